"""
Does prepare.py tokenize at the tokenizer's own speed? MB/s of text through prepare.encode_all with one worker
process (texts and token arrays crossing the process boundary, hashes, batching: all a worker does) against the raw
tokenizer in one thread of this process (Tokenizer.encode_array: for gpt2 and bpe:N tiktoken's encode_to_numpy, its
fastest call, the one the workers make), on the same documents. The pool's start (a fork, the tokenizer loaded from
its files), timed on one empty document, is paid once a run, not per megabyte: the worker's steady rate leaves it
out, and fraction = steady / raw, per core. The parent process reads the documents and writes the shards for all the
workers: its rate (reading, then write_shards on the results) over the workers' steady rate is how many worker
processes it can keep busy.

    python bench/encode.py                                  # the stdlib's .py files, gpt2 (PODGPT_GPT2_TIKTOKEN)
    python bench/encode.py --tokenizer=byte --max_docs=300

Each figure is the best of `iters` passes over the documents, after one untimed pass (page cache, the
tokenizer's own caches); the raw tokenizer and the worker take turns.
"""

import os
import sys
import tempfile
import time

import common
import torch

from podgpt.corpus import holdout
import prepare
from podgpt.corpus import sources
from podgpt.core.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from podgpt.core.util import fail, run_main

# --- config
source = "stdlib"       # prepare.py's source: stdlib | a file or folder
tokenizer = "gpt2"      # gpt2 | byte | char (bpe:N trains on the documents first)
max_docs = 2000         # documents read (0: all)
iters = 5               # timed passes; the best counts
out = ""                # JSONL file the result line is appended to; "": bench/results/encode.jsonl
# --- end config


def best_seconds(iters, *fns):
    """The best wall seconds of each fn over `iters` calls after an untimed one, the fns taking turns: a load that
    comes and goes on a shared machine then weighs on each alike."""
    seconds = [[] for _ in fns]
    for i in range(iters + 1):
        for fn, times in zip(fns, seconds, strict=True):
            t0 = time.perf_counter()
            fn()
            if i:  # the first round is untimed
                times.append(time.perf_counter() - t0)
    return [min(times) for times in seconds]


def encode_all(docs, tok_dir):
    """prepare.py's tokenizing, in one worker process, its results taken and dropped."""
    for _ in prepare.encode_all(iter(docs), 1, tok_dir, []):
        pass


def main(argv):
    cfg, _ = common.configure(__file__, argv)
    common.check_counts(cfg, "iters")
    inputs, description = sources.resolve_sources(cfg["source"], 0, "", False)
    docs = list(sources.documents(inputs, "text", 0, cfg["max_docs"], "downloads", ""))
    if not docs:
        fail(f"no documents in {cfg['source']}")
    n_bytes = sum(len(text.encode("utf-8")) for text, _ in docs)
    with tempfile.TemporaryDirectory() as tok_dir:
        meta, ranks = train_tokenizer(cfg["tokenizer"], lambda: (t for t, _ in docs), lambda: (t for t, _ in docs))
        save_tokenizer(tok_dir, cfg["tokenizer"], meta, ranks)
        tok = load_tokenizer(tok_dir)
        raw, worker, start = best_seconds(cfg["iters"], lambda: [tok.encode_array(text) for text, _ in docs],
                                          lambda: encode_all(docs, tok_dir), lambda: encode_all([("", None)], tok_dir))
        encoded = list(prepare.encode_all(iter(docs), 1, tok_dir, []))
        with tempfile.TemporaryDirectory() as shard_dir:
            read, write = best_seconds(
                cfg["iters"], lambda: list(sources.documents(inputs, "text", 0, cfg["max_docs"], "downloads", "")),
                lambda: prepare.write_shards(shard_dir, iter(encoded), tok, prepare.shard_tokens, 0,
                                             holdout.SmallestHashes(0)))
    if worker <= start:
        fail(f"{n_bytes / 1e6:.2f} MB of text take no longer than the pool's start ({start:.3f} s): "
             "raise --max_docs or choose a bigger --source")
    raw_mbps, worker_mbps, steady_mbps, parent_mbps = (n_bytes / seconds / 1e6
                                                       for seconds in (raw, worker, worker - start, read + write))
    print(f"{len(docs):,} documents of {description}, {n_bytes / 1e6:.1f} MB, {tok.spec}: raw tokenizer "
          f"{raw_mbps:.2f} MB/s in one thread; prepare.py's worker process {worker_mbps:.2f} MB/s, {start:.2f} s of "
          f"it the pool's start, {steady_mbps:.2f} MB/s without: {steady_mbps / raw_mbps:.0%} of the raw tokenizer")
    print(f"the parent reads and writes {parent_mbps:.0f} MB/s (reading {n_bytes / read / 1e6:.0f}, write_shards "
          f"{n_bytes / write / 1e6:.0f}): enough for {parent_mbps / steady_mbps:.0f} worker processes")
    common.write_result("encode", cfg["out"], torch.device("cpu"), dict(
        source=description, tokenizer=tok.spec, docs=len(docs), mb=n_bytes / 1e6, iters=cfg["iters"],
        raw_mb_per_sec=raw_mbps, worker_mb_per_sec=worker_mbps, start_s=start, steady_mb_per_sec=steady_mbps,
        fraction=steady_mbps / raw_mbps, read_s=read, write_s=write, parent_mb_per_sec=parent_mbps,
        workers_fed=parent_mbps / steady_mbps, cores=os.cpu_count()))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
