#!/usr/bin/env bash
# The speed figures a Hopper pod is judged by, re-measured in one session on one GPU, each probe under a time cap
# so that one hang costs only its own cap: the 1B shape in bf16 and fp8 (with profiler traces) and sharded by
# FSDP2 (bf16 weights), the 1B run's own step (its micro-batch and accumulation), the 50M shape, the comparison
# with transformers' Llama, and checkpoint saves (the first one and a later one).
#   bash bench/speed_table.sh OUT             # JSON lines in OUT/bench.jsonl, log OUT/log.txt, gzipped traces OUT/traces
#   BUDGET=500 bash bench/speed_table.sh OUT    # all of it within 500 s: a probe gets what is left of its cap, or is skipped
# Copy the lines you keep into bench/results/<probe>.jsonl: each holds the device, torch, date and command.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?give a folder for the results, the log and the traces}
PYTHON=${PYTHON:-python3}
BUDGET=${BUDGET:-0}
CKPT_DIR=${CKPT_DIR:-}   # where the checkpoint probe writes (a scratch folder it removes); "": the run's out_dir
mkdir -p "$OUT/traces"
export PYTHONUNBUFFERED=1
probe() {  # probe SECONDS ARGS...: one probe, its exit status logged, the session going on whatever it was
    local cap=$1
    shift
    if [ "$BUDGET" -gt 0 ]; then
        local left=$((BUDGET - SECONDS))
        [ "$left" -lt "$cap" ] && cap=$left
        if [ "$cap" -lt 30 ]; then
            echo "=== skipped (${left}s of the budget left): $*"
            return
        fi
    fi
    echo "=== [$(date -u +%T) +${SECONDS}s] cap ${cap}s: $*"
    timeout "$cap" $PYTHON "$@" "--out=$OUT/bench.jsonl"
    echo "--- rc=$? at +${SECONDS}s"
}
{
    nvidia-smi -L
    $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
    FAST=(--device=cuda --grad_ckpts=none --compile=True --warmup=2 --iters=5)
    probe 120 bench/mfu.py config/h200_1b_ddp8.py "${FAST[@]}" --micro_batches=12 "--trace=$OUT/traces/bf16"
    probe 150 bench/mfu.py config/h200_1b_ddp8.py "${FAST[@]}" --micro_batches=12 --fp8=True "--trace=$OUT/traces/fp8"
    probe 100 bench/mfu.py config/h200_1b_ddp8.py "${FAST[@]}" --micro_batches=12 --dist_mode=fsdp
    probe 100 bench/mfu.py config/h200_1b_ddp8.py "${FAST[@]}" --micro_batches=16 --accum=4
    probe 70 bench/mfu.py config/a100_50m.py "${FAST[@]}" --micro_batches=64 "--trace=$OUT/traces/50m"
    probe 90 bench/ckpt.py config/h200_1b_ddp8.py --device=cuda --saves=2 ${CKPT_DIR:+"--write_dir=$CKPT_DIR"}
    probe 150 bench/vs_hf.py config/h200_1b_ddp8.py --device=cuda --compile=True --micro_batch_size=8 --windows=2 --iters=4
} 2>&1 | tee "$OUT/log.txt"
