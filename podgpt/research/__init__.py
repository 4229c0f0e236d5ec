"""The objectives beyond next-token prediction, each in its own file. Pretraining never imports them."""
