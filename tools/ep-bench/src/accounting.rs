//! Byte accounting for one routing: how many bytes each rank moves.
//!
//! Everything derives from the rank count matrix that every rank learns
//! during the layout step: `counts` is `R x R`, row-major, with
//! `counts[src * R + dst]` = tokens that rank `src` sends to rank `dst`.
//! A token counts once per destination *rank* (two of its top-k experts on
//! the same rank are one row on the wire); the diagonal entry is the tokens a
//! rank keeps locally.
//!
//! Only token payload rows are counted (`hidden * elem_bytes` bytes each):
//! top-k indices, weights, scales and other metadata are **not** included,
//! so GB/s figures are payload bandwidth.
//!
//! Two conventions are reported:
//! * **NVLink bytes** ([`Traffic::dispatch_nvlink`], [`Traffic::combine_nvlink`]):
//!   the rows that actually cross NVLink from this rank (self entry excluded).
//! * **Logical bytes** ([`Traffic::logical`]): DeepEP's convention for its "NVL"
//!   GB/s: every token row this rank receives in dispatch (and sends back in
//!   combine), the locally kept ones included.
//!
//! Malformed inputs (matrix of the wrong length, `rank >= R`) never panic:
//! missing entries count as 0, and products saturate.
//!
//! The fp8 dispatch (`dispatch-fp8`, [`fp8_row_bytes`]) is the exception:
//! its rows are the e4m3 codes (`hidden` bytes), their scales (`hidden /
//! 32` bytes, either kind) and the token's top-k f32 weights, all of it
//! counted, so that its GB/s and NCCL EP's fp8 dispatch's (the same bytes)
//! say what crossed.
//!
//! The low-latency ops ([`LlTraffic`]) count the same way, with their own
//! rows: dispatch sends a token to a rank once (bf16 rows of `2 * hidden`
//! bytes, fp8 rows of `hidden` bytes: the scales are metadata), combine
//! sends back one bf16 row per (token, rank) in rank-major and one per
//! (token, expert) in expert-major (the home weights and sums them), and
//! `ll-pair` moves the fp8 dispatch's bytes plus the combine's.

use crate::cli::Op;

/// NVLink and logical bytes of one op on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpBytes {
    /// Bytes (B) this rank pushes across NVLink.
    pub nvlink: u64,
    /// DeepEP-convention bytes (B), local rows included.
    pub logical: u64,
}

/// The rows of one routing and their size.
#[derive(Clone, Copy, Debug)]
pub struct Traffic<'a> {
    /// The `world x world` count matrix.
    counts: &'a [u32],
    /// Number of ranks.
    world: usize,
    /// Bytes of one payload row (`hidden * elem_bytes`, saturating).
    row: u64,
    /// Bytes of one `dispatch-fp8` row ([`fp8_row_bytes`]; top-k 0 until
    /// [`Traffic::with_topk`]).
    fp8_row: u64,
}

/// Bytes of one row of `dispatch-fp8` with rows of `hidden` values and
/// `topk` experts per token: `hidden` e4m3 codes, `hidden / 32` bytes of
/// scales (f32 per 128 values or e8m0 per 32: the same bytes) and the
/// token's `topk` f32 weights.
pub fn fp8_row_bytes(hidden: usize, topk: usize) -> u64 {
    let h = hidden as u64;
    h.saturating_add(h / 32)
        .saturating_add((topk as u64).saturating_mul(4))
}

impl<'a> Traffic<'a> {
    /// The traffic of `counts` (`world x world`) with rows of `hidden`
    /// elements of `elem_bytes` bytes.
    pub fn new(counts: &'a [u32], world: usize, hidden: usize, elem_bytes: usize) -> Self {
        let row = (hidden as u64).saturating_mul(elem_bytes as u64);
        Traffic {
            counts,
            world,
            row,
            fp8_row: fp8_row_bytes(hidden, 0),
        }
    }

    /// The same traffic whose `dispatch-fp8` rows carry `topk` f32 weights
    /// each ([`fp8_row_bytes`]).
    pub fn with_topk(self, hidden: usize, topk: usize) -> Self {
        Traffic {
            fp8_row: fp8_row_bytes(hidden, topk),
            ..self
        }
    }

    /// Entry `[src][dst]`, 0 when out of range.
    fn at(&self, src: usize, dst: usize) -> u64 {
        if src >= self.world || dst >= self.world {
            return 0;
        }
        (src.checked_mul(self.world))
            .and_then(|i| i.checked_add(dst))
            .and_then(|i| self.counts.get(i))
            .map_or(0, |&c| u64::from(c))
    }

    /// Bytes of the rows between `rank` and every rank `other` that `keep`
    /// accepts: `sent` rows go from `rank` to `other`, else from `other` to
    /// `rank`.
    fn bytes(&self, rank: usize, sent: bool, keep: impl Fn(usize) -> bool) -> u64 {
        let rows: u64 = (0..self.world)
            .filter(|&o| keep(o))
            .map(|o| {
                if sent {
                    self.at(rank, o)
                } else {
                    self.at(o, rank)
                }
            })
            .sum();
        rows.saturating_mul(self.row)
    }

    /// Bytes (B) that `rank` pushes across NVLink in dispatch:
    /// `sum over d != rank of counts[rank][d] * row`.
    pub fn dispatch_nvlink(&self, rank: usize) -> u64 {
        self.bytes(rank, true, |d| d != rank)
    }

    /// Bytes (B) that `rank` pushes back across NVLink in combine (the
    /// partial rows of tokens it received from other ranks):
    /// `sum over s != rank of counts[s][rank] * row`.
    pub fn combine_nvlink(&self, rank: usize) -> u64 {
        self.bytes(rank, false, |s| s != rank)
    }

    /// DeepEP-convention bytes (B) of `rank`: every token row it receives in
    /// dispatch, the locally kept ones included (`sum over all s of
    /// counts[s][rank] * row`); the same figure for combine (the rows sent
    /// back).
    pub fn logical(&self, rank: usize) -> u64 {
        self.bytes(rank, false, |_| true)
    }

    /// Bytes of one of our ops on `rank`: dispatch and combine-bwd move data
    /// like dispatch, combine and dispatch-bwd like combine; layout moves no
    /// payload (0 bytes); dispatch-fp8 moves dispatch's rows, each of
    /// [`fp8_row_bytes`].
    pub fn op(&self, op: Op, rank: usize) -> OpBytes {
        let nvlink = match op {
            Op::DispatchFp8 => {
                let fp8 = Traffic {
                    row: self.fp8_row,
                    ..*self
                };
                return OpBytes {
                    nvlink: fp8.dispatch_nvlink(rank),
                    logical: fp8.logical(rank),
                };
            }
            Op::Layout => {
                return OpBytes {
                    nvlink: 0,
                    logical: 0,
                }
            }
            Op::Dispatch | Op::CombineBwd | Op::LlDispatch | Op::LlDispatchFp8 | Op::LlPair => {
                self.dispatch_nvlink(rank)
            }
            Op::Combine | Op::CombinePush | Op::DispatchBwd | Op::LlCombine => {
                self.combine_nvlink(rank)
            }
        };
        OpBytes {
            nvlink,
            logical: self.logical(rank),
        }
    }
}

/// The bytes of the low-latency ops of one routing (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct LlTraffic<'a> {
    /// Dispatch's bf16 rows: one per (token, destination rank).
    bf16: Traffic<'a>,
    /// Dispatch's fp8 rows (codes only).
    fp8: Traffic<'a>,
    /// Combine's bf16 rows: per (token, rank) or per (token, expert).
    back: Traffic<'a>,
}

impl<'a> LlTraffic<'a> {
    /// `tokens` is the `world x world` token count matrix (as
    /// [`Traffic::new`]); `back` the matrix of combine's rows:
    /// `tokens` itself for rank-major, for expert-major the (token, expert)
    /// pairs `back[src * R + dst]` that `src` sends to `dst`'s experts
    /// ([`pair_counts`]). Rows of `hidden` elements.
    pub fn new(tokens: &'a [u32], back: &'a [u32], world: usize, hidden: usize) -> Self {
        LlTraffic {
            bf16: Traffic::new(tokens, world, hidden, 2),
            fp8: Traffic::new(tokens, world, hidden, 1),
            back: Traffic::new(back, world, hidden, 2),
        }
    }

    /// Bytes of a low-latency op on `rank` (a high-throughput op: as
    /// [`Traffic::op`] with bf16 rows).
    pub fn op(&self, op: Op, rank: usize) -> OpBytes {
        let dispatch = |t: &Traffic| OpBytes {
            nvlink: t.dispatch_nvlink(rank),
            logical: t.logical(rank),
        };
        let combine = OpBytes {
            nvlink: self.back.combine_nvlink(rank),
            logical: self.back.logical(rank),
        };
        match op {
            Op::LlDispatch => dispatch(&self.bf16),
            Op::LlDispatchFp8 => dispatch(&self.fp8),
            Op::LlCombine => combine,
            Op::LlPair => {
                let d = dispatch(&self.fp8);
                OpBytes {
                    nvlink: d.nvlink.saturating_add(combine.nvlink),
                    logical: d.logical.saturating_add(combine.logical),
                }
            }
            other => self.bf16.op(other, rank),
        }
    }
}

/// The `world x world` matrix of (token, expert) pairs, `[src * R + dst]`
/// = pairs that `src` routes to the experts of `dst`, from the
/// `world x experts` matrix `per_expert[src * E + e]` (the reference's
/// `Counts::expert`); experts `dst * E / R ..` live on `dst`.
pub fn pair_counts(per_expert: &[u32], world: usize, experts: usize) -> Vec<u32> {
    let local = experts.checked_div(world).unwrap_or(0).max(1);
    let mut out = vec![0u32; world * world];
    for src in 0..world {
        for e in 0..experts {
            let n = per_expert.get(src * experts + e).copied().unwrap_or(0);
            let dst = (e / local).min(world.saturating_sub(1));
            out[src * world + dst] = out[src * world + dst].saturating_add(n);
        }
    }
    out
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
        let t = Traffic::new(&[3, 5, 2, 4], 2, 8, 2);
        assert_eq!((t.dispatch_nvlink(0), t.dispatch_nvlink(1)), (80, 32));
        assert_eq!((t.combine_nvlink(0), t.combine_nvlink(1)), (32, 80));
        assert_eq!((t.logical(0), t.logical(1)), (80, 144));
    }

    #[test]
    fn three_ranks_by_hand() {
        // counts = [[1, 2, 3],
        //           [4, 5, 6],
        //           [7, 8, 9]]   hidden 16, 2 B -> 32 B per row.
        // dispatch: r0 2+3 = 5 rows -> 160; r1 4+6 = 10 -> 320; r2 7+8 = 15 -> 480
        // combine:  r0 4+7 = 11 -> 352;     r1 2+8 = 10 -> 320; r2 3+6 = 9 -> 288
        // logical:  r0 1+4+7 = 12 -> 384;   r1 2+5+8 = 15 -> 480; r2 3+6+9 = 18 -> 576
        let t = Traffic::new(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 16, 2);
        let d: Vec<u64> = (0..3).map(|r| t.dispatch_nvlink(r)).collect();
        let k: Vec<u64> = (0..3).map(|r| t.combine_nvlink(r)).collect();
        let l: Vec<u64> = (0..3).map(|r| t.logical(r)).collect();
        assert_eq!(d, vec![160, 320, 480]);
        assert_eq!(k, vec![352, 320, 288]);
        assert_eq!(l, vec![384, 480, 576]);
        // Conservation: what everybody sends equals what everybody returns.
        assert_eq!(d.iter().sum::<u64>(), k.iter().sum::<u64>());
        // op maps ops to the right pattern.
        let both = |nvlink, logical| OpBytes { nvlink, logical };
        assert_eq!(t.op(Op::Dispatch, 1), both(320, 480));
        assert_eq!(t.op(Op::CombineBwd, 1), both(320, 480));
        assert_eq!(t.op(Op::Combine, 1), both(320, 480));
        assert_eq!(t.op(Op::Combine, 0).nvlink, 352);
        assert_eq!(t.op(Op::DispatchBwd, 0).nvlink, 352);
        assert_eq!(t.op(Op::CombinePush, 2), both(288, 576));
        assert_eq!(t.op(Op::Layout, 1), both(0, 0));
    }

    #[test]
    fn fp8_dispatch_by_hand() {
        // counts = [[3, 5], [2, 4]]; hidden 128, top-8: 128 codes + 4 scale
        // bytes + 32 weight bytes = 164 B a row.
        assert_eq!(fp8_row_bytes(128, 8), 164);
        // hidden 7168, top-8: 7168 + 224 + 32.
        assert_eq!(fp8_row_bytes(7168, 8), 7424);
        let both = |nvlink, logical| OpBytes { nvlink, logical };
        let t = Traffic::new(&[3, 5, 2, 4], 2, 128, 2).with_topk(128, 8);
        assert_eq!(t.op(Op::DispatchFp8, 0), both(5 * 164, 5 * 164));
        assert_eq!(t.op(Op::DispatchFp8, 1), both(2 * 164, 9 * 164));
        // The bf16 ops keep their rows.
        assert_eq!(t.op(Op::Dispatch, 0), both(5 * 256, 5 * 256));
        // Without the top-k: codes and scales only.
        let t = Traffic::new(&[3, 5, 2, 4], 2, 128, 2);
        assert_eq!(t.op(Op::DispatchFp8, 0).nvlink, 5 * 132);
        assert_eq!(fp8_row_bytes(usize::MAX, usize::MAX), u64::MAX);
    }

    #[test]
    fn low_latency_by_hand() {
        // tokens = [[3, 5], [2, 4]] as above; hidden 8: bf16 rows 16 B, fp8 rows 8 B.
        // pairs (2 experts per rank): r0 -> e0 1, e1 2, e2 4, e3 3; r1 -> e0 2, e1 0, e2 3, e3 5.
        let per_expert = [1, 2, 4, 3, 2, 0, 3, 5];
        let pairs = pair_counts(&per_expert, 2, 4);
        assert_eq!(pairs, vec![3, 7, 2, 8]);
        let tokens = [3, 5, 2, 4];
        let both = |nvlink, logical| OpBytes { nvlink, logical };
        // Rank-major: combine rows as the tokens.
        let rm = LlTraffic::new(&tokens, &tokens, 2, 8);
        assert_eq!(rm.op(Op::LlDispatch, 0), both(80, 80));
        assert_eq!(rm.op(Op::LlDispatchFp8, 0), both(40, 40));
        assert_eq!(rm.op(Op::LlCombine, 0), both(32, 80));
        assert_eq!(rm.op(Op::LlPair, 1), both(16 + 80, 72 + 144));
        // Expert-major: combine sends one row per pair. r0 returns r1's 2
        // pairs (32 B) and holds 3 + 2 = 5 pairs (80 B); r1 returns 7 (112 B)
        // of 7 + 8 = 15 (240 B).
        let em = LlTraffic::new(&tokens, &pairs, 2, 8);
        assert_eq!(em.op(Op::LlCombine, 0), both(32, 80));
        assert_eq!(em.op(Op::LlCombine, 1), both(112, 240));
        assert_eq!(em.op(Op::LlDispatch, 1), rm.op(Op::LlDispatch, 1));
        // One rank: nothing crosses, every row is logical.
        let one = LlTraffic::new(&[6], &[9], 1, 8);
        assert_eq!(one.op(Op::LlDispatch, 0), both(0, 96));
        assert_eq!(one.op(Op::LlCombine, 0), both(0, 144));
        assert_eq!(pair_counts(&[1, 2, 3], 1, 3), vec![6]);
    }

    #[test]
    fn bad_input_does_not_panic() {
        assert_eq!(Traffic::new(&[1, 2, 3], 2, 8, 2).dispatch_nvlink(0), 32);
        assert_eq!(Traffic::new(&[1, 2, 3, 4], 2, 8, 2).dispatch_nvlink(5), 0);
        assert_eq!(Traffic::new(&[], 4, 8, 2).logical(0), 0);
        let huge = Traffic::new(&[0, u32::MAX, 0, 0], 2, usize::MAX, 2);
        assert_eq!(huge.dispatch_nvlink(0), u64::MAX);
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
