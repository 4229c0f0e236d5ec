"""
How long a checkpoint of a config's model holds the training loop, and how long it takes to write:
its weights and AdamW state saved by train.py's own checkpoint.Checkpoints, in the background
(train.py's default, ckpt_async=True) and synchronously (ckpt_async=False).

    python bench/ckpt.py config/h200_1b_ddp8.py --device=cuda
    python bench/ckpt.py config/h200_1b_ddp8.py --device=cpu --n_layer=8   # a slice that fits a CPU's RAM

Per save: blocked, the seconds save() held the loop (in the background: the copy of the state into
CPU memory, pinned on a GPU), and written, the seconds until complete.json and ckpt/latest were on
disk. The staging buffers (pinned memory on a GPU: seconds to allocate for a 1B model) are allocated in the
background after a run's first step, as train.py does (the first save's reserve_s: how long that took, while
the run's steps went on); every save, the first included, finds them ready, which --saves=2 or more shows. The
state is what a ddp
run's rank 0 writes: fp32 weights and AdamW's two moments, 12 bytes per parameter; the process holds
it twice (on the device, and its CPU copy), so on a CPU a 1B model needs ~27 GB of RAM. --n_layer=K,
below the config's depth, measures a K-layer slice of the same width and scales the times to the
full depth by the bytes (copying and writing go at a rate in bytes). A save written in more than
checkpoint.PREEMPT_SAVE_SECONDS would not fit between a SIGTERM and its SIGKILL: the probe warns,
as train.py does, with what to change.
"""

import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace

import common
import torch

from podgpt.core import configurator
from podgpt.core.checkpoint import PREEMPT_SAVE_SECONDS, too_slow_for_preemption
from podgpt.pod.checkpoints import Checkpoints
from podgpt.pod.preflight import model_config
from podgpt.pod.memory import param_counts
from podgpt.core.util import fail, make_scratch, remove_scratch, run_main, warn

# --- config
saves = 2                       # background saves timed, the first and later ones (each reuses the staging buffers)
write_dir = ""                  # where the checkpoints go (a scratch folder, removed after); "": out_dir/bench_checkpoint, the run's own disk
out = ""                        # JSONL file the result line is appended to; "": bench/results/ckpt.jsonl
# --- end config


def with_moments(model, optimizer):
    """AdamW's state as after a training step (both moments exist): one step on zero gradients."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_saves(root, model, optimizer, dev, world, background, n, files):
    """n saves through checkpoint.Checkpoints as rank 0 of a ddp run of `world` ranks writes them, each
    waited for, then removed (one on disk at a time): their records (step, path, gb, blocked_s, waited_s,
    written_s; in the background, the first also reserve_s: how long its staging buffers took to allocate)."""
    proc = SimpleNamespace(dev=dev, rank=0, world=world, torchrun=False, distributed=False)
    ckpts = Checkpoints(root, model, optimizer, proc, False, files, every=1, keep_last=n, save_best=False,
                        min_free_gb=0, background=background)
    if background:  # as the loop after a step: the buffers allocated in the background, ready for a run's first
        t0 = time.perf_counter()  # save, ckpt_every steps later (the probe waits for them)
        ckpts.poll()
        ckpts.staging.reserving.join()
        reserve_s = time.perf_counter() - t0
    records = []
    for step in range(1, n + 1):
        ckpts.save(dict(step=step), best=False)
        ckpts.wait()
        records += ckpts.finished()
        if len(records) < step:
            fail(f"the step {step} checkpoint was not written (see the warning above): free disk space, or "
                 f"give --write_dir a folder on a disk with room")
        shutil.rmtree(records[-1]["path"])
    if background:
        records[0]["reserve_s"] = reserve_s
    return records


def main(argv):
    cfg, run = common.configure(__file__, argv, run=True)
    if cfg["saves"] < 1:
        fail(f"saves={cfg['saves']} must be positive")
    dev, _ = common.run_device(run)
    # the config file's own depth (what --n_layer slices): the config files without the command line's keys
    full = configurator.configure(common.TRAIN, [a for a in argv if not a.startswith("--")])["n_layer"]
    mconfig = model_config(run)
    full_config = model_config(run, n_layer=max(full, mconfig.n_layer))
    params, full_params = param_counts(mconfig)["total"], param_counts(full_config)["total"]
    world = run["expect_world_size"] or 1  # the ranks the config is written for (a slow save's fix: fsdp's share)
    model, optimizer = common.build(mconfig, run, dev)
    with_moments(model, optimizer)
    root = make_scratch(cfg["write_dir"] or os.path.join(run["out_dir"], "bench_checkpoint"))
    os.makedirs(os.path.join(root, "ckpt"))
    name = common.device_name(dev)
    print(f"{name}: checkpoints of {params / 1e6:.1f}M parameters ({mconfig.n_layer} layers; fp32 weights and "
          f"AdamW's moments) into {root}"
          + (f"; scaled to the config's {full} layers ({full_params / 1e6:.1f}M)" if full > mconfig.n_layer else ""))
    files = {"config.json": json.dumps(dict(model=asdict(mconfig))).encode()}
    try:
        rows = [dict(mode="async", save=i + 1, **r) for i, r in
                enumerate(time_saves(root, model, optimizer, dev, world, True, cfg["saves"], files))]
        rows += [dict(mode="sync", save=1, **r) for r in
                 time_saves(root, model, optimizer, dev, world, False, 1, files)]
    finally:
        remove_scratch(root)
    print(f"  staging buffers allocated in the background in {rows[0]['reserve_s']:.2f}s, while a run's first steps "
          "go on")
    for r in rows:
        del r["path"], r["step"]  # scratch
        print(f"  {r['mode']:5s} save {r['save']}: blocked {r['blocked_s']:.2f}s, written in {r['written_s']:.2f}s "
              f"({r['gb']:.2f} GB: copied at {r['gb'] / r['blocked_s']:.2f} GB/s, written at "
              f"{r['gb'] / r['written_s']:.2f} GB/s)")
    steady, sync = rows[cfg["saves"] - 1], rows[-1]  # the last background save: its buffers already there
    scale = full_params / params
    extrapolation = dict(n_layer=full, params=full_params, gb=steady["gb"] * scale,
                         blocked_s=steady["blocked_s"] * scale, written_s=steady["written_s"] * scale,
                         sync_s=sync["written_s"] * scale) if full > mconfig.n_layer else None
    if extrapolation:
        e = extrapolation
        print(f"  scaled to {full} layers ({e['gb']:.2f} GB): in the background blocked {e['blocked_s']:.2f}s, "
              f"written in {e['written_s']:.2f}s; synchronous {e['sync_s']:.2f}s")
    if extrapolation and extrapolation["written_s"] > PREEMPT_SAVE_SECONDS:  # a measured one: Checkpoints warned
        warn(f"scaled to {full} layers, a checkpoint would be " + too_slow_for_preemption(
            extrapolation["gb"], extrapolation["written_s"], run["dist_mode"] == "fsdp" or run["optimizer"] != "muon",
            world))
    common.write_result("ckpt", cfg["out"], dev, dict(
        config=[a for a in argv if not a.startswith("--")], model=asdict(mconfig), params=params,
        write_dir=root, saves=cfg["saves"], rows=rows, extrapolation=extrapolation))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
