"""The modules import one way, from the bottom up: util -> model, data -> checkpoint, preflight -> train
and the other scripts. A module imports only podgpt modules below it (at its top or inside a function),
so each can be read, copied and tested without the ones above it; no script imports train.py's insides."""
import ast
import os

from conftest import ROOT

# each module and the podgpt modules it may import
BELOW = {
    "util": set(),
    "configurator": {"util"},
    "model": {"util"},
    "data": {"util"},
    "report": {"util", "configurator"},
    "checkpoint": {"util", "model", "data"},
    "preflight": {"util", "model", "data"},
    "prepare": {"util", "configurator", "data"},
    "export": {"util", "configurator", "model", "checkpoint", "prepare", "report"},
    "serve": {"util", "model"},
    "sample": {"util", "configurator", "model", "checkpoint", "prepare", "export", "serve"},
    "sanity": {"util", "configurator", "model", "data", "checkpoint", "preflight"},
    # train.py evaluates GSM8K answers (eval_gsm8k_samples) with prepare.py's tokenizer and its reading of the
    # format prepare.py writes; prepare.py imports nothing of train's
    "train": {"util", "configurator", "model", "data", "checkpoint", "preflight", "report", "prepare"},
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
