"""dist_mode=fsdp: FSDP2 computes what DDP and one process compute, its checkpoints are sharded
(torch.distributed.checkpoint, written in the background) and reshard on resume to another world size
or dist_mode, a kill in the middle of a sharded background save leaves the previous checkpoint in
charge, and sample/export read sharded checkpoints whole. CPU, gloo, fp32."""
import os
import sys

import pytest
import torch

from conftest import read_metrics, run, shared, train_losses
from test_resume import ARGS, CKPT_EVERY, MAX_STEPS, assert_identical, ckpt_steps, load, train, wrapper
from podgpt.core.checkpoint import MARKER, STATE_DIR, find_checkpoint
from podgpt.pod.checkpoints import load_model

FSDP = ["--dist_mode=fsdp"]
RESUME_AT = 2 * CKPT_EVERY


def assert_close_losses(out, ref, steps):
    """Per-step losses of `out` equal `ref`'s within 1e-5 relative (fp32: the ranks' sums may round differently)."""
    got, want = train_losses(out), train_losses(ref)
    assert sorted(got) == list(steps), sorted(got)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    assert worst <= 1e-5, f"largest relative difference {worst:.2e}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stdlib_data):
    """The same 16 steps on one process, on 2 ranks under DDP and on 2 ranks under FSDP. The ranks run as
    on a pod with one GPU, which a CPU run must leave alone (gloo, a CPU mesh, no CUDA call)."""
    layouts = (("single", 1, []), ("ddp", 2, []), ("fsdp", 2, FSDP))

    def build(root):
        for name, nproc, args in layouts:
            train(root / name, stdlib_data, *ARGS, *args, nproc=nproc, fake_gpus=1)
    root = shared(tmp_path_factory, "fsdp_runs", build)
    return {name: root / name for name, _, _ in layouts}


def test_fsdp_ddp_and_one_process_compute_the_same_steps(runs):
    assert_close_losses(runs["ddp"], runs["single"], range(1, MAX_STEPS + 1))
    assert_close_losses(runs["fsdp"], runs["single"], range(1, MAX_STEPS + 1))
    final = runs["fsdp"] / f"ckpt/step_{MAX_STEPS:07d}"
    # sharded: each rank's part of model and optimizer in state/, no single-file model.pt
    assert os.path.isdir(final / STATE_DIR) and not os.path.exists(final / "model.pt")
    assert {f for f in os.listdir(final / STATE_DIR)} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    # load_model (sample.py, export.py) gathers the shards whole: the weights the one process trained
    fsdp_model, _ = load_model(str(final))
    single_model, _ = load_model(find_checkpoint(str(runs["single"])))
    for (name, a), b in zip(fsdp_model.state_dict().items(), single_model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_param_norm_is_the_whole_models_on_every_layout(runs):
    """metrics.jsonl's param_norm: under FSDP the shards' squares summed over the ranks, so each step's equals
    one process's and DDP's, and the last equals the norm of the final checkpoint's parameters."""
    norms = {name: {r["step"]: r["param_norm"] for r in read_metrics(out) if "param_norm" in r}
             for name, out in runs.items()}
    assert sorted(norms["fsdp"]) == list(range(1, MAX_STEPS + 1))
    for name in ("ddp", "fsdp"):
        for step, norm in norms["single"].items():
            assert norms[name][step] == pytest.approx(norm, rel=1e-5), (name, step)
    model, _ = load_model(str(runs["fsdp"] / f"ckpt/step_{MAX_STEPS:07d}"))
    whole = torch.sqrt(sum(p.double().square().sum() for p in model.parameters())).item()
    assert norms["fsdp"][MAX_STEPS] == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("grad_ckpt", ["full", "selective"])
def test_fsdp_composes_with_activation_checkpointing(runs, stdlib_data, tmp_path, grad_ckpt):
    """Recomputing each block's activations inside FSDP's gather and reduce leaves the steps as they were."""
    out = tmp_path / grad_ckpt
    train(out, stdlib_data, *ARGS, *FSDP, f"--grad_ckpt={grad_ckpt}", nproc=2)
    assert_close_losses(out, runs["fsdp"], range(1, MAX_STEPS + 1))


@pytest.mark.parametrize("nproc,mode", [(1, "fsdp"), (1, "ddp"), (2, "fsdp")])
def test_a_sharded_checkpoint_resumes_at_another_world_size_and_mode(runs, stdlib_data, tmp_path, nproc, mode):
    """Saved by 2 FSDP ranks at step 10; resumed by 1 or 2 ranks, sharded or not: the next steps
    are the uninterrupted 2-rank run's."""
    out = tmp_path / "resumed"
    ckpt = runs["fsdp"] / f"ckpt/step_{RESUME_AT:07d}"
    r = train(out, stdlib_data, *ARGS, f"--dist_mode={mode}", f"--resume={ckpt}", nproc=nproc)
    assert f"resumed from {ckpt} at step {RESUME_AT}" in r.stdout
    assert_close_losses(out, runs["fsdp"], range(RESUME_AT + 1, MAX_STEPS + 1))


def test_a_ddp_checkpoint_resumes_under_fsdp(runs, stdlib_data, tmp_path):
    out = tmp_path / "resumed"
    ckpt = runs["ddp"] / f"ckpt/step_{RESUME_AT:07d}"
    train(out, stdlib_data, *ARGS, *FSDP, f"--resume={ckpt}", nproc=2)
    assert_close_losses(out, runs["ddp"], range(RESUME_AT + 1, MAX_STEPS + 1))
    assert os.path.isdir(out / f"ckpt/step_{MAX_STEPS:07d}" / STATE_DIR)


KILL_AFTER_SECOND_SHARDED_SAVE = """\
import threading
import torch.distributed.checkpoint as dcp

_save, _train_batch = dcp.save, data.Loader.train_batch
saves, moved_on = [], threading.Event()


def train_batch(self, first_sample, size, device):
    if step_of(first_sample) > {step}:  # a second step past the checkpoint at {step}: step {step} + 1 is logged
        moved_on.set()
    return _train_batch(self, first_sample, size, device)


def save(state, **where):
    _save(state, **where)
    saves.append(where)
    if len(saves) == 2 and RANK == 1:  # rank 1's shards of the second checkpoint are on disk
        moved_on.wait(60)  # written in the background: the loop trains on meanwhile
        os.kill(os.getpid(), signal.SIGKILL)


data.Loader.train_batch = train_batch
dcp.save = save
"""


def test_sigkill_during_a_sharded_save_leaves_the_previous_checkpoint(runs, stdlib_data, tmp_path):
    """Rank 1 killed in the background write of the step-10 checkpoint, its shards on disk, while the loop
    trained on: rank 0 never writes the marker, latest stays at step 5, and the same command resumes
    from there bit-identically."""
    out = tmp_path / "killed"
    script = wrapper(tmp_path, KILL_AFTER_SECOND_SHARDED_SAVE, step=RESUME_AT)
    r = train(out, stdlib_data, *ARGS, *FSDP, script=script, nproc=2, check=False, torchrun=True)
    assert r.returncode != 0
    assert (out / "ckpt/latest").read_text() == f"step_{CKPT_EVERY:07d}"
    assert ckpt_steps(out) == [CKPT_EVERY]
    assert max(train_losses(out)) > RESUME_AT  # the save held the loop only for its copy into memory
    partial = out / f"ckpt/.tmp-step_{RESUME_AT:07d}"
    assert os.path.isdir(partial / STATE_DIR) and not os.path.exists(partial / MARKER)
    train(out, stdlib_data, *ARGS, *FSDP, nproc=2, torchrun=True)  # the same command, with train.py
    assert not os.path.exists(partial)
    assert train_losses(out) == train_losses(runs["fsdp"])  # same ranks, same mode: bit-identical
    final = f"ckpt/step_{MAX_STEPS:07d}"
    t, t_ref = load(out / final, "trainer.pt"), load(runs["fsdp"] / final, "trainer.pt")
    for state in (t, t_ref):
        del state["elapsed"]
    assert_identical(t, t_ref, "trainer.pt")


def test_export_reads_a_sharded_checkpoint(runs, tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    from podgpt.release.hf import load_export
    dest = tmp_path / "hf"
    run([sys.executable, "export.py", f"--ckpt={runs['fsdp']}", f"--out={dest}", "--which=latest"])
    exported, _ = load_export(str(dest), "cpu")
    ours, _ = load_model(find_checkpoint(str(runs["fsdp"])))
    assert_identical(exported.state_dict(), ours.state_dict(), "exported weights")
