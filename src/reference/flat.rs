//! The CPU reference's flat (one-level) ops: [`dispatch`] into either
//! receive layout ([`DispatchOutput`]), [`combine_f64`] and
//! [`combine_emulated`] (the GPU's summation order), [`dispatch_backward`],
//! [`combine_backward`], and [`check_close_bf16`]; the input checks and
//! row plans the low-latency and two-level references share. The model and
//! the layouts are in the module docs of `reference`.
//!
//! Tests: `tests/reference.rs` (properties of every op), and every GPU test
//! of the one-node path (`tests/gpu_intranode.rs`) against it.

use super::{align_up, validate_topk, RankInput, Shape};
use crate::error::{Error, Result};
use crate::types::RecvLayout;
use half::bf16;

/// What one destination rank received, in its receive layout.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchOutput {
    /// Rank-major: received tokens; expert-major: padded rows.
    pub num_rows: usize,
    /// `[rows * H]` token rows; padding rows are `+0.0`.
    pub tokens: Vec<bf16>,
    /// Rank-major: `[rows * K]`, slot `k` = the source weight if expert
    /// `topk_idx[t, k]` is local to this rank, else `0.0`.
    /// Expert-major: `[rows]`, the row's `(t, k)` weight; `0.0` on padding.
    pub topk_weights: Vec<f32>,
    /// Rank-major: `[rows * K]`, slot `k` = `topk_idx[t, k] - dst * E_local`
    /// if local, else `-1`. Expert-major: `[rows]`, the row's local expert;
    /// `-1` on padding.
    pub topk_local_idx: Vec<i32>,
    /// `[rows]` (source rank, source token); `(-1, -1)` on padding.
    pub src: Vec<(i32, i32)>,
    /// `[E_local]` unpadded (token, expert) pairs received per local expert
    /// (the same in both layouts).
    pub tokens_per_local_expert: Vec<u32>,
    /// Rank-major: `[R + 1]` first row per source rank; expert-major:
    /// `[E_local + 1]` padded block starts.
    pub offsets: Vec<usize>,
}

/// Where one received row came from: source rank, source token, and (for
/// expert-major rows) the top-k slot it stands for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowSrc {
    pub(crate) rank: usize,
    pub(crate) token: usize,
    pub(crate) slot: Option<usize>,
}

/// The row structure of one destination rank's receive buffer, without data.
pub(crate) struct RowPlan {
    /// `[rows]`, `None` for padding.
    pub(crate) rows: Vec<Option<RowSrc>>,
    pub(crate) tokens_per_local_expert: Vec<u32>,
    pub(crate) offsets: Vec<usize>,
}

/// Checks the shape, the layout, and every rank's input slices.
pub(crate) fn check_inputs(shape: &Shape, inputs: &[RankInput], layout: RecvLayout) -> Result<()> {
    shape.validate()?;
    layout.validate()?;
    check_rank_inputs(shape, inputs, true)
}

/// Checks every rank's input slices (`tokens` only if `with_tokens`); the
/// shape must be valid.
pub(crate) fn check_rank_inputs(
    shape: &Shape,
    inputs: &[RankInput],
    with_tokens: bool,
) -> Result<()> {
    if inputs.len() != shape.num_ranks {
        return Err(Error::arg(
            "inputs",
            format!("one RankInput per rank ({})", shape.num_ranks),
            inputs.len(),
        ));
    }
    for (r, inp) in inputs.iter().enumerate() {
        validate_topk(shape, &inp.topk_idx).map_err(|e| match e {
            Error::InvalidArgument { arg, expected, got } => Error::InvalidArgument {
                arg,
                expected,
                got: format!("{got} (rank {r})"),
            },
            other => other,
        })?;
        let t = inp.num_tokens(shape);
        if inp.topk_weights.len() != t * shape.topk {
            return Err(Error::arg(
                "topk_weights",
                format!("T * topk = {} values", t * shape.topk),
                format!("{} values (rank {r})", inp.topk_weights.len()),
            ));
        }
        if with_tokens && inp.tokens.len() != t * shape.hidden {
            return Err(Error::arg(
                "tokens",
                format!("T * hidden = {} values", t * shape.hidden),
                format!("{} values (rank {r})", inp.tokens.len()),
            ));
        }
    }
    Ok(())
}

pub(crate) fn check_rank(arg: &'static str, rank: usize, shape: &Shape) -> Result<()> {
    if rank >= shape.num_ranks {
        return Err(Error::arg(
            arg,
            format!("a rank in 0..{}", shape.num_ranks),
            rank,
        ));
    }
    Ok(())
}

/// Builds the row plan of `dst` (inputs already checked).
pub(crate) fn plan(shape: &Shape, inputs: &[RankInput], dst: usize, layout: RecvLayout) -> RowPlan {
    let k = shape.topk;
    let el = shape.experts_per_rank();
    let first = dst * el;
    let local_of = |e: i64| -> Option<usize> {
        (shape.rank_of_entry(e) == Some(dst)).then(|| e as usize - first)
    };
    let mut tokens_per_local_expert = vec![0u32; el];
    match layout {
        RecvLayout::RankMajor => {
            let mut rows = Vec::new();
            let mut offsets = vec![0];
            for (s, inp) in inputs.iter().enumerate() {
                for (t, idx) in inp.topk_idx.chunks_exact(k).enumerate() {
                    let mut sent = false;
                    for j in idx.iter().filter_map(|&e| local_of(e)) {
                        tokens_per_local_expert[j] += 1;
                        sent = true;
                    }
                    if sent {
                        rows.push(Some(RowSrc {
                            rank: s,
                            token: t,
                            slot: None,
                        }));
                    }
                }
                offsets.push(rows.len());
            }
            RowPlan {
                rows,
                tokens_per_local_expert,
                offsets,
            }
        }
        RecvLayout::ExpertMajor { alignment } => {
            // Bucket (source, token, slot) by local expert; scanning sources
            // and tokens in ascending order keeps each bucket sorted.
            let mut buckets: Vec<Vec<RowSrc>> = vec![Vec::new(); el];
            for (s, inp) in inputs.iter().enumerate() {
                for (t, idx) in inp.topk_idx.chunks_exact(k).enumerate() {
                    for (slot, &e) in idx.iter().enumerate() {
                        if let Some(j) = local_of(e) {
                            buckets[j].push(RowSrc {
                                rank: s,
                                token: t,
                                slot: Some(slot),
                            });
                        }
                    }
                }
            }
            let mut rows = Vec::new();
            let mut offsets = vec![0];
            for (j, bucket) in buckets.into_iter().enumerate() {
                tokens_per_local_expert[j] = bucket.len() as u32;
                let padded = align_up(bucket.len(), alignment);
                rows.extend(bucket.into_iter().map(Some));
                rows.resize(
                    rows.len() + padded - tokens_per_local_expert[j] as usize,
                    None,
                );
                offsets.push(rows.len());
            }
            RowPlan {
                rows,
                tokens_per_local_expert,
                offsets,
            }
        }
    }
}

/// The rows that destination `d`'s plan holds for each token of `home`:
/// `[T_home]` lists of row indices, ascending.
pub(crate) fn rows_of_home(plan: &RowPlan, home: usize, home_tokens: usize) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); home_tokens];
    for (row, src) in plan.rows.iter().enumerate() {
        if let Some(src) = src.filter(|s| s.rank == home) {
            out[src.token].push(row);
        }
    }
    out
}

/// The rows rank `dst` receives, in `layout` (see the module docs for the row
/// order). `inputs` holds one [`RankInput`] per rank, in rank order.
///
/// Errors name `num_ranks`/`num_experts`/`hidden`/`topk` (bad shape),
/// `alignment`, `inputs`, `topk_idx`, `topk_weights`, `tokens` or `dst`.
pub fn dispatch(
    shape: &Shape,
    inputs: &[RankInput],
    dst: usize,
    layout: RecvLayout,
) -> Result<DispatchOutput> {
    check_inputs(shape, inputs, layout)?;
    check_rank("dst", dst, shape)?;
    let (h, k) = (shape.hidden, shape.topk);
    let first = (dst * shape.experts_per_rank()) as i64;
    let p = plan(shape, inputs, dst, layout);
    let rows = p.rows.len();
    let per_row = match layout {
        RecvLayout::RankMajor => k,
        RecvLayout::ExpertMajor { .. } => 1,
    };
    let mut out = DispatchOutput {
        num_rows: rows,
        tokens: Vec::with_capacity(rows * h),
        topk_weights: Vec::with_capacity(rows * per_row),
        topk_local_idx: Vec::with_capacity(rows * per_row),
        src: Vec::with_capacity(rows),
        tokens_per_local_expert: p.tokens_per_local_expert,
        offsets: p.offsets,
    };
    for row in &p.rows {
        let Some(RowSrc { rank, token, slot }) = *row else {
            out.tokens.extend(std::iter::repeat_n(bf16::ZERO, h));
            out.topk_weights.push(0.0);
            out.topk_local_idx.push(-1);
            out.src.push((-1, -1));
            continue;
        };
        let inp = &inputs[rank];
        out.tokens
            .extend_from_slice(&inp.tokens[token * h..(token + 1) * h]);
        out.src.push((rank as i32, token as i32));
        let idx = &inp.topk_idx[token * k..(token + 1) * k];
        let w = &inp.topk_weights[token * k..(token + 1) * k];
        match slot {
            // Expert-major: the one (t, k) pair this row stands for.
            Some(slot) => {
                out.topk_weights.push(w[slot]);
                out.topk_local_idx.push((idx[slot] - first) as i32);
            }
            // Rank-major: all K slots, masked to the local ones.
            None => {
                for (&e, &w) in idx.iter().zip(w) {
                    if shape.rank_of_entry(e) == Some(dst) {
                        out.topk_weights.push(w);
                        out.topk_local_idx.push((e - first) as i32);
                    } else {
                        out.topk_weights.push(0.0);
                        out.topk_local_idx.push(-1);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The rows rank `dst` receives of a payload other than the tokens, in
/// `layout`: `rows[s]` is rank `s`'s `[T_s, width]` rows (any element
/// type: fp8 codes `u8` with `width = H`, their scales `u8` with `H / 32`
/// or `f32` with `H / 128`), moved as [`dispatch`] moves the tokens (the
/// same rows in the same order; padding rows are `T::default()`, zero).
/// The routing is `inputs`' (their `tokens` are not read).
///
/// Errors as [`dispatch`]'s, and `rows` (one list per rank, `T_s * width`
/// values each).
pub fn dispatch_rows<T: Copy + Default>(
    shape: &Shape,
    inputs: &[RankInput],
    rows: &[Vec<T>],
    width: usize,
    dst: usize,
    layout: RecvLayout,
) -> Result<Vec<T>> {
    check_inputs(shape, inputs, layout)?;
    check_rank("dst", dst, shape)?;
    if rows.len() != inputs.len() {
        return Err(Error::arg(
            "rows",
            format!("one list per rank ({})", inputs.len()),
            rows.len(),
        ));
    }
    for (s, (r, inp)) in rows.iter().zip(inputs).enumerate() {
        let want = inp.num_tokens(shape) * width;
        if r.len() != want {
            return Err(Error::arg(
                "rows",
                format!("T * width = {want} values on rank {s}"),
                r.len(),
            ));
        }
    }
    let p = plan(shape, inputs, dst, layout);
    let mut out = Vec::with_capacity(p.rows.len() * width);
    for row in &p.rows {
        match *row {
            Some(RowSrc { rank, token, .. }) => {
                out.extend_from_slice(&rows[rank][token * width..(token + 1) * width])
            }
            None => out.extend(std::iter::repeat_n(T::default(), width)),
        }
    }
    Ok(out)
}

/// Checks one per-destination buffer list: `bufs.len() == R` and
/// `bufs[d].len() == rows_d * per_row`.
pub(crate) fn check_per_rank<T>(
    arg: &'static str,
    bufs: &[Vec<T>],
    plans: &[RowPlan],
    per_row: usize,
    unit: &str,
) -> Result<()> {
    if bufs.len() != plans.len() {
        return Err(Error::arg(
            arg,
            format!("one buffer per rank ({})", plans.len()),
            bufs.len(),
        ));
    }
    for (d, (buf, p)) in bufs.iter().zip(plans).enumerate() {
        let want = p.rows.len() * per_row;
        if buf.len() != want {
            return Err(Error::arg(
                arg,
                format!("rows * {unit} = {want} values on rank {d}"),
                format!("{} values", buf.len()),
            ));
        }
    }
    Ok(())
}

pub(crate) fn check_rank_major_unweighted(layout: RecvLayout, weighted: bool) -> Result<()> {
    if weighted && layout == RecvLayout::RankMajor {
        return Err(Error::arg(
            "weights",
            "weighted = false with RecvLayout::RankMajor (a rank-major row already \
             stands for all of the token's experts on that rank)",
            "weighted = true",
        ));
    }
    Ok(())
}

/// Everything combine needs on the home rank: for each destination `d`, the
/// rows of each home token on `d`.
pub(crate) struct CombinePlan {
    /// `[R]` plans (one per destination).
    pub(crate) plans: Vec<RowPlan>,
    /// `[R][T_home]` ascending row lists.
    pub(crate) rows: Vec<Vec<Vec<usize>>>,
    pub(crate) home_tokens: usize,
}

pub(crate) fn combine_plan(
    shape: &Shape,
    inputs: &[RankInput],
    home: usize,
    layout: RecvLayout,
) -> Result<CombinePlan> {
    check_inputs(shape, inputs, layout)?;
    check_rank("home", home, shape)?;
    let home_tokens = inputs[home].num_tokens(shape);
    let plans: Vec<RowPlan> = (0..shape.num_ranks)
        .map(|d| plan(shape, inputs, d, layout))
        .collect();
    let rows = plans
        .iter()
        .map(|p| rows_of_home(p, home, home_tokens))
        .collect();
    Ok(CombinePlan {
        plans,
        rows,
        home_tokens,
    })
}

/// The dispatched weight of expert-major row `row` on a plan.
pub(crate) fn row_weight(inputs: &[RankInput], k: usize, p: &RowPlan, row: usize) -> f32 {
    let src = p.rows[row].expect("not a padding row");
    inputs[src.rank].topk_weights[src.token * k + src.slot.expect("expert-major row")]
}

/// Exact combine on home rank `home`, in f64: `[T_home * H]`.
///
/// `expert_out[d]` is rank `d`'s expert output in its dispatch layout
/// (`[rows_d * H]`). `out[t]` is the sum over ranks `d` ascending (only where
/// `t` was sent) of `d`'s partial:
///
/// * `RankMajor`: the partial is `expert_out[d][row of t on d]`. `weighted`
///   must be false (error naming `weights`): a rank-major row already stands
///   for all of `t`'s experts on `d`.
/// * `ExpertMajor`: the partial is the sum over `t`'s rows on `d`, in
///   ascending row order, of `(w_row if weighted else 1) * expert_out[d][row]`,
///   `w_row` being that row's dispatched weight.
pub fn combine_f64(
    shape: &Shape,
    inputs: &[RankInput],
    expert_out: &[Vec<bf16>],
    home: usize,
    layout: RecvLayout,
    weighted: bool,
) -> Result<Vec<f64>> {
    check_rank_major_unweighted(layout, weighted)?;
    let cp = combine_plan(shape, inputs, home, layout)?;
    check_per_rank("expert_out", expert_out, &cp.plans, shape.hidden, "hidden")?;
    let (h, k) = (shape.hidden, shape.topk);
    let mut out = vec![0.0f64; cp.home_tokens * h];
    for (t, acc) in out.chunks_exact_mut(h).enumerate() {
        for (d, x_d) in expert_out.iter().enumerate() {
            for &row in &cp.rows[d][t] {
                let w = if weighted {
                    row_weight(inputs, k, &cp.plans[d], row) as f64
                } else {
                    1.0
                };
                for (a, x) in acc.iter_mut().zip(&x_d[row * h..(row + 1) * h]) {
                    *a += w * x.to_f64();
                }
            }
        }
    }
    Ok(out)
}

/// The shared body of [`combine_emulated`] and the token half of
/// [`dispatch_backward`]; `arg` names the per-destination buffers in errors.
pub(crate) fn combine_emulated_impl(
    shape: &Shape,
    inputs: &[RankInput],
    expert_out: &[Vec<bf16>],
    home: usize,
    layout: RecvLayout,
    weighted: bool,
    arg: &'static str,
) -> Result<Vec<bf16>> {
    check_rank_major_unweighted(layout, weighted)?;
    let cp = combine_plan(shape, inputs, home, layout)?;
    check_per_rank(arg, expert_out, &cp.plans, shape.hidden, "hidden")?;
    let h = shape.hidden;
    let mut out = Vec::with_capacity(cp.home_tokens * h);
    let mut home_acc = vec![0.0f32; h];
    let mut partial = vec![0.0f32; h];
    for t in 0..cp.home_tokens {
        home_acc.fill(0.0);
        for d in 0..shape.num_ranks {
            // The destination's partial, sent home as bf16 and summed there
            // in f32; nothing where t was not sent to d.
            if rank_partial(
                shape,
                inputs,
                &cp,
                expert_out,
                (d, t),
                weighted,
                &mut partial,
            ) {
                add_bf16(&mut home_acc, &partial);
            }
        }
        out.extend(home_acc.iter().map(|&a| bf16::from_f32(a)));
    }
    Ok(out)
}

/// Destination `d`'s partial of home token `t` in f32, accumulated from
/// `0.0` over `t`'s rows on `d` in ascending row order: `acc = w.mul_add(x,
/// acc)` (weighted) or `acc = acc + x`, `x` the bf16 value as f32. Returns
/// false (and leaves `partial` zero) where `t` was not sent to `d`.
pub(crate) fn rank_partial(
    shape: &Shape,
    inputs: &[RankInput],
    cp: &CombinePlan,
    expert_out: &[Vec<bf16>],
    (d, t): (usize, usize),
    weighted: bool,
    partial: &mut [f32],
) -> bool {
    let (h, k) = (shape.hidden, shape.topk);
    partial.fill(0.0);
    let rows = &cp.rows[d][t];
    for &row in rows {
        let x = &expert_out[d][row * h..(row + 1) * h];
        if weighted {
            let w = row_weight(inputs, k, &cp.plans[d], row);
            for (a, x) in partial.iter_mut().zip(x) {
                *a = w.mul_add(x.to_f32(), *a);
            }
        } else {
            for (a, x) in partial.iter_mut().zip(x) {
                *a += x.to_f32();
            }
        }
    }
    !rows.is_empty()
}

/// `acc += f32(bf16(p))` elementwise: one bf16 partial summed in f32.
pub(crate) fn add_bf16(acc: &mut [f32], p: &[f32]) {
    for (a, p) in acc.iter_mut().zip(p) {
        *a += bf16::from_f32(*p).to_f32();
    }
}

/// The GPU's combine arithmetic on home rank `home`, bit for bit:
/// `[T_home * H]` bf16. Same arguments and partials as [`combine_f64`].
///
/// On each destination `d` (where `t` was sent): `RankMajor` partial = the row
/// itself; `ExpertMajor` partial = f32 `acc` from `0.0`, for each of `t`'s rows
/// in ascending row order `acc = w.mul_add(x, acc)` (weighted) or
/// `acc = acc + x` (unweighted), `x` = the bf16 value as f32, then rounded to
/// bf16 (round-to-nearest-even). On the home rank: f32 `acc = 0.0`, for `d`
/// ascending `acc += f32(partial_d)`, result `bf16::from_f32(acc)`.
pub fn combine_emulated(
    shape: &Shape,
    inputs: &[RankInput],
    expert_out: &[Vec<bf16>],
    home: usize,
    layout: RecvLayout,
    weighted: bool,
) -> Result<Vec<bf16>> {
    combine_emulated_impl(
        shape,
        inputs,
        expert_out,
        home,
        layout,
        weighted,
        "expert_out",
    )
}

/// Dispatch backward on home rank `home`.
///
/// `grad_recv[d]` (`[rows_d * H]`) and `grad_recv_w[d]` (rank-major
/// `[rows_d * K]`, expert-major `[rows_d]`) are the gradients of rank `d`'s
/// dispatch output. Returns `(grad_tokens [T_home * H], grad_topk_weights
/// [T_home * K])`:
///
/// * `grad_tokens` = the unweighted combine of `grad_recv`, with exactly the
///   arithmetic of [`combine_emulated`] (`weighted = false`); in expert-major
///   that sums all of `t`'s rows on each `d`.
/// * `grad_topk_weights[t, k]` = the weight gradient where `(t, k)` landed:
///   rank-major `grad_recv_w[d][row * K + k]`, expert-major
///   `grad_recv_w[d][row]`; `0.0` for masked slots.
pub fn dispatch_backward(
    shape: &Shape,
    inputs: &[RankInput],
    grad_recv: &[Vec<bf16>],
    grad_recv_w: &[Vec<f32>],
    home: usize,
    layout: RecvLayout,
) -> Result<(Vec<bf16>, Vec<f32>)> {
    let grad_tokens =
        combine_emulated_impl(shape, inputs, grad_recv, home, layout, false, "grad_recv")?;
    let cp = combine_plan(shape, inputs, home, layout)?;
    let k = shape.topk;
    let per_row = match layout {
        RecvLayout::RankMajor => k,
        RecvLayout::ExpertMajor { .. } => 1,
    };
    check_per_rank(
        "grad_recv_w",
        grad_recv_w,
        &cp.plans,
        per_row,
        "weight slots",
    )?;
    let idx = &inputs[home].topk_idx;
    let mut grad_w = vec![0.0f32; cp.home_tokens * k];
    for (d, (p, gw)) in cp.plans.iter().zip(grad_recv_w).enumerate() {
        for (row, src) in p.rows.iter().enumerate() {
            let Some(src) = src.filter(|s| s.rank == home) else {
                continue;
            };
            let t = src.token;
            match src.slot {
                Some(slot) => grad_w[t * k + slot] = gw[row],
                None => {
                    for slot in 0..k {
                        if shape.rank_of_entry(idx[t * k + slot]) == Some(d) {
                            grad_w[t * k + slot] = gw[row * k + slot];
                        }
                    }
                }
            }
        }
    }
    Ok((grad_tokens, grad_w))
}

/// Combine backward on rank `dst`: the gradient of `dst`'s expert output,
/// `[rows_dst * H]` in `dst`'s dispatch layout.
///
/// `grad_out[s]` (`[T_s * H]`) is the gradient of home rank `s`'s combine
/// output. Each non-padding row from `(s, t)` gets `grad_out[s][t]`; with
/// `weighted` (expert-major only, else an error naming `weights`) it gets
/// `bf16::from_f32(w_row * f32(g))` elementwise. Padding rows are `+0.0`.
pub fn combine_backward(
    shape: &Shape,
    inputs: &[RankInput],
    grad_out: &[Vec<bf16>],
    dst: usize,
    layout: RecvLayout,
    weighted: bool,
) -> Result<Vec<bf16>> {
    check_rank_major_unweighted(layout, weighted)?;
    check_inputs(shape, inputs, layout)?;
    check_rank("dst", dst, shape)?;
    let (h, k) = (shape.hidden, shape.topk);
    if grad_out.len() != shape.num_ranks {
        return Err(Error::arg(
            "grad_out",
            format!("one buffer per rank ({})", shape.num_ranks),
            grad_out.len(),
        ));
    }
    for (s, (g, inp)) in grad_out.iter().zip(inputs).enumerate() {
        let want = inp.num_tokens(shape) * h;
        if g.len() != want {
            return Err(Error::arg(
                "grad_out",
                format!("T * hidden = {want} values on rank {s}"),
                format!("{} values", g.len()),
            ));
        }
    }
    let p = plan(shape, inputs, dst, layout);
    let mut out = Vec::with_capacity(p.rows.len() * h);
    for (row, src) in p.rows.iter().enumerate() {
        let Some(src) = src else {
            out.extend(std::iter::repeat_n(bf16::ZERO, h));
            continue;
        };
        let g = &grad_out[src.rank][src.token * h..(src.token + 1) * h];
        if weighted {
            let w = row_weight(inputs, k, &p, row);
            out.extend(g.iter().map(|g| bf16::from_f32(w * g.to_f32())));
        } else {
            out.extend_from_slice(g);
        }
    }
    Ok(out)
}

/// Compares a bf16 result with an exact (f64) one.
///
/// Passes iff every element satisfies
///
/// ```text
/// |got[i] - want[i]| <= 2^-8 * (|want[i]| + terms * m),   m = max_j |want[j]|
/// ```
///
/// i.e. `rtol = 2^-8` plus an absolute floor `atol = 2^-8 * terms * m`.
/// `terms` is the number of bf16-rounded partials summed to form each result:
/// for combine (and dispatch backward), the number of ranks a token can reach;
/// `R` is always safe, `0` means a single final rounding.
///
/// Why: each of the `terms` partials `p_d` is rounded once to bf16 (unit
/// roundoff `u = 2^-9`), the f32 sums add error of order `2^-24` relative,
/// and the final result is rounded once more, so
/// `|err| <= u * (sum_d |p_d| + |want[i]|)` up to negligible f32 terms.
/// * Without cancellation `sum_d |p_d| = |want[i]| <= m`, so
///   `|err| <= 2u |want[i]|`, well inside `2u (|want[i]| + terms * m)`.
/// * With cancellation (partials of both signs) `want[i]` alone bounds
///   nothing; taking the slice's largest result `m` as the scale of the
///   partials, the bound holds for any partials with `|p_d| <= 2m`
///   (`u * (2 * terms * m + |want[i]|)` <= tol), with 2x headroom for `|p_d| <= m`.
///
/// A wrong or swapped row shifts a result by (its weight times) the difference
/// of two whole input rows, typically of order `m / terms` or more per element,
/// so across a row's `H` elements it fails; a row whose weight is far below
/// `terms / 256` can hide in the floor, so also compare bit for bit with
/// [`combine_emulated`]. Non-finite values and a length mismatch fail.
///
/// `Err` names the first bad index with both values and the tolerance.
pub fn check_close_bf16(
    got: &[bf16],
    want: &[f64],
    terms: usize,
) -> std::result::Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "length mismatch: got {} values, want {}",
            got.len(),
            want.len()
        ));
    }
    let m = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let floor = terms as f64 * m;
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        let tol = (w.abs() + floor) / 256.0;
        let diff = (g - w).abs();
        if !g.is_finite() || !w.is_finite() || diff > tol {
            return Err(format!(
                "index {i}: got {g}, want {w}, |diff| {diff:e} > tol {tol:e} (terms {terms})"
            ));
        }
    }
    Ok(())
}
