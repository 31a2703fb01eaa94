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
//   moe_ep_combine_push_expert_major_r{2,4,8}  one warp per block brings
//       each item's row pieces into stages of shared memory by bulk copies,
//       the other warps sum every item together (combine, weighted or not;
//       dispatch backward without weight gradients)
//   moe_ep_dispatch_bwd_push_rank_major_r{2,4,8}  the dispatch backward with
//       weight gradients, which travel home beside the rows: every warp
//       pushes, then sums
//   moe_ep_dispatch_bwd_push_expert_major_r{2,4,8}  the same, through the
//       expert-major stages
//
// (_rN: the bound on the world; the launcher picks the smallest that fits.)
// Pipelined over chunks of the home ranks' tokens (CombineParams::num_chunks,
// sub-chunk bounds from the layout): NVLink carries chunk c while local
// memory serves c - 1. Work items are (row, piece), so short chunks still
// spread over every warp.
//
// Rust launcher: src/ops/node/combine_op.rs (combine, dispatch_backward). Tests:
// tests/gpu_intranode.rs (the pushed combine and dispatch backward of every
// case against the CPU reference, bit-identical across runs, every chunk
// count; expert-major weighted).
#include "intranode.cuh"



// Vectors [base + j * 32 + lane] (< lim) of row u (rank-major: a received
// row is the token's partial from this rank).
template <int kU>
__device__ __forceinline__ void row_chunks(const int4* y, int u, int n16, int lim, int base,
                                           int lane, int4 (&out)[kU]) {
#pragma unroll
  for (int j = 0; j < kU; ++j) {
    const int c = base + j * 32 + lane;
    out[j] = c < lim ? ld_nc_v4(y + (size_t)u * n16 + c) : make_int4(0, 0, 0, 0);
  }
}

// Expert-major combine: items (row pieces of one token) in flight per block.
constexpr int kEmStages = 8;
// The fewest stages the pieces are cut for. Measured at world 1 (one H200,
// 2026-12-01, the working tree after b518b47; BENCHMARKS.md, raw output
// docs/perf-log/raw/2026-12-01-em-combine-variants.txt), combine at 4096
// tokens: in 200 KiB, 3 (halves at hidden 7168, top-8) 477.89 µs against
// 576.72 for 4; in 128 KiB, 2 / 3 / 4: 546.16 / 606.48 / 672.02.
constexpr int kEmMinStages = 3;

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
  // Rank-major: vectors per lane per rank the home sum loads at once (at 2
  // ranks 4 and 8 measured alike, BENCHMARKS.md).
  constexpr int kHome = kMaxR <= 2 ? 4 : (kMaxR <= 4 ? 2 : 1);
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int n16 = p.op.hidden / 8, T = p.op.num_tokens, nb = p.op.num_blocks;
  const Ws ws = ws_of(p.op);
  const uint64_t callno = begin_call(p.op);
  if (callno == 0) return;  // an earlier error: skip, telling every peer
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.op.bufs.info;
  const int n = count_row(R, E);
  const bool weighted = p.w_rows != nullptr;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int C = p.num_chunks, sub_per_chunk = MOE_EP_SUBCHUNKS / C;

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
  // Expert-major stages: copies landed (one arrival: the producer's), and
  // read (one arrival per consumer warp).
  __shared__ uint64_t s_em_full[kExpertMajor ? kEmStages : 1], s_em_empty[kExpertMajor ? kEmStages : 1];
  // Each warp's pending progress (done_add), in shared memory: in registers
  // it made some of these kernels spill.
  __shared__ unsigned long long s_done[kWarps];
  if (threadIdx.x < kWarps) s_done[threadIdx.x] = 0ull;
  if (!kExpertMajor && threadIdx.x < MOE_EP_BULK_BUFS) {
    mbar_init(&s_bar[threadIdx.x], 1);
    fence_mbar_init();
  }
  if (kExpertMajor && threadIdx.x < 2 * kEmStages) {
    if (threadIdx.x < kEmStages) {
      mbar_init(&s_em_full[threadIdx.x], 1);
    } else {
      mbar_init(&s_em_empty[threadIdx.x - kEmStages], kWarps - 1);
    }
    fence_mbar_init();
  }
  next_seq(ws, 2, me);  // the barrier for the shared arrays (and this rank's item counters)
  const Call call = call_of(p.op, p.desc, callno);
  const ErrSink& err = call.err;
  publish_desc(call);
  const int parity = (int)(call.call & 1);
  // Expert-major rows a sender wrote (meta) are trusted only inside this
  // rank's rows (the padded blocks of its experts, from the checked count
  // matrix; a caller's buffers sized after the host counts hold no more)
  // and its capacity.
  const int cap = min(p.op.recv_capacity, info[o.expert_start + El]);
  const int4* y = reinterpret_cast<const int4*>(p.y);
  int4* stage_here = ws.stage(me, parity, p.op.hidden);
  const float* stage_w_here = ws.stage_w(me, parity);
  int4* out = reinterpret_cast<int4*>(p.out);
  // Flag value meaning "chunk c of this call is pushed": grows over chunks and calls.
  auto chunk_flag = [&](int c) { return call.call * (MOE_EP_SUBCHUNKS + 1) + (uint64_t)c + 1; };
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
  // Every other rank's blocks have pushed chunk c (one warp; false on timeout/error).
  auto wait_chunk = [&](int c) {
    bool ok = true;
    if (c == 0) {
      // Before any peer's chunk is awaited: every peer runs this op and
      // pushes (a rank that pulls never pushes: without this, its peers
      // would wait for it until the timeout).
      if (lane < R && lane != me) ok = desc_agrees(call, lane);
      if (!__all_sync(0xffffffffu, ok)) return false;
    }
    const uint64_t* flags = ws.combine_done(me);
    for (int i = lane; i < R * nb; i += 32) {
      const int s = i / nb, b = i % nb;
      if (s == me || !ok) continue;
      ok = wait_peer(call, flags + s * MOE_EP_MAX_BLOCKS + b, chunk_flag(c), s, MOE_EP_CTR_COMBINE_DONE);
    }
    return __all_sync(0xffffffffu, ok) != 0;
  };

  // Expert-major: the block streams its items through stages of shared
  // memory. Warp 0 works out 32 items at a time (one per lane: the rows here
  // in ascending order, their weights, where the sum goes), then for each
  // item fills a free stage: its header, and one bulk (TMA) copy per row
  // piece. The other warps sum each stage's pieces per vector in that row
  // order (the same arithmetic, order and bits as one row at a time) and
  // store the partial (push: into the home's stage) or the home sum (with
  // the other ranks' partials, ascending rank). Whole row pieces per copy,
  // up to kEmStages items ahead, every consumer thread on every item: the
  // register path's loads (8 vectors per lane, prefetched into L2) kept the
  // DRAM at 0.9 TB/s, and per-warp rings of 1-4 KiB copies no better
  // (BENCHMARKS.md).
  if constexpr (kExpertMajor) {
    constexpr int kNC = kWarps - 1;  // consumer warps
    // Item header, one per stage (and the producer's table of 32 items).
    struct EmItem {
      int n, first, lim, t, u, s, slot, pad;  // rows here; vectors [first, lim); target
      int slots[MOE_EP_MAX_RANKS];             // home sums: each rank's row (-1: none)
      int rows[MOE_EP_MAX_TOPK];               // the rows here, ascending
      float w[MOE_EP_MAX_TOPK];                // their weights, in that order
      float g[MOE_EP_MAX_TOPK];                // weight gradients of the rows here, by slot k
    };
    constexpr int kItemWords = sizeof(EmItem) / 4;
    static_assert(kItemWords <= 64, "an item's words: two per lane");
    __shared__ EmItem s_tab[32];
    __shared__ EmItem s_hdr[kEmStages];
    // Pieces: the fewest that give kEmMinStages stages of K pieces each.
    auto slot_bytes_of = [&](int np) { return (((n16 + np - 1) / np) * 16 + 127) / 128 * 128; };
    int np_min = 1;
    while (np_min < n16 && K * slot_bytes_of(np_min) * kEmMinStages > MOE_EP_EM_COMBINE_SMEM) ++np_min;
    const int slot_bytes = slot_bytes_of(np_min), stage_bytes = K * slot_bytes;
    const int n_st = min(kEmStages, MOE_EP_EM_COMBINE_SMEM / stage_bytes);
    // Per phase: cut rows into more pieces when there are fewer rows than blocks.
    auto np_for = [&](int rows) {
      const int want = rows > 0 ? (nb + rows - 1) / rows : 1;
      return max(np_min, min(want, max(1, n16 / 32)));
    };
    // This block's items of a phase: it = blockIdx.x + k * nb < n_items.
    auto my_items = [&](int n_items) {
      return n_items > (int)blockIdx.x ? (n_items - (int)blockIdx.x + nb - 1) / nb : 0;
    };
    if (warp == 0) {
      // ---- producer ----
      uint32_t seqn = 0;
      bool ok = true;
      // The lane's item of a batch: rows (of u, ascending), weights, target.
      // A row a sender wrote (meta) is trusted only inside `cap`, and once
      // a token: one outside, or repeated, is reported (the item then sums
      // no such row, and the kernel stops at its next wait).
      auto fill_rows = [&](EmItem& e, int u) {
        int raw[MOE_EP_MAX_TOPK];
#pragma unroll
        for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
          raw[k] = k < K ? p.op.bufs.meta[(size_t)u * K + k] : -1;
          if (raw[k] >= cap || raw[k] < -1) {
            report_error(err, MOE_EP_ERR_BAD_PEER_DATA, me, -1, MOE_EP_FIELD_META, (uint64_t)cap,
                         (uint64_t)(int64_t)raw[k], (uint64_t)u, 0);
            raw[k] = -1;
          }
        }
#pragma unroll
        for (int k = 1; k < MOE_EP_MAX_TOPK; ++k) {
          bool repeated = false;
#pragma unroll
          for (int j = 0; j < k; ++j) repeated |= raw[k] >= 0 && raw[j] == raw[k];
          if (repeated) {
            report_error(err, MOE_EP_ERR_BAD_PEER_DATA, me, -1, MOE_EP_FIELD_META_REPEATED, 0,
                         (uint64_t)(int64_t)raw[k], (uint64_t)u, 0);
            raw[k] = -1;
          }
        }
        int cnt = 0;
#pragma unroll
        for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
          int rank = 0;
#pragma unroll
          for (int j = 0; j < MOE_EP_MAX_TOPK; ++j) rank += (raw[j] >= 0 && raw[j] < raw[k]) ? 1 : 0;
          if (raw[k] >= 0) {
            e.rows[rank] = raw[k];
            ++cnt;
          }
          if (kGradW && k < K) e.g[k] = raw[k] >= 0 ? p.grad_w_in[raw[k]] : 0.f;
        }
        e.n = cnt;
#pragma unroll
        for (int j = 0; j < MOE_EP_MAX_TOPK; ++j) {
          if (j < cnt) e.w[j] = weighted ? p.w_rows[e.rows[j]] : 1.f;
        }
      };
      auto run_phase = [&](bool push, int c) {
        int rows, t_lo = 0;
        if (push) {
          rows = rows_of_chunk(c);
        } else {
          t_lo = (int)((long)(c * sub_per_chunk) * T / MOE_EP_SUBCHUNKS);
          rows = (int)((long)((c + 1) * sub_per_chunk) * T / MOE_EP_SUBCHUNKS) - t_lo;
        }
        const int np = np_for(rows), per = (n16 + np - 1) / np, n_items = rows * np;
        const int mine = my_items(n_items);
        for (int k0 = 0; k0 < mine && ok; k0 += 32) {
          // ---- lane l works out item k0 + l ----
          if (k0 + lane < mine) {
            EmItem& e = s_tab[lane];
            int it = blockIdx.x + (k0 + lane) * nb;
            const int piece = it % np;
            e.first = piece * per;
            e.lim = min(n16, e.first + per);
            e.n = 0;
            if (push) {
              int u = it / np;
              const int s = locate(s_lo[c], s_lo[c + 1], R, me, &u);
              e.s = s;
              e.u = u;
              e.slot = s_my_slot_on[s] + (u - s_src_u_off[s]);
              fill_rows(e, u);
            } else {
              const int t = t_lo + it / np;
              e.t = t;
              int pm = -1;
#pragma unroll
              for (int d = 0; d < kMaxR; ++d) {
                const int pos = d < R ? p.op.bufs.rank_pos[(size_t)t * R + d] : -1;
                if (d < R) {
                  e.slots[d] = pos >= 0 ? (d == me ? s_src_u_off[me] + pos : s_home_slot[d] + pos) : -1;
                }
                if (d == me) pm = pos;
              }
              e.u = pm >= 0 ? s_src_u_off[me] + pm : -1;
              if (pm >= 0) fill_rows(e, e.u);
            }
          }
          __syncwarp();
          const int nbatch = min(32, mine - k0);
          for (int i = 0; i < nbatch; ++i) {
            const int st = (int)(seqn % n_st);
            const uint32_t use = seqn / n_st;
            if (use >= 1) {
              if (lane == 0) {
                ok = mbar_wait(&s_em_empty[st], (use - 1) & 1u, p.op.timeout_ns, err, me,
                               MOE_EP_CTR_BULK_COPY);
              }
              ok = __shfl_sync(0xffffffffu, ok, 0) != 0;
              if (!ok) break;
            }
            // Every lane's writes below come after lane 0's acquire of the
            // stage (a shuffle orders no memory).
            __syncwarp();
            const int* src = reinterpret_cast<const int*>(&s_tab[i]);
            int* dst = reinterpret_cast<int*>(&s_hdr[st]);
            dst[lane] = src[lane];
            if (lane + 32 < kItemWords) dst[lane + 32] = src[lane + 32];
            const int nr = s_tab[i].n, first = s_tab[i].first, lim = s_tab[i].lim;
            const uint32_t bytes = (uint32_t)(lim - first) * 16;
            __syncwarp();
            // The header's writes come before the arrival that the consumers acquire.
            if (lane == 0) mbar_expect_tx(&s_em_full[st], bytes * (uint32_t)nr);
            __syncwarp();
            if (lane < nr) {
              bulk_load(s_bulk + st * stage_bytes + lane * slot_bytes,
                        y + (size_t)s_tab[i].rows[lane] * n16 + first, bytes, &s_em_full[st]);
            }
            ++seqn;
          }
          __syncwarp();
        }
      };
      for (int c = 0; c <= C && ok; ++c) {
        if (c < C) run_phase(true, c);
        if (c >= 1 && ok) run_phase(false, c - 1);
      }
      return;
    }
    // ---- consumers: warps 1 .. kWarps - 1, every thread on every item ----
    const int ct = threadIdx.x - 32, cw = warp - 1;
    uint32_t seqn = 0;
    // The per-item weight-gradient work (piece 0): one consumer warp per
    // item, in turn (one warp for all of them held every stage up).
    auto grad_turn = [&](const EmItem& h) { return kGradW && h.first == 0 && (int)(seqn % kNC) == cw; };
    // Item seqn's stage, once its copies landed (false: one never did).
    auto take = [&](int* st) {
      *st = (int)(seqn % n_st);
      const bool ok = mbar_wait(&s_em_full[*st], (seqn / n_st) & 1u, p.op.timeout_ns, err, me,
                                MOE_EP_CTR_BULK_COPY);
      return __all_sync(0xffffffffu, ok) != 0;
    };
    auto give_back = [&](int st) {
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(&s_em_empty[st]);
      }
      ++seqn;
    };
    // f32 sum, in row order, of vector x of the stage's pieces.
    auto stage_sum = [&](int st, const EmItem& h, int x, float (&acc)[8]) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      const unsigned char* base = s_bulk + st * stage_bytes + (x - h.first) * 16;
      if (weighted) {
        for (int j = 0; j < h.n; ++j) {
          acc_v4(acc, *reinterpret_cast<const int4*>(base + j * slot_bytes), h.w[j], true);
        }
      } else {
        for (int j = 0; j < h.n; ++j) {
          acc_v4(acc, *reinterpret_cast<const int4*>(base + j * slot_bytes), 1.f, false);
        }
      }
    };
    for (int c = 0; c <= C; ++c) {
      if (c < C) {
        // ---- push chunk c ----
        const int rows = rows_of_chunk(c), np = np_for(rows), mine = my_items(rows * np);
        for (int k = 0; k < mine; ++k) {
          int st;
          if (!take(&st)) return;
          const EmItem& h = s_hdr[st];
          int4* dst = ws.stage(h.s, parity, p.op.hidden) + (size_t)h.slot * n16;
          for (int x = h.first + ct; x < h.lim; x += kNC * 32) {
            float acc[8];
            stage_sum(st, h, x, acc);
            st_na_v4(dst + x, pack_v4(acc));
          }
          if (grad_turn(h) && lane < K) {
            ws.stage_w(h.s, parity)[(size_t)h.slot * MOE_EP_MAX_TOPK + lane] = h.g[lane];
          }
          give_back(st);
        }
        // The block's last consumer warp to finish chunk c releases it to every rank.
        __syncwarp();
        if (lane == 0) {
          __threadfence_block();
          if (atomicAdd(&s_arrived[c], 1u) == kNC - 1) release_chunk(c);
        }
      }
      if (c == 0) continue;
      // ---- home sums of chunk c - 1 ----
      if (!wait_chunk(c - 1)) return;
      const int cs = c - 1;
      const int t_lo = (int)((long)(cs * sub_per_chunk) * T / MOE_EP_SUBCHUNKS);
      const int rows = (int)((long)((cs + 1) * sub_per_chunk) * T / MOE_EP_SUBCHUNKS) - t_lo;
      const int np = np_for(rows), mine = my_items(rows * np);
      for (int k = 0; k < mine; ++k) {
        int st;
        if (!take(&st)) return;
        const EmItem& h = s_hdr[st];
        int stored = 0;  // this thread's vectors of the item (done_add)
        for (int x = h.first + ct; x < h.lim; x += kNC * 32, ++stored) {
          float own[8];
          stage_sum(st, h, x, own);
          float acc[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
          for (int d = 0; d < kMaxR; ++d) {
            if (d >= R || h.slots[d] < 0) continue;
            const int4 v = d == me ? pack_v4(own) : ld_v4(stage_here + (size_t)h.slots[d] * n16 + x);
            acc_v4(acc, v, 1.f, false);
          }
          st_na_v4(out + (size_t)h.t * n16 + x, pack_v4(acc));
        }
        if (p.done != nullptr) done_add(p, s_done[warp], h.t, __reduce_add_sync(0xffffffffu, stored));
        // Weight gradients: what the header holds is read now, the loads
        // wait until the stage is given back.
        const bool g_mine = grad_turn(h);
        int g_t = 0, g_slots[kMaxR];
        float g_own = 0.f;
        if (g_mine) {
          g_t = h.t;
          g_own = lane < K ? h.g[lane] : 0.f;
#pragma unroll
          for (int d = 0; d < kMaxR; ++d) g_slots[d] = d < R ? h.slots[d] : -1;
        }
        give_back(st);
        if (g_mine && lane < K) {
          const int e = p.op.bufs.topk[(size_t)g_t * K + lane];
          float g = 0.f;
#pragma unroll
          for (int d = 0; d < kMaxR; ++d) {
            if (d >= R || e < 0 || e / El != d || g_slots[d] < 0) continue;
            g = d == me ? g_own : stage_w_here[(size_t)g_slots[d] * MOE_EP_MAX_TOPK + lane];
          }
          p.grad_w_out[(size_t)g_t * K + lane] = g;
        }
      }
      done_flush(p, s_done[warp]);
    }
    return;
  }

  // Rank-major (the expert-major kernels returned above).
  if constexpr (!kExpertMajor) {
    // Push item `it` of chunk c: piece `piece` of row u (from home s) into slot `slot` there.
    const Pieces pc = pieces_of(n16);
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
      ws.stage_w(q.s, parity)[(size_t)q.slot * MOE_EP_MAX_TOPK + lane] =
          p.grad_w_in[(size_t)q.u * K + lane];
    };
    // Sums home tokens of chunk cs, items w0, w0 + nws, ... (one warp).
    auto reduce_chunk = [&](int cs, int w0, int nws) {
      const int t_lo = (int)((long)(cs * sub_per_chunk) * T / MOE_EP_SUBCHUNKS);
      const int t_hi = (int)((long)((cs + 1) * sub_per_chunk) * T / MOE_EP_SUBCHUNKS);
      const int n_items = (t_hi - t_lo) * pc.n;
      int pos =
          (w0 < n_items && lane < R) ? p.op.bufs.rank_pos[(size_t)(t_lo + w0 / pc.n) * R + lane] : -1;
      for (int it = w0; it < n_items; it += nws) {
        const int t = t_lo + it / pc.n, piece = it % pc.n;
        const int slot =
            pos >= 0 ? (lane == me ? s_src_u_off[me] + pos : s_home_slot[lane] + pos) : -1;
        // This warp's next item: its positions now, its first vectors into L2 below.
        const int itn = it + nws;
        const int pos_next = (itn < n_items && lane < R)
                                 ? p.op.bufs.rank_pos[(size_t)(t_lo + itn / pc.n) * R + lane]
                                 : -1;
        int slots[kMaxR];
#pragma unroll
        for (int d = 0; d < kMaxR; ++d) slots[d] = __shfl_sync(0xffffffffu, slot, d < R ? d : 0);
        const int first = piece * pc.per * 32, lim = min(n16, first + pc.per * 32);
        for (int base = first; base < lim; base += 32 * kHome) {
          int4 v[kMaxR][kHome];
          if (base == first && pos_next >= 0) {
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
              row_chunks<kHome>(y, slots[d], n16, lim, base, lane, v[d]);
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
        done_add<true>(p, s_done[warp], t, lim - first);
        if (kGradW && piece == 0 && lane < K) {
          const int e = p.op.bufs.topk[(size_t)t * K + lane];
          float g = 0.f;
#pragma unroll
          for (int d = 0; d < kMaxR; ++d) {
            if (e < 0 || e / El != d || slots[d] < 0) continue;
            g = d != me ? stage_w_here[(size_t)slots[d] * MOE_EP_MAX_TOPK + lane]
                        : p.grad_w_in[(size_t)slots[d] * K + lane];
          }
          p.grad_w_out[(size_t)t * K + lane] = g;
        }
        pos = pos_next;
      }
      done_flush(p, s_done[warp]);
    };

    // Rank-major without weight gradients: pusher + summers. With them (the
    // dispatch backward) every warp moves rows and gradients, as in expert-major:
    // per-row gradient loads in the pusher's issue loop slowed it down.
    if constexpr (!kGradW) {
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
      const int gw = blockIdx.x * kWarps + warp, nw = gridDim.x * kWarps;
      for (int c = 0; c <= C; ++c) {
        // ---- push chunk c: the rows whose home tokens are in it ----
        if (c < C) {
          const int n_items = rows_of_chunk(c) * pc.n;
          PushItem q_next = gw < n_items ? push_item(c, gw, pc) : PushItem{};
          for (int it = gw; it < n_items; it += nw) {
            const PushItem q = q_next;
            if (it + nw < n_items) q_next = push_item(c, it + nw, pc);  // worked out ahead
            int4* dst = ws.stage(q.s, parity, p.op.hidden) + (size_t)q.slot * n16;
            for (int base = q.first; base < q.lim; base += 32 * kPiece) {
              int4 v[kPiece];
              row_chunks<kPiece>(y, q.u, n16, q.lim, base, lane, v);
#pragma unroll
              for (int j = 0; j < kPiece; ++j) {
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
}

MOE_EP_ENTRIES_BY_WORLD(moe_ep_combine_push_rank_major, CombineParams, combine_push, false, false)
MOE_EP_ENTRIES_BY_WORLD(moe_ep_combine_push_expert_major, CombineParams, combine_push, true, false)
MOE_EP_ENTRIES_BY_WORLD(moe_ep_dispatch_bwd_push_rank_major, CombineParams, combine_push, false, true)
MOE_EP_ENTRIES_BY_WORLD(moe_ep_dispatch_bwd_push_expert_major, CombineParams, combine_push, true,
                        true)
