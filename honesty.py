"""
The honesty report of a run folder: every claim its model card would make, each tied to the
measurement behind it (file and field), what was never measured, the train/validation gap, the
release gate as recorded and the limitations its numbers show; honesty.md (its first screen: the
model, the verdict, what it can and cannot do) and honesty.json, into the run folder.

    python honesty.py --run=out/tiny_skills/sft
    python honesty.py config/tiny_skills.py          # the run a config file describes (its out_dir)

It only reads the files a run and eval.py leave (and a fine-tuned run's base run's): no model
loaded, no gate judged again. run.sh runs it after eval.py; handoff.py, into the bundle.
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import json
import os
import sys

from podgpt.core import configurator
from podgpt.pod.report import read_json, read_metrics
from podgpt.core.owned import replace_files
from podgpt.core.util import MAKE_ROOM, disk_full, fail, first_line, percent, run_main

# --- config
run = ""                        # the run folder (a train.py out_dir); "": out_dir
out_dir = "out"                 # used when run is empty (a run's config file finds its folder)
# --- end config

COMPUTE_OPTIMAL = 20  # tokens per parameter at the compute-optimal point (Hoffmann et al., 2022)
WIDE = 0.25  # a 95% interval wider than this: the category's accuracy is known only roughly
GAP = 0.10  # validation loss this much (relative) above the training loss: it overfits
FIRST_SCREEN = 25  # honesty.md's lines that must say the essentials
# a category's standing, and its flag in honesty.md's table
ABOVE, AT_OR_BELOW, NO_CHANCE = "above_chance", "at_or_below_chance", "no_chance_level"
FLAGS = {ABOVE: "above chance", AT_OR_BELOW: "AT OR BELOW CHANCE", NO_CHANCE: "no chance level"}
UNEVALUATED = (  # eval.json's parts, and what their absence leaves unmeasured
    ("pack", "no skills-pack evaluation (eval.py --pack_dir): nothing measured of what the model "
             "can do"),
    ("mc", "no multiple-choice benchmark (eval.py --mc)"),
    ("external", "no external benchmark attached (an lm-evaluation-harness results JSON: eval.py "
                 "--attach)"),
    ("bpb", "no validation bits per byte (eval.py --data_dir)"))


def read_run(folder, seen=()):
    """What the run (and a fine-tuned run's base run) recorded; util.Error without a summary.json.
    base: the base run's read_run, if it ended; base_data: its config and data, if it is there.
    seen: the runs whose base this one is (a chain that comes back is refused)."""
    summary = read_json(os.path.join(folder, "summary.json"))
    if not isinstance(summary, dict):
        fail(f"run={folder}: no readable summary.json there: give a train.py out_dir whose run has "
             "ended")
    recorded = run_data(folder)
    base_dir = run_folder(recorded["config"].get("init_from") or "")
    seen = (*seen, os.path.realpath(folder))
    if base_dir and os.path.realpath(base_dir) in seen:
        fail(f"{folder}/config.json: init_from={base_dir} names the run itself (or a run based on "
             "it): put back the config.json train.py wrote, then rerun")
    ended = base_dir and os.path.isfile(os.path.join(base_dir, "summary.json"))
    base = read_run(base_dir, seen) if ended else None
    report = read_json(os.path.join(folder, "eval.json"))
    cats = categories(report) if isinstance(report, dict) else {}
    if not isinstance(cats, dict) or not all(isinstance(c, dict) for c in cats.values()):
        fail(f"{folder}/eval.json: its pack categories are not as eval.py writes them (one is "
             "null or not an object): run eval.py again, then honesty.py")
    return dict(recorded, folder=folder, summary=summary,
                metrics=read_metrics(os.path.join(folder, "metrics.jsonl")),
                eval=report if isinstance(report, dict) else None,
                manifest=read_json(os.path.join(folder, "manifest.json")) or {}, base=base,
                base_dir=base_dir, base_data=base or (run_data(base_dir) if base_dir
                                                      and os.path.isdir(base_dir) else None))


def run_folder(init_from):
    """The run folder of init_from: itself (an out_dir), or a checkpoint folder's out_dir."""
    ckpt = os.path.dirname(os.path.normpath(init_from)) if init_from else ""
    return (os.path.dirname(ckpt) or ".") if os.path.basename(ckpt) == "ckpt" else init_from


def run_data(folder):
    """A run folder's config.json and its data's manifest.json (a run that never ended has them)."""
    config = read_json(os.path.join(folder, "config.json")) or {}
    data_dir = config.get("data_dir") or ""
    return dict(config=config,
                data=read_json(os.path.join(data_dir, "manifest.json")) if data_dir else None)


def gate_status(summary):
    """The release gate as summary.json's long_run_gate records it: recorded, profile, verdict, and
    the blocking and warning gates (name, detail) of its preflight gates and post-run checks."""
    gate = summary.get("long_run_gate")
    if not isinstance(gate, dict):
        return {"recorded": False, "verdict": None, "profile": None, "blocking": [], "warnings": []}
    gates = [*gate.get("gates", []), *gate.get("post_run", [])]
    pick = lambda verdict: [{"name": g.get("name"), "detail": g.get("detail")}  # noqa: E731
                            for g in gates if isinstance(g, dict) and g.get("verdict") == verdict]
    return {"recorded": True, "verdict": gate.get("verdict"), "profile": gate.get("profile"),
            "blocking": pick("block"), "warnings": pick("warn")}


def gate_line(status):
    if not status["recorded"]:
        return "NOT RECORDED (summary.json has no long_run_gate): not acceptable for a release"
    named = lambda gates: ", ".join(g["name"] for g in gates) or "none"  # noqa: E731
    return (f"{str(status['verdict']).upper()} under the {status['profile']} profile (blocking: "
            f"{named(status['blocking'])}; warnings: {named(status['warnings'])})")


def categories(report):
    """The skills pack's categories of eval.json, as eval.py wrote them."""
    return ((report or {}).get("pack") or {}).get("categories", {})


def standing(c):
    """ABOVE (its 95% interval's low end is above chance), AT_OR_BELOW, or NO_CHANCE: the pack's
    manifest gives it no chance level (a free-form task), so its score is all there is."""
    return NO_CHANCE if c.get("chance") is None else ABOVE if c["above_chance"] else AT_OR_BELOW


def standing_in(cats, where):
    return [n for n, c in cats.items() if standing(c) == where]


def claims(run):
    """Each number a model card would state: {claim, value, source (file: field)}."""
    s, out = run["summary"], []
    add = lambda *row: out.append(dict(zip(("claim", "value", "source"), row)))  # noqa: E731
    add("parameters", s.get("params", {}).get("total"), "summary.json: params.total")
    add("tokens trained on", s.get("tokens"), "summary.json: tokens")
    if vals := [m for m in run["metrics"] if "val_loss" in m]:
        step = vals[-1]["step"]
        add(f"validation loss at step {step} (nats/token)", vals[-1]["val_loss"],
            f"metrics.jsonl: step {step}, val_loss")
    add("best validation loss", s.get("best_val_loss"),
        f"summary.json: best_val_loss (step {s.get('best_step')})")
    add("final training loss", s.get("final_train_loss"), "summary.json: final_train_loss")
    add("unigram baseline validation loss", s.get("unigram_val_loss"),
        "summary.json: unigram_val_loss")
    report = run["eval"] or {}
    interval = lambda c: [c["accuracy"], c["low"], c["high"], c["chance"]]  # noqa: E731
    if "bpb" in report:
        add("validation bits per byte", report["bpb"]["val_bpb"], "eval.json: bpb.val_bpb")
    for name, c in categories(report).items():
        add(f"skills pack: {name} accuracy (95% interval; chance)", interval(c),
            f"eval.json: pack.categories.{name}")
    if "pack" in report:
        add("skills pack: overall accuracy (95% interval; pooled chance)",
            interval(report["pack"]["overall"]), "eval.json: pack.overall")
    for task, t in (report.get("mc") or {}).get("tasks", {}).items():
        add(f"multiple choice: {task} acc (95% interval; chance)", interval(t),
            f"eval.json: mc.tasks.{task}")
    for task, metrics in (report.get("external") or {}).get("results", {}).items():
        for metric, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                add(f"external: {task} {metric}", value, f"eval.json: external.results.{task}")
    return out


def unmeasured(run):
    """What was never measured, each said plainly; no GPU run from manifest.json's hardware."""
    report = run["eval"]
    if report is None:
        out = ["no evaluation at all: eval.py never wrote eval.json into this run folder"]
    else:
        out = [gap for key, gap in UNEVALUATED if key not in report]
    if report is not None and run["config"].get("init_from") and run["base"] is None:
        gone = "has no readable summary.json" if run["base_data"] else "is not there to read"
        out.append(f"the base run ({run['base_dir']}) {gone}: its tokens and numbers are not in "
                   "this report")
    hardware = [(who, r["manifest"].get("hardware") or {})
                for who, r in (("this run", run), ("its base run", run["base"])) if r is not None]
    if cpu := [(who, hw.get("cpu") or "unknown") for who, hw in hardware if not hw.get("gpus")]:
        out.append(f"no GPU run: {' and '.join(who for who, _ in cpu)} trained on a CPU "
                   f"({cpu[0][1]}); the GPU paths (bf16, compiled kernels, several ranks) never "
                   "trained this model")
    return out


def limitations(run, cats):
    """The limitations the numbers show, each with its numbers."""
    s, out = run["summary"], []
    pretrained = (run["base"] or run)["summary"]  # a fine-tuned model's: its base run's
    tokens, params = pretrained.get("tokens"), pretrained.get("params", {}).get("total")
    if tokens and params and tokens / params < COMPUTE_OPTIMAL:
        out.append(f"undertrained: pretrained on {tokens / params:.1f} tokens per parameter "
                   f"({tokens:,} tokens, {params:,} parameters), below the compute-optimal "
                   f"{COMPUTE_OPTIMAL}")
    low, free = standing_in(cats, AT_OR_BELOW), standing_in(cats, NO_CHANCE)
    if low:
        out.append(f"at or below chance (95% interval's low end not above it) in {len(low)} of "
                   f"{len(cats) - len(free)} categories with a chance level: {', '.join(low)}")
    if free:
        out.append(f"no chance level for {len(free)} of {len(cats)} categories (the pack's "
                   f"manifest gives none): {', '.join(free)}: their accuracy alone, never "
                   "compared with guessing")
    if wide := [n for n, c in cats.items() if c["high"] - c["low"] > WIDE]:
        widest = max(wide, key=lambda n: cats[n]["high"] - cats[n]["low"])
        w = cats[widest]
        out.append(f"few eval rows: {len(wide)} categories have 95% intervals wider than "
                   f"{percent(WIDE)} (widest {widest}: {percent(w['low'])} to "
                   f"{percent(w['high'])} from {w['n']} rows); smaller differences are noise")
    train, val = s.get("final_train_loss"), s.get("final_val_loss")
    if train and val and val > train * (1 + GAP):
        out.append(f"a train/validation gap: validation loss {val:.4f} against training loss "
                   f"{train:.4f} ({100 * (val / train - 1):.0f}% higher): it fits its training "
                   "rows better than new ones")
    out += contamination(run)
    if s.get("spikes") or s.get("rollbacks"):
        out.append(f"training was unstable: {s.get('spikes')} loss spikes, "
                   f"{s.get('rollbacks')} rollbacks")
    if (block := run["config"].get("block_size")):
        out.append(f"context of {block} tokens: a prompt and reply longer than that were never "
                   "trained on")
    if not run["config"].get("init_from"):
        out.append("a base model: no supervised fine-tuning (SFT), so it continues text and does "
                   "not follow instructions")
    return out


def contamination(run):
    """A line per contamination finding: val documents in training (the data's manifest.json), and
    each gate's other finding, once where the preflight gate and the post-run check share it."""
    out = []
    found = (run["data"] or {}).get("contamination") or {}
    gate = run["summary"].get("long_run_gate") or {}
    preflight, after = ([g for g in gate.get(part, []) if isinstance(g, dict)
                         and g.get("verdict") in ("warn", "block")
                         and "contamination" in str(g.get("name"))]
                        for part in ("gates", "post_run"))
    if found.get("train_docs_in_val"):
        out.append(f"contamination: {found['train_docs_in_val']} of {found.get('val_documents')} "
                   "validation documents are also training documents (the data's manifest.json): "
                   "its validation loss is optimistic")
        preflight = [g for g in preflight if g.get("name") != "contamination"]  # counted above
    findings = {}  # detail -> the gates that report it
    for g in preflight + after:
        findings.setdefault(g.get("detail"), []).append(g)
    for detail, gates in findings.items():
        verdict = "block" if any(g["verdict"] == "block" for g in gates) else "warn"
        out.append(f"{', '.join(str(g['name']) for g in gates)} ({verdict}): {detail}")
    return out


def model_line(run):
    s, c = run["summary"], run["config"]
    tok = (run["data"] or {}).get("tokenizer", "unknown")
    kind = (f"fine-tuned (SFT) from {c['init_from']}" if c.get("init_from")
            else "a base model (pretrained only)")
    step = (run["eval"] or {}).get("model", {}).get("step")
    at = f"; the checkpoint of step {step} evaluated" if step is not None else ""
    return (f"{s.get('params', {}).get('total', 0):,} parameters ({c.get('n_layer')} layers, "
            f"width {c.get('n_embd')}, context {c.get('block_size')} tokens, {tok} tokenizer), "
            f"{kind}{at}")


def build(run):
    """The honesty report of a run (read_run's) as a dict (honesty.json)."""
    cats, s = categories(run["eval"]), run["summary"]
    train, val = s.get("final_train_loss"), s.get("final_val_loss")
    return {"run": "/".join(os.path.normpath(os.path.abspath(run["folder"])).split(os.sep)[-2:]),
            "model": model_line(run), "release_gate": gate_status(s), "claims": claims(run),
            "categories": cats,
            **{where: standing_in(cats, where) for where in (ABOVE, AT_OR_BELOW, NO_CHANCE)},
            "train_val_gap": {"final_train_loss": train, "final_val_loss": val,
                              "gap": val - train if train is not None and val is not None else None,
                              "source": "summary.json: final_train_loss, final_val_loss"},
            "never_measured": unmeasured(run), "limitations": limitations(run, cats)}


def first_screen(h):
    """The essentials, in the first lines of honesty.md."""
    cats = h["categories"]

    def cells(where):
        return "; ".join(
            f"{n} {percent(c['accuracy'])} ({percent(c['low'])}-{percent(c['high'])}, "
            + ("no chance level)" if where == NO_CHANCE else f"chance {percent(c['chance'])})")
            for n, c in cats.items() if n in h[where])
    can, cannot = cells(ABOVE) or "nothing measured above chance", cells(AT_OR_BELOW) or "-"
    if not cats:
        can = cannot = "unknown: no skills pack was evaluated"
    free = cells(NO_CHANCE)
    return [f"# Honesty report: {h['run']}", "",
            f"- **Model**: {h['model']}",
            f"- **Release gate**: {gate_line(h['release_gate'])}",
            f"- **Can** (95% interval's low end above chance): {can}",
            f"- **Not shown above chance** (at or below it): {cannot}",
            *([f"- **No chance level** (the score alone, neither above nor at chance): {free}"]
              if free else []),
            "- **Never measured**: " + ("; ".join(h["never_measured"]) or "-"), "",
            "## Known limitations", "",
            *(f"- {x}" for x in h["limitations"] or ["none the numbers show"])]


def value_cell(value):
    if isinstance(value, list):  # accuracy, interval low, high, chance
        return (f"{percent(value[0])} ({percent(value[1])} to {percent(value[2])}; "
                f"chance {percent(value[3])})")
    return f"{value:,}" if isinstance(value, int) else f"{value:.4f}" if isinstance(value, float) \
        else str(value)


def markdown(h):
    gap, status = h["train_val_gap"], h["release_gate"]
    lines = first_screen(h) + ["", "## Claims and their measurements", "",
                               "| claim | value | measured in |", "|---|---|---|",
                               *(f"| {c['claim']} | {value_cell(c['value'])} | {c['source']} |"
                                 for c in h["claims"])]
    if h["categories"]:
        lines += ["", "## Skills pack categories", "",
                  "| category | n | accuracy | 95% interval | chance | flag |",
                  "|---|---:|---:|---|---:|---|",
                  *(f"| {n} | {c['n']} | {percent(c['accuracy'])} | {percent(c['low'])} to "
                    f"{percent(c['high'])} | {percent(c['chance'])} | {FLAGS[standing(c)]} |"
                    for n, c in h["categories"].items())]
    lines += ["", "## Train/validation gap", "",
              f"final training loss {value_cell(gap['final_train_loss'])}, final validation loss "
              f"{value_cell(gap['final_val_loss'])}: a gap of {value_cell(gap['gap'])} nats/token "
              f"({gap['source']}).",
              "", "## Release gate", "", gate_line(status), "",
              *(f"- block: {g['name']}: {g['detail']}" for g in status["blocking"]),
              *(f"- warn: {g['name']}: {g['detail']}" for g in status["warnings"])]
    return "\n".join(lines).rstrip() + "\n"


def write(run, dest=None):
    """honesty.md and honesty.json of a run (read_run's) into dest (default: the run folder)."""
    h = build(run)
    dest = dest or run["folder"]
    replace_files(dest, {"honesty.json": json.dumps(h, indent=1), "honesty.md": markdown(h)},
                  "give another --run")
    return h


def main(argv):
    config = configurator.configure(__file__, argv)
    folder = config.run or config.out_dir
    if not os.path.isdir(folder):
        fail(f"run={folder}: no such folder: give a train.py out_dir", code=2)
    try:
        h = write(read_run(folder))
    except OSError as e:
        fail(f"cannot write honesty.json and honesty.md into {folder} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "make the folder writable, then rerun"))
    print("\n".join(markdown(h).splitlines()[:FIRST_SCREEN]))
    print(f"wrote {os.path.join(folder, 'honesty.md')} and honesty.json")


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
