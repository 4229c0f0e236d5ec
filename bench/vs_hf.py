"""
Our training step against transformers' LlamaForCausalLM of the same shape: is model.py's
GPT as fast as the reference implementation of the architecture it copies?

    python bench/vs_hf.py config/h200_1b_ddp8.py --device=cuda --micro_batch_size=8
    python bench/vs_hf.py config/h200_1b_ddp8.py --device=cuda --compile=True

Both models: the shape of the config (release/hf.py's hf_config maps it: hidden, intermediate,
heads, kv heads, head dim, RoPE theta, RMSNorm eps, tied embeddings, padded vocabulary, positions),
fp32 weights under the same autocast dtype, SDPA attention (ours attn_backend="sdpa", HF's
attn_implementation="sdpa"), the same torch.compile setting, the same step (forward, fp32
cross-entropy on every position, backward, clipping, train.py's AdamW), in this process on
this device. Activation checkpointing and document masking are off on both sides; otherwise
ours runs as the config has it (its loss_chunk, fused_loss, residual_dtype included: that is our
step; master_weights=True gives ours bf16 weights and MasterAdamW, and HF keeps fp32). The timing
windows alternate (ours, HF, ours, HF, ...) so that clock and thermal drift hit both.
Prints tokens/s of each and the ratio ours / HF (above 1: ours is faster).
"""

import sys
from dataclasses import asdict

import common
import torch

from podgpt.release.hf import hf_config
from podgpt.pod.preflight import model_config
from podgpt.core.util import dtype_name, fail, run_main

# --- config
windows = 4                     # timing windows per model, alternating ours / HF
warmup = 3                      # untimed steps per model before the first window (the first also compiles)
iters = 10                      # timed steps per window
out = ""                        # JSONL file the result line is appended to; "": bench/results/vs_hf.jsonl
# --- end config


def hf_model(transformers, mconfig, run, dev):
    """LlamaForCausalLM of our model's shape, fp32 weights, SDPA attention, no KV cache (training)."""
    config = transformers.LlamaConfig(**dict(hf_config(mconfig, "float32"), use_cache=False),
                                      attn_implementation="sdpa")
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(config)
    return model, common.run_optimizer(model, run, dev)


def hf_loss(model, x, y):
    return common.cross_entropy(model(input_ids=x, use_cache=False).logits, y)


def main(argv):
    cfg, run = common.configure(__file__, argv, run=True)
    common.check_counts(cfg, "warmup", "iters")
    if cfg["windows"] < 1:
        fail(f"windows={cfg['windows']} must be positive")
    try:
        import transformers  # optional: only this probe needs it
    except ImportError:
        fail("vs_hf.py compares against transformers, which is not installed: pip install transformers")
    dev, dt = common.run_device(run)
    # our side as HF's: SDPA attention; no activation checkpointing or document masking, which HF's model lacks
    mconfig = model_config(run, attn_backend="sdpa", grad_ckpt="none", doc_mask=False)
    mb, block = run["micro_batch_size"], mconfig.block_size
    sides, params = {}, {}
    for side, (model, optimizer), loss_of in (("ours", common.build(mconfig, run, dev), common.our_loss),
                                              ("hf", hf_model(transformers, mconfig, run, dev), hf_loss)):
        sides[side] = (common.compiled(model, run), optimizer, loss_of)
        params[side] = sum(p.numel() for p in model.parameters())  # equal when the mapping is right

    def tokens_per_sec(side, warm, timed):
        step, optimizer, loss_of = sides[side]
        row = common.measure_steps(step, optimizer, mb, block, mconfig.vocab_size, dev, dt, warm, timed, loss_of)
        if row.get("oom"):
            fail(f"out of memory at micro_batch_size={mb} with both models on one device: lower micro_batch_size")
        return row["tokens_per_sec"]

    print(f"{common.device_name(dev)}, {dtype_name(dt)}, compile={run['compile']}, micro-batch {mb} x {block}: "
          f"{params['ours'] / 1e6:.2f}M parameters (ours), {params['hf'] / 1e6:.2f}M (HF)")
    for side in sides:
        tokens_per_sec(side, cfg["warmup"], 1)
    per_window = {side: [] for side in sides}
    for w in range(cfg["windows"]):
        for side in sides:
            per_window[side].append(tokens_per_sec(side, 0, cfg["iters"]))
        print(f"  window {w + 1}: ours {per_window['ours'][-1]:,.0f} tokens/s, HF {per_window['hf'][-1]:,.0f}")
    # over all windows: total tokens / total time (the harmonic mean of equal-token windows)
    tps = {side: len(v) / sum(1 / t for t in v) for side, v in per_window.items()}
    ratio = tps["ours"] / tps["hf"]
    print(f"ours {tps['ours']:,.0f} tokens/s, HF {tps['hf']:,.0f} tokens/s: ours / HF = {ratio:.3f}")
    common.write_result("vs_hf", cfg["out"], dev, dict(
        config=[a for a in argv if not a.startswith("--")], model=asdict(mconfig), dtype=dtype_name(dt),
        compile=run["compile"] and run["compile_mode"], **{k: run[k] for k in common.STEP_KEYS}, micro_batch=mb, block_size=block, transformers=transformers.__version__,
        params_ours=params["ours"], params_hf=params["hf"], windows=cfg["windows"], warmup=cfg["warmup"],
        iters=cfg["iters"], ours_tokens_per_sec=tps["ours"], hf_tokens_per_sec=tps["hf"], ratio=ratio,
        per_window=per_window))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
