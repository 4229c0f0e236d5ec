"""sample.py --serve=True: the HTTP API gives sample.py's text, streams it, refuses bad requests with a JSON
error naming the field, survives a client that leaves mid-stream, and stops cleanly on SIGTERM."""
import http.client
import json
import os
import select
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

import sample
from checkpoint import find_checkpoint
from conftest import ROOT, TINY_MODEL, run, shared
from prepare import load_tokenizer

MAX_TOKENS = 1000  # the server's serve_max_tokens in these tests (not the default: the flag must take)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, stdlib_data):
    def build(out):
        run([sys.executable, "train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_MODEL,
             "--total_batch_tokens=256", "--micro_batch_size=4", "--max_steps=3", "--eval_every=3", "--ckpt_every=3",
             "--learning_rate=1e-2", "--seed=7"])
    out = shared(tmp_path_factory, "serve_run", build)
    return find_checkpoint(str(out), "best")


def start_server(ckpt, log):
    """sample.py --serve=True on a port the OS picks, its stderr into `log`; a namespace with port and proc."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "sample.py", f"--ckpt={ckpt}", "--serve=True", "--port=0",
                                 "--device=cpu", f"--serve_max_tokens={MAX_TOKENS}"], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=f, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(f"serving {ckpt} on http://127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"no start line: {line!r}\n{log.read_text()}")
    return SimpleNamespace(port=int(line.strip().rsplit(":", 1)[1]), proc=proc, stderr=log)


def stop_server(server):
    """SIGTERM; the server must exit 0 without a traceback or an abort."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        assert server.proc.wait(timeout=30) == 0, server.stderr.read_text()
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
    assert info["limits"]["max_tokens"] == MAX_TOKENS and info["limits"]["prompt_tokens"] == 63
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
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_request_gets_400_naming_the_field(server, body, param):
    status, headers, data = call(server, "POST", "/v1/completions", body)
    error = json.loads(data)["error"]
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), error
    assert headers["Content-Type"] == "application/json"
    message = error["message"]
    assert "\n" not in message and (param is None or message.startswith(param)), message
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


def test_client_leaving_mid_stream_does_not_stop_the_server(server):
    for _ in range(2):  # the second must find the model free again
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True}))
        r = conn.getresponse()
        assert r.status == 200 and r.fp.readline().startswith(b"data: ")
        r.close()  # leave without reading the rest
    assert call(server, "GET", "/health")[0] == 200
    r = complete(server, prompt="x", max_tokens=3, temperature=0)
    assert r["usage"]["completion_tokens"] == 3
    log = server.stderr.read_text()
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
    parts = list(sample.complete(ctx, p, tok.encode("hi")))
    assert [t for t, _, _ in parts if t] == ["é", "€"]
    assert parts[-1][1:] == ("stop", 6)  # 5 bytes and BOS
    parts = list(sample.complete(ctx, dict(p, max_tokens=4), tok.encode("hi")))
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


def test_sigterm_during_a_generation_exits_0(ckpt, tmp_path):
    server = start_server(ckpt, tmp_path / "stderr.txt")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True}))
    r = conn.getresponse()
    assert r.fp.readline().startswith(b"data: ")
    stop_server(server)  # mid-stream: the generation stops at its next token
    assert b"data: [DONE]" not in r.read()
    conn.close()
