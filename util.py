"""
What every podgpt script shares below the model: the one error exit, and the one device and
process-group setup (train.py, sanity.py, sample.py and its server, export.py, bench/).

The device a process runs on is always an indexed one: cuda:LOCAL_RANK under torchrun, cuda:0
otherwise, or the CPU. device=cpu means the CPU all the way down, also on a machine with GPUs:
gloo for the process group, a CPU mesh for FSDP, and no call into CUDA at all.
"""

import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DEVICES = "auto, cpu, cuda, cuda:N"


def fail(message):
    """Stop with one line that names the problem and the fix."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def first_line(e):
    """An exception as one line, for messages that must stay one line ."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def torchrun_env():
    """(rank, local_rank, world_size) as torchrun sets them, or None outside torchrun."""
    if "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_device(name, local_rank=None, cuda_count=None):
    """The torch.device for `device=name`. local_rank: torchrun's LOCAL_RANK (None outside torchrun);
    cuda_count: the GPUs CUDA sees (None: ask torch; 0 where CUDA is absent). ValueError names the fix.

    cpu: the CPU, GPUs or not. auto: this process's GPU when there is one, else the CPU. cuda: this
    process's GPU: cuda:LOCAL_RANK under torchrun, cuda:0 otherwise. cuda:N: that GPU, outside torchrun
    (under it every rank takes its own)."""
    if name == "cpu":
        return torch.device("cpu")
    if name != "auto" and name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ValueError(f"device={name!r} is not one of {DEVICES}")
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count == 0:
        if name == "auto":
            return torch.device("cpu")
        raise ValueError(f"device={name} but CUDA is not available here (torch {torch.__version__}, "
                         f"CUDA build {torch.version.cuda}): use --device=cpu")
    if name.startswith("cuda:") and local_rank is not None:
        raise ValueError(f"device={name} under torchrun: every rank takes its own GPU (cuda:LOCAL_RANK), "
                         f"give --device=cuda")
    index = int(name[5:]) if name.startswith("cuda:") else (local_rank or 0)
    if index >= cuda_count:
        where = f"LOCAL_RANK {index}" if local_rank is not None else f"device={name}"
        raise ValueError(f"{where} but this machine has {cuda_count} GPU{'s' * (cuda_count > 1)}: "
                         + (f"launch at most --nproc_per_node={cuda_count}" if local_rank is not None
                            else f"give --device=cuda:0 to cuda:{cuda_count - 1}"))
    return torch.device("cuda", index)


def setup(device, group=False):
    """This process's device and process group. Under torchrun (or with group=True: a group of one
    process, as fsdp needs) joins the process group: NCCL on GPUs, gloo on the CPU. Returns
    dev, rank, world, torchrun and distributed; a bad device stops with one line."""
    env = torchrun_env()
    rank, local_rank, world = env or (0, 0, 1)
    try:
        dev = resolve_device(device, local_rank if env else None)
    except ValueError as e:
        fail(str(e))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    distributed = env is not None or group
    if distributed and not dist.is_initialized():
        # a rank that dies or hangs makes the others' collectives fail after this long instead of waiting forever
        timeout = timedelta(minutes=float(os.environ.get("PODGPT_DDP_TIMEOUT_MINUTES", 30)))
        options = {} if env else dict(store=dist.HashStore(), rank=0, world_size=1)  # torchrun's, or a group of one
        if dev.type == "cuda":  # binds the group to this rank's GPU (barrier() would guess it)
            options["device_id"] = dev
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timeout, **options)
    return SimpleNamespace(dev=dev, rank=rank, world=world, torchrun=env is not None, distributed=distributed)


def device_mesh(dev):
    """The 1-D mesh FSDP2 shards over: this run's process group, on its device type. (fully_shard's default
    mesh is CUDA's wherever a GPU exists, so a CPU run on a GPU machine would put rank 1 on a cuda:1 that may
    not exist; and a new mesh of CPU type there adds an NCCL backend to a gloo run.)"""
    return DeviceMesh.from_group(dist.group.WORLD, dev.type)
