//! The two-level path's group ([`TwoLevelPath`]): its creation (the node
//! group over `Communicator::split`, the rail hop, the arrival flags), the
//! network hop in chunks beside the node's NVLink work, and the launches
//! of the path's own kernels (`pack_rows`, `node_sum`, `remap_src`,
//! `wait_chunks`). Its ops are in `ops.rs`.
//!
//! Kernels: `kernels-cuda/two_level.cu`. Tests: `tests/gpu_two_level.rs`
//! (virtual nodes).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use half::bf16;

use super::handle::TwoLevelHandle;
use super::plan::{chunk_range, Plan};
use super::rail_hop::{HopRecv, HopSend, RailHop};
use crate::error::{Error, Result};
use crate::ops::abi::{ChunkWaitParams, TwoLevelParams, MAX_NODES};
use crate::ops::buffers::DeviceRegion;
use crate::ops::config::{forward_tokens, validate_two_level, GroupConfig};
use crate::ops::node::combine_op::Progress;
use crate::ops::node::dispatch_op::Arrival;
use crate::ops::node::group::NodeGroup;
use crate::runtime::{Communicator, Function, Module};
use crate::symm::SymmBuffer;
use crate::types::Topology;

/// The kernels of `two_level.cu`.
pub(crate) struct Kernels {
    pub(crate) streams_i32: Function,
    pub(crate) streams_i64: Function,
    pub(crate) pack_ids_i32: Function,
    pub(crate) pack_ids_i64: Function,
    pub(crate) pack_rows: Function,
    pub(crate) node_sum: Function,
    pub(crate) gather_w: Function,
    pub(crate) remap_src: Function,
    pub(crate) wait_chunks: Function,
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
pub(crate) const STREAM_THREADS: u32 = 1024;
/// Threads of every other two-level kernel.
pub(crate) const THREADS: u32 = 256;

/// A grid of `THREADS`-thread blocks for `items` items of `per_block` each.
pub(crate) fn grid(items: usize, per_block: usize) -> u32 {
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
    pub(crate) comm: Arc<Communicator>,
    pub(crate) cfg: GroupConfig,
    pub(crate) topology: Topology,
    pub(crate) node: NodeGroup,
    pub(crate) hop: RailHop,
    pub(crate) k: Kernels,
    /// This group's number in the process (handles remember it).
    pub(crate) id: u64,
    /// Rows per chunk of the hop.
    pub(crate) chunk_rows: usize,
    /// The hop, chunk by chunk (the op stream's node op runs beside it).
    pub(crate) hop_stream: Arc<CudaStream>,
    /// One arrival flag per chunk a dispatch (or combine backward) can
    /// receive (its remote segments in node order, each in chunks): the
    /// call's epoch once the chunk has landed.
    pub(crate) arrive: CudaSlice<u64>,
    /// The last epoch of the arrival flags (dispatch, combine backward).
    pub(crate) epoch: std::sync::atomic::AtomicU64,
    /// One counter per chunk a combine sends (its remote segments in node
    /// order, each in chunks, as `arrive`): the vectors of the chunk's rows
    /// the node combine has written (`Progress`), zeroed per call.
    pub(crate) done: CudaSlice<u64>,
    /// One op at a time: an op's hop rounds are collective steps that the
    /// ranks pair in order, and its chunks share the hop stream and flags.
    pub(crate) turn: std::sync::Mutex<()>,
}

pub(crate) static NEXT_GROUP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl TwoLevelPath {
    /// Creates the path (collective over the world `comm`): `cfg` as for
    /// [`EpGroup::new`](crate::EpGroup::new), with `ranks_per_node` making at least two nodes;
    /// high-throughput mode only; every op's network hop in chunks of
    /// `cfg.hop_chunk_rows` rows.
    ///
    /// Errors, by field: [`GroupConfig::validate`]'s; a field that differs
    /// between ranks (every rank fails, naming the field). Where the ranks
    /// share one GPU (a virtual world), `num_sms` must leave one block per
    /// rank for combine's hop: at most [`residency`](crate::ops::residency)'s
    /// `max_blocks_per_rank() - 1`; an error names `num_sms` otherwise.
    pub(crate) fn new(comm: &Arc<Communicator>, cfg: GroupConfig) -> Result<TwoLevelPath> {
        let world = comm.world();
        let hop_chunk_rows = cfg.hop_chunk_rows;
        let topology = validate_two_level(&cfg, world)?;
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
        let r = crate::ops::node::residency::residency(comm, node_cfg.num_experts)?;
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
    pub(crate) fn params(&self, h: &TwoLevelHandle) -> TwoLevelParams {
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
    pub(crate) fn check_handle(&self, h: &TwoLevelHandle) -> Result<()> {
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
    pub(crate) fn hop(
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
    pub(crate) fn remap_src(
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

    /// The network hop in dispatch's direction in rounds on the hop stream
    /// (round `c`: chunk `c` of every stream, for each of `pieces`, each a
    /// forward batch, the send range and the bytes of a row), each round's
    /// landed chunks flagged with a new epoch there. Returns where the node
    /// op enqueued next on `stream` finds the flags; [`Self::rejoin`] after
    /// it.
    pub(crate) fn hop_forward_in_chunks(
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
    pub(crate) fn hop_home_in_chunks(
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
    pub(crate) fn rejoin(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let hs = &self.hop_stream;
        stream.join(hs).map_err(Error::cuda("cuStreamWaitEvent"))?;
        hs.join(stream).map_err(Error::cuda("cuStreamWaitEvent"))
    }

    /// Copies each token's row of `x` (and, with `w`, its weights masked
    /// to the node) to its row for every node it reaches.
    pub(crate) fn pack_rows(
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
    pub(crate) fn node_sum(
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
    pub(crate) fn bad_entry(
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
pub(crate) fn dptr<T>(s: &CudaSlice<T>) -> u64 {
    DeviceRegion::device_ptr(s)
}

/// `len` elements (at least one) of stream-ordered device memory, not zeroed:
/// every buffer of the two-level ops is written (by a kernel or the hop) in
/// every element that is read.
pub(crate) fn alloc<T: cudarc::driver::DeviceRepr>(
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
pub(crate) fn write_flag(stream: &CudaStream, addr: u64, epoch: u64) -> Result<()> {
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
pub(crate) fn memset_u32(
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
pub(crate) fn flag_value(epoch: u64) -> u64 {
    (epoch << 32) | epoch
}

/// One routing entry of `elem` bytes at `ptr`, read back for an error message.
pub(crate) fn read_entry(stream: &Arc<CudaStream>, ptr: u64, elem: usize) -> Result<i64> {
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
