"""The validation hold-out: the documents with the smallest hashes, and where val_fraction's hold
fewer than min_val_tokens tokens, the next smallest, found after tokenizing. Those are held out with
no second tokenizing pass: the documents are read back from the shards just written, in order (a
Ledger remembers where each went), and written again split at the new threshold. bpe:N trains
without any document that may be held out so (bpe_reserve): trained once, tokenizing once."""

import array
import hashlib
import heapq

from podgpt.core.data import shard_documents, token_hash
from podgpt.core.tokenizer import BPE_PATTERN, SEGMENT
from podgpt.core.util import fail

FORCED = (None, "train", "val")  # a document's source split (None: the hash's), in a Ledger


def doc_hash(data):
    """A document's place in the split, from its UTF-8 bytes alone: uniform in [0, 2**64), so the
    documents below a threshold are a share of them, and duplicates land together."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def bpe_training_texts(docs, threshold, max_chars):
    """The texts of the training documents of docs, (text, source split), at or above threshold,
    up to max_chars characters in all; segments apart."""
    n = 0
    for text, split in docs:
        if n >= max_chars:
            return
        in_training = split == "train" if split else doc_hash(text.encode("utf-8")) >= threshold
        if in_training:
            text = text.replace(SEGMENT, "\n")[: max_chars - n]
            n += len(text)
            yield text
    if n == 0:  # rustbpe would learn no merge, and say nothing
        fail("no training document for bpe:N to learn from: every one may be held out for "
             "validation (lower --min_val_tokens or --val_fraction, or add documents)")


def least_tokens(lengths):
    """A document's fewest tokens under bpe:N before its merges are known (bpe_reserve's bound): the
    segments' lengths, or BOS and one per piece BPE_PATTERN cuts the text into (merges never cross
    pieces; the regex module's are tiktoken's where their Unicode tables agree)."""
    if lengths:
        return lambda text: sum(lengths)
    import regex  # tiktoken's own dependency

    pieces = regex.compile(BPE_PATTERN)
    return lambda text: 1 + sum(1 for _ in pieces.finditer(text))


class SmallestHashes:
    """The documents with the smallest hashes that together hold min_tokens tokens, in a heap as
    they stream past: memory grows with min_tokens, not with the corpus."""

    def __init__(self, min_tokens):
        self.min_tokens, self.tokens = min_tokens, 0
        self.heap = []  # (-hash, n_tokens): the largest hash on top

    def wants(self, h):
        """Whether a document of hash h would be kept: not once enough with smaller ones are."""
        return self.tokens < self.min_tokens or bool(self.heap) and h < -self.heap[0][0]

    def add(self, h, n_tokens):
        if not self.wants(h):
            return
        heapq.heappush(self.heap, (-h, n_tokens))
        self.tokens += n_tokens
        while self.tokens - self.heap[0][1] >= self.min_tokens:  # enough without the largest
            self.tokens -= heapq.heappop(self.heap)[1]

    def threshold(self):
        """The least threshold below which the documents hold min_tokens; None if all hold fewer."""
        return -self.heap[0][0] + 1 if self.tokens >= self.min_tokens else None


def bpe_reserve(docs, threshold, min_tokens, least_tokens):
    """The hash below which bpe:N must not train: `threshold` (val_fraction's), or higher where the
    documents below it may hold fewer than min_tokens tokens, so none held out after tokenizing was
    trained on. docs: (hash, source split, text) of all but the train split's; least_tokens(text):
    a lower bound on its tokens. Reads only until the documents below `threshold` surely hold
    min_tokens: the first few hundred MB of a big corpus."""
    smallest, held = SmallestHashes(min_tokens), 0
    for h, split, text in docs:
        below = split == "val" or not split and h < threshold  # validation at `threshold`
        if below or not split and smallest.wants(h):
            n = least_tokens(text)
            held += n if below else 0
            if not split:
                smallest.add(h, n)
            if held >= min_tokens:
                return threshold
    reserve = smallest.threshold()  # above `threshold`: the documents below that are in `held`
    return 2**64 if reserve is None else reserve  # None: any of them may be held out


class Ledger:
    """What write_shards knew of each document in order (hash, bytes, split, source split, cut, eval
    rows found), 17 bytes apiece, kept only while validation holds fewer than min_tokens tokens."""

    def __init__(self, min_tokens):
        self.min_tokens = min_tokens
        self.hashes, self.n_bytes, self.flags = array.array("Q"), array.array("Q"), array.array("B")
        self.rows = {}  # document number -> the eval rows it holds a gram of, where any

    def add(self, h, n_bytes, name, forced, cut, rows, val_tokens):
        if val_tokens >= self.min_tokens:  # validation is big enough, and only grows: no replay
            self.hashes = self.n_bytes = self.flags = self.rows = None
            return
        if rows:
            self.rows[len(self.hashes)] = rows
        self.hashes.append(h)
        self.n_bytes.append(n_bytes)
        self.flags.append((name == "val") | cut << 1 | FORCED.index(forced) << 2)

    def replay(self, folder, splits):
        """The tuples encode_all gave for each document, again, in order: the tokens (and loss
        masks) read back from the shards of `splits` in folder."""
        readers = {name: shard_documents(folder, splits[name]["shards"]) for name in splits}
        rows = zip(self.hashes, self.n_bytes, self.flags, strict=True)
        for i, (h, n_bytes, flags) in enumerate(rows):
            tokens, mask = next(readers["val" if flags & 1 else "train"])
            yield (h, n_bytes, tokens, FORCED[flags >> 2], bool(flags & 2), mask,
                   self.rows.get(i, ()), token_hash(tokens))
