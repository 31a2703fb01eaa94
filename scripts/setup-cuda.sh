#!/usr/bin/env bash
# Makes sure nvcc and NCCL's headers are available to build.rs.
# Where no nvcc is found (NVCC, CUDA_HOME/CUDA_PATH, PATH), installs the pinned
# toolchain from PyPI into .toolchain/py of this checkout (ignored by git).
# Prints the environment to use; `source <(scripts/setup-cuda.sh --env)` or
# let scripts/test.sh call it. `--env --dep` adds NVCC and NCCL_INCLUDE_DIR
# for building moe-ep as a dependency (outside this checkout).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tc="$root/.toolchain/py"
pins=('cuda-toolkit[nvcc,crt,nvvm,cudart,cccl]==13.0.2' 'nvidia-nccl-cu13==2.28.9')

have_system_nvcc() {
  [ -n "${NVCC:-}" ] && return 0
  for h in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do [ -n "$h" ] && [ -x "$h/bin/nvcc" ] && return 0; done
  command -v nvcc >/dev/null 2>&1
}

need_install=0
have_system_nvcc || [ -x "$tc/nvidia/cu13/bin/nvcc" ] || need_install=1
# NCCL headers + library for the CPU tests of the loader, wherever nvcc came from.
[ -f "$tc/nvidia/nccl/include/nccl.h" ] || [ -n "${NCCL_INCLUDE_DIR:-}${NCCL_HOME:-}" ] || need_install=1

if [ "$need_install" = 1 ]; then
  echo "setup-cuda: installing ${pins[*]} into $tc" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$tc" "${pins[@]}" >&2
fi

if [ "${1:-}" = "--env" ]; then
  lib="$tc/nvidia/nccl/lib/libnccl.so.2"
  [ -f "$lib" ] && [ -z "${MOE_EP_NCCL_LIBRARY:-}" ] && echo "export MOE_EP_NCCL_LIBRARY=$lib"
  # --env --dep: also name the toolchain explicitly (NVCC, NCCL_INCLUDE_DIR),
  # for builds of moe-ep outside this checkout, whose build.rs cannot see its
  # .toolchain/: a project that depends on moe-ep, or cargo publish's packaged
  # copy. Plain --env leaves them unset, so build.rs finds .toolchain/ itself.
  if [ "${2:-}" = "--dep" ]; then
    if ! have_system_nvcc && [ -x "$tc/nvidia/cu13/bin/nvcc" ]; then
      echo "export NVCC=$tc/nvidia/cu13/bin/nvcc"
    fi
    if [ -z "${NCCL_INCLUDE_DIR:-}${NCCL_HOME:-}" ] && [ -f "$tc/nvidia/nccl/include/nccl.h" ]; then
      echo "export NCCL_INCLUDE_DIR=$tc/nvidia/nccl/include"
    fi
  fi
fi
exit 0
