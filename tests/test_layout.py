"""The house: the root holds the scripts a user runs and model.py; the library beneath is podgpt/, whose folders
are layers that import one way, from the bottom up (core -> corpus -> model.py -> pod -> research, release ->
the scripts). A module imports only its own layer and those below it (at its top or inside a function), so each
can be read, copied and tested without the ones above; no script imports train.py's insides. Pretraining loads
nothing of the release path or the research objectives, and the core never names one. Files stay short."""
import ast
import functools
import os
import re
import sys

from conftest import ROOT, TINY_MODEL, run

# each layer and the layers it may import; a script may import any module, and another script but train.py
MAY_IMPORT = {
    "core": {"core"},
    "corpus": {"core", "corpus"},
    "model": {"core"},
    "pod": {"core", "corpus", "model", "pod"},
    "research": {"core", "model"},  # and no objective imports another
    "release": {"core", "corpus", "model", "pod", "release"},
}
LAYERS = sorted(set(MAY_IMPORT) - {"model"})  # podgpt/'s folders
SCRIPTS = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} - {"model"}
# files that run the research objectives or the release path; pretraining's process must load none of them
NOT_IN_PRETRAINING = ("podgpt.release", "podgpt.research")


@functools.cache
def library():
    """{dotted module name: path} of every module under podgpt/."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "podgpt")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return found


def layer_of(module):
    """The layer of a dotted module name: a podgpt/ folder, "model", "script", or None (not ours)."""
    parts = module.split(".")
    if parts[0] == "podgpt":
        return parts[1] if len(parts) > 1 else "podgpt"
    return "model" if module == "model" else "script" if parts[0] in SCRIPTS else None


def imported(source):
    """The modules of ours that Python source imports anywhere in it: {dotted name}."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from podgpt.core import util` imports podgpt.core.util; `from podgpt.core.util import x`, that module
            names.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in library() else node.module
                         for a in node.names)
    return {n for n in names if layer_of(n)}


def breaches(module, source):
    """'module imports X' for each import of source (module's) that its layer may not make."""
    layer, found = layer_of(module), []
    for name in sorted(imported(source)):
        target = layer_of(name)
        if layer == "script":
            bad = name == "train" and module != "train"
        else:
            bad = target not in MAY_IMPORT.get(layer, set())
        if bad:
            found.append(f"{module} ({layer}) imports {name} ({target})")
    return found


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_the_checker_sees_a_breach_at_the_top_and_inside_a_function():
    source = "import os\nfrom podgpt.core import util\ndef f():\n    from podgpt.release.gates import pack_gates\n"
    assert breaches("podgpt.core.data", source) == [
        "podgpt.core.data (core) imports podgpt.release.gates (release)"]
    assert breaches("podgpt.pod.report", "import model\nfrom podgpt.corpus import tasks\n") == []
    assert breaches("podgpt.research.refine", "from podgpt.pod import gates\n") == [
        "podgpt.research.refine (research) imports podgpt.pod.gates (pod)"]
    assert breaches("eval", "import train\nfrom podgpt.release import loading\n") == ["eval (script) imports train (script)"]


def test_every_module_imports_only_its_layer_and_those_below():
    wrong = [b for module, path in library().items() for b in breaches(module, read(path))]
    wrong += breaches("model", read(os.path.join(ROOT, "model.py")))
    wrong += [b for script in SCRIPTS for b in breaches(script, read(os.path.join(ROOT, f"{script}.py")))]
    assert not wrong, "; ".join(wrong)


def test_the_root_holds_the_scripts_model_and_the_layers():
    """ls at the root: the scripts a user runs (each with its config block and its __main__), model.py, run.sh,
    the folders and the project's files; podgpt/ holds the layers and nothing else."""
    others = {"README.md", "requirements.txt", "requirements-dev.txt", "pytest.ini", "run.sh", "config", "bench",
              "tests", "docs", "podgpt"}
    listed = {f for f in os.listdir(ROOT) if not f.startswith(".")} - {f"{s}.py" for s in SCRIPTS} - {"model.py"}
    assert listed - others <= {"data", "out", "export", "downloads", "mlruns", "mlflow.db", "__pycache__"}  # made by runs
    for script in SCRIPTS:
        source = read(os.path.join(ROOT, f"{script}.py"))
        assert "# --- config" in source and '__name__ == "__main__"' in source, f"{script}.py is not a script"
    folders = {f for f in os.listdir(os.path.join(ROOT, "podgpt")) if not f.startswith(("_", "."))}
    assert {f.removesuffix(".py") for f in folders} == set(LAYERS)


def test_bench_imports_no_script_insides():
    """bench/'s probes may use any module, and prepare.py's encoder (bench/encode.py), but not the insides of the
    scripts that run a model."""
    for f in sorted(os.listdir(os.path.join(ROOT, "bench"))):
        if f.endswith(".py"):
            wrong = imported(read(os.path.join(ROOT, "bench", f))) & {"train", "sanity", "sample"}
            assert not wrong, f"bench/{f} imports {wrong}"


# model.py, train.py, sanity.py, the core and the run's checkpoints never name a research objective
NO_OBJECTIVE = ["model.py", "train.py", "sanity.py", "podgpt/pod/checkpoints.py"] + [
    os.path.join("podgpt", "core", f) for f in sorted(os.listdir(os.path.join(ROOT, "podgpt", "core")))
    if f.endswith(".py")]
OBJECTIVE_NAMES = re.compile(r"bd3lm|refine|diffusion", re.IGNORECASE)


def named_objectives(source):
    return [line for line in source.splitlines() if OBJECTIVE_NAMES.search(line)]


def test_the_core_names_no_research_objective():
    assert named_objectives("import torch\n# a research objective adds its own mask\n") == []
    assert named_objectives("x = 1\nif objective == 'bd3lm':\n") == ["if objective == 'bd3lm':"]
    found = {path: named_objectives(read(os.path.join(ROOT, path))) for path in NO_OBJECTIVE}
    assert not any(found.values()), {p: lines for p, lines in found.items() if lines}


# train.py run as python train.py would run it, and the names of every module loaded when it exits written out
LOADED = """import atexit, os, runpy, sys
atexit.register(lambda: open(os.environ["LOADED_TO"], "w").write("\\n".join(sorted(sys.modules))))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def loaded_modules(stdlib_data, out, *args):
    """The modules a train.py run loaded (sys.modules at its exit: imports by importlib too)."""
    run([sys.executable, "-c", LOADED, "train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_MODEL,
         "--micro_batch_size=2", "--total_batch_tokens=128", "--max_steps=2", "--eval_every=2", *args],
        env={"LOADED_TO": str(out) + ".modules"})
    return set(read(str(out) + ".modules").split())


def test_pretraining_loads_neither_the_release_path_nor_a_research_objective(tmp_path, stdlib_data):
    plain = loaded_modules(stdlib_data, tmp_path / "ar", "--objective=ar", "--gate_profile=research")
    assert "podgpt.pod.preflight" in plain and "podgpt.core.checkpoint" in plain  # the run's own are listed
    assert not [m for m in plain if m.startswith(NOT_IN_PRETRAINING)]
    # the same look finds a research objective where a run trains one
    refined = loaded_modules(stdlib_data, tmp_path / "refine", "--objective=refine", "--n_sup_train=2",
                             "--n_sup_inference=2")
    assert "podgpt.research.refine" in refined and "podgpt.release.gates" not in refined


# a file is read in one sitting and a function on one screen
MAX_FILE_LINES = 600
MAX_LINE = 100  # columns: a line of the library or a script fits a side-by-side diff
MAX_FUNCTION_LINES = 60


def long_functions(source, limit):
    """'name (N lines)' for each function of source longer than limit lines, def to last line."""
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= limit]


def test_the_length_checks_see_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions("def f():\n    return 1\n", MAX_FUNCTION_LINES) == []


def test_files_functions_and_lines_stay_short():
    code = [*library().values(), *(os.path.join(ROOT, f"{m}.py") for m in [*SCRIPTS, "model"])]
    bench = [os.path.join(ROOT, "bench", f) for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py")]
    too_long = []
    for path in sorted(code + bench):
        source, name = read(path), os.path.relpath(path, ROOT)
        if source.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{name} has {source.count(chr(10))} lines (at most {MAX_FILE_LINES})")
        too_long += [f"{name}: {f}" for f in long_functions(source, MAX_FUNCTION_LINES)]
        if path in code:
            too_long += [f"{name}:{n} is {len(line)} columns" for n, line in enumerate(source.splitlines(), 1)
                         if len(line) > MAX_LINE]
    assert not too_long, "; ".join(too_long)
