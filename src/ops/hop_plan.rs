//! The two-level dispatch's network hop cut into chunk rounds: which bytes
//! each [`RailHop::exchange`](super::rail_hop::RailHop::exchange) of one
//! dispatch sends and receives (`docs/rdma-model.md`, "Pipelining").
//!
//! A rank's streams to its rail peers lie back to back in its send range,
//! nodes ascending (its own node's stream empty); the streams from them
//! land the same way in its landing range. Every stream is cut into the
//! same number of chunks, `chunks`, by rows: chunk `c` of a stream of `n`
//! rows is rows `[c * n / chunks, (c + 1) * n / chunks)`. Round `c` sends
//! and receives chunk `c` of every stream, so the two sides of a pair cut
//! the same rows (the receiver knows `n` from the count matrix), every rank
//! makes `chunks` rounds (the exchange is collective over the world) and a
//! chunk can be forwarded over NVLink while the next one is on the wire.
//!
//! Tests: the unit tests below (against `reference::two_level_traffic` in
//! `tests/reference_two_level.rs` too).

use crate::error::{Error, Result};
use crate::ops::Topology;

use super::rail_hop::{HopRecv, HopSend};

/// The sends and receives of one round (one exchange) of a dispatch's hop.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HopRound {
    /// One entry per rail peer with rows in this chunk, nodes ascending.
    pub sends: Vec<HopSend>,
    /// One entry per rail peer with rows in this chunk, nodes ascending.
    pub recvs: Vec<HopRecv>,
}

/// This rank's hop, `chunks` rounds: `send_rows[m]` rows to its rail peer on
/// node `m`, `recv_rows[m]` from it (both `[N]`, `0` at its own node), rows
/// of `row_bytes`, streams back to back by node from `send_base` and
/// `recv_base` ([`hop_rounds_at`] with the streams' starts summed up).
///
/// Errors, each naming the argument: `rank` outside the world, `send_rows`
/// or `recv_rows` not one count per node or not 0 at the rank's own node,
/// `chunks` 0, `row_bytes` 0, a range past the end of the address space.
#[allow(clippy::too_many_arguments)]
pub fn hop_rounds(
    topology: &Topology,
    rank: usize,
    send_rows: &[usize],
    recv_rows: &[usize],
    row_bytes: usize,
    chunks: usize,
    send_base: u64,
    recv_base: u64,
) -> Result<Vec<HopRound>> {
    let starts = |rows: &[usize]| -> Vec<usize> {
        rows.iter()
            .scan(0, |at, &n| {
                let s = *at;
                *at += n;
                Some(s)
            })
            .collect()
    };
    let (send_at, recv_at) = (starts(send_rows), starts(recv_rows));
    hop_rounds_at(
        topology,
        rank,
        HopSide {
            rows: send_rows,
            at: &send_at,
            base: send_base,
        },
        HopSide {
            rows: recv_rows,
            at: &recv_at,
            base: recv_base,
        },
        row_bytes,
        chunks,
    )
}

/// One side of a rank's hop: `rows[m]` rows with its rail peer on node
/// `m`, starting at row `at[m]` of the range at `base` (both `[N]`; `rows`
/// is `0` at the rank's own node).
#[derive(Clone, Copy, Debug)]
pub struct HopSide<'a> {
    /// Rows per node.
    pub rows: &'a [usize],
    /// First row per node, in the range.
    pub at: &'a [usize],
    /// The range's address.
    pub base: u64,
}

/// [`hop_rounds`] with each stream where `at` says: combine's return sends
/// a rail peer's partials from its forward batch's output, where its own
/// node's rows lie between the streams of the other nodes.
///
/// Errors, each naming the argument (`send_rows`, `send_at`, `send_base`
/// for `send`, `recv_*` for `recv`): `rank` outside the world, `rows` or
/// `at` not one count per node, `rows` not 0 at the rank's own node,
/// `chunks` 0, `row_bytes` 0, a stream past the end of the address space.
pub fn hop_rounds_at(
    topology: &Topology,
    rank: usize,
    send: HopSide<'_>,
    recv: HopSide<'_>,
    row_bytes: usize,
    chunks: usize,
) -> Result<Vec<HopRound>> {
    let (world, nodes) = (topology.world(), topology.nodes());
    if rank >= world {
        return Err(Error::arg("rank", format!("a rank in 0..{world}"), rank));
    }
    let me = topology.node_of(rank);
    // Each side with the names its errors give: rows, at, base.
    let sides = [
        (["send_rows", "send_at", "send_base"], send),
        (["recv_rows", "recv_at", "recv_base"], recv),
    ];
    for ([rows, at, _], h) in sides {
        if h.rows.len() != nodes || h.rows[me] != 0 {
            return Err(Error::arg(
                rows,
                format!("{nodes} row counts, one per node, 0 at this rank's node {me}"),
                format!("{:?}", h.rows),
            ));
        }
        if h.at.len() != nodes {
            return Err(Error::arg(
                at,
                format!("{nodes} first rows, one per node"),
                format!("{:?}", h.at),
            ));
        }
    }
    if chunks == 0 {
        return Err(Error::arg("chunks", "at least 1", chunks));
    }
    if row_bytes == 0 {
        return Err(Error::arg("row_bytes", "at least 1", row_bytes));
    }
    for ([.., base], h) in sides {
        let end = |m: usize| {
            h.at[m]
                .checked_add(h.rows[m])
                .and_then(|r| r.checked_mul(row_bytes))
                .and_then(|b| h.base.checked_add(b as u64))
        };
        if let Some(m) = (0..nodes).find(|&m| end(m).is_none()) {
            return Err(Error::arg(
                base,
                "a range within the address space",
                format!(
                    "{:#x} + rows {} + {} of {row_bytes} bytes (node {m})",
                    h.base, h.at[m], h.rows[m]
                ),
            ));
        }
    }
    // Row `[c * n / chunks]` of a stream of n rows: chunk c's first.
    let cut = |n: usize, c: usize| (n as u128 * c as u128 / chunks as u128) as usize;
    // Chunk c of node m's stream of a side: its address and bytes, None
    // when empty.
    let chunk = |h: &HopSide<'_>, m: usize, c: usize| {
        let (lo, hi) = (cut(h.rows[m], c), cut(h.rows[m], c + 1));
        (hi > lo).then(|| {
            (
                h.base + ((h.at[m] + lo) * row_bytes) as u64,
                (hi - lo) * row_bytes,
            )
        })
    };
    Ok((0..chunks)
        .map(|c| {
            let mut round = HopRound::default();
            for m in 0..nodes {
                let peer = topology.rail_peer(rank, m);
                if let Some((src, bytes)) = chunk(&send, m, c) {
                    round.sends.push(HopSend { peer, src, bytes });
                }
                if let Some((dst, bytes)) = chunk(&recv, m, c) {
                    round.recvs.push(HopRecv { peer, dst, bytes });
                }
            }
            round
        })
        .collect())
}

/// This rank's `send_rows` and `recv_rows` for [`hop_rounds`], from every
/// rank's stream lengths: `lens[r * N + m]` is rank `r`'s stream to node `m`
/// (its rail peer there), as the layouts of all ranks give them; the entry
/// of a rank's own node (its own rows, no network) is not read, and both
/// results hold 0 there. `send_rows[m]` is this rank's stream to node `m`;
/// `recv_rows[m]` is what its rail peer on node `m` sends to this rank's
/// node.
///
/// Errors, each naming the argument: `rank` outside the world, `lens` not
/// `R * N` counts.
pub fn hop_rows(
    topology: &Topology,
    rank: usize,
    lens: &[usize],
) -> Result<(Vec<usize>, Vec<usize>)> {
    let (world, nodes) = (topology.world(), topology.nodes());
    if rank >= world {
        return Err(Error::arg("rank", format!("a rank in 0..{world}"), rank));
    }
    if lens.len() != world * nodes {
        return Err(Error::arg(
            "lens",
            format!("{world} x {nodes} stream lengths (ranks x nodes)"),
            format!("{} values", lens.len()),
        ));
    }
    let me = topology.node_of(rank);
    let net = |m: usize, rows: usize| if m == me { 0 } else { rows };
    let send = (0..nodes).map(|m| net(m, lens[rank * nodes + m])).collect();
    let recv = (0..nodes)
        .map(|m| net(m, lens[topology.rail_peer(rank, m) * nodes + me]))
        .collect();
    Ok((send, recv))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::rail_hop::validate_plan;

    fn topo(world: usize, g: usize) -> Topology {
        Topology::new(world, g).unwrap()
    }

    #[test]
    fn hop_rounds_at_take_each_stream_where_it_lies() {
        // Rank 1 of 2 x 1 sends 3 rows from row 5 and receives 2 at row 1.
        let t = topo(2, 1);
        let side = |rows: &'static [usize], at: &'static [usize]| HopSide {
            rows,
            at,
            base: 1000,
        };
        let r =
            hop_rounds_at(&t, 1, side(&[3, 0], &[5, 0]), side(&[2, 0], &[1, 0]), 10, 1).unwrap();
        assert_eq!(
            r[0].sends,
            vec![HopSend {
                peer: 0,
                src: 1050,
                bytes: 30
            }]
        );
        assert_eq!(
            r[0].recvs,
            vec![HopRecv {
                peer: 0,
                dst: 1010,
                bytes: 20
            }]
        );
        let e = hop_rounds_at(&t, 1, side(&[3, 0], &[5]), side(&[2, 0], &[1, 0]), 10, 1);
        assert!(e.unwrap_err().to_string().contains("send_at"));
        let far = HopSide {
            rows: &[3, 0],
            at: &[5, 0],
            base: u64::MAX - 40,
        };
        let e = hop_rounds_at(&t, 1, far, side(&[2, 0], &[1, 0]), 10, 1);
        assert!(e.unwrap_err().to_string().contains("send_base"));
    }

    #[test]
    fn hop_rows_pair_each_rank_with_its_rail_peers() {
        // 3 nodes of 2: rank r sends 10 * r + m rows to node m (0 at its own).
        let t = topo(6, 2);
        let lens: Vec<usize> = (0..6)
            .flat_map(|r| (0..3).map(move |m| if m == r / 2 { 0 } else { 10 * r + m }))
            .collect();
        let (send, recv) = hop_rows(&t, 3, &lens).unwrap();
        assert_eq!(send, vec![30, 0, 32]);
        // From rank 1 (node 0) and rank 5 (node 2), to node 1.
        assert_eq!(recv, vec![11, 0, 51]);
        // Every pair agrees: what a sends to node m is what its rail peer there receives.
        for a in 0..6 {
            let (send, _) = hop_rows(&t, a, &lens).unwrap();
            for (m, &rows) in send.iter().enumerate() {
                let (_, recv) = hop_rows(&t, t.rail_peer(a, m), &lens).unwrap();
                assert_eq!(recv[t.node_of(a)], rows, "rank {a}, node {m}");
            }
        }
    }

    #[test]
    fn hop_rows_leave_out_the_own_node_and_refuse_bad_arguments_by_name() {
        let t = topo(4, 2);
        // Rank r's own rows (its own node's entry) are not network rows.
        let lens = vec![9, 1, 9, 2, 3, 9, 4, 9];
        assert_eq!(hop_rows(&t, 2, &lens).unwrap(), (vec![3, 0], vec![1, 0]));
        assert_eq!(hop_rows(&t, 1, &lens).unwrap(), (vec![0, 2], vec![0, 4]));
        let err = |rank: usize, lens: &[usize]| hop_rows(&t, rank, lens).unwrap_err().to_string();
        assert!(err(4, &lens).contains("rank"), "{}", err(4, &lens));
        assert!(
            err(0, &lens[..6]).contains("lens"),
            "{}",
            err(0, &lens[..6])
        );
    }

    #[test]
    fn rounds_cover_every_row_once_and_pairs_agree() {
        const ROW: usize = 48;
        for (world, g) in [(2, 1), (4, 2), (8, 4), (8, 2), (8, 1)] {
            let t = topo(world, g);
            let n = t.nodes();
            // rows[a][m]: rank a's rows to its rail peer on node m.
            let rows: Vec<Vec<usize>> = (0..world)
                .map(|a| {
                    (0..n)
                        .map(|m| match m == t.node_of(a) {
                            true => 0,
                            false => (a * 7 + m * 13) % 11 + (a + m) % 3 * 100,
                        })
                        .collect()
                })
                .collect();
            for chunks in [1, 3, 8, 16] {
                let plans: Vec<Vec<HopRound>> = (0..world)
                    .map(|a| {
                        // From its rail peer on m: what that peer sends to a's node.
                        let recv: Vec<usize> = (0..n)
                            .map(|m| rows[t.rail_peer(a, m)][t.node_of(a)])
                            .collect();
                        hop_rounds(&t, a, &rows[a], &recv, ROW, chunks, 0x1000, 0x10_0000).unwrap()
                    })
                    .collect();
                for a in 0..world {
                    assert_eq!(plans[a].len(), chunks);
                    // Each stream's chunks are contiguous, in order, whole.
                    let mut next: Vec<u64> = {
                        let mut at = 0x1000u64;
                        (0..n)
                            .map(|m| {
                                let s = at;
                                at += (rows[a][m] * ROW) as u64;
                                s
                            })
                            .collect()
                    };
                    for (c, round) in plans[a].iter().enumerate() {
                        validate_plan(&t, a, &round.sends, &round.recvs).unwrap();
                        for s in &round.sends {
                            let m = t.node_of(s.peer);
                            assert_eq!(s.src, next[m], "{world}/{g} rank {a} chunk {c}");
                            next[m] += s.bytes as u64;
                            // The receiver's chunk c from a has the same bytes.
                            let back = plans[s.peer][c].recvs.iter().find(|r| r.peer == a);
                            assert_eq!(back.map(|r| r.bytes), Some(s.bytes));
                        }
                        for r in &round.recvs {
                            let sent = plans[r.peer][c].sends.iter().find(|s| s.peer == a);
                            assert_eq!(sent.map(|s| s.bytes), Some(r.bytes));
                        }
                    }
                    let mut at = 0x1000u64;
                    for m in 0..n {
                        at += (rows[a][m] * ROW) as u64;
                        assert_eq!(next[m], at, "{world}/{g} rank {a}: stream {m} whole");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_plans_are_refused_by_name() {
        let t = topo(4, 2);
        let arg = |r: Result<Vec<HopRound>>| match r.unwrap_err() {
            Error::InvalidArgument { arg, .. } => arg,
            e => panic!("{e}"),
        };
        let ok = [0, 5];
        assert_eq!(arg(hop_rounds(&t, 4, &ok, &ok, 16, 2, 0, 0)), "rank");
        assert_eq!(arg(hop_rounds(&t, 0, &[0], &ok, 16, 2, 0, 0)), "send_rows");
        assert_eq!(
            arg(hop_rounds(&t, 0, &ok, &[3, 5], 16, 2, 0, 0)),
            "recv_rows"
        );
        assert_eq!(arg(hop_rounds(&t, 0, &ok, &ok, 16, 0, 0, 0)), "chunks");
        assert_eq!(arg(hop_rounds(&t, 0, &ok, &ok, 0, 2, 0, 0)), "row_bytes");
        assert_eq!(
            arg(hop_rounds(&t, 0, &ok, &ok, 16, 2, u64::MAX - 8, 0)),
            "send_base"
        );
        assert_eq!(
            arg(hop_rounds(&t, 0, &ok, &ok, 16, 2, 0, u64::MAX - 8)),
            "recv_base"
        );
        // Nothing to move: every round empty, still `chunks` of them.
        let none = hop_rounds(&t, 0, &[0, 0], &[0, 0], 16, 3, 0, 0).unwrap();
        assert_eq!(none, vec![HopRound::default(); 3]);
    }
}
