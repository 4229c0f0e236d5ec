"""
The GPT of podgpt: a decoder-only transformer laid out as Llama's (names, rotate-half RoPE), so its
weights map one to one onto transformers' LlamaForCausalLM: pre-norm RMSNorm, RoPE, a SwiGLU MLP,
grouped-query attention, no biases. The vocabulary is padded to a multiple of vocab_multiple
(faster matmuls); padded ids are never targets and never sampled. podgpt/research/'s objectives
subclass GPT and GPTConfig.
"""

import importlib.util
import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from podgpt.core.attention import (ATTENTION_BACKENDS, OPT_IN_BACKENDS, Documents, Mask, attention,
                                   resolve_backend)
from podgpt.core.loss import linear_cross_entropy
from podgpt.core.util import IGNORE, device_mesh, dtype_name, first_line

GRAD_CKPT = ("none", "full", "selective")
# GPTConfig fields that say how to run the model, not what it is: the weights do not depend on
# them, export has nothing to map them to, and a resumed run may change them
RUNTIME_FIELDS = ("attn_backend", "doc_mask", "bos_id", "grad_ckpt", "loss_chunk", "fused_loss",
                  "fuse_projections", "fp8_head", "fp8_recipe", "residual_dtype")
RESIDUAL_DTYPES = ("auto", "float32", "bfloat16")
# fp8_recipe's choices (torchao's Float8LinearRecipeName), each with torchao's size rule for it:
# (K, N) -> whether a matmul is too small for float8 to pay for its casts (fp8_filter)
FP8_RECIPES = {"tensorwise": lambda k, n: k <= 4096 and n <= 1024,
               "rowwise": lambda k, n: n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)}


@dataclass
class GPTConfig:
    vocab_size: int = 50257       # the tokenizer's vocabulary (BOS included)
    block_size: int = 1024        # context length
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 12           # < n_head: grouped-query attention
    n_embd: int = 768
    ffn_hidden: int = None        # SwiGLU hidden size; None: 8/3 n_embd rounded up to multiple_of
    multiple_of: int = 256        # Llama's rounding (an odd size is slow: docs/config.md); 1: none
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    vocab_multiple: int = 64      # pad the embedding rows to a multiple of this
    init_std: float = 0.02
    # runtime settings (RUNTIME_FIELDS): a checkpoint of any of them resumes under any other
    attn_backend: str = "sdpa"    # auto | sdpa (PyTorch picks) | one of attention.py's backends
    doc_mask: bool = False        # attend only within the document (one starts at each bos_id)
    bos_id: int = None            # the BOS token id (prepare.py: vocab_size - 1); doc_mask needs it
    grad_ckpt: str = "none"       # activation checkpointing while training: none | full | selective
    # tokens per chunk of the LM head + loss (0: all at once, and the logits are returned): 8192
    # rows of 50k-vocabulary logits are ~4 GB, and the head's matmul stays efficient
    loss_chunk: int = 8192
    # the chunked loss makes its gradients in its forward (podgpt/core/loss.py): the head's matmul
    # runs once, not again in the backward as a checkpointed chunk's does
    fused_loss: bool = True
    # q/k/v and gate/up each as one matmul while training (their weights concatenated in forward,
    # so checkpoints and export keep the separate ones): one read and, in fp8, one cast of the
    # input instead of three and two. Off until a GPU measures it: preflight's memory plan counts
    # separate projections (on, it plans up to ~10% more activation memory than a CPU step holds)
    fuse_projections: bool = False
    fp8_head: bool = False        # fp8=True: the LM head in float8 too (the loss reads its logits)
    fp8_recipe: str = "tensorwise"  # fp8=True: torchao's scales, tensorwise | rowwise (FP8_RECIPES)
    # the residual stream between blocks: bfloat16 halves the bytes its norms and adds move; auto:
    # bfloat16 under bf16 autocast or bf16 compute, else float32 (residual_stream_dtype)
    residual_dtype: str = "auto"
    padded_vocab: int = field(init=False)
    objective = "ar"              # not fields: a research objective's config has its own
    added_tokens = 0              # ids an objective adds past the data's vocabulary
    own_mask = None               # the kind of Mask an objective trains under, if it has its own
    draws = None                  # an objective that makes its own targets: each sample's draws

    def __post_init__(self):
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}) "
                             f"and n_head by n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2:
            raise ValueError(f"head size n_embd/n_head = {self.head_dim} must be even for RoPE")
        if self.attn_backend not in ("auto", *ATTENTION_BACKENDS, *OPT_IN_BACKENDS, "sdpa"):
            raise ValueError(f"attn_backend={self.attn_backend!r}: choose auto, sdpa or one of "
                             f"{', '.join(ATTENTION_BACKENDS + OPT_IN_BACKENDS)}")
        if self.grad_ckpt not in GRAD_CKPT:
            raise ValueError(f"grad_ckpt={self.grad_ckpt!r}: choose one of {', '.join(GRAD_CKPT)}")
        if self.doc_mask and self.bos_id is None:
            raise ValueError("doc_mask=True needs bos_id, the token that starts every document "
                             "(prepare.py's manifest: vocab_size - 1)")
        if why := fp8_recipe_unknown(self.fp8_recipe):
            raise ValueError(why)
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype={self.residual_dtype!r}: choose one of "
                             f"{', '.join(RESIDUAL_DTYPES)}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk={self.loss_chunk}: "
                             f"tokens per loss chunk, or 0 for no chunking")
        if self.multiple_of < 1:
            raise ValueError(f"multiple_of={self.multiple_of}: the SwiGLU hidden size is rounded "
                             f"up to a multiple of this (1: not rounded)")
        if self.ffn_hidden is None:
            self.ffn_hidden = -(-(8 * self.n_embd // 3) // self.multiple_of) * self.multiple_of
        self.padded_vocab = -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def mask_kind(self):
        """The kind of Mask training attends under: the objective's, documents, or None (causal)."""
        return self.own_mask or ("documents" if self.doc_mask else None)

    # what a research objective overrides
    stream = 1                    # positions the blocks run on per token of a row

    def applications(self, training=True):
        """(supervision steps, block applications per layer and step with gradients, without)."""
        return 1, 1, 0

    def sums_kept(self, mode):
        """Bytes per token a layer keeps beyond its activations under grad_ckpt=mode."""
        return 0

    def check_data(self, data_dir, manifest):
        """Stop with one line when the prepared data cannot train this model."""

    def random_batch(self, rows, device, seq_len=None):
        """(inputs, targets) of random tokens, for the probes that time a step (sanity, bench)."""
        shape = (rows, seq_len or self.block_size)
        return tuple(torch.randint(0, self.vocab_size, shape, device=device) for _ in range(2))

    @property
    def cache_slots(self):
        """KV-cache entries per position: one per block application of an inference forward."""
        n_sup, per_layer, _ = self.applications(training=False)
        return n_sup * per_layer * self.n_layer


# -----------------------------------------------------------------------------------------------
# RoPE, Llama's rotate-half convention: a head's two halves are the coordinates of rotated pairs

def rope_tables(head_dim, length, theta, device=None):
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device),
                         1.0 / (theta ** exponents))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class KVCache:
    """Keys and values of positions [0, pos), up to max_len, with a slot per block application (an
    objective that applies a block many times keeps each one's keys)."""

    def __init__(self, config, batch_size, max_len, device, dtype):
        shape = (config.cache_slots, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0

    def update(self, slot, k, v):
        end = self.pos + k.size(2)
        self.k[slot, :, :, self.pos:end] = k
        self.v[slot, :, :, self.pos:end] = v
        return self.k[slot, :, :, :end], self.v[slot, :, :, :end]


def fuses(config, linears):
    """Whether linears run as one matmul: while training (without gradients, as in generation, the
    concatenation would copy the weights at every token), and all of one kind, fp8 or not."""
    return (config.fuse_projections and torch.is_grad_enabled()
            and len({type(m) for m in linears}) == 1)


def fused_linear(x, linears):
    """Each of linears (bias-free, nn.Linear or torchao's Float8Linear) on x, from one matmul over
    their concatenated weights; float8 as Float8Linear.forward computes it, under the first's
    config: one cast of x and of the weights, one cast of the gradient in the backward. Tensorwise,
    one scale for all the weights; rowwise, one per output row, as the separate layers' forward."""
    weight, first = torch.cat([m.weight for m in linears]), linears[0]
    if hasattr(first, "linear_mm_config"):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        if torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), first.linear_mm_config,
                                                 first.config)
    else:
        y = F.linear(x, weight)
    return y.split([m.out_features for m in linears], dim=-1)


class Attention(nn.Module):
    FUSED = ("q_proj", "k_proj", "v_proj")  # one matmul under fuse_projections

    def __init__(self, config):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * hd, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(config.n_head * hd, config.n_embd, bias=False)
        # RoPE tables: not learned, so not in checkpoints, and float32. Each layer holds its own:
        # FSDP2 casts a block's float inputs to the compute dtype, and torch 2.11-2.12 skip that
        # cast when activation checkpointing recomputes the block.
        cos, sin = rope_tables(hd, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x, cache=None, mask=None, slot=None):
        """mask: None (causal), False (none: x sees itself and every cached key), or a Mask."""
        (B, T, _), hd, start = x.shape, self.config.head_dim, cache.pos if cache is not None else 0
        positions = mask.positions if isinstance(mask, Mask) else None  # a mask may move rows
        at = slice(start, start + T) if positions is None else positions
        cos, sin = self.rope_cos[at], self.rope_sin[at]
        projs = (self.q_proj, self.k_proj, self.v_proj)
        outs = fused_linear(x, projs) if fuses(self.config, projs) else (p(x) for p in projs)
        q, k, v = (y.view(B, T, -1, hd).transpose(1, 2) for y in outs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # the queries follow the cached keys: causal aligns them bottom-right
            k, v = cache.update(slot, k, v)
        y = attention(self.config.attn_backend, q, k, v, mask is not False, mask or None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    FUSED = ("gate_proj", "up_proj")

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x):
        projs = (self.gate_proj, self.up_proj)
        gate, up = fused_linear(x, projs) if fuses(self.config, projs) else (p(x) for p in projs)
        return self.down_proj(F.silu(gate) * up)


def residual_stream_dtype(setting, x):
    """The residual stream's dtype under residual_dtype=setting for x: auto is bfloat16 under bf16
    autocast or where x already is (FSDP2's bf16 compute, bf16 weights), else float32 (fp16's range
    is too narrow for a stream of sums)."""
    if setting != "auto":
        return getattr(torch, setting)
    dev = x.device.type
    bf16 = x.dtype == torch.bfloat16 or (torch.is_autocast_enabled(dev)
                                         and torch.get_autocast_dtype(dev) == torch.bfloat16)
    return torch.bfloat16 if bf16 else torch.float32


class RMSNormFp32(torch.autograd.Function):
    """RMSNorm of a low-precision x computed in fp32, its output in dtype. It keeps x as it came and
    each row's 1/rms for the backward, not an fp32 copy: half the bytes of an fp32 stream's norm."""

    @staticmethod
    def forward(ctx, x, weight, eps, dtype):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed, grad = x.float() * rstd, grad.float()
        grad_weight = (grad * normed).flatten(0, -2).sum(0)
        grad_normed = grad * weight.float()
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None, None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm, in fp32 whatever its input's dtype. A bf16 residual stream's norm returns the
    compute dtype: autocast's, else the weight's (a stream stored in bf16, computed in fp32)."""

    def forward(self, x):
        if x.dtype == torch.float32:
            return super().forward(x)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else \
            self.weight.dtype
        return RMSNormFp32.apply(x, self.weight, self.eps, dtype)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.grad_ckpt, self.residual_dtype = config.grad_ckpt, config.residual_dtype
        self.input_layernorm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, mask=None, slot=None, context=None):
        # Checkpointing inside the block's forward runs the block's hooks (FSDP2's all-gather and
        # cast) once, outside the recomputed region: checkpoint, then shard, as torchtitan wraps.
        # (torch.compile takes context_fn only spelled out like this.)
        if torch.is_grad_enabled() and cache is None and self.grad_ckpt == "full":
            return checkpoint(self.body, x, None, mask, None, context, use_reentrant=False)
        if torch.is_grad_enabled() and cache is None and self.grad_ckpt == "selective":
            return checkpoint(self.body, x, None, mask, None, context, use_reentrant=False,
                              context_fn=selective_checkpointing)
        return self.body(x, cache, mask, slot, context)

    def body(self, x, cache, mask, slot, context):
        """x plus the block's two residual branches. context: the branches read x + context and add
        to x alone (a recurrent objective's state). slot: this application's KV-cache entry."""
        stream = residual_stream_dtype(self.residual_dtype, x)  # each add's sum is cast
        h = x if context is None else x + context
        x = (x + self.self_attn(self.input_layernorm(h), cache, mask, slot)).to(stream)
        h = x if context is None else x + context
        return (x + self.mlp(self.post_attention_layernorm(h))).to(stream)


# selective checkpointing saves what is costly to recompute, the matmuls' and the attention
# kernels' outputs, and recomputes norms, RoPE, SiLU, residual adds and casts. (Kernels that are
# no torch op are recomputed: right, only slower.) fp8's matmuls are aten::_scaled_mm.
SAVED_OPS = {"aten::mm", "aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention", "flex_attention",
             "flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward",
             "flash_attn_3::_flash_attn_forward"}


def selective_policy(ctx, op, *args, **kwargs):
    saved = op.name() in SAVED_OPS
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


selective_checkpointing = partial(create_selective_checkpoint_contexts, selective_policy)


def per_target(total, targets, weights):
    """The loss per target, as F.cross_entropy's mean over the targets that are not IGNORE, but 0,
    not NaN, for a batch with none; with weights, over every target."""
    return total / (targets.numel() if weights is not None
                    else (targets != IGNORE).sum().clamp(min=1))


# a division by a count from the targets inside the compiled graph made its backward hold every
# loss chunk's logits at once
per_target_outside = torch.compiler.disable(per_target)


class GPT(nn.Module):
    """The autoregressive model (objective="ar"): embedding, blocks, head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.padded_vocab, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch adds to the stream 2*n_layer times
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def forward(self, idx, targets=None, cache=None):
        """(logits (B, T, padded_vocab), loss): loss None without targets, logits None when the loss
        is chunked. With a cache, idx follows its positions and joins them. A research model may add
        a third item, its stats: a 1-D tensor train.py sums and the model's metrics() names."""
        T = self.check_length(idx, cache)
        x = self.embed_tokens(idx)
        x = x.to(residual_stream_dtype(self.config.residual_dtype, x))
        doc_mask = self.config.doc_mask and cache is None  # generation reads one document
        documents = Documents(torch.cumsum(idx == self.config.bos_id, dim=1)) if doc_mask else None
        out = self.predict(x, targets, cache, self.ready(x, documents))
        if cache is not None:
            cache.pos += T
        return out

    def check_length(self, idx, cache):
        start, T = cache.pos if cache is not None else 0, idx.size(1)
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than "
                             f"block_size={self.config.block_size}")
        return T

    def ready(self, x, mask=None):
        """mask, made in the form x's backend takes: once for all layers, and not inside a
        checkpoint (auto's parity check runs a backward of its own)."""
        c, dev = self.config, x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        kind = None if mask is None else mask.kind
        backend = resolve_backend(c.attn_backend, x.device, dtype, c.head_dim, kind)[0]
        if mask is not None:
            mask.get(mask.FORMS[backend])
        return mask

    def predict(self, x, targets, cache, mask):
        """forward()'s result for the embedded tokens x."""
        return self.head(self.blocks(x, cache, mask), targets)

    def blocks(self, x, cache=None, mask=None):
        """x through every layer, each with its own KV-cache slot."""
        for i, block in enumerate(self.layers):
            x = block(x, cache, mask, i)
        return x

    def head(self, x, targets, weights=None, in_graph=False):
        """The final norm, the LM head and the loss: forward()'s first two items. The loss: with
        weights, their weighted cross-entropy over the number of targets; else per_target, outside
        the compiled graph when chunked, unless in_graph (a break would split a caller's loop)."""
        x = self.norm(x)
        if targets is None:
            return self.lm_head(x), None
        targets, weights = targets.flatten(), None if weights is None else weights.flatten()
        logits = None if self.config.loss_chunk else self.lm_head(x)
        total = (self.chunked_loss(x.flatten(0, 1), targets, weights) if logits is None else
                 self.cross_entropy_sum(logits, targets, weights))
        outside = logits is None and weights is None and not in_graph
        return logits, (per_target_outside if outside else per_target)(total, targets, weights)

    def chunked_loss(self, x, targets, weights=None):
        """The summed cross-entropy, loss_chunk tokens at a time: fused (fused_loss), or each chunk
        under checkpoint: the forward keeps no logits and the backward rebuilds them a chunk at a
        time."""
        n = self.config.loss_chunk
        if self.fuses_loss(self.config):
            never = self.never_predicted(x.device)
            return linear_cross_entropy(x, self.lm_head.weight, targets, weights, n, never)
        xs, ys = x.split(n), targets.split(n)
        ws = (None,) * len(xs) if weights is None else weights.split(n)
        # one chunk would be rebuilt while every layer's activations are still held: only cost
        rebuild = torch.is_grad_enabled() and x.size(0) > n
        return sum(checkpoint(self.loss_sum, xc, yc, wc, use_reentrant=False) if rebuild
                   else self.loss_sum(xc, yc, wc) for xc, yc, wc in zip(xs, ys, ws, strict=True))

    @staticmethod
    def fuses_loss(config):
        """Whether the loss runs fused: fused_loss, chunked, and the head not fp8_head's (the fused
        loss reads its weight, not its float8 module)."""
        return bool(config.fused_loss and config.loss_chunk and not config.fp8_head)

    def never_predicted(self, device):
        """The ids (a tensor) whose logit the loss sets to -inf, or None: an objective's own."""
        return None

    def loss_sum(self, x, targets, weights=None):
        return self.cross_entropy_sum(self.lm_head(x), targets, weights)

    def cross_entropy_sum(self, logits, targets, weights=None):
        """The summed cross-entropy of logits against targets (N,), each weighed by weights (N,)."""
        logits = logits.float().view(targets.numel(), -1)
        never = self.never_predicted(logits.device)
        if never is not None:
            logits = logits.index_fill(-1, never, float("-inf"))
        if weights is None:
            return F.cross_entropy(logits, targets, reduction="sum")
        return (F.cross_entropy(logits, targets, reduction="none") * weights).sum()

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 use_cache=True, generator=None):
        """Yields the next token of each row, shape (B,), max_new_tokens times. Past block_size the
        cache restarts from the last block_size // 2 tokens (a sliding window)."""
        c, cache, feed = self.config, None, idx
        block, dtype = c.block_size, next(self.parameters()).dtype
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(idx[:, -block:])[0]
            else:
                if cache is None or cache.pos + feed.size(1) > block:
                    feed = idx[:, -(block if cache is None else block // 2):]
                    cache = KVCache(c, idx.size(0), block, idx.device, dtype)
                logits = self(feed, cache=cache)[0]
            token = sample_next(logits[:, -1, :c.vocab_size], temperature, top_k, top_p, generator)
            idx = torch.cat([idx, token[:, None]], dim=1)
            feed = token[:, None]
            yield token


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from logits (B, V): greedy at temperature 0, else top-k / top-p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # the mass before this token covers top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def fp8_unavailable(device, dtype, compiled):
    """None when fp8=True can train on device, the rest in dtype, compiled or not; else one line
    saying why not and what would make it run."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"fp8=True trains on a CUDA GPU with float8 tensor cores; this is {device.type}: "
                f"set fp8=False")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"fp8=True needs float8 tensor cores, compute capability 8.9 or newer (H100, "
                f"H200, L40S, RTX 4090); {torch.cuda.get_device_name(device)} is "
                f"{major}.{minor}: set fp8=False")
    if dtype != torch.bfloat16:
        return (f"fp8=True computes the rest of the model in bfloat16, not "
                f"{dtype_name(dtype)}: set dtype=bfloat16")
    if not compiled:
        return ("fp8=True needs compile=True: without torch.compile fusing float8's scaling and "
                "casts, its matmuls are slower than bfloat16's")
    if importlib.util.find_spec("torchao") is None:
        return ("fp8=True needs torchao (float8 training), which is not installed: "
                "pip install torchao")
    try:
        importlib.import_module("torchao.float8")
    except Exception as e:  # a torchao built for another torch fails in its own ways
        return (f"torchao is installed but torchao.float8 does not import ({first_line(e)}): "
                f"pip install -U torchao")
    return None


def fp8_recipe_unknown(recipe):
    """None for one of FP8_RECIPES, else the one line that refuses it."""
    return None if recipe in FP8_RECIPES else (
        f"fp8_recipe={recipe!r} is not one of {', '.join(FP8_RECIPES)} (torchao's float8 "
        f"scaling: one scale per tensor, or one per row)")


def fp8_filter(model):
    """torchao's module_filter_fn for model: (module, fqn) -> whether that nn.Linear computes in
    float8. Not the LM head (the loss reads its logits) unless fp8_head; not a layer with a
    dimension not a multiple of 16 (float8 matmuls need it); not a matmul too small for float8 to
    pay for its casts, by the rule torchao gives fp8_recipe (FP8_RECIPES, from its H100 tables;
    bench/matmul.py --fp8 measures this GPU's): tensorwise keeps K <= 4096 and N <= 1024
    (float8_linear_utils._auto_filter_for_tensorwise), rowwise N <= 2048, K <= 1024, or N <= 4096
    and K <= 2048 (_auto_filter_for_rowwise). Under fuse_projections a fused group's matmul is
    judged whole (N its members' summed), and its members convert together (fused_linear runs
    them as one)."""
    c = model.config
    too_small = FP8_RECIPES[c.fp8_recipe]

    def converts(module, fqn):
        if fqn == "lm_head":
            return c.fp8_head and not (module.in_features % 16 or module.out_features % 16)
        parent, _, name = fqn.rpartition(".")
        names = getattr(model.get_submodule(parent), "FUSED", ())
        group = ([model.get_submodule(f"{parent}.{n}") for n in names]
                 if c.fuse_projections and name in names else [module])
        k, n = module.in_features, sum(m.out_features for m in group)
        if k % 16 or any(m.out_features % 16 for m in group):
            return False
        return not too_small(k, n)
    return converts


def float8_linears(model):
    """fp8=True: (converted names, kept names). The nn.Linear layers fp8_filter chooses become
    torchao's Float8Linear (fp8_recipe's), in place, their weights the same fp32 parameters."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    converts = fp8_filter(model)
    # decided before the conversion replaces any of a group's modules
    chosen = {name: converts(m, name) for name, m in model.named_modules()
              if isinstance(m, nn.Linear)}
    # no enable_fsdp_float8_all_gather: its float8 weight subclass would reach checkpoints, export
    # and sample.py; FSDP gathers bf16 weights, and the matmuls still run in float8
    config = Float8LinearConfig.from_recipe_name(model.config.fp8_recipe)
    convert_to_float8_training(model, module_filter_fn=lambda module, name: chosen.get(name, False),
                               config=config)
    return [n for n, yes in chosen.items() if yes], [n for n, yes in chosen.items() if not yes]


def shard_model(model, dev, compute_dtype):
    """FSDP2: each block sharded on its own, the root the rest; compute in compute_dtype,
    gradients reduced in fp32. (Imported here: ~1 s every run that does not shard would pay.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    mesh = device_mesh(dev)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
