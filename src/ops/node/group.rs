//! `NodeGroup`: the collective object that owns the symmetric workspace, the
//! kernels and the device error report of one expert-parallel group, and
//! its configuration; its creation (the ranks agree on the config, the
//! workspace is carved and zeroed) and what it holds for its ops' turns
//! (`Turns`, `OpStreams`). The turn itself is in `turn.rs`, the device's
//! errors in `device_error.rs`, the kernels in `kernels.rs`, the ops in
//! files of their own (`layout_op.rs`, `dispatch_op.rs`, `combine_op.rs`,
//! and `ops/low_latency/`).
//!
//! Tests: `tests/cpu_api.rs` (the config's checks at creation),
//! `tests/gpu_intranode.rs` (every op; a device error reported by the next
//! call; a timeout leaves the group unusable).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

use super::kernels::Kernels;
use crate::error::{Error, Result};
use crate::ops::abi::{self, ErrorInfo, Workspace, MAX_RANKS};
use crate::ops::buffers::DeviceRegion;
use crate::ops::config::{GroupConfig, Mode};
use crate::ops::footprint::{carve_workspace, MemoryFootprint};
use crate::ops::low_latency::buffers::LlBuffers;
use crate::ops::low_latency::ll_buffer_bytes;
use crate::runtime::{Communicator, MappedHost};
use crate::symm::{SymmBuffer, SymmPool};

/// One expert-parallel group over a communicator whose ranks share an NVLink
/// node. Creating it is collective; so is every op.
pub(crate) struct NodeGroup {
    pub(crate) comm: Arc<Communicator>,
    pub(crate) pool: SymmPool,
    pub(crate) cfg: GroupConfig,
    pub(crate) recv_capacity: usize,
    /// Symmetric workspace (flags, counts, combine stage); carved by `w`.
    /// Held for its lifetime; kernels reach it through `ws_peers`.
    _ws: SymmBuffer<u8>,
    pub(crate) w: Workspace,
    /// The workspace's bytes (`_ws`).
    pub(crate) ws_bytes: u64,
    pub(crate) ws_peers: [u64; MAX_RANKS],
    /// The low-latency buffers (`Mode::LowLatency` only).
    pub(crate) ll: Option<LlBuffers>,
    pub(crate) error: Arc<MappedHost<ErrorInfo>>,
    pub(crate) poisoned: AtomicBool,
    pub(crate) k: Kernels,
    /// This group's number in the process (handles remember it).
    pub(crate) id: u64,
    /// The stream of the group's last op, the calls so far, this rank's
    /// refusals and cleared errors (see `OpTurn`).
    pub(crate) turns: Mutex<Turns>,
    /// The current op's stream and its buffers' streams (`OpTurn`).
    pub(crate) op_streams: Mutex<OpStreams>,
    /// The group's own stream (its creation's; a refusal of a call whose
    /// stream was unusable goes here).
    pub(crate) own_stream: Arc<CudaStream>,
    /// Called by `Communicator::abort`: marks the error report aborted, so
    /// that every running kernel of the group stops at its next look.
    _on_abort: Arc<dyn Fn() + Send + Sync>,
    /// A virtual world's ranks' arrivals at the end of each op (shared by
    /// the group's ranks; `None` on NCCL communicators).
    pub(crate) op_barrier: Option<Arc<crate::runtime::host_group::OpBarrier>>,
    /// Set by [`EpGroup::allow_graph_capture`](crate::EpGroup::allow_graph_capture): ops may be called on a
    /// stream that captures a CUDA graph (refused otherwise).
    pub(crate) capture_allowed: AtomicBool,
    /// Fault tests only: what this rank's next layout or low-latency
    /// dispatch sends wrong on purpose (0: nothing).
    pub(crate) faults: TestFaults,
}

/// Fault tests only (`EpGroup::corrupt_next_count_row_for_tests`,
/// `EpGroup::corrupt_next_ll_token_count_for_tests`): each taken (reset to
/// 0) by the next op it applies to.
#[derive(Default)]
pub(crate) struct TestFaults {
    /// `LayoutParams::count_fault`: a count-row word replaced.
    pub(crate) count_row: std::sync::atomic::AtomicI32,
    /// `LlParams::tokens_fault`: the token count a dispatch send signals.
    pub(crate) ll_tokens: std::sync::atomic::AtomicI32,
}

/// Dropping a group first waits for the work it was given (the last op's
/// stream follows every earlier op, see `NodeGroup::turn`), so no kernel of it
/// still reads or writes its workspace, handles' arrays or error report when
/// they are released. A failed wait is printed, not raised (drop cannot
/// fail); a peer timeout still ends that work within the group's timeout.
impl Drop for NodeGroup {
    fn drop(&mut self) {
        let turns = self.turns.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(stream) = turns.last.take() {
            let res = self
                .comm
                .context()
                .bind_to_thread()
                .and_then(|()| stream.synchronize());
            if let Err(e) = res {
                tracing::warn!("waiting for the group's work in drop failed: {e}");
            }
        }
    }
}

impl NodeGroup {
    /// Creates the group (collective): validates `cfg`, allocates and zeroes
    /// the symmetric workspace, loads the kernels.
    pub fn new(comm: &Arc<Communicator>, cfg: GroupConfig) -> Result<Self> {
        let world = comm.world();
        if comm.node_ranks().len() != world {
            return Err(Error::arg(
                "comm",
                "all ranks on one node (the NVLink path); the RDMA path is not implemented yet",
                format!("{} of {world} ranks on this node", comm.node_ranks().len()),
            ));
        }
        let ctx = comm.context().clone();
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        // This rank's checks, then every rank's verdict and config: a rank
        // that refuses its config, or a config that differs between ranks,
        // stops every rank here, before any collective allocation (a peer
        // with a larger capacity or other sizes would write past this rank's
        // buffers).
        let k = Kernels::load(comm, cfg.mode)?;
        let local = cfg.validate_one_node(world).and_then(|_| {
            super::residency::measure(comm, &k.with_smem(cfg.num_experts))?.check(cfg.num_sms)
        });
        let recv_capacity = if cfg.recv_capacity == 0 {
            world * cfg.max_tokens_per_rank
        } else {
            cfg.recv_capacity
        };
        agree(comm, &stream, &cfg, recv_capacity, local)?;

        // The workspace's regions and size: crate::ops::footprint.
        let (w, zeroed, total) = carve_workspace(&cfg, world);
        let pool = SymmPool::new(comm, 256 << 20);
        let ws: SymmBuffer<u8> = pool.alloc(total as usize)?;
        // Low-latency buffers (collective, after the workspace on every
        // rank: the mode is a shared field), zeroed on `stream` below.
        let ll = match cfg.mode {
            Mode::LowLatency => Some(LlBuffers::new(comm, &pool, &stream, &cfg)?),
            Mode::HighThroughput => None,
        };
        let mut ws_peers = [0u64; MAX_RANKS];
        for (rank, p) in ws_peers.iter_mut().enumerate().take(world) {
            *p = ws.peer_ptr(rank).ok_or_else(|| {
                Error::InvalidState(format!(
                    "rank {rank} is not NVLink-reachable from rank {}",
                    comm.rank()
                ))
            })?;
        }
        // SAFETY: the flag region lies inside ws; the barrier below keeps
        // peers from writing before everyone has zeroed.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                ws.device_ptr(),
                0,
                zeroed as usize,
                stream.cu_stream(),
            )
            .map_err(Error::cuda("cuMemsetD8Async"))?;
        }
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        // Everything that allocates (pinned host memory may wait for the whole
        // GPU) happens before the barrier: once a rank has passed it, its
        // kernels may wait for the other ranks', and on a virtual world a
        // rank still allocating behind the barrier would hold them up.
        let error = Arc::new(MappedHost::new(&ctx, ErrorInfo::default())?);
        let on_abort: Arc<dyn Fn() + Send + Sync> = {
            let error = error.clone();
            Arc::new(move || {
                let mut e = error.read();
                if e.code == abi::code::OK {
                    e.code = abi::code::ABORTED;
                    error.write(e);
                }
            })
        };
        comm.on_abort(Arc::downgrade(&on_abort));
        // Virtual ranks: one barrier of the group's ops, rank 0's, for all.
        let op_barrier = match comm.host_group() {
            Some(g) => {
                let mine = (comm.rank() == 0)
                    .then(|| Arc::new(crate::runtime::host_group::OpBarrier::new(world)));
                g.exchange("op barrier", mine)?[0].clone()
            }
            None => None,
        };
        comm.barrier(&stream)?;

        Ok(NodeGroup {
            comm: comm.clone(),
            pool,
            recv_capacity,
            _ws: ws,
            ws_bytes: total,
            ll,
            w,
            ws_peers,
            error,
            poisoned: AtomicBool::new(false),
            k,
            id: NEXT_GROUP.fetch_add(1, Ordering::Relaxed),
            turns: Mutex::new(Turns::default()),
            op_streams: Mutex::new(Default::default()),
            own_stream: stream,
            _on_abort: on_abort,
            op_barrier,
            capture_allowed: AtomicBool::new(false),
            faults: TestFaults::default(),
            cfg,
        })
    }

    /// The one-node path of [`EpGroup::allow_graph_capture`](crate::EpGroup::allow_graph_capture).
    pub unsafe fn allow_graph_capture(&self) {
        self.capture_allowed.store(true, Ordering::Relaxed);
    }

    /// The configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.cfg
    }
    /// Receive capacity in rows (after defaults).
    pub fn recv_capacity(&self) -> usize {
        self.recv_capacity
    }
    /// The communicator.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }
    /// What this rank of the group holds ([`MemoryFootprint`]).
    pub fn memory_footprint(&self) -> MemoryFootprint {
        let ll = self.ll.as_ref().map_or(Default::default(), |_| {
            ll_buffer_bytes(&self.cfg, self.comm.world())
        });
        let (reserved, free) = (self.pool.reserved_bytes(), self.pool.free_bytes());
        MemoryFootprint {
            workspace: self.ws_bytes,
            low_latency: ll.total(),
            pool_other: reserved.saturating_sub(self.ws_bytes + ll.symmetric),
            pool_free: free,
            two_level: 0,
            pinned_host: std::mem::size_of::<ErrorInfo>() as u64,
        }
    }
    /// The group's symmetric-memory pool: allocate caller-supplied receive
    /// buffers here (collectively) for zero copy.
    pub fn pool(&self) -> &SymmPool {
        &self.pool
    }
    /// Experts hosted by each rank.
    pub fn experts_per_rank(&self) -> usize {
        self.cfg.num_experts / self.comm.world()
    }

    pub(crate) fn timeout_ns(&self) -> u64 {
        self.cfg.timeout.as_nanos().min(u64::MAX as u128) as u64
    }

    pub(crate) fn bind(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.comm.context().cu_ctx() {
            return Err(Error::arg(
                "stream",
                "a stream of the group's GPU context",
                "a stream of another context",
            ));
        }
        self.comm
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))
    }
}

/// Numbers the groups of the process (`NodeGroup::id`).
static NEXT_GROUP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The fields of a config every rank must share, with their names
/// (`recv_capacity` and `ranks_per_node` after their defaults).
fn shared_fields(
    cfg: &GroupConfig,
    world: usize,
    recv_capacity: usize,
) -> [(&'static str, u64); 9] {
    let ranks_per_node = match cfg.ranks_per_node {
        0 => world,
        g => g,
    };
    [
        ("num_experts", cfg.num_experts as u64),
        ("hidden", cfg.hidden as u64),
        ("max_tokens_per_rank", cfg.max_tokens_per_rank as u64),
        ("recv_capacity", recv_capacity as u64),
        ("num_sms", cfg.num_sms as u64),
        ("combine_chunks", cfg.combine_chunks as u64),
        ("mode", cfg.mode as u64),
        ("ranks_per_node", ranks_per_node as u64),
        ("overflow", cfg.overflow as u64),
    ]
}

/// Gathers every rank's verdict on its own config (`local`) and the config
/// itself: every rank returns the same kind of error when any rank refused
/// its config or a shared field differs (naming the field, both values and
/// both ranks), so no rank goes on into a collective the others skip.
fn agree(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    cfg: &GroupConfig,
    recv_capacity: usize,
    local: Result<()>,
) -> Result<()> {
    let fields = shared_fields(cfg, comm.world(), recv_capacity);
    let mut mine = vec![local.is_ok() as u64];
    mine.extend(fields.iter().map(|&(_, v)| v));
    let all = comm.all_gather_host(stream, &mine)?;
    local?;
    let n = mine.len();
    let me = comm.rank();
    if let Some(r) = (0..comm.world()).find(|&r| all[r * n] == 0) {
        return Err(Error::arg(
            "cfg",
            "a config every rank accepts",
            format!("rank {r} refused its config (its own error names the field)"),
        ));
    }
    for (i, &(name, v)) in fields.iter().enumerate() {
        if let Some(r) = (0..comm.world()).find(|&r| all[r * n + 1 + i] != v) {
            let theirs = all[r * n + 1 + i];
            return Err(Error::arg(
                name,
                format!("the same value on every rank (rank {r} has {theirs})"),
                format!("{v} on rank {me}"),
            ));
        }
    }
    Ok(())
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
    pub(crate) op: Option<Arc<CudaStream>>,
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
                tracing::warn!("ordering a buffer's stream after the op failed: {e}");
            }
        }
    }
}

impl Drop for OpStreams {
    fn drop(&mut self) {
        self.finish();
    }
}
