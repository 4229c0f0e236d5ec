"""The honesty report (honesty.py) and the hand-off bundle (handoff.py): a category at chance is flagged and what was
never measured is said; the bundle refuses a run whose release gate blocks or was never recorded unless told to go
on (and then its README's first line says so), holds what the receiving team needs with a checksum for every file
(a fine-tuned model's base model too, or that alone), and its model folder, loaded by transformers with its chat
template, answers as podgpt's own sampler does."""
import contextlib
import hashlib
import io
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import handoff as handoff_py
import honesty
from podgpt.core.checkpoint import find_checkpoint
from podgpt.pod.checkpoints import load_model
from conftest import Captured, run_script, shared, train_tiny, tree
from test_bad_input import finished_run  # noqa: F401 -- a fixture: the base model (1 step, stdlib)
from test_sft import SFT_ARGS, sft_data  # noqa: F401 -- a fixture: SFT data in the base model's tokenizer
from podgpt.core.tokenizer import chat_ids, chat_prompt, load_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

PROMPTS = ["What is 7 + 5?", "Is 9 even?"]
GATE_BLOCK = {"profile": "skill_release", "verdict": "block",
              "gates": [{"name": "release_token_budget", "verdict": "block", "value": 0.5, "threshold": 20,
                         "detail": "0.5 tokens per parameter, below the profile's 20"}],
              "post_run": [{"name": "final_loss", "verdict": "warn", "value": 3.1, "threshold": 2.0,
                            "detail": "final validation loss 3.1 above the target 2.0"}]}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, finished_run, sft_data):  # noqa: F811 -- pytest fixtures by name
    """A fine-tuned run of 4 steps from the base model, evaluated by eval.py on a two-category pack: its folder."""
    def build(root):
        with Captured() as captured:
            train_tiny(captured, root / "sft", sft_data, *SFT_ARGS, "--max_steps=4", "--eval_every=4",
                       "--ckpt_every=4", f"--init_from={finished_run}")
        pack = root / "pack"
        pack.mkdir()
        rows = [dict(category="add", prompt=f"What is {a} + {a}?", answer=str(2 * a)) for a in range(4)]
        rows += [dict(category="yes_no", prompt=f"Is {a} even?", answer="yes" if a % 2 == 0 else "no") for a in range(4)]
        (pack / "eval.jsonl").write_text("".join(json.dumps(dict(r, scratchpad="", answer_style="direct")) + "\n"
                                                 for r in rows))
        (pack / "manifest.json").write_text(json.dumps({"categories": {"add": {"eval": 4, "chance": 0.0},
                                                                       "yes_no": {"eval": 4, "chance": 0.5}}}))
        with Captured() as captured:
            r = run_script(["eval.py", f"--ckpt={root / 'sft'}", f"--pack_dir={pack}", f"--data_dir={sft_data}",
                            "--max_new_tokens=4", "--eval_batches=1", "--micro_batch_size=2", "--device=cpu"], captured)
        assert r.returncode == 0, r.stderr[-2000:]
    return shared(tmp_path_factory, "handoff_sft_run", build) / "sft"


def with_gate(run, tmp_path, gate):
    """A copy of the run whose summary.json records `gate` as its release gate (None: none, as an older run)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary.pop("long_run_gate", None)
    (copy / "summary.json").write_text(json.dumps(summary if gate is None else dict(summary, long_run_gate=gate)))
    return copy


def handoff(capfd, run, out, *args):
    return run_script(["handoff.py", f"--run={run}", f"--out={out}", *args], capfd)


def test_the_honesty_report_flags_categories_at_chance_and_says_what_was_never_measured(sft_run, tmp_path):
    planted = {"name": "contamination", "verdict": "block", "value": 2, "threshold": 0,
               "detail": "2 eval rows share a 13-gram with the corpus"}
    run = with_gate(sft_run, tmp_path, dict(GATE_BLOCK, post_run=[*GATE_BLOCK["post_run"], planted]))
    report = json.loads((run / "eval.json").read_text())
    report["pack"]["categories"]["yes_no"].update(n=4, correct=3, accuracy=0.75, low=0.3, high=0.95, chance=0.5,
                                                  above_chance=False)
    report["pack"]["categories"]["add"].update(n=4, correct=4, accuracy=1.0, low=0.51, high=1.0, chance=0.0,
                                               above_chance=True)
    (run / "eval.json").write_text(json.dumps(report))
    h = honesty.write(honesty.read_run(str(run)))
    assert h["at_or_below_chance"] == ["yes_no"] and h["above_chance"] == ["add"]
    assert honesty.standing(h["categories"]["yes_no"]) == honesty.AT_OR_BELOW  # 75% right, the interval reaches below
    never = " ".join(h["never_measured"])
    assert "no external benchmark attached" in never and "no multiple-choice" in never and "no GPU run" in never
    limits = " ".join(h["limitations"])
    assert "below the compute-optimal 20" in limits and "at or below chance" in limits and "yes_no" in limits
    assert "wider than" in limits  # 4 rows a category: intervals of 45 points
    assert "contamination (block): 2 eval rows share a 13-gram with the corpus" in limits
    sources = {c["claim"]: c["source"] for c in h["claims"]}
    assert sources["skills pack: yes_no accuracy (95% interval; chance)"] == "eval.json: pack.categories.yes_no"
    val = [m for m in map(json.loads, open(run / "metrics.jsonl")) if "val_loss" in m][-1]
    assert f"metrics.jsonl: step {val['step']}, val_loss" in sources.values()
    first = (run / "honesty.md").read_text().splitlines()[:honesty.FIRST_SCREEN]
    screen = "\n".join(first)
    assert ("BLOCK under the skill_release profile (blocking: release_token_budget, contamination; warnings: "
            "final_loss)") in screen
    assert "**Can** (95% interval's low end above chance): add 100.0%" in screen
    assert "**Not shown above chance** (at or below it): yes_no 75.0%" in screen
    assert "no external benchmark attached" in screen and "## Known limitations" in screen
    assert json.loads((run / "honesty.json").read_text()) == h


def test_a_category_without_a_chance_level_is_neither_above_nor_below_it_and_each_contamination_is_said_once(
        tmp_path):
    """A hand-made run folder, fine-tuned from a base run that never ended: a free-form category (no chance level in
    the pack's manifest) is shown with its score alone; the data's count of validation documents in training and the
    preflight gate that states it again are one line, as are the preflight and post-run gates that report the same
    eval rows in the corpus; the base run's data recipe comes from its config.json."""
    data, run, base = tmp_path / "data", tmp_path / "run", tmp_path / "base"
    data.mkdir(), run.mkdir(), base.mkdir()
    (data / "manifest.json").write_text(json.dumps({"tokenizer": "byte", "tokenizer_files": [], "contamination": {
        "train_docs_in_val": 3, "val_documents": 10}}))
    (run / "config.json").write_text(json.dumps({"data_dir": str(data), "block_size": 64, "init_from": str(base)}))
    (base / "config.json").write_text(json.dumps({"data_dir": str(data)}))  # a base run that never ended: no summary
    rows = "data: 2 of 8 eval rows in training documents"
    gate = {"profile": "research", "verdict": "block",
            "gates": [{"name": "contamination", "verdict": "block", "detail": "3 training documents are also "
                       "validation documents"}, {"name": "eval_contamination", "verdict": "warn", "detail": rows}],
            "post_run": [{"name": "contamination", "verdict": "warn", "detail": rows}]}
    (run / "summary.json").write_text(json.dumps({"params": {"total": 1000}, "tokens": 50000, "long_run_gate": gate}))
    cats = {"add": dict(n=10, correct=9, accuracy=0.9, low=0.6, high=0.98, chance=0.1, above_chance=True),
            "story": dict(n=10, correct=1, accuracy=0.1, low=0.02, high=0.4, chance=None, above_chance=False)}
    overall = dict(n=20, correct=10, accuracy=0.5, low=0.3, high=0.7, chance=None, above_chance=False)
    (run / "eval.json").write_text(json.dumps({"pack": {"categories": cats, "overall": overall}}))
    h = honesty.write(recorded := honesty.read_run(str(run)))
    assert f"the base run ({base}) has no readable summary.json: its tokens and numbers are not in this report" in \
        h["never_measured"]
    assert handoff_py.recipe(recorded)["base"]["data_dir"] == str(data)  # its data's recipe, from its config.json
    assert (h["above_chance"], h["at_or_below_chance"], h["no_chance_level"]) == (["add"], [], ["story"])
    assert "at_or_below_chance" not in h["categories"]["story"]  # eval.py's record as it is: derived, not stored
    assert not [x for x in h["limitations"] if "at or below chance" in x]
    assert [x for x in h["limitations"] if "no chance level" in x] == [
        "no chance level for 1 of 2 categories (the pack's manifest gives none): story: their accuracy alone, never "
        "compared with guessing"]
    assert [x for x in h["limitations"] if "contamination" in x] == [
        "contamination: 3 of 10 validation documents are also training documents (the data's manifest.json): its "
        "validation loss is optimistic", f"eval_contamination, contamination (warn): {rows}"]
    md = (run / "honesty.md").read_text()
    screen = md.splitlines()[:honesty.FIRST_SCREEN]
    assert "- **Not shown above chance** (at or below it): -" in screen
    assert ("- **No chance level** (the score alone, neither above nor at chance): story 10.0% (2.0%-40.0%, no chance "
            "level)") in screen
    assert "| story | 10 | 10.0% | 2.0% to 40.0% | - | no chance level |" in md.splitlines()


def test_a_sources_files_are_those_prepare_reads_and_a_gone_one_is_said_to_be_gone(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("one")
    (corpus / "sub" / "b.jsonl").write_text('{"text": "two"}\n')
    (corpus / "notes.bin").write_bytes(b"not a source")
    folder, preset, gone = handoff_py.source_hashes({"source": f"{corpus},tinyshakespeare,gone.txt"})
    assert folder["files"] == 2 and folder["sha256"]  # prepare.py's files of a folder: not notes.bin
    assert preset["sha256"] is None and preset["how"].startswith("not recorded: a URL or preset")
    assert gone["sha256"] is None and gone["how"].startswith(
        "not recorded: source 'gone.txt' is not stdlib, a preset, a URL or an existing file or folder")


def test_the_bundle_refuses_a_run_without_an_acceptable_gate_unless_told(sft_run, tmp_path, capfd):
    """The run's own gate (research, with eval.py's floors) lets it go; an older run without one, or a gate that
    blocks, stops it with one line and nothing written, unless --override_gate=True."""
    recorded = json.loads((sft_run / "summary.json").read_text())["long_run_gate"]
    assert recorded["profile"] == "research" and "eval_floors" in [g["name"] for g in recorded["post_run"]]
    assert recorded["verdict"] in ("pass", "warn")  # research's gates let a tiny run through
    assert handoff(capfd, sft_run, tmp_path / "own").returncode == 0
    assert json.loads((tmp_path / "own" / "release_gate.json").read_text()) == recorded
    assert (tmp_path / "own" / "README.md").read_text().startswith("# ")
    older = with_gate(sft_run, tmp_path / "older", None)
    before = tree(tmp_path)
    r = handoff(capfd, older, tmp_path / "bundle")
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: run={older}: no release gate recorded (summary.json has no long_run_gate): not handing it off; "
        "train it with this podgpt, or give --override_gate=True to bundle it anyway (README.md's first line then "
        "says so)"]
    assert tree(tmp_path) == before
    blocked = with_gate(sft_run, tmp_path, GATE_BLOCK)
    before = tree(tmp_path)
    r = handoff(capfd, blocked, tmp_path / "bundle")
    assert r.returncode == 1 and "the release gate (skill_release) is block: release_token_budget: not handing" \
        in r.stderr and "Traceback" not in r.stderr
    assert tree(tmp_path) == before
    assert handoff(capfd, blocked, tmp_path / "bundle", "--override_gate=True").returncode == 0
    readme = (tmp_path / "bundle" / "README.md").read_text().splitlines()
    assert readme[0] == ("**NOT ACCEPTABLE FOR RELEASE: the release gate (skill_release) is block: "
                         "release_token_budget; this bundle was made anyway (handoff.py --override_gate=True).**")
    assert json.loads((tmp_path / "bundle" / "release_gate.json").read_text()) == GATE_BLOCK
    passed = with_gate(sft_run, tmp_path / "pass", dict(GATE_BLOCK, verdict="warn", gates=[]))
    (tmp_path / "bundle" / "model" / "notes.txt").write_text("mine")  # a user's file inside the bundle's model/
    r = handoff(capfd, passed, tmp_path / "bundle")
    assert r.returncode == 1 and "holds what handoff.py did not write (model/notes.txt)" in r.stderr
    (tmp_path / "bundle" / "model" / "notes.txt").unlink()
    assert handoff(capfd, passed, tmp_path / "bundle").returncode == 0  # an earlier bundle, replaced
    readme = (tmp_path / "bundle" / "README.md").read_text().splitlines()
    assert readme[0] == "# pass/run: hand-off bundle" and "WARN under the skill_release profile" in readme[3]


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_bundle_holds_every_part_with_its_checksum_and_answers_as_podgpt(sft_run, tmp_path, capfd, monkeypatch):
    run = with_gate(sft_run, tmp_path, dict(GATE_BLOCK, verdict="pass", gates=[], post_run=[]))
    bundle = tmp_path / "bundle"
    reads = []
    # each of the run's files read once (export.py's model card reads its own)
    for module, name in ((honesty, "read_json"), (honesty, "read_metrics"), (handoff_py, "read_json")):
        monkeypatch.setattr(module, name, lambda path, read=getattr(module, name): reads.append(path) or read(path))
    assert handoff(capfd, run, bundle).returncode == 0
    assert len(reads) == len(set(reads)) and os.path.join(str(run), "summary.json") in reads, reads
    files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
    for name in ("README.md", "honesty.md", "honesty.json", "limitations.md", "recipe.json", "release_gate.json",
                 "podgpt-handoff.json", "model/model.safetensors", "model/config.json", "model/generation_config.json",
                 "model/tokenizer.json", "model/tokenizer_config.json", "run/config.json", "run/preflight.md",
                 "run/preflight.json", "run/eval.json", "run/eval.md", "run/summary.json", "base/run/preflight.json"):
        assert name in files, name
    listed = dict(reversed(line.split("  ", 1)) for line in (bundle / "checksums.sha256").read_text().splitlines())
    assert sorted(listed) == [f for f in files if f != "checksums.sha256"]
    assert all(sha256(bundle / name) == digest for name, digest in listed.items())
    recipe = json.loads((bundle / "recipe.json").read_text())
    sft_source = recipe["sft"]["sources"][0]
    assert sft_source["sha256"] == sha256(pathlib.Path(sft_source["source"]))
    assert recipe["base"]["prepare_args"]["source"] == "stdlib" and recipe["base"]["sources"][0]["sha256"]
    for part in ("base", "sft"):
        assert recipe[part]["tokenizer_fingerprint"] and all(s["sha256"] for s in recipe[part]["shards"])
    assert recipe["eval_pack"]["manifest"]["categories"]["yes_no"]["chance"] == 0.5
    assert "undertrained" in (bundle / "limitations.md").read_text()

    ckpt = find_checkpoint(str(run), "best")
    tok, (ours, _) = load_tokenizer(ckpt), load_model(ckpt)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(bundle / "model"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(bundle / "model"), dtype=torch.float32).eval()
    stops = {chat_ids(tok)["<|end|>"], tok.bos_id}
    for prompt in PROMPTS:
        ids = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        assert ids == chat_prompt(tok, prompt)  # BOS <|user|> prompt <|end|> <|assistant|>
        with torch.no_grad():  # the next-token logits at every position, not only the greedy picks
            logits = ours(torch.tensor([ids]))[0][..., :tok.vocab_size]  # the export has the true vocabulary's rows
            assert (hf(torch.tensor([ids])).logits - logits).abs().max() < 1e-4
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)  # ends at <|end|> or BOS
        mine = []
        for t in ours.eval().generate(torch.tensor([ids]), 12, temperature=0):
            mine.append(t.item())
            if t.item() in stops:
                break
        assert out[0, len(ids):].tolist() == mine
    # the README's code runs as written, in the bundle's folder, and prints the reply podgpt's sampler gives
    code = re.search(r"```python\n(.*?)```", (bundle / "README.md").read_text(), re.S).group(1)
    card = re.search(r"```python\n(.*?)```", (bundle / "model" / "README.md").read_text(), re.S).group(1)
    assert "apply_chat_template" in code and code == card.replace("<this folder>", "model")  # the export's own
    printed = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(bundle)
        with contextlib.redirect_stdout(printed):
            exec(code, {})
    finally:
        os.chdir(cwd)
    ids = chat_prompt(tok, "What is 2 + 3?")
    reply = []
    for t in ours.generate(torch.tensor([ids]), ours.config.block_size - len(ids), temperature=0):
        if t.item() in stops:
            break
        reply.append(t.item())
    text = tok.decode([t for t in reply if t not in tok.chat.values()])  # as skip_special_tokens=True
    assert printed.getvalue() == text + "\n"


def with_base(run, tmp_path, init_from):
    """A copy of the run (its own gate) whose config.json names `init_from` as the base it started from."""
    copy = tmp_path / "sft"
    shutil.copytree(run, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, init_from=str(init_from))))
    return copy


def checked(bundle):
    """The bundle's files, after `sha256sum -c` and a sha256 of our own have verified every one its checksum file
    lists, which must be all of them."""
    files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
    listed = dict(reversed(line.split("  ", 1)) for line in (bundle / "checksums.sha256").read_text().splitlines())
    assert sorted(listed) == [f for f in files if f != "checksums.sha256"]
    assert all(sha256(bundle / name) == digest for name, digest in listed.items())
    if shutil.which("sha256sum"):  # as the receiving team checks it
        subprocess.run(["sha256sum", "--quiet", "-c", "checksums.sha256"], cwd=bundle, check=True)
    return files


def test_the_bundle_holds_the_base_model_too_and_transformers_loads_both(sft_run, finished_run, tmp_path,  # noqa: F811
                                                                         capfd):
    """A fine-tuned run's bundle holds, in base/, the base checkpoint it started from (its base run's latest) exported
    with its own run files, release gate, honesty report and limitations; the checksums cover both models;
    transformers loads each folder, and each gives its own checkpoint's logits. --base_only writes the base alone,
    file for file the full bundle's base/, for an SFT run and for a pretraining run (whose model is its base)."""
    bundle = tmp_path / "bundle"
    assert handoff(capfd, sft_run, bundle).returncode == 0
    files = checked(bundle)
    for name in ("model/model.safetensors", "run/summary.json", "base/model/model.safetensors",
                 "base/model/config.json", "base/model/tokenizer.json", "base/run/config.json", "base/run/summary.json",
                 "base/run/preflight.md", "base/release_gate.json", "base/honesty.md", "base/honesty.json",
                 "base/limitations.md"):
        assert name in files, name
    assert not [f for f in files if f.startswith("base_run/")]
    record = json.loads((bundle / "podgpt-handoff.json").read_text())
    assert record["base"]["checkpoint"] == os.path.relpath(find_checkpoint(str(finished_run)), finished_run)
    assert record["base"]["release_gate"]["verdict"] == "pass" and record["base_only"] is False
    assert (bundle / "base" / "run" / "summary.json").read_bytes() == (finished_run / "summary.json").read_bytes()
    readme = (bundle / "README.md").read_text()
    assert "## The base model" in readme and 'AutoModelForCausalLM.from_pretrained("base/model")' in readme
    assert "| `base/` | the base model:" in readme

    ids = torch.tensor([[1, 72, 105, 33]])
    for folder, run in (("model", sft_run), ("base/model", finished_run)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(bundle / folder), dtype=torch.float32).eval()
        ours, _ = load_model(find_checkpoint(str(run), "best" if run == sft_run else "latest"))
        with torch.no_grad():
            assert (hf(ids).logits - ours.eval()(ids)[0][..., :ours.config.vocab_size]).abs().max() < 1e-4, folder
    chat = {f: "chat_template" in json.loads((bundle / f / "tokenizer_config.json").read_text())
            for f in ("model", "base/model")}
    assert chat == {"model": True, "base/model": False}  # the fine-tuned one has the chat tokens; its base, not

    # --base_only: the base alone, as the full bundle's base/ holds it
    for run, only in ((sft_run, tmp_path / "only"), (finished_run, tmp_path / "plain")):
        assert handoff(capfd, run, only, "--base_only=True").returncode == 0
        files = checked(only)
        assert not [f for f in files if f.startswith("base/")] and json.loads(
            (only / "podgpt-handoff.json").read_text())["base"] is None
        for name in ("model/model.safetensors", "model/config.json", "model/tokenizer_config.json",
                     "run/config.json", "run/summary.json", "honesty.json", "release_gate.json", "limitations.md"):
            assert sha256(only / name) == sha256(bundle / "base" / name), (only, name)
        assert "## The base model" not in (only / "README.md").read_text()
    assert json.loads((tmp_path / "only" / "recipe.json").read_text())["init_from"] is None  # the base's recipe


def test_a_base_run_gone_or_unusable_stops_the_bundle_in_one_line(sft_run, finished_run, tmp_path, capfd):  # noqa: F811
    """No base run where init_from says, a base checkpoint that fails its check, or a base whose release gate blocks:
    one line, exit 1, nothing written (the last unless --override_gate=True, and README's first line then says
    so). A checkpoint folder as init_from finds its run."""
    gone = with_base(sft_run, tmp_path / "gone", tmp_path / "nowhere")
    before = tree(tmp_path)
    for args in ((), ("--base_only=True",)):
        r = handoff(capfd, gone, tmp_path / "bundle", *args)
        assert r.returncode == 1 and r.stderr.splitlines() == [
            f"error: run={gone}: its base run {tmp_path / 'nowhere'} (init_from={tmp_path / 'nowhere'}) has no "
            "readable summary.json: not handing it off; put the base run's folder back there"]
        assert tree(tmp_path) == before

    base = tmp_path / "base"
    shutil.copytree(finished_run, base)
    damaged = with_base(sft_run, tmp_path / "damaged", base)
    weights = pathlib.Path(find_checkpoint(str(base))) / "model.pt"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    before = tree(tmp_path)
    r = handoff(capfd, damaged, tmp_path / "bundle")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith(
        f"error: run={damaged}: the base run {base}: its checkpoint cannot be used: model.pt is corrupt (CRC32 ")
    assert tree(tmp_path) == before

    blocked = tmp_path / "blocked"
    shutil.copytree(finished_run, blocked)
    summary = json.loads((blocked / "summary.json").read_text())
    (blocked / "summary.json").write_text(json.dumps(dict(summary, long_run_gate=GATE_BLOCK)))
    step = pathlib.Path(find_checkpoint(str(blocked))).name
    sft = with_base(sft_run, tmp_path / "on_blocked", blocked / "ckpt" / step)  # a checkpoint folder
    before = tree(tmp_path)
    r = handoff(capfd, sft, tmp_path / "bundle")
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: run={sft}: the base run {blocked}: the release gate (skill_release) is block: "
        "release_token_budget: not handing it off; fix what blocks, or give --override_gate=True to bundle it "
        "anyway (README.md's first line then says so)"]
    assert tree(tmp_path) == before
    assert handoff(capfd, sft, tmp_path / "bundle", "--override_gate=True").returncode == 0
    assert (tmp_path / "bundle" / "README.md").read_text().splitlines()[0] == (
        f"**NOT ACCEPTABLE FOR RELEASE: the base run {blocked}: the release gate (skill_release) is block: "
        "release_token_budget; this bundle was made anyway (handoff.py --override_gate=True).**")
    record = json.loads((tmp_path / "bundle" / "podgpt-handoff.json").read_text())
    assert record["base"]["checkpoint"] == f"ckpt/{step}"
