"""
The GPT of podgpt: a Llama-compatible decoder-only transformer in one file.

- RMSNorm (pre-norm), rotate-half RoPE with a configurable theta, SwiGLU MLP with a
  configurable hidden size, grouped-query attention (n_kv_head divides n_head), no
  biases, tied or untied input/output embeddings. The layout (names, RoPE convention)
  is Llama's, so the weights map one to one onto transformers' LlamaForCausalLM.
- The vocabulary is padded to a multiple of `vocab_multiple` (matmuls with a round
  inner size run faster); padded ids are never targets and never sampled.
- Attention goes through `attention()`, one place that dispatches on
  `config.attn_backend`, so kernels can be added without touching the blocks.
- `generate()` streams tokens with a KV cache; temperature / top-k / top-p sampling.
- Arithmetic that planning needs without building the model: parameter counts,
  FLOPs per token, and the datasheet peak of known GPUs for MFU.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50257       # the tokenizer's vocabulary (BOS included)
    block_size: int = 1024        # context length
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 12           # < n_head: grouped-query attention
    n_embd: int = 768
    ffn_hidden: int = None        # SwiGLU hidden size; None: floor(8 * n_embd / 3)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    vocab_multiple: int = 64      # pad the embedding rows to a multiple of this
    init_std: float = 0.02
    attn_backend: str = "sdpa"
    padded_vocab: int = field(init=False)

    def __post_init__(self):
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}) "
                             f"and n_head by n_kv_head ({self.n_kv_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head size n_embd/n_head = {self.n_embd // self.n_head} must be even for RoPE")
        if self.ffn_hidden is None:
            self.ffn_hidden = 8 * self.n_embd // 3
        self.padded_vocab = -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


# -----------------------------------------------------------------------------
# attention backends: (q, k, v) are (B, heads, T, head_dim); k and v may have fewer
# heads (GQA). `causal` is the mask: True for a causal square, False for none, or a
# boolean tensor (T_q, T_k) where True means "may attend".

def sdpa_attention(q, k, v, causal):
    mask = causal if isinstance(causal, torch.Tensor) else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal is True,
                                          enable_gqa=k.size(1) != q.size(1))


ATTENTION_BACKENDS = {"sdpa": sdpa_attention}


def attention(backend, q, k, v, causal):
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attn_backend={backend!r} is not available; choose one of {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[backend](q, k, v, causal)


# -----------------------------------------------------------------------------
# rotary position embedding, Llama's rotate-half convention: the first and second
# halves of each head are the two coordinates of each rotated pair.

def rope_tables(head_dim, length, theta, device=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class KVCache:
    """Keys and values of every layer for positions [0, pos), preallocated up to max_len."""

    def __init__(self, config, batch_size, max_len, device, dtype):
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0

    def update(self, layer, k, v):
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.config, self.layer = config, layer
        hd = config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * hd, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(config.n_head * hd, config.n_embd, bias=False)

    def forward(self, x, cos, sin, cache=None):
        B, T, _ = x.shape
        hd = self.config.head_dim
        q = self.q_proj(x).view(B, T, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = True
        if cache is not None:
            start = cache.pos
            k, v = cache.update(self.layer, k, v)
            if start > 0:  # new queries sit at the end of the cached keys: align the mask bottom-right
                causal = False if T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
        y = attention(self.config.attn_backend, q, k, v, causal)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.padded_vocab, config.n_embd)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # RoPE tables are derived, not learned: not saved in checkpoints
        cos, sin = rope_tables(config.head_dim, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch adds to the stream 2*n_layer times
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def forward(self, idx, targets=None, cache=None):
        """Logits (B, T, padded_vocab) and, with targets, the mean cross-entropy."""
        T = idx.size(1)
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        cos = self.rope_cos[start:start + T]
        sin = self.rope_sin[start:start + T]
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x, cos, sin, cache)
        logits = self.lm_head(self.norm(x))
        if cache is not None:
            cache.pos += T
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True, generator=None):
        """Yields the next token of each row, shape (B,), max_new_tokens times.

        With the cache, the prompt runs once and each new token costs one position.
        When the context would pass block_size the cache restarts from the last
        block_size // 2 tokens (a sliding window, amortised over the next half block).
        """
        block = self.config.block_size
        param = next(self.parameters())
        cache, feed = None, idx
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -block:])
            else:
                if cache is None or cache.pos + feed.size(1) > block:
                    feed = idx[:, -(block if cache is None else block // 2):]
                    cache = KVCache(self.config, idx.size(0), block, idx.device, param.dtype)
                logits, _ = self(feed, cache=cache)
            token = sample_next(logits[:, -1, :self.config.vocab_size], temperature, top_k, top_p, generator)
            idx = torch.cat([idx, token[:, None]], dim=1)
            feed = token[:, None]
            yield token


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from logits (B, V): greedy at temperature 0, else top-k / top-p sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # mass before this token already covers top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# -----------------------------------------------------------------------------
# arithmetic: from the config alone, so planning never has to allocate the model

def param_counts(config):
    """Parameter counts: total (unique), embedding (input table), head (untied output
    matrix, 0 when tied), non_embedding (the rest: blocks and final norm)."""
    d, hd = config.n_embd, config.head_dim
    attn = d * config.n_head * hd * 2 + d * config.n_kv_head * hd * 2
    mlp = 3 * d * config.ffn_hidden
    non_embedding = config.n_layer * (attn + mlp + 2 * d) + d
    embedding = config.padded_vocab * d
    head = 0 if config.tie_embeddings else embedding
    return dict(total=non_embedding + embedding + head, embedding=embedding, head=head,
                non_embedding=non_embedding)


def flops_per_token(config, seq_len=None):
    """Training FLOPs per token: 6*N + 12*L*H*Q*T (PaLM's accounting), N = matmul
    parameters including the LM head but not the input embedding lookup."""
    T = seq_len or config.block_size
    n = param_counts(config)["non_embedding"] + config.padded_vocab * config.n_embd
    return 6 * n + 12 * config.n_layer * config.n_head * config.head_dim * T


def memory_estimate(config, micro_batch_size, world_size=1, sharded=False, activation_checkpointing=False,
                    compute_bytes=2):
    """Bytes per GPU of one training step, by part. compute_bytes: 2 under bf16/fp16 autocast, 4 in fp32.

    - weights, gradients: fp32, 4 bytes/param each; optimizer: AdamW's two fp32 moments, 8 bytes/param.
      sharded (FSDP): all three divided over world_size, plus two layers gathered at a time.
    - weight_casts: autocast's compute-dtype copy of every matrix, kept for the backward.
    - activations: what the backward keeps, counted from the saved tensors of model.py on CPU
      (tests/test_model.py measures it): per layer and token, 12*d bytes of fp32 norm state and
      residual, compute-dtype copies of 5 d-wide tensors (norm outputs, q, attention output and
      its reshaped copy), k and v, and SwiGLU's 4 hidden-wide tensors; a fused attention kernel
      keeps no T x T matrix. With activation checkpointing each layer keeps only its fp32 input,
      and one layer is rebuilt at a time.
    - logits: the logits, their fp32 copy for the loss, and the log-softmax the loss keeps.
    """
    counts = param_counts(config)
    n = counts["total"]
    tokens = micro_batch_size * config.block_size
    d, dkv, f, c = config.n_embd, config.n_kv_head * config.head_dim, config.ffn_hidden, compute_bytes
    layer_params = counts["non_embedding"] // config.n_layer
    per_layer = tokens * (12 * d + c * (5 * d + 2 * dkv + 4 * f))
    final = tokens * (8 * d + c * d)
    if activation_checkpointing:
        activations = config.n_layer * tokens * 4 * d + per_layer + final
    else:
        activations = config.n_layer * per_layer + final
    shard = world_size if sharded else 1
    est = dict(params=n,
               weights=4 * n // shard + (2 * layer_params * c if sharded else 0),
               gradients=4 * n // shard + (2 * layer_params * 4 if sharded else 0),
               optimizer=8 * n // shard,
               ddp_buckets=4 * n if world_size > 1 and not sharded else 0,  # DDP's all-reduce copy of the gradients
               weight_casts=0 if c == 4 else c * n // shard + (2 * layer_params * c if sharded else 0),
               activations=activations,
               logits=tokens * config.padded_vocab * (c + (4 if c < 4 else 0) + 4))
    est["total"] = sum(v for k, v in est.items() if k != "params")
    return est


# dense bf16 tensor-core peaks from NVIDIA's datasheets (the sparse figures are 2x these)
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("A100", 312e12))


def peak_flops(device_name):
    """Datasheet dense bf16 FLOP/s for a GPU name, or None if unknown (then no MFU rather than a wrong one)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None
