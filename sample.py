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
also name a folder written by export.py.

--serve=True answers HTTP requests instead (standard library only; one generation at
a time, the others wait; no authentication, so keep host=127.0.0.1 or put a proxy in front):

    GET  /health          {"status": "ok"}
    GET  /info            the checkpoint, its step and validation loss, the model, the tokenizer, the limits
    POST /v1/completions  OpenAI-style: {"prompt": "def main(", "max_tokens": 16, "temperature": 1.0,
                          "top_p": 1.0, "top_k": null, "stop": null, "seed": null, "stream": false}

    curl -s localhost:8000/v1/completions -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'

A completion ends at max_tokens (finish_reason "length"), at a stop string (left out of the
text) or where the model emits BOS, which ends a training document (both "stop"). With
"stream": true the text comes as server-sent events, one `data: {chunk}` per token that adds
text, then `data: [DONE]`. A bad request gets HTTP 400 and {"error": {"message", "type", "param"}}.
"""

import codecs
import http.server
import json
import os
import signal
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import torch

import configurator
from checkpoint import find_checkpoint, load_model
from export import finite, is_export, load_export, tokenizer_dir
from model import param_counts
from prepare import load_tokenizer
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
device = "auto"                 # auto (this rank's GPU if any, else cpu) | cpu | cuda | cuda:N (one process)
serve = False                   # True: answer HTTP (POST /v1/completions, GET /health, /info) instead of printing
host = "127.0.0.1"              # address to listen on; 0.0.0.0 opens it to the network (there is no authentication)
port = 8000                     # port to listen on; 0: any free one (the start line names it)
serve_max_tokens = 1024         # the most max_tokens one request may ask for: bounds how long it holds the model
# --- end config

MAX_BODY_BYTES = 1 << 20        # a request body larger than this is refused unread


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
        if not 0 <= config.port <= 65535 or config.serve_max_tokens < 1:
            fail("need 0 <= port <= 65535 and serve_max_tokens >= 1", code=2)
    elif config.max_new_tokens < 0 or config.num_samples < 1 or config.temperature < 0:
        fail("need max_new_tokens >= 0, num_samples >= 1 and temperature >= 0", code=2)
    text = read_prompt(config.prompt, config.prompt_file)

    dev = setup(config.device).dev
    try:
        model, saved = load_export(path, dev) if exported else load_model(path, dev)
        info = checkpoint_info(path, exported, saved) if config.serve else None
    except ValueError as e:
        fail(f"checkpoint {path} cannot be used: {e}: pick another (--ckpt=<folder>, --which=latest)")
    tok = load_tokenizer(tokenizer_dir(path))
    if config.serve:
        return serve_http(config, path, model, tok, info, dev)
    print(f"# {path}", file=sys.stderr)
    print_samples(config, model, tok, text, dev)


def read_prompt(prompt, prompt_file):
    """The text the samples continue: prompt, or the contents of prompt_file when one is given."""
    if not prompt_file:
        return prompt
    try:
        with open(prompt_file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read prompt_file {prompt_file} ({first_line(e)}): give a UTF-8 text file or --prompt=TEXT")


def print_samples(config, model, tok, text, dev):
    """config.num_samples continuations of text, each streamed to stdout as it is generated."""
    ids = torch.tensor([[tok.bos_id] + tok.encode(text)], device=dev)
    generator = torch.Generator(device=dev).manual_seed(config.seed)
    for i in range(config.num_samples):
        # tokens may end inside a multi-byte character: decode the byte stream incrementally
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(text)
        for token in model.generate(ids, config.max_new_tokens, temperature=config.temperature,
                                    top_k=config.top_k or None, top_p=config.top_p, generator=generator):
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
    """A request the server refuses: HTTP status, one line naming the problem and the fix, the field."""

    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.param, self.status = param, status


def field(req, name, default, kinds, valid, rule):
    """req[name] (default if absent or null) if it has one of `kinds` (a bool is not a number) and passes valid();
    else RequestError."""
    value = req.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds) or not valid(value):
        raise RequestError(f"{name}={json.dumps(value)} is invalid: {rule}", name)
    return value


def parse_completion(body, ctx):
    """(sampling parameters, prompt token ids) of a /v1/completions body, or RequestError."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise RequestError('the body is not JSON: send an object such as {"prompt": "def main(", "max_tokens": 16}')
    if not isinstance(req, dict):
        raise RequestError(f'the body is a JSON {type(req).__name__}, not an object: send {{"prompt": "..."}}')
    if not isinstance(req.get("prompt"), str):
        raise RequestError('prompt is missing or not a string: send "prompt": "text" (one string)', "prompt")
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
        stop=field(req, "stop", None, (str, list), lambda v: all(isinstance(s, str) and s for s in
                                                                 ([v] if isinstance(v, str) else v)),
                   "use a non-empty string or a list of them"),
    )
    field(req, "n", 1, (int,), lambda v: v == 1, "use 1: this server returns one completion per request")
    p["stop"] = [p["stop"]] if isinstance(p["stop"], str) else p["stop"] or []
    try:
        ids = ctx.tok.encode(req["prompt"])
    except ValueError as e:  # the char tokenizer knows only its corpus' characters
        raise RequestError(f"prompt cannot be encoded: {e}: leave those characters out", "prompt")
    if len(ids) > ctx.max_prompt:
        raise RequestError(f"prompt is {len(ids)} tokens, the model's context holds {ctx.max_prompt} after BOS: "
                           "shorten it", "prompt")
    return p, ids


def held_back(text, stops):
    """How many characters at the end of text could begin a stop string: they wait for the next token."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def complete(ctx, p, ids):
    """Yields (new text, finish_reason or None, tokens generated so far); the last has a finish_reason.
    Call it holding ctx.lock."""
    generator = torch.Generator(device=ctx.dev)
    if p["seed"] is None:
        generator.seed()
    else:
        generator.manual_seed(p["seed"])
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a token may end inside a character
    text, sent, n, finish = "", 0, 0, "length"
    x = torch.tensor([[ctx.tok.bos_id] + ids], device=ctx.dev)
    for token in ctx.model.generate(x, p["max_tokens"], temperature=p["temperature"], top_k=p["top_k"] or None,
                                    top_p=p["top_p"], generator=generator):
        if ctx.stopping.is_set():  # SIGTERM or Ctrl-C: end this request so that the process can exit
            raise RequestError("the server is shutting down: send the request again when it is back", status=503)
        n += 1
        if token.item() == ctx.tok.bos_id:  # the model ended the document (BOS = EOS)
            finish = "stop"
            break
        text += decoder.decode(ctx.tok.decode_bytes([token.item()]))
        cut = min((i for i in (text.find(s) for s in p["stop"]) if i >= 0), default=None)
        if cut is not None:
            yield text[sent:cut], "stop", n
            return
        safe = len(text) - held_back(text, p["stop"])
        if safe > sent:
            yield text[sent:safe], None, n
            sent = safe
    yield text[sent:] + decoder.decode(b"", final=True), finish, n


class Handler(http.server.BaseHTTPRequestHandler):
    """GET /health, GET /info, POST /v1/completions; self.server.ctx holds the model and the settings.
    HTTP/1.0 (http.server's default): one request per connection, so a stream ends when the connection
    closes, and a body left unread is never taken for the next request."""
    timeout = 60  # seconds a client may stall: a stalled one must not hold a thread (or the model) forever
    routes = {"/health": "GET", "/info": "GET", "/v1/completions": "POST"}

    def do_GET(self):
        self.route()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def route(self):
        ctx, path = self.server.ctx, self.path.split("?", 1)[0]
        self.streaming = False
        try:
            if path not in self.routes:
                raise RequestError(f"no such path {path}: use GET /health, GET /info or POST /v1/completions",
                                   status=404)
            if self.command != self.routes[path]:
                raise RequestError(f"{self.command} {path} is not supported: use {self.routes[path]} {path}",
                                   status=405)
            if path == "/health":
                self.send_json(200, {"status": "ok"})
            elif path == "/info":
                self.send_json(200, ctx.info)
            else:
                self.completions(ctx)
        except RequestError as e:
            if self.streaming:  # too late for a status: the stream ends without its [DONE]
                return
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            self.send_json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param}},
                           allow=self.routes[path] if e.status == 405 else None)
        except (ConnectionError, TimeoutError) as e:  # the client went away or stalled: serve the next one
            self.log_message("%s %s: the client left before the response ended (%s)", self.command, path,
                             type(e).__name__)
        except Exception as e:  # a bug, or out of memory: say so and keep serving
            print(f"error: {self.command} {path}: {first_line(e)}", file=sys.stderr, flush=True)
            if not self.streaming:
                self.send_json(500, {"error": {"message": first_line(e), "type": "server_error", "param": None}})

    def completions(self, ctx):
        size = self.headers.get("Content-Length", "0")
        if not size.isdigit():
            raise RequestError(f"Content-Length {size!r} is not a size in bytes: send the body's length")
        if int(size) > MAX_BODY_BYTES:  # refused unread
            raise RequestError(f"the body is {size} bytes, above this server's limit of {MAX_BODY_BYTES}: "
                               "send a shorter prompt", status=413)
        p, ids = parse_completion(self.rfile.read(int(size)), ctx)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": ctx.name}

        def body(text, finish, n):
            return dict(head, choices=[{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
                        usage={"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n})

        with ctx.lock:  # one generation at a time: the others wait here
            if not p["stream"]:
                parts = list(complete(ctx, p, ids))
                return self.send_json(200, body("".join(t for t, _, _ in parts), parts[-1][1], parts[-1][2]))
            self.streaming = True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for text, finish, n in complete(ctx, p, ids):
                chunk = body(text, finish, n)
                if finish is None:
                    del chunk["usage"]  # the last chunk counts the tokens
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    def send_json(self, status, obj, allow=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if allow:  # a 405 names the method that works
            self.send_header("Allow", allow)
        self.end_headers()
        self.wfile.write(data)


def serve_http(config, path, model, tok, info, dev):
    """Answer HTTP requests until SIGTERM or Ctrl-C (then exit 0)."""
    cfg = model.config
    ctx = SimpleNamespace(model=model, tok=tok, dev=dev, name=path, lock=threading.Lock(), stopping=threading.Event(),
                          max_tokens=config.serve_max_tokens, max_prompt=cfg.block_size - 1)
    ctx.info = dict(info, parameters=param_counts(cfg)["total"], tokenizer=tok.spec, block_size=cfg.block_size,
                    device=str(dev), limits={"max_tokens": ctx.max_tokens, "prompt_tokens": ctx.max_prompt,
                                             "body_bytes": MAX_BODY_BYTES})
    try:
        server = http.server.ThreadingHTTPServer((config.host, config.port), Handler)
    except OSError as e:
        fail(f"cannot listen on {config.host}:{config.port} ({first_line(e)}): "
             "pick another --port (0: any free one) or --host")
    # the exit waits for every request's thread (a thread killed inside torch aborts the process);
    # ctx.stopping makes a generation end at its next token
    server.daemon_threads = False
    server.ctx = ctx
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    host, bound = server.server_address[:2]
    print(f"serving {path} on http://{host}:{bound}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr, flush=True)
    finally:
        ctx.stopping.set()
        server.server_close()


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
