//! The low-latency (decode) mode: [`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch) and
//! [`EpGroup::ll_combine`](crate::EpGroup::ll_combine) (and their two-phase forms) of a group made with
//! [`Mode::LowLatency`](super::Mode::LowLatency). There is no layout pass:
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
//! Kernels: `kernels-cuda/low_latency.cu`. Tests: `tests/gpu_low_latency.rs`
//! (GPU), `tests/cpu_api.rs` (the config).

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use super::abi::{
    ll_cast, ll_payload, LayoutKind, LlBufs, LlParams, LlSignal, OpCommon, FP8_BLOCK, LL_SETS,
    MAX_BLOCKS, MAX_TOPK, THREADS,
};
use super::buffers::{DeviceRegion, DeviceRegionMut, TopkIdx, ROW_ALIGN};
use super::group::{GroupConfig, NodeGroup};
use super::handle::{OpTurn, Refuse};
use super::layout::tokens_of_routing;
use crate::error::{Error, Result};
use crate::runtime::{Communicator, Function, Module};
use crate::symm::{SymmBuffer, SymmPool};

pub use crate::types::{Fp8Scaling, LlLayout};

// ---- kernels ----

/// The entry points of `kernels-cuda/low_latency.cu`.
pub(crate) const LL_SEND: [&str; 2] =
    ["moe_ep_ll_dispatch_send_i32", "moe_ep_ll_dispatch_send_i64"];
/// `[rank-major, expert-major]`.
pub(crate) const LL_RECV: [&str; 2] = [
    "moe_ep_ll_dispatch_recv_rank_major",
    "moe_ep_ll_dispatch_recv_expert_major",
];
/// Expert-major only: the counted rows into their experts' blocks.
pub(crate) const LL_COPY: &str = "moe_ep_ll_dispatch_copy_expert_major";
pub(crate) const LL_COMBINE_SEND: [&str; 2] = [
    "moe_ep_ll_combine_send_rank_major",
    "moe_ep_ll_combine_send_expert_major",
];
pub(crate) const LL_COMBINE_RECV: [&str; 2] = [
    "moe_ep_ll_combine_recv_rank_major",
    "moe_ep_ll_combine_recv_expert_major",
];

/// The low-latency kernels, loaded for a group of that mode.
pub(crate) struct LlKernels {
    send: [Function; 2],
    recv: [Function; 2],
    copy: Function,
    combine_send: [Function; 2],
    combine_recv: [Function; 2],
}

impl LlKernels {
    pub(crate) fn load(comm: &Communicator) -> Result<LlKernels> {
        let m = Module::get(comm.context(), "low_latency")?;
        let two = |n: [&'static str; 2]| -> Result<[Function; 2]> {
            Ok([m.function(n[0])?, m.function(n[1])?])
        };
        Ok(LlKernels {
            send: two(LL_SEND)?,
            recv: two(LL_RECV)?,
            copy: m.function(LL_COPY)?,
            combine_send: two(LL_COMBINE_SEND)?,
            combine_recv: two(LL_COMBINE_RECV)?,
        })
    }
    /// Every kernel (none takes dynamic shared memory).
    pub(crate) fn all(&self) -> impl Iterator<Item = &Function> {
        self.send
            .iter()
            .chain(&self.recv)
            .chain(std::iter::once(&self.copy))
            .chain(&self.combine_send)
            .chain(&self.combine_recv)
    }
}

/// `[rank-major, expert-major]` index of a layout.
fn li(layout: LlLayout) -> usize {
    match layout {
        LlLayout::RankMajor => 0,
        LlLayout::ExpertMajor => 1,
    }
}

// ---- buffers ----

/// Bytes of a low-latency group's buffers, both sets ([`ll_buffer_bytes`]
/// has the formula).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlBufferBytes {
    /// Symmetric memory from the group's pool (written by the peers).
    pub symmetric: u64,
    /// Plain device memory of the rank (the expert-major rows and counts).
    pub local: u64,
}

impl LlBufferBytes {
    /// Both together.
    pub fn total(&self) -> u64 {
        self.symmetric + self.local
    }
}

/// Region offsets (no addresses yet) and the totals of both buffers.
fn carve(world: usize, cfg: &GroupConfig) -> (LlBufs, LlBufferBytes) {
    let (r, m, h) = (
        world as u64,
        cfg.max_tokens_per_rank as u64,
        cfg.hidden as u64,
    );
    let e = cfg.num_experts as u64;
    let el = e.checked_div(r).unwrap_or(0);
    let nb = h.div_ceil(FP8_BLOCK as u64);
    let (km, mb) = (MAX_TOPK as u64, MAX_BLOCKS as u64);
    struct Carver(u64);
    impl Carver {
        fn take(&mut self, bytes: u64) -> u64 {
            let off = self.0;
            self.0 = (self.0 + bytes).div_ceil(256) * 256;
            off
        }
    }
    let mut b = LlBufs::default();
    let mut s = Carver(0);
    b.sig_dispatch = s.take(r * mb * std::mem::size_of::<LlSignal>() as u64);
    b.sig_combine = s.take(r * mb * 8);
    b.recv_x = s.take(r * m * 2 * h);
    b.recv_scales = s.take(r * m * 4 * nb);
    b.recv_src = s.take(r * m * 8);
    b.recv_idx = s.take(r * m * km * 4);
    b.recv_w = s.take(r * m * km * 4);
    b.comb = s.take(m * km * 2 * h);
    b.sym_set_bytes = s.0;
    let mut l = Carver(0);
    let rows = el * r * m;
    b.em_x = l.take(rows * 2 * h);
    b.em_scales = l.take(rows * 4 * nb);
    b.em_src = l.take(rows * 8);
    b.counts = l.take((el + el * r + r) * 4);
    b.home_topk = l.take(m * km * 4);
    b.home_w = l.take(m * km * 4);
    b.set_seq = l.take(8);
    b.em_stage = l.take(e * m * 4);
    b.em_off = l.take((e + 1) * 4);
    b.ticket = l.take(8);
    b.home_row = l.take(m * km * 4);
    b.local_set_bytes = l.0;
    b.counters = LL_SETS as u64 * b.local_set_bytes;
    let bytes = LlBufferBytes {
        symmetric: LL_SETS as u64 * b.sym_set_bytes,
        local: b.counters + mb * 8,
    };
    (b, bytes)
}

/// The bytes a [`Mode::LowLatency`](super::Mode::LowLatency) group of
/// `cfg` over `world` ranks allocates for its buffers, fixed at creation.
/// (The high-throughput workspace every group has comes on top.)
///
/// Two sets (batch `n` of the group uses set `n mod 2`, so one batch can be
/// dispatched while the other's combine is pending). With `R = world`, `E`
/// experts, `El = E / R`, `M = max_tokens_per_rank`, `H = hidden`,
/// `NB = ceil(H / 128)`, `KM = 16` (the largest top-k), each region rounded
/// up to 256 bytes:
///
/// ```text
/// symmetric (the group's pool), per set:
///   R * 132 * 32  + R * 132 * 8                     dispatch and combine signals
///   R * M * 2H    + R * M * 4 NB                    received rows (rank-major output), scales
///   R * M * 8     + 2 * R * M * KM * 4              sources, slots' local ids and weights
///   M * KM * 2H                                     combine rows arriving home
/// local (device memory of this rank), per set:
///   E * M * 2H    + E * M * 4 NB  + E * M * 8       expert-major rows, scales, sources
///   4 (El + E + R) + 2 * M * KM * 4 + 8             counts, the home's routing, sequence
///   E * M * 4     + 4 (E + 1)     + 8               staged expert-major order, offsets, ticket
///   M * KM * 4                                      the home's rows of its local slots
/// plus 132 * 8 bytes of counters; everything times 2 sets.
/// ```
///
/// About `4 H M (E + R + 16)` bytes in all: 1.04 GB for `E = 256`, `R = 8`,
/// `M = 128`, `H = 7168` (0.09 GB of it symmetric).
pub fn ll_buffer_bytes(cfg: &GroupConfig, world: usize) -> LlBufferBytes {
    carve(world, cfg).1
}

/// Where a buffer set's batch is, on the host (see [`LlState`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Never used, or reset after an error.
    Free,
    /// Dispatch sent, not waited for.
    Sent,
    /// Dispatched: the handle's outputs are there.
    Received,
    /// Combine sent, not waited for.
    CombineSent,
    /// Combined: the set may take the next batch.
    Combined,
}

/// Which set the next batch takes, and where each set's batch is.
struct LlState {
    next_set: usize,
    generation: u64,
    sets: [(u64, Phase); LL_SETS],
}

/// A low-latency group's buffers and the host's view of its two sets.
pub(crate) struct LlBuffers {
    /// Held for the group's lifetime; the kernels reach them through `bufs`.
    _sym: SymmBuffer<u8>,
    _local: CudaSlice<u8>,
    bufs: LlBufs,
    state: Mutex<LlState>,
}

impl LlBuffers {
    /// Allocates (collectively) and zeroes both buffers on `stream`; the
    /// caller synchronises `stream` before any peer may write (the group's
    /// creation barrier).
    pub(crate) fn new(
        comm: &Communicator,
        pool: &SymmPool,
        stream: &Arc<CudaStream>,
        cfg: &GroupConfig,
    ) -> Result<LlBuffers> {
        let world = comm.world();
        let (mut bufs, bytes) = carve(world, cfg);
        let too_big = |what: &'static str| {
            move |_| {
                Error::arg(
                    what,
                    "low-latency buffers whose size fits usize",
                    "too large",
                )
            }
        };
        let sym_len = usize::try_from(bytes.symmetric).map_err(too_big("max_tokens_per_rank"))?;
        let local_len = usize::try_from(bytes.local).map_err(too_big("max_tokens_per_rank"))?;
        let sym: SymmBuffer<u8> = pool.alloc(sym_len)?;
        for (rank, p) in bufs.sym.iter_mut().enumerate().take(world) {
            *p = sym.peer_ptr(rank).ok_or_else(|| {
                Error::InvalidState(format!(
                    "rank {rank} is not NVLink-reachable from rank {}",
                    comm.rank()
                ))
            })?;
        }
        // SAFETY: the range is the buffer just allocated; the caller's
        // barrier keeps peers from writing before it is zeroed.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                sym.device_ptr(),
                0,
                sym_len,
                stream.cu_stream(),
            )
        }
        .map_err(Error::cuda("cuMemsetD8Async"))?;
        let local = stream
            .alloc_zeros::<u8>(local_len)
            .map_err(Error::cuda("cuMemAlloc"))?;
        bufs.local = DeviceRegion::device_ptr(&local);
        Ok(LlBuffers {
            _sym: sym,
            _local: local,
            bufs,
            state: Mutex::new(LlState {
                next_set: 0,
                generation: 0,
                sets: [(0, Phase::Free); LL_SETS],
            }),
        })
    }

    /// The batches this rank's sends have counted (every block's counter
    /// moves in step; block 0's), read after `stream`'s work (the caller
    /// has waited for it).
    pub(crate) fn batches_sent(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        let mut v = [0u64; 1];
        // SAFETY: the counters lie in the local buffer; nothing runs on it.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut v,
                self.bufs.local + self.bufs.counters,
                stream.cu_stream(),
            )
        }
        .map_err(Error::cuda("cuMemcpyDtoHAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        Ok(v[0])
    }

    /// After an error (`NodeGroup::check`, on every rank): both sets take new
    /// batches again, the next in set 0, and every block's counter is
    /// `sent` (the most any rank counted), so that every rank's next batch
    /// has the same sequence number, above any its sets' signals hold.
    pub(crate) fn realign(&self, stream: &Arc<CudaStream>, sent: u64) -> Result<()> {
        let counters = vec![sent; MAX_BLOCKS];
        // SAFETY: [MAX_BLOCKS] u64 at `counters` in the local buffer; no
        // kernel of the group runs (the caller waited for its work).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                self.bufs.local + self.bufs.counters,
                &counters,
                stream.cu_stream(),
            )
        }
        .map_err(Error::cuda("cuMemcpyHtoDAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.next_set = 0;
        for s in &mut st.sets {
            s.1 = Phase::Free;
        }
        Ok(())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LlState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sym_set(&self, me: usize, set: usize) -> u64 {
        self.bufs.sym[me] + set as u64 * self.bufs.sym_set_bytes
    }
    fn local_set(&self, set: usize) -> u64 {
        self.bufs.local + set as u64 * self.bufs.local_set_bytes
    }
}

// ---- the API's types ----

/// The token rows a low-latency dispatch sends.
pub enum LlInput<'a> {
    /// `[T, H]` bf16 (sent as bf16, or cast to fp8 with `cast_fp8`).
    Bf16(&'a dyn DeviceRegion<bf16>),
    /// The caller's fp8 rows, forwarded as they are: `codes` `[T, H]` e4m3,
    /// `scales` `[T, H / 128]` f32 (`x ≈ e4m3(code) * scale`).
    Fp8 {
        codes: &'a dyn DeviceRegion<u8>,
        scales: &'a dyn DeviceRegion<f32>,
    },
}

/// What a low-latency dispatch sends ([`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch),
/// [`EpGroup::ll_dispatch_send`](crate::EpGroup::ll_dispatch_send)).
pub struct LlDispatchArgs<'a> {
    /// This rank's token rows, `[T, H]`.
    pub x: LlInput<'a>,
    /// `[T, topk]` expert ids (-1: not routed).
    pub topk_idx: TopkIdx<'a>,
    /// Experts per token, 1..=8 (the kernels' `MAX_TOPK`).
    pub topk: usize,
    /// `[T, topk]` f32 weights.
    pub topk_weights: &'a dyn DeviceRegion<f32>,
    /// The receive layout.
    pub layout: LlLayout,
    /// `Some`: bf16 rows cast to fp8 on the sender, per 128 values, with
    /// this scaling ([`crate::reference::quantize_fp8`], bit for bit).
    pub cast_fp8: Option<Fp8Scaling>,
}

/// What a batch is, as the host knows it.
#[derive(Clone, Copy, Debug)]
struct LlBatch {
    group: u64,
    set: usize,
    generation: u64,
    layout: LlLayout,
    fp8: bool,
    num_tokens: usize,
    topk: usize,
}

/// A dispatch that was sent ([`EpGroup::ll_dispatch_send`](crate::EpGroup::ll_dispatch_send)); give it to
/// [`EpGroup::ll_dispatch_wait`](crate::EpGroup::ll_dispatch_wait) for the received rows.
#[must_use = "a sent dispatch must be waited for (ll_dispatch_wait) before its set is reused"]
#[derive(Debug)]
pub struct LlDispatchSent {
    b: LlBatch,
}

/// A combine that was sent ([`EpGroup::ll_combine_send`](crate::EpGroup::ll_combine_send)); give it to
/// [`EpGroup::ll_combine_wait`](crate::EpGroup::ll_combine_wait) for the output.
#[must_use = "a sent combine must be waited for (ll_combine_wait)"]
#[derive(Debug)]
pub struct LlCombineSent {
    b: LlBatch,
}

// A wait takes its sent op by reference: one that was refused (a short
// `out`, the wrong stream) can be waited for again once the call is fixed;
// a second wait of one that ran is refused by the group's phase check.
impl LlDispatchSent {
    /// The buffer set (0 or 1) the batch is in.
    pub fn buffer_set(&self) -> usize {
        self.b.set
    }
}

/// A read-only view of a low-latency output: `len()` elements of `T` at a
/// device address in the group's buffers. Valid (the batch's data) until
/// the next dispatch into the batch's set.
pub struct LlView<'a, T> {
    ptr: u64,
    len: usize,
    _p: PhantomData<&'a T>,
}

impl<T> LlView<'_, T> {
    fn new(ptr: u64, len: usize) -> Self {
        LlView {
            ptr,
            len,
            _p: PhantomData,
        }
    }
}

// SAFETY: a range inside the group's low-latency buffers, which the view's
// lifetime (borrowing the handle, which borrows the group) keeps allocated.
unsafe impl<T> DeviceRegion<T> for LlView<'_, T> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// The result of a low-latency dispatch: where its rows and counts are on
/// this rank (views into the group's buffer set), for the experts and for
/// [`EpGroup::ll_combine`](crate::EpGroup::ll_combine). All arrays are on the device.
pub struct LlHandle {
    group: Arc<NodeGroup>,
    b: LlBatch,
}

impl LlHandle {
    /// The receive layout.
    pub fn layout(&self) -> LlLayout {
        self.b.layout
    }
    /// This rank's tokens `T` in the dispatch.
    pub fn num_tokens(&self) -> usize {
        self.b.num_tokens
    }
    /// Top-k.
    pub fn topk(&self) -> usize {
        self.b.topk
    }
    /// True when the rows are fp8 (cast by the senders, or the callers').
    pub fn is_fp8(&self) -> bool {
        self.b.fp8
    }
    /// The buffer set (0 or 1) holding the batch.
    pub fn buffer_set(&self) -> usize {
        self.b.set
    }
    /// Rows of the layout: expert-major `El * R * M`, rank-major `R * M`
    /// (only the counted ones are defined: expert-major the first
    /// `tokens_per_local_expert[j]` of each block `j`, rank-major rows
    /// `s * M + t` with `t < tokens_from_rank[s]`).
    pub fn num_rows(&self) -> usize {
        let (r, m) = (self.group.comm.world(), self.group.cfg.max_tokens_per_rank);
        match self.b.layout {
            LlLayout::ExpertMajor => self.group.experts_per_rank() * r * m,
            LlLayout::RankMajor => r * m,
        }
    }
    fn bufs(&self) -> &LlBuffers {
        self.group.ll.as_ref().expect("a low-latency group")
    }
    fn sym(&self, off: u64) -> u64 {
        self.bufs().sym_set(self.group.comm.rank(), self.b.set) + off
    }
    fn local(&self, off: u64) -> u64 {
        self.bufs().local_set(self.b.set) + off
    }
    /// Address of the rows and of their scales.
    fn rows_at(&self) -> (u64, u64) {
        let b = &self.bufs().bufs;
        match self.b.layout {
            LlLayout::ExpertMajor => (self.local(b.em_x), self.local(b.em_scales)),
            LlLayout::RankMajor => (self.sym(b.recv_x), self.sym(b.recv_scales)),
        }
    }
    /// `[rows, H]` bf16 rows; `None` for fp8 rows.
    pub fn tokens(&self) -> Option<LlView<'_, bf16>> {
        let h = self.group.cfg.hidden;
        (!self.b.fp8).then(|| LlView::new(self.rows_at().0, self.num_rows() * h))
    }
    /// `[rows, H]` e4m3 codes (rows `H` bytes apart); `None` for bf16 rows.
    pub fn fp8_codes(&self) -> Option<LlView<'_, u8>> {
        let h = self.group.cfg.hidden;
        self.b
            .fp8
            .then(|| LlView::new(self.rows_at().0, self.num_rows() * h))
    }
    /// `[rows, H / 128]` f32 scales of the fp8 rows; `None` for bf16 rows.
    pub fn fp8_scales(&self) -> Option<LlView<'_, f32>> {
        let nb = self.group.cfg.hidden / FP8_BLOCK;
        self.b
            .fp8
            .then(|| LlView::new(self.rows_at().1, self.num_rows() * nb))
    }
    /// `[rows, 2]` i32 (source rank, source token) per row; `(-1, -1)` for a
    /// counted rank-major row that carries no token.
    pub fn src(&self) -> LlView<'_, i32> {
        let b = &self.bufs().bufs;
        let at = match self.b.layout {
            LlLayout::ExpertMajor => self.local(b.em_src),
            LlLayout::RankMajor => self.sym(b.recv_src),
        };
        LlView::new(at, self.num_rows() * 2)
    }
    /// Rank-major `[R * M, K]` i32: the local expert of each of the row's
    /// token's slots, `-1` where that expert is not here. `None` for
    /// expert-major.
    pub fn topk_local_idx(&self) -> Option<LlView<'_, i32>> {
        let at = self.sym(self.bufs().bufs.recv_idx);
        (self.b.layout == LlLayout::RankMajor)
            .then(|| LlView::new(at, self.num_rows() * self.b.topk))
    }
    /// Rank-major `[R * M, K]` f32: the slots' weights, `0.0` where the
    /// expert is not here. `None` for expert-major.
    pub fn topk_weights(&self) -> Option<LlView<'_, f32>> {
        let at = self.sym(self.bufs().bufs.recv_w);
        (self.b.layout == LlLayout::RankMajor)
            .then(|| LlView::new(at, self.num_rows() * self.b.topk))
    }
    /// `[El]` i32: (token, expert) pairs received per local expert (the
    /// counted rows of each expert-major block).
    pub fn tokens_per_local_expert(&self) -> LlView<'_, i32> {
        let el = self.group.experts_per_rank();
        LlView::new(self.local(self.bufs().bufs.counts), el)
    }
    /// `[El * R]` i32: `[j * R + s]` = pairs of local expert `j` from rank `s`.
    pub fn tokens_per_expert_source(&self) -> LlView<'_, i32> {
        let (el, r) = (self.group.experts_per_rank(), self.group.comm.world());
        LlView::new(self.local(self.bufs().bufs.counts) + el as u64 * 4, el * r)
    }
    /// `[R]` i32: every rank's token count `T_s` (the counted rank-major rows).
    pub fn tokens_from_rank(&self) -> LlView<'_, i32> {
        let (el, r) = (self.group.experts_per_rank(), self.group.comm.world());
        let off = (el + el * r) as u64 * 4;
        LlView::new(self.local(self.bufs().bufs.counts) + off, r)
    }
}

// ---- the ops ----

/// What a dispatch send launches with, checked.
struct SendCall {
    x: u64,
    x_scales: u64,
    topk_idx: u64,
    idx_i64: bool,
    topk_w: u64,
    fp8: bool,
    cast: i32,
}

impl NodeGroup {
    fn ll_buffers(&self) -> Result<&LlBuffers> {
        self.ll.as_ref().ok_or_else(|| {
            Error::arg(
                "mode",
                "a group made with Mode::LowLatency (its buffers are fixed at creation)",
                "HighThroughput",
            )
        })
    }

    /// The parameters every low-latency kernel of batch `b` starts from.
    fn ll_params(&self, ll: &LlBuffers, b: &LlBatch) -> LlParams {
        let layout = match b.layout {
            LlLayout::RankMajor => LayoutKind::RankMajor,
            LlLayout::ExpertMajor => LayoutKind::ExpertMajor,
        };
        LlParams {
            op: OpCommon {
                ws: self.ws_peers,
                w: self.w,
                error: self.error.device_ptr(),
                timeout_ns: self.timeout_ns(),
                rank: self.comm.rank() as i32,
                world: self.comm.world() as i32,
                num_tokens: b.num_tokens as i32,
                hidden: self.cfg.hidden as i32,
                topk: b.topk as i32,
                num_experts: self.cfg.num_experts as i32,
                layout,
                alignment: 1,
                recv_capacity: 0,
                num_blocks: self.cfg.num_sms as i32,
                ..Default::default()
            },
            b: ll.bufs,
            set: b.set as i32,
            max_tokens: self.cfg.max_tokens_per_rank as i32,
            payload: if b.fp8 {
                ll_payload::FP8
            } else {
                ll_payload::BF16
            },
            ..Default::default()
        }
    }

    fn ll_launch(&self, stream: &Arc<CudaStream>, f: &Function, p: &LlParams) -> Result<()> {
        // SAFETY: p mirrors LlParams; every buffer was checked by the
        // caller or lies in the group's low-latency buffers, which outlive
        // the enqueued work (dropping the group waits for it).
        unsafe { f.launch(stream, self.cfg.num_sms as u32, THREADS, 0, p) }
    }

    fn ll_kernels(&self) -> &LlKernels {
        self.k
            .ll
            .as_ref()
            .expect("a low-latency group loads its kernels")
    }

    /// Checks that batch `b` is this group's and its set's latest, in
    /// phase `from`, for `op`.
    fn ll_expect(&self, ll: &LlBuffers, b: &LlBatch, from: Phase, op: &str) -> Result<()> {
        if b.group != self.id {
            return Err(Error::arg(
                "handle",
                format!("a low-latency batch of this group (group {})", self.id),
                format!("one of group {}", b.group),
            ));
        }
        let (generation, phase) = ll.state().sets[b.set];
        if generation != b.generation {
            return Err(Error::arg(
                "handle",
                format!(
                    "the latest batch of buffer set {} (a later dispatch reused the set)",
                    b.set
                ),
                "a handle of an earlier batch",
            ));
        }
        if phase != from {
            return Err(Error::InvalidState(format!(
                "{op}: the batch in buffer set {} is {phase:?}, not {from:?} (each batch is sent, waited for, combine-sent and combine-waited once, in that order)",
                b.set
            )));
        }
        Ok(())
    }

    fn ll_set_phase(&self, ll: &LlBuffers, b: &LlBatch, to: Phase) {
        ll.state().sets[b.set].1 = to;
    }

    /// The checks of a dispatch send (on the op's turn).
    fn ll_check_send(&self, a: &LlDispatchArgs<'_>) -> Result<(usize, SendCall)> {
        let (x, topk_idx, topk, topk_weights, cast_fp8) =
            (&a.x, &a.topk_idx, a.topk, a.topk_weights, a.cast_fp8);
        let h = self.cfg.hidden;
        // topk, then topk_idx's shape and tokens: the layout's checks.
        let (idx_ptr, idx_len) = topk_idx.ptr_len();
        let t = tokens_of_routing(topk, idx_len, &self.cfg)?;
        let idx_i64 = match topk_idx {
            TopkIdx::I32(b) => {
                self.check_region("topk_idx", *b, t * topk, "[T, K] i32", 4)?;
                false
            }
            TopkIdx::I64(b) => {
                self.check_region("topk_idx", *b, t * topk, "[T, K] i64", 8)?;
                true
            }
        };
        self.check_region("topk_weights", topk_weights, t * topk, "[T, K] f32", 4)?;
        let fp8_hidden = || {
            if h.is_multiple_of(FP8_BLOCK) {
                Ok(())
            } else {
                Err(Error::arg(
                    "hidden",
                    "a multiple of 128 for fp8 rows (one scale per 128 values)",
                    h,
                ))
            }
        };
        let call = match (x, cast_fp8) {
            (LlInput::Bf16(x), cast) => {
                if cast.is_some() {
                    fp8_hidden()?;
                }
                self.check_region("x", *x, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
                SendCall {
                    x: x.device_ptr(),
                    x_scales: 0,
                    topk_idx: idx_ptr,
                    idx_i64,
                    topk_w: topk_weights.device_ptr(),
                    fp8: cast.is_some(),
                    cast: match cast {
                        None => ll_cast::NONE,
                        Some(Fp8Scaling::Exact) => ll_cast::EXACT,
                        Some(Fp8Scaling::PowerOfTwo) => ll_cast::POW2,
                    },
                }
            }
            (LlInput::Fp8 { .. }, Some(_)) => {
                return Err(Error::arg(
                    "cast_fp8",
                    "None for fp8 input (the caller's rows are sent as they are)",
                    "Some",
                ))
            }
            (LlInput::Fp8 { codes, scales }, None) => {
                fp8_hidden()?;
                self.check_region("x", *codes, t * h, "[T, hidden] e4m3 codes", ROW_ALIGN)?;
                self.check_region(
                    "x_scales",
                    *scales,
                    t * (h / FP8_BLOCK),
                    "[T, hidden / 128] f32",
                    4,
                )?;
                SendCall {
                    x: codes.device_ptr(),
                    x_scales: scales.device_ptr(),
                    topk_idx: idx_ptr,
                    idx_i64,
                    topk_w: topk_weights.device_ptr(),
                    fp8: true,
                    cast: ll_cast::NONE,
                }
            }
        };
        Ok((t, call))
    }

    /// Dispatch send, on the op's turn.
    fn ll_send(&self, stream: &Arc<CudaStream>, a: LlDispatchArgs<'_>) -> Result<LlDispatchSent> {
        let ll = self.ll_buffers()?;
        let (t, call) = self.ll_check_send(&a)?;
        let (layout, topk) = (a.layout, a.topk);
        let (set, generation) = {
            let st = ll.state();
            let set = st.next_set;
            let (_, phase) = st.sets[set];
            if !matches!(phase, Phase::Free | Phase::Combined) {
                return Err(Error::InvalidState(format!(
                    "ll_dispatch: buffer set {set} still holds a batch that is {phase:?}: combine it (ll_combine, or ll_combine_send + ll_combine_wait) before dispatching a third batch"
                )));
            }
            (set, st.generation + 1)
        };
        let b = LlBatch {
            group: self.id,
            set,
            generation,
            layout,
            fp8: call.fp8,
            num_tokens: t,
            topk,
        };
        let mut p = self.ll_params(ll, &b);
        p.x = call.x;
        p.x_scales = call.x_scales;
        p.topk_idx = call.topk_idx;
        p.topk_w = call.topk_w;
        p.cast = call.cast;
        self.ll_launch(stream, &self.ll_kernels().send[call.idx_i64 as usize], &p)?;
        let mut st = ll.state();
        st.generation = generation;
        st.sets[set] = (generation, Phase::Sent);
        st.next_set = (set + 1) % LL_SETS;
        Ok(LlDispatchSent { b })
    }

    /// Dispatch wait, on the op's turn.
    fn ll_recv(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        sent: &LlDispatchSent,
    ) -> Result<LlHandle> {
        let ll = self.ll_buffers()?;
        let b = sent.b;
        self.ll_expect(ll, &b, Phase::Sent, "ll_dispatch_wait")?;
        let p = self.ll_params(ll, &b);
        self.ll_launch(stream, &self.ll_kernels().recv[li(b.layout)], &p)?;
        if b.layout == LlLayout::ExpertMajor {
            self.ll_launch(stream, &self.ll_kernels().copy, &p)?;
        }
        self.ll_set_phase(ll, &b, Phase::Received);
        Ok(LlHandle {
            group: Arc::clone(self),
            b,
        })
    }

    /// The one-node path of [`EpGroup::ll_dispatch_send`](crate::EpGroup::ll_dispatch_send).
    pub fn ll_dispatch_send(
        &self,
        stream: &Arc<CudaStream>,
        args: LlDispatchArgs<'_>,
    ) -> Result<LlDispatchSent> {
        let layout = args.layout;
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_send(turn, layout, arg);
        self.op_with(
            "moe_ep::ll_dispatch_send",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            |_| self.ll_send(stream, args),
        )
    }

    /// A dispatch send this rank's host refused (argument `arg`), or made
    /// after an error of its own: the send kernel moves no rows and tells
    /// every receiver why (LlSignal), so that none waits for this rank, and
    /// the batch counts on every rank. Nothing when the set the batch would
    /// take still holds one (its receivers are not waiting for this batch).
    fn ll_refuse_send(&self, turn: &OpTurn<'_>, layout: LlLayout, arg: u64) -> Result<()> {
        let (Some(ll), Some(stream)) = (self.ll.as_ref(), turn.stream()) else {
            return Ok(());
        };
        let mut st = ll.state();
        let set = st.next_set;
        if !matches!(st.sets[set].1, Phase::Free | Phase::Combined) {
            return Ok(());
        }
        let generation = st.generation + 1;
        let b = LlBatch {
            group: self.id,
            set,
            generation,
            layout,
            fp8: false,
            num_tokens: 0,
            topk: 1,
        };
        let mut p = self.ll_params(ll, &b);
        p.refuse = arg as i32 + 1;
        self.ll_launch(stream, &self.ll_kernels().send[0], &p)?;
        st.generation = generation;
        st.sets[set] = (generation, Phase::Free);
        st.next_set = (set + 1) % LL_SETS;
        Ok(())
    }

    /// Waits (on the stream, bounded by the group's timeout) for every
    /// rank's rows of a sent dispatch and lays them out: the second half of
    /// [`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch).
    pub fn ll_dispatch_wait(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        sent: &LlDispatchSent,
    ) -> Result<LlHandle> {
        self.op_with(
            "moe_ep::ll_dispatch_wait",
            0,
            stream,
            None,
            Refuse::Quiet,
            |_| self.ll_recv(stream, sent),
        )
    }

    /// The one-node path of [`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch).
    pub fn ll_dispatch(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        args: LlDispatchArgs<'_>,
    ) -> Result<LlHandle> {
        let layout = args.layout;
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_send(turn, layout, arg);
        self.op_with(
            "moe_ep::ll_dispatch",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            |turn| {
                let sent = self.ll_send(stream, args)?;
                turn.launched.set(true);
                self.ll_recv(stream, &sent)
            },
        )
    }

    /// The checks of `expert_out`.
    fn ll_check_expert_out(
        &self,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
    ) -> Result<()> {
        let h = self.cfg.hidden;
        self.check_region(
            "expert_out",
            expert_out,
            handle.num_rows() * h,
            "[rows, hidden] bf16 in the dispatch's layout",
            ROW_ALIGN,
        )
    }

    /// The checks of a combine wait's `weights` and `out`: the weights'
    /// address, or 0 for the dispatch's.
    fn ll_check_wait(
        &self,
        b: &LlBatch,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &dyn DeviceRegionMut<bf16>,
    ) -> Result<u64> {
        let (t, k, h) = (b.num_tokens, b.topk, self.cfg.hidden);
        let w = match (weights, b.layout) {
            (None, _) => 0,
            (Some(_), LlLayout::RankMajor) => {
                return Err(Error::arg(
                    "weights",
                    "None for rank-major (each rank weights and sums its experts' outputs into the row before combine)",
                    "Some",
                ))
            }
            (Some(w), LlLayout::ExpertMajor) => {
                self.check_region("weights", w, t * k, "[T, K] f32", 4)?;
                w.device_ptr()
            }
        };
        self.check_region("out", out, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
        Ok(w)
    }

    fn ll_combine_send_on_turn(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        in_place: bool,
    ) -> Result<LlCombineSent> {
        let ll = self.ll_buffers()?;
        let b = handle.b;
        self.ll_expect(ll, &b, Phase::Received, "ll_combine_send")?;
        self.ll_check_expert_out(handle, expert_out)?;
        let mut p = self.ll_params(ll, &b);
        p.y = expert_out.device_ptr();
        p.in_place = in_place as i32;
        self.ll_launch(stream, &self.ll_kernels().combine_send[li(b.layout)], &p)?;
        self.ll_set_phase(ll, &b, Phase::CombineSent);
        Ok(LlCombineSent { b })
    }

    fn ll_combine_wait_on_turn(
        &self,
        stream: &Arc<CudaStream>,
        b: LlBatch,
        w: u64,
        out: u64,
        in_place_y: Option<u64>,
    ) -> Result<()> {
        let ll = self.ll_buffers()?;
        self.ll_expect(ll, &b, Phase::CombineSent, "ll_combine_wait")?;
        let mut p = self.ll_params(ll, &b);
        p.comb_w = w;
        p.out = out;
        if let Some(y) = in_place_y {
            p.y = y;
            p.in_place = 1;
        }
        self.ll_launch(stream, &self.ll_kernels().combine_recv[li(b.layout)], &p)?;
        self.ll_set_phase(ll, &b, Phase::Combined);
        Ok(())
    }

    /// Sends this rank's expert outputs home (the first half of
    /// [`EpGroup::ll_combine`](crate::EpGroup::ll_combine), whose docs say what `expert_out` holds);
    /// returns at once. Then [`EpGroup::ll_combine_wait`](crate::EpGroup::ll_combine_wait).
    pub fn ll_combine_send(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
    ) -> Result<LlCombineSent> {
        // NOTE: a refused combine tells no peer (a refusal signal in the
        // batch's set passed a corrected retry's wait for the same batch on
        // an H200, 2026-12-04): a peer's combine wait for a rank whose host
        // refused alone ends at the timeout.
        self.op_with(
            "moe_ep::ll_combine_send",
            0,
            stream,
            None,
            Refuse::Quiet,
            // Not in place: the caller may reuse expert_out before the wait.
            |_| self.ll_combine_send_on_turn(stream, handle, expert_out, false),
        )
    }

    /// Waits (bounded) for every rank's rows of a sent combine and sums them
    /// into `out` (the second half of [`EpGroup::ll_combine`](crate::EpGroup::ll_combine)).
    pub fn ll_combine_wait(
        &self,
        stream: &Arc<CudaStream>,
        sent: &LlCombineSent,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        self.op_with(
            "moe_ep::ll_combine_wait",
            0,
            stream,
            None,
            Refuse::Quiet,
            |_| {
                let b = sent.b;
                let w = self.ll_check_wait(&b, weights, &*out)?;
                self.ll_combine_wait_on_turn(stream, b, w, out.device_ptr(), None)
            },
        )
    }

    /// The one-node path of [`EpGroup::ll_combine`](crate::EpGroup::ll_combine).
    pub fn ll_combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        // (A refused combine tells no peer: see ll_combine_send.)
        self.op_with(
            "moe_ep::ll_combine",
            0,
            stream,
            None,
            Refuse::Quiet,
            |turn| {
                let ll = self.ll_buffers()?;
                self.ll_expect(ll, &handle.b, Phase::Received, "ll_combine")?;
                self.ll_check_expert_out(handle, expert_out)?;
                let w = self.ll_check_wait(&handle.b, weights, &*out)?;
                // Both halves on one stream within this call: the rows homed
                // here stay in expert_out, read there by the sum (no copy).
                let sent = self.ll_combine_send_on_turn(stream, handle, expert_out, true)?;
                turn.launched.set(true);
                let y = expert_out.device_ptr();
                self.ll_combine_wait_on_turn(stream, sent.b, w, out.device_ptr(), Some(y))
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's e4m3 constant is the reference's `1.0f / 448.0f`.
    #[test]
    fn kernel_constants_match_the_reference() {
        let inv = crate::reference::E4M3_MAX_INV.to_bits();
        assert_eq!(inv, 0x3B12_4925);
        let cu = include_str!("../../kernels-cuda/low_latency.cu");
        assert!(cu.contains("kE4m3MaxInvBits = 0x3B124925u"));
        assert!(cu.contains("kAmaxFloor = 1e-4f"));
        assert_eq!(crate::reference::FP8_AMAX_FLOOR, 1e-4f32);
        assert_eq!(crate::reference::FP8_BLOCK, FP8_BLOCK);
    }

    /// The carve follows the documented formula.
    #[test]
    fn buffer_bytes_follow_the_formula() {
        let mut cfg = GroupConfig::new(256, 7168, 128);
        cfg.mode = super::super::Mode::LowLatency;
        let (r, e, m, h) = (8u64, 256u64, 128u64, 7168u64);
        let nb = h / 128;
        let up = |x: u64| x.div_ceil(256) * 256;
        let sym = up(r * 132 * 32)
            + up(r * 132 * 8)
            + up(r * m * 2 * h)
            + up(r * m * 4 * nb)
            + up(r * m * 8)
            + 2 * up(r * m * 16 * 4)
            + up(m * 16 * 2 * h);
        let local = up(e * m * 2 * h)
            + up(e * m * 4 * nb)
            + up(e * m * 8)
            + up(4 * (32 + e + r))
            + 2 * up(m * 16 * 4)
            + up(8)
            + up(e * m * 4)
            + up(4 * (e + 1))
            + up(8)
            + up(m * 16 * 4);
        let got = ll_buffer_bytes(&cfg, 8);
        assert_eq!(got.symmetric, 2 * sym);
        assert_eq!(got.local, 2 * local + 132 * 8);
        // The module docs' round figure.
        let approx = 4 * h * m * (e + r + 16);
        assert!(got.total() >= approx && got.total() < approx + approx / 20);
        assert!((0.95e9..1.05e9).contains(&(got.total() as f64)));
    }
}
