# The 1B run's path rehearsed at tiny size on one GPU, before paying for 8x H200: every stage that
# config/h200_1b_ddp8.py runs, on the same code paths (compiled, bf16 on a GPU; the dry run's kill-and-resume and
# its SFT step; the skills pack with worked steps; SFT on packed rows that attend only within themselves, stopped
# by validation; eval, honesty reports, the hand-off bundle, a sample of the bundle's model):
#   CONFIG=config/rehearsal_1b.py bash run.sh
# (Where no GPU is, it runs in fp32 on the CPU: 9m40s on 2 cores, torch 2.13.)
# What differs from the 1B run, and why: the embedded corpus with byte tokens (nothing to download, no tokenizer
# to train), a 3.1M-parameter model, and the research gates: a few minutes of tokens are no release, so
# skill_release would block the train stage and the hand-off.

# data (prepare.py): config/tiny.py's, in the same data_dir (prepared once for both)
source, tokenizer, data_dir = "stdlib", "byte", "data/stdlib_byte"
val_fraction, min_val_tokens = 0.01, 500_000
plan_vocab_size = 257  # the byte tokenizer's 256 bytes and BOS: run.sh's sanity --capacity plans before prepare

# model: 4 layers of 256, GQA 4:1 as the 1B's; a window of 256 bytes holds all but the longest skills rows (~290
# bytes with their worked steps; honesty.md names the cut)
block_size, n_layer, n_embd = 256, 4, 256
n_head, n_kv_head = 4, 1
tie_embeddings = True

# base training: 200 steps of 8,192 tokens
out_dir = "out/rehearsal_1b"
gate_profile = "research"
micro_batch_size, total_batch_tokens, max_steps = 32, 8192, 200
learning_rate, min_lr, warmup_steps = 2e-3, 2e-4, 20
weight_decay, grad_clip = 0.1, 1.0
eval_every, eval_steps, log_every, ckpt_every = 100, 8, 20, 100
compile = True
max_spikes = 1  # the 1B run's done check: one spike warning at most

# the dry run (run.sh's dryrun stage): 20 steps, a kill and resume at step 10, then one step of the SFT stage
dryrun_stage_steps = 20
dryrun_sft = "config/rehearsal_1b_sft.py"

# the skills pack (skills.py) and its evaluation (eval.py): the 1B run's worked steps, fewer rows
pack_dir = "data/skills_rehearsal"
sft_rows, eval_rows, answer_style = 1600, 160, "scratchpad"
max_new_tokens = 128
