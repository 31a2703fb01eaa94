//! What a group holds in memory on each rank ([`MemoryFootprint`],
//! [`EpGroup::memory_footprint`](crate::EpGroup::memory_footprint)), and the
//! one-node path's workspace layout with its size formula
//! ([`workspace_bytes`]), which `node/group.rs` carves.
//!
//! Tests: `tests/cpu_api.rs` (the formula against hand-computed sizes).
//! No GPU test reads a live group's footprint yet; ep-bench prints it.

use super::abi::{count_row, Workspace, MAX_BLOCKS, MAX_RANKS, MAX_TOPK};
use super::config::GroupConfig;

/// Device and pinned host memory one rank of a group holds, by category, in
/// bytes. Everything but `handles` is held from [`EpGroup::new`] to the
/// group's drop; receive buffers a dispatch takes from the pool come and go
/// within `pool_other` / `pool_free`.
///
/// [`EpGroup::new`]: crate::EpGroup::new
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryFootprint {
    /// The symmetric workspace ([`workspace_bytes`]): flags, the count
    /// matrix, the call descriptors and, most of it, the combine stage.
    pub workspace: u64,
    /// The low-latency buffer sets ([`ll_buffer_bytes`](crate::ops::ll_buffer_bytes),
    /// symmetric and local); 0 in high-throughput mode.
    pub low_latency: u64,
    /// Bytes of the pool's segments beside the workspace and the symmetric
    /// low-latency sets: receive buffers and handles' symmetric arrays in
    /// use now, and freed ranges kept for reuse (of which `pool_free`).
    pub pool_other: u64,
    /// Of `pool_other`, the bytes in free ranges now.
    pub pool_free: u64,
    /// The two-level path's own device buffers beside its node group (the
    /// network hop's arrival and progress flags); 0 on one node.
    pub two_level: u64,
    /// Pinned host memory (the error report the kernels write).
    pub pinned_host: u64,
}

impl MemoryFootprint {
    /// Device bytes in all: workspace, low-latency sets, the rest of the
    /// pool and the two-level path's buffers.
    pub fn device_total(&self) -> u64 {
        self.workspace + self.low_latency + self.pool_other + self.two_level
    }
}

/// The workspace of a one-node group of `cfg` over `world` ranks, in bytes
/// (each region rounded up to 256 bytes). With `R = world`,
/// `E = num_experts`, `M = max_tokens_per_rank`, `H = hidden`,
/// `S = 16` combine sub-chunks, `B = 132` blocks, `K = 16` the largest top-k:
///
/// ```text
///   counts         4 * 2 * R * (E + R * S + 8)     the count matrix, two parities
///   flags          8 * (R + 3 * R * B)             count, dispatch, combine, pull flags
///   descriptors    8 * 2 * 8 * 8                   each call's op and buffers
///   counters       8 * 5 * B                       calls, items, status
///   stage weights  4 * 2 * R * M * K               combine's pushed weights
///   stage          2 * 2 * R * M * H               combine's pushed rows (bf16)
/// ```
///
/// about `4 R M H` bytes: 944 MB at `R = 8`, `M = 4096`, `H = 7168`.
pub fn workspace_bytes(cfg: &GroupConfig, world: usize) -> u64 {
    carve_workspace(cfg, world).2
}

/// The workspace's regions (offsets), the bytes that must start at zero
/// (everything before the stage), and the total.
pub(crate) fn carve_workspace(cfg: &GroupConfig, world: usize) -> (Workspace, u64, u64) {
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
    let zeroed;
    (w.seq_off, zeroed) = carve(5 * MAX_BLOCKS as u64 * 8);
    w.stage_w_off = carve(2 * stage_rows * MAX_TOPK as u64 * 4).0;
    let total;
    (w.stage_off, total) = carve(2 * stage_rows * h * 2);
    w.stage_rows = stage_rows;
    (w, zeroed, total)
}
