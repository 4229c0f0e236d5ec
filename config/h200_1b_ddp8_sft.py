# The sft stage of config/h200_1b_ddp8.py (run.sh reads this file after it, so the model's shape is the base run's):
# the base run's latest checkpoint (run.sh's --init_from) fine-tuned on the release skills pack's 1,600 SFT rows,
# loss on the assistant's replies only, on the same 8 GPUs.
#   STAGES="skills sft eval" CONFIG=config/h200_1b_ddp8.py NPROC=8 bash run.sh
#
# Size: those rows are 206 KB of text (89 KB of prompts, 117 KB of replies with their worked steps; skills.py with
# the base config, measured), so at most 214k tokens with the chat tokens (a BPE token is at least a byte): at
# most 105 windows of 2048. An epoch is a handful of steps, and how many depends on the tokenizer; so the run is
# bounded by validation instead of by a guess: an evaluation every 5 steps on the held-out rows, a stop after 3
# without a new best, and eval.py scores the best checkpoint.
# The learning rates are chosen, not measured: a tenth of the base run's peak.

# the chat data (prepare.py --chat=True, from PACK_DIR/sft.jsonl, in the base run's tokenizer plus the chat tokens)
data_dir = "data/climbmix_bpe32k_sft"
val_fraction = 0.05        # 80 of the 1,600 rows held out: the validation loss early stopping reads
min_val_tokens = 0

# fine-tuning: rows packed into windows, each row attending only within itself; one window per GPU per step
out_dir = "out/h200_1b_ddp8/sft"
doc_mask = True
micro_batch_size = 1
total_batch_tokens = 16384  # 8 GPUs x 1 window x 2048 tokens
max_steps = 200             # an upper bound: early stopping ends the run
max_epochs = 100            # corpus_model_fit: many passes over 1,600 rows are the plan, as early stopping watches
learning_rate = 3e-5
min_lr = 3e-6
warmup_steps = 5
eval_every = 5
eval_steps = 1              # 8 windows (one per GPU): the held-out rows are about 5 windows
early_stop_patience = 3
ckpt_every = 200            # and one at every new best validation loss
log_every = 1
