"""The modules import one way, from the bottom up: util -> attention -> model -> optim, and objectives beside
model (it imports model and attention), data -> checkpoint (which builds models through objectives), preflight
-> train and the other scripts. A module imports only podgpt modules below it (at its top or inside a function),
so each can be read, copied and tested without the ones above it; no script imports train.py's insides."""
import ast
import os

from conftest import ROOT

# each module and the podgpt modules it may import
BELOW = {
    "util": set(),
    "configurator": {"util"},
    "attention": {"util"},
    "model": {"util", "attention"},
    "optim": set(),
    "objectives": {"model", "attention"},
    "data": {"util"},
    "report": {"util", "configurator"},
    "checkpoint": {"util", "model", "objectives", "data"},
    "schedule": {"util"},
    "preflight": {"util", "attention", "model", "data", "schedule"},
    "postmortem": {"util", "configurator", "data"},
    "dryrun": {"util", "report"},
    "tokenizer": {"util"},
    "download": {"util"},
    "tasks": {"util", "data", "tokenizer"},
    "prepare": {"util", "configurator", "data", "download", "tasks", "tokenizer"},
    "export": {"util", "configurator", "model", "objectives", "preflight", "checkpoint", "tokenizer", "report"},
    "serve": {"util", "preflight"},
    "sample": {"util", "configurator", "objectives", "preflight", "checkpoint", "tokenizer", "export", "serve"},
    "sanity": {"util", "configurator", "attention", "model", "objectives", "optim", "data", "checkpoint", "preflight"},
    "train": {"util", "configurator", "attention", "model", "objectives", "optim", "data", "checkpoint", "preflight",
              "schedule", "report", "postmortem", "dryrun", "tasks", "tokenizer"},
}
# bench/'s probes share bench/common.py and may use any module but the scripts' insides
BENCH_MAY_NOT = {"train", "sanity", "sample"}


OURS = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}  # the repo's top-level modules


def podgpt_imports(source):
    """The podgpt modules that this Python source imports anywhere in its code."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & OURS


def imports_of(module):
    with open(os.path.join(ROOT, f"{module}.py")) as f:
        return podgpt_imports(f.read())


def test_the_finder_sees_imports_at_the_top_and_inside_functions():
    source = "import os, util\nfrom model import GPT\ndef f():\n    import data.x\n    from train import main\n"
    assert podgpt_imports(source) == {"util", "model", "data", "train"}


def test_modules_import_only_what_is_below_them():
    for module, allowed in BELOW.items():
        assert imports_of(module) <= allowed, f"{module}.py imports {imports_of(module) - allowed}"


def below(module):
    """Every module that `module` may reach through the imports BELOW allows."""
    seen, todo = set(), list(BELOW[module])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += BELOW[m]
    return seen


def test_every_module_has_its_place_and_the_layers_have_no_cycle():
    assert OURS == set(BELOW), f"place {OURS - set(BELOW)} in BELOW (or drop {set(BELOW) - OURS})"
    for module in BELOW:
        assert module not in below(module), f"{module} may import itself through {below(module)}"
    assert not any("train" in allowed for allowed in BELOW.values())  # train.py's insides stay its own


def test_bench_imports_no_script_insides():
    bench = os.path.join(ROOT, "bench")
    for f in sorted(os.listdir(bench)):
        if f.endswith(".py"):
            with open(os.path.join(bench, f)) as fh:
                wrong = podgpt_imports(fh.read()) & BENCH_MAY_NOT
            assert not wrong, f"bench/{f} imports {wrong}"
