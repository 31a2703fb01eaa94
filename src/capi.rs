//! The C ABI: `include/moe_ep.h`, built into `libmoe_ep.so` and
//! `libmoe_ep.a` (the crate's `cdylib` and `staticlib`).
//!
//! Every function is `extern "C"`, returns a status code and catches panics
//! ([`MOE_EP_ERR_INTERNAL`]); a failing call leaves the Rust [`Error`]'s text
//! in a thread-local message (`moe_ep_last_error`). Versioned structs (size
//! and magic first) are read through [`Versioned`]: a wrong magic or a size
//! below the first version's is refused naming the argument and the struct,
//! a smaller (older) struct takes defaults for the fields it lacks, and a
//! larger (newer) one is accepted when its extra bytes are zero.
//!
//! The header is written by hand; `tests/capi.rs` compiles it as C11 and
//! C++17, builds `tests/capi/abi_test.c` against the static and the shared
//! library, and compares every struct's size and field offsets as the C
//! compiler lays them out with the `#[repr(C)]` mirrors here.
//!
//! Low-latency handles: the Rust [`LlHandle`] borrows its group, which C
//! cannot express, so a `moe_ep_group_t` holds its group in an `Arc` and a
//! `moe_ep_ll_handle_t` holds another reference to it beside the batch
//! ([`CLlHandle`]): destroying the group first cannot leave a handle
//! dangling, the group goes with its last handle. Every transition of a
//! batch (sent, received, combine sent, combined) is a call on the handle,
//! which keeps the batch's state under a lock.
//!
//! Buffers arrive as `(device pointer, element count)` and become
//! [`CRegion`]s, this module's implementation of the unsafe
//! [`DeviceRegion`] / [`DeviceRegionMut`] traits; the caller's obligations
//! are those of the traits, stated in the header. The ops check lengths,
//! alignment and device memory as they do for Rust callers, and this module
//! adds that no output overlaps another buffer of the call.

#![allow(clippy::missing_safety_doc)] // the header states each function's contract

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;

use crate::error::{Error, Result};
use crate::ops::{
    DeviceRegion, DeviceRegionMut, DispatchOut, EpGroup, ExpertParallel, Fp8Scaling, GroupConfig,
    Handle, LlCombineSent, LlDispatchSent, LlHandle, LlInput, LlLayout, Mode, RecvBuf, RecvLayout,
    TopkIdx, TwoLevelGroup, TwoLevelHandle,
};
use crate::runtime::{Communicator, UniqueId};
use crate::symm::{SymmBuffer, SymmPool};

/// The ABI version of this library (`MOE_EP_ABI_VERSION`): one more with
/// every release that adds to the ABI (the header has the rule). 2: the
/// low-latency mode; 3: `moe_ep_group_config_t.ranks_per_node`.
pub const ABI_VERSION: u32 = 3;

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
fn ffi(f: impl FnOnce() -> Result<()>) -> Status {
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

// ---- versioned structs ------------------------------------------------

/// The first two fields of every versioned struct.
#[repr(C)]
#[derive(Clone, Copy)]
struct Head {
    size: u32,
    magic: u32,
}

/// A `#[repr(C)]` struct that starts with `size` and `magic`.
///
/// # Safety
/// `Self` is `#[repr(C)]`, starts with two `u32` (size, magic), and every
/// bit pattern of its bytes is a valid value (integers and raw pointers).
pub unsafe trait Versioned: Copy {
    /// The C name.
    const NAME: &'static str;
    /// The value of `magic`.
    const MAGIC: u32;
    /// The init macro.
    const INIT: &'static str;
    /// The size of the struct's first version: the smallest accepted.
    const MIN_SIZE: usize;
    /// The struct with size and magic set, every other field zero.
    fn init() -> Self;
}

/// Checks size and magic of a struct at `p`, returning its size.
unsafe fn head<T: Versioned>(p: *const T, arg: &'static str) -> Result<usize> {
    if p.is_null() {
        return Err(Error::arg(
            arg,
            format!("a pointer to a {}", T::NAME),
            "NULL",
        ));
    }
    // SAFETY: the caller passes a struct, which starts with these 8 bytes.
    let h = unsafe { std::ptr::read_unaligned(p as *const Head) };
    if h.magic != T::MAGIC {
        return Err(Error::arg(
            arg,
            format!(
                "a {} with magic {:#x} (initialise it with {})",
                T::NAME,
                T::MAGIC,
                T::INIT
            ),
            format!("magic {:#x}", h.magic),
        ));
    }
    let size = h.size as usize;
    if size < T::MIN_SIZE {
        return Err(Error::arg(
            arg,
            format!(
                "a {} of size >= {} (initialise it with {})",
                T::NAME,
                T::MIN_SIZE,
                T::INIT
            ),
            format!("size {size}"),
        ));
    }
    Ok(size)
}

/// Reads a caller's input struct (see the module's rules).
unsafe fn read_in<T: Versioned>(p: *const T, arg: &'static str) -> Result<T> {
    // SAFETY: p points to a struct of `size` bytes, as the caller declared.
    unsafe {
        let size = head(p, arg)?;
        let mine = std::mem::size_of::<T>();
        if size > mine {
            let extra = std::slice::from_raw_parts((p as *const u8).add(mine), size - mine);
            if extra.iter().any(|&b| b != 0) {
                return Err(Error::arg(
                    arg,
                    format!(
                        "a {} whose fields past the {mine} bytes this library (ABI {ABI_VERSION}) knows are zero",
                        T::NAME
                    ),
                    format!("size {size} with nonzero fields this library does not know"),
                ));
            }
        }
        let mut out = T::init();
        std::ptr::copy_nonoverlapping(
            p as *const u8,
            &mut out as *mut T as *mut u8,
            size.min(mine),
        );
        Ok(out)
    }
}

/// Fills a caller's output struct up to its size (size and magic kept).
unsafe fn write_out<T: Versioned>(p: *mut T, arg: &'static str, value: &T) -> Result<()> {
    // SAFETY: as read_in; the first 8 bytes are the caller's and kept.
    unsafe {
        let size = head(p, arg)?.min(std::mem::size_of::<T>());
        let h = std::mem::size_of::<Head>();
        std::ptr::copy_nonoverlapping(
            (value as *const T as *const u8).add(h),
            (p as *mut u8).add(h),
            size - h,
        );
    }
    Ok(())
}

macro_rules! versioned {
    ($t:ty, $name:literal, $magic:expr, $init:literal, $min:expr) => {
        // SAFETY: repr(C), size and magic first, integer and pointer fields.
        unsafe impl Versioned for $t {
            const NAME: &'static str = $name;
            const MAGIC: u32 = $magic;
            const INIT: &'static str = $init;
            const MIN_SIZE: usize = $min;
            fn init() -> Self {
                // SAFETY: all-zero bytes are a valid value (integers, null pointers).
                let mut v: Self = unsafe { std::mem::zeroed() };
                v.size = std::mem::size_of::<Self>() as u32;
                v.magic = $magic;
                v
            }
        }
    };
}

/// `moe_ep_buf_t`: an input buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CBuf {
    pub ptr: *const c_void,
    pub len: usize,
}

/// `moe_ep_buf_mut_t`: an output buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CBufMut {
    pub ptr: *mut c_void,
    pub len: usize,
}

impl CBufMut {
    fn of(ptr: u64, len: usize) -> CBufMut {
        CBufMut {
            ptr: ptr as *mut c_void,
            len,
        }
    }
}

/// `moe_ep_version_info_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CVersionInfo {
    pub size: u32,
    pub magic: u32,
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
    pub abi_version: u32,
    pub nccl_headers_version: i32,
    pub reserved: u32,
}

/// `moe_ep_group_config_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CGroupConfig {
    pub size: u32,
    pub magic: u32,
    pub num_experts: u64,
    pub hidden: u64,
    pub max_tokens_per_rank: u64,
    pub recv_capacity: u64,
    pub num_sms: u32,
    pub combine_chunks: u32,
    pub mode: u32,
    pub timeout_ms: u32,
    /// ABI 3; past the first version's 56 bytes.
    pub ranks_per_node: u64,
}

/// `moe_ep_layout_args_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CLayoutArgs {
    pub size: u32,
    pub magic: u32,
    pub topk_idx: CBuf,
    pub topk_idx_dtype: u32,
    pub topk: u32,
    pub layout: u32,
    pub alignment: u32,
}

/// `moe_ep_dispatch_args_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CDispatchArgs {
    pub size: u32,
    pub magic: u32,
    pub x: CBuf,
    pub topk_weights: CBuf,
    pub recv_tokens: CBufMut,
    pub recv_topk_weights: CBufMut,
}

/// `moe_ep_combine_args_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CCombineArgs {
    pub size: u32,
    pub magic: u32,
    pub expert_out: CBuf,
    pub weights: CBuf,
    pub out: CBufMut,
}

/// `moe_ep_combine_backward_args_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CCombineBackwardArgs {
    pub size: u32,
    pub magic: u32,
    pub grad_out: CBuf,
    pub weights: CBuf,
    pub grad_expert_out: CBufMut,
}

/// `moe_ep_dispatch_backward_args_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CDispatchBackwardArgs {
    pub size: u32,
    pub magic: u32,
    pub grad_recv_tokens: CBuf,
    pub grad_recv_topk_weights: CBuf,
    pub grad_tokens: CBufMut,
    pub grad_topk_weights: CBufMut,
}

/// `moe_ep_recv_buffers_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CRecvBuffers {
    pub size: u32,
    pub magic: u32,
    pub tokens: CBufMut,
    pub topk_weights: CBufMut,
    pub topk_idx: CBufMut,
    pub src: CBufMut,
}

/// `moe_ep_handle_counts_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CHandleCounts {
    pub size: u32,
    pub magic: u32,
    pub num_tokens: u64,
    pub topk: u64,
    pub recv_rows: u64,
    pub recv_tokens: u64,
    pub num_local_experts: u64,
}

/// `moe_ep_ll_dispatch_args_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CLlDispatchArgs {
    pub size: u32,
    pub magic: u32,
    pub x: CBuf,
    pub x_scales: CBuf,
    pub topk_idx: CBuf,
    pub topk_weights: CBuf,
    pub topk_idx_dtype: u32,
    pub topk: u32,
    pub layout: u32,
    pub payload: u32,
}

/// `moe_ep_ll_combine_args_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CLlCombineArgs {
    pub size: u32,
    pub magic: u32,
    pub expert_out: CBuf,
    pub weights: CBuf,
    pub out: CBufMut,
}

/// `moe_ep_ll_handle_info_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CLlHandleInfo {
    pub size: u32,
    pub magic: u32,
    pub num_tokens: u64,
    pub topk: u64,
    pub hidden: u64,
    pub num_rows: u64,
    pub num_local_experts: u64,
    pub world: u64,
    pub max_tokens_per_rank: u64,
    pub layout: u32,
    pub fp8: u32,
    pub buffer_set: u32,
    pub state: u32,
}

/// `moe_ep_ll_buffers_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CLlBuffers {
    pub size: u32,
    pub magic: u32,
    pub tokens: CBuf,
    pub fp8_codes: CBuf,
    pub fp8_scales: CBuf,
    pub src: CBuf,
    pub topk_local_idx: CBuf,
    pub topk_weights: CBuf,
    pub tokens_per_local_expert: CBuf,
    pub tokens_per_expert_source: CBuf,
    pub tokens_from_rank: CBuf,
}

/// `moe_ep_unique_id_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUniqueId {
    pub internal: [c_char; 128],
}

// The sizes of the first versions, as the header lays them out (64-bit).
versioned!(
    CVersionInfo,
    "moe_ep_version_info_t",
    0x4d4f_4501,
    "MOE_EP_VERSION_INFO_INIT",
    32
);
versioned!(
    CGroupConfig,
    "moe_ep_group_config_t",
    0x4d4f_4502,
    "MOE_EP_GROUP_CONFIG_INIT",
    56
);
versioned!(
    CLayoutArgs,
    "moe_ep_layout_args_t",
    0x4d4f_4503,
    "MOE_EP_LAYOUT_ARGS_INIT",
    40
);
versioned!(
    CDispatchArgs,
    "moe_ep_dispatch_args_t",
    0x4d4f_4504,
    "MOE_EP_DISPATCH_ARGS_INIT",
    72
);
versioned!(
    CCombineArgs,
    "moe_ep_combine_args_t",
    0x4d4f_4505,
    "MOE_EP_COMBINE_ARGS_INIT",
    56
);
versioned!(
    CCombineBackwardArgs,
    "moe_ep_combine_backward_args_t",
    0x4d4f_4506,
    "MOE_EP_COMBINE_BACKWARD_ARGS_INIT",
    56
);
versioned!(
    CDispatchBackwardArgs,
    "moe_ep_dispatch_backward_args_t",
    0x4d4f_4507,
    "MOE_EP_DISPATCH_BACKWARD_ARGS_INIT",
    72
);
versioned!(
    CRecvBuffers,
    "moe_ep_recv_buffers_t",
    0x4d4f_4508,
    "MOE_EP_RECV_BUFFERS_INIT",
    72
);
versioned!(
    CHandleCounts,
    "moe_ep_handle_counts_t",
    0x4d4f_4509,
    "MOE_EP_HANDLE_COUNTS_INIT",
    48
);
// ABI 2.
versioned!(
    CLlDispatchArgs,
    "moe_ep_ll_dispatch_args_t",
    0x4d4f_450a,
    "MOE_EP_LL_DISPATCH_ARGS_INIT",
    88
);
versioned!(
    CLlCombineArgs,
    "moe_ep_ll_combine_args_t",
    0x4d4f_450b,
    "MOE_EP_LL_COMBINE_ARGS_INIT",
    56
);
versioned!(
    CLlHandleInfo,
    "moe_ep_ll_handle_info_t",
    0x4d4f_450c,
    "MOE_EP_LL_HANDLE_INFO_INIT",
    80
);
versioned!(
    CLlBuffers,
    "moe_ep_ll_buffers_t",
    0x4d4f_450d,
    "MOE_EP_LL_BUFFERS_INIT",
    152
);

// The first versions are the structs as they are now (ABI 1; the moe_ep_ll_*
// structs ABI 2), except moe_ep_group_config_t, which ABI 3 grew by
// ranks_per_node (8 bytes); the C test asserts the same sizes with
// _Static_assert, and tests/capi.rs compares every field offset with the C
// compiler's.
const _: () = {
    use std::mem::size_of;
    assert!(
        size_of::<usize>() == 8,
        "the C ABI is laid out for 64-bit targets"
    );
    assert!(size_of::<CBuf>() == 16 && size_of::<CBufMut>() == 16);
    assert!(size_of::<CVersionInfo>() == CVersionInfo::MIN_SIZE);
    assert!(size_of::<CGroupConfig>() == CGroupConfig::MIN_SIZE + 8);
    assert!(size_of::<CLayoutArgs>() == CLayoutArgs::MIN_SIZE);
    assert!(size_of::<CDispatchArgs>() == CDispatchArgs::MIN_SIZE);
    assert!(size_of::<CCombineArgs>() == CCombineArgs::MIN_SIZE);
    assert!(size_of::<CCombineBackwardArgs>() == CCombineBackwardArgs::MIN_SIZE);
    assert!(size_of::<CDispatchBackwardArgs>() == CDispatchBackwardArgs::MIN_SIZE);
    assert!(size_of::<CRecvBuffers>() == CRecvBuffers::MIN_SIZE);
    assert!(size_of::<CHandleCounts>() == CHandleCounts::MIN_SIZE);
    assert!(size_of::<CLlDispatchArgs>() == CLlDispatchArgs::MIN_SIZE);
    assert!(size_of::<CLlCombineArgs>() == CLlCombineArgs::MIN_SIZE);
    assert!(size_of::<CLlHandleInfo>() == CLlHandleInfo::MIN_SIZE);
    assert!(size_of::<CLlBuffers>() == CLlBuffers::MIN_SIZE);
    assert!(size_of::<CUniqueId>() == 128);
};

// ---- buffers ------------------------------------------------------------

/// A C caller's `(device pointer, element count)`: the C ABI's
/// [`DeviceRegion`] and [`DeviceRegionMut`].
///
/// Made only from a call's arguments and dropped when the call returns.
/// What the library cannot check, the C caller promises (header, "Buffers"):
/// the address is one live allocation of at least `len` elements of `T`
/// that stays allocated, and is written by no one else outside stream
/// order, until the work enqueued with it has finished; an output is written
/// by nothing else meanwhile. The ops check length, alignment and that the
/// memory is device memory of the group's GPU, as for every region, and
/// the C ABI that no output overlaps another buffer of the call.
pub struct CRegion<T> {
    ptr: u64,
    len: usize,
    _t: PhantomData<*const T>,
}

// SAFETY: the C caller's promise above stands in for ownership, which C
// cannot show; everything checkable is checked by the ops.
unsafe impl<T> DeviceRegion<T> for CRegion<T> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}
// SAFETY: as above; outputs are checked disjoint from the call's other buffers.
unsafe impl<T> DeviceRegionMut<T> for CRegion<T> {}

impl<T> CRegion<T> {
    /// A buffer; NULL only with `len == 0`, its bytes within the address space.
    fn new(arg: &'static str, ptr: *const c_void, len: usize) -> Result<CRegion<T>> {
        if ptr.is_null() && len > 0 {
            return Err(Error::arg(
                arg,
                "a device pointer (NULL only with len 0)",
                format!("NULL with len {len}"),
            ));
        }
        let fits = len
            .checked_mul(std::mem::size_of::<T>())
            .and_then(|b| (ptr as u64).checked_add(b as u64));
        if fits.is_none() {
            return Err(Error::arg(
                arg,
                "a buffer inside the address space",
                format!("{ptr:p} with len {len}"),
            ));
        }
        Ok(CRegion {
            ptr: ptr as u64,
            len,
            _t: PhantomData,
        })
    }
    /// An optional buffer: `{NULL, 0}` is not given.
    fn opt(arg: &'static str, ptr: *const c_void, len: usize) -> Result<Option<CRegion<T>>> {
        if ptr.is_null() && len == 0 {
            return Ok(None);
        }
        Self::new(arg, ptr, len).map(Some)
    }
    fn span(&self, arg: &'static str) -> Span {
        (arg, self.ptr, (self.len * std::mem::size_of::<T>()) as u64)
    }
}

/// `topk_idx` of a `topk_idx_dtype`.
enum CTopkIdx {
    I32(CRegion<i32>),
    I64(CRegion<i64>),
}

impl CTopkIdx {
    fn new(b: CBuf, dtype: u32) -> Result<CTopkIdx> {
        Ok(match dtype as c_int {
            MOE_EP_DTYPE_I32 => CTopkIdx::I32(CRegion::new("topk_idx", b.ptr, b.len)?),
            MOE_EP_DTYPE_I64 => CTopkIdx::I64(CRegion::new("topk_idx", b.ptr, b.len)?),
            d => {
                return Err(Error::arg(
                    "topk_idx_dtype",
                    "MOE_EP_DTYPE_I32 or MOE_EP_DTYPE_I64",
                    d,
                ))
            }
        })
    }
    fn get(&self) -> TopkIdx<'_> {
        match self {
            CTopkIdx::I32(r) => TopkIdx::I32(r),
            CTopkIdx::I64(r) => TopkIdx::I64(r),
        }
    }
}

/// A buffer's name, address and size in bytes.
type Span = (&'static str, u64, u64);

fn span_of<T>(arg: &'static str, r: &Option<CRegion<T>>) -> Option<Span> {
    r.as_ref().map(|r| r.span(arg))
}

/// Refuses an output that overlaps an input or another output, naming it.
fn disjoint(outs: &[Option<Span>], ins: &[Option<Span>]) -> Result<()> {
    let live = |s: &&Option<Span>| matches!(s, Some((_, _, n)) if *n > 0);
    let outs: Vec<Span> = outs.iter().filter(live).map(|s| s.unwrap()).collect();
    let ins: Vec<Span> = ins.iter().filter(live).map(|s| s.unwrap()).collect();
    for (i, &(name, a, n)) in outs.iter().enumerate() {
        let others = ins.iter().chain(outs[i + 1..].iter());
        for &(other, b, m) in others {
            if a < b + m && b < a + n {
                return Err(Error::arg(
                    name,
                    format!("an output that overlaps no other buffer of the call (it overlaps `{other}`)"),
                    format!("[{a:#x}, {:#x}) and [{b:#x}, {:#x})", a + n, b + m),
                ));
            }
        }
    }
    Ok(())
}

// ---- handles --------------------------------------------------------------

/// `moe_ep_comm_t`.
pub struct CComm(Arc<Communicator>);
/// `moe_ep_group_t`: a group of one node (the NVLink path; shared with the
/// low-latency handles made by it) or of several (`ranks_per_node` below
/// the world: the two-level path); the ops take either.
pub struct CGroup(GroupOf);
enum GroupOf {
    Node(Arc<EpGroup>),
    Nodes(Box<TwoLevelGroup>),
}
/// `moe_ep_handle_t`: a layout of either kind of group.
pub struct CHandle(HandleOf);
// (Boxed as a whole: a moe_ep_handle_t is a box.)
#[allow(clippy::large_enum_variant)]
enum HandleOf {
    Node(Handle),
    Nodes(TwoLevelHandle),
}

impl CGroup {
    fn comm(&self) -> &Arc<Communicator> {
        match &self.0 {
            GroupOf::Node(g) => g.comm(),
            GroupOf::Nodes(g) => g.comm(),
        }
    }
    /// The group of one node, which the low-latency mode needs; a group of
    /// several nodes is refused naming `group`.
    fn node(&self) -> Result<&Arc<EpGroup>> {
        match &self.0 {
            GroupOf::Node(g) => Ok(g),
            GroupOf::Nodes(g) => Err(Error::arg(
                "group",
                "a low-latency group (MOE_EP_MODE_LOW_LATENCY, one node)",
                format!("a high-throughput group of {} nodes", g.topology().nodes()),
            )),
        }
    }
    fn pool(&self) -> &SymmPool {
        match &self.0 {
            GroupOf::Node(g) => g.pool(),
            GroupOf::Nodes(g) => ExpertParallel::pool(&**g),
        }
    }
}

impl CHandle {
    /// The layout of this rank's node group: the rows this rank receives.
    fn node(&self) -> &Handle {
        match &self.0 {
            HandleOf::Node(h) => h,
            HandleOf::Nodes(h) => h.node_handle(),
        }
    }
    /// This rank's tokens and their top-k, as the layout was given them.
    fn tokens_topk(&self) -> (usize, usize) {
        match &self.0 {
            HandleOf::Node(h) => (h.num_tokens(), h.topk()),
            HandleOf::Nodes(h) => (h.num_tokens(), h.topk()),
        }
    }
}

/// `$body` with the group and the handle of an op as `$g` and `$h`, both of
/// one node or both of several; a handle of the other kind is refused
/// naming `handle` (the groups refuse another group's handle of their kind).
macro_rules! on_kind {
    ($group:expr, $handle:expr, |$g:ident, $h:ident| $body:expr) => {
        match (&$group.0, &$handle.0) {
            (GroupOf::Node($g), HandleOf::Node($h)) => $body,
            (GroupOf::Nodes($g), HandleOf::Nodes($h)) => $body,
            (GroupOf::Node(_), HandleOf::Nodes(_)) => Err(Error::arg(
                "handle",
                "a handle made by this group's layout (one node)",
                "a handle of a group of several nodes",
            )),
            (GroupOf::Nodes(_), HandleOf::Node(_)) => Err(Error::arg(
                "handle",
                "a handle made by this group's layout (several nodes)",
                "a handle of a group of one node",
            )),
        }
    };
}
/// `moe_ep_buffer_t`: a pool buffer of one element type.
pub enum CBuffer {
    Bf16(SymmBuffer<bf16>),
    F32(SymmBuffer<f32>),
    I32(SymmBuffer<i32>),
    I64(SymmBuffer<i64>),
    U8(SymmBuffer<u8>),
}
/// `moe_ep_dispatched_t`: the receive buffers of a dispatch; the pool's
/// are owned here, the caller's only named.
pub struct CDispatched {
    tokens: Kept<bf16>,
    topk_weights: Kept<f32>,
    topk_idx: SymmBuffer<i32>,
    src: SymmBuffer<i32>,
}

/// A receive buffer's address and length, and the pool buffer if it is one.
struct Kept<T> {
    ptr: u64,
    len: usize,
    _pool: Option<SymmBuffer<T>>,
}

impl<T> Kept<T> {
    fn of(b: RecvBuf<'_, T>) -> Kept<T> {
        let (ptr, len) = (b.device_ptr(), b.len());
        let pool = match b {
            RecvBuf::Pool(s) => Some(s),
            RecvBuf::Caller(_) => None,
        };
        Kept {
            ptr,
            len,
            _pool: pool,
        }
    }
}

impl CBuffer {
    fn ptr_len(&self) -> (u64, usize) {
        match self {
            CBuffer::Bf16(b) => (b.device_ptr(), b.len()),
            CBuffer::F32(b) => (b.device_ptr(), b.len()),
            CBuffer::I32(b) => (b.device_ptr(), b.len()),
            CBuffer::I64(b) => (b.device_ptr(), b.len()),
            CBuffer::U8(b) => (b.device_ptr(), b.len()),
        }
    }
}

/// A handle argument: refuses NULL, naming `arg`.
unsafe fn obj<'a, T>(p: *const T, arg: &'static str) -> Result<&'a T> {
    // SAFETY: a non-null handle is one this library returned and the caller
    // has not destroyed (the header's contract).
    unsafe { p.as_ref() }.ok_or_else(|| Error::arg(arg, "a live handle", "NULL"))
}

/// An out-parameter: refuses NULL, naming `arg`.
fn out_ptr<T>(p: *mut T, arg: &'static str) -> Result<*mut T> {
    if p.is_null() {
        return Err(Error::arg(arg, "a pointer to write the result to", "NULL"));
    }
    Ok(p)
}

fn boxed<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// Destroys what [`boxed`] made; NULL is a no-op.
///
/// # Safety
/// `p` is NULL or a pointer this library returned that the caller has not
/// destroyed yet (the header's contract: each handle is destroyed once).
unsafe fn unboxed<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: as the function's contract says.
        drop(unsafe { Box::from_raw(p) });
    }
}

fn to_usize(arg: &'static str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::arg(arg, "a value that fits size_t", v))
}

fn device_of(arg: &'static str, device: c_int) -> Result<usize> {
    usize::try_from(device).map_err(|_| Error::arg(arg, "a device ordinal >= 0", device))
}

/// The caller's stream, wrapped without taking it over: it must belong to
/// the communicator's context (checked with `cuStreamGetCtx`).
unsafe fn stream_of(ctx: &Arc<CudaContext>, s: *mut c_void) -> Result<Arc<CudaStream>> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()
        .map_err(Error::cuda("cuCtxSetCurrent"))?;
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: any stream value is accepted; a dead one is an error code.
    let rc = unsafe { sys::cuStreamGetCtx(s as sys::CUstream, &mut owner) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::arg(
            "stream",
            "a live CUDA stream",
            format!("{s:p} (cuStreamGetCtx: {rc:?})"),
        ));
    }
    if owner != ctx.cu_ctx() {
        return Err(Error::arg(
            "stream",
            format!(
                "a stream of the primary context of the communicator's GPU {}",
                ctx.ordinal()
            ),
            format!("{s:p}, a stream of another context"),
        ));
    }
    // SAFETY: a live stream of this context (checked); the header makes the
    // caller keep it alive while the group and what it made with it live,
    // and the crate orders its own work on it.
    Ok(unsafe { ctx.wrap_borrowed_stream(s as sys::CUstream) })
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
        nccl_headers_version: crate::kernels::NCCL_HEADERS_VERSION_CODE,
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
        let headers = crate::NcclVersion::from_code(crate::kernels::NCCL_HEADERS_VERSION_CODE);
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

// ---- devices and communicators -----------------------------------------

#[no_mangle]
pub unsafe extern "C" fn moe_ep_device_count(out: *mut c_int) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        let n = crate::device_count()?;
        // SAFETY: checked non-null; the caller's int.
        unsafe { *out = n.min(c_int::MAX as usize) as c_int };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_unique_id_create(out: *mut CUniqueId) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        let bytes = UniqueId::generate()?.to_bytes();
        // SAFETY: checked non-null; 128 bytes.
        unsafe { (*out).internal = bytes.map(|b| b as c_char) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_init(
    device: c_int,
    id: *const CUniqueId,
    rank: c_int,
    world: c_int,
    out: *mut *mut CComm,
) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        let id = unsafe { obj(id, "id") }?;
        let world = usize::try_from(world).map_err(|_| Error::arg("world", ">= 1", world))?;
        let rank = usize::try_from(rank)
            .map_err(|_| Error::arg("rank", format!("a rank in 0..{world}"), rank))?;
        let device = device_of("device", device)?;
        let ctx = crate::context(device)?;
        let id = UniqueId::from_bytes(id.internal.map(|b| b as u8));
        let comm = Communicator::init(&ctx, &id, rank, world)?;
        // SAFETY: checked non-null.
        unsafe { *out = boxed(CComm(comm)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_borrow_nccl(
    device: c_int,
    nccl: *mut c_void,
    out: *mut *mut CComm,
) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        if nccl.is_null() {
            return Err(Error::arg("nccl", "a live ncclComm_t", "NULL"));
        }
        let device = device_of("device", device)?;
        let ctx = crate::context(device)?;
        let raw = nccl as crate::sys::nccl::ncclComm_t;
        // SAFETY: the caller's live communicator (the header's contract).
        let on = unsafe { crate::runtime::nccl_call::comm_cu_device(raw)? };
        if on != device {
            return Err(Error::arg(
                "nccl",
                format!("a communicator of GPU {device} (the `device` argument)"),
                format!("a communicator of GPU {on}"),
            ));
        }
        // SAFETY: live, of this device, outliving the handle (the contract).
        let comm = unsafe { Communicator::borrow_raw(&ctx, raw)? };
        // SAFETY: checked non-null.
        unsafe { *out = boxed(CComm(comm)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_create_virtual(
    device: c_int,
    world: c_int,
    comms: *mut *mut CComm,
) -> Status {
    ffi(|| {
        let comms = out_ptr(comms, "comms")?;
        let world = usize::try_from(world)
            .ok()
            .filter(|&w| w >= 1)
            .ok_or_else(|| Error::arg("world", "at least 1 virtual rank", world))?;
        let device = device_of("device", device)?;
        let ctx = crate::context(device)?;
        let all = Communicator::virtual_world(&ctx, world)?;
        for (r, c) in all.into_iter().enumerate() {
            // SAFETY: the caller's array of `world` pointers.
            unsafe { *comms.add(r) = boxed(CComm(c)) };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_destroy(comm: *mut CComm) -> Status {
    ffi(|| {
        // SAFETY: a handle of ours, destroyed once (the contract).
        unsafe { unboxed(comm) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_rank(comm: *const CComm, out: *mut c_int) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        unsafe { *out = c.0.rank() as c_int };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_world(comm: *const CComm, out: *mut c_int) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        unsafe { *out = c.0.world() as c_int };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_max_sms(
    comm: *const CComm,
    num_experts: u64,
    out: *mut u32,
) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        let e = to_usize("num_experts", num_experts)?;
        let n = crate::ops::residency(&c.0, e)?.max_blocks_per_rank();
        unsafe { *out = n.min(u32::MAX as usize) as u32 };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_abort(comm: *mut CComm) -> Status {
    ffi(|| unsafe { obj(comm, "comm") }?.0.abort())
}

// ---- groups -------------------------------------------------------------

fn group_config(c: &CGroupConfig) -> Result<GroupConfig> {
    let mut g = GroupConfig::new(
        to_usize("num_experts", c.num_experts)?,
        to_usize("hidden", c.hidden)?,
        to_usize("max_tokens_per_rank", c.max_tokens_per_rank)?,
    );
    g.recv_capacity = to_usize("recv_capacity", c.recv_capacity)?;
    if c.num_sms != 0 {
        g.num_sms = c.num_sms as usize;
    }
    if c.combine_chunks != 0 {
        g.combine_chunks = c.combine_chunks as usize;
    }
    g.mode = match c.mode {
        MOE_EP_MODE_HIGH_THROUGHPUT => Mode::HighThroughput,
        MOE_EP_MODE_LOW_LATENCY => Mode::LowLatency,
        m => {
            return Err(Error::arg(
                "mode",
                "MOE_EP_MODE_HIGH_THROUGHPUT (0) or MOE_EP_MODE_LOW_LATENCY (1)",
                m,
            ))
        }
    };
    if c.timeout_ms != 0 {
        g.timeout = Duration::from_millis(c.timeout_ms as u64);
    }
    // 0 (and a struct of ABI 1 or 2, which lacks the field) is one node.
    g.ranks_per_node = to_usize("ranks_per_node", c.ranks_per_node)?;
    Ok(g)
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_config_validate(
    cfg: *const CGroupConfig,
    world: c_int,
) -> Status {
    ffi(|| {
        let cfg = group_config(&unsafe { read_in(cfg, "cfg") }?)?;
        let world = usize::try_from(world).map_err(|_| Error::arg("world", ">= 1", world))?;
        match cfg.topology(world)?.nodes() {
            1 => cfg.validate(world),
            _ => TwoLevelGroup::validate(&cfg, world).map(drop),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_create(
    comm: *const CComm,
    cfg: *const CGroupConfig,
    out: *mut *mut CGroup,
) -> Status {
    ffi(|| {
        let cfg = group_config(&unsafe { read_in(cfg, "cfg") }?)?;
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        // One node: the NVLink path; several: the two-level path.
        let g = match cfg.topology(c.0.world())?.nodes() {
            1 => GroupOf::Node(Arc::new(EpGroup::new(&c.0, cfg)?)),
            _ => GroupOf::Nodes(Box::new(TwoLevelGroup::new(&c.0, cfg)?)),
        };
        unsafe { *out = boxed(CGroup(g)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_destroy(group: *mut CGroup) -> Status {
    ffi(|| {
        // SAFETY: a handle of ours, destroyed once; dropping the last
        // reference (this or a low-latency handle's) waits for its work.
        unsafe { unboxed(group) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_check(group: *const CGroup) -> Status {
    ffi(|| match &unsafe { obj(group, "group") }?.0 {
        GroupOf::Node(g) => g.check(),
        GroupOf::Nodes(g) => ExpertParallel::check(&**g),
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_allow_graph_capture(group: *const CGroup) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        // SAFETY: the C caller takes on the contract the header states
        // (that of EpGroup::allow_graph_capture).
        match &g.0 {
            GroupOf::Node(g) => unsafe { g.allow_graph_capture() },
            GroupOf::Nodes(g) => unsafe { g.node_group().allow_graph_capture() },
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_recv_capacity(group: *const CGroup, out: *mut u64) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        let cap = match &g.0 {
            GroupOf::Node(g) => g.recv_capacity(),
            GroupOf::Nodes(g) => g.recv_capacity(),
        };
        unsafe { *out = cap as u64 };
        Ok(())
    })
}

// ---- symmetric memory ---------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn moe_ep_pool_alloc(
    group: *const CGroup,
    dtype: c_int,
    len: usize,
    out: *mut *mut CBuffer,
) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        let pool = g.pool();
        let b = match dtype {
            MOE_EP_DTYPE_BF16 => CBuffer::Bf16(pool.alloc(len)?),
            MOE_EP_DTYPE_F32 => CBuffer::F32(pool.alloc(len)?),
            MOE_EP_DTYPE_I32 => CBuffer::I32(pool.alloc(len)?),
            MOE_EP_DTYPE_I64 => CBuffer::I64(pool.alloc(len)?),
            MOE_EP_DTYPE_U8 => CBuffer::U8(pool.alloc(len)?),
            d => return Err(Error::arg("dtype", "a moe_ep_dtype_t (1..=5)", d)),
        };
        unsafe { *out = boxed(b) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_buffer_free(buffer: *mut CBuffer) -> Status {
    ffi(|| {
        // SAFETY: a handle of ours, freed once.
        unsafe { unboxed(buffer) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_buffer_get(buffer: *const CBuffer, out: *mut CBufMut) -> Status {
    ffi(|| {
        let b = unsafe { obj(buffer, "buffer") }?;
        let out = out_ptr(out, "out")?;
        let (p, n) = b.ptr_len();
        unsafe { *out = CBufMut::of(p, n) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_is_symm_backed(
    group: *const CGroup,
    ptr: *const c_void,
    bytes: usize,
    out: *mut c_int,
) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        let yes = g.pool().is_symm_backed(ptr as u64, bytes);
        unsafe { *out = yes as c_int };
        Ok(())
    })
}

// ---- ops ------------------------------------------------------------------

/// The group, its stream and the handle of an op (see `on_kind`).
unsafe fn op<'a>(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CHandle,
) -> Result<(&'a CGroup, Arc<CudaStream>, &'a CHandle)> {
    // SAFETY: the header's contract for handles and streams.
    unsafe {
        let g = obj(group, "group")?;
        let h = obj(handle, "handle")?;
        let s = stream_of(g.comm().context(), stream)?;
        Ok((g, s, h))
    }
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_layout(
    group: *const CGroup,
    stream: *mut c_void,
    args: *const CLayoutArgs,
    out: *mut *mut CHandle,
) -> Status {
    ffi(|| {
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
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        let s = unsafe { stream_of(g.comm().context(), stream) }?;
        let h = match &g.0 {
            GroupOf::Node(g) => HandleOf::Node(g.layout(&s, idx.get(), a.topk as usize, layout)?),
            GroupOf::Nodes(g) => {
                HandleOf::Nodes(g.layout(&s, idx.get(), a.topk as usize, layout)?)
            }
        };
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
        let s = unsafe { stream_of(h.arena.stream().context(), stream) }?;
        let c = h.host_counts(&s)?;
        let (num_tokens, topk) = handle.tokens_topk();
        let v = CHandleCounts {
            num_tokens: num_tokens as u64,
            topk: topk as u64,
            recv_rows: c.recv_rows as u64,
            recv_tokens: c.recv_tokens as u64,
            num_local_experts: c.tokens_per_local_expert.len() as u64,
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
        let v = h.tokens_per_local_expert();
        let (p, n) = (DeviceRegion::device_ptr(&v), DeviceRegion::len(&v));
        unsafe {
            *out = CBuf {
                ptr: p as *const c_void,
                len: n,
            }
        };
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
        let a = unsafe { read_in(args, "args") }?;
        let x = CRegion::<bf16>::new("x", a.x.ptr, a.x.len)?;
        let w = CRegion::<f32>::new("topk_weights", a.topk_weights.ptr, a.topk_weights.len)?;
        let mut rt = CRegion::<bf16>::opt("recv_tokens", a.recv_tokens.ptr, a.recv_tokens.len)?;
        let mut rw = CRegion::<f32>::opt(
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
        let (g, s, h) = unsafe { op(group, stream, handle) }?;
        let out = out_ptr(out, "out")?;
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
        let a = unsafe { read_in(args, "args") }?;
        let y = CRegion::<bf16>::new("expert_out", a.expert_out.ptr, a.expert_out.len)?;
        let w = CRegion::<f32>::opt("weights", a.weights.ptr, a.weights.len)?;
        let mut o = CRegion::<bf16>::new("out", a.out.ptr as *const c_void, a.out.len)?;
        disjoint(
            &[Some(o.span("out"))],
            &[Some(y.span("expert_out")), span_of("weights", &w)],
        )?;
        let (g, s, h) = unsafe { op(group, stream, handle) }?;
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
        let a = unsafe { read_in(args, "args") }?;
        let go = CRegion::<bf16>::new("grad_out", a.grad_out.ptr, a.grad_out.len)?;
        let w = CRegion::<f32>::opt("weights", a.weights.ptr, a.weights.len)?;
        let mut ge = CRegion::<bf16>::opt(
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
        let (g, s, h) = unsafe { op(group, stream, handle) }?;
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
        let mut gt = CRegion::<bf16>::new(
            "grad_tokens",
            a.grad_tokens.ptr as *const c_void,
            a.grad_tokens.len,
        )?;
        let mut gtw = CRegion::<f32>::opt(
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
        let (g, s, h) = unsafe { op(group, stream, handle) }?;
        on_kind!(g, h, |g, h| g.dispatch_backward(
            &s,
            h,
            &gr,
            grw.as_ref().map(|w| w as &dyn DeviceRegion<f32>),
            &mut gt,
            gtw.as_mut().map(|w| w as &mut dyn DeviceRegionMut<f32>),
        ))
    })
}

// ---- low-latency mode ---------------------------------------------------

/// `moe_ep_ll_handle_t`: one low-latency batch, and the group it belongs to.
pub struct CLlHandle {
    // NOTE: the batch's `LlHandle` borrows `*group`; its lifetime is
    // extended to 'static (`extend`), which is sound because `group` is
    // never replaced, keeps the group at its address (an `Arc`'s
    // allocation) while the handle lives, and is declared after `batch`, so
    // dropped after it. Nothing 'static leaves this struct: the accessors
    // copy addresses out.
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
    views: Option<LlHandle<'static>>,
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

/// # Safety
/// `h` borrows the `EpGroup` of the [`CLlHandle`] it is stored in (see the
/// note there).
unsafe fn extend(h: LlHandle<'_>) -> LlHandle<'static> {
    // SAFETY: only the lifetime changes; the caller's contract keeps the
    // group alive and in place for as long as the result lives.
    unsafe { std::mem::transmute::<LlHandle<'_>, LlHandle<'static>>(h) }
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

/// The group, its stream and the handle of a low-latency op.
unsafe fn ll_op<'a>(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *const CLlHandle,
) -> Result<(&'a CGroup, Arc<CudaStream>, &'a CLlHandle)> {
    // SAFETY: the header's contract for handles and streams.
    unsafe {
        let g = obj(group, "group")?;
        let h = obj(handle, "handle")?;
        h.check_group(g)?;
        let s = stream_of(g.comm().context(), stream)?;
        Ok((g, s, h))
    }
}

/// A low-latency dispatch's arguments, checked as C buffers, handed to `f`
/// as the Rust API takes them.
fn with_ll_args<R>(
    a: &CLlDispatchArgs,
    f: impl FnOnce(
        LlInput<'_>,
        TopkIdx<'_>,
        &dyn DeviceRegion<f32>,
        LlLayout,
        Option<Fp8Scaling>,
    ) -> Result<R>,
) -> Result<R> {
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
    let layout = match a.layout {
        MOE_EP_LAYOUT_RANK_MAJOR => LlLayout::RankMajor,
        MOE_EP_LAYOUT_EXPERT_MAJOR => LlLayout::ExpertMajor,
        l => {
            return Err(Error::arg(
                "layout",
                "MOE_EP_LAYOUT_RANK_MAJOR or MOE_EP_LAYOUT_EXPERT_MAJOR",
                l,
            ))
        }
    };
    let idx = CTopkIdx::new(a.topk_idx, a.topk_idx_dtype)?;
    let w = CRegion::<f32>::new("topk_weights", a.topk_weights.ptr, a.topk_weights.len)?;
    let (bf16_x, codes, scales);
    let x = if fp8_rows {
        codes = CRegion::<u8>::new("x", a.x.ptr, a.x.len)?;
        scales = CRegion::<f32>::new("x_scales", a.x_scales.ptr, a.x_scales.len)?;
        LlInput::Fp8 {
            codes: &codes,
            scales: &scales,
        }
    } else {
        if !a.x_scales.ptr.is_null() || a.x_scales.len != 0 {
            return Err(Error::arg(
                "x_scales",
                "not given ({NULL, 0}): only MOE_EP_LL_FP8 rows come with scales",
                format!("{:p} with len {}", a.x_scales.ptr, a.x_scales.len),
            ));
        }
        bf16_x = CRegion::<bf16>::new("x", a.x.ptr, a.x.len)?;
        LlInput::Bf16(&bf16_x)
    };
    f(x, idx.get(), &w, layout, cast)
}

/// The two forms of a low-latency dispatch.
unsafe fn ll_dispatch_impl(
    group: *const CGroup,
    stream: *mut c_void,
    args: *const CLlDispatchArgs,
    out: *mut *mut CLlHandle,
    wait: bool,
) -> Result<()> {
    let a = unsafe { read_in(args, "args") }?;
    with_ll_args(&a, |x, idx, w, layout, cast| {
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        let s = unsafe { stream_of(g.comm().context(), stream) }?;
        let topk = a.topk as usize;
        let num_tokens = idx.ptr_len().1.checked_div(topk).unwrap_or(0);
        // The handle's own reference to the group, which its batch borrows.
        let group = g.node()?.clone();
        let mut batch = LlBatchState::default();
        let buffer_set = if wait {
            let h = group.ll_dispatch(&s, x, idx, topk, w, layout, cast)?;
            let set = h.buffer_set();
            // SAFETY: `h` borrows `group`, which moves into the same handle.
            batch.views = Some(unsafe { extend(h) });
            set
        } else {
            let sent = group.ll_dispatch_send(&s, x, idx, topk, w, layout, cast)?;
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
    })
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
        let b = crate::ops::ll_buffer_bytes(&cfg, world);
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
        let (_, s, h) = unsafe { ll_op(group, stream, handle) }?;
        let mut st = h.lock();
        CLlHandle::expect_state("moe_ep_ll_dispatch_wait", &st, MOE_EP_LL_SENT)?;
        let sent = st.sent.as_ref().map(LlDispatchSent::again);
        let r = h.group.ll_dispatch_wait(&s, sent.expect("a sent batch"))?;
        // SAFETY: `r` borrows `h.group`, the handle's own reference.
        st.views = Some(unsafe { extend(r) });
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

fn combine_bufs(a: &CLlCombineArgs, send: bool, wait: bool) -> Result<CombineBufs> {
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

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_combine(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *mut CLlHandle,
    args: *const CLlCombineArgs,
) -> Status {
    ffi(|| {
        let a = unsafe { read_in(args, "args") }?;
        let mut b = combine_bufs(&a, true, true)?;
        let (g, s, h) = unsafe { ll_op(group, stream, handle) }?;
        let mut st = h.lock();
        CLlHandle::expect_state("moe_ep_ll_combine", &st, MOE_EP_LL_RECEIVED)?;
        let lh = st.views.as_ref().expect("a received batch");
        let w = b.w.as_ref().map(|w| w as &dyn DeviceRegion<f32>);
        g.node()?.ll_combine(&s, lh, &b.y, w, &mut b.out)?;
        st.combined = true;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_ll_combine_send(
    group: *const CGroup,
    stream: *mut c_void,
    handle: *mut CLlHandle,
    args: *const CLlCombineArgs,
) -> Status {
    ffi(|| {
        let a = unsafe { read_in(args, "args") }?;
        let b = combine_bufs(&a, true, false)?;
        let (g, s, h) = unsafe { ll_op(group, stream, handle) }?;
        let mut st = h.lock();
        CLlHandle::expect_state("moe_ep_ll_combine_send", &st, MOE_EP_LL_RECEIVED)?;
        let lh = st.views.as_ref().expect("a received batch");
        let sent = g.node()?.ll_combine_send(&s, lh, &b.y)?;
        st.combine = Some(sent);
        Ok(())
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
        let a = unsafe { read_in(args, "args") }?;
        let mut b = combine_bufs(&a, false, true)?;
        let (g, s, h) = unsafe { ll_op(group, stream, handle) }?;
        let mut st = h.lock();
        CLlHandle::expect_state("moe_ep_ll_combine_wait", &st, MOE_EP_LL_COMBINE_SENT)?;
        let sent = st.combine.as_ref().map(LlCombineSent::again);
        let w = b.w.as_ref().map(|w| w as &dyn DeviceRegion<f32>);
        g.node()?
            .ll_combine_wait(&s, sent.expect("a sent combine"), w, &mut b.out)?;
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

/// A view's address and length; `{NULL, 0}` for none.
fn view<T>(v: Option<impl DeviceRegion<T>>) -> CBuf {
    match v {
        Some(v) => CBuf {
            ptr: v.device_ptr() as *const c_void,
            len: v.len(),
        },
        None => CBuf {
            ptr: std::ptr::null(),
            len: 0,
        },
    }
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
            tokens: view(lh.tokens()),
            fp8_codes: view(lh.fp8_codes()),
            fp8_scales: view(lh.fp8_scales()),
            src: view(Some(lh.src())),
            topk_local_idx: view(lh.topk_local_idx()),
            topk_weights: view(lh.topk_weights()),
            tokens_per_local_expert: view(Some(lh.tokens_per_local_expert())),
            tokens_per_expert_source: view(Some(lh.tokens_per_expert_source())),
            tokens_from_rank: view(Some(lh.tokens_from_rank())),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_checks_name_the_argument_and_the_struct() {
        let mut c = CGroupConfig::init();
        c.magic = 7;
        let e = unsafe { read_in(&c, "cfg") }.unwrap_err().to_string();
        assert!(
            e.contains("`cfg`") && e.contains("moe_ep_group_config_t"),
            "{e}"
        );
        c.magic = CGroupConfig::MAGIC;
        c.size = 12;
        let e = unsafe { read_in(&c, "cfg") }.unwrap_err().to_string();
        assert!(e.contains("size 12"), "{e}");
    }

    #[test]
    fn overlapping_outputs_are_refused() {
        let e = disjoint(
            &[Some(("out", 0x1000, 64))],
            &[Some(("expert_out", 0x1020, 64))],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`out`") && e.contains("expert_out"), "{e}");
        disjoint(&[Some(("out", 0x1000, 64))], &[Some(("x", 0x1040, 64))]).unwrap();
    }

    #[test]
    fn every_status_is_named_in_order() {
        for (i, (s, _)) in STATUS_NAMES.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
    }
}
