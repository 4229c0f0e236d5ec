"""The OpenAI-style completions API of a checkpoint on FastAPI + uvicorn, as docs/serving.md has it:
`python sample.py --ckpt=out --serve=True`. One generation at a time, on a thread of its own; every
request bounded (stop strings, body, arrival time, wait), so that no client holds the model."""

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

try:  # sample.py imports this module only to serve: sampling needs neither library
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.utils import get_path_with_query_string
except ImportError as e:
    fail(f"the server needs FastAPI and uvicorn ({e.name} is not installed): "
         "pip install fastapi uvicorn")

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused unread
MAX_STOPS = 4             # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256      # far more than a stop string needs; bounds the text held back
MAX_LOGPROBS = 5          # the most likely tokens listed per token, as OpenAI allows
# OpenAI's parameters that this server does not implement: each is accepted only at the value (or
# null) that changes nothing, so that no client gets an answer to a question it did not ask
UNSUPPORTED = {"n": (1, "one completion per request"), "best_of": (1, "one completion per request"),
               "presence_penalty": (0, "no penalties"), "frequency_penalty": (0, "no penalties"),
               "suffix": ("", "it continues the prompt"), "logit_bias": ({}, "no logit bias"),
               "stream_options": (None, "a stream's last chunk carries the usage")}
ROUTES = {"/health": "GET", "/info": "GET", "/v1/models": "GET", "/v1/completions": "POST"}
STOP_SECONDS = 3  # at SIGTERM or Ctrl-C, the time the running generation has to reach a token


# --- a request: its parameters, its prompt, its stop strings, its completion and log-probabilities

class RequestError(Exception):
    """A request refused: one line naming the problem and the fix; the field, status, headers."""

    def __init__(self, message, param=None, status=400, headers=None):
        super().__init__(message)
        self.param, self.status, self.headers = param, status, headers


def shown(value, width=40):
    """A client's value as JSON, cut short: a request must not make the reply (or the log) huge."""
    text = json.dumps(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"


def stops(value):
    """The stop strings of a request's "stop": null, a string or a list of them."""
    return [] if value is None else [value] if isinstance(value, str) else value


def parse_completion(body, ctx):
    """(sampling parameters, prompt token ids, prompt text) of a /v1/completions body."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested 1000s deep
        raise RequestError('the body is not JSON (or nests it too deeply): send an object such as '
                           '{"prompt": "def main("}')
    if not isinstance(req, dict):
        raise RequestError(f'the body is a JSON {type(req).__name__}: send {{"prompt": "..."}}')
    number, anything = (int, float), lambda v: True
    rules = {  # name: (default, types, valid(value), the rule a bad value breaks)
        "max_tokens": (16, (int,), lambda v: 0 <= v <= ctx.max_tokens,
                       f"use an integer from 0 to {ctx.max_tokens} (serve_max_tokens)"),
        "temperature": (1.0, number, lambda v: 0 <= v <= 2, "use a number from 0 (greedy) to 2"),
        "top_p": (1.0, number, lambda v: 0 < v <= 1, "use a number above 0 and at most 1"),
        "top_k": (None, (int,), lambda v: v >= 0, "use an integer >= 0 (0: all tokens)"),
        "stop": (None, (str, list), lambda v: len(stops(v)) <= MAX_STOPS and all(
                     isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops(v)),
                 f"use a string or a list of at most {MAX_STOPS}, each of 1 to {MAX_STOP_CHARS} "
                 "characters"),
        "seed": (None, (int,), lambda v: 0 <= v < 2**63, "use an integer from 0 to 2**63 - 1"),
        "stream": (False, (bool,), anything, "use true or false"),
        "echo": (False, (bool,), anything, "use true or false"),
        "logprobs": (None, (int,), lambda v: 0 <= v <= MAX_LOGPROBS,
                     f"use an integer from 0 to {MAX_LOGPROBS} (the tokens listed), or null"),
        "model": (None, (str,), anything, "use a string (any: the reply names the one served)"),
        "user": (None, (str,), anything, "use a string")}  # model and user: only names
    for key, value in req.items():  # a parameter not read, or not at a value that changes nothing
        neutral, why = UNSUPPORTED.get(key, (None, ""))
        if why and value is not None and (isinstance(value, bool) or value != neutral):
            send = "" if neutral is None else f" or send {json.dumps(neutral)}"
            raise RequestError(f"{key}={shown(value)} is not supported: leave it out{send} (this "
                               f"server: {why})", key)
        if not why and key != "prompt" and key not in rules:
            name = key if len(key) <= 40 else f"{key[:40]}..."  # the reply must not grow with it
            raise RequestError(f"{name} is not a parameter this server knows: leave it out (it "
                               f"reads prompt, {', '.join(rules)})", name)
    if req.get("prompt") is None:
        raise RequestError('prompt is missing: send "prompt": "text" (or token ids)', "prompt")
    p = {}
    for name, (default, kinds, valid, rule) in rules.items():  # null: the default
        value = req.get(name)
        if value is not None and (not isinstance(value, kinds) or not valid(value)
                                  or isinstance(value, bool) and bool not in kinds):  # True is no 1
            raise RequestError(f"{name}={shown(value)} is invalid: {rule}", name)
        p[name] = default if value is None else value
    p["stop"] = stops(p["stop"])
    if p["stream"] and p["logprobs"] is not None:
        raise RequestError("logprobs cannot be streamed: send stream=false to get them", "logprobs")
    ids, text = prompt_ids(ctx, req["prompt"])
    if len(ids) > ctx.max_prompt:
        raise RequestError(f"prompt is {len(ids)} tokens, the model's context holds "
                           f"{ctx.max_prompt} after BOS: shorten it", "prompt")
    return p, ids, text


def prompt_ids(ctx, value):
    """(token ids, text) of a prompt: a string, token ids, or a batch of one of those."""
    batch = isinstance(value, list) and all(isinstance(v, (str, list)) for v in value)
    if batch and len(value) > 1:
        raise RequestError(f"prompt holds {len(value)} prompts: send one per request "
                           "(lm-evaluation-harness: batch_size=1)", "prompt")
    if batch and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        try:
            return ctx.tok.encode(value), value
        except ValueError as e:  # the char tokenizer knows only its corpus' characters
            raise RequestError(f"prompt cannot be encoded: {e}: leave those out", "prompt")
    vocab = ctx.tok.vocab_size
    if isinstance(value, list) and value and all(type(i) is int and 0 <= i < vocab for i in value):
        return value, ctx.tok.decode(value)  # type(i) is int: no bools
    raise RequestError(f"prompt={shown(value)} is invalid: send a string, a non-empty list of "
                       f"token ids from 0 to {vocab - 1}, or a list holding one of those", "prompt")


def first_stop(text, stops):
    """Where in text the first stop string to end begins (of two ending at once, the longer)."""
    found = [(i + len(s), -len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[2] if found else None


def held_back(text, stops):
    """How many characters at the end of text could begin a stop string. Only the last
    MAX_STOP_CHARS - 1 can, so a token costs the same whatever text came before."""
    firsts = {s[0] for s in stops}
    for i in range(max(0, len(text) - max(map(len, stops), default=0) + 1), len(text)):
        if text[i] in firsts and any(s.startswith(text[i:]) for s in stops):
            return len(text) - i
    return 0


def model_input(ctx, ids):
    """BOS, which begins every training document, then the prompt (no second BOS)."""
    bos = ctx.tok.bos_id
    return torch.tensor([ids if ids[:1] == [bos] else [bos] + ids], device=ctx.dev)


def score(ctx, logits, tokens, k):
    """(log-probability of the token, its k most likely (id, log-probability)) per row of logits
    (T, V) and token: the model's own float32 log-softmax (no temperature, top_k, top_p)."""
    logprobs = logits[:, :ctx.model.config.vocab_size].float().log_softmax(dim=-1)  # no padding ids
    top = logprobs.topk(k, dim=-1)
    chosen = logprobs[torch.arange(len(tokens), device=logprobs.device), tokens].tolist()
    return [(c, list(zip(i, v)))
            for c, i, v in zip(chosen, top.indices.tolist(), top.values.tolist())]


def logprobs_object(tok, scored, start):
    """OpenAI's logprobs of (token id, score() or None) pairs whose text begins at `start`. A token
    is its text if its bytes are UTF-8 alone, else "bytes:\\xNN" (part of a character)."""
    def text(token):
        data = tok.decode_bytes([token])
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, s in scored:
        out["tokens"].append(text(token))
        out["token_logprobs"].append(None if s is None else s[0])
        out["top_logprobs"].append(None if s is None else {text(i): lp for i, lp in s[1]})
        out["text_offset"].append(start)
        start += len(decoder.decode(tok.decode_bytes([token])))
    return out


def reply_logprobs(ctx, p, ids, prompt, scored):
    """None unless asked for, else the generated tokens' (scored), after the prompt's with echo
    (the first gets None, as at OpenAI: a client sends ids that begin with BOS to score it)."""
    if scored is None:
        return None
    generated = logprobs_object(ctx.tok, scored, len(prompt))
    if not p["echo"] or not ids:
        return generated
    x = model_input(ctx, ids)
    with torch.no_grad():
        logits = ctx.model(x)[0][0]
    shift = x.size(1) - len(ids)  # 1 where BOS was put first: ids[j] is predicted at j - 1 + shift
    scores = score(ctx, logits[shift:len(ids) - 1 + shift], ids[1:], p["logprobs"])
    echoed = logprobs_object(ctx.tok, [(ids[0], None)] + list(zip(ids[1:], scores)), 0)
    return {key: echoed[key] + generated[key] for key in echoed}


def complete(ctx, p, ids, gone, scored=None):
    """Yields (new text, finish_reason or None, tokens so far); text that could begin a stop string
    waits until it cannot. scored: None, or a list that gets (token id, score()) of each token."""
    generator = torch.Generator(device=ctx.dev)  # the request's seed, else a random one
    generator.manual_seed(generator.seed() if p["seed"] is None else p["seed"])
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a token may end in a char
    held, n, finish = "", 0, "length"  # held: the text not yielded yet
    tokens = ctx.model.generate(model_input(ctx, ids), p["max_tokens"], generator=generator,
                                temperature=p["temperature"], top_k=p["top_k"] or None,
                                top_p=p["top_p"])
    # with logprobs, each forward's last logits: what each token was drawn from (after a restart of
    # the KV cache too)
    logits = []
    hook = scored is not None and ctx.model.register_forward_hook(
        lambda m, a, out: logits.append(out[0][0, -1]))
    try:
        for token in map(int, tokens):
            if ctx.stopping.is_set():  # SIGTERM or Ctrl-C: end this request, the process exits
                raise RequestError("the server is stopping: send the request again when it is back",
                                   status=503)
            if gone():  # nobody would read the rest: free the model for the next request
                raise ConnectionAbortedError(f"the client closed its connection: generation "
                                             f"stopped after {n} of {p['max_tokens']} tokens")
            n += 1
            if scored is not None:
                scored.append((token, score(ctx, logits.pop()[None], [token], p["logprobs"])[0]))
            if token == ctx.tok.bos_id:  # the model ended the document (BOS = EOS)
                finish = "stop"
                break
            # held holds no stop string, and is the longest end of the text that could begin one
            held += decoder.decode(ctx.tok.decode_bytes([token]))
            cut = first_stop(held, p["stop"])
            if cut is not None:
                yield held[:cut], "stop", n
                return
            ready = len(held) - held_back(held, p["stop"])
            if ready > 0:
                yield held[:ready], None, n
                held = held[ready:]
    finally:
        if hook:
            hook.remove()
    yield held + decoder.decode(b"", final=True), finish, n


class ModelQueue:
    """The model, for one generation at a time, first come first served; at most max_waiting wait,
    each at most max_wait seconds, or get 503 with a Retry-After (limit_concurrency has none)."""

    def __init__(self, max_waiting, max_wait):
        self.max_waiting, self.max_wait = max_waiting, max_wait
        self.cond = threading.Condition()
        self.line = collections.deque()  # the waiting requests, first come first
        self.started = None  # when the running generation took the model; None: the model is free
        self.held = collections.deque(maxlen=16)  # seconds each of the last requests held it
        self.closed = False  # the server is stopping: no generation starts

    def free(self):
        return self.started is None and not self.closed

    @contextlib.contextmanager
    def turn(self):
        with self.cond:
            if len(self.line) + (not self.free()) > self.max_waiting:
                raise self.refusal(f"the model is busy and its line is full ({len(self.line)} "
                                   "waiting: serve_max_queue)")
            me = object()
            self.line.append(me)
            if not self.cond.wait_for(lambda: self.line[0] is me and self.free(), self.max_wait):
                self.line.remove(me)
                self.cond.notify_all()  # the next one may be first in line now
                raise self.refusal(f"the model was not free within {self.max_wait} s "
                                   "(serve_max_wait)")
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
        """The 503; Retry-After: when the requests ahead would be done at the mean time the last
        ones held the model (before any ended: the running one's time so far), at least 1 s."""
        now = time.monotonic()
        per_request = sum(self.held) / len(self.held) if self.held else now - (self.started or now)
        seconds = max(1, math.ceil(per_request * (len(self.line) + (self.started is not None))))
        return RequestError(f"{why}: send it again in {seconds} s", status=503,
                            headers={"Retry-After": str(seconds)})

    def close(self, timeout):
        """Lets no generation start; waits up to timeout s for the running one: whether it ended."""
        with self.cond:
            self.closed = True
            return self.cond.wait_for(lambda: self.started is None, timeout)


# --- the HTTP layer: uvicorn's connection with the bounds it lacks, the FastAPI app, the thread

def log(client, message):
    """One write, so that threads' lines do not interleave; client: (host, port) or None."""
    when, who = time.strftime("%d/%b/%Y %H:%M:%S"), client[0] if client else "-"
    sys.stderr.write(f"{who} - - [{when}] {message}\n")  # stderr is line-buffered


def json_reply(status, obj, headers=None):
    """obj as json.dumps writes it (a log-probability of -inf too, as -Infinity)."""
    return Response(json.dumps(obj), status, headers, media_type="application/json")


def error_reply(e):
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return json_reply(e.status, {"error": {"message": str(e), "type": kind, "param": e.param}},
                      e.headers)


def length_error(size):
    """RequestError for a Content-Length (text) that is not a size or is over MAX_BODY_BYTES."""
    if not (size.isascii() and size.isdigit()):  # isdigit() alone passes "²", which int() refuses
        return RequestError(f"Content-Length {shown(size)} is not a size in bytes: send its length")
    if len(size) > 9 or int(size) > MAX_BODY_BYTES:  # int() refuses thousands of digits
        return RequestError(f"Content-Length {shown(size)} is above this server's limit of "
                            f"{MAX_BODY_BYTES} bytes: send a shorter prompt", status=413)
    return None


class Connection(H11Protocol):
    """uvicorn's connection (h11), one request each, with what uvicorn lacks: a request arrives
    within read_timeout seconds (uvicorn bounds a head's size, not its time); a head h11 refuses
    gets the JSON error (not plain text); a body cut short by EOF gets 400 (not a dropped line)."""

    def __init__(self, *args, read_timeout, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self.head = read_timeout, b""  # head: the bytes before h11's request
        self.timer = self.loop.call_later(read_timeout, self.too_slow)

    def connection_lost(self, exc):
        self.timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data):
        if self.cycle is None:
            self.head += data
        elif not self.cycle.more_body:
            return  # bytes after the request, unread: h11 would pause reading, blind to a leaving
        super().data_received(data)

    def eof_received(self):
        if self.cycle is None or not self.cycle.more_body:
            return False  # the connection closes: its client has left, its generation stops
        self.cycle.more_body = False  # a body cut short ends here, and gets the app's 400
        self.cycle.message_event.set()
        return True

    def too_slow(self):
        if self.cycle is None:
            self.transport.close()  # its head never came whole: dropped unanswered
        elif self.cycle.more_body:  # its body never did: 408, and its handler sees the client gone
            self.refuse(RequestError(f"the request did not arrive within {self.read_timeout} s "
                                     "(serve_read_timeout): send it at once", status=408))

    def send_400_response(self, msg):
        """h11 refused the request's head: the JSON error, naming the bad Content-Length or h11's
        reason."""
        size = re.search(rb"(?im)^content-length:(.*)$", self.head)
        error = size and length_error(size[1].strip().decode("latin-1"))
        reason = first_line(sys.exc_info()[1])[:80]  # h11's reason may quote the request at length
        self.refuse(error or RequestError(f"the request is not HTTP that h11 reads ({reason}): "
                                          "send a well-formed HTTP/1.1 request"))

    def refuse(self, error):
        """Answers error past h11, which writes HTTP/1.1 alone: in the client's version."""
        line = self.head.split(b"\n", 1)[0].strip().decode("latin-1")
        version, body = "1.0" if line.endswith("HTTP/1.0") else "1.1", error_reply(error).body
        self.transport.write(f"HTTP/{version} {error.status} {http.HTTPStatus(error.status).phrase}"
                             f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                             "\r\nConnection: close\r\n\r\n".encode() + body)
        self.transport.close()
        log(self.client, f'"{line}" {error.status} -')


def logged(app):
    """app, logging each reply's status (uvicorn's access log leaves out a client already gone)."""
    async def app_logged(scope, receive, send):
        async def send_logged(message):
            if message["type"] == "http.response.start":
                line = f'{scope["method"]} {get_path_with_query_string(scope)}'
                log(scope["client"], f'"{line} HTTP/{scope["http_version"]}" {message["status"]} -')
            await send(message)
        await app(scope, receive, send_logged)
    return app_logged


def make_app(ctx):
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    models = {"object": "list", "data": [{"id": ctx.name, "object": "model",
                                          "created": ctx.created, "owned_by": "podgpt"}]}
    for path, obj in (("/health", {"status": "ok"}), ("/info", ctx.info), ("/v1/models", models)):
        app.add_route(path, json_reply(200, obj), methods=["GET"])  # an ASGI app: the same reply

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            return await answer(ctx, request)
        except RequestError as e:
            return error_reply(e)
        except (ClientDisconnect, ConnectionAbortedError):  # gone: uvicorn writes nothing, the log
            return Response(status_code=499)  # says 499 (nginx's "client closed request")
        except Exception as e:  # a bug, or out of memory: say so and keep serving
            print(f"error: POST /v1/completions: {first_line(e)}", file=sys.stderr, flush=True)
            return error_reply(RequestError(first_line(e), status=500))

    @app.exception_handler(HTTPException)  # FastAPI's 404 and 405
    async def unrouted(request, e):
        path, use = request.url.path, ", ".join(f"{m} {p}" for p, m in ROUTES.items())
        allow = {"Allow": ROUTES[path]} if path in ROUTES else None
        use = f"{ROUTES[path]} {path}" if allow else use
        return error_reply(RequestError(f"{request.method} {path} is not served: use {use}",
                                        status=e.status_code, headers=allow))
    return logged(app)


async def answer(ctx, request):
    size = request.headers.get("content-length")
    if size is None or "transfer-encoding" in request.headers:
        raise RequestError("the body has no Content-Length (a chunked body is not read): send it "
                           "whole, with its length", status=411)
    # not FastAPI's max_body_size, which answers in plain text
    if error := length_error(size):
        raise error
    body = await request.body()  # ClientDisconnect if the client left, or was too slow (408)
    if len(body) < int(size):
        raise RequestError(f"the body ended after {len(body)} of the {size} bytes its "
                           "Content-Length promised: send all of it")
    p, ids, prompt = parse_completion(body, ctx)
    # after the body, uvicorn's receive() returns once the client has left (or the reply is done)
    left = threading.Event()
    asyncio.ensure_future(request.receive()).add_done_callback(lambda _: left.set())
    loop, replies = asyncio.get_running_loop(), asyncio.Queue()
    say = functools.partial(log, request.scope["client"])
    put = functools.partial(loop.call_soon_threadsafe, replies.put_nowait)
    threading.Thread(target=generate, args=(ctx, p, ids, prompt, left.is_set, say, put),
                     daemon=True).start()
    first = await replies.get()
    if isinstance(first, Exception):
        raise first
    if not p["stream"]:
        return json_reply(200, first)
    return StreamingResponse(events(first, replies), headers={"Content-Type": "text/event-stream",
                                                              "Cache-Control": "no-cache"})


async def events(reply, replies):
    """Server-sent events, then `data: [DONE]`, which a stream cut short (the client left, the
    server is stopping, a bug) leaves out: too late for an error's status."""
    while reply is not None and not isinstance(reply, Exception):
        yield f"data: {json.dumps(reply)}\n\n"
        await asyncio.sleep(0)  # uvicorn sees a client leave between chunks, not after a burst
        reply = await replies.get()
    if reply is None:
        yield "data: [DONE]\n\n"
    elif not isinstance(reply, (RequestError, ConnectionAbortedError)):  # a bug: say so
        print(f"error: POST /v1/completions: {first_line(reply)}", file=sys.stderr, flush=True)


def generate(ctx, p, ids, prompt, gone, say, put):
    """Puts a completion's replies (the whole reply, or a stream's chunks) then None, or what ended
    them; on a thread of its own, so that a client that stops reading does not hold the model."""
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": ctx.name}

    def reply(text, finish, n, logprobs=None):  # of a stream's chunks, the last alone has usage
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
        return dict(head, choices=[choice], **({"usage": usage} if finish else {}))

    try:
        with ctx.queue.turn():
            scored = None if p["logprobs"] is None else []
            parts = complete(ctx, p, ids, gone, scored)
            if p["echo"]:  # the prompt's text first, streamed or not
                parts = itertools.chain([(prompt, None, 0)], parts)
            if p["stream"]:
                for text, finish, n in parts:
                    put(reply(text, finish, n))
            else:
                parts = list(parts)
                text, finish, n = "".join(t for t, _, _ in parts), parts[-1][1], parts[-1][2]
                put(reply(text, finish, n, reply_logprobs(ctx, p, ids, prompt, scored)))
        put(None)
    except Exception as e:  # the client left, a RequestError (503), or a bug: the reply says so
        put(e)
        if isinstance(e, ConnectionAbortedError):
            say(f"the client left before the response ended ({first_line(e)})")


class Server(uvicorn.Server):
    """Ends at SIGTERM or Ctrl-C once the running generation stops (uvicorn's waits for every
    client, then raises the signal: exit -15)."""

    def __init__(self, config, ctx):
        super().__init__(config)
        self.ctx = ctx

    async def shutdown(self, sockets=None):
        print("stopping", file=sys.stderr, flush=True)
        self.ctx.stopping.set()  # the running generation ends at its next token
        if not self.ctx.queue.close(STOP_SECONDS):
            print(f"warning: the generation did not stop within {STOP_SECONDS} s: exiting anyway",
                  file=sys.stderr, flush=True)
        # at once: the interpreter's teardown would end waiting threads (pthread_exit): an abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def serve_http(config, path, model, tok, info, dev):
    """Answer HTTP requests until SIGTERM or Ctrl-C (then exit 0)."""
    cfg = model.config
    ctx = SimpleNamespace(model=model, tok=tok, dev=dev, name=path,
                          created=int(os.path.getmtime(path)),  # when it was written: /v1/models
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
    # one request per connection, as Connection reads them; the longest accept queue, so that a
    # burst of clients gets answers, not resets; the access log is logged()'s
    protocol = functools.partial(Connection, read_timeout=config.serve_read_timeout)
    settings = uvicorn.Config(make_app(ctx), http=protocol, loop="asyncio", ws="none",
                              lifespan="off", headers=[("Connection", "close")],
                              backlog=socket.SOMAXCONN, proxy_headers=False, log_config=None,
                              log_level="error", access_log=False)
    Server(settings, ctx).run(sockets=[sock])
