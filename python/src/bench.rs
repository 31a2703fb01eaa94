//! The same ops called from Rust, for `scripts/python-overhead.py`: what a
//! call costs through Python over the Rust op, measured in one run.

use std::time::Instant;

use moe_ep::bf16;
use moe_ep::ops::{DispatchOut, LlDispatchArgs, LlInput, LlLayout, TopkIdx};
use pyo3::prelude::*;

use crate::dlpack::DType;
use crate::errors::{detached, guarded, value_err};
use crate::group::{Group, Handle, Raw};
use crate::stream;

/// Runs `op` `iters` times from Rust on `stream` with the given arrays and
/// returns `(host seconds per call, seconds per call until the stream
/// drained)`. `op`: `"layout"` (`arrays` = topk_idx), `"dispatch"` (x,
/// topk_weights), `"combine"` (expert_out, out), `"ll"` (ll_dispatch and
/// ll_combine: x, topk_idx, topk_weights, expert_out, out). Two probes of
/// where the host time goes: `"layout_keep"` is `"layout"` with every
/// handle kept until the loop's time is taken (what dropping one costs),
/// `"pool"` (x, topk_weights; `handle`) the four pool allocations a
/// dispatch into the pool makes, and their release, without a kernel.
#[pyfunction]
#[pyo3(signature = (group, stream, op, iters, arrays, handle=None, layout="expert_major"))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _rust_loop(
    py: Python<'_>,
    group: &Group,
    stream: u64,
    op: &str,
    iters: usize,
    arrays: Vec<Bound<'_, PyAny>>,
    handle: Option<&Handle>,
    layout: &str,
) -> PyResult<(f64, f64)> {
    guarded(py, || {
        let want: &[&[DType]] = match op {
            "layout" | "layout_keep" => &[&[DType::I64]],
            "dispatch" | "pool" => &[&[DType::Bf16], &[DType::F32]],
            "combine" => &[&[DType::Bf16], &[DType::Bf16]],
            "ll" => &[
                &[DType::Bf16],
                &[DType::I64],
                &[DType::F32],
                &[DType::Bf16],
                &[DType::Bf16],
            ],
            other => {
                return Err(value_err(
                    "op",
                    "layout, layout_keep, dispatch, pool, combine or ll",
                    other,
                ))
            }
        };
        if arrays.len() != want.len() {
            return Err(value_err(
                "arrays",
                format!("{} arrays for {op}", want.len()),
                arrays.len(),
            ));
        }
        let a = arrays
            .iter()
            .zip(want)
            .map(|(o, w)| group.import(o, "arrays", w, stream))
            .collect::<Result<Vec<_>, _>>()?;
        let h = match (op, handle) {
            ("layout" | "layout_keep" | "ll", _) => None,
            (_, Some(h)) => Some(&h.h),
            (_, None) => return Err(value_err("handle", "the layout's handle", "None")),
        };
        let ll = match layout {
            "rank_major" => LlLayout::RankMajor,
            _ => LlLayout::ExpertMajor,
        };
        let topk = a[0].shape.get(1).copied().unwrap_or(1);
        detached(py, || {
            let s = stream::wrap(&group.ctx, stream)?;
            s.synchronize()
                .map_err(moe_ep::Error::cuda("cuStreamSynchronize"))?;
            let rl = match ll {
                LlLayout::RankMajor => moe_ep::RecvLayout::RankMajor,
                LlLayout::ExpertMajor => moe_ep::RecvLayout::ExpertMajor { alignment: 1 },
            };
            let mut kept = Vec::new();
            let t0 = Instant::now();
            for _ in 0..iters {
                match op {
                    "layout" | "layout_keep" => {
                        let idx = Raw::<i64>::of(&a[0]);
                        let h = group.g.layout(&s, TopkIdx::I64(&idx), topk, rl)?;
                        if op == "layout_keep" {
                            kept.push(h);
                        }
                    }
                    "pool" => {
                        // dispatch's: recv_tokens, recv_topk_weights, the
                        // received ids and sources.
                        let h = h.expect("checked");
                        let (cap, pool) = (group.g.recv_capacity(), group.g.pool());
                        let k = h.topk();
                        let wpr = match h.layout() {
                            moe_ep::RecvLayout::RankMajor => k,
                            moe_ep::RecvLayout::ExpertMajor { .. } => 1,
                        };
                        drop((
                            pool.alloc::<bf16>(cap * group.hidden())?,
                            pool.alloc::<f32>(cap * wpr)?,
                            pool.alloc::<i32>(cap * wpr)?,
                            pool.alloc::<i32>(cap * 2)?,
                        ));
                    }
                    "dispatch" => {
                        let (x, w) = (Raw::<bf16>::of(&a[0]), Raw::<f32>::of(&a[1]));
                        let h = h.expect("checked");
                        drop(group.g.dispatch(&s, h, &x, &w, DispatchOut::default())?);
                    }
                    "combine" => {
                        let y = Raw::<bf16>::of(&a[0]);
                        let mut o = Raw::<bf16>::of(&a[1]);
                        group.g.combine(&s, h.expect("checked"), &y, None, &mut o)?;
                    }
                    _ => {
                        let (x, idx, w) = (
                            Raw::<bf16>::of(&a[0]),
                            Raw::<i64>::of(&a[1]),
                            Raw::<f32>::of(&a[2]),
                        );
                        let (y, mut o) = (Raw::<bf16>::of(&a[3]), Raw::<bf16>::of(&a[4]));
                        let k = a[1].shape.get(1).copied().unwrap_or(1);
                        let b = group.g.ll_dispatch(
                            &s,
                            LlDispatchArgs {
                                x: LlInput::Bf16(&x),
                                topk_idx: TopkIdx::I64(&idx),
                                topk: k,
                                topk_weights: &w,
                                layout: ll,
                                cast_fp8: None,
                            },
                        )?;
                        group.g.ll_combine(&s, &b, &y, None, &mut o)?;
                    }
                }
            }
            let host = t0.elapsed().as_secs_f64();
            drop(kept);
            s.synchronize()
                .map_err(moe_ep::Error::cuda("cuStreamSynchronize"))?;
            let total = t0.elapsed().as_secs_f64();
            let n = iters.max(1) as f64;
            Ok((host / n, total / n))
        })
    })
}
