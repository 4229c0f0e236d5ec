"""
The hand-off bundle of a run: everything a team that takes the model needs, in one folder with a checksum for every
file, made only when the run's release gate is acceptable.

    python handoff.py --run=out/tiny_skills/sft --out=handoff/tiny_skills
    python handoff.py --run=out/tiny_skills/sft --out=handoff/tiny_skills --override_gate=True   # gate or not

The release gate is summary.json's "long_run_gate" as train.py and eval.py recorded it: pass or warn goes on; block,
or no gate recorded (an older run), stops with one line, unless override_gate=True, and then README.md's first line
says that the bundle was made against its gate. The bundle:

    README.md            for the receiving team: the model, the verdict, what it can and cannot do, how to load it
    model/               the Hugging Face folder (export.py; an SFT model's tokenizer with the chat tokens and template)
    run/                 the run's config.json, summary.json, metrics.jsonl, preflight.md/.json, eval.json/.md
    base_run/            the same of the base run, for a fine-tuned (SFT) model
    release_gate.json    summary.json's long_run_gate, as recorded ({"recorded": false} when it is not)
    honesty.md/.json     honesty.py's report (claims and their measurements, never measured, limitations)
    limitations.md       the known limitations, derived from the numbers
    recipe.json          the exact data: prepare.py's arguments, each source with its sha256, the shards' sha256s, the
                         tokenizer's fingerprint, the skills pack's manifest; of the base data and of the SFT data
    podgpt-handoff.json  the bundle's record: what made it, from what, and its files (so that it can be replaced)
    checksums.sha256     the sha256 of every other file (sha256sum -c checksums.sha256)

It is built in a temporary folder beside out and renamed into place; an earlier bundle there is replaced only when it
holds nothing but the files its podgpt-handoff.json lists.
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
from podgpt.core.util import (MAKE_ROOM, SCRATCH_MARK, Error, check_apart, disk_full, fail, files_under,
                  first_line, run_main, write_atomic, write_json)

# --- config
run = ""                        # the run folder to hand off (a train.py out_dir); "": out_dir
out_dir = "out"                 # used when run is empty (so a run's config file finds its folder)
which = "best"                  # the checkpoint: best (lowest validation loss; latest if none evaluated) | latest
out = ""                        # the bundle's folder (required); an earlier bundle there is replaced
weights_dtype = "float32"       # the exported weights: float32 | bfloat16 (not train.py's dtype, which configs set)
override_gate = False           # bundle when the release gate is block or not recorded; README's first line says so
examples = 4                    # eval.json's recorded replies quoted in README.md: what the model writes
# --- end config

RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "preflight.md", "preflight.json", "eval.json", "eval.md")
CHECKSUMS = "checksums.sha256"
BUNDLE_MARK = "podgpt-handoff.json"  # the bundle's own record of what it holds: a later bundle replaces only that


def gate_check(folder, status, override):
    """None when the release gate lets the run go; else why not (util.Error unless override)."""
    if not status["recorded"]:
        why, fix = "no release gate recorded (summary.json has no long_run_gate)", "train it with this podgpt"
    elif status["verdict"] not in ("pass", "warn"):  # block (or a verdict no profile gives)
        blocking = ", ".join(g["name"] for g in status["blocking"]) or "see summary.json"
        why, fix = f"the release gate ({status['profile']}) is {status['verdict']}: {blocking}", "fix what blocks"
    else:
        return None
    if not override:
        fail(f"run={folder}: {why}: not handing it off; {fix}, or give --override_gate=True to bundle it anyway "
             f"(README.md's first line then says so)")
    return why


def source_hashes(args):
    """Each source of prepare.py's arguments with its sha256, hashed now (the shards' sha256s are what trained):
    of the files prepare.py would read for it (sources.resolve_sources)."""
    out = []
    for part in (p.strip() for p in args.get("source", "").split(",") if p.strip()):
        if part in PRESETS or is_url(part):  # a download: its sha256 only as prepare.py checked it
            given = args.get("sha256") or None
            out.append(dict(source=part, files=None, sha256=given,
                            how="prepare.py's --sha256, checked at download" if given else
                            "not recorded: a URL or preset; prepare.py checks a download's sha256 only when --sha256 "
                            "is given"))
            continue
        try:
            found, description = resolve_sources(part, 0, "", False)
        except Error as e:  # gone, or no longer readable as a source: the rest of the recipe still stands
            out.append(dict(source=part, files=None, sha256=None, how=f"not recorded: {e}"))
            continue
        files = [s.location for s in found]
        if files == [part]:  # a file, not a folder
            out.append(dict(source=part, files=1, sha256=file_sha256(part), how="sha256 of the file"))
            continue
        root = sysconfig.get_paths()["stdlib"] if part == "stdlib" else part  # the paths' folder in the lines
        lines = "".join(f"{file_sha256(f)}  {os.path.relpath(f, root)}\n" for f in files)
        out.append(dict(source=part, files=len(files), sha256=hashlib.sha256(lines.encode()).hexdigest(),
                        how=f"sha256 of the sorted 'sha256  path' lines of the files of {description}, here"))
    return out


def pack_of(source):
    """The manifest.json of the skills pack a source file belongs to (its sft.jsonl or eval.jsonl), or None."""
    manifest = read_json(os.path.join(os.path.dirname(source), "manifest.json")) if os.path.isfile(source) else None
    return manifest if isinstance(manifest, dict) and os.path.basename(source) in manifest.get("files", {}) else None


def data_recipe(data_dir, manifest):
    """What data_dir holds and how prepare.py made it, from its manifest.json (as read)."""
    if not isinstance(manifest, dict):
        return {"data_dir": data_dir, "missing": "no readable manifest.json there"}
    args = manifest.get("prepare_args", {})
    sources = source_hashes(args)
    packs = {s["source"]: pack for s in sources if (pack := pack_of(s["source"]))}
    for s in sources:  # a pack's file: its sha256 now against the one the pack recorded
        if s["source"] in packs:
            s["matches_pack"] = packs[s["source"]]["files"][os.path.basename(s["source"])]["sha256"] == s["sha256"]
    try:
        tokenizer = tokenizer_fingerprint(data_dir, manifest)
    except OSError as e:
        tokenizer = f"unreadable ({first_line(e)})"
    return {"data_dir": data_dir, "source": manifest.get("source"), "prepare_args": args, "sources": sources,
            "skills_packs": packs, "tokenizer": manifest.get("tokenizer"), "tokenizer_fingerprint": tokenizer,
            "tokenizer_files": {f: file_sha256(os.path.join(data_dir, f)) for f in manifest.get("tokenizer_files", [])
                                if os.path.isfile(os.path.join(data_dir, f))},
            "fingerprint": manifest.get("fingerprint"), "contamination": manifest.get("contamination"),
            "shards": [dict(split=name, file=s["file"], tokens=s["tokens"], sha256=s["sha256"])
                       for name, split in manifest.get("splits", {}).items() for s in split.get("shards", [])]}


def recipe(run):
    """The exact data behind the model of a run (honesty.read_run's): the base data's recipe, and the SFT data's
    for a fine-tuned run; the skills pack eval.py asked, by its manifest."""
    eval_pack = ((run["eval"] or {}).get("pack") or {}).get("folder")
    parts = {"sft": run, "base": run["base_data"]} if run["base_dir"] else {"base": run}
    out = {name: data_recipe(r["config"].get("data_dir", ""), r["data"]) if r else
           {"data_dir": None, "missing": f"the base run ({run['base_dir']}) is not there to read"}
           for name, r in parts.items()}
    out["eval_pack"] = {"folder": eval_pack, "manifest": read_json(os.path.join(eval_pack, "manifest.json"))} \
        if eval_pack else None
    out["init_from"] = run["base_dir"] or None
    return out


def copy_run(folder, dest):
    """The run's own files into dest (those it has)."""
    os.makedirs(dest)
    for name in RUN_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(dest, name))


def usage(model):
    """The export's own code (hf.card_usage) for the export in `model`, run from the bundle's folder."""
    hf_tokenizer = read_json(os.path.join(model, "tokenizer_config.json"))  # written with tokenizer.json, or neither
    bos = (read_json(os.path.join(model, "config.json")) or {}).get("bos_token_id")
    return card_usage(os.path.basename(model), bos, hf_tokenizer is not None, "chat_template" in (hf_tokenizer or {}))


def readme(name, h, why, model, data, shown):
    """README.md: its first line says when the bundle was made against its release gate."""
    head = [f"**NOT ACCEPTABLE FOR RELEASE: {why}; this bundle was made anyway (handoff.py --override_gate=True).**",
            "", f"# {name}: hand-off bundle"] if why else [f"# {name}: hand-off bundle"]
    screen = honesty.first_screen(h)[2:]  # the honesty report's essentials, less its title
    examples = [f"- ({e['category']}) {e['prompt']!r} -> {e['final_answer']!r} (expected {e['answer']!r})"
                for e in shown]
    recipes = [f"- {part} data: `{r.get('data_dir')}` from {r.get('source')}, tokenizer {r.get('tokenizer')} "
               f"(fingerprint {r.get('tokenizer_fingerprint')}), data fingerprint {r.get('fingerprint')}"
               for part, r in data.items() if part in ("base", "sft") and r]
    code = usage(model)
    return "\n".join([
        *head, "", *screen, "",
        "## What the model wrote (eval.json's recorded replies)", "", *(examples or ["- none recorded"]), "",
        "## Use", "", "```python", *code, "```", "",
        "## The data", "", *recipes, "", "Every source with its sha256, the shards' sha256s and the skills "
        "packs' manifests: `recipe.json`.", "",
        "## Contents", "", "| file | what it is |", "|---|---|",
        "| `model/` | the Hugging Face LlamaForCausalLM folder (`model/README.md`: its model card) |",
        "| `run/`, `base_run/` | the run's config, summary, metrics, preflight report and evaluation "
        "(and its base run's) |",
        "| `release_gate.json` | the release gate as summary.json recorded it |",
        "| `honesty.md`, `honesty.json` | every claim with its measurement; what was never measured |",
        "| `limitations.md` | the known limitations, derived from the numbers |",
        "| `recipe.json` | the exact training data |",
        f"| `{CHECKSUMS}` | the sha256 of every file: `sha256sum -c {CHECKSUMS}` |"]) + "\n"


def write_checksums(folder):
    """checksums.sha256: every other file's sha256, in sha256sum's format, paths relative to the bundle."""
    lines = [f"{file_sha256(os.path.join(folder, path))}  {path}\n" for path in files_under(folder)
             if path not in (CHECKSUMS, SCRATCH_MARK)]
    write_atomic(os.path.join(folder, CHECKSUMS), "".join(lines))


def fill(tmp, run, path, cfg, why):
    """Everything but the record and the checksums into the bundle's temporary folder `tmp`, from the run as
    honesty.read_run read it."""
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
    firsts = [dict(some[0], category=c) for c, some in pack.get("examples", {}).items() if some]
    shown = firsts[:cfg.examples]  # one a category, the first categories
    write_atomic(os.path.join(tmp, "README.md"), readme(h["run"], h, why, os.path.join(tmp, "model"), data, shown))
    return h


def bundle(run, path, cfg, why):
    """Write the bundle of checkpoint `path` of a run (honesty.read_run's) to cfg.out, atomically."""
    out = os.path.normpath(cfg.out)
    check_replaceable(out, BUNDLE_MARK, "handoff.py", "bundle")
    with scratch_beside(out, "podgpt-handoff") as tmp:
        h = fill(tmp, run, path, cfg, why)
        files = [f for f in files_under(tmp) if f != SCRATCH_MARK] + [BUNDLE_MARK, CHECKSUMS]
        write_json(os.path.join(tmp, BUNDLE_MARK),
                   {"run": h["run"], "checkpoint": os.path.relpath(path, run["folder"]),
                    "release_gate": h["release_gate"], "override_gate": why, "files": files})
        write_checksums(tmp)
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
    run = honesty.read_run(folder)  # every file of the run (and its base run and data) read once, here
    why = gate_check(folder, honesty.gate_status(run["summary"]), cfg.override_gate)
    try:
        with reading(folder, cfg.which) as path:  # held against a training run's rotation while it is read
            bundle(run, path, cfg, why)
    except ValueError as e:
        fail(f"run={folder}: its checkpoint cannot be used: {e}")
    except OSError as e:
        fail(f"cannot write out={cfg.out} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "choose another --out"))
    print(f"handed off {path} to {cfg.out}" + (f" against its release gate ({why})" if why else ""))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
