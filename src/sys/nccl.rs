//! NCCL, declared by hand from `nccl.h` 2.28.9 and loaded with `libloading`.
//!
//! Names of C types and constants are kept as in `nccl.h` so they can be
//! grepped against the header. [`nccl()`] loads the library once per process
//! (path: `$MOE_EP_NCCL_LIBRARY`, else `libnccl.so.2` through the dynamic
//! loader's search path) and refuses one older than the headers the kernels
//! were built with.

#![allow(non_camel_case_types, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_uint, c_void, OsString};
use std::path::Path;
use std::sync::OnceLock;

use libloading::Library;

use crate::error::{Error, NcclVersion, Result};

/// Opaque communicator handle (`struct ncclComm*`).
pub type ncclComm_t = *mut c_void;
/// Opaque registered-window handle (`struct ncclWindow_vidmem*`).
pub type ncclWindow_t = *mut c_void;
/// Return code of every NCCL call (a C enum, `int`-sized).
pub type ncclResult_t = c_int;
/// Element type selector (a C enum, `int`-sized).
pub type ncclDataType_t = c_int;
/// Reduction operator selector (a C enum, `int`-sized).
pub type ncclRedOp_t = c_int;
/// CUDA stream (`cudaStream_t`, the same object as the driver's `CUstream`).
pub type cudaStream_t = *mut c_void;

// ncclResult_t values.
pub const ncclSuccess: ncclResult_t = 0;
pub const ncclUnhandledCudaError: ncclResult_t = 1;
pub const ncclSystemError: ncclResult_t = 2;
pub const ncclInternalError: ncclResult_t = 3;
pub const ncclInvalidArgument: ncclResult_t = 4;
pub const ncclInvalidUsage: ncclResult_t = 5;
pub const ncclRemoteError: ncclResult_t = 6;
pub const ncclInProgress: ncclResult_t = 7;

// ncclDataType_t values.
pub const ncclInt8: ncclDataType_t = 0;
pub const ncclUint8: ncclDataType_t = 1;
pub const ncclInt32: ncclDataType_t = 2;
pub const ncclUint32: ncclDataType_t = 3;
pub const ncclInt64: ncclDataType_t = 4;
pub const ncclUint64: ncclDataType_t = 5;
pub const ncclFloat16: ncclDataType_t = 6;
pub const ncclFloat32: ncclDataType_t = 7;
pub const ncclFloat64: ncclDataType_t = 8;
pub const ncclBfloat16: ncclDataType_t = 9;
pub const ncclFloat8e4m3: ncclDataType_t = 10;
pub const ncclFloat8e5m2: ncclDataType_t = 11;

// ncclRedOp_t values.
pub const ncclSum: ncclRedOp_t = 0;
pub const ncclProd: ncclRedOp_t = 1;
pub const ncclMax: ncclRedOp_t = 2;
pub const ncclMin: ncclRedOp_t = 3;
pub const ncclAvg: ncclRedOp_t = 4;

/// Size of [`ncclUniqueId`] in bytes.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;
/// Window flag: plain registration.
pub const NCCL_WIN_DEFAULT: c_int = 0x00;
/// Window flag: symmetric registration (same size and offset on every rank).
pub const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;
/// Required alignment of a window's base address and size, in bytes.
pub const NCCL_WIN_REQUIRED_ALIGNMENT: usize = 4096;

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): "let NCCL choose".
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `ncclConfig_t::magic` as set by `NCCL_CONFIG_INITIALIZER`.
pub const NCCL_CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// Version code of the headers whose `ncclConfig_t` layout [`NcclConfig`]
/// mirrors (2.28.9), stored in its `version` field.
pub const NCCL_CONFIG_VERSION: c_uint = 22809;
/// First NCCL release exporting `ncclGetPeerDevicePointer` (2.29.2).
pub const NCCL_PEER_POINTER_VERSION_CODE: c_int = 22902;

/// Opaque id that every rank of a new communicator must receive from rank 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclUniqueId {
    pub internal: [u8; NCCL_UNIQUE_ID_BYTES],
}

impl ncclUniqueId {
    /// An all-zero id (only useful as an out-parameter).
    pub const fn zeroed() -> Self {
        ncclUniqueId {
            internal: [0; NCCL_UNIQUE_ID_BYTES],
        }
    }
}

/// `ncclConfig_t`, layout `ncclConfig_v22800` (unchanged through 2.28.9).
///
/// Build it with [`NcclConfig::initializer`] (= `NCCL_CONFIG_INITIALIZER`) and
/// then set only the fields that matter; NCCL rejects an uninitialized config.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclConfig {
    /// `sizeof(ncclConfig_t)` in bytes; do not touch.
    pub size: usize,
    /// [`NCCL_CONFIG_MAGIC`]; do not touch.
    pub magic: c_uint,
    /// Header version code the layout comes from; do not touch.
    pub version: c_uint,
    /// 1: calls block until done; 0: non-blocking (calls may return `ncclInProgress`).
    pub blocking: c_int,
    /// Cooperative group array cluster size (CTAs per cluster).
    pub cga_cluster_size: c_int,
    /// Minimum number of CTAs (channels) per collective.
    pub min_ctas: c_int,
    /// Maximum number of CTAs (channels) per collective.
    pub max_ctas: c_int,
    /// Network module to use (NUL-terminated), or null.
    pub net_name: *const c_char,
    /// Share resources with the parent on `ncclCommSplit` (0/1).
    pub split_share: c_int,
    /// Traffic class for network traffic.
    pub traffic_class: c_int,
    /// Communicator name for logging (NUL-terminated), or null.
    pub comm_name: *const c_char,
    /// Enable CollNet (0/1).
    pub collnet_enable: c_int,
    /// `NCCL_CTA_POLICY_*` bit set.
    pub cta_policy: c_int,
    /// Share resources with the parent on `ncclCommShrink` (0/1).
    pub shrink_share: c_int,
    /// CTAs used by NVLS collectives.
    pub nvls_ctas: c_int,
    /// Channels per network peer.
    pub n_channels_per_net_peer: c_int,
    /// NVLink-centric scheduling (0/1).
    pub nvlink_centric_sched: c_int,
}

/// `ncclConfig_t` under its C name.
pub type ncclConfig_t = NcclConfig;

impl NcclConfig {
    /// `NCCL_CONFIG_INITIALIZER` of the 2.28.9 headers: size, magic, version,
    /// every `int` `INT_MIN` and every pointer null.
    pub const fn initializer() -> Self {
        const U: c_int = NCCL_CONFIG_UNDEF_INT;
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: NCCL_CONFIG_MAGIC,
            version: NCCL_CONFIG_VERSION,
            blocking: U,
            cga_cluster_size: U,
            min_ctas: U,
            max_ctas: U,
            net_name: std::ptr::null(),
            split_share: U,
            traffic_class: U,
            comm_name: std::ptr::null(),
            collnet_enable: U,
            cta_policy: U,
            shrink_share: U,
            nvls_ctas: U,
            n_channels_per_net_peer: U,
            nvlink_centric_sched: U,
        }
    }
}

impl Default for NcclConfig {
    fn default() -> Self {
        Self::initializer()
    }
}

/// The loaded library and its function table.
///
/// Every field is the C function of the same name (`get_version` is
/// `ncclGetVersion`, ...) with the signature of `nccl.h` 2.28.9. The pointers
/// stay valid as long as this value lives (it owns the library handle).
pub struct NcclLib {
    _lib: Library,
    version_code: c_int,
    pub get_version: unsafe extern "C" fn(version: *mut c_int) -> ncclResult_t,
    pub get_unique_id: unsafe extern "C" fn(unique_id: *mut ncclUniqueId) -> ncclResult_t,
    pub comm_init_rank: unsafe extern "C" fn(
        comm: *mut ncclComm_t,
        nranks: c_int,
        comm_id: ncclUniqueId,
        rank: c_int,
    ) -> ncclResult_t,
    pub comm_init_rank_config: unsafe extern "C" fn(
        comm: *mut ncclComm_t,
        nranks: c_int,
        comm_id: ncclUniqueId,
        rank: c_int,
        config: *mut NcclConfig,
    ) -> ncclResult_t,
    pub comm_split: unsafe extern "C" fn(
        comm: ncclComm_t,
        color: c_int,
        key: c_int,
        newcomm: *mut ncclComm_t,
        config: *mut NcclConfig,
    ) -> ncclResult_t,
    pub comm_finalize: unsafe extern "C" fn(comm: ncclComm_t) -> ncclResult_t,
    pub comm_destroy: unsafe extern "C" fn(comm: ncclComm_t) -> ncclResult_t,
    pub comm_abort: unsafe extern "C" fn(comm: ncclComm_t) -> ncclResult_t,
    pub comm_get_async_error:
        unsafe extern "C" fn(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t,
    pub get_error_string: unsafe extern "C" fn(result: ncclResult_t) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(comm: ncclComm_t) -> *const c_char,
    pub comm_count: unsafe extern "C" fn(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t,
    pub comm_cu_device: unsafe extern "C" fn(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t,
    pub comm_user_rank: unsafe extern "C" fn(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t,
    pub mem_alloc: unsafe extern "C" fn(ptr: *mut *mut c_void, size: usize) -> ncclResult_t,
    pub mem_free: unsafe extern "C" fn(ptr: *mut c_void) -> ncclResult_t,
    pub comm_window_register: unsafe extern "C" fn(
        comm: ncclComm_t,
        buff: *mut c_void,
        size: usize,
        win: *mut ncclWindow_t,
        win_flags: c_int,
    ) -> ncclResult_t,
    pub comm_window_deregister:
        unsafe extern "C" fn(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t,
    pub group_start: unsafe extern "C" fn() -> ncclResult_t,
    pub group_end: unsafe extern "C" fn() -> ncclResult_t,
    pub send: unsafe extern "C" fn(
        sendbuff: *const c_void,
        count: usize,
        datatype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t,
    pub recv: unsafe extern "C" fn(
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t,
    pub all_reduce: unsafe extern "C" fn(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t,
    pub all_gather: unsafe extern "C" fn(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        sendcount: usize,
        datatype: ncclDataType_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t,
    pub broadcast: unsafe extern "C" fn(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t,
    pub all_to_all: unsafe extern "C" fn(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t,
    /// `ncclGetPeerDevicePointer(window, offset, peer, outPtr)`; `None` before
    /// NCCL 2.29.2. `offset` is in bytes, `peer` a world rank.
    pub get_peer_device_pointer: Option<
        unsafe extern "C" fn(
            window: ncclWindow_t,
            offset: usize,
            peer: c_int,
            out_ptr: *mut *mut c_void,
        ) -> ncclResult_t,
    >,
}

/// Environment variable naming the NCCL library to load (full path or soname).
pub const NCCL_LIBRARY_ENV: &str = "MOE_EP_NCCL_LIBRARY";
/// Library loaded when [`NCCL_LIBRARY_ENV`] is unset or empty.
pub const NCCL_DEFAULT_LIBRARY: &str = "libnccl.so.2";

/// `e` with its source chain (libloading keeps `dlerror()`'s text in the source).
fn describe(e: &libloading::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

const HOW_TO_FIX: &str = "install NCCL >= 2.28.9 (e.g. `pip install nvidia-nccl-cu13`) and put \
its lib folder (site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH, or set MOE_EP_NCCL_LIBRARY \
to the full path of libnccl.so.2";

/// Copies symbol `name` out of `lib`.
///
/// # Safety
/// `T` must be the exact function-pointer type of the C symbol `name`.
unsafe fn symbol<T: Copy>(lib: &Library, path: &Path, name: &str) -> Result<T> {
    match lib.get::<T>(name) {
        Ok(sym) => Ok(*sym),
        Err(e) => Err(Error::NcclLibrary(format!(
            "`{}` lacks the symbol `{name}` ({}); it is not NCCL >= 2.28: {HOW_TO_FIX}",
            path.display(),
            describe(&e)
        ))),
    }
}

impl NcclLib {
    /// Loads NCCL from `path` (a file path, or a bare soname searched by the
    /// dynamic loader), resolves every symbol and checks that the library is
    /// not older than the headers (`crate::kernels::NCCL_HEADERS_VERSION_CODE`).
    ///
    /// Prefer [`nccl()`], which loads once per process. `path` must name an
    /// NCCL library: loading runs its initializers, and the symbols are called
    /// with NCCL's signatures.
    pub fn load(path: impl AsRef<Path>) -> Result<NcclLib> {
        let path = path.as_ref();
        // SAFETY: loading NCCL runs only NCCL's own initializers.
        let lib = unsafe { Library::new(path) }.map_err(|e| {
            Error::NcclLibrary(format!(
                "could not load `{}` ({}): {HOW_TO_FIX}",
                path.display(),
                describe(&e)
            ))
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the field type receiving it is the C signature in nccl.h.
                unsafe { symbol(&lib, path, $name)? }
            };
        }
        let mut table = NcclLib {
            version_code: 0,
            get_version: sym!("ncclGetVersion"),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_init_rank_config: sym!("ncclCommInitRankConfig"),
            comm_split: sym!("ncclCommSplit"),
            comm_finalize: sym!("ncclCommFinalize"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            get_error_string: sym!("ncclGetErrorString"),
            get_last_error: sym!("ncclGetLastError"),
            comm_count: sym!("ncclCommCount"),
            comm_cu_device: sym!("ncclCommCuDevice"),
            comm_user_rank: sym!("ncclCommUserRank"),
            mem_alloc: sym!("ncclMemAlloc"),
            mem_free: sym!("ncclMemFree"),
            comm_window_register: sym!("ncclCommWindowRegister"),
            comm_window_deregister: sym!("ncclCommWindowDeregister"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            broadcast: sym!("ncclBroadcast"),
            all_to_all: sym!("ncclAlltoAll"),
            // SAFETY: the signature is that of NCCL >= 2.29.2 (nccl_device/core.h).
            get_peer_device_pointer: unsafe { symbol(&lib, path, "ncclGetPeerDevicePointer").ok() },
            _lib: lib,
        };

        let mut code: c_int = 0;
        // SAFETY: `code` is a valid out-pointer; ncclGetVersion needs no state.
        let rc = unsafe { (table.get_version)(&mut code) };
        if rc != ncclSuccess {
            return Err(Error::NcclLibrary(format!(
                "ncclGetVersion in `{}` failed with code {rc}",
                path.display()
            )));
        }
        table.version_code = code;
        let library = NcclVersion::from_code(code);
        let headers = NcclVersion::from_code(crate::kernels::NCCL_HEADERS_VERSION_CODE);
        if library < headers {
            return Err(Error::NcclVersion { library, headers });
        }
        Ok(table)
    }

    /// The library's version (from `ncclGetVersion`).
    pub fn version(&self) -> NcclVersion {
        NcclVersion::from_code(self.version_code)
    }

    /// Whether the library exports `ncclGetPeerDevicePointer` (NCCL >= 2.29.2).
    pub fn has_peer_device_pointer(&self) -> bool {
        self.get_peer_device_pointer.is_some()
    }
}

/// Path [`nccl()`] loads: `$MOE_EP_NCCL_LIBRARY` if set and not empty, else
/// `libnccl.so.2`.
pub fn library_path() -> OsString {
    match std::env::var_os(NCCL_LIBRARY_ENV) {
        Some(p) if !p.is_empty() => p,
        _ => OsString::from(NCCL_DEFAULT_LIBRARY),
    }
}

/// The process-wide NCCL table, loaded on first use from [`library_path()`].
///
/// A failed load is remembered: later calls return the same error again
/// without retrying.
pub fn nccl() -> Result<&'static NcclLib> {
    static LIB: OnceLock<Result<NcclLib>> = OnceLock::new();
    match LIB.get_or_init(|| NcclLib::load(library_path())) {
        Ok(lib) => Ok(lib),
        Err(Error::NcclVersion { library, headers }) => Err(Error::NcclVersion {
            library: *library,
            headers: *headers,
        }),
        Err(Error::NcclLibrary(msg)) => Err(Error::NcclLibrary(msg.clone())),
        Err(other) => Err(Error::NcclLibrary(other.to_string())),
    }
}

/// For tests: the process-wide library, or `None` after printing a `SKIP:`
/// line when it is absent and `MOE_EP_NCCL_LIBRARY` is unset. With the
/// variable set, a failed load panics (the test fails).
#[cfg(test)]
pub(crate) fn lib_or_skip(test: &str) -> Option<&'static NcclLib> {
    use std::io::Write;
    match nccl() {
        Ok(lib) => Some(lib),
        Err(e) if std::env::var_os(NCCL_LIBRARY_ENV).is_none_or(|p| p.is_empty()) => {
            // Written to the stderr handle, not eprintln!, so the harness does not capture it.
            let _ = writeln!(
                std::io::stderr(),
                "SKIP: {test}: NCCL not loadable and {NCCL_LIBRARY_ENV} unset: {e}"
            );
            None
        }
        Err(e) => panic!("{NCCL_LIBRARY_ENV} is set but NCCL did not load: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn config_layout_matches_lp64_by_hand() {
        // size_t; 2 x uint; 4 x int; ptr; 2 x int; ptr; 6 x int.
        assert_eq!(offset_of!(NcclConfig, size), 0);
        assert_eq!(offset_of!(NcclConfig, magic), 8);
        assert_eq!(offset_of!(NcclConfig, version), 12);
        assert_eq!(offset_of!(NcclConfig, blocking), 16);
        assert_eq!(offset_of!(NcclConfig, cga_cluster_size), 20);
        assert_eq!(offset_of!(NcclConfig, min_ctas), 24);
        assert_eq!(offset_of!(NcclConfig, max_ctas), 28);
        assert_eq!(offset_of!(NcclConfig, net_name), 32);
        assert_eq!(offset_of!(NcclConfig, split_share), 40);
        assert_eq!(offset_of!(NcclConfig, traffic_class), 44);
        assert_eq!(offset_of!(NcclConfig, comm_name), 48);
        assert_eq!(offset_of!(NcclConfig, collnet_enable), 56);
        assert_eq!(offset_of!(NcclConfig, cta_policy), 60);
        assert_eq!(offset_of!(NcclConfig, shrink_share), 64);
        assert_eq!(offset_of!(NcclConfig, nvls_ctas), 68);
        assert_eq!(offset_of!(NcclConfig, n_channels_per_net_peer), 72);
        assert_eq!(offset_of!(NcclConfig, nvlink_centric_sched), 76);
        assert_eq!(size_of::<NcclConfig>(), 80);
        assert_eq!(align_of::<NcclConfig>(), 8);
        assert_eq!(size_of::<ncclUniqueId>(), 128);
        assert_eq!(align_of::<ncclUniqueId>(), 1);
    }

    #[test]
    fn config_initializer_matches_header_macro() {
        let c = NcclConfig::default();
        assert_eq!(c.size, 80);
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.version, 22809);
        assert!(c.net_name.is_null() && c.comm_name.is_null());
        let ints = [
            c.blocking,
            c.cga_cluster_size,
            c.min_ctas,
            c.max_ctas,
            c.split_share,
            c.traffic_class,
            c.collnet_enable,
            c.cta_policy,
            c.shrink_share,
            c.nvls_ctas,
            c.n_channels_per_net_peer,
            c.nvlink_centric_sched,
        ];
        assert!(ints.iter().all(|&v| v == i32::MIN));
    }

    #[test]
    fn loads_and_is_not_older_than_headers() {
        let Some(lib) = lib_or_skip("loads_and_is_not_older_than_headers") else {
            return;
        };
        let headers = NcclVersion::from_code(crate::kernels::NCCL_HEADERS_VERSION_CODE);
        let v = lib.version();
        println!("NCCL library {v}, headers {headers}");
        assert!(v >= headers, "library {v} < headers {headers}");
        // The bundled toolchain ships library and headers from one wheel.
        let path = library_path();
        if path
            .to_string_lossy()
            .contains(".toolchain/py/nvidia/nccl/")
        {
            assert_eq!(v, headers);
        }
        assert_eq!(
            lib.has_peer_device_pointer(),
            lib.version().code() >= NCCL_PEER_POINTER_VERSION_CODE
        );
    }

    #[test]
    fn missing_library_names_path_and_fix() {
        let path = "/nonexistent/moe-ep/libnccl.so.2";
        match NcclLib::load(path) {
            Err(Error::NcclLibrary(msg)) => {
                assert!(msg.contains(path), "{msg}");
                assert!(msg.contains("MOE_EP_NCCL_LIBRARY"), "{msg}");
                assert!(msg.contains("nvidia-nccl-cu13"), "{msg}");
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("loaded a nonexistent library"),
        }
    }

    #[test]
    fn missing_symbol_is_named() {
        // libc is always present and has no NCCL symbols.
        match NcclLib::load("libc.so.6") {
            Err(Error::NcclLibrary(msg)) => {
                assert!(msg.contains("ncclGetVersion"), "{msg}");
                assert!(msg.contains("libc.so.6"), "{msg}");
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("libc loaded as NCCL"),
        }
    }
}
