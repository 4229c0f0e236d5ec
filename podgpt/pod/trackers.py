"""Watching a run: with log_to, rank 0 mirrors every metrics.jsonl line, as it writes it, to
TensorBoard, Weights & Biases or MLflow. A tracker that fails never stops training: metrics.jsonl
has every line."""

import importlib.util
import os
import queue
import threading
import time

from podgpt.core.util import fail, first_line, warn, write_json
from podgpt.pod.report import is_number, read_json

TRACKERS = ("tensorboard", "wandb", "mlflow")  # each the name of its package and its pip install


def comma_list(text):
    """The names of a comma-separated setting ("a, b,a" -> ["a", "b"])."""
    return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


def tracker_names(log_to):
    """The trackers log_to names, each known and installed; else one line (util.Error)."""
    names = comma_list(log_to)
    for name in names:
        if name not in TRACKERS:
            fail(f"log_to={log_to!r}: no tracker named {name!r}; name any of "
                 f"{', '.join(TRACKERS)}, comma-separated", 2)
    for name in names:
        # found without importing it: wandb and mlflow take seconds to import
        if importlib.util.find_spec(name) is None:
            fail(f"log_to={name} needs the {name} package, which is not installed: "
                 f"pip install {name} (or leave {name} out of log_to)", 2)
    return names


def tracker_values(row):
    """(step, {name: number}) of a metrics line; an event line as event/<name> = 1 and its numbers
    as event/<name>/<field>: series of their own."""
    event = row.get("event")
    values = {f"event/{event}": 1} if event else {}
    values.update({(f"event/{event}/{k}" if event else k): v
                   for k, v in row.items() if k != "step" and is_number(v)})
    return row["step"], values


class TensorBoard:
    """Event files in out_dir/tensorboard: `tensorboard --logdir out` shows every run under out/. A
    resumed run purges the steps past its checkpoint, which it trains again."""

    def __init__(self, out_dir, name, config, tags, run_id, step):
        from torch.utils.tensorboard import SummaryWriter
        self.id = None
        self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=step or None,
                                    flush_secs=30)
        self.writer.add_text("run", name + (f" (tags: {', '.join(tags)})" if tags else ""), step)
        # indented four spaces: TensorBoard's text tab renders markdown, which would join the lines
        text = "\n".join(f"    {k} = {v!r}" for k, v in config.items())
        self.writer.add_text("config", text, step)

    def log(self, step, values):
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self, status):
        self.writer.close()


class WandB:
    """A Weights & Biases run in wandb_project (WANDB_MODE=offline keeps it in out_dir/wandb for a
    later `wandb sync`). podgpt's step is the x axis, which a resume or a rollback may repeat."""

    def __init__(self, out_dir, name, config, tags, run_id, step):
        import wandb
        self.run = wandb.init(project=config["wandb_project"], name=name, config=dict(config),
                              tags=tags, dir=out_dir, id=run_id, resume="allow")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # wandb's own step may only grow
        self.id = self.run.id

    def log(self, step, values):
        self.run.log(dict(values, step=step))

    def close(self, status):
        self.run.finish(exit_code=0 if status in ("completed", "stopped") else 1)


class MLflow:
    """An MLflow run in mlflow_experiment, at MLFLOW_TRACKING_URI (unset: ./mlflow.db). Through
    MlflowClient: mlflow's module-level calls keep a run per thread, and Trackers has its own."""

    def __init__(self, out_dir, name, config, tags, run_id, step):
        import mlflow
        from mlflow.entities import Metric, Param
        self.client, self.metric = mlflow.MlflowClient(), Metric
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(config["mlflow_experiment"])
            experiment_id = experiment.experiment_id if experiment else \
                self.client.create_experiment(config["mlflow_experiment"])
            run_id = self.client.create_run(experiment_id, run_name=name,
                                            tags={t: "true" for t in tags}).info.run_id
            params = [Param(k, repr(v)) for k, v in config.items()]
            for i in range(0, len(params), 100):  # the server takes at most 100 params a batch
                self.client.log_batch(run_id, params=params[i:i + 100])
        self.id = run_id

    def log(self, step, values):
        ms = int(time.time() * 1000)
        metrics = [self.metric(k, v, ms, step) for k, v in values.items()]
        self.client.log_batch(self.id, metrics=metrics)

    def close(self, status):
        end = {"completed": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.id, end)


class Trackers:
    """Rank 0's mirror of metrics.jsonl to the trackers log_to names, through a queue to a thread
    of their own: a slow tracker never holds a step up. A tracker that fails gets one warning (and
    the next lines: an outage can end). Their run ids go to out_dir/trackers.json, for a resume."""

    CLASSES = dict(tensorboard=TensorBoard, wandb=WandB, mlflow=MLflow)

    def __init__(self, cfg, step):
        path = os.path.join(cfg.out_dir, "trackers.json")
        ids = read_json(path) if step else None  # a run from step 0 is new to the trackers too
        ids = ids if isinstance(ids, dict) else {}
        name, tags = cfg.run_name or cfg.out_dir, comma_list(cfg.run_tags)
        self.live, self.failures = [], {}
        for tracker in tracker_names(cfg.log_to):
            try:
                t = self.CLASSES[tracker](cfg.out_dir, name, cfg, tags, ids.get(tracker), step)
                self.live.append((tracker, t))
            except Exception as e:
                warn(f"log_to: {tracker} did not start ({first_line(e)}); training goes on without "
                     "it (metrics.jsonl has every line)")
        # a tracker that did not start this time keeps its run for the next
        write_json(path, dict(ids, **{tracker: t.id for tracker, t in self.live if t.id}))
        self.queue = queue.Queue()
        self.thread = threading.Thread(target=self.deliver, name="trackers", daemon=True)
        self.thread.start()

    def log(self, row):
        self.queue.put(tracker_values(row))

    def deliver(self):
        while (item := self.queue.get()) is not None:
            for tracker, t in self.live:
                self.attempt(tracker, t.log, *item)

    def attempt(self, tracker, call, *args):
        try:
            call(*args)
        except Exception as e:
            self.failures[tracker] = self.failures.get(tracker, 0) + 1
            if self.failures[tracker] == 1:
                warn(f"log_to: {tracker} failed ({first_line(e)}); training goes on, and so do the "
                     "attempts to reach it")

    def close(self, status, wait=60):
        """Deliver what is queued (waiting at most `wait` seconds) and end the tracker runs."""
        self.queue.put(None)
        self.thread.join(wait)
        if self.thread.is_alive():
            warn(f"log_to: the trackers took more than {wait} s for their last lines; leaving "
                 "without them (metrics.jsonl has every line)")
            return
        for tracker, t in self.live:
            self.attempt(tracker, t.close, status)
        for tracker, n in self.failures.items():
            warn(f"log_to: {n} call(s) to {tracker} failed in this run; metrics.jsonl has every "
                 "line")
