// Device helpers the NVLink (intra-node) kernels share: the workspace as
// mapped here (Ws), the per-op sequence counters and work-item claims, row
// pieces, bf16 <-> f32 on 16-byte vectors, the one reduction order of every
// combine, and the macros that stamp an entry point per path.
//
// Included by layout.cu, dispatch.cu, combine_pull.cu and combine_push.cu
// (one module each); everything here has internal linkage.
#pragma once
#include <cuda_bf16.h>

#include "abi.cuh"
#include "common.cuh"

// One entry point NAME (grid-constant PARAMS p) that runs BODY(p); BODY may
// be a template with its arguments (the last macro argument takes commas).
#define MOE_EP_ENTRY(NAME, PARAMS, ...)                                              \
  extern "C" __global__ void __launch_bounds__(MOE_EP_THREADS)                       \
      NAME(const __grid_constant__ PARAMS p) {                                       \
    __VA_ARGS__(p);                                                                  \
  }
// NAME_r2, NAME_r4, NAME_r8: BODY<bound on the world, ARGS...> (the launcher
// picks the smallest bound that fits, so the home's loads of every rank's
// partial stay in registers).
#define MOE_EP_ENTRIES_BY_WORLD(NAME, PARAMS, BODY, ...)  \
  MOE_EP_ENTRY(NAME##_r2, PARAMS, BODY<2, __VA_ARGS__>)   \
  MOE_EP_ENTRY(NAME##_r4, PARAMS, BODY<4, __VA_ARGS__>)   \
  MOE_EP_ENTRY(NAME##_r8, PARAMS, BODY<8, __VA_ARGS__>)

namespace {

constexpr int kWarps = MOE_EP_THREADS / 32;

// Work items of dispatch and combine are (row, piece): a piece is up to
// kPiece 16-byte vectors per lane (registers in flight), every piece of a
// row the same size. (4, 6 and 8 measured alike: BENCHMARKS.md.)
constexpr int kPiece = 8;

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
  // On rank r: the descriptor rank `src` published for the call of this
  // parity (the call number's low bit; every op of the group counts): 8
  // words, the last the call's number (written last, released).
  __device__ uint64_t* desc(int r, int parity, int src) const {
    return reinterpret_cast<uint64_t*>(base[r] + w.desc_off) +
           ((size_t)(parity * MOE_EP_MAX_RANKS + src) * 8);
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
  // block. [3][0] is the error claim word (see ErrSink), [3][1..6] the
  // item counters (claims), [3][8] the status word (status()), [3][10] the
  // layout scan's arrivals (layout_arrivals()). [4]: the group's calls
  // (next_call), one per block.
  __device__ uint64_t* seq(int which, int me) const {
    return reinterpret_cast<uint64_t*>(base[me] + w.seq_off) + which * MOE_EP_MAX_BLOCKS;
  }
  __device__ ErrSink err(ErrorInfo* host, int me) const {
    return ErrSink{host, reinterpret_cast<unsigned long long*>(seq(3, me)), status(me)};
  }
  // The rank's status: 0, or the code of an error that every rank found in
  // the same layout exchange (bad routing on some rank, ranks that disagree,
  // capacity). Written only by the exchange kernel; while it is set every
  // kernel of the group returns at entry, before its sequence counter moves,
  // so all ranks skip the same work and stay in step. The host clears it
  // (EpGroup::check).
  __device__ unsigned long long* status(int me) const {
    return reinterpret_cast<unsigned long long*>(seq(3, me)) + 8;
  }
  // Blocks of the current layout scan that have finished their part ([3][10]):
  // the last one resets it to 0 and runs the exchange.
  __device__ unsigned long long* layout_arrivals(int me) const {
    return reinterpret_cast<unsigned long long*>(seq(3, me)) + 10;
  }
  __device__ bool stopped(int me) const {
    return *reinterpret_cast<volatile unsigned long long*>(status(me)) != 0ull;
  }
  // Work-item counters of op `which` (1 dispatch, 2 combine): [3][1..4],
  // two per op, alternating with the op's sequence number (see ItemClaims).
  __device__ unsigned long long* claims(int which, int me, uint64_t call) const {
    return reinterpret_cast<unsigned long long*>(seq(3, me)) + 1 + 2 * (which - 1) + (call & 1);
  }
};
// The workspace of an op's call.
__device__ __forceinline__ Ws ws_of(const OpCommon& op) {
  return Ws{op.w, op.ws, op.world, op.num_experts};
}

// Op call descriptors (MOE_EP_FIELD_OP in abi.cuh). Every op of the group
// is one call, numbered by the host (OpCommon::call: the same on every
// rank, whatever the op), and every flag a peer raises for a call carries
// that number. At its start each rank publishes to every other rank its
// descriptor of the call: which op, where each buffer its peers write or
// read in place lies (the collective allocation contract makes a peer's
// address this rank's offset in the same window), and the handle. Before a
// rank writes to or reads from a peer's buffer it compares the peer's
// descriptor with its own, and every wait for a peer looks at the peer's
// descriptor of the call too, so ranks that run different ops (or other
// handles, or buffers in other places), a rank whose host refused the call
// (MOE_EP_OP_REFUSED) and a rank that skips it after an error
// (MOE_EP_OP_STOPPED) stop every peer at once, with an error naming them,
// instead of leaving them waiting for the timeout. A wait that does time
// out names the lowest rank whose descriptor of the call never came (the
// rank that did not arrive), else the peer it waited for. Two parities: a
// rank is at most one call ahead of any peer that still reads its
// descriptor (every call waits for every peer).

// The group's calls, counted on the device: every op of the group is one
// kernel on every rank (a refused call's too, moe_ep_publish_refusal), and
// each counts itself in Ws::seq(4) before anything else, so the counts of
// all ranks move in step, also through CUDA-graph replays. (Per block, as
// next_seq; a kernel whose grid is not the group's bumps every block's.)
__device__ uint64_t next_call(const Ws& ws, int me) {
  __shared__ uint64_t s_call;
  if (threadIdx.x == 0) {
    uint64_t* c = ws.seq(4, me) + blockIdx.x;
    s_call = *c + 1;
    *c = s_call;
  }
  __syncthreads();
  return s_call;
}
__device__ uint64_t next_call_all(const Ws& ws, int me, int num_blocks) {
  __shared__ uint64_t s_call;
  uint64_t* c = ws.seq(4, me);
  __syncthreads();
  if (threadIdx.x == 0) s_call = c[0] + 1;
  __syncthreads();
  const uint64_t v = s_call;
  for (int b = threadIdx.x; b < num_blocks; b += blockDim.x) c[b] = v;
  __syncthreads();
  return v;
}

// One call as a kernel sees it: what its waits need.
struct Call {
  Ws ws;
  const uint64_t* mine;  // this rank's descriptor (MOE_EP_DESC_WORDS words)
  uint64_t call, timeout_ns;
  ErrSink err;
  int me;
};
__device__ __forceinline__ Call call_of(const OpCommon& op, const uint64_t* mine, uint64_t call) {
  const Ws ws = ws_of(op);
  return Call{ws, mine, call, op.timeout_ns, ws.err(op.error, op.rank), op.rank};
}

// Threads d < R of the calling block: publish `words` as this rank's
// descriptor of the call to every other rank d.
__device__ __forceinline__ void publish_words(const Ws& ws, uint64_t call, const uint64_t* words,
                                              int me) {
  const int d = threadIdx.x;
  if (d >= ws.R || d == me) return;
  uint64_t* slot = ws.desc(d, (int)(call & 1), me);
#pragma unroll
  for (int i = 0; i < MOE_EP_DESC_WORDS; ++i) slot[i] = words[i];
  st_release_sys_u64(slot + 7, call);
}
// Block 0: publish this rank's descriptor of the call.
__device__ __forceinline__ void publish_desc(const Call& c) {
  if (blockIdx.x == 0) publish_words(c.ws, c.call, c.mine, c.me);
}
// Threads d < R of the calling block: tell every peer that this rank skips
// the call after an error (MOE_EP_OP_STOPPED, with its status code).
__device__ __forceinline__ void publish_stopped(const Ws& ws, uint64_t call, int me) {
  uint64_t w[MOE_EP_DESC_WORDS] = {};
  w[0] = MOE_EP_OP_STOPPED | (*reinterpret_cast<volatile unsigned long long*>(ws.status(me)) << 8);
  publish_words(ws, call, w, me);
}
// The start of every op kernel whose grid is the group's (every block):
// the call's number, or 0 when an earlier error stopped this rank (its
// status word). Then block 0 tells every peer that it skips the call
// (MOE_EP_OP_STOPPED), so that none waits for it, and the kernel returns
// at once, writing nothing.
__device__ __forceinline__ uint64_t begin_call(const OpCommon& op) {
  const Ws ws = ws_of(op);
  const uint64_t call = next_call(ws, op.rank);
  if (!ws.stopped(op.rank)) return call;
  if (blockIdx.x == 0) publish_stopped(ws, call, op.rank);
  return 0;
}

// Peer s stopped, its status word `st` saying why (status_word): reported
// as the root it names, so that every rank names the same one. A refusal
// elsewhere stays a refusal (its rank and argument); a stop stays a stop
// of its root (with the root's code: a timeout there is one here too).
__device__ __noinline__ void report_stop(const Call& c, int s, unsigned long long st) {
  const int code = (int)(st & 0xffull), root = (int)((st >> 8) & 0xffull);
  const int aux = (int)((st >> 16) & 0xffffull);
  if (code == MOE_EP_ERR_REFUSED) {
    report_error(c.err, MOE_EP_ERR_REFUSED, c.me, root, aux, c.mine[0], 0, 0, c.call);
  } else if (code == MOE_EP_ERR_PEER_STOPPED) {
    report_error(c.err, MOE_EP_ERR_PEER_STOPPED, c.me, root, 0, c.mine[0], (uint64_t)aux, 0, c.call);
  } else {
    // A timeout names the rank that did not come: that one is the root.
    const int who = code == MOE_EP_ERR_TIMEOUT ? root : s;
    report_error(c.err, MOE_EP_ERR_PEER_STOPPED, c.me, who, 0, c.mine[0], (uint64_t)code, 0, c.call);
  }
}

// What peer s's descriptor of the call says, seen here.
enum PeerSays { kNotYet = 0, kAgrees = 1, kDiffers = 2, kMovedOn = 3 };
// One thread. kDiffers has been reported (the first word that differs;
// a refusal or a stop as such). kMovedOn: s published a later call.
__device__ __forceinline__ int peer_says(const Call& c, int s) {
  const uint64_t* slot = c.ws.desc(c.me, (int)(c.call & 1), s);
  const uint64_t at = ld_acquire_sys_u64(slot + 7);
  if (at < c.call) return kNotYet;
  if (at > c.call) return kMovedOn;
#pragma unroll
  for (int i = 0; i < MOE_EP_DESC_WORDS; ++i) {
    const uint64_t theirs = ld_acquire_sys_u64(slot + i);
    if (theirs == c.mine[i]) continue;
    const uint64_t kind = theirs & 0xffull;
    if (i == 0 && kind == MOE_EP_OP_REFUSED) {
      report_error(c.err, MOE_EP_ERR_REFUSED, c.me, s, (int)((theirs >> 16) & 0xffffull), c.mine[0],
                   (theirs >> 8) & 0xffull, 0, c.call);
    } else if (i == 0 && kind == MOE_EP_OP_STOPPED) {
      report_stop(c, s, theirs >> 8);
    } else {
      const bool dispatch_family = (c.mine[0] & 0xffull) == MOE_EP_OP_DISPATCH ||
                                   (c.mine[0] & 0xffull) == MOE_EP_OP_COMBINE_BWD;
      const int field = i == 0 ? MOE_EP_FIELD_OP
                        : i == MOE_EP_DESC_HANDLE     ? MOE_EP_FIELD_HANDLE
                        : dispatch_family && i == 5 ? MOE_EP_FIELD_RECV_SCALES
                        : (dispatch_family ? MOE_EP_FIELD_OP : MOE_EP_FIELD_RECV_SRC) + i;
      report_error(c.err, MOE_EP_ERR_MISMATCH, c.me, s, field, c.mine[i], theirs, 0, c.call);
    }
    return kDiffers;
  }
  return kAgrees;
}

// True (reported) when peer s's status word is set: it stopped, in this
// call or before (an error of its own, found maybe after it had published
// this call's descriptor), and will raise no more flags until every rank's
// check. (A remote load, every kCheckEvery polls of a wait.)
__device__ __forceinline__ bool peer_stopped(const Call& c, int s) {
  if (s == c.me) return false;
  const unsigned long long st = *reinterpret_cast<volatile unsigned long long*>(c.ws.status(s));
  if (st == 0ull) return false;
  report_stop(c, s, st);
  return true;
}

// A wait that ran out of time: names the lowest rank whose descriptor of
// the call is not here (it never arrived: needed = 1), else `peer`.
__device__ __noinline__ void report_timeout(const Call& c, int peer, int counter, uint64_t expected,
                                            uint64_t seen) {
  int who = peer, absent = 0;
  for (int r = 0; r < c.ws.R; ++r) {
    if (r == c.me) continue;
    if (ld_acquire_sys_u64(c.ws.desc(c.me, (int)(c.call & 1), r) + 7) < c.call) {
      who = r;
      absent = 1;
      break;
    }
  }
  report_error(c.err, MOE_EP_ERR_TIMEOUT, c.me, who, counter, expected, seen, (uint64_t)absent,
               c.call);
}

// Bounded wait of one thread until *flag >= target, a flag peer `peer`
// raises in this call. Every kCheckEvery polls it also looks at the error
// word and at the peer's descriptor of the call: a peer that runs
// something else, refused or stopped ends the wait at once (reported).
// false: the wait failed (reported here or elsewhere).
__device__ __noinline__ bool wait_peer(const Call& c, const uint64_t* flag, uint64_t target,
                                       int peer, int counter) {
  uint64_t start = 0;
  bool agreed = peer == c.me;
  for (uint32_t i = 1;; ++i) {
    uint64_t v = ld_acquire_sys_u64(flag);
    if (v >= target) return true;
    if (i % kCheckEvery == 0) {
      if (has_error(c.err)) return false;
      if (peer_stopped(c, peer)) return false;
      if (!agreed) {
        const int says = peer_says(c, peer);
        if (says == kDiffers) return false;
        agreed = says == kAgrees;
        if (says == kMovedOn) {
          // It went on to a later call: it raised its flags of this one
          // first, unless it skipped the call.
          v = ld_acquire_sys_u64(flag);
          if (v >= target) return true;
          report_error(c.err, MOE_EP_ERR_PEER_STOPPED, c.me, peer, 0, c.mine[0], 0, 0, c.call);
          return false;
        }
      }
      if (timed_out(&start, c.timeout_ns)) {
        report_timeout(c, peer, counter, target, v);
        return false;
      }
    }
    __nanosleep(32);
  }
}

// One thread: waits (bounded) for peer s's descriptor of the call; true
// when it equals mine (false: it differs, or the wait failed; reported).
__device__ __noinline__ bool desc_agrees(const Call& c, int s) {
  uint64_t start = 0;
  for (uint32_t i = 1;; ++i) {
    const int says = peer_says(c, s);
    if (says == kAgrees) return true;
    if (says == kDiffers) return false;
    if (says == kMovedOn) {
      report_error(c.err, MOE_EP_ERR_PEER_STOPPED, c.me, s, 0, c.mine[0], 0, 0, c.call);
      return false;
    }
    if (i % kCheckEvery == 0) {
      if (has_error(c.err)) return false;
      if (peer_stopped(c, s)) return false;
      if (timed_out(&start, c.timeout_ns)) {
        report_timeout(c, s, MOE_EP_CTR_DESCRIPTOR, c.call,
                       ld_acquire_sys_u64(c.ws.desc(c.me, (int)(c.call & 1), s) + 7));
        return false;
      }
    }
    __nanosleep(32);
  }
}

// Work items handed to warps one at a time from a counter, so a warp that
// finishes early takes the next item and no SM is left with a tail. (On
// 2 x H200 this moved dispatch at 20-32 SMs from 204-225 to 182-185 µs:
// fixed strides left the slowest warps the last items; BENCHMARKS.md. The
// pulled combine claims only in the dispatch backward: see combine_pull.cu.)
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
// (slot: the block's counter; the layout's exchange, run by whichever block
// of the scan finishes last, always takes slot 0.)
__device__ uint64_t next_seq(const Ws& ws, int which, int me, int slot) {
  __shared__ uint64_t s_seq;
  if (threadIdx.x == 0) {
    uint64_t* seq_local = ws.seq(which, me);
    s_seq = seq_local[slot] + 1;
    seq_local[slot] = s_seq;
    if (which > 0 && slot == 0) *ws.claims(which, me, s_seq + 1) = 0ull;
  }
  __syncthreads();
  return s_seq;
}
__device__ uint64_t next_seq(const Ws& ws, int which, int me) {
  return next_seq(ws, which, me, blockIdx.x);
}

// ---- bf16 <-> f32 on 16-byte vectors of 8 values ----
// The two bf16 of a 32-bit word as f32 (exact: a bf16 is the top half of its
// f32): one shift and one mask, where __bfloat1622float2 compiles to three
// instructions (the sums below are bound by instruction issue, BENCHMARKS.md).
__device__ __forceinline__ float2 bf16x2_to_f32x2(uint32_t u) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
// acc += w * v (weighted) or acc += v, per value in f32. Keep `weighted` a
// constant where this sits in a loop (hoist the test): a run-time flag makes
// every value cost both the add and the multiply-add, predicated.
__device__ __forceinline__ void acc_v4(float (&acc)[8], int4 v, float w, bool weighted) {
  const uint32_t h[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = bf16x2_to_f32x2(h[i]);
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

// The two-level combine's progress (CombineParams::done), per warp:
// done_add(st, t, n) once the warp has stored n vectors of home row t (t
// and n warp-uniform; every lane calls), done_flush(st) when the warp is
// done with its items (every lane calls). st is the warp's pending count,
// lane 0's: (chunk + 1) << 32 | vectors, 0 for none (a register, or a
// shared word where registers are short). A warp's count for a chunk goes
// out when its rows move to another chunk or at the flush, not per row:
// the rows of a chunk are the same few counters for every warp, and an
// atomic per item there cost the expert-major combine 17% at 4096 tokens
// (2026-12-02, BENCHMARKS.md). Before the count, the warp's stores (ordered
// by the warp barrier) are made visible at GPU scope: what reads them is on
// this GPU (the hop stream's wait kernel acquires the count; the hop after
// it in stream order reads the rows). A chunk holds at most 2^30 vectors
// (the launcher's bound), so the count fits the low word.
__device__ __forceinline__ void done_flush_body(const CombineParams& p, unsigned long long& st) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0 && st != 0ull) {
    __threadfence();
    atomicAdd(p.done + ((int)(st >> 32) - 1), st & 0xffffffffull);
    st = 0ull;
  }
}
__device__ __forceinline__ void done_add_body(const CombineParams& p, unsigned long long& st, int t,
                                              int vecs) {
  const int c = p.done_of[t];
  // Lane 0's state decides for the warp (the flush syncs the warp).
  const bool moved = (threadIdx.x & 31) == 0 && st != 0ull && (int)(st >> 32) - 1 != c;
  if (__shfl_sync(0xffffffffu, (int)moved, 0) != 0) done_flush_body(p, st);
  if ((threadIdx.x & 31) == 0 && c >= 0) {
    st = ((unsigned long long)(c + 1) << 32) | ((st & 0xffffffffull) + (unsigned long long)vecs);
  }
}
__device__ __noinline__ void done_add_call(const CombineParams& p, unsigned long long& st, int t,
                                           int vecs) {
  done_add_body(p, st, t, vecs);
}
// kCall: out of line. Inlined, the hook made the pushed rank-major combine
// at 4 ranks spill; out of line, the expert-major ones (which run at the
// 64-register bound) spilled around the call. Each kernel takes the form
// that costs it no spill (ptxas -v, 2026-12-02).
template <bool kCall = false>
__device__ __forceinline__ void done_add(const CombineParams& p, unsigned long long& st, int t,
                                         int vecs) {
  if (p.done == nullptr) return;
  if (kCall) {
    done_add_call(p, st, t, vecs);
  } else {
    done_add_body(p, st, t, vecs);
  }
}
__device__ __forceinline__ void done_flush(const CombineParams& p, unsigned long long& st) {
  if (p.done != nullptr) done_flush_body(p, st);
}

// Row t's vectors base + j * 32 + lane (< lim): every present rank's vector
// j of v (rank d present when have[d] >= 0) summed in f32 in ascending rank
// order, stored as bf16. The one reduction order of every combine path
// (pulled and pushed give the same bits).
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

}  // namespace
