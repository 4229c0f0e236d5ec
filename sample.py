"""
Generate text from a trained checkpoint, streaming it as it comes, or serve it over HTTP.

    python sample.py --ckpt=out                      # the best checkpoint of a run (lowest validation loss)
    python sample.py --ckpt=out --which=latest       # its newest checkpoint instead
    python sample.py --ckpt=out/ckpt/step_0000600 --prompt="def main(" --temperature=0.8
    python sample.py config/tiny.py                  # the run a config file describes (its out_dir)
    python sample.py --ckpt=out --serve=True --port=8000   # an HTTP API (below)

Every checkpoint folder holds the model, its config and the tokenizer files, so
nothing else (no data folder, no network) is needed. Each sample starts with the
BOS token that begins every training document, followed by the prompt. --ckpt may
also name a folder written by export.py. A block-diffusion model (objective=bd3lm) writes a
block at a time: diffusion_steps denoising passes per block, filling the tokens unmask picks
(objectives.py: BlockDiffusionLM.generate); it is not served.

--serve=True answers HTTP requests instead (standard library only; one generation at
a time, the others wait in line, within bounds (below); no authentication, so keep host=127.0.0.1 or
put a proxy in front):

    GET  /health          {"status": "ok"}
    GET  /info            the checkpoint, its step and validation loss, the model, the tokenizer, the limits
    GET  /v1/models       OpenAI-style: the one model served; its id is the checkpoint's path
    POST /v1/completions  OpenAI-style: {"prompt": "def main(", "max_tokens": 16, "temperature": 1.0,
                          "top_p": 1.0, "top_k": null, "stop": null, "seed": null, "stream": false,
                          "echo": false, "logprobs": null, "model": "any"}

    curl -s localhost:8000/v1/completions -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'

The prompt is a string, a list of token ids, or a list holding one of those (a batch of one, as
lm-evaluation-harness sends it: one prompt per request). The model reads BOS, then the prompt
(token ids that begin with BOS get no second one). "model" may name anything, as clients such as
lm-evaluation-harness put their tokenizer's folder there: the reply's "model" is the id of the
model that answered. A completion ends at max_tokens (finish_reason "length"), at a stop string
(left out of the text) or where the model emits BOS, which ends a training document (both "stop").
With "stream": true the text comes as server-sent events, one `data: {chunk}` per token that adds
text, then `data: [DONE]`. A bad request gets HTTP 400 and {"error": {"message", "type", "param"}}.

"echo": true puts the prompt before the completion's text. "logprobs": k (0 to 5) adds OpenAI's
logprobs object, for each generated token and, with echo, each prompt token before them (the first
prompt token gets null, as at OpenAI): "tokens" (each token's text: "bytes:\\xNN..." for one whose
bytes are no UTF-8 text alone, such as part of a character; "" for BOS), "token_logprobs",
"top_logprobs" (the k most likely tokens there) and "text_offset" (where each token's text starts,
in characters from the prompt's start, echo or not). They are the log-softmax of the model's logits
in float32: the model's own distribution, before temperature, top_k and top_p (what OpenAI reports),
so they do not depend on how the tokens were drawn. They cover every generated token that usage
counts: the BOS that ends a completion, and the tokens whose text a stop string cut off. With echo,
logprobs and max_tokens 0 a request scores its prompt and generates nothing (lm-evaluation-harness's
local-completions sends max_tokens 1 and drops the generated token's entry). A stream carries no
logprobs: asking for both is a 400.

OpenAI's other parameters are not implemented. n and best_of (1), presence_penalty and
frequency_penalty (0), suffix ("") and logit_bias ({}) are accepted at the value in brackets, which
changes nothing, and "user" (it names the client's end user) is accepted and ignored; any other
value, stream_options, and any key this server does not know is a 400 naming it, never ignored.

What one request may carry is bounded (/info lists it under "limits"), so that no request holds
the model, or a thread, for long: max_tokens up to serve_max_tokens; a prompt the context holds
(block_size - 1 tokens after BOS); at most 4 stop strings (OpenAI's limit) of at most 256
characters each; a body of at most 1 MB (413), sent with a Content-Length (411 without one), whole
within serve_read_timeout seconds (408). Generation stops when the client closes its connection.
SIGTERM or Ctrl-C ends the server within a few seconds, exit 0, whatever the clients are doing.

Waiting is bounded too, so that a short request behind long ones is answered or refused within a
bound instead of waiting for all of them: while one completion generates, at most serve_max_queue
others wait for the model, first come first served, each for at most serve_max_wait seconds. A
request past either bound gets 503 with the JSON error and a Retry-After header: whole seconds, the
requests ahead of it (the one generating and those waiting) times the mean time the last requests
held the model (before any ended, the running one's time so far). /health, /info and /v1/models
never wait.
"""

import codecs
import collections
import contextlib
import http.server
import io
import itertools
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import torch

import configurator
from checkpoint import find_checkpoint, load_model, reading
from export import finite, is_export, load_export, tokenizer_dir
from objectives import UNMASKING
from preflight import param_counts
from tokenizer import load_tokenizer
from util import fail, first_line, run_main, setup

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

MAX_BODY_BYTES = 1 << 20        # a request body larger than this is refused unread
MAX_STOPS = 4                   # stop strings per request, as OpenAI allows
# a stop string marks where a completion ends (a blank line, a closing tag, a role name): 256 characters is far
# more than any such marker needs, and bounds the text a request can make the server hold back and match
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 5                # the most likely tokens listed per token with logprobs, as OpenAI allows
# OpenAI's completion parameters that this server does not implement: each is accepted only at the value (or null)
# that changes nothing, so that a client never gets, without an error, an answer to a question it did not ask
UNSUPPORTED = {"n": (1, "this server returns one completion per request"),
               "best_of": (1, "this server generates one completion per request"),
               "presence_penalty": (0, "this server applies no penalties"),
               "frequency_penalty": (0, "this server applies no penalties"),
               "suffix": ("", "this server only continues the prompt, it does not insert"),
               "logit_bias": ({}, "this server does not bias logits"),
               "stream_options": (None, "a stream's last chunk carries the usage")}
SUPPORTED = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "echo", "logprobs",
             "model", "user")  # the parameters this server reads (model and user only as names)
STOP_SECONDS = 3                # at SIGTERM or Ctrl-C, how long the running generation gets to reach its next token


def main(argv):
    config = configurator.configure(__file__, argv)
    if config.which not in ("best", "latest"):
        fail(f"which={config.which!r} is not one of best, latest", code=2)
    src = config.ckpt or config.out_dir
    exported = is_export(src)
    path = src if exported else find_checkpoint(src, config.which)
    if path is None:
        fail(f"no checkpoint in {src!r}: train first or pass --ckpt=OUT_DIR or a checkpoint folder")
    if config.serve:
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
    with contextlib.ExitStack() as held:  # a checkpoint is held against the run's rotation while it is read
        try:
            if not exported:
                path = held.enter_context(reading(src, config.which))
            model, saved = load_exported(path, dev) if exported else load_model(path, dev, verify=False)
            info = checkpoint_info(path, exported, saved) if config.serve else None
        except ValueError as e:
            fail(f"checkpoint {path} cannot be used: {e}: pick another (--ckpt=<folder>, --which=latest)")
        try:
            tok = load_tokenizer(tokenizer_dir(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"{path}: its tokenizer files do not load ({first_line(e)}): pick another checkpoint "
                 f"(--ckpt=<folder>, --which=latest) or export it again")
    if config.serve:
        if model.config.objective == "bd3lm":
            fail(f"checkpoint {path} is a block-diffusion model (objective=bd3lm): --serve answers with autoregressive "
                 f"models' token log-probabilities, which it has none of; sample.py without --serve prints its samples",
                 code=2)
        return serve_http(config, path, model, tok, info, dev)
    ids = encode_prompt(tok, text)
    print(f"# {path}", file=sys.stderr)
    print_samples(config, model, tok, text, ids, dev)


def load_exported(path, dev):
    """load_export(path, dev), or one line naming what cannot be read and the fix: export the checkpoint again."""
    try:
        from safetensors import SafetensorError  # an export's weights need it, a checkpoint's do not
    except ImportError:
        fail(f"export {path} holds its weights in safetensors, which is not installed: pip install safetensors")
    again = f"export its checkpoint again (python export.py --ckpt=CHECKPOINT --out={path})"
    try:
        return load_export(path, dev)
    except SafetensorError as e:  # a truncated or damaged weights file (safetensors' error is no ValueError)
        fail(f"export {path}: {', '.join(unreadable_weights(path))} cannot be read ({first_line(e)}): {again}")
    except ValueError as e:  # podgpt.json unreadable or unknown to this model.py, or the weights do not fit it
        fail(f"export {path} cannot be used: {e}: {again}")


def unreadable_weights(path):
    """The safetensors files of an export that safetensors cannot open (a truncated file holds fewer bytes than
    its header promises); all of them if each opens, as one failed further in."""
    from safetensors import safe_open

    def opens(name):
        try:
            with safe_open(os.path.join(path, name), "pt"):
                return True
        except Exception:  # SafetensorError, or OSError for a file that cannot be read at all
            return False
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    return [n for n in names if not opens(n)] or names


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


def checkpoint_info(path, exported, saved):
    """Step, validation losses and model config of a checkpoint (trainer.pt, config.json) or an export
    (podgpt.json: `saved`, as load_export read it)."""
    if exported:
        trainer = saved
    else:
        try:
            trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged pickle can raise many kinds of error
            raise ValueError(f"trainer.pt is unreadable ({first_line(e)})") from None
    return {"checkpoint": path, "exported": exported, "step": trainer.get("step"),
            "val_loss": finite(trainer.get("val_loss")), "best_val_loss": finite(trainer.get("best_val_loss")),
            "model": saved["model"]}


# -----------------------------------------------------------------------------
# the HTTP API


class RequestError(Exception):
    """A request the server refuses: HTTP status, one line naming the problem and the fix, the field, and headers
    for the reply (a 405's Allow, a 503's Retry-After)."""

    def __init__(self, message, param=None, status=400, headers=None):
        super().__init__(message)
        self.param, self.status, self.headers = param, status, headers


def shown(value, width=40):
    """A client's value as JSON for an error message, cut short: a request must not make the reply (or the log) huge."""
    text = json.dumps(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"


def field(req, name, default, kinds, valid, rule):
    """req[name] (default if absent or null) if it has one of `kinds` (a bool is not a number) and passes valid();
    else RequestError."""
    value = req.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds) or not valid(value):
        raise RequestError(f"{name}={shown(value)} is invalid: {rule}", name)
    return value


def stop_strings(value):
    """The stop strings of a request's "stop" (null, a string or a list of strings), within the limits;
    else RequestError."""
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop={shown(value)} is invalid: use a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop holds {len(stops)} strings, above the limit of {MAX_STOPS}: send at most {MAX_STOPS}",
                           "stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise RequestError(f"stop holds a string of {longest} characters, above the limit of {MAX_STOP_CHARS}: "
                           "send shorter ones", "stop")
    return stops


def parse_completion(body, ctx):
    """(sampling parameters, prompt token ids, prompt text) of a /v1/completions body, or RequestError."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise RequestError('the body is not JSON: send an object such as {"prompt": "def main(", "max_tokens": 16}')
    except RecursionError:  # arrays or objects nested thousands deep
        raise RequestError('the body nests JSON too deeply to read: send a flat object such as {"prompt": "def main("}')
    if not isinstance(req, dict):
        raise RequestError(f'the body is a JSON {type(req).__name__}, not an object: send {{"prompt": "..."}}')
    refuse_unsupported(req)
    if req.get("prompt") is None:
        raise RequestError('prompt is missing: send "prompt": "text" (or token ids)', "prompt")
    number = (int, float)
    p = dict(
        max_tokens=field(req, "max_tokens", 16, (int,), lambda v: 0 <= v <= ctx.max_tokens,
                         f"use an integer from 0 to {ctx.max_tokens} (this server's serve_max_tokens)"),
        temperature=field(req, "temperature", 1.0, number, lambda v: 0 <= v <= 2,
                          "use a number from 0 (greedy) to 2"),
        top_p=field(req, "top_p", 1.0, number, lambda v: 0 < v <= 1, "use a number above 0 and at most 1"),
        top_k=field(req, "top_k", None, (int,), lambda v: v >= 0, "use an integer >= 0 (0: all tokens)"),
        seed=field(req, "seed", None, (int,), lambda v: 0 <= v < 2**63, "use an integer from 0 to 2**63 - 1"),
        stream=field(req, "stream", False, (bool,), lambda v: True, "use true or false"),
        stop=stop_strings(req.get("stop")),
        echo=field(req, "echo", False, (bool,), lambda v: True, "use true or false"),
        logprobs=field(req, "logprobs", None, (int,), lambda v: 0 <= v <= MAX_LOGPROBS,
                       f"use an integer from 0 to {MAX_LOGPROBS} (the most likely tokens listed), or null for none"),
    )
    field(req, "model", None, (str,), lambda v: True, "use a string (any: this server answers as the one it serves)")
    field(req, "user", None, (str,), lambda v: True, "use a string")
    if p["stream"] and p["logprobs"] is not None:
        raise RequestError("logprobs cannot be streamed by this server: send stream=false to get them", "logprobs")
    ids, text = prompt_ids(ctx, req["prompt"])
    if len(ids) > ctx.max_prompt:
        raise RequestError(f"prompt is {len(ids)} tokens, the model's context holds {ctx.max_prompt} after BOS: "
                           "shorten it", "prompt")
    return p, ids, text


def refuse_unsupported(req):
    """RequestError for the first key of req that this server does not read, or that names an OpenAI parameter it
    does not implement at a value that would change the answer (see UNSUPPORTED)."""
    for key, value in req.items():
        if key in UNSUPPORTED:
            neutral, why = UNSUPPORTED[key]
            if value is None or (not isinstance(value, bool) and value == neutral):
                continue
            instead = "leave it out" if neutral is None else f"leave it out or send {json.dumps(neutral)}"
            raise RequestError(f"{key}={shown(value)} is not supported: {instead} ({why})", key)
        if key not in SUPPORTED:
            name = key if len(key) <= 40 else f"{key[:40]}..."  # the reply must not grow with what the client sent
            raise RequestError(f"{name} is not a parameter this server knows: leave it out (it reads "
                               f"{', '.join(SUPPORTED)})", name)


def prompt_ids(ctx, value):
    """(token ids, text) of a request's prompt: a string, token ids, or a list holding one of those (a batch of
    one, as lm-evaluation-harness sends it); else RequestError."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise RequestError(f"prompt holds {len(value)} prompts: this server answers one per request, send them "
                           "one at a time (lm-evaluation-harness: batch_size=1)", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        try:
            return ctx.tok.encode(value), value
        except ValueError as e:  # the char tokenizer knows only its corpus' characters
            raise RequestError(f"prompt cannot be encoded: {e}: leave those characters out", "prompt")
    vocab = ctx.tok.vocab_size
    if isinstance(value, list) and value and all(type(i) is int and 0 <= i < vocab for i in value):  # no bools
        return value, ctx.tok.decode(value)
    raise RequestError(f"prompt={shown(value)} is invalid: send a string, a non-empty list of token ids from 0 to "
                       f"{vocab - 1}, or a list holding one of those", "prompt")


def kmp_table(s):
    """table[k]: the length of the longest proper prefix of s[:k + 1] that is also its suffix (KMP's failure table)."""
    table, m = [0] * len(s), 0
    for k in range(1, len(s)):
        while m and s[k] != s[m]:
            m = table[m - 1]
        if s[k] == s[m]:
            m += 1
        table[k] = m
    return table


class StopStrings:
    """Finds a request's stop strings in text that comes a piece at a time, in time linear in the text: a KMP
    automaton per stop string, advanced one character at a time (matching each new token against the whole text
    would be quadratic, and a long stop string would hold the model for seconds per token)."""

    def __init__(self, stops):
        self.stops, self.tables = stops, [kmp_table(s) for s in stops]
        self.matched = [0] * len(stops)  # per stop string: the longest prefix of it that ends the text so far

    def find(self, text):
        """Reads the next piece of text: (where in it the first stop string to complete ends, its length), or None."""
        for end, c in enumerate(text, 1):
            found = 0
            for i, s in enumerate(self.stops):
                m = self.matched[i]
                while m and s[m] != c:  # fall back to the longest shorter prefix that still ends the text
                    m = self.tables[i][m - 1]
                m += s[m] == c
                self.matched[i] = m
                if m == len(s):
                    found = max(found, m)  # of two that end here, the longer one begins first
            if found:
                return end, found
        return None

    def held(self):
        """How many characters at the end of the text could begin a stop string: they wait for more text."""
        return max(self.matched, default=0)


def model_input(ctx, ids):
    """The tokens the model reads for a prompt: BOS, which begins every training document, then the prompt (token
    ids that begin with BOS already get no second one: the model never saw two in a row)."""
    return torch.tensor([ids if ids[:1] == [ctx.tok.bos_id] else [ctx.tok.bos_id] + ids], device=ctx.dev)


@contextlib.contextmanager
def forward_logits(model, on):
    """A list that gets the last position's logits of each forward the model runs in the with block (if on):
    generate() yields only tokens, and this is what each was drawn from (after a sliding-window restart of the
    KV cache too). The hook is gone after the block, however it ends."""
    logits = []
    hook = model.register_forward_hook(lambda module, args, out: logits.append(out[0][0, -1])) if on else None
    try:
        yield logits
    finally:
        if hook:
            hook.remove()


def score(ctx, logits, tokens, k):
    """(log-probability of the token, its k most likely (token id, log-probability)) for each row of logits (T, V)
    and token of tokens: the log-softmax in float32 of the model's own distribution (no temperature, top_k, top_p)."""
    logprobs = logits[:, :ctx.model.config.vocab_size].float().log_softmax(dim=-1)  # padding ids are no tokens
    top = logprobs.topk(k, dim=-1)
    chosen = logprobs[torch.arange(len(tokens), device=logprobs.device), tokens].tolist()
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, top.indices.tolist(), top.values.tolist())]


def prompt_scores(ctx, ids, k):
    """(token id, score()) of each prompt token, from one forward over model_input(): each given BOS and the tokens
    before it. The first gets None, as at OpenAI, though the model read BOS before it (a client that wants it scored
    sends token ids that begin with BOS: then BOS is the first)."""
    if not ids:
        return []
    x = model_input(ctx, ids)
    with torch.no_grad():
        logits = ctx.model(x)[0][0]
    shift = x.size(1) - len(ids)  # 1 when the server put BOS first: the prediction of ids[j] is at j - 1 + shift
    return [(ids[0], None)] + list(zip(ids[1:], score(ctx, logits[shift:len(ids) - 1 + shift], ids[1:], k)))


def token_text(tok, token):
    """A token as text, for logprobs: its text when its bytes are UTF-8 on their own, else OpenAI's "bytes:\\xNN..."
    form (a byte-level token may be part of a character); BOS (no text) is ""."""
    data = tok.decode_bytes([token])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def logprobs_object(tok, scored, start):
    """OpenAI's logprobs object of (token id, score() or None) pairs whose text begins at character `start` of the
    prompt + completion text; each token's offset is where the text decoded before it ends."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, s in scored:
        out["tokens"].append(token_text(tok, token))
        out["token_logprobs"].append(None if s is None else s[0])
        out["top_logprobs"].append(None if s is None else {token_text(tok, i): logprob for i, logprob in s[1]})
        out["text_offset"].append(start)
        start += len(decoder.decode(tok.decode_bytes([token])))
    return out


def reply_logprobs(ctx, p, ids, prompt, scored):
    """A reply's logprobs: None unless asked for, else the object of the generated tokens (scored), after the
    prompt's tokens with echo. Their text_offset counts from the prompt's start either way, as OpenAI's does."""
    if scored is None:
        return None
    generated = logprobs_object(ctx.tok, scored, len(prompt))
    if not p["echo"]:
        return generated
    echoed = logprobs_object(ctx.tok, prompt_scores(ctx, ids, p["logprobs"]), 0)
    return {key: echoed[key] + generated[key] for key in echoed}


def complete(ctx, p, ids, gone, scored=None):
    """Yields (new text, finish_reason or None, tokens generated so far); the last has a finish_reason. The text
    ends before the first stop string to appear in it; text that could begin one is held back until it cannot.
    gone(): whether the client has left, which ends the generation with ConnectionAbortedError.
    scored: None, or a list that gets (token id, score() with p["logprobs"] top tokens) of each token generated.
    Call it holding the model (ctx.queue.turn())."""
    generator = torch.Generator(device=ctx.dev)
    if p["seed"] is None:
        generator.seed()
    else:
        generator.manual_seed(p["seed"])
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a token may end inside a character
    stops = StopStrings(p["stop"])
    held, n, finish = "", 0, "length"  # held: the text not yielded yet
    with forward_logits(ctx.model, scored is not None) as logits:
        for token in ctx.model.generate(model_input(ctx, ids), p["max_tokens"], temperature=p["temperature"],
                                        top_k=p["top_k"] or None, top_p=p["top_p"], generator=generator):
            if ctx.stopping.is_set():  # SIGTERM or Ctrl-C: end this request so that the process can exit
                raise RequestError("the server is shutting down: send the request again when it is back", status=503)
            if gone():  # nobody would read the rest: free the model for the next request
                raise ConnectionAbortedError(f"the client closed its connection: generation stopped after {n} of "
                                             f"{p['max_tokens']} tokens")
            n += 1
            if scored is not None:  # one forward per token: its logits are the ones the token was drawn from
                scored.append((token.item(), score(ctx, logits.pop()[None], [token.item()], p["logprobs"])[0]))
            if token.item() == ctx.tok.bos_id:  # the model ended the document (BOS = EOS)
                finish = "stop"
                break
            new = decoder.decode(ctx.tok.decode_bytes([token.item()]))
            found = stops.find(new)
            if found:
                end, length = found
                text = held + new[:end]
                yield text[:len(text) - length], "stop", n
                return
            held += new
            ready = len(held) - stops.held()
            if ready > 0:
                yield held[:ready], None, n
                held = held[ready:]
    yield held + decoder.decode(b"", final=True), finish, n


class ModelQueue:
    """The model, for one generation at a time, first come first served. At most max_waiting completions wait for
    it, each for at most max_wait seconds: past either bound a request gets 503 with a Retry-After, so that a short
    request behind many long ones is answered or refused within a bound instead of waiting for all of them."""

    def __init__(self, max_waiting, max_wait):
        self.max_waiting, self.max_wait = max_waiting, max_wait
        self.cond = threading.Condition()
        self.line = collections.deque()  # the waiting requests, first come first
        self.started = None  # when the generation now running took the model; None: the model is free
        self.held = collections.deque(maxlen=16)  # seconds each of the last requests held the model
        self.closed = False  # the server is stopping: no generation starts

    def free(self):
        return self.started is None and not self.closed

    @contextlib.contextmanager
    def turn(self):
        """Holds the model through the with block, once the requests before this one have had it; RequestError
        (503) when max_waiting others already wait, or the model is not free within max_wait seconds."""
        with self.cond:
            if len(self.line) + (not self.free()) > self.max_waiting:
                raise self.refusal(f"the model is busy and its line is full ({len(self.line)} waiting: "
                                   "serve_max_queue)")
            me = object()
            self.line.append(me)
            if not self.cond.wait_for(lambda: self.line[0] is me and self.free(), self.max_wait):
                self.line.remove(me)
                self.cond.notify_all()  # the next one may be first in line now
                raise self.refusal(f"the model was not free within {self.max_wait} s (serve_max_wait)")
            self.line.popleft()
            self.started = time.monotonic()
        try:
            yield
        finally:
            with self.cond:
                self.held.append(time.monotonic() - self.started)
                self.started = None
                self.cond.notify_all()

    def refusal(self, why):
        """The 503 for a request refused because of `why`. Its Retry-After: when the requests now ahead of it (the
        one generating and those waiting) would be done, at the mean time the last requests held the model
        (before any ended: the running one's time so far); at least 1 s."""
        now = time.monotonic()
        per_request = sum(self.held) / len(self.held) if self.held else now - (self.started or now)
        seconds = max(1, math.ceil(per_request * (len(self.line) + (self.started is not None))))
        return RequestError(f"{why}: send it again in {seconds} s", status=503,
                            headers={"Retry-After": str(seconds)})

    def close(self, timeout):
        """Waits up to timeout seconds for the running generation to end, then keeps any from starting; whether
        it ended."""
        with self.cond:
            self.closed = True
            return self.cond.wait_for(lambda: self.started is None, timeout)


class DeadlineReader(io.RawIOBase):
    """A socket's reads, all of them before one deadline: a timeout per read alone starts again at every byte,
    so a client sending its request a byte at a time could hold a thread for as long as it likes."""

    def __init__(self, sock, seconds):
        self.sock, self.deadline, self.timeout = sock, time.monotonic() + seconds, sock.gettimeout()

    def readable(self):
        return True

    def readinto(self, buffer):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.timeout)  # the writes keep theirs


class Handler(http.server.BaseHTTPRequestHandler):
    """GET /health, GET /info, GET /v1/models, POST /v1/completions; self.server.ctx holds the model and the
    settings. HTTP/1.0 (http.server's default): one request per connection, so a stream ends when the connection
    closes, and a body left unread is never taken for the next request."""
    timeout = 60  # seconds a write may wait on a client that stops reading: it must not hold the model forever
    routes = {"/health": "GET", "/info": "GET", "/v1/models": "GET", "/v1/completions": "POST"}

    def setup(self):
        super().setup()
        self.rfile.close()  # the request is read through one deadline instead
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, self.server.ctx.read_timeout))

    def handle(self):
        try:
            super().handle()
        except ConnectionError as e:  # the client left, even before an error reply: one line, not a traceback
            self.log_message("%s: the client left before the response ended (%s)",
                             getattr(self, "requestline", "a request not read yet"), first_line(e))

    def do_GET(self):
        self.route()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def route(self):
        ctx, path = self.server.ctx, self.path.split("?", 1)[0]
        self.streaming = False
        try:
            if path not in self.routes:
                raise RequestError(f"no such path {path}: use GET /health, GET /info, GET /v1/models or "
                                   "POST /v1/completions", status=404)
            if self.command != self.routes[path]:
                raise RequestError(f"{self.command} {path} is not supported: use {self.routes[path]} {path}",
                                   status=405, headers={"Allow": self.routes[path]})
            if path == "/health":
                self.send_json(200, {"status": "ok"})
            elif path == "/info":
                self.send_json(200, ctx.info)
            elif path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": ctx.name, "object": "model",
                                                                 "created": ctx.created, "owned_by": "podgpt"}]})
            else:
                self.completions(ctx)
        except RequestError as e:
            if self.streaming:  # too late for a status: the stream ends without its [DONE]
                return
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            self.send_json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param}}, e.headers)
        except (ConnectionError, TimeoutError):  # the client left or stalled: handle() or http.server logs it
            raise
        except Exception as e:  # a bug, or out of memory: say so and keep serving
            print(f"error: {self.command} {path}: {first_line(e)}", file=sys.stderr, flush=True)
            if not self.streaming:
                self.send_json(500, {"error": {"message": first_line(e), "type": "server_error", "param": None}})

    def completions(self, ctx):
        size = self.headers.get("Content-Length")
        if size is None or "Transfer-Encoding" in self.headers:
            raise RequestError("the body has no Content-Length (a chunked body is not read): send it whole, "
                               "with its length in bytes", status=411)
        size = size.strip()
        if not (size.isascii() and size.isdigit()):  # isdigit() alone passes "²", which int() refuses
            raise RequestError(f"Content-Length {shown(size)} is not a size in bytes: send the body's length")
        # refused unread; more than 9 digits is over the limit, and int() refuses thousands of them
        if len(size) > 9 or int(size) > MAX_BODY_BYTES:
            raise RequestError(f"Content-Length {shown(size)} is above this server's limit of {MAX_BODY_BYTES} "
                               "bytes: send a shorter prompt", status=413)
        size = int(size)
        try:
            body = self.rfile.read(size)
        except TimeoutError:
            raise RequestError(f"the request did not arrive within {ctx.read_timeout} s (serve_read_timeout): "
                               "send it at once", status=408)
        if len(body) < size:
            raise RequestError(f"the body ended after {len(body)} of the {size} bytes its Content-Length "
                               "promised: send all of it")
        p, ids, prompt = parse_completion(body, ctx)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": ctx.name}

        def body(text, finish, n, logprobs=None):
            return dict(head, choices=[{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
                        usage={"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n})

        with ctx.queue.turn():  # one generation at a time; the others wait, within bounds, or get a 503
            scored = None if p["logprobs"] is None else []
            parts = complete(ctx, p, ids, self.client_gone, scored)
            if p["echo"]:  # the prompt's text first, streamed or not
                parts = itertools.chain([(prompt, None, 0)], parts)
            if not p["stream"]:
                parts = list(parts)
                text, finish, n = "".join(t for t, _, _ in parts), parts[-1][1], parts[-1][2]
                return self.send_json(200, body(text, finish, n, reply_logprobs(ctx, p, ids, prompt, scored)))
            self.streaming = True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for text, finish, n in parts:
                chunk = body(text, finish, n)
                if finish is None:
                    del chunk["usage"]  # the last chunk counts the tokens
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    def send_json(self, status, obj, headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def client_gone(self):
        """Whether the client has closed its connection: its socket reads as ended (or reset). poll(), unlike
        select(), takes any descriptor. Bytes sent after the body are dropped, so that they cannot hide the end
        (one request per connection: nobody would read them). A client that only shuts its sending side (rare
        over HTTP) counts as gone too."""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            return self.connection.recv(1 << 16) == b""
        except ConnectionError:
            return True


class Server(http.server.ThreadingHTTPServer):
    """A thread per connection."""
    daemon_threads = True  # the exit does not wait for them: a client decides how long its thread reads
    # connections not accepted yet: the system's most, not socketserver's 5, so that a burst of clients gets
    # answers (a 503 past the queue's bound) rather than connections reset
    request_queue_size = socket.SOMAXCONN


def serve_http(config, path, model, tok, info, dev):
    """Answer HTTP requests until SIGTERM or Ctrl-C (then exit 0)."""
    cfg = model.config
    # created (/v1/models): when the checkpoint or export was written
    ctx = SimpleNamespace(model=model, tok=tok, dev=dev, name=path, created=int(os.path.getmtime(path)),
                          queue=ModelQueue(config.serve_max_queue, config.serve_max_wait), stopping=threading.Event(),
                          max_tokens=config.serve_max_tokens, max_prompt=cfg.block_size - 1,
                          read_timeout=config.serve_read_timeout)
    ctx.info = dict(info, parameters=param_counts(cfg)["total"], tokenizer=tok.spec, block_size=cfg.block_size,
                    device=str(dev), limits={"max_tokens": ctx.max_tokens, "prompt_tokens": ctx.max_prompt,
                                             "body_bytes": MAX_BODY_BYTES, "stop_strings": MAX_STOPS,
                                             "stop_chars": MAX_STOP_CHARS, "read_seconds": ctx.read_timeout,
                                             "logprobs": MAX_LOGPROBS, "queue": config.serve_max_queue,
                                             "wait_seconds": config.serve_max_wait})
    try:
        server = Server((config.host, config.port), Handler)
    except OSError as e:
        fail(f"cannot listen on {config.host}:{config.port} ({first_line(e)}): "
             "pick another --port (0: any free one) or --host")
    server.ctx = ctx
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    host, bound = server.server_address[:2]
    print(f"serving {path} on http://{host}:{bound}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr, flush=True)
    server.server_close()  # no new connections
    ctx.stopping.set()  # a generation ends at its next token, and frees the model
    if not ctx.queue.close(STOP_SECONDS):
        print(f"warning: the generation did not stop within {STOP_SECONDS} s: exiting anyway", file=sys.stderr,
              flush=True)
    # End at once, the queue closed so that no generation starts: the threads left may be reading a client's
    # bytes or encoding a prompt, and the interpreter's teardown would end them inside that call (pthread_exit),
    # which can abort the process from native code; os._exit ends them all where they are.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
