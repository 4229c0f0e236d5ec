"""Run a script as N ranks of one node, in the environment torchrun gives its workers, forked from this process.

    python tests/ranks.py --nproc_per_node=N SCRIPT [ARGS...]

For the tests whose subject is what the ranks compute (DDP and FSDP steps, resharding, a resume on two
ranks): the ranks are forked after torch is imported here, so they skip the ~4 s of CPU each process
spends importing torch and torch._dynamo (which torch.optim imports), and no launcher process imports it a
third time. A 2-rank tiny run took 11 s of CPU under torchrun, 5.5 s here (2 cores, torch 2.13). The tests
whose subject is the launch itself (a killed rank, SIGTERM to the job, restarts, two nodes) use torchrun.

Like torchrun with its defaults: every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR and MASTER_PORT (a free port), OMP_NUM_THREADS=1 unless set; when a rank fails the others are
killed and the exit status is 1; SIGINT and SIGTERM are passed on to the ranks. A rank ends with os._exit, as
train.py's ranks do under torchrun too (util.exit_worker), so no interpreter teardown is skipped that would run.
"""
import contextlib
import os
import runpy
import signal
import socket
import sys
import threading
import traceback

import torch  # noqa: F401 -- imported once, here, for every rank
import torch._dynamo  # noqa: F401 -- torch.optim's Optimizer imports it: ~1.5 s per process

assert sys.argv[1].startswith("--nproc_per_node="), __doc__
nproc, (script, *args) = int(sys.argv[1].split("=")[1]), sys.argv[2:]
assert threading.active_count() == 1, "forking with other threads running could copy a held lock"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]

ranks = {}
for rank in range(nproc):
    pid = os.fork()
    if pid == 0:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never back into this launcher's loop
    ranks[pid] = rank


def pass_on(signum, frame):
    for pid in list(ranks):
        with contextlib.suppress(ProcessLookupError):  # reaped, not yet out of ranks
            os.kill(pid, signum)


signal.signal(signal.SIGINT, pass_on)
signal.signal(signal.SIGTERM, pass_on)
failed = False
while ranks:
    pid, status = os.wait()
    rank = ranks.pop(pid)
    if os.waitstatus_to_exitcode(status) != 0 and not failed:
        failed = True
        print(f"ranks.py: rank {rank} exited {os.waitstatus_to_exitcode(status)}: killing the others",
              file=sys.stderr, flush=True)
        pass_on(signal.SIGKILL, None)
sys.exit(int(failed))
