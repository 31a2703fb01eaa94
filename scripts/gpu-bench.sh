#!/usr/bin/env bash
# On the GPU machine, from a checkout with .gpu/ staged (scripts/stage-gpu.sh, then unpacked):
# the whole GPU test suite, then the benchmark tables of BENCHMARKS.md, then a
# short Nsight Compute pass that checks the profiling recipe of the README.
# Logs and the sweep's SVG land in $OUT (or /tmp): 9 files, what a device
# call brings back.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/env.sh
out=${OUT:-/tmp}
bench=.gpu/bin/ep-bench
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
bash .gpu/run-tests.sh 2>&1 | grep -E "^(==|test |test result|SKIP|FAILED)" | tee "$out/tests.log"
# 4096 tokens, hidden 7168, top-8 of 256: both layouts, every op, with --check.
$bench --check --quiet --layout rank,expert:128 --ops layout,dispatch,combine,combine-push,dispatch-bwd,combine-bwd 2>&1 | tee "$out/ht.txt"
# The same rank-major table timed from a host barrier only (--start host):
# host skew and enqueue time inside the timing, as BENCHMARKS.md timed before commit 02a8218.
$bench --quiet --start host --ops layout,dispatch,combine,dispatch-bwd,combine-bwd 2>&1 | tee "$out/host-start.txt"
# SM count sweep at that size.
$bench --quiet --num-sms 12,16,20,24,32,48 2>&1 | tee "$out/sms.txt"
# Tokens sweep for the plot.
$bench --quiet --tokens 128,256,512,1024,2048,4096,8192 --plot "$out/sweep.svg" 2>&1 | tee "$out/sweep.txt"
# The largest sizes of the NVLink path's scope.
$bench --quiet --check --hidden 16384 --experts 512 --tokens 4096 2>&1 | tee "$out/large.txt"
$bench --quiet --check --tokens 16384 2>&1 | tee -a "$out/large.txt"
# Nsight Compute recipe of the README: rank 1 alone under ncu (single-pass
# metrics, so no kernel replay), rank 0 plain, joined by the torchrun variables.
if command -v ncu >/dev/null; then
  export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29611
  RANK=0 LOCAL_RANK=0 timeout 120 $bench --profile --iters 3 --no-baselines --ops dispatch,combine --quiet >/dev/null 2>&1 &
  RANK=1 LOCAL_RANK=1 timeout 120 ncu --clock-control none --kernel-name regex:moe_ep_combine_pull --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    $bench --profile --iters 3 --no-baselines --ops dispatch,combine --quiet 2>&1 | tail -32 | tee "$out/ncu.txt"
  wait
fi
