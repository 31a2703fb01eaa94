// Device primitives named by their PTX meaning (scope and ordering), and the
// bounded wait every kernel uses on flags that other GPUs write.
#pragma once
#include <stdint.h>

#include "abi.cuh"

#define MOE_EP_DEVICE __device__ __forceinline__

// ---- memory ordering across GPUs (system scope: peers write over NVLink) ----
MOE_EP_DEVICE void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MOE_EP_DEVICE uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MOE_EP_DEVICE void st_relaxed_sys_s32(int32_t* p, int32_t v) {
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
MOE_EP_DEVICE int32_t ld_relaxed_sys_s32(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MOE_EP_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ---- bulk data: 16-byte vectors ----
// NOTE: the loads are not `volatile`, so the compiler may hoist several of
// them ahead of the stores and keep them in flight; ordering against peers'
// writes comes from the acquire + barrier that precede every use.
// Local inputs that no one writes during the kernel: non-coherent path, no L1 allocation.
MOE_EP_DEVICE int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
// Data written by peers (after an acquire): plain coherent load, no L1 allocation.
MOE_EP_DEVICE int4 ld_v4(const int4* p) {
  int4 v;
  asm("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
// Stores into a peer's (or our own) buffer.
MOE_EP_DEVICE void st_na_v4(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Asks L2 to fetch [p, p + bytes) now (bytes: a multiple of 16, p 16-byte
// aligned); no registers held, no completion to wait for. Measured on and
// off (2 x H200, 4096 tokens, rank-major; docs/perf-log/2026-11-30.md): no
// clear change up to a9cf28f; at d9131bf the dispatch without it 204 / 214
// / 199 µs against 190 / 221 / 205 with it at 16 / 24 / 32 SMs.
MOE_EP_DEVICE void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
}

// ---- bulk asynchronous copies (TMA, sm_90) ----
// A row piece goes global -> shared -> global without passing through
// registers: one lane issues, the copy engine of the SM moves the bytes.
MOE_EP_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
MOE_EP_DEVICE void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialised mbarriers visible to the async proxy (then a CTA barrier).
MOE_EP_DEVICE void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
MOE_EP_DEVICE void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
MOE_EP_DEVICE bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// One arrival without bytes (release: this thread's earlier accesses come first).
MOE_EP_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// global -> shared, completion counted on `bar` (expect_tx first).
MOE_EP_DEVICE void bulk_load(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(smem_dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// shared -> global (local or a peer's memory), in the current bulk group.
MOE_EP_DEVICE void bulk_store(void* dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}
MOE_EP_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// All but the newest N committed stores have read their shared sources.
template <int N>
MOE_EP_DEVICE void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// All but the newest N committed stores are complete (written), then
// ordered before this thread's later generic accesses (e.g. a release flag).
template <int N>
MOE_EP_DEVICE void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

MOE_EP_DEVICE uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// ---- errors ----
// A rank's status word (Ws::status): 0, or why its kernels stop: the error's
// code (bits 0..7), the rank it names (8..15: the root of a chain, so that
// a peer that stopped because of a refusal or a timeout elsewhere passes
// that rank on), and 16..31 the argument of a refusal, the root's code of a
// stop, else the field or counter.
MOE_EP_DEVICE unsigned long long status_word(int code, int peer, int counter, uint64_t seen) {
  const unsigned aux = code == MOE_EP_ERR_PEER_STOPPED ? (unsigned)(seen & 0xffu) : (unsigned)counter;
  return (unsigned long long)(code & 0xff) | ((unsigned long long)(peer & 0xff) << 8) |
         ((unsigned long long)(aux & 0xffffu) << 16);
}
// Where kernels report: a claim word in device memory (first error wins, by
// an atomic there) and the report itself in host-mapped memory, written with
// plain stores by the one winning thread (no atomics on host memory, which
// not every platform supports). The host clears both. Every error also sets
// the rank's status word (`status`, when given): the rank's later kernels
// then skip at entry, telling their peers so (MOE_EP_OP_STOPPED), until the
// host clears it (EpGroup::check).
struct ErrSink {
  ErrorInfo* host;
  unsigned long long* claim;
  unsigned long long* status;
};
MOE_EP_DEVICE void report_error(const ErrSink& e, int code, int rank, int peer, int counter,
                                uint64_t expected, uint64_t seen, uint64_t needed,
                                uint64_t capacity) {
  if (e.host == nullptr || e.claim == nullptr) return;
  if (atomicCAS(e.claim, 0ull, (unsigned long long)code) != 0ull) return;
  if (e.status != nullptr) atomicCAS(e.status, 0ull, status_word(code, peer, counter, seen));
  volatile ErrorInfo* h = e.host;
  h->rank = rank;
  h->peer = peer;
  h->counter = counter;
  h->expected = expected;
  h->seen = seen;
  h->needed = needed;
  h->capacity = capacity;
  __threadfence_system();
  h->code = code;
  __threadfence_system();
}
// A peer's first-bad-entry word `w` (bad_entry_word, nonzero; from rank s)
// reported as the error it names (MOE_EP_ERR_BAD_EXPERT, bounded by the
// E experts, or MOE_EP_ERR_DUP_EXPERT), or, naming neither, as bad peer
// data (MOE_EP_FIELD_BAD_ENTRY, the word as seen). Returns the code.
MOE_EP_DEVICE int report_bad_entry(const ErrSink& err, int me, int s, unsigned long long w,
                                   int E) {
  const unsigned long long key = ~w;
  const int code = (int)((key >> 32) & 0xfu);
  if (code != MOE_EP_ERR_BAD_EXPERT && code != MOE_EP_ERR_DUP_EXPERT) {
    report_error(err, MOE_EP_ERR_BAD_PEER_DATA, me, s, MOE_EP_FIELD_BAD_ENTRY, 0, w, 0, 0);
    return MOE_EP_ERR_BAD_PEER_DATA;
  }
  const int64_t v = (int32_t)(uint32_t)key;
  report_error(err, code, me, s, 0, code == MOE_EP_ERR_BAD_EXPERT ? (uint64_t)E : 0,
               (uint64_t)v, key >> 40, (key >> 36) & 0xfu);
  return code;
}
// An error was recorded here, or the host aborted the communicator (it
// writes MOE_EP_ERR_ABORTED into the host-mapped report, read here over
// PCIe; the waits below look only every kCheckEvery polls).
MOE_EP_DEVICE bool has_error(const ErrSink& e) {
  if (e.claim != nullptr && *reinterpret_cast<volatile unsigned long long*>(e.claim) != 0ull) {
    return true;
  }
  return e.host != nullptr && reinterpret_cast<volatile ErrorInfo*>(e.host)->code != 0;
}

// The waits below look at the error word and the clock only every
// kCheckEvery polls (their clock starts at the first look): a waiting thread
// then loads little besides its flag. (Measured on 2 x H200: no change in
// speed either way; the timeout is reported as before.)
constexpr uint32_t kCheckEvery = 64;

// True once more than timeout_ns passed since the first call (*start == 0).
MOE_EP_DEVICE bool timed_out(uint64_t* start, uint64_t timeout_ns) {
  const uint64_t now = globaltimer_ns();
  if (*start == 0) *start = now;
  return now - *start > timeout_ns;
}

// Bounded wait: spins until *flag >= target, or reports a timeout naming the
// peer and counter and returns false. Call from one thread per flag.
MOE_EP_DEVICE bool wait_at_least(const uint64_t* flag, uint64_t target, uint64_t timeout_ns,
                                 const ErrSink& err, int rank, int peer, int counter) {
  uint64_t start = 0;
  for (uint32_t i = 1;; ++i) {
    const uint64_t v = ld_acquire_sys_u64(flag);
    if (v >= target) return true;
    if (i % kCheckEvery == 0) {
      if (has_error(err)) return false;  // another thread already gave up
      if (timed_out(&start, timeout_ns)) {
        report_error(err, MOE_EP_ERR_TIMEOUT, rank, peer, counter, target, v, 0, 0);
        return false;
      }
    }
    __nanosleep(32);
  }
}

// Bounded wait for the phase `parity` of a local mbarrier (bulk copies in
// flight): a copy that never lands is reported as a timeout on `counter`.
// NOTE: its bound is twice the group's timeout: such a wait is often behind
// a wait for a peer in another warp (a stage that warp was to fill), which
// names the rank that did not come first.
MOE_EP_DEVICE bool mbar_wait(uint64_t* bar, uint32_t parity, uint64_t timeout_ns,
                             const ErrSink& err, int rank, int counter) {
  uint64_t start = 0;
  for (uint32_t i = 1;; ++i) {
    if (mbar_try_wait(bar, parity)) return true;
    if (i % kCheckEvery == 0) {
      if (has_error(err)) return false;
      if (timed_out(&start, 2 * timeout_ns)) {
        report_error(err, MOE_EP_ERR_TIMEOUT, rank, rank, counter, parity, 0, 0, 0);
        return false;
      }
    }
  }
}

// ---- block-wide helpers ----
template <typename T>
MOE_EP_DEVICE T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Exclusive prefix sum of one value per thread over the block; returns the
// thread's exclusive prefix and writes the block total to *total.
// scratch: >= 33 values of shared memory.
template <typename T>
MOE_EP_DEVICE T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  T incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    T n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    T w = lane < nwarps ? scratch[lane] : T(0);
    T wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      T n = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += n;
    }
    if (lane < nwarps) scratch[lane] = wi - w;  // exclusive prefix of warps
    if (lane == 31) scratch[32] = wi;           // total
  }
  __syncthreads();
  T r = scratch[warp] + incl - v;
  *total = scratch[32];
  __syncthreads();
  return r;
}
