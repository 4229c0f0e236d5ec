"""
The learning-rate schedule, and the time and money left to it: train.py asks these at every step, preflight.py
at the start.

The schedule ends at its horizon: max_steps, or fewer where max_hours or budget_usd pay for fewer at the planned
throughput (fit_horizon). lr_at: linear warmup, then cosine to min_lr at the horizon; or wsd, flat at
learning_rate, then linear to min_lr over the horizon's last decay_frac, starting (or ending) sooner when the time
or money left at the pace of the recent steps pays for no more (decay_horizon). The guards stop a run before a limit
is crossed (over_limit, budget_file_verdict), keeping back what a stop still needs: one more step, an evaluation and
the final save (the reserve, in seconds). A run's elapsed time and spend are in its checkpointed state, and in
out_dir/clock.json for the steps after its last checkpoint (restore_clock).
"""
import json
import math
import os

import torch.distributed as dist

from podgpt.core.util import first_line, log, warn

BUDGET_WARN = 0.85              # warn when budget_file's spend passes this fraction of budget_usd


def lr_at(step, cfg, horizon, decay_start=-1, decay_lr=None):
    """Learning rate of optimizer step `step` (0-based) of a schedule whose last step is horizon - 1: linear
    warmup, then cosine to min_lr at the last step; wsd: learning_rate until decay_start (-1: not yet), then
    linear from decay_lr (learning_rate, or where an earlier decay had come when the horizon moved closer)
    to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "wsd":
        if decay_start < 0 or step < decay_start:
            return cfg.learning_rate
        start = cfg.learning_rate if decay_lr is None else decay_lr
        return start + (cfg.min_lr - start) * min(1.0, (step - decay_start + 1) / max(1, horizon - decay_start))
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - 1 - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.learning_rate - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def check_warmup(cfg):
    """Warn when warmup_steps is more than max_steps: the learning rate never reaches its peak."""
    if cfg.warmup_steps > cfg.max_steps:
        warn(f"warmup_steps={cfg.warmup_steps} is more than max_steps={cfg.max_steps}: the learning rate stops at "
             f"{lr_at(cfg.max_steps - 1, cfg, cfg.max_steps):.3g}, short of learning_rate={cfg.learning_rate:g}")


def seconds_left(cfg, elapsed, cost_usd, reserve, usd_per_s):
    """{limit: seconds}: what max_hours and budget_usd (each where set) leave of a run's time after `elapsed`
    seconds and `cost_usd` dollars, keeping back `reserve` seconds; usd_per_s: what the run spends a second."""
    left = {}
    if cfg.max_hours:
        left["max_hours"] = cfg.max_hours * 3600 - elapsed - reserve
    if cfg.budget_usd and cfg.usd_per_gpu_hour:
        left["budget_usd"] = (cfg.budget_usd - cost_usd) / usd_per_s - reserve
    return left


def fit_horizon(cfg, tokens_per_sec, world, spent_s=0.0, spent_usd=0.0, reserve_s=0.0):
    """(steps, what sets them): where the run's schedule ends at tokens_per_sec. max_steps, or fewer when
    max_hours or budget_usd (after spent_s and spent_usd, keeping back reserve_s and a step, as the guards do)
    pays for fewer. A step's time includes its share of the evaluations: eval_steps micro-batches forward every
    eval_every steps, a forward pass being about a third of a training micro-batch's forward and backward."""
    accum = cfg.total_batch_tokens / (cfg.micro_batch_size * cfg.block_size * world)
    step_s = cfg.total_batch_tokens / tokens_per_sec * (1 + cfg.eval_steps / (3 * accum * cfg.eval_every))
    left = seconds_left(cfg, spent_s, spent_usd, reserve_s, world * cfg.usd_per_gpu_hour / 3600)
    steps, by = min([(cfg.max_steps, "max_steps"), *((s / step_s, limit) for limit, s in left.items())])
    return max(0, int(steps) - (by != "max_steps")), by


def start_horizon(cfg, proc, tokens_per_sec, spent_s, usd_per_s, reserve_s):
    """A new run's horizon, (steps, what sets them), rank 0's for every rank: with fit_budget, what max_hours and
    budget_usd pay for at preflight's tokens_per_sec after the startup's spent_s, keeping back reserve_s for a last
    evaluation and save; else max_steps."""
    fitted = [(cfg.max_steps, "max_steps")]
    if cfg.fit_budget and tokens_per_sec and proc.rank == 0:
        fitted = [fit_horizon(cfg, tokens_per_sec, proc.world, spent_s=spent_s, spent_usd=spent_s * usd_per_s,
                              reserve_s=reserve_s)]
    if proc.distributed:
        dist.broadcast_object_list(fitted)
    horizon, by = fitted[0]
    if horizon < cfg.max_steps:
        log(f"horizon: {by} pays for {horizon:,} of max_steps={cfg.max_steps:,} steps at {tokens_per_sec:,.0f} "
            f"tokens/s: the {cfg.lr_schedule} schedule ends there")
    return horizon, by


def decay_horizon(cfg, st, pace, reserve, usd_per_s):
    """wsd: the horizon to decay to from the next step on, when the decay should start (or, already decaying, end
    sooner) now; 0 otherwise. st: the loop's state; pace: (steps done, elapsed) at the ends of the recent steps. The
    decay starts decay_frac of the horizon before its end, or sooner when the time or money left pays for no more
    than the decay at that pace (saves, evaluations and all); a decay the money can no longer finish ends sooner,
    from where it has come."""
    if cfg.lr_schedule != "wsd" or st.step + 1 < cfg.warmup_steps or len(pace) < 2:
        return 0
    decay = max(1, round(cfg.decay_frac * st.horizon))
    if st.decay_start < 0 and st.horizon - (st.step + 1) <= decay:
        return st.horizon
    (s0, t0), (s1, t1) = pace[0], pace[-1]
    step_s = (t1 - t0) / (s1 - s0)
    # the guard's reserve, and a step to spare: the horizon comes before the guard
    left = seconds_left(cfg, st.elapsed, st.cost_usd, reserve + step_s, usd_per_s)
    if not left:
        return 0
    end = st.step + 1 + max(1, int(min(left.values()) / step_s))
    if st.decay_start < 0:
        return end if end - (st.step + 1) <= decay else 0
    return end if end < st.horizon else 0


def over_limit(cfg, st, reserve, usd_per_s):
    """The guard, max_hours or budget_usd, whose limit the run (st: the loop's state) would cross within `reserve`
    seconds; None."""
    left = seconds_left(cfg, st.elapsed, st.cost_usd, reserve, usd_per_s)
    return next((limit for limit, s in left.items() if s < 0), None)


def read_budget_file(path):
    """(spent_usd, projected_total_usd) from the budget file, or the reason it cannot be read."""
    try:
        with open(path) as f:
            b = json.load(f)
        return float(b["spent_usd"]), float(b.get("projected_total_usd", b["spent_usd"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return first_line(e)


def budget_file_verdict(cfg):
    """budget_file, read now: (the guard that must stop the run, or None; (spent, projected) when the spend has
    passed BUDGET_WARN of budget_usd, to warn about, or None). An unreadable file is a warning: it is read again at
    the next check."""
    read = read_budget_file(cfg.budget_file)
    if isinstance(read, str):
        warn(f"budget_file {cfg.budget_file} unreadable ({read}); retrying in {cfg.budget_check_minutes} min")
        return None, None
    spent, projected = read
    if spent > cfg.budget_usd:
        return "budget_file_spent", None
    if projected > cfg.budget_usd:
        return "budget_file_projected", None
    return None, read if spent > BUDGET_WARN * cfg.budget_usd else None


def restore_clock(cfg, state):
    """The guards also count what a killed run spent after its last checkpoint: out_dir/clock.json, which train.py
    writes with every metrics line."""
    path = os.path.join(cfg.out_dir, "clock.json")
    if cfg.resume == "never" or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            clock = json.load(f)
        state.elapsed = max(state.elapsed, float(clock["elapsed"]))
        state.cost_usd = max(state.cost_usd, float(clock["cost_usd"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        warn(f"ignoring {path} ({first_line(e)}): time and cost count from the checkpoint")
