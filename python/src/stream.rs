//! The caller's streams: a raw `cudaStream_t` (torch's
//! `torch.cuda.current_stream().cuda_stream`, `0` for the legacy default
//! stream) checked against the communicator's context and wrapped without
//! taking it over; one stream ordered after another (an event); where a
//! pointer lives.

use std::sync::Arc;

use moe_ep::cuda::{result, sys, CudaContext, CudaStream};
use moe_ep::error::{Error, Result};

/// The caller's stream `s`, which must belong to `ctx` (the primary context
/// of the group's GPU, which torch uses too): `moe_ep::runtime::borrow_stream`.
pub(crate) fn wrap(ctx: &Arc<CudaContext>, s: u64) -> Result<Arc<CudaStream>> {
    // SAFETY: the caller keeps the stream alive while the work enqueued on
    // it runs (torch never destroys its pooled streams).
    unsafe { moe_ep::runtime::borrow_stream(ctx, s) }
}

/// Makes `waiter` wait for the work enqueued on `producer` so far.
pub(crate) fn wait_for(ctx: &Arc<CudaContext>, waiter: u64, producer: u64) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(Error::cuda("cuCtxSetCurrent"))?;
    let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(Error::cuda("cuEventCreate"))?;
    // SAFETY: a fresh event and the caller's live streams; the event is
    // destroyed once waited for (the driver keeps what the wait needs).
    let r = unsafe {
        result::event::record(ev, producer as sys::CUstream)
            .map_err(Error::cuda("cuEventRecord"))
            .and_then(|()| {
                result::stream::wait_event(
                    waiter as sys::CUstream,
                    ev,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .map_err(Error::cuda("cuStreamWaitEvent"))
            })
    };
    // SAFETY: ours, not used after this.
    let _ = unsafe { result::event::destroy(ev) };
    r
}

/// The GPU whose memory `ptr` is (`None`: host memory the driver does not
/// know, or pinned host memory).
pub(crate) fn device_of_pointer(ctx: &Arc<CudaContext>, ptr: u64) -> Result<Option<usize>> {
    ctx.bind_to_thread()
        .map_err(Error::cuda("cuCtxSetCurrent"))?;
    let mut kind: u32 = 0;
    // SAFETY: writes one u32; an unknown pointer is an error code.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            &mut kind as *mut u32 as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as sys::CUdeviceptr,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Ok(None);
    }
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(None);
    }
    let mut ordinal: i32 = -1;
    // SAFETY: as above, one i32.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as sys::CUdeviceptr,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS || ordinal < 0 {
        return Ok(None);
    }
    Ok(Some(ordinal as usize))
}
