"""The opt-in speed paths on a CPU: fp8=True (torchao's float8 linear layers) and attn_backend=fa4 (FlashAttention 4
through SDPA). Each refusal is one line that names the fix, and train.py stops on it before writing a byte; which
layers model.float8_linears converts, where torchao is installed. Their training runs are tests/test_gpu.py's."""
import sys

import pytest
import torch

from podgpt.core import attention
import model
from conftest import train_tiny, tree
from model import fp8_unavailable

H100, A100 = ((9, 0), "NVIDIA H100 80GB HBM3"), ((8, 0), "NVIDIA A100-SXM4-80GB")
CUDA, BF16 = torch.device("cuda"), torch.bfloat16
# train.py's tiny model for one step: warmup within it, so no warning line comes before the refusal
ONE_STEP = ["--micro_batch_size=2", "--total_batch_tokens=128", "--warmup_steps=1", "--max_steps=1"]


def gpu(monkeypatch, capability, name):
    """torch.cuda as it answers on that GPU, for the questions fp8_unavailable asks."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("on, dtype, compiled, why", [
    (A100, BF16, True, "fp8=True needs float8 tensor cores, compute capability 8.9 or newer (H100, H200, L40S, "
                       "RTX 4090); NVIDIA A100-SXM4-80GB is 8.0: set fp8=False"),
    (H100, torch.float16, True, "fp8=True computes the rest of the model in bfloat16, not float16: set dtype=bfloat16"),
    (H100, torch.float32, True, "fp8=True computes the rest of the model in bfloat16, not float32: set dtype=bfloat16"),
    (H100, BF16, False, "fp8=True needs compile=True: without torch.compile fusing float8's scaling and casts, its "
                        "matmuls are slower than bfloat16's")], ids=["a100", "float16", "float32", "eager"])
def test_fp8_refuses_what_cannot_run_it(monkeypatch, on, dtype, compiled, why):
    gpu(monkeypatch, *on)
    assert fp8_unavailable(CUDA, dtype, compiled) == why
    assert fp8_unavailable("cpu", BF16, True) == \
        "fp8=True trains on a CUDA GPU with float8 tensor cores; this is cpu: set fp8=False"


def test_fp8_without_torchao_says_how_to_get_it(monkeypatch):
    gpu(monkeypatch, *H100)
    monkeypatch.setitem(sys.modules, "torchao", None)  # not installed, whether or not it is here
    assert fp8_unavailable(CUDA, BF16, True) == \
        "fp8=True needs torchao (float8 training), which is not installed: pip install torchao"


def refused(capfd, tmp_path, data, *args):
    """train.py on the tiny model with args, which it must refuse: (exit status, the one line on stderr), and
    nothing under tmp_path created or changed."""
    before = tree(tmp_path, stat=True)
    r = train_tiny(capfd, tmp_path / "out", data, *ONE_STEP, *args, check=False)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert tree(tmp_path, stat=True) == before
    return r.returncode, lines[0]


def test_train_py_refuses_fp8_where_it_cannot_run(capfd, tmp_path, stdlib_data):
    assert refused(capfd, tmp_path, stdlib_data, "--fp8=True") == \
        (2, "error: fp8=True trains on a CUDA GPU with float8 tensor cores; this is cpu: set fp8=False")


def test_train_py_refuses_fa4_where_it_cannot_run(capfd, tmp_path, stdlib_data):
    why = attention.backend_unavailable("fa4", "cpu", torch.float32, 8)  # the tiny model: 4 heads of 8
    assert refused(capfd, tmp_path, stdlib_data, "--attn_backend=fa4") == \
        (1, f"error: preflight blocks: attention_backend_runtime: ValueError: attn_backend=fa4 cannot run here: {why}. "
            f"Available here (cpu, float32, head_dim 8): flash, math, sdpa (or allow_unsafe=True to train anyway)")


def test_float8_linears_converts_all_but_the_head_and_odd_sizes():
    """With torchao installed: every nn.Linear becomes a Float8Linear on the same weight, but lm_head (tied to the
    embedding) and those with a dimension that is not a multiple of 16 (here the MLP's 2056-wide hidden layer).
    Wide enough that fp8_filter's size rule converts every attention layer (k and v with q, fused)."""
    pytest.importorskip("torchao.float8")
    gpt = model.GPT(model.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=16, n_kv_head=4, n_embd=2048,
                                    ffn_hidden=2056, fuse_projections=True))
    weights = dict(gpt.named_parameters())
    converted, kept = model.float8_linears(gpt)
    attn = [f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    assert converted == attn and sorted(kept) == sorted(
        ["lm_head"] + [f"layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")])
    kinds = {name: type(m).__name__ for name, m in gpt.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {name for name, kind in kinds.items() if kind == "Float8Linear"} == set(attn)
    assert dict(gpt.named_parameters()).keys() == weights.keys()  # checkpoints keep their names
    assert all(p is weights[name] for name, p in gpt.named_parameters())  # the optimizer's, the tied embedding's
    assert gpt.lm_head.weight is gpt.embed_tokens.weight
