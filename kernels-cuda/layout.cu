// Layout of the NVLink (intra-node) path: where every token goes. One kernel
// per index type of topk_idx (int32 / int64), moe_ep_layout_scan_i32 / _i64:
//   the scan  this rank's positions of every (token, expert) and (token,
//       rank) in its outgoing streams, and its row of the count matrix
//   the exchange, by the scan's last block to finish  the count matrix
//       through symmetric memory, every offset the data kernels need, the
//       capacity check
// (One kernel, not two: the launch between them cost more than the last
// block's arrival, 2026-12-01, BENCHMARKS.md.)
//
// (Expert-major receivers also learn, per token they get, the rows of the
// token's experts there: the dispatch writes that beside the rows.)
//
// The layout runs cold between a model's other kernels, so its code is kept
// small (error reports out of unrolled loops, the slot search rolled but
// for top-k rows of at most 8 ids in 16-byte vectors).
//
// Rust launcher: src/ops/node/layout_op.rs. Tests: tests/gpu_intranode.rs (every
// case runs the layout; host_counts against the CPU reference), and the
// bad-id and capacity tests there.
#include "intranode.cuh"

// ============================================================================
// Layout, part 1: local scan. Grid: ceil(E / kExpertsPerBlock) expert-group
// blocks, R rank blocks, then check blocks (one token per thread). Positions
// of every (token, expert) and (token, rank) in this rank's outgoing streams,
// and this rank's row of the count matrix.
// ============================================================================
constexpr int kExpertsPerBlock = MOE_EP_SCAN_EXPERTS;
__device__ __forceinline__ int expert_groups(int E) {
  return (E + kExpertsPerBlock - 1) / kExpertsPerBlock;
}
// A warp takes kRounds rounds of 32 consecutive tokens (lane = token), so a
// load instruction reads 32 neighbouring tokens' ids; one block-wide scan
// per blockDim.x * kRounds tokens.
constexpr int kRounds = 4096 / MOE_EP_SCAN_THREADS;
static_assert(kRounds >= 1 && kRounds * MOE_EP_SCAN_THREADS == 4096, "scan threads");

// Where a token's K ids fill whole 16-byte vectors (K * sizeof(Idx) a
// multiple of 16, at most kVecIds ids, topk_idx 16-byte aligned), scan_bins
// loads them with 16-byte loads issued together, the next round's before
// this round's ballots, instead of one scalar load per slot in turn (the
// scan waits on each of those loads); other rows take the scalar loop. The
// same slots either way; the unrolled search over 8 ids makes the scan
// kernels' code about 1.2x. Measured against the scalar loop everywhere on
// 2026-12-02 (commit 8fbbdb5, one H200, world 1, 4096 tokens, expert:128,
// 24 SMs): 22.08-22.85 against 25.41-26.83 us (BENCHMARKS.md; raw output
// docs/perf-log/raw/2026-12-02-layout-scan-vec-ab.txt).
// Ids held per token: top-8 in int64 (4 vectors) or int32 (2 vectors); the
// slot search over them is unrolled, so more would grow the code.
constexpr int kVecIds = 8;
template <typename Idx>
struct Vec16;  // 16 bytes of ids
// in(v, c, lo, lim, off): is id c of v in [lo, lo + lim), its offset there
// in off. 0 <= lo, lo + lim <= E < 2^31: 32-bit compares only.
template <>
struct Vec16<int> {
  using T = int4;
  MOE_EP_DEVICE static int4 none() { return make_int4(-1, -1, -1, -1); }
  MOE_EP_DEVICE static bool in(const int4& v, int c, int lo, uint32_t lim, uint32_t& off) {
    off = (uint32_t)(c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w) - (uint32_t)lo;
    return off < lim;
  }
};
template <>
struct Vec16<long long> {
  using T = longlong2;
  MOE_EP_DEVICE static longlong2 none() { return make_longlong2(-1, -1); }
  MOE_EP_DEVICE static bool in(const longlong2& v, int c, int lo, uint32_t lim, uint32_t& off) {
    const unsigned long long x = (unsigned long long)(c == 0 ? v.x : v.y);
    off = (uint32_t)x - (uint32_t)lo;
    return (uint32_t)(x >> 32) == 0u && off < lim;
  }
};

// Slot k's value v (an id less lo) into sl: byte g = k when v is in bin g.
// Called for k from K - 1 down to 0, so the lowest matching slot stays.
template <int kBins>
MOE_EP_DEVICE uint32_t take_slot(uint32_t sl, long v, int k, long width, int nbins) {
  if (v >= 0 && v < width * nbins) {
    // 0 <= v < width * nbins <= E: 32-bit arithmetic (a 64-bit
    // division is a long software routine).
    const int g = kBins == 1 ? 0 : (width == 1 ? (int)v : (int)v / (int)width);
    sl = (sl & ~(0xffu << (8 * g))) | ((uint32_t)k << (8 * g));
  }
  return sl;
}

// Positions in token order of the tokens that hit each of kBins bins: bin g
// holds the values [lo + g * width, lo + (g + 1) * width), g < nbins; a
// token's slot in bin g is its first slot k with a value there. For every
// token t and bin g, emit(t, g, k, pos): k the slot (0xff: none), pos the
// number of earlier tokens in bin g. Adds the bins' totals to running.
// Per round, ballots give each lane its place within the warp; one scan of
// the warps' totals (16-bit fields of a u64: at most blockDim.x * kRounds =
// 4096 per field per scan) places the warps.
template <int kBins, typename Idx, typename Emit>
__device__ void scan_bins(const Idx* idx, int T, int K, long lo, long width, int nbins,
                          int (&running)[kBins], Emit emit) {
  static_assert(kBins * 16 <= 64 && kBins * 8 <= 32, "fields");
  __shared__ uint64_t scratch[33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  using V = typename Vec16<Idx>::T;
  constexpr int kPer = 16 / (int)sizeof(Idx), kVec = kVecIds / kPer;
  const int nvec = K / kPer;
  const uint32_t lim = (uint32_t)(width * nbins);
  const bool vec = K * (int)sizeof(Idx) % 16 == 0 && K <= kVecIds &&
                   (reinterpret_cast<uintptr_t>(idx) & 15) == 0;
  // Token t's vectors into b (rows end on a vector: t * K * sizeof(Idx) is a
  // multiple of 16); nothing read past the row or for t >= T. Round j's
  // token is row j * 32 * nvec (vectors) from the chunk's first.
  auto load = [&](V (&b)[kVec], const V* row, int t) {
    if (t < T) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if (i < nvec) b[i] = row[i];
      }
    }
  };
  // This round's and the next round's tokens; vectors past the row stay -1.
  V buf[2][kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) buf[0][i] = buf[1][i] = Vec16<Idx>::none();
  for (int t0 = 0; t0 < T; t0 += blockDim.x * kRounds) {
    const int tw = t0 + warp * 32 * kRounds;
    uint32_t slots[kRounds];  // byte g: the token's slot in bin g (0xff: none)
    uint32_t hits[kRounds][kBins];
    uint64_t mine = 0;        // the warp's hits per bin, lane 0's copy counted
    const V* row0 = reinterpret_cast<const V*>(idx + (size_t)(tw + lane) * K);
    if (vec) load(buf[0], row0, tw + lane);
#pragma unroll
    for (int j = 0; j < kRounds; ++j) {
      const int t = tw + j * 32 + lane;
      uint32_t sl = 0xffffffffu;
      if (vec) {
        if (j + 1 < kRounds) load(buf[(j + 1) & 1], row0 + (j + 1) * 32 * nvec, t + 32);
        if (t < T) {
          // Slots past K hold -1 (never loaded), in no bin: no k < K test.
#pragma unroll
          for (int k = kVecIds - 1; k >= 0; --k) {  // first matching slot wins
            uint32_t v;
            if (Vec16<Idx>::in(buf[j & 1][k / kPer], k % kPer, (int)lo, lim, v)) {
              const int g = kBins == 1 ? 0 : (width == 1 ? (int)v : (int)(v / (uint32_t)width));
              // Byte g of sl := k (take_slot's update, one 3-input logic op).
              sl ^= (sl ^ (uint32_t)k * 0x01010101u) & (0xffu << (8 * g));
            }
          }
        }
      } else if (t < T) {
        // Kept rolled: unrolled, this loop made the scan kernel's code 182 KB
        // instead of 104 KB, and cold code (other work fills the L2 between
        // layouts) costs more than the rolled loop.
#pragma unroll 1
        for (int k = K - 1; k >= 0; --k) {  // first matching slot wins
          sl = take_slot<kBins>(sl, (long)idx[(size_t)t * K + k] - lo, k, width, nbins);
        }
      }
      slots[j] = sl;
#pragma unroll
      for (int g = 0; g < kBins; ++g) {
        hits[j][g] = __ballot_sync(0xffffffffu, ((sl >> (8 * g)) & 0xffu) != 0xffu);
        if (lane == 0) mine += (uint64_t)__popc(hits[j][g]) << (16 * g);
      }
    }
    uint64_t total;
    const uint64_t before = __shfl_sync(0xffffffffu, block_exclusive_scan(mine, scratch, &total), 0);
    int pos[kBins];
#pragma unroll
    for (int g = 0; g < kBins; ++g) pos[g] = running[g] + (int)((before >> (16 * g)) & 0xffffu);
#pragma unroll
    for (int j = 0; j < kRounds; ++j) {
      const int t = tw + j * 32 + lane;
#pragma unroll
      for (int g = 0; g < kBins; ++g) {
        if (t < T && g < nbins) {
          emit(t, g, (slots[j] >> (8 * g)) & 0xffu, pos[g] + __popc(hits[j][g] & below));
        }
        pos[g] += __popc(hits[j][g]);
      }
    }
#pragma unroll
    for (int g = 0; g < kBins; ++g) running[g] += (int)((total >> (16 * g)) & 0xffffu);
  }
}

template <typename Idx>
__device__ void layout_scan_body(const LayoutParams& p) {
  const Idx* idx = reinterpret_cast<const Idx*>(p.topk_idx);
  const int T = p.op.num_tokens, K = p.op.topk, E = p.op.num_experts, R = p.op.world;
  const int El = E / R, nG = expert_groups(E);
  const int b = blockIdx.x;
  int32_t* my_counts = p.op.bufs.info + info_offsets(R, E, El).counts + p.op.rank * count_row(R, E);

  if (b < nG) {
    // Experts [e0, e0 + ng): their (token, slot) positions, counts at [e].
    const int e0 = b * kExpertsPerBlock, ng = min(kExpertsPerBlock, E - e0);
    int running[kExpertsPerBlock] = {};
    scan_bins<kExpertsPerBlock>(idx, T, K, e0, 1, ng, running,
                                [&](int t, int, uint32_t k, int pos) {
                                  if (k != 0xffu) p.op.bufs.expert_pos[(size_t)t * K + k] = pos;
                                });
    if (threadIdx.x == 0) {
      for (int g = 0; g < ng; ++g) my_counts[e0 + g] = running[g];
    }
    return;
  }
  if (b < nG + R) {
    // Rank d: every token's position (-1: not sent), count at [E + d], and
    // the sub-chunk starts: tokens for d before token floor(j * T / SUBCHUNKS).
    const int d = b - nG;
    int running[1] = {0};
    scan_bins<1>(idx, T, K, (long)d * El, El, 1, running, [&](int t, int, uint32_t k, int pos) {
      p.op.bufs.rank_pos[(size_t)t * R + d] = k != 0xffu ? pos : -1;
      for (int j = 1; j < MOE_EP_SUBCHUNKS; ++j) {
        if ((int)((long)j * T / MOE_EP_SUBCHUNKS) == t) {
          my_counts[E + R + d * (MOE_EP_SUBCHUNKS - 1) + j - 1] = pos;
        }
      }
    });
    if (threadIdx.x == 0) {
      my_counts[E + d] = running[0];
      if (T == 0) {
        for (int j = 1; j < MOE_EP_SUBCHUNKS; ++j) {
          my_counts[E + R + d * (MOE_EP_SUBCHUNKS - 1) + j - 1] = 0;
        }
      }
    }
    return;
  }

  // Check blocks (the rest of the grid): normalise to int32, mask what the
  // scans did not count. One token per thread, its K ids in registers.
  // The arena is not zeroed: these blocks also zero the info words the
  // exchange writes (all but this rank's count row, which the scan blocks
  // write), so a handle whose exchange stopped early reads zeros, and each
  // writes its own bad-entry word.
  const int nchk = gridDim.x - (nG + R), cb = b - (nG + R);
  const InfoOffsets o = info_offsets(R, E, El);
  const int n = count_row(R, E), me = p.op.rank;
  for (int i = cb * blockDim.x + threadIdx.x; i < o.bad; i += nchk * blockDim.x) {
    if (i < me * n || i >= (me + 1) * n) p.op.bufs.info[i] = 0;
  }
  __shared__ unsigned long long s_bad;
  if (threadIdx.x == 0) s_bad = 0ull;
  __syncthreads();
  for (int t = cb * blockDim.x + threadIdx.x; t < T; t += nchk * blockDim.x) {
    long v[MOE_EP_MAX_TOPK];
#pragma unroll
    for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) v[k] = k < K ? (long)idx[(size_t)t * K + k] : -1;
    // The token's first bad entry is reported once, after the loop (one
    // inlined report instead of one per unrolled comparison).
    int bad_code = 0, bad_k = 0;
#pragma unroll
    for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
      if (k >= K) break;
      int norm = (int)v[k];
      int code = 0;
      if (v[k] < -1 || v[k] >= E) {
        code = MOE_EP_ERR_BAD_EXPERT;
      } else if (v[k] >= 0) {
#pragma unroll
        for (int k2 = 0; k2 < k; ++k2) {
          if (v[k2] == v[k]) code = MOE_EP_ERR_DUP_EXPERT;
        }
      }
      if (code != 0) {
        norm = -1;
        if (bad_code == 0) bad_code = code, bad_k = k;
      }
      p.op.bufs.topk[(size_t)t * K + k] = norm;
      if (norm < 0) p.op.bufs.expert_pos[(size_t)t * K + k] = -1;
    }
    if (bad_code != 0) {
      long bad_v = v[0];
#pragma unroll
      for (int k = 1; k < MOE_EP_MAX_TOPK; ++k) {
        if (k == bad_k) bad_v = v[k];
      }
      // Not reported here: the exchange sends it to every rank, and every
      // rank reports it (the lowest bad token of the lowest such rank).
      atomicMax(&s_bad, bad_entry_word(t, bad_k, bad_code, bad_v));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    reinterpret_cast<unsigned long long*>(p.op.bufs.info + o.bad)[cb] = s_bad;
  }
}

__device__ void layout_exchange_body(const LayoutParams& p);
// The scan's part of block blockIdx.x, then the exchange by the last block
// to finish: each block's thread 0 counts it in (Ws::layout_arrivals) after
// the block's writes; the one that counts gridDim.x resets the counter for
// the next layout and runs the exchange. One entry point per index type of
// topk_idx.
template <typename Idx>
__device__ void layout_scan_then_exchange(const LayoutParams& p) {
  layout_scan_body<Idx>(p);
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long* arrived = ws_of(p.op).layout_arrivals(p.op.rank);
    __threadfence();  // this block's writes (ordered by the barrier) before its arrival
    const bool last = atomicAdd(arrived, 1ull) == (unsigned long long)gridDim.x - 1ull;
    if (last) *arrived = 0ull;  // every block has arrived: ready for the next layout
    __threadfence();
    s_last = last;
  }
  __syncthreads();
  if (s_last) layout_exchange_body(p);
}
extern "C" __global__ void __launch_bounds__(MOE_EP_SCAN_THREADS)
    moe_ep_layout_scan_i32(const __grid_constant__ LayoutParams p) {
  layout_scan_then_exchange<int>(p);
}
extern "C" __global__ void __launch_bounds__(MOE_EP_SCAN_THREADS)
    moe_ep_layout_scan_i64(const __grid_constant__ LayoutParams p) {
  layout_scan_then_exchange<long long>(p);
}

// ============================================================================
// The drop policy (LayoutParams::drop), in the exchange, on the gathered
// matrix (the same on every rank, so every rank drops the same rows): where
// rank d would receive more rows than recv_capacity, it keeps what fits.
//   rank-major: the sources share the capacity by water-filling: the
//     largest q with sum_s min(N(s, d), q) <= cap, then one more row for
//     each source with more, lowest rank first, while rows are left; source
//     s keeps its first k_s tokens for d, in token order, and drops the rest;
//   expert-major: d's experts share it the same way in whole blocks of the
//     alignment (the largest q, a multiple of it, with
//     sum_j min(align(c_j), q) <= cap, then one more block for each expert
//     with more, lowest expert first, while a block is left); expert e keeps
//     its first k_e rows in (source rank, token) order.
// The kept counts replace the matrix's in info (the offsets and rows_needed
// then follow them, and the rank-major sub-chunk starts are clipped to
// them); dropped[d] is the rows d did not take. One thread per rank d.
// (Rank-major: the expert counts C(s, e) stay those before the drop, the
// receivers cannot see which tokens a source dropped.)
// ============================================================================
__device__ void drop_over_capacity(const LayoutParams& p, int32_t* info, const InfoOffsets& o) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, n = count_row(R, E);
  const int d = threadIdx.x;
  if (d >= R) return;
  int32_t* C = info + o.counts;
  const long cap = p.op.recv_capacity;
  long dropped = 0;
  if (p.op.layout != LayoutKind::ExpertMajor) {
    long need = 0;
    int most = 0;
    for (int s = 0; s < R; ++s) {
      need += C[s * n + E + d];
      most = max(most, C[s * n + E + d]);
    }
    if (need > cap) {
      auto kept = [&](int q) {
        long f = 0;
        for (int s = 0; s < R; ++s) f += min(C[s * n + E + d], q);
        return f;
      };
      int lo = 0, hi = most;  // kept(lo) <= cap < kept(hi + 1)
      while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (kept(mid) <= cap) lo = mid; else hi = mid - 1;
      }
      long left = cap - kept(lo);
      for (int s = 0; s < R; ++s) {
        int32_t* row = C + s * n;
        int keep = min(row[E + d], lo);
        if (row[E + d] > lo && left > 0) ++keep, --left;
        row[E + d] = keep;
        for (int j = 1; j < MOE_EP_SUBCHUNKS; ++j) {
          int32_t& start = row[E + R + d * (MOE_EP_SUBCHUNKS - 1) + j - 1];
          start = min(start, keep);
        }
      }
      dropped = need - cap;
    }
  } else {
    const int align = p.op.alignment > 0 ? p.op.alignment : 1;
    auto total = [&](int j) {
      long c = 0;
      for (int s = 0; s < R; ++s) c += C[s * n + d * El + j];
      return c;
    };
    long need = 0, most = 0;  // rows; blocks
    for (int j = 0; j < El; ++j) {
      const long b = (total(j) + align - 1) / align;
      need += b * align;
      most = max(most, b);
    }
    if (need > cap) {
      auto kept = [&](long m) {  // rows of blocks when no expert keeps more than m
        long f = 0;
        for (int j = 0; j < El; ++j) f += min((total(j) + align - 1) / align, m) * align;
        return f;
      };
      long lo = 0, hi = most;
      while (lo < hi) {
        const long mid = lo + (hi - lo + 1) / 2;
        if (kept(mid) <= cap) lo = mid; else hi = mid - 1;
      }
      long left = (cap - kept(lo)) / align;  // whole blocks left
      for (int j = 0; j < El; ++j) {
        const long c = total(j), b = (c + align - 1) / align;
        long keep_b = min(b, lo);
        if (b > lo && left > 0) ++keep_b, --left;
        const long k = min(c, keep_b * align);
        long before = 0;
        for (int s = 0; s < R; ++s) {
          int32_t& cs = C[s * n + d * El + j];
          const long keep_s = max(0l, min((long)cs, k - before));
          before += cs;
          cs = (int32_t)keep_s;
        }
        dropped += c - k;
      }
    }
  }
  info[o.dropped + d] = (int32_t)dropped;
}

// This rank's tokens of a dropped row marked, after drop_over_capacity:
// the slots of a dropped (token, expert) row (expert-major), or of a token
// dropped at rank d (rank-major: every slot of an expert of d, and the
// token's position for d), get topk -1 and expert_pos -2, so that dispatch,
// combine and the backward passes skip them (the combine of a dropped row
// adds nothing), and the handle reports them. Block-wide.
__device__ void mark_dropped(const LayoutParams& p, const int32_t* info, const InfoOffsets& o) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, n = count_row(R, E);
  const int T = p.op.num_tokens, K = p.op.topk, me = p.op.rank;
  const int32_t* mine = info + o.counts + me * n;  // my kept counts
  int32_t* topk = p.op.bufs.topk;
  int32_t* epos = p.op.bufs.expert_pos;
  if (p.op.layout == LayoutKind::ExpertMajor) {
    for (int i = threadIdx.x; i < T * K; i += blockDim.x) {
      const int e = topk[i];
      if (e >= 0 && epos[i] >= mine[e]) {
        topk[i] = -1;
        epos[i] = -2;
      }
    }
  } else {
    int32_t* rpos = p.op.bufs.rank_pos;
    for (int i = threadIdx.x; i < T * R; i += blockDim.x) {
      const int t = i / R, d = i % R;
      const int pos = rpos[i];
      if (pos < 0 || pos < mine[E + d]) continue;
      rpos[i] = -1;
      // Slots of d's experts: no other thread writes them (theirs are of
      // other ranks' experts; a slot it clears reads -1 or another rank).
      for (int k = 0; k < K; ++k) {
        const int e = topk[(size_t)t * K + k];
        if (e >= 0 && e / El == d) {
          topk[(size_t)t * K + k] = -1;
          epos[(size_t)t * K + k] = -2;
        }
      }
    }
  }
}

// ============================================================================
// Layout, part 2: exchange (one block: the scan's last to finish). Sends
// this rank's count row to every rank, waits for all rows, derives every offset the data kernels need, and
// checks every rank's receive capacity (all ranks see the same matrix, so all
// skip the data movement together when one would overflow).
// ============================================================================
__device__ void layout_exchange_body(const LayoutParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, n = count_row(R, E), me = p.op.rank;
  const Ws ws = ws_of(p.op);
  const InfoOffsets o = info_offsets(R, E, El);
  int32_t* info = p.op.bufs.info;
  // The call, counted for every block of the group's grid (this kernel's
  // is larger; the data kernels read their block's count).
  const uint64_t seq = next_call_all(ws, me, p.op.num_blocks);
  if (ws.stopped(me)) {  // an earlier error: nothing runs until cleared; every peer is told
    publish_stopped(ws, seq, me);
    return;
  }
  next_seq(ws, 0, me, 0);  // this rank's layout calls (MOE_EP_DEBUG_PEERS)
  const int parity = (int)(seq & 1);
  // The layout's descriptor: the op alone (topk, layout and alignment travel
  // in the count rows' tails).
  const uint64_t mine[MOE_EP_DESC_WORDS] = {MOE_EP_OP_LAYOUT, 0, 0, 0, 0, 0, 0};
  const Call call = call_of(p.op, mine, seq);
  const ErrSink& err = call.err;
  publish_words(ws, seq, mine, me);

  // Phase 1: my row (its tail: what the receivers check) to every rank,
  // then one release flag each. The tail's bad entry: the highest word of
  // the scan's check blocks (bad_entry_word: the lowest bad token).
  int32_t* row = info + o.counts + me * n;
  __shared__ unsigned long long s_bad;
  if (threadIdx.x == 0) s_bad = 0ull;
  __syncthreads();
  const int nchk = layout_check_blocks(p.op.num_tokens);
  for (int i = threadIdx.x; i < nchk; i += blockDim.x) {
    atomicMax(&s_bad, __ldcg(reinterpret_cast<const unsigned long long*>(info + o.bad) + i));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long bad = s_bad;
    int32_t* tail = row + row_tail(R, E);
    tail[0] = (int32_t)(uint32_t)(bad >> 32);
    tail[1] = (int32_t)(uint32_t)bad;
    tail[2] = p.op.topk;
    tail[3] = (int32_t)p.op.layout;
    tail[4] = p.op.alignment;
    tail[5] = tail[6] = tail[7] = 0;
  }
  __syncthreads();
  const int faulty = p.count_fault != 0 ? (p.count_fault >> 16) - 1 : -1;  // fault tests only
  for (int d = 0; d < R; ++d) {
    int32_t* dst = ws.counts(d, parity) + me * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int32_t v = i == faulty ? (int32_t)(int16_t)(p.count_fault & 0xffff) : __ldcg(row + i);
      st_relaxed_sys_s32(dst + i, v);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int d = 0; d < R; ++d) st_release_sys_u64(ws.count_flag(d) + me, seq);
  }
  // Phase 2: wait for every row.
  bool ok = true;
  if (threadIdx.x < R) {
    ok = wait_peer(call, ws.count_flag(me) + threadIdx.x, seq, threadIdx.x, MOE_EP_CTR_LAYOUT_COUNTS);
  }
  if (!__syncthreads_and(ok)) return;
  // The rows, each count checked against what a rank can send (its
  // max_tokens_per_rank, stage_rows / R): a row out of range (memory a
  // peer did not write as it should) stops every rank below, before any
  // offset is derived from it. Tails are checked in phase 4.
  __shared__ int s_bad_at;   // the first (rank, word) out of range, or INT_MAX
  __shared__ int s_bad_sub;  // the first sub-chunk start out of order, or INT_MAX
  if (threadIdx.x == 0) s_bad_at = s_bad_sub = 0x7fffffff;
  __syncthreads();
  const int32_t max_count = (int32_t)(p.op.w.stage_rows / (uint64_t)R);
  const int32_t* all = ws.counts(me, parity);
  for (int i = threadIdx.x; i < R * n; i += blockDim.x) {
    const int32_t v = ld_relaxed_sys_s32(all + i);
    info[o.counts + i] = v;
    if (i % n < row_tail(R, E) && (v < 0 || v > max_count)) atomicMin(&s_bad_at, i);
  }
  __syncthreads();
  // Each rank's sub-chunk starts for each receiver (where combine's chunks
  // of its rows begin) rise and stay within its rows for that receiver.
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
    const int s = i / R, d = i % R;
    const int32_t* row = info + o.counts + s * n;
    const int at = E + R + d * (MOE_EP_SUBCHUNKS - 1);
    int32_t prev = 0;
    for (int j = 0; j < MOE_EP_SUBCHUNKS - 1; ++j) {
      const int32_t v = row[at + j];
      if (v < prev || v > row[E + d]) {
        atomicMin(&s_bad_sub, s * n + at + j);
        break;
      }
      prev = v;
    }
  }
  __syncthreads();
  // A matrix out of range is reported below (its first bad word, and for a
  // start the rows it splits, kept for that) and zeroed here, so that no
  // offset is derived from it: the data kernels skip the call, and the
  // host reads zeros, not sums of it.
  const bool bad_matrix = s_bad_at != 0x7fffffff || s_bad_sub != 0x7fffffff;
  __shared__ int32_t s_bad_val, s_bad_rows;
  if (bad_matrix) {
    if (threadIdx.x == 0) {
      const int at = s_bad_at != 0x7fffffff ? s_bad_at : s_bad_sub;
      s_bad_val = info[o.counts + at];
      const int s = at / n, d = (at % n - E - R) / (MOE_EP_SUBCHUNKS - 1);
      s_bad_rows = s_bad_at == 0x7fffffff ? info[o.counts + s * n + E + d] : 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < R * n; i += blockDim.x) {
      if (i % n < row_tail(R, E)) info[o.counts + i] = 0;
    }
    __syncthreads();
  }
  // The drop policy clips the matrix before any offset is derived from it.
  const bool drop = p.drop != 0 && !bad_matrix;
  if (drop) drop_over_capacity(p, info, o);
  __syncthreads();

  // Phase 3: offsets. C(s, e) expert counts, N(s, d) rank counts.
  const int32_t* C = info + o.counts;
  auto N = [&](int s, int d) { return C[s * n + E + d]; };
  extern __shared__ int32_t smem[];  // [E] expert totals, then [E] padded block starts
  int32_t* tot = smem;
  int32_t* start = smem + E;
  const bool expert_major = p.op.layout == LayoutKind::ExpertMajor;
  const int align = p.op.alignment > 0 ? p.op.alignment : 1;
  // Every expert's padded block start within its rank d = e / El: one
  // block-wide exclusive scan over all E padded totals (tiles of
  // blockDim.x), then each rank's segment rebased to 0.
  __shared__ int32_t s_scan[33];
  __shared__ int32_t s_seg[MOE_EP_MAX_RANKS + 1];  // scan value at e = d * El; [R]: the sum
  int carry = 0;
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    int padded = 0;
    if (e < E) {
      int s_sum = 0;
      for (int s = 0; s < R; ++s) s_sum += C[s * n + e];
      tot[e] = s_sum;
      padded = (s_sum + align - 1) / align * align;
    }
    int tile;
    const int ex = block_exclusive_scan(padded, s_scan, &tile);
    if (e < E) start[e] = carry + ex;
    carry += tile;
  }
  __syncthreads();
  if (threadIdx.x < R) s_seg[threadIdx.x] = start[threadIdx.x * El];
  if (threadIdx.x == 0) s_seg[R] = carry;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) start[e] -= s_seg[e / El];
  __syncthreads();
  if (threadIdx.x < R) {
    const int d = threadIdx.x;
    const int acc = s_seg[d + 1] - s_seg[d];  // rank d's padded expert-major rows
    int rows = 0, before_me = 0;
    for (int s = 0; s < R; ++s) {
      if (s < me) before_me += N(s, d);
      rows += N(s, d);
    }
    info[o.dst_u_off + d] = before_me;
    info[o.rows_needed + d] = expert_major ? acc : rows;
    if (d == me) info[o.expert_start + El] = acc;
    int slot = 0;
    for (int d2 = 0; d2 < me; ++d2) slot += N(d, d2);
    info[o.my_slot_on + d] = slot;
  }
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      info[o.src_u_off + s] = acc;
      acc += N(s, me);
    }
    info[o.src_u_off + R] = acc;
    acc = 0;
    for (int d = 0; d < R; ++d) {
      info[o.home_slot + d] = acc;
      acc += N(me, d);
    }
    info[o.home_slot + R] = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int before_me = 0;
    for (int s = 0; s < me; ++s) before_me += C[s * n + e];
    info[o.erow_base + e] = start[e] + before_me;
  }
  for (int j = threadIdx.x; j < El; j += blockDim.x) {
    info[o.expert_start + j] = start[me * El + j];
    info[o.expert_count + j] = tot[me * El + j];
  }
  __syncthreads();
  if (drop) {
    __shared__ int s_any;
    if (threadIdx.x == 0) {
      s_any = 0;
      for (int d = 0; d < R; ++d) s_any |= info[o.dropped + d] != 0;
    }
    __syncthreads();
    if (s_any) mark_dropped(p, info, o);
    __syncthreads();
  }
  // Phase 4: the verdict, from the gathered rows alone (the same on every
  // rank): ranks that disagree, then the lowest rank's bad routing, then
  // capacity. Any of them stops every rank's kernels from here on.
  if (threadIdx.x == 0) {
    int code = 0;
    if (s_bad_at != 0x7fffffff) {
      code = MOE_EP_ERR_BAD_PEER_DATA;
      report_error(err, code, me, s_bad_at / n, MOE_EP_FIELD_COUNTS, (uint64_t)max_count + 1,
                   (uint64_t)(int64_t)s_bad_val, (uint64_t)(s_bad_at % n), 0);
    } else if (s_bad_sub != 0x7fffffff) {
      code = MOE_EP_ERR_BAD_PEER_DATA;
      report_error(err, code, me, s_bad_sub / n, MOE_EP_FIELD_SUBCHUNK_STARTS,
                   (uint64_t)s_bad_rows, (uint64_t)(int64_t)s_bad_val, (uint64_t)(s_bad_sub % n),
                   0);
    }
    for (int s = 0; s < R && code == 0; ++s) {
      const int32_t* tail = C + s * n + row_tail(R, E);
      const int32_t mine[3] = {p.op.topk, (int32_t)p.op.layout, p.op.alignment};
      for (int f = 0; f < 3 && code == 0; ++f) {
        if (tail[2 + f] != mine[f]) {
          code = MOE_EP_ERR_MISMATCH;
          report_error(err, code, me, s, MOE_EP_FIELD_TOPK + f, (uint64_t)(int64_t)mine[f],
                       (uint64_t)(int64_t)tail[2 + f], 0, 0);
        }
      }
    }
    for (int s = 0; s < R && code == 0; ++s) {
      const int32_t* tail = C + s * n + row_tail(R, E);
      const unsigned long long w =
          ((unsigned long long)(uint32_t)tail[0] << 32) | (unsigned long long)(uint32_t)tail[1];
      if (w != 0ull) code = report_bad_entry(err, me, s, w, E);
    }
    for (int d = 0; d < R && code == 0; ++d) {
      const int need = info[o.rows_needed + d];
      if (need > p.op.recv_capacity) {
        code = MOE_EP_ERR_CAPACITY;
        report_error(err, code, me, d, 0, 0, 0, need, p.op.recv_capacity);
      }
    }
    if (code != 0) *ws.status(me) = (unsigned long long)code;
  }
}

// ============================================================================
// A call this rank's host refused (a bad argument on this rank only, or an
// earlier error): the call counted, and its descriptor, word 0
// MOE_EP_OP_REFUSED with the op and the argument (MOE_EP_OP_STOPPED when
// this rank's kernels are stopped), to every peer, whose waits for this rank
// then stop at once naming both (intranode.cuh). One block. Launcher:
// NodeGroup::op (src/ops/node/turn.rs).
// ============================================================================
extern "C" __global__ void __launch_bounds__(MOE_EP_SCAN_THREADS)
    moe_ep_publish_refusal(const __grid_constant__ RefusalParams p) {
  const Ws ws = ws_of(p.op);
  const uint64_t call = next_call_all(ws, p.op.rank, p.op.num_blocks);
  if (ws.stopped(p.op.rank)) {
    publish_stopped(ws, call, p.op.rank);
  } else {
    publish_words(ws, call, p.desc, p.op.rank);
  }
}
