"""The tasks a model is scored on, in their formats: GSM8K's problems (each answer ends in
"#### <number>") as prepare.py's documents and train.py's eval_gsm8k_samples; a skills pack's rows
as prepare.py's chat documents; the hub's multiple-choice benchmarks as eval.py's questions."""

import json
import os
import re

import numpy as np
import torch
import torch.distributed as dist

from podgpt.core.data import open_shard
from podgpt.core.owned import file_sha256
from podgpt.corpus.download import download
from podgpt.core.tokenizer import SEGMENT, load_tokenizer, reply_text
from podgpt.core.util import fail, first_line


def gsm8k_plan(answer):
    """The reasoning lines of a GSM8K answer (before "####") without their <<calculator>> notes."""
    return re.sub(r"<<[^<>]*>>", "", answer.rpartition("####")[0]).strip()


def gsm8k_documents(path, questions, answers, form):
    """The problems of a GSM8K file's question and answer columns, each one document: qa,
    "Question: ...\nAnswer: ..."; hdp, for plan-then-execute block diffusion, the question, the plan
    (gsm8k_plan) and the execution (the annotated lines and "#### <number>"), joined by SEGMENT."""
    if len(questions) != len(answers):
        fail(f"{path}: {len(questions)} questions but {len(answers)} answers (a null in one "
             "column?): download it again")
    for question, answer in zip(questions, answers, strict=True):
        reasoning, hashes, final = answer.rpartition("####")
        if not hashes:
            fail(f"{path}: an answer without its final '#### <number>' line, which GSM8K's all "
                 f"have: not GSM8K's main config? ({answer[:60]!r})")
        if form == "qa":
            yield f"Question: {question}\nAnswer: {answer}"
        else:
            execution = f"{reasoning.strip()}\n#### {final.strip()}"
            yield SEGMENT.join([question.strip(), gsm8k_plan(answer), execution])


def gsm8k_answer(text):
    """The number after the last "####" of a GSM8K answer (or a model's), commas and a trailing ".0"
    dropped; None without one."""
    found = re.findall(r"####\s*(-?[\d,]*\.?\d+)", text)
    return found[-1].replace(",", "").removesuffix(".0") if found else None


def gsm8k_problems(data_dir, manifest, n):
    """(prompt token ids, the right answer) of the first n problems of a gsm8k data_dir's validation
    split (GSM8K's test): qa, BOS and the document up to "Answer:"; hdp, its question segment."""
    tok, args = load_tokenizer(data_dir), manifest["prepare_args"]
    lengths = [int(x) for x in args.get("segments", "").split(",") if x]  # prepare.py checked them
    if args["source"] != "gsm8k" or not lengths:
        fail(f"eval_gsm8k_samples={n}: {data_dir} holds no GSM8K problems of a fixed length: "
             "prepare it with --source=gsm8k and --segments (config/h200_gsm8k_bd3lm.py)")
    problems = []
    for shard in manifest["splits"]["val"]["shards"]:
        rows = np.asarray(open_shard(os.path.join(data_dir, shard["file"])))
        for row in rows.reshape(-1, sum(lengths))[:n - len(problems)]:
            if args.get("gsm8k_format", "qa") == "hdp":
                prompt, answer = row[:lengths[0]].tolist(), tok.decode(row[lengths[0]:])
                # the segment's padding off: the sampler pads again
                while len(prompt) > 1 and prompt[-1] == tok.bos_id:
                    prompt.pop()
            else:
                head, _, answer = tok.decode(row).partition("\nAnswer:")
                prompt = [tok.bos_id] + tok.encode(head + "\nAnswer:")
            problems.append((prompt, gsm8k_answer(answer)))
    return problems


def gsm8k_accuracy(model, problems, tok, block_size, autocast, proc, sharded):
    """The share of problems whose greedy answer ends in the right "#### <number>". Distributed,
    each rank answers every world-th problem and one all-reduce sums them; sharded (fsdp), every
    forward gathers weights with every rank, so each answers them all (greedy: the same tokens)."""
    split = proc.distributed and not sharded
    right = torch.zeros((), device=proc.dev)
    model.eval()
    with torch.no_grad(), autocast:
        for prompt, answer in problems[proc.rank::proc.world] if split else problems:
            ids = torch.tensor([prompt], device=proc.dev)
            tokens = model.generate(ids, block_size - len(prompt), temperature=0)
            right += gsm8k_answer(tok.decode([t.item() for t in tokens])) == answer
    model.train()
    if split:
        dist.all_reduce(right)
    return right.item() / len(problems)


PACK_FIELDS = ("category", "prompt", "answer", "scratchpad", "answer_style")  # all strings
ANSWER_STYLES = ("direct", "scratchpad")
A_ROW = f"(a row is {{{', '.join(PACK_FIELDS)}}})"


def check_row(row, where):
    """Fail, naming where, unless row is an object of exactly the pack's fields, each valid."""
    if not isinstance(row, dict):
        fail(f"{where}: not a JSON object {A_ROW}")
    if missing := [f for f in PACK_FIELDS if f not in row]:
        fail(f"{where}: no field '{missing[0]}' {A_ROW}")
    if extra := sorted(set(row) - set(PACK_FIELDS)):
        fail(f"{where}: unknown field '{extra[0]}' {A_ROW}")
    for field in PACK_FIELDS:
        if not isinstance(row[field], str):
            fail(f"{where}: field '{field}' is {type(row[field]).__name__}, not a string")
    if row["answer_style"] not in ANSWER_STYLES:
        fail(f"{where}: answer_style {row['answer_style']!r} is not one of "
             f"{', '.join(ANSWER_STYLES)}")
    for field in ("category", "prompt", "answer"):
        if not row[field].strip():
            fail(f"{where}: field '{field}' is empty")
    if "\n" in row["answer"] or "\r" in row["answer"]:
        fail(f"{where}: the answer is more than one line (the steps belong in 'scratchpad')")


def read_rows(path):
    """The rows of a JSONL file, each checked, with where each came from ("path:line")."""
    rows, origins = [], []
    try:
        with open(path, encoding="utf-8-sig") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    fail(f"{where}: not valid JSON {A_ROW}")
                check_row(row, where)
                rows.append(row)
                origins.append(where)
    except UnicodeDecodeError as e:
        fail(f"{path}: not UTF-8 text ({first_line(e)}): save it as UTF-8")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}")
    return rows, origins


def pack_documents(path):
    """The rows of a skills pack's sft.jsonl, each checked, as documents: the prompt and the reply
    (tokenizer.reply_text) joined by SEGMENT, which prepare.py --chat=True makes a chat_row."""
    rows, origins = read_rows(path)
    for row, where in zip(rows, origins, strict=True):
        reply = reply_text(row)
        if SEGMENT in row["prompt"] + reply:
            fail(f"{where}: holds the character {SEGMENT!r}, which prepare.py keeps for itself")
        yield row["prompt"] + SEGMENT + reply


# -----------------------------------------------------------------------------
# the hub's multiple-choice benchmarks as eval.py's {question, choices, answer, task}, worded as
# lm-evaluation-harness words them zero-shot, each at a pinned revision: every user scores the same
# questions, and eval.json names them by it

def arc_question(r):
    return dict(question=f"Question: {r['question']}\nAnswer:", choices=list(r["choices"]["text"]),
                answer=list(r["choices"]["label"]).index(r["answerKey"]))


def piqa_question(r):
    return dict(question=f"Question: {r['goal']}\nAnswer:", choices=[r["sol1"], r["sol2"]],
                answer=int(r["label"]))


def hellaswag_text(text):
    """A HellaSwag text without its WikiHow markup ("[title]", "[step]"...)."""
    return re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". ")).replace("  ", " ")


def hellaswag_question(r):
    context = f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"
    return dict(question=hellaswag_text(context), choices=[hellaswag_text(e) for e in r["endings"]],
                answer=int(r["label"]))


ARC = ("allenai/ai2_arc", "210d026faf9955653af8916fad021475a3f00453")
HUB_MC = {  # name: (repo, revision, file, its row -> a question)
    "arc_easy": (*ARC, "ARC-Easy/test-00000-of-00001.parquet", arc_question),
    "arc_challenge": (*ARC, "ARC-Challenge/test-00000-of-00001.parquet", arc_question),
    "hellaswag": ("Rowan/hellaswag", "218ec52e09a7e7462a5400043bb9a69a41d06b76",
                  "data/validation-00000-of-00001.parquet", hellaswag_question),
    "piqa": ("ybisk/piqa", "078a131412f46a38025a762322c174a8bae2610c",
             "plain_text/piqa-validation.parquet", piqa_question),
}


def hub_questions(name, download_dir, limit=0):
    """(the first `limit` questions of a hub benchmark (0: all), {url, sha256, questions} of where
    they came from); its file through download.py."""
    from huggingface_hub import hf_hub_url
    import pyarrow.parquet as pq
    repo, revision, file, question = HUB_MC[name]
    url = hf_hub_url(repo, file, repo_type="dataset", revision=revision)
    path = download(url, download_dir)
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors have many types
        fail(f"{path} ({name}) cannot be read as parquet ({first_line(e)}): delete it and rerun "
             "to download it again", code=2)
    questions = []
    for i, r in enumerate(records[:limit or None], 1):
        try:
            questions.append(dict(question(r), task=name))
        except (KeyError, TypeError, ValueError) as e:
            fail(f"{path} row {i}: not {name}'s columns or values ({first_line(e)}): not the file "
                 f"of {repo} at {revision}?", code=2)
    return questions, dict(url=url, sha256=file_sha256(path), questions=len(questions))
