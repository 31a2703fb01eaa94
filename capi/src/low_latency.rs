//! The low-latency mode: a batch's handle `moe_ep_ll_handle_t`
//! ([`CLlHandle`], which holds its group and the batch's state under a
//! lock), and the calls `moe_ep_ll_buffer_bytes`, `moe_ep_ll_dispatch`,
//! `moe_ep_ll_dispatch_send` / `_wait`, `moe_ep_ll_combine`,
//! `moe_ep_ll_combine_send` / `_wait`, `moe_ep_ll_handle_info`,
//! `moe_ep_ll_handle_buffers` and `moe_ep_ll_handle_destroy`.

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};

use moe_ep::bf16;
use moe_ep::cuda::CudaStream;
use moe_ep::error::{Error, Result};
use moe_ep::ops::{
    DeviceRegion, EpGroup, Fp8Scaling, LlCombineSent, LlDispatchArgs, LlDispatchSent, LlHandle,
    LlInput, LlLayout, RefusedCall, TopkIdx,
};

use crate::buffers::{disjoint, span_of, CRegion, CTopkIdx};
use crate::group::{checked, group_config, group_stream, stream_of, CGroup};
use crate::status::{
    boxed, ffi, obj, out_ptr, unboxed, Status, MOE_EP_LAYOUT_EXPERT_MAJOR,
    MOE_EP_LAYOUT_RANK_MAJOR, MOE_EP_LL_BF16, MOE_EP_LL_CAST_FP8_EXACT,
    MOE_EP_LL_CAST_FP8_POWER_OF_TWO, MOE_EP_LL_COMBINED, MOE_EP_LL_COMBINE_SENT, MOE_EP_LL_FP8,
    MOE_EP_LL_RECEIVED, MOE_EP_LL_SENT,
};
use crate::structs::{
    head, read_in, write_out, CBuf, CGroupConfig, CLlBuffers, CLlCombineArgs, CLlDispatchArgs,
    CLlHandleInfo, Versioned,
};

/// `moe_ep_ll_handle_t`: one low-latency batch, and the group it belongs to.
pub struct CLlHandle {
    // The batch's `LlHandle` holds its own reference to the group; `group`
    // is the same one, for the ops that need the group before the batch
    // is received.
    batch: Mutex<LlBatchState>,
    group: Arc<EpGroup>,
    num_tokens: usize,
    topk: usize,
    layout: LlLayout,
    fp8: bool,
    buffer_set: usize,
}

/// Where a batch is: sent (`sent`), then received (`views`), combine sent
/// (`combine`), combined.
#[derive(Default)]
struct LlBatchState {
    sent: Option<LlDispatchSent>,
    views: Option<LlHandle>,
    combine: Option<LlCombineSent>,
    combined: bool,
}

impl LlBatchState {
    /// `moe_ep_ll_state_t` and its name.
    fn state(&self) -> (u32, &'static str) {
        match (&self.sent, &self.combine, self.combined) {
            (Some(_), _, _) => (MOE_EP_LL_SENT, "MOE_EP_LL_SENT"),
            (None, _, true) => (MOE_EP_LL_COMBINED, "MOE_EP_LL_COMBINED"),
            (None, Some(_), false) => (MOE_EP_LL_COMBINE_SENT, "MOE_EP_LL_COMBINE_SENT"),
            (None, None, false) => (MOE_EP_LL_RECEIVED, "MOE_EP_LL_RECEIVED"),
        }
    }
}

impl CLlHandle {
    fn lock(&self) -> MutexGuard<'_, LlBatchState> {
        self.batch.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Refuses a handle of another group than `group`.
    fn check_group(&self, group: &CGroup) -> Result<()> {
        if group.node().is_ok_and(|g| Arc::ptr_eq(&self.group, g)) {
            return Ok(());
        }
        Err(Error::arg(
            "handle",
            "a low-latency handle of this group",
            "a handle of another group",
        ))
    }
    /// Refuses `op` on a batch `st` that is not in state `want`.
    fn expect_state(op: &str, st: &LlBatchState, want: u32) -> Result<()> {
        let (now, name) = st.state();
        if now == want {
            return Ok(());
        }
        let wanted = [
            "",
            "MOE_EP_LL_SENT",
            "MOE_EP_LL_RECEIVED",
            "MOE_EP_LL_COMBINE_SENT",
        ];
        Err(Error::InvalidState(format!(
            "{op}: the handle's batch is {name}, not {} (each batch is sent, waited for, combine-sent and combine-waited once, in that order)",
            wanted[want as usize]
        )))
    }
}

/// The group, its stream and the handle of a low-latency op; with
/// `same_group`, a handle of another group is refused (naming `handle`).
unsafe fn ll_op<'a>(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CLlHandle,
    same_group: bool,
) -> Result<(&'a CGroup, Arc<CudaStream>, &'a CLlHandle)> {
    // SAFETY: the header's contract for handles and streams.
    unsafe {
        let g = obj(group, "group")?;
        let h = obj(handle, "handle")?;
        if same_group {
            h.check_group(g)?;
        }
        let s = stream_of(g.comm().context(), stream)?;
        Ok((g, s, h))
    }
}

/// A low-latency dispatch's rows as C gave them.
enum LlRows {
    Bf16(CRegion<bf16>),
    Fp8(CRegion<u8>, CRegion<f32>),
}

/// A low-latency dispatch's arguments, checked as C buffers.
struct LlArgs {
    x: LlRows,
    idx: CTopkIdx,
    w: CRegion<f32>,
    layout: LlLayout,
    cast: Option<Fp8Scaling>,
}

impl LlArgs {
    /// The layout of `code`: rank-major or expert-major.
    fn layout(code: u32) -> Result<LlLayout> {
        match code {
            MOE_EP_LAYOUT_RANK_MAJOR => Ok(LlLayout::RankMajor),
            MOE_EP_LAYOUT_EXPERT_MAJOR => Ok(LlLayout::ExpertMajor),
            l => Err(Error::arg(
                "layout",
                "MOE_EP_LAYOUT_RANK_MAJOR or MOE_EP_LAYOUT_EXPERT_MAJOR",
                l,
            )),
        }
    }

    /// The rows as the Rust API takes them.
    fn input(&self) -> LlInput<'_> {
        match &self.x {
            LlRows::Bf16(x) => LlInput::Bf16(x),
            LlRows::Fp8(codes, scales) => LlInput::Fp8 { codes, scales },
        }
    }
}

fn ll_args(a: &CLlDispatchArgs) -> Result<LlArgs> {
    let (cast, fp8_rows) = match a.payload {
        MOE_EP_LL_BF16 => (None, false),
        MOE_EP_LL_CAST_FP8_EXACT => (Some(Fp8Scaling::Exact), false),
        MOE_EP_LL_CAST_FP8_POWER_OF_TWO => (Some(Fp8Scaling::PowerOfTwo), false),
        MOE_EP_LL_FP8 => (None, true),
        p => {
            return Err(Error::arg(
                "payload",
                "a moe_ep_ll_payload_t (MOE_EP_LL_BF16 0 ..= MOE_EP_LL_FP8 3)",
                p,
            ))
        }
    };
    let layout = LlArgs::layout(a.layout)?;
    let idx = CTopkIdx::new(a.topk_idx, a.topk_idx_dtype)?;
    let w = CRegion::<f32>::new("topk_weights", a.topk_weights.ptr, a.topk_weights.len)?;
    let x = if fp8_rows {
        LlRows::Fp8(
            CRegion::<u8>::new("x", a.x.ptr, a.x.len)?,
            CRegion::<f32>::new("x_scales", a.x_scales.ptr, a.x_scales.len)?,
        )
    } else {
        if !a.x_scales.ptr.is_null() || a.x_scales.len != 0 {
            return Err(Error::arg(
                "x_scales",
                "not given ({NULL, 0}): only MOE_EP_LL_FP8 rows come with scales",
                format!("{:p} with len {}", a.x_scales.ptr, a.x_scales.len),
            ));
        }
        LlRows::Bf16(CRegion::<bf16>::new("x", a.x.ptr, a.x.len)?)
    };
    Ok(LlArgs {
        x,
        idx,
        w,
        layout,
        cast,
    })
}

/// The two forms of a low-latency dispatch.
unsafe fn ll_dispatch_impl(
    group: *const CGroup,
    stream: *mut c_void,
    args: *const CLlDispatchArgs,
    out: *mut *mut CLlHandle,
    wait: bool,
) -> Result<()> {
    // SAFETY: the header's contract for handles, streams and structs.
    let on = unsafe { group_stream(group, stream) };
    // A refusal's send moves no rows: a layout these checks refuse is told
    // as rank-major.
    let told = unsafe { read_in(args, "args") }
        .and_then(|a| LlArgs::layout(a.layout))
        .unwrap_or(LlLayout::RankMajor);
    let call = on
        .as_ref()
        .ok()
        .map(|(g, s)| (*g, s, RefusedCall::LlDispatch(told)));
    let (a, la, out) = checked(call, || {
        let a = unsafe { read_in(args, "args") }?;
        let la = ll_args(&a)?;
        Ok((a, la, out_ptr(out, "out")?))
    })?;
    let (g, s) = on?;
    let (topk, layout, cast) = (a.topk as usize, la.layout, la.cast);
    let idx = la.idx.get();
    let idx_len = match idx {
        TopkIdx::I32(r) => r.len(),
        TopkIdx::I64(r) => r.len(),
    };
    let num_tokens = idx_len.checked_div(topk).unwrap_or(0);
    let args = LlDispatchArgs {
        x: la.input(),
        topk_idx: idx,
        topk,
        topk_weights: &la.w,
        layout,
        cast_fp8: cast,
    };
    let group = g.node()?.clone();
    let mut batch = LlBatchState::default();
    let buffer_set = if wait {
        let h = group.ll_dispatch(&s, args)?;
        let set = h.buffer_set();
        batch.views = Some(h);
        set
    } else {
        let sent = group.ll_dispatch_send(&s, args)?;
        let set = sent.buffer_set();
        batch.sent = Some(sent);
        set
    };
    let fp8 = cast.is_some() || a.payload == MOE_EP_LL_FP8;
    let h = CLlHandle {
        batch: Mutex::new(batch),
        group,
        num_tokens,
        topk,
        layout,
        fp8,
        buffer_set,
    };
    unsafe { *out = boxed(h) };
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_buffer_bytes(
    cfg: *const CGroupConfig,
    world: c_int,
    symmetric: *mut u64,
    local: *mut u64,
) -> Status {
    ffi(|| {
        let cfg = group_config(&unsafe { read_in(cfg, "cfg") }?)?;
        let world = usize::try_from(world).map_err(|_| Error::arg("world", ">= 1", world))?;
        cfg.validate(world)?;
        let b = moe_ep::ops::ll_buffer_bytes(&cfg, world);
        // SAFETY: the caller's u64s where given.
        unsafe {
            if !symmetric.is_null() {
                *symmetric = b.symmetric;
            }
            if !local.is_null() {
                *local = b.local;
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_dispatch(
    group: *const CGroup,
    stream: *mut c_void,
    args: *const CLlDispatchArgs,
    out: *mut *mut CLlHandle,
) -> Status {
    ffi(|| unsafe { ll_dispatch_impl(group, stream, args, out, true) })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_dispatch_send(
    group: *const CGroup,
    stream: *mut c_void,
    args: *const CLlDispatchArgs,
    out: *mut *mut CLlHandle,
) -> Status {
    ffi(|| unsafe { ll_dispatch_impl(group, stream, args, out, false) })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_dispatch_wait(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *mut CLlHandle,
) -> Status {
    ffi(|| {
        let (g, s, h) = unsafe { ll_op(group, stream, handle, false) }?;
        // The handle's group and the batch's state, refused as the wait's
        // own refusals are (no peer waits for it).
        let call = Some((g, &s, RefusedCall::LlDispatchWait));
        let mut st = checked(call, || {
            h.check_group(g)?;
            let st = h.lock();
            CLlHandle::expect_state("moe_ep_ll_dispatch_wait", &st, MOE_EP_LL_SENT)?;
            Ok(st)
        })?;
        let sent = st.sent.as_ref().expect("a sent batch");
        let r = h.group.ll_dispatch_wait(&s, sent)?;
        st.views = Some(r);
        st.sent = None;
        Ok(())
    })
}

/// A combine's buffers as C gave them.
struct CombineBufs {
    y: CRegion<bf16>,
    w: Option<CRegion<f32>>,
    out: CRegion<bf16>,
}

/// What a combine's op returns: the sent combine of a send, `None` for
/// the one call.
type CombineResult = Result<Option<LlCombineSent>>;

/// The buffers of a combine's `args` (`send`: its expert outputs; `wait`:
/// its weights and output).
unsafe fn combine_bufs(args: *const CLlCombineArgs, send: bool, wait: bool) -> Result<CombineBufs> {
    let a = unsafe { read_in(args, "args") }?;
    let y = if send {
        CRegion::<bf16>::new("expert_out", a.expert_out.ptr, a.expert_out.len)?
    } else {
        CRegion::<bf16>::new("expert_out", std::ptr::null(), 0)?
    };
    let (w, out) = if wait {
        (
            CRegion::<f32>::opt("weights", a.weights.ptr, a.weights.len)?,
            CRegion::<bf16>::new("out", a.out.ptr as *const c_void, a.out.len)?,
        )
    } else {
        (None, CRegion::<bf16>::new("out", std::ptr::null(), 0)?)
    };
    disjoint(
        &[Some(out.span("out"))],
        &[Some(y.span("expert_out")), span_of("weights", &w)],
    )?;
    Ok(CombineBufs { y, w, out })
}

/// [`ll_op`] of a combine: where the group, the stream or the handle do not
/// resolve there is nothing to publish with, and a bad buffer (`bufs`) is
/// still named first.
unsafe fn ll_combine_target<'a>(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CLlHandle,
    same_group: bool,
    bufs: impl Fn() -> Result<CombineBufs>,
) -> Result<(&'a CGroup, Arc<CudaStream>, &'a CLlHandle)> {
    unsafe { ll_op(group, stream, handle, same_group) }.or_else(|e| {
        bufs()?;
        Err(e)
    })
}

/// A combine of `handle`'s batch (`wait`: the one call; else its send):
/// the buffers of `args` checked, their refusal told to the batch's homes
/// ([`checked`]) where the group, the stream and the handle resolve and the
/// batch is the group's and received (else no home waits for this rank's
/// rows of it; a handle of another group is refused naming `handle`, and a
/// batch in another state by state, neither told); then `f` with the
/// group, the stream, the batch's views and the buffers, which returns the
/// sent combine of a send (`None`: combined).
unsafe fn ll_combine_op(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *mut CLlHandle,
    args: *const CLlCombineArgs,
    wait: bool,
    op: &str,
    f: impl FnOnce(&EpGroup, &Arc<CudaStream>, &LlHandle, CombineBufs) -> CombineResult,
) -> Result<()> {
    let bufs = || unsafe { combine_bufs(args, true, wait) };
    let (g, s, h) = unsafe { ll_combine_target(group, stream, handle, true, bufs) }?;
    let mut st = h.lock();
    let call = st
        .views
        .as_ref()
        .map(|lh| (g, &s, RefusedCall::LlCombine(lh)));
    let b = checked(call, bufs)?;
    CLlHandle::expect_state(op, &st, MOE_EP_LL_RECEIVED)?;
    let lh = st.views.as_ref().expect("a received batch");
    match f(g.node()?, &s, lh, b)? {
        Some(sent) => st.combine = Some(sent),
        None => st.combined = true,
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_combine(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *mut CLlHandle,
    args: *const CLlCombineArgs,
) -> Status {
    ffi(|| unsafe {
        ll_combine_op(
            group,
            stream,
            handle,
            args,
            true,
            "moe_ep_ll_combine",
            |g, s, lh, mut b| {
                let w = b.w.as_ref().map(|w| w as &dyn DeviceRegion<f32>);
                g.ll_combine(s, lh, &b.y, w, &mut b.out)?;
                Ok(None)
            },
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_combine_send(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *mut CLlHandle,
    args: *const CLlCombineArgs,
) -> Status {
    ffi(|| unsafe {
        ll_combine_op(
            group,
            stream,
            handle,
            args,
            false,
            "moe_ep_ll_combine_send",
            |g, s, lh, b| g.ll_combine_send(s, lh, &b.y).map(Some),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_combine_wait(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *mut CLlHandle,
    args: *const CLlCombineArgs,
) -> Status {
    ffi(|| {
        let bufs = || unsafe { combine_bufs(args, false, true) };
        let (g, s, h) = unsafe { ll_combine_target(group, stream, handle, false, bufs) }?;
        // The buffers, the handle's group and the batch's state, refused as
        // the wait's own refusals are (no peer waits for it).
        let call = Some((g, &s, RefusedCall::LlCombineWait));
        let (mut b, mut st) = checked(call, || {
            let b = bufs()?;
            h.check_group(g)?;
            let st = h.lock();
            CLlHandle::expect_state("moe_ep_ll_combine_wait", &st, MOE_EP_LL_COMBINE_SENT)?;
            Ok((b, st))
        })?;
        let sent = st.combine.as_ref().expect("a sent combine");
        let w = b.w.as_ref().map(|w| w as &dyn DeviceRegion<f32>);
        g.node()?.ll_combine_wait(&s, sent, w, &mut b.out)?;
        st.combine = None;
        st.combined = true;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_handle_info(
    handle: *const CLlHandle,
    out: *mut CLlHandleInfo,
) -> Status {
    ffi(|| {
        unsafe { head(out, "out") }?;
        let h = unsafe { obj(handle, "handle") }?;
        let g = &h.group;
        let (world, m) = (g.comm().world(), g.config().max_tokens_per_rank);
        let el = g.experts_per_rank();
        let num_rows = match h.layout {
            LlLayout::ExpertMajor => el * world * m,
            LlLayout::RankMajor => world * m,
        };
        let v = CLlHandleInfo {
            num_tokens: h.num_tokens as u64,
            topk: h.topk as u64,
            hidden: g.config().hidden as u64,
            num_rows: num_rows as u64,
            num_local_experts: el as u64,
            world: world as u64,
            max_tokens_per_rank: m as u64,
            layout: match h.layout {
                LlLayout::RankMajor => MOE_EP_LAYOUT_RANK_MAJOR,
                LlLayout::ExpertMajor => MOE_EP_LAYOUT_EXPERT_MAJOR,
            },
            fp8: h.fp8 as u32,
            buffer_set: h.buffer_set as u32,
            state: h.lock().state().0,
            ..CLlHandleInfo::init()
        };
        unsafe { write_out(out, "out", &v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_handle_buffers(
    handle: *const CLlHandle,
    out: *mut CLlBuffers,
) -> Status {
    ffi(|| {
        unsafe { head(out, "out") }?;
        let h = unsafe { obj(handle, "handle") }?;
        let st = h.lock();
        let Some(lh) = st.views.as_ref() else {
            return Err(Error::InvalidState(
                "moe_ep_ll_handle_buffers: the handle's batch is MOE_EP_LL_SENT: wait for it first (moe_ep_ll_dispatch_wait)".into(),
            ));
        };
        let v = CLlBuffers {
            tokens: CBuf::view(lh.tokens()),
            fp8_codes: CBuf::view(lh.fp8_codes()),
            fp8_scales: CBuf::view(lh.fp8_scales()),
            src: CBuf::view(Some(lh.src())),
            topk_local_idx: CBuf::view(lh.topk_local_idx()),
            topk_weights: CBuf::view(lh.topk_weights()),
            tokens_per_local_expert: CBuf::view(Some(lh.tokens_per_local_expert())),
            tokens_per_expert_source: CBuf::view(Some(lh.tokens_per_expert_source())),
            tokens_from_rank: CBuf::view(Some(lh.tokens_from_rank())),
            ..CLlBuffers::init()
        };
        unsafe { write_out(out, "out", &v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_handle_destroy(handle: *mut CLlHandle) -> Status {
    ffi(|| {
        // SAFETY: a handle of ours, destroyed once; the batch goes before
        // the group reference that it borrows (field order).
        unsafe { unboxed(handle) };
        Ok(())
    })
}
