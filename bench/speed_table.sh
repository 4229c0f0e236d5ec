#!/usr/bin/env bash
# The speed figures a Hopper pod is judged by, re-measured on one GPU, the most valuable rows first, each probe
# under a time cap so that one hang costs only its own cap (a probe writes its JSON line only at its end):
#   (a) the 1B shape, bf16, the current defaults (fused_loss on, residual stream bf16), micro-batch 12, traced
#   (b) the same with fused_loss=False residual_dtype=float32: the step before issue 46, its before/after
#   (c) master_weights=True: bf16 weights, AdamW on fp32 masters
#   (d) micro-batches 12,16,20,24 in one probe: which the config should use (12 is (a)'s, from the compile cache)
#   (e) fp8 tensorwise with fuse_projections=True, and without; rowwise (at 1B its size rule converts gate/up alone)
#   (f) the 50M shape (traced), and with the fused loss (its config's loss_chunk=0 predates it)
#   (g) ours against transformers' Llama   (h) sharded by FSDP2, one process
#   (i) checkpoint saves, the first and a later one   (j) the 1B run's own step (micro-batch 16, accum 4)
# Caps: compiling the 1B model takes ~40-60 s per shape on an H200, the rest ~10-30 s a probe.
#   bash bench/speed_table.sh OUT             # JSON lines in OUT/bench.jsonl, log OUT/log.txt, gzipped traces OUT/traces
#   BUDGET=480 bash bench/speed_table.sh OUT  # within 480 s: a probe gets what is left of its cap, or is skipped
#                                             # when less than 3/4 of its cap is left
#   FROM=e BUDGET=480 bash bench/speed_table.sh OUT   # from row (e) on: a second session's share
# In a 15-minute GPU session (the machine's start takes a few minutes of it): one command of BUDGET=480 under a
# 540 s command limit measures (a)-(c) and, on an H200's compile times, (d); the log names what was skipped,
# for the next session's FROM. Each setting is a process of its own: a cap then loses one row, and torch.compile
# never meets two models in one process (its recompile limit would fall back to eager unannounced).
# Copy the lines you keep into bench/results/<probe>.jsonl: each holds the device, torch, date, command and keys.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?give a folder for the results, the log and the traces}
PYTHON=${PYTHON:-python3}
BUDGET=${BUDGET:-0}
FROM=${FROM:-a}          # the first row to run (a-j): the rows before it were measured already
CKPT_DIR=${CKPT_DIR:-}   # where the checkpoint probe writes (a scratch folder it removes); "": the run's out_dir
mkdir -p "$OUT/traces"
export PYTHONUNBUFFERED=1
probe() {  # probe ROW SECONDS ARGS...: one probe, its exit status logged, the session going on whatever it was
    local row=$1 cap=$2 full=$2
    shift 2
    if [[ "$row" < "$FROM" ]]; then
        echo "=== ($row) not run (FROM=$FROM): $*"
        return
    fi
    if [ "$BUDGET" -gt 0 ]; then
        local left=$((BUDGET - SECONDS))
        [ "$left" -lt "$cap" ] && cap=$left
        if [ $((4 * left)) -lt $((3 * full)) ]; then  # cut shorter, it would be killed before its line
            echo "=== ($row) skipped (${left}s of the budget left, it needs ~$((full * 3 / 4))s): $*"
            return
        fi
    fi
    echo "=== ($row) [$(date -u +%T) +${SECONDS}s] cap ${cap}s: $*"
    timeout "$cap" $PYTHON "$@" "--out=$OUT/bench.jsonl"
    local rc=$?
    echo "--- ($row) rc=$rc at +${SECONDS}s$([ $rc -eq 124 ] && echo ": killed at its cap, no line written")"
}
{
    nvidia-smi -L
    $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
    FAST=(--device=cuda --grad_ckpts=none --compile=True --warmup=2 --iters=5)
    B1=(bench/mfu.py config/h200_1b_ddp8.py "${FAST[@]}")
    probe a 130 "${B1[@]}" --micro_batches=12 "--trace=$OUT/traces/bf16"
    probe b 110 "${B1[@]}" --micro_batches=12 --fused_loss=False --residual_dtype=float32
    probe c 140 "${B1[@]}" --micro_batches=12 --master_weights=True
    probe d 240 "${B1[@]}" --micro_batches=12,16,20,24
    probe e 150 "${B1[@]}" --micro_batches=12 --fp8=True --fuse_projections=True "--trace=$OUT/traces/fp8"
    probe e 150 "${B1[@]}" --micro_batches=12 --fp8=True
    probe e 150 "${B1[@]}" --micro_batches=12 --fp8=True --fuse_projections=True --fp8_recipe=rowwise "--trace=$OUT/traces/fp8_rowwise"
    probe f 80 bench/mfu.py config/a100_50m.py "${FAST[@]}" --micro_batches=64 "--trace=$OUT/traces/50m"
    probe f 80 bench/mfu.py config/a100_50m.py "${FAST[@]}" --micro_batches=64 --loss_chunk=8192
    probe g 170 bench/vs_hf.py config/h200_1b_ddp8.py --device=cuda --compile=True --micro_batch_size=8 --windows=2 --iters=4
    probe h 120 "${B1[@]}" --micro_batches=12 --dist_mode=fsdp
    probe i 90 bench/ckpt.py config/h200_1b_ddp8.py --device=cuda --saves=2 ${CKPT_DIR:+"--write_dir=$CKPT_DIR"}
    probe j 110 "${B1[@]}" --micro_batches=16 --accum=4
} 2>&1 | tee "$OUT/log.txt"
