"""
Generate text from a trained checkpoint, streaming it as it comes.

    python sample.py --ckpt=out                      # the best checkpoint of a run (lowest validation loss)
    python sample.py --ckpt=out --which=latest       # its newest checkpoint instead
    python sample.py --ckpt=out/ckpt/step_0000600 --prompt="def main(" --temperature=0.8
    python sample.py config/tiny.py                  # the run a config file describes (its out_dir)

Every checkpoint folder holds the model, its config and the tokenizer files, so
nothing else (no data folder, no network) is needed. Each sample starts with the
BOS token that begins every training document, followed by the prompt.
"""

import codecs
import sys

import torch

import configurator
from prepare import load_tokenizer
from export import is_export, load_export, tokenizer_dir
from train import find_checkpoint, first_line, load_model

# --- config
ckpt = ""                       # a checkpoint folder, or an out_dir (see which); "": out_dir
which = "best"                  # for an out_dir: best (lowest validation loss; latest if none evaluated) | latest
out_dir = "out"                 # used when ckpt is empty (so a run's config file finds its checkpoint)
prompt = ""                     # text the samples continue
prompt_file = ""                # read the prompt from this file instead
num_samples = 1                 # samples to draw, one after the other
max_new_tokens = 256            # tokens generated per sample
temperature = 0.8               # 0: greedy; higher: more random
top_k = 200                     # sample among the k most likely tokens; 0: all
top_p = 1.0                     # nucleus sampling: smallest set of tokens with this much probability
seed = 1337                     # sampling seed
device = "auto"                 # auto (cuda if available) | cpu | cuda
# --- end config


def main(argv):
    config = configurator.configure(__file__, argv)
    if config["which"] not in ("best", "latest"):
        print(f"error: which={config['which']!r} is not one of best, latest", file=sys.stderr)
        raise SystemExit(2)
    src = config["ckpt"] or config["out_dir"]
    exported = is_export(src)
    path = src if exported else find_checkpoint(src, config["which"])
    if path is None:
        print(f"error: no checkpoint in {config['ckpt'] or config['out_dir']!r}: "
              f"train first or pass --ckpt=OUT_DIR or a checkpoint folder", file=sys.stderr)
        raise SystemExit(1) from None
    if config["max_new_tokens"] < 0 or config["num_samples"] < 1 or config["temperature"] < 0:
        print("error: need max_new_tokens >= 0, num_samples >= 1 and temperature >= 0", file=sys.stderr)
        raise SystemExit(2)
    text = config["prompt"]
    if config["prompt_file"]:
        try:
            with open(config["prompt_file"], encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: cannot read prompt_file {config['prompt_file']} ({first_line(e)}): "
                  f"give a UTF-8 text file or --prompt=TEXT", file=sys.stderr)
            raise SystemExit(1) from None

    dev = config["device"] if config["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model, _ = load_export(path, dev) if exported else load_model(path, dev)
    except ValueError as e:
        print(f"error: checkpoint {path} cannot be used: {e}: pick another (--ckpt=<folder>, --which=latest)",
              file=sys.stderr)
        raise SystemExit(1) from None
    tok = load_tokenizer(tokenizer_dir(path))
    ids = torch.tensor([[tok.bos_id] + tok.encode(text)], device=dev)
    generator = torch.Generator(device=dev).manual_seed(config["seed"])
    print(f"# {path}", file=sys.stderr)
    for i in range(config["num_samples"]):
        # tokens may end inside a multi-byte character: decode the byte stream incrementally
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(text)
        for token in model.generate(ids, config["max_new_tokens"], temperature=config["temperature"],
                                    top_k=config["top_k"] or None, top_p=config["top_p"], generator=generator):
            sys.stdout.write(decoder.decode(tok.decode_bytes([token.item()])))
            sys.stdout.flush()
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        if i < config["num_samples"] - 1:
            print("-" * 40)


if __name__ == "__main__":
    main(sys.argv[1:])
