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
// src/ops/low_latency.rs). Every wait is bounded (MOE_EP_CTR_LL_*).
//
// Rust launcher: src/ops/low_latency.rs (EpGroup::ll_dispatch*,
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
constexpr int kLlUnroll = 4;  // 16-byte vectors in flight per lane per row pass

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
// records it in the set for the set's later kernels.
__device__ uint64_t ll_next_seq(const LlParams& p) {
  __shared__ uint64_t s_seq;
  if (threadIdx.x == 0) {
    uint64_t* c = at<uint64_t>(p.b.local, p.b.counters) + blockIdx.x;
    s_seq = *c + 1;
    *c = s_seq;
    if (blockIdx.x == 0) *at<uint64_t>(local_set(p), p.b.set_seq) = s_seq;
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

// ---- sender: one token's row to every rank in dmask (a warp) ----
// bf16 rows, or the caller's fp8 rows (codes, then scales): copied as they are.
__device__ __forceinline__ void send_row_copy(const LlParams& p, int t, size_t row,
                                              unsigned dmask, int lane) {
  const int R = p.op.world, H = p.op.hidden;
  const bool fp8 = p.payload == MOE_EP_LL_FP8;
  const size_t rb = row_bytes(p);
  const int n16 = (int)(rb / 16);
  const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + (size_t)t * rb);
  for (int base = 0; base < n16; base += 32 * kLlUnroll) {
    int4 v[kLlUnroll];
#pragma unroll
    for (int i = 0; i < kLlUnroll; ++i) {
      const int c = base + i * 32 + lane;
      if (c < n16) v[i] = ld_nc_v4(src + c);
    }
    for (int d = 0; d < R; ++d) {
      if (!((dmask >> d) & 1u)) continue;
      int4* dst = reinterpret_cast<int4*>(sym_set(p, d) + p.b.recv_x + row * rb);
#pragma unroll
      for (int i = 0; i < kLlUnroll; ++i) {
        const int c = base + i * 32 + lane;
        if (c < n16) st_na_v4(dst + c, v[i]);
      }
    }
  }
  if (fp8) {
    const int nb = H / MOE_EP_FP8_BLOCK;
    for (int c = lane; c < nb; c += 32) {
      const float sc = p.x_scales[(size_t)t * nb + c];
      for (int d = 0; d < R; ++d) {
        if ((dmask >> d) & 1u) at<float>(sym_set(p, d), p.b.recv_scales)[row * nb + c] = sc;
      }
    }
  }
}

// bf16 rows cast to fp8 on the way: a half warp per block of 128 values
// (8 per lane), the block's amax by shuffles, one scale per block.
__device__ __forceinline__ void send_row_cast(const LlParams& p, int t, size_t row,
                                              unsigned dmask, int lane) {
  const int R = p.op.world, H = p.op.hidden, n16 = H / 8, nb = H / MOE_EP_FP8_BLOCK;
  const bool pow2 = p.cast == MOE_EP_LL_CAST_POW2;
  const int4* src = reinterpret_cast<const int4*>(p.x) + (size_t)t * n16;
  for (int base = 0; base < n16; base += 32) {
    const int c = base + lane;  // this lane's 8 values; block c / 16
    const bool act = c < n16;   // n16 is a multiple of 16: whole half warps
    const int4 v = act ? ld_nc_v4(src + c) : make_int4(0, 0, 0, 0);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
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

}  // namespace

// ============================================================================
// Dispatch, sender.
// ============================================================================
template <typename Idx>
__device__ void ll_dispatch_send(const LlParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int T = p.op.num_tokens, M = p.max_tokens;
  const Ws ws = ws_of(p.op);
  if (ws.stopped(me)) return;  // an error every rank found: skip, in step with every rank
  __shared__ unsigned long long s_bad;
  if (threadIdx.x == 0) s_bad = 0ull;
  const uint64_t seq = ll_next_seq(p);  // (its barrier publishes s_bad)
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const Idx* idx = static_cast<const Idx*>(p.topk_idx);
  char* loc = local_set(p);
  int32_t* home_topk = at<int32_t>(loc, p.b.home_topk);
  float* home_w = at<float>(loc, p.b.home_w);

  for (int t = gw; t < T; t += nw) {
    // Routing, lane k = slot k: an id outside [-1, E) or one an earlier slot
    // already named is reported (the lowest such slot of the lowest token,
    // by every receiver) and not routed.
    const long long v = lane < K ? (long long)idx[(size_t)t * K + lane] : -1ll;
    int code = (lane < K && (v < -1 || v >= E)) ? MOE_EP_ERR_BAD_EXPERT : 0;
    for (int k2 = 0; k2 + 1 < K; ++k2) {
      const long long o = __shfl_sync(0xffffffffu, v, k2);
      if (code == 0 && k2 < lane && lane < K && v >= 0 && o == v) code = MOE_EP_ERR_DUP_EXPERT;
    }
    const unsigned bad_lanes = __ballot_sync(0xffffffffu, code != 0);
    if (bad_lanes != 0u && lane == __ffs(bad_lanes) - 1) {
      atomicMax(&s_bad, bad_entry_word(t, lane, code, v));
    }
    const int e = (lane < K && code == 0) ? (int)v : -1;
    const float w = lane < K ? p.topk_w[(size_t)t * K + lane] : 0.f;
    if (lane < K) {
      home_topk[(size_t)t * K + lane] = e;
      home_w[(size_t)t * K + lane] = w;
    }
    const int dk = e >= 0 ? e / El : -1;
    unsigned dmask = 0u;
    for (int d = 0; d < R; ++d) {
      if (__ballot_sync(0xffffffffu, dk == d) != 0u) dmask |= 1u << d;
    }
    // Every receiver learns all T rows of mine: slots, weights, source.
    const size_t row = (size_t)me * M + t;
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
    // The row itself, once per rank that hosts one of the token's experts.
    if (dmask != 0u) {
      if (p.cast != MOE_EP_LL_CAST_NONE) {
        send_row_cast(p, t, row, dmask, lane);
      } else {
        send_row_copy(p, t, row, dmask, lane);
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
      vg->num_tokens = T;
      vg->topk = K;
      vg->payload = p.payload;
      vg->layout = (int32_t)p.op.layout;
      st_release_sys_u64(&g->seq, seq);
    }
  }
}

// ============================================================================
// Dispatch, receiver.
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
  if (!wait_all(reinterpret_cast<const char*>(sig), sizeof(LlSignal), R, nb, seq, p, err,
                MOE_EP_CTR_LL_DISPATCH)) {
    return;
  }

  // The verdict, from the signals alone (the same on every rank): ranks
  // that disagree (topk, layout, payload), then the lowest rank's first bad
  // routing entry. Either stops every rank's kernels from here on.
  __shared__ int s_code;
  __shared__ int s_tokens[MOE_EP_MAX_RANKS];
  if (threadIdx.x == 0) {
    int code = 0;
    const int32_t want[3] = {K, (int32_t)p.op.layout, p.payload};
    const int field[3] = {MOE_EP_FIELD_TOPK, MOE_EP_FIELD_LAYOUT, MOE_EP_FIELD_PAYLOAD};
    for (int s = 0; s < R && code == 0; ++s) {
      for (int b = 0; b < nb && code == 0; ++b) {
        const volatile LlSignal* g = sig + s * MOE_EP_MAX_BLOCKS + b;
        const int32_t got[3] = {g->topk, g->layout, g->payload};
        for (int f = 0; f < 3 && code == 0; ++f) {
          if (got[f] != want[f]) {
            code = MOE_EP_ERR_MISMATCH;
            report_error(err, code, me, s, field[f], (uint64_t)(int64_t)want[f],
                         (uint64_t)(int64_t)got[f], 0, 0);
          }
        }
      }
    }
    for (int s = 0; s < R && code == 0; ++s) {
      unsigned long long w = 0ull;
      for (int b = 0; b < nb; ++b) {
        const unsigned long long x = (sig + s * MOE_EP_MAX_BLOCKS + b)->bad;
        w = x > w ? x : w;
      }
      if (w != 0ull) {
        const unsigned long long key = ~w;
        code = (int)((key >> 32) & 0xfu);
        const int64_t v = (int32_t)(uint32_t)key;
        report_error(err, code, me, s, 0, code == MOE_EP_ERR_BAD_EXPERT ? (uint64_t)E : 0,
                     (uint64_t)v, key >> 40, (key >> 36) & 0xfu);
      }
    }
    if (code != 0) *ws.status(me) = (unsigned long long)code;
    s_code = code;
    for (int s = 0; s < R; ++s) s_tokens[s] = sig[s * MOE_EP_MAX_BLOCKS].num_tokens;
  }
  __syncthreads();
  if (s_code != 0) return;

  // Counts: [El] per local expert, [El * R] per (expert, source), [R] per source.
  int32_t* counts = at<int32_t>(loc, p.b.counts);
  if (blockIdx.x == 0 && threadIdx.x < R) counts[El + El * R + threadIdx.x] = s_tokens[threadIdx.x];

  // Per local expert j (a block each): its (source, token) pairs in order,
  // by a block-wide scan over each source's tokens; expert-major copies the
  // rows into the expert's block as it goes.
  const int32_t* ridx = at<const int32_t>(mine, p.b.recv_idx);
  const bool fp8 = p.payload == MOE_EP_LL_FP8;
  const size_t rb = row_bytes(p);
  const int n16 = (int)(rb / 16), nbk = p.op.hidden / MOE_EP_FP8_BLOCK;
  int32_t* em_src = at<int32_t>(loc, p.b.em_src);
  int32_t* em_slot = at<int32_t>(loc, p.b.em_slot);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ int scratch[33];
  __shared__ int2 s_rows[MOE_EP_THREADS];  // (expert-major row, staging row)
  for (int j = blockIdx.x; j < El; j += gridDim.x) {
    int running = 0;
    for (int s = 0; s < R; ++s) {
      const int Ts = s_tokens[s];
      int from_s = 0;
      for (int t0 = 0; t0 < Ts; t0 += blockDim.x) {
        const int t = t0 + threadIdx.x;
        int slot = -1;
        if (t < Ts) {
          const int32_t* li = ridx + ((size_t)s * M + t) * K;
          for (int k = 0; k < K; ++k) {
            if (li[k] == j) slot = k;
          }
        }
        int total;
        const int pos = block_exclusive_scan(slot >= 0 ? 1 : 0, scratch, &total);
        if (kExpertMajor && slot >= 0) {
          const int row = j * R * M + running + pos;
          em_src[(size_t)row * 2] = s;
          em_src[(size_t)row * 2 + 1] = t;
          em_slot[row] = slot;
          s_rows[pos] = make_int2(row, s * M + t);
        }
        running += total;
        from_s += total;
        if (kExpertMajor) {
          __syncthreads();
          for (int i = warp; i < total; i += kWarps) {
            const int2 rr = s_rows[i];
            const int4* src = reinterpret_cast<const int4*>(mine + p.b.recv_x + (size_t)rr.y * rb);
            int4* dst = reinterpret_cast<int4*>(loc + p.b.em_x + (size_t)rr.x * rb);
            for (int c = lane; c < n16; c += 32) st_na_v4(dst + c, ld_v4(src + c));
            if (fp8) {
              const float* ss = at<const float>(mine, p.b.recv_scales) + (size_t)rr.y * nbk;
              float* ds = at<float>(loc, p.b.em_scales) + (size_t)rr.x * nbk;
              for (int c = lane; c < nbk; c += 32) ds[c] = ss[c];
            }
          }
          __syncthreads();
        }
      }
      if (threadIdx.x == 0) counts[El + j * R + s] = from_s;
    }
    if (threadIdx.x == 0) counts[j] = running;
  }
}

// ============================================================================
// Combine, expert rank: every counted row home, then a signal to every home.
// ============================================================================
template <bool kExpertMajor>
__device__ void ll_combine_send(const LlParams& p) {
  const int R = p.op.world, E = p.op.num_experts, El = E / R, K = p.op.topk, me = p.op.rank;
  const int M = p.max_tokens, n16 = p.op.hidden / 8, RM = R * M;
  const Ws ws = ws_of(p.op);
  if (ws.stopped(me)) return;
  const uint64_t seq = set_seq(p);
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  char* loc = local_set(p);
  const int32_t* counts = at<const int32_t>(loc, p.b.counts);
  const int4* y = static_cast<const int4*>(p.y);
  const int n_items = kExpertMajor ? El * RM : RM;
  for (int i = gw; i < n_items; i += nw) {
    int home, slot;
    if (kExpertMajor) {
      const int j = i / RM, r = i % RM;
      if (r >= counts[j]) continue;
      const int32_t* src = at<const int32_t>(loc, p.b.em_src) + (size_t)i * 2;
      home = src[0];
      slot = src[1] * K + at<const int32_t>(loc, p.b.em_slot)[i];
    } else {
      const int s = i / M, t = i % M;
      if (t >= counts[El + El * R + s]) continue;
      if (at<const int32_t>(sym_set(p, me), p.b.recv_src)[(size_t)i * 2] < 0) continue;
      home = s;
      slot = me * M + t;
    }
    const int4* src = y + (size_t)i * n16;
    int4* dst = at<int4>(sym_set(p, home), p.b.comb) + (size_t)slot * n16;
    for (int base = 0; base < n16; base += 32 * kLlUnroll) {
      int4 v[kLlUnroll];
#pragma unroll
      for (int u = 0; u < kLlUnroll; ++u) {
        const int c = base + u * 32 + lane;
        if (c < n16) v[u] = ld_nc_v4(src + c);
      }
#pragma unroll
      for (int u = 0; u < kLlUnroll; ++u) {
        const int c = base + u * 32 + lane;
        if (c < n16) st_na_v4(dst + c, v[u]);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int s = 0; s < R; ++s) {
      st_release_sys_u64(
          at<uint64_t>(sym_set(p, s), p.b.sig_combine) + me * MOE_EP_MAX_BLOCKS + blockIdx.x, seq);
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
  if (!wait_all(mine + p.b.sig_combine, sizeof(uint64_t), R, p.op.num_blocks, seq, p, err,
                MOE_EP_CTR_LL_COMBINE)) {
    return;
  }
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  char* loc = local_set(p);
  const int32_t* home_topk = at<const int32_t>(loc, p.b.home_topk);
  const float* wts = p.comb_w != nullptr ? p.comb_w : at<const float>(loc, p.b.home_w);
  const int4* comb = at<const int4>(mine, p.b.comb);
  int4* out = static_cast<int4*>(p.out);
  for (int t = gw; t < T; t += nw) {
    const int e = lane < K ? home_topk[(size_t)t * K + lane] : -1;
    // NOTE: the terms are gathered with full-warp ballots and shuffles
    // before the vector loop, where lanes may leave early.
    unsigned terms = 0u;  // expert-major: slots k; rank-major: ranks d
    float w[MOE_EP_MAX_TOPK];
    if (kExpertMajor) {
      const float wl = lane < K ? wts[(size_t)t * K + lane] : 0.f;
      terms = __ballot_sync(0xffffffffu, e >= 0);
#pragma unroll
      for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) w[k] = __shfl_sync(0xffffffffu, wl, k);
    } else {
      const int dk = e >= 0 ? e / El : -1;
      for (int d = 0; d < R; ++d) {
        if (__ballot_sync(0xffffffffu, dk == d) != 0u) terms |= 1u << d;
      }
    }
    for (int c = lane; c < n16; c += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (kExpertMajor) {
#pragma unroll
        for (int k = 0; k < MOE_EP_MAX_TOPK; ++k) {
          if ((terms >> k) & 1u) {
            acc_v4(acc, ld_v4(comb + ((size_t)t * K + k) * n16 + c), w[k], true);
          }
        }
      } else {
        for (int d = 0; d < R; ++d) {
          if ((terms >> d) & 1u) {
            acc_v4(acc, ld_v4(comb + ((size_t)d * M + t) * n16 + c), 1.f, false);
          }
        }
      }
      st_na_v4(out + (size_t)t * n16 + c, pack_v4(acc));
    }
  }
}

MOE_EP_ENTRY(moe_ep_ll_dispatch_send_i32, LlParams, ll_dispatch_send<int32_t>)
MOE_EP_ENTRY(moe_ep_ll_dispatch_send_i64, LlParams, ll_dispatch_send<long long>)
MOE_EP_ENTRY(moe_ep_ll_dispatch_recv_rank_major, LlParams, ll_dispatch_recv<false>)
MOE_EP_ENTRY(moe_ep_ll_dispatch_recv_expert_major, LlParams, ll_dispatch_recv<true>)
MOE_EP_ENTRY(moe_ep_ll_combine_send_rank_major, LlParams, ll_combine_send<false>)
MOE_EP_ENTRY(moe_ep_ll_combine_send_expert_major, LlParams, ll_combine_send<true>)
MOE_EP_ENTRY(moe_ep_ll_combine_recv_rank_major, LlParams, ll_combine_recv<false>)
MOE_EP_ENTRY(moe_ep_ll_combine_recv_expert_major, LlParams, ll_combine_recv<true>)
