"""
Sanity checks before paying for a run: does this machine compute what the configured run needs,
correctly, and does the model fit? Each check passes, fails or is skipped, with its seconds and a
detail line, into out_dir/sanity.json and .md; exit status 1 when any check failed on any rank
(under torchrun every rank runs run_checks' list on its own GPU; rank 0 writes the report).

    python sanity.py config/tiny.py
    python sanity.py config/h200_1b_ddp8.py --capacity --gpu_mem_gb=141   # plan a pod from here
    torchrun --standalone --nproc_per_node=8 sanity.py config/h200_1b_ddp8.py --capacity
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import gc
import json
import math
import os
import platform
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist

from podgpt.core import configurator
from podgpt.core.checkpoint import CKPT_FORMAT, load_checkpoint, save_checkpoint
from podgpt.core.data import Loader, check_prepared, load_manifest
from podgpt.core.attention import (ATTENTION_BACKENDS, PARITY_TOLERANCE, backend_unavailable,
                                   parity_errors, parity_tolerance, resolve_backend)
from model import GPT, GPTConfig, KVCache
from podgpt.pod.objectives import config_class, make_model
from podgpt.core.optim import make_optimizer
from podgpt.pod.memory import param_counts
from podgpt.pod.preflight import (MEMORY_USABLE, flops_per_token, largest_fitting, layout_label,
                                  md_table, model_config, plan_layout, plan_vocab)
from podgpt.core.util import (Error, Folder, autocast, check_apart, compute_dtype, driver_version,
                              dtype_name, fail, first_line, make_scratch, on_rank0, remove_scratch,
                              run_main, setup, write_atomic, write_json)

# --- config
out_dir = "out"                 # sanity.json and sanity.md are written here
data_dir = "data/default"       # prepared data to check against the model (skip: none there yet)
# the run's model and batch (train.py's keys): --capacity plans this model; the other checks use a
# 2-layer model with its head layout (and, on a GPU, its width)
block_size = 1024               # context length in tokens
n_layer = 12                    # transformer blocks
n_head = 12                     # query heads
n_kv_head = 12                  # key/value heads; fewer than n_head is grouped-query attention
n_embd = 768                    # model width
ffn_hidden = None               # SwiGLU hidden size; None: 8 * n_embd / 3 rounded up to multiple_of
multiple_of = 256               # Llama's rounding of that default (tensor-core tiles); 1: none
vocab_size = None               # None: the data's vocabulary (manifest.json); a number must match
tie_embeddings = True           # share the input embedding with the output head
vocab_multiple = 64             # pad the vocabulary to a multiple of this (faster matmuls)
micro_batch_size = 8            # sequences per GPU per forward/backward
dist_mode = "ddp"               # ddp: each GPU holds the model and AdamW state | fsdp: shards them
grad_ckpt = "none"              # activation checkpointing: none | full | selective
loss_chunk = 8192               # tokens per chunk of the loss (no batch-wide fp32 logits); 0: off
objective = "ar"                # ar | a module of podgpt/research/ (planned; its own mask checked)
plan_vocab_size = 0             # vocabulary to plan with before data_dir is prepared
expect_world_size = 0           # ranks this config is written for; 0: any
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N
dtype = "auto"                  # auto (CUDA bfloat16, CPU float32) | bfloat16 | float16 | float32
compile = False                 # torch.compile the model: check compiled against eager
# sanity's own
min_free_disk_gb = 1.0          # fail when out_dir's disk has less free space than this
allreduce_mb = 64               # size of the timed all_reduce under torchrun, in MiB
capacity = False                # plan the configured model's memory per GPU (on a GPU: measure it)
world_size = 0                  # GPUs to plan for; 0: WORLD_SIZE, else expect_world_size, else 1
gpu_mem_gb = 0.0                # GPU memory to plan with; 0: the GPU in use (on CPU: no verdict)
# --- end config

# (json key, label, sharded, activation checkpointing); the configured run's layout comes first
LAYOUTS = (("ddp", "DDP", False, "none"), ("ddp_act_ckpt", "DDP + act. ckpt", False, "full"),
           ("sharded", "sharded", True, "none"),
           ("sharded_act_ckpt", "sharded + act. ckpt", True, "full"))
ALLREDUCE_ITERS = 5  # timed all_reduces, after 2 warm-up ones (NCCL builds its rings on the first)
# the probe models' AdamW: any will do (the checks look at its state's files and memory)
PROBE_OPTIMIZER = dict(learning_rate=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


# -----------------------------------------------------------------------------
# helpers

def rel_error(a, b):
    """Largest absolute difference over b's largest absolute value; inf when any is not finite."""
    a, b = a.detach().double(), b.detach().double()
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    return float("inf") if math.isnan(err) else err


def probe_model(cfg, dev, full_width=None):
    """A 2-layer model with the configured head layout: at the configured width (by default on a
    GPU, where the kernels' shapes matter and it costs nothing), or 16 per head (seconds on a CPU);
    and two random rows of its block_size + 1 tokens."""
    full_width = dev.type == "cuda" if full_width is None else full_width
    head_dim = cfg["n_embd"] // cfg["n_head"] if full_width else 16
    torch.manual_seed(0)
    block = min(cfg["block_size"], 256 if full_width else 64)
    model = GPT(GPTConfig(vocab_size=256, block_size=block, n_layer=2, n_head=cfg["n_head"],
                          n_kv_head=cfg["n_kv_head"], n_embd=head_dim * cfg["n_head"],
                          ffn_hidden=cfg["ffn_hidden"] if full_width else None,
                          multiple_of=cfg["multiple_of"], tie_embeddings=cfg["tie_embeddings"]))
    return model.to(dev), torch.randint(0, 256, (2, block + 1), device=dev)


def loss_and_grads(model, x, dev, dt):
    """The loss and every parameter's gradient of one forward/backward on rows x."""
    model.zero_grad(set_to_none=True)
    with autocast(dev, dt):
        _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def same(a, b):
    """Equal nested state: tensors bit for bit, everything else by ==."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def gb(n):
    return None if n is None else round(n / 1e9, 3)


def verdict(ok, detail):
    return ("pass" if ok else "fail"), detail


# -----------------------------------------------------------------------------
# checks: each returns (status, detail)

def check_environment(cfg, dev, dt, device_error):
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if device_error:
        return "fail", "; ".join(parts + [device_error])
    if dev.type == "cpu" and torch.cuda.is_available():  # device=cpu: GPUs counted, never touched
        parts.append(f"{torch.cuda.device_count()} GPU(s) not used (device={cfg['device']}), "
                     f"{os.cpu_count()} CPU cores")
    elif dev.type == "cuda":
        parts.append(f"CUDA {torch.version.cuda}, driver {driver_version()}")
        gpus = Counter(f"{p.name} sm_{p.major}{p.minor} {p.total_memory / 1e9:.1f} GB" for p in
                       map(torch.cuda.get_device_properties, range(torch.cuda.device_count())))
        parts.append(", ".join(f"{n} x {name}" for name, n in gpus.items()))
        if dist.is_nccl_available():
            v = torch.cuda.nccl.version()
            parts.append("NCCL " + (".".join(map(str, v)) if isinstance(v, tuple) else str(v)))
    else:
        parts.append(f"no CUDA, {os.cpu_count()} CPU cores")
    parts.append(f"checking {dev} in {dtype_name(dt)}")
    return "pass", "; ".join(parts)


def check_disk(path, min_gb):
    free = shutil.disk_usage(path).free / 1e9
    return verdict(free >= min_gb,
                   f"{free:.1f} GB free at {os.path.abspath(path)} (need {min_gb:g})")


def check_attention(name, cfg, dev, dt, mask=None):
    """A backend (or auto's pick, saying why) against attention.parity_errors' float64 reference at
    the configured head layout; mask: None (causal) or a kind of attention.masks()."""
    # T=256 crosses a GPU kernel's 128-row tiles; T=64 (attention.py's own check) is quick on a CPU
    T = min(cfg["block_size"], 256 if dev.type == "cuda" else 64)
    hd = cfg["n_embd"] // cfg["n_head"]
    note = ""
    if name == "auto":
        name, note = resolve_backend(name, dev, dt, hd, mask)
        note = f"; {note}"
    elif why := backend_unavailable(name, dev, dt, hd, mask):
        return "skip", why
    errors = parity_errors(name, dev, dt, hd, mask, cfg["n_head"], cfg["n_kv_head"], T)
    worst = max(errors, key=errors.get)
    tol = parity_tolerance(dt, dev)
    ok = errors[worst] <= tol
    return verdict(ok, f"{dtype_name(dt)}, T={T}, heads {cfg['n_head']}/{cfg['n_kv_head']} of "
                       f"{hd}: largest error {errors[worst]:.1e} ({worst}) "
                       f"{'within' if ok else 'OVER'} {tol:g} of the largest value{note}")


def check_train_step(cfg, dev, dt):
    model, x = probe_model(cfg, dev)
    loss, *grads = loss_and_grads(model, x, dev, dt)
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    norm = torch.linalg.vector_norm(norms).item()
    ok = torch.isfinite(loss).item() and 0 < norm < float("inf")
    return verdict(ok, f"{dtype_name(dt)} forward/backward of a 2-layer {model.config.n_embd}-wide "
                       f"model: loss {loss.item():.3f}, gradient norm {norm:.3g}"
                       + ("" if ok else ": NOT finite and non-zero"))


def check_kv_cache(cfg, dev):
    """KV-cache logits equal a full forward pass's, in float32: n/4 tokens, a chunk of n/4 (the
    bottom-right mask path), then single tokens (the unmasked path); n is 32 at most."""
    model = probe_model(cfg, dev)[0].eval()
    n = min(32, model.config.block_size)
    x = torch.randint(0, 256, (2, n), device=dev)
    with torch.no_grad():
        full, _ = model(x)
        cache = KVCache(model.config, 2, n, dev, torch.float32)
        pieces = [(0, n // 4), (n // 4, n // 2)] + [(t, t + 1) for t in range(n // 2, n)]
        cached = torch.cat([model(x[:, a:b], cache=cache)[0] for a, b in pieces], 1)
    err, tol = rel_error(cached, full), PARITY_TOLERANCE[torch.float32]
    return verdict(err <= tol, f"{n} tokens fed as {n // 4} + {n // 4} + {n - n // 2} x 1: logits "
                               f"differ from a full forward pass by {err:.1e} of the largest "
                               f"(tolerance {tol:g})")


def check_checkpoint(cfg, dev):
    """checkpoint.py's save and load of a model and its AdamW state after one step, in a scratch
    folder under out_dir removed afterwards. Small at any width: this checks the files."""
    model, x = probe_model(cfg, dev, full_width=False)
    optimizer = make_optimizer(model, **PROBE_OPTIMIZER, fused=dev.type == "cuda")
    loss_and_grads(model, x, dev, torch.float32)
    optimizer.step()
    files = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict(),
             "trainer.pt": dict(format=CKPT_FORMAT, step=1),
             "config.json": json.dumps(dict(model=asdict(model.config))).encode()}
    rank = int(os.environ.get("RANK", 0))
    scratch = make_scratch(os.path.join(cfg["out_dir"], f".sanity-ckpt-{rank}"))
    try:
        path, _ = save_checkpoint(scratch, 1, files, keep_last=1, best=False, min_free_gb=0)
        if path is None:
            return "fail", f"save_checkpoint could not write to {scratch} (see the warning above)"
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        ckpt = load_checkpoint(path, dev)
    finally:
        remove_scratch(scratch)
    ok = same(ckpt["model"], files["model.pt"]) and same(ckpt["optimizer"], files["optimizer.pt"])
    return verdict(ok, f"saved and verified {size / 1e6:.1f} MB under {cfg['out_dir']}, read back: "
                       + ("every tensor equal" if ok else "tensors DIFFER from what was saved"))


def check_dataset(cfg):
    """data_dir's manifest, files and shards agree with the config, as train.py checks them."""
    data, vocab = cfg["data_dir"], cfg["vocab_size"]
    if not os.path.isfile(os.path.join(data, "manifest.json")):
        return "skip", (f"no manifest.json in {data}: not prepared yet (python prepare.py "
                        f"--data_dir={data})")
    manifest = load_manifest(data)
    check_prepared(data, manifest, vocab)
    if vocab is not None and vocab != manifest["vocab_size"]:  # larger: a preflight block
        return "fail", (f"vocab_size={vocab} but {data} holds {manifest['vocab_size']} tokens: set "
                        "vocab_size=None or prepare matching data (train.py's tokenizer_vocab gate "
                        "blocks it)")
    windows = {split: Loader(data, split, manifest, cfg["block_size"], 0).n
               for split in ("train", "val")}
    splits = manifest["splits"]
    return "pass", (f"{data}: {manifest['tokenizer']}, {manifest['vocab_size']} tokens, "
                    f"{splits['train']['tokens'] / 1e6:.1f}M train and "
                    f"{splits['val']['tokens'] / 1e6:.2f}M val tokens; every shard's header "
                    f"agrees; block_size {cfg['block_size']} gives {windows['train']:,} train and "
                    f"{windows['val']:,} val windows")


def check_compile(cfg, dev, dt):
    if not cfg["compile"]:
        return "skip", "compile=False: the run is eager (--compile=True checks torch.compile)"
    model, x = probe_model(cfg, dev)
    eager = [t.clone() for t in loss_and_grads(model, x, dev, dt)]
    compiled = loss_and_grads(torch.compile(model), x, dev, dt)
    # held to the kernels' bound against float64
    err = max(rel_error(c, e) for c, e in zip(compiled, eager, strict=True))
    tol = PARITY_TOLERANCE[dt]
    return verdict(err <= tol, f"{dtype_name(dt)} loss and gradients: compiled differs from eager "
                               f"by {err:.1e} of the largest value (tolerance {tol:g})")


def check_allreduce(dev, megabytes):
    if not dist.is_initialized():
        return "skip", ("not under torchrun (torchrun --nproc_per_node=N sanity.py ... checks the "
                        "collectives)")
    n = dist.get_world_size()
    # rank r sends (r + 1) * ramp: every rank must get n(n+1)/2 * ramp, exact in float32
    ramp = (torch.arange(1 << 20, device=dev) % 1024).float()
    total = ramp * (dist.get_rank() + 1)
    dist.all_reduce(total)
    right = torch.tensor(float(torch.equal(total, ramp * (n * (n + 1) // 2))), device=dev)
    dist.all_reduce(right)
    buf = torch.zeros(megabytes * 2 ** 20 // 4, device=dev)
    for _ in range(2):  # also lines the ranks up for the timing
        dist.all_reduce(buf)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(ALLREDUCE_ITERS):
        dist.all_reduce(buf)
    sync()
    seconds = (time.perf_counter() - t0) / ALLREDUCE_ITERS
    size, right = buf.numel() * 4, int(right.item())
    busbw = 2 * (n - 1) / n * size / seconds  # what each link carries in a ring (nccl-tests' busbw)
    return verdict(right == n, f"{dist.get_backend()}, {n} ranks: the sum is right on {right}/{n} "
                               f"ranks; all_reduce of {megabytes} MiB in {seconds * 1e3:.1f} ms, "
                               f"algbw {size / seconds / 1e9:.2f} GB/s, busbw "
                               f"{busbw / 1e9:.2f} GB/s")


# capacity: the plan from preflight.py's arithmetic, and on a GPU the measurement

def step_peak(model, optimizer, mb, dev, dt):
    """Peak bytes allocated by one forward/backward/AdamW step of mb sequences; None when OOM."""
    gc.collect()
    torch.cuda.empty_cache()  # what a failed try left cached would count against the next one
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        x, y = model.config.random_batch(mb, dev)
        with autocast(dev, dt):
            loss = model(x, y)[1]  # as train.py: the logits (loss_chunk=0) are not held
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)
    except torch.cuda.OutOfMemoryError:
        return None  # returning drops the traceback, and with it the tensors the failed step held
    finally:
        optimizer.zero_grad(set_to_none=True)


def measure_capacity(mconfig, mb, dev, dt, ddp_buckets):
    """Peak memory of a real training step at micro-batch mb (the second: the first allocates
    AdamW's moments) and the largest micro-batch that fits, eager, on this GPU."""
    with torch.device(dev):  # built in place: a 1B model initialised on the CPU takes a minute
        model = make_model(mconfig)
    optimizer = make_optimizer(model, **PROBE_OPTIMIZER, fused=True)
    # one process stands in for a DDP rank: hold aside DDP's fp32 copy of the gradients
    reserve = torch.empty(ddp_buckets, dtype=torch.uint8, device=dev)
    first = step_peak(model, optimizer, mb, dev, dt)
    peak = step_peak(model, optimizer, mb, dev, dt) if first else None
    largest = largest_fitting(lambda m: step_peak(model, optimizer, m, dev, dt) is not None,
                              mb if peak else 0)
    del reserve  # held until the search is done
    return peak, largest


def largest_fits(measured):
    """The largest micro-batch found against the plan's, in the same words in the check's line
    and in sanity.md."""
    return (f"the largest micro-batch that fits is {measured['largest_micro_batch']} (predicted "
            f"{measured['predicted_largest_micro_batch']} in the whole "
            f"{measured['device_gb']:.1f} GB)")


def check_capacity(cfg, dev, dt, world, out):
    """Fills `out` with the plan (and measurement) that goes to sanity.json under "capacity"."""
    if not cfg["capacity"]:
        return "skip", ("capacity=False (--capacity plans, and on a GPU measures, the memory per "
                        "GPU)")
    mconfig, mb = model_config(cfg), cfg["micro_batch_size"]
    # dtype=auto planned from a CPU is the GPU's bfloat16
    plan_dt = torch.bfloat16 if cfg["dtype"] == "auto" and dev.type != "cuda" else dt
    memory = cfg["gpu_mem_gb"] * 1e9 or (torch.cuda.get_device_properties(dev).total_memory
                                         if dev.type == "cuda" else 0)
    budget = MEMORY_USABLE * memory or None  # train.py's memory_fit gate's usable share
    with torch.device("meta"):  # the real module's shapes at no cost: must match the arithmetic
        built = sum(p.numel() for p in make_model(mconfig).parameters())
    counts = param_counts(mconfig)
    run = ("run", f"this run: {layout_label(cfg)}", cfg["dist_mode"] == "fsdp", cfg["grad_ckpt"])
    layouts = {key: dict(label=label, **plan_layout(mconfig, mb, world, sharded, ckpt,
                                                    plan_dt.itemsize, budget))
               for key, label, sharded, ckpt in (run, *LAYOUTS)}
    out.update(model={k: v for k, v in asdict(mconfig).items()
                      if k not in ("init_std", "attn_backend")},
               vocab_from=plan_vocab(cfg)[1], params=counts, meta_params=built,
               flops_per_token=flops_per_token(mconfig), world_size=world, micro_batch_size=mb,
               compute_dtype=dtype_name(plan_dt), gpu_mem_bytes=memory or None,
               gpu_mem_gb=gb(memory or None), usable_bytes=budget, usable_share=MEMORY_USABLE,
               layouts=layouts, measured=None)
    summary = (f"{counts['total'] / 1e9:.3f}B parameters, {out['flops_per_token'] / 1e9:.2f} "
               f"GFLOP/token; per GPU at micro-batch {mb}, world {world}: "
               + ", ".join(f"{lay['label']} {lay['gb']['total']:.1f} GB"
                           for lay in layouts.values()))
    fits = "fits" if layouts["run"]["fits"] else "does NOT fit"
    if built != counts["total"]:
        return "fail", (f"the model builds with {built:,} parameters, memory.param_counts says "
                        f"{counts['total']:,}")
    if dev.type == "cuda":
        return check_capacity_on_gpu(cfg, mconfig, dev, dt, world, budget, f"{summary}; ", out,
                                     fits)
    fits = f"this run {fits} gpu_mem_gb={cfg['gpu_mem_gb']:g}" if budget else \
        "give gpu_mem_gb for a verdict"
    return verdict(not budget or layouts["run"]["fits"],
                   f"{summary}; {fits}; not on a GPU: estimate only (built on the meta device: "
                   f"{built:,} parameters)")


def check_capacity_on_gpu(cfg, mconfig, dev, dt, world, budget, summary, out, fits):
    """check_capacity on a GPU: one real step's peak memory and the largest micro-batch that fits,
    against the plan, into out["measured"] (not for a model whose whole state it cannot hold)."""
    mb, fsdp = cfg["micro_batch_size"], cfg["dist_mode"] == "fsdp"
    # one GPU measures one rank whole, at the run's grad_ckpt: sharding over one GPU saves nothing
    plan = partial(plan_layout, mconfig, mb, 1 if fsdp else world, False, cfg["grad_ckpt"],
                   dt.itemsize)
    one = plan(budget)
    total = torch.cuda.get_device_properties(dev).total_memory
    state = sum(one["bytes"][k] for k in ("weights", "gradients", "optimizer", "ddp_buckets"))
    if state > total:  # building it would only end in an out-of-memory error
        why = (f"one GPU's whole weights, gradients and AdamW state need {state / 1e9:.1f} GB, "
               f"over this GPU's {total / 1e9:.1f}: not measured (bench/mfu.py measures a slice)")
        if fsdp:  # the run shards them over its GPUs, which one GPU cannot stand in for: the plan
            return verdict(out["layouts"]["run"]["fits"], f"{summary}{why}; by the plan this run "
                                                          f"{fits}")
        return "fail", f"{summary}{why}"
    peak, largest = measure_capacity(mconfig, mb, dev, dt, one["bytes"]["ddp_buckets"])
    name = torch.cuda.get_device_name(dev)
    headroom = total - peak if peak else None
    # the search fills the whole GPU: the prediction to hold it against is the whole GPU's too
    out["measured"] = m = dict(
        device=name, device_bytes=total, device_gb=gb(total), micro_batch_size=mb,
        grad_ckpt=cfg["grad_ckpt"], peak_bytes=peak, peak_gb=gb(peak),
        predicted_bytes=one["bytes"]["total"], predicted_gb=one["gb"]["total"],
        headroom_bytes=headroom, headroom_gb=gb(headroom), largest_micro_batch=largest,
        predicted_largest_micro_batch=plan(total)["largest_micro_batch"])
    if peak is None:
        return "fail", (f"{summary}micro_batch_size={mb} does NOT fit on {name} (out of memory); "
                        f"{largest_fits(m)}")
    return "pass", (f"{summary}measured on {name}: peak {peak / 1e9:.1f} GB (predicted "
                    f"{one['gb']['total']:.1f}), headroom {headroom / 1e9:.1f} GB of "
                    f"{total / 1e9:.1f}; {largest_fits(m)}")


def capacity_lines(cap):
    """The capacity plan as Markdown: one column per layout, predicted against measured below."""
    lays, model, world = list(cap["layouts"].values()), cap["model"], cap["world_size"]
    lines = [f"## capacity: {cap['params']['total'] / 1e9:.3f}B parameters "
             f"({cap['params']['non_embedding'] / 1e9:.3f}B non-embedding), "
             f"{cap['flops_per_token'] / 1e9:.2f} GFLOP/token", "",
             f"GB per GPU (1 GB = 1e9 bytes): {cap['compute_dtype']}, micro-batch "
             f"{cap['micro_batch_size']} x {model['block_size']} tokens, world size {world} "
             f"(sharded: over all {world}), vocabulary {model['vocab_size']} from "
             f"{cap['vocab_from']}", ""]
    rows = [(part, *(f"{lay['gb'][part]:.2f}" for lay in lays)) for part in lays[0]["gb"]]
    if cap["gpu_mem_gb"]:
        rows += [(f"fits {cap['usable_share']:g} x {cap['gpu_mem_gb']:g} GB",
                  *("yes" if lay["fits"] else "NO" for lay in lays)),
                 ("largest micro-batch", *(lay["largest_micro_batch"] for lay in lays))]
    lines += md_table(("GB per GPU", *(lay["label"] for lay in lays)), rows) + [""]
    m = cap["measured"]
    if m is None:
        lines.append("Not on a GPU: the estimate only (the model was built on the meta device to "
                     f"confirm its {cap['meta_params']:,} parameters).")
    elif m["peak_bytes"] is None:
        lines.append(f"Measured on {m['device']} ({m['device_gb']:.1f} GB), eager: micro-batch "
                     f"{m['micro_batch_size']} runs out of memory (predicted "
                     f"{m['predicted_gb']:.2f} GB); {largest_fits(m)}.")
    else:
        lines.append(f"Measured on {m['device']} ({m['device_gb']:.1f} GB), eager, one process "
                     f"holding DDP's buckets aside: peak {m['peak_gb']:.2f} GB allocated against "
                     f"{m['predicted_gb']:.2f} GB predicted (DDP), headroom "
                     f"{m['headroom_gb']:.2f} GB; {largest_fits(m)}; "
                     f"{lays[0]['largest_micro_batch']} within the planned "
                     f"{cap['usable_share']:g} share.")
    return lines


# -----------------------------------------------------------------------------

def run_check(name, fn):
    t0 = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as e:  # a check that crashes is a failed check, reported in one line
        status, detail = "fail", str(e) if isinstance(e, Error) else first_line(e)
    return dict(name=name, status=status, seconds=round(time.perf_counter() - t0, 3), detail=detail)


def write_reports(path, report):
    write_json(os.path.join(path, "sanity.json"), report)
    lines = [f"# sanity: {'PASS' if report['passed'] else 'FAIL'}", "",
             f"{report['device']}, {report['dtype']}, {report['world_size']} rank(s)", ""]
    lines += md_table(("check", "status", "seconds", "detail"),
                      [(c["name"], c["status"], c["seconds"], c["detail"].replace("|", "/"))
                       for c in report["checks"]])
    if "ranks" in report:
        lines += [""] + md_table(("rank", "status", "failed checks"), [
            (r["rank"], "pass" if r["passed"] else "FAIL",
             ", ".join(c["name"] for c in r["checks"] if c["status"] == "fail"))
            for r in report["ranks"]])
    if report["capacity"]:
        lines += [""] + capacity_lines(report["capacity"])
    write_atomic(os.path.join(path, "sanity.md"), "\n".join(lines) + "\n")


def main(argv):
    cfg = configurator.configure(__file__, argv)
    check_apart(out_dir=cfg["out_dir"], data_dir=cfg["data_dir"])  # not its report in the data
    # a device that cannot be had (CUDA asked for but absent): the CPU, so that the other checks
    # still run and the environment check fails with the reason
    device_error = None
    try:
        proc = setup(cfg["device"])
    except Error as e:
        proc, device_error = setup("cpu"), str(e)
    dt = compute_dtype(cfg["dtype"], proc.dev)
    world = (cfg["world_size"] or int(os.environ.get("WORLD_SIZE", 0)) or cfg["expect_world_size"]
             or 1)
    # out_dir may be a run's, or new
    with Folder(cfg["out_dir"], "out_dir", legacy=("ckpt/latest", "sanity.json")) as folder:
        on_rank0(proc.distributed, lambda: folder.hold().claim())
        try:
            os.makedirs(cfg["out_dir"], exist_ok=True)  # on every node
        except OSError as e:  # nowhere to write the report
            fail(f"out_dir {cfg['out_dir']} cannot be created ({first_line(e)}): choose another "
                 "out_dir")
        return run_checks(cfg, proc, dt, world, device_error)


def run_checks(cfg, proc, dt, world, device_error):
    """Every check on this rank, the report of them all from rank 0; the exit status."""
    dev, rank, ddp = proc.dev, proc.rank, proc.distributed
    capacity_report, own_mask = {}, config_class(cfg["objective"]).own_mask
    # (check, backend, mask): each backend causal; the dense document mask (SDPA with a boolean
    # mask, what math, efficient and sdpa run); an objective's own mask, on auto's pick for it
    attention = [(name, name, None) for name in (*ATTENTION_BACKENDS, "sdpa", "auto")]
    attention += [("doc_mask", "sdpa", "documents")]
    if own_mask:
        attention.append((own_mask, "auto", own_mask))
    checks = [("environment", partial(check_environment, cfg, dev, dt, device_error)),
              ("disk", partial(check_disk, cfg["out_dir"], cfg["min_free_disk_gb"]))]
    checks += [(f"attention:{key}", partial(check_attention, name, cfg, dev, dt, mask))
               for key, name, mask in attention]
    checks += [("train_step", partial(check_train_step, cfg, dev, dt)),
               ("kv_cache", partial(check_kv_cache, cfg, dev)),
               ("checkpoint", partial(check_checkpoint, cfg, dev)),
               ("dataset", partial(check_dataset, cfg)),
               ("compile", partial(check_compile, cfg, dev, dt)),
               ("allreduce", partial(check_allreduce, dev, cfg["allreduce_mb"])),
               ("capacity", partial(check_capacity, cfg, dev, dt, world, capacity_report))]
    results = []
    for name, fn in checks:
        results.append(r := run_check(name, fn))
        if rank == 0 or r["status"] == "fail":
            print(f"{'' if rank == 0 else f'[rank {rank}] '}{r['status']:4s}  {name:24s} "
                  f"{r['seconds']:7.2f}s  {r['detail']}", flush=True)
    per_rank = [results]
    if ddp:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, results)
        dist.destroy_process_group()
    passed = all(r["status"] != "fail" for rank_results in per_rank for r in rank_results)
    if rank == 0:
        report = dict(passed=passed, device=str(dev), dtype=dtype_name(dt),
                      world_size=len(per_rank), checks=results, capacity=capacity_report or None)
        if ddp:
            report["ranks"] = [dict(rank=i, passed=all(c["status"] != "fail" for c in checks),
                                    checks=checks) for i, checks in enumerate(per_rank)]
        write_reports(cfg["out_dir"], report)
        if capacity_report:
            print("\n".join(capacity_lines(capacity_report)))
        print(f"sanity {'passed' if passed else 'FAILED'}: "
              f"{os.path.join(cfg['out_dir'], 'sanity.md')}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
