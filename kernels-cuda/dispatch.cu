// Dispatch of the NVLink (intra-node) path, and the combine backward (a
// dispatch of the output gradient), one entry point per receive layout:
//
//   moe_ep_dispatch_rank_major       rows grouped by source rank, with [K]
//       weights and local expert ids per row
//   moe_ep_dispatch_expert_major     one row per (token, local expert), grouped
//       by expert and padded; the token crosses NVLink once per rank and the
//       receiver writes its extra rows
//   moe_ep_combine_bwd_rank_major / _expert_major   the same bodies for the
//       gradient (no weights or metadata; expert-major rows optionally scaled)
//
// Each warp claims a token at a time (ItemClaims), reads its row once and
// stores it into the receive buffer of every rank that hosts one of the
// token's experts (rank-major: row u; expert-major: the row of its first
// local expert there, the receiver copies the others; on the sender's own
// rank the sender writes every row). The warp's next item is claimed, its
// routing loaded and its row fetched into L2 while the current one moves.
// Then one flag per (me, block) on every rank, a bounded wait for everyone's
// flags, and (expert-major) the receiver's local copies, which read the
// token's rows there from the meta the senders wrote beside the rows. A warp's first row
// for a rank waits for that rank's descriptor of the call and writes only
// if it equals this rank's (publish_desc, desc_agrees in intranode.cuh).
//
// Rust launchers: src/ops/node/dispatch_op.rs (dispatch, combine_backward). Tests:
// tests/gpu_intranode.rs (every routing case bit for bit against the CPU
// reference, zero copy, capacity, pipelined handles, CUDA graphs).
#include "intranode.cuh"

namespace {

constexpr int kUnroll = 8;  // receiver: 16-byte vectors in flight per lane per row chunk

// Signals every rank that this block's stores of the call are done, then
// waits until every (rank, block) has signalled it. Returns false on
// timeout/error (reported).
__device__ bool signal_and_wait(const Call& c, int num_blocks) {
  const Ws& ws = c.ws;
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int d = 0; d < ws.R; ++d) {
      st_release_sys_u64(ws.dispatch_done(d) + c.me * MOE_EP_MAX_BLOCKS + blockIdx.x, c.call);
    }
  }
  bool ok = true;
  const uint64_t* mine = ws.dispatch_done(c.me);
  for (int i = threadIdx.x; i < ws.R * num_blocks; i += blockDim.x) {
    const int s = i / num_blocks, b = i % num_blocks;
    if (ok) ok = wait_peer(c, mine + s * MOE_EP_MAX_BLOCKS + b, c.call, s, MOE_EP_CTR_DISPATCH_DONE);
  }
  return __syncthreads_and(ok) != 0;
}

// 8 bf16 values times w, in f32, rounded back to bf16 (the expert-major
// combine backward's scaled rows).
__device__ __forceinline__ int4 scale_v4(int4 v, float w) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const uint32_t h[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = bf16x2_to_f32x2(h[i]);
    acc[2 * i] = __fmul_rn(w, f.x);
    acc[2 * i + 1] = __fmul_rn(w, f.y);
  }
  return pack_v4(acc);
}

// Copies a row of n16 vectors, `per` (<= kPiece) per lane per pass, from
// local `src` to every rank in `dmask` (row pointer dst[r]) and, with
// kLocal, to the rows lrow[k] of `local` for k in `lmask` (scaled by lw[k]
// when `scaled`). One warp; the row is read once.
template <bool kLocal>
__device__ __forceinline__ void copy_row(const int4* src, int4* const (&dst)[MOE_EP_MAX_RANKS],
                                         unsigned dmask, int4* local, unsigned lmask,
                                         const int (&lrow)[MOE_EP_MAX_TOPK],
                                         const float (&lw)[MOE_EP_MAX_TOPK], bool scaled, int n16,
                                         int per, int lane, bool coherent) {
  for (int base = 0; base < n16; base += 32 * per) {
    int4 v[kPiece];
#pragma unroll
    for (int i = 0; i < kPiece; ++i) {
      const int idx = base + i * 32 + lane;
      if (i < per && idx < n16) v[i] = coherent ? ld_v4(src + idx) : ld_nc_v4(src + idx);
    }
#pragma unroll
    for (int r = 0; r < MOE_EP_MAX_RANKS; ++r) {
      if (!((dmask >> r) & 1u)) continue;
#pragma unroll
      for (int i = 0; i < kPiece; ++i) {
        const int idx = base + i * 32 + lane;
        if (i < per && idx < n16) st_na_v4(dst[r] + idx, v[i]);
      }
    }
    if constexpr (kLocal) {
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
        if (!((lmask >> k) & 1u)) continue;
        int4* row = local + (size_t)lrow[k] * n16;
#pragma unroll
        for (int i = 0; i < kPiece; ++i) {
          const int idx = base + i * 32 + lane;
          if (i < per && idx < n16) st_na_v4(row + idx, scaled ? scale_v4(v[i], lw[k]) : v[i]);
        }
      }
    }
  }
}

// Whether row t of x may be read: with p.arrive, the warp's lane 0 waits
// (bounded) for its chunk of the network hop, then the warp syncs, so that
// every lane's later loads of the row and its weights see the chunk.
// false: the wait failed (reported); the warp takes no more rows.
__device__ __forceinline__ bool row_arrived(const DispatchParams& p, int t, int me, int lane,
                                            const ErrSink& err) {
  if (p.arrive == nullptr) return true;
  bool ok = true;
  if (lane == 0) {
    const int c = p.arrive_of[t];
    if (c >= 0) {
      ok = wait_at_least(p.arrive + c, p.arrive_epoch, p.op.timeout_ns, err, me, p.arrive_peer[c],
                         MOE_EP_CTR_HOP_ARRIVAL);
    }
  }
  ok = __shfl_sync(0xffffffffu, (int)ok, 0) != 0;
  __syncwarp();
  return ok;
}

// One token's routing as this lane sees it (lane < R: rank d = lane; lane < K: slot k = lane).
struct TokRoute {
  int pos;   // position in my stream to rank `lane`, -1 if not sent
  int e;     // expert of slot `lane`, -1 masked
  int epos;  // position of (t, slot) in my stream to expert e (expert-major)
  float wt;  // top-k weight of slot `lane`
};
__device__ __forceinline__ TokRoute load_route(const DispatchParams& p, int t, int R, int K,
                                               bool expert_major, int lane) {
  TokRoute r;
  r.pos = lane < R ? p.op.bufs.rank_pos[(size_t)t * R + lane] : -1;
  r.e = lane < K ? p.op.bufs.topk[(size_t)t * K + lane] : -1;
  r.epos = (expert_major && lane < K) ? p.op.bufs.expert_pos[(size_t)t * K + lane] : 0;
  r.wt = (lane < K && p.topk_w != nullptr) ? p.topk_w[(size_t)t * K + lane] : 0.f;
  return r;
}
}  // namespace

template <bool kExpertMajor>
__device__ void dispatch_body(const DispatchParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  // Row vectors: bf16 rows of hidden / 8, or fp8 rows of row16; and the
  // fp8 rows' scale words beside them (0: none).
  const int n16 = p.row16 > 0 ? p.row16 : p.op.hidden / 8;
  const int sw = p.scale_words;
  const Ws ws = ws_of(p.op);
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.op.bufs.info;
  constexpr bool expert_major = kExpertMajor;
  const bool scaled = p.scale_w != nullptr;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const uint64_t callno = begin_call(p.op);
  if (callno == 0) return;  // an earlier error: skip, telling every peer
  const uint64_t seq = next_seq(ws, 1, me);  // this rank's item counters (ItemClaims)
  const Call call = call_of(p.op, p.desc, callno);
  const ErrSink& err = call.err;
  publish_desc(call);

  // NOTE: every rank derived rows_needed from the same matrix: if one rank
  // would overflow, every rank skips the data and only keeps the flags in step.
  bool overflow = false;
  for (int d = 0; d < R; ++d) overflow |= info[o.rows_needed + d] > p.op.recv_capacity;

  int4* rx = reinterpret_cast<int4*>(p.recv_x[me]);
  if (expert_major && !overflow) {
    // Zero padding rows at the tail of each local expert's block (only this
    // rank writes them, so before the wait). Padding row i of expert j goes
    // to warp (j * (alignment - 1) + i) mod nw: every expert's padding
    // starts on another warp, so all warps share the zeros (with a fixed
    // start, every expert's padding fell on the first alignment - 1 warps:
    // for alignment 16, one SM wrote them all). The lanes read 32 experts'
    // bounds at once.
    const int4 zero = make_int4(0, 0, 0, 0);
    const long pad_max = p.op.alignment > 1 ? p.op.alignment - 1 : 1;
    for (int j0 = 0; j0 < El; j0 += 32) {
      const int j = j0 + lane;
      const int first_l = j < El ? info[o.expert_start + j] + info[o.expert_count + j] : 0;
      const int end_l = j < El ? info[o.expert_start + j + 1] : 0;
      const int i0_l = (int)(((gw - (long)j * pad_max) % nw + nw) % nw);  // this warp's first row
      unsigned mine = __ballot_sync(0xffffffffu, first_l + i0_l < end_l);
      while (mine != 0u) {
        const int l = __ffs(mine) - 1;
        mine &= mine - 1u;
        const int first = __shfl_sync(0xffffffffu, first_l + i0_l, l);
        const int end = __shfl_sync(0xffffffffu, end_l, l);
        for (int row = first; row < end; row += nw) {
          if (p.zero_pad) {
            for (int c = lane; c < n16; c += 32) st_na_v4(rx + (size_t)row * n16 + c, zero);
            for (int c = lane; c < sw; c += 32) p.recv_xs[me][(size_t)row * sw + c] = 0u;
          }
          if (lane == 0) {
            if (p.recv_w[me]) p.recv_w[me][row] = 0.f;
            if (p.recv_idx[me]) p.recv_idx[me][row] = -1;
            if (p.recv_src[me]) {
              p.recv_src[me][(size_t)row * 2] = -1;
              p.recv_src[me][(size_t)row * 2 + 1] = -1;
            }
          }
        }
      }
    }
  }

  // ---- sender ----
  const int4* x = reinterpret_cast<const int4*>(p.x);
  const int u_off = lane < R ? info[o.dst_u_off + lane] : 0;  // my first row on rank `lane`
  // Items are whole rows (row pieces were slower: BENCHMARKS.md), moved
  // `per` vectors per lane per pass (the piece size of pieces_of).
  const int per = pieces_of(n16).per;
  const int n_items = overflow ? 0 : p.op.num_tokens;
  const ItemClaims claims(ws, 1, me, seq);
  TokRoute cur{-1, -1, 0, 0.f};
  // Ranks whose descriptor this warp found equal to mine (written to only then).
  unsigned agreed = 1u << me;
  const bool coherent = p.arrive != nullptr;  // rows land while this kernel runs
  int t = n_items > 0 ? claims.next(lane) : n_items;
  if (t < n_items && !row_arrived(p, t, me, lane, err)) t = n_items;
  if (t < n_items) cur = load_route(p, t, R, K, expert_major, lane);
  while (t < n_items) {
    // Claims only grow, so the next token is another one: its routing now,
    // its row into L2.
    int t_next = claims.next(lane);
    if (t_next < n_items && !row_arrived(p, t_next, me, lane, err)) t_next = n_items;
    TokRoute next = cur;
    if (t_next < n_items) {
      next = load_route(p, t_next, R, K, expert_major, lane);
      if (lane == 0) prefetch_l2(x + (size_t)t_next * n16, (uint32_t)n16 * 16);
    }

    const int u = cur.pos >= 0 ? u_off + cur.pos : -1;
    const int e = cur.e;
    const int dk = e >= 0 ? e / El : -1;
    const int erow = (expert_major && e >= 0) ? info[o.erow_base + e] + cur.epos : -1;
    unsigned dmask = __ballot_sync(0xffffffffu, u >= 0);
    if (const unsigned ask = dmask & ~agreed) {
      // First rows for these ranks: their buffers must lie where mine do.
      const bool bad = ((ask >> lane) & 1u) && !desc_agrees(call, lane);
      if (__any_sync(0xffffffffu, bad)) break;  // reported; no row goes anywhere
      agreed |= ask;
    }
    int4* dst[MOE_EP_MAX_RANKS];
    int drow[MOE_EP_MAX_RANKS];  // the row on rank d (scales go beside it)
#pragma unroll
    for (int d = 0; d < MOE_EP_MAX_RANKS; ++d) {
      dst[d] = nullptr;
      drow[d] = -1;
      if (d < R) {
        const int ud = __shfl_sync(0xffffffffu, u, d);
        // Expert-major: the token's first (lowest) row on d.
        int row = ud;
        if (expert_major) {
          int cand = dk == d ? erow : 0x7fffffff;
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, off));
          // No slot left on d (the drop policy dropped its rows there):
          // nothing goes to d but the meta row that says so.
          row = (ud >= 0 && cand != 0x7fffffff) ? cand : -1;
        }
        if (row >= 0) dst[d] = reinterpret_cast<int4*>(p.recv_x[d]) + (size_t)row * n16;
        drow[d] = row;
      }
    }
    if (expert_major) {
#pragma unroll
      for (int d = 0; d < MOE_EP_MAX_RANKS; ++d) {
        if (drow[d] < 0) dmask &= ~(1u << d);
      }
    }
    // Expert-major rows on my own rank: every one written here (slot k's
    // row lrow[k]), none left for the receiver pass.
    int lrow[MOE_EP_MAX_TOPK];
    float lw[MOE_EP_MAX_TOPK];
    unsigned lmask = 0u;
    if (!expert_major) {
      copy_row<false>(x + (size_t)t * n16, dst, dmask, nullptr, 0u, lrow, lw, false, n16, per,
                      lane, coherent);
    } else {
      lmask = __ballot_sync(0xffffffffu, dk == me);
      const float my_w = (scaled && dk == me) ? p.scale_w[erow] : 1.f;
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
        lrow[k] = __shfl_sync(0xffffffffu, erow, k);
        lw[k] = __shfl_sync(0xffffffffu, my_w, k);
      }
      copy_row<true>(x + (size_t)t * n16, dst, dmask & ~(1u << me), rx, lmask, lrow, lw, scaled,
                     n16, per, lane, coherent);
    }
    // fp8: the row's scales beside it on every rank (expert-major: every
    // row of this rank written here, the receivers copy their extra rows').
    if (sw > 0) {
      const unsigned remote = expert_major ? dmask & ~(1u << me) : dmask;
      for (int c = lane; c < sw; c += 32) {
        const uint32_t v = p.xs[(size_t)t * sw + c];
#pragma unroll
        for (int d = 0; d < MOE_EP_MAX_RANKS; ++d) {
          if ((remote >> d) & 1u) p.recv_xs[d][(size_t)drow[d] * sw + c] = v;
        }
#pragma unroll
        for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
          if ((lmask >> k) & 1u) p.recv_xs[me][(size_t)lrow[k] * sw + c] = v;
        }
      }
    }

    // Metadata: top-k weights, local expert ids, source.
    if (!expert_major) {
      for (int d = 0; d < R; ++d) {
        const int ud = __shfl_sync(0xffffffffu, u, d);
        if (ud < 0) continue;
        if (lane < K) {
          if (p.recv_w[d]) p.recv_w[d][(size_t)ud * K + lane] = dk == d ? cur.wt : 0.f;
          if (p.recv_idx[d]) p.recv_idx[d][(size_t)ud * K + lane] = dk == d ? e - d * El : -1;
        }
        if (lane == 0 && p.recv_src[d]) {
          p.recv_src[d][(size_t)ud * 2] = me;
          p.recv_src[d][(size_t)ud * 2 + 1] = t;
        }
      }
    } else {
      // The receivers' meta: per rank d the token goes to, the rows of its
      // experts on d (-1 for slots of other ranks), at the token's row u there.
      for (int d = 0; d < R; ++d) {
        const int ud = __shfl_sync(0xffffffffu, u, d);
        if (ud >= 0 && lane < K) p.meta[d][(size_t)ud * K + lane] = dk == d ? erow : -1;
      }
    }
    if (expert_major && lane < K && e >= 0) {
      if (p.recv_w[dk]) p.recv_w[dk][erow] = cur.wt;
      if (p.recv_idx[dk]) p.recv_idx[dk][erow] = e - dk * El;
      if (p.recv_src[dk]) {
        p.recv_src[dk][(size_t)erow * 2] = me;
        p.recv_src[dk][(size_t)erow * 2 + 1] = t;
      }
    }
    cur = next;
    t = t_next;
  }

  if (!signal_and_wait(call, p.op.num_blocks)) return;
  // Every rank has published (its block 0 signalled after): each block
  // compares all descriptors, so every rank of a call whose ranks disagree
  // reports it, also ranks that sent nothing to the one that differs.
  const bool agree = threadIdx.x >= R || threadIdx.x == me || desc_agrees(call, threadIdx.x);
  if (!__syncthreads_and(agree) || overflow || !expert_major) return;

  // ---- receiver (expert-major): extra copies of each token from other ranks ----
  const int self_lo = info[o.src_u_off + me], self_hi = info[o.src_u_off + me + 1];
  const int u_count = info[o.src_u_off + R] - (self_hi - self_lo);
  // A row a sender wrote is trusted only inside this rank's rows (the
  // padded blocks of its experts, from the checked count matrix; a caller's
  // buffers sized after the host counts hold no more), and its capacity.
  const int cap = min(p.op.recv_capacity, info[o.expert_start + El]);
  for (int i = gw; i < u_count; i += nw) {
    const int u = i < self_lo ? i : i + (self_hi - self_lo);
    const int row_k = lane < K ? p.op.bufs.meta[(size_t)u * K + lane] : -1;
    const bool bad_row = row_k >= cap || row_k < -1;
    if (__any_sync(0xffffffffu, bad_row)) {
      if (bad_row) {
        int s = 0;  // the sender of received token u
        while (s + 1 < R && info[o.src_u_off + s + 1] <= u) ++s;
        report_error(err, MOE_EP_ERR_BAD_PEER_DATA, me, s, MOE_EP_FIELD_META, (uint64_t)cap,
                     (uint64_t)(int64_t)row_k, (uint64_t)u, 0);
      }
      break;
    }
    int primary = row_k >= 0 ? row_k : 0x7fffffff;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) primary = min(primary, __shfl_xor_sync(0xffffffffu, primary, off));
    const unsigned rows_mask = __ballot_sync(0xffffffffu, row_k >= 0);
    if (rows_mask == 0u) continue;  // every row of the token here dropped
    const float wk = (scaled && row_k >= 0) ? p.scale_w[row_k] : 1.f;
    // NOTE: rows/weights gathered with full-warp shuffles before the chunk
    // loop, where lanes may leave early when n16 is not a multiple of 32.
    int rows[MOE_EP_MAX_TOPK];
    float wrow[MOE_EP_MAX_TOPK];
#pragma unroll
    for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
      rows[k] = __shfl_sync(0xffffffffu, row_k, k);
      wrow[k] = __shfl_sync(0xffffffffu, wk, k);
    }
    for (int base = 0; base < n16; base += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int c = base + i * 32 + lane;
        if (c < n16) v[i] = ld_v4(rx + (size_t)primary * n16 + c);
      }
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
        if (!((rows_mask >> k) & 1u) || (rows[k] == primary && !scaled)) continue;
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          const int c = base + i * 32 + lane;
          if (c < n16) st_na_v4(rx + (size_t)rows[k] * n16 + c, scaled ? scale_v4(v[i], wrow[k]) : v[i]);
        }
      }
    }
    for (int c = lane; c < sw; c += 32) {
      const uint32_t v = p.recv_xs[me][(size_t)primary * sw + c];
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
        if (((rows_mask >> k) & 1u) && rows[k] != primary) p.recv_xs[me][(size_t)rows[k] * sw + c] = v;
      }
    }
  }
}

MOE_EP_ENTRY(moe_ep_dispatch_rank_major, DispatchParams, dispatch_body<false>)
MOE_EP_ENTRY(moe_ep_dispatch_expert_major, DispatchParams, dispatch_body<true>)
// Combine backward: the output gradient dispatched like tokens (no weights,
// no metadata; expert-major rows scaled by scale_w when given). The same
// bodies, named for the profile.
MOE_EP_ENTRY(moe_ep_combine_bwd_rank_major, DispatchParams, dispatch_body<false>)
MOE_EP_ENTRY(moe_ep_combine_bwd_expert_major, DispatchParams, dispatch_body<true>)
