"""
Train a GPT on the shards that prepare.py writes: one process (CPU or one GPU), or under torchrun (gloo on
CPU, nccl on CUDA), data-parallel (dist_mode=ddp) or sharded by FSDP2 (dist_mode=fsdp, for models DDP cannot fit).

    python train.py config/tiny.py
    python train.py config/a100_50m.py --max_steps=500 --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/h200_1b_ddp8.py
    torchrun --standalone --nproc_per_node=8 train.py config/h100_d64.py      # fsdp

Config: the globals between the config markers below, overridden by config files and --key=val
(configurator.py; --help lists them). A run writes into out_dir only (docs/long-runs.md lists its files).
The batch of optimizer step s is the same set of sequences whatever the number of GPUs or the micro-batch
(data.Loader), so the same command again resumes bit-identically from the newest complete checkpoint, at any
world size; a preemption signal, max_hours or a budget guard stops every rank at one step boundary, with a
checkpoint; bad steps are skipped, then rolled back.

optimizer=muon is nanochat's split: Muon for the blocks' matrices, AdamW for the rest. An objective beyond
next-token prediction is a module of podgpt/research/ (its keys: --help): train.py logs the numbers it returns.
"""
import os
import random
import sys
import time
from collections import deque
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import float8_linears, fp8_unavailable, shard_model
from podgpt.core import configurator
from podgpt.core.attention import resolve_backend
from podgpt.core.checkpoint import find_checkpoint, tensor_bytes
from podgpt.core.data import (Loader, bpb_scale, check_prepared, load_manifest, rare_token_batch, rarest_tokens,
                              unigram_baseline)
from podgpt.core.optim import check_optimizer, make_optimizer
from podgpt.core.schedule import Budget, Schedule
from podgpt.core.tokenizer import check_tokenizer_loads, load_tokenizer
from podgpt.core.util import (MAKE_ROOM, Folder, autocast, catch_signals, check_apart, compute_dtype, disk_full,
                              dtype_name, fail, first_line, format_seconds, log, on_rank0, peak_memory_gb, remove,
                              run_main, setup, warn, write_json)
from podgpt.corpus.tasks import gsm8k_accuracy, gsm8k_problems
from podgpt.pod.checkpoints import Checkpoints, run_record
from podgpt.pod.dryrun import dryrun
from podgpt.pod.gates import long_run_gate
from podgpt.pod.guards import LOSS_EMA_DECAY, STOP_REASONS, BadSteps, Clock, Drills, restore_clock
from podgpt.pod.objectives import make_model, objective as research_objective
from podgpt.pod.postmortem import POSTMORTEM_STEPS, PostMortem, bad_batch
from podgpt.pod.preflight import (check_gate_settings, finish_preflight, flops_per_token, model_config, param_counts,
                                  peak_flops, plan_run, start_horizon, target_band, write_preflight)
from podgpt.pod.report import MetricsFile, outcome, target_verdict, write_report
from podgpt.pod.trackers import Trackers, tracker_names

# --- config
# I/O
out_dir = "out"                 # metrics.jsonl, ckpt/, summary.json are written here
data_dir = "data/default"       # shards and manifest.json written by prepare.py
resume = "auto"                 # auto: newest good checkpoint in out_dir, if any | never | a checkpoint folder
allow_resume_mismatch = False   # resume even from a checkpoint trained on other data or another tokenizer
init_from = ""                  # SFT: a fresh out_dir starts from this base checkpoint's weights (folder or out_dir)
# model
block_size = 1024               # context length in tokens
n_layer = 12                    # transformer blocks
n_head = 12                     # query heads
n_kv_head = 12                  # key/value heads; fewer than n_head is grouped-query attention
n_embd = 768                    # model width
ffn_hidden = None               # SwiGLU hidden size; None: floor(8 * n_embd / 3) rounded up to multiple_of
multiple_of = 256               # Llama's rounding of that default, for whole tensor-core tiles (1: none)
vocab_size = None               # None: the data's vocabulary (manifest.json); a number must match it
tie_embeddings = True           # share the input embedding with the output head
rope_theta = 10000.0            # RoPE base
vocab_multiple = 64             # pad the vocabulary to a multiple of this (faster matmuls)
init_std = 0.02                 # std of the normal init (residual projections scaled by 1/sqrt(2*n_layer))
objective = "ar"                # ar: next-token prediction | a module of podgpt/research/ (its keys follow this list)
eval_gsm8k_samples = 0          # gsm8k data: answer this many test problems (greedy) at each evaluation, log the accuracy
# speed and memory: none of these changes what a step computes, beyond rounding (a run may resume with others)
attn_backend = "auto"           # auto (fastest that passes a parity check here) | fa3 | fa2 | cudnn | flash | efficient | flex | math | sdpa | fa4 (never auto's pick)
doc_mask = False                # attention stays inside each document (BOS boundaries); this one does change the model
grad_ckpt = "none"              # activation checkpointing: none | full (each block keeps only its input) | selective
loss_chunk = 8192               # tokens per chunk of the cross-entropy: fp32 logits never exist for the whole batch; 0: off
# batch
micro_batch_size = 8            # sequences per GPU per forward/backward
total_batch_tokens = 524288     # tokens per optimizer step over all GPUs; grad accumulation is derived from it
max_steps = 1000                # optimizer steps, at most: budget_usd and max_hours may end the schedule sooner (fit_budget)
# AdamW and schedule: linear warmup, then cosine (or wsd) from learning_rate down to min_lr at the horizon
optimizer = "adamw"             # adamw | muon: Muon for the blocks' 2-D matrices, AdamW for the rest (nanochat's split)
learning_rate = 3e-4            # peak learning rate; muon: the schedule's scale, each group runs at lr x its own peak / this
min_lr = 3e-5                   # final learning rate
warmup_steps = 100              # linear warmup steps
lr_schedule = "cosine"          # cosine: to min_lr at the horizon | wsd: flat, then linear to min_lr over its last decay_frac
decay_frac = 0.2                # wsd: the decay's share of the horizon; it starts sooner when the money or hours left cover
                                # just the decay at the speed measured so far
matrix_lr = 0.02                # muon: Muon's peak learning rate for the blocks' matrices (nanochat's default)
embedding_lr = 4e-3             # muon: AdamW's peak for the embedding, untied head and norms (nanochat's head LR at width 768)
muon_momentum = 0.95            # muon: Muon's Nesterov momentum (torch's default; nanochat's after a 0.85 -> 0.95 warmup)
weight_decay = 0.1              # AdamW's, on matrices only, never on norms or embeddings (muon: only an untied head)
beta1 = 0.9                     # AdamW beta1
beta2 = 0.95                    # AdamW beta2
grad_clip = 1.0                 # clip the global gradient norm to this; 0 disables
# evaluation, logging, checkpoints
eval_every = 250                # steps between validation evaluations (and one at the end)
eval_steps = 20                 # validation micro-batches per rank per evaluation
log_every = 10                  # steps between metrics.jsonl lines and console lines
ckpt_every = 1000               # steps between checkpoints (and one at the end)
ckpt_every_minutes = 0.0        # also a checkpoint when this many minutes passed since the last one (or the start); 0: off
keep_last = 3                   # newest checkpoints kept (at least 1), besides the best one
save_best = True                # also checkpoint at every new best validation loss (ckpt/best; never rotated away)
plots = True                    # draw plots/*.png into the run report at every evaluation and at the end
early_stop_patience = 0         # stop after this many evaluations without a new best validation loss; 0: never
target_val_loss = None          # what the run is for: a final val loss at most this, or within "lo,hi" (e.g. "3.20,3.50")
ckpt_min_free_gb = 1.0          # skip a checkpoint, with a warning, that would leave less disk free than this
ckpt_async = True               # write checkpoints in the background: the loop waits only for a copy into CPU memory
# watching a run: every metrics line mirrored, as it is written, from rank 0 (report.py: Trackers)
log_to = ""                     # trackers, comma-separated: tensorboard (out_dir/tensorboard) | wandb | mlflow; "": none
run_name = ""                   # the run's name in the trackers; "": out_dir
run_tags = ""                   # the run's tags in the trackers, comma-separated
wandb_project = "podgpt"        # Weights & Biases project (WANDB_API_KEY or `wandb login`; WANDB_MODE=offline)
mlflow_experiment = "podgpt"    # MLflow experiment, at MLFLOW_TRACKING_URI (unset: mlflow 3's default, ./mlflow.db)
verbose = False                 # print the long notes too (the attention kernels skipped and why), not just in out_dir
# guards: each stops the run before its limit is crossed (checkpoint, summary.json, exit 0)
max_hours = 0.0                 # wall-clock limit, resumed time included; 0: none
budget_usd = 0.0                # spending cap in dollars; 0: none
usd_per_gpu_hour = 0.0          # price of one GPU-hour; spend = wall clock x GPUs x this
budget_file = ""                # JSON kept current from outside, {"spent_usd": .., "projected_total_usd": ..}, checked against budget_usd
budget_check_minutes = 30.0     # how often budget_file is read
fit_budget = True               # the horizon is what budget_usd and max_hours pay for, at preflight's throughput; False:
                                # a plan they cannot finish is a block
# loss spikes and non-finite steps
spike_factor = 2.5              # a step whose loss exceeds this x the EMA of recent losses is a spike (logged, counted)
max_bad_steps = 10              # spikes or non-finite steps in a row before rolling back to the last checkpoint at lr x 0.5
max_rollbacks = 3               # rollbacks allowed before the run stops as diverged
inject_spike_at_step = -1       # fire drill: the steps logged as N..N+4 train on batches of the rarest tokens; -1: off
inject_nan_at_step = -1         # fire drill: the steps logged as N..N+4 get a NaN loss on the last rank; -1: off
inject_slow_at_step = -1        # fire drill: from this step on every step sleeps inject_slow_seconds (a slower pod); -1: off
inject_slow_seconds = 0.0       # the sleep of inject_slow_at_step
stop_at_step = 0                # stop (checkpoint, exit 0) after this step, the schedule still max_steps' (a spike
                                # post-mortem's replay command sets it); 0: off
# preflight: gates checked before any step is paid for (out_dir/preflight.json and .md)
preflight_only = False          # write the preflight report and exit: 1 if a gate blocks, else 0
dryrun_steps = 0                # dry run: N steps into out_dir/first, then N/2+1..N again from its step-N/2
                                # checkpoint into out_dir/resumed; dryrun.json; exit 1 if anything is off
gate_profile = "research"       # research | release | skill_release: what the gates demand (gates.PROFILES)
pack_dir = ""                   # the skills pack the run is judged with (its SFT rows, eval rows, contamination)
allow_unsafe = False            # train even when a gate blocks (each block becomes a warning)
max_epochs = 0                  # corpus_model_fit blocks above this many passes over the training tokens; 0: the profile's
lr_base = 0.0                   # lr_scaling warns when learning_rate is far from lr_base x sqrt(batch / lr_base_batch); 0: off
lr_base_batch = 128             # sequences per optimizer step at which lr_base was tuned (e.g. 3e-4 at 128)
expect_world_size = 0           # ranks this config is written for; 0: any
gpu_mem_gb = 0.0                # GPU memory to plan with; 0: the GPU in use (no memory gate on CPU)
plan_gpu = ""                   # GPU to plan time with when not on it, e.g. "H100 PCIe"; "": the one in use
planned_mfu = 0.0               # plan time and cost at this fraction of plan_gpu's bf16 peak
planned_tokens_per_sec = 0.0    # or at this throughput; both 0: measured by a few timed steps here
plan_vocab_size = 0             # vocabulary to plan with before data_dir is prepared
# parallelism under torchrun (fsdp also runs as one process)
dist_mode = "ddp"               # ddp: each GPU holds the whole model and AdamW state | fsdp: FSDP2 shards them over the GPUs
# system
seed = 1337                     # model init and data order
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N (one process)
dtype = "auto"                  # auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32
compile = False                 # torch.compile the model
compile_mode = "default"        # torch.compile mode: default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
fp8 = False                     # float8 matmuls in the linear layers (torchao): a GPU of compute capability 8.9+, compile, bfloat16
matmul_precision = "high"       # CUDA fp32 matmuls: high lets them use TF32 tensor cores | highest: true fp32
# --- end config

# a torchrun worker keeps its wrapped model until os._exit (util.exit_worker): freeing DDP's reducer or FSDP's
# groups after the process group is gone joins a gloo thread that can wait forever for the interpreter lock
LIVE_MODELS = []


def check_config(cfg):
    """Refuse settings that cannot work, before anything is read or written."""
    for key, example in (("out_dir", "out"), ("data_dir", "data/default")):
        if not cfg[key]:
            fail(f"{key} is empty: name a folder (e.g. --{key}={example})")
    check_apart(out_dir=cfg.out_dir, data_dir=cfg.data_dir)
    tracker_names(cfg.log_to)
    for key in ("block_size", "n_layer", "micro_batch_size", "total_batch_tokens", "max_steps", "learning_rate",
                "eval_every", "eval_steps", "log_every", "ckpt_every", "keep_last", "max_bad_steps",
                "budget_check_minutes", "lr_base_batch"):
        if cfg[key] <= 0:
            fail(f"{key}={cfg[key]} must be positive")
    for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "max_rollbacks", "early_stop_patience",
                "max_hours", "budget_usd", "usd_per_gpu_hour", "ckpt_min_free_gb", "max_epochs", "lr_base",
                "eval_gsm8k_samples", "ckpt_every_minutes", "stop_at_step"):
        if cfg[key] < 0:
            fail(f"{key}={cfg[key]} must be >= 0")
    for key, choices in (("compile_mode", ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
                         ("matmul_precision", ("highest", "high", "medium")), ("dist_mode", ("ddp", "fsdp")),
                         ("optimizer", ("adamw", "muon")), ("lr_schedule", ("cosine", "wsd"))):
        if cfg[key] not in choices:
            fail(f"{key}={cfg[key]!r} is not one of {', '.join(choices)}")
    check_gate_settings(cfg)
    check_optimizer(cfg)
    if cfg.spike_factor <= 1:
        fail(f"spike_factor={cfg.spike_factor} must be above 1 (a spike is a loss this many times the recent average)")
    if cfg.budget_usd and not (cfg.usd_per_gpu_hour or cfg.budget_file):
        fail(f"budget_usd={cfg.budget_usd} needs a way to measure spend: set usd_per_gpu_hour or budget_file")
    if not 0 < cfg.decay_frac <= 1:
        fail(f"decay_frac={cfg.decay_frac} must be in (0, 1]: the decay's share of the horizon")
    if cfg.budget_file and not cfg.budget_usd:
        fail(f"budget_file={cfg.budget_file} needs budget_usd, the cap its spend is checked against")
    if cfg.budget_file and not os.path.isfile(cfg.budget_file):
        fail(f"budget_file {cfg.budget_file} does not exist: start what writes it first, or leave budget_file empty")
    module = research_objective(cfg.objective)
    try:
        if hasattr(module, "check_config"):
            module.check_config(cfg)
    except ValueError as e:
        fail(str(e))


# -----------------------------------------------------------------------------
# the steps of main

def set_up(cfg):
    """(process, compute dtype, gradient accumulation): torchrun's ranks each on its own GPU; fsdp without
    torchrun is a group of one."""
    proc = setup(cfg.device, group=cfg.dist_mode == "fsdp")
    if proc.dev.type == "cuda":
        torch.set_float32_matmul_precision(cfg.matmul_precision)  # not on CPU: it would change fp32 results there
    per_micro = cfg.micro_batch_size * cfg.block_size * proc.world
    if cfg.total_batch_tokens % per_micro:
        fail(f"total_batch_tokens={cfg.total_batch_tokens} is not a multiple of micro_batch_size*block_size*world_size"
             f" = {cfg.micro_batch_size}*{cfg.block_size}*{proc.world} = {per_micro}: use a multiple of {per_micro}")
    return proc, compute_dtype(cfg.dtype, proc.dev), cfg.total_batch_tokens // per_micro


def read_manifest(cfg):
    """The prepared data's manifest, checked; None for a preflight planned before data exists."""
    try:
        manifest = load_manifest(cfg.data_dir)
    except ValueError as e:
        if cfg.preflight_only and not os.path.exists(cfg.data_dir):
            return None
        fail(str(e))
    check_prepared(cfg.data_dir, manifest, cfg.vocab_size)
    check_tokenizer_loads(cfg.data_dir, manifest)  # every checkpoint carries a copy, which sample.py loads
    return manifest


def open_data(cfg, manifest, mconfig):
    """(manifest, train Loader, validation Loader) for the model mconfig; all None before the data exists."""
    if manifest is None:
        return None, None, None
    mconfig.check_data(cfg.data_dir, manifest)
    return manifest, *(Loader(cfg.data_dir, split, manifest, cfg.block_size, cfg.seed, mconfig.draws)
                       for split in ("train", "val"))


def release_gates(pack_dir):
    """The skills pack's release gates (podgpt/release/gates.py) for a run judged with a pack; None without one,
    and pretraining loads nothing of the release path."""
    if not pack_dir:
        return None
    from podgpt.release import gates
    return gates


def build_model(cfg, proc, dt, mconfig):
    """The model on this rank's device (its share of it under fsdp), its attention kernel resolved first
    (before torch.compile traces it) and logged in one short line (verbose: with the kernels auto skipped and
    why, which preflight.md always has). fp8: its linear layers in float8, or one line why that cannot run here.
    The seeds are set first: its init, and every RNG the run uses, start from cfg.seed."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed + proc.rank)
    np.random.seed((cfg.seed + proc.rank) % 2**32)  # numpy's range; the configurator keeps seed in it
    if cfg.fp8 and (why := fp8_unavailable(proc.dev, dt, cfg.compile)):
        fail(why, 2)
    try:
        backend, note = resolve_backend(cfg.attn_backend, proc.dev, dt, mconfig.head_dim, mconfig.mask_kind)
    except ValueError as e:
        fail(str(e))
    log(f"attention: {note}" if cfg.verbose or cfg.attn_backend != "auto" else
        f"attention: {backend} (auto: the first that passes its parity check here; why not the others: "
        f"{os.path.join(cfg.out_dir, 'preflight.md')})")
    model = make_model(mconfig).to(proc.dev)
    if cfg.fp8:  # before FSDP wraps the layers, and before torch.compile traces them
        converted, kept = float8_linears(model)
        log(f"fp8: {len(converted)} linear layers compute in float8 (torchao, tensorwise scales); kept in bfloat16: "
            f"{', '.join(kept[:4])}{f' and {len(kept) - 4} more' if len(kept) > 4 else ''}")
    if cfg.dist_mode == "fsdp":
        shard_model(model, proc.dev, dt)
    return model


def check_writable(cfg, proc, report, folder):
    """out_dir becomes this run's (rank 0 claims it) and takes writes before any step is spent (each rank its own
    probe: they run at once); then rank 0 writes the resolved config and the preflight report into it."""
    on_rank0(proc.distributed, folder.claim)
    probe = os.path.join(cfg.out_dir, f".write-test-{proc.rank}")
    try:
        os.makedirs(os.path.join(cfg.out_dir, "ckpt"), exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        if proc.rank == 0:
            write_json(os.path.join(cfg.out_dir, "config.json"), cfg)
            write_preflight(cfg.out_dir, report)
    except OSError as e:
        fail(f"out_dir {cfg.out_dir} is not writable ({first_line(e)}): " + (
            MAKE_ROOM if disk_full(e) else "choose another out_dir"))
    finally:
        if os.path.isfile(probe):
            remove(probe)
    if proc.distributed:
        dist.barrier()


def out_of_space(path, e, ckpts):
    """Stop, in one line, at a write into out_dir the disk refused: the run resumes from its newest checkpoint."""
    where = f"it resumes from step {ckpts.on_disk}" if ckpts.on_disk >= 0 else "it starts over (no checkpoint yet)"
    fail(f"cannot write {path} ({first_line(e)}): " + (f"{MAKE_ROOM}: {where}" if disk_full(e) else
                                                         "check out_dir's disk"))


def wrap_model(cfg, proc, raw_model):
    """The model as the loop calls it: compiled when compile=True, in DDP under torchrun's ddp."""
    model = torch.compile(raw_model, mode=cfg.compile_mode) if cfg.compile else raw_model
    if proc.distributed and cfg.dist_mode == "ddp":
        model = DDP(model, device_ids=[proc.dev.index] if proc.dev.type == "cuda" else None)
    if proc.distributed:
        LIVE_MODELS.append(model)
    return model


# -----------------------------------------------------------------------------
# the loop

class Trainer:
    """The training loop and what it keeps between steps. Everything a resumed run needs to continue exactly is in
    `state`, which goes into every checkpoint; the rest is the guards' timing (clock) and the run's log."""

    def __init__(self, cfg, proc, dt, grad_accum, data, model, raw_model, optimizer, ckpts, state, stop_signal,
                 t_start):
        self.cfg, self.proc, self.autocast, self.grad_accum = cfg, proc, autocast(proc.dev, dt), grad_accum
        self.manifest, self.train_data, self.val_data = data
        self.model, self.raw_model, self.optimizer, self.ckpts = model, raw_model, optimizer, ckpts
        self.state, self.stop_signal, self.sharded = state, stop_signal, cfg.dist_mode == "fsdp"
        self.scaler = torch.amp.GradScaler(enabled=dt == torch.float16)
        self.schedule = Schedule.of(cfg)
        self.flops_tok = flops_per_token(raw_model.config)
        self.peak = peak_flops(torch.cuda.get_device_name(proc.dev)) if proc.dev.type == "cuda" else None
        self.bpb_scale = bpb_scale(self.manifest["splits"]["val"])
        # until a save is measured, its write: the fsyncs, and weights + AdamW's 2 moments at 200 MB/s
        save_s = 0.5 + 3 * tensor_bytes(raw_model.state_dict()) / 200e6
        self.clock = Clock(state, t_start, Budget.of(cfg), self.schedule, proc.world * cfg.usd_per_gpu_hour / 3600,
                           save_s)
        self.drills = Drills(cfg.inject_spike_at_step, cfg.inject_nan_at_step, cfg.inject_slow_at_step,
                             cfg.inject_slow_seconds)
        self.rare = rarest_tokens(np.load(os.path.join(cfg.data_dir, self.manifest["token_counts"]))) \
            if cfg.inject_spike_at_step >= 0 else None
        self.metrics_path, self.clock_path = (os.path.join(cfg.out_dir, f) for f in ("metrics.jsonl", "clock.json"))
        self.metrics = MetricsFile(self.metrics_path, state.step) if proc.rank == 0 else None
        self.trackers = Trackers(cfg, state.step) if proc.rank == 0 and tracker_names(cfg.log_to) else None
        self.postmortem = PostMortem(cfg, __file__, proc.world, ckpts.root, state.step, LOSS_EMA_DECAY) \
            if proc.rank == 0 else None
        self.bad = BadSteps(cfg.spike_factor, self.event, self.postmortem, self.write_postmortem)
        self.recent = deque(maxlen=POSTMORTEM_STEPS)  # (step, loss, grad norm, lr) of the steps a post-mortem shows
        self.problems = gsm8k_questions(cfg.data_dir, self.manifest, cfg.eval_gsm8k_samples)
        self.t_log, self.step_at_log, self.diverged, self.last_loss = time.time(), state.step, None, None
        self.val_stats = None  # the objective's numbers of the last evaluation (evaluate), if it has any
        self.save_due = False  # the ranks agreed this step that ckpt_every_minutes have passed since the last save

    def loop(self):
        """Train until the horizon (max_steps, or what the budget pays for), a stop (signal, guard, early stop) or
        divergence: (the stop reason, the last validation loss, or None when the last step was not evaluated)."""
        cfg, st, proc = self.cfg, self.state, self.proc
        self.clock.tick()
        reason = self.guard() if proc.rank == 0 else None  # a resumed run may already be past a limit
        if proc.distributed:
            reason = self.agree(torch.zeros(1, device=proc.dev), True, reason)[2]
        if not reason and cfg.stop_at_step and st.step >= cfg.stop_at_step:
            reason = "stop_at_step"
        if reason:
            log(f"not training: {reason} already reached at step {st.step}")
        val_loss = None
        while st.step < st.horizon and not reason:
            reason = self.step()
            if not reason and st.step == cfg.stop_at_step:
                reason = "stop_at_step"
            new_best, val_loss = False, None
            if reason is None and (st.step % cfg.eval_every == 0 or st.step == st.horizon):
                val_loss, new_best = self.validate()
                if cfg.early_stop_patience and st.evals_since_best >= cfg.early_stop_patience:
                    reason = "early_stop"
            if reason == "budget_file_spent":
                break  # already over the cap: not one more byte or second
            # a periodic checkpoint waits for the end of a run of bad steps, so a rollback never lands inside one
            if self.ckpts.due(st.step, st.horizon, new_best, bool(reason), st.bad_in_a_row, self.save_due):
                self.clock.tick()
                self.checkpoint(val_loss, new_best)
            if not reason and st.bad_in_a_row >= cfg.max_bad_steps:
                self.diverged = self.rollback()
                reason = "diverged" if self.diverged else None
            self.saved()  # a background save that has ended: reported (or its error raised) now
        return reason or ("max_steps" if st.horizon >= cfg.max_steps else "horizon"), val_loss

    def step(self):
        """One optimizer step over the step's global batch: the stop reason the ranks agreed on, or None. Before
        it, the learning rate and the fire drills; after the backward, the guards' verdicts, agreed by every rank in
        one all-reduce; after the update, the step's account (wsd's decay, the drills, spikes) and its log line."""
        cfg, proc, st = self.cfg, self.proc, self.state
        t_step = time.time()
        lr, base_lr = self.set_lr()
        spike_drill, nan_drill = self.drills.pick(st)
        loss_sum, stats = self.forward_backward(spike_drill, nan_drill)
        grad_norm, finite = self.clip_gradients(loss_sum)
        self.drills.slow_down(st.step)
        self.clock.tick()
        verdicts = (self.guard(), self.clock.decay_to(self.ckpts.writing), self.ckpts.time_due()) \
            if proc.rank == 0 else (None, 0, False)
        loss, finite, reason, decay_to, self.save_due, stats = self.agree(loss_sum, finite, *verdicts, stats)
        if finite:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        st.step += 1
        st.samples += cfg.total_batch_tokens // cfg.block_size
        self.after_step(loss, finite, grad_norm, lr, base_lr, decay_to, spike_drill, nan_drill)
        self.clock.step_times.append(time.time() - t_step)
        if st.step % cfg.log_every == 0 or st.step == st.horizon:
            self.log_step(loss, lr, grad_norm.item(), stats)
        self.last_loss = loss
        return reason

    def set_lr(self):
        """The step's learning rate, the schedule's times the rollbacks' scale, set in every group: (it, the
        schedule's). optimizer=muon: each group at its own peak_lr, on the schedule's shape."""
        st = self.state
        base_lr = self.schedule.lr(st.step, st.horizon, st.decay_start, st.decay_lr)
        lr = base_lr * st.lr_scale
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["peak_lr"] / self.schedule.learning_rate if "peak_lr" in g else lr
        return lr, base_lr

    def forward_backward(self, spike_drill, nan_drill):
        """This rank's micro-steps of the step, forward and backward: (their summed loss, and the objective's
        summed stats or None)."""
        proc = self.proc
        loss_sum, stats_sum = torch.zeros((), device=proc.dev), None
        batch = self.micro_batch(0, spike_drill)
        # the drill's batches count every target: equal micro-batches, as unmasked data's
        weights = self.target_weights() if self.train_data.masked and not spike_drill else None
        for micro in range(self.grad_accum):
            x, y = batch
            last = micro == self.grad_accum - 1
            # gradients are reduced across ranks once per step, after the last micro-step
            if self.sharded:
                self.raw_model.set_requires_gradient_sync(last)
            with nullcontext() if self.sharded or not proc.distributed or last else self.model.no_sync():
                with self.autocast:
                    # [1:] alone: with loss_chunk=0 a name for the logits would hold them through the backward
                    micro_loss, *stats = self.model(x, y)[1:]
                if nan_drill and proc.rank == proc.world - 1:
                    micro_loss = micro_loss * float("nan")
                if weights is not None:
                    micro_loss = micro_loss * weights[micro]
                self.scaler.scale(micro_loss / self.grad_accum).backward()
            loss_sum += micro_loss.detach()
            if stats:
                stats_sum = stats[0] if stats_sum is None else stats_sum + stats[0]
            if not last:  # read and copy the next one while the GPU still works on this one
                batch = self.micro_batch(micro + 1, spike_drill)
        return loss_sum, stats_sum

    def clip_gradients(self, loss_sum):
        """The gradients unscaled and clipped to grad_clip: (their norm before clipping, whether the step is
        finite)."""
        self.scaler.unscale_(self.optimizer)
        grad_clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), grad_clip)
        if self.sharded:  # a DTensor: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        # fp16's scaler skips overflowing gradients itself; any other non-finite value skips the step here
        finite = bool(torch.isfinite(loss_sum)) and (self.scaler.is_enabled() or bool(torch.isfinite(grad_norm)))
        return grad_norm, finite

    def agree(self, loss_sum, finite, guard_reason, decay_to=0, save_due=False, stats=None):
        """One all-reduce per step: the summed loss (and the objective's summed stats, if it has any), and
        whether any rank saw a non-finite step, a signal, or (rank 0) a guard, rank 0's decay_to (wsd: the horizon
        to decay to from the next step; 0: none) and whether a save is due by rank 0's clock. Every rank then takes
        the same decisions. (mean loss, finite, stop reason or None, decay_to, save due, mean stats or None)."""
        flags = [0.0 if finite else 1.0, 1.0 if self.stop_signal else 0.0,
                 float(STOP_REASONS.index(guard_reason) + 1) if guard_reason else 0.0, float(decay_to),
                 1.0 if save_due else 0.0]
        # float64: a horizon is an exact integer in it at any length (float32 stops at 2**24)
        v = torch.cat([loss_sum.double().reshape(1), torch.tensor(flags, device=self.proc.dev, dtype=torch.float64),
                       *([] if stats is None else [stats.double()])])
        if self.proc.distributed:
            dist.all_reduce(v)
        v = v.tolist()
        reason = STOP_REASONS[int(v[3]) - 1] if v[3] else ("signal" if v[2] else None)
        n = self.grad_accum * self.proc.world
        return v[0] / n, v[1] == 0, reason, int(v[4]), v[5] > 0, [s / n for s in v[6:]] if stats is not None else None

    def after_step(self, loss, finite, grad_norm, lr, base_lr, decay_to, spike_drill, nan_drill):
        """The step's account: wsd's decay from the next step (to min_lr at step decay_to, linear from this step's
        learning rate), the fire drill it ran, and a spike or non-finite step counted (the post-mortem's)."""
        st, cfg = self.state, self.cfg
        if decay_to:
            planned = decay_to == st.horizon
            if not planned:
                st.horizon_by = "time or money left"
            st.decay_start, st.decay_lr, st.horizon = st.step, base_lr, decay_to
            self.event("decay", f"the learning rate decays from {base_lr:.3g} to min_lr at step {decay_to} ("
                       + ("as planned" if planned else "what max_hours or budget_usd leaves pays for no more") + ")",
                       horizon=decay_to, lr=base_lr)
        if spike_drill or nan_drill:
            self.event("drill", "fire drill: " + ("a batch of the rarest tokens" if spike_drill
                                                  else "a NaN loss on the last rank"),
                       drill="spike" if spike_drill else "nan")
        self.recent.append((st.step, loss, grad_norm, lr))
        self.bad.account(st, loss, finite, grad_norm, lambda: bad_batch(cfg, st, self.train_data, self.rare,
                                                                        load_tokenizer(cfg.data_dir)),
                         self.recent, self.ckpts.on_disk)

    # what a step reads

    def first_sample(self, micro):
        """The first sample of this rank's slice of the step's global batch: disjoint across ranks and micro-steps."""
        return self.state.samples + (micro * self.proc.world + self.proc.rank) * self.cfg.micro_batch_size

    def micro_batch(self, micro, spike_drill):
        """This rank's micro-batch `micro` of the step (the fire drill's, when spike_drill)."""
        cfg, first = self.cfg, self.first_sample(micro)
        if spike_drill:
            return rare_token_batch(self.rare, cfg.micro_batch_size, cfg.block_size, [cfg.seed, self.state.step, first],
                                    self.proc.dev, self.train_data.draws)
        return self.train_data.train_batch(first, cfg.micro_batch_size, self.proc.dev)

    def target_weights(self):
        """SFT data (targets IGNORE outside the replies): each micro-batch's weight, its share of the targets the
        whole step counts (every rank's) times the micro-batches of the step, so that the mean the gradient and the
        logged loss take over ranks and micro-batches is the mean over every counted target, not a mean of unequal
        micro-batches' means. Counted in the loss masks alone: the micro-batches are read one at a time."""
        cfg = self.cfg
        counts = torch.tensor([self.train_data.train_targets(self.first_sample(micro), cfg.micro_batch_size)
                               for micro in range(self.grad_accum)], device=self.proc.dev).float()
        total = counts.sum()
        if self.proc.distributed:
            dist.all_reduce(total)
        return counts * (self.grad_accum * self.proc.world) / total.clamp(min=1)

    # the guards: time, money, signals; bad steps

    def guard(self):
        """Rank 0's verdict: the guard that must stop the run now (a limit it would cross within one more step, an
        evaluation and the final save), or None."""
        return self.clock.stop_reason(self.ckpts.writing, self.event)

    def rollback(self):
        """Back to the newest good checkpoint at half the learning rate; None, or why that cannot be."""
        st, cfg = self.state, self.cfg
        if st.rollbacks >= cfg.max_rollbacks:
            return (f"{cfg.max_bad_steps} bad steps in a row after {st.rollbacks} rollbacks (max_rollbacks="
                    f"{cfg.max_rollbacks}): the run diverges; lower learning_rate or check the data")
        path, ckpt = self.ckpts.newest()
        if ckpt is None:
            return (f"{st.bad_in_a_row} bad steps in a row at step {st.step} and no checkpoint to roll back to: "
                    f"lower learning_rate, raise warmup_steps, or check the data")
        keep = dict(elapsed=st.elapsed, cost_usd=st.cost_usd, spikes=st.spikes, nonfinite_steps=st.nonfinite_steps,
                    injected=st.injected, rollbacks=st.rollbacks + 1, lr_scale=st.lr_scale * 0.5)
        bad_at = st.step
        self.ckpts.restore(ckpt, st)
        vars(st).update(keep, bad_in_a_row=0)
        self.t_log, self.step_at_log = time.time(), st.step
        self.event("rollback", f"{cfg.max_bad_steps} bad steps in a row up to step {bad_at}: rolled back to {path}, "
                   f"learning rate x {st.lr_scale:g} (rollback {st.rollbacks} of {cfg.max_rollbacks})",
                   from_step=bad_at, lr_scale=st.lr_scale, rollbacks=st.rollbacks)
        if self.postmortem:
            self.postmortem.rolled_back(st.step, st.lr_scale)
            self.write_postmortem()
        return None

    def fit(self, tokens_per_sec, t_start):
        """A new run's horizon (preflight.start_horizon), the startup so far spent."""
        self.state.horizon, self.state.horizon_by = start_horizon(self.cfg, self.proc, tokens_per_sec,
                                                                  time.time() - t_start, self.clock.save_seconds)

    # evaluation

    def evaluate(self):
        """The validation loss, the mean over every target eval_steps micro-batches per rank count (SFT data: the
        replies'), on all ranks; the objective's stats (its forward's third item), their mean per micro-batch, in
        self.val_stats."""
        cfg, proc = self.cfg, self.proc
        self.model.eval()
        with torch.no_grad(), self.autocast:
            sums = self.val_data.validation_sums(self.raw_model, cfg.eval_steps, cfg.micro_batch_size, proc.rank,
                                                 proc.world, proc.dev)
        self.model.train()
        if proc.distributed:
            dist.all_reduce(sums)
        loss, *stats, counted = sums.tolist()
        self.val_stats = [v / (cfg.eval_steps * proc.world) for v in stats] or None
        return loss / max(counted, 1)

    def validate(self):
        """Evaluate now: (validation loss, whether it is a new best), logged."""
        st, t0 = self.state, time.time()
        val_loss = self.evaluate()
        self.clock.eval_seconds = time.time() - t0
        new_best = val_loss < st.best_val_loss
        if new_best:
            st.best_val_loss, st.best_step, st.evals_since_best = val_loss, st.step, 0
        else:
            st.evals_since_best += 1
        accuracy = self.gsm8k_accuracy() if self.problems else None
        self.write_metrics(dict(step=st.step, val_loss=val_loss, val_bpb=val_loss * self.bpb_scale,
                                tokens=st.step * self.cfg.total_batch_tokens,
                                **self.objective_metrics(self.val_stats, "val_"),
                                **({} if accuracy is None else {"gsm8k_accuracy": accuracy})))
        log(f"step {st.step} | val loss {val_loss:.4f} | val bpb {val_loss * self.bpb_scale:.4f}"
            f"{' (best)' if new_best else ''}{self.objective_console(self.val_stats)}"
            + ("" if accuracy is None else f" | gsm8k {100 * accuracy:.1f}% of {len(self.problems)}"), flush=True)
        if self.val_stats is not None:
            self.check_validation()
        if self.metrics is not None:  # the live report: summary.md and plots/ as of this evaluation
            write_report(self.cfg.out_dir, self.cfg.plots, live=True)
        return val_loss, new_best

    def gsm8k_accuracy(self):
        return gsm8k_accuracy(self.raw_model, self.problems, load_tokenizer(self.cfg.data_dir), self.cfg.block_size,
                              self.autocast, self.proc, self.sharded)

    def check_validation(self):
        """The objective's check of the evaluation just made (a warning event, when it has one to give)."""
        warning = self.raw_model.check_validation(self.val_stats, self.state, self.cfg)
        if warning:
            name, message, fields = warning
            self.event(name, message, **fields)

    def objective_metrics(self, stats, prefix=""):
        """The objective's numbers beyond the loss (stats: its forward's third item) by the names it gives them for
        metrics.jsonl; {} for an objective without."""
        return {} if stats is None else self.raw_model.metrics(stats, prefix)

    def objective_console(self, stats):
        """The same numbers as the objective shows them on a console line; "" without."""
        return "" if stats is None else self.raw_model.console(stats)

    # checkpoints

    def checkpoint(self, val_loss, best):
        st = self.state
        self.ckpts.save(dict(vars(st), tokens=st.step * self.cfg.total_batch_tokens, val_loss=val_loss), best)

    def saved(self):
        """Each save that reached the disk since the last look: what it cost the loop and how long it took to
        write, as a metrics.jsonl event; the slowest write is what the guards keep back for the final save."""
        for record in self.ckpts.finished():
            self.clock.save_seconds = max(self.clock.save_seconds, record["written_s"])
            self.write_metrics({"step": record["step"], "event": "checkpoint", **record})

    # the log: metrics.jsonl (and the trackers), clock.json, the console

    def write_metrics(self, row):
        if self.metrics is not None:
            try:
                row = self.metrics.write(row)
            except OSError as e:
                self.metrics = None
                out_of_space(self.metrics_path, e, self.ckpts)
            if self.trackers:
                self.trackers.log(row)

    def write_clock(self):
        try:
            write_json(self.clock_path, dict(elapsed=self.state.elapsed, cost_usd=self.state.cost_usd))
        except OSError as e:
            out_of_space(self.clock_path, e, self.ckpts)

    def write_postmortem(self):
        try:
            self.postmortem.write()
        except OSError as e:
            out_of_space(self.postmortem.path + ".md", e, self.ckpts)

    def event(self, name, message, **fields):
        self.write_metrics(dict(step=self.state.step, event=name, **fields))
        warn(f"step {self.state.step}: {message}")

    def log_step(self, loss, lr, grad_norm, stats):
        """A metrics line, clock.json (what the guards resume with), and a console line; with the objective's
        numbers of the step (stats), if it has any."""
        cfg, st, now = self.cfg, self.state, time.time()
        tok_s = (st.step - self.step_at_log) * cfg.total_batch_tokens / (now - self.t_log)
        mfu = self.flops_tok * tok_s / (self.peak * self.proc.world) if self.peak else None
        eta = (st.horizon - st.step) * (now - self.t_log) / (st.step - self.step_at_log)
        self.t_log, self.step_at_log = now, st.step
        row = dict(step=st.step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=st.step * cfg.total_batch_tokens,
                   tokens_per_sec=tok_s, mfu=mfu, mem_gb=peak_memory_gb(self.proc.dev), elapsed=st.elapsed,
                   cost_usd=st.cost_usd, **self.objective_metrics(stats))
        self.write_metrics(row)
        if self.metrics is not None:
            self.write_clock()
        log(f"step {st.step}/{st.horizon} | loss {loss:.4f} | lr {lr:.2e} | gnorm {grad_norm:.2f} | "
            f"{tok_s:,.0f} tok/s | mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"mem {row['mem_gb']:.2f} GB | eta {format_seconds(eta)}{self.objective_console(stats)}", flush=True)

    # the end

    def unsaved(self, reason):
        """Why the run ends without its model on disk (every stop saves the step it stopped at, but a stop over
        budget_file, which saves nothing and needs an earlier checkpoint), or None."""
        st, on_disk, root = self.state, self.ckpts.on_disk, self.ckpts.root
        if on_disk == st.step or (reason == "budget_file_spent" and on_disk >= 0):
            return None
        if on_disk < 0:
            return (f"the run ended at step {st.step} with no checkpoint on disk (the saves failed: see the warnings): "
                    f"free disk space for {root}, then run the same command again (it starts over)")
        return (f"the run ended at step {st.step} but its newest checkpoint is step {on_disk} (the saves after it "
                f"failed: see the warnings): free disk space for {root}, then run the same command again: it resumes "
                f"from step {on_disk}")

    def finish(self, reason, val_loss):
        """A final evaluation and checkpoint when the run completed, then summary.json and the report;
        rank 0's summary (None elsewhere)."""
        st, cfg = self.state, self.cfg
        if reason in ("max_steps", "horizon"):
            if val_loss is None:  # resumed at the horizon
                val_loss = self.evaluate()
                if val_loss < st.best_val_loss:
                    st.best_val_loss, st.best_step = val_loss, st.step
            if self.ckpts.saved_step != st.step:
                self.checkpoint(val_loss, val_loss <= st.best_val_loss and cfg.save_best)
        self.ckpts.wait()  # the last save on disk before the summary names it and the run exits
        self.saved()
        self.clock.tick()
        if self.proc.rank != 0:
            return None
        summary = self.summary(reason, val_loss)
        write_json(os.path.join(cfg.out_dir, "summary.json"), summary)
        self.write_clock()
        self.metrics.close()
        write_report(cfg.out_dir, cfg.plots)  # summary.md, plots, metrics.csv, manifest.json: never raises
        if self.trackers:  # last: a slow tracker may take its minute, and a preempted pod may not give it one
            self.trackers.close(summary["status"])
        if line := outcome(summary, cfg.max_steps, cfg.out_dir):
            log(line)
        return summary

    def summary(self, reason, val_loss):
        """summary.json: how the run ended and what it measured, with its long-run gate."""
        st, cfg = self.state, self.cfg
        status = {"max_steps": "completed", "horizon": "completed", "early_stop": "completed",
                  "diverged": "failed"}.get(reason, "stopped")
        lost = self.unsaved(reason)
        status = "failed" if lost else status
        best, band = st.best_step >= 0, target_band(cfg.target_val_loss)
        summary = dict(status=status, stop_reason=reason, signal=self.stop_signal[0] if self.stop_signal else None,
                       steps=st.step, horizon=st.horizon, horizon_by=st.horizon_by, lr_schedule=cfg.lr_schedule,
                       decay_start=st.decay_start, tokens=st.step * cfg.total_batch_tokens,
                       final_train_loss=self.last_loss, final_val_loss=val_loss,
                       best_val_loss=st.best_val_loss if best else None, best_step=st.best_step if best else None,
                       final_val_bpb=None if val_loss is None else val_loss * self.bpb_scale,
                       unigram_val_loss=unigram_baseline(cfg.data_dir, self.manifest, self.val_data),
                       target_val_loss=list(band) if band else None, target=target_verdict(band, status, val_loss),
                       elapsed_s=st.elapsed, cost_usd=st.cost_usd, spikes=st.spikes,
                       nonfinite_steps=st.nonfinite_steps, rollbacks=st.rollbacks, lr_scale=st.lr_scale,
                       params=param_counts(self.raw_model.config), flops_per_token=self.flops_tok,
                       world_size=self.proc.world, checkpoint=find_checkpoint(cfg.out_dir),
                       best_checkpoint=find_checkpoint(cfg.out_dir, "best"), error=lost,
                       **self.objective_metrics(self.val_stats if val_loss is not None else None, "final_val_"))
        summary["long_run_gate"] = long_run_gate(cfg, summary, release_gates(cfg.pack_dir))
        return summary


def gsm8k_questions(data_dir, manifest, n):
    """eval_gsm8k_samples' (prompt, answer) pairs of GSM8K data; None when n is 0."""
    if not n:
        return None
    try:
        return gsm8k_problems(data_dir, manifest, n)
    except ValueError as e:
        fail(f"eval_gsm8k_samples={n}: {e}")


# -----------------------------------------------------------------------------

def configure(argv):
    """This script's config from argv, checked."""
    cfg = configurator.configure(__file__, argv)
    check_config(cfg)
    return cfg


def new_state(cfg):
    """The loop's state at the start: all of it goes into every checkpoint, so a resumed run continues exactly."""
    return SimpleNamespace(step=0, samples=0, elapsed=0.0, cost_usd=0.0, best_val_loss=float("inf"), best_step=-1,
                           evals_since_best=0, loss_ema=None, spikes=0, nonfinite_steps=0, bad_in_a_row=0,
                           rollbacks=0, lr_scale=1.0, injected=[], order_broken=0,
                           horizon=cfg.max_steps, horizon_by="max_steps", decay_start=-1, decay_lr=None)


def log_run(cfg, proc, dt, mconfig, data, grad_accum):
    """The run's first console lines: the keys that differ from the defaults, the model, the data and the batch."""
    (manifest, train_data, val_data), counts = data, param_counts(mconfig)
    log(f"config: {configurator.changed(cfg, __file__)} (every key: {os.path.join(cfg.out_dir, 'config.json')})")
    log(f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{flops_per_token(mconfig) / 1e9:.3f} GFLOP/token | data: {manifest['tokenizer']}, {train_data.n:,} train "
        f"and {val_data.n:,} validation windows | world {proc.world} x micro {cfg.micro_batch_size} x accum "
        f"{grad_accum} = {cfg.total_batch_tokens} tokens/step | {proc.dev} {dtype_name(dt)}")


def train(cfg, keep_group=False):
    """One run: (exit status, rank 0's summary or None, this rank's activity). keep_group: leave the
    process group up for a second run in this process (the dry run)."""
    t_start = time.time()
    stop_signal = catch_signals()
    proc, dt, grad_accum = set_up(cfg)
    # out_dir is this run's alone: held before anything reads what an earlier run left (rank 0 for every rank)
    with Folder(cfg.out_dir, "out_dir", legacy=("ckpt/latest",)) as folder:
        on_rank0(proc.distributed, folder.hold)
        manifest = read_manifest(cfg)
        mconfig = model_config(cfg, manifest)
        data = open_data(cfg, manifest, mconfig)
        release = release_gates(cfg.pack_dir)
        report, raw_model = plan_run(cfg, proc, dt, mconfig, data, lambda: build_model(cfg, proc, dt, mconfig),
                                     release)
        if cfg.preflight_only:
            on_rank0(proc.distributed, folder.claim)
            return finish_preflight(cfg, report, proc.rank == 0), None, None

        optimizer = make_optimizer(raw_model, cfg.learning_rate, (cfg.beta1, cfg.beta2), cfg.weight_decay,
                                   fused=proc.dev.type == "cuda", kind=cfg.optimizer, matrix_lr=cfg.matrix_lr,
                                   embedding_lr=cfg.embedding_lr, momentum=cfg.muon_momentum)
        saved, files = run_record(cfg, mconfig, proc.world, grad_accum, manifest)
        ckpts = Checkpoints(cfg.out_dir, raw_model, optimizer, proc, cfg.dist_mode == "fsdp",
                            files if proc.rank == 0 else {}, cfg.ckpt_every, cfg.keep_last, cfg.save_best,
                            cfg.ckpt_min_free_gb, cfg.ckpt_async, cfg.ckpt_every_minutes)
        state = new_state(cfg)
        resumed = ckpts.resume(cfg.resume, saved, cfg.allow_resume_mismatch, cfg.data_dir, state, cfg.init_from)
        if cfg.resume != "never":
            restore_clock(os.path.join(cfg.out_dir, "clock.json"), state)
        check_writable(cfg, proc, report, folder)
        model = wrap_model(cfg, proc, raw_model)
        log_run(cfg, proc, dt, mconfig, data, grad_accum)
        if resumed:
            log(f"resumed from {resumed} at step {state.step} ({format_seconds(state.elapsed)} and "
                f"${state.cost_usd:.2f} so far)")
        trainer = Trainer(cfg, proc, dt, grad_accum, data, model, raw_model, optimizer, ckpts, state, stop_signal,
                          t_start)
        if resumed:  # the schedule goes on to the horizon it had; one that was max_steps follows a changed max_steps
            if state.horizon_by == "max_steps" or cfg.max_steps < state.horizon:
                state.horizon, state.horizon_by = cfg.max_steps, "max_steps"
        else:
            trainer.fit(report["plan"].get("horizon", {}).get("tokens_per_sec"), t_start)
        reason, val_loss = trainer.loop()
        summary = trainer.finish(reason, val_loss)
        if proc.distributed:
            dist.barrier()  # tear gloo/nccl down together: a rank leaving while rank 0 still writes can abort
            if not keep_group:
                dist.destroy_process_group()
        if reason == "diverged":
            fail(f"{trainer.diverged} (summary in {cfg.out_dir}/summary.json)")
        if summary and summary["error"]:  # rank 0's: torchrun's job fails with it
            fail(summary["error"])
        activity = dict(rank=proc.rank, device=str(proc.dev), dtype=dtype_name(dt), steps=state.step,
                        samples=state.samples, peak_mem_gb=peak_memory_gb(proc.dev), elapsed_s=state.elapsed,
                        stop_reason=reason)
        return 0, summary, activity


def main(argv):
    """The script: a training run, a dry run (dryrun_steps) or a preflight (preflight_only); the exit status."""
    cfg = configure(argv)
    if cfg.dryrun_steps:
        return dryrun(argv, cfg.dryrun_steps, cfg.out_dir, lambda args: train(configure(args), keep_group=True))
    Schedule.of(cfg).check_warmup(cfg.max_steps)  # not for a dry run, which runs a long run's config for a few steps
    return train(cfg)[0]


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
