# The sft stage of config/rehearsal_1b.py (run.sh reads this file after it): as config/h200_1b_ddp8_sft.py, the
# base run's latest checkpoint fine-tuned on the pack's SFT rows, loss on the replies only, rows packed into
# windows that attend only within themselves, stopped by the held-out rows' loss.

# the chat data (prepare.py --chat=True, from PACK_DIR/sft.jsonl)
data_dir = "data/rehearsal_1b_sft"
val_fraction = 0.05
min_val_tokens = 0

out_dir = "out/rehearsal_1b/sft"
doc_mask = True
micro_batch_size = 16
total_batch_tokens = 4096
max_steps = 200             # an upper bound: early stopping ends the run
max_epochs = 100            # corpus_model_fit: many passes over 1,600 rows are the plan, as early stopping watches
learning_rate = 1e-3
min_lr = 1e-4
warmup_steps = 5
eval_every = 5
eval_steps = 2
early_stop_patience = 3
ckpt_every = 200            # and one at every new best validation loss
log_every = 5
