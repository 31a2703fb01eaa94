//! `RailHop`: the network hop of the inter-node path (`docs/rdma-model.md`),
//! the transfers between a rank and its *rail peers* (the ranks with its
//! local index on the other nodes, [`Topology::rail_peer`]) behind one
//! interface for both kinds of communicator.
//!
//! - On an NCCL communicator, one [`RailHop::exchange`] is one NCCL group of
//!   `ncclSend` / `ncclRecv` on the hop's own stream (NCCL carries it over
//!   the network between hosts, over NVLink or its socket transport on one).
//! - On a virtual world (`Communicator::virtual_world`: every rank a thread
//!   of one process on one GPU, "nodes" only by [`Topology`]) the same call
//!   moves the same bytes with device-to-device copies into the receivers'
//!   buffers, ordered by CUDA events that the ranks share through their
//!   host group.
//!
//! The hop is issued from the host with its sizes known there, so what
//! enqueues it cannot be captured into a CUDA graph (the model page's "Host
//! synchronisation and CUDA graphs").
//!
//! Public with the Cargo feature `raw` (it takes raw device addresses);
//! the inter-node dispatch and combine are built on it.
//!
//! ```no_run
//! # fn main() -> moe_ep::Result<()> {
//! use moe_ep::ops::rail_hop::{HopRecv, HopSend, RailHop};
//! use moe_ep::ops::DeviceRegion;
//! use moe_ep::{Communicator, Topology};
//!
//! let ctx = moe_ep::context(0)?;
//! # let id = moe_ep::UniqueId::generate()?;
//! let comm = Communicator::init(&ctx, &id, 0, 2)?; // rank 0 of 2
//! let stream = ctx.new_stream().map_err(moe_ep::Error::cuda("cuStreamCreate"))?;
//! let hop = RailHop::new(&comm, Topology::new(2, 1)?)?; // 2 nodes of 1 rank; collective
//! let out = stream.alloc_zeros::<u8>(4096).map_err(moe_ep::Error::cuda("alloc"))?;
//! let inn = stream.alloc_zeros::<u8>(4096).map_err(moe_ep::Error::cuda("alloc"))?;
//! let send = HopSend { peer: 1, src: DeviceRegion::device_ptr(&out), bytes: 4096 };
//! let recv = HopRecv { peer: 1, dst: DeviceRegion::device_ptr(&inn), bytes: 4096 };
//! // SAFETY: both buffers live, and are left alone, until `stream` has passed the call.
//! unsafe { hop.exchange(&stream, &[send], &[recv])? };
//! // Work enqueued on `stream` from here on sees rank 1's bytes in `inn`.
//! # Ok(()) }
//! ```
//!
//! Tests: the unit tests below (the argument and pair checks);
//! `tests/gpu_rail_hop.rs` (every byte at virtual 2 x 2, 2 x 4, 4 x 2 and
//! the other shapes of 2, 4 and 8 ranks, and 2 x 1 on two GPUs; calls in a
//! row; refusals; a rank that never calls).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::{Error, Result};
use crate::runtime::nccl_call as nc;
use crate::runtime::{nvtx, Communicator, HostGroup};
use crate::sys::nccl::ncclUint8;
use crate::types::Topology;

/// What this rank sends to one rail peer in one [`RailHop::exchange`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopSend {
    /// The receiving rank: a rail peer of this rank on another node.
    pub peer: usize,
    /// Device address of the first byte, on this rank's GPU.
    pub src: u64,
    /// Bytes to send; 0 sends nothing (as if the entry were not listed).
    pub bytes: usize,
}

/// What this rank receives from one rail peer in one [`RailHop::exchange`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopRecv {
    /// The sending rank: a rail peer of this rank on another node.
    pub peer: usize,
    /// Device address the bytes land at, on this rank's GPU.
    pub dst: u64,
    /// Bytes to receive: exactly what `peer` sends to this rank; 0 receives
    /// nothing (as if the entry were not listed).
    pub bytes: usize,
}

/// The network hop between this rank and its rail peers, with a stream of
/// its own for the transfers (a non-blocking stream of the communicator's
/// context). One per rank of a world; every rank's hop has the same
/// [`Topology`].
pub struct RailHop {
    comm: Arc<Communicator>,
    topology: Topology,
    /// This rank's rail peers on the other nodes, by ascending node.
    peers: Vec<usize>,
    stream: Arc<CudaStream>,
    /// One exchange at a time: they share the hop stream and, on a virtual
    /// world, this rank's rounds of the host group.
    turn: Mutex<()>,
}

/// A virtual rank's part of one exchange, as its siblings see it.
#[derive(Clone)]
struct Plan {
    /// This rank's own error, when it refused its arguments.
    refused: Option<String>,
    sizes: Sizes,
    recvs: Vec<HopRecv>,
    /// Recorded on the caller's stream at the call: what the rank's
    /// buffers wait for before the hop may read or write them.
    ready: Option<Arc<CudaEvent>>,
}

/// One rank's transfers of an exchange by size: `(peer, bytes)`.
#[derive(Clone, Debug, Default)]
struct Sizes {
    sends: Vec<(usize, usize)>,
    recvs: Vec<(usize, usize)>,
}

impl RailHop {
    /// The hop of this rank of `comm` in `topology` (collective: every rank
    /// calls it, with the same topology).
    ///
    /// Errors: `topology` of another world size than `comm`'s, or one that
    /// another rank passed differently (every rank fails, naming the rank
    /// and its value); a CUDA error creating the stream.
    pub fn new(comm: &Arc<Communicator>, topology: Topology) -> Result<RailHop> {
        let ctx = comm.context();
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        let world = comm.world();
        let local = if topology.world() == world {
            Ok(())
        } else {
            Err(Error::arg(
                "topology",
                format!("a topology of the communicator's {world} ranks"),
                format!("{} ranks", topology.world()),
            ))
        };
        let mine = [local.is_ok() as u64, topology.ranks_per_node() as u64];
        let all = comm.all_gather_host(&stream, &mine)?;
        local?;
        let me = comm.rank();
        if let Some(r) = (0..world).find(|&r| all[2 * r] == 0) {
            return Err(Error::arg(
                "topology",
                "a topology every rank accepts",
                format!("rank {r} refused its topology (its own error says why)"),
            ));
        }
        if let Some(r) = (0..world).find(|&r| all[2 * r + 1] != mine[1]) {
            return Err(Error::arg(
                "topology",
                format!(
                    "the same ranks per node on every rank (rank {r} has {})",
                    all[2 * r + 1]
                ),
                format!("{} on rank {me}", mine[1]),
            ));
        }
        Ok(RailHop {
            comm: comm.clone(),
            topology,
            peers: rail_peers(&topology, me),
            stream,
            turn: Mutex::new(()),
        })
    }

    /// The topology the hop was made with.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// This rank's rail peers on the other nodes, by ascending node (empty
    /// for a single node).
    pub fn rail_peers(&self) -> &[usize] {
        &self.peers
    }

    /// The stream the transfers run on (for timing them with events; work
    /// enqueued on it by others is ordered like the hop's own).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Enqueues this rank's transfers with its rail peers: every `sends[i]`
    /// goes to `sends[i].peer`, every `recvs[i]` lands from `recvs[i].peer`.
    /// Collective over the world: every rank calls it the same number of
    /// times, also one with nothing to move (empty lists), and what rank a
    /// sends to b is what b receives from a, byte for byte.
    ///
    /// **Ordering.** The transfers start after the work enqueued on `stream`
    /// before the call (on this rank, and for what lands in a peer's buffer,
    /// on that peer's stream before its call), and `stream`'s work enqueued
    /// after the call starts after this rank's transfers, both ways, have
    /// finished: a receive buffer holds the peer's bytes, a send buffer may
    /// be written again. The host does not wait for the GPU. The transfers
    /// run on [`RailHop::stream`]:
    /// - NCCL: the hop stream waits for an event recorded on `stream`, runs
    ///   one NCCL group of the sends and receives (with the communicator's
    ///   NCCL-call lock held), and `stream` waits for an event recorded on
    ///   the hop stream.
    /// - Virtual world: each rank records a "ready" event on `stream` and
    ///   shares it and its receive list through the host group; the hop
    ///   stream of each sender waits for its own and each receiver's ready
    ///   event, copies its `src` into the receiver's `dst` and records a
    ///   "done" event; `stream` waits for it (the sources), then, after a
    ///   second host round, for the done events of the ranks that send to
    ///   this one.
    ///
    /// Not CUDA-graph capturable: the sizes are the host's, and a virtual
    /// world's events are shared through host rounds.
    ///
    /// # Errors
    /// Before anything is enqueued, each naming the argument and what was
    /// expected ([`validate_plan`]): a peer that is not a rail peer of this
    /// rank on another node, a peer listed twice in `sends` or in `recvs`, a
    /// null address with nonzero bytes, a range past the address space;
    /// `stream` of another context. On a virtual world every rank knows
    /// every plan, so the ranks fail together: a rank whose arguments are
    /// refused gets its own error, the others
    /// [`Error::CollectiveFailed`] naming it; a pair whose sizes disagree
    /// (what a sends to b is not what b expects from a) fails the sender
    /// (`sends`) and the receiver (`recvs`), both naming the pair and both
    /// sizes, and every other rank naming the pair. A rank that does not
    /// call within the host group's timeout (or leaves the world) fails the
    /// others with [`Error::CollectiveFailed`] naming it. On NCCL, sizes
    /// that disagree and a peer that never calls are not seen on the host
    /// (NCCL's own errors, [`Communicator::check_async`], or a wait the
    /// caller ends with [`Communicator::abort`]); an aborted communicator
    /// is [`Error::InvalidState`].
    ///
    /// # Safety
    /// Each `src` must be device memory of this rank's GPU readable for its
    /// `bytes`, each `dst` device memory of this rank's GPU writable for its
    /// `bytes`, no `dst` range may overlap another or a `src` range, and
    /// the caller (and anything else) must neither free them nor write
    /// (`src`) or touch (`dst`) them until `stream` has passed the call
    /// (work enqueued on `stream` after the call is ordered after it).
    pub unsafe fn exchange(
        &self,
        stream: &Arc<CudaStream>,
        sends: &[HopSend],
        recvs: &[HopRecv],
    ) -> Result<()> {
        let _range = nvtx::range("moe_ep::rail_hop");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        let local = self.check_stream(stream).and_then(|()| {
            validate_plan(&self.topology, self.comm.rank(), sends, recvs)?;
            self.comm
                .context()
                .bind_to_thread()
                .map_err(Error::cuda("cuCtxSetCurrent"))
        });
        match self.comm.host_group() {
            Some(group) => self.exchange_virtual(group, stream, sends, recvs, local),
            None => {
                local?;
                self.exchange_nccl(stream, sends, recvs)
            }
        }
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.comm.context().cu_ctx() {
            return Err(Error::arg(
                "stream",
                "a stream of the communicator's GPU context",
                "a stream of another context",
            ));
        }
        Ok(())
    }

    /// One NCCL group on the hop stream, between two events.
    fn exchange_nccl(
        &self,
        stream: &Arc<CudaStream>,
        sends: &[HopSend],
        recvs: &[HopRecv],
    ) -> Result<()> {
        let _one_call = self.comm.nccl_calls();
        let raw = self.comm.raw().ok_or_else(|| {
            Error::InvalidState(format!(
                "rank {}: the communicator was aborted; make a new one",
                self.comm.rank()
            ))
        })?;
        let hop = &self.stream;
        hop.join(stream).map_err(Error::cuda("cuStreamWaitEvent"))?;
        let cs = hop.cu_stream() as *mut c_void;
        nc::group_start()?;
        let calls = (|| -> Result<()> {
            for s in sends.iter().filter(|s| s.bytes > 0) {
                // SAFETY: the caller's contract; ordered on the hop stream.
                unsafe { nc::send(s.src as *const c_void, s.bytes, ncclUint8, s.peer, raw, cs)? };
            }
            for r in recvs.iter().filter(|r| r.bytes > 0) {
                // SAFETY: as above.
                unsafe { nc::recv(r.dst as *mut c_void, r.bytes, ncclUint8, r.peer, raw, cs)? };
            }
            Ok(())
        })();
        // Closed whatever happened: NCCL's group depth is per thread.
        let end = nc::group_end();
        calls?;
        end?;
        stream.join(hop).map_err(Error::cuda("cuStreamWaitEvent"))
    }

    /// Device copies between the threads of one process, in two host
    /// rounds: the plans with the ready events, then the done events.
    fn exchange_virtual(
        &self,
        group: &HostGroup,
        stream: &Arc<CudaStream>,
        sends: &[HopSend],
        recvs: &[HopRecv],
        local: Result<()>,
    ) -> Result<()> {
        let me = self.comm.rank();
        let ready = local.and_then(|()| {
            stream
                .record_event(None)
                .map(Arc::new)
                .map_err(Error::cuda("cuEventRecord"))
        });
        let plan = Plan {
            refused: ready.as_ref().err().map(|e| e.to_string()),
            sizes: Sizes {
                sends: sends.iter().map(|s| (s.peer, s.bytes)).collect(),
                recvs: recvs.iter().map(|r| (r.peer, r.bytes)).collect(),
            },
            recvs: recvs.to_vec(),
            ready: ready.as_ref().ok().cloned(),
        };
        let plans = group.exchange("rail hop (plans)", plan)?;
        let ready = ready?;
        if let Some((r, why)) = plans
            .iter()
            .enumerate()
            .find_map(|(r, p)| p.refused.as_ref().map(|w| (r, w)))
        {
            return Err(Error::CollectiveFailed {
                rank: me,
                collective: "rail hop",
                missing: vec![r],
                reason: format!("rank {r} refused its part: {why}"),
            });
        }
        let sizes: Vec<Sizes> = plans.iter().map(|p| p.sizes.clone()).collect();
        check_pairs(me, &sizes)?;

        // This rank's sends: pushed into the receivers' buffers on the hop
        // stream once this rank's and the receiver's prior work are done.
        let hop = &self.stream;
        let enqueued = (|| -> Result<Arc<CudaEvent>> {
            hop.wait(&ready).map_err(Error::cuda("cuStreamWaitEvent"))?;
            for s in sends.iter().filter(|s| s.bytes > 0) {
                let theirs = &plans[s.peer];
                let dst = theirs
                    .recvs
                    .iter()
                    .find(|r| r.peer == me)
                    .map(|r| r.dst)
                    .expect("the pair check found the receive of these bytes");
                let peer_ready = theirs.ready.as_ref().expect("no rank refused");
                hop.wait(peer_ready)
                    .map_err(Error::cuda("cuStreamWaitEvent"))?;
                // SAFETY: the caller's contract for `src`, the receiver's
                // for `dst` (both of this GPU, the same context); ordered
                // after both ranks' prior work.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(dst, s.src, s.bytes, hop.cu_stream())
                }
                .map_err(Error::cuda("cuMemcpyDtoDAsync (rail hop)"))?;
            }
            let done = hop
                .record_event(None)
                .map(Arc::new)
                .map_err(Error::cuda("cuEventRecord"))?;
            // The sources stay untouched until the copies have read them.
            stream
                .wait(&done)
                .map_err(Error::cuda("cuStreamWaitEvent"))?;
            Ok(done)
        })();
        let shared: std::result::Result<Arc<CudaEvent>, String> =
            enqueued.as_ref().cloned().map_err(|e| e.to_string());
        let dones = group.exchange("rail hop (copies enqueued)", shared)?;
        enqueued?;
        if let Some((r, why)) = dones
            .iter()
            .enumerate()
            .find_map(|(r, d)| d.as_ref().err().map(|w| (r, w)))
        {
            return Err(Error::CollectiveFailed {
                rank: me,
                collective: "rail hop",
                missing: vec![r],
                reason: format!("rank {r} failed to enqueue its copies: {why}"),
            });
        }
        // What lands here: after the senders' copies.
        for r in recvs.iter().filter(|r| r.bytes > 0) {
            let done = dones[r.peer].as_ref().expect("checked above");
            stream
                .wait(done)
                .map_err(Error::cuda("cuStreamWaitEvent"))?;
        }
        Ok(())
    }
}

/// The rail peers of `rank` on the other nodes, by ascending node.
fn rail_peers(topology: &Topology, rank: usize) -> Vec<usize> {
    let home = topology.node_of(rank);
    (0..topology.nodes())
        .filter(|&m| m != home)
        .map(|m| topology.rail_peer(rank, m))
        .collect()
}

/// Checks one rank's arguments to [`RailHop::exchange`] against
/// `topology`, as the call does before it enqueues anything: every peer a
/// rail peer of `rank` on another node, no peer twice in `sends` nor twice
/// in `recvs`, no null address with nonzero bytes, no range past the end
/// of the address space. Each error names `sends` or `recvs`, the entry
/// and what was expected (`rank` itself: `rank`).
pub fn validate_plan(
    topology: &Topology,
    rank: usize,
    sends: &[HopSend],
    recvs: &[HopRecv],
) -> Result<()> {
    let world = topology.world();
    if rank >= world {
        return Err(Error::arg("rank", format!("a rank in 0..{world}"), rank));
    }
    let peers = rail_peers(topology, rank);
    let side = |arg: &'static str, addr: &str, items: &[(usize, u64, usize)]| -> Result<()> {
        for (i, &(peer, at, bytes)) in items.iter().enumerate() {
            if !peers.contains(&peer) {
                let what = if peer == rank {
                    " (this rank itself)".to_string()
                } else if peer >= world {
                    format!(" (outside the world of {world} ranks)")
                } else if topology.node_of(peer) == topology.node_of(rank) {
                    format!(" (on this rank's node {})", topology.node_of(rank))
                } else {
                    format!(
                        " (node {}, local index {}, another rail)",
                        topology.node_of(peer),
                        topology.local_index(peer)
                    )
                };
                return Err(Error::arg(
                    arg,
                    format!(
                        "peers that are rail peers of rank {rank} on other nodes ({})",
                        ranks_text(&peers)
                    ),
                    format!("{arg}[{i}].peer = {peer}{what}"),
                ));
            }
            if let Some(j) = items[..i].iter().position(|x| x.0 == peer) {
                return Err(Error::arg(
                    arg,
                    "each peer at most once",
                    format!("{arg}[{j}].peer and {arg}[{i}].peer both rank {peer}"),
                ));
            }
            if bytes > 0 && at == 0 {
                return Err(Error::arg(
                    arg,
                    format!("a device address for the {bytes} bytes of {arg}[{i}]"),
                    format!("{arg}[{i}].{addr} = 0 (null)"),
                ));
            }
            if at.checked_add(bytes as u64).is_none() {
                return Err(Error::arg(
                    arg,
                    "a range inside the address space",
                    format!("{arg}[{i}]: {bytes} bytes at {at:#x}"),
                ));
            }
        }
        Ok(())
    };
    let s: Vec<_> = sends.iter().map(|s| (s.peer, s.src, s.bytes)).collect();
    side("sends", "src", &s)?;
    let r: Vec<_> = recvs.iter().map(|r| (r.peer, r.dst, r.bytes)).collect();
    side("recvs", "dst", &r)
}

/// Every (sender, receiver) pair of the world whose sizes disagree, as
/// `(sender, receiver, bytes sent, bytes expected)` by ascending sender,
/// then receiver; an unlisted transfer is 0 bytes. The plans' peers are
/// ranks of the world (checked by [`validate_plan`] on their ranks).
fn pair_mismatches(sizes: &[Sizes]) -> Vec<(usize, usize, usize, usize)> {
    let bytes = |list: &[(usize, usize)], peer: usize| {
        list.iter().find(|x| x.0 == peer).map(|x| x.1).unwrap_or(0)
    };
    let mut out = Vec::new();
    for (a, sa) in sizes.iter().enumerate() {
        let mut bs: Vec<usize> = sa.sends.iter().map(|x| x.0).collect();
        bs.extend((0..sizes.len()).filter(|&b| sizes[b].recvs.iter().any(|x| x.0 == a && x.1 > 0)));
        bs.sort_unstable();
        bs.dedup();
        for b in bs {
            let (sent, expected) = (bytes(&sa.sends, b), bytes(&sizes[b].recvs, a));
            if sent != expected {
                out.push((a, b, sent, expected));
            }
        }
    }
    out
}

/// Fails rank `me` when any pair's sizes disagree: the sender with
/// `sends`, the receiver with `recvs` (the first such pair of `me`), every
/// other rank with [`Error::CollectiveFailed`] naming the first pair.
fn check_pairs(me: usize, sizes: &[Sizes]) -> Result<()> {
    let bad = pair_mismatches(sizes);
    if let Some(&(a, b, sent, expected)) = bad.iter().find(|m| m.0 == me || m.1 == me) {
        return Err(if a == me {
            Error::arg(
                "sends",
                format!("the {expected} bytes that rank {b} expects from rank {a} (its recvs)"),
                format!("{sent} bytes from rank {a} to rank {b}"),
            )
        } else {
            Error::arg(
                "recvs",
                format!("the {sent} bytes that rank {a} sends to rank {b} (its sends)"),
                format!("{expected} bytes expected by rank {b} from rank {a}"),
            )
        });
    }
    if let Some(&(a, b, sent, expected)) = bad.first() {
        return Err(Error::CollectiveFailed {
            rank: me,
            collective: "rail hop",
            missing: vec![a, b],
            reason: format!("rank {a} sends {sent} bytes to rank {b}, which expects {expected}"),
        });
    }
    Ok(())
}

fn ranks_text(r: &[usize]) -> String {
    let list: Vec<String> = r.iter().map(|x| x.to_string()).collect();
    match r.len() {
        0 => "none: the world is one node".to_string(),
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(peer: usize, bytes: usize) -> HopSend {
        HopSend {
            peer,
            src: 0x1000,
            bytes,
        }
    }
    fn recv(peer: usize, bytes: usize) -> HopRecv {
        HopRecv {
            peer,
            dst: 0x2000,
            bytes,
        }
    }

    /// The argument an `InvalidArgument` names, and its whole text.
    fn refused(r: Result<()>) -> (&'static str, String) {
        match r {
            Err(e @ Error::InvalidArgument { arg, .. }) => (arg, e.to_string()),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn rail_peers_are_the_other_nodes_ranks_of_the_rail() {
        let t = Topology::new(8, 2).unwrap(); // 4 nodes of 2
        assert_eq!(rail_peers(&t, 3), vec![1, 5, 7]);
        assert_eq!(rail_peers(&t, 4), vec![0, 2, 6]);
        let t = Topology::new(8, 4).unwrap(); // 2 nodes of 4
        assert_eq!(rail_peers(&t, 6), vec![2]);
        assert_eq!(
            rail_peers(&Topology::new(4, 0).unwrap(), 1),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn good_plans_pass() {
        let t = Topology::new(8, 2).unwrap();
        let sends = [send(1, 100), send(5, 0), send(7, 17)];
        let recvs = [recv(7, 3), recv(1, 0)];
        validate_plan(&t, 3, &sends, &recvs).unwrap();
        // Nothing to move, and zero bytes at a null address.
        validate_plan(&t, 3, &[], &[]).unwrap();
        let null0 = HopSend {
            peer: 1,
            src: 0,
            bytes: 0,
        };
        validate_plan(&t, 3, &[null0], &[]).unwrap();
    }

    #[test]
    fn a_peer_off_the_rail_or_node_is_refused_by_name() {
        let t = Topology::new(8, 2).unwrap(); // rank 3: node 1, index 1; peers 1, 5, 7
        let (arg, msg) = refused(validate_plan(&t, 3, &[send(1, 8), send(4, 8)], &[]));
        assert_eq!(arg, "sends");
        assert!(
            msg.contains("sends[1].peer = 4 (node 2, local index 0, another rail)")
                && msg.contains("ranks 1, 5, 7"),
            "{msg}"
        );
        let (arg, msg) = refused(validate_plan(&t, 3, &[], &[recv(2, 8)]));
        assert_eq!(arg, "recvs");
        assert!(
            msg.contains("recvs[0].peer = 2 (on this rank's node 1)"),
            "{msg}"
        );
        let (_, msg) = refused(validate_plan(&t, 3, &[send(3, 8)], &[]));
        assert!(
            msg.contains("sends[0].peer = 3 (this rank itself)"),
            "{msg}"
        );
        let (_, msg) = refused(validate_plan(&t, 3, &[], &[recv(9, 8)]));
        assert!(
            msg.contains("recvs[0].peer = 9 (outside the world of 8 ranks)"),
            "{msg}"
        );
        // One node: no rail peer at all.
        let one = Topology::new(4, 4).unwrap();
        let (_, msg) = refused(validate_plan(&one, 0, &[send(1, 8)], &[]));
        assert!(msg.contains("none: the world is one node"), "{msg}");
        // The rank itself.
        let (arg, _) = refused(validate_plan(&t, 8, &[], &[]));
        assert_eq!(arg, "rank");
    }

    #[test]
    fn a_peer_twice_or_a_null_address_is_refused_by_name() {
        let t = Topology::new(8, 2).unwrap();
        let (arg, msg) = refused(validate_plan(
            &t,
            3,
            &[send(5, 1), send(1, 1), send(5, 0)],
            &[],
        ));
        assert_eq!(arg, "sends");
        assert!(
            msg.contains("sends[0].peer and sends[2].peer both rank 5"),
            "{msg}"
        );
        let (arg, msg) = refused(validate_plan(&t, 3, &[], &[recv(7, 1), recv(7, 1)]));
        assert_eq!(arg, "recvs");
        assert!(
            msg.contains("recvs[0].peer and recvs[1].peer both rank 7"),
            "{msg}"
        );
        // Sending to and receiving from one peer is not listing it twice.
        validate_plan(&t, 3, &[send(7, 4)], &[recv(7, 4)]).unwrap();
        let null = HopRecv {
            peer: 5,
            dst: 0,
            bytes: 64,
        };
        let (arg, msg) = refused(validate_plan(&t, 3, &[], &[recv(1, 2), null]));
        assert_eq!(arg, "recvs");
        assert!(
            msg.contains("the 64 bytes of recvs[1]") && msg.contains("recvs[1].dst = 0 (null)"),
            "{msg}"
        );
        let past_end = HopSend {
            peer: 1,
            src: u64::MAX - 3,
            bytes: 8,
        };
        let (arg, msg) = refused(validate_plan(&t, 3, &[past_end], &[]));
        assert_eq!(arg, "sends");
        assert!(msg.contains("address space"), "{msg}");
    }

    fn sizes(sends: &[(usize, usize)], recvs: &[(usize, usize)]) -> Sizes {
        Sizes {
            sends: sends.to_vec(),
            recvs: recvs.to_vec(),
        }
    }

    #[test]
    fn matching_pairs_pass_and_unlisted_is_zero_bytes() {
        // 2 x 1: rank 0 sends 10 to 1, rank 1 sends 0 (unlisted on one side).
        let w = vec![sizes(&[(1, 10)], &[(1, 0)]), sizes(&[], &[(0, 10)])];
        assert!(pair_mismatches(&w).is_empty());
        check_pairs(0, &w).unwrap();
        check_pairs(1, &w).unwrap();
        assert!(pair_mismatches(&[Sizes::default(), Sizes::default()]).is_empty());
    }

    #[test]
    fn a_size_mismatch_fails_both_ranks_of_the_pair_and_names_it_elsewhere() {
        // 4 x 1: rank 2 sends 64 to rank 0, which expects 100; 1 <-> 3 agree.
        let w = vec![
            sizes(&[], &[(2, 100)]),
            sizes(&[(3, 5)], &[]),
            sizes(&[(0, 64)], &[]),
            sizes(&[], &[(1, 5)]),
        ];
        assert_eq!(pair_mismatches(&w), vec![(2, 0, 64, 100)]);
        let (arg, msg) = refused(check_pairs(2, &w));
        assert_eq!(arg, "sends");
        assert!(
            msg.contains("64 bytes from rank 2 to rank 0")
                && msg.contains("100 bytes that rank 0 expects from rank 2"),
            "{msg}"
        );
        let (arg, msg) = refused(check_pairs(0, &w));
        assert_eq!(arg, "recvs");
        assert!(
            msg.contains("64 bytes that rank 2 sends to rank 0")
                && msg.contains("100 bytes expected by rank 0 from rank 2"),
            "{msg}"
        );
        for other in [1, 3] {
            match check_pairs(other, &w) {
                Err(Error::CollectiveFailed {
                    rank,
                    missing,
                    reason,
                    ..
                }) => {
                    assert_eq!((rank, missing), (other, vec![2, 0]));
                    assert!(
                        reason.contains("rank 2 sends 64 bytes to rank 0"),
                        "{reason}"
                    );
                }
                r => panic!("rank {other}: {r:?}"),
            }
        }
        // A receive with no send at all, and a send with no receive.
        let w = vec![sizes(&[], &[(1, 8)]), sizes(&[], &[])];
        assert_eq!(pair_mismatches(&w), vec![(1, 0, 0, 8)]);
        let w = vec![sizes(&[(1, 8)], &[]), sizes(&[], &[])];
        assert_eq!(pair_mismatches(&w), vec![(0, 1, 8, 0)]);
        assert_eq!(refused(check_pairs(1, &w)).0, "recvs");
    }
}
