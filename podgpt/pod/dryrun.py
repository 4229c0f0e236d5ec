"""
The dry run (train.py --dryrun_steps=N): the real config for N steps into out_dir/first with a
checkpoint at N/2, then steps N/2+1..N again from it into out_dir/resumed; with dryrun_sft, one
step of the SFT stage from that checkpoint into out_dir/sft. out_dir/dryrun.json says whether the
resume reproduced the losses, every rank ran every step, no step spiked or went non-finite and the
loss fell.
"""
import math
import os
import subprocess
import sys

import torch.distributed as dist

from podgpt.core.util import Folder, fail, is_master, log, remove, write_json
from podgpt.pod.report import read_metrics


PREPARE = os.path.join(os.path.dirname(__file__), "..", "..", "prepare.py")


def dryrun_report(root, n, first, resumed, activities, sft):
    """Rank 0's verdict on the passes, into root/dryrun.json; `problems` lists what is off.
    activities: each rank's (first pass, SFT step or None); sft: the SFT step's summary or None."""
    activities, sft_activities = [a for a, _ in activities], [b for _, b in activities]
    half, problems = n // 2, []
    # training rows with a loss (a non-finite one is null, counted in nonfinite_steps)
    a, b = ({m["step"]: m for m in read_metrics(os.path.join(root, run, "metrics.jsonl"))
             if m.get("loss") is not None} for run in ("first", "resumed"))
    tolerance = 1e-5 if activities[0]["dtype"] == "float32" else 1e-2  # bf16 may reduce otherwise
    diffs = {k: abs(b[k]["loss"] - a[k]["loss"]) / abs(a[k]["loss"])
             for k in range(half + 1, n + 1) if k in a and k in b}
    worst = max(diffs.values(), default=float("inf"))
    if len(diffs) != n - half or not worst <= tolerance:
        problems.append(f"the resumed run does not reproduce steps {half + 1}..{n}: largest "
                        f"relative loss difference {worst:.3g} (tolerance {tolerance:g})")
    if idle := [x["rank"] for x in activities if x["steps"] != n]:
        problems.append(f"ranks {idle} did not run all {n} steps")
    if first["nonfinite_steps"]:
        problems.append(f"{first['nonfinite_steps']} non-finite steps")
    if first["spikes"]:  # a loss above spike_factor x its recent average
        problems.append(f"{first['spikes']} loss spikes above spike_factor x the recent average "
                        f"(the spike events in {root}/first/metrics.jsonl)")
    if sft is not None:
        problems += sft_problems(sft, sft_activities)
    losses = [a[k]["loss"] for k in sorted(a)]
    k = max(1, len(losses) // 4)
    trend = (sum(losses[:k]) / k, sum(losses[-k:]) / k)
    if trend[1] > trend[0]:
        problems.append(f"the loss rose: {trend[0]:.4f} over the first {k} steps, {trend[1]:.4f} "
                        f"over the last {k}")
    report = dict(ok=not problems, problems=problems, steps=n, world_size=len(activities),
                  ranks=activities, tokens_per_sec=a[max(a)]["tokens_per_sec"],
                  peak_mem_gb=max(x["peak_mem_gb"] for x in activities), loss_first=trend[0],
                  loss_last=trend[1], spikes=first["spikes"],
                  resume_check=dict(from_step=half, steps=sorted(diffs), max_rel_diff=worst,
                                    tolerance=tolerance),
                  first=first, resumed=resumed, sft=sft)
    write_json(os.path.join(root, "dryrun.json"), report)
    return report


def sft_problems(sft, activities):
    """What is off with the SFT step: a rank that did not take it, a non-finite loss."""
    problems = []
    if idle := [x["rank"] for x in activities if x["steps"] != 1]:
        problems.append(f"ranks {idle} did not take the SFT step")
    loss = sft["final_train_loss"]
    if sft["nonfinite_steps"] or loss is None or not math.isfinite(loss):
        problems.append(f"the SFT step's loss is not finite ({loss})")
    return problems


def check_sft(sft):
    """The dry run's SFT step needs its config and the skills pack's SFT rows: one line if not."""
    config, pack_dir = sft
    if not os.path.isfile(config):
        fail(f"dryrun_sft={config}: no such file (the SFT stage's config, e.g. "
             f"config/h200_1b_ddp8_sft.py; '' for no SFT step)")
    if not os.path.isfile(os.path.join(pack_dir or ".", "sft.jsonl")):
        fail(f"dryrun_sft needs the skills pack's SFT rows, {pack_dir}/sft.jsonl: none there; "
             f"make it first (python skills.py with this config, run.sh's skills stage)")


def sft_step(argv, sft, root, train, master, ddp):
    """The SFT stage for one step: the pack's SFT rows as chat data in the resumed run's tokenizer
    (rank 0, prepare.py), then one step from its checkpoint: train's (status, summary, activity)."""
    config, pack_dir = sft
    configs = [a for a in argv if not a.startswith("--")]  # prepare.py takes the files alone
    data = os.path.join(root, "sft_data")
    if master:
        r = subprocess.run([sys.executable, PREPARE, *configs, config, "--chat=True",
                            f"--chat_base={root}/resumed", f"--source={pack_dir}/sft.jsonl",
                            f"--data_dir={data}", "--force=True"], stdout=subprocess.DEVNULL)
        if r.returncode:
            fail(f"dry run failed: the SFT step's data (prepare.py --chat=True) exited "
                 f"{r.returncode}")
    if ddp:
        dist.barrier()
    return train([*configs, config, *(a for a in argv if a.startswith("--")), f"--data_dir={data}",
                  f"--out_dir={root}/sft", "--resume=never", f"--init_from={root}/resumed",
                  "--max_steps=1", "--eval_every=1", "--ckpt_every=1"])


def leave(ddp):
    """Every rank leaves together: one exiting while another still works can abort gloo."""
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


def dryrun(argv, n, root, train, sft=None):
    """The exit status of the dry run of n steps into root. train(args): one run of the training
    script with argv and args, in this process, keeping its process group: (exit status, rank 0's
    summary or None, this rank's activity). sft: (config, pack_dir) of its SFT step, or None. A
    stop in the first pass ends it: nothing to compare."""
    ddp, master = "RANK" in os.environ, is_master()
    if n < 2:
        fail(f"dryrun_steps={n}: need at least 2 (a checkpoint at half, then the resume)")
    if sft:
        check_sft(sft)
    half = n // 2
    folder = Folder(root, "out_dir", legacy=("dryrun.json", "first", "resumed"))  # its names
    if master:  # each dry run starts from nothing: the one before's folders go
        folder.hold()
        for sub in ("first", "resumed", "sft"):
            if os.path.lexists(os.path.join(root, sub)):
                remove(os.path.join(root, sub))
        folder.claim()
    try:
        # the research gates: a few steps are no release, which release_token_budget would block
        common = ["--dryrun_steps=0", f"--max_steps={n}", "--fit_budget=False", "--log_every=1",
                  f"--eval_every={n}", "--save_best=False", "--early_stop_patience=0",
                  f"--keep_last={n}", "--gate_profile=research"]
        _, first, activity = train([*argv, *common, f"--out_dir={root}/first", "--resume=never",
                                    f"--ckpt_every={half}"])
        if activity["stop_reason"] != "max_steps":  # agreed by every rank
            leave(ddp)
            log(f"dry run stopped at step {activity['steps']} of its first pass "
                f"({activity['stop_reason']}): nothing to compare; run the same command again to "
                f"start it over")
            return 0
        _, resumed, _ = train([*argv, *common, f"--out_dir={root}/resumed", f"--ckpt_every={n}",
                               f"--resume={root}/first/ckpt/step_{half:07d}"])
        sft_summary, sft_activity = sft_step([*argv, *common], sft, root, train, master, ddp)[1:] \
            if sft else (None, None)
    finally:
        folder.release()
    activities = [(activity, sft_activity)]
    if ddp:
        activities = [None] * dist.get_world_size()
        dist.all_gather_object(activities, (activity, sft_activity))
    report = [dryrun_report(root, n, first, resumed, activities, sft_summary) if master else None]
    if ddp:
        dist.broadcast_object_list(report)
    report = report[0]
    leave(ddp)
    if report["problems"]:
        if master:
            fail(f"dry run failed: {'; '.join(report['problems'])} (report in {root}/dryrun.json)")
        return 1
    if master:
        print(f"dry run ok: {n} steps on {len(activities)} rank(s), loss "
              f"{report['loss_first']:.4f} -> {report['loss_last']:.4f}, resume from step {half} "
              f"reproduces steps {half + 1}..{n} (largest difference "
              f"{report['resume_check']['max_rel_diff']:.2g}), {report['tokens_per_sec']:,.0f} "
              f"tokens/s, peak {report['peak_mem_gb']:.2f} GB"
              + (f", 1 SFT step (loss {sft_summary['final_train_loss']:.4f})" if sft else "")
              + f" | {root}/dryrun.json")
    return 0
