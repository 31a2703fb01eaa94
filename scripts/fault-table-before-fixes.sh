#!/usr/bin/env bash
# The fault table of tests/gpu_guarantees.rs as first written (commit
# ef2494b), run against the library before the protocol fixes (07b1a82, the
# parent of 78cd0db): the evidence that each row fails on the code it was
# written to fix.
#
#   scripts/fault-table-before-fixes.sh build   # here: a worktree of 07b1a82 in
#       $PREFIX_TREE (default /tmp/moe-ep-07b1a82), the table of ef2494b with the
#       three edits of fault-table-before-fixes.patch (the old API has no
#       PeerFailed, no PeerTimeout::absent, no Handle::meta_for_tests), built
#       in its own target dir; the binary lands in .gpu-prefix/ (git-ignored).
#   bash scripts/fault-table-before-fixes.sh run  # on the GPU machine, with .gpu-prefix/
#       carried: every fault_ and plain_loop_ row in its own process, one
#       summary line each; the log in $OUT/prefix.log (OUT default /tmp).
#       BUDGET_S (default 420): no row starts that could end past it;
#       PER_TEST_S (default 45); TESTS="a b": those rows only.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bin=$root/.gpu-prefix/test-gpu_guarantees-07b1a82
case ${1:-} in
build)
  set -e
  tree=${PREFIX_TREE:-/tmp/moe-ep-07b1a82}
  eval "$(scripts/setup-cuda.sh --env)"
  [ -d "$tree" ] || git worktree add --detach "$tree" 07b1a82
  git show ef2494b:tests/gpu_guarantees.rs > "$tree/tests/gpu_guarantees.rs"
  patch -s "$tree/tests/gpu_guarantees.rs" < scripts/fault-table-before-fixes.patch
  [ -e "$tree/.toolchain" ] || ln -s "$root/.toolchain" "$tree/.toolchain"
  exe=$(cd "$tree" && CARGO_TARGET_DIR=${PREFIX_TARGET:-/tmp/moe-ep-07b1a82-target} \
    cargo test --release --features multi-gpu --test gpu_guarantees --no-run \
      --message-format=json-render-diagnostics |
    python3 -c 'import sys, json
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
  mkdir -p .gpu-prefix
  grep -qx /.gpu-prefix/ "$(git rev-parse --git-path info/exclude)" ||
    echo /.gpu-prefix/ >> "$(git rev-parse --git-path info/exclude)"
  cp "$exe" "$bin" && strip "$bin"
  ls -l "$bin"
  ;;
run)
  out=${OUT:-/tmp}; mkdir -p "$out"; log=$out/prefix.log
  budget=${BUDGET_S:-420} per=${PER_TEST_S:-45}
  nccl_lib=$(python3 -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
  [ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export NCCL_NVLS_ENABLE=0 MOE_EP_TEST_VIRTUAL_WORLDS=${MOE_EP_TEST_VIRTUAL_WORLDS:-2,4,8}
  if [ -n "${TESTS:-}" ]; then
    read -r -a tests <<< "$TESTS"
  else
    mapfile -t tests < <("$bin" --list 2>/dev/null | sed -n 's/: test$//p' |
      grep -E '^(fault_|plain_loop_)' | grep -v '_soak$')
  fi
  { echo "== $(date -u '+%F %T') UTC $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)";
    echo "== worlds $MOE_EP_TEST_VIRTUAL_WORLDS, ${#tests[@]} rows, $per s each"; } | tee -a "$log"
  t0=$(date +%s) pass=0 fail=0 tout=0 skipped=()
  for name in "${tests[@]}"; do
    if (( $(date +%s) - t0 + per + 5 > budget )); then skipped+=("$name"); continue; fi
    s0=$(date +%s)
    timeout -k 5 "$per" "$bin" "$name" --exact --test-threads=1 --nocapture > "$out/row.txt" 2>&1
    rc=$?
    { echo "===== $name rc=$rc"; cat "$out/row.txt"; } >> "$log"
    case $rc in 0) pass=$((pass + 1)) ;; 124|137) tout=$((tout + 1)) ;; *) fail=$((fail + 1)) ;; esac
    # The line that says most: the panic's message, else the result line.
    why=$(grep -A1 'panicked at' "$out/row.txt" | sed -n 2p)
    [ -n "$why" ] || why=$(grep -E '^test result' "$out/row.txt" | tail -1)
    echo "$name rc=$rc $(( $(date +%s) - s0 ))s ${why:0:220}"
  done
  rm -f "$out/row.txt"
  echo "== pass=$pass fail=$fail timeout=$tout in $(( $(date +%s) - t0 )) s${skipped:+; not started: ${skipped[*]}}" | tee -a "$log"
  ;;
*) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
