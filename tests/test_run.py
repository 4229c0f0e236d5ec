"""run.sh end to end on the embedded default (shortened), and sample.py on its checkpoint."""
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from podgpt.pod import gates
from conftest import ROOT, TINY_MODEL, popen, read_metrics, run, shared


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


def test_the_skills_sft_eval_and_handoff_stages_fine_tune_the_train_stage_s_model_ask_both_and_bundle_it(
        pipeline, tmp_path):
    """After the train stage: skills writes the pack, sft fine-tunes the train stage's checkpoint on its SFT rows
    (the base run untouched), eval writes eval.json and the honesty report for the base model and the fine-tuned
    one, each over every eval row of the pack, the base in its plain layout, the fine-tuned one in the chat layout;
    handoff bundles the fine-tuned one with its base, their release gates (research) letting them go; sample
    samples the bundle's model."""
    tmp, _ = pipeline
    out, pack, bundle = tmp / "out", tmp_path / "pack", tmp_path / "bundle"
    before = (out / "ckpt" / "latest").read_text()
    env = dict(DATA_DIR=str(tmp / "data"), OUT_DIR=str(out), PYTHON=sys.executable, PACK_DIR=str(pack),
               STAGES="skills sft eval handoff sample", SFT_CONFIG="config/tiny_skills_sft.py",
               SAMPLE_ARGS="--max_new_tokens=8",
               SFT_ARGS=f"--out_dir={tmp_path / 'sft'} --data_dir={tmp_path / 'sft_data'} --max_steps=4 "
                        "--eval_every=4 --ckpt_every=4 --log_every=2 --micro_batch_size=8 --total_batch_tokens=2048",
               EVAL_ARGS="--max_new_tokens=4 --eval_batches=2", HANDOFF_DIR=str(bundle))
    stdout = run(["bash", "run.sh"], env=env).stdout
    for stage in ("skills", "sft-data", "sft", "eval", "honesty", "eval-sft", "honesty-sft", "handoff"):
        assert f"=== {stage}:" in stdout
    # the last stage samples the model handed off: the bundle's fine-tuned export, a chat model answering
    sample = stdout.split("=== sample: ")[1].splitlines()
    assert sample[0].split()[1] == "sample.py" and f"--ckpt={bundle}/model" in sample[0].split(), sample[0]
    assert "".join(sample[1:]).strip() and "Traceback" not in stdout
    assert all((run_dir / "honesty.md").is_file() for run_dir in (out, tmp_path / "sft"))
    record = json.loads((bundle / "podgpt-handoff.json").read_text())
    assert record["run"] == f"{tmp_path.name}/sft" and (bundle / "model" / "model.safetensors").is_file()
    assert record["base"]["run"].endswith("/out") and (bundle / "base" / "model" / "model.safetensors").is_file()
    assert record["release_gate"]["verdict"] in ("pass", "warn")  # research: it goes on, no override needed
    assert (bundle / "README.md").read_text().startswith("# ")
    for line in (bundle / "checksums.sha256").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((bundle / name).read_bytes()).hexdigest() == digest, name
    assert (out / "ckpt" / "latest").read_text() == before
    rows = sum(1 for _ in open(pack / "eval.jsonl"))
    layouts = {}
    for run_dir in (out, tmp_path / "sft"):
        report = json.load(open(run_dir / "eval.json"))
        layouts[run_dir.name] = report["pack"]["layout"]
        assert report["pack"]["overall"]["n"] == rows > 0
    assert layouts == {"out": "base", "sft": "chat"}
    assert json.load(open(tmp_path / "sft" / "summary.json"))["steps"] == 4
    # each run's summary.json carries its long-run gate: the preflight gates it started with, the checks after it,
    # and eval_floors from the eval stage (research: no floors); summary.md shows it
    for run_dir in (out, tmp_path / "sft"):
        record = json.load(open(run_dir / "summary.json"))["long_run_gate"]
        assert record["gates"] == json.load(open(run_dir / "preflight.json"))["gates"]
        assert [g["name"] for g in record["post_run"]] == ["final_loss", "spikes_rollbacks", "contamination",
                                                           "eval_floors"]
        assert record["profile"] == "research" and record["post_run"][-1]["verdict"] == "skip"
        assert record["verdict"] == gates.verdict_of(record["gates"] + record["post_run"]) != "block"
        assert f"verdict: **{record['verdict']}** (research profile)" in (run_dir / "summary.md").read_text()


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


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_run_sh_sanity_measures_capacity_where_there_is_a_gpu(tmp_path, gpu):
    """The sanity stage passes --capacity (the must-pass memory check: on a GPU one real step of the whole
    model) when nvidia-smi lists a GPU, and not on a machine without one. nvidia-smi and the interpreter are
    stand-ins: one answers as with or without a GPU, the other prints its arguments."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, body in (("nvidia-smi", f"exit {0 if gpu else 6}"), ("python", 'echo "python $*"')):
        (stand_ins / name).write_text(f"#!/bin/sh\n{body}\n")
        (stand_ins / name).chmod(0o755)
    env = dict(STAGES="sanity", OUT_DIR=str(tmp_path / "out"), PYTHON=str(stand_ins / "python"),
               PATH=f"{stand_ins}:{os.environ['PATH']}")
    r = run(["bash", "run.sh"], env=env)
    [line] = [line for line in r.stdout.splitlines() if line.startswith("python sanity.py")]
    assert line == f"python sanity.py config/tiny.py --out_dir={tmp_path / 'out'}" + (" --capacity" if gpu else "")


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


@pytest.mark.parametrize("to", ["group", "pid"])
def test_ctrl_c_stops_the_running_stage_and_run_sh(tmp_path, to):
    """Ctrl-C during prepare, sent to run.sh's process group as a terminal sends it or to run.sh alone: prepare.py
    stops and so does run.sh, by SIGINT (so a calling shell stops too), before the next stage and without
    '=== done'. bash starts background jobs ignoring SIGINT, so prepare.py ran on after a Ctrl-C (with --force
    it replaced the data) and run.sh went on. prepare.py reads its documents from a named pipe that this test
    holds open, so the signal lands mid-stage on any machine."""
    source = tmp_path / "source"
    source.mkdir()
    pipe = source / "docs.jsonl"
    os.mkfifo(pipe)
    env = dict(STAGES="prepare sample", DATA_DIR=str(tmp_path / "data"), OUT_DIR=str(tmp_path / "out"),
               PREPARE_ARGS=f"--source={source} --val_fraction=0 --min_val_tokens=0", PYTHON=sys.executable)
    p = popen(["bash", "run.sh"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
              start_new_session=True)
    deadline = time.time() + 60
    while True:  # opening a pipe's write end without blocking succeeds once prepare.py has opened it to read
        try:
            writer = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or p.poll() is not None or time.time() > deadline:
                p.kill()
                raise AssertionError(p.communicate()[0]) from e
            time.sleep(0.05)
    try:
        if to == "group":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGINT)
        try:
            log = p.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:  # prepare.py did not stop: give it documents, to see what run.sh does then
            os.write(writer, b'{"text": "def f():\\n    return 1\\n"}\n' * 100)
            os.close(writer)
            writer = None
            log = p.communicate(timeout=60)[0]
    finally:
        if writer is not None:
            os.close(writer)
    assert p.returncode == -signal.SIGINT, log
    assert "error: interrupted (Ctrl-C)" in log and "run.sh: prepare stopped by SIGINT; no later stage runs" in log
    assert "=== sample" not in log and "=== done" not in log
    assert not (tmp_path / "data" / "manifest.json").exists()


@pytest.mark.parametrize("env, line", [
    (dict(STAGES="train smaple"), "unknown stage 'smaple' in STAGES (choose from: sanity skills prepare dryrun train sft eval handoff sample)"),
    (dict(STAGES=" "), "STAGES=' ' names no stage (choose from: sanity skills prepare dryrun train sft eval handoff sample)"),
    *[(dict(DRYRUN_STEPS=n), f"DRYRUN_STEPS={n}: the dry run needs at least 2 steps (a checkpoint at half, then the "
                             "resume from it); to skip it, leave dryrun out of STAGES") for n in ("0", "1")],
    (dict(DRYRUN_STEPS="abc"), "DRYRUN_STEPS=abc is not a whole number: write it in digits (0-9)"),
    # read as decimal numbers (bash reads 08 as a bad octal number, and the old run.sh ran one process for NPROC=08)
    (dict(NPROC="08", NODE_RANK="01"), "need NPROC >= 1, NNODES >= 1 and NODE_RANK < NNODES (got 8, 1, 1)"),
    (dict(MASTER_PORT="070000"), "MASTER_PORT=70000 is not a TCP port (1 to 65535)"),
    (dict(PYTHON="/no/python"), "PYTHON=/no/python: no such command (give the interpreter, e.g. PYTHON=python3)"),
    (dict(STAGES="sft"), "SFT_CONFIG=config/tiny_sft.py: no such file (the sft stage's data_dir, out_dir and steps, "
                         "e.g. config/tiny_skills_sft.py)"),
], ids=["stages", "no-stages", "dryrun-0", "dryrun-1", "dryrun-abc", "leading-zeros", "port", "python", "sft-config"])
def test_run_sh_refuses_a_bad_value_before_any_stage(tmp_path, env, line):
    """Each value run.sh reads is checked before the first stage, in one line: "train smaple" trained for an hour
    before the typo stopped run.sh, and DRYRUN_STEPS=0 ran a whole training as the dry run. Should a check let
    a value through, the stage that runs (a dry run on data that is not there) fails in seconds."""
    env = dict(STAGES="dryrun", DATA_DIR=str(tmp_path / "none"), OUT_DIR=str(tmp_path / "out"),
               PYTHON=sys.executable) | env
    r = run(["bash", "run.sh"], env=env, check=False)
    assert (r.returncode, r.stderr, r.stdout) == (2, f"run.sh: {line}\n", "")


def test_a_config_without_a_pack_runs_the_pretraining_stages_and_passes_no_pack_dir(tmp_path):
    """A config whose pack_dir is "" (as train.py's default) gets the default stages, and no stage is handed a
    --pack_dir. The interpreter is a stand-in that prints each stage's command (run.sh's own reads of the config and
    of a run's summary, python -c and python -, run for real)."""
    stand_ins, config = tmp_path / "bin", tmp_path / "no_pack.py"
    stand_ins.mkdir()
    (stand_ins / "python").write_text(f'#!/bin/sh\ncase "$1" in -c|-) exec {sys.executable} "$@";; esac\n'
                                      'echo "python $*"\n')
    (stand_ins / "python").chmod(0o755)
    config.write_text('exec(open("config/tiny.py").read())\npack_dir = ""\n')
    r = run(["bash", "run.sh"], env=dict(CONFIG=str(config), OUT_DIR=str(tmp_path / "out"),
                                         PYTHON=str(stand_ins / "python")), check=False)
    banners = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("===")]
    assert banners == ["=== sanity", "=== prepare", "=== dryrun", "=== train", "=== sample", "=== done"], r.stdout
    assert "--pack_dir" not in r.stdout


@pytest.mark.parametrize("stages", [None, ""], ids=["unset", "empty"])
def test_a_config_with_a_skills_pack_runs_the_skills_path_by_default(tmp_path, stages):
    """Without STAGES (unset, or set empty as a script's STAGES=$1 leaves it), a config that sets pack_dir gets
    sanity skills prepare dryrun train sft eval handoff sample: its sft stage's config is checked before any stage
    runs (here one that is not there)."""
    env = dict(CONFIG="config/tiny_skills.py", SFT_CONFIG="/missing.py", OUT_DIR=str(tmp_path / "out"),
               PYTHON=sys.executable) | ({} if stages is None else dict(STAGES=stages))
    r = run(["bash", "run.sh"], env=env, check=False)
    assert (r.returncode, r.stderr) == (2, "run.sh: SFT_CONFIG=/missing.py: no such file (the sft stage's data_dir, "
                                           "out_dir and steps, e.g. config/tiny_skills_sft.py)\n")
