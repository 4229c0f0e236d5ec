# The sft stage of config/rehearsal_1b.py (run.sh reads this file after it): as config/h200_1b_ddp8_sft.py, the
# base run's latest checkpoint fine-tuned on the pack's SFT rows, loss on the replies only, rows packed into
# windows that attend only within themselves, stopped by the held-out rows' loss.

# the chat data (prepare.py --chat=True, from PACK_DIR/sft.jsonl)
data_dir = "data/rehearsal_1b_sft"
val_fraction, min_val_tokens = 0.05, 0

out_dir = "out/rehearsal_1b/sft"
doc_mask = True
micro_batch_size, total_batch_tokens = 16, 4096
# at most 200 steps: early stopping ends the run; corpus_model_fit: many passes over 1,600 rows are the plan
max_steps, max_epochs, early_stop_patience = 200, 100, 3
learning_rate, min_lr, warmup_steps = 1e-3, 1e-4, 5
eval_every, eval_steps, log_every = 5, 2, 5
ckpt_every = 200  # and one at every new best validation loss
