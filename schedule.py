"""
The learning-rate schedule, and the time and money left to it. train.py asks these at every step.

The schedule ends at its horizon: max_steps, or fewer where max_hours or budget_usd pay for fewer
(preflight.fit_horizon). lr_at: linear warmup, then cosine to min_lr at the horizon; or wsd, flat at learning_rate,
then linear to min_lr over the horizon's last decay_frac. wsd's decay starts sooner, or ends sooner, when the time or
money left pays for no more than the decay at the pace of the recent steps (decay_horizon). The guards stop a run
before a limit is crossed (over_limit), keeping back what a stop still needs: one more step, an evaluation and the
final save (the reserve, in seconds).
"""
import json
import math
import os

from util import first_line, warn


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


def seconds_left(cfg, st, reserve, usd_per_s):
    """{limit: seconds}: what max_hours and budget_usd (each where set) leave of the run's time, after st.elapsed
    and st.cost_usd so far and keeping back `reserve` seconds; usd_per_s: the run's spend per second."""
    left = {}
    if cfg.max_hours:
        left["max_hours"] = cfg.max_hours * 3600 - st.elapsed - reserve
    if cfg.budget_usd and cfg.usd_per_gpu_hour:
        left["budget_usd"] = (cfg.budget_usd - st.cost_usd) / usd_per_s - reserve
    return left


def over_limit(cfg, st, reserve, usd_per_s):
    """The guard, max_hours or budget_usd, whose limit the reserve would cross now; None."""
    return next((limit for limit, s in seconds_left(cfg, st, reserve, usd_per_s).items() if s < 0), None)


def decay_horizon(cfg, st, pace, reserve, usd_per_s):
    """wsd: the horizon to decay to from the next step on, when the decay should start (or, already decaying, end
    sooner) now; 0 otherwise. It starts decay_frac of the horizon before its end, or sooner when the time or money
    left pays for no more than the decay at the pace of the recent steps (saves, evaluations and all: pace holds
    their (steps done, elapsed) at each end); a decay the money can no longer finish ends sooner, from where it has
    come."""
    if cfg.lr_schedule != "wsd" or st.step + 1 < cfg.warmup_steps or len(pace) < 2:
        return 0
    decay = max(1, round(cfg.decay_frac * st.horizon))
    if st.decay_start < 0 and st.horizon - (st.step + 1) <= decay:
        return st.horizon
    (s0, t0), (s1, t1) = pace[0], pace[-1]
    step_s = (t1 - t0) / (s1 - s0)
    # the guard's reserve, and a step to spare: the horizon comes before the guard
    left = seconds_left(cfg, st, reserve + step_s, usd_per_s)
    if not left:
        return 0
    end = st.step + 1 + max(1, int(min(left.values()) / step_s))
    if st.decay_start < 0:
        return end if end - (st.step + 1) <= decay else 0
    return end if end < st.horizon else 0


def restore_clock(cfg, state):
    """The guards also count what a killed run spent after its last checkpoint (out_dir/clock.json, which train.py
    writes with every metrics line)."""
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


def read_budget_file(path):
    """(spent_usd, projected_total_usd) from the budget file, or the reason it cannot be read."""
    try:
        with open(path) as f:
            b = json.load(f)
        return float(b["spent_usd"]), float(b.get("projected_total_usd", b["spent_usd"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return first_line(e)
