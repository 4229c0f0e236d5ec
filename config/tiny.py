# The embedded default: a ~1.6M-parameter byte-level model trained on this machine's
# Python standard library (a corpus that is on every machine, so it runs offline).
# `bash run.sh` runs it end to end on a 2-core CPU in under 10 minutes.
# Measured on a 2-core CPU (torch 2.13 CPU build): ~0.4 s per optimizer step.

# data (prepare.py)
source = "stdlib"
tokenizer = "byte"
plan_vocab_size = 257       # the byte tokenizer's 256 bytes and BOS: run.sh's sanity --capacity plans before prepare
data_dir = "data/stdlib_byte"
val_fraction = 0.01
# val_fraction counts files, and stdlib files differ in size a thousandfold: 1% of them can be
# 0.6% of the tokens (Python 3.12: 12 files, 196,641 tokens). 500k tokens is at least 1% of any
# stdlib up to 50M tokens (3.10-3.13: 29.8M-33.1M) and ~1,950 windows of block_size 256.
# Set here, not as prepare.py's default (100k, a floor for any corpus): 500k would be most of a
# small corpus, which prepare.py refuses (it keeps at least half of the tokens for training).
min_val_tokens = 500_000

# model
block_size = 256
n_layer = 4
n_head = 6
n_kv_head = 2            # GQA 3:1, so the default path exercises grouped-query attention
n_embd = 192

# training
out_dir = "out/tiny"
micro_batch_size = 16
total_batch_tokens = 4096   # 16 x 256: one micro-step per optimizer step on one process
max_steps = 600
learning_rate = 2e-3        # small models train stably at higher rates
min_lr = 2e-4
warmup_steps = 50
eval_every = 100
eval_steps = 8
log_every = 20
ckpt_every = 200
device = "cpu"
dtype = "float32"

# sampling (sample.py)
prompt = "def "
max_new_tokens = 300
