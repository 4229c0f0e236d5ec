"""fuse_projections: q/k/v and gate/up each run as one matmul while training, over their weights
concatenated in forward, so checkpoints and the Hugging Face export keep the separate ones; and
fp8_filter, which layers fp8=True converts (torchao's rule for tensorwise scales, fused groups
judged whole). The float8 path itself runs where torchao imports (emulated on a CPU), and on a
GPU."""
import dataclasses
import json
import os
import runpy
import shutil
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn

from conftest import Captured, run_script, shared, train_tiny
from model import GPT, GPTConfig, fp8_filter
from podgpt.core.checkpoint import find_checkpoint
from podgpt.pod.checkpoints import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=64,
             multiple_of=16, loss_chunk=0)
GQA = {"gqa": 2, "mha": 4}


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**dict(SHAPE, **kw))).float()


@contextmanager
def counting_linears():
    """[calls]: how many F.linear calls ran meanwhile (nn.Linear's forward makes one)."""
    calls, real = [0], torch.nn.functional.linear

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    torch.nn.functional.linear = counted
    try:
        yield calls
    finally:
        torch.nn.functional.linear = real


def logits_and_grads(model, ids, fused):
    model.config.fuse_projections = fused  # one config object: every layer reads it
    model.zero_grad()
    logits, _ = model(ids)
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kv", GQA)
def test_fused_projections_equal_separate_ones(kv):
    model = tiny(n_kv_head=GQA[kv])
    ids = torch.randint(0, 97, (3, 32))
    attn, x = model.layers[0].self_attn, torch.randn(3, 32, 64)
    for module in (attn, model.layers[0].mlp):
        module.config.fuse_projections = True
        with counting_linears() as calls:
            fused = module(x)
        assert calls[0] == 2  # q/k/v and o; gate/up and down
        module.config.fuse_projections = False
        with counting_linears() as calls:
            separate = module(x)
        assert calls[0] == (4 if module is attn else 3)
        assert (fused - separate).abs().max().item() < 1e-6
    fused, fused_grads = logits_and_grads(model, ids, True)
    separate, separate_grads = logits_and_grads(model, ids, False)
    assert (fused - separate).abs().max().item() < 1e-6
    assert fused_grads.keys() == separate_grads.keys() and len(fused_grads) == 20  # 9 a layer
    for name, grad in fused_grads.items():
        assert (grad - separate_grads[name]).abs().max().item() < 1e-6, name


def test_state_dict_layout_is_unchanged():
    names = set(tiny(fuse_projections=True).state_dict())
    assert names == set(tiny(fuse_projections=False).state_dict())
    assert {n for n in names if n.startswith("layers.0.")} == {
        f"layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm",
                                         "self_attn.q_proj", "self_attn.k_proj",
                                         "self_attn.v_proj", "self_attn.o_proj",
                                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stdlib_data):
    """test_export's two tiny trained runs, the same folder (shared: built once per session)."""
    pytest.importorskip("transformers")
    from test_export import VARIANTS

    def build(root):
        for name, args in VARIANTS.items():
            with Captured() as captured:
                train_tiny(captured, root / name, stdlib_data, *args, "--total_batch_tokens=256",
                           "--micro_batch_size=4", "--max_steps=3", "--log_every=1",
                           "--eval_every=3", "--ckpt_every=3", "--learning_rate=1e-2", "--seed=7")
    root = shared(tmp_path_factory, "export_runs", build)
    return {name: str(root / name) for name in VARIANTS}


def test_checkpoint_from_before_loads_fused(runs, tmp_path):
    """A checkpoint whose config.json has no fuse_projections (as written before it existed)
    loads (the key takes its default, as any runtime field), and run fused its logits are the unfused model's."""
    ckpt = tmp_path / "old"
    shutil.copytree(find_checkpoint(runs["gqa_tied"], "best"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["model"] = {k: v for k, v in config["model"].items() if k != "fuse_projections"}
    (ckpt / "config.json").write_text(json.dumps(config))
    model, _ = load_model(str(ckpt), verify=False)
    assert model.config.fuse_projections is GPTConfig.fuse_projections
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    fused, _ = logits_and_grads(model, ids, True)
    separate, _ = logits_and_grads(model, ids, False)
    assert (fused - separate).abs().max().item() < 1e-6


def test_export_matches_the_fused_model(runs, tmp_path, capfd):
    """transformers' LlamaForCausalLM from export.py's folder (separate q/k/v and gate/up, as
    before) computes the fused model's logits."""
    import transformers
    dest = tmp_path / "hf"
    r = run_script(["export.py", f"--ckpt={runs['gqa_tied']}", f"--out={dest}"], capfd)
    assert r.returncode == 0, r.stderr[-2000:]
    ours, _ = load_model(find_checkpoint(runs["gqa_tied"], "best"))
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(dest), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 16))
    fused, _ = logits_and_grads(ours, ids, True)  # run fused
    with torch.no_grad():
        hf = theirs(ids).logits
    assert (hf - fused[..., :ours.config.vocab_size]).abs().max().item() < 1e-4


def test_compiled_fused_model_runs_on_cpu():
    model = tiny(n_kv_head=2)
    ids = torch.randint(0, 97, (2, 32))
    eager, eager_grads = logits_and_grads(model, ids, True)
    compiled = torch.compile(model)
    model.zero_grad()
    logits, _ = compiled(ids)
    (logits ** 2).mean().backward()
    assert (logits - eager).abs().max().item() < 1e-5
    for name, p in model.named_parameters():
        assert (p.grad - eager_grads[name]).abs().max().item() < 1e-5, name


def config_of(path, **kw):
    """The GPTConfig a config file trains (its GPTConfig keys)."""
    keys = runpy.run_path(os.path.join(ROOT, path))
    names = {f.name for f in dataclasses.fields(GPTConfig) if f.init}
    return GPTConfig(**{k: v for k, v in keys.items() if k in names}, **kw)


def decisions(config):
    """{layer name (layer 0 and the head): whether fp8 converts it}."""
    with torch.device("meta"):
        model = GPT(config)
    converts = fp8_filter(model)
    return {name.removeprefix("layers.0.").split(".")[-1]: converts(m, name)
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.startswith(("layers.0.", "lm_head"))}


# torchao's rule for tensorwise scales: K <= 4096 and N <= 1024 stays bf16. The 1B: d 2048, 16
# heads and 4 of keys of 128, hidden 5632; the 50M: d 768, 12 heads and 4 of keys of 64, hidden 2048
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = {
    ("config/h200_1b_ddp8.py", True): set(ALL),  # q/k/v: 2048 -> 3072
    ("config/h200_1b_ddp8.py", False): set(ALL) - {"k_proj", "v_proj"},  # 2048 -> 512
    ("config/a100_50m.py", True): {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"},
    ("config/a100_50m.py", False): {"gate_proj", "up_proj"},  # 768 -> 2048; down 2048 -> 768
}


@pytest.mark.parametrize("path,fused", FP8)
def test_fp8_filter_follows_the_rule(path, fused):
    got = decisions(config_of(path, fuse_projections=fused))
    assert {name for name, yes in got.items() if yes} == FP8[path, fused]
    assert got["lm_head"] is False
    assert decisions(config_of(path, fuse_projections=fused, fp8_head=True))["lm_head"] is True


def test_fp8_filter_skips_dimensions_not_a_multiple_of_16():
    got = decisions(GPTConfig(vocab_size=97, n_layer=1, n_head=4, n_kv_head=4, n_embd=4104,
                              ffn_hidden=8200, fp8_head=True))
    assert not any(got.values())


def float8_model(model):
    """model's layers but the head as torchao's Float8Linear (tensorwise; emulated on a CPU)."""
    float8 = pytest.importorskip("torchao.float8")
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("tensorwise"),
                                 emulate=next(model.parameters()).device.type != "cuda")
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, n: n != "lm_head",
                                      config=config)
    return model


@contextmanager
def float8_matmuls():
    """[the number of torchao float8 matmuls run inside the block so far]."""
    from torchao.float8 import float8_linear
    calls, real = [0], float8_linear.matmul_with_hp_or_float8_args.apply

    def counted(*args):
        calls[0] += 1
        return real(*args)
    float8_linear.matmul_with_hp_or_float8_args.apply = counted
    try:
        yield calls
    finally:
        float8_linear.matmul_with_hp_or_float8_args.apply = real


def test_fused_float8_is_one_float8_matmul():
    """With torchao: a fused group of Float8Linear runs as one float8 matmul (one cast of the
    input), and computes what the separate float8 layers do, to float8's precision."""
    reference = tiny(n_kv_head=2)
    model = float8_model(tiny(n_kv_head=2))
    from torchao.float8 import float8_linear
    assert isinstance(model.layers[0].self_attn.k_proj, float8_linear.Float8Linear)
    ids = torch.randint(0, 97, (2, 32))
    exact, _ = logits_and_grads(reference, ids, True)
    with float8_matmuls() as calls:
        fused, _ = logits_and_grads(model, ids, True)
        assert calls[0] == 2 * 4  # q/k/v, o, gate/up, down in each of 2 layers
        separate, _ = logits_and_grads(model, ids, False)
        assert calls[0] == 2 * 4 + 2 * 7
    scale = exact.abs().max().item()
    assert (fused - exact).abs().max().item() < 0.1 * scale
    assert (fused - exact).abs().max().item() < 2 * (separate - exact).abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_table_on_this_gpu(tmp_path, capfd):
    """bench/matmul.py --fp8=True measures each default shape's linear layer in bf16 and float8;
    the 1B's MLP shapes run faster in float8 (their matmuls did, 1.82x, in the H200 traces)."""
    pytest.importorskip("torchao.float8")
    out = tmp_path / "matmul.jsonl"
    from test_bench import in_this_process  # bench/ on sys.path, as `python bench/matmul.py` has it
    r = in_this_process(capfd, "matmul", "--fp8=True", "--iters=5", f"--out={out}")
    if r.returncode == 2 and "fp8=True" in r.stderr:  # a GPU without float8 tensor cores
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {(row["k"], row["n"]): row for row in json.loads(out.read_text())["rows"]}
    assert len(rows) == 12 and all(row["linear_fp8_ms"] > 0 for row in rows.values())
    assert rows[2048, 11264]["fp8_speedup"] > 1 and rows[5632, 2048]["fp8_speedup"] > 1
    print({shape: round(row["fp8_speedup"], 2) for shape, row in rows.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_float8_trains_on_cuda():
    """The fused float8 path compiled under bf16 autocast on a GPU: its logits track bf16's."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip("no float8 tensor cores")
    shape = dict(SHAPE, n_embd=1024, n_head=8, n_kv_head=2, ffn_hidden=2816, block_size=256)
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**shape)).cuda()
    torch.manual_seed(0)
    model = float8_model(GPT(GPTConfig(**shape)).cuda())
    ids = torch.randint(0, 97, (4, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        exact, _ = logits_and_grads(torch.compile(reference), ids, True)
        fused, grads = logits_and_grads(torch.compile(model), ids, True)
    assert all(g.isfinite().all() for g in grads.values())
    assert (fused.float() - exact.float()).abs().max().item() < 0.1 * exact.abs().max().item()
