"""Cases that left a user stuck or unsure: a hand-off cut short in its last cleanup refused every rerun; two
skills.py on one pack_dir both said "wrote"; a download_dir that is a file ended in a bare errno; config mistakes
of skills.py and handoff.py exited 1; torchrun's traceback followed podgpt's one line."""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from podgpt.core.util import SCRATCH_MARK
from podgpt.release import hf
from conftest import ROOT, run, run_script, tree
from test_bad_input import finished_run  # noqa: F401 -- a fixture: a finished 1-step run (stdlib)
from test_handoff import checked

# handoff.py as a process, its put_in_place dying (a SIGKILL's exit) where it removes the earlier bundle
KILLED_IN_CLEANUP = """
import importlib, os, sys
from podgpt.core.util import run_main
from podgpt.release import hf
removed = hf.remove_scratch
hf.remove_scratch = lambda path: os._exit(137) if path.endswith("podgpt-old") else removed(path)
run_main(importlib.import_module(sys.argv[1]).main, sys.argv[2:])
"""


def test_a_handoff_killed_in_its_last_cleanup_is_finished_by_the_rerun(finished_run, tmp_path, capfd):  # noqa: F811
    """A kill between the new bundle's rename into place and the earlier one's removal left the earlier one in
    .NAME.podgpt-old/old, and every rerun refused. The rerun removes it when the folder is podgpt's (marked, no
    live holder) and the bundle in place is whole as handoff.py wrote it; cut between the two renames (no bundle
    in place), the earlier bundle, whole, goes back. What podgpt cannot prove its own is refused as before."""
    out, aside = tmp_path / "bundle", tmp_path / ".bundle.podgpt-old"
    args = ["handoff.py", f"--run={finished_run}", f"--out={out}"]
    assert run_script(args, capfd).returncode == 0
    killed = run([sys.executable, "-c", KILLED_IN_CLEANUP, "handoff", *args[1:]], check=False)
    assert killed.returncode == 137, killed.stderr[-2000:]
    assert sorted(os.listdir(aside)) == [SCRATCH_MARK, "old"] and (aside / "old" / "podgpt-handoff.json").is_file()
    r = run_script(args, capfd)
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == ["bundle"] and checked(out)

    # cut between the renames: the earlier bundle waits beside and none is in place; it goes back, then is replaced
    shutil.copytree(out, aside / "old")
    (aside / SCRATCH_MARK).write_text("")
    shutil.rmtree(out)
    assert run_script(args, capfd).returncode == 0
    assert os.listdir(tmp_path) == ["bundle"] and checked(out)

    waits = (f"error: out={out}: an earlier bundle waits in {aside}/old, left by a replace cut short: move it back "
             f"to {out} (or away), then rerun")
    shutil.copytree(out, aside / "old")
    readme = (out / "README.md").read_text()
    for unproven in ("no mark", "an edited bundle in place", "a file of yours beside"):
        if unproven == "an edited bundle in place":
            (aside / SCRATCH_MARK).write_text("")
            (out / "README.md").write_text(readme + "mine\n")
        elif unproven == "a file of yours beside":
            (out / "README.md").write_text(readme)
            (aside / "notes.txt").write_text("mine")
        r = run_script(args, capfd)
        assert (r.returncode, r.stderr.splitlines()) == (1, [waits]), unproven
        assert (aside / "old" / "podgpt-handoff.json").is_file()


def test_an_export_killed_in_its_last_cleanup_is_finished_by_the_rerun(finished_run, tmp_path, capfd):  # noqa: F811
    """export.py replaces through the same code as handoff.py: its rerun finishes the replace a kill cut short
    (before: every rerun refused, an earlier export waiting in .NAME.podgpt-old/old)."""
    out = tmp_path / "export"
    args = ["export.py", f"--ckpt={finished_run}", f"--out={out}"]
    assert run_script(args, capfd).returncode == 0
    killed = run([sys.executable, "-c", KILLED_IN_CLEANUP, "export", *args[1:]], check=False)
    assert killed.returncode == 137 and (tmp_path / ".export.podgpt-old" / "old" / "podgpt.json").is_file()
    r = run_script(args, capfd)
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == ["export"] and hf.as_recorded(str(out))


# skills.py as a process that says when it has begun making its rows, then waits for the test's go
PAUSED_SKILLS = """
import os, sys, time
import skills
from podgpt.core.util import run_main
made, began, go = skills.template_pack, sys.argv[1], sys.argv[2]

def paused(cfg):
    open(began, "w").close()
    while not os.path.exists(go):
        time.sleep(0.05)
    return made(cfg)
skills.template_pack = paused
run_main(skills.main, sys.argv[3:])
"""


def test_a_second_skills_py_on_a_pack_dir_being_made_is_refused_and_the_first_pack_stays(tmp_path, capfd):
    """Two skills.py on one pack_dir both printed "wrote" and the later one's pack replaced the earlier's. The
    first now holds pack_dir (its mark's lock) from its start: the second, started while the first makes its
    rows, is refused in one line naming it and writes nothing; the first's pack is written whole."""
    import json
    import time
    from conftest import popen
    from podgpt.core.util import holder
    pack, began, go = tmp_path / "pack", tmp_path / "began", tmp_path / "go"
    small = ["--sft_rows=22", "--eval_rows=11"]
    first = popen([sys.executable, "-c", PAUSED_SKILLS, began, go, f"--pack_dir={pack}", *small, "--pack_seed=1"],
                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not began.exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.05)
        who = holder(str(pack / ".podgpt"))
        assert who.startswith(f"pid {first.pid} on ")
        r = run_script(["skills.py", f"--pack_dir={pack}", *small, "--pack_seed=2"], capfd)
        assert (r.returncode, r.stderr.splitlines(), r.stdout) == (1, [
            f"error: pack_dir {pack} is being written by another podgpt process ({who}): wait for it to end (or "
            "stop it), or choose another pack_dir"], "")
        assert os.listdir(pack) == [".podgpt"]
    finally:
        go.touch()
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and out.splitlines()[-1].startswith(f"wrote {pack}: 22 SFT rows"), err
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["seed"] == 1 and sorted(os.listdir(pack)) == [".podgpt", "eval.jsonl", "manifest.json",
                                                                   "sft.jsonl"]
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((pack / name).read_bytes()).hexdigest() == entry["sha256"]


def test_a_download_dir_that_is_a_file_is_one_line_naming_it(tmp_path, capsys):
    """prepare.py downloading a URL into --download_dir=<a file> ended in a bare "[Errno 20] Not a directory"; now
    one line names download_dir (or the file standing where its folder must be) and the fix, before anything is
    fetched or written."""
    from podgpt.core import util
    import prepare
    (tmp_path / "afile").write_text("mine")
    url = "http://127.0.0.1:9/doc.txt"  # nothing listens: the refusal comes before any request
    for download_dir, message in {
            "afile": "download_dir={d} is a file, not a folder: give the path of a folder for the downloads (it is "
                     "created), e.g. --download_dir=downloads",
            "afile/below": "download_dir={d}: {tmp}/afile is a file, not a folder: move it away, or choose another "
                           "--download_dir"}.items():
        before = tree(tmp_path)
        d = tmp_path / download_dir
        with pytest.raises(SystemExit) as stop:
            util.run_main(prepare.main, [f"--source={url}", f"--data_dir={tmp_path / 'data'}", f"--download_dir={d}",
                                         "--workers=1"])
        assert (stop.value.code, capsys.readouterr().err) == (1, "error: " + message.format(d=d, tmp=tmp_path)
                                                              + "\n")
        assert tree(tmp_path) == before


CATEGORY_LIST = ("arithmetic, word_problem, counting, sorting, units, date_add, weekday, month_add, string_edit, "
                 "yes_no, format")


@pytest.mark.parametrize("args, message", [
    (["skills.py", "--pack_dir={tmp}/pack", "--answer_style=cot"],
     "answer_style='cot' is not one of direct, scratchpad, mixed"),
    (["skills.py", "--pack_dir={tmp}/pack", "--sft_rows=-1"], "sft_rows=-1 must be 0 or more"),
    (["skills.py", "--pack_dir={tmp}/pack", "--eval_rows=-3"], "eval_rows=-3 must be 0 or more"),
    (["skills.py", "--pack_dir={tmp}/pack", "--max_draws=0"], "max_draws=0 and pack_workers=1 must be at least 1"),
    (["skills.py", "--pack_dir={tmp}/pack", "--pack_workers=0"],
     "max_draws=100 and pack_workers=0 must be at least 1"),
    (["skills.py", "--pack_dir={tmp}/pack", "--pack_source=rows.csv"],
     "pack_source='rows.csv' is not templates, gsm8k or a .jsonl file of rows"),
    (["skills.py", "--pack_dir={tmp}/pack", "--pack_categories=units,poetry"],
     f"pack_categories='units,poetry': no category 'poetry' (the categories: {CATEGORY_LIST})"),
    (["handoff.py", "--run={run}", "--out={tmp}/bundle", "--weights_dtype=float16"],
     "weights_dtype='float16' is not one of float32, bfloat16"),
    (["handoff.py", "--run={run}", "--out={tmp}/bundle", "--examples=-1"], "examples=-1 must be 0 or more"),
])
def test_a_config_mistake_of_skills_or_handoff_exits_2_in_one_line(args, message, finished_run,  # noqa: F811
                                                                    tmp_path, capfd):
    """docs/refusals.md: a config mistake exits 2. These exited 1 (handoff's weights_dtype named as "dtype", and
    only after the gate was read and a scratch folder made; examples=-1 dropped the last example silently); each is
    now one line naming the key as given, exit 2, and nothing written."""
    before = tree(tmp_path)
    r = run_script([a.format(tmp=tmp_path, run=finished_run) for a in args], capfd)
    assert (r.returncode, r.stderr, r.stdout) == (2, f"error: {message}\n", "")
    assert tree(tmp_path) == before


def test_a_failed_worker_under_run_sh_s_torchrun_leaves_its_own_line_and_its_exit_status(tmp_path):
    """run.sh launches torchrun through podgpt.pod.torchrun: a worker's `error:` line was followed by torchrun's
    ChildFailedError traceback; now the line is the last word and the exit status is the worker's (a worker
    killed by a signal: 128 + its number, as a shell reports it)."""
    launch = [sys.executable, "-m", "podgpt.pod.torchrun", "--standalone", "--nproc_per_node=2"]
    r = run([*launch, "train.py", f"--data_dir={tmp_path / 'nodata'}", f"--out_dir={tmp_path / 'out'}",
             "--device=cpu"], check=False)
    line = f"error: no manifest.json in {tmp_path / 'nodata'}: run python prepare.py --data_dir={tmp_path / 'nodata'}"
    assert r.returncode == 1 and line in r.stderr.splitlines(), r.stderr
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr
    killed = tmp_path / "killed.py"
    killed.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    r = run([*launch, killed], check=False)
    assert r.returncode == 128 + 9 and "Traceback" not in r.stderr, r.stderr
    with open(os.path.join(ROOT, "run.sh")) as f:
        assert "\nTORCHRUN=($PYTHON -m podgpt.pod.torchrun)" in f.read()  # each of run.sh's torchrun launches
