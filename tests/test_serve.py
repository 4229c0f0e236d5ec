"""sample.py --serve=True: the HTTP API gives sample.py's text, streams it, refuses bad requests with a JSON
error naming the field, survives a client that leaves mid-stream, and stops cleanly on SIGTERM; hostile
clients (long stop strings, trickled or malformed requests, clients that leave) cannot hold it up. And
sample.py's command line refuses bad settings and prompts with one line."""
import http.client
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
from checkpoint import MARKER, file_crc32, find_checkpoint
from conftest import ROOT, TINY_MODEL, run, shared
from prepare import load_tokenizer
from util import run_main

# the server's serve_max_tokens in these tests (not the default: the flag must take); a greedy generation this
# long takes seconds on a CPU, long enough to see whether a client that leaves still holds the model
MAX_TOKENS = 4000
READ_TIMEOUT = 3  # the server's serve_read_timeout in these tests: a trickled request is cut off after this


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, stdlib_data):
    def build(out):
        run([sys.executable, "train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_MODEL,
             "--total_batch_tokens=256", "--micro_batch_size=4", "--max_steps=3", "--eval_every=3", "--ckpt_every=3",
             "--learning_rate=1e-2", "--seed=7"])
    out = shared(tmp_path_factory, "serve_run", build)
    return find_checkpoint(str(out), "best")


def start_server(ckpt, log, read_timeout=READ_TIMEOUT):
    """sample.py --serve=True on a port the OS picks, its stderr into `log`; a namespace with port and proc."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "sample.py", f"--ckpt={ckpt}", "--serve=True", "--port=0",
                                 "--device=cpu", f"--serve_max_tokens={MAX_TOKENS}",
                                 f"--serve_read_timeout={read_timeout}"], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=f, env=dict(os.environ, OMP_NUM_THREADS="1"))
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
    assert info["limits"] == {"max_tokens": MAX_TOKENS, "prompt_tokens": 63, "body_bytes": sample.MAX_BODY_BYTES,
                              "stop_strings": 4, "stop_chars": sample.MAX_STOP_CHARS, "read_seconds": READ_TIMEOUT}
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
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": ["ok", 3]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": ["a"] * (sample.MAX_STOPS + 1)}, "stop"),
    ({"prompt": "x", "stop": "a" * (sample.MAX_STOP_CHARS + 1)}, "stop"),
    ({"prompt": "x", "stop": "a" * 1_000_000}, "stop"),  # once held the model ~14 s per token
    (b"[" * 100_000, None),  # nested too deeply for the JSON parser (a RecursionError)
    (b'{"prompt": "\\udcff"}', "prompt"),  # a lone surrogate: no UTF-8 for it
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_request_gets_400_naming_the_field(server, body, param):
    status, headers, data = call(server, "POST", "/v1/completions", body)
    error = json.loads(data)["error"]
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), error
    assert headers["Content-Type"] == "application/json"
    message = error["message"]
    assert "\n" not in message and len(message) < 300, message  # one line, whatever the request held
    assert param is None or message.startswith(param), message
    assert call(server, "GET", "/health")[0] == 200


def test_wrong_path_method_and_size(server):
    status, _, data = call(server, "GET", "/v1/chat/completions")
    assert status == 404 and "/v1/completions" in json.loads(data)["error"]["message"]
    status, headers, data = call(server, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST" and "use POST" in json.loads(data)["error"]["message"]
    assert call(server, "POST", "/health")[0] == 405
    # a body over the limit is refused from its Content-Length, unread
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(sample.MAX_BODY_BYTES + 1))
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
    start = len(server.stderr.read_text())
    for _ in range(2):  # the second must find the model free again
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True}))
        r = conn.getresponse()
        assert r.status == 200 and r.fp.readline().startswith(b"data: ")
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
    parts = list(sample.complete(ctx, p, tok.encode("hi"), lambda: False))
    assert [t for t, _, _ in parts if t] == ["é", "€"]
    assert parts[-1][1:] == ("stop", 6)  # 5 bytes and BOS
    parts = list(sample.complete(ctx, dict(p, max_tokens=4), tok.encode("hi"), lambda: False))
    assert "".join(t for t, _, _ in parts) == "é\ufffd" and parts[-1][1:] == ("length", 4)  # a cut character


def test_serves_an_exported_folder(server, ckpt, tmp_path):
    pytest.importorskip("safetensors")
    dest = tmp_path / "hf"
    run([sys.executable, "export.py", f"--ckpt={ckpt}", f"--out={dest}"])
    exported = start_server(str(dest), tmp_path / "stderr.txt")
    try:
        info = json.loads(call(exported, "GET", "/info")[2])
        trainer = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)
        assert info["exported"] is True and info["checkpoint"] == str(dest)
        assert (info["step"], info["val_loss"]) == (trainer["step"], trainer["val_loss"])  # from its podgpt.json
        body = dict(prompt="import os\n", max_tokens=20, temperature=1.0, seed=5)
        assert complete(exported, **body)["choices"][0]["text"] == complete(server, **body)["choices"][0]["text"]
    finally:
        stop_server(exported)


def test_sigterm_during_a_generation_exits_0_within_seconds(ckpt, tmp_path):
    """Also while a client trickles its request: its thread reads for up to serve_read_timeout (60 s here),
    and the exit must not wait for it."""
    server = start_server(ckpt, tmp_path / "stderr.txt", read_timeout=60)
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    slow.sendall(POST + b"Content-Length: 100\r\n\r\n{")  # and never the rest
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True}))
    r = conn.getresponse()
    assert r.fp.readline().startswith(b"data: ")
    stop_server(server, within=5)  # mid-stream: the generation stops at its next token
    assert b"data: [DONE]" not in r.read()
    conn.close()
    slow.close()


# -----------------------------------------------------------------------------
# stop strings, in process with a stand-in model whose text is chosen


def stand_in(pieces):
    """A ctx whose model "generates" the text pieces in order, one token each (token i: pieces[i])."""
    tok = SimpleNamespace(bos_id=-1, decode_bytes=lambda ids: pieces[ids[0]].encode())
    model = SimpleNamespace(generate=lambda x, n, **kw: (torch.tensor([i]) for i in range(min(n, len(pieces)))))
    return SimpleNamespace(model=model, tok=tok, dev="cpu", stopping=threading.Event())


def run_complete(pieces, stops):
    p = dict(max_tokens=len(pieces), temperature=1.0, top_k=None, top_p=1.0, seed=0, stop=stops)
    return list(sample.complete(stand_in(pieces), p, [], lambda: False))


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
    pieces, stops = ["a"] * 4000, ["a" * (sample.MAX_STOP_CHARS - 1) + c for c in "bcde"]
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
                 "stop": ["a" * (sample.MAX_STOP_CHARS - 1) + c for c in "bcde"]}

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
    assert results["headers"][0] == b"", results  # http.server drops a request line or header cut short
    assert all(READ_TIMEOUT - 0.5 < seconds < READ_TIMEOUT + 2 for _, seconds in results.values()), results

    log = wait_for_log(server, start, lambda log: "generation stopped after" in log)
    stopped = [int(line.split("generation stopped after ")[1].split()[0]) for line in log.splitlines()
               if "generation stopped after" in line]
    assert stopped and all(n < MAX_TOKENS / 2 for n in stopped), log  # it stopped when the client left
    assert "Traceback" not in log and server.proc.poll() is None, log


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


def test_server_refuses_a_prompt_outside_a_char_tokenizer(ckpt, tmp_path):
    ctx = SimpleNamespace(tok=load_tokenizer(char_checkpoint(ckpt, tmp_path / "char")), max_tokens=16, max_prompt=63)
    with pytest.raises(sample.RequestError) as e:
        sample.parse_completion(json.dumps({"prompt": "abxc"}).encode(), ctx)
    assert (e.value.status, e.value.param) == (400, "prompt") and "'x'" in str(e.value), e.value
