// Small kernels for tests and the benchmark's baselines: a pattern writer and
// checker (symmetric-memory tests), the SM copy loop that measures the
// peer-store and peer-load ceilings, the bulk (TMA) copy loop that
// measures the bulk-copy ceilings and the row fan-out / fan-in loop that
// measures the local-copy ceilings (ep-bench).
//
// Rust launchers: src/testkit/copy.rs (feature testkit). Tests:
// tests/gpu_symm.rs (patterns through peers' memory),
// tools/ep-bench/tests/gpu_bench.rs (ep-bench's baselines; the fan copy's
// rows against the CPU).
#include <stdint.h>

#include "common.cuh"

__device__ __forceinline__ uint32_t pattern(uint32_t seed, uint32_t i) {
  uint32_t h = seed * 0x9E3779B9u ^ (i + 0x7F4A7C15u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// dst[i] = pattern(seed, i) for i < n; dst may be a peer's buffer.
extern "C" __global__ void moe_ep_fill_pattern(uint32_t* dst, uint64_t n, uint32_t seed) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    dst[i] = pattern(seed, (uint32_t)i);
  }
}

// Counts i < n with src[i] != pattern(seed, i) into *mismatches.
extern "C" __global__ void moe_ep_check_pattern(const uint32_t* src, uint64_t n, uint32_t seed,
                                                unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    bad += src[i] != pattern(seed, (uint32_t)i);
  }
  bad = warp_sum(bad);
  if ((threadIdx.x & 31) == 0 && bad) atomicAdd(mismatches, bad);
}

// The peer-store ceiling: 16-byte loads from local memory, 16-byte stores to
// `dst` (a peer's buffer), n16 vectors, grid-stride, kUnroll in flight. With
// `src` a peer's buffer and `dst` local: the peer-load ceiling.
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_copy_v4(const int4* src, int4* dst, uint64_t n16) {
  constexpr int kUnroll = 4;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n16; i += kUnroll * stride) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_nc_v4(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_na_v4(dst + i + u * stride, v[u]);
  }
  for (; i < n16; i += stride) st_na_v4(dst + i, ld_nc_v4(src + i));
}

// The local-copy ceilings: rows moved on one GPU as an op moves them, by SM
// loads and stores. `src` holds src_rows rows, `dst` dst_rows rows, both of
// `vecs` 16-byte vectors.
//   fan-out (dst_rows >= src_rows, as dispatch): source row i is read once
//     and stored into dst rows [i * D / S, (i + 1) * D / S) (D / S of them,
//     rounded down or up; together every dst row exactly once). Without
//     source rows every dst row is stored as zeros.
//   fan-in (src_rows > dst_rows, as combine): dst row j is stored once, the
//     xor of src rows [j * S / D, (j + 1) * S / D), so every source byte is
//     read and none is skipped.
// Bytes: src_rows * vecs * 16 read, dst_rows * vecs * 16 written (fan-in
// with no dst row reads nothing).
// One warp per outer row (fan-out: a src row; fan-in: a dst row), grid-stride
// over the grid's warps; per lane kInFlight vectors loaded before any is used.
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_fan_copy_v4(const int4* src, int4* dst, uint64_t src_rows, uint64_t dst_rows,
                       uint64_t vecs) {
  constexpr int kInFlight = 8;
  constexpr uint32_t kWarp = 32;
  const uint32_t lane = threadIdx.x % kWarp;
  const uint64_t warps = (uint64_t)gridDim.x * (blockDim.x / kWarp);
  const uint64_t first = blockIdx.x * (uint64_t)(blockDim.x / kWarp) + threadIdx.x / kWarp;
  const bool fan_out = dst_rows >= src_rows;
  if (fan_out) {
    // ---- fan-out: one load of each source vector, one store per dst row ----
    constexpr uint64_t kSpan = kWarp * kInFlight;
    const uint64_t outer = src_rows ? src_rows : dst_rows;
    for (uint64_t r = first; r < outer; r += warps) {
      const uint64_t lo = src_rows ? r * dst_rows / src_rows : r;
      const uint64_t hi = src_rows ? (r + 1) * dst_rows / src_rows : r + 1;
      const int4* row = src + r * vecs;
      for (uint64_t v0 = lane; v0 < vecs; v0 += kSpan) {
        int4 x[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          const uint64_t v = v0 + u * kWarp;
          x[u] = src_rows && v < vecs ? ld_nc_v4(row + v) : make_int4(0, 0, 0, 0);
        }
        for (uint64_t d = lo; d < hi; ++d) {
#pragma unroll
          for (int u = 0; u < kInFlight; ++u) {
            const uint64_t v = v0 + u * kWarp;
            if (v < vecs) st_na_v4(dst + d * vecs + v, x[u]);
          }
        }
      }
    }
    return;
  }
  // ---- fan-in: source rows two at a time, kInFlight / 2 vectors of each ----
  constexpr int kPer = kInFlight / 2;
  constexpr uint64_t kSpan = kWarp * kPer;
  auto fold = [](int4& acc, int4 y) {
    acc.x ^= y.x;
    acc.y ^= y.y;
    acc.z ^= y.z;
    acc.w ^= y.w;
  };
  for (uint64_t r = first; r < dst_rows; r += warps) {
    const uint64_t lo = r * src_rows / dst_rows;
    const uint64_t hi = (r + 1) * src_rows / dst_rows;
    for (uint64_t v0 = lane; v0 < vecs; v0 += kSpan) {
      int4 acc[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) acc[u] = make_int4(0, 0, 0, 0);
      uint64_t s = lo;
      for (; s + 1 < hi; s += 2) {
        int4 a[kPer], b[kPer];
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
          const uint64_t v = v0 + u * kWarp;
          if (v < vecs) {
            a[u] = ld_nc_v4(src + s * vecs + v);
            b[u] = ld_nc_v4(src + (s + 1) * vecs + v);
          }
        }
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
          if (v0 + u * kWarp < vecs) {
            fold(acc[u], a[u]);
            fold(acc[u], b[u]);
          }
        }
      }
      if (s < hi) {
        int4 a[kPer];
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
          const uint64_t v = v0 + u * kWarp;
          if (v < vecs) a[u] = ld_nc_v4(src + s * vecs + v);
        }
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
          if (v0 + u * kWarp < vecs) fold(acc[u], a[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const uint64_t v = v0 + u * kWarp;
        if (v < vecs) st_na_v4(dst + r * vecs + v, acc[u]);
      }
    }
  }
}

// The bulk-copy ceiling: the same bytes moved by the SMs' bulk-copy (TMA)
// units instead of their threads. One thread per block walks pieces of
// MOE_EP_BULK_VECS * 512 bytes (grid-stride): global -> shared (a ring of
// MOE_EP_COMBINE_SMEM bytes of dynamic shared memory, loads half the ring
// ahead) -> `dst`. The pattern of the combine pusher, without its per-row
// bookkeeping.
extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)
    moe_ep_bulk_copy(const char* src, char* dst, uint64_t bytes) {
  constexpr int kBufs = MOE_EP_BULK_BUFS, kAhead = MOE_EP_BULK_AHEAD;
  constexpr uint32_t kSlot = MOE_EP_BULK_VECS * 512;
  __shared__ uint64_t bar[kBufs];
  extern __shared__ __align__(128) unsigned char ring[];
  if (threadIdx.x != 0) return;
  for (int b = 0; b < kBufs; ++b) mbar_init(&bar[b], 1);
  fence_mbar_init();
  const uint64_t pieces = (bytes + kSlot - 1) / kSlot;
  const uint64_t mine = pieces > blockIdx.x ? (pieces - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto piece = [&](uint64_t g, uint32_t* len) {
    const uint64_t off = (blockIdx.x + g * gridDim.x) * (uint64_t)kSlot;
    *len = (uint32_t)min((uint64_t)kSlot, bytes - off);
    return off;
  };
  uint32_t phase = 0;
  for (uint64_t g = 0; g < mine + kAhead; ++g) {
    if (g < mine) {
      if (g >= kBufs) bulk_wait_read<kBufs - kAhead - 1>();
      uint32_t len;
      const uint64_t off = piece(g, &len);
      const int b = g % kBufs;
      mbar_expect_tx(&bar[b], len);
      bulk_load(ring + b * kSlot, src + off, len, &bar[b]);
    }
    if (g < kAhead) continue;
    const uint64_t gs = g - kAhead;
    if (gs >= mine) continue;
    uint32_t len;
    const uint64_t off = piece(gs, &len);
    const int b = gs % kBufs;
    while (!mbar_try_wait(&bar[b], (phase >> b) & 1u)) {
    }
    phase ^= 1u << b;
    bulk_store(dst + off, ring + b * kSlot, len);
    bulk_commit();
  }
  bulk_wait<0>();
}
