#!/usr/bin/env bash
# The test command: sets up the CUDA compiler if needed, then runs the tests.
#   scripts/test.sh                      # CPU tests (any machine, no GPU needed)
#   scripts/test.sh --features multi-gpu # adds the GPU suite (needs >= 2 GPUs)
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-cuda.sh --env)"
exec cargo test "$@"
