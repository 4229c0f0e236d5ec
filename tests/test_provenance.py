"""What a run records is what it did: a resume keeps the base it was fine-tuned from (init_from), needs
no base once it has checkpoints of its own, refuses an init_from that holds no checkpoint before any
gate, and leaves a user's files beside its checkpoints alone (issue 44's families 2, 3 and 7)."""
import json
import shutil

from conftest import TINY_MODEL, train_tiny
from test_bad_input import CKPT, TINY_RUN, finished_run  # noqa: F401 -- a fixture: a 1-step base run
from test_sft import SFT_ARGS, sft_data  # noqa: F401 -- a fixture: SFT data in the base's tokenizer

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
