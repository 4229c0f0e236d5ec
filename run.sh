#!/usr/bin/env bash
# podgpt end to end: sanity -> prepare -> dryrun -> train -> sample.
#
#   bash run.sh                                   # the embedded default (config/tiny.py), CPU, ~7 minutes
#   CONFIG=config/a100_50m.py bash run.sh
#   CONFIG=config/h200_1b_ddp8.py NPROC=8 bash run.sh --max_steps=2000
#   # two nodes of 8 GPUs: the same command on each, NODE_RANK=0 on the node at MASTER_ADDR, 1 on the other
#   CONFIG=config/h200_1b_ddp8.py NPROC=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash run.sh
#
# Environment (all optional):
#   CONFIG        config file read by every stage (default config/tiny.py)
#   NPROC         processes per node; > 1 runs sanity, dryrun and train under torchrun (DDP)
#   NNODES        nodes in the run (default 1); > 1 runs sanity, dryrun and train under torchrun on every node
#   NODE_RANK     this node's index, 0..NNODES-1 (default 0); node 0 holds ranks 0..NPROC-1
#   MASTER_ADDR   address of node 0 that every node reaches; required when NNODES > 1
#   MASTER_PORT   port on node 0 for the rendezvous (default 29500)
#   RDZV_ID       the job's name, the same on every node (default podgpt)
#   MAX_RESTARTS  times torchrun re-launches a failed train stage (default 0); each restart resumes
#                 from the latest checkpoint (train.py's resume=auto); > 0 uses torchrun on one node too
#   DATA_DIR      overrides the config's data_dir (prepare, dryrun, train)
#   OUT_DIR       overrides the config's out_dir (sanity, train, sample; the dry run uses OUT_DIR/dryrun)
#   STAGES        stages to run, in order (default "sanity prepare dryrun train sample")
#   PREPARE_ARGS  extra --key=val for prepare.py, e.g. "--max_docs=1000 --workers=4"
#   SAMPLE_ARGS   extra --key=val for sample.py, e.g. "--num_samples=3"
#   DRYRUN_STEPS  optimizer steps of the dry run (default 20)
#   PYTHON        the interpreter (default python)
# Arguments after run.sh are --key=val overrides for train.py (dry run included).
#
# Several nodes: start run.sh on every node with the same CONFIG, NPROC, NNODES, MASTER_ADDR,
# MASTER_PORT, RDZV_ID, STAGES and arguments, and its own NODE_RANK. Every torchrun stage (sanity,
# dryrun, train) is a rendezvous that waits up to 10 minutes for all nodes. Where the files live:
#   - data: each node runs prepare into its own DATA_DIR, since pods rarely share a filesystem.
#     prepare.py is deterministic, so the copies are identical given the same source and image
#     (train.py checks the data's fingerprint against a checkpoint's). When prepare takes long, run
#     STAGES=prepare on every node first, then the other stages. On a DATA_DIR that all nodes share,
#     run STAGES=prepare on one node only, then the other stages everywhere.
#   - out: rank 0, on node 0, writes metrics, checkpoints and the summary into node 0's OUT_DIR, and
#     sample runs on node 0 only. But every rank reads the checkpoint it resumes from in its own
#     OUT_DIR, so the dryrun stage, a resume (MAX_RESTARTS, or the same command again) and train.py's
#     rollbacks need one OUT_DIR that every node sees (a shared volume; there, with MAX_RESTARTS > 0,
#     rank 0 may be on any node, see below). On node-local OUT_DIRs only a fresh training works:
#     STAGES="sanity prepare train sample".

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
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-podgpt}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [[ ! -f $CONFIG ]]; then
    echo "run.sh: CONFIG=$CONFIG: no such file (give a config file, e.g. CONFIG=config/tiny.py)" >&2
    exit 2
fi
for v in NPROC NNODES NODE_RANK MASTER_PORT MAX_RESTARTS; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { echo "run.sh: $v=${!v} is not a whole number" >&2; exit 2; }
done
if [[ $NNODES -gt 1 && -z ${MASTER_ADDR:-} ]]; then
    echo "run.sh: NNODES=$NNODES needs MASTER_ADDR, the address of node 0 (NODE_RANK=0) that every node reaches" >&2
    exit 2
fi
if [[ $NPROC -lt 1 || $NNODES -lt 1 || $NODE_RANK -ge $NNODES ]]; then
    echo "run.sh: need NPROC >= 1, NNODES >= 1 and NODE_RANK < NNODES (got $NPROC, $NNODES, $NODE_RANK)" >&2
    exit 2
fi
TRAIN_ARGS=("$@")
[[ -n ${DATA_DIR:-} ]] && TRAIN_ARGS+=("--data_dir=$DATA_DIR")
# the run's out_dir as train.py resolves it from the config and the overrides
OUT=${OUT_DIR:-$($PYTHON -c 'import sys, configurator, util
util.run_main(lambda argv: print(configurator.configure("train.py", argv).out_dir), sys.argv[1:])' \
    "$CONFIG" "${TRAIN_ARGS[@]}")}

# How torchrun is launched. Several nodes use the static rendezvous (--node_rank, --master_addr,
# --master_port): node NODE_RANK holds ranks NODE_RANK*NPROC .. NODE_RANK*NPROC+NPROC-1, so rank 0,
# which writes the metrics and checkpoints, is on node 0. The c10d rendezvous ignores --node_rank and
# numbers the nodes by sorting their host names (then process ids): rank 0 could be on any node.
# Restarts (MAX_RESTARTS > 0, train stage only: a failed check or dry run would fail again) need more:
#   - a static rendezvous keeps one TCP store across restarts, and the restarted workers find the
#     dead ones' addresses in it and hang or fail (torch 2.13, measured), so a train stage with
#     restarts on several nodes uses c10d; the restart resumes from OUT_DIR, which then has to be
#     a folder every node sees anyway (see the top);
#   - the same happens on one node, where by default the workers share torchrun's own TCP store
#     (measured; pytorch/pytorch#135712): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt
#     a store of its own.
TORCHRUN=($PYTHON -m torch.distributed.run)
if [[ $NNODES -gt 1 ]]; then
    NODES=("--nnodes=$NNODES" "--nproc_per_node=$NPROC" "--rdzv_id=$RDZV_ID")
    LAUNCH=("${TORCHRUN[@]}" "${NODES[@]}" --rdzv_backend=static "--node_rank=$NODE_RANK"
            "--master_addr=$MASTER_ADDR" "--master_port=$MASTER_PORT")
    RESTARTING=("${TORCHRUN[@]}" "${NODES[@]}" --rdzv_backend=c10d "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT")
elif [[ $NPROC -gt 1 ]]; then
    LAUNCH=("${TORCHRUN[@]}" --standalone "--nproc_per_node=$NPROC")
    RESTARTING=("${LAUNCH[@]}")
else
    LAUNCH=($PYTHON)
    RESTARTING=("${TORCHRUN[@]}" --standalone --nproc_per_node=1)  # restarts need torchrun, even for one process
fi
TRAIN_LAUNCH=("${LAUNCH[@]}")
if [[ $MAX_RESTARTS -gt 0 ]]; then
    TRAIN_LAUNCH=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "${RESTARTING[@]}" "--max_restarts=$MAX_RESTARTS")
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
        train)   stage train "${TRAIN_LAUNCH[@]}" train.py "$CONFIG" "${TRAIN_ARGS[@]}" "--out_dir=$OUT" ;;
        sample)  if [[ $NODE_RANK -eq 0 ]]; then
                     stage sample $PYTHON sample.py "$CONFIG" "--out_dir=$OUT" ${SAMPLE_ARGS:-}
                 else
                     echo "=== sample: skipped on node $NODE_RANK (node 0 holds the checkpoints and samples)"
                 fi ;;
        *) echo "run.sh: unknown stage '$s' in STAGES (choose from: sanity prepare dryrun train sample)" >&2; exit 2 ;;
    esac
done
echo "=== done: $OUT"
