// Combine of the NVLink (intra-node) path, rank-major, with the expert
// outputs in symmetric memory (pulled): the home reads each of its tokens'
// partials where they lie, its own locally and every other rank's over
// NVLink, and sums them in ascending rank order in one pass (the same order
// and bits as the pushed combine): no stage, no chunks.
//
//   moe_ep_combine_pull_r{2,4,8}       combine, and the dispatch backward
//       without weight gradients (a combine of the gradient)
//   moe_ep_dispatch_bwd_pull_r{2,4,8}  the dispatch backward with weight
//       gradients: each token's [K] gradients are read beside its first
//       piece, on the ranks of its experts
//
// (_rN: the bound on the world; the launcher picks the smallest that fits.)
// Each block shakes hands with the same block of every other rank twice
// through pull_flag: "my expert outputs are ready" before its loads
// (2 call + 1) and "I have read yours" before it may end (2 call + 2), since a
// rank may overwrite its expert outputs once its combine is done. Before the
// first, each compares the peer's descriptor of the call with its own
// (intranode.cuh): the same op, outputs in the same place, pulled.
//
// Rust launcher: src/ops/node/combine_op.rs (combine, dispatch_backward). Tests:
// tests/gpu_intranode.rs (the pulled combine and dispatch backward in every
// rank-major case against the CPU reference, bit-identical across runs;
// buffers that differ between ranks refused on every rank).
#include "intranode.cuh"

// kMaxR: compile-time bound on the world (every rank's vectors stay in
// registers). kGradW: the dispatch backward's weight gradients travel too.
template <int kMaxR, bool kGradW>
__device__ void combine_pull(const CombineParams& p) {
  // Every rank's vectors are in flight at once: fewer each for larger worlds
  // (8 per lane per rank at 2 ranks beat 4: BENCHMARKS.md).
  constexpr int kV = kMaxR <= 2 ? 8 : (kMaxR <= 4 ? 4 : 2);
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int n16 = p.op.hidden / 8, T = p.op.num_tokens;
  const Ws ws = ws_of(p.op);
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.op.bufs.info;
  const int lane = threadIdx.x & 31;
  const uint64_t callno = begin_call(p.op);
  if (callno == 0) return;  // an earlier error: skip, telling every peer
  const uint64_t seq = next_seq(ws, 2, me);  // this rank's item counters (ItemClaims)
  const Call call = call_of(p.op, p.desc, callno);
  publish_desc(call);
  // Thread d < R (d != me) shakes hands with block blockIdx.x of rank d.
  const int d_hs = threadIdx.x;
  const bool shakes = d_hs < R && d_hs != me;
  auto handshake = [&](uint64_t value, bool first) {
    bool ok = true;
    // Before the first: rank d's outputs must lie where mine do, and d must
    // pull too (a rank that pushes never shakes hands: without this, its
    // peers would wait for it until the timeout).
    if (shakes && first) ok = desc_agrees(call, d_hs);
    if (shakes && ok) {
      fence_acq_rel_sys();
      st_release_sys_u64(ws.pull_flag(d_hs) + me * MOE_EP_MAX_BLOCKS + blockIdx.x, value);
      ok = wait_peer(call, ws.pull_flag(me) + d_hs * MOE_EP_MAX_BLOCKS + blockIdx.x, value, d_hs,
                     MOE_EP_CTR_COMBINE_PULL);
    }
    return __syncthreads_and(ok) != 0;
  };
  // Items (token, piece), pieces of up to kV vectors per lane.
  const Pieces pc = pieces_of(n16, kV);
  const int4* src[kMaxR];
#pragma unroll
  for (int d = 0; d < kMaxR; ++d) {
    src[d] = d < R ? reinterpret_cast<const int4*>(p.y_peers[d]) : nullptr;
  }
  const int u_off = lane < R ? info[o.dst_u_off + lane] : 0;  // my first row on rank `lane`
  int4* out = reinterpret_cast<int4*>(p.out);
  const int n_items = T * pc.n;
  // Lane d < R: the row on rank d of the token of item `it` (-1: not sent there).
  auto row_of = [&](int it) {
    if (it >= n_items || lane >= R) return -1;
    const int pos = p.op.bufs.rank_pos[(size_t)(it / pc.n) * R + lane];
    return pos >= 0 ? u_off + pos : -1;
  };
  // Items: the dispatch backward (weight gradients read beside each token's
  // first piece) claims them (ItemClaims: 240 -> 193 µs at 24 SMs); the
  // plain combine keeps a fixed stride gw, gw + nw, ... (claims: no faster
  // at 20-32 SMs, 5-8% slower at 16; BENCHMARKS.md).
  constexpr bool claimed = kGradW;
  const ItemClaims claims(ws, 2, me, seq);
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  int it = claimed ? claims.next(lane) : gw;
  int row = row_of(it);  // looked up while the handshake waits
  if (!handshake(2 * call.call + 1, true)) return;
  unsigned long long done = 0;  // the warp's pending progress (done_add)
  while (it < n_items) {
    const int t = it / pc.n, piece = it % pc.n;
    const int it_next = claimed ? claims.next(lane) : it + nw;
    const int row_next = row_of(it_next);  // loaded while this item's rows move
    if (kGradW && piece == 0) {
      // Dispatch backward: slot k's weight gradient lives on the rank that
      // owns expert k, beside the token's row there.
      const int e = lane < K ? p.op.bufs.topk[(size_t)t * K + lane] : -1;
      const int dk = e >= 0 ? e / El : 0;
      const int row_k = __shfl_sync(0xffffffffu, row, dk);
      if (lane < K) {
        p.grad_w_out[(size_t)t * K + lane] =
            (e >= 0 && row_k >= 0) ? p.gw_peers[dk][(size_t)row_k * K + lane] : 0.f;
      }
    }
    int rows[kMaxR];
#pragma unroll
    for (int d = 0; d < kMaxR; ++d) rows[d] = __shfl_sync(0xffffffffu, row, d < R ? d : 0);
    const int first = piece * pc.per * 32, lim = min(n16, first + pc.per * 32);
    int4 v[kMaxR][kV];
#pragma unroll
    for (int d = 0; d < kMaxR; ++d) {
      if (d >= R || rows[d] < 0) continue;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const int x = first + j * 32 + lane;
        v[d][j] = x < lim ? ld_v4(src[d] + (size_t)rows[d] * n16 + x) : make_int4(0, 0, 0, 0);
      }
    }
    sum_ranks_store<kMaxR, kV>(v, rows, R, out, t, n16, first, lim, lane);
    done_add(p, done, t, lim - first);
    it = it_next;
    row = row_next;
  }
  done_flush(p, done);
  handshake(2 * call.call + 2, false);
}

MOE_EP_ENTRIES_BY_WORLD(moe_ep_combine_pull, CombineParams, combine_pull, false)
MOE_EP_ENTRIES_BY_WORLD(moe_ep_dispatch_bwd_pull, CombineParams, combine_pull, true)
