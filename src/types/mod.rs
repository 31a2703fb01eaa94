//! The types the ops and the CPU reference share, below both: the receive
//! layouts ([`RecvLayout`] for the high-throughput ops, [`LlLayout`] for the
//! low-latency ones), the fp8 block scaling ([`Fp8Scaling`]) and the
//! two-level shape of a world ([`Topology`], in `topology.rs`).
//!
//! The two layouts stay two types: a low-latency batch has a fixed slot
//! per (expert, source rank, token) and no alignment, a high-throughput
//! expert-major block is padded to one; a single enum would carry an
//! alignment the low-latency ops must refuse.

mod topology;

pub use topology::Topology;

use crate::error::{Error, Result};

/// Most ranks on one NVLink node (the kernels' `MAX_RANKS`, asserted equal
/// in `ops::abi`).
pub(crate) const NODE_MAX_RANKS: usize = 8;

/// Where received rows land on the receiving rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvLayout {
    /// One row per (token, rank), grouped by source rank, then token.
    RankMajor,
    /// One row per (token, local expert), in per-expert blocks padded with
    /// zero rows to a multiple of `alignment` (>= 1) rows.
    ExpertMajor {
        /// Block granularity in rows (>= 1).
        alignment: usize,
    },
}

impl RecvLayout {
    /// Checks `alignment >= 1` for [`RecvLayout::ExpertMajor`]; the error
    /// names `alignment`.
    pub fn validate(&self) -> Result<()> {
        match *self {
            RecvLayout::ExpertMajor { alignment: 0 } => {
                Err(Error::arg("alignment", "at least 1 row", 0))
            }
            _ => Ok(()),
        }
    }

    /// Weights (and local expert ids) per received row: `k` rank-major, 1
    /// expert-major.
    pub(crate) fn weights_per_row(self, k: usize) -> usize {
        match self {
            RecvLayout::RankMajor => k,
            RecvLayout::ExpertMajor { .. } => 1,
        }
    }
}

/// The two low-latency receive layouts (`moe_ep::reference::ll_dispatch` documents both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlLayout {
    /// `[E_local, R * M, H]`, per-expert counts, `src` per row.
    ExpertMajor,
    /// `[R, M, H]`, `[K]` local expert ids and weights per row.
    RankMajor,
}

/// How a block's scale is chosen from its amax (`moe_ep::reference`'s fp8 module documents the cast).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// `scale = amax * (1/448)`: the block's largest value maps to ±448.
    #[default]
    Exact,
    /// `scale = 2^ceil(log2(amax * (1/448)))` (DeepEP's `round_scale`): the
    /// cast is then an exact scaling followed by one rounding.
    PowerOfTwo,
}
