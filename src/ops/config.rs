//! [`GroupConfig`] and [`Mode`]: the sizes and the kernel family a group is
//! made with, the same on every rank, and their checks
//! ([`GroupConfig::validate`]) for either path: the one-node path's fields,
//! and the two-level path's rules (at least two and at most
//! [`MAX_NODES`] nodes, high-throughput mode, `hop_chunk_rows`, the forward
//! batch's size). Used by every path (`node/`, `low_latency/`,
//! `two_level/`).
//!
//! Tests: `tests/cpu_api.rs` (`GroupConfig::validate`, `ranks_per_node`
//! included).

use std::time::Duration;

use super::abi::{self, MAX_BLOCKS, MAX_NODES};
use crate::error::{Error, Result};
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

/// What a high-throughput layout does when a rank would receive more rows
/// than its `recv_capacity` ([`GroupConfig::overflow`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    /// Every rank stops in that call with [`Error::CapacityExceeded`]
    /// (`check()` reports it), and nothing is written.
    #[default]
    Error,
    /// The rows beyond the capacity are dropped, the same way on every rank
    /// (all decide from the same count matrix): a rank's senders share its
    /// capacity by water-filling (rank-major: the largest per-source quota
    /// that fits, then one more row for each source that has more, lowest
    /// rank first; expert-major: per local expert, in whole blocks of the
    /// alignment, lowest expert first), and each source or expert keeps its
    /// first rows in (source rank, token) order, dropping the last ones.
    /// A dropped (token, expert) is not sent, its combine adds nothing and
    /// its gradients are zero; [`Handle::dropped_slots`](crate::Handle::dropped_slots) says which of this
    /// rank's were dropped, [`HostCounts::dropped_rows`](crate::HostCounts::dropped_rows) how many each rank
    /// dropped, and [`Handle::kept_topk_idx`](crate::Handle::kept_topk_idx) is the routing that was kept.
    /// One node only.
    Drop,
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
    /// does not read it. Default [`DEFAULT_HOP_CHUNK_ROWS`].
    pub hop_chunk_rows: usize,
    /// Expert-major: write zeros into the padding rows of each expert's
    /// block (`true`, the default), or leave their token rows (and fp8
    /// scales) as they are (`false`: for a grouped GEMM that takes per-expert
    /// counts and never reads them). Their weights, ids and sources are
    /// marked either way (0, -1, (-1, -1)). Also the combine backward's
    /// padding rows. Each rank's own choice (it writes only its own rows).
    pub zero_padding: bool,
    /// Rows beyond `recv_capacity`: an error ([`Overflow::Error`], the
    /// default) or dropped ([`Overflow::Drop`]). The same on every rank.
    pub overflow: Overflow,
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
            hop_chunk_rows: DEFAULT_HOP_CHUNK_ROWS,
            zero_padding: true,
            overflow: Overflow::Error,
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
            validate_two_level(self, world)?;
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
        if self.mode == Mode::LowLatency && self.overflow == Overflow::Drop {
            return Err(Error::arg(
                "overflow",
                "Overflow::Error for Mode::LowLatency (its slots hold every token)",
                "Overflow::Drop",
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

/// Rows per chunk of the network hop unless
/// [`GroupConfig::hop_chunk_rows`] says otherwise. 512 rows of hidden
/// 7168 are 7.3 MB of bf16 per chunk and rail peer, 147 µs at a 400 Gb/s
/// NIC's line rate, against a fixed cost per round of the hop: on one H200
/// at 2 virtual nodes x 2 ranks, 4096 tokens (2026-12-02, BENCHMARKS.md),
/// 17-23 µs per round (host rounds of the virtual hop; dispatch 1483 µs in
/// chunks of 128 rows, 921 in chunks of 512, 797 in one chunk).
pub const DEFAULT_HOP_CHUNK_ROWS: usize = 512;

/// Checks `cfg` for a world of `world` ranks without a GPU, naming the
/// bad field: every check of `TwoLevelPath::new` that needs no peer
/// (those of [`GroupConfig::validate`] but the one-node rule, at least
/// two and at most [`MAX_NODES`] nodes, high-throughput mode, the forward
/// batch's size). Returns the world's nodes.
pub(crate) fn validate_two_level(cfg: &GroupConfig, world: usize) -> Result<Topology> {
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
    if cfg.overflow != Overflow::Error {
        return Err(Error::arg(
            "overflow",
            "Overflow::Error on several nodes (the drop policy runs on one node)",
            format!("{:?}", cfg.overflow),
        ));
    }
    Ok(topology)
}

/// The node group's tokens per rank: a forward batch holds a row per node
/// for each of `max_tokens_per_rank` tokens, at most 2^20 (the error names
/// `max_tokens_per_rank`).
pub(crate) fn forward_tokens(cfg: &GroupConfig, nodes: usize) -> Result<usize> {
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
