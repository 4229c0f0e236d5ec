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
import platform
import shutil
import sys
import sysconfig

import configurator
import honesty
from checkpoint import reading
from data import tokenizer_fingerprint
from download import file_sha256
from export import check_replaceable, export, put_in_place, scratch_beside
from prepare import SOURCE_EXTS, is_url, walk
from report import read_json
from util import (BUNDLE_MARK, MAKE_ROOM, SCRATCH_MARK, check_apart, disk_full, fail, files_under, first_line,
                  run_main, write_atomic, write_json)

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
    """Each source of prepare.py's arguments with its sha256, hashed now (the shards' sha256s are what trained)."""
    out = []
    for part in (p.strip() for p in args.get("source", "").split(",") if p.strip()):
        if part == "stdlib" or os.path.isdir(part):
            root = sysconfig.get_paths()["stdlib"] if part == "stdlib" else part
            files = walk(root, (".py",), ("site-packages", "dist-packages")) if part == "stdlib" \
                else walk(part, SOURCE_EXTS)
            lines = "".join(f"{file_sha256(f)}  {os.path.relpath(f, root)}\n" for f in files)
            where = f"Python {platform.python_version()}'s standard library here" if part == "stdlib" else part
            out.append(dict(source=part, files=len(files), sha256=hashlib.sha256(lines.encode()).hexdigest(),
                            how=f"sha256 of the sorted 'sha256  path' lines of the {len(files)} files of {where}"))
        elif os.path.isfile(part):
            out.append(dict(source=part, files=1, sha256=file_sha256(part), how="sha256 of the file"))
        else:
            given = args.get("sha256") or None
            out.append(dict(source=part, files=None, sha256=given,
                            how="prepare.py's --sha256, checked at download" if given else
                            f"not recorded: {'a URL or preset' if is_url(part) or '/' not in part else 'gone'}; "
                            "prepare.py checks a download's sha256 only when --sha256 is given"))
    return out


def pack_of(source):
    """The manifest.json of the skills pack a source file belongs to (its sft.jsonl or eval.jsonl), or None."""
    manifest = read_json(os.path.join(os.path.dirname(source), "manifest.json")) if os.path.isfile(source) else None
    return manifest if isinstance(manifest, dict) and os.path.basename(source) in manifest.get("files", {}) else None


def data_recipe(data_dir):
    """What data_dir holds and how prepare.py made it, from its manifest.json; None when it cannot be read."""
    manifest = read_json(os.path.join(data_dir, "manifest.json"))
    if not isinstance(manifest, dict):
        return None
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


def recipe(folder, base):
    """The exact data behind the model: the base data's recipe, and the SFT data's for a fine-tuned run; the skills
    pack eval.py asked, by its manifest."""
    config = read_json(os.path.join(folder, "config.json")) or {}
    report = read_json(os.path.join(folder, "eval.json")) or {}
    eval_pack = (report.get("pack") or {}).get("folder")
    parts = {"sft": folder, "base": base} if base else {"base": folder}
    out = {}
    for name, run_dir in parts.items():
        data_dir = (read_json(os.path.join(run_dir, "config.json")) or {}).get("data_dir", "")
        out[name] = data_recipe(data_dir) or {"data_dir": data_dir, "missing": "no readable manifest.json there"}
    out["eval_pack"] = {"folder": eval_pack, "manifest": read_json(os.path.join(eval_pack, "manifest.json"))} \
        if eval_pack else None
    out["init_from"] = config.get("init_from") or None
    return out


def copy_run(folder, dest):
    """The run's own files into dest (those it has)."""
    os.makedirs(dest)
    for name in RUN_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(dest, name))


def usage(chat, tokenizer):
    """README.md's code: a chat model through its chat template, a base model by text; without a transformers
    tokenizer (a char tokenizer's), where the model card says what to do."""
    if not tokenizer:
        return ["# no transformers tokenizer: model/README.md says why and how to pass token ids"]
    load = ["from transformers import AutoModelForCausalLM, AutoTokenizer",
            "tok = AutoTokenizer.from_pretrained(\"model\")",
            "model = AutoModelForCausalLM.from_pretrained(\"model\")"]
    if chat:
        return load + ["messages = [{\"role\": \"user\", \"content\": \"What is 2 + 3?\"}]",
                       "ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,",
                       "                              return_tensors=\"pt\")",
                       "# ids: BOS <|user|> prompt <|end|> <|assistant|>, as in training; the reply ends at <|end|>",
                       "room = tok.model_max_length - ids[\"input_ids\"].shape[1]  # the context it was trained on",
                       "out = model.generate(**ids, max_new_tokens=room, do_sample=False)",
                       "print(tok.decode(out[0, ids[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
                       "# a chat marker typed in a message is read as the marker; for text you do not trust,",
                       "# apply_chat_template(..., sanitize_control_tokens=True) keeps it text (transformers 5.24)"]
    return load + ["ids = tok(\"def main(\", return_tensors=\"pt\").input_ids  # starts with BOS, as in training",
                   "print(tok.decode(model.generate(ids, max_new_tokens=64)[0], skip_special_tokens=True))"]


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
    hf = read_json(os.path.join(model, "tokenizer_config.json")) or {}
    code = usage("chat_template" in hf, os.path.isfile(os.path.join(model, "tokenizer.json")))
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


def fill(tmp, folder, path, cfg, why):
    """Everything but the record and the checksums into the bundle's temporary folder `tmp`."""
    base = (read_json(os.path.join(folder, "config.json")) or {}).get("init_from") or ""
    export(path, os.path.join(tmp, "model"), cfg.weights_dtype, chat_template=True)
    copy_run(folder, os.path.join(tmp, "run"))
    if base and os.path.isdir(base):
        copy_run(base, os.path.join(tmp, "base_run"))
    gate = (read_json(os.path.join(folder, "summary.json")) or {}).get("long_run_gate")
    write_json(os.path.join(tmp, "release_gate.json"), gate if isinstance(gate, dict) else
               {"recorded": False, "detail": "summary.json has no long_run_gate"})
    h = honesty.write(folder, tmp)
    write_atomic(os.path.join(tmp, "limitations.md"), "# Known limitations\n\n" + "".join(
        f"- {x}\n" for x in h["limitations"] or ["none the numbers show"]))
    data = recipe(folder, base)
    write_json(os.path.join(tmp, "recipe.json"), data)
    pack = (read_json(os.path.join(folder, "eval.json")) or {}).get("pack") or {}
    firsts = [dict(some[0], category=c) for c, some in pack.get("examples", {}).items() if some]
    shown = firsts[:cfg.examples]  # one a category, the first categories
    write_atomic(os.path.join(tmp, "README.md"), readme(h["run"], h, why, os.path.join(tmp, "model"), data, shown))
    return h


def bundle(folder, path, cfg, why):
    """Write the bundle of checkpoint `path` of run `folder` to cfg.out, atomically."""
    out = os.path.normpath(cfg.out)
    check_replaceable(out, BUNDLE_MARK, "handoff.py", "bundle")
    with scratch_beside(out, "podgpt-handoff") as tmp:
        h = fill(tmp, folder, path, cfg, why)
        files = [f for f in files_under(tmp) if f != SCRATCH_MARK] + [BUNDLE_MARK, CHECKSUMS]
        write_json(os.path.join(tmp, BUNDLE_MARK),
                   {"run": h["run"], "checkpoint": os.path.relpath(path, folder),
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
    why = gate_check(folder, honesty.gate_status(honesty.read_run(folder)["summary"]), cfg.override_gate)
    try:
        with reading(folder, cfg.which) as path:  # held against a training run's rotation while it is read
            bundle(folder, path, cfg, why)
    except ValueError as e:
        fail(f"run={folder}: its checkpoint cannot be used: {e}")
    except OSError as e:
        fail(f"cannot write out={cfg.out} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "choose another --out"))
    print(f"handed off {path} to {cfg.out}" + (f" against its release gate ({why})" if why else ""))


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
