//! `NodeGroup`: the collective object that owns the symmetric workspace, the
//! kernels and the device error report of one expert-parallel group, and
//! its configuration. The ops are in the files of their own (layout.rs,
//! dispatch.rs, combine.rs).
//!
//! Tests: `tests/cpu_api.rs` (`GroupConfig::validate`, `ranks_per_node`
//! included),
//! `tests/gpu_intranode.rs` (every op; a device error reported by the next
//! call; a timeout leaves the group unusable).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaStream;

use super::abi::{self, count_row, ErrorInfo, Workspace, MAX_BLOCKS, MAX_RANKS, MAX_TOPK};
use super::handle::Turns;
use super::layout::{exchange_smem, exchange_smem_limit};
use super::low_latency::{LlBuffers, LlKernels};
use crate::error::{Error, Result};
use crate::runtime::{Communicator, Function, MappedHost, Module};
use crate::symm::{SymmBuffer, SymmPool};
use crate::types::RecvLayout;
use crate::types::Topology;

/// Which kernels a group runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Training and prefill: thousands of tokens per rank, a bounded number
    /// of SMs, layout computed once per routing and reused.
    HighThroughput,
    /// Decode: at most `max_tokens_per_rank` (<= 1024) tokens per rank, no
    /// layout pass, buffers fixed at creation, CUDA-graph capturable: the
    /// `ll_*` ops ([`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch), [`EpGroup::ll_combine`](crate::EpGroup::ll_combine); sizes
    /// in [`ll_buffer_bytes`](super::ll_buffer_bytes)).
    LowLatency,
}

/// Sizes fixed when a group is created (the same on every rank).
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// Experts over all ranks; divisible by the world size.
    pub num_experts: usize,
    /// Token width in bf16 elements; a multiple of 8.
    pub hidden: usize,
    /// Most tokens any rank passes to one dispatch.
    pub max_tokens_per_rank: usize,
    /// Rows every rank's receive buffers hold (rank-major: received tokens;
    /// expert-major: padded (token, expert) rows). `0` picks
    /// `world * max_tokens_per_rank`, enough for any rank-major routing.
    pub recv_capacity: usize,
    /// SMs (thread blocks) the data kernels use; at most 132.
    pub num_sms: usize,
    /// Chunks combine splits each rank's tokens into when it pushes partials
    /// (expert outputs not in symmetric memory, or expert-major), so that
    /// pushing one chunk over NVLink overlaps summing the previous one:
    /// 1, 2, 4, 8 or 16 (1 = push everything, then sum). The pull path
    /// (rank-major, symmetric expert outputs) has no chunks.
    pub combine_chunks: usize,
    /// Kernel family.
    pub mode: Mode,
    /// Bound on every wait for another GPU.
    pub timeout: Duration,
    /// Ranks per node: the world is `world / ranks_per_node` nodes of
    /// `ranks_per_node` ranks, rank `r` on node `r / ranks_per_node` with
    /// local index `r % ranks_per_node` ([`Topology`]). Ranks of a node reach
    /// each other over NVLink; tokens for another node cross the network
    /// once, to the rank of that node with the same local index (the rail
    /// peer; `docs/rdma-model.md`). A divisor of the world size, at most 8;
    /// `0` (the default) is the whole world on one node. One node runs the
    /// NVLink path, several the two-level path (network hop, then NVLink);
    /// [`EpGroup::new`](crate::EpGroup::new) picks it from this field.
    pub ranks_per_node: usize,
    /// Rows per chunk of the two-level path's network hop (each chunk's
    /// NVLink work overlaps the next chunk's transfer); at least 1, at most
    /// 2^30 16-byte vectors a chunk. A world of one node has no hop and
    /// does not read it. Default [`DEFAULT_HOP_CHUNK_ROWS`](crate::ops::DEFAULT_HOP_CHUNK_ROWS).
    pub hop_chunk_rows: usize,
}

impl GroupConfig {
    /// Defaults: 24 SMs, high-throughput, 10 s timeout, rank-major capacity,
    /// one node.
    pub fn new(num_experts: usize, hidden: usize, max_tokens_per_rank: usize) -> Self {
        GroupConfig {
            num_experts,
            hidden,
            max_tokens_per_rank,
            recv_capacity: 0,
            num_sms: 24,
            combine_chunks: 4,
            mode: Mode::HighThroughput,
            timeout: Duration::from_secs(10),
            ranks_per_node: 0,
            hop_chunk_rows: super::two_level::DEFAULT_HOP_CHUNK_ROWS,
        }
    }

    /// The nodes of a world of `world` ranks under this config's
    /// `ranks_per_node`; errors as [`Topology::new`].
    pub fn topology(&self, world: usize) -> Result<Topology> {
        Topology::new(world, self.ranks_per_node)
    }

    /// Checks every field against the world size, naming the bad one: what
    /// [`EpGroup::new`](crate::EpGroup::new) checks before it meets the
    /// other ranks.
    ///
    /// The world and `ranks_per_node` first ([`Topology::new`]: at most 8
    /// ranks on one node, a divisor of the world), then every other field;
    /// a world of several nodes also takes the two-level path's checks
    /// (`mode` high-throughput, at most 32 nodes, `hop_chunk_rows`, the
    /// forward batch's size).
    pub fn validate(&self, world: usize) -> Result<()> {
        let topology = self.validate_fields(world)?;
        if topology.nodes() > 1 {
            super::two_level::TwoLevelPath::validate(self, world)?;
        }
        Ok(())
    }

    /// The one-node path's checks: [`validate`](Self::validate), and one
    /// node.
    pub(crate) fn validate_one_node(&self, world: usize) -> Result<()> {
        let topology = self.validate_fields(world)?;
        if topology.nodes() > 1 {
            return Err(Error::InvalidState(format!(
                "the NVLink path of a world of {} nodes (EpGroup::new picks the two-level path)",
                topology.nodes()
            )));
        }
        Ok(())
    }

    /// [`validate`](Self::validate) but the one-node rule: the world's
    /// nodes when every field is good.
    pub(crate) fn validate_fields(&self, world: usize) -> Result<Topology> {
        let topology = self.topology(world)?;
        if self.num_experts == 0
            || !self.num_experts.is_multiple_of(world)
            || self.num_experts > MAX_EXPERTS
        {
            return Err(Error::arg(
                "num_experts",
                format!("a positive multiple of the world size {world}, at most {MAX_EXPERTS}"),
                self.num_experts,
            ));
        }
        if self.hidden == 0 || !self.hidden.is_multiple_of(8) || self.hidden > 65536 {
            return Err(Error::arg(
                "hidden",
                "a positive multiple of 8 (16-byte rows), at most 65536",
                self.hidden,
            ));
        }
        if self.max_tokens_per_rank == 0 || self.max_tokens_per_rank > (1 << 20) {
            return Err(Error::arg(
                "max_tokens_per_rank",
                "1..=1048576",
                self.max_tokens_per_rank,
            ));
        }
        if self.num_sms == 0 || self.num_sms > MAX_BLOCKS {
            return Err(Error::arg(
                "num_sms",
                format!("1..={MAX_BLOCKS}"),
                self.num_sms,
            ));
        }
        if !(self.combine_chunks.is_power_of_two() && self.combine_chunks <= abi::SUBCHUNKS) {
            return Err(Error::arg(
                "combine_chunks",
                format!("1, 2, 4, 8 or {}", abi::SUBCHUNKS),
                self.combine_chunks,
            ));
        }
        if self.mode == Mode::LowLatency && self.max_tokens_per_rank > abi::LL_MAX_TOKENS {
            return Err(Error::arg(
                "max_tokens_per_rank",
                format!("1..={} for Mode::LowLatency", abi::LL_MAX_TOKENS),
                self.max_tokens_per_rank,
            ));
        }
        if self.timeout.is_zero() {
            return Err(Error::arg("timeout", "a positive duration", "0"));
        }
        if self.recv_capacity > i32::MAX as usize {
            return Err(Error::arg(
                "recv_capacity",
                "at most 2^31-1 rows",
                self.recv_capacity,
            ));
        }
        Ok(topology)
    }
}

/// Most experts a group takes: the layout exchange keeps two int32 per expert
/// in shared memory (128 KiB at this bound), and every size derived from the
/// config (count rows, workspace, stage) then stays far inside `usize` and
/// the kernels' int32 indices.
pub const MAX_EXPERTS: usize = 16384;

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
    pub(crate) op_streams: Mutex<super::handle::OpStreams>,
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
                eprintln!("moe-ep: waiting for the group's work in drop failed: {e}");
            }
        }
    }
}

/// `NAME_r2`, `NAME_r4`, `NAME_r8`: a combine kernel per bound on the world.
macro_rules! by_world {
    ($name:literal) => {
        [
            concat!($name, "_r2"),
            concat!($name, "_r4"),
            concat!($name, "_r8"),
        ]
    };
}

// The entry points a group loads: [rank-major, expert-major] where there is
// one per receive layout, [r2, r4, r8] where there is one per world bound.
const LAYOUT_SCAN: [&str; 2] = ["moe_ep_layout_scan_i32", "moe_ep_layout_scan_i64"];
const PUBLISH_REFUSAL: &str = "moe_ep_publish_refusal";
const DISPATCH: [&str; 2] = ["moe_ep_dispatch_rank_major", "moe_ep_dispatch_expert_major"];
const COMBINE_BWD: [&str; 2] = [
    "moe_ep_combine_bwd_rank_major",
    "moe_ep_combine_bwd_expert_major",
];
const COMBINE_PULL: [&str; 3] = by_world!("moe_ep_combine_pull");
const DISPATCH_BWD_PULL: [&str; 3] = by_world!("moe_ep_dispatch_bwd_pull");
const COMBINE_PUSH: [[&str; 3]; 2] = [
    by_world!("moe_ep_combine_push_rank_major"),
    by_world!("moe_ep_combine_push_expert_major"),
];
const DISPATCH_BWD_PUSH: [[&str; 3]; 2] = [
    by_world!("moe_ep_dispatch_bwd_push_rank_major"),
    by_world!("moe_ep_dispatch_bwd_push_expert_major"),
];

/// One kernel per receive layout.
pub(crate) struct ByLayout {
    pub(crate) rank_major: Function,
    pub(crate) expert_major: Function,
}

impl ByLayout {
    fn load(
        names: [&'static str; 2],
        load: impl Fn(&'static str) -> Result<Function>,
    ) -> Result<ByLayout> {
        Ok(ByLayout {
            rank_major: load(names[0])?,
            expert_major: load(names[1])?,
        })
    }
    /// The kernel of `layout`.
    pub(crate) fn of(&self, layout: RecvLayout) -> &Function {
        match layout {
            RecvLayout::RankMajor => &self.rank_major,
            RecvLayout::ExpertMajor { .. } => &self.expert_major,
        }
    }
}

/// The kernels of a group: one entry point per path (the launchers pick),
/// each module loaded once per context.
pub(crate) struct Kernels {
    // layout.cu
    pub(crate) layout_scan_i32: Function,
    pub(crate) layout_scan_i64: Function,
    pub(crate) publish_refusal: Function,
    // dispatch.cu
    pub(crate) dispatch: ByLayout,
    pub(crate) combine_bwd: ByLayout,
    // combine_pull.cu and combine_push.cu: the smallest compile-time world
    // bound that fits (registers); every one may take COMBINE_SMEM of
    // dynamic shared memory (the pushed rank-major bulk-copy ring), the
    // pushed expert-major ones EM_COMBINE_SMEM (their stages).
    pub(crate) combine_pull: Function,
    pub(crate) dispatch_bwd_pull: Function,
    pub(crate) combine_push: ByLayout,
    pub(crate) dispatch_bwd_push: ByLayout,
    // low_latency.cu, for a group of that mode.
    pub(crate) ll: Option<LlKernels>,
}

impl Kernels {
    pub(crate) fn load(comm: &Communicator, mode: Mode) -> Result<Kernels> {
        let ctx = comm.context();
        let (layout, dispatch) = (Module::get(ctx, "layout")?, Module::get(ctx, "dispatch")?);
        let (pull, push) = (
            Module::get(ctx, "combine_pull")?,
            Module::get(ctx, "combine_push")?,
        );
        let bound = match comm.world() {
            0..=2 => 0,
            3..=4 => 1,
            _ => 2,
        };
        let pick = |names: [&'static str; 3]| names[bound];
        let combine_with = |m: &Arc<Module>, name: &'static str, smem: u32| -> Result<Function> {
            let f = m.function(name)?;
            f.allow_dynamic_smem(smem)?;
            Ok(f)
        };
        let combine =
            |m: &Arc<Module>, name: &'static str| combine_with(m, name, abi::COMBINE_SMEM);
        // The expert-major pushed kernels: their own stages (EM_COMBINE_SMEM).
        let em_push = |f: &'static str| {
            let smem = if f.contains("expert_major") {
                abi::EM_COMBINE_SMEM
            } else {
                abi::COMBINE_SMEM
            };
            combine_with(&push, f, smem)
        };
        Ok(Kernels {
            // The scan's last block runs the exchange, whose per-expert
            // arrays take up to 2 x MAX_EXPERTS int32 (128 KiB): above the
            // default 48 KiB.
            layout_scan_i32: {
                let f = layout.function(LAYOUT_SCAN[0])?;
                f.allow_dynamic_smem(exchange_smem_limit())?;
                f
            },
            layout_scan_i64: {
                let f = layout.function(LAYOUT_SCAN[1])?;
                f.allow_dynamic_smem(exchange_smem_limit())?;
                f
            },
            publish_refusal: layout.function(PUBLISH_REFUSAL)?,
            dispatch: ByLayout::load(DISPATCH, |f| dispatch.function(f))?,
            combine_bwd: ByLayout::load(COMBINE_BWD, |f| dispatch.function(f))?,
            combine_pull: combine(&pull, pick(COMBINE_PULL))?,
            dispatch_bwd_pull: combine(&pull, pick(DISPATCH_BWD_PULL))?,
            combine_push: ByLayout::load(COMBINE_PUSH.map(pick), em_push)?,
            dispatch_bwd_push: ByLayout::load(DISPATCH_BWD_PUSH.map(pick), em_push)?,
            ll: match mode {
                Mode::LowLatency => Some(LlKernels::load(comm)?),
                Mode::HighThroughput => None,
            },
        })
    }

    /// Every kernel with the dynamic shared memory its launches ask for.
    pub(crate) fn with_smem(&self, num_experts: usize) -> Vec<(&Function, u32)> {
        let smem = abi::COMBINE_SMEM;
        let mut all = vec![
            (&self.layout_scan_i32, exchange_smem(num_experts)),
            (&self.layout_scan_i64, exchange_smem(num_experts)),
            (&self.dispatch.rank_major, 0),
            (&self.dispatch.expert_major, 0),
            (&self.combine_bwd.rank_major, 0),
            (&self.combine_bwd.expert_major, 0),
            (&self.combine_pull, smem),
            (&self.dispatch_bwd_pull, smem),
            (&self.combine_push.rank_major, smem),
            (&self.combine_push.expert_major, abi::EM_COMBINE_SMEM),
            (&self.dispatch_bwd_push.rank_major, smem),
            (&self.dispatch_bwd_push.expert_major, abi::EM_COMBINE_SMEM),
        ];
        all.extend(self.ll.iter().flat_map(|k| k.all().map(|f| (f, 0))));
        all
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

        // Workspace layout (bytes; R = world, E = experts, H = hidden):
        //   counts         int32 [2][R][count_row(R, E)] parity double-buffered
        //   count_flag     u64   [R]
        //   dispatch_done  u64   [R][MAX_BLOCKS]
        //   combine_done   u64   [R][MAX_BLOCKS]
        //   pull_flag      u64   [R][MAX_BLOCKS]        combine (pull) handshakes
        //   desc           u64   [2][MAX_RANKS][8]      op call descriptors (call
        //                                               parity, source)
        //   seq            u64   [5][MAX_BLOCKS]        local counters ([3][0] error
        //                                               claim, [3][1..6] item counters,
        //                                               [3][8] status, [3][10] layout
        //                                               arrivals; [4] the group's calls)
        //   stage_w        f32   [2][R * max_tokens][MAX_TOPK]
        //   stage          bf16  [2][R * max_tokens][H]
        let (r, h) = (world as u64, cfg.hidden as u64);
        let stage_rows = r * cfg.max_tokens_per_rank as u64;
        let align = |x: u64| x.div_ceil(256) * 256;
        let mut w = Workspace::default();
        let mut at = 0u64;
        let mut carve = |bytes: u64| {
            let off = at;
            at = align(at + bytes);
            (off, at)
        };
        w.counts_off = carve(2 * r * count_row(world, cfg.num_experts) as u64 * 4).0;
        w.count_flag_off = carve(r * 8).0;
        w.dispatch_done_off = carve(r * MAX_BLOCKS as u64 * 8).0;
        w.combine_done_off = carve(r * MAX_BLOCKS as u64 * 8).0;
        w.pull_flag_off = carve(r * MAX_BLOCKS as u64 * 8).0;
        w.desc_off = carve(2 * MAX_RANKS as u64 * 8 * 8).0;
        let zeroed; // everything before the stage must start at zero
        (w.seq_off, zeroed) = carve(5 * MAX_BLOCKS as u64 * 8);
        w.stage_w_off = carve(2 * stage_rows * MAX_TOPK as u64 * 4).0;
        let total;
        (w.stage_off, total) = carve(2 * stage_rows * h * 2);
        w.stage_rows = stage_rows;

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
    /// The group's symmetric-memory pool: allocate caller-supplied receive
    /// buffers here (collectively) for zero copy.
    pub fn pool(&self) -> &SymmPool {
        &self.pool
    }
    /// Experts hosted by each rank.
    pub fn experts_per_rank(&self) -> usize {
        self.cfg.num_experts / self.comm.world()
    }

    /// The one-node path of [`EpGroup::check`](crate::EpGroup::check).
    pub fn check(&self) -> Result<()> {
        if self.comm.is_aborted() {
            return Err(Error::InvalidState(format!(
                "rank {}: the communicator was aborted; make a new communicator and group",
                self.comm.rank()
            )));
        }
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        // Every op of the group is ordered after the previous one (turn):
        // the last stream's end is the end of all of them.
        let stream = turns
            .last
            .clone()
            .unwrap_or_else(|| self.own_stream.clone());
        self.bind(&stream)?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let dev = self.error.read();
        if self.poisoned.load(Ordering::Relaxed) || timed_out(&dev) {
            // Dead here: no collective (the rank that did not come may never
            // call check), and nothing more runs on the group.
            self.poisoned.store(true, Ordering::Relaxed);
            return Err(if timed_out(&dev) {
                self.print_peer_state(&dev);
                self.error_of(dev)
            } else {
                Self::poisoned_error()
            });
        }
        if !turns.unchecked {
            // No op since the last check that met the other ranks: nothing
            // new to learn, and no collective (a program may check twice).
            return Ok(());
        }
        // 0: nothing; 1: an error (what the kernels found: a refusal of
        // this rank's host alone is found by its peers' kernels, unless every
        // rank refused that call, which leaves nothing out of step).
        let found = u64::from(dev.code != abi::code::OK);
        if found != 0 {
            // Cleared before the ranks meet: once any rank is past the
            // all-gather, every rank's status word is clear (a peer's kernel
            // of the next call reads it, peer_stopped in intranode.cuh).
            self.clear_device_error(&stream)?;
            self.error.write(ErrorInfo::default());
        }
        let ll_seq = match &self.ll {
            Some(ll) => ll.batches_sent(&stream)?,
            None => 0,
        };
        let calls = self.device_calls(&stream)?;
        let arrived = self
            .op_barrier
            .as_ref()
            .map_or(0, |b| b.arrivals(self.comm.rank()));
        let all = self
            .comm
            .all_gather_host(&stream, &[found, turns.calls, ll_seq, calls, arrived])?;
        let world = self.comm.world();
        let row = |r: usize| &all[5 * r..5 * r + 5];
        let worst = (0..world).map(|r| row(r)[0]).max().unwrap_or(0);
        turns.unchecked = false;
        if worst == 0 {
            turns.refused = None;
            return Ok(());
        }
        // This rank's own error first, else the first rank's that found one.
        let own: Option<Error> = if dev.code != abi::code::OK {
            Some(self.error_of(dev))
        } else {
            turns.refused.clone().map(Error::InvalidState)
        };
        let peer_error = || Error::PeerFailed {
            peer: (0..world).find(|&r| row(r)[0] != 0).unwrap_or(0),
            arg: None,
            reason: "reported an error since the last check (its own check says which)".into(),
        };
        // Every rank agrees on where the next call starts, its kernels run
        // again, and its low-latency sets take new batches.
        turns.calls = (0..world).map(|r| row(r)[1]).max().unwrap_or(turns.calls);
        if let Some(b) = &self.op_barrier {
            b.realign(
                self.comm.rank(),
                (0..world).map(|r| row(r)[4]).max().unwrap_or(arrived),
            );
        }
        self.set_device_calls(
            &stream,
            (0..world).map(|r| row(r)[3]).max().unwrap_or(calls),
        )?;
        turns.refused = None;
        turns.epoch += 1;
        if let Some(ll) = &self.ll {
            let sent = (0..world).map(|r| row(r)[2]).max().unwrap_or(0);
            ll.realign(&stream, sent)?;
        }
        Err(own.unwrap_or_else(peer_error))
    }

    /// The error an earlier call left, if any, without clearing it: what an
    /// op refuses with at entry (every rank found it in the same call, or
    /// this rank's host refused one, which its peers found).
    pub(crate) fn pending_error(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Relaxed) {
            return Err(Self::poisoned_error());
        }
        let e = self.error.read();
        match e.code {
            abi::code::OK => {}
            _ if timed_out(&e) => {
                // A timeout poisons the group at once.
                self.poisoned.store(true, Ordering::Relaxed);
                self.print_peer_state(&e);
                return Err(self.error_of(e));
            }
            _ => return Err(self.error_of(e)),
        }
        // A refusal of this rank's host alone stops nothing here: where the
        // peers took part in the call their kernels found it, and this
        // rank's next call meets them stopped; where every rank refused
        // the same call, nothing is out of step.
        Ok(())
    }

    fn poisoned_error() -> Error {
        Error::InvalidState(
            "an earlier peer timeout left this group unusable; create a new one".into(),
        )
    }

    /// The calls this rank's kernels have counted (Ws::seq(4), block 0's;
    /// every block's moves in step), read after `stream`'s work.
    fn device_calls(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        let at = self.ws_peers[self.comm.rank()] + self.w.seq_off + 4 * MAX_BLOCKS as u64 * 8;
        let mut v = [0u64; 1];
        // SAFETY: one word of the seq region; no kernel of the group runs.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemcpyDtoHAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        Ok(v[0])
    }

    /// Sets every block's count of the group's calls to `calls` (the most
    /// any rank counted, at `check`): the next call has the same number on
    /// every rank, above any a peer's flag or descriptor still holds.
    fn set_device_calls(&self, stream: &Arc<CudaStream>, calls: u64) -> Result<()> {
        let at = self.ws_peers[self.comm.rank()] + self.w.seq_off + 4 * MAX_BLOCKS as u64 * 8;
        let v = vec![calls; MAX_BLOCKS];
        // SAFETY: the seq region's row 4; no kernel of the group runs.
        unsafe { cudarc::driver::result::memcpy_htod_async(at, &v, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemcpyHtoDAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))
    }

    /// Clears, on `stream` (after the work on it), the device-side claim
    /// word (ErrSink in common.cuh), the item counters and the status word
    /// that stops the kernels (Ws::status in intranode.cuh): seq region
    /// `[3][0..10)`; then waits for it.
    fn clear_device_error(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let words = self.ws_peers[self.comm.rank()] + self.w.seq_off + 3 * MAX_BLOCKS as u64 * 8;
        // SAFETY: the ten words lie inside the workspace (seq region [3]);
        // no kernel of this group runs once `stream`, the last op's, is done
        // with what was enqueued before the memset.
        unsafe { cudarc::driver::result::memset_d8_async(words, 0, 10 * 8, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemsetD8Async"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))
    }

    /// With `MOE_EP_DEBUG_PEERS=1`, a timeout also prints to stderr the
    /// words of this rank's and the named peer's workspaces that keep the
    /// ranks in step ([`peer_state_line`]), read while they stand (the
    /// peer's kernels may still run). Off, it does nothing.
    fn print_peer_state(&self, e: &ErrorInfo) {
        if std::env::var_os("MOE_EP_DEBUG_PEERS").is_none_or(|v| v != "1") {
            return;
        }
        let me = self.comm.rank();
        let mut ranks = vec![me];
        if (e.peer as usize) < self.comm.world() && e.peer as usize != me {
            ranks.push(e.peer as usize);
        }
        for r in ranks {
            let mut words = vec![0u64; 5 * MAX_BLOCKS];
            let base = self.ws_peers[r];
            // SAFETY: the seq region ([5][MAX_BLOCKS] u64 at seq_off) lies
            // inside rank r's workspace as mapped here; reading it races only
            // with its kernels' own updates, which a debug print tolerates.
            let read = (base != 0)
                .then(|| unsafe {
                    cudarc::driver::result::memcpy_dtoh_sync(&mut words, base + self.w.seq_off)
                })
                .transpose();
            match read {
                Ok(Some(())) => eprintln!(
                    "moe-ep: rank {me}, after a timeout ({}): {}",
                    abi::counter_name(e.counter),
                    peer_state_line(r, &words, self.cfg.num_sms)
                ),
                Ok(None) => eprintln!("moe-ep: rank {me}: rank {r}'s workspace is not mapped here"),
                Err(err) => eprintln!("moe-ep: rank {me}: rank {r}'s workspace unreadable: {err}"),
            }
        }
    }

    /// The error a device report stands for.
    fn error_of(&self, e: ErrorInfo) -> Error {
        let who = |peer: i32| {
            if peer as usize == self.comm.rank() {
                format!("rank {peer} (this rank)")
            } else {
                format!("rank {peer}")
            }
        };
        match e.code {
            abi::code::TIMEOUT => Error::PeerTimeout {
                rank: e.rank as usize,
                peer: e.peer as usize,
                counter: abi::counter_name(e.counter),
                expected: e.expected,
                seen: e.seen,
                absent: e.needed == 1,
            },
            abi::code::REFUSED => {
                let arg = (e.counter > 0).then(|| abi::arg_name(e.counter as u64));
                Error::PeerFailed {
                    peer: e.peer as usize,
                    arg,
                    reason: format!(
                        "its host refused its part of call {}{}{} (its own error says why)",
                        e.capacity,
                        match e.seen {
                            0 => String::new(),
                            op => format!(" ({})", abi::desc::op_name(op)),
                        },
                        arg.map_or(String::new(), |a| format!(": argument `{a}`")),
                    ),
                }
            }
            abi::code::PEER_STOPPED if e.seen == abi::code::TIMEOUT as u64 => Error::PeerTimeout {
                rank: e.rank as usize,
                peer: e.peer as usize,
                counter: "another rank's wait for it (that rank timed out first)",
                expected: 0,
                seen: 0,
                absent: false,
            },
            abi::code::PEER_STOPPED => Error::PeerFailed {
                peer: e.peer as usize,
                arg: None,
                reason: format!(
                    "it skipped call {} after an error of its own{}; call check() on every rank",
                    e.capacity,
                    match e.seen {
                        0 => String::new(),
                        c => format!(" (code {c}: {})", abi::code_name(c as i32)),
                    }
                ),
            },
            abi::code::BAD_PEER_DATA => Error::InvalidDeviceData {
                arg: abi::field_name(e.counter),
                detail: format!(
                    "{} wrote {} where only values below {} fit (at {}); nothing was read or written there",
                    if e.peer >= 0 { who(e.peer) } else { "a peer".to_string() },
                    e.seen as i64,
                    e.expected,
                    e.needed
                ),
            },
            abi::code::ABORTED => Error::InvalidState(format!(
                "rank {}: the communicator was aborted; make a new communicator and group",
                self.comm.rank()
            )),
            abi::code::MISMATCH if e.counter == abi::desc::FIELD_HANDLE => Error::arg(
                "handle",
                format!(
                    "the same handle (the same layout call) on every rank at once (rank {} uses the handle of call {})",
                    e.peer, e.seen
                ),
                format!("the handle of call {} on rank {}", e.expected, self.comm.rank()),
            ),
            abi::code::CAPACITY => Error::CapacityExceeded {
                what: if e.peer as usize == self.comm.rank() {
                    "recv_capacity (this rank)"
                } else {
                    "recv_capacity (a peer rank)"
                },
                needed: e.needed as usize,
                capacity: e.capacity as usize,
            },
            abi::code::BAD_EXPERT => Error::InvalidDeviceData {
                arg: "topk_idx",
                detail: format!(
                    "{}: token {} slot {}: expert id {} not in [-1, {})",
                    who(e.peer),
                    e.needed,
                    e.capacity,
                    e.seen as i64,
                    e.expected
                ),
            },
            abi::code::DUP_EXPERT => Error::InvalidDeviceData {
                arg: "topk_idx",
                detail: format!(
                    "{}: token {} slot {}: expert {} appears twice in the token's top-k",
                    who(e.peer),
                    e.needed,
                    e.capacity,
                    e.seen as i64
                ),
            },
            abi::code::MISMATCH
                if e.counter < abi::desc::FIELD_OP || e.counter == abi::FIELD_PAYLOAD =>
            {
                Error::arg(
                    abi::field_name(e.counter),
                    format!(
                        "the same value on every rank in one layout (rank {} has {})",
                        e.peer, e.seen as i64
                    ),
                    format!("{} on rank {}", e.expected as i64, self.comm.rank()),
                )
            }
            abi::code::MISMATCH if e.counter == abi::desc::FIELD_OP => Error::arg(
                "op",
                format!(
                    "the same op on every rank at once (rank {} runs {})",
                    e.peer,
                    abi::desc::op_name(e.seen)
                ),
                format!(
                    "{} on rank {}",
                    abi::desc::op_name(e.expected),
                    self.comm.rank()
                ),
            ),
            abi::code::MISMATCH => Error::arg(
                abi::field_name(e.counter),
                format!(
                    "a buffer of the same kind in the same place on every rank (rank {}: {})",
                    e.peer,
                    abi::desc::place(e.seen)
                ),
                format!(
                    "{} on rank {}",
                    abi::desc::place(e.expected),
                    self.comm.rank()
                ),
            ),
            c => Error::InvalidState(format!("unknown device error code {c}")),
        }
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

/// A report that leaves the group unusable: a timeout here, or a peer that
/// stopped after a timeout of its own (the flags of that call are out of
/// step on some rank).
fn timed_out(e: &ErrorInfo) -> bool {
    e.code == abi::code::TIMEOUT
        || (e.code == abi::code::PEER_STOPPED && e.seen == abi::code::TIMEOUT as u64)
}

/// Numbers the groups of the process (`NodeGroup::id`).
static NEXT_GROUP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The fields of a config every rank must share, with their names
/// (`recv_capacity` and `ranks_per_node` after their defaults).
fn shared_fields(
    cfg: &GroupConfig,
    world: usize,
    recv_capacity: usize,
) -> [(&'static str, u64); 8] {
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

/// One rank's step words (`words`: its workspace's `[5][MAX_BLOCKS]` seq
/// region, `Ws::seq` in intranode.cuh), for a timeout's debug print: the
/// group's calls (row 4), the layout calls (row 0, slot 0), the dispatch-family and combine-family
/// calls of its `blocks` blocks (rows 1 and 2: the fewest and the most), the
/// error claim word (row 3, word 0) and the status word that makes every
/// kernel return at entry (row 3, word 8).
fn peer_state_line(rank: usize, words: &[u64], blocks: usize) -> String {
    let blocks = blocks.clamp(1, MAX_BLOCKS);
    let range = |row: usize| {
        let s = &words[row * MAX_BLOCKS..row * MAX_BLOCKS + blocks];
        let (lo, hi) = (s.iter().min().unwrap(), s.iter().max().unwrap());
        if lo == hi {
            format!("{lo}")
        } else {
            format!("{lo}..{hi}")
        }
    };
    format!(
        "rank {rank}'s workspace: calls {} (layout {}, dispatch family {}, combine family {}) over its {blocks} blocks, error word {}, status word {}",
        range(4),
        words[0],
        range(1),
        range(2),
        words[3 * MAX_BLOCKS],
        words[3 * MAX_BLOCKS + 8]
    )
}

#[cfg(test)]
mod tests {
    use super::super::low_latency::{LL_COMBINE_RECV, LL_COMBINE_SEND, LL_COPY, LL_RECV, LL_SEND};
    use super::*;

    /// The debug line reads each word where the kernels keep it.
    #[test]
    fn peer_state_line_reads_the_kernels_words() {
        let mut w = vec![0u64; 5 * MAX_BLOCKS];
        w[4 * MAX_BLOCKS..4 * MAX_BLOCKS + 4].fill(15); // the group's calls
        w[0] = 3; // layout calls
        w[MAX_BLOCKS..MAX_BLOCKS + 4].copy_from_slice(&[7, 7, 6, 7]); // dispatch, 4 blocks
        w[MAX_BLOCKS + 4] = 99; // a block past the grid: not counted
        w[2 * MAX_BLOCKS..2 * MAX_BLOCKS + 4].fill(5); // combine
        w[3 * MAX_BLOCKS] = 1; // error claim
        w[3 * MAX_BLOCKS + 8] = 4; // status
        assert_eq!(
            peer_state_line(2, &w, 4),
            "rank 2's workspace: calls 15 (layout 3, dispatch family 6..7, combine family 5) \
             over its 4 blocks, error word 1, status word 4"
        );
        w[3 * MAX_BLOCKS + 8] = 0;
        assert!(peer_state_line(2, &w, 4).ends_with("error word 1, status word 0"));
    }

    /// Every entry point `Kernels::load` looks up is in its module's PTX
    /// (a misspelt name would otherwise show only on a GPU).
    #[test]
    fn every_entry_point_is_in_its_module() {
        let per_world = |n: [[&'static str; 3]; 2]| n.concat();
        let modules: [(&str, Vec<&str>); 5] = [
            ("layout", [&LAYOUT_SCAN[..], &[PUBLISH_REFUSAL]].concat()),
            ("dispatch", [DISPATCH, COMBINE_BWD].concat()),
            ("combine_pull", [COMBINE_PULL, DISPATCH_BWD_PULL].concat()),
            (
                "combine_push",
                [per_world(COMBINE_PUSH), per_world(DISPATCH_BWD_PUSH)].concat(),
            ),
            (
                "low_latency",
                [
                    &LL_SEND[..],
                    &LL_RECV,
                    &[LL_COPY],
                    &LL_COMBINE_SEND,
                    &LL_COMBINE_RECV,
                ]
                .concat(),
            ),
        ];
        for (module, entries) in modules {
            let (_, _, ptx) = crate::kernels::MODULES
                .iter()
                .find(|m| m.0 == module)
                .unwrap_or_else(|| panic!("module {module} is not embedded"));
            let ptx = std::str::from_utf8(&ptx[..ptx.len() - 1]).unwrap();
            let found = ptx.matches(".entry ").count();
            assert_eq!(found, entries.len(), "{module}: entry points");
            for f in entries {
                assert!(ptx.contains(&format!(".entry {f}(")), "{module}: no {f}");
            }
        }
    }
}
