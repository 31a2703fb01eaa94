//! The crate's one error type.
//!
//! Every variant carries what a caller needs to fix the call: the argument's
//! name and what was expected, the capacity that was exceeded, the peer and
//! counter that stalled, or the driver / NCCL code with its own message.

use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in moe-ep.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A caller-supplied argument has the wrong shape, dtype, alignment or
    /// value. `arg` names it; `expected` says what would have been accepted.
    #[error("invalid argument `{arg}`: expected {expected}, got {got}")]
    InvalidArgument {
        arg: &'static str,
        expected: String,
        got: String,
    },

    /// A buffer that zero copy needs to be symmetric (NCCL window or pool
    /// buffer of this communicator) is not.
    #[error("`{what}` is not symmetric memory of this communicator: allocate it from the SymmPool or wrap a window registered with NCCL_WIN_COLL_SYMMETRIC")]
    NotSymmetric { what: &'static str },

    /// A receive (or send) count found on the device is larger than the
    /// buffer sized for it. Nothing was written out of bounds.
    #[error("capacity exceeded for `{what}`: {needed} rows needed, capacity {capacity}")]
    CapacityExceeded {
        what: &'static str,
        needed: usize,
        capacity: usize,
    },

    /// A bounded wait on another GPU ran out of time. `peer` is the rank
    /// that did not come: with `absent`, it never arrived at the op at all
    /// (its part of the call was not there); otherwise it had, and the
    /// wait was for its progress on `counter`.
    #[error("rank {rank} timed out on counter `{counter}`: {} (expected {expected}, saw {seen})", if *absent { format!("rank {peer} never arrived at this op") } else { format!("waiting for peer rank {peer}") })]
    PeerTimeout {
        rank: usize,
        peer: usize,
        counter: &'static str,
        expected: u64,
        seen: u64,
        absent: bool,
    },

    /// Another rank failed its part of the same op call: its host refused
    /// it (`arg`, when it was an argument: a bad input on that rank only;
    /// its own error says what was wrong) or it skipped the call after an
    /// error of its own. Nothing was written or read on its behalf; call
    /// `check()` on every rank.
    #[error("rank {peer} failed its part of this op: {reason}")]
    PeerFailed {
        peer: usize,
        arg: Option<&'static str>,
        reason: String,
    },

    /// A host-side collective (barrier, all-gather, a collective allocation,
    /// a rail hop) of a virtual world did not complete: `missing` names the
    /// ranks that did not arrive within the timeout, left the world (dropped
    /// their communicator, or panicked), called another collective, or
    /// refused their part of it (their own error says why).
    #[error("rank {rank}: host collective `{collective}` failed: {reason}")]
    CollectiveFailed {
        rank: usize,
        collective: &'static str,
        missing: Vec<usize>,
        reason: String,
    },

    /// An input value checked on the device was out of range (e.g. an expert
    /// id in `topk_idx` not in `[-1, num_experts)`).
    #[error("invalid device data in `{arg}`: {detail}")]
    InvalidDeviceData { arg: &'static str, detail: String },

    /// No usable CUDA driver (libcuda) could be loaded.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),

    /// Fewer GPUs than needed.
    #[error("not enough GPUs: need {needed}, found {found}")]
    NotEnoughGpus { needed: usize, found: usize },

    /// A CUDA driver call failed.
    #[error("CUDA error in {context}: {source}")]
    Cuda {
        context: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },

    /// The NCCL library could not be loaded or lacks a symbol.
    #[error("NCCL library: {0}")]
    NcclLibrary(String),

    /// The NCCL library at run time is older than the headers the kernels
    /// were built against.
    #[error("NCCL library version {library} is older than the headers moe-ep was built with ({headers}); point MOE_EP_NCCL_LIBRARY at a newer libnccl.so.2")]
    NcclVersion {
        library: NcclVersion,
        headers: NcclVersion,
    },

    /// An NCCL call returned an error code.
    #[error("NCCL error in {call}: {code} ({message}){last}")]
    Nccl {
        call: &'static str,
        code: i32,
        message: String,
        /// `ncclGetLastError` text, prefixed with "; " when present.
        last: String,
    },

    /// Kernel image for this GPU is missing (not sm_90-compatible, or the
    /// build had no nvcc).
    #[error("kernel module `{module}`: {detail}")]
    Module {
        module: &'static str,
        detail: String,
    },

    /// The object was used after an earlier error poisoned it, or in a state
    /// that does not allow the call.
    #[error("invalid state: {0}")]
    InvalidState(String),

    /// Host-side I/O (launcher, files).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn arg(arg: &'static str, expected: impl Into<String>, got: impl fmt::Display) -> Self {
        Error::InvalidArgument {
            arg,
            expected: expected.into(),
            got: got.to_string(),
        }
    }

    /// Wraps a driver error with a short context.
    pub fn cuda(context: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
        move |source| Error::Cuda { context, source }
    }
}

/// An NCCL version `major.minor.patch` (code `major*10000 + minor*100 + patch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes NCCL's integer version code (>= 2.9: `major*10000+minor*100+patch`).
    pub fn from_code(code: i32) -> Self {
        let c = code.max(0) as u32;
        if c >= 10000 {
            NcclVersion {
                major: c / 10000,
                minor: (c % 10000) / 100,
                patch: c % 100,
            }
        } else {
            // Pre-2.9 scheme: major*1000 + minor*100 + patch.
            NcclVersion {
                major: c / 1000,
                minor: (c % 1000) / 100,
                patch: c % 100,
            }
        }
    }

    /// The integer code.
    pub fn code(&self) -> i32 {
        (self.major * 10000 + self.minor * 100 + self.patch) as i32
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}
