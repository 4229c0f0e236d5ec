"""
The one rule for every replace: podgpt replaces a file only when it can prove it wrote that exact
content, by its own record (the file's sha256, as written) or its own mark on the folder
(util.MARK, util.SCRATCH_MARK: a folder podgpt writes whole); otherwise one line names the file.
"""

import hashlib
import json
import os

from podgpt.core.util import MARK, SCRATCH_MARK, fail, write_atomic, write_json

RECORD = ".podgpt-files.json"  # in a folder podgpt writes files into: {name: [sha256 as written]}


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):  # hashlib.file_digest needs Python 3.11
            digest.update(block)
    return digest.hexdigest()


def shas(folder, names):
    """{name: sha256} of the files `names` in folder (an empty folder's entry has none): the
    record a later replace checks."""
    return {name: file_sha256(os.path.join(folder, name)) for name in names
            if os.path.isfile(os.path.join(folder, name))}


def edited(folder, recorded):
    """The first of the files `recorded` ({name: sha256, or a list of those}) that is in folder
    with other content."""
    for name, sha in sorted(recorded.items()):
        path = os.path.join(folder, name)
        if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)
                                      or file_sha256(path) not in accepted(sha)):
            return name
    return None


def accepted(sha):
    return [sha] if isinstance(sha, str) else sha if isinstance(sha, list) else []


def read_record(folder):
    """folder's RECORD ({} if none or unreadable: then nothing in it is proven podgpt's)."""
    try:
        with open(os.path.join(folder, RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    ok = isinstance(record, dict) and all(isinstance(v, list) for v in record.values())
    return record if ok else {}


def check_replace(folder, names, fix):
    """Stop, before anything is written, unless each of `names` already in folder is provably
    podgpt's: the folder holds podgpt's mark, or the file is as its RECORD says podgpt wrote it."""
    if os.path.isfile(os.path.join(folder, MARK)) or os.path.isfile(
            os.path.join(folder, SCRATCH_MARK)):
        return
    record = read_record(folder)
    present = [n for n in names if os.path.lexists(os.path.join(folder, n))]
    for name in present:
        if name not in record or edited(folder, {name: record[name]}):
            fail(f"{os.path.join(folder, name)} is not as podgpt wrote it (a file of yours, or "
                 f"edited since): not replacing it; move it away, or {fix}")


def replace_files(folder, texts, fix):
    """Write texts ({name: text}) into folder, each atomically, after check_replace. The record
    lists the old and the new content while they are written: a crash between proves either."""
    check_replace(folder, texts, fix)
    os.makedirs(folder, exist_ok=True)
    marked = any(os.path.isfile(os.path.join(folder, m)) for m in (MARK, SCRATCH_MARK))
    new = {n: hashlib.sha256(t.encode("utf-8")).hexdigest() for n, t in texts.items()}
    record = {} if marked else read_record(folder)
    if not marked:
        write_json(os.path.join(folder, RECORD), record | {
            n: record.get(n, [])[-1:] + [sha] for n, sha in new.items()})
    for name, text in texts.items():
        write_atomic(os.path.join(folder, name), text)
    if not marked:
        write_json(os.path.join(folder, RECORD), record | {n: [sha] for n, sha in new.items()})
