"""podgpt's library, beneath the scripts at the repo's root. Its folders are layers, each importing
only those below it (tests/test_layout.py holds the rules):

    core/      what one training step needs: util, configurator, tokenizer, data, attention,
               optim, schedule, checkpoint; names no objective
    corpus/    what prepare.py reads and checks a corpus against: sources, downloads, the
               hold-out, the tasks' formats, n-gram contamination
    pod/       what a paid run needs around the step: preflight, gates, guards, the run's start
               and log, checkpoints as the loop sees them, report, post-mortems, dry run, and the
               registry that finds a research objective by name
    release/   after pretraining: loading a trained model, the Hugging Face folder, the server,
               the release gates
    research/  the objectives beyond next-token prediction, each in its own file

model.py (at the root, the GPT) sits above core/ and corpus/ and below pod/."""

import multiprocessing
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the scripts' folder


def interrupted_while_loading(signum, frame):
    """A Ctrl-C while a script's imports load (torch: seconds) ends as a later one does: one line
    and exit 130, not a traceback from inside an import. Nothing is written before run_main."""
    os.write(2, b"error: interrupted (Ctrl-C)\n")
    os._exit(130)


# a script at the root, run as the main process (a worker process ignores Ctrl-C its own way)
main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
if (os.path.dirname(os.path.abspath(main_file)) == ROOT and multiprocessing.parent_process() is None
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, interrupted_while_loading)
