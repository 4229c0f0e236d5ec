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
