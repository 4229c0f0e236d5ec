"""
Preflight: the gates a run passes before any GPU-hour is paid for (train.py, at every start: into
out_dir/preflight.json and .md), and the plan behind them (parameters, memory per GPU, hours and
dollars) from the model's config alone, the prepared data's manifest or a measurement here.
"""

import math
import os
import shutil
import time
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from podgpt.core.attention import resolve_backend
from podgpt.core.data import contamination, load_manifest
from podgpt.core.optim import master_weights_on
from podgpt.core.schedule import Budget, fit_horizon, step_seconds
from podgpt.core.util import (autocast, fail, first_line, format_bytes, log, mean_over_ranks, warn,
                              write_atomic, write_json)
from podgpt.pod.gates import (check_profile, gate, limits, no_pack_gates, release_token_budget,
                              verdict_of)
from podgpt.pod.memory import memory_estimate, param_counts
from podgpt.pod.objectives import config_class, config_fields, make_config
from podgpt.pod.report import target_text
from podgpt.pod.spend import print_spend, spend_lines

LR_SLACK = 1.5  # lr_scaling warns when learning_rate is off its rule by more than this, either way
LONG_RUN_TOKENS = 1e9  # the horizon's upper block applies to runs at least this long
MEMORY_USABLE = 0.92  # of a GPU's memory: the rest goes to the CUDA context, NCCL, fragmentation
MAX_MICRO_BATCH = 1024  # the micro-batch searches stop here
# Chinchilla's fit (Hoffmann et al. 2022, approach 3): L = E + A/N^alpha + B/D^beta nats/token on
# MassiveText, N all parameters, embeddings included (Pearce & Song 2024), D the training tokens
CHINCHILLA = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
# dense bf16 tensor-core peaks from NVIDIA's datasheets (the sparse figures are 2x these)
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12),
                   ("H100", 989e12), ("A100", 312e12))


# -----------------------------------------------------------------------------
# the model a config describes, by arithmetic: planning never allocates it

def plan_vocab(cfg, manifest=None):
    """(vocabulary, its source): vocab_size, else the prepared data's, else plan_vocab_size."""
    if cfg.vocab_size:
        return cfg.vocab_size, "vocab_size"
    if manifest is None and os.path.isfile(os.path.join(cfg.data_dir, "manifest.json")):
        manifest = load_manifest(cfg.data_dir)
    if manifest is not None:
        return manifest["vocab_size"], f"{cfg.data_dir}/manifest.json"
    if cfg.plan_vocab_size:
        return cfg.plan_vocab_size, "plan_vocab_size"
    fail(f"no data in {cfg.data_dir} to take the vocabulary from: prepare it, or set "
         f"plan_vocab_size (or vocab_size) to plan without it")


def model_config(cfg, manifest=None, **overrides):
    """The objective's model config from cfg's model keys, plan_vocab plus the objective's added
    ids, BOS as prepare.py numbers it (the last id; doc_mask needs it); `overrides` on top."""
    name = overrides.get("objective", cfg.get("objective", "ar"))
    kwargs = {k: cfg[k] for k in config_fields(name) if k in cfg}
    vocab = plan_vocab(cfg, manifest)[0]
    kwargs["bos_id"] = manifest["bos_id"] if manifest else vocab - 1
    kwargs["vocab_size"] = vocab + config_class(name).added_tokens
    try:
        return make_config(**dict(kwargs, **overrides))
    except ValueError as e:
        fail(f"{e}: change the model shape")


def flops_per_token(config, seq_len=None):
    """Training FLOPs per token: 6*N + 12*L*H*Q*T (PaLM's), per block application (one without
    gradients at a third), the head once per supervision step; config.stream copies of a row."""
    L, d, stream = config.n_layer, config.n_embd, config.stream
    T = (seq_len or config.block_size) * stream
    n_sup, with_grad, without = config.applications()
    layer = (param_counts(config)["non_embedding"] - d) // L  # a block's parameters
    attention = config.n_head * config.head_dim * T
    return (6 * (L * with_grad * n_sup * stream * layer + n_sup * (d + config.padded_vocab * d))
            + 12 * L * with_grad * n_sup * stream * attention
            + L * without * n_sup * (2 * layer + 4 * attention))


def peak_flops(device_name):
    """Datasheet dense bf16 FLOP/s of a GPU name; None if unknown (no MFU, not a wrong one)."""
    return next((f for key, f in PEAK_BF16_FLOPS if key.lower() in device_name.lower()), None)


def largest_fitting(fits, known, limit=MAX_MICRO_BATCH):
    """The largest micro-batch <= limit that fits(), given that `known` fits (0: none known)."""
    lo, hi, limit = known, max(2 * known, 1), max(limit, known)
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_layout(mconfig, mb, world, sharded, ckpt, cbytes, budget):
    """One layout's bytes per GPU, and with a budget: whether it fits, the largest that would."""
    estimate = partial(memory_estimate, mconfig, world_size=world, sharded=sharded,
                       activation_checkpointing=ckpt, compute_bytes=cbytes)
    parts = {k: v for k, v in estimate(mb).items() if k != "params"}  # a count, not bytes
    largest = largest_fitting(lambda m: estimate(m)["total"] <= budget, 0) if budget else None
    return dict(sharded=sharded, activation_checkpointing=ckpt, bytes=parts,
                gb={k: round(v / 1e9, 3) for k, v in parts.items()},
                fits=parts["total"] <= budget if budget else None, largest_micro_batch=largest)


def layout_label(cfg):
    return ("FSDP" if cfg.dist_mode == "fsdp" else "DDP") + (
        "" if cfg.grad_ckpt == "none" else f" + grad_ckpt={cfg.grad_ckpt}")


# -----------------------------------------------------------------------------
# the gates

def horizon_gate(cfg, counts):
    """compute_optimal_horizon: planned tokens per non-embedding parameter vs Chinchilla's 20."""
    tokens = cfg.max_steps * cfg.total_batch_tokens
    per_param = tokens / counts["non_embedding"]
    low, band, high = (limits(cfg.gate_profile)[f"horizon_{k}"]
                       for k in ("block_below", "warn_outside", "block_above"))
    ratio = per_param / 20
    blocked = (low and ratio < low) or (high and ratio > high and tokens >= LONG_RUN_TOKENS)
    verdict = "block" if blocked else "warn" if band and not band[0] <= ratio <= band[1] else "pass"
    return gate("compute_optimal_horizon", verdict, ratio, band or "-",
                f"{tokens / 1e9:.3g}B tokens = {tokens / counts['total']:.1f} per parameter "
                f"({counts['total'] / 1e9:.3g}B), {per_param:.1f} per non-embedding parameter "
                f"({counts['non_embedding'] / 1e9:.3g}B) = {ratio:.2f}x Chinchilla's 20",
                f"max_steps={round(20 / per_param * cfg.max_steps):,} is 20 per non-embedding "
                "parameter, or gate_profile=research for a run not meant for release")


def lr_scaling_gate(cfg):
    """lr_scaling: learning_rate against block diffusion's rule, lr_base x sqrt(batch in sequences);
    a warning outside LR_SLACK (its recipe's 5e-4 at 512, 7e-4 at 1024 are within 18% of it)."""
    if not cfg.lr_base:
        return gate("lr_scaling", "skip", cfg.learning_rate, None,
                    "lr_base=0: no rule to hold learning_rate to")
    batch = cfg.total_batch_tokens // cfg.block_size
    rule = cfg.lr_base * math.sqrt(batch / cfg.lr_base_batch)
    ratio = cfg.learning_rate / rule
    far = not 1 / LR_SLACK <= ratio <= LR_SLACK
    return gate("lr_scaling", "warn" if far else "pass", cfg.learning_rate, rule,
                f"learning_rate={cfg.learning_rate:g} is {ratio:.2f}x lr_base x sqrt(batch / "
                f"lr_base_batch) = {cfg.lr_base:g} x sqrt({batch} / {cfg.lr_base_batch}) = "
                f"{rule:.3g}" + (f": outside 1/{LR_SLACK:g}..{LR_SLACK:g}x, set learning_rate="
                                 f"{rule:.3g} (or lr_base=0 to check nothing)" if far else ""))


def data_gates(cfg, manifest):
    """corpus_model_fit (epochs of the unique training tokens), contamination, tokenizer_vocab."""
    if manifest is None:
        return [gate(name, "skip", None, None, f"no data prepared in {cfg.data_dir} yet")
                for name in ("corpus_model_fit", "contamination", "tokenizer_vocab")]
    tokens = cfg.max_steps * cfg.total_batch_tokens
    unique, vocab = manifest["splits"]["train"]["tokens"], manifest["vocab_size"]
    limit = cfg.max_epochs or limits(cfg.gate_profile)["epochs_block_above"]
    epochs = tokens / unique
    shared, val_docs = contamination(cfg.data_dir, manifest)
    ok = cfg.vocab_size is None or cfg.vocab_size == vocab
    fit = "block" if epochs > limit else "warn" if epochs > 1 else "pass"
    return [gate("corpus_model_fit", fit, epochs, limit,
                 f"{tokens / 1e9:.3g}B planned tokens over {unique / 1e9:.3g}B unique training "
                 f"tokens = {epochs:.2f} epochs (warn above 1, block above {limit}" + (
                     "" if epochs <= limit else f": fewer max_steps, more data, or max_epochs="
                     f"{math.ceil(epochs)} where that many passes are the plan") + ")"),
            gate("contamination", "block" if shared else "pass", shared, 0,
                 f"{shared} training documents are also validation documents" if shared else
                 f"no training document among the {val_docs} validation documents"),
            gate("tokenizer_vocab", "pass" if ok else "block", cfg.vocab_size or vocab, vocab,
                 f"{cfg.data_dir}: {manifest['tokenizer']}, {vocab} tokens" + (
                     "" if ok else f"; the model is set to vocab_size={cfg.vocab_size}: set "
                     f"vocab_size=None or prepare matching data"))]


def memory_gate(cfg, mconfig, world, mem_gb, dtype_bytes, master):
    """memory_fit: this run's bytes per GPU against the usable memory; remedies when it is over."""
    sharded = cfg.dist_mode == "fsdp"
    def total(mb=cfg.micro_batch_size, shard=sharded, ckpt=cfg.grad_ckpt):
        return memory_estimate(mconfig, mb, world, sharded=shard, activation_checkpointing=ckpt,
                               compute_bytes=dtype_bytes, master=master)["total"]
    need, usable = total(), mem_gb * 1e9 * MEMORY_USABLE
    detail = (f"{layout_label(cfg)}: {need / 1e9:.1f} GB per GPU of {usable / 1e9:.1f} usable "
              f"({mem_gb:g} GB x {MEMORY_USABLE})")
    if need <= usable:
        return gate("memory_fit", "warn" if need > 0.85 * usable else "pass", need, usable, detail)
    # the first that fits of each: a micro-batch halved (up to 11 times), more checkpointing
    halves = [mb for mb in (cfg.micro_batch_size >> k for k in range(1, 12)) if mb >= 1]
    remedies = [f"micro_batch_size={mb} (gradient accumulation keeps total_batch_tokens)"
                for mb in halves if total(mb) <= usable][:1]
    remedies += [f"grad_ckpt={ckpt}" for ckpt in ("selective", "full")
                 if cfg.grad_ckpt not in (ckpt, "full") and total(ckpt=ckpt) <= usable][:1]
    best = total(shard=True, ckpt="full")
    if not sharded and best <= usable:
        remedies.append(f"dist_mode=fsdp + grad_ckpt=full across {world} GPUs: "
                        f"{best / 1e9:.1f} GB per GPU")
    fix = "; or ".join(remedies) or (f"more GPUs or a smaller model (FSDP + grad_ckpt=full across "
                                     f"{world} GPUs still needs {best / 1e9:.1f} GB per GPU)")
    return gate("memory_fit", "block", need, usable, f"{detail}: does not fit; use {fix}")


def disk_gate(cfg, counts, free_disk):
    """checkpoint_disk: the checkpoints kept (fp32 weights, AdamW's moments) against free disk."""
    ckpt_bytes = 12 * counts["total"]
    need = ckpt_bytes * (cfg.keep_last + (1 if cfg.save_best else 0))
    detail = (f"{cfg.keep_last}{' + best' if cfg.save_best else ''} checkpoints of "
              f"{format_bytes(ckpt_bytes)} = {format_bytes(need)}")
    if free_disk is None:
        return gate("checkpoint_disk", "skip", need, None,
                    f"{detail}: planning for another machine")
    verdict = "block" if need > free_disk else "warn" if need > 0.8 * free_disk else "pass"
    return gate("checkpoint_disk", verdict, need, free_disk,
                f"{detail} against {format_bytes(free_disk)} free")


def world_gate(cfg, world, launched):
    if launched != world:
        return gate("world_size", "skip", launched, world,
                    f"planning for {world} ranks from {launched}")
    expect = cfg.expect_world_size
    wrong = expect and expect != world
    return gate("world_size", "block" if wrong else "pass", world, expect or "any",
                f"launched {world} ranks" + (f", the config expects {expect}: launch "
                                             f"--nproc_per_node={expect}" if wrong else ""))


def attention_gate(cfg, mconfig, runtime):
    """attention_backend_runtime: attn_backend runs on runtime, (device, dtype); None: elsewhere."""
    name = "attention_backend_runtime"
    if runtime is None:
        return gate(name, "skip", cfg.attn_backend, None, "planned from another machine: "
                    "sanity.py on the pod checks the kernels")
    try:
        chosen, note = resolve_backend(cfg.attn_backend, *runtime, mconfig.head_dim,
                                       mconfig.mask_kind)
        return gate(name, "pass", chosen, None, note)
    except ValueError as e:
        return gate(name, "block", cfg.attn_backend, None, first_line(e))


def step_time(cfg, tokens_per_sec, world):
    """A step's seconds at tokens_per_sec on `world` ranks, its share of evaluations included."""
    batch = cfg.total_batch_tokens
    accum = batch / (cfg.micro_batch_size * cfg.block_size * world)
    return step_seconds(tokens_per_sec, batch, accum, cfg.eval_steps, cfg.eval_every)


def planned_horizon(cfg, tokens_per_sec, world, spent_s=0.0, reserve_s=0.0):
    """schedule.fit_horizon of this run at tokens_per_sec on `world` ranks, after spent_s."""
    step_s = step_time(cfg, tokens_per_sec, world)
    budget = Budget.of(cfg)
    usd_per_s = budget.usd_per_s(world)
    return fit_horizon(cfg.max_steps, budget, step_s, usd_per_s, spent_s,
                       budget.usd_fixed + spent_s * usd_per_s, reserve_s)


def start_horizon(cfg, proc, tokens_per_sec, spent_s, reserve_s):
    """A new run's (horizon, what sets it), rank 0's for every rank: with fit_budget, what max_hours
    and budget_usd pay for after the startup's spent_s, less reserve_s for a last eval and save."""
    fitted = [(cfg.max_steps, "max_steps")]
    if cfg.fit_budget and tokens_per_sec and proc.rank == 0:
        fitted = [planned_horizon(cfg, tokens_per_sec, proc.world, spent_s, reserve_s)]
    if proc.distributed:
        dist.broadcast_object_list(fitted)
    horizon, by = fitted[0]
    if horizon < cfg.max_steps:
        log(f"horizon: {by} pays for {horizon:,} of max_steps={cfg.max_steps:,} steps at "
            f"{tokens_per_sec:,.0f} tokens/s: the {cfg.lr_schedule} schedule ends there")
    return horizon, by


def target_band(value):
    """target_val_loss as (low, high): a number x is (None, x), met at or below x; "lo,hi" (or the
    pair --target_val_loss=3.2,3.5 parses to) met within, ends included; None for None or ""."""
    if value is None or value == "":
        return None
    parts = (value.split(",") if isinstance(value, str) else
             value if isinstance(value, (tuple, list)) else [value])
    try:
        nums = [float(p) for p in parts if not isinstance(p, bool)]
    except (TypeError, ValueError):
        nums = []
    if not (len(nums) == len(parts) and len(nums) in (1, 2)
            and all(math.isfinite(x) and x > 0 for x in nums) and nums == sorted(set(nums))):
        raise ValueError(f"target_val_loss={value!r} is neither a loss nor a band: give a number "
                         f"(the final validation loss at most that) or \"lo,hi\" with 0 < lo < hi "
                         f"(within it, e.g. \"3.20,3.50\")")
    return (None, nums[0]) if len(nums) == 1 else tuple(nums)


def check_gate_settings(cfg):
    """Refuse (exit 2) an unknown gate_profile or target_val_loss."""
    check_profile(cfg.gate_profile)
    try:
        target_band(cfg.target_val_loss)
    except ValueError as e:
        fail(str(e), 2)


def loss_gate(cfg, plan, manifest):
    """predicted_loss: CHINCHILLA's fit against target_val_loss; a warning at most (other data)."""
    band = target_band(cfg.target_val_loss)
    target = target_text(band) if band else None
    tokenizer = manifest["tokenizer"] if manifest else None
    if cfg.objective != "ar" or tokenizer in ("byte", "char"):
        why = (f"objective={cfg.objective}'s loss is not next-token cross-entropy"
               if cfg.objective != "ar" else
               f"nats per {tokenizer} token are not comparable to its subword tokens'")
        return gate("predicted_loss", "skip", None, target,
                    f"Chinchilla's fit does not apply: {why}")
    horizon = plan.get("horizon")  # what the budget pays for, else what max_steps plans
    d = horizon["steps"] * cfg.total_batch_tokens if horizon else plan["planned_tokens"]
    n, c = plan["params"]["total"], CHINCHILLA
    loss = c["E"] + c["A"] / n ** c["alpha"] + c["B"] / d ** c["beta"]
    detail = (f"Chinchilla's fit (Hoffmann et al. 2022, approach 3) E + A/N^alpha + B/D^beta = "
              f"{c['E']} + {c['A']}/N^{c['alpha']} + {c['B']}/D^{c['beta']} at N = {n / 1e9:.3g}B "
              f"parameters (embeddings included, as the fit counts them) and D = {d / 1e9:.3g}B "
              f"planned tokens: {loss:.2f} nats/token, indicative only (fitted in the tokens of "
              f"Chinchilla's tokenizer on MassiveText; this data: "
              f"{tokenizer or 'not prepared yet'})")
    if band is None:
        return gate("predicted_loss", "skip", loss, None,
                    f"{detail}; no target_val_loss to compare it with")
    within = (band[0] is None or band[0] <= loss) and loss <= band[1]
    return gate("predicted_loss", "pass" if within else "warn", loss, target,
                f"{detail}: {'within' if within else 'outside'} target_val_loss ({target})")


# -----------------------------------------------------------------------------
# the report

def refuse(cfg, blocks):
    """Stop on blocking gates, unless allow_unsafe (a warning each) or preflight_only (reported)."""
    if blocks and not cfg.allow_unsafe and not cfg.preflight_only:
        fail("preflight blocks: " + "; ".join(f"{g['name']}: {g['detail']}" for g in blocks)
             + " (or allow_unsafe=True to train anyway)")
    for g in blocks if cfg.allow_unsafe else []:
        warn(f"preflight gate {g['name']} blocks, allow_unsafe=True goes on: {g['detail']}")


def gates_report(cfg, proc, mconfig, manifest, dt, release=None):
    """{profile, gates, plan} of the gates needing no model on the device, from rank 0 to every
    rank; a block stops the run. release: podgpt/release/gates.py (a skills pack) or None."""
    report = [None]
    if proc.rank == 0:
        world, here = plan_world(cfg, proc), not planning(cfg, proc)
        mem_gb = cfg.gpu_mem_gb or (torch.cuda.get_device_properties(proc.dev).total_memory / 1e9
                                    if proc.dev.type == "cuda" else 0)
        counts, dtype_bytes = param_counts(mconfig), dt.itemsize
        master = master_weights_on(cfg, dt)
        if dt == torch.float16 and mconfig.residual_dtype == "auto":  # auto's stream: fp32
            mconfig = replace(mconfig, residual_dtype="float32")
        pack_gates = release.pack_gates if release else no_pack_gates
        gates = [release_token_budget(cfg, counts["total"]), horizon_gate(cfg, counts),
                 *data_gates(cfg, manifest), *pack_gates(cfg, counts["total"], manifest),
                 lr_scaling_gate(cfg),
                 memory_gate(cfg, mconfig, world, mem_gb, dtype_bytes, master) if mem_gb else
                 gate("memory_fit", "skip", None, None,
                      "not on a GPU: give gpu_mem_gb to plan for one"),
                 disk_gate(cfg, counts, free_disk(cfg.out_dir) if here else None),
                 world_gate(cfg, world, proc.world),
                 attention_gate(cfg, mconfig, (proc.dev, dt) if here else None)]
        tokens = cfg.max_steps * cfg.total_batch_tokens
        plan = dict(params=counts, flops_per_token=flops_per_token(mconfig), planned_tokens=tokens,
                    tokens_per_param=tokens / counts["non_embedding"], dist_mode=cfg.dist_mode,
                    grad_ckpt=cfg.grad_ckpt)
        for key, sharded, ckpt in (("memory", cfg.dist_mode == "fsdp", cfg.grad_ckpt),
                                   ("memory_ddp", False, "none"), ("memory_sharded", True, "full")):
            plan[key] = memory_estimate(mconfig, cfg.micro_batch_size, world, sharded=sharded,
                                        activation_checkpointing=ckpt, compute_bytes=dtype_bytes,
                                        master=master)
        report = [dict(profile=cfg.gate_profile, gates=gates, plan=plan)]
    if proc.distributed:
        dist.broadcast_object_list(report)
    report = report[0]
    refuse(cfg, [g for g in report["gates"] if g["verdict"] == "block"])
    for g in report["gates"] if proc.rank == 0 else []:  # a learning rate off its rule, said first
        if g["name"] == "lr_scaling" and g["verdict"] == "warn":
            warn(f"preflight: {g['detail']}")
    return report


def plan_time(cfg, proc, report, tokens_per_sec, source):
    """time_and_cost at a known throughput (else a skip): hours, dollars, and where max_hours or
    budget_usd end the schedule (fit_budget: the horizon) or would stop the run early (a block)."""
    if not tokens_per_sec:
        if cfg.preflight_only:
            report["gates"].append(gate("time_and_cost", "skip", None, None,
                                        "give planned_mfu (and plan_gpu) or planned_tokens_per_sec "
                                        "to plan another machine's time"))
        return
    world = plan_world(cfg, proc)
    hours = cfg.max_steps * cfg.total_batch_tokens / tokens_per_sec / 3600
    usd = Budget.of(cfg).lines(hours, world, "")[-1][2]
    detail = (f"{tokens_per_sec:,.0f} tokens/s ({source}): {hours:.2f} h"
              + (f", ${usd:,.0f}" if cfg.usd_per_gpu_hour else ""))
    steps, by = planned_horizon(cfg, tokens_per_sec, world)
    report["plan"]["horizon"] = dict(steps=steps, by=by, tokens_per_sec=tokens_per_sec,
                                     source=source, world=world,
                                     hours=steps * step_time(cfg, tokens_per_sec, world) / 3600)
    limit = cfg.max_hours or cfg.budget_usd
    if by == "max_steps":
        verdict, limit = "pass", cfg.max_hours or None
    elif cfg.fit_budget:
        verdict, detail = "pass", (f"{detail}: {by} pays for {steps:,} of max_steps="
                                   f"{cfg.max_steps:,}: the horizon, where the schedule ends "
                                   f"({cfg.lr_schedule} to min_lr)")
    else:
        verdict, detail = "block", (f"{detail}: {by} stops it near step {steps:,} of "
                                    f"{cfg.max_steps:,}, before the schedule ends: lower max_steps "
                                    f"to ~{steps}, or fit_budget=True to end the schedule there")
    report["gates"].append(gate("time_and_cost", verdict, hours, limit, detail))


def planning(cfg, proc):
    """Planning from a CPU for a GPU pod: no local disk, kernels or speed count."""
    return cfg.preflight_only and bool(cfg.gpu_mem_gb) and proc.dev.type != "cuda"


def plan_world(cfg, proc):
    """The world size planned for: the config's when planning a pod from one process, else this."""
    if planning(cfg, proc) and not proc.torchrun and cfg.expect_world_size:
        return cfg.expect_world_size
    return proc.world


def free_disk(path):
    """Free bytes on the disk that holds path (or would: its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def planned_speed(cfg, proc, mconfig):
    """(tokens/s, its source) from planned_tokens_per_sec or planned_mfu; (0, None): measure it."""
    if cfg.planned_tokens_per_sec:
        return cfg.planned_tokens_per_sec, "planned_tokens_per_sec"
    if not cfg.planned_mfu:
        return 0, None
    gpu = cfg.plan_gpu or (torch.cuda.get_device_name(proc.dev) if proc.dev.type == "cuda" else "")
    peak = peak_flops(gpu) if gpu else None
    if peak is None:
        fail("planned_mfu needs a known GPU's peak: set plan_gpu to one of H200, H100 SXM, H100 "
             "PCIe, A100")
    return (cfg.planned_mfu * peak * plan_world(cfg, proc) / flops_per_token(mconfig),
            f"planned_mfu={cfg.planned_mfu:g} of {gpu}")


def measure_tokens_per_sec(model, loader, dev, autocast, micro_batch_size, block_size):
    """This rank's forward+backward tokens/s over 3 micro-steps after 2 warm-up ones, no update."""
    x, y = loader.batch(range(micro_batch_size), dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    for i in range(5):
        if i == 2:
            sync()
            t0 = time.time()
        with autocast:
            loss = model(x, y)[1]
        loss.backward()
    sync()
    model.zero_grad(set_to_none=True)
    return 3 * micro_batch_size * block_size / (time.time() - t0)


def plan_run(cfg, proc, dt, mconfig, data, build_model, release=None):
    """(preflight report, the model or None until needed). data: (manifest, train and validation
    Loaders), all None before the data exists. Unplanned throughput is measured on the model."""
    manifest, train_data, _ = data
    report = gates_report(cfg, proc, mconfig, manifest, dt, release)
    tokens_per_sec, source = planned_speed(cfg, proc, mconfig)
    measure = not tokens_per_sec and manifest is not None and not planning(cfg, proc) \
        and not any(g["name"] == "memory_fit" and g["verdict"] == "block" for g in report["gates"])
    model = build_model() if measure or not cfg.preflight_only else None
    if measure:
        tokens_per_sec = proc.world * mean_over_ranks(measure_tokens_per_sec(
            model, train_data, proc.dev, autocast(proc.dev, dt), cfg.micro_batch_size,
            cfg.block_size), proc.distributed, proc.dev)
        source = f"measured here, {proc.world} x {proc.dev.type}"
    plan_time(cfg, proc, report, tokens_per_sec, source)
    report["gates"].append(loss_gate(cfg, report["plan"], manifest))  # at the plan's tokens
    if not cfg.preflight_only:  # fit_budget=False: the plan overruns max_hours or budget_usd
        refuse(cfg, [g for g in report["gates"]
                     if g["name"] == "time_and_cost" and g["verdict"] == "block"][:1])
    return report, model


def write_preflight(path, report):
    """preflight.json and preflight.md, with the report's verdict."""
    report["verdict"] = verdict_of(report["gates"])
    write_json(os.path.join(path, "preflight.json"), report)
    lines = [f"# preflight: {report['verdict']} ({report['profile']} profile)", ""] + md_table(
        ("gate", "verdict", "value", "threshold", "detail"),
        [(g["name"], g["verdict"], f"{g['value']:.4g}" if isinstance(g["value"], float)
          else g["value"], g["threshold"], g["detail"]) for g in report["gates"]])
    write_atomic(os.path.join(path, "preflight.md"), "\n".join(lines) + "\n")


def md_table(head, rows):
    """A Markdown table's lines: the head's cells, its rule, then each row's."""
    lines = [f"| {' | '.join(map(str, cells))} |" for cells in [head, *rows]]
    return lines[:1] + ["|" + "---|" * len(head)] + lines[1:]


def finish_preflight(cfg, report, master):
    """--preflight_only: write and print the report; exit status 1 when a gate blocks, else 0."""
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        report["plan"]["spend"] = spend_lines(cfg, report["plan"].get("horizon"))
        write_preflight(cfg.out_dir, report)
        for g in report["gates"]:
            print(f"{g['verdict']:>5}  {g['name']}: {g['detail']}")
        print_spend(cfg, report["plan"])
        print(f"preflight: {report['verdict']} ({cfg.gate_profile} profile), report in "
              f"{cfg.out_dir}/preflight.md")
    else:
        report["verdict"] = verdict_of(report["gates"])
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if report["verdict"] == "block" else 0
