//! The two-level path's network hop between rail peers: how many rows each
//! rank sends to and receives from each of its rail peers ([`hop_rows`]),
//! from the stream lengths every rank's layout gives. `two_level/plan.rs` plans
//! the hop's chunks from them (`docs/rdma-model.md`, "Pipelining").
//!
//! Tests: the unit tests below, and against `reference::two_level_traffic`
//! and `reference::node_streams` in `tests/reference_two_level.rs`.

use crate::error::{Error, Result};
use crate::types::Topology;

/// This rank's `send_rows` and `recv_rows` of the hop, from every
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

    fn topo(world: usize, g: usize) -> Topology {
        Topology::new(world, g).unwrap()
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
}
