"""Nothing lost to a second process, a folder that is not podgpt's, or a full disk.

One writer per folder: a podgpt process holds the out_dir (or data_dir, or an export's scratch folder) it
writes with the OS's lock on a mark file, and a second one is refused in one line naming the first; a reader
of a checkpoint holds it against the run's rotation. podgpt writes only into a folder that is empty or its
own, deletes only what carries its mark or its name (util.remove), leaves nothing behind when refused, and
stops at a write the disk refuses with one line that says how to go on (the same command resumes).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import zlib

import pytest
import torch

from podgpt.core.checkpoint import verify_checkpoint, write_files
from conftest import ROOT, TINY_MODEL, Captured, popen, run, run_script, shared, train_tiny, tree

FAST = ["--micro_batch_size=4", "--total_batch_tokens=256"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, stdlib_data):
    """A finished 4-step run holding the checkpoints of steps 2 and 4; tests copy it."""
    def build(out):
        with Captured() as captured:
            train_tiny(captured, out, stdlib_data, *FAST, "--max_steps=4", "--ckpt_every=2", "--keep_last=2",
                       "--eval_every=4", "--save_best=False")
    out = shared(tmp_path_factory, "two_checkpoints", build)
    assert sorted(d for d in os.listdir(out / "ckpt") if d.startswith("step_")) == ["step_0000002", "step_0000004"]
    return out


def copy_run(src, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(src, out)
    return out


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def start_train(tmp_path, out, data, *args):
    log = open(tmp_path / "first.log", "w")
    p = popen([sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={out}", *TINY_MODEL, *FAST, *args],
              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()
    return p


def wait_until(condition, p, tmp_path, what):
    import time
    deadline = time.time() + 120
    while not condition():
        assert p.poll() is None and time.time() < deadline, f"never saw {what}\n{(tmp_path / 'first.log').read_text()}"
        time.sleep(0.05)


# -----------------------------------------------------------------------------
# one writer per folder

def test_a_second_train_py_on_a_running_out_dir_is_refused_naming_the_first(tmp_path, stdlib_data, capfd):
    """Two train.py on one out_dir deleted each other's checkpoints. Now the second stops at once with one
    line naming the first (its pid and command) and touches nothing; the first goes on, stops on SIGTERM with
    its checkpoint, and every checkpoint it left reads back intact."""
    out = tmp_path / "out"
    first = start_train(tmp_path, out, stdlib_data, "--max_steps=100000", "--ckpt_every=5", "--keep_last=1",
                        "--eval_every=100000", "--log_every=1")
    try:
        wait_until(lambda: os.path.exists(out / "ckpt" / "latest"), first, tmp_path, "a checkpoint")
        before = {p: v for p, v in tree(out).items() if p.startswith("ckpt/")}
        r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_MODEL, *FAST,
                        "--max_steps=3"], capfd)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, (tmp_path / "first.log").read_text()
    finally:
        if first.poll() is None:
            first.kill()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = error_lines(r.stderr)
    assert line.startswith(f"error: out_dir {out} is being written by another podgpt process (pid {first.pid} on ")
    assert "train.py" in line and line.endswith("): wait for it to end (or stop it), or choose another out_dir")
    assert "step" not in r.stdout  # it trained nothing
    log = (tmp_path / "first.log").read_text()
    assert "stopped at step" in log and "Traceback" not in log
    assert before  # what the first had written then was still its own when the second was refused
    for name in os.listdir(out / "ckpt"):
        if name.startswith("step_"):
            verify_checkpoint(str(out / "ckpt" / name))


def test_a_second_export_to_the_same_out_is_refused_while_the_first_writes(tmp_path, two_checkpoints):
    """export.py builds in a scratch folder beside --out; a second export.py to the same --out removed the
    first's scratch under it. The scratch is now held by the process that made it (here this test's): the
    second export is refused in one line and the scratch stays."""
    from podgpt.core.util import make_scratch, remove_scratch
    scratch = make_scratch(str(tmp_path / ".x.podgpt-export"))
    (tmp_path / ".x.podgpt-export" / "model.safetensors").write_bytes(b"half written")
    try:
        r = run([sys.executable, "export.py", f"--ckpt={two_checkpoints}", f"--out={tmp_path / 'x'}"], check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        [line] = error_lines(r.stderr)
        assert line.startswith(f"error: {scratch} is in use by another podgpt process (pid {os.getpid()} on ")
        assert (tmp_path / ".x.podgpt-export" / "model.safetensors").read_bytes() == b"half written"
        assert not (tmp_path / "x").exists()
    finally:
        remove_scratch(scratch)


def test_a_second_prepare_py_on_a_data_dir_being_built_is_refused(tmp_path, stdlib_data):
    """prepare.py builds in data_dir/.podgpt-prepare; a second prepare.py on the same data_dir removed the
    first's build under it. That folder is held while a build runs (here by this test): the second is refused
    at once, naming the holder, and neither the build nor the data beside it is touched."""
    from podgpt.core.util import make_scratch, remove_scratch
    data = shutil.copytree(stdlib_data, tmp_path / "data")
    scratch = make_scratch(str(data / ".podgpt-prepare"))
    (data / ".podgpt-prepare" / "train_000000.bin").write_bytes(b"half a shard")
    before = tree(tmp_path)
    try:
        r = run([sys.executable, "prepare.py", f"--data_dir={data}", "--force"], check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        [line] = error_lines(r.stderr)
        assert line.startswith(f"error: data_dir={data} is being written by another prepare.py (pid {os.getpid()} on ")
        assert line.endswith("): wait for it to end (or stop it), or choose another --data_dir")
        assert tree(tmp_path) == before
    finally:
        remove_scratch(scratch)


def test_a_checkpoint_being_read_outlives_the_rotation_that_would_remove_it(tmp_path, two_checkpoints, capfd):
    """sample.py, export.py (and eval) hold the checkpoint they read (checkpoint.reading): a training run's
    rotation passes it over, so the reader never loses its files; the next rotation after the read removes
    it. Export itself then works from the held folder."""
    from podgpt.core.checkpoint import reading
    out = copy_run(two_checkpoints, tmp_path)
    data = json.load(open(out / "config.json"))["data_dir"]
    with reading(str(out), "latest") as path:
        assert path == str(out / "ckpt" / "step_0000004")
        train_tiny(capfd, out, data, *FAST, "--max_steps=6", "--ckpt_every=1", "--keep_last=1", "--eval_every=6",
                   "--save_best=False")
        verify_checkpoint(path)  # still whole, though keep_last=1 and steps 5 and 6 were saved since
        assert sorted(d for d in os.listdir(out / "ckpt") if d.startswith("step_")) == ["step_0000004",
                                                                                        "step_0000006"]
        r = run_script(["export.py", f"--ckpt={path}", f"--out={tmp_path / 'export'}"], capfd)
        assert r.returncode == 0, r.stderr
    train_tiny(capfd, out, data, *FAST, "--max_steps=7", "--ckpt_every=1", "--keep_last=1", "--eval_every=7",
               "--save_best=False")
    assert sorted(d for d in os.listdir(out / "ckpt") if d.startswith("step_")) == ["step_0000007"]


# -----------------------------------------------------------------------------
# podgpt's own folders, and only those

def test_an_out_dir_holding_a_users_files_is_refused_untouched(tmp_path, stdlib_data, capfd):
    """train.py --out_dir=<a folder of the user's with config.json, summary.md, metrics.csv> overwrote them
    and exited 0. Now: one line naming them, exit 1, not one byte changed; sanity.py refuses it too."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("config.json", "summary.md", "metrics.csv"):
        (mine / name).write_text(f"the user's {name}\n")
    before = tree(tmp_path, stat=True)
    for args in (["train.py", *TINY_MODEL, "--max_steps=1"], ["sanity.py", "--device=cpu"]):
        r = run_script([*args, f"--data_dir={stdlib_data}", f"--out_dir={mine}"], capfd)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert error_lines(r.stderr) == [
            f"error: out_dir {mine} holds files podgpt did not write (config.json, metrics.csv, summary.md): give a "
            f"new or empty folder, or a podgpt run's own"]
    assert tree(tmp_path, stat=True) == before


def test_only_what_podgpt_made_is_deleted(tmp_path, two_checkpoints, capfd):
    """The rotation deletes old checkpoint folders by name; a link named like one (to the user's folder) is not
    podgpt's kind of entry: one line, and the link and its target stay. A checkpoint podgpt made is rotated."""
    out = copy_run(two_checkpoints, tmp_path)
    data = json.load(open(out / "config.json"))["data_dir"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "weights.bin").write_text("the user's")
    os.symlink(mine, out / "ckpt" / "step_0000001")
    r = train_tiny(capfd, out, data, *FAST, "--max_steps=5", "--ckpt_every=5", "--keep_last=1", "--eval_every=5",
                   "--save_best=False", check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert error_lines(r.stderr) == [f"error: {out}/ckpt/step_0000001 is in podgpt's way and podgpt did not make it: "
                                     f"move or rename it, then rerun"]
    assert (mine / "weights.bin").read_text() == "the user's" and os.path.islink(out / "ckpt" / "step_0000001")
    verify_checkpoint(str(out / "ckpt" / "step_0000005"))  # the save itself was made before the rotation stopped


def test_a_refused_dry_run_leaves_no_folders_behind(tmp_path, capfd):
    """A dry run refused before its first step (here: no data) made its first/ and resumed/ folders before it
    was refused, and left them, nested and empty but for podgpt's mark. Now the tree is as it was."""
    before = tree(tmp_path, stat=True)
    r = run_script(["train.py", f"--data_dir={tmp_path / 'nodata'}", f"--out_dir={tmp_path / 'a' / 'run'}",
                    *TINY_MODEL, "--dryrun_steps=2"], capfd)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert tree(tmp_path, stat=True) == before


def test_sample_falls_back_to_the_newest_intact_checkpoint(tmp_path, two_checkpoints, capfd):
    """latest (and best, which falls back to it) naming a damaged checkpoint: sample.py used to stop; it now
    says so in a warning and samples from the newest intact one."""
    out = copy_run(two_checkpoints, tmp_path)
    with open(out / "ckpt" / "step_0000004" / "model.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    r = run_script(["sample.py", f"--out_dir={out}", "--max_new_tokens=8", "--num_samples=1", "--device=cpu",
                    "--prompt=def "], capfd)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    [warning] = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warning.startswith(f"warning: {out}/ckpt/step_0000004 cannot be used (model.pt is corrupt (CRC32 ")
    assert warning.endswith(f"): using {out}/ckpt/step_0000002, the newest intact checkpoint")
    assert f"# {out}/ckpt/step_0000002" in r.stderr and r.stdout.startswith("def ")


# -----------------------------------------------------------------------------
# a full disk

def limited(size, script, *args):
    """`python script args` in a process whose files may not grow past `size` bytes (ulimit -f): every write
    past it fails as on a full disk (EFBIG instead of ENOSPC), whatever code makes it."""
    limit = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             f"resource.setrlimit(resource.RLIMIT_FSIZE, ({size}, {size})); sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    return run([sys.executable, "-c", limit, script, *args], check=False)


def test_a_full_disk_mid_run_stops_in_one_line_and_the_same_command_resumes(tmp_path, two_checkpoints, capfd):
    """On a disk that fills up (here: a file-size limit), a synchronous save died in torch's RuntimeError and
    a write of metrics.jsonl in an OSError traceback. Now a save that fails is a warning (training goes on),
    and the write into out_dir that fails stops the run with one line: free space and run the same command
    again, which resumes from the newest checkpoint. Nothing is half-written: metrics.jsonl holds whole lines,
    no temporary file or folder is left, and the checkpoint resumed from is intact."""
    out = copy_run(two_checkpoints, tmp_path)
    data = json.load(open(out / "config.json"))["data_dir"]
    args = [f"--data_dir={data}", f"--out_dir={out}", *TINY_MODEL, *FAST, "--max_steps=1000", "--ckpt_every=2",
            "--ckpt_async=False", "--log_every=1", "--eval_every=1000", "--keep_last=2", "--save_best=False"]
    r = limited(os.path.getsize(out / "metrics.jsonl") + 4000, "train.py", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warnings and all(" checkpoint failed (OSError: " in w for w in warnings), r.stderr
    assert error_lines(r.stderr) == [
        f"error: cannot write {out}/metrics.jsonl (OSError: [Errno 27] File too large): free disk space (or raise "
        f"the quota or file-size limit), then run the same command again: it resumes from step 4"]
    assert all(line.endswith("\n") for line in open(out / "metrics.jsonl"))
    leftovers = [p for p in tree(out) if p.endswith(".tmp") or "/.tmp-" in p or ".write-test" in p]
    assert leftovers == [] and (out / "ckpt" / "latest").read_text() == "step_0000004"
    verify_checkpoint(str(out / "ckpt" / "step_0000004"))
    r = run_script(["train.py", *args, "--max_steps=6"], capfd)
    assert r.returncode == 0 and f"resumed from {out}/ckpt/step_0000004 at step 4" in r.stdout, r.stderr


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, two_checkpoints):
    """safetensors' own error type (SafetensorError) escaped export.py as a traceback; its scratch folder
    stayed. Now: one line that says to make room and run the same command, and nothing left beside --out."""
    r = limited(50_000, "export.py", f"--ckpt={two_checkpoints}", f"--out={tmp_path / 'x'}")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = error_lines(r.stderr)
    assert line.startswith(f"error: cannot write out={tmp_path / 'x'} (OSError: [Errno 27] safetensors could not "
                           f"write {tmp_path}/.x.podgpt-export/model.safetensors: ")
    assert line.endswith("): free disk space (or raise the quota or file-size limit), then run the same command again")
    assert os.listdir(tmp_path) == []


def test_an_atomic_write_the_disk_refuses_leaves_no_temporary_file(tmp_path):
    """util.write_atomic writes x.tmp, then renames it over x: a write the disk refused left x.tmp behind."""
    script = ("import resource, signal, sys; from podgpt.core import util; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); "
              "util.write_atomic(sys.argv[1], 'x' * 100_000)")
    (tmp_path / "report.md").write_text("the one before")
    r = run([sys.executable, "-c", script, str(tmp_path / "report.md")], check=False)
    assert r.returncode == 1 and "File too large" in r.stderr.splitlines()[-1]
    assert os.listdir(tmp_path) == ["report.md"] and (tmp_path / "report.md").read_text() == "the one before"


def test_the_files_of_a_save_carry_their_whole_crc32_and_leave_torchs_own_option_as_it_was(tmp_path):
    # one thread a file, torch's own CRC32 of each record off meanwhile: each file's CRC32 (complete.json's) is the
    # whole file's, and torch.save elsewhere in the process computes its own again afterwards
    state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(7)}
    marker = write_files(str(tmp_path), {"model.pt": state, "optimizer.pt": {"step": 3}, "config.json": b"{}"})
    for name, m in marker.items():
        data = (tmp_path / name).read_bytes()
        assert m == dict(bytes=len(data), crc32=zlib.crc32(data)), name
    assert torch.equal(torch.load(tmp_path / "model.pt")["w"], state["w"])
    assert torch.load(tmp_path / "optimizer.pt") == {"step": 3}
    assert torch.serialization.get_crc32_options() is True
