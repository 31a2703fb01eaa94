#!/usr/bin/env bash
# On one GPU, from a checkout with .gpu/ staged (scripts/stage-gpu.sh, then
# unpacked) and NCCL EP in .nccl-ep/ (docs/profiler.md): the ep-bench runs
# behind BENCHMARKS.md's fp8, footprint and padding rows, at world 1 with
# NCCL EP beside every op (timed by stream events, as ours), then the fp8
# dispatch at virtual world 8 (no NVLink column). Each step has its own
# time limit; logs land in $OUT (or /tmp/gpu-te).
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/env.sh
out=${OUT:-/tmp/gpu-te}
mkdir -p "$out"
bench=$PWD/.gpu/bin/ep-bench
t0=$(date +%s)
step() {  # name, limit (s), command...
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - t0 )) s"
}
# NCCL EP 0.x needs the NCCL it was built against (2.30.7, from source).
if [ ! -e /tmp/nccl/lib/libnccl.so.2 ]; then
  bash .nccl-ep/build-nccl.sh /tmp/nccl > "$out/nccl-build.txt" 2>&1 || echo "NCCL build failed"
fi
with_nccl_ep=(env "LD_LIBRARY_PATH=/tmp/nccl/lib:$PWD/.nccl-ep/lib:${LD_LIBRARY_PATH:-}"
  MOE_EP_NCCL_LIBRARY=/tmp/nccl/lib/libnccl.so.2 NCCL_HOME=/tmp/nccl "NCCL_EP_HOME=$PWD/.nccl-ep")
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$out/when.txt"

# fp8 with f32 scales per 128 values beside NCCL EP's QUANT_FWD dispatch,
# the bf16 ops beside NCCL EP's, and the memory block of both.
step fp8-f32 150 "${with_nccl_ep[@]}" "$bench" --gpus 1 --tokens 4096,128 --layout rank,expert:128 \
  --ops layout,dispatch,dispatch-fp8,combine --check --json "$out/fp8-f32.json"
# The same fp8 dispatch with MXFP8's e8m0 scales per 32 values.
step fp8-e8m0 120 "${with_nccl_ep[@]}" "$bench" --gpus 1 --tokens 4096,128 --layout rank,expert:128 \
  --ops dispatch-fp8 --fp8-scales e8m0 --check --json "$out/fp8-e8m0.json"
# Expert-major padding zero-filled (default) against left unwritten, alternated twice.
for i in 1 2; do
  for z in 1 0; do
    step "padding-$z-$i" 60 env MOE_EP_ZERO_PADDING=$z "$bench" --gpus 1 --layout expert:128 \
      --ops dispatch,dispatch-fp8,combine-bwd --tokens 128,4096 --no-baselines --no-nccl-ep --quiet
  done
done
# Virtual world 8: the table has no NVLink column; fp8 checked too.
step virtual8 150 "$bench" --virtual-ranks 8 --tokens 4096 --layout rank,expert:128 \
  --ops layout,dispatch,dispatch-fp8,combine --check --iters 5 --warmup 2 --json "$out/virtual8.json"
