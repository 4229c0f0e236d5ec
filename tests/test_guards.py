"""train.py's guards, end to end on the tiny model: the time and budget limits (max_hours, budget_usd,
budget_file), the loss-spike and NaN fire drills and the post-mortem of a spike (and its replay), rollback at
half the learning rate, early stopping with the best checkpoint, the free-disk check before a checkpoint, and
checkpoints by the clock.

Every test runs train.py as a user would and judges it only by what the run leaves behind: its exit
code, stdout/stderr, metrics.jsonl, summary.json and ckpt/. A run goes on while the test watches it
(budget_file written from outside) or on 2 ranks as a subprocess, any other as its main in this
process (conftest.run_script: no torch import per run).
"""
import json
import math
import os
import shlex
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from podgpt.core import data
from podgpt.pod.checkpoints import load_model
from conftest import ROOT, TINY_MODEL, Captured, popen, read_metrics, run_script, train_losses
from conftest import train_tiny as train

# ~125 steps/s on one CPU core: guards with limits of seconds stop a run a few hundred steps in
FAST = ["--micro_batch_size=4", "--total_batch_tokens=256"]
# no evaluation or periodic checkpoint before a guard stops the run: the final save is the run's first,
# so the guard has to reserve time for it without having measured one
NO_SAVE_BEFORE_STOP = ["--max_steps=1000000", "--eval_every=1000000", "--ckpt_every=1000000", "--log_every=10"]


def start(tmp, out, data, *args):
    """train.py in the background (stdout/stderr to files, so a chatty run never blocks on a full pipe)."""
    stdout, stderr = open(tmp / "stdout.txt", "w"), open(tmp / "stderr.txt", "w")
    proc = popen([sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={out}", *TINY_MODEL, *args],
                 cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
    stdout.close(), stderr.close()
    return proc


def finish(proc, tmp, timeout=60):
    """Wait for a background run (killed if it outlives timeout); (exit code, stdout, stderr)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the run did not exit within {timeout} s\n{(tmp / 'stderr.txt').read_text()[-2000:]}")
    return proc.returncode, (tmp / "stdout.txt").read_text(), (tmp / "stderr.txt").read_text()


def wait_for(condition, proc, tmp, what, timeout=60):
    """Poll until condition() holds while the run is alive; fail with the run's output otherwise."""
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None or time.time() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            stdout, stderr = (tmp / "stdout.txt").read_text(), (tmp / "stderr.txt").read_text()
            raise AssertionError(f"never saw {what} (exit {proc.returncode})\n{stdout[-2000:]}\n{stderr[-2000:]}")
        time.sleep(0.02)


def live_metrics(out):
    """metrics.jsonl of a run still writing it: complete lines only."""
    try:
        with open(out / "metrics.jsonl") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def last_step(out):
    return max((m["step"] for m in live_metrics(out) if "loss" in m and "event" not in m), default=0)


def write_budget(path, spent, projected):
    """Update the budget file the way an outside process must: a new file renamed over the old one."""
    with open(f"{path}.tmp", "w") as f:
        json.dump({"spent_usd": spent, "projected_total_usd": projected}, f)
    os.replace(f"{path}.tmp", path)


def summary_of(out):
    with open(out / "summary.json") as f:
        return json.load(f)


def step_folders(out):
    return sorted(int(d[len("step_"):]) for d in os.listdir(out / "ckpt") if d.startswith("step_"))


def events(out, name):
    return [m for m in read_metrics(out) if m.get("event") == name]


def errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_stopped_with_checkpoint(out, reason):
    """A guard stop: status "stopped", the reason, and a complete checkpoint of the very last step."""
    summary = summary_of(out)
    assert summary["status"] == "stopped" and summary["stop_reason"] == reason, summary
    assert summary["steps"] > 0
    name = f"step_{summary['steps']:07d}"
    assert (out / "ckpt" / "latest").read_text() == name
    assert (out / "ckpt" / name / "complete.json").exists()
    assert summary["checkpoint"] == str(out / "ckpt" / name)
    assert not [d for d in os.listdir(out / "ckpt") if d.startswith(".tmp-")]
    return summary


def load_weights(folder):
    """A checkpoint's weights: model.pt, or the state/ that several ranks write together."""
    return load_model(str(folder))[0].state_dict()


# -----------------------------------------------------------------------------
# 1. time and money


def test_max_hours_stops_before_the_limit_then_a_resume_trains_nothing(tmp_path, stdlib_data, capfd):
    """max_hours=0.003 (10.8 s, startup included: the first step ends 2.6 s after the start on an idle
    2-core CPU, and more than 3.6 s after it while other tests load the CPU): the run stops by itself,
    saves the step it reached and exits 0, with the time it took (final save included) still within
    the limit. The same command again finds the limit used up (the time is carried in the checkpoint):
    it trains no step and says so."""
    limit = 0.003 * 3600
    # an optimistic plan: the horizon stays max_steps, and the guard is what stops the run
    args = [*FAST, *NO_SAVE_BEFORE_STOP, "--max_hours=0.003", "--planned_tokens_per_sec=1e12"]
    r = train(capfd, tmp_path, stdlib_data, *args)
    summary = assert_stopped_with_checkpoint(tmp_path, "max_hours")
    assert "stopped at step" in r.stdout and "(max_hours)" in r.stdout
    assert summary["steps"] > 20  # it did train until close to the limit
    assert 0.5 * limit < summary["elapsed_s"] <= limit, summary["elapsed_s"]
    assert summary["cost_usd"] == 0  # no price set

    steps, folders = summary["steps"], step_folders(tmp_path)
    r = train(capfd, tmp_path, stdlib_data, *args)
    assert f"not training: max_hours already reached at step {steps}" in r.stdout
    again = summary_of(tmp_path)
    assert again["status"] == "stopped" and again["stop_reason"] == "max_hours" and again["steps"] == steps
    assert step_folders(tmp_path) == folders  # nothing new saved
    assert last_step(tmp_path) <= steps


def test_max_hours_keeps_back_the_slowest_recent_step():
    """The guard (guards.Clock) on its own: with 1 s left, an evaluation and a save of 0.25 s each, and 19 steps of
    0.1 s behind one of 0.9 s (a loaded machine), it stops now: the slowest step would cross the limit, which their
    average (0.14 s) would not. Once that step is older than the last GUARD_STEPS, the fast ones decide again."""
    from podgpt.core.schedule import Budget
    from podgpt.pod.guards import Clock
    state = SimpleNamespace(elapsed=3600 - 1.0, cost_usd=0.0)
    clock = Clock(state, time.time(), Budget(max_hours=1.0), None, 0.0, save_seconds=0.25)
    clock.eval_seconds = 0.25
    clock.step_times.extend([0.9] + [0.1] * 19)
    assert clock.stop_reason(False, None) == "max_hours"
    clock.step_times.append(0.1)
    assert clock.stop_reason(False, None) is None


def test_budget_usd_stops_before_the_spend_crosses_the_cap(tmp_path, stdlib_data, capfd):
    """budget_usd=10 at usd_per_gpu_hour=3600 (one dollar per second of one process; $10 leaves seconds
    of training after the start (see above), whatever the guard reserves for its final save): the run
    stops, saves and exits 0 having spent no more than $10, final save included."""
    # an optimistic plan: the horizon stays max_steps, and the guard is what stops the run
    r = train(capfd, tmp_path, stdlib_data, *FAST, *NO_SAVE_BEFORE_STOP, "--budget_usd=10", "--usd_per_gpu_hour=3600",
              "--planned_tokens_per_sec=1e12")
    summary = assert_stopped_with_checkpoint(tmp_path, "budget_usd")
    assert "(budget_usd)" in r.stdout
    assert summary["steps"] > 10
    assert summary["cost_usd"] == pytest.approx(summary["elapsed_s"], rel=1e-9)  # $1/s, world size 1
    assert 5.0 < summary["cost_usd"] <= 10.0, summary["cost_usd"]


def test_budget_file_warns_then_stops_on_the_projection(tmp_path, stdlib_data):
    """budget_file, read every budget_check_minutes (here every 30 ms) while the run goes on:
    (a) spend above 85% of budget_usd with the projection under it: a "budget_warning" event in
    metrics.jsonl and a warning on stderr, and training continues;
    (b) a projected total above budget_usd: checkpoint, exit 0, stop_reason budget_file_projected."""
    budget, out = tmp_path / "budget.json", tmp_path / "out"
    write_budget(budget, 1.0, 5.0)
    proc = start(tmp_path, out, stdlib_data, *FAST, "--max_steps=1000000", "--log_every=1", "--budget_usd=10",
                 f"--budget_file={budget}", "--budget_check_minutes=0.0005")
    try:
        wait_for(lambda: last_step(out) >= 5, proc, tmp_path, "5 steps")
        assert not [m for m in live_metrics(out) if m.get("event") == "budget_warning"]  # 10% spent: quiet
        write_budget(budget, 9.0, 9.5)
        wait_for(lambda: any(m.get("event") == "budget_warning" for m in live_metrics(out)), proc, tmp_path,
                 "a budget_warning event")
        warned_at = min(m["step"] for m in live_metrics(out) if m.get("event") == "budget_warning")
        wait_for(lambda: last_step(out) >= warned_at + 10, proc, tmp_path, "training go on after the warning")
        write_budget(budget, 9.0, 12.0)
    finally:
        rc, stdout, stderr = finish(proc, tmp_path)
    assert rc == 0, stderr[-3000:]
    warning = next(m for m in read_metrics(out) if m.get("event") == "budget_warning")
    assert warning["spent_usd"] == 9.0 and warning["projected_total_usd"] == 9.5
    assert "warning: step" in stderr and "spent $9.00 of budget_usd=$10.00 (projected $9.50)" in stderr
    summary = assert_stopped_with_checkpoint(out, "budget_file_projected")
    assert summary["steps"] > warned_at + 10
    assert "(budget_file_projected)" in stdout


def test_budget_file_spent_over_the_cap_stops_at_once_without_saving(tmp_path, stdlib_data):
    """budget_file reporting a spend already above budget_usd: the run exits 0 at the next check and
    writes no checkpoint (not one more byte or second); summary.json says budget_file_spent, and its
    newest checkpoint is the last periodic one, older than the step the run stopped at."""
    budget, out = tmp_path / "budget.json", tmp_path / "out"
    write_budget(budget, 0.0, 0.0)
    proc = start(tmp_path, out, stdlib_data, *FAST, "--max_steps=1000000", "--log_every=1", "--ckpt_every=20",
                 "--budget_usd=10", f"--budget_file={budget}", "--budget_check_minutes=0.0005")
    try:
        wait_for(lambda: (out / "ckpt" / "latest").exists(), proc, tmp_path, "a first checkpoint")
        write_budget(budget, 11.0, 11.0)
        written_at = max(m["elapsed"] for m in live_metrics(out) if "loss" in m)  # the run's clock (log_every=1)
    finally:
        rc, stdout, stderr = finish(proc, tmp_path)
    assert rc == 0, stderr[-3000:]
    summary = summary_of(out)
    # "at once" on the run's own clock, which a loaded machine slows with everything else: the file is
    # read every 30 ms, so the run ends within a step or two of the write, not at a later checkpoint
    assert summary["elapsed_s"] - written_at < 2, (summary["elapsed_s"], written_at)
    assert summary["status"] == "stopped" and summary["stop_reason"] == "budget_file_spent", summary
    newest = step_folders(out)[-1]
    assert newest < summary["steps"]  # the step it stopped at was not saved
    assert (out / "ckpt" / "latest").read_text() == f"step_{newest:07d}"
    assert summary["checkpoint"] == str(out / "ckpt" / f"step_{newest:07d}")
    assert not [d for d in os.listdir(out / "ckpt") if d.startswith(".tmp-")]
    assert "no checkpoint written" in stdout


def test_budget_file_missing_at_start(tmp_path, stdlib_data, capfd):
    """A budget_file that does not exist is refused before anything runs: one error line, exit 1."""
    r = train(capfd, tmp_path / "out", stdlib_data, "--max_steps=5", "--budget_usd=10",
              f"--budget_file={tmp_path / 'nope.json'}", check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(errors(r.stderr)) == 1 and "nope.json does not exist" in errors(r.stderr)[0], r.stderr
    assert not (tmp_path / "out" / "ckpt").exists()


def test_the_throughput_floor_is_judged_once_over_the_first_window_from_the_second_step():
    """guards.Floor on its own: the window starts at the second step of a start (the first compiles), the
    rate is the steps since then over the time since then, judged once when the window has passed."""
    from podgpt.pod.guards import Floor
    floor = Floor(1000.0, 1.0, batch_tokens=100)  # 1,000 tokens/s over 60 s
    assert floor.judge(7, 0.0) is None and floor.judge(7, 30.0) is None  # before the loop, the first step
    assert floor.judge(8, 40.0) is None  # the second step: the window opens here
    assert floor.judge(400, 99.0) is None  # 59 s in: not yet
    rate, why = floor.judge(500, 100.0)  # 492 steps x 100 tokens in 60 s
    assert rate == pytest.approx(492 * 100 / 60) and "under min_tokens_per_sec=1,000" in why
    assert floor.judge(900, 500.0) is None  # judged once
    fast = Floor(1000.0, 1.0, batch_tokens=100)
    assert [fast.judge(s, t) for s, t in ((0, 0.0), (1, 5.0), (700, 65.0), (701, 66.0))] == [None] * 4
    assert Floor(0.0, 1.0, 100).judge(1, 1e9) is None  # no floor


def test_a_slow_first_window_stops_with_a_checkpoint_and_a_lowered_floor_resumes_bit_identically(
        tmp_path, stdlib_data, capfd):
    """min_tokens_per_sec far above what this CPU does, over a window of 12 ms: the run stops after that
    window with a checkpoint, the reason in summary.json and a throughput_floor event with the measured rate;
    the same command with the floor lowered goes on to max_steps, and its weights are bit-identical to a run
    never stopped."""
    steps = ["--max_steps=12", "--eval_every=6", "--ckpt_every=6", "--log_every=1", "--planned_tokens_per_sec=1e12"]
    out, ref = tmp_path / "out", tmp_path / "ref"
    r = train(capfd, out, stdlib_data, *FAST, *steps, "--min_tokens_per_sec=1e12", "--floor_window_minutes=0.0002")
    summary = assert_stopped_with_checkpoint(out, "throughput_floor")
    assert summary["steps"] < 12 and "(throughput_floor)" in r.stdout
    (event,) = events(out, "throughput_floor")
    assert 0 < event["tokens_per_sec"] < 1e12 and "under min_tokens_per_sec=1,000,000,000,000" in r.stderr
    train(capfd, out, stdlib_data, *FAST, *steps, "--min_tokens_per_sec=0")
    train(capfd, ref, stdlib_data, *FAST, *steps)
    assert summary_of(out)["steps"] == summary_of(ref)["steps"] == 12
    a, b = load_weights(out / "ckpt" / "step_0000012"), load_weights(ref / "ckpt" / "step_0000012")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_spend_counts_the_disk_and_fixed_charges_and_warns_once_past_budget_warn_usd():
    """Budget counts the disk by the hour (1/730 of its GB-month price) and usd_fixed from the start; the
    rate guard warns once when the run's own count passes budget_warn_usd (85% of the cap when unset)."""
    from podgpt.core.schedule import Budget
    from podgpt.pod.guards import Clock
    budget = Budget(budget_usd=35.0, usd_per_gpu_hour=1.10, usd_fixed=1.0, storage_gb=200.0,
                    usd_per_gb_month=0.30, warn_usd=30.0)
    assert budget.usd_per_s(1) * 3600 == pytest.approx(1.10 + 200 * 0.30 / 730)
    rows = {line: usd for line, _, usd in budget.lines(24.0, 1, "A100")}
    assert rows == pytest.approx(dict(GPU=26.4, storage=200 * 0.30 * 24 / 730, fixed=1.0,
                                      total=27.4 + 200 * 0.30 * 24 / 730))
    assert Budget(budget_usd=35.0).warn_at() == pytest.approx(29.75)
    state, seen = SimpleNamespace(elapsed=0.0, cost_usd=29.0, step=0), []
    clock = Clock(state, time.time(), budget, None, budget.usd_per_s(1), save_seconds=0.1)
    assert clock.stop_reason(False, lambda *a, **k: seen.append(k)) is None and seen == []
    state.cost_usd = 30.5
    for _ in range(3):
        assert clock.stop_reason(False, lambda *a, **k: seen.append(k)) is None
    assert seen == [dict(spent_usd=30.5)]


# -----------------------------------------------------------------------------
# 2. loss spikes


def test_spike_drill_is_detected_and_counted(tmp_path, stdlib_data, capfd):
    """inject_spike_at_step=100: steps 100..104 train on batches of the rarest tokens. At
    learning_rate=1e-2 the model has learned the common tokens by then, so those batches cost ~3x the
    recent average loss: above spike_factor=2.5, each is logged as a "spike" and counted, measured
    against the average from before the drill (a spike does not feed the average), and the run
    completes normally."""
    train(capfd, tmp_path, stdlib_data, *FAST, "--learning_rate=1e-2", "--max_steps=150", "--inject_spike_at_step=100",
          "--log_every=1")
    assert [e["step"] for e in events(tmp_path, "drill")] == [100, 101, 102, 103, 104]
    assert all(e["drill"] == "spike" for e in events(tmp_path, "drill"))
    spikes = events(tmp_path, "spike")
    assert spikes and spikes[0]["step"] == 100 and {e["step"] for e in spikes} <= set(range(100, 105))
    assert all(e["loss"] > 2.5 * e["loss_ema"] for e in spikes)
    assert len({e["loss_ema"] for e in spikes}) == 1  # every spike measured against the pre-drill average
    summary = summary_of(tmp_path)
    assert summary["spikes"] == len(spikes) >= 1
    assert summary["status"] == "completed" and summary["steps"] == 150 and summary["rollbacks"] == 0
    losses = train_losses(tmp_path)
    assert losses[150] < spikes[0]["loss_ema"] * 1.5  # and training recovered


def test_a_spike_leaves_a_postmortem_whose_command_replays_its_loss(tmp_path, stdlib_data, capfd):
    """spike_factor=1.3 at learning_rate=1e-2 flags a few real batches before the drill (steps 94 and 98 here,
    batches of codec tables), and the drill's steps 100..104. Each is in spike-postmortem.json and .md: the step,
    its loss (the metrics line's), the steps before it, the batch's sample numbers; a real batch's shard, document
    and first tokens as data.Loader reads them, the drill's rare tokens decoded. Each replay command, run as
    written, trains from the newest checkpoint on disk and logs the spiking step's loss bit for bit."""
    out = tmp_path / "out"
    train(capfd, out, stdlib_data, *FAST, "--learning_rate=1e-2", "--max_steps=105", "--inject_spike_at_step=100",
          "--spike_factor=1.3", "--max_bad_steps=1000", "--ckpt_every=40", "--log_every=1")
    losses = train_losses(out)
    bad = json.loads((out / "spike-postmortem.json").read_text())["bad_steps"]
    md = (out / "spike-postmortem.md").read_text()
    assert [b["step"] for b in bad] == [e["step"] for e in events(out, "spike")]
    real = [b for b in bad if not b["batch"]["drill"]]
    assert real and all(b["step"] < 100 for b in real)
    assert [b["step"] for b in bad if b["batch"]["drill"]] == [100, 101, 102, 103, 104]
    manifest = data.load_manifest(stdlib_data)
    loader = data.Loader(stdlib_data, "train", manifest, 64, 1337)
    for b in bad:
        step, batch = b["step"], b["batch"]
        assert b["kind"] == "spike" and b["loss"] == losses[step] and b["recent"][-1]["step"] == step
        assert [r["step"] for r in b["recent"]] == list(range(step - 7, step + 1))
        assert batch["samples"] == [4 * (step - 1), 4 * step]  # 4 samples of 64 tokens per step
        assert len(batch["text"]) == 4 and all(batch["text"])
        assert "counted, not skipped" in b["action"] and b["replay_from"] in (40, 80)  # 80 once its write is done
        assert f"## Step {step}: spike, loss {losses[step]:.4f}" in md and b["replay_command"] in md
        assert b["replay_command"].endswith(shlex.join(["train.py", *b["replay_args"]]))
    for b in real:
        assert [s["sample"] for s in b["batch"]["sources"]] == list(range(*b["batch"]["samples"]))
        for s, text in zip(b["batch"]["sources"], b["batch"]["text"]):
            assert s["window"] == loader.train_window(s["sample"]) and loader.locate(s["window"]) == (0, s["token"])
            assert s["shard"] == manifest["splits"]["train"]["shards"][0]["file"]
            starts = [*np.load(os.path.join(stdlib_data, data.docs_file(s["shard"]))), len(loader.shards[0])]
            assert starts[s["doc"]] <= s["token"] < starts[s["doc"] + 1]
            assert bytes(t for t in loader.window(s["window"])[:32] if t < 256).decode(errors="replace") == text
            assert f"({s['shard']}, document {s['doc']:,}, token {s['token']:,}): {json.dumps(text)}" in md
    for b in (real[0], bad[-1]):  # a real batch and the drill's last
        r = run_script(["train.py", *b["replay_args"]], capfd)
        assert r.returncode == 0, r.stderr[-2000:]
        replay, start = tmp_path / f"out-replay-{b['step']}", b["replay_from"]
        assert f"resumed from {out}/ckpt/step_{start:07d} at step {start}" in r.stdout
        assert train_losses(replay) == {s: losses[s] for s in range(start + 1, b["step"] + 1)}
        assert summary_of(replay)["stop_reason"] == "stop_at_step" and summary_of(replay)["steps"] == b["step"]


def test_a_replay_from_the_start_keeps_the_horizon_the_budget_had_set(tmp_path, stdlib_data, capfd):
    """A spike before the first checkpoint of a run whose horizon budget_usd fitted: the replay drops the budget
    keys, so it carries the horizon as max_steps, and its cosine, and the spiking step's loss, are the run's."""
    out = tmp_path / "out"
    # $0.004 at $1 an hour and 0.1 s a step: a horizon of about 100 steps (startup counts), the drill's inside it
    train(capfd, out, stdlib_data, *FAST, "--max_steps=1000", "--budget_usd=0.004", "--usd_per_gpu_hour=1",
          "--planned_tokens_per_sec=2560", "--learning_rate=1e-2", "--inject_spike_at_step=20", "--spike_factor=1.3",
          "--max_bad_steps=1000", "--eval_every=1000", "--log_every=1")
    horizon = summary_of(out)["horizon"]
    first = json.loads((out / "spike-postmortem.json").read_text())["bad_steps"][0]
    assert 20 < horizon < 1000 and first["replay_from"] < 0 and f"--max_steps={horizon}" in first["replay_args"]
    r = run_script(["train.py", *first["replay_args"]], capfd)
    assert r.returncode == 0, r.stderr[-2000:]
    assert train_losses(tmp_path / f"out-replay-{first['step']}") == {
        s: v for s, v in train_losses(out).items() if s <= first["step"]}


# -----------------------------------------------------------------------------
# 3. non-finite steps


def test_nan_drill_under_ddp_is_skipped_on_every_rank(tmp_path, stdlib_data, capfd):
    """2 ranks (gloo), inject_nan_at_step=6: steps 6..10 get a NaN loss on the last rank only, so
    NaN gradients reach both ranks through DDP's all-reduce. Every rank must skip those 5 steps:
    - "nonfinite" events at steps 6..10 and summary nonfinite_steps == 5 exactly: had either rank taken
      a NaN update, the rank-averaged loss would stay NaN at every later step;
    - a skipped step changes no weight, so the validation loss at step 10 (both ranks evaluate and
      average) is bit-identical to the one at step 5;
    - training then goes on: finite losses after the drill, validation loss going down, and a
      final checkpoint with finite weights."""
    train(capfd, tmp_path, stdlib_data, "--micro_batch_size=4", "--total_batch_tokens=512", "--max_steps=25",
          "--inject_nan_at_step=6", "--max_bad_steps=100", "--log_every=1", "--eval_every=5", "--ckpt_every=5",
          nproc=2)
    assert [e["step"] for e in events(tmp_path, "drill")] == [6, 7, 8, 9, 10]
    assert [e["step"] for e in events(tmp_path, "nonfinite")] == [6, 7, 8, 9, 10]
    summary = summary_of(tmp_path)
    assert summary["world_size"] == 2 and summary["status"] == "completed" and summary["steps"] == 25
    assert summary["nonfinite_steps"] == 5 and summary["rollbacks"] == 0 and summary["lr_scale"] == 1.0
    val = {m["step"]: m["val_loss"] for m in read_metrics(tmp_path) if "val_loss" in m}
    assert val[10] == val[5]  # exactly: steps 6..10 left the weights as step 5 did
    assert val[25] < val[15] < val[5]
    losses = train_losses(tmp_path)
    assert all(losses[s] is None for s in range(6, 11))  # NaN is written as null
    assert all(math.isfinite(losses[s]) for s in range(11, 26))
    weights = load_weights(tmp_path / "ckpt" / "step_0000025")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_nan_drill_single_process_leaves_model_and_optimizer_untouched(tmp_path, stdlib_data, capfd):
    """One process, inject_nan_at_step=6, max_steps=10: the run ends on the last NaN step, so its final
    checkpoint (step 10) must hold exactly the weights and AdamW state of the step-5 checkpoint."""
    train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--inject_nan_at_step=6", "--max_bad_steps=100",
          "--log_every=1", "--eval_every=5", "--ckpt_every=5")
    assert [e["step"] for e in events(tmp_path, "nonfinite")] == [6, 7, 8, 9, 10]
    summary = summary_of(tmp_path)
    assert summary["nonfinite_steps"] == 5 and summary["status"] == "completed" and summary["steps"] == 10
    ckpt = tmp_path / "ckpt"
    a, b = load_weights(ckpt / "step_0000005"), load_weights(ckpt / "step_0000010")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = torch.load(ckpt / "step_0000005" / "optimizer.pt", weights_only=True)["state"]
    ob = torch.load(ckpt / "step_0000010" / "optimizer.pt", weights_only=True)["state"]
    assert oa.keys() == ob.keys()
    for i in oa:
        for key in oa[i]:
            assert torch.equal(oa[i][key], ob[i][key]), (i, key)  # exp_avg, exp_avg_sq and the step count


# -----------------------------------------------------------------------------
# 4. rollback

# NaN at steps 11..15 with max_bad_steps=3 and checkpoints at 5 and 10: steps 11, 12, 13 are bad in a
# row, so the run rolls back to step 10 at half the learning rate. Each drill step fires once, so the
# replayed 11..13 are clean and 14, 15 still get their NaN (2 bad in a row: no second rollback).
ROLLBACK = [*FAST, "--max_steps=20", "--ckpt_every=5", "--log_every=1"]


def test_repeated_nans_roll_back_at_half_the_learning_rate(tmp_path, stdlib_data, capfd):
    """The rollback event (from step 13, lr_scale 0.5), then steps 11..20 again from the step-10
    checkpoint, each logging exactly half the learning rate of the same step in an identical run
    without the drill, the replayed step 11 computing exactly that run's loss (same weights, same
    batch); summary rollbacks 1, lr_scale 0.5, and the run completes."""
    train(capfd, tmp_path / "ref", stdlib_data, *ROLLBACK)
    train(capfd, tmp_path / "drill", stdlib_data, *ROLLBACK, "--inject_nan_at_step=11", "--max_bad_steps=3")
    ref = {m["step"]: m for m in read_metrics(tmp_path / "ref") if "lr" in m}
    rows = read_metrics(tmp_path / "drill")
    [at] = [i for i, m in enumerate(rows) if m.get("event") == "rollback"]
    rollback = rows[at]
    assert rollback["from_step"] == 13 and rollback["lr_scale"] == 0.5 and rollback["rollbacks"] == 1
    assert rollback["step"] == 10  # back at the step-10 checkpoint
    before = [m for m in rows[:at] if "lr" in m]
    after = [m for m in rows[at:] if "lr" in m]
    assert [m["step"] for m in before] == list(range(1, 14))
    assert [m["step"] for m in after] == list(range(11, 21))
    for m in before:
        assert m["lr"] == ref[m["step"]]["lr"], m["step"]
    for m in after:
        assert m["lr"] == pytest.approx(0.5 * ref[m["step"]]["lr"], rel=1e-12), m["step"]
    assert after[0]["loss"] == ref[11]["loss"]
    assert [e["step"] for e in events(tmp_path / "drill", "nonfinite")] == [11, 12, 13, 14, 15]
    summary = summary_of(tmp_path / "drill")
    assert summary["rollbacks"] == 1 and summary["lr_scale"] == 0.5 and summary["nonfinite_steps"] == 5
    assert summary["status"] == "completed" and summary["steps"] == 20
    # the post-mortem: 11..13 skipped, then rolled back; 14 and 15 have no replay (the step-10 checkpoint
    # holds the learning rate before the rollback halved it, and the saves at 15 waited for the NaNs to end)
    bad = json.loads((tmp_path / "drill" / "spike-postmortem.json").read_text())["bad_steps"]
    assert [(b["step"], b["kind"], b["rolled_back_to"]) for b in bad] == [
        (11, "nonfinite", 10), (12, "nonfinite", 10), (13, "nonfinite", 10), (14, "nonfinite", None),
        (15, "nonfinite", None)]
    assert all(b["loss"] == "nan" and "skipped on every rank" in b["action"] for b in bad)
    assert all(b["action"].endswith("then the run rolled back to step 10 at lr x 0.5") for b in bad[:3])
    assert [b["replay_from"] in (5, 10) for b in bad] == [True, True, True, False, False]  # 10 once written
    assert bad[3]["replay_command"] is None and "no checkpoint since the rollback to step 10" in bad[3]["replay_note"]


def test_when_no_rollback_is_possible_the_run_fails_with_one_error_line(tmp_path, stdlib_data, capfd):
    """max_rollbacks=0: the third bad step in a row ends the run: exit 1, one error line saying it
    diverges, summary.json with status "failed" and stop_reason "diverged".
    No checkpoint yet: bad steps 3, 4, 5 in a row with nothing to roll back to: exit 1, one error
    line naming the problem."""
    diverged, no_ckpt = tmp_path / "diverged", tmp_path / "no_ckpt"
    r = train(capfd, diverged, stdlib_data, *ROLLBACK, "--inject_nan_at_step=11", "--max_bad_steps=3",
              "--max_rollbacks=0", check=False)
    r2 = train(capfd, no_ckpt, stdlib_data, *FAST, "--max_steps=20", "--inject_nan_at_step=3", "--max_bad_steps=3",
               check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(errors(r.stderr)) == 1 and "diverg" in errors(r.stderr)[0], r.stderr
    summary = summary_of(diverged)
    assert summary["status"] == "failed" and summary["stop_reason"] == "diverged"
    assert summary["steps"] == 13 and summary["rollbacks"] == 0 and summary["nonfinite_steps"] == 3

    assert r2.returncode == 1 and "Traceback" not in r2.stderr
    assert len(errors(r2.stderr)) == 1 and "no checkpoint to roll back to" in errors(r2.stderr)[0], r2.stderr
    assert "at step 5" in errors(r2.stderr)[0]
    assert summary_of(no_ckpt)["status"] == "failed" and summary_of(no_ckpt)["stop_reason"] == "diverged"


# -----------------------------------------------------------------------------
# 5. early stopping


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory, stdlib_data):
    """A run that early-stops, deterministically.

    Validation loss must stop improving on purpose. A high learning rate does make it go up, but
    when is noise: with eval_every=1 and patience 3, lr 2e-2, 3e-2 and 5e-2 stopped at steps 9, 8
    and 7, each after whichever noisy evaluation happened to be lowest, and any later dip below the
    best restarts the count (lr 1 and up wreck the model, then spike rollbacks halve the lr and it
    recovers to new bests). A learning rate of 1e-30 instead freezes the model bit for bit: every
    AdamW update (~1e-30) and the weight decay factor (1 - 1e-31 == 1.0) are far below float32
    resolution at the weights' scale, and evaluation reads the same validation windows every time,
    so every evaluation returns exactly the same loss, never strictly below the best: an exact
    plateau. With eval_every=2 and early_stop_patience=3 the run is best at step 2 and stops after
    evaluations 4, 6, 8. ckpt_every=3 and keep_last=1 rotate the periodic checkpoints 3 and 6 away,
    but never the best one."""
    out = tmp_path_factory.mktemp("early_stop")
    with Captured() as captured:
        r = train(captured, out, stdlib_data, *FAST, "--learning_rate=1e-30", "--min_lr=0", "--max_steps=100",
                  "--eval_every=2", "--early_stop_patience=3", "--ckpt_every=3", "--keep_last=1", "--log_every=1")
    return out, r


def test_early_stop_after_patience_evaluations_without_a_new_best(early_stopped):
    """early_stop_patience=3 ends the run right after the third evaluation without a new best:
    status "completed", stop_reason "early_stop"; ckpt/best names the best step's checkpoint, which
    survived keep_last=1 rotation, and ckpt/latest the step the run stopped at."""
    out, r = early_stopped
    summary = summary_of(out)
    assert summary["status"] == "completed" and summary["stop_reason"] == "early_stop"
    assert summary["best_step"] == 2 and summary["steps"] == 8
    val = [(m["step"], m["val_loss"]) for m in read_metrics(out) if "val_loss" in m]
    assert [s for s, _ in val] == [2, 4, 6, 8]
    assert len({v for _, v in val}) == 1  # the plateau is exact
    assert "done (early_stop)" in r.stdout
    # ckpt/best names the best step's checkpoint, kept through keep_last=1 rotation; latest is the stop
    assert (out / "ckpt" / "best").read_text() == "step_0000002"
    assert (out / "ckpt" / "latest").read_text() == "step_0000008"
    assert step_folders(out) == [2, 8]
    assert summary["best_checkpoint"] == str(out / "ckpt" / "step_0000002")
    assert summary["checkpoint"] == str(out / "ckpt" / "step_0000008")


def test_sample_which_best_and_latest(early_stopped, capfd):
    """sample.py --which=best (the default) and --which=latest load the two different checkpoints of
    the early-stopped run (steps 2 and 8; frozen, so equal weights: the folder is what is checked);
    sample.py names the one it loaded on stderr's first line (its main in this process: run_script)."""
    out, _ = early_stopped
    base = ["sample.py", f"--out_dir={out}", "--max_new_tokens=4", "--device=cpu"]
    loaded = {}
    for which in ("best", "latest", None):
        r = run_script(base + ([f"--which={which}"] if which else []), capfd)
        assert r.returncode == 0, f"--which={which}: exit {r.returncode}\n{r.stderr[-2000:]}"
        loaded[which] = r.stderr.splitlines()[0]
    assert loaded["best"] == f"# {out / 'ckpt' / 'step_0000002'}"
    assert loaded["latest"] == f"# {out / 'ckpt' / 'step_0000008'}"
    assert loaded[None] == loaded["best"]


# -----------------------------------------------------------------------------
# 6. free disk


def test_a_run_whose_every_save_was_skipped_fails_at_its_end(tmp_path, stdlib_data, capfd):
    """ckpt_min_free_gb=1e9: no disk has that, so every checkpoint (periodic, best, final) is skipped
    with a warning naming what it needs and what is free; training goes on, but a run that ends without
    its model on disk is no success: exit 1 with one line that says so and what to do, summary.json
    status failed, and ckpt/ holds no checkpoint and no half-written .tmp-* folder."""
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--ckpt_every=3", "--eval_every=5",
              "--log_every=5", "--ckpt_min_free_gb=1e9", check=False)
    warnings = [l for l in r.stderr.splitlines() if l.startswith("warning: skipping the step")]
    assert [int(w.split()[4]) for w in warnings] == [3, 5, 6, 9, 10]  # periodic 3, 6, 9; best 5; final 10
    for w in warnings:
        assert "it needs" in w and "GB free" in w and "ckpt_min_free_gb=1000000000.0" in w
    assert r.returncode == 1 and "Traceback" not in r.stderr and "done (" not in r.stdout
    assert r.stderr.splitlines()[-1] == (
        f"error: the run ended at step 10 with no checkpoint on disk (the saves were skipped to keep "
        f"ckpt_min_free_gb=1000000000.0 GB free: see the warnings): lower ckpt_min_free_gb (or free disk space "
        f"for {tmp_path}/ckpt), then run the same command again (it starts over)")
    summary = summary_of(tmp_path)
    assert summary["status"] == "failed" and summary["steps"] == 10 and summary["checkpoint"] is None
    assert os.listdir(tmp_path / "ckpt") == []


# -----------------------------------------------------------------------------
# 7. checkpoints by the clock


@pytest.mark.parametrize("nproc", [1, 2], ids=["one_process", "ddp"])
def test_ckpt_every_minutes_saves_by_the_clock_on_every_rank(tmp_path, stdlib_data, capfd, nproc):
    """ckpt_every_minutes=0.001 (60 ms, a few steps here) with ckpt_every far past max_steps: checkpoints come by
    the clock, more than the final one, each complete. Under 2 ranks rank 0's clock decides for both (a rank that
    saved alone would hang in the save's gather): the run completes."""
    train(capfd, tmp_path, stdlib_data, "--micro_batch_size=4", "--total_batch_tokens=512", "--max_steps=40",
          "--ckpt_every=1000000", "--ckpt_every_minutes=0.001",
          "--eval_every=1000000", "--keep_last=100", "--log_every=10", nproc=nproc)
    saves = [e["step"] for e in events(tmp_path, "checkpoint")]
    assert len(saves) > 2 and saves[-1] == 40 and saves == sorted(set(saves)), saves
    assert step_folders(tmp_path) == saves
    assert all((tmp_path / "ckpt" / f"step_{s:07d}" / "complete.json").exists() for s in saves)
    summary = summary_of(tmp_path)
    assert summary["status"] == "completed" and summary["world_size"] == nproc
