"""
Say what a trained model can do: a checkpoint, a run's out_dir (its best checkpoint) or an export
in; eval.json and eval.md out, and a table on the console. Each part runs when its setting is
given: pack_dir (a skills pack's rows, greedy replies), data_dir (validation bits per byte), mc
(multiple choice), attach (an lm-evaluation-harness results JSON); docs/evaluation.md says how.

    python eval.py --ckpt=out/tiny --pack_dir=data/skills --data_dir=data/default \\
        --mc=arc_easy,piqa --attach=lm_eval.json
    torchrun --standalone --nproc_per_node=8 eval.py ...   # ranks split the rows; one all-reduce

A run's checkpoint asked a pack's rows: its summary.json long_run_gate gains (or renews)
eval_floors, the gate profile's floors on those results (gates.py).
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import itertools
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from podgpt.core import configurator
from podgpt.core.inputs import read_json
from podgpt.core.data import Loader, bpb_scale, load_manifest
from podgpt.pod.gates import wilson
from podgpt.release.gates import record_eval_floors
from podgpt.release.loading import load_trained, locate
from podgpt.corpus.tasks import HUB_MC, hub_questions, read_rows
from podgpt.core.tokenizer import chat_ids, chat_prompt, load_tokenizer
from podgpt.core.owned import replace_files
from podgpt.core.util import (MAKE_ROOM, Error, autocast, compute_dtype, disk_full, dtype_name,
                              fail, first_line, is_master, log, percent, run_main, setup)

# --- config
ckpt = ""                       # a checkpoint or export folder, or an out_dir (see which)
which = "best"                  # for an out_dir: best (lowest val loss, else latest) | latest
out_dir = "out"                 # used when ckpt is empty (a run's config file finds its checkpoint)
out = ""                        # eval.json and eval.md go here; "": the run's folder, or eval-NAME
pack_dir = ""                   # a skills pack folder (eval.jsonl, manifest.json); "": no pack rows
data_dir = ""                   # prepared data whose val split gives bits per byte; "": none
mc = ""                         # multiple choice: hub benchmarks or JSONL files, comma-separated
mc_limit = 0                    # a hub benchmark's first N questions (0: all of them)
download_dir = "downloads"      # where a hub benchmark's file may already be; else the hub's cache
attach = ""                     # an lm-evaluation-harness results JSON to include; "": none
max_new_tokens = 256            # the longest reply generated for a pack row
eval_batches = 20               # validation micro-batches per rank for bits per byte
micro_batch_size = 8            # sequences per micro-batch for bits per byte
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N
dtype = "auto"                  # auto (bfloat16 if the GPU has it) | float32 | bfloat16 | float16
# --- end config

MAX_NEW_TOKENS = 1024  # sample.py's serve_max_tokens: a pack's reply never needs more
EXAMPLES = 2  # replies kept per category (rank 0's): what a model writes shows why it scores so


# -----------------------------------------------------------------------------
# the arithmetic: pure functions of counts and text

def summary(n, correct, chance):
    """n, correct, accuracy (None when n is 0), its 95% interval, the chance level and whether the
    interval's low end is above it."""
    low, high = wilson(correct, n)
    return {"n": int(n), "correct": int(correct), "accuracy": correct / n if n else None,
            "low": low, "high": high, "chance": chance,
            "above_chance": bool(n) and chance is not None and low > chance}


def normalise(text):
    return " ".join(text.split())


def final_answer(reply):
    """A reply's last non-empty line, normalised; "" when it has none."""
    lines = [line for line in reply.splitlines() if line.strip()]
    return normalise(lines[-1]) if lines else ""


def pooled_chance(stats):
    """Categories' chance levels weighed by their rows (None where one has none)."""
    n = sum(s["n"] for s in stats)
    if not n or any(s["chance"] is None for s in stats if s["n"]):
        return None
    return sum(s["chance"] * s["n"] for s in stats if s["n"]) / n


# -----------------------------------------------------------------------------
# reading the inputs: one line naming the fix for anything unusable

def read_pack(folder):
    """(eval rows, checked as skills.py checks them, {category: chance level}) of a skills pack."""
    path = os.path.join(folder, "eval.jsonl")
    try:
        rows = read_rows(path)[0]
    except Error as e:  # eval.py's exit status for bad input
        fail(str(e), code=2)
    if not rows:
        fail(f"{path} holds no rows: the pack's eval.jsonl needs at least one", code=2)
    try:
        with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"pack_dir={folder}: its manifest.json cannot be read ({first_line(e)}): build the "
             "pack again", code=2)
    return rows, chance_levels(manifest)


def chance_levels(manifest):
    """{category: chance level} from a pack's manifest.json: categories -> {name: {"chance": p}}."""
    categories = manifest.get("categories") if isinstance(manifest, dict) else None
    if not isinstance(categories, dict):
        return {}
    return {name: float(c["chance"]) for name, c in categories.items()
            if isinstance(c, dict) and isinstance(c.get("chance"), (int, float))}


def read_questions(spec, download_dir, limit):
    """(mc's questions, {source: where its questions came from}): a hub benchmark, else a file."""
    questions, sources = [], {}
    for source in filter(None, (part.strip() for part in spec.split(","))):
        if source in HUB_MC:
            found, sources[source] = hub_questions(source, download_dir, limit)
        else:
            found = read_mc(source)
            sources[source] = dict(file=os.path.abspath(source), questions=len(found))
        questions += found
    return questions, sources


def read_mc(path):
    """The questions of a multiple-choice JSONL file; stops at the first row not in the schema."""
    what = "the multiple-choice file"
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read {what} {path} ({first_line(e)})", code=2)
    rows = []
    for i, line in lines:
        try:
            row = json.loads(line)
        except ValueError as e:
            fail(f"{path} line {i} is not JSON ({first_line(e)}): {what} holds one JSON object a "
                 "line", code=2)
        if wrong := [k for k, kind in (("question", str), ("choices", list), ("answer", int))
                     if not isinstance(row, dict) or not isinstance(row.get(k), kind)]:
            fail(f"{path} line {i}: {', '.join(wrong)} missing or not of the {what} schema's type",
                 code=2)
        rows.append(row)
        if (len(row["choices"]) < 2 or not all(isinstance(c, str) for c in row["choices"])
                or not 0 <= row["answer"] < len(row["choices"])):
            fail(f"{path} row {len(rows)}: choices must be 2 or more strings and answer the index "
                 "of one of them", code=2)
        if not isinstance(row.get("task", ""), str):
            fail(f"{path} row {len(rows)}: task must be a string", code=2)
    if not rows:
        fail(f"{path} holds no rows: {what} needs at least one", code=2)
    return rows


def read_attach(path):
    """{"file": path, "results": {task: {metric: value}}} of lm-evaluation-harness's results."""
    saved = read_json(path, "give the results JSON lm_eval wrote", f"attach={path}", code=2)
    results = saved.get("results") if isinstance(saved, dict) else None
    if not isinstance(results, dict) or not all(isinstance(m, dict) for m in results.values()):
        fail(f"attach={path} is not an lm-evaluation-harness results JSON (no \"results\" object "
             "of task -> metrics): give the results_*.json that lm_eval --output_path wrote",
             code=2)
    return {"file": os.path.abspath(path), "results": results}


# -----------------------------------------------------------------------------
# measuring: each rank its share of the rows, as sums one all-reduce adds up

def encode(where, tokenize, *args):
    try:
        return tokenize(*args)
    except ValueError as e:  # the char tokenizer knows only its corpus' characters
        fail(f"{where}: {e}: this model cannot read it", code=2)


def prompt_layout(tok, prompt, where):
    """(the prompt's ids, the ids that end a reply): with the chat tokens, the chat prompt, ended by
    <|end|> or BOS; without (a base model), BOS, the prompt and a newline, ended by BOS."""
    if not tok.chat:
        return [tok.bos_id] + encode(where, tok.encode, prompt + "\n"), {tok.bos_id}
    return encode(where, chat_prompt, tok, prompt), {chat_ids(tok)["<|end|>"], tok.bos_id}


def score_pack(model, tok, rows, categories, cfg, proc):
    """(n, correct) per category of this rank's rows (rows[rank::world]) as a flat float64 tensor,
    and each category's first EXAMPLES greedy replies (prompt, answer, reply, its final answer)."""
    counts = torch.zeros(len(categories), 2, dtype=torch.float64)
    examples = {c: [] for c in categories}
    for k, row in list(enumerate(rows))[proc.rank::proc.world]:
        ids, stops = prompt_layout(tok, row["prompt"], f"{cfg.pack_dir} eval row {k + 1}")
        tokens = model.generate(torch.tensor([ids], device=proc.dev), cfg.max_new_tokens,
                                temperature=0)
        text = tok.decode(list(itertools.takewhile(lambda t: t not in stops,
                                                   (t.item() for t in tokens))))
        right = final_answer(text) == normalise(row["answer"])
        counts[categories.index(row["category"])] += torch.tensor([1.0, right])
        if len(examples[row["category"]]) < EXAMPLES:
            examples[row["category"]].append(dict(prompt=row["prompt"], answer=row["answer"],
                                                  reply=text, final_answer=final_answer(text)))
    return counts.flatten(), examples


def choice_logprobs(model, context, continuations, dev):
    """Each continuation's summed log-probability after the context, in one right-padded batch (a
    causal model's earlier positions do not see the padding), of the last block_size + 1 ids."""
    span = model.config.block_size + 1
    seqs = [(context + c)[-span:] for c in continuations]
    width = max(len(s) for s in seqs)
    batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=dev)
    logp = F.log_softmax(model(batch[:, :-1])[0].float(), dim=-1)
    picked = logp.gather(-1, batch[:, 1:, None])[..., 0]  # each position's next id's
    # a continuation longer than the window: the part it holds
    ends = [(len(s) - 1, min(len(c), len(s) - 1)) for s, c in zip(seqs, continuations, strict=True)]
    return [picked[row, end - n:end].sum().item() for row, (end, n) in enumerate(ends)]


def score_mc(model, tok, rows, tasks, cfg, proc):
    """(n, acc, acc_norm, summed chance) per task of this rank's rows, as a flat float64 tensor."""
    sums = torch.zeros(len(tasks), 4, dtype=torch.float64)
    for k, row in list(enumerate(rows))[proc.rank::proc.world]:
        choices, right, where = row["choices"], row["answer"], f"{cfg.mc} row {k + 1}"
        # as lm-evaluation-harness splits question + " " + choice: the whole text encoded, the
        # continuation what follows the question's own encoding (after BOS)
        context = [tok.bos_id] + encode(where, tok.encode, row["question"])
        wholes = [encode(where, tok.encode, row["question"] + " " + c) for c in choices]
        scores = choice_logprobs(model, context, [w[len(context) - 1:] for w in wholes], proc.dev)
        per_byte = [s / max(1, len(c.encode("utf-8")))
                    for s, c in zip(scores, choices, strict=True)]
        sums[tasks.index(row.get("task", "mc"))] += torch.tensor(
            [1.0, int(np.argmax(scores)) == right, int(np.argmax(per_byte)) == right,
             1 / len(choices)])
    return sums.flatten()


def check_same_tokens(tok, data_dir, val):
    """Stop unless data_dir's tokens mean to the model what they meant to the data: the same BOS,
    and a stretch of its validation text encoded alike by both tokenizers."""
    try:
        data_tok = load_tokenizer(data_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"data_dir={data_dir}: its tokenizer does not load ({first_line(e)})", code=2)
    text = data_tok.decode(val.window(0)[:256])
    try:
        same = data_tok.bos_id == tok.bos_id and tok.encode(text) == data_tok.encode(text)
    except ValueError:
        same = False
    if not same:
        fail(f"data_dir={data_dir} was tokenized with another tokenizer ({data_tok.spec}) than the "
             f"model's ({tok.spec}): its bits per byte would mean nothing; give the data the model "
             "trained on", code=2)


# -----------------------------------------------------------------------------
# the report

def pack_report(counts, categories, chances):
    """Each category's summary, and overall's (its chance the rows' pooled chance)."""
    pairs = zip(categories, counts.view(-1, 2).tolist(), strict=True)
    stats = {c: summary(n, right, chances.get(c)) for c, (n, right) in pairs}
    n, right = counts.view(-1, 2).sum(0).tolist()
    return {"categories": stats, "overall": summary(n, right, pooled_chance(list(stats.values())))}


def mc_report(sums, tasks):
    """Each task's acc (with its interval and the mean chance) and acc_norm."""
    rows = zip(tasks, sums.view(-1, 4).tolist(), strict=True)
    return {task: dict(summary(n, acc, chance / n if n else None),
                       acc_norm=acc_norm / n if n else None)
            for task, (n, acc, acc_norm, chance) in rows}


def table(title, stats, norm=False):
    """A markdown table of summaries, one row each."""
    head = [f"| {title} | n | correct | accuracy | 95% interval | chance | above chance |"
            + " acc_norm |" * norm, "|---|---:|---:|---:|---|---:|---|" + "---:|" * norm]
    rows = [f"| {name} | {s['n']} | {s['correct']} | {percent(s['accuracy'])} | "
            f"{percent(s['low'])} to {percent(s['high'])} | {percent(s['chance'])} | "
            f"{'yes' if s['above_chance'] else 'no'} |" + f" {percent(s.get('acc_norm'))} |" * norm
            for name, s in stats.items()]
    return "\n".join(head + rows)


def cell(text, width=60):
    """text as one markdown table cell: one line, at most width characters, no column breaks."""
    text = normalise(text).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def markdown(report):
    """eval.md: what was evaluated, then each part that ran."""
    src = report["model"]
    parts = [f"# Evaluation of {src['checkpoint']}", "",
             f"{'Export' if src['exported'] else 'Checkpoint'} at step {src['step']}; greedy "
             f"replies of up to {report['settings']['max_new_tokens']} tokens; intervals are 95% "
             "Wilson score intervals."]
    if "pack" in report:
        pack = report["pack"]
        parts += ["", f"## Skills pack ({pack['folder']}, {pack['layout']} prompts)", "",
                  table("category", {**pack["categories"], "overall": pack["overall"]}),
                  "", "| category | prompt | answer | the reply's final answer |",
                  "|---|---|---|---|",
                  *(f"| {c} | {cell(e['prompt'])} | {cell(e['answer'])} | "
                    f"{cell(e['final_answer'])} |"
                    for c, shown in pack["examples"].items() for e in shown)]
    if "bpb" in report:
        bpb = report["bpb"]
        parts += ["", "## Validation", "",
                  f"{bpb['val_bpb']:.4f} bits per byte on {bpb['data_dir']}'s val split (loss "
                  f"{bpb['val_loss']:.4f} over {bpb['batches']} micro-batches of "
                  f"{bpb['micro_batch_size']})."]
    if "mc" in report:
        sources = "; ".join(f"{name}: {where.get('url', where.get('file'))}"
                            for name, where in report["mc"]["sources"].items())
        parts += ["", "## Multiple choice", "", f"From {sources}.", "",
                  table("task", report["mc"]["tasks"], True)]
    if "external" in report:
        external = report["external"]
        parts += ["", f"## lm-evaluation-harness ({external['file']})", "",
                  "| task | metric | value |", "|---|---|---:|",
                  *(f"| {task} | {metric} | {value:.4g} |"
                    for task, metrics in external["results"].items()
                    for metric, value in metrics.items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool))]
    return "\n".join(parts) + "\n"


# -----------------------------------------------------------------------------

def check_config(config):
    if config.which not in ("best", "latest"):
        fail(f"which={config.which!r} is not one of best, latest", code=2)
    for key, least in (("max_new_tokens", 1), ("eval_batches", 1), ("micro_batch_size", 1),
                       ("mc_limit", 0)):
        if not isinstance(config[key], int) or config[key] < least:
            fail(f"{key}={config[key]!r} is out of range: use an integer >= {least}", code=2)
    if config.max_new_tokens > MAX_NEW_TOKENS:  # each row would generate for minutes
        fail(f"max_new_tokens={config.max_new_tokens} is out of range: use an integer from 1 to "
             f"{MAX_NEW_TOKENS} (as sample.py's server caps a request)", code=2)
    if not (config.pack_dir or config.data_dir or config.mc or config.attach):
        fail("nothing to evaluate: give --pack_dir=FOLDER, --data_dir=FOLDER, --mc=FILE and/or "
             "--attach=FILE", code=2)


def read_inputs(config):
    """Every input given: the pack, the questions, data_dir's manifest, the attached results."""
    rows, chances = read_pack(config.pack_dir) if config.pack_dir else ([], {})
    questions, sources = read_questions(config.mc, config.download_dir, config.mc_limit)
    try:
        manifest = load_manifest(config.data_dir) if config.data_dir else None
    except ValueError as e:
        fail(f"data_dir={config.data_dir}: {e}", code=2)
    return SimpleNamespace(rows=rows, chances=chances, questions=questions, sources=sources,
                           manifest=manifest,
                           external=read_attach(config.attach) if config.attach else None)


def measure(config, loaded, proc, inputs):
    """The report's parts of the inputs (read_inputs), each rank's sums added in one all-reduce."""
    model, tok, manifest = loaded.model, loaded.tok, inputs.manifest
    val = None
    if manifest:  # data_dir's val split, once its tokens are known to be the model's
        val = Loader(config.data_dir, "val", manifest, model.config.block_size, seed=0)
        check_same_tokens(tok, config.data_dir, val)
    categories = sorted({r["category"] for r in inputs.rows})
    tasks = sorted({q.get("task", "mc") for q in inputs.questions})
    with torch.no_grad(), autocast(proc.dev, compute_dtype(config.dtype, proc.dev)):
        pack_counts, examples = score_pack(model, tok, inputs.rows, categories, config, proc)
        parts = [pack_counts, score_mc(model, tok, inputs.questions, tasks, config, proc)]
        # the summed loss and the targets counted: validation_sums' first and last (refine's
        # stats lie between)
        loss = torch.zeros(2, dtype=torch.float64) if val is None else val.validation_sums(
            model, config.eval_batches, config.micro_batch_size, proc.rank, proc.world,
            proc.dev).cpu()[[0, -1]]
    sums = torch.cat([*parts, loss])
    if proc.distributed:
        sums = sums.to(proc.dev)
        dist.all_reduce(sums)
        sums = sums.cpu()
    pack_sums, mc_sums, loss = sums.split([parts[0].numel(), parts[1].numel(), 2])
    report = {}
    if config.pack_dir:
        report["pack"] = dict(folder=config.pack_dir, layout="chat" if tok.chat else "base",
                              **pack_report(pack_sums, categories, inputs.chances),
                              examples=examples)
    if config.mc:
        report["mc"] = {"sources": inputs.sources, "tasks": mc_report(mc_sums, tasks)}
    if config.data_dir:
        val_loss = loss[0].item() / loss[1].item()
        report["bpb"] = dict(data_dir=config.data_dir, val_loss=val_loss,
                             val_bpb=val_loss * bpb_scale(manifest["splits"]["val"]),
                             targets=int(loss[1].item()), batches=config.eval_batches * proc.world,
                             micro_batch_size=config.micro_batch_size)
    return report


def main(argv):
    config = configurator.configure(__file__, argv)
    check_config(config)
    found = locate(config.ckpt or config.out_dir, config.which)
    inputs = read_inputs(config)  # before the model: a bad input stops at once
    proc = setup(config.device)
    loaded = load_trained(found, proc.dev, info=True)
    if loaded.model.config.objective == "bd3lm":
        fail(f"checkpoint {loaded.path} is a block-diffusion model (objective=bd3lm): eval.py "
             "scores autoregressive models' greedy replies and log-likelihoods", code=2)
    settings = {k: config[k] for k in ("max_new_tokens", "eval_batches", "micro_batch_size")}
    report = {"model": {k: v for k, v in loaded.info.items() if k != "model"},
              "settings": settings | {"dtype": dtype_name(compute_dtype(config.dtype, proc.dev))},
              **measure(config, loaded, proc, inputs)}
    if inputs.external:
        report["external"] = inputs.external
    if not is_master():
        return
    # the run's folder (its out_dir) for a checkpoint of OUT_DIR/ckpt/; else eval-NAME beside the
    # checkpoint or export (an export holds only what export.py wrote, so that it can replace it)
    path = os.path.abspath(loaded.path)
    parent = os.path.dirname(path)
    in_run = not loaded.exported and os.path.basename(parent) == "ckpt"
    run = os.path.dirname(parent) if in_run else None
    out = config.out or run or os.path.join(parent, f"eval-{os.path.basename(path)}")
    try:
        replace_files(out, {"eval.json": json.dumps(report, indent=1),
                            "eval.md": markdown(report)}, "give another --out=FOLDER")
    except OSError as e:
        fail(f"cannot write eval.json and eval.md into {out} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "give --out=FOLDER"))
    log(markdown(report))
    log(f"wrote {os.path.join(out, 'eval.json')} and eval.md")
    # the run's long-run gate (summary.json) gains the profile's floors on what the pack measured
    if "pack" in report and run and (floors := record_eval_floors(run, report["pack"])):
        log(f"{run}/summary.json long_run_gate: eval_floors {floors['verdict']}: "
            f"{floors['detail']}")


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
