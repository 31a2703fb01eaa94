// The two-level (inter-node) path's own kernels: the node streams of a home
// rank's tokens, the packing of its rows into its forward batch and its send
// range, the home's sum over nodes and the weight gradients' gather in
// combine's direction, the received rows' sources, and the wait of the
// combine's hop for each chunk of the node combine's rows. The forwarding inside
// a node is the NVLink path's kernels on the node's group; the network hop
// between rail peers is src/ops/two_level/rail_hop.rs.
//
// Rust launchers: src/ops/two_level/ (ops.rs, path.rs). Tests: tests/gpu_two_level.rs
// (against src/reference/two_level.rs). The layout of every array:
// TwoLevelParams in abi.cuh.
#include <stdint.h>

#include "intranode.cuh"

namespace {

constexpr int kStreamThreads = 1024;
constexpr int kWarp = 32;

// Experts per node.
__device__ __forceinline__ int experts_per_node(const TwoLevelParams& p) {
  return p.num_experts / p.nodes;
}

// Where node m's row of token t lies: own_* (m is this rank's node) or
// net_* (a remote node), at the returned row; -1 if t does not reach m.
__device__ __forceinline__ int row_of(const TwoLevelParams& p, int t, int m) {
  const int q = p.pos[(size_t)t * p.nodes + m];
  return q < 0 ? -1 : p.row_off[m] + q;
}

// Node streams: block m scans the tokens in order and gives each token that
// reaches node m (any slot's expert hosted there) its row in the stream to
// m: pos[t][m], and the stream's length lens[m]. Block 0 also checks every
// entry (-1 masked, else 0..E-1, no expert twice in a token) and writes
// lens[N] = 0, or 1 + the smallest key 4 * (t * K + slot) + kind of a bad
// entry (kind 1: out of range, 2: a repeat of an earlier slot's expert).
template <typename Idx>
__device__ void streams_body(const TwoLevelParams& p) {
  __shared__ int scratch[33];
  __shared__ int s_bad;
  const int m = blockIdx.x, T = p.num_tokens, K = p.topk, E = p.num_experts;
  const int en = experts_per_node(p);
  const Idx* idx = static_cast<const Idx*>(p.topk_idx);
  if (threadIdx.x == 0) s_bad = INT32_MAX;
  __syncthreads();
  int base = 0;
  for (int t0 = 0; t0 < T; t0 += kStreamThreads) {
    const int t = t0 + threadIdx.x;
    int reach = 0;
    if (t < T) {
      for (int s = 0; s < K; ++s) {
        const long long e = (long long)idx[(size_t)t * K + s];
        reach |= e >= (long long)m * en && e < (long long)(m + 1) * en;
        if (m == 0) {
          int kind = 0;
          if (e < -1 || e >= E) {
            kind = 1;
          } else if (e >= 0) {
            for (int s2 = 0; s2 < s; ++s2) {
              if ((long long)idx[(size_t)t * K + s2] == e) kind = 2;
            }
          }
          if (kind) atomicMin(&s_bad, 4 * (t * K + s) + kind);
        }
      }
    }
    int total;
    const int before = block_exclusive_scan(reach, scratch, &total);
    if (t < T) p.pos[(size_t)t * p.nodes + m] = reach ? base + before : -1;
    base += total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    p.lens[m] = base;
    if (m == 0) p.lens[p.nodes] = s_bad == INT32_MAX ? 0 : s_bad + 1;
  }
}

// Per token (one thread each), per node m it reaches: its expert ids on m as
// node-local ids (-1 elsewhere, the token's slot order) and its origin
// (home rank, token), at its row for m.
template <typename Idx>
__device__ void pack_ids_body(const TwoLevelParams& p) {
  const int K = p.topk, en = experts_per_node(p);
  const Idx* idx = static_cast<const Idx*>(p.topk_idx);
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < p.num_tokens;
       t += gridDim.x * blockDim.x) {
    for (int m = 0; m < p.nodes; ++m) {
      const int row = row_of(p, t, m);
      if (row < 0) continue;
      const bool own = m == p.node;
      int32_t* ids = (own ? p.own_ids : p.net_ids) + (size_t)row * K;
      for (int s = 0; s < K; ++s) {
        const long long e = (long long)idx[(size_t)t * K + s] - (long long)m * en;
        ids[s] = e >= 0 && e < en ? (int32_t)e : -1;
      }
      int32_t* o = (own ? p.own_origin : p.net_origin) + (size_t)row * 2;
      o[0] = p.home_rank;
      o[1] = t;
    }
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kStreamThreads)
    moe_ep_two_level_streams_i32(const __grid_constant__ TwoLevelParams p) {
  streams_body<int32_t>(p);
}
extern "C" __global__ void __launch_bounds__(kStreamThreads)
    moe_ep_two_level_streams_i64(const __grid_constant__ TwoLevelParams p) {
  streams_body<int64_t>(p);
}
extern "C" __global__ void moe_ep_two_level_pack_ids_i32(const __grid_constant__ TwoLevelParams p) {
  pack_ids_body<int32_t>(p);
}
extern "C" __global__ void moe_ep_two_level_pack_ids_i64(const __grid_constant__ TwoLevelParams p) {
  pack_ids_body<int64_t>(p);
}

// One warp per token: its row x[t] copied to its row for every node it
// reaches, and (with topk_w) its weights there, 0 for the slots whose expert
// is not on that node (the ids pack_ids wrote say which).
extern "C" __global__ void moe_ep_two_level_pack_rows(const __grid_constant__ TwoLevelParams p) {
  const int lane = threadIdx.x % kWarp, K = p.topk, n16 = p.hidden / 8;
  const int warps = gridDim.x * (blockDim.x / kWarp);
  const int4* x = static_cast<const int4*>(p.x);
  for (int t = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < p.num_tokens;
       t += warps) {
    for (int m = 0; m < p.nodes; ++m) {
      const int row = row_of(p, t, m);
      if (row < 0) continue;
      const bool own = m == p.node;
      int4* dst = static_cast<int4*>(own ? p.own_x : p.net_x) + (size_t)row * n16;
      for (int j = lane; j < n16; j += kWarp) st_na_v4(dst + j, ld_nc_v4(x + (size_t)t * n16 + j));
      if (p.topk_w != nullptr && lane < K) {
        const int32_t* ids = (own ? p.own_ids : p.net_ids) + (size_t)row * K;
        float* w = (own ? p.own_w : p.net_w) + (size_t)row * K;
        w[lane] = ids[lane] >= 0 ? p.topk_w[(size_t)t * K + lane] : 0.f;
      }
    }
  }
}

// The home's sum over nodes: one warp per token, out[t] = bf16(sum over the
// nodes t reaches, ascending, of f32(its node's row)), in f32 from 0 (a
// token that reaches no node gets a zero row). The node's rows are the node
// group's combine (own_x: this rank's; net_x: what the rail peers sent back).
extern "C" __global__ void moe_ep_two_level_node_sum(const __grid_constant__ TwoLevelParams p) {
  const int lane = threadIdx.x % kWarp, n16 = p.hidden / 8;
  const int warps = gridDim.x * (blockDim.x / kWarp);
  const int4* own = static_cast<const int4*>(p.own_x);
  const int4* net = static_cast<const int4*>(p.net_x);
  int4* out = static_cast<int4*>(p.out);
  for (int t = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < p.num_tokens;
       t += warps) {
    for (int j = lane; j < n16; j += kWarp) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int m = 0; m < p.nodes; ++m) {
        const int row = row_of(p, t, m);
        if (row < 0) continue;
        const int4* src = (m == p.node ? own : net) + (size_t)row * n16 + j;
        acc_v4(acc, ld_v4(src), 1.f, false);
      }
      st_na_v4(out + (size_t)t * n16 + j, pack_v4(acc));
    }
  }
}

// The weight gradients home: out_w[t][s] is slot s of t's row on the node
// that hosts slot s's expert (own_w / net_w, the node groups' dispatch
// backward, as node_sum reads rows); 0 for a masked slot.
extern "C" __global__ void moe_ep_two_level_gather_w(const __grid_constant__ TwoLevelParams p) {
  const int K = p.topk;
  const int n = p.num_tokens * K;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int t = i / K, s = i % K;
    float g = 0.f;
    for (int m = 0; m < p.nodes; ++m) {
      const int row = row_of(p, t, m);
      if (row < 0) continue;
      const bool own = m == p.node;
      if ((own ? p.own_ids : p.net_ids)[(size_t)row * K + s] >= 0) {
        g = (own ? p.own_w : p.net_w)[(size_t)row * K + s];
      }
    }
    p.out_w[i] = g;
  }
}

// One round of the combine's network hop waits here, on the hop stream,
// while the node group's combine runs on the op stream: thread i < count
// until chunk chunk[i] of the combine's rows is complete (its counter at
// need[i], ChunkWaitParams). Bounded: the node group's timeout, or its
// error word once any of its kernels reported (the launcher also sets
// every counter past any need once the combine kernel has ended, so a
// combine that stopped early never holds the hop until the timeout).
extern "C" __global__ void moe_ep_two_level_wait_chunks(const __grid_constant__ ChunkWaitParams p) {
  const int i = threadIdx.x;
  if (i >= p.count) return;
  const ErrSink err = ws_of(p.op).err(p.op.error, p.op.rank);
  wait_at_least(reinterpret_cast<const uint64_t*>(p.done) + p.chunk[i], p.need[i], p.op.timeout_ns,
                err, p.op.rank, p.peer[i], MOE_EP_CTR_HOP_DEPARTURE);
}

// The received rows' sources: the node group's dispatch gives (forwarding
// node rank j, row r of j's forward batch) in src_in; recv_src gets j's
// origin of that row, (home rank, home token), read from j's own_origin.
// Out of place: src_in is never written, so a source is mapped once. A
// source outside the node's ranks or the origin rows (padding, or rows a
// failed node dispatch left unwritten: its error is the group's) becomes
// (-1, -1) and is never dereferenced; so does an origin outside the world's
// ranks and their tokens (origin_rows = nodes x max tokens per rank), which
// only a peer's bad write gives: nothing a peer wrote reaches the caller
// unchecked.
extern "C" __global__ void moe_ep_two_level_remap_src(const __grid_constant__ TwoLevelParams p) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.recv_rows;
       i += gridDim.x * blockDim.x) {
    const int j = p.src_in[2 * i], r = p.src_in[2 * i + 1];
    int home = -1, tok = -1;
    if (j >= 0 && j < p.node_world && j < MOE_EP_MAX_RANKS && r >= 0 && r < p.origin_rows) {
      const int32_t* o = p.origin_peers[j] + (size_t)r * 2;
      home = o[0];
      tok = o[1];
      const int max_tokens = p.nodes > 0 ? p.origin_rows / p.nodes : 0;
      if (home < 0 || home >= p.nodes * p.node_world || tok < 0 || tok >= max_tokens) {
        home = -1;
        tok = -1;
      }
    }
    p.recv_src[2 * i] = home;
    p.recv_src[2 * i + 1] = tok;
  }
}
