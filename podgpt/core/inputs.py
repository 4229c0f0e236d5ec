"""Reading what a user or an earlier run left: a JSON file or a checkpoint pointer is its value,
or util.Error's one line naming the file and the fix, however it is damaged (never a traceback)."""

import json
import os

from podgpt.core.util import fail, first_line


def why(e):
    # json's decoder recurses once per bracket: a file nested a few thousand deep overflows it
    return "nested too deeply" if isinstance(e, RecursionError) else first_line(e)


def read_json(path, fix, name=None, code=1):
    """path's JSON value; else one line, "NAME cannot be read (why): FIX" (name: path)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        fail(f"{name or path} cannot be read ({why(e)}): {fix}", code)


def read_pointer(path):
    """The checkpoint folder's name a pointer file (ckpt/latest, ckpt/best) holds, None when there
    is none; a pointer that is not a folder's name is one line naming it."""
    try:
        with open(path, "rb") as f:
            name = f.read(4096).decode("utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError:
        name, problem = None, "not UTF-8 text"
    except OSError as e:
        name, problem = None, why(e)
    else:
        problem = None if os.path.basename(name) == name and "\0" not in name else "not a name"
    if problem:
        fail(f"{path} is damaged ({problem}): delete it (the newest intact checkpoint is then "
             "used) or write a checkpoint folder's name into it, then rerun")
    return name or None
