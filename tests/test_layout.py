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
    "optim": {"util"},
    "objectives": {"model", "attention"},
    "data": {"util"},
    "report": {"util", "configurator"},
    "checkpoint": {"util", "model", "objectives", "data", "tokenizer"},
    "schedule": {"util"},
    "gates": {"util", "report", "download", "checkpoint", "tasks", "tokenizer"},  # checkpoint: the base checkpoint's tokens, read
    "preflight": {"util", "attention", "model", "data", "schedule", "gates"},
    "postmortem": {"util", "configurator", "data"},
    "dryrun": {"util", "report"},
    "tokenizer": {"util"},
    "ngrams": {"download", "tasks", "tokenizer"},
    "download": {"util"},
    "tasks": {"util", "data", "download", "tokenizer"},
    "holdout": {"data"},
    "sources": {"util", "download", "tasks"},
    "prepare": {"util", "configurator", "data", "download", "sources", "tokenizer", "checkpoint", "ngrams", "holdout"},
    "skills": {"util", "configurator", "download", "tasks", "tokenizer", "ngrams", "sources"},  # sources: the gsm8k preset's files, read
    "hf": {"util", "model", "objectives", "preflight", "checkpoint", "tokenizer", "report"},
    "export": {"util", "configurator", "checkpoint", "hf"},
    "serve": {"util", "preflight"},
    "loading": {"util", "checkpoint", "tokenizer", "hf"},
    "sample": {"util", "configurator", "objectives", "preflight", "loading", "serve"},
    "eval": {"util", "configurator", "data", "tasks", "tokenizer", "loading", "gates"},
    "honesty": {"util", "configurator", "report"},
    "handoff": {"util", "configurator", "report", "data", "download", "sources", "checkpoint", "hf", "honesty"},
    "sanity": {"util", "configurator", "attention", "model", "objectives", "optim", "data", "checkpoint", "preflight"},
    "train": {"util", "configurator", "attention", "model", "objectives", "optim", "data", "checkpoint", "preflight",
              "schedule", "report", "postmortem", "dryrun", "tasks", "tokenizer", "gates"},
}
# bench/'s probes share bench/common.py and may use any module but the scripts' insides
BENCH_MAY_NOT = {"train", "sanity", "sample"}


# the repo's modules by name: the scripts and model.py at the root, the rest in the package's layers
PATHS = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
PATHS.update({f[:-3]: os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "podgpt"))
              for f in fs if f.endswith(".py") and f != "__init__.py"})
OURS = set(PATHS)


def podgpt_imports(source):
    """The podgpt modules that this Python source imports anywhere in its code."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[-1 if a.name.startswith("podgpt.") else 0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("podgpt."):
                parts = node.module.split(".")
                names.update([parts[-1]] if len(parts) > 2 else [a.name for a in node.names])
            else:
                names.add(node.module.split(".")[0])
    return names & OURS


def imports_of(module):
    with open(PATHS[module]) as f:
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


# a file is read in one sitting and a function on one screen: the model itself in well under the rest's bound
MAX_LINES = {"model": 600}
MAX_FILE_LINES = 900
MAX_FUNCTION_LINES = 60


def sources():
    """(name, source) of every top-level module and bench probe."""
    bench = os.path.join(ROOT, "bench")
    paths = [PATHS[m] for m in sorted(OURS)]
    paths += [os.path.join(bench, f) for f in sorted(os.listdir(bench)) if f.endswith(".py")]
    for path in paths:
        with open(path) as f:
            yield os.path.relpath(path, ROOT), f.read()


def long_functions(source, limit):
    """'name (N lines)' for each function of source longer than limit lines, def to last line."""
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= limit]


def test_the_length_checks_see_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions("def f():\n    return 1\n", MAX_FUNCTION_LINES) == []


def test_files_and_functions_stay_short():
    too_long = []
    for name, source in sources():
        limit = MAX_LINES.get(name.removesuffix(".py"), MAX_FILE_LINES)
        if source.count("\n") > limit:
            too_long.append(f"{name} has {source.count(chr(10))} lines (at most {limit})")
        too_long += [f"{name}: {f}" for f in long_functions(source, MAX_FUNCTION_LINES)]
    assert not too_long, "; ".join(too_long)
