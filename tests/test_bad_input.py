"""Bad input: every row of docs/refusals.md's "What podgpt refuses" table.

Each row builds a bad situation under tmp_path (a damaged copy of the test dataset, a
copy of a finished run with a damaged or mismatched checkpoint, a config file that
raises, ...), runs the script, and checks the contract: exit status 2 for config
mistakes (configurator.py) and 1 for the rest, one "error: ..." line on stderr naming
the problem and the fix (after "warning: ..." lines where a row expects them), no
traceback, and not one file or folder under tmp_path added, removed or modified.

A row runs the script's main in the test's own process (conftest.run_script), as its
`python script.py` line does: the same code from the command line on, without the ~2 s
of an interpreter and torch starting, which for 60 rows is most of a minute on 2 cores.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from podgpt.core.checkpoint import verify_checkpoint
from conftest import ROOT, TINY_MODEL, Captured, popen, read_metrics, run_script, shared, train_tiny, tree
from test_preflight import contaminate

# warmup within the 1 or 2 steps these runs take (more would add a warning line)
TINY_RUN = [*TINY_MODEL, "--micro_batch_size=2", "--total_batch_tokens=128", "--warmup_steps=1"]
CKPT = "ckpt/step_0000001"  # the one checkpoint of the finished run below


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, stdlib_data):
    """An out_dir with a completed 1-step run of the tiny model on stdlib_data; rows copy it."""
    def build(out):
        with Captured() as captured:  # train_tiny adds TINY_MODEL, which TINY_RUN begins with
            train_tiny(captured, out, stdlib_data, *TINY_RUN[len(TINY_MODEL):], "--max_steps=1")
    out = shared(tmp_path_factory, "bad_input_run", build)
    assert os.path.isfile(out / CKPT / "complete.json")
    return out


# -----------------------------------------------------------------------------
# setups: each gets ctx (tmp, and the fixtures' paths), builds the situation under ctx.tmp,
# and returns the script's arguments; ctx's fields fill the {placeholders} of the row's message

def data(ctx):
    """A private copy of the dataset (rows may damage it; the shared fixture stays intact)."""
    if not os.path.isdir(ctx.tmp / "data"):
        shutil.copytree(ctx.stdlib_data, ctx.tmp / "data")
    return ctx.tmp / "data"


def finished(ctx):
    """A private copy of the finished run, next to a copy of its data."""
    data(ctx)
    shutil.copytree(ctx.finished_run, ctx.tmp / "out")
    return ctx.tmp / "out"


def train_args(ctx, *args, data_dir="data", out_dir="out"):
    """train.py on the tiny model for one step, on ctx.tmp/data_dir into ctx.tmp/out_dir, then args."""
    return ["train.py", f"--data_dir={ctx.tmp / data_dir}", f"--out_dir={ctx.tmp / out_dir}", *TINY_RUN,
            "--max_steps=1", *args]


def plain_dirs(data_dir, out_dir):
    """Good data in ctx.tmp/data, and train.py given these data_dir and out_dir."""
    def setup(ctx):
        data(ctx)
        return train_args(ctx, data_dir=data_dir, out_dir=out_dir)
    return setup


def plain(*args):
    """Good data, a fresh out_dir, and these arguments."""
    def setup(ctx):
        data(ctx)
        return train_args(ctx, *args)
    return setup


def config_file(text):
    """A config file with this text, given before the arguments."""
    def setup(ctx):
        data(ctx)
        (ctx.tmp / "conf.py").write_text(text)
        return ["train.py", ctx.tmp / "conf.py", *train_args(ctx)[1:]]
    return setup


def set_header(shard, index, value):
    """Overwrite int64 number `index` of a shard's 128-int64 little-endian header."""
    def setup(ctx):
        path = data(ctx) / shard
        header = np.fromfile(path, dtype="<i8", count=128)
        header[index] = value
        with open(path, "r+b") as f:
            f.write(header.tobytes())
        return train_args(ctx)
    return setup


def cut_shard(shard, size):
    """Truncate a shard to `size` bytes (negative: that many bytes fewer)."""
    def setup(ctx):
        path = data(ctx) / shard
        ctx.full = os.path.getsize(path)
        ctx.size = size if size >= 0 else ctx.full + size
        os.truncate(path, ctx.size)
        return train_args(ctx)
    return setup


def remove(name):
    """Delete a file of the dataset that its manifest.json lists."""
    def setup(ctx):
        os.remove(data(ctx) / name)
        return train_args(ctx)
    return setup


def no_data_dir(ctx):
    return train_args(ctx, data_dir="nodata")


def garbage_manifest(ctx):
    (data(ctx) / "manifest.json").write_text("{garbage")
    return train_args(ctx)


def block_longer_than_val(ctx):
    ctx.val = json.load(open(data(ctx) / "manifest.json"))["splits"]["val"]["tokens"]
    ctx.val1 = ctx.val + 1
    return train_args(ctx, f"--block_size={ctx.val}", "--micro_batch_size=1", f"--total_batch_tokens={ctx.val}")


def flip_byte(path):
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))


def damaged_checkpoint(*args):
    """The finished run with one byte of its checkpoint's model.pt flipped."""
    def setup(ctx):
        flip_byte(finished(ctx) / CKPT / "model.pt")
        return train_args(ctx, "--max_steps=2", *[a.format(**vars(ctx)) for a in args])
    return setup


def other_shape(ctx):
    finished(ctx)
    return train_args(ctx, "--max_steps=2", "--n_layer=3")


def contaminated(ctx):
    """A dataset whose first training shard also holds a validation document."""
    contaminate(ctx.stdlib_data, ctx.tmp / "data")
    return train_args(ctx)


def resume_never_over_a_run(ctx):
    finished(ctx)
    return train_args(ctx, "--resume=never")


def other_data(ctx):
    """The finished run resumed on data whose manifest has another fingerprint (what other data has)."""
    finished(ctx)
    manifest = json.loads((ctx.tmp / "data/manifest.json").read_text())
    manifest["fingerprint"] = "0" * 64
    (ctx.tmp / "data/manifest.json").write_text(json.dumps(manifest))
    return train_args(ctx, "--max_steps=2")


def other_tokenizer(ctx):
    """The finished run resumed on data whose tokenizer file differs from the one it was trained with."""
    finished(ctx)
    with open(ctx.tmp / "data/tokenizer.json", "a") as f:
        f.write("\n")
    return train_args(ctx, "--max_steps=2")


def init_from(target, make=None):
    """Good data, a fresh out_dir, and --init_from=ctx.tmp/target, after make(ctx)."""
    def setup(ctx):
        data(ctx)
        if make:
            make(ctx)
        return train_args(ctx, f"--init_from={ctx.tmp / target}")
    return setup


def fake_export(ctx):
    """A folder holding what export.py writes (the files alone matter here)."""
    (ctx.tmp / "hf").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (ctx.tmp / "hf" / name).write_text("{}")


def resume_with_init_from(ctx):
    """The finished run (a base run, no init_from) resumed as if fine-tuned from a copy of itself."""
    shutil.copytree(finished(ctx), ctx.tmp / "base")
    return train_args(ctx, "--max_steps=2", f"--init_from={ctx.tmp / 'base'}")


def out_dir_under_a_file(ctx):
    """Tests run as root, where no permission stops a write: a path under a regular file does."""
    data(ctx)
    (ctx.tmp / "afile").write_text("a file, not a folder")
    return train_args(ctx, out_dir="afile/out")


def sample_damaged(ctx):
    flip_byte(finished(ctx) / CKPT / "model.pt")
    return ["sample.py", f"--ckpt={ctx.tmp / 'out'}", "--device=cpu", "--max_new_tokens=4"]


def sample_no_prompt_file(ctx):
    finished(ctx)
    return ["sample.py", f"--ckpt={ctx.tmp / 'out'}", "--device=cpu", "--max_new_tokens=4",
            f"--prompt_file={ctx.tmp / 'prompt.txt'}"]


def edit_manifest(change):
    """The dataset with change(manifest) applied to its manifest.json."""
    def setup(ctx):
        path = data(ctx) / "manifest.json"
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
        return train_args(ctx)
    return setup


def shard_tokens(manifest, n):
    """The first training shard listed with n more tokens than it holds, the split's total to match."""
    manifest["splits"]["train"]["shards"][0]["tokens"] += n
    manifest["splits"]["train"]["tokens"] += n


def dryrun_over_a_folder_of_mine(ctx):
    """The dry run's scratch folder names (out_dir/first, out_dir/resumed) already hold a user's files."""
    data(ctx)
    (ctx.tmp / "out/first").mkdir(parents=True)
    (ctx.tmp / "out/first/notes.txt").write_text("mine")
    return train_args(ctx, "--dryrun_steps=2")


def export_to(out, ckpt="out"):
    def setup(ctx):
        finished(ctx)
        return ["export.py", f"--ckpt={ctx.tmp / ckpt}", f"--out={ctx.tmp / out}"]
    return setup


def handoff_to(out, *args):
    """handoff.py on a copy of the finished run without its release gate (as a run from before the gates)."""
    def setup(ctx):
        summary = json.loads((finished(ctx) / "summary.json").read_text())
        summary.pop("long_run_gate", None)
        (ctx.tmp / "out" / "summary.json").write_text(json.dumps(summary))
        return ["handoff.py", f"--run={ctx.tmp / 'out'}", *([f"--out={ctx.tmp / out}"] if out else []), *args]
    return setup


def handoff_base_gone(ctx):
    """handoff.py on a copy of the finished run (its gate kept) as a fine-tuned one whose base run is not there."""
    config = json.loads((finished(ctx) / "config.json").read_text())
    (ctx.tmp / "out" / "config.json").write_text(json.dumps(dict(config, init_from=str(ctx.tmp / "gone"))))
    return ["handoff.py", f"--run={ctx.tmp / 'out'}", f"--out={ctx.tmp / 'bundle'}"]


def honesty_on(folder):
    def setup(ctx):
        (ctx.tmp / folder).mkdir()
        return ["honesty.py", f"--run={ctx.tmp / folder}"]
    return setup


def with_file(path, then):
    """A file (or, ending in /, a folder holding notes.txt) at ctx.tmp/path, then the setup `then`."""
    def setup(ctx):
        target = ctx.tmp / path
        if path.endswith("/"):
            target.mkdir(parents=True)
            target = target / "notes.txt"
        target.write_text("mine")
        return then(ctx)
    return setup


def prepare_bad_tokenizer(ctx):
    return ["prepare.py", "--tokenizer=wordpiece", f"--data_dir={data(ctx)}"]  # over existing data: kept as is


def prepare_foreign_dir(ctx):
    (ctx.tmp / "mine").mkdir()
    (ctx.tmp / "mine" / "notes.txt").write_text("not podgpt's")
    return ["prepare.py", "--max_docs=10", f"--data_dir={ctx.tmp / 'mine'}"]


def prepare_bpe_with_all_held_out(ctx):  # 16 documents cannot be sure to hold min_val_tokens' 100,000 tokens
    return ["prepare.py", "--tokenizer=bpe:2000", "--max_docs=16", f"--data_dir={ctx.tmp / 'small'}"]


def prepare_broken_eval_rows(ctx):
    (ctx.tmp / "pack").mkdir()
    (ctx.tmp / "pack" / "eval.jsonl").write_text('{"prompt": "What is 2 + 2?"}\n')  # no answer, no answer_style
    return ["prepare.py", f"--pack_dir={ctx.tmp / 'pack'}", f"--data_dir={data(ctx)}"]  # over existing data: kept


# id, setup, exit status, the error line after "error: " (… stands for any text; {placeholders} are ctx's
# fields), and the warning lines that come before it
ROWS = [
    # configurator.py: exit 2
    ("unknown-key", plain("--max_step=5"), 2, "unknown key 'max_step' (did you mean 'max_steps'?); see --help"),
    ("wrong-type", plain("--max_steps=1.5"), 2, "max_steps expects int (default 1000), got 1.5"),
    ("config-file-raises", config_file("n_layer = int('twelve')\n"), 2,
     "{tmp}/conf.py failed to run: ValueError: invalid literal for int() with base 10: 'twelve'"),
    # train.py: exit 1
    ("missing-data-dir", no_data_dir, 1,
     "no manifest.json in {tmp}/nodata: run python prepare.py --data_dir={tmp}/nodata"),
    ("unreadable-manifest", garbage_manifest, 1,
     "{tmp}/data/manifest.json is unreadable (…): rerun python prepare.py --data_dir={tmp}/data --force"),
    ("missing-counts-file", remove("train_counts.npy"), 1,
     "{tmp}/data has no train_counts.npy, which its manifest.json lists: rebuild the data with prepare.py --force"),
    ("empty-shard", cut_shard("val_000000.bin", 0), 1,
     "{tmp}/data/val_000000.bin: truncated shard (0 bytes, shorter than its 1024-byte header): "
     "rebuild the data with prepare.py --force"),
    ("truncated-shard", cut_shard("train_000000.bin", -100), 1,
     "{tmp}/data/train_000000.bin: {size} bytes, but its header promises {full} (truncated or corrupt): "
     "rebuild with prepare.py --force"),
    ("bad-magic", set_header("train_000000.bin", 0, 12345), 1,
     "{tmp}/data/train_000000.bin: not a podgpt shard (bad magic 12345, expected 20240520): "
     "rebuild the data with prepare.py --force"),
    ("bad-version", set_header("val_000000.bin", 1, 2), 1,
     "{tmp}/data/val_000000.bin: unsupported shard version 2 (this code reads 1): "
     "rebuild it with this prepare.py --force"),
    ("shard-of-another-vocabulary", set_header("train_000000.bin", 4, 50257), 1,
     "{tmp}/data/train_000000.bin: vocab_size 50257 in its header, 257 in manifest.json: "
     "rebuild the data with prepare.py --force"),
    ("vocab-smaller-than-the-data's", plain("--vocab_size=100"), 1,
     "vocab_size=100 but {tmp}/data was tokenized with byte (257 tokens): set vocab_size=None or prepare "
     "matching data"),
    ("vocab-larger-than-the-data's", plain("--vocab_size=50257"), 1,
     "preflight blocks: tokenizer_vocab: {tmp}/data: byte, 257 tokens; the model is set to vocab_size=50257: "
     "set vocab_size=None or prepare matching data (or allow_unsafe=True to train anyway)"),
    ("contaminated-data", contaminated, 1,
     "preflight blocks: contamination: 1 training documents are also validation documents "
     "(or allow_unsafe=True to train anyway)"),
    ("block-longer-than-val", block_longer_than_val, 1,
     "the val split of {tmp}/data has fewer than block_size+1 = {val1} tokens: lower block_size or prepare more data"),
    ("spot-price-over-the-ceiling", plain("--usd_per_gpu_hour=1.5", "--max_usd_per_gpu_hour=1.4"), 1,
     "usd_per_gpu_hour=1.5 is above max_usd_per_gpu_hour=1.4, the run's spot ceiling: wait for a lower price or "
     "another provider, or raise the ceiling if the budget allows"),
    ("no-checkpoint-to-resume", plain("--resume=/nonexistent"), 1,
     "resume=/nonexistent: no checkpoint there (give a checkpoint folder or an out_dir with ckpt/latest)"),
    ("corrupt-checkpoint", damaged_checkpoint("--resume={tmp}/out/" + CKPT), 1,
     "checkpoint {tmp}/out/" + CKPT + " is damaged: model.pt is corrupt (CRC32 …): give another checkpoint "
     "folder or --resume=auto"),
    ("all-checkpoints-damaged", damaged_checkpoint(), 1,
     "no checkpoint in {tmp}/out/ckpt reads back intact (see the warnings): move them away to start over, or give "
     "resume= a checkpoint folder",
     ["skipping checkpoint {tmp}/out/" + CKPT + ": model.pt is corrupt (CRC32 …)"]),
    ("checkpoint-of-another-shape", other_shape, 1,
     "checkpoint {tmp}/out/" + CKPT + " has another model shape (n_layer 2 -> 3): use a new out_dir, or the "
     "checkpoint's shape"),
    ("resume-never-over-a-finished-run", resume_never_over_a_run, 1,
     "resume=never but {tmp}/out/ckpt holds checkpoints of an earlier run: use a new out_dir, or move them away"),
    ("checkpoint-of-other-data", other_data, 1,
     "checkpoint {tmp}/out/" + CKPT + " was trained on other data than {tmp}/data (manifest fingerprint differs): "
     "point data_dir at its data, or --allow_resume_mismatch=True to continue on this data"),
    ("checkpoint-of-another-tokenizer", other_tokenizer, 1,
     "checkpoint {tmp}/out/" + CKPT + " was trained with another tokenizer (byte:…) than {tmp}/data (byte:…): "
     "point data_dir at its data, or --allow_resume_mismatch=True"),
    ("resume-with-another-init-from", resume_with_init_from, 1,
     "checkpoint {tmp}/out/" + CKPT + " records init_from=(none), and this resume gives init_from={tmp}/base: "
     "resume with no --init_from (the recorded value), or use a new out_dir to fine-tune from {tmp}/base"),
    ("init-from-nothing", init_from("bsae"), 1,
     "init_from={tmp}/bsae holds no checkpoint: it is nothing: no such file or folder; give the base run's "
     "out_dir or one of its ckpt/step_NNNNNNN folders"),
    ("init-from-an-export", init_from("hf", fake_export), 1,
     "init_from={tmp}/hf holds no checkpoint: it is an export (export.py's); give the base run's out_dir or one "
     "of its ckpt/step_NNNNNNN folders"),
    ("init-from-its-own-out-dir", init_from("out"), 1,
     "init_from={tmp}/out holds no checkpoint: it is this run's own out_dir; give the base run's out_dir or one "
     "of its ckpt/step_NNNNNNN folders"),
    ("init-from-a-data-dir", init_from("data"), 1,
     "init_from={tmp}/data holds no checkpoint: it is a data_dir (prepare.py's); give the base run's out_dir or "
     "one of its ckpt/step_NNNNNNN folders"),
    ("out-dir-is-data-dir", plain_dirs("data", "data"), 1,
     "out_dir={tmp}/data and data_dir={tmp}/data are the same folder: give each its own folder, side by side"),
    ("out-dir-inside-data-dir", plain_dirs("data", "data/run"), 1,
     "out_dir={tmp}/data/run lies inside data_dir={tmp}/data: give each its own folder, side by side"),
    ("data-dir-inside-out-dir", plain_dirs("out/data", "out"), 1,
     "data_dir={tmp}/out/data lies inside out_dir={tmp}/out: give each its own folder, side by side"),
    ("empty-out-dir", plain("--out_dir="), 1, "out_dir is empty: name a folder (e.g. --out_dir=out)"),
    ("dryrun-over-a-folder-of-mine", dryrun_over_a_folder_of_mine, 1,
     "{tmp}/out/first is in podgpt's way and podgpt did not make it (it holds no PODGPT_SCRATCH file): "
     "move or rename it, then rerun"),
    ("manifest-without-a-key", edit_manifest(lambda m: m.pop("splits")), 1,
     "{tmp}/data/manifest.json has no 'splits': rerun python prepare.py --data_dir={tmp}/data --force"),
    ("manifest-splits-null", edit_manifest(lambda m: m.update(splits=None)), 1,
     "{tmp}/data/manifest.json has splits=null, a JSON null where an object belongs: "
     "rerun python prepare.py --data_dir={tmp}/data --force"),
    ("manifest-vocab-size-a-string", edit_manifest(lambda m: m.update(vocab_size="257")), 1,
     '{tmp}/data/manifest.json has vocab_size="257", a JSON string where an integer belongs: '
     "rerun python prepare.py --data_dir={tmp}/data --force"),
    ("manifest-bos-id-out-of-range", edit_manifest(lambda m: m.update(bos_id=300)), 1,
     "{tmp}/data/manifest.json has bos_id=300, outside the vocabulary [0, 257): "
     "rerun python prepare.py --data_dir={tmp}/data --force"),
    ("manifest-split-total-disagrees", edit_manifest(lambda m: m["splits"]["val"].update(tokens=1)), 1,
     "{tmp}/data/manifest.json counts 1 val tokens, but its val shards …: "
     "rerun python prepare.py --data_dir={tmp}/data --force"),
    ("manifest-shard-tokens-disagree", edit_manifest(lambda m: shard_tokens(m, 64)), 1,
     "{tmp}/data/train_000000.bin: n_tokens … in its header, … in manifest.json: rebuild the data with "
     "prepare.py --force"),
    ("out-dir-under-a-file", out_dir_under_a_file, 1,
     "out_dir {tmp}/afile/out is not writable (NotADirectoryError: …): choose another out_dir"),
    ("batch-not-divisible", plain("--micro_batch_size=3", "--total_batch_tokens=500"), 1,
     "total_batch_tokens=500 is not a multiple of micro_batch_size*block_size*world_size = 3*64*1 = 192: "
     "use a multiple of 192"),
    ("zero-steps", plain("--max_steps=0"), 1, "max_steps=0 must be positive"),
    ("infinite-learning-rate", plain("--learning_rate=1e999"), 2,
     "learning_rate=inf is not a finite number: give a number (default 0.0003)"),
    ("nan-learning-rate-in-a-config-file", config_file("learning_rate = float('nan')\n"), 2,
     "learning_rate=nan is not a finite number: give a number (default 0.0003)"),
    ("zero-learning-rate", plain("--learning_rate=0"), 1, "learning_rate=0.0 must be positive"),
    ("negative-learning-rate", plain("--learning_rate=-1e-3"), 1, "learning_rate=-0.001 must be positive"),
    ("zero-micro-batch", plain("--micro_batch_size=0"), 1, "micro_batch_size=0 must be positive"),
    ("min-lr-above-lr", plain("--min_lr=1e-2"), 1,
     "min_lr=0.01 is above learning_rate=0.001: the schedule decays from learning_rate to min_lr"),
    ("unknown-dist-mode", plain("--dist_mode=zero3"), 1, "dist_mode='zero3' is not one of ddp, fsdp"),
    ("unknown-compile-mode", plain("--compile_mode=fast"), 1,
     "compile_mode='fast' is not one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
    # a likely typo: a KeyError traceback in preflight.py before
    ("unknown-gate-profile", plain("--gate_profile=skills"), 2,
     "gate_profile='skills' is not one of research, release, skill_release"),
    ("target-band-upside-down", plain("--target_val_loss=3.5,3.2"), 2,
     "target_val_loss=(3.5, 3.2) is neither a loss nor a band: give a number (the final validation loss at most "
     "that) or \"lo,hi\" with 0 < lo < hi (within it, e.g. \"3.20,3.50\")"),
    ("target-not-a-number", config_file("target_val_loss = '3.2-3.5'\n"), 2,
     "target_val_loss='3.2-3.5' is neither a loss nor a band: give a number (the final validation loss at most "
     "that) or \"lo,hi\" with 0 < lo < hi (within it, e.g. \"3.20,3.50\")"),
    # sanity.py: exit 1
    ("sanity-out-dir-is-data-dir", lambda ctx: ["sanity.py", f"--data_dir={data(ctx)}", f"--out_dir={ctx.tmp / 'data'}"],
     1, "out_dir={tmp}/data and data_dir={tmp}/data are the same folder: give each its own folder, side by side"),
    # sample.py: exit 1
    ("sample-corrupt-checkpoint", sample_damaged, 1,
     "checkpoint {tmp}/out/" + CKPT + " cannot be used: model.pt is corrupt (CRC32 …): pick another "
     "(--ckpt=<folder>, --which=latest)"),
    ("sample-missing-prompt-file", sample_no_prompt_file, 1,
     "cannot read prompt_file {tmp}/prompt.txt (FileNotFoundError: …): give a UTF-8 text file or --prompt=TEXT"),
    # export.py: exit 1
    ("export-out-is-a-file", with_file("afile", export_to("afile")), 1,
     "out={tmp}/afile is a file, not a folder: give the path of a folder to write (it is created)"),
    ("export-out-under-a-file", with_file("afile", export_to("afile/x")), 1,
     "cannot write out={tmp}/afile/x (NotADirectoryError: …): choose another --out"),
    ("export-into-the-run", export_to("out/export"), 1,
     "out={tmp}/out/export lies inside ckpt={tmp}/out: give each its own folder, side by side"),
    ("export-over-a-folder-of-mine", with_file("mine/", export_to("mine")), 1,
     "out={tmp}/mine holds what export.py did not write (notes.txt): not replacing this folder; choose another "
     "--out or move those away"),
    ("export-scratch-name-taken", with_file(".x.podgpt-export/", export_to("x")), 1,
     "{tmp}/.x.podgpt-export is in podgpt's way and podgpt did not make it (it holds no PODGPT_SCRATCH file): "
     "move or rename it, then rerun"),
    # handoff.py: the finished run has no release gate recorded
    ("handoff-no-gate", handoff_to("bundle"), 1,
     "run={tmp}/out: no release gate recorded (summary.json has no long_run_gate): not handing it off; train it with "
     "this podgpt, or give --override_gate=True to bundle it anyway (README.md's first line then says so)"),
    ("handoff-over-a-folder-of-mine", with_file("mine/", handoff_to("mine", "--override_gate=True")), 1,
     "out={tmp}/mine holds what handoff.py did not write (notes.txt): not replacing this folder; choose another "
     "--out or move those away"),
    ("handoff-into-the-run", handoff_to("out/bundle"), 1,
     "out={tmp}/out/bundle lies inside run={tmp}/out: give each its own folder, side by side"),
    ("handoff-base-gone", handoff_base_gone, 1,
     "run={tmp}/out: its base run {tmp}/gone (init_from={tmp}/gone) has no readable summary.json: not handing it "
     "off; put the base run's folder back there"),
    ("handoff-no-out", handoff_to(None), 2, "no --out: give the bundle's folder, e.g. --out=handoff/tiny_skills"),
    ("honesty-not-a-run", honesty_on("empty"), 1,
     "run={tmp}/empty: no readable summary.json there: give a train.py out_dir whose run has ended"),
    # prepare.py: exit 1
    ("prepare-unknown-tokenizer", prepare_bad_tokenizer, 1,
     "unknown tokenizer 'wordpiece': use gpt2, byte, char or bpe:N with N > 256 (e.g. bpe:8192)"),
    ("prepare-over-a-foreign-folder", prepare_foreign_dir, 1,
     "{tmp}/mine holds what prepare.py did not write (notes.txt): move that out of it, or choose another --data_dir"),
    ("prepare-bpe-with-every-document-held-out", prepare_bpe_with_all_held_out, 1,
     "no training document for bpe:N to learn from: every one may be held out for validation (lower "
     "--min_val_tokens or --val_fraction, or add documents)"),
    ("prepare-broken-eval-rows", prepare_broken_eval_rows, 1,
     "{tmp}/pack/eval.jsonl:1: no field 'category' (a row is {{category, prompt, answer, scratchpad, answer_style}})"),
]


def says(line, prefix, message, ctx):
    """Whether line is prefix + message, where … in message stands for any text."""
    pattern = ".*".join(re.escape(part) for part in (prefix + message.format(**vars(ctx))).split("…"))
    return re.fullmatch(pattern, line) is not None


@pytest.mark.parametrize("setup, status, message, warns", [(*r[1:4], r[4] if len(r) > 4 else []) for r in ROWS],
                         ids=[r[0] for r in ROWS])
def test_refused_with_one_line(tmp_path, stdlib_data, finished_run, setup, status, message, warns, capfd):
    ctx = SimpleNamespace(tmp=tmp_path, stdlib_data=stdlib_data, finished_run=finished_run)
    args = setup(ctx)
    before = tree(tmp_path, stat=True)
    r = run_script(args, capfd)
    shown = f"exit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, shown
    assert r.returncode == status, shown
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == len(warns) + 1, shown
    for line, warning in zip(lines, warns):
        assert says(line, "warning: ", warning, ctx), shown
    assert says(lines[-1], "error: ", message, ctx), shown
    after = tree(tmp_path, stat=True)
    changed = sorted(p for p in before if p in after and before[p] != after[p])
    assert (sorted(set(after) - set(before)), sorted(set(before) - set(after)), changed) == ([], [], []), \
        "(added, removed, changed) under tmp_path"


def test_resume_keeps_lines_it_did_not_write_and_warns_of_a_short_warmup(tmp_path, stdlib_data, finished_run, capfd):
    """Lines of metrics.jsonl that are not podgpt's rows (an array, a string, a row whose step is not an
    integer) survive a resume, which drops only its own rows past the checkpoint, and are named in one
    warning; warmup_steps beyond max_steps is a warning too. The run goes on and exits 0."""
    ctx = SimpleNamespace(tmp=tmp_path, stdlib_data=stdlib_data, finished_run=finished_run)
    out = finished(ctx)
    rows = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    foreign = ['[1, 2]\n', '"a string"\n', '{"step": "one"}\n']
    (out / "metrics.jsonl").write_text("".join(rows + foreign))
    r = run_script(train_args(ctx, "--max_steps=2", "--warmup_steps=5"), capfd)
    shown = f"exit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    assert r.returncode == 0 and "Traceback" not in r.stderr, shown
    n = len(rows)
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        "warning: warmup_steps=5 is more than max_steps=2: the learning rate stops at 0.0004, short of "
        "learning_rate=0.001",
        f"warning: {out}/metrics.jsonl: 3 line(s) not a metrics row (a JSON object with an integer step), line "
        f"{n + 1}, {n + 2}, {n + 3}: kept as they are; the report skips them"], shown
    after = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert after[:n + 3] == rows + foreign  # the run's own rows of steps 0-1, then the foreign lines, as they were
    assert [json.loads(line)["step"] for line in after[n + 3:]][-1] == 2


def test_a_second_ctrl_c_ends_train_py_at_once_with_one_line(tmp_path, stdlib_data):
    """The first Ctrl-C asks for a checkpoint at the step's end; a second one right after ends the process
    there: one line, exit 130, and nothing half-written left where a resume would read it."""
    out = tmp_path / "out"
    p = popen([sys.executable, "train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_RUN,
               "--max_steps=100000", "--log_every=1", "--eval_every=100000", "--ckpt_every=100000", "--plots=True"],
              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (out / "metrics.jsonl").exists() or not read_metrics(out):
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        # two signals before Python's handler runs are one (a backward pass is one C call: under load it outlasts
        # any fixed pause), so the second is sent once the stop is under way: its checkpoint folder exists, and
        # the save and the report's plots (~1 s) are still ahead, not the process's exit (a signal there ends it
        # as SIGINT does)
        deadline = time.time() + 30
        while not os.listdir(out / "ckpt"):
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted (Ctrl-C)"
    assert all(line.endswith("\n") for line in open(out / "metrics.jsonl"))
    for name in os.listdir(out / "ckpt"):  # a checkpoint folder there is a whole one
        if name.startswith("step_"):
            verify_checkpoint(str(out / "ckpt" / name))
