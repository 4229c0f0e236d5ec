"""Damaged inputs: a shard with a token past the vocabulary, garbage unigram counts, a truncated tokenizer, a
metrics.jsonl with a byte that is not UTF-8, a disk that fills while prepare.py writes. Each is one line that
names the file and the fix (or, for metrics.jsonl, one warning and the run goes on), no traceback, and nothing
under tmp_path added, removed or changed that the line does not account for.

The scripts run as their main in this process (conftest.run_script), on copies of the shared test dataset and
of test_bad_input.py's finished 1-step run."""
import errno
import json
import os
import re
import shutil
import zlib

import numpy as np
import pytest

from podgpt.core import data
from podgpt.corpus import download
import prepare
from podgpt.core import util
from conftest import run_script, tree
from test_bad_input import TINY_RUN, finished_run  # noqa: F401 -- a fixture: the shared finished 1-step run
from podgpt.core.tokenizer import check_tokenizer_loads


@pytest.fixture
def corpus(tmp_path):
    """A few kilobytes of text files for prepare.py."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(20):
        (root / f"{i}.txt").write_text(f"document {i}: the quick brown fox jumps over the lazy dog. " * (i + 3))
    return root


def copy_data(src, tmp_path):
    shutil.copytree(src, tmp_path / "data")
    return tmp_path / "data"


def train_args(tmp_path, *args):
    return ["train.py", f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", *TINY_RUN,
            "--max_steps=1", *args]


def refused(r, message, status=1):
    """run_script's result r ended with exit `status` and one line on stderr, "error: " + message (… stands for
    any text), and no traceback."""
    shown = f"exit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr and r.returncode == status, shown
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    pattern = ".*".join(re.escape(part) for part in ("error: " + message).split("…"))
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), shown


def refused_at_start(tmp_path, capfd, message):
    """train.py on tmp_path's data stops before its first step with `message`, and nothing under tmp_path changes."""
    before = tree(tmp_path, stat=True)
    refused(run_script(train_args(tmp_path), capfd), message)
    assert tree(tmp_path, stat=True) == before


def rewrite_checkpoint_file(ckpt, name, content):
    """A checkpoint's file replaced, its complete.json updated to match: the checkpoint reads back intact, and
    only what the file says is wrong."""
    complete = json.loads((ckpt / "complete.json").read_text())
    (ckpt / name).write_bytes(content)
    complete["files"][name] = dict(bytes=len(content), crc32=zlib.crc32(content))
    (ckpt / "complete.json").write_text(json.dumps(complete))


def set_token(path, position, value):
    tokens = np.memmap(path, dtype=data.read_header(path)["dtype"], mode="r+", offset=data.HEADER_BYTES)
    tokens[position] = value
    tokens.flush()
    del tokens


# -----------------------------------------------------------------------------
# the data: refused at the first batch that reads the damage, or at the start


@pytest.mark.parametrize("where", ["first-batch", "first-training-sample"])
def test_a_token_past_the_vocabulary_is_one_line_naming_the_shard_and_position(where, tmp_path, stdlib_data, capfd):
    """A shard whose token is id 300 in a vocabulary of 257: the model's table, padded to 320 rows, trained on it
    without a word; an id past the table is an IndexError on a CPU, a device-side assert on a GPU. Read in the
    first batch (train.py measures its speed on windows 0, 1, ... before it writes anything) or the loop's first
    sample: one line, the data left as it is, no checkpoint."""
    path = copy_data(stdlib_data, tmp_path) / "train_000000.bin"
    manifest = data.load_manifest(tmp_path / "data")
    assert len(manifest["splits"]["train"]["shards"]) == 1  # window i is tokens 64 * i ... of its one shard
    loader = data.Loader(str(tmp_path / "data"), "train", manifest, 64, 1337)  # TINY_RUN's block_size, the seed
    start = 64 * (0 if where == "first-batch" else int(loader.order(0)[0]))
    set_token(path, start + 3, 300)
    before = tree(tmp_path, stat=True)
    refused(run_script(train_args(tmp_path), capfd),
            f"{path}: token {start + 3:,} is id 300, outside the vocabulary [0, 257) of manifest.json: the shard is "
            f"damaged (manifest.json lists its sha256 to check it against): rebuild the data with python prepare.py "
            f"--data_dir={tmp_path / 'data'} --force")
    after = tree(tmp_path, stat=True)
    if where == "first-batch":
        assert after == before
    else:  # the run had started: its out_dir holds the start's files, no checkpoint
        assert {p: d for p, d in after.items() if not p.startswith("out")} == before
        assert not os.listdir(tmp_path / "out" / "ckpt")


@pytest.mark.parametrize("damage, problem", [
    (lambda path: path.write_bytes(os.urandom(3000)), "does not load as a .npy array"),
    (lambda path: np.save(path, np.ones(5, dtype=np.int32)), "holds int32[5]"),
], ids=["random-bytes", "int32[5]"])
def test_garbage_unigram_counts_are_one_line_at_the_start(damage, problem, tmp_path, stdlib_data, capfd):
    """train_counts.npy of random bytes, or of another dtype and shape: the unigram baseline reads it at the end
    of a run, so it is checked at the start, before any step is paid for."""
    damage(copy_data(stdlib_data, tmp_path) / "train_counts.npy")
    refused_at_start(tmp_path, capfd, f"{tmp_path}/data/train_counts.npy {problem}, not the int64[257] unigram "
                     f"counts of manifest.json: the data is damaged; rebuild it with python prepare.py "
                     f"--data_dir={tmp_path}/data --force")


def test_a_truncated_tokenizer_json_is_one_line_at_the_start(tmp_path, stdlib_data, capfd):
    """Every checkpoint carries a copy of the data's tokenizer files, which sample.py loads: a truncated one is
    refused before the run starts, not found once the checkpoints are written."""
    path = copy_data(stdlib_data, tmp_path) / "tokenizer.json"
    path.write_bytes(path.read_bytes()[:40])
    refused_at_start(tmp_path, capfd, f"{path} does not load (JSONDecodeError: …): the data is damaged; rebuild it "
                     f"with python prepare.py --data_dir={tmp_path}/data --force")


def test_a_checkpoint_whose_tokenizer_copy_is_truncated_is_one_line_in_sample_py(tmp_path, finished_run, capfd):
    """sample.py loads the tokenizer from the checkpoint folder: a damaged copy there is one line too."""
    out = shutil.copytree(finished_run, tmp_path / "out")
    ckpt = out / "ckpt" / "step_0000001"
    rewrite_checkpoint_file(ckpt, "tokenizer.json", (ckpt / "tokenizer.json").read_bytes()[:40])
    refused(run_script(["sample.py", f"--ckpt={ckpt}", "--max_new_tokens=4", "--device=cpu"], capfd),
            f"{ckpt}: its tokenizer files do not load (JSONDecodeError: …): pick another checkpoint (--ckpt=<folder>, "
            f"--which=latest) or export it again")


def test_a_checkpoint_config_with_a_field_model_py_does_not_know_is_one_line_in_sample_py(tmp_path, finished_run,
                                                                                        capfd):
    """A checkpoint's config.json naming a model field this model.py has no such setting for (a newer podgpt's,
    or a hand edit) was a TypeError traceback in sample.py."""
    out = shutil.copytree(finished_run, tmp_path / "out")
    ckpt = out / "ckpt" / "step_0000001"
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["n_experts"] = 8
    rewrite_checkpoint_file(ckpt, "config.json", json.dumps(config).encode())
    refused(run_script(["sample.py", f"--ckpt={ckpt}", "--max_new_tokens=4", "--device=cpu"], capfd),
            f"checkpoint {ckpt} cannot be used: config.json does not describe a model this model.py builds (TypeError: "
            f"…n_experts…): pick another (--ckpt=<folder>, --which=latest)")


def test_a_truncated_bpe_ranks_file_is_refused(corpus, tmp_path):
    """A bpe tokenizer's tokenizer.tiktoken cut mid-line (a rank repeats: tiktoken would abort with pyo3's
    PanicException, which no `except Exception` catches) or at a line's end (ranks missing, which tiktoken
    takes): one line naming the file."""
    out = tmp_path / "bpe"
    with pytest.raises(SystemExit) as stop:
        util.run_main(prepare.main, [f"--source={corpus}", f"--data_dir={out}", "--tokenizer=bpe:300",
                                     "--val_fraction=0", "--workers=1"])
    assert stop.value.code == 0
    manifest = data.load_manifest(out)
    check_tokenizer_loads(str(out), manifest)
    ranks = (out / "tokenizer.tiktoken").read_bytes()
    for cut in (len(ranks) - 3, ranks.rindex(b"\n", 0, -1) + 1):
        (out / "tokenizer.tiktoken").write_bytes(ranks[:cut])
        with pytest.raises(util.Error) as e:
            check_tokenizer_loads(str(out), manifest)
        assert str(e.value) == (
            f"the tokenizer files of {out} (tokenizer.json, tokenizer.tiktoken) do not load (ValueError: "
            f"{out}/tokenizer.tiktoken does not hold the ranks 0..298 of vocab_size 300 (a damaged or truncated "
            f"file)): the data is damaged; rebuild it with python prepare.py --data_dir={out} --force")


# -----------------------------------------------------------------------------
# metrics.jsonl: a line that is not UTF-8 is one more line that is not a metrics row

NOT_UTF8 = b'{"step": 1, "note": "\xff\xfe"}\n'


def with_bad_lines(run_dir, tmp_path, torn=b""):
    """A copy of the finished run run_dir whose metrics.jsonl has NOT_UTF8 after its rows, then `torn` (half a
    line); returns (out_dir, its rows)."""
    out = tmp_path / "out"
    shutil.copytree(run_dir, out)
    rows = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (out / "metrics.jsonl").write_bytes(b"".join(rows) + NOT_UTF8 + torn)
    return out, rows


def test_a_resume_keeps_a_line_that_is_not_utf8_and_drops_a_torn_last_line(finished_run, tmp_path, stdlib_data, capfd):
    """rewrite_metrics, as a resume starts: the line that is not UTF-8 is kept byte for byte with one warning,
    the run's own rows too, the torn last line (a run killed mid-write) goes; the run goes on and exits 0."""
    copy_data(stdlib_data, tmp_path)
    out, rows = with_bad_lines(finished_run, tmp_path, torn=b'{"step": 1, "lo')
    r = run_script(train_args(tmp_path, "--max_steps=2"), capfd)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        f"warning: {out}/metrics.jsonl: 1 line(s) not a metrics row (a JSON object with an integer step), line "
        f"{len(rows) + 1}: kept as they are; the report skips them"]
    after = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert after[:len(rows) + 1] == rows + [NOT_UTF8]
    assert [json.loads(line)["step"] for line in after[len(rows) + 1:]][-1] == 2


def test_report_skips_a_line_that_is_not_utf8_with_one_warning(finished_run, tmp_path, capfd):
    out, rows = with_bad_lines(finished_run, tmp_path)
    r = run_script(["podgpt/pod/report.py", f"--out_dir={out}"], capfd)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        f"warning: {out}/metrics.jsonl: 1 line(s) not a metrics row (a JSON object with an integer step), line "
        f"{len(rows) + 1}: the report skips them"]
    steps = {json.loads(line)["step"] for line in rows if "event" not in json.loads(line)}
    with open(out / "metrics.csv") as f:
        assert {int(line.split(",")[0]) for line in list(f)[1:]} == steps  # every good row, none lost
    assert (out / "metrics.jsonl").read_bytes() == b"".join(rows) + NOT_UTF8  # the report writes no input


# -----------------------------------------------------------------------------
# prepare.py on a disk that fills: one line naming the folder, and nothing of the build left


def disk_fills(monkeypatch, module, name, file_arg):
    """module.name writes a few bytes into its argument number file_arg (a path), then the disk is full: the
    write fails as a real one does, with ENOSPC and no file name."""
    def full(*args):
        with open(args[file_arg], "ab") as f:
            f.write(b"\x93NUMPY" * 200)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(module, name, full)


def prepare_main(*args):
    with pytest.raises(SystemExit) as stop:
        util.run_main(prepare.main, [str(a) for a in args])
    return stop.value.code


def error_line(err):
    lines = [line for line in err.splitlines() if line.startswith(("error", "Traceback"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_full_disk_under_data_dir_is_one_line_and_leaves_the_folder_as_it_was(rebuild, corpus, tmp_path, monkeypatch,
                                                                                capsys):
    """The disk fills as the first shard's index is written (a half-written file in the build's scratch
    folder): one line naming data_dir, which is as it was before (absent, or the earlier build), with no
    scratch folder left; the same command, rerun with space, builds it."""
    out = tmp_path / "data"
    args = [f"--source={corpus}", f"--data_dir={out}", "--val_fraction=0", "--workers=1", "--force"]
    if rebuild:
        assert prepare_main(*args[:-1]) == 0
    before = tree(tmp_path)
    with monkeypatch.context() as patch:
        disk_fills(patch, prepare, "save_npy", 0)  # save_npy(path, array)
        assert prepare_main(*args) == 1
    assert error_line(capsys.readouterr().err) == (
        f"error: the disk of data_dir={out} is full (OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}): "
        "free space on it and rerun the same command (this run's partial files there are removed)")
    assert tree(tmp_path) == before
    assert prepare_main(*args) == 0 and data.load_manifest(out)


def test_a_full_disk_under_download_dir_keeps_the_bytes_for_the_rerun(tmp_path, monkeypatch, capsys):
    url, cache = "http://127.0.0.1:9/big.txt", tmp_path / "downloads"
    part = download.cache_path(url, str(cache)) + ".part"
    disk_fills(monkeypatch, download, "fetch", 1)  # fetch(url, part)
    assert prepare_main(f"--source={url}", f"--data_dir={tmp_path / 'data'}", f"--download_dir={cache}",
                        "--workers=1") == 1
    assert error_line(capsys.readouterr().err) == (
        f"error: the disk of download_dir={cache} is full (OSError: [Errno {errno.ENOSPC}] "
        f"{os.strerror(errno.ENOSPC)}) downloading {url}: free space on it and rerun the same command; the 1,200 "
        f"bytes so far are kept in {part}, and the rerun resumes them")
    assert list(tree(tmp_path)) == ["downloads", "downloads/127.0.0.1_9", os.path.relpath(part, tmp_path)]
