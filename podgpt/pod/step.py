"""
The end of a step's backward on this rank: the gradients unscaled (fp16) and clipped to grad_clip,
or, with master weights, their global norm taken once for MasterAdamW to clip inside its update.
"""
import torch

from podgpt.core.optim import MasterAdamW


def clip_gradients(optimizer, scaler, model, grad_clip, sharded, loss_sum):
    """(the global gradient norm before clipping, whether the step is finite)."""
    grad_clip = grad_clip if grad_clip > 0 else float("inf")
    if isinstance(optimizer, MasterAdamW):
        grad_norm = optimizer.prepare(grad_clip)
    else:
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if sharded:  # a DTensor: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    # fp16's scaler skips overflowing gradients itself; any other non-finite value skips it here
    finite = bool(torch.isfinite(loss_sum)) and (scaler.is_enabled()
                                                 or bool(torch.isfinite(grad_norm)))
    return grad_norm, finite
