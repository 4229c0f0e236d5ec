# The skills path on the embedded corpus, on a CPU: a byte-level base model on config/tiny.py's data (this
# machine's Python standard library), fine-tuned on a skills pack's SFT rows (run.sh's sft stage reads
# config/tiny_skills_sft.py after this file), then both checkpoints asked the pack's eval rows, each run's honesty
# report written, and the fine-tuned model handed off as a bundle (out/tiny_skills-handoff); run.sh runs all of
# it for a config that sets pack_dir:
#     CONFIG=config/tiny_skills.py bash run.sh
#     CONFIG=config/tiny_skills.py STAGES="skills prepare train sft eval" bash run.sh   # the model and its eval
# Measured on a 2-core CPU (torch 2.13): 5m20s for the first command, 5m21s for the second; after SFT, counting 7
# of 30 right (95% interval 11.8% to 40.9%, chance and the base model 0%), yes_no 19 of 30 (chance 50%, base 0%),
# 31 of 330 overall against a pooled chance of 6.6% (eval.md in out/tiny_skills and out/tiny_skills/sft); the
# fine-tuned run's release gate is warn (corpus_model_fit, base_exposure), so it is handed off as it is.

# data (prepare.py): config/tiny.py's, in the same data_dir (prepared once for both)
source, tokenizer, data_dir = "stdlib", "byte", "data/stdlib_byte"
val_fraction, min_val_tokens = 0.01, 500_000
plan_vocab_size = 257  # the byte tokenizer's 256 bytes and BOS: run.sh's sanity --capacity plans before prepare

# model: config/tiny.py's width and depth; a window of 128 bytes holds a few skills rows
block_size, n_layer, n_embd = 128, 4, 192
n_head, n_kv_head = 6, 2

# base training: 300 steps of 4,096 tokens, under the research gates (docs/preflight.md): 1.2M tokens, 0.75 per
# parameter of this 1.6M-parameter model, are far short of what release_token_budget asks of a release
out_dir = "out/tiny_skills"
gate_profile = "research"
micro_batch_size, total_batch_tokens, max_steps = 32, 4096, 300
learning_rate, min_lr, warmup_steps = 2e-3, 2e-4, 30
eval_every, eval_steps, log_every, ckpt_every = 100, 8, 20, 300
device, dtype = "cpu", "float32"

# the skills pack (skills.py, run.sh's skills stage) and its evaluation (eval.py, the eval stage): direct answers,
# which a model this small can learn in a few hundred steps where worked steps would take many more
pack_dir = "data/skills_tiny"
sft_rows, eval_rows, answer_style = 1600, 330, "direct"
max_new_tokens = 48
