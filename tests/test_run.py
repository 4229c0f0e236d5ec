"""run.sh end to end on the embedded default (shortened), and sample.py on its checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY_MODEL, read_metrics, run, shared


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    def build(tmp):
        # the first 400 files of any Python's stdlib (3.10-3.13: 5.0M-5.8M tokens) are enough for config/tiny.py's
        # min_val_tokens, so every Python holds out a validation set, however many files its stdlib has
        # half config/tiny.py's batch (8 x 256 tokens): the dry run and training take 44 s instead of 64 on 2 cores,
        # and 40 steps still end at 2.54 nats/token (3.44 unigram)
        env = dict(DATA_DIR=str(tmp / "data"), OUT_DIR=str(tmp / "out"), PREPARE_ARGS="--max_docs=400 --workers=2",
                   DRYRUN_STEPS="4", PYTHON=sys.executable)
        r = run(["bash", "run.sh", "--max_steps=40", "--eval_every=20", "--ckpt_every=20", "--log_every=10",
                 "--micro_batch_size=8", "--total_batch_tokens=2048"], env=env)
        (tmp / "stdout.txt").write_text(r.stdout)
    tmp = shared(tmp_path_factory, "run_sh", build)
    return tmp, (tmp / "stdout.txt").read_text()


def test_every_stage_runs_and_leaves_its_outputs(pipeline):
    tmp, stdout = pipeline
    out = tmp / "out"
    for stage in ("sanity", "prepare", "dryrun", "train", "sample"):
        assert f"=== {stage}:" in stdout
    assert (out / "sanity.json").exists() and json.load(open(out / "sanity.json"))["passed"]
    manifest = json.load(open(tmp / "data" / "manifest.json"))
    val, min_val_tokens = manifest["splits"]["val"], manifest["prepare_args"]["min_val_tokens"]
    assert val["tokens"] >= min_val_tokens > 0 and f"validation: {val['docs']:,} documents, " in stdout
    assert all((out / f).exists() for f in ("summary.md", "metrics.csv", "manifest.json", "plots/loss_steps.png"))
    dryrun = json.load(open(out / "dryrun" / "dryrun.json"))
    assert dryrun["ok"] and dryrun["steps"] == 4 and dryrun["resume_check"]["steps"] == [3, 4]
    assert (out / "ckpt" / "latest").read_text() == "step_0000040"
    summary = json.load(open(out / "summary.json"))
    assert summary["steps"] == 40
    # the model learned something beyond token frequencies
    print(f"final val loss {summary['final_val_loss']:.3f} vs unigram {summary['unigram_val_loss']:.3f}")
    assert summary["final_val_loss"] < summary["unigram_val_loss"] - 0.5
    metrics = read_metrics(out)
    train_rows = [m for m in metrics if "loss" in m]
    for key in ("step", "loss", "lr", "tokens", "tokens_per_sec", "mfu", "mem_gb", "grad_norm"):
        assert key in train_rows[0]
    assert [m["step"] for m in metrics if "val_loss" in m] == [20, 40]
    # the sample stage printed the prompt of config/tiny.py and generated text after it
    sample = stdout.split("=== sample:")[1].splitlines()[1:]
    assert "".join(sample).startswith("def ") and len("".join(sample)) > 100


def test_sample_is_deterministic_and_streams_from_a_checkpoint_folder(pipeline):
    tmp, _ = pipeline
    ckpt = tmp / "out" / "ckpt" / "step_0000040"
    args = [sys.executable, "sample.py", f"--ckpt={ckpt}", "--prompt=import os\n", "--max_new_tokens=60",
            "--num_samples=2", "--seed=7"]
    a, b = run(args), run(args)
    assert a.stdout == b.stdout and a.stdout.count("import os\n") == 2
    greedy = run([*args[:-2], "--temperature=0", "--num_samples=1"]).stdout
    assert greedy.startswith("import os\n") and greedy != a.stdout.split("-" * 40)[0]


def test_sample_without_checkpoint_fails_clearly(tmp_path):
    r = run([sys.executable, "sample.py", f"--ckpt={tmp_path}"], check=False)
    assert r.returncode == 1 and r.stderr.startswith("error: no checkpoint") and "Traceback" not in r.stderr


def test_run_sh_names_the_failing_stage(tmp_path):
    r = run(["bash", "run.sh"], env=dict(STAGES="prepare", DATA_DIR=str(tmp_path / "d"),
                                         PREPARE_ARGS="--source=/no/such/path", PYTHON=sys.executable), check=False)
    assert r.returncode != 0 and "stage 'prepare' failed" in r.stderr
    r = run(["bash", "run.sh"], env=dict(STAGES="bogus", PYTHON=sys.executable), check=False)
    assert r.returncode == 2 and "unknown stage 'bogus'" in r.stderr
    for env in ({}, {"OUT_DIR": str(tmp_path / "out")}):  # with OUT_DIR no stage of run.sh reads the config first
        r = run(["bash", "run.sh"], env=dict(env, CONFIG="/missing.py", PYTHON=sys.executable), check=False)
        assert (r.returncode, r.stderr, r.stdout) == (2, "run.sh: CONFIG=/missing.py: no such file (give a config "
                                                         "file, e.g. CONFIG=config/tiny.py)\n", "")


def test_run_sh_forwards_a_preemption_signal_and_stops_cleanly(tmp_path, stdlib_data):
    """SIGUSR1 (SLURM's notice) to run.sh reaches both torchrun workers; they save the same step and
    run.sh exits 0 instead of reporting torchrun's non-zero exit as a failed stage."""
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", STAGES="train sample", NPROC="2", OUT_DIR=str(out),
               DATA_DIR=stdlib_data, PYTHON=sys.executable)
    args = [*TINY_MODEL, "--micro_batch_size=2", "--total_batch_tokens=256", "--max_steps=100000",
            "--log_every=1", "--eval_every=100000", "--ckpt_every=100000"]
    p = subprocess.Popen(["bash", "run.sh", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 5:
        assert time.time() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.2)
    p.send_signal(signal.SIGUSR1)
    log = p.communicate(timeout=30)[0]
    assert p.returncode == 0, log
    summary = json.load(open(out / "summary.json"))
    assert summary["status"] == "stopped" and summary["signal"] == "SIGUSR1"
    assert f"run.sh: train stopped at step {summary['steps']} (signal)" in log
    assert "=== sample" not in log  # a stopped run ends run.sh
    state = torch.load(out / "ckpt" / f"step_{summary['steps']:07d}" / "trainer.pt", weights_only=True)
    assert state["step"] == summary["steps"] and len(state["rng"]) == 2
