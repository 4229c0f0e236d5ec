"""
Generate text from a trained checkpoint, streaming it as it comes, or serve it over HTTP.

    python sample.py --ckpt=out                      # the best checkpoint of a run (lowest validation loss)
    python sample.py --ckpt=out --which=latest       # its newest checkpoint instead
    python sample.py --ckpt=out/ckpt/step_0000600 --prompt="def main(" --temperature=0.8
    python sample.py config/tiny.py                  # the run a config file describes (its out_dir)
    python sample.py --ckpt=out --serve=True --port=8000   # an OpenAI-style HTTP API: serve.py

Every checkpoint folder holds the model, its config and the tokenizer files, so
nothing else (no data folder, no network) is needed. Each sample starts with the
BOS token that begins every training document, followed by the prompt. --ckpt may
also name a folder written by export.py. A block-diffusion model (objective=bd3lm) writes a
block at a time: diffusion_steps denoising passes per block, filling the tokens unmask picks
(objectives.py: BlockDiffusionLM.generate); it is not served.

--serve=True loads the model as sampling does and hands it to serve.py, which answers OpenAI-style
completions on FastAPI + uvicorn (pip install fastapi uvicorn) until SIGTERM or Ctrl-C; the serve_*
keys bound what a request may ask and how long it may wait (docs/serving.md describes the API).
"""

import codecs
import sys
import threading

import torch

from podgpt.core import configurator
from podgpt.release.loading import load_trained, locate
from podgpt.research.bd3lm import UNMASKING
from podgpt.core.util import fail, first_line, run_main, setup

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
diffusion_steps = 0             # bd3lm: denoising passes per block; 0: one token per pass (the block's length)
unmask = "schedule"             # bd3lm: which masked tokens a pass fills: schedule (BD3-LM's, random order) | confidence
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N (one process)
serve = False                   # True: answer HTTP (POST /v1/completions, GET /health, /info) instead of printing
host = "127.0.0.1"              # address to listen on; 0.0.0.0 opens it to the network (there is no authentication)
port = 8000                     # port to listen on; 0: any free one (the start line names it)
serve_max_tokens = 1024         # the most max_tokens one request may ask for: bounds how long it holds the model
serve_read_timeout = 30.0       # seconds a client has to send its whole request (headers and body): then 408
serve_max_queue = 8             # completions that may wait while one generates: one more gets 503 at once
serve_max_wait = 10.0           # seconds a completion may wait for the model: then 503, not an unbounded wait
# --- end config


def main(argv):
    config = configurator.configure(__file__, argv)
    if config.which not in ("best", "latest"):
        fail(f"which={config.which!r} is not one of best, latest", code=2)
    found = locate(config.ckpt or config.out_dir, config.which)
    if config.serve:
        from podgpt.release.serve import serve_http  # FastAPI and uvicorn: only the server needs them
        check_ranges(config, port=(lambda v: 0 <= v <= 65535, "0 to 65535 (0: any free port)"),
                     serve_max_tokens=(lambda v: v >= 1, "an integer >= 1"),
                     serve_read_timeout=(lambda v: v > 0, "a number of seconds above 0"),
                     serve_max_queue=(lambda v: v >= 0, "an integer >= 0 (0: none waits)"),
                     serve_max_wait=(lambda v: 0 < v <= threading.TIMEOUT_MAX, "a number of seconds above 0, at "
                                     f"most {threading.TIMEOUT_MAX:.0f} (threading's limit)"))
    else:
        check_ranges(config, max_new_tokens=(lambda v: v >= 0, "an integer >= 0"),
                     num_samples=(lambda v: v >= 1, "an integer >= 1"),
                     temperature=(lambda v: v >= 0, "a number >= 0 (0: greedy)"),
                     top_k=(lambda v: v >= 0, "an integer >= 0 (0: all tokens)"),
                     top_p=(lambda v: 0 < v <= 1, "a number above 0 and at most 1"),
                     diffusion_steps=(lambda v: v >= 0, "an integer >= 0 (0: one token per pass)"))
        if config.unmask not in UNMASKING:
            fail(f"unmask={config.unmask!r} is not one of {', '.join(UNMASKING)}", code=2)
    text = read_prompt(config.prompt, config.prompt_file)

    dev = setup(config.device).dev
    loaded = load_trained(found, dev, info=config.serve)
    path, model, tok = loaded.path, loaded.model, loaded.tok
    if config.serve:
        if model.config.objective == "bd3lm":
            fail(f"checkpoint {path} is a block-diffusion model (objective=bd3lm): --serve answers with autoregressive "
                 f"models' token log-probabilities, which it has none of; sample.py without --serve prints its samples",
                 code=2)
        return serve_http(config, path, model, tok, loaded.info, dev)
    ids = encode_prompt(tok, text)
    print(f"# {path}", file=sys.stderr)
    print_samples(config, model, tok, text, ids, dev)


def check_ranges(config, **rules):
    """Stop (exit 2) at the first setting outside its range; rules: key=(valid(value), the range in words)."""
    for key, (valid, rule) in rules.items():
        value = config[key]
        if not isinstance(value, (int, float)) or not valid(value):  # None passes the configurator: refuse it here
            fail(f"{key}={value!r} is out of range: use {rule}", code=2)


def read_prompt(prompt, prompt_file):
    """The text the samples continue: prompt, or the contents of prompt_file when one is given."""
    if not prompt_file:
        return prompt
    try:
        with open(prompt_file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read prompt_file {prompt_file} ({first_line(e)}): give a UTF-8 text file or --prompt=TEXT")


def encode_prompt(tok, text):
    """The prompt's token ids, or one line (exit 2) naming the part of it the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv's bytes that are not UTF-8 arrive as lone surrogates
        fail(f"the prompt holds bytes that are not UTF-8 (at character {e.start}): write it as UTF-8 text "
             "to a file and pass --prompt_file=FILE", code=2)
    try:
        return tok.encode(text)
    except ValueError:  # the char tokenizer knows only the characters of the corpus it was made from
        known = set(tok.chars)
        at, char = next((i, c) for i, c in enumerate(text) if c not in known)
        fail(f"the prompt's character {char!r} (at position {at}) is not in the vocabulary of this char "
             "tokenizer, which knows only its corpus' characters: leave it out of the prompt", code=2)


def print_samples(config, model, tok, text, ids, dev):
    """config.num_samples continuations of text (token ids: ids), each streamed to stdout as it is generated."""
    ids = torch.tensor([[tok.bos_id] + ids], device=dev)
    generator = torch.Generator(device=dev).manual_seed(config.seed)
    # a block-diffusion model's sampler also takes how it denoises each block
    blocks = dict(steps=config.diffusion_steps or None, unmask=config.unmask) \
        if model.config.objective == "bd3lm" else {}
    for i in range(config.num_samples):
        # tokens may end inside a multi-byte character: decode the byte stream incrementally
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(text)
        for token in model.generate(ids, config.max_new_tokens, temperature=config.temperature,
                                    top_k=config.top_k or None, top_p=config.top_p, generator=generator, **blocks):
            sys.stdout.write(decoder.decode(tok.decode_bytes([token.item()])))
            sys.stdout.flush()
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        if i < config.num_samples - 1:
            print("-" * 40)


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
