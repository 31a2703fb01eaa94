#!/usr/bin/env bash
# The test command: sets up the CUDA compiler if needed, then runs the tests.
#   scripts/test.sh                      # CPU tests (any machine, no GPU needed)
#   scripts/test.sh --features multi-gpu # adds the GPU suite (needs >= 2 GPUs)
# Extra arguments go to `cargo test`. Ends with one summary line over all
# test binaries: passed, failed, and skipped (ignored tests, and GPU tests
# that found no GPU to run on).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-cuda.sh --env)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test "$@" 2>&1 | tee "$log" || status=$?
# A GPU test that finds no GPU (or too few) prints "SKIP: <test>: <why>" and
# returns, which cargo counts as passed: the summary counts it as skipped,
# with its reason, and not as passed.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     /^ +Running / { delete seen }
     /^SKIP: / { rest = substr($0, 7); k = match(rest, /: (no |needs )/); if (k == 0) next
         name = substr(rest, 1, k - 1); if (name ~ / at / || name in seen) next
         seen[name] = 1; n++; why = substr(rest, k + 2)
         sub(/test [^ ]+ \.\.\. .*$/, "", why); sub(/ \(tried .*$/, "", why); reasons[why]++ }
     END {
       printf "summary: %d passed, %d failed, %d skipped", p - n, f, s + n
       if (n > 0) { printf " (%d ignored, %d GPU tests not run:", s, n; sep = " "; for (r in reasons) { printf "%s%d %s", sep, reasons[r], r; sep = "; " } printf ")" }
       printf "\n"
     }' "$log"
exit "$status"
