"""master_weights: bf16 parameters with an fp32 master in the optimizer (optim.MasterAdamW), micro-batch gradients
accumulated in fp32, the clip folded into the foreach AdamW step. Its update against torch's AdamW (with and
without clip_grad_norm_), a tiny model's loss curve against the fp32 run's noise, a killed run resumed
bit-identically on 1 process and 2 ranks (DDP, and FSDP2, whose mixed precision is its master), and checkpoints
that load either way (on / off)."""
import json
import signal
import sys

import pytest
import torch

from conftest import run, run_script, train_losses
from model import GPT, GPTConfig
from podgpt.core.checkpoint import STATE_DIR
from podgpt.core.data import Loader, load_manifest
from podgpt.core.optim import make_optimizer
from podgpt.pod.memory import memory_phases
from test_resume import (ARGS, CONSTANT_LR, KILL_AT_STEP, MAX_STEPS, assert_same_run, ckpt_steps, load, train,
                         wrapper)

MASTER = ["--dtype=bfloat16", "--master_weights=True"]
LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=16))


def twins():
    """(fp32 model with torch's AdamW, the same model under MasterAdamW)."""
    ref, mine = tiny_gpt(), tiny_gpt()
    return (ref, make_optimizer(ref, LR, BETAS, WD, fused=False),
            mine, make_optimizer(mine, LR, BETAS, WD, fused=False, master=True))


def steps_with_given_grads(grad_clip, n=10):
    """n steps of both optimizers on the same random fp32 gradients (the master's as if accumulated)."""
    ref, adamw, mine, master = twins()
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        for p, q in zip(ref.parameters(), mine.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            master.grads[q].copy_(p.grad)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip)
        norm = master.prepare(grad_clip)
        assert torch.allclose(norm, ref_norm, rtol=1e-6)
        adamw.step()
        master.step()
        adamw.zero_grad()
        master.zero_grad()
    return ref, mine, master, ref_norm


def assert_master_equals(ref, mine, master):
    for (name, p), q in zip(ref.named_parameters(), mine.parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and master.master[q].dtype == torch.float32
        assert torch.allclose(master.master[q], p, atol=1e-6, rtol=0), name
        assert torch.equal(q, master.master[q].to(torch.bfloat16)), name  # the parameter: the master, rounded


def test_the_foreach_step_is_torch_adamw_on_the_master():
    ref, mine, master, _ = steps_with_given_grads(float("inf"))
    assert_master_equals(ref, mine, master)


def test_the_folded_clip_is_clip_grad_norm_then_adamw():
    ref, mine, master, norm = steps_with_given_grads(0.5)
    assert norm > 5  # the clip scaled every step's gradients (by under 1/10)
    assert_master_equals(ref, mine, master)


def test_micro_batch_gradients_accumulate_in_fp32():
    """Each backward's bf16 gradient is added into the fp32 buffer and freed: the sum of 8 micro-batches'
    gradients is the fp32 sum, not a bf16 running sum."""
    model = tiny_gpt()
    master = make_optimizer(model, LR, BETAS, WD, fused=False, master=True)
    gen, total = torch.Generator().manual_seed(1), {p: torch.zeros(p.shape) for p in model.parameters()}
    for _ in range(8):
        x = torch.randint(0, 64, (2, 16), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x)[1]
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        for p, g in zip(model.parameters(), grads, strict=True):
            total[p] += g.float()
        loss.backward()
        assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        assert torch.equal(master.grads[p], total[p])


def curve(data, seed, kind, steps=200):
    """A tiny model's training losses over `steps` steps, data order `seed`: kind fp32 (torch AdamW), master
    (bf16 params, MasterAdamW) or bf16 (bf16 params and moments, torch AdamW: no master)."""
    manifest = load_manifest(data)
    loader = Loader(data, "train", manifest, 32, seed)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=manifest["vocab_size"], block_size=32, n_layer=2, n_head=2, n_kv_head=1,
                          n_embd=32))
    if kind == "bf16":
        model.to(torch.bfloat16)
    opt = make_optimizer(model, 3e-3, BETAS, WD, fused=False, master=kind == "master")
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if kind != "fp32" else torch.autocast("cpu", enabled=False)
    losses = []
    for step in range(steps):
        x, y = loader.train_batch(step * 8, 8, torch.device("cpu"))
        with cast:
            loss = model(x, y)[1]
        loss.backward()
        if kind == "master":
            opt.prepare(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-50:]) / 50  # the last 50 steps' mean loss


def test_a_tiny_models_loss_with_master_weights_stays_in_the_fp32_runs_noise(stdlib_data):
    """200 steps, 3 data orders: with master weights each order's loss is the fp32 run's, well within the spread
    the data order alone makes (measured: within 0.005, the spread 0.06); bf16 parameters without a master end
    worse on every order, by over 3x the master's mean distance (measured: by 0.03-0.06, 13x)."""
    torch.set_num_threads(1)
    seeds = (1, 2, 3)
    fp32, master, bf16 = ([curve(stdlib_data, s, kind) for s in seeds] for kind in ("fp32", "master", "bf16"))
    noise = max(fp32) - min(fp32)
    off = [abs(m - f) for m, f in zip(master, fp32)]
    assert max(off) < noise / 4, (fp32, master)
    worse = [b - f for b, f in zip(bf16, fp32)]
    assert min(worse) > 0 and sum(worse) > 3 * sum(off), (fp32, master, bf16)


@pytest.mark.parametrize("args, message", [
    ("--optimizer=muon", "master_weights=True does not run with optimizer=muon (Muon has no fp32 master copy): use "
                         "optimizer=adamw, or master_weights=False"),
    ("--dtype=float32", "master_weights=True keeps bfloat16 parameters, and this run computes in float32: set "
                        "dtype=bfloat16, or master_weights=False")])
def test_master_weights_refuses_muon_and_a_dtype_without_bf16(args, message, tmp_path, stdlib_data, capfd):
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path}", "--device=cpu", args,
                    "--master_weights=True"], capfd)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {message}"


def test_the_memory_plan_holds_what_master_weights_allocate():
    """After a step, the bf16 parameters, their fp32 masters, AdamW's moments and the flat fp32 gradient take the
    bytes the plan's weights, optimizer and gradients say, to the byte; and nothing for DDP's buckets or autocast's
    casts, which a master run has none of."""
    model = tiny_gpt()
    opt = make_optimizer(model, LR, BETAS, WD, fused=False, master=True)
    x = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", torch.bfloat16):
        model(x, x)[1].backward()
    opt.prepare(1.0)
    opt.step()
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    moments = [t for st in opt.state.values() for k, t in st.items() if k != "step"]
    plan = memory_phases(model.config, 2, world_size=2, compute_bytes=2, master=True)["backward_end"]
    assert (plan["weights"], plan["optimizer"], plan["gradients"]) == (
        size(model.parameters()) + size(opt.master.values()), size(moments), size([opt.grad]))
    assert plan["ddp_buckets"] == plan["weight_casts"] == 0


# -----------------------------------------------------------------------------
# train.py with master_weights=True: resumes, checkpoints

@pytest.fixture(scope="module")
def ref_master(tmp_path_factory, stdlib_data):
    out = tmp_path_factory.mktemp("master") / "out"
    train(out, stdlib_data, *ARGS, *MASTER)
    assert ckpt_steps(out) == [5, 10, 15, 16]
    return out


def test_preflight_plans_the_master_weights_run(ref_master):
    plan = json.load(open(ref_master / "preflight.json"))["plan"]
    params, memory = plan["params"]["total"], plan["memory"]
    assert (memory["weights"], memory["gradients"], memory["weight_casts"]) == (6 * params, 4 * params, 0)


def test_a_checkpoint_holds_the_fp32_masters(ref_master):
    model, optim = load(ref_master / "ckpt/step_0000016", "model.pt"), load(ref_master / "ckpt/step_0000016",
                                                                             "optimizer.pt")
    assert {t.dtype for t in model.values() if t.is_floating_point()} == {torch.float32}
    # not bf16 values stored as fp32: the master keeps what bf16 rounds away
    assert any(not torch.equal(t, t.bfloat16().float()) for t in model.values())
    assert {t.dtype for s in optim["state"].values() for k, t in s.items() if k != "step"} == {torch.float32}


def test_sigkill_then_resume_with_master_weights_is_bit_identical(tmp_path, stdlib_data, ref_master):
    out, kill = tmp_path / "out", 9
    r = train(out, stdlib_data, *ARGS, *MASTER, script=wrapper(tmp_path, KILL_AT_STEP, rank=0, step=kill, last=5),
              check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    r = train(out, stdlib_data, *ARGS, *MASTER)
    assert f"resumed from {out}/ckpt/step_0000005 at step 5" in r.stdout
    assert_same_run(out, ref_master)


def kill_and_resume_on_two_ranks(tmp_path, data, *args):
    """An uninterrupted 2-rank run, and one whose rank 1 is killed at step 9 then resumed by the same command from
    its step-5 checkpoint: the two runs bit-identical (assert_same_run). The reference's folder, and its stdout."""
    ref, out, kill = tmp_path / "ref", tmp_path / "out", 9
    r = train(ref, data, *ARGS, *args, nproc=2)
    killed = train(out, data, *ARGS, *args, script=wrapper(tmp_path, KILL_AT_STEP, rank=1, step=kill, last=5),
                   nproc=2, check=False, torchrun=True)
    assert killed.returncode != 0 and max(train_losses(out)) == kill
    resumed = train(out, data, *ARGS, *args, nproc=2, torchrun=True)
    assert f"resumed from {out}/ckpt/step_0000005 at step 5" in resumed.stdout
    assert_same_run(out, ref)
    return ref, r.stdout


def test_ddp_sigkill_then_resume_with_master_weights_is_bit_identical(tmp_path, stdlib_data):
    """2 ranks (gloo): the fp32 buffers all-reduced by MasterAdamW, each checkpoint written by both ranks."""
    _, stdout = kill_and_resume_on_two_ranks(tmp_path, stdlib_data, *MASTER)
    assert "world 2 x micro 4 x accum 1" in stdout


def test_fsdp_sigkill_then_resume_with_bf16_compute_is_bit_identical(tmp_path, stdlib_data):
    """dist_mode=fsdp, 2 ranks (gloo): FSDP2's mixed precision is the master there (bf16 gathered for compute,
    gradients reduced in fp32 into the fp32 shards), the sharded checkpoint holds those fp32 shards, and a
    run killed after step 5 resumes to the same losses and final checkpoint as the unbroken run."""
    from torch.distributed.checkpoint import FileSystemReader
    ref, _ = kill_and_resume_on_two_ranks(tmp_path, stdlib_data, "--dtype=bfloat16", "--dist_mode=fsdp")
    stored = FileSystemReader(str(ref / f"ckpt/step_{MAX_STEPS:07d}" / STATE_DIR)).read_metadata()
    weights = {k: m.properties.dtype for k, m in stored.state_dict_metadata.items() if k.startswith("model.")}
    assert weights and set(weights.values()) == {torch.float32}, weights


@pytest.mark.parametrize("saved_with,resumed_with", [(MASTER, ["--dtype=bfloat16"]),
                                                    (["--dtype=bfloat16"], MASTER)], ids=["on_to_off", "off_to_on"])
def test_a_checkpoint_loads_with_master_weights_on_or_off(tmp_path, stdlib_data, saved_with, resumed_with):
    """Saved at step 5 with master_weights one way, resumed the other: the weights and AdamW moments go on, so
    steps 6-8 follow the run that kept its setting (bf16 rounding apart), far closer than a fresh start."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    train(ref, stdlib_data, *ARGS, *CONSTANT_LR, *saved_with, "--max_steps=8")
    r = train(out, stdlib_data, *ARGS, *CONSTANT_LR, *resumed_with, "--max_steps=8",
              f"--resume={ref}/ckpt/step_0000005")
    assert f"resumed from {ref}/ckpt/step_0000005 at step 5" in r.stdout
    theirs, ours = train_losses(ref), train_losses(out)
    assert sorted(ours) == [6, 7, 8]
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-2), (step, ours, theirs)
    assert abs(ours[6] - theirs[1]) > 0.1  # a fresh model's loss is far from either


# -----------------------------------------------------------------------------
# GPU: the compiled path (torch.compile of the model and of the foreach step), bf16 autocast

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs CUDA (run python -m pytest -m gpu on "
                    "a GPU pod)")
def test_compiled_master_weights_on_cuda_track_the_fp32_weights_run_and_resume(tmp_path, stdlib_data):
    """config/tiny.py, compiled, 12 steps: with master_weights each step's loss is within 2% of the run with fp32
    weights, and a second process resumed from its step-6 checkpoint reproduces steps 7-12 (within 1e-3)."""
    args = ["config/tiny.py", f"--data_dir={stdlib_data}", "--device=cuda", "--dtype=bfloat16", "--compile=True",
            "--total_batch_tokens=8192", "--warmup_steps=2", "--eval_steps=4", "--log_every=1", "--max_steps=12",
            "--ckpt_every=6", "--eval_every=6", "--keep_last=5"]
    run([sys.executable, "train.py", *args, f"--out_dir={tmp_path / 'off'}"], timeout=300)
    run([sys.executable, "train.py", *args, "--master_weights=True", f"--out_dir={tmp_path / 'on'}"], timeout=300)
    run([sys.executable, "train.py", *args, "--master_weights=True", f"--out_dir={tmp_path / 'resumed'}",
         f"--resume={tmp_path / 'on/ckpt/step_0000006'}"], timeout=300)
    off, on, resumed = (train_losses(tmp_path / d) for d in ("off", "on", "resumed"))
    for step in range(1, 13):
        assert on[step] == pytest.approx(off[step], rel=2e-2), (step, on, off)
    for step in range(7, 13):
        assert resumed[step] == pytest.approx(on[step], rel=1e-3), (step, resumed, on)
