"""report.py on a real (tiny) training run: the files, the plots, metrics.csv against metrics.jsonl, the manifest,
and a machine without matplotlib."""
import csv
import json
import os
import shutil
import sys

import pytest

from conftest import ROOT, Captured, read_metrics, run, shared, train_tiny

PNGS = ["loss_steps.png", "loss_tokens.png", "grad_norm.png", "tokens_per_sec.png", "lr.png", "memory.png",
        "norms.png", "tokens_per_sec_hours.png"]
RUN = ["--max_steps=20", "--log_every=2", "--eval_every=10", "--total_batch_tokens=256", "--micro_batch_size=4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, stdlib_data):
    def build(out):
        with Captured() as captured:
            train_tiny(captured, out, stdlib_data, "--plots=True", *RUN)
    return str(shared(tmp_path_factory, "report_run", build))


@pytest.fixture(scope="module")
def reported(trained):
    r = run([sys.executable, "-m", "podgpt.pod.report", f"--out_dir={trained}"])
    assert "Traceback" not in r.stderr
    return trained


def read(path):
    with open(path) as f:
        return f.read()


def test_files_and_plots(reported):
    for name in ["summary.md", "metrics.csv", "manifest.json"]:
        assert os.path.getsize(os.path.join(reported, name)) > 0
    assert not [f for f in os.listdir(reported) if f.endswith(".tmp")]
    import matplotlib.image
    md = read(os.path.join(reported, "summary.md"))
    for name in PNGS:
        path = os.path.join(reported, "plots", name)
        assert os.path.getsize(path) > 5000, name  # a real figure, not an empty canvas
        img = matplotlib.image.imread(path)
        assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0, name
        assert f"plots/{name}" in md


def test_metrics_csv_round_trips_metrics_jsonl(reported):
    rows = read_metrics(reported)
    expected = {(r["step"], k, float(v)) for r in rows if "event" not in r for k, v in r.items()
                if k != "step" and v is not None and isinstance(v, (int, float)) and not isinstance(v, bool)}
    with open(os.path.join(reported, "metrics.csv")) as f:
        reader = csv.reader(f)
        assert next(reader) == ["step", "name", "value"]
        got = [(int(s), n, float(v)) for s, n, v in reader]
    assert len(got) == len(set(got))
    assert set(got) == expected
    assert {n for _, n, _ in got} >= {"loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "mem_gb", "param_norm"}


def test_param_norm_is_the_checkpointed_models(trained):
    """metrics.jsonl's param_norm at a checkpointed step is the L2 norm of that checkpoint's parameters."""
    import torch
    from podgpt.pod.checkpoints import load_model
    rows = {r["step"]: r for r in read_metrics(trained) if "event" not in r and "loss" in r}
    ckpts = sorted(d for d in os.listdir(os.path.join(trained, "ckpt")) if d.startswith("step_"))
    assert ckpts
    for name in ckpts:
        model, _ = load_model(os.path.join(trained, "ckpt", name))
        norm = torch.sqrt(sum(p.double().square().sum() for p in model.parameters())).item()
        assert rows[int(name.split("_")[1])]["param_norm"] == pytest.approx(norm, rel=1e-5), name


def test_norm_and_throughput_plots_draw_the_metrics(reported):
    """norms.png: grad and param norm against steps; tokens_per_sec_hours.png: tokens/s against elapsed hours."""
    sys.path.insert(0, ROOT)
    from podgpt.pod import report
    rows = [r for r in read_metrics(reported) if "event" not in r and "loss" in r]
    figures = {f[0]: f for f in report.figures(rows)}
    steps = [r["step"] for r in rows]
    _, _, x, ys, _ = figures["norms.png"]
    assert report.figure_lines(rows, x, ys) == [(steps, [r["grad_norm"] for r in rows], "grad norm"),
                                                (steps, [r["param_norm"] for r in rows], "param norm")]
    _, _, x, ys, _ = figures["tokens_per_sec_hours.png"]
    ((hours, tok_s, _),) = report.figure_lines(rows, x, ys)
    assert hours == [r["elapsed"] / 3600 for r in rows] and tok_s == [r["tokens_per_sec"] for r in rows]
    assert "norms.png" in report.LOG_Y


def test_manifest(reported):
    import torch
    m = json.loads(read(os.path.join(reported, "manifest.json")))
    summary = json.loads(read(os.path.join(reported, "summary.json")))
    assert m["seed"] == 1337
    assert m["versions"]["torch"] == torch.__version__
    for lib in ["numpy", "tiktoken", "podgpt"]:
        assert lib in m["versions"]
    if os.path.isdir(os.path.join(ROOT, ".git")):
        assert len(m["versions"]["podgpt"]) == 40
    assert len(m["config_hash"]) == 64
    assert m["world_size"] == 1
    assert m["cost_usd"] == summary["cost_usd"]
    assert {"cpu", "gpus", "gpu_count"} <= set(m["hardware"])


def test_summary_md(reported):
    md = read(os.path.join(reported, "summary.md"))
    summary = json.loads(read(os.path.join(reported, "summary.json")))
    assert summary["stop_reason"] in md and summary["status"] in md
    assert f"{summary['final_val_loss']:.4f}" in md
    assert "preflight" in md and json.loads(read(os.path.join(reported, "preflight.json")))["verdict"] in md


def test_target_val_loss_met_missed_and_not_reached(trained, stdlib_data, tmp_path, capfd):
    """target_val_loss, judged on the final validation loss: summary.json's target_val_loss and target, and one line
    of summary.md. The same command again over (a copy of) the finished run trains no step and evaluates again, to
    the same loss: a target just above it is met, a band below it missed; a resume that max_hours stops before its
    new last step has not reached it."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    final = json.loads(read(out / "summary.json"))["final_val_loss"]
    low, mid, high = round(final - 0.3, 2), round(final - 0.15, 2), round(final + 0.05, 2)
    for args, band, verdict, text in [
            ([f"--target_val_loss={high}"], [None, high], "met", f"at most {high:g}"),
            ([f"--target_val_loss={low},{mid}"], [low, mid], "missed", f"{low:g} to {mid:g}"),
            ([f"--target_val_loss={high}", "--max_steps=40", "--max_hours=1e-6"], [None, high], "not reached",
             f"at most {high:g}")]:
        r = train_tiny(capfd, out, stdlib_data, *RUN, *args)
        summary = json.loads(read(out / "summary.json"))
        assert summary["target_val_loss"] == pytest.approx(band) and summary["target"] == verdict, summary
        assert f"| target val loss | {text}: **{verdict}** |" in read(out / "summary.md")
        if verdict != "not reached":
            assert summary["steps"] == 20 and summary["final_val_loss"] == final
            assert f"target_val_loss {text}: {verdict} | summary in" in r.stdout
        else:
            assert summary["status"] == "stopped" and summary["stop_reason"] == "max_hours"


def test_without_matplotlib(trained, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for name in ["metrics.jsonl", "summary.json", "preflight.json", "clock.json"]:
        (out / name).write_text(read(os.path.join(trained, name)))
    wrapper = tmp_path / "no_mpl.py"
    wrapper.write_text("import sys\nsys.modules['matplotlib'] = None\nsys.path.insert(0, %r)\n"
                       "from podgpt.pod import report\nsys.exit(1 if report.write_report(sys.argv[1]) else 0)\n" % ROOT)
    r = run([sys.executable, str(wrapper), str(out)])
    assert "Traceback" not in r.stderr
    for name in ["summary.md", "metrics.csv", "manifest.json"]:
        assert os.path.getsize(out / name) > 0
    assert not (out / "plots").exists()
    md = (out / "summary.md").read_text()
    assert "plots skipped" in md and "matplotlib" in md
    assert json.loads((out / "manifest.json").read_text())["config_hash"] is None  # no checkpoint copied


def test_never_raises_on_an_empty_or_missing_folder(tmp_path):
    sys.path.insert(0, ROOT)
    from podgpt.pod import report
    assert report.write_report(str(tmp_path)) == {}
    md = (tmp_path / "summary.md").read_text()
    assert "No summary.json" in md
    assert report.write_report(str(tmp_path / "missing"))  # a problem returned, nothing raised


def test_plots_false_draws_none_and_says_how_to_get_them(trained, tmp_path):
    """train.py --plots=False (the tests' tiny runs): the report without plots/, and summary.md says how to draw them."""
    sys.path.insert(0, ROOT)
    from podgpt.pod import report
    for name in ["metrics.jsonl", "summary.json"]:
        (tmp_path / name).write_text(read(os.path.join(trained, name)))
    assert report.write_report(str(tmp_path), plots=False) == {}
    assert not (tmp_path / "plots").exists() and (tmp_path / "metrics.csv").exists()
    assert f"plots not drawn (plots=False): python -m podgpt.pod.report --out_dir={tmp_path} draws them" in read(
        tmp_path / "summary.md")
