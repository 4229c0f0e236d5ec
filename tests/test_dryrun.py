"""train.py --dryrun_steps=N: N steps, a checkpoint at N/2, a resume from it in the same invocation
that must reproduce steps N/2+1..N; one process and two ranks, a deliberately broken resume, a
dry run stopped by a signal, and the 1B config's dry run as its recipe runs it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from podgpt.core import checkpoint, configurator
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


# the 1B config at a tiny shape on 2 CPU ranks: its own keys (the recipe's dry run) stay as they are
TINY_1B = ["config/h200_1b_ddp8.py", *TINY_MODEL, "--micro_batch_size=2", "--total_batch_tokens=256",
           "--compile=False", "--expect_world_size=2"]


@pytest.fixture(scope="module")
def pack_1b(tmp_path_factory):
    """The 1B config's skills pack at a few rows: the dry run's SFT step trains on its sft.jsonl."""
    pack = tmp_path_factory.mktemp("pack_1b")
    run([sys.executable, "skills.py", "config/h200_1b_ddp8.py", f"--pack_dir={pack}", "--sft_rows=44",
         "--eval_rows=11"])
    return pack


def readme_1b():
    """README's commands for the 1B config, as written in its bash blocks: {script: its arguments}."""
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = [line for block in text.split("```bash\n")[1:] for line in block.split("```")[0].splitlines()
             if "config/h200_1b_ddp8.py" in line and not line.startswith("#")]
    found = {}
    for line in lines:
        words = line.split()
        at = next(i for i, w in enumerate(words) if w.endswith((".py", ".sh")) and not w.startswith("CONFIG="))
        found.setdefault(words[at], []).append((words[:at], words[at + 1:]))
    return found


def test_readme_s_1b_commands_run_as_written(tmp_path, stdlib_data):
    """Each of README's commands for the 1B config takes its arguments as written; its plan runs under 8-GPU
    torchrun's arguments on 2 CPU ranks at a tiny shape (the dry run's command: the test below)."""
    commands = readme_1b()
    assert set(commands) == {"run.sh", "skills.py", "prepare.py", "train.py"}
    for script, runs in commands.items():
        for launch, args in runs:
            if script != "run.sh":
                configurator.configure(script, args)  # a key the script lacks would exit here
            if script == "train.py":
                assert launch == ["torchrun", "--standalone", "--nproc_per_node=8"]
    plan, = [args for _, args in commands["train.py"] if "--preflight_only=True" in args]
    run([*TORCHRUN, "train.py", *plan, *TINY_1B[1:], f"--data_dir={stdlib_data}", f"--out_dir={tmp_path}",
         "--gate_profile=research"])
    assert json.load(open(tmp_path / "preflight.json"))["verdict"] != "block"


def test_the_1b_dry_run_is_its_recipe_s_and_a_spike_fails_it(tmp_path, stdlib_data, pack_1b):
    """The recipe's dry run: 100 steps on every rank under the research gates, a kill and resume at 50 that
    reproduces 51..100, one SFT step from that checkpoint on the pack's rows; its DDP timeout is 120 minutes.
    The same run with a planted spike (the fire drill at step 60) fails, in one line."""
    cfg = configurator.configure("train.py", ["config/h200_1b_ddp8.py"])
    assert (cfg.dryrun_stage_steps, cfg.dryrun_sft, cfg.ddp_timeout_minutes) == (100, "config/h200_1b_ddp8_sft.py", 120)
    dry, = [args for _, args in readme_1b()["train.py"] if any(a.startswith("--dryrun_steps=") for a in args)]
    assert dry == ["config/h200_1b_ddp8.py", "--dryrun_steps=100"]  # README's, run as written
    args = [*TORCHRUN, "train.py", *dry, *TINY_1B[1:], f"--data_dir={stdlib_data}", f"--pack_dir={pack_1b}"]
    r = run([*args, f"--out_dir={tmp_path}/ok"])
    report = json.load(open(tmp_path / "ok" / "dryrun.json"))
    assert report["ok"] and [x["steps"] for x in report["ranks"]] == [100, 100]
    assert report["resume_check"]["steps"] == list(range(51, 101)) and report["resume_check"]["max_rel_diff"] == 0
    assert report["first"]["long_run_gate"]["profile"] == "research" and report["spikes"] == 0
    sft = report["sft"]
    assert sft["status"] == "completed" and sft["steps"] == 1 and sft["nonfinite_steps"] == 0
    assert "dry run ok: 100 steps on 2 rank(s)" in r.stdout and "1 SFT step (loss" in r.stdout
    r = run([*args, f"--out_dir={tmp_path}/spike", "--learning_rate=1e-2", "--inject_spike_at_step=60"], check=False)
    report = json.load(open(tmp_path / "spike" / "dryrun.json"))
    assert r.returncode != 0 and not report["ok"] and report["spikes"] >= 1
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        f"error: dry run failed: {report['spikes']} loss spikes above spike_factor x the recent average (the spike "
        f"events in {tmp_path}/spike/first/metrics.jsonl) (report in {tmp_path}/spike/dryrun.json)"]
