"""sample.py on a chat (SFT) model: the prompt is a user message in the chat layout and the reply ends at <|end|>,
as transformers answers through the export's chat template; the export's probabilities are over the true
vocabulary; --chat=False and a base model continue text as before."""
import json

import pytest
import torch

from conftest import Captured, run_script, shared, train_tiny
from podgpt.core.checkpoint import find_checkpoint
from podgpt.core.tokenizer import chat_ids, chat_prompt, load_tokenizer
from podgpt.pod.checkpoints import load_model
from test_bad_input import CKPT, finished_run  # noqa: F401 -- a fixture: the base model (1 step, stdlib)
from test_sft import SFT_ARGS, sft_data  # noqa: F401 -- a fixture: SFT data in the base model's tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

QUESTION = "What is 7 + 13?"
N = 40  # tokens at most: the tiny model's replies end well before


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, finished_run, sft_data):  # noqa: F811
    """{"run": an SFT run of the base model long enough that its greedy replies end at <|end|>, "hf": its export
    with the chat template (as handoff.py makes it)}."""
    def build(root):
        with Captured() as captured:
            train_tiny(captured, root / "run", sft_data, *SFT_ARGS, f"--init_from={finished_run}",
                       "--max_steps=60", "--ckpt_every=60", "--learning_rate=1e-2", "--log_every=20")
            r = run_script(["export.py", f"--ckpt={root / 'run'}", f"--out={root / 'hf'}", "--chat_template=True"],
                           captured)
            assert r.returncode == 0, r.stderr
    root = shared(tmp_path_factory, "chat_sample_run", build)
    return {"run": root / "run", "hf": root / "hf"}


def sample(capfd, ckpt, *args, prompt=QUESTION):
    r = run_script(["sample.py", f"--ckpt={ckpt}", f"--prompt={prompt}", "--temperature=0",
                    f"--max_new_tokens={N}", "--device=cpu", *args], capfd)
    assert r.returncode == 0, r.stderr
    return r.stdout


def transformers_reply(folder):
    """(reply text, generated ids) of transformers' greedy answer to QUESTION through the export's chat template."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=N, do_sample=False)[0, ids["input_ids"].shape[1]:]
    return tok.decode(out, skip_special_tokens=True), out.tolist(), ids["input_ids"][0].tolist()


def test_sample_answers_a_chat_model_as_transformers_answers_its_export(sft_run, capfd):
    """The prompt is the user's message (chat_prompt's ids, as the chat template's); the reply is printed alone and
    ends at <|end|>, which is not printed (transformers' skip_special_tokens); greedy by temperature 0 or top_k 1,
    from the checkpoint or its export."""
    tok = load_tokenizer(find_checkpoint(str(sft_run["run"]), "best"))
    reply, generated, prompt_ids = transformers_reply(sft_run["hf"])
    assert prompt_ids == chat_prompt(tok, QUESTION)
    assert generated[-1] == chat_ids(tok)["<|end|>"] and len(generated) < N, "the reply must end at <|end|>"
    assert reply.strip() and "<|" not in reply
    want = reply + "\n"
    assert sample(capfd, sft_run["run"]) == want
    assert sample(capfd, sft_run["hf"]) == want
    assert sample(capfd, sft_run["run"], "--temperature=0.8", "--top_k=1", "--chat=auto") == want
    assert sample(capfd, sft_run["run"], "--chat=True", "--num_samples=2") == want + "-" * 40 + "\n" + want


def test_chat_false_continues_the_prompt_as_bytes(sft_run, capfd):
    """--chat=False on the chat model: the old raw completion, the prompt and its continuation, the markers typed
    in it read as bytes and those the model emits printed by name, no stop."""
    ckpt = find_checkpoint(str(sft_run["run"]), "best")
    ours, tok = load_model(ckpt)[0], load_tokenizer(ckpt)
    prompt = f"<|user|>{QUESTION}<|end|><|assistant|>"
    ids = torch.tensor([[tok.bos_id, *prompt.encode()]])
    continued = [t.item() for t in ours.generate(ids, N, temperature=0)]
    assert sample(capfd, sft_run["run"], "--chat=False", prompt=prompt) == prompt + tok.decode(continued) + "\n"


def test_a_base_model_continues_text_and_refuses_chat(finished_run, capfd):  # noqa: F811
    """A base model (no chat tokens) continues the prompt, --chat auto or False alike; --chat=True is one line."""
    ckpt = finished_run / CKPT
    ours, tok = load_model(str(ckpt))[0], load_tokenizer(str(ckpt))
    ids = torch.tensor([[tok.bos_id, *b"def main("]])
    want = "def main(" + tok.decode([t.item() for t in ours.generate(ids, N, temperature=0)]) + "\n"
    assert sample(capfd, ckpt, prompt="def main(") == sample(capfd, ckpt, "--chat=False", prompt="def main(") == want
    r = run_script(["sample.py", f"--ckpt={ckpt}", "--prompt=hi", "--chat=True", "--device=cpu"], capfd)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"error: chat=True: the byte tokenizer of {ckpt} has no chat tokens (<|user|>, <|assistant|>, "
                        "<|end|>): a base model continues text; leave --chat out\n")


def test_the_export_s_probabilities_are_over_the_true_vocabulary(sft_run):
    """transformers' log-softmax over the export's whole output is podgpt's over the tokenizer's vocabulary (no
    mass on the padding rows), and its greedy generate is podgpt's."""
    ckpt = find_checkpoint(str(sft_run["run"]), "best")
    ours, tok = load_model(ckpt)[0], load_tokenizer(ckpt)
    config = json.loads((sft_run["hf"] / "config.json").read_text())
    assert config["vocab_size"] == tok.vocab_size == 260 < ours.config.padded_vocab
    model = transformers.AutoModelForCausalLM.from_pretrained(str(sft_run["hf"]), dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt(tok, QUESTION) + tok.encode("20") + [chat_ids(tok)["<|end|>"]]])
    with torch.no_grad():
        theirs = model(ids).logits.log_softmax(-1)
        mine = ours(ids)[0][..., :tok.vocab_size].log_softmax(-1)
    assert theirs.shape == mine.shape and (theirs - mine).abs().max().item() < 1e-4
    prompt = torch.tensor([chat_prompt(tok, QUESTION)])
    generated = model.generate(prompt, max_new_tokens=N, do_sample=False)[0, prompt.size(1):].tolist()
    assert generated == [t.item() for t in ours.generate(prompt, len(generated), temperature=0)]


def test_the_server_answers_as_sample_py_and_transformers_from_the_checkpoint_and_its_export(sft_run, tmp_path,
                                                                                           capfd):
    """Issue 45's acceptance, end to end: OpenAI's client against sample.py --serve on the SFT checkpoint and on its
    export, streamed and not, at temperature 0, gives the reply sample.py prints and transformers generates through
    the export's chat template; the server's logprobs on the export are transformers' log-softmax over its whole
    output (no padding row takes mass), within 1e-4 a token."""
    openai = pytest.importorskip("openai")
    from test_serve import start_server, stop_server
    want, generated, prompt_ids = transformers_reply(sft_run["hf"])
    assert sample(capfd, sft_run["run"]) == want + "\n"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(sft_run["hf"]), dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' next-token log-probabilities along its own greedy reply
        logits = hf(torch.tensor([prompt_ids + generated])).logits[0, len(prompt_ids) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(generated)[:, None])[:, 0]
    message = [{"role": "user", "content": QUESTION}]
    for name, folder in (("run", find_checkpoint(str(sft_run["run"]), "best")), ("hf", sft_run["hf"])):
        server = start_server(folder, tmp_path / f"{name}.log")
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
            r = client.chat.completions.create(model="x", messages=message, temperature=0, max_tokens=N,
                                               logprobs=True)
            assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop"), name
            assert r.usage.completion_tokens == len(generated)  # the reply's tokens and its <|end|>
            got = torch.tensor([t.logprob for t in r.choices[0].logprobs.content])
            assert (got - expected[:-1]).abs().max() < 1e-4, name  # <|end|> ends it and is not content
            chunks = client.chat.completions.create(model="x", messages=message, temperature=0, max_tokens=N,
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want, name
        finally:
            stop_server(server)
