"""The schedule ends where the money does: budget_usd or max_hours set the horizon (the step the learning rate
reaches min_lr), and lr_schedule=wsd starts its decay when the time or money left at the speed measured so far
covers just the decay, a decision a resume continues bit for bit."""
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY_MODEL, popen, read_metrics, run_script, train_tiny

FAST = ["--micro_batch_size=4", "--total_batch_tokens=256", "--log_every=1", "--min_lr=1e-4"]
# wsd on a pod that slows down at step 20 by 80 ms a step: max_hours (18 s) cannot pay for the 300 steps any more
SLOWED = [*FAST, "--max_steps=300", "--lr_schedule=wsd", "--decay_frac=0.25", "--max_hours=0.005",
          "--inject_slow_at_step=20", "--inject_slow_seconds=0.08", "--eval_every=1000", "--ckpt_every=10"]


def summary_of(out):
    with open(out / "summary.json") as f:
        return json.load(f)


def lrs(out):
    return {m["step"]: m["lr"] for m in read_metrics(out) if "lr" in m and "event" not in m}


def losses(rows):
    return {m["step"]: m["loss"] for m in rows if "loss" in m and "event" not in m}


def test_a_budget_below_max_steps_ends_the_schedule_at_the_fitted_horizon(tmp_path, stdlib_data, capfd):
    """budget_usd pays for fewer steps than max_steps at the planned throughput: the horizon is those steps,
    the cosine ends at min_lr on the last of them, and the run completes there, saying why. On ae53778 the
    budget guard stopped the run mid-schedule, its learning rate far above min_lr."""
    # 2,560 tokens/s planned: 0.1 s a step; $0.002 at $1 an hour pays for 7.2 s of it, startup and a save included
    r = train_tiny(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=1000", "--eval_every=1000", "--budget_usd=0.002",
                   "--usd_per_gpu_hour=1", "--planned_tokens_per_sec=2560")
    s = summary_of(tmp_path)
    assert (s["status"], s["stop_reason"], s["horizon_by"]) == ("completed", "horizon", "budget_usd"), s
    assert 10 < s["steps"] == s["horizon"] < 72 and s["cost_usd"] <= 0.002
    assert f"horizon: budget_usd pays for {s['horizon']} of max_steps=1,000 steps at 2,560 tokens/s" in r.stdout
    assert f"done (horizon: budget_usd pays for {s['horizon']} of max_steps=1,000)" in r.stdout
    lr = lrs(tmp_path)
    assert lr[s["steps"]] == pytest.approx(1e-4, rel=1e-12) and lr[s["steps"] - 1] > 1e-4


def test_without_fit_budget_a_plan_the_budget_cannot_finish_is_a_block(tmp_path, stdlib_data, capfd):
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path / 'out'}", *TINY_MODEL, *FAST,
                    "--max_steps=1000", "--budget_usd=0.002", "--usd_per_gpu_hour=1", "--planned_tokens_per_sec=2560",
                    "--fit_budget=False"], capfd)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: preflight blocks: time_and_cost: 2,560 tokens/s (planned_tokens_per_sec): ")
    assert "budget_usd stops it near step" in line and "or fit_budget=True to end the schedule there" in line


def decay_events(rows):
    """The decay's start, then each time the horizon came closer: (the first, the last)."""
    events = [m for m in rows if m.get("event") == "decay"]
    return events[0], events[-1]


def test_wsd_decays_in_time_when_the_pod_slows_down(tmp_path, stdlib_data, capfd):
    """The planned decay (the last 75 of 300 steps) no longer fits once steps take 80 ms more: the decay starts
    when what max_hours leaves covers just the decay (and ends sooner, from where it has come, when the pace
    drops further), and reaches min_lr before the guard would stop the run."""
    train_tiny(capfd, tmp_path, stdlib_data, *SLOWED)
    s, rows = summary_of(tmp_path), read_metrics(tmp_path)
    start, last = decay_events(rows)
    assert (s["status"], s["stop_reason"], s["horizon_by"]) == ("completed", "horizon", "time or money left"), s
    assert s["steps"] == s["horizon"] == last["horizon"] < 300 and s["decay_start"] == last["step"]
    assert s["elapsed_s"] <= 0.005 * 3600
    lr = lrs(tmp_path)
    assert all(lr[k] == 1e-3 for k in lr if 2 < k <= start["step"])  # flat until the decay
    assert lr[s["steps"]] == pytest.approx(1e-4, rel=1e-12)
    assert all(lr[k] > lr[k + 1] for k in range(start["step"] + 1, s["steps"]))


def test_a_resume_during_the_decay_continues_it_bit_for_bit(tmp_path, stdlib_data):
    """SIGKILL during a decay the slowdown started, then the same command (with more hours, which would not
    start a decay now): the run continues the recorded decay, and every step it trains again repeats the
    killed run's loss exactly."""
    out = tmp_path / "out"
    args = [sys.executable, "train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_MODEL, *SLOWED,
            "--ckpt_every=5"]
    p = popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:  # killed a few steps after a checkpoint inside the decay
            rows = read_metrics(out) if (out / "metrics.jsonl").exists() else []
            decay = [m["step"] for m in rows if m.get("event") == "decay"]
            saved = [m["step"] for m in rows if m.get("event") == "checkpoint"]
            if decay and saved and saved[-1] > decay[0] and max(losses(rows)) >= saved[-1] + 2:
                break
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
    killed = read_metrics(out)
    r = subprocess.run([*args, "--max_hours=1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    resumed_at = int(r.stdout.split("resumed from ")[1].split(" at step ")[1].split()[0])
    # the decay as the checkpoint resumed from recorded it: its newest decision at or before that step
    event = [m for m in killed if m.get("event") == "decay" and m["step"] <= resumed_at][-1]
    s, again = summary_of(out), losses(read_metrics(out))
    assert (s["status"], s["steps"], s["decay_start"]) == ("completed", event["horizon"], event["step"])
    assert lrs(out)[s["steps"]] == pytest.approx(1e-4, rel=1e-12)
    before = losses(killed)
    overlap = [k for k in before if k > resumed_at]  # trained before the kill, and again after the resume
    assert len(overlap) >= 2 and all(again[k] == before[k] for k in overlap), (overlap, again, before)


def test_wsd_under_two_ranks_decays_as_rank_0_decides(tmp_path, stdlib_data, capfd):
    """Rank 0 decides the decay; the step's one all-reduce hands it to every rank: two ranks reach min_lr
    together on the last step (a rank that missed it would train on and hang in the next collective)."""
    train_tiny(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=12", "--lr_schedule=wsd", "--decay_frac=0.5",
               "--eval_every=12", "--total_batch_tokens=512", nproc=2)
    s, (start, _) = summary_of(tmp_path), decay_events(read_metrics(tmp_path))
    assert (s["status"], s["steps"], s["world_size"], start["step"], start["horizon"]) == ("completed", 12, 2, 6, 12)
    assert lrs(tmp_path)[12] == pytest.approx(1e-4, rel=1e-12)
