"""
The run's checkpoints as train.py's loop sees them (Checkpoints), the record each carries, the
checks a resume makes, an SFT run's start from a base's weights, and load_model for sample.py and
export.py. The folders themselves are podgpt/core/checkpoint.py's.
"""
import json
import os
import time
from dataclasses import asdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

from model import RUNTIME_FIELDS
from podgpt.core import checkpoint  # its functions called through it: a test may replace one
from podgpt.core.data import tokenizer_fingerprint
from podgpt.core.optim import MasterAdamW
from podgpt.core.tokenizer import with_chat_tokens
from podgpt.core.util import CutShortThread, disk_full, fail, first_line, log, warn
from podgpt.pod.gates import base_checkpoint, same_place
from podgpt.pod.objectives import make_config, make_model
from podgpt.pod.report import read_json


def load_model(ckpt, device="cpu", verify=True):
    """(model in eval mode, config dict) from a checkpoint folder, verified unless
    checkpoint.reading() did; ValueError saying what is wrong."""
    if verify:
        checkpoint.verify_checkpoint(ckpt)
    try:
        with open(os.path.join(ckpt, "config.json")) as f:
            config = json.load(f)
        # trained elsewhere: this machine's kernel
        model = make_model(make_config(**dict(config["model"], attn_backend="auto")))
    except (OSError, ValueError, KeyError, TypeError) as e:  # a field unknown here, or missing
        raise ValueError(f"config.json does not describe a model this model.py builds "
                         f"({first_line(e)})") from None
    state_dir = os.path.join(ckpt, checkpoint.STATE_DIR)
    if os.path.isdir(state_dir):  # fsdp's: DCP gathers it whole
        state = {"model": model.state_dict()}
        checkpoint.load_sharded(state, state_dir)
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(torch.load(os.path.join(ckpt, "model.pt"), map_location=device,
                                         weights_only=True))
    return model.to(device).eval(), config


def new_state(cfg):
    """The loop's state at the start: all of it goes into every checkpoint."""
    return SimpleNamespace(step=0, samples=0, elapsed=0.0, cost_usd=cfg.usd_fixed,
                           best_val_loss=float("inf"),
                           best_step=-1, evals_since_best=0, loss_ema=None, spikes=0,
                           nonfinite_steps=0, bad_in_a_row=0, rollbacks=0, lr_scale=1.0,
                           injected=[], order_broken=0, horizon=cfg.max_steps,
                           horizon_by="max_steps", decay_start=-1, decay_lr=None)


def run_record(cfg, mconfig, world, grad_accum, manifest):
    """(config.json's dict, {file: bytes}): what every checkpoint carries besides the weights, so
    that the folder is enough to sample from."""
    # padded_vocab follows from vocab_size and multiple_of only rounded ffn_hidden: a checkpoint
    # from before multiple_of has the same record, and export meets no unknown field
    model = {k: v for k, v in asdict(mconfig).items() if k not in ("padded_vocab", "multiple_of")}
    saved = dict(cfg, model=model, world_size=world, grad_accum=grad_accum,
                 data_fingerprint=manifest["fingerprint"],
                 tokenizer_fingerprint=tokenizer_fingerprint(cfg.data_dir, manifest))
    if cfg.init_from:  # the base's tokens, folder and data_dir: its gates on a resume without it
        saved["base"] = base_checkpoint(cfg)
    files = {"config.json": json.dumps(saved, indent=1).encode()}
    for f in manifest["tokenizer_files"]:
        with open(os.path.join(cfg.data_dir, f), "rb") as fh:
            files[f] = fh.read()
    return saved, files


# what a folder holds that is no run, by a file its maker writes (the first that is there)
NOT_A_RUN = (("recipe.json", "a hand-off bundle (handoff.py's)"),
             ("model.safetensors", "an export (export.py's)"),
             ("model.safetensors.index.json", "an export (export.py's)"),
             ("eval.jsonl", "a skills pack (skills.py's)"),
             ("manifest.json", "a data_dir (prepare.py's)"))


def what_is(folder, out_dir):
    """What init_from=folder, which holds no checkpoint, is instead."""
    if same_place(folder, out_dir):
        return "this run's own out_dir"
    if not os.path.exists(folder):
        return "nothing: no such file or folder"
    if not os.path.isdir(folder):
        return "a file"
    return next((kind for name, kind in NOT_A_RUN if os.path.isfile(os.path.join(folder, name))),
                "a folder with neither complete.json nor ckpt/step_NNNNNNN in it")


def own_checkpoints(out_dir):
    """This run's newest checkpoint folder (ckpt/latest's, else the newest), or None."""
    root = os.path.join(out_dir, "ckpt")
    names = checkpoint.step_folders(root) if os.path.isdir(root) else []
    return (checkpoint.find_checkpoint(out_dir) or os.path.join(root, names[0])) if names else None


def check_init_from(cfg):
    """Before the gates: stop with one line when init_from names no checkpoint and this run has none
    of its own to resume, or when its own were fine-tuned from another base (a resume needs no base:
    its weights are in its checkpoints)."""
    own = own_checkpoints(cfg.out_dir) if cfg.init_from and cfg.resume == "auto" else None
    record = read_json(os.path.join(own, "config.json")) if own else None
    if isinstance(record, dict):  # an unreadable one: the resume says so
        check_provenance(own, record, cfg.init_from)
    if not cfg.init_from or own is not None or cfg.resume not in ("auto", "never"):
        return  # resume= a folder: check_compatible compares its init_from
    src, root = checkpoint.find_checkpoint(cfg.init_from), os.path.join(cfg.init_from, "ckpt")
    if not (src and os.path.isdir(src)) and not (
            os.path.isdir(root) and checkpoint.step_folders(root)):
        fail(f"init_from={cfg.init_from} holds no checkpoint: it is "
             f"{what_is(cfg.init_from, cfg.out_dir)}; give the base run's out_dir or one of its "
             f"ckpt/step_NNNNNNN folders")


def check_provenance(path, old, init_from):
    """Stop with one line when checkpoint `path` (config.json: old) was fine-tuned from another base
    than init_from, or from none: the run's record would name a base its weights never saw."""
    recorded = old.get("init_from") or ""
    if not same_place(recorded, init_from):
        fix = f"--init_from={recorded}" if recorded else "no --init_from"
        fail(f"checkpoint {path} records init_from={recorded or '(none)'}, and this resume gives "
             f"init_from={init_from or '(none)'}: resume with {fix} (the recorded value), or use a "
             f"new out_dir to fine-tune from {init_from or 'no base'}")


def check_compatible(path, old, new, allow_mismatch, data_dir):
    """Stop with one line when checkpoint `path` (config.json: old) cannot continue this run (new):
    another model shape or base (init_from) always; another tokenizer or other data unless
    allow_mismatch."""
    shape = {k: v for k, v in new["model"].items() if k not in RUNTIME_FIELDS}  # the rest may vary
    diff = ", ".join(f"{k} {old['model'].get(k)} -> {v}" for k, v in shape.items()
                     if old["model"].get(k) != v)
    if diff:
        fail(f"checkpoint {path} has another model shape ({diff}): use a new out_dir, or the "
             f"checkpoint's shape")
    check_provenance(path, old, new.get("init_from") or "")
    trained_with = old.get("optimizer", "adamw")  # checkpoints from before optimizer=muon
    if trained_with != new["optimizer"]:
        fail(f"checkpoint {path} holds optimizer={trained_with}'s state, which "
             f"optimizer={new['optimizer']} cannot continue: resume with "
             f"--optimizer={trained_with}, or use a new out_dir")
    if old["tokenizer_fingerprint"] != new["tokenizer_fingerprint"] and not allow_mismatch:
        fail(f"checkpoint {path} was trained with another tokenizer "
             f"({old['tokenizer_fingerprint']}) than {data_dir} ({new['tokenizer_fingerprint']}): "
             f"point data_dir at its data, or --allow_resume_mismatch=True")
    if old["data_fingerprint"] != new["data_fingerprint"] and not allow_mismatch:
        fail(f"checkpoint {path} was trained on other data than {data_dir} (manifest fingerprint "
             f"differs): point data_dir at its data, or --allow_resume_mismatch=True to continue "
             f"on this data")


def same_base_vocabulary(base, data_dir):
    """Whether data_dir's tokenizer is checkpoint folder `base`'s, chat tokens aside."""
    def tokenizer_files(folder):
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            meta = with_chat_tokens(json.load(f))
        ranks = os.path.join(folder, "tokenizer.tiktoken")
        return meta, open(ranks, "rb").read() if os.path.exists(ranks) else None

    try:
        return tokenizer_files(base) == tokenizer_files(data_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def grown_state(base, model, base_vocab):
    """The base's state dict for `model`, where the rows past base_vocab keep `model`'s init."""
    state = {}
    for name, new in model.state_dict().items():
        old = base[name]
        if old.shape != new.shape:
            new = new.full_tensor() if hasattr(new, "full_tensor") else new  # fsdp's DTensor
            old = torch.cat([old[:base_vocab], new[base_vocab:].to(old.device, old.dtype)])
        state[name] = old
    return state


def start_from(model, sharded, src, config, data_dir):
    """Load the weights of base checkpoint `src` (a checkpoint folder or an out_dir) into a fresh
    run's model (config: its config.json) of the same shape, its vocabulary maybe grown by the chat
    tokens; the optimizer, the schedule and the step start anew. Returns the weights loaded."""
    try:
        with checkpoint.reading(src) as path:
            base, base_config = load_model(path, verify=False)
            same_vocabulary = same_base_vocabulary(path, data_dir)
    except ValueError as e:
        fail(f"init_from={src}: {e}: give the base model's checkpoint folder or out_dir")
    if not same_vocabulary:  # first: another tokenizer's data makes another vocabulary size too
        fail(f"init_from={src} was trained with another tokenizer than {data_dir}'s: prepare the "
             f"SFT data with python prepare.py --chat=True --chat_base={path}")
    old, new = base_config["model"], config["model"]
    diff = [f"{k} {old.get(k)} -> {v}" for k, v in new.items()
            if k not in RUNTIME_FIELDS + ("vocab_size",) and old.get(k) != v]
    if diff or old["vocab_size"] > new["vocab_size"]:
        fail(f"init_from={src} has another model shape ({', '.join(diff) or 'a larger vocabulary'})"
             f": give this run the base model's shape")
    state = grown_state(base.state_dict(), model, old["vocab_size"])
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state)
    log(f"init_from: the weights of {path} (vocabulary {old['vocab_size']} -> "
        f"{new['vocab_size']}); a new optimizer state and schedule, from step 0")
    return state


# -----------------------------------------------------------------------------
# the run's checkpoints, as train.py's loop sees them

class Checkpoints:
    """out_dir/ckpt of one run: when a save is due, the model and optimizer it saves (with `files`:
    config.json, the tokenizer) and restores. sharded: the model is FSDP2's; background: each save
    written in a thread (the loop waits only for the copy into CPU memory)."""

    def __init__(self, out_dir, model, optimizer, proc, sharded, files, every, keep_last, save_best,
                 min_free_gb, background=True, every_minutes=0.0):
        self.root = os.path.join(out_dir, "ckpt")
        self.model, self.optimizer, self.proc, self.sharded = model, optimizer, proc, sharded
        self.files, self.every, self.keep_last = files, every, keep_last
        self.save_best, self.min_free_gb = save_best, min_free_gb
        self.every_s, self.t_saved = every_minutes * 60, time.time()  # 0: no save by the clock
        self.pending = False  # a periodic save owed, held back while bad steps run in a row
        self.saved_step = self.on_disk = -1  # the newest save's step; the newest known on disk
        # why the saves since the newest on disk missed it: checkpoint.SKIPPED while each was
        # skipped for min_free_gb, checkpoint.FAILED once one failed; None: none missed
        self.missed = None
        # the ranks that write each save: fsdp's all; ddp's those of rank 0's node, which see the
        # out_dir it writes (torchrun numbers node 0's ranks first); muon's MuonAdamW: rank 0 alone
        self.writers = proc.world if sharded else 1
        if not sharded and isinstance(optimizer, torch.optim.Optimizer):
            self.writers = min(proc.world, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.shared = self.writers > 1  # every writer writes its part of each save
        self.staging = checkpoint.Staging(proc.dev) if background else None
        self.reserved = False  # the staging buffers allocated, once the optimizer has state
        # the writers' background writes agree (DCP's plan, the shards' checksums) while the loop's
        # collectives run: on a gloo group of their own, which works on CPU tensors
        self.group = dist.new_group(range(self.writers), backend="gloo") if (
            sharded or self.shared) and (background or self.writers < proc.world) else None
        self.writer = None  # this rank's save being written in the background
        self.in_flight = False  # a save started that the ranks have not all waited for yet
        self.records = []  # saves on disk that finished() has not handed out yet

    def newest(self):
        """(path, loaded checkpoint) of the newest one that reads back intact, or (None, None)."""
        self.wait()  # the save in flight may be that one
        return checkpoint.newest_good_checkpoint(self.root, self.proc.dev)

    def resume(self, resume, config, allow_mismatch, data_dir, state, init_from=""):
        """Restore the model, optimizer and the loop's `state` from the checkpoint resume= names
        (auto: the newest good one, if any; never: none; or a folder) when it fits `config`; the
        folder resumed from, or None (then init_from's weights, if given: start_from)."""
        earlier = os.path.isdir(self.root) and bool(checkpoint.step_folders(self.root))
        ckpt = None
        if resume == "never" and earlier:  # its checkpoints and ckpt/best would mix with this run's
            fail(f"resume=never but {self.root} holds checkpoints of an earlier run: use a new "
                 f"out_dir, or move them away")
        elif resume == "auto":
            path, ckpt = self.newest()
            if ckpt is None and earlier:
                fail(f"no checkpoint in {self.root} reads back intact (see the warnings): move "
                     f"them away to start over, or give resume= a checkpoint folder")
        elif resume != "never":
            path = checkpoint.find_checkpoint(resume)
            if path is None:
                fail(f"resume={resume}: no checkpoint there (give a checkpoint folder or an "
                     f"out_dir with ckpt/latest)")
            try:
                ckpt = checkpoint.load_checkpoint(path, self.proc.dev)
            except ValueError as e:
                fail(f"checkpoint {path} is damaged: {e}: give another checkpoint folder or "
                     f"--resume=auto")
        if ckpt is None:
            if init_from:
                weights = start_from(self.model, self.sharded, init_from, config, data_dir)
                if isinstance(self.optimizer, MasterAdamW):
                    self.optimizer.load_masters(weights)
            return None
        check_compatible(path, ckpt["config"], config, allow_mismatch, data_dir)
        self.restore(ckpt, state)
        return path

    def state_dicts(self):
        """Model and optimizer as DCP saves and loads them: by name, sharded under fsdp."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # see model.shard_model
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return dict(model=self.weights(model), optimizer=optimizer)

    def weights(self, model):
        """The weights a checkpoint holds: master_weights' fp32 masters, not the bf16 parameters."""
        return self.optimizer.masters(model) if isinstance(self.optimizer, MasterAdamW) else model

    def restore(self, ckpt, state):
        """Model, optimizer, the loop's state and this rank's RNGs from a loaded checkpoint,
        whichever mode and world size wrote it; the step restored is on disk: no save is owed."""
        model, optimizer, proc = self.model, self.optimizer, self.proc
        if "state" in ckpt:  # sharded: DCP reads each rank's part, resharded to this world
            from torch.distributed.checkpoint.state_dict import set_state_dict
            sd = self.state_dicts()
            checkpoint.load_sharded(sd, ckpt["state"])
            set_state_dict(model, optimizer, model_state_dict=sd["model"],
                           optim_state_dict=sd["optimizer"])
            weights = sd["model"]  # master_weights: the masters themselves, loaded in place
        elif self.sharded:  # a ddp checkpoint: every rank holds it whole and keeps its shard
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, set_model_state_dict, set_optimizer_state_dict)
            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, ckpt["model"], options=full)
            by_name = checkpoint.optimizer_by_name(model, optimizer, ckpt["optimizer"])
            set_optimizer_state_dict(model, optimizer, by_name, options=full)
        else:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            weights = ckpt["model"]
        if isinstance(optimizer, MasterAdamW):
            optimizer.load_masters(weights)
        trainer = ckpt["trainer"]
        for key in vars(state):  # a field the loop gained since keeps its start value
            setattr(state, key, trainer.get(key, getattr(state, key)))
        if len(trainer["rng"]) == proc.world:
            checkpoint.set_rng_state(trainer["rng"][proc.rank])
        else:  # training uses no randomness; only the per-rank RNGs restart
            warn(f"world size {len(trainer['rng'])} -> {proc.world}: same batches, per-rank RNG "
                 f"states re-seeded")
        self.pending, self.saved_step, self.on_disk = False, state.step, state.step

    def time_due(self):
        """Whether every_minutes have passed since the last save; one rank's answer is `timed`."""
        return bool(self.every_s) and time.time() - self.t_saved >= self.every_s

    def due(self, step, last_step, new_best, stopping, bad_in_a_row, timed=False):
        """Whether to save now: every `every` steps, when `timed` and at the last step, but not
        while bad steps run in a row (a rollback never lands in them); at a new best; on a stop."""
        self.pending |= step % self.every == 0 or step == last_step or timed
        return (self.pending and bad_in_a_row == 0) or (new_best and self.save_best) or stopping

    def save(self, trainer, best):
        """Save the step with every rank's RNG state and `trainer` (the loop's state), after the
        save in flight; once copied into CPU memory, written in the background if `background`."""
        t0 = self.t_saved = time.time()
        proc = self.proc
        self.wait()
        t1 = time.time()  # this save's own time starts
        states = [checkpoint.rng_state()]
        if proc.distributed:
            states = [None] * proc.world
            dist.all_gather_object(states, checkpoint.rng_state())
        files, sharded = self.tensors()
        if proc.rank == 0:
            files = dict(self.files, **files, **{"trainer.pt": dict(
                trainer, format=checkpoint.CKPT_FORMAT, rng=states, world_size=proc.world)})
        step = trainer["step"]
        if proc.rank < self.writers:
            if self.staging:
                files, sharded = self.staging.copy((files, sharded))
                blocked = time.time() - t0
                self.writer = CutShortThread(
                    lambda: self.write(step, best, files, sharded, t1, t1 - t0, blocked),
                    "checkpoint-writer")
            else:
                self.report(self.write(step, best, files, sharded, t1, t1 - t0, None))
        self.in_flight = True
        self.pending, self.saved_step = False, step
        if not self.staging:
            self.wait()

    def tensors(self):
        """(rank 0's model.pt and optimizer.pt or {}, the state dicts this rank's DCP writes)."""
        if self.sharded:
            return {}, self.state_dicts()
        if self.shared and self.proc.rank < self.writers:
            return {}, checkpoint.share_of(self.state_dicts(), self.proc.rank, self.writers)
        if self.proc.rank == 0:
            return {"model.pt": self.weights(self.model.state_dict()),
                    "optimizer.pt": self.optimizer.state_dict()}, None
        return {}, None

    def write(self, step, best, files, sharded, t1, waited, blocked):
        """Write what save() prepared: its record, {step, missed} when the disk did not take it.
        blocked: the seconds the loop waited for it (None: all of it)."""
        path, missed = checkpoint.save_checkpoint(self.root, step, files, self.keep_last, best,
                                                  self.min_free_gb, sharded, self.group)
        if missed:
            return dict(step=step, missed=missed)
        written = time.time() - t1
        return dict(step=step, path=path, gb=checkpoint.checkpoint_bytes(path) / 1e9,
                    blocked_s=waited + written if blocked is None else blocked, waited_s=waited,
                    written_s=written)

    @property
    def writing(self):  # this rank has a save being written in the background
        return self.writer is not None

    def poll(self):
        """Report the background save if its write has ended (raising what it raised); never
        waits. Once the optimizer has state, the staging buffers are allocated."""
        if self.staging is not None and not self.reserved and checkpoint.tensor_bytes(
                self.optimizer.state_dict()):
            self.reserved = True
            self.staging.reserve(self.tensors())
        if self.writer is not None and not self.writer.is_alive():
            self.collect()

    def wait(self):
        """Wait for the save in flight on every rank: then it is on disk (or given up, with a
        warning) and reported. The next save, a rollback and the run's end call this first."""
        if self.writer is not None:
            self.collect()
        if self.in_flight and self.proc.distributed:
            dist.barrier()  # ddp: rank 0 wrote it, the other ranks wait for it here
        self.in_flight = False

    def collect(self):
        writer, self.writer = self.writer, None
        self.report(writer.result())  # raises what the write raised

    def report(self, r):
        """Say on the loop's thread (a line from the writer's could land inside a step's) how long
        save record r took, and warn when it would not fit a preemption's window."""
        if "missed" in r:  # the disk did not take it: a warning said so
            self.missed = checkpoint.FAILED if checkpoint.FAILED in (self.missed, r["missed"]) \
                else r["missed"]
            return
        waited = (f", {r['waited_s']:.2f}s of it waiting for the save before"
                  if r["waited_s"] >= 0.01 else "")
        log(f"checkpoint {r['path']} (blocked {r['blocked_s']:.2f}s{waited}, written in "
            f"{r['written_s']:.2f}s)", flush=True)
        if r["written_s"] > checkpoint.PREEMPT_SAVE_SECONDS:
            shared = self.shared or isinstance(self.optimizer, torch.optim.Optimizer)
            warn(f"the step {r['step']} checkpoint: " + checkpoint.too_slow_for_preemption(
                r["gb"], r["written_s"], shared, self.proc.world))
        self.records.append(r)
        self.on_disk, self.missed = r["step"], None

    def finished(self):
        """The records {step, path, gb, blocked_s, waited_s, written_s} of the saves that reached
        the disk since the last call; never waits."""
        self.poll()
        records, self.records = self.records, []
        return records

    def unsaved(self, step, reason):
        """Why a run that stops at `step` ends without its model on disk, or None (every stop saves
        its step, but one over budget_file, which saves nothing and needs an earlier checkpoint)."""
        if self.on_disk == step or (reason == "budget_file_spent" and self.on_disk >= 0):
            return None
        if self.missed == checkpoint.SKIPPED:  # the disk had room: ckpt_min_free_gb kept them off
            why = f"were skipped to keep ckpt_min_free_gb={self.min_free_gb} GB free"
            fix = f"lower ckpt_min_free_gb (or free disk space for {self.root})"
        else:
            why, fix = "failed", f"free disk space for {self.root}"
        if self.on_disk < 0:
            return (f"the run ended at step {step} with no checkpoint on disk (the saves {why}: "
                    f"see the warnings): {fix}, then run the same command again (it starts over)")
        return (f"the run ended at step {step} but its newest checkpoint is step {self.on_disk} "
                f"(the saves after it {why}: see the warnings): {fix}, then run the same "
                f"command again: it resumes from step {self.on_disk}")

    def unwritten(self, step, path, e):
        """Where a run that ended at `step` stands when the disk refused its file `path` (OSError e)
        after the saves."""
        folder, on_disk = os.path.dirname(path), self.on_disk
        saved = ("with no checkpoint on disk" if on_disk < 0 else
                 "with its checkpoint on disk" if on_disk == step else
                 f"with its newest checkpoint on disk at step {on_disk}")
        fix = f"free disk space for {folder}" if disk_full(e) else f"check {folder}'s disk"
        return (f"the run ended at step {step} {saved}, but {path} could not be written "
                f"({first_line(e)}): {fix}, then run the same command again: "
                + (f"it resumes from step {on_disk}" if on_disk >= 0 else "it starts over"))
