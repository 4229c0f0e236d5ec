"""
The LM head and its cross-entropy in one pass (the approach of Liger-Kernel's fused linear
cross-entropy and cut-cross-entropy): the forward goes loss_chunk tokens at a time, and with each
chunk's logits at hand it also makes that chunk's gradients for the head's input and weight. The
backward then only scales them by the loss's upstream gradient: no logits are kept, and none are
computed twice (a checkpointed chunk computes them again in the backward).
"""

import torch

from podgpt.core.util import IGNORE


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i weights_i * CE(x_i @ weight^T, targets_i), a target IGNORE counting 0: as
    F.cross_entropy over fp32 logits made in the autocast dtype (every column of weight: padded
    ids included, but those in never, whose logits are -inf)."""

    @staticmethod
    def forward(ctx, x, weight, targets, weights, chunk, grads, never):
        """x (N, C), weight (V, C), targets (N,), weights (N,) or None; grads: make gradients;
        never: the ids (a tensor) never predicted, or None."""
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        w = weight.to(dtype)  # autocast's cast of the head, once for every chunk
        total = torch.zeros((), device=x.device, dtype=torch.float32)
        grad_x = torch.empty_like(x) if grads else None
        # fp32 whatever the compute dtype: a sum over every chunk, as autograd sums the weight's
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        with torch.autocast(dev, enabled=False):
            for start in range(0, x.size(0), chunk):
                rows = slice(start, start + chunk)
                xc, yc = x[rows].to(dtype), targets[rows]
                scale = (yc != IGNORE).float()  # each token's weight in the sum
                if weights is not None:
                    scale = scale * weights[rows].float()
                logits = (xc @ w.t()).float()
                if never is not None:  # softmax 0 there: no gradient reaches their rows
                    logits.index_fill_(1, never, float("-inf"))
                lse = logits.logsumexp(dim=-1)
                picked = yc.clamp(min=0).unsqueeze(1)  # IGNORE's row is scaled by 0
                # not +=: compiled by torch 2.11, an in-place op on the returned tensor sent its
                # gradient to the wrong slot, and every gradient came out 0 (pytorch/pytorch#180642)
                total = total + ((lse - logits.gather(1, picked).squeeze(1)) * scale).sum()
                if grads:
                    # d/dlogits of the weighted sum: (softmax - onehot(target)) * weight
                    g = (logits - lse.unsqueeze(1)).exp_().mul_(scale.unsqueeze(1))
                    g.scatter_add_(1, picked, -scale.unsqueeze(1))
                    g = g.to(dtype)
                    grad_x[rows] = g @ w
                    grad_w += (g.t() @ xc).float()
        if grads:
            ctx.save_for_backward(grad_x, grad_w)
            ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_w = ctx.saved_tensors
        grad_w = (grad_w * grad_total).to(ctx.weight_dtype)
        return grad_x * grad_total, grad_w, None, None, None, None, None


def linear_cross_entropy(x, weight, targets, weights=None, chunk=8192, never=None):
    """The summed (weighted) cross-entropy of x @ weight^T against targets, chunk rows at a time,
    its gradients made in the same pass when autograd will want them; the ids in never (a tensor)
    are never predicted."""
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return LinearCrossEntropy.apply(x, weight, targets, weights, chunk or x.size(0), grads, never)
