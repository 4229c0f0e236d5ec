"""model.py: causality, KV cache, sampling, and the parameter/FLOP arithmetic the configs quote."""
import os

import pytest
import torch

import configurator
from model import GPT, GPTConfig, flops_per_token, memory_estimate, param_counts, peak_flops, sample_next

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
    cfg = configurator.parse(os.path.join(ROOT, "train.py"), [os.path.join(ROOT, "config", name)])
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


def test_memory_estimate_matches_what_a_cpu_step_allocates():
    """The planner's bytes for weights, gradients and AdamW state equal a real step's, and its
    activation count is within 2% of the tensors autograd actually keeps (fp32, where the
    compute dtype is the storage dtype, so every saved tensor is counted)."""
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 256, (2, 4, 128))
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits, loss = model(x, y)
    loss.backward()
    optimizer.step()
    est = memory_estimate(config, micro_batch_size=4, compute_bytes=4)
    params = list(model.parameters())
    assert est["weights"] == sum(p.nbytes for p in params)
    assert est["gradients"] == sum(p.grad.nbytes for p in params)
    assert est["optimizer"] == sum(t.nbytes for st in optimizer.state.values() for k, t in st.items() if k != "step")
    weights = {p.untyped_storage().data_ptr() for p in params} | {model.rope_cos.untyped_storage().data_ptr(),
                                                                   model.rope_sin.untyped_storage().data_ptr()}
    kept = sum(n for ptr, n in saved.items() if ptr not in weights)
    log_softmax = 4 * 128 * config.padded_vocab * 4  # the loss's saved fp32 log-probabilities
    assert est["activations"] == pytest.approx(kept - log_softmax, rel=0.02)
    # sharding divides the per-parameter state; checkpointing keeps one layer's activations, not all
    sharded = memory_estimate(config, micro_batch_size=4, world_size=8, sharded=True, activation_checkpointing=True)
    assert sharded["optimizer"] == est["optimizer"] // 8 and sharded["activations"] < est["activations"]
