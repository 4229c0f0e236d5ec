"""A trained model ready to use, as sample.py and eval.py take it: a checkpoint folder, a run's
out_dir (its best or latest checkpoint) or an export; the model in eval mode on a device and its
tokenizer. A checkpoint is held against the run's rotation while it is read; a problem is one line
naming the fix."""

import contextlib
import os
from types import SimpleNamespace

from podgpt.core.checkpoint import find_checkpoint, reading
from podgpt.pod.checkpoints import load_model
from podgpt.release.hf import finite, is_export, load_export, read_trainer, tokenizer_dir
from podgpt.core.tokenizer import load_tokenizer
from podgpt.core.util import fail, first_line


def locate(src, which):
    """What `src` names: src, which, exported (an export folder), path (the export, or the
    checkpoint folder find_checkpoint picks); one line with the fix when there is none."""
    exported = is_export(src)
    path = src if exported else find_checkpoint(src, which)
    if path is None:
        fail(f"no checkpoint in {src!r}: train first or pass --ckpt=OUT_DIR or a checkpoint folder")
    return SimpleNamespace(src=src, which=which, exported=exported, path=path)


def load_trained(found, dev, info=False):
    """path, exported, model, tok and (info=True) checkpoint_info of what locate found."""
    src, which, exported, path = found.src, found.which, found.exported, found.path
    with contextlib.ExitStack() as held:  # a checkpoint is held against the run's rotation
        try:
            if not exported:
                path = held.enter_context(reading(src, which))
            model, saved = (load_exported(path, dev) if exported
                            else load_model(path, dev, verify=False))
            details = checkpoint_info(path, exported, saved) if info else None
        except ValueError as e:
            fail(f"checkpoint {path} cannot be used: {e}: pick another "
                 "(--ckpt=<folder>, --which=latest)")
        try:
            tok = load_tokenizer(tokenizer_dir(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"{path}: its tokenizer files do not load ({first_line(e)}): pick another "
                 f"checkpoint (--ckpt=<folder>, --which=latest) or export it again")
    return SimpleNamespace(path=path, exported=exported, model=model, tok=tok, info=details)


def load_exported(path, dev):
    """load_export(path, dev), or one line naming what cannot be read and the fix."""
    try:
        from safetensors import SafetensorError  # an export's weights need it, a checkpoint's not
    except ImportError:
        fail(f"safetensors is not installed, and export {path} needs it: pip install safetensors")
    again = f"export its checkpoint again (python export.py --ckpt=CHECKPOINT --out={path})"
    try:
        return load_export(path, dev)
    except SafetensorError as e:  # a truncated or damaged weights file (it is no ValueError)
        fail(f"export {path}: {', '.join(unreadable_weights(path))} cannot be read "
             f"({first_line(e)}): {again}")
    except ValueError as e:  # podgpt.json unreadable or unknown to model.py, or weights that misfit
        fail(f"export {path} cannot be used: {e}: {again}")


def unreadable_weights(path):
    """The safetensors files of an export that safetensors cannot open (a truncated one); all of
    them if each opens, as one failed further in."""
    from safetensors import safe_open

    def opens(name):
        try:
            with safe_open(os.path.join(path, name), "pt"):
                return True
        except Exception:  # SafetensorError, or OSError for a file that cannot be read at all
            return False
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    return [n for n in names if not opens(n)] or names


def checkpoint_info(path, exported, saved):
    """Step, validation losses and model config of a checkpoint (trainer.pt; `saved`: config.json)
    or an export (`saved`: podgpt.json)."""
    trainer = saved if exported else read_trainer(path)
    return {"checkpoint": path, "exported": exported, "step": trainer.get("step"),
            "val_loss": finite(trainer.get("val_loss")),
            "best_val_loss": finite(trainer.get("best_val_loss")), "model": saved["model"]}
