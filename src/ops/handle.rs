//! [`Handle`](crate::Handle): the routing of one batch, computed by [`EpGroup::layout`](crate::EpGroup::layout)
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

use super::abi::{
    self, count_row, desc, info_offsets, LayoutBufs, OpCommon, RefusalParams, DESC_WORDS,
    SCAN_THREADS,
};
use super::buffers::DeviceRegion;
use super::group::NodeGroup;
use crate::error::{Error, Result};
use crate::runtime::nvtx::{self, Range};
use crate::symm::SymmBuffer;
use crate::types::RecvLayout;
use std::sync::atomic::Ordering;

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
}

impl NodeHandle {
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
/// one group are serialised), an op on another stream than the group's
/// previous one is ordered after everything enqueued there so far, and the
/// op is one call of the group (every op counts, on every rank: the call's
/// number is what its kernels' descriptors and flags carry).
pub(crate) struct OpTurn<'a> {
    group: &'a NodeGroup,
    _range: Range,
    pub(crate) turns: MutexGuard<'a, Turns>,
    /// The call's number on the group, as the host counts them (a
    /// layout's is its handle's id; the kernels count the calls
    /// themselves, `next_call` in intranode.cuh).
    pub(crate) call: u64,
    /// The op's descriptor code (`desc::OP_*`), for a refusal.
    op: u64,
    /// The op's stream, once bound (`None`: another context's stream).
    stream: Option<Arc<CudaStream>>,
    /// Set by the first launch: a refusal after it publishes nothing.
    pub(crate) launched: std::cell::Cell<bool>,
}

/// What the group's turn guards: the stream of its last op, the calls made
/// so far, a refusal of this rank's host not yet cleared by `check`, and
/// how many errors `check` has cleared (handles made before are refused).
#[derive(Default)]
pub(crate) struct Turns {
    pub(crate) last: Option<Arc<CudaStream>>,
    pub(crate) calls: u64,
    pub(crate) refused: Option<String>,
    pub(crate) epoch: u64,
    /// An op was called since the last check that met the other ranks.
    pub(crate) unchecked: bool,
}

/// The op's stream and the other streams its buffers are ordered on
/// ([`DeviceRegion::home_stream`]), while the op holds the group's turn.
#[derive(Default)]
pub(crate) struct OpStreams {
    op: Option<Arc<CudaStream>>,
    homes: Vec<Arc<CudaStream>>,
}

impl OpStreams {
    /// Orders `op` after the work enqueued so far on `home` (a buffer's own
    /// stream, when it is not the op's), once per op; [`OpStreams::finish`]
    /// orders `home` after the op.
    pub(crate) fn order_with(&mut self, home: &Arc<CudaStream>) -> Result<()> {
        let Some(op) = self.op.clone() else {
            return Ok(());
        };
        if home.cu_stream() == op.cu_stream()
            || self.homes.iter().any(|h| h.cu_stream() == home.cu_stream())
        {
            return Ok(());
        }
        op.join(home).map_err(Error::cuda("cuStreamWaitEvent"))?;
        self.homes.push(home.clone());
        Ok(())
    }
    /// Tells `r` that the op uses it on the op's stream (symmetric buffers
    /// order their release by it), and orders the op with `r`'s own stream.
    pub(crate) fn use_region<T>(&mut self, r: &dyn DeviceRegion<T>) -> Result<()> {
        if let Some(home) = r.home_stream() {
            self.order_with(home)?;
        }
        match &self.op {
            Some(op) => r.used_on(op),
            None => Ok(()),
        }
    }
    /// A new op on `op`.
    pub(crate) fn start(op: &Arc<CudaStream>) -> OpStreams {
        OpStreams {
            op: Some(op.clone()),
            homes: Vec::new(),
        }
    }
    /// After the op's launches: every buffer's own stream waits for them
    /// (what it does next with the buffer comes after the op).
    pub(crate) fn finish(&mut self) {
        let Some(op) = self.op.take() else { return };
        for home in self.homes.drain(..) {
            if let Err(e) = home.join(&op) {
                eprintln!("moe-ep: ordering a buffer's stream after the op failed: {e}");
            }
        }
    }
}

impl Drop for OpStreams {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Where an op runs once it has its turn: the turn, the op's stream and
/// its handle (what every launcher of the one-node ops takes first).
#[derive(Clone, Copy)]
pub(crate) struct OnTurn<'a, 't> {
    pub(crate) turn: &'a OpTurn<'t>,
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) handle: &'a NodeHandle,
}

impl Drop for OpTurn<'_> {
    /// After the op's launches: every buffer's own stream waits for them.
    fn drop(&mut self) {
        self.group
            .op_streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .finish();
    }
}

impl OpTurn<'_> {
    /// The op's stream, once bound (`None`: the entry refused it).
    pub(crate) fn stream(&self) -> Option<&Arc<CudaStream>> {
        self.stream.as_ref()
    }
}

impl NodeGroup {
    /// Runs one op: its NVTX range `name`, the group's turn and the call's
    /// number, the error an earlier call left (refused at once), the
    /// stream's context, `handle` (this group's and made since the last
    /// cleared error), then `body`. When `body` (or the entry) refuses
    /// before anything was launched, every peer is told through the call's
    /// descriptor (`desc::OP_REFUSED`, naming the argument), so their
    /// kernels stop at once; later ops of this rank refuse until `check`.
    /// On a virtual world every op ends in a host barrier of the ranks
    /// (see [`Communicator::virtual_world`](crate::Communicator::virtual_world)).
    pub(crate) fn op<T>(
        &self,
        name: &'static str,
        op: u64,
        stream: &Arc<CudaStream>,
        handle: Option<&NodeHandle>,
        body: impl FnOnce(&OpTurn<'_>) -> Result<T>,
    ) -> Result<T> {
        self.op_with(name, op, stream, handle, Refuse::Descriptor, body)
    }

    /// [`NodeGroup::op`] whose refusal tells the peers as `refuse` says.
    pub(crate) fn op_with<T>(
        &self,
        name: &'static str,
        op: u64,
        stream: &Arc<CudaStream>,
        handle: Option<&NodeHandle>,
        refuse: Refuse<'_>,
        body: impl FnOnce(&OpTurn<'_>) -> Result<T>,
    ) -> Result<T> {
        let out = {
            let mut turn = self.turn(name, op);
            let res = self
                .enter(&mut turn, stream, handle)
                .and_then(|()| body(&turn));
            match res {
                Ok(v) => Ok(v),
                Err(e) => Err(self.refused(turn, e, refuse)),
            }
        };
        match (out, self.virtual_barrier()) {
            (Ok(v), Ok(())) => Ok(v),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    }

    /// The group's turn, the op's NVTX range and its call number.
    fn turn(&self, name: &'static str, op: u64) -> OpTurn<'_> {
        let range = nvtx::range(name);
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        turns.calls += 1;
        turns.unchecked = true;
        let call = turns.calls;
        OpTurn {
            group: self,
            _range: range,
            turns,
            call,
            op,
            stream: None,
            launched: std::cell::Cell::new(false),
        }
    }

    /// The checks every op starts with; orders `stream` after the group's
    /// previous op.
    fn enter(
        &self,
        turn: &mut OpTurn<'_>,
        stream: &Arc<CudaStream>,
        handle: Option<&NodeHandle>,
    ) -> Result<()> {
        if self.comm.is_aborted() {
            return Err(Error::InvalidState(format!(
                "rank {}: the communicator was aborted: every op of its groups is refused; make a new communicator and group",
                self.comm.rank()
            )));
        }
        self.pending_error()?;
        self.bind(stream)?;
        if !self.capture_allowed.load(Ordering::Relaxed) && crate::symm::capturing(stream) {
            return Err(Error::arg(
                "stream",
                "a stream that does not capture a CUDA graph (capture is allowed once the caller takes on its contract: unsafe NodeGroup::allow_graph_capture)",
                "a capturing stream",
            ));
        }
        turn.stream = Some(stream.clone());
        if let Some(prev) = turn
            .turns
            .last
            .as_ref()
            .filter(|p| p.cu_stream() != stream.cu_stream())
        {
            // The group's kernels share its workspace: this op waits for
            // what the previous stream has been given.
            stream
                .join(prev)
                .map_err(Error::cuda("cuStreamWaitEvent"))?;
        }
        turn.turns.last = Some(stream.clone());
        *self.op_streams.lock().unwrap_or_else(|p| p.into_inner()) = OpStreams::start(stream);
        if let Some(h) = handle {
            self.check_handle(h, turn.turns.epoch)?;
            self.mark_used(&h.meta)?;
        }
        Ok(())
    }

    /// An op that failed: unless the failure is one every rank already
    /// shares (an error the group holds, an aborted communicator) or the
    /// op launched its kernels, this rank's part of the call is published
    /// as refused, naming the argument of `e`, so that no peer waits for it;
    /// the rank then refuses its next ops until `check`. Returns `e`.
    fn refused(&self, mut turn: OpTurn<'_>, e: Error, refuse: Refuse<'_>) -> Error {
        let dead = self.poisoned.load(Ordering::Relaxed) || self.comm.is_aborted();
        // An error this rank's kernels already hold (its peers found it
        // too): the call is skipped, not refused.
        let shared = self.error.read().code != abi::code::OK;
        // Nothing is launched into a graph being captured (it would run at
        // every launch of the graph, not now).
        let capturing = turn
            .stream
            .as_ref()
            .is_some_and(|s| crate::symm::capturing(s));
        if !dead && !capturing && !turn.launched.get() {
            // Every call is one kernel on every rank, whatever happens to it
            // (the group's call counts stay in step).
            let told = match refuse {
                Refuse::Descriptor => {
                    let word = if shared {
                        desc::OP_STOPPED
                    } else {
                        desc::OP_REFUSED | (turn.op << 8) | (refused_arg(&e) << 16)
                    };
                    self.publish_refusal(&turn, word)
                }
                // A send that moves no rows: its peers' receives wait for
                // every sender.
                Refuse::With(f) => f(&turn, refused_arg(&e)),
                Refuse::Quiet => Ok(()),
            };
            if let Err(p) = told {
                eprintln!("moe-ep: telling the peers of a refused call failed: {p}");
            }
        }
        if !shared && !dead && turn.turns.refused.is_none() {
            turn.turns.refused = Some(format!(
                "this rank refused call {} ({}): {e}",
                turn.call,
                desc::op_name(turn.op)
            ));
        }
        e
    }

    /// Launches the refusal of `turn`'s call (moe_ep_publish_refusal, whose
    /// descriptor's word 0 is `word`) on its stream, or, where the op never
    /// got a stream of this context, on the group's own stream after the
    /// group's last op.
    fn publish_refusal(&self, turn: &OpTurn<'_>, word: u64) -> Result<()> {
        self.comm
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let stream = match &turn.stream {
            Some(s) => s.clone(),
            None => {
                if let Some(last) = &turn.turns.last {
                    self.own_stream
                        .join(last)
                        .map_err(Error::cuda("cuStreamWaitEvent"))?;
                }
                self.own_stream.clone()
            }
        };
        let mut d = [0u64; DESC_WORDS];
        d[0] = word;
        let p = RefusalParams {
            op: self.op_base(),
            desc: d,
            _pad: 0,
        };
        // SAFETY: p mirrors RefusalParams; the kernel writes only the peers'
        // descriptor slots of this call, inside their workspaces.
        unsafe {
            self.k
                .publish_refusal
                .launch(&stream, 1, SCAN_THREADS, 0, &p)
        }
    }

    /// On a virtual world, waits (bounded by the group's timeout) until
    /// every rank has enqueued the op: the ranks' streams share the GPU's
    /// hardware queues, where a rank's later work queued ahead of a
    /// sibling's earlier op would keep that op from starting while this
    /// rank's kernels wait for it.
    /// A rank that does not come within twice the group's timeout leaves
    /// the ops out of step: the group is then unusable on the ranks that
    /// came. Once
    /// this rank holds an error the wait ends at once (its kernels skip
    /// every call until `check`, which counts every rank in step again):
    /// after an error the ranks' programs may make different calls.
    fn virtual_barrier(&self) -> Result<()> {
        let Some(b) = &self.op_barrier else {
            return Ok(());
        };
        let holds_error =
            || self.poisoned.load(Ordering::Relaxed) || self.error.read().code != abi::code::OK;
        b.arrive(
            self.comm.rank(),
            "op (virtual ranks enqueue every op in step)",
            // Twice the kernels' bound: a rank that does not come is found
            // first by the kernels that wait for it (naming it), which ends
            // this wait (an error held).
            2 * self.cfg.timeout,
            &holds_error,
        )
        .inspect_err(|_| self.poisoned.store(true, Ordering::Relaxed))
    }

    /// Orders the current op after the work enqueued so far on `home` (a
    /// buffer's own stream, when it is not the op's), once per op; the op's
    /// end orders `home` after it ([`OpTurn`]'s drop).
    pub(crate) fn order_with(&self, home: &Arc<CudaStream>) -> Result<()> {
        self.op_streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .order_with(home)
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

    /// Refuses a handle that another group's layout made, or one made
    /// before the last error `check` cleared (its routing or its dispatch
    /// may have been skipped by that error).
    fn check_handle(&self, handle: &NodeHandle, epoch: u64) -> Result<()> {
        if handle.group != self.id {
            return Err(Error::arg(
                "handle",
                format!("a handle made by this group's layout (group {})", self.id),
                format!("a handle of group {}", handle.group),
            ));
        }
        if handle.epoch != epoch {
            return Err(Error::arg(
                "handle",
                "a handle made since the last error check() cleared (the error may have skipped its layout or dispatch on some rank): make a new one with layout",
                "a handle made before that error",
            ));
        }
        Ok(())
    }

    /// What every kernel of an op is told that is not a handle's: the
    /// group's workspace and error report, its sizes.
    pub(crate) fn op_base(&self) -> OpCommon {
        OpCommon {
            ws: self.ws_peers,
            w: self.w,
            error: self.error.device_ptr(),
            timeout_ns: self.timeout_ns(),
            rank: self.comm.rank() as i32,
            world: self.comm.world() as i32,
            hidden: self.cfg.hidden as i32,
            num_experts: self.cfg.num_experts as i32,
            alignment: 1,
            recv_capacity: self.recv_capacity as i32,
            num_blocks: self.cfg.num_sms as i32,
            ..Default::default()
        }
    }

    /// What every kernel of an op on `handle` is told: the group's
    /// workspace and error report, the handle's arrays and the call's shape.
    pub(crate) fn op_common(&self, handle: &NodeHandle) -> OpCommon {
        let (layout, alignment) = handle.layout.kind();
        OpCommon {
            bufs: handle.bufs(),
            num_tokens: handle.num_tokens as i32,
            topk: handle.topk as i32,
            layout,
            alignment,
            ..self.op_base()
        }
    }
}

/// How a refused op tells its peers.
pub(crate) enum Refuse<'r> {
    /// The high-throughput ops: the call's descriptor says so
    /// (`moe_ep_publish_refusal`).
    Descriptor,
    /// Another way (the low-latency dispatch sends: a send that moves no
    /// rows), given the op's turn and the refused argument's id.
    With(&'r dyn Fn(&OpTurn<'_>, u64) -> Result<()>),
    /// Not at all (ops no peer waits for; the low-latency combines, see
    /// `ll_combine_send`).
    Quiet,
}

/// The argument a refused call names to its peers ([`abi::arg_id`]).
pub(crate) fn refused_arg(e: &Error) -> u64 {
    match e {
        Error::InvalidArgument { arg, .. } => abi::arg_id(arg),
        Error::NotSymmetric { what } => abi::arg_id(what),
        _ => 0,
    }
}
