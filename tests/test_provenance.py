"""What a run records is what it did: a resume keeps the base it was fine-tuned from (init_from), needs
no base once it has checkpoints of its own, refuses an init_from that holds no checkpoint before any
gate, and leaves a user's files beside its checkpoints alone (issue 44's families 2, 3 and 7)."""
import json
import shutil
import sys

from conftest import TINY_MODEL, run, train_tiny
from test_bad_input import CKPT, TINY_RUN, finished_run  # noqa: F401 -- a fixture: a 1-step base run
from test_sft import SFT_ARGS, pack_rows, sft_data  # noqa: F401 -- a fixture: SFT data in the base's tokenizer

RUN = TINY_RUN[len(TINY_MODEL):]  # train_tiny adds TINY_MODEL


def test_a_user_s_files_beside_the_checkpoints_stay_and_the_run_goes_on(finished_run, stdlib_data, tmp_path,
                                                                       capfd):
    """A user's copy of a checkpoint (ckpt/step_0000010.bak) and notes (ckpt/step_0000001_notes.txt) are no
    checkpoints of the run: its rotation removes its own step_NNNNNNN folders around them and goes on."""
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    shutil.copytree(out / CKPT, out / "ckpt/step_0000010.bak")
    (out / "ckpt/step_0000001_notes.txt").write_text("my notes")
    r = train_tiny(capfd, out, stdlib_data, *RUN, "--max_steps=3", "--ckpt_every=1",
                   "--keep_last=1", "--save_best=False", check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "skipping checkpoint" not in r.stderr
    assert (out / "ckpt/step_0000001_notes.txt").read_text() == "my notes"
    assert (out / "ckpt/step_0000010.bak/complete.json").is_file()
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step_")) == [
        "step_0000001_notes.txt", "step_0000003", "step_0000010.bak"]


def sft_run(capfd, tmp_path, sft_data, init_from, *args, check=True):
    """train.py as run.sh's sft stage runs it (--init_from=OUT, every time) into tmp_path/sft."""
    return train_tiny(capfd, tmp_path / "sft", sft_data, *SFT_ARGS, f"--init_from={init_from}", *args,
                      check=check)


def test_a_resume_keeps_the_base_it_was_fine_tuned_from(finished_run, sft_data, tmp_path, capfd):
    """An SFT run resumed with another init_from is refused in one line naming the key, the recorded and the
    given value and the fix; its config.json still names the base its weights came from."""
    for name in ("base", "other"):
        shutil.copytree(finished_run, tmp_path / name)
    sft_run(capfd, tmp_path, sft_data, tmp_path / "base", "--max_steps=1")
    r = sft_run(capfd, tmp_path, sft_data, tmp_path / "other", "--max_steps=2", check=False)
    lines = r.stderr.strip().splitlines()
    assert (r.returncode, "Traceback" in r.stderr, len(lines)) == (1, False, 1), r.stderr[-2000:]
    sft, base, other = tmp_path / "sft", tmp_path / "base", tmp_path / "other"
    assert lines[0] == (
        f"error: checkpoint {sft}/{CKPT} records init_from={base}, and this resume gives init_from={other}: "
        f"resume with --init_from={base} (the recorded value), or use a new out_dir to fine-tune from {other}")
    assert json.loads((sft / "config.json").read_text())["init_from"] == str(base)
    assert not (sft / "ckpt/step_0000002").exists()


def test_an_sft_run_resumes_without_its_base(finished_run, sft_data, tmp_path, capfd):
    """Once an SFT run has checkpoints of its own, its base folder may go: the same command (run.sh's, with
    --init_from) resumes, and the base gates judge the base its checkpoints recorded."""
    base = tmp_path / "base"
    shutil.copytree(finished_run, base)
    sft_run(capfd, tmp_path, sft_data, base, "--max_steps=1")
    shutil.rmtree(base)
    r = sft_run(capfd, tmp_path, sft_data, base, "--max_steps=2", check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and (tmp_path / "sft/ckpt/step_0000002/complete.json").is_file()
    gates = {g["name"]: g for g in json.loads((tmp_path / "sft/preflight.json").read_text())["gates"]}
    assert gates["base_exposure"]["verdict"] != "block" and f"{base}/{CKPT}" in gates["base_exposure"]["detail"]
    record = json.loads((tmp_path / "sft/ckpt/step_0000002/config.json").read_text())
    assert record["init_from"] == str(base) and record["base"][1] == f"{base}/{CKPT}"


def test_a_byte_base_on_char_chat_data_names_the_tokenizer(finished_run, tmp_path, capfd):
    """SFT data prepared in a char tokenizer under a base trained in bytes. Before: "has another model shape (a
    larger vocabulary): give this run the base model's shape", a fix that cannot work; the fix is the data's."""
    with open(tmp_path / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in pack_rows())
    char = tmp_path / "char"
    run([sys.executable, "prepare.py", "--source=stdlib", "--max_docs=50", "--tokenizer=char", f"--data_dir={char}"])
    run([sys.executable, "prepare.py", f"--source={tmp_path / 'sft.jsonl'}", "--chat=True", f"--chat_base={char}",
         f"--data_dir={tmp_path / 'chat'}", "--val_fraction=0.2", "--min_val_tokens=0"])
    r = sft_run(capfd, tmp_path, tmp_path / "chat", finished_run, "--max_steps=1", check=False)
    lines = r.stderr.strip().splitlines()
    assert (r.returncode, "Traceback" in r.stderr, len(lines)) == (1, False, 1), r.stderr[-2000:]
    assert lines[0] == (
        f"error: init_from={finished_run} was trained with another tokenizer than {tmp_path / 'chat'}'s: prepare "
        f"the SFT data with python prepare.py --chat=True --chat_base={finished_run}/{CKPT}")
