"""
The read side of prepared data (prepare.py writes it): the shard and manifest format, the Loader
that turns shards into batches, the fingerprints that tie a checkpoint to its data and tokenizer,
and the unigram baseline a model's loss is measured against.

A shard is a 128-int64 little-endian header (magic, version, token itemsize, tokens, vocab_size,
documents, bos_id), then the tokens; NAME.docs.npy beside it holds the offset at which each
document (a BOS token, then its text) starts. SFT data (prepare.py --chat=True) also has
NAME.mask.npy, a uint8 per token: 1 where the loss counts the token (the assistant's reply).
"""

import hashlib
import json
import math
import os
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from podgpt.core.util import IGNORE, fail, first_line

MAGIC = 20240520  # first int64 of every shard
VERSION = 1  # shard and manifest format version
HEADER_INTS = 128
HEADER_BYTES = HEADER_INTS * 8


def token_dtype(vocab_size):
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def docs_file(shard_file):
    """train_000000.bin -> train_000000.docs.npy."""
    return shard_file[: -len(".bin")] + ".docs.npy"


def mask_file(shard_file):
    """train_000000.bin -> train_000000.mask.npy."""
    return shard_file[: -len(".bin")] + ".mask.npy"


def read_header(path):
    """The validated header of a shard as a dict; ValueError saying what is wrong."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: truncated shard ({size} bytes, shorter than its {HEADER_BYTES}-"
                         f"byte header)")
    header = np.fromfile(path, dtype="<i8", count=HEADER_INTS)
    magic, version, itemsize, n_tokens, vocab_size, n_docs, bos_id = (int(x) for x in header[:7])
    if magic != MAGIC:
        raise ValueError(f"{path}: not a podgpt shard (bad magic {magic}, expected {MAGIC})")
    if version != VERSION:
        raise ValueError(f"{path}: unsupported shard version {version} (this code reads "
                         f"{VERSION}): rebuild it with this prepare.py --force")
    if itemsize != token_dtype(vocab_size).itemsize:
        raise ValueError(f"{path}: token itemsize {itemsize} does not fit vocab_size {vocab_size}")
    if size != HEADER_BYTES + n_tokens * itemsize:
        raise ValueError(f"{path}: {size} bytes, but its header promises "
                         f"{HEADER_BYTES + n_tokens * itemsize} (truncated or corrupt): rebuild "
                         "with prepare.py --force")
    return {"version": version, "dtype": token_dtype(vocab_size), "n_tokens": n_tokens,
            "vocab_size": vocab_size, "n_docs": n_docs, "bos_id": bos_id}


def open_shard(path):
    """The tokens of a shard, memory-mapped read-only, its header checked."""
    header = read_header(path)
    return np.memmap(path, dtype=header["dtype"], mode="r", offset=HEADER_BYTES,
                     shape=(header["n_tokens"],))


def load_manifest(data_dir):
    """manifest.json of a prepared data_dir; ValueError with the fix when missing or unreadable."""
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.isfile(path):
        raise ValueError(f"no manifest.json in {data_dir}: run python prepare.py "
                         f"--data_dir={data_dir}")
    rerun = f"rerun python prepare.py --data_dir={data_dir} --force"
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}): {rerun}")
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != VERSION:
        raise ValueError(f"{path} has format_version {version}, this code reads {VERSION}: {rerun}")
    problem = manifest_problem(manifest)
    if problem:
        raise ValueError(f"{path} {problem}: {rerun}")
    return manifest


# what the scripts read from a manifest, and each one's type (a hand-edited one can be anything)
MANIFEST_FIELDS = {"tokenizer": str, "vocab_size": int, "bos_id": int, "token_dtype": str,
                   "tokenizer_files": list, "splits": dict, "token_counts": str,
                   "fingerprint": str}
SHARD_FIELDS = {"file": str, "docs_file": str, "tokens": int, "docs": int}
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              dict: "object", type(None): "null"}


def manifest_problem(manifest):
    """What is wrong in a manifest's fields (as "has ..."), or None."""
    def wrong(value, kind):
        return not isinstance(value, kind) or kind is int and isinstance(value, bool)

    for key, kind in MANIFEST_FIELDS.items():
        if key not in manifest:
            return f"has no {key!r}"
        if wrong(manifest[key], kind):
            return (f"has {key}={json.dumps(manifest[key])}, a JSON "
                    f"{JSON_TYPES[type(manifest[key])]} where "
                    f"{'an' if kind is int or kind is dict else 'a'} {JSON_TYPES[kind]} belongs")
    vocab, bos = manifest["vocab_size"], manifest["bos_id"]
    if not 0 <= bos < vocab:
        return f"has bos_id={bos}, outside the vocabulary [0, {vocab})"
    for name in ("train", "val"):
        split = manifest["splits"].get(name)
        if not isinstance(split, dict) or not isinstance(split.get("shards"), list) or wrong(
                split.get("tokens"), int):
            return f"has no {name} split (a \"shards\" list and a \"tokens\" count)"
        if any(not isinstance(s, dict) or any(wrong(s.get(k), t) for k, t in SHARD_FIELDS.items())
               for s in split["shards"]):
            return f"lists a {name} shard without its {', '.join(SHARD_FIELDS)}"
        in_shards = sum(s["tokens"] for s in split["shards"])
        if in_shards != split["tokens"]:
            return f"counts {split['tokens']:,} {name} tokens, but its {name} shards {in_shards:,}"
    return None


def check_prepared(data_dir, manifest, vocab_size):
    """Stop when data_dir lacks a file its manifest lists, its tokenizer or counts do not load, or
    it holds tokens a model of vocab_size (None: the data's) cannot embed. Loader checks shards."""
    for name in manifest["tokenizer_files"] + [manifest["token_counts"]]:
        if not os.path.isfile(os.path.join(data_dir, name)):
            fail(f"{data_dir} has no {name}, which its manifest.json lists: rebuild the data with "
                 f"prepare.py --force")
    check_tokenizer(data_dir, manifest)
    check_counts(data_dir, manifest)
    if vocab_size is not None and vocab_size < manifest["vocab_size"]:
        fail(f"vocab_size={vocab_size} but {data_dir} was tokenized with {manifest['tokenizer']} "
             f"({manifest['vocab_size']} tokens): set vocab_size=None or prepare matching data")


def check_tokenizer(data_dir, manifest):
    """Stop unless tokenizer.json reads back as the manifest's tokenizer (checkpoints carry it)."""
    path = os.path.join(data_dir, "tokenizer.json")
    fix = f"the data is damaged; rebuild it with python prepare.py --data_dir={data_dir} --force"
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path} does not load ({first_line(e)}): {fix}")
    listed = {"vocab_size": manifest["vocab_size"], "bos_id": manifest["bos_id"]}
    if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in listed.items()):
        fail(f"{path} is not the tokenizer of manifest.json "
             f"({', '.join(f'{k} {v}' for k, v in listed.items())}): {fix}")


def check_counts(data_dir, manifest):
    """Stop unless the unigram counts load as int64[vocab_size]: unigram_baseline reads them at
    the run's end, after every step is paid for."""
    path, vocab = os.path.join(data_dir, manifest["token_counts"]), manifest["vocab_size"]
    try:
        counts = np.load(path)
    except (OSError, ValueError, EOFError):  # what np.load raises for a file that is not a .npy
        counts = None
    if not isinstance(counts, np.ndarray):
        problem = "does not load as a .npy array"
    elif counts.dtype != np.int64 or counts.shape != (vocab,):
        problem = f"holds {counts.dtype}{list(counts.shape)}"
    elif counts.min() < 0:
        problem = "holds negative counts"
    else:
        return
    fail(f"{path} {problem}, not the int64[{vocab}] unigram counts of manifest.json: the data is "
         f"damaged; rebuild it with python prepare.py --data_dir={data_dir} --force")


def token_hash(tokens):
    """A document's 64-bit hash: blake2b of its tokens' bytes in the shard's dtype."""
    digest = hashlib.blake2b(np.ascontiguousarray(tokens), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_documents(data_dir, shards):
    """(tokens, loss mask or None) of each document of these shards in order, memory-mapped."""
    for shard in shards:
        path = os.path.join(data_dir, shard["file"])
        tokens, starts = open_shard(path), np.load(docs_file(path), mmap_mode="r")
        mask = open_mask(data_dir, shard, False)
        for a, b in zip(starts, [*starts[1:], len(tokens)], strict=True):
            yield tokens[a:b], None if mask is None else mask[a:b]


def document_hashes(data_dir, split):
    return (token_hash(tokens) for tokens, _ in shard_documents(data_dir, split["shards"]))


def shared_documents(train_hashes, val_hashes):
    """(training documents that are also validation documents, validation documents), by hash."""
    val = set(val_hashes)
    return sum(h in val for h in train_hashes), len(val_hashes)


def contamination(data_dir, manifest):
    """shared_documents of the data: the manifest's "contamination" (prepare.py counts it as it
    writes), or for an older manifest, by hashing the whole corpus."""
    if "contamination" in manifest:
        return (manifest["contamination"]["train_docs_in_val"],
                manifest["contamination"]["val_documents"])
    splits = manifest["splits"]
    return shared_documents(document_hashes(data_dir, splits["train"]),
                            list(document_hashes(data_dir, splits["val"])))


def tokenizer_fingerprint(data_dir, manifest):
    """CRC32s of the tokenizer files: two bpe:N tokenizers of different corpora differ here."""
    crcs = (f"{zlib.crc32(Path(data_dir, name).read_bytes()):08x}"
            for name in manifest["tokenizer_files"])
    return f"{manifest['tokenizer']}:{'.'.join(crcs)}"


def unigram_baseline(data_dir, manifest, val):
    """Loss (nats/token) of predicting each validation token the loss counts from the training
    tokens' add-one smoothed unigram frequencies: what a model that ignores context gets."""
    counts = np.load(os.path.join(data_dir, manifest["token_counts"])).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    val_counts = sum(np.bincount(np.asarray(s), None if m is None else np.asarray(m),
                                 minlength=len(counts))
                     for s, m in zip(val.shards, val.masks, strict=True))
    return float(-(val_counts * log_p).sum() / val_counts.sum())


# -----------------------------------------------------------------------------
# batches

def bpb_scale(split):
    """Bits per byte per nat per token of a manifest split: its counted tokens (SFT: the replies')
    over its bytes, over ln 2."""
    return split.get("loss_tokens", split["tokens"]) / split["bytes"] / math.log(2)


class Loader:
    """Windows of block_size+1 tokens (input and shifted target) over a split's shards; with draws
    (an objective that makes its own targets), block_size tokens and draws(seed, keys, block_size).
    Window i of a shard starts at token i*block_size. Training's sample k is window
    order(k // n)[k % n], a seeded permutation per epoch, so the loader's whole state is k;
    validation reads windows 0, 1, 2, ..."""

    def __init__(self, data_dir, split, manifest, block_size, seed, draws=None):
        self.block_size, self.seed, self.draws = block_size, seed, draws
        self.span = block_size if draws else block_size + 1  # tokens a window reads
        self.data_dir, self.vocab_size = data_dir, manifest["vocab_size"]
        shards = manifest["splits"][split]["shards"]
        self.paths = [os.path.join(data_dir, s["file"]) for s in shards]
        self.shards, self.masks = [], []
        for s, path in zip(shards, self.paths, strict=True):
            try:
                header = read_header(path)
                for key, listed in (("vocab_size", manifest["vocab_size"]),
                                    ("bos_id", manifest["bos_id"]), ("n_tokens", s["tokens"])):
                    if header[key] != listed:
                        raise ValueError(f"{path}: {key} {header[key]} in its header, {listed} in "
                                         f"manifest.json")
                self.shards.append(open_shard(path))
                self.masks.append(open_mask(data_dir, s, bool(draws)))
            except ValueError as e:  # read_header's message names the shard, most also the fix
                fail(f"{e}" if "prepare.py" in str(e) else
                     f"{e}: rebuild the data with prepare.py --force")
            except OSError as e:
                fail(f"cannot read shard {path} ({first_line(e)}): rebuild the data with "
                     f"prepare.py --force")
        # SFT data: the targets outside the replies are IGNORE
        self.masked = any(m is not None for m in self.masks)
        counts = [max(0, (len(s) - self.span + block_size) // block_size) for s in self.shards]
        self.starts = np.cumsum([0] + counts)
        self.n = int(self.starts[-1])
        if self.n == 0:
            fail(f"the {split} split of {data_dir} has fewer than "
                 f"{'block_size' if draws else 'block_size+1'} = {self.span} tokens: lower "
                 f"block_size or prepare more data")

    @lru_cache(maxsize=1)  # an epoch's permutation, made once: the epochs come in order
    def order(self, epoch):
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def locate(self, i):
        """(shard, first token) of window i."""
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        return s, int(i - self.starts[s]) * self.block_size

    def window(self, i):
        s, start = self.locate(i)
        return self.shards[s][start:start + self.span]

    def window_mask(self, i):
        """The loss mask of window i: its shard's, or all ones (pretraining data)."""
        s, start = self.locate(i)
        mask = self.masks[s]
        return np.ones(self.span, dtype=np.uint8) if mask is None else mask[start:start + self.span]

    def batch(self, windows, device, keys=None):
        """The windows' (inputs, targets); with draws (tokens, their draws) of `keys` (training's
        sample numbers; None: the windows', as validation reads them)."""
        rows = np.stack([self.window(int(i)) for i in windows])
        # a damaged shard's id past the vocabulary would index past the embedding (on a GPU, a
        # device-side assert that kills the process): checked here, for a max over the batch
        if rows.max() >= self.vocab_size:
            row, col = divmod(int(np.argmax(rows >= self.vocab_size)), rows.shape[1])
            s, start = self.locate(int(windows[row]))
            fail(f"{self.paths[s]}: token {start + col:,} is id {rows[row, col]}, outside the "
                 f"vocabulary [0, {self.vocab_size}) of manifest.json: the shard is damaged "
                 f"(manifest.json lists its sha256 to check it against): rebuild the data with "
                 f"python prepare.py --data_dir={self.data_dir} --force")
        if not self.draws:
            mask = np.stack([self.window_mask(int(i)) for i in windows]) if self.masked else None
            return to_device(rows, device, mask=mask)
        return to_device(rows, device, self.draws([self.seed, 0 if keys is None else 1],
                                                  windows if keys is None else keys,
                                                  self.block_size))

    def validation_sums(self, model, steps, size, rank, world, device):
        """This rank's sums over `steps` micro-batches of `size` windows (micro-batch i of rank r
        starts at window (i * world + r) * size), float64, kept on the device (no sync per batch):
        the loss over the targets it counts, the objective's stats if any, the targets counted."""
        total = torch.zeros((), device=device, dtype=torch.float64)
        for i in range(steps):
            first = ((i * world + rank) * size) % self.n
            x, y = self.batch((np.arange(size) + first) % self.n, device)
            loss, *stats = model(x, y)[1:]
            n = (y != IGNORE).sum().double()
            total = total + torch.cat([loss.reshape(1).double() * n,
                                       *(s.double() for s in stats), n.reshape(1)])
        return total

    def train_window(self, k):
        return int(self.order(k // self.n)[k % self.n])

    def train_batch(self, first_sample, size, device):
        samples = np.arange(first_sample, first_sample + size)
        return self.batch([self.train_window(k) for k in samples], device, samples)

    def train_targets(self, first_sample, size):
        """The targets train_batch(first_sample, size) counts (not IGNORE), from the masks alone."""
        masks = np.stack([self.window_mask(self.train_window(k))
                          for k in range(first_sample, first_sample + size)])
        return int(np.count_nonzero(masks[:, 1:]))

    def sources(self, samples):
        """Where training samples come from: each one's window, shard file, first token in that
        shard, and the document (its index in the shard's docs.npy) that token belongs to."""
        starts, found = {}, []
        for k in samples:
            w = self.train_window(k)
            s, token = self.locate(w)
            if s not in starts:
                starts[s] = np.load(docs_file(self.paths[s]), mmap_mode="r")
            found.append(dict(sample=int(k), window=w, shard=os.path.basename(self.paths[s]),
                              token=token,
                              doc=int(np.searchsorted(starts[s], token, side="right")) - 1))
        return found


def open_mask(data_dir, shard, own_targets):
    """The loss mask the manifest lists beside a shard, memory-mapped, or None (pretraining data);
    ValueError when it does not fit the shard, or the objective makes its own targets."""
    if "mask_file" not in shard:
        return None
    if own_targets:
        raise ValueError(f"{shard['file']} is SFT data (a loss mask beside it): this objective "
                         "makes its own targets and cannot train on it")
    path = os.path.join(data_dir, shard["mask_file"])
    mask = np.load(path, mmap_mode="r")
    if mask.dtype != np.uint8 or mask.shape != (shard["tokens"],):
        raise ValueError(f"{path}: holds {mask.dtype}{list(mask.shape)}, not the "
                         f"uint8[{shard['tokens']}] loss mask of its shard")
    return mask


def to_device(rows, device, draws=None, mask=None):
    """(inputs, targets) from rows of block_size+1 tokens, a target whose mask is 0 set to IGNORE;
    with draws, (rows, draws)."""
    if mask is not None:
        rows = rows.astype(np.int64)  # IGNORE is negative
        targets = np.where(mask[:, 1:] != 0, rows[:, 1:], IGNORE)
        return move(rows[:, :-1], device), move(targets, device)
    rows = move(rows, device)
    return (rows[:, :-1], rows[:, 1:]) if draws is None else (rows, move(draws, device))


def move(array, device):
    """A numpy array on device (tokens as int64), through page-locked memory to a GPU."""
    t = torch.from_numpy(array if array.dtype == np.float32 else array.astype(np.int64, copy=False))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def rare_token_batch(rare, size, block_size, seed, device, draws=None):
    """A batch drawn uniformly from the rarest training tokens: a loss spike on demand (the 50M
    A100 run's drill); with draws (Loader's), rows of block_size tokens and their draws."""
    rows = np.random.default_rng(seed).choice(rare, size=(size, block_size + (draws is None)))
    return to_device(rows, device, None if draws is None else draws(seed, range(size), block_size))


def rarest_tokens(counts):
    """The rarest 1% of the token kinds that occur in training (at least 16 kinds)."""
    seen = np.flatnonzero(counts)
    return seen[np.argsort(counts[seen], kind="stable")][:max(16, len(seen) // 100)]
