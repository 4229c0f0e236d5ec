# The 1B run: the 1.1B "h200-1b-ddp8" model on 8x H200 under DDP, ClimbMix data.
#   python prepare.py config/h200_1b_ddp8.py
#   torchrun --standalone --nproc_per_node=8 train.py config/h200_1b_ddp8.py
#
# Shape from its recipe: 24 layers x 2048, GQA 16:4, context 2048, tied 32768 vocabulary.
# The recipe's SwiGLU hidden floor(8d/3) = 5461 is not a multiple of 64: on an H100 those
# matmuls ran at 125-146 TFLOP/s against 704 for the LM head. Here it is rounded up to a
# multiple of 256 (multiple_of, Llama's rule): 5632, 1.149B parameters (1.082B
# non-embedding; the recipe's 1.124B), 8.10 GFLOP/token (model.py; tests/test_model.py).
# The recipe's ~22.4B planned tokens (its ~20 per parameter; 19.5 at 1.149B) with 2^20
# tokens per step is 21,362 steps.
# Not in the recipe, chosen here: the batch size, micro-batch and learning rates.
# data: the 1B run's ClimbMix import (climbmix-import --shards 2048 --max-rows 10000000 --min-chars 100), and a BPE
# vocabulary of 32768 trained on the corpus itself
source = "climbmix"
max_shards = 2048          # the first 2,048 of the preset's 6,543 files
max_docs = 10_000_000      # at most 10M documents, counted after min_chars drops the shorter ones
min_chars = 100
tokenizer = "bpe:32768"
data_dir = "data/climbmix_bpe32k"
val_fraction = 0.001

# model
block_size = 2048
n_layer = 24
n_head = 16
n_kv_head = 4
n_embd = 2048
ffn_hidden = None          # floor(8 * 2048 / 3) = 5461 rounded up to a multiple of 256: 5632
tie_embeddings = True

# training: 2^20 tokens per step = 8 GPUs x 16 sequences x 2048 tokens x accumulation 4.
# Micro-batch 16: measured memory on one H100 scaled by the planner to a 141 GB H200, 78% of
# the usable memory (docs/LOG.md; bench/results/).
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
# preflight (train.py --preflight_only=True): the recipe's 8 ranks, and its vocabulary
# for planning before the data is prepared
expect_world_size = 8
plan_vocab_size = 32768
# the recipe's release gates (docs/preflight.md): its full run is judged under skill_release, with the skills pack
# below, made before the data so that prepare.py counts the eval rows the corpus holds (run.sh: STAGES="skills
# prepare dryrun train"); the dry run (dryrun_steps) always runs under research, where 100 steps are no release
gate_profile = "skill_release"
# the recipe's dry run (run.sh's dryrun stage, or train.py --dryrun_steps=100): 100 steps on the 8 ranks, a kill
# and resume at step 50, then one step of the SFT stage on the skills pack's rows; it fails on a spike, a
# non-finite step, a rank that did not run every step or a loss that rose
dryrun_stage_steps = 100
dryrun_sft = "config/h200_1b_ddp8_sft.py"
# the recipe's DDP timeout: a rank left waiting on a hung one fails after 120 minutes (the default, 30)
ddp_timeout_minutes = 120
# the release skills pack (skills.py, run.sh's skills stage): the recipe's 1,600 SFT rows and 320 eval rows,
# answered with worked steps; the eval stage asks the eval rows of the base (and a fine-tuned) checkpoint
pack_dir = "data/skills_1b"
sft_rows = 1600
eval_rows = 320
answer_style = "scratchpad"
# the recipe's dry run watches for "no repeated spike warnings above the threshold": one at most
max_spikes = 1
