//! The low-latency parts of the CPU reference (`moe_ep::reference`): the fp8
//! e4m3 cast and the low-latency dispatch layouts and combine.
//!
//! * e4m3 conversion against a table of known values (zeros, subnormals,
//!   ties to even, saturation, NaN), decode-then-encode identity for all 254
//!   non-NaN codes, and (ignored by default; `--ignored --release`) all 2^32
//!   f32 inputs against the hash of the CUDA 13.0 header's conversion.
//! * The block scale rules (amax floor, exact and power-of-two scales), the
//!   cast of whole rows and its dequantization error.
//! * Both low-latency layouts on hand-checkable routings (two experts of a
//!   token on one rank, masked entries, a rank that sends nothing, no tokens)
//!   and on seeded random ones, with bf16, cast fp8 and caller fp8 payloads.
//! * Combine of identity experts: each token times its weight sum.

#![allow(clippy::needless_range_loop)] // index loops read better in these checks

use moe_ep::bf16;
use moe_ep::reference::*;

// ---------------------------------------------------------------- e4m3

fn p2(e: i32) -> f32 {
    2f32.powi(e)
}

#[test]
fn e4m3_encode_known_values() {
    let next_up = |x: f32| f32::from_bits(x.to_bits() + 1);
    let next_down = |x: f32| f32::from_bits(x.to_bits() - 1);
    let table: &[(f32, u8)] = &[
        (0.0, 0x00),
        (-0.0, 0x80),
        // subnormals m * 2^-9
        (p2(-9), 0x01),
        (-p2(-9), 0x81),
        (7.0 * p2(-9), 0x07),
        (p2(-10), 0x00),          // tie between 0 and 2^-9: even (0)
        (-p2(-10), 0x80),         // ... keeping the sign
        (next_up(p2(-10)), 0x01), // just above the tie
        (3.0 * p2(-10), 0x02),    // tie between 1 and 2 (x 2^-9): even
        (5.0 * p2(-10), 0x02),    // tie between 2 and 3: even
        (7.0 * p2(-10), 0x04),    // tie between 3 and 4: even
        (15.0 * p2(-10), 0x08),   // tie between 7 * 2^-9 and 2^-6: even
        (1e-40, 0x00),            // f32 subnormal
        (-1e-40, 0x80),
        // normals
        (p2(-6), 0x08),
        (0.5, 0x30),
        (1.0, 0x38),
        (1.125, 0x39),
        (1.0625, 0x38), // tie between 1 and 1.125: even
        (1.1875, 0x3A), // tie between 1.125 and 1.25: even
        (next_down(1.0625), 0x38),
        (next_up(1.0625), 0x39),
        (-1.5, 0xBC),
        (2.0, 0x40),
        (240.0, 0x77),
        (416.0, 0x7D),
        (432.0, 0x7E), // tie between 416 and 448: even
        (next_down(432.0), 0x7D),
        // saturation
        (448.0, 0x7E),
        (-448.0, 0xFE),
        (449.0, 0x7E),
        (464.0, 0x7E),
        (1e6, 0x7E),
        (f32::MAX, 0x7E),
        (f32::INFINITY, 0x7E),
        (f32::NEG_INFINITY, 0xFE),
        // NaN of either sign: the one NaN code
        (f32::NAN, 0x7F),
        (-f32::NAN, 0x7F),
    ];
    for &(x, code) in table {
        assert_eq!(
            f32_to_e4m3(x),
            code,
            "f32_to_e4m3({x:e}) (bits {:#010x})",
            x.to_bits()
        );
    }
}

#[test]
fn e4m3_decode_known_values() {
    let table: &[(u8, f32)] = &[
        (0x00, 0.0),
        (0x01, p2(-9)),
        (0x07, 7.0 * p2(-9)),
        (0x08, p2(-6)),
        (0x38, 1.0),
        (0x3C, 1.5),
        (0x77, 240.0),
        (0x7E, 448.0),
        (0xFE, -448.0),
        (0x81, -p2(-9)),
    ];
    for &(code, x) in table {
        assert_eq!(e4m3_to_f32(code), x, "e4m3_to_f32({code:#04x})");
    }
    assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    assert!(e4m3_to_f32(0x7F).is_nan());
    assert!(e4m3_to_f32(0xFF).is_nan());
}

#[test]
fn e4m3_round_trip_of_every_code() {
    let mut prev = f32::NEG_INFINITY;
    for code in 0..=255u8 {
        if code & 0x7F == 0x7F {
            continue;
        }
        let x = e4m3_to_f32(code);
        assert!(x.is_finite() && x.abs() <= 448.0, "{code:#04x} -> {x}");
        assert_eq!(f32_to_e4m3(x), code, "{code:#04x} -> {x:e} -> back");
        // Positive codes are ordered like their values.
        if code < 0x7F {
            assert!(x > prev || code == 0, "{code:#04x} not above the previous");
            prev = x;
        }
    }
}

/// Between two neighbouring codes, values below the midpoint go down, above
/// it go up, and the midpoint goes to the even code.
#[test]
fn e4m3_rounds_to_nearest_even_between_every_pair() {
    for code in 0..0x7Eu8 {
        let (lo, hi) = (e4m3_to_f32(code), e4m3_to_f32(code + 1));
        let mid = (lo + hi) / 2.0; // exact in f32
        let even = if code % 2 == 0 { code } else { code + 1 };
        assert_eq!(f32_to_e4m3(mid), even, "midpoint of {code:#04x}");
        assert_eq!(f32_to_e4m3(-mid), even | 0x80, "-midpoint of {code:#04x}");
        assert_eq!(f32_to_e4m3(f32::from_bits(mid.to_bits() - 1)), code);
        assert_eq!(f32_to_e4m3(f32::from_bits(mid.to_bits() + 1)), code + 1);
    }
}

/// FNV-1a of `__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)` over all
/// 2^32 f32 bit patterns in ascending order, computed with the host code of
/// CUDA 13.0.2's `cuda_fp8.hpp` (g++ -O2).
const CUDA_E4M3_SATFINITE_FNV: u64 = 0xdbe8_dace_d262_23a5;

#[test]
#[ignore = "4 * 10^9 conversions: run with --release --ignored"]
fn e4m3_matches_cuda_header_on_all_f32() {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for bits in 0..=u32::MAX {
        h ^= u64::from(f32_to_e4m3(f32::from_bits(bits)));
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    assert_eq!(h, CUDA_E4M3_SATFINITE_FNV);
}

// ---------------------------------------------------------------- scales

#[test]
fn constants_are_the_f32_roundings() {
    assert_eq!(E4M3_MAX_INV, (1.0f64 / 448.0) as f32);
    assert_eq!(E4M3_MAX_INV.to_bits(), 0x3B12_4925);
    assert_eq!(FP8_AMAX_FLOOR, 1e-4f64 as f32);
    assert_eq!(f32_to_e4m3(E4M3_MAX), 0x7E);
}

#[test]
fn block_scale_rules() {
    // amax floor: an all-zero block (and -0) behaves as amax = 1e-4.
    let zeros = vec![bf16::ZERO; 128];
    assert_eq!(block_amax(&zeros), FP8_AMAX_FLOOR);
    let mut neg = zeros.clone();
    neg[5] = bf16::from_f32(-3.0);
    assert_eq!(block_amax(&neg), 3.0);
    let mut with_nan = neg.clone();
    with_nan[6] = bf16::NAN;
    assert_eq!(block_amax(&with_nan), 3.0, "NaN is ignored, as fmaxf does");

    // Exact: scale = amax * f32(1/448), mul = 448 / amax.
    for amax in [FP8_AMAX_FLOOR, 0.3, 1.0, 3.0, 448.0, 1000.0, 3.0e38] {
        let s = block_scale(amax, Fp8Scaling::Exact);
        assert_eq!(s.scale, amax * E4M3_MAX_INV, "scale of {amax}");
        assert_eq!(s.mul, 448.0 / amax, "mul of {amax}");
    }
    let s = block_scale(448.0, Fp8Scaling::Exact);
    assert_eq!((s.scale, s.mul), (1.0, 1.0));
    // mul is the quotient, not the reciprocal of the scale: they differ in
    // the last bit for some amax.
    let differ = (1..1000)
        .map(|i| i as f32 * 0.37)
        .filter(|&a| {
            let s = block_scale(a, Fp8Scaling::Exact);
            s.mul != 1.0 / s.scale
        })
        .count();
    assert!(differ > 0);

    // PowerOfTwo: the power of two at or above amax * f32(1/448).
    let pow = |amax: f32| block_scale(amax, Fp8Scaling::PowerOfTwo);
    assert_eq!(pow(448.0).scale, 1.0);
    assert_eq!(pow(448.0).mul, 1.0);
    assert_eq!(pow(896.0).scale, 2.0);
    assert_eq!(pow(449.0).scale, 2.0);
    assert_eq!(pow(447.0).scale, 1.0);
    assert_eq!(pow(224.0).scale, 0.5);
    assert_eq!(pow(225.0).scale, 1.0);
    assert_eq!(pow(1.0).scale, p2(-8)); // 1/448 is in (2^-9, 2^-8]
    assert_eq!(pow(1.0).mul, p2(8));
    assert_eq!(pow(FP8_AMAX_FLOOR).scale, p2(-22)); // 2.23e-7 in (2^-23, 2^-22]
    assert_eq!(pow(3.0e38).scale, p2(120));
    for amax in [FP8_AMAX_FLOOR, 0.01, 0.3, 1.0, 3.0, 500.0, 1e20, 3.0e38] {
        let s = pow(amax);
        let p = amax * E4M3_MAX_INV;
        assert_eq!(s.scale.to_bits() & 0x7F_FFFF, 0, "{amax}: a power of two");
        assert_eq!(s.scale * s.mul, 1.0, "{amax}");
        assert!(s.scale >= p && s.scale / 2.0 < p, "{amax}: the ceiling");
    }
}

fn row_of(f: impl Fn(usize) -> f32, h: usize) -> Vec<bf16> {
    (0..h).map(|i| bf16::from_f32(f(i))).collect()
}

#[test]
fn quantize_row_by_blocks() {
    let h = 384;
    // Block 0: values up to 3; block 1: all zero (one -0); block 2: tiny.
    let x = row_of(
        |i| match i / 128 {
            0 => (i as f32 - 64.0) * 3.0 / 64.0,
            1 if i == 130 => -0.0,
            1 => 0.0,
            _ => 1e-6 * (i % 7) as f32,
        },
        h,
    );
    let q = quantize_fp8(&x, h, Fp8Scaling::Exact).unwrap();
    assert_eq!(q.codes.len(), h);
    assert_eq!(q.scales.len(), 3);
    assert_eq!(q.scales[0], 3.0 * E4M3_MAX_INV);
    assert_eq!(q.scales[1], FP8_AMAX_FLOOR * E4M3_MAX_INV);
    assert_eq!(
        q.scales[2],
        FP8_AMAX_FLOOR * E4M3_MAX_INV,
        "amax 6e-6 floored"
    );
    assert_eq!(q.codes[0], 0xFE, "-3 maps to -448");
    assert_eq!(q.codes[64], 0x00);
    assert!(q.codes[128..256]
        .iter()
        .enumerate()
        .all(|(i, &c)| c == if i == 2 { 0x80 } else { 0x00 }));
    // Every code is the rounding of x * (448 / amax), bit for bit.
    for (i, (&c, xv)) in q.codes.iter().zip(&x).enumerate() {
        let amax = block_amax(&x[i / 128 * 128..(i / 128 + 1) * 128]);
        assert_eq!(c, f32_to_e4m3(xv.to_f32() * (448.0 / amax)), "value {i}");
    }
    let back = dequantize_fp8(&q, h).unwrap();
    for (i, b) in back.iter().enumerate() {
        let s = q.scales[i / 128];
        assert_eq!(*b, e4m3_to_f32(q.codes[i]) * s);
    }
}

/// Over random rows: the block's largest value maps to ±448 (exact scales)
/// or into (224, 448] (power-of-two scales), and dequantization is within
/// half an e4m3 step: |deq - x| <= 2^-4 |x| + 2^-10 scale (plus f32 dust).
#[test]
fn prop_quantize_error_bound() {
    let mut rng = moe_ep::testkit::workload::Rng::new(0xF8);
    for case in 0..200 {
        let h = 128 * (1 + rng.below(4));
        let rows = 1 + rng.below(3);
        let mag = p2(rng.below(40) as i32 - 20);
        let x: Vec<bf16> = (0..rows * h)
            .map(|_| bf16::from_f64((rng.f64_unit() * 2.0 - 1.0) * mag as f64))
            .collect();
        for scaling in [Fp8Scaling::Exact, Fp8Scaling::PowerOfTwo] {
            let q = quantize_fp8(&x, h, scaling).unwrap();
            let back = dequantize_fp8(&q, h).unwrap();
            for (b, block) in x.chunks_exact(128).enumerate() {
                let amax = block_amax(block);
                let s = q.scales[b];
                assert_eq!(s, block_scale(amax, scaling).scale);
                let top = block
                    .iter()
                    .position(|v| v.to_f32().abs() == amax)
                    .map(|i| e4m3_to_f32(q.codes[b * 128 + i]).abs());
                if let Some(top) = top {
                    match scaling {
                        Fp8Scaling::Exact => assert_eq!(top, 448.0, "case {case}"),
                        Fp8Scaling::PowerOfTwo => {
                            assert!(top > 224.0 && top <= 448.0, "case {case}: {top}")
                        }
                    }
                }
                for i in b * 128..(b + 1) * 128 {
                    let xv = x[i].to_f32();
                    let err = (back[i] - xv).abs();
                    let tol = (xv.abs() / 16.0 + s * p2(-10)) * (1.0 + 1e-5);
                    assert!(
                        err <= tol,
                        "case {case} {scaling:?} value {i}: {xv} -> {}",
                        back[i]
                    );
                }
            }
        }
    }
}

#[test]
fn quantize_validation_names_the_argument() {
    let x = vec![bf16::ONE; 256];
    let e = quantize_fp8(&x, 64, Fp8Scaling::Exact).unwrap_err();
    assert!(e.to_string().contains("hidden"), "{e}");
    let e = quantize_fp8(&x[..200], 128, Fp8Scaling::Exact).unwrap_err();
    assert!(e.to_string().contains("tokens"), "{e}");
    let q = quantize_fp8(&x, 128, Fp8Scaling::Exact).unwrap();
    assert_eq!(q.num_rows(128), 2);
    let bad = Fp8Tokens {
        codes: q.codes.clone(),
        scales: vec![1.0],
    };
    let e = dequantize_fp8(&bad, 128).unwrap_err();
    assert!(e.to_string().contains("fp8"), "{e}");
    assert!(quantize_fp8(&[], 128, Fp8Scaling::Exact)
        .unwrap()
        .codes
        .is_empty());
}

// ---------------------------------------------------------------- layouts

/// Token `t` of rank `s`: small integers, exact in bf16, distinct per token.
fn token_row(s: usize, t: usize, h: usize) -> Vec<bf16> {
    (0..h)
        .map(|i| bf16::from_f32((100 * s + 10 * t + i % 8) as f32 - 50.0))
        .collect()
}

fn inputs_of(shape: &Shape, idx: &[Vec<i64>]) -> Vec<RankInput> {
    let (h, k) = (shape.hidden, shape.topk);
    idx.iter()
        .enumerate()
        .map(|(s, idx)| {
            let t_count = idx.len() / k;
            RankInput {
                tokens: (0..t_count).flat_map(|t| token_row(s, t, h)).collect(),
                topk_idx: idx.clone(),
                topk_weights: (0..idx.len()).map(|i| 0.25 + 0.125 * i as f32).collect(),
            }
        })
        .collect()
}

/// The module example: R = 2, E = 4, K = 2, M = 3, H = 128.
fn example() -> (Shape, Vec<RankInput>) {
    let shape = Shape {
        num_ranks: 2,
        num_experts: 4,
        hidden: 128,
        topk: 2,
    };
    let inputs = inputs_of(&shape, &[vec![0, 3, 1, -1, 2, 3], vec![3, 0, 2, -1]]);
    (shape, inputs)
}

fn bf16_rows(out: &LlDispatchOutput) -> &[bf16] {
    match &out.tokens {
        LlTokens::Bf16(v) => v,
        LlTokens::Fp8(_) => panic!("expected bf16 rows"),
    }
}

#[test]
fn worked_example_expert_major() {
    let (shape, inputs) = example();
    let h = shape.hidden;
    let d1 = ll_dispatch(
        &shape,
        &inputs,
        3,
        1,
        LlLayout::ExpertMajor,
        LlPayload::Bf16,
    )
    .unwrap();
    assert_eq!(d1.num_rows, 2 * 2 * 3);
    assert_eq!(d1.tokens_per_local_expert, vec![2, 3]);
    assert_eq!(d1.tokens_per_expert_source, vec![1, 1, 2, 1]);
    assert_eq!(d1.tokens_from_rank, vec![3, 2]);
    assert_eq!(d1.counted_rows(), vec![0, 1, 6, 7, 8]);
    let want = [
        (0, (0, 2)),
        (1, (1, 1)),
        (6, (0, 0)),
        (7, (0, 2)),
        (8, (1, 0)),
    ];
    for (row, (s, t)) in want {
        assert_eq!(d1.src[row], (s, t), "row {row}");
        assert_eq!(
            bf16_rows(&d1)[row * h..(row + 1) * h],
            token_row(s as usize, t as usize, h)[..],
            "row {row}"
        );
    }
    assert!(d1.topk_local_idx.is_empty() && d1.topk_weights.is_empty());
    // (0, t2) has experts 2 and 3 here: twice in expert-major.
    assert_eq!(d1.src.iter().filter(|&&s| s == (0, 2)).count(), 2);

    let d0 = ll_dispatch(
        &shape,
        &inputs,
        3,
        0,
        LlLayout::ExpertMajor,
        LlPayload::Bf16,
    )
    .unwrap();
    assert_eq!(d0.tokens_per_local_expert, vec![2, 1]);
    assert_eq!(d0.tokens_per_expert_source, vec![1, 1, 1, 0]);
    assert_eq!(d0.counted_rows(), vec![0, 1, 6]);
    assert_eq!((d0.src[0], d0.src[1], d0.src[6]), ((0, 0), (1, 0), (0, 1)));
}

#[test]
fn worked_example_rank_major() {
    let (shape, inputs) = example();
    let h = shape.hidden;
    let w = |s: usize, t: usize, k: usize| inputs[s].topk_weights[t * 2 + k];
    let d1 = ll_dispatch(&shape, &inputs, 3, 1, LlLayout::RankMajor, LlPayload::Bf16).unwrap();
    assert_eq!(d1.num_rows, 6);
    assert_eq!(d1.tokens_from_rank, vec![3, 2]);
    assert_eq!(d1.tokens_per_local_expert, vec![2, 3]);
    assert_eq!(d1.counted_rows(), vec![0, 1, 2, 3, 4]);
    type Row = ((i32, i32), [i32; 2], [f32; 2]); // src, local idx, weights
    let want: [Row; 5] = [
        ((0, 0), [-1, 1], [0.0, w(0, 0, 1)]),
        ((-1, -1), [-1, -1], [0.0, 0.0]), // t1 of rank 0: nothing here
        ((0, 2), [0, 1], [w(0, 2, 0), w(0, 2, 1)]), // once for two experts
        ((1, 0), [1, -1], [w(1, 0, 0), 0.0]),
        ((1, 1), [0, -1], [w(1, 1, 0), 0.0]), // slot 1 masked
    ];
    for (row, (src, idx, wt)) in want.into_iter().enumerate() {
        assert_eq!(d1.src[row], src, "row {row}");
        assert_eq!(d1.topk_local_idx[row * 2..row * 2 + 2], idx, "row {row}");
        assert_eq!(d1.topk_weights[row * 2..row * 2 + 2], wt, "row {row}");
        if src.0 >= 0 {
            assert_eq!(
                bf16_rows(&d1)[row * h..(row + 1) * h],
                token_row(src.0 as usize, src.1 as usize, h)[..]
            );
        }
    }
    let d0 = ll_dispatch(&shape, &inputs, 3, 0, LlLayout::RankMajor, LlPayload::Bf16).unwrap();
    let srcs: Vec<_> = d0.counted_rows().iter().map(|&r| d0.src[r]).collect();
    assert_eq!(srcs, vec![(0, 0), (0, 1), (-1, -1), (1, 0), (-1, -1)]);
    assert_eq!(d0.topk_local_idx[6..8], [-1, 0]);
}

/// Rank 1 holds no tokens, rank 2 sends everything to rank 0, rank 0 sends
/// nothing to rank 2; E_local = 2, K = 2, M = 4.
#[test]
fn ranks_that_send_nothing_and_no_tokens() {
    let shape = Shape {
        num_ranks: 3,
        num_experts: 6,
        hidden: 128,
        topk: 2,
    };
    let inputs = inputs_of(
        &shape,
        &[vec![0, 2, 3, -1], vec![], vec![1, 0, -1, 1, 0, -1]],
    );
    for layout in [LlLayout::ExpertMajor, LlLayout::RankMajor] {
        let d2 = ll_dispatch(&shape, &inputs, 4, 2, layout, LlPayload::Bf16).unwrap();
        assert_eq!(d2.tokens_per_local_expert, vec![0, 0]);
        assert_eq!(d2.tokens_from_rank, vec![2, 0, 3]);
        assert!(d2.src.iter().all(|&s| s == (-1, -1)), "{layout:?}");
        assert!(d2.topk_local_idx.iter().all(|&i| i == -1));
        let d1 = ll_dispatch(&shape, &inputs, 4, 1, layout, LlPayload::Bf16).unwrap();
        assert_eq!(d1.tokens_per_expert_source, vec![1, 0, 0, 1, 0, 0]);
        let d0 = ll_dispatch(&shape, &inputs, 4, 0, layout, LlPayload::Bf16).unwrap();
        assert_eq!(d0.tokens_per_local_expert, vec![3, 2]);
        assert_eq!(d0.tokens_per_expert_source, vec![1, 0, 2, 0, 0, 2]);
    }
    let em = ll_dispatch(
        &shape,
        &inputs,
        4,
        0,
        LlLayout::ExpertMajor,
        LlPayload::Bf16,
    )
    .unwrap();
    // local expert 0 block: (0,t0), then rank 2's t0, t2; block 1 starts at 3 * 4.
    assert_eq!(em.counted_rows(), vec![0, 1, 2, 12, 13]);
    let srcs: Vec<_> = em.counted_rows().iter().map(|&r| em.src[r]).collect();
    assert_eq!(srcs, vec![(0, 0), (2, 0), (2, 2), (2, 0), (2, 1)]);
    let rm = ll_dispatch(&shape, &inputs, 4, 0, LlLayout::RankMajor, LlPayload::Bf16).unwrap();
    assert_eq!(rm.counted_rows(), vec![0, 1, 8, 9, 10]);
    assert_eq!(rm.topk_local_idx[8 * 2..11 * 2], [1, 0, -1, 1, 0, -1]);

    // T = 0 everywhere.
    let empty = inputs_of(&shape, &[vec![], vec![], vec![]]);
    for layout in [LlLayout::ExpertMajor, LlLayout::RankMajor] {
        for dst in 0..3 {
            let d = ll_dispatch(
                &shape,
                &empty,
                4,
                dst,
                layout,
                LlPayload::Fp8Cast(Fp8Scaling::Exact),
            )
            .unwrap();
            assert!(d.counted_rows().is_empty());
            assert_eq!(d.tokens_per_local_expert, vec![0, 0]);
        }
        let out = ll_combine_emulated(&shape, &empty, 4, &zeros_out(&shape, 4, layout), 0, layout)
            .unwrap();
        assert!(out.is_empty());
    }
}

fn zeros_out(shape: &Shape, m: usize, layout: LlLayout) -> Vec<Vec<bf16>> {
    let rows = match layout {
        LlLayout::ExpertMajor => shape.num_experts * m,
        LlLayout::RankMajor => shape.num_ranks * m,
    };
    vec![vec![bf16::ZERO; rows * shape.hidden]; shape.num_ranks]
}

#[test]
fn fp8_payloads_carry_the_senders_cast() {
    let (shape, mut inputs) = example();
    let h = shape.hidden;
    // Give the rows some fractional values so the cast rounds.
    for inp in &mut inputs {
        for (i, x) in inp.tokens.iter_mut().enumerate() {
            *x = bf16::from_f32(x.to_f32() * 0.37 + (i % 13) as f32 * 0.011);
        }
    }
    for scaling in [Fp8Scaling::Exact, Fp8Scaling::PowerOfTwo] {
        let q: Vec<Fp8Tokens> = inputs
            .iter()
            .map(|i| quantize_fp8(&i.tokens, h, scaling).unwrap())
            .collect();
        for layout in [LlLayout::ExpertMajor, LlLayout::RankMajor] {
            for dst in 0..2 {
                let cast =
                    ll_dispatch(&shape, &inputs, 3, dst, layout, LlPayload::Fp8Cast(scaling))
                        .unwrap();
                let LlTokens::Fp8(rows) = &cast.tokens else {
                    panic!("fp8 rows expected");
                };
                for row in cast.counted_rows() {
                    let (s, t) = cast.src[row];
                    if s < 0 {
                        continue;
                    }
                    let (s, t) = (s as usize, t as usize);
                    assert_eq!(
                        rows.codes[row * h..(row + 1) * h],
                        q[s].codes[t * h..(t + 1) * h]
                    );
                    assert_eq!(rows.scales[row], q[s].scales[t]);
                }
                // The caller's fp8 rows are forwarded unchanged, and the
                // bf16 tokens are not needed for them.
                let mut no_tokens = inputs.clone();
                no_tokens.iter_mut().for_each(|i| i.tokens.clear());
                let fwd =
                    ll_dispatch(&shape, &no_tokens, 3, dst, layout, LlPayload::Fp8(&q)).unwrap();
                assert_eq!(fwd, cast, "{layout:?} dst {dst}");
            }
        }
    }
}

/// Over random routings: every unmasked (token, expert) pair lands exactly
/// once in expert-major on the expert's rank, blocks ordered by (source,
/// token); every (token, rank) pair once in rank-major with the token's own
/// slots; counts agree.
#[test]
fn prop_layouts_agree_with_routing() {
    use moe_ep::testkit::workload::{self, Rng, Routing};
    for seed in 0..150u64 {
        let mut rng = Rng::new(seed ^ 0x11_0C);
        let r = [1, 2, 3, 4, 8][rng.below(5)];
        let k: usize = [1, 2, 4, 8][rng.below(4)];
        let el = k.div_ceil(r) + rng.below(3);
        let m = 1 + rng.below(20);
        let shape = Shape {
            num_ranks: r,
            num_experts: r * el,
            hidden: 8,
            topk: k,
        };
        let tpr: Vec<usize> = (0..r)
            .map(|_| match rng.below(4) {
                0 => 0,
                1 => m,
                _ => rng.below(m + 1),
            })
            .collect();
        let routing = match seed % 3 {
            0 => Routing::Uniform,
            1 => Routing::Skewed { hot_share: 0.7 },
            _ => Routing::Masked { masked_share: 0.4 },
        };
        let inputs = workload::rank_inputs(seed, &shape, &tpr, routing);
        for dst in 0..r {
            let em = ll_dispatch(
                &shape,
                &inputs,
                m,
                dst,
                LlLayout::ExpertMajor,
                LlPayload::Bf16,
            )
            .unwrap();
            let rm = ll_dispatch(
                &shape,
                &inputs,
                m,
                dst,
                LlLayout::RankMajor,
                LlPayload::Bf16,
            )
            .unwrap();
            assert_eq!(em.tokens_per_local_expert, rm.tokens_per_local_expert);
            assert_eq!(em.tokens_per_expert_source, rm.tokens_per_expert_source);
            for j in 0..el {
                let e = (dst * el + j) as i64;
                // The pairs routed to e, in (source, token) order.
                let want: Vec<(i32, i32)> = inputs
                    .iter()
                    .enumerate()
                    .flat_map(|(s, inp)| {
                        inp.topk_idx
                            .chunks_exact(k)
                            .enumerate()
                            .filter(move |(_, idx)| idx.contains(&e))
                            .map(move |(t, _)| (s as i32, t as i32))
                    })
                    .collect();
                let base = j * r * m;
                let got = &em.src[base..base + em.tokens_per_local_expert[j] as usize];
                assert_eq!(got, &want[..], "seed {seed} dst {dst} expert {j}");
                for s in 0..r {
                    let n = want.iter().filter(|p| p.0 == s as i32).count();
                    assert_eq!(em.tokens_per_expert_source[j * r + s] as usize, n);
                }
            }
            for (s, inp) in inputs.iter().enumerate() {
                for t in 0..inp.num_tokens(&shape) {
                    let row = s * m + t;
                    let idx = &inp.topk_idx[t * k..(t + 1) * k];
                    let here = idx.iter().any(|&e| e >= 0 && e as usize / el == dst);
                    assert_eq!(rm.src[row] == (s as i32, t as i32), here, "seed {seed}");
                    for slot in 0..k {
                        let e = idx[slot];
                        let local = rm.topk_local_idx[row * k + slot];
                        if e >= 0 && e as usize / el == dst {
                            assert_eq!(local as i64, e - (dst * el) as i64);
                            assert_eq!(
                                rm.topk_weights[row * k + slot],
                                inp.topk_weights[t * k + slot]
                            );
                        } else {
                            assert_eq!((local, rm.topk_weights[row * k + slot]), (-1, 0.0));
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------- combine

/// Identity experts: expert-major returns each token times its weight sum;
/// rank-major (rows pre-reduced on each rank with its local weights)
/// returns the same; emulated within bf16 rounding of exact.
#[test]
fn prop_combine_of_identity_experts() {
    use moe_ep::testkit::workload::{self, Rng, Routing};
    for seed in 0..100u64 {
        let mut rng = Rng::new(seed ^ 0xC0_4B);
        let r = [1, 2, 4, 8][rng.below(4)];
        let k: usize = [1, 2, 8][rng.below(3)];
        let el = k.div_ceil(r) + rng.below(3);
        let m = 1 + rng.below(12);
        let shape = Shape {
            num_ranks: r,
            num_experts: r * el,
            hidden: 16,
            topk: k,
        };
        let tpr: Vec<usize> = (0..r).map(|_| rng.below(m + 1)).collect();
        let routing = if seed % 2 == 0 {
            Routing::Uniform
        } else {
            Routing::Masked { masked_share: 0.3 }
        };
        let inputs = workload::rank_inputs(seed, &shape, &tpr, routing);
        let h = shape.hidden;
        // Expert-major: identity experts return the dispatched rows.
        let em_out: Vec<Vec<bf16>> = (0..r)
            .map(|d| {
                let o = ll_dispatch(
                    &shape,
                    &inputs,
                    m,
                    d,
                    LlLayout::ExpertMajor,
                    LlPayload::Bf16,
                )
                .unwrap();
                bf16_rows(&o).to_vec()
            })
            .collect();
        // Rank-major: each rank pre-reduces its local slots' weights.
        let rm_out: Vec<Vec<bf16>> = (0..r)
            .map(|d| {
                let o = ll_dispatch(&shape, &inputs, m, d, LlLayout::RankMajor, LlPayload::Bf16)
                    .unwrap();
                let rows = bf16_rows(&o);
                (0..o.num_rows)
                    .flat_map(|row| {
                        let w: f32 = o.topk_weights[row * k..(row + 1) * k].iter().sum();
                        rows[row * h..(row + 1) * h]
                            .iter()
                            .map(move |x| bf16::from_f32(w * x.to_f32()))
                            .collect::<Vec<_>>()
                    })
                    .collect()
            })
            .collect();
        for home in 0..r {
            let inp = &inputs[home];
            let want: Vec<f64> = (0..inp.num_tokens(&shape))
                .flat_map(|t| {
                    let wsum: f64 = (0..k)
                        .filter(|&s| inp.topk_idx[t * k + s] >= 0)
                        .map(|s| f64::from(inp.topk_weights[t * k + s]))
                        .sum();
                    inp.tokens[t * h..(t + 1) * h]
                        .iter()
                        .map(move |x| x.to_f64() * wsum)
                })
                .collect();
            let layouts = [
                (LlLayout::ExpertMajor, &em_out),
                (LlLayout::RankMajor, &rm_out),
            ];
            for (layout, out) in layouts {
                let exact = ll_combine_f64(&shape, &inputs, m, out, home, layout).unwrap();
                let emu = ll_combine_emulated(&shape, &inputs, m, out, home, layout).unwrap();
                if layout == LlLayout::ExpertMajor {
                    for (a, b) in exact.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "seed {seed}");
                    }
                    check_close_bf16(&emu, &exact, 1).unwrap();
                }
                // Rank-major partials were rounded to bf16 on each rank.
                check_close_bf16(&emu, &want, r)
                    .unwrap_or_else(|e| panic!("seed {seed} home {home} {layout:?}: {e}"));
            }
        }
    }
}

/// The emulated combine's order and rounding on a hand-made case: the
/// expert-major terms are fused multiply-adds in slot order from 0.0.
#[test]
fn emulated_combine_is_fixed_order_f32() {
    let (shape, mut inputs) = example();
    let h = shape.hidden;
    inputs[0].topk_weights = vec![1.0, 1.0, 1.0, 0.0, 1.0, 3.0];
    let mut out = zeros_out(&shape, 3, LlLayout::ExpertMajor);
    // Token (0, t2): slot 0 -> expert 2 (rank 1 row 0), slot 1 -> expert 3
    // (rank 1 row 7).
    out[1][0..h].fill(bf16::from_f32(256.0));
    out[1][7 * h..8 * h].fill(bf16::from_f32(1.0 / 3.0));
    let emu = ll_combine_emulated(&shape, &inputs, 3, &out, 0, LlLayout::ExpertMajor).unwrap();
    let x = bf16::from_f32(1.0 / 3.0).to_f32();
    let want = bf16::from_f32(3.0f32.mul_add(x, 256.0));
    assert!(emu[2 * h..3 * h].iter().all(|&v| v == want));
    // t1 of rank 0 reaches only expert 1 on rank 0, whose output is zero.
    assert!(emu[h..2 * h].iter().all(|&v| v.to_bits() == 0));
    // Rank-major: (0, t0) reaches ranks 0 and 1, summed in rank order.
    let mut rm = zeros_out(&shape, 3, LlLayout::RankMajor);
    rm[0][0..h].fill(bf16::from_f32(1.5));
    rm[1][0..h].fill(bf16::from_f32(-0.25));
    rm[1][h..2 * h].fill(bf16::from_f32(100.0)); // (0, t1) not on rank 1: not read
    let emu = ll_combine_emulated(&shape, &inputs, 3, &rm, 0, LlLayout::RankMajor).unwrap();
    assert!(emu[0..h].iter().all(|&v| v.to_f32() == 1.25));
    assert!(emu[h..2 * h].iter().all(|&v| v.to_f32() == 0.0));
}

#[test]
fn ll_validation_names_the_argument() {
    let (shape, inputs) = example();
    let msg = |r: moe_ep::Result<LlDispatchOutput>| r.unwrap_err().to_string();
    let e = msg(ll_dispatch(
        &shape,
        &inputs,
        2,
        0,
        LlLayout::RankMajor,
        LlPayload::Bf16,
    ));
    assert!(
        e.contains("topk_idx") && e.contains("max_tokens_per_rank"),
        "{e}"
    );
    let e = msg(ll_dispatch(
        &shape,
        &inputs,
        0,
        0,
        LlLayout::RankMajor,
        LlPayload::Bf16,
    ));
    assert!(e.contains("max_tokens_per_rank"), "{e}");
    let e = msg(ll_dispatch(
        &shape,
        &inputs,
        3,
        2,
        LlLayout::RankMajor,
        LlPayload::Bf16,
    ));
    assert!(e.contains("dst"), "{e}");
    let shape64 = Shape {
        hidden: 64,
        ..shape
    };
    let in64 = inputs_of(&shape64, &[vec![0, 3], vec![]]);
    ll_dispatch(
        &shape64,
        &in64,
        3,
        0,
        LlLayout::ExpertMajor,
        LlPayload::Bf16,
    )
    .unwrap();
    let e = msg(ll_dispatch(
        &shape64,
        &in64,
        3,
        0,
        LlLayout::ExpertMajor,
        LlPayload::Fp8Cast(Fp8Scaling::Exact),
    ));
    assert!(e.contains("hidden") && e.contains("128"), "{e}");
    let q = vec![Fp8Tokens::default(), Fp8Tokens::default()];
    let e = msg(ll_dispatch(
        &shape,
        &inputs,
        3,
        0,
        LlLayout::ExpertMajor,
        LlPayload::Fp8(&q),
    ));
    assert!(e.contains("fp8") && e.contains("rank 0"), "{e}");
    let e = msg(ll_dispatch(
        &shape,
        &inputs,
        3,
        0,
        LlLayout::ExpertMajor,
        LlPayload::Fp8(&q[..1]),
    ));
    assert!(e.contains("fp8"), "{e}");
    let out = zeros_out(&shape, 3, LlLayout::ExpertMajor);
    let e = ll_combine_f64(&shape, &inputs, 3, &out[..1], 0, LlLayout::ExpertMajor).unwrap_err();
    assert!(e.to_string().contains("expert_out"), "{e}");
    let e = ll_combine_f64(&shape, &inputs, 3, &out, 0, LlLayout::RankMajor).unwrap_err();
    assert!(e.to_string().contains("expert_out"), "{e}");
    let e = ll_combine_f64(&shape, &inputs, 3, &out, 5, LlLayout::ExpertMajor).unwrap_err();
    assert!(e.to_string().contains("home"), "{e}");
}
