# The sft stage of config/tiny_skills.py (run.sh reads this file after it): the base run's latest checkpoint
# (run.sh's --init_from) fine-tuned on the skills pack's SFT rows, loss on the assistant's replies only; judged
# under config/tiny_skills.py's research gates (its pack_dir: the pack's gates and eval contamination).

# the chat data (prepare.py --chat=True, from PACK_DIR/sft.jsonl): a few percent of the rows held out
data_dir = "data/tiny_skills_sft"
val_fraction = 0.05
min_val_tokens = 0

# fine-tuning: rows packed into windows, each attending only within itself
out_dir = "out/tiny_skills/sft"
doc_mask = True
max_steps = 200
learning_rate = 1e-3
min_lr = 1e-4
warmup_steps = 10
eval_every = 50
ckpt_every = 200
