//! The fp8 (e4m3) cast of the low-latency dispatch, defined bit for bit.
//!
//! # The format
//!
//! e4m3 ("e4m3fn"): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits;
//! no infinities; `0x7F` / `0xFF` are NaN; the largest finite value is
//! `0x7E` = 448; subnormals are `m * 2^-9` (`m` in 1..=7), the smallest
//! normal `0x08` = 2^-6. `0x80` is -0.
//!
//! # The cast ([`quantize_fp8`])
//!
//! Each token row of `H` bf16 values (`H` a positive multiple of 128) is cut
//! into `H / 128` blocks of 128 consecutive values; each block gets one f32
//! `scale`, and each value one e4m3 code `q` with `x ≈ e4m3_to_f32(q) * scale`.
//! For a block `x[0..128]` (bf16 values, converted exactly to f32), in f32
//! arithmetic with round-to-nearest-even, no flush-to-zero:
//!
//! ```text
//! amax  = fmaxf(1e-4f, fmaxf(|x[0]|, ..., |x[127]|))      (any order; NaN ignored)
//! Exact:       scale = amax * (1.0f / 448.0f)             __fmul_rn, the constant rounded once
//!              mul   = 448.0f / amax                      __fdiv_rn (IEEE division)
//! PowerOfTwo:  p     = amax * (1.0f / 448.0f)             __fmul_rn, p is a normal f32
//!              e     = exponent(p) - 127 + (mantissa(p) != 0)   = ceil(log2(p)), from p's bits
//!              scale = 2^e,  mul = 2^-e                   exact
//! q[i]  = f32_to_e4m3(x[i] * mul)                         __fmul_rn, then cvt.rn.satfinite.e4m3x2.f32
//! ```
//!
//! This is the convention of DeepEP's low-latency dispatch and of NCCL EP's
//! low-latency mode (which adapts it): the amax is floored at `1e-4` (so an
//! all-zero block gets `scale = 1e-4 / 448`, not 1, and codes of ±0), the
//! stored scale is `amax * (1/448)`, and the values are *multiplied* by
//! `448 / amax` (a correctly rounded quotient, not `x / scale` and not
//! `x * (1 / scale)`), so a kernel written the natural way (`fp32 * scale`,
//! `__nv_cvt_float2_to_fp8x2(.., __NV_SATFINITE, __NV_E4M3)`) reproduces it
//! as long as it is built without `--use_fast_math` / `-ftz=true` /
//! `-prec-div=false`. With `Exact`, the block's largest magnitude maps to
//! ±448 (code `0x7E` / `0xFE`); with `PowerOfTwo` the scale is the power of
//! two at or above `p` (DeepEP's `round_scale`, UE8M0-ready: its exponent
//! byte is `scale.to_bits() >> 23`).
//!
//! [`f32_to_e4m3`] is `cvt.rn.satfinite.e4m3x2.f32` on one value: round to
//! nearest, ties to even; magnitudes at or above 448 (including infinity)
//! give ±448; the sign is kept (a negative value that rounds to zero gives
//! `0x80`); NaN gives `0x7F`. [`dequantize_fp8`] is `e4m3_to_f32(q) * scale`
//! in f32.
//!
//! The input is expected to be finite: a non-finite bf16 value gives
//! whatever the f32 operations above give (an infinity makes `amax` infinite,
//! `mul` zero and the block's codes ±0 or NaN), identically on CPU and GPU
//! for `Exact`; `PowerOfTwo` with an infinite `amax` is undefined.

use crate::error::{Error, Result};
pub use crate::types::Fp8Scaling;
use half::bf16;

/// Values per fp8 scale block (one f32 scale per 128 values of a row).
pub const FP8_BLOCK: usize = 128;
/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The f32 constant `1.0f / 448.0f` (rounded once) that the scale is
/// multiplied out of.
pub const E4M3_MAX_INV: f32 = 1.0 / 448.0;
/// Floor of a block's amax (DeepEP's `kFP8Margin`): an all-zero block
/// behaves as if its amax were `1e-4`.
pub const FP8_AMAX_FLOOR: f32 = 1e-4;
/// The e4m3 NaN code [`f32_to_e4m3`] produces (`0xFF` is also a NaN).
pub const E4M3_NAN: u8 = 0x7F;

/// One block's scale pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockScale {
    /// The stored scale, the dequantization multiplier: `x ≈ q * scale`.
    pub scale: f32,
    /// The quantization multiplier: `q = e4m3(x * mul)`. With `Exact` this
    /// is `448 / amax`, which in general differs from `1.0 / scale` in the
    /// last bit.
    pub mul: f32,
}

/// Rows of e4m3 codes with their per-block scales.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fp8Tokens {
    /// `[rows * H]` e4m3 codes, row-major.
    pub codes: Vec<u8>,
    /// `[rows * H / 128]` f32 scales, row-major (`scales[row * H / 128 + b]`
    /// for values `b * 128 .. (b + 1) * 128` of the row).
    pub scales: Vec<f32>,
}

impl Fp8Tokens {
    /// Number of rows, `codes.len() / hidden`.
    pub fn num_rows(&self, hidden: usize) -> usize {
        self.codes.len().checked_div(hidden).unwrap_or(0)
    }
}

/// `f32` → e4m3 code, round to nearest even with saturation to ±448
/// (`cvt.rn.satfinite.e4m3x2.f32`); NaN → `0x7F`; the sign of zero and of
/// values that round to zero is kept.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return E4M3_NAN;
    }
    if a >= E4M3_MAX {
        // 448 itself, everything that rounds to 448, and everything beyond
        // (satfinite), infinity included.
        return sign | 0x7E;
    }
    if a < f32::from_bits((127 - 6) << 23) {
        // Below the smallest normal 2^-6: the nearest multiple of 2^-9
        // (ties to even). Scaling by 2^9 is exact; code 8 is 2^-6 itself.
        let m = (a * 512.0).round_ties_even();
        return sign | m as u8;
    }
    // Normal: keep the top 3 of the 23 mantissa bits, round the other 20
    // to nearest even; a carry out of the mantissa bumps the exponent.
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127; // -6..=8
    let mant = bits & 0x7F_FFFF;
    let mut code = (((exp + 7) as u32) << 3) | (mant >> 20);
    let rest = mant & 0xF_FFFF;
    if rest > 0x8_0000 || (rest == 0x8_0000 && code & 1 == 1) {
        code += 1;
    }
    sign | code as u8
}

/// e4m3 code → `f32` (exact); `0x7F` and `0xFF` give NaN.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let mag = code & 0x7F;
    if mag == E4M3_NAN {
        return f32::NAN;
    }
    let exp = (mag >> 3) as u32;
    let m = (mag & 7) as f32;
    let v = if exp == 0 {
        m * f32::from_bits((127 - 9) << 23) // m * 2^-9
    } else {
        (8.0 + m) * f32::from_bits((127 + exp - 10) << 23) // (1 + m/8) * 2^(exp-7)
    };
    if code & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// A block's amax: `max(1e-4, max |x|)` in f32 (NaN values ignored).
pub fn block_amax(block: &[bf16]) -> f32 {
    block
        .iter()
        .fold(FP8_AMAX_FLOOR, |m, x| m.max(x.to_f32().abs()))
}

/// The scale pair for a block of amax `amax` (as [`block_amax`] returns it,
/// so `amax >= 1e-4`).
pub fn block_scale(amax: f32, scaling: Fp8Scaling) -> BlockScale {
    match scaling {
        Fp8Scaling::Exact => BlockScale {
            scale: amax * E4M3_MAX_INV,
            mul: E4M3_MAX / amax,
        },
        Fp8Scaling::PowerOfTwo => {
            let p = (amax * E4M3_MAX_INV).to_bits();
            let e = ((p >> 23) & 0xFF) as i32 - 127 + i32::from(p & 0x7F_FFFF != 0);
            BlockScale {
                scale: f32::from_bits(((127 + e) as u32) << 23),
                mul: f32::from_bits(((127 - e) as u32) << 23),
            }
        }
    }
}

/// Casts one block: writes its codes into `out` (`out.len() == block.len()`)
/// and returns its scale.
pub fn quantize_block(block: &[bf16], scaling: Fp8Scaling, out: &mut [u8]) -> f32 {
    assert_eq!(block.len(), out.len(), "one code per value");
    let s = block_scale(block_amax(block), scaling);
    for (q, x) in out.iter_mut().zip(block) {
        *q = f32_to_e4m3(x.to_f32() * s.mul);
    }
    s.scale
}

pub(super) fn check_fp8_hidden(hidden: usize) -> Result<()> {
    if hidden == 0 || !hidden.is_multiple_of(FP8_BLOCK) {
        return Err(Error::arg(
            "hidden",
            "a positive multiple of 128 for fp8 rows",
            hidden,
        ));
    }
    Ok(())
}

/// Casts `[rows * H]` bf16 token rows to fp8 (see the module docs).
///
/// Errors name `hidden` (not a positive multiple of 128) or `tokens` (a
/// length that is not a multiple of `hidden`).
pub fn quantize_fp8(tokens: &[bf16], hidden: usize, scaling: Fp8Scaling) -> Result<Fp8Tokens> {
    check_fp8_hidden(hidden)?;
    if !tokens.len().is_multiple_of(hidden) {
        return Err(Error::arg(
            "tokens",
            format!("a length that is a multiple of hidden = {hidden}"),
            format!("{} values", tokens.len()),
        ));
    }
    let mut out = Fp8Tokens {
        codes: vec![0; tokens.len()],
        scales: Vec::with_capacity(tokens.len() / FP8_BLOCK),
    };
    for (block, codes) in tokens
        .chunks_exact(FP8_BLOCK)
        .zip(out.codes.chunks_exact_mut(FP8_BLOCK))
    {
        out.scales.push(quantize_block(block, scaling, codes));
    }
    Ok(out)
}

/// Checks an [`Fp8Tokens`] holding `rows` rows of `hidden`; `arg` names it.
pub(super) fn check_fp8_tokens(
    arg: &'static str,
    t: &Fp8Tokens,
    rows: usize,
    hidden: usize,
) -> Result<()> {
    check_fp8_hidden(hidden)?;
    if t.codes.len() != rows * hidden || t.scales.len() != rows * (hidden / FP8_BLOCK) {
        return Err(Error::arg(
            arg,
            format!(
                "{rows} rows: {} codes and {} scales",
                rows * hidden,
                rows * (hidden / FP8_BLOCK)
            ),
            format!("{} codes and {} scales", t.codes.len(), t.scales.len()),
        ));
    }
    Ok(())
}

/// `[rows * H]` f32 values `e4m3_to_f32(q) * scale` (f32 multiply).
///
/// Errors name `hidden` or `fp8` (codes and scales that do not make whole
/// rows).
pub fn dequantize_fp8(fp8: &Fp8Tokens, hidden: usize) -> Result<Vec<f32>> {
    check_fp8_hidden(hidden)?;
    let rows = fp8.num_rows(hidden);
    check_fp8_tokens("fp8", fp8, rows, hidden)?;
    Ok(fp8
        .codes
        .chunks_exact(FP8_BLOCK)
        .zip(&fp8.scales)
        .flat_map(|(codes, &s)| codes.iter().map(move |&q| e4m3_to_f32(q) * s))
        .collect())
}
