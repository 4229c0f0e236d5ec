"""Start `python script.py ARGS` as a fork of this process, which has imported torch.

    python tests/forkserver.py SOCKET_PATH        (conftest.popen starts one per test process)

Each process the tests start would otherwise spend ~4.7 s of CPU (2-core CI machine, torch 2.13) importing
torch and torch._dynamo (which torch.optim imports) before its first line of work. Here they are imported
once, and each command runs in a fork of this process, as tests/ranks.py runs ranks.

A request is one message on a SOCK_SEQPACKET connection: JSON {argv, cwd, env, new_session} with the
command's stdin, stdout and stderr as file descriptors. A monitor process forks the command, answers its pid,
waits for it, and answers its wait status: the test's Popen (conftest.Forked) reads both. The command then
runs as it would in a new interpreter: its argv, working folder, environment, sys.path[0], standard streams
and SIGINT handler are its own, it runs as __main__, and it ends through the interpreter's own exit (threads
joined, atexit, flushes; an uncaught KeyboardInterrupt ends it by SIGINT). What cannot be set after the
interpreter starts (PYTHONPATH, PYTHONHASHSEED, OMP_NUM_THREADS, read when torch loads OpenMP...) is this
server's own: conftest.popen forks only commands whose environment agrees with it on those. /proc/PID/cmdline
(what ps shows) stays this server's command line.
"""
import io
import json
import os
import runpy
import select
import signal
import socket
import sys

import torch  # noqa: F401 -- imported once, here, for every command
import torch._dynamo  # noqa: F401 -- torch.optim's Optimizer imports it: ~1.5 s per process

# this server, and the monitors it forks, leave Ctrl-C to the commands (all of them share pytest's process group)
signal.signal(signal.SIGINT, signal.SIG_IGN)


def next_request(listener):
    """Serve until stdin closes (the test process has ended: exit) or, in a forked command, return its
    request and its three descriptors."""
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:
            sys.exit(0)
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:  # the monitor
            listener.close()
            pid = os.fork()
            if pid == 0:
                return conn, json.loads(msg), fds
            for fd in fds:  # the command's alone: a pipe ends when the command's end closes
                os.close(fd)
            try:  # the test process may be gone: the command goes on, as an orphaned subprocess would
                conn.send(str(pid).encode())
                conn.send(str(os.waitpid(pid, 0)[1]).encode())
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)
        while True:  # reap the monitors that have ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def standard_stream(fd, mode, errors, unbuffered):
    """A standard stream as a new interpreter makes it (stderr line-buffered, stdout line-buffered on a tty)."""
    line = fd == 2 or (fd == 1 and os.isatty(fd))
    return io.TextIOWrapper(io.open(fd, mode + "b", closefd=False), encoding="utf-8", errors=errors,
                            line_buffering=line, write_through=unbuffered and fd != 0)


listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(64)
print("ready", flush=True)
conn, request, fds = next_request(listener)

# the command: its standard streams, folder, environment, session, Ctrl-C, argv and sys.path
conn.close()
for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
if request["new_session"]:
    os.setsid()
signal.signal(signal.SIGINT, signal.default_int_handler)
unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
sys.stdin = sys.__stdin__ = standard_stream(0, "r", "strict", unbuffered)
sys.stdout = sys.__stdout__ = standard_stream(1, "w", "strict", unbuffered)
sys.stderr = sys.__stderr__ = standard_stream(2, "w", "backslashreplace", unbuffered)
argv = request["argv"]
sys.orig_argv = [sys.executable, *argv]
sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
runpy.run_path(argv[0], run_name="__main__")
