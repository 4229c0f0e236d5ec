# The d64 run: the character-level model on 8x H100 PCIe, 31 hours, $1000 budget.
#   python prepare.py config/h100_d64.py --source=/workspace/combined_output.txt
#   torchrun --standalone --nproc_per_node=8 train.py config/h100_d64.py      (dist_mode=fsdp, below)
#
# Where the recipe's arithmetic is wrong (memory.param_counts; tests/test_model.py):
# - 64 layers x 4096 wide with a 4x MLP is 12*L*d^2 = 12.9B parameters, not "4.3B".
#   Here the MLP is SwiGLU with hidden floor(8d/3) = 10922 rounded up to a multiple of
#   256 (multiple_of): 11008, Llama-7B's, so its matmuls run on whole tiles: 12.953B in
#   total (12.885B at 10922, the same 8*d^2 parameters per layer as a 4x two-matrix MLP).
# - Mixed-precision AdamW under plain DDP needs ~16 bytes/parameter per GPU (~207 GB),
#   far over 80 GB, so the recipe's "~75GB per GPU at batch 4" cannot be. This model
#   trains only sharded with activation checkpointing (dist_mode and grad_ckpt below);
#   `train.py config/h100_d64.py --preflight_only=True --gpu_mem_gb=80` prints the
#   per-GPU estimate of both layouts (memory_fit).
# - One token costs 84.2 GFLOP: at an optimistic 40% MFU of the H100 PCIe's 756
#   TFLOP/s, 8 GPUs process ~29k tokens/s, ~3.2B tokens in 31 hours (not "~12B"),
#   about 9 passes over the recipe's 350M-token corpus.
# - $4/GPU-hour x 8 x 31 h = $992, as the recipe says.

# data: the recipe's own text file, character-level (its vocabulary is 32 symbols)
source = "data/combined_output.txt"
tokenizer = "char"
split_paragraphs = True    # one big text file: documents at blank lines, so whole ones can be held out
data_dir = "data/d64_char"
val_fraction = 0.005

# model: depth 64, width 64*64, 32 heads of 128, full multi-head attention
block_size = 2048
n_layer = 64
n_head = 32
n_kv_head = 32
n_embd = 4096
ffn_hidden = None          # floor(8 * 4096 / 3) = 10922 rounded up to a multiple of 256: 11008
tie_embeddings = True

# training: 524,288 tokens per step = 8 GPUs x 8 sequences x 2048 tokens x accumulation 4.
# Micro-batch 8: the planner puts all 64 layers sharded over 8 GPUs at 42.1 GB per GPU, its
# estimate checked at 4 layers on one H100 (docs/LOG.md); fewer, larger micro-steps halve
# FSDP's all-gather traffic per token.
out_dir = "out/h100_d64"
micro_batch_size = 8
total_batch_tokens = 524288
max_steps = 22630          # the recipe's 31 checkpoints x 730 steps
learning_rate = 1.5e-4     # not in the recipe: a conservative AdamW rate for ~13B
min_lr = 1.5e-5
warmup_steps = 500
weight_decay = 0.1
grad_clip = 1.0
# An hour is not 730 steps: preflight's plan (docs/preflight.md's command for this config: 28,746 tokens/s at
# 40% MFU of 8 H100 PCIe) is 18.2 s per step, so 730 steps take 3.7 h and an hour is 197 steps.
eval_every = 197           # about an hour at that plan
ckpt_every_minutes = 60    # every hour by the clock, whatever the throughput turns out to be
log_every = 10
dtype = "bfloat16"
compile = True
# FSDP2 splits weights, gradients and AdamW state over the 8 GPUs (12.9B x 16 bytes / 8), and
# full activation checkpointing keeps one block's activations at a time instead of 64
dist_mode = "fsdp"
grad_ckpt = "full"
# the recipe's limits: 31 hours, $1000 at $4/GPU-hour on 8 GPUs; whichever comes first
# stops the run with a checkpoint. It also warns of overfitting (9 passes over a small
# corpus) and says to use the best checkpoint, not the last: stop after 3 evaluations
# (~3 hours) without a new best validation loss; sample.py takes ckpt/best by default.
max_hours = 31.0
budget_usd = 1000.0
usd_per_gpu_hour = 4.0
early_stop_patience = 3
# the recipe warns under 15% MFU and 30k tokens/s; the corrected plan is 28.7k at 40% MFU (84.2
# GFLOP/token, not its 4.3B's), so 30k would always alarm: the floor is 15% MFU, 10.8k tokens/s
min_mfu = 0.15
warn_tokens_per_sec = 10800.0
# preflight: 8 ranks; the recipe's 32 characters plus BOS, for planning before the data exists
expect_world_size = 8
plan_vocab_size = 33
