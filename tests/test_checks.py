"""A run's own checks (podgpt/pod/checks.py): each judged met, missed or not reached from the values a run
measures, the live alarms and the grad norm's stop band; then two tiny runs that judge them at every
evaluation and at the end (summary.json, summary.md, the done line), one of them stopped by its grad norm. The
shipped configs set what their recipes call done."""
import os
import runpy
from types import SimpleNamespace

import pytest

from conftest import ROOT, read_metrics
from conftest import train_tiny as train
from podgpt.pod.checks import Alarm, Checks, check_settings, parse_band
from podgpt.core.util import Error
from test_guards import FAST, assert_stopped_with_checkpoint, events, summary_of

NONE = dict(objective="ar", target_val_loss=None, max_spikes=-1, warn_tokens_per_sec=0.0, min_mfu=0.0,
            grad_norm_band="", grad_norm_stop=0.0, alarm_minutes=0.0, refine_band="")


class Cfg(SimpleNamespace):
    def __getitem__(self, key):
        return getattr(self, key)


def judge(status="completed", val_loss=3.3, spikes=2, speeds=(), grads=(), metrics=None, **keys):
    """Checks of NONE with keys, fed (tokens/s, MFU) log windows and grad norms: ({name: verdict}, events)."""
    seen, st = [], SimpleNamespace(elapsed=0.0)
    checks = Checks(Cfg(**dict(NONE, **keys)), lambda name, message, **fields: seen.append((name, fields)))
    for tok_s, mfu in speeds:
        checks.speed(st, tok_s, mfu)
    for g in grads:
        checks.step(st, g)
    final = checks.final(status, val_loss, spikes, metrics)
    return {c["name"]: c["verdict"] for c in final}, seen


SPEEDS = [(1.0, 0.01), (500.0, 0.40), (700.0, 0.50)]  # the first window (compiling) is left out: 600, 0.45


@pytest.mark.parametrize("keys, met, missed", [
    (dict(target_val_loss="3.20,3.50"), dict(val_loss=3.3), dict(val_loss=3.6)),
    (dict(target_val_loss=3.5), dict(val_loss=3.3), dict(val_loss=3.6)),
    (dict(max_spikes=2), dict(spikes=2), dict(spikes=3)),
    (dict(warn_tokens_per_sec=600.0), dict(speeds=SPEEDS), dict(speeds=SPEEDS[:2])),
    (dict(min_mfu=0.44), dict(speeds=SPEEDS), dict(speeds=SPEEDS[:2])),
    (dict(grad_norm_band="0.5,1.5"), dict(grads=[0.9, 1.2, 30.0]), dict(grads=[0.9, 3.0, 30.0])),
    (dict(grad_norm_stop=20.0), dict(grads=[5.0]), dict(grads=[25.0])),
    (dict(objective="refine", refine_band="15,25"), dict(metrics={"refinement": 20.0}),
     dict(metrics={"refinement": 5.0})),
])
def test_each_check_is_met_or_missed_and_not_reached_until_the_run_completes(keys, met, missed):
    name = {"target_val_loss": "target_val_loss", "max_spikes": "spikes", "warn_tokens_per_sec": "tokens_per_sec",
            "min_mfu": "mfu", "grad_norm_band": "grad_norm", "grad_norm_stop": "grad_norm",
            "refine_band": "refinement"}[[k for k in keys if k != "objective"][0]]
    assert judge(**keys, **met)[0] == {name: "met"}
    assert judge(**keys, **missed)[0] == {name: "missed"}
    assert judge(**keys, **met, status="stopped")[0] == {name: "not reached"}
    if not {"val_loss", "spikes"} & set(met):  # measured by the run: nothing measured, nothing reached
        assert judge(**keys)[0] == {name: "not reached"}
    assert judge()[0] == {}  # no check set: none judged


def test_a_miss_that_cannot_be_undone_stays_missed_when_the_run_stops():
    """Spikes over the allowance are missed on a stopped run too (no later step takes one back), and so is the
    grad norm that stopped it; a loss band is not reached."""
    verdicts, seen = judge(status="stopped", spikes=3, val_loss=9.0, grads=[25.0], max_spikes=2,
                           target_val_loss="3.2,3.5", grad_norm_stop=20.0)
    assert verdicts == {"spikes": "missed", "target_val_loss": "not reached", "grad_norm": "missed"}
    assert [name for name, _ in seen] == ["grad_norm_stop"] and seen[0][1]["grad_norm"] == 25.0


def test_alarms_fire_once_after_their_minutes_and_rearm():
    alarm = Alarm(minutes=1.0)
    assert [alarm.holds(b, t) for b, t in [(True, 0.0), (True, 59.0), (True, 60.0), (True, 200.0), (False, 201.0),
                                           (True, 300.0), (True, 360.0)]] == [False, False, True, False, False,
                                                                              False, True]
    # the grad norm outside its healthy band: an alarm, no stop; the median of the last 20 steps is judged
    verdicts, seen = judge(grads=[1.0] * 3 + [9.0] * 4, grad_norm_band="0.5,1.5")
    assert verdicts == {"grad_norm": "missed"} and seen == [("alarm", dict(check="grad_norm", value=5.0))]
    _, seen = judge(speeds=SPEEDS, warn_tokens_per_sec=650.0, min_mfu=0.3)
    assert seen == [("alarm", dict(check="tokens_per_sec", value=500.0))]


def test_a_band_that_cannot_be_judged_is_refused():
    assert parse_band("k", "0.5,1.5") == (0.5, 1.5) and parse_band("k", (15, 25)) == (15.0, 25.0)
    for bad in ("1.5,0.5", "1", "a,b", "1,2,3"):
        with pytest.raises(ValueError, match="is not a band"):
            parse_band("grad_norm_band", bad)
    for keys in (dict(grad_norm_band="2,1"), dict(min_mfu=-0.1), dict(objective="refine", refine_band="25")):
        with pytest.raises(Error) as e:
            check_settings(Cfg(**dict(NONE, **keys)))
        assert e.value.code == 2


def test_a_run_judges_its_checks_at_each_evaluation_and_at_the_end(tmp_path, stdlib_data, capfd):
    """A tiny run with a target band it cannot reach, a spike allowance it keeps, a tokens/s floor no CPU reaches
    (an alarm at once: alarm_minutes=0) and a grad-norm band that holds any norm."""
    out = tmp_path / "out"
    r = train(capfd, out, stdlib_data, *FAST, "--max_steps=12", "--eval_every=6", "--log_every=2",
              "--target_val_loss=0.01,0.02", "--max_spikes=100", "--warn_tokens_per_sec=1e12", "--alarm_minutes=0",
              "--grad_norm_band=1e-9,1e9")
    want = {"target_val_loss": "missed", "spikes": "met", "tokens_per_sec": "missed", "grad_norm": "met"}
    checks = summary_of(out)["checks"]
    assert {c["name"]: c["verdict"] for c in checks} == want
    assert {c["name"]: c["band"] for c in checks} == {"target_val_loss": [0.01, 0.02], "spikes": [None, 100],
                                                      "tokens_per_sec": [1e12, None], "grad_norm": [1e-9, 1e9]}
    assert all(isinstance(c["value"], (int, float)) for c in checks)
    assert len([line for line in r.stdout.splitlines() if line.startswith("checks: target_val_loss")]) == 2
    done = [line for line in r.stdout.splitlines() if line.startswith("done (")][0]
    assert "| checks: spikes met, tokens_per_sec missed, grad_norm met | target_val_loss 0.01 to 0.02: missed |" \
        in done  # the target as the line said it before the checks
    (alarm,) = events(out, "alarm")  # once: the floor stays crossed, so it never re-arms
    assert alarm["check"] == "tokens_per_sec" and "under 1e+12 for 0 minutes" in r.stderr
    assert [e["check"] for e in events(out, "check_missed")] == ["target_val_loss", "tokens_per_sec"]
    assert "step 6: tokens_per_sec " in r.stderr and "misses its band, at least 1e+12" in r.stderr
    md = (out / "summary.md").read_text()
    assert "| target_val_loss | 0.01 to 0.02 |" in md and "| tokens_per_sec | at least 1e+12 |" in md
    assert "| spikes | at most 100 |" in md and md.count("**met**") == 2


def test_a_refine_run_whose_grad_norm_is_in_the_stop_band_stops_with_a_checkpoint_and_the_reason(
        tmp_path, stdlib_data, capfd):
    """grad_norm_stop far under what the tiny refine run's grad norm is: the run stops with a checkpoint of its
    last step after the step that crossed it, on one line saying why, as a guard stops it."""
    out = tmp_path / "out"
    r = train(capfd, out, stdlib_data, *FAST, "--objective=refine", "--n_sup_train=2", "--n_sup_inference=2",
              "--max_steps=50", "--eval_every=4", "--log_every=1", "--grad_norm_stop=1e-6", "--refine_band=15,25")
    summary = assert_stopped_with_checkpoint(out, "grad_norm_stop")
    assert summary["steps"] == 2  # step 1 crossed it; the ranks agree to stop at the next step's end
    (event,) = events(out, "grad_norm_stop")
    assert event["grad_norm"] > 1e-6 and "over grad_norm_stop=1e-06: stopped with a checkpoint" in r.stderr
    assert {c["name"]: c["verdict"] for c in summary["checks"]} == {"grad_norm": "missed",
                                                                      "refinement": "not reached"}
    stopped = [line for line in r.stdout.splitlines() if line.startswith("stopped at step 2 (grad_norm_stop)")]
    assert len(stopped) == 1 and "checks: grad_norm missed, refinement not reached" in stopped[0]
    assert [m["step"] for m in read_metrics(out) if "loss" in m and "event" not in m] == [1, 2]


CONFIG_CHECKS = {  # each shipped config's checks, as its recipe gives them (the report's table)
    "a100_50m": dict(target_val_loss="3.20,3.50", max_spikes=5, min_mfu=0.30),
    "h100_trm_fast": dict(refine_band="15,25", grad_norm_band="0.5,1.5", grad_norm_stop=20.0),
    "h100_trm_extreme": dict(refine_band="50,97", grad_norm_band="2,15", grad_norm_stop=20.0),
    "h100_d64": dict(warn_tokens_per_sec=10800.0, min_mfu=0.15),
    "h200_1b_ddp8": dict(max_spikes=1),
    "h200_gsm8k_bd3lm": dict(warn_tokens_per_sec=202272.0),
    "h200_hdp_diffusion": dict(warn_tokens_per_sec=202272.0),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CHECKS))
def test_each_shipped_config_sets_the_checks_its_recipe_gives(name):
    keys = runpy.run_path(os.path.join(ROOT, "config", f"{name}.py"))
    assert {k: keys[k] for k in CONFIG_CHECKS[name]} == CONFIG_CHECKS[name]
    check_settings(Cfg(**dict(NONE, **{k: keys[k] for k in [*NONE, *CONFIG_CHECKS[name]] if k in keys})))
