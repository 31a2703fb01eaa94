//! The CUDA driver, found at run time, and device contexts.
//!
//! cudarc loads libcuda dynamically but panics when it is missing; we probe
//! for it first so that a machine without a driver gets [`Error::NoDriver`].

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, CudaContext};

use crate::error::{Error, Result};

/// Checks once that libcuda loads and `cuInit` succeeds.
pub fn driver() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        let names = cudarc::get_lib_name_candidates("cuda");
        // SAFETY: loading the CUDA driver library runs no initialisers of ours.
        let found = names
            .iter()
            .any(|n| unsafe { libloading::Library::new(n) }.is_ok());
        if !found {
            return Err(format!(
                "libcuda not found (tried {names:?}); install an NVIDIA driver"
            ));
        }
        result::init().map_err(|e| format!("cuInit failed: {e}"))
    })
    .clone()
    .map_err(Error::NoDriver)
}

/// Number of CUDA devices visible to this process.
pub fn device_count() -> Result<usize> {
    driver()?;
    let n = CudaContext::device_count().map_err(Error::cuda("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

/// The primary context of device `ordinal`, bound to the calling thread.
/// cudarc's cross-stream event tracking is turned off: every op of this crate
/// orders its work on the caller's stream itself.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::NotEnoughGpus {
            needed: ordinal + 1,
            found: n,
        });
    }
    let ctx = CudaContext::new(ordinal).map_err(Error::cuda("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: no allocation of this context exists yet.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// A stream the caller owns (a C caller's `cudaStream_t`, torch's
/// `cuda_stream`; `0` for the legacy default stream), wrapped without taking
/// it over. It must be a live stream of `ctx` (checked with
/// `cuStreamGetCtx`); otherwise an error naming `stream`.
///
/// # Safety
/// The stream must stay alive while the returned handle and the work
/// enqueued through it live (the crate orders its own work on it).
pub unsafe fn borrow_stream(
    ctx: &Arc<CudaContext>,
    raw: u64,
) -> Result<Arc<cudarc::driver::CudaStream>> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()
        .map_err(Error::cuda("cuCtxSetCurrent"))?;
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: any value is accepted; a dead stream is an error code.
    let rc = unsafe { sys::cuStreamGetCtx(raw as sys::CUstream, &mut owner) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::arg(
            "stream",
            "a live CUDA stream",
            format!("{raw:#x} (cuStreamGetCtx: {rc:?})"),
        ));
    }
    if owner != ctx.cu_ctx() {
        return Err(Error::arg(
            "stream",
            format!(
                "a stream of the primary context of the communicator's GPU {} (torch's streams are)",
                ctx.ordinal()
            ),
            format!("{raw:#x}, a stream of another context"),
        ));
    }
    // SAFETY: a live stream of this context (checked); the caller keeps it
    // alive (this function's contract).
    Ok(unsafe { ctx.wrap_borrowed_stream(raw as sys::CUstream) })
}
