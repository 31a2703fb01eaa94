//! [`Handle`](crate::Handle): the routing of one batch, computed by [`EpGroup::layout`](crate::EpGroup::layout)
//! and reused by its dispatch, combine and both backward passes; the
//! device arrays it owns (one arena per layout, plus the expert-major
//! receivers' `meta` in symmetric memory), [`HostCounts`], and the
//! handle's arrays as the kernels see them (`LayoutBufs`; the rest of
//! `OpCommon` is filled in `turn.rs`).
//!
//! Tests: `tests/gpu_intranode.rs` (`host_counts` against the CPU
//! reference in every case; pipelined handles; a handle of another group
//! refused).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView};

use crate::error::{Error, Result};
use crate::ops::abi::{count_row, info_offsets, LayoutBufs, MAX_RANKS};
use crate::ops::buffers::DeviceRegion;
use crate::symm::SymmBuffer;
use crate::types::RecvLayout;

/// The routing of one batch, computed by [`EpGroup::layout`](crate::EpGroup::layout) and reused by
/// its dispatch, combine and both backward passes.
pub struct NodeHandle {
    pub(crate) layout: RecvLayout,
    pub(crate) num_tokens: usize,
    pub(crate) topk: usize,
    /// One stream-ordered allocation (one alloc, one memset per layout):
    /// the normalised routing `[T, K]`, rank positions `[T, R]`, expert
    /// positions `[T, K]` and the info words, at `arena_at`.
    pub(crate) arena: CudaSlice<i32>,
    pub(crate) arena_at: ArenaOffsets,
    /// Expert-major: per received token, the rows of its experts here
    /// (`[R * max_tokens, K]`, written by the senders, so symmetric).
    /// Allocated for every layout (`[R * max_tokens, MAX_TOPK]`) so that
    /// every rank's pool allocations match whatever layout each asked for;
    /// unused by rank-major handles.
    pub(crate) meta: SymmBuffer<i32>,
    /// Set once a dispatch or combine backward of this handle is enqueued:
    /// they write `meta` (on every rank) before the expert-major combine
    /// and dispatch backward can read it.
    pub(crate) meta_written: std::sync::atomic::AtomicBool,
    /// The group whose layout made it ([`NodeGroup::id`]).
    pub(crate) group: u64,
    /// Its layout's call number: the handle's id in every op's descriptor
    /// (the same on every rank for the same layout call).
    pub(crate) id: u64,
    /// The group's count of cleared errors when it was made (a handle of
    /// an earlier count is refused).
    pub(crate) epoch: u64,
    pub(crate) world: usize,
    pub(crate) experts: usize,
    /// The most rows any rank receives, once [`NodeHandle::host_counts`]
    /// has read it (`usize::MAX` until then): caller buffers of the
    /// handle's ops need only hold that many rows.
    pub(crate) rows_bound: std::sync::atomic::AtomicUsize,
}

impl NodeHandle {
    /// Expert-major: every rank's `meta` as mapped here (the senders of a
    /// dispatch write them); zeros for rank-major.
    pub(crate) fn meta_peers(&self) -> Result<[u64; MAX_RANKS]> {
        let mut peers = [0u64; MAX_RANKS];
        if matches!(self.layout, RecvLayout::ExpertMajor { .. }) {
            for (rank, p) in peers.iter_mut().enumerate().take(self.world) {
                *p = self.meta.peer_ptr(rank).ok_or_else(|| {
                    Error::InvalidState(format!("meta buffer of rank {rank} not reachable"))
                })?;
            }
        }
        Ok(peers)
    }
}

/// Where each of a handle's arrays starts in its arena (i32 elements, each
/// start a multiple of 64 elements).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ArenaOffsets {
    topk_norm: usize,
    rank_pos: usize,
    expert_pos: usize,
    info: usize,
    info_len: usize,
    pub(crate) total: usize,
}

impl ArenaOffsets {
    pub(crate) fn new(t: usize, k: usize, r: usize, info_len: usize) -> ArenaOffsets {
        let up = |n: usize| n.max(1).div_ceil(64) * 64;
        let rank_pos = up(t * k);
        let expert_pos = rank_pos + up(t * r);
        let info = expert_pos + up(t * k);
        ArenaOffsets {
            topk_norm: 0,
            rank_pos,
            expert_pos,
            info,
            info_len,
            total: info + up(info_len),
        }
    }
}

/// The count matrix of a handle, copied to the host on request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostCounts {
    /// Rows received here in the handle's layout (expert-major: padded).
    pub recv_rows: usize,
    /// The most rows any rank receives: a symmetric receive buffer (the
    /// same size on every rank) of this many rows is enough for every op
    /// of the handle (dispatch's outputs, combine's `expert_out`, the
    /// backward passes' row buffers), also below `recv_capacity`.
    pub max_recv_rows: usize,
    /// Rows each rank dropped (by rank; [`Overflow::Drop`](crate::ops::Overflow::Drop), else zeros):
    /// rank-major, tokens; expert-major, (token, expert) rows.
    pub dropped_rows: Vec<usize>,
    /// Tokens received here (one per (source token, this rank); expert-major
    /// with drops: also tokens whose every row here was dropped).
    pub recv_tokens: usize,
    /// (token, expert) pairs per local expert, unpadded (rank-major with
    /// drops: counted before the drop).
    pub tokens_per_local_expert: Vec<usize>,
    /// `rank_counts[s * R + d]`: tokens rank s sends to rank d.
    pub rank_counts: Vec<u32>,
    /// `expert_counts[s * E + e]`: tokens rank s sends to expert e.
    pub expert_counts: Vec<u32>,
}

impl NodeHandle {
    /// Tests only (feature `testkit`): the expert-major receivers' rows of
    /// each received token here, as the senders wrote them (`[R * M, K]`),
    /// for fault tests that corrupt what a peer wrote.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn meta_for_tests(&self) -> &SymmBuffer<i32> {
        &self.meta
    }
    /// The receive layout this handle was computed for.
    pub fn layout(&self) -> RecvLayout {
        self.layout
    }
    /// The rows this rank's buffers of the handle's ops must hold: the most
    /// any rank receives once the counts were read, else `cap`.
    pub(crate) fn rows_held(&self, cap: usize) -> usize {
        self.rows_bound
            .load(std::sync::atomic::Ordering::Relaxed)
            .min(cap)
    }
    /// The routing the layout kept (`[T, K]` i32 on the device): the
    /// caller's, with -1 for unrouted, bad and dropped slots.
    pub fn kept_topk_idx(&self) -> CudaView<'_, i32> {
        let a = self.arena_at;
        self.arena
            .slice(a.topk_norm..a.topk_norm + self.num_tokens * self.topk)
    }
    /// This rank's dropped slots (`[T, K]`, true where the slot was routed
    /// and its row dropped at the receiver), copied to the host
    /// (synchronises `stream`).
    pub fn dropped_slots(&self, stream: &Arc<CudaStream>) -> Result<Vec<bool>> {
        let n = self.num_tokens * self.topk;
        if n == 0 {
            return Ok(vec![]);
        }
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let a = self.arena_at;
        let pos: Vec<i32> = stream
            .clone_dtoh(&self.arena.slice(a.expert_pos..a.expert_pos + n))
            .map_err(Error::cuda("cuMemcpyDtoH"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        Ok(pos.iter().map(|&p| p == -2).collect())
    }
    /// Device bytes of the handle: its arena and the symmetric meta rows.
    pub fn device_bytes(&self) -> u64 {
        (self.arena_at.total * 4 + self.meta.num_bytes()) as u64
    }
    /// Tokens of this rank.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// Top-k.
    pub fn topk(&self) -> usize {
        self.topk
    }
    /// Unpadded (token, expert) rows per local expert, on the device (i32).
    pub fn tokens_per_local_expert(&self) -> CudaView<'_, i32> {
        let el = self.experts / self.world;
        let o = info_offsets(self.world, self.experts, el);
        let at = self.arena_at.info;
        self.arena
            .slice(at + o.expert_count..at + o.expert_count + el)
    }
    fn info(&self) -> CudaView<'_, i32> {
        let a = self.arena_at;
        self.arena.slice(a.info..a.info + a.info_len)
    }
    /// Copies the counts to the host (synchronises `stream`).
    pub fn host_counts(&self, stream: &Arc<CudaStream>) -> Result<HostCounts> {
        // NOTE: the stream is drained before the copy into pageable memory:
        // the driver moves pageable copies of all threads through shared
        // staging buffers, so a copy waiting here behind this rank's kernels
        // (which wait for the other ranks) would hold up a virtual sibling's
        // own copies, and with them its next launch.
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let info: Vec<i32> = stream
            .clone_dtoh(&self.info())
            .map_err(Error::cuda("cuMemcpyDtoH"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let (r, e) = (self.world, self.experts);
        let el = e / r;
        let o = info_offsets(r, e, el);
        let n = count_row(r, e);
        let mut rank_counts = vec![0u32; r * r];
        let mut expert_counts = vec![0u32; r * e];
        for s in 0..r {
            for d in 0..r {
                rank_counts[s * r + d] = info[o.counts + s * n + e + d] as u32;
            }
            for x in 0..e {
                expert_counts[s * e + x] = info[o.counts + s * n + x] as u32;
            }
        }
        let recv_tokens = info[o.src_u_off + r] as usize;
        let recv_rows = match self.layout {
            RecvLayout::RankMajor => recv_tokens,
            RecvLayout::ExpertMajor { .. } => info[o.expert_start + el] as usize,
        };
        let max_recv_rows = (0..r)
            .map(|d| info[o.rows_needed + d].max(0) as usize)
            .max()
            .unwrap_or(0);
        self.rows_bound
            .store(max_recv_rows, std::sync::atomic::Ordering::Relaxed);
        Ok(HostCounts {
            recv_rows,
            max_recv_rows,
            dropped_rows: (0..r)
                .map(|d| info[o.dropped + d].max(0) as usize)
                .collect(),
            recv_tokens,
            tokens_per_local_expert: (0..el).map(|j| info[o.expert_count + j] as usize).collect(),
            rank_counts,
            expert_counts,
        })
    }
    /// The device addresses of the handle's arrays, as the kernels see them.
    pub(crate) fn bufs(&self) -> LayoutBufs {
        let (base, a) = (self.arena.device_ptr(), self.arena_at);
        let at = |off: usize| base + (off * std::mem::size_of::<i32>()) as u64;
        LayoutBufs {
            topk: at(a.topk_norm),
            rank_pos: at(a.rank_pos),
            expert_pos: at(a.expert_pos),
            info: at(a.info),
            meta: match self.layout {
                RecvLayout::ExpertMajor { .. } => self.meta.device_ptr(),
                RecvLayout::RankMajor => 0,
            },
        }
    }
}
