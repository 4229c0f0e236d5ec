# The embedded default: a ~1.6M-parameter byte-level model trained on this machine's
# Python standard library (a corpus that is on every machine, so it runs offline).
# `bash run.sh` runs it end to end on a 2-core CPU in under 10 minutes.
# Measured on a 2-core CPU (torch 2.13 CPU build): ~0.4 s per optimizer step.

# data (prepare.py)
source = "stdlib"
tokenizer = "byte"
data_dir = "data/stdlib_byte"
val_fraction = 0.01

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
