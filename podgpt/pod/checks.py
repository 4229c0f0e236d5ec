"""
A run's own checks: what its recipe calls done, set in its config (target_val_loss, max_spikes,
warn_tokens_per_sec, min_mfu, grad_norm_band, and an objective's own, such as refine's
refine_band), each judged at every evaluation and at the end into summary.json's `checks`: a list
of {name, band, value, verdict}, the verdict met, missed or not reached. Live alarms: tokens/s or
MFU under its floor, or the grad norm out of its band, for alarm_minutes is an `alarm` event; the
grad norm in its stop band (grad_norm_stop) stops the run with a checkpoint, as a guard does.
"""
import math
import statistics
from collections import deque

from podgpt.core.util import fail, log
from podgpt.pod.objectives import objective_checks
from podgpt.pod.preflight import target_band
from podgpt.pod.report import band_text

# the grad norm judged is the median of this many recent steps: one spike the clip absorbs is none
GRAD_STEPS = 20
STOP_REASON = "grad_norm_stop"  # guards.STOP_REASONS carries it to every rank


def parse_band(key, value):
    """A "lo,hi" band (lo < hi, both finite) as (lo, hi); None for "" or None; ValueError else."""
    if value is None or value == "":
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        lo, hi = (float(p) for p in parts)
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{key}={value!r} is not a band: give \"lo,hi\" with lo < hi")
    return lo, hi


def check_settings(cfg):
    """Refuse (exit 2) a check's setting that cannot be judged."""
    for key in ("min_mfu", "warn_tokens_per_sec", "grad_norm_stop", "alarm_minutes"):
        if cfg[key] < 0:
            fail(f"{key}={cfg[key]} must be >= 0", 2)
    try:
        parse_band("grad_norm_band", cfg.grad_norm_band)
        for name, band, _ in objective_checks(cfg):
            parse_band(name, band)
    except ValueError as e:
        fail(str(e), 2)


def verdict(band, value):
    """met when value lies within band (lo or hi None: open), missed outside, not reached: None."""
    if value is None or not math.isfinite(value):
        return "not reached"
    lo, hi = band
    return "met" if (lo is None or lo <= value) and (hi is None or value <= hi) else "missed"


class Alarm:
    """A condition held `minutes` on end by the run's clock fires once; it re-arms once clear."""

    def __init__(self, minutes):
        self.seconds, self.since, self.fired = minutes * 60, None, False

    def holds(self, breached, elapsed):
        """True when the condition has just held for the whole duration."""
        if not breached:
            self.since, self.fired = None, False
            return False
        self.since = elapsed if self.since is None else self.since
        if self.fired or elapsed - self.since < self.seconds:
            return False
        self.fired = True
        return True


class Checks:
    """The checks cfg sets (rank 0 judges; event(name, message, **fields) is the loop's)."""

    def __init__(self, cfg, event):
        self.event, self.stop = event, None
        bands = dict(target_val_loss=target_band(cfg.target_val_loss),
                     spikes=(None, cfg.max_spikes) if cfg.max_spikes >= 0 else None,
                     tokens_per_sec=(cfg.warn_tokens_per_sec, None) if cfg.warn_tokens_per_sec
                     else None,
                     mfu=(cfg.min_mfu, None) if cfg.min_mfu else None,
                     # the healthy band, or else the stop band's edge
                     grad_norm=parse_band("grad_norm_band", cfg.grad_norm_band) or (
                         (None, cfg.grad_norm_stop) if cfg.grad_norm_stop else None))
        # an objective's own: (name, its "lo,hi", the metric of its validation stats judged)
        own = objective_checks(cfg)
        self.metric = {name: key for name, _, key in own}
        bands.update((name, parse_band(name, band)) for name, band, _ in own)
        self.bands = {name: band for name, band in bands.items() if band}
        self.grad_stop, self.grads = cfg.grad_norm_stop, deque(maxlen=GRAD_STEPS)
        self.alarms = {name: Alarm(cfg.alarm_minutes) for name in ("tokens_per_sec", "mfu",
                                                                   "grad_norm")}
        self.speeds = {"tokens_per_sec": [], "mfu": []}  # this start's log windows, the first left
        self.missed, self.windows = set(), 0  # missed at the last evaluation; log windows seen

    def step(self, st, grad_norm):
        """After each step: the grad norm's alarm, and its stop band (stop_reason() from then).
        grad_norm: a number or tensor, read (a device sync) only when a grad-norm check is set."""
        if "grad_norm" not in self.bands or not math.isfinite(grad_norm := float(grad_norm)):
            return
        self.grads.append(grad_norm)
        median = statistics.median(self.grads)
        if self.grad_stop and median > self.grad_stop and not self.stop:
            self.stop = STOP_REASON
            self.event(STOP_REASON, f"grad norm {median:.3g} (median of the last {len(self.grads)} "
                       f"steps) is over grad_norm_stop={self.grad_stop:g}: stopped with a "
                       f"checkpoint; lower learning_rate, or check the data", grad_norm=median)
        else:
            self.alarm("grad_norm", verdict(self.bands["grad_norm"], median) == "missed", median,
                       st.elapsed)

    def speed(self, st, tokens_per_sec, mfu):
        """After each log line: the floors' alarms. The start's first window (it compiles) is left
        out."""
        self.windows += 1
        for name, value in (("tokens_per_sec", tokens_per_sec), ("mfu", mfu)):
            if name not in self.bands or value is None or self.windows == 1:
                continue
            self.speeds[name].append(value)
            self.alarm(name, value < self.bands[name][0], value, st.elapsed)

    def alarm(self, name, breached, value, elapsed):
        if self.alarms[name].holds(breached, elapsed):
            lo, hi = self.bands[name]
            where = f"under {lo:g}" if hi is None else f"outside {lo:g} to {hi:g}"
            minutes = self.alarms[name].seconds / 60
            self.event("alarm", f"{name} {value:.4g} {where} for {minutes:g} minutes "
                       f"(alarm_minutes)", check=name, value=value)

    def stop_reason(self):
        return self.stop

    def values(self, val_loss, spikes, metrics):
        """Each check's value now; metrics: the objective's of the last evaluation (no prefix)."""
        speeds = {k: sum(v) / len(v) if v else None for k, v in self.speeds.items()}
        found = dict(target_val_loss=val_loss, spikes=spikes,
                     grad_norm=statistics.median(self.grads) if self.grads else None, **speeds)
        found.update((name, (metrics or {}).get(key)) for name, key in self.metric.items())
        return found

    def judge(self, val_loss, spikes, metrics):
        """At an evaluation: [{name, band, value, verdict}] of the values now, a console line, and
        an event for each check missed that was not at the evaluation before."""
        judged = self.judged(self.values(val_loss, spikes, metrics), completed=True)
        if not judged:
            return judged
        log("checks: " + " | ".join(f"{c['name']} {shown(c['value'])} {c['verdict']}"
                                    for c in judged), flush=True)
        for c in judged:
            if c["verdict"] == "missed" and c["name"] not in self.missed:
                self.event("check_missed", f"{c['name']} {shown(c['value'])} misses its band, "
                           f"{band_text(c['band'])}", check=c["name"], value=c["value"])
        self.missed = {c["name"] for c in judged if c["verdict"] == "missed"}
        return judged

    def final(self, status, val_loss, spikes, metrics):
        """summary.json's checks: a run that did not complete reaches none but the misses that stay
        missed (spikes over the allowance, the grad norm that stopped it)."""
        return self.judged(self.values(val_loss, spikes, metrics), status == "completed")

    def judged(self, values, completed):
        found = []
        for name, band in self.bands.items():
            value, sticky = values[name], name == "spikes" or (name == "grad_norm" and self.stop)
            v = verdict(band, value)
            if not completed and not (sticky and v == "missed"):
                v = "not reached"
            found.append(dict(name=name, band=list(band), value=value, verdict=v))
        return found


def shown(value):
    return "-" if value is None else f"{value:.4g}"
