"""optimizer=muon: Muon for the blocks' matrices, AdamW for the rest (optim.make_optimizer, MuonAdamW), each group
on the schedule at its own peak; what it refuses; and a killed run resumed bit-identically, on 1 process and on
2 ranks, with Muon's momentum buffers in the checkpoint (test_resume.py's kill wrapper and comparison). The runs
train the refinement recipe: Muon with objective="refine" (each block applied 4 times, 2 supervision steps)."""
import shutil

import pytest
import torch

from conftest import Captured, read_metrics, shared, train_tiny
from model import GPT, GPTConfig
from podgpt.core.optim import MuonAdamW, make_optimizer
from test_resume import ARGS, KILL_AT_STEP, MAX_STEPS, assert_same_run, ckpt_steps, load, train, wrapper

MUON = ["--optimizer=muon"]
TRM = [*MUON, "--objective=refine", "--n_loops=1", "--n_sup_train=2", "--n_sup_inference=2"]
LEARNING_RATE, MATRIX_LR, EMBEDDING_LR = 1e-3, 0.02, 4e-3  # TINY_MODEL's learning_rate; train.py's defaults
KILL_STEP = 9  # just before the step-10 checkpoint: steps 6-9 are trained again from step 5's
BLOCK_MATRICES = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"}


def tiny_gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, **kw))


def muon_of(model, matrix_lr=MATRIX_LR):
    return make_optimizer(model, LEARNING_RATE, (0.9, 0.95), 0.1, fused=False, kind="muon", matrix_lr=matrix_lr,
                          embedding_lr=EMBEDDING_LR, momentum=0.95)


def names(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))[1].backward()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(tied):
    model = tiny_gpt(tie_embeddings=tied)
    opt = muon_of(model)
    assert isinstance(opt, MuonAdamW) and type(opt.muon) is torch.optim.Muon and type(opt.adamw) is torch.optim.AdamW
    (muon,), (decay, no_decay) = opt.muon.param_groups, opt.adamw.param_groups
    assert names(model, muon["params"]) == {f"layers.{i}.{m}.weight" for i in range(2) for m in BLOCK_MATRICES}
    # AdamW's rule as under optimizer=adamw: an untied head decays; the embedding and the norms never do
    assert names(model, decay["params"]) == (set() if tied else {"lm_head.weight"})
    assert names(model, no_decay["params"]) == {"embed_tokens.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
    assert (decay["weight_decay"], no_decay["weight_decay"], muon["weight_decay"]) == (0.1, 0.0, 0.0)
    assert [g["peak_lr"] for g in opt.param_groups] == [MATRIX_LR, EMBEDDING_LR, EMBEDDING_LR]
    assert opt.param_groups == opt.muon.param_groups + opt.adamw.param_groups


def test_adamw_is_the_plain_adamw_it_was():
    """optimizer=adamw: one torch AdamW, matrices decayed, no peak_lr (train.py sets lr itself, unscaled)."""
    model = tiny_gpt()
    opt = make_optimizer(model, LEARNING_RATE, (0.9, 0.95), 0.1, fused=False)
    assert type(opt) is torch.optim.AdamW and not any("peak_lr" in g for g in opt.param_groups)
    decay, no_decay = opt.param_groups
    assert names(model, decay["params"]) == {f"layers.{i}.{m}.weight" for i in range(2) for m in BLOCK_MATRICES}
    assert "embed_tokens.weight" in names(model, no_decay["params"])


def test_muon_adamw_steps_under_grad_scaler_and_resumes_with_this_runs_peaks():
    """GradScaler (fp16's) unscales through param_groups and steps both optimizers, and skips a step whose
    gradient is not finite; zero_grad clears both; load_state_dict restores both states but keeps the peaks
    this run was configured with."""
    scaled, plain = tiny_gpt(), tiny_gpt()
    opt, ref = muon_of(scaled), muon_of(plain)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    backward(plain, 1)
    ref.step()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    scaler.scale(scaled(x, y)[1]).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    for a, b in zip(scaled.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)  # a power-of-two scale unscales exactly
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in scaled.parameters())
    before = [p.clone() for p in scaled.parameters()]
    scaler.scale(scaled(x, y)[1] * float("inf")).backward()
    scaler.unscale_(opt)
    scaler.step(opt)  # skipped: an infinite gradient
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters(), strict=True))

    other = muon_of(tiny_gpt(), matrix_lr=0.01)
    other.load_state_dict(ref.state_dict())
    assert [g["peak_lr"] for g in other.param_groups] == [0.01, EMBEDDING_LR, EMBEDDING_LR]
    for mine, theirs in ((other.muon, ref.muon), (other.adamw, ref.adamw)):
        for p, q in zip((p for g in mine.param_groups for p in g["params"]),
                        (q for g in theirs.param_groups for q in g["params"]), strict=True):
            assert mine.state[p].keys() == theirs.state[q].keys() and all(
                torch.equal(mine.state[p][k], theirs.state[q][k]) for k in mine.state[p])


# -----------------------------------------------------------------------------
# what train.py refuses, in one line

@pytest.mark.parametrize("args,message", [
    (["--dist_mode=fsdp"], "optimizer=muon does not run sharded (dist_mode=fsdp): Muon orthogonalizes each whole "
                           "matrix, which FSDP splits over the GPUs; use dist_mode=ddp, or optimizer=adamw"),
    (["--matrix_lr=0"], "matrix_lr=0.0 must be positive"),
    (["--muon_momentum=1.0"], "muon_momentum=1.0 must be in [0, 1)"),
], ids=["fsdp", "matrix_lr", "momentum"])
def test_muon_refuses_what_cannot_run(tmp_path, stdlib_data, capfd, args, message):
    r = train_tiny(capfd, tmp_path / "out", stdlib_data, *MUON, *args, check=False)
    assert (r.returncode, r.stderr.strip()) == (1, f"error: {message}")
    assert not (tmp_path / "out").exists()


def test_muon_needs_torch_with_muon(tmp_path, stdlib_data, capfd, monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")  # torch before 2.9
    r = train_tiny(capfd, tmp_path / "out", stdlib_data, *MUON, check=False)
    assert (r.returncode, r.stderr.strip()) == (1, "error: optimizer=muon needs torch.optim.Muon (torch 2.9 or "
                                                   "newer): pip install -U torch, or optimizer=adamw")


# -----------------------------------------------------------------------------
# a whole run: the schedule, the checkpoint, kill and resume

@pytest.fixture(scope="module")
def refs(tmp_path_factory, stdlib_data):
    """The uninterrupted optimizer=muon, objective=refine runs, {nproc: out_dir}: test_resume.py's 16 steps,
    checkpoints at 5, 10, 15 and 16, on one process (in this one) and on 2 ranks (gloo)."""
    def single(out):
        with Captured() as captured:
            train_tiny(captured, out, stdlib_data, *ARGS, *TRM)

    def ddp(out):
        train(out, stdlib_data, *ARGS, *TRM, nproc=2)
    outs = {1: shared(tmp_path_factory, "muon_ref_single", single), 2: shared(tmp_path_factory, "muon_ref_ddp", ddp)}
    for out in outs.values():
        assert ckpt_steps(out) == [5, 10, 15, 16]
    return outs


def test_each_group_runs_at_the_schedule_times_its_own_peak(refs):
    """Every checkpoint's group lr is the logged lr (learning_rate's schedule) x its peak / learning_rate."""
    lrs = {m["step"]: m["lr"] for m in read_metrics(refs[1]) if "lr" in m}
    assert len(set(lrs.values())) > 3  # warmup and cosine: the checked steps differ
    for step in ckpt_steps(refs[1]):
        state = load(refs[1] / f"ckpt/step_{step:07d}", "optimizer.pt")
        groups = state["muon"]["param_groups"] + state["adamw"]["param_groups"]
        peaks = [MATRIX_LR, EMBEDDING_LR, EMBEDDING_LR]
        assert [g["lr"] for g in groups] == [lrs[step] * peak / LEARNING_RATE for peak in peaks], step


@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "2ranks"])
def test_muon_refine_kill_then_resume_is_bit_identical(tmp_path, stdlib_data, refs, capfd, nproc):
    """The refinement recipe (refine and Muon). SIGKILL (the last rank) as step 9 starts, then the same command:
    Muon's momentum buffers and AdamW's moments come back from the step-5 checkpoint, and losses (each
    supervision step's too), lr, grad norms, weights and optimizer state equal the uninterrupted run's exactly."""
    out = tmp_path / "out"
    last = KILL_STEP // 5 * 5
    kill = wrapper(tmp_path, KILL_AT_STEP, rank=nproc - 1, step=KILL_STEP, last=last)
    r = train(out, stdlib_data, *ARGS, *TRM, script=kill, nproc=nproc, check=False, torchrun=True)
    assert r.returncode != 0 and ckpt_steps(out)[-1] == last
    momentum = load(out / f"ckpt/step_{last:07d}", "optimizer.pt")["muon"]["state"]
    assert len(momentum) == 2 * len(BLOCK_MATRICES)
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in momentum.values())
    r = train_tiny(capfd, out, stdlib_data, *ARGS, *TRM, nproc=nproc)
    assert f"resumed from {out}/ckpt/step_{last:07d} at step {last}" in r.stdout
    assert_same_run(out, refs[nproc])
    assert len(load(out / f"ckpt/step_{MAX_STEPS:07d}", "trainer.pt")["rng"]) == nproc


def test_a_checkpoint_resumes_only_under_its_own_optimizer(tmp_path, stdlib_data, refs, capfd):
    out = tmp_path / "out"
    shutil.copytree(refs[1], out)
    r = train_tiny(capfd, out, stdlib_data, *ARGS, *TRM, "--optimizer=adamw", check=False)
    assert r.returncode == 1
    assert r.stderr.strip().endswith(
        f"error: checkpoint {out}/ckpt/step_{MAX_STEPS:07d} holds optimizer=muon's state, which optimizer=adamw "
        f"cannot continue: resume with --optimizer=muon, or use a new out_dir")
