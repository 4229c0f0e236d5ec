"""
The hand-off bundle of a run: everything a team taking the model needs, in one folder with a
checksum for every file, made only when the run's release gate is acceptable.

    python handoff.py --run=out/tiny_skills/sft --out=handoff/tiny_skills
    python handoff.py --run=out/tiny_skills/sft --out=handoff/tiny_skills --override_gate=True
    python handoff.py --run=out/tiny_skills/sft --out=handoff/tiny_skills-base --base_only=True

A fine-tuned run's bundle holds its base model too (base/: the checkpoint its init_from names, as
train.py read it), and stops in one line when that base run is gone or its checkpoint unusable.
The gate is summary.json's "long_run_gate" (train.py, eval.py), of each model bundled: pass or warn
goes on; block, or none recorded, stops in one line unless override_gate=True, and then README.md's
first line says so.
README.md's table lists what the bundle holds; podgpt-handoff.json records its files. It is built
beside out and renamed into place; an earlier bundle there is replaced only when it holds nothing
but the files its podgpt-handoff.json lists.
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import contextlib
import hashlib
import os
import shutil
import sys
import sysconfig

from podgpt.core import configurator
import honesty
from podgpt.core.checkpoint import reading
from podgpt.core.data import tokenizer_fingerprint
from podgpt.core.owned import file_sha256, shas
from podgpt.release.hf import (DTYPES, as_recorded, card_usage, check_replaceable, export,
                               finish_replace, put_in_place, scratch_beside)
from podgpt.corpus.sources import PRESETS, is_url, resolve_sources
from podgpt.pod.report import read_json
from podgpt.core.util import (MAKE_ROOM, SCRATCH_MARK, Error, check_apart, disk_full, fail,
                              files_under, first_line, run_main, write_atomic, write_json)

# --- config
run = ""                        # the run folder to hand off (a train.py out_dir); "": out_dir
out_dir = "out"                 # used when run is empty (a run's config file finds its folder)
which = "best"                  # the checkpoint: best (lowest val loss, else latest) | latest
out = ""                        # the bundle's folder (required); replaces an earlier bundle
weights_dtype = "float32"       # the exported weights: float32 | bfloat16
override_gate = False           # bundle despite a block or no gate; README's first line says so
examples = 4                    # eval.json's recorded replies quoted in README.md
base_only = False               # the base model alone: an SFT run's base run, or the run itself
# --- end config

RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "preflight.md", "preflight.json",
             "eval.json", "eval.md")
CHECKSUMS = "checksums.sha256"
BUNDLE_MARK = "podgpt-handoff.json"  # what the bundle holds: a later bundle replaces only that
BASE = "base"  # a fine-tuned model's base model in its bundle: its export and its reports


def models(run, folder, cfg):
    """What the bundle holds, the handed-off model first: [(prefix of its lines, its run, its
    checkpoint's source, which)]; a fine-tuned run's base, from the checkpoint train.py started
    from (init_from: an out_dir's latest); base_only: the base alone."""
    init_from = run["config"].get("init_from")
    given = ("", run, folder, cfg.which)
    if not init_from:
        return [given]  # a pretraining run: its model is the base
    if run["base"] is None:
        fail(f"run={folder}: its base run {run['base_dir']} (init_from={init_from}) has no "
             "readable summary.json: not handing it off; put the base run's folder back there")
    base = (f"the base run {run['base_dir']}: ", run["base"], init_from, "latest")
    return [base] if cfg.base_only else [given, base]


def gate_check(folder, status, override, prefix=""):
    """None when the release gate lets the run go; else why not (util.Error unless override).
    prefix: whose gate it is when not the run's own (its base run's)."""
    if not status["recorded"]:
        why = "no release gate recorded (summary.json has no long_run_gate)"
        fix = "train it with this podgpt"
    elif status["verdict"] not in ("pass", "warn"):  # block (or a verdict no profile gives)
        blocking = ", ".join(g["name"] for g in status["blocking"]) or "see summary.json"
        why = f"the release gate ({status['profile']}) is {status['verdict']}: {blocking}"
        fix = "fix what blocks"
    else:
        return None
    why = prefix + why
    if not override:
        fail(f"run={folder}: {why}: not handing it off; {fix}, or give --override_gate=True to "
             "bundle it anyway (README.md's first line then says so)")
    return why


def source_hashes(args):
    """Each source of prepare.py's arguments with the sha256 of the files it reads, hashed now (the
    shards' sha256s are what trained)."""
    return [source_hash(p.strip(), args) for p in args.get("source", "").split(",") if p.strip()]


def source_hash(part, args):
    if part in PRESETS or is_url(part):  # a download: its sha256 only as prepare.py checked it
        given = args.get("sha256") or None
        return dict(source=part, files=None, sha256=given,
                    how="prepare.py's --sha256, checked at download" if given else
                    "not recorded: a URL or preset; prepare.py checks a download's sha256 only "
                    "when --sha256 is given")
    try:
        found, description = resolve_sources(part, 0, "", False)
    except Error as e:  # gone or unreadable: the rest of the recipe still stands
        return dict(source=part, files=None, sha256=None, how=f"not recorded: {e}")
    files = [s.location for s in found]
    if files == [part]:  # a file, not a folder
        return dict(source=part, files=1, sha256=file_sha256(part), how="sha256 of the file")
    root = sysconfig.get_paths()["stdlib"] if part == "stdlib" else part
    lines = "".join(f"{file_sha256(f)}  {os.path.relpath(f, root)}\n" for f in files)
    return dict(source=part, files=len(files), sha256=hashlib.sha256(lines.encode()).hexdigest(),
                how=f"sha256 of the sorted 'sha256  path' lines of the files of {description}, "
                    "here")


def data_recipe(data_dir, manifest):
    """What data_dir holds and how prepare.py made it, from its manifest.json (as read)."""
    if not isinstance(manifest, dict):
        return {"data_dir": data_dir, "missing": "no readable manifest.json there"}
    args = manifest.get("prepare_args", {})
    sources, packs = source_hashes(args), {}
    for s in sources:  # a skills pack's file: its sha256 now against the one its pack recorded
        name, pack = os.path.basename(s["source"]), None
        if os.path.isfile(s["source"]):
            pack = read_json(os.path.join(os.path.dirname(s["source"]), "manifest.json"))
        if isinstance(pack, dict) and name in pack.get("files", {}):
            packs[s["source"]] = pack
            s["matches_pack"] = pack["files"][name]["sha256"] == s["sha256"]
    try:
        tokenizer = tokenizer_fingerprint(data_dir, manifest)
    except OSError as e:
        tokenizer = f"unreadable ({first_line(e)})"
    files = [f for f in manifest.get("tokenizer_files", [])
             if os.path.isfile(os.path.join(data_dir, f))]
    return {"data_dir": data_dir, "source": manifest.get("source"), "prepare_args": args,
            "sources": sources, "skills_packs": packs, "tokenizer": manifest.get("tokenizer"),
            "tokenizer_fingerprint": tokenizer,
            "tokenizer_files": {f: file_sha256(os.path.join(data_dir, f)) for f in files},
            "fingerprint": manifest.get("fingerprint"),
            "contamination": manifest.get("contamination"),
            "shards": [dict(split=name, file=s["file"], tokens=s["tokens"], sha256=s["sha256"])
                       for name, split in manifest.get("splits", {}).items()
                       for s in split.get("shards", [])]}


def recipe(run):
    """The exact data behind a run's model (honesty.read_run's): the base data's recipe, the SFT
    data's for a fine-tuned run, and the skills pack eval.py asked, by its manifest."""
    eval_pack = ((run["eval"] or {}).get("pack") or {}).get("folder")
    parts = {"sft": run, "base": run["base_data"]} if run["base_dir"] else {"base": run}
    out = {name: data_recipe(r["config"].get("data_dir", ""), r["data"]) if r else
           {"data_dir": None, "missing": f"the base run ({run['base_dir']}) is not there to read"}
           for name, r in parts.items()}
    out["eval_pack"] = None if not eval_pack else {
        "folder": eval_pack, "manifest": read_json(os.path.join(eval_pack, "manifest.json"))}
    out["init_from"] = run["config"].get("init_from") or None
    return out


def copy_run(folder, dest):
    os.makedirs(dest)
    for name in RUN_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(dest, name))


def usage(model, where):
    """The export's own code (hf.card_usage) that loads `model` from `where` in the bundle."""
    # tokenizer_config.json is written with tokenizer.json, or neither is
    hf_tokenizer = read_json(os.path.join(model, "tokenizer_config.json"))
    bos = (read_json(os.path.join(model, "config.json")) or {}).get("bos_token_id")
    return card_usage(where, bos, hf_tokenizer is not None, "chat_template" in (hf_tokenizer or {}))


def readme(name, h, why, tmp, data, shown, base):
    """README.md: its first line says when the bundle was made against its release gate; its Use,
    the export's own code for model/, run from the bundle; base: the base model's record, if any."""
    head = [f"**NOT ACCEPTABLE FOR RELEASE: {why}; this bundle was made anyway (handoff.py "
            "--override_gate=True).**", ""] if why else []
    examples = [f"- ({e['category']}) {e['prompt']!r} -> {e['final_answer']!r} "
                f"(expected {e['answer']!r})" for e in shown]
    recipes = [f"- {part} data: `{r.get('data_dir')}` from {r.get('source')}, tokenizer "
               f"{r.get('tokenizer')} (fingerprint {r.get('tokenizer_fingerprint')}), data "
               f"fingerprint {r.get('fingerprint')}"
               for part, r in data.items() if part in ("base", "sft") and r]
    based = [] if not base else [
        "## The base model", "", f"`{BASE}/`: the model this one was fine-tuned from "
        f"({base['run']}), its release gate {honesty.gate_line(base['release_gate'])}; its own "
        f"reports in `{BASE}/`, its model card `{BASE}/model/README.md`.", "", "```python",
        *usage(os.path.join(tmp, BASE, "model"), f"{BASE}/model"), "```", ""]
    return "\n".join([
        *head, f"# {name}: hand-off bundle", "",
        *honesty.first_screen(h)[2:], "",  # the honesty report's essentials, less its title
        "## What the model wrote (eval.json's recorded replies)", "",
        *(examples or ["- none recorded"]), "",
        "## Use", "", "```python", *usage(os.path.join(tmp, "model"), "model"), "```", "",
        *based, "## The data", "", *recipes, "", "Every source with its sha256, the shards' "
        "sha256s and the skills packs' manifests: `recipe.json`.", "",
        "## Contents", "", "| file | what it is |", "|---|---|",
        "| `model/` | the Hugging Face LlamaForCausalLM folder (`model/README.md`: its model card)"
        " |", "| `run/` | the run's config, summary, metrics, preflight report and evaluation |",
        *[f"| `{BASE}/` | the base model: its `model/`, `run/`, release gate, honesty report and "
          "limitations, as this folder's own |"] * bool(base),
        "| `release_gate.json` | the release gate as summary.json recorded it |",
        "| `honesty.md`, `honesty.json` | every claim with its measurement; what was never "
        "measured |",
        "| `limitations.md` | the known limitations, derived from the numbers |",
        "| `recipe.json` | the exact training data |",
        f"| `{CHECKSUMS}` | the sha256 of every file{' (of `base/` too)' * bool(base)}: "
        f"`sha256sum -c {CHECKSUMS}` |"]) + "\n"


def write_model(run, path, dest, weights_dtype):
    """A model's part of the bundle into dest: its export (model/), its run's files (run/), its
    release gate, honesty report and limitations; the honesty report."""
    export(path, os.path.join(dest, "model"), weights_dtype, chat_template=True)
    copy_run(run["folder"], os.path.join(dest, "run"))
    gate = run["summary"].get("long_run_gate")
    write_json(os.path.join(dest, "release_gate.json"), gate if isinstance(gate, dict) else
               {"recorded": False, "detail": "summary.json has no long_run_gate"})
    h = honesty.write(run, dest)
    write_atomic(os.path.join(dest, "limitations.md"), "# Known limitations\n\n" + "".join(
        f"- {x}\n" for x in h["limitations"] or ["none the numbers show"]))
    return h


def whole(folder):
    """Whether folder is a bundle as handoff.py wrote it: as its record says, and its checksums
    file listing them all."""
    if not as_recorded(folder, BUNDLE_MARK, {CHECKSUMS}):
        return False
    record = read_json(os.path.join(folder, BUNDLE_MARK))
    try:
        sums = record["sha256"] | {BUNDLE_MARK: file_sha256(os.path.join(folder, BUNDLE_MARK))}
        with open(os.path.join(folder, CHECKSUMS), encoding="utf-8", errors="replace") as f:
            return f.read() == "".join(f"{sums[n]}  {n}\n" for n in sorted(record["files"])
                                       if n != CHECKSUMS)
    except (OSError, TypeError):  # unreadable, or a record of another shape: not proven
        return False


def bundle(held, cfg, why):
    """The bundle of held, [(run (honesty.read_run's), checkpoint path)]: the first model at its
    top, its base in base/; into cfg.out atomically: built in a scratch folder beside it, the
    record and the checksums last."""
    out = os.path.normpath(cfg.out)
    finish_replace(out, whole)
    check_replaceable(out, BUNDLE_MARK, "handoff.py", "bundle")
    (run, path), *base = held
    with scratch_beside(out, "podgpt-handoff") as tmp:
        h = write_model(run, path, tmp, cfg.weights_dtype)
        for base_run, base_path in base:  # at most one
            b = write_model(base_run, base_path, os.path.join(tmp, BASE), cfg.weights_dtype)
            b = {"run": b["run"], "checkpoint": os.path.relpath(base_path, base_run["folder"]),
                 "release_gate": b["release_gate"]}
        data = recipe(run)
        write_json(os.path.join(tmp, "recipe.json"), data)
        pack = (run["eval"] or {}).get("pack") or {}
        shown = [dict(some[0], category=c) for c, some in pack.get("examples", {}).items() if some]
        write_atomic(os.path.join(tmp, "README.md"), readme(
            h["run"], h, why, tmp, data, shown[:cfg.examples], b if base else None))
        files = [f for f in files_under(tmp) if f != SCRATCH_MARK] + [BUNDLE_MARK, CHECKSUMS]
        write_json(os.path.join(tmp, BUNDLE_MARK), {
            "run": h["run"], "checkpoint": os.path.relpath(path, run["folder"]),
            "release_gate": h["release_gate"], "override_gate": why, "base_only": cfg.base_only,
            "base": b if base else None,
            "files": files, "sha256": shas(tmp, files[:-2])})  # edits are refused
        # every other file's sha256 in sha256sum's format, relative to the bundle
        write_atomic(os.path.join(tmp, CHECKSUMS), "".join(
            f"{file_sha256(os.path.join(tmp, f))}  {f}\n" for f in files_under(tmp)
            if f not in (CHECKSUMS, SCRATCH_MARK)))
        put_in_place(tmp, out, BUNDLE_MARK, "handoff.py", "bundle")


def main(argv):
    cfg = configurator.configure(__file__, argv)
    if cfg.which not in ("best", "latest"):
        fail(f"which={cfg.which!r} is not one of best, latest", code=2)
    if cfg.weights_dtype not in DTYPES:  # named as the user gives it (export.py's key is dtype)
        fail(f"weights_dtype={cfg.weights_dtype!r} is not one of {', '.join(DTYPES)}", code=2)
    if cfg.examples < 0:
        fail(f"examples={cfg.examples} must be 0 or more", code=2)
    if not cfg.out:
        fail("no --out: give the bundle's folder, e.g. --out=handoff/tiny_skills", code=2)
    folder = cfg.run or cfg.out_dir
    if not os.path.isdir(os.path.join(folder, "ckpt")):
        fail(f"run={folder}: no checkpoints there: give a train.py out_dir", code=2)
    check_apart(out=cfg.out, run=folder)
    run = honesty.read_run(folder)  # every file of the run (its base run, its data) read once, here
    parts = models(run, folder, cfg)
    why = "; ".join(w for prefix, r, _, _ in parts if (w := gate_check(
        folder, honesty.gate_status(r["summary"]), cfg.override_gate, prefix))) or None
    try:
        with contextlib.ExitStack() as stack:
            held = [(r, checkpoint(stack, folder, prefix, src, which))
                    for prefix, r, src, which in parts]
            bundle(held, cfg, why)
    except ValueError as e:
        fail(f"run={folder}: its checkpoint cannot be used: {e}")
    except OSError as e:
        fail(f"cannot write out={cfg.out} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "choose another --out"))
    print(f"handed off {', '.join(p for _, p in held)} to {cfg.out}"
          + (f" against its release gate ({why})" if why else ""))


def checkpoint(stack, folder, prefix, src, which):
    """The checkpoint `src` names, verified and held (against a training run's rotation) until
    stack closes; util.Error when it cannot be used."""
    try:
        return stack.enter_context(reading(src, which))
    except ValueError as e:
        fail(f"run={folder}: {prefix}its checkpoint cannot be used: {e}")


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
