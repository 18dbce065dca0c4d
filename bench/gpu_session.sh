#!/usr/bin/env bash
# One device call for issue 5's GPU figures on a target big enough that a decode step is more than
# kernel launches (2x H200; the machine keeps nothing between calls, so the pair is trained here):
#
#   p5        stage-scoped loading, in the background while the pair trains (it reads bytes and RSS,
#             which sharing GPU 0 with the training does not change)
#   train     bench/train_demo.py --preset medium: a 51M Llama target + its EAGLE3 draft into $PAIR (GPU 0)
#   p3        pipespec bench p3 --pair $PAIR (speedup at PP=2 on both GPUs, + the 70B projection)
#   pipeline  pipespec bench pipeline --pair $PAIR --quick (micro-batches), with the time left
#
# Usage, from anywhere, with OUT set (the lead installs libcst before; nothing here uses the network):
#     OUT=/some/dir bash bench/gpu_session.sh
# DEVICE=cpu PRESET=quick runs the same flow on a CPU machine (a dry run of the script itself).
# Every step runs under `timeout` inside BUDGET_S seconds (default 540) from the script's start; a
# failed or timed-out step does not stop the next ones. Output: $OUT/session.log (one line per step
# start/end with rc and wall seconds), $OUT/<step>.log (each step's stdout+stderr), $OUT/{p5,p3,pipeline}/
# (the bench JSON, plots, and p3_runs.jsonl / pipeline_runs.jsonl written run by run), and
# $OUT/medium_metrics.json (train_demo's metrics.json). With COMPACT=1 (the default) only 8 files stay in
# $OUT at the end (the device returns at most 8): session.log, tables.txt (every result line and the
# training's tail), medium_metrics.json, p3.json, p3_runs.jsonl, pipeline.json, pipeline_runs.jsonl, p5.json.
set -euo pipefail

: "${OUT:?set OUT to the output directory}"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT/sdk:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

BUDGET_S=${BUDGET_S:-540}
PAIR=${PAIR:-/tmp/pair}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-medium}
TRAIN_CAP_S=${TRAIN_CAP_S:-200}   # --max-train-s: the cap on target training, and again on draft training
P3_MIN_S=100                      # kept free for p3 after training (p3 --quick: 4 runs + the projection)
TRAIN_OVERHEAD_S=50               # train_demo besides its two loops: imports, corpus + BPE, save/reload, evaluation
PIPELINE_MIN_S=60                 # kept free for pipeline after p3 when there is room

mkdir -p "$OUT"
LOG="$OUT/session.log"
START=$(date +%s)
STEP_RC=0

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
log() { printf '[%4ds] %s\n' "$(elapsed)" "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD...: CMD under `timeout LIMIT_S`, output in $OUT/NAME.log; sets STEP_RC, never fails.
step() {
  local name=$1 limit=$2
  shift 2
  if (( limit < 20 )); then
    log "$name: skipped (${limit}s of the budget left)"
    STEP_RC=125
    return 0
  fi
  log "$name: start, limit ${limit}s: $*"
  local t0 rc=0
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  local note=""
  if (( rc == 124 || rc == 137 )); then note=" (timed out)"; fi
  log "$name: rc=$rc$note, wall $(( $(date +%s) - t0 ))s"
  STEP_RC=$rc
}

BENCH=(python3 -m pipespec.cli bench)
log "gpu session: budget ${BUDGET_S}s, device $DEVICE, preset $PRESET, pair $PAIR, repo $ROOT"
nvidia-smi -L >>"$LOG" 2>&1 || log "nvidia-smi -L failed"

# --- p5 alongside the training (independent of the pair) -----------------------------------------
step p5 150 "${BENCH[@]}" p5 --device "$DEVICE" --out "$OUT/p5" &
P5_PID=$!

# --- train the medium pair ------------------------------------------------------------------------
TRAIN_LIMIT=$(( $(left) - P3_MIN_S ))
CAP=$(( (TRAIN_LIMIT - TRAIN_OVERHEAD_S) / 2 ))
if (( CAP > TRAIN_CAP_S )); then CAP=$TRAIN_CAP_S; fi
if (( CAP < 10 )); then CAP=10; fi
log "train: --max-train-s $CAP (TRAIN_CAP_S $TRAIN_CAP_S, or less so both loops fit the ${TRAIN_LIMIT}s limit)"
rm -rf "$PAIR"
step train "$TRAIN_LIMIT" python3 bench/train_demo.py --out "$PAIR" --device "$DEVICE" --preset "$PRESET" --max-train-s "$CAP"
TRAIN_RC=$STEP_RC
if [[ -f "$PAIR/metrics.json" ]]; then cp "$PAIR/metrics.json" "$OUT/medium_metrics.json"; fi
# rc 1: trained and written, but some speculative output differed from plain greedy (still a usable pair).
if (( TRAIN_RC == 1 )); then log "train: pair written; evaluation not token-exact (see train.log)"; fi

wait "$P5_PID" || log "p5: background job ended with $?"

PAIR_OK=0
if [[ -f "$PAIR/target/config.json" && -f "$PAIR/draft/config.json" && -f "$PAIR/draft/model.safetensors" ]]; then
  PAIR_OK=1
  cp "$PAIR/target/config.json" "$OUT/medium_target_config.json"
  cp "$PAIR/draft/config.json" "$OUT/medium_draft_config.json"
fi

# --- p3 on the pair -------------------------------------------------------------------------------
if (( PAIR_OK )); then
  P3_FLAGS=()
  if (( $(left) < 180 )); then P3_FLAGS=(--quick); fi
  P3_LIMIT=$(( $(left) - PIPELINE_MIN_S ))
  if (( P3_LIMIT < 90 )); then P3_LIMIT=$(( $(left) - 5 )); fi
  step p3 "$P3_LIMIT" "${BENCH[@]}" p3 --device "$DEVICE" --pair "$PAIR" --out "$OUT/p3" ${P3_FLAGS[@]+"${P3_FLAGS[@]}"}
else
  log "p3: skipped: no complete pair in $PAIR (train rc=$TRAIN_RC)"
fi

# --- pipeline micro-batches on the pair (on its random default model without one) -----------------
PIPE_PAIR=()
if (( PAIR_OK )); then PIPE_PAIR=(--pair "$PAIR"); fi
step pipeline $(( $(left) - 5 )) "${BENCH[@]}" pipeline --device "$DEVICE" --quick --out "$OUT/pipeline" \
  ${PIPE_PAIR[@]+"${PIPE_PAIR[@]}"}

log "done: train rc=$TRAIN_RC, total $(elapsed)s"

# --- what comes back --------------------------------------------------------------------------------
# The device returns at most 8 files from $OUT: with COMPACT=1 (the default) the session leaves exactly
# these there, and removes the rest (COMPACT=0 keeps every log, plot and JSON where the steps wrote them).
if [[ "${COMPACT:-1}" == 1 ]]; then
  KEEP="$OUT/.keep"
  mkdir -p "$KEEP"
  { grep -h "P3\.\|pipeline\.\|P5\." "$OUT"/p3.log "$OUT"/pipeline.log "$OUT"/p5.log 2>/dev/null; tail -5 "$OUT/train.log" 2>/dev/null; } \
    >"$KEEP/tables.txt" || true
  for f in session.log medium_metrics.json p3/p3.json p3/p3_runs.jsonl pipeline/pipeline.json \
           pipeline/pipeline_runs.jsonl p5/p5.json; do
    if [[ -f "$OUT/$f" ]]; then cp "$OUT/$f" "$KEEP/$(basename "$f")"; fi
  done
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name .keep -exec rm -rf {} +
  mv "$KEEP"/* "$OUT"/ && rmdir "$KEEP"
fi
