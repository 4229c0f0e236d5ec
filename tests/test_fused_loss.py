"""The fused loss (podgpt/core/loss.py, fused_loss=True) is the checkpointed chunked loss it replaces: the same
loss and the same gradient of every parameter and of the head's input (fp32, within 1e-5), tied head or not,
with SFT's IGNORE targets and per-token weights, at any chunk size; the same training curve; gradients that
accumulate over micro-batches; bit-identical when run again; and it runs compiled."""
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from model import GPT, GPTConfig
from podgpt.core.util import IGNORE

SHAPE = dict(vocab_size=97, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)  # padded to 128
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**SHAPE, **dict(dict(fused_loss=True), **kw)))


def batch(ignore=False, weighted=False):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 97, (2, 3, 40), generator=g)  # 120 tokens
    if ignore:  # SFT: the prompt's tokens are not targets
        y = y.masked_fill(torch.rand(y.shape, generator=g) < 0.4, IGNORE)
    weights = torch.rand(y.shape, generator=g) * 2 if weighted else None
    return x, y, weights


def loss_and_grads(model, x, y, weights=None):
    """The head's loss through the whole model, and the gradients of every parameter and of the head's input."""
    model.zero_grad(set_to_none=True)
    h = model.blocks(model.embed_tokens(x)).detach().requires_grad_()
    hidden = model.blocks(model.embed_tokens(x))
    hidden.retain_grad()
    loss = model.head(hidden, y, weights)[1]
    loss.backward()
    head_input = model.head(h, y, weights)[1]  # the head alone, for the gradient of its input
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    head_input.backward()
    return loss.detach(), grads, hidden.grad, h.grad


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("ignore, weighted", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "ignore", "weights", "ignore+weights"])
def test_fused_loss_equals_the_checkpointed_and_the_whole_loss(tie, ignore, weighted):
    x, y, w = batch(ignore, weighted)
    whole = loss_and_grads(tiny(loss_chunk=0, tie_embeddings=tie), x, y, w)
    for chunk in (7, 50, 120, 10_000):  # dividing 120 or not; one chunk; more than there is
        plain = loss_and_grads(tiny(loss_chunk=chunk, tie_embeddings=tie, fused_loss=False), x, y, w)
        fused = loss_and_grads(tiny(loss_chunk=chunk, tie_embeddings=tie, fused_loss=True), x, y, w)
        for want in (whole, plain):
            torch.testing.assert_close(fused, want, **TOL)
        assert set(fused[1]) == {n for n, _ in tiny(tie_embeddings=tie).named_parameters()}


def test_fused_loss_is_what_forward_uses_and_counts_its_targets():
    """model(x, y) goes through the fused loss, whose step runs the head's matmul once per chunk, not twice, and
    divides by the targets not IGNORE; a batch of IGNORE alone is 0, not NaN."""
    x, y, _ = batch(ignore=True)
    fused, plain = tiny(loss_chunk=50), tiny(loss_chunk=50, fused_loss=False)
    torch.testing.assert_close(fused(x, y)[1], plain(x, y)[1], **TOL)
    assert fused(x, torch.full_like(y, IGNORE))[1].item() == 0
    assert head_matmuls(plain, x, y) == 3 * 4  # 3 chunks: logits, rebuilt, grad of the input and of the weight
    assert head_matmuls(fused, x, y) == 3 * 3  # logits, grad of the input and of the weight


class HeadMatmuls(TorchDispatchMode):
    """Counts the matmuls with an operand of the head's padded vocabulary (128)."""
    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += any(128 in a.shape for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def head_matmuls(model, x, y):
    """The head's matmuls in a step's forward and backward."""
    with HeadMatmuls() as counted:
        model(x, y)[1].backward()
    return counted.count


def test_gradients_accumulate_over_two_backward_calls():
    models = tiny(loss_chunk=50), tiny(loss_chunk=50, fused_loss=False)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x, y = torch.randint(0, 97, (2, 3, 40))
        for model in models:
            model(x, y)[1].backward()
    fused, plain = ({n: p.grad for n, p in m.named_parameters()} for m in models)
    torch.testing.assert_close(fused, plain, **TOL)


def test_fused_loss_is_deterministic():
    x, y, w = batch(ignore=True, weighted=True)
    model = tiny(loss_chunk=50)
    first, again = loss_and_grads(model, x, y, w), loss_and_grads(model, x, y, w)
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(first),
                                                 torch.utils._pytree.tree_leaves(again), strict=True))


def train_curve(fused, steps=200):
    model = tiny(loss_chunk=50, fused_loss=fused, tie_embeddings=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g, losses = torch.Generator().manual_seed(3), []
    for _ in range(steps):
        x = (torch.randint(0, 97, (3, 1), generator=g) + torch.arange(41)) % 97  # counting: learnable
        loss = model(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


def test_two_hundred_training_steps_fused_or_not_trace_the_same_curve():
    """Far inside any run-to-run noise: every step's loss within 1e-5 (measured: 7e-7 at most)."""
    fused, plain = train_curve(True), train_curve(False)
    assert fused[-1] < fused[0] - 1  # it learns
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-5)


def test_block_diffusion_s_loss_runs_fused_and_never_predicts_mask():
    """bd3lm sets [MASK]'s logit to -inf and weighs each noised token by 1/t: fused, the same loss and gradients
    as the checkpointed chunks, with the head's matmul once per chunk, and no gradient for [MASK]'s head row."""
    from podgpt.pod.objectives import make_config, make_model
    x, draws = torch.randint(0, 96, (2, 48)), torch.rand(2, 2, 48)
    results, matmuls = [], []
    for fused in (True, False):
        torch.manual_seed(0)
        model = make_model(make_config(**SHAPE, loss_chunk=16, objective="bd3lm", fused_loss=fused,
                                       tie_embeddings=False))
        loss = model(x, draws)[1]
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        matmuls.append(head_matmuls(model, x, draws))
    torch.testing.assert_close(*results, **TOL)
    assert matmuls == [6 * 3, 6 * 4]  # 96 noised positions in chunks of 16
    assert torch.equal(results[0][1]["lm_head.weight"][model.config.mask_id], torch.zeros(32))


def test_an_fp8_head_is_not_fused():
    """fp8_head runs the head through its float8 module, which the fused loss (reading the weight) would skip."""
    assert GPT.fuses_loss(GPTConfig(**SHAPE, loss_chunk=16)) and not GPT.fuses_loss(
        GPTConfig(**SHAPE, loss_chunk=16, fp8_head=True))


def test_the_fused_loss_compiles_forward_and_backward():
    x, y, _ = batch(ignore=True)
    eager = loss_and_grads(tiny(loss_chunk=50), x, y)
    model = tiny(loss_chunk=50)
    compiled = torch.compile(model)
    loss = compiled(x, y)[1]
    loss.backward()
    torch.testing.assert_close(loss.detach(), eager[0], **TOL)
    torch.testing.assert_close({n: p.grad for n, p in model.named_parameters()}, eager[1], **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs CUDA (run python -m pytest -m gpu)")
def test_fused_loss_on_cuda_in_bf16_tracks_the_checkpointed_one_and_holds_less():
    """bf16 autocast, compiled, a 50k vocabulary: the fused loss and its gradients within bf16's reach of the
    checkpointed loss, at a lower peak of memory."""
    shape = dict(vocab_size=50257, block_size=1024, n_layer=2, n_head=4, n_kv_head=2, n_embd=256, loss_chunk=2048)
    x = torch.randint(0, 50257, (8, 1025), device="cuda")
    results = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.compile(GPT(GPTConfig(**shape, fused_loss=fused)).cuda())
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        results[fused] = (loss.item(), torch.cuda.max_memory_allocated(),
                          {n: p.grad.float() for n, p in model.named_parameters()})
    (loss, peak, grads), (want, want_peak, want_grads) = results[True], results[False]
    assert abs(loss - want) < 2e-3 and peak < want_peak, (loss, want, peak, want_peak)
    for n, g in grads.items():
        assert (g - want_grads[n]).norm() <= 0.02 * want_grads[n].norm(), n


def test_refine_runs_the_fused_loss_in_one_graph():
    """refine's losses, one per supervision step inside its loop (head(in_graph=True)), go through the fused loss:
    the same loss and gradients as the checkpointed chunks, and still one compiled graph without a break."""
    from podgpt.pod.objectives import make_config, make_model
    x = torch.randint(0, 96, (2, 48))
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = make_model(make_config(**SHAPE, loss_chunk=40, objective="refine", fused_loss=fused))
        loss = model(x, x)[1]
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(*results, **TOL)
    model.config.fused_loss = True
    explained = torch._dynamo.explain(model)(x, x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
