"""
The GPT of podgpt: a Llama-compatible decoder-only transformer in one file.

- RMSNorm (pre-norm), rotate-half RoPE with a configurable theta, SwiGLU MLP with a
  configurable hidden size (by default Llama's: 8/3 of the width rounded up to a multiple of
  256, so its matmuls run on whole tensor-core tiles), grouped-query attention (n_kv_head divides n_head), no
  biases, tied or untied input/output embeddings. The layout (names, RoPE convention)
  is Llama's, so the weights map one to one onto transformers' LlamaForCausalLM.
- The vocabulary is padded to a multiple of `vocab_multiple` (matmuls with a round
  inner size run faster); padded ids are never targets and never sampled.
- Attention goes through `attention()`, one place that dispatches on
  `config.attn_backend`: FlashAttention 3 / 2 when installed, PyTorch's SDPA held to one
  kernel (cudnn, flash, efficient, math) or left to choose ("sdpa"), FlexAttention, or
  "auto", the fastest of them that runs here and agrees with a float64 reference.
  FlashAttention 4 through SDPA ("fa4") runs only when named: never auto's pick.
- doc_mask: tokens attend only within their document (documents start at bos_id), so
  packed rows train like separate sequences.
- Memory: activation checkpointing (grad_ckpt: full or selective) and a chunked loss
  (loss_chunk) that never holds fp32 logits for the whole batch.
- `generate()` streams tokens with a KV cache; temperature / top-k / top-p sampling.
- objective="refine" (deep-supervision refinement): the same weights applied recursively, with a loss after each pass
  through the layers (deep supervision, GPT.refine); its KV cache has an entry per block application.
- objective="bd3lm": block diffusion on GSM8K, BD3-LM's NELBO over a noisy and a clean copy of each row
  in one pass (GPT.diffuse, BlockDiffusion's mask; HDP's question / plan / execution segments), sampled a
  block at a time with the earlier blocks in the KV cache (GPT.generate_blocks).
- fp8 (train.py's key, opt-in): torchao's float8 training for the linear layers, float8_linears.
- Arithmetic that planning needs without building the model: parameter counts,
  FLOPs per token, bytes per GPU, and the datasheet peak of known GPUs for MFU.
"""

import importlib
import importlib.util
import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import lru_cache, partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from util import device_mesh, first_line

# fastest first: the order attn_backend="auto" tries them in
ATTENTION_BACKENDS = ("fa3", "fa2", "cudnn", "flash", "efficient", "flex", "math")
# backends that run only when attn_backend names them, never auto's pick: fa4 is a beta package, and turning it
# on swaps SDPA's flash kernel for the whole process
OPT_IN_BACKENDS = ("fa4",)
GRAD_CKPT = ("none", "full", "selective")
# GPTConfig fields that say how to run the model, not what it is: a checkpoint's weights do not depend
# on them, export has nothing to map them to, and a resumed run may change them
RUNTIME_FIELDS = ("attn_backend", "doc_mask", "bos_id", "grad_ckpt", "loss_chunk")
OBJECTIVES = ("ar", "refine", "bd3lm")
# refine's presets (deep-supervision refinement): (supervision_weight_base, improvement_reward_scale)
REFINE_PRESETS = dict(moderate=(3.0, 0.5), aggressive=(5.0, 1.0), extreme=(10.0, 2.0))
# GPTConfig fields of objective="refine"; an "ar" model's record leaves them out (checkpoint.run_record), so
# checkpoints from before them resume and export unchanged
REFINE_FIELDS = ("objective", "n_loops", "T_recursion", "n_sup_train", "n_sup_inference", "refine_preset",
                 "supervision_weight_base", "improvement_reward_scale", "detach_threshold")
# and objective="bd3lm"'s, likewise left out of other models' records
DIFFUSION_FIELDS = ("objective", "diffusion_block", "noise_schedule", "clip_low", "clip_high", "hdp_segments")
NOISE_SCHEDULES = ("loglinear", "clipped")
UNMASKING = ("schedule", "confidence")  # how bd3lm's sampler picks the tokens each denoising pass fills (generate_blocks)
LOGLINEAR_EPS = 1e-3  # loglinear's t ~ U[eps, 1] (BD3-LM's sampling_eps_min): 1/t stays finite


@dataclass
class GPTConfig:
    vocab_size: int = 50257       # the tokenizer's vocabulary (BOS included)
    block_size: int = 1024        # context length
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 12           # < n_head: grouped-query attention
    n_embd: int = 768
    ffn_hidden: int = None        # SwiGLU hidden size; None: floor(8 * n_embd / 3) rounded up to multiple_of
    # Llama's rounding of the default hidden size. An odd size runs slowly: on an H100 the 1B shape's
    # SwiGLU matmuls ran at 125-146 TFLOP/s with hidden 5461 against 704 for its LM head, and the whole
    # step went from 48.3% to 51.5% MFU at 5632 (bench/results/, 2026-11-22). 1: no rounding
    multiple_of: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    vocab_multiple: int = 64      # pad the embedding rows to a multiple of this
    init_std: float = 0.02
    # objective="refine", deep-supervision refinement (GPT.refine): the same weights, each block applied
    # many times. The embedding x stays; an answer y (from x) and a latent z (from zeros) pass through every
    # layer: the layer's block updates z n_loops times reading x + y + z, then y once reading y + z (its
    # pre-norms read the sum, its residual adds to the state it updates), all of it T_recursion times. One pass
    # through every layer is a supervision step; the head then reads y and the step's cross-entropy is taken
    objective: str = "ar"         # ar: next-token prediction | refine
    n_loops: int = 2              # refine: latent updates per layer and repetition (the seed system's default)
    T_recursion: int = 1          # refine: repetitions per layer; in training all but the last run without gradients
    n_sup_train: int = 4          # refine: supervision steps per training forward (the seed system's default)
    n_sup_inference: int = 4      # refine: supervision steps in evaluation and generation
    refine_preset: str = "aggressive"  # moderate | aggressive | extreme: the next two when they are None
    supervision_weight_base: float = None   # refine: step i's loss weighs base^i / sum_j base^j
    improvement_reward_scale: float = None  # refine: minus this x (prev - cur) / prev from the second step on
    detach_threshold: int = 2     # refine: y and z detached after each step >= this but the last (the seed's 2)
    # objective="bd3lm", block diffusion (BD3-LM, Arriola et al. 2025; GPT.diffuse): the sequence is cut
    # into blocks of diffusion_block tokens; in each, every token is replaced by [MASK] (the vocabulary's last id:
    # model_config adds it to the data's) with probability t, drawn per block, and the model predicts the clean
    # tokens from the noisy block and the clean blocks before it (one pass over both copies, BlockDiffusion). The
    # loss is the NELBO: each masked token's cross-entropy x 1/t, averaged over the tokens
    diffusion_block: int = 16     # bd3lm: tokens per block (1: the NELBO is the autoregressive loss)
    noise_schedule: str = "loglinear"  # bd3lm: loglinear, t ~ U[1e-3, 1] | clipped, t ~ U[clip_low, clip_high] in training
    clip_low: float = 0.3         # bd3lm, clipped: the paper's beta (a lower-variance, biased training loss;
    clip_high: float = 0.8        # omega: validation always draws t from loglinear's range, so val_loss is the NELBO)
    # bd3lm, HDP: "128,128,256", question, plan, execution, summing to block_size. The question is never noised
    # and sees only itself; plan and execution are diffused in blocks, the plan seeing the question, the execution both
    hdp_segments: str = ""
    # runtime settings (RUNTIME_FIELDS); the defaults are what checkpoints written before them ran with
    attn_backend: str = "sdpa"    # auto | fa3 | fa2 | cudnn | flash | efficient | flex | math | sdpa (PyTorch picks) | fa4
    doc_mask: bool = False        # attend only within the document (a document starts at each bos_id)
    bos_id: int = None            # the BOS token id (prepare.py: vocab_size - 1); doc_mask needs it
    grad_ckpt: str = "none"       # activation checkpointing while training: none | full | selective
    # tokens per chunk of the LM head + loss (0: all at once, and the logits are returned). 8192 rows of
    # 50k-vocabulary logits are ~4 GB in bf16 + fp32 (not the 16 GB of a 16 x 2048 micro-batch), and big
    # enough that the head's matmul stays efficient; the loss is the same mean up to fp32 rounding
    loss_chunk: int = 8192
    padded_vocab: int = field(init=False)

    def __post_init__(self):
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}) "
                             f"and n_head by n_kv_head ({self.n_kv_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head size n_embd/n_head = {self.n_embd // self.n_head} must be even for RoPE")
        if self.attn_backend not in ("auto", *ATTENTION_BACKENDS, *OPT_IN_BACKENDS, "sdpa"):
            raise ValueError(f"attn_backend={self.attn_backend!r}: choose auto, sdpa or one of "
                             f"{', '.join(ATTENTION_BACKENDS + OPT_IN_BACKENDS)}")
        if self.grad_ckpt not in GRAD_CKPT:
            raise ValueError(f"grad_ckpt={self.grad_ckpt!r}: choose one of {', '.join(GRAD_CKPT)}")
        if self.doc_mask and self.bos_id is None:
            raise ValueError("doc_mask=True needs bos_id, the token that starts every document "
                             "(prepare.py's manifest: vocab_size - 1)")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk={self.loss_chunk}: tokens per loss chunk, or 0 for no chunking")
        if self.multiple_of < 1:
            raise ValueError(f"multiple_of={self.multiple_of}: the SwiGLU hidden size is rounded up to a multiple "
                             f"of this (1: not rounded)")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}: choose one of {', '.join(OBJECTIVES)}")
        if self.objective == "bd3lm":
            self.check_diffusion()
        elif self.hdp_segments:
            raise ValueError(f"hdp_segments={self.hdp_segments!r} is for objective=bd3lm (HDP is block diffusion)")
        if self.refine_preset not in REFINE_PRESETS:
            raise ValueError(f"refine_preset={self.refine_preset!r}: choose one of {', '.join(REFINE_PRESETS)}")
        for key, least in (("n_loops", 0), ("T_recursion", 1), ("n_sup_train", 1), ("n_sup_inference", 1),
                           ("detach_threshold", 0)):
            if getattr(self, key) < least:
                raise ValueError(f"{key}={getattr(self, key)} must be at least {least}")
        base, reward = REFINE_PRESETS[self.refine_preset]
        self.supervision_weight_base = base if self.supervision_weight_base is None else self.supervision_weight_base
        self.improvement_reward_scale = reward if self.improvement_reward_scale is None else \
            self.improvement_reward_scale
        if self.supervision_weight_base <= 0:
            raise ValueError(f"supervision_weight_base={self.supervision_weight_base} must be positive")
        if self.ffn_hidden is None:
            self.ffn_hidden = -(-(8 * self.n_embd // 3) // self.multiple_of) * self.multiple_of
        self.padded_vocab = -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def check_diffusion(self):
        if self.noise_schedule not in NOISE_SCHEDULES:
            raise ValueError(f"noise_schedule={self.noise_schedule!r}: choose one of {', '.join(NOISE_SCHEDULES)}")
        if self.noise_schedule == "clipped" and not 0 < self.clip_low < self.clip_high <= 1:
            raise ValueError(f"clip_low={self.clip_low}, clip_high={self.clip_high}: need 0 < clip_low < clip_high <= 1")
        if self.doc_mask:
            raise ValueError("doc_mask=True is for objective=ar or refine: bd3lm's attention goes block by block "
                             "(hdp_segments keeps a question to itself)")
        if self.diffusion_block < 1:
            raise ValueError(f"diffusion_block={self.diffusion_block} must be at least 1")
        diffused = self.segments[1:] if self.hdp_segments else [self.block_size]
        if any(n % self.diffusion_block for n in diffused):
            raise ValueError(f"diffusion_block={self.diffusion_block} must divide "
                             + (f"the plan and execution segments {diffused}" if self.hdp_segments
                                else f"block_size={self.block_size}"))

    @property
    def segments(self):
        """hdp_segments as ints: [question, plan, execution]; [] when empty."""
        if not self.hdp_segments:
            return []
        try:
            segments = [int(n) for n in self.hdp_segments.split(",")]
        except ValueError:
            segments = []
        if len(segments) != 3 or min(segments) < 1 or sum(segments) != self.block_size:
            raise ValueError(f"hdp_segments={self.hdp_segments!r}: three positive lengths (question, plan, execution) "
                             f"that sum to block_size={self.block_size}, e.g. \"128,128,256\" for 512")
        return segments

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def mask_kind(self):
        """The kind of Mask training attends under (resolve_backend's `mask`): documents, diffusion, or None."""
        return "diffusion" if self.objective == "bd3lm" else "documents" if self.doc_mask else None

    @property
    def mask_id(self):
        """bd3lm's [MASK] token: the last id of the vocabulary (the data's vocabulary has one id less)."""
        return self.vocab_size - 1

    @property
    def noised_from(self):
        """bd3lm: the first position that is ever noised (after HDP's question), 0 without one."""
        return self.segments[0] if self.hdp_segments else 0

    def diffusion_blocks(self, device=None):
        """bd3lm: the block of every position, (block_size,) int64: HDP's question is block 0 whole."""
        positions = torch.arange(self.block_size, device=device)
        q = self.noised_from
        return torch.where(positions < q, 0, (positions - q) // self.diffusion_block + (q > 0))

    def applications(self, training=True):
        """(supervision steps, block applications per layer and step with gradients, without) of one forward:
        (1, 1, 0) for "ar"; refine's earlier repetitions run without gradients in training only."""
        if self.objective != "refine":
            return 1, 1, 0
        per_repetition = self.n_loops + 1
        if not training:
            return self.n_sup_inference, per_repetition * self.T_recursion, 0
        return self.n_sup_train, per_repetition, per_repetition * (self.T_recursion - 1)

    @property
    def stream(self):
        """Positions the blocks run on per token of a row: 2 for bd3lm (the noisy and the clean copy), else 1."""
        return 2 if self.objective == "bd3lm" else 1

    @property
    def cache_slots(self):
        """KV-cache entries per position: one per block application of an inference forward."""
        n_sup, per_layer, _ = self.applications(training=False)
        return n_sup * per_layer * self.n_layer


# -----------------------------------------------------------------------------
# attention kernels: (q, k, v) are (B, heads, T, head_dim); k and v may have fewer heads (GQA:
# query head h reads key/value head h // (n_head / n_kv_head), every kernel's convention).
# `causal`: True for causal, aligned bottom-right when there are more keys than queries (the new
# queries of the KV cache come after the cached keys); False for no mask; or a boolean tensor
# (T_q, T_k), True where a query may attend (SDPA kernels only).
# `mask`: None or a Mask, which then decides alone who sees whom: Documents (causal within each document), or
# BlockDiffusion (bd3lm's 2T rows).

class Mask:
    """An attention mask in the form each kind of kernel takes (FORMS: backend -> form), each made on first use
    and kept: GPT.forward makes one per batch before the blocks run, so every layer and every recomputation
    under activation checkpointing reuses it."""
    FORMS = {}

    def __init__(self):
        self.made = {}

    def get(self, form):
        if form not in self.made:
            self.made[form] = getattr(self, form)()
        return self.made[form]


class Documents(Mask):
    """Causal attention within documents: doc_ids (B, T) is the document of every token (doc_mask)."""

    def __init__(self, doc_ids):
        super().__init__()
        self.ids = doc_ids

    def dense(self):
        """(B, 1, T, T) bool for SDPA: causal and the same document."""
        T = self.ids.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
        return (causal & (self.ids[:, :, None] == self.ids[:, None, :]))[:, None]

    def block(self):
        """FlexAttention's BlockMask: blocks wholly outside every document are skipped, not computed."""
        from torch.nn.attention.flex_attention import create_block_mask
        ids = self.ids

        def same_document(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv])

        B, T = ids.shape
        return create_block_mask(same_document, B, None, T, T, device=ids.device)

    def varlen(self):
        """(cu_seqlens, longest) for FlashAttention's varlen kernels: each document of each row is one
        sequence of the flattened batch. The longest needs one host sync per batch."""
        B, T = self.ids.shape
        starts = torch.ones_like(self.ids, dtype=torch.bool)
        starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
        first = starts.flatten().nonzero().flatten()
        cu_seqlens = torch.cat([first, first.new_tensor([B * T])]).to(torch.int32)
        return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


class BlockDiffusion(Mask):
    """objective="bd3lm"'s attention over a 2T row, the noisy copy of a sequence (positions [0, T)) then its clean
    copy ([T, 2T)), both at RoPE positions 0..T-1; blocks (T,) numbers the diffusion block of each position,
    in order. A noisy token sees its own noisy block (both ways) and the clean blocks before it; a clean token
    sees the clean blocks up to its own (both ways within it); nothing sees a noisy token from elsewhere.
    BD3-LM's mask (Arriola et al. 2025: block diagonal, offset block causal, block causal); HDP's question is
    one block that no other block precedes, so it sees only itself."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks
        self.positions = torch.arange(blocks.numel(), device=blocks.device).repeat(2)

    def allowed(self, q, kv):
        T = self.blocks.numel()
        q_clean, kv_clean = q >= T, kv >= T
        bq, bkv = self.blocks[q - T * q_clean], self.blocks[kv - T * kv_clean]
        return ((bq == bkv) & ~q_clean & ~kv_clean  # a noisy token: its own noisy block
                | (bkv < bq) & ~q_clean & kv_clean  # and the clean blocks before it
                | (bkv <= bq) & q_clean & kv_clean)  # a clean token: the clean blocks up to its own

    def dense(self):
        """(1, 1, 2T, 2T) bool for SDPA."""
        i = torch.arange(2 * self.blocks.numel(), device=self.blocks.device)
        return self.allowed(i[:, None], i[None, :])[None, None]

    def block(self):
        """FlexAttention's BlockMask: the noisy copy's tiles outside its own block are skipped, not computed."""
        from torch.nn.attention.flex_attention import create_block_mask
        n = 2 * self.blocks.numel()
        return create_block_mask(lambda b, h, q, kv: self.allowed(q, kv), None, None, n, n, device=self.blocks.device)


def sdpa_attention(q, k, v, causal, mask=None):
    """PyTorch's scaled_dot_product_attention, on the kernel it picks (or the one sdpa_kernel pins)."""
    dense, is_causal = None, False
    if mask is not None:
        dense = mask.get("dense")
    elif isinstance(causal, torch.Tensor):
        dense = causal
    elif causal and q.size(2) == k.size(2):
        is_causal = True
    elif causal and q.size(2) > 1:  # SDPA's is_causal aligns top-left: spell bottom-right out (one query needs none)
        dense = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril(k.size(2) - q.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=is_causal,
                                          enable_gqa=k.size(1) != q.size(1))


def pinned_sdpa(kernel, q, k, v, causal, mask=None):
    with sdpa_kernel([kernel]):
        return sdpa_attention(q, k, v, causal, mask)


def flash_sdpa(impl, q, k, v, causal, mask=None):
    """SDPA's flash kernel as implemented by `impl`: None, PyTorch's own (flash); "FA4", FlashAttention 4
    (fa4). torch.nn.attention.activate_flash_attention_impl swaps the CUDA implementation for the whole
    process, so each call puts back the one its backend names: flash and fa4 can both run in one process
    (bench/attention.py, tests/test_gpu.py). A compiled graph calls whichever is active when it runs: the
    eager trial call that resolved the backend set it before anything was traced."""
    if q.is_cuda and not torch.compiler.is_compiling():
        registry = torch.nn.attention  # before torch 2.10 there is none: PyTorch's own is the only one
        if getattr(registry, "current_flash_attention_impl", lambda: None)() != impl:
            if impl is None:
                registry.restore_flash_attention_impl()
            else:
                registry.activate_flash_attention_impl(impl)
    return pinned_sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal, mask)


# name: (module, what it is, how to get it)
FLASH_PACKAGES = {
    "fa3": ("flash_attn_interface", "FlashAttention 3",
            "build it from flash-attention's hopper/ folder: cd hopper && python setup.py install"),
    "fa2": ("flash_attn", "FlashAttention 2", "pip install flash-attn --no-build-isolation"),
}


def flash_attention(name, q, k, v, causal, mask=None):
    """FlashAttention 2 or 3: (B, T, heads, head_dim) layout, GQA native, causal aligned bottom-right;
    documents through the varlen kernel, each document its own sequence."""
    if isinstance(causal, torch.Tensor):
        raise ValueError(f"attn_backend={name} takes causal=True or False, not a mask tensor: use an SDPA backend")
    module = importlib.import_module(FLASH_PACKAGES[name][0])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if mask is None:
        out = module.flash_attn_func(q, k, v, causal=causal)
    else:
        B, T = q.shape[:2]
        cu_seqlens, longest = mask.get("varlen")
        out = module.flash_attn_varlen_func(q.reshape(B * T, *q.shape[2:]), k.reshape(B * T, *k.shape[2:]),
                                            v.reshape(B * T, *v.shape[2:]), cu_seqlens_q=cu_seqlens,
                                            cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
                                            causal=True)
    out = out[0] if isinstance(out, tuple) else out  # some releases also return the log-sum-exp
    return out.view(q.shape[:2] + out.shape[-2:]).transpose(1, 2)


@lru_cache(maxsize=16)
def causal_block_mask(q_len, kv_len, device):
    from torch.nn.attention.flex_attention import create_block_mask
    offset = kv_len - q_len

    def causal(b, h, q, kv):
        return q + offset >= kv

    return create_block_mask(causal, None, None, q_len, kv_len, device=device)


@lru_cache(maxsize=1)
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def flex_attention(q, k, v, causal, mask=None):
    """FlexAttention with a block mask. Uncompiled it computes the whole score matrix, so on CUDA
    the training shapes (as many queries as keys) run compiled; the KV cache's changing shapes
    would each compile anew, so they run eagerly (one query row at a time is cheap)."""
    from torch.nn.attention.flex_attention import flex_attention as eager
    if isinstance(causal, torch.Tensor):
        raise ValueError("attn_backend=flex takes causal=True or False, not a mask tensor: use an SDPA backend")
    block_mask = None
    if mask is not None:
        block_mask = mask.get("block")
    elif causal and q.size(2) > 1:  # one query (the KV cache's next token) sees every key
        block_mask = causal_block_mask(q.size(2), k.size(2), q.device)
    if q.is_cuda and q.size(2) == k.size(2):
        return compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))
    # eager on purpose: torch's warning about it (slow, and "may produce incorrect results", which concerns only its
    # debug mode) would alarm every sampler run; the sampler's logits equal the math kernel's (tests/test_diffusion.py)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return eager(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))


ATTENTION_KERNELS = {
    "fa3": partial(flash_attention, "fa3"),
    "fa2": partial(flash_attention, "fa2"),
    "fa4": partial(flash_sdpa, "FA4"),
    "cudnn": partial(pinned_sdpa, SDPBackend.CUDNN_ATTENTION),
    "flash": partial(flash_sdpa, None),
    "efficient": partial(pinned_sdpa, SDPBackend.EFFICIENT_ATTENTION),
    "flex": flex_attention,
    "math": partial(pinned_sdpa, SDPBackend.MATH),
    "sdpa": sdpa_attention,
}
# the backends that can take each kind of mask, and the form each takes; SDPA's flash kernel takes no mask on
# CUDA, and cudnn's support of one varies with the torch release. bd3lm's mask has no varlen form: its blocks
# see other blocks
Documents.FORMS = {"fa3": "varlen", "fa2": "varlen", "flex": "block", "efficient": "dense", "math": "dense",
                   "sdpa": "dense"}
BlockDiffusion.FORMS = {"flex": "block", "efficient": "dense", "math": "dense", "sdpa": "dense"}
MASKS = {"documents": Documents, "diffusion": BlockDiffusion}  # the kinds resolve_backend's `mask` names
# largest error over largest value against float64, per compute dtype: a right kernel is well inside
# (measured on CPU: 1.2e-2 in bf16, 1.4e-3 in fp16, 1e-6 in fp32), a wrong one (scale, mask, GQA) is off by ~1
PARITY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def parity_tolerance(dtype, device):
    """PARITY_TOLERANCE of dtype; float32 on a GPU whose fp32 matmuls run in TF32 (matmul_precision high or
    medium) gets float16's: TF32 keeps float16's 10-bit mantissa (an H200 measured math at 8.0e-4 and flex at
    2.3e-3 there, over float32's 1e-4, so that auto found no kernel at all)."""
    if dtype == torch.float32 and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return PARITY_TOLERANCE[torch.float16]
    return PARITY_TOLERANCE.get(dtype, 1e-4)


def reference_attention(q, k, v, mask=None):
    """Causal attention (or as a Mask says) in float64, written out: the yardstick. Who sees whom is derived
    here from the mask's own data (document ids, blocks), not taken from the forms the kernels get."""
    rep = q.size(1) // k.size(1)
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    T = q.size(2)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if isinstance(mask, Documents):
        allowed = allowed & (mask.ids[:, None, :, None] == mask.ids[:, None, None, :])
    elif isinstance(mask, BlockDiffusion):  # [noisy copy, clean copy]: block of each position, and which copy
        block, clean = mask.blocks.repeat(2), torch.arange(T, device=q.device) >= T // 2
        earlier, same = block[None, :] < block[:, None], block[None, :] == block[:, None]
        allowed = torch.where(clean[:, None], clean[None, :] & (earlier | same),
                              ~clean[None, :] & same | clean[None, :] & earlier)
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def example_mask(kind, T, device):
    """A Mask of `kind` (MASKS) over two rows of T positions, for parity checks and trial calls: three documents
    in one row and one in the other; or T/2 positions in blocks of 4 (T >= 16) or 16 (T >= 128), both copies."""
    if kind == "documents":
        doc_ids = torch.zeros(2, T, dtype=torch.long, device=device)
        doc_ids[0, T // 3:] += 1
        doc_ids[0, T // 2 + 5:] += 1
        return Documents(doc_ids)
    return BlockDiffusion(torch.arange(T // 2, device=device) // (16 if T >= 128 else 4))


def parity_errors(name, device, dtype, head_dim, mask=None, n_head=4, n_kv_head=2, T=None):
    """Largest error of a kernel's output and of its q/k/v gradients ({output, dq, dk, dv}) against
    reference_attention, relative to the largest value, on random inputs of n_head query and n_kv_head
    key/value heads (rounded to dtype first, so only the kernel's error counts), causal or under an
    example_mask of kind `mask`. T None: 256 on a GPU (past FlexAttention's and FlashAttention's 128-row
    tiles), 64 on a CPU. sanity.py checks every backend with these at the run's head layout."""
    device = torch.device(device)
    T = T or (256 if device.type == "cuda" else 64)
    g = torch.Generator().manual_seed(0)
    shapes = [(2, n_head, T, head_dim), (2, n_kv_head, T, head_dim), (2, n_kv_head, T, head_dim),
              (2, n_head, T, head_dim)]
    q, k, v, grad = (torch.randn(s, generator=g, dtype=torch.float64).to(device, dtype) for s in shapes)
    example = None if mask is None else example_mask(mask, T, device)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    reference_attention(*ref_in, example).backward(grad.double())
    test_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ATTENTION_KERNELS[name](*test_in, True, example)
    out.backward(grad)
    with torch.no_grad():
        ref = reference_attention(*ref_in, example)
        pairs = [(out, ref)] + [(t.grad, r.grad) for t, r in zip(test_in, ref_in, strict=True)]
        return {part: ((a.double() - b).abs().max() / b.abs().max()).nan_to_num(math.inf).item()
                for part, (a, b) in zip(("output", "dq", "dk", "dv"), pairs, strict=True)}


def parity_error(name, device, dtype, head_dim, mask=None):
    """The largest of parity_errors at the default shapes: what auto holds against PARITY_TOLERANCE."""
    return max(parity_errors(name, device, dtype, head_dim, mask).values())


def fa4_unavailable(device, dtype, head_dim):
    """Why fa4 cannot run here, or None: PyTorch 2.10+ routes SDPA's flash kernel to flash_attn.cute (the
    flash-attn-4 package: CuTe DSL kernels, compiled at first use) on Hopper and Blackwell GPUs."""
    label, install = "FlashAttention 4", "pip install --pre flash-attn-4"
    if "FA4" not in getattr(torch.nn.attention, "list_flash_attention_impls", list)():
        return (f"{label} runs through SDPA from torch 2.10 on (torch.nn.attention.activate_flash_attention_impl); "
                f"this is torch {torch.__version__}: upgrade torch, or use fa3, fa2 or flash")
    if importlib.util.find_spec("flash_attn") is None:
        return f"flash_attn.cute is not installed ({label}): {install}"
    if device.type != "cuda":
        return f"{label} is CUDA only; this is {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{label} computes in bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):  # the GPUs PyTorch's FA4 route accepts
        return (f"{label} runs on Hopper (compute capability 9.0) and Blackwell (10.x); this GPU is {major}.{minor}: "
                f"use fa2 or flash")
    if head_dim % 8 or head_dim > 256 or (major == 10 and 128 < head_dim < 256):
        return (f"{label} takes a head_dim that is a multiple of 8 up to 256 (Blackwell: up to 128, or 256), "
                f"not {head_dim}")
    try:  # flash_attn may be FlashAttention 2 alone, without the cute kernels
        importlib.import_module("flash_attn.cute.interface")
    except ImportError as e:
        return f"flash_attn.cute does not import ({first_line(e)}): {install}"
    return None


def backend_unavailable(name, device, dtype, head_dim, mask=None):
    """None when attention backend `name` can train here (device, dtype, head_dim, under a mask of kind `mask`:
    None, or one of MASKS), else one line saying why not and what would make it run."""
    device = torch.device(device)
    if name not in ATTENTION_KERNELS:
        return f"unknown attention backend {name!r}: choose auto or one of {', '.join(ATTENTION_KERNELS)}"
    if mask == "documents" and name not in Documents.FORMS:
        return f"{name} cannot mask documents (doc_mask=True); {', '.join(Documents.FORMS)} can"
    if mask == "diffusion" and name not in BlockDiffusion.FORMS:
        return f"{name} cannot take bd3lm's block-diffusion mask; {', '.join(BlockDiffusion.FORMS)} can"
    if name in FLASH_PACKAGES:
        module, label, install = FLASH_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({label}): {install}"
        if device.type != "cuda":
            return f"{label} is CUDA only; this is {device.type}"
        if dtype not in (torch.bfloat16, torch.float16):
            return f"{label} computes in bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
        if head_dim % 8 or head_dim > 256:
            return f"{label} takes a head_dim that is a multiple of 8 up to 256, not {head_dim}"
        major, minor = torch.cuda.get_device_capability(device)
        if name == "fa3" and major != 9:
            return f"{label} is built for Hopper, compute capability 9.0; this GPU is {major}.{minor}: use fa2"
        if name == "fa2" and major < 8:
            return f"{label} needs compute capability 8.0 (Ampere) or newer; this GPU is {major}.{minor}"
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            return f"{module} is installed but does not import ({first_line(e)}): reinstall it for this torch"
        if not hasattr(imported, "flash_attn_func"):  # flash-attn-4 alone installs flash_attn/cute/, nothing above
            return f"{module} has no flash_attn_func (flash-attn-4 alone installs only flash_attn.cute): {install}"
    elif name == "fa4":
        why = fa4_unavailable(device, dtype, head_dim)
        if why:
            return why
    elif name == "flex":
        if device.type != "cuda":
            return "FlexAttention has no backward pass on CPU: it trains on CUDA only"
        if importlib.util.find_spec("triton") is None:
            return "FlexAttention compiles Triton kernels and triton is not installed: pip install triton"
        return None  # a trial call would compile kernels for its shapes: the parity check (auto) or sanity.py runs it
    elif name in ("cudnn", "efficient") and device.type != "cuda":
        return f"the {name} kernel is CUDA only; this is {device.type}"
    elif name in ("math", "sdpa"):
        return None  # PyTorch's math kernel runs everywhere
    return trial_call(name, device, dtype, head_dim, mask)


def trial_call(name, device, dtype, head_dim, mask):
    """A tiny causal GQA forward and backward (under an example_mask of kind `mask`): None when it runs,
    else why not. SDPA gives its reasons for refusing a kernel in warnings."""
    g = torch.Generator().manual_seed(0)  # not the global RNG: resolving must not change the model's init
    q, kv = (torch.randn(2, h, 16, head_dim, generator=g).to(device, dtype).requires_grad_() for h in (2, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ATTENTION_KERNELS[name](q, kv, kv, True, mask and example_mask(mask, 16, device)).sum().backward()
            return None
        except Exception as e:  # whatever a kernel raises, it cannot train here
            reasons = dict.fromkeys(" ".join(str(w.message).split(" (Triggered internally")[0].split())
                                    for w in caught)
            why = "; ".join(reasons) or first_line(e)
    return f"{name} cannot run {str(dtype).removeprefix('torch.')} with head_dim {head_dim} here: {why[:400]}"


resolved = {}  # (name, device type, dtype, head_dim, mask) -> (backend, note)


def resolve_backend(name, device, dtype, head_dim, mask=None):
    """(backend, note): the kernel attn_backend=name runs here, and one line saying why.

    "auto": the first of ATTENTION_BACKENDS that can run and agrees with float64 (parity_error within
    PARITY_TOLERANCE); the note says which faster ones were skipped and why. A named backend that
    cannot run here is a ValueError that lists the ones that can: never a silent substitute.
    mask: None (causal), or the kind of Mask it will get (MASKS). Cached per (name, device type, dtype,
    head_dim, mask)."""
    if mask not in (None, *MASKS):
        raise ValueError(f"mask={mask!r}: None or one of {', '.join(MASKS)}")
    key = (name, torch.device(device).type, dtype, head_dim, mask)
    if key not in resolved:
        # trial and parity runs are eager work, never part of a compiled graph (disabling compilation at
        # import would import torch._dynamo, a second, into every process)
        resolve = torch.compiler.disable(resolve_uncached) if torch.compiler.is_compiling() else resolve_uncached
        resolved[key] = resolve(*key)
    return resolved[key]


def resolve_uncached(name, device_type, dtype, head_dim, mask):
    # they run forward and backward in their own dtypes, whatever the caller's grad and autocast modes
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device_type, enabled=False):
        return resolve_in_eager(name, torch.device(device_type), dtype, head_dim, mask)


def resolve_in_eager(name, device, dtype, head_dim, mask):
    if name != "auto":
        why = backend_unavailable(name, device, dtype, head_dim, mask)
        if why is None:
            return name, f"{name}: as configured"
        here = [b for b in ATTENTION_KERNELS if b != name and not backend_unavailable(b, device, dtype, head_dim,
                                                                                       mask)]
        raise ValueError(f"attn_backend={name} cannot run here: {why}. Available here "
                         f"({device.type}, {str(dtype).removeprefix('torch.')}, head_dim {head_dim}"
                         f"{dict(documents=', doc_mask', diffusion=', bd3lm mask').get(mask, '')}): "
                         f"{', '.join(here) or 'none'}")
    skipped = []
    tol = parity_tolerance(dtype, device)
    # bd3lm's mask leaves most tiles of its 2T x 2T scores empty, and only FlexAttention skips them
    for candidate in sorted(ATTENTION_BACKENDS, key=lambda b: mask == "diffusion" and b != "flex"):
        why = backend_unavailable(candidate, device, dtype, head_dim, mask)
        if why is None:
            try:
                err = parity_error(candidate, device, dtype, head_dim, mask)
                why = None if err <= tol else f"largest error {err:.1e} against float64, over {tol:g}"
            except Exception as e:  # a kernel that fails its first real call is skipped, saying how
                why = f"failed its parity check: {first_line(e)}"
        if why is None:
            return candidate, (f"auto: {candidate} (largest error {err:.1e} against float64)"
                               + "".join(f"; skipped {s}" for s in skipped))
        skipped.append(f"{candidate} ({why})")
    raise ValueError("attn_backend=auto: no attention backend runs here: " + "; ".join(skipped))


def attention(backend, q, k, v, causal, mask=None):
    """Attention of q (B, Hq, T, D) over k, v (B, Hkv, T', D) on `backend` (an attn_backend value).
    causal: True, False, or a bool mask tensor (see above). mask: None, a Mask, or a (B, T) tensor of each
    token's document (made into Documents: attention is then causal and within documents).
    The first call for a (backend, device, dtype, head_dim, kind of mask) resolves it, which runs a backward
    of its own: call resolve_backend first where that cannot be (under torch.utils.checkpoint)."""
    if isinstance(mask, torch.Tensor):
        mask = Documents(mask)
    if isinstance(mask, Documents) and causal is not True:
        raise ValueError("doc_ids makes attention causal within each document: pass causal=True")
    kind = next((k for k, cls in MASKS.items() if isinstance(mask, cls)), None)
    name = resolve_backend(backend, q.device, q.dtype, q.size(-1), kind)[0]
    return ATTENTION_KERNELS[name](q, k, v, causal, mask)


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
    """Keys and values of every block application (a layer's, or one of refine's) for positions [0, pos),
    preallocated up to max_len. Each application has its own slot: refine applies a block to other inputs each
    time, so each keeps its own keys and values."""

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


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * hd, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(config.n_head * hd, config.n_embd, bias=False)
        # RoPE tables: derived, not learned, so not in checkpoints; float32 whatever the compute dtype. Each
        # layer holds its own rather than taking them as inputs: FSDP2 casts a block's float inputs to the
        # compute dtype, and torch 2.11-2.12 skip that cast when activation checkpointing recomputes it.
        cos, sin = rope_tables(hd, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x, cache=None, mask=None, slot=None):
        """mask: None (causal), False (none: bd3lm's sampler, whose block sees itself and every cached key), or a
        Mask (Block.forward says more)."""
        B, T, _ = x.shape
        hd = self.config.head_dim
        start = cache.pos if cache is not None else 0
        # bd3lm's 2T rows hold two copies of positions 0..T-1
        at = mask.positions if isinstance(mask, BlockDiffusion) else slice(start, start + T)
        cos, sin = self.rope_cos[at], self.rope_sin[at]
        q = self.q_proj(x).view(B, T, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # the new queries come after the cached keys: causal=True aligns them bottom-right
            k, v = cache.update(slot, k, v)
        y = attention(self.config.attn_backend, q, k, v, mask is not False, mask or None)
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
    def __init__(self, config):
        super().__init__()
        self.grad_ckpt = config.grad_ckpt
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, mask=None, slot=None, context=None):
        # Activation checkpointing happens inside the block's own forward, so that hooks on the block (FSDP2's
        # all-gather and input cast) run once, outside the recomputed region: checkpoint, then shard, the
        # order torchtitan wraps in. (torch.compile takes context_fn only spelled out like this.)
        if torch.is_grad_enabled() and cache is None and self.grad_ckpt == "full":  # keeps only its inputs
            return checkpoint(self.body, x, None, mask, None, context, use_reentrant=False)
        if torch.is_grad_enabled() and cache is None and self.grad_ckpt == "selective":
            return checkpoint(self.body, x, None, mask, None, context, use_reentrant=False,
                              context_fn=selective_checkpointing)
        return self.body(x, cache, mask, slot, context)

    def body(self, x, cache, mask, slot, context):
        """x plus the block's two residual branches. mask: who sees whom in attention, None for causal (Attention
        says more). context (refine): the branches read x + context and add to x alone. slot: this application's
        KV-cache entry."""
        h = x if context is None else x + context
        x = x + self.self_attn(self.input_layernorm(h), cache, mask, slot)
        h = x if context is None else x + context
        return x + self.mlp(self.post_attention_layernorm(h))


# selective checkpointing keeps what is costly to recompute, the outputs of the matmuls and of the
# attention kernels (with their log-sum-exp), and recomputes the cheap rest in the backward: norms,
# RoPE, SiLU, the residual adds and autocast's casts. (Kernels that are no torch op, like FlashAttention
# releases before its custom ops, are recomputed: right, only slower.) fp8's matmuls are aten::_scaled_mm.
SAVED_OPS = {"aten::mm", "aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention", "flex_attention", "flash_attn::_flash_attn_forward",
             "flash_attn::_flash_attn_varlen_forward", "flash_attn_3::_flash_attn_forward"}


def selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op.name() in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


selective_checkpointing = partial(create_selective_checkpoint_contexts, selective_policy)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.padded_vocab, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
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
        """(logits (B, T, padded_vocab), None) without targets; with them (logits, mean cross-entropy),
        or (None, mean cross-entropy) when loss_chunk > 0: the chunked loss never holds all the logits.
        objective="refine" adds a third item, each supervision step's cross-entropy (GPT.refine).
        objective="bd3lm": with targets, the noise draws (GPT.diffuse), (None, the NELBO per token); without,
        idx is the next block after the cache's, whole (GPT.denoise), and the cache keeps it."""
        config = self.config
        T = idx.size(1)
        start = cache.pos if cache is not None else 0
        if start + T > config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={config.block_size}")
        if config.objective == "bd3lm":
            out = self.diffuse(idx, targets) if targets is not None else (self.denoise(idx, cache), None)
            if cache is not None:
                cache.pos += T
            return out
        x = self.embed_tokens(idx)
        # the backend is resolved here, before any block runs under checkpoint (auto's parity check runs a
        # backward of its own), as the blocks will ask: in the compute dtype, with documents or not
        doc_mask = config.doc_mask and cache is None  # the KV cache (generation) reads one document at a time
        mask = None
        if doc_mask:
            mask = Documents(torch.cumsum(idx == config.bos_id, dim=1))
            mask.get(Documents.FORMS[self.backend(x, "documents")])  # made once for all layers, not in a checkpoint
        else:
            self.backend(x, None)
        if config.objective == "refine":
            out = self.refine(x, targets, cache, mask)
        else:
            for i, block in enumerate(self.layers):
                x = block(x, cache, mask, i)
            out = self.head(x, targets)
        if cache is not None:
            cache.pos += T
        return out

    def backend(self, x, mask):
        """The attention backend the blocks will run on x under a mask of kind `mask`, resolved as they will ask:
        in the compute dtype."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return resolve_backend(self.config.attn_backend, x.device, dtype, self.config.head_dim, mask)[0]

    def diffuse(self, x0, draws):
        """objective="bd3lm"'s loss: (None, the NELBO per token) of the clean tokens x0 (B, T). draws (B, 2, T), uniform
        in [0, 1) and made by the loader from each sample's index (data.diffusion_draws: the same whatever the world
        size or a resume): block b's t is drawn from draws[:, 1, b] and token i is masked when draws[:, 0, i] < its
        block's t. One pass over the noisy copy and the clean copy (2T positions) under BlockDiffusion's mask; the
        loss is the cross-entropy of the masked tokens, each x 1/t, over the tokens that can be noised."""
        c = self.config
        B, T = x0.shape
        blocks = c.diffusion_blocks(x0.device)[:T]
        low, high = (c.clip_low, c.clip_high) if self.training and c.noise_schedule == "clipped" else (LOGLINEAR_EPS, 1.0)
        t = low + (high - low) * draws[:, 1].float().gather(1, blocks.expand(B, T))  # each token's block's t
        masked = (draws[:, 0] < t) & (torch.arange(T, device=x0.device) >= c.noised_from)
        x = self.embed_tokens(torch.cat([torch.where(masked, c.mask_id, x0), x0], dim=1))
        mask = BlockDiffusion(blocks)
        mask.get(BlockDiffusion.FORMS[self.backend(x, "diffusion")])  # made once for all layers, not in a checkpoint
        for i, block in enumerate(self.layers):
            x = block(x, None, mask, i)
        _, loss = self.head(x[:, :T], x0, masked / t)
        return None, loss * T / (T - c.noised_from)

    def denoise(self, block, cache=None):
        """objective="bd3lm": logits (B, L, padded_vocab) for a block of L tokens (some [MASK]) after the clean blocks
        in the cache, which it sees whole, as it sees itself: what training's noisy copy sees. Its keys and values
        go into the cache past cache.pos, kept only when forward() runs the finished block again."""
        x = self.embed_tokens(block)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, False, i)
        return self.head(x, None)[0]

    def refine(self, x, targets, cache, mask):
        """objective="refine" (GPTConfig says how the states move): (the last step's logits, as head() returns
        them, the objective refine_objective() makes of the steps' losses, the steps' cross-entropies
        (detached, shape (steps,)); both None without targets). n_sup_train steps in training, n_sup_inference
        in eval mode. Reduces to the plain GPT with one step, n_loops=0 and T_recursion=1."""
        c = self.config
        n_sup = c.n_sup_train if self.training else c.n_sup_inference
        y, z, slot, losses, logits = x, None if c.n_loops == 0 else torch.zeros_like(x), 0, [], None
        for step in range(n_sup):
            for block in self.layers:
                for r in range(c.T_recursion):
                    # TRM's deep recursion: the repetitions before the last move the states without gradients
                    with torch.no_grad() if r < c.T_recursion - 1 else nullcontext():
                        if z is not None:  # n_loops > 0
                            xy = x + y  # what every latent update reads besides z
                            for _ in range(c.n_loops):
                                z = block(z, cache, mask, slot, context=xy)
                                slot += 1
                        y = block(y, cache, mask, slot, context=z)
                        slot += 1
            if targets is not None or step == n_sup - 1:
                logits, loss = self.head(y, targets)
                losses.append(loss)
            if c.detach_threshold <= step < n_sup - 1:  # later steps' losses stop reaching back through this one
                y, z = y.detach(), None if z is None else z.detach()
        if targets is None:
            return logits, None, None
        return (logits, refine_objective(losses, c.supervision_weight_base, c.improvement_reward_scale),
                torch.stack(losses).detach())

    def head(self, x, targets, weights=None):
        """The final norm, the LM head and the loss of forward()'s first two items. weights (bd3lm, the shape of
        targets): each token's cross-entropy is weighed, [MASK] is never a prediction, and the loss is the
        weighted sum over the number of targets."""
        config = self.config
        x = self.norm(x)
        if targets is None:
            return self.lm_head(x), None
        if not config.loss_chunk:
            logits = self.lm_head(x)
            if weights is not None:
                return logits, self.cross_entropy_sum(logits, targets.flatten(), weights.flatten()) / targets.numel()
            return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return None, self.chunked_loss(x.flatten(0, 1), targets.flatten(), None if weights is None else weights.flatten())

    def chunked_loss(self, x, targets, weights=None):
        """The mean (weighted) cross-entropy over loss_chunk tokens at a time. Each chunk runs under checkpoint, so
        the forward keeps none of its logits and the backward rebuilds them one chunk at a time."""
        n = self.config.loss_chunk
        xs, ys = x.split(n), targets.split(n)
        ws = (None,) * len(xs) if weights is None else weights.split(n)
        # a single chunk would be rebuilt while every layer's activations are still held: no saving, only cost
        rebuild = torch.is_grad_enabled() and x.size(0) > n
        total = sum(checkpoint(self.loss_sum, xc, yc, wc, use_reentrant=False) if rebuild else self.loss_sum(xc, yc, wc)
                    for xc, yc, wc in zip(xs, ys, ws, strict=True))
        return total / targets.numel()

    def loss_sum(self, x, targets, weights=None):
        """The summed cross-entropy of the head's logits for x (N, n_embd) against targets (N,)."""
        return self.cross_entropy_sum(self.lm_head(x), targets, weights)

    def cross_entropy_sum(self, logits, targets, weights=None):
        """The summed cross-entropy of logits against targets (N,); weights (bd3lm): each token's weighed, the
        [MASK] id never predicted (BD3-LM's SUBS parameterization: its logit is minus infinity)."""
        logits = logits.float().view(targets.numel(), -1)
        if weights is None:
            return F.cross_entropy(logits, targets, reduction="sum")
        logits = logits.index_fill(-1, torch.tensor([self.config.mask_id], device=logits.device), float("-inf"))
        return (F.cross_entropy(logits, targets, reduction="none") * weights).sum()

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True, generator=None,
                 steps=None, unmask="schedule"):
        """Yields the next token of each row, shape (B,), max_new_tokens times.

        With the cache, the prompt runs once and each new token costs one position.
        When the context would pass block_size the cache restarts from the last
        block_size // 2 tokens (a sliding window, amortised over the next half block).
        objective="bd3lm": block by block (generate_blocks; steps and unmask are its).
        """
        if self.config.objective == "bd3lm":
            yield from self.generate_blocks(idx, max_new_tokens, temperature, top_k, top_p, generator, steps, unmask)
            return
        block = self.config.block_size
        param = next(self.parameters())
        cache, feed = None, idx
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(idx[:, -block:])[0]
            else:
                if cache is None or cache.pos + feed.size(1) > block:
                    feed = idx[:, -(block if cache is None else block // 2):]
                    cache = KVCache(self.config, idx.size(0), block, idx.device, param.dtype)
                logits = self(feed, cache=cache)[0]
            token = sample_next(logits[:, -1, :self.config.vocab_size], temperature, top_k, top_p, generator)
            idx = torch.cat([idx, token[:, None]], dim=1)
            feed = token[:, None]
            yield token

    @torch.no_grad()
    def generate_blocks(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None, steps=None,
                        unmask="schedule"):
        """objective="bd3lm"'s sampler: yields the next token of each row, shape (B,), a block at a time.

        The prompt's whole blocks go into the KV cache a block at a time (a clean block sees itself whole and the
        blocks before it, as in training); the block it ends in is finished around its tokens, which stay. Each
        block starts all-[MASK] and is unmasked in `steps` denoising passes (None: one token per pass, the block's
        length; the KV cache holds the blocks before it, so a pass costs one block's positions), then goes into
        the cache whole and its tokens are yielded. Which masked tokens a pass fills (each with a token drawn from
        the model, at temperature / top_k / top_p): unmask="schedule", BD3-LM's own, t falls from 1 to 0 in `steps`
        even steps and each masked token is filled with probability (t - s) / t at the step from t to s, in random
        order as training masks; "confidence", those whose drawn token is most probable, as many as an even share
        of the passes left asks (a small model's most probable token is often a space: config/tiny_bd3lm.py's
        samples were all whitespace this way).
        HDP: the prompt is the question, padded with BOS to its segment as prepare.py pads it; then come the plan
        and the execution. Ends after max_new_tokens, at block_size (no sliding window: a block's tokens are
        drawn for their positions), or once every row has made BOS, the end of a document (HDP: in the execution,
        as the plan's padding is BOS too)."""
        c = self.config
        if unmask not in UNMASKING:
            raise ValueError(f"unmask={unmask!r}: choose one of {', '.join(UNMASKING)}")
        B, device = idx.size(0), idx.device
        if c.hdp_segments:
            if idx.size(1) > c.segments[0]:
                raise ValueError(f"the question is {idx.size(1)} tokens, longer than its segment "
                                 f"(hdp_segments={c.hdp_segments})")
            idx = F.pad(idx, (0, c.segments[0] - idx.size(1)), value=c.bos_id)
        blocks = c.diffusion_blocks(device)
        bounds = [0, *((blocks[1:] != blocks[:-1]).nonzero().flatten() + 1).tolist(), c.block_size]
        P = idx.size(1)
        end, end_from = min(c.block_size, P + max_new_tokens), sum(c.segments[:2]) if c.hdp_segments else P
        cache = KVCache(c, B, c.block_size, device, next(self.parameters()).dtype)
        ended = torch.zeros(B, dtype=torch.bool, device=device)
        for a, b in zip(bounds, bounds[1:]):
            if a >= end:
                return
            if b <= P:
                self(idx[:, a:b], cache=cache)
                continue
            new = b - max(a, P)
            x = torch.cat([idx[:, a:P], torch.full((B, new), c.mask_id, device=device)], dim=1)
            x = self.unmask(x, cache, steps or new, unmask, temperature, top_k, top_p, generator)
            self(x, cache=cache)
            for i in range(max(a, P), min(b, end)):
                yield x[:, i - a]
                ended |= (x[:, i - a] == c.bos_id) & (i >= end_from)
                if ended.all():
                    return

    def unmask(self, x, cache, steps, how, temperature, top_k, top_p, generator):
        """generate_blocks' denoising of one block x (B, L), [MASK] where still open, after the cache's blocks."""
        c = self.config
        for step in range(steps):
            masked = x == c.mask_id
            if not masked.any():
                break
            logits = self.denoise(x, cache)[..., :c.mask_id]  # never [MASK], never a padded id
            drawn = sample_next(logits.flatten(0, 1), temperature, top_k, top_p, generator).view_as(x)
            if how == "confidence":
                confidence = logits.float().softmax(-1).gather(-1, drawn[..., None])[..., 0].masked_fill(~masked, -1.0)
                share = (masked.sum(1, keepdim=True) + steps - step - 1) // (steps - step)  # ceil: none left at the end
                fill = masked & (confidence.argsort(1, descending=True).argsort(1) < share)
            else:
                t, s = 1 - step / steps, 1 - (step + 1) / steps
                fill = masked & (torch.rand(x.shape, generator=generator, device=x.device) < (t - s) / t)
            x = torch.where(fill, drawn, x)
        return x


def random_batch(config, rows, device, seq_len=None):
    """(inputs, targets) of random tokens as a training step of config's objective takes them, for the probes that
    time or measure a step (sanity.py's capacity, bench/): the compute does not depend on the tokens. bd3lm's
    targets are its noise draws (data.diffusion_draws)."""
    shape = (rows, seq_len or config.block_size)
    if config.objective == "bd3lm":
        return (torch.randint(0, config.mask_id, shape, device=device),
                torch.rand(rows, 2, shape[1], device=device))
    return tuple(torch.randint(0, config.vocab_size, shape, device=device) for _ in range(2))


def refine_objective(losses, base, reward):
    """Refinement's training objective from the supervision steps' cross-entropies (0-d tensors, first to
    last): step i weighs base^i / sum_j base^j, so the last steps count most; from the second step on,
    reward * (prev - cur) / prev is subtracted, prev detached, so a step gains from improving on the one
    before it, and the one before is not pushed to be worse. One step: its loss, unchanged."""
    weights = [base ** i for i in range(len(losses))]
    objective = sum(w / sum(weights) * loss for w, loss in zip(weights, losses, strict=True))
    for prev, cur in zip(losses, losses[1:]):
        objective = objective - reward * (prev.detach() - cur) / prev.detach()
    return objective


class MuonAdamW:
    """optimizer=muon's two optimizers stepped as one, as train.py's loop, GradScaler and checkpoint.py use an
    optimizer: param_groups (Muon's, then AdamW's, each with its peak_lr), step, zero_grad, and a state_dict
    holding both. A resume keeps this run's peaks, as it keeps learning_rate (train.py sets every lr from the
    config), and takes the rest from the checkpoint as torch's load_state_dict does: momentum buffers, moments,
    step counts, betas, momentum."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw
        self.peaks = [g["peak_lr"] for g in self.param_groups]

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return dict(muon=self.muon.state_dict(), adamw=self.adamw.state_dict())

    def load_state_dict(self, state):
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        for g, peak in zip(self.param_groups, self.peaks, strict=True):
            g["peak_lr"] = peak


def make_optimizer(model, learning_rate, betas, weight_decay, fused, kind="adamw", matrix_lr=0.02, embedding_lr=4e-3,
                   momentum=0.95):
    """AdamW over the model's parameters, decaying matrices only: norms (1-D) and the embedding table
    (sparse rows, tied head) are left alone. fused: one kernel per step (CUDA).

    kind="muon", nanochat's split: torch.optim.Muon (Nesterov, `momentum`) for the blocks' matrices at peak
    matrix_lr, and that AdamW for the rest (embedding, untied head, norms) at peak embedding_lr: a MuonAdamW,
    whose groups carry their peak_lr for train.py's schedule (the defaults are train.py's). Under ddp every
    rank orthogonalizes every matrix, the same all-reduced gradients into the same update."""
    matrices, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if kind == "muon" and name.startswith("layers.") and p.dim() == 2:
            matrices.append(p)
        else:
            (no_decay if p.dim() < 2 or name.startswith("embed_tokens") else decay).append(p)
    if kind == "adamw":
        groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)
    # no weight decay on Muon's matrices, as in nanochat's Muon setup and Keller Jordan's: torch's Muon would decay
    # by lr x weight_decay per step, at 0.02 some 70x what AdamW's decay does at 3e-4 with the same weight_decay
    muon = torch.optim.Muon([dict(params=matrices, peak_lr=matrix_lr)], lr=matrix_lr, momentum=momentum,
                            weight_decay=0.0)
    groups = [dict(params=decay, weight_decay=weight_decay, peak_lr=embedding_lr),
              dict(params=no_decay, weight_decay=0.0, peak_lr=embedding_lr)]
    return MuonAdamW(muon, torch.optim.AdamW(groups, lr=embedding_lr, betas=betas, fused=fused))


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
    parameters including the LM head but not the input embedding lookup. refine counts every block
    application (and the final norm and head once per supervision step); the ones without gradients
    (T_recursion's earlier repetitions) at a forward's third: 2*N + 4*H*Q*T. bd3lm runs the blocks over
    2T positions (config.stream) per T tokens, each attending over 2T, and the head over the T noisy ones."""
    L, d, stream = config.n_layer, config.n_embd, config.stream
    T = (seq_len or config.block_size) * stream
    n_sup, with_grad, without = config.applications()
    layer = (param_counts(config)["non_embedding"] - d) // L  # a block's parameters
    attention = config.n_head * config.head_dim * T
    return (6 * (L * with_grad * n_sup * stream * layer + n_sup * (d + config.padded_vocab * d))
            + 12 * L * with_grad * n_sup * stream * attention + L * without * n_sup * (2 * layer + 4 * attention))


def memory_estimate(config, micro_batch_size, world_size=1, sharded=False, activation_checkpointing=None,
                    compute_bytes=2):
    """Bytes per GPU at the peak of one training step, by part. compute_bytes: 2 under bf16/fp16 autocast, 4
    in fp32. activation_checkpointing: "none" | "full" | "selective" (True is "full", False "none"; None:
    config.grad_ckpt). The parts are what is held at that moment, so they add up to the total.

    Always held: weights (fp32, 4 bytes/param), AdamW's two fp32 moments (8), DDP's fp32 gradient buckets (4,
    world_size > 1). sharded (FSDP): weights, gradients and moments divided over world_size, plus two layers
    gathered at a time. The rest peaks at one of three moments of the step (memory_phases), whichever is
    largest: the end of the forward (every weight's compute-dtype cast, which autocast caches until the
    forward ends; what the forward keeps for the backward; one loss chunk's fp32 logits and log-softmax);
    the loss's backward (the same, minus the casts checkpointed layers do not keep, plus the fp32 logit
    gradients and the head's weight gradient); or the end of the backward (every gradient, and the first
    layer's activations and weight casts).

    Activations kept per token, as model.py saves them on CPU (tests/test_model.py measures each case).
    With c = compute_bytes, d = n_embd, dkv = n_kv_head * head_dim, f = ffn_hidden: a layer keeps 16*d of
    fp32 (its output, the residual between attention and MLP, each RMSNorm's x * rsqrt), c*(4*d + 2*dkv +
    4*f) (the two norm outputs; q, k, v; the attention output; SwiGLU's four hidden-wide tensors),
    4*n_head of attention log-sum-exp and 8 of norm scales; outside the layers 8*d + c*d + 4 (the
    embedding, the final norm). full checkpointing: a layer keeps only its 4*d output, and the backward
    rebuilds one layer at a time; selective: a layer keeps its output and what its matmuls and attention
    return, 4*d + c*(4*d + 2*dkv + 2*f) + 4*n_head, and one layer at a time rebuilds the rest.

    Calibrated against peaks measured on an H100 (bench/results/memory.jsonl; tests/test_model.py holds
    every row): 1B, 50M and d64-width shapes, each layout, within -1%..+5%. What remains: the kept
    activations are counted as model.py saves them on a CPU, and CUDA's fused kernels keep a little less
    (the 1B's measured activations grow 3.5% slower per sequence than counted); cuBLAS workspaces, the
    allocator's rounding and short-lived temporaries (gradient clipping's norms) are not counted.
    """
    phases = memory_phases(config, micro_batch_size, world_size, sharded, activation_checkpointing, compute_bytes)
    peak = max(phases.values(), key=lambda parts: parts["total"])
    return dict(params=param_counts(config)["total"], **peak)


def memory_phases(config, micro_batch_size, world_size=1, sharded=False, activation_checkpointing=None,
                  compute_bytes=2):
    """{moment: {part: bytes, "total": their sum}} for the three moments where a training step can peak:
    forward_end, loss_backward and backward_end (memory_estimate's docstring says what each holds)."""
    mode = {None: config.grad_ckpt, True: "full", False: "none"}.get(activation_checkpointing, activation_checkpointing)
    if mode not in GRAD_CKPT:
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r}: one of {', '.join(GRAD_CKPT)}")
    counts = param_counts(config)
    n, head = counts["total"], config.padded_vocab * config.n_embd
    tokens = micro_batch_size * config.block_size
    L, d, dkv, f, c = config.n_layer, config.n_embd, config.n_kv_head * config.head_dim, config.ffn_hidden, compute_bytes
    layer_params = counts["non_embedding"] // L
    shard = world_size if sharded else 1
    gathered = 2 * layer_params if sharded else 0  # FSDP2 gathers a layer while prefetching the next
    layer = 16 * d + c * (4 * d + 2 * dkv + 4 * f) + 4 * config.n_head + 8  # all a layer keeps without checkpointing
    # per token: what a layer keeps for the backward, and what the backward rebuilds of it
    kept_layer, rebuilt = {"none": (layer, 0), "full": (4 * d, layer - 4 * d),
                           "selective": (4 * d + c * (4 * d + 2 * dkv + 2 * f) + 4 * config.n_head,
                                         12 * d + c * (3 * d + dkv + 2 * f) + 8)}[mode]
    outside = 8 * d + c * d + 4  # the embedding's output, the final norm's
    logit_rows = min(tokens, config.loss_chunk) if config.loss_chunk else tokens
    # refine: every application with gradients keeps what a layer keeps, and each step its final norm's share;
    # under checkpointing a layer's latent updates also keep the x + y they read, and rebuild the sums the
    # norms read. An unchunked loss keeps each earlier step's log-softmax (4 bytes per logit)
    n_sup, per_layer, _ = config.applications()
    sums = 4 * d if config.objective == "refine" and config.n_loops and mode != "none" else 0
    # bd3lm: the blocks and the embedding run on the noisy and the clean copy (config.stream), the final norm on one
    kept = config.stream * L * n_sup * (per_layer * kept_layer + sums) + n_sup * outside + (config.stream - 1) * 4 * d
    earlier_logits = (n_sup - 1) * logit_rows * config.padded_vocab * 4 if logit_rows == tokens else 0
    casts = 0 if c == 4 else c * (n // shard + gathered)  # autocast's compute-dtype copy of every matrix
    held = dict(weights=4 * n // shard + c * gathered, optimizer=8 * n // shard,
                ddp_buckets=4 * n if world_size > 1 and not sharded else 0)  # DDP's all-reduce copy of the gradients
    phases = dict(
        forward_end=dict(held, gradients=0, weight_casts=casts, activations=tokens * kept,
                         logits=logit_rows * config.padded_vocab * 8 + earlier_logits),
        # checkpointed layers did not keep their casts: only the head's, rebuilt with its loss chunk
        loss_backward=dict(held, gradients=4 * head // shard, weight_casts=casts if mode == "none" or c == 4 else
                           c * head // shard, activations=tokens * kept,
                           logits=logit_rows * config.padded_vocab * 12 + earlier_logits),
        backward_end=dict(held, gradients=4 * n // shard + 4 * gathered, weight_casts=0 if c == 4 else c * layer_params,
                          activations=tokens * (config.stream * (kept_layer + rebuilt + 2 * sums + 4 * d) + outside
                                                - 4 * d), logits=0))
    for parts in phases.values():
        parts["total"] = sum(parts.values())
    return phases


# dense bf16 tensor-core peaks from NVIDIA's datasheets (the sparse figures are 2x these)
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("A100", 312e12))


def peak_flops(device_name):
    """Datasheet dense bf16 FLOP/s for a GPU name, or None if unknown (then no MFU rather than a wrong one)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def fp8_unavailable(device, dtype, compiled):
    """None when fp8=True (float8_linears) can train here: on `device`, the rest in `dtype`, under torch.compile
    or not; else one line saying why not and what would make it run."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8=True trains on a CUDA GPU with float8 tensor cores; this is {device.type}: set fp8=False"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"fp8=True needs float8 tensor cores, compute capability 8.9 or newer (H100, H200, L40S, RTX 4090); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}: set fp8=False")
    if dtype != torch.bfloat16:
        return (f"fp8=True computes the rest of the model in bfloat16, not {str(dtype).removeprefix('torch.')}: "
                f"set dtype=bfloat16")
    if not compiled:
        return ("fp8=True needs compile=True: without torch.compile fusing float8's scaling and casts, its matmuls "
                "are slower than bfloat16's")
    if importlib.util.find_spec("torchao") is None:
        return "fp8=True needs torchao (float8 training), which is not installed: pip install torchao"
    try:
        importlib.import_module("torchao.float8")
    except Exception as e:  # a torchao built for another torch fails in its own ways
        return f"torchao is installed but torchao.float8 does not import ({first_line(e)}): pip install -U torchao"
    return None


def float8_linears(model):
    """fp8=True: the model's nn.Linear layers become torchao's Float8Linear (float8 matmuls, dynamic tensorwise
    scales: torchao's default recipe), in place, before FSDP shards them and torch.compile fuses the scaling.
    Their weights stay the same fp32 parameters, so checkpoints, the optimizer and the tied embedding are as
    without fp8. Kept in bf16: lm_head (the embedding's tied twin, and the loss reads its logits) and any layer
    with a dimension that is not a multiple of 16 (float8 matmuls need that). (converted names, kept names)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept = [name for name, m in linears if name == "lm_head" or m.in_features % 16 or m.out_features % 16]
    # enable_fsdp_float8_all_gather stays off: it makes each weight a float8-aware tensor subclass, which
    # checkpoints, export and sample.py would all have to know (and it wants precompute_float8_dynamic_scale_for_fsdp
    # after every step); FSDP gathers bf16 weights, and the matmuls still run in float8
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name not in kept,
                               config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return [name for name, _ in linears if name not in kept], kept


def shard_model(model, dev, compute_dtype):
    """FSDP2 over the process group: each block's parameters gathered just for its own compute, and again
    for its backward (its recompute under grad_ckpt happens inside the block: checkpoint, then shard);
    compute in compute_dtype, gradients reduced in fp32; the root shards the rest (embedding, tied head,
    final norm)."""
    # FSDP2, DTensor and torch.distributed.checkpoint are imported by the runs that shard, not at the top:
    # together they are 0.8-1.0 s of train.py's 2.5-3.3 s import (measured on a 2-core CPU, torch 2.13),
    # which every other run and every script that imports model.py would pay at each start
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp, mesh = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32), device_mesh(dev)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
