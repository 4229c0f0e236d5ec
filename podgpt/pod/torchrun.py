"""
torchrun (torch.distributed.run), with its arguments, less the traceback it prints when a worker
fails: the worker has said why in its own line, and this exits with the failed worker's status.

    python -m podgpt.pod.torchrun --standalone --nproc_per_node=2 train.py config/tiny.py

SIGUSR1 reaches the workers on every torch (see main). Everything else is torchrun's own, run as
`python -m torch.distributed.run` runs it: the rendezvous, signal forwarding, max_restarts, the
error file its @record writes for a scheduler, its logs (its "failed (exitcode: N) local_rank: R"
line names a worker that died without a word, say by a signal).
"""

import runpy
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def main():
    # SLURM's preemption notice, SIGUSR1, as torchrun takes SIGTERM: passed on to the workers (they
    # save and stop). torchrun does so itself only from torch 2.10 on, and only when told
    # (PET_SIGNALS_TO_HANDLE); before, SIGUSR1 killed torchrun alone and the workers trained on.
    signal.signal(signal.SIGUSR1, _terminate_process_handler)
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()  # the root cause: the first worker that failed
        code = failure.exitcode
        sys.exit(code if code > 0 else 128 - code if code < 0 else 1)  # killed by signal N: 128 + N


if __name__ == "__main__":
    main()
