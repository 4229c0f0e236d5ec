"""configurator.py: config files, --key=val, types, and one clear line on every mistake."""
import os
import subprocess
import sys

import pytest

import configurator
from conftest import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")


def parse(*argv):
    return configurator.configure(TRAIN, list(argv))


def test_defaults_and_overrides(tmp_path):
    base = parse()
    assert base["max_steps"] == 1000 and base["ffn_hidden"] is None and base["compile"] is False
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("import math\nmax_steps = 2 * 50\nn_layer = int(math.sqrt(16))\ntokenizer = 'byte'\n")
    cfg = parse(str(cfg_file), "--max_steps=7", "--compile=true", "--learning_rate=1", "--ffn_hidden=96",
                "--out_dir=123", "--dtype=float32")
    assert cfg["max_steps"] == 7                        # command line after the file wins
    assert cfg["n_layer"] == 4                          # config files are Python
    assert cfg["compile"] is True                       # booleans accept true/false
    assert cfg["learning_rate"] == 1.0 and isinstance(cfg["learning_rate"], float)  # int for a float
    assert cfg["ffn_hidden"] == 96                      # a None default accepts a value
    assert cfg["out_dir"] == "123"                      # strings are verbatim
    assert "tokenizer" not in cfg                       # a key of prepare.py is ignored by train.py
    assert parse("--max_steps=2e3")["max_steps"] == 2000
    assert parse("--compile")["compile"] is True


@pytest.mark.parametrize("args, message", [
    (["--max_step=5"], "unknown key 'max_step' (did you mean 'max_steps'?)"),
    (["--max_steps=abc"], "malformed value for max_steps"),
    (["--max_steps=1.5"], "max_steps expects int"),
    (["--compile=maybe"], "compile expects bool"),
    (["--learning_rate=[1,"], "malformed value for learning_rate"),
    (["--max_steps"], "--max_steps has no value"),
    (["config/does_not_exist.py"], "config file 'config/does_not_exist.py' not found"),
    (["-x"], "cannot read argument '-x'"),
])
def test_mistakes_give_one_line_and_exit_2(args, message, capfd):
    if args == ["--max_step=5"]:  # one as a new `python train.py`: its imports add nothing to the one line either
        r = subprocess.run([sys.executable, TRAIN, *args], cwd=ROOT, capture_output=True, text=True)
    else:  # train.py's main in this process (conftest.run_script), from where that command runs
        r = run_script(["train.py", *args], capfd)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_config_file_unknown_key_and_wrong_type(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("n_layers = 4\n")
    with pytest.raises(configurator.ConfigError, match="unknown key 'n_layers'.*did you mean 'n_layer'"):
        parse(str(bad))
    bad.write_text("max_steps = 'many'\n")
    with pytest.raises(configurator.ConfigError, match="max_steps expects int"):
        parse(str(bad))
    bad.write_text("max_steps = undefined_name\n")
    with pytest.raises(configurator.ConfigError, match="NameError"):
        parse(str(bad))


def test_help_lists_every_key_with_default_and_comment(capfd):
    r = run_script(["train.py", "--help"], capfd)
    assert r.returncode == 0
    keys = configurator.read_defaults(TRAIN)
    for key, (_, comment) in keys.items():
        assert f"--{key}" in r.stdout and comment and comment in r.stdout
    for required in ("out_dir data_dir max_steps micro_batch_size total_batch_tokens block_size n_layer n_head "
                     "n_kv_head n_embd ffn_hidden vocab_size tie_embeddings learning_rate min_lr warmup_steps "
                     "weight_decay beta1 beta2 grad_clip eval_every eval_steps log_every ckpt_every keep_last "
                     "resume seed device dtype compile").split():
        assert required in keys


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "config"))))
def test_every_config_file_is_valid_for_every_script(name):
    for script in configurator.SCRIPTS:
        configurator.configure(os.path.join(ROOT, script), [os.path.join(ROOT, "config", name)])
