"""The objectives beyond next-token prediction, one file each. Pretraining never imports them."""
