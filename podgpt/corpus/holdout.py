"""
The validation hold-out: the documents with the smallest hashes, and, when those a val_fraction gives hold fewer
than min_val_tokens tokens, the next smallest, found after tokenizing. Holding those out then takes no second
tokenizing pass: the documents are read back from the shards just written, in corpus order (a Ledger remembers
where each went), and written again split at the new threshold. A bpe:N tokenizer, trained on training documents
alone, is trained without any document that may be held out so (bpe_reserve): it is trained once, and the corpus
tokenized once. prepare.py does the tokenizing and writing.
"""

import array
import hashlib
import heapq

from podgpt.core.data import shard_documents, token_hash
from podgpt.core.tokenizer import BPE_PATTERN, SEGMENT
from podgpt.core.util import fail

FORCED = (None, "train", "val")  # a document's source split (None: the hash's), as a Ledger stores it


def doc_hash(data):
    """A document's place in the split, from its UTF-8 bytes alone: uniform in [0, 2**64), so the
    documents below a threshold are a share of them, and duplicates land together."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def bpe_training_texts(docs, threshold, max_chars):
    """The texts of the training documents, (text, source split) in docs with a hash at or above
    threshold (none that may be held out), cut off after max_chars characters; segments apart."""
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
    """A document's fewest tokens under bpe:N, before its merges are known (bpe_reserve's bound):
    the segments' lengths, or BOS and one token for each piece BPE_PATTERN cuts the text into (the
    encoder merges within a piece, never across; the regex module's pieces are tiktoken's wherever
    their Unicode tables agree on a letter or a digit)."""
    if lengths:
        return lambda text: sum(lengths)
    import regex  # tiktoken's own dependency

    pieces = regex.compile(BPE_PATTERN)
    return lambda text: 1 + sum(1 for _ in pieces.finditer(text))


class SmallestHashes:
    """The documents with the smallest hashes that together hold at least min_tokens tokens, kept in a
    heap as the documents stream past: memory grows with min_tokens, not with the corpus."""

    def __init__(self, min_tokens):
        self.min_tokens, self.tokens = min_tokens, 0
        self.heap = []  # (-hash, n_tokens): the largest hash on top

    def wants(self, h):
        """Whether a document of hash h would be kept: not while enough are, with smaller hashes."""
        return self.tokens < self.min_tokens or bool(self.heap) and h < -self.heap[0][0]

    def add(self, h, n_tokens):
        if not self.wants(h):
            return
        heapq.heappush(self.heap, (-h, n_tokens))
        self.tokens += n_tokens
        while self.tokens - self.heap[0][1] >= self.min_tokens:  # enough without the largest
            self.tokens -= heapq.heappop(self.heap)[1]

    def threshold(self):
        """The smallest threshold whose documents (hash below it) hold min_tokens tokens; None if all hold fewer."""
        return -self.heap[0][0] + 1 if self.tokens >= self.min_tokens else None


def bpe_reserve(docs, threshold, min_tokens, least_tokens):
    """The hash below which bpe:N must not train: `threshold` (val_fraction's), or higher where the documents below
    it may hold fewer than min_tokens tokens, so that those held out after tokenizing were never in its training.
    docs: (hash, source split, text) of every document but the training split's; least_tokens(text): a bound from
    below on a document's tokens, known before the tokenizer is (the documents below the result hold at least
    min_tokens of them, so more than SmallestHashes finds on the tokens themselves). Reads the corpus only until the
    documents below `threshold` surely hold min_tokens: the first few hundred MB of a big one."""
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
    """What write_shards knew of each document, in corpus order (hash, bytes, split, source split, cut, eval rows
    found), 17 bytes apiece, kept only while validation holds fewer than min_tokens tokens: a corpus big enough
    not to need more held out drops it early."""

    def __init__(self, min_tokens):
        self.min_tokens, self.open = min_tokens, True
        self.hashes, self.n_bytes, self.flags = array.array("Q"), array.array("Q"), array.array("B")
        self.rows = {}  # document number -> the eval rows it holds a gram of, where any

    def add(self, h, n_bytes, name, forced, cut, rows, val_tokens):
        if self.open and val_tokens >= self.min_tokens:  # validation is big enough: never replayed
            self.open = False
            self.hashes, self.n_bytes, self.flags, self.rows = None, None, None, {}
        if not self.open:
            return
        if rows:
            self.rows[len(self.hashes)] = rows
        self.hashes.append(h)
        self.n_bytes.append(n_bytes)
        self.flags.append((name == "val") | cut << 1 | FORCED.index(forced) << 2)

    def replay(self, folder, splits):
        """The tuples encode_all gave for each document, again, in order: the tokens (and loss masks) read back
        from the shards of `splits` in folder."""
        readers = {name: shard_documents(folder, splits[name]["shards"]) for name in splits}
        for i, (h, n_bytes, flags) in enumerate(zip(self.hashes, self.n_bytes, self.flags, strict=True)):
            tokens, mask = next(readers["val" if flags & 1 else "train"])
            yield (h, n_bytes, tokens, FORCED[flags >> 2], bool(flags & 2), mask, self.rows.get(i, ()),
                   token_hash(tokens))

