// The structs and constants shared between the kernels and their Rust
// launchers. Every struct here is mirrored field for field in src/ops/abi.rs;
// both sides assert the same sizes (static_assert below, const asserts there).
// NOTE: no NCCL header here: the hot kernels see plain pointers only.
#pragma once
#include <stddef.h>
#include <stdint.h>

// Largest world the NVLink path handles (ranks that share a node).
#define MOE_EP_MAX_RANKS 8
// Largest grid (one block per SM on an H200).
#define MOE_EP_MAX_BLOCKS 132
// Largest top-k.
#define MOE_EP_MAX_TOPK 16
// Threads per block of the data-moving kernels.
#define MOE_EP_THREADS 512
// Combine pipelines its push and its reduction over chunks of each home
// rank's tokens: token t is in sub-chunk floor(t * SUBCHUNKS / T). The layout
// records, per (source, destination), how many of the source's tokens for the
// destination come before each sub-chunk; a combine runs in 1, 2, 4, 8 or 16
// chunks of whole sub-chunks.
#define MOE_EP_SUBCHUNKS 16
// The layout scan counts this many experts per block (one pass over the
// routing per group of experts): its grid has ceil(E / SCAN_EXPERTS) such
// blocks, then one per rank, then the check blocks.
#define MOE_EP_SCAN_EXPERTS 4
// Threads per block of the layout scan (every block: expert groups, ranks,
// checks); each thread takes 4096 / MOE_EP_SCAN_THREADS tokens per pass.
#define MOE_EP_SCAN_THREADS 512
// Rank-major pushed combine: one warp per block pushes partials with bulk
// copies through a ring of shared buffers (MOE_EP_COMBINE_SMEM bytes of
// dynamic shared memory, given by the launcher), one row piece of up to
// MOE_EP_BULK_VECS 16-byte vectors per lane (16 KiB) each; loads run half the
// ring ahead of the stores. (16 KiB copies beat 8 KiB and 4 KiB: BENCHMARKS.md.)
#define MOE_EP_COMBINE_SMEM (128 * 1024)
// Dynamic shared memory of the expert-major pushed combine kernels: their
// stages of row pieces (at hidden 7168, top-8: 3 stages of 8 half rows,
// 7 KiB copies; 128 KiB gave 3 stages of thirds, 606 against 478 us at
// world 1, BENCHMARKS.md).
#define MOE_EP_EM_COMBINE_SMEM (200 * 1024)
#define MOE_EP_BULK_VECS 32
#define MOE_EP_BULK_BUFS (MOE_EP_COMBINE_SMEM / (MOE_EP_BULK_VECS * 512))
#define MOE_EP_BULK_AHEAD (MOE_EP_BULK_BUFS / 2)
// sizeof(ncclConfig_t) of NCCL 2.28 (checked in symm.cu).
#define MOE_EP_NCCL_CONFIG_BYTES 80

// Error codes written into ErrorInfo::code (first error wins).
#define MOE_EP_OK 0
#define MOE_EP_ERR_TIMEOUT 1        // peer = rank that stalled, counter = MOE_EP_CTR_*
#define MOE_EP_ERR_CAPACITY 2       // needed/capacity in rows, peer = receiving rank
#define MOE_EP_ERR_BAD_EXPERT 3     // needed = token, capacity = slot, expected = value
#define MOE_EP_ERR_DUP_EXPERT 4     // needed = token, capacity = slot
// (BAD_EXPERT and DUP_EXPERT: peer = the rank whose topk_idx it is; every
// rank reports it, from the exchanged count rows.)
#define MOE_EP_ERR_MISMATCH 5       // counter = MOE_EP_FIELD_*, peer = the rank that differs,
                                    // expected = this rank's value, seen = the peer's
// (TIMEOUT: needed = 1 when `peer` had not arrived at the call at all (its
// descriptor of the call was not here: the rank that did not come), 0 when
// it had and the wait was for its progress; capacity = the call number.)
#define MOE_EP_ERR_REFUSED 6        // peer refused its part of the call on its host: counter =
                                    // the argument (src/ops/abi.rs arg_name), seen = its op
#define MOE_EP_ERR_PEER_STOPPED 7   // peer skipped the call after an error of its own (its
                                    // status word): seen = that error's code
#define MOE_EP_ERR_BAD_PEER_DATA 8  // a value a peer wrote is out of range here: counter =
                                    // MOE_EP_FIELD_*, seen = the value, expected = the bound
                                    // (exclusive), needed = where (row or token)
#define MOE_EP_ERR_ABORTED 9        // the communicator was aborted (written by the host)

// What a count row's tail carries that every rank must agree on.
#define MOE_EP_FIELD_TOPK 1
#define MOE_EP_FIELD_LAYOUT 2
#define MOE_EP_FIELD_ALIGNMENT 3
// What an op call's descriptor carries (MOE_EP_DESC_WORDS words, published
// by every rank to every other one at the call's start, see DispatchParams::
// desc): word 0 the op (MOE_EP_OP_*), then the places of the buffers peers
// write or read in place, each (window id << 40 | byte offset in the window),
// 0 for none. Field of word i: MOE_EP_FIELD_OP for i = 0, else the
// dispatch family's MOE_EP_FIELD_OP + i (recv_tokens, recv_topk_weights,
// recv_topk_idx, recv_src) or the combine family's MOE_EP_FIELD_RECV_SRC + i
// (expert_out, grad_recv_topk_weights).
#define MOE_EP_FIELD_OP 4
#define MOE_EP_FIELD_RECV_TOKENS 5
#define MOE_EP_FIELD_RECV_WEIGHTS 6
#define MOE_EP_FIELD_RECV_IDX 7
#define MOE_EP_FIELD_RECV_SRC 8
#define MOE_EP_FIELD_EXPERT_OUT 9
#define MOE_EP_FIELD_GRAD_W 10
#define MOE_EP_FIELD_HANDLE 12     // descriptor word 6: the handle (its layout's call number)
#define MOE_EP_FIELD_COUNTS 13     // a peer's count row (bad-peer-data checks)
#define MOE_EP_FIELD_META 14       // expert-major meta rows written by a sender
#define MOE_EP_FIELD_NUM_TOKENS 15 // a low-latency sender's token count
#define MOE_EP_FIELD_RECV_SCALES 16 // dispatch: descriptor word 5, the place of recv_xs (fp8 scales)
#define MOE_EP_FIELD_META_REPEATED 17 // an expert-major meta row a sender wrote twice for one token
#define MOE_EP_FIELD_BAD_ENTRY 18  // a peer's first-bad-entry word that names no error code
#define MOE_EP_FIELD_SUBCHUNK_STARTS 19  // a count row's sub-chunk starts, out of order
#define MOE_EP_DESC_WORDS 7
// Descriptor word 6 of every data op: the handle's id (MOE_EP_FIELD_HANDLE).
#define MOE_EP_DESC_HANDLE 6
#define MOE_EP_OP_DISPATCH 1
#define MOE_EP_OP_COMBINE_BWD 2
#define MOE_EP_OP_COMBINE 3
#define MOE_EP_OP_DISPATCH_BWD 4
#define MOE_EP_OP_LAYOUT 5
// Word 0 of a descriptor that is not an op: a refusal (the host refused
// its part, op << 8 | argument << 16) or a rank that skipped the call
// after an error (status code << 8). Every peer that waits for such a rank
// stops with MOE_EP_ERR_REFUSED / MOE_EP_ERR_PEER_STOPPED.
#define MOE_EP_OP_REFUSED 6
#define MOE_EP_OP_STOPPED 7
// Descriptor word of a pushed buffer that travels (combine family word 2:
// weight gradients given, pushed).
#define MOE_EP_DESC_PUSHED (1ull << 63)
// Dispatch: descriptor word 0's second byte, the rows' payload (ranks that
// dispatch different payloads differ in word 0: "op").
#define MOE_EP_DESC_PAYLOAD_BF16 0
#define MOE_EP_DESC_PAYLOAD_FP8_E8M0_32 1
#define MOE_EP_DESC_PAYLOAD_FP8_F32_128 2
#define MOE_EP_FIELD_PAYLOAD 11    // low-latency: bf16 or fp8 rows

// Counters a wait can stall on.
#define MOE_EP_CTR_LAYOUT_COUNTS 1
#define MOE_EP_CTR_DISPATCH_DONE 2
#define MOE_EP_CTR_COMBINE_DONE 3
#define MOE_EP_CTR_BULK_COPY 4     // a local bulk (TMA) copy that never completed
#define MOE_EP_CTR_COMBINE_PULL 5  // combine (pull): a peer's "outputs ready" / "read yours" handshake
#define MOE_EP_CTR_DESCRIPTOR 6    // a peer's descriptor of its buffers for this op call
#define MOE_EP_CTR_LL_DISPATCH 7   // low-latency dispatch: a sender block's rows (LlSignal)
#define MOE_EP_CTR_LL_COMBINE 8    // low-latency combine: an expert rank block's rows home
#define MOE_EP_CTR_HOP_ARRIVAL 9   // two-level dispatch: a chunk of the network hop (peer: its sender)
#define MOE_EP_CTR_HOP_DEPARTURE 10  // two-level combine: a chunk of the node combine's rows before the hop (peer: where it goes)

// Written by kernels into host-mapped pinned memory; read by the host at the
// next call. 64 bytes.
struct ErrorInfo {
  int32_t code;
  int32_t rank;
  int32_t peer;
  int32_t counter;
  uint64_t expected;
  uint64_t seen;
  uint64_t needed;
  uint64_t capacity;
  uint64_t _pad[2];
};

// Per-handle layout results on the device (local memory of each rank).
// All arrays are int32. Sizes in elements.
struct LayoutBufs {
  int32_t* topk;          // [T][K] expert ids, -1 masked (normalised from i32/i64)
  int32_t* rank_pos;      // [T][R] position of t in the (me -> d) stream, -1 if not sent
  int32_t* expert_pos;    // [T][K] position of (t,k) in the (me -> expert) stream, -1 masked
  int32_t* info;          // [InfoOffsets::total] see info_offsets() below
  int32_t* meta;          // expert-major, symmetric: [R * max_tokens][K] on me: for received
                          // token u, the row of its slot k's expert here, or -1 (written
                          // by the senders' dispatch or combine backward)
};

// One row of the count matrix, as rank s sends it: [E] tokens per expert,
// [R] tokens per destination rank, then [R][SUBCHUNKS - 1]: for destination
// d and j = 1..15, how many of s's tokens for d come before token
// floor(j * T_s / SUBCHUNKS), then the tail: what the receivers check
// (MOE_EP_ROW_TAIL words from row_tail()).
//   [0], [1]  s's first bad topk_idx entry (InfoOffsets::bad, high and low
//             word; 0 = none)
//   [2]       topk   [3] layout kind   [4] alignment   [5..7] 0
#define MOE_EP_ROW_TAIL 8
__host__ __device__ inline int row_tail(int R, int E) { return E + R * MOE_EP_SUBCHUNKS; }
__host__ __device__ inline int count_row(int R, int E) { return row_tail(R, E) + MOE_EP_ROW_TAIL; }

// The first bad entry of a rank's topk_idx as one word that atomicMax keeps
// (the lowest token, then slot, wins): ~(token << 40 | slot << 36 | code << 32
// | low 32 bits of the id clamped to int32). 0 = none.
__host__ __device__ inline unsigned long long bad_entry_word(int t, int k, int code, long long v) {
  const long long c = v < -2147483648ll ? -2147483648ll : (v > 2147483647ll ? 2147483647ll : v);
  return ~(((unsigned long long)t << 40) | ((unsigned long long)k << 36) |
           ((unsigned long long)code << 32) | (unsigned long long)(uint32_t)(int32_t)c);
}

// Offsets of the words inside LayoutBufs::info (R = world, E = experts,
// El = experts per rank). Computed once by the exchange kernel.
//   counts        [R][count_row]  the gathered count matrix (row s: see count_row)
//   dst_u_off     [R]          first rank-major row of mine on rank d
//   erow_base     [E]          first expert-major row of mine in expert e's block (on e's rank)
//   src_u_off     [R + 1]      on me: first rank-major row from source s; [R] = total rows
//   my_slot_on    [R]          on home s: first combine slot of partials from me
//   home_slot     [R + 1]      on me: first combine slot from rank d; [R] = total slots
//   expert_start  [El + 1]     on me: padded block start of local expert j; [El] = total rows
//   expert_count  [El]         on me: unpadded rows of local expert j
//   rows_needed   [R]          rows each rank must hold (capacity check, in the call's layout;
//                              with the drop policy, the rows it keeps)
//   dropped       [R]          rows each rank dropped (drop policy; 0 otherwise)
//   bad           [2 * layout_check_blocks(T)]  per check block of the scan, its first bad
//                              topk_idx entry (bad_entry_word, 0: none), 8-byte aligned; total
//                              counts one of them (the arena holds them all)
struct InfoOffsets {
  int32_t counts, dst_u_off, erow_base, src_u_off, my_slot_on, home_slot, expert_start,
      expert_count, rows_needed, dropped, bad, total;
};
__host__ __device__ inline InfoOffsets info_offsets(int R, int E, int El) {
  InfoOffsets o;
  o.counts = 0;
  o.dst_u_off = o.counts + R * count_row(R, E);
  o.erow_base = o.dst_u_off + R;
  o.src_u_off = o.erow_base + E;
  o.my_slot_on = o.src_u_off + R + 1;
  o.home_slot = o.my_slot_on + R;
  o.expert_start = o.home_slot + R + 1;
  o.expert_count = o.expert_start + El + 1;
  o.rows_needed = o.expert_count + El;
  o.dropped = o.rows_needed + R;
  o.bad = (o.dropped + R + 1) / 2 * 2;
  o.total = o.bad + 2;
  return o;
}
// Check blocks of the layout scan (one token per thread; 1 when T = 0).
__host__ __device__ inline int layout_check_blocks(int T) {
  return T > 0 ? (T + MOE_EP_SCAN_THREADS - 1) / MOE_EP_SCAN_THREADS : 1;
}

// The group's symmetric workspace, the same offsets on every rank (bytes from
// the workspace base). Carved by src/ops/node/group.rs, whose comment has the sizes.
struct Workspace {
  uint64_t counts_off;     // int32 [2 parity][R src][count_row] written by peers
  uint64_t count_flag_off; // uint64 [R src]                   epoch, written by peers
  uint64_t dispatch_done_off; // uint64 [R src][MAX_BLOCKS]    written by peers
  uint64_t combine_done_off;  // uint64 [R src][MAX_BLOCKS]    written by peers
  uint64_t stage_off;      // bf16 [2 parity][stage_rows][H]   combine partials, by peers
  uint64_t stage_w_off;    // float [2 parity][stage_rows][K_max] weight grads, by peers
  uint64_t seq_off;        // uint64 [5][MAX_BLOCKS] local sequence counters (layout, dispatch, combine); [3][0] error claim, [3][1..6] item counters, [3][8] status, [3][10] layout arrivals; [4] the group's calls, per block
  uint64_t stage_rows;     // combine slots per parity (= max_tokens_per_rank * world)
  uint64_t pull_flag_off;  // uint64 [R src][MAX_BLOCKS]    combine (pull) handshakes, by peers
  uint64_t desc_off;       // uint64 [2 parity][MAX_RANKS src][8] op call descriptors, by peers
};

// How received rows are laid out (RecvLayout on the Rust side).
//   RankMajor    one row per (token, destination rank), grouped by source rank
//   ExpertMajor  one row per (token, local expert), in per-expert blocks
//                padded to OpCommon::alignment rows
enum class LayoutKind : int32_t { RankMajor = 0, ExpertMajor = 1 };

// What every op's parameters share: the group's resources (workspace, error
// report), the handle's layout arrays, and the call's shape. Embedded first
// in each kernel's parameter struct as `op`.
struct OpCommon {
  LayoutBufs bufs;              // the handle's arrays (local)
  char* ws[MOE_EP_MAX_RANKS];   // workspace base as mapped here, per rank (ws[rank] = local)
  Workspace w;
  ErrorInfo* error;             // host-mapped
  uint64_t timeout_ns;          // bound on every wait for another GPU
  int32_t rank, world, num_tokens, hidden, topk, num_experts;
  LayoutKind layout;
  int32_t alignment;            // expert-major padding (1 for rank-major)
  int32_t recv_capacity;        // rows on every rank
  int32_t num_blocks;           // grid of the data kernels (dispatch, combine), the same on every rank
};

// layout: moe_ep_layout_scan_{i32,i64}, _exchange (layout.cu).
struct LayoutParams {
  OpCommon op;
  const void* topk_idx;    // [T][K] int32 (scan_i32) or int64 (scan_i64)
  // The overflow policy: 0 = a rank whose rows exceed recv_capacity stops
  // every rank (MOE_EP_ERR_CAPACITY); 1 = drop rows beyond the capacity
  // (layout.cu, drop_over_capacity, says which), every rank in the same way.
  int32_t drop;
  // Fault tests only (0 otherwise): this rank sends its count row with word
  // (count_fault >> 16) - 1 replaced by the low 16 bits (signed), as a peer's bad
  // write would have it.
  int32_t count_fault;
};

// moe_ep_publish_refusal (layout.cu): a rank whose host refused its part of
// a call (or skipped it after an error) counts the call and publishes `desc`
// (word 0 MOE_EP_OP_REFUSED or MOE_EP_OP_STOPPED) to every peer, so that
// they stop at once instead of waiting for it.
struct RefusalParams {
  OpCommon op;
  uint64_t desc[MOE_EP_DESC_WORDS];
  uint64_t _pad;
};

// dispatch, and combine backward, which is a dispatch of the gradient
// (dispatch.cu).
struct DispatchParams {
  OpCommon op;
  const void* x;           // [T][H] bf16, local
  const float* topk_w;     // [T][K] or null (combine backward)
  const float* scale_w;    // expert-major combine backward: local [rows] weights, or null
  char* recv_x[MOE_EP_MAX_RANKS];   // [rows][H] bf16 on each rank
  float* recv_w[MOE_EP_MAX_RANKS];  // rank-major [rows][K], expert-major [rows]; may be null
  int32_t* recv_idx[MOE_EP_MAX_RANKS]; // same shape as recv_w, local expert ids; may be null
  int32_t* recv_src[MOE_EP_MAX_RANKS]; // [rows][2] (src rank, src token); may be null
  // This call's descriptor (MOE_EP_FIELD_OP): op, then the places of
  // recv_x, recv_w, recv_idx, recv_src here. Senders write only to ranks
  // whose descriptor equals theirs (the addresses above assume the same
  // place on every rank); every rank compares all of them after the wait.
  uint64_t desc[MOE_EP_DESC_WORDS];
  // Expert-major: every rank's LayoutBufs::meta as mapped here; senders
  // write, per token they send, the rows of its experts there (read by the
  // receiver's extra copies and by combine). Null for rank-major.
  int32_t* meta[MOE_EP_MAX_RANKS];
  // Rows that arrive while the kernel runs (the two-level path's forward
  // batch, in chunks of the network hop), or null: row t may be read once
  // arrive[arrive_of[t]] >= arrive_epoch (arrive_of[t] < 0: already here);
  // arrive_peer[c] is the rank that sends chunk c (named on a timeout).
  const uint64_t* arrive;
  const int32_t* arrive_of;
  const int32_t* arrive_peer;
  uint64_t arrive_epoch;
  // fp8 rows (descriptor word 0's MOE_EP_DESC_PAYLOAD_* byte, word 5 the
  // place of recv_xs): each row is row16 16-byte vectors of e4m3 codes, and
  // beside it its block scales, scale_words 4-byte words of xs [T][sw]
  // written to recv_xs[r] [rows][sw] on each rank (same row index).
  // row16 = 0: bf16 rows of hidden / 8 vectors, no scales.
  const uint32_t* xs;
  uint32_t* recv_xs[MOE_EP_MAX_RANKS];
  int32_t row16;
  int32_t scale_words;
  // Expert-major: 1 = padding rows' token vectors (and scales) are written
  // with zeros; 0 = left as they are (their weights, ids and sources are
  // always marked).
  int32_t zero_pad;
  int32_t _pad;
};

// combine, and dispatch backward, which is a combine of the gradient
// (combine_pull.cu, combine_push.cu). grad_w_in and grad_w_out are given
// exactly to the dispatch_bwd kernels (the weight gradients travel home).
struct CombineParams {
  OpCommon op;
  const void* y;           // [rows][H] bf16 local, in the dispatch's layout
  const float* w_rows;     // expert-major weights per row (weighted combine), or null
  const float* grad_w_in;  // dispatch backward: rank-major [rows][K] / expert-major [rows], or null
  void* out;               // [T][H] bf16 local
  float* grad_w_out;       // [T][K] local, or null
  // Pulled kernels only: y (and grad_w_in) as mapped here, per rank: the
  // home reads partials (and weight gradients) in place. Null for the
  // pushed ones, whose partials travel through the stage.
  const void* y_peers[MOE_EP_MAX_RANKS];
  const float* gw_peers[MOE_EP_MAX_RANKS];
  int32_t num_chunks;      // pushed: 1, 2, 4, 8 or 16 (MOE_EP_SUBCHUNKS / num_chunks sub-chunks each)
  int32_t _pad;
  // This call's descriptor (MOE_EP_FIELD_OP): op, the place of y when it is
  // read in place (0: pushed), the place of grad_w_in when read in place
  // (MOE_EP_DESC_PUSHED: pushed, 0: none). Checked before any peer's rows
  // are read or awaited, so ranks that disagree stop with an error.
  uint64_t desc[MOE_EP_DESC_WORDS];
  // Progress of the home rows (the two-level combine's network hop starts
  // on a chunk of them while the rest are summed; null: not counted): once
  // a warp has stored vectors of home row t, it adds how many to
  // done[done_of[t]] (done_of[t] < 0: not counted), after a GPU-scope
  // fence. A chunk of n rows is complete at n * hidden / 8.
  unsigned long long* done;
  const int32_t* done_of;
};

// ---- low-latency mode (low_latency.cu, src/ops/low_latency/) ----
// Buffer sets the group alternates between (batch n uses set n mod 2 of
// the host's count), so one batch's dispatch can run while the other's
// combine is pending.
#define MOE_EP_LL_SETS 2
// Largest max_tokens_per_rank of a low-latency group.
#define MOE_EP_LL_MAX_TOKENS 1024
// Values per fp8 scale (one f32 scale per 128 values of a row).
#define MOE_EP_FP8_BLOCK 128
// LlParams::payload: what a row holds.
#define MOE_EP_LL_BF16 0  // H bf16 values
#define MOE_EP_LL_FP8 1   // H e4m3 codes (rows H bytes apart) + H / 128 f32 scales
// LlParams::cast: how the sender makes fp8 rows.
#define MOE_EP_LL_CAST_NONE 0   // bf16 rows, or the caller's fp8 rows
#define MOE_EP_LL_CAST_EXACT 1  // scale = amax * (1/448)
#define MOE_EP_LL_CAST_POW2 2   // scale = 2^ceil(log2(amax * (1/448)))

// What one sender block tells one receiver, in the receiver's set: written
// after the block's rows, `seq` (the batch's sequence number) last, with
// release. The rest lets every receiver check the batch (the same on every
// block of a sender).
// A dispatch sender that sends no rows says why in num_tokens:
// MOE_EP_LL_STOPPED (it skipped the batch after an error of its own) or
// MOE_EP_LL_REFUSED_BASE - argument (its host refused the call); every
// receiver then stops with that error. A combine send that skips the batch
// signals MOE_EP_LL_SIG_NOT_SENT | 0xffff << 48 | seq, one its host refused
// MOE_EP_LL_SIG_NOT_SENT | argument << 48 | seq (its homes compare the low
// 48 bits with the batch's number).
#define MOE_EP_LL_STOPPED (-2147483647 - 1)
#define MOE_EP_LL_REFUSED_BASE (-1)
#define MOE_EP_LL_SIG_NOT_SENT (1ull << 63)
struct LlSignal {
  uint64_t seq;
  uint64_t bad;        // the block's first bad topk_idx entry (bad_entry_word), 0 = none
  int32_t num_tokens;  // T of the sender (< 0: no rows, see above)
  int32_t topk;
  int32_t payload;     // MOE_EP_LL_BF16 / _FP8
  int32_t layout;      // LayoutKind
};

// The low-latency buffers of a group: one symmetric buffer (peers write
// it) and one local buffer, each MOE_EP_LL_SETS sets of *_set_bytes; the
// offsets of each region inside a set, in bytes. R = world, El = experts
// per rank, M = max_tokens_per_rank, H = hidden, KM = MOE_EP_MAX_TOPK,
// NB = ceil(H / 128). Carved (and sized in the API docs) by
// src/ops/low_latency/.
struct LlBufs {
  char* sym[MOE_EP_MAX_RANKS];  // the symmetric buffer as mapped here, per rank
  char* local;                  // this rank's local buffer
  uint64_t sym_set_bytes, local_set_bytes;
  // symmetric set, written by the peers:
  uint64_t sig_dispatch;  // LlSignal [R src][MAX_BLOCKS]
  uint64_t sig_combine;   // uint64 [R src][MAX_BLOCKS] batch seq, by expert ranks
  uint64_t recv_x;        // [R * M] rows (row s * M + t), 2 H bytes each (fp8: H bytes apart)
  uint64_t recv_scales;   // f32 [R * M][NB]
  uint64_t recv_src;      // int32 [R * M][2] (src rank, src token) or (-1, -1)
  uint64_t recv_idx;      // int32 [R * M][K] local expert per slot, -1 = not here (KM room)
  uint64_t recv_w;        // f32 [R * M][K] weight per slot, 0 = not here (KM room)
  uint64_t comb;          // bf16 [M * KM][H] combine rows: expert-major t * K + k, rank-major d * M + t
  // local set, written by this rank's kernels:
  uint64_t em_x;          // [El * R * M] expert-major rows, as recv_x
  uint64_t em_scales;     // f32 [El * R * M][NB]
  uint64_t em_src;        // int32 [El * R * M][2]
  uint64_t counts;        // int32 [El] per local expert, [El * R] per (expert, source), [R] per source
  uint64_t home_topk;     // int32 [M][K] this rank's routing (bad entries -1)
  uint64_t home_w;        // f32 [M][K] this rank's top-k weights
  uint64_t set_seq;       // uint64: the sequence number of the set's batch
  // after both local sets:
  uint64_t counters;      // uint64 [MAX_BLOCKS] dispatch calls per block
  // local set, again (added after the others):
  uint64_t em_stage;      // int32 [E][M]: (expert, source)'s rows in token order, t * 32 + slot
  uint64_t em_off;        // int32 [E + 1]: rows before each (expert, source), then the total
  uint64_t ticket;        // uint32: blocks of the receive done (zeroed by the send)
  uint64_t home_row;      // int32 [M][KM]: expert-major, my token's slot k -> its row here
                          // (valid where the slot's expert is mine)
};

// Every low-latency kernel's parameters (low_latency.cu). op carries the
// group's workspace (error claim, status word), the shape and the layout;
// op.bufs is unused.
struct LlParams {
  OpCommon op;
  LlBufs b;
  const void* x;          // dispatch: [T][H] bf16, or e4m3 codes (caller fp8)
  const float* x_scales;  // dispatch, caller fp8: [T][H / 128]
  const void* topk_idx;   // dispatch: [T][K] int32 or int64
  const float* topk_w;    // dispatch: [T][K]
  const void* y;          // combine send: expert outputs [rows][H] bf16 in the dispatch's layout
  const float* comb_w;    // combine recv, expert-major: [T][K] weights, or null (the dispatch's)
  void* out;              // combine recv: [T][H] bf16
  int32_t set, max_tokens, payload, cast;
  int32_t in_place;       // combine: rows whose home is this rank stay in y (read there
                          // by the home's sum, so y must be intact until it; the one-call
                          // combine only)
  int32_t refuse;         // sends: 0, or 1 + the argument this rank's host refused (the
                          // send then moves no rows and tells every peer, see LlSignal)
  int32_t tokens_fault;   // fault tests only (0 otherwise): the dispatch send's token
                          // count as every receiver's signal says, instead of T
  int32_t _pad;
};

static_assert(sizeof(ErrorInfo) == 64, "ErrorInfo");
static_assert(sizeof(LayoutBufs) == 40, "LayoutBufs");
static_assert(sizeof(Workspace) == 80, "Workspace");
static_assert(sizeof(LayoutKind) == 4, "LayoutKind");
static_assert(sizeof(OpCommon) == 240, "OpCommon");
static_assert(sizeof(LayoutParams) == 256, "LayoutParams");
static_assert(sizeof(RefusalParams) == 304, "RefusalParams");
static_assert(sizeof(DispatchParams) == 760, "DispatchParams");
static_assert(sizeof(CombineParams) == 488, "CombineParams");
static_assert(sizeof(LlSignal) == 32, "LlSignal");
static_assert(sizeof(LlBufs) == 248, "LlBufs");
static_assert(sizeof(LlParams) == 576, "LlParams");
static_assert(offsetof(LlBufs, local) == 64 && offsetof(LlBufs, sig_dispatch) == 88 &&
                  offsetof(LlBufs, em_x) == 152 && offsetof(LlBufs, counters) == 208 &&
                  offsetof(LlBufs, ticket) == 232,
              "LlBufs offsets");
static_assert(offsetof(LlParams, b) == 240 && offsetof(LlParams, x) == 488 &&
                  offsetof(LlParams, out) == 536 && offsetof(LlParams, set) == 544 &&
                  offsetof(LlParams, in_place) == 560,
              "LlParams offsets");
// ---- the two-level (inter-node) path (two_level.cu) ----
// Most nodes of a two-level world (rail peers of one rank, plus its own node).
#define MOE_EP_MAX_NODES 64

// One parameter struct for every two-level kernel. Node m's row of home
// token t lies at row row_off[m] + pos[t][m] of the own_* arrays when m is
// this rank's node (its segment of its forward batch) and of the net_*
// arrays otherwise (its stream to the rail peer on m: the send range in
// dispatch, the landing range of what comes back in combine).
struct TwoLevelParams {
  const void* topk_idx;       // [T][K] int32 or int64 (streams, pack_ids)
  const void* x;              // [T][H] bf16 (pack_rows: tokens or output gradient)
  const float* topk_w;        // [T][K] or null (pack_rows)
  int32_t* pos;               // [T][N] row of t in its stream to node m, -1 if not reached
  int32_t* lens;              // [N + 1] stream lengths, then the first bad entry's key + 1
  int32_t* own_ids;           // [rows][K] node-local expert ids, -1 elsewhere
  int32_t* net_ids;
  int32_t* own_origin;        // [rows][2] (home rank, home token)
  int32_t* net_origin;
  void* own_x;                // [rows][H] bf16
  void* net_x;
  float* own_w;               // [rows][K]
  float* net_w;
  void* out;                  // [T][H] bf16 (node_sum)
  float* out_w;               // [T][K] (gather_w)
  int32_t* recv_src;          // [recv_rows][2] (remap_src: the mapped sources)
  const int32_t* src_in;      // [recv_rows][2] (remap_src: the node group's sources)
  const int32_t* origin_peers[MOE_EP_MAX_RANKS];  // each node rank's own_origin
  int32_t row_off[MOE_EP_MAX_NODES];
  int32_t num_tokens, topk, hidden, num_experts;
  int32_t nodes, node, home_rank, recv_rows;
  int32_t node_world, origin_rows;  // remap_src: ranks per node, rows of each origin buffer
};
static_assert(sizeof(TwoLevelParams) == 496, "TwoLevelParams");
static_assert(offsetof(TwoLevelParams, src_in) == 128 &&
                  offsetof(TwoLevelParams, origin_peers) == 136 &&
                  offsetof(TwoLevelParams, row_off) == 200 &&
                  offsetof(TwoLevelParams, num_tokens) == 456 &&
                  offsetof(TwoLevelParams, recv_rows) == 484 &&
                  offsetof(TwoLevelParams, origin_rows) == 492,
              "TwoLevelParams offsets");

// moe_ep_two_level_wait_chunks (two_level.cu): the two-level combine's hop
// stream waits, before one round of its hop, until every chunk it sends in
// that round is complete: done[chunk[i]] >= need[i] for i < count (the
// counters CombineParams::done of the node combine running beside it).
// op: the node group's (its error sink, timeout and rank); a chunk not
// complete within the timeout is MOE_EP_CTR_HOP_DEPARTURE, naming peer[i],
// the rail peer it goes to.
struct ChunkWaitParams {
  OpCommon op;
  const unsigned long long* done;
  int32_t count, _pad;
  int32_t chunk[MOE_EP_MAX_NODES];
  int32_t peer[MOE_EP_MAX_NODES];
  uint64_t need[MOE_EP_MAX_NODES];
};
static_assert(sizeof(ChunkWaitParams) == 1280, "ChunkWaitParams");
static_assert(offsetof(ChunkWaitParams, done) == 240 && offsetof(ChunkWaitParams, chunk) == 256 &&
                  offsetof(ChunkWaitParams, need) == 768,
              "ChunkWaitParams offsets");

// Offsets src/ops/abi.rs checks too (param_offsets_match_the_c_layout).
static_assert(offsetof(OpCommon, ws) == 40 && offsetof(OpCommon, w) == 104 &&
                  offsetof(OpCommon, error) == 184 && offsetof(OpCommon, timeout_ns) == 192 &&
                  offsetof(OpCommon, rank) == 200 && offsetof(OpCommon, layout) == 224 &&
                  offsetof(OpCommon, num_blocks) == 236,
              "OpCommon offsets");
static_assert(offsetof(LayoutParams, topk_idx) == 240 && offsetof(RefusalParams, desc) == 240,
              "LayoutParams offsets");
static_assert(offsetof(DispatchParams, x) == 240 && offsetof(DispatchParams, scale_w) == 256 &&
                  offsetof(DispatchParams, recv_x) == 264 && offsetof(DispatchParams, recv_src) == 456 &&
                  offsetof(DispatchParams, desc) == 520 &&
                  offsetof(DispatchParams, meta) == 576 &&
                  offsetof(DispatchParams, arrive) == 640 &&
                  offsetof(DispatchParams, arrive_epoch) == 664 &&
                  offsetof(DispatchParams, xs) == 672 && offsetof(DispatchParams, recv_xs) == 680 &&
                  offsetof(DispatchParams, row16) == 744 && offsetof(DispatchParams, zero_pad) == 752,
              "DispatchParams offsets");
static_assert(offsetof(CombineParams, y) == 240 && offsetof(CombineParams, out) == 264 &&
                  offsetof(CombineParams, y_peers) == 280 && offsetof(CombineParams, gw_peers) == 344 &&
                  offsetof(CombineParams, num_chunks) == 408 &&
                  offsetof(CombineParams, desc) == 416 && offsetof(CombineParams, done) == 472,
              "CombineParams offsets");
