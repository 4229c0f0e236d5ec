"""conftest.popen's forks (tests/forkserver.py) run a command as a new interpreter would: what the suite's
commands print and how they end is what a user's `python script.py` would print and how it would end."""
import os
import signal
import subprocess
import sys

import pytest

from conftest import FORKS, Forked, popen

pytestmark = pytest.mark.skipif(not FORKS, reason="forking is off (PODGPT_TEST_FORKS=0, or not Linux): every command starts anew")

PROBE = """\
import atexit, os, signal, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
print("to stderr", file=sys.stderr)
print(sys.argv, __name__, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), os.getcwd(),
      os.environ.get("PROBE"), sys.stdin.readline().strip(), signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGTERM), sys.stdout.isatty(), flush=True)
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()  # not a daemon: waited for
mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
if mode == "message":
    sys.exit("bye")
if mode == "raise":
    raise ValueError("boom")
if mode == "ctrl-c":
    raise KeyboardInterrupt
if mode in ("sigkill", "sigterm"):
    time.sleep(60)
"""


def ended(args, fork, cwd, signum=None):
    """(exit status, stdout, stderr's last line, whether stderr has a traceback) of args with PROBE=x, stdin
    "line", forked (conftest.popen) or as a new interpreter; signum: sent once it has printed its first line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PROBE="x")  # all of it for subprocess.Popen, added for popen
    with (popen if fork else subprocess.Popen)(args, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True) as p:
        assert isinstance(p, Forked) == fork
        p.stdin.write("line\n")
        p.stdin.flush()
        first = p.stdout.readline()
        if signum:
            p.send_signal(signum)
        out, err = p.communicate(timeout=60)
    return p.returncode, first + out, err.strip().splitlines()[-1], "Traceback" in err


@pytest.mark.parametrize("mode, status", [("ok", 0), ("exit3", 3), ("message", 1), ("raise", 1),
                                          ("ctrl-c", -signal.SIGINT), ("sigkill", -signal.SIGKILL),
                                          ("sigterm", -signal.SIGTERM)])
def test_a_forked_command_runs_and_ends_as_a_new_interpreter(mode, status, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    args = [sys.executable, str(script), mode]
    signum = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}.get(mode)
    forked, new = ended(args, True, tmp_path, signum), ended(args, False, tmp_path, signum)
    assert forked == new and forked[0] == status
    if signum is None:
        assert forked[1].endswith("thread joined\natexit ran\n")


def test_a_command_whose_environment_the_server_cannot_take_starts_anew(tmp_path):
    """OMP_NUM_THREADS (read as torch loads OpenMP) and PYTHONPATH (read as the interpreter starts) are the
    server's: a command asking for others is a new interpreter, which sees them."""
    script = tmp_path / "env.py"
    script.write_text("import os; print(os.environ['OMP_NUM_THREADS'], os.environ.get('PYTHONPATH'))")
    for added in (dict(OMP_NUM_THREADS="2"), dict(PYTHONPATH="/x")):
        with popen([sys.executable, str(script)], env=added, stdout=subprocess.PIPE, text=True) as p:
            assert not isinstance(p, Forked)
            env = {**os.environ, "OMP_NUM_THREADS": "1", **added}
            assert p.communicate()[0].strip() == f"{env['OMP_NUM_THREADS']} {env.get('PYTHONPATH')}"
