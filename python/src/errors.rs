//! Errors: every [`moe_ep::Error`] becomes an instance of the class of its
//! kind in `moe_ep.errors` (pure Python, so that `InvalidArgument` can be a
//! `ValueError` too), with the same message; a refusal of this binding's
//! own checks is an `InvalidArgument` (a value: device, shape, layout) or an
//! `InvalidArgumentType` (also a `TypeError`: not an array, the wrong
//! dtype); a panic is caught before it reaches Python and becomes an
//! `InternalError`.

use std::panic::{catch_unwind, AssertUnwindSafe};

use moe_ep::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;

/// Why a call failed.
pub(crate) enum Fail {
    /// An error of this binding's value checks, or of a Rust call made
    /// with the GIL held.
    Ep(Error),
    /// An error of the Rust API returned inside [`detached`] (the op ran:
    /// it told its peers itself where it refused).
    Ran(Error),
    /// A wrong type or dtype (the message is that of an
    /// `Error::InvalidArgument`).
    Type(Error),
    /// A panic, with its message.
    Panic(String),
    /// An exception Python raised (a producer's `__dlpack__`, ...).
    Py(PyErr),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail::Ep(e)
    }
}

impl From<PyErr> for Fail {
    fn from(e: PyErr) -> Fail {
        Fail::Py(e)
    }
}

pub(crate) type Res<T> = std::result::Result<T, Fail>;

/// A wrong type or dtype of `arg`.
pub(crate) fn type_err(arg: &'static str, expected: impl Into<String>, got: impl ToString) -> Fail {
    Fail::Type(Error::arg(arg, expected, got.to_string()))
}

/// A wrong value (device, shape, layout) of `arg`.
pub(crate) fn value_err(
    arg: &'static str,
    expected: impl Into<String>,
    got: impl ToString,
) -> Fail {
    Fail::Ep(Error::arg(arg, expected, got.to_string()))
}

/// The class name in `moe_ep.errors` of each kind of error.
fn class_of(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument { .. } => "InvalidArgument",
        Error::NotSymmetric { .. } => "NotSymmetric",
        Error::CapacityExceeded { .. } => "CapacityExceeded",
        Error::PeerTimeout { .. } => "PeerTimeout",
        Error::PeerFailed { .. } => "PeerFailed",
        Error::CollectiveFailed { .. } => "CollectiveFailed",
        Error::InvalidDeviceData { .. } => "InvalidDeviceData",
        Error::NoDriver(_) => "NoDriver",
        Error::NotEnoughGpus { .. } => "NotEnoughGpus",
        Error::Cuda { .. } => "CudaError",
        Error::NcclLibrary(_) => "NcclLibraryError",
        Error::NcclVersion { .. } => "NcclVersionError",
        Error::Nccl { .. } => "NcclError",
        Error::Module { .. } => "ModuleError",
        Error::InvalidState(_) => "InvalidState",
        Error::Io(_) => "IoError",
    }
}

/// The fields of an error that a caller may want to branch on, set as
/// attributes of the exception (`arg`, `rank`, `peer`).
fn fields_of(e: &Error) -> Vec<(&'static str, Option<String>, Option<usize>)> {
    let s = |v: &str| Some(v.to_string());
    match e {
        Error::InvalidArgument { arg, .. } => vec![("arg", s(arg), None)],
        Error::NotSymmetric { what } => vec![("arg", s(what), None)],
        Error::InvalidDeviceData { arg, .. } => vec![("arg", s(arg), None)],
        Error::CapacityExceeded { what, .. } => vec![("arg", s(what), None)],
        Error::PeerTimeout { rank, peer, .. } => {
            vec![("rank", None, Some(*rank)), ("peer", None, Some(*peer))]
        }
        Error::PeerFailed { peer, arg, .. } => {
            vec![
                ("peer", None, Some(*peer)),
                ("arg", arg.map(String::from), None),
            ]
        }
        Error::CollectiveFailed { rank, .. } => vec![("rank", None, Some(*rank))],
        _ => vec![],
    }
}

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// An instance of `moe_ep.errors.<class>` with `msg`, or a RuntimeError
/// with it where that module cannot be imported.
fn make(py: Python<'_>, class: &str, msg: String, e: Option<&Error>) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let m = ERRORS.get_or_try_init(py, || py.import("moe_ep.errors").map(Bound::unbind))?;
        let v = m.bind(py).getattr(class)?.call1((msg.clone(),))?;
        if let Some(e) = e {
            for (name, text, num) in fields_of(e) {
                match (text, num) {
                    (Some(t), _) => v.setattr(name, t)?,
                    (None, Some(n)) => v.setattr(name, n)?,
                    (None, None) => v.setattr(name, py.None())?,
                }
            }
        }
        Ok(PyErr::from_value(v))
    })();
    made.unwrap_or_else(|_| PyRuntimeError::new_err(msg))
}

/// The error's message; where formatting it panics (a CUDA error's text
/// comes from the driver, which cudarc loads with a panic where there is
/// none), its code instead.
fn message(e: &Error) -> String {
    catch_unwind(AssertUnwindSafe(|| e.to_string())).unwrap_or_else(|_| match e {
        Error::Cuda { context, source } => format!("CUDA error in {context}: {:?}", source.0),
        other => format!("{other:?}"),
    })
}

impl Fail {
    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            Fail::Ep(e) | Fail::Ran(e) => make(py, class_of(&e), message(&e), Some(&e)),
            Fail::Type(e) => make(py, "InvalidArgumentType", message(&e), Some(&e)),
            Fail::Panic(what) => make(
                py,
                "InternalError",
                format!("internal error in moe-ep (a panic, caught at the Python binding): {what}"),
                None,
            ),
            Fail::Py(e) => e,
        }
    }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs one binding with the GIL held: its failure becomes the Python
/// exception, a panic an `InternalError`.
pub(crate) fn guarded<T>(py: Python<'_>, f: impl FnOnce() -> Res<T>) -> PyResult<T> {
    let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(Fail::Panic(panic_text(p))));
    r.map_err(|e| {
        catch_unwind(AssertUnwindSafe(|| e.into_py(py))).unwrap_or_else(|p| {
            PyRuntimeError::new_err(format!(
                "internal error in moe-ep (a panic while reporting an error, caught at the Python binding): {}",
                panic_text(p)
            ))
        })
    })
}

impl Fail {
    /// What a refusal of this binding's checks tells the peers
    /// ([`moe_ep::EpGroup::refuse`]): the argument, where one is named.
    pub(crate) fn told(&self) -> Error {
        match self {
            Fail::Ep(Error::InvalidArgument { arg, expected, got })
            | Fail::Type(Error::InvalidArgument { arg, expected, got }) => Error::InvalidArgument {
                arg,
                expected: expected.clone(),
                got: got.clone(),
            },
            Fail::Ep(Error::NotSymmetric { what }) => Error::NotSymmetric { what },
            _ => Error::InvalidState("the Python binding refused the call's arguments".into()),
        }
    }
}

/// Runs `f` with the GIL released (the ops block on their peers: virtual
/// ranks on Python threads need the others to run), catching a panic.
pub(crate) fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> moe_ep::Result<T> + Send,
) -> Res<T> {
    py.detach(|| match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(Fail::Ran),
        Err(p) => Err(Fail::Panic(panic_text(p))),
    })
}

/// Tests of the mapping without a GPU: every kind of error, by name.
#[pyfunction]
pub(crate) fn _raise_for_tests(py: Python<'_>, kind: &str) -> PyResult<()> {
    guarded(py, || {
        let e = match kind {
            "InvalidArgument" => Error::arg("x", "a test", "a test"),
            "NotSymmetric" => Error::NotSymmetric {
                what: "recv_tokens",
            },
            "CapacityExceeded" => Error::CapacityExceeded {
                what: "recv_tokens",
                needed: 10,
                capacity: 5,
            },
            "PeerTimeout" => Error::PeerTimeout {
                rank: 0,
                peer: 1,
                counter: "dispatch",
                expected: 1,
                seen: 0,
                absent: true,
            },
            "PeerFailed" => Error::PeerFailed {
                peer: 2,
                arg: Some("x"),
                reason: "a test".into(),
            },
            "CollectiveFailed" => Error::CollectiveFailed {
                rank: 0,
                collective: "barrier",
                missing: vec![1],
                reason: "a test".into(),
            },
            "InvalidDeviceData" => Error::InvalidDeviceData {
                arg: "topk_idx",
                detail: "a test".into(),
            },
            "NoDriver" => Error::NoDriver("a test".into()),
            "NotEnoughGpus" => Error::NotEnoughGpus {
                needed: 2,
                found: 1,
            },
            "Cuda" => Error::Cuda {
                context: "cuMemAlloc",
                source: moe_ep::cuda::DriverError(
                    moe_ep::cuda::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                ),
            },
            "NcclLibrary" => Error::NcclLibrary("a test".into()),
            "NcclVersion" => Error::NcclVersion {
                library: moe_ep::NcclVersion::from_code(22800),
                headers: moe_ep::NcclVersion::from_code(22809),
            },
            "Nccl" => Error::Nccl {
                call: "ncclCommInitRank",
                code: 3,
                message: "a test".into(),
                last: String::new(),
            },
            "Module" => Error::Module {
                module: "dispatch",
                detail: "a test".into(),
            },
            "InvalidState" => Error::InvalidState("a test".into()),
            "Io" => Error::Io(std::io::Error::other("a test")),
            "Panic" => panic!("a test panic"),
            other => return Err(value_err("kind", "the name of an error kind", other)),
        };
        Err(Fail::Ep(e))
    })
}
