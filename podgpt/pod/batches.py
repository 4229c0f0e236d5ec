"""
A step's batches on this rank: its slices of one global, seeded order of windows (disjoint across
ranks, the same at any world size), the fire drill's batches of the rarest tokens, and SFT data's
weight per micro-batch.
"""
import torch
import torch.distributed as dist

from podgpt.core.data import rare_token_batch


class Batches:
    """train_data's batches for proc's rank; rare: the spike drill's rarest tokens, or None."""

    def __init__(self, cfg, proc, train_data, rare, grad_accum):
        self.cfg, self.proc, self.train_data = cfg, proc, train_data
        self.rare, self.grad_accum = rare, grad_accum

    def micro(self, st, micro, spike_drill):
        """(x, y) of micro-batch `micro` of the step after st.step."""
        cfg, first = self.cfg, self.first_sample(st, micro)
        if spike_drill:
            return rare_token_batch(self.rare, cfg.micro_batch_size, cfg.block_size,
                                    [cfg.seed, st.step, first], self.proc.dev,
                                    self.train_data.draws)
        return self.train_data.train_batch(first, cfg.micro_batch_size, self.proc.dev)

    def first_sample(self, st, micro):
        """The first sample of this rank's slice of micro-batch `micro`: disjoint across ranks."""
        world, rank = self.proc.world, self.proc.rank
        return st.samples + (micro * world + rank) * self.cfg.micro_batch_size

    def weights(self, st):
        """SFT data: each micro-batch's share of the step's targets (every rank's) x the step's
        micro-batches, so that the mean over them is over every target, not of unequal means."""
        counts = [self.train_data.train_targets(self.first_sample(st, micro),
                                                self.cfg.micro_batch_size)
                  for micro in range(self.grad_accum)]
        counts = torch.tensor(counts, device=self.proc.dev).float()
        total = counts.sum()
        if self.proc.distributed:
            dist.all_reduce(total)
        return counts * (self.grad_accum * self.proc.world) / total.clamp(min=1)
