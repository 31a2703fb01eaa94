//! [`EpGroup`], the one expert-parallel group of every world, and its
//! [`Handle`]. The group picks its path from
//! [`GroupConfig::ranks_per_node`]: one node runs the NVLink path (the
//! node's high-throughput ops in `ops/node/`, the low-latency ops in
//! `ops/low_latency/`), several nodes the two-level path (`ops/two_level/`:
//! the network hop between rail peers, then the node's ops). Every op here is the path's own, with its arguments,
//! errors and results.
//!
//! Tests: tests/gpu_intranode.rs, tests/gpu_low_latency.rs and
//! tests/gpu_guarantees.rs (one node), tests/gpu_two_level.rs (several
//! nodes, on virtual ranks), tests/cpu_api.rs (the checks a config takes).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView};
use half::bf16;

use super::buffers::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, DispatchOutFp8, Dispatched,
    DispatchedFp8, Fp8Rows, RecvBuf, TopkIdx,
};
use super::config::GroupConfig;
use super::footprint::MemoryFootprint;
use super::low_latency::handle::{LlCombineSent, LlDispatchArgs, LlDispatchSent, LlHandle};
use super::node::group::NodeGroup;
use super::node::handle::{HostCounts, NodeHandle};
use super::node::turn::Op;
use super::two_level::{TwoLevelHandle, TwoLevelPath};
use crate::error::{Error, Result};
use crate::runtime::Communicator;
use crate::symm::SymmPool;
use crate::types::{LlLayout, RecvLayout, Topology};

/// One expert-parallel group over a communicator: its experts, buffers and
/// kernels. Creating it is collective; so is every op (every rank calls the
/// same ops in the same order).
///
/// The path follows [`GroupConfig::ranks_per_node`]: the whole world on one
/// node (`0`, or the world size) runs over NVLink, in either
/// [`Mode`](crate::Mode); several nodes run the two-level path
/// (high-throughput only), whose layout waits on the host (the stream
/// lengths go to every rank before the hop is sized, so it cannot be
/// captured in a CUDA graph) and whose ops use the caller's buffers on the
/// op's stream as they are (they do not order themselves after a buffer's
/// own stream, as the one-node ops do).
pub struct EpGroup {
    path: Path,
}

enum Path {
    Node(Arc<NodeGroup>),
    TwoLevel(Box<TwoLevelPath>),
}

/// The routing of one batch ([`EpGroup::layout`]), for the dispatch,
/// combine and backward passes of the group that made it.
pub struct Handle {
    inner: HandleOf,
}

// The one-node handle stays inline: it is the common case, and boxing it
// would cost a heap allocation per layout.
#[allow(clippy::large_enum_variant)]
enum HandleOf {
    Node(NodeHandle),
    TwoLevel(Box<TwoLevelHandle>),
}

impl EpGroup {
    /// Creates the group (collective): validates `cfg`
    /// ([`GroupConfig::validate`]; every rank must pass the same config, a
    /// field that differs is named on every rank), allocates and zeroes the
    /// symmetric workspace, loads the kernels. `cfg.ranks_per_node` picks
    /// the path (see [`EpGroup`]).
    ///
    /// ```no_run
    /// # use moe_ep::{Communicator, EpGroup, GroupConfig, Overflow};
    /// # fn f(comm: &std::sync::Arc<Communicator>) -> moe_ep::Result<()> {
    /// let mut cfg = GroupConfig::new(256, 7168, 4096); // experts, hidden, max tokens per rank
    /// cfg.overflow = Overflow::Drop;                   // rows beyond recv_capacity dropped
    /// let group = EpGroup::new(comm, cfg)?;            // collective
    /// # Ok(()) }
    /// ```
    pub fn new(comm: &Arc<Communicator>, cfg: GroupConfig) -> Result<EpGroup> {
        let topology = cfg.topology(comm.world())?;
        let path = if topology.nodes() > 1 {
            Path::TwoLevel(Box::new(TwoLevelPath::new(comm, cfg)?))
        } else {
            Path::Node(Arc::new(NodeGroup::new(comm, cfg)?))
        };
        Ok(EpGroup { path })
    }

    /// The node's group: the whole group on one node, the node stage of the
    /// two-level path otherwise.
    fn node(&self) -> &NodeGroup {
        match &self.path {
            Path::Node(g) => g,
            Path::TwoLevel(g) => g.node_group(),
        }
    }

    /// The one-node group, or an error naming `ranks_per_node` for `op`.
    fn one_node(&self, op: &str) -> Result<&Arc<NodeGroup>> {
        match &self.path {
            Path::Node(g) => Ok(g),
            Path::TwoLevel(g) => Err(Error::arg(
                "ranks_per_node",
                format!("a group of one node for {op} (it runs over NVLink only)"),
                format!(
                    "{} ({} nodes)",
                    g.config().ranks_per_node,
                    g.topology().nodes()
                ),
            )),
        }
    }

    /// Lets this group's ops be called on a stream that captures a CUDA
    /// graph (stream capture); until then such an op is refused, naming
    /// `stream`. Every later launch of the graph runs the captured ops
    /// again, with the buffers and handles they were given.
    ///
    /// # Safety
    /// While a graph that captured an op of this group can still be
    /// launched, every buffer and handle that op was given (pool buffers
    /// included: the crate cannot see a graph's launches, so it does not
    /// order a pool range's reuse after them) must stay alive and keep its
    /// place, and the group itself must outlive the graph. Launch the
    /// graph's of every rank the same number of times, in the same order
    /// relative to the group's other ops (its calls are counted on the
    /// device, at each launch).
    ///
    /// On several nodes this allows the node stage's kernels only: the
    /// two-level layout waits on the host and is never capturable.
    pub unsafe fn allow_graph_capture(&self) {
        // SAFETY: the caller's contract, as documented above.
        unsafe { self.node().allow_graph_capture() }
    }

    /// The group's configuration (as given to [`EpGroup::new`]).
    pub fn config(&self) -> &GroupConfig {
        match &self.path {
            Path::Node(g) => g.config(),
            Path::TwoLevel(g) => g.config(),
        }
    }

    /// The world's nodes (one on the NVLink path).
    pub fn topology(&self) -> Topology {
        match &self.path {
            Path::Node(g) => g
                .config()
                .topology(g.comm().world())
                .expect("a valid world"),
            Path::TwoLevel(g) => g.topology(),
        }
    }

    /// True when the group runs the two-level path (several nodes).
    pub fn is_two_level(&self) -> bool {
        matches!(self.path, Path::TwoLevel(_))
    }

    /// Receive capacity in rows (after defaults).
    pub fn recv_capacity(&self) -> usize {
        match &self.path {
            Path::Node(g) => g.recv_capacity(),
            Path::TwoLevel(g) => g.recv_capacity(),
        }
    }

    /// The communicator the group was made on (the whole world).
    pub fn comm(&self) -> &Arc<Communicator> {
        match &self.path {
            Path::Node(g) => g.comm(),
            Path::TwoLevel(g) => g.comm(),
        }
    }

    /// The group's symmetric-memory pool: allocate caller-supplied receive
    /// buffers here (collectively) for zero copy.
    ///
    /// On several nodes: the node stage's pool, where caller-supplied
    /// receive buffers and symmetric expert outputs live.
    pub fn pool(&self) -> &SymmPool {
        self.node().pool()
    }

    /// The memory this rank of the group holds, by category (device and
    /// pinned host bytes; [`MemoryFootprint`], whose formula is in
    /// [`workspace_bytes`](crate::ops::workspace_bytes) and
    /// [`ll_buffer_bytes`](crate::ops::ll_buffer_bytes)). Handles come on top
    /// ([`Handle::device_bytes`]). On several nodes: the node stage's group
    /// and the network hop's flags.
    pub fn memory_footprint(&self) -> MemoryFootprint {
        match &self.path {
            Path::Node(g) => g.memory_footprint(),
            Path::TwoLevel(g) => {
                let mut f = g.node_group().memory_footprint();
                f.two_level = ((g.arrive.len() + g.done.len()) * 8) as u64;
                f
            }
        }
    }

    /// Experts on each rank (`num_experts / world`).
    pub fn experts_per_rank(&self) -> usize {
        self.config().num_experts / self.comm().world()
    }

    /// Waits for the group's work on this rank, then learns what every rank
    /// found since the last check, and clears it: **collective**, call it on
    /// every rank at the same point (after the same ops, e.g. once per step,
    /// whatever the step's ops returned); it ends in one host all-gather of
    /// the communicator. A check with no op of this rank since its last one
    /// meets no one and returns `Ok` (checking twice in a row is harmless).
    ///
    /// `Ok` when no rank found anything. Otherwise every rank gets an
    /// error: its own (the first its kernels recorded, or the refusal of
    /// its host; where its kernels only saw a peer stop,
    /// [`Error::PeerFailed`] naming that peer and the argument of its
    /// error) or, where it found none, [`Error::PeerFailed`] naming the
    /// first rank that did. Then every rank is in the same state again: the
    /// same call count, the status words cleared (stream-ordered), the
    /// low-latency buffer sets realigned, and handles made before the error
    /// refused (`handle`: the error may have skipped their layout or
    /// dispatch on some rank). After a timeout (on any rank) the group stays
    /// unusable on every rank: drop it and make a new one.
    ///
    /// Errors of the routing (a bad or repeated expert id on any rank),
    /// ranks that disagree in a layout (topk, layout, alignment), capacity,
    /// ranks that run different ops, handles or buffers, and a call one
    /// rank's host refused are found by every rank in the same call: from
    /// there on every rank's kernels return at entry, writing nothing (and
    /// telling their peers so), and every op refuses with that error until
    /// `check`.
    ///
    /// On several nodes: the node stage's check (a wait of the network hop
    /// that times out reports in the op itself).
    ///
    /// ```no_run
    /// # use moe_ep::EpGroup;
    /// # fn f(group: &EpGroup) -> moe_ep::Result<()> {
    /// // Once a step, on every rank, whatever the step's ops returned:
    /// if let Err(e) = group.check() {
    ///     eprintln!("the step failed on some rank: {e}"); // every rank is in step again
    /// }
    /// # Ok(()) }
    /// ```
    pub fn check(&self) -> Result<()> {
        self.node().check()
    }

    /// Refuses a handle of the other path.
    fn mismatch<T>(&self) -> Result<T> {
        Err(Error::arg(
            "handle",
            "a handle made by this group's layout",
            "a handle of another group",
        ))
    }

    /// Computes the routing layout (collective): tokens per rank and expert,
    /// every token's row on every receiver, and the count matrix of all
    /// ranks. `topk_idx` is `[T, topk]` with `T <= max_tokens_per_rank`.
    ///
    /// On several nodes the layout waits on the host (a stream sync and a
    /// host exchange of the stream lengths).
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, Handle, RecvLayout, TopkIdx};
    /// # fn f(group: &EpGroup, handle: &Handle, x: &CudaSlice<bf16>, w: &CudaSlice<f32>,
    /// #      idx: &CudaSlice<i64>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// let h = group.layout(&stream, TopkIdx::I64(idx), 8, RecvLayout::ExpertMajor { alignment: 128 })?;
    /// let counts = h.host_counts(&stream)?; // optional: one sync, exact sizes
    /// # Ok(()) }
    /// ```
    pub fn layout(
        &self,
        stream: &Arc<CudaStream>,
        topk_idx: TopkIdx<'_>,
        topk: usize,
        layout: RecvLayout,
    ) -> Result<Handle> {
        let inner = match &self.path {
            Path::Node(g) => HandleOf::Node(g.layout(stream, topk_idx, topk, layout)?),
            Path::TwoLevel(g) => {
                HandleOf::TwoLevel(Box::new(g.layout(stream, topk_idx, topk, layout)?))
            }
        };
        Ok(Handle { inner })
    }

    /// Sends every token to the ranks of its experts, writing straight into
    /// each receiver's buffers (zero copy). `x` is `[T, H]` bf16,
    /// `topk_weights` `[T, K]` f32, matching the handle's routing.
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, Handle, RecvLayout, TopkIdx};
    /// # fn f(group: &EpGroup, handle: &Handle, x: &CudaSlice<bf16>, w: &CudaSlice<f32>,
    /// #      idx: &CudaSlice<i64>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// # use moe_ep::DispatchOut;
    /// let recv = group.dispatch(&stream, handle, x, w, DispatchOut::default())?;
    /// // recv.tokens [rows, H], recv.topk_weights, recv.topk_idx, recv.src
    /// # Ok(()) }
    /// ```
    pub fn dispatch<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
    ) -> Result<Dispatched<'a>> {
        match (&self.path, &handle.inner) {
            (Path::Node(g), HandleOf::Node(h)) => g.dispatch(stream, h, x, topk_weights, out),
            (Path::TwoLevel(g), HandleOf::TwoLevel(h)) => {
                g.dispatch(stream, h, x, topk_weights, out)
            }
            _ => self.mismatch(),
        }
    }

    /// [`dispatch`](Self::dispatch) of fp8 rows: the e4m3 codes `[T, H]` and
    /// their block scales (MXFP8's e8m0 per 32 values, or f32 per 128),
    /// forwarded as given; each received row's scales land beside it (same
    /// row index) in a buffer of the same kind. Both layouts; expert-major
    /// padding rows get zero codes and scales unless
    /// [`GroupConfig::zero_padding`] is off. `H` must be a multiple of 128.
    /// Every rank must send the same payload: a rank whose dispatch is bf16
    /// or whose scales are of the other kind makes every rank stop naming
    /// `op`. Combine stays bf16 ([`combine`](Self::combine) of the experts'
    /// bf16 outputs).
    ///
    /// One node only: a group of several nodes refuses it, naming
    /// `ranks_per_node`.
    ///
    /// ```no_run
    /// # use moe_ep::{cuda::CudaSlice, DispatchOutFp8, EpGroup, Fp8Rows, Fp8Scales, Handle};
    /// # fn f(group: &EpGroup, handle: &Handle, codes: &CudaSlice<u8>, scales: &CudaSlice<u8>,
    /// #      w: &CudaSlice<f32>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// // MXFP8: codes [T, H] e4m3, scales [T, H / 32] e8m0.
    /// let x = Fp8Rows { codes, scales: Fp8Scales::E8m0Per32(scales) };
    /// let recv = group.dispatch_fp8(&stream, handle, x, w, DispatchOutFp8::default())?;
    /// // recv.codes [rows, H], recv.scales [rows, H / 32], in the handle's layout.
    /// # Ok(()) }
    /// ```
    pub fn dispatch_fp8<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        x: Fp8Rows<'_>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOutFp8<'a>,
    ) -> Result<DispatchedFp8<'a>> {
        let g = self.one_node("dispatch_fp8")?;
        match &handle.inner {
            HandleOf::Node(h) => g.dispatch_fp8(stream, h, x, topk_weights, out),
            HandleOf::TwoLevel(_) => self.mismatch(),
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
    /// buffer, in the same place (symmetric buffers are collective anyway):
    /// the kernels compare every rank's choice before they read or wait,
    /// and a rank that differs makes every rank stop with
    /// [`Error::InvalidArgument`] naming `expert_out`.
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, Handle, RecvLayout, TopkIdx};
    /// # fn f(group: &EpGroup, handle: &Handle, x: &CudaSlice<bf16>, w: &CudaSlice<f32>,
    /// #      idx: &CudaSlice<i64>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// # let expert_out = x;
    /// group.combine(&stream, handle, expert_out, None, out)?; // out [T, H]
    /// # Ok(()) }
    /// ```
    pub fn combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        match (&self.path, &handle.inner) {
            (Path::Node(g), HandleOf::Node(h)) => g.combine(stream, h, expert_out, weights, out),
            (Path::TwoLevel(g), HandleOf::TwoLevel(h)) => {
                g.combine(stream, h, expert_out, weights, out)
            }
            _ => self.mismatch(),
        }
    }

    /// Backward of dispatch: the gradient of the received tokens is combined
    /// home (unweighted), and the gradient of the received top-k weights is
    /// routed back to `[T, K]` (`grad_topk_weights`, when given). As in
    /// [`EpGroup::combine`](Self::combine), rank-major gradients in symmetric memory (both of
    /// them, when weights are given) are read in place by their home ranks.
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, Handle, RecvLayout, TopkIdx};
    /// # fn f(group: &EpGroup, handle: &Handle, x: &CudaSlice<bf16>, w: &CudaSlice<f32>,
    /// #      idx: &CudaSlice<i64>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// # use moe_ep::DispatchBackwardArgs;
    /// # let grad_recv = x;
    /// group.dispatch_backward(&stream, handle, DispatchBackwardArgs {
    ///     grad_recv_tokens: grad_recv,   // [rows, H], the handle's layout
    ///     grad_recv_topk_weights: None,
    ///     grad_tokens: out,              // [T, H]
    ///     grad_topk_weights: None,
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn dispatch_backward(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        args: DispatchBackwardArgs<'_>,
    ) -> Result<()> {
        match (&self.path, &handle.inner) {
            (Path::Node(g), HandleOf::Node(h)) => g.dispatch_backward(stream, h, args),
            (Path::TwoLevel(g), HandleOf::TwoLevel(h)) => g.dispatch_backward(stream, h, args),
            _ => self.mismatch(),
        }
    }

    /// Backward of combine: the gradient of the output `[T, H]` is dispatched
    /// (no layout work) into `[recv_capacity, H]` rows in the handle's layout;
    /// padding rows are zero. With `weights` (expert-major, as given to
    /// combine), each row is scaled by its weight.
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, Handle, RecvLayout, TopkIdx};
    /// # fn f(group: &EpGroup, handle: &Handle, x: &CudaSlice<bf16>, w: &CudaSlice<f32>,
    /// #      idx: &CudaSlice<i64>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// # let grad_out = x;
    /// let grad_rows = group.combine_backward(&stream, handle, grad_out, None, None)?;
    /// // grad_rows [rows, H] in the handle's layout, from the pool
    /// # Ok(()) }
    /// ```
    pub fn combine_backward<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Handle,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
    ) -> Result<RecvBuf<'a, bf16>> {
        match (&self.path, &handle.inner) {
            (Path::Node(g), HandleOf::Node(h)) => {
                g.combine_backward(stream, h, grad_out, weights, grad_expert_out)
            }
            (Path::TwoLevel(g), HandleOf::TwoLevel(h)) => {
                g.combine_backward(stream, h, grad_out, weights, grad_expert_out)
            }
            _ => self.mismatch(),
        }
    }

    // ---- low latency: one node only (several refuse, naming ranks_per_node) ----

    /// Sends this rank's tokens to the ranks of their experts (the first
    /// half of [`EpGroup::ll_dispatch`](Self::ll_dispatch), which has the arguments); returns
    /// at once, without waiting for the other ranks. Put other work on the
    /// stream, then [`EpGroup::ll_dispatch_wait`](Self::ll_dispatch_wait). The batch takes the
    /// group's next buffer set: refused while that set's previous batch is
    /// not combined.
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, LlDispatchArgs, LlInput, LlLayout, TopkIdx};
    /// # fn f(group: &EpGroup, x: &CudaSlice<bf16>, w: &CudaSlice<f32>, idx: &CudaSlice<i64>,
    /// #      y: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// let args = LlDispatchArgs {
    ///     x: LlInput::Bf16(x), topk_idx: TopkIdx::I64(idx), topk: 8, topk_weights: w,
    ///     layout: LlLayout::ExpertMajor, cast_fp8: None,
    /// };
    /// let sent = group.ll_dispatch_send(&stream, args)?;
    /// // ... the other micro-batch's work on the stream ...
    /// let h = group.ll_dispatch_wait(&stream, &sent)?;
    /// let sent = group.ll_combine_send(&stream, &h, y)?;
    /// // ... more work ...
    /// group.ll_combine_wait(&stream, &sent, None, out)?;
    /// # Ok(()) }
    /// ```
    pub fn ll_dispatch_send(
        &self,
        stream: &Arc<CudaStream>,
        args: LlDispatchArgs<'_>,
    ) -> Result<LlDispatchSent> {
        self.one_node("ll_dispatch_send")?
            .ll_dispatch_send(stream, args)
    }

    /// Waits (on the stream, bounded by the group's timeout) for every
    /// rank's rows of a sent dispatch and lays them out: the second half of
    /// [`EpGroup::ll_dispatch`](Self::ll_dispatch).
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, LlDispatchArgs, LlInput, LlLayout, TopkIdx};
    /// # fn f(group: &EpGroup, x: &CudaSlice<bf16>, w: &CudaSlice<f32>, idx: &CudaSlice<i64>,
    /// #      y: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// let args = LlDispatchArgs {
    ///     x: LlInput::Bf16(x), topk_idx: TopkIdx::I64(idx), topk: 8, topk_weights: w,
    ///     layout: LlLayout::ExpertMajor, cast_fp8: None,
    /// };
    /// let sent = group.ll_dispatch_send(&stream, args)?;
    /// // ... the other micro-batch's work on the stream ...
    /// let h = group.ll_dispatch_wait(&stream, &sent)?;
    /// let sent = group.ll_combine_send(&stream, &h, y)?;
    /// // ... more work ...
    /// group.ll_combine_wait(&stream, &sent, None, out)?;
    /// # Ok(()) }
    /// ```
    pub fn ll_dispatch_wait(
        &self,
        stream: &Arc<CudaStream>,
        sent: &LlDispatchSent,
    ) -> Result<LlHandle> {
        self.one_node("ll_dispatch_wait")?
            .ll_dispatch_wait(stream, sent)
    }

    /// Low-latency dispatch (collective): every token of this rank to the
    /// ranks of its experts, in `layout`, with no layout pass and no host
    /// synchronisation. Expert-major: `[El, R * M, H]` rows, each local
    /// expert's (token, expert) pairs packed from its block's start by
    /// source rank then token, with their `src`; rank-major: `[R, M, H]`
    /// rows, row `s * M + t` for token `t` of rank `s`, with the token's `K`
    /// local expert ids (`-1` = not here) and weights. The bits are
    /// [`crate::reference::ll_dispatch`]'s; see [`LlHandle`] for the outputs.
    ///
    /// - `x`: `[T, H]` bf16 rows, or the caller's fp8 rows ([`LlInput`](crate::LlInput)).
    /// - `topk_idx`: `[T, topk]` i32 or i64 global expert ids, `-1` = not
    ///   routed; `T <= max_tokens_per_rank` (`T = 0` is fine). An id outside
    ///   `[-1, E)` or repeated in a token is found on the device: every
    ///   rank's later ops refuse with `InvalidDeviceData` until `check()`.
    /// - `topk_weights`: `[T, topk]` f32 (rank-major: they travel with the
    ///   rows; expert-major: combine applies them on this rank).
    /// - `cast_fp8`: cast bf16 rows to fp8 e4m3 on the sender, one scale per
    ///   128 values ([`crate::reference::quantize_fp8`], bit for bit); needs
    ///   `hidden` a multiple of 128. `None` with fp8 input.
    ///
    /// Every rank must pass the same `topk`, `layout` and kind of rows
    /// (bf16 or fp8), else every rank's wait reports the mismatch. Errors
    /// before launch name `mode`, `topk`, `topk_idx`, `topk_weights`, `x`,
    /// `x_scales`, `hidden` or `cast_fp8`.
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, LlDispatchArgs, LlInput, LlLayout, TopkIdx};
    /// # fn f(group: &EpGroup, x: &CudaSlice<bf16>, w: &CudaSlice<f32>, idx: &CudaSlice<i64>,
    /// #      y: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// let args = LlDispatchArgs {
    ///     x: LlInput::Bf16(x), topk_idx: TopkIdx::I64(idx), topk: 8, topk_weights: w,
    ///     layout: LlLayout::ExpertMajor, cast_fp8: None,
    /// };
    /// let h = group.ll_dispatch(&stream, args)?;      // the experts read h's rows, write y
    /// group.ll_combine(&stream, &h, y, None, out)?;   // out [T, H]
    /// # Ok(()) }
    /// ```
    pub fn ll_dispatch(
        &self,
        stream: &Arc<CudaStream>,
        args: LlDispatchArgs<'_>,
    ) -> Result<LlHandle> {
        self.one_node("ll_dispatch")?.ll_dispatch(stream, args)
    }

    /// Sends this rank's expert outputs home (the first half of
    /// [`EpGroup::ll_combine`](Self::ll_combine), whose docs say what `expert_out` holds);
    /// returns at once. Then [`EpGroup::ll_combine_wait`](Self::ll_combine_wait).
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, LlDispatchArgs, LlInput, LlLayout, TopkIdx};
    /// # fn f(group: &EpGroup, x: &CudaSlice<bf16>, w: &CudaSlice<f32>, idx: &CudaSlice<i64>,
    /// #      y: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// let args = LlDispatchArgs {
    ///     x: LlInput::Bf16(x), topk_idx: TopkIdx::I64(idx), topk: 8, topk_weights: w,
    ///     layout: LlLayout::ExpertMajor, cast_fp8: None,
    /// };
    /// let sent = group.ll_dispatch_send(&stream, args)?;
    /// // ... the other micro-batch's work on the stream ...
    /// let h = group.ll_dispatch_wait(&stream, &sent)?;
    /// let sent = group.ll_combine_send(&stream, &h, y)?;
    /// // ... more work ...
    /// group.ll_combine_wait(&stream, &sent, None, out)?;
    /// # Ok(()) }
    /// ```
    pub fn ll_combine_send(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
    ) -> Result<LlCombineSent> {
        self.one_node("ll_combine_send")?
            .ll_combine_send(stream, handle, expert_out)
    }

    /// Waits (bounded) for every rank's rows of a sent combine and sums them
    /// into `out` (the second half of [`EpGroup::ll_combine`](Self::ll_combine)).
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, LlDispatchArgs, LlInput, LlLayout, TopkIdx};
    /// # fn f(group: &EpGroup, x: &CudaSlice<bf16>, w: &CudaSlice<f32>, idx: &CudaSlice<i64>,
    /// #      y: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// let args = LlDispatchArgs {
    ///     x: LlInput::Bf16(x), topk_idx: TopkIdx::I64(idx), topk: 8, topk_weights: w,
    ///     layout: LlLayout::ExpertMajor, cast_fp8: None,
    /// };
    /// let sent = group.ll_dispatch_send(&stream, args)?;
    /// // ... the other micro-batch's work on the stream ...
    /// let h = group.ll_dispatch_wait(&stream, &sent)?;
    /// let sent = group.ll_combine_send(&stream, &h, y)?;
    /// // ... more work ...
    /// group.ll_combine_wait(&stream, &sent, None, out)?;
    /// # Ok(()) }
    /// ```
    pub fn ll_combine_wait(
        &self,
        stream: &Arc<CudaStream>,
        sent: &LlCombineSent,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        self.one_node("ll_combine_wait")?
            .ll_combine_wait(stream, sent, weights, out)
    }

    /// Low-latency combine (collective): the expert outputs of `handle`'s
    /// batch brought home and summed per token in f32 in a fixed order, into
    /// `out` `[T, H]` bf16 (exactly [`crate::reference::ll_combine_emulated`]).
    ///
    /// - `expert_out`: `[rows, H]` bf16 in the dispatch's layout (only
    ///   counted rows are read; any device memory). Expert-major: one row per
    ///   (token, expert), unweighted. Rank-major: per token, the sum of this
    ///   rank's experts' weighted outputs. The rows of this rank's own tokens
    ///   are not copied: the sum reads them here, in place (the two-phase
    ///   form copies them in [`EpGroup::ll_combine_send`](Self::ll_combine_send), so that
    ///   `expert_out` may be reused before the wait).
    /// - `weights`: expert-major only, `[T, K]` f32 applied on this (the
    ///   home) rank, `out[t] = sum over k ascending of w[t, k] * row(t, k)`;
    ///   `None` = the `topk_weights` the dispatch was given. Rank-major:
    ///   `None` (`out[t]` = the sum over ranks ascending of their rows).
    ///
    /// A token with no experts gets zeros. Errors before launch name
    /// `handle` (another group's, or a batch whose set was reused),
    /// `expert_out`, `weights` or `out`; a batch already combined is
    /// `InvalidState`. A refused combine tells every home (they stop with
    /// `PeerFailed` naming this rank and the argument) and spends the
    /// batch: a corrected retry is `InvalidState`; dispatch the next batch
    /// (after `check`, where a peer saw the refusal).
    ///
    /// ```no_run
    /// # use moe_ep::{bf16, cuda::CudaSlice, EpGroup, LlDispatchArgs, LlInput, LlLayout, TopkIdx};
    /// # fn f(group: &EpGroup, x: &CudaSlice<bf16>, w: &CudaSlice<f32>, idx: &CudaSlice<i64>,
    /// #      y: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// let args = LlDispatchArgs {
    ///     x: LlInput::Bf16(x), topk_idx: TopkIdx::I64(idx), topk: 8, topk_weights: w,
    ///     layout: LlLayout::ExpertMajor, cast_fp8: None,
    /// };
    /// let h = group.ll_dispatch(&stream, args)?;      // the experts read h's rows, write y
    /// group.ll_combine(&stream, &h, y, None, out)?;   // out [T, H]
    /// # Ok(()) }
    /// ```
    pub fn ll_combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        self.one_node("ll_combine")?
            .ll_combine(stream, handle, expert_out, weights, out)
    }
}

/// An op this rank's caller refuses before making it, for
/// [`EpGroup::refuse`]: a binding's own checks (a dtype, a device, a shape
/// its language can see before the call) fail on one rank, and the peers,
/// which made the call, must not wait for that rank.
#[derive(Clone, Copy)]
pub enum RefusedCall<'h> {
    /// [`EpGroup::layout`].
    Layout,
    /// [`EpGroup::dispatch`] or [`EpGroup::dispatch_fp8`] of the handle.
    Dispatch(&'h Handle),
    /// [`EpGroup::combine`] of the handle.
    Combine(&'h Handle),
    /// [`EpGroup::dispatch_backward`] of the handle.
    DispatchBackward(&'h Handle),
    /// [`EpGroup::combine_backward`] of the handle.
    CombineBackward(&'h Handle),
    /// [`EpGroup::ll_dispatch`] or [`EpGroup::ll_dispatch_send`] in the
    /// layout.
    LlDispatch(LlLayout),
    /// [`EpGroup::ll_dispatch_wait`] (no peer waits for it).
    LlDispatchWait,
    /// [`EpGroup::ll_combine`] or [`EpGroup::ll_combine_send`] of the
    /// batch.
    LlCombine(&'h LlHandle),
    /// [`EpGroup::ll_combine_wait`] (no peer waits for it).
    LlCombineWait,
}

impl EpGroup {
    /// Refuses `call` on this rank with `e`, as the op itself refuses a bad
    /// argument: every peer's op stops at once with
    /// [`Error::PeerFailed`] from their [`check`](Self::check) naming this
    /// rank and `e`'s argument, this rank's `check` returns
    /// [`Error::InvalidState`] naming its refusal (where every rank refused
    /// the call, nothing is out of step and `check` returns `Ok`), and the
    /// call counts on every rank. For the checks a caller makes before an op (a
    /// binding's dtype or device checks); returns the error to raise: `e`,
    /// or the error the op would have returned first (the group holds one,
    /// the communicator was aborted, the handle is another group's).
    ///
    /// On several nodes a refused layout is told to every rank (its part of
    /// the layout's all-gather says so: every rank's layout fails at once,
    /// [`Error::PeerFailed`] naming this rank); of the other ops nothing is
    /// published (the two-level ops' own host refusals are not either): the
    /// node peers wait until their timeout, naming this rank, the peers on
    /// other nodes in the network hop until the host collectives' timeout
    /// on virtual nodes, over NCCL until
    /// [`Communicator::abort`](crate::Communicator::abort).
    ///
    /// ```no_run
    /// # use moe_ep::{EpGroup, Error, Handle, RefusedCall};
    /// # fn f(group: &EpGroup, handle: &Handle) -> moe_ep::Result<()> {
    /// let stream = group.comm().context().default_stream();
    /// // This rank's x is f16 where the op takes bf16:
    /// let e = Error::arg("x", "a bf16 array", "f16");
    /// return Err(group.refuse(&stream, RefusedCall::Dispatch(handle), e));
    /// # }
    /// ```
    pub fn refuse(&self, stream: &Arc<CudaStream>, call: RefusedCall<'_>, e: Error) -> Error {
        let g = match (&self.path, &call) {
            (Path::Node(g), _) => g,
            (Path::TwoLevel(p), RefusedCall::Layout) => return p.refuse_layout(stream, e),
            (Path::TwoLevel(_), _) => return e,
        };
        fn node(h: &Handle) -> Option<&NodeHandle> {
            match &h.inner {
                HandleOf::Node(h) => Some(h),
                HandleOf::TwoLevel(_) => None,
            }
        }
        match call {
            RefusedCall::Layout => g.refuse_op(stream, Op::Layout, None, e),
            RefusedCall::Dispatch(h) => g.refuse_op(stream, Op::Dispatch, node(h), e),
            RefusedCall::Combine(h) => g.refuse_op(stream, Op::Combine, node(h), e),
            RefusedCall::DispatchBackward(h) => {
                g.refuse_op(stream, Op::DispatchBackward, node(h), e)
            }
            RefusedCall::CombineBackward(h) => g.refuse_op(stream, Op::CombineBackward, node(h), e),
            RefusedCall::LlDispatch(layout) => g.ll_refuse_dispatch(stream, layout, e),
            RefusedCall::LlDispatchWait => {
                g.ll_refuse_quietly(stream, "moe_ep::ll_dispatch_wait", e)
            }
            RefusedCall::LlCombine(h) => g.ll_refuse_combine(stream, h, e),
            RefusedCall::LlCombineWait => g.ll_refuse_quietly(stream, "moe_ep::ll_combine_wait", e),
        }
    }
}

impl EpGroup {
    /// Tests only (feature `testkit`): this rank's next layout on one node
    /// sends its count row with `word` replaced by `value`, as a peer's bad
    /// write would have it, for fault tests of what every rank checks in the
    /// rows it receives.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn corrupt_next_count_row_for_tests(&self, word: CountWord, value: i16) -> Result<()> {
        let Path::Node(g) = &self.path else {
            return Err(Error::InvalidState(
                "count-row faults are for one-node groups".into(),
            ));
        };
        let (e, r) = (self.config().num_experts, g.comm().world());
        let at = match word {
            CountWord::Expert(x) if x < e => x,
            CountWord::SubChunkStart { to, chunk }
                if to < r && (1..crate::ops::abi::SUBCHUNKS).contains(&chunk) =>
            {
                e + r + to * (crate::ops::abi::SUBCHUNKS - 1) + chunk - 1
            }
            other => {
                return Err(Error::arg(
                    "word",
                    "a word of this group's count row",
                    format!("{other:?}"),
                ))
            }
        };
        let w = i32::try_from(at + 1)
            .ok()
            .filter(|&w| w < 0x8000)
            .ok_or_else(|| Error::arg("word", "below 32767", at))?;
        g.faults.count_row.store(
            (w << 16) | i32::from(value as u16),
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(())
    }

    /// Tests only (feature `testkit`): this rank's next low-latency dispatch
    /// sends its rows as usual but signals `tokens` (nonzero) as its token
    /// count to every receiver, as a peer's bad write would have it.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn corrupt_next_ll_token_count_for_tests(&self, tokens: i32) -> Result<()> {
        let Path::Node(g) = &self.path else {
            return Err(Error::InvalidState("low latency is one node's".into()));
        };
        if tokens == 0 {
            return Err(Error::arg("tokens", "a nonzero count", 0));
        }
        g.faults
            .ll_tokens
            .store(tokens, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// Tests only (feature `testkit`): a word of a rank's count row, as
/// [`EpGroup::corrupt_next_count_row_for_tests`] takes it.
#[cfg(feature = "testkit")]
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub enum CountWord {
    /// The tokens-times-slots it sends to expert `e`.
    Expert(usize),
    /// Where the combine's sub-chunk `chunk` (1..SUBCHUNKS) of its rows
    /// for rank `to` begins.
    SubChunkStart { to: usize, chunk: usize },
}

impl Handle {
    /// The node stage's handle: the whole handle on one node; on several,
    /// the handle of the forward batch, whose counts are this rank's
    /// receive counts and whose rank and expert counts are the node's.
    fn node(&self) -> &NodeHandle {
        match &self.inner {
            HandleOf::Node(h) => h,
            HandleOf::TwoLevel(h) => h.node_handle(),
        }
    }

    /// Device bytes this handle holds on this rank while it lives: its
    /// layout arrays (every token's positions, the count matrix, offsets)
    /// and the symmetric rows the expert-major senders write beside the
    /// tokens; on several nodes, the node stage's handle's (the hop plan's
    /// arrays come on top, sized by the batch).
    pub fn device_bytes(&self) -> u64 {
        self.node().device_bytes()
    }

    /// The receive layout.
    pub fn layout(&self) -> RecvLayout {
        self.node().layout()
    }

    /// This rank's tokens `T` in the batch.
    pub fn num_tokens(&self) -> usize {
        match &self.inner {
            HandleOf::Node(h) => h.num_tokens(),
            HandleOf::TwoLevel(h) => h.num_tokens(),
        }
    }

    /// The top-k of the routing the layout was given.
    pub fn topk(&self) -> usize {
        match &self.inner {
            HandleOf::Node(h) => h.topk(),
            HandleOf::TwoLevel(h) => h.topk(),
        }
    }

    /// The routing the layout kept, `[T, K]` i32 on the device (no host
    /// sync, graph-safe): the caller's `topk_idx` with -1 where a slot was
    /// not routed or its row was dropped ([`Overflow::Drop`](crate::ops::Overflow::Drop)). `None` on
    /// several nodes (whose node stage routes a forward batch, not this
    /// rank's tokens; the drop policy runs on one node only).
    pub fn kept_topk_idx(&self) -> Option<CudaView<'_, i32>> {
        match &self.inner {
            HandleOf::Node(h) => Some(h.kept_topk_idx()),
            HandleOf::TwoLevel(_) => None,
        }
    }

    /// This rank's dropped (token, slot) pairs, `[T, K]` on the host: true
    /// where the slot was routed and its row dropped at the receiver
    /// ([`Overflow::Drop`](crate::ops::Overflow::Drop); all false otherwise). One stream sync.
    pub fn dropped_slots(&self, stream: &Arc<CudaStream>) -> Result<Vec<bool>> {
        match &self.inner {
            HandleOf::Node(h) => h.dropped_slots(stream),
            HandleOf::TwoLevel(h) => Ok(vec![false; h.num_tokens() * h.topk()]),
        }
    }

    /// Unpadded (token, expert) rows per local expert, on the device (i32).
    pub fn tokens_per_local_expert(&self) -> CudaView<'_, i32> {
        self.node().tokens_per_local_expert()
    }

    /// Copies the counts to the host (synchronises `stream`): eager sizing.
    /// After it, on one node, the buffers this rank passes to the handle's
    /// ops (dispatch's receive buffers, combine's `expert_out` and
    /// `weights`, the backward passes' row buffers) need only hold
    /// [`HostCounts::max_recv_rows`] rows instead of `recv_capacity`: a
    /// runtime can allocate exactly that (collectively: it is the same on
    /// every rank) between layout and dispatch. Per local expert:
    /// [`HostCounts::tokens_per_local_expert`] (expert-major blocks are
    /// these padded to the alignment); this rank's total:
    /// [`HostCounts::recv_rows`].
    ///
    /// On several nodes: the node stage's counts (`recv_rows` and
    /// `tokens_per_local_expert` are this rank's; the rank and expert
    /// counts are those of the node's ranks).
    pub fn host_counts(&self, stream: &Arc<CudaStream>) -> Result<HostCounts> {
        self.node().host_counts(stream)
    }

    /// Rows dispatch delivers on this rank (expert-major: padded). On one
    /// node this reads the counts back (one stream sync, as
    /// [`host_counts`](Self::host_counts)); on several the layout already
    /// learned it on the host.
    pub fn recv_rows(&self, stream: &Arc<CudaStream>) -> Result<usize> {
        match &self.inner {
            HandleOf::Node(h) => Ok(h.host_counts(stream)?.recv_rows),
            HandleOf::TwoLevel(h) => Ok(h.recv_rows()),
        }
    }

    /// Network rows this rank sends per remote node in dispatch (and
    /// receives back in combine), by node, 0 at its own node; `None` on one
    /// node.
    pub fn network_rows_sent(&self) -> Option<&[usize]> {
        match &self.inner {
            HandleOf::Node(_) => None,
            HandleOf::TwoLevel(h) => Some(h.network_rows_sent()),
        }
    }

    /// Network rows this rank receives per remote node in dispatch; `None`
    /// on one node.
    pub fn network_rows_received(&self) -> Option<&[usize]> {
        match &self.inner {
            HandleOf::Node(_) => None,
            HandleOf::TwoLevel(h) => Some(h.network_rows_received()),
        }
    }

    /// Tests only (feature `testkit`): the expert-major receivers' rows of
    /// each received token here, as the senders wrote them (`[R * M, K]`),
    /// for fault tests that corrupt what a peer wrote.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn meta_for_tests(&self) -> &crate::symm::SymmBuffer<i32> {
        self.node().meta_for_tests()
    }
}
