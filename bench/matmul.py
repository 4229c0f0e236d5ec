"""
The practical ceiling: measured matmul TFLOP/s on this device, bf16 on a GPU (fp32 on a CPU),
over square sizes and the shapes an LLM's training step multiplies.

    python bench/matmul.py                              # a GPU's default sizes (a CPU's: small ones)
    python bench/matmul.py --sizes=8192,16384x2048x5461 --iters=50
    python bench/matmul.py --fp8=True                   # also each shape as a linear layer: bf16 vs fp8
    python bench/matmul.py --fp8=True --fp8_recipe=rowwise  # the same with rowwise scales

Prints TFLOP/s per shape and the best, with the best's fraction of the datasheet dense
peak (preflight.peak_flops; null on a CPU or an unknown GPU). The best is the figure to pass
to bench/mfu.py as --ceiling_tflops: MFU against what the chip can actually do.
With --fp8=True each row also holds the shape as a training step's linear layer (M tokens, K in,
N out: forward and backward, compiled, bf16 autocast) in bf16 and as torchao's float8 layer
(fp8_recipe's scales, as train.py's fp8=True): the per-shape table model.fp8_filter's rule stands for.
"""

import sys

import common
import torch

from model import fp8_recipe_unknown, fp8_unavailable
from podgpt.pod.preflight import peak_flops
from podgpt.core.util import dtype_name, fail, run_main

# --- config
sizes = ""                      # comma-separated N (N x N @ N x N) or MxKxN ((M, K) @ (K, N)); "": the defaults below
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N (one process)
dtype = "auto"                  # auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32
warmup = 5                      # untimed multiplications per shape
iters = 20                      # timed multiplications per shape
fp8 = False                     # also time each shape as a linear layer, bf16 vs float8 (CUDA, torchao)
fp8_recipe = "tensorwise"       # fp8's scales: tensorwise | rowwise (a run's fp8_recipe)
out = ""                        # JSONL file the result line is appended to; "": bench/results/matmul.jsonl
# --- end config

# squares, then (tokens, in, out) of the repo's configs at 16k tokens per micro-batch: h200_1b_ddp8's
# SwiGLU up and down at its hidden 5632 and at the recipe's floor(8d/3) = 5461 (an odd size, the reason
# for multiple_of), its 32k-vocabulary head, h100_d64's up projection (d 4096, hidden 11008; 10922 unrounded)
GPU_SIZES = ("2048,4096,8192,16384,16384x2048x5632,16384x5632x2048,16384x2048x5461,16384x5461x2048,"
             "16384x2048x32768,8192x4096x11008,8192x4096x10922")
CPU_SIZES = "128,256,256x192x512"
# fp8's default: the linear layers of h200_1b_ddp8 (q and o, k or v, fused q/k/v, gate or up,
# fused gate/up, down) and a100_50m (the same, at its width) at 16k tokens
FP8_SIZES = ("16384x2048x2048,16384x2048x512,16384x2048x3072,16384x2048x5632,16384x2048x11264,"
             "16384x5632x2048,16384x768x768,16384x768x256,16384x768x1280,16384x768x2048,"
             "16384x768x4096,16384x2048x768")


def parse_sizes(text):
    """[(M, K, N)] from 'N' and 'MxKxN' items; anything else stops with the fix."""
    shapes = []
    for item in text.split(","):
        dims = item.strip().lower().split("x")
        if not all(d.isdigit() and int(d) > 0 for d in dims) or len(dims) not in (1, 3):
            fail(f"sizes: {item!r} is neither N nor MxKxN (positive integers): write e.g. --sizes=4096,16384x2048x5461")
        m, k, n = [int(d) for d in dims] * (3 if len(dims) == 1 else 1)
        shapes.append((m, k, n))
    return shapes


def tflops(m, k, n, dev, dt, warm, timed):
    """TFLOP/s of (M, K) @ (K, N): 2*M*K*N floating-point operations (a multiply and an add each)."""
    a = torch.randn(m, k, device=dev, dtype=dt)
    b = torch.randn(k, n, device=dev, dtype=dt)
    seconds = common.seconds_per_call(lambda: a @ b, dev, warm, timed)
    return 2 * m * k * n / seconds / 1e12, seconds


def linear_seconds(m, k, n, dev, recipe, warm, timed):
    """Seconds of a training step's (K -> N) linear layer on M tokens, forward and backward,
    compiled, under bf16 autocast; recipe (tensorwise, rowwise): torchao's float8 layer with those
    scales, as train.py's; None: bf16."""
    layer = torch.nn.Linear(k, n, bias=False, device=dev)
    if recipe:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        layer = convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    forward = torch.compile(layer)
    x = torch.randn(m, k, device=dev, requires_grad=True)
    grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = forward(x)
        y.backward(grad)
    return common.seconds_per_call(step, dev, warm, timed)


def fp8_row(m, k, n, dev, recipe, warm, timed):
    """The shape's linear layer in bf16 and in float8 with recipe's scales: milliseconds each, and
    fp8's speedup."""
    bf16, fp8 = (linear_seconds(m, k, n, dev, r, warm, timed) for r in (None, recipe))
    return dict(fp8_recipe=recipe, linear_bf16_ms=bf16 * 1e3, linear_fp8_ms=fp8 * 1e3, fp8_speedup=bf16 / fp8)


def main(argv):
    cfg, _ = common.configure(__file__, argv)
    common.check_counts(cfg, "warmup", "iters")
    if why := fp8_recipe_unknown(cfg["fp8_recipe"]):
        fail(why, 2)
    dev, dt = common.pick_device(cfg["device"], cfg["dtype"])
    if cfg["fp8"] and (why := fp8_unavailable(dev, torch.bfloat16, compiled=True)):
        fail(why, 2)
    default = FP8_SIZES if cfg["fp8"] else GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    shapes = parse_sizes(cfg["sizes"] or default)
    name = common.device_name(dev)
    rows = []
    print(f"{name}, {dtype_name(dt)}")
    for m, k, n in shapes:
        value, seconds = tflops(m, k, n, dev, dt, cfg["warmup"], cfg["iters"])
        rows.append(dict(m=m, k=k, n=n, ms=seconds * 1e3, tflops=value))
        if cfg["fp8"]:
            rows[-1].update(fp8_row(m, k, n, dev, cfg["fp8_recipe"], cfg["warmup"], cfg["iters"]))
        print(f"  {m:>6} x {k:>6} @ {k:>6} x {n:>6}  {seconds * 1e3:9.3f} ms  {value:8.2f} TFLOP/s"
              + (f"  layer fp8 {cfg['fp8_recipe']} {rows[-1]['fp8_speedup']:.2f}x bf16" if cfg["fp8"] else ""))
    best = max(rows, key=lambda r: r["tflops"])
    peak = peak_flops(name) if dev.type == "cuda" else None
    fraction = best["tflops"] * 1e12 / peak if peak else None
    print(f"best {best['tflops']:.2f} TFLOP/s at {best['m']}x{best['k']}x{best['n']}; datasheet peak "
          f"{common.fmt(peak and peak / 1e12)} TFLOP/s, fraction {common.fmt(fraction)}")
    common.write_result("matmul", cfg["out"], dev, dict(
        dtype=dtype_name(dt), warmup=cfg["warmup"], iters=cfg["iters"], rows=rows,
        best_tflops=best["tflops"], best_shape=[best["m"], best["k"], best["n"]],
        peak_tflops=peak and peak / 1e12, fraction_of_peak=fraction))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
