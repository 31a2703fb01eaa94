//! Thin checked NCCL calls.
//!
//! One function per C call of [`crate::sys::nccl::NcclLib`] that the crate,
//! its tools or the C ABI make: it loads the library on first use, converts
//! integer arguments, and turns a code other than `ncclSuccess` into
//! [`Error::Nccl`] with NCCL's own message. Counts are in elements of
//! `datatype`, sizes and offsets in bytes, ranks are world ranks. Device
//! buffers are raw device addresses as `*const/*mut c_void`; streams are
//! CUDA streams (`CUstream` cast to `*mut c_void`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::ptr;

use crate::error::{Error, Result};
use crate::sys::nccl::{
    cudaStream_t, nccl, ncclComm_t, ncclDataType_t, ncclResult_t, ncclSuccess, ncclUniqueId,
    ncclWindow_t, NCCL_UNIQUE_ID_BYTES,
};

/// `comm` argument of [`check`] for calls without a communicator: NCCL's
/// last-error text is process-wide ("comm is currently unused and can be set
/// to NULL", NCCL `ncclGetLastError`), so it is still worth asking for.
const NO_COMM: Option<ncclComm_t> = Some(ptr::null_mut());

/// Copies a C string owned by NCCL; null gives an empty string.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string valid for the call.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// Turns NCCL's return `code` of `call` into a `Result`.
///
/// On failure the error carries `ncclGetErrorString(code)` and, when `comm`
/// is `Some`, the text of `ncclGetLastError(comm)` as `last: "; <text>"`
/// (empty when NCCL has none). Pass the communicator the call used while it
/// is still alive, `Some(null)` when there is none (NCCL ignores the argument
/// and accepts NULL), or `None` to leave the last-error text out.
pub fn check(call: &'static str, code: ncclResult_t, comm: Option<ncclComm_t>) -> Result<()> {
    if code == ncclSuccess {
        return Ok(());
    }
    let (message, last) = match nccl() {
        Ok(lib) => {
            // SAFETY: ncclGetErrorString accepts any code and returns a static string.
            let message = unsafe { text((lib.get_error_string)(code)) };
            let last = match comm {
                // SAFETY: NCCL returns its own last-error buffer; `c` is alive or null.
                Some(c) => unsafe { text((lib.get_last_error)(c)) },
                None => String::new(),
            };
            let last = if last.is_empty() {
                last
            } else {
                format!("; {last}")
            };
            (message, last)
        }
        Err(e) => (format!("NCCL library unavailable: {e}"), String::new()),
    };
    Err(Error::Nccl {
        call,
        code,
        message,
        last,
    })
}

/// `usize` argument `arg` as a C `int`.
fn int_arg(arg: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::arg(arg, "a value <= i32::MAX", v))
}

/// Non-negative `int` result of `call` as `usize`.
fn int_out(call: &'static str, v: c_int) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidState(format!("{call} returned {v}")))
}

/// New id for a communicator (`ncclGetUniqueId`); rank 0 makes it and sends
/// it to the other ranks (see [`UniqueId`]). Starts NCCL's bootstrap listener,
/// so it needs a usable network interface (loopback is enough on one host).
pub fn get_unique_id() -> Result<ncclUniqueId> {
    let lib = nccl()?;
    let mut id = ncclUniqueId::zeroed();
    // SAFETY: `id` is a valid out-pointer of the right type.
    let rc = unsafe { (lib.get_unique_id)(&mut id) };
    check("ncclGetUniqueId", rc, NO_COMM)?;
    Ok(id)
}

/// Joins communicator `id` of `world` ranks as `rank` (`ncclCommInitRank`).
/// Blocks until every rank has joined.
///
/// # Safety
/// The calling thread's current CUDA device/context is the GPU this rank
/// uses. Every rank must call concurrently with the same `id` and `world`,
/// and the returned communicator must end with exactly one of
/// [`comm_destroy`] or [`comm_abort`].
pub unsafe fn comm_init_rank(world: usize, id: ncclUniqueId, rank: usize) -> Result<ncclComm_t> {
    let lib = nccl()?;
    let (world, rank) = (int_arg("world", world)?, int_arg("rank", rank)?);
    let mut comm: ncclComm_t = ptr::null_mut();
    let rc = (lib.comm_init_rank)(&mut comm, world, id, rank);
    check("ncclCommInitRank", rc, NO_COMM)?;
    Ok(comm)
}

/// The ranks of `comm` that give the same `color` as a new communicator,
/// ranked by `key` (`ncclCommSplit`, the parent's configuration inherited).
/// Collective over `comm`.
///
/// # Safety
/// `comm` must be a live communicator, used by no other thread meanwhile,
/// with the context of its device current.
pub unsafe fn comm_split(comm: ncclComm_t, color: usize, key: usize) -> Result<ncclComm_t> {
    let lib = nccl()?;
    let (color, key) = (int_arg("color", color)?, int_arg("key", key)?);
    let mut new: ncclComm_t = ptr::null_mut();
    let rc = (lib.comm_split)(comm, color, key, &mut new, ptr::null_mut());
    check("ncclCommSplit", rc, Some(comm))?;
    Ok(new)
}

/// Flushes the communicator's outstanding work (`ncclCommFinalize`); follow
/// with [`comm_destroy`].
///
/// # Safety
/// `comm` must be a live communicator, used by no other thread meanwhile.
pub unsafe fn comm_finalize(comm: ncclComm_t) -> Result<()> {
    let lib = nccl()?;
    check("ncclCommFinalize", (lib.comm_finalize)(comm), Some(comm))
}

/// Frees the communicator (`ncclCommDestroy`).
///
/// # Safety
/// `comm` must be a live communicator with no work still to be enqueued; it
/// is invalid afterwards, whatever the result.
pub unsafe fn comm_destroy(comm: ncclComm_t) -> Result<()> {
    let lib = nccl()?;
    check("ncclCommDestroy", (lib.comm_destroy)(comm), NO_COMM)
}

/// Aborts outstanding work and frees the communicator (`ncclCommAbort`).
///
/// # Safety
/// `comm` must be a live communicator; it is invalid afterwards, whatever
/// the result.
pub unsafe fn comm_abort(comm: ncclComm_t) -> Result<()> {
    let lib = nccl()?;
    check("ncclCommAbort", (lib.comm_abort)(comm), NO_COMM)
}

/// The communicator's asynchronous error state (`ncclCommGetAsyncError`):
/// `ncclSuccess`, `ncclInProgress`, or the error that broke it.
///
/// # Safety
/// `comm` must be a live communicator.
pub unsafe fn comm_get_async_error(comm: ncclComm_t) -> Result<ncclResult_t> {
    let lib = nccl()?;
    let mut state: ncclResult_t = ncclSuccess;
    let rc = (lib.comm_get_async_error)(comm, &mut state);
    check("ncclCommGetAsyncError", rc, Some(comm))?;
    Ok(state)
}

/// Number of ranks in the communicator (`ncclCommCount`).
///
/// # Safety
/// `comm` must be a live communicator (NCCL rejects null).
pub unsafe fn comm_count(comm: ncclComm_t) -> Result<usize> {
    let lib = nccl()?;
    let mut v: c_int = 0;
    check("ncclCommCount", (lib.comm_count)(comm, &mut v), Some(comm))?;
    int_out("ncclCommCount", v)
}

/// CUDA device ordinal the communicator runs on (`ncclCommCuDevice`; for the
/// C ABI, through the feature `raw`).
///
/// # Safety
/// `comm` must be a live communicator (NCCL rejects null).
#[cfg(feature = "raw")]
pub unsafe fn comm_cu_device(comm: ncclComm_t) -> Result<usize> {
    let lib = nccl()?;
    let mut v: c_int = 0;
    check(
        "ncclCommCuDevice",
        (lib.comm_cu_device)(comm, &mut v),
        Some(comm),
    )?;
    int_out("ncclCommCuDevice", v)
}

/// This process's rank in the communicator (`ncclCommUserRank`).
///
/// # Safety
/// `comm` must be a live communicator (NCCL rejects null).
pub unsafe fn comm_user_rank(comm: ncclComm_t) -> Result<usize> {
    let lib = nccl()?;
    let mut v: c_int = 0;
    check(
        "ncclCommUserRank",
        (lib.comm_user_rank)(comm, &mut v),
        Some(comm),
    )?;
    int_out("ncclCommUserRank", v)
}

/// Allocates `size` bytes of device memory suitable for window registration
/// (`ncclMemAlloc`; NCCL may round the size up to its granularity) on the
/// current CUDA device. Free it with [`mem_free`].
pub fn mem_alloc(size: usize) -> Result<*mut c_void> {
    let lib = nccl()?;
    let mut p: *mut c_void = ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer; NCCL validates `size`.
    let rc = unsafe { (lib.mem_alloc)(&mut p, size) };
    check("ncclMemAlloc", rc, NO_COMM)?;
    Ok(p)
}

/// Frees memory from [`mem_alloc`] (`ncclMemFree`).
///
/// # Safety
/// `ptr` must come from [`mem_alloc`], not be freed yet, be deregistered from
/// every window, and no pending GPU work may use it.
pub unsafe fn mem_free(ptr: *mut c_void) -> Result<()> {
    let lib = nccl()?;
    check("ncclMemFree", (lib.mem_free)(ptr), NO_COMM)
}

/// Registers `size` bytes at `ptr` as a window of `comm`
/// (`ncclCommWindowRegister`; collective: every rank calls it). `flags` is
/// `NCCL_WIN_DEFAULT` or `NCCL_WIN_COLL_SYMMETRIC`; symmetric windows need
/// `ptr` and `size` aligned to `NCCL_WIN_REQUIRED_ALIGNMENT` bytes.
///
/// # Safety
/// `comm` must be live; `ptr..ptr+size` must be device memory (from
/// [`mem_alloc`] for symmetric use) that outlives the window.
pub unsafe fn window_register(
    comm: ncclComm_t,
    ptr: *mut c_void,
    size: usize,
    flags: c_int,
) -> Result<ncclWindow_t> {
    let lib = nccl()?;
    let mut win: ncclWindow_t = ptr::null_mut();
    let rc = (lib.comm_window_register)(comm, ptr, size, &mut win, flags);
    check("ncclCommWindowRegister", rc, Some(comm))?;
    Ok(win)
}

/// Deregisters a window (`ncclCommWindowDeregister`; collective).
///
/// # Safety
/// `win` must be a live window of the live `comm`, with no pending GPU work
/// using it; it is invalid afterwards.
pub unsafe fn window_deregister(comm: ncclComm_t, win: ncclWindow_t) -> Result<()> {
    let lib = nccl()?;
    check(
        "ncclCommWindowDeregister",
        (lib.comm_window_deregister)(comm, win),
        Some(comm),
    )
}

/// Opens a group (`ncclGroupStart`): calls until [`group_end`] are fused.
pub fn group_start() -> Result<()> {
    let lib = nccl()?;
    // SAFETY: no arguments; NCCL tracks group depth per thread.
    check("ncclGroupStart", unsafe { (lib.group_start)() }, NO_COMM)
}

/// Closes a group (`ncclGroupEnd`) and enqueues its work; errors of the
/// grouped calls surface here.
pub fn group_end() -> Result<()> {
    let lib = nccl()?;
    // SAFETY: no arguments; NCCL rejects an unmatched end.
    check("ncclGroupEnd", unsafe { (lib.group_end)() }, NO_COMM)
}

/// Sends `count` elements at `buf` to rank `peer` on `stream` (`ncclSend`).
///
/// # Safety
/// `comm` must be live; `buf` must be device memory holding `count` elements
/// of `datatype` that stays valid until `stream` has run the send; `stream`
/// must be a live stream of the communicator's device.
pub unsafe fn send(
    buf: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: usize,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<()> {
    let lib = nccl()?;
    let peer = int_arg("peer", peer)?;
    let rc = (lib.send)(buf, count, datatype, peer, comm, stream);
    check("ncclSend", rc, Some(comm))
}

/// Receives `count` elements from rank `peer` into `buf` on `stream`
/// (`ncclRecv`).
///
/// # Safety
/// As [`send`], with `buf` writable for `count` elements.
pub unsafe fn recv(
    buf: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: usize,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<()> {
    let lib = nccl()?;
    let peer = int_arg("peer", peer)?;
    let rc = (lib.recv)(buf, count, datatype, peer, comm, stream);
    check("ncclRecv", rc, Some(comm))
}

/// Reduces `count` elements across ranks with `op` into `recv` on every rank
/// (`ncclAllReduce`; in place when `send == recv`; for the testkit and the
/// raw API).
///
/// # Safety
/// `comm` must be live; `send`/`recv` must be device memory of `count`
/// elements each, valid until `stream` has run the call; `stream` must be a
/// live stream of the communicator's device.
#[cfg(any(feature = "raw", feature = "testkit"))]
pub unsafe fn all_reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: crate::sys::nccl::ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<()> {
    let lib = nccl()?;
    let rc = (lib.all_reduce)(send, recv, count, datatype, op, comm, stream);
    check("ncclAllReduce", rc, Some(comm))
}

/// Gathers `send_count` elements from every rank into `recv`, in rank order
/// (`ncclAllGather`).
///
/// # Safety
/// `comm` must be live; `send` must be device memory of `send_count`
/// elements and `recv` of `world * send_count`, valid until `stream` has run
/// the call; `stream` must be a live stream of the communicator's device.
pub unsafe fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    send_count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<()> {
    let lib = nccl()?;
    let rc = (lib.all_gather)(send, recv, send_count, datatype, comm, stream);
    check("ncclAllGather", rc, Some(comm))
}

/// Load/store address of byte `offset` of window `win` on world rank `peer`
/// (`ncclGetPeerDevicePointer`, NCCL >= 2.29.2).
///
/// `Ok(None)`: the library lacks the call. `Ok(Some(p))`: NCCL's answer,
/// where `p` is null when `peer` is not load/store reachable (not in this
/// rank's NVLink domain).
///
/// # Safety
/// `win` must be a live window (registered with `NCCL_WIN_COLL_SYMMETRIC`).
pub unsafe fn peer_device_pointer(
    win: ncclWindow_t,
    offset: usize,
    peer: usize,
) -> Result<Option<*mut c_void>> {
    let lib = nccl()?;
    let Some(get) = lib.get_peer_device_pointer else {
        return Ok(None);
    };
    let peer = int_arg("peer", peer)?;
    let mut p: *mut c_void = ptr::null_mut();
    check(
        "ncclGetPeerDevicePointer",
        get(win, offset, peer, &mut p),
        NO_COMM,
    )?;
    Ok(Some(p))
}

/// Declares [`UniqueId`], its inner `ncclUniqueId` visible as `$vis`.
macro_rules! unique_id {
    ($vis:vis) => {
        /// A communicator id that can travel between processes as 256 hex
        /// characters. The inner `ncclUniqueId` is public with the Cargo
        /// feature `raw`.
        #[derive(Clone, Copy, PartialEq, Eq)]
        pub struct UniqueId($vis ncclUniqueId);
    };
}
#[cfg(feature = "raw")]
unique_id!(pub);
#[cfg(not(feature = "raw"))]
unique_id!(pub(crate));

impl UniqueId {
    /// A fresh id (`ncclGetUniqueId`).
    pub fn generate() -> Result<UniqueId> {
        get_unique_id().map(UniqueId)
    }

    /// The id's bytes (to send to the other ranks by any means).
    pub fn to_bytes(&self) -> [u8; NCCL_UNIQUE_ID_BYTES] {
        self.0.internal
    }

    /// The id from its bytes ([`UniqueId::to_bytes`] of rank 0's id).
    pub fn from_bytes(bytes: [u8; NCCL_UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId(ncclUniqueId { internal: bytes })
    }

    /// The id as 256 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(2 * NCCL_UNIQUE_ID_BYTES);
        for &b in &self.0.internal {
            s.push(DIGITS[usize::from(b >> 4)] as char);
            s.push(DIGITS[usize::from(b & 0xf)] as char);
        }
        s
    }

    /// Parses [`UniqueId::to_hex`] output (either case; surrounding
    /// whitespace ignored).
    pub fn from_hex(s: &str) -> Result<UniqueId> {
        const EXPECTED: &str = "256 hex characters";
        let s = s.trim().as_bytes();
        if s.len() != 2 * NCCL_UNIQUE_ID_BYTES {
            return Err(Error::arg(
                "unique_id",
                EXPECTED,
                format!("{} bytes", s.len()),
            ));
        }
        let nibble = |i: usize| -> Result<u8> {
            let c = s[i];
            let v = match c {
                b'0'..=b'9' => Some(c - b'0'),
                b'a'..=b'f' => Some(c - b'a' + 10),
                b'A'..=b'F' => Some(c - b'A' + 10),
                _ => None,
            };
            v.ok_or_else(|| {
                Error::arg(
                    "unique_id",
                    EXPECTED,
                    format!("byte {c:#04x} at position {i}"),
                )
            })
        };
        let mut id = ncclUniqueId::zeroed();
        for (k, byte) in id.internal.iter_mut().enumerate() {
            *byte = (nibble(2 * k)? << 4) | nibble(2 * k + 1)?;
        }
        Ok(UniqueId(id))
    }
}

impl From<ncclUniqueId> for UniqueId {
    fn from(id: ncclUniqueId) -> Self {
        UniqueId(id)
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::nccl::{lib_or_skip, ncclInvalidArgument};

    #[test]
    fn unique_id_round_trips_through_hex() {
        if lib_or_skip("unique_id_round_trips_through_hex").is_none() {
            return;
        }
        let id = match UniqueId::generate() {
            Ok(id) => id,
            Err(e) => panic!("ncclGetUniqueId failed: {e}"),
        };
        assert_ne!(id.0, ncclUniqueId::zeroed());
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(UniqueId::from_hex(&hex).ok(), Some(id));
        let upper = format!("  {}\n", hex.to_uppercase());
        assert_eq!(UniqueId::from_hex(&upper).ok(), Some(id));
    }

    #[test]
    fn from_hex_rejects_bad_input() {
        let good = "0".repeat(256);
        assert!(UniqueId::from_hex(&good).is_ok());
        let bad_char = format!("{}g", "0".repeat(255));
        let non_ascii = format!("{}é", "0".repeat(254));
        for s in ["", "00", &"0".repeat(258), &bad_char, &non_ascii] {
            match UniqueId::from_hex(s) {
                Err(Error::InvalidArgument { arg, expected, got }) => {
                    assert_eq!(arg, "unique_id");
                    assert_eq!(expected, "256 hex characters");
                    assert!(!got.is_empty());
                }
                other => panic!("{s:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn error_text_for_invalid_argument() {
        if lib_or_skip("error_text_for_invalid_argument").is_none() {
            return;
        }
        assert!(check("ncclTest", ncclSuccess, None).is_ok());
        match check("ncclTest", ncclInvalidArgument, None) {
            Err(Error::Nccl {
                call,
                code,
                message,
                last,
            }) => {
                assert_eq!((call, code), ("ncclTest", 4));
                assert!(message.contains("invalid argument"), "{message}");
                assert!(last.is_empty(), "{last}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn last_error_text_is_appended() {
        if lib_or_skip("last_error_text_is_appended").is_none() {
            return;
        }
        // SAFETY: NCCL checks for a null communicator and returns ncclInvalidArgument.
        match unsafe { comm_count(ptr::null_mut()) } {
            Err(Error::Nccl {
                call, code, last, ..
            }) => {
                assert_eq!((call, code), ("ncclCommCount", 4));
                assert!(last.starts_with("; ") && last.len() > 2, "{last:?}");
                println!("last error{last}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn peer_device_pointer_matches_library() {
        let Some(lib) = lib_or_skip("peer_device_pointer_matches_library") else {
            return;
        };
        // SAFETY: without the symbol nothing is called; with it, NCCL
        // rejects a null window before using it.
        let r = unsafe { peer_device_pointer(ptr::null_mut(), 0, 0) };
        if lib.has_peer_device_pointer() {
            assert!(matches!(r, Err(Error::Nccl { .. })), "{r:?}");
        } else {
            assert!(matches!(r, Ok(None)), "{r:?}");
        }
    }
}
