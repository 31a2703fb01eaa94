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
