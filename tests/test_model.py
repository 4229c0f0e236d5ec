"""model.py: causality, KV cache, sampling, document masks, activation checkpointing, the chunked loss,
and the parameter/FLOP/memory arithmetic the configs quote."""
import dataclasses
import os
from functools import partial

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import configurator
from model import (RUNTIME_FIELDS, GPT, GPTConfig, flops_per_token, memory_estimate, param_counts, peak_flops,
                   sample_next)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**dict(dict(vocab_size=97, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32), **kw)))


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_logits_at_t_ignore_tokens_after_t(kv):
    model = tiny(n_kv_head=kv).eval()
    x = torch.randint(0, 97, (2, 40))
    y = x.clone()
    y[:, 17:] = torch.randint(0, 97, (2, 23))
    lx, ly = model(x)[0], model(y)[0]
    assert torch.allclose(lx[:, :17], ly[:, :17], atol=1e-6)
    assert not torch.allclose(lx[:, 17:], ly[:, 17:], atol=1e-3)  # and later positions do see them


@pytest.mark.parametrize("kw", [dict(n_kv_head=2), dict(n_kv_head=4, tie_embeddings=False)])
def test_kv_cache_generation_equals_recomputation(kw):
    model = tiny(**kw).eval()
    prompt = torch.randint(0, 97, (3, 7))
    cached = torch.stack(list(model.generate(prompt, 41, temperature=0)), 1)
    full = torch.stack(list(model.generate(prompt, 41, temperature=0, use_cache=False)), 1)
    assert torch.equal(cached, full)
    # past block_size the cache slides instead of failing
    long = list(model.generate(prompt, 100, temperature=0))
    assert len(long) == 100


def test_sampling_controls():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0).tolist() == [1, 0]
    for _ in range(20):  # top_k=1 and a tiny top_p both reduce to greedy
        assert sample_next(logits, 1.0, top_k=1, generator=g).tolist() == [1, 0]
        assert sample_next(logits, 1.0, top_p=0.01, generator=g).tolist() == [1, 0]
        assert sample_next(logits, 1.0, top_k=2, generator=g)[0].item() in (1, 3)
    seen = {sample_next(logits[:1], 1.0, generator=g).item() for _ in range(200)}
    assert seen == {0, 1, 2, 3}


def test_padded_vocabulary_is_never_sampled():
    model = tiny(vocab_size=70).eval()
    assert model.lm_head.weight.shape[0] == 128
    with torch.no_grad():
        model.lm_head.weight[70:] = 100.0  # padded rows would win every argmax
    out = torch.stack(list(model.generate(torch.zeros(2, 3, dtype=torch.long), 20, temperature=2.0)), 1)
    assert out.max().item() < 70


def load_model_config(name):
    cfg = configurator.configure(os.path.join(ROOT, "train.py"), [os.path.join(ROOT, "config", name)])
    vocab = {"a100_50m.py": 50257, "h200_1b_ddp8.py": 32768, "h100_d64.py": 32}[name]
    return GPTConfig(vocab_size=vocab, block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                     n_kv_head=cfg["n_kv_head"], n_embd=cfg["n_embd"], ffn_hidden=cfg["ffn_hidden"],
                     tie_embeddings=cfg["tie_embeddings"])


@pytest.mark.parametrize("name, total, non_embedding, gflops", [
    ("a100_50m.py", 88.98e6, 50.34e6, 0.609),      # DESIGN.md: ~50M non-embedding, ~89M, ~0.6 GFLOP/token
    ("h200_1b_ddp8.py", 1.124e9, 1.057e9, 7.953),  # ~1.12B
    ("h100_d64.py", 12.885e9, 12.885e9, 83.75),    # ~12.9B (12*L*d^2), not the runbook's 4.3B
])
def test_seed_config_arithmetic(name, total, non_embedding, gflops):
    config = load_model_config(name)
    counts = param_counts(config)
    assert counts["total"] == pytest.approx(total, rel=1e-3)
    assert counts["non_embedding"] == pytest.approx(non_embedding, rel=1e-3)
    assert flops_per_token(config) / 1e9 == pytest.approx(gflops, rel=1e-3)
    with torch.device("meta"):  # the arithmetic matches the module the config builds
        model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]


def test_untied_head_counts():
    config = GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, tie_embeddings=False)
    assert sum(p.numel() for p in GPT(config).parameters()) == param_counts(config)["total"]
    assert param_counts(config)["head"] == 128 * 32


def test_peak_flops_known_and_unknown():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_embd=32, n_head=4, n_kv_head=3)


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage the ops of a step make, while they are alive, by kind: made by the
    forward, rebuilt in the backward (grad mode on: checkpoint's recomputation) or by the backward
    proper; and by region: inside a block or outside (embedding, final norm, head, loss)."""

    def __init__(self, model, *batch):
        super().__init__()
        self.live, self.peak, self.phase, self.depth = {}, {}, "forward", 0
        self.before = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers(),
                                                                           *batch]}
        for block in model.layers:  # a block's body runs in the forward, and again when checkpoint rebuilds it
            block.body = partial(self.inside, block.body)

    def inside(self, body, *args):
        self.depth += 1
        try:
            return body(*args)
        finally:
            self.depth -= 1

    def alive(self):
        bytes_by_kind = {}
        for cdata, (ref, nbytes, kind) in list(self.live.items()):
            if ref.expired():
                del self.live[cdata]
            else:
                bytes_by_kind[kind] = bytes_by_kind.get(kind, 0) + nbytes
        return bytes_by_kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        phase = "rebuilt" if self.phase == "backward" and torch.is_grad_enabled() else self.phase
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live and ref.cdata not in self.before:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes(), (phase, "block" if self.depth else "head"))
        for kind, n in self.alive().items():
            self.peak[kind] = max(self.peak.get(kind, 0), n)
        return out


def measure_step(config, micro_batch):
    """One fp32 CPU step: (bytes the forward leaves for the backward, the most the backward rebuilds
    at once inside blocks and outside them, the model after its step, its optimizer)."""
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, config.vocab_size, (2, micro_batch, config.block_size))
    with LiveBytes(model, x, y) as live:
        _, loss = model(x, y)
        kept = sum(live.alive().values())
        live.phase = "backward"
        loss.backward()
    optimizer.step()
    return kept, live.peak.get(("rebuilt", "block"), 0), live.peak.get(("rebuilt", "head"), 0), model, optimizer


@pytest.mark.parametrize("grad_ckpt, loss_chunk", [("none", 0), ("full", 0), ("selective", 0), ("none", 200),
                                                   ("selective", 128)])
def test_memory_estimate_matches_what_a_cpu_step_allocates(grad_ckpt, loss_chunk):
    """The planner's bytes for weights, gradients and AdamW state equal a real step's; its activations
    and logits are what the step holds (fp32, where the compute dtype is the storage dtype, so every
    tensor counts): what the forward leaves for the backward, plus the one block (checkpointing) and the
    one loss chunk the backward rebuilds at a time."""
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                       grad_ckpt=grad_ckpt, loss_chunk=loss_chunk)
    kept, block, chunk, model, optimizer = measure_step(config, micro_batch=4)
    est = memory_estimate(config, micro_batch_size=4, compute_bytes=4)
    params = list(model.parameters())
    assert est["weights"] == sum(p.nbytes for p in params)
    assert est["gradients"] == sum(p.grad.nbytes for p in params)
    assert est["optimizer"] == sum(t.nbytes for st in optimizer.state.values() for k, t in st.items() if k != "step")
    if loss_chunk:  # the forward keeps no logits; the backward rebuilds one chunk's at a time
        assert est["activations"] == pytest.approx(kept + block, rel=0.01)
        assert est["logits"] == pytest.approx(chunk, rel=0.01) and est["logits"] == 8 * loss_chunk * 256
    else:
        assert est["activations"] + est["logits"] == pytest.approx(kept + block, rel=0.01)
        assert chunk == pytest.approx(0, abs=16) and est["logits"] == 8 * 4 * 128 * 256
    assert (block > 0) == (grad_ckpt != "none")
    # None follows the config; True and False are "full" and "none"
    for ckpt, same in ((None, grad_ckpt), (True, "full"), (False, "none")):
        assert memory_estimate(config, 4, compute_bytes=4, activation_checkpointing=ckpt) == \
            memory_estimate(config, 4, compute_bytes=4, activation_checkpointing=same)


def test_memory_estimate_orders_the_layouts():
    config = GPTConfig(vocab_size=32768, block_size=2048, n_layer=24, n_head=16, n_kv_head=4, n_embd=2048)
    act = {mode: memory_estimate(config, 8, activation_checkpointing=mode)["activations"]
           for mode in ("none", "selective", "full")}
    assert act["none"] > act["selective"] > act["full"]
    sharded = memory_estimate(config, 8, world_size=8, sharded=True, activation_checkpointing=True)
    assert sharded["optimizer"] == memory_estimate(config, 8)["optimizer"] // 8
    whole = memory_estimate(dataclasses.replace(config, loss_chunk=0), 8)["logits"]
    assert memory_estimate(config, 8)["logits"] * 2 == whole  # 8192 of the 16384 tokens at a time
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        memory_estimate(config, 8, activation_checkpointing="some")


def losses_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kw", [dict(), dict(doc_mask=True, bos_id=96, tie_embeddings=False)])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(mode, kw):
    x, y = torch.randint(0, 97, (2, 3, 48))
    _, loss, grads = losses_and_grads(tiny(**kw), x, y)
    _, ckpt_loss, ckpt_grads = losses_and_grads(tiny(grad_ckpt=mode, **kw), x, y)
    torch.testing.assert_close(ckpt_loss, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(ckpt_grads, grads, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=False)])
def test_chunked_loss_equals_the_whole_batch(kw):
    x, y = torch.randint(0, 97, (2, 3, 40))  # 120 tokens
    logits, loss, grads = losses_and_grads(tiny(loss_chunk=0, **kw), x, y)
    assert logits.shape == (3, 40, 128)
    for chunk in (40, 50, 7, 120, 10_000):  # dividing 120 or not; one chunk; more than there is
        no_logits, chunked, chunked_grads = losses_and_grads(tiny(loss_chunk=chunk, **kw), x, y)
        assert no_logits is None
        torch.testing.assert_close(chunked, loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(chunked_grads, grads, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(tiny(loss_chunk=50, **kw)(x, y)[1], loss, rtol=1e-6, atol=0)


def test_doc_mask_reads_packed_documents_as_if_alone():
    """Two documents packed in a row give each one the logits it has alone; without doc_mask the
    second sees the first. A row that starts mid-document (no BOS yet) is a document too."""
    bos = 96
    a, b = torch.randint(0, bos, (16,)), torch.randint(0, bos, (21,))
    a[0] = b[0] = bos
    packed = torch.cat([a, b])[None]
    masked, plain = tiny(doc_mask=True, bos_id=bos).eval(), tiny().eval()
    with torch.no_grad():
        out = masked(torch.cat([packed, torch.cat([b[1:], a, b[:1]])[None]]))[0]
        alone_a, alone_b = masked(a[None])[0][0], masked(b[None])[0][0]
        torch.testing.assert_close(out[0, :16], alone_a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[0, 16:], alone_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1, 20:36], alone_a, atol=1e-5, rtol=1e-5)  # after a BOS-less start
        torch.testing.assert_close(out[1, :20], masked(b[None, 1:])[0][0], atol=1e-5, rtol=1e-5)
        unmasked = plain(packed)[0][0]
        torch.testing.assert_close(unmasked[:16], alone_a, atol=1e-5, rtol=1e-5)  # same weights
        assert not torch.allclose(unmasked[16:], alone_b, atol=1e-3)
        # generation (the KV cache) reads one document: the same tokens as without the cache
        cached = torch.stack(list(masked.generate(a[None, :7], 20, temperature=0)), 1)
        assert torch.equal(cached, torch.stack(list(masked.generate(a[None, :7], 20, temperature=0,
                                                                    use_cache=False)), 1))


def test_runtime_settings_are_checked_and_old_configs_load():
    old = dict(vocab_size=97, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=85,
               rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True, vocab_multiple=64, init_std=0.02,
               attn_backend="sdpa")  # a config.json written before the runtime settings
    config = GPTConfig(**old)
    assert (config.doc_mask, config.bos_id, config.grad_ckpt, config.loss_chunk) == (False, None, "none", 8192)
    assert set(RUNTIME_FIELDS) <= {f.name for f in dataclasses.fields(GPTConfig)}
    for bad, message in ((dict(attn_backend="fa4"), "attn_backend='fa4'"), (dict(grad_ckpt="some"), "grad_ckpt"),
                         (dict(doc_mask=True), "doc_mask=True needs bos_id"), (dict(loss_chunk=-1), "loss_chunk")):
        with pytest.raises(ValueError, match=message):
            GPTConfig(**dict(old, **bad))
