"""Issue 44's damaged files and hangs: a pointer that is not UTF-8, metrics.jsonl that is a folder, a
long_run_gate train.py did not write, honesty.py on a null category, a self-based run or a full disk, an
--attach nested too deep, eval.py's and skills.py's unbounded arguments. Each is one line, no traceback."""
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_script
from podgpt.core import owned
from test_bad_input import finished_run  # noqa: F401 -- a fixture: the shared finished 1-step run
from test_damaged_inputs import refused

DAMAGED = ("…/ckpt/best is damaged (not UTF-8 text): delete it (the newest intact checkpoint is then used) "
           "or write a checkpoint folder's name into it, then rerun")


def copy_run(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "out")
    return tmp_path / "out"


def edit_json(path, change):
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("script", ["sample.py", "export.py", "eval.py"])
def test_a_pointer_that_is_not_utf8_is_one_line(script, finished_run, tmp_path, capfd):
    out = copy_run(finished_run, tmp_path)
    (out / "ckpt" / "latest").write_bytes(b"\xff\xfe")
    (out / "ckpt" / "best").write_bytes(b"\xff")
    (tmp_path / "lm.json").write_text(json.dumps({"results": {"t": {"acc": 0.5}}}))
    args = {"sample.py": [f"--out_dir={out}", "--max_new_tokens=2"],
            "export.py": [f"--ckpt={out}", f"--out={tmp_path / 'dest'}"],
            "eval.py": [f"--out_dir={out}", f"--attach={tmp_path / 'lm.json'}"]}[script]
    refused(run_script([script, *args], capfd), DAMAGED)


def test_metrics_jsonl_that_is_a_folder_is_one_line_on_resume(finished_run, stdlib_data, tmp_path, capfd):
    from test_bad_input import TINY_RUN
    out = copy_run(finished_run, tmp_path)
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").mkdir()
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_RUN, "--max_steps=2"], capfd)
    refused(r, f"{out}/metrics.jsonl is a folder, not the run's metrics file: move it out of the way, then rerun")


@pytest.mark.parametrize("gate", [{}, {"profile": "nope", "gates": [], "post_run": []}])
def test_a_long_run_gate_train_py_did_not_write_is_one_line_in_eval_py(gate, finished_run, tmp_path, capfd):
    out = copy_run(finished_run, tmp_path)
    edit_json(out / "summary.json", lambda s: s.update(long_run_gate=gate))
    pack = tmp_path / "pack"
    assert run_script(["skills.py", f"--pack_dir={pack}", "--sft_rows=11", "--eval_rows=11"], capfd).returncode == 0
    r = run_script(["eval.py", f"--out_dir={out}", f"--pack_dir={pack}", "--max_new_tokens=2"], capfd)
    refused(r, f"{out}/summary.json: its long_run_gate is not one train.py wrote (profile {gate.get('profile')!r}; "
               "the profiles: research, release, skill_release), so the eval floors are not added to it: put back "
               "the run's own summary.json, then run eval.py again")


def test_honesty_on_a_null_category_and_on_a_run_based_on_itself(finished_run, tmp_path, capfd):
    out = copy_run(finished_run, tmp_path)
    (out / "eval.json").write_text(json.dumps({"pack": {"categories": {"arithmetic": None}}}))
    refused(run_script(["honesty.py", f"--run={out}"], capfd),
            f"{out}/eval.json: its pack categories are not as eval.py writes them (one is null or not an object): "
            "run eval.py again, then honesty.py")
    (out / "eval.json").unlink()
    edit_json(out / "config.json", lambda c: c.update(init_from=str(out)))
    refused(run_script(["honesty.py", f"--run={out}"], capfd),
            f"{out}/config.json: init_from={out} names the run itself (or a run based on it): put back the "
            "config.json train.py wrote, then rerun")


def test_honesty_on_a_full_disk_is_one_line(finished_run, tmp_path, monkeypatch, capfd):
    out = copy_run(finished_run, tmp_path)

    def full(path, obj):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(owned, "write_atomic", full)  # every replace_files write
    refused(run_script(["honesty.py", f"--run={out}"], capfd),
            f"cannot write honesty.json and honesty.md into {out} (OSError: [Errno {errno.ENOSPC}] "
            f"{os.strerror(errno.ENOSPC)}): free disk space (or raise the quota or file-size limit), then run the "
            "same command again")


def test_eval_on_a_full_disk_says_so(finished_run, tmp_path, monkeypatch, capfd):
    (tmp_path / "lm.json").write_text(json.dumps({"results": {"t": {"acc": 0.5}}}))

    def full(path, obj):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(owned, "write_atomic", full)
    r = run_script(["eval.py", f"--out_dir={finished_run}", f"--attach={tmp_path / 'lm.json'}",
                    f"--out={tmp_path / 'e'}"], capfd)
    refused(r, f"cannot write eval.json and eval.md into {tmp_path / 'e'} (OSError: [Errno {errno.ENOSPC}] "
               f"{os.strerror(errno.ENOSPC)}): free disk space (or raise the quota or file-size limit), then run the "
               "same command again")


def test_an_attach_nested_too_deep_is_one_line(finished_run, tmp_path, capfd):
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    r = run_script(["eval.py", f"--out_dir={finished_run}", f"--attach={tmp_path / 'deep.json'}"], capfd)
    refused(r, f"attach={tmp_path / 'deep.json'} cannot be read (nested too deeply): give the results JSON lm_eval "
               "wrote", status=2)


def test_huge_counts_are_refused_before_any_work(finished_run, tmp_path, capfd):
    r = run_script(["eval.py", f"--out_dir={finished_run}", "--attach=x.json", "--max_new_tokens=1000000000"], capfd)
    refused(r, "max_new_tokens=1000000000 is out of range: use an integer from 1 to 1024 (as sample.py's server caps "
               "a request)", status=2)
    r = run_script(["skills.py", f"--pack_dir={tmp_path / 'pack'}", "--sft_rows=1000000000"], capfd)
    refused(r, "sft_rows=1000000000 is more than a pack holds (at most 1,000,000 rows a split): ask for fewer rows "
               "(--sft_rows / --eval_rows)", status=2)
    assert not (tmp_path / "pack").exists()


def interrupt_while_torch_loads(args, env=None):
    """Start args, send SIGINT (to its process group) once torch's library is being mapped in, before any
    script's main() runs: the moment a user's Ctrl-C lands in a script's first seconds. (exit status, stderr)."""
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 60
    while p.poll() is None and time.time() < deadline:
        with contextlib.suppress(OSError):  # the maps of each python of its session: the script's
            pids = subprocess.run(["pgrep", "-s", str(p.pid), "-f", "python"], capture_output=True,
                                  text=True).stdout.split()
            if any("libtorch" in open(f"/proc/{pid}/maps").read() for pid in pids):
                break
        time.sleep(0.002)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return p.returncode, err


@pytest.mark.parametrize("script", ["train.py", "sample.py", "export.py"])
def test_ctrl_c_while_a_script_loads_is_one_line(script):
    """Before: a KeyboardInterrupt traceback from inside `import torch` (exit -2)."""
    code, err = interrupt_while_torch_loads([sys.executable, script, "--out_dir=nowhere"])
    assert (code, err) == (130, "error: interrupted (Ctrl-C)\n")


def test_ctrl_c_while_run_sh_s_sample_stage_loads_is_one_line(tmp_path):
    """Through run.sh: its sample stage ends in one line, and run.sh stops by SIGINT."""
    env = dict(os.environ, STAGES="sample", OUT_DIR=str(tmp_path / "out"), PYTHON=sys.executable)
    code, err = interrupt_while_torch_loads(["bash", "run.sh"], env)
    assert code == -signal.SIGINT and "Traceback" not in err, err
    assert err.splitlines() == ["error: interrupted (Ctrl-C)", "run.sh: sample stopped by SIGINT; no later stage runs"]
