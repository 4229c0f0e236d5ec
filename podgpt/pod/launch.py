"""
A run's start on this rank: its settings checked, the process and device set up, its data read and
checked, the model built on its device (seeds, attention kernel, fp8, FSDP2) and wrapped as the loop
calls it (compiled, DDP), and out_dir claimed and proved writable before a step is paid for.
"""
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import float8_linears, fp8_recipe_unknown, fp8_unavailable, shard_model
from podgpt.core.attention import resolve_backend
from podgpt.core.data import Loader, check_prepared, load_manifest
from podgpt.core.tokenizer import check_tokenizer_loads
from podgpt.core.optim import check_optimizer
from podgpt.core.util import (MAKE_ROOM, check_apart, compute_dtype, disk_full, fail, first_line,
                              log, on_rank0, remove, setup, write_json)
from podgpt.pod.checks import check_settings
from podgpt.pod.objectives import make_model, objective as research_objective
from podgpt.pod.preflight import check_gate_settings, write_preflight
from podgpt.pod.trackers import tracker_names

# a torchrun worker keeps its wrapped model until os._exit (util.exit_worker): freeing DDP's reducer
# or FSDP's groups after the process group is gone joins a gloo thread that can wait forever for the
# interpreter lock
LIVE_MODELS = []


def check_config(cfg):
    """Refuse train.py settings that cannot work, before anything is read or written."""
    for key, example in (("out_dir", "out"), ("data_dir", "data/default")):
        if not cfg[key]:
            fail(f"{key} is empty: name a folder (e.g. --{key}={example})")
    check_apart(out_dir=cfg.out_dir, data_dir=cfg.data_dir)
    tracker_names(cfg.log_to)
    for key in ("block_size", "n_layer", "micro_batch_size", "total_batch_tokens", "max_steps",
                "learning_rate", "eval_every", "eval_steps", "log_every", "ckpt_every", "keep_last",
                "max_bad_steps", "budget_check_minutes", "lr_base_batch", "ddp_timeout_minutes"):
        if cfg[key] <= 0:
            fail(f"{key}={cfg[key]} must be positive")
    for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "max_rollbacks",
                "early_stop_patience", "max_hours", "budget_usd", "usd_per_gpu_hour",
                "ckpt_min_free_gb", "max_epochs", "lr_base", "eval_gsm8k_samples",
                "ckpt_every_minutes", "stop_at_step", "budget_warn_usd", "usd_fixed", "storage_gb",
                "usd_per_gb_month", "max_usd_per_gpu_hour", "min_tokens_per_sec",
                "floor_window_minutes"):
        if cfg[key] < 0:
            fail(f"{key}={cfg[key]} must be >= 0")
    for key, choices in (("compile_mode", ("default", "reduce-overhead", "max-autotune",
                                           "max-autotune-no-cudagraphs")),
                         ("matmul_precision", ("highest", "high", "medium")),
                         ("dist_mode", ("ddp", "fsdp")), ("optimizer", ("adamw", "muon")),
                         ("lr_schedule", ("cosine", "wsd"))):
        if cfg[key] not in choices:
            fail(f"{key}={cfg[key]!r} is not one of {', '.join(choices)}")
    if why := fp8_recipe_unknown(cfg.fp8_recipe):
        fail(why, 2)
    check_gate_settings(cfg)
    check_settings(cfg)
    check_optimizer(cfg)
    if cfg.spike_factor <= 1:
        fail(f"spike_factor={cfg.spike_factor} must be above 1 (a spike is a loss this many times "
             f"the recent average)")
    if cfg.budget_usd and not (cfg.usd_per_gpu_hour or cfg.budget_file):
        fail(f"budget_usd={cfg.budget_usd} needs a way to measure spend: set usd_per_gpu_hour or "
             f"budget_file")
    if cfg.max_usd_per_gpu_hour and cfg.usd_per_gpu_hour > cfg.max_usd_per_gpu_hour:
        fail(f"usd_per_gpu_hour={cfg.usd_per_gpu_hour:g} is above max_usd_per_gpu_hour="
             f"{cfg.max_usd_per_gpu_hour:g}, the run's spot ceiling: wait for a lower price or "
             f"another provider, or raise the ceiling if the budget allows")
    if cfg.dryrun_stage_steps < 2:
        fail(f"dryrun_stage_steps={cfg.dryrun_stage_steps} must be at least 2 (a checkpoint at "
             f"half, then the resume from it)")
    if not 0 < cfg.decay_frac <= 1:
        fail(f"decay_frac={cfg.decay_frac} must be in (0, 1]: the decay's share of the horizon")
    if cfg.budget_file and not cfg.budget_usd:
        fail(f"budget_file={cfg.budget_file} needs budget_usd, the cap its spend is checked "
             f"against")
    if cfg.budget_file and not os.path.isfile(cfg.budget_file):
        fail(f"budget_file {cfg.budget_file} does not exist: start what writes it first, or leave "
             f"budget_file empty")
    try:  # a research objective's own keys (the configurator already refused another objective's)
        getattr(research_objective(cfg.objective), "check_config", lambda cfg: None)(cfg)
    except ValueError as e:
        fail(str(e))


def set_up(device, sharded, matmul_precision, dtype, micro_batch_size, block_size,
           total_batch_tokens, timeout_minutes):
    """(process, compute dtype, gradient accumulation): torchrun's ranks each on its own GPU; a
    sharded run without torchrun is a group of one."""
    proc = setup(device, group=sharded, timeout_minutes=timeout_minutes)
    if proc.dev.type == "cuda":  # not on CPU: it changes fp32 results there
        torch.set_float32_matmul_precision(matmul_precision)
    per_micro = micro_batch_size * block_size * proc.world
    if total_batch_tokens % per_micro:
        fail(f"total_batch_tokens={total_batch_tokens} is not a multiple of "
             f"micro_batch_size*block_size*world_size = "
             f"{micro_batch_size}*{block_size}*{proc.world} = {per_micro}: use a multiple of "
             f"{per_micro}")
    return proc, compute_dtype(dtype, proc.dev), total_batch_tokens // per_micro


def read_manifest(data_dir, vocab_size, planning=False):
    """The prepared data's manifest, checked; None when planning before the data exists."""
    try:
        manifest = load_manifest(data_dir)
    except ValueError as e:
        if planning and not os.path.exists(data_dir):
            return None
        fail(str(e))
    check_prepared(data_dir, manifest, vocab_size)
    check_tokenizer_loads(data_dir, manifest)  # every checkpoint carries it for sample.py
    return manifest


def open_data(data_dir, manifest, mconfig, seed):
    """(manifest, train Loader, validation Loader); all None before the data exists."""
    if manifest is None:
        return None, None, None
    mconfig.check_data(data_dir, manifest)
    return manifest, *(Loader(data_dir, split, manifest, mconfig.block_size, seed, mconfig.draws)
                       for split in ("train", "val"))


def build_model(mconfig, proc, dt, seed, fp8=False, compiled=False, sharded=False, verbose=False,
                out_dir=""):
    """The model on this rank's device (its share when sharded), every RNG seeded; its attention
    kernel resolved before torch.compile traces it (verbose: why auto skipped the others)."""
    torch.manual_seed(seed)
    random.seed(seed + proc.rank)
    np.random.seed((seed + proc.rank) % 2**32)  # numpy's range; the configurator keeps seed in it
    if fp8 and (why := fp8_unavailable(proc.dev, dt, compiled)):
        fail(why, 2)
    try:
        backend, note = resolve_backend(mconfig.attn_backend, proc.dev, dt, mconfig.head_dim,
                                        mconfig.mask_kind)
    except ValueError as e:
        fail(str(e))
    log(f"attention: {note}" if verbose or mconfig.attn_backend != "auto" else
        f"attention: {backend} (auto: the first that passes its parity check here; why not the "
        f"others: {os.path.join(out_dir, 'preflight.md')})")
    model = make_model(mconfig).to(proc.dev)
    if fp8:  # before FSDP wraps the layers, and before torch.compile traces them
        converted, kept = float8_linears(model)
        log(f"fp8: {len(converted)} linear layers compute in float8 (torchao, {mconfig.fp8_recipe} "
            f"scales); kept in bfloat16: {', '.join(kept[:4])}"
            + (f" and {len(kept) - 4} more" if len(kept) > 4 else ""))
    if sharded:
        shard_model(model, proc.dev, dt)
    return model


def wrap_model(raw_model, proc, compile_mode=None, ddp=True):
    """The model as the loop calls it: compiled unless compile_mode is None, maybe in DDP."""
    model = raw_model if compile_mode is None else torch.compile(raw_model, mode=compile_mode)
    if proc.distributed:
        if ddp:
            model = DDP(model, device_ids=[proc.dev.index] if proc.dev.type == "cuda" else None)
        LIVE_MODELS.append(model)
    return model


def check_writable(out_dir, proc, folder, config, report):
    """out_dir claimed by rank 0 and proved writable by each rank before any step is spent; then
    rank 0 writes the config and preflight report into it."""
    on_rank0(proc.distributed, folder.claim)
    probe = os.path.join(out_dir, f".write-test-{proc.rank}")
    try:
        os.makedirs(os.path.join(out_dir, "ckpt"), exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        if proc.rank == 0:
            write_json(os.path.join(out_dir, "config.json"), config)
            write_preflight(out_dir, report)
    except OSError as e:
        fail(f"out_dir {out_dir} is not writable ({first_line(e)}): " + (
            MAKE_ROOM if disk_full(e) else "choose another out_dir"))
    finally:
        if os.path.isfile(probe):
            remove(probe)
    if proc.distributed:
        dist.barrier()
