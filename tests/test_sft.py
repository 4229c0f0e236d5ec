"""The SFT stage: the chat layout in every tokenizer (base ids keep their meaning), SFT data whose loss covers the
assistant's tokens only, and init_from a base checkpoint."""
import json

import pytest

import tokenizer
from test_prepare import gpt2_or_skip
from tokenizer import CHAT_TOKENS, chat_prompt, chat_row, load_tokenizer, reply_text, save_tokenizer

TEXTS = ["What is 17 + 25?", "42", "Sort: pear, apple\nkiwi", "<|user|> <|end|> typed, not special"]


def tokenizer_pair(spec, folder):
    """(base, chat) Tokenizers of spec, each loaded from the files save_tokenizer wrote."""
    if spec == "gpt2":
        gpt2_or_skip()
    meta, ranks = tokenizer.train_tokenizer(spec, lambda: iter(TEXTS), lambda: iter(TEXTS * 20))
    for name, fields in (("base", meta), ("chat", tokenizer.with_chat_tokens(meta))):
        (folder / name).mkdir()
        save_tokenizer(folder / name, spec, fields, ranks)
    return load_tokenizer(folder / "base"), load_tokenizer(folder / "chat")


@pytest.mark.parametrize("spec", ["byte", "char", "bpe:300", "gpt2"])
def test_chat_tokens_follow_the_base_vocabulary(spec, tmp_path):
    base, chat = tokenizer_pair(spec, tmp_path)
    v = base.vocab_size
    assert chat.bos_id == base.bos_id == v - 1 and chat.vocab_size == v + 3
    assert tokenizer.chat_ids(chat) == {name: v + i for i, name in enumerate(CHAT_TOKENS)}
    assert json.loads((tmp_path / "chat" / "tokenizer.json").read_text())["bos_id"] == v - 1
    for text in TEXTS:  # a base-vocabulary encode is unchanged and never yields a chat token
        ids = chat.encode(text)
        assert ids == base.encode(text) and max(ids) < v - 1 and chat.decode(ids) == text
    assert chat.decode(chat_prompt(chat, "hi")) == "<|user|>hi<|end|><|assistant|>"
    assert chat.decode(list(chat.chat.values())) == "".join(CHAT_TOKENS)
    with pytest.raises(ValueError, match="no chat tokens"):
        chat_prompt(base, "hi")


def test_chat_row_masks_the_reply_and_its_end(tmp_path):
    _, tok = tokenizer_pair("byte", tmp_path)
    ids, mask = chat_row(tok, "2+2?", "4")
    user, assistant, end = (tokenizer.chat_ids(tok)[name] for name in CHAT_TOKENS)
    assert ids == [tok.bos_id, user, *b"2+2?", end, assistant, ord("4"), end]
    assert mask == [0] * 8 + [1, 1]
    assert ids[:len(ids) - 2] == chat_prompt(tok, "2+2?")


def test_reply_text():
    row = {"category": "add", "prompt": "17+25?", "answer": "42", "scratchpad": "7+5=12\n1+2+1=4"}
    assert reply_text({**row, "answer_style": "direct"}) == "42"
    assert reply_text({**row, "answer_style": "scratchpad"}) == "7+5=12\n1+2+1=4\n42"
