"""Tests of prepare.py: round trips through every tokenizer, the shard format, the split and its
guaranteed minimum, determinism across workers, reuse, downloads (from a local HTTP server) and CLI errors."""

import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import prepare  # noqa: E402
import util  # noqa: E402

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
    tok = prepare.load_tokenizer(data_dir)
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
    tok = prepare.load_tokenizer(out)
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


def test_workers_do_not_change_the_output(corpus, tmp_path, capsys):
    """Also when min_val_tokens moves the threshold: then bpe:N is trained again without the new
    validation documents, so the result is what one pass with that threshold gives."""
    outs = [tmp_path / "w1", tmp_path / "w2"]
    for n, out in zip((1, 2), outs):
        assert run(f"--source={corpus}", "--tokenizer=bpe:300", f"--data_dir={out}", "--val_fraction=0.05",
                   "--min_val_tokens=300", "--shard_tokens=200", f"--workers={n}") == 0
        assert "fewer than min_val_tokens=300: holding out more documents" in capsys.readouterr().out
    one, two = ({name: data for name, (_, _, data) in snapshot(out).items()} for out in outs)
    assert one == two and len(one) > 8
    train, val = decode_split(outs[0], "train"), decode_split(outs[0], "val")
    assert data.load_manifest(outs[0])["splits"]["val"]["tokens"] >= 300
    assert max(map(doc_hash, val)) < min(map(doc_hash, train))  # the smallest hashes, whole documents
    between = (max(map(doc_hash, val)) + min(map(doc_hash, train))) / 2 / 2**64
    single = tmp_path / "single"
    assert run(f"--source={corpus}", "--tokenizer=bpe:300", f"--data_dir={single}", f"--val_fraction={between!r}",
               "--min_val_tokens=0", "--shard_tokens=200") == 0
    assert "tokenizing again" not in capsys.readouterr().out
    assert data.load_manifest(single)["fingerprint"] == data.load_manifest(outs[0])["fingerprint"]


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
    r = subprocess.run([sys.executable, "prepare.py", "config/tiny.py", f"--data_dir={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
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


def test_min_val_tokens_holds_out_documents_where_val_fraction_gives_none(tmp_path, capsys):
    docs = [f"document {i}: " + "word " * (i % 13) for i in range(150)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    n_tokens = [len(d.encode()) + 1 for d in docs]  # byte tokens and BOS
    assert smallest_hash_split(docs, n_tokens, 0.001, 0) == []  # val_fraction alone: no document
    held_out = smallest_hash_split(docs, n_tokens, 0.001, 500)
    outs = [tmp_path / "w1", tmp_path / "w2"]
    for n, out in zip((1, 2), outs):
        assert run(f"--source={source}", f"--data_dir={out}", "--val_fraction=0.001", "--min_val_tokens=500",
                   "--shard_tokens=400", f"--workers={n}") == 0
        printed = capsys.readouterr().out
        assert "validation: 0 documents, 0 tokens, fewer than min_val_tokens=500: holding out more" in printed
        assert decode_split(out, "val") == held_out
        assert decode_split(out, "train") == [d for d in docs if d not in held_out]
    one, two = ({name: data for name, (_, _, data) in snapshot(out).items()} for out in outs)
    assert one == two
    val = data.load_manifest(outs[0])["splits"]["val"]
    assert val["docs"] == len(held_out) and val["tokens"] == sum(len(d.encode()) + 1 for d in held_out) >= 500
    assert f"validation: {len(held_out):,} documents, {val['tokens']:,} tokens (" in printed


def test_too_small_a_corpus_for_min_val_tokens_is_refused(corpus, tmp_path):
    total = sum(len(d.encode()) + 1 for d in CORPUS_DOCS)
    out = tmp_path / "out"
    for min_tokens in (total + 1, total * 6 // 10):  # more than all the tokens; more than half of them
        r = subprocess.run([sys.executable, "prepare.py", f"--source={corpus}", f"--data_dir={out}",
                            f"--min_val_tokens={min_tokens}", "--workers=2"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
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
    tok = prepare.Tokenizer("byte", "byte", 257, 256)
    threshold = 2**63

    def doc(text, h):
        return h, len(text), np.array([tok.bos_id] + tok.encode(text), dtype=data.token_dtype(tok.vocab_size))

    encoded = [doc("shared", 5), doc("val only", 6), doc("shared", threshold + 5), doc("train only", threshold + 6),
               doc("shared!", threshold + 7), doc("shared", threshold + 8)]
    splits, _, contamination = prepare.write_shards(tmp_path, encoded, tok, 8, threshold, prepare.SmallestHashes(0))
    assert [splits[name]["docs"] for name in ("train", "val")] == [4, 2] and len(splits["train"]["shards"]) > 1
    assert contamination == {"train_docs_in_val": 2, "val_documents": 2, "hash": TOKEN_HASH}
    assert data.contamination(tmp_path, {"splits": splits}) == (2, 2)  # what the written shards give


# -----------------------------------------------------------------------------
# downloads, from a server on 127.0.0.1


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        srv = self.server
        srv.log.append((self.path, self.headers.get("Range")))
        if srv.failures > 0:
            srv.failures -= 1
            return self.send_error(503)
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
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if srv.cut:  # send only part of the promised body, then drop the connection
            self.wfile.write(body[start:start + srv.cut])
            srv.cut = 0
            self.close_connection = True
            return
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(prepare, "BACKOFF", 0.01)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.files, srv.log, srv.failures, srv.honor_range, srv.cut = {}, [], 0, True, 0
    srv.url = f"http://127.0.0.1:{srv.server_port}"
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_download_resumes_a_partial_file(server, tmp_path):
    body = os.urandom(300_000)
    server.files["/f/data.txt"] = body
    url = server.url + "/f/data.txt"
    path = prepare.cache_path(url, str(tmp_path))
    os.makedirs(os.path.dirname(path))
    open(path + ".part", "wb").write(body[:100_000])
    assert prepare.download(url, str(tmp_path)) == path
    assert open(path, "rb").read() == body and not os.path.exists(path + ".part")
    assert server.log == [("/f/data.txt", "bytes=100000-")]
    assert prepare.download(url, str(tmp_path)) == path and len(server.log) == 1  # complete: reused


def test_download_resumes_after_a_dropped_connection(server, tmp_path):
    body = os.urandom(3 << 20)
    server.files["/x.txt"], server.cut = body, 5 << 19  # dropped after 2.5 MB
    path = prepare.download(server.url + "/x.txt", str(tmp_path))
    assert open(path, "rb").read() == body
    (first, no_range), (second, resumed) = server.log
    assert no_range is None and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= 5 << 19


def test_download_restarts_when_range_is_ignored(server, tmp_path):
    body = b"the real content\n" * 1000
    server.files["/y.txt"], server.honor_range = body, False
    url = server.url + "/y.txt"
    path = prepare.cache_path(url, str(tmp_path))
    os.makedirs(os.path.dirname(path))
    open(path + ".part", "wb").write(b"stale bytes")
    assert open(prepare.download(url, str(tmp_path)), "rb").read() == body


def test_download_retries_transient_errors_then_gives_up(server, tmp_path):
    server.files["/z.txt"], server.failures = b"ok\n", 2
    assert open(prepare.download(server.url + "/z.txt", str(tmp_path)), "rb").read() == b"ok\n"
    assert len(server.log) == 3
    server.failures = 100
    with pytest.raises(util.Error, match=f"after {prepare.RETRIES} attempts"):
        prepare.download(server.url + "/w.txt", str(tmp_path))
    assert len(server.log) == 3 + prepare.RETRIES
    server.failures = 0
    with pytest.raises(util.Error, match="HTTP 404"):  # not transient: no retries
        prepare.download(server.url + "/missing.txt", str(tmp_path))
    assert len(server.log) == 4 + prepare.RETRIES


def test_url_source_with_sha256(server, tmp_path, capsys):
    body = "\n\n".join(f"paragraph {i} ünïcode" for i in range(40)).encode()
    server.files["/doc.txt"] = body
    out, cache = tmp_path / "out", tmp_path / "cache"
    common = [f"--source={server.url}/doc.txt", f"--data_dir={out}", f"--download_dir={cache}", "--val_fraction=0"]
    assert run(*common, "--sha256=" + "0" * 64) == 1
    assert "sha256" in error_line(capsys.readouterr().err)
    assert not out.exists() and not Path(f"{out}.tmp").exists()
    assert not os.path.exists(prepare.cache_path(f"{server.url}/doc.txt", str(cache)))  # bad download deleted
    assert run(*common, "--sha256=" + hashlib.sha256(body).hexdigest()) == 0
    assert decode_split(out, "train") == [body.decode()]  # a .txt URL is one document


def test_presets_through_local_mirrors(server, tmp_path, monkeypatch):
    rows = [f"fineweb row {i}: educational text ✓" for i in range(40)]
    server.files["/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/000_00000.parquet"] = parquet_bytes(rows)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    out, cache = tmp_path / "fw", tmp_path / "fw" / "downloads"  # a download cache inside data_dir
    args = ["--source=fineweb-edu-10bt", "--max_shards=1", f"--data_dir={out}", f"--download_dir={cache}",
            "--val_fraction=0.2", "--min_val_tokens=0"]
    assert run(*args) == 0
    manifest = data.load_manifest(out)
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == len(rows)
    assert sorted(decode_split(out, "train") + decode_split(out, "val")) == sorted(rows)
    assert "1 of 14 files" in manifest["source"] and len(server.log) == 1
    assert run(*args, "--force") == 0 and len(server.log) == 1  # rebuilt from the kept download cache
    assert list(cache.rglob("*.parquet"))

    speeches = [f"Speaker {i}:\nLine {i} of the play." for i in range(30)]
    server.files["/input.txt"] = ("\n\n".join(speeches) + "\n").encode()
    monkeypatch.setattr(prepare, "TINYSHAKESPEARE_URL", server.url + "/input.txt")
    out = tmp_path / "shakespeare"
    assert run("--source=tinyshakespeare", "--tokenizer=char", f"--data_dir={out}", f"--download_dir={cache}",
               "--val_fraction=0") == 0
    assert decode_split(out, "train") == speeches[:-1] + [speeches[-1] + "\n"]


# -----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("args", [["--source=/no/such/folder"], ["--tokenizer=wordpiece"], ["--source=fineweb"]])
def test_cli_bad_input_is_one_error_line(args, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "prepare.py", *args, f"--data_dir={out}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
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
    assert "holds no manifest.json" in error_line(capsys.readouterr().err) and (out / "precious.txt").exists()
