"""
Can the data loader feed the GPU? data.Loader's tokens/s from a prepared data folder, in
batches of the configured shape (micro_batch_size x block_size), onto the device, against
what the GPU consumes.

    python bench/loader.py config/h200_1b_ddp8.py --gpu_tokens_per_sec=52000
    python bench/loader.py --data_dir=data/stdlib_byte --block_size=256 --micro_batch_size=16

train.py reads each micro-batch in the training loop, on the CPU: the next one while the GPU
works on the current one (within a step's gradient accumulation), the first of each step while
the GPU waits. headroom = loader tokens/s / GPU tokens/s, per GPU (each rank reads its own
micro-batches; the GPU figure is bench/mfu.py's tokens_per_sec): below 1 training waits on
data; at 10 a batch read that is not hidden costs a tenth of a micro-step. Windows are read at
random positions in the shards (the training order), the first pass from disk, the rest from
the page cache as it warms: `warmup` batches are not timed.
"""

import itertools
import sys

import common

from podgpt.core.data import Loader, load_manifest
from podgpt.core.util import fail, run_main

# --- config
gpu_tokens_per_sec = 0.0        # tokens/s one GPU consumes (bench/mfu.py); 0: no comparison
warmup = 5                      # untimed batches
iters = 100                     # timed batches
out = ""                        # JSONL file the result line is appended to; "": bench/results/loader.jsonl
# --- end config


def main(argv):
    cfg, run = common.configure(__file__, argv, run=True)
    common.check_counts(cfg, "warmup", "iters")
    dev, _ = common.run_device(run)
    try:
        manifest = load_manifest(run["data_dir"])
    except ValueError as e:
        fail(str(e))
    loader = Loader(run["data_dir"], "train", manifest, run["block_size"], run["seed"])
    mb, block = run["micro_batch_size"], run["block_size"]
    first = itertools.count(0, mb)  # each batch continues the training order where the last one stopped
    seconds = common.seconds_per_call(lambda: loader.train_batch(next(first), mb, dev), dev,
                                      cfg["warmup"], cfg["iters"])
    tps = mb * block / seconds
    gpu = cfg["gpu_tokens_per_sec"] or None
    headroom = tps / gpu if gpu else None
    print(f"data.Loader on {run['data_dir']} ({manifest['tokenizer']}, {loader.n} windows of {block}): "
          f"{mb} x {block} tokens to {dev} in {seconds * 1e3:.2f} ms, {tps:,.0f} tokens/s"
          + (f"; the GPU consumes {gpu:,.0f}: headroom {headroom:.1f}x" if gpu else ""))
    if headroom is not None and headroom < 1:
        print("warning: the loader is slower than the GPU: training would wait on data")
    common.write_result("loader", cfg["out"], dev, dict(
        data_dir=run["data_dir"], tokenizer=manifest["tokenizer"], windows=loader.n, micro_batch=mb, block_size=block,
        warmup=cfg["warmup"], iters=cfg["iters"], batch_ms=seconds * 1e3, tokens_per_sec=tps,
        gpu_tokens_per_sec=gpu, headroom=headroom))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
