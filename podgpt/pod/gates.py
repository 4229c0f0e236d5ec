"""
The gate profiles (PROFILES: every threshold of every gate), the gates on the base model's tokens,
and summary.json's long_run_gate: the preflight gates, then the checks only the finished run can
answer. A gate is {name, verdict, value, threshold, detail}: pass, warn, block (the run does not
start, unless allow_unsafe; it says the fix) or skip (said why). preflight.py checks the others;
the skills pack's gates and eval.py's floors are podgpt/release/gates.py's.
"""

import math
import os

from podgpt.core.util import fail
from podgpt.pod.report import read_json

PROFILE_NAMES = ("research", "release", "skill_release")
# every threshold per profile: (research, release, skill_release), None: not checked under it;
# docs/preflight.md's table says what each means (tests/test_gates.py holds the two equal)
PROFILES = {
    # compute_optimal_horizon, in Chinchilla's 20 tokens per non-embedding parameter
    "horizon_block_below": (None, 0.1, 0.1),
    "horizon_warn_outside": (None, (0.5, 1.5), (0.5, 1.5)),
    "horizon_block_above": (None, 3.0, 3.0),  # only for runs of preflight.LONG_RUN_TOKENS or more
    # corpus_model_fit, in epochs: repetition costs from 4 (Muennighoff et al. 2023) and past ~16
    # adds next to nothing, so research's 100 is surely a mistake
    "epochs_block_above": (100, 4, 4),
    # release_token_budget, in base tokens per parameter, all counted (as the 1B recipe counts)
    "budget_block_below": (None, 10, 15),
    "budget_warn_below": (None, 18, 18),
    "exposure_block_below": (None, 10, 15),  # base_exposure
    "sft_share_warn_above": (0.1, 0.05, 0.05),
    "sft_share_block_above": (None, 0.2, 0.1),
    "balance_warn_below": (0.5, 0.5, 0.5),  # sft_category_balance
    "balance_block_below": (None, 0.2, 0.25),
    # eval_skill_release_coverage: a 95% interval 0.4 wide needs 22 rows a category, 0.35 needs 28
    # (the 1B pack has 29)
    "interval_warn_above": (0.5, 0.4, 0.35),
    "interval_block_above": (None, 0.5, 0.4),
    "overlap": ("warn", "block", "block"),  # eval_contamination before the run, contamination after
    "pack_missing": ("skip", "skip", "block"),  # the pack's gates without a pack_dir
    "target_missed": ("warn", "warn", "block"),  # final_loss
    "rollbacks_block_above": (None, 1, 0),  # spikes_rollbacks
    "floor_above_chance": (False, True, True),  # eval_floors (eval.py)
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


def gate(name, verdict, value, threshold, detail, fix=""):
    """fix: what to change, said after the detail when the gate blocks."""
    if fix and verdict == "block":
        detail += f": {fix}"
    return dict(name=name, verdict=verdict, value=value, threshold=threshold, detail=detail)


def worst(*verdicts):
    """block over warn over pass (a skip counts as a pass)."""
    return next((v for v in ("block", "warn") if v in verdicts), "pass")


def verdict_of(gates):
    return worst(*(g["verdict"] for g in gates))


def wilson(correct, n, z=Z95):
    """The Wilson score interval (low, high) of correct/n; (0, 1) when n is 0 (nothing known)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def judge(value, warn=None, block=None, below=False):
    """pass, warn or block of a value against its thresholds (None: unchecked), above or below."""
    def past(limit):
        return limit is not None and (value < limit if below else value > limit)
    return "block" if past(block) else "warn" if past(warn) else "pass"


def said(profile, **rules):
    """A profile's thresholds as details say them: "release: warn below 18, block below 10"."""
    checked = [f"{rule.replace('_', ' ')} {value:g}" for rule, value in rules.items()
               if value is not None]
    return f"{profile}: {', '.join(checked) or 'not checked'}"


# -----------------------------------------------------------------------------
# the base model's tokens

def same_place(a, b):
    """Whether two paths as given name one place (init_from, recorded and given)."""
    return a == b or bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def base_checkpoint(cfg):
    """(tokens the base checkpoint of cfg.init_from trained on, its folder, its data_dir) or None:
    once this run has checkpoints, what they recorded of the base its weights came from (a resume
    needs no base, and the base run may have gone on since: run_record), else the base's."""
    from podgpt.core.checkpoint import MARKER, find_checkpoint  # only an SFT run asks
    own = find_checkpoint(cfg.out_dir)
    record = read_json(os.path.join(own, "config.json")) if own else None
    record = record if isinstance(record, dict) else {}
    base = record.get("base") if same_place(record.get("init_from"), cfg.init_from) else None
    if isinstance(base, list) and len(base) == 3:
        return tuple(base)
    path = find_checkpoint(cfg.init_from)
    marker, config = (read_json(os.path.join(path, name)) if path else None
                      for name in (MARKER, "config.json"))
    if not marker or not config:
        return None
    return marker["step"] * config["total_batch_tokens"], path, config.get("data_dir")


def release_token_budget(cfg, params):
    """release_token_budget: the base model's tokens per parameter: planned, or for an SFT run
    (init_from) those its base checkpoint trained on."""
    lim = limits(cfg.gate_profile)
    warn_below, block_below = lim["budget_warn_below"], lim["budget_block_below"]
    base = base_checkpoint(cfg) if cfg.init_from else None
    if cfg.init_from and base is None:
        return gate("release_token_budget", "block", None, block_below,
                    f"init_from={cfg.init_from} holds no checkpoint to count the base tokens of: "
                    f"train the base first")
    tokens, what = (base[0], f"the base checkpoint {base[1]} trained on") if base else (
        cfg.max_steps * cfg.total_batch_tokens, f"max_steps={cfg.max_steps:,} plans")
    per_param = tokens / params
    return gate("release_token_budget", judge(per_param, warn_below, block_below, below=True),
                per_param, block_below, f"{tokens / 1e9:.3g}B tokens {what} = {per_param:.3g} per "
                f"parameter ({params / 1e9:.3g}B) ("
                + said(cfg.gate_profile, warn_below=warn_below, block_below=block_below) + ")",
                "a longer base run (more max_steps), or gate_profile=research for a run not meant "
                "for release")


# -----------------------------------------------------------------------------
# the skills pack: its manifest (skills.py) and its SFT rows

def read_pack(pack_dir):
    """(the pack's manifest.json, None) or (None, why there is none to judge)."""
    if not pack_dir:
        return None, "no pack_dir: no skills pack to judge"
    manifest = read_json(os.path.join(pack_dir, "manifest.json"))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("categories"), dict):
        return None, (f"pack_dir={pack_dir} holds no skills pack (manifest.json): make it with "
                      f"skills.py")
    return manifest, None


def no_pack(name, profile, pack_dir, why):
    verdict = limits(profile)["pack_missing"]
    fix = verdict == "block" and not pack_dir
    return gate(name, verdict, None, None,
                why + (": set pack_dir to the skills pack the run is released with" if fix else ""))


def pack_sft_tokens(pack_dir, manifest):
    """Tokens of one pass over the pack's SFT rows at the data's tokens per byte; None without."""
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
    """base_exposure: the base model's tokens per parameter, and SFT's share of base + SFT tokens:
    an SFT run's base checkpoint and own tokens, or a base run's and a pass over its pack's SFT."""
    lim = limits(cfg.gate_profile)
    base_below, share_warn, share_block = (
        lim[k] for k in ("exposure_block_below", "sft_share_warn_above", "sft_share_block_above"))
    threshold = dict(base_tokens_per_param=base_below, sft_share=share_block)
    planned = cfg.max_steps * cfg.total_batch_tokens
    if cfg.init_from:
        base = base_checkpoint(cfg)
        if base is None:
            return gate("base_exposure", "block", None, threshold, f"init_from={cfg.init_from} "
                        f"holds no checkpoint: train the base model first")
        base_tokens, sft_tokens = base[0], planned
        how = (f"the base checkpoint {base[1]}'s tokens, and this run's "
               f"max_steps={cfg.max_steps:,} of SFT")
    else:
        sft_tokens = pack_sft_tokens(cfg.pack_dir, manifest) if cfg.pack_dir else None
        if sft_tokens is None:
            why = (f"no SFT rows in {cfg.pack_dir} or no prepared data to count their tokens in"
                   if cfg.pack_dir else "no pack_dir to plan its SFT from")
            return gate("base_exposure", "skip", None, threshold,
                        f"a base run without init_from: {why}")
        base_tokens = planned
        how = f"max_steps={cfg.max_steps:,} planned, then one pass over {cfg.pack_dir}'s SFT rows"
    per_param, share = base_tokens / params, sft_tokens / (base_tokens + sft_tokens)
    verdict = worst(judge(per_param, None, base_below, below=True),
                    judge(share, share_warn, share_block))
    return gate("base_exposure", verdict, dict(base_tokens_per_param=per_param, sft_share=share),
                threshold, f"{how}: the base saw {base_tokens / 1e9:.3g}B tokens = {per_param:.3g} "
                f"per parameter, SFT {sft_tokens / 1e6:.3g}M = {share:.2%} of all ("
                + said(cfg.gate_profile, base_block_below=base_below,
                       SFT_share_warn_above=share_warn, block_above=share_block) + ")",
                "a longer base run, or fewer SFT steps")


def no_pack_gates(cfg, params, manifest):
    """The pack's gates of a run without a skills pack: base_exposure, the rest no_pack's."""
    why = read_pack(cfg.pack_dir)[1]
    return [base_exposure(cfg, params, manifest)] + [
        no_pack(name, cfg.gate_profile, cfg.pack_dir, why)
        for name in ("sft_category_balance", "eval_skill_release_coverage", "eval_contamination")]


# -----------------------------------------------------------------------------
# after the run: summary.json's long_run_gate

def final_loss(profile, summary):
    """final_loss: report.target_verdict's met, missed or not reached, against the profile."""
    target, loss = summary.get("target"), summary.get("final_val_loss")
    if target is None:
        return gate("final_loss", "skip", loss, None, "no target_val_loss to judge it by")
    return gate("final_loss", "pass" if target == "met" else limits(profile)["target_missed"],
                loss, summary.get("target_val_loss"), f"final validation loss {loss}: target "
                f"{target}", "resume it to its horizon, or train longer or on more data")


def spikes_rollbacks(profile, summary):
    """spikes_rollbacks: the loss spikes, non-finite steps and rollbacks of the run."""
    block = limits(profile)["rollbacks_block_above"]
    counts = {k: summary.get(k) or 0 for k in ("spikes", "nonfinite_steps", "rollbacks")}
    verdict = worst(judge(counts["rollbacks"], block=block),
                    "warn" if counts["rollbacks"] or counts["nonfinite_steps"] else "pass")
    return gate("spikes_rollbacks", verdict, counts, block,
                f"{counts['spikes']} spikes, {counts['nonfinite_steps']} non-finite steps, "
                f"{counts['rollbacks']} rollbacks ({profile}: warn at a rollback or a non-finite "
                f"step" + ("" if block is None else f", block above {block} rollbacks") + ")",
                "find the cause (metrics.jsonl's events, postmortem/) and train again, lower "
                "learning_rate")


def long_run_gate(cfg, summary, release=None):
    """summary.json's long_run_gate: the run's preflight gates (out_dir/preflight.json) and the
    checks after it. release: podgpt/release/gates.py for a run with a skills pack, else None."""
    preflight = read_json(os.path.join(cfg.out_dir, "preflight.json")) or {}
    pack, why = read_pack(cfg.pack_dir)
    contamination = (release.eval_contamination(cfg, pack, "contamination") if pack and release
                     else no_pack("contamination", cfg.gate_profile, cfg.pack_dir, why))
    post = [final_loss(cfg.gate_profile, summary), spikes_rollbacks(cfg.gate_profile, summary),
            contamination]
    gates = preflight.get("gates", [])
    return dict(profile=cfg.gate_profile, verdict=verdict_of(gates + post), gates=gates,
                post_run=post)
