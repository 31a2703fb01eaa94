// Low-latency (decode) mode of the NVLink path: dispatch and combine of at
// most max_tokens_per_rank (M) tokens per rank into fixed buffers (LlBufs,
// two sets), with no layout pass and no count exchange before the data:
// every row has a place that depends only on its source and token, and each
// sender block's count travels with its rows (LlSignal, released after them).
//
//   moe_ep_ll_dispatch_send_{i32,i64}   sender: each warp takes a token, checks
//       its routing, writes it once to every rank that hosts one of its
//       experts (row me * M + t there; fp8 cast on the way when asked), and
//       its [K] local ids / weights / source to every rank (so every
//       receiver knows all of the sender's T rows); then one LlSignal per
//       (block, rank). Never waits.
//   moe_ep_ll_dispatch_recv_{rank,expert}_major   receiver: waits for every
//       sender block's signal, checks the batch (topk, layout, payload, bad
//       routing: every rank finds the same error), counts the (token,
//       expert) pairs per local expert and source; expert-major also packs
//       the rows into [El, R * M] blocks (the extra copies of a token for
//       this rank's other experts are made here, from the one that crossed).
//   moe_ep_ll_combine_send_{rank,expert}_major    expert rank: pushes each
//       expert output row home (expert-major: to the home's slot t * K + k;
//       rank-major, pre-reduced rows: to d * M + t), then signals every home.
//   moe_ep_ll_combine_recv_{rank,expert}_major    home: waits for every
//       expert rank's signal and sums each token's rows in f32 in the
//       reference's fixed order (expert-major: k ascending, fmaf(w, x, acc)
//       with the home's weights; rank-major: d ascending, acc + x), bf16 out.
//
// Sequence numbers: the sender bumps a per-block counter (every launch has
// the same grid on every rank, so the counters of all ranks move in step)
// and stores it in its set (LlBufs::set_seq); the set's later kernels (the
// receive, both combine halves) read it there. A set is reused only after
// its combine (the host refuses otherwise), which orders every reader of a
// set's buffers on every rank before the next writer (see
// src/ops/low_latency/). Every wait is bounded (MOE_EP_CTR_LL_*).
//
// Rust launcher: src/ops/low_latency/ops.rs (EpGroup::ll_dispatch*,
// ll_combine*). Tests: tests/gpu_low_latency.rs (every layout and payload bit
// for bit against src/reference/low_latency.rs and fp8.rs, combine against
// the reference's f32 emulation and f64, two batches in flight, CUDA graphs,
// bad inputs).
#include "intranode.cuh"

namespace {

// 1.0f / 448.0f rounded once (src/reference/fp8.rs E4M3_MAX_INV; a test
// there checks these bits).
constexpr uint32_t kE4m3MaxInvBits = 0x3B124925u;
constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;
constexpr int kLlUnroll = 8;  // 16-byte vectors in flight per lane per row pass

// ---- one buffer set as mapped here ----
__device__ __forceinline__ char* sym_set(const LlParams& p, int r) {
  return p.b.sym[r] + (size_t)p.set * p.b.sym_set_bytes;
}
__device__ __forceinline__ char* local_set(const LlParams& p) {
  return p.b.local + (size_t)p.set * p.b.local_set_bytes;
}
template <typename T>
__device__ __forceinline__ T* at(char* base, uint64_t off) {
  return reinterpret_cast<T*>(base + off);
}
// Bytes of one row's payload (fp8: H codes; bf16: H values).
__device__ __forceinline__ size_t row_bytes(const LlParams& p) {
  return p.payload == MOE_EP_LL_FP8 ? (size_t)p.op.hidden : (size_t)p.op.hidden * 2;
}

// The sender's sequence number: this block's dispatch counter + 1; block 0
// records it in the set for the set's later kernels (and zeroes the set's
// ticket for the receive).
__device__ uint64_t ll_next_seq(const LlParams& p) {
  __shared__ uint64_t s_seq;
  if (threadIdx.x == 0) {
    uint64_t* c = at<uint64_t>(p.b.local, p.b.counters) + blockIdx.x;
    s_seq = *c + 1;
    *c = s_seq;
    if (blockIdx.x == 0) {
      *at<uint64_t>(local_set(p), p.b.set_seq) = s_seq;
      *at<unsigned>(local_set(p), p.b.ticket) = 0u;  // the receive's last-block ticket
    }
  }
  __syncthreads();
  return s_seq;
}
// The set's sequence number (written by its dispatch send, an earlier kernel).
__device__ __forceinline__ uint64_t set_seq(const LlParams& p) {
  return *at<volatile uint64_t>(local_set(p), p.b.set_seq);
}

// Waits until every (source rank, block) slot of `flags` (uint64 at
// `stride` bytes apart, [R][MAX_BLOCKS]) holds at least seq. Block-wide;
// false on timeout or an error found elsewhere.
__device__ bool wait_all(const char* flags, size_t stride, int R, int nb, uint64_t seq,
                         const LlParams& p, const ErrSink& err, int counter) {
  bool ok = true;
  for (int i = threadIdx.x; i < R * nb; i += blockDim.x) {
    const int s = i / nb, b = i % nb;
    const uint64_t* f =
        reinterpret_cast<const uint64_t*>(flags + ((size_t)s * MOE_EP_MAX_BLOCKS + b) * stride);
    ok &= wait_at_least(f, seq, p.op.timeout_ns, err, p.op.rank, s, counter);
  }
  return __syncthreads_and(ok) != 0;
}
// The combine signals' sequence number (below the MOE_EP_LL_SIG_NOT_SENT
// and argument bits), as wait_all compares it: a sender that sent no rows
// in an earlier batch of the set must not pass for this one.
__device__ bool wait_all_combine(const char* flags, int R, int nb, uint64_t seq, const LlParams& p,
                                 const ErrSink& err) {
  bool ok = true;
  for (int i = threadIdx.x; i < R * nb; i += blockDim.x) {
    const int s = i / nb, b = i % nb;
    const uint64_t* f = reinterpret_cast<const uint64_t*>(flags) + s * MOE_EP_MAX_BLOCKS + b;
    uint64_t start = 0;
    for (uint32_t n = 1; ok; ++n) {
      if ((ld_acquire_sys_u64(f) & ((1ull << 48) - 1)) >= seq) break;
      if (n % kCheckEvery == 0) {
        if (has_error(err)) {
          ok = false;
        } else if (timed_out(&start, p.op.timeout_ns)) {
          report_error(err, MOE_EP_ERR_TIMEOUT, p.op.rank, s, MOE_EP_CTR_LL_COMBINE, seq,
                       ld_acquire_sys_u64(f) & ((1ull << 48) - 1), 0, 0);
          ok = false;
        }
      }
      __nanosleep(32);
    }
  }
  return __syncthreads_and(ok) != 0;
}

// ---- fp8 e4m3 (src/reference/fp8.rs) ----
// Two values to two e4m3 codes (lo in the low byte): round to nearest even,
// saturating to +-448, NaN -> 0x7F.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
// The scale pair of a block of amax `amax` (>= 1e-4): the stored scale and
// the multiplier the values are quantized with.
__device__ __forceinline__ void block_scale(float amax, bool pow2, float* scale, float* mul) {
  const float inv = __uint_as_float(kE4m3MaxInvBits);
  if (!pow2) {
    *scale = __fmul_rn(amax, inv);
    *mul = __fdiv_rn(kE4m3Max, amax);
  } else {
    const uint32_t b = __float_as_uint(__fmul_rn(amax, inv));
    const int e = (int)((b >> 23) & 0xffu) - 127 + ((b & 0x7fffffu) != 0u ? 1 : 0);
    *scale = __uint_as_float((uint32_t)(127 + e) << 23);
    *mul = __uint_as_float((uint32_t)(127 - e) << 23);
  }
}

// ---- flat work over the grid's warps ----
// A row of n16 16-byte vectors is cut into `parts` pieces of whole warp
// passes (32 vectors each), so that few rows still keep every warp busy.
__device__ __forceinline__ int parts_for(int rows, int n16, int nw) {
  const int passes = (n16 + 31) / 32;
  const int want = rows > 0 ? nw / rows : 1;
  return want < 1 ? 1 : (want > passes ? passes : want);
}
// Vector range [c0, c1) of piece `part` of `parts` of a row of n16 vectors.
__device__ __forceinline__ void piece(int n16, int part, int parts, int* c0, int* c1) {
  const int passes = (n16 + 31) / 32;
  *c0 = (passes * part / parts) * 32;
  const int e = (passes * (part + 1) / parts) * 32;
  *c1 = e < n16 ? e : n16;
}
// Copies vectors [c0, c1) of src to dst, a warp, kLlUnroll loads in flight
// per lane.
__device__ __forceinline__ void warp_copy(const int4* src, int4* dst, int c0, int c1, int lane) {
  for (int base = c0; base < c1; base += 32 * kLlUnroll) {
    int4 v[kLlUnroll];
#pragma unroll
    for (int i = 0; i < kLlUnroll; ++i) {
      const int c = base + i * 32 + lane;
      if (c < c1) v[i] = ld_nc_v4(src + c);
    }
#pragma unroll
    for (int i = 0; i < kLlUnroll; ++i) {
      const int c = base + i * 32 + lane;
      if (c < c1) st_na_v4(dst + c, v[i]);
    }
  }
}

// ---- sender: a piece of one token's row to every rank in dmask (a warp) ----
// bf16 rows, or the caller's fp8 rows (codes; the scales with piece 0):
// copied as they are.
__device__ __forceinline__ void send_row_copy(const LlParams& p, int t, size_t row,
                                              unsigned dmask, int lane, int part, int parts) {
  const int R = p.op.world, H = p.op.hidden;
  const bool fp8 = p.payload == MOE_EP_LL_FP8;
  const size_t rb = row_bytes(p);
  const int n16 = (int)(rb / 16);
  int c0, c1;
  piece(n16, part, parts, &c0, &c1);
  const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + (size_t)t * rb);
  for (int base = c0; base < c1; base += 32 * kLlUnroll) {
    int4 v[kLlUnroll];
#pragma unroll
    for (int i = 0; i < kLlUnroll; ++i) {
      const int c = base + i * 32 + lane;
      if (c < c1) v[i] = ld_nc_v4(src + c);
    }
    for (int d = 0; d < R; ++d) {
      if (!((dmask >> d) & 1u)) continue;
      int4* dst = reinterpret_cast<int4*>(sym_set(p, d) + p.b.recv_x + row * rb);
#pragma unroll
      for (int i = 0; i < kLlUnroll; ++i) {
        const int c = base + i * 32 + lane;
        if (c < c1) st_na_v4(dst + c, v[i]);
      }
    }
  }
  if (fp8 && part == 0) {
    const int nb = H / MOE_EP_FP8_BLOCK;
    for (int c = lane; c < nb; c += 32) {
      const float sc = p.x_scales[(size_t)t * nb + c];
      for (int d = 0; d < R; ++d) {
        if ((dmask >> d) & 1u) at<float>(sym_set(p, d), p.b.recv_scales)[row * nb + c] = sc;
      }
    }
  }
}

// A piece of a bf16 row cast to fp8 on the way: a half warp per block of
// 128 values (8 per lane), the block's amax by shuffles, one scale per
// block. kCastUnroll passes' loads are issued before any is used.
constexpr int kCastUnroll = 4;
__device__ __forceinline__ void send_row_cast(const LlParams& p, int t, size_t row,
                                              unsigned dmask, int lane, int part, int parts) {
  const int R = p.op.world, H = p.op.hidden, n16 = H / 8, nb = H / MOE_EP_FP8_BLOCK;
  const bool pow2 = p.cast == MOE_EP_LL_CAST_POW2;
  const int4* src = reinterpret_cast<const int4*>(p.x) + (size_t)t * n16;
  int c0, c1;
  piece(n16, part, parts, &c0, &c1);
  for (int base0 = c0; base0 < c1; base0 += 32 * kCastUnroll) {
    int4 in[kCastUnroll];
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) {
      const int c = base0 + u * 32 + lane;
      in[u] = c < c1 ? ld_nc_v4(src + c) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) {
      const int base = base0 + u * 32;
      if (base >= c1) break;      // warp-uniform
      const int c = base + lane;  // this lane's 8 values; block c / 16
      const bool act = c < c1;    // c1 is a multiple of 16: whole half warps
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&in[u]);
      float f[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
      }
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      amax = fmaxf(kAmaxFloor, amax);
      float scale, mul;
      block_scale(amax, pow2, &scale, &mul);
      uint2 q;
      q.x = e4m3x2(__fmul_rn(f[0], mul), __fmul_rn(f[1], mul)) |
            (e4m3x2(__fmul_rn(f[2], mul), __fmul_rn(f[3], mul)) << 16);
      q.y = e4m3x2(__fmul_rn(f[4], mul), __fmul_rn(f[5], mul)) |
            (e4m3x2(__fmul_rn(f[6], mul), __fmul_rn(f[7], mul)) << 16);
      if (!act) continue;
      for (int d = 0; d < R; ++d) {
        if (!((dmask >> d) & 1u)) continue;
        char* s = sym_set(p, d);
        *reinterpret_cast<uint2*>(s + p.b.recv_x + row * (size_t)H + (size_t)c * 8) = q;
        if ((lane & 15) == 0) at<float>(s, p.b.recv_scales)[row * nb + c / 16] = scale;
      }
    }
  }
}

// ---- expert-major rows of a set, counted (after the dispatch receive) ----
// Staged entry i of (local expert j, source s): token t and top-k slot,
// packed as t * 32 + slot at em_stage[(j * R + s) * M + i]; em_off[j * R +
// s] is the number of rows before it in (j, s) order, em_off[E] the total.
// Row f of that order: its (j, s), its token and slot, and its row in the
// expert-major layout.
struct EmRow {
  int j, s, t, slot;
  size_t row;
};
__device__ __forceinline__ EmRow em_locate(const LlParams& p, const int32_t* off, int f) {
  const int R = p.op.world, E = p.op.num_experts, M = p.max_tokens;
  int lo = 0, hi = E;  // off[lo] <= f < off[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= f) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int i = f - off[lo];
  const int e = at<const int32_t>(local_set(p), p.b.em_stage)[(size_t)lo * M + i];
  EmRow r;
  r.j = lo / R;
  r.s = lo % R;
  r.t = e >> 5;
  r.slot = e & 31;
  r.row = (size_t)r.j * R * M + (size_t)(off[lo] - off[r.j * R]) + i;
  return r;
}

}  // namespace

// ============================================================================
// Dispatch, sender.
// ============================================================================
template <typename Idx>
__device__ void ll_dispatch_send(const LlParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const Ws ws = ws_of(p.op);
  // A send that moves no rows: this rank skips the batch after an error
  // (its status word) or its host refused the call. It still counts the
  // batch and tells every receiver why (LlSignal::num_tokens), so that no
  // peer waits for it and every rank's counters stay in step.
  const bool stopped = ws.stopped(me);
  const int why = stopped ? MOE_EP_LL_STOPPED
                          : (p.refuse > 0 ? MOE_EP_LL_REFUSED_BASE - (p.refuse - 1) : 0);
  const int T = why != 0 ? 0 : p.op.num_tokens, M = p.max_tokens;
  __shared__ unsigned long long s_bad;
  if (threadIdx.x == 0) s_bad = 0ull;
  const uint64_t seq = ll_next_seq(p);  // (its barrier publishes s_bad)
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const Idx* idx = static_cast<const Idx*>(p.topk_idx);
  char* loc = local_set(p);
  int32_t* home_topk = at<int32_t>(loc, p.b.home_topk);
  float* home_w = at<float>(loc, p.b.home_w);
  const int n16 = (int)(p.cast != MOE_EP_LL_CAST_NONE ? p.op.hidden / 8 : row_bytes(p) / 16);
  const int parts = parts_for(T, n16, nw);

  // Item (token t, piece part): every piece reads the token's routing; piece
  // 0 also reports it and writes the slots.
  for (int it = gw; it < T * parts; it += nw) {
    const int t = it / parts, part = it % parts;
    // Routing, lane k = slot k: an id outside [-1, E) or one an earlier slot
    // already named is reported (the lowest such slot of the lowest token,
    // by every receiver) and not routed.
    const long long v = lane < K ? (long long)idx[(size_t)t * K + lane] : -1ll;
    int code = (lane < K && (v < -1 || v >= E)) ? MOE_EP_ERR_BAD_EXPERT : 0;
    for (int k2 = 0; k2 + 1 < K; ++k2) {
      const long long o = __shfl_sync(0xffffffffu, v, k2);
      if (code == 0 && k2 < lane && lane < K && v >= 0 && o == v) code = MOE_EP_ERR_DUP_EXPERT;
    }
    const int e = (lane < K && code == 0) ? (int)v : -1;
    const int dk = e >= 0 ? e / El : -1;
    unsigned dmask = 0u;
    for (int d = 0; d < R; ++d) {
      if (__ballot_sync(0xffffffffu, dk == d) != 0u) dmask |= 1u << d;
    }
    const size_t row = (size_t)me * M + t;
    if (part == 0) {
      const unsigned bad_lanes = __ballot_sync(0xffffffffu, code != 0);
      if (bad_lanes != 0u && lane == __ffs(bad_lanes) - 1) {
        atomicMax(&s_bad, bad_entry_word(t, lane, code, v));
      }
      const float w = lane < K ? p.topk_w[(size_t)t * K + lane] : 0.f;
      if (lane < K) {
        home_topk[(size_t)t * K + lane] = e;
        home_w[(size_t)t * K + lane] = w;
      }
      // Every receiver learns all T rows of mine: slots, weights, source.
      for (int d = 0; d < R; ++d) {
        char* s = sym_set(p, d);
        if (lane < K) {
          at<int32_t>(s, p.b.recv_idx)[row * K + lane] = dk == d ? e - d * El : -1;
          at<float>(s, p.b.recv_w)[row * K + lane] = dk == d ? w : 0.f;
        }
        if (lane < 2) {
          const bool here = (dmask >> d) & 1u;
          at<int32_t>(s, p.b.recv_src)[row * 2 + lane] = here ? (lane == 0 ? me : t) : -1;
        }
      }
    }
    // The row itself, once per rank that hosts one of the token's experts.
    if (dmask != 0u) {
      if (p.cast != MOE_EP_LL_CAST_NONE) {
        send_row_cast(p, t, row, dmask, lane, part, parts);
      } else {
        send_row_copy(p, t, row, dmask, lane, part, parts);
      }
    }
  }

  // This block's signal to every rank: its rows are there.
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int d = 0; d < R; ++d) {
      LlSignal* g = at<LlSignal>(sym_set(p, d), p.b.sig_dispatch) + me * MOE_EP_MAX_BLOCKS + blockIdx.x;
      volatile LlSignal* vg = g;
      vg->bad = s_bad;
      vg->num_tokens = why != 0 ? why : (p.tokens_fault != 0 ? p.tokens_fault : T);
      vg->topk = K;
      vg->payload = p.payload;
      vg->layout = (int32_t)p.op.layout;
      st_release_sys_u64(&g->seq, seq);
    }
  }
}

// ============================================================================
// Dispatch, receiver: counts (and the expert-major order, staged).
// ============================================================================
template <bool kExpertMajor>
__device__ void ll_dispatch_recv(const LlParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int M = p.max_tokens, nb = p.op.num_blocks;
  const Ws ws = ws_of(p.op);
  if (ws.stopped(me)) return;
  const uint64_t seq = set_seq(p);
  const ErrSink err = ws.err(p.op.error, me);
  char* mine = sym_set(p, me);
  char* loc = local_set(p);
  const LlSignal* sig = at<const LlSignal>(mine, p.b.sig_dispatch);

  // Each thread waits for its (source, block) signals and reads what they
  // say; the verdict (the same on every rank): ranks that disagree (topk,
  // layout, payload), the lowest (source, block, field) first; else the
  // lowest rank's first bad routing entry. Either stops every rank's
  // kernels from here on.
  __shared__ int s_code;
  __shared__ int s_mismatch;  // (s * MAX_BLOCKS + b) * 3 + field, or INT_MAX
  __shared__ unsigned long long s_badw[MOE_EP_MAX_RANKS];
  __shared__ int s_tokens[MOE_EP_MAX_RANKS];
  if (threadIdx.x == 0) s_mismatch = 0x7fffffff;
  if (threadIdx.x < MOE_EP_MAX_RANKS) s_badw[threadIdx.x] = 0ull;
  __syncthreads();
  bool ok = true;
  const int32_t want[3] = {K, (int32_t)p.op.layout, p.payload};
  for (int i = threadIdx.x; i < R * nb; i += blockDim.x) {
    const int s = i / nb, b = i % nb;
    const LlSignal* g = sig + s * MOE_EP_MAX_BLOCKS + b;
    ok &= wait_at_least(&g->seq, seq, p.op.timeout_ns, err, me, s, MOE_EP_CTR_LL_DISPATCH);
    if (!ok) continue;
    const volatile LlSignal* vg = g;
    const int32_t got[3] = {vg->topk, vg->layout, vg->payload};
    for (int f = 0; f < 3; ++f) {
      if (got[f] != want[f]) {
        atomicMin(&s_mismatch, (s * MOE_EP_MAX_BLOCKS + b) * 3 + f);
        break;
      }
    }
    atomicMax(&s_badw[s], (unsigned long long)vg->bad);
    if (b == 0) s_tokens[s] = vg->num_tokens;
  }
  if (__syncthreads_and(ok) == 0) return;
  if (threadIdx.x == 0) {
    int code = 0;
    // Senders that moved no rows (stopped, refused), then a count no
    // sender could have (a peer's word is trusted only inside [0, M]).
    for (int s = 0; s < R && code == 0; ++s) {
      const int n = s_tokens[s];
      if (n == MOE_EP_LL_STOPPED) {
        code = MOE_EP_ERR_PEER_STOPPED;
        report_error(err, code, me, s, 0, 0, 0, 0, seq);
      } else if (n < 0) {
        code = MOE_EP_ERR_REFUSED;
        report_error(err, code, me, s, MOE_EP_LL_REFUSED_BASE - n, 0, 0, 0, seq);
      } else if (n > M) {
        code = MOE_EP_ERR_BAD_PEER_DATA;
        report_error(err, code, me, s, MOE_EP_FIELD_NUM_TOKENS, (uint64_t)M + 1, (uint64_t)n, 0,
                     0);
      }
    }
    if (code == 0 && s_mismatch != 0x7fffffff) {
      const int f = s_mismatch % 3, s = s_mismatch / 3 / MOE_EP_MAX_BLOCKS,
                b = s_mismatch / 3 % MOE_EP_MAX_BLOCKS;
      const int field[3] = {MOE_EP_FIELD_TOPK, MOE_EP_FIELD_LAYOUT, MOE_EP_FIELD_PAYLOAD};
      const volatile LlSignal* g = sig + s * MOE_EP_MAX_BLOCKS + b;
      const int32_t got[3] = {g->topk, g->layout, g->payload};
      code = MOE_EP_ERR_MISMATCH;
      report_error(err, code, me, s, field[f], (uint64_t)(int64_t)want[f],
                   (uint64_t)(int64_t)got[f], 0, 0);
    }
    for (int s = 0; s < R && code == 0; ++s) {
      const unsigned long long w = s_badw[s];
      if (w != 0ull) code = report_bad_entry(err, me, s, w, E);
    }
    if (code != 0) *ws.status(me) = (unsigned long long)code;
    s_code = code;
  }
  __syncthreads();
  if (s_code != 0) return;

  // Counts: [El] per local expert, [El * R] per (expert, source), [R] per
  // source. A warp per (local expert j, source s): its rows in token order
  // (a token names an expert at most once), ranked by ballots.
  int32_t* counts = at<int32_t>(loc, p.b.counts);
  const int32_t* ridx = at<const int32_t>(mine, p.b.recv_idx);
  int32_t* stage = at<int32_t>(loc, p.b.em_stage);
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  constexpr int kU = 4;  // 32-token chunks whose slots are loaded together
  for (int js = gw; js < El * R; js += nw) {
    const int j = js / R, s = js % R, Ts = s_tokens[s];
    const int32_t* rs = ridx + (size_t)s * M * K;
    int n = 0;
    for (int t0 = 0; t0 < Ts; t0 += 32 * kU) {
      int slot[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int t = t0 + u * 32 + lane;
        int32_t li[MOE_EP_MAX_TOPK];
#pragma unroll
        for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) li[k] = (t < Ts && k < K) ? rs[(size_t)t * K + k] : -1;
        slot[u] = -1;
#pragma unroll
        for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
          if (li[k] == j) slot[u] = k;
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const unsigned bal = __ballot_sync(0xffffffffu, slot[u] >= 0);
        if (kExpertMajor && slot[u] >= 0) {
          const int pos = n + __popc(bal & ((1u << lane) - 1u));
          stage[(size_t)js * M + pos] = (t0 + u * 32 + lane) * 32 + slot[u];
        }
        n += __popc(bal);
      }
    }
    if (lane == 0) counts[El + js] = n;
  }

  // The last block to finish sums them: per expert, and (expert-major) the
  // rows before each (expert, source) in that order. Its ticket was zeroed
  // by the batch's send.
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned* ticket = at<unsigned>(loc, p.b.ticket);
    s_last = atomicAdd(ticket, 1u) == gridDim.x - 1 ? 1 : 0;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (threadIdx.x < R) counts[El + El * R + threadIdx.x] = s_tokens[threadIdx.x];
  for (int j = threadIdx.x; j < El; j += blockDim.x) {
    int n = 0;
    for (int s = 0; s < R; ++s) n += __ldcg(counts + El + j * R + s);
    counts[j] = n;
  }
  if (kExpertMajor) {
    __shared__ int scratch[33];
    int32_t* off = at<int32_t>(loc, p.b.em_off);
    int running = 0;
    for (int base = 0; base < E; base += blockDim.x) {
      const int i = base + threadIdx.x;
      const int v = i < E ? __ldcg(counts + El + i) : 0;
      int total;
      const int pos = block_exclusive_scan(v, scratch, &total);
      if (i < E) off[i] = running + pos;
      running += total;
    }
    if (threadIdx.x == 0) off[E] = running;
  }
}

// ============================================================================
// Dispatch, receiver, expert-major: the counted rows into their blocks (the
// extra copies of a token for this rank's other experts are made here, from
// the one that crossed).
// ============================================================================
__device__ void ll_dispatch_copy(const LlParams& p) {
  const int E = p.op.num_experts, me = p.op.rank, M = p.max_tokens;
  const Ws ws = ws_of(p.op);
  if (ws.stopped(me)) return;
  char* mine = sym_set(p, me);
  char* loc = local_set(p);
  const int32_t* off = at<const int32_t>(loc, p.b.em_off);
  const int N = off[E];
  const bool fp8 = p.payload == MOE_EP_LL_FP8;
  const size_t rb = row_bytes(p);
  const int n16 = (int)(rb / 16), nbk = p.op.hidden / MOE_EP_FP8_BLOCK;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const int parts = parts_for(N, n16, nw);
  for (int it = gw; it < N * parts; it += nw) {
    const int f = it / parts, part = it % parts;
    const EmRow r = em_locate(p, off, f);
    const size_t from = (size_t)r.s * M + r.t;
    if (part == 0) {
      if (lane < 2) at<int32_t>(loc, p.b.em_src)[r.row * 2 + lane] = lane == 0 ? r.s : r.t;
      if (lane == 0 && r.s == me) {  // my own token: where its slot's row is, for the home
        at<int32_t>(loc, p.b.home_row)[(size_t)r.t * p.op.topk + r.slot] = (int32_t)r.row;
      }
      if (fp8) {
        const float* ss = at<const float>(mine, p.b.recv_scales) + from * nbk;
        float* ds = at<float>(loc, p.b.em_scales) + r.row * nbk;
        for (int c = lane; c < nbk; c += 32) ds[c] = ss[c];
      }
    }
    int c0, c1;
    piece(n16, part, parts, &c0, &c1);
    warp_copy(reinterpret_cast<const int4*>(mine + p.b.recv_x + from * rb),
              reinterpret_cast<int4*>(loc + p.b.em_x + r.row * rb), c0, c1, lane);
  }
}

// ============================================================================
// Combine, expert rank: every counted row home, then a signal to every home.
// ============================================================================
template <bool kExpertMajor>
__device__ void ll_combine_send(const LlParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int M = p.max_tokens, n16 = p.op.hidden / 8;
  const Ws ws = ws_of(p.op);
  const uint64_t seq = set_seq(p);
  // No rows when this rank skips the batch (an error: its status word) or
  // its host refused the call; the signal says which (MOE_EP_LL_SIG_NOT_SENT
  // and the refused argument, or 0x7fff), so that no home waits for it. A
  // refused batch is spent on the refusing rank (its host refuses a retry):
  // no later signal of this batch's number follows the refusal.
  const bool stopped = ws.stopped(me);
  const uint64_t sig = stopped ? (MOE_EP_LL_SIG_NOT_SENT | (0xffffull << 48) | seq)
                       : p.refuse > 0
                           ? (MOE_EP_LL_SIG_NOT_SENT | ((uint64_t)(p.refuse - 1) << 48) | seq)
                           : seq;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  char* loc = local_set(p);
  const int32_t* counts = at<const int32_t>(loc, p.b.counts);
  const int32_t* off = at<const int32_t>(loc, p.b.em_off);
  const int4* y = static_cast<const int4*>(p.y);
  // Expert-major: the counted rows, in (expert, source) order; rank-major:
  // every (source, token) slot, those that did not come here skipped.
  const int n_items = sig != seq ? 0 : kExpertMajor ? off[E] : R * M;
  const int parts = parts_for(n_items, n16, nw);
  for (int it = gw; it < n_items * parts; it += nw) {
    const int i = it / parts, part = it % parts;
    int home, slot;
    size_t row;
    if (kExpertMajor) {
      const EmRow r = em_locate(p, off, i);
      home = r.s;
      slot = r.t * K + r.slot;
      row = r.row;
    } else {
      const int s = i / M, t = i % M;
      if (t >= counts[El + El * R + s]) continue;
      if (at<const int32_t>(sym_set(p, me), p.b.recv_src)[(size_t)i * 2] < 0) continue;
      home = s;
      slot = me * M + t;
      row = (size_t)i;
    }
    if (p.in_place && home == me) continue;  // read in y by the home's sum
    int c0, c1;
    piece(n16, part, parts, &c0, &c1);
    warp_copy(y + row * n16, at<int4>(sym_set(p, home), p.b.comb) + (size_t)slot * n16, c0, c1,
              lane);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int s = 0; s < R; ++s) {
      st_release_sys_u64(
          at<uint64_t>(sym_set(p, s), p.b.sig_combine) + me * MOE_EP_MAX_BLOCKS + blockIdx.x, sig);
    }
  }
}

// ============================================================================
// Combine, home: wait for every expert rank, then each token's sum.
// ============================================================================
template <bool kExpertMajor>
__device__ void ll_combine_recv(const LlParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int M = p.max_tokens, n16 = p.op.hidden / 8, T = p.op.num_tokens;
  const Ws ws = ws_of(p.op);
  if (ws.stopped(me)) return;
  const uint64_t seq = set_seq(p);
  const ErrSink err = ws.err(p.op.error, me);
  char* mine = sym_set(p, me);
  if (!wait_all_combine(mine + p.b.sig_combine, R, p.op.num_blocks, seq, p, err)) return;
  // An expert rank that sent no rows: it skipped the batch after an error,
  // or its host refused the call (the argument in bits 48..62).
  {
    bool sent = true;
    for (int i = threadIdx.x; i < R * p.op.num_blocks; i += blockDim.x) {
      const int s = i / p.op.num_blocks, b = i % p.op.num_blocks;
      const uint64_t v = ld_acquire_sys_u64(
          reinterpret_cast<const uint64_t*>(mine + p.b.sig_combine) + s * MOE_EP_MAX_BLOCKS + b);
      if ((v & MOE_EP_LL_SIG_NOT_SENT) != 0ull) {
        const int arg = (int)((v >> 48) & 0x7fffull);
        if (arg == 0x7fff) {
          report_error(err, MOE_EP_ERR_PEER_STOPPED, me, s, 0, 0, 0, 0, seq);
        } else {
          report_error(err, MOE_EP_ERR_REFUSED, me, s, arg, 0, 0, 0, seq);
        }
        sent = false;
      }
    }
    if (__syncthreads_and(sent) == 0) return;
  }
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  char* loc = local_set(p);
  const int32_t* home_topk = at<const int32_t>(loc, p.b.home_topk);
  const float* wts = p.comb_w != nullptr ? p.comb_w : at<const float>(loc, p.b.home_w);
  const int4* comb = at<const int4>(mine, p.b.comb);
  const int4* y = static_cast<const int4*>(p.y);  // in place: this rank's own rows
  const int32_t* home_row = at<const int32_t>(loc, p.b.home_row);
  int4* out = static_cast<int4*>(p.out);
  // Item (token t, chunk of 32 * kV vectors): each lane sums kV vectors, all
  // of their terms' loads issued together.
  constexpr int kV = 4;
  const int chunks = (n16 + 32 * kV - 1) / (32 * kV);
  for (int it = gw; it < T * chunks; it += nw) {
    const int t = it / chunks, c0 = (it % chunks) * 32 * kV;
    const int e = lane < K ? home_topk[(size_t)t * K + lane] : -1;
    unsigned terms = 0u;  // expert-major: slots k; rank-major: ranks d
    float w[MOE_EP_MAX_TOPK];
    int hrow[MOE_EP_MAX_TOPK];  // expert-major, in place: slot k's row in y, or -1
    if (kExpertMajor) {
      const float wl = lane < K ? wts[(size_t)t * K + lane] : 0.f;
      const bool here = p.in_place && e >= 0 && e / El == me;
      const int hr = here ? home_row[(size_t)t * K + lane] : -1;
      terms = __ballot_sync(0xffffffffu, e >= 0);
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
        w[k] = __shfl_sync(0xffffffffu, wl, k);
        hrow[k] = __shfl_sync(0xffffffffu, hr, k);
      }
    } else {
      const int dk = e >= 0 ? e / El : -1;
      for (int d = 0; d < R; ++d) {
        if (__ballot_sync(0xffffffffu, dk == d) != 0u) terms |= 1u << d;
      }
    }
    float acc[kV][8];
#pragma unroll
    for (int v = 0; v < kV; ++v) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[v][i] = 0.f;
    }
    // One term: kV vectors of row src, loads first, added as acc += w * x
    // (weighted) or acc + x.
    auto add_row = [&](const int4* src, float wk, bool weighted) {
      int4 x[kV];
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        const int c = c0 + v * 32 + lane;
        if (c < n16) x[v] = ld_v4(src + c);
      }
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        if (c0 + v * 32 + lane < n16) acc_v4(acc[v], x[v], wk, weighted);
      }
    };
    if (kExpertMajor) {
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
        if (!((terms >> k) & 1u)) continue;
        add_row(hrow[k] >= 0 ? y + (size_t)hrow[k] * n16 : comb + ((size_t)t * K + k) * n16, w[k],
                true);
      }
    } else {
      for (int d = 0; d < R; ++d) {
        if (!((terms >> d) & 1u)) continue;
        add_row((p.in_place && d == me) ? y + ((size_t)me * M + t) * n16
                                        : comb + ((size_t)d * M + t) * n16,
                1.f, false);
      }
    }
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const int c = c0 + v * 32 + lane;
      if (c < n16) st_na_v4(out + (size_t)t * n16 + c, pack_v4(acc[v]));
    }
  }
}

MOE_EP_ENTRY(moe_ep_ll_dispatch_send_i32, LlParams, ll_dispatch_send<int32_t>)
MOE_EP_ENTRY(moe_ep_ll_dispatch_send_i64, LlParams, ll_dispatch_send<long long>)
MOE_EP_ENTRY(moe_ep_ll_dispatch_recv_rank_major, LlParams, ll_dispatch_recv<false>)
MOE_EP_ENTRY(moe_ep_ll_dispatch_recv_expert_major, LlParams, ll_dispatch_recv<true>)
MOE_EP_ENTRY(moe_ep_ll_dispatch_copy_expert_major, LlParams, ll_dispatch_copy)
MOE_EP_ENTRY(moe_ep_ll_combine_send_rank_major, LlParams, ll_combine_send<false>)
MOE_EP_ENTRY(moe_ep_ll_combine_send_expert_major, LlParams, ll_combine_send<true>)
MOE_EP_ENTRY(moe_ep_ll_combine_recv_rank_major, LlParams, ll_combine_recv<false>)
MOE_EP_ENTRY(moe_ep_ll_combine_recv_expert_major, LlParams, ll_combine_recv<true>)
