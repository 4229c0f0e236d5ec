"""
The model a run trains: next-token prediction ("ar": model.py's GPT), or an objective of
podgpt/research/, a module each, imported only when a config or checkpoint names it. A research
module gives Config (a GPTConfig with its fields; its config block's keys join train.py's and
sanity.py's), Model (a GPT), maybe check_config(cfg) for its training keys and checks(cfg), the
run's own checks it adds (podgpt/pod/checks.py judges them).
"""
import importlib
from dataclasses import fields

from model import GPT, GPTConfig
from podgpt.core.configurator import research_keys, research_modules


def objective(name):
    """The research module of objective `name`; None for "ar"; ValueError for neither."""
    if name == "ar":
        return None
    if name not in research_modules():
        raise ValueError(f"objective={name!r}: choose one of "
                         f"{', '.join(('ar', *research_modules()))}")
    return importlib.import_module(f"podgpt.research.{name}")


def objective_checks(cfg):
    """[(name, its "lo,hi" band, the metric of Model.metrics judged)] that cfg's objective adds."""
    return getattr(objective(cfg.objective), "checks", lambda cfg: [])(cfg)


def config_class(name):
    return getattr(objective(name), "Config", GPTConfig)  # "ar" (None) has none: GPTConfig


def config_fields(name):
    return [f.name for f in fields(config_class(name)) if f.init]


def make_config(**values):
    """The model config of values["objective"] (default "ar"), a run's or a checkpoint's: ValueError
    for a field of another objective, the dataclass's TypeError for one no model has."""
    name = values.pop("objective", "ar")
    known, owners = config_fields(name), research_keys()
    for key, value in values.items():
        if key in owners and key not in known:
            raise ValueError(f"{key}={value!r} is for objective={owners[key]}, not "
                             f"objective={name}")
    return config_class(name)(**values, **({} if name == "ar" else {"objective": name}))


def make_model(config):
    """A new model of config's objective, initialized."""
    return getattr(objective(config.objective), "Model", GPT)(config)
