"""The skills pack (skills.py): the same files from the same seed on any worker count, eval rows never trained on
(no shared prompt, no shared run of words), and each refusal in one line with nothing written."""
import hashlib
import json

import skills
from podgpt.corpus import tasks
from conftest import run_script
from test_prepare import GSM8K, gsm8k_parquet, hub_env, server  # noqa: F401  (server: a local hub's fixture)

SMALL = ["--sft_rows=111", "--eval_rows=23"]  # 11 categories: a remainder in both splits


def make(capfd, out, *args, code=0):
    r = run_script(["skills.py", f"--pack_dir={out}", *args], capfd)
    assert r.returncode == code, r.stderr
    return r


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_the_pack_is_its_seed_s_on_any_worker_count_valid_balanced_and_apart(tmp_path, capfd):
    """workers=1 and workers=2 write byte-identical files; another seed other rows. Every row is in the schema with
    its answer on the reply's last line; the rows per category are asked // categories, the remainder to the
    first; no prompt repeats and no SFT row holds a run of an eval row's words; the manifest's counts and sha256
    are the files'."""
    files = ("sft.jsonl", "eval.jsonl", "manifest.json")
    packs = {}
    for name, args in {"one": ["--pack_workers=1"], "two": ["--pack_workers=2"], "seed1": ["--pack_seed=1"]}.items():
        make(capfd, tmp_path / name, *SMALL, *args)
        packs[name] = {f: (tmp_path / name / f).read_bytes() for f in files}
    assert packs["one"] == packs["two"]
    assert packs["seed1"]["sft.jsonl"] != packs["one"]["sft.jsonl"]
    sft, evals = read(tmp_path / "one" / "sft.jsonl"), read(tmp_path / "one" / "eval.jsonl")
    for k, row in enumerate(sft + evals):
        tasks.check_row(row, f"row {k}")
        assert skills.reply_text(row).split("\n")[-1] == row["answer"] and row["scratchpad"]
        assert row["answer_style"] == "scratchpad"
    prompts = [skills.normal(row["prompt"]) for row in sft + evals]
    assert len(set(prompts)) == len(prompts) and skills.overlap(sft, evals) == []
    manifest = json.loads(packs["one"]["manifest.json"])
    names = list(skills.CATEGORIES)
    assert [(name, n["sft"], n["eval"]) for name, n in manifest["categories"].items()] == [
        (name, 10 + (k < 1), 2 + (k < 1)) for k, name in enumerate(names)]
    assert manifest["categories"]["weekday"]["chance"] == 1 / 7 and manifest["categories"]["yes_no"]["chance"] == 0.5
    assert [row["category"] for row in evals[:len(names)]] == names  # row 0 of each category, then row 1, ...
    for split, rows in (("sft", sft), ("eval", evals)):
        entry = manifest["files"][f"{split}.jsonl"]
        assert entry == {"rows": len(rows), "sha256": hashlib.sha256(packs["one"][f"{split}.jsonl"]).hexdigest()}
    assert (manifest["seed"], manifest["generator_version"], manifest["answer_style"]) == (0, skills.VERSION,
                                                                                           "scratchpad")
    make(capfd, tmp_path / "one", *SMALL, "--answer_style=mixed")  # its own pack is rewritten
    assert [row["answer_style"] for row in read(tmp_path / "one" / "eval.jsonl")[::11]] == ["scratchpad", "direct",
                                                                                            "scratchpad"]
    (tmp_path / "one" / "notes.txt").write_text("mine")
    r = make(capfd, tmp_path / "one", *SMALL, code=1)
    assert r.stderr == (f"error: pack_dir {tmp_path / 'one'} holds what skills.py did not write (notes.txt): move "
                        "that out of it, or choose another --pack_dir\n")


def test_a_category_that_runs_out_is_refused_with_its_count(tmp_path, capfd):
    """month_add has 552 prompts: 300 eval rows and 300 SFT rows apart from them are more than it can make."""
    r = make(capfd, tmp_path / "pack", "--pack_categories=month_add", "--eval_rows=300", "--sft_rows=300", code=1)
    assert r.stderr == ("error: the templates could make only 300 of 300 eval rows, 245 of 300 SFT rows unique and "
                        "apart (month_add SFT 245 of 300) in 100 draws a row: ask for fewer rows (--sft_rows / "
                        "--eval_rows) or give another --pack_source\n")
    assert not (tmp_path / "pack").exists()


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_jsonl_source_is_split_by_hash_and_a_planted_duplicate_or_13_gram_refused(tmp_path, capfd):
    make(capfd, tmp_path / "pack", "--sft_rows=40", "--eval_rows=10")
    rows = read(tmp_path / "pack" / "sft.jsonl") + read(tmp_path / "pack" / "eval.jsonl")
    source = write_rows(tmp_path / "rows.jsonl", rows)
    make(capfd, tmp_path / "mine", f"--pack_source={source}", "--sft_rows=30", "--eval_rows=10")
    picks = skills.split_rows(rows, 10, 30)
    assert read(tmp_path / "mine" / "eval.jsonl") == [rows[k] for k in picks["eval"]]
    assert read(tmp_path / "mine" / "sft.jsonl") == [rows[k] for k in picks["sft"]]

    shouted = dict(rows[3], prompt="  " + rows[3]["prompt"].upper().replace(" ", "   "))  # the same, normalised
    write_rows(source, rows + [shouted])
    r = make(capfd, tmp_path / "dup", f"--pack_source={source}", "--sft_rows=40", "--eval_rows=10", code=1)
    assert r.stderr == (f"error: {source}:51 and {source}:4 have the same prompt after normalisation "
                        f"({shouted['prompt'][:60]!r}): remove one of them\n")

    e = next(k for k in picks["eval"] if rows[k]["category"] == "arithmetic")
    planted = next(row for n in range(100) if (row := dict(rows[e], prompt=f"{rows[e]['prompt']} ({n})"))
                   and 50 in skills.split_rows(rows + [row], 10, 41)["sft"])  # lands in SFT, its twin in eval
    write_rows(source, rows + [planted])
    r = make(capfd, tmp_path / "gram", f"--pack_source={source}", "--sft_rows=41", "--eval_rows=10", code=1)
    assert r.stderr.startswith(f"error: SFT row {source}:51 and eval row {source}:{e + 1} share the words '")
    quoted = r.stderr.split("share the words '", 1)[1].split("'", 1)[0]  # a run of the eval row's prompt or reply
    eval_texts = [" ".join(text.lower().split()) for text in (rows[e]["prompt"], skills.reply_text(rows[e]))]
    assert quoted and any(quoted in text for text in eval_texts), (quoted, eval_texts)
    assert r.stderr.count("\n") == 1 and not any((tmp_path / name).exists() for name in ("dup", "gram"))


def test_a_bad_jsonl_row_is_one_line_naming_its_file_and_line(tmp_path, capfd, stdlib_data):
    """skills.py --pack_source and prepare.py --chat=True read rows alike: the same line for each bad row."""
    good = dict(category="c", prompt="p?", answer="a", scratchpad="", answer_style="direct")
    cases = {"{not json": "not valid JSON (a row is {category, prompt, answer, scratchpad, answer_style})",
             json.dumps({k: v for k, v in good.items() if k != "answer"}): "no field 'answer' (a row is {category, "
                                                                           "prompt, answer, scratchpad, answer_style})",
             json.dumps(good | {"answer": 42}): "field 'answer' is int, not a string",
             json.dumps(good | {"answer_style": "cot"}): "answer_style 'cot' is not one of direct, scratchpad",
             json.dumps(good | {"answer": "a\nb"}): "the answer is more than one line (the steps belong in "
                                                    "'scratchpad')"}
    source = tmp_path / "rows.jsonl"
    for line, message in cases.items():
        source.write_text(json.dumps(good) + "\n\n" + line + "\n")
        r = make(capfd, tmp_path / "pack", f"--pack_source={source}", "--sft_rows=1", "--eval_rows=1", code=1)
        assert r.stderr == f"error: {source}:3: {message}\n"
        r = run_script(["prepare.py", f"--source={source}", "--chat=True", f"--chat_base={stdlib_data}",
                        f"--data_dir={tmp_path / 'sft'}", "--workers=1"], capfd)
        assert r.returncode == 1 and r.stderr.splitlines()[-1] == f"error: {source}:3: {message}", r.stderr


def test_gsm8k_train_problems_are_sft_rows_and_test_problems_eval_rows(server, tmp_path, monkeypatch, capfd):
    """Through prepare.py's preset from a local mirror of the hub: the answer is the number after "####", the
    scratchpad the reasoning without its calculator annotations; a training problem that is a test problem is
    left out of SFT."""
    base = "/datasets/openai/gsm8k/resolve/main/main/"
    server.files[base + "train-00000-of-00001.parquet"] = gsm8k_parquet(GSM8K[::-1])
    server.files[base + "test-00000-of-00001.parquet"] = gsm8k_parquet(GSM8K[1:])
    hub_env(monkeypatch, HF_ENDPOINT=server.url, HF_HOME=tmp_path / "hf_home", HF_HUB_DISABLE_TELEMETRY=1)
    make(capfd, tmp_path / "pack", "--pack_source=gsm8k", "--sft_rows=1", "--eval_rows=1",
         f"--download_dir={tmp_path / 'dl'}")
    (sft,), (test,) = read(tmp_path / "pack" / "sft.jsonl"), read(tmp_path / "pack" / "eval.jsonl")
    assert (sft["prompt"], sft["answer"], sft["category"]) == (GSM8K[0][0], "72", "gsm8k")
    assert sft["scratchpad"] == ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in "
                                 "April and May.")
    assert (test["prompt"], test["answer"]) == (GSM8K[1][0], "10")
    r = make(capfd, tmp_path / "more", "--pack_source=gsm8k", "--sft_rows=2", "--eval_rows=1",
             f"--download_dir={tmp_path / 'dl'}", code=1)
    assert "gsm8k gives 1 of 1 eval rows and 1 of 2 SFT rows" in r.stderr
