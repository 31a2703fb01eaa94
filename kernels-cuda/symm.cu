// Symmetric memory helpers: the one kernel that includes NCCL's device API.
//
// moe_ep_peer_pointers resolves, for one registered window, the address at
// which every load/store-reachable peer's copy of the window is mapped into
// this GPU's address space. The hot kernels then get plain pointers and never
// include an NCCL header.
//
// Rust launcher: src/symm/mod.rs (on NCCL 2.28.x; newer NCCL answers on the
// host). Tests: tests/gpu_symm.rs.
#include <nccl.h>
#include <nccl_device.h>

#include "abi.cuh"

// One thread. out[p] = peer p's window base as seen from here, for p in
// [first, first + count): the ranks that share this node (NCCL's LSA team),
// in world-rank order. Peers on other nodes get no entry (the host leaves 0).
extern "C" __global__ void moe_ep_peer_pointers(ncclWindow_t win, int first, int count,
                                                unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int i = 0; i < count; ++i) {
    out[first + i] = reinterpret_cast<unsigned long long>(ncclGetPeerPointer(win, 0, first + i));
  }
}

// The structs Rust mirrors from nccl.h (src/sys/nccl.rs): sizes checked here
// against the numbers the Rust side asserts too.
static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId mirror");
static_assert(sizeof(ncclConfig_t) == MOE_EP_NCCL_CONFIG_BYTES, "ncclConfig_t mirror (src/sys/nccl.rs)");
static_assert(sizeof(ncclResult_t) == 4, "ncclResult_t is a C int");
static_assert(sizeof(ncclWindow_t) == 8 && sizeof(ncclComm_t) == 8, "opaque handles are pointers");
