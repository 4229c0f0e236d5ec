"""sample.py --serve=True's chat API (POST /v1/chat/completions) on an SFT checkpoint of the tiny model, through
OpenAI's own client: the reply is the model's own generation on the chat template's ids (tokenizer.chat_prompt's
for one user message) up to <|end|>, streamed or not, with n choices that a seed repeats, usage and the model's
log-probabilities; a base model's chat request gets one 400; /v1/completions on a chat model stops at <|end|>
unless asked not to; and the hostile clients of test_serve.py get the same answers on both endpoints."""
import json
import re
import threading
import time
from types import SimpleNamespace

import jinja2
import pytest
import torch

import sample
from conftest import Captured, shared, train_tiny
from podgpt.core.checkpoint import find_checkpoint
from podgpt.core.tokenizer import chat_ids, chat_prompt, load_tokenizer
from podgpt.pod.checkpoints import load_model
from podgpt.release import chat, hf, serve
from test_bad_input import finished_run  # noqa: F401 -- a fixture: the base model (1 step, stdlib)
from test_serve import (FRAMING, LONG, READ_TIMEOUT, WAIT, call, ckpt, queued_server, raw_request,  # noqa: F401
                        refused_naming, server, trickle)
from test_sft import SFT_ARGS, sft_data  # noqa: F401 -- a fixture: SFT data in the base model's byte tokenizer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def sft_ckpt(tmp_path_factory, finished_run, sft_data):  # noqa: F811
    """A 1-step SFT run from the base run: a model whose tokenizer has the chat tokens."""
    def build(out):
        with Captured() as captured:
            train_tiny(captured, out, sft_data, *SFT_ARGS, f"--init_from={finished_run}", "--max_steps=1")
    return find_checkpoint(str(shared(tmp_path_factory, "serve_chat_sft", build)), "latest")


@pytest.fixture(scope="module")
def chatty(sft_ckpt, tmp_path_factory):
    """The SFT checkpoint served, with a line of one request that waits at most WAIT seconds."""
    yield from queued_server(sft_ckpt, tmp_path_factory)


@pytest.fixture(scope="module")
def model(sft_ckpt):
    """The SFT checkpoint loaded here by the repo's own code, on one thread as the server runs (test_serve's local)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield SimpleNamespace(model=load_model(sft_ckpt, "cpu")[0], tok=load_tokenizer(sft_ckpt))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(chatty):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{chatty.port}/v1", api_key="x", max_retries=0)


def draws(model, ids, n, seed=None, choices=1, temperature=1.0):
    """`choices` generations of n tokens after ids (BOS first) by model.generate, one after the other from one
    generator at seed (None: greedy), each cut after the first token that ends a reply (BOS or <|end|>)."""
    generator = torch.Generator().manual_seed(seed or 0)
    ends, out = {model.tok.bos_id, chat_ids(model.tok)["<|end|>"]}, []
    for _ in range(choices):
        drawn = [t.item() for t in model.model.generate(torch.tensor([ids]), n, generator=generator,
                                                        temperature=0 if seed is None else temperature)]
        cut = next((i + 1 for i, t in enumerate(drawn) if t in ends), n)
        out.append(drawn[:cut])
    return out


def reply(model, tokens):
    """(content, finish_reason) of drawn tokens: the one that ended them is no part of the text."""
    if tokens and tokens[-1] in {model.tok.bos_id, chat_ids(model.tok)["<|end|>"]}:
        return model.tok.decode(tokens[:-1]), "stop"
    return model.tok.decode(tokens), "length"


def post(server, path, body):
    status, _, data = call(server, "POST", path, body)
    assert status == 200, data
    return json.loads(data)


def test_template_ids_are_the_exports_chat_template(model):
    """In process: the prompt ids of messages are what hf.CHAT_TEMPLATE renders (its markers as the chat tokens,
    the rest encoded): one user message is tokenizer.chat_prompt's; a system message is what it cannot express."""
    tok = model.tok

    def rendered(messages):
        def raise_exception(message):
            raise jinja2.TemplateError(message)
        text = jinja2.Template(hf.CHAT_TEMPLATE).render(messages=messages, bos_token="", add_generation_prompt=True,
                                                        raise_exception=raise_exception)
        parts = re.split("(" + "|".join(map(re.escape, tok.chat)) + ")", text)
        return [tok.bos_id] + [i for part in parts for i in ([tok.chat[part]] if part in tok.chat else
                                                             tok.encode(part))]
    one = [{"role": "user", "content": "What is 2 + 2?"}]
    turns = one + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 + 3?"}]
    assert chat.prompt_ids(tok, one) == chat_prompt(tok, "What is 2 + 2?") == rendered(one)
    assert chat.prompt_ids(tok, turns) == rendered(turns)
    with pytest.raises(jinja2.TemplateError):
        rendered([{"role": "system", "content": "Be brief."}] + one)
    with pytest.raises(serve.RequestError) as e:
        chat.prompt_ids(tok, [{"role": "system", "content": "Be brief."}] + one)
    assert e.value.param == "messages[0].role" and "podgpt trained no other role" in str(e.value)


def test_greedy_reply_is_the_models_generation_streamed_or_not(client, model, sft_ckpt):
    """OpenAI's client, temperature 0: the reply is greedy generation on chat_prompt's ids through the model here
    (one turn and three), to <|end|> or max_tokens; usage counts the template's ids and the tokens drawn."""
    for messages in ([{"role": "user", "content": "What is 7 + 5?"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "12"},
                      {"role": "user", "content": "ok"}]):
        ids = chat.prompt_ids(model.tok, messages)
        want = draws(model, ids, 20)[0]
        r = client.chat.completions.create(model="podgpt", messages=messages, max_tokens=20, temperature=0)
        c = r.choices[0]
        assert (r.object, r.model, c.index, c.message.role) == ("chat.completion", sft_ckpt, 0, "assistant")
        assert (c.message.content, c.finish_reason) == reply(model, want) and len(r.choices) == 1
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            len(ids), len(want), len(ids) + len(want))
        chunks = list(client.chat.completions.create(model="podgpt", messages=messages, max_tokens=20, temperature=0,
                                                     stream=True))
        assert all(ch.object == "chat.completion.chunk" for ch in chunks) and chunks[0].choices[0].delta.role == \
            "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
        assert chunks[-1].choices[0].finish_reason == c.finish_reason and chunks[-1].usage == r.usage
    assert ids == [model.tok.bos_id, *chat_prompt(model.tok, "hi")[1:-1], model.tok.chat["<|assistant|>"],
                   *b"12", model.tok.chat["<|end|>"], *chat_prompt(model.tok, "ok")[1:]]


def test_n_choices_are_samples_in_turn_and_a_seed_repeats_them(client, chatty, model):
    """n=3 at a seed: three choices, index 0 to 2, each the model's next draw from one generator at the seed (as
    sample.py's num_samples), the same three on a second call and streamed; /v1/completions likewise."""
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = chat.prompt_ids(model.tok, messages)
    want = [reply(model, tokens) for tokens in draws(model, ids, 16, seed=5, choices=3)]
    assert len(set(want)) == 3
    body = dict(model="podgpt", messages=messages, max_tokens=16, temperature=1.0, seed=5, n=3)
    for _ in range(2):
        r = client.chat.completions.create(**body)
        assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [(i, *w) for i, w in
                                                                                      enumerate(want)]
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i)
            for i in range(3)] == [text for text, _ in want]
    assert [ch.usage for ch in chunks if ch.usage] == [r.usage] and r.usage.completion_tokens == sum(
        len(tokens) for tokens in draws(model, ids, 16, seed=5, choices=3))
    text = [model.tok.decode(t) for t in draws(model, [model.tok.bos_id, *b"def f("], 12, seed=9, choices=3)]
    for _ in range(2):
        r = post(chatty, COMPLETIONS, dict(prompt="def f(", max_tokens=12, temperature=1.0, seed=9, n=3,
                                           stop_token_ids=[]))
        assert [(c["index"], c["text"]) for c in r["choices"]] == list(enumerate(text))


def test_a_base_model_refuses_chat_naming_completions(server):
    """The base model of test_serve.py has no chat tokens: one 400 that points at /v1/completions."""
    openai = pytest.importorskip("openai")
    base = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        base.chat.completions.create(model="podgpt", messages=[{"role": "user", "content": "hi"}])
    message = e.value.body["message"]
    assert e.value.status_code == 400 and "no chat tokens" in message and "POST /v1/completions" in message
    assert "\n" not in message


def test_completions_stop_at_end_unless_asked_not_to(chatty, model):
    """A chat model's completion of a chat prompt ends at <|end|> (finish "stop", usage counting it) where the
    model draws it; stop_token_ids=[] runs on past it, as the model draws."""
    ids = chat_prompt(model.tok, "What is 1 + 1?")
    end = chat_ids(model.tok)["<|end|>"]
    seed = next(s for s in range(300) if end in draws(model, ids, 40, seed=s)[0])  # BOS may come first: then no end
    long = [t.item() for t in model.model.generate(torch.tensor([ids]), 40, generator=torch.Generator().manual_seed(
        seed), temperature=1.0)]
    cut = long.index(end)
    body = dict(prompt=ids, max_tokens=40, temperature=1.0, seed=seed)
    r = post(chatty, COMPLETIONS, body)
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (model.tok.decode(long[:cut]), "stop")
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": cut + 1, "total_tokens": len(ids) + cut + 1}
    r = post(chatty, COMPLETIONS, dict(body, stop_token_ids=[]))
    past = long[:long.index(model.tok.bos_id) + 1] if model.tok.bos_id in long else long
    assert r["choices"][0]["text"] == model.tok.decode(past) and "<|end|>" in r["choices"][0]["text"]
    assert r["usage"]["completion_tokens"] == len(past) > cut + 1


def test_chat_logprobs_are_the_models_log_softmax(client, model):
    """logprobs=true, top_logprobs=3 at a seed: each reply token (its text, bytes) with its log-probability and the
    3 most likely there, against a log-softmax of the model's logits here over the prompt and reply (within 1e-4);
    asking changes nothing drawn."""
    messages = [{"role": "user", "content": "What is 9 + 9?"}]
    ids = chat.prompt_ids(model.tok, messages)
    body = dict(model="podgpt", messages=messages, max_tokens=20, temperature=1.0, seed=2)
    r = client.chat.completions.create(**body, logprobs=True, top_logprobs=3)
    assert r.choices[0].message.content == client.chat.completions.create(**body).choices[0].message.content
    entries = r.choices[0].logprobs.content
    tokens = draws(model, ids, 20, seed=2)[0]
    shown = tokens[:-1] if r.choices[0].finish_reason == "stop" else tokens
    assert [bytes(e.bytes) for e in entries] == [model.tok.decode_bytes([t]) for t in shown] and shown
    with torch.no_grad():
        logits = model.model(torch.tensor([ids + tokens]))[0][0, len(ids) - 1:, :model.tok.vocab_size]
    want = logits.float().log_softmax(dim=-1)
    for j, (e, t) in enumerate(zip(entries, shown)):
        assert e.logprob == pytest.approx(want[j, t].item(), abs=1e-4), j
        top = want[j].topk(3)
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4), j
        assert [bytes(x.bytes) for x in e.top_logprobs] == [model.tok.decode_bytes([i]) for i in top.indices.tolist()]


# -----------------------------------------------------------------------------
# the hostile cases of test_serve.py, on both endpoints of the chat model's server

PROMPTS = {COMPLETIONS: {"prompt": "x"}, CHAT: {"messages": [{"role": "user", "content": "x"}]}}
BAD = [  # (body after the endpoint's prompt, param the error names)
    (b"{not json", None),
    (b"[1, 2]", None),
    (b"[" * 100_000, None),  # nested too deeply for the JSON parser
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": LONG + 1}, "max_tokens"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stop": ""}, "stop"),
    ({"stop": "a" * 1_000_000}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"seed": -1}, "seed"),
    ({"n": 0}, "n"),
    ({"n": sample.serve_max_n + 1}, "n"),
    ({"n": True}, "n"),
    ({"model": 3}, "model"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"min_p": 0.1}, "min_p"),
]
CHAT_BAD = [  # a chat request's own fields
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x" * 61}]}, "messages"),  # 65 ids with the template: past 64
    ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"logprobs": 1}, "logprobs"),  # chat's logprobs is true or false
    ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ({"logprobs": True, "stream": True}, "logprobs"),
    ({"echo": True}, "echo"),  # completions' alone
    ({"stop_token_ids": []}, "stop_token_ids"),
]
COMPLETION_BAD = [({"stop_token_ids": [260]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids")]
CASES = [(path, body, param) for path in (COMPLETIONS, CHAT) for body, param in BAD] + \
        [(CHAT, body, param) for body, param in CHAT_BAD] + [(COMPLETIONS, body, param) for body, param in COMPLETION_BAD]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{i}-{p[4:]}-{q}" for i, (p, _, q) in enumerate(CASES)])
def test_bad_request_gets_400_naming_the_field(chatty, path, body, param):
    refused_naming(chatty, path, body if isinstance(body, bytes) else dict(PROMPTS[path], **body), param)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("request_,status,says", FRAMING, ids=[f"{i}-{s}" for i, (_, s, _) in enumerate(FRAMING)])
def test_bad_framing_gets_its_status_and_one_line(chatty, path, request_, status, says):
    got, error = raw_request(chatty, f"POST {path} HTTP/1.0\r\n".encode() + request_)
    assert (got, error["type"]) == (status, "invalid_request_error") and says in error["message"], error


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_trickled_body_is_cut_off_with_408(chatty, path):
    results = {}
    trickle(chatty, f"POST {path} HTTP/1.0\r\nContent-Length: 1000\r\n\r\n".encode(), results, "body")
    status, seconds = results["body"]
    assert status == b"HTTP/1.0 408 Request Timeout" and READ_TIMEOUT - 0.5 < seconds < READ_TIMEOUT + 2, results
    status, _, data = call(chatty, "GET", "/v1/chat/completions")
    assert status == 405 and "use POST /v1/chat/completions" in json.loads(data)["error"]["message"]


@pytest.mark.parametrize("held_by", [COMPLETIONS, CHAT])
def test_a_full_line_gets_503_on_both_endpoints_and_the_model_frees(chatty, held_by):
    """While a long stream (of either endpoint) holds the model: one request waits WAIT seconds for it and gets
    503, one more is refused at once (serve_max_queue=1), each with a Retry-After; once the stream's client
    leaves, a chat request is answered."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", chatty.port, timeout=60)
    conn.request("POST", held_by, json.dumps(dict(PROMPTS[held_by], max_tokens=LONG, temperature=0, stream=True,
                                                  **({"stop_token_ids": []} if held_by == COMPLETIONS else {}))))
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    results = []

    def send(path):
        start = time.monotonic()
        status, headers, data = call(chatty, "POST", path, dict(PROMPTS[path], max_tokens=4))
        results.append((path, status, headers.get("Retry-After"), json.loads(data), time.monotonic() - start))
    try:
        senders = [threading.Thread(target=send, args=(path,)) for path in (CHAT, COMPLETIONS)]
        for t in senders:
            t.start()
            time.sleep(0.2)  # the first is in line before the second comes
        for t in senders:
            t.join(timeout=60)
    finally:
        r.close()
        conn.close()
    assert [(path, status) for path, status, *_ in results] == [(COMPLETIONS, 503), (CHAT, 503)], results
    assert all(retry.isdigit() and "send it again in" in reply["error"]["message"]
               for _, _, retry, reply, _ in results), results
    assert results[0][4] < WAIT <= results[1][4] < WAIT + 2, results
    assert post(chatty, CHAT, dict(PROMPTS[CHAT], max_tokens=4))["usage"]["completion_tokens"] <= 4
