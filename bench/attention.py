"""
Causal attention forward+backward TFLOP/s of every backend attention.py offers, over sequence
lengths and head dims, with and without document masking.

    python bench/attention.py                                   # a GPU's defaults (a CPU's: tiny shapes)
    python bench/attention.py --seq_lens=2048,8192 --head_dims=128 --backends=fa3,cudnn,flex
    python bench/attention.py --backends=fa4,flash                # FlashAttention 4 runs only when named

FLOPs (the FlashAttention papers' count): the forward's two matmuls, QK^T and PV, are
4*B*H*T*T*D for full attention, half of it causal; the backward is 2.5x the forward (five
matmuls, QK^T recomputed, against two). TFLOP/s = 3.5 x forward / time. With document
masking (random document lengths, each token attends only within its document) the same
causal count is used, so its TFLOP/s are comparable with the plain causal ones (above them:
the kernel skips the masked blocks); useful_tflops counts only the pairs that are attended.
A backend attention.backend_unavailable rules out here is reported with its reason.
"""

import sys
from collections import Counter

import common
import torch

from podgpt.core import attention
from podgpt.core.util import dtype_name, fail, first_line, run_main

# --- config
seq_lens = ""                   # comma-separated sequence lengths T; "": 1024,2048,4096 on a GPU, 64,128 on a CPU
head_dims = ""                  # comma-separated head dims D; "": 64,128 on a GPU, 16 on a CPU
width = 0                       # query heads x head dim (heads = width / D); 0: 2048 on a GPU, 64 on a CPU
gqa = 1                         # query heads per key/value head (1: multi-head attention)
tokens = 0                      # tokens per batch (B = tokens / T, at least 1); 0: 16384 on a GPU, 256 on a CPU
docs_per_row = 4                # documents per sequence in the masked cases, cut at random positions
backends = ""                   # comma-separated attn_backend names (fa4 too); "": attention.ATTENTION_BACKENDS, then sdpa
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N (one process)
dtype = "auto"                  # auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32
warmup = 3                      # untimed forward+backward per case
iters = 10                      # timed forward+backward per case
seed = 0                        # of the random inputs and document cuts
out = ""                        # JSONL file the result line is appended to; "": bench/results/attention.jsonl
# --- end config

# (seq_lens, head_dims, width, tokens) when not given
DEFAULTS = {"cuda": ("1024,2048,4096", "64,128", 2048, 16384), "cpu": ("64,128", "16", 64, 256)}


def doc_ids(batch, length, docs):
    """(batch, length) document ids: each row cut into `docs` documents at random positions."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    for row in ids:
        row[torch.randperm(length - 1)[:docs - 1] + 1] = 1
    return ids.cumsum(dim=1)


def attended_pairs(ids):
    """Query-key pairs causal document masking keeps: L(L+1)/2 per document of L tokens."""
    lengths = torch.cat([torch.bincount(row) for row in ids]).double()
    return float((lengths * (lengths + 1) / 2).sum())


def measure(backend, q, k, v, grad, docs, dev, dt, cfg):
    """{status, ms, tflops, useful_tflops} of one backend's causal forward+backward, or why it has none."""
    reason = attention.backend_unavailable(backend, dev, dt, q.size(-1), "documents" if docs is not None else None)
    if reason:
        return dict(status="unavailable", reason=reason)

    def fwd_bwd():  # autograd.grad: fresh gradients each time, none accumulated into q, k, v
        torch.autograd.grad(attention.attention(backend, q, k, v, True, docs), (q, k, v), grad)

    common.free_memory(dev)
    try:
        seconds = common.seconds_per_call(fwd_bwd, dev, cfg["warmup"], cfg["iters"])
    except torch.cuda.OutOfMemoryError:
        return dict(status="oom")
    except Exception as e:  # a kernel that fails at this shape is reported, and the sweep goes on
        return dict(status="error", reason=first_line(e))
    B, H, T, D = q.shape
    forward = 4 * B * H * T * T * D / 2
    useful = 4 * H * D * attended_pairs(docs.ids.cpu()) if docs is not None else forward
    return dict(status="ok", ms=seconds * 1e3, tflops=3.5 * forward / seconds / 1e12,
                useful_tflops=3.5 * useful / seconds / 1e12)


def main(argv):
    cfg, _ = common.configure(__file__, argv)
    common.check_counts(cfg, "warmup", "iters")
    dev, dt = common.pick_device(cfg["device"], cfg["dtype"])
    lens, dims, width, tokens_per_batch = DEFAULTS[dev.type]
    lens = common.int_list("seq_lens", cfg["seq_lens"] or lens)
    dims = common.int_list("head_dims", cfg["head_dims"] or dims)
    width, tokens_per_batch = cfg["width"] or width, cfg["tokens"] or tokens_per_batch
    offered = [*attention.ATTENTION_BACKENDS, "sdpa"]  # sdpa: the default attn_backend, SDPA's own kernel choice
    names = [b.strip() for b in cfg["backends"].split(",") if b.strip()] or offered
    known = offered + list(attention.OPT_IN_BACKENDS)  # and those that run only when named
    unknown = [b for b in names if b not in known]
    if unknown:
        fail(f"backends: {', '.join(unknown)} not offered by attention.py: choose among {', '.join(known)}")
    for D in dims:
        if width % D or (width // D) % cfg["gqa"]:
            fail(f"width={width} must be a multiple of each head dim ({D}) times gqa={cfg['gqa']}")
    if cfg["docs_per_row"] < 1 or cfg["docs_per_row"] > min(lens):
        fail(f"docs_per_row={cfg['docs_per_row']} must be between 1 and the shortest sequence ({min(lens)})")
    torch.manual_seed(cfg["seed"])
    print(f"{common.device_name(dev)}, {dtype_name(dt)}, causal forward+backward, {tokens_per_batch} tokens per batch, "
          f"width {width}, gqa {cfg['gqa']}")
    rows, unavailable = [], Counter()
    for D in dims:
        for T in lens:
            B, H = max(1, tokens_per_batch // T), width // D
            q, k, v = (torch.randn(B, h, T, D, device=dev, dtype=dt, requires_grad=True)
                       for h in (H, H // cfg["gqa"], H // cfg["gqa"]))
            grad = torch.randn_like(q)
            for masked in (False, True):
                # training makes a batch's mask once (attention.Documents) for all layers: here in the warmup, untimed
                docs = attention.Documents(doc_ids(B, T, cfg["docs_per_row"]).to(dev)) if masked else None
                for backend in names:
                    r = dict(backend=backend, seq_len=T, head_dim=D, batch=B, heads=H, kv_heads=H // cfg["gqa"],
                             doc_mask=masked, **measure(backend, q, k, v, grad, docs, dev, dt, cfg))
                    rows.append(r)
                    if r["status"] == "unavailable":  # said once at the end, not at every shape
                        unavailable[f"{backend}: {r['reason']}"] += 1
                        continue
                    print(f"  D={D:<4} T={T:<6} {'doc-masked' if masked else 'causal':10s} {backend:10s} "
                          + (f"{r['ms']:9.3f} ms {r['tflops']:8.3g} TFLOP/s (useful {r['useful_tflops']:.3g})"
                             if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"))
    for reason, cases in unavailable.items():
        print(f"  unavailable ({cases} cases) {reason}")
    common.write_result("attention", cfg["out"], dev, dict(
        dtype=dtype_name(dt), width=width, gqa=cfg["gqa"], tokens=tokens_per_batch, docs_per_row=cfg["docs_per_row"],
        warmup=cfg["warmup"], iters=cfg["iters"], backends=names, rows=rows))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
