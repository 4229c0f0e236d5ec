"""export.py: the exported folder is a LlamaForCausalLM that computes podgpt's logits, bit-exact weights,
the same greedy text as sample.py, a transformers tokenizer that encodes as podgpt's, shards, refusals."""
import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import Captured, run, run_script, shared, train_tiny

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from podgpt.release import hf as export  # noqa: E402
from podgpt.core.checkpoint import find_checkpoint  # noqa: E402
from podgpt.pod.checkpoints import load_model  # noqa: E402
from podgpt.core.tokenizer import load_tokenizer  # noqa: E402
from podgpt.core.util import SCRATCH_MARK, Error, files_under, remove  # noqa: E402

VARIANTS = {"gqa_tied": ["--n_kv_head=2", "--tie_embeddings=True"],
            "mha_untied": ["--n_kv_head=4", "--tie_embeddings=False"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stdlib_data):
    """Two tiny runs of 3 steps, GQA + tied and MHA + untied; {variant: out_dir}."""
    def build(root):
        for name, args in VARIANTS.items():
            with Captured() as captured:
                train_tiny(captured, root / name, stdlib_data, *args, "--total_batch_tokens=256",
                           "--micro_batch_size=4", "--max_steps=3", "--log_every=1", "--eval_every=3",
                           "--ckpt_every=3", "--learning_rate=1e-2", "--seed=7")
    root = shared(tmp_path_factory, "export_runs", build)
    return {name: str(root / name) for name in VARIANTS}


def do_export(capfd, out_dir, dest, *args, check=True):
    """`python export.py` in this process (conftest.run_script: no second torch and transformers to import)."""
    r = run_script(["export.py", f"--ckpt={out_dir}", f"--out={dest}", *args], capfd)
    assert not check or r.returncode == 0, f"export.py exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def hf_model(folder):
    return transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@contextlib.contextmanager
def transformers_warnings():
    """The records transformers logs at WARNING and above meanwhile (its warnings go through logging)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def random_ids(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_and_weights_round_trip(runs, variant, tmp_path, capfd):
    dest = tmp_path / "hf"
    do_export(capfd, runs[variant], dest)
    ckpt = find_checkpoint(runs[variant], "best")
    ours, _ = load_model(ckpt)
    cfg = ours.config
    hf_cfg = json.load(open(dest / "config.json"))
    assert hf_cfg["architectures"] == ["LlamaForCausalLM"]
    assert (hf_cfg["num_key_value_heads"], hf_cfg["tie_word_embeddings"]) == (cfg.n_kv_head, cfg.tie_embeddings)
    assert hf_cfg["vocab_size"] == cfg.vocab_size and hf_cfg["bos_token_id"] == hf_cfg["eos_token_id"] == 256
    assert not (tmp_path / "hf.tmp").exists()

    # AutoModel picks the Llama class from config.json alone
    model = transformers.AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = random_ids(cfg)
    with torch.no_grad():
        theirs = model(ids).logits
        mine, _ = ours(ids)
    assert theirs.shape == mine[..., :cfg.vocab_size].shape
    assert (theirs - mine[..., :cfg.vocab_size]).abs().max().item() < 1e-4

    # the exported tensors read back into podgpt are the checkpoint's, bit for bit
    state = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
    back, _ = export.load_export(dest)
    for name, t in state.items():
        assert back.state_dict()[name].dtype == t.dtype and torch.equal(back.state_dict()[name], t), name
    stored = export.load_export_state(dest)
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)  # a tied head is stored once
    for name, t in stored.items():
        assert torch.equal(t, state[name]), name


def test_wrong_rope_layout_is_caught(runs, tmp_path, capfd):
    """Negative control: q/k rows permuted as if the checkpoint were interleaved (GPT-J style) break parity."""
    dest = tmp_path / "hf"
    do_export(capfd, runs["gqa_tied"], dest)
    ours, _ = load_model(find_checkpoint(runs["gqa_tied"], "best"))
    model = hf_model(dest)
    hd = ours.config.head_dim
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight.view(-1, hd, proj.weight.size(1))
                proj.weight.copy_(w[:, perm].reshape_as(proj.weight))
        ids = random_ids(ours.config)
        diff = (model(ids).logits - ours(ids)[0][..., :ours.config.vocab_size]).abs().max().item()
    assert diff > 1e-3, diff


def test_greedy_generation_matches_sample_py(runs, tmp_path, capfd):
    dest = tmp_path / "hf"
    do_export(capfd, runs["mha_untied"], dest)
    prompt, n = "def main(", 24
    tok = load_tokenizer(export.tokenizer_dir(str(dest)))
    ids = torch.tensor([[tok.bos_id] + tok.encode(prompt)])
    model = hf_model(dest)
    with transformers_warnings() as warned:  # as the model card's generate(ids, max_new_tokens=64): no warning
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert [w.getMessage() for w in warned] == []  # with max_length in generation_config.json: "Both ... set"
    hf_tokens = out[0, ids.size(1):].tolist()
    ours, _ = export.load_export(dest)
    mine = [t.item() for t in ours.generate(ids, n, temperature=0)]
    assert hf_tokens == mine
    assert all(t < tok.vocab_size for t in hf_tokens)  # no padding ids: the export has none
    r = run([sys.executable, "sample.py", f"--ckpt={dest}", f"--prompt={prompt}", "--temperature=0",
             f"--max_new_tokens={n}", "--device=cpu"])
    assert r.stdout == prompt + tok.decode(hf_tokens) + "\n"
    # the checkpoint itself gives the same text
    r2 = run([sys.executable, "sample.py", f"--ckpt={runs['mha_untied']}", f"--prompt={prompt}", "--temperature=0",
              f"--max_new_tokens={n}", "--device=cpu"])
    assert r2.stdout == r.stdout


def test_sharded_export_writes_index_and_loads(runs, tmp_path, capfd):
    dest = tmp_path / "hf"
    do_export(capfd, runs["gqa_tied"], dest, "--max_shard_gb=0.00002", "--dtype=bfloat16")
    index = json.load(open(dest / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (dest / "model.safetensors").exists()
    assert all((dest / s).exists() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]
    from safetensors import safe_open
    with safe_open(str(dest / shards[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert json.load(open(dest / "config.json"))["dtype"] == "bfloat16"
    model = hf_model(dest)
    ours, _ = load_model(find_checkpoint(runs["gqa_tied"], "best"))
    state = export.load_export_state(dest)
    for name, t in state.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ours.state_dict()[name].to(torch.bfloat16))
    ids = random_ids(ours.config)
    with torch.no_grad():
        a, b = model(ids).logits, export.load_export(dest)[0](ids)[0][..., :ours.config.vocab_size]
    assert (a - b).abs().max().item() < 1e-4  # both run the same bf16-rounded weights in fp32
    card = (dest / "README.md").read_text()
    assert "LlamaForCausalLM" in card or "Llama" in card
    assert "tokens seen: 768" in card and "preflight verdict" in card


def test_refusals_leave_nothing(runs, tmp_path, capfd):
    r = do_export(capfd, runs["gqa_tied"], tmp_path / "x", "--dtype=float16", check=False)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == []
    r = do_export(capfd, tmp_path / "nothing", tmp_path / "y", check=False)
    assert r.returncode == 1 and "no checkpoint" in r.stderr
    r = run_script(["export.py", f"--ckpt={runs['gqa_tied']}"], capfd)
    assert r.returncode == 1 and "--out" in r.stderr
    # an architecture Llama cannot express
    ours, cfg = load_model(find_checkpoint(runs["gqa_tied"], "best"))
    with pytest.raises(Error, match="qk_norm.*Llama cannot express") as e:
        export.check_llama(dict(cfg["model"], qk_norm=True), ours.state_dict())
    assert e.value.code == 1
    state = dict(ours.state_dict(), **{"layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    with pytest.raises(Error, match="Llama's layout") as e:
        export.check_llama(cfg["model"], state)
    assert e.value.code == 1
    # a folder that is not an export is never overwritten
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    r = do_export(capfd, runs["gqa_tied"], tmp_path / "keep", check=False)
    assert r.returncode == 1 and (tmp_path / "keep" / "notes.txt").read_text() == "mine"


def test_export_replaces_an_earlier_export_and_nothing_else(runs, tmp_path):
    """An earlier export at --out is replaced whole (its podgpt.json lists its files); a folder beside it
    named like export.py's old temporary folder (out.tmp) is the user's and stays; a file of the user's
    inside an export stops the next one, which leaves it all as it was."""
    dest, mine = tmp_path / "hf", tmp_path / "hf.tmp"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    path = find_checkpoint(runs["gqa_tied"], "best")
    export.export(path, str(dest), max_shard_gb=0.00002)
    sharded = json.load(open(dest / "podgpt.json"))["files"]
    export.export(path, str(dest))  # over the sharded export: one model.safetensors, no shard left over
    listed = json.load(open(dest / "podgpt.json"))["files"]
    assert files_under(dest) == sorted(listed) and "model.safetensors" in listed
    assert any(f.startswith("podgpt_tokenizer/") for f in listed)  # every file by its path, the subfolder's too
    assert "model.safetensors.index.json" in sharded and "model.safetensors.index.json" not in listed
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf.tmp"] and (mine / "notes.txt").read_text() == "mine"
    for notes in ("notes.txt", "podgpt_tokenizer/notes.txt"):  # beside the export's files, or among them
        (dest / notes).write_text("mine too")
        with pytest.raises(Error, match=rf"holds what export.py did not write \({notes}\): not replacing this earlier"):
            export.export(path, str(dest))
        assert files_under(dest) == sorted(listed + [notes])
        (dest / notes).unlink()
    (dest / "podgpt_tokenizer" / "mine").mkdir()  # an empty folder of the user's, which a replacement would take
    with pytest.raises(Error, match=r"did not write \(podgpt_tokenizer/mine/\): not replacing this earlier"):
        export.export(path, str(dest))
    (dest / "podgpt_tokenizer" / "mine").rmdir()
    record = json.load(open(dest / "podgpt.json"))  # an export from before paths were listed: its top-level names
    (dest / "podgpt.json").write_text(json.dumps(dict(record, files=sorted(os.listdir(dest)))))
    export.export(path, str(dest))  # still replaced
    assert files_under(dest) == sorted(listed) and json.load(open(dest / "podgpt.json"))["files"] == listed
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf.tmp"]


def test_exported_files_are_readable_by_all_and_the_checkpoint_is_named_without_its_path(runs, tmp_path):
    """Every file of an export has the mode a new file gets (0644 under umask 022: safetensors writes 0600,
    a private checkpoint's tokenizer files are 0600), the weights sharded too; podgpt.json and the card name
    the checkpoint as run/ckpt/checkpoint, not by the absolute path it was exported from."""
    ckpt = find_checkpoint(runs["gqa_tied"], "best")
    path = tmp_path / "myrun" / "ckpt" / os.path.basename(ckpt)
    shutil.copytree(ckpt, path)
    for name in os.listdir(path):
        os.chmod(path / name, 0o600)  # as a umask of 077 writes them
    dest = tmp_path / "hf"
    umask = os.umask(0o022)
    try:
        export.export(str(path), str(dest), max_shard_gb=0.00002)
    finally:
        os.umask(umask)
    modes = {os.path.relpath(os.path.join(folder, name), dest): os.stat(os.path.join(folder, name)).st_mode & 0o777
             for folder, dirs, files in os.walk(dest) for name in files + dirs}
    assert any(name.endswith(".safetensors") for name in modes) and "podgpt_tokenizer/tokenizer.json" in modes
    assert modes == {name: 0o755 if os.path.isdir(dest / name) else 0o644 for name in modes}
    source = f"myrun/ckpt/{path.name}"
    assert json.load(open(dest / "podgpt.json"))["source"] == source
    assert f"exported from `{source}`" in (dest / "README.md").read_text()
    assert not any(str(tmp_path) in (dest / name).read_text() for name in ("podgpt.json", "README.md"))  # no local path


# ASCII, code, multi-byte characters, and special-token names, which podgpt encodes as plain text
TEXTS = ["Hello world", "def main(argv):\n    return {k: v ** 2 for k, v in argv}  # squares\n\n\tpass\r\n",
         "héllo 世界 — naïve café 😀", "a literal <|endoftext|> and <|bos|> stay text", "  2 spaces, 1234567 digits"]
UNICODE_DOC = "\n".join(["héllo 世界, naïve café — 東京 😀 ünïcödé"] * 3000)


@pytest.fixture(scope="module")
def tokenizer_run(tmp_path_factory):
    """make(spec): the out_dir of a 3-step run on data prepared with that tokenizer (made once per spec); the
    source puts multi-byte text first, so that a bpe learns merges inside characters too (no min_val_tokens: a bpe
    is trained without every document it may hold out)."""
    root = tmp_path_factory.mktemp("tokenizer_runs")
    (root / "unicode.txt").write_text(UNICODE_DOC, encoding="utf-8")
    made = {}

    def make(spec):
        if spec not in made:
            data, out = root / f"data_{spec}".replace(":", "_"), root / f"run_{spec}".replace(":", "_")
            run([sys.executable, "prepare.py", f"--source={root / 'unicode.txt'},stdlib", f"--tokenizer={spec}",
                 f"--data_dir={data}", "--max_docs=100", "--val_fraction=0.1", "--min_val_tokens=0", "--workers=2"])
            with Captured() as captured:
                train_tiny(captured, out, data, "--total_batch_tokens=256", "--micro_batch_size=4",
                           "--max_steps=3", "--eval_every=3", "--ckpt_every=3", "--seed=7")
            made[spec] = str(out)
        return made[spec]
    return make


@pytest.mark.parametrize("spec", ["byte", "bpe:400", "gpt2"])
def test_transformers_tokenizer_encodes_as_podgpt(spec, runs, tokenizer_run, tmp_path, capfd):
    if spec == "gpt2" and not os.environ.get("PODGPT_GPT2_TIKTOKEN"):
        pytest.skip("no gpt2 ranks offline: set PODGPT_GPT2_TIKTOKEN to a gpt2.tiktoken file")
    dest = tmp_path / "hf"
    r = do_export(capfd, runs["gqa_tied"] if spec == "byte" else tokenizer_run(spec), dest)
    assert "note:" not in r.stdout
    ours = load_tokenizer(export.tokenizer_dir(str(dest)))
    assert ours.spec == spec
    hf = transformers.AutoTokenizer.from_pretrained(str(dest))
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf(text, add_special_tokens=False).input_ids == ids, text
        with_bos = hf(text).input_ids
        assert with_bos == [ours.bos_id] + ids, text  # BOS first, as every training document and sample.py
        assert hf.decode(with_bos, skip_special_tokens=True) == text
    if spec.startswith("bpe"):  # merges were learnt and used, inside multi-byte characters too
        assert len(ours.encode(TEXTS[0])) < len(TEXTS[0].encode())
        pieces = [ours.decode_bytes([i]) for i in ours.encode(TEXTS[2])]
        assert any(len(piece) > 1 and max(piece) >= 0x80 for piece in pieces)
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.bos_id)
    assert "encodes exactly as podgpt's tokenizer" in (dest / "README.md").read_text()


def export_files(out, text):
    """What put_in_place moves: a model file and the record listing it."""
    out.mkdir(exist_ok=True)
    (out / "model.safetensors").write_text(text)
    (out / "podgpt.json").write_text(json.dumps({"files": ["model.safetensors", "podgpt.json"]}))


def test_an_export_a_kill_left_marked_is_replaced_and_one_that_cannot_be_put_back_stays_beside(tmp_path, monkeypatch):
    """A kill between put_in_place's rename and the mark's removal leaves --out holding its scratch mark: the next
    export replaces it all the same. When the rename of the new folder and the put-back of the earlier one both
    fail, the earlier export stays whole in the folder beside --out, and the one line says where."""
    out, replace = tmp_path / "x", os.replace
    export_files(out, "killed")
    (out / SCRATCH_MARK).write_text("")

    def export_to_out(text):
        with export.scratch_beside(str(out), "podgpt-export") as tmp:
            export_files(Path(tmp), text)
            export.put_in_place(tmp, str(out))
    export_to_out("the new")
    assert sorted(os.listdir(out)) == ["model.safetensors", "podgpt.json"]
    assert (out / "model.safetensors").read_text() == "the new" and os.listdir(tmp_path) == ["x"]

    def refused_into_out(src, dst):
        if dst == str(out):
            raise OSError("refused")
        replace(src, dst)
    monkeypatch.setattr(os, "replace", refused_into_out)
    aside = tmp_path / ".x.podgpt-old"
    with pytest.raises(Error, match=f"nor the earlier one back \\(OSError: refused\\): the earlier export is in "
                       f"{aside}/old: move it back to {out}"):
        export_to_out("the newest")
    assert os.listdir(tmp_path) == [".x.podgpt-old"] and (aside / SCRATCH_MARK).is_file()
    assert (aside / "old" / "model.safetensors").read_text() == "the new"
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Error, match=f"an earlier export waits in {aside}/old, left by a replace cut short"):
        export_to_out("later")  # the next export over it stops, and leaves it be
    assert (aside / "old" / "model.safetensors").read_text() == "the new" and os.listdir(tmp_path) == [".x.podgpt-old"]


def test_char_tokenizer_gets_no_transformers_tokenizer_but_a_note(tokenizer_run, tmp_path, capfd):
    dest = tmp_path / "hf"
    r = do_export(capfd, tokenizer_run("char"), dest)
    notes = [line for line in r.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "char tokenizer" in notes[0] and "Traceback" not in r.stderr, r.stdout
    assert not (dest / "tokenizer.json").exists() and not (dest / "tokenizer_config.json").exists()
    assert load_tokenizer(export.tokenizer_dir(str(dest))).spec == "char"  # podgpt's own files are there
    card = (dest / "README.md").read_text()
    assert "No transformers tokenizer is included (the char tokenizer" in card and "AutoTokenizer" not in card


def test_a_folder_holding_an_export_record_is_not_podgpts_to_delete_unless_its_files_were_checked(tmp_path):
    # util.remove never takes podgpt.json (or a bundle's record) for its mark: put_in_place replaces an earlier export
    # only after check_replaceable checked every file against it, and a folder that merely holds one stays
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "podgpt.json").write_text("{}")
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(Error, match="podgpt did not make it"):
        remove(str(folder))
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("earlier", [True, False], ids=["over-an-export", "new"])
def test_a_rename_into_place_that_fails_leaves_the_earlier_export_and_nothing_else(tmp_path, monkeypatch, earlier):
    """put_in_place renames the finished folder to --out. When that rename fails, the earlier export is there as it
    was (or nothing, if there was none), and nothing beside it: the new folder held its scratch mark up to the
    rename, so it was podgpt's to remove. (It dropped the mark first and deleted the earlier export before that: a
    failure left neither export, and an unmarked folder that stayed.)"""
    out = tmp_path / "x"
    if earlier:
        out.mkdir()
        (out / "model.safetensors").write_text("the earlier")
        (out / "podgpt.json").write_text(json.dumps({"files": ["model.safetensors", "podgpt.json"]}))
    before = {f: (out / f).read_text() for f in files_under(out)} if earlier else None
    new, replace, marked = tmp_path / ".x.podgpt-export", os.replace, []

    def refused_for_the_new_folder(src, dst):
        if src == str(new):
            marked.append(os.path.isfile(os.path.join(src, SCRATCH_MARK)))
            raise OSError("rename refused")
        replace(src, dst)
    monkeypatch.setattr(os, "replace", refused_for_the_new_folder)
    with pytest.raises(OSError, match="rename refused"):
        with export.scratch_beside(str(out), "podgpt-export") as tmp:
            (new / "model.safetensors").write_text("the new")
            (new / "podgpt.json").write_text(json.dumps({"files": ["model.safetensors", "podgpt.json"]}))
            export.put_in_place(tmp, str(out))
    assert marked == [True]
    assert os.listdir(tmp_path) == (["x"] if earlier else [])
    if earlier:
        assert {f: (out / f).read_text() for f in files_under(out)} == before
