"""A checkpoint as a Hugging Face Llama folder (export.py's docstring lists it): written (export),
read back (load_export), and put in place over an earlier one of podgpt's (put_in_place, which
handoff.py's bundles use too)."""

import contextlib
import errno
import importlib.util
import json
import math
import os
import re
import shutil

import torch

from model import RUNTIME_FIELDS, GPTConfig
from podgpt.pod.checkpoints import load_model
from podgpt.pod.objectives import make_config, make_model
from podgpt.pod.memory import param_counts
from podgpt.pod.report import read_json, read_metrics
from podgpt.core.tokenizer import read_ranks
from podgpt.core.owned import edited, shas
from podgpt.core.util import (SCRATCH_MARK, fail, files_under, finish_scratch, first_line, in_use,
                              make_scratch, remove_scratch, write_atomic, write_json)

TOKENIZER_DIR = "podgpt_tokenizer"
# the padding rows past the vocabulary, which podgpt's model has and transformers' must not (no
# probability mass on ids that are no tokens): beside the weights, in a folder no loader globs
PADDING_FILE = os.path.join("podgpt_padding", "rows.safetensors")
PODGPT_FILE = "podgpt.json"  # the export's record: what it holds, where it came from
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the GPTConfig fields Llama expresses, and the runtime settings that leave the weights as they are
# (kernels, memory, document masking): any other field is an architecture Llama may not express
LLAMA_FIELDS = {"vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                "ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings", "vocab_multiple",
                "init_std", *RUNTIME_FIELDS}
# tokenizer.chat_prompt's layout, BOS <|user|> prompt <|end|> <|assistant|>, and chat_row's reply
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
                 "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
                 "{% else %}{{ raise_exception('only user and assistant messages: "
                 "podgpt trained no other role') }}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
LAYER_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm")


def finite(x):
    """x, or None where JSON has no number for it (no evaluation yet: inf)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def read_trainer(path):
    """Checkpoint `path`'s trainer.pt (step, losses); ValueError if it cannot be read."""
    try:
        return torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged pickle can raise many kinds of error
        raise ValueError(f"trainer.pt is unreadable ({first_line(e)})") from None


# --- the folder, written from a checkpoint

def check_llama(model_cfg, state_dict):
    """The model's GPTConfig; util.Error unless LlamaForCausalLM expresses the model exactly."""
    why = dict(refine="applies each block many times per token (recursive refinement)",
               bd3lm="denoises blocks of [MASK] tokens (block diffusion), "
                     "which no causal LM generates")
    objective = model_cfg.get("objective", "ar")
    if objective != "ar":
        fail(f"objective={objective}: this model {why[objective]}, which a Llama folder cannot "
             f"express: sample.py runs the checkpoint itself")
    if extra := sorted(set(model_cfg) - LLAMA_FIELDS):
        fail(f"the model config has {', '.join(extra)}, which Llama cannot express: "
             f"this export.py only maps podgpt's Llama architecture")
    cfg = GPTConfig(**model_cfg)
    want = {"embed_tokens.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.{i}.{m}.weight" for i in range(cfg.n_layer) for m in LAYER_WEIGHTS}
    if set(state_dict) != want:
        odd = sorted(set(state_dict) ^ want)[:3]
        fail(f"the weights do not match Llama's layout (e.g. {', '.join(odd)}): cannot export")
    head, embed = state_dict["lm_head.weight"], state_dict["embed_tokens.weight"]
    if cfg.tie_embeddings and not (head.data_ptr() == embed.data_ptr() or torch.equal(head, embed)):
        fail("tie_embeddings=True but lm_head differs from embed_tokens: "
             "the checkpoint is inconsistent")
    return cfg


def special_tokens(path, cfg):
    """(BOS id, EOS id, {chat token: id}) of checkpoint `path`'s tokenizer: a base model's text ends
    at BOS, an SFT model's reply at <|end|> (tokenizer.CHAT_TOKENS, after BOS)."""
    meta = read_json(os.path.join(path, "tokenizer.json")) or {}
    chat = meta.get("chat_tokens") or {}
    bos = meta.get("bos_id", cfg.vocab_size - 1)
    return bos, chat.get("<|end|>", bos), chat


def hf_config(cfg, torch_dtype, special=None, rows=None):
    """config.json. special: special_tokens' (BOS, EOS); None: both the last id. rows: vocab_size,
    the weights' rows (the export's: cfg.vocab_size, hf_tensors'); None: model.py's padded rows
    (bench/vs_hf.py's model of model.py's shape)."""
    bos, eos = special[:2] if special else (cfg.vocab_size - 1,) * 2
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": rows or cfg.padded_vocab, "hidden_size": cfg.n_embd,
            "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.block_size, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "pretraining_tp": 1, "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": bos, "eos_token_id": eos,
            "use_cache": True, "dtype": torch_dtype, "torch_dtype": torch_dtype}


def generation_config(bos, eos):
    """generation_config.json: a reply ends at EOS or BOS; no max_length, which
    generate(max_new_tokens=...) would warn of."""
    return {"bos_token_id": bos, "eos_token_id": bos if eos == bos else [eos, bos]}


VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")  # one row per id: the padding rows' tensors


def hf_tensors(cfg, state_dict, dt):
    """({HF name: tensor}, {podgpt name: padding rows}), a tied head once (as the embedding); the
    vocabulary rows to transformers, the padding rows apart; q and k unpermuted, as model.py's
    RoPE rotates halves as transformers' rotate_half does (tests/test_export.py checks)."""
    # copies: safetensors refuses tensors that share memory; huggingface_hub sizes them by storage
    state = {name: t.detach().to("cpu", dt, copy=True) for name, t in state_dict.items()
             if not (name == "lm_head.weight" and cfg.tie_embeddings)}
    padding = {name: state[name][cfg.vocab_size:].contiguous() for name in VOCAB_ROWS
               if name in state and cfg.padded_vocab > cfg.vocab_size}
    return {name if name == "lm_head.weight" else "model." + name:
            (t[:cfg.vocab_size] if name in VOCAB_ROWS else t).contiguous()
            for name, t in state.items()}, padding


def write_weights(folder, tensors, max_shard_bytes):
    """model.safetensors, or shards of at most max_shard_bytes and their index, as huggingface_hub
    plans them."""
    from huggingface_hub import split_torch_state_dict_into_shards
    plan = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_bytes)
    # each written here, not by save_torch_state_dict: its errors name no file, its files are 0600
    for name, keys in plan.filename_to_tensors.items():
        save_safetensors({k: tensors[k] for k in keys}, os.path.join(folder, name))
    if plan.is_sharded:
        write_json(os.path.join(folder, "model.safetensors.index.json"),
                   {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename})


def save_safetensors(tensors, path):
    """safetensors' save_file, then the mode a new file gets (0666 less the umask): safetensors
    writes 0600, which a server running as another user could not read."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:  # its I/O errors (a full disk) come as its own error type
        code = re.search(r"\(os error (\d+)\)", str(e))  # the OS's error number, in the text
        raise OSError(int(code.group(1)) if code else errno.EIO,
                      f"safetensors could not write {path}: {first_line(e)}") from None
    umask = os.umask(0)  # the only way to read it is to set it: put straight back
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_hf_tokenizer(src, folder, block_size, template=False):
    """tokenizer.json + tokenizer_config.json for transformers (its tiktoken converter gives the
    same ids) from podgpt's files in `src`; None, or why none was written. template: a chat
    tokenizer gets CHAT_TEMPLATE and reads chat markers in text as tokens."""
    meta = read_json(os.path.join(src, "tokenizer.json"))
    if meta is None:
        return f"no readable podgpt tokenizer.json in {src}"
    if meta["kind"] == "byte":  # ids 0-255 are the bytes: a byte-level BPE without merges
        ranks, pattern, bos = {bytes([i]): i for i in range(256)}, r"[\s\S]+", "<|bos|>"
    elif meta["kind"] == "tiktoken":
        ranks, pattern = read_ranks(os.path.join(src, "tokenizer.tiktoken")), meta["pattern"]
        bos = next(name for name, i in meta["special_tokens"].items() if i == meta["bos_id"])
    else:
        return (f"the {meta['spec']} tokenizer's ids index characters, not bytes, "
                "which transformers' tiktoken converter cannot express")
    try:
        from tokenizers import processors
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        return ("transformers is not installed "
                "(pip install transformers, or pip install -r requirements.txt)")

    class Converter(TikTokenConverter):
        def load_tiktoken_bpe(self, _):  # the ranks read above (tiktoken's caches files by path)
            return ranks

    chat = meta.get("chat_tokens") or {}
    try:  # the chat tokens (an SFT model's) follow BOS, as their ids do
        fast = Converter(pattern=pattern, extra_special_tokens=[bos, *chat]).converted()
    except Exception as e:  # e.g. a split pattern the tokenizers library cannot compile
        return f"transformers' tiktoken converter failed ({first_line(e)})"
    # every training document starts with BOS: transformers puts it first, as sample.py does
    fast.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta["bos_id"])])
    fast.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",  # a name transformers 4 and 5 both load
              "bos_token": bos, "eos_token": "<|end|>" if chat else bos,
              "model_max_length": block_size,
              "split_special_tokens": True,  # "<|bos|>" typed in a text is text, as podgpt encodes
              "clean_up_tokenization_spaces": False}  # decode gives the text back as it was
    if template and chat:
        config |= {"chat_template": CHAT_TEMPLATE, "split_special_tokens": False}
    write_json(os.path.join(folder, "tokenizer_config.json"), config)
    return None


# the model card's code that asks the model: a chat through its template, or a text to continue
ASK_CHAT = """\
messages = [{"role": "user", "content": "What is 2 + 3?"}]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                              return_tensors="pt")
# ids: BOS <|user|> prompt <|end|> <|assistant|>, as in training; the reply ends at <|end|>
room = tok.model_max_length - ids["input_ids"].shape[1]  # the context it was trained on
out = model.generate(**ids, max_new_tokens=room, do_sample=False)
print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
# a chat marker typed in a message is read as the marker; for text you do not trust,
# apply_chat_template(..., sanitize_control_tokens=True) keeps it text (transformers 5.24)"""
ASK_TEXT = """\
ids = tok("def main(", return_tensors="pt").input_ids  # starts with BOS, as in training
print(tok.decode(model.generate(ids, max_new_tokens=64)[0], skip_special_tokens=True))"""


def card_usage(where, bos, tokenizer, chat):
    """The code (of the model card, the hand-off README) that loads the export in `where` and asks
    it: through its chat template (chat), by text (tokenizer), else by token ids."""
    if not tokenizer:
        return ["from transformers import AutoModelForCausalLM",
                f'model = AutoModelForCausalLM.from_pretrained("{where}")',
                f"# start every prompt with the BOS id {bos}"]
    return ["from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'tok = AutoTokenizer.from_pretrained("{where}")',
            f'model = AutoModelForCausalLM.from_pretrained("{where}")',
            *(ASK_CHAT if chat else ASK_TEXT).splitlines()]


def card_training(path, run_cfg, trainer, out_dir):
    """The model card's Training section of checkpoint `path`, from what out_dir holds."""
    summary = read_json(os.path.join(out_dir, "summary.json")) or {}
    if os.path.basename(str(summary.get("checkpoint") or path)) != os.path.basename(path):
        summary = {}  # the run went on (or ended) at another checkpoint: not this one's numbers
    preflight = read_json(os.path.join(out_dir, "preflight.json"))
    tok = read_json(os.path.join(path, "tokenizer.json")) or {}
    train_loss = summary.get("final_train_loss")
    if train_loss is None:  # the run has not ended: the last loss it logged up to this checkpoint
        losses = [r["loss"] for r in read_metrics(os.path.join(out_dir, "metrics.jsonl"))
                  if "loss" in r and r["step"] <= trainer.get("step", -1)]
        train_loss = losses[-1] if losses else None
    recipe_keys = ("max_steps total_batch_tokens micro_batch_size learning_rate min_lr "
                   "warmup_steps weight_decay beta1 beta2 grad_clip seed dtype world_size "
                   "grad_accum").split()

    def fmt(x):
        return "n/a" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)
    tokens = trainer.get("tokens")
    lines = [
        "## Training", "",
        f"- data: `{run_cfg.get('data_dir', 'n/a')}` (fingerprint "
        f"`{run_cfg.get('data_fingerprint', 'n/a')}`), tokenizer `{tok.get('spec', 'n/a')}`",
        f"- tokens seen: {tokens:,}" if isinstance(tokens, int) else "- tokens seen: n/a",
        "- recipe: " + ", ".join(f"{k}={run_cfg[k]}" for k in recipe_keys if k in run_cfg),
        "- AdamW, linear warmup then cosine decay to min_lr",
        f"- final train loss: {fmt(train_loss)}; validation loss at this checkpoint: "
        f"{fmt(trainer.get('val_loss'))} (best {fmt(trainer.get('best_val_loss'))}) nats/token",
    ]
    if summary.get("unigram_val_loss") is not None:
        lines.append(f"- unigram baseline validation loss: {fmt(summary['unigram_val_loss'])}")
    if not preflight:
        return lines + ["- preflight verdict: none recorded (no preflight.json in the out_dir)"]
    blocked = [g["name"] for g in preflight.get("gates", []) if g.get("verdict") == "block"]
    return lines + [f"- preflight verdict: {preflight.get('verdict', 'n/a')}"
                    + (f" (blocked: {', '.join(blocked)})" if blocked else "")]


def model_card(path, source, run_cfg, cfg, trainer, out_dir, weight_dtype, tokenizer_note, special,
               template):
    """README.md of the export of checkpoint `path`, named `source`; tokenizer_note: why there is
    no transformers tokenizer (None: there is one)."""
    p = param_counts(cfg)
    bos, eos, chat = special
    use = card_usage("<this folder>", bos, tokenizer_note is None, template and bool(chat))
    tokenizer_line = (
        "- `tokenizer.json` encodes exactly as podgpt's tokenizer (made with transformers' "
        f"tiktoken converter); podgpt's own files are in `{TOKENIZER_DIR}/`."
        if tokenizer_note is None else
        f"- No transformers tokenizer is included ({tokenizer_note}): podgpt's tokenizer files are "
        f"in `{TOKENIZER_DIR}/` (read them with podgpt's `tokenizer.load_tokenizer`); pass token "
        "ids to transformers, and serve with vLLM using `--skip-tokenizer-init`.")
    ids = f"BOS = EOS = id {bos}" if not chat else (f"BOS id {bos}; chat tokens " + ", ".join(
        f"{name} = id {i}" for name, i in chat.items()) + f"; a reply ends at EOS = id {eos}")
    name = os.path.basename(os.path.normpath(out_dir)) or "podgpt"
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        "tags: [llama, podgpt]", "---", "", f"# {name} (podgpt export)", "",
        "A Llama-architecture decoder pretrained from scratch with podgpt, exported from "
        f"`{source}` (step {trainer.get('step', 'n/a')}). Weights: {weight_dtype}.", "",
        "## Model", "",
        f"- {p['total']:,} parameters ({p['non_embedding']:,} non-embedding); {cfg.n_layer} "
        f"layers, d_model {cfg.n_embd}, {cfg.n_head} heads / {cfg.n_kv_head} KV heads (head_dim "
        f"{cfg.head_dim}), SwiGLU {cfg.ffn_hidden}, RoPE theta {cfg.rope_theta}, RMSNorm eps "
        f"{cfg.norm_eps}, {'tied' if cfg.tie_embeddings else 'untied'} embeddings, context "
        f"{cfg.block_size}",
        f"- vocabulary: {cfg.vocab_size} tokens ({ids}), config.json's vocab_size: every output "
        "is a token's", "",
        *card_training(path, run_cfg, trainer, out_dir),
        "", "## Use", "",
        "```python", *use, "```", "",
        "`python sample.py --ckpt=<this folder>` streams text with podgpt's own tokenizer "
        f"(`{TOKENIZER_DIR}/`).", "",
        "## Known limitations", "",
        "- Small model pretrained from scratch, no safety tuning; " + (
            "fine-tuned on chat rows (SFT): it answers in the chat layout above" if chat else
            "no instruction tuning: it continues text."),
        tokenizer_line,
        *[f"- Trained with the vocabulary padded to {cfg.padded_vocab} rows: the padding rows "
          f"are not in the model (log-probabilities are over the {cfg.vocab_size} tokens alone) "
          f"but in `{PADDING_FILE}`, for podgpt's own loader."][:cfg.padded_vocab > cfg.vocab_size],
        f"- Context is {cfg.block_size} tokens; RoPE was not trained beyond it.",
        "- Documents were separated by BOS only; the model emits BOS (= EOS) where a document "
        "ends.",
    ]
    return "\n".join(lines) + "\n"


def export(path, out, weight_dtype="float32", max_shard_gb=5.0, chat_template=False):
    """Write the export of checkpoint `path` to `out`, whole or not at all; util.Error if not."""
    for lib in ("safetensors", "huggingface_hub"):  # the weights' format, and their shards' plan
        if importlib.util.find_spec(lib) is None:
            fail(f"{lib} is not installed: pip install {lib} (or pip install -r requirements.txt)")
    if weight_dtype not in DTYPES:
        fail(f"dtype={weight_dtype!r} is not one of float32, bfloat16")
    if max_shard_gb <= 0:
        fail(f"max_shard_gb={max_shard_gb} must be positive")
    finish_replace(out)
    check_replaceable(out)
    try:  # verified, loaded into model.py as it is; a sharded (fsdp) checkpoint gathered whole
        model, run_cfg = load_model(path, "cpu")
        trainer = read_trainer(path)
    except Exception as e:  # a damaged pickle can raise many kinds of error
        fail(f"checkpoint {path} cannot be used: {e}")
    state = model.state_dict()
    cfg = check_llama(run_cfg["model"], state)
    out = os.path.normpath(out)
    with scratch_beside(out, "podgpt-export") as tmp:
        tensors, padding = hf_tensors(cfg, state, DTYPES[weight_dtype])
        write_weights(tmp, tensors, int(max_shard_gb * 1e9))
        if padding:  # load_export puts them back: the checkpoint's weights, bit for bit
            os.makedirs(os.path.dirname(os.path.join(tmp, PADDING_FILE)))
            save_safetensors(padding, os.path.join(tmp, PADDING_FILE))
        special = special_tokens(path, cfg)
        write_json(os.path.join(tmp, "config.json"), hf_config(cfg, weight_dtype, special,
                                                                   rows=cfg.vocab_size))
        write_json(os.path.join(tmp, "generation_config.json"),
                   generation_config(*special[:2]))
        os.makedirs(os.path.join(tmp, TOKENIZER_DIR))  # podgpt's own tokenizer, for sample.py
        for name in ("tokenizer.json", "tokenizer.tiktoken"):
            if os.path.exists(os.path.join(path, name)):  # copyfile: the bytes, not a private mode
                shutil.copyfile(os.path.join(path, name), os.path.join(tmp, TOKENIZER_DIR, name))
        note = write_hf_tokenizer(path, tmp, cfg.block_size, chat_template)
        if note:
            print(f"note: no tokenizer.json for transformers: {note}; "
                  f"the model card says so, and podgpt's tokenizer is in {TOKENIZER_DIR}/")
        out_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        # named as run/ckpt/checkpoint: an export is made to be shared, and an absolute path names
        # the machine's folders (a home directory, a user name)
        source = os.path.relpath(os.path.abspath(path), os.path.dirname(out_dir))
        card = model_card(path, source, run_cfg, cfg, trainer, out_dir, weight_dtype, note, special,
                          chat_template)
        write_atomic(os.path.join(tmp, "README.md"), card)
        files = [f for f in files_under(tmp) if f != SCRATCH_MARK] + [PODGPT_FILE]
        write_json(os.path.join(tmp, PODGPT_FILE),  # files: what a later export may replace
                   {"model": run_cfg["model"], "source": source, "step": trainer.get("step"),
                    "val_loss": finite(trainer.get("val_loss")),
                    "best_val_loss": finite(trainer.get("best_val_loss")),
                    "weights_dtype": weight_dtype, "files": files,
                    "sha256": shas(tmp, files[:-1])})  # what the files were: edits are refused
        put_in_place(tmp, out)


# --- a finished folder put in place over an earlier one of podgpt's (an export, a hand-off bundle)

def beside(out, suffix):
    """A path beside `out` under a name no user picks: .NAME.suffix."""
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{suffix}")


@contextlib.contextmanager
def scratch_beside(out, suffix):
    """The folder to build `out` in, beside it, marked as podgpt's; removed if the build fails."""
    tmp = make_scratch(beside(out, suffix))
    try:
        yield tmp
    except BaseException:
        if os.path.isfile(os.path.join(tmp, SCRATCH_MARK)):
            remove_scratch(tmp)
        raise


def put_in_place(tmp, out, record=PODGPT_FILE, script="export.py", kind="export"):
    """The finished folder tmp renamed to out, over an earlier one holding only its own files
    (checked again). The earlier one waits in a marked folder beside, put back if the rename
    fails."""
    check_replaceable(out, record, script, kind)
    if not os.path.lexists(out):
        os.replace(tmp, out)
        finish_scratch(tmp, out)
        return
    aside = make_scratch(beside(out, "podgpt-old"))
    old = os.path.join(aside, "old")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        try:
            os.replace(old, out)
        except OSError as e:  # the earlier one stays where it is, and the user is told where
            fail(f"out={out}: the new {kind} could not be put in place, nor the earlier one back "
                 f"({first_line(e)}): the earlier {kind} is in {old}: move it back to {out}")
        remove_scratch(aside)
        raise
    finish_scratch(tmp, out)
    remove_scratch(aside)


def as_recorded(folder, record=PODGPT_FILE, unhashed=()):
    """Whether folder holds exactly the files its `record` lists, each with the sha256 recorded
    (all but the record and `unhashed`): as export.py (or handoff.py) wrote it."""
    saved = read_json(os.path.join(folder, record))
    try:
        present = [f for f in files_under(folder) if f != SCRATCH_MARK]
        return (isinstance(saved, dict) and isinstance(saved.get("sha256"), dict)
                and sorted(saved.get("files") or ()) == present
                and sorted(saved["sha256"]) == sorted(set(present) - {record, *unhashed})
                and not edited(folder, saved["sha256"]))
    except (OSError, TypeError):  # unreadable, or a record of another shape: not proven
        return False


def finish_replace(out, whole=as_recorded):
    """What a kill during put_in_place left beside out: the earlier folder in the one podgpt named
    and marked to hold it. With the new one whole in out, that folder goes; with none there, the
    earlier one goes back when whole (or the empty folder it replaced). Anything else stays, for
    check_replaceable to refuse."""
    aside = beside(out, "podgpt-old")
    old = os.path.join(aside, "old")
    if not (os.path.isdir(aside) and not os.path.islink(aside) and not in_use(aside)
            and os.path.isfile(os.path.join(aside, SCRATCH_MARK))
            and set(os.listdir(aside)) <= {"old", SCRATCH_MARK}):
        return
    if not os.path.lexists(out):  # cut between its two renames
        if os.path.islink(old) or not os.path.isdir(old) or (os.listdir(old) and not whole(old)):
            return
        os.replace(old, out)
    elif not whole(out):
        return
    remove_scratch(aside)


def check_replaceable(out, record=PODGPT_FILE, script="export.py", kind="export"):
    """Stop unless `out` is absent, empty, or an earlier `kind` holding only the files its `record`
    lists, with no earlier one left beside it by a replace cut short."""
    waiting = os.path.join(beside(out, "podgpt-old"), "old")
    if os.path.lexists(waiting):
        fail(f"out={out}: an earlier {kind} waits in {waiting}, left by a replace cut short: "
             f"move it back to {out} (or away), then rerun")
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out) or os.path.islink(out):
        fail(f"out={out} is a file, not a folder: "
             "give the path of a folder to write (it is created)")
    saved = read_json(os.path.join(out, record))
    listed = set(saved.get("files", ())) if isinstance(saved, dict) else set()
    by_entry = not any("/" in f for f in listed)  # a record from before paths: top-level entries
    try:
        present = files_under(out)
    except OSError as e:
        fail(f"out={out} cannot be read whole ({first_line(e)}): not replacing it; "
             "choose another --out")
    # a scratch mark that a kill left between put_in_place's rename and its removal is podgpt's
    # own (scratch_beside's lock stops a second writer of out before it gets here)
    foreign = [f for f in present if f not in listed and f != SCRATCH_MARK
               and not (by_entry and f.split("/")[0] in listed)]
    if not foreign:
        recorded = saved.get("sha256") if isinstance(saved, dict) else None
        if isinstance(recorded, dict) and (name := edited(out, recorded)):
            fail(f"out={out}: {name} was changed since {script} wrote it: not replacing this "
                 f"earlier {kind}; move {name} (or the {kind}) away, or choose another --out")
        return
    what = f"earlier {kind}" if os.path.isfile(os.path.join(out, record)) else "folder"
    some = ", ".join(foreign[:3]) + " ..." * (len(foreign) > 3)
    fail(f"out={out} holds what {script} did not write ({some}): not replacing this {what}; "
         "choose another --out or move those away")


# --- an export read back into podgpt (sample.py and eval.py, through loading.py)

def is_export(path):
    return bool(path) and os.path.isfile(os.path.join(path, PODGPT_FILE))


def tokenizer_dir(path):
    """Where tokenizer.load_tokenizer finds the tokenizer: an export's subfolder, else path."""
    sub = os.path.join(path, TOKENIZER_DIR)
    return sub if os.path.isdir(sub) else path


def load_export_state(path):
    """podgpt's state dict (model.py names) from an export's safetensors, as stored, with the
    padding rows (PADDING_FILE) after the vocabulary's."""
    from safetensors.torch import load_file
    files = ["model.safetensors"]
    if os.path.exists(index := os.path.join(path, "model.safetensors.index.json")):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    state = {k.removeprefix("model."): v for name in files
             for k, v in load_file(os.path.join(path, name)).items()}
    if os.path.exists(os.path.join(path, PADDING_FILE)):  # none: no padding, or an earlier export
        for name, rows in load_file(os.path.join(path, PADDING_FILE)).items():
            state[name] = torch.cat([state[name], rows])
    return state


def load_export(path, device="cpu"):
    """(model in eval mode, float32; podgpt.json's dict) of an export; ValueError if unreadable."""
    try:
        with open(os.path.join(path, PODGPT_FILE)) as f:
            meta = json.load(f)
        model = make_model(make_config(**meta["model"]))
        state = load_export_state(path)
        if model.config.tie_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"not a readable podgpt export ({why})") from None
    return model.to(device).eval(), meta
