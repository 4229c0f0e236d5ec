"""
The guards train.py's loop calls around a paid run's steps: its clock and spend (Clock: the stop
before max_hours or budget_usd is crossed, budget_file's verdict, wsd's decay), the fire drills
that rehearse a bad batch, a NaN or a slower pod (Drills), and spikes and non-finite steps
(BadSteps), each an event and a post-mortem entry.
"""
import json
import os
import time
from collections import deque

import torch
import torch.distributed as dist

from podgpt.core.schedule import decay_horizon
from podgpt.core.util import first_line, format_seconds, warn
from podgpt.pod.postmortem import POSTMORTEM_STEPS

# the guards keep back the slowest of this many recent steps (their mean let one overshoot)
GUARD_STEPS = 20
# steps an injected spike or NaN lasts (the 50M A100 run's "next 5 batches")
INJECT_STEPS = 5
LOSS_EMA_DECAY = 0.9            # EMA of the loss that spikes are measured against
LIMITS = ("max_hours", "budget_usd", "budget_file_projected", "budget_file_spent")
STOP_REASONS = ("signal", *LIMITS, "throughput_floor", "grad_norm_stop")  # the last: checks.py's


def agree(proc, loss_sum, finite, signal, guard_reason, decay_to=0, save_due=False, stats=None,
          accum=1):
    """One all-reduce per step, so that every rank takes the same decisions: the summed loss and
    stats, any rank's non-finite step or signal, rank 0's guard, decay_to (wsd's horizon from the
    next step; 0: none) and save_due (by its clock). Returns (mean loss over every micro-step,
    finite, stop reason or None, decay_to, save due, mean stats or None)."""
    flags = [not finite, bool(signal), STOP_REASONS.index(guard_reason) + 1 if guard_reason else 0,
             decay_to, bool(save_due)]
    # float64: a horizon is an exact integer in it at any length (float32 stops at 2**24)
    v = torch.cat([loss_sum.double().reshape(1),
                   torch.tensor(flags, device=proc.dev, dtype=torch.float64),
                   *([] if stats is None else [stats.double()])])
    if proc.distributed:
        dist.all_reduce(v)
    v = v.tolist()
    reason = STOP_REASONS[int(v[3]) - 1] if v[3] else ("signal" if v[2] else None)
    n = accum * proc.world
    return (v[0] / n, v[1] == 0, reason, int(v[4]), v[5] > 0,
            None if stats is None else [s / n for s in v[6:]])


class Clock:
    """Wall clock and spend, accrued step by step into the loop's state (startup included), and what
    a stop keeps back: one more step (as slow as the slowest recent one), an evaluation and the
    final save."""

    def __init__(self, state, t_start, budget, schedule, usd_per_s, save_seconds, floor=None):
        self.state, self.budget, self.schedule, self.usd_per_s = state, budget, schedule, usd_per_s
        self.floor, self.warned = floor, False
        # save_seconds: the slowest save's write, estimated until measured
        self.t_last, self.save_seconds = t_start, save_seconds
        self.eval_seconds, self.next_budget_check = 0.0, 0.0
        self.verdict = None  # budget_file's last: (the guard it calls for, spent, projected)
        # pace: (steps done, elapsed) at the recent steps' ends, wsd's projection
        self.step_times, self.pace = deque(maxlen=GUARD_STEPS), deque(maxlen=GUARD_STEPS)

    def tick(self):
        now = time.time()
        self.state.elapsed += now - self.t_last
        self.state.cost_usd += (now - self.t_last) * self.usd_per_s
        self.t_last = now

    def reserve(self, writing):
        """Seconds a stop keeps back; writing: a save in the background, which a stop waits for."""
        slowest = max(self.step_times, default=0.0)
        return slowest + self.eval_seconds + self.save_seconds * (2 if writing else 1)

    def stop_reason(self, writing, event):
        """Rank 0's guard that must stop the run now, or None; event: the loop's (budget_file's)."""
        st, budget = self.state, self.budget
        if limit := budget.crossed(st.elapsed, st.cost_usd, self.reserve(writing), self.usd_per_s):
            return limit
        # the run's own count of the spend warns once a start
        own = self.usd_per_s and budget.budget_usd and not self.warned
        if own and st.cost_usd > budget.warn_at():
            self.warned = True
            event("budget_warning", f"spent ${st.cost_usd:.2f} of budget_usd="
                  f"${budget.budget_usd:.2f}", spent_usd=st.cost_usd)
        if self.floor and (slow := self.floor.judge(st.step, st.elapsed)):
            event("throughput_floor", slow[1], tokens_per_sec=slow[0])
            return "throughput_floor"
        if not budget.budget_file or time.time() < self.next_budget_check:
            return None
        self.next_budget_check = time.time() + budget.check_minutes * 60
        verdict = self.verdict = budget.file_verdict()
        if verdict and not verdict[0] and verdict[1] > budget.warn_at():
            event("budget_warning", f"spent ${verdict[1]:.2f} of budget_usd="
                  f"${budget.budget_usd:.2f} (projected ${verdict[2]:.2f})", spent_usd=verdict[1],
                  projected_total_usd=verdict[2])
        return verdict and verdict[0]

    def unsaved(self, reason):
        """Why a run that `reason` stopped with no checkpoint, and none tried (before the first
        step, or budget_file_spent before the first save), fails; None for a signal: it lost
        nothing."""
        st, budget, fix = self.state, self.budget, reason
        if reason == "signal":
            return None
        ended = f"the run ended at step {st.step} with " + (
            "nothing trained and no checkpoint" if st.step == 0 else "no checkpoint on disk")
        kept = f"{seconds(self.reserve(False))} is kept back for the final save"
        if reason == "max_hours":
            why = (f"max_hours={budget.max_hours:g} ({seconds(budget.max_hours * 3600)}) left no "
                   f"time for a step: {seconds(st.elapsed)} went before it, and {kept}")
        elif reason == "budget_usd":
            why = (f"budget_usd={budget.budget_usd:g} left no money for a step: "
                   f"{dollars(st.cost_usd)} went in the {seconds(st.elapsed)} before it, and the "
                   f"spend of {kept}")
        else:
            spent, projected = self.verdict[1:]
            says = (f"says {dollars(spent)} is spent" if reason == "budget_file_spent" else
                    f"projects {dollars(projected)} in all")
            why = f"budget_file={budget.budget_file} {says}, over budget_usd={budget.budget_usd:g}"
            if st.step:
                why += ", and a run over its budget saves nothing (no checkpoint was due before)"
            fix = "budget_usd (or correct budget_file)"
        return (f"{ended}: {why}; raise {fix}, then run the same command again"
                + " (it starts over)" * bool(st.step))

    def decay_to(self, writing):
        """wsd, rank 0: the horizon to decay to from the next step on, or 0 (decay_horizon)."""
        self.pace.append((self.state.step + 1, self.state.elapsed))  # as the next tick counts it
        return decay_horizon(self.schedule, self.budget, self.state, self.pace,
                             self.reserve(writing), self.usd_per_s)


def two_digits(x):
    """x to 2 significant digits, never in e-notation: 0.00036, 2.1, 1300."""
    return f"{float(f'{x:.2g}'):f}".rstrip("0").rstrip(".")


def seconds(s):
    return f"{two_digits(s)} s" if s < 60 else format_seconds(s)


def dollars(usd):
    return f"${usd:.2f}" if usd >= 1 else f"${two_digits(usd)}"


class Floor:
    """min_tokens_per_sec over the first window_minutes of each start, judged once, timed from its
    second step (the first compiles): a pod slower than the plan burns the budget."""

    def __init__(self, min_tokens_per_sec, window_minutes, batch_tokens):
        self.min, self.window_s, self.batch = min_tokens_per_sec, window_minutes * 60, batch_tokens
        self.marks = []  # (step, elapsed) at the first two steps this start

    def judge(self, step, elapsed):
        """(tokens/s, a message) when the window's rate is under the floor, else None."""
        if not self.min:
            return None
        if len(self.marks) < 2 or step == self.marks[-1][0]:
            if not self.marks or step > self.marks[-1][0]:
                self.marks.append((step, elapsed))
            return None
        (s0, t0), floor = self.marks[-1], self.min
        if elapsed - t0 < self.window_s:
            return None
        self.min = 0  # judged: the rest of the run is the budget's to watch
        rate = (step - s0) * self.batch / (elapsed - t0)
        return None if rate >= floor else (rate, (
            f"{rate:,.0f} tokens/s over steps {s0}..{step} ({elapsed - t0:.0f} s), under "
            f"min_tokens_per_sec={floor:,.0f}: stopped with a checkpoint, to resume on a faster "
            f"pod or with the floor lowered"))


def restore_clock(path, state):
    """What a killed run spent after its last checkpoint, into state, from its clock.json."""
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            clock = json.load(f)
        state.elapsed = max(state.elapsed, float(clock["elapsed"]))
        state.cost_usd = max(state.cost_usd, float(clock["cost_usd"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        warn(f"ignoring {path} ({first_line(e)}): time and cost count from the checkpoint")


class Drills:
    """Fire drills (each -1: off): INJECT_STEPS steps from spike_at train on the rarest tokens, from
    nan_at get a NaN loss on the last rank; from slow_at every step sleeps slow_seconds."""

    def __init__(self, spike_at, nan_at, slow_at, slow_seconds):
        self.spike_at, self.nan_at = spike_at, nan_at
        self.slow_at, self.slow_seconds = slow_at, slow_seconds

    def pick(self, state):
        """(spike, nan) the next step runs; each fires once, even if a rollback replays its step."""
        return self.firing(state, "spike", self.spike_at), self.firing(state, "nan", self.nan_at)

    @staticmethod
    def firing(state, kind, at):
        tag = f"{kind}@{state.step + 1}"  # steps are numbered as logged: the first one is step 1
        if at < 0 or not at <= state.step + 1 < at + INJECT_STEPS or tag in state.injected:
            return False
        state.injected.append(tag)
        return True

    def slow_down(self, step):
        if 0 <= self.slow_at <= step:
            time.sleep(self.slow_seconds)


class BadSteps:
    """Spikes (a loss above spike_factor x the EMA of recent losses) and non-finite steps: each an
    event and, on rank 0, a post-mortem entry; max_bad_steps in a row roll back."""

    def __init__(self, spike_factor, max_bad_steps, max_rollbacks, event, postmortem,
                 write_postmortem):
        self.spike_factor, self.max_bad_steps = spike_factor, max_bad_steps
        self.max_rollbacks, self.event = max_rollbacks, event
        self.postmortem, self.write_postmortem = postmortem, write_postmortem
        self.recent = deque(maxlen=POSTMORTEM_STEPS)  # (step, loss, grad norm, lr) it shows

    def account(self, st, loss, finite, grad_norm, lr, batch, on_disk):
        """Count the step just taken as non-finite or a spike, else fold its loss into the EMA.
        batch(): the step's batch for the post-mortem; on_disk: the newest checkpoint."""
        self.recent.append((st.step, loss, grad_norm, lr))
        spike = finite and st.loss_ema is not None and loss > self.spike_factor * st.loss_ema
        if not finite:
            st.nonfinite_steps += 1
            self.event("nonfinite", f"non-finite loss or gradient (loss {loss}, grad norm "
                       f"{grad_norm.item()}): step skipped on every rank", loss=str(loss),
                       grad_norm=str(grad_norm.item()))
        elif spike:
            st.spikes += 1
            self.event("spike", f"loss {loss:.4f} is {loss / st.loss_ema:.1f}x its recent average "
                       f"{st.loss_ema:.4f}", loss=loss, loss_ema=st.loss_ema)
        else:
            ema, d = st.loss_ema, LOSS_EMA_DECAY
            st.loss_ema = loss if ema is None else d * ema + (1 - d) * loss
        st.bad_in_a_row = 0 if finite and not spike else st.bad_in_a_row + 1
        if (spike or not finite) and self.postmortem:
            kind = "spike" if finite else "nonfinite"
            self.postmortem.add(kind, st, self.recent, batch(), on_disk)
            self.write_postmortem()

    def rollback(self, st, ckpts):
        """Back to the newest good checkpoint at half the learning rate: None, or why it cannot."""
        if st.rollbacks >= self.max_rollbacks:
            return (f"{self.max_bad_steps} bad steps in a row after {st.rollbacks} rollbacks "
                    f"(max_rollbacks={self.max_rollbacks}): the run diverges; lower learning_rate "
                    f"or check the data")
        path, ckpt = ckpts.newest()
        if ckpt is None:
            return (f"{st.bad_in_a_row} bad steps in a row at step {st.step} and no checkpoint to "
                    f"roll back to: lower learning_rate, raise warmup_steps, or check the data")
        keep = dict(elapsed=st.elapsed, cost_usd=st.cost_usd, spikes=st.spikes,
                    nonfinite_steps=st.nonfinite_steps, injected=st.injected,
                    rollbacks=st.rollbacks + 1, lr_scale=st.lr_scale * 0.5)
        bad_at = st.step
        ckpts.restore(ckpt, st)
        vars(st).update(keep, bad_in_a_row=0)
        self.event("rollback", f"{self.max_bad_steps} bad steps in a row up to step {bad_at}: "
                   f"rolled back to {path}, learning rate x {st.lr_scale:g} (rollback "
                   f"{st.rollbacks} of {self.max_rollbacks})", from_step=bad_at,
                   lr_scale=st.lr_scale, rollbacks=st.rollbacks)
        if self.postmortem:
            self.postmortem.rolled_back(st.step, st.lr_scale)
            self.write_postmortem()
        return None
