"""
The optimizers train.py steps: AdamW decaying only the matrices, or (optimizer=muon) nanochat's
split, Muon for the blocks' matrices and AdamW for the rest, stepped as one (MuonAdamW); with
master_weights, AdamW on an fp32 master copy of bf16 parameters, the clip folded in (MasterAdamW).
"""
import torch
import torch.distributed as dist

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
    if cfg.master_weights not in (False, True, "auto"):
        fail(f"master_weights={cfg.master_weights!r} is not one of False, True, auto", 2)
    if cfg.master_weights is True and cfg.optimizer == "muon":
        fail("master_weights=True does not run with optimizer=muon (Muon has no fp32 master "
             "copy): use optimizer=adamw, or master_weights=False", 2)
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
                   embedding_lr=4e-3, momentum=0.95, master=False, compiled=False):
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
    if master:  # kind adamw (check_optimizer refuses muon)
        return MasterAdamW(model, [dict(params=decay, weight_decay=weight_decay),
                                   dict(params=no_decay, weight_decay=0.0)], learning_rate, betas,
                           compiled, fused)
    adamw = torch.optim.AdamW([dict(params=decay, weight_decay=weight_decay, **peak),
                               dict(params=no_decay, weight_decay=0.0, **peak)],
                              lr=peak.get("peak_lr", learning_rate), betas=betas, fused=fused)
    if kind == "adamw":
        return adamw
    # no weight decay on Muon's matrices (nanochat's, Keller Jordan's): torch's decays by lr x wd a
    # step, at 0.02 some 70x what AdamW's does at 3e-4 with the same weight_decay
    return MuonAdamW(torch.optim.Muon([dict(params=matrices, peak_lr=matrix_lr)], lr=matrix_lr,
                                      momentum=momentum, weight_decay=0.0), adamw)


def master_weights_on(cfg, dt):
    """Whether this run keeps bf16 parameters and an fp32 master (MasterAdamW): master_weights=True
    needs bfloat16; auto is on for bf16 ddp runs of AdamW. Under fsdp, FSDP2's mixed precision
    already keeps the fp32 shards as the master (model.shard_model): nothing to add."""
    if cfg.master_weights is True and dt != torch.bfloat16:
        fail(f"master_weights=True keeps bfloat16 parameters, and this run computes in "
             f"{str(dt).removeprefix('torch.')}: set dtype=bfloat16, or master_weights=False", 2)
    return bool(cfg.master_weights) and dt == torch.bfloat16 and cfg.dist_mode == "ddp" \
        and cfg.optimizer == "adamw"


def adamw_update(masters, params, grads, exp_avgs, exp_avg_sqs, lr, weight_decay, beta1, beta2,
                 eps, step, scale):
    """torch's AdamW (decoupled decay) on the fp32 masters, the gradients x the clip's `scale`
    (a tensor, as lr and step: one compiled graph for every step); the bf16 params then copied."""
    torch._foreach_mul_(grads, scale)
    torch._foreach_mul_(masters, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2 ** step).sqrt())
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(update, -lr / (1 - beta1 ** step))
    torch._foreach_add_(masters, update)
    torch._foreach_copy_(params, masters)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over a model whose parameters it turns bfloat16 (autocast then casts none), keeping an
    fp32 master of each. Each backward's bf16 gradient is added into one flat fp32 buffer as it is
    made (a hook; the bf16 .grad freed at once), so micro-batches accumulate in fp32; under ddp the
    buffer is all-reduced here, once a step, in fp32 (the model runs without DDP). prepare() takes
    the global norm once; step() applies the clip inside the update. Its state_dict is torch
    AdamW's (fp32 moments), so either optimizer resumes the other's checkpoint."""

    def __init__(self, model, groups, lr, betas, compiled=False, fused=False):
        # torch AdamW's defaults, every key: a checkpoint's param_groups load into either
        defaults = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, fused=fused).defaults
        super().__init__(groups, defaults)
        params = [p for g in self.param_groups for p in g["params"]]
        self.grad = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        self.master, self.grads, at = {}, {}, 0
        for p in params:
            self.master[p] = p.detach().float().clone()
            self.grads[p] = self.grad[at:at + p.numel()].view_as(p)
            at += p.numel()
            p.data = p.data.to(torch.bfloat16)
            p.register_post_accumulate_grad_hook(self.accumulate)
        self.names = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
        self.scale = None  # the clip's factor, set by prepare()
        self.update = torch.compile(adamw_update) if compiled else adamw_update

    def accumulate(self, p):
        self.grads[p].add_(p.grad)
        p.grad = None

    def prepare(self, grad_clip):
        """The step's gradients (averaged over the ranks): their global norm; the clip to apply."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.grad)
            self.grad.div_(dist.get_world_size())
        norm = torch.linalg.vector_norm(self.grad)
        # clip_grad_norm_'s factor, never above 1
        self.scale = (grad_clip / (norm + 1e-6)).clamp(max=1.0)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.grads:  # a gradient set directly, not by a backward (DCP's state init)
            if p.grad is not None:
                self.accumulate(p)
        dev = self.grad.device
        scale = torch.ones((), device=dev) if self.scale is None else self.scale
        for g in self.param_groups:
            params, beta1, beta2 = g["params"], *g["betas"]
            for p in params:
                if not self.state[p]:  # as torch's AdamW: a step count per parameter
                    self.state[p] = dict(step=torch.tensor(0.0), exp_avg=torch.zeros_like(
                        self.master[p]), exp_avg_sq=torch.zeros_like(self.master[p]))
                self.state[p]["step"] += 1
            state = [self.state[p] for p in params]
            self.update([self.master[p] for p in params], params, [self.grads[p] for p in params],
                        [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state],
                        torch.tensor(float(g["lr"]), device=dev), g["weight_decay"], beta1, beta2,
                        g["eps"], state[0]["step"].to(dev), scale)
        self.scale = None

    def zero_grad(self, set_to_none=True):
        self.grad.zero_()
        for p in self.grads:
            p.grad = None

    def load_state_dict(self, state_dict):
        """torch's, but the moments kept fp32 (torch's casts them to the parameter's dtype)."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, (p for g in self.param_groups for p in g["params"]), strict=True):
            for key, value in state_dict["state"].get(i, {}).items():
                # the step count on the CPU (a count per parameter, each +1 a step)
                self.state[p][key] = value.to("cpu" if key == "step" else p.device,
                                              torch.float32).clone()

    def masters(self, state):
        """A model state dict (by name: a checkpoint's) with the parameters' fp32 masters in it."""
        return {n: self.master[self.names[n]] if n in self.names else t for n, t in state.items()}

    def load_masters(self, state):
        """The masters and the bf16 parameters from a model state dict holding full precision."""
        with torch.no_grad():
            for n, p in self.names.items():
                if n in state:
                    self.master[p].copy_(state[n])
                    p.copy_(self.master[p])
