//! [`Handle`]: the routing of one batch, computed by [`EpGroup::layout`]
//! and reused by its dispatch, combine and both backward passes; the
//! device arrays it owns (one arena per layout, plus the expert-major
//! receivers' `meta` in symmetric memory), [`HostCounts`], and the
//! [`OpCommon`] every kernel's parameters start with.
//!
//! Tests: `tests/gpu_intranode.rs` (`host_counts` against the CPU
//! reference in every case; pipelined handles; a handle of another group
//! refused).

use std::sync::{Arc, MutexGuard};

use cudarc::driver::{CudaSlice, CudaStream, CudaView};

use super::abi::{count_row, info_offsets, LayoutBufs, OpCommon};
use super::buffers::DeviceRegion;
use super::group::EpGroup;
use super::layout::RecvLayout;
use crate::error::{Error, Result};
use crate::runtime::nvtx::{self, Range};
use crate::symm::SymmBuffer;

/// The routing of one batch, computed by [`EpGroup::layout`] and reused by
/// its dispatch, combine and both backward passes.
pub struct Handle {
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
    /// The group whose layout made it ([`EpGroup::id`]).
    pub(crate) group: u64,
    pub(crate) world: usize,
    pub(crate) experts: usize,
}

impl Handle {
    /// Expert-major: every rank's `meta` as mapped here (the senders of a
    /// dispatch write them); zeros for rank-major.
    pub(crate) fn meta_peers(&self) -> Result<[u64; super::abi::MAX_RANKS]> {
        let mut peers = [0u64; super::abi::MAX_RANKS];
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
    /// Tokens received here (one per (source token, this rank)).
    pub recv_tokens: usize,
    /// (token, expert) pairs per local expert, unpadded.
    pub tokens_per_local_expert: Vec<usize>,
    /// `rank_counts[s * R + d]`: tokens rank s sends to rank d.
    pub rank_counts: Vec<u32>,
    /// `expert_counts[s * E + e]`: tokens rank s sends to expert e.
    pub expert_counts: Vec<u32>,
}

impl Handle {
    /// The receive layout this handle was computed for.
    pub fn layout(&self) -> RecvLayout {
        self.layout
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
        Ok(HostCounts {
            recv_rows,
            recv_tokens,
            tokens_per_local_expert: (0..el).map(|j| info[o.expert_count + j] as usize).collect(),
            rank_counts,
            expert_counts,
        })
    }
    /// The device addresses of the handle's arrays, as the kernels see them.
    fn bufs(&self) -> LayoutBufs {
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

/// An op's turn on its group, held while the op checks its arguments and
/// enqueues its kernels: ops of one group never interleave (two threads on
/// one group are serialised), and an op on another stream than the group's
/// previous one is ordered after everything enqueued there so far.
pub(crate) struct OpTurn<'a> {
    group: &'a EpGroup,
    _range: Range,
    _turn: MutexGuard<'a, Option<Arc<CudaStream>>>,
}

/// The op's stream and the other streams its buffers are ordered on
/// ([`DeviceRegion::home_stream`]), while the op holds the group's turn.
#[derive(Default)]
pub(crate) struct OpStreams {
    op: Option<Arc<CudaStream>>,
    homes: Vec<Arc<CudaStream>>,
}

impl Drop for OpTurn<'_> {
    /// After the op's launches: every buffer's own stream waits for them
    /// (what it does next with the buffer comes after the op).
    fn drop(&mut self) {
        let mut st = self
            .group
            .op_streams
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(op) = st.op.take() else { return };
        for home in st.homes.drain(..) {
            if let Err(e) = home.join(&op) {
                eprintln!("moe-ep: ordering a buffer's stream after the op failed: {e}");
            }
        }
    }
}

impl EpGroup {
    /// The start of every op: its NVTX range `name`, the group's turn, the
    /// error an earlier call left, the stream's context.
    pub(crate) fn turn(&self, name: &'static str, stream: &Arc<CudaStream>) -> Result<OpTurn<'_>> {
        let range = nvtx::range(name);
        let mut last = self.last_stream.lock().unwrap_or_else(|p| p.into_inner());
        self.pending_error()?;
        self.bind(stream)?;
        if let Some(prev) = last
            .as_ref()
            .filter(|p| p.cu_stream() != stream.cu_stream())
        {
            // The group's kernels share its workspace and sequence counters:
            // this op waits for what the previous stream has been given.
            let event = stream
                .context()
                .new_event(Some(
                    cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
                ))
                .map_err(Error::cuda("cuEventCreate"))?;
            event.record(prev).map_err(Error::cuda("cuEventRecord"))?;
            stream
                .wait(&event)
                .map_err(Error::cuda("cuStreamWaitEvent"))?;
        }
        *last = Some(stream.clone());
        *self.op_streams.lock().unwrap_or_else(|p| p.into_inner()) = OpStreams {
            op: Some(stream.clone()),
            homes: Vec::new(),
        };
        Ok(OpTurn {
            group: self,
            _range: range,
            _turn: last,
        })
    }

    /// Orders the current op after the work enqueued so far on `home` (a
    /// buffer's own stream, when it is not the op's), once per op; the op's
    /// end orders `home` after it ([`OpTurn`]'s drop).
    pub(crate) fn order_with(&self, home: &Arc<CudaStream>) -> Result<()> {
        let mut st = self.op_streams.lock().unwrap_or_else(|p| p.into_inner());
        let Some(op) = st.op.clone() else {
            return Ok(());
        };
        if home.cu_stream() == op.cu_stream()
            || st.homes.iter().any(|h| h.cu_stream() == home.cu_stream())
        {
            return Ok(());
        }
        op.join(home).map_err(Error::cuda("cuStreamWaitEvent"))?;
        st.homes.push(home.clone());
        Ok(())
    }

    /// Tells `r` that the current op uses it on the op's stream (symmetric
    /// buffers order their release by it).
    pub(crate) fn mark_used<T>(&self, r: &dyn DeviceRegion<T>) -> Result<()> {
        let op = self
            .op_streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .op
            .clone();
        match op {
            Some(op) => r.used_on(&op),
            None => Ok(()),
        }
    }

    /// [`EpGroup::turn`] for an op on `handle`, which must be this group's.
    pub(crate) fn enter(
        &self,
        name: &'static str,
        stream: &Arc<CudaStream>,
        handle: &Handle,
    ) -> Result<OpTurn<'_>> {
        let turn = self.turn(name, stream)?;
        self.check_handle(handle)?;
        self.mark_used(&handle.meta)?;
        Ok(turn)
    }

    /// Refuses a handle that another group's layout made.
    fn check_handle(&self, handle: &Handle) -> Result<()> {
        if handle.group != self.id {
            return Err(Error::arg(
                "handle",
                format!("a handle made by this group's layout (group {})", self.id),
                format!("a handle of group {}", handle.group),
            ));
        }
        Ok(())
    }

    /// What every kernel of an op on `handle` is told: the group's
    /// workspace and error report, the handle's arrays and the call's shape.
    pub(crate) fn op_common(&self, handle: &Handle) -> OpCommon {
        let (layout, alignment) = handle.layout.kind();
        OpCommon {
            bufs: handle.bufs(),
            ws: self.ws_peers,
            w: self.w,
            error: self.error.device_ptr(),
            timeout_ns: self.timeout_ns(),
            rank: self.comm.rank() as i32,
            world: self.comm.world() as i32,
            num_tokens: handle.num_tokens as i32,
            hidden: self.cfg.hidden as i32,
            topk: handle.topk as i32,
            num_experts: self.cfg.num_experts as i32,
            layout,
            alignment,
            recv_capacity: self.recv_capacity as i32,
            num_blocks: self.cfg.num_sms as i32,
        }
    }
}
