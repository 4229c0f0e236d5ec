"""
Generate text from a trained checkpoint, streaming it as it comes, or serve it over HTTP.

    python sample.py --ckpt=out                   # the run's best checkpoint (lowest val loss)
    python sample.py --ckpt=out --which=latest    # its newest checkpoint instead
    python sample.py --ckpt=out/ckpt/step_0000600 --prompt="def main(" --temperature=0.8
    python sample.py config/tiny.py               # the run a config file describes (its out_dir)
    python sample.py --ckpt=out --serve=True --port=8000   # an OpenAI-style HTTP API: serve.py
    python sample.py --ckpt=out_sft --prompt="What is 17 + 25?"   # an SFT model answers it

A checkpoint folder (or an export) holds the model and its tokenizer: no data or network needed.
Each sample starts with BOS, as every training document does, then the prompt. A chat model (its
tokenizer has the chat tokens: SFT) takes the prompt as a user message, BOS <|user|> prompt <|end|>
<|assistant|>, and prints its reply alone, which ends at <|end|> (or BOS), no marker printed, as
transformers' decode(..., skip_special_tokens=True) of the export shows it; --chat=False continues
the prompt as text instead. A block-diffusion model (objective=bd3lm) is not served. --serve=True
needs FastAPI and uvicorn (docs/serving.md).
"""

import podgpt  # noqa: F401 -- first: a Ctrl-C while the imports below load is one line
import codecs
import sys
import threading

import torch

from podgpt.core import configurator
from podgpt.core.tokenizer import CHAT_TOKENS, chat_prompt, has_chat
from podgpt.release.loading import load_trained, locate
from podgpt.research.bd3lm import UNMASKING
from podgpt.core.util import fail, first_line, run_main, setup

# --- config
ckpt = ""                       # a checkpoint folder, or an out_dir (see which); "": out_dir
which = "best"                  # for an out_dir: best (lowest val loss, else latest) | latest
out_dir = "out"                 # used when ckpt is empty (a run's config file finds its checkpoint)
prompt = ""                     # text the samples continue
prompt_file = ""                # read the prompt from this file instead
chat = None                     # None (auto): a chat model answers the prompt | True | False: text
num_samples = 1                 # samples to draw, one after the other
max_new_tokens = 256            # tokens generated per sample
temperature = 0.8               # 0: greedy; higher: more random
top_k = 200                     # sample among the k most likely tokens; 0: all
top_p = 1.0                     # nucleus sampling: the smallest token set of this probability
seed = 1337                     # sampling seed
diffusion_steps = 0             # bd3lm: denoising passes per block; 0: one token per pass
unmask = "schedule"             # bd3lm: schedule (BD3-LM's, random order) | confidence
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N
serve = False                   # True: answer HTTP (POST /v1/completions, GET /health, /info)
host = "127.0.0.1"              # address to listen on; 0.0.0.0: the network (no authentication)
port = 8000                     # port to listen on; 0: any free one (the start line names it)
serve_max_tokens = 1024         # the most max_tokens a request may ask: how long it holds the model
serve_read_timeout = 30.0       # seconds a client has to send its whole request: then 408
serve_max_queue = 8             # completions that may wait while one generates: one more gets 503
serve_max_wait = 10.0           # seconds a completion may wait for the model: then 503
serve_max_n = 4                 # choices (n) a request may ask: each holds the model that much more
# --- end config


def main(argv):
    config = configurator.configure(__file__, argv)
    if config.which not in ("best", "latest"):
        fail(f"which={config.which!r} is not one of best, latest", code=2)
    found = locate(config.ckpt or config.out_dir, config.which)
    if config.serve:
        from podgpt.release.serve import serve_http  # only the server needs FastAPI and uvicorn
        most = threading.TIMEOUT_MAX
        check_ranges(config, port=(lambda v: 0 <= v <= 65535, "0 to 65535 (0: any free port)"),
                     serve_max_tokens=(lambda v: v >= 1, "an integer >= 1"),
                     serve_max_n=(lambda v: v >= 1, "an integer >= 1"),
                     serve_read_timeout=(lambda v: v > 0, "a number of seconds above 0"),
                     serve_max_queue=(lambda v: v >= 0, "an integer >= 0 (0: none waits)"),
                     serve_max_wait=(lambda v: 0 < v <= most, "a number of seconds above 0, at "
                                     f"most {most:.0f} (threading's limit)"))
    else:
        check_ranges(config, max_new_tokens=(lambda v: v >= 0, "an integer >= 0"),
                     num_samples=(lambda v: v >= 1, "an integer >= 1"),
                     temperature=(lambda v: v >= 0, "a number >= 0 (0: greedy)"),
                     top_k=(lambda v: v >= 0, "an integer >= 0 (0: all tokens)"),
                     top_p=(lambda v: 0 < v <= 1, "a number above 0 and at most 1"),
                     diffusion_steps=(lambda v: v >= 0, "an integer >= 0 (0: one token per pass)"))
        if config.unmask not in UNMASKING:
            fail(f"unmask={config.unmask!r} is not one of {', '.join(UNMASKING)}", code=2)
        if config.chat not in (None, "auto", True, False):
            fail(f"chat={config.chat!r} is not one of True, False, auto", code=2)
    text = read_prompt(config.prompt, config.prompt_file)
    dev = setup(config.device).dev
    loaded = load_trained(found, dev, info=config.serve)
    path, model, tok = loaded.path, loaded.model, loaded.tok
    if config.serve:
        if model.config.objective == "bd3lm":
            fail(f"checkpoint {path} is a block-diffusion model (objective=bd3lm): --serve answers "
                 "with autoregressive models' token log-probabilities, which it has none of; "
                 "sample.py without --serve prints its samples", code=2)
        return serve_http(config, path, model, tok, loaded.info, dev)
    chat = has_chat(tok) if config.chat in (None, "auto") else config.chat
    if chat and not has_chat(tok):
        fail(f"chat=True: the {tok.spec} tokenizer of {path} has no chat tokens "
             f"({', '.join(CHAT_TOKENS)}): a base model continues text; leave --chat out", code=2)
    ids = encode_prompt(tok, text)
    print(f"# {path}", file=sys.stderr)
    if chat:
        print_samples(config, model, tok, "", chat_prompt(tok, text), dev, stop=tok.chat["<|end|>"])
    else:
        print_samples(config, model, tok, text, [tok.bos_id] + ids, dev)


def check_ranges(config, **rules):
    """Stop (exit 2) at the first setting outside its range; rules: key=(valid(value), in words)."""
    for key, (valid, rule) in rules.items():
        value = config[key]  # None passes the configurator: refuse it here
        if not isinstance(value, (int, float)) or not valid(value):
            fail(f"{key}={value!r} is out of range: use {rule}", code=2)


def read_prompt(prompt, prompt_file):
    if not prompt_file:
        return prompt
    try:
        with open(prompt_file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read prompt_file {prompt_file} ({first_line(e)}): give a UTF-8 text file or "
             "--prompt=TEXT")


def encode_prompt(tok, text):
    """The prompt's token ids, or one line (exit 2) naming the part the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv's bytes that are not UTF-8 arrive as lone surrogates
        fail(f"the prompt holds bytes that are not UTF-8 (at character {e.start}): write it as "
             "UTF-8 text to a file and pass --prompt_file=FILE", code=2)
    try:
        return tok.encode(text)
    except ValueError:  # the char tokenizer knows only the characters of its corpus
        at, char = next((i, c) for i, c in enumerate(text) if c not in tok.char_ids)
        fail(f"the prompt's character {char!r} (at position {at}) is not in the vocabulary of this "
             "char tokenizer, which knows only its corpus' characters: leave it out of the prompt",
             code=2)


def print_samples(config, model, tok, text, ids, dev, stop=None):
    """config.num_samples continuations of text (token ids: ids, BOS first), each streamed to
    stdout. stop: a chat reply's end, at which (or at BOS) a sample ends; its special tokens are
    not printed, as transformers' skip_special_tokens has them."""
    ends, special = ({stop, tok.bos_id}, set(tok.chat.values())) if stop is not None else ((), ())
    ids = torch.tensor([ids], device=dev)
    generator = torch.Generator(device=dev).manual_seed(config.seed)
    blocks = dict(steps=config.diffusion_steps or None, unmask=config.unmask) \
        if model.config.objective == "bd3lm" else {}
    for i in range(config.num_samples):
        # tokens may end inside a multi-byte character: decode the byte stream incrementally
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(text)
        for token in model.generate(ids, config.max_new_tokens, temperature=config.temperature,
                                    top_k=config.top_k or None, top_p=config.top_p,
                                    generator=generator, **blocks):
            if token.item() in ends:
                break
            if token.item() not in special:
                sys.stdout.write(decoder.decode(tok.decode_bytes([token.item()])))
                sys.stdout.flush()
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        if i < config.num_samples - 1:
            print("-" * 40)


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
