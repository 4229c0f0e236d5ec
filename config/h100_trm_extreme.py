# Deep-supervision refinement, phase 2 ("extreme"): the production model, once phase 1 (config/h100_trm_fast.py) showed
# refinement working. The same model, data and recipe (the comments there say where each number comes
# from); what changes is the recipe's phase-2 table: the extreme preset, half the batch, 5x the steps,
# half the learning rates.
#   torchrun --standalone --nproc_per_node=8 train.py config/h100_trm_extreme.py
# The recipe expects 50-97% refinement and gradient norms of 2-15 ("if >20: reduce LR or increase
# grad_clip"; NaN: go back to the aggressive preset).

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

# training: the recipe's phase 2 is refine_phase="extreme" (podgpt/research/refine.py: PRESETS; train.py
# --help lists it): 8 GPUs x 16 sequences x accumulation 2 = 256 sequences per step, 5000 steps, Muon at
# matrix LR 5e-4 and AdamW at embedding LR 5e-3 (embedding, head, norms), the extreme refine_preset
# (supervision_weight_base 10, improvement_reward_scale 2); a key set here wins. Compile and bf16: below
out_dir = "out/h100_trm_extreme"
refine_phase = "extreme"
min_lr = 5e-5                  # not in the recipe: a tenth of the phase's peak, as the other configs
warmup_steps = 200             # podgpt's: the recipe gives no warmup ("check warmup is working")
grad_clip = 1.0                # the recipe's troubleshooting: "grad_clip=1.0"
# done (the recipe's phase 2): 50-97% refinement, gradient norms 2-15 ("higher but stable"); over 20
# it says reduce LR: stop there with a checkpoint
refine_band = "50,97"
grad_norm_band = "2,15"
grad_norm_stop = 20.0
# 12 layers x (2 + 1) applications x 4 steps = 144 block applications per token. memory.memory_estimate at
# micro-batch 16 (train.py --preflight_only=True --gpu_mem_gb=80): 97.3 GB per GPU without activation
# checkpointing, 58.4 GB with selective (of 73.6 usable), 17.3 GB with full. Selective recomputes
# only the cheap ops, so it is the faster of the two that fit (phase 1's micro-batch 32 needs full)
grad_ckpt = "selective"
eval_every = 250           # not in the recipe: 20 validations, each with the losses per supervision step to watch
eval_steps = 20            # not in the recipe: 20 x 8 ranks x micro-batch x 1024 tokens per validation
log_every = 10             # not in the recipe: the console line with the training losses per step
ckpt_every = 500           # not in the recipe: a preemption loses at most this many steps (saves run in the background)
dtype = "bfloat16"
compile = True
expect_world_size = 8      # the recipe's 8 GPUs: preflight blocks another count (--expect_world_size=0: any)
plan_vocab_size = 50257    # GPT-2's vocabulary, for planning before the data is prepared
