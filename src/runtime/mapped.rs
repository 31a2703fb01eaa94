//! [`MappedHost`]: host-pinned memory mapped into the device's address space
//! (the kernels' error reports). Public with the Cargo feature `raw` (tools
//! use it as a gate their GPUs wait on).

use std::sync::Arc;

use cudarc::driver::{result, CudaContext};

use crate::error::{Error, Result};

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
            tracing::warn!("cuMemFreeHost failed in drop: {e}");
        }
    }
}
