//! Low-latency mode: what dispatch writes on each receiving rank, and what
//! combine returns on each home rank.
//!
//! The model is the high-throughput one (`R` ranks, `E_local = E / R`
//! experts per rank, `K` top-k slots, [`RankInput`] per rank), plus
//! `M = max_tokens_per_rank`: every rank holds `T_s <= M` tokens. There is
//! no layout pass, so every row has a fixed place that depends only on `M`,
//! `R` and the routing of the rows before it from the same source.
//!
//! # Expert-major ([`LlLayout::ExpertMajor`])
//!
//! `[E_local, R * M]` rows of `H`: block `j` (rows `j * R * M ..`) holds the
//! (token, expert) pairs routed to local expert `j`, packed from the start of
//! the block, ordered by source rank ascending, then source token ascending;
//! its length is `tokens_per_local_expert[j]` (at most `R * M`, since a token
//! names an expert at most once). Source `s`'s pairs for `j` start at row
//! `j * R * M + sum over s' < s of tokens_per_expert_source[j * R + s']`. Each
//! counted row carries its `src = (source rank, source token)`; a token with
//! several experts on a rank appears once per expert. No weights travel:
//! combine weights on the home rank.
//!
//! # Rank-major ([`LlLayout::RankMajor`])
//!
//! `[R, M]` rows of `H`: row `s * M + t` is token `t` of source rank `s`.
//! Rows with `t < tokens_from_rank[s] = T_s` are *counted*: each has `K`
//! local-expert slots and `K` weights, slot `k` = `topk_idx[t, k] - dst *
//! E_local` and the token's weight if that expert lives here, else `-1` and
//! `0.0` (the token's own slot order). A counted row with at least one local
//! slot carries the token (once, however many of its experts live here) and
//! `src = (s, t)`; a counted row with none carries no token, `src = (-1,
//! -1)`, all slots `-1` / `0.0`.
//!
//! # Payloads ([`LlPayload`])
//!
//! A row is bf16 (`H` values), or fp8: `H` e4m3 codes plus `H / 128` f32
//! scales ([`Fp8Tokens`]), cast on the sender once per token with
//! [`quantize_fp8`] (so every copy of a token has the same bits), or
//! quantized by the caller and forwarded unchanged.
//!
//! Rows that are not counted (past a block's count, `t >= T_s`) are
//! unspecified: the GPU may leave anything there, and tests compare only
//! [`LlDispatchOutput::counted_rows`]. The reference fills them with zeros
//! (scale `0.0`), `src = (-1, -1)`, slots `-1` / `0.0`.
//!
//! # Worked example
//!
//! The module example of [`crate::reference`] (`R = 2`, `E = 4`, `K = 2`)
//! with `M = 3`; rank 1 hosts experts 2 and 3 (local 0 and 1), `R * M = 6`:
//!
//! ```text
//! rank 0: t0 -> [0, 3]   t1 -> [1, -1]   t2 -> [2, 3]
//! rank 1: t0 -> [3, 0]   t1 -> [2, -1]
//!
//! Expert-major on rank 1: tokens_per_local_expert [2, 3],
//!                         tokens_per_expert_source [1, 1, 2, 1]
//!   local expert 0: row 0 (0,t2)  row 1 (1,t1)                 rows 2..6 unused
//!   local expert 1: row 6 (0,t0)  row 7 (0,t2)  row 8 (1,t0)   rows 9..12 unused
//!
//! Rank-major on rank 1: tokens_from_rank [3, 2]
//!   row 0 (0,t0)  local idx [-1, 1]
//!   row 1 --      local idx [-1,-1]   (t1 of rank 0 has no expert here)
//!   row 2 (0,t2)  local idx [ 0, 1]   (once, for two experts)
//!   row 3 (1,t0)  local idx [ 1,-1]
//!   row 4 (1,t1)  local idx [ 0,-1]
//!   row 5 unused                      (T_1 = 2)
//! ```
//!
//! # Combine
//!
//! On home rank `s`, for each of its tokens `t`, into `[T_s, H]` bf16:
//!
//! * Expert-major: each rank's expert outputs are in its expert-major layout;
//!   `out[t] = sum over k ascending (unmasked) of w[t, k] * row(t, k)`, `row(t,
//!   k)` being the output row of `(s, t)` in block `topk_idx[t, k]` on the
//!   rank hosting that expert, `w` the home rank's `topk_weights`.
//! * Rank-major: each rank `d` pre-reduces (its experts, its weighting) into
//!   row `s * M + t` of its rank-major layout; `out[t] = sum over d ascending
//!   (where t has an expert) of that row`.
//!
//! [`ll_combine_f64`] is the exact sum; [`ll_combine_emulated`] is the GPU's
//! fixed-order f32 arithmetic, bit for bit: `acc = 0.0f32`, then per term in
//! the order above `acc = fmaf(w, x, acc)` (expert-major) or `acc += x`
//! (rank-major), `x` the bf16 value as f32, result `bf16(acc)` (round to
//! nearest even). A token with no experts gets `+0.0`. Compare the two with
//! [`check_close_bf16`](super::check_close_bf16) at `terms = 1`: only the
//! final rounding is a bf16 one.

use super::flat::{check_rank, check_rank_inputs, RowSrc};
use super::fp8::{check_fp8_hidden, check_fp8_tokens};
use super::{quantize_fp8, FP8_BLOCK};
use super::{Fp8Scaling, Fp8Tokens, RankInput, Shape};
use crate::error::{Error, Result};
pub use crate::types::LlLayout;
use half::bf16;

/// What a dispatched row holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LlPayload<'a> {
    /// The bf16 row of `inputs[s].tokens`.
    Bf16,
    /// `inputs[s].tokens` cast to fp8 on the sender ([`quantize_fp8`]).
    Fp8Cast(Fp8Scaling),
    /// fp8 rows the caller quantized, one [`Fp8Tokens`] per source rank
    /// (`[T_s]` rows); `inputs[s].tokens` is not read (may be empty).
    Fp8(&'a [Fp8Tokens]),
}

/// Dispatched rows: bf16 values, or e4m3 codes with their scales.
#[derive(Clone, Debug, PartialEq)]
pub enum LlTokens {
    /// `[rows * H]`.
    Bf16(Vec<bf16>),
    /// `[rows * H]` codes, `[rows * H / 128]` scales.
    Fp8(Fp8Tokens),
}

/// What one rank receives from a low-latency dispatch.
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatchOutput {
    /// The layout.
    pub layout: LlLayout,
    /// `M`.
    pub max_tokens_per_rank: usize,
    /// Expert-major `E_local * R * M`, rank-major `R * M`.
    pub num_rows: usize,
    /// `[rows]` row payloads.
    pub tokens: LlTokens,
    /// `[rows]` (source rank, source token); `(-1, -1)` where no token.
    pub src: Vec<(i32, i32)>,
    /// Rank-major `[rows * K]` local expert per slot, `-1` = not here;
    /// expert-major: empty.
    pub topk_local_idx: Vec<i32>,
    /// Rank-major `[rows * K]` weight per slot, `0.0` where not here;
    /// expert-major: empty.
    pub topk_weights: Vec<f32>,
    /// `[E_local]` (token, expert) pairs received per local expert (both
    /// layouts; the expert-major block lengths).
    pub tokens_per_local_expert: Vec<u32>,
    /// `[E_local * R]`, `[j * R + s]` = pairs of local expert `j` from
    /// source `s` (both layouts).
    pub tokens_per_expert_source: Vec<u32>,
    /// `[R]` every source's token count `T_s` (the counted rank-major rows).
    pub tokens_from_rank: Vec<u32>,
}

impl LlDispatchOutput {
    /// The rows whose contents are defined, ascending: expert-major, the
    /// first `tokens_per_local_expert[j]` rows of each block; rank-major,
    /// rows `s * M + t` for `t < T_s` (of which those with `src != (-1, -1)`
    /// carry a token).
    pub fn counted_rows(&self) -> Vec<usize> {
        let (m, r) = (self.max_tokens_per_rank, self.tokens_from_rank.len());
        let mut rows = Vec::new();
        match self.layout {
            LlLayout::ExpertMajor => {
                for (j, &n) in self.tokens_per_local_expert.iter().enumerate() {
                    rows.extend(j * r * m..j * r * m + n as usize);
                }
            }
            LlLayout::RankMajor => {
                for (s, &n) in self.tokens_from_rank.iter().enumerate() {
                    rows.extend(s * m..s * m + n as usize);
                }
            }
        }
        rows
    }
}

/// Rows per rank in `layout`.
fn ll_rows(shape: &Shape, max_tokens: usize, layout: LlLayout) -> usize {
    let rm = shape.num_ranks * max_tokens;
    match layout {
        LlLayout::ExpertMajor => shape.experts_per_rank() * rm,
        LlLayout::RankMajor => rm,
    }
}

/// Checks the shape, `M`, every rank's inputs (`tokens` only if
/// `with_tokens`) and `T_s <= M`.
fn check_ll_inputs(
    shape: &Shape,
    inputs: &[RankInput],
    max_tokens: usize,
    with_tokens: bool,
) -> Result<()> {
    shape.validate()?;
    if max_tokens == 0 {
        return Err(Error::arg("max_tokens_per_rank", "at least 1", 0));
    }
    check_rank_inputs(shape, inputs, with_tokens)?;
    for (r, inp) in inputs.iter().enumerate() {
        let t = inp.num_tokens(shape);
        if t > max_tokens {
            return Err(Error::arg(
                "topk_idx",
                format!("at most max_tokens_per_rank = {max_tokens} tokens"),
                format!("{t} tokens (rank {r})"),
            ));
        }
    }
    Ok(())
}

/// The top-k slot of `(s, t)` that names expert `e`, if any.
fn slot_of(shape: &Shape, inp: &RankInput, t: usize, e: usize) -> Option<usize> {
    let k = shape.topk;
    inp.topk_idx[t * k..(t + 1) * k]
        .iter()
        .position(|&x| x == e as i64)
}

/// Where every row of `dst` comes from (`None` = not counted or no token),
/// and the `[E_local * R]` per-(expert, source) counts. Inputs checked.
fn ll_plan(
    shape: &Shape,
    inputs: &[RankInput],
    max_tokens: usize,
    dst: usize,
    layout: LlLayout,
) -> (Vec<Option<RowSrc>>, Vec<u32>) {
    let (r, el, k, m) = (
        shape.num_ranks,
        shape.experts_per_rank(),
        shape.topk,
        max_tokens,
    );
    let mut rows = vec![None; ll_rows(shape, m, layout)];
    let mut per_source = vec![0u32; el * r];
    for j in 0..el {
        let e = dst * el + j;
        let mut n = 0;
        for (s, inp) in inputs.iter().enumerate() {
            for t in 0..inp.num_tokens(shape) {
                if let Some(slot) = slot_of(shape, inp, t, e) {
                    per_source[j * r + s] += 1;
                    if layout == LlLayout::ExpertMajor {
                        rows[j * r * m + n] = Some(RowSrc {
                            rank: s,
                            token: t,
                            slot: Some(slot),
                        });
                    }
                    n += 1;
                }
            }
        }
    }
    if layout == LlLayout::RankMajor {
        for (s, inp) in inputs.iter().enumerate() {
            for (t, idx) in inp.topk_idx.chunks_exact(k).enumerate() {
                if idx.iter().any(|&e| shape.rank_of_entry(e) == Some(dst)) {
                    rows[s * m + t] = Some(RowSrc {
                        rank: s,
                        token: t,
                        slot: None,
                    });
                }
            }
        }
    }
    (rows, per_source)
}

/// The rows rank `dst` receives from a low-latency dispatch in `layout`,
/// with `payload` rows (see the module docs). `inputs` holds one
/// [`RankInput`] per rank, in rank order, each with at most
/// `max_tokens_per_rank` tokens.
///
/// Errors name `num_ranks`/`num_experts`/`hidden`/`topk` (bad shape;
/// `hidden` also when fp8 and not a multiple of 128),
/// `max_tokens_per_rank` (0), `inputs`, `topk_idx` (bad entries, or more
/// than `max_tokens_per_rank` tokens), `topk_weights`, `tokens`, `fp8`
/// (caller rows of the wrong count or length) or `dst`.
pub fn ll_dispatch(
    shape: &Shape,
    inputs: &[RankInput],
    max_tokens_per_rank: usize,
    dst: usize,
    layout: LlLayout,
    payload: LlPayload,
) -> Result<LlDispatchOutput> {
    let m = max_tokens_per_rank;
    check_ll_inputs(shape, inputs, m, !matches!(payload, LlPayload::Fp8(_)))?;
    check_rank("dst", dst, shape)?;
    let (r, el, h, k) = (
        shape.num_ranks,
        shape.experts_per_rank(),
        shape.hidden,
        shape.topk,
    );
    // The per-source fp8 rows, cast once per token on the sender.
    let fp8: Option<Vec<Fp8Tokens>> = match payload {
        LlPayload::Bf16 => None,
        LlPayload::Fp8Cast(scaling) => {
            check_fp8_hidden(h)?;
            Some(
                inputs
                    .iter()
                    .map(|i| quantize_fp8(&i.tokens, h, scaling))
                    .collect::<Result<_>>()?,
            )
        }
        LlPayload::Fp8(q) => {
            check_fp8_hidden(h)?;
            if q.len() != r {
                return Err(Error::arg(
                    "fp8",
                    format!("one Fp8Tokens per rank ({r})"),
                    q.len(),
                ));
            }
            for (s, (q, inp)) in q.iter().zip(inputs).enumerate() {
                check_fp8_tokens("fp8", q, inp.num_tokens(shape), h).map_err(|e| match e {
                    Error::InvalidArgument { arg, expected, got } => Error::InvalidArgument {
                        arg,
                        expected,
                        got: format!("{got} (rank {s})"),
                    },
                    other => other,
                })?;
            }
            Some(q.to_vec())
        }
    };
    let (plan, per_source) = ll_plan(shape, inputs, m, dst, layout);
    let rows = plan.len();
    let nb = h / FP8_BLOCK;
    let mut tokens = match &fp8 {
        None => LlTokens::Bf16(vec![bf16::ZERO; rows * h]),
        Some(_) => LlTokens::Fp8(Fp8Tokens {
            codes: vec![0; rows * h],
            scales: vec![0.0; rows * nb],
        }),
    };
    let per_row = if layout == LlLayout::RankMajor { k } else { 0 };
    let mut out_src = vec![(-1, -1); rows];
    let mut local_idx = vec![-1i32; rows * per_row];
    let mut weights = vec![0.0f32; rows * per_row];
    let first = (dst * el) as i64;
    for (row, src) in plan.iter().enumerate() {
        let Some(RowSrc {
            rank: s, token: t, ..
        }) = *src
        else {
            continue;
        };
        out_src[row] = (s as i32, t as i32);
        match (&mut tokens, &fp8) {
            (LlTokens::Bf16(v), _) => {
                v[row * h..(row + 1) * h].copy_from_slice(&inputs[s].tokens[t * h..(t + 1) * h])
            }
            (LlTokens::Fp8(v), Some(q)) => {
                v.codes[row * h..(row + 1) * h].copy_from_slice(&q[s].codes[t * h..(t + 1) * h]);
                v.scales[row * nb..(row + 1) * nb]
                    .copy_from_slice(&q[s].scales[t * nb..(t + 1) * nb]);
            }
            (LlTokens::Fp8(_), None) => unreachable!("fp8 rows without a source"),
        }
        if layout == LlLayout::RankMajor {
            let idx = &inputs[s].topk_idx[t * k..(t + 1) * k];
            let w = &inputs[s].topk_weights[t * k..(t + 1) * k];
            for slot in 0..k {
                if shape.rank_of_entry(idx[slot]) == Some(dst) {
                    local_idx[row * k + slot] = (idx[slot] - first) as i32;
                    weights[row * k + slot] = w[slot];
                }
            }
        }
    }
    let tokens_per_local_expert = per_source.chunks_exact(r).map(|c| c.iter().sum()).collect();
    Ok(LlDispatchOutput {
        layout,
        max_tokens_per_rank: m,
        num_rows: rows,
        tokens,
        src: out_src,
        topk_local_idx: local_idx,
        topk_weights: weights,
        tokens_per_local_expert,
        tokens_per_expert_source: per_source,
        tokens_from_rank: inputs.iter().map(|i| i.num_tokens(shape) as u32).collect(),
    })
}

/// One term of a home token's combine: rank, row there, weight (expert-major)
/// or `None` (rank-major, unweighted).
type Term = (usize, usize, Option<f32>);

/// For each token of `home`, its combine terms in summation order.
fn ll_combine_terms(
    shape: &Shape,
    inputs: &[RankInput],
    max_tokens: usize,
    expert_out: &[Vec<bf16>],
    home: usize,
    layout: LlLayout,
) -> Result<Vec<Vec<Term>>> {
    check_ll_inputs(shape, inputs, max_tokens, false)?;
    check_rank("home", home, shape)?;
    let (r, k, h) = (shape.num_ranks, shape.topk, shape.hidden);
    let rows = ll_rows(shape, max_tokens, layout);
    if expert_out.len() != r {
        return Err(Error::arg(
            "expert_out",
            format!("one buffer per rank ({r})"),
            expert_out.len(),
        ));
    }
    for (d, x) in expert_out.iter().enumerate() {
        if x.len() != rows * h {
            return Err(Error::arg(
                "expert_out",
                format!("rows * hidden = {} values on rank {d}", rows * h),
                format!("{} values", x.len()),
            ));
        }
    }
    let home_in = &inputs[home];
    let t_home = home_in.num_tokens(shape);
    let plans: Vec<Vec<Option<RowSrc>>> = (0..r)
        .map(|d| ll_plan(shape, inputs, max_tokens, d, layout).0)
        .collect();
    let mut terms = vec![Vec::new(); t_home];
    match layout {
        LlLayout::ExpertMajor => {
            // [t * K + slot] -> (rank, row)
            let mut at = vec![None; t_home * k];
            for (d, plan) in plans.iter().enumerate() {
                for (row, src) in plan.iter().enumerate() {
                    if let Some(s) = src.filter(|s| s.rank == home) {
                        at[s.token * k + s.slot.expect("expert-major row")] = Some((d, row));
                    }
                }
            }
            for (t, terms) in terms.iter_mut().enumerate() {
                for slot in 0..k {
                    if let Some((d, row)) = at[t * k + slot] {
                        terms.push((d, row, Some(home_in.topk_weights[t * k + slot])));
                    }
                }
            }
        }
        LlLayout::RankMajor => {
            for (d, plan) in plans.iter().enumerate() {
                for (t, terms) in terms.iter_mut().enumerate() {
                    let row = home * max_tokens + t;
                    if plan[row].is_some() {
                        terms.push((d, row, None));
                    }
                }
            }
        }
    }
    Ok(terms)
}

/// Exact low-latency combine on home rank `home`, in f64: `[T_home * H]`.
///
/// `expert_out[d]` is rank `d`'s expert output in its `layout`
/// (`[rows_d * H]`, rows as [`ll_dispatch`] gives them; only counted rows
/// are read). Expert-major: `out[t] = sum over k ascending of w[t, k] *
/// row(t, k)`; rank-major: `out[t] = sum over ranks d ascending where t has
/// an expert of expert_out[d][home * M + t]` (see the module docs).
///
/// Errors as [`ll_dispatch`] (without `tokens` and `fp8`), plus `home` and
/// `expert_out`.
pub fn ll_combine_f64(
    shape: &Shape,
    inputs: &[RankInput],
    max_tokens_per_rank: usize,
    expert_out: &[Vec<bf16>],
    home: usize,
    layout: LlLayout,
) -> Result<Vec<f64>> {
    let terms = ll_combine_terms(shape, inputs, max_tokens_per_rank, expert_out, home, layout)?;
    let h = shape.hidden;
    let mut out = vec![0.0f64; terms.len() * h];
    for (acc, terms) in out.chunks_exact_mut(h).zip(&terms) {
        for &(d, row, w) in terms {
            let w = w.map_or(1.0, f64::from);
            for (a, x) in acc.iter_mut().zip(&expert_out[d][row * h..(row + 1) * h]) {
                *a += w * x.to_f64();
            }
        }
    }
    Ok(out)
}

/// The GPU's low-latency combine arithmetic on home rank `home`, bit for
/// bit: `[T_home * H]` bf16. Same arguments as [`ll_combine_f64`].
///
/// Per token, f32 `acc = 0.0`; for each term in the order of
/// [`ll_combine_f64`], `acc = w.mul_add(x, acc)` (expert-major, `w` the home
/// token's weight of that slot) or `acc = acc + x` (rank-major), `x` the bf16
/// value as f32; result `bf16::from_f32(acc)`.
pub fn ll_combine_emulated(
    shape: &Shape,
    inputs: &[RankInput],
    max_tokens_per_rank: usize,
    expert_out: &[Vec<bf16>],
    home: usize,
    layout: LlLayout,
) -> Result<Vec<bf16>> {
    let terms = ll_combine_terms(shape, inputs, max_tokens_per_rank, expert_out, home, layout)?;
    let h = shape.hidden;
    let mut out = Vec::with_capacity(terms.len() * h);
    let mut acc = vec![0.0f32; h];
    for terms in &terms {
        acc.fill(0.0);
        for &(d, row, w) in terms {
            let x = &expert_out[d][row * h..(row + 1) * h];
            match w {
                Some(w) => {
                    for (a, x) in acc.iter_mut().zip(x) {
                        *a = w.mul_add(x.to_f32(), *a);
                    }
                }
                None => {
                    for (a, x) in acc.iter_mut().zip(x) {
                        *a += x.to_f32();
                    }
                }
            }
        }
        out.extend(acc.iter().map(|&a| bf16::from_f32(a)));
    }
    Ok(out)
}
