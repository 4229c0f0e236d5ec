"""sample.py --serve=True (serve.py): the HTTP API gives sample.py's text, streams it, echoes the prompt and scores
tokens with the model's own log-probabilities (answering lm-evaluation-harness's requests as the model would, and
OpenAI's own client), lists its model, refuses bad requests and parameters it does not implement with a JSON error
naming the field, survives a client that leaves mid-stream, and stops cleanly on SIGTERM; hostile clients (long
stop strings, trickled or malformed requests, clients that leave) cannot hold it up, and requests behind long ones
wait in a bounded line, for a bounded time, or get a 503 with a Retry-After. And sample.py's command line refuses
bad settings, prompts and damaged exports with one line."""
import contextlib
import http.client
import itertools
import json
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import sample
from podgpt.release import serve
from podgpt.core.checkpoint import MARKER, file_crc32, find_checkpoint
from podgpt.pod.checkpoints import load_model
from conftest import ROOT, Captured, popen, run, shared, train_tiny
from podgpt.core.tokenizer import load_tokenizer
from podgpt.core.util import run_main

# the server's serve_max_tokens in these tests (not the default: the flag must take); a greedy generation this
# long takes seconds on a CPU, long enough to see whether a client that leaves still holds the model
MAX_TOKENS = 4000
READ_TIMEOUT = 3  # the server's serve_read_timeout in these tests: a trickled request is cut off after this


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, stdlib_data):
    def build(out):
        with Captured() as captured:
            train_tiny(captured, out, stdlib_data, "--total_batch_tokens=256", "--micro_batch_size=4",
                       "--max_steps=3", "--eval_every=3", "--ckpt_every=3", "--learning_rate=1e-2", "--seed=7")
    out = shared(tmp_path_factory, "serve_run", build)
    return find_checkpoint(str(out), "best")


def start_server(ckpt, log, *flags, read_timeout=READ_TIMEOUT):
    """sample.py --serve=True on a port the OS picks, its stderr into `log`, with `flags` last (they override);
    a namespace with port and proc."""
    with open(log, "w") as f:
        proc = popen([sys.executable, "sample.py", f"--ckpt={ckpt}", "--serve=True", "--port=0", "--device=cpu",
                      f"--serve_max_tokens={MAX_TOKENS}", f"--serve_read_timeout={read_timeout}", *flags], cwd=ROOT,
                     text=True, stdout=subprocess.PIPE, stderr=f)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(f"serving {ckpt} on http://127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"no start line: {line!r}\n{log.read_text()}")
    return SimpleNamespace(port=int(line.strip().rsplit(":", 1)[1]), proc=proc, stderr=log)


def stop_server(server, within=30):
    """SIGTERM; the server must exit 0 within `within` seconds, without a traceback or an abort."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        assert server.proc.wait(timeout=within) == 0, server.stderr.read_text()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    log = server.stderr.read_text()
    assert "Traceback" not in log and "terminate called" not in log, log


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    server = start_server(ckpt, tmp_path_factory.mktemp("serve_log") / "stderr.txt")
    try:
        yield server
    finally:
        stop_server(server)


def call(server, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, r.headers, data


def complete(server, **body):
    status, headers, data = call(server, "POST", "/v1/completions", body)
    assert status == 200 and headers["Content-Type"] == "application/json", data
    return json.loads(data)


def stream(server, **body):
    """The chunks of a streamed completion; asserts the event-stream framing and the closing [DONE]."""
    status, headers, data = call(server, "POST", "/v1/completions", dict(body, stream=True))
    assert status == 200 and headers["Content-Type"] == "text/event-stream", data
    events = data.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def long_seed(server, n=64):
    """A seed whose sampled completion of "x" runs n tokens without the model ending it (BOS): a stream with it
    is still generating when its client leaves, so the server must notice the leaving, not an end of its own."""
    for seed in range(100):
        if complete(server, prompt="x", max_tokens=n, seed=seed)["choices"][0]["finish_reason"] == "length":
            return seed
    raise AssertionError(f"every seed below 100 made the model end its text within {n} tokens")


def raw_request(server, data):
    """Send `data` (a request's bytes, as they are) on a new connection and shut the sending side:
    (status, error body) of the reply."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def leave_with_reset(server, data):
    """Send `data` and leave at once: close() with a zero linger resets the connection, so the server's reply
    meets a client that is gone."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.sendall(data)
    s.close()


def wait_for_log(server, start, done, timeout=10):
    """The server's log from offset `start` on, once done(log) holds (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while not done(log := server.stderr.read_text()[start:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return log


def sample_py(ckpt, prompt, n, *args):
    """What `python sample.py` prints after the prompt."""
    out = run([sys.executable, "sample.py", f"--ckpt={ckpt}", f"--prompt={prompt}", f"--max_new_tokens={n}",
               "--device=cpu", *args]).stdout
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt):-1]


def test_health_and_info(server, ckpt):
    status, _, data = call(server, "GET", "/health")
    assert status == 200 and json.loads(data) == {"status": "ok"}
    status, _, data = call(server, "GET", "/info")
    info = json.loads(data)
    trainer = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)
    config = json.load(open(os.path.join(ckpt, "config.json")))
    assert status == 200 and info["checkpoint"] == ckpt and info["exported"] is False
    assert info["step"] == trainer["step"] == 3
    assert info["val_loss"] == trainer["val_loss"] and info["best_val_loss"] == trainer["best_val_loss"]
    assert info["model"] == config["model"] and info["block_size"] == 64 and info["tokenizer"] == "byte"
    weights = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
    assert info["parameters"] == sum(t.numel() for k, t in weights.items() if k != "lm_head.weight")  # tied head
    assert info["limits"] == {"max_tokens": MAX_TOKENS, "prompt_tokens": 63, "body_bytes": serve.MAX_BODY_BYTES,
                              "stop_strings": 4, "stop_chars": serve.MAX_STOP_CHARS, "read_seconds": READ_TIMEOUT,
                              "logprobs": 5, "queue": sample.serve_max_queue,
                              "wait_seconds": sample.serve_max_wait, "n": sample.serve_max_n}
    assert info["device"] == "cpu"  # the one setup's device, as text


def test_greedy_completion_is_sample_py_text(server, ckpt):
    prompt, n = "def main(", 24
    r = complete(server, prompt=prompt, max_tokens=n, temperature=0, model="anything")
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == ckpt
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
    assert choice["text"] == sample_py(ckpt, prompt, n, "--temperature=0")


def test_seeded_sampling_is_sample_py_text_and_streams_the_same(server, ckpt):
    """A 3-step model's greedy text is mostly spaces; sampling at a seed tells far more apart."""
    prompt, n, seed = "import os\n", 40, 3
    r = complete(server, prompt=prompt, max_tokens=n, temperature=1.0, seed=seed)
    text = r["choices"][0]["text"]
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == n  # no BOS drawn
    assert text == sample_py(ckpt, prompt, n, "--temperature=1.0", "--top_k=0", f"--seed={seed}")
    assert len(set(text)) > 5
    assert complete(server, prompt=prompt, max_tokens=n, temperature=1.0, seed=seed + 1)["choices"][0]["text"] != text

    chunks = stream(server, prompt=prompt, max_tokens=n, temperature=1.0, seed=seed)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert len(chunks) > n // 2  # token by token, not all at once
    assert all(c["choices"][0]["finish_reason"] is None and "usage" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == r["usage"] and len({c["id"] for c in chunks}) == 1

    # a stop string ends the text before it, streamed or not, whichever tokens it straddles
    stop = text[10:13]
    cut = text[:text.index(stop)]
    for body in (dict(stop=stop), dict(stop=["not in the text", stop])):
        r = complete(server, prompt=prompt, max_tokens=n, temperature=1.0, seed=seed, **body)
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (cut, "stop")
        chunks = stream(server, prompt=prompt, max_tokens=n, temperature=1.0, seed=seed, **body)
        assert "".join(c["choices"][0]["text"] for c in chunks) == cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# -----------------------------------------------------------------------------
# echo and logprobs, /v1/models, and requests as lm-evaluation-harness sends them


@pytest.fixture(scope="module")
def local(ckpt):
    """The server's checkpoint loaded in this process by the repo's own code: what its answers must match. On one
    thread, as the server runs: two threads on two cores shared with the server made each forward of this small
    model ~100x slower (0.2 s)."""
    model, _ = load_model(ckpt, "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield SimpleNamespace(model=model, tok=load_tokenizer(ckpt))
    finally:
        torch.set_num_threads(threads)


def model_logprobs(local, ids):
    """The model's log-softmax (float32) over BOS + ids, computed here: row j is the distribution of ids[j]."""
    with torch.no_grad():
        logits = local.model(torch.tensor([[local.tok.bos_id] + ids]))[0][0, :, :local.tok.vocab_size]
    return logits.float().log_softmax(dim=-1)


def byte_id(tok, text):
    """A byte tokenizer's token id from its text in logprobs: "" is BOS, "bytes:\\xNN" a byte that is no character
    alone, any other text the one character its byte is."""
    if text == "":
        return tok.bos_id
    data = bytes.fromhex(text[len("bytes:"):].replace("\\x", "")) if text.startswith("bytes:") else text.encode()
    assert len(data) == 1, text
    return data[0]


def test_echo_and_logprobs_are_the_models_own_distribution(server, local):
    """An echoed prompt and sampled tokens (temperature 0.5, top_k 5): each token's logprob and its 5 most likely
    tokens are the model's log-softmax computed here, untouched by temperature and top_k; a character in two byte
    tokens shows as two bytes: tokens at its offset; asking for logprobs changes nothing that is drawn."""
    prompt = "x = 'é'\n"
    ids = local.tok.encode(prompt)
    body = dict(prompt=prompt, max_tokens=24, temperature=0.5, top_k=5, seed=11)
    text = complete(server, **body)["choices"][0]["text"]
    r = complete(server, **body, echo=True, logprobs=5)
    choice, lp = r["choices"][0], r["choices"][0]["logprobs"]
    assert choice["text"] == prompt + text and set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(c["choices"][0]["text"] for c in stream(server, **body, echo=True)) == prompt + text
    tokens = [byte_id(local.tok, t) for t in lp["tokens"]]
    assert tokens[:len(ids)] == ids and len(tokens) == len(ids) + r["usage"]["completion_tokens"]
    assert lp["tokens"][5:7] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert lp["text_offset"][:len(ids)] == [0, 1, 2, 3, 4, 5, 5, 6, 7]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token, as OpenAI's
    want = model_logprobs(local, tokens)
    for j in range(1, len(tokens)):
        top = lp["top_logprobs"][j]
        assert lp["token_logprobs"][j] == pytest.approx(want[j, tokens[j]].item(), abs=1e-4), j
        assert sorted(top.values(), reverse=True) == pytest.approx(want[j].topk(5).values.tolist(), abs=1e-4), j
        assert all(v == pytest.approx(want[j, byte_id(local.tok, t)].item(), abs=1e-4) for t, v in top.items()), j
    for token, offset in zip(lp["tokens"], lp["text_offset"]):  # a one-character token is where its offset says
        if len(token) == 1:
            assert choice["text"][offset] == token
    # without echo: the generated tokens' entries alone, their offsets still counted from the prompt's start
    alone = complete(server, **body, logprobs=1)["choices"][0]["logprobs"]
    assert all(alone[k] == lp[k][len(ids):] for k in ("tokens", "token_logprobs", "text_offset"))
    assert [len(top) for top in alone["top_logprobs"]] == [1] * len(alone["tokens"])


def test_logprobs_past_the_context_are_of_the_window_the_model_read(local):
    """In process: 40 tokens after a 55-token prompt pass the 64-token context, where generate() restarts its KV
    cache from the last 32 tokens (model.py): each token's logprob is of the window the model read for it."""
    tok = local.tok
    ctx = SimpleNamespace(model=local.model, tok=tok, dev="cpu", stopping=threading.Event())
    ids, scored = tok.encode("x" * 55), []
    p = dict(max_tokens=40, temperature=1.0, top_k=None, top_p=1.0, seed=3, stop=[], logprobs=2)
    list(serve.complete(ctx, p, ids, lambda: False, scored))
    seq, start = [tok.bos_id] + ids + [token for token, _ in scored], 0
    for i, (token, (logprob, _)) in enumerate(scored):
        end = len(ids) + 1 + i  # the tokens before this one
        if end - start > 64:  # the window would pass the context: it restarts from the last 32 tokens
            start = end - 32
        with torch.no_grad():
            logits = local.model(torch.tensor([seq[start:end]]))[0][0, -1, :tok.vocab_size]
        assert logprob == pytest.approx(logits.float().log_softmax(dim=-1)[token].item(), abs=1e-4), i
    assert len(scored) == 40 and start > 0


def test_models_lists_the_one_model_served(server, ckpt):
    status, _, data = call(server, "GET", "/v1/models")
    assert status == 200 and json.loads(data) == {"object": "list", "data": [
        {"id": ckpt, "object": "model", "created": int(os.path.getmtime(ckpt)), "owned_by": "podgpt"}]}
    assert call(server, "POST", "/v1/models")[0] == 405
    # a request may name it, or anything else (lm-evaluation-harness names its tokenizer): the reply names it
    assert complete(server, prompt="x", max_tokens=1, model=ckpt)["model"] == ckpt


def test_openai_parameters_at_values_that_change_nothing_are_accepted(server):
    body = dict(prompt="def main(", max_tokens=8, temperature=1.0, seed=4)
    neutral = dict(n=1, best_of=1, presence_penalty=0, frequency_penalty=0.0, suffix="", logit_bias={},
                   stream_options=None, user="someone", model="any", echo=False, logprobs=None)
    assert set(serve.UNSUPPORTED) <= set(neutral)
    assert complete(server, **body, **neutral)["choices"][0]["text"] == complete(server, **body)["choices"][0]["text"]


def lm_eval_loglikelihood(server, tok, context, continuation, max_tokens, tokenized=True):
    """(log-likelihood of continuation after context, is_greedy, context ids, continuation ids), asked and read as
    lm-evaluation-harness's local-completions model does (0.4.x: TemplateLM.loglikelihood and _encode_pair in
    lm_eval/api/model.py; _create_payload and parse_logprobs in lm_eval/models/openai_completions.py): the prompt
    as token ids in a batch of one (tokenized_requests=False: as the text they decode to). It sends max_tokens=1
    and cuts the one generated token off the end; with max_tokens=0 (its versions before 0.4.3, and other
    OpenAI-style scorers) there is none to cut."""
    if context == "":  # an empty context is the prefix token: the export's tokenizer's bos_token
        context_enc, continuation_enc = [tok.bos_id], tok.encode(continuation)
    else:  # the context's trailing spaces go to the continuation; the whole is encoded, the context split off
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, context_enc = tok.encode(context + continuation), tok.encode(context)
        continuation_enc = whole[len(context_enc):]
    ids = context_enc + continuation_enc
    r = complete(server, model="export/tiny", prompt=[ids] if tokenized else tok.decode(ids), temperature=0,
                 max_tokens=max_tokens, logprobs=1, seed=1234, echo=True)
    choice = sorted(r["choices"], key=lambda c: c["index"])[0]
    end = -1 if max_tokens == 1 else None
    logprobs = choice["logprobs"]["token_logprobs"][len(context_enc):end]
    top = choice["logprobs"]["top_logprobs"][len(context_enc):end]
    return sum(logprobs), all(lp == max(t.values()) for lp, t in zip(logprobs, top)), context_enc, continuation_enc


def model_loglikelihood(local, context_enc, continuation_enc):
    """(log-likelihood, is_greedy) of the continuation from the model here, after BOS and the context (less the BOS
    that stands for an empty one): is_greedy by argmax."""
    context = context_enc[1:] if context_enc[:1] == [local.tok.bos_id] else context_enc
    want = model_logprobs(local, context + continuation_enc)[len(context):]
    return (sum(want[i, t].item() for i, t in enumerate(continuation_enc)),
            all(want[i].argmax().item() == t for i, t in enumerate(continuation_enc)))


def test_lm_eval_loglikelihood_requests_get_the_models_answer(server, local):
    """The model's greedy text here is spaces: the first pair is greedy, the others are not; an empty context and
    one whose trailing space moves to the continuation are lm-eval's two special cases."""
    pairs = [("def main(", "    "), ("import os\n", "import sys"), ("", "import"), ("x = 1 ", "+ 2")]
    greedy = set()
    for (context, continuation), max_tokens in itertools.product(pairs, (1, 0)):
        got = lm_eval_loglikelihood(server, local.tok, context, continuation, max_tokens)
        want = model_loglikelihood(local, *got[2:])
        assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1] == want[1], (context, continuation, max_tokens)
        if context:  # tokenized_requests=False: the same (an empty context's BOS has no text)
            assert lm_eval_loglikelihood(server, local.tok, context, continuation, max_tokens, False) == got
        greedy.add(got[1])
    assert greedy == {True, False}


def test_lm_eval_generate_until_requests_get_the_greedy_text(server, local):
    """generate_until as local-completions asks it: the context's token ids, max_gen_toks as max_tokens,
    temperature 0, the task's until and the tokenizer's EOS text ("<|bos|>": export.py's name for BOS) as stop,
    seed 1234; the answer is the reply's text, which must be the greedy text here, cut before the first stop."""
    ids = local.tok.encode("def main():\n")
    drawn = local.model.generate(torch.tensor([[local.tok.bos_id] + ids]), 8, temperature=0)
    greedy = local.tok.decode(list(itertools.takewhile(lambda t: t != local.tok.bos_id, (t.item() for t in drawn))))
    for until in (["\n\n"], ["\n\n", greedy[2:4]]):
        stop = until + ["<|bos|>"]
        r = complete(server, prompt=[ids], model="export/tiny", max_tokens=8, temperature=0, stop=stop, seed=1234)
        cut = min((greedy.find(s) for s in stop if s in greedy), default=len(greedy))
        assert sorted(r["choices"], key=lambda c: c["index"])[0]["text"] == greedy[:cut], (until, greedy)


def test_the_openai_client_gets_the_models_text(server, local, ckpt):
    """OpenAI's own Python client pointed at the server: its greedy completion is the model's greedy text here, and
    a seeded one, streamed or not, is the server's answer to the same request (sample.py's text, as above)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    ids = local.tok.encode("def main():\n")
    drawn = local.model.generate(torch.tensor([[local.tok.bos_id] + ids]), 12, temperature=0)
    greedy = local.tok.decode(list(itertools.takewhile(lambda t: t != local.tok.bos_id, (t.item() for t in drawn))))
    r = client.completions.create(model="podgpt", prompt="def main():\n", max_tokens=12, temperature=0)
    assert (r.model, r.choices[0].text, r.usage.prompt_tokens) == (ckpt, greedy, len(ids))
    seeded = dict(model="podgpt", prompt="import os\n", max_tokens=40, temperature=1.0, seed=3)
    text = complete(server, **seeded)["choices"][0]["text"]
    assert client.completions.create(**seeded).choices[0].text == text
    chunks = list(client.completions.create(**seeded, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == "length"


BAD = [  # (body, param the error names)
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x" * 64}, "prompt"),  # 64 tokens + BOS pass the 64-token context
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "n": sample.serve_max_n + 1}, "n"),  # past serve_max_n
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": ["ok", 3]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),  # OpenAI's limit
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logprobs": 1, "stream": True}, "logprobs"),  # a stream carries no logprobs
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "user": ["a"]}, "user"),
    ({"prompt": [[1], [2]]}, "prompt"),  # a batch: one prompt per request
    ({"prompt": []}, "prompt"),
    ({"prompt": [257]}, "prompt"),  # past the byte tokenizer's 257 ids (BOS is 256)
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": None}, "prompt"),
    # OpenAI's parameters this server does not implement, at a value that would change the answer, and keys it
    # does not know: never ignored
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "presence_penalty": False}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "suffix": "\n"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"50": 100}}, "logit_bias"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "min_p": 0.1}, "min_p"),  # a vLLM extension
    ({"prompt": "x", "max_new_tokens": 8}, "max_new_tokens"),  # a misspelt max_tokens
    ({"prompt": "x", "k" * 100: 1}, "k" * 40 + "..."),  # named, cut short
    ({"prompt": "x", "stop": ["a"] * (serve.MAX_STOPS + 1)}, "stop"),
    ({"prompt": "x", "stop": "a" * (serve.MAX_STOP_CHARS + 1)}, "stop"),
    ({"prompt": "x", "stop": "a" * 1_000_000}, "stop"),  # once held the model ~14 s per token
    (b"[" * 100_000, None),  # nested too deeply for the JSON parser (a RecursionError)
    (b'{"prompt": "\\udcff"}', "prompt"),  # a lone surrogate: no UTF-8 for it
]


def refused_naming(server, path, body, param):
    """body to path gets a 400 in OpenAI's error shape, one line naming param first."""
    status, headers, data = call(server, "POST", path, body)
    error = json.loads(data)["error"]
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), error
    assert headers["Content-Type"] == "application/json"
    message = error["message"]
    assert "\n" not in message and len(message) < 300, message  # one line, whatever the request held
    assert param is None or message.startswith(param), message


@pytest.mark.parametrize("body,param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_request_gets_400_naming_the_field(server, body, param):
    refused_naming(server, "/v1/completions", body, param)
    assert call(server, "GET", "/health")[0] == 200


def test_wrong_path_method_and_size(server):
    status, _, data = call(server, "GET", "/v1/embeddings")
    assert status == 404 and "/v1/completions" in json.loads(data)["error"]["message"]
    status, headers, data = call(server, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST" and "use POST" in json.loads(data)["error"]["message"]
    assert call(server, "POST", "/health")[0] == 405
    # a body over the limit is refused from its Content-Length, unread
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(serve.MAX_BODY_BYTES + 1))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and "limit" in json.loads(r.read())["error"]["message"]
    conn.close()
    assert complete(server, prompt="x", max_tokens=2)["usage"]["completion_tokens"] == 2


POST = b"POST /v1/completions HTTP/1.0\r\n"
FRAMING = [  # (headers and body after the request line, status, what the message says)
    (b"Content-Length: abc\r\n\r\n", 400, "Content-Length \"abc\" is not a size in bytes"),
    (b"Content-Length: -1\r\n\r\n", 400, "Content-Length \"-1\" is not a size in bytes"),
    (b"Content-Length: \xb2\r\n\r\n", 400, "is not a size in bytes"),  # "²": isdigit() but not int()
    (b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n", 413, "above this server's limit"),
    (b"\r\n", 411, "no Content-Length"),
    (b"Transfer-Encoding: chunked\r\n\r\n", 411, "a chunked body is not read"),
    (b"Content-Length: 10\r\n\r\n{}", 400, "the body ended after 2 of the 10 bytes"),
]


@pytest.mark.parametrize("request_,status,says", FRAMING, ids=[f"{i}-{s}" for i, (_, s, _) in enumerate(FRAMING)])
def test_bad_framing_gets_its_status_and_one_line(server, request_, status, says):
    """A body's length that is not a number, is missing or is chunked, or a body cut short: 400, 411 or 413
    with the JSON error (it was a 500 for a length int() refuses, and "not JSON" for a chunked body)."""
    got, error = raw_request(server, POST + request_)
    assert (got, error["type"]) == (status, "invalid_request_error") and says in error["message"], error
    assert "\n" not in error["message"] and len(error["message"]) < 300


def test_client_leaving_before_its_error_reply_costs_one_log_line(server):
    """A client gone before its 400 is written: one line in the log, not socketserver's traceback."""
    start = len(server.stderr.read_text())
    for _ in range(5):
        leave_with_reset(server, POST + b"Content-Length: 9\r\n\r\n{not json")
    wait_for_log(server, start, lambda log: log.count('" 400 -') == 5)
    time.sleep(0.2)  # what a reply that failed writes comes after its status line
    lines = server.stderr.read_text()[start:].splitlines()
    # per client: its status line, and at most one more, saying that it left
    assert sum('" 400 -' in line for line in lines) == 5 and len(lines) <= 10, lines
    assert all('" 400 -' in line or "the client left before the response ended" in line for line in lines), lines
    assert call(server, "GET", "/health")[0] == 200


def test_client_leaving_mid_stream_does_not_stop_the_server(server):
    seed = long_seed(server)
    start = len(server.stderr.read_text())
    for _ in range(2):  # the second must find the model free again
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True,
                                                            "seed": seed}))
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        r.close()  # leave without reading the rest
    assert call(server, "GET", "/health")[0] == 200
    r = complete(server, prompt="x", max_tokens=3, temperature=0)
    assert r["usage"]["completion_tokens"] == 3
    log = server.stderr.read_text()[start:]
    assert server.proc.poll() is None and "Traceback" not in log
    assert log.count("the client left before the response ended") == 2, log  # it noticed, and went on


def test_completion_ends_at_bos_and_never_splits_a_character(ckpt):
    """In process, with a stand-in model whose tokens are chosen: BOS (= EOS) ends the text with "stop",
    and a character whose bytes come in two tokens comes out whole."""
    tok = load_tokenizer(ckpt)
    tokens = list("é€".encode()) + [tok.bos_id, ord("z")]

    def generate(x, n, **kw):
        assert x[0].tolist() == [tok.bos_id] + tok.encode("hi")
        return (torch.tensor([t]) for t in tokens[:n])

    ctx = SimpleNamespace(model=SimpleNamespace(generate=generate), tok=tok, dev="cpu", stopping=threading.Event())
    p = dict(max_tokens=len(tokens), temperature=1.0, top_k=None, top_p=1.0, seed=0, stop=[])
    parts = list(serve.complete(ctx, p, tok.encode("hi"), lambda: False))
    assert [t for t, _, _ in parts if t] == ["é", "€"]
    assert parts[-1][1:] == ("stop", 6)  # 5 bytes and BOS
    parts = list(serve.complete(ctx, dict(p, max_tokens=4), tok.encode("hi"), lambda: False))
    assert "".join(t for t, _, _ in parts) == "é\ufffd" and parts[-1][1:] == ("length", 4)  # a cut character


@pytest.fixture(scope="module")
def export_dir(ckpt, tmp_path_factory):
    """The checkpoint as export.py writes it, made once per test session."""
    pytest.importorskip("safetensors")
    out = shared(tmp_path_factory, "serve_export", lambda out: run([sys.executable, "export.py", f"--ckpt={ckpt}",
                                                                       f"--out={out / 'hf'}"]))
    return out / "hf"


def test_serves_an_exported_folder(server, ckpt, export_dir, tmp_path):
    exported = start_server(str(export_dir), tmp_path / "stderr.txt")
    try:
        info = json.loads(call(exported, "GET", "/info")[2])
        trainer = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)
        assert info["exported"] is True and info["checkpoint"] == str(export_dir)
        assert (info["step"], info["val_loss"]) == (trainer["step"], trainer["val_loss"])  # from its podgpt.json
        body = dict(prompt="import os\n", max_tokens=20, temperature=1.0, seed=5)
        assert complete(exported, **body)["choices"][0]["text"] == complete(server, **body)["choices"][0]["text"]
    finally:
        stop_server(exported)


def test_sigterm_during_a_generation_exits_0_within_seconds(ckpt, tmp_path):
    """Also while a client trickles its request (its thread reads for up to serve_read_timeout, 60 s here) and
    another waits in line for the model (up to serve_max_wait): the exit must wait for neither."""
    server = start_server(ckpt, tmp_path / "stderr.txt", read_timeout=60)
    seed = long_seed(server)
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    slow.sendall(POST + b"Content-Length: 100\r\n\r\n{")  # and never the rest
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True,
                                                        "seed": seed}))
    r = conn.getresponse()
    assert r.readline().startswith(b"data: ")
    waiting = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    waiting.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 8}))
    stop_server(server, within=5)  # mid-stream: the generation stops at its next token
    try:
        rest = r.read()
    except http.client.IncompleteRead as e:  # an HTTP/1.1 stream is chunked: cut short, it ends mid-chunk
        rest = e.partial
    assert b"data: [DONE]" not in rest
    for c in (conn, waiting, slow):
        c.close()


# -----------------------------------------------------------------------------
# stop strings, in process with a stand-in model whose text is chosen


def stand_in(pieces):
    """A ctx whose model "generates" the text pieces in order, one token each (token i: pieces[i])."""
    tok = SimpleNamespace(bos_id=-1, decode_bytes=lambda ids: pieces[ids[0]].encode())
    model = SimpleNamespace(generate=lambda x, n, **kw: (torch.tensor([i]) for i in range(min(n, len(pieces)))))
    return SimpleNamespace(model=model, tok=tok, dev="cpu", stopping=threading.Event())


def run_complete(pieces, stops):
    p = dict(max_tokens=len(pieces), temperature=1.0, top_k=None, top_p=1.0, seed=0, stop=stops)
    return list(serve.complete(stand_in(pieces), p, [], lambda: False))


def test_stop_strings_end_the_text_as_a_search_of_the_whole_text_would(ckpt):
    """Random texts, stop strings and token boundaries: the text ends before the first stop string to appear
    in it (left out), and after each token exactly the text that could still begin a stop string is held back
    (so a stream never sends part of one, and sends the rest at once)."""
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10)))) if text else []
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])] if text else []
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 4))]
        parts = run_complete(pieces, stops)

        # the first place where a stop string is complete, and the longest one complete there
        end = next((e for e in range(1, len(text) + 1) if any(text[:e].endswith(s) for s in stops)), None)
        if end is None:
            want = (text, "length")
        else:
            want = (text[:end - max(len(s) for s in stops if text[:end].endswith(s))], "stop")
        assert ("".join(t for t, _, _ in parts), parts[-1][1]) == want, (pieces, stops)

        for n in range(1, parts[-1][2]):  # after each token but the last: all but the held-back text is out
            seen = "".join(pieces[:n])
            held = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
            assert "".join(t for t, _, k in parts if k <= n) == seen[:len(seen) - held], (pieces, stops, n)


def test_stop_matching_is_linear_in_the_text():
    """4 stop strings of the longest length, which the text keeps almost matching: matching them costs about
    what generating costs (the old search took seconds for this: quadratic in the stop strings' length)."""
    pieces, stops = ["a"] * 4000, ["a" * (serve.MAX_STOP_CHARS - 1) + c for c in "bcde"]
    costs = []
    for s in ([], stops):
        start = time.process_time()
        assert "".join(t for t, _, _ in run_complete(pieces, s)) == "a" * 4000
        costs.append(time.process_time() - start)
    assert costs[1] < 2 * costs[0] + 0.2, costs


# -----------------------------------------------------------------------------
# hostile clients against the shared server


def trickle(server, head, results, key):
    """Send head, then one byte every 50 ms until the server answers or closes: results[key] = (the status line
    or b"" for a close without one, seconds)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(head)
        try:
            while not select.select([s], [], [], 0.05)[0]:
                s.sendall(b" ")
            reply = s.recv(100).split(b"\r\n")[0]
        except ConnectionError:
            reply = b""
    results[key] = reply, time.monotonic() - start


def test_hostile_clients_do_not_hold_up_a_normal_one(server):
    """While clients send huge or many stop strings, trickle their requests, nest JSON deeply, send lengths
    that are not lengths or chunked bodies, and leave in the middle of long generations, a normal client's
    requests each take at most 2 s more than alone; the tricklers are cut off at serve_read_timeout."""
    normal = dict(prompt="def main(", max_tokens=32, temperature=0)

    def timed():
        start = time.monotonic()
        complete(server, **normal)
        return time.monotonic() - start

    alone = max(timed() for _ in range(2))
    start = len(server.stderr.read_text())
    done, results, refused, allowed = threading.Event(), {}, [], []

    def leave_mid_generation():  # non-streaming, greedy (no BOS): seconds of work if nobody stopped it
        while not done.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(dict(prompt="x", max_tokens=MAX_TOKENS, temperature=0)))
            time.sleep(0.3)
            conn.close()

    huge = json.dumps({"prompt": "x", "stop": "a" * 1_000_000})
    at_limits = {"prompt": "x", "max_tokens": 200, "temperature": 0,
                 "stop": ["a" * (serve.MAX_STOP_CHARS - 1) + c for c in "bcde"]}

    def refused_at_once():
        while not done.is_set():
            for body in (huge, {"prompt": "x", "stop": ["a"] * 100}, b"[" * 100_000):
                refused.append(call(server, "POST", "/v1/completions", body)[0])
            refused.extend(raw_request(server, POST + request_)[0] for request_, _, _ in FRAMING)
            allowed.append(call(server, "POST", "/v1/completions", at_limits)[0])
            time.sleep(0.2)

    attackers = [threading.Thread(target=trickle, args=(server, POST + b"Content-Length: 1000\r\n\r\n", results,
                                                        "body")),
                 threading.Thread(target=trickle, args=(server, POST + b"X-Slow: ", results, "headers")),
                 threading.Thread(target=leave_mid_generation), threading.Thread(target=refused_at_once)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.5)  # the attack under way
        for _ in range(5):
            took = timed()
            assert took < alone + 2, (took, alone)
            time.sleep(0.2)
    finally:
        done.set()
        for t in attackers:
            t.join(timeout=60)
    assert set(refused) == {400, 411, 413} and set(allowed) == {200}, (refused, allowed)
    assert results["body"][0] == b"HTTP/1.0 408 Request Timeout", results
    assert results["headers"][0] == b"", results  # a request line or header cut short is dropped unanswered
    assert all(READ_TIMEOUT - 0.5 < seconds < READ_TIMEOUT + 2 for _, seconds in results.values()), results

    log = wait_for_log(server, start, lambda log: "generation stopped after" in log)
    stopped = [int(line.split("generation stopped after ")[1].split()[0]) for line in log.splitlines()
               if "generation stopped after" in line]
    assert stopped and all(n < MAX_TOKENS / 2 for n in stopped), log  # it stopped when the client left
    assert "Traceback" not in log and server.proc.poll() is None, log


# -----------------------------------------------------------------------------
# the line of requests waiting for the model, and its bounds

WAIT = 1.0  # the queued server's serve_max_wait
LONG = 1_000_000  # a generation that holds the model until its client leaves (~0.8 ms a token on a 2-core CPU)


def queued_server(ckpt, tmp_path_factory):
    """A server where one request may wait for the model (serve_max_queue=1), for at most WAIT seconds; stopped
    when the fixture that yields from this ends."""
    server = start_server(ckpt, tmp_path_factory.mktemp("queued_log") / "stderr.txt", "--serve_max_queue=1",
                          f"--serve_max_wait={WAIT}", f"--serve_max_tokens={LONG}")
    try:
        yield server
    finally:
        stop_server(server, within=5)


@pytest.fixture(scope="module")
def queued(ckpt, tmp_path_factory):
    yield from queued_server(ckpt, tmp_path_factory)


@contextlib.contextmanager
def generating(server):
    """A long greedy stream that holds the model (its first chunk has come) until the with block ends, where its
    client leaves and the generation stops at its next token."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": LONG, "temperature": 0,
                                                         "stream": True}))
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    try:
        yield
    finally:
        r.close()
        conn.close()


def timed_call(server, body, results):
    """POST body to /v1/completions: results gets (status, headers, JSON reply, seconds)."""
    start = time.monotonic()
    status, headers, data = call(server, "POST", "/v1/completions", body)
    results.append((status, headers, json.loads(data), time.monotonic() - start))


SHORT = dict(prompt="def main(", max_tokens=8, temperature=0)  # the normal request


def test_requests_behind_a_long_one_get_503_with_retry_after_within_the_bounds(queued):
    """A normal 8-token request behind long greedy ones waited for all of them (issue 29: 14.6 s behind 20).
    Five long requests and a short one sent while a long one generates: one waits WAIT seconds, the others are
    refused at once (one place in line), each with 503, a Retry-After and the JSON error; /health, /info and
    /v1/models answer meanwhile; once the long one's client leaves, the server answers again."""
    results = []
    with generating(queued):
        senders = [threading.Thread(target=timed_call, args=(queued, body, results))
                   for body in [dict(SHORT, max_tokens=LONG)] * 5 + [SHORT]]
        for t in senders:
            t.start()
        for path in ("/health", "/info", "/v1/models"):  # never in line
            start = time.monotonic()
            assert call(queued, "GET", path)[0] == 200 and time.monotonic() - start < WAIT / 2, path
        for t in senders:
            t.join(timeout=60)
    assert len(results) == 6
    waited = []
    for status, headers, reply, seconds in results:
        message, retry = reply["error"]["message"], headers["Retry-After"]
        assert (status, headers["Content-Type"], reply["error"]["type"]) == (503, "application/json", "server_error")
        assert set(reply["error"]) == {"message", "type", "param"} and "\n" not in message, reply
        assert retry.isdigit() and int(retry) >= 1 and message.endswith(f"send it again in {retry} s"), message
        if "serve_max_wait" in message:
            waited.append(seconds)
        else:
            assert "serve_max_queue" in message and seconds < WAIT, (message, seconds)
    assert waited and all(WAIT <= s < WAIT + 2 for s in waited), results  # usually one, two if one came late
    timed_call(queued, SHORT, results)  # the long one's client left: the line drains
    assert results[-1][0] == 200 and results[-1][2]["usage"]["completion_tokens"] == 8, results[-1]


def test_a_request_in_line_gets_the_model_when_it_frees(queued):
    """A request waiting for the model is answered once the generation ahead of it ends, within serve_max_wait."""
    results = []
    with generating(queued):
        waiting = threading.Thread(target=timed_call, args=(queued, SHORT, results))
        waiting.start()
        time.sleep(WAIT / 4)  # in line by now
    waiting.join(timeout=60)
    status, _, reply, seconds = results[0]
    assert status == 200 and reply["usage"]["completion_tokens"] == 8 and seconds < WAIT, results


def test_model_queue_is_first_come_first_served_and_retry_after_is_measured():
    """In process: two requests that held the model 0.3 s and 0.5 s make 0.4 s a request; with one generating and
    two waiting (max_waiting=2), another is refused at once, Retry-After ceil(3 x 0.4) = 2 s; those waiting get the
    model in the order they came."""
    q = serve.ModelQueue(max_waiting=2, max_wait=30)
    for seconds in (0.3, 0.5):
        with q.turn():
            time.sleep(seconds)
    order, release = [], threading.Event()

    def request(name):
        with q.turn():
            order.append(name)
            release.wait(timeout=30)

    requests = [threading.Thread(target=request, args=(name,)) for name in ("first", "second", "third")]
    for waiting, t in enumerate(requests):
        t.start()
        deadline = time.monotonic() + 10
        while (order != ["first"] or len(q.line) < waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert order == ["first"] and len(q.line) == 2
    with pytest.raises(serve.RequestError) as e:
        with q.turn():
            pass
    assert (e.value.status, e.value.headers) == (503, {"Retry-After": "2"}) and "serve_max_queue" in str(e.value)
    release.set()
    for t in requests:
        t.join(timeout=30)
    assert order == ["first", "second", "third"]


# -----------------------------------------------------------------------------
# sample.py's command line


def char_checkpoint(ckpt, dest):
    """A copy of ckpt with a char tokenizer that knows "abc" in place of its own (the prompt is refused before
    the model, whose vocabulary no longer matches, generates anything); complete.json vouches for the new file."""
    shutil.copytree(ckpt, dest)
    path = os.path.join(dest, "tokenizer.json")
    with open(path, "w") as f:
        json.dump({"spec": "char", "kind": "char", "vocab_size": 4, "bos_id": 3, "chars": ["a", "b", "c"]}, f)
    with open(os.path.join(dest, MARKER)) as f:
        marker = json.load(f)
    marker["files"]["tokenizer.json"] = dict(bytes=os.path.getsize(path), crc32=file_crc32(path))
    with open(os.path.join(dest, MARKER), "w") as f:
        json.dump(marker, f)
    return str(dest)


CLI_BAD = [  # (arguments, char tokenizer, what the one line says)
    (["--top_k=-1"], False, ["top_k=-1 is out of range: use an integer >= 0"]),
    (["--top_p=0"], False, ["top_p=0.0 is out of range: use a number above 0 and at most 1"]),
    (["--top_p=1.5"], False, ["top_p=1.5 is out of range"]),
    (["--prompt=ab\udcffc"], False, ["the prompt holds bytes that are not UTF-8 (at character 2)", "--prompt_file"]),
    (["--prompt=abxc"], True, ["character 'x' (at position 2) is not in the vocabulary of this char tokenizer",
                               "leave it out"]),
]


@pytest.mark.parametrize("args,char,says", CLI_BAD, ids=[a[0] for a, _, _ in CLI_BAD])
def test_command_line_refuses_in_one_line(ckpt, tmp_path, capfd, args, char, says):
    """Out-of-range sampling settings, a prompt of bytes that are not UTF-8 (argv hands them over as lone
    surrogates) and a prompt character outside a char tokenizer: exit 2, one error line, no traceback."""
    path = char_checkpoint(ckpt, tmp_path / "char") if char else ckpt
    with pytest.raises(SystemExit) as e:
        run_main(sample.main, [f"--ckpt={path}", "--device=cpu", "--max_new_tokens=2", *args])
    err = capfd.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(s in err for s in says), err


def cut_in_half(path):
    os.truncate(path, os.path.getsize(path) // 2)


def add_unknown_field(path):
    with open(path) as f:
        saved = json.load(f)
    saved["model"]["no_such_field"] = 1
    with open(path, "w") as f:
        json.dump(saved, f)


EXPORT_BAD = [  # (file, what is done to it, what the one line says)
    ("model.safetensors", cut_in_half, "model.safetensors cannot be read (SafetensorError: "),  # a copy cut short
    ("podgpt.json", add_unknown_field, "unexpected keyword argument 'no_such_field'"),  # from a newer podgpt
]


@pytest.mark.parametrize("name,damage,says", EXPORT_BAD, ids=[name for name, _, _ in EXPORT_BAD])
def test_a_damaged_export_is_refused_in_one_line(export_dir, tmp_path, capfd, name, damage, says):
    """An export whose weights were cut short (a traceback from safetensors before) or whose podgpt.json holds a
    field this model.py does not know: exit 1, one line naming the problem and the fix (export it again)."""
    dest = tmp_path / "hf"
    shutil.copytree(export_dir, dest)
    damage(dest / name)
    with pytest.raises(SystemExit) as e:
        run_main(sample.main, [f"--ckpt={dest}", "--device=cpu", "--max_new_tokens=2"])
    err = capfd.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: export {dest}") and err.count("\n") == 1, err
    assert says in err and f"python export.py --ckpt=CHECKPOINT --out={dest})" in err, err


def test_server_refuses_a_prompt_outside_a_char_tokenizer(ckpt, tmp_path):
    ctx = SimpleNamespace(tok=load_tokenizer(char_checkpoint(ckpt, tmp_path / "char")), max_tokens=16, max_prompt=63)
    with pytest.raises(serve.RequestError) as e:
        serve.parse_completion(json.dumps({"prompt": "abxc"}).encode(), ctx)
    assert (e.value.status, e.value.param) == (400, "prompt") and "'x'" in str(e.value), e.value
