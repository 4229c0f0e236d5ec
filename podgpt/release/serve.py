"""The OpenAI-style completions and chat completions API of a checkpoint on FastAPI + uvicorn, as
docs/serving.md has it: `python sample.py --ckpt=out --serve=True`. One generation at a time, on a
thread of its own; every request bounded (stop strings, body, arrival time, wait, choices), so that
no client holds the model. bounds.py holds the bounds, chat.py the chat format."""

import asyncio
import codecs
import functools
import itertools
import json
import os
import socket
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import torch

from podgpt.pod.memory import param_counts
from podgpt.core.util import fail, first_line

try:  # sample.py imports this module only to serve: sampling needs neither library
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
except ImportError as e:
    fail(f"the server needs FastAPI and uvicorn ({e.name} is not installed): "
         "pip install fastapi uvicorn")

from podgpt.release import chat  # noqa: E402 -- after the check above: both need FastAPI
from podgpt.release.bounds import (MAX_BODY_BYTES, Connection, ModelQueue,  # noqa: E402
                                   RequestError, error_reply, json_reply, length_error, log,
                                   logged, shown)

MAX_STOPS = 4             # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256      # far more than a stop string needs; bounds the text held back
MAX_LOGPROBS = 5          # the most likely tokens listed per token, as OpenAI allows
# OpenAI's parameters that this server does not implement: each is accepted only at the value (or
# null) that changes nothing, so that no client gets an answer to a question it did not ask
UNSUPPORTED = {"best_of": (1, "each choice is one sample"),
               "presence_penalty": (0, "no penalties"), "frequency_penalty": (0, "no penalties"),
               "suffix": ("", "it continues the prompt"), "logit_bias": ({}, "no logit bias"),
               "stream_options": (None, "a stream's last chunk carries the usage")}
ROUTES = {"/health": "GET", "/info": "GET", "/v1/models": "GET", "/v1/completions": "POST",
          "/v1/chat/completions": "POST"}
STOP_SECONDS = 3  # at SIGTERM or Ctrl-C, the time the running generation has to reach a token


# --- a request: its parameters, its prompt, its stop strings, its completion and log-probabilities


def stops(value):
    """The stop strings of a request's "stop": null, a string or a list of them."""
    return [] if value is None else [value] if isinstance(value, str) else value


def read_object(body, example):
    """The JSON object a body holds."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested 1000s deep
        raise RequestError("the body is not JSON (or nests it too deeply): send an object such as "
                           f"{example}")
    if not isinstance(req, dict):
        raise RequestError(f"the body is a JSON {type(req).__name__}: send {example}")
    return req


def sampling_rules(ctx):
    """{name: (default, types, valid(value), the rule a bad value breaks)}: both endpoints'."""
    number, anything = (int, float), lambda v: True
    return {
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
        "n": (1, (int,), lambda v: 1 <= v <= ctx.max_n,
              "use an integer from 1 to the server's serve_max_n (GET /info: limits.n)"),
        "model": (None, (str,), anything, "use a string (any: the reply names the one served)"),
        "user": (None, (str,), anything, "use a string")}  # model and user: only names


def parameters(req, rules, needed):
    """The parameters of a request by rules (null: the default); needed: (the field a request must
    hold, what to send)."""
    for key, value in req.items():  # a parameter not read, or not at a value that changes nothing
        neutral, why = UNSUPPORTED.get(key, (None, ""))
        if why and value is not None and (isinstance(value, bool) or value != neutral):
            send = "" if neutral is None else f" or send {json.dumps(neutral)}"
            raise RequestError(f"{key}={shown(value)} is not supported: leave it out{send} (this "
                               f"server: {why})", key)
        if not why and key != needed[0] and key not in rules:
            name = key if len(key) <= 40 else f"{key[:40]}..."  # the reply must not grow with it
            raise RequestError(f"{name} is not a parameter this server knows: leave it out (it "
                               f"reads {needed[0]}, {', '.join(rules)})", name)
    if req.get(needed[0]) is None:
        raise RequestError(f"{needed[0]} is missing: send {needed[1]}", needed[0])
    p = {}
    for name, (default, kinds, valid, rule) in rules.items():
        value = req.get(name)
        if value is not None and (not isinstance(value, kinds) or not valid(value)
                                  or isinstance(value, bool) and bool not in kinds):  # True is no 1
            raise RequestError(f"{name}={shown(value)} is invalid: {rule}", name)
        p[name] = default if value is None else value
    p["stop"] = stops(p["stop"])
    return p


def parse_completion(body, ctx):
    """(sampling parameters, prompt token ids, prompt text) of a /v1/completions body. A chat
    model's completion ends at <|end|> too, unless stop_token_ids says otherwise."""
    req, vocab = read_object(body, '{"prompt": "def main("}'), ctx.tok.vocab_size
    rules = dict(sampling_rules(ctx), **{
        "echo": (False, (bool,), lambda v: True, "use true or false"),
        "logprobs": (None, (int,), lambda v: 0 <= v <= MAX_LOGPROBS,
                     f"use an integer from 0 to {MAX_LOGPROBS} (the tokens listed), or null"),
        "stop_token_ids": (None, (list,), lambda v: len(v) <= MAX_STOPS and all(
                               type(i) is int and 0 <= i < vocab for i in v),
                           f"use a list of at most {MAX_STOPS} token ids from 0 to {vocab - 1} "
                           "([]: none but BOS)")})
    p = parameters(req, rules, ("prompt", '"prompt": "text" (or token ids)'))
    if p["stream"] and p["logprobs"] is not None:
        raise RequestError("logprobs cannot be streamed: send stream=false to get them", "logprobs")
    ends = [ctx.tok.chat["<|end|>"]] if "<|end|>" in ctx.tok.chat else []
    p["stop_ids"] = ends if p.pop("stop_token_ids") is None else req["stop_token_ids"]
    ids, text = prompt_ids(ctx, req["prompt"])
    if len(ids) > ctx.max_prompt:
        raise RequestError(f"prompt is {len(ids)} tokens, the model's context holds "
                           f"{ctx.max_prompt} after BOS: shorten it", "prompt")
    return p, ids, text


def parse_chat(body, ctx):
    """(sampling parameters, prompt token ids, "") of a /v1/chat/completions body: the prompt is
    the chat template's, the reply ends at <|end|>; max_tokens defaults to the context's room."""
    chat.check_chat_model(ctx.tok)
    req = read_object(body, chat.EXAMPLE)
    rules = dict(sampling_rules(ctx), **{
        "max_completion_tokens": sampling_rules(ctx)["max_tokens"],
        "logprobs": (False, (bool,), lambda v: True, "use true or false"),
        "top_logprobs": (None, (int,), lambda v: 0 <= v <= MAX_LOGPROBS,
                         f"use an integer from 0 to {MAX_LOGPROBS} (the tokens listed), or null")})
    p = parameters(req, rules, ("messages", chat.EXAMPLE[1:-1]))
    if req.get("max_tokens") is not None and req.get("max_completion_tokens") is not None:
        raise RequestError("max_completion_tokens and max_tokens (its older name) are both set: "
                           "send one",
                           "max_completion_tokens")
    if p["top_logprobs"] is not None and not p["logprobs"]:
        raise RequestError("top_logprobs needs logprobs: send logprobs=true", "top_logprobs")
    if p["stream"] and p["logprobs"]:
        raise RequestError("logprobs cannot be streamed: send stream=false to get them", "logprobs")
    ids = chat.prompt_ids(ctx.tok, req["messages"])
    if len(ids) > ctx.max_prompt + 1:
        raise RequestError(f"messages are {len(ids)} tokens in the chat template (BOS first), the "
                           f"model's context holds {ctx.max_prompt + 1}: shorten them", "messages")
    most = next((req[k] for k in ("max_completion_tokens", "max_tokens") if req.get(k) is not None),
                min(ctx.max_tokens, ctx.max_prompt + 1 - len(ids)))
    p.update(max_tokens=most, logprobs=(p["top_logprobs"] or 0) if p["logprobs"] else None,
             echo=False, stop_ids=[ctx.tok.chat["<|end|>"]])
    return p, ids, ""


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


def seeded(ctx, seed):
    """A generator at the request's seed, else a random one."""
    generator = torch.Generator(device=ctx.dev)
    return generator.manual_seed(generator.seed() if seed is None else seed)


def complete(ctx, p, ids, gone, scored=None, generator=None):
    """Yields (new text, finish_reason or None, tokens so far); text that could begin a stop string
    waits until it cannot. scored: None, or a list that gets (token id, score()) of each token;
    generator: what draws the tokens (None: one at p["seed"]). BOS and p["stop_ids"] end it."""
    generator = generator or seeded(ctx, p["seed"])
    ends = {ctx.tok.bos_id, *p.get("stop_ids", ())}
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
            if token in ends:  # the model ended the document (BOS = EOS), or its reply
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


# --- the HTTP layer: uvicorn's connection with the bounds it lacks, the FastAPI app, the thread


def make_app(ctx):
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    models = {"object": "list", "data": [{"id": ctx.name, "object": "model",
                                          "created": ctx.created, "owned_by": "podgpt"}]}
    for path, obj in (("/health", {"status": "ok"}), ("/info", ctx.info), ("/v1/models", models)):
        app.add_route(path, json_reply(200, obj), methods=["GET"])  # an ASGI app: the same reply

    for path, parse in (("/v1/completions", parse_completion),
                        ("/v1/chat/completions", parse_chat)):
        app.add_api_route(path, functools.partial(endpoint, ctx, parse), methods=["POST"])

    @app.exception_handler(HTTPException)  # FastAPI's 404 and 405
    async def unrouted(request, e):
        path, use = request.url.path, ", ".join(f"{m} {p}" for p, m in ROUTES.items())
        allow = {"Allow": ROUTES[path]} if path in ROUTES else None
        use = f"{ROUTES[path]} {path}" if allow else use
        return error_reply(RequestError(f"{request.method} {path} is not served: use {use}",
                                        status=e.status_code, headers=allow))
    return logged(app)


async def endpoint(ctx, parse, request: Request):
    """A POST's reply: its answer, or the JSON error."""
    try:
        return await answer(ctx, parse, request)
    except RequestError as e:
        return error_reply(e)
    except (ClientDisconnect, ConnectionAbortedError):  # gone: uvicorn writes nothing, the log
        return Response(status_code=499)  # says 499 (nginx's "client closed request")
    except Exception as e:  # a bug, or out of memory: say so and keep serving
        print(f"error: POST {request.url.path}: {first_line(e)}", file=sys.stderr, flush=True)
        return error_reply(RequestError(first_line(e), status=500))


async def answer(ctx, parse, request):
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
    p, ids, prompt = parse(body, ctx)
    # after the body, uvicorn's receive() returns once the client has left (or the reply is done)
    left = threading.Event()
    asyncio.ensure_future(request.receive()).add_done_callback(lambda _: left.set())
    loop, replies = asyncio.get_running_loop(), asyncio.Queue()
    say = functools.partial(log, request.scope["client"])
    put = functools.partial(loop.call_soon_threadsafe, replies.put_nowait)
    api = chat if parse is parse_chat else COMPLETIONS
    threading.Thread(target=generate, args=(ctx, api, p, ids, prompt, left.is_set, say, put),
                     daemon=True).start()
    first = await replies.get()
    if isinstance(first, Exception):
        raise first
    if not p["stream"]:
        return json_reply(200, first)
    return StreamingResponse(events(first, replies, request.url.path),
                             headers={"Content-Type": "text/event-stream",
                                      "Cache-Control": "no-cache"})


async def events(reply, replies, path):
    """Server-sent events, then `data: [DONE]`, which a stream cut short (the client left, the
    server is stopping, a bug) leaves out: too late for an error's status."""
    while reply is not None and not isinstance(reply, Exception):
        yield f"data: {json.dumps(reply)}\n\n"
        await asyncio.sleep(0)  # uvicorn sees a client leave between chunks, not after a burst
        reply = await replies.get()
    if reply is None:
        yield "data: [DONE]\n\n"
    elif not isinstance(reply, (RequestError, ConnectionAbortedError)):  # a bug: say so
        print(f"error: POST {path}: {first_line(reply)}", file=sys.stderr, flush=True)


def completion_choice(index, text, finish, logprobs):
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


# the replies of /v1/completions; chat.py has /v1/chat/completions' of the same names
COMPLETIONS = SimpleNamespace(OBJECT="text_completion", CHUNK="text_completion",
                              choice=completion_choice, logprobs=reply_logprobs,
                              delta=lambda index, text, finish, first: completion_choice(
                                  index, text, finish, None))


def generate(ctx, api, p, ids, prompt, gone, say, put):
    """Puts the replies of a request's n choices (the whole reply, or a stream's chunks, choice
    after choice) then None, or what ended them; on a thread of its own, so that a client that
    stops reading does not hold the model. The choices draw in turn from one generator at the seed
    (as sample.py's num_samples do)."""
    head = {"id": f"{'chatcmpl' if api is chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": api.CHUNK if p["stream"] else api.OBJECT, "created": int(time.time()),
            "model": ctx.name}

    def usage(n):  # of a stream's chunks, the last alone has it; n: the tokens of all choices
        return {"usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                          "total_tokens": len(ids) + n}}

    try:
        with ctx.queue.turn():
            generator, used, choices = seeded(ctx, p["seed"]), 0, []
            for i in range(p["n"]):
                scored = None if p["logprobs"] is None else []
                parts = complete(ctx, p, ids, gone, scored, generator)
                if p["echo"]:  # the prompt's text first, streamed or not
                    parts = itertools.chain([(prompt, None, 0)], parts)
                if p["stream"]:
                    for j, (text, finish, n) in enumerate(parts):
                        last = finish and i == p["n"] - 1
                        put(dict(head, choices=[api.delta(i, text, finish, j == 0)],
                                 **(usage(used + n) if last else {})))
                else:
                    parts = list(parts)
                    text, finish, n = "".join(t for t, _, _ in parts), parts[-1][1], parts[-1][2]
                    choices.append(api.choice(i, text, finish,
                                              api.logprobs(ctx, p, ids, prompt, scored)))
                used += n
            if not p["stream"]:
                put(dict(head, choices=choices, **usage(used)))
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
                          max_n=config.serve_max_n,
                          max_prompt=cfg.block_size - 1)
    limits = {"max_tokens": ctx.max_tokens, "prompt_tokens": ctx.max_prompt,
              "body_bytes": MAX_BODY_BYTES, "stop_strings": MAX_STOPS, "stop_chars": MAX_STOP_CHARS,
              "read_seconds": config.serve_read_timeout, "logprobs": MAX_LOGPROBS,
              "queue": config.serve_max_queue, "wait_seconds": config.serve_max_wait,
              "n": ctx.max_n}
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
