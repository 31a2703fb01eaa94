// NVLink (intra-node) path, high-throughput mode: layout, dispatch, combine.
//
// Every rank's receive buffers are sized for the worst case, so once the
// count matrix is exchanged (layout), each sender knows the final row of each
// of its tokens on every receiver and stores it there directly (zero copy);
// the receiver waits for one completion flag per (source rank, source block).
// Combine mirrors it: partial rows (the local experts of a token reduced in
// f32) are pushed to the token's home rank, which sums them in rank order,
// pipelined over chunks of the home ranks' tokens (rank-major: one warp per
// block pushes with bulk (TMA) copies while the others sum). Rank-major with
// the expert outputs in symmetric memory, the home instead reads every
// rank's partial where it lies and sums in one pass (combine_pull).
//
// Tuning switches below and in abi.cuh / common.cuh (MOE_EP_PREFETCH,
// MOE_EP_BULK_VECS) are compile-time: build with
// MOE_EP_KERNEL_DEFINES="NAME=VALUE ..." to compare variants with ep-bench.
// MOE_EP_PUSH_PROBE=1 adds timing probes to combine's pusher (below).
// Measured on 2 x H200 (BENCHMARKS.md): whole-row dispatch items beat
// pieces, registers in flight per warp (MOE_EP_PIECE 4..8, MOE_EP_HOME_VECS
// 4..8) made no difference, bulk copies of 16 KiB beat 8 KiB and 4 KiB.
//
// Rust launchers: src/ops/launch.rs. Tests: tests/gpu_intranode.rs.
#include <cuda_bf16.h>

#include "abi.cuh"
#include "common.cuh"

namespace {

constexpr int kWarps = MOE_EP_THREADS / 32;
constexpr int kUnroll = 8;  // 16-byte vectors in flight per lane per row chunk

// Tuning switches (see the top of the file):
#ifndef MOE_EP_DISPATCH_SPLIT_ROWS
#define MOE_EP_DISPATCH_SPLIT_ROWS 0  // 1: dispatch items are row pieces (0: whole rows)
#endif
#ifndef MOE_EP_PIECE
#define MOE_EP_PIECE 8  // 16-byte vectors per lane per piece (registers in flight)
#endif
#ifndef MOE_EP_HOME_VECS
#define MOE_EP_HOME_VECS 4  // vectors per lane per rank the 2-rank home sum loads at once
#endif
#ifndef MOE_EP_PULL_VECS
#define MOE_EP_PULL_VECS 8  // combine (pull): vectors per lane per rank loaded at once
#endif

// MOE_EP_PUSH_PROBE=1 (timing only): cycles the combine pusher of block 0
// spends between its probe points, printed once per call.
#ifndef MOE_EP_PUSH_PROBE
#define MOE_EP_PUSH_PROBE 0
#endif
#if MOE_EP_PUSH_PROBE
#define PROBE_INIT()                    \
  long long pr_t[10] = {}, pr_last = clock64(), pr_start = pr_last
#define PROBE(i)                        \
  do {                                  \
    const long long pr_now = clock64(); \
    pr_t[i] += pr_now - pr_last;        \
    pr_last = pr_now;                   \
  } while (0)
#define PROBE_REPORT(n)                                                                     \
  if (blockIdx.x == 0)                                                                      \
  printf("pusher n %d total %lld | 0 %lld 1 %lld 2 %lld 3 %lld 4 %lld 5 %lld 6 %lld 7 %lld " \
         "8 %lld 9 %lld\n",                                                                 \
         (n), clock64() - pr_start, pr_t[0], pr_t[1], pr_t[2], pr_t[3], pr_t[4], pr_t[5],   \
         pr_t[6], pr_t[7], pr_t[8], pr_t[9])
#else
#define PROBE_INIT()
#define PROBE(i)
#define PROBE_REPORT(n)
#endif

// Work items of dispatch and combine are (row, piece): a piece is up to
// kPiece 16-byte vectors per lane, every piece of a row the same size.
constexpr int kPiece = MOE_EP_PIECE;

// A row of n16 vectors cut into `n` pieces of `per` (<= max_per) vectors
// per lane.
struct Pieces {
  int n, per;
};
__device__ __forceinline__ Pieces pieces_of(int n16, int max_per = kPiece) {
  Pieces pc;
  pc.n = (n16 + 32 * max_per - 1) / (32 * max_per);
  pc.per = (n16 + 32 * pc.n - 1) / (32 * pc.n);
  return pc;
}

// Workspace regions as mapped here for rank `r`.
struct Ws {
  const Workspace& w;
  char* const* base;
  int R, E;
  __device__ int32_t* counts(int r, int parity) const {
    return reinterpret_cast<int32_t*>(base[r] + w.counts_off) + parity * R * count_row(R, E);
  }
  __device__ uint64_t* count_flag(int r) const {
    return reinterpret_cast<uint64_t*>(base[r] + w.count_flag_off);
  }
  __device__ uint64_t* dispatch_done(int r) const {
    return reinterpret_cast<uint64_t*>(base[r] + w.dispatch_done_off);
  }
  __device__ uint64_t* combine_done(int r) const {
    return reinterpret_cast<uint64_t*>(base[r] + w.combine_done_off);
  }
  __device__ uint64_t* pull_flag(int r) const {
    return reinterpret_cast<uint64_t*>(base[r] + w.pull_flag_off);
  }
  __device__ int4* stage(int r, int parity, int hidden) const {
    return reinterpret_cast<int4*>(base[r] + w.stage_off) +
           (size_t)parity * w.stage_rows * (hidden / 8);
  }
  __device__ float* stage_w(int r, int parity) const {
    return reinterpret_cast<float*>(base[r] + w.stage_w_off) +
           (size_t)parity * w.stage_rows * MOE_EP_MAX_TOPK;
  }
  // Local sequence counters: [0] layout, [1] dispatch, [2] combine; one per
  // block. [3][0] is the error claim word (see ErrSink), [3][1..4] the
  // item counters (claims).
  __device__ uint64_t* seq(int which, int me) const {
    return reinterpret_cast<uint64_t*>(base[me] + w.seq_off) + which * MOE_EP_MAX_BLOCKS;
  }
  __device__ ErrSink err(ErrorInfo* host, int me) const {
    return ErrSink{host, reinterpret_cast<unsigned long long*>(seq(3, me))};
  }
  // Work-item counters of op `which` (1 dispatch, 2 combine): [3][1..4],
  // two per op, alternating with the op's sequence number (see ItemClaims).
  __device__ unsigned long long* claims(int which, int me, uint64_t call) const {
    return reinterpret_cast<unsigned long long*>(seq(3, me)) + 1 + 2 * (which - 1) + (call & 1);
  }
};

// Work items handed to warps one at a time from a counter, so a warp that
// finishes early takes the next item and no SM is left with a tail. (On
// 2 x H200 this moved dispatch at 20-32 SMs from 204-225 to 182-185 µs:
// fixed strides left the slowest warps the last items; BENCHMARKS.md. The
// pulled combine claims only in the dispatch backward: see combine_pull.)
// Op call `seq` counts on claims(which, me, seq); next_seq clears the
// other counter for call seq + 1 in every call of the op, whichever path it
// takes (call seq - 1, its last user, has finished: one stream).
struct ItemClaims {
  unsigned long long* ctr;
  __device__ ItemClaims(const Ws& ws, int which, int me, uint64_t seq)
      : ctr(ws.claims(which, me, seq)) {}
  // The warp's next item (warp-uniform; every lane calls).
  __device__ int next(int lane) const {
    int v = 0;
    if (lane == 0) v = (int)atomicAdd(ctr, 1ull);
    return __shfl_sync(0xffffffffu, v, 0);
  }
};

// Bumps this block's sequence counter for op `which` (0 layout, 1 dispatch,
// 2 combine) and returns the new value; block 0 clears the op's item counter
// for the next call (ItemClaims).
// NOTE: every rank launches the same number of blocks per op, so all the
// counters of all ranks move in lockstep and one block's value is everyone's.
__device__ uint64_t next_seq(const Ws& ws, int which, int me) {
  __shared__ uint64_t s_seq;
  if (threadIdx.x == 0) {
    uint64_t* seq_local = ws.seq(which, me);
    s_seq = seq_local[blockIdx.x] + 1;
    seq_local[blockIdx.x] = s_seq;
    if (which > 0 && blockIdx.x == 0) *ws.claims(which, me, s_seq + 1) = 0ull;
  }
  __syncthreads();
  return s_seq;
}

// Signals every rank that this block's stores are done, then waits until
// every (rank, block) has signalled this op. Returns false on timeout/error.
__device__ bool signal_and_wait(uint64_t* (*flags_of)(const Ws&, int), const Ws& ws, int rank,
                                int world, int num_blocks, uint64_t seq, uint64_t timeout_ns,
                                const ErrSink& err, int counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int d = 0; d < world; ++d) {
      st_release_sys_u64(flags_of(ws, d) + rank * MOE_EP_MAX_BLOCKS + blockIdx.x, seq);
    }
  }
  bool ok = true;
  const uint64_t* mine = flags_of(ws, rank);
  for (int i = threadIdx.x; i < world * num_blocks; i += blockDim.x) {
    const int s = i / num_blocks, b = i % num_blocks;
    ok &= wait_at_least(mine + s * MOE_EP_MAX_BLOCKS + b, seq, timeout_ns, err, rank, s, counter);
  }
  return __syncthreads_and(ok) != 0;
}
__device__ uint64_t* dispatch_flags(const Ws& ws, int r) { return ws.dispatch_done(r); }

// ---- bf16 <-> f32 on 16-byte vectors of 8 values ----
__device__ __forceinline__ void acc_v4(float (&acc)[8], int4 v, float w, bool weighted) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    if (weighted) {
      acc[2 * i] = __fmaf_rn(w, f.x, acc[2 * i]);
      acc[2 * i + 1] = __fmaf_rn(w, f.y, acc[2 * i + 1]);
    } else {
      acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
      acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
    }
  }
}
__device__ __forceinline__ int4 pack_v4(const float (&acc)[8]) {
  int4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return v;
}
__device__ __forceinline__ int4 scale_v4(int4 v, float w) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = __fmul_rn(w, f.x);
    acc[2 * i + 1] = __fmul_rn(w, f.y);
  }
  return pack_v4(acc);
}

// Copies vectors [first, lim) of a row, `per` (<= kPiece) per lane per
// pass, from local `src` to every rank in `dmask` (row pointer dst[r]) and,
// with kLocal, to the rows lrow[k] of `local` for k in `lmask` (scaled by
// lw[k] when `scaled`). One warp; the piece is read once.
template <bool kLocal>
__device__ __forceinline__ void copy_piece(const int4* src, int4* const (&dst)[MOE_EP_MAX_RANKS],
                                           unsigned dmask, int4* local, unsigned lmask,
                                           const int (&lrow)[MOE_EP_MAX_TOPK],
                                           const float (&lw)[MOE_EP_MAX_TOPK], bool scaled,
                                           int n16, int first, int lim, int per, int lane) {
  for (int base = first; base < lim; base += 32 * per) {
    int4 v[kPiece];
#pragma unroll
    for (int i = 0; i < kPiece; ++i) {
      const int idx = base + i * 32 + lane;
      if (i < per && idx < lim) v[i] = ld_nc_v4(src + idx);
    }
#pragma unroll
    for (int r = 0; r < MOE_EP_MAX_RANKS; ++r) {
      if (!((dmask >> r) & 1u)) continue;
#pragma unroll
      for (int i = 0; i < kPiece; ++i) {
        const int idx = base + i * 32 + lane;
        if (i < per && idx < lim) st_na_v4(dst[r] + idx, v[i]);
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
          if (i < per && idx < lim) st_na_v4(row + idx, scaled ? scale_v4(v[i], lw[k]) : v[i]);
        }
      }
    }
  }
}

// The `i`-th smallest of the valid (>= 0) values held by lanes < n; -1 if none.
__device__ __forceinline__ int nth_smallest(int v, int i, int lane) {
  const bool valid = v >= 0;
  int below = 0;
  for (int j = 0; j < 32; ++j) {
    const int o = __shfl_sync(0xffffffffu, v, j);
    below += (o >= 0 && valid && (o < v)) ? 1 : 0;
  }
  const unsigned who = __ballot_sync(0xffffffffu, valid && below == i);
  return who ? __shfl_sync(0xffffffffu, v, __ffs(who) - 1) : -1;
}

}  // namespace

// ============================================================================
// Layout, kernel 1: local scan. Grid: ceil(E / kExpertsPerBlock) expert-group
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
constexpr int kRounds = 8;

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
  for (int t0 = 0; t0 < T; t0 += blockDim.x * kRounds) {
    const int tw = t0 + warp * 32 * kRounds;
    uint32_t slots[kRounds];  // byte g: the token's slot in bin g (0xff: none)
    uint32_t hits[kRounds][kBins];
    uint64_t mine = 0;        // the warp's hits per bin, lane 0's copy counted
#pragma unroll
    for (int j = 0; j < kRounds; ++j) {
      const int t = tw + j * 32 + lane;
      uint32_t sl = 0xffffffffu;
      if (t < T) {
        // Kept rolled: unrolled, this loop made the scan kernel's code 182 KB
        // instead of 104 KB, and cold code (other work fills the L2 between
        // layouts) costs more than the rolled loop.
#pragma unroll 1
        for (int k = K - 1; k >= 0; --k) {  // first matching slot wins
          const long v = (long)idx[(size_t)t * K + k] - lo;
          if (v >= 0 && v < width * nbins) {
            // 0 <= v < width * nbins <= E: 32-bit arithmetic (a 64-bit
            // division is a long software routine).
            const int g = kBins == 1 ? 0 : (width == 1 ? (int)v : (int)v / (int)width);
            sl = (sl & ~(0xffu << (8 * g))) | ((uint32_t)k << (8 * g));
          }
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
  const int T = p.num_tokens, K = p.topk, E = p.num_experts, R = p.world;
  const int El = E / R, nG = expert_groups(E);
  const int b = blockIdx.x;
  int32_t* my_counts = p.bufs.info + info_offsets(R, E, El).counts + p.rank * count_row(R, E);
  const ErrSink err = Ws{p.w, p.ws, R, E}.err(p.error, p.rank);

  if (b < nG) {
    // Experts [e0, e0 + ng): their (token, slot) positions, counts at [e].
    const int e0 = b * kExpertsPerBlock, ng = min(kExpertsPerBlock, E - e0);
    int running[kExpertsPerBlock] = {};
    scan_bins<kExpertsPerBlock>(idx, T, K, e0, 1, ng, running,
                                [&](int t, int, uint32_t k, int pos) {
                                  if (k != 0xffu) p.bufs.expert_pos[(size_t)t * K + k] = pos;
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
      p.bufs.rank_pos[(size_t)t * R + d] = k != 0xffu ? pos : -1;
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
  const int nchk = gridDim.x - (nG + R);
  for (int t = (b - (nG + R)) * blockDim.x + threadIdx.x; t < T; t += nchk * blockDim.x) {
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
      p.bufs.topk[(size_t)t * K + k] = norm;
      if (norm < 0) p.bufs.expert_pos[(size_t)t * K + k] = -1;
    }
    if (bad_code != 0) {
      long bad_v = v[0];
#pragma unroll
      for (int k = 1; k < MOE_EP_MAX_TOPK; ++k) {
        if (k == bad_k) bad_v = v[k];
      }
      const bool range = bad_code == MOE_EP_ERR_BAD_EXPERT;
      report_error(err, bad_code, p.rank, -1, 0, range ? (uint64_t)E : 0, (uint64_t)bad_v, t,
                   bad_k);
    }
  }
}

extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_layout_scan(const __grid_constant__ LayoutParams p) {
  if (p.idx_is_i64) {
    layout_scan_body<long long>(p);
  } else {
    layout_scan_body<int>(p);
  }
}

// ============================================================================
// Layout, kernel 2: exchange (one block). Sends this rank's count row to every
// rank, waits for all rows, derives every offset the data kernels need, and
// checks every rank's receive capacity (all ranks see the same matrix, so all
// skip the data movement together when one would overflow).
// ============================================================================
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_layout_exchange(const __grid_constant__ LayoutParams p) {
  const int R = p.world, E = p.num_experts, El = E / R, n = count_row(R, E), me = p.rank;
  const Ws ws{p.w, p.ws, R, E};
  const InfoOffsets o = info_offsets(R, E, El);
  int32_t* info = p.bufs.info;
  const uint64_t seq = next_seq(ws, 0, me);
  const int parity = (int)(seq & 1);
  const ErrSink err = ws.err(p.error, me);

  // Phase 1: my row to every rank, then one release flag each.
  const int32_t* row = info + o.counts + me * n;
  for (int d = 0; d < R; ++d) {
    int32_t* dst = ws.counts(d, parity) + me * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) st_relaxed_sys_s32(dst + i, row[i]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int d = 0; d < R; ++d) st_release_sys_u64(ws.count_flag(d) + me, seq);
  }
  // Phase 2: wait for every row.
  bool ok = true;
  if (threadIdx.x < R) {
    ok = wait_at_least(ws.count_flag(me) + threadIdx.x, seq, p.timeout_ns, err, me,
                       threadIdx.x, MOE_EP_CTR_LAYOUT_COUNTS);
  }
  if (!__syncthreads_and(ok)) return;
  const int32_t* all = ws.counts(me, parity);
  for (int i = threadIdx.x; i < R * n; i += blockDim.x) info[o.counts + i] = ld_relaxed_sys_s32(all + i);
  __syncthreads();

  // Phase 3: offsets. C(s, e) expert counts, N(s, d) rank counts.
  const int32_t* C = info + o.counts;
  auto N = [&](int s, int d) { return C[s * n + E + d]; };
  extern __shared__ int32_t smem[];  // [E] expert totals, then [E] padded block starts
  int32_t* tot = smem;
  int32_t* start = smem + E;
  const bool expert_major = p.layout == 1;
  const int align = p.alignment > 0 ? p.alignment : 1;
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
  if (threadIdx.x == 0) {
    for (int d = 0; d < R; ++d) {
      const int need = info[o.rows_needed + d];
      if (need > p.recv_capacity) {
        report_error(err, MOE_EP_ERR_CAPACITY, me, d, 0, 0, 0, need, p.recv_capacity);
        break;
      }
    }
  }
}

// ============================================================================
// Layout, kernel 3 (expert-major only): tell every receiver, for each token
// it will get from me, the rows of the token's experts there (LayoutBufs::meta).
// ============================================================================
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_layout_meta(const __grid_constant__ LayoutParams p) {
  const int R = p.world, E = p.num_experts, El = E / R, K = p.topk, me = p.rank;
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.bufs.info;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  for (int t = gw; t < p.num_tokens; t += nw) {
    const int pos = lane < R ? p.bufs.rank_pos[(size_t)t * R + lane] : -1;
    const int u = pos >= 0 ? info[o.dst_u_off + lane] + pos : -1;
    const int e = lane < K ? p.bufs.topk[(size_t)t * K + lane] : -1;
    const int erow = e >= 0 ? info[o.erow_base + e] + p.bufs.expert_pos[(size_t)t * K + lane] : -1;
    const int dk = e >= 0 ? e / El : -1;
    for (int d = 0; d < R; ++d) {
      const int ud = __shfl_sync(0xffffffffu, u, d);
      if (ud < 0) continue;
      if (lane < K) st_relaxed_sys_s32(p.meta[d] + (size_t)ud * K + lane, dk == d ? erow : -1);
    }
  }
  (void)me;
  fence_acq_rel_sys();
}

// ============================================================================
// Dispatch: each warp claims a (token, piece) at a time (ItemClaims), reads
// it once and stores it into the receive buffer of every rank that hosts one
// of the token's experts (rank-major: row u; expert-major: the row of its
// first local expert there, the receiver copies the others; on the sender's
// own rank the sender writes every row). The warp's next item is claimed,
// its routing loaded and its data fetched into L2 while the current one
// moves. Then one flag per (me, block) on every
// rank, a bounded wait for everyone's flags, and (expert-major) the
// receiver's local copies.
// ============================================================================
namespace {
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
  r.pos = lane < R ? p.bufs.rank_pos[(size_t)t * R + lane] : -1;
  r.e = lane < K ? p.bufs.topk[(size_t)t * K + lane] : -1;
  r.epos = (expert_major && lane < K) ? p.bufs.expert_pos[(size_t)t * K + lane] : 0;
  r.wt = (lane < K && p.topk_w != nullptr) ? p.topk_w[(size_t)t * K + lane] : 0.f;
  return r;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_dispatch(const __grid_constant__ DispatchParams p) {
  const int R = p.world, E = p.num_experts, El = E / R, K = p.topk, me = p.rank;
  const int n16 = p.hidden / 8;
  const Ws ws{p.w, p.ws, R, E};
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.bufs.info;
  const bool expert_major = p.layout == 1;
  const bool scaled = p.scale_w != nullptr;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const uint64_t seq = next_seq(ws, 1, me);
  const ErrSink err = ws.err(p.error, me);

  // NOTE: every rank derived rows_needed from the same matrix: if one rank
  // would overflow, every rank skips the data and only keeps the flags in step.
  bool overflow = false;
  for (int d = 0; d < R; ++d) overflow |= info[o.rows_needed + d] > p.recv_capacity;

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
    const long pad_max = p.alignment > 1 ? p.alignment - 1 : 1;
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
          for (int c = lane; c < n16; c += 32) st_na_v4(rx + (size_t)row * n16 + c, zero);
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
  Pieces pc = pieces_of(n16);
#if !MOE_EP_DISPATCH_SPLIT_ROWS
  pc.n = 1;  // whole rows: pc.per vectors per lane per pass
#endif
  const int n_items = overflow ? 0 : p.num_tokens * pc.n;
  const ItemClaims claims(ws, 1, me, seq);
  TokRoute cur{-1, -1, 0, 0.f};
  int it = n_items > 0 ? claims.next(lane) : n_items;
  if (it < n_items) cur = load_route(p, it / pc.n, R, K, expert_major, lane);
  while (it < n_items) {
    const int t = it / pc.n, piece = it % pc.n;
    const int first = piece * pc.per * 32;
    const int lim = pc.n == 1 ? n16 : min(n16, first + pc.per * 32);
    const int it_next = claims.next(lane);
    TokRoute next = cur;
    if (it_next < n_items) {
      const int tn = it_next / pc.n, fn = (it_next % pc.n) * pc.per * 32;
      if (tn != t) next = load_route(p, tn, R, K, expert_major, lane);
      if (lane == 0) {
        const int ln = pc.n == 1 ? n16 : min(n16, fn + pc.per * 32);
        prefetch_l2(x + (size_t)tn * n16 + fn, (uint32_t)(ln - fn) * 16);
      }
    }

    const int u = cur.pos >= 0 ? u_off + cur.pos : -1;
    const int e = cur.e;
    const int dk = e >= 0 ? e / El : -1;
    const int erow = (expert_major && e >= 0) ? info[o.erow_base + e] + cur.epos : -1;
    unsigned dmask = __ballot_sync(0xffffffffu, u >= 0);
    int4* dst[MOE_EP_MAX_RANKS];
#pragma unroll
    for (int d = 0; d < MOE_EP_MAX_RANKS; ++d) {
      dst[d] = nullptr;
      if (d < R) {
        const int ud = __shfl_sync(0xffffffffu, u, d);
        // Expert-major: the token's first (lowest) row on d.
        int row = ud;
        if (expert_major) {
          int cand = dk == d ? erow : 0x7fffffff;
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, off));
          row = ud >= 0 ? cand : -1;
        }
        if (row >= 0) dst[d] = reinterpret_cast<int4*>(p.recv_x[d]) + (size_t)row * n16;
      }
    }
    // Expert-major rows on my own rank: every one written here (slot k's
    // row lrow[k]), none left for the receiver pass.
    int lrow[MOE_EP_MAX_TOPK];
    float lw[MOE_EP_MAX_TOPK];
    if (!expert_major) {
      copy_piece<false>(x + (size_t)t * n16, dst, dmask, nullptr, 0u, lrow, lw, false, n16, first,
                        lim, pc.per, lane);
    } else {
      const unsigned lmask = __ballot_sync(0xffffffffu, dk == me);
      const float my_w = (scaled && dk == me) ? p.scale_w[erow] : 1.f;
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
        lrow[k] = __shfl_sync(0xffffffffu, erow, k);
        lw[k] = __shfl_sync(0xffffffffu, my_w, k);
      }
      copy_piece<true>(x + (size_t)t * n16, dst, dmask & ~(1u << me), rx, lmask, lrow, lw, scaled,
                       n16, first, lim, pc.per, lane);
    }

    // Metadata: top-k weights, local expert ids, source (with piece 0).
    if (piece == 0) {
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
      } else if (lane < K && e >= 0) {
        if (p.recv_w[dk]) p.recv_w[dk][erow] = cur.wt;
        if (p.recv_idx[dk]) p.recv_idx[dk][erow] = e - dk * El;
        if (p.recv_src[dk]) {
          p.recv_src[dk][(size_t)erow * 2] = me;
          p.recv_src[dk][(size_t)erow * 2 + 1] = t;
        }
      }
    }
    cur = next;
    it = it_next;
  }

  if (!signal_and_wait(dispatch_flags, ws, me, R, p.num_blocks, seq, p.timeout_ns, err,
                       MOE_EP_CTR_DISPATCH_DONE) ||
      overflow || !expert_major) {
    return;
  }

  // ---- receiver (expert-major): extra copies of each token from other ranks ----
  const int self_lo = info[o.src_u_off + me], self_hi = info[o.src_u_off + me + 1];
  const int u_count = info[o.src_u_off + R] - (self_hi - self_lo);
  for (int i = gw; i < u_count; i += nw) {
    const int u = i < self_lo ? i : i + (self_hi - self_lo);
    const int row_k = lane < K ? p.bufs.meta[(size_t)u * K + lane] : -1;
    int primary = row_k >= 0 ? row_k : 0x7fffffff;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) primary = min(primary, __shfl_xor_sync(0xffffffffu, primary, off));
    const unsigned rows_mask = __ballot_sync(0xffffffffu, row_k >= 0);
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
  }
}

// ============================================================================
// Combine: each received token's rows here are reduced in f32 (expert-major:
// ascending row order, optionally weighted), rounded to bf16 and pushed into
// the home rank's stage; the home sums, per token, the partials in ascending
// rank order, its own read (rank-major) or reduced (expert-major) straight
// from the local expert outputs, never staged.
//
// Pipelined over chunks of the home ranks' tokens (CombineParams::num_chunks,
// sub-chunk bounds from the layout): every warp pushes its share of chunk c,
// marks it in its block (the block's last warp releases the block's flag for
// c on every rank), then waits for everyone's chunk c - 1 and sums its share
// of those tokens. NVLink carries chunk c while local memory serves c - 1.
// Work items are (row, piece), so short chunks still spread over every warp.
// ============================================================================


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
  const int row_k = lane < K ? p.bufs.meta[(size_t)u * K + lane] : -1;
  rs.n = __popc(__ballot_sync(0xffffffffu, row_k >= 0));
  rs.row = -1;
  for (int i = 0; i < rs.n; ++i) {
    const int r = nth_smallest(row_k, i, lane);
    if (lane == i) rs.row = r;
  }
  rs.w = (rs.row >= 0 && p.w_rows != nullptr) ? p.w_rows[rs.row] : 1.f;
  return rs;
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
  // NOTE: whole-warp shuffles: every caller's loop bounds are warp-uniform.
  for (int i = 0; i < rs.n; ++i) {
    const int row = __shfl_sync(0xffffffffu, rs.row, i);
    const float w = __shfl_sync(0xffffffffu, rs.w, i);
    int4 v[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const int c = base + j * 32 + lane;
      v[j] = c < lim ? ld_nc_v4(y + (size_t)row * n16 + c) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kU; ++j) acc_v4(acc[j], v[j], w, weighted);
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

// Row t's vectors base + j * 32 + lane (< lim): every present rank's vector
// j of v (rank d present when have[d] >= 0) summed in f32 in ascending rank
// order, stored as bf16. The one reduction order of every combine path.
template <int kMaxR, int kV>
__device__ __forceinline__ void sum_ranks_store(const int4 (&v)[kMaxR][kV],
                                                const int (&have)[kMaxR], int R, int4* out, int t,
                                                int n16, int base, int lim, int lane) {
#pragma unroll
  for (int j = 0; j < kV; ++j) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int d = 0; d < kMaxR; ++d) {
      if (d < R && have[d] >= 0) acc_v4(acc, v[d][j], 1.f, false);
    }
    const int x = base + j * 32 + lane;
    if (x < lim) st_na_v4(out + (size_t)t * n16 + x, pack_v4(acc));
  }
}

// kMaxR: compile-time bound on the world, so the home's loads of every
// rank's partial stay in registers (kHome vectors each).
//
// Rank-major: warp 0 of each block is the pusher (bulk copies, no registers
// in flight, chunk by chunk; it releases the block's flag for chunk c once
// its copies are written) and the other warps sum: they wait for every other
// rank's chunk c and reduce it, while the pushers already move chunk c + 1.
// Expert-major (partials are f32 sums of several rows): every warp pushes its
// share of chunk c, marks it (the block's last warp releases the flag), then
// sums chunk c - 1.
template <int kMaxR, bool kExpertMajor>
__device__ void combine_body(const CombineParams& p) {
  // Expert-major home sums hold f32 accumulators too: fewer vectors.
  constexpr int kHomeRm = kMaxR <= 2 ? MOE_EP_HOME_VECS : (kMaxR <= 4 ? 2 : 1);
  constexpr int kHome = kExpertMajor ? (kMaxR <= 2 ? 2 : 1) : kHomeRm;
  constexpr int kEm = 2;  // expert-major partials: vectors per lane per step (f32 sums)
  const int R = p.world, E = p.num_experts, El = E / R, K = p.topk, me = p.rank;
  const int n16 = p.hidden / 8, T = p.num_tokens, nb = p.num_blocks;
  const Ws ws{p.w, p.ws, R, E};
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.bufs.info;
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
  const ErrSink err = ws.err(p.error, me);
  const int parity = (int)(seq & 1);
  const int4* y = reinterpret_cast<const int4*>(p.y);
  int4* stage_here = ws.stage(me, parity, p.hidden);
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
    if (q.piece != 0 || p.grad_w_in == nullptr || lane >= K) return;
    float g = 0.f;
    if (!expert_major) {
      g = p.grad_w_in[(size_t)q.u * K + lane];
    } else {
      const int row_k = p.bufs.meta[(size_t)q.u * K + lane];
      g = row_k >= 0 ? p.grad_w_in[row_k] : 0.f;
    }
    ws.stage_w(q.s, parity)[(size_t)q.slot * MOE_EP_MAX_TOPK + lane] = g;
  };
  // Every other rank's blocks have pushed chunk c (one warp; false on timeout/error).
  auto wait_chunk = [&](int c) {
    bool ok = true;
    const uint64_t* flags = ws.combine_done(me);
    for (int i = lane; i < R * nb; i += 32) {
      const int s = i / nb, b = i % nb;
      if (s == me) continue;
      ok &= wait_at_least(flags + s * MOE_EP_MAX_BLOCKS + b, chunk_flag(c), p.timeout_ns, err, me,
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
        (w0 < n_items && lane < R) ? p.bufs.rank_pos[(size_t)(t_lo + w0 / pc.n) * R + lane] : -1;
    for (int it = w0; it < n_items; it += nws) {
      const int t = t_lo + it / pc.n, piece = it % pc.n;
      const int slot =
          pos >= 0 ? (lane == me ? s_src_u_off[me] + pos : s_home_slot[lane] + pos) : -1;
      // This warp's next item: its positions now, its rows into L2 below.
      const int itn = it + nws;
      const int pos_next = (itn < n_items && lane < R)
                               ? p.bufs.rank_pos[(size_t)(t_lo + itn / pc.n) * R + lane]
                               : -1;
      int slots[kMaxR];
#pragma unroll
      for (int d = 0; d < kMaxR; ++d) slots[d] = __shfl_sync(0xffffffffu, slot, d < R ? d : 0);
      const int u_self = slots[me < kMaxR ? me : 0];
      RowSet rs;
      rs.n = 0;
      if (u_self >= 0) rs = row_set(p, u_self, expert_major, K, lane);
      const int first = piece * pc.per * 32, lim = min(n16, first + pc.per * 32);
      for (int base = first; base < lim; base += 32 * kHome) {
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
      if (piece == 0 && p.grad_w_out != nullptr && lane < K) {
        const int e = p.bufs.topk[(size_t)t * K + lane];
        float g = 0.f;
#pragma unroll
        for (int d = 0; d < kMaxR; ++d) {
          if (e < 0 || e / El != d || slots[d] < 0) continue;
          if (d != me) {
            g = stage_w_here[(size_t)slots[d] * MOE_EP_MAX_TOPK + lane];
          } else if (!expert_major) {
            g = p.grad_w_in[(size_t)slots[d] * K + lane];
          } else {
            const int row_k = p.bufs.meta[(size_t)slots[d] * K + lane];
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
    if (info[o.rows_needed + d] > p.recv_capacity) return;
  }

  // Rank-major without weight gradients: pusher + summers. With them (the
  // dispatch backward) every warp moves rows and gradients, as in expert-major:
  // per-row gradient loads in the pusher's issue loop slowed it down.
  if (!expert_major && p.grad_w_in == nullptr) {
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
    PROBE_INIT();
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
        PROBE(0);
        const PushItem q = from_lane(ql, g);
        PROBE(1);
        if (lane == 0) {
          // Stores issued so far: g - kAhead; the one of piece g - kBufs is
          // followed by kBufs - kAhead - 1 newer ones.
          if (g >= kBufs) bulk_wait_read<kBufs - kAhead - 1>();
          const int b = g % kBufs;
          const uint32_t bytes = (uint32_t)(q.lim - q.first) * 16;
          PROBE(2);
          mbar_expect_tx(&s_bar[b], bytes);
          bulk_load(s_bulk + b * kSlot, y + (size_t)q.u * n16 + q.first, bytes, &s_bar[b]);
          PROBE(3);
        }
      }
      const int gs = g - kAhead;
      if (gs < 0 || gs >= total) continue;
      PROBE(4);
      if (gs % 32 == 0 && gs + lane < total) qs = item_at(sk, gs + lane);
      const PushItem q = from_lane(qs, gs);
      PROBE(5);
      if (lane == 0) {
        const int b = gs % kBufs;
        ok = mbar_wait(&s_bar[b], (phase >> b) & 1u, p.timeout_ns, err, me, MOE_EP_CTR_BULK_COPY);
        PROBE(6);
        phase ^= 1u << b;
        int4* dst = ws.stage(q.s, parity, p.hidden) + (size_t)q.slot * n16 + q.first;
        PROBE(7);
        if (ok) bulk_store(dst, s_bulk + b * kSlot, (uint32_t)(q.lim - q.first) * 16);
        bulk_commit();
        PROBE(8);
      }
      __syncwarp();
      PROBE(9);
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
      PROBE_REPORT(total);
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
        for (int it = gw; it < n_items; it += nw) {
          const PushItem q = push_item(c, it, pc);
          int4* dst = ws.stage(q.s, parity, p.hidden) + (size_t)q.slot * n16;
          const RowSet rs = row_set(p, q.u, expert_major, K, lane);
          for (int base = q.first; base < q.lim; base += 32 * kU) {
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

// ============================================================================
// Combine, rank-major, expert outputs in symmetric memory (pull): the home
// reads each of its tokens' partials where they lie, its own locally and
// every other rank's over NVLink, and sums them in ascending rank order in
// one pass (the same order and bits as the push path): no stage, no chunks.
// Each block shakes hands with the same block of every other rank twice
// through pull_flag: "my expert outputs are ready" before its loads
// (2 seq + 1) and "I have read yours" before it may end (2 seq + 2), since a
// rank may overwrite its expert outputs once its combine is done.
// ============================================================================
template <int kMaxR>
__device__ void combine_pull(const CombineParams& p) {
  // Every rank's vectors are in flight at once: fewer each for larger worlds.
  constexpr int kV = kMaxR <= 2 ? MOE_EP_PULL_VECS : (kMaxR <= 4 ? 4 : 2);
  const int R = p.world, E = p.num_experts, El = E / R, K = p.topk, me = p.rank;
  const int n16 = p.hidden / 8, T = p.num_tokens;
  const Ws ws{p.w, p.ws, R, E};
  const InfoOffsets o = info_offsets(R, E, El);
  const int32_t* info = p.bufs.info;
  const int lane = threadIdx.x & 31;
  const uint64_t seq = next_seq(ws, 2, me);
  const ErrSink err = ws.err(p.error, me);
  // NOTE: as in dispatch, every rank sees the same overflow and skips together.
  for (int d = 0; d < R; ++d) {
    if (info[o.rows_needed + d] > p.recv_capacity) return;
  }
  // Thread d < R (d != me) shakes hands with block blockIdx.x of rank d.
  const int d_hs = threadIdx.x;
  const bool shakes = d_hs < R && d_hs != me;
  auto handshake = [&](uint64_t value) {
    bool ok = true;
    if (shakes) {
      fence_acq_rel_sys();
      st_release_sys_u64(ws.pull_flag(d_hs) + me * MOE_EP_MAX_BLOCKS + blockIdx.x, value);
      ok = wait_at_least(ws.pull_flag(me) + d_hs * MOE_EP_MAX_BLOCKS + blockIdx.x, value,
                         p.timeout_ns, err, me, d_hs, MOE_EP_CTR_COMBINE_PULL);
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
    const int pos = p.bufs.rank_pos[(size_t)(it / pc.n) * R + lane];
    return pos >= 0 ? u_off + pos : -1;
  };
  // Items: the dispatch backward (weight gradients read beside each token's
  // first piece) claims them (ItemClaims: 240 -> 193 µs at 24 SMs); the
  // plain combine keeps a fixed stride gw, gw + nw, ... (claims: no faster
  // at 20-32 SMs, 5-8% slower at 16; BENCHMARKS.md).
  const bool claimed = p.grad_w_in != nullptr;
  const ItemClaims claims(ws, 2, me, seq);
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  int it = claimed ? claims.next(lane) : gw;
  int row = row_of(it);  // looked up while the handshake waits
  if (!handshake(2 * seq + 1)) return;
  while (it < n_items) {
    const int t = it / pc.n, piece = it % pc.n;
    const int it_next = claimed ? claims.next(lane) : it + nw;
    const int row_next = row_of(it_next);  // loaded while this item's rows move
    if (piece == 0 && p.grad_w_in != nullptr) {
      // Dispatch backward: slot k's weight gradient lives on the rank that
      // owns expert k, beside the token's row there.
      const int e = lane < K ? p.bufs.topk[(size_t)t * K + lane] : -1;
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
    it = it_next;
    row = row_next;
  }
  handshake(2 * seq + 2);
}

// One entry point per bound on the world (the launcher picks the smallest).
template <int kMaxR>
__device__ __forceinline__ void combine_entry(const CombineParams& p) {
  if (p.layout == 1) {
    combine_body<kMaxR, true>(p);
  } else if (p.y_peers[p.rank] != nullptr) {
    combine_pull<kMaxR>(p);
  } else {
    combine_body<kMaxR, false>(p);
  }
}
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_combine_r2(const __grid_constant__ CombineParams p) {
  combine_entry<2>(p);
}
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_combine_r4(const __grid_constant__ CombineParams p) {
  combine_entry<4>(p);
}
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_combine_r8(const __grid_constant__ CombineParams p) {
  combine_entry<8>(p);
}
