# Block diffusion (BD3-LM) on the embedded default's data, CPU-sized: a tiny byte-level model
# that learns to denoise blocks of 8 bytes given the clean blocks before them (research/bd3lm.py: BlockDiffusionLM), and
# samples text a block at a time (sample.py: each block starts as [MASK]s and is unmasked in 8 passes).
# It shows on a 2-core CPU what config/h200_gsm8k_bd3lm.py is for (its numbers: docs/LOG.md).
# Prepare the data as config/tiny.py does (bash run.sh, or python prepare.py config/tiny.py).

# data (prepare.py): config/tiny.py's
source = "stdlib"
tokenizer = "byte"
plan_vocab_size = 257       # the byte tokenizer's 256 bytes and BOS: run.sh's sanity --capacity plans before prepare
data_dir = "data/stdlib_byte"
min_val_tokens = 500_000

# model: config/tiny.py's shape at half its context (a bd3lm row is two copies of it)
block_size = 128
n_layer = 4
n_head = 6
n_kv_head = 2
n_embd = 192
objective = "bd3lm"
diffusion_block = 8
noise_schedule = "loglinear"
attn_backend = "sdpa"       # PyTorch's pick; auto's is math, the only one of its list with a mask on a CPU: ~20% slower here

# training
out_dir = "out/tiny_bd3lm"
micro_batch_size = 16
total_batch_tokens = 2048
max_steps = 300
learning_rate = 2e-3
min_lr = 2e-4
warmup_steps = 30
eval_every = 100
eval_steps = 8
log_every = 20
ckpt_every = 100
device = "cpu"
dtype = "float32"

# sampling (sample.py)
prompt = "def "
max_new_tokens = 120
