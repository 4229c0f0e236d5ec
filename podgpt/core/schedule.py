"""
The learning-rate schedule, and the time and money left to it. The schedule ends at its horizon:
max_steps, or fewer where max_hours or budget_usd pay for fewer (fit_horizon); wsd's decay starts
(or ends) sooner when what is left pays for no more (decay_horizon). Budget stops a run before a
limit is crossed, keeping back what a stop still needs (the reserve, in seconds).
"""
import json
import math
from dataclasses import dataclass

from podgpt.core.util import first_line, warn

BUDGET_WARN = 0.85              # warn past this fraction of budget_usd (budget_warn_usd: 0)
HOURS_PER_MONTH = 730           # a disk's price per GB-month is billed by the hour at 1/730 of it


@dataclass
class Schedule:
    """train.py's learning_rate, min_lr, warmup_steps, lr_schedule and decay_frac."""
    learning_rate: float
    min_lr: float
    warmup_steps: int
    kind: str = "cosine"
    decay_frac: float = 0.2

    @classmethod
    def of(cls, cfg):
        return cls(cfg.learning_rate, cfg.min_lr, cfg.warmup_steps, cfg.lr_schedule, cfg.decay_frac)

    def lr(self, step, horizon, decay_start=-1, decay_lr=None):
        """Learning rate of step `step` (0-based), the last being horizon - 1: warmup, then cosine;
        wsd: learning_rate until decay_start (-1: not yet), then linear from decay_lr (None:
        learning_rate; else where an earlier decay had come) to min_lr at the last step."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        if self.kind == "wsd":
            if decay_start < 0 or step < decay_start:
                return self.learning_rate
            start = self.learning_rate if decay_lr is None else decay_lr
            return start + (self.min_lr - start) * min(1.0, (step - decay_start + 1)
                                                       / max(1, horizon - decay_start))
        progress = min(1.0, (step - self.warmup_steps) / max(1, horizon - 1 - self.warmup_steps))
        return (self.min_lr
                + 0.5 * (self.learning_rate - self.min_lr) * (1.0 + math.cos(math.pi * progress)))

    def check_warmup(self, max_steps):
        """Warn when warmup_steps is more than max_steps: the learning rate never peaks."""
        if self.warmup_steps > max_steps:
            warn(f"warmup_steps={self.warmup_steps} is more than max_steps={max_steps}: the "
                 f"learning rate stops at {self.lr(max_steps - 1, max_steps):.3g}, short of "
                 f"learning_rate={self.learning_rate:g}")


@dataclass
class Budget:
    """What a run may spend (train.py's keys; 0 or "": no limit); budget_file is kept current from
    outside and read every check_minutes. The spend is GPU-hours, the disk while the run lasts and
    usd_fixed (the data's egress, say), counted from the start."""
    max_hours: float = 0.0
    budget_usd: float = 0.0
    usd_per_gpu_hour: float = 0.0
    budget_file: str = ""
    check_minutes: float = 30.0
    usd_fixed: float = 0.0
    storage_gb: float = 0.0
    usd_per_gb_month: float = 0.0
    warn_usd: float = 0.0

    @classmethod
    def of(cls, cfg):
        return cls(cfg.max_hours, cfg.budget_usd, cfg.usd_per_gpu_hour, cfg.budget_file,
                   cfg.budget_check_minutes, cfg.usd_fixed, cfg.storage_gb, cfg.usd_per_gb_month,
                   cfg.budget_warn_usd)

    def usd_per_s(self, world):
        """Dollars a second of the run costs on `world` GPUs, its disk included."""
        return (world * self.usd_per_gpu_hour
                + self.storage_gb * self.usd_per_gb_month / HOURS_PER_MONTH) / 3600

    def warn_at(self):
        return self.warn_usd or BUDGET_WARN * self.budget_usd

    def lines(self, hours, world, gpu):
        """What `hours` on `world` GPUs spend, by line: [(line, how, dollars)], the total last."""
        rows = [("GPU", f"{world} x {gpu} x {hours:.2f} h x ${self.usd_per_gpu_hour:.2f}/h",
                 world * self.usd_per_gpu_hour * hours),
                ("storage", f"{self.storage_gb:g} GB x {hours:.2f} h x ${self.usd_per_gb_month:.2f}"
                 f"/GB-month", self.storage_gb * self.usd_per_gb_month / HOURS_PER_MONTH * hours),
                ("fixed", "usd_fixed: egress, one-off charges", self.usd_fixed)]
        total = sum(usd for *_, usd in rows)
        cap = f"budget_usd=${self.budget_usd:.2f}" if self.budget_usd else "no budget_usd"
        return rows + [("total", f"{cap}, a warning past ${self.warn_at():.2f}", total)]

    def seconds_left(self, elapsed, cost_usd, reserve, usd_per_s):
        """{limit: seconds}: what max_hours and budget_usd (where set) leave after `elapsed` seconds
        and `cost_usd` dollars at usd_per_s, keeping back `reserve` seconds."""
        left = {}
        if self.max_hours:
            left["max_hours"] = self.max_hours * 3600 - elapsed - reserve
        if self.budget_usd and usd_per_s:
            left["budget_usd"] = (self.budget_usd - cost_usd) / usd_per_s - reserve
        return left

    def crossed(self, elapsed, cost_usd, reserve, usd_per_s):
        """The limit (max_hours, budget_usd) the run would cross within `reserve` s, or None."""
        left = self.seconds_left(elapsed, cost_usd, reserve, usd_per_s)
        return next((limit for limit, s in left.items() if s < 0), None)

    def file_verdict(self):
        """budget_file, read now: (the guard that must stop the run or None, spent, projected);
        None when unreadable (a warning)."""
        try:
            with open(self.budget_file) as f:
                b = json.load(f)
            spent = float(b["spent_usd"])
            projected = float(b.get("projected_total_usd", b["spent_usd"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            warn(f"budget_file {self.budget_file} unreadable ({first_line(e)}); retrying in "
                 f"{self.check_minutes} min")
            return None
        limit = ("budget_file_spent" if spent > self.budget_usd else
                 "budget_file_projected" if projected > self.budget_usd else None)
        return limit, spent, projected


def step_seconds(tokens_per_sec, batch_tokens, accum, eval_steps, eval_every):
    """A step's time at tokens_per_sec, with its share of the evaluations (a forward is about a
    third of a training micro-batch's forward and backward)."""
    return batch_tokens / tokens_per_sec * (1 + eval_steps / (3 * accum * eval_every))


def fit_horizon(max_steps, budget, step_s, usd_per_s, spent_s=0.0, spent_usd=0.0, reserve_s=0.0):
    """(steps, what sets them): max_steps, or fewer when max_hours or budget_usd (after spent_s and
    spent_usd, keeping back reserve_s and a step, as the guards do) pay for fewer at step_s."""
    left = budget.seconds_left(spent_s, spent_usd, reserve_s, usd_per_s)
    steps, by = min([(max_steps, "max_steps"), *((s / step_s, limit) for limit, s in left.items())])
    return max(0, int(steps) - (by != "max_steps")), by


def decay_horizon(schedule, budget, st, pace, reserve, usd_per_s):
    """wsd: the horizon to decay to from the next step on, when the decay should start (or end
    sooner) now; else 0. pace: (steps done, elapsed) at the ends of recent steps. The decay starts
    decay_frac of the horizon before its end, or sooner when what is left pays for no more than it
    at that pace; a decay the money can no longer finish ends sooner, from where it has come."""
    if schedule.kind != "wsd" or st.step + 1 < schedule.warmup_steps or len(pace) < 2:
        return 0
    decay = max(1, round(schedule.decay_frac * st.horizon))
    if st.decay_start < 0 and st.horizon - (st.step + 1) <= decay:
        return st.horizon
    (s0, t0), (s1, t1) = pace[0], pace[-1]
    step_s = (t1 - t0) / (s1 - s0)
    # the guard's reserve, and a step to spare: the horizon comes before the guard
    left = budget.seconds_left(st.elapsed, st.cost_usd, reserve + step_s, usd_per_s)
    if not left:
        return 0
    end = st.step + 1 + max(1, int(min(left.values()) / step_s))
    if st.decay_start < 0:
        return end if end - (st.step + 1) <= decay else 0
    return end if end < st.horizon else 0
