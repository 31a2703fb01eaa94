//! `Topology`: the two-level shape of a world, nodes of NVLink-connected
//! ranks joined by the network (`docs/rdma-model.md`).
//!
//! Rank `r` of a world of `W` ranks in nodes of `G` ranks
//! ([`GroupConfig::ranks_per_node`](crate::GroupConfig::ranks_per_node)) lies
//! on node `r / G` with local index `r % G`. Its *rail peer* on node `m` is
//! the rank of `m` with the same local index, `m * G + r % G`: tokens for
//! another node cross the network once, to that peer, which forwards them
//! over NVLink to the ranks of its node that host their experts.
//!
//! ```
//! use moe_ep::Topology;
//! let t = Topology::new(16, 8).unwrap(); // 2 nodes of 8 ranks
//! assert_eq!((t.nodes(), t.node_of(11), t.local_index(11)), (2, 1, 3));
//! assert_eq!(t.rail_peer(11, 0), 3);
//! assert_eq!(t.node_ranks(1), 8..16);
//! ```
//!
//! Tests: the unit tests below; `tests/cpu_api.rs` (the config checks that
//! use it).

use std::ops::Range;

use super::NODE_MAX_RANKS as MAX_RANKS;
use crate::error::{Error, Result};

/// A world of `nodes()` nodes of `ranks_per_node()` ranks each, ranks
/// numbered node by node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    world: usize,
    ranks_per_node: usize,
}

impl Topology {
    /// The topology of `world` ranks in nodes of `ranks_per_node` (`0`: the
    /// whole world on one node).
    ///
    /// Errors: `world` 0, or more than `MAX_RANKS` (8) ranks on one node when
    /// the whole world is one node (the same check as a single-node
    /// [`GroupConfig::validate`](crate::GroupConfig::validate)), naming
    /// `world`; `ranks_per_node` that does not divide `world`, or above 8,
    /// naming `ranks_per_node`.
    pub fn new(world: usize, ranks_per_node: usize) -> Result<Topology> {
        let g = if ranks_per_node == 0 {
            world
        } else {
            ranks_per_node
        };
        if world == 0 || (g == world && world > MAX_RANKS) {
            return Err(Error::arg(
                "world",
                format!("1..={MAX_RANKS} ranks on one NVLink node"),
                world,
            ));
        }
        if !world.is_multiple_of(g) {
            return Err(Error::arg(
                "ranks_per_node",
                format!("a divisor of the world size {world} (0: all ranks on one node)"),
                ranks_per_node,
            ));
        }
        if g > MAX_RANKS {
            return Err(Error::arg(
                "ranks_per_node",
                format!("at most {MAX_RANKS} ranks on one NVLink node (0: the whole world)"),
                ranks_per_node,
            ));
        }
        Ok(Topology {
            world,
            ranks_per_node: g,
        })
    }

    /// Ranks in the world.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Ranks per node, `G` (the whole world for a single node).
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// Nodes, `world / G`.
    pub fn nodes(&self) -> usize {
        self.world / self.ranks_per_node
    }

    /// The node of `rank`, `rank / G`.
    ///
    /// # Panics
    /// If `rank` is not a rank of the world.
    pub fn node_of(&self, rank: usize) -> usize {
        self.check_rank(rank);
        rank / self.ranks_per_node
    }

    /// The index of `rank` inside its node, `rank % G`: its rail.
    ///
    /// # Panics
    /// If `rank` is not a rank of the world.
    pub fn local_index(&self, rank: usize) -> usize {
        self.check_rank(rank);
        rank % self.ranks_per_node
    }

    /// The rank of `node` with the local index of `rank`,
    /// `node * G + rank % G`: where `rank`'s tokens for `node` cross the
    /// network to (`rank` itself for its own node).
    ///
    /// # Panics
    /// If `rank` is not a rank or `node` not a node of the world.
    pub fn rail_peer(&self, rank: usize, node: usize) -> usize {
        self.check_node(node);
        node * self.ranks_per_node + self.local_index(rank)
    }

    /// The ranks of `node`, `node * G .. (node + 1) * G`.
    ///
    /// # Panics
    /// If `node` is not a node of the world.
    pub fn node_ranks(&self, node: usize) -> Range<usize> {
        self.check_node(node);
        node * self.ranks_per_node..(node + 1) * self.ranks_per_node
    }

    fn check_rank(&self, rank: usize) {
        assert!(
            rank < self.world,
            "rank {rank} outside a world of {}",
            self.world
        );
    }

    fn check_node(&self, node: usize) {
        assert!(
            node < self.nodes(),
            "node {node} outside a world of {} nodes",
            self.nodes()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arg_of(e: Error) -> &'static str {
        match e {
            Error::InvalidArgument { arg, .. } => arg,
            other => panic!("expected InvalidArgument, got {other}"),
        }
    }

    #[test]
    fn one_node_is_the_default() {
        for world in 1..=MAX_RANKS {
            let t = Topology::new(world, 0).unwrap();
            assert_eq!(t, Topology::new(world, world).unwrap());
            assert_eq!(
                (t.nodes(), t.ranks_per_node(), t.world()),
                (1, world, world)
            );
            for r in 0..world {
                assert_eq!((t.node_of(r), t.local_index(r)), (0, r));
                assert_eq!(t.rail_peer(r, 0), r);
            }
            assert_eq!(t.node_ranks(0), 0..world);
        }
    }

    #[test]
    fn ranks_map_to_node_local_index_and_rail_peers() {
        for (world, g) in [(4, 2), (8, 4), (8, 2), (8, 1), (16, 8), (64, 8)] {
            let t = Topology::new(world, g).unwrap();
            assert_eq!(t.nodes(), world / g);
            for r in 0..world {
                let (n, i) = (t.node_of(r), t.local_index(r));
                assert_eq!(n * g + i, r, "world {world} g {g} rank {r}");
                assert!(i < g && t.node_ranks(n).contains(&r));
                for m in 0..t.nodes() {
                    let p = t.rail_peer(r, m);
                    // Same rail, on node m; the relation is symmetric.
                    assert_eq!((t.node_of(p), t.local_index(p)), (m, i));
                    assert_eq!(t.rail_peer(p, n), r);
                }
                assert_eq!(t.rail_peer(r, n), r);
            }
            // The nodes' ranks tile the world in order.
            let all: Vec<usize> = (0..t.nodes()).flat_map(|m| t.node_ranks(m)).collect();
            assert_eq!(all, (0..world).collect::<Vec<_>>());
        }
        // 2 x 4: rank 6 is node 1, index 2; its rail peer on node 0 is 2.
        let t = Topology::new(8, 4).unwrap();
        assert_eq!(
            (t.node_of(6), t.local_index(6), t.rail_peer(6, 0)),
            (1, 2, 2)
        );
    }

    #[test]
    fn bad_shapes_are_refused_by_name() {
        assert_eq!(arg_of(Topology::new(0, 0).unwrap_err()), "world");
        assert_eq!(arg_of(Topology::new(9, 0).unwrap_err()), "world");
        assert_eq!(arg_of(Topology::new(16, 16).unwrap_err()), "world");
        assert_eq!(arg_of(Topology::new(6, 4).unwrap_err()), "ranks_per_node");
        assert_eq!(arg_of(Topology::new(2, 4).unwrap_err()), "ranks_per_node");
        assert_eq!(arg_of(Topology::new(32, 16).unwrap_err()), "ranks_per_node");
        let msg = Topology::new(12, 5).unwrap_err().to_string();
        assert!(
            msg.contains("divisor of the world size 12") && msg.contains('5'),
            "{msg}"
        );
        let msg = Topology::new(32, 16).unwrap_err().to_string();
        assert!(msg.contains("at most 8") && msg.contains("16"), "{msg}");
    }

    #[test]
    #[should_panic(expected = "rank 8 outside")]
    fn a_rank_outside_the_world_panics() {
        Topology::new(8, 4).unwrap().node_of(8);
    }

    #[test]
    #[should_panic(expected = "node 2 outside")]
    fn a_node_outside_the_world_panics() {
        Topology::new(8, 4).unwrap().rail_peer(0, 2);
    }
}
