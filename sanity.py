"""
Sanity checks before paying for a run: is this machine able to run the configured
model at all? Each check has a status (pass / fail / skip), the seconds it took and a
detail line; the report goes to out_dir/sanity.json and out_dir/sanity.md and the exit
status is 1 when any check failed.

    python sanity.py config/tiny.py
    python sanity.py config/a100_50m.py --device=cuda

Checks: the environment (python, torch, CUDA and GPUs, free disk), one bf16/fp32
training step of a tiny copy of the configured architecture giving finite loss and
gradients, and KV-cache generation equal to full recomputation.
"""

import json
import os
import platform
import shutil
import sys
import time

import torch

import configurator
from model import GPT, GPTConfig

# --- config
out_dir = "out"                 # sanity.json and sanity.md are written here
device = "auto"                 # auto (cuda if available) | cpu | cuda
n_head = 12                     # the configured model's heads: the probe model keeps the head layout
n_kv_head = 12                  # the configured model's key/value heads
min_free_disk_gb = 1.0          # fail when out_dir's disk has less free space than this
# --- end config


def check_environment(dev):
    lines = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if dev.type == "cuda":
        lines.append(f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"{i}: {p.name} {p.total_memory / 2**30:.0f} GiB sm_{p.major}{p.minor}")
        if torch.distributed.is_nccl_available():
            lines.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    else:
        lines.append(f"no GPU in use, {os.cpu_count()} CPU cores")
    return True, "; ".join(lines)


def check_disk(path, min_gb):
    free = shutil.disk_usage(path).free / 1e9
    return free >= min_gb, f"{free:.1f} GB free at {os.path.abspath(path)} (need {min_gb})"


def probe_model(dev, heads, kv_heads):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=heads, n_kv_head=kv_heads,
                       n_embd=16 * heads)
    return GPT(config).to(dev)


def check_train_step(dev, heads, kv_heads):
    model = probe_model(dev, heads, kv_heads)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randint(0, 256, (2, 64), device=dev)
    with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(x, x)
    loss.backward()
    finite = torch.isfinite(loss).item() and all(torch.isfinite(p.grad).all().item() for p in model.parameters())
    return finite, f"{dtype} loss {loss.item():.3f}, gradients {'finite' if finite else 'NOT finite'}"


def check_kv_cache(dev, heads, kv_heads):
    model = probe_model(dev, heads, kv_heads).eval()
    prompt = torch.randint(0, 256, (2, 8), device=dev)
    cached = torch.stack(list(model.generate(prompt, 40, temperature=0)), 1)
    full = torch.stack(list(model.generate(prompt, 40, temperature=0, use_cache=False)), 1)
    same = torch.equal(cached, full)
    return same, "greedy tokens with the KV cache " + ("equal" if same else "DIFFER from") + " full recomputation"


def main(argv):
    config = configurator.configure(__file__, argv)
    dev = torch.device(config["device"] if config["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(config["out_dir"], exist_ok=True)
    checks = [("environment", lambda: check_environment(dev)),
              ("disk", lambda: check_disk(config["out_dir"], config["min_free_disk_gb"])),
              ("train_step", lambda: check_train_step(dev, config["n_head"], config["n_kv_head"])),
              ("kv_cache", lambda: check_kv_cache(dev, config["n_head"], config["n_kv_head"]))]
    results = []
    for name, fn in checks:
        t0 = time.time()
        try:
            ok, detail = fn()
            status = "pass" if ok else "fail"
        except Exception as e:  # a check that crashes is a failed check, reported like the others
            status, detail = "fail", f"{type(e).__name__}: {e}"
        results.append(dict(name=name, status=status, seconds=round(time.time() - t0, 3), detail=detail))
        print(f"{status:4s} {name:12s} {detail}", flush=True)
    passed = all(r["status"] != "fail" for r in results)
    report = dict(passed=passed, device=str(dev), checks=results)
    with open(os.path.join(config["out_dir"], "sanity.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(config["out_dir"], "sanity.md"), "w") as f:
        f.write(f"# sanity: {'PASS' if passed else 'FAIL'}\n\n| check | status | seconds | detail |\n|---|---|---|---|\n")
        f.writelines(f"| {r['name']} | {r['status']} | {r['seconds']} | {r['detail']} |\n" for r in results)
    print(f"sanity {'passed' if passed else 'FAILED'}: {config['out_dir']}/sanity.md")
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
