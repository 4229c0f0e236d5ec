"""
Train a GPT on the shards that prepare.py writes: one process (CPU or one GPU), or
data-parallel (DDP) under torchrun: gloo on CPU, nccl on CUDA.

    python train.py config/tiny.py
    python train.py config/a100_50m.py --max_steps=500 --compile=False
    torchrun --standalone --nproc_per_node=8 train.py config/h200_1b_ddp8.py

Config: the globals between the config markers below, overridden by config files and
--key=val (configurator.py; --help lists them). Everything a run writes goes to out_dir:
metrics.jsonl (a JSON object per logged step), ckpt/ (checkpoints, ckpt/latest names
the newest complete one), summary.json at the end.

The batch of optimizer step s is always the same set of sequences, whatever the
number of GPUs or the micro-batch: the loader walks one global, seeded order of
windows (see Loader), and each step takes the next total_batch_tokens worth of it,
split across ranks and micro-steps. So a run resumes exactly where it stopped, and
1 GPU with gradient accumulation k computes the same step as k GPUs.
"""

import json
import math
import os
import random
import resource
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import configurator
from model import GPT, GPTConfig, flops_per_token, param_counts, peak_flops
from prepare import load_manifest, open_shard

# --- config
# I/O
out_dir = "out"                 # metrics.jsonl, ckpt/, summary.json are written here
data_dir = "data"               # shards and manifest.json written by prepare.py
resume = "auto"                 # auto: newest complete checkpoint in out_dir, if any | never | a checkpoint folder
# model
block_size = 1024               # context length in tokens
n_layer = 12                    # transformer blocks
n_head = 12                     # query heads
n_kv_head = 12                  # key/value heads; fewer than n_head is grouped-query attention
n_embd = 768                    # model width
ffn_hidden = None               # SwiGLU hidden size; None: floor(8 * n_embd / 3)
vocab_size = None               # None: the data's vocabulary (manifest.json); a number must match it
tie_embeddings = True           # share the input embedding with the output head
rope_theta = 10000.0            # RoPE base
vocab_multiple = 64             # pad the vocabulary to a multiple of this (faster matmuls)
init_std = 0.02                 # std of the normal init (residual projections scaled by 1/sqrt(2*n_layer))
# batch
micro_batch_size = 8            # sequences per GPU per forward/backward
total_batch_tokens = 524288     # tokens per optimizer step over all GPUs; grad accumulation is derived from it
max_steps = 1000                # optimizer steps
# AdamW and schedule: linear warmup, then cosine from learning_rate down to min_lr at max_steps
learning_rate = 3e-4            # peak learning rate
min_lr = 3e-5                   # final learning rate
warmup_steps = 100              # linear warmup steps
weight_decay = 0.1              # on matrices only, never on norms or embeddings
beta1 = 0.9                     # AdamW beta1
beta2 = 0.95                    # AdamW beta2
grad_clip = 1.0                 # clip the global gradient norm to this; 0 disables
# evaluation, logging, checkpoints
eval_every = 250                # steps between validation evaluations (and one at the end)
eval_steps = 20                 # validation micro-batches per rank per evaluation
log_every = 10                  # steps between metrics.jsonl lines and console lines
ckpt_every = 1000               # steps between checkpoints (and one at the end)
keep_last = 3                   # checkpoints kept (at least 1); older ones are deleted
# system
seed = 1337                     # model init and data order
device = "auto"                 # auto (cuda if available) | cpu | cuda
dtype = "auto"                  # auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32
compile = False                 # torch.compile the model
# --- end config

CKPT_FORMAT = 1


def fail(message):
    """Stop with one line that names the problem and the fix."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


# -----------------------------------------------------------------------------
# data

class Loader:
    """Windows of block_size+1 tokens (input and shifted target) over a split's shards.

    Window i of shard s starts at token i*block_size. Training visits all windows in a
    seeded random order per epoch (without replacement), and the order of epoch e is
    a pure function of (seed, e). Sample k of the run is window order(k // n)[k % n],
    so the loader's whole state is k, the number of samples consumed; validation
    reads windows 0, 1, 2, ... in place.
    """

    def __init__(self, data_dir, split, manifest, block_size, seed):
        self.block_size, self.seed = block_size, seed
        self.shards = [open_shard(os.path.join(data_dir, s["file"])) for s in manifest["splits"][split]["shards"]]
        counts = [max(0, (len(s) - 1) // block_size) for s in self.shards]
        self.starts = np.cumsum([0] + counts)
        self.n = int(self.starts[-1])
        if self.n == 0:
            fail(f"the {split} split of {data_dir} has fewer than block_size+1 = {block_size + 1} tokens: "
                 f"lower block_size or prepare more data")
        self._epoch, self._order = None, None

    def order(self, epoch):
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._order

    def window(self, i):
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        start = int(i - self.starts[s]) * self.block_size
        return self.shards[s][start:start + self.block_size + 1]

    def batch(self, windows, device):
        rows = torch.from_numpy(np.stack([self.window(int(i)) for i in windows]).astype(np.int64))
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def train_batch(self, first_sample, size, device):
        samples = np.arange(first_sample, first_sample + size)
        windows = [self.order(k // self.n)[k % self.n] for k in samples]
        return self.batch(windows, device)


# -----------------------------------------------------------------------------
# checkpoints: ckpt/step_NNNNNNN/ written under a temporary name, renamed into place
# when complete, then ckpt/latest is pointed at it: a crash mid-save leaves the
# previous checkpoint as latest.

def save_file(obj, path):
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(ckpt_root, step, model, optimizer, trainer_state, config, tokenizer_dir, keep_last):
    name = f"step_{step:07d}"
    tmp = os.path.join(ckpt_root, f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(model.state_dict(), os.path.join(tmp, "model.pt"))
    save_file(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    save_file(trainer_state, os.path.join(tmp, "trainer.pt"))
    save_file(json.dumps(config, indent=1).encode(), os.path.join(tmp, "config.json"))
    for f in ("tokenizer.json", "tokenizer.tiktoken"):  # the folder is enough to sample from
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(tmp, f))
    final = os.path.join(ckpt_root, name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    save_file(name.encode(), os.path.join(ckpt_root, "latest.tmp"))
    os.replace(os.path.join(ckpt_root, "latest.tmp"), os.path.join(ckpt_root, "latest"))
    for old in sorted(d for d in os.listdir(ckpt_root) if d.startswith("step_"))[:-max(1, keep_last)]:
        shutil.rmtree(os.path.join(ckpt_root, old))
    return final


def find_checkpoint(path):
    """The checkpoint folder that `path` names: itself, or the latest one of an out_dir; None if none."""
    if os.path.exists(os.path.join(path, "model.pt")):
        return path
    pointer = os.path.join(path, "ckpt", "latest")
    if os.path.exists(pointer):
        with open(pointer) as f:
            return os.path.join(path, "ckpt", f.read().strip())
    return None


def load_model(ckpt, device="cpu"):
    """(model, config dict) from a checkpoint folder, weights loaded, in eval mode."""
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    model = GPT(GPTConfig(**config["model"]))
    model.load_state_dict(torch.load(os.path.join(ckpt, "model.pt"), map_location=device, weights_only=True))
    return model.to(device).eval(), config


def rng_state():
    return dict(python=random.getstate(), numpy=[x.tolist() if isinstance(x, np.ndarray) else x
                                                   for x in np.random.get_state()],
                torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_rng_state(state):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -----------------------------------------------------------------------------
# helpers of the loop

def lr_at(step):
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + 0.5 * (learning_rate - min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model, fused):
    # decay matrices only: norms (1-D) and the embedding table (sparse rows, tied head) are left alone
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or name.startswith("embed_tokens") else decay).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2), fused=fused)


def mean_over_ranks(value, ddp, device):
    t = torch.tensor(float(value), device=device)
    if ddp:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def format_seconds(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def unigram_baseline(data_dir, manifest, val):
    """Loss (nats/token) of predicting each validation token from the training tokens'
    unigram frequencies (add-one smoothed): what a model that ignores context gets."""
    counts = np.load(os.path.join(data_dir, manifest["token_counts"])).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    val_counts = sum(np.bincount(np.asarray(s), minlength=len(counts)) for s in val.shards)
    return float(-(val_counts * log_p).sum() / val_counts.sum())


def rewrite_metrics(path, last_step):
    """On resume: keep only the metrics lines of steps <= last_step (and drop a torn last line)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if line.endswith("\n") and json.loads(line)["step"] <= last_step:
                    kept.append(line)
            except (ValueError, KeyError):
                pass
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------

def main(argv):
    config = configurator.configure(__file__, argv)
    globals().update(config)

    # distributed setup: torchrun sets RANK/LOCAL_RANK/WORLD_SIZE
    ddp = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        fail(f"device={device} but CUDA is not available here: use --device=cpu")
    dev = torch.device(f"cuda:{local_rank}" if use_cuda and ddp else ("cuda" if use_cuda else "cpu"))
    if use_cuda:
        torch.cuda.set_device(dev)
    if ddp:
        timeout = timedelta(minutes=float(os.environ.get("PODGPT_DDP_TIMEOUT_MINUTES", 30)))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)

    dt_name = dtype if dtype != "auto" else ("bfloat16" if use_cuda and torch.cuda.is_bf16_supported() else "float32")
    if dt_name not in ("float32", "bfloat16", "float16"):
        fail(f"dtype={dtype!r} is not one of auto, float32, bfloat16, float16")
    ptdtype = getattr(torch, dt_name)
    autocast = nullcontext() if ptdtype == torch.float32 else torch.autocast(dev.type, dtype=ptdtype)

    # batch arithmetic
    tokens_per_micro = micro_batch_size * block_size * world
    if total_batch_tokens % tokens_per_micro:
        fail(f"total_batch_tokens={total_batch_tokens} is not a multiple of micro_batch_size*block_size*world_size"
             f" = {micro_batch_size}*{block_size}*{world} = {tokens_per_micro}: use a multiple of {tokens_per_micro}")
    grad_accum = total_batch_tokens // tokens_per_micro
    global_batch = total_batch_tokens // block_size  # sequences per optimizer step

    # data
    try:
        manifest = load_manifest(data_dir)
    except ValueError as e:
        fail(str(e))
    if vocab_size is not None and vocab_size != manifest["vocab_size"]:
        fail(f"vocab_size={vocab_size} but {data_dir} was tokenized with {manifest['tokenizer']} "
             f"({manifest['vocab_size']} tokens): set vocab_size=None or prepare matching data")
    train_data = Loader(data_dir, "train", manifest, block_size, seed)
    val_data = Loader(data_dir, "val", manifest, block_size, seed)

    # model
    torch.manual_seed(seed)
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    model_config = GPTConfig(vocab_size=manifest["vocab_size"], block_size=block_size, n_layer=n_layer,
                             n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd, ffn_hidden=ffn_hidden,
                             rope_theta=rope_theta, tie_embeddings=tie_embeddings,
                             vocab_multiple=vocab_multiple, init_std=init_std)
    raw_model = GPT(model_config).to(dev)
    optimizer = make_optimizer(raw_model, fused=use_cuda)
    scaler = torch.amp.GradScaler(enabled=ptdtype == torch.float16)
    counts = param_counts(model_config)
    flops_tok = flops_per_token(model_config)
    peak = peak_flops(torch.cuda.get_device_name(dev)) if use_cuda else None
    saved = dict(config, model={k: v for k, v in asdict(model_config).items() if k != "padded_vocab"},
                 world_size=world, grad_accum=grad_accum, data_fingerprint=manifest["fingerprint"])

    # resume
    step, samples, elapsed, best_val = 0, 0, 0.0, float("inf")
    ckpt_root = os.path.join(out_dir, "ckpt")
    ckpt = None if resume == "never" else find_checkpoint(out_dir if resume == "auto" else resume)
    if resume not in ("auto", "never") and ckpt is None:
        fail(f"resume={resume}: no checkpoint there (give a checkpoint folder or an out_dir with ckpt/latest)")
    if ckpt is not None:
        with open(os.path.join(ckpt, "config.json")) as f:
            old = json.load(f)
        if old["model"] != saved["model"]:
            diff = ", ".join(f"{k} {old['model'].get(k)} -> {v}" for k, v in saved["model"].items() if old["model"].get(k) != v)
            fail(f"checkpoint {ckpt} has another model shape ({diff}): use a new out_dir or --resume=never")
        if old["data_fingerprint"] != manifest["fingerprint"]:
            fail(f"checkpoint {ckpt} was trained on other data than {data_dir} (manifest fingerprint differs): "
                 f"point data_dir at its data or use a new out_dir")
        raw_model.load_state_dict(torch.load(os.path.join(ckpt, "model.pt"), map_location=dev, weights_only=True))
        optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), map_location=dev, weights_only=True))
        state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)
        step, samples, elapsed, best_val = state["step"], state["samples"], state["elapsed"], state["best_val_loss"]
        if len(state["rng"]) == world:
            set_rng_state(state["rng"][rank])
        log(f"resumed from {ckpt} at step {step}")

    model = torch.compile(raw_model) if compile else raw_model
    if ddp:
        model = DDP(model, device_ids=[local_rank] if use_cuda else None)

    log("config: " + json.dumps(config))
    log(f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{flops_tok / 1e9:.3f} GFLOP/token | data: {manifest['tokenizer']}, {train_data.n} train windows | "
        f"world {world} x micro {micro_batch_size} x accum {grad_accum} = {total_batch_tokens} tokens/step | "
        f"{dev} {dt_name}")

    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if master:
        os.makedirs(ckpt_root, exist_ok=True)
        rewrite_metrics(metrics_path, step)
    metrics = open(metrics_path, "a") if master else None

    def write_metrics(row):
        if master:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    def evaluate():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(eval_steps):
                first = ((i * world + rank) * micro_batch_size) % val_data.n
                x, y = val_data.batch((np.arange(micro_batch_size) + first) % val_data.n, dev)
                with autocast:
                    total += raw_model(x, y)[1].item()
        model.train()
        return mean_over_ranks(total / eval_steps, ddp, dev)

    def checkpoint(val_loss):
        states = [None] * world
        if ddp:
            dist.all_gather_object(states, rng_state())
        else:
            states = [rng_state()]
        if master:
            trainer = dict(format=CKPT_FORMAT, step=step, samples=samples, tokens=step * total_batch_tokens,
                           elapsed=elapsed, best_val_loss=best_val, val_loss=val_loss, rng=states,
                           world_size=world)
            path = save_checkpoint(ckpt_root, step, raw_model, optimizer, trainer, saved, data_dir, keep_last)
            log(f"checkpoint {path}")

    bpb_scale = manifest["splits"]["val"]["tokens"] / manifest["splits"]["val"]["bytes"] / math.log(2)
    t_log, t_run, step_at_log, val_loss, loss = time.time(), time.time() - elapsed, step, None, None
    saved_step = step if ckpt is not None else -1
    while step < max_steps:
        lr = lr_at(step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_sum = 0.0
        for micro in range(grad_accum):
            # this rank's slice of the step's global batch: disjoint across ranks and micro-steps
            first = samples + (micro * world + rank) * micro_batch_size
            x, y = train_data.train_batch(first, micro_batch_size, dev)
            sync = nullcontext() if not ddp or micro == grad_accum - 1 else model.no_sync()
            with sync:
                with autocast:
                    _, micro_loss = model(x, y)
                scaler.scale(micro_loss / grad_accum).backward()
            loss_sum += micro_loss.detach()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        samples += global_batch
        elapsed = time.time() - t_run

        if step % log_every == 0 or step == max_steps:
            loss = mean_over_ranks(loss_sum.item() / grad_accum, ddp, dev)
            now = time.time()
            tok_s = (step - step_at_log) * total_batch_tokens / (now - t_log)
            mfu = flops_tok * tok_s / (peak * world) if peak else None
            eta = (max_steps - step) * (now - t_log) / (step - step_at_log)
            t_log, step_at_log = now, step
            row = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm.item(), tokens=step * total_batch_tokens,
                       tokens_per_sec=tok_s, mfu=mfu, mem_gb=peak_memory_gb(dev), elapsed=elapsed)
            write_metrics(row)
            log(f"step {step}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | gnorm {row['grad_norm']:.2f} | "
                f"{tok_s:,.0f} tok/s | mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
                f"mem {row['mem_gb']:.2f} GB | eta {format_seconds(eta)}", flush=True)
        if step % eval_every == 0 or step == max_steps:
            val_loss = evaluate()
            best_val = min(best_val, val_loss)
            write_metrics(dict(step=step, val_loss=val_loss, val_bpb=val_loss * bpb_scale, tokens=step * total_batch_tokens))
            log(f"step {step} | val loss {val_loss:.4f} | val bpb {val_loss * bpb_scale:.4f}", flush=True)
        if step % ckpt_every == 0 or step == max_steps:
            checkpoint(val_loss)
            saved_step = step

    if val_loss is None:  # resumed at or past max_steps: still report a validation loss
        val_loss = evaluate()
        best_val = min(best_val, val_loss)
    if saved_step != step:
        checkpoint(val_loss)
    if master:
        unigram = unigram_baseline(data_dir, manifest, val_data)
        summary = dict(status="completed", stop_reason="max_steps", steps=step, tokens=step * total_batch_tokens,
                       final_train_loss=loss, final_val_loss=val_loss, best_val_loss=best_val,
                       final_val_bpb=val_loss * bpb_scale, unigram_val_loss=unigram, elapsed_s=elapsed,
                       params=counts, flops_per_token=flops_tok, world_size=world,
                       checkpoint=find_checkpoint(out_dir))
        with open(os.path.join(out_dir, "summary.json.tmp"), "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(os.path.join(out_dir, "summary.json.tmp"), os.path.join(out_dir, "summary.json"))
        log(f"done: {step} steps in {format_seconds(elapsed)} | final val loss {val_loss:.4f} "
            f"(unigram baseline {unigram:.4f}) | summary in {out_dir}/summary.json")
        metrics.close()
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
