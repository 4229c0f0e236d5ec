"""train.py's last line names what ended the run as it did: a disk that refused summary.json after the
saves (where the run stands, what is on disk, the fix), saves that ckpt_min_free_gb skipped on a disk
with room for them (the key, not the disk, is the cause), and a limit or a signal before the first step
(nothing failed: max_hours, budget_usd or budget_file paid for no step; a signal lost nothing).

Each run is train.py's main in this process (conftest.run_script), its disk made full by monkeypatch."""
import errno
import json
import os
import re
import shutil
import signal
from collections import namedtuple

import pytest

import train as train_script
from conftest import train_tiny as train
from podgpt.core import checkpoint

FAST = ["--micro_batch_size=4", "--total_batch_tokens=256", "--log_every=5"]
ENOSPC = "OSError: [Errno 28] No space left on device"
Usage = namedtuple("Usage", "total used free")


def summary_of(out):
    with open(out / "summary.json") as f:
        return json.load(f)


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def last_line(r):
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr.splitlines()[-1]


def warnings_of(r):
    return [line for line in r.stderr.splitlines() if line.startswith("warning:")]


# -----------------------------------------------------------------------------
# 1. summary.json refused after the saves


@pytest.mark.parametrize("saved", [False, True], ids=["no_checkpoint", "step_5_on_disk"])
def test_a_full_disk_that_refuses_summary_json_ends_in_one_line(tmp_path, stdlib_data, capfd, monkeypatch,
                                                                saved):
    """Synchronous saves, then summary.json, refused with ENOSPC (step 5's save goes through when `saved`): the
    saves warn and training goes on; the end is one line, exit 1, no traceback: the step the run ended at, what
    is on disk, why summary.json is missing, and the fix with where the same command goes on from. The end's
    report, which would read a summary.json that is not there, is not attempted."""
    save_file = checkpoint.save_file

    def failing(obj, path):
        if not saved or "step_0000010" in path:
            no_space()
        return save_file(obj, path)
    monkeypatch.setattr(checkpoint, "save_file", failing)
    monkeypatch.setattr(train_script, "write_json", no_space)
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--ckpt_every=5", "--eval_every=1000",
              "--save_best=False", "--ckpt_async=False", check=False)
    failed = [w for w in warnings_of(r) if " checkpoint failed (" in w]
    assert len(failed) == 1 + (not saved), r.stderr
    state, resume = (("with its newest checkpoint on disk at step 5", "it resumes from step 5") if saved else
                     ("with no checkpoint on disk", "it starts over"))
    assert r.returncode == 1 and last_line(r) == (
        f"error: the run ended at step 10 {state}, but {tmp_path}/summary.json could not be written ({ENOSPC}): "
        f"free disk space for {tmp_path}, then run the same command again: {resume}")
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [last_line(r)]
    assert "report:" not in r.stderr and not (tmp_path / "summary.json").exists()


# -----------------------------------------------------------------------------
# 2. ckpt_min_free_gb, not the disk


def fake_free(monkeypatch, tmp_path, *free):
    """out_dir/ckpt reports free[0] bytes free, then free[1], ... (the last from then on); other paths
    (the preflight's) the real disk's."""
    disk_usage, left = shutil.disk_usage, list(free)

    def usage(path):
        if os.fspath(path) != str(tmp_path / "ckpt"):
            return disk_usage(path)
        return Usage(10**12, 0, left.pop(0) if len(left) > 1 else left[0])
    monkeypatch.setattr(shutil, "disk_usage", usage)


NEEDS = r"it needs \d+\.\d kB"


def test_saves_skipped_by_ckpt_min_free_gb_name_the_key(tmp_path, stdlib_data, capfd, monkeypatch):
    """20.9 MB free, room for the ~0.8 MB checkpoint but not for ckpt_min_free_gb=1 GB beside it: each save's
    warning and the end line (exit 1) name the key as the cause and lowering it as the fix."""
    fake_free(monkeypatch, tmp_path, 20.9e6)
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--ckpt_every=5", "--eval_every=1000",
              "--save_best=False", "--ckpt_min_free_gb=1", check=False)
    for step, w in zip([5, 10], warnings_of(r), strict=True):
        assert re.fullmatch(
            rf"warning: skipping the step {step} checkpoint: {NEEDS} and {re.escape(str(tmp_path))}/ckpt has "
            r"20\.9 MB free, and saving it would leave less than ckpt_min_free_gb=1.0 GB free; training goes on: "
            r"lower ckpt_min_free_gb or free disk space", w), w
    assert r.returncode == 1 and last_line(r) == (
        f"error: the run ended at step 10 with no checkpoint on disk (the saves were skipped to keep "
        f"ckpt_min_free_gb=1.0 GB free: see the warnings): lower ckpt_min_free_gb (or free disk space for "
        f"{tmp_path}/ckpt), then run the same command again (it starts over)")
    assert summary_of(tmp_path)["status"] == "failed"


def test_a_skip_by_ckpt_min_free_gb_after_a_checkpoint_resumes_from_it(tmp_path, stdlib_data, capfd,
                                                                         monkeypatch):
    """Step 5's save has the disk's room; step 10's is skipped by ckpt_min_free_gb: the end line names the key,
    and step 5 as where the same command resumes."""
    fake_free(monkeypatch, tmp_path, 10**12, 20.9e6)
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--ckpt_every=5", "--eval_every=1000",
              "--save_best=False", "--ckpt_min_free_gb=1", check=False)
    assert r.returncode == 1 and last_line(r) == (
        f"error: the run ended at step 10 but its newest checkpoint is step 5 (the saves after it were skipped "
        f"to keep ckpt_min_free_gb=1.0 GB free: see the warnings): lower ckpt_min_free_gb (or free disk space for "
        f"{tmp_path}/ckpt), then run the same command again: it resumes from step 5")


def test_a_disk_without_room_for_the_checkpoint_still_says_free_disk_space(tmp_path, stdlib_data, capfd,
                                                                           monkeypatch):
    """Step 5: 20.9 MB free (the key skips it); step 10: 100 kB free, less than the checkpoint itself: that
    warning, and the end line, say to free disk space, as lowering ckpt_min_free_gb would not help."""
    fake_free(monkeypatch, tmp_path, 20.9e6, 100e3)
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--ckpt_every=5", "--eval_every=1000",
              "--save_best=False", "--ckpt_min_free_gb=1", check=False)
    skipped, full = warnings_of(r)
    assert "lower ckpt_min_free_gb" in skipped
    assert re.fullmatch(
        rf"warning: skipping the step 10 checkpoint: {NEEDS} and {re.escape(str(tmp_path))}/ckpt has 100\.0 kB "
        r"free \(ckpt_min_free_gb=1\.0\); training goes on: free disk space", full), full
    assert r.returncode == 1 and last_line(r) == (
        f"error: the run ended at step 10 with no checkpoint on disk (the saves failed: see the warnings): free "
        f"disk space for {tmp_path}/ckpt, then run the same command again (it starts over)")


# -----------------------------------------------------------------------------
# 3. stopped before the first step


def two_digits(x):
    return f"{float(f'{x:.2g}'):f}".rstrip("0").rstrip(".")


def seconds(s):  # a startup's: under a minute
    return f"{two_digits(s)} s"


def test_max_hours_that_pays_for_no_step_says_so(tmp_path, stdlib_data, capfd):
    """max_hours=1e-07 (0.36 ms) is spent before the first step: exit 1, one line naming the key, its value,
    the time spent and the final save's kept back (0.5 s: nothing measured yet), and raising it as the fix."""
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--max_hours=0.0000001", check=False)
    assert "not training: max_hours already reached at step 0" in r.stdout
    summary = summary_of(tmp_path)
    assert r.returncode == 1 and last_line(r) == (
        f"error: the run ended at step 0 with nothing trained and no checkpoint: max_hours=1e-07 (0.00036 s) left "
        f"no time for a step: {seconds(summary['elapsed_s'])} went before it, and 0.5 s is kept back for the "
        f"final save; raise max_hours, then run the same command again")
    assert summary["status"] == "failed" and summary["steps"] == 0


def test_budget_usd_that_pays_for_no_step_says_so(tmp_path, stdlib_data, capfd):
    """budget_usd=0.0001 at usd_per_gpu_hour=1 pays for 0.36 s, less than the 0.5 s kept back for the final
    save: exit 1, one line naming the key, its value, the dollars and seconds spent, and raising it."""
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--budget_usd=0.0001",
              "--usd_per_gpu_hour=1", check=False)
    assert "not training: budget_usd already reached at step 0" in r.stdout
    summary = summary_of(tmp_path)
    spent, before = two_digits(summary["cost_usd"]), seconds(summary["elapsed_s"])
    assert r.returncode == 1 and last_line(r) == (
        f"error: the run ended at step 0 with nothing trained and no checkpoint: budget_usd=0.0001 left no money "
        f"for a step: ${spent} went in the {before} before it, and the spend of 0.5 s is kept back for the final "
        f"save; raise budget_usd, then run the same command again")


def test_budget_file_spent_before_the_first_step_names_budget_file(tmp_path, stdlib_data, capfd):
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"spent_usd": 20.0}))
    out = tmp_path / "out"
    r = train(capfd, out, stdlib_data, *FAST, "--max_steps=10", "--budget_usd=10", f"--budget_file={budget}",
              check=False)
    assert r.returncode == 1 and last_line(r) == (
        f"error: the run ended at step 0 with nothing trained and no checkpoint: budget_file={budget} says "
        f"$20.00 is spent, over budget_usd=10; raise budget_usd (or correct budget_file), then run the same "
        f"command again")


def test_a_signal_before_the_first_step_loses_nothing(tmp_path, stdlib_data, capfd, monkeypatch):
    """SIGTERM during the startup (one process, as under torchrun): the run stops at step 0 without a step
    or a checkpoint, status stopped, exit 0, and says nothing was lost."""
    start_horizon = train_script.start_horizon

    def preempted(*args):
        signal.raise_signal(signal.SIGTERM)
        return start_horizon(*args)
    monkeypatch.setattr(train_script, "start_horizon", preempted)
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", check=False)
    assert r.returncode == 0 and "error:" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == ("stopped at step 0 (signal SIGTERM) before the first step: nothing was "
                                         "trained, so nothing is lost; the same command starts the run")
    summary = summary_of(tmp_path)
    assert (summary["status"], summary["stop_reason"], summary["steps"], summary["error"]) == (
        "stopped", "signal", 0, None)
    assert os.listdir(tmp_path / "ckpt") == []


def test_a_pointer_the_full_disk_refuses_leaves_the_checkpoint_and_rotates_nothing(tmp_path, stdlib_data, capfd,
                                                                                   monkeypatch):
    """The step-10 save is whole on disk, then the 10-byte ckpt/latest.tmp is refused. Before: an OSError
    traceback out of the save. Now a warning, every checkpoint kept (latest still names step 5, which the
    rotation would have removed), no .tmp left, and the run ends as it would."""
    write_pointer = checkpoint.write_pointer

    def refused(ckpt_root, which, name):
        if name == "step_0000010":
            open(os.path.join(ckpt_root, f"{which}.tmp"), "wb").close()  # what a refused write leaves
            no_space()
        write_pointer(ckpt_root, which, name)
    monkeypatch.setattr(checkpoint, "write_pointer", refused)
    r = train(capfd, tmp_path, stdlib_data, *FAST, "--max_steps=10", "--ckpt_every=5", "--eval_every=1000",
              "--save_best=False", "--keep_last=1", "--ckpt_async=False", check=False)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert warnings_of(r) == [
        f"warning: the step 10 checkpoint is whole in {tmp_path}/ckpt/step_0000010, but ckpt/latest (or best) "
        f"could not name it ({ENOSPC}), so none is rotated away; training goes on: free disk space for "
        f"{tmp_path}/ckpt"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step_0000005", "step_0000010"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_0000005"
