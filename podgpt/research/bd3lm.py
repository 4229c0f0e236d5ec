"""
Block diffusion (objective=bd3lm; BD3-LM, Arriola et al. 2025): the sequence is cut into blocks of
diffusion_block tokens, each noised to [MASK] (one id past the data's) at a rate t drawn per block
and denoised from the clean blocks before it. The loss, the NELBO (each masked token's
cross-entropy x 1/t, averaged over the tokens), takes a noisy and a clean copy of each row in one
pass; the model samples a block at a time, the earlier blocks in the KV cache.
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, KVCache, sample_next
from podgpt.core.attention import Mask
from podgpt.core.util import fail

# --- config
diffusion_block = 16            # bd3lm: tokens per diffusion block (denoised at once, in order)
noise_schedule = "loglinear"    # bd3lm: loglinear (t ~ U[1e-3, 1]) | clipped (training: U[clip_*])
clip_low = 0.3                  # bd3lm, clipped: lowest mask rate drawn in training (BD3-LM's beta)
clip_high = 0.8                 # bd3lm, clipped: highest (BD3-LM's omega); validation: loglinear
hdp_segments = ""               # bd3lm: "128,128,256": HDP (question, plan, execution); "": plain
batch_preset = ""               # bd3lm: conservative | recommended | aggressive | extreme; "": none
# --- end config

# what each batch preset fills unless set (configurator.apply_presets): the recipe's micro-batch,
# its global batch (accumulation 4 on one GPU), its LR for that batch (768: none given, so its rule
# lr_base x sqrt(batch / lr_base_batch), 3e-4 x sqrt(6)), and that rule for preflight's lr_scaling
PRESETS = {"batch_preset": {
    "conservative": {"micro_batch_size": 64, "total_batch_tokens": (256, "block_size"),
                     "learning_rate": 4e-4, "lr_base": 3e-4, "lr_base_batch": 128},
    "recommended": {"micro_batch_size": 128, "total_batch_tokens": (512, "block_size"),
                    "learning_rate": 5e-4, "lr_base": 3e-4, "lr_base_batch": 128},
    "aggressive": {"micro_batch_size": 192, "total_batch_tokens": (768, "block_size"),
                   "learning_rate": 7.3e-4, "lr_base": 3e-4, "lr_base_batch": 128},
    "extreme": {"micro_batch_size": 256, "total_batch_tokens": (1024, "block_size"),
                "learning_rate": 7e-4, "lr_base": 3e-4, "lr_base_batch": 128}}}

NOISE_SCHEDULES = ("loglinear", "clipped")
UNMASKING = ("schedule", "confidence")  # how generate picks the tokens a denoising pass fills
LOGLINEAR_EPS = 1e-3  # loglinear's t ~ U[eps, 1] (BD3-LM's sampling_eps_min): 1/t stays finite


def diffusion_draws(seed, keys, block_size):
    """The noise, (len(keys), 2, block_size) float32 in [0, 1): row j from a generator of (seed,
    keys[j]) alone, the same whatever the world size or resume ([:, 0] masks, [:, 1] draws t)."""
    rows = [np.random.default_rng([*seed, int(k)]).random((2, block_size), dtype=np.float32)
            for k in keys]
    return np.stack(rows)


@dataclass
class Config(GPTConfig):
    """GPTConfig and the keys above. HDP: the question is never noised and sees only itself; plan
    and execution are diffused in blocks, the plan seeing the question, the execution both."""
    objective: str = "bd3lm"
    diffusion_block: int = diffusion_block
    noise_schedule: str = noise_schedule
    clip_low: float = clip_low      # a lower-variance, biased training loss; validation
    clip_high: float = clip_high    # draws t from loglinear's range, so val_loss is the NELBO
    hdp_segments: str = hdp_segments
    added_tokens = 1                # [MASK]
    own_mask = "diffusion"          # BlockDiffusion
    draws = staticmethod(diffusion_draws)  # the loader's: each sample's noise (data.Loader)

    def __post_init__(self):
        super().__post_init__()
        if self.noise_schedule not in NOISE_SCHEDULES:
            raise ValueError(f"noise_schedule={self.noise_schedule!r}: choose one of "
                             f"{', '.join(NOISE_SCHEDULES)}")
        if self.noise_schedule == "clipped" and not 0 < self.clip_low < self.clip_high <= 1:
            raise ValueError(f"clip_low={self.clip_low}, clip_high={self.clip_high}: need "
                             f"0 < clip_low < clip_high <= 1")
        if self.doc_mask:
            raise ValueError("doc_mask=True is for objective=ar or refine: bd3lm's attention goes "
                             "block by block (hdp_segments keeps a question to itself)")
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
            raise ValueError(f"hdp_segments={self.hdp_segments!r}: three positive lengths "
                             f"(question, plan, execution) that sum to "
                             f"block_size={self.block_size}, e.g. \"128,128,256\" for 512")
        return segments

    stream = 2                      # the blocks run on the noisy and the clean copy of each row

    @property
    def mask_id(self):  # [MASK]: the vocabulary's last id
        return self.vocab_size - 1

    @property
    def noised_from(self):  # the first position ever noised (after HDP's question)
        return self.segments[0] if self.hdp_segments else 0

    def diffusion_blocks(self, device=None):
        """The block of every position, (block_size,) int64: HDP's question is block 0 whole."""
        positions = torch.arange(self.block_size, device=device)
        q = self.noised_from
        return torch.where(positions < q, 0, (positions - q) // self.diffusion_block + (q > 0))

    def random_batch(self, rows, device, seq_len=None):
        """(tokens, noise draws) of random tokens (GPTConfig.random_batch)."""
        shape = (rows, seq_len or self.block_size)
        return (torch.randint(0, self.mask_id, shape, device=device),
                torch.rand(rows, 2, shape[1], device=device))

    def check_data(self, data_dir, manifest):
        """Data of fixed-length documents (prepare.py's segments): a row must be one document, and
        HDP's segments the data's."""
        segments = manifest.get("prepare_args", {}).get("segments", "")
        if not (segments or self.hdp_segments):
            return
        if self.hdp_segments and self.hdp_segments != segments:
            fail(f"hdp_segments={self.hdp_segments} but {data_dir} was prepared with "
                 f"segments={segments or 'none'}: prepare it with --gsm8k_format=hdp "
                 f"--segments={self.hdp_segments}, or set hdp_segments to match")
        if sum(int(n) for n in segments.split(",")) != self.block_size:
            fail(f"block_size={self.block_size} but every document of {data_dir} is "
                 f"{segments.replace(',', '+')} tokens: set block_size to their sum, so that "
                 f"each row is one document")


class BlockDiffusion(Mask):
    """bd3lm's attention over a 2T row, a sequence's noisy copy ([0, T)) then its clean copy ([T,
    2T)), both at RoPE positions 0..T-1; blocks (T,) numbers each position's diffusion block.
    BD3-LM's block diagonal, offset block causal and block causal (below); HDP's question is one
    block that no block precedes, so it sees only itself."""
    kind, label, flex_first = "diffusion", ", bd3lm mask", True
    refusal = "take bd3lm's block-diffusion mask"
    FORMS = {"flex": "block", "efficient": "dense", "math": "dense", "sdpa": "dense"}  # no varlen

    def __init__(self, blocks):
        super().__init__(None, 2 * blocks.numel(), blocks.device)
        self.blocks = blocks
        self.positions = torch.arange(blocks.numel(), device=blocks.device).repeat(2)

    def allowed(self, q, kv, b=None):
        T = self.blocks.numel()
        q_clean, kv_clean = q >= T, kv >= T
        bq, bkv = self.blocks[q - T * q_clean], self.blocks[kv - T * kv_clean]
        return ((bq == bkv) & ~q_clean & ~kv_clean  # a noisy token: its own noisy block
                | (bkv < bq) & ~q_clean & kv_clean  # and the clean blocks before it
                | (bkv <= bq) & q_clean & kv_clean)  # a clean token: the clean blocks up to its own

    @classmethod
    def example(cls, T, device):
        """T/2 positions in blocks of 4 (T >= 16) or 16 (T >= 128), both copies."""
        return cls(torch.arange(T // 2, device=device) // (16 if T >= 128 else 4))


class BlockDiffusionLM(GPT):
    """The model (the module's docstring)."""

    def forward(self, idx, targets=None, cache=None):
        """With targets, the noise draws: (None, the NELBO per token); without, idx is the next
        block after the cache's, whole: (its logits, None), and the cache keeps it."""
        T = self.check_length(idx, cache)
        out = (self.denoise(idx, cache), None) if targets is None else self.diffuse(idx, targets)
        if cache is not None:
            cache.pos += T
        return out

    def diffuse(self, x0, draws):
        """(None, the NELBO per token) of the clean tokens x0 (B, T). Block b's t is drawn from
        draws[:, 1, b] and token i is masked when draws[:, 0, i] < its block's t (draws (B, 2, T):
        diffusion_draws). One pass over both copies (2T positions) under BlockDiffusion."""
        c = self.config
        B, T = x0.shape
        blocks = c.diffusion_blocks(x0.device)[:T]
        clipped = self.training and c.noise_schedule == "clipped"
        low, high = (c.clip_low, c.clip_high) if clipped else (LOGLINEAR_EPS, 1.0)
        t = low + (high - low) * draws[:, 1].float().gather(1, blocks.expand(B, T))  # by token
        masked = (draws[:, 0] < t) & (torch.arange(T, device=x0.device) >= c.noised_from)
        x = self.embed_tokens(torch.cat([torch.where(masked, c.mask_id, x0), x0], dim=1))
        x = self.blocks(x, None, self.ready(x, BlockDiffusion(blocks)))
        _, loss = self.head(x[:, :T], x0, masked / t)
        return None, loss * T / (T - c.noised_from)  # over the tokens that can be noised

    def denoise(self, block, cache=None):
        """Logits (B, L, padded_vocab) for a block of L tokens (some [MASK]) that sees the cache's
        clean blocks and itself whole, as training's noisy copy does; its keys and values stay in
        the cache only when forward() runs the finished block."""
        return self.head(self.blocks(self.embed_tokens(block), cache, False), None)[0]

    def never_predicted(self, device):
        """[MASK] (BD3-LM's SUBS parameterization: its logit -inf)."""
        return torch.tensor([self.config.mask_id], device=device)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 generator=None, steps=None, unmask="schedule"):
        """Yields the next token of each row, shape (B,), a block at a time: each block after the
        prompt's starts [MASK] and is unmasked in `steps` passes (None: a token a pass). HDP: the
        prompt is the question, padded with BOS as prepare.py pads it. Ends after max_new_tokens,
        at block_size (no sliding window), or once every row has made BOS (HDP: in the
        execution)."""
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
        end, end_from = min(c.block_size, P + max_new_tokens), sum(c.segments[:2]) or P
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
        """generate's denoising of one block x (B, L), [MASK] where still open: each pass draws
        tokens and fills some. "schedule", BD3-LM's: t falls from 1 to 0 in even steps, each masked
        token filled with probability (t - s) / t; "confidence": the most probable, an even share
        per pass (a small model's most probable token is often a space: all whitespace)."""
        c = self.config
        for step in range(steps):
            masked = x == c.mask_id
            if not masked.any():
                break
            logits = self.denoise(x, cache)[..., :c.mask_id]  # never [MASK], never a padded id
            drawn = sample_next(logits.flatten(0, 1), temperature, top_k, top_p,
                                generator).view_as(x)
            if how == "confidence":
                p = logits.float().softmax(-1).gather(-1, drawn[..., None])[..., 0]
                left = steps - step
                share = (masked.sum(1, keepdim=True) + left - 1) // left  # ceil: none left over
                rank = p.masked_fill(~masked, -1.0).argsort(1, descending=True).argsort(1)
                fill = masked & (rank < share)
            else:
                t, s = 1 - step / steps, 1 - (step + 1) / steps
                draw = torch.rand(x.shape, generator=generator, device=x.device)
                fill = masked & (draw < (t - s) / t)
            x = torch.where(fill, drawn, x)
        return x


Model = BlockDiffusionLM
