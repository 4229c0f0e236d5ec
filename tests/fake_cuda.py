"""Run a podgpt script as if this machine had GPUs that nothing may touch.

    python tests/fake_cuda.py SCRIPT [ARGS...]       (also as torchrun's script)

torch.cuda reports PODGPT_FAKE_GPUS GPUs (default 1), and every call that would reach one (set_device,
the lazy CUDA init behind properties, synchronize and memory stats, NCCL) stops the script with
"CUDA called: <call>", and the allocator settings that call would have read (PYTORCH_ALLOC_CONF and
PYTORCH_CUDA_ALLOC_CONF). So a run that finishes made no CUDA call, and a run that picks a GPU shows which
device it asked for first, and with which settings.
"""
import os
import runpy
import sys

import torch


def forbidden(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"CUDA called: {name}({', '.join(map(str, args))}) with " + ", ".join(
            f"{k}={os.environ.get(k)}" for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")))
    return call


gpus = int(os.environ.get("PODGPT_FAKE_GPUS", "1"))
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: gpus
torch._C._get_accelerator = lambda: torch.device("cuda")  # what FSDP2's default mesh asks
for name in ("set_device", "_lazy_init", "init", "current_device", "synchronize", "get_device_properties",
             "get_device_name", "get_device_capability", "is_bf16_supported", "mem_get_info", "empty_cache",
             "reset_peak_memory_stats", "max_memory_allocated", "memory_stats"):
    setattr(torch.cuda, name, forbidden(f"torch.cuda.{name}"))
torch.cuda.nccl.version = forbidden("torch.cuda.nccl.version")
# torch's AdamW.step asks this whenever CUDA is available, CPU parameters or not (up to torch 2.9): not
# podgpt's call, answered as on a machine without GPUs
torch.cuda.is_current_stream_capturing = lambda: False

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
