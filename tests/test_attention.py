"""attention.py's backends on CPU: each one that runs here against float64 (forward and backward,
GQA, document masks), the refusals of the ones that cannot, what auto picks, and FlashAttention's and
FlexAttention's wrappers (their GPU kernels replaced by a stand-in package, or run forward only)."""
import importlib.machinery
import re
import sys
import types
import warnings

import pytest
import torch

from podgpt.core import attention as attn
from podgpt.research.bd3lm import BlockDiffusion
import model
from podgpt.core.attention import (ATTENTION_BACKENDS, ATTENTION_KERNELS, Documents, attention, backend_unavailable,
                       resolve_backend)

F32 = torch.float32
HERE = [b for b in (*ATTENTION_BACKENDS, "sdpa") if backend_unavailable(b, "cpu", F32, 16) is None]


def reference(q, k, v, doc_ids=None, queries=None):
    """Causal attention in float64, one document of one row at a time; query head h reads key/value
    head h // (Hq / Hkv). queries: only the last that many queries (the KV cache's new tokens)."""
    rep = q.size(1) // k.size(1)
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    T = q.size(2)
    doc_ids = torch.zeros(q.size(0), T, dtype=torch.long) if doc_ids is None else doc_ids
    out = torch.zeros_like(q)
    for b in range(q.size(0)):
        for doc in doc_ids[b].unique():
            t = (doc_ids[b] == doc).nonzero().flatten()
            s = q[b][:, t] @ k[b][:, t].transpose(-1, -2) / q.size(-1) ** 0.5
            s = s.masked_fill(torch.ones(len(t), len(t), dtype=torch.bool).triu(1), float("-inf"))
            out[b][:, t] = s.softmax(-1) @ v[b][:, t]
    return out if queries is None else out[:, :, -queries:]


def inputs(T=40, hq=4, hkv=2, hd=16, grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, h, T, hd, generator=g).requires_grad_(grad) for h in (hq, hkv, hkv)]


def documents(T=40):
    """Row 0: three documents; row 1 starts mid-document (id 0) and has a second from 7 on."""
    ids = torch.zeros(2, T, dtype=torch.long)
    ids[0, 13:] += 1
    ids[0, 30:] += 1
    ids[1, 7:] += 1
    return ids


def assert_matches_reference(out, q, k, v, doc_ids=None, tol=1e-5):
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, doc_ids)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref.backward(grad)
    out.backward(grad.to(out.dtype))
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for t, r in zip((q, k, v), ref_in, strict=True):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=tol, rtol=tol)


def test_cpu_has_the_sdpa_kernels_and_nothing_cuda_only():
    assert HERE == ["flash", "math", "sdpa"]  # SDPA's flash kernel has a CPU implementation


@pytest.mark.parametrize("name, doc_mask", [(name, False) for name in HERE]
                         + [(name, True) for name in HERE if name in Documents.FORMS])
def test_each_backend_that_runs_here_matches_float64(name, doc_mask):
    q, k, v = inputs()
    doc_ids = documents() if doc_mask else None
    assert_matches_reference(attention(name, q, k, v, True, doc_ids), q, k, v, doc_ids)


@pytest.mark.parametrize("name, why", [("fa3", "flash_attn_interface is not installed|FlashAttention 3 is CUDA only"),
                                       ("fa2", "pip install flash-attn|FlashAttention 2 is CUDA only"),
                                       ("fa4", "pip install --pre flash-attn-4|FlashAttention 4 is CUDA only|"
                                               "FlashAttention 4 runs through SDPA from torch 2.10 on"),
                                       ("cudnn", "CUDA only"), ("efficient", "CUDA only"),
                                       ("flex", "no backward pass on CPU")])
def test_a_named_backend_that_cannot_run_here_is_refused(name, why):
    assert re.search(why, backend_unavailable(name, "cpu", F32, 16))
    with pytest.raises(ValueError, match=f"attn_backend={name} cannot run here: .*({why})") as e:
        resolve_backend(name, "cpu", F32, 16)
    assert str(e.value).endswith("Available here (cpu, float32, head_dim 16): flash, math, sdpa")
    q, k, v = inputs()
    with pytest.raises(ValueError, match="Available here"):
        attention(name, q, k, v, True)
    gpt = model.GPT(model.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                                    attn_backend=name))
    with pytest.raises(ValueError, match=f"attn_backend={name} cannot run here"):
        gpt(torch.zeros(1, 8, dtype=torch.long))


def test_document_masks_need_a_backend_that_can_mask():
    for name in ("flash", "cudnn"):
        assert backend_unavailable(name, "cpu", F32, 16, "documents") == \
            f"{name} cannot mask documents (doc_mask=True); fa3, fa2, flex, efficient, math, sdpa can"
    with pytest.raises(ValueError, match=r"flash cannot mask documents.*Available here \(cpu, float32, head_dim "
                                         r"16, doc_mask\): math, sdpa$"):
        resolve_backend("flash", "cpu", F32, 16, "documents")
    q, k, v = inputs()
    with pytest.raises(ValueError, match="pass causal=True"):
        attention("math", q, k, v, False, documents())
    with pytest.raises(ValueError, match="unknown attention backend 'fa5'"):
        resolve_backend("fa5", "cpu", F32, 16)


def test_the_block_diffusion_mask_runs_on_the_backends_that_take_a_mask(monkeypatch):
    """bd3lm's 2T mask: math and sdpa match a float64 reference under its dense form (rows: 20 noisy then 20
    clean positions, blocks of 4); flash, which takes no mask, is refused saying which can; auto picks math here
    and says why not flex, the backend it tries first for this mask."""
    monkeypatch.setattr(attn, "resolved", {})
    mask = BlockDiffusion(torch.arange(20) // 4)
    for name in ("math", "sdpa"):
        q, k, v = inputs()
        out = attention(name, q, k, v, True, mask)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attn.reference_attention(*ref_in, mask)
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        ref.backward(grad)
        out.backward(grad.float())
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        for t, r in zip((q, k, v), ref_in, strict=True):
            torch.testing.assert_close(t.grad.double(), r.grad, atol=1e-5, rtol=1e-5)
    assert backend_unavailable("flash", "cpu", F32, 16, "diffusion") == \
        "flash cannot take bd3lm's block-diffusion mask; flex, efficient, math, sdpa can"
    with pytest.raises(ValueError, match=r"Available here \(cpu, float32, head_dim 16, bd3lm mask\): math, sdpa$"):
        resolve_backend("flash", "cpu", F32, 16, "diffusion")
    chosen, note = resolve_backend("auto", "cpu", F32, 16, "diffusion")
    assert chosen == "math" and note.split("; skipped ")[1].startswith("flex (FlexAttention has no backward pass on CPU")


def test_fa4_names_what_it_lacks_in_one_line(monkeypatch):
    """FlashAttention 4 through SDPA needs torch 2.10+, the flash-attn-4 package, a Hopper or Blackwell GPU,
    bf16/fp16 and a head_dim its kernels have: each missing piece (stood in for on this CPU) is one line
    that names the fix."""
    bf16, cuda = torch.bfloat16, torch.device("cuda")
    registry = torch.nn.attention
    monkeypatch.setattr(registry, "list_flash_attention_impls", lambda: [], raising=False)  # torch < 2.10
    assert backend_unavailable("fa4", cuda, bf16, 128) == (
        "FlashAttention 4 runs through SDPA from torch 2.10 on (torch.nn.attention.activate_flash_attention_impl); "
        f"this is torch {torch.__version__}: upgrade torch, or use fa3, fa2 or flash")
    monkeypatch.setattr(registry, "list_flash_attention_impls", lambda: ["FA4"])
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: find_spec says None
    assert backend_unavailable("fa4", cuda, bf16, 128) == \
        "flash_attn.cute is not installed (FlashAttention 4): pip install --pre flash-attn-4"
    package = types.ModuleType("flash_attn")  # installed, without flash_attn.cute (FlashAttention 2 alone)
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    assert backend_unavailable("fa4", "cpu", bf16, 128) == "FlashAttention 4 is CUDA only; this is cpu"
    assert backend_unavailable("fa4", cuda, F32, 128) == "FlashAttention 4 computes in bfloat16 or float16, not float32"
    for capability, head_dim, why in [
            ((8, 0), 128, "FlashAttention 4 runs on Hopper (compute capability 9.0) and Blackwell (10.x); this GPU "
                          "is 8.0: use fa2 or flash"),
            ((9, 0), 264, "FlashAttention 4 takes a head_dim that is a multiple of 8 up to 256 (Blackwell: up to "
                          "128, or 256), not 264"),
            ((10, 0), 192, "FlashAttention 4 takes a head_dim that is a multiple of 8 up to 256 (Blackwell: up to "
                           "128, or 256), not 192")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert backend_unavailable("fa4", cuda, bf16, head_dim) == why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # all but the kernels
    assert re.fullmatch(r"flash_attn\.cute does not import \(ModuleNotFoundError: .*\): pip install --pre flash-attn-4",
                        backend_unavailable("fa4", cuda, bf16, 192))
    assert backend_unavailable("fa4", cuda, bf16, 128, "documents").startswith("fa4 cannot mask documents")


def test_auto_picks_the_fastest_that_runs_and_says_why(monkeypatch):
    monkeypatch.setattr(attn, "resolved", {})
    chosen, note = resolve_backend("auto", "cpu", F32, 16)
    assert chosen == "flash" and note.startswith("auto: flash (largest error ")
    assert "; skipped fa3 (" in note and "; skipped cudnn (the cudnn kernel is CUDA only; this is cpu)" in note
    assert "fa4" not in note  # it runs only when named
    assert resolve_backend("auto", "cpu", F32, 16) is attn.resolved[("auto", "cpu", F32, 16, None)]  # cached
    chosen, note = resolve_backend("auto", "cpu", F32, 16, "documents")
    assert chosen == "math" and "skipped flash (flash cannot mask documents" in note
    q, k, v = inputs()
    assert_matches_reference(attention("auto", q, k, v, True, documents()), q, k, v, documents())


def test_resolving_leaves_the_global_rng_alone(monkeypatch):
    """Ranks resolve at different moments (rank 0 also in preflight); if resolving drew from the global
    RNG, the ranks would initialise different weights, which FSDP (unlike DDP) never re-broadcasts."""
    monkeypatch.setattr(attn, "resolved", {})
    before = torch.get_rng_state()
    for doc_mask in (False, True):  # on this CPU, SDPA's flash kernel gets a trial call
        resolve_backend("auto", "cpu", F32, 16, "documents" if doc_mask else None)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("grad_ckpt", ["none", "selective"])
def test_the_model_resolves_auto_whatever_mode_it_runs_in(grad_ckpt, monkeypatch):
    """Auto's parity check runs a backward of its own: the model resolves it before any checkpointed
    block, and it runs whether the caller is under no_grad, inference_mode or autocast."""
    gpt = model.GPT(model.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                                    attn_backend="auto", grad_ckpt=grad_ckpt))
    x = torch.randint(0, 64, (2, 16))
    for mode in (torch.inference_mode, torch.no_grad, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        monkeypatch.setattr(attn, "resolved", {})
        with mode():
            gpt(x, x)
        assert list(attn.resolved.values())[0][0] in ("flash", "math")
    monkeypatch.setattr(attn, "resolved", {})
    gpt(x, x)[1].backward()
    assert attn.resolved[("auto", "cpu", F32, 16, None)][0] == "flash"


def test_auto_skips_a_backend_that_disagrees_with_float64(monkeypatch):
    monkeypatch.setattr(attn, "resolved", {})
    right = ATTENTION_KERNELS["flash"]
    monkeypatch.setitem(ATTENTION_KERNELS, "flash", lambda *args: 1.5 * right(*args))
    chosen, note = resolve_backend("auto", "cpu", F32, 16)
    assert chosen == "math" and "skipped flash (largest error 5.0e-01 against float64, over 0.0001)" in note


def test_kv_cache_queries_align_bottom_right():
    """The KV cache's new queries are the last positions: causal=True with fewer queries than keys."""
    q, k, v = inputs(grad=False)
    for name in HERE:
        for n in (1, 5):
            out = attention(name, q[:, :, -n:], k, v, True)
            torch.testing.assert_close(out.double(), reference(q, k, v, queries=n), atol=1e-5, rtol=1e-5)


def test_flex_attention_forward_on_cpu():
    """FlexAttention has no CPU backward, but its forward runs the same block masks as on a GPU."""
    q, k, v = inputs(grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex_attention warns that it is unfused
        with torch.no_grad():
            for doc_ids, n in ((None, None), (documents(), None), (None, 5)):
                out = ATTENTION_KERNELS["flex"](q[:, :, -(n or 40):], k, v, True,
                                                None if doc_ids is None else Documents(doc_ids))
                torch.testing.assert_close(out.double(), reference(q, k, v, doc_ids, n), atol=1e-5, rtol=1e-5)


def stand_in_flash_package(returns_lse, calls):
    """FlashAttention's Python API as documented, on plain torch ops: (B, T, heads, head_dim), GQA,
    causal aligned bottom-right, and varlen sequences packed along the first dimension."""
    def attend(q, k, v, causal):  # (T, H, D) one sequence
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / q.size(-1) ** 0.5
        if causal:
            s = s.masked_fill(torch.ones(q.size(0), k.size(0), dtype=torch.bool).tril(k.size(0) - q.size(0)) == 0,
                              float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    def flash_attn_func(q, k, v, causal=False):
        calls.append("dense")
        out = torch.stack([attend(q[b], k[b], v[b], causal) for b in range(q.size(0))])
        return (out, None) if returns_lse else out

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
        calls.append("varlen")
        assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        assert max_seqlen_q == max_seqlen_k == max(lengths) and q.dim() == 3
        out = torch.cat([attend(q[a:b], k[a:b], v[a:b], causal) for a, b in
                         zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True)])
        return (out, None) if returns_lse else out

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.mark.parametrize("name, module", [("fa2", "flash_attn"), ("fa3", "flash_attn_interface")])
def test_flash_attention_wrapper_against_a_stand_in_package(name, module, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, module, stand_in_flash_package(returns_lse=name == "fa3", calls=calls))
    kernel = ATTENTION_KERNELS[name]
    for doc_ids in (None, documents()):
        q, k, v = inputs()
        assert_matches_reference(kernel(q, k, v, True, None if doc_ids is None else Documents(doc_ids)), q, k, v,
                                 doc_ids)
    q, k, v = inputs(grad=False)
    torch.testing.assert_close(kernel(q[:, :, -5:], k, v, True).double(), reference(q, k, v, queries=5),
                               atol=1e-5, rtol=1e-5)
    assert calls == ["dense", "varlen", "dense"]
    assert Documents(documents()).varlen()[0].tolist() == [0, 13, 30, 40, 47, 80]
    with pytest.raises(ValueError, match="not a mask tensor"):
        kernel(q, k, v, torch.ones(40, 40, dtype=torch.bool))


def test_fp32_under_tf32_is_held_to_float16s_tolerance_and_no_kernel_is_one_line(monkeypatch):
    """On a GPU, float32 matmuls run in TF32 unless matmul_precision=highest: TF32 keeps float16's mantissa, so
    auto holds kernels to float16's tolerance there (with float32's, config/tiny.py on an H200 found none: math
    measured 8.0e-4 against 1e-4); on a CPU, and at highest, float32's stays. When no kernel passes, auto says so
    in a ValueError, which train.py and preflight turn into one line (it was a RuntimeError traceback)."""
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert attn.parity_tolerance(torch.float32, torch.device("cuda")) == attn.PARITY_TOLERANCE[torch.float16]
        assert attn.parity_tolerance(torch.float32, torch.device("cpu")) == 1e-4
        torch.set_float32_matmul_precision("highest")
        assert attn.parity_tolerance(torch.float32, torch.device("cuda")) == 1e-4
    finally:
        torch.set_float32_matmul_precision(precision)
    monkeypatch.setattr(attn, "resolved", {})  # what earlier tests resolved in this process stays theirs
    monkeypatch.setattr(attn, "backend_unavailable", lambda name, *a: f"{name} stood in as unavailable")
    with pytest.raises(ValueError, match="attn_backend=auto: no attention backend runs here: "):
        attn.resolve_backend("auto", torch.device("cpu"), torch.float32, 16)
