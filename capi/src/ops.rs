//! High-throughput ops: the layout's handle `moe_ep_handle_t` ([`CHandle`],
//! of either kind of group) and the calls `moe_ep_layout`,
//! `moe_ep_handle_*` (the counts, and the drop policy's results: dropped
//! rows and slots, the kept routing), `moe_ep_dispatch`,
//! `moe_ep_dispatch_fp8`, `moe_ep_dispatched_*`, `moe_ep_combine`,
//! `moe_ep_combine_backward` and `moe_ep_dispatch_backward`.

use std::ffi::c_void;
use std::sync::Arc;

use moe_ep::bf16;
use moe_ep::cuda::{CudaStream, DeviceSlice};
use moe_ep::error::{Error, Result};
use moe_ep::ops::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, DispatchOutFp8, Fp8Rows,
    Fp8Scales, Handle, RecvBuf, RecvLayout, RecvScales, RecvScalesOut, RefusedCall,
};

use crate::buffers::{disjoint, span_of, CBuffer, CDispatched, CRegion, CTopkIdx, Kept, Span};
use crate::group::{checked, group_stream, stream_of, CGroup};
use crate::status::{
    boxed, ffi, obj, out_ptr, unboxed, Status, MOE_EP_FP8_SCALES_E8M0_PER_32,
    MOE_EP_FP8_SCALES_F32_PER_128, MOE_EP_LAYOUT_EXPERT_MAJOR, MOE_EP_LAYOUT_RANK_MAJOR,
};
use crate::structs::{
    head, read_in, write_out, CBuf, CBufMut, CCombineArgs, CCombineBackwardArgs, CDispatchArgs,
    CDispatchBackwardArgs, CDispatchFp8Args, CHandleCounts, CLayoutArgs, CRecvBuffers, Versioned,
};

/// `moe_ep_handle_t`: a layout of the group (of one node or of several).
pub struct CHandle(Handle);

impl CHandle {
    /// The layout: the rows this rank receives.
    fn node(&self) -> &Handle {
        &self.0
    }
    /// This rank's tokens and their top-k, as the layout was given them.
    fn tokens_topk(&self) -> (usize, usize) {
        (self.0.num_tokens(), self.0.topk())
    }
}

/// `$body` with the group and the handle of an op as `$g` and `$h` (the
/// group refuses a handle of another group, naming `handle`).
macro_rules! on_kind {
    ($group:expr, $handle:expr, |$g:ident, $h:ident| $body:expr) => {{
        let ($g, $h) = (&$group.0, &$handle.0);
        $body
    }};
}
// ---- ops ------------------------------------------------------------------

/// The group, its stream and the handle of an op (see `on_kind`).
unsafe fn op<'a>(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CHandle,
) -> Result<Op<'a>> {
    // SAFETY: the header's contract for handles and streams.
    unsafe {
        let g = obj(group, "group")?;
        let h = obj(handle, "handle")?;
        let s = stream_of(g.comm().context(), stream)?;
        Ok((g, s, h))
    }
}

/// An op's group, stream and handle ([`op`]).
type Op<'a> = (&'a CGroup, Arc<CudaStream>, &'a CHandle);

/// Where an op's group, stream and handle resolved (`on`): the group and
/// stream on which a refusal of the C ABI's own checks is published, as
/// `call` of the handle ([`checked`]); the op's entry checks the handle
/// there first (another group's, or a stale one, is refused naming
/// `handle`, as the op refuses it). `None` where they did not: nothing can
/// be published.
fn refusing<'a>(
    on: &'a Result<Op<'a>>,
    call: fn(&'a Handle) -> RefusedCall<'a>,
) -> Option<(&'a CGroup, &'a Arc<CudaStream>, RefusedCall<'a>)> {
    on.as_ref().ok().map(|(g, s, h)| (*g, s, call(&h.0)))
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_layout(
    group: *const CGroup,
    stream: *mut c_void,
    args: *const CLayoutArgs,
    out: *mut *mut CHandle,
) -> Status {
    ffi(|| {
        // The arguments are checked first (named even beside a NULL
        // group); a refusal is published where the group and stream resolve.
        let on = unsafe { group_stream(group, stream) };
        let call = on.as_ref().ok().map(|(g, s)| (*g, s, RefusedCall::Layout));
        let (a, idx, layout, out) = checked(call, || {
            let a = unsafe { read_in(args, "args") }?;
            let idx = CTopkIdx::new(a.topk_idx, a.topk_idx_dtype)?;
            let layout = match (a.layout, a.alignment) {
                (MOE_EP_LAYOUT_RANK_MAJOR, 0) => RecvLayout::RankMajor,
                (MOE_EP_LAYOUT_RANK_MAJOR, al) => {
                    return Err(Error::arg("alignment", "0 for a rank-major layout", al))
                }
                (MOE_EP_LAYOUT_EXPERT_MAJOR, al) => RecvLayout::ExpertMajor {
                    alignment: al as usize,
                },
                (l, _) => {
                    return Err(Error::arg(
                        "layout",
                        "MOE_EP_LAYOUT_RANK_MAJOR or MOE_EP_LAYOUT_EXPERT_MAJOR",
                        l,
                    ))
                }
            };
            layout.validate()?;
            let out = out_ptr(out, "out")?;
            Ok((a, idx, layout, out))
        })?;
        let (g, s) = on?;
        let h = g.0.layout(&s, idx.get(), a.topk as usize, layout)?;
        unsafe { *out = boxed(CHandle(h)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_handle_destroy(handle: *mut CHandle) -> Status {
    ffi(|| {
        // SAFETY: a handle of ours, destroyed once; its arrays are freed
        // in the order of the stream its layout ran on.
        unsafe { unboxed(handle) };
        Ok(())
    })
}

/// The caller's stream, checked against the context of the handle's arrays
/// (a view of them names their stream, as the arena does inside moe-ep).
unsafe fn handle_stream(h: &Handle, stream: *mut c_void) -> Result<Arc<CudaStream>> {
    let ctx = h.tokens_per_local_expert().stream().context().clone();
    // SAFETY: the header's contract for streams.
    unsafe { stream_of(&ctx, stream) }
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_handle_counts(
    handle: *const CHandle,
    stream: *mut c_void,
    out: *mut CHandleCounts,
) -> Status {
    ffi(|| {
        unsafe { head(out, "out") }?;
        let handle = unsafe { obj(handle, "handle") }?;
        let h = handle.node();
        let s = unsafe { handle_stream(h, stream) }?;
        let c = h.host_counts(&s)?;
        let (num_tokens, topk) = handle.tokens_topk();
        let v = CHandleCounts {
            num_tokens: num_tokens as u64,
            topk: topk as u64,
            recv_rows: c.recv_rows as u64,
            recv_tokens: c.recv_tokens as u64,
            num_local_experts: c.tokens_per_local_expert.len() as u64,
            max_recv_rows: c.max_recv_rows as u64,
            dropped_rows: c.dropped_rows.iter().sum::<usize>() as u64,
            ..CHandleCounts::init()
        };
        unsafe { write_out(out, "out", &v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_handle_tokens_per_local_expert(
    handle: *const CHandle,
    out: *mut CBuf,
) -> Status {
    ffi(|| {
        let h = unsafe { obj(handle, "handle") }?.node();
        let out = out_ptr(out, "out")?;
        unsafe { *out = CBuf::view(Some(h.tokens_per_local_expert())) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_handle_dropped_rows(
    handle: *const CHandle,
    stream: *mut c_void,
    out: *mut u64,
    len: usize,
) -> Status {
    ffi(|| {
        if out.is_null() {
            return Err(Error::arg("out", "a host array of `len` uint64_t", "NULL"));
        }
        let h = unsafe { obj(handle, "handle") }?.node();
        let s = unsafe { handle_stream(h, stream) }?;
        let rows = h.host_counts(&s)?.dropped_rows;
        if len < rows.len() {
            return Err(Error::arg(
                "len",
                format!("at least the world's {} ranks", rows.len()),
                len,
            ));
        }
        for (i, &n) in rows.iter().enumerate() {
            // SAFETY: the caller's array of `len` >= rows.len() entries.
            unsafe { *out.add(i) = n as u64 };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_handle_dropped_slots(
    handle: *const CHandle,
    stream: *mut c_void,
    out: *mut u8,
    len: usize,
) -> Status {
    ffi(|| {
        if out.is_null() && len > 0 {
            return Err(Error::arg(
                "out",
                "a host array of `len` bytes (NULL only with len 0)",
                format!("NULL with len {len}"),
            ));
        }
        let handle = unsafe { obj(handle, "handle") }?;
        let (t, k) = handle.tokens_topk();
        if len < t * k {
            return Err(Error::arg(
                "len",
                format!("at least the handle's T * topk = {t} * {k} slots"),
                len,
            ));
        }
        let h = handle.node();
        let s = unsafe { handle_stream(h, stream) }?;
        let slots = h.dropped_slots(&s)?;
        for (i, &d) in slots.iter().enumerate() {
            // SAFETY: the caller's array of `len` >= T * topk bytes.
            unsafe { *out.add(i) = d as u8 };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_handle_kept_topk_idx(
    handle: *const CHandle,
    out: *mut CBuf,
) -> Status {
    ffi(|| {
        let h = unsafe { obj(handle, "handle") }?.node();
        let out = out_ptr(out, "out")?;
        let Some(v) = h.kept_topk_idx() else {
            return Err(Error::arg(
                "handle",
                "a handle of a group of one node (the drop policy runs on one node)",
                "a handle of a group of several nodes",
            ));
        };
        unsafe { *out = CBuf::view(Some(v)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_handle_device_bytes(
    handle: *const CHandle,
    out: *mut u64,
) -> Status {
    ffi(|| {
        let h = unsafe { obj(handle, "handle") }?.node();
        let out = out_ptr(out, "out")?;
        unsafe { *out = h.device_bytes() };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_dispatch(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CHandle,
    args: *const CDispatchArgs,
    out: *mut *mut CDispatched,
) -> Status {
    ffi(|| {
        let on = unsafe { op(group, stream, handle) };
        let (x, w, mut rt, mut rw, out) = checked(refusing(&on, RefusedCall::Dispatch), || {
            let a = unsafe { read_in(args, "args") }?;
            let x = CRegion::<bf16>::new("x", a.x.ptr, a.x.len)?;
            let w = CRegion::<f32>::new("topk_weights", a.topk_weights.ptr, a.topk_weights.len)?;
            let rt = CRegion::<bf16>::opt("recv_tokens", a.recv_tokens.ptr, a.recv_tokens.len)?;
            let rw = CRegion::<f32>::opt(
                "recv_topk_weights",
                a.recv_topk_weights.ptr,
                a.recv_topk_weights.len,
            )?;
            disjoint(
                &[
                    span_of("recv_tokens", &rt),
                    span_of("recv_topk_weights", &rw),
                ],
                &[Some(x.span("x")), Some(w.span("topk_weights"))],
            )?;
            Ok((x, w, rt, rw, out_ptr(out, "out")?))
        })?;
        let (g, s, h) = on?;
        let d = on_kind!(g, h, |g, h| g.dispatch(
            &s,
            h,
            &x,
            &w,
            DispatchOut {
                recv_tokens: rt.as_mut().map(|r| r as &mut dyn DeviceRegionMut<bf16>),
                recv_topk_weights: rw.as_mut().map(|r| r as &mut dyn DeviceRegionMut<f32>),
            },
        ))?;
        let kept = CDispatched {
            tokens: Kept::of(d.tokens),
            scales: None,
            topk_weights: Kept::of(d.topk_weights),
            topk_idx: d.topk_idx,
            src: d.src,
        };
        unsafe { *out = boxed(kept) };
        Ok(())
    })
}

/// An fp8 dispatch's scales of `kind`: the caller's input and, where given,
/// its receive buffer.
enum CScales {
    E8m0(CRegion<u8>, Option<CRegion<u8>>),
    F32(CRegion<f32>, Option<CRegion<f32>>),
}

impl CScales {
    fn new(kind: u32, x: CBuf, recv: CBufMut) -> Result<CScales> {
        let rp = recv.ptr as *const c_void;
        Ok(match kind {
            MOE_EP_FP8_SCALES_E8M0_PER_32 => CScales::E8m0(
                CRegion::new("scales", x.ptr, x.len)?,
                CRegion::opt("recv_scales", rp, recv.len)?,
            ),
            MOE_EP_FP8_SCALES_F32_PER_128 => CScales::F32(
                CRegion::new("scales", x.ptr, x.len)?,
                CRegion::opt("recv_scales", rp, recv.len)?,
            ),
            k => {
                return Err(Error::arg(
                    "scale_kind",
                    "MOE_EP_FP8_SCALES_E8M0_PER_32 (1) or MOE_EP_FP8_SCALES_F32_PER_128 (2)",
                    k,
                ))
            }
        })
    }
    fn spans(&self) -> (Option<Span>, Option<Span>) {
        match self {
            CScales::E8m0(x, r) => (Some(x.span("scales")), span_of("recv_scales", r)),
            CScales::F32(x, r) => (Some(x.span("scales")), span_of("recv_scales", r)),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_dispatch_fp8(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CHandle,
    args: *const CDispatchFp8Args,
    out: *mut *mut CDispatched,
) -> Status {
    ffi(|| {
        let on = unsafe { op(group, stream, handle) };
        let checks = || {
            let a = unsafe { read_in(args, "args") }?;
            let codes = CRegion::<u8>::new("codes", a.codes.ptr, a.codes.len)?;
            let sc = CScales::new(a.scale_kind, a.scales, a.recv_scales)?;
            let w = CRegion::<f32>::new("topk_weights", a.topk_weights.ptr, a.topk_weights.len)?;
            let rc = CRegion::<u8>::opt("recv_codes", a.recv_codes.ptr, a.recv_codes.len)?;
            let rw = CRegion::<f32>::opt(
                "recv_topk_weights",
                a.recv_topk_weights.ptr,
                a.recv_topk_weights.len,
            )?;
            let (xs, rs) = sc.spans();
            disjoint(
                &[
                    span_of("recv_codes", &rc),
                    rs,
                    span_of("recv_topk_weights", &rw),
                ],
                &[Some(codes.span("codes")), xs, Some(w.span("topk_weights"))],
            )?;
            Ok((codes, sc, w, rc, rw, out_ptr(out, "out")?))
        };
        let (codes, mut sc, w, mut rc, mut rw, out) =
            checked(refusing(&on, RefusedCall::Dispatch), checks)?;
        let (g, s, h) = on?;
        let (scales, recv_scales) = match &mut sc {
            CScales::E8m0(x, r) => (
                Fp8Scales::E8m0Per32(x as &dyn DeviceRegion<u8>),
                r.as_mut().map(|r| RecvScalesOut::E8m0Per32(r)),
            ),
            CScales::F32(x, r) => (
                Fp8Scales::F32Per128(x as &dyn DeviceRegion<f32>),
                r.as_mut().map(|r| RecvScalesOut::F32Per128(r)),
            ),
        };
        let d = on_kind!(g, h, |g, h| g.dispatch_fp8(
            &s,
            h,
            Fp8Rows {
                codes: &codes,
                scales,
            },
            &w,
            DispatchOutFp8 {
                recv_codes: rc.as_mut().map(|r| r as &mut dyn DeviceRegionMut<u8>),
                recv_scales,
                recv_topk_weights: rw.as_mut().map(|r| r as &mut dyn DeviceRegionMut<f32>),
            },
        ))?;
        let scales = match d.scales {
            RecvScales::E8m0Per32(b) => (Kept::of(b), MOE_EP_FP8_SCALES_E8M0_PER_32),
            RecvScales::F32Per128(b) => (Kept::of(b), MOE_EP_FP8_SCALES_F32_PER_128),
        };
        let kept = CDispatched {
            tokens: Kept::of(d.codes),
            scales: Some(scales),
            topk_weights: Kept::of(d.topk_weights),
            topk_idx: d.topk_idx,
            src: d.src,
        };
        unsafe { *out = boxed(kept) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_dispatched_buffers(
    dispatched: *const CDispatched,
    out: *mut CRecvBuffers,
) -> Status {
    ffi(|| {
        unsafe { head(out, "out") }?;
        let d = unsafe { obj(dispatched, "dispatched") }?;
        let v = CRecvBuffers {
            tokens: CBufMut::of(d.tokens.ptr, d.tokens.len),
            topk_weights: CBufMut::of(d.topk_weights.ptr, d.topk_weights.len),
            topk_idx: CBufMut::of(d.topk_idx.device_ptr(), d.topk_idx.len()),
            src: CBufMut::of(d.src.device_ptr(), d.src.len()),
            scales: d
                .scales
                .as_ref()
                .map_or(CBufMut::of(0, 0), |(b, _)| CBufMut::of(b.ptr, b.len)),
            scale_kind: d.scales.as_ref().map_or(0, |&(_, k)| k),
            ..CRecvBuffers::init()
        };
        unsafe { write_out(out, "out", &v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_dispatched_destroy(dispatched: *mut CDispatched) -> Status {
    ffi(|| {
        // SAFETY: a result of ours, destroyed once.
        unsafe { unboxed(dispatched) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_combine(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CHandle,
    args: *const CCombineArgs,
) -> Status {
    ffi(|| {
        let on = unsafe { op(group, stream, handle) };
        let (y, w, mut o) = checked(refusing(&on, RefusedCall::Combine), || {
            let a = unsafe { read_in(args, "args") }?;
            let y = CRegion::<bf16>::new("expert_out", a.expert_out.ptr, a.expert_out.len)?;
            let w = CRegion::<f32>::opt("weights", a.weights.ptr, a.weights.len)?;
            let o = CRegion::<bf16>::new("out", a.out.ptr as *const c_void, a.out.len)?;
            disjoint(
                &[Some(o.span("out"))],
                &[Some(y.span("expert_out")), span_of("weights", &w)],
            )?;
            Ok((y, w, o))
        })?;
        let (g, s, h) = on?;
        on_kind!(g, h, |g, h| g.combine(
            &s,
            h,
            &y,
            w.as_ref().map(|w| w as &dyn DeviceRegion<f32>),
            &mut o,
        ))
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_combine_backward(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CHandle,
    args: *const CCombineBackwardArgs,
    out: *mut *mut CBuffer,
) -> Status {
    ffi(|| {
        let on = unsafe { op(group, stream, handle) };
        let (go, w, mut ge) = checked(refusing(&on, RefusedCall::CombineBackward), || {
            let a = unsafe { read_in(args, "args") }?;
            let go = CRegion::<bf16>::new("grad_out", a.grad_out.ptr, a.grad_out.len)?;
            let w = CRegion::<f32>::opt("weights", a.weights.ptr, a.weights.len)?;
            let ge = CRegion::<bf16>::opt(
                "grad_expert_out",
                a.grad_expert_out.ptr,
                a.grad_expert_out.len,
            )?;
            disjoint(
                &[span_of("grad_expert_out", &ge)],
                &[Some(go.span("grad_out")), span_of("weights", &w)],
            )?;
            if ge.is_none() {
                out_ptr(out, "out")?;
            }
            Ok((go, w, ge))
        })?;
        let (g, s, h) = on?;
        let r = on_kind!(g, h, |g, h| g.combine_backward(
            &s,
            h,
            &go,
            w.as_ref().map(|w| w as &dyn DeviceRegion<f32>),
            ge.as_mut().map(|r| r as &mut dyn DeviceRegionMut<bf16>),
        ))?;
        let pool = match r {
            RecvBuf::Pool(b) => boxed(CBuffer::Bf16(b)),
            RecvBuf::Caller(_) => std::ptr::null_mut(),
        };
        if !out.is_null() {
            unsafe { *out = pool };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_dispatch_backward(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CHandle,
    args: *const CDispatchBackwardArgs,
) -> Status {
    ffi(|| {
        let on = unsafe { op(group, stream, handle) };
        let checks = || {
            let a = unsafe { read_in(args, "args") }?;
            let gr = CRegion::<bf16>::new(
                "grad_recv_tokens",
                a.grad_recv_tokens.ptr,
                a.grad_recv_tokens.len,
            )?;
            let grw = CRegion::<f32>::opt(
                "grad_recv_topk_weights",
                a.grad_recv_topk_weights.ptr,
                a.grad_recv_topk_weights.len,
            )?;
            let gt = CRegion::<bf16>::new(
                "grad_tokens",
                a.grad_tokens.ptr as *const c_void,
                a.grad_tokens.len,
            )?;
            let gtw = CRegion::<f32>::opt(
                "grad_topk_weights",
                a.grad_topk_weights.ptr,
                a.grad_topk_weights.len,
            )?;
            disjoint(
                &[
                    Some(gt.span("grad_tokens")),
                    span_of("grad_topk_weights", &gtw),
                ],
                &[
                    Some(gr.span("grad_recv_tokens")),
                    span_of("grad_recv_topk_weights", &grw),
                ],
            )?;
            Ok((gr, grw, gt, gtw))
        };
        let (gr, grw, mut gt, mut gtw) =
            checked(refusing(&on, RefusedCall::DispatchBackward), checks)?;
        let (g, s, h) = on?;
        on_kind!(g, h, |g, h| g.dispatch_backward(
            &s,
            h,
            DispatchBackwardArgs {
                grad_recv_tokens: &gr,
                grad_recv_topk_weights: grw.as_ref().map(|w| w as &dyn DeviceRegion<f32>),
                grad_tokens: &mut gt,
                grad_topk_weights: gtw.as_mut().map(|w| w as &mut dyn DeviceRegionMut<f32>),
            },
        ))
    })
}
