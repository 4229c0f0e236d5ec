#!/usr/bin/env bash
# podgpt end to end: sanity -> prepare -> dryrun -> train -> sample.
#
#   bash run.sh                                   # the embedded default (config/tiny.py), CPU, ~7 minutes
#   CONFIG=config/a100_50m.py bash run.sh
#   CONFIG=config/h200_1b_ddp8.py NPROC=8 bash run.sh --max_steps=2000
#
# Environment (all optional):
#   CONFIG        config file read by every stage (default config/tiny.py)
#   NPROC         processes per node; > 1 runs dryrun and train under torchrun (DDP)
#   DATA_DIR      overrides the config's data_dir (prepare, dryrun, train)
#   OUT_DIR       overrides the config's out_dir (sanity, train, sample; the dry run uses OUT_DIR/dryrun)
#   STAGES        stages to run, in order (default "sanity prepare dryrun train sample")
#   PREPARE_ARGS  extra --key=val for prepare.py, e.g. "--max_docs=1000 --workers=4"
#   SAMPLE_ARGS   extra --key=val for sample.py, e.g. "--num_samples=3"
#   DRYRUN_STEPS  optimizer steps of the dry run (default 20)
#   PYTHON        the interpreter (default python)
# Arguments after run.sh are --key=val overrides for train.py (dry run included).
set -euo pipefail
export PYTHONUNBUFFERED=1  # stage output in order, also when piped to a log
cd "$(dirname "$0")"

CONFIG=${CONFIG:-config/tiny.py}
NPROC=${NPROC:-1}
STAGES=${STAGES:-sanity prepare dryrun train sample}
DRYRUN_STEPS=${DRYRUN_STEPS:-20}
PYTHON=${PYTHON:-python}
TRAIN_ARGS=("$@")
[[ -n ${DATA_DIR:-} ]] && TRAIN_ARGS+=("--data_dir=$DATA_DIR")
# the run's out_dir as train.py resolves it from the config and the overrides
OUT=${OUT_DIR:-$($PYTHON -c 'import sys, configurator; print(configurator.parse("train.py", sys.argv[1:])["out_dir"])' \
    "$CONFIG" "${TRAIN_ARGS[@]}")}

if [[ $NPROC -gt 1 ]]; then
    LAUNCH=($PYTHON -m torch.distributed.run --standalone "--nproc_per_node=$NPROC")
else
    LAUNCH=($PYTHON)
fi

stage() {
    local name=$1
    shift
    echo "=== $name: $*"
    if ! "$@"; then
        echo "run.sh: stage '$name' failed (command: $*)" >&2
        exit 1
    fi
}

for s in $STAGES; do
    case $s in
        sanity)  stage sanity $PYTHON sanity.py "$CONFIG" "--out_dir=$OUT" ;;
        prepare) stage prepare $PYTHON prepare.py "$CONFIG" ${DATA_DIR:+"--data_dir=$DATA_DIR"} ${PREPARE_ARGS:-} ;;
        dryrun)  stage dryrun "${LAUNCH[@]}" train.py "$CONFIG" "${TRAIN_ARGS[@]}" "--out_dir=$OUT/dryrun" \
                     --resume=never "--max_steps=$DRYRUN_STEPS" "--eval_every=$DRYRUN_STEPS" "--ckpt_every=$DRYRUN_STEPS" ;;
        train)   stage train "${LAUNCH[@]}" train.py "$CONFIG" "${TRAIN_ARGS[@]}" "--out_dir=$OUT" ;;
        sample)  stage sample $PYTHON sample.py "$CONFIG" "--out_dir=$OUT" ${SAMPLE_ARGS:-} ;;
        *) echo "run.sh: unknown stage '$s' in STAGES (choose from: sanity prepare dryrun train sample)" >&2; exit 2 ;;
    esac
done
echo "=== done: $OUT"
