"""
The hand-off bundle of a run: everything a team taking the model needs, in one folder with a
checksum for every file, made only when the run's release gate is acceptable.

    python handoff.py --run=out/tiny_skills/sft --out=handoff/tiny_skills
    python handoff.py --run=out/tiny_skills/sft --out=handoff/tiny_skills --override_gate=True

The gate is summary.json's "long_run_gate" (train.py, eval.py): pass or warn goes on; block, or
none recorded, stops in one line unless override_gate=True, and then README.md's first line says so.
README.md's table lists what the bundle holds; podgpt-handoff.json records its files. It is built
beside out and renamed into place; an earlier bundle there is replaced only when it holds nothing
but the files its podgpt-handoff.json lists.
"""

import hashlib
import os
import shutil
import sys
import sysconfig

from podgpt.core import configurator
import honesty
from podgpt.core.checkpoint import reading
from podgpt.core.data import tokenizer_fingerprint
from podgpt.corpus.download import file_sha256
from podgpt.release.hf import card_usage, check_replaceable, export, put_in_place, scratch_beside
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
# --- end config

RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "preflight.md", "preflight.json",
             "eval.json", "eval.md")
CHECKSUMS = "checksums.sha256"
BUNDLE_MARK = "podgpt-handoff.json"  # what the bundle holds: a later bundle replaces only that


def gate_check(folder, status, override):
    """None when the release gate lets the run go; else why not (util.Error unless override)."""
    if not status["recorded"]:
        why = "no release gate recorded (summary.json has no long_run_gate)"
        fix = "train it with this podgpt"
    elif status["verdict"] not in ("pass", "warn"):  # block (or a verdict no profile gives)
        blocking = ", ".join(g["name"] for g in status["blocking"]) or "see summary.json"
        why = f"the release gate ({status['profile']}) is {status['verdict']}: {blocking}"
        fix = "fix what blocks"
    else:
        return None
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
    out["init_from"] = run["base_dir"] or None
    return out


def copy_run(folder, dest):
    os.makedirs(dest)
    for name in RUN_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(dest, name))


def readme(name, h, why, model, data, shown):
    """README.md: its first line says when the bundle was made against its release gate; its Use,
    the export's own code (hf.card_usage) for `model`, run from the bundle."""
    # tokenizer_config.json is written with tokenizer.json, or neither is
    hf_tokenizer = read_json(os.path.join(model, "tokenizer_config.json"))
    bos = (read_json(os.path.join(model, "config.json")) or {}).get("bos_token_id")
    usage = card_usage(os.path.basename(model), bos, hf_tokenizer is not None,
                       "chat_template" in (hf_tokenizer or {}))
    head = [f"**NOT ACCEPTABLE FOR RELEASE: {why}; this bundle was made anyway (handoff.py "
            "--override_gate=True).**", ""] if why else []
    examples = [f"- ({e['category']}) {e['prompt']!r} -> {e['final_answer']!r} "
                f"(expected {e['answer']!r})" for e in shown]
    recipes = [f"- {part} data: `{r.get('data_dir')}` from {r.get('source')}, tokenizer "
               f"{r.get('tokenizer')} (fingerprint {r.get('tokenizer_fingerprint')}), data "
               f"fingerprint {r.get('fingerprint')}"
               for part, r in data.items() if part in ("base", "sft") and r]
    return "\n".join([
        *head, f"# {name}: hand-off bundle", "",
        *honesty.first_screen(h)[2:], "",  # the honesty report's essentials, less its title
        "## What the model wrote (eval.json's recorded replies)", "",
        *(examples or ["- none recorded"]), "",
        "## Use", "", "```python", *usage, "```", "",
        "## The data", "", *recipes, "", "Every source with its sha256, the shards' sha256s and "
        "the skills packs' manifests: `recipe.json`.", "",
        "## Contents", "", "| file | what it is |", "|---|---|",
        "| `model/` | the Hugging Face LlamaForCausalLM folder (`model/README.md`: its model card)"
        " |", "| `run/`, `base_run/` | the run's config, summary, metrics, preflight report and "
        "evaluation (and its base run's) |",
        "| `release_gate.json` | the release gate as summary.json recorded it |",
        "| `honesty.md`, `honesty.json` | every claim with its measurement; what was never "
        "measured |",
        "| `limitations.md` | the known limitations, derived from the numbers |",
        "| `recipe.json` | the exact training data |",
        f"| `{CHECKSUMS}` | the sha256 of every file: `sha256sum -c {CHECKSUMS}` |"]) + "\n"


def bundle(run, path, cfg, why):
    """The bundle of checkpoint `path` of a run (honesty.read_run's) into cfg.out, atomically: built
    in a scratch folder beside it, the record and the checksums last."""
    out = os.path.normpath(cfg.out)
    check_replaceable(out, BUNDLE_MARK, "handoff.py", "bundle")
    with scratch_beside(out, "podgpt-handoff") as tmp:
        export(path, os.path.join(tmp, "model"), cfg.weights_dtype, chat_template=True)
        copy_run(run["folder"], os.path.join(tmp, "run"))
        if run["base_data"]:  # the base run's folder is there
            copy_run(run["base_dir"], os.path.join(tmp, "base_run"))
        gate = run["summary"].get("long_run_gate")
        write_json(os.path.join(tmp, "release_gate.json"), gate if isinstance(gate, dict) else
                   {"recorded": False, "detail": "summary.json has no long_run_gate"})
        h = honesty.write(run, tmp)
        write_atomic(os.path.join(tmp, "limitations.md"), "# Known limitations\n\n" + "".join(
            f"- {x}\n" for x in h["limitations"] or ["none the numbers show"]))
        data = recipe(run)
        write_json(os.path.join(tmp, "recipe.json"), data)
        pack = (run["eval"] or {}).get("pack") or {}
        shown = [dict(some[0], category=c) for c, some in pack.get("examples", {}).items() if some]
        write_atomic(os.path.join(tmp, "README.md"), readme(
            h["run"], h, why, os.path.join(tmp, "model"), data, shown[:cfg.examples]))
        files = [f for f in files_under(tmp) if f != SCRATCH_MARK] + [BUNDLE_MARK, CHECKSUMS]
        write_json(os.path.join(tmp, BUNDLE_MARK),
                   {"run": h["run"], "checkpoint": os.path.relpath(path, run["folder"]),
                    "release_gate": h["release_gate"], "override_gate": why, "files": files})
        # every other file's sha256 in sha256sum's format, relative to the bundle
        write_atomic(os.path.join(tmp, CHECKSUMS), "".join(
            f"{file_sha256(os.path.join(tmp, f))}  {f}\n" for f in files_under(tmp)
            if f not in (CHECKSUMS, SCRATCH_MARK)))
        put_in_place(tmp, out, BUNDLE_MARK, "handoff.py", "bundle")


def main(argv):
    cfg = configurator.configure(__file__, argv)
    if cfg.which not in ("best", "latest"):
        fail(f"which={cfg.which!r} is not one of best, latest", code=2)
    if not cfg.out:
        fail("no --out: give the bundle's folder, e.g. --out=handoff/tiny_skills", code=2)
    folder = cfg.run or cfg.out_dir
    if not os.path.isdir(os.path.join(folder, "ckpt")):
        fail(f"run={folder}: no checkpoints there: give a train.py out_dir", code=2)
    check_apart(out=cfg.out, run=folder)
    run = honesty.read_run(folder)  # every file of the run (its base run, its data) read once, here
    why = gate_check(folder, honesty.gate_status(run["summary"]), cfg.override_gate)
    try:
        with reading(folder, cfg.which) as path:  # held against a training run's rotation
            bundle(run, path, cfg, why)
    except ValueError as e:
        fail(f"run={folder}: its checkpoint cannot be used: {e}")
    except OSError as e:
        fail(f"cannot write out={cfg.out} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "choose another --out"))
    print(f"handed off {path} to {cfg.out}" + (f" against its release gate ({why})" if why else ""))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
