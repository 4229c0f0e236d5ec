"""
Checkpoint folders: write, verify, commit, rotate, find, load (the run's view of them:
podgpt/pod/checkpoints.py). ckpt/step_NNNNNNN/ is written as ckpt/.tmp-step_NNNNNNN/, each file
fsync'd, complete.json (sizes, CRC32s) last, then renamed into place and named by latest (and
best): a kill at any moment leaves the previous checkpoint intact, and a damaged one is caught when
read back. Rank 0 writes model.pt and optimizer.pt, or several ranks write state/ with
torch.distributed.checkpoint, each its part (fsdp's shards, ddp's share_of); muon's ddp runs
(DCP does not take its optimizer) write on rank 0. Either resumes at any world size.
"""

import fcntl
import json
import os
import random
import re
import shutil
import warnings
import zlib
from contextlib import contextmanager, suppress
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from podgpt.core import inputs
from podgpt.core.util import (CutShortThread, Error, fail, first_line, format_bytes, lock_file,
                              remove, warn)

CKPT_FORMAT = 2
MARKER = "complete.json"  # written last into a checkpoint folder: file sizes and CRC32s
STATE_DIR = "state"  # a sharded checkpoint's model and optimizer, as DCP writes them
# why a save did not reach the disk: min_free_gb kept it off a disk that had room for it, or not
SKIPPED, FAILED = "skipped", "failed"
PREEMPT_SAVE_SECONDS = 25  # a save slower than this would not fit between SIGTERM and SIGKILL
# the names podgpt gives its checkpoint folders: a user's step_0000010.bak or notes beside them
# are never read, rotated or removed
STEP_NAME, TMP_NAME = re.compile(r"step_\d{7}"), re.compile(r"\.tmp-step_\d{7}")


# -----------------------------------------------------------------------------
# files

class _CRC32Writer:
    """Checksums what is written through it, so that saving reads nothing back."""

    def __init__(self, f):
        self.f, self.crc = f, 0

    def write(self, b):
        self.crc = zlib.crc32(b, self.crc)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def save_file(obj, path):
    """Write bytes or a torch object to path, fsync'd; its CRC32. OSError when the disk refuses."""
    with open(path, "wb") as f:
        w = _CRC32Writer(f)
        if isinstance(obj, bytes):
            w.write(obj)
        else:
            try:
                torch.save(obj, w)
            except RuntimeError as e:  # torch's zip writer reports a refused write as its own error
                raise OSError(f"torch.save could not write {path}: {first_line(e)}") from e
        f.flush()
        os.fsync(f.fileno())
    return w.crc


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pointer(ckpt_root, which, name):
    save_file(name.encode(), os.path.join(ckpt_root, f"{which}.tmp"))
    os.replace(os.path.join(ckpt_root, f"{which}.tmp"), os.path.join(ckpt_root, which))


def read_pointer(ckpt_root, which):
    """The name a pointer holds, or None, also when damaged: a run goes on (it rewrites latest)."""
    try:
        return inputs.read_pointer(os.path.join(ckpt_root, which))
    except Error:
        return None


def leaves(obj):
    """What nested dicts, lists and tuples hold."""
    if isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from leaves(v)
    else:
        yield obj


def tensor_bytes(obj):
    """The bytes of the tensors and bytes objects in obj."""
    return sum(x.numel() * x.element_size() if torch.is_tensor(x) else
               len(x) if isinstance(x, bytes) else 0 for x in leaves(obj))


def file_crc32(path):
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# -----------------------------------------------------------------------------
# writing

def room_for(ckpt_root, step, need, min_free_gb):
    """None when the disk holds `need` more bytes and keeps min_free_gb free; else, with a warning,
    SKIPPED (it has room for the checkpoint, not for min_free_gb beside it) or FAILED (no room)."""
    free = shutil.disk_usage(ckpt_root).free
    if free - need >= min_free_gb * 1e9:
        return None
    where = f"it needs {format_bytes(need)} and {ckpt_root} has {format_bytes(free)} free"
    if free < need:
        warn(f"skipping the step {step} checkpoint: {where} (ckpt_min_free_gb={min_free_gb}); "
             f"training goes on: free disk space")
        return FAILED
    warn(f"skipping the step {step} checkpoint: {where}, and saving it would leave less than "
         f"ckpt_min_free_gb={min_free_gb} GB free; training goes on: lower ckpt_min_free_gb or "
         f"free disk space")
    return SKIPPED


def write_shards(state_dir, sharded, group=None):
    """This rank's part of the sharded state, written by DCP into state_dir: {file: size, CRC32}."""
    import torch.distributed.checkpoint as dcp  # only sharded runs import it: see model.shard_model
    # DCP stages tensors through a CUDA stream wherever CUDA exists: a CPU run's are written as they
    # are, so that a CPU run on a GPU machine never reaches into a GPU
    on_cpu = all(t.device.type == "cpu" for t in leaves(sharded) if torch.is_tensor(t))
    writer = dcp.FileSystemWriter(state_dir, **({"per_thread_copy_ahead": 0} if on_cpu else {}))
    dcp.save(sharded, storage_writer=writer, process_group=group)
    # DCP names each rank's data __<rank>_<n>.distcp; rank 0 also writes .metadata
    rank, marker = dist.get_rank(), {}
    for f in os.listdir(state_dir):
        if f.startswith(f"__{rank}_") or (rank == 0 and not f.startswith("__")):
            path = os.path.join(state_dir, f)
            marker[f"{STATE_DIR}/{f}"] = dict(bytes=os.path.getsize(path), crc32=file_crc32(path))
    return marker


def save_errors(sharded):
    """What a failing disk raises in a save: OSError, and DCP's CheckpointException."""
    if sharded is None:
        return (OSError,)
    import torch.distributed.checkpoint as dcp
    return OSError, dcp.api.CheckpointException


def write_files(folder, files):
    """`files` ({name: bytes or torch object}) into folder, fsync'd, each in a thread (torch.save's
    copies and the CRC32 leave the GIL): {file: size, CRC32}. Torch's own per-record CRC32, a second
    pass, is off meanwhile: process-wide, but one save runs at a time, and no other torch.save."""
    crc_options = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        writers = {name: CutShortThread(partial(save_file, obj, os.path.join(folder, name)),
                                        "checkpoint-writer") for name, obj in files.items()}
        for writer in writers.values():  # all done before an error is raised: the caller cleans up
            writer.join()
        crcs = {name: writer.result() for name, writer in writers.items()}
    finally:
        torch.serialization.set_crc32_options(crc_options)
    return {name: dict(bytes=os.path.getsize(os.path.join(folder, name)), crc32=crc)
            for name, crc in crcs.items()}


def commit(ckpt_root, tmp, step, marker, best, keep_last):
    """Rank 0's end of a save: the marker, the rename, the pointers, the rotation. The folder, or
    None (see abandon) when the disk refused."""
    name = f"step_{step:07d}"
    try:
        save_file(json.dumps(dict(step=step, files=marker), indent=1).encode(),
                  os.path.join(tmp, MARKER))
        if os.path.isdir(os.path.join(tmp, STATE_DIR)):
            fsync_dir(os.path.join(tmp, STATE_DIR))
        fsync_dir(tmp)
    except OSError as e:
        return abandon(ckpt_root, tmp, step, first_line(e))
    final = os.path.join(ckpt_root, name)
    if os.path.lexists(final):  # the same step saved again (a rollback replayed it)
        remove_unread(final)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    try:
        write_pointer(ckpt_root, "latest", name)
        if best:
            write_pointer(ckpt_root, "best", name)
    except OSError as e:  # whole on disk, but a pointer still names an older one: keep them all
        for left in (os.path.join(ckpt_root, w) for w in ("latest.tmp", "best.tmp")):
            with suppress(OSError):
                if os.path.lexists(left):
                    remove(left)
        warn(f"the step {step} checkpoint is whole in {final}, but ckpt/latest (or best) could not "
             f"name it ({first_line(e)}), so none is rotated away; training goes on: free disk "
             f"space for {ckpt_root}")
        return final
    keep = read_pointer(ckpt_root, "best")
    for old in step_folders(ckpt_root)[keep_last:]:  # newest first
        if old != keep:
            remove_unread(os.path.join(ckpt_root, old))
    return final


def remove_unread(path):
    """Remove a checkpoint folder unless a reader holds it (see reading): a later rotation will."""
    try:
        fd = lock_file(os.path.join(path, MARKER))
    except OSError:  # no marker, or unreadable: an incomplete folder, which nobody reads
        fd = None
    if fd is None and os.path.exists(os.path.join(path, MARKER)):
        return
    try:
        remove(path)
    finally:
        if fd is not None:
            os.close(fd)


def abandon(ckpt_root, tmp, step, error):
    """Drop a partial checkpoint folder and keep training; None."""
    with suppress(OSError):  # the disk that failed the save may fail this too: a later save will
        if os.path.lexists(tmp):
            remove(tmp)
    warn(f"the step {step} checkpoint failed ({error}); training goes on: free disk space or "
         f"check {ckpt_root}")


def save_checkpoint(ckpt_root, step, files, keep_last, best, min_free_gb, sharded=None, group=None):
    """Write `files` ({name: bytes or torch object}) as ckpt_root/step_NNNNNNN: (the folder, None),
    or (None, SKIPPED or FAILED: see room_for) when it did not reach the disk, on every rank.
    sharded: {"model", "optimizer"} of DTensors (fsdp) or this rank's share_of (ddp): every rank
    calls this and writes its part with DCP on `group`; rank 0 alone writes `files`, then the
    marker and the pointers."""
    tmp = os.path.join(ckpt_root, f".tmp-step_{step:07d}")
    master = sharded is None or dist.get_rank() == 0
    go = [None]  # why the save does not start, or None
    if master:
        for leftover in os.listdir(ckpt_root):  # of a save that was killed
            if TMP_NAME.fullmatch(leftover):
                remove(os.path.join(ckpt_root, leftover))
        # the whole checkpoint, as on a shared disk: a DTensor's numel is the global one, a ddp
        # share ~1/world of it
        ddp = sharded is not None and all(type(t) is torch.Tensor for t in leaves(sharded)
                                          if torch.is_tensor(t))
        world = dist.get_world_size(group) if ddp else 1
        go = [room_for(ckpt_root, step, tensor_bytes(files) + tensor_bytes(sharded) * world,
                       min_free_gb)]
    if sharded is not None:  # also keeps the other ranks out until the leftovers are gone
        dist.broadcast_object_list(go, group=group)
    if go[0]:
        return None, go[0]
    marker, error = {}, None
    try:
        os.makedirs(tmp, exist_ok=True)
        if sharded is not None:
            marker.update(write_shards(os.path.join(tmp, STATE_DIR), sharded, group))
        if master:
            marker.update(write_files(tmp, files))
    except save_errors(sharded) as e:  # the disk filled up after all, or went away
        error = first_line(e)
    if sharded is not None:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (marker, error), group=group)
        marker = {k: v for m, _ in gathered for k, v in m.items()}
        error = next((e for _, e in gathered if e), None)
    final = (abandon(ckpt_root, tmp, step, error) if error else
             commit(ckpt_root, tmp, step, marker, best, keep_last)) if master else None
    if sharded is not None:
        dist.broadcast_object_list(result := [final], group=group)
        final = result[0]
    return final, None if final else FAILED


def share_of(state, rank, world):
    """Rank `rank`'s part of a ddp run's state ({"model", "optimizer"} by parameter name): each
    parameter with its optimizer state, largest first, to the rank with the fewest bytes so far;
    param_groups to every rank (DCP writes a key that several ranks hold once)."""
    model, optim = state["model"], state["optimizer"]
    size = {n: tensor_bytes([model.get(n), optim["state"].get(n)])
            for n in set(model) | set(optim["state"])}
    loads, mine = [0] * world, set()
    for name in sorted(size, key=lambda n: (-size[n], n)):
        least = loads.index(min(loads))
        loads[least] += size[name]
        if least == rank:
            mine.add(name)
    return dict(model={n: t for n, t in model.items() if n in mine},
                optimizer=dict(optim, state={n: s for n, s in optim["state"].items() if n in mine}))


def checkpoint_bytes(path):
    """The bytes of a checkpoint's files, every rank's shards included."""
    with open(os.path.join(path, MARKER)) as f:
        return sum(m["bytes"] for m in json.load(f)["files"].values())


def too_slow_for_preemption(gb, seconds, shared, world):
    """What is wrong with `gb` written in `seconds` (over PREEMPT_SAVE_SECONDS), and the fix.
    shared: the ranks share the write (not with muon's optimizer under ddp)."""
    fix = (f"put out_dir on a disk that writes {gb / PREEMPT_SAVE_SECONDS:.1f} GB/s or more "
           f"(local NVMe, not a network volume)")
    if not shared and world > 1:  # muon's ddp runs
        fix += (f", or train with optimizer=adamw: each of the {world} ranks then writes 1/{world} "
                f"of it at once")
    return (f"{gb:.1f} GB written in {seconds:.0f}s ({gb / seconds:.2f} GB/s): more than the ~30 "
            f"s torchrun and most clouds leave between SIGTERM and SIGKILL, and a stop also waits "
            f"for a save in flight, so a preemption would lose the steps since the last "
            f"checkpoint; {fix}")


# -----------------------------------------------------------------------------
# saving in the background

# Ours, not DCP's stagers: theirs allocate at the first stage(), which would block the first save
class Staging:
    """CPU copies of state dicts, written while training goes on. Buffers are kept by their place
    in the dict; on a GPU they are pinned (full-speed copies), seconds to allocate for a 1B model:
    reserve() allocates them in a thread while the first steps run."""

    def __init__(self, dev):
        self.dev, self.pin, self.buffers, self.reserving = dev, dev.type == "cuda", {}, None

    def reserve(self, obj):
        """Allocate the buffers copy(obj) will fill, each touched so its pages are mapped."""
        wanted = {}
        self._walk(obj, "", {}, lambda p, t: type(t) is torch.Tensor and wanted.setdefault(
            p, (t.shape, t.dtype)))

        def allocate():
            for place, (shape, dtype) in wanted.items():
                self.buffers[place] = torch.empty(shape, dtype=dtype, pin_memory=self.pin).zero_()
        self.reserving = CutShortThread(allocate, "checkpoint-staging")

    def copy(self, obj):
        """obj with every tensor replaced by a CPU copy; tensors that share memory (tied
        embeddings) share it, so torch.save writes it once, as it would the originals."""
        if self.reserving is not None:
            self.reserving.result()
            self.reserving = None
        copied = self._walk(obj, "", {}, self._buffer)
        if self.pin:  # the copies from the GPU run asynchronously: the writer needs them whole
            torch.cuda.synchronize(self.dev)
        return copied

    def _walk(self, obj, place, seen, to):
        """obj with each plain tensor t replaced by to(its place, t), once for shared memory."""
        if isinstance(obj, dict):
            return {k: self._walk(v, f"{place}/{k}", seen, to) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v, f"{place}/{i}", seen, to) for i, v in enumerate(obj))
        if not torch.is_tensor(obj):
            return obj  # numbers, strings, bytes, None: never changed in place
        if type(obj) is not torch.Tensor:  # fsdp's DTensor
            return to(place, obj)
        alias = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.shape, obj.stride(),
                 obj.dtype)
        if alias not in seen:
            seen[alias] = to(place, obj)
        return seen[alias]

    def _buffer(self, place, obj):
        if type(obj) is not torch.Tensor:  # fsdp's DTensor: this rank's shard, with its place
            return obj.to("cpu", copy=True)
        buf = self.buffers.get(place)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = self.buffers[place] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=self.pin)
        return buf.copy_(obj, non_blocking=self.pin)


# -----------------------------------------------------------------------------
# reading

def verify_checkpoint(path):
    """Raise ValueError saying what is wrong if the folder is not a complete, intact checkpoint."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            files = {n: dict(bytes=int(m["bytes"]), crc32=int(m["crc32"]))
                     for n, m in json.load(f)["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"incomplete, no readable {MARKER} ({first_line(e)})") from None
    for fname, want in files.items():
        file = os.path.join(path, fname)
        size = os.path.getsize(file) if os.path.exists(file) else "no"
        if size != want["bytes"]:
            raise ValueError(f"{fname} has {size} bytes, {want['bytes']} were written")
        crc = file_crc32(file)
        if crc != want["crc32"]:
            raise ValueError(f"{fname} is corrupt (CRC32 {crc:08x}, {want['crc32']:08x} was "
                             f"written)")


def load_checkpoint(path, device, verify=True):
    """Everything a resume needs from a checkpoint folder, verified; ValueError saying what is
    wrong. A sharded checkpoint's model and optimizer stay on disk: "state" names their folder."""
    if verify:
        verify_checkpoint(path)
    sharded = os.path.isdir(os.path.join(path, STATE_DIR))
    try:
        ckpt = {name: torch.load(os.path.join(path, f"{name}.pt"), weights_only=True,
                                 map_location=device if name != "trainer" else "cpu")
                for name in (("trainer",) if sharded else ("model", "optimizer", "trainer"))}
        if sharded:
            ckpt["state"] = os.path.join(path, STATE_DIR)
        with open(os.path.join(path, "config.json")) as f:
            ckpt["config"] = json.load(f)
    except Exception as e:  # a damaged pickle can raise many kinds of error: all mean "unreadable"
        raise ValueError(f"unreadable ({first_line(e)})") from None
    if ckpt["trainer"].get("format") != CKPT_FORMAT:
        raise ValueError(f"checkpoint format {ckpt['trainer'].get('format')}, this train.py reads "
                         f"{CKPT_FORMAT}")
    return ckpt


def step_folders(ckpt_root):
    """The checkpoint folders' names, newest first: step_NNNNNNN folders alone."""
    return sorted((d for d in os.listdir(ckpt_root) if STEP_NAME.fullmatch(d)
                   and os.path.isdir(os.path.join(ckpt_root, d))), reverse=True)


def newest_good_checkpoint(ckpt_root, device):
    """(path, loaded checkpoint) of the newest intact checkpoint, or (None, None), damaged ones
    skipped with a warning. Rank 0 alone checks the files (every rank reading them whole would
    multiply the reads) and names the one to load."""
    names = step_folders(ckpt_root) if os.path.isdir(ckpt_root) else []
    chosen = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name in names:
            try:
                verify_checkpoint(os.path.join(ckpt_root, name))
                chosen = [name]
                break
            except ValueError as e:
                warn(f"skipping checkpoint {os.path.join(ckpt_root, name)}: {e}")
    if dist.is_initialized():
        dist.broadcast_object_list(chosen)
    if chosen[0] and chosen[0] not in names:
        fail(f"rank 0 resumes from {chosen[0]}, which this rank's {ckpt_root} does not hold: on "
             f"several nodes, out_dir must be a folder every node sees (a shared filesystem)")
    for name in names[names.index(chosen[0]):] if chosen[0] else []:
        path = os.path.join(ckpt_root, name)
        try:  # files that check out can still fail to unpickle
            return path, load_checkpoint(path, device, verify=name != chosen[0])
        except ValueError as e:
            warn(f"skipping checkpoint {path}: {e}")
    return None, None


@contextmanager
def reading(src, which="latest"):
    """The checkpoint folder `src` names (see find_checkpoint), verified and locked shared while
    the caller reads it (a run's rotation waits: remove_unread). From an out_dir, a damaged one
    gives way to the newest intact one, with a warning; ValueError saying why when none is."""
    if os.path.exists(os.path.join(src, MARKER)) or not os.path.isdir(os.path.join(src, "ckpt")):
        candidates, named = [src], src
    else:
        root, named = os.path.join(src, "ckpt"), find_checkpoint(src, which)
        candidates = [named] * bool(named) + [os.path.join(root, d) for d in step_folders(root)
                                              if os.path.join(root, d) != named]
    problem = None
    for path in candidates:
        try:
            f = open(os.path.join(path, MARKER), "rb")
        except OSError as e:
            if path == named:
                problem = f"incomplete, no readable {MARKER} ({first_line(e)})"
            continue
        with f:
            fcntl.flock(f, fcntl.LOCK_SH)
            if not os.path.exists(os.path.join(path, MARKER)):  # rotated away before the lock
                continue
            try:
                verify_checkpoint(path)
            except ValueError as e:
                if len(candidates) == 1:
                    raise
                if path == named:
                    problem = str(e)
                else:
                    warn(f"skipping checkpoint {path}: {e}")
                continue
            if path != named and named:
                warn(f"{named} cannot be used ({problem}): using {path}, the newest intact "
                     f"checkpoint")
            yield path
            return
    raise ValueError(problem or "no checkpoint there")


def find_checkpoint(path, which="latest"):
    """The checkpoint folder `path` names: itself, or an out_dir's latest or best (its latest while
    it has no best); None if none."""
    if os.path.exists(os.path.join(path, MARKER)):
        return path
    ckpt_root = os.path.join(path, "ckpt")
    name = (inputs.read_pointer(os.path.join(ckpt_root, which))
            or inputs.read_pointer(os.path.join(ckpt_root, "latest")))
    return os.path.join(ckpt_root, name) if name else None


def load_sharded(state, path):
    """Fill `state` from a sharded checkpoint, resharded to it: every rank its part under torchrun,
    everything in a process without a process group."""
    import torch.distributed.checkpoint as dcp  # see model.shard_model
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def rng_state():
    numpy = [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()]
    return dict(python=random.getstate(), numpy=numpy, torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None)


def set_rng_state(state):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def optimizer_by_name(model, optimizer, saved):
    """A plain optimizer.state_dict() (parameters numbered in param_groups order) keyed by parameter
    name, the form FSDP's loader takes; both runs build their groups with optim.make_optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    number_to_name = dict(zip((i for g in saved["param_groups"] for i in g["params"]),
                              (names[id(p)] for g in optimizer.param_groups for p in g["params"]),
                              strict=True))
    return dict(state={number_to_name[i]: s for i, s in saved["state"].items()},
                param_groups=[dict(g, params=[number_to_name[i] for i in g["params"]])
                              for g in saved["param_groups"]])
