//! Versioned structs: the [`Versioned`] trait (size and magic first), how
//! a caller's struct is read ([`read_in`]: a wrong magic or a size below
//! the first version's refused by name, an older struct completed with
//! defaults, a newer one accepted when its extra bytes are zero) and
//! written ([`write_out`]: up to the caller's size), and the `#[repr(C)]`
//! mirror of every struct of the header with its magic, init macro and
//! first version's size, checked at compile time.

use std::ffi::{c_char, c_void};

use moe_ep::error::{Error, Result};

/// The ABI version of this library (`MOE_EP_ABI_VERSION`): one more with
/// every release that adds to the ABI (the header has the rule). 2: the
/// low-latency mode; 3: `moe_ep_group_config_t.ranks_per_node`; 4: the
/// caller's windows (`moe_ep_pool_wrap_window`, `moe_ep_pool_wrap_device`)
/// and `moe_ep_buffer_range`; 5: the fp8 dispatch (`moe_ep_dispatch_fp8`),
/// `moe_ep_group_config_t.padding` and `.overflow`, the drop policy's
/// results (`moe_ep_handle_counts_t.max_recv_rows` and `.dropped_rows`,
/// `moe_ep_handle_dropped_rows`, `moe_ep_handle_dropped_slots`,
/// `moe_ep_handle_kept_topk_idx`), `moe_ep_recv_buffers_t.scales` and the
/// memory footprint (`moe_ep_group_memory_footprint`,
/// `moe_ep_handle_device_bytes`).
pub const ABI_VERSION: u32 = 6;

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
pub(crate) unsafe fn head<T: Versioned>(p: *const T, arg: &'static str) -> Result<usize> {
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
pub(crate) unsafe fn read_in<T: Versioned>(p: *const T, arg: &'static str) -> Result<T> {
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
pub(crate) unsafe fn write_out<T: Versioned>(
    p: *mut T,
    arg: &'static str,
    value: &T,
) -> Result<()> {
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

impl CBuf {
    /// A view's address and length; `{NULL, 0}` for none.
    pub(crate) fn view<T>(v: Option<impl moe_ep::ops::DeviceRegion<T>>) -> CBuf {
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
}

impl CBufMut {
    pub(crate) fn of(ptr: u64, len: usize) -> CBufMut {
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
    /// ABI 5: `moe_ep_padding_t` (0: zero the expert-major padding rows).
    pub padding: u32,
    /// ABI 5: `moe_ep_overflow_t` (0: rows over the capacity are an error).
    pub overflow: u32,
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
    /// ABI 5: an fp8 dispatch's scales (`tokens` then holds its codes).
    pub scales: CBufMut,
    /// ABI 5: `moe_ep_fp8_scales_t` of `scales`; 0 (none) for bf16 rows.
    pub scale_kind: u32,
    pub reserved: u32,
}

/// `moe_ep_dispatch_fp8_args_t` (ABI 5).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CDispatchFp8Args {
    pub size: u32,
    pub magic: u32,
    pub codes: CBuf,
    pub scales: CBuf,
    pub scale_kind: u32,
    pub reserved: u32,
    pub topk_weights: CBuf,
    pub recv_codes: CBufMut,
    pub recv_scales: CBufMut,
    pub recv_topk_weights: CBufMut,
}

/// `moe_ep_memory_footprint_t` (ABI 5).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CMemoryFootprint {
    pub size: u32,
    pub magic: u32,
    pub workspace: u64,
    pub low_latency: u64,
    pub pool_other: u64,
    pub pool_free: u64,
    pub two_level: u64,
    pub pinned_host: u64,
    pub device_total: u64,
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
    /// ABI 5: the most rows any rank receives (eager sizing).
    pub max_recv_rows: u64,
    /// ABI 5: rows dropped over all ranks (the drop policy; else 0).
    pub dropped_rows: u64,
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
// ABI 5.
versioned!(
    CDispatchFp8Args,
    "moe_ep_dispatch_fp8_args_t",
    0x4d4f_450e,
    "MOE_EP_DISPATCH_FP8_ARGS_INIT",
    112
);
versioned!(
    CMemoryFootprint,
    "moe_ep_memory_footprint_t",
    0x4d4f_450f,
    "MOE_EP_MEMORY_FOOTPRINT_INIT",
    64
);

// The first versions are the structs as they are now (ABI 1; the moe_ep_ll_*
// structs ABI 2, moe_ep_dispatch_fp8_args_t and moe_ep_memory_footprint_t
// ABI 5), except those ABI 3 and 5 grew: moe_ep_group_config_t by
// ranks_per_node (ABI 3, 8 bytes) and padding and overflow (ABI 5, 8 bytes),
// moe_ep_recv_buffers_t by scales and scale_kind (ABI 5, 24 bytes) and
// moe_ep_handle_counts_t by max_recv_rows and dropped_rows (ABI 5, 16
// bytes); the C test asserts the same sizes with
// _Static_assert, and capi/tests/capi.rs compares every field offset with
// the C compiler's.
const _: () = {
    use std::mem::size_of;
    assert!(
        size_of::<usize>() == 8,
        "the C ABI is laid out for 64-bit targets"
    );
    assert!(size_of::<CBuf>() == 16 && size_of::<CBufMut>() == 16);
    assert!(size_of::<CVersionInfo>() == CVersionInfo::MIN_SIZE);
    assert!(size_of::<CGroupConfig>() == CGroupConfig::MIN_SIZE + 16);
    assert!(size_of::<CLayoutArgs>() == CLayoutArgs::MIN_SIZE);
    assert!(size_of::<CDispatchArgs>() == CDispatchArgs::MIN_SIZE);
    assert!(size_of::<CCombineArgs>() == CCombineArgs::MIN_SIZE);
    assert!(size_of::<CCombineBackwardArgs>() == CCombineBackwardArgs::MIN_SIZE);
    assert!(size_of::<CDispatchBackwardArgs>() == CDispatchBackwardArgs::MIN_SIZE);
    assert!(size_of::<CRecvBuffers>() == CRecvBuffers::MIN_SIZE + 24);
    assert!(size_of::<CHandleCounts>() == CHandleCounts::MIN_SIZE + 16);
    assert!(size_of::<CLlDispatchArgs>() == CLlDispatchArgs::MIN_SIZE);
    assert!(size_of::<CLlCombineArgs>() == CLlCombineArgs::MIN_SIZE);
    assert!(size_of::<CLlHandleInfo>() == CLlHandleInfo::MIN_SIZE);
    assert!(size_of::<CLlBuffers>() == CLlBuffers::MIN_SIZE);
    assert!(size_of::<CDispatchFp8Args>() == CDispatchFp8Args::MIN_SIZE);
    assert!(size_of::<CMemoryFootprint>() == CMemoryFootprint::MIN_SIZE);
    assert!(size_of::<CUniqueId>() == 128);
};

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
}
