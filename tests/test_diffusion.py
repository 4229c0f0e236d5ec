"""
objective="bd3lm": block diffusion on GSM8K. The model's loss, masks and sampler on CPU (a tiny model, the
real forward) against hand-built and slow references, the loader's noise, and the training loop on it.
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from podgpt.core import attention
from podgpt.research import bd3lm
from podgpt.pod import report
from conftest import read_metrics, run_script, train_tiny
from podgpt.core.checkpoint import find_checkpoint
from podgpt.pod.checkpoints import load_model
from podgpt.core.data import Loader, load_manifest
from podgpt.release.hf import tokenizer_dir
from podgpt.research.bd3lm import LOGLINEAR_EPS, BlockDiffusion, diffusion_draws
from model import GPTConfig, KVCache
from podgpt.pod.objectives import make_config, make_model
from podgpt.pod.preflight import flops_per_token
from podgpt.pod.memory import memory_phases, param_counts
from podgpt.corpus.tasks import gsm8k_problems
from podgpt.core.tokenizer import load_tokenizer
from test_model import LiveBytes
from test_prepare import GSM8K, gsm8k_parquet, hub_env, server  # noqa: F401  (server: a local hub's fixture)

SHAPE = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bos_id=95)
DIFFUSION = ["--objective=bd3lm", "--diffusion_block=8"]


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return make_model(make_config(**{**SHAPE, "objective": "bd3lm", "diffusion_block": 4, **kw})).eval()


def tokens(rows, T=32, seed=0):
    return torch.randint(0, SHAPE["bos_id"] + 1, (rows, T), generator=torch.Generator().manual_seed(seed))


def all_masked(rows, T=32):
    """Draws that mask every token at t = 1: the loss is then each token's plain cross-entropy."""
    draws = torch.zeros(rows, 2, T)
    draws[:, 1] = 1.0
    return draws


# -----------------------------------------------------------------------------
# the loss

def test_block_one_with_the_linear_schedule_is_the_autoregressive_loss():
    """BD3-LM's reduction: with blocks of one token and t ~ U[eps, 1], a token is masked with probability t
    and weighed 1/t, so the NELBO's expectation is every token's cross-entropy given the clean tokens before
    it, the model's autoregressive loss. That loss, token by token through the sampler's KV cache (the
    clean prefix in the cache, [MASK] at the token), equals the all-masked pass at t = 1, and the mean of
    the loss over 200 draws of t and masks is within 2% of it."""
    model = tiny(diffusion_block=1, loss_chunk=0)
    c, x0 = model.config, tokens(16)
    with torch.no_grad():
        ar = model(x0, all_masked(16))[1]
        by_token = []
        for row in x0[:2]:
            cache = KVCache(c, 1, c.block_size, "cpu", torch.float32)
            for i in range(c.block_size):
                logits = model.denoise(torch.tensor([[c.mask_id]]), cache)[0, 0]
                logits[c.mask_id] = float("-inf")  # as training: never [MASK]
                by_token.append(F.cross_entropy(logits, row[i]))
                model(row[None, i:i + 1], cache=cache)
        assert torch.stack(by_token).mean().item() == pytest.approx(model(x0[:2], all_masked(2))[1].item(), rel=1e-5)
        g = torch.Generator().manual_seed(1)
        draws = [model(x0, torch.rand(16, 2, c.block_size, generator=g))[1] for _ in range(200)]
    assert torch.stack(draws).mean().item() == pytest.approx(ar.item(), rel=0.02)
    assert torch.stack(draws).std() > 0.01 * ar  # the draws do differ: the mean is not a copy of one


@pytest.mark.parametrize("hdp, loss_chunk", [("", 0), ("", 24), ("8,8,16", 0)], ids=["bd3lm", "chunked", "hdp"])
def test_the_2T_pass_equals_a_slow_reference_block_by_block(hdp, loss_chunk):
    """One pass over [noisy copy, clean copy] under BlockDiffusion's mask gives the loss of running every block
    of every row on its own (same t and masks): the clean blocks before it go into a KV cache one block at a
    time, then the noisy block is denoised after them, and its masked tokens' cross-entropy x 1/t is summed
    ([MASK] never predicted). HDP's question is never masked and is not in the average."""
    model = tiny(hdp_segments=hdp, loss_chunk=loss_chunk)
    c, x0 = model.config, tokens(3)
    draws = torch.rand(3, 2, c.block_size, generator=torch.Generator().manual_seed(2))
    blocks = c.diffusion_blocks()
    total = torch.zeros(())
    with torch.no_grad():
        fast = model(x0, draws)[1]
        for r in range(3):
            cache = KVCache(c, 1, c.block_size, "cpu", torch.float32)
            for b in range(int(blocks.max()) + 1):
                span = (blocks == b).nonzero().flatten()
                a, e = int(span[0]), int(span[-1]) + 1
                t = LOGLINEAR_EPS + (1 - LOGLINEAR_EPS) * draws[r, 1, b]
                masked = (draws[r, 0, a:e] < t) & (torch.arange(a, e) >= c.noised_from)
                logits = model.denoise(torch.where(masked, c.mask_id, x0[r, a:e])[None], cache)[0].float()
                logits[:, c.mask_id] = float("-inf")
                total += (F.cross_entropy(logits, x0[r, a:e], reduction="none") * masked / t).sum()
                model(x0[r:r + 1, a:e], cache=cache)
    assert fast.item() == pytest.approx((total / (3 * (c.block_size - c.noised_from))).item(), rel=1e-5)
    if hdp:
        assert c.noised_from == 8 and not blocks[:8].any()


def test_clipped_trains_on_its_range_and_validates_on_the_nelbo():
    """clipped draws t from [clip_low, clip_high] in training only: in eval mode the loss is loglinear's."""
    clipped, loglinear = tiny(noise_schedule="clipped", clip_low=0.4, clip_high=0.6), tiny()
    x0, draws = tokens(2), torch.rand(2, 2, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(clipped(x0, draws)[1], loglinear(x0, draws)[1])  # eval mode
        clipped.train()
        draws[:, 1] = 0.0  # t = clip_low = 0.4, where loglinear's would be 1e-3
        draws[:, 0] = 0.3  # so every token is masked, and weighed 1 / 0.4
        assert clipped(x0, draws)[1].item() == pytest.approx(clipped.eval()(x0, all_masked(2))[1].item() / 0.4,
                                                             rel=1e-5)


# -----------------------------------------------------------------------------
# the masks

def hand_mask(blocks):
    """BlockDiffusion's mask written out pair by pair from its definition, over [noisy copy, clean copy]."""
    T = len(blocks)
    allowed = torch.zeros(2 * T, 2 * T, dtype=torch.bool)
    for q in range(2 * T):
        for kv in range(2 * T):
            q_clean, kv_clean, bq, bkv = q >= T, kv >= T, blocks[q % T], blocks[kv % T]
            if not q_clean:  # a noisy token: its own noisy block, and the clean blocks before it
                allowed[q, kv] = bq == bkv if not kv_clean else bkv < bq
            else:  # a clean token: clean blocks up to its own, never a noisy one
                allowed[q, kv] = kv_clean and bkv <= bq
    return allowed


def test_bd3lm_mask_is_the_hand_built_one():
    """T = 8 in blocks of 2, checked whole, and FlexAttention's mask function gives the same pairs."""
    config = make_config(**{**SHAPE, "block_size": 8}, objective="bd3lm", diffusion_block=2)
    blocks = config.diffusion_blocks()
    assert blocks.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    mask = BlockDiffusion(blocks)
    assert torch.equal(mask.dense()[0, 0], hand_mask(blocks.tolist()))
    i = torch.arange(16)
    assert torch.equal(mask.allowed(i[:, None], i[None, :]), hand_mask(blocks.tolist()))
    assert mask.positions.tolist() == list(range(8)) * 2  # both copies at RoPE positions 0..7
    # rows: noisy token 2 (block 1) sees noisy 2-3 and clean 0-1; clean token 8+2 sees clean 0-3
    assert mask.dense()[0, 0, 2].nonzero().flatten().tolist() == [2, 3, 8, 9]
    assert mask.dense()[0, 0, 10].nonzero().flatten().tolist() == [8, 9, 10, 11]


def test_hdp_mask_keeps_the_question_to_itself_and_the_plan_from_the_execution():
    """hdp_segments 4,4,8 in blocks of 2: the question is one block that sees only itself (both copies); a plan
    token sees the question and the plan before it, never the execution; an execution token sees all three."""
    config = make_config(**{**SHAPE, "block_size": 16}, objective="bd3lm", diffusion_block=2, hdp_segments="4,4,8")
    blocks = config.diffusion_blocks()
    assert blocks.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    dense = BlockDiffusion(blocks).dense()[0, 0]
    assert torch.equal(dense, hand_mask(blocks.tolist()))
    T, question, plan, execution = 16, range(0, 4), range(4, 8), range(8, 16)
    for copy in (0, T):
        assert dense[[copy + q for q in question]][:, [p + o for p in (*plan, *execution) for o in (0, T)]].sum() == 0
        assert dense[[copy + p for p in plan]][:, [e + o for e in execution for o in (0, T)]].sum() == 0
    assert dense[T + 15, T:].all() and dense[15, T:T + 14].all()  # the execution's last block: everything clean before
    assert dense[[q for q in question]][:, list(question)].all()  # the question sees itself both ways


def test_config_refuses_what_cannot_be_a_diffusion_model():
    for bad, match in ((dict(diffusion_block=5), "diffusion_block=5 must divide block_size=32"),
                       (dict(hdp_segments="8,8,8"), "hdp_segments='8,8,8': three positive lengths"),
                       (dict(hdp_segments="8,6,18"), "must divide the plan and execution segments"),
                       (dict(doc_mask=True), "doc_mask=True is for objective=ar or refine"),
                       (dict(noise_schedule="clipped", clip_low=0.9, clip_high=0.5), "need 0 < clip_low < clip_high"),
                       (dict(noise_schedule="cosine"), "noise_schedule='cosine'"),
                       (dict(objective="ar", hdp_segments="8,8,16"), "is for objective=bd3lm")):
        with pytest.raises(ValueError, match=match):
            make_config(**{**SHAPE, "objective": "bd3lm", "diffusion_block": 4, **bad})


# -----------------------------------------------------------------------------
# the arithmetic: FLOPs and memory count the 2T pass

def test_flops_count_both_copies():
    plain = GPTConfig(**SHAPE)
    diffusion = make_config(**SHAPE, objective="bd3lm", diffusion_block=4)
    d, T, L = 32, 32, 2
    layer = (param_counts(plain)["non_embedding"] - d) // L
    head = d + diffusion.padded_vocab * d
    assert flops_per_token(diffusion) == 6 * (L * 2 * layer + head) + 12 * L * 2 * d * 2 * T
    assert flops_per_token(plain) == 6 * (L * layer + head) + 12 * L * d * T


@pytest.mark.parametrize("grad_ckpt, loss_chunk", [("none", 0), ("full", 128), ("selective", 128)])
def test_memory_plan_counts_both_copies(grad_ckpt, loss_chunk):
    """What the planner says a bd3lm forward keeps for the backward is what a real fp32 step keeps, within 10%."""
    config = make_config(vocab_size=257, block_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, objective="bd3lm",
                       diffusion_block=16, grad_ckpt=grad_ckpt, loss_chunk=loss_chunk)
    torch.manual_seed(0)
    model = make_model(config)
    x0 = torch.randint(0, 256, (4, 128))
    draws = torch.rand(4, 2, 128)
    with LiveBytes(model, x0, draws) as live:
        loss = model(x0, draws)[1]  # held, as train.py holds it until its backward
        kept = sum(live.alive().values())
    assert loss.requires_grad
    forward = memory_phases(config, micro_batch_size=4, compute_bytes=4)["forward_end"]
    log_softmax = 0 if loss_chunk else 4 * 4 * 128 * config.padded_vocab
    assert 0.9 <= kept / (forward["activations"] + log_softmax) <= 1.1


# -----------------------------------------------------------------------------
# the sampler

def test_sampler_unmasks_a_block_in_its_passes_then_commits_it():
    """steps=2 over blocks of 4: the first pass fills the 2 most confident of 4, the second the rest; the prompt's
    tokens in the first open block stay; every pass of a block comes before its tokens are yielded, and a
    block's tokens before the next block's passes (text made block by block)."""
    model = tiny()
    c = model.config
    events = []
    denoise = model.denoise
    model.denoise = lambda block, cache: events.append(("pass", int((block == c.mask_id).sum())) if (
        block == c.mask_id).any() else ("commit",)) or denoise(block, cache)
    prompt = tokens(1, 6, seed=4)
    out = []
    for token in model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(0), steps=2,
                                unmask="confidence"):
        events.append(("token",))
        out.append(token.item())
    # prompt 6: block [0,4) goes into the cache whole, [4,8) holds 2 prompt tokens and 2 masks, then [8,12), [12,16)
    assert events == [("commit",), ("pass", 2), ("pass", 1), ("commit",), ("token",), ("token",),
                      ("pass", 4), ("pass", 2), ("commit",), *[("token",)] * 4,
                      ("pass", 4), ("pass", 2), ("commit",), *[("token",)] * 4]
    assert len(out) == 10 and c.mask_id not in out
    assert all(t < c.vocab_size - 1 for t in out)


def sampler_calls(model, prompt, n, seed):
    """The tokens (B, n) the block sampler yields after prompt (B, P) at temperature 1, and every model call it makes
    on the way, as (the block it saw, the cache position it sat at, its logits in float32)."""
    calls, denoise = [], model.denoise
    def recorded(block, cache):
        logits = denoise(block, cache)
        calls.append((block.clone(), cache.pos, logits.float()))
        return logits
    model.denoise = recorded
    try:
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
        out = list(model.generate(prompt, n, temperature=1.0, generator=generator))
    finally:
        del model.denoise
    return torch.stack(out, 1), calls


@torch.no_grad()
def replayed(model, calls):
    """Each of sampler_calls' calls made again by model, on its own attn_backend: the same blocks at the same cache
    positions, so each sees the same cached keys."""
    rows, device = calls[0][0].size(0), calls[0][0].device
    cache = KVCache(model.config, rows, model.config.block_size, device, next(model.parameters()).dtype)
    logits = []
    for block, pos, _ in calls:
        cache.pos = pos
        logits.append(model.denoise(block, cache).float())
    return logits


def sample_on(model, backend, reference, prompt, n, seed):
    """The block sampler's tokens on attn_backend=backend, checked as text made a block at a time (every call sees a
    whole block of diffusion_block tokens at a block's start, the prompt's tokens stay where they are, no [MASK] is
    yielded), and the largest difference of its logits from reference's on the same calls, relative to the
    largest logit."""
    c = model.config
    c.attn_backend = backend
    tokens, calls = sampler_calls(model, prompt, n, seed)
    P = prompt.size(1)
    for block, pos, _ in calls:
        assert block.size(1) == c.diffusion_block and pos % c.diffusion_block == 0, (block.shape, pos)
        kept = prompt[:, pos:pos + c.diffusion_block]
        assert torch.equal(block[:, :kept.size(1)], kept), pos
    assert not (tokens == c.mask_id).any() and (tokens.size(1) == n or (tokens[:, -1] == c.bos_id).all())
    assert len(calls) > (P + n) // c.diffusion_block  # more passes than blocks: each block is denoised, then kept
    c.attn_backend = reference
    again = replayed(model, calls)
    c.attn_backend = backend
    return tokens, max(((a - b).abs().max() / b.abs().max()).item() for a, (_, _, b) in zip(again, calls, strict=True))


def sampled_text(ckpt, device, prompt, n, seed):
    """What sample.py prints after prompt at temperature 1 (no top-k) for a seed, from the checkpoint's model in
    this process, checked by sample_on against the math kernel; and its largest logit difference from math's."""
    model, _ = load_model(ckpt, device)
    tok = load_tokenizer(tokenizer_dir(ckpt))
    ids = torch.tensor([[tok.bos_id] + tok.encode(prompt)], device=device)
    out, err = sample_on(model, "auto", "math", ids, n, seed)
    return tok.decode(out[0].tolist()), err


def test_sampler_on_flex_computes_what_math_does(monkeypatch):
    """The sampler's attention is a block over itself and the cached blocks before it, unmasked, with fewer queries
    than keys; on FlexAttention (auto's pick for it on a GPU in float32) that runs eagerly, which torch warns "may
    produce incorrect results". Forward only, a CPU runs it so too: every pass's logits are the math kernel's on the
    same calls, and the tokens for a seed are the same."""
    model = tiny()
    c = model.config
    # resolve_backend refuses flex on a CPU, which cannot train on it (no backward): the sampler needs no backward
    monkeypatch.setitem(attention.resolved, ("flex", "cpu", torch.float32, c.head_dim, None), ("flex", "flex"))
    prompt = tokens(2, 6, seed=1)
    flex_tokens, err = sample_on(model, "flex", "math", prompt, 24, seed=0)
    assert err <= 1e-5, err
    math_tokens, err = sample_on(model, "math", "flex", prompt, 24, seed=0)
    assert err <= 1e-5 and torch.equal(flex_tokens, math_tokens)
    # a wrong kernel is seen: flex attending only to the block, not to the cached keys
    flex = attention.ATTENTION_KERNELS["flex"]
    monkeypatch.setitem(attention.ATTENTION_KERNELS, "flex", lambda q, k, v, causal, mask=None:
                        flex(q, k[:, :, -q.size(2):], v[:, :, -q.size(2):], causal, mask))
    assert sample_on(model, "flex", "math", prompt, 24, seed=0)[1] > 1e-2


def test_schedule_unmasking_and_the_end_token():
    """unmask="schedule" fills every token by the last pass; a row ends at the first BOS it makes."""
    model = tiny()
    c = model.config
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        out = [t.item() for t in model.generate(tokens(1, 4), 28, temperature=1.0, generator=g, unmask="schedule",
                                                steps=3)]
        assert c.mask_id not in out and c.bos_id not in out[:-1]
        assert len(out) == 28 or out[-1] == c.bos_id
    # a model that always says BOS: the first block ends the sample at its first token
    model.denoise = lambda block, cache: F.one_hot(torch.full_like(block, c.bos_id), c.padded_vocab).float()
    assert [t.item() for t in model.generate(tokens(1, 4), 28, temperature=0.0)] == [c.bos_id]


def test_hdp_sampling_pads_the_question_and_fills_plan_then_execution():
    model = tiny(hdp_segments="8,8,16")
    out = list(model.generate(tokens(1, 5), 100, temperature=1.0, generator=torch.Generator().manual_seed(0)))
    assert len(out) <= 24  # the plan and the execution, after the question padded to 8
    with pytest.raises(ValueError, match="the question is 9 tokens, longer than its segment"):
        next(model.generate(tokens(1, 9), 4))


# -----------------------------------------------------------------------------
# the loader: each sample's noise is its own

def test_noise_draws_are_the_samples_own(stdlib_data):
    """A sample's draws depend on (seed, sample) alone: the same at any offset into the batch (any world
    size or micro-batch), different between samples; validation windows draw theirs by window."""
    manifest = load_manifest(stdlib_data)
    train = Loader(stdlib_data, "train", manifest, 64, 7, draws=diffusion_draws)
    x, draws = train.train_batch(0, 5, torch.device("cpu"))
    x2, draws2 = train.train_batch(3, 2, torch.device("cpu"))
    assert x.shape == (5, 64) and draws.shape == (5, 2, 64) and draws.dtype == torch.float32
    assert torch.equal(x[3:], x2) and torch.equal(draws[3:], draws2)
    assert not torch.equal(draws[0], draws[1])
    assert torch.equal(draws[4], torch.from_numpy(diffusion_draws([7, 1], [4], 64)[0]))
    val = Loader(stdlib_data, "val", manifest, 64, 7, draws=diffusion_draws)
    assert torch.equal(val.batch([2, 3], torch.device("cpu"))[1], torch.from_numpy(diffusion_draws([7, 0], [2, 3], 64)))
    ar = Loader(stdlib_data, "train", manifest, 64, 7)
    assert ar.n == train.n or ar.n + 1 == train.n  # a diffusion window reads no shifted target: 64 tokens, not 65


# -----------------------------------------------------------------------------
# the loop

def test_train_resume_and_ranks_give_the_same_steps(tmp_path, stdlib_data, capfd):
    """A bd3lm dry run (8 steps, then 5..8 again from the step-4 checkpoint) reproduces its steps, and the
    model's vocabulary is the data's plus [MASK]; on 2 ranks (gloo, half the micro-steps each)
    the losses are one process's, step by step: each sample carries its own noise."""
    common = [*DIFFUSION, "--micro_batch_size=4", "--total_batch_tokens=512", "--block_size=64"]
    r = train_tiny(capfd, tmp_path / "one", stdlib_data, *common, "--dryrun_steps=8")
    assert "dry run ok: 8 steps on 1 rank(s)" in r.stdout and "largest difference 0" in r.stdout
    saved = json.loads((tmp_path / "one/first/ckpt/step_0000008/config.json").read_text())
    assert saved["model"]["vocab_size"] == load_manifest(stdlib_data)["vocab_size"] + 1
    assert saved["model"]["diffusion_block"] == 8 and "n_loops" not in saved["model"]
    train_tiny(capfd, tmp_path / "two", stdlib_data, *common, "--dryrun_steps=8", nproc=2)
    one, two = ([m["loss"] for m in read_metrics(tmp_path / run / "first") if "loss" in m] for run in ("one", "two"))
    assert len(one) == 8 and np.allclose(one, two, rtol=1e-5, atol=0)

    
def test_tiny_bd3lm_learns_and_samples_block_by_block(tmp_path, stdlib_data, capfd):
    """config/tiny_bd3lm.py on the tests' corpus, shortened to 16 steps of half its batch (the whole run's figures
    are in its comment): the validation NELBO falls from the uniform guess's ln(258) = 5.55 nats per byte to
    under 0.75 of it; sample.py then prints the prompt and the text made after it a block at a time (blocks of 8,
    each unmasked in 8 passes); --serve and export.py refuse it in one line."""
    out = tmp_path / "out"
    args = ["train.py", "config/tiny_bd3lm.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", "--max_steps=16",
            "--micro_batch_size=8", "--total_batch_tokens=1024", "--warmup_steps=4", "--eval_every=16", "--eval_steps=4",
            "--ckpt_every=16", "--log_every=8", "--plots=False", "--planned_tokens_per_sec=1000"]
    r = run_script(args, capfd)
    assert r.returncode == 0, r.stderr
    (val,) = [m["val_loss"] for m in read_metrics(out) if "val_loss" in m]
    assert val < 0.75 * np.log(258), val
    r = run_script(["sample.py", "config/tiny_bd3lm.py", f"--out_dir={out}", "--max_new_tokens=40", "--seed=3",
                    "--temperature=1", "--top_k=0"], capfd)
    assert r.returncode == 0 and r.stdout.startswith("def ") and len(r.stdout.encode()) > len("def ") + 8, r.stdout
    text, err = sampled_text(find_checkpoint(str(out), "best"), "cpu", "def ", 40, 3)  # auto: flash on a CPU
    assert r.stdout == "def " + text + "\n" and err <= 1e-5, (r.stdout, text, err)
    r = run_script(["sample.py", f"--ckpt={out}", "--serve=True", "--port=0"], capfd)
    assert r.returncode == 2 and r.stderr.strip().startswith(f"error: checkpoint {out}/ckpt/step_0000016 is a "
                                                            f"block-diffusion model (objective=bd3lm): --serve")
    r = run_script(["export.py", f"--ckpt={out}", f"--out={tmp_path / 'hf'}"], capfd)
    assert r.returncode == 1 and "objective=bd3lm: this model denoises blocks of [MASK] tokens" in r.stderr
    assert not (tmp_path / "hf").exists()
    r = run_script([*args[:3], f"--out_dir={tmp_path / 'bad'}", *args[4:], "--diffusion_block=5"], capfd)
    assert (r.returncode, r.stderr.strip()) == (1, "error: diffusion_block=5 must divide block_size=128: change the "
                                                   "model shape")
    assert not (tmp_path / "bad").exists()


# -----------------------------------------------------------------------------
# GSM8K: the problems train.py answers at each evaluation


def test_gsm8k_accuracy_is_measured_on_the_test_problems(server, tmp_path, monkeypatch, capfd):
    """HDP data (bytes, segments 96,96,128) from a local mirror; a bd3lm HDP run with eval_gsm8k_samples=1
    answers the test problem at each evaluation and logs gsm8k_accuracy: 0.0 for a model that says nothing
    useful, 1.0 once the model's answer ends in "#### 10" (its generate stood in for)."""
    base = "/datasets/openai/gsm8k/resolve/main/main/"
    server.files[base + "train-00000-of-00001.parquet"] = gsm8k_parquet(GSM8K[:1] * 8)
    server.files[base + "test-00000-of-00001.parquet"] = gsm8k_parquet(GSM8K[1:])
    hub_env(monkeypatch, HF_ENDPOINT=server.url, HF_HOME=tmp_path / "hf_home", HF_HUB_DISABLE_TELEMETRY=1)
    data = tmp_path / "gsm8k"
    assert run_script(["prepare.py", "--source=gsm8k", "--gsm8k_format=hdp", "--segments=96,96,128",
                       f"--data_dir={data}", f"--download_dir={tmp_path / 'dl'}", "--min_val_tokens=0", "--workers=1"],
                      capfd).returncode == 0
    (prompt, answer), = gsm8k_problems(str(data), load_manifest(data), 5)
    tok = load_tokenizer(data)
    assert answer == "10" and tok.decode(prompt) == GSM8K[1][0] and prompt[0] == tok.bos_id
    args = ["--objective=bd3lm", "--hdp_segments=96,96,128", "--diffusion_block=16", "--block_size=320",
            "--micro_batch_size=2", "--total_batch_tokens=640", "--max_steps=1", "--warmup_steps=1", "--ckpt_every=10",
            "--eval_gsm8k_samples=1"]
    r = train_tiny(capfd, tmp_path / "out", data, *args)
    assert "step 1 | val loss" in r.stdout and "| gsm8k 0.0% of 1" in r.stdout
    right = tok.encode("Weng earns 12/60 = $0.2 per minute.\n#### 10")
    monkeypatch.setattr(bd3lm.BlockDiffusionLM, "generate",
                        lambda self, idx, n, **kw: iter(torch.tensor([t]) for t in right))
    train_tiny(capfd, tmp_path / "out2", data, *args)
    rows = read_metrics(tmp_path / "out2")
    assert [m["gsm8k_accuracy"] for m in rows if "val_loss" in m] == [1.0]
    assert "| GSM8K accuracy (last evaluation, greedy) | 100.0% |" in (tmp_path / "out2/summary.md").read_text()
    assert "gsm8k_accuracy.png" in [f[0] for f in report.figures(rows)]
    r = train_tiny(capfd, tmp_path / "out3", data, *args, "--hdp_segments=64,64,192", check=False)
    assert (r.returncode, r.stderr.strip()) == (1, f"error: hdp_segments=64,64,192 but {data} was prepared with "
                                                   f"segments=96,96,128: prepare it with --gsm8k_format=hdp "
                                                   f"--segments=64,64,192, or set hdp_segments to match")


def test_sanity_plans_hdp_on_an_h200_and_checks_its_mask(tmp_path, capfd):
    """sanity.py --capacity on config/h200_hdp_diffusion.py before its data exists: the model's vocabulary is
    GPT-2's plus [MASK], its FLOPs and memory count both copies of each row (52.5 GB per GPU at micro-batch 128 with
    the bf16 residual stream residual_dtype=auto gives it; test_preflight: 67.5 GB with an fp32 one),
    and attention:diffusion holds the backend auto picks here to float64 under HDP's mask."""
    from test_sanity import sanity
    r, rep, checks, md = sanity(capfd, tmp_path, "--capacity", "--device=cpu", "--compile=False", "--gpu_mem_gb=141",
                                config="config/h200_hdp_diffusion.py", check=False)
    cap = rep["capacity"]
    config = make_config(**{k: v for k, v in cap["model"].items() if k != "padded_vocab"})
    assert config.objective == "bd3lm" and config.hdp_segments == "128,128,256" and config.vocab_size == 50258
    assert cap["flops_per_token"] == flops_per_token(config) == 1477734912
    run_layout = cap["layouts"]["run"]
    assert run_layout["fits"] and round(run_layout["bytes"]["total"] / 1e9, 1) == 52.5
    assert checks["attention:diffusion"]["status"] == "pass" and "auto: math" in checks["attention:diffusion"]["detail"]


def test_a_batch_preset_reaches_the_run_and_its_start_line_and_an_explicit_key_wins(tmp_path, stdlib_data, capfd):
    """batch_preset=conservative on a real (one-step) run: its global batch of 256 rows and its LR reach the
    loop and the optimizer, and the config line says what it filled; --micro_batch_size beats its 64."""
    out = tmp_path / "run"
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *DIFFUSION, "--block_size=64",
                    "--n_layer=1", "--n_head=2", "--n_kv_head=2", "--n_embd=16", "--device=cpu", "--dtype=float32",
                    "--eval_steps=1", "--plots=False", "--max_steps=1", "--warmup_steps=0",
                    "--batch_preset=conservative", "--micro_batch_size=32"], capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("batch_preset=conservative (total_batch_tokens=16384 learning_rate=0.0004 lr_base=0.0003 "
            "lr_base_batch=128)") in r.stdout and "micro_batch_size=32" in r.stdout
    assert "world 1 x micro 32 x accum 8 = 16384 tokens/step" in r.stdout
    step = next(m for m in read_metrics(out) if "loss" in m)
    assert step["lr"] == pytest.approx(4e-4) and step["tokens"] == 256 * 64
    saved = json.loads((out / "config.json").read_text())
    assert (saved["batch_preset"], saved["learning_rate"], saved["lr_base"]) == ("conservative", 4e-4, 3e-4)
