"""
The dry run (train.py --dryrun_steps=N): the real config for N steps into out_dir/first with a checkpoint at N/2,
then steps N/2+1..N again from that checkpoint into out_dir/resumed, in one invocation. out_dir/dryrun.json says
whether the resume reproduced the first pass's losses, every rank ran every step and the loss fell: everything a
long run needs, checked in minutes.
"""
import os

import torch.distributed as dist

from podgpt.pod.report import read_metrics
from podgpt.core.util import Folder, fail, is_master, log, remove, write_json


def dryrun_report(root, n, first, resumed, activities):
    """Rank 0's verdict on the two passes, written to root/dryrun.json; `problems` lists what is off."""
    half, problems = n // 2, []
    # training rows with a loss (a non-finite one is written as null, and counted in nonfinite_steps)
    a, b = ({m["step"]: m for m in read_metrics(os.path.join(root, run, "metrics.jsonl")) if m.get("loss") is not None}
            for run in ("first", "resumed"))
    tolerance = 1e-5 if activities[0]["dtype"] == "float32" else 1e-2  # bf16 kernels may reduce in another order
    diffs = {k: abs(b[k]["loss"] - a[k]["loss"]) / abs(a[k]["loss"]) for k in range(half + 1, n + 1) if k in a and k in b}
    worst = max(diffs.values(), default=float("inf"))
    if len(diffs) != n - half or not worst <= tolerance:
        problems.append(f"the resumed run does not reproduce steps {half + 1}..{n}: largest relative loss "
                        f"difference {worst:.3g} (tolerance {tolerance:g})")
    idle = [x["rank"] for x in activities if x["steps"] != n]
    if idle:
        problems.append(f"ranks {idle} did not run all {n} steps")
    if first["nonfinite_steps"]:
        problems.append(f"{first['nonfinite_steps']} non-finite steps")
    losses = [a[k]["loss"] for k in sorted(a)]
    k = max(1, len(losses) // 4)
    trend = (sum(losses[:k]) / k, sum(losses[-k:]) / k)
    if trend[1] > trend[0]:
        problems.append(f"the loss rose: {trend[0]:.4f} over the first {k} steps, {trend[1]:.4f} over the last {k}")
    report = dict(ok=not problems, problems=problems, steps=n, world_size=len(activities), ranks=activities,
                  tokens_per_sec=a[max(a)]["tokens_per_sec"], peak_mem_gb=max(x["peak_mem_gb"] for x in activities),
                  loss_first=trend[0], loss_last=trend[1], spikes=first["spikes"],
                  resume_check=dict(from_step=half, steps=sorted(diffs), max_rel_diff=worst, tolerance=tolerance),
                  first=first, resumed=resumed)
    write_json(os.path.join(root, "dryrun.json"), report)
    return report


def dryrun(argv, n, root, train):
    """The real config for n steps into root/first with a checkpoint at n/2, then n/2+1..n again from it into
    root/resumed, in one invocation; the exit status. train(args): one run of the training script with argv and
    these arguments, in this process, its process group kept for the next: (exit status, rank 0's summary or None,
    this rank's activity). A stop (a signal, a guard) in the first pass ends the dry run there: there is nothing
    to compare."""
    ddp, master = "RANK" in os.environ, is_master()
    if n < 2:
        fail(f"dryrun_steps={n}: need at least 2 (a checkpoint at half, then the resume)")
    half = n // 2
    folder = Folder(root, "out_dir", legacy=("dryrun.json", "first", "resumed"))  # the names a dry run writes
    if master:  # each dry run starts from nothing: the folders of the one before go (podgpt's own, and no one's now)
        folder.hold()
        for sub in ("first", "resumed"):
            if os.path.lexists(os.path.join(root, sub)):
                remove(os.path.join(root, sub))
        folder.claim()
    try:
        # the research gates: a few steps are no release, and release_token_budget blocks them under the others
        common = ["--dryrun_steps=0", f"--max_steps={n}", "--fit_budget=False", "--log_every=1", f"--eval_every={n}",
                  "--save_best=False", "--early_stop_patience=0", f"--keep_last={n}", "--gate_profile=research"]
        _, first, activity = train([*argv, *common, f"--out_dir={root}/first", "--resume=never",
                                    f"--ckpt_every={half}"])
        if activity["stop_reason"] != "max_steps":  # agreed by every rank
            if ddp:
                dist.barrier()
                dist.destroy_process_group()
            log(f"dry run stopped at step {activity['steps']} of its first pass ({activity['stop_reason']}): nothing "
                f"to compare; run the same command again to start it over")
            return 0
        _, resumed, _ = train([*argv, *common, f"--out_dir={root}/resumed", f"--ckpt_every={n}",
                               f"--resume={root}/first/ckpt/step_{half:07d}"])
    finally:
        folder.release()
    activities = [activity]
    if ddp:
        activities = [None] * dist.get_world_size()
        dist.all_gather_object(activities, activity)
    report = dryrun_report(root, n, first, resumed, activities) if master else None
    if ddp:  # every rank leaves together: one exiting while another still works can abort gloo
        verdict = [report]
        dist.broadcast_object_list(verdict)
        report = verdict[0]
        dist.barrier()
        dist.destroy_process_group()
    if report["problems"]:
        if master:
            fail(f"dry run failed: {'; '.join(report['problems'])} (report in {root}/dryrun.json)")
        return 1
    if master:
        print(f"dry run ok: {n} steps on {len(activities)} rank(s), loss {report['loss_first']:.4f} -> "
              f"{report['loss_last']:.4f}, resume from step {n // 2} reproduces steps {n // 2 + 1}..{n} (largest "
              f"difference {report['resume_check']['max_rel_diff']:.2g}), {report['tokens_per_sec']:,.0f} tokens/s, "
              f"peak {report['peak_mem_gb']:.2f} GB | {root}/dryrun.json")
    return 0
