//! The drop policy on the CPU ([`drop_over_capacity`]): which rows a rank
//! that would receive more than its capacity drops, as the layout kernel
//! decides it (`kernels-cuda/layout.cu`, `drop_over_capacity`), given as the
//! routing that is kept. Dispatch and combine of a group with
//! `Overflow::Drop` then equal [`dispatch`](super::dispatch) and the
//! combines of that kept routing: a dropped row is not sent, and its
//! combine adds nothing.
//!
//! Tests: `tests/reference.rs` (the order of the drop, its counts and
//! masks); `tests/gpu_payloads.rs` (the GPU against it).

use super::{align_up, validate_topk, RankInput, Shape};
use crate::error::{Error, Result};
use crate::types::RecvLayout;

/// What the drop policy keeps and drops ([`drop_over_capacity`]).
#[derive(Clone, Debug)]
pub struct Dropped {
    /// Every rank's input with its dropped slots set to `-1`.
    pub kept: Vec<RankInput>,
    /// Rows each receiving rank dropped (rank-major: tokens; expert-major:
    /// (token, expert) rows).
    pub dropped_rows: Vec<usize>,
    /// Per rank `[T, K]`: true where the slot was routed and dropped.
    pub dropped_slots: Vec<Vec<bool>>,
}

/// The largest `q` in `0..=most` with `kept(q) <= cap` (`kept` grows with
/// `q`, `kept(0) <= cap`).
fn water_level(most: usize, cap: usize, kept: impl Fn(usize) -> usize) -> usize {
    let (mut lo, mut hi) = (0, most);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if kept(mid) <= cap {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Shares `cap` among `need` (units of `unit`): each keeps `min(need, q)`
/// for the largest `q` (a multiple of `unit`) that fits, then one more
/// `unit` for each that needs more, first come first, while one is left.
/// Returns what each keeps (`need` itself where everything fits).
fn share(need: &[usize], unit: usize, cap: usize) -> Vec<usize> {
    let blocks: Vec<usize> = need.iter().map(|&n| n.div_ceil(unit)).collect();
    if blocks.iter().sum::<usize>() * unit <= cap {
        return need.to_vec();
    }
    let kept_blocks = |m: usize| blocks.iter().map(|&b| b.min(m)).sum::<usize>() * unit;
    let most = blocks.iter().copied().max().unwrap_or(0);
    let q = water_level(most, cap, kept_blocks);
    let mut left = (cap - kept_blocks(q)) / unit;
    need.iter()
        .zip(&blocks)
        .map(|(&n, &b)| {
            let mut keep = b.min(q);
            if b > q && left > 0 {
                keep += 1;
                left -= 1;
            }
            n.min(keep * unit)
        })
        .collect()
}

/// The drop policy on `inputs` for receive buffers of `capacity` rows in
/// `layout`. For each receiving rank `d` whose rows exceed `capacity`:
///
/// * rank-major: the sources share the capacity by water-filling: source
///   `s` keeps `min(n_s, q)` tokens for `d`, `q` the largest level that
///   fits, then one more each for the sources with more, lowest rank first,
///   while rows are left; it keeps its first tokens for `d` (token order)
///   and drops the rest, with every slot of theirs on `d`;
/// * expert-major: `d`'s experts share it the same way in whole blocks of
///   `alignment` rows (lowest expert first for the extra blocks); expert `e`
///   keeps its first `k_e` rows in (source rank, token) order.
///
/// Errors name `topk_idx` (bad routing, as [`validate_topk`]) or `alignment`.
pub fn drop_over_capacity(
    shape: &Shape,
    inputs: &[RankInput],
    layout: RecvLayout,
    capacity: usize,
) -> Result<Dropped> {
    for inp in inputs {
        validate_topk(shape, &inp.topk_idx)?;
    }
    let (r, k, el) = (shape.num_ranks, shape.topk, shape.experts_per_rank());
    let mut kept: Vec<RankInput> = inputs.to_vec();
    let mut slots: Vec<Vec<bool>> = inputs
        .iter()
        .map(|i| vec![false; i.topk_idx.len()])
        .collect();
    let mut dropped_rows = vec![0usize; r];
    let t_of = |s: usize| inputs[s].topk_idx.len() / k;
    match layout {
        RecvLayout::RankMajor => {
            for (d, dropped) in dropped_rows.iter_mut().enumerate() {
                let on_d = |s: usize, t: usize| {
                    inputs[s].topk_idx[t * k..(t + 1) * k]
                        .iter()
                        .any(|&e| shape.rank_of_entry(e) == Some(d))
                };
                let need: Vec<usize> = (0..r)
                    .map(|s| (0..t_of(s)).filter(|&t| on_d(s, t)).count())
                    .collect();
                let keep = share(&need, 1, capacity);
                *dropped = need.iter().sum::<usize>() - keep.iter().sum::<usize>();
                for s in 0..r {
                    let mut seen = 0;
                    for t in (0..t_of(s)).filter(|&t| on_d(s, t)) {
                        seen += 1;
                        if seen <= keep[s] {
                            continue;
                        }
                        for j in 0..k {
                            let e = inputs[s].topk_idx[t * k + j];
                            if shape.rank_of_entry(e) == Some(d) {
                                kept[s].topk_idx[t * k + j] = -1;
                                slots[s][t * k + j] = true;
                            }
                        }
                    }
                }
            }
        }
        RecvLayout::ExpertMajor { alignment } => {
            if alignment == 0 {
                return Err(Error::arg("alignment", "at least 1", 0));
            }
            for (d, dropped) in dropped_rows.iter_mut().enumerate() {
                // Rows of each local expert, per source.
                let per: Vec<Vec<usize>> = (0..el)
                    .map(|j| {
                        let e = (d * el + j) as i64;
                        (0..r)
                            .map(|s| inputs[s].topk_idx.iter().filter(|&&x| x == e).count())
                            .collect()
                    })
                    .collect();
                let need: Vec<usize> = per.iter().map(|p| p.iter().sum()).collect();
                let keep =
                    if need.iter().map(|&n| align_up(n, alignment)).sum::<usize>() <= capacity {
                        need.clone()
                    } else {
                        share(&need, alignment, capacity)
                    };
                *dropped = need.iter().sum::<usize>() - keep.iter().sum::<usize>();
                for j in 0..el {
                    let e = (d * el + j) as i64;
                    let mut before = 0;
                    for s in 0..r {
                        let keep_s = keep[j].saturating_sub(before).min(per[j][s]);
                        before += per[j][s];
                        let mut seen = 0;
                        for (i, &x) in inputs[s].topk_idx.iter().enumerate() {
                            if x != e {
                                continue;
                            }
                            seen += 1;
                            if seen > keep_s {
                                kept[s].topk_idx[i] = -1;
                                slots[s][i] = true;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(Dropped {
        kept,
        dropped_rows,
        dropped_slots: slots,
    })
}
