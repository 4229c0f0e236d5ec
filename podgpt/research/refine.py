"""
Deep-supervision refinement (objective=refine): each block applied many times. The embedding x
stays; an answer y (from x) and a latent z (from zeros) pass through every layer: the block updates
z n_loops times reading x + y + z, then y once reading y + z, all T_recursion times. One pass
through every layer is a supervision step, after which the head reads y and takes a cross-entropy.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from model import GPT, GPTConfig

# --- config
n_loops = 2                     # refine: latent (z) updates per layer and repetition
T_recursion = 1                 # refine: repetitions per layer; training: the earlier without grad
n_sup_train = 4                 # refine: supervision steps (all layers, then a loss) in training
n_sup_inference = 4             # refine: supervision steps in evaluation and generation
refine_phase = ""               # refine: the recipe's phase: fast (1) | extreme (2) | "": none
refine_preset = "aggressive"    # refine: moderate (3, .5) | aggressive (5, 1) | extreme (10, 2)
supervision_weight_base = None  # refine: step i's loss weighs base^i / sum_j base^j; None: preset
improvement_reward_scale = None  # refine: minus this x (prev-cur)/prev from step 2 on; None: preset
detach_threshold = 2            # refine: y, z detached after each step >= this, but the last
refine_order_patience = 3       # refine: warn at this many evals in a row of val steps out of order
refine_band = ""                # refine: done is a val refinement of "lo,hi" % (recipe's); "": none
# --- end config

# what each preset fills unless set (configurator.apply_presets; a phase's refine_preset then fills
# its own). The phases: the recipe's two tables (8 GPUs: 32 x 2 x 8, then 16 x 2 x 8 sequences)
PRESETS = {
    "refine_phase": {
        "fast": {"refine_preset": "aggressive", "micro_batch_size": 32,
                 "total_batch_tokens": (512, "block_size"), "max_steps": 1000, "optimizer": "muon",
                 "matrix_lr": 1e-3, "embedding_lr": 1e-2, "learning_rate": 1e-3},
        "extreme": {"refine_preset": "extreme", "micro_batch_size": 16,
                    "total_batch_tokens": (256, "block_size"), "max_steps": 5000,
                    "optimizer": "muon", "matrix_lr": 5e-4, "embedding_lr": 5e-3,
                    "learning_rate": 5e-4}},
    "refine_preset": {
        "moderate": {"supervision_weight_base": 3.0, "improvement_reward_scale": 0.5},
        "aggressive": {"supervision_weight_base": 5.0, "improvement_reward_scale": 1.0},
        "extreme": {"supervision_weight_base": 10.0, "improvement_reward_scale": 2.0}},
}


@dataclass
class Config(GPTConfig):
    """GPTConfig and the keys above, but refine_phase (the run's keys), refine_order_patience and
    refine_band (the loop's), not the model's."""
    objective: str = "refine"
    n_loops: int = n_loops
    T_recursion: int = T_recursion
    n_sup_train: int = n_sup_train
    n_sup_inference: int = n_sup_inference
    refine_preset: str = refine_preset
    supervision_weight_base: float = supervision_weight_base
    improvement_reward_scale: float = improvement_reward_scale
    detach_threshold: int = detach_threshold

    def __post_init__(self):
        super().__post_init__()
        presets = PRESETS["refine_preset"]
        if self.refine_preset not in presets:
            raise ValueError(f"refine_preset={self.refine_preset!r}: choose one of "
                             f"{', '.join(presets)}")
        for key, least in (("n_loops", 0), ("T_recursion", 1), ("n_sup_train", 1),
                           ("n_sup_inference", 1), ("detach_threshold", 0)):
            if getattr(self, key) < least:
                raise ValueError(f"{key}={getattr(self, key)} must be at least {least}")
        for key, value in presets[self.refine_preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.supervision_weight_base <= 0:
            raise ValueError(f"supervision_weight_base={self.supervision_weight_base} "
                             f"must be positive")

    def applications(self, training=True):
        """GPTConfig's: in training, the earlier repetitions run without gradients."""
        per_repetition = self.n_loops + 1
        if not training:
            return self.n_sup_inference, per_repetition * self.T_recursion, 0
        return self.n_sup_train, per_repetition, per_repetition * (self.T_recursion - 1)

    def sums_kept(self, mode):
        """Under checkpointing a layer's latent updates also keep the x + y they read (fp32)."""
        return 4 * self.n_embd if self.n_loops and mode != "none" else 0


def check_config(cfg):
    """Refuse the training keys the model's config does not check."""
    if cfg.refine_order_patience <= 0:
        raise ValueError(f"refine_order_patience={cfg.refine_order_patience} must be positive")


def checks(cfg):
    """The run's own checks this objective adds (podgpt/pod/checks.py judges them at each
    evaluation and the end): the refinement of Refine.metrics within refine_band."""
    return [("refinement", cfg.refine_band, "refinement")] if cfg.refine_band else []


def refine_objective(losses, base, reward):
    """The training loss of the steps' cross-entropies (0-d, first to last): step i weighs base^i /
    sum_j base^j, less reward * (prev - cur) / prev from step 2 on, prev detached (so that the step
    before is not pushed to be worse)."""
    weights = [base ** i for i in range(len(losses))]
    objective = sum(w / sum(weights) * loss for w, loss in zip(weights, losses, strict=True))
    for prev, cur in zip(losses, losses[1:]):
        objective = objective - reward * (prev.detach() - cur) / prev.detach()
    return objective


class Refine(GPT):
    """The model (the module's docstring). Its stats: each supervision step's cross-entropy."""

    def predict(self, x, targets, cache, mask):
        """(the last step's logits, the loss, the steps' cross-entropies (detached)); the last two
        None without targets. The loss: refine_objective() in training, else the last step's."""
        c = self.config
        n_sup = c.n_sup_train if self.training else c.n_sup_inference
        y, z, slot, losses, logits = x, None if c.n_loops == 0 else torch.zeros_like(x), 0, [], None
        for step in range(n_sup):
            for block in self.layers:
                for r in range(c.T_recursion):
                    # TRM's deep recursion: the repetitions before the last have no gradients
                    with torch.no_grad() if r < c.T_recursion - 1 else nullcontext():
                        if z is not None:
                            xy = x + y  # what every latent update reads besides z
                            for _ in range(c.n_loops):
                                z = block(z, cache, mask, slot, context=xy)
                                slot += 1
                        y = block(y, cache, mask, slot, context=z)
                        slot += 1
            if targets is not None or step == n_sup - 1:
                logits, loss = self.head(y, targets, in_graph=True)  # a break leaves the loop eager
                losses.append(loss)
            if c.detach_threshold <= step < n_sup - 1:  # later losses stop reaching back past here
                y, z = y.detach(), None if z is None else z.detach()
        if targets is None:
            return logits, None, None
        steps = torch.stack(losses).detach()
        if not self.training:
            return logits, losses[-1], steps
        return logits, refine_objective(losses, c.supervision_weight_base,
                                        c.improvement_reward_scale), steps

    @staticmethod
    def metrics(losses, prefix=""):
        """The losses per step as sup_loss_0, sup_loss_1, ..., and the refinement: the % of step 0's
        loss the last removes."""
        return {**{f"{prefix}sup_loss_{i}": v for i, v in enumerate(losses)},
                f"{prefix}refinement": 100 * (losses[0] - losses[-1]) / losses[0]}

    @staticmethod
    def console(losses):
        """metrics() on a console line: " | steps 5.1000 -> 4.9000 -> 4.8000 (5.9% refined)"."""
        refined = Refine.metrics(losses)["refinement"]
        return f" | steps {' -> '.join(f'{v:.4f}' for v in losses)} ({refined:.1f}% refined)"

    @staticmethod
    def check_validation(losses, state, cfg):
        """(event name, message, fields) of a warning when a validation step did no better than the
        one before for refine_order_patience evaluations in a row (and each such run after)."""
        inverted = [i for i in range(1, len(losses)) if losses[i] >= losses[i - 1]]
        state.order_broken = state.order_broken + 1 if inverted else 0
        if not inverted or state.order_broken % cfg.refine_order_patience:
            return None
        return ("refinement_order",
                f"validation loss per supervision step out of order for {state.order_broken} "
                f"evaluations in a row (now {' -> '.join(f'{v:.4f}' for v in losses)}; step "
                f"{', '.join(map(str, inverted))} no better than the one before): lower "
                f"learning_rate, or check supervision_weight_base and grad_clip",
                dict(val_sup_losses=losses, evaluations=state.order_broken))


Model = Refine
