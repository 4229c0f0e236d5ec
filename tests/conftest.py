"""Shared fixtures: a small real dataset (the stdlib corpus, byte tokenizer) and a runner for the scripts."""
import contextlib
import fcntl
import gc
import hashlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from podgpt.core.util import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# runs a script as if the machine had GPUs that nothing may touch (a CPU test must pass on a GPU pod too)
FAKE_CUDA = os.path.join(ROOT, "tests", "fake_cuda.py")
# 2 ranks in torchrun's environment, forked after one torch import (tests/ranks.py): for the tests of what ranks
# compute; those of the launch itself (a killed rank, a signal to the job, restarts) use torchrun
RANKS = [sys.executable, os.path.join(ROOT, "tests", "ranks.py"), "--nproc_per_node=2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# a 2-layer model that trains in seconds on a CPU, used by the training tests; without the report's plots,
# ~1 s of matplotlib per run (tests/test_report.py and the run.sh pipeline check them)
TINY_MODEL = ["--block_size=64", "--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--device=cpu",
              "--dtype=float32", "--warmup_steps=2", "--learning_rate=1e-3", "--eval_steps=2", "--plots=False"]


def pytest_configure(config):
    """One torch thread in each of pytest-xdist's test processes (one per core): two processes each spinning a
    thread per core stall each other; a tiny model's 200 forwards took 40 s that way instead of 2. run() and
    run_script give the scripts they start one thread for the same reason."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """pytest.ini's `-n auto`: one test process per CPU core, and one process in all for the GPU tier
    (`-m gpu`), whose tests share the one GPU and time it."""
    if config.option.markexpr.strip() == "gpu":
        return 0
    # Linux: the cores this process may run on (a container's share), elsewhere all of them
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def shared(tmp_path_factory, name, build):
    """The folder `name`, made by build(folder) once per test session and only read by the tests.
    pytest.ini runs the tests on several processes (pytest-xdist, one per core), each with its own
    fixtures: the first one to ask for a costly shared fixture (a trained run, the run.sh pipeline)
    builds it while the others wait on a lock, then they reuse the folder instead of building it again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this session's folder, which holds every worker's own
    folder, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build on another worker left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def popen(args, env=None, **kwargs):
    """subprocess.Popen(args, **kwargs) on one torch thread (OMP_NUM_THREADS=1: two xdist workers on two cores,
    each spinning a thread per core, stall each other), with `env` added to this process's environment."""
    return subprocess.Popen(args, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kwargs)


def run(args, env=None, check=True, timeout=600):
    """Run a command in the repo root (popen); on failure show what it printed."""
    with popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    r = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def run_script(args, capfd):
    """`python script.py argv...` as run_main(script.main, argv) in this process, as run() would run it: from
    the repo root, on one torch thread (run's OMP_NUM_THREADS=1: two xdist workers on two cores, each spinning
    a thread per core, stall each other). Its exit status, and what it wrote to file descriptors 1 and 2
    (torch's C++ and logging output too). A Python warning counts as a line of stderr, as it would be one
    there (pytest would otherwise collect it, once per place). The signal handlers a script sets (train.py's
    preemption notices), the working folder and the thread count are put back."""
    import torch

    script, *argv = map(str, args)
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))  # a script, or a module's path
    capfd.readouterr()  # what came before is not the script's
    gc.collect()  # nor are earlier tests' garbage's warnings (an unclosed file's ResourceWarning) at the next collection
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    cwd, threads = os.getcwd(), torch.get_num_threads()
    try:
        os.chdir(ROOT)
        torch.set_num_threads(1)
        with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as e:
            warnings.simplefilter("always")
            run_main(module.main, argv)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        os.chdir(cwd)
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    err += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    return SimpleNamespace(returncode=e.value.code, stdout=out, stderr=err)


def train_tiny(capfd, out, data, *args, nproc=1, check=True):
    """train.py on TINY_MODEL: one process as its main in this process (run_script: no torch import per run),
    nproc=2: two ranks (RANKS); check: it must exit 0, else its output is shown. capfd: pytest's, or a Captured."""
    args = ["train.py", f"--data_dir={data}", f"--out_dir={out}", *TINY_MODEL, *args]
    if nproc > 1:
        assert nproc == 2, "RANKS launches 2 ranks"
        return run([*RANKS, *args], check=check)
    r = run_script(args, capfd)
    assert not check or r.returncode == 0, f"{out}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


class Captured:
    """capfd's readouterr for run_script in a module-scoped fixture, which cannot take capfd: what Python
    prints to sys.stdout and sys.stderr inside `with Captured() as captured:`, other threads' too."""

    def __enter__(self):
        self.out, self.err = io.StringIO(), io.StringIO()
        self.redirects = contextlib.ExitStack()
        self.redirects.enter_context(contextlib.redirect_stdout(self.out))
        self.redirects.enter_context(contextlib.redirect_stderr(self.err))
        return self

    def __exit__(self, *exc):
        self.redirects.close()

    def readouterr(self):
        text = self.out.getvalue(), self.err.getvalue()
        for f in (self.out, self.err):
            f.seek(0)
            f.truncate()
        return text


def tree(root, stat=False):
    """{path under root: "folder", or the file's sha256 (stat=True: with its size and mtime)}: every byte a
    user had there, to compare after a run."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = "folder"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            st = os.lstat(path)
            found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, digest) if stat else digest
    return found


def read_metrics(out_dir):
    """Every row of metrics.jsonl, events included. A last line without its newline is one the run is
    writing at this moment (a reader can see part of a write), so it is left for the next read."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def train_losses(out_dir):
    return {m["step"]: m["loss"] for m in read_metrics(out_dir) if "loss" in m and "event" not in m}


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory):
    def build(folder):
        run([sys.executable, "prepare.py", "--source=stdlib", "--tokenizer=byte", f"--data_dir={folder}",
             "--max_docs=300", "--val_fraction=0.05", "--workers=2"])
    return str(shared(tmp_path_factory, "stdlib_byte", build))
