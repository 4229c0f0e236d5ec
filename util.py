"""
What every podgpt script shares below the model: the one error type and exit, atomic writes,
dtype names, peak memory, and the one device and process-group setup (train.py, sanity.py,
sample.py and its server, export.py, prepare.py, bench/).

The device a process runs on is always an indexed one: cuda:LOCAL_RANK under torchrun, cuda:0
otherwise, or the CPU. device=cpu means the CPU all the way down, also on a machine with GPUs:
gloo for the process group, a CPU mesh for FSDP, and no call into CUDA at all.
"""

import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from contextlib import nullcontext
from datetime import timedelta
from types import SimpleNamespace


# torch is imported inside the functions that use it: configurator.py and report.py import util for the
# error type and atomic writes, and import in 0.04 s instead of torch's 1.6 s (measured on a 2-core CPU,
# torch 2.13; run.sh reads out_dir through configurator.py at every start)
DEVICES = "auto, cpu, cuda, cuda:N"


class Error(Exception):
    """podgpt's own error: one line that names the problem and the fix, and the exit status it
    ends the script with. A script's top level (run_main) prints it; only a script that carries on
    past one catches it (sanity.py reports a device it cannot have as a failed check)."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


def fail(message, code=1):
    """Stop with one line that names the problem and the fix."""
    raise Error(message, code)


def run_main(main, argv):
    """A script's top level: run main(argv), print podgpt's Error (or a Ctrl-C) as one line, exit with
    main's status (None: 0), the error's, or 130 after Ctrl-C."""
    try:
        code = main(argv)
    except Error as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = e.code
    except KeyboardInterrupt:  # Ctrl-C (a second one, for train.py): what was cleaned up on the way out is done
        print("error: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        code = 130  # the shell's status for a process ended by SIGINT
    exit_worker(code or 0)


class CutShortThread(threading.Thread):
    """A daemon thread running work() that an exit may cut short (checkpoint.py's background save: a save cut
    short is never taken for a checkpoint). While work() runs, exit_worker skips the interpreter's teardown:
    a daemon thread still inside torch's C++ code when the interpreter ends aborts the process. `busy` is
    the thread's own flag because is_alive() turns False when a Ctrl-C interrupts a join() (CPython < 3.13)."""

    def __init__(self, name):
        super().__init__(name=name, daemon=True)
        self.busy = True

    def run(self):
        try:
            self.work()
        finally:
            self.busy = False


def exit_worker(code):
    """Exit with `code`. A torchrun worker, and a process whose background save is still writing (a second
    Ctrl-C, an error), skip the interpreter's teardown: destroying the process group's leftover C++ threads
    there, or ending a thread inside torch.save, aborts the process ("terminate called without an active
    exception"), which torchrun reports as a failed job. Output is flushed first; the files podgpt appends
    to are flushed line by line."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "RANK" in os.environ or any(getattr(t, "busy", False) for t in threading.enumerate()):
        os._exit(code)
    raise SystemExit(code)


def first_line(e):
    """An exception as one line, for messages that must stay one line ."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def is_master():
    """Rank 0 of a torchrun job, or a process on its own: the one that prints and writes the run's files."""
    return int(os.environ.get("RANK", 0)) == 0


def log(*args, **kwargs):
    if is_master():
        print(*args, **kwargs)


def warn(message):
    if is_master():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def format_seconds(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def write_atomic(path, text):
    """Whole file or none: a reader (or a crash) never sees half a report."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path, obj):
    write_atomic(path, json.dumps(obj, indent=1))


# the file inside every temporary folder podgpt makes: a folder is removed only when it holds one, so a
# user's folder that happens to sit where podgpt wants its own is refused, never deleted
SCRATCH_MARK = "PODGPT_SCRATCH"


def check_apart(**folders):
    """Stop with one line when two of the named folders (key: the setting's name) are the same folder
    or one lies inside the other: one script's files would land among, and over, the other's (a run's
    report over the data's manifest.json, a rebuild of the data over a run). Call it before writing."""
    real = {name: os.path.realpath(path) for name, path in folders.items()}
    for (a, pa), (b, pb) in itertools.combinations(real.items(), 2):
        if pa == pb:
            fail(f"{a}={folders[a]} and {b}={folders[b]} are the same folder: give each its own folder, side by side")
        if os.path.commonpath([pa, pb]) in (pa, pb):
            (inner, outer) = (a, b) if len(pa) > len(pb) else (b, a)
            fail(f"{inner}={folders[inner]} lies inside {outer}={folders[outer]}: give each its own folder, "
                 "side by side")


def make_scratch(path):
    """The empty folder `path` for podgpt's temporary files, with the marker file that proves podgpt
    made it. What an interrupted run left there (marked) is removed first; anything else is refused."""
    remove_scratch(path)
    os.makedirs(path)
    with open(os.path.join(path, SCRATCH_MARK), "w") as f:
        f.write(f"made by podgpt ({os.path.basename(sys.argv[0])}, pid {os.getpid()}) for its temporary files; "
                "safe to delete\n")
    return path


def remove_scratch(path):
    """Remove a folder make_scratch made (nothing there: nothing to do); a folder or file there without
    the marker is not podgpt's: one line, and it stays."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isfile(os.path.join(path, SCRATCH_MARK)):
        fail(f"{path} is in podgpt's way and podgpt did not make it (it holds no {SCRATCH_MARK} file): "
             "move or rename it, then rerun")
    shutil.rmtree(path)


def compute_dtype(name, dev):
    """The torch dtype of `dtype=name` on dev: auto is bfloat16 on a GPU that has it, else float32."""
    import torch
    if name == "auto":
        name = "bfloat16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if name not in ("float32", "bfloat16", "float16"):
        fail(f"dtype={name!r} is not one of auto, float32, bfloat16, float16")
    return getattr(torch, name)


def dtype_name(dt):
    return str(dt).removeprefix("torch.")


def autocast(dev, dt):
    """Mixed precision in dt, or nothing in float32."""
    import torch
    return nullcontext() if dt == torch.float32 else torch.autocast(dev.type, dtype=dt)


def peak_memory_gb(device):
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


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
    import torch
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
    import torch
    import torch.distributed as dist
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
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(dist.group.WORLD, dev.type)


def driver_version():
    """The NVIDIA driver's version, which torch does not report, from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout
        return out.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (no nvidia-smi)"


def mean_over_ranks(value, distributed, device):
    import torch
    import torch.distributed as dist
    t = torch.tensor(float(value), device=device)
    if distributed:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()
