#!/usr/bin/env bash
# One device call for a session lent a GPU (GPU_RUNBOOK.md): the issue-3/4 checks first,
# each step under its own time limit, every result under $OUT (8 files at most come back).
#
#   device run, carry [".whl"], timeout_s 600:
#     bash benchmarks/gpu_session.sh
#
# Steps, in priority order (issues 3 and 4 are open only for their GPU figures):
#   1. kernel and triton-backend tests on CUDA          -> session.log
#   2. kernel table (bf16 cache) and FP8-cache table     -> kernels.{json,md}, kernels_fp8.md
#   3. NIXL VRAM to VRAM against a device copy           -> kv_transfer.{json,md}
#   4. the batched sampler against the per-row one       -> sampler_cuda.{json,md}
# A step that runs out of time is cut and the next runs; session.log holds every step's
# output and exit status. Then copy the tables into benchmarks/results/ (GPU_RUNBOOK.md).
set -uo pipefail
OUT=${OUT:?set by the device tool}
cd "$(dirname "$0")/.."
LOG="$OUT/session.log"
step() {  # step NAME SECONDS COMMAND...: run under a limit, log the outcome, never abort
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  echo "== $name: exit $? after $((SECONDS - start))s" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheels missing: see GPU_RUNBOOK.md" >>"$LOG"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

step gpu_tests 225 python3 -m pytest -q -x tests/kernels tests/engine/test_triton_backend.py
step kernels 120 python3 benchmarks/kernels.py --json "$OUT/kernels.json" --md "$OUT/kernels.md"
step kernels_fp8 60 python3 benchmarks/kernels.py --kv-cache-dtype fp8 --md "$OUT/kernels_fp8.md"
# One GPU has no NVLink: UCX reads VRAM over TCP without this (kv_transfer_h100.md).
step kv_transfer 120 env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python3 benchmarks/kv_transfer.py \
  --device cuda --connectors nixl nixl-layers --repeats 5 --warmup 2 --out "$OUT/kv_transfer"
# Llama 3's vocabulary; the per-row sampler paid launches and a sync per row here.
step sampler 45 python3 -m benchmarks.sampler --device cuda --vocab 128256 --logits zipf \
  --repeats 3 --out-dir "$OUT"
ls -la "$OUT" >>"$LOG"
