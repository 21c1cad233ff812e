#!/usr/bin/env bash
# The one-shot check on the GPU machine (an H200: Python 3.12, torch 2.11, transformers 5.17, no
# registry). Run from the repository root with gpu/bundle/ present (`make gpu-bundle`):
#
#     OUT=/somewhere gpu/check.sh
#
# Steps, each under its own time limit and all under one deadline (QLLM_CHECK_BUDGET_S, 470 s):
#   env        nvidia-smi, versions                                       -> env.json
#   smoke      tokens equal generate in float64 on CUDA, two families, bf16 -> smoke.json
#   validate   Mixtral-8x7B shape (random bf16 weights) profiled on a reduced grid (wake-up,
#              the engine's host time), then sim vs real (iteration, qllm; 24 synthetic requests;
#              utilization 0.6, 2, 6; one real replay each), per-iteration errors
#                                            -> validation.json, iteration_errors.json
#   compare    the measured profile op by op against the analytic h200-mixtral-bf16
#                                                                          -> profile_compare.json
#   preemption LS arrival to its first operation per policy, Mixtral shape -> preemption.json
#   pytest_gpu pytest -m gpu
# After every step: $OUT/steps.jsonl (one line per step: rc, seconds), the step's JSON, and
# $OUT/check.tar.gz (all logs, the profile, everything written so far), so a timeout still
# returns the earlier steps. At most 8 files come back from $OUT: these are 8.
#
# QLLM_CHECK_STEPS="env validate" runs only the steps named (default: the six above), for a
# rerun of one step in what is left of a device lease; "env modes" runs gpu/modes.py (~1 min),
# "env faults" gpu/faults.py (~80 s: the engine twice, each fault charged to its place).
# QLLM_CHECK_PIN=N pins the validate step to CPU core N. QLLM_CHECK_POLICIES ([iteration,qllm])
# and QLLM_CHECK_UTILIZATIONS (the loads) narrow the validation to fit what is left of a lease.
# QLLM_CHECK_DRY=1 (make gpu-check-dry): the same steps on the CPU with tiny-mixtral and small
# grids, the GPU machine's missing packages hidden (gpu/dry/sitecustomize.py).
set -u -o pipefail
: "${OUT:?set OUT to the folder whose files come back}"
PY=${PYTHON:-python3}
DRY=${QLLM_CHECK_DRY:-0}
STEPS=" ${QLLM_CHECK_STEPS:-env smoke validate compare preemption pytest_gpu} "
# QLLM_CHECK_PIN=N: validate (its profile and its real runs, one process) pinned to CPU core N,
# so its host thread cannot move between cores (run 3 on the H200: the slow mode stayed).
PIN_CMD=()
if [ -n "${QLLM_CHECK_PIN:-}" ]; then
  PIN_CMD=($PY -c 'import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execvp(sys.argv[2], sys.argv[2:])' "$QLLM_CHECK_PIN")
fi
START_S=$(date +%s)
DEADLINE_S=$((START_S + ${QLLM_CHECK_BUDGET_S:-470}))
WORK=$(mktemp -d)
R=$WORK/results
SITE=$WORK/site
mkdir -p "$R" "$OUT"

# The bundle's pure-Python wheels into a temporary directory, ahead of everything else.
if ! $PY -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$SITE" gpu/bundle/*.whl; then
  echo "check: error: gpu/bundle/: cannot install the bundle (run make gpu-bundle)" >&2
  exit 2
fi
export PYTHONPATH="$SITE${QLLM_CHECK_PYTHONPATH:+:$QLLM_CHECK_PYTHONPATH}:$PWD"
export PYTHONUNBUFFERED=1 QLLM_CACHE_DIR=$WORK/cache MPLBACKEND=Agg
if [ "$DRY" = 1 ]; then
  export PYTHONPATH="$PWD/gpu/dry:$PYTHONPATH" QLLM_BUNDLE_SITE=$SITE
fi

pack() {  # everything so far into $OUT, replaced atomically
  tar -czf "$OUT/check.tar.gz.part" -C "$WORK" results && mv -f "$OUT/check.tar.gz.part" "$OUT/check.tar.gz"
}

step() {  # step NAME LIMIT_S JSON_FILE CMD...: run CMD under its limit, log to $R/NAME.log
  local name=$1 limit_s=$2 json=$3
  shift 3
  if [[ $STEPS != *" $name "* ]]; then return 0; fi
  local left_s=$((DEADLINE_S - $(date +%s)))
  ((limit_s > left_s)) && limit_s=$left_s
  local t0_ns rc
  t0_ns=$(date +%s%N)
  if ((limit_s < 10)); then
    echo "== $name: skipped, the deadline is near" | tee "$R/$name.log"
    rc=-1
  else
    echo "== $name (limit ${limit_s} s): $*" | tee "$R/$name.log"
    timeout -k 10 "$limit_s" "$@" 2>&1 | tee -a "$R/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  local wall_ms=$((($(date +%s%N) - t0_ns) / 1000000)) timed_out=false
  if [ $rc = 124 ] || [ $rc = 137 ]; then timed_out=true; fi
  printf '{"step": "%s", "rc": %d, "timed_out": %s, "wall_ms": %d, "limit_s": %d}\n' \
    "$name" "$rc" "$timed_out" "$wall_ms" "$limit_s" >>"$R/steps.jsonl"
  cp "$R/steps.jsonl" "$OUT/steps.jsonl"
  if [ -n "$json" ] && [ -f "$R/$json" ]; then cp "$R/$json" "$OUT/$(basename "$json")"; fi
  pack
  echo "== $name: rc=$rc in $wall_ms ms"
}

if [ "$DRY" = 1 ]; then
  DEVICE=cpu MODEL=tiny-mixtral NAME=tiny-mixtral-dry
  VALIDATE_ARGS=(threads=1 workload.num_requests=8 replays=2 min_run_s=0 max_run_s=0
    utilizations="${QLLM_CHECK_UTILIZATIONS:-[1.0]}"
    profile.wake.idle_ms=[5,50] profile.wake.repeats=1
    workload.prompt.tokens=16 workload.prompt.max=32 workload.output.tokens=4 workload.output.max=6
    profile.grid.prefill_tokens=[8,32] profile.grid.decode_batch=[1,4] profile.grid.decode_kv=[16,40]
    profile.grid.expert_tokens=[1,4,16,64] profile.repeats=2 profile.warmup=1
    profile.passes_per_round=1 profile.routing.prompts=2 profile.routing.prompt_tokens=16)
  PREEMPTION_ARGS=(--be 2 --be-prompt 16 --be-output 12 --ls 3 --ls-rate 20 --ls-after-s 0.05
    --ls-prompt 8 --policies iteration qllm)
  LIMITS=(30 120 150 30 60 90)
  FAULTS_ARGS=(threads=1 workload.num_requests=6 workload.prompt.tokens=16 workload.prompt.max=32
    workload.output.tokens=4 workload.output.max=6)
else
  DEVICE=cuda MODEL=mixtral-8x7b NAME=mixtral-8x7b-h200
  # Lengths of a chat-like mix, cut to fit: 24 requests, outputs ~16 tokens. Loads 0.6, 2 and 6
  # (of a one-request-at-a-time server): light (an idle H200 clocks down to 345 MHz: the
  # profile's wake_up), near the knee, overloaded; two real replays per point.
  # min_run_s=0 max_run_s=0: the points keep 24 requests, as the check's time limits were sized for.
  # replays=1 (no noise floor; 2 profile passes): with 2 the step was estimated at 400-480 s
  # (run 2 took 284 s before the drift probe, the duty check, the host-time calibration and
  # the passes between replays were added), over its 360 s. One profile pass per round
  # (profile.passes_per_round=1), as the limits were sized for: the 3 of `make validate` (many
  # short visits of each shape, for a CPU VM whose speed moves from one visit to the next)
  # would time each shape 6 times after 2 warm-up steps, 18 steps where 2 passes take 10.
  VALIDATE_ARGS=(threads=null workload.num_requests=24 replays=1 min_run_s=0 max_run_s=0
    utilizations="${QLLM_CHECK_UTILIZATIONS:-[0.6,2.0,6.0]}"
    workload.prompt.tokens=128 workload.prompt.sigma=0.6 workload.prompt.min=16 workload.prompt.max=512
    workload.output.tokens=16 workload.output.sigma=0.5 workload.output.min=4 workload.output.max=48
    max_prompt_tokens=512
    profile.grid.prefill_tokens=[16,64,128,256,512] profile.grid.decode_batch=[1,4,8,16,32]
    profile.grid.decode_kv=[128,512]
    profile.grid.expert_tokens=[1,2,4,8,16,32,64,128,256,512,1024]
    profile.repeats=6 profile.warmup=2 profile.passes_per_round=1
    profile.routing.prompts=8 profile.routing.prompt_tokens=512)
  PREEMPTION_ARGS=(--be 8 --be-prompt 128 --be-output 100 --ls 12 --ls-rate 5 --ls-after-s 0.5)
  # validate 420 s: 290 s pinned in run 3 (2026-12-04), and over 314 s (cut) on a machine in
  # its slow state; the deadline still caps it
  LIMITS=(30 90 420 30 110 90)
  FAULTS_ARGS=(threads=null)  # the validation's workload near its knee (gpu/faults.py's defaults)
fi

step env "${LIMITS[0]}" env.json bash -c \
  "{ command -v nvidia-smi >/dev/null && nvidia-smi || echo 'no nvidia-smi'; } && $PY -m pip list 2>/dev/null | grep -iE '^(torch|transformers|hydra-core|omegaconf|simpy|numpy|pandas) ' ; $PY -m gpu.smoke --env-only --json $R/env.json"
step smoke "${LIMITS[1]}" smoke.json $PY -m gpu.smoke --device "$DEVICE" --json "$R/smoke.json"
# Not in the default steps: the real engine itself, each fault charged to a stage kind,
# the main thread or not, and the segment's resident memory and Python arenas (gpu/faults.py),
# as the runner runs it (cuDNN's attention off) and with cuDNN's attention back on. Run 5 ran
# it with glibc's and Python's allocators as they are, PYTHONMALLOC=malloc and
# MALLOC_ARENA_MAX=1 (--env ""  --env PYTHONMALLOC=malloc --env MALLOC_ARENA_MAX=1).
step faults 200 faults.json $PY -m gpu.faults --json "$R/faults.json" --env "" \
  --env GPU_FAULTS_CUDNN_SDPA=1 model="$MODEL" device="$DEVICE" "${FAULTS_ARGS[@]}"
# The validation below runs under the variant that took under a quarter of the default's faults
# (the fewest), where the default took 20 or more a segment: does the slow mode go with them?
VALIDATE_ENV=()
if [ -f "$R/faults.json" ]; then
  CHOSEN=$($PY -m gpu.faults --choose "$R/faults.json") || CHOSEN=""
  if [ -n "$CHOSEN" ]; then
    VALIDATE_ENV=(env ${CHOSEN//,/ })
    echo "check: validate runs under $CHOSEN (gpu/faults.py's choice)" | tee -a "$R/faults.log"
  fi
fi
# Not in the default steps either: decode-step times against the host page faults each step
# takes (gpu/modes.py: the same step repeated, growing contexts, then growing under the
# allocator that keeps freed memory). Both diagnostics run before validate, so that a lease's
# deadline cuts the long step, not them.
step modes 150 modes.json $PY -m gpu.modes --model "$MODEL" --device "$DEVICE" \
  --steps "$([ "$DRY" = 1 ] && echo 20 || echo 300)" --json "$R/modes.json"
# validate's own time budget (time_budget_s): the limit step() will give it, less
# VALIDATE_AFTER_S for Python's start and what follows its runs (run 4 on the H200: 3 s
# before its clock; predictions and simulations 2 s, and 13 s of "other": the model's load
# before the runs, the files and the plot after them), so that a short lease
# leaves a validation of the points it ran (runs 5 and 6 were killed in their runs and left
# none)
VALIDATE_AFTER_S=40
NOW_S=$(date +%s)
VALIDATE_LIMIT_S=$((DEADLINE_S - NOW_S < LIMITS[2] ? DEADLINE_S - NOW_S : LIMITS[2]))
VALIDATE_BUDGET_S=$((VALIDATE_LIMIT_S - VALIDATE_AFTER_S > 1 ? VALIDATE_LIMIT_S - VALIDATE_AFTER_S : 1))
step validate "${LIMITS[2]}" "$NAME/validation.json" "${VALIDATE_ENV[@]}" "${PIN_CMD[@]}" \
  $PY -m realrun.validate model="$MODEL" device="$DEVICE" name="$NAME" out_dir="$R" \
  policies="${QLLM_CHECK_POLICIES:-[iteration,qllm]}" workload=synthetic \
  workload.ls_fraction=0.3 progress=false time_budget_s="$VALIDATE_BUDGET_S" "${VALIDATE_ARGS[@]}"
if [ -f "$R/$NAME/iteration_errors.json" ]; then cp "$R/$NAME/iteration_errors.json" "$OUT/"; fi
step compare "${LIMITS[3]}" profile_compare.json $PY -m sim.compare_profiles "$R/$NAME/profile" \
  h200-mixtral-bf16 --json "$R/profile_compare.json"
step preemption "${LIMITS[4]}" preemption.json $PY benchmarks/preemption_latency.py \
  --model "$MODEL" --device "$DEVICE" "${PREEMPTION_ARGS[@]}" --json "$R/preemption.json"
step pytest_gpu "${LIMITS[5]}" "" $PY -m pytest -p no:cacheprovider -m gpu -rs \
  tests/test_realrun*.py tests/test_profiler.py

echo "check: done in $(($(date +%s) - START_S)) s; results in $OUT"
rm -rf "$WORK"
# Fails when any step failed (listing those), so a dry run in make test cannot rot silently.
if grep -v '"rc": 0,' "$OUT/steps.jsonl"; then exit 1; fi
