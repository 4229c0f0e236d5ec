"""The release gates of a skills pack and of an evaluated model: the SFT rows' category balance, the
eval rows' coverage, their contamination by the corpus and by the SFT rows, and eval.py's floors on
the accuracy; thresholds in podgpt/pod/gates.py's PROFILES. A run without a pack never loads it."""

import os

from podgpt.core.util import fail, first_line, write_json
from podgpt.core.owned import file_sha256
from podgpt.pod.gates import (PROFILE_NAMES, base_checkpoint, base_exposure, gate, judge, limits,
                              no_pack, read_pack, said, verdict_of, wilson)
from podgpt.pod.report import read_json


def sft_category_balance(cfg, pack):
    """sft_category_balance: the SFT rows of the pack's smallest category over its largest's."""
    lim = limits(cfg.gate_profile)
    warn, block = lim["balance_warn_below"], lim["balance_block_below"]
    counts = {name: c.get("sft", 0) for name, c in pack["categories"].items() if c.get("sft", 0)}
    if not counts:
        return gate("sft_category_balance", "block", None, block,
                    f"{cfg.pack_dir} has no SFT rows: make the pack with sft_rows > 0")
    low, high = min(counts, key=counts.get), max(counts, key=counts.get)
    ratio = counts[low] / counts[high]
    verdict = judge(ratio, warn, block, below=True)
    return gate("sft_category_balance", verdict, ratio, block,
                f"{len(counts)} categories: the smallest, {low}, has {counts[low]} SFT rows, the "
                f"largest, {high}, {counts[high]}: {ratio:.2f} ("
                + said(cfg.gate_profile, warn_below=warn, block_below=block) + ")"
                + ("" if verdict != "block" else f": more rows of {low}, or fewer of {high}"))


def eval_skill_release_coverage(cfg, pack):
    """eval_skill_release_coverage: the widest 95% Wilson interval (at 50% correct) of an SFT
    category's eval rows against the profile's width."""
    lim = limits(cfg.gate_profile)
    warn, block = lim["interval_warn_above"], lim["interval_block_above"]
    names = [name for name, c in pack["categories"].items() if c.get("sft", 0)]
    if not names:
        return gate("eval_skill_release_coverage", "skip", None, block, "no SFT categories")
    rows = {name: pack["categories"][name].get("eval", 0) for name in names}
    fewest = min(rows, key=rows.get)
    low, high = wilson(rows[fewest] / 2, rows[fewest])
    verdict = judge(high - low, warn, block)
    return gate("eval_skill_release_coverage", verdict, high - low, block,
                f"the fewest eval rows of the {len(names)} SFT categories: {fewest}'s "
                f"{rows[fewest]}, whose 95% interval at 50% correct is {high - low:.3f} wide ("
                + said(cfg.gate_profile, warn_above=warn, block_above=block) + ")"
                + ("" if verdict != "block" else
                   ": more eval rows per category (skills.py --eval_rows)"))


# -----------------------------------------------------------------------------
# contamination of the eval rows: by the corpus (prepare.py's count), by the SFT rows (skills.py's)

def corpus_overlap(manifest, data_dir, eval_sha):
    """(eval rows found in data_dir's training documents, what was counted) from its manifest's
    eval_contamination; (None, why not) when it was not counted for these eval rows."""
    record = manifest.get("eval_contamination")
    if not isinstance(record, dict):
        return None, f"{data_dir} was not checked against these eval rows"
    if record.get("eval_sha256") != eval_sha:
        return None, f"{data_dir} was checked against other eval rows (eval.jsonl changed since)"
    rows = sorted(record["train_docs_by_row"], key=int)
    some = f" (rows {', '.join(rows[:5])}{' ...' if len(rows) > 5 else ''})" if rows else ""
    return len(rows), (f"{data_dir}: {len(rows)} of {record['eval_rows']} eval rows in training "
                       f"documents{some}, {record['rows_checked']} of them long enough to check")


def eval_contamination(cfg, pack, name="eval_contamination"):
    """eval_contamination: the pack's eval rows that the run's training corpus (and an SFT run's
    base's) holds, as prepare.py counted them, and the SFT rows holding a run of an eval row's words
    (skills.py refuses to write such a pack, and records the check)."""
    lim = limits(cfg.gate_profile)
    try:
        eval_sha = file_sha256(os.path.join(cfg.pack_dir, "eval.jsonl"))
    except OSError as e:
        return gate(name, lim["pack_missing"], None, 0, f"no eval rows to check ({first_line(e)})")
    base = base_checkpoint(cfg) if cfg.init_from else None
    corpora = [cfg.data_dir] + ([base[2]] if base and base[2] and base[2] != cfg.data_dir else [])
    found, details = 0, []
    for data_dir in corpora:
        manifest = read_json(os.path.join(data_dir, "manifest.json"))
        if manifest is None:  # as corpus_model_fit: a run cannot start before its data is prepared
            return gate(name, "skip", None, 0, f"no data prepared in {data_dir} yet")
        rows, detail = corpus_overlap(manifest, data_dir, eval_sha)
        if rows is None:
            return gate(name, lim["overlap"], None, 0,
                        f"{detail}: prepare it with --pack_dir={cfg.pack_dir} (--force) to count "
                        "the eval rows its training documents hold")
        found += rows
        details.append(detail)
    sft = pack.get("sft_rows_sharing_eval")
    details.append("SFT rows holding a run of an eval row's words: " + (
        "not recorded (a pack from before skills.py recorded it)" if sft is None else str(sft)))
    found += sft or 0
    return gate(name, lim["overlap"] if found else "pass", found, 0,
                "; ".join(details) + ("" if not found else ": take those rows out of the eval "
                                      "set, or the documents out of the corpus, and prepare again"))


def pack_gates(cfg, params, manifest):
    """base_exposure, sft_category_balance, eval_skill_release_coverage and eval_contamination.
    Without the pack they block under skill_release, unless the data is not prepared either
    (planning ahead: they skip, as data_gates do)."""
    pack, why = read_pack(cfg.pack_dir)
    profile = cfg.gate_profile if manifest or not cfg.pack_dir else "research"  # planned ahead
    return [base_exposure(cfg, params, manifest)] + [
        g(cfg, pack) if pack is not None else no_pack(g.__name__, profile, cfg.pack_dir, why)
        for g in (sft_category_balance, eval_skill_release_coverage, eval_contamination)]


# -----------------------------------------------------------------------------
# eval.py's floors, added to the evaluated run's long_run_gate

def eval_floors(profile, pack_report):
    """eval_floors: of eval.py's pack report, the overall accuracy's interval against the pooled
    chance level, and the share of categories at or below their chance level."""
    lim = limits(profile)
    most = lim["floor_at_chance_share"]
    if not lim["floor_above_chance"] and most is None:
        return gate("eval_floors", "skip", None, None, f"{profile}: no floors")
    overall, cats = pack_report["overall"], pack_report["categories"]
    at_chance = sorted(c for c, s in cats.items() if s["accuracy"] is None or s["chance"] is None
                       or s["accuracy"] <= s["chance"])
    share = len(at_chance) / len(cats) if cats else 1.0
    chance = "unknown" if overall["chance"] is None else f"{overall['chance']:.3f}"
    above = bool(overall["above_chance"])
    too_many = most is not None and share > most
    verdict = "block" if (lim["floor_above_chance"] and not above) or too_many else "pass"
    value = dict(overall_low=overall["low"], pooled_chance=overall["chance"], at_chance_share=share)
    return gate("eval_floors", verdict, value, most,
                f"overall {overall['correct']} of {overall['n']}, 95% interval from "
                f"{overall['low']:.3f}: {'above' if above else 'not above'} the pooled chance "
                f"{chance}; {len(at_chance)} of {len(cats)} categories at or below chance"
                + (f" ({', '.join(at_chance)})" if at_chance else "")
                + f" ({profile}: at most {most:.0%})"
                + ("" if verdict != "block" else
                   ": more base or SFT training on the weak categories"))


def record_eval_floors(run_dir, pack_report):
    """Add (or replace) eval_floors in run_dir's summary.json long_run_gate and recompute its
    verdict; the gate, or None when the run has no long_run_gate."""
    path = os.path.join(run_dir, "summary.json")
    summary = read_json(path)
    record = summary.get("long_run_gate") if isinstance(summary, dict) else None
    if not isinstance(record, dict):
        return None
    if not (record.get("profile") in PROFILE_NAMES and isinstance(record.get("gates"), list)
            and isinstance(record.get("post_run"), list)):
        fail(f"{path}: its long_run_gate is not one train.py wrote (profile "
             f"{record.get('profile')!r}; the profiles: {', '.join(PROFILE_NAMES)}), so the eval "
             "floors are not added to it: put back the run's own summary.json, then run eval.py "
             "again")
    floors = eval_floors(record["profile"], pack_report)
    record["post_run"] = [g for g in record["post_run"] if g["name"] != "eval_floors"] + [floors]
    record["verdict"] = verdict_of(record["gates"] + record["post_run"])
    try:
        write_json(path, summary)
    except OSError as e:
        fail(f"cannot rewrite {path} with the eval floors ({first_line(e)}): free space there and "
             "run eval.py again")
    return floors
