"""
Train a GPT on the shards that prepare.py writes: one process (CPU or one GPU), or
under torchrun (gloo on CPU, nccl on CUDA) either data-parallel (dist_mode=ddp: each
GPU holds the whole model and AdamW state) or sharded (dist_mode=fsdp: FSDP2 splits
weights, gradients and AdamW state over the GPUs, for models DDP cannot fit).

    python train.py config/tiny.py
    python train.py config/a100_50m.py --max_steps=500 --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/h200_1b_ddp8.py
    torchrun --standalone --nproc_per_node=8 train.py config/h100_d64.py      # fsdp

Config: the globals between the config markers below, overridden by config files and
--key=val (configurator.py; --help lists them). Everything a run writes goes to out_dir:
metrics.jsonl (a JSON object per logged step, and one per event: spike, non-finite step,
rollback, budget warning), ckpt/ (checkpoints; ckpt/latest and ckpt/best name the
newest and the best complete one), summary.json when the run ends or stops.

The batch of optimizer step s is always the same set of sequences, whatever the
number of GPUs or the micro-batch: the loader walks one global, seeded order of
windows (see Loader), and each step takes the next total_batch_tokens worth of it,
split across ranks and micro-steps. So a run resumes exactly where it stopped, and
1 GPU with gradient accumulation k computes the same step as k GPUs. That also holds
across world sizes: a run checkpointed on 8 GPUs resumes on 4 (grad accumulation
doubles) with the same batches; only the per-rank RNG states, which training does not
use, are re-seeded. An fsdp checkpoint is sharded (ckpt/step_N/state/, written by every
rank with torch.distributed.checkpoint) and reshards on load: it resumes at another
world size, or under ddp, and a ddp checkpoint resumes under fsdp; sample.py and
export.py read it whole.

A run survives what a rented pod does to it:
- the same command again resumes from the newest checkpoint that is complete and reads
  back (resume=auto); a kill at any moment, even mid-save, loses at most the steps
  since the last checkpoint, and the resumed run is bit-identical to one never stopped;
- SIGTERM, SIGINT and SIGUSR1 (preemption notices) make every rank stop at the same
  step boundary, save, and exit 0; so do max_hours and the budget guards, before their
  limit is crossed;
- a non-finite loss or gradient skips the step on every rank; max_bad_steps spikes or
  non-finite steps in a row roll back to the last checkpoint at half the learning rate.
"""

import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
import warnings
import zlib
from contextlib import nullcontext
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import configurator
from util import device_mesh, fail, first_line, setup
from report import read_metrics, write_atomic, write_report
from model import (GPT, RUNTIME_FIELDS, GPTConfig, flops_per_token, memory_estimate, param_counts,
                   peak_flops, resolve_backend)
from data import (Loader, document_hashes, load_manifest, rare_token_batch, rarest_tokens, tokenizer_fingerprint,
                  unigram_baseline)

# --- config
# I/O
out_dir = "out"                 # metrics.jsonl, ckpt/, summary.json are written here
data_dir = "data"               # shards and manifest.json written by prepare.py
resume = "auto"                 # auto: newest good checkpoint in out_dir, if any | never | a checkpoint folder
allow_resume_mismatch = False   # resume even from a checkpoint trained on other data or another tokenizer
# model
block_size = 1024               # context length in tokens
n_layer = 12                    # transformer blocks
n_head = 12                     # query heads
n_kv_head = 12                  # key/value heads; fewer than n_head is grouped-query attention
n_embd = 768                    # model width
ffn_hidden = None               # SwiGLU hidden size; None: floor(8 * n_embd / 3)
vocab_size = None               # None: the data's vocabulary (manifest.json); a number must match it
tie_embeddings = True           # share the input embedding with the output head
rope_theta = 10000.0            # RoPE base
vocab_multiple = 64             # pad the vocabulary to a multiple of this (faster matmuls)
init_std = 0.02                 # std of the normal init (residual projections scaled by 1/sqrt(2*n_layer))
# speed and memory: none of these changes what a step computes, beyond rounding (a run may resume with others)
attn_backend = "auto"           # auto (fastest that passes a parity check here) | fa3 | fa2 | cudnn | flash | efficient | flex | math | sdpa
doc_mask = False                # attention stays inside each document (BOS boundaries); this one does change the model
grad_ckpt = "none"              # activation checkpointing: none | full (each block keeps only its input) | selective
loss_chunk = 8192               # tokens per chunk of the cross-entropy: fp32 logits never exist for the whole batch; 0: off
# batch
micro_batch_size = 8            # sequences per GPU per forward/backward
total_batch_tokens = 524288     # tokens per optimizer step over all GPUs; grad accumulation is derived from it
max_steps = 1000                # optimizer steps
# AdamW and schedule: linear warmup, then cosine from learning_rate down to min_lr at max_steps
learning_rate = 3e-4            # peak learning rate
min_lr = 3e-5                   # final learning rate
warmup_steps = 100              # linear warmup steps
weight_decay = 0.1              # on matrices only, never on norms or embeddings
beta1 = 0.9                     # AdamW beta1
beta2 = 0.95                    # AdamW beta2
grad_clip = 1.0                 # clip the global gradient norm to this; 0 disables
# evaluation, logging, checkpoints
eval_every = 250                # steps between validation evaluations (and one at the end)
eval_steps = 20                 # validation micro-batches per rank per evaluation
log_every = 10                  # steps between metrics.jsonl lines and console lines
ckpt_every = 1000               # steps between checkpoints (and one at the end)
keep_last = 3                   # newest checkpoints kept (at least 1), besides the best one
save_best = True                # also checkpoint at every new best validation loss (ckpt/best; never rotated away)
early_stop_patience = 0         # stop after this many evaluations without a new best validation loss; 0: never
ckpt_min_free_gb = 1.0          # skip a checkpoint, with a warning, that would leave less disk free than this
# guards: each stops the run before its limit is crossed (checkpoint, summary.json, exit 0)
max_hours = 0.0                 # wall-clock limit, resumed time included; 0: none
budget_usd = 0.0                # spending cap in dollars; 0: none
usd_per_gpu_hour = 0.0          # price of one GPU-hour; spend = wall clock x GPUs x this
budget_file = ""                # JSON kept current from outside, {"spent_usd": .., "projected_total_usd": ..}, checked against budget_usd
budget_check_minutes = 30.0     # how often budget_file is read
# loss spikes and non-finite steps
spike_factor = 2.5              # a step whose loss exceeds this x the EMA of recent losses is a spike (logged, counted)
max_bad_steps = 10              # spikes or non-finite steps in a row before rolling back to the last checkpoint at lr x 0.5
max_rollbacks = 3               # rollbacks allowed before the run stops as diverged
inject_spike_at_step = -1       # fire drill: the steps logged as N..N+4 train on batches of the rarest tokens; -1: off
inject_nan_at_step = -1         # fire drill: the steps logged as N..N+4 get a NaN loss on the last rank; -1: off
# preflight: gates checked before any step is paid for (out_dir/preflight.json and .md)
preflight_only = False          # write the preflight report and exit: 1 if a gate blocks, else 0
dryrun_steps = 0                # dry run: N steps into out_dir/first, then N/2+1..N again from its step-N/2
                                # checkpoint into out_dir/resumed; dryrun.json; exit 1 if anything is off
gate_profile = "research"       # research | release: release also blocks too short or too long token horizons
allow_unsafe = False            # train even when a gate blocks (each block becomes a warning)
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
matmul_precision = "high"       # CUDA fp32 matmuls: high lets them use TF32 tensor cores | highest: true fp32
# --- end config

CKPT_FORMAT = 2
MARKER = "complete.json"        # written last into a checkpoint folder: file sizes and CRC32s
STATE_DIR = "state"             # a sharded (fsdp) checkpoint's model and optimizer, torch.distributed.checkpoint files
INJECT_STEPS = 5                # steps an injected spike or NaN lasts (seed 002's "next 5 batches")
LOSS_EMA_DECAY = 0.9            # EMA of the loss that spikes are measured against
BUDGET_WARN = 0.85              # warn when budget_file's spend passes this fraction of budget_usd
PREEMPT_SAVE_SECONDS = 25       # a save slower than this would not fit between SIGTERM and SIGKILL
# a torchrun worker keeps its wrapped model until os._exit (exit_worker): freeing DDP's reducer or FSDP's
# groups after the process group is gone joins a gloo thread that can wait forever for the interpreter lock
LIVE_MODELS = []
STOP_REASONS = ("signal", "max_hours", "budget_usd", "budget_file_projected", "budget_file_spent")


def check_config():
    """Refuse settings that cannot work, before anything is read or written."""
    positive = dict(block_size=block_size, n_layer=n_layer, micro_batch_size=micro_batch_size,
                    total_batch_tokens=total_batch_tokens, max_steps=max_steps, learning_rate=learning_rate,
                    eval_every=eval_every, eval_steps=eval_steps, log_every=log_every, ckpt_every=ckpt_every,
                    keep_last=keep_last, max_bad_steps=max_bad_steps, budget_check_minutes=budget_check_minutes)
    for key, value in positive.items():
        if value <= 0:
            fail(f"{key}={value} must be positive")
    non_negative = dict(min_lr=min_lr, warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip,
                        max_rollbacks=max_rollbacks, early_stop_patience=early_stop_patience, max_hours=max_hours,
                        budget_usd=budget_usd, usd_per_gpu_hour=usd_per_gpu_hour, ckpt_min_free_gb=ckpt_min_free_gb)
    for key, value in non_negative.items():
        if value < 0:
            fail(f"{key}={value} must be >= 0")
    if compile_mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        fail(f"compile_mode={compile_mode!r} is not one of default, reduce-overhead, max-autotune, "
             f"max-autotune-no-cudagraphs")
    if matmul_precision not in ("highest", "high", "medium"):
        fail(f"matmul_precision={matmul_precision!r} is not one of highest, high, medium")
    if dist_mode not in ("ddp", "fsdp"):
        fail(f"dist_mode={dist_mode!r} is not one of ddp, fsdp")
    if min_lr > learning_rate:
        fail(f"min_lr={min_lr} is above learning_rate={learning_rate}: the schedule decays from learning_rate to min_lr")
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        fail(f"beta1={beta1}, beta2={beta2}: both must be in [0, 1)")
    if spike_factor <= 1:
        fail(f"spike_factor={spike_factor} must be above 1 (a spike is a loss this many times the recent average)")
    if budget_usd and not (usd_per_gpu_hour or budget_file):
        fail(f"budget_usd={budget_usd} needs a way to measure spend: set usd_per_gpu_hour or budget_file")
    if budget_file and not budget_usd:
        fail(f"budget_file={budget_file} needs budget_usd, the cap its spend is checked against")
    if budget_file and not os.path.isfile(budget_file):
        fail(f"budget_file {budget_file} does not exist: start what writes it first, or leave budget_file empty")


# -----------------------------------------------------------------------------
# checkpoints: ckpt/step_NNNNNNN/ is written as ckpt/.tmp-step_NNNNNNN/, every file
# fsync'd, complete.json (sizes and CRC32 of every file) last, then renamed into place;
# only then are ckpt/latest (and ckpt/best) pointed at it. A kill at any moment leaves
# the previous checkpoint intact, and a damaged one is recognized when read back.

class _CRC32Writer:
    """A file wrapper that checksums what is written through it, so saving reads nothing back."""

    def __init__(self, f):
        self.f, self.crc = f, 0

    def write(self, b):
        self.crc = zlib.crc32(b, self.crc)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def save_file(obj, path):
    """Write bytes or a torch object to path, fsync'd; its CRC32."""
    with open(path, "wb") as f:
        w = _CRC32Writer(f)
        if isinstance(obj, bytes):
            w.write(obj)
        else:
            torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return w.crc


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pointer(ckpt_root, which, name):
    save_file(name.encode(), os.path.join(ckpt_root, f"{which}.tmp"))
    os.replace(os.path.join(ckpt_root, f"{which}.tmp"), os.path.join(ckpt_root, which))


def read_pointer(ckpt_root, which):
    try:
        with open(os.path.join(ckpt_root, which)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def tensor_bytes(obj):
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return len(obj) if isinstance(obj, bytes) else 0


def file_crc32(path):
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def save_checkpoint(ckpt_root, step, files, keep_last, best, min_free_gb, sharded=None):
    """Write `files` ({name: bytes or torch object}) as ckpt_root/step_NNNNNNN; the folder, or
    None when the disk could not hold it and keep min_free_gb free (nothing is written then).

    sharded (fsdp): {"model": .., "optimizer": ..} state dicts of DTensors. Then every rank calls
    this: each writes its shards into state/ with torch.distributed.checkpoint and checksums
    them; rank 0 alone writes `files`, the marker, and the pointers."""
    name = f"step_{step:07d}"
    tmp = os.path.join(ckpt_root, f".tmp-{name}")
    master = sharded is None or dist.get_rank() == 0
    go = [True]
    if master:
        for leftover in os.listdir(ckpt_root):  # of a save that was killed
            if leftover.startswith(".tmp-"):
                shutil.rmtree(os.path.join(ckpt_root, leftover), ignore_errors=True)
        # a DTensor's numel is the global one: `need` is the whole checkpoint, as on a shared disk
        need, free = tensor_bytes([list(files.values()), sharded]), shutil.disk_usage(ckpt_root).free
        if free - need < min_free_gb * 1e9:
            print(f"warning: skipping the step {step} checkpoint: it needs {need / 1e9:.2f} GB and {ckpt_root} has "
                  f"{free / 1e9:.2f} GB free (ckpt_min_free_gb={min_free_gb}); training goes on: free disk space",
                  file=sys.stderr, flush=True)
            go = [False]
    if sharded is not None:
        dist.broadcast_object_list(go)  # also keeps the other ranks out until the leftovers are gone
    if not go[0]:
        return None
    marker, error, errors = {}, None, (OSError,)
    try:
        os.makedirs(tmp, exist_ok=True)
        if sharded is not None:
            import torch.distributed.checkpoint as dcp  # only sharded runs import it: see shard_model
            errors = (OSError, dcp.api.CheckpointException)
            state = os.path.join(tmp, STATE_DIR)
            # DCP's writer stages tensors through a CUDA stream wherever CUDA exists; a CPU run's tensors are
            # written as they are, so that a CPU run on a GPU machine never reaches into a GPU
            on_cpu = all(t.device.type == "cpu" for t in sharded["model"].values())
            dcp.save(sharded, storage_writer=dcp.FileSystemWriter(state, **({"per_thread_copy_ahead": 0} if on_cpu
                                                                             else {})))
            rank = dist.get_rank()  # DCP names each rank's data __<rank>_<n>.distcp; rank 0 also writes .metadata
            for f in os.listdir(state):
                if f.startswith(f"__{rank}_") or (rank == 0 and not f.startswith("__")):
                    marker[f"{STATE_DIR}/{f}"] = dict(bytes=os.path.getsize(os.path.join(state, f)),
                                                      crc32=file_crc32(os.path.join(state, f)))
        if master:
            for fname, obj in files.items():
                crc = save_file(obj, os.path.join(tmp, fname))
                marker[fname] = dict(bytes=os.path.getsize(os.path.join(tmp, fname)), crc32=crc)
    except errors as e:  # the disk filled up after all, or went away
        error = first_line(e)
    if sharded is not None:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (marker, error))
        marker = {k: v for m, _ in gathered for k, v in m.items()}
        error = next((e for _, e in gathered if e), None)
    final = os.path.join(ckpt_root, name)
    if master:
        if error is None:
            try:
                save_file(json.dumps(dict(step=step, files=marker), indent=1).encode(), os.path.join(tmp, MARKER))
                if sharded is not None:
                    fsync_dir(os.path.join(tmp, STATE_DIR))
                fsync_dir(tmp)
            except OSError as e:
                error = first_line(e)
        if error is not None:  # drop the partial folder, keep training
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"warning: the step {step} checkpoint failed ({error}); training goes on: check {ckpt_root}",
                  file=sys.stderr, flush=True)
            final = None
        else:
            shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a rollback replayed it)
            os.replace(tmp, final)
            fsync_dir(ckpt_root)
            write_pointer(ckpt_root, "latest", name)
            if best:
                write_pointer(ckpt_root, "best", name)
            keep = {read_pointer(ckpt_root, "best")}
            for old in sorted(d for d in os.listdir(ckpt_root) if d.startswith("step_"))[:-keep_last]:
                if old not in keep:
                    shutil.rmtree(os.path.join(ckpt_root, old))
    if sharded is not None:
        result = [final]
        dist.broadcast_object_list(result)
        final = result[0]
    return final


def verify_checkpoint(path):
    """Raise ValueError saying what is wrong if the folder is not a complete, intact checkpoint."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            files = {n: dict(bytes=int(m["bytes"]), crc32=int(m["crc32"])) for n, m in json.load(f)["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"incomplete, no readable {MARKER} ({first_line(e)})") from None
    for fname, want in files.items():
        file = os.path.join(path, fname)
        if not os.path.exists(file) or os.path.getsize(file) != want["bytes"]:
            size = os.path.getsize(file) if os.path.exists(file) else "no"
            raise ValueError(f"{fname} has {size} bytes, {want['bytes']} were written")
        crc = file_crc32(file)
        if crc != want["crc32"]:
            raise ValueError(f"{fname} is corrupt (CRC32 {crc:08x}, {want['crc32']:08x} was written)")


def load_checkpoint(path, device, verify=True):
    """Everything a resume needs from a checkpoint folder, verified; ValueError saying what is wrong.
    A sharded checkpoint's model and optimizer stay on disk: "state" names their folder (see restore)."""
    if verify:
        verify_checkpoint(path)
    sharded = os.path.isdir(os.path.join(path, STATE_DIR))
    try:
        names = ("trainer",) if sharded else ("model", "optimizer", "trainer")
        ckpt = {name: torch.load(os.path.join(path, f"{name}.pt"), map_location=device if name != "trainer" else "cpu",
                                 weights_only=True) for name in names}
        if sharded:
            ckpt["state"] = os.path.join(path, STATE_DIR)
        with open(os.path.join(path, "config.json")) as f:
            ckpt["config"] = json.load(f)
    except Exception as e:  # a damaged pickle can raise many kinds of error; all mean "unreadable"
        raise ValueError(f"unreadable ({first_line(e)})") from None
    if ckpt["trainer"].get("format") != CKPT_FORMAT:
        raise ValueError(f"checkpoint format {ckpt['trainer'].get('format')}, this train.py reads {CKPT_FORMAT}")
    return ckpt


def newest_good_checkpoint(ckpt_root, device, warn):
    """(path, loaded checkpoint) of the newest checkpoint that reads back intact, or (None, None);
    damaged or incomplete ones are skipped with a warning. Under torchrun rank 0 checks the files
    (each rank reading a sharded checkpoint whole would multiply the reads) and names the one to load."""
    names = sorted((d for d in os.listdir(ckpt_root) if d.startswith("step_")), reverse=True) \
        if os.path.isdir(ckpt_root) else []
    chosen = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name in names:
            try:
                verify_checkpoint(os.path.join(ckpt_root, name))
                chosen = [name]
                break
            except ValueError as e:
                warn(f"skipping checkpoint {os.path.join(ckpt_root, name)}: {e}")
    if dist.is_initialized():
        dist.broadcast_object_list(chosen)
    if chosen[0] and chosen[0] not in names:
        fail(f"rank 0 resumes from {chosen[0]}, which this rank's {ckpt_root} does not hold: on several nodes, "
             f"out_dir must be a folder every node sees (a shared filesystem)")
    for name in names[names.index(chosen[0]):] if chosen[0] else []:
        path = os.path.join(ckpt_root, name)
        try:  # files that check out can still fail to unpickle
            return path, load_checkpoint(path, device, verify=name != chosen[0])
        except ValueError as e:
            warn(f"skipping checkpoint {path}: {e}")
    return None, None


def find_checkpoint(path, which="latest"):
    """The checkpoint folder that `path` names: itself, or the latest (or best) one of an out_dir; None if none.
    An out_dir without a best checkpoint (no evaluation yet) gives its latest."""
    if os.path.exists(os.path.join(path, MARKER)):
        return path
    ckpt_root = os.path.join(path, "ckpt")
    name = read_pointer(ckpt_root, which) or read_pointer(ckpt_root, "latest")
    return os.path.join(ckpt_root, name) if name else None


def load_sharded(state, path):
    """Fill `state` from a sharded checkpoint's files, resharded to it: every rank its part under
    torchrun, everything in a process without a process group."""
    import torch.distributed.checkpoint as dcp  # see shard_model
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def load_model(ckpt, device="cpu"):
    """(model, config dict) from a checkpoint folder, verified, weights loaded, in eval mode;
    ValueError saying what is wrong."""
    verify_checkpoint(ckpt)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    model = GPT(GPTConfig(**dict(config["model"], attn_backend="auto")))  # trained elsewhere: this machine's kernel
    if os.path.isdir(os.path.join(ckpt, STATE_DIR)):  # sharded (fsdp): DCP gathers the model's shards whole
        state = {"model": model.state_dict()}
        load_sharded(state, os.path.join(ckpt, STATE_DIR))
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(torch.load(os.path.join(ckpt, "model.pt"), map_location=device, weights_only=True))
    return model.to(device).eval(), config


def rng_state():
    return dict(python=random.getstate(), numpy=[x.tolist() if isinstance(x, np.ndarray) else x
                                                   for x in np.random.get_state()],
                torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None)  # this rank's GPU


def set_rng_state(state):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


# -----------------------------------------------------------------------------
# helpers of the loop

def lr_at(step):
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + 0.5 * (learning_rate - min_lr) * (1.0 + math.cos(math.pi * progress))


def shard_model(model, dev, compute_dtype):
    """FSDP2 over the process group: each block's parameters gathered just for its own compute, and again
    for its backward (its recompute under grad_ckpt happens inside the block: checkpoint, then shard);
    compute in compute_dtype, gradients reduced in fp32; the root shards the rest (embedding, tied head,
    final norm)."""
    # FSDP2, DTensor and torch.distributed.checkpoint are imported by the runs that shard, not at the top:
    # together they are 0.8-1.0 s of train.py's 2.5-3.3 s import (measured on a 2-core CPU, torch 2.13),
    # which every other run and every script that imports train.py would pay at each start
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp, mesh = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32), device_mesh(dev)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def make_optimizer(model, fused):
    # decay matrices only: norms (1-D) and the embedding table (sparse rows, tied head) are left alone
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or name.startswith("embed_tokens") else decay).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2), fused=fused)


def optimizer_by_name(model, optimizer, saved):
    """A plain optimizer.state_dict() (parameters numbered in param_groups order) keyed by parameter
    name instead, the form FSDP's loader takes; both runs build their groups with make_optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    number_to_name = dict(zip((i for g in saved["param_groups"] for i in g["params"]),
                              (names[id(p)] for g in optimizer.param_groups for p in g["params"]), strict=True))
    return dict(state={number_to_name[i]: s for i, s in saved["state"].items()},
                param_groups=[dict(g, params=[number_to_name[i] for i in g["params"]]) for g in saved["param_groups"]])


def mean_over_ranks(value, ddp, device):
    t = torch.tensor(float(value), device=device)
    if ddp:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def format_seconds(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def rewrite_metrics(path, last_step):
    """On resume: keep only the metrics lines of steps <= last_step (and drop a torn last line)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if line.endswith("\n") and json.loads(line)["step"] <= last_step:
                    kept.append(line)
            except (ValueError, KeyError):
                pass
    write_atomic(path, "".join(kept))


def read_budget_file(path):
    """(spent_usd, projected_total_usd) from the budget file, or the reason it cannot be read."""
    try:
        with open(path) as f:
            b = json.load(f)
        return float(b["spent_usd"]), float(b.get("projected_total_usd", b["spent_usd"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return first_line(e)


def write_json(path, obj):
    write_atomic(path, json.dumps(obj, indent=1))


# -----------------------------------------------------------------------------
# preflight: every number from model.py's arithmetic, the data, or a measurement here

HORIZON = {"research": (None, None, None), "release": (0.1, (0.5, 1.5), 3.0)}  # block below, warn outside, block above
# epochs over the same data: release stops at 4 (where repetition starts to cost, Muennighoff et al. 2023),
# research only at 100 (past ~16 repetition adds next to nothing: surely a mistake)
EPOCHS_BLOCK = {"research": 100, "release": 4}
LONG_RUN_TOKENS = 1e9           # the horizon's upper block applies to runs at least this long
MEMORY_USABLE = 0.92            # of a GPU's memory: the rest goes to the CUDA context, NCCL and fragmentation


def gate(name, verdict, value, threshold, detail):
    return dict(name=name, verdict=verdict, value=value, threshold=threshold, detail=detail)


def memory_gate(config, world, mem_gb, dtype_bytes):
    """memory_fit: this run's estimate per GPU (dist_mode, grad_ckpt) against the usable memory, and
    when it does not fit, the remedies that would."""
    sharded = dist_mode == "fsdp"

    def total(mb=micro_batch_size, shard=sharded, ckpt=grad_ckpt):
        return memory_estimate(config, mb, world, sharded=shard, activation_checkpointing=ckpt,
                               compute_bytes=dtype_bytes)["total"]

    need, usable = total(), mem_gb * 1e9 * MEMORY_USABLE
    layout = ("FSDP" if sharded else "DDP") + ("" if grad_ckpt == "none" else f" + grad_ckpt={grad_ckpt}")
    detail = f"{layout}: {need / 1e9:.1f} GB per GPU of {usable / 1e9:.1f} usable ({mem_gb:g} GB x {MEMORY_USABLE})"
    if need <= usable:
        return gate("memory_fit", "warn" if need > 0.85 * usable else "pass", need, usable, detail)
    remedies = []
    for mb in (micro_batch_size // 2 ** k for k in range(1, 12)):
        if mb >= 1 and total(mb) <= usable:
            remedies.append(f"micro_batch_size={mb} (gradient accumulation keeps total_batch_tokens)")
            break
    for ckpt in ("selective", "full"):
        if grad_ckpt != ckpt and grad_ckpt != "full" and total(ckpt=ckpt) <= usable:
            remedies.append(f"grad_ckpt={ckpt}")
            break
    best = total(shard=True, ckpt="full")
    if not sharded and best <= usable:
        remedies.append(f"dist_mode=fsdp + grad_ckpt=full across {world} GPUs: {best / 1e9:.1f} GB per GPU")
    fix = "; or ".join(remedies) or (f"more GPUs or a smaller model (FSDP + grad_ckpt=full across {world} GPUs still "
                                      f"needs {best / 1e9:.1f} GB per GPU)")
    return gate("memory_fit", "block", need, usable, f"{detail}: does not fit; use {fix}")


def preflight_gates(model_config, manifest, world, launched, dev_mem_gb, dtype_bytes, free_disk, runtime):
    """Every gate that needs no model on the device, for `world` ranks (`launched` here): (gates, plan).
    free_disk None: planning for another machine."""
    counts = param_counts(model_config)
    tokens = max_steps * total_batch_tokens
    per_param = tokens / counts["non_embedding"]
    gates = []
    low, band, high = HORIZON[gate_profile]
    ratio = per_param / 20
    verdict = "pass"
    if band and not band[0] <= ratio <= band[1]:
        verdict = "warn"
    if (low and ratio < low) or (high and ratio > high and tokens >= LONG_RUN_TOKENS):
        verdict = "block"
    gates.append(gate("compute_optimal_horizon", verdict, ratio, band or "-",
                      f"{tokens / 1e9:.3g}B tokens = {tokens / counts['total']:.1f} per parameter "
                      f"({counts['total'] / 1e9:.3g}B), {per_param:.1f} per non-embedding parameter "
                      f"({counts['non_embedding'] / 1e9:.3g}B) = {ratio:.2f}x Chinchilla's 20"))
    if manifest is None:
        for name in ("corpus_model_fit", "contamination", "tokenizer_vocab"):
            gates.append(gate(name, "skip", None, None, f"no data prepared in {data_dir} yet"))
    else:
        unique = manifest["splits"]["train"]["tokens"]
        epochs = tokens / unique
        limit = EPOCHS_BLOCK[gate_profile]
        gates.append(gate("corpus_model_fit", "block" if epochs > limit else "warn" if epochs > 1 else "pass",
                          epochs, limit, f"{tokens / 1e9:.3g}B planned tokens over {unique / 1e9:.3g}B unique "
                          f"training tokens = {epochs:.2f} epochs (warn above 1, block above {limit})"))
        val = set(document_hashes(data_dir, manifest["splits"]["val"]))
        shared = sum(h in val for h in document_hashes(data_dir, manifest["splits"]["train"]))
        gates.append(gate("contamination", "block" if shared else "pass", shared, 0,
                          f"{shared} training documents are also validation documents" if shared else
                          f"no training document among the {len(val)} validation documents"))
        ok = vocab_size is None or vocab_size == manifest["vocab_size"]
        gates.append(gate("tokenizer_vocab", "pass" if ok else "block", vocab_size or manifest["vocab_size"],
                          manifest["vocab_size"], f"{data_dir}: {manifest['tokenizer']}, {manifest['vocab_size']} "
                          f"tokens" + ("" if ok else f"; the model is set to vocab_size={vocab_size}: set "
                                                       f"vocab_size=None or prepare matching data")))
    if dev_mem_gb:
        gates.append(memory_gate(model_config, world, dev_mem_gb, dtype_bytes))
    else:
        gates.append(gate("memory_fit", "skip", None, None, "not on a GPU: give gpu_mem_gb to plan for one"))
    ckpt_bytes = 12 * counts["total"]  # fp32 weights (4) and AdamW's two moments (8)
    need = ckpt_bytes * (keep_last + (1 if save_best else 0))
    detail = f"{keep_last} + best checkpoints of {ckpt_bytes / 1e9:.2f} GB = {need / 1e9:.1f} GB"
    if free_disk is None:
        gates.append(gate("checkpoint_disk", "skip", need, None, f"{detail}: planning for another machine"))
    else:
        gates.append(gate("checkpoint_disk", "block" if need > free_disk else "warn" if need > 0.8 * free_disk
                          else "pass", need, free_disk, f"{detail} against {free_disk / 1e9:.1f} GB free"))
    if launched != world:
        gates.append(gate("world_size", "skip", launched, world, f"planning for {world} ranks from {launched}"))
    else:
        wrong = expect_world_size and expect_world_size != world
        gates.append(gate("world_size", "block" if wrong else "pass", world, expect_world_size or "any",
                          f"launched {world} ranks" + (f", the config expects {expect_world_size}: launch "
                                                       f"--nproc_per_node={expect_world_size}" if wrong else "")))
    if runtime is None:
        gates.append(gate("attention_backend_runtime", "skip", attn_backend, None,
                          "planned from another machine: sanity.py on the pod checks the kernels"))
    else:
        try:
            chosen, note = resolve_backend(attn_backend, *runtime, model_config.head_dim, doc_mask)
            gates.append(gate("attention_backend_runtime", "pass", chosen, None, note))
        except ValueError as e:
            gates.append(gate("attention_backend_runtime", "block", attn_backend, None, first_line(e)))
    plan = dict(params=counts, flops_per_token=flops_per_token(model_config), planned_tokens=tokens,
                tokens_per_param=per_param, dist_mode=dist_mode, grad_ckpt=grad_ckpt,
                memory=memory_estimate(model_config, micro_batch_size, world, sharded=dist_mode == "fsdp",
                                       activation_checkpointing=grad_ckpt, compute_bytes=dtype_bytes),
                memory_ddp=memory_estimate(model_config, micro_batch_size, world, activation_checkpointing="none",
                                           compute_bytes=dtype_bytes),
                memory_sharded=memory_estimate(model_config, micro_batch_size, world, sharded=True,
                                               activation_checkpointing="full", compute_bytes=dtype_bytes))
    return gates, plan


def time_gate(tokens_per_sec, source, world):
    """time_and_cost: hours and dollars of the planned tokens, and where a guard would stop the run."""
    tokens = max_steps * total_batch_tokens
    hours = tokens / tokens_per_sec / 3600
    usd = hours * world * usd_per_gpu_hour
    limits = []
    if max_hours and hours > max_hours:
        limits.append(("max_hours", max_hours / hours))
    if budget_usd and usd_per_gpu_hour and usd > budget_usd:
        limits.append(("budget_usd", budget_usd / usd))
    detail = f"{tokens_per_sec:,.0f} tokens/s ({source}): {hours:.2f} h" + (f", ${usd:,.0f}" if usd_per_gpu_hour else "")
    if not limits:
        return gate("time_and_cost", "pass", hours, max_hours or None, detail)
    name, fraction = min(limits, key=lambda x: x[1])
    steps = int(max_steps * fraction)
    return gate("time_and_cost", "block" if gate_profile == "release" else "warn", hours, max_hours or budget_usd,
                f"{detail}: {name} stops it near step {steps} of {max_steps}, before the schedule ends: "
                f"lower max_steps to ~{steps} so the learning rate decays in time")


def write_preflight(path, report):
    write_json(os.path.join(path, "preflight.json"), report)
    lines = [f"# preflight: {report['verdict']} ({report['profile']} profile)", "",
             "| gate | verdict | value | threshold | detail |", "|---|---|---|---|---|"]
    for g in report["gates"]:
        value = f"{g['value']:.4g}" if isinstance(g["value"], float) else g["value"]
        lines.append(f"| {g['name']} | {g['verdict']} | {value} | {g['threshold']} | {g['detail']} |")
    write_atomic(os.path.join(path, "preflight.md"), "\n".join(lines) + "\n")


def verdict_of(gates):
    verdicts = {g["verdict"] for g in gates}
    return "block" if "block" in verdicts else "warn" if "warn" in verdicts else "pass"


def finish_preflight(report, master):
    """--preflight_only: write and print the report; exit 1 when a gate blocks."""
    report["verdict"] = verdict_of(report["gates"])
    if master:
        os.makedirs(out_dir, exist_ok=True)
        write_preflight(out_dir, report)
        for g in report["gates"]:
            print(f"{g['verdict']:>5}  {g['name']}: {g['detail']}")
        print(f"preflight: {report['verdict']} ({gate_profile} profile), report in {out_dir}/preflight.md")
    if dist.is_initialized():
        dist.destroy_process_group()
    if report["verdict"] == "block":
        raise SystemExit(1)


def measure_tokens_per_sec(model, loader, dev, autocast):
    """This rank's forward+backward tokens/s: 2 warm-up and 3 timed micro-steps; the gradients are dropped."""
    x, y = loader.batch(range(micro_batch_size), dev)
    for i in range(5):
        if i == 2:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
        with autocast:
            loss = model(x, y)[1]
        loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return 3 * micro_batch_size * block_size / (time.time() - t0)


# -----------------------------------------------------------------------------
# dry run: the real config for a few steps, a checkpoint halfway, and a resume from it in the
# same invocation that must reproduce the second half; everything a long run needs, in minutes

def dryrun(argv, n):
    ddp, master = "RANK" in os.environ, int(os.environ.get("RANK", 0)) == 0
    if n < 2:
        fail(f"dryrun_steps={n}: need at least 2 (a checkpoint at half, then the resume)")
    half, root = n // 2, out_dir
    if master:  # the dry run's folders are scratch: each dry run starts from nothing
        for sub in ("first", "resumed"):
            shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
    common = ["--dryrun_steps=0", f"--max_steps={n}", "--log_every=1", f"--eval_every={n}", "--save_best=False",
              "--early_stop_patience=0", f"--keep_last={n}"]
    first, activity = main([*argv, *common, f"--out_dir={root}/first", "--resume=never", f"--ckpt_every={half}"],
                           keep_group=True)
    resumed, _ = main([*argv, *common, f"--out_dir={root}/resumed", f"--ckpt_every={n}",
                       f"--resume={root}/first/ckpt/step_{half:07d}"], keep_group=True)
    activities = [activity]
    if ddp:
        activities = [None] * dist.get_world_size()
        dist.all_gather_object(activities, activity)
    report = dryrun_report(root, n, first, resumed, activities) if master else None
    if ddp:  # every rank leaves together: one exiting while another still works can abort gloo
        verdict = [report]
        dist.broadcast_object_list(verdict)
        report = verdict[0]
        dist.barrier()
        dist.destroy_process_group()
    if report["problems"]:
        if master:
            fail(f"dry run failed: {'; '.join(report['problems'])} (report in {root}/dryrun.json)")
        raise SystemExit(1)
    if master:
        print(f"dry run ok: {n} steps on {len(activities)} rank(s), loss {report['loss_first']:.4f} -> "
              f"{report['loss_last']:.4f}, resume from step {n // 2} reproduces steps {n // 2 + 1}..{n} (largest "
              f"difference {report['resume_check']['max_rel_diff']:.2g}), {report['tokens_per_sec']:,.0f} tokens/s, "
              f"peak {report['peak_mem_gb']:.2f} GB | {root}/dryrun.json")
    return report, activity


def dryrun_report(root, n, first, resumed, activities):
    """Rank 0's verdict on the two passes, written to root/dryrun.json; `problems` lists what is off."""
    half, problems = n // 2, []
    # training rows with a loss (a non-finite one is written as null, and counted in nonfinite_steps)
    a, b = ({m["step"]: m for m in read_metrics(os.path.join(root, run, "metrics.jsonl")) if m.get("loss") is not None}
            for run in ("first", "resumed"))
    tolerance = 1e-5 if activities[0]["dtype"] == "float32" else 1e-2  # bf16 kernels may reduce in another order
    diffs = {k: abs(b[k]["loss"] - a[k]["loss"]) / abs(a[k]["loss"]) for k in range(half + 1, n + 1) if k in a and k in b}
    worst = max(diffs.values(), default=float("inf"))
    if len(diffs) != n - half or not worst <= tolerance:
        problems.append(f"the resumed run does not reproduce steps {half + 1}..{n}: largest relative loss "
                        f"difference {worst:.3g} (tolerance {tolerance:g})")
    idle = [x["rank"] for x in activities if x["steps"] != n]
    if idle:
        problems.append(f"ranks {idle} did not run all {n} steps")
    if first["nonfinite_steps"]:
        problems.append(f"{first['nonfinite_steps']} non-finite steps")
    losses = [a[k]["loss"] for k in sorted(a)]
    k = max(1, len(losses) // 4)
    trend = (sum(losses[:k]) / k, sum(losses[-k:]) / k)
    if trend[1] > trend[0]:
        problems.append(f"the loss rose: {trend[0]:.4f} over the first {k} steps, {trend[1]:.4f} over the last {k}")
    report = dict(ok=not problems, problems=problems, steps=n, world_size=len(activities), ranks=activities,
                  tokens_per_sec=a[max(a)]["tokens_per_sec"], peak_mem_gb=max(x["peak_mem_gb"] for x in activities),
                  loss_first=trend[0], loss_last=trend[1], spikes=first["spikes"],
                  resume_check=dict(from_step=half, steps=sorted(diffs), max_rel_diff=worst, tolerance=tolerance),
                  first=first, resumed=resumed)
    write_json(os.path.join(root, "dryrun.json"), report)
    return report


# -----------------------------------------------------------------------------

def main(argv, keep_group=False):
    """One run; returns rank 0's summary (None elsewhere) and this rank's activity. keep_group: leave
    the process group up for a second run in this process (the dry run)."""
    t_start = time.time()
    config = configurator.configure(__file__, argv)
    globals().update(config)
    check_config()
    if dryrun_steps:
        return dryrun(argv, dryrun_steps)

    # preemption notices: note them here, act on them at the next step boundary, on every rank together
    stop_signal = []

    def on_signal(signum, frame):
        if stop_signal and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        stop_signal.append(signal.Signals(signum).name)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, on_signal)

    # device and process group: torchrun's ranks each on its own GPU; fsdp without torchrun is a group of one
    fsdp = dist_mode == "fsdp"
    proc = setup(device, group=fsdp)
    dev, rank, world, torchrun, distributed = proc.dev, proc.rank, proc.world, proc.torchrun, proc.distributed
    use_cuda = dev.type == "cuda"
    if use_cuda:
        torch.set_float32_matmul_precision(matmul_precision)  # not on CPU: it would change fp32 results there
    master = rank == 0
    log = print if master else (lambda *a, **k: None)

    def warn(message):
        if master:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    dt_name = dtype if dtype != "auto" else ("bfloat16" if use_cuda and torch.cuda.is_bf16_supported() else "float32")
    if dt_name not in ("float32", "bfloat16", "float16"):
        fail(f"dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
    ptdtype = getattr(torch, dt_name)
    autocast = nullcontext() if ptdtype == torch.float32 else torch.autocast(dev.type, dtype=ptdtype)

    # batch arithmetic
    tokens_per_micro = micro_batch_size * block_size * world
    if total_batch_tokens % tokens_per_micro:
        fail(f"total_batch_tokens={total_batch_tokens} is not a multiple of micro_batch_size*block_size*world_size"
             f" = {micro_batch_size}*{block_size}*{world} = {tokens_per_micro}: use a multiple of {tokens_per_micro}")
    grad_accum = total_batch_tokens // tokens_per_micro
    global_batch = total_batch_tokens // block_size  # sequences per optimizer step

    # data (a preflight can plan without it)
    manifest = None
    try:
        manifest = load_manifest(data_dir)
    except ValueError as e:
        if not (preflight_only and not os.path.exists(data_dir)):
            fail(str(e))
    if manifest is not None:
        for name in manifest["tokenizer_files"] + [manifest["token_counts"]]:
            if not os.path.isfile(os.path.join(data_dir, name)):
                fail(f"{data_dir} has no {name}, which its manifest.json lists: rebuild the data with prepare.py --force")
        if vocab_size is not None and vocab_size < manifest["vocab_size"]:
            fail(f"vocab_size={vocab_size} but {data_dir} was tokenized with {manifest['tokenizer']} "
                 f"({manifest['vocab_size']} tokens): set vocab_size=None or prepare matching data")
        train_data = Loader(data_dir, "train", manifest, block_size, seed)
        val_data = Loader(data_dir, "val", manifest, block_size, seed)
    vocab = vocab_size or (manifest["vocab_size"] if manifest else plan_vocab_size)
    if not vocab:
        fail(f"no data in {data_dir} to take the vocabulary from: prepare it, or set plan_vocab_size to plan without it")
    rare = None
    if inject_spike_at_step >= 0:
        rare = rarest_tokens(np.load(os.path.join(data_dir, manifest["token_counts"])))
    try:
        model_config = GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer,
                                 n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd, ffn_hidden=ffn_hidden,
                                 rope_theta=rope_theta, tie_embeddings=tie_embeddings,
                                 vocab_multiple=vocab_multiple, init_std=init_std, attn_backend=attn_backend,
                                 doc_mask=doc_mask, bos_id=manifest["bos_id"] if manifest else None,
                                 grad_ckpt=grad_ckpt, loss_chunk=loss_chunk)
    except ValueError as e:
        fail(f"{e}: change the model shape")

    # preflight: the gates that need no model on the device, on rank 0, before anything is allocated
    dev_mem_gb = gpu_mem_gb or (torch.cuda.get_device_properties(dev).total_memory / 1e9 if use_cuda else 0)
    disk = os.path.abspath(out_dir)
    while not os.path.exists(disk):
        disk = os.path.dirname(disk)
    # planning from a CPU for a GPU pod: the config's world size, no local disk or speed
    planning = preflight_only and bool(gpu_mem_gb) and not use_cuda
    plan_world = expect_world_size if planning and not torchrun and expect_world_size else world
    report = [None]
    if master:
        gates, plan = preflight_gates(model_config, manifest, plan_world, world, dev_mem_gb,
                                      4 if dt_name == "float32" else 2, None if planning else shutil.disk_usage(disk).free,
                                      None if planning else (dev, ptdtype))
        report = [dict(profile=gate_profile, gates=gates, plan=plan)]
    if distributed:
        dist.broadcast_object_list(report)
    report = report[0]
    blocks = [g for g in report["gates"] if g["verdict"] == "block"]
    if blocks and not allow_unsafe and not preflight_only:
        fail("preflight blocks: " + "; ".join(f"{g['name']}: {g['detail']}" for g in blocks)
             + " (or allow_unsafe=True to train anyway)")
    for g in blocks if allow_unsafe else []:
        warn(f"preflight gate {g['name']} blocks, allow_unsafe=True goes on: {g['detail']}")

    # model
    torch.manual_seed(seed)
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    flops_tok = flops_per_token(model_config)
    peak = peak_flops(torch.cuda.get_device_name(dev)) if use_cuda else None
    # time and cost: at a planned throughput, or measured here on the real model (not for a plan of another machine)
    tokens_per_sec, source = planned_tokens_per_sec, "planned_tokens_per_sec"
    if not tokens_per_sec and planned_mfu:
        plan_peak = peak_flops(plan_gpu) if plan_gpu else peak
        if plan_peak is None:
            fail("planned_mfu needs a known GPU's peak: set plan_gpu to one of H200, H100 SXM, H100 PCIe, A100")
        tokens_per_sec = planned_mfu * plan_peak * plan_world / flops_tok
        source = f"planned_mfu={planned_mfu:g} of {plan_gpu or torch.cuda.get_device_name(dev)}"
    measure = not tokens_per_sec and manifest is not None and not planning \
        and not any(g["name"] == "memory_fit" and g["verdict"] == "block" for g in report["gates"])
    if preflight_only and not measure:
        if tokens_per_sec:
            report["gates"].append(time_gate(tokens_per_sec, source, plan_world))
        else:
            report["gates"].append(gate("time_and_cost", "skip", None, None, "give planned_mfu (and plan_gpu) or "
                                        "planned_tokens_per_sec to plan another machine's time"))
        return finish_preflight(report, master)
    try:  # resolved before the model runs (and before torch.compile traces it); the choice is logged
        attn_note = resolve_backend(attn_backend, dev, ptdtype, model_config.head_dim, doc_mask)[1]
    except ValueError as e:
        fail(str(e))
    log(f"attention: {attn_note}")
    raw_model = GPT(model_config).to(dev)
    if fsdp:
        shard_model(raw_model, dev, ptdtype)
    if measure:
        tokens_per_sec = mean_over_ranks(measure_tokens_per_sec(raw_model, train_data, dev, autocast), distributed,
                                         dev) * world
        source = f"measured here, {world} x {dev.type}"
    if tokens_per_sec:
        report["gates"].append(time_gate(tokens_per_sec, source, world))
    if preflight_only:
        return finish_preflight(report, master)
    optimizer = make_optimizer(raw_model, fused=use_cuda)
    scaler = torch.amp.GradScaler(enabled=ptdtype == torch.float16)
    counts = param_counts(model_config)
    saved = dict(config, model={k: v for k, v in asdict(model_config).items() if k != "padded_vocab"},
                 world_size=world, grad_accum=grad_accum, data_fingerprint=manifest["fingerprint"],
                 tokenizer_fingerprint=tokenizer_fingerprint(data_dir, manifest))

    # the loop's state: all of it goes into every checkpoint, so a resumed run continues exactly
    state = SimpleNamespace(step=0, samples=0, elapsed=0.0, cost_usd=0.0, best_val_loss=float("inf"), best_step=-1,
                            evals_since_best=0, loss_ema=None, spikes=0, nonfinite_steps=0, bad_in_a_row=0,
                            rollbacks=0, lr_scale=1.0, injected=[])

    def sharded_state():
        """Model and optimizer as DCP saves and loads them: by parameter name, sharded under fsdp."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # see shard_model
        return dict(zip(("model", "optimizer"), get_state_dict(raw_model, optimizer), strict=True))

    def restore(ckpt):
        if "state" in ckpt:  # sharded: DCP reads each rank's part, resharded to this world size and dist_mode
            from torch.distributed.checkpoint.state_dict import set_state_dict  # see shard_model
            sd = sharded_state()
            load_sharded(sd, ckpt["state"])
            set_state_dict(raw_model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        elif fsdp:  # a ddp checkpoint: every rank holds it whole and keeps its shard
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)
            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(raw_model, ckpt["model"], options=full)
            set_optimizer_state_dict(raw_model, optimizer, optimizer_by_name(raw_model, optimizer, ckpt["optimizer"]),
                                     options=full)
        else:
            raw_model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        trainer = ckpt["trainer"]
        for key in vars(state):
            setattr(state, key, trainer[key])
        if len(trainer["rng"]) == world:
            set_rng_state(trainer["rng"][rank])
        else:  # training uses no randomness; only the per-rank RNGs restart
            warn(f"world size {len(trainer['rng'])} -> {world}: same batches, per-rank RNG states re-seeded")

    # resume
    ckpt_root = os.path.join(out_dir, "ckpt")
    ckpt_path, ckpt = None, None
    earlier = os.path.isdir(ckpt_root) and any(d.startswith("step_") for d in os.listdir(ckpt_root))
    if resume == "never" and earlier:  # its checkpoints and ckpt/best would mix with this run's
        fail(f"resume=never but {ckpt_root} holds checkpoints of an earlier run: use a new out_dir, or move them away")
    if resume == "auto":
        ckpt_path, ckpt = newest_good_checkpoint(ckpt_root, dev, warn)
        if ckpt is None and earlier:
            fail(f"no checkpoint in {ckpt_root} reads back intact (see the warnings): move them away to start over, "
                 f"or give resume= a checkpoint folder")
    elif resume != "never":
        ckpt_path = find_checkpoint(resume)
        if ckpt_path is None:
            fail(f"resume={resume}: no checkpoint there (give a checkpoint folder or an out_dir with ckpt/latest)")
        try:
            ckpt = load_checkpoint(ckpt_path, dev)
        except ValueError as e:
            fail(f"checkpoint {ckpt_path} is damaged: {e}: give another checkpoint folder or --resume=auto")
    if ckpt is not None:
        old = ckpt["config"]
        shape = {k: v for k, v in saved["model"].items() if k not in RUNTIME_FIELDS}  # the rest may change
        if any(old["model"].get(k) != v for k, v in shape.items()):
            diff = ", ".join(f"{k} {old['model'].get(k)} -> {v}" for k, v in shape.items() if old["model"].get(k) != v)
            fail(f"checkpoint {ckpt_path} has another model shape ({diff}): use a new out_dir, or the checkpoint's shape")
        if old["tokenizer_fingerprint"] != saved["tokenizer_fingerprint"] and not allow_resume_mismatch:
            fail(f"checkpoint {ckpt_path} was trained with another tokenizer ({old['tokenizer_fingerprint']}) than "
                 f"{data_dir} ({saved['tokenizer_fingerprint']}): point data_dir at its data, or --allow_resume_mismatch=True")
        if old["data_fingerprint"] != saved["data_fingerprint"] and not allow_resume_mismatch:
            fail(f"checkpoint {ckpt_path} was trained on other data than {data_dir} (manifest fingerprint differs): "
                 f"point data_dir at its data, or --allow_resume_mismatch=True to continue on this data")
        restore(ckpt)
        del ckpt
    # the guards also count what a killed run spent after its last checkpoint (clock.json, see tick)
    clock_path = os.path.join(out_dir, "clock.json")
    if resume != "never" and os.path.exists(clock_path):
        try:
            with open(clock_path) as f:
                clock = json.load(f)
            state.elapsed = max(state.elapsed, float(clock["elapsed"]))
            state.cost_usd = max(state.cost_usd, float(clock["cost_usd"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            warn(f"ignoring {clock_path} ({first_line(e)}): time and cost count from the checkpoint")

    # out_dir must take writes before any step is spent (each rank its own probe: they run at once)
    probe = os.path.join(out_dir, f".write-test-{rank}")
    try:
        os.makedirs(ckpt_root, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        fail(f"out_dir {out_dir} is not writable ({first_line(e)}): choose another out_dir")
    if master:
        report["verdict"] = verdict_of(report["gates"])
        write_preflight(out_dir, report)
    if distributed:
        dist.barrier()

    model = torch.compile(raw_model, mode=compile_mode) if compile else raw_model
    if distributed and not fsdp:
        model = DDP(model, device_ids=[dev.index] if use_cuda else None)
    if distributed:
        LIVE_MODELS.append(model)

    log("config: " + json.dumps(config))
    log(f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{flops_tok / 1e9:.3f} GFLOP/token | data: {manifest['tokenizer']}, {train_data.n:,} train and "
        f"{val_data.n:,} validation windows | "
        f"world {world} x micro {micro_batch_size} x accum {grad_accum} = {total_batch_tokens} tokens/step | "
        f"{dev} {dt_name}")
    if ckpt_path:
        log(f"resumed from {ckpt_path} at step {state.step} ({format_seconds(state.elapsed)} and "
            f"${state.cost_usd:.2f} so far)")

    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if master:
        rewrite_metrics(metrics_path, state.step)
    metrics = open(metrics_path, "a") if master else None

    def write_metrics(row):
        if master:  # strict JSON: a non-finite value is written as null (its event line says what it was)
            row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    def event(name, message, **fields):
        write_metrics(dict(step=state.step, event=name, **fields))
        warn(f"step {state.step}: {message}")

    def evaluate():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(eval_steps):
                first = ((i * world + rank) * micro_batch_size) % val_data.n
                x, y = val_data.batch((np.arange(micro_batch_size) + first) % val_data.n, dev)
                with autocast:
                    total += raw_model(x, y)[1].item()
        model.train()
        return mean_over_ranks(total / eval_steps, distributed, dev)

    def checkpoint(val_loss, best):
        """Save the current step with every rank's RNG state, on rank 0 (fsdp: every rank writes its
        shards); the seconds it took."""
        t0 = time.time()
        states = [None] * world
        if distributed:
            dist.all_gather_object(states, rng_state())
        else:
            states = [rng_state()]
        files = {}
        if master:
            trainer = dict(vars(state), format=CKPT_FORMAT, tokens=state.step * total_batch_tokens,
                           val_loss=val_loss, rng=states, world_size=world)
            files = {"trainer.pt": trainer, "config.json": json.dumps(saved, indent=1).encode()}
            if not fsdp:
                files.update({"model.pt": raw_model.state_dict(), "optimizer.pt": optimizer.state_dict()})
            for f in manifest["tokenizer_files"]:  # the folder is enough to sample from
                with open(os.path.join(data_dir, f), "rb") as fh:
                    files[f] = fh.read()
        if fsdp:  # every rank writes its shards
            path = save_checkpoint(ckpt_root, state.step, files, keep_last, best, ckpt_min_free_gb,
                                   sharded=sharded_state())
        elif master:
            path = save_checkpoint(ckpt_root, state.step, files, keep_last, best, ckpt_min_free_gb)
        if master:
            if path:
                log(f"checkpoint {path} ({time.time() - t0:.1f}s)", flush=True)
            if time.time() - t0 > PREEMPT_SAVE_SECONDS:
                warn(f"that save took {time.time() - t0:.0f}s: more than the ~30 s torchrun and most clouds leave "
                     f"between SIGTERM and SIGKILL, so a preemption would lose the steps since the last checkpoint; "
                     f"write checkpoints to a faster local disk")
        if distributed:
            dist.barrier()  # every rank leaves with the checkpoint on disk (a rollback may read it next)
        return time.time() - t0

    # timing for the guards: wall clock and spend accrue step by step, startup included
    t_last = t_start
    step_seconds = 0.0
    # until a save is measured: the fsyncs, and weights + AdamW's 2 moments at 200 MB/s
    save_seconds = 0.5 + 3 * tensor_bytes(raw_model.state_dict()) / 200e6
    eval_seconds = 0.0
    next_budget_check = 0.0
    gpu_rate = world * usd_per_gpu_hour / 3600  # dollars per wall-clock second

    def tick():
        nonlocal t_last
        now = time.time()
        state.elapsed += now - t_last
        state.cost_usd += (now - t_last) * gpu_rate
        t_last = now

    def guard():
        """Rank 0's verdict: the name of the guard that must stop the run now, or None. The
        reserve is what one more step and the final save take, so no limit is crossed."""
        nonlocal next_budget_check
        reserve = step_seconds + eval_seconds + save_seconds
        if max_hours and state.elapsed + reserve > max_hours * 3600:
            return "max_hours"
        if budget_usd and usd_per_gpu_hour and state.cost_usd + reserve * gpu_rate > budget_usd:
            return "budget_usd"
        if budget_file and time.time() >= next_budget_check:
            next_budget_check = time.time() + budget_check_minutes * 60
            read = read_budget_file(budget_file)
            if isinstance(read, str):
                warn(f"budget_file {budget_file} unreadable ({read}); retrying in {budget_check_minutes} min")
                return None
            spent, projected = read
            if spent > budget_usd:
                return "budget_file_spent"
            if projected > budget_usd:
                return "budget_file_projected"
            if spent > BUDGET_WARN * budget_usd:
                event("budget_warning", f"spent ${spent:.2f} of budget_usd=${budget_usd:.2f} "
                      f"(projected ${projected:.2f})", spent_usd=spent, projected_total_usd=projected)
        return None

    def agree(loss_sum, finite, guard_reason):
        """One all-reduce per step: the summed loss, and whether any rank saw a non-finite step,
        a signal, or (rank 0) a guard. Every rank then takes the same decisions."""
        flags = [0.0 if finite else 1.0, 1.0 if stop_signal else 0.0,
                 float(STOP_REASONS.index(guard_reason) + 1) if guard_reason else 0.0]
        v = torch.cat([loss_sum.float().reshape(1), torch.tensor(flags, device=dev)])
        if distributed:
            dist.all_reduce(v)
        v = v.tolist()
        reason = STOP_REASONS[int(v[3]) - 1] if v[3] else ("signal" if v[2] else None)
        return v[0] / grad_accum / world, v[1] == 0, reason

    def rollback():
        """Back to the newest good checkpoint at half the learning rate; None, or why that cannot be."""
        if state.rollbacks >= max_rollbacks:
            return (f"{max_bad_steps} bad steps in a row after {state.rollbacks} rollbacks (max_rollbacks="
                    f"{max_rollbacks}): the run diverges; lower learning_rate or check the data")
        path, ckpt = newest_good_checkpoint(ckpt_root, dev, warn)
        if ckpt is None:
            return (f"{state.bad_in_a_row} bad steps in a row at step {state.step} and no checkpoint to roll back to: "
                    f"lower learning_rate, raise warmup_steps, or check the data")
        keep = dict(elapsed=state.elapsed, cost_usd=state.cost_usd, spikes=state.spikes,
                    nonfinite_steps=state.nonfinite_steps, injected=state.injected,
                    rollbacks=state.rollbacks + 1, lr_scale=state.lr_scale * 0.5)
        bad_at = state.step
        restore(ckpt)
        vars(state).update(keep, bad_in_a_row=0)
        event("rollback", f"{max_bad_steps} bad steps in a row up to step {bad_at}: rolled back to {path}, "
              f"learning rate x {state.lr_scale:g} (rollback {state.rollbacks} of {max_rollbacks})",
              from_step=bad_at, lr_scale=state.lr_scale, rollbacks=state.rollbacks)
        return None

    def injecting(kind, at):
        """Whether this step is one of the drill's; each drill step fires once, even if a rollback replays it."""
        tag = f"{kind}@{state.step + 1}"  # steps are numbered as logged: the first one is step 1
        if at < 0 or not at <= state.step + 1 < at + INJECT_STEPS or tag in state.injected:
            return False
        state.injected.append(tag)
        return True

    def micro_batch(micro, spike_drill):
        """This rank's slice of the step's global batch: disjoint across ranks and micro-steps."""
        first = state.samples + (micro * world + rank) * micro_batch_size
        if spike_drill:
            return rare_token_batch(rare, micro_batch_size, block_size, [seed, state.step, first], dev)
        return train_data.train_batch(first, micro_batch_size, dev)

    bpb_scale = manifest["splits"]["val"]["tokens"] / manifest["splits"]["val"]["bytes"] / math.log(2)
    t_log, step_at_log = time.time(), state.step
    val_loss, loss = None, None
    saved_step = state.step if ckpt_path else -1
    ckpt_pending, diverged = False, None
    tick()
    reason = guard() if master else None  # a resumed run may already be past a limit
    if distributed:
        reason = agree(torch.zeros(1, device=dev), True, reason)[2]
    if reason:
        log(f"not training: {reason} already reached at step {state.step}")

    while state.step < max_steps and not reason:
        t_step = time.time()
        lr = lr_at(state.step) * state.lr_scale
        for g in optimizer.param_groups:
            g["lr"] = lr
        spike_drill, nan_drill = injecting("spike", inject_spike_at_step), injecting("nan", inject_nan_at_step)
        loss_sum = torch.zeros((), device=dev)
        batch = micro_batch(0, spike_drill)
        for micro in range(grad_accum):
            x, y = batch
            # gradients are reduced across ranks once per step, after the last micro-step
            if fsdp:
                raw_model.set_requires_gradient_sync(micro == grad_accum - 1)
            sync = nullcontext() if fsdp or not distributed or micro == grad_accum - 1 else model.no_sync()
            with sync:
                with autocast:
                    _, micro_loss = model(x, y)
                if nan_drill and rank == world - 1:
                    micro_loss = micro_loss * float("nan")
                scaler.scale(micro_loss / grad_accum).backward()
            loss_sum += micro_loss.detach()
            if micro + 1 < grad_accum:  # read and copy the next one while the GPU still works on this one
                batch = micro_batch(micro + 1, spike_drill)
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
        if fsdp:  # a DTensor: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        # fp16's scaler skips overflowing gradients itself; any other non-finite value skips the step here
        finite = bool(torch.isfinite(loss_sum)) and (scaler.is_enabled() or bool(torch.isfinite(grad_norm)))
        tick()
        loss, finite, reason = agree(loss_sum, finite, guard() if master else None)
        if finite:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.samples += global_batch
        if spike_drill or nan_drill:
            event("drill", f"fire drill: {'a batch of the rarest tokens' if spike_drill else 'a NaN loss on the last rank'}",
                  drill="spike" if spike_drill else "nan")

        spike = finite and state.loss_ema is not None and loss > spike_factor * state.loss_ema
        if not finite:
            state.nonfinite_steps += 1
            event("nonfinite", f"non-finite loss or gradient (loss {loss}, grad norm {grad_norm.item()}): step skipped "
                  f"on every rank", loss=str(loss), grad_norm=str(grad_norm.item()))
        elif spike:
            state.spikes += 1
            event("spike", f"loss {loss:.4f} is {loss / state.loss_ema:.1f}x its recent average {state.loss_ema:.4f}",
                  loss=loss, loss_ema=state.loss_ema)
        else:
            state.loss_ema = loss if state.loss_ema is None else LOSS_EMA_DECAY * state.loss_ema + (1 - LOSS_EMA_DECAY) * loss
        state.bad_in_a_row = 0 if finite and not spike else state.bad_in_a_row + 1
        step_seconds = time.time() - t_step if step_seconds == 0 else 0.9 * step_seconds + 0.1 * (time.time() - t_step)

        if state.step % log_every == 0 or state.step == max_steps:
            now = time.time()
            tok_s = (state.step - step_at_log) * total_batch_tokens / (now - t_log)
            mfu = flops_tok * tok_s / (peak * world) if peak else None
            eta = (max_steps - state.step) * (now - t_log) / (state.step - step_at_log)
            t_log, step_at_log = now, state.step
            row = dict(step=state.step, loss=loss, lr=lr, grad_norm=grad_norm.item(),
                       tokens=state.step * total_batch_tokens, tokens_per_sec=tok_s, mfu=mfu,
                       mem_gb=peak_memory_gb(dev), elapsed=state.elapsed, cost_usd=state.cost_usd)
            write_metrics(row)
            if master:
                write_json(clock_path, dict(elapsed=state.elapsed, cost_usd=state.cost_usd))
            log(f"step {state.step}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | gnorm {row['grad_norm']:.2f} | "
                f"{tok_s:,.0f} tok/s | mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
                f"mem {row['mem_gb']:.2f} GB | eta {format_seconds(eta)}", flush=True)

        new_best, val_loss = False, None
        if reason is None and (state.step % eval_every == 0 or state.step == max_steps):
            t0 = time.time()
            val_loss = evaluate()
            eval_seconds = time.time() - t0
            new_best = val_loss < state.best_val_loss
            if new_best:
                state.best_val_loss, state.best_step, state.evals_since_best = val_loss, state.step, 0
            else:
                state.evals_since_best += 1
            write_metrics(dict(step=state.step, val_loss=val_loss, val_bpb=val_loss * bpb_scale,
                               tokens=state.step * total_batch_tokens))
            log(f"step {state.step} | val loss {val_loss:.4f} | val bpb {val_loss * bpb_scale:.4f}"
                f"{' (best)' if new_best else ''}", flush=True)
            if early_stop_patience and state.evals_since_best >= early_stop_patience:
                reason = "early_stop"

        # a periodic checkpoint waits for the end of a run of bad steps, so a rollback never lands inside one
        ckpt_pending |= state.step % ckpt_every == 0 or state.step == max_steps
        if reason == "budget_file_spent":
            break  # already over the cap: not one more byte or second
        if (ckpt_pending and state.bad_in_a_row == 0) or (new_best and save_best) or reason:
            tick()
            save_seconds = max(save_seconds, checkpoint(val_loss, new_best))  # the slowest save so far
            saved_step, ckpt_pending = state.step, False
        if reason:
            break
        if state.bad_in_a_row >= max_bad_steps:
            diverged = rollback()
            if diverged:
                reason = "diverged"
                break
            saved_step, ckpt_pending = state.step, False
            t_log, step_at_log = time.time(), state.step

    # the end: a final evaluation and checkpoint when the run completed, then summary.json
    reason = reason or "max_steps"
    if reason == "max_steps":
        if val_loss is None:  # resumed at max_steps
            val_loss = evaluate()
            if val_loss < state.best_val_loss:
                state.best_val_loss, state.best_step = val_loss, state.step
        if saved_step != state.step:
            checkpoint(val_loss, val_loss <= state.best_val_loss and save_best)
    tick()
    if master:
        status = {"max_steps": "completed", "early_stop": "completed", "diverged": "failed"}.get(reason, "stopped")
        unigram = unigram_baseline(data_dir, manifest, val_data)
        summary = dict(status=status, stop_reason=reason, signal=stop_signal[0] if stop_signal else None,
                       steps=state.step, tokens=state.step * total_batch_tokens, final_train_loss=loss,
                       final_val_loss=val_loss, best_val_loss=state.best_val_loss if state.best_step >= 0 else None,
                       best_step=state.best_step if state.best_step >= 0 else None,
                       final_val_bpb=None if val_loss is None else val_loss * bpb_scale, unigram_val_loss=unigram,
                       elapsed_s=state.elapsed, cost_usd=state.cost_usd, spikes=state.spikes,
                       nonfinite_steps=state.nonfinite_steps, rollbacks=state.rollbacks, lr_scale=state.lr_scale,
                       params=counts, flops_per_token=flops_tok, world_size=world,
                       checkpoint=find_checkpoint(out_dir), best_checkpoint=find_checkpoint(out_dir, "best"))
        write_json(os.path.join(out_dir, "summary.json"), summary)
        write_json(clock_path, dict(elapsed=state.elapsed, cost_usd=state.cost_usd))
        metrics.close()
        write_report(out_dir)  # summary.md, plots, metrics.csv, manifest.json: never raises
        if status == "completed":
            log(f"done ({reason}): {state.step} steps in {format_seconds(state.elapsed)} | "
                f"final val loss {val_loss:.4f} (best {state.best_val_loss:.4f} at step {state.best_step}, "
                f"unigram baseline {unigram:.4f}) | summary in {out_dir}/summary.json")
        elif status == "stopped":
            log(f"stopped at step {state.step} ({reason}{' ' + stop_signal[0] if reason == 'signal' else ''}) after "
                f"{format_seconds(state.elapsed)}, ${state.cost_usd:.2f} | "
                + ("no checkpoint written: already over budget_usd" if reason == "budget_file_spent"
                   else f"checkpoint {summary['checkpoint']}: the same command resumes"))
    if distributed:
        dist.barrier()  # tear gloo/nccl down together: a rank leaving while rank 0 still writes can abort
        if not keep_group:
            dist.destroy_process_group()
    if reason == "diverged":
        fail(f"{diverged} (summary in {out_dir}/summary.json)")
    activity = dict(rank=rank, device=str(dev), dtype=dt_name, steps=state.step, samples=state.samples,
                    peak_mem_gb=peak_memory_gb(dev), elapsed_s=state.elapsed)
    return (summary if master else None), activity


def exit_worker(code):
    """Exit with `code`. A torchrun worker skips the interpreter's teardown: destroying the process
    group's leftover C++ threads there aborts the process now and then ("terminate called without an
    active exception"), which torchrun reports as a failed job."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "RANK" in os.environ:
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_worker(0)
