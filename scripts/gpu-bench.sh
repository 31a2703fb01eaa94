#!/usr/bin/env bash
# On the GPU machine, from a checkout with .gpu/ staged (../shared/device/stage-gpu):
# the whole GPU test suite, then the benchmark tables of BENCHMARKS.md, then a
# short Nsight Compute pass that checks the profiling recipe of the README.
# Logs and JSON/CSV/SVG land in $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/env.sh
out=${OUT:-/tmp}
bench=.gpu/bin/ep-bench
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
bash .gpu/run-tests.sh 2>&1 | grep -E "^(==|test |test result|SKIP|FAILED)" | tee "$out/tests.log"
# The issue's size, both layouts, every op, with --check.
$bench --check --quiet --layout rank,expert:128 --ops layout,dispatch,combine,dispatch-bwd,combine-bwd \
  --json "$out/ht.json" --csv "$out/ht.csv" 2>&1 | tee "$out/ht.txt"
# SM count sweep at the issue's size.
$bench --quiet --num-sms 16,24,32,48 --json "$out/sms.json" 2>&1 | tee "$out/sms.txt"
# Tokens sweep for the plot.
$bench --quiet --tokens 128,256,512,1024,2048,4096,8192 --plot "$out/sweep.svg" --json "$out/sweep.json" 2>&1 | tee "$out/sweep.txt"
# Nsight Compute recipe: one dispatch kernel of one rank.
if command -v ncu >/dev/null; then
  timeout 240 ncu --clock-control none --target-processes all --kernel-name regex:moe_ep_dispatch --launch-count 1 \
    --section SpeedOfLight $bench --gpus 2 --profile --iters 1 --no-baselines --ops dispatch --quiet 2>&1 | tail -25 | tee "$out/ncu.txt"
fi
