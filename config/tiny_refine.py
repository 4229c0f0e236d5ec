# The deep-supervision refinement recipe on the embedded default's data, CPU-sized: a tiny byte-level model run
# recursively (podgpt/research/refine.py: Refine) with deep supervision. It shows on a 2-core CPU what the H100 presets
# (config/h100_trm_fast.py, config/h100_trm_extreme.py) are for: the validation loss falls from each
# supervision step to the next (the console's "steps a -> b -> c (x% refined)", metrics.jsonl's
# val_sup_loss_<i>, plots/refinement.png).
# Prepare the data as config/tiny.py does (bash run.sh, or python prepare.py config/tiny.py).

# data (prepare.py): config/tiny.py's
source = "stdlib"
tokenizer = "byte"
plan_vocab_size = 257       # the byte tokenizer's 256 bytes and BOS: run.sh's sanity --capacity plans before prepare
data_dir = "data/stdlib_byte"
min_val_tokens = 500_000

# model: one layer, 64 wide, applied n_sup_train = 3 times per forward (n_loops=0: no latent updates). One
# layer, so that each supervision step adds depth the first one lacks (a second layer's attention composes
# with the first's: copying a name seen earlier in the file needs both). At this size the latent loops
# cost twice the time and refine less, so n_loops=0 here (docs/LOG.md); the H100 configs keep refine.py's
# 2, podgpt's choice (the recipe gives no n_loops).
block_size = 128
n_layer = 1
n_head = 4
n_kv_head = 2
n_embd = 64
objective = "refine"
n_loops = 0
n_sup_train = 3
n_sup_inference = 3
refine_preset = "aggressive"   # the recipe's phase 1

# training
out_dir = "out/tiny_refine"
micro_batch_size = 16
total_batch_tokens = 2048
max_steps = 250
learning_rate = 2e-3
min_lr = 2e-4
warmup_steps = 20
eval_every = 50
eval_steps = 8
log_every = 10
ckpt_every = 100
device = "cpu"
dtype = "float32"

# sampling (sample.py)
prompt = "def "
max_new_tokens = 200
