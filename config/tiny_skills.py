# The skills path on the embedded corpus, on a CPU: config/tiny.py's byte-level model and data (this machine's
# Python standard library), trained shorter, then fine-tuned on a skills pack's SFT rows by run.sh's sft stage,
# which reads config/tiny_skills_sft.py after this file:
#     CONFIG=config/tiny_skills.py STAGES="prepare train sft" bash run.sh
# The pack is PACK_DIR/sft.jsonl (default data/skills). Not yet tuned to a measured accuracy after SFT.

# data (prepare.py): config/tiny.py's, the same data_dir
source = "stdlib"
tokenizer = "byte"
plan_vocab_size = 257
data_dir = "data/stdlib_byte"
val_fraction = 0.01
min_val_tokens = 500_000

# model: config/tiny.py's shape
block_size = 256
n_layer = 4
n_head = 6
n_kv_head = 2
n_embd = 192

# base training
out_dir = "out/tiny_skills"
micro_batch_size = 16
total_batch_tokens = 4096
max_steps = 300
learning_rate = 2e-3
min_lr = 2e-4
warmup_steps = 30
eval_every = 100
eval_steps = 8
log_every = 20
ckpt_every = 300
device = "cpu"
dtype = "float32"
