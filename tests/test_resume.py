"""train.py survives what a rented pod does to it: kills, kills mid-save, damaged checkpoints,
preemption signals, a different number of GPUs on resume, and a rank that dies.

Every "bit-identical" claim here is checked exactly: the same float for every step's loss
(and lr, grad norm) in metrics.jsonl, and torch.equal on every tensor of the final checkpoint's
model.pt and optimizer.pt (and the loop state and RNG states in trainer.pt), fp32 on CPU.

To stop a run at a chosen moment the tests run train.main from a small wrapper script (written
into tmp_path) that patches one function: data.Loader.train_batch to SIGKILL the process
(or raise) when the step it is about to run is the chosen one, or checkpoint.save_file to SIGKILL it while
a checkpoint's optimizer.pt is half written by the background write, the loop training on meanwhile.
The resume is always the plain `train.py` with the same arguments: "the same command again".
"""
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from podgpt.core import checkpoint
from podgpt.pod import checkpoints
from podgpt.core.checkpoint import MARKER, STATE_DIR, read_pointer
from podgpt.pod.checkpoints import Checkpoints
from conftest import FAKE_CUDA, RANKS, ROOT, TINY_MODEL, TORCHRUN, popen, read_metrics, run, shared, train_losses
from model import GPT, GPTConfig
from podgpt.core.optim import make_optimizer

MAX_STEPS, CKPT_EVERY = 16, 5  # checkpoints at steps 5, 10, 15 and the final 16
# 8 sequences of 64 tokens per step: accumulation 2 on one process, 1 on each of two ranks;
# an evaluation only at the end, and every checkpoint kept (the tests below pick older ones)
ARGS = ["--micro_batch_size=4", "--total_batch_tokens=512", f"--max_steps={MAX_STEPS}", f"--ckpt_every={CKPT_EVERY}",
        "--log_every=1", "--eval_every=1000", "--keep_last=10"]
# a constant learning rate (warmup of one step at the peak, cosine from the peak to the peak):
# no step depends on max_steps, so a run stopped under one max_steps compares with a run of another
CONSTANT_LR = ["--warmup_steps=1", "--learning_rate=1e-3", "--min_lr=1e-3"]


def kill_points(rng, n):
    """n 0-based steps at which to kill a run (the step about to run; that many steps are done):
    right after a checkpoint, just before the next one, then anywhere after the first checkpoint."""
    after = rng.choice(range(CKPT_EVERY, MAX_STEPS, CKPT_EVERY))                 # 5, 10 or 15: nothing lost
    before = rng.choice(range(CKPT_EVERY, MAX_STEPS - CKPT_EVERY, CKPT_EVERY)) + CKPT_EVERY - 1  # 9 or 14
    rest = [k for k in range(CKPT_EVERY, MAX_STEPS) if k not in (after, before)]
    return ([after, before] + rng.sample(rest, max(0, n - 2)))[:n]


SINGLE_KILLS = kill_points(random.Random(4), 3)  # [5, 14, 7]
# two ranks: just before a checkpoint; right after one, the kill lands in its background write (section 2)
DDP_KILLS = kill_points(random.Random(6), 2)[1:]  # [9]

WRAPPER = """\
import os, signal, sys
sys.path.insert(0, {root!r})
import train
from podgpt.core import checkpoint, data
from podgpt.pod import checkpoints
from podgpt.core.util import run_main

RANK = int(os.environ.get("RANK", 0))
CFG = train.configure(sys.argv[1:])


def step_of(first_sample):
    # the 0-based optimizer step a train_batch call belongs to
    return first_sample // (CFG.total_batch_tokens // CFG.block_size)


{body}

run_main(train.main, sys.argv[1:])
"""

KILL_AT_STEP = """\
import time

_train_batch = data.Loader.train_batch


def train_batch(self, first_sample, size, device):
    if RANK == {rank} and step_of(first_sample) == {step}:
        # the checkpoint before this step may still be written in the background: die once it is on disk,
        # so the test knows the newest checkpoint (a kill inside a background write is section 2's)
        deadline = time.time() + 60
        while checkpoint.read_pointer(os.path.join(CFG.out_dir, "ckpt"), "latest") != "step_{last:07d}" \\
                and time.time() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return _train_batch(self, first_sample, size, device)


data.Loader.train_batch = train_batch
"""

RAISE_AT_STEP = """\
_train_batch = data.Loader.train_batch


def train_batch(self, first_sample, size, device):
    if RANK == {rank} and step_of(first_sample) == {step}:
        raise RuntimeError("injected failure on rank {rank} at step {step}")
    return _train_batch(self, first_sample, size, device)


data.Loader.train_batch = train_batch
"""

KILL_IN_SECOND_SAVE = """\
import io
import threading
import torch

_save_file, _train_batch = checkpoint.save_file, data.Loader.train_batch
optimizer_saves, moved_on = [], threading.Event()


def train_batch(self, first_sample, size, device):
    if step_of(first_sample) > {step}:  # a second step past the checkpoint at {step}: step {step} + 1 is logged
        moved_on.set()
    return _train_batch(self, first_sample, size, device)


def save_file(obj, path):  # rank 0 writes
    if os.path.basename(path) == "optimizer.pt":
        optimizer_saves.append(path)
        if len(optimizer_saves) == 2:  # the second checkpoint: half of optimizer.pt on disk, then die
            buf = io.BytesIO()
            torch.save(obj, buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
            moved_on.wait(60)  # the write is in the background: the loop trains on meanwhile
            os.kill(os.getpid(), signal.SIGKILL)
    return _save_file(obj, path)


data.Loader.train_batch = train_batch
checkpoint.save_file = save_file
"""


# rank 0 writes every checkpoint whole (model.pt, optimizer.pt), as ddp's ranks did before they shared the write
ONE_WRITER = """\
_init = checkpoints.Checkpoints.__init__


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.writers, self.shared = 1, False


checkpoints.Checkpoints.__init__ = init
"""


def wrapper(tmp_path, body, **fmt):
    """A script that patches train.py as `body` says, then runs train.main with its arguments."""
    path = tmp_path / "wrapped_train.py"
    path.write_text(WRAPPER.format(root=ROOT, body=body.format(**fmt)))
    return str(path)


def train(out, data, *args, script="train.py", nproc=1, check=True, env=None, timeout=300, fake_gpus=0,
          torchrun=False):
    """Run train.py (or a wrapper of it) on the tiny model: one process, or 2 ranks (RANKS, or under torchrun for
    the tests of the launch: a rank that fails, a kill). fake_gpus: as if the machine had that many GPUs, which
    the CPU run must not touch (tests/fake_cuda.py)."""
    assert nproc in (1, 2)
    launch = [sys.executable] if nproc == 1 else TORCHRUN if torchrun else RANKS
    if fake_gpus:
        launch, env = [*launch, FAKE_CUDA], dict(env or {}, PODGPT_FAKE_GPUS=str(fake_gpus))
    return run([*launch, script, f"--data_dir={data}", f"--out_dir={out}", *TINY_MODEL, *args],
               env=env, check=check, timeout=timeout)


def popen_train(out, data, *args, nproc=1, log_dir=None):
    """Start train.py in the background (stdout/stderr to files in out's parent); for the signal tests.
    Under torchrun, log_dir makes each worker's output go to its own files, apart from torchrun's."""
    launch = [sys.executable] if nproc == 1 else TORCHRUN + [f"--log-dir={log_dir}", "--redirects=3"]
    base = str(out) + ".console"
    with open(base + ".out", "w") as stdout, open(base + ".err", "w") as stderr:
        return popen([*launch, "train.py", f"--data_dir={data}", f"--out_dir={out}", *TINY_MODEL, *args],
                     cwd=ROOT, stdout=stdout, stderr=stderr)


def logged_steps(out):
    """Steps in metrics.jsonl so far, counting only whole lines (the run may be writing one)."""
    try:
        with open(out / "metrics.jsonl") as f:
            return sum(1 for line in f if line.endswith("\n") and '"loss"' in line and '"event"' not in line)
    except FileNotFoundError:
        return 0


def wait_for_steps(p, out, n, timeout=120):
    """Wait until a running train.py has logged n steps."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert p.poll() is None, f"the run exited ({p.returncode}) before logging {n} steps"
        if logged_steps(out) >= n:
            return
        time.sleep(0.05)
    p.kill()
    raise AssertionError(f"no {n} logged steps within {timeout}s")


def children(pid):
    """Pids of the live child processes of pid (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_text(path):
    with open(path) as f:
        return f.read()


def load(folder, name):
    return torch.load(os.path.join(folder, name), weights_only=True)


def saved_state(folder):
    """A checkpoint's weights and optimizer state, whole: {model.pt, optimizer.pt} as one process (and muon's
    ranks) write them, or {state: every key} of the state/ that several ranks write together."""
    if not os.path.isdir(folder / STATE_DIR):
        return {name: load(folder, name) for name in ("model.pt", "optimizer.pt")}
    whole = io.BytesIO()
    dcp_to_torch_save(folder / STATE_DIR, whole)
    whole.seek(0)
    return {STATE_DIR: torch.load(whole, weights_only=True)}


def assert_identical(a, b, where):
    """a == b exactly, recursively: tensors by torch.equal (same dtype and shape), floats by ==."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max difference {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def step_rows(out):
    """metrics.jsonl's per-step rows, in file order."""
    return [m for m in read_metrics(out) if "loss" in m and "event" not in m]


def assert_same_run(out, ref, steps=MAX_STEPS):
    """out is bit-identical to the uninterrupted run ref: every step logged once, in order, with the
    same loss, lr, grad norm (and refine's losses per supervision step): every field but the clocks and
    memory; the final checkpoint's weights, AdamW state and loop state equal."""
    rows, ref_rows = step_rows(out), step_rows(ref)
    assert [m["step"] for m in rows] == list(range(1, steps + 1))  # lines past the resumed checkpoint were dropped
    assert train_losses(out) == train_losses(ref)
    measured = ("tokens_per_sec", "mfu", "mem_gb", "elapsed", "cost_usd")
    for m, r in zip(rows, ref_rows, strict=True):
        assert {k: v for k, v in m.items() if k not in measured} == {k: v for k, v in r.items() if k not in measured}
    final = f"ckpt/step_{steps:07d}"
    for name, state in saved_state(out / final).items():
        assert_identical(state, saved_state(ref / final)[name], name)
    t, t_ref = load(out / final, "trainer.pt"), load(ref / final, "trainer.pt")
    for state in (t, t_ref):
        del state["elapsed"]  # wall clock: the only thing allowed to differ
    assert_identical(t, t_ref, "trainer.pt")  # step, samples, loss EMA, best val loss, every rank's RNG states


def ckpt_steps(out):
    return sorted(int(d[5:]) for d in os.listdir(out / "ckpt") if d.startswith("step_"))


def console(out):
    """Where a shared reference run's stdout is kept: beside its out_dir."""
    return out.with_name(out.name + ".stdout")


@pytest.fixture(scope="module")
def ref_single(tmp_path_factory, stdlib_data):
    """The uninterrupted one-process run that the interrupted ones must reproduce."""
    def build(out):
        console(out).write_text(train(out, stdlib_data, *ARGS).stdout)
    out = shared(tmp_path_factory, "resume_ref_single", build)
    assert ckpt_steps(out) == [5, 10, 15, 16]
    return out


@pytest.fixture(scope="module")
def ref_ddp(tmp_path_factory, stdlib_data):
    """The uninterrupted 2-rank run (gloo)."""
    def build(out):
        r = train(out, stdlib_data, *ARGS, nproc=2)
        assert "world 2 x micro 4 x accum 1" in r.stdout
    out = shared(tmp_path_factory, "resume_ref_ddp", build)
    assert ckpt_steps(out) == [5, 10, 15, 16]
    return out


# -----------------------------------------------------------------------------
# 1. SIGKILL at any step after the first checkpoint, then the same command: bit-identical

def test_kill_points_cover_both_ends_of_a_checkpoint_interval():
    # the seeded choice includes the step right after a checkpoint and the one just before the next; two
    # ranks: just before (right after one, their kill lands in its background write: section 2)
    assert {0, CKPT_EVERY - 1} <= {k % CKPT_EVERY for k in SINGLE_KILLS}, SINGLE_KILLS
    assert [k % CKPT_EVERY for k in DDP_KILLS] == [CKPT_EVERY - 1], DDP_KILLS
    assert all(CKPT_EVERY <= k < MAX_STEPS for k in SINGLE_KILLS + DDP_KILLS) and len(set(SINGLE_KILLS)) == 3


# the last kill point saves synchronously (ckpt_async=False), in the killed run and in its resume
@pytest.mark.parametrize("kill_step,save", [*((k, []) for k in SINGLE_KILLS[:-1]),
                                            (SINGLE_KILLS[-1], ["--ckpt_async=False"])],
                         ids=[*map(str, SINGLE_KILLS[:-1]), f"{SINGLE_KILLS[-1]}-sync"])
def test_sigkill_then_resume_is_bit_identical(tmp_path, stdlib_data, ref_single, kill_step, save):
    """One process SIGKILLed as it starts step kill_step (0-based; kill_step steps done), then
    `train.py` with the same arguments: the same losses, weights and AdamW state as never stopped."""
    out = tmp_path / "out"
    last = kill_step // CKPT_EVERY * CKPT_EVERY
    r = train(out, stdlib_data, *ARGS, *save, script=wrapper(tmp_path, KILL_AT_STEP, rank=0, step=kill_step, last=last),
              check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert max(train_losses(out)) == kill_step  # it died before logging step kill_step + 1
    assert ckpt_steps(out)[-1] == last
    r = train(out, stdlib_data, *ARGS, *save)
    assert f"resumed from {out}/ckpt/step_{last:07d} at step {last}" in r.stdout
    assert_same_run(out, ref_single)


@pytest.mark.parametrize("kill_step", DDP_KILLS)
def test_ddp_sigkill_of_one_rank_then_resume_is_bit_identical(tmp_path, stdlib_data, ref_ddp, kill_step):
    """2 ranks under torchrun (gloo); rank 1 SIGKILLs itself as it starts step kill_step, torchrun
    takes rank 0 down and fails; the same torchrun command with train.py resumes bit-identically."""
    out = tmp_path / "out"
    last = kill_step // CKPT_EVERY * CKPT_EVERY
    r = train(out, stdlib_data, *ARGS, script=wrapper(tmp_path, KILL_AT_STEP, rank=1, step=kill_step, last=last),
              nproc=2, check=False, torchrun=True)
    assert r.returncode != 0
    assert max(train_losses(out)) == kill_step
    assert ckpt_steps(out)[-1] == last
    r = train(out, stdlib_data, *ARGS, nproc=2, torchrun=True)
    assert f"resumed from {out}/ckpt/step_{last:07d} at step {last}" in r.stdout
    assert_same_run(out, ref_ddp)
    assert len(load(out / f"ckpt/step_{MAX_STEPS:07d}", "trainer.pt")["rng"]) == 2


# -----------------------------------------------------------------------------
# 2. checkpoints written in the background: a kill in the middle of one, what a save blocks and
# takes, one save at a time, errors raised to the loop

@pytest.mark.parametrize("nproc", [1, 2], ids=["one_process", "ddp"])
def test_kill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path, stdlib_data, request, nproc):
    """SIGKILL while the background write has optimizer.pt of the second checkpoint (step 10) half
    written, the loop having trained on to step 11 meanwhile (one process, and rank 0 of two writing alone): only
    a .tmp-step_0000010 folder is left, latest still names step 5; resume=auto takes step 5, cleans the
    leftover, and the run ends bit-identical to one never stopped."""
    ref = request.getfixturevalue("ref_single" if nproc == 1 else "ref_ddp")
    out, second = tmp_path / "out", 2 * CKPT_EVERY
    # 2 ranks: with the one-writer checkpoints of earlier runs, which a resume reads as well
    body = KILL_IN_SECOND_SAVE if nproc == 1 else ONE_WRITER + "\n\n" + KILL_IN_SECOND_SAVE
    r = train(out, stdlib_data, *ARGS, script=wrapper(tmp_path, body, step=second), nproc=nproc,
              check=False, torchrun=True)
    assert r.returncode == -signal.SIGKILL if nproc == 1 else r.returncode != 0, r.stderr[-2000:]
    assert ".tmp-step_0000010" in os.listdir(out / "ckpt") and ckpt_steps(out) == [CKPT_EVERY]
    leftover = set(os.listdir(out / "ckpt/.tmp-step_0000010"))
    assert {"model.pt", "optimizer.pt"} <= leftover and "complete.json" not in leftover
    assert (out / "ckpt/latest").read_text() == f"step_{CKPT_EVERY:07d}"
    assert max(train_losses(out)) > second  # the save held the loop only for its copy into memory
    r = train(out, stdlib_data, *ARGS, nproc=nproc, torchrun=True)
    assert f"resumed from {out}/ckpt/step_{CKPT_EVERY:07d} at step {CKPT_EVERY}" in r.stdout
    assert not [d for d in os.listdir(out / "ckpt") if d.startswith(".tmp-")]
    assert ckpt_steps(out) == [5, 10, 15, 16]
    assert_same_run(out, ref)


def test_ddp_ranks_share_the_write_and_one_process_reads_it_whole(ref_ddp, tmp_path):
    """Each checkpoint of the 2-rank run is state/, written by both ranks at once (each a share of the
    parameters with their AdamW state); one process restores the step-10 one bit-identically, and load_model
    (sample.py, eval.py, export.py) reads its weights whole."""
    for step in ckpt_steps(ref_ddp):
        files = read_json(ref_ddp / f"ckpt/step_{step:07d}" / MARKER)["files"]
        assert not {"model.pt", "optimizer.pt"} & set(files)
        shares = [files[f"{STATE_DIR}/__{rank}_0.distcp"]["bytes"] for rank in (0, 1)]
        assert min(shares) > sum(shares) / 4, shares
    folder = ref_ddp / f"ckpt/step_{2 * CKPT_EVERY:07d}"
    saved = saved_state(folder)[STATE_DIR]
    config = read_json(folder / "config.json")
    model = GPT(GPTConfig(**config["model"]))
    optimizer = make_optimizer(model, 1e-3, (0.9, 0.95), 0.1, fused=False)
    proc = SimpleNamespace(dev=torch.device("cpu"), rank=0, world=1, torchrun=False, distributed=False)
    ckpts = Checkpoints(str(tmp_path), model, optimizer, proc, False, {}, every=1, keep_last=1, save_best=False,
                        min_free_gb=0)
    state = SimpleNamespace(step=0)
    ckpts.restore(checkpoint.load_checkpoint(str(folder), proc.dev), state)
    assert state.step == 2 * CKPT_EVERY
    assert_identical(ckpts.state_dicts(), saved, "restored")
    assert_identical(checkpoints.load_model(str(folder))[0].state_dict(), saved["model"], "load_model")  # sample, export


def test_each_save_says_what_it_blocked_and_how_long_it_wrote(ref_single):
    """Every checkpoint's console line gives the seconds the loop was held and the seconds its write took,
    and metrics.jsonl the same as a checkpoint event, with the checkpoint's size: the loop was held, for
    its own save, less than the background write took."""
    printed = re.findall(r"^checkpoint (\S+) \(blocked (\d+\.\d\d)s(?:, \d+\.\d\ds of it waiting for the save "
                         r"before)?, written in (\d+\.\d\d)s\)$", console(ref_single).read_text(), re.M)
    events = [m for m in read_metrics(ref_single) if m.get("event") == "checkpoint"]
    folders = [ref_single / f"ckpt/step_{s:07d}" for s in (5, 10, 15, 16)]
    assert [e["step"] for e in events] == [5, 10, 15, 16]
    assert [p for p, _, _ in printed] == [e["path"] for e in events] == list(map(str, folders))
    for (_, blocked, written), e, folder in zip(printed, events, folders):
        assert (blocked, written) == (f"{e['blocked_s']:.2f}", f"{e['written_s']:.2f}")
        assert 0 <= e["waited_s"] <= e["blocked_s"] and 0 < e["blocked_s"] - e["waited_s"] < e["written_s"]
        size = sum(os.path.getsize(folder / f) for f in os.listdir(folder) if f != "complete.json")
        assert e["gb"] == pytest.approx(size / 1e9, rel=1e-12)


TINY_SHAPE = dict(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)


def tiny_checkpoints(tmp_path, monkeypatch, hold_step=None, shape=TINY_SHAPE):
    """(Checkpoints of a tiny model (or one of `shape`) and its AdamW after one step, in tmp_path/ckpt, one process
    on the CPU as train.py makes them; the Event that releases a save of hold_step, whose background write waits for it;
    the count of the writes under way at once, the most of them in `.most_at_once`)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, **shape))
    optimizer = make_optimizer(model, 1e-3, (0.9, 0.95), 0.1, fused=False)
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))[1].backward()
    optimizer.step()
    os.makedirs(tmp_path / "ckpt")
    proc = SimpleNamespace(dev=torch.device("cpu"), rank=0, world=1, torchrun=False, distributed=False)
    ckpts = Checkpoints(str(tmp_path), model, optimizer, proc, False, {"config.json": b"{}"}, every=1, keep_last=10,
                        save_best=False, min_free_gb=0)
    release, writes = threading.Event(), SimpleNamespace(now=0, most_at_once=0)
    save_checkpoint = checkpoint.save_checkpoint

    def counted(ckpt_root, step, *args):
        writes.now += 1
        writes.most_at_once = max(writes.most_at_once, writes.now)
        if step == hold_step:
            release.wait(30)
        try:
            return save_checkpoint(ckpt_root, step, *args)
        finally:
            writes.now -= 1
    monkeypatch.setattr(checkpoint, "save_checkpoint", counted)
    return ckpts, release, writes


def test_a_save_waits_for_the_one_in_flight_and_writes_its_own_step(tmp_path, monkeypatch):
    """The step-1 save's background write is held up until 0.5 s after the weights change, as the
    steps after a save change them. The step-2 save waits for it: never two writes at once, each
    reported once, in order; and step 1's files hold the weights it was given, not the changed ones."""
    ckpts, release, writes = tiny_checkpoints(tmp_path, monkeypatch, hold_step=1)
    before = {k: v.clone() for k, v in ckpts.model.state_dict().items()}
    ckpts.save(dict(step=1), best=False)
    assert ckpts.writing and ckpts.finished() == []  # save() returned while its write waits
    with torch.no_grad():
        for p in ckpts.model.parameters():
            p.add_(1.0)
    threading.Timer(0.5, release.set).start()
    ckpts.save(dict(step=2), best=False)
    first = ckpts.finished()  # the second save found it on disk first
    ckpts.wait()
    records = first + ckpts.finished()
    assert [r["step"] for r in first] == [1] and [r["step"] for r in records] == [1, 2]
    assert writes.most_at_once == 1 and not ckpts.writing
    assert records[1]["waited_s"] >= 0.4 and records[1]["blocked_s"] >= records[1]["waited_s"]
    assert read_pointer(str(tmp_path / "ckpt"), "latest") == "step_0000002"
    assert_identical(load(tmp_path / "ckpt/step_0000001", "model.pt"), before, "step 1's model.pt")
    changed = load(tmp_path / "ckpt/step_0000002", "model.pt")
    assert all(torch.equal(changed[k], v + 1) for k, v in before.items())


def test_the_first_save_blocks_no_longer_than_a_later_one(tmp_path, monkeypatch):
    """66 MB of model and AdamW state: its staging buffers are allocated (and their pages mapped) in the
    background after the first step, so the first save's copy finds them ready, as the later ones do: every save
    copies the model and optimizer into the buffers reserved before it (the same memory), none allocates one of
    theirs, and the first one's blocked time is within 2x of a later one's."""
    ckpts, _, _ = tiny_checkpoints(tmp_path, monkeypatch, shape=dict(vocab_size=8192, n_layer=4, n_head=4,
                                                                     n_kv_head=4, n_embd=256))
    ckpts.poll()  # the loop's look after the first step
    ckpts.staging.reserving.join()  # the steps that run meanwhile
    buffers = ckpts.staging.buffers  # {place in what save() copies: its buffer}
    reserved, after = {p: b.untyped_storage().data_ptr() for p, b in buffers.items()}, []
    for step in (1, 2, 3):
        ckpts.save(dict(step=step), best=False)
        ckpts.wait()
        after.append({p: b.untyped_storage().data_ptr() for p, b in buffers.items()})
    assert {p.split("/")[2] for p in reserved} == {"model.pt", "optimizer.pt"}
    # the first save adds only the trainer state's (its RNG state, 5 KB), and no later save adds any
    assert all(p.startswith("/0/trainer.pt/") for p in after[0].keys() - reserved.keys())
    assert after[0].items() >= reserved.items() and after[0] == after[1] == after[2]
    blocked = [r["blocked_s"] for r in ckpts.finished()]
    assert len(blocked) == 3 and blocked[0] <= 2 * max(blocked[1:]), blocked


@pytest.mark.parametrize("error", [OSError, RuntimeError])
def test_an_error_in_the_background_write_reaches_the_loop(tmp_path, monkeypatch, capsys, error):
    """optimizer.pt of the step-2 save fails in the background thread. A disk error (OSError) is what
    it is in a synchronous save: a warning, the partial folder removed, training goes on; any other
    error is raised on the loop's thread at its next look at the save (poll, or wait), once. Either
    way latest still names step 1."""
    ckpts, _, _ = tiny_checkpoints(tmp_path, monkeypatch)
    ckpts.save(dict(step=1), best=False)
    ckpts.wait()
    assert [r["step"] for r in ckpts.finished()] == [1]
    save_file = checkpoint.save_file

    def failing(obj, path):
        if os.path.basename(path) == "optimizer.pt":
            raise error("injected")
        return save_file(obj, path)
    monkeypatch.setattr(checkpoint, "save_file", failing)
    ckpts.save(dict(step=2), best=False)
    if error is OSError:
        ckpts.wait()
        assert "warning: the step 2 checkpoint failed (OSError: injected); training goes on" in capsys.readouterr().err
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step_0000001"]  # the partial folder removed
    else:
        deadline = time.time() + 30
        with pytest.raises(RuntimeError, match="injected"):
            while time.time() < deadline:
                ckpts.poll()
                time.sleep(0.01)
        assert not ckpts.writing
        ckpts.wait()  # raised once: nothing in flight any more
        assert ".tmp-step_0000002" in os.listdir(tmp_path / "ckpt")
    assert ckpts.finished() == []  # nothing reached the disk
    assert read_pointer(str(tmp_path / "ckpt"), "latest") == "step_0000001" and ckpt_steps(tmp_path) == [1]


# -----------------------------------------------------------------------------
# 3. resume=auto skips a damaged newest checkpoint

def truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return f"model.pt has {size // 2} bytes, {size} were written"


def flip_bytes(path):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    mid = len(data) // 2
    for i in range(mid, mid + 4):
        data[i] ^= 0xFF
    with open(path, "wb") as f:  # the same size: only the CRC32 in complete.json can tell
        f.write(bytes(data))
    # what a bad disk does: the file still loads as tensors (wrong ones); only the CRC32 tells
    torch.load(path, weights_only=True)
    return "model.pt is corrupt (CRC32"


def remove_marker(path):
    os.remove(os.path.join(os.path.dirname(path), "complete.json"))
    return "incomplete, no readable complete.json"


@pytest.mark.parametrize("damage", [truncate, flip_bytes, remove_marker], ids=["truncated", "flipped", "no_marker"])
def test_auto_resume_skips_a_damaged_checkpoint(tmp_path, stdlib_data, ref_single, damage):
    """The newest checkpoint (step 16) damaged: the warning names the folder and what is wrong,
    the run resumes from step 15, saves a good step 16 over the damaged one, and matches the
    uninterrupted run exactly."""
    out = tmp_path / "out"
    shutil.copytree(ref_single, out)
    bad = out / f"ckpt/step_{MAX_STEPS:07d}"
    reason = damage(str(bad / "model.pt"))
    r = train(out, stdlib_data, *ARGS)
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: skipping checkpoint")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping checkpoint {bad}: {reason}"), r.stderr
    assert f"resumed from {out}/ckpt/step_0000015 at step 15" in r.stdout
    assert read_json(out / "summary.json")["status"] == "completed"
    assert_same_run(out, ref_single)  # includes: the new step_0000016 reads back and equals the reference


# -----------------------------------------------------------------------------
# 4. preemption signals: stop at a step boundary on every rank, save, summary, resume exactly

def test_sigterm_to_torchrun_stops_saves_and_resumes_exactly(tmp_path, stdlib_data):
    """SIGTERM to torchrun mid-run: torchrun forwards it to both workers, which stop at the same
    step, save one checkpoint with both ranks' RNG states, write summary.json and exit without a
    traceback; the same command (max_steps now stop + 3) continues from that step with the losses
    and weights of a run never stopped (constant lr, so max_steps changes no step)."""
    out, logs = tmp_path / "out", tmp_path / "worker_logs"
    never = ["--micro_batch_size=4", "--total_batch_tokens=512", "--log_every=1", "--eval_every=100000",
             "--ckpt_every=100000", *CONSTANT_LR]
    p = popen_train(out, stdlib_data, *never, "--max_steps=100000", nproc=2, log_dir=logs)
    try:
        wait_for_steps(p, out, 3)
        workers = children(p.pid)
        assert len(workers) == 2, workers
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)  # torchrun itself exits non-zero with its SignalException: its behaviour
        assert time.time() - t0 < 30
    finally:
        if p.poll() is None:
            p.kill()
    assert not [pid for pid in workers if alive(pid)], "a worker outlived torchrun"

    summary = read_json(out / "summary.json")
    stopped = summary["steps"]
    assert (summary["status"], summary["stop_reason"], summary["signal"]) == ("stopped", "signal", "SIGTERM")
    assert summary["world_size"] == 2 and stopped >= 3
    assert ckpt_steps(out) == [stopped]  # the one checkpoint: at the stopping step
    trainer = load(out / f"ckpt/step_{stopped:07d}", "trainer.pt")
    assert trainer["step"] == stopped and len(trainer["rng"]) == 2 and trainer["world_size"] == 2
    assert max(train_losses(out)) == stopped
    # the workers' own output (torchrun --redirects): a clean stop, no traceback on any rank
    worker_files = sorted(logs.rglob("*.log"))
    assert len(worker_files) == 4, worker_files  # stdout and stderr of ranks 0 and 1
    worker_text = {str(f.relative_to(logs)): f.read_text() for f in worker_files}
    assert not [f for f, text in worker_text.items() if "Traceback" in text], worker_text
    rank0 = next(text for f, text in worker_text.items() if f.endswith("/0/stdout.log"))
    assert f"stopped at step {stopped} (signal SIGTERM)" in rank0

    total = stopped + 3
    r = train(out, stdlib_data, *never, f"--max_steps={total}", nproc=2, torchrun=True)
    assert f"resumed from {out}/ckpt/step_{stopped:07d} at step {stopped}" in r.stdout
    ref = tmp_path / "ref"
    train(ref, stdlib_data, *never, f"--max_steps={total}", nproc=2)
    assert_same_run(out, ref, steps=total)
    assert read_json(out / "summary.json")["status"] == "completed"


# SIGUSR1 (a preemption notice) goes through the same handler; add it here for ~3 s more
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=["SIGINT"])
def test_signal_to_one_process_stops_saves_and_exits_0(tmp_path, stdlib_data, sig):
    """Ctrl-C (SIGINT) to a single process: it finishes the step, saves a checkpoint there,
    writes summary.json (stopped, signal) and exits 0."""
    out = tmp_path / "out"
    p = popen_train(out, stdlib_data, "--micro_batch_size=4", "--total_batch_tokens=512", "--max_steps=100000",
                    "--log_every=1", "--eval_every=100000", "--ckpt_every=100000")
    try:
        wait_for_steps(p, out, 3)
        p.send_signal(sig)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
    summary = read_json(out / "summary.json")
    stopped = summary["steps"]
    assert (summary["status"], summary["stop_reason"], summary["signal"]) == ("stopped", "signal", sig.name)
    assert ckpt_steps(out) == [stopped] and max(train_losses(out)) == stopped
    trainer = load(out / f"ckpt/step_{stopped:07d}", "trainer.pt")
    assert trainer["step"] == stopped and len(trainer["rng"]) == 1
    console = read_text(str(out) + ".console.out")
    assert f"stopped at step {stopped} (signal {sig.name})" in console
    assert "Traceback" not in read_text(str(out) + ".console.err")


# -----------------------------------------------------------------------------
# 5. resuming on another number of ranks

def test_resume_on_fewer_ranks_continues_deterministically(tmp_path, stdlib_data, ref_ddp):
    """A 2-rank run's step-10 checkpoint resumed by one process (accumulation 1 -> 2, the same
    global batches): the losses follow the 2-rank run to 1e-5 (the reduction order differs)."""
    out = tmp_path / "out"
    shutil.copytree(ref_ddp, out)
    k = 2 * CKPT_EVERY
    for step in ckpt_steps(out):  # as if the 2-rank run had stopped right after its step-10 checkpoint
        if step > k:
            shutil.rmtree(out / f"ckpt/step_{step:07d}")
    (out / "ckpt/latest").write_text(f"step_{k:07d}")
    (out / "ckpt/best").unlink()
    r = train(out, stdlib_data, *ARGS)
    assert "warning: world size 2 -> 1: same batches, per-rank RNG states re-seeded" in r.stderr
    assert f"resumed from {out}/ckpt/step_{k:07d} at step {k}" in r.stdout
    assert "world 1 x micro 4 x accum 2" in r.stdout
    ddp, resumed = train_losses(ref_ddp), train_losses(out)
    assert sorted(resumed) == list(range(1, MAX_STEPS + 1))
    for step in range(k + 1, MAX_STEPS + 1):
        assert resumed[step] == pytest.approx(ddp[step], rel=1e-5, abs=0), step
    assert len(load(out / f"ckpt/step_{MAX_STEPS:07d}", "trainer.pt")["rng"]) == 1


# -----------------------------------------------------------------------------
# 6. a rank that dies takes the whole job down, instead of leaving the others hanging

def test_ddp_rank_failure_ends_the_job(tmp_path, stdlib_data):
    """Rank 1 raises at step 3; with PODGPT_DDP_TIMEOUT_MINUTES=0.5 nothing can wait long:
    torchrun exits non-zero within 60 s and names the failure."""
    t0 = time.time()
    r = train(tmp_path / "out", stdlib_data, *ARGS, script=wrapper(tmp_path, RAISE_AT_STEP, rank=1, step=3), nproc=2,
              check=False, env={"PODGPT_DDP_TIMEOUT_MINUTES": "0.5"}, timeout=90, torchrun=True)
    elapsed = time.time() - t0
    assert r.returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert "injected failure on rank 1 at step 3" in r.stdout + r.stderr
    assert max(train_losses(tmp_path / "out")) == 3  # steps 1-3 ran (0-based step 3 is the fourth)
