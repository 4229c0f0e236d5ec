"""
Export a podgpt checkpoint as a Hugging Face Llama folder (transformers, vLLM).

    python export.py --ckpt=out/tiny --out=export/tiny              # the run's best checkpoint
    python export.py --ckpt=out/tiny --which=latest --out=export/tiny --dtype=bfloat16
    python export.py config/tiny.py --out=export/tiny               # the run a config names

The folder holds config.json (LlamaForCausalLM; vocab_size the tokenizer's), model.safetensors (or
shards and an index past max_shard_gb; a tied head stored once; one row per token, so no output
takes probability from the padding rows training had), generation_config.json (a reply ends at
EOS), tokenizer.json and tokenizer_config.json for transformers (none for the char tokenizer),
podgpt_padding/ (those padding rows, which podgpt reads back), podgpt_tokenizer/ (the
checkpoint's own tokenizer files, which sample.py reads), podgpt.json (the
model config; where it came from, as run/ckpt/checkpoint, never a local path; its step and losses;
the files a later export to the same --out may replace) and README.md, a model card. Every file
gets a new file's mode (0644 under umask 022). podgpt/release/hf.py builds it beside --out.
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import os
import sys

from podgpt.core import configurator
from podgpt.core.checkpoint import find_checkpoint, reading
from podgpt.core.util import MAKE_ROOM, check_apart, disk_full, fail, first_line, run_main
from podgpt.release.hf import export

# --- config
ckpt = ""                       # a checkpoint folder, or an out_dir (see which); "": out_dir
which = "best"                  # for an out_dir: best (lowest val loss; latest if none) | latest
out_dir = "out"                 # used when ckpt is empty (a run's config file names its out_dir)
out = ""                        # the folder to write (required); an earlier export is replaced
dtype = "float32"               # dtype of the saved weights: float32 | bfloat16
max_shard_gb = 5.0              # weights larger than this are split into shards with an index
chat_template = False           # an SFT model's chat template; the chat markers read as tokens
# --- end config


def main(argv):
    config = configurator.configure(__file__, argv)
    if config.which not in ("best", "latest"):
        fail(f"which={config.which!r} is not one of best, latest")
    if not config.out:
        fail("no --out: give the folder to write, e.g. --out=export/tiny")
    src = config.ckpt or config.out_dir
    path = find_checkpoint(src, config.which) if os.path.isdir(src) else None
    if path is None:
        fail(f"no checkpoint in {src!r}: train first or pass --ckpt=OUT_DIR or a checkpoint folder")
    check_apart(out=config.out, ckpt=src)
    try:
        with reading(src, config.which) as path:  # held against a run's rotation while it is read
            export(path, config.out, config.dtype, config.max_shard_gb, config.chat_template)
    except ValueError as e:
        fail(f"checkpoint {path} cannot be used: {e}")
    except OSError as e:  # a read-only place, a full disk
        fail(f"cannot write out={config.out} ({first_line(e)}): "
             + (MAKE_ROOM if disk_full(e) else "choose another --out"))
    print(f"exported {path} to {config.out}")


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
