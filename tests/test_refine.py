"""
objective="refine" (deep-supervision refinement): recursive blocks with deep supervision. The model's arithmetic and
states on CPU (a tiny model, the real forward), then the training loop's view of it.
"""
import json
import os
from dataclasses import asdict, fields
from types import SimpleNamespace

import pytest
import torch

from podgpt.research import refine as objectives
from podgpt.core.checkpoint import find_checkpoint
from conftest import read_metrics, run_script, train_tiny
from model import GPT, GPTConfig, KVCache
from podgpt.pod.objectives import make_config, make_model
from podgpt.research.refine import Refine, refine_objective
from podgpt.pod.preflight import flops_per_token
from podgpt.pod.memory import memory_estimate, memory_phases, param_counts
from test_fsdp import FSDP, assert_close_losses
from test_model import measure_step
from test_resume import ARGS, train
from test_sanity import sanity

GPT_FIELDS = {f.name for f in fields(GPTConfig) if f.init}
SHAPE = dict(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def batch(config, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (2, n, config.block_size), generator=g)


@pytest.mark.parametrize("loss_chunk, grad_ckpt", [(0, "none"), (16, "full")])
def test_one_step_without_loops_is_the_plain_gpt(loss_chunk, grad_ckpt):
    """n_sup_train=1, n_loops=0, T_recursion=1: the same loss and the same gradients as the plain GPT with
    the same weights, to the bit."""
    plain = GPT(GPTConfig(**SHAPE, loss_chunk=loss_chunk, grad_ckpt=grad_ckpt))
    refine = make_model(make_config(**SHAPE, loss_chunk=loss_chunk, grad_ckpt=grad_ckpt, objective="refine",
                                  n_sup_train=1, n_loops=0, T_recursion=1))
    refine.load_state_dict(plain.state_dict())
    x, y = batch(plain.config)
    loss = plain(x, y)[1]
    objective, steps = refine(x, y)[1:]
    assert torch.equal(loss, objective) and torch.equal(steps, loss.detach().reshape(1))
    loss.backward()
    objective.backward()
    for (name, p), q in zip(plain.named_parameters(), refine.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_the_objective_is_the_weighted_losses_minus_the_improvement_bonus():
    """Three fixed step losses, base 5 and reward 1, by hand: weights 1, 5, 25 over 31; the bonus
    (4 - 3)/4 + (3 - 2.5)/3, each with its earlier loss detached, so that loss gets no gradient from it."""
    losses = [torch.tensor(v, requires_grad=True) for v in (4.0, 3.0, 2.5)]
    objective = refine_objective(losses, base=5.0, reward=1.0)
    assert objective.item() == pytest.approx((4 + 5 * 3 + 25 * 2.5) / 31 - (1 / 4 + 0.5 / 3), rel=1e-6)
    objective.backward()
    assert [t.grad.item() for t in losses] == pytest.approx([1 / 31, 5 / 31 + 1 / 4, 25 / 31 + 1 / 3], rel=1e-6)
    one = torch.tensor(3.7, requires_grad=True)
    assert torch.equal(refine_objective([one], 10.0, 2.0), one)  # one step: its loss, unchanged


@pytest.mark.parametrize("threshold", [0, 1, 2, 4])
def test_detach_threshold_decides_which_steps_later_losses_reach(threshold, monkeypatch):
    """Step i's loss reaches back into the answer y of an earlier step j only while no step in between was
    detached: y is detached after each step k with threshold <= k < last. The latent z goes with it."""
    config = make_config(**SHAPE, objective="refine", n_sup_train=4, n_loops=1, detach_threshold=threshold)
    model = make_model(config)
    answers, latents, losses = [], [], []
    # the final norm reads each step's y; the last layer's last application of a step is its y update (context z)
    model.norm.register_forward_pre_hook(lambda m, args: answers.append(args[0]))
    model.layers[-1].register_forward_pre_hook(lambda m, args, kw: latents.append(kw["context"]), with_kwargs=True)
    monkeypatch.setattr(objectives, "refine_objective", lambda ls, *a: losses.extend(ls) or sum(ls))
    x, y = batch(config)
    model(x, y)
    latents = latents[1::2]  # per layer: the z update (context x + y), then the y update (context z)
    assert len(answers) == len(latents) == len(losses) == 4
    for i in range(4):
        for j in range(i):
            reaches = all(not threshold <= k < 3 for k in range(j, i))
            for state in (answers[j], latents[j]):
                grad = torch.autograd.grad(losses[i], state, retain_graph=True, allow_unused=True)[0]
                assert (grad is not None) == reaches, (i, j, threshold)


def test_kv_cache_generation_equals_full_recomputation():
    """Greedy generation through the KV cache (one entry per block application) gives the tokens and
    logits of recomputing every position from scratch."""
    config = make_config(**SHAPE, objective="refine", n_sup_inference=3, n_loops=2, T_recursion=2)
    model = make_model(config).eval()
    assert config.cache_slots == 3 * 2 * 2 * 3
    x = batch(config)[0]
    with torch.no_grad():
        full = model(x)[0]
        cache = KVCache(config, x.size(0), config.block_size, "cpu", torch.float32)
        pieces = [(0, 8), (8, 16)] + [(t, t + 1) for t in range(16, 32)]
        cached = torch.cat([model(x[:, a:b], cache=cache)[0] for a, b in pieces], 1)
    assert torch.allclose(cached, full, atol=1e-5, rtol=0)
    prompt = x[:, :5]
    with_cache = torch.stack(list(model.generate(prompt, 20, temperature=0)), 1)
    without = torch.stack(list(model.generate(prompt, 20, temperature=0, use_cache=False)), 1)
    assert torch.equal(with_cache, without)


def test_flops_count_every_block_application():
    """The refinement recipe's shape: depth 12, n_loops=2, T_recursion=1, n_sup_train=4 is 12 x 3 x 4 = 144 block
    applications per token, and 4 passes of the final norm and head; T_recursion's extra repetitions run
    without gradients, at a forward's third."""
    shape = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_kv_head=12, n_embd=768)
    plain, refine = GPTConfig(**shape), make_config(**shape, objective="refine", n_loops=2, T_recursion=1, n_sup_train=4)
    d, T = 768, 1024
    layer = (param_counts(plain)["non_embedding"] - d) // 12
    head = d + refine.padded_vocab * d
    assert flops_per_token(plain) == 6 * (12 * layer + head) + 12 * 12 * d * T
    assert flops_per_token(refine) == 6 * (144 * layer + 4 * head) + 12 * 144 * d * T
    deep = make_config(**shape, objective="refine", n_loops=2, T_recursion=3, n_sup_train=4)
    assert flops_per_token(deep) - flops_per_token(refine) == 2 * 144 * (2 * layer + 4 * d * T)
    assert param_counts(refine) == param_counts(plain)  # the same weights, applied more often


@pytest.mark.parametrize("grad_ckpt, n_loops, n_sup, loss_chunk", [("none", 2, 2, 0), ("full", 1, 3, 128),
                                                                    ("selective", 2, 2, 128)])
def test_memory_plan_counts_the_recursion(grad_ckpt, n_loops, n_sup, loss_chunk):
    """What the planner says the forward keeps for the backward is what a real fp32 step keeps, within
    10%: every block application with gradients, each supervision step's norm and loss."""
    config = make_config(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                       grad_ckpt=grad_ckpt, loss_chunk=loss_chunk, objective="refine", n_loops=n_loops,
                       n_sup_train=n_sup)
    kept = measure_step(config, micro_batch=4)[0]
    forward = memory_phases(config, micro_batch_size=4, compute_bytes=4)["forward_end"]
    log_softmax = 0 if loss_chunk else n_sup * 4 * 4 * 128 * 256  # an unchunked loss keeps each step's
    assert 0.9 <= kept / (forward["activations"] + log_softmax) <= 1.1
    plain = memory_phases(make_config(**{k: v for k, v in asdict(config).items() if k in GPT_FIELDS}), 4,
                          compute_bytes=4)["forward_end"]
    assert forward["activations"] > n_sup * (n_loops + 1) * 0.9 * plain["activations"] * 2 / 3


def test_presets_set_both_and_explicit_keys_win():
    assert (objectives.Config(**SHAPE).supervision_weight_base,
            objectives.Config(**SHAPE).improvement_reward_scale) == (5.0, 1.0)
    extreme = objectives.Config(**SHAPE, refine_preset="extreme")
    assert (extreme.supervision_weight_base, extreme.improvement_reward_scale) == (10.0, 2.0)
    mixed = objectives.Config(**SHAPE, refine_preset="moderate", improvement_reward_scale=0.0)
    assert (mixed.supervision_weight_base, mixed.improvement_reward_scale) == (3.0, 0.0)
    for bad, match in ((dict(objective="diffusion"), "objective"), (dict(refine_preset="wild"), "refine_preset"),
                       (dict(n_sup_train=0), "n_sup_train"), (dict(T_recursion=0), "T_recursion")):
        with pytest.raises(ValueError, match=match):
            make_config(**{**SHAPE, "objective": "refine", **bad})


# -----------------------------------------------------------------------------
# the loop: train.py, sample.py and export.py on a refine run

REFINE = ["--objective=refine", "--n_loops=1", "--n_sup_train=3", "--n_sup_inference=3"]
TINY_REFINE_STEPS = 250  # config/tiny_refine.py's max_steps


def test_an_order_broken_for_patience_evaluations_is_a_warning(capfd):
    """refinement_order: a later supervision step no better than the one before, refine_order_patience
    evaluations in a row, is one warning (and a metrics event); in order again, the count starts over."""
    events = []
    state, cfg = SimpleNamespace(order_broken=0), SimpleNamespace(refine_order_patience=2)
    for sups in [[3.0, 2.9, 2.95], [3.0, 2.9, 2.95], [3.0, 2.9, 2.8], [3.1, 3.2, 3.0], [3.0, 3.0, 2.9],
                 [3.0, 2.9, 2.95], [2.0, 2.1, 2.2]]:
        if warning := Refine.check_validation(sups, state, cfg):
            events.append(warning)
    assert [(e[2]["evaluations"], e[2]["val_sup_losses"]) for e in events] == [(2, [3.0, 2.9, 2.95]),
                                                                               (2, [3.0, 3.0, 2.9]),
                                                                               (4, [2.0, 2.1, 2.2])]
    assert "step 2 no better than the one before" in events[0][1] and "step 1, 2 no better" in events[2][1]


def test_tiny_refine_refines_and_the_loop_reports_it(tmp_path, stdlib_data, capfd):
    """config/tiny_refine.py as shipped, on the tests' stdlib corpus (~60 s on one core; one test, so that
    no second xdist worker waits for the run): the refinement, the loop's fields, sample.py and export.py."""
    out = tmp_path / "run"
    r = run_script(["train.py", "config/tiny_refine.py", f"--data_dir={stdlib_data}", f"--out_dir={out}"], capfd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_refines(out, r.stdout)
    check_loop_fields(out, r.stdout)
    check_sample_and_export(out, tmp_path, capfd)
    # eval.py's validation loss of the final checkpoint, read as train.py read it: its last supervision step's
    r = run_script(["eval.py", "config/tiny_refine.py", f"--ckpt={out}", "--which=latest", f"--data_dir={stdlib_data}",
                    "--eval_batches=8", "--micro_batch_size=16", f"--out={tmp_path / 'eval'}"], capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    bpb = json.loads((tmp_path / "eval" / "eval.json").read_text())["bpb"]
    final = json.loads((out / "summary.json").read_text())["final_val_loss"]
    assert bpb["val_loss"] == pytest.approx(final, rel=1e-5) and bpb["targets"] == 8 * 16 * 128


def check_refines(out, console):
    """After config/tiny_refine.py's 250 steps the validation loss falls from each supervision step to the
    next, and the refinement is reported: in the console's last validation line and in summary.json."""
    summary = json.loads((out / "summary.json").read_text())
    sups = [summary[f"final_val_sup_loss_{i}"] for i in range(3)]
    assert sups[0] > sups[1] > sups[2] and summary["final_val_loss"] == sups[2]
    assert 0 < summary["final_val_refinement"] == pytest.approx(100 * (sups[0] - sups[2]) / sups[0])
    last_val = [line for line in console.splitlines() if line.startswith(f"step {TINY_REFINE_STEPS} | val loss")][0]
    assert last_val.endswith(f"({summary['final_val_refinement']:.1f}% refined)")


def check_loop_fields(out, console):
    """metrics.jsonl: each training line has the step's loss per supervision step and the refinement made of
    them; each validation line the same for validation, its val_loss the last step's cross-entropy; the console
    shows them; summary.json and summary.md have the final ones, and the report plots them."""
    rows = [r for r in read_metrics(out) if "event" not in r]
    train_rows, val_rows = [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == list(range(10, TINY_REFINE_STEPS + 1, 10))
    assert [r["step"] for r in val_rows] == list(range(50, TINY_REFINE_STEPS + 1, 50))
    for prefix, row in [("", r) for r in train_rows] + [("val_", r) for r in val_rows]:
        sups = [row[f"{prefix}sup_loss_{i}"] for i in range(3)]
        assert f"{prefix}sup_loss_3" not in row
        assert row[f"{prefix}refinement"] == pytest.approx(100 * (sups[0] - sups[2]) / sups[0])
        shown = " -> ".join(f"{v:.4f}" for v in sups) + f" ({row[f'{prefix}refinement']:.1f}% refined)"
        assert f"| steps {shown}" in console
    for row in val_rows:
        assert row["val_loss"] == row["val_sup_loss_2"]
    summary = json.loads((out / "summary.json").read_text())
    assert [summary[f"final_val_sup_loss_{i}"] for i in range(3)] == [val_rows[-1][f"val_sup_loss_{i}"]
                                                                      for i in range(3)]
    assert summary["final_val_refinement"] == val_rows[-1]["val_refinement"]
    with open(os.path.join(find_checkpoint(str(out)), "config.json")) as f:  # the checkpoint's: the model too
        record = json.load(f)
    assert record["model"]["objective"] == "refine" and record["model"]["n_sup_train"] == 3
    assert summary["flops_per_token"] == flops_per_token(make_config(**record["model"]))
    assert (out / "plots" / "refinement.png").stat().st_size > 0
    assert f"| refinement (validation, first to last supervision step) | {summary['final_val_refinement']:.1f}% |" \
        in (out / "summary.md").read_text()


def check_sample_and_export(out, tmp_path, capfd):
    """sample.py generates from the refine checkpoint (its KV cache); export.py refuses it with one line."""
    r = run_script(["sample.py", f"--ckpt={out}", "--prompt=def ", "--max_new_tokens=24", "--temperature=0",
                    "--device=cpu"], capfd)
    assert r.returncode == 0 and r.stdout.startswith("def ") and len(r.stdout) > len("def "), r.stderr
    r = run_script(["export.py", f"--ckpt={out}", f"--out={tmp_path / 'export'}"], capfd)
    assert r.returncode == 1 and not os.path.exists(tmp_path / "export")
    assert r.stderr.strip().splitlines() == ["error: objective=refine: this model applies each block many times per "
                                             "token (recursive refinement), which a Llama folder cannot express: "
                                             "sample.py runs the checkpoint itself"]


def test_refine_under_fsdp_computes_the_steps_of_one_process(tmp_path, stdlib_data, capfd):
    """FSDP2 gathers a block's weights at each of its many applications in a forward and reduces its
    gradient once, with activation checkpointing inside each application: the same steps as one process."""
    steps = ["--max_steps=6", "--ckpt_every=6"]
    train_tiny(capfd, tmp_path / "single", stdlib_data, *ARGS, *REFINE, *steps)  # in this process: no start-up
    train(tmp_path / "fsdp", stdlib_data, *ARGS, *REFINE, *FSDP, "--grad_ckpt=full", *steps, nproc=2)
    assert_close_losses(tmp_path / "fsdp", tmp_path / "single", range(1, 7))


def test_sanity_capacity_plans_the_recursion(tmp_path, capfd):
    """sanity.py --capacity on the refinement recipe's phase-1 config plans 144 block applications per token: its FLOPs,
    and its memory under the config's DDP + full checkpointing (which fits 80 GB; plain DDP does not)."""
    r, report, checks, md = sanity(capfd, tmp_path, "--capacity", "--device=cpu", "--compile=False", "--gpu_mem_gb=80",
                                   config="config/h100_trm_fast.py", check=False)
    cap = report["capacity"]
    config = make_config(**{k: v for k, v in cap["model"].items() if k != "padded_vocab"})
    assert config.objective == "refine" and config.n_layer * config.applications()[0] * config.applications()[1] == 144
    assert cap["flops_per_token"] == flops_per_token(config)
    run_layout = cap["layouts"]["run"]
    assert run_layout["label"] == "this run: DDP + grad_ckpt=full" and run_layout["fits"]
    assert not cap["layouts"]["ddp"]["fits"]
    assert run_layout["bytes"] == {k: v for k, v in memory_estimate(config, 32, 8, False, "full").items()
                                   if k != "params"}


def test_a_phase_reaches_the_model_the_optimizer_and_the_start_line(tmp_path, stdlib_data, capfd):
    """refine_phase=extreme on a real (one-step) run: the recipe's phase-2 batch (256 rows of 16), Muon at matrix
    LR 5e-4 beside AdamW at 5e-3, and the extreme refine_preset's base 10 reach the loop, the optimizer and the
    checkpoint's model; the config line says what the phase and its refine_preset filled; --max_steps=1 and
    --improvement_reward_scale=0.5 beat the phase's 5000 and the preset's 2."""
    out = tmp_path / "run"
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", "--objective=refine",
                    "--block_size=32", "--n_layer=1", "--n_head=2", "--n_kv_head=2", "--n_embd=16", "--n_loops=0",
                    "--n_sup_train=2", "--n_sup_inference=2", "--device=cpu", "--dtype=float32", "--eval_steps=1",
                    "--plots=False", "--max_steps=1", "--refine_phase=extreme", "--improvement_reward_scale=0.5"],
                   capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("refine_phase=extreme (refine_preset=extreme micro_batch_size=16 total_batch_tokens=8192 optimizer=muon "
            "matrix_lr=0.0005 embedding_lr=0.005 learning_rate=0.0005) refine_preset=extreme "
            "(supervision_weight_base=10.0) improvement_reward_scale=0.5") in r.stdout
    assert "world 1 x micro 16 x accum 16 = 8192 tokens/step" in r.stdout and "done (max_steps): 1 steps" in r.stdout
    ckpt = find_checkpoint(str(out))
    groups = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False)
    peaks = {kind: {g["peak_lr"] for g in groups[kind]["param_groups"]} for kind in ("muon", "adamw")}
    assert peaks == {"muon": {5e-4}, "adamw": {5e-3}}
    model = json.loads(open(os.path.join(ckpt, "config.json")).read())["model"]
    assert (model["refine_preset"], model["supervision_weight_base"], model["improvement_reward_scale"]) == (
        "extreme", 10.0, 0.5)
