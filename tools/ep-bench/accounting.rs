//! Byte accounting for one routing: how many bytes each rank moves.
//!
//! Everything derives from the rank count matrix that every rank learns
//! during the layout step: `rank_counts` is `R x R`, row-major, with
//! `rank_counts[src * R + dst]` = tokens that rank `src` sends to rank `dst`.
//! A token counts once per destination *rank* (two of its top-k experts on
//! the same rank are one row on the wire); the diagonal entry is the tokens a
//! rank keeps locally.
//!
//! Only token payload rows are counted (`hidden * elem_bytes` bytes each):
//! top-k indices, weights, scales and other metadata are **not** included,
//! so GB/s figures are payload bandwidth.
//!
//! Two conventions are reported:
//! * **NVLink bytes** ([`dispatch_nvlink_bytes`], [`combine_nvlink_bytes`]):
//!   the rows that actually cross NVLink from this rank (self entry excluded).
//! * **Logical bytes** ([`logical_bytes`]): DeepEP's convention for its "NVL"
//!   GB/s: every token row this rank receives in dispatch (and sends back in
//!   combine), the locally kept ones included.
//!
//! Malformed inputs (matrix of the wrong length, `rank >= R`) never panic:
//! [`check_counts`] reports them, and the byte functions treat missing
//! entries as 0.

use crate::cli::Op;

/// Checks that `rank_counts` is an `r x r` matrix (`r >= 1`).
pub fn check_counts(rank_counts: &[u32], r: usize) -> Result<(), String> {
    if r == 0 {
        return Err("rank count matrix: world size is 0".to_string());
    }
    match r.checked_mul(r) {
        Some(n) if n == rank_counts.len() => Ok(()),
        _ => Err(format!(
            "rank count matrix: expected {r}x{r} = {} entries, got {}",
            r.saturating_mul(r),
            rank_counts.len()
        )),
    }
}

/// Entry `[src][dst]`, 0 when out of range.
fn at(rank_counts: &[u32], r: usize, src: usize, dst: usize) -> u64 {
    if src >= r || dst >= r {
        return 0;
    }
    src.checked_mul(r)
        .and_then(|i| i.checked_add(dst))
        .and_then(|i| rank_counts.get(i))
        .map_or(0, |&c| u64::from(c))
}

/// `rows * hidden * elem_bytes`, saturating.
fn row_bytes(rows: u64, hidden: usize, elem_bytes: usize) -> u64 {
    rows.saturating_mul(hidden as u64)
        .saturating_mul(elem_bytes as u64)
}

/// Bytes (B) that `rank` pushes across NVLink in dispatch:
/// `sum over d != rank of counts[rank][d] * hidden * elem_bytes`.
/// Payload only (no top-k metadata).
pub fn dispatch_nvlink_bytes(
    rank_counts: &[u32],
    r: usize,
    rank: usize,
    hidden: usize,
    elem_bytes: usize,
) -> u64 {
    let rows: u64 = (0..r)
        .filter(|&d| d != rank)
        .map(|d| at(rank_counts, r, rank, d))
        .sum();
    row_bytes(rows, hidden, elem_bytes)
}

/// Bytes (B) that `rank` pushes back across NVLink in combine (the partial
/// rows of tokens it received from other ranks):
/// `sum over s != rank of counts[s][rank] * hidden * elem_bytes`.
pub fn combine_nvlink_bytes(
    rank_counts: &[u32],
    r: usize,
    rank: usize,
    hidden: usize,
    elem_bytes: usize,
) -> u64 {
    let rows: u64 = (0..r)
        .filter(|&s| s != rank)
        .map(|s| at(rank_counts, r, s, rank))
        .sum();
    row_bytes(rows, hidden, elem_bytes)
}

/// DeepEP-convention bytes (B) of `rank`: every token row it receives in
/// dispatch, the locally kept ones included:
/// `sum over all s of counts[s][rank] * hidden * elem_bytes`.
/// The same figure is used for combine (the rows sent back).
pub fn logical_bytes(
    rank_counts: &[u32],
    r: usize,
    rank: usize,
    hidden: usize,
    elem_bytes: usize,
) -> u64 {
    let rows: u64 = (0..r).map(|s| at(rank_counts, r, s, rank)).sum();
    row_bytes(rows, hidden, elem_bytes)
}

/// Bytes (B) the NCCL all-to-all baseline moves across NVLink for `rank`:
/// the same rows as our dispatch ([`dispatch_nvlink_bytes`]).
pub fn alltoall_bytes(
    rank_counts: &[u32],
    r: usize,
    rank: usize,
    hidden: usize,
    elem_bytes: usize,
) -> u64 {
    dispatch_nvlink_bytes(rank_counts, r, rank, hidden, elem_bytes)
}

/// NVLink and logical bytes of one op on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpBytes {
    /// Bytes (B) this rank pushes across NVLink.
    pub nvlink: u64,
    /// DeepEP-convention bytes (B), local rows included.
    pub logical: u64,
}

/// Bytes of one of our ops on `rank`: dispatch and combine-bwd move data like
/// dispatch, combine and dispatch-bwd like combine; layout moves no payload
/// (0 bytes).
pub fn op_bytes(
    op: Op,
    rank_counts: &[u32],
    r: usize,
    rank: usize,
    hidden: usize,
    elem_bytes: usize,
) -> OpBytes {
    let logical = logical_bytes(rank_counts, r, rank, hidden, elem_bytes);
    match op {
        Op::Layout => OpBytes {
            nvlink: 0,
            logical: 0,
        },
        Op::Dispatch | Op::CombineBwd => OpBytes {
            nvlink: dispatch_nvlink_bytes(rank_counts, r, rank, hidden, elem_bytes),
            logical,
        },
        Op::Combine | Op::CombinePush | Op::DispatchBwd => OpBytes {
            nvlink: combine_nvlink_bytes(rank_counts, r, rank, hidden, elem_bytes),
            logical,
        },
    }
}

/// One rank's row of the count matrix from its routing: `topk_idx` holds
/// `tokens * topk` global expert ids (row-major, one row per token; negative
/// = masked slot), experts are owned in contiguous blocks of
/// `experts / world`. With `dedup` (high-throughput kernels) a token counts
/// once per destination rank; without it (low-latency kernels, one copy per
/// expert) once per (token, expert). Returns `world` counts.
pub fn count_row(
    topk_idx: &[i32],
    topk: usize,
    experts: usize,
    world: usize,
    dedup: bool,
) -> Result<Vec<u32>, String> {
    if world == 0 || experts == 0 || !experts.is_multiple_of(world) {
        return Err(format!(
            "count_row: {experts} experts do not split over {world} ranks"
        ));
    }
    if topk == 0 || !topk_idx.len().is_multiple_of(topk) {
        return Err(format!(
            "count_row: {} ids is not a multiple of topk {topk}",
            topk_idx.len()
        ));
    }
    let per_rank = experts / world;
    let mut counts = vec![0u32; world];
    let mut seen = vec![false; world];
    for row in topk_idx.chunks(topk) {
        seen.iter_mut().for_each(|s| *s = false);
        for &e in row {
            if e < 0 {
                continue;
            }
            let e = e as usize;
            if e >= experts {
                return Err(format!(
                    "count_row: expert id {e} out of range 0..{experts}"
                ));
            }
            let dst = e / per_rank;
            if dedup && seen[dst] {
                continue;
            }
            seen[dst] = true;
            counts[dst] = counts[dst].saturating_add(1);
        }
    }
    Ok(counts)
}

/// Bandwidth in GB/s (1 GB = 1e9 B) of `bytes` moved in `us` microseconds:
/// `bytes / us / 1e3`. Returns 0.0 when `us` is not a positive finite number.
pub fn gbps(bytes: u64, us: f64) -> f64 {
    if us.is_finite() && us > 0.0 {
        bytes as f64 / us / 1e3
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_ranks_by_hand() {
        // counts = [[3, 5],
        //           [2, 4]]   hidden 8, bf16 (2 B) -> 16 B per row.
        // dispatch NVLink: r0 sends 5 rows to r1 -> 5*16 = 80 B
        //                  r1 sends 2 rows to r0 -> 2*16 = 32 B
        // combine NVLink:  r0 returns the 2 rows it got from r1 -> 32 B
        //                  r1 returns the 5 rows it got from r0 -> 80 B
        // logical:         r0 receives 3 + 2 = 5 rows -> 80 B
        //                  r1 receives 5 + 4 = 9 rows -> 144 B
        let c = [3, 5, 2, 4];
        assert!(check_counts(&c, 2).is_ok());
        assert_eq!(dispatch_nvlink_bytes(&c, 2, 0, 8, 2), 80);
        assert_eq!(dispatch_nvlink_bytes(&c, 2, 1, 8, 2), 32);
        assert_eq!(combine_nvlink_bytes(&c, 2, 0, 8, 2), 32);
        assert_eq!(combine_nvlink_bytes(&c, 2, 1, 8, 2), 80);
        assert_eq!(logical_bytes(&c, 2, 0, 8, 2), 80);
        assert_eq!(logical_bytes(&c, 2, 1, 8, 2), 144);
        assert_eq!(alltoall_bytes(&c, 2, 0, 8, 2), 80);
        assert_eq!(alltoall_bytes(&c, 2, 1, 8, 2), 32);
    }

    #[test]
    fn three_ranks_by_hand() {
        // counts = [[1, 2, 3],
        //           [4, 5, 6],
        //           [7, 8, 9]]   hidden 16, 2 B -> 32 B per row.
        // dispatch: r0 2+3 = 5 rows -> 160; r1 4+6 = 10 -> 320; r2 7+8 = 15 -> 480
        // combine:  r0 4+7 = 11 -> 352;     r1 2+8 = 10 -> 320; r2 3+6 = 9 -> 288
        // logical:  r0 1+4+7 = 12 -> 384;   r1 2+5+8 = 15 -> 480; r2 3+6+9 = 18 -> 576
        let c = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let d: Vec<u64> = (0..3)
            .map(|r| dispatch_nvlink_bytes(&c, 3, r, 16, 2))
            .collect();
        let k: Vec<u64> = (0..3)
            .map(|r| combine_nvlink_bytes(&c, 3, r, 16, 2))
            .collect();
        let l: Vec<u64> = (0..3).map(|r| logical_bytes(&c, 3, r, 16, 2)).collect();
        assert_eq!(d, vec![160, 320, 480]);
        assert_eq!(k, vec![352, 320, 288]);
        assert_eq!(l, vec![384, 480, 576]);
        // Conservation: what everybody sends equals what everybody returns.
        assert_eq!(d.iter().sum::<u64>(), k.iter().sum::<u64>());
        // op_bytes maps ops to the right pattern.
        let ob = |op| op_bytes(op, &c, 3, 1, 16, 2);
        assert_eq!(
            ob(Op::Dispatch),
            OpBytes {
                nvlink: 320,
                logical: 480
            }
        );
        assert_eq!(
            ob(Op::CombineBwd),
            OpBytes {
                nvlink: 320,
                logical: 480
            }
        );
        assert_eq!(
            ob(Op::Combine),
            OpBytes {
                nvlink: 320,
                logical: 480
            }
        );
        assert_eq!(op_bytes(Op::Combine, &c, 3, 0, 16, 2).nvlink, 352);
        assert_eq!(op_bytes(Op::DispatchBwd, &c, 3, 0, 16, 2).nvlink, 352);
        assert_eq!(
            ob(Op::Layout),
            OpBytes {
                nvlink: 0,
                logical: 0
            }
        );
    }

    #[test]
    fn bad_input_does_not_panic() {
        assert!(check_counts(&[1, 2, 3], 2).is_err());
        assert!(check_counts(&[], 0).is_err());
        assert_eq!(dispatch_nvlink_bytes(&[1, 2, 3], 2, 0, 8, 2), 32);
        assert_eq!(dispatch_nvlink_bytes(&[1, 2, 3, 4], 2, 5, 8, 2), 0);
        assert_eq!(logical_bytes(&[], 4, 0, 8, 2), 0);
        assert_eq!(
            dispatch_nvlink_bytes(&[0, u32::MAX, 0, 0], 2, 0, usize::MAX, 2),
            u64::MAX
        );
    }

    #[test]
    fn count_row_dedups_per_rank() {
        // 8 experts over 2 ranks: 0..4 on rank 0, 4..8 on rank 1.
        // token 0 -> experts 0,1 (rank 0 twice), token 1 -> 3,4, token 2 -> 6,-1.
        let idx = [0, 1, 3, 4, 6, -1];
        assert_eq!(count_row(&idx, 2, 8, 2, true).unwrap(), vec![2, 2]);
        assert_eq!(count_row(&idx, 2, 8, 2, false).unwrap(), vec![3, 2]);
        assert!(count_row(&idx, 2, 8, 3, true).is_err());
        assert!(count_row(&idx, 4, 8, 2, true).is_err());
        assert!(count_row(&[9, 0], 2, 8, 2, true).is_err());
    }

    #[test]
    fn gbps_units() {
        // 1e9 B in 1e6 us (1 s) = 1 GB/s; 80 B in 0.5 us = 160e6 B/s = 0.16 GB/s.
        assert!((gbps(1_000_000_000, 1e6) - 1.0).abs() < 1e-12);
        assert!((gbps(80, 0.5) - 0.16).abs() < 1e-12);
        assert_eq!(gbps(100, 0.0), 0.0);
        assert_eq!(gbps(100, f64::NAN), 0.0);
        assert_eq!(gbps(100, -1.0), 0.0);
    }
}
