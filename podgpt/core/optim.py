"""
The optimizers train.py steps: AdamW decaying only the matrices, or (optimizer=muon) nanochat's
split, Muon for the blocks' matrices and AdamW for the rest, stepped as one (MuonAdamW).
"""
import torch

from podgpt.core.util import fail


def check_optimizer(cfg):
    """Refuse an optimizer or learning rates that cannot work, before anything is read or saved."""
    if cfg.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            fail("optimizer=muon needs torch.optim.Muon (torch 2.9 or newer): pip install -U "
                 "torch, or optimizer=adamw")
        # Newton-Schulz multiplies whole matrices: on FSDP2's shards torch's Muon would all-gather
        if cfg.dist_mode == "fsdp":
            fail("optimizer=muon does not run sharded (dist_mode=fsdp): Muon orthogonalizes each "
                 "whole matrix, which FSDP splits over the GPUs; use dist_mode=ddp, or "
                 "optimizer=adamw")
        for key in ("matrix_lr", "embedding_lr"):
            if cfg[key] <= 0:
                fail(f"{key}={cfg[key]} must be positive")
        if not 0 <= cfg.muon_momentum < 1:
            fail(f"muon_momentum={cfg.muon_momentum} must be in [0, 1)")
    if cfg.min_lr > cfg.learning_rate:
        fail(f"min_lr={cfg.min_lr} is above learning_rate={cfg.learning_rate}: the schedule decays "
             "from learning_rate to min_lr")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        fail(f"beta1={cfg.beta1}, beta2={cfg.beta2}: both must be in [0, 1)")


class MuonAdamW:
    """optimizer=muon's two optimizers as one (param_groups: Muon's, then AdamW's). A resume keeps
    this run's peak_lr, as it keeps learning_rate, and takes the rest from the checkpoint."""

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


def make_optimizer(model, learning_rate, betas, weight_decay, fused, kind="adamw", matrix_lr=0.02,
                   embedding_lr=4e-3, momentum=0.95):
    """AdamW decaying matrices only: not norms (1-D) nor the embedding (sparse rows, tied head).
    kind="muon": torch.optim.Muon (Nesterov) for the blocks' matrices at peak matrix_lr, that AdamW
    for the rest at peak embedding_lr, as a MuonAdamW whose groups carry their peak_lr. (Under ddp
    every rank orthogonalizes every matrix: the same all-reduced gradients, the same update.)"""
    matrices, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if kind == "muon" and name.startswith("layers.") and p.dim() == 2:
            matrices.append(p)
        else:
            (no_decay if p.dim() < 2 or name.startswith("embed_tokens") else decay).append(p)
    peak = {} if kind == "adamw" else dict(peak_lr=embedding_lr)
    adamw = torch.optim.AdamW([dict(params=decay, weight_decay=weight_decay, **peak),
                               dict(params=no_decay, weight_decay=0.0, **peak)],
                              lr=peak.get("peak_lr", learning_rate), betas=betas, fused=fused)
    if kind == "adamw":
        return adamw
    # no weight decay on Muon's matrices (nanochat's, Keller Jordan's): torch's decays by lr x wd a
    # step, at 0.02 some 70x what AdamW's does at 3e-4 with the same weight_decay
    return MuonAdamW(torch.optim.Muon([dict(params=matrices, peak_lr=matrix_lr)], lr=matrix_lr,
                                      momentum=momentum, weight_decay=0.0), adamw)
