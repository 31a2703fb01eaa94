//! NVTX ranges around every op, so an Nsight Systems timeline reads like the
//! API (`moe_ep::dispatch`, `moe_ep::combine`, ...).
//!
//! The NVTX v2 entry points (`nvtxRangePushA` / `nvtxRangePop`) are loaded at
//! run time from `MOE_EP_NVTX_LIBRARY` or `libnvToolsExt.so.1` (CUDA toolkits
//! and PyPI's `nvidia-nvtx` ship it); without the library the ranges cost
//! one branch and do nothing.

use std::ffi::{c_char, c_int, CString};
use std::sync::OnceLock;

struct Nvtx {
    _lib: libloading::Library,
    push: unsafe extern "C" fn(*const c_char) -> c_int,
    pop: unsafe extern "C" fn() -> c_int,
}

fn nvtx() -> Option<&'static Nvtx> {
    static LIB: OnceLock<Option<Nvtx>> = OnceLock::new();
    LIB.get_or_init(|| {
        let path =
            std::env::var("MOE_EP_NVTX_LIBRARY").unwrap_or_else(|_| "libnvToolsExt.so.1".into());
        // SAFETY: loading NVTX runs no initialisers with preconditions; the
        // symbols have the declared C signatures (nvToolsExt.h).
        unsafe {
            let lib = libloading::Library::new(&path).ok()?;
            let push = *lib
                .get::<unsafe extern "C" fn(*const c_char) -> c_int>(b"nvtxRangePushA\0")
                .ok()?;
            let pop = *lib
                .get::<unsafe extern "C" fn() -> c_int>(b"nvtxRangePop\0")
                .ok()?;
            Some(Nvtx {
                _lib: lib,
                push,
                pop,
            })
        }
    })
    .as_ref()
}

/// An NVTX range, popped on drop.
#[must_use = "the range ends when this is dropped"]
pub struct Range {
    active: bool,
}

/// Opens a range named `name` (no-op without the NVTX library).
pub fn range(name: &str) -> Range {
    let Some(n) = nvtx() else {
        return Range { active: false };
    };
    let Ok(c) = CString::new(name) else {
        return Range { active: false };
    };
    // SAFETY: c is a valid NUL-terminated string for the call.
    unsafe { (n.push)(c.as_ptr()) };
    Range { active: true }
}

impl Drop for Range {
    fn drop(&mut self) {
        if let (true, Some(n)) = (self.active, nvtx()) {
            // SAFETY: matches the push in `range`.
            unsafe { (n.pop)() };
        }
    }
}
