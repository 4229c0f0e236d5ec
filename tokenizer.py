"""
The tokenizers every script loads: byte (the 256 UTF-8 bytes), char (the corpus' characters), gpt2
(tiktoken's GPT-2 BPE) and bpe:N (trained on the training documents with rustbpe, run with tiktoken).
BOS is always the last id (bos_id = vocab_size - 1); every document is stored as [BOS] + tokens.

prepare.py trains one and saves it into data_dir as tokenizer.json (kind, vocab_size, bos_id, and the
chars or the BPE pattern and special tokens) plus, for gpt2 and bpe:N, tokenizer.tiktoken (the ranks,
"base64 rank" lines); load_tokenizer reads them back, without the network.
"""

import base64
import json
import os

import numpy as np

from util import fail, first_line

GPT2_RANKS = 50256  # GPT-2's BPE ranks; <|endoftext|> = 50256 is its BOS
SEGMENT = "\x1e"  # between a document's segments, from the reader to the tokenizer (ASCII's record separator)


class Tokenizer:
    """Text <-> token ids. kind "byte": ids 0-255 are the UTF-8 bytes; "char": ids index
    `chars`; "tiktoken": a BPE encoding (gpt2, bpe:N). bos_id = vocab_size - 1."""

    def __init__(self, spec, kind, vocab_size, bos_id, chars=None, enc=None):
        self.spec, self.kind, self.vocab_size, self.bos_id = spec, kind, vocab_size, bos_id
        self.chars, self.enc = chars, enc
        self.char_ids = {c: i for i, c in enumerate(chars or ())}

    def encode(self, text):
        """Token ids of text, without BOS; text like "<|endoftext|>" is plain text, not a special token."""
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        if self.kind == "char":
            try:
                return [self.char_ids[c] for c in text]
            except KeyError as e:
                raise ValueError(f"character {e.args[0]!r} is not in the vocabulary of this char tokenizer") from None
        return self.enc.encode_ordinary(text)

    def decode_bytes(self, ids):
        """The bytes of ids; BOS decodes to nothing."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[ids != self.bos_id].tolist()
        if self.kind == "byte":
            return bytes(ids)
        if self.kind == "char":
            return "".join(self.chars[i] for i in ids).encode("utf-8")
        return self.enc.decode_bytes(ids)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def parse_spec(spec):
    """("byte" | "char" | "gpt2" | "bpe", N) for a tokenizer spec; fails on any other."""
    if spec in ("byte", "char", "gpt2"):
        return spec, None
    name, _, n = spec.partition(":")
    if name == "bpe" and n.isdigit() and int(n) > 256:
        return "bpe", int(n)
    fail(f"unknown tokenizer '{spec}': use gpt2, byte, char or bpe:N with N > 256 (e.g. bpe:8192)")


def read_ranks(path):
    """{token bytes: rank} from a tiktoken ranks file (lines "base64 rank"). Not tiktoken's
    load_tiktoken_bpe: it caches files by path, so a rebuilt file at the same path would load stale."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def write_ranks(path, ranks):
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" %d\n" % rank)


def gpt2_ranks():
    """GPT-2's BPE ranks, from the file $PODGPT_GPT2_TIKTOKEN names (offline) or through tiktoken."""
    path = os.environ.get("PODGPT_GPT2_TIKTOKEN")
    if path:
        if not os.path.isfile(path):
            fail(f"PODGPT_GPT2_TIKTOKEN={path}: no such file")
        ranks = read_ranks(path)
    else:
        import tiktoken
        try:
            enc = tiktoken.get_encoding("gpt2")  # downloads once, then tiktoken's cache
        except Exception as e:  # network errors come in many types
            fail(f"cannot load the gpt2 tokenizer ({type(e).__name__}): offline? set "
                 "PODGPT_GPT2_TIKTOKEN to a gpt2.tiktoken file (openai-whisper ships one) or use bpe:N")
        ranks = {enc.decode_single_token_bytes(i): i for i in range(GPT2_RANKS)}
    if sorted(ranks.values()) != list(range(GPT2_RANKS)):
        fail(f"{path or 'tiktoken gpt2'}: expected GPT-2's {GPT2_RANKS} ranks, found {len(ranks)}")
    return ranks


def train_tokenizer(spec, texts, bpe_texts):
    """tokenizer.json's fields and, for tiktoken kinds, the BPE ranks. texts() streams every document's text (char:
    validation's too, so that all of them encode); bpe_texts() the texts bpe:N trains on."""
    kind, n = parse_spec(spec)
    if kind == "byte":
        return {"kind": "byte", "vocab_size": 257}, None
    if kind == "char":
        chars = set()
        for text in texts():
            chars.update(text.replace(SEGMENT, ""))
        return {"kind": "char", "vocab_size": len(chars) + 1, "chars": sorted(chars)}, None
    if kind == "gpt2":
        from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's split pattern, as tiktoken has it
        ranks, pattern, bos = gpt2_ranks(), r50k_pat_str, "<|endoftext|>"
    else:
        import rustbpe
        bpe = rustbpe.Tokenizer()
        # deterministic: merges are ranked by count, ties broken by the pair's ids (checked
        # across runs, thread counts and hash seeds). A small corpus may give fewer merges.
        bpe.train_from_iterator(bpe_texts(), n - 1)
        ranks = {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}
        pattern, bos = bpe.get_pattern(), "<|bos|>"
    meta = {"kind": "tiktoken", "vocab_size": len(ranks) + 1, "pattern": pattern, "special_tokens": {bos: len(ranks)}}
    return meta, ranks


def save_tokenizer(out_dir, spec, meta, ranks):
    """Write tokenizer.json (+ tokenizer.tiktoken); returns the file names."""
    meta = {"spec": spec, "bos_id": meta["vocab_size"] - 1, **meta}
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    if ranks is None:
        return ["tokenizer.json"]
    write_ranks(os.path.join(out_dir, "tokenizer.tiktoken"), ranks)
    return ["tokenizer.json", "tokenizer.tiktoken"]


def load_tokenizer(data_dir):
    """The Tokenizer saved in data_dir (tokenizer.json + tokenizer.tiktoken); never needs the network."""
    path = os.path.join(data_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"no tokenizer.json in {data_dir}: run python prepare.py --data_dir={data_dir}")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    enc = None
    if meta["kind"] == "tiktoken":
        import tiktoken
        ranks_file = os.path.join(data_dir, "tokenizer.tiktoken")
        ranks, n_ranks = read_ranks(ranks_file), meta["vocab_size"] - len(meta["special_tokens"])
        # checked here: tiktoken aborts on ranks that repeat (a file cut mid-line) with an exception that is not an
        # Exception (pyo3's PanicException), and takes ranks that stop short (a file cut at a line's end)
        if sorted(ranks.values()) != list(range(n_ranks)):
            raise ValueError(f"{ranks_file} does not hold the ranks 0..{n_ranks - 1} of vocab_size "
                             f"{meta['vocab_size']} (a damaged or truncated file)")
        enc = tiktoken.Encoding(name=meta["spec"], pat_str=meta["pattern"], special_tokens=meta["special_tokens"],
                                mergeable_ranks=ranks)
    return Tokenizer(meta["spec"], meta["kind"], meta["vocab_size"], meta["bos_id"], meta.get("chars"), enc)


def check_tokenizer_loads(data_dir, manifest):
    """Stop with one line unless data_dir's tokenizer files load, as sample.py will load a checkpoint's copy of
    them, and decode every id of the manifest's vocabulary."""
    try:
        load_tokenizer(data_dir).decode_bytes(np.arange(manifest["vocab_size"]))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        fail(f"the tokenizer files of {data_dir} ({', '.join(manifest['tokenizer_files'])}) do not load "
             f"({first_line(e)}): the data is damaged; rebuild it with python prepare.py --data_dir={data_dir} --force")
