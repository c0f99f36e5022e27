#!/usr/bin/env bash
# One device call for a session lent a GPU (GPU_RUNBOOK.md): the issue-3/4 checks first,
# each step under its own time limit, every result under $OUT (8 files at most come back).
#
#   device run, carry [".whl"], timeout_s 600:
#     bash benchmarks/gpu_session.sh
#
# Steps, in priority order (issues 3 and 4 are open only for their GPU figures):
#   1. kernel and triton-backend tests on CUDA          -> session.log
#   2. kernel table (bf16 cache)                         -> kernels.json
#   3. NIXL VRAM to VRAM against a device copy           -> kv_transfer.{json,md}
#   4. more launch shapes on the open targets' shapes    -> kernels_targets.json
#   5. kernel table with an FP8 cache                    -> kernels_fp8.json
#   6. FP8-cache decode launch shapes at batch 16        -> kernels_fp8_targets.json
# (The sampler's GPU record, sampler_h100.md, was taken on 2026-11-27: GPU_RUNBOOK.md step 4.)
# A step that runs out of time is cut and the next runs, and no step runs past
# SESSION_SECONDS (default 575) from the start, so the call ends inside its 600 s; the
# kernel tables come back as JSON only (8 files at most) and print their rows as they go.
# session.log holds every step's output and exit status. Then copy the records into
# benchmarks/results/ (GPU_RUNBOOK.md).
set -uo pipefail
OUT=${OUT:?set by the device tool}
cd "$(dirname "$0")/.."
LOG="$OUT/session.log"
END=$((SECONDS + ${SESSION_SECONDS:-575}))
step() {  # step NAME SECONDS COMMAND...: run under a limit, log the outcome, never abort
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS left=$((END - SECONDS - 12))
  if ((left < 15)); then
    echo "== $name: skipped, session time spent" | tee -a "$LOG"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  echo "== $name: exit $? after $((SECONDS - start))s" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheels missing: see GPU_RUNBOOK.md" >>"$LOG"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

step gpu_tests 120 python3 -m pytest -q -n 8 -p no:cacheprovider --timeout 90 -rf --tb=short \
  tests/kernels tests/engine/test_triton_backend.py
step kernels 110 python3 benchmarks/kernels.py --json "$OUT/kernels.json"
# One GPU has no NVLink: UCX reads VRAM over TCP without this (kv_transfer_h100.md).
step kv_transfer 110 env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python3 benchmarks/kv_transfer.py \
  --device cuda --connectors nixl nixl-4lanes nixl-layers --repeats 5 --warmup 2 --out "$OUT/kv_transfer"
step kernels_targets 90 python3 benchmarks/kernels.py --sweep-targets \
  --json "$OUT/kernels_targets.json"
step kernels_fp8 60 python3 benchmarks/kernels.py --kv-cache-dtype fp8 \
  --json "$OUT/kernels_fp8.json"
step kernels_fp8_targets 60 python3 benchmarks/kernels.py --sweep-targets --kv-cache-dtype fp8 \
  --json "$OUT/kernels_fp8_targets.json"
ls -la "$OUT" >>"$LOG"
