"""
The dry run (train.py --dryrun_steps=N): the real config for N steps into out_dir/first with a
checkpoint at N/2, then steps N/2+1..N again from it into out_dir/resumed. out_dir/dryrun.json says
whether the resume reproduced the losses, every rank ran every step and the loss fell.
"""
import os

import torch.distributed as dist

from podgpt.core.util import Folder, fail, is_master, log, remove, write_json
from podgpt.pod.report import read_metrics


def dryrun_report(root, n, first, resumed, activities):
    """Rank 0's verdict on the two passes, into root/dryrun.json; `problems` lists what is off."""
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
                  first=first, resumed=resumed)
    write_json(os.path.join(root, "dryrun.json"), report)
    return report


def leave(ddp):
    """Every rank leaves together: one exiting while another still works can abort gloo."""
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


def dryrun(argv, n, root, train):
    """The exit status of the dry run of n steps into root. train(args): one run of the training
    script with argv and args, in this process, keeping its process group: (exit status, rank 0's
    summary or None, this rank's activity). A stop in the first pass ends it: nothing to compare."""
    ddp, master = "RANK" in os.environ, is_master()
    if n < 2:
        fail(f"dryrun_steps={n}: need at least 2 (a checkpoint at half, then the resume)")
    half = n // 2
    folder = Folder(root, "out_dir", legacy=("dryrun.json", "first", "resumed"))  # its names
    if master:  # each dry run starts from nothing: the one before's folders go
        folder.hold()
        for sub in ("first", "resumed"):
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
    finally:
        folder.release()
    activities = [activity]
    if ddp:
        activities = [None] * dist.get_world_size()
        dist.all_gather_object(activities, activity)
    report = [dryrun_report(root, n, first, resumed, activities) if master else None]
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
              f"tokens/s, peak {report['peak_mem_gb']:.2f} GB | {root}/dryrun.json")
    return 0
