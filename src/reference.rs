//! Pure-Rust CPU reference for expert-parallel dispatch and combine.
//!
//! The GPU kernels are tested (and the benchmark is checked) against the
//! functions here. Everything is plain, single-threaded, and written for
//! readability, not speed.
//!
//! # The model
//!
//! * `R` ranks (GPUs), `E` experts with `E % R == 0`, `E_local = E / R`.
//!   Rank `r` hosts the global experts `[r * E_local, (r + 1) * E_local)`;
//!   expert `e` is *local expert* `e - r * E_local` on its rank.
//! * Rank `s` holds `T_s` tokens (possibly 0), each a row of `H` bf16 values
//!   (`tokens`, `[T_s, H]` row-major), and for every token `K` top-k entries:
//!   `topk_idx` (`[T_s, K]`, `i64`, a global expert id or `-1` = masked) and
//!   `topk_weights` (`[T_s, K]`, `f32`).
//! * A token is *sent to rank `d`* if at least one of its non-masked experts
//!   lives on `d`. It is sent once per rank, however many of its experts live
//!   there.
//!
//! # Receive layouts ([`RecvLayout`](crate::RecvLayout))
//!
//! **Rank-major**: one row per (token, destination rank). Rows are grouped by
//! source rank ascending; inside a source, by token index ascending. Each row
//! carries `K` weight slots and `K` local-index slots: slot `k` holds the
//! token's weight / local expert id if `topk_idx[t, k]` lives on the receiving
//! rank, else `0.0` / `-1`.
//!
//! **Expert-major**: one row per (token, expert) pair. Rows form one block per
//! local expert (ascending); inside a block, rows are ordered by
//! (source rank, token) ascending; each block is padded with zero rows to a
//! multiple of `alignment` (an expert that received nothing has 0 rows). Each
//! row carries one weight and one local expert id; padding rows have weight
//! `0.0`, local expert `-1`, source `(-1, -1)` and all-`+0.0` tokens.
//!
//! Row positions follow from the count matrix every rank learns in the count
//! exchange ([`Counts`], built by [`gather_counts`] from each source rank's
//! [`Layout`]): a row's position is a prefix sum over the counts plus the
//! token's position inside its (source → destination) stream
//! ([`Layout::rank_pos`], [`Layout::expert_pos`]).
//!
//! # Worked example
//!
//! `R = 2`, `E = 4` (`E_local = 2`), `K = 2`, expert-major `alignment = 4`.
//!
//! ```text
//! rank 0: t0 -> [0, 3]   t1 -> [1, -1]   t2 -> [2, 3]
//! rank 1: t0 -> [3, 0]   t1 -> [2, -1]
//! ```
//!
//! Rank 1 hosts experts 2 and 3 (local 0 and 1).
//!
//! ```text
//! Layout of rank 0: tokens_per_rank = [2, 2]            (t0,t1 -> r0; t0,t2 -> r1)
//!                   rank_pos   [t][r] = [0,0] [1,-1] [-1,1]
//!                   expert_pos [t][k] = [0,0] [0,-1] [0,1]
//!
//! Rank-major rows on rank 1 (offsets [0, 2, 4]):
//!   row 0: (src 0, t0)  local idx [-1, 1]
//!   row 1: (src 0, t2)  local idx [ 0, 1]
//!   row 2: (src 1, t0)  local idx [ 1,-1]
//!   row 3: (src 1, t1)  local idx [ 0,-1]
//!
//! Expert-major rows on rank 1 (offsets [0, 4, 8], tokens_per_local_expert [2, 3]):
//!   local expert 0 (expert 2): row 0 (0,t2)  row 1 (1,t1)  rows 2,3 padding
//!   local expert 1 (expert 3): row 4 (0,t0)  row 5 (0,t2)  row 6 (1,t0)  row 7 padding
//! ```
//!
//! E.g. `(src 1, t0)` for expert 3 sits at
//! `Counts::expert_major_row(1, 1, 1, 4) + expert_pos = (4 + 2) + 0 = 6`.
//!
//! # Combine
//!
//! Each destination rank `d` turns its received rows into one *partial* per
//! (home token) and sends it back; the home rank sums the partials over `d`
//! ascending. [`combine_f64`] is the exact answer; [`combine_emulated`]
//! reproduces the GPU's f32/bf16 arithmetic bit for bit; [`check_close_bf16`]
//! compares a bf16 result with an f64 one under a documented bound.
//!
//! # Two levels: nodes and the network
//!
//! [`two_level_routes`], [`two_level_traffic`] and
//! [`combine_two_level_emulated`] define the inter-node path over a
//! [`Topology`](crate::Topology): what crosses the network once per
//! (token, remote node) to the rail peer and is forwarded over NVLink there,
//! the rows each rank sends and receives, and combine's fixed two-level
//! order (`docs/rdma-model.md`).
//!
//! # Low-latency mode and fp8
//!
//! [`ll_dispatch`], [`ll_combine_f64`] and [`ll_combine_emulated`] define the
//! low-latency layouts (expert-major `[E_local, R * M, H]`, rank-major
//! `[R, M, H]`) and combine; [`quantize_fp8`] and [`f32_to_e4m3`] define the
//! fp8 e4m3 cast with per-128 scales bit for bit (the docs of each say what
//! the GPU must reproduce).

//!
//! Files: the shapes, inputs, routing layout and count exchange here; the
//! flat (one-level) dispatch, combine and backward passes in `flat.rs`;
//! the drop policy (rows beyond a capacity) in `drop.rs`;
//! the fp8 cast in `fp8.rs`; the low-latency ops in `low_latency.rs`; the
//! two-level path in `two_level.rs`.

use crate::error::{Error, Result};
use half::bf16;

mod drop;
mod flat;
mod fp8;
mod low_latency;
mod two_level;
pub use drop::*;
pub use flat::*;
pub use fp8::*;
pub use low_latency::*;
pub use two_level::*;

/// Largest top-k accepted (`Shape::topk` must be in `1..=MAX_TOPK`).
pub const MAX_TOPK: usize = 16;

/// Problem dimensions shared by all ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Number of ranks `R` (>= 1).
    pub num_ranks: usize,
    /// Number of global experts `E` (a multiple of `R`).
    pub num_experts: usize,
    /// Hidden size `H`: bf16 values per token row (a positive multiple of 8).
    pub hidden: usize,
    /// Top-k `K`: expert slots per token (`1..=16`, at most `E`).
    pub topk: usize,
}

impl Shape {
    /// Experts hosted per rank, `E / R` (0 if `num_ranks` is 0).
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts.checked_div(self.num_ranks).unwrap_or(0)
    }

    /// Checks the dimension rules: `num_ranks >= 1`, `num_experts` a positive
    /// multiple of `num_ranks`, `hidden` a positive multiple of 8,
    /// `topk` in `1..=16` and `<= num_experts`.
    ///
    /// Errors name the offending field (`num_ranks`, `num_experts`, `hidden`,
    /// `topk`).
    pub fn validate(&self) -> Result<()> {
        if self.num_ranks == 0 {
            return Err(Error::arg("num_ranks", "at least 1", self.num_ranks));
        }
        if self.num_experts == 0 || !self.num_experts.is_multiple_of(self.num_ranks) {
            return Err(Error::arg(
                "num_experts",
                format!("a positive multiple of num_ranks = {}", self.num_ranks),
                self.num_experts,
            ));
        }
        if self.hidden == 0 || !self.hidden.is_multiple_of(8) {
            return Err(Error::arg(
                "hidden",
                "a positive multiple of 8",
                self.hidden,
            ));
        }
        if self.topk == 0 || self.topk > MAX_TOPK || self.topk > self.num_experts {
            return Err(Error::arg(
                "topk",
                format!(
                    "in 1..={} and at most num_experts = {}",
                    MAX_TOPK, self.num_experts
                ),
                self.topk,
            ));
        }
        Ok(())
    }

    /// The rank hosting global expert `e` (`e / E_local`). The shape must be
    /// valid; `e` must be `< num_experts` for the answer to be a rank.
    pub fn rank_of_expert(&self, e: usize) -> usize {
        e / self.experts_per_rank()
    }

    /// The rank hosting a `topk_idx` entry, `None` for a masked (negative) one.
    fn rank_of_entry(&self, e: i64) -> Option<usize> {
        usize::try_from(e).ok().map(|e| self.rank_of_expert(e))
    }
}

/// One rank's dispatch input.
#[derive(Clone, Debug)]
pub struct RankInput {
    /// `[T, H]` row-major token rows.
    pub tokens: Vec<bf16>,
    /// `[T, K]` global expert ids, `-1` = masked.
    pub topk_idx: Vec<i64>,
    /// `[T, K]` routing weights.
    pub topk_weights: Vec<f32>,
}

impl RankInput {
    /// Number of tokens `T`, `topk_idx.len() / K`.
    pub fn num_tokens(&self, shape: &Shape) -> usize {
        self.topk_idx.len() / shape.topk
    }
}

/// Checks one rank's `topk_idx` (`[T, K]`): the length is a multiple of `K`,
/// every entry is in `[-1, E)`, and no expert repeats inside a token's row.
/// The shape is validated first. Errors name `topk_idx` and the token/slot.
pub fn validate_topk(shape: &Shape, topk_idx: &[i64]) -> Result<()> {
    shape.validate()?;
    let k = shape.topk;
    let e_max = shape.num_experts as i64;
    if !topk_idx.len().is_multiple_of(k) {
        return Err(Error::arg(
            "topk_idx",
            format!("a length that is a multiple of topk = {k}"),
            format!("{} entries", topk_idx.len()),
        ));
    }
    for (t, row) in topk_idx.chunks_exact(k).enumerate() {
        for (slot, &e) in row.iter().enumerate() {
            if e < -1 || e >= e_max {
                return Err(Error::arg(
                    "topk_idx",
                    format!("expert ids in [-1, {e_max})"),
                    format!("{e} at token {t}, slot {slot}"),
                ));
            }
            if e >= 0 {
                if let Some(first) = row[..slot].iter().position(|&x| x == e) {
                    return Err(Error::arg(
                        "topk_idx",
                        "distinct experts within a token",
                        format!("expert {e} repeated at token {t}, slots {first} and {slot}"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// One source rank's routing layout: what it sends where, and in which
/// position of each (source → destination) stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    /// `T`, this rank's token count.
    pub num_tokens: usize,
    /// `[R]` tokens sent to each rank (a token counts once per rank).
    pub tokens_per_rank: Vec<u32>,
    /// `[E]` (token, expert) pairs sent to each global expert.
    pub tokens_per_expert: Vec<u32>,
    /// `[T * R]` row-major `[t][r]`: token `t` is sent to rank `r`.
    pub is_token_in_rank: Vec<bool>,
    /// `[T * R]` index of token `t` in the (this rank → `r`) stream (this
    /// rank's tokens sent to `r`, ascending `t`); `-1` if not sent.
    pub rank_pos: Vec<i32>,
    /// `[T * K]` index of `(t, k)` in the (this rank → expert `topk_idx[t, k]`)
    /// stream (ascending `t`); `-1` if masked.
    pub expert_pos: Vec<i32>,
}

/// Computes one source rank's [`Layout`] from its `topk_idx` (`[T, K]`),
/// after [`validate_topk`].
pub fn layout(shape: &Shape, topk_idx: &[i64]) -> Result<Layout> {
    validate_topk(shape, topk_idx)?;
    let (r_count, e_count, k) = (shape.num_ranks, shape.num_experts, shape.topk);
    let t_count = topk_idx.len() / k;
    let mut out = Layout {
        num_tokens: t_count,
        tokens_per_rank: vec![0; r_count],
        tokens_per_expert: vec![0; e_count],
        is_token_in_rank: vec![false; t_count * r_count],
        rank_pos: vec![-1; t_count * r_count],
        expert_pos: vec![-1; t_count * k],
    };
    for (t, row) in topk_idx.chunks_exact(k).enumerate() {
        for (slot, &e) in row.iter().enumerate() {
            let Some(r) = shape.rank_of_entry(e) else {
                continue;
            };
            let e = e as usize;
            out.expert_pos[t * k + slot] = out.tokens_per_expert[e] as i32;
            out.tokens_per_expert[e] += 1;
            let tr = t * r_count + r;
            if !out.is_token_in_rank[tr] {
                out.is_token_in_rank[tr] = true;
                out.rank_pos[tr] = out.tokens_per_rank[r] as i32;
                out.tokens_per_rank[r] += 1;
            }
        }
    }
    Ok(out)
}

/// The count matrix every rank learns in the count exchange.
#[derive(Clone, Debug, PartialEq)]
pub struct Counts {
    /// `R`.
    pub num_ranks: usize,
    /// `E`.
    pub num_experts: usize,
    /// `[R * R]`, `rank[src * R + dst]` = tokens `src` sends to `dst`.
    pub rank: Vec<u32>,
    /// `[R * E]`, `expert[src * E + e]` = (token, expert) pairs `src` sends to
    /// global expert `e`.
    pub expert: Vec<u32>,
}

/// Stacks every source rank's counts (`layouts[src]`, one per rank in rank
/// order) into the exchanged [`Counts`].
///
/// # Panics
/// If `layouts.len() != R` or a layout's count vectors do not match `shape`.
pub fn gather_counts(shape: &Shape, layouts: &[Layout]) -> Counts {
    assert_eq!(layouts.len(), shape.num_ranks, "one layout per rank");
    let mut counts = Counts {
        num_ranks: shape.num_ranks,
        num_experts: shape.num_experts,
        rank: Vec::with_capacity(shape.num_ranks * shape.num_ranks),
        expert: Vec::with_capacity(shape.num_ranks * shape.num_experts),
    };
    for l in layouts {
        assert_eq!(l.tokens_per_rank.len(), shape.num_ranks, "tokens_per_rank");
        assert_eq!(
            l.tokens_per_expert.len(),
            shape.num_experts,
            "tokens_per_expert"
        );
        counts.rank.extend_from_slice(&l.tokens_per_rank);
        counts.expert.extend_from_slice(&l.tokens_per_expert);
    }
    counts
}

impl Counts {
    fn experts_per_rank(&self) -> usize {
        self.num_experts / self.num_ranks
    }

    /// Rank-major: first row of source `src`'s tokens on rank `dst`,
    /// `sum over s' < src of rank[s' * R + dst]` (`src == R` gives the total).
    pub fn rank_major_offset(&self, src: usize, dst: usize) -> usize {
        (0..src)
            .map(|s| self.rank[s * self.num_ranks + dst] as usize)
            .sum()
    }

    /// Rank-major: total rows received on `dst`.
    pub fn rank_major_rows(&self, dst: usize) -> usize {
        self.rank_major_offset(self.num_ranks, dst)
    }

    /// Unpadded (token, expert) pairs received by local expert `local_expert`
    /// of rank `dst`, summed over all sources.
    pub fn recv_expert_count(&self, dst: usize, local_expert: usize) -> usize {
        let e = dst * self.experts_per_rank() + local_expert;
        (0..self.num_ranks)
            .map(|s| self.expert[s * self.num_experts + e] as usize)
            .sum()
    }

    /// Expert-major on `dst`: first (padded) row of local expert
    /// `local_expert`'s block, `sum over j' < j of align_up(count(dst, j'),
    /// alignment)` (`local_expert == E_local` gives the total).
    pub fn expert_block_start(&self, dst: usize, local_expert: usize, alignment: usize) -> usize {
        (0..local_expert)
            .map(|j| align_up(self.recv_expert_count(dst, j), alignment))
            .sum()
    }

    /// Expert-major on `dst`: first row of source `src`'s pairs inside local
    /// expert `local_expert`'s block, block start + `sum over s' < src of
    /// expert[s' * E + e]`.
    pub fn expert_major_row(
        &self,
        src: usize,
        dst: usize,
        local_expert: usize,
        alignment: usize,
    ) -> usize {
        let e = dst * self.experts_per_rank() + local_expert;
        self.expert_block_start(dst, local_expert, alignment)
            + (0..src)
                .map(|s| self.expert[s * self.num_experts + e] as usize)
                .sum::<usize>()
    }

    /// Expert-major: total padded rows on `dst`.
    pub fn expert_major_rows(&self, dst: usize, alignment: usize) -> usize {
        self.expert_block_start(dst, self.experts_per_rank(), alignment)
    }

    /// Home-side slot base for partial rows coming back in combine: on home
    /// rank `home`, the partials from rank `from` start at
    /// `sum over d' < from of rank[home * R + d']`.
    pub fn combine_slot_base(&self, home: usize, from: usize) -> usize {
        self.rank[home * self.num_ranks..home * self.num_ranks + from]
            .iter()
            .map(|&c| c as usize)
            .sum()
    }
}

/// `n` rounded up to a multiple of `alignment` (>= 1).
pub(crate) fn align_up(n: usize, alignment: usize) -> usize {
    n.div_ceil(alignment) * alignment
}
