//! The low-latency (decode) mode: [`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch) and
//! [`EpGroup::ll_combine`](crate::EpGroup::ll_combine) (and their two-phase forms) of a group made with
//! [`Mode::LowLatency`](crate::Mode::LowLatency). There is no layout pass:
//! every row has a fixed place that depends only on its source rank and
//! token, and counts travel with the data, so a call needs no host work
//! beyond its checks, never synchronises the host, allocates nothing and is
//! capturable in a CUDA graph. The results are defined by the CPU reference
//! ([`crate::reference::ll_dispatch`], [`crate::reference::ll_combine_emulated`],
//! [`crate::reference::quantize_fp8`]) and match it bit for bit.
//!
//! ```no_run
//! # use moe_ep::{bf16, cuda::CudaSlice, Communicator, EpGroup, Fp8Scaling, GroupConfig};
//! # use moe_ep::{LlDispatchArgs, LlInput, LlLayout, Mode, TopkIdx};
//! # fn step(comm: &std::sync::Arc<Communicator>, x: &CudaSlice<bf16>, idx: &CudaSlice<i64>,
//! #         w: &CudaSlice<f32>, y: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
//! let stream = comm.context().default_stream();
//! let mut cfg = GroupConfig::new(256, 7168, 128); // experts, hidden, max tokens per rank
//! cfg.mode = Mode::LowLatency;
//! let group = EpGroup::new(comm, cfg)?; // collective; fixes the buffers
//! let h = group.ll_dispatch(&stream, LlDispatchArgs {
//!     x: LlInput::Bf16(x),
//!     topk_idx: TopkIdx::I64(idx),
//!     topk: 8,
//!     topk_weights: w,
//!     layout: LlLayout::ExpertMajor,
//!     cast_fp8: Some(Fp8Scaling::Exact),
//! })?;
//! // ... experts on h.fp8_codes() / h.fp8_scales(), h.tokens_per_local_expert() rows each,
//! //     writing bf16 rows in the same layout into y ...
//! group.ll_combine(&stream, &h, y, None, out)?; // out [T, H] bf16
//! # Ok(()) }
//! ```
//!
//! # Layouts
//!
//! With `R` ranks, `El = E / R` experts per rank, `M = max_tokens_per_rank`
//! (see [`crate::reference::ll_dispatch`] for the exact contents):
//!
//! * [`LlLayout::ExpertMajor`]: `[El, R * M, H]` rows; block `j` holds the
//!   (token, expert) pairs of local expert `j`, packed from its start by
//!   source rank then token; `tokens_per_local_expert[j]` of them are
//!   counted. Each row has its `src` (rank, token). No weights travel: combine
//!   weights the rows on the home rank.
//! * [`LlLayout::RankMajor`]: `[R, M, H]` rows, row `s * M + t` = token `t`
//!   of rank `s`, with the token's own `K` slots of local expert ids (`-1` =
//!   not here) and weights. Combine sums each home token's rows over ranks:
//!   the expert ranks weight and reduce their experts' outputs into the row
//!   first.
//!
//! Rows are bf16, or fp8 e4m3 codes (`H` bytes, rows `H` bytes apart) with
//! `H / 128` f32 scales each: cast by the sender ([`Fp8Scaling`]), or the
//! caller's own fp8 rows forwarded as they are. A token crosses to a rank at
//! most once; the receiver writes its extra copies for its other experts.
//!
//! # Buffers
//!
//! Fixed when the group is made, in two sets: batch `n` of the group uses
//! set `n mod 2` (the group counts), so batch `n + 1` can be dispatched
//! while batch `n`'s combine is pending. A set is reused only after the
//! combine of its previous batch (the dispatch is refused otherwise), and a
//! handle's outputs stay valid until then. Sizes in bytes, with `R`, `E`,
//! `El`, `M`, `H` as above, `NB = ceil(H / 128)`, `KM = 16` (the largest
//! top-k), each region rounded up to 256 bytes (the same text is on
//! [`ll_buffer_bytes`], which computes it):
//!
//! ```text
//! symmetric (the group's pool), per set:
//!   R * 132 * 32  + R * 132 * 8                     dispatch and combine signals
//!   R * M * 2H    + R * M * 4 NB                    received rows (rank-major output), scales
//!   R * M * 8     + 2 * R * M * KM * 4              sources, slots' local ids and weights
//!   M * KM * 2H                                     combine rows arriving home
//! local (device memory of this rank), per set:
//!   E * M * 2H    + E * M * 4 NB  + E * M * 8       expert-major rows, scales, sources
//!   4 (El + E + R) + 2 * M * KM * 4 + 8             counts, the home's routing, sequence
//!   E * M * 4     + 4 (E + 1)     + 8               staged expert-major order, offsets, ticket
//!   M * KM * 4                                      the home's rows of its local slots
//! plus 132 * 8 bytes of counters; everything times 2 sets.
//! ```
//!
//! About `4 H M (E + R + 16)` bytes in all: 1.04 GB for `E = 256`, `R = 8`,
//! `M = 128`, `H = 7168` (0.09 GB of it symmetric).
//!
//! # Ordering
//!
//! Each op is two kernels on the caller's stream: dispatch's send (writes
//! every peer's rows, then one signal per block and rank carrying the
//! batch's sequence number, from a device counter) and wait (bounded waits
//! for every sender's signals, then the counts and, expert-major, the
//! packing); combine's send (every expert output row to its home, then
//! signals) and wait (bounded waits, then the fixed-order sums). The
//! two-phase forms (`*_send` / `*_wait`) let a runtime put other work
//! between them, e.g. the other micro-batch's. Why a set may be reused after
//! its combine: the home's combine wait of batch `n` sees every rank's
//! combine send of `n`, which follows that rank's dispatch wait of `n`; so
//! no rank still reads set `n mod 2` when any rank's dispatch of `n + 2`
//! (after its own combine wait of `n`) writes it.
//!
//! Errors only the GPU sees (an expert id outside `[-1, E)` or repeated in a
//! token, ranks that disagree on topk, layout or payload) travel in the
//! signals: every rank's dispatch wait finds the same error, every rank's
//! kernels skip from there on, and every op refuses until `check()`, as in
//! the high-throughput mode. A peer that never signals is a bounded
//! `Error::PeerTimeout` naming the rank, the peer and the counter
//! (`low-latency dispatch` / `low-latency combine`).
//!
//! Files: the kernels in `kernels.rs`, the buffers and their sizes in
//! `buffers.rs`, the API's types ([`LlHandle`], [`LlDispatchArgs`], ...)
//! in `handle.rs`, the ops on the group in `ops.rs`.
//!
//! Kernels: `kernels-cuda/low_latency.cu`. Tests: `tests/gpu_low_latency.rs`
//! (GPU), `tests/cpu_api.rs` (the config).

pub(crate) mod buffers;
pub(crate) mod handle;
pub(crate) mod kernels;
mod ops;

pub use buffers::{ll_buffer_bytes, LlBufferBytes};
pub use handle::{LlCombineSent, LlDispatchArgs, LlDispatchSent, LlHandle, LlInput, LlView};
