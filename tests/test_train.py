"""train.py: gradient accumulation, DDP equivalence, resume, checkpoint contents (bad input: test_bad_input.py)."""
import json
import os
import shutil
import sys

import pytest
import torch

from conftest import read_metrics, run, train_losses
from conftest import train_tiny as train


def test_grad_accumulation_equals_a_bigger_micro_batch(tmp_path, stdlib_data, capfd):
    # 4 micro-steps of 2 sequences against 1 micro-step of 8: the same 8 sequences, the same step
    common = ["--total_batch_tokens=512", "--max_steps=1", "--log_every=1", "--eval_every=1", "--ckpt_every=1"]
    train(capfd, tmp_path / "accum", stdlib_data, "--micro_batch_size=2", *common)
    train(capfd, tmp_path / "whole", stdlib_data, "--micro_batch_size=8", *common)
    a, b = read_metrics(tmp_path / "accum")[0], read_metrics(tmp_path / "whole")[0]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=0)
    # the step's gradient, read back from AdamW's first moment (exp_avg = (1 - beta1) * grad)
    ga = torch.load(tmp_path / "accum/ckpt/step_0000001/optimizer.pt", weights_only=True)["state"]
    gb = torch.load(tmp_path / "whole/ckpt/step_0000001/optimizer.pt", weights_only=True)["state"]
    assert len(ga) == len(gb) > 0
    for i in ga:
        a, b = ga[i]["exp_avg"], gb[i]["exp_avg"]
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), i
    # and the weights after it (Adam's first update is ~lr*sign(grad), so compare at 1% of lr)
    wa = torch.load(tmp_path / "accum/ckpt/step_0000001/model.pt", weights_only=True)
    wb = torch.load(tmp_path / "whole/ckpt/step_0000001/model.pt", weights_only=True)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-5, msg=name)


def test_ddp_two_ranks_match_one_process(tmp_path, stdlib_data, capfd):
    # the same global batch (2 x 4 sequences): accumulation 2 on one process, 1 on each of two ranks
    common = ["--micro_batch_size=4", "--total_batch_tokens=512", "--max_steps=10", "--log_every=1",
              "--eval_every=5", "--ckpt_every=10"]
    train(capfd, tmp_path / "single", stdlib_data, *common)
    r = train(capfd, tmp_path / "ddp", stdlib_data, *common, nproc=2)
    assert "world 2 x micro 4 x accum 1" in r.stdout
    single, ddp = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert sorted(single) == list(range(1, 11)) and sorted(ddp) == list(range(1, 11))
    for step in single:
        assert ddp[step] == pytest.approx(single[step], rel=1e-5, abs=0), step
    assert single[10] < single[1]


def test_resume_continues_the_same_run(tmp_path, stdlib_data, capfd):
    common = ["--micro_batch_size=4", "--total_batch_tokens=256", "--max_steps=12", "--log_every=1",
              "--eval_every=6", "--ckpt_every=6", "--keep_last=5"]
    full = tmp_path / "full"
    train(capfd, full, stdlib_data, *common)
    # the same run "interrupted" after its step-6 checkpoint: resume=auto picks it up
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    (cut / "ckpt/latest").write_text("step_0000006")
    shutil.rmtree(cut / "ckpt/step_0000012")
    r = train(capfd, cut, stdlib_data, *common)
    assert "resumed from" in r.stdout and "at step 6" in r.stdout
    steps = [m["step"] for m in read_metrics(cut) if "loss" in m]
    assert steps == list(range(1, 13))  # lines past step 6 were dropped, then written again
    a, b = train_losses(full), train_losses(cut)
    for step in range(1, 13):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=0), step
    summary = json.load(open(cut / "summary.json"))
    assert summary["steps"] == 12 and summary["status"] == "completed"


def test_checkpoint_holds_what_resume_and_sampling_need(tmp_path, stdlib_data, capfd):
    train(capfd, tmp_path, stdlib_data, "--micro_batch_size=2", "--total_batch_tokens=128", "--max_steps=3",
          "--ckpt_every=2", "--keep_last=1")
    ckpts = sorted(os.listdir(tmp_path / "ckpt"))
    # keep_last=1 rotated step 2 away; the final evaluation is the best so far; no temporary folder left
    assert ckpts == ["best", "latest", "step_0000003"]
    folder = tmp_path / "ckpt/step_0000003"
    files = {"model.pt", "optimizer.pt", "trainer.pt", "config.json", "tokenizer.json"}
    assert files | {"complete.json"} <= set(os.listdir(folder))
    marker = json.load(open(folder / "complete.json"))  # written last: every file's size and CRC32
    assert marker["step"] == 3 and files <= set(marker["files"])
    assert all(os.path.getsize(folder / f) == m["bytes"] for f, m in marker["files"].items())
    state = torch.load(folder / "trainer.pt", weights_only=True)
    assert state["step"] == 3 and state["samples"] == 3 * 2 and state["format"] == 2
    assert {"python", "numpy", "torch", "cuda"} <= set(state["rng"][0])
    assert state["loss_ema"] > 0 and state["elapsed"] > 0 and state["best_step"] == 3 and state["spikes"] == 0
    config = json.load(open(folder / "config.json"))
    assert config["max_steps"] == 3 and config["model"]["n_layer"] == 2 and config["data_fingerprint"]
    assert config["tokenizer_fingerprint"].startswith("byte:")


def test_resume_on_other_data_only_with_the_override(tmp_path, stdlib_data, capfd):
    """Continuing a run on new data (a second corpus, a fine-tune) is refused unless asked for;
    with allow_resume_mismatch=True it resumes from the checkpoint and trains on the new data."""
    common = ["--micro_batch_size=2", "--total_batch_tokens=128", "--ckpt_every=2", "--log_every=1"]
    train(capfd, tmp_path / "out", stdlib_data, *common, "--max_steps=2")
    other = tmp_path / "other"
    run([sys.executable, "prepare.py", "--source=stdlib", "--tokenizer=byte", f"--data_dir={other}", "--max_docs=50",
         "--val_fraction=0.2"])
    r = train(capfd, tmp_path / "out", other, *common, "--max_steps=4", check=False)
    assert r.returncode == 1 and "was trained on other data" in r.stderr
    r = train(capfd, tmp_path / "out", other, *common, "--max_steps=4", "--allow_resume_mismatch=True")
    assert "resumed from" in r.stdout and "at step 2" in r.stdout
    assert json.load(open(tmp_path / "out/ckpt/step_0000004/config.json"))["data_dir"] == str(other)
