"""
Throughput and MFU of a config's model on one device, with the real training step (forward
with targets, backward, gradient clipping, train.py's optimizer; bf16 autocast on CUDA), over a
micro-batch sweep and each activation-checkpointing setting.

    python bench/mfu.py config/h200_1b_ddp8.py --device=cuda
    python bench/mfu.py config/h200_1b_ddp8.py --micro_batches=8,16 --compile=True --ceiling_tflops=790
    python bench/mfu.py config/h200_1b_ddp8.py --micro_batches=16 --accum=4 --compile=True  # the run's own step
    python bench/mfu.py config/h100_d64.py --n_layer=4 --micro_batches=1,2,4   # a slice, extrapolated to 64 layers
    python bench/mfu.py config/h100_d64.py --n_layer=4 --compile=True --fp8=True  # float8 linear layers (torchao)
    python bench/mfu.py config/h200_1b_ddp8.py --compile=True --fp8=True --fp8_recipe=rowwise  # rowwise scales
    python bench/mfu.py config/h200_1b_ddp8.py --compile=True --dist_mode=fsdp    # sharded by FSDP2, as one process
    python bench/mfu.py config/h200_1b_ddp8.py --compile=True --fused_loss=False --residual_dtype=float32
    python bench/mfu.py config/h200_1b_ddp8.py --compile=True --master_weights=True  # bf16 weights, fp32 masters

The step's keys (fused_loss, residual_dtype, master_weights, fuse_projections, fp8, fp8_head, fp8_recipe) are
train.py's and reach the model and optimizer as train.py builds them; each row records what was built (optimizer,
parameter and residual stream dtypes, whether the loss and the projections run fused, float8 layers), so two
lines differ where their keys did.

dist_mode=fsdp shards the model as train.py does (here a group of one process): its parameters are gathered in
bf16 for each block, so the step computes on bf16 weights and a bf16 residual stream instead of autocast's casts
of fp32 weights; what a GPU's share of an fsdp run computes, without the all-gathers' traffic.

Per (grad_ckpt, micro-batch): step time, tokens/s, MFU against the datasheet peak
(preflight.peak_flops; null on a CPU or an unknown GPU) and against a measured matmul ceiling
(--ceiling_tflops, bench/matmul.py's best), and peak memory (torch.cuda.max_memory_allocated;
on a CPU the process's peak RSS). A micro-batch that runs out of memory is recorded as OOM
and the sweep goes on. FLOPs are preflight.flops_per_token's: the recomputation of activation
checkpointing is not counted, so checkpointing shows as lower MFU, as it should.

A model too big for one device: --n_layer=K (below the config file's own n_layer) builds a
slice of the same width with K layers, and again with 2K; step time and memory grow linearly
with depth, so the two give a per-layer cost and a fixed one (embedding, head, loss,
optimizer of those), extrapolated to the config's full depth.
"""

import os
import sys
from dataclasses import asdict

import common
import torch
import torch.distributed as dist

from podgpt.core import configurator
from podgpt.pod.preflight import flops_per_token, model_config, peak_flops
from podgpt.pod.memory import param_counts
from podgpt.core.util import dtype_name, fail, run_main

# --- config
micro_batches = "1,2,4,8"       # micro-batch sizes to sweep (sequences of block_size tokens)
grad_ckpts = "none,full,selective"  # activation checkpointing settings to sweep (model.GPTConfig.grad_ckpt)
accum = 1                       # micro-batches per optimizer step, as a run accumulates them: its AdamW and clipping spread over accum
ceiling_tflops = 0.0            # a measured matmul ceiling (bench/matmul.py) for a second MFU; 0: none
warmup = 3                      # untimed steps per point (the first compiles, with --compile=True)
iters = 10                      # timed steps per point
out = ""                        # JSONL file the result line is appended to; "": bench/results/mfu.jsonl
trace = ""                      # a folder for a torch.profiler trace of each point (Chrome JSON); "": none
# --- end config


def sweep(run, setting, depth, micro_batches, dev, dt, cfg):
    """One row per micro-batch for a model of `depth` layers with activation checkpointing `setting`."""
    base = dict(grad_ckpt=setting, n_layer=depth)
    mconfig = model_config(run, n_layer=depth, grad_ckpt=setting)
    try:
        model, optimizer = common.build(mconfig, run, dev, shard=run["dist_mode"] == "fsdp")
    except torch.cuda.OutOfMemoryError:  # the weights alone do not fit
        return [dict(base, micro_batch=mb, oom=True) for mb in micro_batches]
    base["sharded"] = hasattr(next(model.parameters()), "device_mesh")  # FSDP2's parameters are DTensors
    base.update(common.built(model, optimizer, dev, dt))
    step = common.compiled(model, run)
    rows = []
    for mb in micro_batches:
        rows.append(dict(base, **common.measure_steps(step, optimizer, mb, mconfig.block_size, mconfig.vocab_size,
                                                      dev, dt, cfg["warmup"], cfg["iters"], accum=cfg["accum"])))
        if cfg["trace"] and "step_time_s" in rows[-1]:
            path = os.path.join(cfg["trace"], f"mfu-{setting}-{depth}layers-mb{mb}.json.gz")
            rows[-1].update(trace=path, kernel_time=common.trace_steps(step, optimizer, mb, mconfig.block_size, dev, dt,
                                                                       path, rows[-1]["step_time_s"],
                                                                       accum=cfg["accum"]))
    del model, optimizer, step
    common.free_memory(dev)
    return rows


def add_mfu(row, fpt, peak, ceiling):
    """MFU of a row against the datasheet peak and the measured ceiling (FLOP/s), each None when unknown."""
    tps = row.get("tokens_per_sec")
    row["mfu"] = fpt * tps / peak if tps and peak else None
    row["mfu_vs_ceiling"] = fpt * tps / ceiling if tps and ceiling else None
    return row


def extrapolate(rows, depths, full):
    """Per (grad_ckpt, micro-batch) measured at both slice depths: the line through the two points, for
    step time and peak memory, evaluated at the full depth."""
    lo, hi = depths
    measured = [r for r in rows if "step_time_s" in r]
    deeper = {(r["grad_ckpt"], r["micro_batch"]): r for r in measured if r["n_layer"] == hi}
    fits = []
    for a in (r for r in measured if r["n_layer"] == lo):
        b = deeper.get((a["grad_ckpt"], a["micro_batch"]))
        if b is None:  # out of memory at the deeper slice
            continue
        fit = dict(grad_ckpt=a["grad_ckpt"], micro_batch=a["micro_batch"], tokens=a["tokens"])
        for key in ("step_time_s", "peak_mem_gb"):
            per_layer = (b[key] - a[key]) / (hi - lo)
            fit[f"{key}_per_layer"] = per_layer
            fit[f"{key}_fixed"] = a[key] - per_layer * lo
            fit[key] = fit[f"{key}_fixed"] + per_layer * full
        fit["tokens_per_sec"] = fit["tokens"] / fit["step_time_s"] if fit["step_time_s"] > 0 else None
        fits.append(fit)
    return fits


def main(argv):
    cfg, run = common.configure(__file__, argv, run=True)
    common.check_counts(cfg, "warmup", "iters", "accum")
    micro_batches = common.int_list("micro_batches", cfg["micro_batches"])
    settings = common.ckpt_settings("grad_ckpts", cfg["grad_ckpts"])
    if run["compile"] and cfg["warmup"] < 1:
        fail("compile=True needs warmup >= 1: the first step compiles")
    dev, dt = common.run_device(run, group=run["dist_mode"] == "fsdp")
    # the config file's own depth (what --n_layer slices): the config files without the command line's keys
    full = configurator.configure(common.TRAIN, [a for a in argv if not a.startswith("--")])["n_layer"]
    depth = run["n_layer"]
    depths = [depth, min(2 * depth, full)] if depth < full else [depth]
    full_config = model_config(run, n_layer=max(full, depth))
    name = common.device_name(dev)
    peak = peak_flops(name) if dev.type == "cuda" else None
    ceiling = cfg["ceiling_tflops"] * 1e12 or None
    print(f"{name}, {dtype_name(dt)}, compile={run['compile']}, fp8={run['fp8']}, dist_mode={run['dist_mode']}, "
          + ", ".join(f"{k}={run[k]}" for k in common.STEP_KEYS) + ": "
          f"{param_counts(full_config)['total'] / 1e6:.1f}M "
          f"parameters at {full_config.n_layer} layers, block_size {full_config.block_size}"
          + (f"; measured as slices of {depths[0]} and {depths[1]} layers" if len(depths) == 2 else ""))
    rows = []
    for setting in settings:
        for d in depths:
            fpt = flops_per_token(model_config(run, n_layer=d))
            for row in sweep(run, setting, d, micro_batches, dev, dt, cfg):
                rows.append(add_mfu(row, fpt, peak, ceiling))
                print(f"  grad_ckpt={setting:9s} n_layer={d:<3} micro_batch={row['micro_batch']:<4} accum={cfg['accum']:<3} "
                      + (f"{row['step_time_s'] * 1e3:9.1f} ms/step {row['tokens_per_sec']:10.0f} tokens/s "
                         f"MFU {common.fmt(row['mfu'])} (vs ceiling {common.fmt(row['mfu_vs_ceiling'])}) "
                         f"peak {row['peak_mem_gb']:.2f} GB" if "step_time_s" in row
                         else "OOM"))
    fpt_full = flops_per_token(full_config)
    fits = [add_mfu(f, fpt_full, peak, ceiling) for f in extrapolate(rows, depths, full)] \
        if len(depths) == 2 else None
    for f in fits or []:
        print(f"  extrapolated to {full} layers: grad_ckpt={f['grad_ckpt']} micro_batch={f['micro_batch']}: "
              f"{f['step_time_s'] * 1e3:.1f} ms/step ({f['step_time_s_per_layer'] * 1e3:.2f} per layer), "
              f"{common.fmt(f['tokens_per_sec'], '.0f')} tokens/s, MFU {common.fmt(f['mfu'])}, "
              f"peak {f['peak_mem_gb']:.2f} GB ({f['peak_mem_gb_per_layer']:.3f} per layer)")
        if f["step_time_s_per_layer"] <= 0:
            print("warning: the deeper slice was not slower: timing noise exceeds a layer's cost; "
                  "raise iters or the slice depth (--n_layer)")
    measured = [r for r in (fits if fits is not None else rows) if r.get("tokens_per_sec")]
    best = max(measured, key=lambda r: r["tokens_per_sec"]) if measured else None
    common.write_result("mfu", cfg["out"], dev, dict(
        config=[a for a in argv if not a.startswith("--")], model=asdict(full_config),
        params=param_counts(full_config)["total"], flops_per_token=fpt_full, dtype=dtype_name(dt),
        compile=run["compile"] and run["compile_mode"], fp8=run["fp8"], **{k: run[k] for k in common.STEP_KEYS},
        dist_mode=run["dist_mode"], accum=cfg["accum"],
        warmup=cfg["warmup"], iters=cfg["iters"], peak_tflops=peak and peak / 1e12,
        ceiling_tflops=cfg["ceiling_tflops"] or None, rows=rows,
        extrapolation=dict(n_layer=full, depths=depths, rows=fits) if fits is not None else None, best=best))
    if dist.is_initialized():  # dist_mode=fsdp's group of one, ended as train.py ends its own
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
