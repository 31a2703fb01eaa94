//! Status codes and errors: the ABI version, `moe_ep_status_t` and its
//! names, the enum values of the header, the mapping from the Rust
//! [`Error`] to a status, the thread's last error message, [`ffi`] (every
//! call's wrapper: an error becomes a status and the message, a panic
//! [`MOE_EP_ERR_INTERNAL`]), the argument checks every call shares (handles,
//! out-parameters, sizes, device ordinals), and the version and error calls
//! (`moe_ep_abi_version`, `moe_ep_version`, `moe_ep_version_string`,
//! `moe_ep_last_error`, `moe_ep_status_name`).

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use moe_ep::error::{Error, Result};

pub use crate::structs::ABI_VERSION;
use crate::structs::{write_out, CVersionInfo, Versioned};

/// `moe_ep_status_t`.
pub type Status = c_int;
pub const MOE_EP_OK: Status = 0;
pub const MOE_EP_ERR_INVALID_ARGUMENT: Status = 1;
pub const MOE_EP_ERR_NOT_SYMMETRIC: Status = 2;
pub const MOE_EP_ERR_CAPACITY_EXCEEDED: Status = 3;
pub const MOE_EP_ERR_PEER_TIMEOUT: Status = 4;
pub const MOE_EP_ERR_COLLECTIVE_FAILED: Status = 5;
pub const MOE_EP_ERR_INVALID_DEVICE_DATA: Status = 6;
pub const MOE_EP_ERR_NO_DRIVER: Status = 7;
pub const MOE_EP_ERR_NOT_ENOUGH_GPUS: Status = 8;
pub const MOE_EP_ERR_CUDA: Status = 9;
pub const MOE_EP_ERR_NCCL_LIBRARY: Status = 10;
pub const MOE_EP_ERR_NCCL_VERSION: Status = 11;
pub const MOE_EP_ERR_NCCL: Status = 12;
pub const MOE_EP_ERR_MODULE: Status = 13;
pub const MOE_EP_ERR_INVALID_STATE: Status = 14;
pub const MOE_EP_ERR_IO: Status = 15;
pub const MOE_EP_ERR_INTERNAL: Status = 16;
pub const MOE_EP_ERR_PEER_FAILED: Status = 17;

/// Every status with its name, in code order.
pub const STATUS_NAMES: [(Status, &CStr); 18] = [
    (MOE_EP_OK, c"MOE_EP_OK"),
    (MOE_EP_ERR_INVALID_ARGUMENT, c"MOE_EP_ERR_INVALID_ARGUMENT"),
    (MOE_EP_ERR_NOT_SYMMETRIC, c"MOE_EP_ERR_NOT_SYMMETRIC"),
    (
        MOE_EP_ERR_CAPACITY_EXCEEDED,
        c"MOE_EP_ERR_CAPACITY_EXCEEDED",
    ),
    (MOE_EP_ERR_PEER_TIMEOUT, c"MOE_EP_ERR_PEER_TIMEOUT"),
    (
        MOE_EP_ERR_COLLECTIVE_FAILED,
        c"MOE_EP_ERR_COLLECTIVE_FAILED",
    ),
    (
        MOE_EP_ERR_INVALID_DEVICE_DATA,
        c"MOE_EP_ERR_INVALID_DEVICE_DATA",
    ),
    (MOE_EP_ERR_NO_DRIVER, c"MOE_EP_ERR_NO_DRIVER"),
    (MOE_EP_ERR_NOT_ENOUGH_GPUS, c"MOE_EP_ERR_NOT_ENOUGH_GPUS"),
    (MOE_EP_ERR_CUDA, c"MOE_EP_ERR_CUDA"),
    (MOE_EP_ERR_NCCL_LIBRARY, c"MOE_EP_ERR_NCCL_LIBRARY"),
    (MOE_EP_ERR_NCCL_VERSION, c"MOE_EP_ERR_NCCL_VERSION"),
    (MOE_EP_ERR_NCCL, c"MOE_EP_ERR_NCCL"),
    (MOE_EP_ERR_MODULE, c"MOE_EP_ERR_MODULE"),
    (MOE_EP_ERR_INVALID_STATE, c"MOE_EP_ERR_INVALID_STATE"),
    (MOE_EP_ERR_IO, c"MOE_EP_ERR_IO"),
    (MOE_EP_ERR_INTERNAL, c"MOE_EP_ERR_INTERNAL"),
    (MOE_EP_ERR_PEER_FAILED, c"MOE_EP_ERR_PEER_FAILED"),
];

/// `moe_ep_dtype_t`.
pub const MOE_EP_DTYPE_BF16: c_int = 1;
pub const MOE_EP_DTYPE_F32: c_int = 2;
pub const MOE_EP_DTYPE_I32: c_int = 3;
pub const MOE_EP_DTYPE_I64: c_int = 4;
pub const MOE_EP_DTYPE_U8: c_int = 5;
/// `moe_ep_recv_layout_t`.
pub const MOE_EP_LAYOUT_RANK_MAJOR: u32 = 0;
pub const MOE_EP_LAYOUT_EXPERT_MAJOR: u32 = 1;
/// `moe_ep_mode_t`.
pub const MOE_EP_MODE_HIGH_THROUGHPUT: u32 = 0;
pub const MOE_EP_MODE_LOW_LATENCY: u32 = 1;
/// `moe_ep_ll_payload_t`.
pub const MOE_EP_LL_BF16: u32 = 0;
pub const MOE_EP_LL_CAST_FP8_EXACT: u32 = 1;
pub const MOE_EP_LL_CAST_FP8_POWER_OF_TWO: u32 = 2;
pub const MOE_EP_LL_FP8: u32 = 3;
/// `moe_ep_ll_state_t`.
pub const MOE_EP_LL_SENT: u32 = 1;
pub const MOE_EP_LL_RECEIVED: u32 = 2;
pub const MOE_EP_LL_COMBINE_SENT: u32 = 3;
pub const MOE_EP_LL_COMBINED: u32 = 4;
/// `moe_ep_padding_t` (ABI 5).
pub const MOE_EP_PADDING_ZERO: u32 = 0;
pub const MOE_EP_PADDING_UNTOUCHED: u32 = 1;
/// `moe_ep_overflow_t` (ABI 5).
pub const MOE_EP_OVERFLOW_ERROR: u32 = 0;
pub const MOE_EP_OVERFLOW_DROP: u32 = 1;
/// `moe_ep_fp8_scales_t` (ABI 5).
pub const MOE_EP_FP8_SCALES_NONE: u32 = 0;
pub const MOE_EP_FP8_SCALES_E8M0_PER_32: u32 = 1;
pub const MOE_EP_FP8_SCALES_F32_PER_128: u32 = 2;

/// The code of an error.
pub fn status_of(e: &Error) -> Status {
    match e {
        Error::InvalidArgument { .. } => MOE_EP_ERR_INVALID_ARGUMENT,
        Error::NotSymmetric { .. } => MOE_EP_ERR_NOT_SYMMETRIC,
        Error::CapacityExceeded { .. } => MOE_EP_ERR_CAPACITY_EXCEEDED,
        Error::PeerTimeout { .. } => MOE_EP_ERR_PEER_TIMEOUT,
        Error::CollectiveFailed { .. } => MOE_EP_ERR_COLLECTIVE_FAILED,
        Error::InvalidDeviceData { .. } => MOE_EP_ERR_INVALID_DEVICE_DATA,
        Error::NoDriver(_) => MOE_EP_ERR_NO_DRIVER,
        Error::NotEnoughGpus { .. } => MOE_EP_ERR_NOT_ENOUGH_GPUS,
        Error::Cuda { .. } => MOE_EP_ERR_CUDA,
        Error::NcclLibrary(_) => MOE_EP_ERR_NCCL_LIBRARY,
        Error::NcclVersion { .. } => MOE_EP_ERR_NCCL_VERSION,
        Error::Nccl { .. } => MOE_EP_ERR_NCCL,
        Error::Module { .. } => MOE_EP_ERR_MODULE,
        Error::InvalidState(_) => MOE_EP_ERR_INVALID_STATE,
        Error::Io(_) => MOE_EP_ERR_IO,
        Error::PeerFailed { .. } => MOE_EP_ERR_PEER_FAILED,
    }
}

// ---- errors and panics ------------------------------------------------

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs one call: its error becomes a status and the thread's message, a
/// panic becomes [`MOE_EP_ERR_INTERNAL`].
pub(crate) fn ffi(f: impl FnOnce() -> Result<()>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => MOE_EP_OK,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            status_of(&e)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            // Catching the panic may itself not unwind into C.
            let _ = catch_unwind(|| {
                set_last_error(&format!(
                    "internal error in moe-ep (a panic, caught at the C ABI): {what}"
                ))
            });
            MOE_EP_ERR_INTERNAL
        }
    }
}
/// A handle argument: refuses NULL, naming `arg`.
pub(crate) unsafe fn obj<'a, T>(p: *const T, arg: &'static str) -> Result<&'a T> {
    // SAFETY: a non-null handle is one this library returned and the caller
    // has not destroyed (the header's contract).
    unsafe { p.as_ref() }.ok_or_else(|| Error::arg(arg, "a live handle", "NULL"))
}

/// An out-parameter: refuses NULL, naming `arg`.
pub(crate) fn out_ptr<T>(p: *mut T, arg: &'static str) -> Result<*mut T> {
    if p.is_null() {
        return Err(Error::arg(arg, "a pointer to write the result to", "NULL"));
    }
    Ok(p)
}

pub(crate) fn boxed<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// Destroys what [`boxed`] made; NULL is a no-op.
///
/// # Safety
/// `p` is NULL or a pointer this library returned that the caller has not
/// destroyed yet (the header's contract: each handle is destroyed once).
pub(crate) unsafe fn unboxed<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: as the function's contract says.
        drop(unsafe { Box::from_raw(p) });
    }
}

pub(crate) fn to_usize(arg: &'static str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::arg(arg, "a value that fits size_t", v))
}

pub(crate) fn device_of(arg: &'static str, device: c_int) -> Result<usize> {
    usize::try_from(device).map_err(|_| Error::arg(arg, "a device ordinal >= 0", device))
}
// ---- version and errors -------------------------------------------------

#[no_mangle]
pub extern "C" fn moe_ep_abi_version() -> u32 {
    ABI_VERSION
}

fn version_info() -> CVersionInfo {
    let num = |s: &str| s.parse::<u32>().unwrap_or(0);
    CVersionInfo {
        major: num(env!("CARGO_PKG_VERSION_MAJOR")),
        minor: num(env!("CARGO_PKG_VERSION_MINOR")),
        patch: num(env!("CARGO_PKG_VERSION_PATCH")),
        abi_version: ABI_VERSION,
        nccl_headers_version: moe_ep::NCCL_HEADERS_VERSION_CODE,
        ..CVersionInfo::init()
    }
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_version(out: *mut CVersionInfo) -> Status {
    ffi(|| unsafe { write_out(out, "out", &version_info()) })
}

#[no_mangle]
pub extern "C" fn moe_ep_version_string() -> *const c_char {
    static S: OnceLock<CString> = OnceLock::new();
    S.get_or_init(|| {
        let headers = moe_ep::NcclVersion::from_code(moe_ep::NCCL_HEADERS_VERSION_CODE);
        CString::new(format!(
            "{} (ABI {ABI_VERSION}, NCCL headers {headers})",
            env!("CARGO_PKG_VERSION")
        ))
        .unwrap_or_default()
    })
    .as_ptr()
}

#[no_mangle]
pub extern "C" fn moe_ep_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|l| l.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

#[no_mangle]
pub extern "C" fn moe_ep_status_name(status: Status) -> *const c_char {
    STATUS_NAMES
        .iter()
        .find(|(s, _)| *s == status)
        .map_or(c"MOE_EP_UNKNOWN_STATUS".as_ptr(), |(_, n)| n.as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_is_named_in_order() {
        for (i, (s, _)) in STATUS_NAMES.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
    }
}
