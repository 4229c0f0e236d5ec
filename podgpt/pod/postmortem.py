"""The spike post-mortem: out_dir/spike-postmortem.md and .json, kept current by rank 0 at every
spike and non-finite step: each bad step with the steps before it, its batch, what the run did
about it, and the command that trains the run again to that step, logging the same loss."""
import json
import math
import os
import shlex
import sys
from collections import Counter

import torch

from podgpt.core import configurator
from podgpt.core.data import rare_token_batch
from podgpt.core.util import write_atomic, write_json

POSTMORTEM = "spike-postmortem"  # out_dir/spike-postmortem.md and .json
POSTMORTEM_STEPS = 8  # steps (the bad one last) whose loss and grad norm a post-mortem shows
POSTMORTEM_SAMPLES = 4  # samples of a bad step's batch shown decoded
POSTMORTEM_TOKENS = 32  # tokens of each
# keys a replay command leaves at their defaults or sets itself: none changes what a step computes
REPLAY_DROPS = ("out_dir", "resume", "stop_at_step", "log_every", "eval_every", "ckpt_every",
                "ckpt_every_minutes", "early_stop_patience", "max_hours", "budget_usd",
                "budget_file", "budget_check_minutes", "log_to", "run_name", "run_tags")


def finite_or_text(x):
    """A float as strict JSON takes it: NaN and inf as the text "nan", "inf"."""
    return x if math.isfinite(x) else str(x)


def bad_batch(cfg, st, train_data, rare, tok):
    """The sample numbers and first tokens of the step just taken; a spike drill's batch is rank 0's
    first micro-batch of the rarest tokens."""
    n = cfg.total_batch_tokens // cfg.block_size
    first, drill = st.samples - n, f"spike@{st.step}" in st.injected
    if drill:
        rows = rare_token_batch(rare, cfg.micro_batch_size, cfg.block_size,
                                [cfg.seed, st.step - 1, first], torch.device("cpu"),
                                train_data.draws)[0].numpy()
        sources = None
    else:
        sources = train_data.sources(range(first, first + n))
        rows = [train_data.window(s["window"]) for s in sources[:POSTMORTEM_SAMPLES]]
    text = [tok.decode(row[:POSTMORTEM_TOKENS]) for row in rows[:POSTMORTEM_SAMPLES]]
    return dict(samples=[first, first + n], drill=drill, sources=sources, text=text)


def postmortem_md(cfg, bad_steps, ema_decay):
    """spike-postmortem.md: the bad steps oldest first, each with its replay command."""
    def shown(x):
        return f"{x:.4f}" if isinstance(x, float) else str(x)

    lines = [f"# Spike post-mortem: {cfg.out_dir}", "",
             f"{len(bad_steps)} bad steps: a spike is a loss above spike_factor="
             f"{cfg.spike_factor:g} x the average of the losses before it (a decay-{ema_decay} "
             f"EMA), a non-finite step a NaN or inf loss or gradient. Every step is in "
             f"metrics.jsonl; this, in full, in {POSTMORTEM}.json."]
    for bad in bad_steps:
        (a, z), batch = bad["batch"]["samples"], bad["batch"]
        kind = "spike" if bad["kind"] == "spike" else "non-finite"
        lines += ["", f"## Step {bad['step']}: {kind}, loss {shown(bad['loss'])} (average before "
                      f"it {shown(bad['loss_ema'])})", "",
                  f"What the run did: {bad['action']}.", "", "| step | loss | grad norm | lr |",
                  "|---|---|---|---|"]
        lines += [f"| {r['step']} | {shown(r['loss'])} | {shown(r['grad_norm'])} | {r['lr']:.3g} |"
                  for r in bad["recent"]]
        if batch["drill"]:
            lines += ["", f"The batch: the fire drill's, rarest tokens (data.rare_token_batch) in "
                          f"place of samples {a:,}..{z - 1:,}; the first tokens of rank 0's first "
                          f"rows:", "", "```"]
            lines += [json.dumps(t, ensure_ascii=False) for t in batch["text"]]
        else:
            shards = ", ".join(f"{name} ({k})" for name, k in
                               Counter(s["shard"] for s in batch["sources"]).items())
            lines += ["", f"The batch: samples {a:,}..{z - 1:,} (data.Loader's order), windows "
                          f"from {shards}; the first tokens of the first ones (a document is its "
                          f"index in the shard's docs.npy):", "", "```"]
            lines += [f"sample {s['sample']:,} ({s['shard']}, document {s['doc']:,}, token "
                      f"{s['token']:,}): {json.dumps(t, ensure_ascii=False)}"
                      for s, t in zip(batch["sources"], batch["text"])]
        lines += ["```", ""]
        if bad["replay_command"] is None:
            lines += [f"No replay: {bad['replay_note']}."]
            continue
        start = "the start" if bad["replay_from"] < 0 else (
            f"ckpt/step_{bad['replay_from']:07d} (kept while among the keep_last={cfg.keep_last} "
            f"newest)")
        lines += [f"Replay: trains from {start} to step {bad['step']} with this run's config, logs "
                  f"every step and stops there (a checkpoint in the replay's out_dir); its loss at "
                  f"step {bad['step']} is this one (bit for bit on CPU in fp32, "
                  f"tests/test_guards.py; a GPU's kernels may differ in the last bits):", "",
                  "```bash", bad["replay_command"], "```"]
    return "\n".join(lines) + "\n"


class PostMortem:
    """Rank 0's record of the run's bad steps; a replay command runs `script` on `world` ranks from
    a checkpoint in ckpt_root."""

    def __init__(self, cfg, script, world, ckpt_root, step, ema_decay):
        self.cfg, self.script, self.world, self.ckpt_root = cfg, script, world, ckpt_root
        self.ema_decay, self.path = ema_decay, os.path.join(cfg.out_dir, POSTMORTEM)
        # the oldest checkpoint a replay may start from (-1: any; after a rollback, only one saved
        # since holds its lr_scale)
        self.replay_floor = -1
        self.bad_steps = self.read(step)

    def read(self, step):
        """The bad steps this out_dir's post-mortem holds up to the step resumed from."""
        try:
            with open(self.path + ".json") as f:
                return [bad for bad in json.load(f)["bad_steps"] if bad["step"] <= step]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def write(self):
        """spike-postmortem.json and .md; an OSError (a full disk) is the caller's to report."""
        write_json(self.path + ".json", dict(out_dir=self.cfg.out_dir, bad_steps=self.bad_steps))
        write_atomic(self.path + ".md", postmortem_md(self.cfg, self.bad_steps, self.ema_decay))

    def add(self, kind, st, recent, batch, on_disk):
        """The step just taken, a spike or non-finite: recent holds the steps up to it as (step,
        loss, grad norm tensor, lr), on_disk the newest checkpoint on disk (-1: none)."""
        recent = [dict(step=s, loss=finite_or_text(loss), grad_norm=finite_or_text(g.item()), lr=lr)
                  for s, loss, g, lr in recent]
        action = ("skipped on every rank: no weight or optimizer state changed"
                  if kind == "nonfinite" else "counted, not skipped: its update was applied")
        args, note = self.replay_args(st, on_disk)
        launch = [sys.executable] + ([] if self.world == 1 else [
            "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.world}"])
        command = args and (f"cd {shlex.quote(os.getcwd())} && "
                            f"{shlex.join([*launch, os.path.relpath(self.script), *args])}")
        self.bad_steps.append(dict(
            **recent[-1], kind=kind, loss_ema=st.loss_ema, recent=recent, batch=batch,
            action=f"{action} ({st.bad_in_a_row} bad in a row; max_bad_steps="
                   f"{self.cfg.max_bad_steps} in a row roll back)",
            rolled_back_to=None, replay_from=on_disk if args else None, replay_args=args,
            replay_command=command, replay_note=note))

    def replay_args(self, st, on_disk):
        """(the script's arguments that train this run again up to st.step from the newest
        checkpoint on disk, or the start, and stop, None), or (None, why there are none)."""
        cfg = self.cfg
        if on_disk < self.replay_floor:
            return None, (f"no checkpoint since the rollback to step {on_disk}, and one from "
                          f"before it would train at its learning rate, not this one's x "
                          f"{st.lr_scale:g}")
        if st.horizon_by == "time or money left" and on_disk < st.decay_start:
            return None, (f"the learning rate's decay began at step {st.decay_start}, after the "
                          f"newest checkpoint, on the time or money then left, which a replay does "
                          f"not repeat")
        defaults = configurator.read_defaults(self.script)
        args = [f"--{k}={v}" for k, v in cfg.items()
                if v != defaults[k][0] and k not in REPLAY_DROPS]
        if on_disk < 0 and st.horizon < cfg.max_steps:  # the end the dropped budget keys had set
            args.append(f"--max_steps={st.horizon}")
        resume = os.path.join(self.ckpt_root, f"step_{on_disk:07d}") if on_disk >= 0 else "never"
        return [*args, f"--out_dir={cfg.out_dir.rstrip('/')}-replay-{st.step}",
                f"--resume={resume}", f"--stop_at_step={st.step}", "--log_every=1",
                f"--eval_every={cfg.max_steps}", f"--ckpt_every={cfg.max_steps}"], None

    def rolled_back(self, step, lr_scale):
        """The run rolled back to `step` at lr x lr_scale: the bad steps past it say so, and a
        replay starts from a checkpoint saved since."""
        self.replay_floor = step + 1
        for bad in self.bad_steps:
            if bad["step"] > step and bad["rolled_back_to"] is None:
                bad["rolled_back_to"] = step
                bad["action"] += f"; then the run rolled back to step {step} at lr x {lr_scale:g}"
