"""
The end of a step's backward on this rank: the gradients unscaled (fp16) and clipped to grad_clip,
or, with master weights, their global norm taken once for MasterAdamW to clip inside its update.
"""
import torch

from podgpt.core.optim import MasterAdamW


def clip(optimizer, model, grad_clip):
    """The global gradient norm before clipping to grad_clip (MasterAdamW clips in its update)."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.prepare(grad_clip)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)


def clip_gradients(optimizer, scaler, model, grad_clip, sharded, loss_sum):
    """(the global gradient norm before clipping, whether the step is finite)."""
    scaler.unscale_(optimizer)  # fp16's; a disabled scaler (bf16, fp32, master weights): no-op
    grad_norm = clip(optimizer, model, grad_clip if grad_clip > 0 else float("inf"))
    if sharded:  # a DTensor: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    # fp16's scaler skips overflowing gradients itself; any other non-finite value skips it here
    finite = bool(torch.isfinite(loss_sum)) and (scaler.is_enabled()
                                                 or bool(torch.isfinite(grad_norm)))
    return grad_norm, finite
