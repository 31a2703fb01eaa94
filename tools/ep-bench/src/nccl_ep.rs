//! NCCL EP (NVIDIA's expert-parallel library on NCCL's device API) as a
//! baseline measured beside moe-ep in the same run, and the cross-check of
//! what it receives and combines.
//!
//! The library is loaded at run time ([`load`]): `$MOE_EP_NCCL_EP_LIBRARY`
//! when set, else `libnccl_ep.so.0` through the dynamic loader's search
//! path. Nothing links against it: without it the rest of the run is the
//! same, and one line says it was left out. It needs NCCL >= 2.30.4 and the
//! very libnccl moe-ep uses (one per process): its `libnccl.so.2`
//! dependency resolves to the one moe-ep loaded first (same soname), and
//! [`load`] checks that (the version that dependency reports, and its file
//! when `MOE_EP_NCCL_LIBRARY` names one). It compiles its kernels at first
//! use with the machine's nvcc: `NCCL_EP_HOME` must name the folder that
//! holds its `include/`, `NCCL_HOME` an NCCL build with `include/nccl_device/`.
//!
//! # What stands beside what ([`pairing`])
//!
//! | ours | NCCL EP |
//! | --- | --- |
//! | `--mode ht --layout rank` | high-throughput (HT), flat layout |
//! | `--mode ht --layout expert:A` | HT, expert-major, per-expert alignment `A` (a power of two) |
//! | `--mode ll --layout expert` / `rank` | low-latency (LL), expert-major / rank-major ([`ll`]) |
//!
//! Its rows ([`crate::report::nccl_ep_row`]): `nccl-ep-layout` is `ncclEpUpdateHandle` (the
//! routing turned into its handle, what our layout op does),
//! `nccl-ep-dispatch` and `nccl-ep-combine` its forward dispatch and
//! combine, `nccl-ep-dispatch-bwd` its combine in the backward pass (the
//! data movement of our dispatch backward: gradients and weight gradients
//! home), `nccl-ep-combine-bwd` its dispatch in the backward pass. Our
//! `combine-push` is compared with `nccl-ep-combine`.
//!
//! `nccl-ep-dispatch-fp8` ([`Runner::dispatch_fp8`]) stands beside our
//! `dispatch-fp8`: its HT dispatch with the `NCCL_EP_DISP_QUANT_FWD`
//! recipe, which forwards the caller's codes and scales as their bytes
//! ("physical bytes forwarded without conversion"): our very codes
//! (`ncclFloat8e4m3`, `[T, H]`) and scales (`ncclFloat32` `[T, H / 128]`,
//! or `ncclUint8` `[T, H / 32]` for e8m0), so both libraries move the same
//! bytes, with the same weights, into receive buffers of the same shapes.
//! Either scale kind is matched. What is not: its recipe wants every row of
//! codes and of scales 16-byte aligned, so the `H / 32` bytes of scales a
//! row need `H` a multiple of 512 (ours: 128); below that its row is left
//! out with one line ([`FP8_WHY`]). Its other fp8 recipe (`DS_FP8E3M4`,
//! casting bf16 in its kernel) is LL-only ([`ll`]).
//!
//! Configuration ([`Runner::new`]): the same tokens, routing (our `topk_idx`,
//! `i64`), token rows and weights (our device buffers), `max_num_sms` = our
//! SM count, receive capacity = ours (at least the token count), recv
//! expert ids in local numbering; its tensors are plain device memory (no
//! NCCL windows: it stages). A receive overflow drops instead of trapping
//! (the pre-drop count is read back and turned into an error), and its GPU
//! waits give up after 30 s instead of about 100 (`NCCL_EP_TIMEOUT_MS`
//! overrides; a timeout still traps: HT has no masking). What its group and
//! handle take on the device is recorded as they are made
//! ([`Runner::memory`], [`crate::memory`]): `cuMemGetInfo` around
//! `ncclEpCreateGroup` and `ncclEpInitHandle`, and `ncclEpHandleMemSize`.
//!
//! # Cross-check ([`compare_dispatch`], [`compare_combine`])
//!
//! Its dispatch output is compared with the CPU reference of our layout
//! (`moe_ep::reference::dispatch`, which moe-ep's own check matches bit for
//! bit): the row count, the per-expert counts (padded in expert-major) and
//! offsets, and then every row, first position by position (same order as
//! ours); where that fails, order-independently, since NCCL EP's header
//! defines no order inside a flat buffer or an expert's zone: each row is
//! matched by its bits to an unmatched reference row (flat: of any source;
//! expert-major: of the same expert's zone) and its weights compared there
//! (flat: the (local expert, weight) pairs of the slots on this rank, by
//! position or else as a set; a slot whose expert is on another rank is
//! only required to say -1). Expert-major padding rows must be all +0.0.
//! Its combine of its own received rows (identity experts, as in our
//! check) is compared bit for bit with ours, the reference's emulation of
//! our arithmetic and the correctly rounded exact sum: every element must
//! equal one of them. Any difference fails the check and names the first.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void, CStr, OsString};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use libloading::Library;
use moe_ep::cuda::{CudaSlice, CudaStream};
use moe_ep::ops::DeviceRegion;
use moe_ep::reference::DispatchOutput;
use moe_ep::{bf16, Communicator, Mode, NcclVersion, RecvLayout};

use crate::cli::{Case, ScaleKind};
use crate::memory::NcclEpMemory;

pub mod ll;

/// Environment variable naming the NCCL EP library (a path or a soname).
pub const LIBRARY_ENV: &str = "MOE_EP_NCCL_EP_LIBRARY";
/// Library loaded when [`LIBRARY_ENV`] is unset or empty.
pub const DEFAULT_LIBRARY: &str = "libnccl_ep.so.0";
/// The variable moe-ep reads for its libnccl (the library's `MOE_EP_NCCL_LIBRARY`).
const MOE_EP_NCCL_ENV: &str = "MOE_EP_NCCL_LIBRARY";
/// Oldest NCCL that NCCL EP runs on (its device API).
pub const MIN_NCCL: NcclVersion = NcclVersion {
    major: 2,
    minor: 30,
    patch: 4,
};
/// Timeout of its GPU-side waits (ns): 30 s instead of its ~100 s default.
const TIMEOUT_NS: u64 = 30_000_000_000;
/// Its HT kernels' largest tokens per rank (`MAX_SUPPORTED_TOKENS_PER_RANK`).
const MAX_TOKENS: usize = 8192;
/// Its largest hidden size (`MAX_HIDDEN_DIM`).
const MAX_HIDDEN: usize = 16384;
/// Its largest local expert count (`NUM_MAX_LOCAL_EXPERTS`).
const MAX_LOCAL_EXPERTS: usize = 1024;
/// Hidden multiple of its fp8 rows (`QUANT_FWD`: each row of scales,
/// `H / 32` bytes, 16-byte aligned).
pub const FP8_HIDDEN_MULTIPLE: usize = 512;
/// Why its fp8 dispatch is left out of a case whose hidden size is not a
/// multiple of [`FP8_HIDDEN_MULTIPLE`].
pub const FP8_WHY: &str = "its QUANT_FWD recipe wants 16-byte aligned rows of scales (H / 32 \
bytes either kind): hidden a multiple of 512";

/// The C declarations, written from `nccl_ep.h` (API version 2, library
/// 0.2.0). Every struct starts with `size` and `magic`; the sizes are the
/// header's frozen boundaries (checked below and in the tests).
#[allow(non_camel_case_types)]
mod ffi {
    use std::ffi::{c_int, c_uint, c_ulong, c_void};

    /// `ncclResult_t`.
    pub type ncclResult_t = c_int;
    /// `ncclComm_t`.
    pub type ncclComm_t = *mut c_void;
    /// `cudaStream_t` (the driver's `CUstream`).
    pub type cudaStream_t = *mut c_void;
    /// `ncclEpGroup_t`.
    pub type ncclEpGroup_t = *mut c_void;
    /// `ncclEpHandle_t`.
    pub type ncclEpHandle_t = *mut c_void;

    /// `NCCL_EP_API_VERSION`.
    pub const API_VERSION: c_uint = 2;
    /// `NCCL_EP_MAGIC`.
    pub const MAGIC: c_uint = 0xC00F_FFEE;
    /// `NCCL_EP_TENSOR_MAGIC`.
    pub const TENSOR_MAGIC: c_uint = 0xCAFE_CAFE;

    /// `NCCL_EP_ALGO_LOW_LATENCY` ([`super::ll`]).
    pub const ALGO_LOW_LATENCY: c_int = 0;
    /// `NCCL_EP_ALGO_HIGH_THROUGHPUT`.
    pub const ALGO_HIGH_THROUGHPUT: c_int = 1;
    /// `NCCL_EP_LAYOUT_EXPERT_MAJOR`.
    pub const LAYOUT_EXPERT_MAJOR: c_int = 1;
    /// `NCCL_EP_LAYOUT_FLAT` (HT only).
    pub const LAYOUT_FLAT: c_int = 3;
    /// `NCCL_EP_OVERFLOW_DROP`.
    pub const OVERFLOW_DROP: c_int = 2;
    /// `NCCL_EP_FWD_PASS`.
    pub const FWD_PASS: c_int = 0;
    /// `NCCL_EP_BWD_PASS`.
    pub const BWD_PASS: c_int = 1;
    /// `NCCL_EP_EXPERT_ID_LOCAL`.
    pub const EXPERT_ID_LOCAL: c_int = 1;

    /// `NCCL_EP_DISP_QUANT_FWD`: codes and scales forwarded as given.
    pub const DISP_QUANT_FWD: c_int = 1;

    /// `ncclDataType_t` values used here.
    pub const NCCL_UINT8: c_int = 1;
    pub const NCCL_INT32: c_int = 2;
    pub const NCCL_INT64: c_int = 4;
    pub const NCCL_FLOAT32: c_int = 7;
    pub const NCCL_BFLOAT16: c_int = 9;
    pub const NCCL_FLOAT8E4M3: c_int = 10;

    /// `ncclEpTensor_t`.
    #[repr(C)]
    pub struct Tensor {
        pub size: c_uint,
        pub magic: c_uint,
        pub ndim: c_uint,
        pub datatype: c_int,
        pub data: *mut c_void,
        pub win_hdl: *mut c_void,
        pub win_offset: u64,
        pub sizes: *mut usize,
    }

    /// `ncclEpAllocConfig_t` (all null: cudaMalloc / cudaFree).
    #[repr(C)]
    pub struct AllocConfig {
        pub alloc_fn: *mut c_void,
        pub free_fn: *mut c_void,
        pub context: *mut c_void,
    }

    /// `ncclEpGroupConfig_t`.
    #[repr(C)]
    pub struct GroupConfig {
        pub size: c_uint,
        pub magic: c_uint,
        pub version: c_uint,
        pub algorithm: c_int,
        pub num_experts: c_uint,
        pub max_dispatch_tokens_per_rank: c_uint,
        pub max_recv_tokens_per_rank: c_uint,
        pub max_token_bytes: c_uint,
        pub rdma_buffer_size: c_ulong,
        pub num_qp_per_rank: c_uint,
        pub num_channels: c_uint,
        pub max_num_sms: c_uint,
        pub alloc: AllocConfig,
        pub enable_mask: c_uint,
        pub timeout_ns: u64,
        pub zero_copy: c_int,
        pub overflow_policy: c_int,
        pub num_topk: c_uint,
        pub padding_v2: [u8; 4],
    }

    /// `ncclEpLayoutInfo_t`.
    #[repr(C)]
    pub struct LayoutInfo {
        pub size: c_uint,
        pub magic: c_uint,
        pub expert_counters: *mut Tensor,
        pub src_rank_counters: *mut Tensor,
        pub expert_offsets: *mut Tensor,
        pub recv_total_counter: *mut Tensor,
        pub recv_topk_idx_kind: c_int,
        pub padding_v2: [u8; 4],
    }

    /// `ncclEpDispatchInputs_t` and `ncclEpCombineInputs_t` (same fields).
    #[repr(C)]
    pub struct Inputs {
        pub size: c_uint,
        pub magic: c_uint,
        pub tokens: *mut Tensor,
        pub topk_weights: *mut Tensor,
        pub scales: *mut Tensor,
    }

    /// `ncclEpDispatchOutputs_t`.
    #[repr(C)]
    pub struct DispatchOutputs {
        pub size: c_uint,
        pub magic: c_uint,
        pub tokens: *mut Tensor,
        pub topk_weights: *mut Tensor,
        pub scales: *mut Tensor,
        pub topk_idx: *mut Tensor,
    }

    /// `ncclEpCombineOutputs_t`.
    #[repr(C)]
    pub struct CombineOutputs {
        pub size: c_uint,
        pub magic: c_uint,
        pub tokens: *mut Tensor,
        pub topk_weights: *mut Tensor,
    }

    /// `ncclEpHandleConfig_t`.
    #[repr(C)]
    pub struct HandleConfig {
        pub size: c_uint,
        pub magic: c_uint,
        pub dispatch_output_per_expert_alignment: usize,
    }

    /// `ncclEpDispatchConfig_t`.
    #[repr(C)]
    pub struct DispatchConfig {
        pub size: c_uint,
        pub magic: c_uint,
        pub send_only: c_uint,
        pub round_scales: c_uint,
        pub pass_direction: c_int,
        pub quant_recipe: c_int,
    }

    /// `ncclEpCombineConfig_t`.
    #[repr(C)]
    pub struct CombineConfig {
        pub size: c_uint,
        pub magic: c_uint,
        pub send_only: c_uint,
        pub pass_direction: c_int,
        pub quant_recipe: c_int,
    }

    // The header's current sizes (its `_V2_SIZE` / `_V1_SIZE` boundaries).
    const _: () = assert!(std::mem::size_of::<Tensor>() == 48);
    const _: () = assert!(std::mem::size_of::<GroupConfig>() == 112);
    const _: () = assert!(std::mem::offset_of!(GroupConfig, timeout_ns) + 8 == 96);
    const _: () = assert!(std::mem::size_of::<LayoutInfo>() == 48);
    const _: () = assert!(std::mem::size_of::<Inputs>() == 32);
    const _: () = assert!(std::mem::size_of::<DispatchOutputs>() == 40);
    const _: () = assert!(std::mem::size_of::<CombineOutputs>() == 24);
    const _: () = assert!(std::mem::size_of::<HandleConfig>() == 16);
    const _: () = assert!(std::mem::size_of::<DispatchConfig>() == 24);
    const _: () = assert!(std::mem::size_of::<CombineConfig>() == 20);

    pub type GetVersion = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;
    pub type CreateGroup =
        unsafe extern "C" fn(*mut ncclEpGroup_t, ncclComm_t, *const GroupConfig) -> ncclResult_t;
    pub type GroupDestroy = unsafe extern "C" fn(ncclEpGroup_t) -> ncclResult_t;
    pub type InitHandle = unsafe extern "C" fn(
        *mut ncclEpHandle_t,
        ncclEpGroup_t,
        c_int,
        *const HandleConfig,
        c_int,
        *const Tensor,
    ) -> ncclResult_t;
    pub type UpdateHandle = unsafe extern "C" fn(
        ncclEpHandle_t,
        *const Tensor,
        *const LayoutInfo,
        cudaStream_t,
    ) -> ncclResult_t;
    pub type HandleDestroy = unsafe extern "C" fn(ncclEpHandle_t) -> ncclResult_t;
    /// `ncclEpHandleMemSize(group, layout, config, size_out, num_topk)`:
    /// the device bytes of a handle's routing buffers.
    pub type HandleMemSize = unsafe extern "C" fn(
        ncclEpGroup_t,
        c_int,
        *const HandleConfig,
        *mut usize,
        c_int,
    ) -> ncclResult_t;
    pub type Dispatch = unsafe extern "C" fn(
        ncclEpHandle_t,
        *const Inputs,
        *const DispatchOutputs,
        *const LayoutInfo,
        *const DispatchConfig,
        cudaStream_t,
    ) -> ncclResult_t;
    pub type Combine = unsafe extern "C" fn(
        ncclEpHandle_t,
        *const Inputs,
        *const CombineOutputs,
        *const CombineConfig,
        cudaStream_t,
    ) -> ncclResult_t;
    /// NCCL's `ncclGetVersion`, `ncclGetErrorString`, `ncclGetLastError`.
    pub type NcclGetVersion = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;
    pub type NcclErrorString = unsafe extern "C" fn(ncclResult_t) -> *const std::ffi::c_char;
    pub type NcclLastError = unsafe extern "C" fn(ncclComm_t) -> *const std::ffi::c_char;

    /// glibc's `Dl_info`.
    #[repr(C)]
    pub struct DlInfo {
        pub fname: *const std::ffi::c_char,
        pub fbase: *mut c_void,
        pub sname: *const std::ffi::c_char,
        pub saddr: *mut c_void,
    }
    pub type Dladdr = unsafe extern "C" fn(*const c_void, *mut DlInfo) -> c_int;
}

/// The loaded library: its entry points, and what it runs on.
pub struct Lib {
    /// `ncclEpGetVersion`'s code (0.2.0 = 200).
    pub version: i32,
    /// What was loaded (path or soname).
    pub path: OsString,
    /// The NCCL its `libnccl.so.2` dependency is.
    pub nccl: NcclVersion,
    /// That NCCL's file, when the loader says.
    pub nccl_file: Option<PathBuf>,
    create_group: ffi::CreateGroup,
    group_destroy: ffi::GroupDestroy,
    init_handle: ffi::InitHandle,
    update_handle: ffi::UpdateHandle,
    handle_destroy: ffi::HandleDestroy,
    /// `ncclEpHandleMemSize`, where the library has it.
    handle_mem_size: Option<ffi::HandleMemSize>,
    dispatch: ffi::Dispatch,
    combine: ffi::Combine,
    error_string: Option<ffi::NcclErrorString>,
    last_error: Option<ffi::NcclLastError>,
    /// Kept loaded for the process: groups and handles live in it.
    _lib: Library,
}

/// `a.b.c` of a packed `MAJOR*10000 + MINOR*100 + PATCH` code.
fn dotted(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

impl Lib {
    /// One line on what runs: `NCCL EP 0.2.0 (libnccl_ep.so.0) on NCCL 2.30.7 (/path)`.
    pub fn describe(&self) -> String {
        let file = self
            .nccl_file
            .as_ref()
            .map_or(String::new(), |f| format!(" ({})", f.display()));
        format!(
            "NCCL EP {} ({}) on NCCL {}{file}",
            dotted(self.version),
            Path::new(&self.path).display(),
            self.nccl
        )
    }

    /// Loads `path` and checks the NCCL under it (see the module docs).
    fn load(path: &OsString) -> Result<Lib, String> {
        let shown = Path::new(path).display().to_string();
        // SAFETY: loading NCCL EP runs its (and NCCL's) initializers only.
        let lib = unsafe { Library::new(path) }.map_err(|e| {
            format!(
                "cannot load {shown} ({}); put it on the library path or set {LIBRARY_ENV}",
                one_line(&e.to_string())
            )
        })?;
        /// Copies symbol `name` of type `T` out of `lib`.
        ///
        /// # Safety
        /// `T` must be the C signature of `name`.
        unsafe fn sym<T: Copy>(lib: &Library, name: &str, shown: &str) -> Result<T, String> {
            lib.get::<T>(name.as_bytes())
                .map(|s| *s)
                .map_err(|e| format!("{shown} lacks `{name}` ({})", one_line(&e.to_string())))
        }
        // SAFETY (every `sym` below): the types are the header's signatures.
        let get_version: ffi::GetVersion = unsafe { sym(&lib, "ncclEpGetVersion", &shown)? };
        let mut version: c_int = 0;
        // SAFETY: a valid out-pointer; the call needs no state.
        let rc = unsafe { get_version(&mut version) };
        if rc != 0 {
            return Err(format!("ncclEpGetVersion failed with NCCL error {rc}"));
        }
        // NCCL as NCCL EP sees it: a handle's lookup searches its dependencies.
        let nccl_get_version: ffi::NcclGetVersion = unsafe { sym(&lib, "ncclGetVersion", &shown)? };
        let mut code: c_int = 0;
        // SAFETY: as above.
        let rc = unsafe { nccl_get_version(&mut code) };
        if rc != 0 {
            return Err(format!(
                "ncclGetVersion (under {shown}) failed with error {rc}"
            ));
        }
        let nccl = NcclVersion::from_code(code);
        if nccl < MIN_NCCL {
            return Err(format!(
                "it needs NCCL >= {MIN_NCCL}, the process has NCCL {nccl} (build one: \
                 .nccl-ep/build-nccl.sh, then point {MOE_EP_NCCL_ENV} and LD_LIBRARY_PATH at it)"
            ));
        }
        let nccl_file = file_of(nccl_get_version as *const c_void);
        if let (Some(theirs), Some(ours)) = (&nccl_file, moe_ep_nccl_file()) {
            let same = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            if same(theirs) != same(&ours) {
                return Err(format!(
                    "it runs on {} while moe-ep loaded {} ({MOE_EP_NCCL_ENV}): one libnccl per \
                     process is needed",
                    theirs.display(),
                    ours.display()
                ));
            }
        }
        // SAFETY (every `sym`): the header's signatures.
        unsafe {
            Ok(Lib {
                version,
                path: path.clone(),
                nccl,
                nccl_file,
                create_group: sym(&lib, "ncclEpCreateGroup", &shown)?,
                group_destroy: sym(&lib, "ncclEpGroupDestroy", &shown)?,
                init_handle: sym(&lib, "ncclEpInitHandle", &shown)?,
                update_handle: sym(&lib, "ncclEpUpdateHandle", &shown)?,
                handle_destroy: sym(&lib, "ncclEpHandleDestroy", &shown)?,
                handle_mem_size: sym(&lib, "ncclEpHandleMemSize", &shown).ok(),
                dispatch: sym(&lib, "ncclEpDispatch", &shown)?,
                combine: sym(&lib, "ncclEpCombine", &shown)?,
                error_string: sym(&lib, "ncclGetErrorString", &shown).ok(),
                last_error: sym(&lib, "ncclGetLastError", &shown).ok(),
                _lib: lib,
            })
        }
    }

    /// `Ok` for `ncclSuccess`, else an error naming `what`, NCCL's words for
    /// the code and its last error on `comm`.
    fn check(
        &self,
        what: &str,
        rc: ffi::ncclResult_t,
        comm: ffi::ncclComm_t,
    ) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        let text = |p: *const c_char| {
            // SAFETY: NCCL returns static or per-thread NUL-terminated strings.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        // SAFETY: plain lookups of NCCL's messages.
        let name = self.error_string.and_then(|f| text(unsafe { f(rc) }));
        let last = self
            .last_error
            .and_then(|f| text(unsafe { f(comm) }))
            .filter(|s| !s.is_empty());
        let mut msg = format!("{what} failed: NCCL error {rc}");
        if let Some(n) = name {
            msg += &format!(" ({n})");
        }
        if let Some(l) = last {
            msg += &format!(": {}", one_line(&l));
        }
        Err(msg)
    }
}

/// `s` on one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Free device memory of the current context's GPU (`cuMemGetInfo`).
fn free_device() -> Result<u64, String> {
    moe_ep::cuda::result::mem_get_info()
        .map(|(free, _)| free as u64)
        .map_err(|e| format!("cuMemGetInfo: {e}"))
}

/// Runs `f` (a creation call of NCCL EP) and returns its result with the
/// device memory it took: the free memory before less the free memory
/// after (0 if it grew). `stream`'s context is drained first, so that the
/// stream-ordered pools' trimming at a synchronisation does not land
/// inside the measurement (see [`crate::memory`]).
pub(crate) fn measured<T>(
    stream: &CudaStream,
    f: impl FnOnce() -> Result<T, String>,
) -> Result<(T, u64), String> {
    stream.context().synchronize().map_err(s)?;
    let before = free_device()?;
    let v = f()?;
    let after = free_device()?;
    Ok((v, before.saturating_sub(after)))
}

impl Lib {
    /// `ncclEpHandleMemSize` of a handle of `group` with `layout`,
    /// `config` and `topk`; `None` where the library lacks the query or
    /// refuses it.
    pub(crate) fn handle_mem_size(
        &self,
        group: ffi::ncclEpGroup_t,
        layout: c_int,
        config: &ffi::HandleConfig,
        topk: usize,
    ) -> Option<u64> {
        let f = self.handle_mem_size?;
        let mut bytes = 0usize;
        // SAFETY: a live group, a valid config and out-pointer.
        let rc = unsafe { f(group, layout, config, &mut bytes, topk as c_int) };
        (rc == 0).then_some(bytes as u64)
    }
}

/// The file of the loaded object holding `addr` (glibc's `dladdr`, looked
/// up at run time; `None` where it is not there).
fn file_of(addr: *const c_void) -> Option<PathBuf> {
    // The process's own global scope.
    let this = libloading::os::unix::Library::this();
    // SAFETY: glibc's signature.
    let dladdr: ffi::Dladdr = unsafe { this.get::<ffi::Dladdr>(b"dladdr").ok().map(|s| *s)? };
    let mut info = ffi::DlInfo {
        fname: std::ptr::null(),
        fbase: std::ptr::null_mut(),
        sname: std::ptr::null(),
        saddr: std::ptr::null_mut(),
    };
    // SAFETY: a valid out-struct; addr is a function of a loaded object.
    if unsafe { dladdr(addr, &mut info) } == 0 || info.fname.is_null() {
        return None;
    }
    // SAFETY: the loader's NUL-terminated path.
    let name = unsafe { CStr::from_ptr(info.fname) }
        .to_string_lossy()
        .into_owned();
    Some(PathBuf::from(name))
}

/// The libnccl file moe-ep loads when `MOE_EP_NCCL_LIBRARY` names a path
/// (otherwise it loads `libnccl.so.2` by soname, the very dependency NCCL
/// EP resolves to).
fn moe_ep_nccl_file() -> Option<PathBuf> {
    let p = std::env::var_os(MOE_EP_NCCL_ENV).filter(|p| !p.is_empty())?;
    let p = PathBuf::from(p);
    p.components().count().gt(&1).then_some(p)
}

/// `$MOE_EP_NCCL_EP_LIBRARY` when set and not empty, else `libnccl_ep.so.0`.
pub fn library_path() -> OsString {
    match std::env::var_os(LIBRARY_ENV) {
        Some(p) if !p.is_empty() => p,
        _ => OsString::from(DEFAULT_LIBRARY),
    }
}

/// The process-wide library, loaded on first use; a failure (one line, the
/// reason) is remembered. Load moe-ep's NCCL first (a communicator), so
/// that NCCL EP's dependency resolves to it.
pub fn load() -> Result<&'static Lib, String> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| Lib::load(&library_path()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The NCCL EP configuration that stands beside one case of ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pairing {
    /// `ncclEpAlgorithm_t`.
    algorithm: c_int,
    /// `ncclEpLayout_t`.
    layout: c_int,
    /// Expert-major zone alignment in rows (0: flat).
    alignment: usize,
}

impl Pairing {
    /// `HT flat` or `HT expert-major:128`.
    pub fn name(&self) -> String {
        match self.layout {
            ffi::LAYOUT_FLAT => "HT flat".to_string(),
            _ => format!("HT expert-major:{}", self.alignment),
        }
    }

    fn expert_major(&self) -> bool {
        self.layout == ffi::LAYOUT_EXPERT_MAJOR
    }
}

/// What NCCL EP runs beside `case`, or why nothing does.
pub fn pairing(case: &Case, world: usize) -> Result<Pairing, String> {
    if case.mode != Mode::HighThroughput {
        return Err("a --mode ll case pairs with its LL mode (nccl_ep::ll::pairing)".into());
    }
    if case.tokens == 0 {
        return Err("it needs at least one token per rank".into());
    }
    if case.tokens > MAX_TOKENS {
        return Err(format!(
            "its HT kernels take at most {MAX_TOKENS} tokens per rank"
        ));
    }
    if case.hidden > MAX_HIDDEN {
        return Err(format!("its largest hidden size is {MAX_HIDDEN}"));
    }
    if case.experts / world.max(1) > MAX_LOCAL_EXPERTS {
        return Err(format!(
            "it takes at most {MAX_LOCAL_EXPERTS} experts per rank"
        ));
    }
    let (layout, alignment) = match case.layout {
        RecvLayout::RankMajor => (ffi::LAYOUT_FLAT, 0),
        RecvLayout::ExpertMajor { alignment } if alignment.is_power_of_two() => {
            (ffi::LAYOUT_EXPERT_MAJOR, alignment)
        }
        RecvLayout::ExpertMajor { alignment } => {
            return Err(format!(
                "its expert-major alignment must be a power of two, not {alignment}"
            ))
        }
    };
    Ok(Pairing {
        algorithm: ffi::ALGO_HIGH_THROUGHPUT,
        layout,
        alignment,
    })
}

/// One tensor descriptor with its own extents.
struct Desc {
    t: ffi::Tensor,
    sizes: [usize; 3],
}

impl Desc {
    /// A descriptor of `dims` (1 to 3) elements of `datatype` at `data`;
    /// boxed so that its address, and `sizes`', stay put.
    fn new(datatype: c_int, data: u64, dims: &[usize]) -> Box<Desc> {
        let mut sizes = [0usize; 3];
        sizes[..dims.len()].copy_from_slice(dims);
        let mut d = Box::new(Desc {
            t: ffi::Tensor {
                size: std::mem::size_of::<ffi::Tensor>() as c_uint,
                magic: ffi::TENSOR_MAGIC,
                ndim: dims.len() as c_uint,
                datatype,
                data: data as *mut c_void,
                win_hdl: std::ptr::null_mut(),
                win_offset: 0,
                sizes: std::ptr::null_mut(),
            },
            sizes,
        });
        d.t.sizes = d.sizes.as_mut_ptr();
        d
    }

    fn ptr(&mut self) -> *mut ffi::Tensor {
        &mut self.t
    }
}

/// The sizes of one case.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Tokens per rank (>= 1).
    pub tokens: usize,
    /// Hidden size (bf16 elements).
    pub hidden: usize,
    /// Top-k.
    pub topk: usize,
    /// Experts (all ranks).
    pub experts: usize,
    /// Ranks.
    pub world: usize,
    /// SMs (`max_num_sms`).
    pub num_sms: usize,
    /// Receive rows (ours: exact for this routing).
    pub recv_rows: usize,
    /// What runs.
    pub pairing: Pairing,
}

/// Device addresses of our inputs: `topk_idx` `[T, K]` i64, `x` `[T, H]`
/// bf16, `w` `[T, K]` f32, and (`dispatch-fp8`) the fp8 rows.
#[derive(Clone, Copy, Debug)]
pub struct Inputs {
    pub topk_idx: u64,
    pub x: u64,
    pub w: u64,
    pub fp8: Option<Fp8Inputs>,
}

/// Device addresses of our fp8 rows: `codes` `[T, H]` e4m3, `scales`
/// `[T, kind.per_row(H)]` of `kind`.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Inputs {
    pub codes: u64,
    pub scales: u64,
    pub kind: ScaleKind,
}

/// The descriptors and receive buffers of its fp8 dispatch.
struct Fp8 {
    codes: Box<Desc>,
    scales: Box<Desc>,
    recv_codes: Box<Desc>,
    recv_scales: Box<Desc>,
    /// `[slots, H]` codes.
    recv_codes_buf: CudaSlice<u8>,
    /// `[slots, H / 32]` bytes of scales (f32 or e8m0).
    recv_scales_buf: CudaSlice<u8>,
}

impl Fp8 {
    /// The descriptors of `inputs` (`t` rows of `h` values) and receive
    /// buffers of `slots` rows.
    fn new(
        stream: &Arc<CudaStream>,
        inputs: Fp8Inputs,
        t: usize,
        h: usize,
        slots: usize,
    ) -> R<Fp8> {
        let kind = inputs.kind;
        let dtype = match kind {
            ScaleKind::F32 => ffi::NCCL_FLOAT32,
            ScaleKind::E8m0 => ffi::NCCL_UINT8,
        };
        let per = kind.per_row(h);
        let alloc = |what: &'static str| move |e| format!("NCCL EP {what} ({slots} rows): {e}");
        let recv_codes_buf = stream
            .alloc_zeros::<u8>(slots * h)
            .map_err(alloc("fp8 receive buffer"))?;
        let recv_scales_buf = stream
            .alloc_zeros::<u8>(slots * kind.row_bytes(h))
            .map_err(alloc("fp8 receive scales"))?;
        Ok(Fp8 {
            codes: Desc::new(ffi::NCCL_FLOAT8E4M3, inputs.codes, &[t, h]),
            scales: Desc::new(dtype, inputs.scales, &[t, per]),
            recv_codes: Desc::new(
                ffi::NCCL_FLOAT8E4M3,
                recv_codes_buf.device_ptr(),
                &[slots, h],
            ),
            recv_scales: Desc::new(dtype, recv_scales_buf.device_ptr(), &[slots, per]),
            recv_codes_buf,
            recv_scales_buf,
        })
    }
}

/// The first `n` values of `words` as written with `datatype` (int64, or
/// int32 two to a word).
fn decode(words: &[i64], n: usize, datatype: c_int) -> Vec<i64> {
    if datatype == ffi::NCCL_INT64 {
        return words[..n.min(words.len())].to_vec();
    }
    words
        .iter()
        .flat_map(|w| {
            let b = w.to_ne_bytes();
            [
                i32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
                i32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
            ]
        })
        .take(n)
        .map(i64::from)
        .collect()
}

/// What NCCL EP received on this rank, on the host.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Received {
    /// Rows (flat: tokens; expert-major: padded slots).
    pub total: usize,
    /// `[total * H]`.
    pub rows: Vec<bf16>,
    /// Flat `[total * K]`, expert-major `[total]`.
    pub weights: Vec<f32>,
    /// Flat: `[total * K]` local expert ids, -1 off this rank.
    pub idx: Option<Vec<i64>>,
    /// `[E_local]`: flat unpadded, expert-major padded counts.
    pub counts: Vec<i64>,
    /// Expert-major: `[E_local]` zone offsets.
    pub offsets: Option<Vec<i64>>,
}

/// A group and a handle of NCCL EP for one case, with its buffers.
pub struct Runner {
    lib: &'static Lib,
    comm: ffi::ncclComm_t,
    group: ffi::ncclEpGroup_t,
    handle: ffi::ncclEpHandle_t,
    spec: Spec,
    slots: usize,
    stream: Arc<CudaStream>,
    /// What its group and handle took ([`crate::memory`]).
    memory: NcclEpMemory,
    // Descriptors: ours (idx, x, w), then its buffers'.
    idx: Box<Desc>,
    x: Box<Desc>,
    w: Box<Desc>,
    recv_x: Box<Desc>,
    recv_w: Box<Desc>,
    recv_idx: Option<Box<Desc>>,
    counts: Box<Desc>,
    offsets: Option<Box<Desc>>,
    total: Box<Desc>,
    out: Box<Desc>,
    out_w: Box<Desc>,
    /// Its fp8 dispatch (`None`: not asked for, or [`FP8_WHY`]).
    fp8: Option<Fp8>,
    // Its buffers (freed after the handle and group, in field order).
    recv_x_buf: CudaSlice<bf16>,
    recv_w_buf: CudaSlice<f32>,
    recv_idx_buf: Option<CudaSlice<i64>>,
    counts_buf: CudaSlice<i64>,
    offsets_buf: Option<CudaSlice<i64>>,
    total_buf: CudaSlice<i32>,
    out_buf: CudaSlice<bf16>,
    _out_w_buf: CudaSlice<f32>,
}

type R<T> = Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

impl Runner {
    /// Creates the group (collective: every rank, in the same order) and
    /// the handle, and allocates the buffers.
    ///
    /// # Safety
    /// `inputs` must stay valid device memory of `stream`'s GPU, of the
    /// sizes `spec` gives, for the life of the runner.
    pub unsafe fn new(
        lib: &'static Lib,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        spec: Spec,
        inputs: Inputs,
    ) -> R<Runner> {
        let raw = comm.raw().ok_or("no NCCL communicator (virtual ranks)")? as ffi::ncclComm_t;
        let (t, h, k) = (spec.tokens, spec.hidden, spec.topk);
        let e_local = spec.experts / spec.world;
        let em = spec.pairing.expert_major();
        let slots = spec.recv_rows.max(t);
        let alloc_err = |what: &'static str| move |e| format!("NCCL EP {what} ({slots} rows): {e}");
        let recv_x_buf = stream
            .alloc_zeros::<bf16>(slots * h)
            .map_err(alloc_err("receive buffer"))?;
        let recv_w_buf = stream
            .alloc_zeros::<f32>(if em { slots } else { slots * k })
            .map_err(alloc_err("receive weights"))?;
        let recv_idx_buf = if em {
            None
        } else {
            Some(stream.alloc_zeros::<i64>(slots * k).map_err(s)?)
        };
        let counts_buf = stream.alloc_zeros::<i64>(e_local).map_err(s)?;
        let offsets_buf = if em {
            Some(stream.alloc_zeros::<i64>(e_local).map_err(s)?)
        } else {
            None
        };
        let total_buf = stream.alloc_zeros::<i32>(1).map_err(s)?;
        let out_buf = stream.alloc_zeros::<bf16>(t * h).map_err(s)?;
        let out_w_buf = stream.alloc_zeros::<f32>(t * k).map_err(s)?;
        let fp8 = match inputs.fp8 {
            Some(f) if h.is_multiple_of(FP8_HIDDEN_MULTIPLE) => {
                Some(Fp8::new(stream, f, t, h, slots)?)
            }
            _ => None,
        };
        // Every counter in one type (0.2.0 asserts that they share it, and
        // flat ones must be int32); the buffers are i64 words, read back
        // by `decode`.
        let count_type = ffi::NCCL_INT32;
        let mut r = Runner {
            lib,
            comm: raw,
            group: std::ptr::null_mut(),
            handle: std::ptr::null_mut(),
            spec,
            slots,
            stream: stream.clone(),
            memory: NcclEpMemory::default(),
            idx: Desc::new(ffi::NCCL_INT64, inputs.topk_idx, &[t, k]),
            x: Desc::new(ffi::NCCL_BFLOAT16, inputs.x, &[t, h]),
            w: Desc::new(ffi::NCCL_FLOAT32, inputs.w, &[t, k]),
            recv_x: Desc::new(ffi::NCCL_BFLOAT16, recv_x_buf.device_ptr(), &[slots, h]),
            recv_w: if em {
                Desc::new(ffi::NCCL_FLOAT32, recv_w_buf.device_ptr(), &[slots])
            } else {
                Desc::new(ffi::NCCL_FLOAT32, recv_w_buf.device_ptr(), &[slots, k])
            },
            recv_idx: recv_idx_buf
                .as_ref()
                .map(|b| Desc::new(ffi::NCCL_INT64, b.device_ptr(), &[slots, k])),
            counts: Desc::new(count_type, counts_buf.device_ptr(), &[e_local]),
            offsets: offsets_buf
                .as_ref()
                .map(|b| Desc::new(count_type, b.device_ptr(), &[e_local])),
            total: Desc::new(count_type, total_buf.device_ptr(), &[1]),
            out: Desc::new(ffi::NCCL_BFLOAT16, out_buf.device_ptr(), &[t, h]),
            out_w: Desc::new(ffi::NCCL_FLOAT32, out_w_buf.device_ptr(), &[t, k]),
            fp8,
            recv_x_buf,
            recv_w_buf,
            recv_idx_buf,
            counts_buf,
            offsets_buf,
            total_buf,
            out_buf,
            _out_w_buf: out_w_buf,
        };
        // The buffers are zeroed on the stream: done before NCCL EP's own streams use them.
        stream.synchronize().map_err(s)?;
        let cfg = ffi::GroupConfig {
            size: std::mem::size_of::<ffi::GroupConfig>() as c_uint,
            magic: ffi::MAGIC,
            version: ffi::API_VERSION,
            algorithm: spec.pairing.algorithm,
            num_experts: spec.experts as c_uint,
            max_dispatch_tokens_per_rank: t as c_uint,
            max_recv_tokens_per_rank: slots as c_uint,
            // bf16 rows; an fp8 row and its scales (H + H / 32 bytes) fit too.
            max_token_bytes: (h * 2) as c_uint,
            rdma_buffer_size: 0 as c_ulong,
            num_qp_per_rank: 0,
            num_channels: 0,
            max_num_sms: spec.num_sms as c_uint,
            alloc: ffi::AllocConfig {
                alloc_fn: std::ptr::null_mut(),
                free_fn: std::ptr::null_mut(),
                context: std::ptr::null_mut(),
            },
            enable_mask: 0,
            timeout_ns: TIMEOUT_NS,
            zero_copy: 0,
            overflow_policy: ffi::OVERFLOW_DROP,
            num_topk: 0,
            padding_v2: [0; 4],
        };
        let ((), taken) = measured(stream, || {
            // SAFETY: a valid config and out-pointer; raw is moe-ep's live communicator.
            let rc = unsafe { (lib.create_group)(&mut r.group, raw, &cfg) };
            lib.check("ncclEpCreateGroup", rc, raw)
        })?;
        r.memory.group_measured = taken;
        let hcfg = ffi::HandleConfig {
            size: std::mem::size_of::<ffi::HandleConfig>() as c_uint,
            magic: ffi::MAGIC,
            dispatch_output_per_expert_alignment: spec.pairing.alignment,
        };
        r.memory.handle_queried = lib.handle_mem_size(r.group, spec.pairing.layout, &hcfg, k);
        let ((), taken) = measured(stream, || {
            // SAFETY: a live group, a valid config. The header says -1 for
            // HT, but 0.2.0 refuses it ("HT mode requires num_topk > 0").
            let rc = unsafe {
                (lib.init_handle)(
                    &mut r.handle,
                    r.group,
                    spec.pairing.layout,
                    &hcfg,
                    k as c_int,
                    std::ptr::null(),
                )
            };
            lib.check("ncclEpInitHandle", rc, raw)
        })?;
        r.memory.init_handle_measured = taken;
        Ok(r)
    }

    fn stream_ptr(&self) -> ffi::cudaStream_t {
        self.stream.cu_stream() as ffi::cudaStream_t
    }

    /// What its group and handle took on this rank ([`crate::memory`]).
    pub fn memory(&self) -> NcclEpMemory {
        self.memory
    }

    /// `ncclEpUpdateHandle`: the routing into the handle (its "layout");
    /// writes the counters.
    pub fn layout(&mut self) -> R<()> {
        let info = ffi::LayoutInfo {
            size: std::mem::size_of::<ffi::LayoutInfo>() as c_uint,
            magic: ffi::MAGIC,
            expert_counters: self.counts.ptr(),
            src_rank_counters: std::ptr::null_mut(),
            expert_offsets: self
                .offsets
                .as_mut()
                .map_or(std::ptr::null_mut(), |d| d.ptr()),
            recv_total_counter: self.total.ptr(),
            recv_topk_idx_kind: ffi::EXPERT_ID_LOCAL,
            padding_v2: [0; 4],
        };
        let stream = self.stream_ptr();
        // SAFETY: live handle, descriptors of live buffers, our stream.
        let rc = unsafe { (self.lib.update_handle)(self.handle, self.idx.ptr(), &info, stream) };
        self.lib.check("ncclEpUpdateHandle", rc, self.comm)
    }

    /// Forward dispatch of our `x`, `w` into its receive buffers.
    pub fn dispatch(&mut self) -> R<()> {
        let inputs = ffi::Inputs {
            size: std::mem::size_of::<ffi::Inputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.x.ptr(),
            topk_weights: self.w.ptr(),
            scales: std::ptr::null_mut(),
        };
        let outputs = ffi::DispatchOutputs {
            size: std::mem::size_of::<ffi::DispatchOutputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.recv_x.ptr(),
            topk_weights: self.recv_w.ptr(),
            scales: std::ptr::null_mut(),
            topk_idx: self
                .recv_idx
                .as_mut()
                .map_or(std::ptr::null_mut(), |d| d.ptr()),
        };
        self.run_dispatch("ncclEpDispatch", &inputs, &outputs, ffi::FWD_PASS)
    }

    /// Forward dispatch of our fp8 rows (`QUANT_FWD`: codes and scales
    /// forwarded as their bytes) and weights into its fp8 receive buffers,
    /// its weights and ids; [`FP8_WHY`] where it has none.
    pub fn dispatch_fp8(&mut self) -> R<()> {
        let Some(f) = self.fp8.as_mut() else {
            return Err(FP8_WHY.into());
        };
        let inputs = ffi::Inputs {
            size: std::mem::size_of::<ffi::Inputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: f.codes.ptr(),
            topk_weights: self.w.ptr(),
            scales: f.scales.ptr(),
        };
        let outputs = ffi::DispatchOutputs {
            size: std::mem::size_of::<ffi::DispatchOutputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: f.recv_codes.ptr(),
            topk_weights: self.recv_w.ptr(),
            scales: f.recv_scales.ptr(),
            topk_idx: self
                .recv_idx
                .as_mut()
                .map_or(std::ptr::null_mut(), |d| d.ptr()),
        };
        let cfg = dispatch_config(ffi::FWD_PASS, ffi::DISP_QUANT_FWD);
        // SAFETY: live handle; the descriptors name live buffers of their sizes.
        let rc = unsafe {
            (self.lib.dispatch)(
                self.handle,
                &inputs,
                &outputs,
                std::ptr::null(),
                &cfg,
                self.stream_ptr(),
            )
        };
        self.lib
            .check("ncclEpDispatch (QUANT_FWD fp8)", rc, self.comm)
    }

    /// Backward dispatch (our combine-bwd): `out` (gradients of the combined
    /// tokens) to the receive buffer, no weights.
    pub fn combine_bwd(&mut self) -> R<()> {
        let inputs = ffi::Inputs {
            size: std::mem::size_of::<ffi::Inputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.out.ptr(),
            topk_weights: std::ptr::null_mut(),
            scales: std::ptr::null_mut(),
        };
        let outputs = ffi::DispatchOutputs {
            size: std::mem::size_of::<ffi::DispatchOutputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.recv_x.ptr(),
            topk_weights: std::ptr::null_mut(),
            scales: std::ptr::null_mut(),
            topk_idx: std::ptr::null_mut(),
        };
        self.run_dispatch(
            "ncclEpDispatch (backward)",
            &inputs,
            &outputs,
            ffi::BWD_PASS,
        )
    }

    fn run_dispatch(
        &mut self,
        what: &str,
        inputs: &ffi::Inputs,
        outputs: &ffi::DispatchOutputs,
        pass: c_int,
    ) -> R<()> {
        let cfg = dispatch_config(pass, 0);
        // SAFETY: live handle; the descriptors name live buffers of their sizes.
        let rc = unsafe {
            (self.lib.dispatch)(
                self.handle,
                inputs,
                outputs,
                std::ptr::null(),
                &cfg,
                self.stream_ptr(),
            )
        };
        self.lib.check(what, rc, self.comm)
    }

    /// Forward combine of its receive buffer (identity experts) into `out`.
    pub fn combine(&mut self) -> R<()> {
        let inputs = ffi::Inputs {
            size: std::mem::size_of::<ffi::Inputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.recv_x.ptr(),
            topk_weights: std::ptr::null_mut(),
            scales: std::ptr::null_mut(),
        };
        let outputs = ffi::CombineOutputs {
            size: std::mem::size_of::<ffi::CombineOutputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.out.ptr(),
            topk_weights: std::ptr::null_mut(),
        };
        self.run_combine("ncclEpCombine", &inputs, &outputs, ffi::FWD_PASS)
    }

    /// Backward combine (our dispatch-bwd): the receive buffer and its
    /// weights (as gradients) home into `out` and the weight gradients.
    pub fn dispatch_bwd(&mut self) -> R<()> {
        let inputs = ffi::Inputs {
            size: std::mem::size_of::<ffi::Inputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.recv_x.ptr(),
            topk_weights: self.recv_w.ptr(),
            scales: std::ptr::null_mut(),
        };
        let outputs = ffi::CombineOutputs {
            size: std::mem::size_of::<ffi::CombineOutputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.out.ptr(),
            topk_weights: self.out_w.ptr(),
        };
        self.run_combine("ncclEpCombine (backward)", &inputs, &outputs, ffi::BWD_PASS)
    }

    fn run_combine(
        &mut self,
        what: &str,
        inputs: &ffi::Inputs,
        outputs: &ffi::CombineOutputs,
        pass: c_int,
    ) -> R<()> {
        let cfg = ffi::CombineConfig {
            size: std::mem::size_of::<ffi::CombineConfig>() as c_uint,
            magic: ffi::MAGIC,
            send_only: 0,
            pass_direction: pass,
            quant_recipe: 0,
        };
        // SAFETY: as run_dispatch.
        let rc =
            unsafe { (self.lib.combine)(self.handle, inputs, outputs, &cfg, self.stream_ptr()) };
        self.lib.check(what, rc, self.comm)
    }

    /// Its receive count after [`Runner::layout`] (the pre-drop total),
    /// refused when above the buffers. Synchronises the stream.
    pub fn recv_total(&self) -> R<usize> {
        let v = self.stream.clone_dtoh(&self.total_buf).map_err(s)?;
        self.stream.synchronize().map_err(s)?;
        let total = v.first().copied().unwrap_or(-1);
        let total = usize::try_from(total).map_err(|_| format!("NCCL EP counted {total} rows"))?;
        if total > self.slots {
            return Err(format!(
                "NCCL EP receives {total} rows, more than its {} slots (rows were dropped)",
                self.slots
            ));
        }
        Ok(total)
    }

    /// What the last dispatch received, on the host. Synchronises the stream.
    pub fn received(&self) -> R<Received> {
        let h = self.spec.hidden;
        self.received_with(|total| {
            let mut rows = vec![bf16::ZERO; total * h];
            if total > 0 {
                (self.stream)
                    .memcpy_dtoh(&self.recv_x_buf.slice(0..total * h), &mut rows)
                    .map_err(s)?;
            }
            Ok(rows)
        })
    }

    /// What the last fp8 dispatch received, on the host, each row of
    /// codes and its scale bytes packed as one row of
    /// [`crate::fp8::packed_width`] bf16 words ([`crate::fp8::packed`]).
    /// Synchronises the stream.
    pub fn received_fp8(&self) -> R<Received> {
        let f = self.fp8.as_ref().ok_or(FP8_WHY)?;
        let h = self.spec.hidden;
        self.received_with(|total| {
            let mut codes = vec![0u8; total * h];
            let mut scales = vec![0u8; total * h / 32];
            if total > 0 {
                let st = &self.stream;
                st.memcpy_dtoh(&f.recv_codes_buf.slice(0..total * h), &mut codes)
                    .map_err(s)?;
                st.memcpy_dtoh(&f.recv_scales_buf.slice(0..total * h / 32), &mut scales)
                    .map_err(s)?;
                st.synchronize().map_err(s)?;
            }
            Ok(crate::fp8::packed(&codes, &scales, total, h))
        })
    }

    /// What the last dispatch received: its rows as `rows(total)` reads
    /// them, its weights, ids and counters.
    fn received_with(&self, rows: impl FnOnce(usize) -> R<Vec<bf16>>) -> R<Received> {
        let total = self.recv_total()?;
        let k = self.spec.topk;
        let em = self.spec.pairing.expert_major();
        let st = &self.stream;
        let rows = rows(total)?;
        let nw = if em { total } else { total * k };
        let mut weights = vec![0f32; nw];
        if nw > 0 {
            st.memcpy_dtoh(&self.recv_w_buf.slice(0..nw), &mut weights)
                .map_err(s)?;
        }
        let idx = match (&self.recv_idx_buf, &self.recv_idx) {
            (Some(b), Some(d)) if total > 0 => {
                let mut v = vec![0i64; total * k];
                st.memcpy_dtoh(&b.slice(0..total * k), &mut v).map_err(s)?;
                Some(decode(&v, total * k, d.t.datatype))
            }
            (Some(_), _) => Some(Vec::new()),
            _ => None,
        };
        let raw = st.clone_dtoh(&self.counts_buf).map_err(s)?;
        let offsets = match (&self.offsets_buf, &self.offsets) {
            (Some(b), Some(d)) => {
                let v = st.clone_dtoh(b).map_err(s)?;
                Some(decode(&v, v.len(), d.t.datatype))
            }
            _ => None,
        };
        st.synchronize().map_err(s)?;
        let counts = decode(&raw, raw.len(), self.counts.t.datatype);
        Ok(Received {
            total,
            rows,
            weights,
            idx,
            counts,
            offsets,
        })
    }

    /// The last combine's output `[T * H]`, on the host. Synchronises the stream.
    pub fn combined(&self) -> R<Vec<bf16>> {
        let v = self.stream.clone_dtoh(&self.out_buf).map_err(s)?;
        self.stream.synchronize().map_err(s)?;
        Ok(v)
    }
}

/// Its dispatch config for `pass` with recipe `quant` (0: none).
fn dispatch_config(pass: c_int, quant: c_int) -> ffi::DispatchConfig {
    ffi::DispatchConfig {
        size: std::mem::size_of::<ffi::DispatchConfig>() as c_uint,
        magic: ffi::MAGIC,
        send_only: 0,
        round_scales: 0,
        pass_direction: pass,
        quant_recipe: quant,
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // SAFETY: its handle and group, created by this runner, go once.
        unsafe {
            destroy(
                self.lib,
                self.comm,
                &self.stream,
                self.handle,
                self.group,
                "",
            )
        };
    }
}

/// The end of a runner (high throughput or low latency): its stream's work
/// done before its buffers go (NCCL EP's are freed by destroy), then its
/// handle, then its group; failures are printed (`what` tags the calls).
///
/// # Safety
/// `handle` and `group` are null or live objects of `lib` on `comm`, each
/// destroyed here once, the handle belonging to the group.
pub(crate) unsafe fn destroy(
    lib: &Lib,
    comm: ffi::ncclComm_t,
    stream: &CudaStream,
    handle: ffi::ncclEpHandle_t,
    group: ffi::ncclEpGroup_t,
    what: &str,
) {
    let _ = stream.synchronize();
    if !handle.is_null() {
        // SAFETY: created by ncclEpInitHandle, destroyed once (caller).
        let rc = unsafe { (lib.handle_destroy)(handle) };
        if let Err(e) = lib.check(&format!("ncclEpHandleDestroy{what}"), rc, comm) {
            eprintln!("ep-bench: {e}");
        }
    }
    if !group.is_null() {
        // SAFETY: created by ncclEpCreateGroup, destroyed once, after its handle.
        let rc = unsafe { (lib.group_destroy)(group) };
        if let Err(e) = lib.check(&format!("ncclEpGroupDestroy{what}"), rc, comm) {
            eprintln!("ep-bench: {e}");
        }
    }
}

// ---------------------------------------------------------------------------
// The cross-check: pure host code.
// ---------------------------------------------------------------------------

/// How NCCL EP's rows sat against the reference's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Row for row, slot for slot, in moe-ep's order.
    Same,
    /// The same rows in the same places, some rows' top-k slots in another order.
    SlotsReordered,
    /// The same rows in another order.
    RowsReordered,
}

impl Order {
    /// Words for the report line.
    pub fn words(self) -> &'static str {
        match self {
            Order::Same => "in moe-ep's order",
            Order::SlotsReordered => "in moe-ep's row order, top-k slots reordered",
            Order::RowsReordered => "in another row order (matched by source rank and token)",
        }
    }
}

/// The bits of a row.
fn bits(row: &[bf16]) -> impl Iterator<Item = u16> + '_ {
    row.iter().map(|v| v.to_bits())
}

fn same_bits(a: &[bf16], b: &[bf16]) -> bool {
    a.len() == b.len() && bits(a).eq(bits(b))
}

fn row_hash(row: &[bf16]) -> u64 {
    let mut hs = std::collections::hash_map::DefaultHasher::new();
    for b in bits(row) {
        b.hash(&mut hs);
    }
    hs.finish()
}

/// `(source rank, token)` of reference row `j`.
fn who(want: &DispatchOutput, j: usize) -> String {
    let (r, t) = want.src[j];
    format!("source rank {r}, token {t}")
}

/// A few values of a row, for messages.
fn head(row: &[bf16]) -> String {
    let v: Vec<String> = row.iter().take(4).map(|x| format!("{x}")).collect();
    format!("[{}, ...]", v.join(", "))
}

/// Flat slots of NCCL EP row `i` against reference row `j`: `Ok(true)`
/// position by position, `Ok(false)` as a set, `Err` the first difference.
fn flat_slots(
    want: &DispatchOutput,
    j: usize,
    got: &Received,
    i: usize,
    k: usize,
) -> Result<bool, String> {
    let idx = got.idx.as_deref().unwrap_or(&[]);
    let (gi, gw) = (&idx[i * k..(i + 1) * k], &got.weights[i * k..(i + 1) * k]);
    let (wi, ww) = (
        &want.topk_local_idx[j * k..(j + 1) * k],
        &want.topk_weights[j * k..(j + 1) * k],
    );
    // Only the slots on this rank carry a weight; the others say -1.
    let pos = (0..k)
        .all(|s| gi[s] == i64::from(wi[s]) && (wi[s] < 0 || gw[s].to_bits() == ww[s].to_bits()));
    if pos {
        return Ok(true);
    }
    let set = |idx: &mut dyn Iterator<Item = (i64, f32)>| {
        let mut v: Vec<(i64, u32)> = idx
            .filter(|p| p.0 >= 0)
            .map(|(e, w)| (e, w.to_bits()))
            .collect();
        v.sort_unstable();
        v
    };
    let g = set(&mut gi.iter().copied().zip(gw.iter().copied()));
    let w = set(&mut wi.iter().map(|&e| i64::from(e)).zip(ww.iter().copied()));
    if g == w {
        return Ok(false);
    }
    let pairs = |v: &[(i64, u32)]| {
        let p: Vec<String> = v
            .iter()
            .map(|&(e, b)| format!("{e}:{}", f32::from_bits(b)))
            .collect();
        format!("[{}]", p.join(" "))
    };
    Err(format!(
        "{}: (local expert:weight) NCCL EP {}, reference {}",
        who(want, j),
        pairs(&g),
        pairs(&w)
    ))
}

/// NCCL EP's dispatch output against the reference's in `layout` (see the
/// module docs): how the rows were ordered, or the first difference.
pub fn compare_dispatch(
    want: &DispatchOutput,
    got: &Received,
    layout: RecvLayout,
    hidden: usize,
    topk: usize,
) -> Result<Order, String> {
    let (h, k) = (hidden, topk);
    if got.total != want.num_rows {
        return Err(format!(
            "NCCL EP received {} rows, the reference {}",
            got.total, want.num_rows
        ));
    }
    let em = match layout {
        RecvLayout::RankMajor => None,
        RecvLayout::ExpertMajor { alignment } => Some(alignment),
    };
    let tpl = &want.tokens_per_local_expert;
    for (e, &n) in tpl.iter().enumerate() {
        let want_n = match em {
            Some(a) => (n as usize).div_ceil(a) * a,
            None => n as usize,
        } as i64;
        let got_n = got.counts.get(e).copied().unwrap_or(-1);
        if got_n != want_n {
            return Err(format!(
                "local expert {e}: NCCL EP counts {got_n} rows, the reference {want_n}"
            ));
        }
    }
    if let (Some(_), Some(off)) = (em, &got.offsets) {
        let e_local = tpl.len();
        let starts: Vec<i64> = want.offsets.iter().map(|&o| o as i64).collect();
        // Zone starts; a prefix sum written inclusively is accepted too.
        let ok = off[..] == starts[..e_local] || off[..] == starts[1..=e_local];
        if !ok {
            let e = (0..e_local).find(|&e| off[e] != starts[e]).unwrap_or(0);
            return Err(format!(
                "local expert {e}: NCCL EP's zone offset {}, the reference {}",
                off[e], starts[e]
            ));
        }
    }
    fn row(v: &[bf16], h: usize, i: usize) -> &[bf16] {
        &v[i * h..(i + 1) * h]
    }
    let row = |v, i| row(v, h, i);
    let padding = |j: usize| want.src[j].0 < 0;

    // 1. Position by position.
    let mut order = Order::Same;
    let mut positional = true;
    for i in 0..got.total {
        if !same_bits(row(&got.rows, i), row(&want.tokens, i)) {
            positional = false;
            break;
        }
        if padding(i) {
            continue;
        }
        match em {
            Some(_) => {
                if got.weights[i].to_bits() != want.topk_weights[i].to_bits() {
                    return Err(format!(
                        "row {i} ({}, local expert {}): NCCL EP weight {}, the reference {}",
                        who(want, i),
                        want.topk_local_idx[i],
                        got.weights[i],
                        want.topk_weights[i]
                    ));
                }
            }
            None => match flat_slots(want, i, got, i, k) {
                Ok(true) => {}
                Ok(false) => order = Order::SlotsReordered,
                Err(_) => {
                    positional = false;
                    break;
                }
            },
        }
    }
    if positional {
        return Ok(order);
    }

    // 2. Order-independently: each row matched by its bits to an unmatched
    //    reference row of the same zone (flat: one zone of every row).
    let zones: Vec<(usize, usize, usize)> = match em {
        None => vec![(0, want.num_rows, want.num_rows)],
        Some(_) => (0..tpl.len())
            .map(|e| {
                (
                    want.offsets[e],
                    tpl[e] as usize,
                    want.offsets[e + 1] - want.offsets[e],
                )
            })
            .collect(),
    };
    for (z, &(start, real, padded)) in zones.iter().enumerate() {
        let zone = |i: usize| match em {
            Some(_) => format!("local expert {z}, slot {}", i - start),
            None => format!("row {i}"),
        };
        let mut by_hash: HashMap<u64, Vec<usize>> = HashMap::new();
        for j in start..start + real {
            by_hash
                .entry(row_hash(row(&want.tokens, j)))
                .or_default()
                .push(j);
        }
        let mut taken = vec![false; want.num_rows];
        for i in start..start + real {
            let g = row(&got.rows, i);
            let cands: Vec<usize> = by_hash
                .get(&row_hash(g))
                .map(|v| {
                    v.iter()
                        .copied()
                        .filter(|&j| !taken[j] && same_bits(g, row(&want.tokens, j)))
                        .collect()
                })
                .unwrap_or_default();
            let Some(&first) = cands.first() else {
                return Err(format!(
                    "{}: NCCL EP's row {} is none of the rows the reference {}",
                    zone(i),
                    head(g),
                    if em.is_some() {
                        "sends to this expert"
                    } else {
                        "receives"
                    }
                ));
            };
            // Rows equal in bits (the same token twice) pair by their weights.
            let fits = |j: usize| match em {
                Some(_) => got.weights[i].to_bits() == want.topk_weights[j].to_bits(),
                None => flat_slots(want, j, got, i, k).is_ok(),
            };
            let Some(j) = cands.iter().copied().find(|&j| fits(j)) else {
                return Err(match em {
                    Some(_) => format!(
                        "{} ({}): NCCL EP weight {}, the reference {}",
                        zone(i),
                        who(want, first),
                        got.weights[i],
                        want.topk_weights[first]
                    ),
                    None => format!(
                        "{}: {}",
                        zone(i),
                        flat_slots(want, first, got, i, k).unwrap_err()
                    ),
                });
            };
            taken[j] = true;
        }
        for i in start + real..start + padded {
            if row(&got.rows, i).iter().any(|v| v.to_bits() != 0) {
                return Err(format!(
                    "{}: a padding row that is not +0.0: {}",
                    zone(i),
                    head(row(&got.rows, i))
                ));
            }
        }
    }
    Ok(Order::RowsReordered)
}

/// NCCL EP's combine output (`[T * H]`) against ours, the reference's
/// emulation of our arithmetic, and (computed only when needed) the exact
/// sum `exact()` correctly rounded: every element must equal one of them.
/// `Ok(true)` when every element equals ours bit for bit.
pub fn compare_combine(
    got: &[bf16],
    ours: &[bf16],
    emu: &[bf16],
    exact: &dyn Fn() -> Result<Vec<f64>, String>,
    hidden: usize,
) -> Result<bool, String> {
    if got.len() != emu.len() {
        return Err(format!(
            "NCCL EP combined {} values, the reference {}",
            got.len(),
            emu.len()
        ));
    }
    let mut ex: Option<Vec<f64>> = None;
    let mut all_ours = got.len() == ours.len();
    for (i, g) in got.iter().enumerate() {
        let b = g.to_bits();
        if ours.get(i).is_some_and(|o| o.to_bits() == b) {
            continue;
        }
        all_ours = false;
        if emu[i].to_bits() == b {
            continue;
        }
        if ex.is_none() {
            ex = Some(exact()?);
        }
        let x = ex
            .as_ref()
            .and_then(|v| v.get(i).copied())
            .unwrap_or(f64::NAN);
        let rounded = bf16::from_f64(x);
        if rounded.to_bits() == b {
            continue;
        }
        let ours = ours
            .get(i)
            .map_or("-".to_string(), |o| format!("{o} ({:#06x})", o.to_bits()));
        return Err(format!(
            "combine output, token {}, element {}: NCCL EP {g} ({b:#06x}), moe-ep {ours}, \
             reference {} ({:#06x}), exact {x}",
            i / hidden.max(1),
            i % hidden.max(1),
            emu[i],
            emu[i].to_bits()
        ));
    }
    Ok(all_ours)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Dtype, Op, Routing, ScaleKind};
    use crate::report;
    use moe_ep::reference::{self as refr, RankInput, Shape};
    use moe_ep::testkit::workload;
    use std::mem::offset_of;

    #[test]
    fn struct_layouts_match_the_header() {
        // The offsets the header's V1/V2 boundaries imply.
        assert_eq!(offset_of!(ffi::Tensor, data), 16);
        assert_eq!(offset_of!(ffi::Tensor, sizes), 40);
        assert_eq!(offset_of!(ffi::GroupConfig, rdma_buffer_size), 32);
        assert_eq!(offset_of!(ffi::GroupConfig, max_num_sms), 48);
        assert_eq!(offset_of!(ffi::GroupConfig, alloc), 56);
        assert_eq!(offset_of!(ffi::GroupConfig, enable_mask), 80);
        assert_eq!(offset_of!(ffi::GroupConfig, timeout_ns), 88);
        assert_eq!(offset_of!(ffi::GroupConfig, overflow_policy), 100);
        assert_eq!(offset_of!(ffi::LayoutInfo, recv_total_counter), 32);
        assert_eq!(offset_of!(ffi::LayoutInfo, recv_topk_idx_kind), 40);
        assert_eq!(offset_of!(ffi::DispatchOutputs, topk_idx), 32);
        assert_eq!(offset_of!(ffi::DispatchConfig, quant_recipe), 20);
        assert_eq!(offset_of!(ffi::CombineConfig, quant_recipe), 16);
        let d = Desc::new(ffi::NCCL_BFLOAT16, 0x1000, &[3, 5]);
        // SAFETY: sizes points into d.
        assert_eq!(unsafe { *d.t.sizes.add(1) }, 5);
        assert_eq!((d.t.ndim, d.t.size), (2, 48));
    }

    #[test]
    fn counters_of_either_width() {
        let w = i64::from_ne_bytes([3, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(decode(&[w, 9], 3, ffi::NCCL_INT32), vec![3, -1, 9]);
        assert_eq!(decode(&[w, 9], 2, ffi::NCCL_INT64), vec![w, 9]);
    }

    #[test]
    fn absent_library_is_one_line() {
        let e = match Lib::load(&OsString::from("/nonexistent/libnccl_ep.so.0")) {
            Err(e) => e,
            Ok(_) => panic!("loaded a library that does not exist"),
        };
        assert!(!e.contains('\n') && e.contains(LIBRARY_ENV), "{e}");
    }

    fn case(layout: RecvLayout, tokens: usize) -> Case {
        Case {
            tokens,
            hidden: 64,
            topk: 4,
            experts: 16,
            layout,
            num_sms: 24,
            mode: Mode::HighThroughput,
            dtype: Dtype::Bf16,
            fp8_scales: ScaleKind::F32,
            routing: Routing::Generated(workload::Routing::Uniform),
        }
    }

    #[test]
    fn pairings() {
        let rank = pairing(&case(RecvLayout::RankMajor, 8), 1).unwrap();
        assert_eq!(rank.name(), "HT flat");
        let em = pairing(&case(RecvLayout::ExpertMajor { alignment: 128 }, 8), 1).unwrap();
        assert_eq!(em.name(), "HT expert-major:128");
        for (c, why) in [
            (
                case(RecvLayout::ExpertMajor { alignment: 48 }, 8),
                "power of two",
            ),
            (case(RecvLayout::RankMajor, 0), "at least one token"),
            (case(RecvLayout::RankMajor, 8193), "8192"),
        ] {
            assert!(pairing(&c, 1).unwrap_err().contains(why));
        }
        let mut ll = case(RecvLayout::RankMajor, 8);
        ll.mode = Mode::LowLatency;
        assert!(pairing(&ll, 1).unwrap_err().contains("LL mode"));
        assert_eq!(
            report::nccl_ep_row(Op::CombinePush),
            report::NCCL_EP_COMBINE
        );
        assert_eq!(
            report::nccl_ep_row(Op::DispatchBwd),
            report::NCCL_EP_DISPATCH_BWD
        );
    }

    /// Two ranks' inputs and rank `dst`'s reference output.
    fn world(layout: RecvLayout, dst: usize) -> (Shape, Vec<RankInput>, DispatchOutput) {
        let shape = Shape {
            num_ranks: 2,
            num_experts: 16,
            hidden: 64,
            topk: 4,
        };
        let inputs = workload::rank_inputs(7, &shape, &[24, 24], workload::Routing::Uniform);
        let want = refr::dispatch(&shape, &inputs, dst, layout).unwrap();
        (shape, inputs, want)
    }

    /// What NCCL EP would report if it wrote exactly the reference's output.
    fn as_received(want: &DispatchOutput, layout: RecvLayout) -> Received {
        let em = matches!(layout, RecvLayout::ExpertMajor { .. });
        let counts = match layout {
            RecvLayout::RankMajor => want
                .tokens_per_local_expert
                .iter()
                .map(|&n| n as i64)
                .collect(),
            RecvLayout::ExpertMajor { .. } => want
                .offsets
                .windows(2)
                .map(|w| (w[1] - w[0]) as i64)
                .collect(),
        };
        Received {
            total: want.num_rows,
            rows: want.tokens.clone(),
            weights: want.topk_weights.clone(),
            idx: (!em).then(|| want.topk_local_idx.iter().map(|&v| v as i64).collect()),
            counts,
            offsets: em.then(|| {
                want.offsets[..want.offsets.len() - 1]
                    .iter()
                    .map(|&o| o as i64)
                    .collect()
            }),
        }
    }

    fn swap_rows(v: &mut [bf16], h: usize, a: usize, b: usize) {
        for c in 0..h {
            v.swap(a * h + c, b * h + c);
        }
    }

    #[test]
    fn flat_rows_in_any_order() {
        let layout = RecvLayout::RankMajor;
        let (_, _, want) = world(layout, 1);
        let (h, k) = (64, 4);
        let mut got = as_received(&want, layout);
        assert_eq!(compare_dispatch(&want, &got, layout, h, k), Ok(Order::Same));
        // Slots of row 0 in another order.
        let (a, b) = (0, k - 1);
        got.weights.swap(a, b);
        got.idx.as_mut().unwrap().swap(a, b);
        let o = compare_dispatch(&want, &got, layout, h, k);
        let differs = want.topk_local_idx[a] != want.topk_local_idx[b];
        assert_eq!(
            o,
            Ok(if differs {
                Order::SlotsReordered
            } else {
                Order::Same
            })
        );
        // Rows 1 and 3 swapped, with their slots.
        let mut got = as_received(&want, layout);
        swap_rows(&mut got.rows, h, 1, 3);
        swap_rows_k(&mut got.weights, k, 1, 3);
        swap_rows_k(got.idx.as_mut().unwrap(), k, 1, 3);
        assert_eq!(
            compare_dispatch(&want, &got, layout, h, k),
            Ok(Order::RowsReordered)
        );
        // A weight off by one bit: named.
        let mut bad = got.clone();
        let slot = (0..k)
            .find(|&s| bad.idx.as_ref().unwrap()[2 * k + s] >= 0)
            .unwrap();
        bad.weights[2 * k + slot] = f32::from_bits(bad.weights[2 * k + slot].to_bits() ^ 1);
        let e = compare_dispatch(&want, &bad, layout, h, k).unwrap_err();
        assert!(e.contains("row 2") && e.contains("source rank"), "{e}");
        // A token value off: no reference row has it.
        let mut bad = got.clone();
        bad.rows[5 * h] = bf16::from_f32(1234.0);
        let e = compare_dispatch(&want, &bad, layout, h, k).unwrap_err();
        assert!(e.contains("row 5") && e.contains("none of the rows"), "{e}");
        // A missing row.
        let mut bad = got;
        bad.total -= 1;
        assert!(compare_dispatch(&want, &bad, layout, h, k)
            .unwrap_err()
            .contains("rows"));
    }

    fn swap_rows_k<T>(v: &mut [T], k: usize, a: usize, b: usize) {
        for c in 0..k {
            v.swap(a * k + c, b * k + c);
        }
    }

    #[test]
    fn expert_major_zones() {
        let layout = RecvLayout::ExpertMajor { alignment: 4 };
        let (_, _, want) = world(layout, 0);
        let h = 64;
        let mut got = as_received(&want, layout);
        assert_eq!(compare_dispatch(&want, &got, layout, h, 4), Ok(Order::Same));
        // Inclusive offsets are accepted too.
        let mut incl = got.clone();
        incl.offsets = Some(want.offsets[1..].iter().map(|&o| o as i64).collect());
        assert_eq!(
            compare_dispatch(&want, &incl, layout, h, 4),
            Ok(Order::Same)
        );
        // Two real rows of one zone swapped: found by matching.
        let e = (0..want.tokens_per_local_expert.len())
            .find(|&e| want.tokens_per_local_expert[e] >= 2)
            .unwrap();
        let s = want.offsets[e];
        swap_rows(&mut got.rows, h, s, s + 1);
        got.weights.swap(s, s + 1);
        assert_eq!(
            compare_dispatch(&want, &got, layout, h, 4),
            Ok(Order::RowsReordered)
        );
        // A row moved to another expert's zone is not accepted.
        let f = (0..want.tokens_per_local_expert.len())
            .find(|&f| f != e && want.tokens_per_local_expert[f] >= 1)
            .unwrap();
        let mut bad = as_received(&want, layout);
        swap_rows(&mut bad.rows, h, s, want.offsets[f]);
        assert!(compare_dispatch(&want, &bad, layout, h, 4).is_err());
        // Non-zero padding is named.
        let pad = (0..want.num_rows).find(|&j| want.src[j].0 < 0).unwrap();
        let mut bad = got.clone();
        bad.rows[pad * h] = bf16::from_f32(1.0);
        let e = compare_dispatch(&want, &bad, layout, h, 4).unwrap_err();
        assert!(e.contains("padding"), "{e}");
        // Counts are compared first.
        let mut bad = got;
        bad.counts[0] += 4;
        assert!(compare_dispatch(&want, &bad, layout, h, 4)
            .unwrap_err()
            .contains("local expert 0"));
    }

    #[test]
    fn combine_accepts_ours_the_emulation_or_the_rounded_sum() {
        let v = |x: &[f32]| x.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
        let ours = v(&[1.0, 2.0, 3.0, 4.0]);
        let emu = v(&[1.0, 2.0, 3.0, 4.5]);
        let exact = || Ok(vec![1.0, 2.0, 3.25, 4.0]);
        assert_eq!(compare_combine(&ours, &ours, &emu, &exact, 2), Ok(true));
        assert_eq!(
            compare_combine(&v(&[1.0, 2.0, 3.0, 4.5]), &ours, &emu, &exact, 2),
            Ok(false)
        );
        assert_eq!(
            compare_combine(&v(&[1.0, 2.0, 3.25, 4.0]), &ours, &emu, &exact, 2),
            Ok(false)
        );
        let e = compare_combine(&v(&[1.0, 2.5, 3.0, 4.0]), &ours, &emu, &exact, 2).unwrap_err();
        assert!(e.contains("token 0, element 1"), "{e}");
    }
}
