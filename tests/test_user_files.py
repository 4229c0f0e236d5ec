"""Issue 44, family 1: podgpt replaces a file only when it can prove it wrote that exact content (its
record's sha256, or its mark on the folder); a user's file, or one edited since, is refused in one line
naming it, and nothing changes. Each case here overwrote the user's file before (exit 0)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, run_script, tree
from test_bad_input import finished_run  # noqa: F401 -- a fixture: a 1-step run of the tiny model

MINE = {"manifest.json": '{"mine": true}\n', "tokenizer.json": '{"my": "tokenizer"}\n'}


def error_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def users_folder(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return tree(folder)


@pytest.mark.parametrize("how", ["argument", "config"])
def test_skills_refuses_an_empty_pack_dir_and_writes_nothing(how, tmp_path):
    """Before: .podgpt, eval.jsonl, sft.jsonl and manifest.json written into the current folder over the
    user's own, then a FileNotFoundError traceback (exit 1)."""
    before = users_folder(tmp_path, {**MINE, "sft.jsonl": "my rows\n", "eval.jsonl": "mine\n"})
    (tmp_path.parent / f"{tmp_path.name}.py").write_text('pack_dir = ""\n')
    arg = "--pack_dir=" if how == "argument" else str(tmp_path.parent / f"{tmp_path.name}.py")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "skills.py"), arg, "--sft_rows=8",
                        "--eval_rows=8"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and error_line(r.stderr) == (
        "error: pack_dir is empty: give the pack's folder, e.g. --pack_dir=data/skills")
    assert tree(tmp_path) == before


def test_eval_replaces_only_its_own_report(finished_run, stdlib_data, tmp_path, capfd):  # noqa: F811
    """Before: a user's eval.json and eval.md in --out replaced, exit 0. Now refused; eval.py's own report
    there is replaced, and once edited, refused."""
    out = tmp_path / "f"
    before = users_folder(out, {"eval.json": "{}\n", "eval.md": "my notes\n"})
    args = ["eval.py", f"--ckpt={finished_run}", f"--out={out}", "--device=cpu", "--mc=",
            "--pack_dir=", f"--data_dir={stdlib_data}", "--eval_batches=1", "--micro_batch_size=2"]
    r = run_script(args, capfd)
    assert r.returncode == 1 and error_line(r.stderr) == (
        f"error: {out / 'eval.json'} is not as podgpt wrote it (a file of yours, or edited since): not "
        "replacing it; move it away, or give another --out=FOLDER")
    assert tree(out) == before
    for name in before:
        (out / name).unlink()
    assert run_script(args, capfd).returncode == 0
    assert run_script(args, capfd).returncode == 0  # its own, replaced
    (out / "eval.md").write_text("edited\n")
    before = tree(out)
    r = run_script(args, capfd)
    assert r.returncode == 1 and f"{out / 'eval.md'} is not as podgpt wrote it" in error_line(r.stderr)
    assert tree(out) == before


@pytest.mark.parametrize("script", ["export", "handoff"])
def test_an_edited_model_card_or_readme_is_not_replaced(script, finished_run, tmp_path, capfd):  # noqa: F811
    """Before: export.py over an export whose README.md (the model card) was edited, and handoff.py over a
    bundle whose README.md was, exit 0 and the edits gone. An unedited one is still replaced."""
    out = tmp_path / "out"
    args = (["export.py", f"--ckpt={finished_run}", f"--out={out}"] if script == "export" else
            ["handoff.py", f"--run={finished_run}", f"--out={out}", "--override_gate=True"])
    assert run_script(args, capfd).returncode == 0
    assert run_script(args, capfd).returncode == 0  # unedited: replaced, as before
    with open(out / "README.md", "a") as f:
        f.write("my edit\n")
    before = tree(tmp_path)
    r = run_script(args, capfd)
    kind = "export" if script == "export" else "bundle"
    assert r.returncode == 1 and error_line(r.stderr) == (
        f"error: out={out}: README.md was changed since {script}.py wrote it: not replacing this earlier "
        f"{kind}; move README.md (or the {kind}) away, or choose another --out")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("chat", [False, True])
def test_prepare_refuses_a_data_dir_holding_a_users_manifest(chat, stdlib_data, tmp_path, capfd):
    """Before: the user's manifest.json and tokenizer.json replaced by a build, exit 0."""
    before = users_folder(tmp_path / "d", MINE)
    args = ["prepare.py", f"--data_dir={tmp_path / 'd'}", "--max_docs=20", "--val_fraction=0"]
    if chat:
        (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "1+1?", "reply": "2"}) + "\n")
        args += [f"--source={tmp_path / 'sft.jsonl'}", "--chat=True", f"--chat_base={stdlib_data}"]
    r = run_script(args, capfd)
    assert r.returncode == 1 and error_line(r.stderr) == (
        f"error: {tmp_path / 'd' / 'manifest.json'} is not as podgpt wrote it (no .podgpt-data of "
        "prepare.py's beside it, and no podgpt manifest.json): not replacing it; move it away, or choose "
        "another --data_dir")
    assert tree(tmp_path / "d") == before


def test_prepare_rebuilds_a_folder_it_prepared_before_it_kept_a_mark(stdlib_data, tmp_path, capfd):
    """A data_dir prepared before .podgpt-data existed (its manifest a podgpt manifest that reads) is still
    prepare.py's to rebuild with --force; the rebuild leaves the mark, and two builds leave the same bytes."""
    data = tmp_path / "d"
    shutil.copytree(stdlib_data, data)
    mark = (data / ".podgpt-data").read_text()
    (data / ".podgpt-data").unlink()
    r = run_script(["prepare.py", f"--data_dir={data}", "--max_docs=20", "--val_fraction=0", "--force"], capfd)
    assert r.returncode == 0, r.stderr
    assert (data / ".podgpt-data").read_text() == mark
    assert json.load(open(data / "manifest.json"))["vocab_size"] == 257
