# Block diffusion on GSM8K: the BD3-LM baseline on one H200 (141 GB): block discrete diffusion (Arriola et al.,
# "Block Diffusion", ICLR 2025) over "Question: ...\nAnswer: ..." documents of 512 tokens.
#   python prepare.py config/h200_gsm8k_bd3lm.py
#   python train.py config/h200_gsm8k_bd3lm.py
#   python sample.py config/h200_gsm8k_bd3lm.py --prompt="Question: ...
#   Answer:"
#
# From the seed: the "small" model (768 wide, 12 layers: 85.0M non-embedding parameters, 123.6M with the
# tied GPT-2 embedding of 50,257 tokens + [MASK]), micro-batch 128, global batch 512 (accumulation 4),
# LR 5e-4, 50K steps, bf16, compile, FlashAttention where it applies (bd3lm's mask: FlexAttention, which
# auto picks on a GPU), gradient checkpointing only when memory runs short.
# The recipe's four batch presets are batch_preset's (podgpt/research/bd3lm.py: PRESETS; train.py --help
# lists them): each sets the micro-batch, the global batch at accumulation 4, the recipe's LR for it and its
# rule lr_base x sqrt(batch / lr_base_batch), which preflight's lr_scaling checks; a key set here wins.
# memory.memory_estimate per H200 at each (bf16 and its bf16 residual stream, the fused loss, no
# checkpointing; the recipe's expectation in brackets): conservative 64: 29.7 GB [40-50] | recommended 128:
# 52.5 GB [60-80] | aggressive 192: 75.4 GB [90-110] | extreme 256: 98.2 GB [110-130], 76% of the usable
# 0.92 x 141 GB. The recipe's LR per global batch: 256: 4e-4, 512: 5e-4, 768: none given
# (the preset takes its square-root rule: 7.3e-4), 1024: 7e-4.
# The recipe's num_workers=16 has no counterpart: podgpt's loader reads memory-mapped shards in the
# training process (bench/loader.py measures its rate against the GPU's).
# Not in the recipe, chosen here: the tokenizer (GPT-2's), the block length, the warmup (the recipe's
# troubleshooting says "instead of 5000"), the evaluation cadence, the early stop and the price.

# data: GSM8K's own split (its 7,473 training problems, and its 1,319 test problems as validation), each
# problem one document of exactly 512 tokens (BOS-padded; prepare.py prints how many it had to cut)
source = "gsm8k"
tokenizer = "gpt2"
gsm8k_format = "qa"
segments = "512"
data_dir = "data/gsm8k_qa_gpt2"
min_val_tokens = 0

# model
block_size = 512
n_layer = 12
n_head = 12
n_kv_head = 12
n_embd = 768
objective = "bd3lm"
diffusion_block = 16        # BD3-LM's paper trains blocks of 4, 8 and 16; 16 denoises 16 tokens per pass
noise_schedule = "loglinear"

# training: 512 problems per step = 128 x 512 tokens x accumulation 4 on one GPU, LR 5e-4
out_dir = "out/h200_gsm8k_bd3lm"
batch_preset = "recommended"
max_steps = 50000
min_lr = 5e-5
warmup_steps = 5000
# 50K steps of 512 problems are 3,425 passes over GSM8K's 7,473: the recipe's plan, which preflight's
# corpus_model_fit gate would block (above 100 passes) unless it is said here. The early stop ends the run
# once the validation loss has not improved for 10 evaluations (10,000 steps)
max_epochs = 3500
eval_every = 1000
eval_steps = 4              # x 128 = 512 of the 1,319 test problems per evaluation
eval_gsm8k_samples = 64     # and the accuracy of greedy answers to the first 64 of them (each a few hundred passes)
early_stop_patience = 10
# the recipe's expectation, 50K steps in 12-18 h: slower than its 18 h (50,000 x 262,144 tokens in
# 64,800 s) for alarm_minutes is an alarm event
warn_tokens_per_sec = 202272
ckpt_every = 1000
compile = True
dtype = "bfloat16"
usd_per_gpu_hour = 4.5      # the recipe's "~$4-5/hour"
plan_vocab_size = 50257     # GPT-2's vocabulary, for planning before the data is prepared ([MASK] is added)

# sampling (sample.py): the answer after a question, a block of 16 at a time
max_new_tokens = 384
temperature = 0.0
