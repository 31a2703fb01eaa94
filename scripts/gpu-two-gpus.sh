#!/usr/bin/env bash
# On a machine of 2 GPUs, from a checkout with .gpu/ staged
# (scripts/stage-gpu.sh, then unpacked) and, for NCCL EP beside moe-ep,
# .nccl-ep/ (git-ignored: lib/libnccl_ep.so.0 and include/ from PyPI's
# nccl-extensions 0.1.0 wheel, NCCL 2.30.7's source tarball (release
# v2.30.7-1) and a build-nccl.sh that builds it for sm_90 into its first
# argument; docs/profiler.md, "NCCL EP beside it"): every 2-GPU run that
# BENCHMARKS.md's open gaps wait for, in one command.
#   1. the whole GPU suite on the real GPUs (virtual worlds beside them);
#   2. high throughput, 4096 tokens, hidden 7168, top-8 of 256, 24 SMs, both
#      layouts, every op, with the ceilings and NCCL EP in the same run;
#   3. low latency at 128 tokens (both layouts, bf16 and fp8) and a sweep
#      of 1 to 256 tokens;
#   4. the two-level path as 2 nodes x 1 GPU over NCCL's socket transport:
#      gpu_two_level on the real GPUs, ep-bench --ranks-per-node 1 beside
#      NCCL's own send / receive of the same bytes (the rail-hop row), the
#      ops in 512-row chunks against one chunk (the overlap's gain), and
#      the C++ example if .gpu/ex/ holds it (examples/cpp/intranode and
#      libmoe_ep.so.1 from capi/install.sh beside it, or on LD_LIBRARY_PATH).
# Logs land in $OUT (or /tmp), one file per step; the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/env.sh
out=${OUT:-/tmp}
bench=.gpu/bin/ep-bench
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv; } > "$out/when.txt"
t0=$(date +%s)
step() { echo "$1 rc=$2 at $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"; }

# 1. The suite.
for t in .gpu/tests/*; do
  name=$(basename "$t")
  timeout "${MOE_EP_TEST_TIMEOUT:-600}" "$t" --test-threads=1 > "$out/$name.log" 2>&1
  step "$name" $?
done

# NCCL 2.30.7 for NCCL EP (70 s), when its files are staged.
nccl_ep=()
if [ -f .nccl-ep/lib/libnccl_ep.so.0 ] && [ -f .nccl-ep/build-nccl.sh ]; then
  bash .nccl-ep/build-nccl.sh /tmp/nccl > "$out/build-nccl.txt" 2>&1
  step build-nccl $?
  nccl_ep=(env LD_LIBRARY_PATH="/tmp/nccl/lib:$PWD/.nccl-ep/lib:${LD_LIBRARY_PATH:-}"
    MOE_EP_NCCL_LIBRARY=/tmp/nccl/lib/libnccl.so.2 NCCL_HOME=/tmp/nccl NCCL_EP_HOME="$PWD/.nccl-ep")
fi

# 2. High throughput, with the peer-store / peer-load ceilings and NCCL EP.
timeout 300 "${nccl_ep[@]}" $bench --gpus 2 --tokens 4096 --hidden 7168 --topk 8 --experts 256 \
  --num-sms 24 --layout rank,expert:128 --check \
  --ops layout,dispatch,combine,combine-push,dispatch-bwd,combine-bwd \
  --json "$out/ht.json" > "$out/ht.txt" 2>&1
step ht $?

# 3. Low latency: 128 tokens, then the sweep.
timeout 300 "${nccl_ep[@]}" $bench --gpus 2 --mode ll --tokens 128 --hidden 7168 --topk 8 \
  --experts 256 --num-sms 24 --layout expert,rank --check --json "$out/ll.json" > "$out/ll.txt" 2>&1
step ll $?
timeout 300 $bench --gpus 2 --mode ll --tokens 1,2,4,8,16,32,64,128,256 --hidden 7168 --topk 8 \
  --experts 256 --num-sms 24 --layout expert,rank --check --no-nccl-ep > "$out/ll-sweep.txt" 2>&1
step ll-sweep $?

# 4. Two nodes of one GPU over NCCL's socket transport.
sockets=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo
  MOE_EP_TEST_VIRTUAL_WORLDS=none)
timeout 900 "${sockets[@]}" .gpu/tests/test-gpu_two_level --test-threads=1 > "$out/two-level-sockets.log" 2>&1
step two-level-sockets $?
timeout 300 "${sockets[@]}" $bench --gpus 2 --ranks-per-node 1 --tokens 4096 --hidden 7168 --topk 8 \
  --experts 256 --num-sms 24 --layout rank,expert:128 --check \
  --ops layout,dispatch,combine,dispatch-bwd,combine-bwd --json "$out/two-level.json" \
  > "$out/two-level.txt" 2>&1
step two-level-bench $?
# The overlap itself: the default 512-row chunks against one chunk per
# stream (no overlap), over the same transport.
for rows in 512 4096; do
  timeout 300 "${sockets[@]}" $bench --gpus 2 --ranks-per-node 1 --tokens 4096 --hidden 7168 --topk 8 \
    --experts 256 --num-sms 24 --layout rank,expert:128 --hop-chunk-rows $rows \
    --ops dispatch,combine,dispatch-bwd,combine-bwd > "$out/two-level-chunks-$rows.txt" 2>&1
  step two-level-chunks-$rows $?
done
if [ -x .gpu/ex/intranode ]; then
  timeout 120 "${sockets[@]}" .gpu/ex/intranode --gpus 2 --ranks-per-node 1 > "$out/example-sockets.txt" 2>&1
  step example-sockets $?
  timeout 120 .gpu/ex/intranode --gpus 2 --ll > "$out/example.txt" 2>&1
  step example $?
fi

grep -hE "^test result|FAILED after" "$out"/*.log | cut -c1-200 | head -20
cat "$out/summary.txt"
