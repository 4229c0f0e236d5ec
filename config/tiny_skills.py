# The skills path on the embedded corpus, on a CPU: a byte-level base model on config/tiny.py's data (this
# machine's Python standard library), then fine-tuned on a skills pack's SFT rows by run.sh's sft stage, which
# reads config/tiny_skills_sft.py after this file:
#     CONFIG=config/tiny_skills.py STAGES="prepare train sft" bash run.sh
# The pack is PACK_DIR/sft.jsonl (default data/skills). Not yet tuned to a measured accuracy after SFT.

# data (prepare.py): config/tiny.py's, in the same data_dir (prepared once for both)
source, tokenizer, data_dir = "stdlib", "byte", "data/stdlib_byte"
val_fraction, min_val_tokens = 0.01, 500_000
plan_vocab_size = 257  # the byte tokenizer's 256 bytes and BOS: run.sh's sanity --capacity plans before prepare

# model: config/tiny.py's width and depth; a window of 128 bytes holds a few skills rows
block_size, n_layer, n_embd = 128, 4, 192
n_head, n_kv_head = 6, 2

# base training: 300 steps of 4,096 tokens
out_dir = "out/tiny_skills"
micro_batch_size, total_batch_tokens, max_steps = 32, 4096, 300
learning_rate, min_lr, warmup_steps = 2e-3, 2e-4, 30
eval_every, eval_steps, log_every, ckpt_every = 100, 8, 20, 300
device, dtype = "cpu", "float32"
