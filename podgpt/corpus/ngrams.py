"""A skills pack's eval rows as hashed word n-grams, and the rows a batch of documents holds: the
one definition of an overlap with an eval row, for the corpus (prepare.py's eval_contamination) and
for a pack's SFT rows (skills.py). Words are the lowercased text split at ASCII whitespace; an eval
row's prompt and its reply (tokenizer.reply_text) are each checked by their NGRAM-word windows, or
whole with fewer words but at least MIN_WORDS (a shorter text, a bare number, may match by chance).
A word is a polynomial hash of its bytes and a gram one of its words, both mod 2^64, in numpy."""

import functools
import os

import numpy as np

from podgpt.core.owned import file_sha256
from podgpt.corpus.tasks import read_rows
from podgpt.core.tokenizer import reply_text

NGRAM = 13       # words in a row that count as an overlap (the usual decontamination length)
MIN_WORDS = 5    # a shorter prompt or reply is not checked: its words alone occur by chance
WHITESPACE = np.zeros(256, dtype=bool)
WHITESPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True  # the ASCII str.split() splits at
BYTE_BASE, WORD_BASE = 0x100000001B3, 0x9E3779B97F4A7C15  # odd, so invertible mod 2^64
TABLE = 1 << 22  # slots of the first look-up (a few eval rows' grams fill a tiny share of them)
POWERS = {}  # base -> base^0, base^1, ... mod 2^64, as long as asked so far


def powers(base, n):
    """base^0 .. base^(n-1) mod 2^64 (numpy's uint64 products wrap), kept for the next batch."""
    if len(POWERS.get(base, ())) < n:
        out = np.full(max(n, 1 << 20), base, dtype=np.uint64)
        out[:1] = 1
        POWERS[base] = np.cumprod(out)
    return POWERS[base][:n]


class Rolling:
    """Polynomial hashes of the runs of `values`: of values[s:e], sum values[s + k] * base^k."""

    def __init__(self, values, base):
        self.prefix = np.zeros(len(values) + 1, dtype=np.uint64)
        np.cumsum(values * powers(base, len(values)), out=self.prefix[1:])
        self.inverse = powers(pow(base, -1, 1 << 64), len(values) + 1)

    def __call__(self, starts, ends):
        return (self.prefix[ends] - self.prefix[starts]) * self.inverse[starts]


def word_hashes(data):
    """(each word's hash, its first byte, the byte after its last) of lowercased UTF-8 bytes."""
    b = np.frombuffer(data, dtype=np.uint8)
    edges = np.diff(np.concatenate(([True], WHITESPACE[b], [True])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == -1), np.flatnonzero(edges == 1)
    return Rolling(b.astype(np.uint64) + np.uint64(1), BYTE_BASE)(starts, ends), starts, ends


def gram_hashes(words, n, rolled=None):
    """The hash of each n-word window of words (word hashes), n mixed in; rolled: their Rolling,
    made once for every n."""
    starts = np.arange(max(len(words) - n + 1, 0))
    return (rolled or Rolling(words, WORD_BASE))(starts, starts + n) ^ np.uint64(n)


def text_grams(text):
    """(the grams a prompt or reply is checked by, their length in words): its NGRAM-word windows,
    itself whole when shorter, none below MIN_WORDS."""
    words = word_hashes(text.lower().encode("utf-8"))[0]
    n = min(NGRAM, len(words))
    return (gram_hashes(words, n) if n >= MIN_WORDS else np.zeros(0, np.uint64)), n


def shared_run(text, row):
    """The first run of words of text that is one of eval row `row`'s grams ("" if none): what a
    refusal quotes (EvalGrams says which row, not which words)."""
    data = text.lower().encode("utf-8")
    words, starts, ends = word_hashes(data)
    for part in (row["prompt"], reply_text(row)):
        grams, n = text_grams(part)
        if at := np.flatnonzero(np.isin(gram_hashes(words, n), grams)).tolist():
            return " ".join(data[starts[at[0]]:ends[at[0] + n - 1]].decode("utf-8").split())
    return ""


def read_eval_grams(path):
    """The EvalGrams of a pack's eval.jsonl (a bad row: one line naming it)."""
    return EvalGrams(read_rows(path)[0], file_sha256(path))


def eval_grams(pack_dir):
    """The EvalGrams of pack_dir's eval rows; None without a pack_dir, or, said, its eval.jsonl."""
    if not pack_dir:
        return None
    path = os.path.join(pack_dir, "eval.jsonl")
    if not os.path.isfile(path):
        print(f"pack_dir={pack_dir} has no eval.jsonl (make the pack first: skills.py): the corpus "
              "is not checked against its eval rows")
        return None
    return read_eval_grams(path)


def eval_record(pack_dir, grams, found):
    """manifest.json's eval_contamination: the training documents holding an eval row's gram
    (found, a Counter by 0-based row) by row number (1: the first)."""
    return {"pack_dir": pack_dir, "eval_sha256": grams.sha256, "ngram": NGRAM,
            "min_words": MIN_WORDS, "eval_rows": grams.rows, "rows_checked": grams.rows_checked,
            "rows_found": len(found),
            "train_docs_by_row": {str(row + 1): n for row, n in sorted(found.items())}}


class EvalGrams:
    """The grams of a pack's eval rows: keys (sorted hashes), owners (each one's 0-based row), the
    gram lengths to look for, rows_checked (rows with a gram) and the sha256 of their file (None:
    not from a file)."""

    def __init__(self, rows, sha256=None):
        found, lengths, self.sha256 = {}, set(), sha256
        for k, row in enumerate(rows):
            for text in (row["prompt"], reply_text(row)):
                grams, n = text_grams(text)
                lengths |= {n} if len(grams) else set()
                for h in grams.tolist():
                    found.setdefault(h, k)
        self.rows, self.rows_checked = len(rows), len(set(found.values()))
        self.lengths = sorted(lengths)
        self.keys = np.array(sorted(found), dtype=np.uint64)
        self.owners = np.array([found[h] for h in self.keys.tolist()], dtype=np.int64)

    @functools.cached_property
    def table(self):
        """The keys' low bits, looked up before the sorted keys are searched: few windows pass."""
        table = np.zeros(TABLE, dtype=bool)
        table[self.keys & np.uint64(TABLE - 1)] = True
        return table

    def __getstate__(self):  # to skills.py's pool workers without the table, rebuilt from the keys
        return {k: v for k, v in self.__dict__.items() if k != "table"}

    def hits(self, texts):
        """For each text, the sorted eval rows it holds a gram of (a tuple, mostly empty)."""
        parts = [t.lower().encode("utf-8") for t in texts]
        firsts = np.cumsum([0] + [len(p) + 1 for p in parts[:-1]])  # each text's first, joined
        words, starts, _ = word_hashes(b" ".join(parts))
        doc = np.searchsorted(firsts, starts, side="right") - 1
        found, rolled = [set() for _ in texts], Rolling(words, WORD_BASE)
        for n in self.lengths:
            grams = gram_hashes(words, n, rolled)
            maybe = np.flatnonzero(self.table[grams & np.uint64(TABLE - 1)])
            at = np.minimum(np.searchsorted(self.keys, grams[maybe]), len(self.keys) - 1)
            # the gram, and inside one text
            ok = (self.keys[at] == grams[maybe]) & (doc[maybe] == doc[maybe + n - 1])
            for d, row in zip(doc[maybe[ok]].tolist(), self.owners[at[ok]].tolist(), strict=True):
                found[d].add(row)
        return [tuple(sorted(s)) for s in found]
