"""
The memory plan: the bytes per GPU a training step holds, by part and by moment, from the model's
config alone (what a layer keeps of its activations per token, its weights, gradients and optimizer
state); preflight's memory_fit gate and sanity.py --capacity plan with it.
"""

from model import GPT, GRAD_CKPT


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


def param_counts(config):
    """total (unique), embedding, head (0 when tied), non_embedding (blocks and final norm)."""
    d, hd = config.n_embd, config.head_dim
    attn = d * config.n_head * hd * 2 + d * config.n_kv_head * hd * 2
    mlp = 3 * d * config.ffn_hidden
    non_embedding = config.n_layer * (attn + mlp + 2 * d) + d
    embedding = config.padded_vocab * d
    head = 0 if config.tie_embeddings else embedding
    return dict(total=non_embedding + embedding + head, embedding=embedding, head=head,
                non_embedding=non_embedding)


def memory_estimate(config, micro_batch_size, world_size=1, sharded=False,
                    activation_checkpointing=None, compute_bytes=2, master=False):
    """Bytes per GPU at a training step's peak (memory_phases' largest), by part, and params.
    compute_bytes: 2 under bf16/fp16 autocast, 4 in fp32; activation_checkpointing: "none", "full"
    or "selective" (True: full, False: none, None: config.grad_ckpt); master: master_weights' bf16
    weights and fp32 masters (unsharded). Within -1%..+5% of the H100 peaks in
    bench/results/memory.jsonl (cuBLAS workspaces, allocator rounding not counted)."""
    phases = memory_phases(config, micro_batch_size, world_size, sharded, activation_checkpointing,
                           compute_bytes, master)
    peak = max(phases.values(), key=lambda parts: parts["total"])
    return dict(params=param_counts(config)["total"], **peak)


def state_bytes(n, layer_params, c, world_size, sharded, master):
    """(bytes held through the step by part, gradient bytes held throughout, the bytes of every
    gradient, autocast's cast of every matrix) for n parameters: fp32 weights, AdamW's two fp32
    moments, DDP's fp32 all-reduce copy; FSDP divides them and gathers two layers in c bytes.
    master (MasterAdamW, unsharded): bf16 weights beside their fp32 masters and one flat fp32
    gradient, held throughout; autocast casts none of them, and no DDP wraps the model."""
    if master and not sharded:
        return dict(weights=6 * n, optimizer=8 * n, ddp_buckets=0), 4 * n, 4 * n, 0
    shard = world_size if sharded else 1
    gathered = 2 * layer_params if sharded else 0  # FSDP2 gathers a layer, prefetching the next
    held = dict(weights=4 * n // shard + c * gathered, optimizer=8 * n // shard,
                ddp_buckets=4 * n if world_size > 1 and not sharded else 0)
    return held, 0, 4 * n // shard + 4 * gathered, 0 if c == 4 else c * (n // shard + gathered)


def memory_phases(config, micro_batch_size, world_size=1, sharded=False,
                  activation_checkpointing=None, compute_bytes=2, master=False):
    """{moment: {part: bytes, "total": sum}} where a step can peak: forward_end (autocast's cached
    weight casts, the kept activations, a loss chunk's fp32 logits and log-softmax or, fused, their
    gradient), loss_backward (less the casts checkpointed layers drop, plus the head's gradients and
    the logits rebuilt, or the fused loss's input gradient scaled), backward_end (every gradient,
    the first layer's activations and casts); and throughout, state_bytes' weights and optimizer."""
    ckpt = activation_checkpointing
    mode = {None: config.grad_ckpt, True: "full", False: "none"}.get(ckpt, ckpt)
    if mode not in GRAD_CKPT:
        raise ValueError(f"activation_checkpointing={ckpt!r}: one of {', '.join(GRAD_CKPT)}")
    counts = param_counts(config)
    n, V, S = counts["total"], config.padded_vocab, config.stream
    tokens = micro_batch_size * config.block_size
    L, d, c, s = config.n_layer, config.n_embd, compute_bytes, stream_bytes(config, compute_bytes)
    head, fused = V * d, GPT.fuses_loss(config)
    layer_params, shard = counts["non_embedding"] // L, world_size if sharded else 1
    held, flat, all_grads, casts = state_bytes(n, layer_params, c, world_size, sharded, master)
    (kept_layer, rebuilt), (outside, norm_out) = layer_bytes(config, mode, c, s), \
        outside_bytes(d, c, s)
    rows = min(tokens, config.loss_chunk) if config.loss_chunk else tokens
    # per block application with gradients, and per supervision step its final norm and sums
    (n_sup, per_layer, _), sums = config.applications(), config.sums_kept(mode)
    kept = S * L * n_sup * (per_layer * kept_layer + sums) + n_sup * outside + (S - 1) * 4 * d
    # an unchunked loss keeps each earlier supervision step's fp32 log-softmax; the fused loss
    # each step's fp32 gradient of the head, made in the forward
    earlier = (n_sup - 1) * rows * V * 4 if rows == tokens and not fused else 0
    grad_head = n_sup * 4 * head if fused else 0
    # the fused loss's chunk: fp32 logits and logsumexp's two temporaries, beside the final norm's
    # output, which it reads and does not keep
    chunk = rows * V * 12 + tokens * norm_out * d if fused else rows * V * 8 + earlier
    # checkpointed layers did not keep their casts: only the head's, rebuilt with its loss chunk
    loss_casts = casts if mode == "none" or not casts else 0 if fused else c * head // shard
    phases = dict(
        forward_end=dict(held, gradients=flat, weight_casts=casts,
                         activations=tokens * kept + grad_head, logits=chunk),
        loss_backward=dict(held, gradients=flat + (2 if flat else 4) * head // shard,
                           weight_casts=loss_casts, activations=tokens * kept + grad_head,
                           logits=tokens * norm_out * d if fused else rows * V * 12 + earlier),
        backward_end=dict(held, gradients=all_grads,
                          weight_casts=c * layer_params if casts else 0,
                          activations=tokens * (S * (kept_layer + rebuilt + 2 * sums + 4 * d)
                                                + outside - 4 * d), logits=0))
    for parts in phases.values():
        parts["total"] = sum(parts.values())
    return phases
