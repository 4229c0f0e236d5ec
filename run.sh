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
#
# SIGTERM, SIGINT or SIGUSR1 to run.sh (a preemption notice) reaches the running stage:
# train.py saves a checkpoint at the next step and exits, and run.sh stops there with
# exit 0; the same command later resumes. So does a run that a guard (max_hours,
# budget_usd, budget_file) stopped.
set -euo pipefail
export PYTHONUNBUFFERED=1  # stage output in order, also when piped to a log
# torchrun forwards only SIGTERM/SIGINT/SIGHUP/SIGQUIT by default; SLURM's notice is SIGUSR1
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
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

# the stage runs in the background so that a signal reaches this script's trap at once
CHILD=
trap '[[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null' TERM
trap '[[ -n $CHILD ]] && kill -INT "$CHILD" 2>/dev/null' INT
trap '[[ -n $CHILD ]] && kill -USR1 "$CHILD" 2>/dev/null' USR1

# "stopped <reason>" when train.py wrote summary.json into $1 after time $2 and stopped early
stopped() {
    $PYTHON - "$1/summary.json" "$2" <<'PY' 2>/dev/null
import json, os, sys
path, since = sys.argv[1], float(sys.argv[2])
if os.path.exists(path) and os.path.getmtime(path) >= since:
    s = json.load(open(path))
    if s["status"] == "stopped":
        print(f"stopped at step {s['steps']} ({s['stop_reason']})")
PY
}

stage() {
    local name=$1 rc=0 since
    shift
    echo "=== $name: $*"
    since=$(date +%s)
    "$@" &
    CHILD=$!
    while kill -0 "$CHILD" 2>/dev/null; do wait "$CHILD" || true; done  # a trapped signal ends wait early
    wait "$CHILD" || rc=$?
    CHILD=
    if [[ $name == train || $name == dryrun ]]; then
        local out=$OUT
        [[ $name == dryrun ]] && out=$OUT/dryrun/first
        local why
        why=$(stopped "$out" "$since")
        if [[ -n $why ]]; then  # torchrun itself exits non-zero after forwarding a signal
            echo "run.sh: $name $why; run the same command to resume"
            exit 0
        fi
    fi
    if [[ $rc -ne 0 ]]; then
        echo "run.sh: stage '$name' failed (command: $*)" >&2
        exit 1
    fi
}

for s in $STAGES; do
    case $s in
        sanity)  stage sanity "${LAUNCH[@]}" sanity.py "$CONFIG" "--out_dir=$OUT" ${DATA_DIR:+"--data_dir=$DATA_DIR"} ;;
        prepare) stage prepare $PYTHON prepare.py "$CONFIG" ${DATA_DIR:+"--data_dir=$DATA_DIR"} ${PREPARE_ARGS:-} ;;
        dryrun)  stage dryrun "${LAUNCH[@]}" train.py "$CONFIG" "${TRAIN_ARGS[@]}" "--out_dir=$OUT/dryrun" \
                     "--dryrun_steps=$DRYRUN_STEPS" ;;
        train)   stage train "${LAUNCH[@]}" train.py "$CONFIG" "${TRAIN_ARGS[@]}" "--out_dir=$OUT" ;;
        sample)  stage sample $PYTHON sample.py "$CONFIG" "--out_dir=$OUT" ${SAMPLE_ARGS:-} ;;
        *) echo "run.sh: unknown stage '$s' in STAGES (choose from: sanity prepare dryrun train sample)" >&2; exit 2 ;;
    esac
done
echo "=== done: $OUT"
