#!/usr/bin/env bash
# podgpt end to end: sanity -> prepare -> dryrun -> train -> sample; with a skills pack (a config that sets
# pack_dir): sanity -> skills -> prepare -> dryrun -> train -> sft -> eval -> handoff -> sample.
#
#   bash run.sh                                   # the embedded default (config/tiny.py), CPU, ~7 minutes
#   CONFIG=config/tiny_skills.py bash run.sh      # the skills path on a CPU, to the hand-off bundle
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
#   DATA_DIR      overrides the config's data_dir (prepare, dryrun, train, eval)
#   OUT_DIR       overrides the config's out_dir (sanity, train, sample; the dry run uses OUT_DIR/dryrun)
#   STAGES        stages to run, in order (unset or empty: "sanity prepare dryrun train sample"; for a config that sets
#                 pack_dir, "sanity skills prepare dryrun train sft eval handoff sample")
#   PREPARE_ARGS  extra --key=val for prepare.py, e.g. "--max_docs=1000 --workers=4"
#   SAMPLE_ARGS   extra --key=val for sample.py, e.g. "--num_samples=3"
#                 (the sample stage samples the bundle's model when STAGES holds handoff, else OUT_DIR's)
#   DRYRUN_STEPS  optimizer steps of the dry run, at least 2 (default: the config's dryrun_stage_steps, 20 unless
#                 it sets them; the 1B config's 100)
#   SFT_CONFIG    the sft stage's config file, read after CONFIG: its data_dir and out_dir, steps, learning rate
#                 (default CONFIG's name + _sft, e.g. config/tiny_skills_sft.py). The stage makes the chat data
#                 of PACK_DIR/sft.jsonl in the tokenizer of the train stage's checkpoint (prepare.py --chat=True),
#                 then fine-tunes that checkpoint on it (train.py --init_from=OUT_DIR)
#   PACK_DIR      the skills pack's folder (default: the config's pack_dir, skills.py's data/skills); the skills
#                 stage writes it (skills.py), prepare counts its eval rows in the corpus, the train and sft stages'
#                 gates judge it, the sft stage trains on its sft.jsonl, the eval stage asks its eval.jsonl
#   EVAL_ARGS     extra --key=val for eval.py, e.g. "--mc=arc_easy,piqa --attach=lm_eval.json"; after eval.py,
#                 honesty.py writes each evaluated run's honesty.md and honesty.json
#   HANDOFF_DIR   the handoff stage's bundle (default OUT_DIR + "-handoff"): handoff.py on the sft stage's run
#                 when there is one, else the train stage's; it refuses a run whose release gate is block or not
#                 recorded unless --override_gate=True (in the config or HANDOFF_ARGS)
#   HANDOFF_ARGS  extra --key=val for handoff.py, e.g. "--override_gate=True"
#   SFT_ARGS      extra --key=val for the sft stage's train.py, e.g. "--max_steps=50" (its data_dir: prepare.py's too)
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
# budget_usd, budget_file) stopped. A signal during any other stage stops run.sh there:
# it ends by that signal (a shell reports exit status 128 + its number).
set -euo pipefail
set -f  # no file-name globbing: STAGES, PREPARE_ARGS and SAMPLE_ARGS are split into words as written
export PYTHONUNBUFFERED=1  # stage output in order, also when piped to a log
cd "$(dirname "$0")"

# A signal is noted (SIGNAL) and passed on to the running stage as $!, which bash sets as the stage forks:
# a variable set after the fork would miss one that came in between (REAPED: that stage has ended). Trapped
# first, so that one before the first stage (the checks, reading the config) stops run.sh too. SIGHUP as
# well: the stage has a process group of its own (see stage()), which a closing terminal no longer reaches.
SIGNAL= REAPED=
on_signal() {
    SIGNAL=$1
    if [[ -n ${!-} && $! != "$REAPED" ]]; then kill -"$1" "$!" 2>/dev/null || true; fi
}
for sig in TERM INT USR1 HUP; do trap "on_signal $sig" "$sig"; done

STAGE_NAMES="sanity skills prepare dryrun train sft eval handoff sample"
CONFIG=${CONFIG:-config/tiny.py}
NPROC=${NPROC:-1}
SFT_CONFIG=${SFT_CONFIG:-${CONFIG%.py}_sft.py}
DRYRUN_STEPS=${DRYRUN_STEPS:-}
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-podgpt}
MAX_RESTARTS=${MAX_RESTARTS:-0}
# Every value is checked before the first stage, in one line each: a typo must not surface an hour into a run.
refuse() { echo "run.sh: $*" >&2; exit 2; }
[[ -f $CONFIG ]] || refuse "CONFIG=$CONFIG: no such file (give a config file, e.g. CONFIG=config/tiny.py)"
command -v "${PYTHON%% *}" >/dev/null ||
    refuse "PYTHON=$PYTHON: no such command (give the interpreter, e.g. PYTHON=python3)"
[[ -n $DRYRUN_STEPS || " ${STAGES:-dryrun} " != *" dryrun "* ]] || DRYRUN_STEPS=$($PYTHON -c 'import sys
from podgpt.core import configurator, util
util.run_main(lambda argv: print(configurator.configure("train.py", argv).dryrun_stage_steps), sys.argv[1:])' \
    "$CONFIG" "$@")
for v in NPROC NNODES NODE_RANK MASTER_PORT MAX_RESTARTS ${DRYRUN_STEPS:+DRYRUN_STEPS}; do
    [[ ${!v} =~ ^0*([0-9]{1,18})$ ]] || refuse "$v=${!v} is not a whole number: write it in digits (0-9)"
    printf -v "$v" %d "$((10#${BASH_REMATCH[1]}))"  # in decimal: bash reads 08 as a bad octal number
done
[[ $NNODES -le 1 || -n ${MASTER_ADDR:-} ]] ||
    refuse "NNODES=$NNODES needs MASTER_ADDR, the address of node 0 (NODE_RANK=0) that every node reaches"
[[ $NPROC -ge 1 && $NNODES -ge 1 && $NODE_RANK -lt $NNODES ]] ||
    refuse "need NPROC >= 1, NNODES >= 1 and NODE_RANK < NNODES (got $NPROC, $NNODES, $NODE_RANK)"
[[ $MASTER_PORT -ge 1 && $MASTER_PORT -le 65535 ]] || refuse "MASTER_PORT=$MASTER_PORT is not a TCP port (1 to 65535)"
[[ -z $DRYRUN_STEPS || $DRYRUN_STEPS -ge 2 ]] || refuse "DRYRUN_STEPS=$DRYRUN_STEPS: the dry run needs at least 2 steps (a checkpoint at" \
    "half, then the resume from it); to skip it, leave dryrun out of STAGES"
# the config's pack_dir (skills.py's), read once: its first lines are the folder (PACK_DIR's default), the last says
# whether the config sets its own, other than skills.py's default (then the skills path runs by default)
CONFIG_PACK=
if [[ -z ${STAGES:-} || -z ${PACK_DIR:-} ]]; then
    CONFIG_PACK=$($PYTHON -c 'import sys
from podgpt.core import configurator, util
def pack_dir(argv):
    own = configurator.configure("skills.py", argv).pack_dir
    print(own, bool(own) and own != configurator.configure("skills.py", []).pack_dir, sep="\n")
util.run_main(pack_dir, sys.argv[1:])' "$CONFIG")
fi
if [[ -z ${STAGES:-} ]]; then  # unset or empty: the default stages
    STAGES="sanity prepare dryrun train sample"
    [[ ${CONFIG_PACK##*$'\n'} == True ]] && STAGES="sanity skills prepare dryrun train sft eval handoff sample"
fi
[[ $STAGES =~ [^[:space:]] ]] || refuse "STAGES='$STAGES' names no stage (choose from: $STAGE_NAMES)"
for s in $STAGES; do
    [[ " $STAGE_NAMES " == *" $s "* ]] || refuse "unknown stage '$s' in STAGES (choose from: $STAGE_NAMES)"
done
[[ " $STAGES " != *" sft "* || -f $SFT_CONFIG ]] ||
    refuse "SFT_CONFIG=$SFT_CONFIG: no such file (the sft stage's data_dir, out_dir and steps, e.g." \
        "config/tiny_skills_sft.py)"
# the must-pass memory check before a paid run: on a machine with a GPU, sanity.py --capacity takes one
# real training step of the whole model (on a CPU it would only plan, and needs the vocabulary before prepare)
GPU=
nvidia-smi -L >/dev/null 2>&1 && GPU=1
TRAIN_ARGS=("$@")
[[ -n ${DATA_DIR:-} ]] && TRAIN_ARGS+=("--data_dir=$DATA_DIR")
# a PACK_DIR given reaches every stage that reads the pack: prepare counts its eval rows in the corpus, the gates
# of train and sft judge it (otherwise each reads the config's pack_dir)
PACK_ARG=()
[[ -n ${PACK_DIR:-} ]] && PACK_ARG=("--pack_dir=$PACK_DIR")
TRAIN_ARGS+=("${PACK_ARG[@]}")
# the run's out_dir as train.py resolves it from the config and the overrides
OUT=${OUT_DIR:-$($PYTHON -c 'import sys
from podgpt.core import configurator, util
util.run_main(lambda argv: print(configurator.configure("train.py", argv).out_dir), sys.argv[1:])' \
    "$CONFIG" "${TRAIN_ARGS[@]}")}
HANDOFF_DIR=${HANDOFF_DIR:-${OUT%/}-handoff}
PACK_DIR=${PACK_DIR:-${CONFIG_PACK%$'\n'*}}
# the sft stage's out_dir and data_dir, as its train.py resolves them (the eval stage evaluates its model too)
SFT_OUT= SFT_DATA=
[[ (" $STAGES " == *" sft "* || " $STAGES " == *" eval "* || " $STAGES " == *" handoff "*) && -f $SFT_CONFIG ]] && { read -r SFT_OUT; read -r SFT_DATA; } < <($PYTHON -c 'import sys
from podgpt.core import configurator, util
util.run_main(lambda argv: print(*(configurator.configure("train.py", argv)[k] for k in ("out_dir", "data_dir")),
                                 sep="\n"), sys.argv[1:])' "$CONFIG" "$SFT_CONFIG" ${SFT_ARGS:-})

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
# podgpt.pod.torchrun is torchrun less the traceback it adds after a failed worker's own error line.
TORCHRUN=($PYTHON -m podgpt.pod.torchrun)
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

# A stage runs in the background, so that a signal reaches the trap at once, under job control (set -m):
# without it bash starts background jobs ignoring SIGINT (Ctrl-C never reached sanity, prepare or sample),
# and with it the stage has a process group of its own, so that a terminal's Ctrl-C, sent to run.sh's
# group, reaches it once, through the trap (twice is train.py's "second Ctrl-C: stop now").
stage() {
    local name=$1 rc=0 since why=
    shift
    echo "=== $name: $*"
    since=$(date +%s)
    set -m
    { [[ -z $SIGNAL ]] && exec "$@"; } </dev/null &  # not started after a signal; stdin as without set -m
    set +m
    while kill -0 "$!" 2>/dev/null; do wait "$!" || true; done  # a trapped signal ends wait early
    wait "$!" || rc=$?
    REAPED=$!
    if [[ $name == train || $name == dryrun || $name == sft ]]; then
        local out=$OUT
        [[ $name == dryrun ]] && out=$OUT/dryrun/first
        [[ $name == sft ]] && out=$SFT_OUT
        why=$(stopped "$out" "$since")
    fi
    # torchrun itself exits non-zero after forwarding a signal
    if [[ ($name == train || $name == sft) && -n $why ]]; then
        echo "run.sh: $name $why; run the same command to resume"
        exit 0
    fi
    if [[ -n $SIGNAL || -n $why ]]; then  # a dry run stopped early has checked nothing
        echo "run.sh: $name ${why:-stopped by SIG$SIGNAL}; no later stage runs" >&2
        # ended by the signal, as if uncaught: a calling shell (say, a loop over configs) then stops too
        [[ -z $SIGNAL ]] || { trap - "$SIGNAL"; kill -"$SIGNAL" $$; }
        exit 1
    fi
    if [[ $rc -ne 0 ]]; then
        echo "run.sh: stage '$name' failed (command: $*)" >&2
        exit 1
    fi
}

for s in $STAGES; do
    case $s in
        sanity)  stage sanity "${LAUNCH[@]}" sanity.py "$CONFIG" "--out_dir=$OUT" ${DATA_DIR:+"--data_dir=$DATA_DIR"} \
                     ${GPU:+--capacity} ;;
        prepare) stage prepare $PYTHON prepare.py "$CONFIG" ${DATA_DIR:+"--data_dir=$DATA_DIR"} "${PACK_ARG[@]}" \
                     ${PREPARE_ARGS:-} ;;
        dryrun)  stage dryrun "${LAUNCH[@]}" train.py "$CONFIG" "${TRAIN_ARGS[@]}" "--out_dir=$OUT/dryrun" \
                     "--dryrun_steps=$DRYRUN_STEPS" ;;
        train)   stage train "${TRAIN_LAUNCH[@]}" train.py "$CONFIG" "${TRAIN_ARGS[@]}" "--out_dir=$OUT" ;;
        sft)     stage sft-data $PYTHON prepare.py "$CONFIG" "$SFT_CONFIG" --chat=True "--chat_base=$OUT" \
                     "--source=$PACK_DIR/sft.jsonl" "--data_dir=$SFT_DATA"
                 stage sft "${TRAIN_LAUNCH[@]}" train.py "$CONFIG" "$SFT_CONFIG" "${PACK_ARG[@]}" ${SFT_ARGS:-} \
                     "--init_from=$OUT" ;;
        skills)  stage skills $PYTHON skills.py "$CONFIG" "--pack_dir=$PACK_DIR" ;;
        eval)    stage eval "${LAUNCH[@]}" eval.py "$CONFIG" "--ckpt=$OUT" "--pack_dir=$PACK_DIR" \
                     ${DATA_DIR:+"--data_dir=$DATA_DIR"} ${EVAL_ARGS:-}
                 [[ $NODE_RANK -ne 0 ]] || stage honesty $PYTHON honesty.py "--run=$OUT"
                 if [[ -n $SFT_OUT && -d $SFT_OUT ]]; then
                     stage eval-sft "${LAUNCH[@]}" eval.py "$CONFIG" "$SFT_CONFIG" "--ckpt=$SFT_OUT" \
                         "--pack_dir=$PACK_DIR" "--data_dir=$SFT_DATA" ${EVAL_ARGS:-}
                     [[ $NODE_RANK -ne 0 ]] || stage honesty-sft $PYTHON honesty.py "--run=$SFT_OUT"
                 fi ;;
        handoff) if [[ $NODE_RANK -ne 0 ]]; then
                     echo "=== handoff: skipped on node $NODE_RANK (node 0 holds the checkpoints)"
                 elif [[ -n $SFT_OUT && -d $SFT_OUT ]]; then
                     stage handoff $PYTHON handoff.py "$CONFIG" "$SFT_CONFIG" "--run=$SFT_OUT" "--out=$HANDOFF_DIR" \
                         ${HANDOFF_ARGS:-}
                 else
                     stage handoff $PYTHON handoff.py "$CONFIG" "--run=$OUT" "--out=$HANDOFF_DIR" ${HANDOFF_ARGS:-}
                 fi ;;
        sample)  if [[ $NODE_RANK -eq 0 && " $STAGES " == *" handoff "* ]]; then  # the model handed off
                     stage sample $PYTHON sample.py "$CONFIG" "--ckpt=$HANDOFF_DIR/model" ${SAMPLE_ARGS:-}
                 elif [[ $NODE_RANK -eq 0 ]]; then
                     stage sample $PYTHON sample.py "$CONFIG" "--out_dir=$OUT" ${SAMPLE_ARGS:-}
                 else
                     echo "=== sample: skipped on node $NODE_RANK (node 0 holds the checkpoints and samples)"
                 fi ;;
    esac
done
echo "=== done: $OUT"
