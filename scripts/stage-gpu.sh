#!/usr/bin/env bash
# Stage a GPU run for a machine without a Rust toolchain: build the GPU test
# binaries, ep-bench, the C ABI's library and its C window test here, put
# them in .gpu/ (git-ignored) with an environment file and a runner, and
# pack .gpu/ into .gpu-pack/gpu.tar.xz when it is too large to carry as is.
#
#   scripts/stage-gpu.sh                  # features: multi-gpu
# then, on the GPU machine, from a copy of the checkout that holds .gpu-pack/:
#   python3 -c "import tarfile; tarfile.open('.gpu-pack/gpu.tar.xz').extractall()"
#   bash .gpu/run-tests.sh [FILTER]       # every staged test binary
#   source .gpu/env.sh && .gpu/bin/ep-bench --help
# scripts/gpu-virtual.sh, gpu-bench.sh and gpu-two-gpus.sh run from .gpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-cuda.sh --env)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for p in /.gpu/ /.gpu-pack/; do
  grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"
done
rm -rf .gpu .gpu-pack
mkdir -p .gpu/bin .gpu/tests .gpu/capi

# The test binaries of every package, named test-<target>, and the binaries.
artifacts() {  # cargo's JSON messages -> "kind-name path" of executables
  python3 -c '
import sys, json
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0] + "-" + m["target"]["name"], m["executable"], int(m["profile"]["test"]))'
}
cargo test --release --features multi-gpu --no-run --message-format=json-render-diagnostics \
  | artifacts | while read -r name exe test; do
    [ "$test" = 1 ] && cp "$exe" ".gpu/tests/$name"
  done
cargo build --release --features multi-gpu --bins --message-format=json-render-diagnostics \
  | artifacts | while read -r name exe _; do cp "$exe" .gpu/bin/; done

# The C ABI: libmoe_ep.so under its SONAME, and the C window test against it.
cargo build --release -p moe-ep-capi >&2
lib=${CARGO_TARGET_DIR:-target}/release
cp "$lib/libmoe_ep.so" .gpu/capi/libmoe_ep.so.1
"${CC:-cc}" -std=c11 -Wall -Wextra -pedantic -Icapi/include capi/tests/window_test.c \
  -o .gpu/capi/window_test -L"$lib" -lmoe_ep -lpthread -ldl -Wl,-rpath,'$ORIGIN'
strip .gpu/tests/* .gpu/bin/* .gpu/capi/* 2>/dev/null || true

cat > .gpu/env.sh <<'ENV'
# Source on the GPU machine: NCCL from its python3's nvidia-nccl package,
# NVLink multicast kept off.
nccl_lib=$(python3 -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RUST_BACKTRACE=1
ENV
cat > .gpu/run-tests.sh <<'RUN'
#!/usr/bin/env bash
# Every staged test binary, one test at a time; arguments go to each binary
# (a name filter, --nocapture, ...). The log lands in $OUT (or /tmp).
cd "$(dirname "$0")" && source ./env.sh
log=${OUT:-/tmp}/gpu-tests.log; : > "$log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$log"
status=0
for t in tests/test-*; do
  echo "== $t" | tee -a "$log"
  "./$t" --test-threads=1 "$@" 2>&1 | tee -a "$log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
echo "== C window test" | tee -a "$log"
capi/window_test 2>&1 | tee -a "$log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "== overall: $([ $status = 0 ] && echo PASS || echo FAIL)" | tee -a "$log"
exit $status
RUN
chmod +x .gpu/run-tests.sh
du -sh .gpu
# A call carries at most 64 MiB: the binaries share the embedded kernels,
# so xz packs them about ten to one.
if [ "$(du -sm .gpu | cut -f1)" -ge 48 ]; then
  mkdir -p .gpu-pack
  tar -cf - .gpu | xz -T0 -6 > .gpu-pack/gpu.tar.xz
  du -sh .gpu-pack/gpu.tar.xz
fi
