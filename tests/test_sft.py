"""The SFT stage: the chat layout in every tokenizer (base ids keep their meaning), SFT data whose loss covers the
assistant's tokens only, and init_from a base checkpoint."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from podgpt.core import checkpoint
from podgpt.pod import checkpoints
from podgpt.core import tokenizer
from conftest import TINY_MODEL, run, shared, train_losses, train_tiny
from podgpt.core.data import Loader, docs_file, load_manifest, open_shard
from model import GPTConfig
from podgpt.pod.objectives import make_model
from test_bad_input import CKPT, TINY_RUN, finished_run  # noqa: F401 -- a fixture: the base model (1 step, stdlib)
from test_model import tiny
from test_prepare import gpt2_or_skip
from podgpt.core.tokenizer import CHAT_TOKENS, chat_prompt, chat_row, load_tokenizer, reply_text, save_tokenizer
from podgpt.core.util import IGNORE

TEXTS = ["What is 17 + 25?", "42", "Sort: pear, apple\nkiwi", "<|user|> <|end|> typed, not special"]


def tokenizer_pair(spec, folder):
    """(base, chat) Tokenizers of spec, each loaded from the files save_tokenizer wrote."""
    if spec == "gpt2":
        gpt2_or_skip()
    meta, ranks = tokenizer.train_tokenizer(spec, lambda: iter(TEXTS), lambda: iter(TEXTS * 20))
    for name, fields in (("base", meta), ("chat", tokenizer.with_chat_tokens(meta))):
        (folder / name).mkdir()
        save_tokenizer(folder / name, spec, fields, ranks)
    return load_tokenizer(folder / "base"), load_tokenizer(folder / "chat")


@pytest.mark.parametrize("spec", ["byte", "char", "bpe:300", "gpt2"])
def test_chat_tokens_follow_the_base_vocabulary(spec, tmp_path):
    base, chat = tokenizer_pair(spec, tmp_path)
    v = base.vocab_size
    assert chat.bos_id == base.bos_id == v - 1 and chat.vocab_size == v + 3
    assert tokenizer.chat_ids(chat) == {name: v + i for i, name in enumerate(CHAT_TOKENS)}
    assert json.loads((tmp_path / "chat" / "tokenizer.json").read_text())["bos_id"] == v - 1
    for text in TEXTS:  # a base-vocabulary encode is unchanged and never yields a chat token
        ids = chat.encode(text)
        assert ids == base.encode(text) and max(ids) < v - 1 and chat.decode(ids) == text
    assert chat.decode(chat_prompt(chat, "hi")) == "<|user|>hi<|end|><|assistant|>"
    assert chat.decode(list(chat.chat.values())) == "".join(CHAT_TOKENS)
    with pytest.raises(ValueError, match="no chat tokens"):
        chat_prompt(base, "hi")


def test_chat_row_masks_the_reply_and_its_end(tmp_path):
    _, tok = tokenizer_pair("byte", tmp_path)
    ids, mask = chat_row(tok, "2+2?", "4")
    user, assistant, end = (tokenizer.chat_ids(tok)[name] for name in CHAT_TOKENS)
    assert ids == [tok.bos_id, user, *b"2+2?", end, assistant, ord("4"), end]
    assert mask == [0] * 8 + [1, 1]
    assert ids[:len(ids) - 2] == chat_prompt(tok, "2+2?")


def test_reply_text():
    row = {"category": "add", "prompt": "17+25?", "answer": "42", "scratchpad": "7+5=12\n1+2+1=4"}
    assert reply_text({**row, "answer_style": "direct"}) == "42"
    assert reply_text({**row, "answer_style": "scratchpad"}) == "7+5=12\n1+2+1=4\n42"


def pack_rows(n=40):
    """Skills-pack rows as skills.py writes them (chat.md's schema), half of them with a scratchpad."""
    pairs = [(i * 7 % 50, i * 13 % 50) for i in range(n)]
    return [{"category": "add", "prompt": f"What is {a} + {b}?", "answer": str(a + b),
             "scratchpad": f"{a} + {b} = {a + b}", "answer_style": ("direct", "scratchpad")[i % 2]}
            for i, (a, b) in enumerate(pairs)]


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory, stdlib_data):
    """SFT data of pack_rows() in the tokenizer of stdlib_data (the base model's data) plus the chat tokens."""
    def build(folder):
        with open(folder / "sft.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in pack_rows())
        run([sys.executable, "prepare.py", f"--source={folder / 'sft.jsonl'}", "--chat=True",
             f"--chat_base={stdlib_data}", f"--data_dir={folder / 'data'}", "--val_fraction=0.2", "--min_val_tokens=0",
             "--workers=2"])
    return str(shared(tmp_path_factory, "sft_byte", build) / "data")


def test_sft_targets_are_the_replies_alone(sft_data):
    """Every document of the SFT shards is a pack row's chat_row, its mask beside it; the Loader's targets are the
    next tokens where that mask is 1 and IGNORE elsewhere, token by token."""
    manifest, tok = load_manifest(sft_data), load_tokenizer(sft_data)
    rows = {tuple(ids): mask for ids, mask in (chat_row(tok, r["prompt"], reply_text(r)) for r in pack_rows())}
    shard = manifest["splits"]["train"]["shards"][0]
    tokens = np.asarray(open_shard(os.path.join(sft_data, shard["file"])), dtype=np.int64)
    mask = np.load(os.path.join(sft_data, shard["mask_file"]))
    starts = [*np.load(docs_file(os.path.join(sft_data, shard["file"]))), len(tokens)]
    for a, b in zip(starts, starts[1:]):
        assert rows[tuple(tokens[a:b].tolist())] == mask[a:b].tolist()
    loader = Loader(sft_data, "train", manifest, block_size=64, seed=0)
    x, y = loader.batch(range(loader.n), torch.device("cpu"))
    for w in range(loader.n):
        _, start = loader.locate(w)
        assert x[w].tolist() == tokens[start:start + 64].tolist()
        want = np.where(mask[start + 1:start + 65] == 1, tokens[start + 1:start + 65], IGNORE)
        assert y[w].tolist() == want.tolist()
    assert (y != IGNORE).sum() == mask[1:loader.n * 64 + 1].sum() > 0
    for first, size in ((0, 1), (1, 2), (loader.n - 1, 3)):  # what train.py weighs a micro-batch by (the last: 2 epochs)
        _, y = loader.train_batch(first, size, torch.device("cpu"))
        assert loader.train_targets(first, size) == (y != IGNORE).sum()
    val = manifest["splits"]["val"]  # bits per byte are the replies': their bytes and the tokens the loss counts
    val_mask = np.load(os.path.join(sft_data, val["shards"][0]["mask_file"]))
    assert val["loss_tokens"] == val_mask.sum() and manifest["splits"]["train"]["loss_tokens"] == mask.sum()
    assert val["bytes"] + manifest["splits"]["train"]["bytes"] == sum(len(reply_text(r).encode()) for r in pack_rows())


def test_the_loss_counts_only_the_targets_not_ignored():
    """Chunked or not, the loss is the mean over the targets that are not IGNORE; without IGNORE in the batch, the
    chunked loss is its sum over the number of targets, as before SFT, bit for bit."""
    torch.manual_seed(0)
    whole, chunked = tiny(), tiny(loss_chunk=20)
    chunked.load_state_dict(whole.state_dict())
    idx, targets = torch.randint(0, 97, (2, 48)), torch.randint(0, 97, (2, 48))
    x = chunked.norm(chunked.blocks(chunked.embed_tokens(idx)))
    before = sum(chunked.loss_sum(xc, yc) for xc, yc in zip(x.flatten(0, 1).split(20), targets.flatten().split(20)))
    assert torch.equal(chunked(idx, targets)[1], before / targets.numel())
    masked = targets.masked_fill(torch.rand(2, 48) < 0.7, IGNORE)
    kept = masked != IGNORE
    logits = whole(idx)[0]
    want = torch.nn.functional.cross_entropy(logits[kept], targets[kept])
    for model in (whole, chunked):
        torch.testing.assert_close(model(idx, masked)[1], want)
    for model in (whole, chunked):  # a window of prompt tokens alone: loss 0, not NaN
        assert model(idx, torch.full_like(targets, IGNORE))[1].item() == 0


def sft_model(base_ckpt, vocab_size):
    """A fresh model of the base checkpoint's shape with vocab_size, and the config.json a run of it records."""
    with open(os.path.join(base_ckpt, "config.json")) as f:
        config = {"model": dict(json.load(f)["model"], vocab_size=vocab_size)}
    torch.manual_seed(1)
    return make_model(GPTConfig(**config["model"])), config


def test_init_from_keeps_the_base_ids_rows(finished_run, sft_data):
    """The base ids' embedding rows (tied: the head's too) are the base checkpoint's, exactly; the chat tokens'
    rows fall in the base's padded rows and take them, and a vocabulary that outgrows the padding keeps the new
    model's init beyond the base ids."""
    base_ckpt = str(finished_run / CKPT)
    base_state = checkpoints.load_model(base_ckpt)[0].state_dict()
    base = base_state["embed_tokens.weight"]
    model, config = sft_model(base_ckpt, 260)
    assert model.config.padded_vocab == base.size(0) == 320  # 257 + 3 chat tokens: within the padding
    checkpoints.start_from(model, False, str(finished_run), config, sft_data)
    assert torch.equal(model.embed_tokens.weight, base) and model.lm_head.weight is model.embed_tokens.weight
    grown = sft_model(base_ckpt, 330)[0]
    state = checkpoints.grown_state(base_state, grown, 257)["embed_tokens.weight"]
    assert state.size(0) == grown.config.padded_vocab == 384
    assert torch.equal(state[:257], base[:257]) and torch.equal(state[257:], grown.embed_tokens.weight[257:])


SFT_ARGS = [*TINY_RUN[len(TINY_MODEL):], "--max_steps=6", "--ckpt_every=3", "--log_every=1", "--eval_every=1000",
            "--doc_mask=True", "--keep_last=5"]


def test_sft_resumes_from_its_own_checkpoints_bit_identically(finished_run, sft_data, tmp_path, capfd):
    """An SFT run starts from the base weights at step 0; stopped at step 3 and run again with the same command,
    it continues from its own step-3 checkpoint (not from init_from) to the same losses and weights as a run
    that was never stopped."""
    args = [*SFT_ARGS, f"--init_from={finished_run}"]
    whole = train_tiny(capfd, tmp_path / "whole", sft_data, *args)
    assert f"init_from: the weights of {finished_run / CKPT}" in whole.stdout
    first = train_tiny(capfd, tmp_path / "split", sft_data, *args, "--stop_at_step=3")
    assert "init_from: the weights" in first.stdout
    again = train_tiny(capfd, tmp_path / "split", sft_data, *args)
    assert "init_from: the weights" not in again.stdout and "resumed from" in again.stdout
    losses = train_losses(tmp_path / "whole")
    assert train_losses(tmp_path / "split") == losses and len(losses) == 6
    final = "ckpt/step_0000006/model.pt"
    a, b = (torch.load(tmp_path / run / final, weights_only=True) for run in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("nproc, mode", [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_a_step_s_loss_is_the_mean_over_every_reply_token_it_counts(finished_run, sft_data, tmp_path, capfd, nproc,
                                                                    mode):
    """A step of two windows (two micro-batches of one rank, or one on each of two ranks, DDP or FSDP) whose
    replies differ in length: its loss and gradient are the mean over all their counted targets, not the mean of
    the two windows' means. (learning_rate 1e-30 leaves the weights as they were, so the step's checkpoint holds
    them.)"""
    args = [*SFT_ARGS, f"--init_from={finished_run}", "--max_steps=1", "--micro_batch_size=1",
            "--learning_rate=1e-30", "--min_lr=0", "--ckpt_every=1", f"--dist_mode={mode}"]
    train_tiny(capfd, tmp_path / "sft", sft_data, *args, nproc=nproc)
    model = checkpoints.load_model(str(tmp_path / "sft" / "ckpt" / "step_0000001"))[0]
    seed = json.loads((tmp_path / "sft" / "config.json").read_text())["seed"]
    x, y = Loader(sft_data, "train", load_manifest(sft_data), 64, seed).train_batch(0, 2, torch.device("cpu"))
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(x)[0].transpose(1, 2), y, reduction="none")
    counted = (y != IGNORE).sum(1)
    want, means = losses.sum() / counted.sum(), (losses.sum(1) / counted).mean()
    assert counted[0] != counted[1] and abs(want - means) > 1e-3, "the two windows must count different targets"
    assert train_losses(tmp_path / "sft")[1] == pytest.approx(want.item(), rel=1e-5)


def test_the_dry_run_runs_sft_steps_from_a_base_checkpoint(finished_run, sft_data, tmp_path, capfd):
    """The 1B recipe's --base-steps then --sft-steps as a dry run: the first pass starts from the base weights, the
    second resumes from its half-way checkpoint and reproduces its losses; the unigram baseline counts the
    replies alone."""
    r = train_tiny(capfd, tmp_path / "dry", sft_data, *SFT_ARGS, f"--init_from={finished_run}", "--dryrun_steps=2")
    assert r.stdout.count("init_from: the weights") == 1, r.stdout
    report = json.loads((tmp_path / "dry" / "dryrun.json").read_text())
    assert report["ok"] and report["resume_check"]["max_rel_diff"] == 0, report["problems"]
    summary = json.loads((tmp_path / "dry" / "first" / "summary.json").read_text())
    manifest = load_manifest(sft_data)
    counts = np.load(os.path.join(sft_data, manifest["token_counts"])) + 1.0
    shard = manifest["splits"]["val"]["shards"][0]
    tokens = np.asarray(open_shard(os.path.join(sft_data, shard["file"])))
    replies = tokens[np.load(os.path.join(sft_data, shard["mask_file"])) == 1]
    assert summary["unigram_val_loss"] == pytest.approx(-np.log(counts / counts.sum())[replies].mean())


def test_an_sft_export_keeps_bos_and_ends_replies_at_end(finished_run, sft_data, tmp_path, capfd):
    """An SFT checkpoint's export: BOS is the base's id, a reply ends at <|end|>, and transformers' tokenizer has
    the chat tokens at their ids and encodes a chat prompt as chat_prompt does."""
    transformers = pytest.importorskip("transformers")
    from test_export import do_export
    train_tiny(capfd, tmp_path / "sft", sft_data, *SFT_ARGS, f"--init_from={finished_run}", "--max_steps=1")
    do_export(capfd, tmp_path / "sft", tmp_path / "hf")
    tok = load_tokenizer(sft_data)
    end = tokenizer.chat_ids(tok)["<|end|>"]
    config, gen = (json.loads((tmp_path / "hf" / f"{name}.json").read_text())
                   for name in ("config", "generation_config"))
    assert (config["bos_token_id"], config["eos_token_id"], gen["eos_token_id"]) == (256, end, [end, 256])
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert [hf.convert_tokens_to_ids(name) for name in CHAT_TOKENS] == list(tokenizer.chat_ids(tok).values())
    assert hf("<|user|> typed")["input_ids"] == [256, *tok.encode("<|user|> typed")]  # text, as podgpt's encode
    assert hf.decode(chat_prompt(tok, "hi")[1:]) == "<|user|>hi<|end|><|assistant|>"
