#!/usr/bin/env bash
# On the GPU machine (python3 with torch + CUDA; no Rust toolchain, no
# network), from the repository root with the wheel built here in .pywheel/
# (.toolchain/maturin/bin/maturin build --release --compatibility linux -m python/Cargo.toml
# -o .pywheel: the plain linux tag, which pip takes whatever the GPU machine's glibc;
# the binary needs glibc >= 2.34 as built on Debian 12):
# installs it into /tmp/site, then runs the Python package's GPU tests at
# NCCL world 1 and virtual worlds 2, 4 and 8, the example at virtual world 4
# and NCCL world 1, and the overhead measurement (Python over Rust, each
# op's Python profile, the Rust host-time probes). Logs
# land in $OUT (or /tmp/gpu-python); the last lines printed are the summary.
# The whole script ends within BUDGET_S seconds (default 420, 7 minutes):
# every step's timeout is cut to what is left of it, and a step with less
# than 10 s left is not started (counted as failed, rc=124).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-python}
mkdir -p "$out"
t0=$(date +%s)
budget=${BUDGET_S:-420}
# NCCL from the python3 here, multicast kept off (as .gpu/env.sh).
nccl_lib=$(python3 -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Virtual ranks: every kernel loaded when CUDA starts (a lazy load at a
# first launch waits for the whole GPU; moe_ep.run_virtual says more).
export RUST_BACKTRACE=1 CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONFAULTHANDLER=1 CUDA_MODULE_LOADING=EAGER

whl=$(ls .pywheel/*.whl 2>/dev/null | head -1)
if [ -z "$whl" ]; then echo "no wheel in .pywheel/ (build it first)"; exit 2; fi
rm -rf /tmp/site
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site "$whl" > "$out/install.log" 2>&1
echo "install $(basename "$whl") rc=$?"
export PYTHONPATH=/tmp/site
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c 'import torch, moe_ep; print("torch", torch.__version__, "cuda", torch.version.cuda, "moe_ep", moe_ep.__version__)'; } > "$out/when.txt" 2>&1

declare -A rc
run() {  # name, timeout (s), command...
  local name=$1 limit=$2; shift 2
  local left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 10 ]; then
    echo "not started: ${left} s of the ${budget} s budget left" > "$out/$name.log"
    rc[$name]=124
    echo "$name not started (budget spent) at $(( $(date +%s) - t0 )) s"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  # SIGABRT at the limit: faulthandler prints every thread's Python stack
  # (a hang shows where each rank's thread waits).
  timeout -s ABRT -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc[$name]=$?
  echo "$name rc=${rc[$name]} at $(( $(date +%s) - t0 )) s"
}
# The CPU tests here too (the package as installed from the wheel).
run cpu-tests 30 python3 -m unittest discover -s python/tests -p 'test_cpu.py' -v
declare -A limit=([1]=70 [2]=70 [4]=80 [8]=100)
for w in 1 2 4 8; do
  MOE_EP_PY_WORLDS=$w run "gpu-tests-world$w" "${limit[$w]}" python3 -m unittest discover -s python/tests/gpu -p 'test_gpu.py' -v
done
run example-virtual4 30 python3 examples/python/moe_layer.py --world 4
run example-nccl1 20 python3 examples/python/moe_layer.py --world 1
run overhead 60 python3 python/bench/overhead.py --iters 100 --profile 15 --json "$out/overhead.json"

echo "== summary"
grep -hE "^(Ran|OK|FAILED)" "$out"/gpu-tests-world*.log "$out/cpu-tests.log" | paste -sd' ' | cut -c1-400
grep -hE "^(FAIL|ERROR):" "$out"/*.log | head -20
grep -h "^world" "$out"/example-*.log
tail -10 "$out/overhead.log"
fails=0
for k in "${!rc[@]}"; do [ "${rc[$k]}" = 0 ] || fails=$((fails + 1)); done
echo "== gpu-python: ${#rc[@]} steps, $fails failed, $(( $(date +%s) - t0 )) s"
[ "$fails" = 0 ]
