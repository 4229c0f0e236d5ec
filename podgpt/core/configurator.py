"""
The one config mechanism of podgpt's scripts. Each script declares its defaults as module-level
assignments between `# --- config` and `# --- end config` (a key's comment on its line is its
--help), and calls `configure(__file__, sys.argv[1:])`, which applies arguments left to right:

- a config file is Python run against the current values; it may set any podgpt script's keys
  (one file describes a whole run), another script's are ignored here, an unknown one is an error;
- `--key=val` must be this script's key; val is read with ast.literal_eval (else the raw string)
  and checked against the default's type: an int passes for a float (nan and inf do not),
  true/false for a bool, anything for a None default; `--flag` alone is `--flag=True`.

Then the chosen objective's presets: a preset key (its module's PRESETS) names a set of values that
fill the keys no config file assigned and no --key gave; a key set explicitly wins.

Any mistake is a ConfigError: one line naming the problem and the fix, and exit status 2.
"""

import ast
import difflib
import io
import math
import os
import tokenize

from podgpt.core.util import Error

BEGIN, END = "# --- config", "# --- end config"
SCRIPTS = ("train.py", "prepare.py", "sample.py", "sanity.py", "skills.py", "eval.py", "handoff.py")
# where the scripts are; the research objectives' keys are read from their files, never imported
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESEARCH = os.path.join(ROOT, "podgpt", "research")


class ConfigError(Error):
    """A mistake in a config file or --key=val: exit status 2."""

    def __init__(self, message):
        super().__init__(message, code=2)


class Config(dict):
    """The resolved config: config["key"] or config.key; its presets attribute: {preset key: {key:
    the value it filled}} (apply_presets)."""

    presets = {}

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def block_defaults(path):
    """{key: (default, comment)} of the config block of a script or an objective."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    try:
        begin = next(i for i, l in enumerate(lines) if l.startswith(BEGIN)) + 1
        end = next(i for i, l in enumerate(lines) if l.startswith(END)) + 1
    except StopIteration:
        raise ConfigError(f"{path} has no '{BEGIN}' ... '{END}' block")
    comments = {t.start[0]: t.string.lstrip("# ").rstrip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    defaults = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and begin < node.lineno < end:
            for target in node.targets:
                defaults[target.id] = (ast.literal_eval(node.value), comments.get(node.lineno, ""))
    return defaults


def block_presets(path):
    """{preset key: {name: {key: value}}}: the literal PRESETS of an objective's module, or {}."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
                "PRESETS"]:
            return ast.literal_eval(node.value)
    return {}


def research_modules():
    """{objective: its module's path} of the objectives beyond next-token prediction."""
    return {f[:-3]: os.path.join(RESEARCH, f) for f in sorted(os.listdir(RESEARCH))
            if f.endswith(".py") and not f.startswith("_")}


def research_keys():
    """{key: its objective} of every research objective."""
    return {key: name for name, path in research_modules().items() for key in block_defaults(path)}


def read_defaults(path):
    """{key: (default, comment)} of a script: its config block, then, when it has an `objective`
    key, every research objective's keys."""
    defaults = block_defaults(path)
    if "objective" in defaults:
        for module in research_modules().values():
            defaults.update(block_defaults(module))
    return defaults


def shown(value):
    """repr(value) for a message, a huge int by its size: one of over 4300 digits has no repr in
    Python 3.11+, and asking would turn the message into a traceback. A preset's (n, "key") is
    n*key."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        return f"{value[0]}*{value[1]}"
    if is_int(value) and value.bit_length() > 128:
        return f"an integer of {value.bit_length():,} bits"
    try:
        return repr(value)
    except ValueError:  # such an int inside a list, a dict, ...
        return f"a {type(value).__name__} too large to print"


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(key, value):
    """An int setting fits in 64 bits, or torch, numpy and floats fail on it deep in a run; a seed
    fits np.random.seed (train.py's): [0, 2**32)."""
    if key == "seed" and not 0 <= value < 2**32:
        raise ConfigError(f"seed is {shown(value)}, outside [0, 2**32), the seeds numpy takes: "
                          "give a seed in that range")
    if not -2**63 <= value < 2**63:
        raise ConfigError(f"{key} is {shown(value)}, which does not fit in 64 bits: give an "
                          "integer in [-2**63, 2**63)")
    return value


def coerce(key, value, default):
    """`value` converted to the type of `default`, or ConfigError."""
    if default is None or value is None:  # any value, but an int must fit in 64 bits
        return check_int(key, value) if is_int(value) else value
    kind = type(default)
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, float) and value.is_integer():  # 2e4 for max_steps
            value = int(value)
        if is_int(value):
            return check_int(key, value)
    elif kind is float:
        if is_int(value) or isinstance(value, float):
            try:
                number = float(value)
            except OverflowError:  # an int past the largest float
                raise ConfigError(f"{key} is {shown(value)}, past the largest float: give a number "
                                  f"(default {default!r})") from None
            if not math.isfinite(number):  # nan passes every "must be positive" check downstream
                raise ConfigError(f"{key}={number} is not a finite number: give a number "
                                  f"(default {default!r})")
            return number
    elif isinstance(value, kind):
        return value
    raise ConfigError(f"{key} expects {kind.__name__} (default {default!r}), got {shown(value)}")


def suggest(key, known):
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def foreign_keys(script_path):
    """Keys of the other podgpt scripts: a config file may set them."""
    others = [p for p in (os.path.join(ROOT, name) for name in SCRIPTS)
              if os.path.exists(p) and os.path.abspath(p) != os.path.abspath(script_path)]
    return {key for path in others for key in read_defaults(path)}


class Scope(dict):
    """A config file's namespace: it records the names the file assigns (its explicit keys)."""

    def __init__(self, values):
        super().__init__(values)
        self.assigned = set()

    def __setitem__(self, key, value):
        self.assigned.add(key)
        super().__setitem__(key, value)


def apply_file(path, config, defaults, foreign):
    """Run a config file against config: the keys it assigned."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found (give a path such as config/tiny.py)")
    scope = Scope(config)
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), {}, scope)
    except Exception as e:
        raise ConfigError(f"{path} failed to run: {type(e).__name__}: {e}")
    for key, value in scope.items():
        if key.startswith("_") or type(value).__name__ in ("module", "function", "type"):
            continue
        if key in defaults:
            config[key] = coerce(key, value, defaults[key][0])
        elif key not in foreign:
            known = list(defaults) + sorted(foreign)
            raise ConfigError(f"{path} sets unknown key '{key}'{suggest(key, known)}")
    return scope.assigned & set(defaults)


def apply_arg(arg, config, defaults):
    """Apply one --key=val: its key."""
    key, eq, text = arg[2:].partition("=")
    if key not in defaults:
        raise ConfigError(f"unknown key '{key}'{suggest(key, list(defaults))}; see --help")
    apply_value(arg, key, eq, text, config, defaults[key][0])
    return key


def apply_value(arg, key, eq, text, config, default):
    if not eq:
        if isinstance(default, bool):
            config[key] = True
            return
        raise ConfigError(f"{arg} has no value: write --{key}=VALUE")
    if isinstance(default, str):
        config[key] = text  # strings are taken verbatim: --prompt=1+1 stays "1+1"
        return
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if default is not None and not isinstance(default, bool):
            raise ConfigError(f"malformed value for {key}: {text!r} "
                              f"(expected {type(default).__name__})")
        value = text
    config[key] = coerce(key, value, default)


def help_text(prog, defaults):
    width = max(len(k) for k in defaults)
    rows = [f"usage: {prog} [config/x.py ...] [--key=value ...]", "", "keys (default  # comment):"]
    rows += [f"  --{k:<{width}} = {d!r:<16} # {c}" for k, (d, c) in defaults.items()]
    presets = research_presets() if "objective" in defaults else {}
    if presets:
        rows += ["", "presets (the objective's, in this order, after every file and --key): each "
                 "fills the keys", "no config file assigned and no --key gave, so an explicit key "
                 "wins"]
    for key, table in presets.items():
        rows += [f"  --{key}={name}: " + " ".join(f"{k}={shown(v)}" for k, v in values.items())
                 for name, values in table.items()]
    return "\n".join(rows)


def research_presets():
    """{preset key: {name: {key: value}}} of every research objective."""
    return {k: v for path in research_modules().values() for k, v in block_presets(path).items()}


def apply_presets(config, defaults, explicit):
    """Fill the keys of the objective's presets not in explicit, in their module's order: {preset
    key: {key: the value it filled}}. A value (n, "key") is n x that key's value (a global
    batch of n sequences: (n, "block_size") tokens); a key this script lacks is skipped."""
    module, filled = research_modules().get(config["objective"]), {}
    for key, table in (block_presets(module) if module else {}).items():
        name = config[key]
        if name == defaults[key][0] == "":  # "": no preset
            continue
        if name not in table:
            none = ' (or "" for none)' if defaults[key][0] == "" else ""
            raise ConfigError(f"{key}={shown(name)} is not a preset: choose one of "
                              f"{', '.join(table)}{none}")
        filled[key] = {}
        for k, value in table[name].items():
            if k in defaults and k not in explicit:
                value = value[0] * config[value[1]] if isinstance(value, tuple) else value
                config[k] = filled[key][k] = coerce(k, value, defaults[k][0])
    return filled


def changed(config, script_path):
    """`key=value` of each key off the script's default, a preset's followed by the values it filled
    (even those at their default): what a start prints (not a screenful)."""
    defaults, presets = read_defaults(script_path), getattr(config, "presets", {})
    filled = {k for values in presets.values() for k in values}
    words = []
    for k, v in config.items():
        if presets.get(k):
            words.append(f"{k}={v} ({' '.join(f'{f}={x}' for f, x in presets[k].items())})")
        elif k not in filled and v != defaults[k][0]:
            words.append(f"{k}={v}")
    return " ".join(words) or "the defaults"


def configure(script_path, argv):
    """The resolved Config; ConfigError on any mistake, SystemExit(0) after --help."""
    defaults = read_defaults(script_path)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(os.path.basename(script_path), defaults))
        raise SystemExit(0)
    config = {k: d for k, (d, _) in defaults.items()}
    foreign, explicit, presets = None, set(), {}
    for arg in argv:
        if arg.startswith("--"):
            explicit.add(apply_arg(arg, config, defaults))
        elif arg.startswith("-"):
            raise ConfigError(f"cannot read argument {arg!r}: use --key=value or a config file "
                              "path")
        else:
            foreign = foreign_keys(script_path) if foreign is None else foreign
            explicit |= apply_file(arg, config, defaults, foreign)
    if "objective" in config:
        check_objective(config, defaults)
        presets = apply_presets(config, defaults, explicit)
    config = Config(config)
    config.presets = presets
    return config


def check_objective(config, defaults):
    """The objective is "ar" or a module of podgpt/research/; no other objective's key is set."""
    owners, names = research_keys(), ("ar", *research_modules())
    if config["objective"] not in names:
        raise ConfigError(f"objective={config['objective']!r} is not one of {', '.join(names)}")
    for key, owner in owners.items():
        if owner != config["objective"] and config[key] != defaults[key][0]:
            raise ConfigError(f"{key}={shown(config[key])} is for objective={owner}: "
                              f"set objective={owner}, or leave {key} out")
