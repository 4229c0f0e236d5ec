"""The tokenizers: byte (the 256 UTF-8 bytes), char (the corpus' characters), gpt2 (tiktoken's
GPT-2 BPE) and bpe:N (trained with rustbpe, run with tiktoken). BOS is the base vocabulary's last
id; a document is stored as [BOS] + tokens. A chat tokenizer (SFT) appends CHAT_TOKENS after BOS,
so a base checkpoint's ids keep their meaning. prepare.py saves one into data_dir as tokenizer.json
plus, for gpt2 and bpe:N, tokenizer.tiktoken ("base64 rank" lines); loading needs no network."""

import base64
import itertools
import json
import os

import numpy as np

from podgpt.core.util import fail, first_line, write_atomic

GPT2_RANKS = 50256  # GPT-2's BPE ranks; <|endoftext|> = 50256 is its BOS
SEGMENT = "\x1e"  # between a document's segments, reader to tokenizer (ASCII's record separator)
CHAT_TOKENS = ("<|user|>", "<|assistant|>", "<|end|>")  # ids V, V+1, V+2 after a base vocabulary V
# bpe:N's split of text into pieces, which merges never cross (rustbpe's default, GPT-4's)
BPE_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")


class Tokenizer:
    """Text <-> token ids. kind "byte": ids 0-255 are the UTF-8 bytes; "char": ids index `chars`;
    "tiktoken": gpt2 or bpe:N. `chat` ({name: id} of CHAT_TOKENS) is empty for a base tokenizer."""

    def __init__(self, spec, kind, vocab_size, bos_id, chars=None, enc=None, chat=None):
        self.spec, self.kind, self.vocab_size, self.bos_id = spec, kind, vocab_size, bos_id
        self.chars, self.enc, self.chat = chars, enc, dict(chat or {})
        self.char_ids = {c: i for i, c in enumerate(chars or ())}

    def encode(self, text):
        """Token ids of text, without BOS; "<|endoftext|>" and the like are plain text."""
        if self.kind == "tiktoken":
            return self.enc.encode_ordinary(text)  # replaces lone surrogates; encode_to_numpy not
        return self.encode_array(text).tolist()

    def encode_array(self, text):
        """encode's ids as a numpy array (uint32, byte's uint8), which tiktoken fills with no Python
        list made and copied (prepare.py's workers)."""
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        if self.kind == "char":
            try:
                return np.array([self.char_ids[c] for c in text], dtype=np.uint32)
            except KeyError as e:
                raise ValueError(f"character {e.args[0]!r} is not in the vocabulary of this char "
                                 "tokenizer") from None
        # no special token allowed: their text is plain text, as encode_ordinary has it
        return self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode_bytes(self, ids):
        """The bytes of ids; BOS decodes to nothing, a chat token to its name."""
        ids = np.asarray(ids, dtype=np.int64)
        names = {i: name.encode("utf-8") for name, i in self.chat.items()}
        parts = []
        for chat, run in itertools.groupby(ids[ids != self.bos_id].tolist(), names.__contains__):
            parts += [names[i] for i in run] if chat else [self.decode_base(list(run))]
        return b"".join(parts)

    def decode_base(self, ids):
        """The bytes of base-vocabulary ids (no BOS, no chat token)."""
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
    """{token bytes: rank} from a tiktoken ranks file. Not tiktoken's load_tiktoken_bpe: it caches
    by path, so a rebuilt file at the same path would load stale."""
    with open(path, "rb") as f:
        pairs = [line.split() for line in f if line.strip()]
    return {base64.b64decode(token): int(rank) for token, rank in pairs}


def gpt2_ranks():
    """GPT-2's BPE ranks, from the file $PODGPT_GPT2_TIKTOKEN (offline) or through tiktoken."""
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
                 "PODGPT_GPT2_TIKTOKEN to a gpt2.tiktoken file (openai-whisper ships one) "
                 "or use bpe:N")
        ranks = {enc.decode_single_token_bytes(i): i for i in range(GPT2_RANKS)}
    if sorted(ranks.values()) != list(range(GPT2_RANKS)):
        fail(f"{path or 'tiktoken gpt2'}: expected GPT-2's {GPT2_RANKS} ranks, found {len(ranks)}")
    return ranks


def train_tokenizer(spec, texts, bpe_texts):
    """tokenizer.json's fields and, for tiktoken kinds, the BPE ranks. texts() streams every
    document's text (char: validation's too, so all of it encodes); bpe_texts() bpe:N's."""
    kind, n = parse_spec(spec)
    if kind == "byte":
        return {"kind": "byte", "vocab_size": 257}, None
    if kind == "char":
        chars = set()
        for text in texts():
            chars.update(text.replace(SEGMENT, ""))
        return {"kind": "char", "vocab_size": len(chars) + 1, "chars": sorted(chars)}, None
    if kind == "gpt2":
        from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's split pattern
        ranks, pattern, bos = gpt2_ranks(), r50k_pat_str, "<|endoftext|>"
    else:
        import rustbpe
        bpe = rustbpe.Tokenizer()
        # deterministic: merges ranked by count, ties by the pair's ids (a small corpus: fewer)
        bpe.train_from_iterator(bpe_texts(), n - 1, pattern=BPE_PATTERN)
        ranks = {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}
        pattern, bos = BPE_PATTERN, "<|bos|>"
    return {"kind": "tiktoken", "vocab_size": len(ranks) + 1, "pattern": pattern,
            "special_tokens": {bos: len(ranks)}}, ranks


def with_chat_tokens(meta):
    """tokenizer.json's fields with CHAT_TOKENS after every id (BOS stays the base's last id)."""
    if "chat_tokens" in meta:
        return meta
    v = meta["vocab_size"]
    return {**meta, "bos_id": v - 1, "vocab_size": v + len(CHAT_TOKENS),
            "chat_tokens": {name: v + i for i, name in enumerate(CHAT_TOKENS)}}


def chat_tokenizer(base):
    """(tokenizer.json's fields with the chat tokens, the ranks or None) of the tokenizer in `base`
    (a data_dir or checkpoint), for SFT data whose ids mean what they meant to the base model."""
    try:
        with open(os.path.join(base, "tokenizer.json"), encoding="utf-8") as f:
            meta = json.load(f)
        load_tokenizer(base)  # its files are whole
    except (OSError, ValueError, KeyError) as e:
        fail(f"chat_base={base}: no tokenizer there that loads ({first_line(e)}): name the base "
             "model's data_dir or checkpoint folder")
    ranks_file = os.path.join(base, "tokenizer.tiktoken")
    return with_chat_tokens(meta), read_ranks(ranks_file) if meta["kind"] == "tiktoken" else None


def save_tokenizer(out_dir, spec, meta, ranks):
    """Write tokenizer.json (+ tokenizer.tiktoken); returns the file names."""
    meta = {"spec": spec, "bos_id": meta["vocab_size"] - 1, **meta}
    write_atomic(os.path.join(out_dir, "tokenizer.json"), json.dumps(meta, indent=1) + "\n")
    if ranks is None:
        return ["tokenizer.json"]
    with open(os.path.join(out_dir, "tokenizer.tiktoken"), "wb") as f:
        f.writelines(b"%s %d\n" % (base64.b64encode(token), rank)
                     for token, rank in sorted(ranks.items(), key=lambda item: item[1]))
    return ["tokenizer.json", "tokenizer.tiktoken"]


def load_tokenizer(data_dir):
    """The Tokenizer saved in data_dir; never needs the network."""
    path = os.path.join(data_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"no tokenizer.json in {data_dir}: run python prepare.py "
                         f"--data_dir={data_dir}")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    enc = None
    if meta["kind"] == "tiktoken":
        import tiktoken
        ranks_file = os.path.join(data_dir, "tokenizer.tiktoken")
        specials = len(meta["special_tokens"]) + len(meta.get("chat_tokens", ()))
        n_ranks, ranks = meta["vocab_size"] - specials, read_ranks(ranks_file)
        # tiktoken aborts on repeated ranks (a file cut mid-line) with pyo3's PanicException, not an
        # Exception, and takes ranks that stop short (a file cut at a line's end)
        if sorted(ranks.values()) != list(range(n_ranks)):
            raise ValueError(f"{ranks_file} does not hold the ranks 0..{n_ranks - 1} of vocab_size "
                             f"{meta['vocab_size']} (a damaged or truncated file)")
        enc = tiktoken.Encoding(name=meta["spec"], pat_str=meta["pattern"],
                                special_tokens=meta["special_tokens"], mergeable_ranks=ranks)
    return Tokenizer(meta["spec"], meta["kind"], meta["vocab_size"], meta["bos_id"],
                     meta.get("chars"), enc, meta.get("chat_tokens"))


def check_tokenizer_loads(data_dir, manifest):
    """Stop with one line unless data_dir's tokenizer files load (as sample.py will a checkpoint's
    copy) and decode every id of the manifest's vocabulary."""
    try:
        load_tokenizer(data_dir).decode_bytes(np.arange(manifest["vocab_size"]))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        fail(f"the tokenizer files of {data_dir} ({', '.join(manifest['tokenizer_files'])}) do not "
             f"load ({first_line(e)}): the data is damaged; rebuild it with python prepare.py "
             f"--data_dir={data_dir} --force")


def has_chat(tok):
    """Whether tok is a chat tokenizer (an SFT model's): it has every one of CHAT_TOKENS."""
    return set(tok.chat) == set(CHAT_TOKENS)


def chat_ids(tok):
    """{name: id} of CHAT_TOKENS for a tokenizer that has them."""
    if not has_chat(tok):
        raise ValueError(f"the {tok.spec} tokenizer has no chat tokens {', '.join(CHAT_TOKENS)}: "
                         "make the SFT data with prepare.py --chat=True")
    return tok.chat


def chat_prompt(tok, prompt):
    """A generation prompt: BOS <|user|> prompt <|end|> <|assistant|>."""
    ids = chat_ids(tok)
    return [tok.bos_id, ids["<|user|>"], *tok.encode(prompt), ids["<|end|>"], ids["<|assistant|>"]]


def chat_row(tok, prompt, reply):
    """(ids, loss mask) of a training row: the chat prompt, then reply <|end|>, the loss's alone."""
    head = chat_prompt(tok, prompt)
    tail = tok.encode(reply) + [chat_ids(tok)["<|end|>"]]
    return head + tail, [0] * len(head) + [1] * len(tail)


def reply_text(row):
    """The assistant's reply to a skills-pack row: the answer, after its scratchpad if any."""
    if row["answer_style"] == "direct":
        return row["answer"]
    if row["answer_style"] == "scratchpad":
        return row["scratchpad"] + "\n" + row["answer"]
    raise ValueError(f"answer_style {row['answer_style']!r}: expected 'direct' or 'scratchpad'")
