# Seed 000: the 1.1B "h200-1b-ddp8" run on 8x H200 under DDP, ClimbMix data.
#   python prepare.py config/h200_1b_ddp8.py
#   torchrun --standalone --nproc_per_node=8 train.py config/h200_1b_ddp8.py
#
# Shape from the runbook: 24 layers x 2048, GQA 16:4, context 2048, SwiGLU hidden
# floor(8d/3) = 5461, tied 32768 vocabulary: 1.124B parameters (1.057B non-embedding),
# 7.95 GFLOP/token (model.py; tests/test_model.py checks it). The runbook's ~22.4B
# planned tokens is ~20 tokens/parameter; with 2^20 tokens per step that is 21,362 steps.
# Not in the runbook, chosen here: the batch size, micro-batch and learning rates.
# The micro-batch that fits is for the capacity probe to measure on the pod.

# data: a BPE vocabulary of 32768 trained on the corpus itself
source = "climbmix"
tokenizer = "bpe:32768"
data_dir = "data/climbmix_bpe32k"
min_chars = 100
val_fraction = 0.001

# model
block_size = 2048
n_layer = 24
n_head = 16
n_kv_head = 4
n_embd = 2048
ffn_hidden = None          # floor(8 * 2048 / 3) = 5461
tie_embeddings = True

# training: 2^20 tokens per step = 8 GPUs x 16 sequences x 2048 tokens x accumulation 4
out_dir = "out/h200_1b_ddp8"
micro_batch_size = 16
total_batch_tokens = 1048576
max_steps = 21362          # 22.4e9 / 2^20
learning_rate = 3e-4
min_lr = 3e-5
warmup_steps = 1000
weight_decay = 0.1
grad_clip = 1.0
eval_every = 500
eval_steps = 20
log_every = 10
ckpt_every = 1000
dtype = "bfloat16"
compile = True
# preflight (train.py --preflight_only=True): the runbook's 8 ranks, and its vocabulary
# for planning before the data is prepared
expect_world_size = 8
plan_vocab_size = 32768
