"""model.py: causality, KV cache, sampling, document masks, activation checkpointing, the chunked loss;
and preflight.py's parameter/FLOP/memory arithmetic the configs quote."""
import dataclasses
import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from podgpt.core import configurator
from conftest import ROOT, popen
from model import RUNTIME_FIELDS, GPT, GPTConfig, sample_next
from podgpt.pod.objectives import make_model
from podgpt.pod.preflight import flops_per_token, peak_flops, plan_layout
from podgpt.pod.memory import memory_estimate, memory_phases, param_counts



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
    ("h200_1b_ddp8.py", 1.149e9, 1.082e9, 8.104),  # ~1.15B: SwiGLU hidden 5632 (the recipe's 5461: 1.124B)
    ("h100_d64.py", 12.953e9, 12.953e9, 84.16),    # ~13.0B: hidden 11008 (10922, 12*L*d^2: 12.885B), not 4.3B
])
def test_seed_config_arithmetic(name, total, non_embedding, gflops):
    config = load_model_config(name)
    counts = param_counts(config)
    assert counts["total"] == pytest.approx(total, rel=1e-3)
    assert counts["non_embedding"] == pytest.approx(non_embedding, rel=1e-3)
    assert flops_per_token(config) / 1e9 == pytest.approx(gflops, rel=1e-3)
    with torch.device("meta"):  # the arithmetic matches the module the config builds
        model = make_model(config)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]


@pytest.mark.parametrize("n_embd, multiple_of, hidden", [
    (2048, 256, 5632), (2048, 1, 5461),   # the 1B: floor(8 * 2048 / 3) = 5461, up to 22 x 256
    (4096, 256, 11008),                   # d64: Llama-7B's hidden size
    (768, 256, 2048), (192, 256, 512),    # already multiples of 256: unchanged
    (96, 256, 256), (96, 64, 256), (96, 1, 256), (64, 64, 192), (64, 1, 170)])
def test_swiglu_hidden_is_rounded_up_to_multiple_of(n_embd, multiple_of, hidden):
    config = GPTConfig(vocab_size=97, n_layer=1, n_head=4, n_kv_head=2, n_embd=n_embd, multiple_of=multiple_of)
    assert config.ffn_hidden == hidden and GPT(config).layers[0].mlp.up_proj.out_features == hidden
    # q and o: d x d each; k and v: d x d/2 each (4 heads, 2 of them for keys and values); 2 norms + the final one
    assert param_counts(config)["non_embedding"] == 3 * n_embd * n_embd + 3 * n_embd * hidden + 3 * n_embd
    # an explicit size is kept as given, and nothing else is accepted
    assert GPTConfig(vocab_size=97, n_head=4, n_kv_head=2, n_embd=n_embd, ffn_hidden=100).ffn_hidden == 100
    with pytest.raises(ValueError, match="multiple_of=0"):
        GPTConfig(vocab_size=97, n_head=4, n_kv_head=2, n_embd=n_embd, multiple_of=0)


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
    model = make_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, config.vocab_size, (2, micro_batch, config.block_size))
    with LiveBytes(model, x, y) as live:
        loss = model(x, y)[1]  # as train.py: the logits are not held
        kept = sum(live.alive().values())
        live.phase = "backward"
        loss.backward()
    optimizer.step()
    return kept, live.peak.get(("rebuilt", "block"), 0), live.peak.get(("rebuilt", "head"), 0), model, optimizer


@pytest.mark.parametrize("grad_ckpt, loss_chunk", [("none", 0), ("full", 0), ("selective", 0), ("none", 200),
                                                   ("selective", 128)])
def test_memory_phases_match_what_a_cpu_step_allocates(grad_ckpt, loss_chunk):
    """The planner's bytes for weights, gradients and AdamW state equal a real step's, and what it holds at
    each moment is what the step holds (fp32, where the compute dtype is the storage dtype, so every tensor
    counts): at the end of the forward, what the forward leaves for the backward and one loss chunk's fp32
    logits and log-softmax (rebuilt in the backward, or kept by the forward when the loss is not chunked);
    at the end of the backward, one layer's activations: what the forward kept of it and what
    checkpointing rebuilds."""
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                       grad_ckpt=grad_ckpt, loss_chunk=loss_chunk, fused_loss=False)  # the checkpointed chunks
    kept, block, chunk, model, optimizer = measure_step(config, micro_batch=4)
    phases = memory_phases(config, micro_batch_size=4, compute_bytes=4)
    fwd, end = phases["forward_end"], phases["backward_end"]
    params = list(model.parameters())
    assert fwd["weights"] == end["weights"] == sum(p.nbytes for p in params)
    assert end["gradients"] == sum(p.grad.nbytes for p in params) and fwd["gradients"] == 0
    assert fwd["optimizer"] == sum(t.nbytes for st in optimizer.state.values() for k, t in st.items() if k != "step")
    tokens = 4 * 128
    if loss_chunk and tokens > loss_chunk:  # the forward keeps no logits; the backward rebuilds a chunk at a time
        assert fwd["activations"] == pytest.approx(kept, rel=0.01)
        assert fwd["logits"] == pytest.approx(chunk, rel=0.01) and fwd["logits"] == 8 * loss_chunk * 256
    else:  # one chunk: the forward keeps its log-softmax, 4 of the 8 bytes per logit
        assert fwd["activations"] + 4 * tokens * 256 == pytest.approx(kept, rel=0.01)
        assert chunk == pytest.approx(0, abs=16) and fwd["logits"] == 8 * tokens * 256
    outside = tokens * (8 * 64 + 4 * 64 + 4)  # the embedding's output and the final norm's
    one_layer = (fwd["activations"] - outside) / config.n_layer
    assert end["activations"] == pytest.approx(outside + one_layer + block, rel=0.01)
    assert (block > 0) == (grad_ckpt != "none")
    est = memory_estimate(config, 4, compute_bytes=4)
    assert est["total"] == max(p["total"] for p in phases.values()) == sum(v for k, v in est.items()
                                                                             if k not in ("params", "total"))
    # None follows the config; True and False are "full" and "none"
    for ckpt, same in ((None, grad_ckpt), (True, "full"), (False, "none")):
        assert memory_estimate(config, 4, compute_bytes=4, activation_checkpointing=ckpt) == \
            memory_estimate(config, 4, compute_bytes=4, activation_checkpointing=same)


@pytest.mark.parametrize("grad_ckpt, loss_chunk", [("none", 200), ("selective", 128)])
def test_memory_phases_match_what_a_fused_loss_step_allocates(grad_ckpt, loss_chunk):
    """fused_loss: the forward leaves for the backward what the plan's activations say, within 1% (its input's
    gradient where the checkpointed loss keeps the input, and the head's fp32 gradient); the loss's chunk at its
    peak in the forward (fp32 logits and logsumexp's temporaries, beside the final norm's output) is the plan's
    logits, within 1%; and the backward rebuilds nothing."""
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                       grad_ckpt=grad_ckpt, loss_chunk=loss_chunk, fused_loss=True)
    torch.manual_seed(0)
    model = make_model(config)
    x, y = torch.randint(0, config.vocab_size, (2, 4, config.block_size))
    with LiveBytes(model, x, y) as live:
        loss = model(x, y)[1]
        alive = live.alive()
        live.phase = "backward"
        loss.backward()
    fwd = memory_phases(config, micro_batch_size=4, compute_bytes=4)["forward_end"]
    assert fwd["activations"] == pytest.approx(sum(alive.values()), rel=0.01)
    assert fwd["logits"] == pytest.approx(live.peak["forward", "head"] - alive["forward", "head"], rel=0.01)
    assert live.peak.get(("rebuilt", "head"), 0) <= 16


# the peak memory of one compiled training step, in bytes (the peak RSS of a fresh process, compiling included)
LOSS_SHAPE = dict(vocab_size=32768, block_size=512, n_layer=1, n_head=2, n_kv_head=1, n_embd=64)
COMPILED_STEP_PEAK = f"""
import resource, sys, torch
from model import GPT, GPTConfig
model = torch.compile(GPT(GPTConfig(**{LOSS_SHAPE}, loss_chunk=int(sys.argv[1]))), dynamic=False)
x = torch.randint(0, 32768, (16, 512))
model(x, x)[1].backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_the_chunked_loss_keeps_its_saving_under_torch_compile():
    """Compiled, a step whose loss goes 2048 tokens at a time peaks below one that holds the logits of all 8192
    tokens by 70% at least of what memory.memory_estimate says the chunks save (the logits of the other 6144
    tokens): its backward rebuilds one chunk at a time, never every chunk at once. Each step in a fresh process,
    both at once."""
    procs = [popen([sys.executable, "-c", COMPILED_STEP_PEAK, str(chunk)], cwd=ROOT, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True) for chunk in (2048, 0)]
    peaks = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            peaks.append(int(out.split()[-1]))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    chunked, whole = peaks
    planned = (memory_estimate(GPTConfig(**LOSS_SHAPE, loss_chunk=0), 16, compute_bytes=4)["logits"]
               - memory_estimate(GPTConfig(**LOSS_SHAPE, loss_chunk=2048), 16, compute_bytes=4)["logits"])
    assert whole - chunked >= 0.7 * planned, (chunked, whole, planned)


@pytest.mark.parametrize("objective", ["refine", "bd3lm"])
def test_the_refine_and_diffusion_losses_trace_into_one_graph(objective):
    """The autoregressive loss divides by its count of targets outside the compiled graph (per_target_outside);
    refine's loss, one a supervision step inside its loop, and bd3lm's weighted loss stay inside it: a graph break
    there would leave refine's loop to run eagerly, each block compiled apart."""
    from podgpt.pod.objectives import make_config, make_model
    config = make_config(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, loss_chunk=16,
                       objective=objective)
    model, x = make_model(config), torch.randint(0, 255, (2, 32))
    y = x if objective == "refine" else torch.rand(2, 2, 32)  # bd3lm's targets: the noise draws
    model(x, y)  # the attention kernel resolved (its first call is eager work, outside any graph)
    explained = torch._dynamo.explain(model)(x, y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def measured_memory_rows():
    """Every GPU-measured row of bench/results/memory.jsonl: (model config, micro-batch, grad_ckpt, peak bytes)."""
    with open(os.path.join(ROOT, "bench", "results", "memory.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # rows from before fused_loss and residual_dtype ran the checkpointed loss over an fp32 stream
    before = dict(fused_loss=False, residual_dtype="float32")
    return [(GPTConfig(**{**before, **{k: v for k, v in rec["model"].items() if k != "padded_vocab"}}), r["micro_batch"],
             r["grad_ckpt"], r["measured_gb"] * 1e9) for rec in records for r in rec["rows"] if r["measured_gb"]]


def test_memory_estimate_is_within_10_percent_of_every_measured_peak():
    """bench/memory.py's peaks on an H100 80GB (bf16, eager, one process, 2026-11-22 and -23): the 1B
    shape at SwiGLU hidden 5461 and 5632, the 50M with and without the chunked loss, the d64 width at 4
    layers; each grad_ckpt. The estimate is within 10% of every one and never more than 5% under it (an
    estimate under the truth plans a run that runs out of memory)."""
    rows = measured_memory_rows()
    assert len(rows) >= 25 and {r[2] for r in rows} == {"none", "full", "selective"}
    assert {(c.n_embd, c.ffn_hidden, c.loss_chunk) for c, *_ in rows} >= {
        (2048, 5461, 8192), (2048, 5632, 8192), (768, 2048, 8192), (768, 2048, 0), (4096, 11008, 8192)}
    for config, mb, ckpt, measured in rows:
        ratio = memory_estimate(config, mb, activation_checkpointing=ckpt)["total"] / measured
        assert 0.95 <= ratio <= 1.10, (config.n_embd, config.ffn_hidden, config.loss_chunk, ckpt, mb, ratio)


@pytest.mark.parametrize("hidden, largest", [(5461, 14), (5632, 13)])
def test_capacity_predicts_the_largest_micro_batch_within_one(hidden, largest):
    """sanity.py --capacity on an H100 80GB HBM3 (85,017,493,504 bytes, eager, bf16): the largest
    micro-batch of the 1B shape that trained was 14 at hidden 5461 and 13 at 5632 (2026-11-22 and -23).
    The planner's prediction for the whole GPU, as sanity.py makes it, is within one."""
    config = GPTConfig(vocab_size=32768, block_size=2048, n_layer=24, n_head=16, n_kv_head=4, n_embd=2048,
                       ffn_hidden=hidden, fused_loss=False, residual_dtype="float32")  # as it was measured
    predicted = plan_layout(config, 16, 1, False, "none", 2, 85_017_493_504)["largest_micro_batch"]
    assert abs(predicted - largest) <= 1, predicted


def test_memory_estimate_orders_the_layouts():
    config = GPTConfig(vocab_size=32768, block_size=2048, n_layer=24, n_head=16, n_kv_head=4, n_embd=2048,
                       fused_loss=False)  # the checkpointed chunks hold their logits in the backward
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
    for bad, message in ((dict(attn_backend="fa5"), "attn_backend='fa5'"), (dict(grad_ckpt="some"), "grad_ckpt"),
                         (dict(doc_mask=True), "doc_mask=True needs bos_id"), (dict(loss_chunk=-1), "loss_chunk")):
        with pytest.raises(ValueError, match=message):
            GPTConfig(**dict(old, **bad))
