"""
What a run says as it trains: the console's lines, and rank 0's files: metrics.jsonl (the parameter
norm measured at log steps only), each line mirrored to the trackers; clock.json, the guards' time
and spend, which a resume reads back; the spike post-mortem. A write the disk refuses stops the
run in one line saying where it resumes.
"""
import os
import time

import torch

from podgpt.core.util import MAKE_ROOM, disk_full, fail, first_line, format_seconds, log, write_json
from podgpt.pod.report import MetricsFile


def param_norm(model):
    """The L2 norm of all the model's parameters, as clip_gradients takes the gradients': under
    FSDP2 each is a DTensor shard, and full_tensor() all-reduces the squared norms of the shards
    (a collective: every rank calls this, at the same steps). One process and DDP: no collective."""
    norm = torch.nn.utils.get_total_norm([p.detach() for p in model.parameters()])
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


class RunLog:
    """out_dir's running files, on rank 0 alone (master). on_disk(): the newest checkpoint's step
    (-1: none), where a stop on a full disk resumes; model names its objective's stats;
    batch_tokens, flops_tok and peak (the GPUs' bf16 FLOP/s; None: no MFU) measure the speed."""

    def __init__(self, out_dir, step, master, trackers, on_disk, model, batch_tokens, flops_tok,
                 peak):
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
        self.clock_path = os.path.join(out_dir, "clock.json")
        self.metrics = MetricsFile(self.metrics_path, step) if master else None
        self.trackers, self.on_disk, self.model = trackers, on_disk, model
        self.batch_tokens, self.flops_tok, self.peak = batch_tokens, flops_tok, peak
        self.restart(step)

    def restart(self, step):
        """Measure the speed from now and `step` on (a rollback went back to it)."""
        self.t_log, self.step_at_log = time.time(), step

    def objective(self, stats, prefix=""):
        """The objective's numbers by the names it gives them for metrics.jsonl; {} without."""
        return {} if stats is None else self.model.metrics(stats, prefix)

    def step(self, st, loss, lr, grad_norm, stats, mem_gb):
        """A step's metrics line, clock.json and console line: (tokens/s, MFU or None) since the
        last. Called on every rank: the parameter norm may take a collective (rank 0 writes)."""
        now, steps = time.time(), st.step - self.step_at_log
        tok_s = steps * self.batch_tokens / (now - self.t_log)
        mfu = self.flops_tok * tok_s / self.peak if self.peak else None
        eta = (st.horizon - st.step) * (now - self.t_log) / steps
        self.restart(st.step)
        self.write(dict(step=st.step, loss=loss, lr=lr, grad_norm=grad_norm,
                        param_norm=param_norm(self.model), tokens=st.step * self.batch_tokens,
                        tokens_per_sec=tok_s, mfu=mfu, mem_gb=mem_gb, elapsed=st.elapsed,
                        cost_usd=st.cost_usd,
                        **self.objective(stats)))
        self.clock(st)
        log(f"step {st.step}/{st.horizon} | loss {loss:.4f} | lr {lr:.2e} | gnorm {grad_norm:.2f} "
            f"| {tok_s:,.0f} tok/s | mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'} | mem "
            f"{mem_gb:.2f} GB | eta {format_seconds(eta)}{self.console(stats)}", flush=True)
        return tok_s, mfu

    def validation(self, step, val_loss, val_bpb, best, stats, accuracy=None, problems=0):
        """An evaluation's metrics and console lines; accuracy: of `problems` GSM8K answers."""
        self.write(dict(step=step, val_loss=val_loss, val_bpb=val_bpb,
                        tokens=step * self.batch_tokens, **self.objective(stats, "val_"),
                        **({} if accuracy is None else {"gsm8k_accuracy": accuracy})))
        gsm8k = "" if accuracy is None else f" | gsm8k {100 * accuracy:.1f}% of {problems}"
        log(f"step {step} | val loss {val_loss:.4f} | val bpb "
            f"{val_bpb:.4f}{' (best)' if best else ''}{self.console(stats)}{gsm8k}", flush=True)

    def console(self, stats):
        return "" if stats is None else self.model.console(stats)

    def write(self, row):
        """A metrics.jsonl line, and the trackers'."""
        if self.metrics is not None:
            row = self.attempt(self.metrics_path, self.metrics.write, row)
            if self.trackers:
                self.trackers.log(row)

    def clock(self, state):
        if self.metrics is not None:
            self.attempt(self.clock_path, write_json, self.clock_path,
                         dict(elapsed=state.elapsed, cost_usd=state.cost_usd))

    def postmortem(self, postmortem):
        self.attempt(postmortem.path + ".md", postmortem.write)

    def close(self, status, report):
        """metrics.jsonl closed, report() (the run report, read from it), then the trackers: last,
        as a slow one may take its minute, which a preempted pod may not give it."""
        self.metrics.close()
        report()
        if self.trackers:
            self.trackers.close(status)

    def attempt(self, path, write, *args):
        """write(*args); one the disk refuses stops the run (a refused metrics.jsonl write closed
        it: nothing more goes there)."""
        try:
            return write(*args)
        except OSError as e:
            if path == self.metrics_path:
                self.metrics = None
            on_disk = self.on_disk()
            where = (f"it resumes from step {on_disk}" if on_disk >= 0
                     else "it starts over (no checkpoint yet)")
            fail(f"cannot write {path} ({first_line(e)}): "
                 + (f"{MAKE_ROOM}: {where}" if disk_full(e) else "check out_dir's disk"))
