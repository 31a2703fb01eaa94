// Combine of the NVLink (intra-node) path with the partials pushed home
// through the group's stage: expert outputs not in symmetric memory, and
// every expert-major combine. Each received token's rows here are reduced in
// f32 (expert-major: ascending row order, optionally weighted), rounded to
// bf16 and pushed into the home rank's stage; the home sums, per token, the
// partials in ascending rank order (the same order and bits as the pulled
// combine), its own read (rank-major) or reduced (expert-major) straight
// from the local expert outputs, never staged.
//
//   moe_ep_combine_push_rank_major_r{2,4,8}    one warp per block pushes
//       with bulk (TMA) copies through a shared-memory ring, the other
//       warps sum (combine; dispatch backward without weight gradients)
//   moe_ep_combine_push_expert_major_r{2,4,8}  every warp pushes, then sums
//       (combine, weighted or not; dispatch backward without weight gradients)
//   moe_ep_dispatch_bwd_push_rank_major_r{2,4,8} / _expert_major_r{2,4,8}
//       the dispatch backward with weight gradients, which travel home beside
//       the rows: every warp pushes, then sums
//
// (_rN: the bound on the world; the launcher picks the smallest that fits.)
// Pipelined over chunks of the home ranks' tokens (CombineParams::num_chunks,
// sub-chunk bounds from the layout): NVLink carries chunk c while local
// memory serves c - 1. Work items are (row, piece), so short chunks still
// spread over every warp.
//
// Rust launcher: src/ops/combine.rs (combine, dispatch_backward). Tests:
// tests/gpu_intranode.rs (the pushed combine and dispatch backward of every
// case against the CPU reference, bit-identical across runs, every chunk
// count; expert-major weighted).
#include "intranode.cuh"



// The rows here that make up one received token's partial: rank-major the
// row itself, expert-major its rows in ascending order. Spread over the warp
// (lane i holds the i-th row and its weight) to keep registers free.
struct RowSet {
  int row;
  float w;
  int n;
};
__device__ __forceinline__ RowSet row_set(const CombineParams& p, int u, bool expert_major, int K,
                                          int lane) {
  RowSet rs;
  if (!expert_major) {
    rs.n = 1;
    rs.row = u;
    rs.w = 1.f;
    return rs;
  }
  const int row_k = lane < K ? p.op.bufs.meta[(size_t)u * K + lane] : -1;
  const bool valid = row_k >= 0;
  // Each valid row's rank among the token's rows (they are distinct), then
  // lane i takes the row of rank i: K + 2n warp steps (ranking again for
  // every i cost 32 shuffles per row).
  int below = 0;
  for (int j = 0; j < K; ++j) {
    const int o = __shfl_sync(0xffffffffu, row_k, j);
    below += (valid && o >= 0 && o < row_k) ? 1 : 0;
  }
  rs.n = __popc(__ballot_sync(0xffffffffu, valid));
  rs.row = -1;
  for (int i = 0; i < rs.n; ++i) {
    const unsigned who = __ballot_sync(0xffffffffu, valid && below == i);
    const int r = __shfl_sync(0xffffffffu, row_k, __ffs(who) - 1);
    if (lane == i) rs.row = r;
  }
  rs.w = (rs.row >= 0 && p.w_rows != nullptr) ? p.w_rows[rs.row] : 1.f;
  return rs;
}

// Brings vectors [first, lim) of every row of a row set into L2 (bulk
// prefetches, one per row). Expert-major items are several whole rows: a
// warp keeps kPrefetchVecs vectors of each row ahead of its loads in
// flight (the next item's first ones while it ends the current one), so
// its loads find L2, not DRAM. (A whole next item ahead, 8 rows of 14 KB
// per warp, overflowed L2: 23 % hits; BENCHMARKS.md.)
constexpr int kPrefetchVecs = 256;  // 4 KiB per row
__device__ __forceinline__ void prefetch_rows(const int4* y, const RowSet& rs, int n16, int first,
                                              int lim, int lane) {
  if (lane < rs.n && lim > first) {
    prefetch_l2(y + (size_t)rs.row * n16 + first, (uint32_t)(lim - first) * 16);
  }
}

// Partial (as bf16) of vectors [base + j*32 + lane] (< lim) of a row set.
template <int kU>
__device__ __forceinline__ void partial_chunks(const int4* y, const RowSet& rs, int n16, int lim,
                                               int base, int lane, bool weighted,
                                               bool expert_major, int4 (&out)[kU]) {
  if (!expert_major) {
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const int c = base + j * 32 + lane;
      out[j] = c < lim ? ld_nc_v4(y + (size_t)rs.row * n16 + c) : make_int4(0, 0, 0, 0);
    }
    return;
  }
  float acc[kU][8];
#pragma unroll
  for (int j = 0; j < kU; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;
  // kB rows' loads in flight at once (kB * kU = 8 vectors per lane), then
  // summed in ascending row order (the same order, and bits, as one row at
  // a time: loads of one row at a time left the warps waiting on memory).
  constexpr int kB = kU >= 8 ? 1 : 8 / kU;
  // NOTE: whole-warp shuffles: every caller's loop bounds are warp-uniform.
  for (int i0 = 0; i0 < rs.n; i0 += kB) {
    int4 v[kB][kU];
    float w[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + b;
      const int row = __shfl_sync(0xffffffffu, rs.row, i & 31);
      w[b] = __shfl_sync(0xffffffffu, rs.w, i & 31);
#pragma unroll
      for (int j = 0; j < kU; ++j) {
        const int c = base + j * 32 + lane;
        v[b][j] = (i < rs.n && c < lim) ? ld_nc_v4(y + (size_t)row * n16 + c) : make_int4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      if (i0 + b >= rs.n) break;
#pragma unroll
      for (int j = 0; j < kU; ++j) acc_v4(acc[j], v[b][j], w[b], weighted);
    }
  }
#pragma unroll
  for (int j = 0; j < kU; ++j) out[j] = pack_v4(acc[j]);
}

// Which rank's stream a flattened index over the ranges [lo[s], hi[s]) of
// every s != me falls in; returns s and turns *i into the row (lo[s] + rest).
__device__ __forceinline__ int locate(const int* lo, const int* hi, int R, int me, int* i) {
  for (int s = 0; s < R; ++s) {
    if (s == me) continue;
    const int len = hi[s] - lo[s];
    if (*i < len) {
      *i += lo[s];
      return s;
    }
    *i -= len;
  }
  return -1;
}

// kMaxR: compile-time bound on the world, so the home's loads of every
// rank's partial stay in registers (kHome vectors each). kGradW: the
// dispatch backward's weight gradients travel beside the rows.
//
// Rank-major without weight gradients: warp 0 of each block is the pusher
// (bulk copies, no registers in flight, chunk by chunk; it releases the
// block's flag for chunk c once its copies are written) and the other warps
// sum: they wait for every other rank's chunk c and reduce it, while the
// pushers already move chunk c + 1.
// Expert-major (partials are f32 sums of several rows), and rank-major with
// weight gradients: every warp pushes its share of chunk c, marks it (the
// block's last warp releases the flag), then sums chunk c - 1.
template <int kMaxR, bool kExpertMajor, bool kGradW>
__device__ void combine_push(const CombineParams& p) {
  // Vectors per lane per rank the home sum loads at once (rank-major at 2
  // ranks: 4 and 8 measured alike, BENCHMARKS.md); expert-major home sums
  // hold f32 accumulators too: fewer vectors.
  constexpr int kHomeRm = kMaxR <= 2 ? 4 : (kMaxR <= 4 ? 2 : 1);
  constexpr int kHome = kExpertMajor ? (kMaxR <= 2 ? 2 : 1) : kHomeRm;
  constexpr int kEm = 2;  // expert-major partials: vectors per lane per step (f32 sums)
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int n16 = p.op.hidden / 8, T = p.op.num_tokens, nb = p.op.num_blocks;
  const Ws ws = ws_of(p.op);
  if (ws.stopped(me)) return;  // a layout exchange found an error: skip, in step with every rank
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.op.bufs.info;
  const int n = count_row(R, E);
  constexpr bool expert_major = kExpertMajor;
  const bool weighted = p.w_rows != nullptr;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int C = p.num_chunks, sub_per_chunk = MOE_EP_SUBCHUNKS / C;
  // Expert-major items are whole rows: a token's row set (its local expert
  // rows, sorted) is worked out once per token, not once per piece. A chunk
  // with fewer rows (or home tokens) than working warps is cut into pieces
  // instead, so that few tokens still spread over every warp (whole rows
  // left most warps idle and the rest walking long rows: 200 tokens cost
  // ~400 µs).
  const Pieces pc = expert_major ? Pieces{1, (n16 + 31) / 32} : pieces_of(n16);
  auto pieces_for = [&](int n_rows, int n_warps) {
    return expert_major && n_rows < n_warps ? pieces_of(n16) : pc;
  };

  // s_lo[c][s] .. s_lo[c + 1][s]: rows (u) from rank s whose home tokens are in chunk c.
  __shared__ int s_lo[MOE_EP_SUBCHUNKS + 1][MOE_EP_MAX_RANKS];
  __shared__ int s_home_slot[MOE_EP_MAX_RANKS], s_my_slot_on[MOE_EP_MAX_RANKS];
  __shared__ int s_src_u_off[MOE_EP_MAX_RANKS + 1];
  __shared__ unsigned s_arrived[MOE_EP_SUBCHUNKS];
  __shared__ uint64_t s_bar[MOE_EP_BULK_BUFS];
  extern __shared__ __align__(128) unsigned char s_bulk[];  // [BULK_BUFS][BULK_VECS * 512]
  for (int i = threadIdx.x; i < (C + 1) * R; i += blockDim.x) {
    const int c = i / R, s = i % R;
    const int j = c * sub_per_chunk;
    const int total = info[o.counts + s * n + E + me];  // s's tokens for me
    const int before = j == 0 ? 0
                       : j == MOE_EP_SUBCHUNKS
                           ? total
                           : info[o.counts + s * n + E + R + me * (MOE_EP_SUBCHUNKS - 1) + j - 1];
    s_lo[c][s] = info[o.src_u_off + s] + before;
  }
  if (threadIdx.x < R) {
    s_home_slot[threadIdx.x] = info[o.home_slot + threadIdx.x];
    s_my_slot_on[threadIdx.x] = info[o.my_slot_on + threadIdx.x];
  }
  if (threadIdx.x <= R) s_src_u_off[threadIdx.x] = info[o.src_u_off + threadIdx.x];
  if (threadIdx.x < MOE_EP_SUBCHUNKS) s_arrived[threadIdx.x] = 0;
  if (!expert_major && threadIdx.x < MOE_EP_BULK_BUFS) {
    mbar_init(&s_bar[threadIdx.x], 1);
    fence_mbar_init();
  }
  const uint64_t seq = next_seq(ws, 2, me);  // also the barrier for the shared arrays
  const ErrSink err = ws.err(p.op.error, me);
  publish_desc(ws, 1, seq, p.desc, me);
  const int parity = (int)(seq & 1);
  const int4* y = reinterpret_cast<const int4*>(p.y);
  int4* stage_here = ws.stage(me, parity, p.op.hidden);
  const float* stage_w_here = ws.stage_w(me, parity);
  int4* out = reinterpret_cast<int4*>(p.out);
  // Flag value meaning "chunk c of combine `seq` is pushed": grows over chunks and calls.
  auto chunk_flag = [&](int c) { return seq * (MOE_EP_SUBCHUNKS + 1) + (uint64_t)c + 1; };
  auto release_chunk = [&](int c) {
    fence_acq_rel_sys();
    for (int d = 0; d < R; ++d) {
      st_release_sys_u64(ws.combine_done(d) + me * MOE_EP_MAX_BLOCKS + blockIdx.x, chunk_flag(c));
    }
  };
  // Rows pushed for chunk c: from every other rank s, s_lo[c][s] .. s_lo[c + 1][s].
  auto rows_of_chunk = [&](int c) {
    int rows = 0;
    for (int s = 0; s < R; ++s) rows += s == me ? 0 : s_lo[c + 1][s] - s_lo[c][s];
    return rows;
  };
  // Push item `it` of chunk c: piece `piece` of row u (from home s) into slot `slot` there.
  struct PushItem {
    int u, s, slot, piece, first, lim;
  };
  auto push_item = [&](int c, int it, const Pieces& pc) {
    PushItem q;
    q.u = it / pc.n;
    q.piece = it % pc.n;
    q.s = locate(s_lo[c], s_lo[c + 1], R, me, &q.u);
    q.slot = s_my_slot_on[q.s] + (q.u - s_src_u_off[q.s]);
    q.first = q.piece * pc.per * 32;
    q.lim = min(n16, q.first + pc.per * 32);
    return q;
  };
  // Gradient of the dispatched top-k weights travels home beside the row.
  auto push_grad_w = [&](const PushItem& q) {
    if (!kGradW || q.piece != 0 || lane >= K) return;
    float g = 0.f;
    if (!expert_major) {
      g = p.grad_w_in[(size_t)q.u * K + lane];
    } else {
      const int row_k = p.op.bufs.meta[(size_t)q.u * K + lane];
      g = row_k >= 0 ? p.grad_w_in[row_k] : 0.f;
    }
    ws.stage_w(q.s, parity)[(size_t)q.slot * MOE_EP_MAX_TOPK + lane] = g;
  };
  // Every other rank's blocks have pushed chunk c (one warp; false on timeout/error).
  auto wait_chunk = [&](int c) {
    bool ok = true;
    if (c == 0) {
      // Before any peer's chunk is awaited: every peer runs this op and
      // pushes (a rank that pulls never pushes: without this, its peers
      // would wait for it until the timeout).
      if (lane < R && lane != me) ok = desc_agrees(ws, 1, seq, p.desc, me, lane, p.op.timeout_ns, err);
      if (!__all_sync(0xffffffffu, ok)) return false;
    }
    const uint64_t* flags = ws.combine_done(me);
    for (int i = lane; i < R * nb; i += 32) {
      const int s = i / nb, b = i % nb;
      if (s == me) continue;
      ok &= wait_at_least(flags + s * MOE_EP_MAX_BLOCKS + b, chunk_flag(c), p.op.timeout_ns, err, me,
                          s, MOE_EP_CTR_COMBINE_DONE);
    }
    return __all_sync(0xffffffffu, ok) != 0;
  };
  // Sums home tokens of chunk cs, items w0, w0 + nws, ... (one warp).
  auto reduce_chunk = [&](int cs, int w0, int nws) {
    const int t_lo = (int)((long)(cs * sub_per_chunk) * T / MOE_EP_SUBCHUNKS);
    const int t_hi = (int)((long)((cs + 1) * sub_per_chunk) * T / MOE_EP_SUBCHUNKS);
    const Pieces pc = pieces_for(t_hi - t_lo, nws);
    const int n_items = (t_hi - t_lo) * pc.n;
    int pos =
        (w0 < n_items && lane < R) ? p.op.bufs.rank_pos[(size_t)(t_lo + w0 / pc.n) * R + lane] : -1;
    RowSet rs_next;  // expert-major: the next item's own rows, when have_next
    rs_next.n = 0;
    bool have_next = false;
    for (int it = w0; it < n_items; it += nws) {
      const int t = t_lo + it / pc.n, piece = it % pc.n;
      const int slot =
          pos >= 0 ? (lane == me ? s_src_u_off[me] + pos : s_home_slot[lane] + pos) : -1;
      // This warp's next item: its positions now, its rows into L2 below.
      const int itn = it + nws;
      const int pos_next = (itn < n_items && lane < R)
                               ? p.op.bufs.rank_pos[(size_t)(t_lo + itn / pc.n) * R + lane]
                               : -1;
      int slots[kMaxR];
#pragma unroll
      for (int d = 0; d < kMaxR; ++d) slots[d] = __shfl_sync(0xffffffffu, slot, d < R ? d : 0);
      const int u_self = slots[me < kMaxR ? me : 0];
      RowSet rs;
      rs.n = 0;
      if (have_next) {
        rs = rs_next;
      } else if (u_self >= 0) {
        rs = row_set(p, u_self, expert_major, K, lane);
      }
      have_next = false;
      if (expert_major && itn < n_items) {
        // The next item's own rows: worked out now, prefetched into L2.
        const int pn = __shfl_sync(0xffffffffu, pos_next, me);
        if (pn >= 0) {
          rs_next = row_set(p, s_src_u_off[me] + pn, true, K, lane);
          have_next = true;
          const int fn = (itn % pc.n) * pc.per * 32;
          prefetch_rows(y, rs_next, n16, fn, min(min(n16, fn + pc.per * 32), fn + kPrefetchVecs),
                        lane);
        }
      }
      const int first = piece * pc.per * 32, lim = min(n16, first + pc.per * 32);
      for (int base = first; base < lim; base += 32 * kHome) {
        if (expert_major) {
          const int ahead = base + kPrefetchVecs;
          prefetch_rows(y, rs, n16, ahead, min(lim, ahead + 32 * kHome), lane);
        }
        int4 v[kMaxR][kHome];
        if (!expert_major && base == first && pos_next >= 0) {
          // Lane d < R: the next item's partial from rank d.
          const int fn = (itn % pc.n) * pc.per * 32;
          const uint32_t bytes = (uint32_t)(min(n16, fn + pc.per * 32) - fn) * 16;
          if (lane == me) {
            prefetch_l2(y + (size_t)(s_src_u_off[me] + pos_next) * n16 + fn, bytes);
          } else {
            prefetch_l2(stage_here + (size_t)(s_home_slot[lane] + pos_next) * n16 + fn, bytes);
          }
        }
#pragma unroll
        for (int d = 0; d < kMaxR; ++d) {
          if (d >= R || slots[d] < 0) continue;
          if (d == me) {
            partial_chunks<kHome>(y, rs, n16, lim, base, lane, weighted, expert_major, v[d]);
          } else {
#pragma unroll
            for (int j = 0; j < kHome; ++j) {
              const int x = base + j * 32 + lane;
              v[d][j] = x < lim ? ld_v4(stage_here + (size_t)slots[d] * n16 + x)
                                : make_int4(0, 0, 0, 0);
            }
          }
        }
        sum_ranks_store<kMaxR, kHome>(v, slots, R, out, t, n16, base, lim, lane);
      }
      if (kGradW && piece == 0 && lane < K) {
        const int e = p.op.bufs.topk[(size_t)t * K + lane];
        float g = 0.f;
#pragma unroll
        for (int d = 0; d < kMaxR; ++d) {
          if (e < 0 || e / El != d || slots[d] < 0) continue;
          if (d != me) {
            g = stage_w_here[(size_t)slots[d] * MOE_EP_MAX_TOPK + lane];
          } else if (!expert_major) {
            g = p.grad_w_in[(size_t)slots[d] * K + lane];
          } else {
            const int row_k = p.op.bufs.meta[(size_t)slots[d] * K + lane];
            g = row_k >= 0 ? p.grad_w_in[row_k] : 0.f;
          }
        }
        p.grad_w_out[(size_t)t * K + lane] = g;
      }
      pos = pos_next;
    }
  };

  // NOTE: as in dispatch, every rank sees the same overflow and skips together.
  for (int d = 0; d < R; ++d) {
    if (info[o.rows_needed + d] > p.op.recv_capacity) return;
  }

  // Rank-major without weight gradients: pusher + summers. With them (the
  // dispatch backward) every warp moves rows and gradients, as in expert-major:
  // per-row gradient loads in the pusher's issue loop slowed it down.
  if constexpr (!kExpertMajor && !kGradW) {
    if (warp != 0) {
      // ---- summers: chunk by chunk, as the other ranks' pushers finish them ----
      const int w0 = blockIdx.x * (kWarps - 1) + warp - 1, nws = nb * (kWarps - 1);
      for (int c = 0; c < C; ++c) {
        if (!wait_chunk(c)) return;
        reduce_chunk(c, w0, nws);
      }
      return;
    }
    // ---- pusher (warp 0): this block's pieces, chunk after chunk, global -> shared -> home ----
    // One sequence over every chunk: piece g of this block loads into ring
    // buffer g % BULK_BUFS, BULK_AHEAD pieces ahead of its store, reusing the
    // buffer of the store BULK_BUFS back. Chunk c is released once its last
    // store is kDelay stores old and those older stores are complete, so the
    // ring never drains between chunks.
    constexpr int kBufs = MOE_EP_BULK_BUFS, kAhead = MOE_EP_BULK_AHEAD, kDelay = 2;
    constexpr int kSlot = MOE_EP_BULK_VECS * 512;
    static_assert(kAhead < kBufs && kDelay < kBufs, "ring sizes");
    Pieces pb;  // pieces as large as a slot: few, long copies
    pb.n = (n16 + 32 * MOE_EP_BULK_VECS - 1) / (32 * MOE_EP_BULK_VECS);
    pb.per = (n16 + 32 * pb.n - 1) / (32 * pb.n);
    // This block's pieces of chunk c; a cursor walks the sequence chunk by
    // chunk (c, and [lo, hi): the sequence indices of chunk c's pieces).
    auto mine = [&](int c) -> int {
      const int n_items = rows_of_chunk(c) * pb.n, bid = blockIdx.x;
      return n_items > bid ? (n_items - bid + nb - 1) / nb : 0;
    };
    struct Cursor {
      int c, lo, hi;
    };
    auto seek = [&](Cursor& k, int g) {
      while (g >= k.hi && k.c < C - 1) {
        ++k.c;
        k.lo = k.hi;
        k.hi += mine(k.c);
      }
    };
    int total = 0;
    for (int c = 0; c < C; ++c) total += mine(c);
    auto item_at = [&](Cursor& k, int g) {
      seek(k, g);
      return push_item(k.c, blockIdx.x + (g - k.lo) * nb, pb);
    };
    // NOTE: working out an item (item_at) is a chain of dependent shared
    // loads and divisions, about 600 cycles: done for every load and every
    // store by one lane it took half the pusher's time (probes, 2 x H200).
    // So the lanes work out 32 items at once: lane i the load and the store
    // items g and gs with g % 32 == i, each lane with its own cursors.
    Cursor lk{0, 0, mine(0)}, sk = lk, rk = lk;  // loads, stores, releases (rk.c = next to release)
    PushItem ql{}, qs{};                         // this lane's load and store items of the batch
    uint32_t phase = 0;  // lane 0: bit b = parity of buffer b's next completion
    int rel = 0;         // next chunk to release
    bool ok = true;
    // Item g's fields, from the lane that worked it out (whole warp).
    auto from_lane = [&](const PushItem& mine_q, int g) {
      PushItem q;
      const int l = g % 32;
      q.u = __shfl_sync(0xffffffffu, mine_q.u, l);
      q.s = __shfl_sync(0xffffffffu, mine_q.s, l);
      q.slot = __shfl_sync(0xffffffffu, mine_q.slot, l);
      q.first = __shfl_sync(0xffffffffu, mine_q.first, l);
      q.lim = __shfl_sync(0xffffffffu, mine_q.lim, l);
      return q;
    };
    for (int g = 0; g < total + kAhead && ok; ++g) {
      if (g < total) {
        if (g % 32 == 0 && g + lane < total) ql = item_at(lk, g + lane);
        const PushItem q = from_lane(ql, g);
        if (lane == 0) {
          // Stores issued so far: g - kAhead; the one of piece g - kBufs is
          // followed by kBufs - kAhead - 1 newer ones.
          if (g >= kBufs) bulk_wait_read<kBufs - kAhead - 1>();
          const int b = g % kBufs;
          const uint32_t bytes = (uint32_t)(q.lim - q.first) * 16;
          mbar_expect_tx(&s_bar[b], bytes);
          bulk_load(s_bulk + b * kSlot, y + (size_t)q.u * n16 + q.first, bytes, &s_bar[b]);
        }
      }
      const int gs = g - kAhead;
      if (gs < 0 || gs >= total) continue;
      if (gs % 32 == 0 && gs + lane < total) qs = item_at(sk, gs + lane);
      const PushItem q = from_lane(qs, gs);
      if (lane == 0) {
        const int b = gs % kBufs;
        ok = mbar_wait(&s_bar[b], (phase >> b) & 1u, p.op.timeout_ns, err, me, MOE_EP_CTR_BULK_COPY);
        phase ^= 1u << b;
        int4* dst = ws.stage(q.s, parity, p.op.hidden) + (size_t)q.slot * n16 + q.first;
        if (ok) bulk_store(dst, s_bulk + b * kSlot, (uint32_t)(q.lim - q.first) * 16);
        bulk_commit();
      }
      __syncwarp();
      if (lane == 0) {
        // Chunks whose last store is at least kDelay stores old.
        bool waited = false;
        while (ok && rel < C && rk.hi <= gs + 1 - kDelay) {
          if (!waited) bulk_wait<kDelay>();
          waited = true;
          release_chunk(rel++);
          if (rel < C) {
            rk.lo = rk.hi;
            rk.hi += mine(rel);
          }
        }
      }
      ok = __shfl_sync(0xffffffffu, ok, 0) != 0;
    }
    __syncwarp();
    if (!ok) return;
    if (lane == 0) {
      bulk_wait<0>();
      while (rel < C) release_chunk(rel++);
    }
    return;
  }
  {
    // Every warp pushes its share of chunk c, marks it, then sums chunk c - 1.
    constexpr int kU = expert_major ? kEm : kPiece;
    const int gw = blockIdx.x * kWarps + warp, nw = gridDim.x * kWarps;
    for (int c = 0; c <= C; ++c) {
      // ---- push chunk c: partials of the rows whose home tokens are in it ----
      if (c < C) {
        const Pieces pc = pieces_for(rows_of_chunk(c), nw);
        const int n_items = rows_of_chunk(c) * pc.n;
        PushItem q_next = gw < n_items ? push_item(c, gw, pc) : PushItem{};
        RowSet rs_next;
        if (gw < n_items) rs_next = row_set(p, q_next.u, expert_major, K, lane);
        for (int it = gw; it < n_items; it += nw) {
          const PushItem q = q_next;
          const RowSet rs = rs_next;
          if (it + nw < n_items) {
            // The next item's rows: worked out now, prefetched into L2.
            q_next = push_item(c, it + nw, pc);
            rs_next = row_set(p, q_next.u, expert_major, K, lane);
            if (expert_major) {
              prefetch_rows(y, rs_next, n16, q_next.first,
                            min(q_next.lim, q_next.first + kPrefetchVecs), lane);
            }
          }
          int4* dst = ws.stage(q.s, parity, p.op.hidden) + (size_t)q.slot * n16;
          for (int base = q.first; base < q.lim; base += 32 * kU) {
            if (expert_major) {
              const int ahead = base + kPrefetchVecs;
              prefetch_rows(y, rs, n16, ahead, min(q.lim, ahead + 32 * kU), lane);
            }
            int4 v[kU];
            partial_chunks<kU>(y, rs, n16, q.lim, base, lane, weighted, expert_major, v);
#pragma unroll
            for (int j = 0; j < kU; ++j) {
              const int x = base + j * 32 + lane;
              if (x < q.lim) st_na_v4(dst + x, v[j]);
            }
          }
          push_grad_w(q);
        }
        // The block's last warp to finish chunk c releases it to every rank.
        __syncwarp();
        if (lane == 0) {
          __threadfence_block();
          if (atomicAdd(&s_arrived[c], 1u) == kWarps - 1) release_chunk(c);
        }
      }
      // ---- sum chunk c - 1 ----
      if (c == 0) continue;
      if (!wait_chunk(c - 1)) return;
      reduce_chunk(c - 1, gw, nw);
    }
  }
}

MOE_EP_ENTRIES_BY_WORLD(moe_ep_combine_push_rank_major, CombineParams, combine_push, false, false)
MOE_EP_ENTRIES_BY_WORLD(moe_ep_combine_push_expert_major, CombineParams, combine_push, true, false)
MOE_EP_ENTRIES_BY_WORLD(moe_ep_dispatch_bwd_push_rank_major, CombineParams, combine_push, false, true)
MOE_EP_ENTRIES_BY_WORLD(moe_ep_dispatch_bwd_push_expert_major, CombineParams, combine_push, true,
                        true)
