//! The ops' Rust launchers: argument validation on the host, then one
//! parameter struct per kernel (kernels-cuda/intranode.cu).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use half::bf16;

use super::abi::{
    count_row, info_offsets, CombineParams, DispatchParams, LayoutBufs, LayoutParams, COMBINE_SMEM,
    MAX_RANKS, MAX_TOPK, SCAN_EXPERTS, THREADS,
};
use super::group::EpGroup;
use super::DeviceRegion;
use crate::error::{Error, Result};
use crate::reference::RecvLayout;
use crate::symm::SymmBuffer;

/// `topk_idx [T, K]` on the device, i32 or i64; -1 = not routed.
pub enum TopkIdx<'a> {
    I32(&'a dyn DeviceRegion<i32>),
    I64(&'a dyn DeviceRegion<i64>),
}

impl TopkIdx<'_> {
    fn ptr_len(&self) -> (u64, usize, bool) {
        match self {
            TopkIdx::I32(r) => (r.device_ptr(), r.len(), false),
            TopkIdx::I64(r) => (r.device_ptr(), r.len(), true),
        }
    }
}

/// The routing of one batch, computed by [`EpGroup::layout`] and reused by
/// its dispatch, combine and both backward passes.
pub struct Handle {
    pub(crate) layout: RecvLayout,
    pub(crate) num_tokens: usize,
    pub(crate) topk: usize,
    /// One stream-ordered allocation (one alloc, one memset per layout):
    /// the normalised routing `[T, K]`, rank positions `[T, R]`, expert
    /// positions `[T, K]` and the info words, at `arena_at`.
    arena: CudaSlice<i32>,
    arena_at: ArenaOffsets,
    meta: Option<SymmBuffer<i32>>,
    world: usize,
    experts: usize,
}

/// Where each of a handle's arrays starts in its arena (i32 elements, each
/// start a multiple of 64 elements).
#[derive(Clone, Copy, Debug)]
struct ArenaOffsets {
    topk_norm: usize,
    rank_pos: usize,
    expert_pos: usize,
    info: usize,
    info_len: usize,
    total: usize,
}

impl ArenaOffsets {
    fn new(t: usize, k: usize, r: usize, info_len: usize) -> ArenaOffsets {
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
    fn bufs(&self) -> LayoutBufs {
        let (base, a) = (self.arena.device_ptr(), self.arena_at);
        let at = |off: usize| base + (off * std::mem::size_of::<i32>()) as u64;
        LayoutBufs {
            topk: at(a.topk_norm),
            rank_pos: at(a.rank_pos),
            expert_pos: at(a.expert_pos),
            info: at(a.info),
            meta: self.meta.as_ref().map_or(0, |m| m.device_ptr()),
        }
    }
}

/// A receive buffer: the caller's (borrowed; symmetric memory of the group's
/// communicator) or one the pool gave this call.
pub enum RecvBuf<'a, T> {
    Caller(&'a dyn DeviceRegion<T>),
    Pool(SymmBuffer<T>),
}

impl<T> DeviceRegion<T> for RecvBuf<'_, T> {
    fn device_ptr(&self) -> u64 {
        match self {
            RecvBuf::Caller(b) => b.device_ptr(),
            RecvBuf::Pool(b) => b.device_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            RecvBuf::Caller(b) => b.len(),
            RecvBuf::Pool(b) => b.len(),
        }
    }
}

impl<T> RecvBuf<'_, T> {
    /// True when this is the caller's buffer (zero copy into it).
    pub fn is_callers(&self) -> bool {
        matches!(self, RecvBuf::Caller(_))
    }
}

/// Optional caller-supplied receive buffers (symmetric: from the group's pool
/// or a wrapped window, allocated collectively). `None` takes them from the pool.
#[derive(Default)]
pub struct DispatchOut<'a> {
    /// `[recv_capacity, H]` bf16.
    pub recv_tokens: Option<&'a dyn DeviceRegion<bf16>>,
    /// Rank-major `[recv_capacity, K]`, expert-major `[recv_capacity]` f32.
    pub recv_topk_weights: Option<&'a dyn DeviceRegion<f32>>,
}

/// What dispatch returns. Rows past the handle's `recv_rows` are untouched.
pub struct Dispatched<'a> {
    /// `[rows, H]` received tokens in the handle's layout.
    pub tokens: RecvBuf<'a, bf16>,
    /// Rank-major `[rows, K]` (0 for experts not on this rank), expert-major `[rows]`.
    pub topk_weights: RecvBuf<'a, f32>,
    /// Local expert ids, same shape as the weights; -1 = not here / padding.
    pub topk_idx: SymmBuffer<i32>,
    /// `[rows, 2]` (source rank, source token); (-1, -1) on padding.
    pub src: SymmBuffer<i32>,
}

fn check_len(arg: &'static str, got: usize, want: usize, what: &str) -> Result<()> {
    if got < want {
        return Err(Error::arg(
            arg,
            format!("at least {want} elements ({what})"),
            format!("{got} elements"),
        ));
    }
    Ok(())
}

impl EpGroup {
    fn layout_code(layout: RecvLayout) -> Result<(i32, i32)> {
        match layout {
            RecvLayout::RankMajor => Ok((0, 1)),
            RecvLayout::ExpertMajor { alignment } => {
                if alignment == 0 || alignment > 4096 {
                    return Err(Error::arg(
                        "layout",
                        "ExpertMajor alignment in 1..=4096",
                        alignment,
                    ));
                }
                Ok((1, alignment as i32))
            }
        }
    }

    fn weights_per_row(&self, layout: RecvLayout, k: usize) -> usize {
        match layout {
            RecvLayout::RankMajor => k,
            RecvLayout::ExpertMajor { .. } => 1,
        }
    }

    /// Computes the routing layout (collective): tokens per rank and expert,
    /// every token's row on every receiver, and the count matrix of all
    /// ranks. `topk_idx` is `[T, topk]` with `T <= max_tokens_per_rank`.
    pub fn layout(
        &self,
        stream: &Arc<CudaStream>,
        topk_idx: TopkIdx<'_>,
        topk: usize,
        layout: RecvLayout,
    ) -> Result<Handle> {
        let _range = crate::runtime::nvtx::range("moe_ep::layout");
        self.check()?;
        self.bind(stream)?;
        let (idx_ptr, idx_len, is_i64) = topk_idx.ptr_len();
        if topk == 0 || topk > MAX_TOPK || topk > self.cfg.num_experts {
            return Err(Error::arg(
                "topk",
                format!("1..={} (and at most num_experts)", MAX_TOPK),
                topk,
            ));
        }
        if idx_len % topk != 0 {
            return Err(Error::arg(
                "topk_idx",
                format!("[T, {topk}] (a multiple of {topk} elements)"),
                format!("{idx_len} elements"),
            ));
        }
        let t = idx_len / topk;
        if t > self.cfg.max_tokens_per_rank {
            return Err(Error::arg(
                "topk_idx",
                format!(
                    "at most max_tokens_per_rank = {} tokens",
                    self.cfg.max_tokens_per_rank
                ),
                format!("{t} tokens"),
            ));
        }
        let (layout_code, alignment) = Self::layout_code(layout)?;
        let (r, e) = (self.comm.world(), self.cfg.num_experts);
        let el = e / r;
        let arena_at = ArenaOffsets::new(t, topk, r, info_offsets(r, e, el).total);
        let arena = stream
            .alloc_zeros::<i32>(arena_at.total)
            .map_err(Error::cuda("cuMemAlloc"))?;
        // Expert-major receivers need, per received token, its rows here:
        // written by the senders, so symmetric. Collective allocation.
        let meta = match layout {
            RecvLayout::ExpertMajor { .. } => Some(
                self.pool
                    .alloc::<i32>(r * self.cfg.max_tokens_per_rank * topk)?,
            ),
            RecvLayout::RankMajor => None,
        };
        let handle = Handle {
            layout,
            num_tokens: t,
            topk,
            arena,
            arena_at,
            meta,
            world: r,
            experts: e,
        };
        let mut metas = [0u64; MAX_RANKS];
        if let Some(m) = &handle.meta {
            for (rank, p) in metas.iter_mut().enumerate().take(r) {
                *p = m.peer_ptr(rank).ok_or_else(|| {
                    Error::InvalidState(format!("meta buffer of rank {rank} not reachable"))
                })?;
            }
        }
        let p = LayoutParams {
            topk_idx: idx_ptr,
            bufs: handle.bufs(),
            ws: self.ws_peers,
            meta: metas,
            w: self.w,
            error: self.error.device_ptr(),
            idx_is_i64: is_i64 as i32,
            rank: self.comm.rank() as i32,
            world: r as i32,
            num_tokens: t as i32,
            topk: topk as i32,
            num_experts: e as i32,
            hidden: self.cfg.hidden as i32,
            layout: layout_code,
            alignment,
            recv_capacity: self.recv_capacity as i32,
            timeout_ns: self.timeout_ns(),
        };
        // SAFETY: p mirrors LayoutParams; every buffer lives in `handle` or
        // the group, both outliving the enqueued work (the handle's arrays are
        // stream-ordered allocations freed in stream order).
        unsafe {
            // Expert-group blocks, R rank blocks, then one token per thread
            // of the check blocks.
            let check_blocks = t.div_ceil(THREADS as usize).max(1);
            let groups = e.div_ceil(SCAN_EXPERTS);
            self.k.layout_scan.launch(
                stream,
                (groups + r + check_blocks) as u32,
                THREADS,
                0,
                &p,
            )?;
            self.k.layout_exchange
                .launch(stream, 1, THREADS, super::group::exchange_smem(e), &p)?;
            if layout_code == 1 {
                self.k.layout_meta
                    .launch(stream, self.cfg.num_sms as u32, THREADS, 0, &p)?;
            }
        }
        Ok(handle)
    }

    /// Every rank's address of `buf`, which must lie in a registered window
    /// of this communicator (same offset on every rank, by the collective
    /// allocation contract).
    fn recv_peers<T>(
        &self,
        buf: &dyn DeviceRegion<T>,
        arg: &'static str,
    ) -> Result<[u64; MAX_RANKS]> {
        let (ptr, bytes) = (buf.device_ptr(), buf.len() * std::mem::size_of::<T>());
        let seg = self
            .comm
            .segment_of(ptr, bytes)
            .ok_or(Error::NotSymmetric { what: arg })?;
        let mut out = [0u64; MAX_RANKS];
        for (rank, p) in out.iter_mut().enumerate().take(self.comm.world()) {
            *p = seg
                .peer_base(rank)
                .ok_or(Error::NotSymmetric { what: arg })?
                + (ptr - seg.base());
        }
        Ok(out)
    }

    /// Peer mappings for combine's pull path: rank-major, `y` (and `grad_w`,
    /// when given) symmetric. Otherwise zeros: partials are pushed.
    fn pull_peers(
        &self,
        handle: &Handle,
        y: &dyn DeviceRegion<bf16>,
        grad_w: Option<&dyn DeviceRegion<f32>>,
    ) -> ([u64; MAX_RANKS], [u64; MAX_RANKS]) {
        let none = ([0; MAX_RANKS], [0; MAX_RANKS]);
        if !matches!(handle.layout, RecvLayout::RankMajor) {
            return none;
        }
        let Ok(y_peers) = self.recv_peers(y, "expert_out") else {
            return none;
        };
        match grad_w.map(|g| self.recv_peers(g, "grad_recv_topk_weights")) {
            None => (y_peers, [0; MAX_RANKS]),
            Some(Ok(gw_peers)) => (y_peers, gw_peers),
            Some(Err(_)) => none,
        }
    }

    fn check_handle(&self, handle: &Handle) -> Result<()> {
        if handle.world != self.comm.world() || handle.experts != self.cfg.num_experts {
            return Err(Error::arg(
                "handle",
                "a handle made by this group's layout",
                "a handle of another group",
            ));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_dispatch(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        x: u64,
        topk_w: u64,
        recv_x: [u64; MAX_RANKS],
        recv_w: [u64; MAX_RANKS],
        recv_idx: [u64; MAX_RANKS],
        recv_src: [u64; MAX_RANKS],
        scale_w: u64,
    ) -> Result<()> {
        let (layout, alignment) = Self::layout_code(handle.layout)?;
        let p = DispatchParams {
            x,
            topk_w,
            bufs: handle.bufs(),
            ws: self.ws_peers,
            w: self.w,
            recv_x,
            recv_w,
            recv_idx,
            recv_src,
            scale_w,
            error: self.error.device_ptr(),
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
            timeout_ns: self.timeout_ns(),
        };
        // SAFETY: p mirrors DispatchParams; sizes were validated by callers.
        unsafe {
            self.k.dispatch
                .launch(stream, self.cfg.num_sms as u32, THREADS, 0, &p)
        }
    }

    /// Sends every token to the ranks of its experts, writing straight into
    /// each receiver's buffers (zero copy). `x` is `[T, H]` bf16,
    /// `topk_weights` `[T, K]` f32, matching the handle's routing.
    pub fn dispatch<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
    ) -> Result<Dispatched<'a>> {
        let _range = crate::runtime::nvtx::range("moe_ep::dispatch");
        self.check()?;
        self.bind(stream)?;
        self.check_handle(handle)?;
        let (t, k, h, cap) = (
            handle.num_tokens,
            handle.topk,
            self.cfg.hidden,
            self.recv_capacity,
        );
        check_len("x", x.len(), t * h, "[T, hidden] bf16")?;
        check_len("topk_weights", topk_weights.len(), t * k, "[T, K] f32")?;
        let wpr = self.weights_per_row(handle.layout, k);
        let tokens = match out.recv_tokens {
            Some(b) => {
                check_len(
                    "recv_tokens",
                    b.len(),
                    cap * h,
                    "[recv_capacity, hidden] bf16",
                )?;
                RecvBuf::Caller(b)
            }
            None => RecvBuf::Pool(self.pool.alloc(cap * h)?),
        };
        let weights = match out.recv_topk_weights {
            Some(b) => {
                check_len(
                    "recv_topk_weights",
                    b.len(),
                    cap * wpr,
                    "recv_capacity rows of weights",
                )?;
                RecvBuf::Caller(b)
            }
            None => RecvBuf::Pool(self.pool.alloc(cap * wpr)?),
        };
        let idx: SymmBuffer<i32> = self.pool.alloc(cap * wpr)?;
        let src: SymmBuffer<i32> = self.pool.alloc(cap * 2)?;
        let recv_x = self.recv_peers(&tokens, "recv_tokens")?;
        let recv_w = self.recv_peers(&weights, "recv_topk_weights")?;
        let recv_idx = self.recv_peers(&idx, "recv_topk_idx")?;
        let recv_src = self.recv_peers(&src, "recv_src")?;
        self.launch_dispatch(
            stream,
            handle,
            x.device_ptr(),
            topk_weights.device_ptr(),
            recv_x,
            recv_w,
            recv_idx,
            recv_src,
            0,
        )?;
        Ok(Dispatched {
            tokens,
            topk_weights: weights,
            topk_idx: idx,
            src,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        y: u64,
        w_rows: u64,
        grad_w_in: u64,
        out: u64,
        grad_w_out: u64,
        (y_peers, gw_peers): ([u64; MAX_RANKS], [u64; MAX_RANKS]),
    ) -> Result<()> {
        let (layout, _) = Self::layout_code(handle.layout)?;
        let p = CombineParams {
            y,
            w_rows,
            grad_w_in,
            bufs: handle.bufs(),
            ws: self.ws_peers,
            w: self.w,
            out,
            grad_w_out,
            error: self.error.device_ptr(),
            rank: self.comm.rank() as i32,
            world: self.comm.world() as i32,
            num_tokens: handle.num_tokens as i32,
            hidden: self.cfg.hidden as i32,
            topk: handle.topk as i32,
            num_experts: self.cfg.num_experts as i32,
            layout,
            num_blocks: self.cfg.num_sms as i32,
            recv_capacity: self.recv_capacity as i32,
            num_chunks: self.cfg.combine_chunks as i32,
            timeout_ns: self.timeout_ns(),
            y_peers,
            gw_peers,
        };
        // SAFETY: p mirrors CombineParams; sizes were validated by callers.
        unsafe {
            self.k.combine
                .launch(stream, self.cfg.num_sms as u32, THREADS, COMBINE_SMEM, &p)
        }
    }

    /// Brings expert outputs home and sums them per token in f32, in a fixed
    /// order (ascending rank; inside a rank ascending row), so the result is
    /// the same bits on every run. `expert_out` is `[recv_capacity, H]` in the
    /// handle's layout; `weights` (expert-major only) scales each row; `out`
    /// is `[T, H]`.
    ///
    /// Rank-major with `expert_out` in symmetric memory (the dispatch's
    /// receive buffer, a pool buffer, a registered window), each home rank
    /// reads its tokens' rows in place over NVLink: no staging. Any other
    /// device memory (and expert-major) is read locally and pushed home
    /// through the group's stage. Every rank must pass the same kind of
    /// buffer (symmetric buffers are collective anyway); a rank that does not
    /// makes the others stop with [`Error::PeerTimeout`].
    pub fn combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &dyn DeviceRegion<bf16>,
    ) -> Result<()> {
        let _range = crate::runtime::nvtx::range("moe_ep::combine");
        self.check()?;
        self.bind(stream)?;
        self.check_handle(handle)?;
        let (t, h, cap) = (handle.num_tokens, self.cfg.hidden, self.recv_capacity);
        check_len(
            "expert_out",
            expert_out.len(),
            cap * h,
            "[recv_capacity, hidden] bf16",
        )?;
        check_len("out", out.len(), t * h, "[T, hidden] bf16")?;
        let w = match (weights, handle.layout) {
            (None, _) => 0,
            (Some(_), RecvLayout::RankMajor) => {
                return Err(Error::arg("weights", "None for a rank-major handle (a rank-major row already stands for all of the token's experts on that rank: weight them before combine)", "Some"))
            }
            (Some(w), RecvLayout::ExpertMajor { .. }) => {
                check_len("weights", w.len(), cap, "[recv_capacity] f32")?;
                w.device_ptr()
            }
        };
        let peers = self.pull_peers(handle, expert_out, None);
        self.launch_combine(
            stream,
            handle,
            expert_out.device_ptr(),
            w,
            0,
            out.device_ptr(),
            0,
            peers,
        )
    }

    /// Backward of dispatch: the gradient of the received tokens is combined
    /// home (unweighted), and the gradient of the received top-k weights is
    /// routed back to `[T, K]` (`grad_topk_weights`, when given). As in
    /// [`EpGroup::combine`], rank-major gradients in symmetric memory (both of
    /// them, when weights are given) are read in place by their home ranks.
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch_backward(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        grad_recv_tokens: &dyn DeviceRegion<bf16>,
        grad_recv_topk_weights: Option<&dyn DeviceRegion<f32>>,
        grad_tokens: &dyn DeviceRegion<bf16>,
        grad_topk_weights: Option<&dyn DeviceRegion<f32>>,
    ) -> Result<()> {
        let _range = crate::runtime::nvtx::range("moe_ep::dispatch_backward");
        self.check()?;
        self.bind(stream)?;
        self.check_handle(handle)?;
        let (t, k, h, cap) = (
            handle.num_tokens,
            handle.topk,
            self.cfg.hidden,
            self.recv_capacity,
        );
        let wpr = self.weights_per_row(handle.layout, k);
        check_len(
            "grad_recv_tokens",
            grad_recv_tokens.len(),
            cap * h,
            "[recv_capacity, hidden] bf16",
        )?;
        check_len("grad_tokens", grad_tokens.len(), t * h, "[T, hidden] bf16")?;
        let peers = self.pull_peers(handle, grad_recv_tokens, grad_recv_topk_weights);
        let (gin, gout) = match (grad_recv_topk_weights, grad_topk_weights) {
            (Some(a), Some(b)) => {
                check_len(
                    "grad_recv_topk_weights",
                    a.len(),
                    cap * wpr,
                    "recv_capacity rows of weights",
                )?;
                check_len("grad_topk_weights", b.len(), t * k, "[T, K] f32")?;
                (a.device_ptr(), b.device_ptr())
            }
            (None, None) => (0, 0),
            _ => {
                return Err(Error::arg(
                    "grad_topk_weights",
                    "given together with grad_recv_topk_weights",
                    "only one of the two",
                ))
            }
        };
        self.launch_combine(
            stream,
            handle,
            grad_recv_tokens.device_ptr(),
            0,
            gin,
            grad_tokens.device_ptr(),
            gout,
            peers,
        )
    }

    /// Backward of combine: the gradient of the output `[T, H]` is dispatched
    /// (no layout work) into `[recv_capacity, H]` rows in the handle's layout;
    /// padding rows are zero. With `weights` (expert-major, as given to
    /// combine), each row is scaled by its weight.
    pub fn combine_backward<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a dyn DeviceRegion<bf16>>,
    ) -> Result<RecvBuf<'a, bf16>> {
        let _range = crate::runtime::nvtx::range("moe_ep::combine_backward");
        self.check()?;
        self.bind(stream)?;
        self.check_handle(handle)?;
        let (t, h, cap) = (handle.num_tokens, self.cfg.hidden, self.recv_capacity);
        check_len("grad_out", grad_out.len(), t * h, "[T, hidden] bf16")?;
        let scale = match (weights, handle.layout) {
            (None, _) => 0,
            (Some(_), RecvLayout::RankMajor) => {
                return Err(Error::arg(
                    "weights",
                    "None for a rank-major handle",
                    "Some",
                ))
            }
            (Some(w), _) => {
                check_len("weights", w.len(), cap, "[recv_capacity] f32")?;
                w.device_ptr()
            }
        };
        let out = match grad_expert_out {
            Some(b) => {
                check_len(
                    "grad_expert_out",
                    b.len(),
                    cap * h,
                    "[recv_capacity, hidden] bf16",
                )?;
                RecvBuf::Caller(b)
            }
            None => RecvBuf::Pool(self.pool.alloc(cap * h)?),
        };
        let recv_x = self.recv_peers(&out, "grad_expert_out")?;
        let none = [0u64; MAX_RANKS];
        self.launch_dispatch(
            stream,
            handle,
            grad_out.device_ptr(),
            0,
            recv_x,
            none,
            none,
            none,
            scale,
        )?;
        Ok(out)
    }
}
