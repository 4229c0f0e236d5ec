"""Preflight: the gates a run passes before any GPU-hour is spent, on the shipped configs (planned
from this CPU, no data) and on real data that is contaminated or mismatched."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from podgpt.pod import preflight as preflight_module
from conftest import ROOT, TINY_MODEL, run_script
from podgpt.core import configurator
from podgpt.core.data import docs_file, document_hashes, load_manifest, open_shard, shared_documents
from podgpt.corpus.shards import write_shard

NO_DATA = "--data_dir=/nonexistent/podgpt-data"  # planned before the data exists (and not inside out_dir)
# the 50M A100 run logs to MLflow, which these tests need not have installed: without it train.py refuses in
# one line (test_a100_50m_is_the_recipes_compile_tracker_and_drill), so they plan it without a tracker
A100_50M = ["config/a100_50m.py", "--log_to="]


def train_py(capfd, *args, check=True):
    """`python train.py args` as its main in this process (conftest.run_script: no torch import per run);
    check: it must exit 0, else its output is shown."""
    r = run_script(["train.py", *args], capfd)
    assert not check or r.returncode == 0, f"train.py exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def preflight(capfd, out, *args, check=False):
    """Preflight planned on this CPU (pinned: a GPU on the machine running the tests changes nothing)."""
    r = train_py(capfd, *args, "--device=cpu", "--preflight_only=True", f"--out_dir={out}", check=check)
    report = json.load(open(os.path.join(out, "preflight.json")))
    assert os.path.exists(os.path.join(out, "preflight.md"))
    return r, report, {g["name"]: g for g in report["gates"]}


def test_d64_fits_only_sharded_with_activation_checkpointing(tmp_path, capfd):
    """The d64 run on 8x H100 80GB: ~13.0B parameters (not the recipe's 4.3B). Its config trains it
    under FSDP with full activation checkpointing, which fits; plain DDP is far over 80 GB per GPU, and
    the gate names the fix."""
    plan = ["config/h100_d64.py", "--gpu_mem_gb=80", "--expect_world_size=8", NO_DATA]
    r, report, gates = preflight(capfd, tmp_path, *plan)
    assert report["plan"]["params"]["total"] == pytest.approx(12.953e9, rel=1e-3)  # SwiGLU hidden 11008
    mem = gates["memory_fit"]
    assert mem["verdict"] == "pass" and mem["value"] < 0.92 * 80e9, mem
    assert mem["detail"].startswith("FSDP + grad_ckpt=full:")
    assert gates["corpus_model_fit"]["verdict"] == "skip"  # no data prepared: said, not guessed
    r, report, gates = preflight(capfd, tmp_path, *plan, "--dist_mode=ddp", "--grad_ckpt=none")
    assert r.returncode == 1 and report["verdict"] == "block"
    mem = gates["memory_fit"]
    assert mem["verdict"] == "block" and mem["value"] > 80e9 and mem["detail"].startswith("DDP:")
    assert "dist_mode=fsdp + grad_ckpt=full across 8 GPUs" in mem["detail"]
    assert report["plan"]["memory_sharded"]["total"] < 0.92 * 80e9 < report["plan"]["memory_ddp"]["total"]


def test_h200_1b_is_its_planned_tokens_and_fits(tmp_path, capfd):
    r, report, gates = preflight(capfd, tmp_path, "config/h200_1b_ddp8.py", "--gpu_mem_gb=141", NO_DATA,
                                 "--planned_mfu=0.4", "--plan_gpu=H200")
    assert r.returncode == 0, r.stdout + r.stderr
    plan = report["plan"]
    assert plan["params"]["total"] == pytest.approx(1.149e9, rel=1e-3)  # SwiGLU hidden 5632
    # the recipe's 22.4B tokens: its ~20 per parameter at hidden 5461 (1.124B), 19.5 at 5632
    assert plan["planned_tokens"] == pytest.approx(22.4e9, rel=1e-3)
    assert plan["planned_tokens"] / plan["params"]["total"] == pytest.approx(19.5, rel=0.01)
    assert gates["memory_fit"]["verdict"] == "pass" and gates["world_size"]["verdict"] == "skip"
    # 8 GPUs at 40% of 989 TFLOP/s, 8.10 GFLOP/token: the hours follow from preflight.py's arithmetic
    assert gates["time_and_cost"]["value"] == pytest.approx(plan["planned_tokens"] / (0.4 * 989e12 * 8 /
                                                            plan["flops_per_token"]) / 3600, rel=1e-6)


def test_a100_50m_non_embedding_and_the_budget_cut(tmp_path, capfd):
    """The 50M A100 run: ~50M non-embedding parameters; at 48% MFU its 84,000 steps overrun the $35 cap, so the
    horizon is what $35 pays for and the schedule ends there; without fit_budget the plan is a block."""
    r, report, gates = preflight(capfd, tmp_path, *A100_50M, "--gpu_mem_gb=80", NO_DATA,
                                 "--planned_mfu=0.48", "--plan_gpu=A100")
    assert report["plan"]["params"]["non_embedding"] == pytest.approx(50.3e6, rel=1e-2)
    horizon = report["plan"]["horizon"]
    assert horizon["by"] == "budget_usd" and 40_000 < horizon["steps"] < 84_000
    assert gates["time_and_cost"]["verdict"] == "pass" and \
        f"budget_usd pays for {horizon['steps']:,} of max_steps=84,000: the horizon" in gates["time_and_cost"]["detail"]
    r, report, gates = preflight(capfd, tmp_path, *A100_50M, "--gpu_mem_gb=80", NO_DATA,
                                 "--planned_mfu=0.48", "--plan_gpu=A100", "--fit_budget=False")
    assert r.returncode == 1 and gates["time_and_cost"]["verdict"] == "block"
    assert f"budget_usd stops it near step {horizon['steps']:,} of 84,000" in gates["time_and_cost"]["detail"]
    r, report, gates = preflight(capfd, tmp_path, *A100_50M, "--gpu_mem_gb=80", NO_DATA,
                                 "--planned_mfu=0.48", "--plan_gpu=A100", "--gate_profile=release")
    assert r.returncode == 1 and gates["compute_optimal_horizon"]["verdict"] == "block"  # 44x Chinchilla


def test_a100_50m_dry_run_budget_prints_its_spend_within_the_cap_and_a_high_spot_price_refuses(tmp_path, capfd):
    """--dry_run_budget on the 50M A100 run: the spend of the horizon $35 pays for, line by line (GPU-hours, the
    200 GB disk, the egress), summing to at most $35, and budget_file's verdict, with no step trained; a spot
    price above max_usd_per_gpu_hour refuses the run in one line before anything is written."""
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps(dict(spent_usd=31.0, projected_total_usd=34.0)))
    out = tmp_path / "out"
    r = train_py(capfd, *A100_50M, NO_DATA, "--device=cpu", "--dry_run_budget=True",
                 f"--out_dir={out}", f"--budget_file={budget}")
    spend = {line.split()[1]: float(line.split("$")[1].split()[0].replace(",", ""))
             for line in r.stdout.splitlines() if line.startswith("spend ")}
    horizon = json.load(open(out / "preflight.json"))["plan"]["horizon"]
    assert horizon["by"] == "budget_usd" and horizon["steps"] < 84_000 and not (out / "ckpt").exists()
    assert spend["GPU"] == pytest.approx(horizon["hours"] * 1.10, abs=0.01)
    assert spend["storage"] == pytest.approx(200 * horizon["hours"] * 0.30 / 730, abs=0.01)
    assert spend["fixed"] == 1.0
    assert spend["total"] == pytest.approx(spend["GPU"] + spend["storage"] + spend["fixed"], abs=0.02)
    assert 34.0 < spend["total"] <= 35.0  # the horizon spends the cap, and no more
    assert "spent $31.00, projected $34.00 of budget_usd=$35.00: the run would warn and go on" in r.stdout
    r = train_py(capfd, *A100_50M, NO_DATA, "--device=cpu", "--dry_run_budget=True",
                 f"--out_dir={tmp_path / 'spot'}", "--usd_per_gpu_hour=1.50", check=False)
    assert r.returncode == 1 and not (tmp_path / "spot").exists()
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert "usd_per_gpu_hour=1.5 is above max_usd_per_gpu_hour=1.4" in line


def test_a100_50m_is_the_recipes_compile_tracker_and_drill(tmp_path, capfd, monkeypatch):
    """The recipe's max-autotune, MLflow and spike drill at step 12,000; without mlflow installed, its preflight is
    one line naming the install, before anything is written."""
    cfg = configurator.configure(os.path.join(ROOT, "train.py"), [os.path.join(ROOT, "config", "a100_50m.py")])
    assert (cfg.compile, cfg.compile_mode, cfg.log_to, cfg.inject_spike_at_step) == (True, "max-autotune", "mlflow",
                                                                                      12000)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an import of an absent package finds
    r = train_py(capfd, "config/a100_50m.py", NO_DATA, "--device=cpu", "--preflight_only=True",
                 f"--out_dir={tmp_path / 'out'}", check=False)
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert r.stderr == ("error: log_to=mlflow needs the mlflow package, which is not installed: pip install mlflow "
                        "(or leave mlflow out of log_to)\n")


def test_predicted_loss_is_chinchillas_fit_against_the_target(tmp_path, capfd):
    """predicted_loss: Hoffmann et al. 2022's approach-3 fit at the plan's parameters (all of them, embeddings
    included) and the horizon's tokens, named with its constants and said to be indicative, in preflight.json and .md. A
    target_val_loss it falls outside of is a warning (the run may start), one it meets passes, none is a skip."""
    plan = [*A100_50M, NO_DATA, "--plan_gpu=A100-SXM4-80GB", "--planned_mfu=0.48"]

    def fit(report):  # at the horizon's tokens: what $35 pays for, or max_steps
        n, d = report["plan"]["params"]["total"], report["plan"]["horizon"]["steps"] * 524288
        return 1.69 + 406.4 / n ** 0.34 + 410.7 / d ** 0.28

    r, report, gates = preflight(capfd, tmp_path, *plan, "--target_val_loss=3.20,3.50")  # the 50M run's band
    loss = gates["predicted_loss"]
    assert r.returncode == 0 and loss["value"] == pytest.approx(fit(report), rel=1e-12) and loss["value"] < 3.2
    assert loss["verdict"] == "warn" and loss["threshold"] == "3.2 to 3.5"
    for words in ("Hoffmann et al. 2022, approach 3", "1.69 + 406.4/N^0.34 + 410.7/D^0.28", "embeddings included",
                  "indicative only", "outside target_val_loss (3.2 to 3.5)"):
        assert words in loss["detail"]
    assert f"| predicted_loss | warn | {loss['value']:.4g} | 3.2 to 3.5 |" in (tmp_path / "preflight.md").read_text()
    r, report, gates = preflight(capfd, tmp_path, *plan, "--max_steps=9500", "--target_val_loss=3.5")  # ~5B tokens
    loss = gates["predicted_loss"]
    assert loss["value"] == pytest.approx(fit(report), rel=1e-12) and loss["verdict"] == "pass"
    assert loss["threshold"] == "at most 3.5" and loss["detail"].endswith("within target_val_loss (at most 3.5)")
    r, report, gates = preflight(capfd, tmp_path, *plan, "--target_val_loss=")  # the config sets the recipe's band
    assert gates["predicted_loss"]["verdict"] == "skip" and gates["predicted_loss"]["value"] == pytest.approx(
        fit(report), rel=1e-12)


TINY = [*TINY_MODEL, "--micro_batch_size=2", "--total_batch_tokens=128", "--max_steps=2", "--eval_every=2"]


def contaminate(src, dst):
    """A copy of the dataset whose first training shard also holds the first validation document, with the
    manifest's contamination count as prepare.py would have written it for such data."""
    shutil.copytree(src, dst)
    manifest = load_manifest(dst)
    val = os.path.join(dst, manifest["splits"]["val"]["shards"][0]["file"])
    val_tokens, val_starts = open_shard(val), np.load(docs_file(val))
    doc = np.asarray(val_tokens[val_starts[0]:val_starts[1]])
    shard = manifest["splits"]["train"]["shards"][0]
    path = os.path.join(dst, shard["file"])
    tokens, starts = np.asarray(open_shard(path)), np.load(docs_file(path))
    write_shard(path, np.concatenate([tokens, doc]), manifest["vocab_size"], manifest["bos_id"],
                np.append(starts, len(tokens)))
    shard["tokens"] += len(doc)
    manifest["splits"]["train"]["tokens"] += len(doc)
    splits = manifest["splits"]
    manifest["contamination"]["train_docs_in_val"] = shared_documents(
        document_hashes(dst, splits["train"]), list(document_hashes(dst, splits["val"])))[0]
    with open(os.path.join(dst, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def test_contamination_blocks_and_allow_unsafe_proceeds(tmp_path, stdlib_data, capfd):
    data = tmp_path / "data"
    contaminate(stdlib_data, data)
    r, report, gates = preflight(capfd, tmp_path / "pf", f"--data_dir={data}", *TINY)
    assert r.returncode == 1 and gates["contamination"]["verdict"] == "block" and gates["contamination"]["value"] == 1
    r = train_py(capfd, f"--data_dir={data}", f"--out_dir={tmp_path}/run", *TINY, check=False)
    assert r.returncode == 1 and "preflight blocks: contamination" in r.stderr
    assert not os.path.exists(tmp_path / "run" / "ckpt")  # nothing trained, nothing written
    r = train_py(capfd, f"--data_dir={data}", f"--out_dir={tmp_path}/run", *TINY, "--allow_unsafe=True")
    assert "warning: preflight gate contamination blocks, allow_unsafe=True goes on" in r.stderr
    assert json.load(open(tmp_path / "run" / "summary.json"))["status"] == "completed"
    assert json.load(open(tmp_path / "run" / "preflight.json"))["verdict"] == "block"


def test_vocabulary_mismatch_blocks(tmp_path, stdlib_data, capfd):
    r, report, gates = preflight(capfd, tmp_path, f"--data_dir={stdlib_data}", *TINY, "--vocab_size=300")
    assert r.returncode == 1 and gates["tokenizer_vocab"]["verdict"] == "block"
    assert "vocab_size=300" in gates["tokenizer_vocab"]["detail"]


def test_clean_data_passes_with_a_measured_time(tmp_path, stdlib_data, capfd):
    r, report, gates = preflight(capfd, tmp_path, f"--data_dir={stdlib_data}", *TINY, check=True)
    assert report["verdict"] in ("pass", "warn")
    assert gates["contamination"]["verdict"] == "pass" and gates["tokenizer_vocab"]["verdict"] == "pass"
    assert "measured here" in gates["time_and_cost"]["detail"] and gates["time_and_cost"]["value"] > 0
    loss = gates["predicted_loss"]  # byte tokens: not the fit's
    assert loss["verdict"] == "skip" and loss["value"] is None and "nats per byte token" in loss["detail"]
    assert not os.path.exists(tmp_path / "ckpt" / "latest")  # a preflight trains nothing


@pytest.mark.parametrize("config", ["config/h200_gsm8k_bd3lm.py", "config/h200_hdp_diffusion.py"])
def test_block_diffusion_configs_fit_an_h200_and_hold_their_lr_rule(tmp_path, capfd, config):
    """Block diffusion on one H200, planned from this CPU before the data exists: the 85M-non-embedding model at
    micro-batch 128 fits (memory.memory_estimate counts both copies of each 512-token row: 67.5 GB with an fp32
    residual stream, 52.5 GB with the bf16 stream residual_dtype=auto gives a bf16 run), 5e-4 at a
    batch of 512 is 0.83x the recipe's rule 3e-4 x sqrt(512 / 128) (a pass), and 3e-4 there is a warning that
    names the rule's rate."""
    plan = [config, "--gpu_mem_gb=141", NO_DATA, "--plan_vocab_size=50257"]
    r, report, gates = preflight(capfd, tmp_path, *plan)
    assert r.returncode == 0 and report["plan"]["params"]["non_embedding"] == 84953856
    assert report["plan"]["flops_per_token"] == 1477734912  # the blocks over 2 x 512 positions per 512 tokens
    assert gates["memory_fit"]["verdict"] == "pass" and round(gates["memory_fit"]["value"] / 1e9, 1) == 52.5
    gates = preflight(capfd, tmp_path, *plan, "--residual_dtype=float32")[2]
    assert gates["memory_fit"]["verdict"] == "pass" and round(gates["memory_fit"]["value"] / 1e9, 1) == 67.5
    assert gates["lr_scaling"]["verdict"] == "pass" and gates["lr_scaling"]["threshold"] == pytest.approx(6e-4)
    r, report, gates = preflight(capfd, tmp_path, *plan, "--learning_rate=3e-4", "--min_lr=3e-5")
    assert gates["lr_scaling"]["verdict"] == "warn"
    assert ("warning: preflight: learning_rate=0.0003 is 0.50x lr_base x sqrt(batch / lr_base_batch) = 0.0003 x "
            "sqrt(512 / 128) = 0.0006: outside 1/1.5..1.5x, set learning_rate=0.0006 (or lr_base=0 to check "
            "nothing)") in r.stderr


def test_checkpoint_disk_names_sizes_in_a_unit_that_shows_them(tmp_path, capfd, monkeypatch):
    """The tiny model's checkpoints are kilobytes, and a nearly full disk has megabytes free: in GB both read
    0.00 and 0.0 (the old line, "0.00 GB = 0.0 GB against 0.0 GB free", said nothing), each in its own unit."""
    monkeypatch.setattr(preflight_module, "free_disk", lambda path: 30_500_000)
    r, report, gates = preflight(capfd, tmp_path, NO_DATA, *TINY, "--plan_vocab_size=257", check=True)
    disk = gates["checkpoint_disk"]
    ckpt_bytes = 12 * report["plan"]["params"]["total"]
    assert 250e3 < ckpt_bytes < 1e6 and disk["verdict"] == "pass"  # 4 of them: megabytes
    assert disk["detail"] == (f"3 + best checkpoints of {ckpt_bytes / 1e3:.1f} kB = {4 * ckpt_bytes / 1e6:.1f} MB "
                              "against 30.5 MB free")
    r, report, gates = preflight(capfd, tmp_path, NO_DATA, *TINY, "--plan_vocab_size=257", "--save_best=False")
    assert gates["checkpoint_disk"]["detail"].startswith(f"3 checkpoints of {ckpt_bytes / 1e3:.1f} kB = ")
