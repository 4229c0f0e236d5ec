"""
The objectives beyond next-token prediction: for each, the model that trains on it (a GPT of model.py with its
own forward), its loss, the metrics it reports and its sampler; make_model builds the model a config asks for.

- refine (Refine): deep-supervision refinement, the same weights applied recursively with a loss after each
  pass through the layers; its KV cache has an entry per block application.
- bd3lm (BlockDiffusionLM): block diffusion on GSM8K, BD3-LM's NELBO over a noisy and a clean copy of each row
  in one pass (attention.BlockDiffusion's mask; HDP's question / plan / execution segments), sampled a block at
  a time with the earlier blocks in the KV cache.

A model's forward may return a third item, stats: a 1-D tensor of numbers of the batch, which train.py sums
over micro-batches and ranks as it does the loss. The model then names them: metrics(stats, prefix) for
metrics.jsonl, console(stats) for the console's lines, check_validation(stats, state, cfg) after an evaluation.
"""
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from podgpt.core.attention import BlockDiffusion
from model import GPT, KVCache, sample_next

UNMASKING = ("schedule", "confidence")  # how bd3lm's sampler picks the tokens each denoising pass fills (generate)
LOGLINEAR_EPS = 1e-3  # loglinear's t ~ U[eps, 1] (BD3-LM's sampling_eps_min): 1/t stays finite


# -----------------------------------------------------------------------------
# refine: deep-supervision refinement

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


class Refine(GPT):
    """objective="refine": the same weights, each block applied many times. The embedding x stays; an answer y
    (from x) and a latent z (from zeros) pass through every layer: the layer's block updates z n_loops times
    reading x + y + z, then y once reading y + z (its pre-norms read the sum, its residual adds to the state it
    updates), all of it T_recursion times. One pass through every layer is a supervision step; the head then
    reads y and the step's cross-entropy is taken. Its stats: each step's cross-entropy."""

    def predict(self, x, targets, cache, mask):
        """(the last step's logits, as head() returns them, the loss, the steps' cross-entropies (detached, shape
        (steps,))); the last two None without targets. The loss: in training the objective refine_objective()
        makes of the steps' losses, in eval mode the last step's cross-entropy (validation's loss). n_sup_train
        steps in training, n_sup_inference in eval mode. Reduces to the plain GPT with one step, n_loops=0 and
        T_recursion=1."""
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
                logits, loss = self.head(y, targets, in_graph=True)  # a graph break would leave the loop eager
                losses.append(loss)
            if c.detach_threshold <= step < n_sup - 1:  # later steps' losses stop reaching back through this one
                y, z = y.detach(), None if z is None else z.detach()
        if targets is None:
            return logits, None, None
        steps = torch.stack(losses).detach()
        if not self.training:
            return logits, losses[-1], steps
        return logits, refine_objective(losses, c.supervision_weight_base, c.improvement_reward_scale), steps

    @staticmethod
    def metrics(losses, prefix=""):
        """The losses per supervision step (first to last) as sup_loss_0, sup_loss_1, ... (numbers of their own,
        so metrics.csv, the trackers and the plots take them as they take the rest), and the refinement, the share
        of the first step's loss the last one removes, in percent."""
        return {**{f"{prefix}sup_loss_{i}": v for i, v in enumerate(losses)},
                f"{prefix}refinement": 100 * (losses[0] - losses[-1]) / losses[0]}

    @staticmethod
    def console(losses):
        """metrics() on a console line: " | steps 5.1000 -> 4.9000 -> 4.8000 (5.9% refined)"."""
        refined = Refine.metrics(losses)["refinement"]
        return f" | steps {' -> '.join(f'{v:.4f}' for v in losses)} ({refined:.1f}% refined)"

    @staticmethod
    def check_validation(losses, state, cfg):
        """A later supervision step should never do worse than the one before it on validation: a warning, (event
        name, message, fields), when the order has been broken cfg.refine_order_patience evaluations in a row
        (state.order_broken counts them), and again at each such run of evaluations; else None."""
        inverted = [i for i in range(1, len(losses)) if losses[i] >= losses[i - 1]]
        state.order_broken = state.order_broken + 1 if inverted else 0
        if not inverted or state.order_broken % cfg.refine_order_patience:
            return None
        return ("refinement_order", f"validation loss per supervision step out of order for {state.order_broken} "
                f"evaluations in a row (now {' -> '.join(f'{v:.4f}' for v in losses)}; step "
                f"{', '.join(map(str, inverted))} no better than the one before): lower learning_rate, or "
                f"check supervision_weight_base and grad_clip",
                dict(val_sup_losses=losses, evaluations=state.order_broken))


# -----------------------------------------------------------------------------
# bd3lm: block diffusion

class BlockDiffusionLM(GPT):
    """objective="bd3lm", block diffusion (BD3-LM, Arriola et al. 2025): the sequence is cut into blocks of
    diffusion_block tokens; in each, every token is replaced by [MASK] (config.mask_id) with probability t, drawn
    per block, and the model predicts the clean tokens from the noisy block and the clean blocks before it (one
    pass over both copies, BlockDiffusion's mask). The loss is the NELBO: each masked token's cross-entropy x 1/t,
    averaged over the tokens. Sampled a block at a time (generate)."""

    def forward(self, idx, targets=None, cache=None):
        """With targets, the noise draws (diffuse): (None, the NELBO per token); without, idx is the next block
        after the cache's, whole (denoise): (its logits, None), and the cache keeps it."""
        T = self.check_length(idx, cache)
        out = self.diffuse(idx, targets) if targets is not None else (self.denoise(idx, cache), None)
        if cache is not None:
            cache.pos += T
        return out

    def diffuse(self, x0, draws):
        """The loss: (None, the NELBO per token) of the clean tokens x0 (B, T). draws (B, 2, T), uniform in [0, 1)
        and made by the loader from each sample's index (data.diffusion_draws: the same whatever the world size or a
        resume): block b's t is drawn from draws[:, 1, b] and token i is masked when draws[:, 0, i] < its block's t.
        One pass over the noisy copy and the clean copy (2T positions) under BlockDiffusion's mask; the loss is the
        cross-entropy of the masked tokens, each x 1/t, over the tokens that can be noised."""
        c = self.config
        B, T = x0.shape
        blocks = c.diffusion_blocks(x0.device)[:T]
        low, high = (c.clip_low, c.clip_high) if self.training and c.noise_schedule == "clipped" else (LOGLINEAR_EPS, 1.0)
        t = low + (high - low) * draws[:, 1].float().gather(1, blocks.expand(B, T))  # each token's block's t
        masked = (draws[:, 0] < t) & (torch.arange(T, device=x0.device) >= c.noised_from)
        x = self.embed_tokens(torch.cat([torch.where(masked, c.mask_id, x0), x0], dim=1))
        x = self.blocks(x, None, self.ready(x, BlockDiffusion(blocks)))
        _, loss = self.head(x[:, :T], x0, masked / t)
        return None, loss * T / (T - c.noised_from)

    def denoise(self, block, cache=None):
        """Logits (B, L, padded_vocab) for a block of L tokens (some [MASK]) after the clean blocks in the cache,
        which it sees whole, as it sees itself: what training's noisy copy sees. Its keys and values go into the
        cache past cache.pos, kept only when forward() runs the finished block again."""
        return self.head(self.blocks(self.embed_tokens(block), cache, False), None)[0]

    def cross_entropy_sum(self, logits, targets, weights=None):
        """GPT's, with the [MASK] id never predicted (BD3-LM's SUBS parameterization: its logit is minus infinity)."""
        logits = logits.float().view(targets.numel(), -1)
        logits = logits.index_fill(-1, torch.tensor([self.config.mask_id], device=logits.device), float("-inf"))
        return super().cross_entropy_sum(logits, targets, weights)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None, steps=None,
                 unmask="schedule"):
        """Yields the next token of each row, shape (B,), a block at a time.

        The prompt's whole blocks go into the KV cache a block at a time (a clean block sees itself whole and the
        blocks before it, as in training); the block it ends in is finished around its tokens, which stay. Each
        block starts all-[MASK] and is unmasked in `steps` denoising passes (None: one token per pass, the block's
        length), then goes into the cache whole and its tokens are yielded. Which masked tokens a pass fills (each
        with a token drawn at temperature / top_k / top_p): unmask="schedule", BD3-LM's own, t falls from 1 to 0
        in `steps` even steps and each masked token is filled with probability (t - s) / t at the step from t to s,
        in random order as training masks; "confidence", those whose drawn token is most probable, as many as an
        even share of the passes left asks (a small model's most probable token is often a space:
        config/tiny_bd3lm.py's samples were all whitespace this way).
        HDP: the prompt is the question, padded with BOS to its segment as prepare.py pads it; then come the plan
        and the execution. Ends after max_new_tokens, at block_size (no sliding window: a block's tokens are drawn
        for their positions), or once every row has made BOS, the end of a document (HDP: in the execution, as the
        plan's padding is BOS too)."""
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
        """generate's denoising of one block x (B, L), [MASK] where still open, after the cache's blocks."""
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


# -----------------------------------------------------------------------------
# the model of each objective

MODELS = dict(ar=GPT, refine=Refine, bd3lm=BlockDiffusionLM)  # config.objective -> its model


def make_model(config):
    """A new model of config's objective (GPTConfig.objective), initialized."""
    return MODELS[config.objective](config)


def random_batch(config, rows, device, seq_len=None):
    """(inputs, targets) of random tokens as a training step of config's objective takes them, for the probes that
    time or measure a step (sanity.py's capacity, bench/): the compute does not depend on the tokens. bd3lm's
    targets are its noise draws (data.diffusion_draws)."""
    shape = (rows, seq_len or config.block_size)
    if config.objective == "bd3lm":
        return (torch.randint(0, config.mask_id, shape, device=device),
                torch.rand(rows, 2, shape[1], device=device))
    return tuple(torch.randint(0, config.vocab_size, shape, device=device) for _ in range(2))
