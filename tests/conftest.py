"""Shared fixtures: a small real dataset (the stdlib corpus, byte tokenizer) and a runner for the scripts."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# runs a script as if the machine had GPUs that nothing may touch (a CPU test must pass on a GPU pod too)
FAKE_CUDA = os.path.join(ROOT, "tests", "fake_cuda.py")
# a 2-layer model that trains in seconds on a CPU, used by the training tests
TINY_MODEL = ["--block_size=64", "--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--device=cpu",
              "--dtype=float32", "--warmup_steps=2", "--learning_rate=1e-3", "--eval_steps=2"]


def run(args, env=None, check=True, timeout=600):
    """Run a command in the repo root; on failure show what it printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def read_metrics(out_dir):
    """Every row of metrics.jsonl, events included. A last line without its newline is one the run is
    writing at this moment (a reader can see part of a write), so it is left for the next read."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def train_losses(out_dir):
    return {m["step"]: m["loss"] for m in read_metrics(out_dir) if "loss" in m and "event" not in m}


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "stdlib_byte"
    run([sys.executable, "prepare.py", "--source=stdlib", "--tokenizer=byte", f"--data_dir={data}",
         "--max_docs=300", "--val_fraction=0.05", "--workers=2"])
    return str(data)
