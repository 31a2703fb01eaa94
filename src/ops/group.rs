//! `EpGroup`: the collective object that owns the symmetric workspace, the
//! kernels and the device error report of one expert-parallel group.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;

use super::abi::{self, count_row, ErrorInfo, Workspace, MAX_BLOCKS, MAX_RANKS, MAX_TOPK};
use crate::error::{Error, Result};
use crate::runtime::{Communicator, Function, MappedHost, Module};
use crate::symm::{SymmBuffer, SymmPool};

/// Which kernels a group runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Training and prefill: thousands of tokens per rank, a bounded number
    /// of SMs, layout computed once per routing and reused.
    HighThroughput,
    /// Decode: up to a fixed number of tokens, CUDA-graph capturable. Not
    /// implemented yet: `EpGroup::new` rejects it.
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
}

impl GroupConfig {
    /// Defaults: 24 SMs, high-throughput, 10 s timeout, rank-major capacity.
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
        }
    }

    /// Checks every field against the world size, naming the bad one.
    pub fn validate(&self, world: usize) -> Result<()> {
        if world == 0 || world > MAX_RANKS {
            return Err(Error::arg(
                "world",
                format!("1..={MAX_RANKS} ranks on one NVLink node"),
                world,
            ));
        }
        if self.num_experts == 0 || !self.num_experts.is_multiple_of(world) {
            return Err(Error::arg(
                "num_experts",
                format!("a positive multiple of the world size {world}"),
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
        if self.mode == Mode::LowLatency {
            return Err(Error::arg(
                "mode",
                "HighThroughput (LowLatency is not implemented yet)",
                "LowLatency",
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
        Ok(())
    }
}

/// One expert-parallel group over a communicator whose ranks share an NVLink
/// node. Creating it is collective; so is every op.
pub struct EpGroup {
    pub(crate) comm: Arc<Communicator>,
    pub(crate) pool: SymmPool,
    pub(crate) cfg: GroupConfig,
    pub(crate) recv_capacity: usize,
    /// Symmetric workspace (flags, counts, combine stage); carved by `w`.
    /// Held for its lifetime; kernels reach it through `ws_peers`.
    _ws: SymmBuffer<u8>,
    pub(crate) w: Workspace,
    pub(crate) ws_peers: [u64; MAX_RANKS],
    pub(crate) error: MappedHost<ErrorInfo>,
    poisoned: AtomicBool,
    pub(crate) k: Kernels,
}

/// The kernels of a group.
pub(crate) struct Kernels {
    pub(crate) layout_scan: Function,
    pub(crate) layout_exchange: Function,
    pub(crate) layout_meta: Function,
    pub(crate) dispatch: Function,
    /// The smallest compile-time world bound that fits (registers); its
    /// bulk-copy buffers live in dynamic shared memory.
    pub(crate) combine: Function,
}

impl Kernels {
    pub(crate) fn load(comm: &Communicator) -> Result<Kernels> {
        let m = Module::get(comm.context(), "intranode")?;
        let combine = m.function(match comm.world() {
            0..=2 => "moe_ep_combine_r2",
            3..=4 => "moe_ep_combine_r4",
            _ => "moe_ep_combine_r8",
        })?;
        combine.allow_dynamic_smem(abi::COMBINE_SMEM)?;
        Ok(Kernels {
            layout_scan: m.function("moe_ep_layout_scan")?,
            layout_exchange: m.function("moe_ep_layout_exchange")?,
            layout_meta: m.function("moe_ep_layout_meta")?,
            dispatch: m.function("moe_ep_dispatch")?,
            combine,
        })
    }

    /// Every kernel with the dynamic shared memory its launches ask for.
    pub(crate) fn with_smem(&self, num_experts: usize) -> Vec<(&Function, u32)> {
        vec![
            (&self.layout_scan, 0),
            (&self.layout_exchange, exchange_smem(num_experts)),
            (&self.layout_meta, 0),
            (&self.dispatch, 0),
            (&self.combine, abi::COMBINE_SMEM),
        ]
    }
}

/// Dynamic shared memory of the layout exchange: two int32 per expert.
pub(crate) fn exchange_smem(num_experts: usize) -> u32 {
    (2 * num_experts * 4) as u32
}

impl EpGroup {
    /// Creates the group (collective): validates `cfg`, allocates and zeroes
    /// the symmetric workspace, loads the kernels.
    pub fn new(comm: &Arc<Communicator>, cfg: GroupConfig) -> Result<Self> {
        let world = comm.world();
        cfg.validate(world)?;
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
        // Before any collective allocation: a refusal here is the same on
        // every rank (same GPU kind, same config), so no rank is left waiting.
        let k = Kernels::load(comm)?;
        super::residency::measure(comm, &k.with_smem(cfg.num_experts))?.check(cfg.num_sms)?;
        let recv_capacity = if cfg.recv_capacity == 0 {
            world * cfg.max_tokens_per_rank
        } else {
            cfg.recv_capacity
        };

        // Workspace layout (bytes; R = world, E = experts, H = hidden):
        //   counts         int32 [2][R][count_row(R, E)] parity double-buffered
        //   count_flag     u64   [R]
        //   dispatch_done  u64   [R][MAX_BLOCKS]
        //   combine_done   u64   [R][MAX_BLOCKS]
        //   pull_flag      u64   [R][MAX_BLOCKS]        combine (pull) handshakes
        //   seq            u64   [4][MAX_BLOCKS]        local counters ([3][0] error
        //                                               claim, [3][1..4] item counters)
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
        let zeroed; // everything before the stage must start at zero
        (w.seq_off, zeroed) = carve(4 * MAX_BLOCKS as u64 * 8);
        w.stage_w_off = carve(2 * stage_rows * MAX_TOPK as u64 * 4).0;
        let total;
        (w.stage_off, total) = carve(2 * stage_rows * h * 2);
        w.stage_rows = stage_rows;

        let pool = SymmPool::new(comm, 256 << 20);
        let ws: SymmBuffer<u8> = pool.alloc(total as usize)?;
        let mut ws_peers = [0u64; MAX_RANKS];
        for (rank, p) in ws_peers.iter_mut().enumerate().take(world) {
            *p = ws.peer_ptr(rank).ok_or_else(|| {
                Error::InvalidState(format!(
                    "rank {rank} is not NVLink-reachable from rank {}",
                    comm.rank()
                ))
            })?;
        }
        let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
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
        let error = MappedHost::new(&ctx, ErrorInfo::default())?;
        comm.barrier(&stream)?;

        Ok(EpGroup {
            comm: comm.clone(),
            pool,
            recv_capacity,
            _ws: ws,
            w,
            ws_peers,
            error,
            poisoned: AtomicBool::new(false),
            k,
            cfg,
        })
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

    /// Reports (and clears) the first error the kernels recorded since the
    /// last call. A timeout leaves the group unusable: its flags are out of
    /// step with the peers'.
    pub fn check(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Relaxed) {
            return Err(Error::InvalidState(
                "an earlier peer timeout left this group unusable; create a new one".into(),
            ));
        }
        let e = self.error.read();
        if e.code == abi::code::OK {
            return Ok(());
        }
        // Clear the report and the device-side claim word (ErrSink in
        // common.cuh), so the next error is recorded too.
        self.error.write(ErrorInfo::default());
        let claim = self.ws_peers[self.comm.rank()] + self.w.seq_off + 3 * MAX_BLOCKS as u64 * 8;
        self.comm
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: the claim word lies inside the workspace (seq region).
        unsafe { cudarc::driver::result::memset_d8_sync(claim, 0, 8) }
            .map_err(Error::cuda("cuMemsetD8"))?;
        Err(match e.code {
            abi::code::TIMEOUT => {
                self.poisoned.store(true, Ordering::Relaxed);
                Error::PeerTimeout {
                    rank: e.rank as usize,
                    peer: e.peer as usize,
                    counter: abi::counter_name(e.counter),
                    expected: e.expected,
                    seen: e.seen,
                }
            }
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
                    "token {} slot {}: expert id {} not in [-1, {})",
                    e.needed, e.capacity, e.seen as i64, e.expected
                ),
            },
            abi::code::DUP_EXPERT => Error::InvalidDeviceData {
                arg: "topk_idx",
                detail: format!(
                    "token {} slot {}: expert {} appears twice in the token's top-k",
                    e.needed, e.capacity, e.seen
                ),
            },
            c => Error::InvalidState(format!("unknown device error code {c}")),
        })
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
