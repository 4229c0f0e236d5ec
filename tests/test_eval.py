"""eval.py: the interval, chance and answer arithmetic against hand-computed cases; on a tiny checkpoint, the pack's
categories and counts, multiple choice against the model's own log-likelihoods, bits per byte as train.py's
val_bpb, an attached lm-eval JSON, an export as input, two ranks as one, and bad inputs as one line each."""
import hashlib
import io
import json
import os

import pytest
import torch

import eval as evaluate
from podgpt.core.checkpoint import find_checkpoint
from podgpt.pod.checkpoints import load_model
from conftest import RANKS, Captured, read_metrics, run, run_script, shared, train_tiny
from podgpt.corpus.tasks import HUB_MC, hub_questions
from test_prepare import hub_env, server  # noqa: F401  (server: a local hub's fixture)
from podgpt.core.tokenizer import chat_ids, chat_prompt, load_tokenizer, save_tokenizer, train_tokenizer, with_chat_tokens

PACK_ROWS = [("arith", "2+2="), ("arith", "3+4="), ("arith", "10-3="), ("letters", "count a in banana")]
QUESTIONS = ["def main(", "import", "for i in", "class Foo"]
CHOICES = [")", " os", "@@@q", "range(10):"]


def test_wilson_interval_against_hand_computed_values():
    # z = 1.96: z^2 = 3.8416; 0/10: centre (0 + 0.19208) / 1.38416 = 0.13877, half the same: 0 to 0.27754
    assert evaluate.wilson(0, 10, z=1.96) == pytest.approx((0.0, 0.277540), abs=1e-6)
    # 5/10: centre 0.5, half 1.96 / 1.38416 * sqrt(0.025 + 0.009604) = 1.416021 * 0.186022 = 0.263410
    assert evaluate.wilson(5, 10, z=1.96) == pytest.approx((0.236590, 0.763410), abs=1e-6)
    assert evaluate.wilson(10, 10, z=1.96) == pytest.approx((0.722460, 1.0), abs=1e-6)
    assert evaluate.wilson(0, 0) == (0.0, 1.0)  # an empty category: nothing known


def test_summary_chance_and_final_answer():
    empty = evaluate.summary(0, 0, 0.1)
    assert empty["accuracy"] is None and not empty["above_chance"]
    assert evaluate.summary(10, 10, 0.5)["above_chance"]  # low end 0.7225 > 0.5
    assert evaluate.summary(10, 5, 0.2)["above_chance"] and not evaluate.summary(10, 5, 0.25)["above_chance"]
    assert not evaluate.summary(10, 10, None)["above_chance"]  # no chance level: no claim
    stats = [evaluate.summary(2, 1, 0.5), evaluate.summary(6, 1, 0.1), evaluate.summary(0, 0, None)]
    assert evaluate.pooled_chance(stats) == pytest.approx((2 * 0.5 + 6 * 0.1) / 8)
    assert evaluate.chance_levels({"categories": {"a": {"eval": 3, "chance": 0.25}, "b": {"chance": None}}}) \
        == {"a": 0.25}
    assert evaluate.final_answer("step 1\n  12 +  30 = 42\n\n  42  \n \n") == "42"
    assert evaluate.final_answer("apple,  banana\tcherry") == "apple, banana cherry"
    assert evaluate.final_answer(" \n") == ""


def test_the_chat_prompt_when_the_tokenizer_has_the_chat_tokens(tmp_path):
    meta, ranks = train_tokenizer("byte", lambda: iter(()), lambda: iter(()))
    save_tokenizer(tmp_path, "byte", with_chat_tokens(meta), ranks)
    tok = load_tokenizer(tmp_path)
    ids, stops = evaluate.prompt_layout(tok, "2+2=", "row 1")
    assert ids == chat_prompt(tok, "2+2=") and stops == {chat_ids(tok)["<|end|>"], tok.bos_id}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, stdlib_data):
    """A tiny run of 3 steps (an evaluation and a checkpoint at the last) and an export of it: (out_dir, export)."""
    def build(root):
        with Captured() as captured:
            train_tiny(captured, root / "run", stdlib_data, "--total_batch_tokens=256", "--micro_batch_size=4",
                       "--max_steps=3", "--eval_every=3", "--ckpt_every=3", "--learning_rate=1e-2", "--seed=7")
        from podgpt.release.hf import export
        export(find_checkpoint(str(root / "run"), "best"), str(root / "export"))
    root = shared(tmp_path_factory, "eval_run", build)
    return str(root / "run"), str(root / "export")


def greedy_answer(model, tok, prompt, max_new_tokens):
    """The final answer of the model's greedy reply to a base model's prompt, computed here token by token."""
    ids = [tok.bos_id] + tok.encode(prompt + "\n")
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids]))[0][0, -1, :model.config.vocab_size].argmax())
        if token == tok.bos_id:
            break
        ids.append(token)
    return evaluate.final_answer(tok.decode(ids[len(tok.encode(prompt + "\n")) + 1:]))


def loglikelihood(model, tok, question, choice):
    """The summed log-probability of choice's tokens after the question's, as lm-eval splits the text."""
    context = [tok.bos_id] + tok.encode(question)
    whole = [tok.bos_id] + tok.encode(question + " " + choice)
    logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0][0].float(), dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(len(context), len(whole)))


@pytest.fixture(scope="module")
def inputs(trained, tmp_path_factory):
    """A pack (half its rows answered as the model answers them), a multiple-choice file (the first two questions'
    answer the choice the model likes most, the others another) and an lm-eval JSON; with the counts expected."""
    folder = tmp_path_factory.mktemp("eval_inputs")
    model, _ = load_model(find_checkpoint(trained[0], "best"))
    tok = load_tokenizer(find_checkpoint(trained[0], "best"))
    rows, right = [], {"arith": 0, "letters": 0}
    with torch.no_grad():
        for i, (category, prompt) in enumerate(PACK_ROWS):
            # the odd rows' answers are the model's own, where it gives one (a pack's answer is never empty)
            answer = greedy_answer(model, tok, prompt, 8) if i % 2 else ""
            answer = answer if answer.strip() else "no such answer"
            right[category] += answer != "no such answer"
            rows.append(dict(category=category, prompt=prompt, answer=answer, scratchpad="", answer_style="direct"))
        scores = [[loglikelihood(model, tok, q, c) for c in CHOICES] for q in QUESTIONS]
    best = [max(range(len(CHOICES)), key=s.__getitem__) for s in scores]
    answers = [b if i < 2 else (b + 1) % len(CHOICES) for i, b in enumerate(best)]
    per_byte = [max(range(len(CHOICES)), key=lambda c: s[c] / len(CHOICES[c].encode())) for s in scores]
    (folder / "pack").mkdir()
    (folder / "pack" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "pack" / "manifest.json").write_text(json.dumps(
        {"categories": {"arith": {"eval": 3, "chance": 0.01}, "letters": {"eval": 1, "chance": 0.1}}}))
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": CHOICES, "answer": a, "task": "t"})
                                             + "\n" for q, a in zip(QUESTIONS, answers)))
    (folder / "lm.json").write_text(json.dumps({"results": {"arc_easy": {"acc,none": 0.25, "alias": "arc_easy"}}}))
    return dict(pack=str(folder / "pack"), mc=str(folder / "mc.jsonl"), attach=str(folder / "lm.json"),
                right=right, mc_right=2, mc_norm_right=sum(map(int.__eq__, per_byte, answers)))


def run_eval(capfd, src, *args, ranks=False):
    """eval.py on src (in this process; ranks: as two ranks), must exit 0."""
    argv = ["eval.py", f"--ckpt={src}", "--device=cpu", "--dtype=float32", "--max_new_tokens=8", *args]
    r = run([*RANKS, *argv]) if ranks else run_script(argv, capfd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_a_checkpoint_is_evaluated_into_its_run_folder(trained, inputs, capfd, stdlib_data):
    out_dir = trained[0]
    r = run_eval(capfd, out_dir, f"--pack_dir={inputs['pack']}", f"--mc={inputs['mc']}", f"--attach={inputs['attach']}",
                 f"--data_dir={stdlib_data}", "--eval_batches=2", "--micro_batch_size=4")
    report = json.load(open(os.path.join(out_dir, "eval.json")))
    pack = report["pack"]
    assert pack["layout"] == "base"
    assert {c: (s["n"], s["correct"], s["chance"]) for c, s in pack["categories"].items()} \
        == {"arith": (3, inputs["right"]["arith"], 0.01), "letters": (1, inputs["right"]["letters"], 0.1)}
    assert (pack["overall"]["n"], pack["overall"]["correct"]) == (4, sum(inputs["right"].values()))
    assert [e["prompt"] for e in pack["examples"]["arith"]] == ["2+2=", "3+4="]  # the first two of 3
    mc = report["mc"]["tasks"]["t"]
    assert (mc["n"], mc["correct"], mc["chance"]) == (4, inputs["mc_right"], 1 / len(CHOICES))
    assert mc["acc_norm"] == inputs["mc_norm_right"] / 4
    # train.py's val_bpb of the same checkpoint, the same micro-batches (TINY_MODEL's eval_steps=2, 4 rows each)
    val = [m for m in read_metrics(out_dir) if "val_bpb" in m][-1]
    assert report["bpb"]["val_bpb"] == pytest.approx(val["val_bpb"], rel=1e-5)
    assert report["external"]["results"]["arc_easy"]["acc,none"] == 0.25
    md = open(os.path.join(out_dir, "eval.md")).read()
    assert "| arith | 3 |" in md and "| arith | 2+2= | no such answer |" in md and "| arc_easy | acc,none | 0.25 |" in md and "bits per byte" in md
    assert f"| overall | 4 | {sum(inputs['right'].values())} |" in r.stdout


def test_an_export_and_two_ranks_give_the_same_counts(trained, inputs, capfd, tmp_path):
    out_dir, exported = trained
    args = [f"--pack_dir={inputs['pack']}", f"--mc={inputs['mc']}"]
    run_eval(capfd, out_dir, *args, f"--out={tmp_path / 'one'}")
    run_eval(capfd, exported, *args)  # beside the export: it holds only export.py's files
    run_eval(capfd, out_dir, *args, f"--out={tmp_path / 'two'}", ranks=True)
    one, *others = (json.load(open(os.path.join(folder, "eval.json")))
                    for folder in (tmp_path / "one", exported.replace("export", "eval-export"), tmp_path / "two"))
    assert not os.path.exists(os.path.join(exported, "eval.json"))
    for other in others:
        assert other["pack"]["categories"] == one["pack"]["categories"] and other["mc"] == one["mc"]


def parquet(rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


HUB_ROWS = {  # two rows of each benchmark's file, in its columns
    "arc_easy": [{"id": "a1", "question": "def main(", "answerKey": "B",
                  "choices": {"text": [")", " os", "@@@q", "range(10):"], "label": ["A", "B", "C", "D"]}},
                 {"id": "a2", "question": "import", "answerKey": "3",
                  "choices": {"text": [" os", ")", "@@@q"], "label": ["1", "2", "3"]}}],
    "hellaswag": [{"ind": 4, "activity_label": "Coding", "ctx_a": "A man writes", "ctx_b": "code [title] then",
                   "ctx": "", "endings": ["runs it [step] twice.", "sleeps.", "@@@.", "for i in range(3)."],
                   "source_id": "s", "split": "val", "split_type": "indomain", "label": "3"},
                  {"ind": 5, "activity_label": "Code", "ctx_a": "def f(x):", "ctx_b": "return", "ctx": "",
                   "endings": [" x", " @@@", " )", " import"], "source_id": "s", "split": "val",
                   "split_type": "indomain", "label": "0"}],
    "piqa": [{"goal": "print a line", "sol1": "print('hi')", "sol2": "@@@q", "label": 0},
             {"goal": "import os", "sol1": "@@@", "sol2": "import os", "label": 1}],
}


def test_the_hub_benchmarks_come_from_their_pinned_files_worded_as_lm_eval(trained, inputs, server, tmp_path,
                                                                           monkeypatch, capfd):
    """arc_easy, hellaswag and piqa from a local mirror of the hub, each file at its pinned revision: the questions
    as lm-evaluation-harness words them (Question/Answer for ARC and PIQA, HellaSwag's context without its WikiHow
    markup), the answer's index from ARC's labels (letters or digits) and HellaSwag's string label; eval.py scores
    them beside a JSONL file, each a task with its chance level, and records each file's URL and sha256."""
    for name, rows in HUB_ROWS.items():
        repo, revision, file, _ = HUB_MC[name]
        server.files[f"/datasets/{repo}/resolve/{revision}/{file}"] = parquet(rows)
    hub_env(monkeypatch, HF_ENDPOINT=server.url, HF_HOME=tmp_path / "hf_home", HF_HUB_DISABLE_TELEMETRY=1)
    arc, source = hub_questions("arc_easy", str(tmp_path / "dl"))
    assert [(q["question"], q["choices"][q["answer"]]) for q in arc] == [("Question: def main(\nAnswer:", " os"),
                                                                         ("Question: import\nAnswer:", "@@@q")]
    assert source["sha256"] == hashlib.sha256(server.files[next(iter(server.files))]).hexdigest()
    (swag,), _ = hub_questions("hellaswag", str(tmp_path / "dl"), limit=1)
    assert swag == dict(question="Coding: A man writes Code. then", task="hellaswag", answer=3,
                        choices=["runs it twice.", "sleeps.", "@@@.", "for i in range(3)."])
    piqa, _ = hub_questions("piqa", str(tmp_path / "dl"))
    assert [(q["question"], q["answer"]) for q in piqa] == [("Question: print a line\nAnswer:", 0),
                                                            ("Question: import os\nAnswer:", 1)]
    model, _ = load_model(find_checkpoint(trained[0], "best"))
    tok = load_tokenizer(find_checkpoint(trained[0], "best"))
    right = {}
    with torch.no_grad():
        for name in HUB_ROWS:
            questions, _ = hub_questions(name, str(tmp_path / "dl"))
            right[name] = sum(max(range(len(q["choices"])), key=lambda c: loglikelihood(
                model, tok, q["question"], q["choices"][c])) == q["answer"] for q in questions)
    out = tmp_path / "report"
    run_eval(capfd, trained[0], f"--mc=arc_easy, hellaswag,piqa,{inputs['mc']}", f"--download_dir={tmp_path / 'dl'}",
             f"--out={out}")
    report = json.loads((out / "eval.json").read_text())["mc"]
    assert report["tasks"]["t"]["correct"] == inputs["mc_right"] and report["sources"][inputs["mc"]]["questions"] == 4
    for name, chance in (("arc_easy", (1 / 4 + 1 / 3) / 2), ("hellaswag", 1 / 4), ("piqa", 1 / 2)):
        task = report["tasks"][name]
        assert (task["n"], task["correct"]) == (2, right[name]) and task["chance"] == pytest.approx(chance)
        repo, revision, file, _ = HUB_MC[name]
        assert report["sources"][name]["url"].endswith(f"/datasets/{repo}/resolve/{revision}/{file}")
    run_eval(capfd, trained[0], "--mc=piqa", "--mc_limit=1", f"--download_dir={tmp_path / 'dl'}", f"--out={out}")
    assert json.loads((out / "eval.json").read_text())["mc"]["tasks"]["piqa"]["n"] == 1


@pytest.mark.parametrize("args, says", [
    ([], "nothing to evaluate"),
    (["--pack_dir={pack}", "--max_new_tokens=0"], "max_new_tokens=0 is out of range"),
    (["--mc=piqa", "--mc_limit=-1"], "mc_limit=-1 is out of range"),
    (["--mc={bad_mc}"], "answer the index of one of them"),
    (["--pack_dir={bad_pack}"], "eval.jsonl:1: no field 'scratchpad' (a row is {category, prompt, answer, "),
    (["--attach={pack}/manifest.json"], "is not an lm-evaluation-harness results JSON"),
    (["--mc=nowhere.jsonl"], "cannot read the multiple-choice file nowhere.jsonl"),
    (["--data_dir=nowhere"], "data_dir=nowhere: no manifest.json in nowhere"),
])
def test_bad_inputs_are_one_line(trained, inputs, capfd, tmp_path, args, says):
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "choices": ["a", "b"], "answer": 2}\n')
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "eval.jsonl").write_text('{"category": "c", "prompt": "p", "answer": 4}\n')
    paths = dict(pack=inputs["pack"], bad_mc=tmp_path / "bad.jsonl", bad_pack=tmp_path / "pack")
    r = run_script(["eval.py", f"--ckpt={trained[0]}", "--device=cpu", *(a.format(**paths) for a in args)], capfd)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
