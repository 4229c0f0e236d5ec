# Block diffusion on GSM8K: HDP-Diffusion on one H200 (141 GB): hierarchical plan-then-execute block diffusion.
# Each 512-token row is a question (128 tokens, never noised, seeing only itself), a plan (128) and an
# execution (256); the plan sees the question, the execution both, the plan never the execution, and block
# diffusion runs within plan and execution (model.py: BlockDiffusion, GPTConfig.hdp_segments).
#   python prepare.py config/h200_hdp_diffusion.py
#   python train.py config/h200_hdp_diffusion.py
#   python sample.py config/h200_hdp_diffusion.py --prompt="<a GSM8K question>"
#
# The recipe's settings are config/h200_gsm8k_bd3lm.py's (micro-batch 128, global 512, LR 5e-4, 50K steps,
# bf16, compile); its memory expectation here is 70-90 GB at micro-batch 128, and memory.memory_estimate
# gives 52.5 GB, as for the baseline: the plan's mask changes which tiles attention skips, not what it keeps.
# The batch presets (batch_preset), the LR table and what is not in the recipe: see
# config/h200_gsm8k_bd3lm.py.

# data: a GSM8K problem as three segments, each BOS-padded or cut to its length (prepare.py prints the share
# of problems cut): the question; the plan, the answer's reasoning without its <<calculator>> annotations;
# the execution, the annotated reasoning and the final "#### <number>"
source = "gsm8k"
tokenizer = "gpt2"
gsm8k_format = "hdp"
segments = "128,128,256"
data_dir = "data/gsm8k_hdp_gpt2"
min_val_tokens = 0

# model
block_size = 512
n_layer = 12
n_head = 12
n_kv_head = 12
n_embd = 768
objective = "bd3lm"
hdp_segments = "128,128,256"
diffusion_block = 16        # divides the plan (128) and the execution (256)
noise_schedule = "loglinear"

# training: as config/h200_gsm8k_bd3lm.py
out_dir = "out/h200_hdp_diffusion"
batch_preset = "recommended"   # micro-batch 128, global 512 (accumulation 4), LR 5e-4
max_steps = 50000
min_lr = 5e-5
warmup_steps = 5000
max_epochs = 3500           # 50K steps are 3,425 passes over the 7,473 training problems (the recipe's plan)
eval_every = 1000
eval_steps = 4
eval_gsm8k_samples = 64     # and the accuracy of greedy answers to the first 64 of them (each a few hundred passes)
early_stop_patience = 10
# the recipe's expectation, 50K steps in 12-18 h: slower than its 18 h (50,000 x 262,144 tokens in
# 64,800 s) for alarm_minutes is an alarm event
warn_tokens_per_sec = 202272
ckpt_every = 1000
compile = True
dtype = "bfloat16"
usd_per_gpu_hour = 4.5
plan_vocab_size = 50257     # GPT-2's vocabulary, for planning before the data is prepared ([MASK] is added)

# sampling (sample.py): the question is the prompt; then the plan and the execution, 16 tokens at a time
max_new_tokens = 384
temperature = 0.0
