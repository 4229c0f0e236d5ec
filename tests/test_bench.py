"""bench/: every probe runs on a CPU at tiny shapes and appends one JSON line (to a temporary file,
never into the repo) with the fields every result carries and figures that add up; --help lists
each probe's keys; bad input is one line and a non-zero exit."""
import gzip
import json
import os
import runpy
import sys
import warnings
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, TORCHRUN, run
from podgpt.core.configurator import read_defaults
from model import GPTConfig
from podgpt.pod.preflight import flops_per_token
from podgpt.pod.memory import memory_estimate, param_counts

PROBES = ("matmul", "attention", "mfu", "memory", "comms", "loader", "vs_hf", "ckpt", "encode")
RUN_PROBES = ("mfu", "memory", "loader", "vs_hf", "ckpt")  # these also take train.py's config files and keys
# config/tiny.py (4 layers, CPU, float32) made smaller still; a vocabulary given, so no data is needed
SHAPE = ["--n_embd=64", "--n_head=4", "--n_kv_head=2", "--block_size=64", "--vocab_size=256"]
TINY = ["config/tiny.py", "--n_layer=2", *SHAPE]
FAST = ["--warmup=1", "--iters=2"]


def in_this_process(capfd, name, *args):
    """`python bench/<name>.py args` run in this process, where torch and the repo are already imported, as
    that command runs it: as __main__ from the repo root, with its sys.argv and sys.orig_argv (the result
    line records the command from these), on one torch thread (conftest.run's OMP_NUM_THREADS=1: two xdist
    workers on two cores, each spinning a thread per core, stall each other). Its exit status and what it
    wrote to file descriptors 1 and 2, a Python warning as a line of stderr (as conftest.run_script)."""
    script = f"bench/{name}.py"
    threads = torch.get_num_threads()
    capfd.readouterr()  # what came before is not the probe's
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught, \
            pytest.raises(SystemExit) as e:
        mp.chdir(ROOT)
        mp.syspath_prepend(os.path.join(ROOT, "bench"))
        mp.setattr(sys, "argv", [script, *args])
        mp.setattr(sys, "orig_argv", [sys.executable, script, *args])
        warnings.simplefilter("always")
        torch.set_num_threads(1)
        try:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        finally:
            torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    err += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    return SimpleNamespace(returncode=e.value.code, stdout=out, stderr=err)


def run_probe(tmp_path, name, *args, launch=(sys.executable,), timeout=600, capfd=None):
    """Run bench/<name>.py into a fresh results file (a new process; with capfd, in_this_process); its one
    JSON line, checked for the fields every result carries (the device's are the caller's to check: this
    file's CPU, tests/test_gpu.py's GPU)."""
    out = tmp_path / f"{name}.jsonl"
    if capfd is None:
        r = run([*launch, f"bench/{name}.py", *args, f"--out={out}"], timeout=timeout)
    else:
        assert launch == (sys.executable,), "a launcher (torchrun) runs its own processes"
        r = in_this_process(capfd, name, *args, f"--out={out}")
        assert r.returncode == 0, f"bench/{name}.py exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    lines = out.read_text().splitlines()
    assert len(lines) == 1, lines
    rec = json.loads(lines[0])
    assert rec["probe"] == name and rec["torch"] == torch.__version__ and rec["cuda"] == torch.version.cuda
    date = datetime.fromisoformat(rec["date"])
    assert date.tzinfo == timezone.utc and abs((datetime.now(timezone.utc) - date).total_seconds()) < 900
    # the command as typed: the interpreter, the script and every argument
    assert rec["command"].startswith(launch[0]) and f"bench/{name}.py" in rec["command"]
    assert all(a in rec["command"] for a in args) and f"--out={out}" in rec["command"]
    assert f"result appended to {out}" in r.stdout
    return rec


def probe(capfd, tmp_path, name, *args, launch=None):
    """A CPU result of bench/<name>.py: run in this process, or under launch (torchrun) in processes of its own."""
    rec = run_probe(tmp_path, name, *args, capfd=capfd) if launch is None else \
        run_probe(tmp_path, name, *args, launch=launch)
    assert rec["device"].startswith("cpu") and rec["driver"] is None
    return rec


def close(a, b):
    return a == pytest.approx(b, rel=1e-9)


def model_of(rec, **changes):
    """The GPTConfig a result line records (padded_vocab is derived), with changes."""
    return GPTConfig(**{k: v for k, v in rec["model"].items() if k != "padded_vocab"} | changes)


def test_matmul(tmp_path, capfd):
    rec = probe(capfd, tmp_path, "matmul", "--device=cpu", "--sizes=64,32x48x16", *FAST)
    assert [(r["m"], r["k"], r["n"]) for r in rec["rows"]] == [(64, 64, 64), (32, 48, 16)]
    assert rec["dtype"] == "float32"
    for r in rec["rows"]:
        assert r["tflops"] > 0 and close(r["tflops"], 2 * r["m"] * r["k"] * r["n"] / (r["ms"] / 1e3) / 1e12)
    assert rec["best_tflops"] == max(r["tflops"] for r in rec["rows"])
    assert rec["peak_tflops"] is None and rec["fraction_of_peak"] is None  # no datasheet peak for a CPU


def test_attention_every_backend_with_and_without_documents(tmp_path, capfd):
    rec = probe(capfd, tmp_path, "attention", "--device=cpu", *FAST)  # the CPU defaults: T 64 and 128, head dim 16
    from podgpt.core import attention
    backends = [*attention.ATTENTION_BACKENDS, "sdpa"]
    assert rec["backends"] == backends
    assert [(r["head_dim"], r["seq_len"], r["doc_mask"], r["backend"]) for r in rec["rows"]] == \
        [(16, T, masked, b) for T in (64, 128) for masked in (False, True) for b in backends]
    for r in rec["rows"]:
        reason = attention.backend_unavailable(r["backend"], "cpu", torch.float32, 16, "documents" if r["doc_mask"] else None)
        assert r["status"] == ("unavailable" if reason else "ok"), r
        if reason:  # reported with attention.py's reason, not dropped
            assert r["reason"] == reason
            continue
        # causal forward 4*B*H*T*T*D / 2, backward 2.5x that
        assert r["batch"] == 256 // r["seq_len"] and r["heads"] == 64 // 16
        flops = 3.5 * 4 * r["batch"] * r["heads"] * r["seq_len"] ** 2 * r["head_dim"] / 2
        assert r["tflops"] > 0 and close(r["tflops"], flops / (r["ms"] / 1e3) / 1e12)
        assert r["useful_tflops"] < r["tflops"] if r["doc_mask"] else r["useful_tflops"] == r["tflops"]
    assert any(r["status"] == "ok" and r["doc_mask"] for r in rec["rows"])  # math and sdpa mask documents on a CPU


def test_mfu_sweep_and_extrapolation_from_two_slices(tmp_path, capfd):
    # a 1-layer slice of tiny.py's 4 layers: measured at 1 and 2 layers, extrapolated to 4
    rec = probe(capfd, tmp_path, "mfu", "config/tiny.py", *SHAPE, "--n_layer=1", "--micro_batches=1,2",
                "--grad_ckpts=none,full", "--ceiling_tflops=0.5", f"--trace={tmp_path / 'traces'}", "--accum=2", *FAST)
    for r in rec["rows"]:  # each point's profiler trace, the training step's ops in it
        events = json.load(gzip.open(r["trace"]))["traceEvents"]
        assert any(e.get("name") == "aten::mm" for e in events) and f"mb{r['micro_batch']}" in r["trace"]
        assert r["kernel_time"] is None  # no GPU kernels to share out
    full = model_of(rec)
    assert (full.n_layer, full.n_embd, full.block_size, full.vocab_size) == (4, 64, 64, 256)
    assert rec["flops_per_token"] == flops_per_token(full) and rec["config"] == ["config/tiny.py"]
    assert [(r["grad_ckpt"], r["n_layer"], r["micro_batch"]) for r in rec["rows"]] == \
        [(g, d, mb) for g in ("none", "full") for d in (1, 2) for mb in (1, 2)]
    for r in rec["rows"]:
        # a step is 2 micro-batches (accum=2), each of micro_batch windows of 64 tokens
        assert r["tokens"] == 2 * r["micro_batch"] * 64 and r["tokens_per_sec"] > 0 and r["step_time_s"] > 0
        assert close(r["tokens_per_sec"], r["tokens"] / r["step_time_s"])
        assert r["mfu"] is None  # no datasheet peak on a CPU: no MFU rather than a wrong one
        fpt = flops_per_token(model_of(rec, n_layer=r["n_layer"]))
        assert close(r["mfu_vs_ceiling"], fpt * r["tokens_per_sec"] / 0.5e12)
        assert r["peak_mem_gb"] > 0 and r["peak_mem_kind"] == "process_peak_rss"
    ext = rec["extrapolation"]
    assert ext["n_layer"] == 4 and ext["depths"] == [1, 2] and len(ext["rows"]) == 4
    rows = {(r["grad_ckpt"], r["micro_batch"], r["n_layer"]): r for r in rec["rows"]}
    for f in ext["rows"]:
        one, two = rows[f["grad_ckpt"], f["micro_batch"], 1], rows[f["grad_ckpt"], f["micro_batch"], 2]
        for key in ("step_time_s", "peak_mem_gb"):  # the line through (1, one) and (2, two), at 4 layers
            assert close(f[f"{key}_per_layer"], two[key] - one[key])
            assert close(f[key], one[key] + 3 * f[f"{key}_per_layer"])
        if f["tokens_per_sec"] is not None:
            assert close(f["tokens_per_sec"], f["tokens"] / f["step_time_s"])
            assert close(f["mfu_vs_ceiling"], rec["flops_per_token"] * f["tokens_per_sec"] / 0.5e12)
        assert f["mfu"] is None
    assert rec["best"] in ext["rows"] or rec["best"] is None


def test_mfu_measures_the_step_of_a_model_fsdp_shards(tmp_path):
    # in a process of its own: it joins a process group (of one, gloo), as train.py's dist_mode=fsdp does; in bf16
    # as bench/speed_table.sh's fsdp row runs it: the shards fp32, gathered in bf16, the stream bf16
    rec = probe(None, tmp_path, "mfu", *TINY, "--micro_batches=2", "--grad_ckpts=none", "--dist_mode=fsdp",
                "--dtype=bfloat16", *FAST, launch=(sys.executable,))
    assert rec["dist_mode"] == "fsdp" and [(r["n_layer"], r["micro_batch"]) for r in rec["rows"]] == [(2, 2), (4, 2)]
    assert all(r["sharded"] for r in rec["rows"])  # its parameters FSDP2's DTensors
    assert all(r["step_time_s"] > 0 and close(r["tokens_per_sec"], r["tokens"] / r["step_time_s"]) for r in rec["rows"])
    for r in rec["rows"]:  # master_weights is for ddp: FSDP2's fp32 shards are the master
        assert (r["optimizer"], r["param_dtype"], r["residual_stream"]) == ("AdamW", "float32", "bfloat16"), r


# each key a flip of train.py's default, and what build() then makes
STEP_KEYS = {"--master_weights=True": ("optimizer", "AdamW", "MasterAdamW"),
             "--fused_loss=False": ("loss_fused", True, False),
             "--residual_dtype=float32": ("residual_stream", "bfloat16", "float32"),
             "--fuse_projections=True": ("projections_fused", False, True)}


@pytest.mark.parametrize("flip", [None, *STEP_KEYS])
def test_mfu_builds_what_a_step_key_asks_for(tmp_path, capfd, flip):
    # bf16 on the CPU (autocast), where master_weights and the bf16 stream apply; read off the built model and
    # optimizer: a key that reached only the JSON leaves the row as the default's
    rec = probe(capfd, tmp_path, "mfu", *TINY, "--dtype=bfloat16", "--micro_batches=1", "--grad_ckpts=none",
                "--warmup=1", "--iters=1", *[flip] * bool(flip))
    want = {field: on if key == flip else off for key, (field, off, on) in STEP_KEYS.items()}
    want["param_dtype"] = "bfloat16" if flip == "--master_weights=True" else "float32"
    for r in rec["rows"]:
        assert {k: r[k] for k in want} == want and r["fp8_linears"] == 0 and r["step_time_s"] > 0
    key, _, value = (flip or "--master_weights=False").removeprefix("--").partition("=")
    assert str(rec[key]) == value  # the line says which setting it measured


def test_memory_predicts_what_model_memory_estimate_says(tmp_path, capfd):
    rec = probe(capfd, tmp_path, "memory", *TINY, "--micro_batches=1,2", "--grad_ckpts=none,full,selective")
    mconfig = model_of(rec)
    assert (mconfig.n_layer, mconfig.n_embd, mconfig.block_size) == (2, 64, 64)
    assert rec["compute_bytes"] == 4 and rec["dtype"] == "float32"  # tiny.py: float32
    assert [(r["grad_ckpt"], r["micro_batch"]) for r in rec["rows"]] == \
        [(g, mb) for g in ("none", "full", "selective") for mb in (1, 2)]
    for r in rec["rows"]:
        assert r["measured_gb"] is None and r["ratio"] is None and r["oom"] is False  # a CPU: predicted only
        want = memory_estimate(mconfig, r["micro_batch"], activation_checkpointing=r["grad_ckpt"], compute_bytes=4)
        assert r["predicted_gb"] == want["total"] / 1e9
        assert r["predicted_parts_gb"]["activations"] == want["activations"] / 1e9


def test_checkpoint_blocks_for_the_copy_and_writes_in_the_background(tmp_path, capfd):
    # a 2-layer slice of tiny.py's 4 layers: its times scaled to 4 layers by the parameters
    scratch = tmp_path / "ckpts"
    rec = probe(capfd, tmp_path, "ckpt", *TINY, "--device=cpu", "--saves=2", f"--write_dir={scratch}")
    slice_, full = model_of(rec), model_of(rec, n_layer=4)
    assert slice_.n_layer == 2 and rec["params"] == param_counts(slice_)["total"]
    assert [(r["mode"], r["save"]) for r in rec["rows"]] == [("async", 1), ("async", 2), ("sync", 1)]
    for r in rec["rows"]:
        # fp32 weights (the tied head once) and AdamW's two moments; config.json, trainer.pt and pickling besides
        assert 12 * rec["params"] <= r["gb"] * 1e9 <= 1.05 * 12 * rec["params"]
        if r["mode"] == "async":  # the loop waits for the copy into memory, not for the disk
            assert 0 < r["blocked_s"] < r["written_s"]
        else:
            assert r["blocked_s"] >= r["written_s"] > 0
    ext, steady = rec["extrapolation"], rec["rows"][1]
    scale = param_counts(full)["total"] / rec["params"]
    assert ext["n_layer"] == 4 and ext["params"] == param_counts(full)["total"]
    assert close(ext["written_s"], steady["written_s"] * scale) and close(ext["blocked_s"], steady["blocked_s"] * scale)
    assert close(ext["sync_s"], rec["rows"][2]["written_s"] * scale) and close(ext["gb"], steady["gb"] * scale)
    assert not scratch.exists()  # the probe's checkpoints are removed


def test_comms_two_ranks_under_torchrun(tmp_path):
    rec = probe(None, tmp_path, "comms", "--device=cpu", "--sizes=1024,65536", *FAST, launch=TORCHRUN)
    assert rec["backend"] == "gloo" and rec["world_size"] == 2 and "--nproc_per_node=2" in rec["command"]
    assert [r["bytes"] for r in rec["rows"]] == [1024, 65536]
    for r in rec["rows"]:
        assert r["us"] > 0 and close(r["algbw_gbps"], r["bytes"] / (r["us"] / 1e6) / 1e9)
        assert close(r["busbw_gbps"], r["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert rec["best_busbw_gbps"] == max(r["busbw_gbps"] for r in rec["rows"])


def test_loader_against_the_gpu_rate(tmp_path, stdlib_data, capfd):
    rec = probe(capfd, tmp_path, "loader", f"--data_dir={stdlib_data}", "--block_size=64", "--micro_batch_size=4",
                "--device=cpu", "--gpu_tokens_per_sec=1000", "--iters=20")
    assert rec["data_dir"] == stdlib_data and rec["tokenizer"] == "byte" and rec["windows"] > 0
    assert (rec["micro_batch"], rec["block_size"]) == (4, 64)
    assert rec["tokens_per_sec"] > 0 and close(rec["tokens_per_sec"], 4 * 64 / (rec["batch_ms"] / 1e3))
    assert close(rec["headroom"], rec["tokens_per_sec"] / 1000)


def test_encode_a_worker_process_against_the_raw_tokenizer(tmp_path, capfd):
    """Text enough (~6 MB) and the best of two, so that encoding outlasts a pool's start on a loaded machine
    (0.9 MB once did not: 0.17 s to start, on a 2-core CI machine running the suite)."""
    rec = probe(capfd, tmp_path, "encode", "--tokenizer=char", "--max_docs=400", "--iters=2")
    from podgpt.corpus import sources
    texts = [text for text, _ in sources.documents(sources.resolve_sources("stdlib", 0, "", False)[0], "text", 0, 400,
                                                   "downloads", "")]
    assert rec["tokenizer"] == "char" and rec["docs"] == 400 and rec["source"].startswith("stdlib")
    assert close(rec["mb"], sum(len(t.encode()) for t in texts) / 1e6)
    assert rec["raw_mb_per_sec"] > 0 and 0 < rec["start_s"] < rec["mb"] / rec["worker_mb_per_sec"]
    assert close(rec["steady_mb_per_sec"], rec["mb"] / (rec["mb"] / rec["worker_mb_per_sec"] - rec["start_s"]))
    assert close(rec["fraction"], rec["steady_mb_per_sec"] / rec["raw_mb_per_sec"])
    assert close(rec["parent_mb_per_sec"], rec["mb"] / (rec["read_s"] + rec["write_s"]))
    assert close(rec["workers_fed"], rec["parent_mb_per_sec"] / rec["steady_mb_per_sec"])


def test_vs_hf_same_shape_both_timed(tmp_path, capfd):
    pytest.importorskip("transformers")
    rec = probe(capfd, tmp_path, "vs_hf", *TINY, "--micro_batch_size=2", "--windows=2", *FAST)
    assert rec["params_ours"] == rec["params_hf"]  # the Llama mapping builds the same model
    assert rec["model"]["attn_backend"] == "sdpa" and rec["compile"] is False
    assert [len(v) for v in rec["per_window"].values()] == [2, 2]
    assert rec["ours_tokens_per_sec"] > 0 and rec["hf_tokens_per_sec"] > 0
    assert close(rec["ratio"], rec["ours_tokens_per_sec"] / rec["hf_tokens_per_sec"])


def in_process(monkeypatch, capsys, name, *args):
    """(exit status, stdout, stderr) of bench/<name>.py run in this process, where torch and the repo are
    already imported: --help and input checks in milliseconds rather than a new interpreter each."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, "bench", f"{name}.py"), run_name="__main__")
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("name", PROBES)
def test_help_lists_every_key(monkeypatch, capsys, name):
    code, out, _ = in_process(monkeypatch, capsys, name, "--help")
    assert code == 0
    keys = read_defaults(os.path.join(ROOT, "bench", f"{name}.py"))
    for key in keys:
        assert f"--{key} " in out
    assert ("train.py" in out) == (name in RUN_PROBES)
    if name in RUN_PROBES:  # its own keys and train.py's are told apart by name
        assert not set(keys) & set(read_defaults(os.path.join(ROOT, "train.py")))


@pytest.mark.parametrize("args, says", [
    (["mfu", *TINY, "--micro_batches=1,x"], "micro_batches='1,x' is not a comma-separated list"),
    (["mfu", *TINY, "--grad_ckpts=none,partial"], "grad_ckpts='none,partial'"),
    (["mfu", *TINY, "--fp8=True"], "fp8=True trains on a CUDA GPU with float8 tensor cores; this is cpu: set fp8=False"),
    (["memory", "config/nonexistent.py"], "config file 'config/nonexistent.py' not found"),
    (["memory", "config/tiny.py", "--micro_batchs=2"], "unknown key 'micro_batchs'"),
    (["matmul", "--sizes=64x64"], "sizes: '64x64' is neither N nor MxKxN"),
    (["attention", "--backends=fa5"], "backends: fa5 not offered by attention.py"),
    (["loader", "--data_dir=/nonexistent"], "no manifest.json in /nonexistent"),
    (["comms"], "run it under torchrun"),
    (["encode", "--source=/nonexistent"], "source '/nonexistent' is not stdlib, a preset"),
    (["ckpt", *TINY, "--saves=0"], "saves=0 must be positive")])
def test_bad_input_is_one_line_and_a_failure(monkeypatch, capsys, tmp_path, args, says):
    code, _, err = in_process(monkeypatch, capsys, *args, f"--out={tmp_path / 'never.jsonl'}")
    assert code != 0 and err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "never.jsonl").exists()


def test_a_bad_input_from_the_command_line():
    r = run([sys.executable, "bench/mfu.py", *TINY, "--micro_batches=0"], check=False)
    assert r.returncode != 0 and r.stderr.strip() == ("error: micro_batches='0' is not a comma-separated list of "
                                                      "positive integers: write e.g. --micro_batches=1,2,4,8")
