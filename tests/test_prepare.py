"""Tests of prepare.py: round trips through every tokenizer, the shard format, the split and its
guaranteed minimum, determinism across workers, reuse, downloads (from a local HTTP server) and CLI errors."""

import collections
import errno
import hashlib
import http.server
import importlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import logging as hub_logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from podgpt.core import configurator  # noqa: E402
from podgpt.core import data  # noqa: E402
from podgpt.corpus import download  # noqa: E402
from podgpt.corpus import holdout  # noqa: E402
import prepare  # noqa: E402
from podgpt.corpus import sources  # noqa: E402
from podgpt.core import tokenizer  # noqa: E402
from podgpt.core import util  # noqa: E402
from conftest import popen, tree  # noqa: E402
from conftest import run as run_command  # noqa: E402

# documents with accents, CJK, emoji, \r\n, tabs and special-token text
JSONL_DOCS = [f"doc {i}: naïve café — 東京 {i * 7} 😀\tend" for i in range(30)] + [
    "line one\r\nline two\r\n", "a literal <|endoftext|> and <|bos|> stay text", "", "ß∂ƒ©˙∆˚¬ 🎉🎉 \u200b zero width",
]
PARQUET_DOCS = [f"parquet row {i} — Ünïcödé 中文 {'x' * i}" for i in range(25)]
TXT_DOC = "Café\r\nrésumé\twith a tab\n<|endoftext|>\n"
MD_DOC = "# 見出し\n\n日本語のテキスト。emoji 🚀\n"
CORPUS_DOCS = [TXT_DOC, MD_DOC] + JSONL_DOCS + PARQUET_DOCS  # the order prepare.py must keep


def parquet_bytes(texts, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    buf = io.BytesIO()
    table = pa.table({column: texts, "id": list(range(len(texts)))})
    pq.write_table(table, buf, row_group_size=7)  # several row groups
    return buf.getvalue()


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_bytes(TXT_DOC.encode())
    (root / "b" / "c.md").write_bytes(MD_DOC.encode())
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(JSONL_DOCS)]
    (root / "d.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n", encoding="utf-8")
    (root / "e.parquet").write_bytes(parquet_bytes(PARQUET_DOCS[:10] + [None] + PARQUET_DOCS[10:]))
    (root / "notes.csv").write_text("skipped: not a source type\n")
    return root


def run(*args):
    """prepare.py's top level (util.run_main) in this process; returns its exit status (0 on success)."""
    with pytest.raises(SystemExit) as stop:
        util.run_main(prepare.main, [str(a) for a in args])
    return stop.value.code


def hub_env(monkeypatch, **env):
    """Set (a value) or unset (None) Hugging Face environment variables for prepare.py run in this process:
    huggingface_hub reads them into huggingface_hub.constants at its first import, so they are read again
    here; the test's end puts the constants back as they were."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    before = dict(vars(constants))
    after = dict(vars(importlib.reload(constants)))
    vars(constants).update(before)
    for name, value in after.items():
        if not name.startswith("__"):
            monkeypatch.setattr(constants, name, value)


class Stderr:
    """sys.stderr as it is when written to: huggingface_hub's log handler keeps the one of its first import,
    which pytest may have closed since."""

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def no_hugging_face_setup(tmp_path, monkeypatch):
    """No test sees this machine's Hugging Face token, cache or mirror: HF_HOME is a folder of the test's,
    absent unless the test makes it. Nor does huggingface_hub ask the hub for its telemetry (which coding agent
    runs it): the local hub sees the downloads alone."""
    hub_env(monkeypatch, HF_HOME=tmp_path / "hf_home", HF_HUB_DISABLE_TELEMETRY=1, **dict.fromkeys((
        "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
        "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")))
    for handler in hub_logging.get_logger().handlers:
        monkeypatch.setattr(handler, "stream", Stderr())


def error_line(err):
    """The one "error: ..." line prepare.py ends with (after any progress bars), without a traceback."""
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("error:"), err
    assert sum(line.startswith("error:") for line in lines) == 1, err
    return lines[-1]


def doc_hash(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def expected_val(text, fraction):
    return doc_hash(text) / 2**64 < fraction


def smallest_hash_split(texts, n_tokens, val_fraction, min_tokens):
    """The held-out documents, computed here by sorting: those whose hash lies in the first val_fraction
    of the hash range, or, while those hold fewer than min_tokens tokens, the fewest smallest-hash ones that do."""
    hashes = [doc_hash(t) for t in texts]
    threshold = val_fraction * 2**64
    if sum(n for h, n in zip(hashes, n_tokens) if h < threshold) < min_tokens:
        total = 0
        for h, n in sorted(zip(hashes, n_tokens)):
            total += n
            if total >= min_tokens:
                threshold = h + 1
                break
    return [t for t, h in zip(texts, hashes) if h < threshold]


def decode_split(data_dir, split):
    """The documents of a split, cut at BOS by the .docs.npy index and decoded strictly."""
    manifest = data.load_manifest(data_dir)
    tok = tokenizer.load_tokenizer(data_dir)
    docs = []
    for shard in manifest["splits"][split]["shards"]:
        tokens = data.open_shard(os.path.join(data_dir, shard["file"]))
        starts = np.load(os.path.join(data_dir, shard["docs_file"]))
        assert len(tokens) == shard["tokens"] and len(starts) == shard["docs"]
        assert (tokens[starts] == tok.bos_id).all() and (tokens == tok.bos_id).sum() == len(starts)
        for start, end in zip(starts, list(starts[1:]) + [len(tokens)]):
            docs.append(tok.decode_bytes(tokens[start + 1:end]).decode("utf-8"))
    return docs


def gpt2_or_skip():
    if os.environ.get("PODGPT_GPT2_TIKTOKEN"):
        return
    import tiktoken
    try:
        tiktoken.get_encoding("gpt2")
    except Exception as e:
        pytest.skip(f"no gpt2 ranks: set PODGPT_GPT2_TIKTOKEN (offline: {type(e).__name__})")


@pytest.mark.parametrize("spec", ["byte", "char", "bpe:300", "gpt2"])
def test_round_trip_every_tokenizer(spec, corpus, tmp_path, monkeypatch):
    if spec == "gpt2":
        gpt2_or_skip()
    out = tmp_path / "out"
    assert run(f"--source={corpus}", f"--tokenizer={spec}", f"--data_dir={out}", "--val_fraction=0.2",
               "--min_val_tokens=0", "--shard_tokens=300", "--workers=2") == 0
    train, val = decode_split(out, "train"), decode_split(out, "val")
    assert train == [d for d in CORPUS_DOCS if not expected_val(d, 0.2)]
    assert val == [d for d in CORPUS_DOCS if expected_val(d, 0.2)]
    assert val and not set(train) & set(val)

    manifest = data.load_manifest(out)
    tok = tokenizer.load_tokenizer(out)
    assert manifest["tokenizer"] == tok.spec == spec
    assert manifest["bos_id"] == tok.bos_id == tok.vocab_size - 1 == manifest["vocab_size"] - 1
    assert manifest["splits"]["val"]["bytes"] == sum(len(d.encode()) for d in val)
    for split in manifest["splits"].values():  # a shard closes with the document that fills it
        for shard in split["shards"][:-1]:
            header = data.read_header(os.path.join(out, shard["file"]))
            assert header["n_tokens"] >= 300 and header["n_docs"] == shard["docs"]
    assert len(manifest["splits"]["train"]["shards"]) > 1
    counts = np.load(out / manifest["token_counts"])
    assert counts.shape == (tok.vocab_size,) and counts.sum() == manifest["splits"]["train"]["tokens"]
    assert counts[tok.bos_id] == len(train)
    for text in CORPUS_DOCS:
        assert tok.bos_id not in tok.encode(text) and tok.decode(tok.encode(text)) == text

    if spec == "byte":
        assert tok.vocab_size == 257
    if spec == "char":
        assert json.loads((out / "tokenizer.json").read_text())["chars"] == sorted(set("".join(CORPUS_DOCS)))
    if spec.startswith("bpe") or spec == "gpt2":
        import tiktoken.load
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # its cache is keyed by path: read the file itself
        ranks = tiktoken.load.load_tiktoken_bpe(str(out / "tokenizer.tiktoken"))
        assert sorted(ranks.values()) == list(range(tok.vocab_size - 1))
    if spec == "bpe:300":
        assert 256 < tok.vocab_size <= 300
    if spec == "gpt2":
        assert tok.vocab_size == 50257 and tok.encode("Hello world") == [15496, 995]
        assert tok.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]  # plain text, not BOS


def test_shard_header_is_validated(tmp_path):
    path = str(tmp_path / "train_000000.bin")
    tokens = [256, 72, 105, 256, 0, 255]
    sha = prepare.write_shard(path, tokens, 257, 256, [0, 3])
    raw = open(path, "rb").read()
    assert sha == hashlib.sha256(raw).hexdigest() and len(raw) == 1024 + 2 * len(tokens)
    assert data.read_header(path) | {"dtype": None} == {
        "version": 1, "dtype": None, "n_tokens": 6, "vocab_size": 257, "n_docs": 2, "bos_id": 256}
    shard = data.open_shard(path)
    assert shard.dtype == np.uint16 and shard.tolist() == tokens
    assert np.load(data.docs_file(path)).tolist() == [0, 3]

    def corrupt(content, match):
        bad = str(tmp_path / "bad.bin")
        open(bad, "wb").write(content)
        with pytest.raises(ValueError, match=match):
            data.open_shard(bad)

    header = np.frombuffer(raw[:1024], dtype="<i8").copy()
    corrupt(np.array([1234] + [0] * 127, dtype="<i8").tobytes() + raw[1024:], "bad magic")
    header[1] = 2
    corrupt(header.tobytes() + raw[1024:], "unsupported shard version 2")
    corrupt(raw[:-1], "truncated or corrupt")
    corrupt(raw[:100], "truncated shard")

    big = str(tmp_path / "val_000000.bin")
    prepare.write_shard(big, [70000, 69999, 5], 70001, 70000, [0])
    assert data.open_shard(big).dtype == np.uint32 and data.open_shard(big).tolist() == [70000, 69999, 5]
    with pytest.raises(ValueError, match="starting with bos_id"):
        prepare.write_shard(big, [1, 256], 257, 256, [0])
    with pytest.raises(ValueError, match="must lie in"):
        prepare.write_shard(big, [256, 300], 257, 256, [0])
    with pytest.raises(ValueError, match="no manifest.json in"):
        data.load_manifest(tmp_path)


def snapshot(folder):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_workers_do_not_change_the_output(corpus, tmp_path, capsys, monkeypatch):
    """Also when min_val_tokens moves the threshold of a bpe:N: the tokenizer is trained once, on none of the
    documents held out, and each document is tokenized once."""
    trained, train = [], prepare.train_tokenizer

    def recording(spec, texts, bpe_texts):
        trained[:] = bpe_texts()
        return train(spec, texts, lambda: iter(trained))
    monkeypatch.setattr(prepare, "train_tokenizer", recording)
    log = tmp_path / "encoded.jsonl"
    counting_encodes(monkeypatch, log)
    outs = [tmp_path / "w1", tmp_path / "w2"]
    for n, out in zip((1, 2), outs):
        assert run(f"--source={corpus}", "--tokenizer=bpe:300", f"--data_dir={out}", "--val_fraction=0.05",
                   "--min_val_tokens=300", "--shard_tokens=200", f"--workers={n}") == 0
        printed = capsys.readouterr().out
        assert "bpe:300 is trained without the documents min_val_tokens=300 may hold out for validation" in printed
        assert "fewer than min_val_tokens=300: holding out more documents" in printed
        assert "read back from the shards" in printed
        assert sorted(json.loads(line) for line in log.read_text().splitlines()) == sorted(CORPUS_DOCS)
        log.unlink()
    one, two = ({name: data for name, (_, _, data) in snapshot(out).items()} for out in outs)
    assert one == two and len(one) > 8
    train, val = decode_split(outs[0], "train"), decode_split(outs[0], "val")
    assert data.load_manifest(outs[0])["splits"]["val"]["tokens"] >= 300
    assert max(map(doc_hash, val)) < min(map(doc_hash, train))  # the smallest hashes, whole documents
    assert trained and set(trained) <= set(train) and not set(trained) & set(val)


def test_bpe_reserve_counts_tokens_from_below_and_reads_no_more_than_it_needs(corpus, tmp_path):
    """bpe_reserve's bound on a document's tokens is one: no document makes fewer tokens than least_tokens says,
    so the documents below the reserve hold min_tokens; and where val_fraction's hold them surely, it stops reading."""
    assert run(f"--source={corpus}", "--tokenizer=bpe:300", f"--data_dir={tmp_path / 'out'}", "--val_fraction=0.5",
               "--min_val_tokens=0") == 0
    tok = tokenizer.load_tokenizer(tmp_path / "out")
    counted, least = [], prepare.least_tokens(())
    for text in CORPUS_DOCS:
        n = 1 + len(tok.encode(text))
        assert least(text) <= n
        counted.append(n)
    assert sum(map(least, CORPUS_DOCS)) > 0.5 * sum(counted)  # a bound, not a guess of zero
    hashes = [doc_hash(t) for t in CORPUS_DOCS]
    for min_tokens in (1, 200, sum(map(least, CORPUS_DOCS)) // 2):
        reserve = holdout.bpe_reserve(((h, None, t) for h, t in zip(hashes, CORPUS_DOCS)), 0, min_tokens, least)
        assert sum(n for h, n in zip(hashes, counted) if h < reserve) >= min_tokens
        assert sum(least(t) for h, t in zip(hashes, CORPUS_DOCS) if h < reserve - 1) < min_tokens  # the least
    read = []

    def docs():
        for h, t in zip(hashes, CORPUS_DOCS):
            read.append(t)
            yield h, None, t
    threshold = hashes[0] + 1  # the first document is below it, and holds enough
    assert holdout.bpe_reserve(docs(), threshold, least(CORPUS_DOCS[0]), least) == threshold
    assert read == CORPUS_DOCS[:1]
    assert holdout.bpe_reserve(iter([(5, "val", "a b c"), (3, None, "x")]), 0, 4, least) == 0  # "val": held anyway
    assert holdout.bpe_reserve(iter([(5, None, "a b c")]), 0, 99, least) == 2**64  # too few: any may be held out


def test_rerun_reuses_and_force_rebuilds(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    args = [f"--source={corpus}", f"--data_dir={out}", "--val_fraction=0.2", "--min_val_tokens=0", "--shard_tokens=500"]
    assert run(*args) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert run(*args) == 0
    assert "reusing" in capsys.readouterr().out and snapshot(out) == before
    assert run(*args, "--force") == 0
    after = snapshot(out)
    assert "reusing" not in capsys.readouterr().out
    assert after.keys() == before.keys() and all(after[k][2] == before[k][2] for k in after)
    assert all(after[k][0] != before[k][0] for k in after)  # every file written anew
    assert run(*args, "--min_chars=40") == 0  # other arguments: rebuilt, fewer documents
    assert "reusing" not in capsys.readouterr().out
    assert data.load_manifest(out)["prepare_args"]["min_chars"] == 40
    shard = out / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # a damaged shard is not reused
    assert run(*args, "--min_chars=40") == 0
    assert "reusing" not in capsys.readouterr().out and data.read_header(shard)


def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            yield f.read()


def test_stdlib_source_max_docs_and_min_chars(tmp_path):
    out = tmp_path / "out"
    assert run(f"--data_dir={out}", "--max_docs=12", "--val_fraction=0") == 0
    files = list(stdlib_files())
    assert decode_split(out, "train") == files[:12] and decode_split(out, "val") == []
    assert run(f"--data_dir={out}", "--max_docs=12", "--val_fraction=0", "--min_chars=5000") == 0
    long_docs = decode_split(out, "train")
    assert long_docs == [t for t in files if len(t) >= 5000][:12]
    assert "stdlib" in data.load_manifest(out)["source"]


def test_the_1b_config_imports_the_climbmix_subset_it_is_planned_on():
    """config/h200_1b_ddp8.py's data is the 1B run's ClimbMix import (--shards 2048 --max-rows 10000000
    --min-chars 100): the preset's first 2,048 files, at most 10M documents of at least 100 characters (the test
    above checks how prepare.py applies those two). Without max_shards, run.sh fetched and tokenized every file."""
    cfg = configurator.configure(prepare.__file__, ["config/h200_1b_ddp8.py"])
    assert (cfg.source, cfg.max_docs, cfg.min_chars) == ("climbmix", 10_000_000, 100)
    inputs, description = sources.resolve_sources(cfg.source, cfg.max_shards, cfg.sha256, cfg.split_paragraphs)
    assert len(inputs) == 2048 and inputs[-1].location.endswith("/shard_02047.parquet")
    assert "climbmix (2048 of 6543 files" in description


def test_split_paragraphs_makes_documents_of_one_big_text_file(tmp_path):
    book = tmp_path / "book.txt"
    book.write_bytes("Chapter 1\r\nIt begins.\r\n\r\nSecond — paragraph\n \t\n\n\nThird 🌙\n".encode())
    out = tmp_path / "out"
    assert run(f"--source={book}", "--split_paragraphs", "--tokenizer=char", f"--data_dir={out}",
               "--val_fraction=0") == 0
    assert decode_split(out, "train") == ["Chapter 1\r\nIt begins.", "Second — paragraph", "Third 🌙\n"]


# -----------------------------------------------------------------------------
# the validation split: val_fraction of the documents, and at least min_val_tokens tokens


def test_embedded_default_holds_out_a_real_validation_set(tmp_path):
    """config/tiny.py on this Python's stdlib (bash run.sh's data): at least 1% of the tokens and 64 windows
    of its block_size are held out, however many files the stdlib has, and they are the smallest hashes."""
    config = {}
    exec((ROOT / "config" / "tiny.py").read_text(), config)
    out = tmp_path / "out"
    r = run_command([sys.executable, "prepare.py", "config/tiny.py", f"--data_dir={out}"], timeout=300)
    splits = data.load_manifest(out)["splits"]
    train, val = splits["train"], splits["val"]
    total = train["tokens"] + val["tokens"]
    windows = sum((shard["tokens"] - 1) // config["block_size"] for shard in val["shards"])  # as train.py's Loader
    print(f"held out: {val['docs']} documents, {val['tokens']} tokens, {val['tokens'] / total:.2%}, {windows} windows")
    assert val["tokens"] >= 0.01 * total and windows >= 64 and 2 * val["tokens"] < total
    assert (f"validation: {val['docs']:,} documents, {val['tokens']:,} tokens ({val['tokens'] / total:.1%} of tokens) "
            "held out") in r.stdout
    files = list(stdlib_files())
    held_out = smallest_hash_split(files, [len(t.encode()) + 1 for t in files], config["val_fraction"],
                                   config["min_val_tokens"])
    assert decode_split(out, "val") == held_out and train["docs"] == len(files) - len(held_out)


def counting_encodes(monkeypatch, log):
    """Make every worker append each document it encodes to `log` (the workers are forked: they inherit this)."""
    encode = prepare.encode_document

    def counted(tok, text, lengths):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(text) + "\n")
        return encode(tok, text, lengths)
    monkeypatch.setattr(prepare, "encode_document", counted)


def test_min_val_tokens_holds_out_documents_where_val_fraction_gives_none(tmp_path, capsys, monkeypatch):
    """The documents held out beyond val_fraction's are read back from the shards, never tokenized twice: each
    document is encoded once, and the shards are those of one pass at a threshold giving the same split."""
    docs = [f"document {i}: " + "word " * (i % 13) for i in range(150)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    n_tokens = [len(d.encode()) + 1 for d in docs]  # byte tokens and BOS
    assert smallest_hash_split(docs, n_tokens, 0.001, 0) == []  # val_fraction alone: no document
    held_out = smallest_hash_split(docs, n_tokens, 0.001, 500)
    outs = [tmp_path / "w1", tmp_path / "w2"]
    log = tmp_path / "encoded.jsonl"
    counting_encodes(monkeypatch, log)
    for n, out in zip((1, 2), outs):
        assert run(f"--source={source}", f"--data_dir={out}", "--val_fraction=0.001", "--min_val_tokens=500",
                   "--shard_tokens=400", f"--workers={n}") == 0
        printed = capsys.readouterr().out
        assert "validation: 0 documents, 0 tokens, fewer than min_val_tokens=500: holding out more" in printed
        assert "read back from the shards" in printed and "tokenizing again" not in printed
        assert sorted(json.loads(line) for line in log.read_text().splitlines()) == sorted(docs)
        log.unlink()
        assert decode_split(out, "val") == held_out
        assert decode_split(out, "train") == [d for d in docs if d not in held_out]
    one, two = ({name: data for name, (_, _, data) in snapshot(out).items()} for out in outs)
    assert one == two
    val = data.load_manifest(outs[0])["splits"]["val"]
    assert val["docs"] == len(held_out) and val["tokens"] == sum(len(d.encode()) + 1 for d in held_out) >= 500
    assert f"validation: {len(held_out):,} documents, {val['tokens']:,} tokens (" in printed
    between = (max(map(doc_hash, held_out)) + min(doc_hash(d) for d in docs if d not in held_out)) / 2 / 2**64
    single = tmp_path / "single"
    assert run(f"--source={source}", f"--data_dir={single}", f"--val_fraction={between!r}", "--min_val_tokens=0",
               "--shard_tokens=400") == 0
    shards = ({name: data for name, (_, _, data) in snapshot(out).items() if name != "manifest.json"}
              for out in (single, outs[0]))
    assert next(shards) == next(shards)


def test_too_small_a_corpus_for_min_val_tokens_is_refused(corpus, tmp_path):
    total = sum(len(d.encode()) + 1 for d in CORPUS_DOCS)
    out = tmp_path / "out"
    for min_tokens in (total + 1, total * 6 // 10):  # more than all the tokens; more than half of them
        r = run_command([sys.executable, "prepare.py", f"--source={corpus}", f"--data_dir={out}",
                         f"--min_val_tokens={min_tokens}", "--workers=2"], check=False, timeout=120)
        line = error_line(r.stderr)
        assert r.returncode == 1 and f"min_val_tokens={min_tokens:,}" in line and f"of the {total:,} tokens" in line
        assert "lower --min_val_tokens" in line and "--max_docs" in line
        assert not out.exists() and not Path(f"{out}.tmp").exists()
    assert run(f"--source={corpus}", f"--data_dir={out}", f"--min_val_tokens={total // 4}") == 0
    val = data.load_manifest(out)["splits"]["val"]
    assert total // 4 <= val["tokens"] < total / 2
    assert run(f"--source={corpus}", f"--data_dir={out}", "--val_fraction=0") == 0  # no validation, no minimum
    assert decode_split(out, "val") == [] and len(decode_split(out, "train")) == len(CORPUS_DOCS)


def test_smallest_hashes_finds_the_threshold_in_any_order():
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**63, 200).tolist()
    docs = [(h, int(n)) for h, n in zip(hashes + hashes[:40:4], rng.integers(1, 60, 210))]  # duplicates too
    total = sum(n for _, n in docs)
    for min_tokens in (1, 30, 500, total // 2, total, total + 1):
        expected, seen = None, 0
        for h, n in sorted(docs):
            seen += n
            if seen >= min_tokens:
                expected = h + 1
                break
        for _ in range(3):
            rng.shuffle(docs)
            smallest = prepare.SmallestHashes(min_tokens)
            for h, n in docs:
                smallest.add(h, n)
            assert smallest.threshold() == expected
            if expected is not None:  # the documents below it hold min_tokens, those below the one before do not
                below = [sum(n for h, n in docs if h < t) for t in (expected, expected - 1)]
                assert below[0] >= min_tokens > below[1]


TOKEN_HASH = "blake2b-64 of each document's tokens"


def test_manifest_counts_contamination_as_hashing_the_shards_does(stdlib_data, monkeypatch):
    """train.py's contamination check reads prepare.py's count from the manifest, no pass over the corpus;
    a manifest of an older prepare.py, without the count, is answered by hashing the shards."""
    manifest = data.load_manifest(stdlib_data)
    splits = manifest["splits"]
    train = list(data.document_hashes(stdlib_data, splits["train"]))
    val = list(data.document_hashes(stdlib_data, splits["val"]))
    assert len(train) == splits["train"]["docs"] and len(val) == splits["val"]["docs"] > 0
    shard = os.path.join(stdlib_data, splits["val"]["shards"][0]["file"])
    first = data.open_shard(shard)[:np.load(data.docs_file(shard))[1]].tobytes()  # the hash is of the token bytes
    assert val[0] == int.from_bytes(hashlib.blake2b(first, digest_size=8).digest(), "little")
    shared = sum(h in set(val) for h in train)
    assert manifest["contamination"] == {"train_docs_in_val": shared, "val_documents": len(val), "hash": TOKEN_HASH}

    def no_corpus_pass(*args):
        raise AssertionError("hashed the corpus although the manifest holds the count")

    with monkeypatch.context() as m:
        m.setattr(data, "document_hashes", no_corpus_pass)
        assert data.contamination(stdlib_data, manifest) == (shared, len(val))
    older = {key: value for key, value in manifest.items() if key != "contamination"}
    assert data.contamination(stdlib_data, older) == (shared, len(val))


def test_a_document_in_both_splits_is_counted(tmp_path):
    """The split keeps equal texts together, so a document lands in both splits only when two texts give
    the same tokens: planted here, the same tokens under text hashes either side of the threshold. The count
    is of training documents (a duplicate counts twice); tokens that differ by one do not count."""
    tok = tokenizer.Tokenizer("byte", "byte", 257, 256)
    threshold = 2**63

    def doc(text, h):
        tokens = np.array([tok.bos_id] + tok.encode(text), dtype=data.token_dtype(tok.vocab_size))
        return h, len(text), tokens, None, False, None, (), data.token_hash(tokens)

    encoded = [doc("shared", 5), doc("val only", 6), doc("shared", threshold + 5), doc("train only", threshold + 6),
               doc("shared!", threshold + 7), doc("shared", threshold + 8)]
    splits, _, contamination = prepare.write_shards(tmp_path, encoded, tok, 8, threshold, prepare.SmallestHashes(0))
    assert [splits[name]["docs"] for name in ("train", "val")] == [4, 2] and len(splits["train"]["shards"]) > 1
    assert contamination == {"train_docs_in_val": 2, "val_documents": 2, "hash": TOKEN_HASH}
    assert data.contamination(tmp_path, {"splits": splits}) == (2, 2)  # what the written shards give


def test_a_raised_threshold_rewrites_the_shards_as_one_pass_at_it(tmp_path):
    """split_again, from the shards of a first pass and its Ledger, writes what one pass at the raised threshold
    writes: the same files, counts, contamination and eval rows, loss masks and source splits kept."""
    tok = tokenizer.Tokenizer("byte", "byte", 257, 256)
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**64, 60, dtype=np.uint64).tolist()
    forced = [None] * 50 + ["train"] * 5 + ["val"] * 5
    rng.shuffle(forced)
    encoded = []
    for i, (h, split) in enumerate(zip(hashes, forced)):
        tokens = np.array([tok.bos_id] + tok.encode(f"document {i} " * (i % 7 + 1)), dtype=np.uint16)
        mask = (np.arange(len(tokens)) % 3 == 0).astype(np.uint8)
        rows = (i % 4,) if i % 3 == 0 else ()
        encoded.append((h, len(tokens) - 1, tokens, split, i % 5 == 0, mask, rows, data.token_hash(tokens)))
    first, raised = 2**60, sorted(hashes)[20]
    outs = {name: tmp_path / name for name in ("first", "one_pass")}
    for out in outs.values():
        out.mkdir()
    ledger, found = holdout.Ledger(10**9), collections.Counter()
    splits, *_ = prepare.write_shards(outs["first"], encoded, tok, 100, first, prepare.SmallestHashes(0), found,
                                      ledger)
    again = prepare.split_again(str(outs["first"]), ledger, splits, tok, 100, raised, found)
    expected = collections.Counter()
    one_pass = prepare.write_shards(outs["one_pass"], encoded, tok, 100, raised, prepare.SmallestHashes(0), expected)
    assert again[0] == one_pass[0] and np.array_equal(again[1], one_pass[1]) and again[2] == one_pass[2]
    assert found == expected and sum(found.values()) > 0
    assert again[0]["val"]["docs"] > splits["val"]["docs"] and again[0]["val"]["loss_tokens"] > 0
    assert snapshot_bytes(outs["first"]) == snapshot_bytes(outs["one_pass"])  # the first pass's files gone


def snapshot_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# -----------------------------------------------------------------------------
# downloads, from a server on 127.0.0.1


class Handler(http.server.BaseHTTPRequestHandler):
    """A file server that speaks as much of the hub as huggingface_hub asks of it: its HEAD before a download
    is answered with the file's commit (X-Repo-Commit), ETag and size, also on a redirect (X-Linked-*)."""

    def do_HEAD(self):
        self.answer(head=True)

    def do_GET(self):
        self.answer(head=False)

    def answer(self, head):
        srv = self.server
        if not head:  # the downloads; every request's Authorization is in srv.auth
            srv.log.append((self.path, self.headers.get("Range")))
        srv.auth.append((self.path, self.headers.get("Authorization")))
        time.sleep(srv.stall)
        if srv.failures > 0:
            srv.failures -= 1
            self.send_response(srv.status)
            for name, value in srv.failure_headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        if self.path in srv.gated and self.headers.get("Authorization") != f"Bearer {srv.gated[self.path]}":
            return self.send_error(401)  # a gated dataset's file
        if self.path in srv.redirects:  # as the hub sends a download on to its storage host
            self.send_response(302)
            self.send_header("Location", srv.redirects[self.path])
            body = srv.files[urllib.parse.urlsplit(srv.redirects[self.path]).path]
            self.send_header("X-Repo-Commit", HUB_COMMIT)
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(body).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(body)))
            self.send_header("Content-Length", "0")
            return self.end_headers()
        body = srv.files.get(self.path)
        if body is None:
            return self.send_error(404)
        start = 0
        if self.headers.get("Range") and srv.honor_range:
            start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("X-Repo-Commit", HUB_COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if head:
            return
        if srv.cuts > 0:  # send only srv.cut bytes of the promised body, then drop the connection
            srv.cuts -= 1
            self.wfile.write(body[start:start + srv.cut])
            self.close_connection = True
            return
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


HUB_COMMIT = "c0ffee" * 6 + "c0de"  # the dataset's one commit on the local hub


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up mid-answer is no error here
            super().handle_error(request, client_address)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(download, "BACKOFF", 0.01)
    srv = Server(("127.0.0.1", 0), Handler)
    srv.files, srv.log, srv.honor_range = {}, [], True
    srv.failures, srv.status = 0, 503  # the next `failures` requests are answered with `status`
    srv.failure_headers = {}  # and these headers (Retry-After, RateLimit)
    srv.auth = []  # (path, Authorization header) of every request
    srv.gated = {}  # path: the token it needs (Authorization: Bearer <token>), else a 401
    srv.redirects = {}  # path: the URL a 302 sends it to
    srv.cut, srv.cuts = 0, 0  # the next `cuts` responses end after `cut` bytes
    srv.stall = 0  # seconds before each answer
    srv.url = f"http://127.0.0.1:{srv.server_port}"
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_download_resumes_a_partial_file(server, tmp_path):
    body = os.urandom(300_000)
    server.files["/f/data.txt"] = body
    url = server.url + "/f/data.txt"
    path = download.cache_path(url, str(tmp_path))
    os.makedirs(os.path.dirname(path))
    open(path + ".part", "wb").write(body[:100_000])
    assert download.download(url, str(tmp_path)) == path
    assert open(path, "rb").read() == body and not os.path.exists(path + ".part")
    assert server.log == [("/f/data.txt", "bytes=100000-")]
    assert download.download(url, str(tmp_path)) == path and len(server.log) == 1  # complete: reused


def test_download_resumes_after_a_dropped_connection(server, tmp_path):
    body = os.urandom(3 << 20)
    server.files["/x.txt"], server.cut, server.cuts = body, 5 << 19, 1  # dropped after 2.5 MB
    path = download.download(server.url + "/x.txt", str(tmp_path))
    assert open(path, "rb").read() == body
    (first, no_range), (second, resumed) = server.log
    assert no_range is None and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= 5 << 19


def test_download_restarts_when_range_is_ignored(server, tmp_path):
    body = b"the real content\n" * 1000
    server.files["/y.txt"], server.honor_range = body, False
    url = server.url + "/y.txt"
    path = download.cache_path(url, str(tmp_path))
    os.makedirs(os.path.dirname(path))
    open(path + ".part", "wb").write(b"stale bytes")
    assert open(download.download(url, str(tmp_path)), "rb").read() == body


def test_download_retries_transient_errors_then_gives_up(server, tmp_path):
    server.files["/z.txt"], server.failures = b"ok\n", 2
    assert open(download.download(server.url + "/z.txt", str(tmp_path)), "rb").read() == b"ok\n"
    assert len(server.log) == 3
    server.failures = 100
    with pytest.raises(util.Error, match=f"after {download.RETRIES} attempts"):
        download.download(server.url + "/w.txt", str(tmp_path))
    assert len(server.log) == 3 + download.RETRIES
    server.failures = 0
    with pytest.raises(util.Error, match="HTTP 404"):  # not transient: no retries
        download.download(server.url + "/missing.txt", str(tmp_path))
    assert len(server.log) == 4 + download.RETRIES


def test_url_source_with_sha256(server, tmp_path, capsys):
    body = "\n\n".join(f"paragraph {i} ünïcode" for i in range(40)).encode()
    server.files["/doc.txt"] = body
    out, cache = tmp_path / "out", tmp_path / "cache"
    common = [f"--source={server.url}/doc.txt", f"--data_dir={out}", f"--download_dir={cache}", "--val_fraction=0"]
    assert run(*common, "--sha256=" + "0" * 64) == 1
    assert "sha256" in error_line(capsys.readouterr().err)
    assert not out.exists() and not Path(f"{out}.tmp").exists()
    assert not cache.exists()  # the bad download deleted, and the folders made for it
    assert run(*common, "--sha256=" + hashlib.sha256(body).hexdigest()) == 0
    assert decode_split(out, "train") == [body.decode()]  # a .txt URL is one document


def test_presets_through_local_mirrors(server, tmp_path, monkeypatch):
    """A Hugging Face preset through HF_ENDPOINT, downloaded once into the Hugging Face cache (HF_HOME/hub here)
    and read from there by a rebuild; tinyshakespeare, a plain URL, into download_dir."""
    rows = [f"fineweb row {i}: educational text ✓" for i in range(40)]
    server.files["/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/000_00000.parquet"] = parquet_bytes(rows)
    hub_env(monkeypatch, HF_ENDPOINT=server.url)
    out, cache = tmp_path / "fw", tmp_path / "downloads"
    args = ["--source=fineweb-edu-10bt", "--max_shards=1", f"--data_dir={out}", f"--download_dir={cache}",
            "--val_fraction=0.2", "--min_val_tokens=0"]
    assert run(*args) == 0
    manifest = data.load_manifest(out)
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == len(rows)
    assert sorted(decode_split(out, "train") + decode_split(out, "val")) == sorted(rows)
    assert "1 of 14 files" in manifest["source"] and len(server.log) == 1
    assert run(*args, "--force") == 0 and len(server.log) == 1  # rebuilt from the kept download
    assert list((tmp_path / "hf_home" / "hub").rglob("*.parquet")) and not cache.exists()

    speeches = [f"Speaker {i}:\nLine {i} of the play." for i in range(30)]
    server.files["/input.txt"] = ("\n\n".join(speeches) + "\n").encode()
    monkeypatch.setattr(sources, "TINYSHAKESPEARE_URL", server.url + "/input.txt")
    out = tmp_path / "shakespeare"
    assert run("--source=tinyshakespeare", "--tokenizer=char", f"--data_dir={out}", f"--download_dir={cache}",
               "--val_fraction=0") == 0
    assert decode_split(out, "train") == speeches[:-1] + [speeches[-1] + "\n"]


GSM8K = [("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May?",
          "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in "
          "April and May.\n#### 72"),
         ("Weng earns $12 an hour for babysitting. How much did she earn for 50 minutes?",
          "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10."
          "\n#### 10")]


def gsm8k_parquet(rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    buf = io.BytesIO()
    pq.write_table(pa.table({"question": [q for q, _ in rows], "answer": [a for _, a in rows]}), buf)
    return buf.getvalue()


def test_gsm8k_preset_keeps_its_split_and_formats_each_objective(server, tmp_path, monkeypatch, capsys):
    """The gsm8k preset through a local mirror of the hub: its train file's problems are the training split and
    its test file's the validation split, whatever their hashes. qa: "Question: ...\nAnswer: ..." documents.
    hdp with segments 128,128,256: every document is 512 tokens, the question after BOS, the plan without the
    calculator annotations, the execution with them and the final answer, each padded with BOS or cut (the
    first problem's question is longer than 127 bytes), and prepare.py says how many were cut."""
    base = "/datasets/openai/gsm8k/resolve/main/main/"
    server.files[base + "train-00000-of-00001.parquet"] = gsm8k_parquet(GSM8K * 3)
    server.files[base + "test-00000-of-00001.parquet"] = gsm8k_parquet(GSM8K[1:])
    hub_env(monkeypatch, HF_ENDPOINT=server.url)
    common = ["--source=gsm8k", f"--download_dir={tmp_path / 'downloads'}", "--min_val_tokens=0", "--workers=1"]
    assert run(*common, f"--data_dir={tmp_path / 'qa'}") == 0
    assert decode_split(tmp_path / "qa", "train") == [f"Question: {q}\nAnswer: {a}" for q, a in GSM8K * 3]
    assert decode_split(tmp_path / "qa", "val") == [f"Question: {q}\nAnswer: {a}" for q, a in GSM8K[1:]]
    capsys.readouterr()
    assert run(*common, f"--data_dir={tmp_path / 'hdp'}", "--gsm8k_format=hdp", "--segments=128,128,256") == 0
    assert ("segments 128,128,256: every document is 512 tokens; 3 of 7 (42.9%) had a segment cut to its length "
            "(train 3, validation 0)") in capsys.readouterr().out
    manifest, tok = data.load_manifest(tmp_path / "hdp"), tokenizer.load_tokenizer(tmp_path / "hdp")
    rows = {}
    for split in ("train", "val"):
        (shard,) = manifest["splits"][split]["shards"]
        tokens = np.asarray(data.open_shard(os.path.join(tmp_path / "hdp", shard["file"])))
        assert len(tokens) == 512 * shard["docs"] and (tokens[::512] == tok.bos_id).all()
        rows[split] = tokens.reshape(-1, 512)
    assert len(rows["train"]) == 6 and len(rows["val"]) == 1

    def text(segment):
        return tok.decode_bytes(segment[segment != tok.bos_id]).decode("utf-8", errors="replace")

    (q, a), row = GSM8K[1], rows["val"][0]
    assert text(row[:128]) == q and row[1 + len(q):128].tolist() == [tok.bos_id] * (127 - len(q))
    assert text(row[128:256]) == "Weng earns 12/60 = $0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $10."
    assert text(row[256:]) == a and row[256 + len(a):].tolist() == [tok.bos_id] * (256 - len(a))
    assert text(rows["train"][0][:128]) == GSM8K[0][0][:127]  # BOS and 127 bytes of the question: cut
    assert run(*common, f"--data_dir={tmp_path / 'bad'}", "--gsm8k_format=hdp") == 1
    assert error_line(capsys.readouterr().err) == (
        "error: gsm8k_format=hdp makes each problem three segments (question, plan, execution): set segments to their "
        "token lengths, e.g. --segments=128,128,256 (got '')")


def refused_url():
    """A URL on a port of 127.0.0.1 where nothing listens: the connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/corpus.txt"


@pytest.mark.parametrize("case", ["refused", "404", "dns", "unreachable"])
def test_a_download_that_cannot_succeed_fails_at_once_and_leaves_nothing(case, server, tmp_path, capsys, monkeypatch):
    """A URL that refuses or answers 404, and the hub on an offline pod (its name does not resolve, or there is
    no network to reach it): one line, nothing left behind; a URL at once, with no retries (huggingface_hub
    retries the hub's network errors, its waits skipped here). For the hub it names a mirror and the places a
    copy of the file would be read from."""
    downloads = tmp_path / "downloads"
    if case in ("refused", "404"):
        source = url = refused_url() if case == "refused" else server.url + "/no.txt"
    else:
        monkeypatch.setattr(time, "sleep", lambda seconds: None)
        if case == "dns":
            def lookup(*args, **kwargs):
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            monkeypatch.setattr(socket, "getaddrinfo", lookup)
        else:  # an address needs no lookup; the connection finds no route
            def connect(self, address):
                raise OSError(errno.ENETUNREACH, "Network is unreachable")
            hub_env(monkeypatch, HF_ENDPOINT="http://192.0.2.1")
            monkeypatch.setattr(socket.socket, "connect", connect)
        source, url = "fineweb-edu-10bt", sources.preset_urls("fineweb-edu-10bt")[0]
    path = download.cache_path(url, str(downloads))
    expected = {
        "refused": f"connection refused: offline? put the file at {path}, or check the URL",
        "404": "HTTP 404: check the URL",
        "dns": f"cannot resolve the host name: offline? set HF_ENDPOINT to a mirror, or put the file at {path} "
               f"or in the Hugging Face cache ({tmp_path / 'hf_home' / 'hub'})",
        "unreachable": f"network unreachable: offline? set HF_ENDPOINT to a mirror, or put the file at {path} "
                       f"or in the Hugging Face cache ({tmp_path / 'hf_home' / 'hub'})"}[case]
    (tmp_path / "mine.txt").write_text("the user's")
    before = tree(tmp_path)
    assert run(f"--source={source}", "--max_shards=1", f"--data_dir={tmp_path / 'data'}", f"--download_dir={downloads}",
               "--workers=1") == 1
    err = capsys.readouterr().err
    assert error_line(err) == f"error: cannot download {url}: {expected}"
    assert len(server.log) == (case == "404") and (case in ("dns", "unreachable") or "retry" not in err)
    assert tree(tmp_path) == before  # no data_dir, no download folders


@pytest.mark.parametrize("case", ["503", "429", "dropped", "timeout"])
def test_a_download_that_keeps_failing_is_retried_then_leaves_nothing(case, server, tmp_path, capsys, monkeypatch):
    """5xx, 429 (a rate limit), a dropped connection and a timeout may pass: retried. What arrived is
    nothing (a dropped answer's first bytes are less than a chunk), so nothing stays behind."""
    monkeypatch.setattr(download, "RETRIES", 2)
    server.files["/corpus.txt"] = b"text\n" * 1000
    reason = {"503": "HTTP 503", "429": "HTTP 429", "dropped": "connection dropped", "timeout": "timed out"}[case]
    if case in ("503", "429"):
        server.failures, server.status = 2, int(case)
    if case == "dropped":
        server.cut, server.cuts = 10, 2
    if case == "timeout":
        server.stall = 0.3
        monkeypatch.setattr(download, "TIMEOUT", (5, 0.1))
    url = server.url + "/corpus.txt"
    before = tree(tmp_path)
    assert run(f"--source={url}", f"--data_dir={tmp_path / 'data'}", f"--download_dir={tmp_path / 'downloads'}",
               "--workers=1") == 1
    err = capsys.readouterr().err
    rerun = "rate-limited: rerun later" if case == "429" else "check the network and rerun"
    assert error_line(err) == f"error: cannot download {url} after 2 attempts ({reason}): {rerun}"
    assert f"download of {url} failed ({reason}); retry 1/1 in 0.01s" in err and len(server.log) == 2
    assert tree(tmp_path) == before


def test_a_partial_download_is_kept_for_the_rerun_to_resume(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(download, "RETRIES", 2)
    body = b"some words " * 250_000  # 2.75 MB; each answer dropped after 1.25 MB, of which a 1 MB chunk is written
    server.files["/big.txt"], server.cut, server.cuts = body, 5 << 18, 2
    url, cache = server.url + "/big.txt", tmp_path / "downloads"
    part = download.cache_path(url, str(cache)) + ".part"
    assert run(f"--source={url}", f"--data_dir={tmp_path / 'data'}", f"--download_dir={cache}", "--workers=1") == 1
    kept = os.path.getsize(part)
    assert error_line(capsys.readouterr().err) == (
        f"error: cannot download {url} after 2 attempts (connection dropped): check the network and rerun; "
        f"the {kept:,} bytes so far are kept in {part}, and the rerun resumes them")
    assert kept > 0 and os.listdir(os.path.dirname(part)) == ["big.txt.part"] and not (tmp_path / "data").exists()
    assert open(download.download(url, str(cache)), "rb").read() == body
    assert server.log[-1] == ("/big.txt", f"bytes={kept}-")


# -----------------------------------------------------------------------------
# the Hugging Face hub's conventions: HF_TOKEN, the cache, HF_HUB_OFFLINE, rate limits

FINEWEB_FILE = "sample/10BT/000_00000.parquet"
FINEWEB_PATH = "/datasets/HuggingFaceFW/fineweb-edu/resolve/main/" + FINEWEB_FILE


def preset_args(tmp_path, *args):
    """prepare.py on fineweb-edu-10bt's first file into tmp_path/data, downloads in tmp_path/downloads."""
    return ["--source=fineweb-edu-10bt", "--max_shards=1", f"--data_dir={tmp_path / 'data'}",
            f"--download_dir={tmp_path / 'downloads'}", "--val_fraction=0", "--workers=1", *args]


def test_a_gated_dataset_takes_hf_token_and_only_the_hub_gets_it(server, tmp_path, capsys, monkeypatch):
    """Without a token the hub's 401 is one line naming HF_TOKEN; with HF_TOKEN the file comes, and the token
    goes to the hub alone: not on to the storage host the hub redirects the download to (another host name,
    as the hub's are), nor to a URL source elsewhere."""
    rows = [f"gated row {i}" for i in range(20)]
    storage = f"http://localhost:{server.server_port}"
    server.gated[FINEWEB_PATH] = "hf_access"
    server.redirects[FINEWEB_PATH] = storage + "/blobs/000.parquet"
    server.files["/blobs/000.parquet"] = parquet_bytes(rows)
    server.files["/notes.txt"] = b"notes from elsewhere\n"
    hub_env(monkeypatch, HF_ENDPOINT=server.url)
    assert run(*preset_args(tmp_path)) == 1
    err = capsys.readouterr().err
    assert error_line(err) == (f"error: cannot download {server.url + FINEWEB_PATH}: HTTP 401: set HF_TOKEN (a "
                               "token with access to HuggingFaceFW/fineweb-edu; a gated dataset's terms accepted on "
                               "its page)")
    assert "retry" not in err
    monkeypatch.setenv("HF_TOKEN", "hf_access")
    assert run(*preset_args(tmp_path)) == 0
    assert decode_split(tmp_path / "data", "train") == rows
    assert run(f"--source={storage}/notes.txt", f"--data_dir={tmp_path / 'notes'}",
               f"--download_dir={tmp_path / 'downloads'}", "--val_fraction=0", "--workers=1") == 0
    assert server.auth == [(FINEWEB_PATH, None), (FINEWEB_PATH, "Bearer hf_access"), ("/blobs/000.parquet", None),
                           ("/notes.txt", None)]


def test_a_rate_limit_waits_as_long_as_the_server_asks_then_names_hf_token(server, tmp_path, monkeypatch):
    """A 429 from the hub is waited out as long as its Retry-After or RateLimit header asks (huggingface_hub's
    retries), then the file comes; one that outlasts the retries says that the hub's limits are per token. A
    URL elsewhere waits as long as its Retry-After asks, at most MAX_WAIT."""
    waits = []
    monkeypatch.setattr(time, "sleep", lambda seconds: seconds and waits.append(seconds))  # the server sleeps 0
    hub_env(monkeypatch, HF_ENDPOINT=server.url)
    server.status = 429
    for i, (headers, wait) in enumerate([({"Retry-After": "7"}, 7), ({"RateLimit": '"resolvers";r=0;t=42'}, 42)]):
        url = f"{server.url}/datasets/o/d/resolve/main/{i}.txt"
        server.files[url.removeprefix(server.url)] = b"rows\n"
        server.failures, server.failure_headers, waits[:] = 2, headers, []  # the first 429 is tried again at once
        assert open(download.download(url, str(tmp_path)), "rb").read() == b"rows\n"
        assert len(waits) == 1 and waits[0] >= wait
    server.failures = 100
    url = f"{server.url}/datasets/o/d/resolve/main/2.txt"
    with pytest.raises(util.Error) as e:
        download.download(url, str(tmp_path))
    assert str(e.value) == (f"cannot download {url} after retries (HTTP 429): rate-limited: rerun later with HF_TOKEN "
                            "set (the hub's rate limits are per token, and lowest without one)")
    server.files["/plain.txt"] = b"rows\n"
    for headers, wait in ({"Retry-After": "7"}, 7), ({"Retry-After": "100000"}, download.MAX_WAIT):
        server.failures, server.failure_headers, waits[:] = 1, headers, []
        path = download.download(server.url + "/plain.txt", str(tmp_path / f"plain{wait}"))
        assert open(path, "rb").read() == b"rows\n" and waits == [wait]


def hub_snapshot(cache, repo, commit, files):
    """A dataset's snapshot in a Hugging Face cache as huggingface_hub lays one out: each file in blobs/, named by
    its hash, and a relative link to it at snapshots/<commit>/<path>; returns the dataset's folder."""
    folder = cache / ("datasets--" + repo.replace("/", "--"))
    for name, content in files.items():
        blob = folder / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return folder


def test_a_url_on_the_hub_is_read_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """A file's URL on the hub is read from the snapshot of the Hugging Face cache that its revision names (a
    branch through refs/), with no request (HF_HUB_OFFLINE here); with --sha256 the cache's copy is checked, and
    stays when it does not match. Not in the cache, offline: one line naming where it was looked for."""
    hub_env(monkeypatch, HF_HUB_CACHE=tmp_path / "hub", HF_HUB_OFFLINE="1")
    folder = hub_snapshot(tmp_path / "hub", "o/d", "a" * 40, {"f.txt": b"old", "dir/g.txt": b"old g"})
    hub_snapshot(tmp_path / "hub", "o/d", "b" * 40, {"f.txt": b"new"})
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("b" * 40)
    downloads = str(tmp_path / "downloads")

    def read(revision, file, sha256=""):
        url = f"https://huggingface.co/datasets/o/d/resolve/{revision}/{file}"
        return open(download.download(url, downloads, sha256), "rb").read()

    assert read("main", "f.txt", hashlib.sha256(b"new").hexdigest()) == b"new"  # the snapshot refs/main names
    assert read("a" * 40, "f.txt") == b"old" and read("a" * 40, "dir/g.txt") == b"old g"  # a commit: its own
    with pytest.raises(util.Error, match=r"sha256 of its copy in the Hugging Face cache \(.*\) is [0-9a-f]{64}, "):
        read("main", "f.txt", "0" * 64)
    assert read("main", "f.txt") == b"new" and not os.path.exists(downloads)
    url = "https://huggingface.co/datasets/o/d/resolve/main/dir/g.txt"  # not in refs/main's snapshot
    with pytest.raises(util.Error) as e:
        download.download(url, downloads)
    assert str(e.value) == (f"HF_HUB_OFFLINE is set and {url} is not at {download.cache_path(url, downloads)} nor in "
                            f"the Hugging Face cache ({tmp_path / 'hub'}): put the file there, or unset HF_HUB_OFFLINE "
                            "to download it")


def test_a_preset_reads_the_hugging_face_cache_and_hf_hub_offline_never_asks_the_hub(tmp_path, capsys, monkeypatch):
    """A preset's file in the cache (HF_HOME/hub here) is read there, refs/main's version, with no request (the
    endpoint refuses every one) and nothing in download_dir; under HF_HUB_OFFLINE a missing file stops the run
    before it tokenizes, in one line naming where it was looked for; download_dir's copy serves offline too."""
    hub_env(monkeypatch, HF_ENDPOINT=refused_url().removesuffix("/corpus.txt"))
    old, new = [f"old row {i}" for i in range(20)], [f"new row {i}" for i in range(20)]
    cache, repo = tmp_path / "hf_home" / "hub", "HuggingFaceFW/fineweb-edu"
    folder = hub_snapshot(cache, repo, "a" * 40, {FINEWEB_FILE: parquet_bytes(old)})
    hub_snapshot(cache, repo, "b" * 40, {FINEWEB_FILE: parquet_bytes(new)})
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("b" * 40)
    assert run(*preset_args(tmp_path)) == 0
    assert decode_split(tmp_path / "data", "train") == new and not (tmp_path / "downloads").exists()

    hub_env(monkeypatch, HF_HUB_OFFLINE="1", HF_HUB_CACHE=tmp_path / "empty")  # HF_HUB_CACHE before HF_HOME/hub
    url = sources.preset_urls("fineweb-edu-10bt")[0]
    path = download.cache_path(url, str(tmp_path / "downloads"))
    before = tree(tmp_path)
    capsys.readouterr()
    assert run(*preset_args(tmp_path, "--force")) == 1
    assert capsys.readouterr().err == (f"error: HF_HUB_OFFLINE is set and {url} is not at {path} nor in the Hugging "
                                       f"Face cache ({tmp_path / 'empty'}): put the file there, or unset "
                                       "HF_HUB_OFFLINE to download it\n")
    assert tree(tmp_path) == before
    os.makedirs(os.path.dirname(path))
    shutil.copyfile(folder / "snapshots" / ("a" * 40) / FINEWEB_FILE, path)
    assert run(*preset_args(tmp_path, "--force")) == 0 and decode_split(tmp_path / "data", "train") == old


# -----------------------------------------------------------------------------
# data_dir: prepare.py deletes or overwrites only what it can prove it wrote


def prepared(corpus, out, *args):
    """prepare.py on the small corpus into out (byte tokens, no validation split, one worker), then args."""
    return run(f"--source={corpus}", f"--data_dir={out}", "--val_fraction=0", "--workers=1", *args)


@pytest.mark.parametrize("outcome", ["built", "failed"])
def test_folders_named_like_the_old_temporaries_survive(outcome, corpus, tmp_path, capsys):
    """prepare.py once built in data_dir.tmp and swapped through data_dir.old, deleting what it found at
    those names: a user's folders there now stay, whether a build (and a rebuild) completes or fails."""
    out = tmp_path / "data"
    for name in ("data.tmp", "data.old"):
        (tmp_path / name / "run").mkdir(parents=True)
        (tmp_path / name / "run" / "ckpt.pt").write_bytes(os.urandom(1000))
    before = tree(tmp_path)
    if outcome == "built":
        assert prepared(corpus, out) == 0 and prepared(corpus, out, "--force") == 0
        assert {path: digest for path, digest in tree(tmp_path).items() if not path.startswith("data/")} == {
            "data": "folder", **before}
    else:
        assert prepared(corpus, out, "--val_fraction=0.1", "--min_val_tokens=1000000") == 1
        assert "too little data" in error_line(capsys.readouterr().err)
        assert tree(tmp_path) == before


def test_a_rebuild_over_a_users_files_is_refused_and_keeps_them(corpus, tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()  # an empty folder is fine to build into
    assert prepared(corpus, out) == 0
    (out / "run").mkdir()
    (out / "run" / "ckpt.pt").write_bytes(os.urandom(1000))
    (out / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    capsys.readouterr()
    assert prepared(corpus, out, "--force") == 1
    assert error_line(capsys.readouterr().err) == (f"error: {out} holds what prepare.py did not write (notes.txt, "
                                                   "run/): move that out of it, or choose another --data_dir")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("entries, named", [
    (["notes.txt"], "notes.txt"),
    (["train_000000.bin", "tokenizer.json", "run/ckpt.pt"], "run/"),  # podgpt's names are not named
    (["a.jsonl", "notes.txt", "run/x", "zz.txt", "zz/y"], "a.jsonl, notes.txt, run/ and 2 more"),
    (["manifest.json/x"], "manifest.json/"),  # a folder by the name of one of podgpt's files is not podgpt's
])
def test_a_data_dir_holding_what_prepare_did_not_write_is_refused(entries, named, corpus, tmp_path, capsys):
    out = tmp_path / "data"
    for entry in entries:
        (out / entry).parent.mkdir(parents=True, exist_ok=True)
        (out / entry).write_text("the user's")
    before = tree(tmp_path)
    assert prepared(corpus, out) == 1
    assert error_line(capsys.readouterr().err) == (f"error: {out} holds what prepare.py did not write ({named}): "
                                                   "move that out of it, or choose another --data_dir")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("marked", [False, True])
def test_a_folder_at_the_scratch_path_is_removed_only_when_podgpt_made_it(marked, corpus, tmp_path, capsys):
    out = tmp_path / "data"
    assert prepared(corpus, out) == 0
    data_files = tree(out)
    scratch = out / prepare.SCRATCH
    scratch.mkdir()
    (scratch / "work.txt").write_text("whose?")
    if marked:  # what a killed run leaves
        (scratch / util.SCRATCH_MARK).write_text("made by podgpt")
        assert prepared(corpus, out, "--force") == 0
        assert tree(out) == data_files  # the same build again, and no scratch folder
        return
    before = tree(tmp_path)
    assert prepared(corpus, out, "--force") == 1
    assert error_line(capsys.readouterr().err) == (
        f"error: {scratch} is in podgpt's way and podgpt did not make it (it holds no {util.SCRATCH_MARK} file): "
        "move or rename it, then rerun")
    assert tree(tmp_path) == before


def test_a_rebuild_leaves_only_its_own_new_files(corpus, tmp_path):
    """The old build's files the new manifest does not list go (more shards, tokenizer.tiktoken, a crash's
    leftover of write_shard), the listed ones are replaced."""
    out = tmp_path / "data"
    assert prepared(corpus, out, "--tokenizer=bpe:300", "--shard_tokens=200") == 0
    (out / "train_000099.bin.tmp").write_bytes(b"half a shard")
    assert len(list(out.glob("train_*.bin"))) > 1 and (out / "tokenizer.tiktoken").exists()
    assert prepared(corpus, out) == 0
    manifest = data.load_manifest(out)
    assert sorted(os.listdir(out)) == sorted(prepare.listed_files(manifest) + ["manifest.json", ".podgpt-data"])
    assert len(manifest["splits"]["train"]["shards"]) == 1 and manifest["tokenizer"] == "byte"


DAMAGES = {
    "a key missing": lambda m: m.pop("token_dtype"),
    "splits null": lambda m: m.update(splits=None),
    "text for a list": lambda m: m.update(tokenizer_files="tokenizer.json"),
    "text for a count": lambda m: m["splits"]["train"]["shards"][0].update(tokens="many"),
    "an unknown dtype": lambda m: m.update(token_dtype="uint7"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_manifest_is_rebuilt(damage, corpus, tmp_path, capsys):
    out = tmp_path / "data"
    assert prepared(corpus, out) == 0
    good = (out / "manifest.json").read_text()
    manifest = json.loads(good)
    DAMAGES[damage](manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert not prepare.is_complete(str(out), json.loads(good)["prepare_args"])
    capsys.readouterr()
    assert prepared(corpus, out) == 0
    assert "reusing" not in capsys.readouterr().out and (out / "manifest.json").read_text() == good


def test_a_ctrl_c_during_the_swap_waits_until_it_is_done():
    """signals_held, which the swap runs under: a Ctrl-C that comes meanwhile is acted on after the block, also
    while numpy's threads run (signal.pthread_sigmask would not hold it: one of them would take the signal)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever pytest set
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with prepare.signals_held(signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), signal.SIGINT)
                np.ones((300, 300)) @ np.ones((300, 300))
                steps.append("done")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert steps == ["done"]


def test_ctrl_c_stops_in_one_line_and_keeps_the_previous_data(corpus, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, workers too) while a rebuild tokenizes: no worker's
    traceback, the scratch folder removed, exit 130, the previous data there byte for byte."""
    out = tmp_path / "data"
    assert prepared(corpus, out) == 0
    before = tree(out)
    # ~120 MB in 120 shards; the signal follows the first. 40 MB was once tokenized whole on a loaded CI before
    # this test's polling, starved by the other tests on the cores, sent it: the signal must land mid-build
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 160}) + "\n" for i in range(120_000)))
    proc = popen([sys.executable, "prepare.py", f"--source={big}", f"--data_dir={out}", "--force", "--val_fraction=0",
                  "--shard_tokens=1000000", "--workers=2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True, start_new_session=True)
    first_shard = out / prepare.SCRATCH / "train_000000.bin"  # in the scratch folder: mid-tokenizing
    deadline = time.time() + 60
    while not first_shard.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert error_line(err) == "error: interrupted (Ctrl-C)" and "tokenizing" in err
    assert tree(out) == before


ENCODE_BATCH = prepare.encode_batch


def slow_encode_batch(docs):
    """ENCODE_BATCH, 0.3 s slower, leaving a file as it starts and one as it ends (in the forked workers:
    the test below puts it in place of encode_batch, which the pool sends to them by name)."""
    folder = os.environ["PODGPT_TEST_JOBS"]
    name = f"{os.getpid()}-{time.monotonic_ns()}"
    open(os.path.join(folder, f"{name}.start"), "w").close()
    time.sleep(0.3)
    out = ENCODE_BATCH(docs)
    open(os.path.join(folder, f"{name}.end"), "w").close()
    return out


def test_the_tokenizing_pool_is_stopped_only_once_every_job_sent_is_back(tmp_path, monkeypatch):
    """encode_all stopped early (an error downstream, a Ctrl-C) with batches still out: the pool is terminated
    only after each one has come back, so no worker is killed in the middle of a job. A worker killed while it
    sent its result left the pool's result thread waiting forever for the rest: prepare.py hung after a Ctrl-C
    (once on CI, once in 24 tries on a loaded 2-core VM)."""
    tokenizer.save_tokenizer(str(tmp_path), "byte", {"kind": "byte", "vocab_size": 257}, None)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    monkeypatch.setenv("PODGPT_TEST_JOBS", str(jobs))
    monkeypatch.setattr(prepare, "encode_batch", slow_encode_batch)
    docs = (("x" * prepare.BATCH_CHARS, None) for _ in range(20))  # a batch each
    encoded = prepare.encode_all(docs, 2, str(tmp_path), None)
    assert len(next(encoded)[2]) == prepare.BATCH_CHARS + 1  # BOS, then a token per byte
    encoded.close()
    started, ended = ({f.stem for f in jobs.glob(f"*.{end}")} for end in ("start", "end"))
    assert len(started) > 1 and started == ended, f"{len(started)} jobs started, {len(ended)} ended"


# -----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("args", [["--source=/no/such/folder"], ["--tokenizer=wordpiece"], ["--source=fineweb"]])
def test_cli_bad_input_is_one_error_line(args, tmp_path):
    out = tmp_path / "out"
    result = run_command([sys.executable, "prepare.py", *args, f"--data_dir={out}"], check=False, timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert not out.exists() and not Path(f"{out}.tmp").exists()


def test_bad_files_and_splits_are_errors(tmp_path, capsys):
    out = tmp_path / "out"
    cases = {
        "x.csv": (b"a,b\n", "unsupported file type"),
        "x.jsonl": (b'{"body": "no text field"}\n', "string field 'text'"),
        "y.parquet": (parquet_bytes(["t"], column="content"), "no column 'text'"),
        "z.parquet": (b"PAR1 not really parquet", "cannot read"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        assert run(f"--source={tmp_path / name}", f"--data_dir={out}") == 1
        assert message in error_line(capsys.readouterr().err)
        assert not out.exists() and not Path(f"{out}.tmp").exists()
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    assert run(f"--source={few}", f"--data_dir={out}", "--val_fraction=0.001") == 1
    assert "lower --min_val_tokens" in error_line(capsys.readouterr().err) and not out.exists()
    assert run(f"--source={few}", f"--data_dir={out}", "--val_fraction=0.001", "--min_val_tokens=0") == 1
    assert "no document went to validation" in error_line(capsys.readouterr().err) and not out.exists()
    out.mkdir()
    (out / "precious.txt").write_text("not prepare's")
    assert run(f"--source={few}", f"--data_dir={out}", "--val_fraction=0") == 1
    assert error_line(capsys.readouterr().err) == (f"error: {out} holds what prepare.py did not write (precious.txt): "
                                                   "move that out of it, or choose another --data_dir")
    assert (out / "precious.txt").read_text() == "not prepare's"


@pytest.mark.parametrize("args, message", [
    (["--workers=-1"], "workers=-1 must be >= 0 (0: one per core)"),
    (["--max_docs=-5"], "max_docs=-5 must be >= 0 (0: all)"),
    (["--max_shards=-1"], "max_shards=-1 must be >= 0 (0: all)"),
    (["--min_chars=-1"], "min_chars=-1 must be >= 0 (0: keep all)"),
    (["--min_val_tokens=-1"], "min_val_tokens=-1 must be >= 0 (0: no minimum)"),
    (["--shard_tokens=0"], "shard_tokens=0 must be positive"),
    (["--bpe_train_chars=-1"], "bpe_train_chars=-1 must be positive"),
    (["--val_fraction=1.0"], "val_fraction=1.0 must be in [0, 1)"),
    (["--data_dir="], "data_dir is empty: name a folder (e.g. --data_dir=data/default)"),
    (["--download_dir="], "download_dir is empty: name a folder (e.g. --download_dir=downloads)"),
    (["--data_dir={tmp}/afile"], "data_dir={tmp}/afile is not a folder: choose another --data_dir"),
    (["--download_dir={tmp}/data"],
     "data_dir={tmp}/data and download_dir={tmp}/data are the same folder: give each its own folder, side by side"),
    (["--download_dir={tmp}/data/downloads"],
     "download_dir={tmp}/data/downloads lies inside data_dir={tmp}/data: give each its own folder, side by side"),
    (["--download_dir={tmp}"],
     "data_dir={tmp}/data lies inside download_dir={tmp}: give each its own folder, side by side"),
])
def test_bad_settings_are_one_line_before_anything_is_written(args, message, tmp_path, capsys):
    (tmp_path / "afile").write_text("a file, not a folder")
    before = tree(tmp_path)
    assert run(f"--source={tmp_path / 'corpus.txt'}", f"--data_dir={tmp_path / 'data'}",
               *(a.format(tmp=tmp_path) for a in args)) == 1
    assert capsys.readouterr().err == f"error: {message.format(tmp=tmp_path)}\n"
    assert tree(tmp_path) == before


def damaged_parquet(where):
    """A parquet file whose dictionary page (the distinct values of a dictionary-encoded column) is damaged
    in its header, its values or the UTF-8 of one value: pyarrow opens it, and fails reading the row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": [f"row {i % 3} text" for i in range(30)]}), buf, use_dictionary=True,
                   compression="NONE")
    raw = bytearray(buf.getvalue())
    column = pq.ParquetFile(io.BytesIO(bytes(raw))).metadata.row_group(0).column(0)
    start, end = column.dictionary_page_offset, column.data_page_offset  # the dictionary page is what lies between
    if where == "header":
        raw[start:start + 4] = b"\xff" * 4
    if where == "values":
        raw[end - 12:end] = bytes(b ^ 0xff for b in raw[end - 12:end])
    if where == "utf-8":
        raw[raw.index(b"row 1", start) + 4] = 0xff
    return bytes(raw)


@pytest.mark.parametrize("case", ["deep.jsonl", "header.parquet", "values.parquet", "utf-8.parquet"])
def test_a_damaged_source_file_is_one_line(case, tmp_path, capsys):
    source = tmp_path / case
    if case == "deep.jsonl":  # json.loads raises RecursionError
        source.write_bytes(b'{"text": "fine"}\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    else:
        source.write_bytes(damaged_parquet(case.removesuffix(".parquet")))
    before = tree(tmp_path)
    assert run(f"--source={source}", f"--data_dir={tmp_path / 'data'}", "--workers=1") == 1
    line = error_line(capsys.readouterr().err)
    if case == "deep.jsonl":
        assert line == f"error: {source}:2: JSON nested too deeply to read (a damaged line?): fix or remove that line"
    else:  # the rest is pyarrow's words, which differ between its versions
        assert line.startswith(f"error: cannot read {source} as parquet (row group 1 of 1): ") and len(line) > 80
    assert tree(tmp_path) == before


def test_a_jsonl_file_with_a_byte_order_mark_is_read(tmp_path):
    source = tmp_path / "bom.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second \xef\xbb\xbf stays"}\n')
    out = tmp_path / "data"
    assert run(f"--source={source}", f"--data_dir={out}", "--val_fraction=0", "--workers=1") == 0
    assert decode_split(out, "train") == ["first", "second \ufeff stays"]
