//! The low-latency mode: `ll_dispatch` (and `ll_dispatch_send` /
//! `ll_dispatch_wait`), `ll_combine` (and `ll_combine_send` /
//! `ll_combine_wait`) on a group of `mode="low_latency"`, and `LlBatch`,
//! one batch: its state (sent, received, combine sent, combined, each once
//! and in that order, as in the C ABI) and its views into the group's
//! buffer set as `DeviceArray`s.

use std::sync::{Arc, Mutex, MutexGuard};

use moe_ep::bf16;
use moe_ep::cuda::CudaContext;
use moe_ep::error::Error;
use moe_ep::ops::{
    DeviceRegion, EpGroup, Fp8Scaling, LlCombineSent, LlDispatchArgs, LlDispatchSent, LlHandle,
    LlInput, LlLayout, RefusedCall, TopkIdx,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack::{DType, DeviceArray, Keep};
use crate::errors::{detached, guarded, value_err, Fail, Res};
use crate::group::{disjoint, Group, Raw};
use crate::stream;

/// Where a batch is.
#[derive(Default)]
struct State {
    sent: Option<LlDispatchSent>,
    views: Option<Arc<LlHandle>>,
    combine: Option<LlCombineSent>,
    combined: bool,
}

impl State {
    fn name(&self) -> &'static str {
        match (&self.sent, &self.combine, self.combined) {
            (Some(_), _, _) => "sent",
            (None, _, true) => "combined",
            (None, Some(_), false) => "combine_sent",
            (None, None, false) => "received",
        }
    }
    fn expect(&self, op: &str, want: &str) -> moe_ep::Result<()> {
        let now = self.name();
        if now == want {
            return Ok(());
        }
        Err(Error::InvalidState(format!(
            "{op}: the batch is {now}, not {want} (each batch is sent, waited for, combine-sent and combine-waited once, in that order)"
        )))
    }
}

/// One low-latency batch of a group.
#[pyclass(frozen, module = "moe_ep._moe_ep", name = "LlBatch")]
pub struct LlBatch {
    group: Arc<EpGroup>,
    ctx: Arc<CudaContext>,
    state: Mutex<State>,
    num_tokens: usize,
    topk: usize,
    layout: LlLayout,
    fp8: bool,
    buffer_set: usize,
    /// The stream of the dispatch's wait (the views are written there).
    stream: Mutex<u64>,
}

impl LlBatch {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// A combine (one call or send) of this batch that the binding's
    /// checks refused: its homes are told ([`Group::publish_refusal`]),
    /// where the batch is this group's and received (else no home waits
    /// for this rank's rows of it).
    fn publish_combine_refusal(&self, py: Python<'_>, g: &Group, stream: u64, e: &Fail) {
        if self.check_group(g).is_err() {
            return;
        }
        let views = self.lock().views.clone();
        if let Some(h) = views {
            g.publish_refusal(py, stream, RefusedCall::LlCombine(&h), e);
        }
    }
    fn check_group(&self, g: &Group) -> Res<()> {
        if Arc::ptr_eq(&self.group, &g.g) {
            return Ok(());
        }
        Err(Fail::Ep(Error::arg(
            "batch",
            "a low-latency batch of this group",
            "a batch of another group",
        )))
    }
    /// The batch's `[..., H]`-row shape: expert-major `[El, R * M]`,
    /// rank-major `[R, M]`.
    fn rows_shape(&self) -> Vec<usize> {
        let (r, m) = (
            self.group.comm().world(),
            self.group.config().max_tokens_per_rank,
        );
        match self.layout {
            LlLayout::ExpertMajor => vec![self.group.experts_per_rank(), r * m],
            LlLayout::RankMajor => vec![r, m],
        }
    }
}

fn parse_ll_layout(s: &str) -> Res<LlLayout> {
    match s {
        "expert_major" => Ok(LlLayout::ExpertMajor),
        "rank_major" => Ok(LlLayout::RankMajor),
        other => Err(value_err(
            "layout",
            "\"expert_major\" or \"rank_major\"",
            other,
        )),
    }
}

fn parse_cast(s: Option<&str>) -> Res<Option<Fp8Scaling>> {
    match s {
        None | Some("none") => Ok(None),
        Some("exact") => Ok(Some(Fp8Scaling::Exact)),
        Some("power_of_two") | Some("pow2") => Ok(Some(Fp8Scaling::PowerOfTwo)),
        Some(other) => Err(value_err(
            "cast_fp8",
            "None, \"exact\" or \"power_of_two\"",
            other,
        )),
    }
}

/// Low-latency dispatch (collective) of `x` `[T, H]` bfloat16 (or, with
/// `x_scales` `[T, H / 128]` float32, the caller's fp8 rows: `x` `[T, H]`
/// float8_e4m3fn or uint8 codes), `topk_idx` `[T, K]` and `topk_weights`
/// `[T, K]` float32. `cast_fp8` casts bf16 rows to fp8 on the sender.
/// `send_only`: the first half only (then `ll_dispatch_wait`).
#[pyfunction]
#[pyo3(signature = (group, stream, x, topk_idx, topk_weights, layout="expert_major",
    cast_fp8=None, x_scales=None, send_only=false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ll_dispatch(
    py: Python<'_>,
    group: &Group,
    stream: u64,
    x: &Bound<'_, PyAny>,
    topk_idx: &Bound<'_, PyAny>,
    topk_weights: &Bound<'_, PyAny>,
    layout: &str,
    cast_fp8: Option<&str>,
    x_scales: Option<&Bound<'_, PyAny>>,
    send_only: bool,
) -> PyResult<LlBatch> {
    // The refusal's send carries no rows: a layout this binding refuses
    // publishes as rank-major.
    let told = parse_ll_layout(layout).unwrap_or(LlLayout::RankMajor);
    group.guarded_op(py, stream, RefusedCall::LlDispatch(told), || {
        let layout = parse_ll_layout(layout)?;
        let cast = parse_cast(cast_fp8)?;
        let hd = group.hidden();
        let idx = group.import(topk_idx, "topk_idx", &[DType::I64, DType::I32], stream)?;
        idx.expect_shape(&[None, None], "[T, topk]")?;
        let (t, k) = (idx.shape[0], idx.shape[1]);
        let w = group.import(topk_weights, "topk_weights", &[DType::F32], stream)?;
        w.expect_shape(&[Some(t), Some(k)], &format!("[T={t}, K={k}]"))?;
        let sc = group.import_opt(x_scales, "x_scales", &[DType::F32], stream)?;
        let fp8_rows = sc.is_some();
        let xa = if fp8_rows {
            group.import(x, "x", &[DType::F8E4M3, DType::U8], stream)?
        } else {
            group.import(x, "x", &[DType::Bf16], stream)?
        };
        xa.expect_shape(&[Some(t), Some(hd)], &format!("[T={t}, H={hd}]"))?;
        if let Some(s) = &sc {
            s.expect_shape(
                &[Some(t), Some(hd.div_ceil(128))],
                &format!("[T={t}, H/128={}]", hd.div_ceil(128)),
            )?;
        }
        let (i64r, i32r) = (Raw::<i64>::of(&idx), Raw::<i32>::of(&idx));
        let wr = Raw::<f32>::of(&w);
        let (xb, xc) = (Raw::<bf16>::of(&xa), Raw::<u8>::of(&xa));
        let scr = sc.as_ref().map(Raw::<f32>::of);
        let idt = idx.dtype;
        let (state, set) = detached(py, || {
            let s = stream::wrap(&group.ctx, stream)?;
            let x = match &scr {
                Some(scales) => LlInput::Fp8 { codes: &xc, scales },
                None => LlInput::Bf16(&xb),
            };
            let args = LlDispatchArgs {
                x,
                topk_idx: match idt {
                    DType::I64 => TopkIdx::I64(&i64r),
                    _ => TopkIdx::I32(&i32r),
                },
                topk: k,
                topk_weights: &wr,
                layout,
                cast_fp8: cast,
            };
            let mut st = State::default();
            let set = if send_only {
                let sent = group.g.ll_dispatch_send(&s, args)?;
                let set = sent.buffer_set();
                st.sent = Some(sent);
                set
            } else {
                let h = group.g.ll_dispatch(&s, args)?;
                let set = h.buffer_set();
                st.views = Some(Arc::new(h));
                set
            };
            Ok((st, set))
        })?;
        Ok(LlBatch {
            group: group.g.clone(),
            ctx: group.ctx.clone(),
            state: Mutex::new(state),
            num_tokens: t,
            topk: k,
            layout,
            fp8: cast.is_some() || fp8_rows,
            buffer_set: set,
            stream: Mutex::new(stream),
        })
    })
}

/// The second half of a sent low-latency dispatch.
#[pyfunction]
pub(crate) fn ll_dispatch_wait(
    py: Python<'_>,
    group: &Group,
    stream: u64,
    batch: &LlBatch,
) -> PyResult<()> {
    group.guarded_op(py, stream, RefusedCall::LlDispatchWait, || {
        batch.check_group(group)?;
        detached(py, || {
            let mut st = batch.lock();
            st.expect("ll_dispatch_wait", "sent")?;
            let s = stream::wrap(&group.ctx, stream)?;
            let sent = st.sent.as_ref().expect("a sent batch");
            let h = group.g.ll_dispatch_wait(&s, sent)?;
            st.views = Some(Arc::new(h));
            st.sent = None;
            Ok(())
        })?;
        *batch.stream.lock().unwrap_or_else(|p| p.into_inner()) = stream;
        Ok(())
    })
}

/// Checks a combine's arrays: `expert_out` `[..., H]` bfloat16 rows in the
/// dispatch's layout, `weights` `[T, K]` float32 (expert-major), `out`
/// `[T, H]` bfloat16.
struct CombineArgs {
    y: Option<crate::dlpack::Array>,
    w: Option<crate::dlpack::Array>,
    out: Option<crate::dlpack::Array>,
}

#[allow(clippy::too_many_arguments)]
fn combine_args(
    group: &Group,
    batch: &LlBatch,
    stream: u64,
    expert_out: Option<&Bound<'_, PyAny>>,
    weights: Option<&Bound<'_, PyAny>>,
    out: Option<&Bound<'_, PyAny>>,
) -> Res<CombineArgs> {
    batch.check_group(group)?;
    let hd = group.hidden();
    let (t, k) = (batch.num_tokens, batch.topk);
    let y = group.import_opt(expert_out, "expert_out", &[DType::Bf16], stream)?;
    if let Some(y) = &y {
        if y.shape.last() != Some(&hd) || y.shape.len() < 2 {
            return Err(value_err(
                "expert_out",
                format!("rows of H={hd} bfloat16 in the dispatch's layout ([..., {hd}])"),
                format!("shape {:?}", y.shape),
            ));
        }
    }
    let w = group.import_opt(weights, "weights", &[DType::F32], stream)?;
    if let Some(w) = &w {
        w.expect_shape(&[Some(t), Some(k)], &format!("[T={t}, K={k}]"))?;
    }
    let o = group.import_opt(out, "out", &[DType::Bf16], stream)?;
    if let Some(o) = &o {
        o.expect_shape(&[Some(t), Some(hd)], &format!("[T={t}, H={hd}]"))?;
    }
    disjoint(&[o.as_ref()], &[y.as_ref(), w.as_ref()])?;
    Ok(CombineArgs { y, w, out: o })
}

/// Low-latency combine (collective): the batch's expert outputs summed home
/// into `out` `[T, H]` bfloat16 (`weights`: expert-major, `None` = the
/// dispatch's).
#[pyfunction]
#[pyo3(signature = (group, stream, batch, expert_out, out, weights=None))]
pub(crate) fn ll_combine(
    py: Python<'_>,
    group: &Group,
    stream: u64,
    batch: &LlBatch,
    expert_out: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    weights: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    guarded(py, || {
        let a = combine_args(group, batch, stream, Some(expert_out), weights, Some(out))
            .inspect_err(|e| batch.publish_combine_refusal(py, group, stream, e))?;
        let yr = Raw::<bf16>::of(a.y.as_ref().expect("given"));
        let wr = a.w.as_ref().map(Raw::<f32>::of);
        let mut or = Raw::<bf16>::of(a.out.as_ref().expect("given"));
        detached(py, || {
            let mut st = batch.lock();
            st.expect("ll_combine", "received")?;
            let s = stream::wrap(&group.ctx, stream)?;
            let h = st.views.as_ref().expect("a received batch");
            let w = wr.as_ref().map(|w| w as &dyn DeviceRegion<f32>);
            group.g.ll_combine(&s, h, &yr, w, &mut or)?;
            st.combined = true;
            Ok(())
        })?;
        Ok(())
    })
}

/// The first half of a low-latency combine: the expert outputs sent home.
#[pyfunction]
pub(crate) fn ll_combine_send(
    py: Python<'_>,
    group: &Group,
    stream: u64,
    batch: &LlBatch,
    expert_out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    guarded(py, || {
        let a = combine_args(group, batch, stream, Some(expert_out), None, None)
            .inspect_err(|e| batch.publish_combine_refusal(py, group, stream, e))?;
        let yr = Raw::<bf16>::of(a.y.as_ref().expect("given"));
        detached(py, || {
            let mut st = batch.lock();
            st.expect("ll_combine_send", "received")?;
            let s = stream::wrap(&group.ctx, stream)?;
            let h = st.views.as_ref().expect("a received batch");
            let sent = group.g.ll_combine_send(&s, h, &yr)?;
            st.combine = Some(sent);
            Ok(())
        })?;
        Ok(())
    })
}

/// The second half of a low-latency combine: the sum into `out`.
#[pyfunction]
#[pyo3(signature = (group, stream, batch, out, weights=None))]
pub(crate) fn ll_combine_wait(
    py: Python<'_>,
    group: &Group,
    stream: u64,
    batch: &LlBatch,
    out: &Bound<'_, PyAny>,
    weights: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    group.guarded_op(py, stream, RefusedCall::LlCombineWait, || {
        let a = combine_args(group, batch, stream, None, weights, Some(out))?;
        let wr = a.w.as_ref().map(Raw::<f32>::of);
        let mut or = Raw::<bf16>::of(a.out.as_ref().expect("given"));
        detached(py, || {
            let mut st = batch.lock();
            st.expect("ll_combine_wait", "combine_sent")?;
            let s = stream::wrap(&group.ctx, stream)?;
            let sent = st.combine.as_ref().expect("a sent combine");
            let w = wr.as_ref().map(|w| w as &dyn DeviceRegion<f32>);
            group.g.ll_combine_wait(&s, sent, w, &mut or)?;
            st.combine = None;
            st.combined = true;
            Ok(())
        })?;
        Ok(())
    })
}

#[pymethods]
impl LlBatch {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    #[getter]
    fn topk(&self) -> usize {
        self.topk
    }
    /// `"expert_major"` or `"rank_major"`.
    #[getter]
    fn layout(&self) -> &'static str {
        match self.layout {
            LlLayout::ExpertMajor => "expert_major",
            LlLayout::RankMajor => "rank_major",
        }
    }
    /// True when the rows are fp8.
    #[getter]
    fn fp8(&self) -> bool {
        self.fp8
    }
    /// The buffer set (0 or 1) holding the batch.
    #[getter]
    fn buffer_set(&self) -> usize {
        self.buffer_set
    }
    /// `"sent"`, `"received"`, `"combine_sent"` or `"combined"`.
    #[getter]
    fn state(&self) -> &'static str {
        self.lock().name()
    }
    /// The batch's arrays on this rank (views into the group's buffer set,
    /// valid until the set takes its next batch): `tokens` (bf16 rows) or
    /// `fp8_codes` / `fp8_scales`, `src`, rank-major `topk_local_idx` /
    /// `topk_weights`, and the counts `tokens_per_local_expert`,
    /// `tokens_per_expert_source`, `tokens_from_rank`. Rows are
    /// expert-major `[El, R * M, ...]`, rank-major `[R, M, ...]`.
    fn buffers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let views = guarded(py, || {
            let st = self.lock();
            st.views.clone().ok_or_else(|| {
                Fail::Ep(Error::InvalidState(
                    "LlBatch.buffers: the batch is sent: wait for it first (ll_dispatch_wait)"
                        .into(),
                ))
            })
        })?;
        let s = *self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let owner: Arc<dyn crate::dlpack::Held> = Arc::new(Keep(views.clone()));
        let rows = self.rows_shape();
        let hd = self.group.config().hidden;
        let (el, r) = (self.group.experts_per_rank(), self.group.comm().world());
        let arr = |p: u64, shape: Vec<usize>, dt: DType| {
            DeviceArray::new(p, shape, dt, &self.ctx, s, owner.clone())
        };
        let with = |last: usize| {
            let mut v = rows.clone();
            v.push(last);
            v
        };
        let d = PyDict::new(py);
        if let Some(v) = views.tokens() {
            d.set_item("tokens", arr(v.device_ptr(), with(hd), DType::Bf16))?;
        }
        if let Some(v) = views.fp8_codes() {
            d.set_item("fp8_codes", arr(v.device_ptr(), with(hd), DType::U8))?;
        }
        if let Some(v) = views.fp8_scales() {
            d.set_item(
                "fp8_scales",
                arr(v.device_ptr(), with(hd.div_ceil(128)), DType::F32),
            )?;
        }
        d.set_item("src", arr(views.src().device_ptr(), with(2), DType::I32))?;
        if let Some(v) = views.topk_local_idx() {
            d.set_item(
                "topk_local_idx",
                arr(v.device_ptr(), with(self.topk), DType::I32),
            )?;
        }
        if let Some(v) = views.topk_weights() {
            d.set_item(
                "topk_weights",
                arr(v.device_ptr(), with(self.topk), DType::F32),
            )?;
        }
        let c = views.tokens_per_local_expert();
        d.set_item(
            "tokens_per_local_expert",
            arr(c.device_ptr(), vec![el], DType::I32),
        )?;
        let c = views.tokens_per_expert_source();
        d.set_item(
            "tokens_per_expert_source",
            arr(c.device_ptr(), vec![el, r], DType::I32),
        )?;
        let c = views.tokens_from_rank();
        d.set_item("tokens_from_rank", arr(c.device_ptr(), vec![r], DType::I32))?;
        Ok(d)
    }
    fn __repr__(&self) -> String {
        format!(
            "LlBatch(num_tokens={}, topk={}, layout={}, fp8={}, buffer_set={}, state={})",
            self.num_tokens,
            self.topk,
            self.layout(),
            self.fp8,
            self.buffer_set,
            self.lock().name()
        )
    }
}
