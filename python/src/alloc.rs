//! Symmetric memory for torch's own allocations: `moe_ep_torch_alloc` and
//! `moe_ep_torch_free`, the two C functions of a
//! `torch.cuda.memory.CUDAPluggableAllocator` over this library, so that a
//! `torch.cuda.MemPool` hands out buffers of a group's symmetric pool (as
//! TransformerEngine places its own buffers in NCCL windows). Which pool
//! serves an allocation is the calling thread's choice
//! (`Group.symmetric_allocations()` in Python sets it around a
//! `torch.cuda.use_mem_pool`): each virtual rank is a thread of its own.
//! Collective by contract, like every pool allocation: every rank makes the
//! same allocations in the same order.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use moe_ep::cuda::CudaContext;
use moe_ep::{SymmBuffer, SymmPool};
use pyo3::prelude::*;

use crate::group::Group;

thread_local! {
    /// The pool that serves this thread's torch allocations, and its GPU.
    static CURRENT: RefCell<Option<(SymmPool, Arc<CudaContext>)>> = const { RefCell::new(None) };
}

/// Live allocations by address, each with its context (for the free's
/// stream).
type Live = HashMap<u64, (SymmBuffer<u8>, Arc<CudaContext>)>;

fn live() -> &'static Mutex<Live> {
    static LIVE: OnceLock<Mutex<Live>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Sets (or, with `None`, clears) the pool that serves this thread's
/// allocations through `moe_ep_torch_alloc`.
#[pyfunction]
#[pyo3(signature = (group=None))]
pub(crate) fn _set_allocation_group(group: Option<&Group>) {
    let v = group.map(|g| (g.g.pool().clone(), g.ctx.clone()));
    CURRENT.with(|c| *c.borrow_mut() = v);
}

/// Bytes handed out to torch and not freed yet (for the tests).
#[pyfunction]
pub(crate) fn _torch_allocations() -> usize {
    live()
        .lock()
        .map(|l| l.values().map(|(b, _)| b.len()).sum())
        .unwrap_or(0)
}

extern "C" {
    /// CPython's "does this thread hold the GIL" (public C API since 3.4,
    /// exported by every interpreter this abi3 module loads into; PyO3 does
    /// not bind it under the limited API). Safe to call without the GIL.
    fn PyGILState_Check() -> c_int;
}

/// torch's `alloc(size, device, stream)`: `size` bytes of the current
/// thread's group's pool; NULL (torch reports out of memory) without a
/// group, on another device, or on failure. Never unwinds.
///
/// # Safety
/// Called by torch's pluggable allocator with its own arguments.
#[no_mangle]
pub unsafe extern "C" fn moe_ep_torch_alloc(
    size: isize,
    device: c_int,
    _stream: *mut c_void,
) -> *mut c_void {
    let r = std::panic::catch_unwind(|| {
        let cur = CURRENT.with(|c| c.borrow().clone());
        let (pool, ctx) = cur?;
        if device < 0 || device as usize != ctx.ordinal() || size < 0 {
            return None;
        }
        // A new segment is a host collective of a virtual world. torch
        // calls this under its allocator's device lock, mostly with the GIL
        // released (torch.empty releases it): then the GIL is left alone,
        // since taking it here would wait for a sibling rank's thread that
        // holds the GIL while it waits for that same allocator lock (a
        // lock-order inversion: two virtual ranks allocating at once hung).
        // Called with the GIL held, it is released while the pool
        // allocates, so that the siblings' threads can reach their own
        // allocation.
        // SAFETY: PyGILState_Check may be called without the GIL; the
        // save/restore pair is balanced on this thread and runs only when
        // this thread holds the GIL.
        let alloc = || pool.alloc::<u8>(size as usize);
        let b = unsafe {
            if PyGILState_Check() == 1 {
                let ts = pyo3::ffi::PyEval_SaveThread();
                let b = std::panic::catch_unwind(std::panic::AssertUnwindSafe(alloc));
                pyo3::ffi::PyEval_RestoreThread(ts);
                b
            } else {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(alloc))
            }
        };
        let b = b.ok()?.ok()?;
        let p = b.device_ptr();
        live().lock().ok()?.insert(p, (b, ctx));
        Some(p as *mut c_void)
    });
    r.ok().flatten().unwrap_or(std::ptr::null_mut())
}

/// torch's `free(ptr, size, device, stream)`: returns the buffer to its
/// pool, its range reused only after the work enqueued on `stream` so far.
/// Never unwinds.
///
/// # Safety
/// Called by torch's pluggable allocator with a pointer it got from
/// [`moe_ep_torch_alloc`] and a live stream of the device.
#[no_mangle]
pub unsafe extern "C" fn moe_ep_torch_free(
    ptr: *mut c_void,
    _size: isize,
    _device: c_int,
    stream: *mut c_void,
) {
    let _ = std::panic::catch_unwind(|| {
        let Some((b, ctx)) = live().lock().ok().and_then(|mut l| l.remove(&(ptr as u64))) else {
            return;
        };
        if let Ok(s) = crate::stream::wrap(&ctx, stream as u64) {
            let _ = b.ready_on(&s);
        }
        drop(b);
    });
}
