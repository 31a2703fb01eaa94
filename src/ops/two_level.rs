//! The two-level (inter-node) path: [`TwoLevelPath`], a world of several
//! nodes (`GroupConfig::ranks_per_node`), and its [`TwoLevelHandle`].
//!
//! A token crosses the network once per remote node it reaches, to the rank
//! of that node with its own local index (its rail peer), which forwards it
//! over NVLink inside its node; combine runs the other way, each node's
//! partial summed inside the node before it crosses the network, and the
//! home sums the nodes in ascending order (`docs/rdma-model.md`,
//! [`crate::reference::two_level`]). Per op:
//!
//! - layout: the node streams (`moe_ep_two_level_streams_*`: each token's
//!   row in its stream to each node), their lengths to the host and to every
//!   rank (one all-gather: the host waits here), each stream's node-local
//!   expert ids and origins packed (`pack_ids`) and sent to the rail peers
//!   ([`RailHop`]), then the node group's layout of the forward batch (the
//!   rows landed from the nodes below, this rank's own rows, the rows landed
//!   from the nodes above);
//! - dispatch: the rows and weights packed (`pack_rows`), sent, and
//!   dispatched inside the node; the received rows' sources mapped back to
//!   (home rank, home token) (`remap_src`);
//! - combine: the node group's combine of the forward batch, the partials
//!   sent back, the home's sum over nodes (`node_sum`);
//! - dispatch backward: as combine, plus the weight gradients (`gather_w`);
//! - combine backward: as dispatch, without weights.
//!
//! The received rows are the flat dispatch's rows in another order: grouped
//! by forwarding rank, then home node, then token
//! ([`two_level_dispatch`](crate::reference::two_level_dispatch)).
//!
//! Kernels: `kernels-cuda/two_level.cu`; the forwarding is the NVLink path
//! (the node's [`EpGroup`](crate::EpGroup)). Tests: `tests/gpu_two_level.rs` (virtual nodes),
//! and the unit tests below (each rank's rows against the reference's
//! forward batches and traffic, on the CPU).
//!
//! Every op's hop runs in chunks of [`TwoLevelPath::hop_chunk_rows`] rows
//! on a stream of its own, overlapped with the node's NVLink work:
//! - dispatch and combine backward (towards the experts): the node group's
//!   op starts at once and each of its warps waits (bounded) for the chunk
//!   of the row it takes, which the hop stream flags once the chunk has
//!   landed (a stream-ordered memset, after the chunk's receive);
//! - combine and dispatch backward (home): the node group's combine counts
//!   the vectors it has written of each chunk of its rows, and each round
//!   of the hop waits on the hop stream (`moe_ep_two_level_wait_chunks`,
//!   one block, bounded) until its chunks are complete, then sends them.
//!   So that every rank's blocks stay resident together where ranks share
//!   a GPU, `num_sms` leaves room for that one block per rank.
//!
//! A world of several nodes runs on this type;
//! [`ExpertParallel`](super::ExpertParallel) gives it and [`EpGroup`](crate::EpGroup) one
//! set of ops, and the C ABI's `moe_ep_group_create` makes either from the
//! config (src/capi.rs).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use half::bf16;

use super::abi::{ChunkWaitParams, TwoLevelParams, MAX_NODES};
use super::buffers::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, Dispatched, RecvBuf, TopkIdx,
    ROW_ALIGN,
};
use super::combine::Progress;
use super::dispatch::Arrival;
use super::group::{GroupConfig, Mode, NodeGroup};
use super::handle::{NodeHandle, OpStreams};
use super::hop_plan::hop_rows;
use super::layout::tokens_of_routing;
use super::rail_hop::{HopRecv, HopSend, RailHop};
use crate::error::{Error, Result};
use crate::runtime::{nvtx, Communicator, Function, Module};
use crate::symm::SymmBuffer;
use crate::types::RecvLayout;
use crate::types::Topology;

/// The kernels of `two_level.cu`.
struct Kernels {
    streams_i32: Function,
    streams_i64: Function,
    pack_ids_i32: Function,
    pack_ids_i64: Function,
    pack_rows: Function,
    node_sum: Function,
    gather_w: Function,
    remap_src: Function,
    wait_chunks: Function,
}

impl Kernels {
    fn load(comm: &Communicator) -> Result<Kernels> {
        let m = Module::get(comm.context(), "two_level")?;
        Ok(Kernels {
            streams_i32: m.function("moe_ep_two_level_streams_i32")?,
            streams_i64: m.function("moe_ep_two_level_streams_i64")?,
            pack_ids_i32: m.function("moe_ep_two_level_pack_ids_i32")?,
            pack_ids_i64: m.function("moe_ep_two_level_pack_ids_i64")?,
            pack_rows: m.function("moe_ep_two_level_pack_rows")?,
            node_sum: m.function("moe_ep_two_level_node_sum")?,
            gather_w: m.function("moe_ep_two_level_gather_w")?,
            remap_src: m.function("moe_ep_two_level_remap_src")?,
            wait_chunks: m.function("moe_ep_two_level_wait_chunks")?,
        })
    }
}

/// Threads of the node-streams blocks (`kStreamThreads` in two_level.cu).
const STREAM_THREADS: u32 = 1024;
/// Threads of every other two-level kernel.
const THREADS: u32 = 256;

/// Rows per chunk of the network hop unless
/// [`TwoLevelPath::with_hop_chunk_rows`] says otherwise. 512 rows of hidden
/// 7168 are 7.3 MB of bf16 per chunk and rail peer, 147 µs at a 400 Gb/s
/// NIC's line rate, against a fixed cost per round of the hop: on one H200
/// at 2 virtual nodes x 2 ranks, 4096 tokens (2026-12-02, BENCHMARKS.md),
/// 17-23 µs per round (host rounds of the virtual hop; dispatch 1483 µs in
/// chunks of 128 rows, 921 in chunks of 512, 797 in one chunk).
pub const DEFAULT_HOP_CHUNK_ROWS: usize = 512;

/// A grid of `THREADS`-thread blocks for `items` items of `per_block` each.
fn grid(items: usize, per_block: usize) -> u32 {
    items.div_ceil(per_block).clamp(1, 4096) as u32
}

/// An expert-parallel group over a world of several nodes: the node's own
/// [`EpGroup`](crate::EpGroup) (over [`Communicator::split`]) forwards inside the node, a
/// [`RailHop`] crosses between nodes. Creating it is collective (over the
/// world); so is every op.
///
/// Unlike the one-node path, the layout waits on the host (the stream
/// lengths go to every rank before the hop can be sized), so it cannot be
/// captured in a CUDA graph; dispatch, combine and the backward passes do
/// not wait on the host (on a virtual world the hop takes two host rounds
/// of the ranks' threads). The caller's buffers are used on `stream` as
/// they are: unlike [`EpGroup`](crate::EpGroup)'s ops, these do not order themselves after
/// a buffer's own stream. As on [`EpGroup`](crate::EpGroup), the ops of one group are taken
/// one at a time (threads calling one group are serialised).
pub(crate) struct TwoLevelPath {
    comm: Arc<Communicator>,
    cfg: GroupConfig,
    topology: Topology,
    node: NodeGroup,
    hop: RailHop,
    k: Kernels,
    /// This group's number in the process (handles remember it).
    id: u64,
    /// Rows per chunk of the hop.
    chunk_rows: usize,
    /// The hop, chunk by chunk (the op stream's node op runs beside it).
    hop_stream: Arc<CudaStream>,
    /// One arrival flag per chunk a dispatch (or combine backward) can
    /// receive (its remote segments in node order, each in chunks): the
    /// call's epoch once the chunk has landed.
    arrive: CudaSlice<u64>,
    /// The last epoch of the arrival flags (dispatch, combine backward).
    epoch: std::sync::atomic::AtomicU64,
    /// One counter per chunk a combine sends (its remote segments in node
    /// order, each in chunks, as `arrive`): the vectors of the chunk's rows
    /// the node combine has written (`Progress`), zeroed per call.
    done: CudaSlice<u64>,
    /// One op at a time: an op's hop rounds are collective steps that the
    /// ranks pair in order, and its chunks share the hop stream and flags.
    turn: std::sync::Mutex<()>,
}

/// Where one rank's rows lie on the two-level path: its forward batch (the
/// node segments in node order, its own at `fwd_off[node]`) and its send
/// range (its streams to the remote nodes in node order).
struct Plan {
    /// `row_off[m]`: the first row of node `m`'s rows (the kernels' view).
    row_off: [i32; MAX_NODES],
    /// Rows of this rank's stream to each remote node (0 at its own node).
    send_rows: Vec<usize>,
    /// Rows the rail peer on each remote node sends here (0 at its own node).
    recv_rows: Vec<usize>,
    /// First row of each node's segment of the forward batch.
    fwd_off: Vec<usize>,
    /// First row of each remote node's stream in the send range.
    send_off: Vec<usize>,
    /// Rows of the forward batch and of the send range.
    fwd_rows: usize,
    sent_rows: usize,
}

/// Rows of chunk `c` of a stream or segment of `len` rows, in chunks of
/// `rows`: empty where the stream is shorter. The hop's pieces and the
/// arrival flags' rows both come from here.
fn chunk_range(len: usize, c: usize, rows: usize) -> std::ops::Range<usize> {
    let lo = c.saturating_mul(rows).min(len);
    lo..(lo + rows).min(len)
}

/// The hop in chunks of the group's `chunk_rows` rows: round `c` moves
/// chunk `c` of every stream and segment ([`chunk_range`]), in either
/// direction.
struct Chunks {
    /// Rounds: the longest stream between any two rail peers, in chunks
    /// (the same on every rank: every rank makes each round's exchange).
    rounds: usize,
    /// First arrival flag of each node's segment here (remote nodes; its
    /// chunk `c` is flag `first[m] + c`).
    first: Vec<usize>,
    /// `[fwd_rows]` each forward row's chunk (its arrival flag and its
    /// combine progress counter; -1: this rank's own rows), then `[flags]`
    /// each chunk's rail peer.
    table: CudaSlice<i32>,
}

impl Chunks {
    /// The chunks of `plan` for `rank`, from every rank's stream lengths
    /// (as [`Plan::new`]); the table on the host.
    fn plan(
        topology: &Topology,
        rank: usize,
        lens: &[usize],
        plan: &Plan,
        rows: usize,
    ) -> (usize, Vec<usize>, Vec<i32>) {
        let n = topology.nodes();
        let longest = (0..topology.world())
            .flat_map(|r| {
                (0..n)
                    .filter(move |&m| m != topology.node_of(r))
                    .map(move |m| lens[r * n + m])
            })
            .max()
            .unwrap_or(0);
        let me = topology.node_of(rank);
        let mut table = vec![-1i32; plan.fwd_rows];
        let (mut first, mut peers) = (vec![0usize; n], Vec::new());
        for m in (0..n).filter(|&m| m != me) {
            first[m] = peers.len();
            let peer = topology.rail_peer(rank, m) as i32;
            for c in 0..plan.recv_rows[m].div_ceil(rows) {
                for q in chunk_range(plan.recv_rows[m], c, rows) {
                    table[plan.fwd_off[m] + q] = peers.len() as i32;
                }
                peers.push(peer);
            }
        }
        table.extend(peers);
        (longest.div_ceil(rows), first, table)
    }
}

impl Plan {
    /// Rank `rank`'s plan from every rank's stream lengths (`lens[r * N +
    /// m]`: rank `r`'s rows to node `m`, its own node's entry its own
    /// segment); errors as [`hop_rows`].
    fn new(topology: &Topology, rank: usize, lens: &[usize]) -> Result<Plan> {
        let (send_rows, recv_rows) = hop_rows(topology, rank, lens)?;
        let (n, me) = (topology.nodes(), topology.node_of(rank));
        let own_len = lens[rank * n + me];
        let (mut fwd_off, mut send_off) = (vec![0; n], vec![0; n]);
        let (mut fwd_rows, mut sent_rows) = (0, 0);
        let mut row_off = [0i32; MAX_NODES];
        for m in 0..n {
            fwd_off[m] = fwd_rows;
            fwd_rows += if m == me { own_len } else { recv_rows[m] };
            send_off[m] = sent_rows;
            sent_rows += send_rows[m];
            row_off[m] = if m == me { fwd_off[m] } else { send_off[m] } as i32;
        }
        Ok(Plan {
            row_off,
            send_rows,
            recv_rows,
            fwd_off,
            send_off,
            fwd_rows,
            sent_rows,
        })
    }
}

/// The routing of one batch on the two-level path ([`TwoLevelPath::layout`]).
pub(crate) struct TwoLevelHandle {
    node: NodeHandle,
    num_tokens: usize,
    topk: usize,
    /// `[T][N]` each token's row in its stream to each node, -1 if not reached.
    pos: CudaSlice<i32>,
    plan: Plan,
    /// `[fwd_rows][K]` and `[sent_rows][K]` node-local ids.
    own_ids: CudaSlice<i32>,
    net_ids: CudaSlice<i32>,
    /// `[N * max_tokens][2]` (home rank, token) of every forward-batch row,
    /// in the node group's pool (read by the node's receivers).
    origin: SymmBuffer<i32>,
    /// Rows the node group's dispatch delivers here.
    received: usize,
    /// The hop in chunks (every op).
    chunks: Chunks,
    group: u64,
}

impl TwoLevelHandle {
    /// The node group's handle of the forward batch: its counts are this
    /// rank's receive counts (`host_counts().recv_rows`,
    /// `tokens_per_local_expert`); its rank and expert counts are the node's.
    pub fn node_handle(&self) -> &NodeHandle {
        &self.node
    }
    /// This rank's tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// The top-k of the routing the layout was given.
    pub fn topk(&self) -> usize {
        self.topk
    }
    /// Rows dispatch delivers here (expert-major: padded).
    pub fn recv_rows(&self) -> usize {
        self.received
    }
    /// Network rows this rank sends per remote node in dispatch (and
    /// receives back in combine), by node; 0 at its own node.
    pub fn network_rows_sent(&self) -> &[usize] {
        &self.plan.send_rows
    }
    /// Network rows this rank receives per remote node in dispatch.
    pub fn network_rows_received(&self) -> &[usize] {
        &self.plan.recv_rows
    }
}

static NEXT_GROUP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl TwoLevelPath {
    /// Creates the path (collective over the world `comm`): `cfg` as for
    /// [`EpGroup::new`](crate::EpGroup::new), with `ranks_per_node` making at least two nodes;
    /// high-throughput mode only; every op's network hop in chunks of
    /// `cfg.hop_chunk_rows` rows.
    ///
    /// Errors, by field: [`GroupConfig::validate`]'s; a field that differs
    /// between ranks (every rank fails, naming the field). Where the ranks
    /// share one GPU (a virtual world), `num_sms` must leave one block per
    /// rank for combine's hop: at most [`residency`](super::residency)'s
    /// `max_blocks_per_rank() - 1`; an error names `num_sms` otherwise.
    pub(crate) fn new(comm: &Arc<Communicator>, cfg: GroupConfig) -> Result<TwoLevelPath> {
        let world = comm.world();
        let hop_chunk_rows = cfg.hop_chunk_rows;
        let topology = Self::validate(&cfg, world)?;
        let nodes = topology.nodes();
        let ctx = comm.context().clone();
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        // Every rank's shared fields (the node groups compare the rest).
        let mine = [
            cfg.num_experts as u64,
            cfg.hidden as u64,
            cfg.max_tokens_per_rank as u64,
            topology.ranks_per_node() as u64,
            hop_chunk_rows as u64,
        ];
        let all = comm.all_gather_host(&stream, &mine)?;
        let names = [
            "num_experts",
            "hidden",
            "max_tokens_per_rank",
            "ranks_per_node",
            "hop_chunk_rows",
        ];
        for (r, theirs) in all.chunks(mine.len()).enumerate() {
            if let Some(f) = (0..mine.len()).find(|&f| theirs[f] != mine[f]) {
                return Err(Error::arg(
                    names[f],
                    format!(
                        "the same value on every rank (rank {} has {})",
                        comm.rank(),
                        mine[f]
                    ),
                    format!("rank {r} has {}", theirs[f]),
                ));
            }
        }
        let mut node_cfg = cfg.clone();
        node_cfg.num_experts = cfg.num_experts / nodes;
        node_cfg.max_tokens_per_rank = forward_tokens(&cfg, nodes)?;
        node_cfg.ranks_per_node = 0;
        if node_cfg.recv_capacity == 0 {
            node_cfg.recv_capacity = world * cfg.max_tokens_per_rank;
        }
        // Where ranks share a GPU, every block of every rank must be
        // resident at once (`residency`); combine's hop adds one block per
        // rank beside the node combine (moe_ep_two_level_wait_chunks).
        let r = super::residency::residency(comm, node_cfg.num_experts)?;
        if r.ranks_per_gpu > 1 && node_cfg.num_sms + 1 > r.max_blocks_per_rank() {
            return Err(Error::arg(
                "num_sms",
                format!(
                    "at most {} blocks per rank on a two-level world whose {} ranks share one GPU \
                     (every rank's blocks must be resident together, {} per rank in all, and \
                     combine's network hop waits with one block per rank beside the node combine's)",
                    r.max_blocks_per_rank().saturating_sub(1),
                    r.ranks_per_gpu,
                    r.max_blocks_per_rank()
                ),
                node_cfg.num_sms,
            ));
        }
        let hop = RailHop::new(comm, topology)?;
        // Allocated before the node group, whose creation ends in a barrier
        // (after it, a sibling's kernels may wait for this rank).
        let hop_stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        let flags = (nodes - 1) * cfg.max_tokens_per_rank.div_ceil(hop_chunk_rows);
        // On the hop stream, which every dispatch leaves ordered after its
        // node dispatch (the flags' last reader): freed after them.
        let arrive = hop_stream
            .alloc_zeros::<u64>(flags.max(1))
            .map_err(Error::cuda("cuMemAlloc"))?;
        let done = hop_stream
            .alloc_zeros::<u64>(flags.max(1))
            .map_err(Error::cuda("cuMemAlloc"))?;
        let k = Kernels::load(comm)?;
        hop_stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let node_comm = comm.split(&stream, comm.rank() / topology.ranks_per_node())?;
        let node = NodeGroup::new(&node_comm, node_cfg)?;
        Ok(TwoLevelPath {
            comm: comm.clone(),
            cfg,
            topology,
            node,
            hop,
            k,
            id: NEXT_GROUP.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            chunk_rows: hop_chunk_rows,
            hop_stream,
            arrive,
            epoch: std::sync::atomic::AtomicU64::new(0),
            done,
            turn: std::sync::Mutex::new(()),
        })
    }

    /// Checks `cfg` for a world of `world` ranks without a GPU, naming the
    /// bad field: every check of [`TwoLevelPath::new`] that needs no peer
    /// (those of [`GroupConfig::validate`] but the one-node rule, at least
    /// two and at most [`MAX_NODES`] nodes, high-throughput mode, the forward
    /// batch's size). Returns the world's nodes.
    pub fn validate(cfg: &GroupConfig, world: usize) -> Result<Topology> {
        let topology = nodes_of(cfg, world)?;
        let rows = cfg.hop_chunk_rows;
        if rows == 0 {
            return Err(Error::arg("hop_chunk_rows", "at least 1 row", 0));
        }
        // A chunk's progress count (CombineParams::done) is 32-bit per warp.
        if rows.saturating_mul(cfg.hidden / 8) > 1 << 30 {
            return Err(Error::arg(
                "hop_chunk_rows",
                format!(
                    "at most 2^30 16-byte vectors per chunk ({} rows at hidden {})",
                    (1usize << 30) / (cfg.hidden / 8).max(1),
                    cfg.hidden
                ),
                rows,
            ));
        }
        forward_tokens(cfg, topology.nodes())?;
        Ok(topology)
    }

    /// The world's configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.cfg
    }
    /// The nodes of the world.
    pub fn topology(&self) -> Topology {
        self.topology
    }
    /// The node's group: its pool holds caller-supplied receive buffers
    /// (zero copy) and symmetric expert outputs; its `recv_capacity` is
    /// this group's.
    pub fn node_group(&self) -> &NodeGroup {
        &self.node
    }
    /// Rows every rank's receive buffers hold.
    pub fn recv_capacity(&self) -> usize {
        self.node.recv_capacity()
    }
    /// The world communicator.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// The parameters every kernel of an op on `h` starts from.
    fn params(&self, h: &TwoLevelHandle) -> TwoLevelParams {
        TwoLevelParams {
            pos: dptr(&h.pos),
            own_ids: dptr(&h.own_ids),
            net_ids: dptr(&h.net_ids),
            row_off: h.plan.row_off,
            num_tokens: h.num_tokens as i32,
            topk: h.topk as i32,
            hidden: self.cfg.hidden as i32,
            num_experts: self.cfg.num_experts as i32,
            nodes: self.topology.nodes() as i32,
            node: self.topology.node_of(self.comm.rank()) as i32,
            home_rank: self.comm.rank() as i32,
            ..Default::default()
        }
    }

    /// Refuses a handle of another group.
    fn check_handle(&self, h: &TwoLevelHandle) -> Result<()> {
        if h.group != self.id {
            return Err(Error::arg(
                "handle",
                "a handle made by this group's layout",
                "a handle of another group",
            ));
        }
        Ok(())
    }

    /// The network hop of `row_bytes`-byte rows: forward (dispatch's way)
    /// from this rank's send range `net` into its rail peers' forward
    /// batches, or back (combine's way) from its forward batch `own` into
    /// the homes' landing ranges `net`.
    fn hop(
        &self,
        stream: &Arc<CudaStream>,
        h: &Plan,
        (own, net, row_bytes): (u64, u64, usize),
        forward: bool,
        chunk: Option<usize>,
    ) -> Result<()> {
        let (rank, me) = (self.comm.rank(), self.topology.node_of(self.comm.rank()));
        // The rows of a stream or segment of `len` rows: all of them, or
        // chunk c's.
        let piece = |len: usize| match chunk {
            None => 0..len,
            Some(c) => chunk_range(len, c, self.chunk_rows),
        };
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        for m in (0..self.topology.nodes()).filter(|&m| m != me) {
            let peer = self.topology.rail_peer(rank, m);
            // This rank's stream to node m in `net`, node m's segment of
            // the forward batch in `own`: dispatch's way out of the first
            // into the second, combine's the other way.
            let (s, f) = (piece(h.send_rows[m]), piece(h.recv_rows[m]));
            let stream_at = (
                net + ((h.send_off[m] + s.start) * row_bytes) as u64,
                s.len() * row_bytes,
            );
            let segment_at = (
                own + ((h.fwd_off[m] + f.start) * row_bytes) as u64,
                f.len() * row_bytes,
            );
            let ((src, out), (dst, inn)) = match forward {
                true => (stream_at, segment_at),
                false => (segment_at, stream_at),
            };
            sends.push(HopSend {
                peer,
                src,
                bytes: out,
            });
            recvs.push(HopRecv {
                peer,
                dst,
                bytes: inn,
            });
        }
        // SAFETY: every range lies in the handle's or the op's buffers,
        // sized by the handle's row counts (send range `sent_rows`, forward
        // batch `fwd_rows` rows of `row_bytes`), which the ranks agreed on
        // in the layout; they outlive the work enqueued on `stream` (freed
        // in stream order); the ranges of one call do not overlap.
        unsafe { self.hop.exchange(stream, &sends, &recvs) }
    }

    /// The rows' sources of a node dispatch, (forwarding node rank, forward
    /// row), mapped to (home rank, home token) from the forwarders' origins,
    /// into a fresh buffer of the node pool (collective: the same size on
    /// every rank of the node).
    fn remap_src(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        src_in: SymmBuffer<i32>,
    ) -> Result<SymmBuffer<i32>> {
        let out: SymmBuffer<i32> = self.node.pool().alloc(src_in.len())?;
        out.used_on(stream)?;
        let node_world = self.node.comm().world();
        let mut p = self.params(handle);
        p.recv_src = out.device_ptr();
        p.src_in = src_in.device_ptr();
        let rows = handle.received.min(src_in.len() / 2);
        p.recv_rows = rows as i32;
        p.node_world = node_world as i32;
        p.origin_rows = (handle.origin.len() / 2) as i32;
        for (j, peer) in p.origin_peers.iter_mut().enumerate().take(node_world) {
            *peer = handle.origin.peer_ptr(j).ok_or_else(|| {
                Error::InvalidState(format!(
                    "the forward batch origins of node rank {j} are not reachable"
                ))
            })?;
        }
        // SAFETY: p mirrors TwoLevelParams; src_in and out hold recv_rows
        // rows of 2 (both the node pool's recv_capacity x 2), each
        // forwarder's origin buffer origin_rows rows; the kernel reads an
        // origin only at a node rank and row inside those bounds.
        unsafe {
            self.k
                .remap_src
                .launch(stream, grid(rows, THREADS as usize), THREADS, 0, &p)?
        };
        // src_in is released in stream order, after the kernel that read it.
        drop(src_in);
        Ok(out)
    }

    /// Computes the two-level routing (collective over the world, and waits
    /// on the host): the node streams, their lengths on every rank, the
    /// forward batch's ids and origins at the rail peers, and the node
    /// group's layout of it. `topk_idx` is `[T, topk]`, `T <=
    /// max_tokens_per_rank`; a bad expert id (outside `-1..E`, or twice in
    /// a token) on any rank fails every rank here with
    /// [`Error::InvalidDeviceData`] naming `topk_idx`, the rank, the token
    /// and the slot.
    pub fn layout(
        &self,
        stream: &Arc<CudaStream>,
        topk_idx: TopkIdx<'_>,
        topk: usize,
        layout: RecvLayout,
    ) -> Result<TwoLevelHandle> {
        let _range = nvtx::range("moe_ep::two_level::layout");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        // The caller's buffers ordered with this op's stream (their own
        // streams wait for it when it ends).
        let mut order = OpStreams::start(stream);
        let (idx_ptr, idx_len) = topk_idx.ptr_len();
        let t = tokens_of_routing(topk, idx_len, &self.cfg)?;
        let elem = match topk_idx {
            TopkIdx::I32(b) => {
                self.node
                    .check_region_in(&mut order, "topk_idx", b, t * topk, "[T, K] i32", 4)?;
                4
            }
            TopkIdx::I64(b) => {
                self.node
                    .check_region_in(&mut order, "topk_idx", b, t * topk, "[T, K] i64", 8)?;
                8
            }
        };
        // The node group's layout refuses what its kernels cannot take: here,
        // before any collective step.
        layout.check_for_kernels()?;
        let (rank, n) = (self.comm.rank(), self.topology.nodes());
        let me = self.topology.node_of(rank);
        self.comm
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let pos = alloc::<i32>(stream, t * n)?;
        let lens = alloc::<i32>(stream, n + 1)?;
        let mut p = TwoLevelParams {
            topk_idx: idx_ptr,
            pos: dptr(&pos),
            lens: dptr(&lens),
            num_tokens: t as i32,
            topk: topk as i32,
            num_experts: self.cfg.num_experts as i32,
            nodes: n as i32,
            node: me as i32,
            home_rank: rank as i32,
            ..Default::default()
        };
        let (streams, pack_ids) = match topk_idx {
            TopkIdx::I32(_) => (&self.k.streams_i32, &self.k.pack_ids_i32),
            TopkIdx::I64(_) => (&self.k.streams_i64, &self.k.pack_ids_i64),
        };
        // SAFETY: p mirrors TwoLevelParams; topk_idx holds [T, K] (checked),
        // pos [T, N] and lens [N + 1] were allocated above.
        unsafe { streams.launch(stream, n as u32, STREAM_THREADS, 0, &p)? };
        // Drained before the pageable copy (see `NodeHandle::host_counts`).
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let host_lens = stream
            .clone_dtoh(&lens)
            .map_err(Error::cuda("cuMemcpyDtoH"))?;
        // Every rank's lengths and verdict (the all-gather waits for the
        // kernel on every rank).
        let all = self.comm.all_gather_host(stream, &host_lens)?;
        for (r, theirs) in all.chunks(n + 1).enumerate() {
            if theirs[n] != 0 {
                return Err(self.bad_entry(stream, r, theirs[n] - 1, topk, idx_ptr, elem));
            }
        }
        let lens_all: Vec<usize> = all
            .chunks(n + 1)
            .flat_map(|c| c[..n].iter().map(|&v| v as usize))
            .collect();
        let plan = Plan::new(&self.topology, rank, &lens_all)?;
        let (fwd_rows, sent_rows, row_off) = (plan.fwd_rows, plan.sent_rows, plan.row_off);
        let own_ids = alloc::<i32>(stream, fwd_rows * topk)?;
        let net_ids = alloc::<i32>(stream, sent_rows * topk)?;
        let net_origin = alloc::<i32>(stream, sent_rows * 2)?;
        // Collective: the same size on every rank of the node.
        let origin: SymmBuffer<i32> = self
            .node
            .pool()
            .alloc(n * self.cfg.max_tokens_per_rank * 2)?;
        origin.used_on(stream)?;
        p.row_off = row_off;
        p.own_ids = dptr(&own_ids);
        p.net_ids = dptr(&net_ids);
        p.own_origin = origin.device_ptr();
        p.net_origin = dptr(&net_origin);
        // SAFETY: as above; the rows written are those of the streams, inside
        // the forward batch (fwd_rows) and the send range (sent_rows).
        unsafe { pack_ids.launch(stream, grid(t, THREADS as usize), THREADS, 0, &p)? };
        self.hop(
            stream,
            &plan,
            (dptr(&own_ids), dptr(&net_ids), 4 * topk),
            true,
            None,
        )?;
        self.hop(
            stream,
            &plan,
            (origin.device_ptr(), dptr(&net_origin), 8),
            true,
            None,
        )?;
        let ids = own_ids.slice(0..fwd_rows * topk);
        let node = self.node.layout(stream, TopkIdx::I32(&ids), topk, layout)?;
        let received = node.host_counts(stream)?.recv_rows;
        let (rounds, first, table) =
            Chunks::plan(&self.topology, rank, &lens_all, &plan, self.chunk_rows);
        let flags = table.len() - plan.fwd_rows;
        if flags > self.arrive.len() {
            return Err(Error::InvalidState(format!(
                "rank {rank}: {flags} chunks of the hop, more than the {} arrival flags",
                self.arrive.len()
            )));
        }
        let mut table = table;
        table.push(-1); // never empty
        let table = stream
            .clone_htod(&table)
            .map_err(Error::cuda("cuMemcpyHtoD"))?;
        let chunks = Chunks {
            rounds,
            first,
            table,
        };
        Ok(TwoLevelHandle {
            node,
            num_tokens: t,
            topk,
            pos,
            plan,
            own_ids,
            net_ids,
            origin,
            received,
            chunks,
            group: self.id,
        })
    }

    /// Sends every token to the ranks of its experts: over the network to
    /// its rail peers, then inside each node (the node group's dispatch).
    /// `x` is `[T, H]` bf16, `topk_weights` `[T, K]` f32; `out` as for
    /// [`EpGroup::dispatch`](crate::EpGroup::dispatch) (buffers of the node group's pool). The rows
    /// are the flat dispatch's, grouped by forwarding rank, then home node,
    /// then token; `src` gives each row's (home rank, home token).
    pub fn dispatch<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
    ) -> Result<Dispatched<'a>> {
        let _range = nvtx::range("moe_ep::two_level::dispatch");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, k, h) = (handle.num_tokens, handle.topk, self.cfg.hidden);
        self.node
            .check_region_in(&mut order, "x", x, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
        self.node.check_region_in(
            &mut order,
            "topk_weights",
            topk_weights,
            t * k,
            "[T, K] f32",
            4,
        )?;
        let plan = &handle.plan;
        let fwd_x = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        let fwd_w = alloc::<f32>(stream, plan.fwd_rows * k)?;
        let net_x = alloc::<bf16>(stream, plan.sent_rows * h)?;
        let net_w = alloc::<f32>(stream, plan.sent_rows * k)?;
        self.pack_rows(
            stream,
            handle,
            (x.device_ptr(), topk_weights.device_ptr()),
            &fwd_x,
            &net_x,
            Some((&fwd_w, &net_w)),
        )?;
        // The hop in rounds on the hop stream; the node dispatch, enqueued
        // after them on `stream`, waits for each row's chunk.
        let arrival = self.hop_forward_in_chunks(
            stream,
            handle,
            &[
                (dptr(&fwd_x), dptr(&net_x), 2 * h),
                (dptr(&fwd_w), dptr(&net_w), 4 * k),
            ],
        )?;
        let (xs, ws) = (
            fwd_x.slice(0..plan.fwd_rows * h),
            fwd_w.slice(0..plan.fwd_rows * k),
        );
        let got = self
            .node
            .dispatch_arriving(stream, &handle.node, &xs, &ws, out, Some(&arrival));
        self.rejoin(stream)?;
        let mut got = got?;
        got.src = self.remap_src(stream, handle, got.src)?;
        Ok(got)
    }

    /// Brings expert outputs home and sums them per token in a fixed order:
    /// inside each node as the node group's combine (ascending rank), then,
    /// at home, over the nodes ascending (f32 from 0, one bf16 term per
    /// node, one rounding); the same bits on every run. Arguments as for
    /// [`EpGroup::combine`](crate::EpGroup::combine), in this handle's receive layout.
    pub fn combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        let _range = nvtx::range("moe_ep::two_level::combine");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, h) = (handle.num_tokens, self.cfg.hidden);
        self.node.check_region_in(
            &mut order,
            "out",
            &*out,
            t * h,
            "[T, hidden] bf16",
            ROW_ALIGN,
        )?;
        let plan = &handle.plan;
        let mut fwd = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        let net = alloc::<bf16>(stream, plan.sent_rows * h)?;
        let (own, home) = (dptr(&fwd), dptr(&net));
        self.hop_home_in_chunks(stream, handle, own, home, |progress| {
            let mut view = fwd.slice_mut(0..plan.fwd_rows * h);
            self.node.combine_counting(
                stream,
                &handle.node,
                expert_out,
                weights,
                &mut view,
                Some(progress),
            )
        })?;
        let summed = self.node_sum(stream, handle, &fwd, &net, out.device_ptr());
        self.rejoin(stream)?;
        summed
    }

    /// Backward of dispatch: the gradient of the received tokens combined
    /// home (unweighted, in combine's order), and the gradient of the
    /// received weights routed back to `[T, K]` (`grad_topk_weights`, when
    /// given). Arguments as for [`EpGroup::dispatch_backward`](crate::EpGroup::dispatch_backward).
    pub fn dispatch_backward(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        args: DispatchBackwardArgs<'_>,
    ) -> Result<()> {
        let DispatchBackwardArgs {
            grad_recv_tokens,
            grad_recv_topk_weights,
            grad_tokens,
            grad_topk_weights,
        } = args;
        let _range = nvtx::range("moe_ep::two_level::dispatch_backward");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, k, h) = (handle.num_tokens, handle.topk, self.cfg.hidden);
        self.node.check_region_in(
            &mut order,
            "grad_tokens",
            &*grad_tokens,
            t * h,
            "[T, hidden] bf16",
            ROW_ALIGN,
        )?;
        if let Some(g) = grad_topk_weights.as_deref() {
            self.node.check_region_in(
                &mut order,
                "grad_topk_weights",
                g,
                t * k,
                "[T, K] f32",
                4,
            )?;
        }
        let plan = &handle.plan;
        let mut fwd = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        // The weight gradients' rows only when they are asked for.
        let mut fwd_w = match grad_topk_weights {
            Some(_) => Some(alloc::<f32>(stream, plan.fwd_rows * k)?),
            None => None,
        };
        let net = alloc::<bf16>(stream, plan.sent_rows * h)?;
        let (own, home) = (dptr(&fwd), dptr(&net));
        self.hop_home_in_chunks(stream, handle, own, home, |progress| {
            let mut view = fwd.slice_mut(0..plan.fwd_rows * h);
            let mut view_w = fwd_w.as_mut().map(|w| w.slice_mut(0..plan.fwd_rows * k));
            let gw = view_w.as_mut().map(|v| v as &mut dyn DeviceRegionMut<f32>);
            let args = DispatchBackwardArgs {
                grad_recv_tokens,
                grad_recv_topk_weights,
                grad_tokens: &mut view,
                grad_topk_weights: gw,
            };
            self.node
                .dispatch_backward_counting(stream, &handle.node, args, Some(progress))
        })?;
        let summed = self.node_sum(stream, handle, &fwd, &net, grad_tokens.device_ptr());
        self.rejoin(stream)?;
        summed?;
        if let (Some(g), Some(fwd_w)) = (grad_topk_weights, fwd_w) {
            let net_w = alloc::<f32>(stream, plan.sent_rows * k)?;
            self.hop(
                stream,
                plan,
                (dptr(&fwd_w), dptr(&net_w), 4 * k),
                false,
                None,
            )?;
            let mut p = self.params(handle);
            p.own_w = dptr(&fwd_w);
            p.net_w = dptr(&net_w);
            p.out_w = g.device_ptr();
            // SAFETY: p mirrors TwoLevelParams; out_w holds [T, K] (checked),
            // the weight rows every row the handle's streams name.
            unsafe {
                self.k
                    .gather_w
                    .launch(stream, grid(t * k, THREADS as usize), THREADS, 0, &p)?
            };
        }
        Ok(())
    }

    /// Backward of combine: the gradient of the output `[T, H]` sent to
    /// every row of the token (over the network to the rail peers, then the
    /// node group's combine backward); with `weights` (expert-major, as
    /// given to combine) each row is scaled by its weight. Arguments as for
    /// [`EpGroup::combine_backward`](crate::EpGroup::combine_backward).
    pub fn combine_backward<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
    ) -> Result<RecvBuf<'a, bf16>> {
        let _range = nvtx::range("moe_ep::two_level::combine_backward");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, h) = (handle.num_tokens, self.cfg.hidden);
        self.node.check_region_in(
            &mut order,
            "grad_out",
            grad_out,
            t * h,
            "[T, hidden] bf16",
            ROW_ALIGN,
        )?;
        let plan = &handle.plan;
        let fwd = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        let net = alloc::<bf16>(stream, plan.sent_rows * h)?;
        self.pack_rows(stream, handle, (grad_out.device_ptr(), 0), &fwd, &net, None)?;
        let arrival =
            self.hop_forward_in_chunks(stream, handle, &[(dptr(&fwd), dptr(&net), 2 * h)])?;
        let view = fwd.slice(0..plan.fwd_rows * h);
        let got = self.node.combine_backward_arriving(
            stream,
            &handle.node,
            &view,
            weights,
            grad_expert_out,
            Some(&arrival),
        );
        self.rejoin(stream)?;
        got
    }

    /// The network hop in dispatch's direction in rounds on the hop stream
    /// (round `c`: chunk `c` of every stream, for each of `pieces`, each a
    /// forward batch, the send range and the bytes of a row), each round's
    /// landed chunks flagged with a new epoch there. Returns where the node
    /// op enqueued next on `stream` finds the flags; [`Self::rejoin`] after
    /// it.
    fn hop_forward_in_chunks(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        pieces: &[(u64, u64, usize)],
    ) -> Result<Arrival> {
        let (plan, ch) = (&handle.plan, &handle.chunks);
        let epoch = self
            .epoch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let hs = &self.hop_stream;
        hs.join(stream).map_err(Error::cuda("cuStreamWaitEvent"))?;
        let me = self.topology.node_of(self.comm.rank());
        let sent = (0..ch.rounds).try_for_each(|c| {
            for &(own, net, row_bytes) in pieces {
                self.hop(hs, plan, (own, net, row_bytes), true, Some(c))?;
            }
            for m in (0..self.topology.nodes()).filter(|&m| m != me) {
                if !chunk_range(plan.recv_rows[m], c, self.chunk_rows).is_empty() {
                    let flag = dptr(&self.arrive) + 8 * (ch.first[m] + c) as u64;
                    write_flag(hs, flag, epoch)?;
                }
            }
            Ok(())
        });
        if let Err(e) = sent {
            // Rounds already enqueued still use the buffers: they are freed
            // after them.
            stream.join(hs).map_err(Error::cuda("cuStreamWaitEvent"))?;
            return Err(e);
        }
        Ok(Arrival {
            flags: dptr(&self.arrive),
            row_chunk: dptr(&ch.table),
            chunk_peer: dptr(&ch.table) + 4 * plan.fwd_rows as u64,
            epoch: flag_value(epoch),
        })
    }

    /// The network hop in combine's direction, each chunk as soon as the
    /// node op has written it: `run` enqueues, on `stream`, the node op
    /// that writes the forward batch `own` and counts its rows into the
    /// progress it is given; round `c` of the hop, on the hop stream, waits
    /// (`moe_ep_two_level_wait_chunks`) until chunk `c` of every remote
    /// segment is complete, then sends it home into `home` (the landing
    /// range). `stream`'s later work comes after the hop; [`Self::rejoin`]
    /// after the op.
    fn hop_home_in_chunks(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        own: u64,
        home: u64,
        run: impl FnOnce(Progress) -> Result<()>,
    ) -> Result<()> {
        let (plan, ch) = (&handle.plan, &handle.chunks);
        let (hs, h) = (&self.hop_stream, self.cfg.hidden);
        let (done, words) = (dptr(&self.done), 2 * self.done.len());
        // The counters from 0, after every earlier use of them (the hop
        // stream's waits) and before this node op.
        hs.join(stream).map_err(Error::cuda("cuStreamWaitEvent"))?;
        memset_u32(hs, done, 0, words, "combine progress counters")?;
        stream.join(hs).map_err(Error::cuda("cuStreamWaitEvent"))?;
        run(Progress {
            done,
            done_of: dptr(&ch.table),
        })?;
        // Once the node op has ended, every counter past any chunk's need
        // (2^62 + 2^30 each; a need is at most 2^30), so that an op that
        // stopped early (its error is the node group's) holds no round of
        // the hop until the timeout.
        memset_u32(stream, done, 1 << 30, words, "combine progress counters")?;
        let op = self.node.op_common(&handle.node);
        let me = self.topology.node_of(self.comm.rank());
        let sent = (0..ch.rounds).try_for_each(|c| {
            let mut w = ChunkWaitParams {
                op,
                done,
                count: 0,
                _pad: 0,
                chunk: [0; MAX_NODES],
                peer: [0; MAX_NODES],
                need: [0; MAX_NODES],
            };
            for m in (0..self.topology.nodes()).filter(|&m| m != me) {
                let rows = chunk_range(plan.recv_rows[m], c, self.chunk_rows).len();
                if rows > 0 {
                    let i = w.count as usize;
                    w.chunk[i] = (ch.first[m] + c) as i32;
                    w.peer[i] = self.topology.rail_peer(self.comm.rank(), m) as i32;
                    w.need[i] = (rows * h / 8) as u64;
                    w.count += 1;
                }
            }
            if w.count > 0 {
                // SAFETY: w mirrors ChunkWaitParams; its chunks index `done`
                // (sized for every chunk a combine sends).
                unsafe { self.k.wait_chunks.launch(hs, 1, MAX_NODES as u32, 0, &w)? };
            }
            self.hop(hs, plan, (own, home, 2 * h), false, Some(c))
        });
        // The hop's rounds, whatever happened, before `stream`'s later work
        // (the home's sum, the buffers' release).
        stream.join(hs).map_err(Error::cuda("cuStreamWaitEvent"))?;
        sent
    }

    /// Orders the hop stream after `stream`'s work so far (the node op that
    /// read the arrival flags, the release of the op's buffers), and
    /// `stream` after the hop stream: the next op may take either.
    fn rejoin(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let hs = &self.hop_stream;
        stream.join(hs).map_err(Error::cuda("cuStreamWaitEvent"))?;
        hs.join(stream).map_err(Error::cuda("cuStreamWaitEvent"))
    }

    /// Copies each token's row of `x` (and, with `w`, its weights masked
    /// to the node) to its row for every node it reaches.
    fn pack_rows(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        (x, topk_w): (u64, u64),
        own_x: &CudaSlice<bf16>,
        net_x: &CudaSlice<bf16>,
        w: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
    ) -> Result<()> {
        let mut p = self.params(handle);
        p.x = x;
        p.own_x = dptr(own_x);
        p.net_x = dptr(net_x);
        if let Some((own_w, net_w)) = w {
            p.topk_w = topk_w;
            p.own_w = dptr(own_w);
            p.net_w = dptr(net_w);
        }
        // SAFETY: p mirrors TwoLevelParams; x holds [T, H] (and topk_w [T, K],
        // checked by the callers), the destinations every row the streams
        // name (fwd_rows, sent_rows).
        unsafe {
            self.k.pack_rows.launch(
                stream,
                grid(handle.num_tokens, (THREADS / 32) as usize),
                THREADS,
                0,
                &p,
            )
        }
    }

    /// The home's sum over nodes into `out` (`[T, H]`): `own` is this rank's
    /// node group's output for its forward batch, `net` what the rail peers
    /// sent back.
    fn node_sum(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        own: &CudaSlice<bf16>,
        net: &CudaSlice<bf16>,
        out: u64,
    ) -> Result<()> {
        let mut p = self.params(handle);
        p.own_x = dptr(own);
        p.net_x = dptr(net);
        p.out = out;
        // SAFETY: p mirrors TwoLevelParams; out holds [T, H] (checked by the
        // callers), own and net every row the streams name.
        unsafe {
            self.k.node_sum.launch(
                stream,
                grid(handle.num_tokens, (THREADS / 32) as usize),
                THREADS,
                0,
                &p,
            )
        }
    }

    /// The error of rank `r`'s first bad routing entry (`key` = 4 * (t * K
    /// + slot) + kind), as every rank reports it.
    fn bad_entry(
        &self,
        stream: &Arc<CudaStream>,
        r: usize,
        key: i32,
        topk: usize,
        idx_ptr: u64,
        elem: usize,
    ) -> Error {
        let (flat, kind) = ((key / 4) as usize, key % 4);
        let (t, s) = (flat / topk, flat % topk);
        let who = if r == self.comm.rank() {
            format!("rank {r} (this rank)")
        } else {
            format!("rank {r}")
        };
        // This rank's own value, for the message.
        let value = (r == self.comm.rank())
            .then(|| read_entry(stream, idx_ptr + (flat * elem) as u64, elem).ok())
            .flatten();
        let what = match (kind, value) {
            (1, Some(v)) => format!("expert id {v} not in [-1, {})", self.cfg.num_experts),
            (1, None) => format!("an expert id not in [-1, {})", self.cfg.num_experts),
            (_, Some(v)) => format!("expert {v} appears twice in the token's top-k"),
            (_, None) => "an expert that appears twice in the token's top-k".to_string(),
        };
        Error::InvalidDeviceData {
            arg: "topk_idx",
            detail: format!("{who}: token {t} slot {s}: {what}"),
        }
    }
}

/// A device address of a slice (no event bookkeeping: the two-level ops
/// enqueue everything on the stream the slice was allocated on).
/// The nodes of a two-level world: `cfg`'s fields good for `world`
/// ([`GroupConfig::validate_fields`]), at least two and at most
/// [`MAX_NODES`] nodes, high-throughput mode; errors name the field.
fn nodes_of(cfg: &GroupConfig, world: usize) -> Result<Topology> {
    let topology = cfg.validate_fields(world)?;
    let nodes = topology.nodes();
    if nodes < 2 {
        return Err(Error::arg(
            "ranks_per_node",
            format!("fewer than the world size {world} (one node runs on NodeGroup)"),
            cfg.ranks_per_node,
        ));
    }
    if nodes > MAX_NODES {
        return Err(Error::arg(
            "ranks_per_node",
            format!("at most {MAX_NODES} nodes"),
            format!("{} ({nodes} nodes)", cfg.ranks_per_node),
        ));
    }
    if cfg.mode != Mode::HighThroughput {
        return Err(Error::arg(
            "mode",
            "Mode::HighThroughput (the two-level path has no low-latency kernels)",
            format!("{:?}", cfg.mode),
        ));
    }
    Ok(topology)
}

/// The node group's tokens per rank: a forward batch holds a row per node
/// for each of `max_tokens_per_rank` tokens, at most 2^20 (the error names
/// `max_tokens_per_rank`).
fn forward_tokens(cfg: &GroupConfig, nodes: usize) -> Result<usize> {
    let t = cfg.max_tokens_per_rank * nodes;
    if t > (1 << 20) {
        return Err(Error::arg(
            "max_tokens_per_rank",
            format!("at most 2^20 / {nodes} nodes (a forward batch holds a row per node)"),
            cfg.max_tokens_per_rank,
        ));
    }
    Ok(t)
}

fn dptr<T>(s: &CudaSlice<T>) -> u64 {
    DeviceRegion::device_ptr(s)
}

/// `len` elements (at least one) of stream-ordered device memory, not zeroed:
/// every buffer of the two-level ops is written (by a kernel or the hop) in
/// every element that is read.
fn alloc<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    // SAFETY: see above; the slice is freed in stream order.
    unsafe { stream.alloc::<T>(len.max(1)) }.map_err(Error::cuda("cuMemAlloc"))
}

/// Sets the arrival flag at `addr` (a u64) to `epoch` in `stream`'s order,
/// after the work enqueued before it: both 32-bit halves to `epoch` (a
/// stream-ordered memset, which takes any device memory, where
/// `cuStreamWriteValue64` refused the pool's: CUDA_ERROR_INVALID_VALUE on
/// an H200, 2026-12-02). The kernels wait for [`flag_value`]`(epoch)`; a
/// half-written flag reads below it.
fn write_flag(stream: &CudaStream, addr: u64, epoch: u64) -> Result<()> {
    let e = u32::try_from(epoch).map_err(|_| {
        Error::InvalidState("the group's dispatches ran past 2^32 epochs of its hop flags".into())
    })?;
    // SAFETY: addr is a u64 of the group's arrival flags (allocated on the
    // hop stream, which every dispatch leaves ordered after its last use).
    let rc = unsafe { cudarc::driver::sys::cuMemsetD32Async(addr, e, 2, stream.cu_stream()) };
    if rc != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Cuda {
            context: "cuMemsetD32Async (hop arrival flag)",
            source: cudarc::driver::DriverError(rc),
        });
    }
    Ok(())
}

/// Sets `words` u32 at `addr` to `value` in `stream`'s order.
fn memset_u32(
    stream: &CudaStream,
    addr: u64,
    value: u32,
    words: usize,
    what: &'static str,
) -> Result<()> {
    // SAFETY: the callers' addr holds `words` u32 of the group's own memory,
    // ordered after its earlier users on `stream`.
    let rc =
        unsafe { cudarc::driver::sys::cuMemsetD32Async(addr, value, words, stream.cu_stream()) };
    if rc != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Cuda {
            context: what,
            source: cudarc::driver::DriverError(rc),
        });
    }
    Ok(())
}

/// The value of an arrival flag set to `epoch` ([`write_flag`]).
fn flag_value(epoch: u64) -> u64 {
    (epoch << 32) | epoch
}

/// One routing entry of `elem` bytes at `ptr`, read back for an error message.
fn read_entry(stream: &Arc<CudaStream>, ptr: u64, elem: usize) -> Result<i64> {
    let mut b = [0u8; 8];
    stream
        .synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;
    // SAFETY: ptr lies in the caller's topk_idx (checked to hold the entry).
    unsafe {
        cudarc::driver::result::memcpy_dtoh_sync(&mut b[..elem], ptr)
            .map_err(Error::cuda("cuMemcpyDtoH"))?;
    }
    Ok(match elem {
        4 => i32::from_le_bytes(b[..4].try_into().unwrap()) as i64,
        _ => i64::from_le_bytes(b),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{forward_batches, node_streams, two_level_traffic, RankInput, Shape};

    /// A routing of `t` tokens per rank: distinct experts per token from a
    /// small linear congruential generator, some slots masked.
    fn inputs(shape: &Shape, t: usize, seed: u64) -> Vec<RankInput> {
        let mut x = seed;
        let mut next = move || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as usize
        };
        (0..shape.num_ranks)
            .map(|_| {
                let mut idx = Vec::new();
                for _ in 0..t {
                    let mut row: Vec<i64> = Vec::new();
                    while row.len() < shape.topk {
                        let e = (next() % shape.num_experts) as i64;
                        if !row.contains(&e) {
                            row.push(e);
                        }
                    }
                    if next() % 4 == 0 {
                        row[0] = -1;
                    }
                    idx.extend(row);
                }
                RankInput {
                    tokens: vec![half::bf16::ZERO; t * shape.hidden],
                    topk_weights: vec![0.5; idx.len()],
                    topk_idx: idx,
                }
            })
            .collect()
    }

    /// A world of `world / g` nodes of `g` ranks, `t` tokens per rank routed
    /// by [`inputs`], and every rank's stream lengths (`lens[r * N + m]`).
    fn routed(
        world: usize,
        g: usize,
        t: usize,
        seed: u64,
    ) -> (Topology, Shape, Vec<RankInput>, Vec<usize>) {
        let topo = Topology::new(world, g).unwrap();
        let shape = Shape {
            num_ranks: world,
            num_experts: 12 * world,
            hidden: 8,
            topk: 4,
        };
        let inputs = inputs(&shape, t, seed);
        let lens = (0..world)
            .flat_map(|r| node_streams(&shape, &topo, &inputs, r).unwrap().len)
            .collect();
        (topo, shape, inputs, lens)
    }

    /// Every rank's plan, from the reference's node streams, puts each
    /// node's rows where the reference's forward batch has them: its own
    /// segment at its node's place, each remote node's rows (what that
    /// node's rail peer sends) in node order, and sends what the traffic
    /// says.
    #[test]
    fn plans_match_the_forward_batches_and_the_traffic() {
        for (world, g, t) in [(4, 2, 37), (8, 2, 50), (8, 4, 23), (2, 1, 0), (6, 2, 11)] {
            let (topo, shape, inputs, lens) = routed(world, g, t, world as u64 * 31 + g as u64);
            let n = topo.nodes();
            let traffic = two_level_traffic(&shape, &topo, &inputs).unwrap();
            for rank in 0..world {
                let p = Plan::new(&topo, rank, &lens).unwrap();
                let me = topo.node_of(rank);
                let batch =
                    &forward_batches(&shape, &topo, &inputs, me).unwrap()[topo.local_index(rank)];
                assert_eq!(p.fwd_rows, batch.origin.len(), "{world} x {g} rank {rank}");
                for m in 0..n {
                    let home = topo.rail_peer(rank, m);
                    let rows: Vec<usize> = (batch.origin.iter().enumerate())
                        .filter(|(_, o)| o.0 == home)
                        .map(|(i, _)| i)
                        .collect();
                    let len = if m == me {
                        lens[rank * n + me]
                    } else {
                        p.recv_rows[m]
                    };
                    assert_eq!(rows.len(), len, "node {m}");
                    assert!(rows.iter().enumerate().all(|(j, &i)| i == p.fwd_off[m] + j));
                    let at = if m == me { p.fwd_off[m] } else { p.send_off[m] };
                    assert_eq!(p.row_off[m] as usize, at);
                    if m != me {
                        assert_eq!(p.send_rows[m], traffic[rank].net_sent[m]);
                        assert_eq!(p.recv_rows[m], traffic[rank].net_recv[m]);
                    } else {
                        assert_eq!((p.send_rows[m], p.recv_rows[m]), (0, 0));
                    }
                }
                assert_eq!(p.sent_rows, p.send_rows.iter().sum::<usize>());
                assert!((0..n).all(|m| m == me || p.send_off[m] + p.send_rows[m] <= p.sent_rows));
            }
        }
    }

    /// Each rank's chunks of dispatch's hop: every remote row's flag is
    /// its node's first flag plus its row / chunk rows, sent by the rail
    /// peer there; own rows have none; the flags are numbered densely and
    /// fit the group's allocation; the rounds are the same on every rank
    /// and cover every stream it sends and every segment it receives.
    #[test]
    #[allow(clippy::needless_range_loop)] // m indexes several per-node arrays
    fn chunks_flag_every_remote_row_and_cover_every_stream() {
        for (world, g, t, rows) in [
            (4, 2, 37, 8),
            (8, 2, 50, 1),
            (8, 4, 23, 128),
            (2, 1, 0, 4),
            (6, 2, 11, 3),
            (8, 2, 64, 16),
        ] {
            let (topo, _, _, lens) = routed(world, g, t, world as u64 * 17 + rows as u64);
            let n = topo.nodes();
            let mut rounds_seen = Vec::new();
            for rank in 0..world {
                let p = Plan::new(&topo, rank, &lens).unwrap();
                let (rounds, first, table) = Chunks::plan(&topo, rank, &lens, &p, rows);
                let at = format!("{world} x {g}, {rows} rows, rank {rank}");
                rounds_seen.push(rounds);
                let me = topo.node_of(rank);
                let (of_row, peers) = table.split_at(p.fwd_rows);
                let mut flags = 0;
                for m in 0..n {
                    let seg = p.fwd_off[m]
                        ..p.fwd_off[m]
                            + if m == me {
                                lens[rank * n + me]
                            } else {
                                p.recv_rows[m]
                            };
                    for (q, i) in seg.enumerate() {
                        let want = if m == me {
                            -1
                        } else {
                            (first[m] + q / rows) as i32
                        };
                        assert_eq!(of_row[i], want, "{at}: row {i} of node {m}");
                    }
                    if m != me {
                        assert_eq!(first[m], flags, "{at}: node {m}'s first flag");
                        let c = p.recv_rows[m].div_ceil(rows);
                        let peer = topo.rail_peer(rank, m) as i32;
                        assert!(
                            peers[flags..flags + c].iter().all(|&q| q == peer),
                            "{at}: the senders of node {m}'s flags"
                        );
                        flags += c;
                        assert!(p.recv_rows[m] <= rounds * rows, "{at}: receive of node {m}");
                        assert!(p.send_rows[m] <= rounds * rows, "{at}: send to node {m}");
                    }
                }
                assert_eq!(peers.len(), flags, "{at}: flags");
                assert!(
                    flags <= (n - 1) * t.max(1).div_ceil(rows),
                    "{at}: allocation"
                );
            }
            assert!(
                rounds_seen.windows(2).all(|w| w[0] == w[1]),
                "{world} x {g}: {rounds_seen:?}"
            );
            let longest = (0..world)
                .flat_map(|r| {
                    (0..n)
                        .filter(move |&m| m != topo.node_of(r))
                        .map(move |m| (r, m))
                })
                .map(|(r, m)| lens[r * n + m])
                .max()
                .unwrap_or(0);
            assert_eq!(
                rounds_seen[0],
                longest.div_ceil(rows),
                "{world} x {g}: rounds"
            );
        }
    }

    #[test]
    fn lengths_of_another_world_are_refused() {
        let topo = Topology::new(4, 2).unwrap();
        assert!(Plan::new(&topo, 0, &[1, 2, 3]).is_err());
        assert!(Plan::new(&topo, 4, &[0; 8]).is_err());
    }
}
