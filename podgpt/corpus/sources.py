"""The sources prepare.py reads (resolve_sources) and their documents, in order (documents); a
comma-separated spec concatenates them:
- stdlib: the .py files of this Python's standard library, one document per file;
- a file or folder (walked, sorted by relative path): .txt/.md/.py one document per file (or per
  paragraph with split_paragraphs), .jsonl one per line, .parquet one per row (field text_field);
- an http(s) URL, downloaded (download.py), then read as a file;
- a preset: tinyshakespeare, or the Hugging Face datasets fineweb-edu-10bt, climbmix and gsm8k,
  which keeps its own split (test as validation), a problem per document (tasks.gsm8k_documents)."""

import collections
import difflib
import json
import os
import platform
import re
import sysconfig
import urllib.parse

from podgpt.corpus.download import download
from podgpt.corpus.tasks import gsm8k_documents, pack_documents
from podgpt.core.util import fail, first_line

TEXT_EXTS = (".txt", ".md", ".py")  # read whole, one document per file
SOURCE_EXTS = TEXT_EXTS + (".jsonl", ".parquet")

TINYSHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                       "tinyshakespeare/input.txt")
# Hugging Face dataset presets: (repo, files), as the repos lay them out: fineweb-edu's sample/10BT
# is 14 files; climbmix ends at shard_06542 (MAX_SHARD in karpathy/autoresearch's prepare.py)
HF_PRESETS = {
    "fineweb-edu-10bt": ("HuggingFaceFW/fineweb-edu",
                         [f"sample/10BT/{i:03d}_00000.parquet" for i in range(14)]),
    "climbmix": ("karpathy/climbmix-400b-shuffle",
                 [f"shard_{i:05d}.parquet" for i in range(6543)]),
    # the dataset's main config: 7,473 training and 1,319 test problems
    "gsm8k": ("openai/gsm8k",
              ["main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet"]),
}
PRESETS = ("tinyshakespeare",) + tuple(HF_PRESETS)
GSM8K_SPLITS = ("train", "val")  # the split of each gsm8k file's problems: its train, its test
GSM8K_FORMATS = ("qa", "hdp")


def is_url(location):
    return location.startswith(("http://", "https://"))


def preset_urls(name):
    if name == "tinyshakespeare":
        return [TINYSHAKESPEARE_URL]
    from huggingface_hub import hf_hub_url

    repo, files = HF_PRESETS[name]  # main: no pinned commit
    return [hf_hub_url(repo, file, repo_type="dataset", revision="main") for file in files]


def walk(root, exts, skip_dirs=()):
    """Files under root ending in exts, sorted by relative path."""
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs]
        paths += [os.path.join(folder, f) for f in files if f.lower().endswith(exts)]
    return sorted(paths, key=lambda p: os.path.relpath(p, root))


class Source(collections.namedtuple("Source", "location paragraphs split form",
                                    defaults=(None, None))):
    """One input: a path or URL; paragraphs: split a text file at blank lines; split: None (by hash)
    or the split of all its documents; form: None (by file type) or "gsm8k" (its two columns)."""


def resolve_sources(spec, max_shards, sha256, split_paragraphs):
    """[Source] for a source spec, and a description of it."""
    inputs, parts = [], []
    for part in (p.strip() for p in spec.split(",")):
        # tinyshakespeare is one file: its blank-line separated speeches are the documents
        paragraphs = split_paragraphs or part == "tinyshakespeare"
        if part == "stdlib":
            files = walk(sysconfig.get_paths()["stdlib"], (".py",),
                         ("site-packages", "dist-packages"))
            parts.append(f"stdlib (Python {platform.python_version()}, {len(files)} files)")
        elif part in PRESETS:
            urls = preset_urls(part)
            files = urls[:max_shards] if max_shards > 0 else urls
            parts.append(f"{part} ({len(files)} of {len(urls)} files from "
                         f"{os.path.dirname(urls[0])})")
            if part == "gsm8k":  # the dataset's own split, not the hash's
                inputs += [Source(url, False, split, "gsm8k")
                           for url, split in zip(files, GSM8K_SPLITS)]
                continue
        elif is_url(part):
            files = [part]
            parts.append(part)
        elif os.path.isfile(part) or os.path.isdir(part):
            files = walk(part, SOURCE_EXTS) if os.path.isdir(part) else [part]
            if not files:
                fail(f"no {'/'.join(SOURCE_EXTS)} files under {part}")
            parts.append(f"{part} ({len(files)} files)")
        else:
            close = difflib.get_close_matches(part, PRESETS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"presets: {', '.join(PRESETS)}"
            fail(f"source '{part}' is not stdlib, a preset, a URL or an existing file or folder "
                 f"({hint})")
        inputs += [Source(f, paragraphs) for f in files]
    for loc in (s.location for s in inputs):  # every input readable, before any download
        name = urllib.parse.urlsplit(loc).path if is_url(loc) else loc
        if not name.lower().endswith(SOURCE_EXTS):
            fail(f"{loc}: unsupported file type (use {', '.join(SOURCE_EXTS)})")
    if sha256 and not (len(inputs) == 1 and is_url(inputs[0].location)):
        fail(f"--sha256 checks a single-URL source; this source has {len(inputs)} inputs: "
             "drop --sha256 or give one URL")
    return inputs, " + ".join(parts)


def read_documents(path, text_field, split_paragraphs):
    """The documents of one local file, by extension (split_paragraphs: for text files)."""
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".jsonl":
            yield from read_jsonl(path, text_field)
        elif ext == ".parquet":
            yield from read_parquet(path, text_field)
        else:  # TEXT_EXTS, as resolve_sources checked; newline="": keep \r\n
            with open(path, encoding="utf-8", errors="replace", newline="") as f:
                text = f.read()
            if split_paragraphs:  # at lines holding only whitespace; \r\n line ends too
                yield from (p for p in re.split(r"\r?\n(?:[ \t]*\r?\n)+", text) if p.strip())
            else:
                yield text
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}")


def read_jsonl(path, text_field):
    """The field text_field of each line of a JSONL file; one line naming a bad line."""
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


def read_parquet(path, text_field):
    import pyarrow.parquet as pq
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
            fail(f"cannot read {path} as parquet (row group {i + 1} of {pf.num_row_groups}): "
                 f"{first_line(e)}")
        for text in (t for t in texts if t is not None):
            if not isinstance(text, str):
                fail(f"{path}: column '{text_field}' holds {type(text).__name__}, not text")
            yield text


def documents(inputs, text_field, min_chars, max_docs, download_dir, sha256, gsm8k_format="qa",
              chat=False):
    """(text, the split it must go to or None for the hash's) of every document of the inputs in
    order, downloading URLs when reached."""
    n = 0
    for source in inputs:
        path = source.location
        if is_url(path):
            path = download(path, download_dir, sha256)
        if source.form == "gsm8k":
            columns = (list(read_parquet(path, column)) for column in ("question", "answer"))
            texts = gsm8k_documents(path, *columns, gsm8k_format)
        elif chat:
            texts = pack_documents(path)
        else:
            texts = read_documents(path, text_field, source.paragraphs)
        for text in (t for t in texts if len(t) >= min_chars):
            yield text, source.split
            n += 1
            if n == max_docs:
                return
