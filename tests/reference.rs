//! The CPU reference (`moe_ep::reference`) checked through its public API.
//!
//! * The worked example of the module docs, value by value, and the bf16
//!   rounding of each combine partial on a hand-made case.
//! * Properties over 300 seeded random cases (1 to 8 ranks, top-k 1 to 16,
//!   0 to 40 tokens per rank, uniform, skewed and masked routings, both
//!   receive layouts): layouts agree with `topk_idx`; dispatched rows agree
//!   with the count matrix's offsets and each routed (token, expert) pair
//!   and (token, rank) lands exactly once; combine of identity experts
//!   scales each token by the ranks (rank-major) or experts it reached, or
//!   by its weight sum (weighted expert-major); the
//!   emulated combine stays within `check_close_bf16`'s bound of the exact
//!   one, and that bound catches a swapped row; combine backward and
//!   dispatch backward match their formulas and are the adjoints of combine
//!   and dispatch.
//! * Validation: every bad shape, `topk_idx`, input and buffer length is
//!   refused with an error naming the argument (and token, slot or rank).
//!
//! The GPU tests (`tests/gpu_intranode.rs`) compare the kernels with these
//! functions; these tests check the functions themselves.

#![allow(clippy::needless_range_loop)] // index loops read better in these checks

use moe_ep::reference::*;
use moe_ep::testkit::workload::{self, Rng, Routing};
use moe_ep::{bf16, RecvLayout, Result};
use std::collections::HashMap;

const CASES: u64 = 300;

struct Case {
    shape: Shape,
    inputs: Vec<RankInput>,
    alignment: usize,
}

impl Case {
    fn layouts(&self) -> Vec<Layout> {
        let s = &self.shape;
        self.inputs
            .iter()
            .map(|i| layout(s, &i.topk_idx).unwrap())
            .collect()
    }
    fn recv_layouts(&self) -> [RecvLayout; 2] {
        [
            RecvLayout::RankMajor,
            RecvLayout::ExpertMajor {
                alignment: self.alignment,
            },
        ]
    }
    fn dispatch_all(&self, l: RecvLayout) -> Vec<DispatchOutput> {
        (0..self.shape.num_ranks)
            .map(|d| dispatch(&self.shape, &self.inputs, d, l).unwrap())
            .collect()
    }
}

/// A random case: R in {1,2,3,4,8}, K in {1,2,8,16}, E >= K, T in {0, 1,
/// 0..40}, alignment in {1,4,16,128}, any routing.
fn gen_case(seed: u64) -> Case {
    let mut rng = Rng::new(seed.wrapping_mul(0x1234_5678_9ABC_DEF1) ^ 0x5EED);
    let r = [1, 2, 3, 4, 8][rng.below(5)];
    let k: usize = [1, 2, 8, 16][rng.below(4)];
    let el = k.div_ceil(r) + rng.below(4);
    let hidden = 8 * (1 + rng.below(3));
    let alignment = [1, 4, 16, 128][rng.below(4)];
    let routing = Routing::for_case(seed, &mut rng);
    let tpr = workload::case_tokens_per_rank(&mut rng, r);
    let shape = Shape {
        num_ranks: r,
        num_experts: r * el,
        hidden,
        topk: k,
    };
    shape.validate().unwrap();
    let inputs = workload::rank_inputs(seed, &shape, &tpr, routing);
    Case {
        shape,
        inputs,
        alignment,
    }
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn dot(a: &[bf16], b: &[bf16]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a.to_f64() * b.to_f64()).sum()
}

fn abs_dot(a: &[bf16], b: &[bf16]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a.to_f64() * b.to_f64()).abs())
        .sum()
}

fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("expected an error").to_string()
}

// ---------------------------------------------------------------- example

fn example() -> (Shape, Vec<RankInput>) {
    let shape = Shape {
        num_ranks: 2,
        num_experts: 4,
        hidden: 8,
        topk: 2,
    };
    let mk = |idx: Vec<i64>| {
        let t = idx.len() / 2;
        RankInput {
            tokens: (0..t * 8).map(|i| bf16::from_f32(i as f32 + 1.0)).collect(),
            topk_weights: (0..t * 2).map(|i| 0.25 * (i as f32 + 1.0)).collect(),
            topk_idx: idx,
        }
    };
    let inputs = vec![mk(vec![0, 3, 1, -1, 2, 3]), mk(vec![3, 0, 2, -1])];
    (shape, inputs)
}

#[test]
fn worked_example_from_module_docs() {
    let (shape, inputs) = example();
    let l0 = layout(&shape, &inputs[0].topk_idx).unwrap();
    assert_eq!(l0.tokens_per_rank, vec![2, 2]);
    assert_eq!(l0.tokens_per_expert, vec![1, 1, 1, 2]);
    assert_eq!(l0.rank_pos, vec![0, 0, 1, -1, -1, 1]);
    assert_eq!(l0.expert_pos, vec![0, 0, 0, -1, 0, 1]);
    assert_eq!(
        l0.is_token_in_rank,
        vec![true, true, true, false, false, true]
    );
    let layouts: Vec<Layout> = inputs
        .iter()
        .map(|i| layout(&shape, &i.topk_idx).unwrap())
        .collect();
    let counts = gather_counts(&shape, &layouts);
    assert_eq!(counts.rank, vec![2, 2, 1, 2]);
    assert_eq!(counts.expert, vec![1, 1, 1, 2, 1, 0, 1, 1]);

    let rm = dispatch(&shape, &inputs, 1, RecvLayout::RankMajor).unwrap();
    assert_eq!(rm.num_rows, 4);
    assert_eq!(rm.offsets, vec![0, 2, 4]);
    assert_eq!(rm.src, vec![(0, 0), (0, 2), (1, 0), (1, 1)]);
    assert_eq!(rm.topk_local_idx, vec![-1, 1, 0, 1, 1, -1, 0, -1]);
    assert_eq!(
        rm.topk_weights,
        vec![0.0, 0.5, 1.25, 1.5, 0.25, 0.0, 0.75, 0.0]
    );
    assert_eq!(rm.tokens_per_local_expert, vec![2, 3]);
    assert_eq!(counts.rank_major_offset(1, 1), 2);

    let em = dispatch(&shape, &inputs, 1, RecvLayout::ExpertMajor { alignment: 4 }).unwrap();
    assert_eq!(em.num_rows, 8);
    assert_eq!(em.offsets, vec![0, 4, 8]);
    assert_eq!(
        em.src,
        vec![
            (0, 2),
            (1, 1),
            (-1, -1),
            (-1, -1),
            (0, 0),
            (0, 2),
            (1, 0),
            (-1, -1)
        ]
    );
    assert_eq!(em.topk_local_idx, vec![0, 0, -1, -1, 1, 1, 1, -1]);
    assert_eq!(
        em.topk_weights,
        vec![1.25, 0.75, 0.0, 0.0, 0.5, 1.5, 0.25, 0.0]
    );
    assert_eq!(em.tokens_per_local_expert, vec![2, 3]);
    assert_eq!(counts.expert_major_row(1, 1, 1, 4), 6);
    assert_eq!(counts.expert_major_rows(1, 4), 8);
    assert_eq!(counts.combine_slot_base(0, 1), 2);
    assert_eq!(counts.combine_slot_base(1, 1), 1);
    // Padding rows are +0.0.
    assert!(em.tokens[2 * 8..4 * 8].iter().all(|x| x.to_bits() == 0));
}

#[test]
fn emulated_combine_rounds_each_partial_to_bf16() {
    // One token on rank 0 with experts 0, 1 (on rank 0) and 2 (on rank 1).
    let shape = Shape {
        num_ranks: 2,
        num_experts: 4,
        hidden: 8,
        topk: 3,
    };
    let inputs = vec![
        RankInput {
            tokens: vec![bf16::ONE; 8],
            topk_idx: vec![0, 1, 2],
            topk_weights: vec![0.5, 0.25, 0.25],
        },
        RankInput {
            tokens: vec![],
            topk_idx: vec![],
            topk_weights: vec![],
        },
    ];
    let l = RecvLayout::ExpertMajor { alignment: 1 };
    let tiny = bf16::from_f32(1.0 / 256.0);
    // Rank 0 rows: (t0, expert 0) = 1.0, (t0, expert 1) = 2^-8; rank 1: 2^-8.
    let mut r0 = vec![bf16::ONE; 8];
    r0.extend(vec![tiny; 8]);
    let expert_out = vec![r0, vec![tiny; 8]];
    let exact = combine_f64(&shape, &inputs, &expert_out, 0, l, false).unwrap();
    assert!(exact.iter().all(|&x| x == 1.0 + 2.0 / 256.0));
    // 1 + 2^-8 rounds (ties to even) to 1.0 on rank 0; 1.0 + 2^-8 again at home.
    let emu = combine_emulated(&shape, &inputs, &expert_out, 0, l, false).unwrap();
    assert!(emu.iter().all(|&x| x == bf16::ONE), "{emu:?}");
    check_close_bf16(&emu, &exact, 2).unwrap();
    // Weighted: 0.5 * 1 + 0.25 * 2^-8 = 0.5009765625 -> bf16 0.5; + 2^-10 -> 0.5.
    let emu = combine_emulated(&shape, &inputs, &expert_out, 0, l, true).unwrap();
    assert!(emu.iter().all(|&x| x == bf16::from_f32(0.5)), "{emu:?}");
}

// ------------------------------------------------------------- properties

#[test]
fn prop_layout_is_consistent_with_topk() {
    for seed in 0..CASES {
        let c = gen_case(seed);
        let (r, k) = (c.shape.num_ranks, c.shape.topk);
        for (inp, l) in c.inputs.iter().zip(c.layouts()) {
            let t_count = inp.num_tokens(&c.shape);
            assert_eq!(l.num_tokens, t_count);
            let routed = inp.topk_idx.iter().filter(|&&e| e >= 0).count();
            assert_eq!(
                l.tokens_per_expert
                    .iter()
                    .map(|&c| c as usize)
                    .sum::<usize>(),
                routed
            );
            let mut next_rank = vec![0i32; r];
            let mut next_expert = vec![0i32; c.shape.num_experts];
            for t in 0..t_count {
                let idx = &inp.topk_idx[t * k..(t + 1) * k];
                for d in 0..r {
                    let sent = idx
                        .iter()
                        .any(|&e| e >= 0 && c.shape.rank_of_expert(e as usize) == d);
                    assert_eq!(l.is_token_in_rank[t * r + d], sent);
                    if sent {
                        assert_eq!(l.rank_pos[t * r + d], next_rank[d]);
                        next_rank[d] += 1;
                    } else {
                        assert_eq!(l.rank_pos[t * r + d], -1);
                    }
                }
                for (slot, &e) in idx.iter().enumerate() {
                    if e < 0 {
                        assert_eq!(l.expert_pos[t * k + slot], -1);
                    } else {
                        assert_eq!(l.expert_pos[t * k + slot], next_expert[e as usize]);
                        next_expert[e as usize] += 1;
                    }
                }
            }
            let tpr: Vec<u32> = next_rank.iter().map(|&n| n as u32).collect();
            assert_eq!(l.tokens_per_rank, tpr);
            let tpe: Vec<u32> = next_expert.iter().map(|&n| n as u32).collect();
            assert_eq!(l.tokens_per_expert, tpe);
        }
    }
}

#[test]
fn prop_dispatch_rows_agree_with_counts() {
    let mut padded_rows_seen = 0;
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        let (r, k, h, el, a) = (
            s.num_ranks,
            s.topk,
            s.hidden,
            s.experts_per_rank(),
            c.alignment,
        );
        let layouts = c.layouts();
        let counts = gather_counts(s, &layouts);
        let mut seen_pair: HashMap<(usize, usize, usize), usize> = HashMap::new();
        let mut seen_rank: HashMap<(usize, usize, usize), usize> = HashMap::new();
        for d in 0..r {
            let is_local = |e: i64| e >= 0 && s.rank_of_expert(e as usize) == d;

            // Rank-major.
            let rm = dispatch(s, &c.inputs, d, RecvLayout::RankMajor).unwrap();
            let rows = rm.num_rows;
            assert_eq!(rows, counts.rank_major_rows(d));
            let offs: Vec<usize> = (0..=r)
                .map(|src| counts.rank_major_offset(src, d))
                .collect();
            assert_eq!(rm.offsets, offs);
            assert_eq!(rm.tokens.len(), rows * h);
            assert_eq!(rm.topk_weights.len(), rows * k);
            assert_eq!(rm.topk_local_idx.len(), rows * k);
            assert_eq!(rm.src.len(), rows);
            let mut tple = vec![0u32; el];
            for row in 0..rows {
                let (src, t) = (rm.src[row].0 as usize, rm.src[row].1 as usize);
                let inp = &c.inputs[src];
                assert!(rm.offsets[src] <= row && row < rm.offsets[src + 1]);
                assert_eq!(
                    row,
                    counts.rank_major_offset(src, d) + layouts[src].rank_pos[t * r + d] as usize
                );
                assert_eq!(
                    bits(&rm.tokens[row * h..(row + 1) * h]),
                    bits(&inp.tokens[t * h..(t + 1) * h])
                );
                for slot in 0..k {
                    let e = inp.topk_idx[t * k + slot];
                    let (w, li) = (
                        rm.topk_weights[row * k + slot],
                        rm.topk_local_idx[row * k + slot],
                    );
                    if is_local(e) {
                        assert_eq!(w, inp.topk_weights[t * k + slot]);
                        assert_eq!(li as i64, e - (d * el) as i64);
                        tple[li as usize] += 1;
                    } else {
                        assert_eq!((w, li), (0.0, -1));
                    }
                }
                *seen_rank.entry((src, t, d)).or_default() += 1;
            }
            assert_eq!(rm.tokens_per_local_expert, tple);

            // Expert-major.
            let em = dispatch(s, &c.inputs, d, RecvLayout::ExpertMajor { alignment: a }).unwrap();
            let rows = em.num_rows;
            assert_eq!(rows, counts.expert_major_rows(d, a));
            let offs: Vec<usize> = (0..=el)
                .map(|j| counts.expert_block_start(d, j, a))
                .collect();
            assert_eq!(em.offsets, offs);
            assert_eq!(em.tokens.len(), rows * h);
            assert_eq!(em.topk_weights.len(), rows);
            assert_eq!(em.topk_local_idx.len(), rows);
            assert_eq!(em.src.len(), rows);
            assert_eq!(em.tokens_per_local_expert, rm.tokens_per_local_expert);
            for j in 0..el {
                let n = counts.recv_expert_count(d, j);
                assert_eq!(em.tokens_per_local_expert[j] as usize, n);
                let (start, end) = (em.offsets[j], em.offsets[j + 1]);
                assert_eq!(end - start, n.div_ceil(a) * a);
                for row in start..end {
                    if row >= start + n {
                        padded_rows_seen += 1;
                        assert_eq!(em.src[row], (-1, -1));
                        assert_eq!(em.topk_local_idx[row], -1);
                        assert_eq!(em.topk_weights[row].to_bits(), 0);
                        assert!(em.tokens[row * h..(row + 1) * h]
                            .iter()
                            .all(|x| x.to_bits() == 0));
                        continue;
                    }
                    let (src, t) = (em.src[row].0 as usize, em.src[row].1 as usize);
                    let inp = &c.inputs[src];
                    assert_eq!(em.topk_local_idx[row], j as i32);
                    let e = (d * el + j) as i64;
                    let slot = inp.topk_idx[t * k..(t + 1) * k]
                        .iter()
                        .position(|&x| x == e)
                        .expect("row's expert is in the token's top-k");
                    assert_eq!(em.topk_weights[row], inp.topk_weights[t * k + slot]);
                    assert_eq!(
                        row,
                        counts.expert_major_row(src, d, j, a)
                            + layouts[src].expert_pos[t * k + slot] as usize
                    );
                    assert_eq!(
                        bits(&em.tokens[row * h..(row + 1) * h]),
                        bits(&inp.tokens[t * h..(t + 1) * h])
                    );
                    *seen_pair.entry((src, t, slot)).or_default() += 1;
                }
            }
        }
        // Every routed pair exactly once across ranks (expert-major), every
        // (token, rank) exactly once (rank-major), nothing else.
        let mut routed = 0;
        let mut sent = 0;
        for (src, inp) in c.inputs.iter().enumerate() {
            for t in 0..inp.num_tokens(s) {
                for slot in 0..k {
                    if inp.topk_idx[t * k + slot] >= 0 {
                        routed += 1;
                        assert_eq!(seen_pair.get(&(src, t, slot)), Some(&1));
                    }
                }
                for d in 0..r {
                    if layouts[src].is_token_in_rank[t * r + d] {
                        sent += 1;
                        assert_eq!(seen_rank.get(&(src, t, d)), Some(&1));
                    }
                }
            }
        }
        assert_eq!(seen_pair.len(), routed);
        assert_eq!(seen_rank.len(), sent);
        assert_eq!(
            counts.expert.iter().map(|&c| c as usize).sum::<usize>(),
            routed
        );
        assert_eq!(counts.rank.iter().map(|&c| c as usize).sum::<usize>(), sent);
        // Combine slots on each home rank tile [0, tokens sent).
        for home in 0..r {
            let mut base = 0;
            for from in 0..r {
                assert_eq!(counts.combine_slot_base(home, from), base);
                base += counts.rank[home * r + from] as usize;
            }
        }
    }
    assert!(padded_rows_seen > 0);
}

#[test]
fn prop_combine_of_identity_expert() {
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        let (r, k, h) = (s.num_ranks, s.topk, s.hidden);
        for l in c.recv_layouts() {
            let expert_out: Vec<Vec<bf16>> =
                c.dispatch_all(l).into_iter().map(|o| o.tokens).collect();
            for home in 0..r {
                let inp = &c.inputs[home];
                for weighted in [false, true] {
                    if weighted && l == RecvLayout::RankMajor {
                        let msg = err_text(combine_f64(s, &c.inputs, &expert_out, home, l, true));
                        assert!(msg.contains("`weights`"), "{msg}");
                        let msg =
                            err_text(combine_emulated(s, &c.inputs, &expert_out, home, l, true));
                        assert!(msg.contains("`weights`"), "{msg}");
                        continue;
                    }
                    let exact = combine_f64(s, &c.inputs, &expert_out, home, l, weighted).unwrap();
                    let emu =
                        combine_emulated(s, &c.inputs, &expert_out, home, l, weighted).unwrap();
                    let mut want = Vec::with_capacity(exact.len());
                    for t in 0..inp.num_tokens(s) {
                        let idx = &inp.topk_idx[t * k..(t + 1) * k];
                        let factor: f64 = match (l, weighted) {
                            (RecvLayout::RankMajor, _) => {
                                let mut ranks: Vec<usize> = idx
                                    .iter()
                                    .filter(|&&e| e >= 0)
                                    .map(|&e| s.rank_of_expert(e as usize))
                                    .collect();
                                ranks.sort();
                                ranks.dedup();
                                ranks.len() as f64
                            }
                            (_, false) => idx.iter().filter(|&&e| e >= 0).count() as f64,
                            (_, true) => idx
                                .iter()
                                .zip(&inp.topk_weights[t * k..(t + 1) * k])
                                .filter(|(&e, _)| e >= 0)
                                .map(|(_, &w)| w as f64)
                                .sum(),
                        };
                        want.extend(
                            inp.tokens[t * h..(t + 1) * h]
                                .iter()
                                .map(|x| x.to_f64() * factor),
                        );
                    }
                    for (i, (&x, &w)) in exact.iter().zip(&want).enumerate() {
                        assert!(
                            (x - w).abs() <= 1e-12 * w.abs().max(1.0),
                            "seed {seed} i {i}: {x} vs {w}"
                        );
                    }
                    check_close_bf16(&emu, &exact, r).unwrap();
                    check_close_bf16(&emu, &want, r).unwrap();
                }
            }
        }
    }
}

/// Emulated vs exact combine on random (cancelling) expert outputs.
#[test]
fn prop_emulated_combine_within_tolerance_of_exact() {
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        let mut rng = Rng::new(seed ^ 0xE0E0);
        for l in c.recv_layouts() {
            let expert_out: Vec<Vec<bf16>> = c
                .dispatch_all(l)
                .iter()
                .map(|o| workload::tokens(&mut rng, o.num_rows, s.hidden))
                .collect();
            for home in 0..s.num_ranks {
                for weighted in [false, true] {
                    if weighted && l == RecvLayout::RankMajor {
                        continue;
                    }
                    let exact = combine_f64(s, &c.inputs, &expert_out, home, l, weighted).unwrap();
                    let emu =
                        combine_emulated(s, &c.inputs, &expert_out, home, l, weighted).unwrap();
                    check_close_bf16(&emu, &exact, s.num_ranks)
                        .unwrap_or_else(|e| panic!("seed {seed} {l:?} home {home}: {e}"));
                }
            }
        }
    }
}

#[test]
fn prop_check_close_catches_a_swapped_row() {
    let mut swaps = 0;
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        let h = s.hidden;
        for l in c.recv_layouts() {
            let outs = c.dispatch_all(l);
            let expert_out: Vec<Vec<bf16>> = outs.iter().map(|o| o.tokens.clone()).collect();
            // On each rank, swap its heaviest row with another token's row (the most
            // different one, so that the swap is visible at bf16 precision).
            for (d, o) in outs.iter().enumerate() {
                let real: Vec<usize> = (0..o.num_rows).filter(|&i| o.src[i].0 >= 0).collect();
                let Some(&a) = real.iter().max_by(|&&i, &&j| {
                    o.topk_weights[i * o.topk_weights.len() / o.num_rows]
                        .total_cmp(&o.topk_weights[j * o.topk_weights.len() / o.num_rows])
                }) else {
                    continue;
                };
                // The other token's row that differs most from row a.
                let xa = &o.tokens[a * h..(a + 1) * h];
                let max_diff = |i: usize| {
                    o.tokens[i * h..(i + 1) * h]
                        .iter()
                        .zip(xa)
                        .fold(0.0f32, |m, (x, y)| m.max((x.to_f32() - y.to_f32()).abs()))
                };
                let Some(&b) = real
                    .iter()
                    .filter(|&&i| o.src[i] != o.src[a])
                    .max_by(|&&i, &&j| max_diff(i).total_cmp(&max_diff(j)))
                else {
                    continue;
                };
                let mut swapped = expert_out.clone();
                for i in 0..h {
                    swapped[d].swap(a * h + i, b * h + i);
                }
                let home = o.src[a].0 as usize;
                for weighted in [false, true] {
                    if weighted && l == RecvLayout::RankMajor {
                        continue;
                    }
                    let exact = combine_f64(s, &c.inputs, &expert_out, home, l, weighted).unwrap();
                    let good =
                        combine_emulated(s, &c.inputs, &expert_out, home, l, weighted).unwrap();
                    let bad = combine_emulated(s, &c.inputs, &swapped, home, l, weighted).unwrap();
                    check_close_bf16(&good, &exact, s.num_ranks).unwrap();
                    let err = check_close_bf16(&bad, &exact, s.num_ranks).expect_err(&format!(
                        "seed {seed} {l:?} weighted {weighted}: swap not caught"
                    ));
                    assert!(err.starts_with("index "), "{err}");
                    swaps += 1;
                }
            }
        }
    }
    assert!(swaps > 100, "only {swaps} swaps tried");
}

#[test]
fn prop_combine_backward_matches_formula_and_adjoint() {
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        let (r, h) = (s.num_ranks, s.hidden);
        let mut rng = Rng::new(seed ^ 0xBACC);
        let grad_out: Vec<Vec<bf16>> = c
            .inputs
            .iter()
            .map(|i| workload::tokens(&mut rng, i.num_tokens(s), h))
            .collect();
        for l in c.recv_layouts() {
            let outs = c.dispatch_all(l);
            let expert_out: Vec<Vec<bf16>> = outs
                .iter()
                .map(|o| workload::tokens(&mut rng, o.num_rows, h))
                .collect();
            for weighted in [false, true] {
                if weighted && l == RecvLayout::RankMajor {
                    let msg = err_text(combine_backward(s, &c.inputs, &grad_out, 0, l, true));
                    assert!(msg.contains("`weights`"), "{msg}");
                    continue;
                }
                // <expert_out, grad_expert_out> summed over ranks ...
                let (mut lhs, mut mag) = (0.0f64, 0.0f64);
                for (d, o) in outs.iter().enumerate() {
                    let g = combine_backward(s, &c.inputs, &grad_out, d, l, weighted).unwrap();
                    assert_eq!(g.len(), o.num_rows * h);
                    for row in 0..o.num_rows {
                        let got = &g[row * h..(row + 1) * h];
                        let (src, t) = o.src[row];
                        if src < 0 {
                            assert!(got.iter().all(|x| x.to_bits() == 0));
                            continue;
                        }
                        let go = &grad_out[src as usize][t as usize * h..(t as usize + 1) * h];
                        let want: Vec<bf16> = if weighted {
                            let w = o.topk_weights[row];
                            go.iter().map(|x| bf16::from_f32(w * x.to_f32())).collect()
                        } else {
                            go.to_vec()
                        };
                        assert_eq!(bits(got), bits(&want));
                    }
                    lhs += dot(&expert_out[d], &g);
                    mag += abs_dot(&expert_out[d], &g);
                }
                // ... equals <combine(expert_out), grad_out> summed over homes.
                let mut rhs = 0.0f64;
                for home in 0..r {
                    let y = combine_f64(s, &c.inputs, &expert_out, home, l, weighted).unwrap();
                    rhs += y
                        .iter()
                        .zip(&grad_out[home])
                        .map(|(y, g)| y * g.to_f64())
                        .sum::<f64>();
                }
                // Unweighted: exact products, f64 summation only. Weighted: one
                // bf16 rounding of w * g per element.
                let tol = if weighted { mag / 256.0 } else { mag * 1e-12 } + 1e-12;
                assert!(
                    (lhs - rhs).abs() <= tol,
                    "seed {seed} {l:?}: {lhs} vs {rhs}"
                );
            }
        }
    }
}

#[test]
fn prop_dispatch_backward_routes_gradients_back() {
    let enc = |d: usize, row: usize, slot: usize| ((d * 20_000 + row) * 17 + slot + 1) as f32;
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        let (r, k, h, el, a) = (
            s.num_ranks,
            s.topk,
            s.hidden,
            s.experts_per_rank(),
            c.alignment,
        );
        let layouts = c.layouts();
        let counts = gather_counts(s, &layouts);
        let mut rng = Rng::new(seed ^ 0xD15B);
        for l in c.recv_layouts() {
            let outs = c.dispatch_all(l);
            let grad_recv: Vec<Vec<bf16>> = outs
                .iter()
                .map(|o| workload::tokens(&mut rng, o.num_rows, h))
                .collect();
            let grad_recv_w: Vec<Vec<f32>> = outs
                .iter()
                .enumerate()
                .map(|(d, o)| match l {
                    RecvLayout::RankMajor => {
                        (0..o.num_rows * k).map(|i| enc(d, i / k, i % k)).collect()
                    }
                    RecvLayout::ExpertMajor { .. } => {
                        (0..o.num_rows).map(|row| enc(d, row, 0)).collect()
                    }
                })
                .collect();
            let mut lhs = 0.0;
            for (d, o) in outs.iter().enumerate() {
                lhs += dot(&o.tokens, &grad_recv[d]);
            }
            let mut rhs = 0.0;
            for home in 0..r {
                let inp = &c.inputs[home];
                let (gt, gw) =
                    dispatch_backward(s, &c.inputs, &grad_recv, &grad_recv_w, home, l).unwrap();
                let emu = combine_emulated(s, &c.inputs, &grad_recv, home, l, false).unwrap();
                assert_eq!(bits(&gt), bits(&emu));
                let exact = combine_f64(s, &c.inputs, &grad_recv, home, l, false).unwrap();
                check_close_bf16(&gt, &exact, r).unwrap();
                rhs += exact
                    .iter()
                    .zip(&inp.tokens)
                    .map(|(g, x)| g * x.to_f64())
                    .sum::<f64>();
                assert_eq!(gw.len(), inp.topk_idx.len());
                for t in 0..inp.num_tokens(s) {
                    for slot in 0..k {
                        let e = inp.topk_idx[t * k + slot];
                        let want = if e < 0 {
                            0.0
                        } else {
                            let e = e as usize;
                            let d = s.rank_of_expert(e);
                            match l {
                                RecvLayout::RankMajor => enc(
                                    d,
                                    counts.rank_major_offset(home, d)
                                        + layouts[home].rank_pos[t * r + d] as usize,
                                    slot,
                                ),
                                RecvLayout::ExpertMajor { .. } => enc(
                                    d,
                                    counts.expert_major_row(home, d, e - d * el, a)
                                        + layouts[home].expert_pos[t * k + slot] as usize,
                                    0,
                                ),
                            }
                        };
                        assert_eq!(
                            gw[t * k + slot],
                            want,
                            "seed {seed} {l:?} t {t} slot {slot}"
                        );
                    }
                }
            }
            // Adjoint: <dispatch(x), g> = <x, dispatch^T(g)>.
            assert!(
                (lhs - rhs).abs() <= 1e-9 * (1.0 + lhs.abs()),
                "{lhs} vs {rhs}"
            );
        }
    }
}

// ------------------------------------------------------------- validation

fn small() -> (Shape, Vec<RankInput>) {
    let shape = Shape {
        num_ranks: 2,
        num_experts: 8,
        hidden: 16,
        topk: 2,
    };
    let inputs = workload::rank_inputs(7, &shape, &[3, 2], Routing::Uniform);
    (shape, inputs)
}

#[test]
fn shape_validation_names_the_field() {
    let ok = Shape {
        num_ranks: 2,
        num_experts: 8,
        hidden: 16,
        topk: 2,
    };
    ok.validate().unwrap();
    assert_eq!(ok.experts_per_rank(), 4);
    assert_eq!(ok.rank_of_expert(3), 0);
    assert_eq!(ok.rank_of_expert(4), 1);
    let cases = [
        (Shape { num_ranks: 0, ..ok }, "`num_ranks`"),
        (
            Shape {
                num_experts: 7,
                ..ok
            },
            "`num_experts`",
        ),
        (
            Shape {
                num_experts: 0,
                ..ok
            },
            "`num_experts`",
        ),
        (Shape { hidden: 12, ..ok }, "`hidden`"),
        (Shape { hidden: 0, ..ok }, "`hidden`"),
        (
            Shape {
                topk: 17,
                num_experts: 32,
                ..ok
            },
            "`topk`",
        ),
        (Shape { topk: 0, ..ok }, "`topk`"),
        (Shape { topk: 9, ..ok }, "`topk`"),
    ];
    for (shape, name) in cases {
        let msg = err_text(shape.validate());
        assert!(msg.contains(name), "{shape:?}: {msg}");
        // Everything that takes a shape validates it.
        let msg = err_text(validate_topk(&shape, &[]));
        assert!(msg.contains(name), "{msg}");
    }
    // 16 is allowed.
    Shape {
        topk: 16,
        num_experts: 32,
        ..ok
    }
    .validate()
    .unwrap();
    let msg = err_text(
        Shape {
            num_experts: 12,
            num_ranks: 8,
            ..ok
        }
        .validate(),
    );
    assert!(msg.contains("multiple of num_ranks"), "{msg}");
}

#[test]
fn topk_validation_names_token_and_slot() {
    let (shape, _) = small();
    validate_topk(&shape, &[0, 7, -1, -1, 3, 5]).unwrap();
    let msg = err_text(validate_topk(&shape, &[0, 1, 8, 2]));
    assert!(
        msg.contains("`topk_idx`") && msg.contains("8 at token 1, slot 0"),
        "{msg}"
    );
    let msg = err_text(validate_topk(&shape, &[0, 1, 2, -2]));
    assert!(
        msg.contains("`topk_idx`") && msg.contains("-2 at token 1, slot 1"),
        "{msg}"
    );
    let msg = err_text(validate_topk(&shape, &[4, 4]));
    assert!(
        msg.contains("`topk_idx`") && msg.contains("repeated at token 0"),
        "{msg}"
    );
    let msg = err_text(validate_topk(&shape, &[0, 1, 2]));
    assert!(
        msg.contains("`topk_idx`") && msg.contains("multiple of topk"),
        "{msg}"
    );
    let msg = err_text(layout(&shape, &[3, 3]));
    assert!(msg.contains("`topk_idx`"), "{msg}");
}

#[test]
fn dispatch_validation_names_the_argument() {
    let (shape, inputs) = small();
    let rm = RecvLayout::RankMajor;
    let check = |inputs: &[RankInput], l: RecvLayout, name: &str| {
        let msg = err_text(dispatch(&shape, inputs, 0, l));
        assert!(msg.contains(name), "{name}: {msg}");
    };
    let mut bad = inputs.clone();
    bad[1].tokens.pop();
    check(&bad, rm, "`tokens`");
    let mut bad = inputs.clone();
    bad[0].topk_weights.push(0.5);
    check(&bad, rm, "`topk_weights`");
    let mut bad = inputs.clone();
    bad[0].topk_idx.push(0);
    check(&bad, rm, "`topk_idx`");
    let mut bad = inputs.clone();
    bad[1].topk_idx[3] = 8;
    let msg = err_text(dispatch(&shape, &bad, 0, rm));
    assert!(
        msg.contains("`topk_idx`") && msg.contains("rank 1"),
        "{msg}"
    );
    bad[1].topk_idx[3] = bad[1].topk_idx[2];
    check(&bad, rm, "repeated");
    check(&inputs[..1], rm, "`inputs`");
    check(
        &inputs,
        RecvLayout::ExpertMajor { alignment: 0 },
        "`alignment`",
    );
    let msg = err_text(dispatch(&shape, &inputs, 2, rm));
    assert!(msg.contains("`dst`"), "{msg}");
    let bad_shape = Shape {
        hidden: 12,
        ..shape
    };
    let msg = err_text(dispatch(&bad_shape, &inputs, 0, rm));
    assert!(msg.contains("`hidden`"), "{msg}");
}

#[test]
fn combine_validation_names_the_argument() {
    let (shape, inputs) = small();
    let em = RecvLayout::ExpertMajor { alignment: 4 };
    let outs: Vec<DispatchOutput> = (0..2)
        .map(|d| dispatch(&shape, &inputs, d, em).unwrap())
        .collect();
    let x: Vec<Vec<bf16>> = outs.iter().map(|o| o.tokens.clone()).collect();
    let w: Vec<Vec<f32>> = outs.iter().map(|o| o.topk_weights.clone()).collect();
    combine_f64(&shape, &inputs, &x, 1, em, true).unwrap();
    dispatch_backward(&shape, &inputs, &x, &w, 1, em).unwrap();

    let mut short = x.clone();
    let n = short[1].len() - 8;
    short[1].truncate(n);
    let msg = err_text(combine_f64(&shape, &inputs, &short, 0, em, true));
    assert!(
        msg.contains("`expert_out`") && msg.contains("rank 1"),
        "{msg}"
    );
    let msg = err_text(combine_emulated(&shape, &inputs, &x[..1], 0, em, false));
    assert!(msg.contains("`expert_out`"), "{msg}");
    let msg = err_text(combine_emulated(&shape, &inputs, &x, 2, em, false));
    assert!(msg.contains("`home`"), "{msg}");
    let msg = err_text(dispatch_backward(&shape, &inputs, &short, &w, 0, em));
    assert!(msg.contains("`grad_recv`"), "{msg}");
    let msg = err_text(dispatch_backward(&shape, &inputs, &x, &w[..1], 0, em));
    assert!(msg.contains("`grad_recv_w`"), "{msg}");
    // Rank-major weights are [rows * K].
    let rm = RecvLayout::RankMajor;
    let xr: Vec<Vec<bf16>> = (0..2)
        .map(|d| dispatch(&shape, &inputs, d, rm).unwrap().tokens)
        .collect();
    let msg = err_text(dispatch_backward(&shape, &inputs, &xr, &w, 0, rm));
    assert!(msg.contains("`grad_recv_w`"), "{msg}");
    let msg = err_text(combine_f64(&shape, &inputs, &xr, 0, rm, true));
    assert!(msg.contains("`weights`"), "{msg}");

    let g: Vec<Vec<bf16>> = inputs.iter().map(|i| i.tokens.clone()).collect();
    combine_backward(&shape, &inputs, &g, 0, em, true).unwrap();
    let msg = err_text(combine_backward(&shape, &inputs, &g[..1], 0, em, true));
    assert!(msg.contains("`grad_out`"), "{msg}");
    let mut gs = g.clone();
    gs[0].pop();
    let msg = err_text(combine_backward(&shape, &inputs, &gs, 0, em, false));
    assert!(msg.contains("`grad_out`"), "{msg}");
    let msg = err_text(combine_backward(&shape, &inputs, &g, 5, em, false));
    assert!(msg.contains("`dst`"), "{msg}");
    let msg = err_text(combine_backward(
        &shape,
        &inputs,
        &g,
        0,
        RecvLayout::ExpertMajor { alignment: 0 },
        false,
    ));
    assert!(msg.contains("`alignment`"), "{msg}");
}

#[test]
fn check_close_reports_the_first_bad_index() {
    let got: Vec<bf16> = [1.0f32, 2.0, 3.0]
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    check_close_bf16(&got, &[1.0, 2.0, 3.0], 1).unwrap();
    check_close_bf16(&got, &[1.001, 2.01, 3.0], 1).unwrap();
    let err = check_close_bf16(&got, &[1.0, 2.5, 3.5], 1).unwrap_err();
    assert!(err.starts_with("index 1:"), "{err}");
    assert!(check_close_bf16(&got, &[1.0, 2.0], 1)
        .unwrap_err()
        .contains("length"));
    let nan = [bf16::NAN, bf16::ONE, bf16::ONE];
    assert!(check_close_bf16(&nan, &[1.0, 1.0, 1.0], 1)
        .unwrap_err()
        .starts_with("index 0"));
    check_close_bf16(&[], &[], 0).unwrap();
}

/// `dispatch_rows` moves any payload as `dispatch` moves the tokens: the
/// tokens' own bits as u16 rows give the dispatched tokens' bits, and fp8
/// scale rows (u8 at `H / 32`, f32 at `H / 128`) follow their rows, zero on
/// padding.
#[test]
fn prop_dispatch_rows_move_any_payload_with_its_rows() {
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        let h = s.hidden;
        let as_u16: Vec<Vec<u16>> = c.inputs.iter().map(|i| bits(&i.tokens)).collect();
        // A scale row per token: its first value's bits, then a counter.
        let scales: Vec<Vec<u8>> = c
            .inputs
            .iter()
            .enumerate()
            .map(|(r, i)| {
                let t = i.num_tokens(s);
                (0..t * 3).map(|j| (r * 31 + j * 7 + 1) as u8).collect()
            })
            .collect();
        for layout in [
            RecvLayout::RankMajor,
            RecvLayout::ExpertMajor {
                alignment: c.alignment,
            },
        ] {
            for dst in 0..s.num_ranks {
                let want = dispatch(s, &c.inputs, dst, layout).unwrap();
                let got = dispatch_rows(s, &c.inputs, &as_u16, h, dst, layout).unwrap();
                assert_eq!(got, bits(&want.tokens), "seed {seed} dst {dst} {layout:?}");
                let sc = dispatch_rows(s, &c.inputs, &scales, 3, dst, layout).unwrap();
                assert_eq!(sc.len(), want.num_rows * 3);
                for (row, src) in want.src.iter().enumerate() {
                    let got_row = &sc[row * 3..row * 3 + 3];
                    if src.0 < 0 {
                        assert_eq!(got_row, &[0, 0, 0], "padding row {row}");
                    } else {
                        let t = src.1 as usize;
                        assert_eq!(got_row, &scales[src.0 as usize][t * 3..t * 3 + 3]);
                    }
                }
            }
        }
    }
    let c = gen_case(1);
    let e = dispatch_rows(
        &c.shape,
        &c.inputs,
        &[vec![0u8; 1]],
        1,
        0,
        RecvLayout::RankMajor,
    );
    assert!(err_text(e).contains("rows"));
}

/// The drop policy: below capacity nothing is dropped; above it, every
/// rank's kept rows fit its capacity exactly (rank-major) or in padded
/// blocks (expert-major), the kept routing is the input's with exactly the
/// dropped slots cleared, and the counts and masks agree.
#[test]
fn prop_drop_keeps_what_fits_and_reports_the_rest() {
    for seed in 0..CASES {
        let c = gen_case(seed);
        let s = &c.shape;
        for layout in [
            RecvLayout::RankMajor,
            RecvLayout::ExpertMajor {
                alignment: c.alignment,
            },
        ] {
            let rows =
                |inputs: &[RankInput], d: usize| dispatch(s, inputs, d, layout).unwrap().num_rows;
            let most = (0..s.num_ranks)
                .map(|d| rows(&c.inputs, d))
                .max()
                .unwrap_or(0);
            // Everything fits: nothing dropped.
            let all = drop_over_capacity(s, &c.inputs, layout, most).unwrap();
            assert!(all.dropped_rows.iter().all(|&n| n == 0), "seed {seed}");
            for (a, b) in all.kept.iter().zip(&c.inputs) {
                assert_eq!(a.topk_idx, b.topk_idx);
            }
            // Half of it.
            let cap = most / 2;
            let dr = drop_over_capacity(s, &c.inputs, layout, cap).unwrap();
            for d in 0..s.num_ranks {
                let before = rows(&c.inputs, d);
                let after = rows(&dr.kept, d);
                assert!(
                    after <= cap,
                    "seed {seed} {layout:?} rank {d}: {after} > {cap}"
                );
                if before > cap {
                    if layout == RecvLayout::RankMajor {
                        assert_eq!(after, cap, "seed {seed}: rank-major keeps exactly cap");
                    }
                    assert!(dr.dropped_rows[d] > 0);
                } else {
                    assert_eq!(dr.dropped_rows[d], 0);
                }
            }
            let mut dropped_slots = 0;
            for (r, (kept, inp)) in dr.kept.iter().zip(&c.inputs).enumerate() {
                for (i, (&a, &b)) in kept.topk_idx.iter().zip(&inp.topk_idx).enumerate() {
                    let gone = dr.dropped_slots[r][i];
                    assert_eq!(
                        a,
                        if gone { -1 } else { b },
                        "seed {seed} rank {r} slot {i}"
                    );
                    assert!(!gone || b >= 0);
                    dropped_slots += gone as usize;
                }
            }
            if let RecvLayout::ExpertMajor { .. } = layout {
                assert_eq!(
                    dropped_slots,
                    dr.dropped_rows.iter().sum::<usize>(),
                    "seed {seed}"
                );
            }
        }
    }
}

/// The drop order on a hand-made case: 2 ranks, rank-major, capacity 3 on
/// rank 0, which both ranks send 4 tokens: water level 1, one extra row
/// for the lowest rank, so rank 0 keeps its first 2 and rank 1 its first 1.
#[test]
fn drop_order_by_hand() {
    let shape = Shape {
        num_ranks: 2,
        num_experts: 2,
        hidden: 8,
        topk: 1,
    };
    let inp = |n: usize| RankInput {
        tokens: vec![bf16::ZERO; n * 8],
        topk_idx: vec![0; n],
        topk_weights: vec![1.0; n],
    };
    let inputs = vec![inp(4), inp(4)];
    let dr = drop_over_capacity(&shape, &inputs, RecvLayout::RankMajor, 3).unwrap();
    assert_eq!(dr.dropped_rows, vec![5, 0]);
    assert_eq!(dr.kept[0].topk_idx, vec![0, 0, -1, -1]);
    assert_eq!(dr.kept[1].topk_idx, vec![0, -1, -1, -1]);
    // Expert-major, alignment 2, capacity 4: experts 0 (8 rows) keeps 4
    // rows, all of rank 0's; rank 1 is dropped entirely.
    let dr =
        drop_over_capacity(&shape, &inputs, RecvLayout::ExpertMajor { alignment: 2 }, 4).unwrap();
    assert_eq!(dr.dropped_rows, vec![4, 0]);
    assert_eq!(dr.kept[0].topk_idx, vec![0, 0, 0, 0]);
    assert_eq!(dr.kept[1].topk_idx, vec![-1; 4]);
}
