"""
What a training step keeps of a layer's activations, per token, by arithmetic: preflight's memory
plan (memory_phases) adds them up.
"""


def stream_bytes(config, compute_bytes):
    """Bytes per value of the residual stream (residual_dtype): auto is bf16 on a 2-byte compute
    dtype (gates_report plans an fp16 run's auto as the float32 it is)."""
    bf16 = config.residual_dtype == "bfloat16" or (config.residual_dtype == "auto"
                                                  and compute_bytes == 2)
    return 2 if bf16 else 4


def layer_bytes(config, mode, c, s):
    """(bytes per token a layer keeps for the backward, what the backward rebuilds of it) under
    grad_ckpt=mode, compute dtype c bytes, stream s. The norms keep their input, and on an fp32
    stream x*rsqrt too; in c bytes the norm outputs, q k v, attention output, SwiGLU's four;
    attention's log-sum-exp; the norms' scales."""
    d, f, dkv = config.n_embd, config.ffn_hidden, config.n_kv_head * config.head_dim
    norms = 16 * d if s == 4 else 2 * s * d
    layer = norms + c * (4 * d + 2 * dkv + 4 * f) + 4 * config.n_head + 8
    return {"none": (layer, 0), "full": (s * d, layer - s * d),
            "selective": (s * d + c * (4 * d + 2 * dkv + 2 * f) + 4 * config.n_head,
                          norms - s * d + c * (3 * d + dkv + 2 * f) + 8)}[mode]


def outside_bytes(d, c, s):
    """(bytes per token the final norm keeps, its output's bytes per value): its input (and on an
    fp32 stream x*rsqrt), its scale, and its output: fp32 on an fp32 stream, else c bytes (the
    fused loss keeps the gradient of that output instead of the output)."""
    out = 4 if s == 4 else c
    return (8 * d if s == 4 else s * d) + out * d + 4, out
