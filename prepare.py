"""
Prepare training data: text sources -> tokenizer -> token shards + manifest.json.

    python prepare.py                                   # the local Python stdlib, byte tokenizer
    python prepare.py --source=tinyshakespeare --tokenizer=char --data_dir=data/shakespeare
    python prepare.py --source=fineweb-edu-10bt --max_shards=2 --tokenizer=gpt2 --data_dir=data/fwe
    python prepare.py --source=corpus/,more.jsonl --tokenizer=bpe:8192 --data_dir=data/mine

Sources (comma-separated ones are concatenated in order):
- stdlib: the .py files of this Python's standard library, one document per file;
- a file or folder (walked recursively, sorted by relative path): .txt/.md/.py one
  document per file (or per paragraph with split_paragraphs: one big text file), .jsonl
  one per line (field `text_field`), .parquet one per row (column `text_field`);
- an http(s) URL: downloaded into download_dir (resumable; retried on timeouts, dropped
  connections and server errors), then read as a file;
- a preset: tinyshakespeare, fineweb-edu-10bt, climbmix, gsm8k. The last three are Hugging Face datasets, which
  follow huggingface_hub's conventions: a file already in the Hugging Face cache (HF_HUB_CACHE, else
  HF_HOME/hub) is read from there; HF_ENDPOINT picks a mirror; HF_TOKEN (or the token `hf auth login`
  saved) goes to the hub alone, for gated datasets and the higher rate limits of a token; HF_HUB_OFFLINE=1
  never asks the hub: every file must be in the cache or download_dir.
  gsm8k (openai/gsm8k, config main) keeps the dataset's own split (train, and test as validation) and
  makes each row (question, answer) a document as gsm8k_format says (tasks.gsm8k_document): qa,
  "Question: ...\nAnswer: ..." with the answer as the dataset has it (its <<calculator>> annotations, then
  "#### <number>"); hdp, three segments for plan-then-execute block diffusion: the question; the plan, the
  answer's reasoning lines without their annotations; the execution, the annotated lines and the final
  "#### <number>" line.

segments (e.g. 512, or 128,128,256 with gsm8k_format=hdp): every document is made exactly that many
tokens, each segment tokenized on its own (the first after BOS), padded with BOS (which also ends a
document) or cut to its length; the manifest says how many documents had a segment cut. Rows of
block_size = the total then hold one document each, from its first token (train.py checks).

Tokenizers (tokenizer.py): byte, char, gpt2, bpe:N (trained here on the training documents).

Output in data_dir, built in the scratch folder data_dir/.podgpt-prepare and moved into place
when complete, manifest.json last. prepare.py writes only into a data_dir that holds nothing
but these files (so download_dir lies elsewhere):
- tokenizer.json (+ tokenizer.tiktoken, plain ranks, for gpt2 and bpe:N): tokenizer.load_tokenizer()
- {train,val}_{i:06d}.bin: header of 128 little-endian int64
  [MAGIC, VERSION, token itemsize (2 or 4), n_tokens, vocab_size, n_docs, bos_id, 0...]
  (1024 bytes), then n_tokens little-endian uint16 (vocab_size <= 65536) or uint32;
  documents are never split across shards. open_shard() memory-maps one.
- {train,val}_{i:06d}.docs.npy: int64 start offset of each document in its shard.
- train_counts.npy: int64[vocab_size] unigram counts of the train split, BOS included.
- manifest.json: tokenizer, counts per split, shards with sha256, source, the arguments
  that determine the output, and a fingerprint of it all. load_manifest() reads it.
  Its "contamination" counts the training documents whose tokens are also a validation
  document's (data.token_hash), so that train.py's check needs no pass over the corpus.
Validation is whole documents, those with the smallest hashes of their text: val_fraction
of them, and more while they hold fewer than min_val_tokens tokens (found at the end of the
pass, then the documents are tokenized again: only a small corpus needs that). The split
depends on the set of documents alone, so the output is the same for any number of
workers, and duplicate documents always land in the same split.
"""

import array
import collections
import contextlib
import difflib
import errno
import hashlib
import heapq
import http.client
import io
import json
import math
import multiprocessing
import os
import platform
import re
import signal
import socket
import sys
import sysconfig
import time
import urllib.parse

import numpy as np

import configurator
from data import (HEADER_BYTES, HEADER_INTS, MAGIC, VERSION, docs_file, load_manifest, shared_documents,
                  token_dtype, token_hash)
from tasks import gsm8k_documents
from tokenizer import SEGMENT, load_tokenizer, parse_spec, save_tokenizer, train_tokenizer
from util import (check_apart, disk_full, fail, first_line, in_use, make_folders, make_scratch, remove_empty,
                  remove_scratch, run_main)

# --- config
source = "stdlib"  # stdlib | file or folder | http(s) URL | preset name; comma-separated for several
data_dir = "data/default"  # output folder: shards, manifest, tokenizer files (data/ holds one folder per dataset)
tokenizer = "byte"  # gpt2 | byte | char | bpe:N
text_field = "text"  # field of .jsonl lines / column of .parquet files
val_fraction = 0.005  # fraction of documents held out for validation (whole documents); 0: no validation
min_val_tokens = 100_000  # with val_fraction > 0, at least this many (more documents, by hash): fewer make a noisy loss
max_docs = 0  # stop after this many documents (0: all)
max_shards = 0  # for presets: download only the first N files (0: all)
min_chars = 0  # drop documents shorter than this many characters
split_paragraphs = False  # .txt/.md/.py: one document per blank-line separated paragraph, not per file
gsm8k_format = "qa"  # gsm8k preset: qa ("Question: ...\nAnswer: ...") | hdp (question, plan, execution: needs 3 segments)
segments = ""  # token lengths each document is padded (BOS) or cut to, e.g. "512" or "128,128,256"; "": packed as is
shard_tokens = 100_000_000  # target tokens per shard file
workers = 0  # tokenizer processes (0: all cores)
download_dir = "downloads"  # cache for downloaded files: beside data_dir, never inside it
sha256 = ""  # expected sha256 of a single-URL source (checked after download)
bpe_train_chars = 2_000_000_000  # at most this many characters of training documents train bpe:N
force = False  # rebuild even if data_dir already holds this exact result
# --- end config

# the config keys that determine the output (data_dir, download_dir, workers, force do not)
OUTPUT_KEYS = ("source", "tokenizer", "text_field", "val_fraction", "min_val_tokens", "max_docs", "max_shards",
               "min_chars", "split_paragraphs", "shard_tokens", "sha256", "bpe_train_chars")

# output keys added since: in prepare_args only when set, so that data prepared before them is still this exact result
LATER_KEYS = {"gsm8k_format": "qa", "segments": ""}

TEXT_EXTS = (".txt", ".md", ".py")  # read whole, one document per file
SOURCE_EXTS = TEXT_EXTS + (".jsonl", ".parquet")
BATCH_CHARS = 1 << 20  # characters of text sent to a tokenizer process at once

SCRATCH = ".podgpt-prepare"  # the build's folder inside data_dir: a name no user picks, renames on one filesystem
MANIFEST = "manifest.json"
# the other files prepare.py writes into data_dir, and write_shard's temporary ones (a crash may leave one):
# with manifest.json and SCRATCH, all a data_dir may hold for prepare.py to rebuild it
OWN_FILE = re.compile(r"(train|val)_\d{6,}\.(bin|docs\.npy|bin\.tmp|bin\.docs\.tmp)|tokenizer\.json|tokenizer\.tiktoken"
                      r"|train_counts\.npy")

RETRIES = 5  # download attempts per file
BACKOFF = 2.0  # seconds before the first retry, doubled after each failed attempt
TIMEOUT = (10, 60)  # download connect and read timeouts, seconds
MAX_WAIT = 300  # seconds: the longest wait a 429 or 503 may ask for (the hub counts its rate limits over 5 minutes)

HF_DEFAULT_ENDPOINT = "https://huggingface.co"

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
# Hugging Face dataset presets: (repo, files). The file lists follow the datasets' layouts:
# fineweb-edu's sample/10BT is 14 parquet files 000_00000 ... 013_00000 (the repo tree; also
# pinned in several public download scripts); climbmix-400b-shuffle is shard_00000 ...
# shard_06542.parquet (MAX_SHARD = 6542 in karpathy/autoresearch's prepare.py).
HF_PRESETS = {
    "fineweb-edu-10bt": ("HuggingFaceFW/fineweb-edu", [f"sample/10BT/{i:03d}_00000.parquet" for i in range(14)]),
    "climbmix": ("karpathy/climbmix-400b-shuffle", [f"shard_{i:05d}.parquet" for i in range(6543)]),
    # the dataset's main config: 7,473 training and 1,319 test problems
    "gsm8k": ("openai/gsm8k", ["main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet"]),
}
PRESETS = ("tinyshakespeare",) + tuple(HF_PRESETS)
GSM8K_SPLITS = ("train", "val")  # the split each gsm8k file's problems go to: its train and its test file
GSM8K_FORMATS = ("qa", "hdp")


# -----------------------------------------------------------------------------
# Shard files: the format data.py reads


def write_shard(path, tokens, vocab_size, bos_id, doc_starts):
    """Write a shard (and its .docs.npy index beside it), each atomically; returns the .bin's sha256."""
    if not path.endswith(".bin"):
        raise ValueError(f"{path}: shard files end in .bin")
    tokens, doc_starts = np.asarray(tokens), np.asarray(doc_starts, dtype=np.int64)
    whole_docs = (len(tokens) > 0 and len(doc_starts) > 0 and doc_starts[0] == 0 and doc_starts[-1] < len(tokens)
                  and np.all(np.diff(doc_starts) > 0) and np.all(tokens[doc_starts] == bos_id))
    if not whole_docs:
        raise ValueError(f"{path}: a shard holds whole documents, each starting with bos_id={bos_id}")
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
    return digest.hexdigest()


def save_npy(path, array):
    """np.save into the file `path`, through bytes: numpy's own file writer (ndarray.tofile) turns a Ctrl-C that
    lands inside it into a TypeError, a traceback where prepare.py owes one line (seen under load)."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


# -----------------------------------------------------------------------------
# Sources -> documents


def is_url(location):
    return location.startswith(("http://", "https://"))


def preset_urls(name):
    if name == "tinyshakespeare":
        return [TINYSHAKESPEARE_URL]
    repo, files = HF_PRESETS[name]
    return [f"{hf_endpoint()}/datasets/{repo}/resolve/main/{file}" for file in files]  # main: no pinned commit


def walk(root, exts, skip_dirs=()):
    """Files under root ending in exts, sorted by relative path."""
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs]
        paths += [os.path.join(folder, f) for f in files if f.lower().endswith(exts)]
    return sorted(paths, key=lambda p: os.path.relpath(p, root))


class Source(collections.namedtuple("Source", "location paragraphs split form")):
    """One input: a path or URL; paragraphs: split a text file at blank lines; split: None (by hash) or the split
    all its documents go to; form: None (documents by file type) or "gsm8k" (question and answer columns)."""


def resolve_sources(spec, max_shards, sha256, split_paragraphs):
    """[Source] for a source spec, and a description of it."""
    inputs, parts = [], []
    for part in (p.strip() for p in spec.split(",")):
        if part == "stdlib":
            files = walk(sysconfig.get_paths()["stdlib"], (".py",), ("site-packages", "dist-packages"))
            parts.append(f"stdlib (Python {platform.python_version()}, {len(files)} files)")
            inputs += [Source(f, split_paragraphs, None, None) for f in files]
        elif part in PRESETS:
            urls = preset_urls(part)
            chosen = urls[:max_shards] if max_shards > 0 else urls
            parts.append(f"{part} ({len(chosen)} of {len(urls)} files from {os.path.dirname(urls[0])})")
            if part == "gsm8k":  # the dataset's own split, not the hash's
                inputs += [Source(url, False, split, "gsm8k") for url, split in zip(chosen, GSM8K_SPLITS)]
            else:  # tinyshakespeare is one file: its blank-line separated speeches are the documents
                inputs += [Source(url, split_paragraphs or part == "tinyshakespeare", None, None) for url in chosen]
        elif is_url(part):
            parts.append(part)
            inputs.append(Source(part, split_paragraphs, None, None))
        elif os.path.isfile(part) or os.path.isdir(part):
            files = walk(part, SOURCE_EXTS) if os.path.isdir(part) else [part]
            if not files:
                fail(f"no {'/'.join(SOURCE_EXTS)} files under {part}")
            parts.append(f"{part} ({len(files)} files)")
            inputs += [Source(f, split_paragraphs, None, None) for f in files]
        else:
            close = difflib.get_close_matches(part, PRESETS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (presets: {', '.join(PRESETS)})"
            fail(f"source '{part}' is not stdlib, a preset, a URL or an existing file or folder{hint}")
    for source in inputs:  # know before any download or tokenizing that every input can be read
        location = source.location
        if not (urllib.parse.urlsplit(location).path if is_url(location) else location).lower().endswith(SOURCE_EXTS):
            fail(f"{location}: unsupported file type (use {', '.join(SOURCE_EXTS)})")
    if sha256 and not (len(inputs) == 1 and is_url(inputs[0].location)):
        fail(f"--sha256 checks a single-URL source; this source has {len(inputs)} inputs: "
             "drop --sha256 or give one URL")
    return inputs, " + ".join(parts)


def read_documents(path, text_field, split_paragraphs):
    """The documents of one local file, by extension (split_paragraphs: for text files)."""
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".jsonl":
            # utf-8-sig: a byte order mark (Windows editors write one) is not part of the first line's JSON
            with open(path, encoding="utf-8-sig", errors="replace") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[text_field]
                    except RecursionError:  # json.loads recurses once per level of nesting
                        fail(f"{path}:{line_no}: JSON nested too deeply to read (a damaged line?): "
                             "fix or remove that line")
                    except (ValueError, KeyError, TypeError):
                        fail(f"{path}:{line_no}: not a JSON object with a string field '{text_field}' "
                             "(set --text_field)")
                    if not isinstance(text, str):
                        fail(f"{path}:{line_no}: field '{text_field}' is not a string (set --text_field)")
                    # \ud800-style escapes can make lone surrogates, which are not valid UTF-8
                    yield text.encode("utf-8", errors="replace").decode("utf-8")
        elif ext == ".parquet":
            yield from read_parquet(path, text_field)
        else:  # TEXT_EXTS, as resolve_sources checked
            with open(path, encoding="utf-8", errors="replace", newline="") as f:  # newline="": keep \r\n
                text = f.read()
            if split_paragraphs:  # at lines holding only whitespace; \r\n line ends too
                yield from (p for p in re.split(r"\r?\n(?:[ \t]*\r?\n)+", text) if p.strip())
            else:
                yield text
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}")


def read_parquet(path, text_field):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        fail("pyarrow is needed for .parquet sources: pip install pyarrow")
    # pyarrow reports a corrupt file as ArrowInvalid, OSError (with a message of several lines),
    # UnicodeDecodeError or others; a damaged page only when its row group is read
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        fail(f"cannot read {path} as parquet: {first_line(e)}")
    if text_field not in pf.schema_arrow.names:
        fail(f"{path} has no column '{text_field}' (columns: {', '.join(pf.schema_arrow.names)}; "
             "set --text_field)")
    for i in range(pf.num_row_groups):  # a row group at a time: shards can be bigger than memory
        try:
            texts = pf.read_row_group(i, columns=[text_field]).column(0).to_pylist()
        except Exception as e:
            fail(f"cannot read {path} as parquet (row group {i + 1} of {pf.num_row_groups}): {first_line(e)}")
        for text in texts:
            if text is None:
                continue
            if not isinstance(text, str):
                fail(f"{path}: column '{text_field}' holds {type(text).__name__}, not text")
            yield text


def documents(inputs, text_field, min_chars, max_docs, download_dir, sha256, gsm8k_format="qa"):
    """All documents of the inputs in order, downloading URLs when reached: (text, the split it must go to or
    None for the hash's)."""
    n = 0
    for source in inputs:
        path = download(source.location, download_dir, sha256) if is_url(source.location) else source.location
        if source.form == "gsm8k":
            columns = (list(read_parquet(path, column)) for column in ("question", "answer"))
            texts = gsm8k_documents(path, *columns, gsm8k_format)
        else:
            texts = read_documents(path, text_field, source.paragraphs)
        for text in texts:
            if len(text) < min_chars:
                continue
            yield text, source.split
            n += 1
            if n == max_docs:
                return


def doc_hash(data):
    """A document's place in the split, from its UTF-8 bytes alone: uniform in [0, 2**64), and
    the documents whose hash is below a threshold are held out for validation."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def in_training(text, split, threshold):
    """Whether a document goes to training: its source's split, else its hash at or above the threshold."""
    return split == "train" if split else doc_hash(text.encode("utf-8")) >= threshold


def bpe_training_texts(docs, threshold, max_chars):
    """The training documents (never validation ones), cut off after max_chars characters; segments apart."""
    n = 0
    for text, split in docs:
        if n >= max_chars:
            return
        if in_training(text, split, threshold):
            text = text.replace(SEGMENT, "\n")[: max_chars - n]
            n += len(text)
            yield text


class SmallestHashes:
    """The documents with the smallest hashes that together hold at least min_tokens tokens, kept in a
    heap as the documents stream past: memory grows with min_tokens, not with the corpus."""

    def __init__(self, min_tokens):
        self.min_tokens, self.tokens = min_tokens, 0
        self.heap = []  # (-hash, n_tokens): the largest hash on top

    def add(self, h, n_tokens):
        if self.tokens >= self.min_tokens and (not self.heap or h >= -self.heap[0][0]):
            return  # enough already, with smaller hashes
        heapq.heappush(self.heap, (-h, n_tokens))
        self.tokens += n_tokens
        while self.tokens - self.heap[0][1] >= self.min_tokens:  # enough without the largest
            self.tokens -= heapq.heappop(self.heap)[1]

    def threshold(self):
        """The smallest threshold whose documents (hash below it) hold min_tokens tokens; None if all hold fewer."""
        return -self.heap[0][0] + 1 if self.tokens >= self.min_tokens else None


# -----------------------------------------------------------------------------
# Folders a run makes, and removes again when it fails


# -----------------------------------------------------------------------------
# Downloads


def cache_path(url, download_dir):
    """download_dir/host/path of url: distinct URLs never share a file (HF shards share base names)."""
    parts = urllib.parse.urlsplit(url)
    names = [parts.netloc] + parts.path.split("/")
    return os.path.join(download_dir, *(re.sub(r"[^\w.-]", "_", n) for n in names if n not in ("", ".", "..")))


# The Hugging Face hub, as huggingface_hub (and so datasets, transformers, the hf CLI) finds it: the same
# environment variables, the same token, the same cache, so that a pod set up for one is set up for podgpt


def hf_endpoint():
    return os.environ.get("HF_ENDPOINT", HF_DEFAULT_ENDPOINT).rstrip("/")


def hf_home():
    return os.path.expanduser(os.environ.get("HF_HOME")
                              or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"))


def hub_cache():
    return os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
                              or os.path.join(hf_home(), "hub"))


def hub_offline():
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hf_token():
    """The token huggingface_hub would send: HF_TOKEN, HUGGING_FACE_HUB_TOKEN (its older name), else the file
    `hf auth login` writes (HF_TOKEN_PATH, else HF_HOME/token); None without one."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if not token:
        try:
            with open(os.path.expanduser(os.environ.get("HF_TOKEN_PATH") or os.path.join(hf_home(), "token"))) as f:
                token = f.read()
        except OSError:
            return None
    return token.strip() or None


def hub_path(url):
    """url's path on the Hugging Face hub (huggingface.co or the HF_ENDPOINT mirror: the same scheme, host and
    port), e.g. /datasets/owner/name/resolve/main/file; None for a URL anywhere else."""
    for endpoint in (hf_endpoint(), HF_DEFAULT_ENDPOINT):
        if url.startswith(endpoint + "/"):
            return url[len(endpoint):]
    return None


def hub_file(url):
    """(repo, revision, file) of a dataset file's URL on the hub, else None."""
    match = re.match(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/([^?#]+)", hub_path(url) or "")
    return tuple(urllib.parse.unquote(part) for part in match.groups()) if match else None


def hub_cached(repo, revision, file):
    """The file of dataset repo in the Hugging Face cache (HF_HUB_CACHE/datasets--owner--name/snapshots/<commit>/
    file, a link into its blobs), or None. A pinned commit is looked for in its snapshot alone; a branch
    (the presets' main) in the snapshot refs/<branch> names first, then in any other: the presets pin no
    commit, so a shard of any version is the dataset's."""
    folder = os.path.join(hub_cache(), "datasets--" + repo.replace("/", "--"))
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        commits = [revision]
    else:
        try:
            commits = sorted(os.listdir(os.path.join(folder, "snapshots")))
        except OSError:  # nothing of this dataset in the cache
            return None
        try:
            with open(os.path.join(folder, "refs", revision)) as f:
                ref = f.read().strip()
        except OSError:  # no ref: the snapshots in name order
            ref = None
        commits.sort(key=lambda commit: commit != ref)
    for commit in commits:
        path = os.path.join(folder, "snapshots", commit, *file.split("/"))
        if os.path.isfile(path):  # a link whose blob was deleted is no file
            return path
    return None


def fetch(url, part):
    """Download url into the file `part`, continuing a partial one with a Range request. On the hub, with
    the Hugging Face token: requests drops it when a redirect leads elsewhere (the hub sends downloads on to
    its storage hosts), and no other URL ever gets it."""
    import requests
    from tqdm import tqdm

    have = os.path.getsize(part) if os.path.exists(part) else 0
    token = hf_token() if hub_path(url) is not None else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if have:
        headers["Range"] = f"bytes={have}-"
    with requests.get(url, headers=headers, stream=True, timeout=TIMEOUT) as r:
        if r.status_code == 416:  # the partial file is not a prefix of this file: start over
            os.remove(part)
        r.raise_for_status()
        if r.status_code != 206:  # the server sent the whole file, not the rest
            have = 0
        total = int(r.headers.get("Content-Length", 0)) + have or None
        with open(part, "ab" if have else "wb") as f, tqdm(total=total, initial=have, unit="B", unit_scale=True,
                                                             desc=os.path.basename(part)[: -len(".part")]) as bar:
            for chunk in r.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                bar.update(len(chunk))


def wrapped(e):
    """e and every exception inside it: requests wraps urllib3's, which wraps the socket's (in args,
    .reason and __cause__)."""
    found, todo = [], [e]
    while todo:
        x = todo.pop()
        if isinstance(x, BaseException) and all(x is not f for f in found):
            found.append(x)
            todo += [*x.args, getattr(x, "reason", None), x.__cause__, x.__context__]
    return found


def failure(e):
    """Why a request failed, in a few words, and what trying again would do: after a timeout, a dropped
    connection or a server error (5xx) it may pass ("retry"); after a refused connection, an unknown host or no
    route to it ("unreachable": an offline pod, whose name lookups fail) or a 4xx ("final") it will not."""
    import requests

    if isinstance(e, requests.HTTPError):
        status = e.response.status_code
        # also retried: 408 (the server timed the request out) and 429 (a rate limit, which Hugging Face sets
        # on downloads: waiting is what it asks for); and 416, after which fetch dropped a .part that is not
        # a prefix of the file, so the retry starts over
        return f"HTTP {status}", "retry" if status >= 500 or status in (408, 416, 429) else "final"
    inner = wrapped(e)

    def has(*types):
        return any(isinstance(x, types) for x in inner)

    if has(ConnectionRefusedError):
        return "connection refused", "unreachable"
    if has(socket.gaierror):
        return "cannot resolve the host name", "unreachable"
    if any(isinstance(x, OSError) and x.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN)
           for x in inner):
        return "network unreachable", "unreachable"
    if isinstance(e, requests.Timeout) or has(TimeoutError):
        return "timed out", "retry"
    if isinstance(e, requests.exceptions.ChunkedEncodingError) or has(
            ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.IncompleteRead):
        return "connection dropped", "retry"
    return first_line(e), "final"


def asked_wait(response):
    """The seconds a 429 or 503 answer asks to wait: its Retry-After in seconds (the HTTP-date form, which
    huggingface_hub does not read either, counts as none), else the reset time (t=) of its RateLimit header,
    which the hub sends with a 429; 0 without either."""
    if response is None:
        return 0
    retry_after = response.headers.get("Retry-After", "").strip()
    if retry_after.isdigit():
        return int(retry_after)
    reset = re.search(r";\s*t\s*=\s*(\d+)", response.headers.get("RateLimit", ""))
    return int(reset.group(1)) if reset else 0


def advice(url, path, status, kind):
    """What to do about a download of url into path that trying again will not mend (failure's kind
    "unreachable" or "final"; status: the HTTP status, if any)."""
    on_hub, file = hub_path(url) is not None, hub_file(url)
    if kind == "unreachable" and on_hub:
        return (f"offline? set HF_ENDPOINT to a mirror, or put the file at {path} or in the Hugging Face cache "
                f"({hub_cache()})")
    if kind == "unreachable":
        return f"offline? put the file at {path}, or check the URL"
    if status in (401, 403) and on_hub:
        return (f"set HF_TOKEN (a token with access to {file[0] if file else 'it'}; a gated dataset's terms "
                "accepted on its page)")
    return "check the URL; HF_ENDPOINT picks the Hugging Face mirror" if on_hub else "check the URL"


def fetch_retrying(url, path):
    """fetch(url, path + ".part"), tried again after a failure that may pass, waiting twice as long each time,
    or as long as the server asks (up to MAX_WAIT)."""
    import requests

    part = path + ".part"
    for attempt in range(1, RETRIES + 1):
        try:
            return fetch(url, part)
        except requests.RequestException as e:
            reason, kind = failure(e)
            status = e.response.status_code if e.response is not None else None
            if kind != "retry":
                fail(f"cannot download {url}: {reason}: {advice(url, path, status, kind)}")
            if attempt == RETRIES:
                kept = os.path.getsize(part) if os.path.exists(part) else 0
                rerun = "check the network and rerun"
                if status == 429:
                    rerun = "rate-limited: rerun later"
                    if hub_path(url) is not None:  # the hub limits each token, and more tightly a machine without one
                        rerun += " with HF_TOKEN set (the hub's rate limits are per token, and lowest without one)"
                fail(f"cannot download {url} after {RETRIES} attempts ({reason}): {rerun}"
                     + (f"; the {kept:,} bytes so far are kept in {part}, and the rerun resumes them" if kept else ""))
            wait = max(BACKOFF * 2 ** (attempt - 1), min(asked_wait(e.response), MAX_WAIT))
            print(f"download of {url} failed ({reason}); retry {attempt}/{RETRIES - 1} in {wait:g}s", file=sys.stderr)
            time.sleep(wait)


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):  # hashlib.file_digest needs Python 3.11
            digest.update(block)
    return digest.hexdigest()


def local_copy(url, download_dir):
    """url's complete copy in download_dir, else (a dataset file on the hub) the Hugging Face cache's; None
    when neither holds it. Under HF_HUB_OFFLINE that is an error for a file on the hub: nothing may fetch it."""
    path, file = cache_path(url, download_dir), hub_file(url)
    found = path if os.path.exists(path) else file and hub_cached(*file)
    if not found and hub_offline() and hub_path(url) is not None:
        fail(f"HF_HUB_OFFLINE is set and {url} is not at {path}"
             + (f" nor in the Hugging Face cache ({hub_cache()})" if file else "")
             + ": put the file there, or unset HF_HUB_OFFLINE to download it")
    return found or None


def download(url, download_dir, sha256=""):
    """The local copy of url: download_dir's if complete, else (a dataset file on the hub) the Hugging Face
    cache's, read where it is, else fetched into download_dir with retries. A failed download leaves nothing
    behind (the folders it made, an empty .part) but a .part with bytes in it, which the rerun resumes."""
    path = cache_path(url, download_dir)
    found = local_copy(url, download_dir)
    if found and found != path:  # the Hugging Face cache's copy: read where it is, never changed or deleted
        actual = file_sha256(found) if sha256 else ""
        if actual != sha256.lower():
            fail(f"{url}: sha256 of its copy in the Hugging Face cache ({found}) is {actual}, expected {sha256}: "
                 "check --sha256")
        return found
    part = path + ".part"
    made = make_folders(os.path.dirname(path))
    try:
        if not found:
            fetch_retrying(url, path)
            os.replace(part, path)
        if sha256:
            actual = file_sha256(path)
            if actual != sha256.lower():
                os.remove(path)
                fail(f"{url}: sha256 is {actual}, expected {sha256} (download deleted): check --sha256 or the URL")
    except BaseException as e:
        if os.path.isfile(part) and os.path.getsize(part) == 0:
            os.remove(part)
        remove_empty(made)
        if disk_full(e):
            kept = os.path.getsize(part) if os.path.isfile(part) else 0
            fail(f"the disk of download_dir={download_dir} is full ({first_line(e)}) downloading {url}: free space "
                 "on it and rerun the same command"
                 + (f"; the {kept:,} bytes so far are kept in {part}, and the rerun resumes them" if kept else ""))
        raise
    return path


# -----------------------------------------------------------------------------
# Tokenizing in worker processes, writing shards

worker_tok = None  # set in each worker process by init_worker


@contextlib.contextmanager
def signals_held(*signals):
    """Run the block with these signals (Ctrl-C's SIGINT, SIGTERM) held back, then act on those that came.
    Not signal.pthread_sigmask: it blocks the calling thread only, and numpy's BLAS threads then take the
    signal and Python runs its handler in the main thread all the same (measured)."""
    came = []
    handlers = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for s in came:
            signal.raise_signal(s)


def init_worker(tok_dir, lengths):
    global worker_tok, worker_lengths
    # Ctrl-C reaches every process of the terminal's group: the parent stops the workers and prints one line;
    # a worker of its own would print a KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_tok, worker_lengths = load_tokenizer(tok_dir), lengths  # from the files: nothing pickled


def encode_document(tok, text, lengths):
    """([BOS] + tokens, whether a segment was cut). lengths (segments): the document's SEGMENT-separated parts
    tokenized one by one, the first after BOS, each padded with BOS or cut to its length."""
    if not lengths:
        return [tok.bos_id] + tok.encode(text), False
    parts = text.split(SEGMENT)
    if len(parts) == 1:  # a plain document: one segment
        parts += [""] * (len(lengths) - 1)
    if len(parts) != len(lengths):
        raise ValueError(f"a document of {len(parts)} segments for segments of {len(lengths)} lengths")
    tokens, cut = [], False
    for i, (part, n) in enumerate(zip(parts, lengths, strict=True)):
        ids = [tok.bos_id] * (i == 0) + tok.encode(part)
        cut |= len(ids) > n
        tokens += ids[:n] + [tok.bos_id] * (n - len(ids))
    return tokens, cut


def encode_batch(docs):
    """(doc_hash, n_bytes, [BOS] + tokens, split, whether a segment was cut) for each (text, split) of a batch."""
    dtype = token_dtype(worker_tok.vocab_size)
    out = []
    for text, split in docs:
        data = text.encode("utf-8")
        tokens, cut = encode_document(worker_tok, text, worker_lengths)
        out.append((doc_hash(data), len(data), np.array(tokens, dtype=dtype), split, cut))
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


def encode_all(docs, n_workers, tok_dir, lengths):
    """encode_batch's results for every document, in order, from a pool of processes."""
    from tqdm import tqdm

    with contextlib.ExitStack() as stack:
        # the workers are forked holding Ctrl-C back until init_worker ignores it; one that came meanwhile
        # stops the pool, already in the stack, before the scratch folder the workers read goes
        with signals_held(signal.SIGINT):
            pool = stack.enter_context(multiprocessing.Pool(n_workers, init_worker, (tok_dir, lengths)))
        bar = stack.enter_context(tqdm(unit="B", unit_scale=True, desc="tokenizing"))
        # apply_async with a bounded queue rather than imap: imap reads its whole input ahead,
        # which for a big corpus means all of it in memory
        pending = collections.deque()

        def wait_for_pending(timeout=60):
            """On the way out (the end, an error, a Ctrl-C), before the pool's __exit__ terminates it: every job
            sent must have come back. terminate() joins the pool's result thread, which waits forever for the
            rest of a result whose worker it killed mid-send (a Ctrl-C hung prepare.py so on CI, and once in 24
            tries on a loaded 2-core VM). At most 2 * n_workers + 1 batches are out: ~1 s. A job whose worker
            was killed from outside never comes back: it is given up after `timeout` seconds."""
            deadline = time.monotonic() + timeout
            for job in pending:
                job.wait(max(0.0, deadline - time.monotonic()))
        stack.callback(wait_for_pending)

        def first_results():
            results = pending[0].get()
            pending.popleft()  # only once it is back: a Ctrl-C inside get() leaves it for wait_for_pending
            for result in results:
                bar.update(result[1])
                yield result

        for batch in batched(docs):
            pending.append(pool.apply_async(encode_batch, (batch,)))
            while len(pending) > 2 * n_workers or (pending and pending[0].ready()):
                yield from first_results()
        while pending:
            yield from first_results()


def write_shards(out_dir, encoded, tok, shard_tokens, threshold, smallest):
    """Pack encoded documents into shards per split (validation: hash below threshold), each also
    added to `smallest`, a SmallestHashes; returns the manifest's splits, train unigram counts and
    contamination. The split keeps duplicate texts together, yet the count is of the tokens written."""
    splits = {name: {"tokens": 0, "docs": 0, "bytes": 0, "cut": 0, "shards": []} for name in ("train", "val")}
    # token_hash of each document, 8 bytes apiece: 160 MB for the ~20M documents of 10B tokens
    hashes = {name: array.array("Q") for name in splits}
    filling = {name: [] for name in splits}  # documents of the shard being filled
    filled = dict.fromkeys(splits, 0)  # and their tokens
    counts = np.zeros(tok.vocab_size, dtype=np.int64)

    def close_shard(name):
        docs = filling[name]
        tokens = np.concatenate(docs)
        starts = np.cumsum([0] + [len(d) for d in docs[:-1]], dtype=np.int64)
        file = f"{name}_{len(splits[name]['shards']):06d}.bin"
        sha = write_shard(os.path.join(out_dir, file), tokens, tok.vocab_size, tok.bos_id, starts)
        splits[name]["shards"].append({"file": file, "docs_file": docs_file(file), "tokens": len(tokens),
                                       "docs": len(docs), "sha256": sha})
        if name == "train":
            counts[:] += np.bincount(tokens, minlength=tok.vocab_size)
        filling[name], filled[name] = [], 0

    for h, n_bytes, tokens, forced, cut in encoded:
        if not forced:  # only the hash's documents can be held out to reach min_val_tokens
            smallest.add(h, len(tokens))
        name = forced or ("val" if h < threshold else "train")
        split = splits[name]
        split["docs"] += 1
        split["cut"] += cut
        split["bytes"] += n_bytes
        split["tokens"] += len(tokens)
        filling[name].append(tokens)
        filled[name] += len(tokens)
        hashes[name].append(token_hash(tokens))
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


def listed_files(manifest):
    """The files a manifest lists besides itself: the tokenizer's, the counts, the shards and their indexes."""
    shards = [shard for split in manifest["splits"].values() for shard in split["shards"]]
    return (manifest["tokenizer_files"] + [manifest["token_counts"]]
            + [shard[key] for shard in shards for key in ("file", "docs_file")])


def is_complete(data_dir, args):
    """Whether data_dir holds a finished build of exactly these arguments, every file there and each shard
    of its size. A damaged manifest (a key missing, a value of the wrong type) is none: it is rebuilt."""
    try:
        manifest = load_manifest(data_dir)
        if manifest.get("prepare_args") != args:
            return False
        itemsize = np.dtype(manifest["token_dtype"]).itemsize
        sizes = {shard["file"]: HEADER_BYTES + shard["tokens"] * itemsize
                 for split in manifest["splits"].values() for shard in split["shards"]}
        return (all(os.path.isfile(os.path.join(data_dir, f)) for f in listed_files(manifest))
                and all(os.path.getsize(os.path.join(data_dir, f)) == size for f, size in sizes.items()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def own_file(entry):
    """Whether an entry of data_dir is a file prepare.py writes there (by its name: a damaged manifest
    cannot tell, and a hand-edited one could name a user's file)."""
    return entry.is_file(follow_symlinks=False) and (entry.name == MANIFEST or OWN_FILE.fullmatch(entry.name))


def check_own(data_dir):
    """Fail, before anything is written, when data_dir holds anything prepare.py did not write: a rebuild
    replaces prepare.py's files there, and a user's file or folder among them (notes, a run) must stay
    as it is. Its scratch folder counts as prepare.py's here; make_scratch checks that it is."""
    if not os.path.lexists(data_dir):
        return
    if not os.path.isdir(data_dir):
        fail(f"data_dir={data_dir} is not a folder: choose another --data_dir")
    with os.scandir(data_dir) as entries:
        foreign = sorted(e.name + "/" * e.is_dir() for e in entries if e.name != SCRATCH and not own_file(e))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        fail(f"{data_dir} holds what prepare.py did not write ({', '.join(foreign[:3])}{more}): "
             "move that out of it, or choose another --data_dir")


def swap_into_place(scratch, data_dir, manifest):
    """Move the new build from scratch into data_dir, then remove the old files the new manifest does not
    list. The old manifest.json goes first and the new one comes last: a crash in between leaves a data_dir
    without one, which the next run rebuilds, never a manifest beside files that are not its own. A Ctrl-C
    waits until the renames are done (milliseconds)."""
    keep = listed_files(manifest) + [MANIFEST]
    with signals_held(signal.SIGINT, signal.SIGTERM):
        if os.path.lexists(os.path.join(data_dir, MANIFEST)):
            os.remove(os.path.join(data_dir, MANIFEST))
        for name in keep:
            os.replace(os.path.join(scratch, name), os.path.join(data_dir, name))
        with os.scandir(data_dir) as entries:
            old = [e.name for e in entries if own_file(e) and e.name not in keep]
        for name in old:
            os.remove(os.path.join(data_dir, name))


def fingerprint(out_dir, tokenizer_files, splits):
    digest = hashlib.sha256()
    for name in tokenizer_files:
        with open(os.path.join(out_dir, name), "rb") as f:
            digest.update(f.read())
    for split in splits.values():
        for shard in split["shards"]:
            digest.update(shard["sha256"].encode())
    return digest.hexdigest()


def tokenize_corpus(scratch, cfg, inputs):
    """Train the tokenizer and write the shards into the scratch folder, holding out at least min_val_tokens
    where the corpus allows; returns the Tokenizer, its files, the manifest's splits, train unigram counts
    and contamination."""

    def docs():
        return documents(inputs, cfg.text_field, cfg.min_chars, cfg.max_docs, cfg.download_dir, cfg.sha256,
                         cfg.gsm8k_format)

    n_workers = cfg.workers or os.cpu_count()
    # documents whose hash is below the threshold are held out: a val_fraction of them (the hashes are
    # uniform), or, when those hold fewer than min_val_tokens tokens, as many as it takes
    threshold = base_threshold = math.ceil(cfg.val_fraction * 2**64)
    while True:  # twice at most, unless a bpe:N retrained without the new validation documents needs a third
        meta, ranks = train_tokenizer(cfg.tokenizer, lambda: (text for text, _ in docs()),
                                      lambda: bpe_training_texts(docs(), threshold, cfg.bpe_train_chars))
        tokenizer_files = save_tokenizer(scratch, cfg.tokenizer, meta, ranks)
        tok = load_tokenizer(scratch)  # what the workers and train.py will use, from the files
        smallest = SmallestHashes(cfg.min_val_tokens)
        # closed as soon as anything fails (a Ctrl-C too), not when the generator is collected: the pool stops
        # and the progress bar ends before the error line is printed
        with contextlib.closing(encode_all(docs(), n_workers, scratch, segment_lengths(cfg.segments))) as encoded:
            splits, counts, contamination = write_shards(scratch, encoded, tok, cfg.shard_tokens, threshold, smallest)
        val = splits["val"]
        if cfg.val_fraction == 0 or val["tokens"] >= cfg.min_val_tokens or smallest.threshold() is None:
            break
        print(f"validation: {val['docs']:,} documents, {val['tokens']:,} tokens, fewer than min_val_tokens="
              f"{cfg.min_val_tokens:,}: holding out more documents (the next smallest hashes) and tokenizing again")
        threshold = smallest.threshold()
        make_scratch(scratch)  # the next pass starts from an empty folder
    check_split(cfg, splits, raised=threshold > base_threshold)
    return tok, tokenizer_files, splits, counts, contamination


def check_split(cfg, splits, raised):
    """Fail on a split that cannot train: no documents, or none for training, or (val_fraction > 0) no
    validation documents, fewer than min_val_tokens tokens of them, or, where that minimum `raised` the
    threshold beyond val_fraction's, more than half of the tokens."""
    train, val = splits["train"], splits["val"]
    n_docs, n_tokens = train["docs"] + val["docs"], train["tokens"] + val["tokens"]
    if n_docs == 0:
        fail(f"no documents in {cfg.source} (check --source, --text_field, --min_chars)")
    if cfg.val_fraction > 0 and (val["tokens"] < cfg.min_val_tokens or raised and 2 * val["tokens"] > n_tokens):
        fail(f"too little data for min_val_tokens={cfg.min_val_tokens:,}: holding out that many tokens "
             f"in whole documents would leave less than half of the {n_tokens:,} tokens "
             f"({n_docs:,} documents) for training: lower --min_val_tokens or add documents "
             "(raise --max_docs)")
    if train["docs"] == 0:
        fail(f"all {n_docs} documents went to validation: lower --val_fraction")
    if cfg.val_fraction > 0 and val["docs"] == 0:
        fail(f"no document went to validation ({n_docs} documents, val_fraction={cfg.val_fraction}): "
             "raise --val_fraction or --min_val_tokens, or add documents "
             "(--val_fraction=0 trains without validation)")


def segment_lengths(spec):
    """The token lengths of --segments ("128,128,256") as ints; [] for ""."""
    if not spec:
        return []
    try:
        lengths = [int(n) for n in spec.split(",")]
    except ValueError:
        lengths = [0]
    if min(lengths) < 1:
        fail(f"segments={spec!r}: token lengths separated by commas, each at least 1, e.g. 512 or 128,128,256")
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
        fail(f"gsm8k_format=hdp makes each problem three segments (question, plan, execution): set segments to their "
             f"token lengths, e.g. --segments=128,128,256 (got {cfg.segments!r})")
    if not 0 <= cfg.val_fraction < 1:
        fail(f"val_fraction={cfg.val_fraction} must be in [0, 1)")
    for key, zero in (("min_val_tokens", "no minimum"), ("max_docs", "all"), ("max_shards", "all"),
                      ("min_chars", "keep all"), ("workers", "one per core")):
        if cfg[key] < 0:
            fail(f"{key}={cfg[key]} must be >= 0 (0: {zero})")
    for key in ("shard_tokens", "bpe_train_chars"):
        if cfg[key] <= 0:
            fail(f"{key}={cfg[key]} must be positive")
    # side by side: a download cache inside data_dir is in a rebuild's way, a data_dir inside the cache among
    # its downloads (a local source needs no download_dir, but checking always is simpler)
    check_apart(data_dir=cfg.data_dir, download_dir=cfg.download_dir)


def build(cfg):
    """Prepare cfg.data_dir: reused when it holds this exact result, else built in its scratch folder and
    moved into place. What data_dir held that prepare.py did not write stops it before it writes."""
    t0 = time.time()
    check_args(cfg)
    out_dir = os.path.normpath(cfg.data_dir)
    if holder := in_use(os.path.join(out_dir, SCRATCH)):  # one writer: its scratch folder is held while it builds
        fail(f"data_dir={out_dir} is being written by another prepare.py ({holder}): wait for it to end (or stop "
             f"it), or choose another --data_dir")
    args = {key: cfg[key] for key in OUTPUT_KEYS} | {k: cfg[k] for k, default in LATER_KEYS.items() if cfg[k] != default}
    if not cfg.force and is_complete(out_dir, args):
        print(f"{out_dir} already holds this data (same arguments, all files present): reusing it; --force rebuilds")
        return
    check_own(out_dir)
    inputs, description = resolve_sources(cfg.source, cfg.max_shards, cfg.sha256, cfg.split_paragraphs)
    if hub_offline():  # nothing comes from the hub: local_copy fails now, not hours into tokenizing, on a missing file
        for source in inputs:
            if is_url(source.location):
                local_copy(source.location, cfg.download_dir)
    made = make_folders(out_dir)
    scratch = make_scratch(os.path.join(out_dir, SCRATCH))  # inside: the moves are renames, also to a mount point
    try:
        tok, tokenizer_files, splits, counts, contamination = tokenize_corpus(scratch, cfg, inputs)
        save_npy(os.path.join(scratch, "train_counts.npy"), counts)
        manifest = {
            "format_version": VERSION,
            "tokenizer": cfg.tokenizer,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "token_dtype": token_dtype(tok.vocab_size).name,
            "tokenizer_files": tokenizer_files,
            "splits": splits,
            "token_counts": "train_counts.npy",
            "source": description,
            "prepare_args": args,
            "contamination": contamination,  # not in the fingerprint: that is of the tokenizer and shards alone
            "fingerprint": fingerprint(scratch, tokenizer_files, splits),
        }
        with open(os.path.join(scratch, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        swap_into_place(scratch, out_dir, manifest)
    finally:  # done or failed, the scratch folder goes, and a data_dir this run made if it is left empty
        remove_scratch(scratch)
        remove_empty(made)
    train, val = splits["train"], splits["val"]
    n_tokens = train["tokens"] + val["tokens"]
    print(f"train: {train['docs']:,} documents, {train['tokens']:,} tokens, shards: {len(train['shards'])}")
    print(f"validation: {val['docs']:,} documents, {val['tokens']:,} tokens ({val['tokens'] / n_tokens:.1%} of tokens) "
          "held out")
    if cfg.segments:
        cut = train["cut"] + val["cut"]
        print(f"segments {cfg.segments}: every document is {sum(segment_lengths(cfg.segments))} tokens; {cut:,} of "
              f"{train['docs'] + val['docs']:,} ({cut / (train['docs'] + val['docs']):.1%}) had a segment cut to its "
              f"length (train {train['cut']:,}, validation {val['cut']:,})")
    print(f"wrote {out_dir}: {cfg.tokenizer} tokenizer (vocab {tok.vocab_size}), fingerprint "
          f"{manifest['fingerprint'][:12]}, {time.time() - t0:.1f}s")


def main(argv):
    cfg = configurator.configure(__file__, argv)
    try:
        build(cfg)
    except OSError as e:  # a full disk, a folder that cannot be written: one line, as podgpt's own errors
        if disk_full(e):  # a write's error names no file: the folder, and that build() removed its files
            fail(f"the disk of data_dir={cfg.data_dir} is full ({first_line(e)}): free space on it and rerun the same "
                 "command (this run's partial files there are removed)")
        fail(str(e))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
