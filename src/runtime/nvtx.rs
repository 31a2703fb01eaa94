//! NVTX ranges around every op, so an Nsight Systems timeline reads like the
//! API (`moe_ep::dispatch`, `moe_ep::combine`, ...).
//!
//! The C entry points (`nvtxRangePushA` / `nvtxRangePop`) are loaded at run
//! time from the first of these that loads and exports both:
//! `MOE_EP_NVTX_LIBRARY` when set, then NVTX3's interop library
//! `libnvtx3interop.so.1` (CUDA 13 toolkits and PyPI's `nvidia-nvtx` 13 ship
//! it), then older toolkits' `libnvToolsExt.so.1`, then the
//! unversioned names of both. Without any of them the ranges cost one branch
//! and do nothing, and one log line (info, through `tracing`) names the
//! libraries tried.

use std::ffi::{c_char, c_int, CString};
use std::sync::OnceLock;

/// The variable naming an NVTX library to load ahead of the default names.
const NVTX_LIBRARY_ENV: &str = "MOE_EP_NVTX_LIBRARY";

/// The library names tried after `MOE_EP_NVTX_LIBRARY`, in order.
const NVTX_LIBRARY_NAMES: [&str; 4] = [
    "libnvtx3interop.so.1",
    "libnvToolsExt.so.1",
    "libnvtx3interop.so",
    "libnvToolsExt.so",
];

struct Nvtx {
    _lib: libloading::Library,
    push: unsafe extern "C" fn(*const c_char) -> c_int,
    pop: unsafe extern "C" fn() -> c_int,
}

/// The names to try: the variable's value first when set and not empty.
fn candidates(env: Option<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    env.filter(|p| !p.is_empty())
        .into_iter()
        .chain(NVTX_LIBRARY_NAMES.iter().map(Into::into))
        .collect()
}

/// Loads `path` and resolves both entry points, or says why not.
fn load(path: &std::ffi::OsStr) -> Result<Nvtx, libloading::Error> {
    // SAFETY: loading NVTX runs no initialisers with preconditions; the
    // symbols have the declared C signatures (nvToolsExt.h, which NVTX3's
    // interop library exports unchanged).
    unsafe {
        let lib = libloading::Library::new(path)?;
        let push = *lib.get::<unsafe extern "C" fn(*const c_char) -> c_int>(b"nvtxRangePushA\0")?;
        let pop = *lib.get::<unsafe extern "C" fn() -> c_int>(b"nvtxRangePop\0")?;
        Ok(Nvtx {
            _lib: lib,
            push,
            pop,
        })
    }
}

fn nvtx() -> Option<&'static Nvtx> {
    static LIB: OnceLock<Option<Nvtx>> = OnceLock::new();
    LIB.get_or_init(|| {
        let names = candidates(std::env::var_os(NVTX_LIBRARY_ENV));
        for name in &names {
            match load(name) {
                Ok(n) => {
                    tracing::debug!("NVTX ranges through {}", name.to_string_lossy());
                    return Some(n);
                }
                Err(e) => tracing::debug!("NVTX library {}: {e}", name.to_string_lossy()),
            }
        }
        let tried: Vec<_> = names.iter().map(|n| n.to_string_lossy()).collect();
        tracing::info!(
            "NVTX ranges are off: none of {} loaded (set {NVTX_LIBRARY_ENV} to an NVTX library's path)",
            tried.join(", ")
        );
        None
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_put_the_variable_first_then_nvtx3_interop() {
        let names = |env: Option<&str>| -> Vec<String> {
            candidates(env.map(Into::into))
                .into_iter()
                .map(|n| n.to_string_lossy().into_owned())
                .collect()
        };
        let defaults = [
            "libnvtx3interop.so.1",
            "libnvToolsExt.so.1",
            "libnvtx3interop.so",
            "libnvToolsExt.so",
        ];
        assert_eq!(names(None), defaults);
        assert_eq!(names(Some("")), defaults);
        let with = names(Some("/opt/nvtx/libnvtx3interop.so.1"));
        assert_eq!(with[0], "/opt/nvtx/libnvtx3interop.so.1");
        assert_eq!(with[1..], defaults);
    }

    #[test]
    fn ranges_work_with_or_without_a_library() {
        // Without NVTX (no GPU machine) the range does nothing; with it, the
        // push and pop pair up. Either way this must not fail.
        let outer = range("moe_ep::test");
        {
            let _inner = range("moe_ep::test/inner");
        }
        drop(outer);
        assert!(!range("a\0b").active);
        // With the variable set, its library must load (as with NCCL's).
        if std::env::var_os(NVTX_LIBRARY_ENV).is_some_and(|p| !p.is_empty()) {
            assert!(
                nvtx().is_some(),
                "{NVTX_LIBRARY_ENV} is set but did not load"
            );
        }
    }
}
