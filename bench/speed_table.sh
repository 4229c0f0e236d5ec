#!/usr/bin/env bash
# The speed figures a Hopper pod is judged by, re-measured in one session on one GPU, each probe under a time cap
# so that one hang costs only its own cap: the 1B shape in bf16 and fp8 (with profiler traces), the 50M shape,
# the comparison with transformers' Llama, and checkpoint saves (the first one and later ones).
#   bash bench/speed_table.sh OUT       # JSON lines in OUT/bench.jsonl, the log in OUT/log.txt, traces in OUT/traces
# Copy the lines you keep into bench/results/<probe>.jsonl: each holds the device, torch, date and command.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?give a folder for the results, the log and the traces}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT/traces"
probe() {  # probe SECONDS ARGS...: one probe, its exit status logged, the session going on whatever it was
    local cap=$1
    shift
    echo "=== [$(date -u +%T)] cap ${cap}s: $*"
    timeout "$cap" $PYTHON "$@" "--out=$OUT/bench.jsonl"
    echo "--- rc=$?"
}
{
    nvidia-smi -L
    $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
    FAST=(--device=cuda --grad_ckpts=none --compile=True --warmup=2 --iters=6)
    probe 240 bench/mfu.py config/h200_1b_ddp8.py "${FAST[@]}" --micro_batches=12 "--trace=$OUT/traces/bf16"
    probe 240 bench/mfu.py config/h200_1b_ddp8.py "${FAST[@]}" --micro_batches=12 --fp8=True "--trace=$OUT/traces/fp8"
    probe 120 bench/mfu.py config/a100_50m.py "${FAST[@]}" --micro_batches=64 "--trace=$OUT/traces/50m"
    probe 240 bench/vs_hf.py config/h200_1b_ddp8.py --device=cuda --compile=True --micro_batch_size=8
    probe 240 bench/ckpt.py config/h200_1b_ddp8.py --device=cuda --saves=3
} 2>&1 | tee "$OUT/log.txt"
