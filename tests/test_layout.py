"""The modules import one way, from the bottom up: util -> model -> data -> train -> the scripts.
A module imports only podgpt modules below it (at its top or inside a function), so each can be
read, copied and tested without the ones above it."""
import ast
import os

from conftest import ROOT

# each module and the podgpt modules it may import
BELOW = {
    "util": set(),
    "model": {"util"},
    "data": {"util"},
}


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
