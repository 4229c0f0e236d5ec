"""
The OpenAI-style completions API of a checkpoint, on FastAPI + uvicorn: `python sample.py --ckpt=out --serve=True`
(sample.py loads the model and hands it to serve_http; docs/serving.md describes the API in full).

    GET  /health          {"status": "ok"}
    GET  /info            the checkpoint, its step and validation loss, the model, the tokenizer, the limits
    GET  /v1/models       OpenAI-style: the one model served; its id is the checkpoint's path
    POST /v1/completions  OpenAI-style: prompt (text, token ids, or a batch of one), max_tokens, temperature, top_p,
                          top_k, stop, seed, stream (server-sent events), echo, logprobs (the model's own
                          log-softmax), model (any name), user

The model generates for one request at a time, on a thread of its own; the others wait in a bounded line, for a
bounded time, or get 503 with a Retry-After. A bad request gets 400 and {"error": {"message", "type", "param"}};
OpenAI's parameters this server does not implement are refused, never ignored. Every request is bounded (/info
lists the limits): its stop strings, its body (413; 411 without a Content-Length) and the time it takes to arrive
(408), so that no client holds the model or the server; a client that leaves ends its generation. SIGTERM or
Ctrl-C ends the server within a few seconds, exit 0. There is no authentication: keep host=127.0.0.1 or put a
proxy in front.
"""

import asyncio
import codecs
import collections
import contextlib
import functools
import http
import itertools
import json
import math
import os
import re
import socket
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import torch

from podgpt.pod.preflight import param_counts
from podgpt.core.util import fail, first_line

try:  # the server's libraries: sample.py imports this module only to serve, so sampling needs neither
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.utils import get_path_with_query_string
except ImportError as e:
    fail(f"the server needs FastAPI and uvicorn ({e.name} is not installed): pip install fastapi uvicorn")

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
ROUTES = {"/health": "GET", "/info": "GET", "/v1/models": "GET", "/v1/completions": "POST"}
STOP_SECONDS = 3                # at SIGTERM or Ctrl-C, how long the running generation gets to reach its next token


# -----------------------------------------------------------------------------
# a request: its parameters, its prompt, its stop strings, its completion and log-probabilities


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


def first_stop(text, stops):
    """Where in text the first stop string to end in it begins (of two that end at once, the longer: it
    begins first), or None."""
    found = [(i + len(s), -len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[2] if found else None


def held_back(text, stops):
    """How many characters at the end of text could begin a stop string: they wait for more text. Only
    the last MAX_STOP_CHARS - 1 can, so a token costs the same however long the text before it."""
    firsts = {s[0] for s in stops}
    for i in range(max(0, len(text) - max(map(len, stops), default=0) + 1), len(text)):
        if text[i] in firsts and any(s.startswith(text[i:]) for s in stops):
            return len(text) - i
    return 0


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
            # the text not yielded yet holds no stop string and ends with the longest start of
            # one: a stop string that ends in the new text begins in it, so it is all that is searched
            held += decoder.decode(ctx.tok.decode_bytes([token.item()]))
            cut = first_stop(held, p["stop"])
            if cut is not None:
                yield held[:cut], "stop", n
                return
            ready = len(held) - held_back(held, p["stop"])
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


# -----------------------------------------------------------------------------
# the HTTP layer: uvicorn's connection with the bounds it lacks, the FastAPI app, the model's thread


def log(client, message):
    """A line of the server's log: the client's address (client: its (host, port), None once it is
    gone), the time, what happened. One write, so that threads' lines do not interleave."""
    sys.stderr.write(f"{client[0] if client else '-'} - - [{time.strftime('%d/%b/%Y %H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def request_line(scope):
    return f'{scope["method"]} {get_path_with_query_string(scope)} HTTP/{scope["http_version"]}'


def error_json(e):
    """The JSON error of a RequestError, as OpenAI's: {"error": {"message", "type", "param"}}."""
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": str(e), "type": kind, "param": e.param}}


def length_error(size):
    """RequestError for a Content-Length (its text) that is not a size (400) or is over MAX_BODY_BYTES
    (413: refused unread); None for one this server reads."""
    if not (size.isascii() and size.isdigit()):  # isdigit() alone passes "²", which int() refuses
        return RequestError(f"Content-Length {shown(size)} is not a size in bytes: send the body's "
                            "length")
    if len(size) > 9 or int(size) > MAX_BODY_BYTES:  # int() refuses thousands of digits
        return RequestError(f"Content-Length {shown(size)} is above this server's limit of "
                            f"{MAX_BODY_BYTES} bytes: send a shorter prompt", status=413)
    return None


class Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection (h11), one request each, with the bounds uvicorn lacks: the whole
    request within read_timeout seconds of the connection (uvicorn bounds a head's size, never the
    time a request takes: a client sending a byte at a time would hold its connection for as long as
    it likes), the JSON error for a head h11 refuses (uvicorn answers in plain text), and the 400 for
    a body cut short by the client's EOF (where uvicorn drops the connection unanswered)."""

    def __init__(self, *args, read_timeout, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.head = b""  # the bytes that came before h11 made a request of them

    def connection_made(self, transport):
        super().connection_made(transport)
        self.timer = self.loop.call_later(self.read_timeout, self.too_slow)

    def connection_lost(self, exc):
        self.timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data):
        if self.cycle is None:
            self.head += data
        elif not self.cycle.more_body:
            return  # bytes after the request, never read: h11 would pause reading, blind to a leaving
        super().data_received(data)

    def eof_received(self):
        if self.cycle is None or not self.cycle.more_body:
            return False  # the connection closes: its client has left, and its generation stops
        self.cycle.more_body = False  # a body cut short ends here, and gets the app's 400
        self.cycle.message_event.set()
        return True

    def too_slow(self):
        """read_timeout after the connection opened: a request whose head has not come whole is dropped
        unanswered, one whose body has not gets 408 (its handler then sees its client gone)."""
        if self.cycle is None:
            self.transport.close()
        elif self.cycle.more_body:
            self.refuse(RequestError(f"the request did not arrive within {self.read_timeout} s "
                                     "(serve_read_timeout): send it at once", status=408))

    def send_400_response(self, msg):
        """h11 refused the request's head: the JSON error, naming the Content-Length h11 cannot read, or
        h11's reason (uvicorn calls this handling h11's error)."""
        size = re.search(rb"(?im)^content-length:(.*)$", self.head)
        error = size and length_error(size[1].strip().decode("latin-1"))
        reason = first_line(sys.exc_info()[1])[:80]  # h11's reason may quote the request at length
        self.refuse(error or RequestError(f"the request is not HTTP that h11 reads ({reason}): send "
                                          "a well-formed HTTP/1.1 request"))

    def refuse(self, error):
        """Answers error and closes the connection, past h11: in the client's HTTP version (h11 writes
        1.1 alone)."""
        line = self.head.split(b"\n", 1)[0].strip().decode("latin-1")
        body = json.dumps(error_json(error)).encode()
        self.transport.write(f"HTTP/1.{int(not line.endswith('HTTP/1.0'))} {error.status} "
                             f"{http.HTTPStatus(error.status).phrase}\r\nContent-Type: application/json"
                             f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                             + body)
        self.transport.close()
        log(self.client, f'"{line}" {error.status} -')


class NoReply(Response):
    """The reply to a client that has left: none (uvicorn writes nothing to a closed connection)."""

    async def __call__(self, scope, receive, send):
        pass


def json_reply(status, obj, headers=None):
    """obj as JSON, as json.dumps writes it (a log-probability of -inf too, as -Infinity)."""
    return Response(json.dumps(obj), status, headers, media_type="application/json")


def error_reply(e):
    return json_reply(e.status, error_json(e), e.headers)


def logged(app):
    """app, logging the status of each reply: '<client> - - [<time>] "<request line>" 200 -' (uvicorn's
    access log leaves out a reply to a client already gone)."""
    async def app_logged(scope, receive, send):
        async def send_logged(message):
            if message["type"] == "http.response.start":
                log(scope["client"], f'"{request_line(scope)}" {message["status"]} -')
            await send(message)
        await app(scope, receive, send_logged)
    return app_logged


def make_app(ctx):
    """The API as a FastAPI app; a path or method it does not answer gets the JSON error, not
    FastAPI's own."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    models = {"object": "list", "data": [{"id": ctx.name, "object": "model", "created": ctx.created,
                                          "owned_by": "podgpt"}]}

    @app.get("/health")
    async def health():
        return json_reply(200, {"status": "ok"})

    @app.get("/info")
    async def info():
        return json_reply(200, ctx.info)

    @app.get("/v1/models")
    async def listed():
        return json_reply(200, models)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            return await answer(ctx, request)
        except RequestError as e:
            return error_reply(e)
        except (ClientDisconnect, ConnectionAbortedError):  # the client left (generate logs it)
            return NoReply()
        except Exception as e:  # a bug, or out of memory: say so and keep serving
            print(f"error: POST /v1/completions: {first_line(e)}", file=sys.stderr, flush=True)
            return error_reply(RequestError(first_line(e), status=500))

    @app.exception_handler(HTTPException)
    async def unrouted(request, e):
        path = request.url.path
        if path not in ROUTES:
            return error_reply(RequestError(f"no such path {path}: use GET /health, GET /info, GET "
                                            "/v1/models or POST /v1/completions", status=404))
        return error_reply(RequestError(f"{request.method} {path} is not supported: use "
                                        f"{ROUTES[path]} {path}", status=405,
                                        headers={"Allow": ROUTES[path]}))
    return logged(app)


async def answer(ctx, request):
    """The reply to POST /v1/completions: the completion or a stream of it. The model runs on a thread
    of its own, so that the server goes on answering (and refusing) while it generates."""
    size = request.headers.get("content-length")
    if size is None or "transfer-encoding" in request.headers:
        raise RequestError("the body has no Content-Length (a chunked body is not read): send it "
                           "whole, with its length in bytes", status=411)
    # h11 refuses a length of over 20 digits before FastAPI's max_body_size could see it: one check
    # serves both (and answers in JSON where max_body_size would answer some in plain text)
    error = length_error(size)
    if error:
        raise error
    body = await request.body()  # ClientDisconnect if the client left, or was too slow (408)
    if len(body) < int(size):
        raise RequestError(f"the body ended after {len(body)} of the {size} bytes its "
                           "Content-Length promised: send all of it")
    p, ids, prompt = parse_completion(body, ctx)
    # after the body, uvicorn's receive() returns only once the client has left (or the reply ended)
    left = threading.Event()
    asyncio.ensure_future(request.receive()).add_done_callback(lambda _: left.set())
    client, line = request.scope["client"], request_line(request.scope)
    replies = in_thread(generate(ctx, p, ids, prompt, left.is_set,
                                 lambda said: log(client, f"{line}: {said}")))
    first = await anext(replies)
    if not p["stream"]:
        return json_reply(200, first)
    return StreamingResponse(events(first, replies),
                             headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


async def events(first, replies):
    """A stream's server-sent events: `data: {chunk}` for each chunk, then `data: [DONE]`. A stream cut
    short (the client left, the server is stopping, a bug) ends without [DONE]: too late for an
    error's status."""
    try:
        yield f"data: {json.dumps(first)}\n\n"
        async for chunk in replies:
            yield f"data: {json.dumps(chunk)}\n\n"
    except (RequestError, ConnectionAbortedError):
        return
    except Exception as e:
        print(f"error: POST /v1/completions: {first_line(e)}", file=sys.stderr, flush=True)
        return
    yield "data: [DONE]\n\n"


async def in_thread(replies):
    """What the generator `replies` yields, made on a thread of its own (the event loop goes on serving
    meanwhile, and a client that stops reading does not hold the model); its exception comes out here."""
    loop, items = asyncio.get_running_loop(), asyncio.Queue()

    def put(item):
        with contextlib.suppress(RuntimeError):  # the event loop has closed: the process is exiting
            loop.call_soon_threadsafe(items.put_nowait, item)

    def run():
        try:
            for reply in replies:
                put((reply, None))
            put((None, None))
        except Exception as e:
            put((None, e))
    threading.Thread(target=run, daemon=True).start()
    while True:
        reply, error = await items.get()
        if error is not None:
            raise error
        if reply is None:
            return
        yield reply


def generate(ctx, p, ids, prompt, gone, say):
    """A completion's replies, made holding the model (ctx.queue: one generation at a time, the others
    wait within bounds or get a 503): the whole reply, or a stream's chunks (the last one counts the
    tokens). gone(): whether the client has left, which ends the generation (say() logs it)."""
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": ctx.name}

    def reply(text, finish, n, logprobs=None):
        return dict(head, choices=[{"text": text, "index": 0, "logprobs": logprobs,
                                    "finish_reason": finish}],
                    usage={"prompt_tokens": len(ids), "completion_tokens": n,
                           "total_tokens": len(ids) + n})

    with ctx.queue.turn():
        scored = None if p["logprobs"] is None else []
        parts = complete(ctx, p, ids, gone, scored)
        if p["echo"]:  # the prompt's text first, streamed or not
            parts = itertools.chain([(prompt, None, 0)], parts)
        try:
            if not p["stream"]:
                parts = list(parts)
                text, finish, n = "".join(t for t, _, _ in parts), parts[-1][1], parts[-1][2]
                yield reply(text, finish, n, reply_logprobs(ctx, p, ids, prompt, scored))
                return
            for text, finish, n in parts:
                chunk = reply(text, finish, n)
                if finish is None:
                    del chunk["usage"]
                yield chunk
        except ConnectionAbortedError as e:
            say(f"the client left before the response ended ({first_line(e)})")
            raise


class Server(uvicorn.Server):
    """uvicorn's server, which ends at SIGTERM or Ctrl-C as soon as the running generation has stopped:
    uvicorn's graceful shutdown waits for every client (timeout_graceful_shutdown then cancels them,
    with a traceback each), and then raises the signal again (exit -15, not 0)."""

    def __init__(self, config, ctx):
        super().__init__(config)
        self.ctx = ctx

    async def shutdown(self, sockets=None):
        print("stopping", file=sys.stderr, flush=True)
        self.ctx.stopping.set()  # the running generation ends at its next token
        if not self.ctx.queue.close(STOP_SECONDS):
            print(f"warning: the generation did not stop within {STOP_SECONDS} s: exiting anyway",
                  file=sys.stderr, flush=True)
        # End at once, the queue closed so that no generation starts: threads may be waiting in line
        # or encoding a prompt, and the interpreter's teardown would end them inside that call
        # (pthread_exit), which can abort the process from native code; os._exit ends them all.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def serve_http(config, path, model, tok, info, dev):
    """Answer HTTP requests until SIGTERM or Ctrl-C (then exit 0)."""
    cfg = model.config
    # created (/v1/models): when the checkpoint or export was written
    ctx = SimpleNamespace(model=model, tok=tok, dev=dev, name=path, created=int(os.path.getmtime(path)),
                          queue=ModelQueue(config.serve_max_queue, config.serve_max_wait),
                          stopping=threading.Event(), max_tokens=config.serve_max_tokens,
                          max_prompt=cfg.block_size - 1)
    limits = {"max_tokens": ctx.max_tokens, "prompt_tokens": ctx.max_prompt,
              "body_bytes": MAX_BODY_BYTES, "stop_strings": MAX_STOPS, "stop_chars": MAX_STOP_CHARS,
              "read_seconds": config.serve_read_timeout, "logprobs": MAX_LOGPROBS,
              "queue": config.serve_max_queue, "wait_seconds": config.serve_max_wait}
    ctx.info = dict(info, parameters=param_counts(cfg)["total"], tokenizer=tok.spec,
                    block_size=cfg.block_size, device=str(dev), limits=limits)
    try:
        sock = socket.create_server((config.host, config.port))
    except OSError as e:
        fail(f"cannot listen on {config.host}:{config.port} ({first_line(e)}): "
             "pick another --port (0: any free one) or --host")
    host, port = sock.getsockname()[:2]
    print(f"serving {path} on http://{host}:{port}", flush=True)  # it takes connections from now on
    # one request per connection (Connection: close), as Connection reads them; the system's longest
    # accept queue, so that a burst of clients gets answers (a 503 past the line's bound), not
    # resets; uvicorn's own log lines only for errors (the access log is logged()'s)
    settings = uvicorn.Config(make_app(ctx), loop="asyncio", ws="none", lifespan="off",
                              http=functools.partial(Connection, read_timeout=config.serve_read_timeout),
                              headers=[("Connection", "close")], backlog=socket.SOMAXCONN,
                              proxy_headers=False, log_config=None, log_level="error",
                              access_log=False)
    Server(settings, ctx).run(sockets=[sock])
