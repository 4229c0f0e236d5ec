"""
All-reduce bandwidth between the processes of a torchrun job (NCCL on GPUs, gloo on CPUs),
over message sizes: what DDP's gradient all-reduce can get from this node's links.

    torchrun --standalone --nproc_per_node=8 bench/comms.py
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/comms.py   # CPU, gloo

Per size: the time of one all_reduce (the slowest rank's: a collective ends when its last
rank does), algbw = bytes / time, and busbw = algbw * 2(n-1)/n, what each link carries in a
ring all-reduce (nccl-tests' convention: comparable across rank counts, and against the
link's rated bandwidth). Rank 0 writes the line. DDP all-reduces fp32 gradients in buckets
of 25 MB, so the figures around 25 MB are the ones training sees.
"""

import os
import sys

import common
import torch
import torch.distributed as dist

from podgpt.core.util import dtype_name, fail, run_main

# --- config
sizes = ""                      # message sizes in bytes, comma-separated; "": 1 KiB..1 GiB (GPU), ..4 MiB (CPU)
device = "auto"                 # auto (each rank its GPU, NCCL, when CUDA is available) | cpu (gloo)
dtype = "float32"               # element type: float32 (DDP's gradients) | bfloat16
warmup = 3                      # untimed all_reduces per size (NCCL builds its rings on the first)
iters = 20                      # timed all_reduces per size
out = ""                        # JSONL file the result line is appended to; "": bench/results/comms.jsonl
# --- end config

GPU_SIZES = [2 ** p for p in range(10, 31, 2)]   # 1 KiB .. 1 GiB
CPU_SIZES = [2 ** p for p in range(10, 23, 2)]   # 1 KiB .. 4 MiB: gloo on a CPU is slow


def slowest(seconds, dev):
    """The largest of the ranks' times."""
    t = torch.tensor(seconds, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv):
    cfg, _ = common.configure(__file__, argv)
    common.check_counts(cfg, "warmup", "iters")
    if "RANK" not in os.environ:
        fail("comms.py measures all-reduce between processes: run it under torchrun, e.g. "
             "python -m torch.distributed.run --standalone --nproc_per_node=2 bench/comms.py")
    dev, dt = common.pick_device(cfg["device"], cfg["dtype"])  # and the process group: NCCL on GPUs, gloo on CPUs
    sizes = common.int_list("sizes", cfg["sizes"]) if cfg["sizes"] else GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    n, rank = dist.get_world_size(), dist.get_rank()
    element = torch.tensor([], dtype=dt).element_size()
    rows = []
    for size in sizes:
        buf = torch.ones(max(1, size // element), dtype=dt, device=dev)
        seconds = common.seconds_per_call(lambda b=buf: dist.all_reduce(b), dev, cfg["warmup"], cfg["iters"])
        seconds = slowest(seconds, dev)
        nbytes = buf.numel() * element
        algbw = nbytes / seconds
        rows.append(dict(bytes=nbytes, us=seconds * 1e6, algbw_gbps=algbw / 1e9,
                         busbw_gbps=algbw * 2 * (n - 1) / n / 1e9))
        if rank == 0:
            r = rows[-1]
            print(f"  {nbytes:>12,} bytes  {r['us']:10.1f} us  algbw {r['algbw_gbps']:8.2f} GB/s  "
                  f"busbw {r['busbw_gbps']:8.2f} GB/s")
    if rank == 0:
        best = max(rows, key=lambda r: r["busbw_gbps"])
        print(f"{dist.get_backend()}, {n} ranks ({os.environ.get('LOCAL_WORLD_SIZE', n)} on this node): "
              f"best busbw {best['busbw_gbps']:.2f} GB/s at {best['bytes']:,} bytes")
        common.write_result("comms", cfg["out"], dev, dict(
            backend=dist.get_backend(), world_size=n, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", n)),
            dtype=dtype_name(dt), warmup=cfg["warmup"], iters=cfg["iters"], rows=rows,
            best_busbw_gbps=best["busbw_gbps"], best_bytes=best["bytes"]))
    dist.barrier()  # tear down together: a rank leaving while rank 0 still writes can abort the job
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
