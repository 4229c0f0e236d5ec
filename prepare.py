"""
Prepare training data: text sources -> tokenizer -> token shards + manifest.json.

    python prepare.py                                   # the local Python stdlib, byte tokenizer
    python prepare.py --source=tinyshakespeare --tokenizer=char --data_dir=data/shakespeare
    python prepare.py --source=fineweb-edu-10bt --max_shards=2 --tokenizer=gpt2 --data_dir=data/fwe
    python prepare.py --source=corpus/,more.jsonl --tokenizer=bpe:8192 --data_dir=data/mine

The tokenizer and shards are built in data_dir/.podgpt-prepare and moved into place when complete,
manifest.json last, into a data_dir that holds nothing but prepare.py's own files (the format:
docs/data-format.md; segments and gsm8k_format: docs/objectives.md). Validation is whole documents,
those with the smallest hashes (holdout.py): the split depends on the set of documents alone, the
same for any number of workers, and duplicate documents land in the same split.
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import array
import collections
import contextlib
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time

import numpy as np

from podgpt.core import configurator
from podgpt.core.data import (HEADER_BYTES, VERSION, docs_file, load_manifest, mask_file,
                              shared_documents, token_dtype, token_hash)
from podgpt.core.tokenizer import (SEGMENT, chat_row, chat_tokenizer, load_tokenizer, parse_spec,
                                   save_tokenizer, train_tokenizer)
from podgpt.core.util import (check_apart, disk_full, fail, first_line, in_use, make_folders,
                              make_scratch, remove_empty, remove_scratch, run_main, signals_held,
                              write_atomic)
from podgpt.corpus.download import local_copy
from podgpt.corpus.holdout import (Ledger, SmallestHashes, bpe_reserve, bpe_training_texts,
                                   doc_hash, least_tokens)
from podgpt.corpus.ngrams import eval_grams, eval_record
from podgpt.corpus.shards import save_npy, write_shard
from podgpt.corpus.sources import GSM8K_FORMATS, documents, is_url, resolve_sources

# --- config
source = "stdlib"  # stdlib | file or folder | http(s) URL | preset name; comma-separated: several
data_dir = "data/default"  # output folder: shards, manifest, tokenizer (one folder per dataset)
tokenizer = "byte"  # gpt2 | byte | char | bpe:N
text_field = "text"  # field of .jsonl lines / column of .parquet files
val_fraction = 0.005  # fraction of documents held out for validation (whole documents); 0: none
min_val_tokens = 100_000  # with val_fraction > 0, at least this many: fewer make a noisy loss
max_docs = 0  # stop after this many documents (0: all)
max_shards = 0  # for presets: download only the first N files (0: all)
min_chars = 0  # drop documents shorter than this many characters
split_paragraphs = False  # .txt/.md/.py: a document per blank-line separated paragraph, not file
gsm8k_format = "qa"  # gsm8k preset: qa (Question/Answer) | hdp (question, plan, execution: 3 parts)
segments = ""  # token lengths each document is padded or cut to ("512", "128,128,256"); "": as is
shard_tokens = 100_000_000  # target tokens per shard file
workers = 0  # tokenizer processes (0: all cores)
download_dir = "downloads"  # URL downloads (the hub's: its cache, HF_HOME); never inside data_dir
sha256 = ""  # expected sha256 of a single-URL source (checked after download)
bpe_train_chars = 2_000_000_000  # at most this many characters of training documents train bpe:N
chat = False  # SFT data: source is a skills pack's sft.jsonl, the loss on each reply alone
chat_base = ""  # with chat: the base model's data_dir or checkpoint folder, whose tokenizer is used
pack_dir = ""  # a skills pack: count the training documents holding one of its eval rows
force = False  # rebuild even if data_dir already holds this exact result
# --- end config

# the config keys that determine the output (data_dir, download_dir, workers, force do not)
OUTPUT_KEYS = ("source", "tokenizer", "text_field", "val_fraction", "min_val_tokens", "max_docs",
               "max_shards", "min_chars", "split_paragraphs", "shard_tokens", "sha256",
               "bpe_train_chars")
# output keys added since: in prepare_args only when set, so older data is still this exact result
LATER_KEYS = {"gsm8k_format": "qa", "segments": "", "chat": False, "chat_base": ""}

BATCH_CHARS = 1 << 20  # characters of text sent to a tokenizer process at once

SCRATCH = ".podgpt-prepare"  # the build's folder inside data_dir: a name no user picks, renames
MANIFEST = "manifest.json"
# prepare.py's mark on a data_dir it built (fixed text: identical builds stay identical): files
# named as its own below are its own to replace only beside it (or a podgpt manifest that reads)
DATA_MARK = ".podgpt-data"
# the other files prepare.py writes into data_dir, and write_shard's temporary ones (a crash may
# leave one): with manifest.json and SCRATCH, all a data_dir may hold for prepare.py to rebuild it
OWN_FILE = re.compile(r"(train|val)_\d{6,}\.(bin|docs\.npy|mask\.npy|bin\.tmp|bin\.(docs|mask)"
                      r"\.tmp)|tokenizer\.json|tokenizer\.tiktoken|train_counts\.npy")


# -----------------------------------------------------------------------------
# Tokenizing in worker processes, writing shards

worker_tok = worker_lengths = worker_chat = worker_grams = None  # each worker's, set by init_worker


def init_worker(tok_dir, lengths, chat, grams):
    global worker_tok, worker_lengths, worker_chat, worker_grams
    # Ctrl-C reaches the terminal's whole process group: the parent alone stops, with one line
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_tok = load_tokenizer(tok_dir)  # from the files: nothing pickled
    worker_lengths, worker_chat, worker_grams = lengths, chat, grams


def encode_document(tok, text, lengths):
    """([BOS] + tokens, whether a segment was cut). lengths (segments): each SEGMENT-separated part
    tokenized alone (the first after BOS), padded with BOS or cut to its length."""
    if not lengths:  # the ids cast once, straight into the shard's dtype
        ids = tok.encode_array(text)
        tokens = np.empty(len(ids) + 1, dtype=token_dtype(tok.vocab_size))
        tokens[0], tokens[1:] = tok.bos_id, ids
        return tokens, False
    parts = text.split(SEGMENT)
    if len(parts) == 1:  # a plain document: one segment
        parts += [""] * (len(lengths) - 1)
    if len(parts) != len(lengths):
        raise ValueError(f"a document of {len(parts)} segments for segments of {len(lengths)} "
                         "lengths")
    tokens, cut = [], False
    for i, (part, n) in enumerate(zip(parts, lengths, strict=True)):
        ids = [tok.bos_id] * (i == 0) + tok.encode(part)
        cut |= len(ids) > n
        tokens += ids[:n] + [tok.bos_id] * (n - len(ids))
    return tokens, cut


def encode_batch(docs):
    """(doc_hash, n_bytes, [BOS] + tokens, split, cut, loss mask or None, the eval rows it holds a
    gram of, token_hash) per (text, split); chat: n_bytes are the reply's, which the loss is on.
    Hashed here: one parent writes for all workers."""
    dtype = token_dtype(worker_tok.vocab_size)
    hits = worker_grams.hits([text for text, _ in docs]) if worker_grams else [()] * len(docs)
    out = []
    for (text, split), found in zip(docs, hits, strict=True):
        data = text.encode("utf-8")
        n_bytes, mask = len(data), None
        if worker_chat:
            prompt, reply = text.split(SEGMENT)
            tokens, mask = chat_row(worker_tok, prompt, reply)
            cut, n_bytes, mask = False, len(reply.encode("utf-8")), np.array(mask, dtype=np.uint8)
        else:
            tokens, cut = encode_document(worker_tok, text, worker_lengths)
        tokens = np.asarray(tokens).astype(dtype, copy=False)
        out.append((doc_hash(data), n_bytes, tokens, split, cut, mask, found, token_hash(tokens)))
    return out


def batched(docs):
    batch, chars = [], 0
    for text, split in docs:
        batch.append((text, split))
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_all(docs, n_workers, tok_dir, lengths, chat=False, grams=None):
    """encode_batch's results for every document, in order, from a pool of processes."""
    from tqdm import tqdm

    with contextlib.ExitStack() as stack:
        # forked holding Ctrl-C back until init_worker ignores it: one that came meanwhile stops the
        # pool, already in the stack, before the scratch folder the workers read goes
        with signals_held(signal.SIGINT):
            pool = stack.enter_context(multiprocessing.Pool(n_workers, init_worker,
                                                            (tok_dir, lengths, chat, grams)))
        bar = stack.enter_context(tqdm(unit="B", unit_scale=True, desc="tokenizing"))
        # apply_async with a bounded queue, not imap, which reads its whole input ahead into memory
        pending = collections.deque()

        def wait_for_pending(timeout=60):
            """Every job sent back before the pool's terminate(), whose result thread waits forever
            for a result cut off mid-send; one whose worker was killed never comes: timeout."""
            deadline = time.monotonic() + timeout
            for job in pending:
                job.wait(max(0.0, deadline - time.monotonic()))
        stack.callback(wait_for_pending)

        for batch in itertools.chain(batched(docs), [None]):  # None: the end, all taken back
            if batch:
                pending.append(pool.apply_async(encode_batch, (batch,)))
            while pending and (not batch or len(pending) > 2 * n_workers or pending[0].ready()):
                results = pending[0].get()
                pending.popleft()  # only once back: a Ctrl-C inside get() leaves it for the wait
                for result in results:
                    bar.update(result[1])
                    yield result


def write_shards(out_dir, encoded, tok, shard_tokens, threshold, smallest, eval_found=None,
                 ledger=None):
    """Pack encoded documents into shards per split (validation: hash below threshold), each added
    to `smallest`, `ledger` (if given) and by eval row to eval_found (a Counter); returns the
    manifest's splits, train unigram counts and contamination."""
    splits = {name: {"tokens": 0, "docs": 0, "bytes": 0, "cut": 0, "shards": []}
              for name in ("train", "val")}
    hashes = {name: array.array("Q") for name in splits}  # each document's token_hash: 8 bytes
    filling = {name: [] for name in splits}  # documents of the shard being filled
    masks = {name: [] for name in splits}  # and their loss masks (SFT data)
    filled = dict.fromkeys(splits, 0)  # and their tokens
    counts = np.zeros(tok.vocab_size, dtype=np.int64)

    def close_shard(name):
        docs, file = filling[name], f"{name}_{len(splits[name]['shards']):06d}.bin"
        tokens = np.concatenate(docs)
        starts = np.cumsum([0] + [len(d) for d in docs[:-1]], dtype=np.int64)
        mask = np.concatenate(masks[name]) if masks[name] else None
        sha = write_shard(os.path.join(out_dir, file), tokens, tok.vocab_size, tok.bos_id, starts,
                          mask)
        splits[name]["shards"].append(
            {"file": file, "docs_file": docs_file(file), "tokens": len(tokens), "docs": len(docs),
             "sha256": sha} | ({} if mask is None else {"mask_file": mask_file(file)}))
        if name == "train":
            counts[:] += np.bincount(tokens, minlength=tok.vocab_size)
        filling[name], masks[name], filled[name] = [], [], 0

    for h, n_bytes, tokens, forced, cut, mask, rows, tokens_hash in encoded:
        if not forced:  # only the hash's documents can be held out to reach min_val_tokens
            smallest.add(h, len(tokens))
        name = forced or ("val" if h < threshold else "train")
        split = splits[name]
        for key, n in (("docs", 1), ("cut", cut), ("bytes", n_bytes), ("tokens", len(tokens))):
            split[key] += n
        if name == "train" and eval_found is not None:
            eval_found.update(rows)
        filling[name].append(tokens)
        if mask is not None:  # SFT data: the tokens the loss counts, for the replies' bits per byte
            masks[name].append(mask)
            split["loss_tokens"] = split.get("loss_tokens", 0) + int(mask.sum())
        filled[name] += len(tokens)
        hashes[name].append(tokens_hash)
        if ledger is not None:
            ledger.add(h, n_bytes, name, forced, cut, rows, splits["val"]["tokens"])
        if filled[name] >= shard_tokens:  # a shard closes after the document that fills it
            close_shard(name)
    for name in splits:
        if filling[name]:
            close_shard(name)
    shared, n_val = shared_documents(hashes["train"], hashes["val"])
    contamination = {"train_docs_in_val": shared, "val_documents": n_val,
                     "hash": "blake2b-64 of each document's tokens"}
    return splits, counts, contamination


# -----------------------------------------------------------------------------
# The data_dir as a whole

def shard_files(splits):
    """The shards of splits, their indexes and loss masks."""
    return [shard[key] for split in splits.values() for shard in split["shards"]
            for key in ("file", "docs_file", "mask_file") if key in shard]


def listed_files(manifest):
    """The files a manifest lists besides itself."""
    splits = manifest["splits"]
    return manifest["tokenizer_files"] + [manifest["token_counts"]] + shard_files(splits)


def is_complete(data_dir, args):
    """Whether data_dir holds a finished build of exactly these arguments, every file there and each
    shard of its size; a damaged manifest is none: rebuilt."""
    try:
        manifest = load_manifest(data_dir)
        saved = manifest.get("prepare_args")
        if "pack_eval_sha256" not in args and isinstance(saved, dict):  # counted against a pack
            saved = {k: v for k, v in saved.items() if k != "pack_eval_sha256"}
        if saved != args:
            return False
        itemsize = np.dtype(manifest["token_dtype"]).itemsize
        sizes = {shard["file"]: HEADER_BYTES + shard["tokens"] * itemsize
                 for split in manifest["splits"].values() for shard in split["shards"]}
        return (all(os.path.isfile(os.path.join(data_dir, f)) for f in listed_files(manifest))
                and all(os.path.getsize(os.path.join(data_dir, f)) == n for f, n in sizes.items()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def own_file(entry):
    """Whether an entry of data_dir is a file prepare.py writes there, by its name: a damaged
    manifest cannot tell, and a hand-edited one could name a user's file."""
    return (entry.is_file(follow_symlinks=False)
            and (entry.name in (MANIFEST, DATA_MARK, DATA_MARK + ".tmp")
                 or OWN_FILE.fullmatch(entry.name)))


def check_own(data_dir):
    """Fail, before anything is written, when data_dir holds anything prepare.py did not write: a
    rebuild replaces prepare.py's files, and a user's must stay (make_scratch checks SCRATCH's)."""
    if not os.path.lexists(data_dir):
        return
    if not os.path.isdir(data_dir):
        fail(f"data_dir={data_dir} is not a folder: choose another --data_dir")
    with os.scandir(data_dir) as entries:
        foreign = sorted(e.name + "/" * e.is_dir() for e in entries
                         if e.name != SCRATCH and not own_file(e))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        fail(f"{data_dir} holds what prepare.py did not write ({', '.join(foreign[:3])}{more}): "
             "move that out of it, or choose another --data_dir")
    with os.scandir(data_dir) as entries:
        named = sorted((e.name != MANIFEST, e.name) for e in entries if own_file(e))
    if named and not os.path.isfile(os.path.join(data_dir, DATA_MARK)) and not earlier(data_dir):
        fail(f"{os.path.join(data_dir, named[0][1])} is not as podgpt wrote it (no {DATA_MARK} "
             "of prepare.py's beside it, and no podgpt manifest.json): not replacing it; move it "
             "away, or choose another --data_dir")


def earlier(data_dir):
    """Whether data_dir holds a podgpt manifest that reads: a folder prepared before DATA_MARK."""
    try:
        load_manifest(data_dir)
        return True
    except ValueError:
        return False


def swap_into_place(scratch, data_dir, manifest):
    """Move the build from scratch into data_dir, then remove old files the manifest does not list.
    The old manifest.json goes first and the new one last: a crash in between leaves no manifest
    (rebuilt), never one beside files not its own. A Ctrl-C waits for the renames (milliseconds)."""
    keep = listed_files(manifest) + [MANIFEST]
    with signals_held(signal.SIGINT, signal.SIGTERM):
        # the mark first: every file prepare.py moves in lands beside it
        write_atomic(os.path.join(data_dir, DATA_MARK), "prepare.py's data: rebuild it with "
                     "prepare.py --force, or delete this folder whole\n")
        if os.path.lexists(os.path.join(data_dir, MANIFEST)):
            os.remove(os.path.join(data_dir, MANIFEST))
        for name in keep:
            os.replace(os.path.join(scratch, name), os.path.join(data_dir, name))
        with os.scandir(data_dir) as entries:
            old = [e.name for e in entries
                   if own_file(e) and e.name not in keep and e.name != DATA_MARK]
        for name in old:
            os.remove(os.path.join(data_dir, name))


def fingerprint(out_dir, tokenizer_files, splits):
    digest = hashlib.sha256()
    for name in tokenizer_files:
        with open(os.path.join(out_dir, name), "rb") as f:
            digest.update(f.read())
    shas = (shard["sha256"] for split in splits.values() for shard in split["shards"])
    digest.update("".join(shas).encode())
    return digest.hexdigest()


# -----------------------------------------------------------------------------
# The build

def make_tokenizer(scratch, cfg, docs, threshold, lengths):
    """The Tokenizer, saved into scratch, and its files; and `reserve`, the highest threshold the
    split may be raised to: bpe:N trains only on documents hashed at or above it."""
    bpe = parse_spec(cfg.tokenizer)[0] == "bpe" and not cfg.chat
    reserve = threshold if bpe else 2**64
    if bpe and cfg.val_fraction and cfg.min_val_tokens:
        unsplit = ((doc_hash(text.encode("utf-8")), split, text) for text, split in docs()
                   if split != "train")
        reserve = bpe_reserve(unsplit, threshold, cfg.min_val_tokens, least_tokens(lengths))
        if reserve > threshold:
            print(f"{cfg.tokenizer} is trained without the documents min_val_tokens="
                  f"{cfg.min_val_tokens:,} may hold out for validation (hashes in the lowest "
                  f"{reserve / 2**64:.2%})")
    if cfg.chat:  # the base's tokenizer: a data_dir or checkpoint folder, or an out_dir's latest
        from podgpt.core.checkpoint import find_checkpoint  # here: only SFT data needs it
        base = cfg.chat_base
        if not os.path.isfile(os.path.join(base, "tokenizer.json")):
            base = find_checkpoint(base) or base
        meta, ranks = chat_tokenizer(base)
    else:
        meta, ranks = train_tokenizer(
            cfg.tokenizer, lambda: (text for text, _ in docs()),
            lambda: bpe_training_texts(docs(), reserve, cfg.bpe_train_chars))
    files = save_tokenizer(scratch, meta.get("spec", cfg.tokenizer), meta, ranks)
    return load_tokenizer(scratch), files, reserve  # from the files, as the workers load it


def tokenize_corpus(scratch, cfg, inputs, grams, eval_found):
    """Train the tokenizer and write the shards into scratch, holding out at least min_val_tokens
    where the corpus allows; returns the Tokenizer, its files and write_shards' results."""

    def docs():
        return documents(inputs, cfg.text_field, cfg.min_chars, cfg.max_docs, cfg.download_dir,
                         cfg.sha256, cfg.gsm8k_format, cfg.chat)

    # the hashes are uniform: those below it are a val_fraction of the documents
    threshold = base_threshold = math.ceil(cfg.val_fraction * 2**64)
    lengths = segment_lengths(cfg.segments)
    tok, tokenizer_files, reserve = make_tokenizer(scratch, cfg, docs, threshold, lengths)
    smallest = SmallestHashes(cfg.min_val_tokens)
    ledger = Ledger(cfg.min_val_tokens) if cfg.val_fraction and cfg.min_val_tokens else None
    # closed as soon as anything fails (a Ctrl-C too), not when collected: the pool stops and the
    # progress bar ends before the error line is printed
    encoded = encode_all(docs(), cfg.workers or os.cpu_count(), scratch, lengths, cfg.chat, grams)
    with contextlib.closing(encoded):
        splits, counts, contamination = write_shards(scratch, encoded, tok, cfg.shard_tokens,
                                                     threshold, smallest, eval_found, ledger)
    val = splits["val"]
    if ledger and val["tokens"] < cfg.min_val_tokens and smallest.threshold() is not None:
        threshold = smallest.threshold()
        if threshold > reserve:  # least_tokens counted more pieces than tiktoken's Unicode tables
            fail(f"{cfg.tokenizer} was trained on documents min_val_tokens={cfg.min_val_tokens:,} "
                 "now holds out: lower --min_val_tokens or raise --val_fraction")
        print(f"validation: {val['docs']:,} documents, {val['tokens']:,} tokens, fewer than "
              f"min_val_tokens={cfg.min_val_tokens:,}: holding out more documents (the next "
              "smallest hashes), read back from the shards")
        splits, counts, contamination = split_again(scratch, ledger, splits, tok, cfg.shard_tokens,
                                                    threshold, eval_found)
    check_split(splits, threshold > base_threshold, cfg.source, cfg.val_fraction,
                cfg.min_val_tokens)
    return tok, tokenizer_files, splits, counts, contamination


def split_again(scratch, ledger, splits, tok, shard_tokens, threshold, eval_found):
    """write_shards again at a raised threshold, the documents read back from the shards just
    written (moved aside, removed after): no document is tokenized twice."""
    first = os.path.join(scratch, "first-pass")
    os.mkdir(first)
    names = shard_files(splits)
    for name in names:
        os.replace(os.path.join(scratch, name), os.path.join(first, name))
    eval_found.clear()
    again = write_shards(scratch, ledger.replay(first, splits), tok, shard_tokens, threshold,
                         SmallestHashes(0), eval_found)
    shutil.rmtree(first)
    return again


def check_split(splits, raised, source, val_fraction, min_val_tokens):
    """Fail on a split that cannot train; with val_fraction > 0 also on one with no validation, less
    than min_val_tokens of it, or (`raised` the threshold) more than half of the tokens."""
    train, val = splits["train"], splits["val"]
    n_docs, n_tokens = train["docs"] + val["docs"], train["tokens"] + val["tokens"]
    if n_docs == 0:
        fail(f"no documents in {source} (check --source, --text_field, --min_chars)")
    short = val["tokens"] < min_val_tokens or raised and 2 * val["tokens"] > n_tokens
    if val_fraction > 0 and short:
        fail(f"too little data for min_val_tokens={min_val_tokens:,}: holding out that many tokens "
             f"in whole documents would leave less than half of the {n_tokens:,} tokens "
             f"({n_docs:,} documents) for training: lower --min_val_tokens or add documents "
             "(raise --max_docs)")
    if train["docs"] == 0:
        fail(f"all {n_docs} documents went to validation: lower --val_fraction")
    if val_fraction > 0 and val["docs"] == 0:
        fail(f"no document went to validation ({n_docs} documents, val_fraction={val_fraction}): "
             "raise --val_fraction or --min_val_tokens, or add documents "
             "(--val_fraction=0 trains without validation)")


def segment_lengths(spec):
    """The token lengths of --segments ("128,128,256") as ints; [] for ""."""
    try:
        lengths = [int(n) for n in spec.split(",")] if spec else []
    except ValueError:
        lengths = [0]
    if lengths and min(lengths) < 1:
        fail(f"segments={spec!r}: token lengths separated by commas, each at least 1, e.g. 512 or "
             "128,128,256")
    return lengths


def check_args(cfg):
    """Fail on settings that cannot work, before anything is read or written."""
    for key, example in (("data_dir", "data/default"), ("download_dir", "downloads")):
        if not cfg[key]:
            fail(f"{key} is empty: name a folder (e.g. --{key}={example})")
    parse_spec(cfg.tokenizer)
    lengths = segment_lengths(cfg.segments)
    if cfg.gsm8k_format not in GSM8K_FORMATS:
        fail(f"gsm8k_format={cfg.gsm8k_format!r} is not one of {', '.join(GSM8K_FORMATS)}")
    if cfg.gsm8k_format == "hdp" and len(lengths) != 3:
        fail("gsm8k_format=hdp makes each problem three segments (question, plan, execution): set "
             f"segments to their token lengths, e.g. --segments=128,128,256 (got {cfg.segments!r})")
    if cfg.chat and (not cfg.chat_base or cfg.segments):
        fail("chat=True makes SFT data in the tokenizer of the base model: set --chat_base to its "
             "data_dir or checkpoint folder (and no --segments)")
    if not 0 <= cfg.val_fraction < 1:
        fail(f"val_fraction={cfg.val_fraction} must be in [0, 1)")
    for key, zero in (("min_val_tokens", "no minimum"), ("max_docs", "all"), ("max_shards", "all"),
                      ("min_chars", "keep all"), ("workers", "one per core")):
        if cfg[key] < 0:
            fail(f"{key}={cfg[key]} must be >= 0 (0: {zero})")
    for key in ("shard_tokens", "bpe_train_chars"):
        if cfg[key] <= 0:
            fail(f"{key}={cfg[key]} must be positive")
    # a download cache inside data_dir is in a rebuild's way (a local source needs none: checked all
    # the same)
    check_apart(data_dir=cfg.data_dir, download_dir=cfg.download_dir)


def write_data(scratch, cfg, inputs, description, args, grams):
    """Tokenize the corpus into scratch, then its unigram counts and manifest.json (returned)."""
    eval_found = collections.Counter()
    tok, tokenizer_files, splits, counts, contamination = tokenize_corpus(
        scratch, cfg, inputs, grams, eval_found)
    save_npy(os.path.join(scratch, "train_counts.npy"), counts)
    manifest = dict(format_version=VERSION, tokenizer=tok.spec, vocab_size=tok.vocab_size,
                    bos_id=tok.bos_id, token_dtype=token_dtype(tok.vocab_size).name,
                    tokenizer_files=tokenizer_files, splits=splits, token_counts="train_counts.npy",
                    source=description, prepare_args=args, contamination=contamination)
    if grams:
        manifest["eval_contamination"] = eval_record(cfg.pack_dir, grams, eval_found)
    # what a checkpoint's data check compares: the tokenizer and the shards alone
    manifest["fingerprint"] = fingerprint(scratch, tokenizer_files, splits)
    write_atomic(os.path.join(scratch, MANIFEST), json.dumps(manifest, indent=2) + "\n")
    return manifest


def print_totals(out_dir, manifest, segments, seconds):
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    n_docs, n_tokens = train["docs"] + val["docs"], train["tokens"] + val["tokens"]
    print(f"train: {train['docs']:,} documents, {train['tokens']:,} tokens, "
          f"shards: {len(train['shards'])}")
    print(f"validation: {val['docs']:,} documents, {val['tokens']:,} tokens "
          f"({val['tokens'] / n_tokens:.1%} of tokens) held out")
    if segments:
        cut = train["cut"] + val["cut"]
        print(f"segments {segments}: every document is {sum(segment_lengths(segments))} tokens; "
              f"{cut:,} of {n_docs:,} ({cut / n_docs:.1%}) had a segment cut to its length "
              f"(train {train['cut']:,}, validation {val['cut']:,})")
    print(f"wrote {out_dir}: {manifest['tokenizer']} tokenizer (vocab {manifest['vocab_size']}), "
          f"fingerprint {manifest['fingerprint'][:12]}, {seconds:.1f}s")


def build(cfg):
    """Prepare cfg.data_dir: reused when it holds this exact result, else built in its scratch
    folder and moved into place; anything there prepare.py did not write stops it first."""
    t0 = time.time()
    check_args(cfg)
    out_dir = os.path.normpath(cfg.data_dir)
    if holder := in_use(os.path.join(out_dir, SCRATCH)):  # one writer: its scratch folder is held
        fail(f"data_dir={out_dir} is being written by another prepare.py ({holder}): wait for it "
             "to end (or stop it), or choose another --data_dir")
    args = {key: cfg[key] for key in OUTPUT_KEYS}
    args |= {k: cfg[k] for k, default in LATER_KEYS.items() if cfg[k] != default}
    grams = eval_grams(cfg.pack_dir)
    args |= {"pack_eval_sha256": grams.sha256} if grams else {}  # another pack's: counted again
    if not cfg.force and is_complete(out_dir, args):
        print(f"{out_dir} already holds this data (same arguments, all files present): reusing it; "
              "--force rebuilds")
        return
    check_own(out_dir)
    inputs, description = resolve_sources(cfg.source, cfg.max_shards, cfg.sha256,
                                          cfg.split_paragraphs)
    for url in (s.location for s in inputs if is_url(s.location)):
        local_copy(url, cfg.download_dir)  # under HF_HUB_OFFLINE a missing file fails now
    made = make_folders(out_dir)
    scratch = make_scratch(os.path.join(out_dir, SCRATCH))  # inside: the moves are renames
    try:
        manifest = write_data(scratch, cfg, inputs, description, args, grams)
        swap_into_place(scratch, out_dir, manifest)
    finally:  # done or failed, the scratch folder goes, and a data_dir this run made if left empty
        remove_scratch(scratch)
        remove_empty(made)
    print_totals(out_dir, manifest, cfg.segments, time.time() - t0)


def main(argv):
    cfg = configurator.configure(__file__, argv)
    try:
        build(cfg)
    except OSError as e:  # a full disk, a folder that cannot be written: one line, as any error
        if disk_full(e):  # its error names no file: say the folder, and that build() cleaned up
            fail(f"the disk of data_dir={cfg.data_dir} is full ({first_line(e)}): free space on it "
                 "and rerun the same command (this run's partial files there are removed)")
        fail(str(e))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
