"""sanity.py on CPU: every check reported with a status, each kind of check able to fail (exit 1,
one line saying why), the capacity plan of the 1B config, and two ranks under torchrun."""
import json
from types import SimpleNamespace

import pytest
import torch

from podgpt.core import configurator
from podgpt.core import attention
import model
import sanity as sanity_script
from conftest import TORCHRUN, run, run_script
from podgpt.core.attention import ATTENTION_BACKENDS
from model import GPTConfig
from podgpt.pod.memory import memory_estimate

CHECKS = ["environment", "disk", *(f"attention:{name}" for name in (*ATTENTION_BACKENDS, "sdpa", "auto")),
          "attention:doc_mask", "train_step", "kv_cache", "checkpoint", "dataset", "compile", "allreduce", "capacity"]


# sanity.main run after making attention.py's attention wrong, its document mask only causal, or its KV cache crash
def wrong_scale(monkeypatch):
    right = attention.ATTENTION_KERNELS["math"]
    monkeypatch.setitem(attention.ATTENTION_KERNELS, "math", lambda *args: 1.5 * right(*args))


def no_documents(monkeypatch):
    monkeypatch.setattr(attention.Documents, "dense",
                        lambda self: torch.ones(self.ids.size(1), self.ids.size(1), dtype=torch.bool).tril())


def crash(monkeypatch):
    def exploded(*args):
        raise RuntimeError("cache exploded\nsecond line")
    monkeypatch.setattr(model.KVCache, "update", exploded)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """sanity.py's main runs in this process (conftest.run_script) with attention.py's cache of resolved attention
    backends empty, as in a new interpreter (its patches above reach what auto resolves, and nothing resolved
    under them stays)."""
    monkeypatch.setattr(attention, "resolved", {})


def read_report(out):
    with open(out / "sanity.json") as f:
        report = json.load(f)
    return report, {c["name"]: c for c in report["checks"]}, (out / "sanity.md").read_text()


def sanity(capfd, out, *args, config="config/tiny.py", check=True):
    """`python sanity.py config --out_dir=out args`, as its main in this process: (the run, its report, its
    checks by name, sanity.md); check: it must exit 0, else its output is shown."""
    r = run_script(["sanity.py", config, f"--out_dir={out}", *args], capfd)
    assert not check or r.returncode == 0, f"sanity.py exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return (r, *read_report(out))


def test_cpu_sanity_passes_and_reports_every_check(tmp_path, stdlib_data, capfd):
    r, report, checks, md = sanity(capfd, tmp_path, f"--data_dir={stdlib_data}")
    assert r.returncode == 0 and report["passed"] and "sanity passed" in r.stdout
    assert list(checks) == CHECKS
    for c in checks.values():
        assert c["status"] in ("pass", "fail", "skip") and c["detail"] and c["seconds"] >= 0
        assert f"| {c['name']} | {c['status']} |" in md
    # what a CPU has passes; what needs CUDA, a package, torchrun or an option is skipped, saying why
    for name in ("environment", "disk", "attention:sdpa", "attention:math", "attention:flash", "attention:auto",
                 "attention:doc_mask", "train_step", "kv_cache", "checkpoint", "dataset"):
        assert checks[name]["status"] == "pass", checks[name]
    assert "CUDA only" in checks["attention:efficient"]["detail"] and checks["attention:efficient"]["status"] == "skip"
    assert "not installed" in checks["attention:fa3"]["detail"] and "no backward" in checks["attention:flex"]["detail"]
    assert "auto: flash" in checks["attention:auto"]["detail"]
    assert "compile=False" in checks["compile"]["detail"] and "torchrun" in checks["allreduce"]["detail"]
    assert checks["capacity"]["status"] == "skip" and report["capacity"] is None
    assert "257 tokens" in checks["dataset"]["detail"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".podgpt", "sanity.json", "sanity.md"]  # no scratch left


# kind: (arguments, the patch model.py runs under, the check that must fail, what its detail must say)
FAILURES = {
    "disk": (["--min_free_disk_gb=1e9"], None, "disk", "(need 1e+09)"),
    "dataset": (["--vocab_size=50257"], None, "dataset", "vocab_size=50257 but"),
    "attention": ([], wrong_scale, "attention:math", "OVER 0.0001"),
    "doc_mask": ([], no_documents, "attention:doc_mask", "OVER 0.0001"),
    "crash": ([], crash, "kv_cache", "RuntimeError: cache exploded"),
}


@pytest.mark.parametrize("kind", FAILURES)
def test_each_kind_of_check_can_fail(tmp_path, stdlib_data, kind, monkeypatch, capfd):
    args, patch, failing, message = FAILURES[kind]
    if patch:
        patch(monkeypatch)
    r, report, checks, md = sanity(capfd, tmp_path, f"--data_dir={stdlib_data}", *args, check=False)
    assert r.returncode == 1 and not report["passed"] and "sanity FAILED" in r.stdout
    assert [n for n, c in checks.items() if c["status"] == "fail"] == [failing]
    assert message in checks[failing]["detail"], checks[failing]
    assert "Traceback" not in r.stdout + r.stderr and "second line" not in checks[failing]["detail"]
    assert md.startswith("# sanity: FAIL") and f"| {failing} | fail |" in md


def test_capacity_on_cpu_plans_the_1b_config(tmp_path, capfd):
    r, report, checks, md = sanity(capfd, tmp_path, "--capacity", "--compile=False", "--device=cpu", "--gpu_mem_gb=141",
                                   config="config/h200_1b_ddp8.py")
    cap = report["capacity"]
    assert cap["world_size"] == 8  # the config's expect_world_size
    assert checks["capacity"]["status"] == "pass" and "not on a GPU: estimate only" in checks["capacity"]["detail"]
    assert cap["params"]["total"] == pytest.approx(1.149e9, rel=1e-3) and cap["meta_params"] == cap["params"]["total"]
    assert cap["flops_per_token"] == pytest.approx(8.104e9, rel=1e-3) and cap["measured"] is None
    assert cap["model"]["vocab_size"] == 32768 and cap["compute_dtype"] == "bfloat16"
    config = GPTConfig(vocab_size=32768, block_size=2048, n_layer=24, n_head=16, n_kv_head=4, n_embd=2048)
    for key, sharded, ckpt in (("ddp", False, False), ("ddp_act_ckpt", False, True), ("sharded", True, False),
                               ("sharded_act_ckpt", True, True)):
        est = memory_estimate(config, 16, world_size=8, sharded=sharded, activation_checkpointing=ckpt)
        layout = cap["layouts"][key]
        assert layout["bytes"] == {k: v for k, v in est.items() if k != "params"}
        assert layout["gb"]["total"] == pytest.approx(est["total"] / 1e9, abs=1e-3)
        usable = 0.92 * 141e9  # train.py's MEMORY_USABLE share, the same as the preflight's memory_fit
        assert layout["fits"] == (est["total"] <= usable)
        assert memory_estimate(config, layout["largest_micro_batch"], 8, sharded, ckpt)["total"] <= usable
        assert memory_estimate(config, layout["largest_micro_batch"] + 1, 8, sharded, ckpt)["total"] > usable
    assert cap["layouts"]["ddp"]["bytes"]["ddp_buckets"] == 4 * cap["params"]["total"]
    assert cap["layouts"]["run"]["label"] == "this run: DDP" and cap["layouts"]["run"]["bytes"] == \
        cap["layouts"]["ddp"]["bytes"]
    assert "## capacity: 1.149B parameters" in md and "| total |" in md and "Not on a GPU" in md
    assert "| fits 0.92 x 141 GB | yes |" in md and "## capacity" in r.stdout  # the table is printed too


def test_capacity_follows_the_runs_dist_mode_and_grad_ckpt(tmp_path, capfd):
    """d64 on 8x 80 GB: its config's FSDP + full activation checkpointing fits, plain DDP would not."""
    r, report, checks, md = sanity(capfd, tmp_path, "--capacity", "--device=cpu", "--compile=False", "--gpu_mem_gb=80",
                                   config="config/h100_d64.py", check=False)
    cap = report["capacity"]
    run_layout, ddp = cap["layouts"]["run"], cap["layouts"]["ddp"]
    assert run_layout["label"] == "this run: FSDP + grad_ckpt=full" and run_layout["fits"] and not ddp["fits"]
    assert run_layout["bytes"] == cap["layouts"]["sharded_act_ckpt"]["bytes"]
    assert checks["capacity"]["status"] == "pass" and "this run fits gpu_mem_gb=80" in checks["capacity"]["detail"]
    r, report, checks, md = sanity(capfd, tmp_path, "--capacity", "--device=cpu", "--compile=False", "--gpu_mem_gb=80",
                                   "--dist_mode=ddp", "--grad_ckpt=none", config="config/h100_d64.py", check=False)
    assert checks["capacity"]["status"] == "fail" and "this run does NOT fit" in checks["capacity"]["detail"]
    assert r.returncode == 1


def test_measured_capacity_says_the_largest_micro_batch_in_the_same_words_everywhere(monkeypatch):
    """What a GPU measures, as sanity reports it: the check's line and sanity.md name the largest micro-batch that
    fits in largest_fits' words, which the GPU tier asserts on a real measurement. The GPU (its memory, its name,
    and the measurement itself) is stood in for; the plan and both reports are sanity's own code."""
    cfg = configurator.configure(sanity_script.__file__, ["config/tiny.py", "--capacity=True", "--vocab_size=257"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "Test GPU")
    for peak, largest, status in ((3e9, 900, "pass"), (None, 12, "fail")):  # micro-batch 16 fits, then does not
        monkeypatch.setattr(sanity_script, "measure_capacity", lambda *args, m=(peak, largest): m)
        out = {}
        got, detail = sanity_script.check_capacity(cfg, torch.device("cuda"), torch.bfloat16, 1, out)
        words = sanity_script.largest_fits(out["measured"])
        assert got == status and words.startswith(f"the largest micro-batch that fits is {largest} (predicted ")
        assert words in detail and ("measured on Test GPU" if peak else "does NOT fit on Test GPU") in detail, detail
        assert words in "\n".join(sanity_script.capacity_lines(out)), sanity_script.capacity_lines(out)


def test_capacity_of_a_sharded_model_one_gpu_cannot_hold_is_the_plans(monkeypatch):
    """d64 on an 80 GB GPU: its whole weights, gradients and AdamW state cannot be built on one GPU to measure,
    but the run shards them over 8 (fsdp): the plan decides, pass, where a fail stopped run.sh's sanity stage for
    a model that fits. Under ddp each GPU would hold them all: a fail, as before. The GPU is stood in for."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(sanity_script, "measure_capacity", lambda *args: pytest.fail("measured"))
    for extra, status, words in (([], "pass", "by the plan this run fits"),
                                 (["--dist_mode=ddp", "--grad_ckpt=none"], "fail", "not measured")):
        cfg = configurator.configure(sanity_script.__file__, ["config/h100_d64.py", "--capacity=True", *extra])
        got, detail = sanity_script.check_capacity(cfg, torch.device("cuda"), torch.bfloat16, 8, {})
        assert got == status and "over this GPU's 80.0: not measured" in detail and words in detail, detail


def test_two_ranks_under_torchrun_check_the_all_reduce(tmp_path):
    # torchrun: two processes of their own
    r = run([*TORCHRUN, "sanity.py", "config/tiny.py", f"--out_dir={tmp_path}", "--allreduce_mb=4"])
    report, checks, md = read_report(tmp_path)
    assert r.returncode == 0 and report["passed"] and report["world_size"] == 2
    assert checks["allreduce"]["status"] == "pass" and "right on 2/2 ranks" in checks["allreduce"]["detail"]
    assert "busbw" in checks["allreduce"]["detail"]
    for rank in report["ranks"]:
        assert rank["passed"] and {c["name"]: c["status"] for c in rank["checks"]}["allreduce"] == "pass"
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1] and "| 1 | pass |" in md
