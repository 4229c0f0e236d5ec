"""What one training step needs: the config mechanism, tokenizers, data, attention, optimizers, the
schedule and checkpoints. Names no objective and imports nothing above it."""
