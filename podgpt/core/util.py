"""
What every podgpt script shares below the model: the one error type and exit, atomic writes,
podgpt's own folders (one writer each), dtype names, and the one device and process-group setup.
device=cpu means the CPU all the way down, also on a machine with GPUs (gloo, no call into CUDA).
"""

import errno
import fcntl
import itertools
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from datetime import timedelta
from types import SimpleNamespace

# torch is imported inside the functions that use it: configurator.py and report.py import util and
# stay quick to start without it (run.sh reads out_dir through configurator.py at every start)
IGNORE = -100  # a target the loss skips (SFT's prompt tokens): F.cross_entropy's ignore_index


class Error(Exception):
    """One line naming the problem and the fix, and the exit status: run_main prints it."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


def fail(message, code=1):
    raise Error(message, code)


def run_main(main, argv):
    """Exit with main(argv)'s status (None: 0), an Error's after its line, or 130 after Ctrl-C."""
    # loaded: podgpt/__init__.py's Ctrl-C while the imports load gives way to the usual one
    if getattr(signal.getsignal(signal.SIGINT), "__module__", None) == "podgpt":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main(argv)
    except Error as e:
        error_line(f"error: {e}")
        code = e.code
    except KeyboardInterrupt:  # Ctrl-C (train.py's second): the cleanup on the way out is done
        error_line("error: interrupted (Ctrl-C)")
        code = 130  # the shell's status for a process ended by SIGINT
    exit_worker(code or 0)


def error_line(line):
    """line and its newline in one write: every rank of a run may say the same error into one
    pipe, and print's two writes (text, then newline) let another rank's line in between."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class CutShortThread(threading.Thread):
    """work() in a daemon thread, started (checkpoint.py's background save): a run stopping on an
    error exits without finishing it, and exit_worker skips the teardown that aborts on a daemon
    thread inside torch's C++ code. `busy`, not is_alive(): that turns False when a Ctrl-C
    interrupts a join() (CPython < 3.13). result() returns or raises what work() did."""

    def __init__(self, work, name):
        super().__init__(name=name, daemon=True)
        self.work, self.busy, self.value, self.error = work, True, None, None
        self.start()

    def run(self):
        try:
            self.value = self.work()
        except BaseException as e:  # handed to the caller's thread by result()
            self.error = e
        finally:
            self.busy = False

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def exit_worker(code):
    """Exit, output flushed. A torchrun worker, or a process still saving, skips the interpreter's
    teardown: it aborts on torch's C++ threads, which torchrun reports as a failed job."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "RANK" in os.environ or any(getattr(t, "busy", False) for t in threading.enumerate()):
        os._exit(code)
    raise SystemExit(code)


def first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def is_master():
    """Rank 0 of a torchrun job, or a process on its own: the one that prints and writes files."""
    return int(os.environ.get("RANK", 0)) == 0


def log(*args, **kwargs):
    if is_master():
        print(*args, **kwargs)


def warn(message):
    if is_master():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def format_bytes(n):
    """A size in the unit that shows it: 340.0 kB, 1.6 MB, 12.4 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


def percent(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def format_seconds(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def write_atomic(path, text):
    """Whole file or none (a reader or a crash never sees half); a refused write leaves no .tmp."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    except BaseException:
        with suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def write_json(path, obj):
    write_atomic(path, json.dumps(obj, indent=1))


def disk_full(e):
    """Whether an OSError says the disk is full: no space, quota, or file-size limit (ulimit -f)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


MAKE_ROOM = ("free disk space (or raise the quota or file-size limit), then run the same command "
             "again")


def check_apart(**folders):
    """Stop when two of the folders (key: the setting) are one or nested: one script's files would
    land among, and over, the other's."""
    real = {name: os.path.realpath(path) for name, path in folders.items()}
    for (a, pa), (b, pb) in itertools.combinations(real.items(), 2):
        if pa == pb:
            fail(f"{a}={folders[a]} and {b}={folders[b]} are the same folder: give each its own "
                 "folder, side by side")
        if os.path.commonpath([pa, pb]) in (pa, pb):
            (inner, outer) = (a, b) if len(pa) > len(pb) else (b, a)
            fail(f"{inner}={folders[inner]} lies inside {outer}={folders[outer]}: give each its "
                 "own folder, side by side")


# -----------------------------------------------------------------------------
# podgpt's own folders: one writer each, and deletes of only what podgpt made

MARK = ".podgpt"  # in each folder podgpt writes whole (out_dir, data_dir), locked by its writer
# in each temporary folder podgpt makes: a folder without one (a user's) is refused, never deleted
SCRATCH_MARK = "PODGPT_SCRATCH"
# entries podgpt names as its own inside its folders, and the kind each must be: a checkpoint
# folder (or one being written), an atomic write's temporary file, a writability probe, the mark
OWN_NAMES = ((re.compile(r"\.?(tmp-)?step_\d{7}"), "folder"),
             (re.compile(r".+\.tmp|\.write-test-\d+|" + re.escape(MARK)), "file"))


# not filelock: it always creates the file, and its 3.x empties it (the holder's record) each try
def lock_file(path, create=False):
    """path's fd, flock'ed by this process alone (the OS drops it however the process ends); None
    when another process holds it, or (create=False) when there is no such file."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        with suppress(FileNotFoundError):  # its last holder may have removed it (another remade it)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)
        if not create:
            return None


def holder(path):
    """Who holds the folder whose mark is `path`, as its holder wrote it there."""
    try:
        with open(path) as f:
            w = json.load(f)["writer"]
        return f"pid {w['pid']} on {w['host']} since {w['since']}: {w['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which yet"


def make_folders(path):
    """os.makedirs(path); returns the folders it created, innermost first, for remove_empty."""
    made, folder = [], path
    while folder and not os.path.lexists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(path, exist_ok=True)
    return made


def remove_empty(made):
    """Remove the folders make_folders made, as far as they are empty again."""
    for folder in made:
        if not os.path.isdir(folder) or os.listdir(folder):  # gone or in use, as are those above
            return
        remove(folder)


class Folder(AbstractContextManager):
    """A folder one podgpt process writes, held by the OS's lock on its MARK: hold() before reading
    what a run left (it writes nothing), claim() before the first write, release() at the end. It
    must be empty or podgpt's: its mark, or `legacy` entries an earlier podgpt made."""

    def __init__(self, path, setting, legacy=()):
        if not path:  # "" would be the current folder, over the user's files in it
            fail(f"{setting} is empty: give a folder, e.g. --{setting}=FOLDER", code=2)
        self.path, self.setting, self.legacy = path, setting, legacy
        self.mark = os.path.join(path, MARK)
        self.fd, self.made, self.marked = None, [], False  # locked mark; what claim() made

    def __exit__(self, *exc):
        self.release()

    def busy(self):
        fail(f"{self.setting} {self.path} is being written by another podgpt process "
             f"({holder(self.mark)}): wait for it to end (or stop it), or choose another "
             f"{self.setting}")

    def unwritable(self, what, e):
        fail(f"{what} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else f"choose another {self.setting}"))

    def hold(self):
        if os.path.isfile(self.mark):
            self.fd = lock_file(self.mark)
            if self.fd is None and os.path.isfile(self.mark):
                self.busy()
        if self.fd is None and os.path.isdir(self.path):
            theirs = sorted(n for n in os.listdir(self.path) if n != MARK)
            if theirs and not any(os.path.exists(os.path.join(self.path, p)) for p in self.legacy):
                fail(f"{self.setting} {self.path} holds files podgpt did not write "
                     f"({', '.join(theirs[:3])}{', ...' if len(theirs) > 3 else ''}): "
                     "give a new or empty folder, or a podgpt run's own")
        return self

    def claim(self):
        if self.fd is None:
            self.hold()  # another process may have started on it since hold()
        if self.fd is None:
            try:
                self.made = make_folders(os.path.abspath(self.path))
                self.marked = not os.path.exists(self.mark)
                self.fd = lock_file(self.mark, create=True)
            except OSError as e:
                self.unwritable(f"{self.setting} {self.path} is not writable", e)
            if self.fd is None:
                self.busy()
        try:
            record = dict(podgpt=self.setting, writer=writer_record())
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(record).encode() + b"\n", 0)
        except OSError as e:
            self.unwritable(f"cannot write {self.mark}", e)
        return self

    def release(self):
        """Unlock; what claim() made goes if nothing else was written there (a run refused)."""
        if self.fd is None:
            return
        if self.marked and os.listdir(self.path) == [MARK]:
            remove(self.mark)
            remove_empty(self.made)
        os.close(self.fd)
        self.fd, self.made, self.marked = None, [], False


def writer_record():
    return dict(pid=os.getpid(), host=socket.gethostname(),
                command=" ".join([sys.executable, *sys.argv]),
                since=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def marked(path):
    """The mark a folder holds that says podgpt made it, or None."""
    return next((m for m in (MARK, SCRATCH_MARK) if os.path.isfile(os.path.join(path, m))), None)


scratch_locks = {}  # the real path of each scratch folder's mark this process made: its locked file


def files_under(path):
    """Every file under folder path, relative, '/'-separated, sorted (a link as a file, an empty
    folder as "name/"): what an export or a bundle records as its own. OSError when unreadable."""
    found = []

    def unreadable(e):
        raise e

    for root, dirs, files in os.walk(path, onerror=unreadable):
        rel = os.path.relpath(root, path).replace(os.sep, "/")
        entries = files + [d for d in dirs if os.path.islink(os.path.join(root, d))]
        if rel != "." and not files and not dirs:
            entries = [""]  # the empty folder itself
        found += [name if rel == "." else f"{rel}/{name}" for name in entries]
    return sorted(found)


def remove(path):
    """Delete `path`, which podgpt made: a folder holding one of its marks that no other process
    holds, or an entry named as podgpt names its own and of that name's kind (OWN_NAMES; never a
    link). Every delete podgpt makes goes through here; anything else stays, with one line."""
    is_dir = os.path.isdir(path) and not os.path.islink(path)
    if is_dir and not os.listdir(path):  # an empty folder: nothing in it to lose
        os.rmdir(path)
        return
    is_file = os.path.isfile(path) and not os.path.islink(path)
    kind = "folder" if is_dir else "file" if is_file else None
    mark = marked(path) if is_dir else None
    fd = None
    if mark:  # held by a live podgpt process: its own to delete, not ours
        mark = os.path.join(path, mark)
        fd = scratch_locks.pop(os.path.realpath(mark), None)
        if fd is None and (fd := lock_file(mark)) is None and os.path.isfile(mark):
            fail(f"{path} is in use by another podgpt process ({holder(mark)}): wait for it to "
                 "end, or stop it")
    elif not any(p.fullmatch(os.path.basename(path)) and kind == want for p, want in OWN_NAMES):
        fail(f"{path} is in podgpt's way and podgpt did not make it"
             + (f" (it holds no {SCRATCH_MARK} file)" if is_dir else "")
             + ": move or rename it, then rerun")
    try:
        if is_dir:
            shutil.rmtree(path)
        else:
            os.remove(path)
    finally:
        if fd is not None:
            os.close(fd)


def in_use(path):
    """Who holds scratch folder `path` (another live process), or None."""
    mark = os.path.join(path, SCRATCH_MARK)
    if os.path.realpath(mark) in scratch_locks or not os.path.isfile(mark):
        return None
    if (fd := lock_file(mark)) is not None:
        os.close(fd)
    return holder(mark) if fd is None and os.path.isfile(mark) else None


def make_scratch(path):
    """The empty folder `path` for temporary files, its mark locked until finish_scratch or exit;
    what an interrupted run left there (marked, no live holder) goes first, anything else stays."""
    remove_scratch(path)
    os.makedirs(path)
    mark = os.path.join(path, SCRATCH_MARK)
    record = dict(podgpt="scratch: temporary files, safe to delete", writer=writer_record())
    with open(mark, "w") as f:
        f.write(json.dumps(record) + "\n")
    scratch_locks[os.path.realpath(mark)] = lock_file(mark)
    return path


def finish_scratch(path, at):
    """Scratch folder `path`, renamed to `at`, is the result: its mark and lock go."""
    fd = scratch_locks.pop(os.path.realpath(os.path.join(path, SCRATCH_MARK)), None)
    os.remove(os.path.join(at, SCRATCH_MARK))
    if fd is not None:
        os.close(fd)


def remove_scratch(path):
    """Remove a folder make_scratch made, if one is there (see remove)."""
    if os.path.lexists(path):
        remove(path)


def compute_dtype(name, dev):
    """The torch dtype of `dtype=name`: auto is bfloat16 on a GPU that has it, else float32."""
    import torch
    if name == "auto":
        name = "bfloat16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if name not in ("float32", "bfloat16", "float16"):
        fail(f"dtype={name!r} is not one of auto, float32, bfloat16, float16")
    return getattr(torch, name)


def dtype_name(dt):
    return str(dt).removeprefix("torch.")


def autocast(dev, dt):
    import torch
    return nullcontext() if dt == torch.float32 else torch.autocast(dev.type, dtype=dt)


def peak_memory_gb(device):
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def resolve_device(name, local_rank=None, cuda_count=None):
    """The torch.device for `device=name`; ValueError names the fix. local_rank: torchrun's (None
    outside it); cuda_count: the GPUs CUDA sees (None: ask torch). auto: the GPU if any, else the
    CPU; cuda: cuda:LOCAL_RANK under torchrun, else cuda:0; cuda:N only outside torchrun."""
    import torch
    if name == "cpu":
        return torch.device("cpu")
    if name not in ("auto", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ValueError(f"device={name!r} is not one of auto, cpu, cuda, cuda:N")
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count == 0:
        if name == "auto":
            return torch.device("cpu")
        raise ValueError(f"device={name} but CUDA is not available here (torch "
                         f"{torch.__version__}, CUDA build {torch.version.cuda}): use --device=cpu")
    if name.startswith("cuda:") and local_rank is not None:
        raise ValueError(f"device={name} under torchrun: every rank takes its own GPU "
                         "(cuda:LOCAL_RANK), give --device=cuda")
    index = int(name[5:]) if name.startswith("cuda:") else (local_rank or 0)
    if index >= cuda_count:
        where = f"LOCAL_RANK {index}" if local_rank is not None else f"device={name}"
        fix = (f"launch at most --nproc_per_node={cuda_count}" if local_rank is not None
               else f"give --device=cuda:0 to cuda:{cuda_count - 1}")
        raise ValueError(f"{where} but this machine has {cuda_count} "
                         f"GPU{'s' * (cuda_count > 1)}: {fix}")
    return torch.device("cuda", index)


def setup(device, group=False, timeout_minutes=30.0):
    """This process's dev, rank, world, torchrun and distributed. Under torchrun, or group=True (a
    group of one, as fsdp needs), joins the process group: NCCL on GPUs, gloo on the CPU, its
    collectives failing after timeout_minutes (env PODGPT_DDP_TIMEOUT_MINUTES overrides). Sets
    PYTORCH_ALLOC_CONF first, unless it or PYTORCH_CUDA_ALLOC_CONF (it would override) is set."""
    import torch
    import torch.distributed as dist
    env, torchrun = os.environ, "RANK" in os.environ
    if "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        # CUDA's allocator grows segments in place rather than leave a freed block idle
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    rank, local_rank, world = (int(env["RANK"]), int(env.get("LOCAL_RANK", 0)),
                               int(env.get("WORLD_SIZE", 1))) if torchrun else (0, 0, 1)
    try:
        dev = resolve_device(device, local_rank if torchrun else None)
    except ValueError as e:
        fail(str(e))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    distributed = torchrun or group
    if distributed and not dist.is_initialized():
        # a rank that dies or hangs fails the others' collectives after this, not never
        minutes = float(env.get("PODGPT_DDP_TIMEOUT_MINUTES", timeout_minutes))
        timeout = timedelta(minutes=minutes)
        options = {} if torchrun else dict(store=dist.HashStore(), rank=0, world_size=1)
        if dev.type == "cuda":  # binds the group to this rank's GPU (barrier() would guess it)
            options["device_id"] = dev
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout, **options)
    return SimpleNamespace(dev=dev, rank=rank, world=world, torchrun=torchrun,
                           distributed=distributed)


def device_mesh(dev):
    """The 1-D mesh FSDP2 shards over: this run's group, on its device type. fully_shard's default,
    CUDA's on a GPU machine, would put a CPU run's rank 1 on a cuda:1 that may not exist."""
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


def on_rank0(distributed, fn):
    """fn() on rank 0 alone (the rank that writes a run's files); an Error it raises stops every
    rank with the same line, where the others would wait at their next collective until timeout."""
    box = [None]
    if is_master():
        try:
            fn()
        except Error as e:
            box = [(str(e), e.code)]
    if distributed:
        import torch.distributed as dist
        dist.broadcast_object_list(box)
    if box[0]:
        fail(*box[0])


def mean_over_ranks(value, distributed, device):
    import torch
    import torch.distributed as dist
    t = torch.tensor(float(value), device=device)
    if distributed:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def catch_signals():
    """Preemption notices: noted in the list returned, acted on at the next step by every rank."""
    stop_signal = []

    def on_signal(signum, frame):
        if stop_signal and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        stop_signal.append(signal.Signals(signum).name)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, on_signal)
    return stop_signal


@contextmanager
def signals_held(*signals):
    """Run the block with these signals held back, then act on those that came. Not
    pthread_sigmask: it blocks one thread, and numpy's BLAS threads would take the signal."""
    came = []
    handlers = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for s in came:
            signal.raise_signal(s)
