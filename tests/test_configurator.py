"""configurator.py: config files, --key=val, types, and one clear line on every mistake."""
import os
import subprocess
import sys

import pytest

from podgpt.core import configurator
from conftest import TINY_MODEL, run_script

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
    (["--hdp_segments=8,8,16"], "hdp_segments='8,8,16' is for objective=bd3lm: set objective=bd3lm, or leave "
                                "hdp_segments out"),
    (["--objective=refine", "--diffusion_block=8"], "diffusion_block=8 is for objective=bd3lm"),
    (["--objective=diffusion"], "objective='diffusion' is not one of ar, bd3lm, refine"),
    (["--objective=bd3lm", "--batch_preset=huge"], "batch_preset='huge' is not a preset: choose one of "
                                                   'conservative, recommended, aggressive, extreme (or "" for none)'),
    (["--objective=refine", "--refine_phase=1"], "refine_phase='1' is not a preset: choose one of fast, extreme"),
    (["--objective=refine", "--refine_preset=wild"], "refine_preset='wild' is not a preset: choose one of moderate, "
                                                     "aggressive, extreme"),
    (["--batch_preset=recommended"], "batch_preset='recommended' is for objective=bd3lm"),
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


def test_an_objective_s_keys_come_from_its_module_and_join_the_scripts_that_choose_one():
    """podgpt/research/'s modules each add their config block's keys to train.py and sanity.py (read from the
    file, not imported), and to no script without an objective key; a config file may set them for every
    script."""
    research = configurator.research_keys()
    assert research["n_loops"] == "refine" and research["diffusion_block"] == "bd3lm"
    for script, has in (("train.py", True), ("sanity.py", True), ("prepare.py", False), ("eval.py", False)):
        keys = configurator.read_defaults(os.path.join(ROOT, script))
        assert (set(research) <= set(keys)) == has, script
    cfg = parse(os.path.join(ROOT, "config", "tiny_refine.py"))
    assert cfg.objective == "refine" and cfg.n_sup_train != configurator.read_defaults(TRAIN)["n_sup_train"][0]
    configurator.configure(os.path.join(ROOT, "prepare.py"), [os.path.join(ROOT, "config", "tiny_refine.py")])


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


@pytest.mark.parametrize("setting, message", [
    ("--seed=18446744073709551616", "seed is 18446744073709551616, outside [0, 2**32), the seeds numpy takes: give a "
                                    "seed in that range"),
    ("--seed=-1", "seed is -1, outside [0, 2**32), the seeds numpy takes: give a seed in that range"),
    ("max_steps = 10**10000", "max_steps is an integer of 33,220 bits, which does not fit in 64 bits: give an integer "
                              "in [-2**63, 2**63)"),
    ("learning_rate = -10**400", "learning_rate is an integer of 1,329 bits, past the largest float: give a number "
                                 "(default 0.0003)"),
], ids=["seed-2**64", "seed-negative", "max_steps-10**10000-in-a-file", "learning_rate-minus-10**400-in-a-file"])
def test_an_integer_no_run_can_use_is_one_line(setting, message, tmp_path, stdlib_data, capfd):
    """What no script can use, refused as it is read: on the old configurator a seed of 2**64 ended in torch's
    "Overflow when unpacking long long", -1 in numpy's seeding, max_steps = 10**10000 in an OverflowError once
    the data was open (and str() of such an int raises in Python 3.11+: the message must not)."""
    if not setting.startswith("--"):  # a config file's line: Python, so 10**10000 is an int
        (tmp_path / "conf.py").write_text(setting + "\n")
        setting = str(tmp_path / "conf.py")
    r = run_script(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path / 'out'}", *TINY_MODEL,
                    "--max_steps=1", setting], capfd)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [f"error: {message}"]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("script", configurator.SCRIPTS)
def test_every_script_refuses_an_int_past_64_bits(script):
    key = next(k for k, (default, _) in configurator.read_defaults(os.path.join(ROOT, script)).items()
               if type(default) is int)
    with pytest.raises(configurator.ConfigError, match=rf"^{key} is 9223372036854775808, which does not fit in 64"):
        configurator.configure(os.path.join(ROOT, script), [f"--{key}={2**63}"])
    assert configurator.configure(os.path.join(ROOT, script), [f"--{key}={2**63 - 1}"])[key] == 2**63 - 1


def test_a_preset_fills_what_no_file_or_key_set_and_the_start_line_shows_it(tmp_path):
    """An objective's preset key fills its values after every file and --key, but not a key a file assigned
    (even to its default) or a --key gave; a preset may set a later one (a phase its refine_preset); the
    start's config line names each preset with the values it filled, and not the explicit ones."""
    cfg = parse("--objective=bd3lm", "--batch_preset=aggressive", "--block_size=512")
    assert (cfg.micro_batch_size, cfg.total_batch_tokens, cfg.learning_rate) == (192, 768 * 512, 7.3e-4)
    assert (cfg.lr_base, cfg.lr_base_batch) == (3e-4, 128)
    (tmp_path / "mine.py").write_text("micro_batch_size = 8\nlearning_rate = 1e-4\n")  # 8: train.py's default
    cfg = parse("--objective=bd3lm", "--batch_preset=extreme", str(tmp_path / "mine.py"), "--block_size=64",
                "--lr_base=2e-4")
    assert (cfg.micro_batch_size, cfg.learning_rate, cfg.lr_base) == (8, 1e-4, 2e-4)
    assert cfg.total_batch_tokens == 1024 * 64 and cfg.presets == {
        "batch_preset": {"total_batch_tokens": 65536, "lr_base_batch": 128}}
    line = configurator.changed(cfg, TRAIN)
    assert "batch_preset=extreme (total_batch_tokens=65536 lr_base_batch=128)" in line  # 128: at its default
    assert "micro_batch_size" not in line and "learning_rate=0.0001" in line and "lr_base=0.0002" in line
    cfg = parse("--objective=refine", "--refine_phase=extreme")
    assert (cfg.micro_batch_size, cfg.total_batch_tokens, cfg.max_steps, cfg.optimizer) == (16, 256 * 1024, 5000,
                                                                                             "muon")
    assert (cfg.matrix_lr, cfg.embedding_lr, cfg.learning_rate) == (5e-4, 5e-3, 5e-4)
    assert (cfg.refine_preset, cfg.supervision_weight_base, cfg.improvement_reward_scale) == ("extreme", 10.0, 2.0)
    (tmp_path / "mine.py").write_text("refine_preset = 'moderate'\n")
    cfg = parse("--objective=refine", "--refine_phase=fast", str(tmp_path / "mine.py"),
                "--improvement_reward_scale=0")
    assert (cfg.refine_preset, cfg.supervision_weight_base, cfg.improvement_reward_scale) == ("moderate", 3.0, 0.0)
    assert (cfg.micro_batch_size, cfg.matrix_lr) == (32, 1e-3)
    assert parse("--objective=bd3lm").presets == {} and parse().presets == {}  # "": none; ar: no preset
    assert configurator.changed(parse(), TRAIN) == "the defaults"


def test_help_lists_each_preset_s_values_and_that_an_explicit_key_wins(capfd):
    r = run_script(["train.py", "--help"], capfd)
    assert r.returncode == 0
    assert ("  --batch_preset=extreme: micro_batch_size=256 total_batch_tokens=1024*block_size learning_rate=0.0007 "
            "lr_base=0.0003 lr_base_batch=128") in r.stdout
    assert "  --refine_phase=fast: refine_preset='aggressive' micro_batch_size=32" in r.stdout
    assert "no --key gave, so an explicit key wins" in r.stdout


@pytest.mark.parametrize("name", ["conservative", "recommended", "aggressive", "extreme"])
def test_each_batch_preset_is_the_recipe_s_batch_at_accumulation_4_and_passes_its_lr_rule(name):
    from podgpt.pod.preflight import lr_scaling_gate
    cfg = parse("--objective=bd3lm", f"--batch_preset={name}", "--block_size=512")
    assert cfg.total_batch_tokens == 4 * cfg.micro_batch_size * 512
    assert lr_scaling_gate(cfg)["verdict"] == "pass"
