"""The chat side of the server (serve.py): POST /v1/chat/completions' messages as the prompt the
export's chat template (hf.CHAT_TEMPLATE) makes of them, and its replies in OpenAI's chat format."""

from podgpt.core.tokenizer import has_chat
from podgpt.release.bounds import RequestError, shown

ROLES = {"user": "<|user|>", "assistant": "<|assistant|>"}  # the only roles podgpt trains
OBJECT, CHUNK = "chat.completion", "chat.completion.chunk"
EXAMPLE = '{"messages": [{"role": "user", "content": "Hi"}]}'


def check_chat_model(tok):
    """A base model has no chat tokens: no prompt a chat request could be made into."""
    if not has_chat(tok):
        raise RequestError("this model has no chat tokens (a base model, not fine-tuned for chat): "
                           "send its text to POST /v1/completions instead")


def prompt_ids(tok, messages):
    """The ids hf.CHAT_TEMPLATE gives messages with add_generation_prompt: BOS, each message as
    <|user|>text<|end|> or <|assistant|>text<|end|>, then <|assistant|> (one user message:
    tokenizer.chat_prompt's ids)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages={shown(messages)} is invalid: send a non-empty list such as "
                           f"{EXAMPLE[13:-1]}", "messages")
    ids = [tok.bos_id]
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{name}={shown(m)} is invalid: send an object with role and "
                               "content", name)
        extra = next((k for k, v in m.items() if k not in ("role", "content") and v is not None),
                     None)
        if extra is not None:  # name, tool_calls...: the template has no place for them
            raise RequestError(f"{name}.{extra[:40]} is not supported: leave it out (the chat "
                               "template reads role and content)", f"{name}.{extra[:40]}")
        if m.get("role") not in ROLES:
            raise RequestError(f"{name}.role={shown(m.get('role'))} is not supported: use user or "
                               "assistant (podgpt trained no other role; put a system prompt's "
                               "instructions in the first user message)", f"{name}.role")
        if not isinstance(m.get("content"), str):
            raise RequestError(f"{name}.content={shown(m.get('content'))} is invalid: send the "
                               "message's text as a string", f"{name}.content")
        try:
            text = tok.encode(m["content"])
        except ValueError as e:  # the char tokenizer knows only its corpus' characters
            raise RequestError(f"{name}.content cannot be encoded: {e}: leave those out",
                               f"{name}.content")
        ids += [tok.chat[ROLES[m["role"]]], *text, tok.chat["<|end|>"]]
    return ids + [tok.chat["<|assistant|>"]]


def choice(index, text, finish, logprobs):
    return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs, "finish_reason": finish}


def delta(index, text, finish, first):
    """A stream's chunk of a choice: its first names the role."""
    part = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": part, "logprobs": None, "finish_reason": finish}


def logprobs(ctx, p, ids, prompt, scored):
    """None unless asked for, else OpenAI's {"content": [...]} of the reply's tokens (scored: the
    (token id, serve.score()) of each; the token that ended the reply is no part of it)."""
    if scored is None:
        return None
    tok = ctx.tok

    def entry(token, logprob):
        data = tok.decode_bytes([token])
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(data)}
    ends = {tok.bos_id, *p["stop_ids"]}
    return {"content": [dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in top])
                        for t, (lp, top) in scored if t not in ends], "refusal": None}
