# Deep-supervision refinement, phase 1 ("fast"): check on 8x H100 that refinement works before paying for phase 2
# (config/h100_trm_extreme.py). The recipe's system is nanochat with a "TRM" objective; here it is
# objective="refine" (podgpt/research/refine.py: Refine), with the recipe's settings where it gives them.
#   python prepare.py config/h100_trm_fast.py
#   torchrun --standalone --nproc_per_node=8 train.py config/h100_trm_fast.py
# Watch the console's "steps a -> b -> c -> d (x% refined)" on every validation line: the recipe's
# success criteria are the order step_0 > step_1 > step_2 > step_3, 15-25% refinement, gradient
# norms 0.5-1.5 and a smooth loss; a refinement_order warning says when the order breaks.

# data: not in the recipe; nanochat trains on FineWeb-EDU. GPT-2's tokenizer (no tokenizer to train;
# nanochat's own is a 65536-entry BPE)
source = "fineweb-edu-10bt"
tokenizer = "gpt2"
data_dir = "data/fineweb_edu_gpt2"
val_fraction = 0.001       # not in the recipe: 0.1% of FineWeb-EDU is ~10M tokens, ample for eval_steps

# model: the recipe's depth 12; the width nanochat gives depth 12 (64 x depth = 768) with its
# 128-wide heads; n_sup_train=4 for the recipe's step_0..step_3. The recipe gives no n_loops,
# T_recursion or detach_threshold: 2, 1 and 2 are podgpt's choices (refine.py's defaults)
block_size = 1024           # the recipe's "standard" sequence length (it suggests 2048 as 2x)
n_layer = 12
n_head = 6
n_kv_head = 6              # nanochat at depth 12 has no grouped-query attention
n_embd = 768
objective = "refine"
n_loops = 2
T_recursion = 1
n_sup_train = 4
n_sup_inference = 4
detach_threshold = 2

# training: the recipe's phase 1 is refine_phase="fast" (podgpt/research/refine.py: PRESETS; train.py
# --help lists it): 8 GPUs x 32 sequences x accumulation 2 = 512 sequences per step, 1000 steps, Muon at
# matrix LR 1e-3 and AdamW at embedding LR 1e-2 (embedding, head, norms), the aggressive refine_preset
# (supervision_weight_base 5, improvement_reward_scale 1); a key set here wins. Compile and bf16: below
out_dir = "out/h100_trm_fast"
refine_phase = "fast"
min_lr = 1e-4                  # not in the recipe: a tenth of the phase's peak, as the other configs
warmup_steps = 100             # podgpt's: the recipe gives no warmup ("check warmup is working")
grad_clip = 1.0                # the recipe's troubleshooting: "grad_clip=1.0"
# done (the recipe's success criteria for the aggressive preset): 15-25% refinement, gradient norms
# 0.5-1.5; over 20 it says reduce LR: stop there with a checkpoint
refine_band = "15,25"
grad_norm_band = "0.5,1.5"
grad_norm_stop = 20.0
# 12 layers x (2 + 1) applications x 4 steps = 144 block applications per token. memory.memory_estimate at
# micro-batch 32 (train.py --preflight_only=True --gpu_mem_gb=80): 187.3 GB per GPU without activation
# checkpointing, 109.7 GB with selective, 27.5 GB with full (of 73.6 usable): full, as the recipe's
# batch of 32 per GPU needs it
grad_ckpt = "full"
eval_every = 100           # not in the recipe: 10 validations, each with the losses per supervision step to watch
eval_steps = 20            # not in the recipe: 20 x 8 ranks x micro-batch x 1024 tokens per validation
log_every = 10             # not in the recipe: the console line with the training losses per step
ckpt_every = 250           # not in the recipe: a preemption loses at most this many steps (saves run in the background)
dtype = "bfloat16"
compile = True
expect_world_size = 8      # the recipe's 8 GPUs: preflight blocks another count (--expect_world_size=0: any)
plan_vocab_size = 50257    # GPT-2's vocabulary, for planning before the data is prepared
