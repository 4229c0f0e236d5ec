"""
The release gates: what each gate profile demands (PROFILES: every threshold of every gate, one table), the gates
that judge a run for release (release_token_budget, base_exposure, sft_category_balance,
eval_skill_release_coverage, eval_contamination), and the long-run gate that summary.json carries after the run:
the run's preflight gates, then the checks only the finished run can answer (final_loss, spikes_rollbacks,
contamination), and eval.py's eval_floors once the run is evaluated.

A gate is {name, verdict, value, threshold, detail}: pass, warn, block (the run does not start, unless
allow_unsafe) or skip (nothing to check it against, said why); a block says the fix. preflight.py plans the run
and checks the rest of the gates; the honesty report and the hand-off bundle read summary.json's long_run_gate.
"""

import math
import os

from podgpt.core.util import fail, first_line, write_json
from podgpt.corpus.download import file_sha256
from podgpt.pod.report import read_json

PROFILE_NAMES = ("research", "release", "skill_release")
# every threshold per profile: (research, release, skill_release); None: not checked under that profile
PROFILES = {
    # compute_optimal_horizon: planned tokens per non-embedding parameter, as a multiple of Chinchilla's 20
    "horizon_block_below": (None, 0.1, 0.1),
    "horizon_warn_outside": (None, (0.5, 1.5), (0.5, 1.5)),
    "horizon_block_above": (None, 3.0, 3.0),  # only for runs of preflight.LONG_RUN_TOKENS or more
    # corpus_model_fit: epochs over the unique training tokens, a warning above 1 in every profile; a block above
    # this (max_epochs overrides it): repetition starts to cost at 4 (Muennighoff et al. 2023), and past ~16 it adds
    # next to nothing, so research's 100 is surely a mistake
    "epochs_block_above": (100, 4, 4),
    # release_token_budget: base-training tokens per parameter, all of them counted (as the 1B recipe counts its
    # 22.4B tokens for 1.12B parameters); a warning more than 10% short of Chinchilla's 20
    "budget_block_below": (None, 10, 15),
    "budget_warn_below": (None, 18, 18),
    # base_exposure: the base model's tokens per parameter before SFT, and SFT's share of all the tokens
    "exposure_block_below": (None, 10, 15),
    "sft_share_warn_above": (0.1, 0.05, 0.05),
    "sft_share_block_above": (None, 0.2, 0.1),
    # sft_category_balance: the smallest category's SFT rows over the largest category's
    "balance_warn_below": (0.5, 0.5, 0.5),
    "balance_block_below": (None, 0.2, 0.25),
    # eval_skill_release_coverage: the widest 95% Wilson interval of a category's accuracy (at 50%, where it is
    # widest) over its eval rows: 0.4 wide needs 22 rows, 0.35 needs 28 (the 1B pack's 320 rows in 11 categories: 29)
    "interval_warn_above": (0.5, 0.4, 0.35),
    "interval_block_above": (None, 0.5, 0.4),
    # eval_contamination before the run, contamination after it: an eval row that the corpus or the SFT rows hold
    "overlap": ("warn", "block", "block"),
    # without a pack (pack_dir) to judge, the pack's gates skip, or block
    "pack_missing": ("skip", "skip", "block"),
    # final_loss: the final validation loss missed target_val_loss (or the run stopped before it was measured)
    "target_missed": ("warn", "warn", "block"),
    # spikes_rollbacks: a warning at any rollback or non-finite step; a block above this many rollbacks
    "rollbacks_block_above": (None, 1, 0),
    # eval_floors (eval.py): the overall accuracy's 95% interval above the pooled chance level, and at most this
    # share of the categories at or below their chance level
    "floor_above_chance": (False, True, True),
    "floor_at_chance_share": (None, 0.5, 0.25),
}
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def limits(profile):
    """{threshold: value} of a profile (a name of PROFILE_NAMES)."""
    k = PROFILE_NAMES.index(profile)
    return {name: values[k] for name, values in PROFILES.items()}


def check_profile(profile):
    if profile not in PROFILE_NAMES:
        fail(f"gate_profile={profile!r} is not one of {', '.join(PROFILE_NAMES)}", 2)


def gate(name, verdict, value, threshold, detail):
    return dict(name=name, verdict=verdict, value=value, threshold=threshold, detail=detail)


def verdict_of(gates):
    """The worst verdict of gates: block, warn, else pass (a skip counts as a pass)."""
    verdicts = {g["verdict"] for g in gates}
    return "block" if "block" in verdicts else "warn" if "warn" in verdicts else "pass"


def wilson(correct, n, z=Z95):
    """The Wilson score interval (low, high) of a proportion correct/n; (0, 1) when n is 0 (nothing is known)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def judge(value, warn=None, block=None, below=False):
    """pass, warn or block for a value against its thresholds (None: not checked), above them or (below) under."""
    def past(limit):
        return limit is not None and (value < limit if below else value > limit)
    return "block" if past(block) else "warn" if past(warn) else "pass"


def said(profile, **rules):
    """A profile's thresholds as the details say them: "release: warn below 18, block below 10" (rule names with
    their underscores as spaces; None: not checked)."""
    checked = [f"{rule.replace('_', ' ')} {value:g}" for rule, value in rules.items() if value is not None]
    return f"{profile}: {', '.join(checked) or 'not checked'}"


# -----------------------------------------------------------------------------
# the base model's tokens

def base_checkpoint(init_from):
    """(tokens the base checkpoint of init_from trained on, its folder, its data_dir); None without one."""
    from podgpt.core.checkpoint import MARKER, find_checkpoint  # here: only an SFT run asks, and it has torch loaded anyway
    path = find_checkpoint(init_from)
    marker, config = (read_json(os.path.join(path, name)) if path else None for name in (MARKER, "config.json"))
    if not marker or not config:
        return None
    return marker["step"] * config["total_batch_tokens"], path, config.get("data_dir")


def release_token_budget(cfg, params):
    """release_token_budget: the base model's tokens per parameter: planned (max_steps), or for an SFT run
    (init_from) those its base checkpoint trained on."""
    lim = limits(cfg.gate_profile)
    base = base_checkpoint(cfg.init_from) if cfg.init_from else None
    if cfg.init_from and base is None:
        return gate("release_token_budget", "block", None, lim["budget_block_below"],
                    f"init_from={cfg.init_from} holds no checkpoint to count the base tokens of: train the base first")
    tokens, what = (base[0], f"the base checkpoint {base[1]} trained on") if base else (
        cfg.max_steps * cfg.total_batch_tokens, f"max_steps={cfg.max_steps:,} plans")
    per_param = tokens / params
    verdict = judge(per_param, lim["budget_warn_below"], lim["budget_block_below"], below=True)
    return gate("release_token_budget", verdict, per_param, lim["budget_block_below"],
                f"{tokens / 1e9:.3g}B tokens {what} = {per_param:.3g} per parameter ({params / 1e9:.3g}B) ("
                + said(cfg.gate_profile, warn_below=lim["budget_warn_below"], block_below=lim["budget_block_below"])
                + ")" + ("" if verdict != "block" else ": a longer base run (more max_steps), or gate_profile=research "
                   "for a run not meant for release"))


# -----------------------------------------------------------------------------
# the skills pack: its manifest (skills.py) and its SFT rows

def read_pack(pack_dir):
    """(the pack's manifest.json, None) or (None, why there is none to judge)."""
    if not pack_dir:
        return None, "no pack_dir: no skills pack to judge"
    manifest = read_json(os.path.join(pack_dir, "manifest.json"))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("categories"), dict):
        return None, f"pack_dir={pack_dir} holds no skills pack (manifest.json): make it with skills.py"
    return manifest, None


def no_pack(name, profile, pack_dir, why):
    verdict = limits(profile)["pack_missing"]
    return gate(name, verdict, None, None, why + (": set pack_dir to the skills pack the run is released with"
                                                  if verdict == "block" and not pack_dir else ""))


def pack_sft_tokens(pack_dir, manifest):
    """Tokens of one pass over the pack's SFT rows, at the prepared data's tokens per byte; None without either."""
    from podgpt.corpus.tasks import read_rows
    from podgpt.core.tokenizer import reply_text
    split = (manifest or {}).get("splits", {}).get("train", {})
    path = os.path.join(pack_dir, "sft.jsonl")
    if not split.get("bytes") or not os.path.isfile(path):
        return None
    rows = read_rows(path)[0]
    sft_bytes = sum(len((row["prompt"] + reply_text(row)).encode("utf-8")) for row in rows)
    return sft_bytes * split["tokens"] / split["bytes"]


def base_exposure(cfg, params, manifest):
    """base_exposure: the base model's tokens per parameter, and SFT's share of base + SFT tokens. An SFT run
    (init_from): its base checkpoint's tokens and its own planned ones; a base run with a pack: its planned tokens,
    and one pass over the pack's SFT rows."""
    lim = limits(cfg.gate_profile)
    threshold = dict(base_tokens_per_param=lim["exposure_block_below"], sft_share=lim["sft_share_block_above"])
    if cfg.init_from:
        base = base_checkpoint(cfg.init_from)
        if base is None:
            return gate("base_exposure", "block", None, threshold,
                        f"init_from={cfg.init_from} holds no checkpoint: train the base model first")
        base_tokens, sft_tokens = base[0], cfg.max_steps * cfg.total_batch_tokens
        how = f"the base checkpoint {base[1]}'s tokens, and this run's max_steps={cfg.max_steps:,} of SFT"
    else:
        sft_tokens = pack_sft_tokens(cfg.pack_dir, manifest) if cfg.pack_dir else None
        if sft_tokens is None:
            return gate("base_exposure", "skip", None, threshold,
                        "a base run without init_from: " + ("no pack_dir to plan its SFT from" if not cfg.pack_dir
                                                            else f"no SFT rows in {cfg.pack_dir} or no prepared data "
                                                                 f"to count their tokens in"))
        base_tokens = cfg.max_steps * cfg.total_batch_tokens
        how = f"max_steps={cfg.max_steps:,} planned, then one pass over {cfg.pack_dir}'s SFT rows"
    per_param, share = base_tokens / params, sft_tokens / (base_tokens + sft_tokens)
    verdict = verdict_of([{"verdict": judge(per_param, None, lim["exposure_block_below"], below=True)},
                          {"verdict": judge(share, lim["sft_share_warn_above"], lim["sft_share_block_above"])}])
    return gate("base_exposure", verdict, dict(base_tokens_per_param=per_param, sft_share=share), threshold,
                f"{how}: the base saw {base_tokens / 1e9:.3g}B tokens = {per_param:.3g} per parameter, SFT "
                f"{sft_tokens / 1e6:.3g}M = {share:.2%} of all ("
                + said(cfg.gate_profile, base_block_below=lim["exposure_block_below"],
                       SFT_share_warn_above=lim["sft_share_warn_above"], block_above=lim["sft_share_block_above"])
                + ")" + ("" if verdict != "block" else ": a longer base run, or fewer SFT steps"))


def sft_category_balance(cfg, pack):
    """sft_category_balance: the SFT rows of the pack's smallest category over its largest's."""
    lim = limits(cfg.gate_profile)
    counts = {name: c.get("sft", 0) for name, c in pack["categories"].items() if c.get("sft", 0)}
    if not counts:
        return gate("sft_category_balance", "block", None, lim["balance_block_below"],
                    f"{cfg.pack_dir} has no SFT rows: make the pack with sft_rows > 0")
    low, high = min(counts, key=counts.get), max(counts, key=counts.get)
    ratio = counts[low] / counts[high]
    verdict = judge(ratio, lim["balance_warn_below"], lim["balance_block_below"], below=True)
    return gate("sft_category_balance", verdict, ratio, lim["balance_block_below"],
                f"{len(counts)} categories: the smallest, {low}, has {counts[low]} SFT rows, the largest, {high}, "
                f"{counts[high]}: {ratio:.2f} ("
                + said(cfg.gate_profile, warn_below=lim["balance_warn_below"], block_below=lim["balance_block_below"])
                + ")" + ("" if verdict != "block" else f": more rows of {low}, or fewer of {high}"))


def eval_skill_release_coverage(cfg, pack):
    """eval_skill_release_coverage: the widest 95% Wilson interval (at 50% correct) of an SFT category's eval
    rows against the profile's width."""
    lim = limits(cfg.gate_profile)
    names = [name for name, c in pack["categories"].items() if c.get("sft", 0)]
    if not names:
        return gate("eval_skill_release_coverage", "skip", None, lim["interval_block_above"], "no SFT categories")
    rows = {name: pack["categories"][name].get("eval", 0) for name in names}
    fewest = min(rows, key=rows.get)
    low, high = wilson(rows[fewest] / 2, rows[fewest])
    verdict = judge(high - low, lim["interval_warn_above"], lim["interval_block_above"])
    return gate("eval_skill_release_coverage", verdict, high - low, lim["interval_block_above"],
                f"the fewest eval rows of the {len(names)} SFT categories: {fewest}'s {rows[fewest]}, whose 95% "
                f"interval at 50% correct is {high - low:.3f} wide ("
                + said(cfg.gate_profile, warn_above=lim["interval_warn_above"], block_above=lim["interval_block_above"])
                + ")" + ("" if verdict != "block" else ": more eval rows per category (skills.py --eval_rows)"))


# -----------------------------------------------------------------------------
# contamination of the eval rows: by the corpus (prepare.py's count) and by the SFT rows (skills.py's check)

def corpus_overlap(manifest, data_dir, eval_sha):
    """(eval rows found in data_dir's training documents, what was counted) from its manifest's
    eval_contamination; (None, why not) when it was not counted for these eval rows."""
    record = manifest.get("eval_contamination")
    if not isinstance(record, dict) or record.get("eval_sha256") != eval_sha:
        return None, (f"{data_dir} was not checked against these eval rows" if not isinstance(record, dict) else
                      f"{data_dir} was checked against other eval rows (eval.jsonl changed since)")
    rows = sorted(record["train_docs_by_row"], key=int)
    return len(rows), (f"{data_dir}: {len(rows)} of {record['eval_rows']} eval rows in training documents"
                       + (f" (rows {', '.join(rows[:5])}{' ...' if len(rows) > 5 else ''})" if rows else "")
                       + f", {record['rows_checked']} of them long enough to check")


def eval_contamination(cfg, pack, name="eval_contamination"):
    """eval_contamination: the pack's eval rows that the run's training corpus holds (and for an SFT run, its
    base's corpus), counted by prepare.py with pack_dir, and the SFT rows that hold a run of an eval row's words
    (ngrams.py; skills.py refuses to write such a pack, and records the check)."""
    lim = limits(cfg.gate_profile)
    try:
        eval_sha = file_sha256(os.path.join(cfg.pack_dir, "eval.jsonl"))
    except OSError as e:
        return gate(name, lim["pack_missing"], None, 0, f"no eval rows to check ({first_line(e)})")
    base = base_checkpoint(cfg.init_from) if cfg.init_from else None
    corpora = [cfg.data_dir] + ([base[2]] if base and base[2] and base[2] != cfg.data_dir else [])
    found, details = 0, []
    for data_dir in corpora:
        manifest = read_json(os.path.join(data_dir, "manifest.json"))
        if manifest is None:  # as corpus_model_fit: a run cannot start before its data is prepared
            return gate(name, "skip", None, 0, f"no data prepared in {data_dir} yet")
        rows, detail = corpus_overlap(manifest, data_dir, eval_sha)
        if rows is None:
            return gate(name, lim["overlap"], None, 0, f"{detail}: prepare it with --pack_dir={cfg.pack_dir} "
                                                       "(--force) to count the eval rows its training documents hold")
        found += rows
        details.append(detail)
    sft = pack.get("sft_rows_sharing_eval")
    details.append("SFT rows holding a run of an eval row's words: " + (
        "not recorded (a pack from before skills.py recorded it)" if sft is None else str(sft)))
    found += sft or 0
    return gate(name, lim["overlap"] if found else "pass", found, 0,
                "; ".join(details) + ("" if not found else ": take those rows out of the eval set, or the documents "
                                                           "out of the corpus, and prepare again"))


def pack_gates(cfg, params, manifest):
    """base_exposure, sft_category_balance, eval_skill_release_coverage and eval_contamination. Without the pack
    they block under skill_release, unless the data is not prepared either (planning ahead: they skip, as
    data_gates do)."""
    pack, why = read_pack(cfg.pack_dir)
    if pack is None:
        profile = cfg.gate_profile if manifest or not cfg.pack_dir else "research"  # planned before data and pack
        return [base_exposure(cfg, params, manifest)] + [no_pack(name, profile, cfg.pack_dir, why) for name in (
            "sft_category_balance", "eval_skill_release_coverage", "eval_contamination")]
    return [base_exposure(cfg, params, manifest), sft_category_balance(cfg, pack),
            eval_skill_release_coverage(cfg, pack), eval_contamination(cfg, pack)]


# -----------------------------------------------------------------------------
# after the run: summary.json's long_run_gate

def final_loss(profile, summary):
    """final_loss: the final validation loss against target_val_loss (report.target_verdict's met, missed, not
    reached)."""
    target, band = summary.get("target"), summary.get("target_val_loss")
    if target is None:
        return gate("final_loss", "skip", summary.get("final_val_loss"), None, "no target_val_loss to judge it by")
    verdict = "pass" if target == "met" else limits(profile)["target_missed"]
    return gate("final_loss", verdict, summary.get("final_val_loss"), band,
                f"final validation loss {summary.get('final_val_loss')}: target {target}" + (
                    "" if verdict != "block" else ": resume it to its horizon, or train longer or on more data"))


def spikes_rollbacks(profile, summary):
    """spikes_rollbacks: the loss spikes, non-finite steps and rollbacks of the run."""
    block = limits(profile)["rollbacks_block_above"]
    counts = {k: summary.get(k) or 0 for k in ("spikes", "nonfinite_steps", "rollbacks")}
    verdict = ("block" if block is not None and counts["rollbacks"] > block else
               "warn" if counts["rollbacks"] or counts["nonfinite_steps"] else "pass")
    return gate("spikes_rollbacks", verdict, counts, block,
                f"{counts['spikes']} spikes, {counts['nonfinite_steps']} non-finite steps, {counts['rollbacks']} "
                f"rollbacks ({profile}: warn at a rollback or a non-finite step"
                + ("" if block is None else f", block above {block} rollbacks") + ")"
                + ("" if verdict != "block" else ": find the cause (metrics.jsonl's events, postmortem/) and train "
                   "again, lower learning_rate"))


def long_run_gate(cfg, summary):
    """summary.json's long_run_gate: the run's preflight gates (out_dir/preflight.json) and the checks after it."""
    preflight = read_json(os.path.join(cfg.out_dir, "preflight.json")) or {}
    pack, why = read_pack(cfg.pack_dir)
    contamination = (eval_contamination(cfg, pack, "contamination") if pack else
                     no_pack("contamination", cfg.gate_profile, cfg.pack_dir, why))
    post = [final_loss(cfg.gate_profile, summary), spikes_rollbacks(cfg.gate_profile, summary), contamination]
    gates = preflight.get("gates", [])
    return dict(profile=cfg.gate_profile, verdict=verdict_of(gates + post), gates=gates, post_run=post)


# -----------------------------------------------------------------------------
# eval.py's floors, added to the evaluated run's long_run_gate

def eval_floors(profile, pack_report):
    """eval_floors: of eval.py's pack report, the overall accuracy's interval against the pooled chance level, and
    the share of categories at or below their chance level."""
    lim = limits(profile)
    if not lim["floor_above_chance"] and lim["floor_at_chance_share"] is None:
        return gate("eval_floors", "skip", None, None, f"{profile}: no floors")
    overall, cats = pack_report["overall"], pack_report["categories"]
    at_chance = sorted(c for c, s in cats.items() if s["accuracy"] is None or s["chance"] is None
                       or s["accuracy"] <= s["chance"])
    share = len(at_chance) / len(cats) if cats else 1.0
    chance = "unknown" if overall["chance"] is None else f"{overall['chance']:.3f}"
    above = bool(overall["above_chance"])
    too_many = lim["floor_at_chance_share"] is not None and share > lim["floor_at_chance_share"]
    verdict = "block" if (lim["floor_above_chance"] and not above) or too_many else "pass"
    return gate("eval_floors", verdict, dict(overall_low=overall["low"], pooled_chance=overall["chance"],
                                             at_chance_share=share), lim["floor_at_chance_share"],
                f"overall {overall['correct']} of {overall['n']}, 95% interval from {overall['low']:.3f}: "
                f"{'above' if above else 'not above'} the pooled chance {chance}; {len(at_chance)} of "
                f"{len(cats)} categories at or below chance" + (f" ({', '.join(at_chance)})" if at_chance else "")
                + f" ({profile}: at most {lim['floor_at_chance_share']:.0%})"
                + ("" if verdict != "block" else ": more base or SFT training on the weak categories"))


def record_eval_floors(run_dir, pack_report):
    """Add (or replace) eval_floors in run_dir's summary.json long_run_gate and recompute its verdict; the gate, or
    None when the run has no long_run_gate."""
    path = os.path.join(run_dir, "summary.json")
    summary = read_json(path)
    record = summary.get("long_run_gate") if isinstance(summary, dict) else None
    if not isinstance(record, dict):
        return None
    floors = eval_floors(record["profile"], pack_report)
    record["post_run"] = [g for g in record["post_run"] if g["name"] != "eval_floors"] + [floors]
    record["verdict"] = verdict_of(record["gates"] + record["post_run"])
    try:
        write_json(path, summary)
    except OSError as e:
        fail(f"cannot rewrite {path} with the eval floors ({first_line(e)}): free space there and run eval.py again")
    return floors
