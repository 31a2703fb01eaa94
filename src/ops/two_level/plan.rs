//! Where one rank's rows lie on the two-level path ([`Plan`]: its forward
//! batch and its send range, from every rank's stream lengths) and the
//! network hop in chunks ([`Chunks`]).
//!
//! Tests: the unit tests below (each rank's rows against the reference's
//! forward batches and traffic, on the CPU).

use cudarc::driver::CudaSlice;

use super::hop_plan::hop_rows;
use crate::error::Result;
use crate::ops::abi::MAX_NODES;
use crate::types::Topology;

/// Where one rank's rows lie on the two-level path: its forward batch (the
/// node segments in node order, its own at `fwd_off[node]`) and its send
/// range (its streams to the remote nodes in node order).
pub(crate) struct Plan {
    /// `row_off[m]`: the first row of node `m`'s rows (the kernels' view).
    pub(crate) row_off: [i32; MAX_NODES],
    /// Rows of this rank's stream to each remote node (0 at its own node).
    pub(crate) send_rows: Vec<usize>,
    /// Rows the rail peer on each remote node sends here (0 at its own node).
    pub(crate) recv_rows: Vec<usize>,
    /// First row of each node's segment of the forward batch.
    pub(crate) fwd_off: Vec<usize>,
    /// First row of each remote node's stream in the send range.
    pub(crate) send_off: Vec<usize>,
    /// Rows of the forward batch and of the send range.
    pub(crate) fwd_rows: usize,
    pub(crate) sent_rows: usize,
}

/// Rows of chunk `c` of a stream or segment of `len` rows, in chunks of
/// `rows`: empty where the stream is shorter. The hop's pieces and the
/// arrival flags' rows both come from here.
pub(crate) fn chunk_range(len: usize, c: usize, rows: usize) -> std::ops::Range<usize> {
    let lo = c.saturating_mul(rows).min(len);
    lo..(lo + rows).min(len)
}

/// The hop in chunks of the group's `chunk_rows` rows: round `c` moves
/// chunk `c` of every stream and segment ([`chunk_range`]), in either
/// direction.
pub(crate) struct Chunks {
    /// Rounds: the longest stream between any two rail peers, in chunks
    /// (the same on every rank: every rank makes each round's exchange).
    pub(crate) rounds: usize,
    /// First arrival flag of each node's segment here (remote nodes; its
    /// chunk `c` is flag `first[m] + c`).
    pub(crate) first: Vec<usize>,
    /// `[fwd_rows]` each forward row's chunk (its arrival flag and its
    /// combine progress counter; -1: this rank's own rows), then `[flags]`
    /// each chunk's rail peer.
    pub(crate) table: CudaSlice<i32>,
}

impl Chunks {
    /// The chunks of `plan` for `rank`, from every rank's stream lengths
    /// (as [`Plan::new`]); the table on the host.
    pub(crate) fn plan(
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
    pub(crate) fn new(topology: &Topology, rank: usize, lens: &[usize]) -> Result<Plan> {
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
