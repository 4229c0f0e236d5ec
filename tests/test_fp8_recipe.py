"""fp8_recipe: torchao's tensorwise scales (one per tensor, the default) or rowwise ones (one per row), each
with torchao's own size rule in model.fp8_filter; any other value refused in one line before any work. With
torchao importable (emulated on a CPU): what a rowwise conversion carries, and that a fused group under rowwise
computes what its separate Float8Linear layers do. On a GPU: both recipes train and track bf16."""
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import model
from model import GPT, GPTConfig, fp8_unavailable
from test_bench import in_this_process
from test_fused_projections import FP8, config_of, decisions, float8_matmuls, logits_and_grads
from test_speed_paths import refused

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# torchao's rule for rowwise scales: N <= 2048, K <= 1024, or N <= 4096 and K <= 2048 stays bf16. The 1B
# (d 2048, k/v 512, fused q/k/v 3072, hidden 5632, fused gate/up 11264): only gate/up's N pays; the 50M's
# every K is 768 but down's, whose N is 768
ROWWISE = {
    ("config/h200_1b_ddp8.py", True): {"gate_proj", "up_proj"},  # q/k/v 2048 -> 3072: N <= 4096, K <= 2048
    ("config/h200_1b_ddp8.py", False): {"gate_proj", "up_proj"},  # down 5632 -> 2048: N <= 2048
    ("config/a100_50m.py", True): set(),
    ("config/a100_50m.py", False): set(),
}
BAD_LINE = ("fp8_recipe='blockwise' is not one of tensorwise, rowwise (torchao's float8 scaling: one scale "
                "per tensor, or one per row)")
# wide enough that both size rules convert layers (2 layers of the 1B's width)
WIDE = dict(vocab_size=97, block_size=256, n_layer=2, n_head=16, n_kv_head=4, n_embd=2048, ffn_hidden=5632,
            loss_chunk=0, fuse_projections=True)


@pytest.mark.parametrize("path,fused", ROWWISE)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_filter_follows_the_recipes_rule(path, fused, recipe):
    got = decisions(config_of(path, fuse_projections=fused, fp8_recipe=recipe))
    want = (ROWWISE if recipe == "rowwise" else FP8)[path, fused]
    assert {name for name, yes in got.items() if yes} == want and got["lm_head"] is False


def test_the_size_rules_are_torchaos():
    """model.FP8_RECIPES' size rules against torchao's own auto filters, on each side of every threshold."""
    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    theirs = {"tensorwise": utils._auto_filter_for_tensorwise, "rowwise": utils._auto_filter_for_rowwise}
    dims = (512, 1024, 1040, 2048, 2064, 4096, 4112, 8192)
    for recipe, rule in theirs.items():
        with torch.device("meta"):
            for k in dims:
                for n in dims:
                    assert rule(nn.Linear(k, n, bias=False), "x", []) is \
                        (not model.FP8_RECIPES[recipe](k, n)), (recipe, k, n)


def test_a_bad_recipe_is_refused_in_one_line(capfd, tmp_path, stdlib_data):
    """train.py (before its data or out_dir is touched), bench/mfu.py and bench/matmul.py: exit 2."""
    assert refused(capfd, tmp_path, stdlib_data, "--fp8_recipe=blockwise") == (2, f"error: {BAD_LINE}")
    for probe in (["mfu", "config/tiny.py"], ["matmul"]):
        r = in_this_process(capfd, *probe, "--fp8_recipe=blockwise", f"--out={tmp_path}/bench.jsonl")
        assert (r.returncode, r.stderr.strip()) == (2, f"error: {BAD_LINE}"), r.stderr
    assert not (tmp_path / "bench.jsonl").exists()
    with pytest.raises(ValueError, match="fp8_recipe='blockwise' is not one of tensorwise, rowwise"):
        GPTConfig(fp8_recipe="blockwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linears_converts_with_the_recipe(recipe):
    """The 2048-wide model: the layers fp8_filter chooses become Float8Linear carrying the recipe's config."""
    float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.config import ScalingGranularity
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**WIDE, fp8_recipe=recipe))
    converted, kept = model.float8_linears(gpt)
    layers = {"tensorwise": ALL, "rowwise": ("gate_proj", "up_proj")}[recipe]
    assert {n.split(".")[-1] for n in converted} == set(layers) and "lm_head" in kept
    granularity = {"tensorwise": ScalingGranularity.TENSORWISE, "rowwise": ScalingGranularity.AXISWISE}[recipe]
    for name in converted:
        config = gpt.get_submodule(name).config
        assert config == float8.Float8LinearConfig.from_recipe_name(recipe), name
        assert config.cast_config_input.scaling_granularity is granularity


# the narrowest one-layer shape where rowwise converts every block layer, fused or not: K = 2064 > 2048, and each
# N (q 2064, fused q/k/v 3440, o 2064, fused gate/up 4128, down 2064) above 2048
EMULATED = dict(vocab_size=97, block_size=32, n_layer=1, n_head=12, n_kv_head=4, n_embd=2064, ffn_hidden=2064,
                loss_chunk=0, fuse_projections=True)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_fused_rowwise_equals_the_separate_float8_layers(monkeypatch):
    """fp8_recipe=rowwise through float8_linears (emulated on a CPU). A fused group's one float8 matmul gives
    its separate Float8Linear layers' outputs and weight gradients exactly, and their input's gradient but for
    the order of fp32 sums: the scales are per row (of the input, of each weight row, of the gradient over the
    tokens) and powers of two, so a row of the group rounds as a member's row does. Through the model, where
    such a last-bit difference can flip a later float8 rounding: the same logits, and gradients a small part
    of float8's own error away."""
    float8 = pytest.importorskip("torchao.float8")
    real_config = float8.Float8LinearConfig.from_recipe_name
    monkeypatch.setattr(float8.Float8LinearConfig, "from_recipe_name",
                        staticmethod(lambda name: dataclasses.replace(real_config(name), emulate=True)))
    torch.manual_seed(0)
    exact_model = GPT(GPTConfig(**EMULATED, fp8_recipe="rowwise"))
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**EMULATED, fp8_recipe="rowwise"))
    assert len(model.float8_linears(gpt)[0]) == 7
    layer = gpt.layers[0]
    for group in ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                  [layer.mlp.gate_proj, layer.mlp.up_proj]):
        x = torch.randn(2, 32, 2064, requires_grad=True)
        fused = model.fused_linear(x, group)
        grads = [torch.randn_like(y) for y in fused]
        torch.autograd.backward(fused, grads)
        fused_x, fused_w = x.grad, [m.weight.grad for m in group]
        x.grad = None
        for m in group:
            m.weight.grad = None
        separate = [m(x) for m in group]
        torch.autograd.backward(separate, grads)
        assert all(torch.equal(a, b) for a, b in zip(fused, separate))
        assert all(torch.equal(a, m.weight.grad) for a, m in zip(fused_w, group))
        assert rel(fused_x, x.grad) < 1e-5
    ids = torch.randint(0, 97, (2, 32))
    exact, exact_grads = logits_and_grads(exact_model, ids, True)
    with float8_matmuls() as calls:
        fused, fused_grads = logits_and_grads(gpt, ids, True)
        assert calls[0] == 4  # q/k/v, o, gate/up, down
        separate, separate_grads = logits_and_grads(gpt, ids, False)
        assert calls[0] == 4 + 7
    assert rel(separate, exact) > 1e-2  # float8 did round
    assert rel(fused, separate) < 1e-6
    assert fused_grads.keys() == separate_grads.keys() and len(fused_grads) == 11
    for name, grad in fused_grads.items():  # measured: at most 0.16 of float8's error (k_proj)
        assert rel(grad, separate_grads[name]) <= 0.5 * rel(separate_grads[name], exact_grads[name]), name


def noisy_sequences(rows, steps, generator):
    """A batch of rows per step, each token 3x the last plus 1 (mod 97) half the time, else a random one: a rule
    to learn, and a loss that stays far from 0 (fresh rows each step: no memorizing)."""
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 97, (rows, 1), generator=generator)
        for _ in range(WIDE["block_size"]):
            follow, noise = (ids[:, -1:] * 3 + 1) % 97, torch.randint(0, 97, (rows, 1), generator=generator)
            keep = torch.rand(rows, 1, generator=generator) < 0.5
            ids = torch.cat([ids, torch.where(keep, follow, noise)], dim=1)
        batches.append(ids.cuda())
    return batches


def train_losses(recipe, batches):
    """The WIDE model's losses over compiled bf16-autocast AdamW steps, one a batch; recipe None: bf16."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**WIDE, fp8_recipe=recipe or "tensorwise")).cuda()
    if recipe:
        assert model.float8_linears(gpt)[0]
    step = torch.compile(gpt)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4, fused=True)
    losses = []
    for ids in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(ids[:, :-1], ids[:, 1:])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_both_recipes_train_and_track_bf16():
    """The WIDE model 10 steps (on a CPU in fp32 at 2 rows a step, 5.25 -> 3.83 in 8), bf16 and each recipe from
    the same weights on the same batches: within test_gpu's fp8 tolerance of bf16 per step over its first
    STABLE_STEPS, within its last-step bound at the end, and learning."""
    if why := fp8_unavailable("cuda", torch.bfloat16, True):
        pytest.skip(why)
    from test_gpu import FP8_TOL, LAST_TOL, STABLE_STEPS
    batches = noisy_sequences(8, 10, torch.Generator().manual_seed(0))
    bf16 = train_losses(None, batches)
    for recipe in ("tensorwise", "rowwise"):
        got = train_losses(recipe, batches)
        diffs = [abs(a - b) / b for a, b in zip(got, bf16)]
        print(f"{recipe}: losses {[round(v, 4) for v in got]} (bf16 {[round(v, 4) for v in bf16]}), "
              f"relative to bf16 {[f'{d:.1e}' for d in diffs]}")
        assert all(math.isfinite(v) for v in got) and got[-1] < 0.8 * got[0], got
        assert max(diffs[:STABLE_STEPS]) <= FP8_TOL and diffs[-1] <= LAST_TOL, (recipe, diffs)
