#!/usr/bin/env bash
# On a machine with one GPU, from a checkout with .gpu/ staged
# (scripts/stage-gpu.sh, then unpacked): the whole GPU suite on virtual ranks at world
# 2, 4 and 8, then ep-bench --virtual-ranks 8 --check at 4096 tokens, hidden
# 7168, top-8 of 256, both layouts. Logs land in $OUT (or /tmp); the last
# lines printed are the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/env.sh
export MOE_EP_TEST_VIRTUAL_WORLDS=${MOE_EP_TEST_VIRTUAL_WORLDS:-2,4,8}
out=${OUT:-/tmp}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$out/when.txt"
t0=$(date +%s)
for t in .gpu/tests/*; do
  name=$(basename "$t")
  timeout "${MOE_EP_TEST_TIMEOUT:-400}" "$t" --test-threads=1 > "$out/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - t0 )) s"
done
timeout 120 .gpu/bin/ep-bench --virtual-ranks 8 --tokens 4096 --hidden 7168 --topk 8 --experts 256 \
  --layout rank,expert:128 --check --iters 5 --warmup 2 --json "$out/virtual8.json" > "$out/virtual8.txt" 2>&1
echo "ep-bench --virtual-ranks 8 rc=$? at $(( $(date +%s) - t0 )) s"
grep -hE "^test result|FAILED after|^    rank" "$out"/*.log | cut -c1-240 | head -40
tail -12 "$out/virtual8.txt"
