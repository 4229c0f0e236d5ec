"""train.py --dryrun_steps=N: N steps, a checkpoint at N/2, a resume from it in the same invocation
that must reproduce steps N/2+1..N; one process and two ranks, a deliberately broken resume, and a
dry run stopped by a signal."""
import json
import os
import signal
import subprocess
import sys
import time

from podgpt.core import checkpoint
from conftest import ROOT, TINY_MODEL, TORCHRUN, popen, run, run_script

ARGS = [*TINY_MODEL, "--micro_batch_size=2", "--total_batch_tokens=256", "--dryrun_steps=6"]


def test_dry_run_passes_on_one_process(tmp_path, stdlib_data, capfd):
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path}", *ARGS], capfd)
    assert r.returncode == 0, f"train.py exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    report = json.load(open(tmp_path / "dryrun.json"))
    assert report["ok"] and report["problems"] == [] and "dry run ok: 6 steps on 1 rank(s)" in r.stdout
    assert report["resume_check"]["steps"] == [4, 5, 6] and report["resume_check"]["max_rel_diff"] == 0
    assert report["ranks"][0]["steps"] == 6 and report["tokens_per_sec"] > 0 and report["loss_last"] < report["loss_first"]


def test_dry_run_passes_on_two_ranks(tmp_path, stdlib_data):
    run([*TORCHRUN, "train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path}", *ARGS])
    report = json.load(open(tmp_path / "dryrun.json"))
    assert report["ok"] and report["world_size"] == 2
    assert [x["steps"] for x in report["ranks"]] == [6, 6] and report["resume_check"]["max_rel_diff"] == 0


def test_dry_run_fails_when_resume_is_broken(tmp_path, stdlib_data, monkeypatch, capfd):
    """A resume that restores the loader one sample off (what a lost loader state looks like) is caught."""
    load = checkpoint.load_checkpoint

    def off_by_one(path, device):
        ckpt = load(path, device)
        ckpt["trainer"]["samples"] += 1
        return ckpt
    monkeypatch.setattr(checkpoint, "load_checkpoint", off_by_one)  # train.py's main, in this process, resumes with it
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path}/out", *ARGS], capfd)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "error: dry run failed: the resumed run does not reproduce steps 4..6" in r.stderr
    assert json.load(open(tmp_path / "out" / "dryrun.json"))["ok"] is False


def test_a_signal_in_the_first_pass_stops_the_dry_run_whole(tmp_path, stdlib_data):
    """SIGTERM (a preemption, or run.sh passing on Ctrl-C) during the first pass stopped only that pass:
    the second one started anyway, from a checkpoint that may not exist. Now the dry run ends there, exit 0,
    saying how to start it over; no second pass, no dryrun.json verdict on a run that did not finish."""
    out = tmp_path / "out"
    p = popen([sys.executable, "train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}",
               *ARGS[:-1], "--dryrun_steps=1000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              text=True)
    try:
        deadline = time.time() + 120
        while not (out / "first" / "metrics.jsonl").exists() or os.path.getsize(out / "first" / "metrics.jsonl") == 0:
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "Traceback" not in stderr, stderr
    summary = json.load(open(out / "first" / "summary.json"))
    assert summary["status"] == "stopped" and summary["stop_reason"] == "signal"
    assert stdout.splitlines()[-1] == (f"dry run stopped at step {summary['steps']} of its first pass (signal): "
                                       "nothing to compare; run the same command again to start it over")
    assert not (out / "resumed").exists() and not (out / "dryrun.json").exists()
