//! A low-latency group's buffers ([`LlBuffers`]: two sets, fixed when the
//! group is made, and the host's view of where each set's batch is), their
//! regions (`carve`) and sizes ([`ll_buffer_bytes`]; the formula is in the
//! module docs of `low_latency/`).
//!
//! Tests: the unit test below (the carve follows the formula);
//! `tests/gpu_low_latency.rs` (GPU).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream};

use crate::error::{Error, Result};
use crate::ops::abi::{LlBufs, LlSignal, FP8_BLOCK, LL_SETS, MAX_BLOCKS, MAX_TOPK};
use crate::ops::buffers::DeviceRegion;
use crate::ops::config::GroupConfig;
use crate::runtime::Communicator;
use crate::symm::{SymmBuffer, SymmPool};

/// Bytes of a low-latency group's buffers, both sets ([`ll_buffer_bytes`]
/// has the formula).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
pub(crate) fn carve(world: usize, cfg: &GroupConfig) -> (LlBufs, LlBufferBytes) {
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

/// The bytes a [`Mode::LowLatency`](crate::Mode::LowLatency) group of
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
pub(crate) enum Phase {
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
    /// Its combine was refused on this rank's host, which told every home
    /// (they stop on it): spent, the set may take the next batch.
    Refused,
}

/// Which set the next batch takes, and where each set's batch is.
pub(crate) struct LlState {
    pub(crate) next_set: usize,
    pub(crate) generation: u64,
    pub(crate) sets: [(u64, Phase); LL_SETS],
}

/// A low-latency group's buffers and the host's view of its two sets.
pub(crate) struct LlBuffers {
    /// Held for the group's lifetime; the kernels reach them through `bufs`.
    pub(crate) _sym: SymmBuffer<u8>,
    pub(crate) _local: CudaSlice<u8>,
    pub(crate) bufs: LlBufs,
    pub(crate) state: Mutex<LlState>,
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

    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, LlState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn sym_set(&self, me: usize, set: usize) -> u64 {
        self.bufs.sym[me] + set as u64 * self.bufs.sym_set_bytes
    }
    pub(crate) fn local_set(&self, set: usize) -> u64 {
        self.bufs.local + set as u64 * self.bufs.local_set_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The carve follows the documented formula.
    #[test]
    fn buffer_bytes_follow_the_formula() {
        let mut cfg = GroupConfig::new(256, 7168, 128);
        cfg.mode = crate::ops::config::Mode::LowLatency;
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
