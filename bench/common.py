"""
What the bench/ probes share: their config, the device they measure, the clock, the
training step they time, and the result line each one appends.

Every probe is a script with its settings as commented globals between the config markers
(podgpt/core/configurator.py; --help lists them). A probe that measures a training run (mfu, memory,
loader, vs_hf) also takes the run the way train.py does: config files and train.py's keys.
Each invocation appends ONE JSON line to bench/results/<probe>.jsonl (or --out): the probe,
the device, torch and CUDA versions, the UTC date, the exact command, and its figures.
"""

import gc
import gzip
import json
import os
import platform
import re
import shlex
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the probes measure the repo's own code: model.py and podgpt/

# after the path: these are the repo's modules
import torch
import torch.nn.functional as F

from podgpt.core import configurator
from model import (GRAD_CKPT, GPTConfig, float8_linears, fp8_recipe_unknown, fp8_unavailable,
                   residual_stream_dtype, shard_model)
from podgpt.pod.objectives import make_model
from podgpt.pod.step import clip
from podgpt.core.optim import check_optimizer, make_optimizer, master_weights_on
from podgpt.core.util import autocast, compute_dtype, driver_version, fail, peak_memory_gb, setup

TRAIN = os.path.join(ROOT, "train.py")  # a run's keys are train.py's: its config block, read as text
# train.py's keys that change the step bench/mfu.py times, besides fp8: printed and recorded with each result
STEP_KEYS = ("fused_loss", "residual_dtype", "master_weights", "fuse_projections", "fp8_head", "fp8_recipe")


# -----------------------------------------------------------------------------
# config

def configure(script_path, argv, run=False):
    """(the probe's keys, the measured run's config or None).

    The probe's own keys (its config block) are set with --key=val. A probe that measures a
    training run (run=True) takes that run as train.py would: config files and train.py's keys,
    e.g. `config/h200_1b_ddp8.py --n_layer=4 --micro_batch_size=8` (python train.py --help)."""
    if not run:
        return configurator.configure(script_path, argv), None
    own = configurator.read_defaults(script_path)
    if any(a in ("-h", "--help") for a in argv):
        print(configurator.help_text(os.path.basename(script_path), own))
        print("\nthe run it measures: config files and train.py's keys (python train.py --help), "
              "e.g. config/tiny.py --n_layer=2 --micro_batch_size=4 --device=cuda --dtype=auto")
        raise SystemExit(0)
    mine = [a for a in argv if a.startswith("--") and a[2:].partition("=")[0] in own]
    run_cfg = configurator.configure(TRAIN, [a for a in argv if a not in mine])
    if why := fp8_recipe_unknown(run_cfg["fp8_recipe"]):  # as train.py refuses it, before any work
        fail(why, 2)
    return configurator.configure(script_path, mine), run_cfg


def int_list(key, text):
    """'1,2,4' as [1, 2, 4]; anything else stops with one line naming the key and the fix."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        fail(f"{key}={text!r} is not a comma-separated list of positive integers: write e.g. --{key}=1,2,4,8")
    return values


def check_counts(cfg, *keys):
    """Stop unless each of these keys (warmup, iters, ...) is a non-negative count, iters and accum positive."""
    for key in keys:
        positive = key in ("iters", "accum")
        if cfg[key] < positive:
            fail(f"{key}={cfg[key]} must be {'positive' if positive else '>= 0'}")


# -----------------------------------------------------------------------------
# device, dtype, clock

def pick_device(name, dtype, group=False):
    """(device, compute dtype) as train.py picks them (util.setup: under torchrun this rank's GPU, and
    the process group joined, or with group=True a group of one; util.compute_dtype: auto is bfloat16 on
    CUDA, float32 on a CPU)."""
    dev = setup(name, group=group).dev
    return dev, compute_dtype(dtype, dev)


def run_device(run, group=False):
    """pick_device for a training run's config, with train.py's fp32 matmul precision on CUDA."""
    dev, dt = pick_device(run["device"], run["dtype"], group)
    if dev.type == "cuda":
        torch.set_float32_matmul_precision(run["matmul_precision"])
    return dev, dt


def device_name(dev):
    """The GPU's name (preflight.peak_flops knows it by this), or the CPU's model and core count."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu ({cpu}, {os.cpu_count()} cores)"


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def seconds_per_call(fn, dev, warmup, iters):
    """Mean wall seconds of fn() over `iters` calls, after `warmup` untimed ones (allocator, cuBLAS
    heuristics, torch.compile). CUDA kernels run asynchronously: the queue is drained before the clock
    starts and before it stops, so the time is the GPU's, not the launches'."""
    for _ in range(warmup):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / iters


def free_memory(dev):
    """Drop what an earlier measurement left (an out-of-memory try leaves cached blocks) and restart the peak."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


# -----------------------------------------------------------------------------
# the training step of a run

def ckpt_settings(key, text):
    """A comma-separated list of activation-checkpointing settings (model.GRAD_CKPT); anything else stops."""
    settings = [s.strip() for s in text.split(",") if s.strip()]
    if not settings or any(s not in GRAD_CKPT for s in settings):
        fail(f"{key}={text!r}: write a comma-separated list of {', '.join(GRAD_CKPT)}, e.g. --{key}=none,full")
    return settings


def build(mconfig, run, dev, shard=False):
    """The model, built in place on the device (a 1B model initialised on the CPU first takes a minute),
    its linear layers in float8 with fp8=True as train.py converts them, with fp8_recipe's scales (or one line
    why that cannot run here), sharded by FSDP2 with shard=True as train.py's dist_mode=fsdp shards it (its
    parameters gathered in the compute dtype), and the run's optimizer for it as train.py makes it: AdamW (fused on CUDA), or with
    master_weights bf16 parameters and MasterAdamW on their fp32 masters (optim.master_weights_on)."""
    dt = compute_dtype(run["dtype"], dev)
    if run["fp8"] and (why := fp8_unavailable(dev, dt, run["compile"])):
        fail(why, 2)
    check_optimizer(run)
    master = master_weights_on(run, dt)
    with torch.device(dev):
        model = make_model(mconfig)
    if run["fp8"]:
        float8_linears(model)
    if shard:
        shard_model(model, dev, dt)
    return model, run_optimizer(model, run, dev, master)


def run_optimizer(model, run, dev, master=False):
    """optim.make_optimizer with the run's hyperparameters, as train.py makes it (master: MasterAdamW, its
    update compiled with compile=True)."""
    return make_optimizer(model, run["learning_rate"], (run["beta1"], run["beta2"]), run["weight_decay"],
                          fused=dev.type == "cuda", master=master, compiled=run["compile"])


def built(model, optimizer, dev, dt):
    """What build() made, read off the objects (not the config), so that two result lines of different keys
    (fused_loss, residual_dtype, master_weights, fuse_projections, fp8, fp8_head) can be told apart and a key
    that did not take shows: the optimizer, the parameters' dtype, the residual stream's dtype in the step,
    whether the loss runs fused, the projections fused, and how many linear layers compute in float8."""
    raw = getattr(model, "_orig_mod", model)
    param = raw.embed_tokens.weight
    # the stream's dtype follows the embedding's output: FSDP2 gathers it in dt, and under the step's autocast
    out = torch.empty(0, dtype=dt if hasattr(param, "device_mesh") else param.dtype, device=dev)
    with autocast(dev, dt):
        stream = residual_stream_dtype(raw.config.residual_dtype, out)
    return dict(optimizer=type(optimizer).__name__, param_dtype=str(param.dtype).removeprefix("torch."),
                residual_stream=str(stream).removeprefix("torch."), loss_fused=raw.fuses_loss(raw.config),
                projections_fused=raw.config.fuse_projections,
                fp8_linears=sum(hasattr(m, "linear_mm_config") for m in raw.modules()))


def compiled(model, run):
    """The model as the run calls it: torch.compile'd with its compile_mode when compile=True.
    dynamic=False: one static graph per micro-batch shape, as a training run (one shape) gets."""
    return torch.compile(model, mode=run["compile_mode"], dynamic=False) if run["compile"] else model


def our_loss(model, x, y):
    return model(x, y)[1]


def cross_entropy(logits, y):
    """model.py's loss on a model's logits: fp32 cross-entropy over every position."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def train_step(model, optimizer, x, y, amp, loss_of, mark=None, accum=1):
    """train.py's step: for each of `accum` micro-batches (the same one each time) forward with targets under
    autocast and backward, the gradients summed; then gradient clipping, AdamW, gradients dropped. mark(phase)
    is called at the end of each phase ("forward", "backward", "optimizer"), e.g. to read the memory peak of each."""
    mark = mark or (lambda phase: None)
    sharded = getattr(model, "_orig_mod", model)  # FSDP2's: gradients reduced after the last micro-batch, as train.py
    for i in range(accum):
        if hasattr(sharded, "set_requires_gradient_sync"):
            sharded.set_requires_gradient_sync(i == accum - 1)
        with amp:
            loss = loss_of(model, x, y) / accum
        mark("forward")
        loss.backward()
        mark("backward")
    clip(optimizer, model, 1.0)  # as train.py clips (MasterAdamW: inside its update)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")


def measure_steps(model, optimizer, micro_batch, block_size, vocab, dev, dt, warmup, iters, loss_of=our_loss, accum=1):
    """Step time, tokens/s and peak memory of training steps of `accum` micro-batches each on random tokens (the
    compute does not depend on them), or oom=True when the micro-batch does not fit. Peak memory: torch.cuda.max_memory_allocated
    on a GPU; on a CPU the process's peak RSS (util.peak_memory_gb), which counts everything the process
    ever held."""
    free_memory(dev)
    row = dict(micro_batch=micro_batch, accum=accum, tokens=accum * micro_batch * block_size)
    try:
        # podgpt's model takes what its objective trains on (bd3lm: noise draws); transformers' takes token ids
        config = getattr(model, "config", None)
        x, y = config.random_batch(micro_batch, dev, block_size) if isinstance(config, GPTConfig) else (
            torch.randint(0, vocab, (micro_batch, block_size), device=dev) for _ in range(2))
        seconds = seconds_per_call(lambda: train_step(model, optimizer, x, y, autocast(dev, dt), loss_of, accum=accum),
                                   dev, warmup, iters)
    except torch.cuda.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return dict(row, oom=True)  # returning drops the traceback, and with it what the failed step held
    return dict(row, step_time_s=seconds, tokens_per_sec=row["tokens"] / seconds, peak_mem_gb=peak_memory_gb(dev),
                peak_mem_kind="max_memory_allocated" if dev.type == "cuda" else "process_peak_rss")


# the GPU's kernels by what they do: the first kind whose pattern starts the kernel's name (after "void "), so a kernel
# is known by its family, never by a word inside its name: torch.compile's Triton kernels that cast and scale for
# fp8 hold "scaled_mm" and are no matmul; cuDNN's attention kernels hold "wgmma". "optimizer" holds AdamW's
# multi-tensor kernels (clipping's norm kernels are "other"). Where a step's time goes against the matmul ceiling.
KERNEL_KINDS = (("matmul", r"(?!triton)(nvjet|cutlass|cublas|sm\d+_xmma|xmma|wgmma|\w*gemm)"),  # GEMM libraries
                ("attention", r"(?!triton)(cudnn|\w*flash|\w*fmha|\w*attn|\w*attention)"),
                ("fused by torch.compile", r"triton"),
                ("optimizer", r".*(multi_tensor|adam|foreach)"),
                ("copies", r"memcpy|memset"))


def kernel_kind(name):
    """The kind (KERNEL_KINDS, else "other") of the GPU kernel called name."""
    name = name.lower().removeprefix("void ")
    return next((kind for kind, pattern in KERNEL_KINDS if re.match(pattern, name)), "other")


def trace_steps(model, optimizer, micro_batch, block_size, dev, dt, path, step_time_s, steps=3, accum=1):
    """A torch.profiler trace of `steps` training steps (warmed up already: measure_steps ran them, step_time_s
    each) as a Chrome trace at path (gzipped when it ends in .gz; chrome://tracing or ui.perfetto.dev), and the ops
    that took the most time on the device (the CPU's, without a GPU), printed: where a step loses time against the
    matmul ceiling. Returns the trace's kernel_time."""
    from torch.profiler import ProfilerActivity, profile
    x, y = model.config.random_batch(micro_batch, dev, block_size)
    gpu = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu, record_shapes=True) as prof:
        for _ in range(steps):
            train_step(model, optimizer, x, y, autocast(dev, dt), our_loss, accum=accum)
        if gpu:
            torch.cuda.synchronize(dev)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="self_device_time_total" if gpu else "self_cpu_time_total",
                                    row_limit=25))
    return kernel_time(path, steps * step_time_s)


def kernel_micros(path):
    """{kind: microseconds} of the GPU's kernels in the Chrome trace at path (gzipped if it ends in .gz), every kind
    of KERNEL_KINDS and "other". Only the GPU's own events count: the profiler's annotations of the GPU timeline (a
    compiled graph's call, the optimizer step) span kernels and would count them twice."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        work = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    micros = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for e in work:
        micros[kernel_kind(e["name"])] += e["dur"]
    return micros


def kernel_time(path, seconds=None):
    """The GPU's time in the Chrome trace at path (gzipped if it ends in .gz), shared out by kind of kernel
    (KERNEL_KINDS, the rest "other"), and, given the seconds the traced steps take unprofiled, the kernels' seconds
    over those ("busy": a share of the time when one stream runs at a time); None when the trace holds no GPU work
    (a CPU's)."""
    micros = kernel_micros(path)
    total = sum(micros.values())
    if not total:
        return None
    shares = {kind: t / total for kind, t in micros.items()}
    if seconds:
        shares["busy"] = total / 1e6 / seconds
    print("GPU time by kind of kernel: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()))
    return shares


# -----------------------------------------------------------------------------
# the result line

def command_line():
    """The command as typed: the interpreter invocation and sys.argv; under torchrun the launcher's
    command (this worker's parent process) when it can be read."""
    argv = sys.orig_argv
    if "LOCAL_RANK" in os.environ:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")[:-1] or argv
        except OSError:
            pass
    return shlex.join(argv)


def write_result(probe, out, dev, figures):
    """Append the result line to `out` (default bench/results/<probe>.jsonl); returns its path."""
    path = out or os.path.join(ROOT, "bench", "results", f"{probe}.jsonl")
    record = dict(probe=probe, device=device_name(dev), torch=torch.__version__, cuda=torch.version.cuda,
                  driver=driver_version() if dev.type == "cuda" else None,
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=command_line(), **figures)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"result appended to {path}")
    return path


def fmt(value, spec=".3g"):
    """A figure for the console tables; None (unknown, not measured) as '-'."""
    return "-" if value is None else format(value, spec)
