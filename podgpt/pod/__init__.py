"""What a paid run needs around the training step: preflight's plan and gates, the guards, the run
report, spike post-mortems and the dry run."""
