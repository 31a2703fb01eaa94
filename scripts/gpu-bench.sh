#!/usr/bin/env bash
# On the GPU machine, from a checkout with .gpu/ staged (../shared/device/stage-gpu):
# the whole GPU test suite, then the benchmark tables of BENCHMARKS.md, then a
# short Nsight Compute pass that checks the profiling recipe of the README.
# Writes at most 8 files into $OUT (or /tmp): gpu-tests.log, ht.txt, ht.json,
# sms.txt, sweep.txt, sweep.svg, sweep.json, ncu.txt.
#   BENCH_DIR=.gpu-old bash scripts/gpu-bench.sh   # benchmark another staged build
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/env.sh
out=${OUT:-/tmp}
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
bash .gpu/run-tests.sh 2>&1 | grep -E "^(==|test result|SKIP|FAILED|rank [0-9])|\.\.\. FAILED"
dir=${BENCH_DIR:-.gpu}
if ! grep -q "overall: PASS" "$out/gpu-tests.log" && [ -z "${BENCH_DIR:-}" ] && [ -d .gpu-fallback ]; then
  echo "!! tests failed: benchmarking the fallback build in .gpu-fallback"
  dir=.gpu-fallback
fi
bench=$dir/bin/ep-bench
echo "== benchmarks with $bench"
# The issue's size, both layouts, every op, with --check.
$bench --check --quiet --layout rank,expert:128 --ops layout,dispatch,combine,dispatch-bwd,combine-bwd \
  --json "$out/ht.json" 2>&1 | tee "$out/ht.txt"
# SM count sweep at the issue's size.
$bench --quiet --num-sms 16,24,32,48 2>&1 | tee "$out/sms.txt"
# Tokens sweep for the plot.
$bench --quiet --tokens 128,256,512,1024,2048,4096,8192 --plot "$out/sweep.svg" --json "$out/sweep.json" 2>&1 | tee "$out/sweep.txt"
# Nsight Compute recipe: the kernels wait on the peer, so replay the whole
# application per pass (kernel replay would stall them).
if command -v ncu >/dev/null; then
  timeout 200 ncu --clock-control none --replay-mode application --target-processes all \
    --kernel-name regex:moe_ep_dispatch --launch-count 1 --section SpeedOfLight \
    $bench --gpus 2 --profile --iters 1 --no-baselines --ops dispatch --quiet 2>&1 | tail -22 | tee "$out/ncu.txt"
fi
