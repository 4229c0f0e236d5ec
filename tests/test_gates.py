"""The release gates (gates.py) at pass, warn and block under each profile, the eval rows' n-gram overlap
(ngrams.py), and an eval prompt planted in a corpus that prepare.py counts and preflight blocks under
skill_release."""
import json
import os

import pytest

from podgpt.pod import gates
from podgpt.release import gates as release_gates
from podgpt.core.configurator import Config
from conftest import ROOT, TINY_MODEL, run_script
from podgpt.corpus.ngrams import read_eval_grams
from podgpt.core.util import Error

B = 2 ** 20  # the 1B run's tokens per step


def cfg(profile, **keys):
    return Config(dict(gate_profile=profile, init_from="", pack_dir="", data_dir="", out_dir="", max_steps=100,
                       total_batch_tokens=B) | keys)


def verdicts(make, *profiles):
    return [make(profile)["verdict"] for profile in profiles]


def test_every_profile_has_every_threshold_and_an_unknown_one_is_named():
    assert all(len(values) == len(gates.PROFILE_NAMES) for values in gates.PROFILES.values())
    assert gates.limits("skill_release")["interval_block_above"] == 0.4
    with pytest.raises(Error, match="gate_profile='skills' is not one of research, release, skill_release"):
        gates.check_profile("skills")


def test_release_token_budget_blocks_the_100_step_dry_run_except_under_research():
    """The 1B run: 21,362 steps of 2^20 tokens for 1.149B parameters is 19.5 per parameter, which passes every
    profile; its 100-step dry run blocks under release and skill_release and passes under research (the recipe's
    dry run uses research for this reason); 17 per parameter warns."""
    params = 1.149e9
    full = verdicts(lambda p: gates.release_token_budget(cfg(p, max_steps=21362), params), *gates.PROFILE_NAMES)
    assert full == ["pass", "pass", "pass"]
    dry = [gates.release_token_budget(cfg(p, max_steps=100), params) for p in gates.PROFILE_NAMES]
    assert [g["verdict"] for g in dry] == ["pass", "block", "block"]
    assert dry[2]["value"] == pytest.approx(100 * B / params) and dry[2]["threshold"] == 15
    assert "gate_profile=research for a run not meant for release" in dry[2]["detail"]
    assert gates.release_token_budget(cfg("skill_release", max_steps=int(17 * params / B)), params)["verdict"] == "warn"


def base_run(folder, steps, tokens_per_step=B):
    """A checkpoint folder as train.py leaves one, as far as the gates read it: its step and its config."""
    folder.mkdir(parents=True)
    (folder / "complete.json").write_text(json.dumps({"step": steps, "files": {}}))
    (folder / "config.json").write_text(json.dumps({"total_batch_tokens": tokens_per_step, "data_dir": "none"}))
    return str(folder)


def test_base_exposure_weighs_the_base_checkpoint_against_the_sft_run(tmp_path):
    """An SFT run: its base checkpoint's tokens per parameter, and SFT's share of all: 1% passes, 7% warns and 20%
    blocks under skill_release; a base that saw 2 tokens per parameter blocks; a base run without a pack skips."""
    params = 1e8
    base = base_run(tmp_path / "base", 2000)  # 2.1B tokens: 21 per parameter
    share = {steps: gates.base_exposure(cfg("skill_release", init_from=base, max_steps=steps), params, None)
             for steps in (20, 150, 500)}
    assert [g["verdict"] for g in share.values()] == ["pass", "warn", "block"]
    assert share[150]["value"]["sft_share"] == pytest.approx(150 / 2150)
    assert share[500]["value"]["base_tokens_per_param"] == pytest.approx(2000 * B / params)
    young = base_run(tmp_path / "young", 200)
    assert gates.base_exposure(cfg("skill_release", init_from=young, max_steps=1), params, None)["verdict"] == "block"
    assert gates.base_exposure(cfg("research", init_from=young, max_steps=1), params, None)["verdict"] == "pass"
    assert gates.base_exposure(cfg("skill_release"), params, None)["verdict"] == "skip"
    # a base run with a pack: its planned tokens, then one pass over the SFT rows at the data's tokens per byte
    (tmp_path / "pack").mkdir()
    row = {"category": "c", "prompt": "p" * 90, "answer": "a" * 10, "scratchpad": "", "answer_style": "direct"}
    (tmp_path / "pack" / "sft.jsonl").write_text((json.dumps(row) + "\n") * 1000)  # 100,000 bytes
    data = {"splits": {"train": {"tokens": 1, "bytes": 2}}}
    planned = gates.base_exposure(cfg("skill_release", pack_dir=str(tmp_path / "pack"), max_steps=1), 5e4, data)
    assert planned["verdict"] == "pass" and planned["value"]["sft_share"] == pytest.approx(50_000 / (B + 50_000))
    assert gates.base_exposure(cfg("skill_release", pack_dir=str(tmp_path / "pack"), max_steps=1), 5e4,
                               None)["verdict"] == "skip"  # no data to count its tokens in
    missing = gates.base_exposure(cfg("research", init_from=str(tmp_path / "none")), params, None)
    assert missing["verdict"] == "block" and "train the base model first" in missing["detail"]


def pack(sft, evals):
    return {"categories": {f"c{k}": {"sft": s, "eval": e} for k, (s, e) in enumerate(zip(sft, evals))}}


def test_sft_category_balance_is_the_smallest_category_over_the_largest():
    def balance(sft, profile="skill_release"):
        return release_gates.sft_category_balance(cfg(profile, pack_dir="p"), pack(sft, [30] * len(sft)))

    assert [balance(s)["verdict"] for s in ([100, 95], [100, 40], [100, 10])] == ["pass", "warn", "block"]
    assert balance([100, 40])["value"] == 0.4 and "the smallest, c1, has 40 SFT rows" in balance([100, 40])["detail"]
    assert balance([100, 10], "research")["verdict"] == "warn"  # research never blocks it


def test_eval_coverage_is_the_widest_wilson_interval_of_a_category():
    """At 50% correct a 95% interval is 0.342 wide over 29 rows (the 1B pack's), 0.366 over 25, 0.52 over 10."""
    def coverage(rows, profile="skill_release"):
        return release_gates.eval_skill_release_coverage(cfg(profile, pack_dir="p"), pack([100, 100], rows))

    got = {rows[1]: coverage(rows) for rows in ([30, 29], [30, 25], [30, 10])}
    assert [g["verdict"] for g in got.values()] == ["pass", "warn", "block"]
    assert got[29]["value"] == pytest.approx(0.342, abs=1e-3) and got[10]["value"] == pytest.approx(0.52, abs=1e-2)
    low, high = gates.wilson(5, 10)
    assert got[10]["value"] == pytest.approx(high - low)
    assert coverage([30, 10], "research")["verdict"] == "warn"


def test_the_pack_gates_need_a_pack_only_under_skill_release():
    for profile, verdict in (("research", "skip"), ("skill_release", "block")):
        found = {g["name"]: g for g in release_gates.pack_gates(cfg(profile), 1e6, None)}
        assert [found[n]["verdict"] for n in ("sft_category_balance", "eval_skill_release_coverage",
                                              "eval_contamination")] == [verdict] * 3


def test_after_the_run_final_loss_and_spikes_rollbacks():
    missed = {"target": "missed", "target_val_loss": [None, 3.0], "final_val_loss": 3.2}
    assert verdicts(lambda p: gates.final_loss(p, missed), "research", "skill_release") == ["warn", "block"]
    assert gates.final_loss("skill_release", dict(missed, target="met"))["verdict"] == "pass"
    assert gates.final_loss("skill_release", {"final_val_loss": 3.2})["verdict"] == "skip"
    runs = [{"spikes": 2}, {"rollbacks": 1}, {"rollbacks": 2}]
    assert [gates.spikes_rollbacks("release", s)["verdict"] for s in runs] == ["pass", "warn", "block"]
    assert gates.spikes_rollbacks("skill_release", runs[1])["verdict"] == "block"
    assert gates.spikes_rollbacks("research", runs[2])["verdict"] == "warn"


def pack_report(overall, chance, cats):
    """eval.py's pack report: overall (correct, n) against a pooled chance, and each category's accuracy, chance."""
    low, high = gates.wilson(*overall)
    return {"overall": {"correct": overall[0], "n": overall[1], "low": low, "chance": chance,
                        "above_chance": low > chance},
            "categories": {f"c{k}": {"accuracy": a, "chance": c} for k, (a, c) in enumerate(cats)}}


def test_eval_floors_and_the_hook_that_records_them_in_summary_json(tmp_path):
    good = pack_report((60, 100), 0.1, [(0.6, 0.0), (0.7, 0.5), (0.5, 0.0), (0.9, 0.25)])
    weak = pack_report((60, 100), 0.1, [(0.0, 0.0), (0.7, 0.5), (0.5, 0.0), (0.9, 0.25)])  # 1 of 4 at chance
    assert [release_gates.eval_floors(p, good)["verdict"] for p in gates.PROFILE_NAMES] == ["skip", "pass", "pass"]
    assert [release_gates.eval_floors(p, weak)["verdict"] for p in gates.PROFILE_NAMES] == ["skip", "pass", "pass"]
    weaker = pack_report((60, 100), 0.1, [(0.0, 0.0), (0.5, 0.5), (0.5, 0.0), (0.9, 0.25)])  # 2 of 4
    assert [release_gates.eval_floors(p, weaker)["verdict"] for p in gates.PROFILE_NAMES] == ["skip", "pass", "block"]
    at_chance = pack_report((12, 100), 0.1, [(0.6, 0.0)])
    floors = release_gates.eval_floors("release", at_chance)
    assert floors["verdict"] == "block" and "not above the pooled chance 0.100" in floors["detail"]
    assert release_gates.record_eval_floors(tmp_path, good) is None  # no summary.json: nothing recorded
    record = {"profile": "skill_release", "verdict": "pass", "gates": [gates.gate("x", "pass", 1, 1, "")],
              "post_run": [gates.gate("eval_floors", "pass", None, None, "an earlier evaluation")]}
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "long_run_gate": record}))
    assert release_gates.record_eval_floors(tmp_path, weaker)["verdict"] == "block"
    after = json.loads((tmp_path / "summary.json").read_text())
    assert after["status"] == "completed" and after["long_run_gate"]["verdict"] == "block"
    assert [g["name"] for g in after["long_run_gate"]["post_run"]] == ["eval_floors"]  # replaced, not added


def test_eval_grams_find_a_row_in_any_case_and_spacing_but_not_across_documents(tmp_path):
    rows = [{"category": "c", "prompt": "Grace has 85 marbles and buys 5 boxes of 25 more marbles for her friends "
             "today.", "answer": "42", "scratchpad": "", "answer_style": "direct"},
            {"category": "c", "prompt": "Convert 712 days to hours.", "answer": "17088", "scratchpad": "",
             "answer_style": "direct"},
            {"category": "c", "prompt": "Add 2 and 3.", "answer": "5", "scratchpad": "", "answer_style": "direct"}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    grams = read_eval_grams(tmp_path / "eval.jsonl")
    assert (grams.rows, grams.rows_checked) == (3, 2)  # "Add 2 and 3." is too short to tell from chance
    texts = ["intro  GRACE has 85 marbles and buys 5 boxes\nof 25 more marbles for her friends, more",
             "we convert 712 days to hours. then", "convert 712 days", "to hours.", "add 2 and 3. 5",
             "nothing here at all"]
    assert grams.hits(texts) == [(0,), (1,), (), (), (), ()]


def test_an_eval_prompt_planted_in_the_corpus_blocks_under_skill_release(tmp_path, capfd):
    """prepare.py --pack_dir counts the training documents holding an eval row (manifest.json's
    eval_contamination); preflight's eval_contamination blocks on it under skill_release, warns under research;
    the same corpus without the planted prompt passes, and a pack changed since the count blocks as unchecked."""
    assert run_script(["skills.py", f"--pack_dir={tmp_path / 'pack'}", "--sft_rows=22", "--eval_rows=11"],
                      capfd).returncode == 0
    prompt = json.loads((tmp_path / "pack" / "eval.jsonl").read_text().splitlines()[1])["prompt"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(40):
        (corpus / f"{k:02d}.txt").write_text(f"document {k} " * 40 + (f"\n{prompt}\n" if k % 4 == 0 else ""))

    def prepare(data, *args):
        r = run_script(["prepare.py", f"--source={corpus}", f"--data_dir={data}", "--val_fraction=0.05",
                        "--min_val_tokens=0", "--workers=1", f"--pack_dir={tmp_path / 'pack'}", *args], capfd)
        assert r.returncode == 0, r.stderr
        return json.loads((data / "manifest.json").read_text())["eval_contamination"]

    def preflight(data, profile):
        out = tmp_path / f"pf-{profile}"
        run_script(["train.py", f"--data_dir={data}", f"--out_dir={out}", *TINY_MODEL, "--micro_batch_size=2",
                    "--total_batch_tokens=128", "--max_steps=2", "--preflight_only=True", f"--gate_profile={profile}",
                    f"--pack_dir={tmp_path / 'pack'}", "--planned_tokens_per_sec=1e6"], capfd)
        return {g["name"]: g for g in json.loads((out / "preflight.json").read_text())["gates"]}["eval_contamination"]

    record = prepare(tmp_path / "data")
    assert record["rows_found"] == 1 and record["train_docs_by_row"]["2"] >= 5 and record["eval_rows"] == 11
    found = preflight(tmp_path / "data", "skill_release")
    assert found["verdict"] == "block" and found["value"] == 1 and "1 of 11 eval rows in training" in found["detail"]
    assert preflight(tmp_path / "data", "research")["verdict"] == "warn"
    for k in range(0, 40, 4):
        (corpus / f"{k:02d}.txt").write_text(f"document {k} " * 40)
    assert prepare(tmp_path / "clean")["rows_found"] == 0
    assert preflight(tmp_path / "clean", "skill_release")["verdict"] == "pass"
    evals = tmp_path / "pack" / "eval.jsonl"
    evals.write_text("".join(evals.read_text().splitlines(keepends=True)[:-1]))  # a row less since the count
    stale = preflight(tmp_path / "clean", "skill_release")
    assert stale["verdict"] == "block" and "checked against other eval rows" in stale["detail"]


def test_docs_show_every_threshold_of_every_profile():
    """docs/preflight.md's profile table is gates.PROFILES, row by row."""
    def text(v):
        return "-" if v is None else f"{v[0]:g} to {v[1]:g}" if isinstance(v, tuple) else \
            ("yes" if v else "no") if isinstance(v, bool) else f"{v:g}" if isinstance(v, (int, float)) else v

    with open(os.path.join(ROOT, "docs", "preflight.md"), encoding="utf-8") as f:
        rows = [[c.strip() for c in line.split("|")[1:5]] for line in f if line.count("|") == 6 and "`" in line]
    assert {r[0].strip("`"): r[1:] for r in rows} == {k: [text(v) for v in values]
                                                       for k, values in gates.PROFILES.items()}
