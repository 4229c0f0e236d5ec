"""Watching a run: log_to mirrors every metrics line to TensorBoard, Weights & Biases and MLflow (stand-in
modules that record each call, in place of the packages), a tracker that raises or fails to start never stops
training, a missing package is one line, a resumed run continues the trackers' runs, and the run report is
refreshed at every evaluation. train.py runs in this process (conftest.run_script) so the stand-ins are seen."""
import importlib.machinery
import json
import re
import sys
import types
from collections import namedtuple

import pytest

import train
from podgpt.core.configurator import configure
from conftest import TINY_MODEL, Captured, read_metrics, run_script

RUN = [*TINY_MODEL, "--micro_batch_size=4", "--total_batch_tokens=256", "--log_every=1", "--eval_every=3",
       "--ckpt_every=3", "--inject_spike_at_step=2", "--log_to=tensorboard,wandb,mlflow", "--run_tags=drill,tiny"]


class Outage(Exception):
    pass


def stand_ins(calls, mlflow_down=(), wandb_init_fails=False):
    """{module name: stand-in} for the three trackers' packages. Each call is appended to calls[tracker].
    mlflow_down: the numbers (1-based) of mlflow's metric batches that raise, an outage; wandb_init_fails:
    wandb.init raises, as it does without an API key."""
    for name in ("tensorboard", "wandb", "mlflow"):
        calls.setdefault(name, [])
    tb = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None, flush_secs=120):
            calls["tensorboard"].append(("init", log_dir, purge_step))

        def add_text(self, tag, text, step=None):
            calls["tensorboard"].append(("text", tag, text))

        def add_scalar(self, tag, value, step):
            calls["tensorboard"].append(("scalar", step, tag, value))

        def close(self):
            calls["tensorboard"].append(("close",))

    tb.SummaryWriter = SummaryWriter

    wandb = types.ModuleType("wandb")

    class Run:
        id = "wandb-run-1"

        def define_metric(self, name, step_metric=None):
            calls["wandb"].append(("define_metric", name, step_metric))

        def log(self, data):
            calls["wandb"].append(("log", dict(data)))

        def finish(self, exit_code=0):
            calls["wandb"].append(("finish", exit_code))

    def init(**kw):
        calls["wandb"].append(("init", kw))
        if wandb_init_fails:
            raise Outage("api key not configured (no-tty)")
        return Run()

    wandb.init = init

    mlflow, entities = types.ModuleType("mlflow"), types.ModuleType("mlflow.entities")
    entities.Metric = namedtuple("Metric", "key value timestamp step")
    entities.Param = namedtuple("Param", "key value")
    batches = []

    class MlflowClient:
        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name):
            calls["mlflow"].append(("create_experiment", name))
            return "7"

        def create_run(self, experiment_id, run_name=None, tags=None):
            calls["mlflow"].append(("create_run", experiment_id, run_name, tags))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="mlflow-run-1"))

        def update_run(self, run_id, status=None):
            calls["mlflow"].append(("update_run", run_id, status))

        def log_batch(self, run_id, metrics=(), params=()):
            if metrics:
                batches.append(1)
                if len(batches) in mlflow_down:
                    raise Outage("connection refused")
            calls["mlflow"].append(("log_batch", run_id, list(metrics), list(params)))

        def set_terminated(self, run_id, status):
            calls["mlflow"].append(("set_terminated", run_id, status))

    mlflow.MlflowClient, mlflow.entities = MlflowClient, entities
    modules = {"tensorboard": types.ModuleType("tensorboard"), "torch.utils.tensorboard": tb, "wandb": wandb,
               "mlflow": mlflow, "mlflow.entities": entities}
    for name, module in modules.items():  # a spec, as an imported package has: report.py looks for it
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return modules


def expected_lines(out_dir):
    """[(step, {name: value})] each tracker must get: every metrics line, read back from metrics.jsonl with
    its numbers (nulls, strings and booleans are not numbers to a tracker), an event as event/<name>."""
    lines = []
    for row in read_metrics(out_dir):
        event = row.get("event")
        values = {f"event/{event}": 1} if event else {}
        for k, v in row.items():
            if k != "step" and type(v) in (int, float):
                values[f"event/{event}/{k}" if event else k] = v
        lines.append((row["step"], values))
    return lines


def received(calls, tracker):
    """[(step, {name: value})] in the order the stand-in got them; tensorboard, which takes one value per call:
    [(step, name, value)]."""
    if tracker == "tensorboard":
        return [c[1:] for c in calls["tensorboard"] if c[0] == "scalar"]
    if tracker == "wandb":
        return [(c[1].pop("step"), c[1]) for c in calls["wandb"] if c[0] == "log"]
    return [(c[2][0].step, {m.key: m.value for m in c[2]}) for c in calls["mlflow"] if c[0] == "log_batch" and c[2]]


def one_by_one(lines):
    return [(step, k, v) for step, values in lines for k, v in values.items()]


@pytest.fixture(scope="module")
def watched(tmp_path_factory, stdlib_data):
    """A 6-step run with all three trackers, mlflow down for its 2nd to 4th lines, then the same command
    resumed to 8 steps with wandb failing to start; and the live reports each evaluation wrote."""
    out = tmp_path_factory.mktemp("watched") / "run"
    runs = []
    for max_steps, kw in ((6, dict(mlflow_down=(2, 3, 4))), (8, dict(wandb_init_fails=True))):
        calls, reports = {}, []
        real = train.write_report

        def spy(out_dir, plots=True, live=False):  # the report as each call left it
            problems = real(out_dir, plots, live)
            with open(f"{out_dir}/summary.md") as f:
                reports.append((live, f.read()))
            return problems

        with pytest.MonkeyPatch.context() as mp, Captured() as captured:
            for name, module in stand_ins(calls, **kw).items():
                mp.setitem(sys.modules, name, module)
            mp.setattr(train, "write_report", spy)
            r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *RUN,
                            f"--max_steps={max_steps}"], captured)
        runs.append(types.SimpleNamespace(r=r, calls=calls, reports=reports, rows=read_metrics(out)))
    return str(out), runs


def test_every_metrics_line_reaches_every_tracker_and_an_outage_does_not_stop_training(watched):
    out, (first, _) = watched
    assert first.r.returncode == 0, first.r.stderr
    lines = expected_lines(out)[:len(first.rows)]
    assert any(k.startswith("event/") for _, v in lines for k in v)  # the drill's event lines are among them
    assert any("val_loss" in v for _, v in lines) and any("mfu" in v or "tokens_per_sec" in v for _, v in lines)
    assert received(first.calls, "wandb") == lines
    assert received(first.calls, "tensorboard") == one_by_one(lines)
    # mlflow was down for three lines, kept being tried, and got every other one
    assert received(first.calls, "mlflow") == lines[:1] + lines[4:]
    assert first.r.stderr.count("log_to: mlflow failed (Outage: connection refused)") == 1
    assert "log_to: 3 call(s) to mlflow failed in this run" in first.r.stderr
    assert "Traceback" not in first.r.stderr


def test_the_trackers_get_the_run_name_tags_and_config_and_end_with_it(watched):
    out, (first, _) = watched
    (init,) = [c[1] for c in first.calls["wandb"] if c[0] == "init"]
    assert init["name"] == out and init["tags"] == ["drill", "tiny"] and init["id"] is None
    assert init["config"]["log_to"] == "tensorboard,wandb,mlflow" and init["config"]["max_steps"] == 6
    assert first.calls["wandb"][-1] == ("finish", 0)
    params = {p.key: p.value for c in first.calls["mlflow"] if c[0] == "log_batch" for p in c[3]}
    assert params["max_steps"] == "6" and params["out_dir"] == repr(out) and len(params) == len(train.configure([]))
    assert ("create_run", "7", out, {"drill": "true", "tiny": "true"}) in first.calls["mlflow"]
    assert first.calls["mlflow"][-1] == ("set_terminated", "mlflow-run-1", "FINISHED")
    assert first.calls["tensorboard"][0] == ("init", out + "/tensorboard", None)
    assert first.calls["tensorboard"][-1] == ("close",)


def test_a_resumed_run_continues_the_trackers_runs_and_one_that_cannot_start_is_one_warning(watched):
    out, (first, resumed) = watched
    assert resumed.r.returncode == 0, resumed.r.stderr
    at = int(re.search(r"resumed from \S+ at step (\d+)", resumed.r.stdout).group(1))
    assert at == 6
    assert resumed.calls["tensorboard"][0] == ("init", out + "/tensorboard", 6)  # steps past 6 purged
    assert ("update_run", "mlflow-run-1", "RUNNING") in resumed.calls["mlflow"]
    assert not [c for c in resumed.calls["mlflow"] if c[0] == "create_run"]
    (init,) = [c[1] for c in resumed.calls["wandb"] if c[0] == "init"]
    assert init["id"] == "wandb-run-1"
    warnings = [line for line in resumed.r.stderr.splitlines() if "log_to" in line]
    assert warnings == ["warning: log_to: wandb did not start (Outage: api key not configured (no-tty)); training "
                        "goes on without it (metrics.jsonl has every line)"]
    lines = expected_lines(out)[len(first.rows):]
    assert lines and all(step > 6 for step, _ in lines)
    assert received(resumed.calls, "mlflow") == lines and received(resumed.calls, "tensorboard") == one_by_one(lines)


def test_the_report_is_refreshed_at_every_evaluation(watched):
    out, (first, _) = watched
    evals = [r["val_loss"] for r in first.rows if "val_loss" in r]
    live = [md for is_live, md in first.reports if is_live]
    assert len(evals) == 2 and len(live) == 2
    for val_loss, md in zip(evals, live):
        assert f"| final val loss | {val_loss:.4f} |" in md
        assert "No summary.json: the run is still going" in md
    assert first.reports[-1][0] is False and "| outcome | completed |" in first.reports[-1][1]


def test_a_missing_tracker_package_is_one_line(tmp_path, stdlib_data, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an import of an absent package finds
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path / 'run'}", *TINY_MODEL,
                    "--log_to=wandb"], capfd)
    assert r.returncode == 2
    assert r.stderr == ("error: log_to=wandb needs the wandb package, which is not installed: pip install wandb "
                        "(or leave wandb out of log_to)\n")
    assert not (tmp_path / "run").exists()
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path / 'run'}", "--log_to=wandb,neptune"],
                   capfd)
    assert r.returncode == 2 and r.stderr == ("error: log_to='wandb,neptune': no tracker named 'neptune'; name any of "
                                              "tensorboard, wandb, mlflow, comma-separated\n")


def test_a_start_prints_the_changed_keys_and_one_short_attention_line(watched):
    out, (_, resumed) = watched  # the last start, whose config.json is the one in out_dir
    lines = resumed.r.stdout.splitlines()
    (config,) = [line for line in lines if line.startswith("config: ")]
    with open(f"{out}/config.json") as f:
        saved = json.load(f)
    # (configurator.configure: train.configure would check log_to, which names packages absent here)
    assert saved == configure(train.__file__, [f"--data_dir={saved['data_dir']}", f"--out_dir={out}", *RUN,
                                               "--max_steps=8"])
    defaults = configure(train.__file__, [])
    changed = [f"{k}={v}" for k, v in saved.items() if v != defaults[k]]
    assert config == f"config: {' '.join(changed)} (every key: {out}/config.json)"
    assert "n_kv_head=2" in changed and "log_to=tensorboard,wandb,mlflow" in changed and len(changed) < len(saved) / 2
    (attention,) = [line for line in lines if line.startswith("attention: ")]
    assert f"{out}/preflight.md" in attention and "skipped" not in attention
    assert len(attention.replace(f"{out}/preflight.md", "")) < 120
    with open(f"{out}/preflight.md") as f:
        assert "skipped fa3" in f.read()  # the long reasons, kept there
