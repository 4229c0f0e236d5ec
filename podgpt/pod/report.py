"""The run report (python -m podgpt.pod.report --out_dir=out), from what a run left in its out_dir:
summary.md, metrics.csv (metrics.jsonl as step, name, value; events and nulls left out),
manifest.json (seed, versions, commit, config hash, hardware, dollars) and plots/*.png. train.py
writes metrics.jsonl through MetricsFile, and the report after every evaluation (live=True) and at
the end. A missing or damaged file leaves its part empty: a report never fails a finished run."""

import contextlib
import csv
import hashlib
import importlib
import io
import json
import math
import os
import platform
import subprocess
import sys

from podgpt.core import configurator
from podgpt.core.inputs import read_pointer
from podgpt.core.util import Error, fail, format_seconds, run_main, warn, write_atomic

# --- config
out_dir = "out"  # the run's folder: metrics.jsonl, summary.json, ckpt/ are read, the report written
# --- end config

PLOTS = "plots"  # subfolder of out_dir for the PNGs


# --- reading: each reader gives None (or []) for a missing or unreadable file

def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError):
        return None


def metrics_lines(path):
    """(line number, the line's bytes, its row) for each line of metrics.jsonl; the row is None for
    half a line, damage, or someone else's line. Bytes: a damaged block spoils its line alone."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError too
                row = None
            step = row.get("step") if isinstance(row, dict) else None
            is_row = isinstance(step, int) and not isinstance(step, bool)
            yield line_no, line, row if is_row else None


def read_metrics(path):
    """The metric rows of metrics.jsonl: event rows are not metrics."""
    try:
        return [row for _, _, row in metrics_lines(path) if row is not None and "event" not in row]
    except OSError:
        return []


def not_rows(path, line_nos, fate):
    """Warn of lines of metrics.jsonl that are not rows, saying what becomes of them."""
    lines = ", ".join(map(str, line_nos[:5])) + (" ..." if len(line_nos) > 5 else "")
    warn(f"{path}: {len(line_nos)} line(s) not a metrics row (a JSON object with an integer step), "
         f"line {lines}: {fate}")


def rewrite_metrics(path, last_step):
    """On resume: drop the lines of steps past last_step (trained again) and a torn last line; a
    line that is not one of podgpt's rows is kept byte for byte, with a warning."""
    if not os.path.exists(path):
        return
    kept, foreign = [], []
    for line_no, line, row in metrics_lines(path):
        if not line.endswith(b"\n"):
            continue
        if row is None:
            foreign.append(line_no)
            kept.append(line)
        elif row["step"] <= last_step:
            kept.append(line)
    if foreign:
        not_rows(path, foreign, "kept as they are; the report skips them")
    tmp = path + ".tmp"  # whole file or none, as util.write_atomic, in bytes
    with open(tmp, "wb") as f:
        f.write(b"".join(kept))
    os.replace(tmp, path)


class MetricsFile:
    """metrics.jsonl as rank 0 writes it, appended with os.write: no buffer holds half a line."""

    def __init__(self, path, step):
        if os.path.isdir(path):
            fail(f"{path} is a folder, not the run's metrics file: move it out of the way, then "
                 "rerun")
        rewrite_metrics(path, step)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, row):
        """The row as written, in strict JSON (a non-finite value as null). A write the disk
        refuses is taken back whole (truncating needs no space), the file closed, OSError raised."""
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v
               for k, v in row.items()}
        line, end = memoryview(json.dumps(row).encode() + b"\n"), os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while line:  # a full disk may take part of it before it refuses
                line = line[os.write(self.fd, line):]
        except OSError:
            os.ftruncate(self.fd, end)
            os.close(self.fd)
            raise
        return row

    def close(self):
        os.close(self.fd)


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_config(out_dir):
    """The run's resolved config: config.json of the checkpoint ckpt/latest names, or None."""
    ckpt_root = os.path.join(out_dir, "ckpt")
    try:
        name = read_pointer(os.path.join(ckpt_root, "latest"))
    except Error:  # damaged: the report leaves the part out
        return None
    return read_json(os.path.join(ckpt_root, name, "config.json")) if name else None


# --- metrics.csv and manifest.json

def write_csv(path, rows):
    """(step, name, value) of every numeric field, once: an eval row repeats its step's tokens."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "name", "value"])
    # repr: a float's exact round trip
    w.writerows(dict.fromkeys((row["step"], n, repr(v) if isinstance(v, float) else v)
                              for row in rows for n, v in row.items()
                              if n != "step" and is_number(v)))
    write_atomic(path, buf.getvalue())

def version(module):
    with contextlib.suppress(Exception):  # not installed, or broken: null rather than a guess
        return importlib.import_module(module).__version__


def git_commit():
    with contextlib.suppress(Exception):  # no git, or not a clone: null
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
        return (r.stdout.strip() or None) if r.returncode == 0 else None


def config_hash(config):
    """sha256 of the config in canonical JSON: the same however the config was formatted."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest() if config else None


def cpu_name():
    with contextlib.suppress(OSError):  # not Linux
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or None


def hardware():
    gpus = []
    with contextlib.suppress(Exception):  # no torch, or a broken driver: a manifest without GPUs
        import torch
        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return dict(cpu=cpu_name(), cpu_count=os.cpu_count(), gpus=gpus, gpu_count=len(gpus),
                host=platform.node())


def spent(summary, clock):
    for source in (summary, clock):
        if source and is_number(source.get("cost_usd")):
            return source["cost_usd"]
    return None


def manifest(config, summary, clock):
    config = config or {}
    versions = dict(python=platform.python_version(), torch=version("torch"),
                    numpy=version("numpy"), tiktoken=version("tiktoken"), podgpt=git_commit())
    world_size = (summary or {}).get("world_size", config.get("world_size"))
    return dict(seed=config.get("seed"), versions=versions, config_hash=config_hash(config),
                hardware=hardware(), world_size=world_size, cost_usd=spent(summary, clock))


# --- plots

def field(row, name):
    """A row's field; "hours": its elapsed seconds (resumed time included) in wall-clock hours."""
    if name == "hours":
        return row["elapsed"] / 3600 if is_number(row.get("elapsed")) else None
    return row.get(name)


def series(rows, x, y):
    pts = [(field(r, x), field(r, y)) for r in rows]
    pts = [p for p in pts if is_number(p[0]) and is_number(p[1])]
    return [p[0] for p in pts], [p[1] for p in pts]


def figure_lines(rows, x, ys):
    """[(xs, ys, label)] of a figure's lines that have points: what write_plots draws."""
    return [(xs, vs, label) for y, label in ys for xs, vs in [series(rows, x, y)] if xs]


LOSSES = [("loss", "train"), ("val_loss", "validation")]
# (file, title, x field, [(y field, label)], y label)
FIGURES = [
    ("loss_steps.png", "loss", "step", LOSSES, "loss"),
    ("loss_tokens.png", "loss against tokens", "tokens", LOSSES, "loss"),
    ("grad_norm.png", "gradient norm (before clipping)", "step", [("grad_norm", "grad norm")],
     "norm"),
    ("tokens_per_sec.png", "throughput", "step", [("tokens_per_sec", "tokens/s")], "tokens/s"),
    # the 50M A100 recipe's gradnorm-curve.png and throughput.png
    ("norms.png", "gradient norm (before clipping) and parameter norm", "step",
     [("grad_norm", "grad norm"), ("param_norm", "param norm")], "norm (log scale)"),
    ("tokens_per_sec_hours.png", "throughput against wall-clock time", "hours",
     [("tokens_per_sec", "tokens/s")], "tokens/s"),
    ("lr.png", "learning rate", "step", [("lr", "lr")], "lr"),
    ("memory.png", "peak device memory", "step", [("mem_gb", "memory")], "GB"),
]
LOG_Y = {"norms.png"}  # a grad norm near 1 beside a parameter norm in the hundreds
XLABELS = {"hours": "wall-clock hours (elapsed, resumed time included)"}


def figures(rows):
    """FIGURES, and those of fields some runs write: a refine run's loss of each supervision step
    (sup_loss_<i>), eval_gsm8k_samples' accuracy."""
    steps = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("sup_loss_")})
    ys = [(f"{p}sup_loss_{i}", f"{label} step {i}")
          for p, label in (("", "train"), ("val_", "validation")) for i in steps]
    extra = [("refinement.png", "loss per supervision step", "step", ys, "loss")] if steps else []
    if any("gsm8k_accuracy" in r for r in rows):
        extra.append(("gsm8k_accuracy.png", "GSM8K test problems answered right (greedy)", "step",
                      [("gsm8k_accuracy", "accuracy")], "share right"))
    return FIGURES + extra


def write_plots(out_dir, rows):
    """[(title, relative path)] of the PNGs written, or a string saying why there are none."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on a training node
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a None put in sys.modules
        return (f"plots skipped: matplotlib is not installed ({type(e).__name__}); "
                "pip install matplotlib for them")
    folder = os.path.join(out_dir, PLOTS)
    written = []
    for name, title, x, ys, ylabel in figures(rows):
        lines = figure_lines(rows, x, ys)
        if not lines:
            continue
        # fixed margins, not tight_layout, which measures every label's text at every evaluation
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100,
                               gridspec_kw=dict(left=0.12, right=0.97, top=0.9, bottom=0.13))
        try:
            for xs, vs, label in lines:
                ax.plot(xs, vs, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            ax.set(title=title, xlabel=XLABELS.get(x, x), ylabel=ylabel)
            if name in LOG_Y:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if len(ys) > 1:
                ax.legend()
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, name)
            fig.savefig(path + ".tmp", format="png")  # format: the .tmp suffix would hide it
            os.replace(path + ".tmp", path)
            written.append((title, f"{PLOTS}/{name}"))
        finally:
            plt.close(fig)
    return written


# --- summary.md

def fmt(v, spec=".4f"):
    return "-" if v is None else format(v, spec) if is_number(v) else str(v)


def last(rows, name):
    vals = [r[name] for r in rows if is_number(r.get(name))]
    return vals[-1] if vals else None


def target_verdict(band, status, val_loss):
    """met or missed: the final validation loss (not the best) against target_val_loss's band; not
    reached when the run did not complete (an early stop does); None without a target."""
    if band is None:
        return None
    if status != "completed" or val_loss is None:
        return "not reached"
    low, high = band
    return "met" if (low is None or low <= val_loss) and val_loss <= high else "missed"


def target_text(band):
    """summary.json's target_val_loss, [low or null, high], as train.py's console says it."""
    low, high = band
    return f"at most {high:g}" if low is None else f"{low:g} to {high:g}"


def band_text(band):
    """A check's [lo, hi] as a reader says it: "at most hi", "at least lo", "lo to hi"."""
    lo, hi = band
    return f"at most {hi:g}" if lo is None else f"at least {lo:g}" if hi is None else \
        f"{lo:g} to {hi:g}"


def checks_text(checks, said=()):
    """The done line's part: " | checks: spikes met, mfu missed"; "" without. said: the names the
    line says already."""
    checks = [c for c in checks or () if c["name"] not in said]
    return " | checks: " + ", ".join(f"{c['name']} {c['verdict']}" for c in checks) if checks \
        else ""


def outcome(summary, max_steps, out_dir):
    """train.py's last console line, from summary.json; "" for a failed run: its error says it."""
    s, band = summary, summary["target_val_loss"]
    if s["status"] == "completed":
        why = f"horizon: {s['horizon_by']} pays for {s['horizon']:,} of max_steps={max_steps:,}" \
            if s["stop_reason"] == "horizon" else s["stop_reason"]
        target = f" | target_val_loss {target_text(band)}: {s['target']}" if band else ""
        return (f"done ({why}): {s['steps']} steps in {format_seconds(s['elapsed_s'])} | "
                f"final val loss {s['final_val_loss']:.4f} (best {fmt(s['best_val_loss'])} at step "
                f"{s['best_step']}, unigram baseline {s['unigram_val_loss']:.4f})"
                f"{checks_text(s.get('checks'), ['target_val_loss'])}{target} | "
                f"summary in {out_dir}/summary.json")
    if s["status"] == "stopped":
        signal_name = f" {s['signal']}" if s["stop_reason"] == "signal" else ""
        resume = f"checkpoint {s['checkpoint']}: the same command resumes"
        if s["stop_reason"] == "budget_file_spent":
            resume = "no checkpoint written: already over budget_usd"
        return (f"stopped at step {s['steps']} ({s['stop_reason']}{signal_name}) after "
                f"{format_seconds(s['elapsed_s'])}, ${s['cost_usd']:.2f}"
                f"{checks_text(s.get('checks'))} | {resume}")
    return ""


def preflight_section(preflight):
    """The preflight verdict and the gates that did not pass."""
    lines = ["## preflight", ""]
    if preflight is None:
        return lines + ["no preflight.json", ""]
    lines += [f"verdict: **{preflight.get('verdict', 'unknown')}** "
              f"({preflight.get('profile', '?')} profile)", ""]
    lines += [f"- {g.get('name')}: {g.get('verdict')}: {g.get('detail')}"
              for g in preflight.get("gates") or []
              if isinstance(g, dict) and g.get("verdict") not in ("pass", "skip")]
    return lines + [""]


def gate_section(record):
    """The long-run gate's verdict and each check after the run; its preflight gates are above."""
    lines = ["## long-run gate", ""]
    if not isinstance(record, dict):
        return lines + ["no release gate recorded", ""]
    lines += [f"verdict: **{record.get('verdict')}** ({record.get('profile')} profile)", "",
              "| after the run | verdict | detail |", "|---|---|---|"]
    lines += [f"| {g.get('name')} | {g.get('verdict')} | {g.get('detail')} |"
              for g in record.get("post_run") or []]
    return lines + [""]


def checks_section(checks):
    """The run's own checks (summary.json's `checks`): each band, value and verdict."""
    if not checks:
        return []
    return ["## checks", "", "| check | band | value | verdict |", "|---|---|---|---|",
            *(f"| {c.get('name')} | {band_text(c.get('band'))} | {fmt(c.get('value'), '.4g')} | "
              f"**{c.get('verdict')}** |" for c in checks), ""]


def plots_section(plots):
    lines = ["## plots", ""]
    if isinstance(plots, str):
        lines += [plots, ""]
    elif not plots:
        lines += ["no metric rows to plot", ""]
    else:
        for title, path in plots:
            lines += [f"![{title}]({path})", ""]
    return lines + ["Also here: metrics.csv (every metric as step, name, value), manifest.json "
                    "(versions, config hash, hardware, spend).", ""]


def summary_md(out_dir, summary, clock, preflight, rows, plots):
    s = summary or {}
    elapsed = s.get("elapsed_s", (clock or {}).get("elapsed"))
    mfus = [r["mfu"] for r in rows if is_number(r.get("mfu"))]
    refined = s.get("final_val_refinement", last(rows, "val_refinement"))
    accuracy = last(rows, "gsm8k_accuracy")
    lines = [f"# run report: {os.path.abspath(out_dir)}", ""]
    if summary is None:
        lines += ["No summary.json: the run is still going, or was killed before it ended. "
                  "What follows is from metrics.jsonl and clock.json.", ""]
    lines += [
        "| | |", "|---|---|",
        f"| outcome | {s.get('status', 'unknown')} |",
        f"| stop reason | {s.get('stop_reason', 'unknown')}"
        + (f" ({s['signal']})" if s.get("signal") else "") + " |",
        f"| steps | {fmt(s.get('steps', last(rows, 'step')), 'd')} |",
        f"| tokens | {fmt(s.get('tokens', last(rows, 'tokens')), ',')} |",
        f"| final train loss | {fmt(s.get('final_train_loss', last(rows, 'loss')))} |",
        f"| final val loss | {fmt(s.get('final_val_loss', last(rows, 'val_loss')))} |",
        f"| best val loss | {fmt(s.get('best_val_loss'))} (step {fmt(s.get('best_step'), 'd')}) |",
        *([f"| target val loss | {target_text(s['target_val_loss'])}: **{s.get('target')}** |"]
          if s.get("target_val_loss") else []),
        f"| final val bits per byte | {fmt(s.get('final_val_bpb', last(rows, 'val_bpb')))} |",
        f"| unigram baseline val loss | {fmt(s.get('unigram_val_loss'))} |",
        *([f"| refinement (validation, first to last supervision step) | {fmt(refined, '.1f')}% |"]
          if refined is not None else []),
        *([f"| GSM8K accuracy (last evaluation, greedy) | {fmt(100 * accuracy, '.1f')}% |"]
          if accuracy is not None else []),
        f"| hours | {fmt(elapsed / 3600 if is_number(elapsed) else None, '.3f')} |",
        f"| dollars | {fmt(spent(summary, clock), '.2f')} |",
        # MFU is empty on devices without a known peak (docs/long-runs.md): said, not printed as 0
        "| MFU | " + (f"{mfus[-1]:.1%} last, {sum(mfus) / len(mfus):.1%} mean" if mfus
                      else "- (no known peak for this device)") + " |",
        f"| spikes / non-finite steps / rollbacks | {s.get('spikes', '-')} / "
        f"{s.get('nonfinite_steps', '-')} / {s.get('rollbacks', '-')} |",
        f"| checkpoint (latest, best) | {s.get('checkpoint', '-')}, "
        f"{s.get('best_checkpoint', '-')} |",
        "",
    ]
    lines += checks_section(s.get("checks"))
    lines += preflight_section(preflight)
    lines += gate_section(s.get("long_run_gate")) if summary is not None else []
    return "\n".join(lines + plots_section(plots))


# --- the report

def write_report(out_dir, plots=True, live=False):
    """Write summary.md, metrics.csv, manifest.json and plots/ (plots=True) into out_dir; {file:
    problem}. Never raises: a part that fails is said in summary.md (or on stderr). live: the run
    goes on, so a summary.json is a stopped run's, which the resume replaces: it is left out."""
    problems = {}

    def attempt(name, fn):
        try:
            return fn()
        except Exception as e:
            problems[name] = f"{type(e).__name__}: {e}"
            print(f"report: {name} not written: {problems[name]}", file=sys.stderr)
            return None

    def written(name, text):
        attempt(name, lambda: write_atomic(os.path.join(out_dir, name), text()))

    if not os.path.isdir(out_dir):
        print(f"report: {out_dir} is not a folder", file=sys.stderr)
        return {"out_dir": "missing"}
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    summary = None if live else read_json(os.path.join(out_dir, "summary.json"))
    clock = read_json(os.path.join(out_dir, "clock.json"))
    preflight = read_json(os.path.join(out_dir, "preflight.json"))
    config = attempt("config", lambda: run_config(out_dir))
    attempt("metrics.csv", lambda: write_csv(os.path.join(out_dir, "metrics.csv"), rows))
    written("manifest.json", lambda: json.dumps(manifest(config, summary, clock), indent=1) + "\n")
    if not plots:
        plots = (f"plots not drawn (plots=False): python -m podgpt.pod.report --out_dir={out_dir} "
                 "draws them")
    else:
        plots = attempt("plots", lambda: write_plots(out_dir, rows))
        if plots is None:
            plots = f"plots skipped: {problems.get('plots')}"
    written("summary.md", lambda: summary_md(out_dir, summary, clock, preflight, rows, plots))
    return problems


def main(argv):
    """Exit status 1 when a part of the report could not be written."""
    config = configurator.configure(__file__, argv)
    path = os.path.join(config.out_dir, "metrics.jsonl")
    if not os.path.isfile(path):  # its manifest.json would go over another's
        fail(f"{config.out_dir} holds no metrics.jsonl: not a training run's out_dir; give "
             "--out_dir=<a run's folder>")
    # a torn last line is one a run is writing now, or was killed writing: no warning for it
    damaged = [n for n, line, row in metrics_lines(path) if row is None and line.endswith(b"\n")]
    if damaged:
        not_rows(path, damaged, "the report skips them")
    problems = write_report(config.out_dir)
    failed = f" ({len(problems)} part(s) failed)" if problems else ""
    print(f"report in {config.out_dir}/summary.md{failed}")
    return 1 if problems else 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
