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

/// A host-pinned block mapped into the device's address space: kernels write
/// it (error reports) and the host reads it without a synchronisation.
pub struct MappedHost<T: Copy> {
    host: *mut T,
    device: u64,
    ctx: Arc<CudaContext>,
}

// SAFETY: the pointers are only dereferenced through volatile reads/writes.
unsafe impl<T: Copy> Send for MappedHost<T> {}
unsafe impl<T: Copy> Sync for MappedHost<T> {}

impl<T: Copy> MappedHost<T> {
    /// Allocates and initialises one `T`.
    pub fn new(ctx: &Arc<CudaContext>, init: T) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP
            | cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: size is that of T; the result is checked.
        let host = unsafe { result::malloc_host(std::mem::size_of::<T>(), flags) }
            .map_err(Error::cuda("cuMemHostAlloc"))? as *mut T;
        let mut device = 0u64;
        // SAFETY: host is a live mapped allocation.
        let rc = unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0)
        };
        if rc != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            // SAFETY: allocated above.
            unsafe {
                let _ = result::free_host(host.cast());
            }
            return Err(Error::Cuda {
                context: "cuMemHostGetDevicePointer",
                source: result::DriverError(rc),
            });
        }
        // SAFETY: valid for one T.
        unsafe { std::ptr::write_volatile(host, init) };
        Ok(MappedHost {
            host,
            device,
            ctx: ctx.clone(),
        })
    }
    /// Device address of the block.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }
    /// Reads the current value (whatever kernels have written so far).
    pub fn read(&self) -> T {
        // SAFETY: valid for one T for the life of self.
        unsafe { std::ptr::read_volatile(self.host) }
    }
    /// Overwrites the value (only when no kernel that writes it can run).
    pub fn write(&self, v: T) {
        // SAFETY: as read.
        unsafe { std::ptr::write_volatile(self.host, v) }
    }
}

impl<T: Copy> Drop for MappedHost<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host in new; Drop runs once.
        if let Err(e) = unsafe { result::free_host(self.host.cast()) } {
            eprintln!("moe-ep: cuMemFreeHost failed in drop: {e}");
        }
    }
}
