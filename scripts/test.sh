#!/usr/bin/env bash
# The test command: sets up the CUDA compiler if needed, then runs the tests.
#   scripts/test.sh                      # CPU tests (any machine, no GPU needed)
#   scripts/test.sh --features multi-gpu # adds the GPU suite (needs >= 2 GPUs)
# Extra arguments go to `cargo test`. Ends with one summary line over all
# test binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-cuda.sh --env)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test "$@" 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     END { printf "summary: %d passed, %d failed, %d skipped\n", p, f, s }' "$log"
exit "$status"
