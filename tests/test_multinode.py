"""run.sh past one node, on this one machine (CPU, gloo, 127.0.0.1): two run.sh processes with
NNODES=2 and NODE_RANK=0/1 stand in for two pods, and MAX_RESTARTS lets torchrun re-launch a
training whose worker was SIGKILLed, which then resumes from its latest checkpoint.

Both compare with one uninterrupted 2-rank run on one node (tests/ranks.py): the same
float for every step's loss in metrics.jsonl. With 2 ranks gloo's all-reduce adds two numbers,
a + b == b + a, so nothing may differ.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import RANKS, ROOT, TINY_MODEL, read_metrics, run, shared, train_losses
from test_resume import children

MAX_STEPS = 10
# 8192 tokens per step = gradient accumulation 16 on each of 2 ranks: ~0.3 s a step here, so the
# restart test has a few seconds between the first checkpoint (step 3) and the end to kill a worker
ARGS = [*TINY_MODEL, "--micro_batch_size=4", "--total_batch_tokens=8192", f"--max_steps={MAX_STEPS}",
        "--log_every=1", "--eval_every=1000", "--ckpt_every=3"]
TIMEOUT = 150  # seconds for one run.sh; a hang (e.g. a restart stuck in init_process_group) fails the test


@pytest.fixture(scope="module")
def ref(tmp_path_factory, stdlib_data):
    """The uninterrupted single-node 2-rank run, with run.sh's default config file (which sets min_lr and more)."""
    def build(out):
        run([*RANKS, "train.py", "config/tiny.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *ARGS],
            timeout=TIMEOUT)
    out = shared(tmp_path_factory, "multinode_ref", build)
    assert sorted(train_losses(out)) == list(range(1, MAX_STEPS + 1))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid):
    """Pids of every live process below pid (torchrun starts its workers in sessions of their own,
    so killing a process group would miss them)."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return {}


class RunSh:
    """bash run.sh in the background, its output in a file; stop() kills what is left of it."""

    def __init__(self, log, env, args):
        self.log = log
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, **env)
        with open(log, "w") as f:
            self.p = subprocess.Popen(["bash", "run.sh", *args], cwd=ROOT, env=env, stdout=f,
                                      stderr=subprocess.STDOUT)

    def wait(self, timeout=TIMEOUT):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"run.sh did not finish within {timeout}s:\n{self.output()[-3000:]}")
        return self.p.returncode

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self):
        for pid in [self.p.pid, *descendants(self.p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.p.wait()


def test_two_nodes_reproduce_one_node(tmp_path, stdlib_data, ref):
    """Two run.sh with NNODES=2 (one process each) train the same steps as one node with 2 processes.
    Each "node" has its own DATA_DIR and OUT_DIR, as two pods without a shared filesystem would: rank 0
    (node 0, the static rendezvous's rank order) writes metrics, checkpoints and the summary into node 0's
    OUT_DIR; rank 1 only checks that its own OUT_DIR takes writes, so node 1's stays empty. One shared
    OUT_DIR would hide a rank 0 that landed on node 1. Sample runs on node 0 only."""
    port = free_port()
    data = [stdlib_data, str(tmp_path / "data1")]
    shutil.copytree(stdlib_data, data[1])  # node 1's own copy: prepare.py writes the same files on every node
    nodes = []
    try:
        for rank in (0, 1):
            env = dict(NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       NPROC="1", STAGES="train sample", DATA_DIR=data[rank], OUT_DIR=str(tmp_path / f"out{rank}"),
                       SAMPLE_ARGS="--max_new_tokens=16")
            nodes.append(RunSh(tmp_path / f"node{rank}.log", env, ARGS))
        codes = [node.wait() for node in nodes]
    finally:
        for node in nodes:
            if node.p.poll() is None:
                node.stop()
    logs = [node.output() for node in nodes]
    assert codes == [0, 0], f"{logs[0][-3000:]}\n-----\n{logs[1][-3000:]}"
    for rank in (0, 1):
        launch = logs[rank].split("=== train: ", 1)[1].splitlines()[0]
        assert f"--nnodes=2 --nproc_per_node=1 --rdzv_id=podgpt --rdzv_backend=static --node_rank={rank} " \
               f"--master_addr=127.0.0.1 --master_port={port} train.py" in launch
    assert "world 2 x micro 4 x accum 16 = 8192 tokens/step" in logs[0]
    assert train_losses(tmp_path / "out0") == train_losses(ref)
    assert sorted(train_losses(ref)) == list(range(1, MAX_STEPS + 1))
    assert (tmp_path / "out0" / "ckpt" / "latest").read_text() == f"step_{MAX_STEPS:07d}"
    out1 = tmp_path / "out1"  # rank 1's: no metrics, summary or checkpoint
    assert not [f for f in ("metrics.jsonl", "summary.json", "ckpt/latest") if (out1 / f).exists()]
    assert not [d for d in os.listdir(out1 / "ckpt") if d.startswith("step_")]
    assert re.search(r"=== sample: .*\n# .*step_0000010\n", logs[0])
    assert "=== sample: skipped on node 1" in logs[1]


def kill_rank_1_after_a_checkpoint(runs, out):
    """Once out has a checkpoint (step 3), SIGKILL the worker of rank 1, found below one of runs (the run.sh
    processes), and wait for them all. Returns their exit codes and the last step logged at the kill."""
    try:
        deadline = time.time() + TIMEOUT
        while not (out / "ckpt" / "latest").exists():
            assert all(sh.p.poll() is None for sh in runs) and time.time() < deadline, runs[0].output()[-3000:]
            time.sleep(0.02)
        rank1 = [pid for sh in runs for pid in descendants(sh.p.pid) if environ(pid).get(b"RANK") == b"1"]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0], signal.SIGKILL)
        killed_after = max(train_losses(out))
        return [sh.wait() for sh in runs], killed_after
    finally:
        for sh in runs:
            if sh.p.poll() is None:
                sh.stop()


def assert_resumed_once_and_same_as(out, log, killed_after, ref):
    assert killed_after < MAX_STEPS, "the run ended before the kill: nothing was restarted"
    resumed = re.findall(rf"resumed from {re.escape(str(out))}/ckpt/step_(\d+) at step (\d+)", log)
    assert len(resumed) == 1 and 3 <= int(resumed[0][1]) <= killed_after, (resumed, killed_after)
    assert train_losses(out) == train_losses(ref)  # every step 1..10, those after the resume recomputed
    steps = [m["step"] for m in read_metrics(out) if "loss" in m and "event" not in m]
    assert steps == list(range(1, MAX_STEPS + 1))
    assert "done (max_steps): 10 steps" in log


def test_max_restarts_relaunches_a_killed_worker_which_resumes(tmp_path, stdlib_data, ref):
    """MAX_RESTARTS=1 on one node of 2 processes: rank 1 SIGKILLed after the first checkpoint, torchrun
    stops rank 0 and starts both again, they resume from the newest checkpoint and finish the run with
    the losses of the uninterrupted one; run.sh exits 0."""
    out = tmp_path / "out"
    env = dict(NPROC="2", MAX_RESTARTS="1", STAGES="train", DATA_DIR=stdlib_data, OUT_DIR=str(out))
    sh = RunSh(tmp_path / "run.log", env, ARGS)
    codes, killed_after = kill_rank_1_after_a_checkpoint([sh], out)
    log = sh.output()
    assert codes == [0], log[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 " in log and "--standalone --nproc_per_node=2 --max_restarts=1 " \
        "train.py" in log
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1", log), log[-3000:]
    assert_resumed_once_and_same_as(out, log, killed_after, ref)


def test_max_restarts_on_two_nodes(tmp_path, stdlib_data, ref):
    """MAX_RESTARTS=1 with NNODES=2 (one process each, c10d rendezvous): rank 1 SIGKILLed after the first
    checkpoint; both nodes start again and resume. A restart reads the checkpoint on every rank, so both
    nodes share one OUT_DIR here, as run.sh requires for restarts on several nodes."""
    out, port = tmp_path / "out", free_port()
    runs = []
    try:
        for rank in (0, 1):
            env = dict(NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NPROC="1",
                       MAX_RESTARTS="1", STAGES="train", DATA_DIR=stdlib_data, OUT_DIR=str(out))
            runs.append(RunSh(tmp_path / f"node{rank}.log", env, ARGS))
    except BaseException:
        for sh in runs:
            sh.stop()
        raise
    codes, killed_after = kill_rank_1_after_a_checkpoint(runs, out)
    log = "\n".join(sh.output() for sh in runs)
    assert codes == [0, 0], log[-6000:]
    assert log.count(f"--rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:{port} --max_restarts=1 train.py") == 2
    assert_resumed_once_and_same_as(out, log, killed_after, ref)


def test_several_nodes_need_master_addr():
    r = run(["bash", "run.sh"], env=dict(NNODES="2", NODE_RANK="1", MASTER_ADDR="", PYTHON=sys.executable),
            check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and "MASTER_ADDR" in r.stderr, r.stderr
    r = run(["bash", "run.sh"], env=dict(NNODES="2", NODE_RANK="2", MASTER_ADDR="127.0.0.1", PYTHON=sys.executable),
            check=False)
    assert r.returncode == 2 and r.stdout == "" and "NODE_RANK < NNODES" in r.stderr, r.stderr
