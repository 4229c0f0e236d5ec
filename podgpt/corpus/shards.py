"""The write side of the shard format that data.py reads: a shard, the index of where each of its
documents starts and, for SFT data, its loss mask, each file written whole or not at all."""

import hashlib
import io
import os

import numpy as np

from podgpt.core.data import HEADER_INTS, MAGIC, VERSION, docs_file, mask_file, token_dtype


def write_shard(path, tokens, vocab_size, bos_id, doc_starts, mask=None):
    """Write a shard, its .docs.npy index and (SFT data) its loss mask; returns the sha256 of the
    .bin."""
    if not path.endswith(".bin"):
        raise ValueError(f"{path}: shard files end in .bin")
    tokens, doc_starts = np.asarray(tokens), np.asarray(doc_starts, dtype=np.int64)
    whole_docs = (len(tokens) > 0 and len(doc_starts) > 0 and doc_starts[0] == 0
                  and doc_starts[-1] < len(tokens) and np.all(np.diff(doc_starts) > 0)
                  and np.all(tokens[doc_starts] == bos_id))
    if not whole_docs:
        raise ValueError(f"{path}: a shard holds whole documents, each starting with "
                         f"bos_id={bos_id}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size})")
    tokens = tokens.astype(token_dtype(vocab_size), copy=False)
    header = np.zeros(HEADER_INTS, dtype="<i8")
    header[:7] = [MAGIC, VERSION, tokens.itemsize, len(tokens), vocab_size, len(doc_starts), bos_id]
    digest = hashlib.sha256()
    with open(path + ".tmp", "wb") as f:
        for block in (header, np.ascontiguousarray(tokens)):
            f.write(block)
            digest.update(block)
    os.replace(path + ".tmp", path)
    save_npy(path + ".docs.tmp", doc_starts)
    os.replace(path + ".docs.tmp", docs_file(path))
    if mask is not None:
        save_npy(path + ".mask.tmp", np.asarray(mask, dtype=np.uint8))
        os.replace(path + ".mask.tmp", mask_file(path))
    return digest.hexdigest()


def save_npy(path, array):
    """np.save through bytes: numpy's own file writer turns a Ctrl-C that lands inside it into a
    TypeError, a traceback where prepare.py owes one line."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
