"""
Train a GPT on the shards that prepare.py writes: one process (CPU or one GPU), or under torchrun
(gloo on CPU, nccl on CUDA), data-parallel (dist_mode=ddp) or sharded by FSDP2 (dist_mode=fsdp, for
models DDP cannot fit).

    python train.py config/tiny.py
    python train.py config/a100_50m.py --max_steps=500 --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/h200_1b_ddp8.py
    torchrun --standalone --nproc_per_node=8 train.py config/h100_d64.py      # fsdp

Config: the globals below, overridden by config files and --key=val (--help). A run writes into
out_dir only. Step s trains on the same sequences at any world size, so the same command resumes
bit-identically; a signal or a guard stops every rank at one step boundary, with a checkpoint.
"""
import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from podgpt.core import configurator
from podgpt.core.checkpoint import find_checkpoint, tensor_bytes
from podgpt.core.data import bpb_scale, rarest_tokens, unigram_baseline
from podgpt.core.optim import make_optimizer, master_weights_on
from podgpt.core.schedule import Budget, Schedule
from podgpt.core.tokenizer import load_tokenizer
from podgpt.core.util import (Folder, autocast, catch_signals, dtype_name, fail, format_seconds,
                              log, on_rank0, peak_memory_gb, run_main, warn, write_json)
from podgpt.corpus.tasks import gsm8k_accuracy, gsm8k_problems
from podgpt.pod.batches import Batches
from podgpt.pod.checkpoints import Checkpoints, check_init_from, new_state, run_record
from podgpt.pod.checks import Checks
from podgpt.pod.dryrun import dryrun
from podgpt.pod.gates import long_run_gate
from podgpt.pod.guards import (LIMITS, LOSS_EMA_DECAY, BadSteps, Clock, Drills, Floor, agree,
                               restore_clock)
from podgpt.pod.launch import (build_model, check_config, check_writable, open_data, read_manifest,
                               set_up, wrap_model)
from podgpt.pod.memory import param_counts
from podgpt.pod.postmortem import PostMortem, bad_batch
from podgpt.pod.preflight import (finish_preflight, flops_per_token, model_config, peak_flops,
                                  plan_run, start_horizon, target_band)
from podgpt.pod.report import outcome, target_verdict, write_report
from podgpt.pod.runlog import RunLog
from podgpt.pod.step import clip_gradients
from podgpt.pod.trackers import Trackers, tracker_names

# --- config
# I/O
out_dir = "out"                 # metrics.jsonl, ckpt/, summary.json are written here
data_dir = "data/default"       # shards and manifest.json written by prepare.py
resume = "auto"                 # auto: newest good checkpoint in out_dir, if any | never | a folder
allow_resume_mismatch = False   # resume even from a checkpoint of other data or another tokenizer
init_from = ""                  # SFT: a fresh out_dir starts from this base checkpoint's weights
# model
block_size = 1024               # context length in tokens
n_layer = 12                    # transformer blocks
n_head = 12                     # query heads
n_kv_head = 12                  # key/value heads; fewer than n_head is grouped-query attention
n_embd = 768                    # model width
ffn_hidden = None               # SwiGLU hidden size; None: 8 * n_embd / 3 rounded up to multiple_of
multiple_of = 256               # Llama's rounding of that default: whole tensor-core tiles
vocab_size = None               # None: the data's vocabulary (manifest.json); a number must match
tie_embeddings = True           # share the input embedding with the output head
rope_theta = 10000.0            # RoPE base
vocab_multiple = 64             # pad the vocabulary to a multiple of this (faster matmuls)
init_std = 0.02                 # std of the normal init (residual projections / sqrt(2 * n_layer))
objective = "ar"                # ar: next-token prediction | a module of podgpt/research/
eval_gsm8k_samples = 0          # gsm8k data: greedy answers to this many test problems at each eval
# speed and memory: none changes what a step computes, beyond rounding (a resume may change them)
attn_backend = "auto"           # auto | fa3 fa2 cudnn flash efficient flex math sdpa fa4
doc_mask = False                # attention stays inside each document (BOS starts one)
grad_ckpt = "none"              # activation checkpointing: none | full | selective
loss_chunk = 8192               # tokens per chunk of the loss (no batch-wide fp32 logits); 0: off
fused_loss = True               # the loss chunks make the head's gradients in the forward: 1 matmul
residual_dtype = "auto"         # the residual stream: auto (bf16 under bf16) | float32 | bfloat16
fuse_projections = False        # q/k/v and gate/up each one matmul in training (fp8: one cast)
# batch
micro_batch_size = 8            # sequences per GPU per forward/backward
total_batch_tokens = 524288     # tokens per optimizer step over all GPUs (sets accumulation)
max_steps = 1000                # optimizer steps at most (the budget may end the schedule sooner)
# optimizer and schedule: warmup, then cosine (or wsd) from learning_rate to min_lr at the horizon
optimizer = "adamw"             # adamw | muon: Muon for the blocks' matrices, AdamW for the rest
learning_rate = 3e-4            # peak learning rate; muon: each group at lr x its own peak / this
min_lr = 3e-5                   # final learning rate
warmup_steps = 100              # linear warmup steps
lr_schedule = "cosine"          # cosine | wsd: flat, then linear to min_lr over the last decay_frac
decay_frac = 0.2                # wsd: the decay's share (sooner when what is left pays no more)
matrix_lr = 0.02                # muon: Muon's peak learning rate for the blocks' matrices
embedding_lr = 4e-3             # muon: AdamW's peak for the embedding, untied head and norms
muon_momentum = 0.95            # muon: Muon's Nesterov momentum
weight_decay = 0.1              # AdamW's, on matrices only (muon: only an untied head)
beta1 = 0.9                     # AdamW beta1
beta2 = 0.95                    # AdamW beta2
grad_clip = 1.0                 # clip the global gradient norm to this; 0 disables
master_weights = False          # bf16 parameters, AdamW on fp32 masters: True | auto (bf16 ddp)
# evaluation, logging, checkpoints
eval_every = 250                # steps between validation evaluations (and one at the end)
eval_steps = 20                 # validation micro-batches per rank per evaluation
log_every = 10                  # steps between metrics.jsonl lines and console lines
ckpt_every = 1000               # steps between checkpoints (and one at the end)
ckpt_every_minutes = 0.0        # also a checkpoint this many minutes after the last one; 0: off
keep_last = 3                   # newest checkpoints kept (at least 1), besides the best one
save_best = True                # also checkpoint at every new best validation loss (ckpt/best)
plots = True                    # draw plots/*.png into the run report at every evaluation
early_stop_patience = 0         # stop after this many evaluations without a new best; 0: never
target_val_loss = None          # the run's aim: a final val loss at most this, or within "lo,hi"
ckpt_min_free_gb = 1.0          # skip a checkpoint, with a warning, that would leave less disk free
ckpt_async = True               # write checkpoints in the background (the loop waits for a copy)
# watching a run: every metrics line mirrored, as it is written, from rank 0 (pod/trackers.py)
log_to = ""                     # trackers, comma-separated: tensorboard | wandb | mlflow; "": none
run_name = ""                   # the run's name in the trackers; "": out_dir
run_tags = ""                   # the run's tags in the trackers, comma-separated
wandb_project = "podgpt"        # Weights & Biases project (WANDB_API_KEY or `wandb login`)
mlflow_experiment = "podgpt"    # MLflow experiment, at MLFLOW_TRACKING_URI (unset: ./mlflow.db)
verbose = False                 # print the long notes too (the attention kernels skipped and why)
# guards: each stops the run before its limit is crossed (checkpoint, summary.json, exit 0)
max_hours = 0.0                 # wall-clock limit, resumed time included; 0: none
budget_usd = 0.0                # spending cap in dollars; 0: none
usd_per_gpu_hour = 0.0          # price of one GPU-hour; spend = wall clock x GPUs x this
budget_file = ""                # JSON kept current outside: {"spent_usd", "projected_total_usd"}
budget_check_minutes = 30.0     # how often budget_file is read
budget_warn_usd = 0.0           # a budget_warning once the spend passes this; 0: 85% of the cap
usd_fixed = 0.0                 # dollars counted from the start beside GPU-hours (egress, say)
storage_gb = 0.0                # a disk billed while the run lasts (at usd_per_gb_month)
usd_per_gb_month = 0.0          # the disk's price per GB-month, billed by the hour (1/730)
max_usd_per_gpu_hour = 0.0      # spot ceiling: a usd_per_gpu_hour above it refuses; 0: none
dry_run_budget = False          # print the spend line by line, and budget_file's verdict; no run
min_tokens_per_sec = 0.0        # throughput floor: a slower first window stops the run; 0: none
floor_window_minutes = 60.0     # the floor's window, from the first step of each start
fit_budget = True               # the horizon is what the budget pays for; False: it blocks
# loss spikes and non-finite steps
spike_factor = 2.5              # a loss above this x the EMA of recent losses is a spike (logged)
max_bad_steps = 10              # bad steps in a row before a rollback to the last checkpoint
max_rollbacks = 3               # rollbacks allowed before the run stops as diverged
inject_spike_at_step = -1       # fire drill: steps N..N+4 train on the rarest tokens; -1: off
inject_nan_at_step = -1         # fire drill: steps N..N+4 get a NaN loss on the last rank; -1: off
inject_slow_at_step = -1        # fire drill: from step N each step sleeps (below); -1: off
inject_slow_seconds = 0.0       # the sleep of inject_slow_at_step
stop_at_step = 0                # stop (checkpoint, exit 0) after this step (replays); 0: off
# the run's own checks (pod/checks.py): what its recipe calls done, with target_val_loss, judged at
# every evaluation and at the end (summary.json's checks: met, missed or not reached)
max_spikes = -1                 # done: at most this many loss spikes in the run; -1: not judged
warn_tokens_per_sec = 0.0       # tokens/s floor: an alarm event under it for alarm_minutes; 0: none
min_mfu = 0.0                   # MFU floor (a fraction), as warn_tokens_per_sec; 0: none
grad_norm_band = ""             # healthy grad norm "lo,hi" (median of 20 steps): an alarm outside
grad_norm_stop = 0.0            # that median over this stops the run, with a checkpoint; 0: none
alarm_minutes = 10.0            # how long a floor or band stays crossed before its alarm event
# preflight: gates checked before any step is paid for (out_dir/preflight.json and .md)
preflight_only = False          # write the preflight report and exit: 1 if a gate blocks, else 0
dryrun_steps = 0                # dry run: N steps, the last N/2 again from a resume; dryrun.json
dryrun_stage_steps = 20         # run.sh's dryrun stage: its dryrun_steps unless DRYRUN_STEPS is set
dryrun_sft = ""                 # dry run: then one SFT step, this config, on pack_dir's sft.jsonl
gate_profile = "research"       # research | release | skill_release: what the gates demand
pack_dir = ""                   # the skills pack the run is judged with (SFT rows, eval rows)
allow_unsafe = False            # train even when a gate blocks (each block becomes a warning)
max_epochs = 0                  # corpus_model_fit blocks above this many passes; 0: the profile's
lr_base = 0.0                   # lr_scaling warns far from lr_base x sqrt(batch / lr_base_batch)
lr_base_batch = 128             # sequences per optimizer step at which lr_base was tuned
expect_world_size = 0           # ranks this config is written for; 0: any
gpu_mem_gb = 0.0                # GPU memory to plan with; 0: the GPU in use (no memory gate on CPU)
plan_gpu = ""                   # GPU to plan time with when not on it, e.g. "H100 PCIe"
planned_mfu = 0.0               # plan time and cost at this fraction of plan_gpu's bf16 peak
planned_tokens_per_sec = 0.0    # or at this throughput; both 0: measured by a few timed steps here
plan_vocab_size = 0             # vocabulary to plan with before data_dir is prepared
# system; dist_mode: parallelism under torchrun (fsdp also runs as one process)
dist_mode = "ddp"               # ddp: each GPU holds the model and AdamW | fsdp: FSDP2 shards them
ddp_timeout_minutes = 30.0      # a hung rank fails the others' collectives after this (env wins)
seed = 1337                     # model init and data order
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N
dtype = "auto"                  # auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float16 | float32
compile = False                 # torch.compile the model
compile_mode = "default"        # torch.compile mode: default | reduce-overhead | max-autotune
fp8 = False                     # float8 matmuls (torchao): capability 8.9+, compile, bfloat16
fp8_head = False                # fp8: the LM head in float8 too (its loss then unfused)
fp8_recipe = "tensorwise"       # fp8: torchao's scales, tensorwise | rowwise (its own size rule)
matmul_precision = "high"       # CUDA fp32 matmuls: high lets them use TF32 tensor cores | highest
# --- end config


def release_gates(pack_dir):
    """podgpt/release/gates.py for a run judged with a skills pack: pretraining never loads it."""
    if not pack_dir:
        return None
    from podgpt.release import gates
    return gates


# -----------------------------------------------------------------------------
# the loop

class Trainer:
    """The training loop; all a resumed run needs to go on exactly is in `state` (checkpointed)."""

    def __init__(self, cfg, proc, dt, grad_accum, data, model, raw_model, optimizer, ckpts, state,
                 stop_signal, t_start):
        self.cfg, self.proc, self.grad_accum = cfg, proc, grad_accum
        self.autocast = autocast(proc.dev, dt)
        self.manifest, self.train_data, self.val_data = data
        self.model, self.raw_model, self.optimizer, self.ckpts = model, raw_model, optimizer, ckpts
        self.state, self.stop_signal, self.sharded = state, stop_signal, cfg.dist_mode == "fsdp"
        self.scaler = torch.amp.GradScaler(enabled=dt == torch.float16)
        self.schedule = Schedule.of(cfg)
        self.bpb_scale = bpb_scale(self.manifest["splits"]["val"])
        # until a save is measured: the fsyncs, and weights + AdamW's 2 moments at 200 MB/s
        save_s = 0.5 + 3 * tensor_bytes(raw_model.state_dict()) / 200e6
        budget = Budget.of(cfg)
        self.clock = Clock(state, t_start, budget, self.schedule, budget.usd_per_s(proc.world),
                           save_s, Floor(cfg.min_tokens_per_sec, cfg.floor_window_minutes,
                                         cfg.total_batch_tokens))
        self.drills = Drills(cfg.inject_spike_at_step, cfg.inject_nan_at_step,
                             cfg.inject_slow_at_step, cfg.inject_slow_seconds)
        counts, master = os.path.join(cfg.data_dir, self.manifest["token_counts"]), proc.rank == 0
        self.rare = rarest_tokens(np.load(counts)) if cfg.inject_spike_at_step >= 0 else None
        self.batches = Batches(cfg, proc, self.train_data, self.rare, grad_accum)
        trackers = Trackers(cfg, state.step) if master and tracker_names(cfg.log_to) else None
        gpu = torch.cuda.get_device_name(proc.dev) if proc.dev.type == "cuda" else None
        self.log = RunLog(cfg.out_dir, state.step, master, trackers,
                          lambda: ckpts.on_disk, raw_model, cfg.total_batch_tokens,
                          flops_per_token(raw_model.config), gpu and peak_flops(gpu) * proc.world)
        self.postmortem = PostMortem(cfg, __file__, proc.world, ckpts.root, state.step,
                                     LOSS_EMA_DECAY) if master else None
        self.bad = BadSteps(cfg.spike_factor, cfg.max_bad_steps, cfg.max_rollbacks, self.event,
                            self.postmortem, lambda: self.log.postmortem(self.postmortem))
        self.problems = gsm8k_problems(cfg.data_dir, self.manifest, cfg.eval_gsm8k_samples) \
            if cfg.eval_gsm8k_samples else None
        self.checks = Checks(cfg, self.event)
        self.diverged, self.last_loss = None, None
        self.val_stats = None  # the objective's numbers of the last evaluation, if it has any
        self.save_due = False  # the ranks agreed: ckpt_every_minutes have passed

    def loop(self):
        """Train until the horizon, a stop or divergence: (the stop reason, the last val loss)."""
        cfg, st, proc = self.cfg, self.state, self.proc
        self.clock.tick()
        reason = self.guard() if proc.rank == 0 else None  # a resumed run may be past a limit
        # a signal during the startup stops the run here, before a step it did not want
        reason = agree(proc, torch.zeros(1, device=proc.dev), True, self.stop_signal, reason)[2]
        if not reason and cfg.stop_at_step and st.step >= cfg.stop_at_step:
            reason = "stop_at_step"
        if reason:
            log(f"not training: {reason} already reached at step {st.step}")
        val_loss = None
        while st.step < st.horizon and not reason:
            reason = self.step()
            if not reason and st.step == cfg.stop_at_step:
                reason = "stop_at_step"
            new_best, val_loss = False, None
            if reason is None and (st.step % cfg.eval_every == 0 or st.step == st.horizon):
                val_loss, new_best = self.validate()
                if cfg.early_stop_patience and st.evals_since_best >= cfg.early_stop_patience:
                    reason = "early_stop"
            if reason == "budget_file_spent":
                break  # already over the cap: not one more byte or second
            # a periodic checkpoint waits for the end of a run of bad steps, so a rollback never
            # lands inside one
            if self.ckpts.due(st.step, st.horizon, new_best, bool(reason), st.bad_in_a_row,
                              self.save_due):
                self.clock.tick()
                self.checkpoint(val_loss, new_best)
            if not reason and st.bad_in_a_row >= cfg.max_bad_steps:
                self.diverged = self.bad.rollback(st, self.ckpts)
                self.log.restart(st.step)
                reason = "diverged" if self.diverged else None
            self.saved()  # a background save that has ended: reported (or its error raised) now
        return reason or ("max_steps" if st.horizon >= cfg.max_steps else "horizon"), val_loss

    def step(self):
        """One optimizer step over the global batch: the stop reason the ranks agreed, or None."""
        cfg, proc, st = self.cfg, self.proc, self.state
        t_step = time.time()
        lr, base_lr = self.set_lr()
        spike_drill, nan_drill = self.drills.pick(st)
        loss_sum, stats = self.forward_backward(spike_drill, nan_drill)
        grad_norm, finite = clip_gradients(self.optimizer, self.scaler, self.raw_model,
                                           cfg.grad_clip, self.sharded, loss_sum)
        self.drills.slow_down(st.step)
        self.clock.tick()
        verdicts = (self.guard(), self.clock.decay_to(self.ckpts.writing), self.ckpts.time_due()) \
            if proc.rank == 0 else (None, 0, False)
        loss, finite, reason, decay_to, self.save_due, stats = agree(
            proc, loss_sum, finite, self.stop_signal, *verdicts, stats, self.grad_accum)
        if finite:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        st.step += 1
        st.samples += cfg.total_batch_tokens // cfg.block_size
        self.after_step(loss, finite, grad_norm, lr, base_lr, decay_to, spike_drill, nan_drill)
        self.clock.step_times.append(time.time() - t_step)
        if st.step % cfg.log_every == 0 or st.step == st.horizon:  # the speed's floors watched
            self.checks.speed(st, *self.log.step(st, loss, lr, grad_norm.item(), stats,
                                                 peak_memory_gb(proc.dev)))
        self.last_loss = loss
        return reason

    def set_lr(self):
        """(the step's learning rate: the schedule's x the rollbacks' scale, the schedule's); muon:
        each group at its own peak_lr, on the schedule's shape."""
        st = self.state
        base_lr = self.schedule.lr(st.step, st.horizon, st.decay_start, st.decay_lr)
        lr = base_lr * st.lr_scale
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["peak_lr"] / self.schedule.learning_rate if "peak_lr" in g else lr
        return lr, base_lr

    def forward_backward(self, spike_drill, nan_drill):
        """This rank's micro-steps: (their summed loss, the objective's summed stats or None)."""
        proc = self.proc
        loss_sum, stats_sum = torch.zeros((), device=proc.dev), None
        batch = self.batches.micro(self.state, 0, spike_drill)
        # the drill's batches count every target: equal micro-batches, as unmasked data's
        masked = self.train_data.masked and not spike_drill
        weights = self.batches.weights(self.state) if masked else None
        for micro in range(self.grad_accum):
            x, y = batch
            last = micro == self.grad_accum - 1
            # gradients are reduced across ranks once per step, after the last micro-step
            if self.sharded:
                self.raw_model.set_requires_gradient_sync(last)
            sync = self.sharded or not hasattr(self.model, "no_sync") or last
            with nullcontext() if sync else self.model.no_sync():
                with self.autocast:
                    # [1:] alone: with loss_chunk=0 a name for the logits would hold them through
                    # the backward
                    micro_loss, *stats = self.model(x, y)[1:]
                if nan_drill and proc.rank == proc.world - 1:
                    micro_loss = micro_loss * float("nan")
                if weights is not None:
                    micro_loss = micro_loss * weights[micro]
                self.scaler.scale(micro_loss / self.grad_accum).backward()
            loss_sum += micro_loss.detach()
            if stats:
                stats_sum = stats[0] if stats_sum is None else stats_sum + stats[0]
            if not last:  # read and copy the next one while the GPU still works on this one
                batch = self.batches.micro(self.state, micro + 1, spike_drill)
        return loss_sum, stats_sum

    def after_step(self, loss, finite, grad_norm, lr, base_lr, decay_to, spike_drill, nan_drill):
        """wsd's decay from the next step (linear to min_lr at step decay_to), the fire drill, a
        spike or non-finite step counted."""
        st, cfg = self.state, self.cfg
        if decay_to:
            planned = decay_to == st.horizon
            if not planned:
                st.horizon_by = "time or money left"
            st.decay_start, st.decay_lr, st.horizon = st.step, base_lr, decay_to
            why = "as planned" if planned else \
                "what max_hours or budget_usd leaves pays for no more"
            self.event("decay", f"the learning rate decays from {base_lr:.3g} to min_lr at step "
                       f"{decay_to} ({why})", horizon=decay_to, lr=base_lr)
        if spike_drill or nan_drill:
            self.event("drill", "fire drill: " + ("a batch of the rarest tokens" if spike_drill
                                                  else "a NaN loss on the last rank"),
                       drill="spike" if spike_drill else "nan")
        self.bad.account(st, loss, finite, grad_norm, lr, lambda: bad_batch(
            cfg, st, self.train_data, self.rare, load_tokenizer(cfg.data_dir)), self.ckpts.on_disk)
        self.checks.step(st, grad_norm)

    def guard(self):  # rank 0's: a stop reason (a guard's, or a check's stop band), or None
        return self.clock.stop_reason(self.ckpts.writing, self.event) or self.checks.stop_reason()

    # evaluation, checkpoints, events

    def evaluate(self):
        """The validation loss on all ranks; the objective's stats per micro-batch in val_stats."""
        cfg, proc = self.cfg, self.proc
        self.model.eval()
        with torch.no_grad(), self.autocast:
            sums = self.val_data.validation_sums(self.raw_model, cfg.eval_steps,
                                                 cfg.micro_batch_size, proc.rank, proc.world,
                                                 proc.dev)
        self.model.train()
        if proc.distributed:
            dist.all_reduce(sums)
        loss, *stats, counted = sums.tolist()
        self.val_stats = [v / (cfg.eval_steps * proc.world) for v in stats] or None
        return loss / max(counted, 1)

    def validate(self):
        """Evaluate, log it, let the objective check it: (validation loss, a new best?)."""
        cfg, st, t0 = self.cfg, self.state, time.time()
        val_loss = self.evaluate()
        self.clock.eval_seconds = time.time() - t0
        new_best = val_loss < st.best_val_loss
        if new_best:
            st.best_val_loss, st.best_step, st.evals_since_best = val_loss, st.step, 0
        else:
            st.evals_since_best += 1
        accuracy = None if not self.problems else gsm8k_accuracy(
            self.raw_model, self.problems, load_tokenizer(cfg.data_dir), cfg.block_size,
            self.autocast, self.proc, self.sharded)
        self.log.validation(st.step, val_loss, val_loss * self.bpb_scale, new_best, self.val_stats,
                            accuracy, len(self.problems or ()))
        if warning := self.val_stats and self.raw_model.check_validation(self.val_stats, st, cfg):
            self.event(warning[0], warning[1], **warning[2])
        self.checks.judge(val_loss, st.spikes, self.log.objective(self.val_stats))
        if self.proc.rank == 0:  # the live report: summary.md and plots/ as of this evaluation
            write_report(cfg.out_dir, cfg.plots, live=True)
        return val_loss, new_best

    def checkpoint(self, val_loss, best):
        st = self.state
        self.ckpts.save(dict(vars(st), tokens=st.step * self.cfg.total_batch_tokens,
                             val_loss=val_loss), best)

    def saved(self):
        """Log each save that reached the disk; the guards keep back the slowest for the last."""
        for record in self.ckpts.finished():
            self.clock.save_seconds = max(self.clock.save_seconds, record["written_s"])
            self.log.write({"step": record["step"], "event": "checkpoint", **record})

    def event(self, name, message, **fields):
        self.log.write(dict(step=self.state.step, event=name, **fields))
        warn(f"step {self.state.step}: {message}")

    def finish(self, reason, val_loss):
        """A last evaluation and save if the run completed, summary.json, the report: rank 0's
        summary (None elsewhere)."""
        st, cfg = self.state, self.cfg
        if reason in ("max_steps", "horizon"):
            if val_loss is None:  # resumed at the horizon
                val_loss = self.evaluate()
                if val_loss < st.best_val_loss:
                    st.best_val_loss, st.best_step = val_loss, st.step
            if self.ckpts.saved_step != st.step:
                self.checkpoint(val_loss, val_loss <= st.best_val_loss and cfg.save_best)
        self.ckpts.wait()  # the last save on disk before the summary names it and the run exits
        self.saved()
        self.clock.tick()
        if self.proc.rank != 0:
            return None
        summary = self.summary(reason, val_loss)
        try:
            write_json(os.path.join(cfg.out_dir, "summary.json"), summary)
        except OSError as e:  # no report either: it would be read from a summary.json not there
            self.log.close("failed", lambda: None)
            fail(self.ckpts.unwritten(st.step, os.path.join(cfg.out_dir, "summary.json"), e))
        self.log.clock(st)
        # summary.md, plots, metrics.csv, manifest.json (never raises), before the trackers close
        self.log.close(summary["status"], lambda: write_report(cfg.out_dir, cfg.plots))
        line = outcome(summary, cfg.max_steps, cfg.out_dir)
        if summary["status"] == "stopped" and self.ckpts.on_disk < 0:  # a signal before a step
            line = (f"stopped at step 0 (signal {summary['signal']}) before the first step: "
                    f"nothing was trained, so nothing is lost; the same command starts the run")
        if line:
            log(line)
        return summary

    def summary(self, reason, val_loss):
        """summary.json: how the run ended and what it measured, with its long-run gate."""
        st, cfg = self.state, self.cfg
        lost = self.ckpts.unsaved(st.step, reason)
        if self.ckpts.on_disk < 0 and self.ckpts.missed is None and reason in ("signal", *LIMITS):
            lost = self.clock.unsaved(reason)  # none tried: a stop before the first step or save
        status = ("failed" if lost or reason == "diverged" else
                  "completed" if reason in ("max_steps", "horizon", "early_stop") else "stopped")
        best, band = st.best_step >= 0, target_band(cfg.target_val_loss)
        summary = dict(
            status=status, stop_reason=reason,
            signal=self.stop_signal[0] if self.stop_signal else None, steps=st.step,
            horizon=st.horizon, horizon_by=st.horizon_by, lr_schedule=cfg.lr_schedule,
            decay_start=st.decay_start, tokens=st.step * cfg.total_batch_tokens,
            final_train_loss=self.last_loss, final_val_loss=val_loss,
            best_val_loss=st.best_val_loss if best else None,
            best_step=st.best_step if best else None,
            final_val_bpb=None if val_loss is None else val_loss * self.bpb_scale,
            unigram_val_loss=unigram_baseline(cfg.data_dir, self.manifest, self.val_data),
            target_val_loss=list(band) if band else None,
            target=target_verdict(band, status, val_loss), elapsed_s=st.elapsed,
            cost_usd=st.cost_usd, spikes=st.spikes, nonfinite_steps=st.nonfinite_steps,
            rollbacks=st.rollbacks, lr_scale=st.lr_scale,
            params=param_counts(self.raw_model.config), flops_per_token=self.log.flops_tok,
            world_size=self.proc.world, checkpoint=find_checkpoint(cfg.out_dir),
            best_checkpoint=find_checkpoint(cfg.out_dir, "best"), error=lost,
            **self.log.objective(self.val_stats if val_loss is not None else None, "final_val_"))
        summary["checks"] = self.checks.final(status, val_loss, st.spikes, self.log.objective(
            self.val_stats if val_loss is not None else None))
        summary["long_run_gate"] = long_run_gate(cfg, summary, release_gates(cfg.pack_dir))
        return summary


# -----------------------------------------------------------------------------
# the run

def configure(argv):
    cfg = configurator.configure(__file__, argv)
    check_config(cfg)
    return cfg


def start(cfg, proc, dt, grad_accum, folder):
    """Everything before the first step: the data, the plan and gates (preflight), the model, the
    optimizer, a resume, out_dir claimed: (the preflight report, unless preflight_only the rest)."""
    check_init_from(cfg)  # before the gates, which would count a base that is not there
    master = master_weights_on(cfg, dt)  # then its optimizer all-reduces the gradients, not DDP
    manifest = read_manifest(cfg.data_dir, cfg.vocab_size, planning=cfg.preflight_only)
    mconfig = model_config(cfg, manifest)
    data = open_data(cfg.data_dir, manifest, mconfig, cfg.seed)
    sharded = cfg.dist_mode == "fsdp"
    report, raw_model = plan_run(cfg, proc, dt, mconfig, data, lambda: build_model(
        mconfig, proc, dt, cfg.seed, cfg.fp8, cfg.compile, sharded, cfg.verbose, cfg.out_dir),
                                 release_gates(cfg.pack_dir))
    if cfg.preflight_only:
        return report, None
    optimizer = make_optimizer(raw_model, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                               cfg.weight_decay, fused=proc.dev.type == "cuda", kind=cfg.optimizer,
                               matrix_lr=cfg.matrix_lr, embedding_lr=cfg.embedding_lr,
                               momentum=cfg.muon_momentum, master=master,
                               compiled=cfg.compile)
    saved, files = run_record(cfg, mconfig, proc.world, grad_accum, manifest)
    ckpts = Checkpoints(cfg.out_dir, raw_model, optimizer, proc, sharded,
                        files if proc.rank == 0 else {}, cfg.ckpt_every, cfg.keep_last,
                        cfg.save_best, cfg.ckpt_min_free_gb, cfg.ckpt_async, cfg.ckpt_every_minutes)
    state = new_state(cfg)
    resumed = ckpts.resume(cfg.resume, saved, cfg.allow_resume_mismatch, cfg.data_dir, state,
                           cfg.init_from)
    if cfg.resume != "never":
        restore_clock(os.path.join(cfg.out_dir, "clock.json"), state)
    check_writable(cfg.out_dir, proc, folder, cfg, report)
    model = wrap_model(raw_model, proc, cfg.compile_mode if cfg.compile else None,
                       not (sharded or master))
    counts, (_, train_data, val_data) = param_counts(mconfig), data
    log(f"config: {configurator.changed(cfg, __file__)} (every key: "
        f"{os.path.join(cfg.out_dir, 'config.json')})")
    log(f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M "
        f"non-embedding), {flops_per_token(mconfig) / 1e9:.3f} GFLOP/token | data: "
        f"{manifest['tokenizer']}, {train_data.n:,} train and {val_data.n:,} validation windows | "
        f"world {proc.world} x micro {cfg.micro_batch_size} x accum {grad_accum} = "
        f"{cfg.total_batch_tokens} tokens/step | {proc.dev} {dtype_name(dt)}")
    if resumed:
        log(f"resumed from {resumed} at step {state.step} ({format_seconds(state.elapsed)} and "
            f"${state.cost_usd:.2f} so far)")
        # the schedule goes on to the horizon it had; one that was max_steps follows max_steps
        if state.horizon_by == "max_steps" or cfg.max_steps < state.horizon:
            state.horizon, state.horizon_by = cfg.max_steps, "max_steps"
    return report, (data, model, raw_model, optimizer, ckpts, state, resumed)


def train(cfg, keep_group=False):
    """One run: (exit status, rank 0's summary or None, this rank's activity). keep_group: leave the
    process group up for a second run in this process (the dry run)."""
    t_start = time.time()
    stop_signal = catch_signals()
    proc, dt, grad_accum = set_up(cfg.device, cfg.dist_mode == "fsdp", cfg.matmul_precision,
                                  cfg.dtype, cfg.micro_batch_size, cfg.block_size,
                                  cfg.total_batch_tokens, cfg.ddp_timeout_minutes)
    # out_dir is this run's alone: held before anything reads what an earlier run left
    with Folder(cfg.out_dir, "out_dir", legacy=("ckpt/latest",)) as folder:
        on_rank0(proc.distributed, folder.hold)
        report, run = start(cfg, proc, dt, grad_accum, folder)
        if run is None:
            on_rank0(proc.distributed, folder.claim)
            return finish_preflight(cfg, report, proc.rank == 0), None, None
        data, model, raw_model, optimizer, ckpts, state, resumed = run
        trainer = Trainer(cfg, proc, dt, grad_accum, data, model, raw_model, optimizer, ckpts,
                          state, stop_signal, t_start)
        if not resumed:  # the horizon the budget pays for, the startup so far spent
            state.horizon, state.horizon_by = start_horizon(
                cfg, proc, report["plan"].get("horizon", {}).get("tokens_per_sec"),
                time.time() - t_start, trainer.clock.save_seconds)
        reason, val_loss = trainer.loop()
        summary = trainer.finish(reason, val_loss)
        if proc.distributed:
            dist.barrier()  # together: a rank leaving while rank 0 still writes can abort
            if not keep_group:
                dist.destroy_process_group()
        if reason == "diverged":
            fail(f"{trainer.diverged} (summary in {cfg.out_dir}/summary.json)")
        if summary and summary["error"]:  # rank 0's: torchrun's job fails with it
            fail(summary["error"])
        return 0, summary, dict(rank=proc.rank, device=str(proc.dev), dtype=dtype_name(dt),
                                steps=state.step, samples=state.samples, elapsed_s=state.elapsed,
                                peak_mem_gb=peak_memory_gb(proc.dev), stop_reason=reason)


def main(argv):
    """A training run, a dry run or a preflight: the exit status."""
    cfg = configure(argv)
    if cfg.dryrun_steps:
        return dryrun(argv, cfg.dryrun_steps, cfg.out_dir,
                      lambda args: train(configure(args), keep_group=True),
                      (cfg.dryrun_sft, cfg.pack_dir) if cfg.dryrun_sft else None)
    Schedule.of(cfg).check_warmup(cfg.max_steps)  # not for a dry run: a long run's config, briefly
    cfg.preflight_only = cfg.preflight_only or cfg.dry_run_budget  # its plan, then no step
    return train(cfg)[0]


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
