"""sanity.py on CPU: every check reported with a status, each kind of check able to fail (exit 1,
one line saying why), the capacity plan of the 1B config, and two ranks under torchrun."""
import json
import sys

import pytest

from conftest import run
from model import ATTENTION_BACKENDS, GPTConfig, memory_estimate

CHECKS = ["environment", "disk", *(f"attention:{name}" for name in (*ATTENTION_BACKENDS, "sdpa", "auto")),
          "attention:doc_mask", "train_step", "kv_cache", "checkpoint", "dataset", "compile", "allreduce", "capacity"]

# run sanity.main after making model.py's attention wrong, its document mask only causal, or its KV cache crash
WRAPPER = "import sys, model\n{patch}\nimport sanity\nraise SystemExit(sanity.main(sys.argv[1:]))\n"
WRONG_SCALE = ("right = model.ATTENTION_KERNELS['math']\n"
               "model.ATTENTION_KERNELS['math'] = lambda *args: 1.5 * right(*args)")
NO_DOCUMENTS = ("model.Documents.dense = lambda self: "
                "model.torch.ones(self.ids.size(1), self.ids.size(1), dtype=model.torch.bool).tril()")
CRASH = ("def crash(*args):\n    raise RuntimeError('cache exploded\\nsecond line')\n"
         "model.KVCache.update = crash")


def sanity(out, *args, script=("sanity.py",), config="config/tiny.py", check=True):
    r = run([sys.executable, *script, config, f"--out_dir={out}", *args], check=check)
    with open(out / "sanity.json") as f:
        report = json.load(f)
    return r, report, {c["name"]: c for c in report["checks"]}, (out / "sanity.md").read_text()


def test_cpu_sanity_passes_and_reports_every_check(tmp_path, stdlib_data):
    r, report, checks, md = sanity(tmp_path, f"--data_dir={stdlib_data}")
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sanity.json", "sanity.md"]  # no checkpoint scratch left


# kind: (arguments, how sanity runs, the check that must fail, what its detail must say)
FAILURES = {
    "disk": (["--min_free_disk_gb=1e9"], ("sanity.py",), "disk", "(need 1e+09)"),
    "dataset": (["--vocab_size=50257"], ("sanity.py",), "dataset", "vocab_size=50257 but"),
    "attention": ([], ("-c", WRAPPER.format(patch=WRONG_SCALE)), "attention:math", "OVER 0.0001"),
    "doc_mask": ([], ("-c", WRAPPER.format(patch=NO_DOCUMENTS)), "attention:doc_mask", "OVER 0.0001"),
    "crash": ([], ("-c", WRAPPER.format(patch=CRASH)), "kv_cache", "RuntimeError: cache exploded"),
}


@pytest.mark.parametrize("kind", FAILURES)
def test_each_kind_of_check_can_fail(tmp_path, stdlib_data, kind):
    args, script, failing, message = FAILURES[kind]
    r, report, checks, md = sanity(tmp_path, f"--data_dir={stdlib_data}", *args, script=script, check=False)
    assert r.returncode == 1 and not report["passed"] and "sanity FAILED" in r.stdout
    assert [n for n, c in checks.items() if c["status"] == "fail"] == [failing]
    assert message in checks[failing]["detail"], checks[failing]
    assert "Traceback" not in r.stdout + r.stderr and "second line" not in checks[failing]["detail"]
    assert md.startswith("# sanity: FAIL") and f"| {failing} | fail |" in md


def test_capacity_on_cpu_plans_the_1b_config(tmp_path):
    r, report, checks, md = sanity(tmp_path, "--capacity", "--compile=False", "--device=cpu", "--gpu_mem_gb=141",
                                   config="config/h200_1b_ddp8.py")
    cap = report["capacity"]
    assert cap["world_size"] == 8  # the config's expect_world_size
    assert checks["capacity"]["status"] == "pass" and "not on a GPU: estimate only" in checks["capacity"]["detail"]
    assert cap["params"]["total"] == pytest.approx(1.124e9, rel=1e-3) and cap["meta_params"] == cap["params"]["total"]
    assert cap["flops_per_token"] == pytest.approx(7.953e9, rel=1e-3) and cap["measured"] is None
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
    assert "## capacity: 1.124B parameters" in md and "| total |" in md and "Not on a GPU" in md
    assert "| fits 0.92 x 141 GB | yes |" in md and "## capacity" in r.stdout  # the table is printed too


def test_capacity_follows_the_runs_dist_mode_and_grad_ckpt(tmp_path):
    """d64 on 8x 80 GB: its config's FSDP + full activation checkpointing fits, plain DDP would not."""
    r, report, checks, md = sanity(tmp_path, "--capacity", "--device=cpu", "--compile=False", "--gpu_mem_gb=80",
                                   config="config/h100_d64.py", check=False)
    cap = report["capacity"]
    run_layout, ddp = cap["layouts"]["run"], cap["layouts"]["ddp"]
    assert run_layout["label"] == "this run: FSDP + grad_ckpt=full" and run_layout["fits"] and not ddp["fits"]
    assert run_layout["bytes"] == cap["layouts"]["sharded_act_ckpt"]["bytes"]
    assert checks["capacity"]["status"] == "pass" and "this run fits gpu_mem_gb=80" in checks["capacity"]["detail"]
    r, report, checks, md = sanity(tmp_path, "--capacity", "--device=cpu", "--compile=False", "--gpu_mem_gb=80", "--dist_mode=ddp",
                                   "--grad_ckpt=none", config="config/h100_d64.py", check=False)
    assert checks["capacity"]["status"] == "fail" and "this run does NOT fit" in checks["capacity"]["detail"]
    assert r.returncode == 1


def test_two_ranks_under_torchrun_check_the_all_reduce(tmp_path):
    r, report, checks, md = sanity(tmp_path, "--allreduce_mb=4",
                                   script=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                           "sanity.py"))
    assert r.returncode == 0 and report["passed"] and report["world_size"] == 2
    assert checks["allreduce"]["status"] == "pass" and "right on 2/2 ranks" in checks["allreduce"]["detail"]
    assert "busbw" in checks["allreduce"]["detail"]
    for rank in report["ranks"]:
        assert rank["passed"] and {c["name"]: c["status"] for c in rank["checks"]}["allreduce"] == "pass"
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1] and "| 1 | pass |" in md
