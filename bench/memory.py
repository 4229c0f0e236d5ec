"""
Peak memory of a config's training step against memory.memory_estimate's prediction, over a
micro-batch sweep, with and without activation checkpointing.

    python bench/memory.py config/h200_1b_ddp8.py --device=cuda --micro_batches=1,2,4,8,16
    python bench/memory.py config/a100_50m.py --plan_vocab_size=50257        # on a CPU: the prediction only

Measured: torch.cuda.max_memory_allocated in each phase (forward, backward, optimizer) of the
second of two real training steps (the steady state: AdamW's moments exist), one process, so no DDP buckets (world_size=1 in the
prediction too). What the CUDA context and the allocator's cache hold on top is not counted
on either side. On a CPU the process's RSS is no measure of a GPU step, so measured is null
and the line holds the prediction alone. The ratio measured / predicted says how far
train.py's memory_fit gate can be trusted; an OOM micro-batch is recorded as such.
"""

import sys
from dataclasses import asdict

import common
import torch

from podgpt.pod.preflight import model_config
from podgpt.pod.memory import memory_estimate
from podgpt.core.util import autocast, dtype_name, run_main

# --- config
micro_batches = "1,2,4,8"       # micro-batch sizes to sweep (sequences of block_size tokens)
grad_ckpts = "none,full,selective"  # activation checkpointing settings to sweep (model.GPTConfig.grad_ckpt)
out = ""                        # JSONL file the result line is appended to; "": bench/results/memory.jsonl
# --- end config


def predict(mconfig, setting, micro_batch, compute_bytes):
    """{part: GB} from memory.memory_estimate ("total" among them) for this activation-checkpointing setting."""
    parts = memory_estimate(mconfig, micro_batch, activation_checkpointing=setting, compute_bytes=compute_bytes)
    return {k: v / 1e9 for k, v in parts.items() if k != "params"}  # params is a count, not bytes


def phase_peaks(model, optimizer, mb, mconfig, dev, dt):
    """{phase: peak GB} of the second of two training steps (the first allocates AdamW's moments), for
    each of its phases (forward, backward, optimizer), or None when out of memory. Which phase peaks
    tells which of memory_estimate's terms are held at once."""
    common.free_memory(dev)
    peaks = {}

    def mark(phase):
        torch.cuda.synchronize(dev)
        peaks[phase] = torch.cuda.max_memory_allocated(dev) / 1e9
        torch.cuda.reset_peak_memory_stats(dev)

    try:
        x, y = mconfig.random_batch(mb, dev)
        for _ in range(2):
            common.train_step(model, optimizer, x, y, autocast(dev, dt), common.our_loss, mark)
    except torch.cuda.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return None  # returning drops the traceback, and with it what the failed step held
    return peaks


def measure(mconfig, run, micro_batches, dev, dt):
    """{micro_batch: {phase: peak GB}, None when out of memory} of real training steps on this GPU."""
    model, optimizer = common.build(mconfig, run, dev)
    peaks = {mb: phase_peaks(model, optimizer, mb, mconfig, dev, dt) for mb in micro_batches}
    del model, optimizer
    common.free_memory(dev)
    return peaks


def main(argv):
    cfg, run = common.configure(__file__, argv, run=True)
    micro_batches = common.int_list("micro_batches", cfg["micro_batches"])
    settings = common.ckpt_settings("grad_ckpts", cfg["grad_ckpts"])
    dev, dt = common.run_device(run)
    # planned from a CPU, dtype=auto means the GPU's bfloat16 (as sanity.py --capacity plans it)
    plan_dt = torch.bfloat16 if run["dtype"] == "auto" and dev.type != "cuda" else dt
    compute_bytes = 4 if plan_dt == torch.float32 else 2
    name = common.device_name(dev)
    print(f"{name}, {dtype_name(plan_dt)}: peak memory per micro-batch, predicted (memory.memory_estimate) "
          f"against measured{'' if dev.type == 'cuda' else ' (not on a GPU: predicted only)'}")
    rows = []
    for setting in settings:
        mconfig = model_config(run, grad_ckpt=setting)
        try:
            measured = measure(mconfig, run, micro_batches, dev, dt) if dev.type == "cuda" else {}
        except torch.cuda.OutOfMemoryError:  # the weights and optimizer alone do not fit
            measured = dict.fromkeys(micro_batches)
        for mb in micro_batches:
            parts, phases = predict(mconfig, setting, mb, compute_bytes), measured.get(mb)
            predicted, peak = parts["total"], max(phases.values()) if phases else None
            rows.append(dict(grad_ckpt=setting, micro_batch=mb, predicted_gb=predicted, predicted_parts_gb=parts,
                             measured_gb=peak, measured_phases_gb=phases, oom=dev.type == "cuda" and peak is None,
                             ratio=peak / predicted if peak and predicted else None))
            r = rows[-1]
            print(f"  grad_ckpt={setting:5s} micro_batch={mb:<4} predicted {common.fmt(r['predicted_gb'], '.3f')} GB  "
                  f"measured {'OOM' if r['oom'] else common.fmt(r['measured_gb'], '.3f')} GB  "
                  f"ratio {common.fmt(r['ratio'])}")
    common.write_result("memory", cfg["out"], dev, dict(
        config=[a for a in argv if not a.startswith("--")], model=asdict(model_config(run)),
        dtype=dtype_name(plan_dt), compute_bytes=compute_bytes, rows=rows))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
