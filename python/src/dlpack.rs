//! Arrays across the boundary, zero copy.
//!
//! In: any object with `__dlpack__` (torch tensors, cupy and numpy arrays)
//! or `__cuda_array_interface__` (v2 and v3), read into an [`Array`]: its
//! device address, shape and dtype, checked to be C-contiguous CUDA memory
//! of the group's GPU. The producer's `__dlpack__` is given the op's stream,
//! so that it orders that stream after its own pending work (torch makes the
//! op's stream wait for its current stream where they differ; a torch
//! tensor on an op that runs on torch's current stream is exported without
//! a stream, there being nothing to order: `torch_export`); a
//! `__cuda_array_interface__` that names a stream is waited for the same
//! way. Host memory, another GPU, another dtype or strides are refused
//! naming the argument, before anything is enqueued.
//!
//! Out: [`DeviceArray`], a DLPack producer (`__dlpack__`,
//! `__dlpack_device__`) over memory the Rust API owns (a pool buffer, a
//! handle's counts, a low-latency batch's views). Its capsule's deleter
//! holds a reference to the owner, so `torch.from_dlpack(a)` aliases the
//! symmetric memory and keeps it alive for as long as the tensor lives.
//! bf16 has no `__cuda_array_interface__` typestr, so DLPack is the only
//! way out.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use moe_ep::cuda::{sys, CudaContext, CudaStream};
use moe_ep::error::Error;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::{guarded, type_err, value_err, Fail, Res};
use crate::stream;

// ---- the DLPack ABI (dlpack.h, v1.1) ---------------------------------------

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const KDL_CUDA_MANAGED: i32 = 13;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

// ---- dtypes ----------------------------------------------------------------

/// The element types the ops take and return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DType {
    Bf16,
    F32,
    I32,
    I64,
    U8,
    /// fp8 e4m3 (finite, no infinities: torch's `float8_e4m3fn`).
    F8E4M3,
}

impl DType {
    pub(crate) fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bfloat16",
            DType::F32 => "float32",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::F8E4M3 => "float8_e4m3fn",
        }
    }
    pub(crate) fn from_name(arg: &'static str, s: &str) -> Res<DType> {
        Ok(match s.strip_prefix("torch.").unwrap_or(s) {
            "bfloat16" => DType::Bf16,
            "float32" | "float" => DType::F32,
            "int32" | "int" => DType::I32,
            "int64" | "long" => DType::I64,
            "uint8" => DType::U8,
            "float8_e4m3fn" => DType::F8E4M3,
            other => {
                return Err(type_err(
                    arg,
                    "bfloat16, float32, int32, int64, uint8 or float8_e4m3fn",
                    other,
                ))
            }
        })
    }
    pub(crate) fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
            DType::U8 | DType::F8E4M3 => 1,
        }
    }
    fn dl(self) -> DLDataType {
        let (code, bits) = match self {
            DType::Bf16 => (4, 16),
            DType::F32 => (2, 32),
            DType::I32 => (0, 32),
            DType::I64 => (0, 64),
            DType::U8 => (1, 8),
            DType::F8E4M3 => (10, 8),
        };
        DLDataType {
            code,
            bits,
            lanes: 1,
        }
    }
    fn from_dl(t: DLDataType) -> Option<DType> {
        if t.lanes != 1 {
            return None;
        }
        Some(match (t.code, t.bits) {
            (4, 16) => DType::Bf16,
            (2, 32) => DType::F32,
            (0, 32) => DType::I32,
            (0, 64) => DType::I64,
            (1, 8) => DType::U8,
            (10, 8) => DType::F8E4M3,
            _ => return None,
        })
    }
    fn describe_dl(t: DLDataType) -> String {
        match DType::from_dl(t) {
            Some(d) => d.name().into(),
            None => {
                let kind = match t.code {
                    0 => "int",
                    1 => "uint",
                    2 => "float",
                    4 => "bfloat",
                    5 => "complex",
                    6 => "bool",
                    7..=12 => "float8 variant",
                    _ => "dtype code",
                };
                format!(
                    "{kind}{} (DLPack code {}, lanes {})",
                    t.bits, t.code, t.lanes
                )
            }
        }
    }
    fn from_typestr(s: &str) -> Option<DType> {
        Some(match s {
            "<f4" => DType::F32,
            "<i4" => DType::I32,
            "<i8" => DType::I64,
            "|u1" | "<u1" => DType::U8,
            _ => return None,
        })
    }
}

fn names(want: &[DType]) -> String {
    let n: Vec<&str> = want.iter().map(|d| d.name()).collect();
    n.join(" or ")
}

fn shape_text(shape: &[usize]) -> String {
    let s: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", s.join(", "))
}

// ---- in ------------------------------------------------------------------

/// A caller's array, checked: C-contiguous device memory of the group's
/// GPU, one of the dtypes the argument takes. Holds the producer's capsule
/// until the op that reads it is enqueued.
pub(crate) struct Array {
    pub(crate) arg: &'static str,
    pub(crate) ptr: u64,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    _keep: Option<Py<PyAny>>,
}

impl Array {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub(crate) fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    /// Refuses another shape than `want` (`None`: any extent there),
    /// naming the argument and `what` it holds.
    pub(crate) fn expect_shape(&self, want: &[Option<usize>], what: &str) -> Res<()> {
        let ok = self.shape.len() == want.len()
            && self
                .shape
                .iter()
                .zip(want)
                .all(|(&d, w)| w.is_none_or(|w| w == d));
        if ok {
            return Ok(());
        }
        Err(value_err(
            self.arg,
            format!("{what} {}", self.dtype.name()),
            format!("shape {}", shape_text(&self.shape)),
        ))
    }
}

/// Reads `obj` as an array for argument `arg` of an op on `stream` (a raw
/// handle, `0` the legacy default stream) of GPU `device`, with one of the
/// dtypes `want`. Without a context (the CPU tests), a
/// `__cuda_array_interface__` pointer is not looked up and its stream not
/// waited for.
pub(crate) fn import(
    obj: &Bound<'_, PyAny>,
    arg: &'static str,
    want: &[DType],
    device: usize,
    ctx: Option<&Arc<CudaContext>>,
    stream: u64,
) -> Res<Array> {
    let py = obj.py();
    // The array API's value for the legacy default stream is 1 (0 is
    // ambiguous and refused by some producers).
    let s = if stream == 0 { 1 } else { stream as i64 };
    if let Some((t, sync)) = torch_export(obj, device, stream)? {
        return from_dlpack(&t, arg, want, device, if sync { s } else { NO_SYNC });
    }
    if let Ok(dev) = obj.call_method0(pyo3::intern!(py, "__dlpack_device__")) {
        let (kind, id): (i32, i32) = dev.extract().map_err(|_| {
            type_err(
                arg,
                "__dlpack_device__() returning (device_type, device_id)",
                dev.repr().map(|r| r.to_string()).unwrap_or_default(),
            )
        })?;
        check_device(arg, kind, id, device)?;
        return from_dlpack(obj, arg, want, device, s);
    }
    if let Ok(cai) = obj.getattr(pyo3::intern!(py, "__cuda_array_interface__")) {
        return from_cai(&cai, arg, want, device, ctx, stream);
    }
    Err(type_err(
        arg,
        "a CUDA array (an object with __dlpack__ or __cuda_array_interface__, e.g. a torch tensor)",
        obj.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "an object".into()),
    ))
}

fn check_device(arg: &'static str, kind: i32, id: i32, device: usize) -> Res<()> {
    let want = format!("CUDA device memory of GPU {device} (the group's)");
    match kind {
        KDL_CUDA if id as i64 == device as i64 => Ok(()),
        KDL_CUDA => Err(value_err(arg, want, format!("memory of GPU {id}"))),
        KDL_CPU => Err(value_err(arg, want, "host memory (DLPack device kDLCPU)")),
        KDL_CUDA_HOST => Err(value_err(
            arg,
            want,
            "pinned host memory (DLPack device kDLCUDAHost)",
        )),
        KDL_CUDA_MANAGED => Err(value_err(
            arg,
            want,
            "managed memory (DLPack device kDLCUDAManaged)",
        )),
        other => Err(value_err(arg, want, format!("DLPack device type {other}"))),
    }
}

/// `obj`'s DLPack capsule, its `__dlpack__` given `stream` (the array
/// API's value: a raw handle, 1 the legacy default stream, -1 none), read
/// and checked as an array of GPU `device` for argument `arg`.
fn from_dlpack(
    obj: &Bound<'_, PyAny>,
    arg: &'static str,
    want: &[DType],
    device: usize,
    stream: i64,
) -> Res<Array> {
    let py = obj.py();
    let s = stream;
    let kwargs = PyDict::new(py);
    kwargs.set_item(pyo3::intern!(py, "stream"), s)?;
    let name = pyo3::intern!(py, "__dlpack__");
    let cap = match obj.call_method(name, (), Some(&kwargs)) {
        Ok(c) => c,
        // torch refuses to export a tensor that requires grad: the op
        // reads it, it does not differentiate it (moe_ep.torch does).
        Err(e) => match obj.call_method0(pyo3::intern!(py, "detach")) {
            Ok(d) => d.call_method(name, (), Some(&kwargs)).map_err(|_| e)?,
            Err(_) => return Err(Fail::Py(e)),
        },
    };
    let p = cap.as_ptr();
    // SAFETY: `p` is a live object (held by `cap`); the capsule API
    // checks its type and name.
    let t: &DLTensor = unsafe {
        if ffi::PyCapsule_IsValid(p, NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(p, NAME.as_ptr()) as *const DLManagedTensor;
            &(*m).dl_tensor
        } else if ffi::PyCapsule_IsValid(p, NAME_VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(p, NAME_VERSIONED.as_ptr())
                as *const DLManagedTensorVersioned;
            &(*m).dl_tensor
        } else {
            return Err(type_err(
                arg,
                "__dlpack__() returning an unused DLPack capsule",
                cap.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
            ));
        }
    };
    // The capsule stays unconsumed (its name unchanged): its own destructor
    // releases the producer's tensor once `_keep` is dropped, after the op.
    // Checked through __dlpack_device__ already; the capsule must agree.
    check_device(arg, t.device.device_type, t.device.device_id, device)?;
    let ndim = usize::try_from(t.ndim).map_err(|_| value_err(arg, "ndim >= 0", t.ndim))?;
    // SAFETY: DLPack: `shape` holds `ndim` extents, `strides` NULL or `ndim`.
    let (shape, strides) = unsafe {
        let shape = if ndim == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(t.shape, ndim)
        };
        let strides =
            (!t.strides.is_null() && ndim > 0).then(|| std::slice::from_raw_parts(t.strides, ndim));
        (shape, strides)
    };
    let dtype = DType::from_dl(t.dtype)
        .filter(|d| want.contains(d))
        .ok_or_else(|| type_err(arg, names(want), DType::describe_dl(t.dtype)))?;
    let shape: Vec<usize> = shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| value_err(arg, "extents >= 0", d)))
        .collect::<Res<_>>()?;
    if let Some(strides) = strides {
        check_contiguous(arg, &shape, strides)?;
    }
    Ok(Array {
        arg,
        ptr: (t.data as u64).wrapping_add(t.byte_offset),
        shape,
        dtype,
        _keep: Some(cap.unbind()),
    })
}

/// DLPack's stream value for "no synchronisation".
const NO_SYNC: i64 = -1;

/// `sys.modules`, looked up once.
static MODULES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// For a torch tensor on GPU `device` (torch loaded by the caller; this
/// crate never imports it): the tensor to export, detached where it
/// requires grad (the op reads it; `moe_ep.torch` differentiates it, and
/// torch refuses to export it otherwise), and whether its `__dlpack__`
/// must order the op's `stream` after torch's current stream of `device`.
/// Where the op runs on that stream there is nothing to order, and the
/// stream is not passed: torch would otherwise wrap both in Python stream
/// objects, for every tensor of every call, only to find them equal. Its
/// device is read from the tensor (`__dlpack_device__` is Python code in
/// torch). `None`: not a torch tensor, or not on `device` (the DLPack path
/// then names what it is).
fn torch_export<'py>(
    obj: &Bound<'py, PyAny>,
    device: usize,
    stream: u64,
) -> Res<Option<(Bound<'py, PyAny>, bool)>> {
    let py = obj.py();
    let modules = MODULES.get_or_try_init(py, || {
        py.import("sys")?.getattr("modules").map(Bound::unbind)
    })?;
    let Ok(torch) = modules.bind(py).get_item(pyo3::intern!(py, "torch")) else {
        return Ok(None);
    };
    let Ok(tensor) = torch.getattr(pyo3::intern!(py, "Tensor")) else {
        return Ok(None);
    };
    if !obj.is_instance(&tensor)?
        || !obj.getattr(pyo3::intern!(py, "is_cuda"))?.is_truthy()?
        || obj
            .call_method0(pyo3::intern!(py, "get_device"))?
            .extract::<i64>()?
            != device as i64
    {
        return Ok(None);
    }
    let t = if obj
        .getattr(pyo3::intern!(py, "requires_grad"))?
        .is_truthy()?
    {
        obj.call_method0(pyo3::intern!(py, "detach"))?
    } else {
        obj.clone()
    };
    // Older or CPU-only builds lack the raw lookup: order as DLPack says.
    let current = torch
        .getattr(pyo3::intern!(py, "_C"))
        .and_then(|c| c.getattr(pyo3::intern!(py, "_cuda_getCurrentRawStream")))
        .and_then(|f| f.call1((device,)))
        .and_then(|r| r.extract::<u64>());
    Ok(Some((t, current.map_or(true, |c| c != stream))))
}

/// C-contiguous: each stride (in elements) the product of the extents
/// after it; extents of 1 (and empty arrays) may have any stride.
fn check_contiguous(arg: &'static str, shape: &[usize], strides: &[i64]) -> Res<()> {
    if shape.contains(&0) {
        return Ok(());
    }
    let mut expect: i64 = 1;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expect {
            return Err(value_err(
                arg,
                "a C-contiguous array (call .contiguous() first)",
                format!("shape {} with strides {strides:?}", shape_text(shape)),
            ));
        }
        expect = expect.saturating_mul(d as i64);
    }
    Ok(())
}

fn from_cai(
    cai: &Bound<'_, PyAny>,
    arg: &'static str,
    want: &[DType],
    device: usize,
    ctx: Option<&Arc<CudaContext>>,
    stream: u64,
) -> Res<Array> {
    let bad = |what: &str| {
        type_err(
            arg,
            "a valid __cuda_array_interface__ (shape, typestr, data)",
            what,
        )
    };
    let d = cai
        .cast::<PyDict>()
        .map_err(|_| bad("__cuda_array_interface__ is not a dict"))?;
    let shape: Vec<usize> = d
        .get_item("shape")?
        .ok_or_else(|| bad("no shape"))?
        .extract()
        .map_err(|_| bad("shape is not a tuple of ints"))?;
    let typestr: String = d
        .get_item("typestr")?
        .ok_or_else(|| bad("no typestr"))?
        .extract()
        .map_err(|_| bad("typestr is not a str"))?;
    let data = d.get_item("data")?.ok_or_else(|| bad("no data"))?;
    let (ptr, _readonly): (u64, bool) = data
        .extract()
        .map_err(|_| bad("data is not (pointer, read_only)"))?;
    let dtype = DType::from_typestr(&typestr)
        .filter(|d| want.contains(d))
        .ok_or_else(|| {
            type_err(
                arg,
                format!(
                    "{} (bfloat16 has no typestr: pass it through DLPack)",
                    names(want)
                ),
                format!("typestr {typestr:?}"),
            )
        })?;
    if let Some(st) = d.get_item("strides")? {
        if !st.is_none() {
            let bytes: Vec<i64> = st.extract().map_err(|_| bad("strides"))?;
            let elems: Vec<i64> = bytes.iter().map(|b| b / dtype.size() as i64).collect();
            check_contiguous(arg, &shape, &elems)?;
        }
    }
    let Some(ctx) = ctx else {
        return Ok(Array {
            arg,
            ptr,
            shape,
            dtype,
            _keep: None,
        });
    };
    if ptr != 0 {
        let on = stream::device_of_pointer(ctx, ptr)
            .map_err(|e| value_err(arg, "CUDA device memory", e))?;
        match on {
            Some(o) if o == device => {}
            Some(o) => {
                return Err(value_err(
                    arg,
                    format!("CUDA device memory of GPU {device} (the group's)"),
                    format!("memory of GPU {o}"),
                ))
            }
            None => {
                return Err(value_err(
                    arg,
                    format!("CUDA device memory of GPU {device} (the group's)"),
                    "host memory",
                ))
            }
        }
    }
    // v3: the producer's stream, which the op's stream must wait for.
    if let Some(s) = d.get_item("stream")? {
        if !s.is_none() {
            let s: u64 = s.extract().map_err(|_| bad("stream is not an int"))?;
            let s = if s == 1 { 0 } else { s };
            if s != stream {
                stream::wait_for(ctx, stream, s).map_err(Fail::Ep)?;
            }
        }
    }
    Ok(Array {
        arg,
        ptr,
        shape,
        dtype,
        _keep: None,
    })
}

// ---- out -----------------------------------------------------------------

/// What keeps an exported array's memory alive, and orders a consumer's
/// stream for it (pool buffers: `SymmBuffer::ready_on`).
pub(crate) trait Held: Send + Sync {
    fn ready_on(&self, _stream: &Arc<CudaStream>) -> moe_ep::Result<()> {
        Ok(())
    }
}

/// A pool buffer, shared by the arrays exported from it.
pub(crate) struct Symm<T>(pub(crate) moe_ep::SymmBuffer<T>);

impl<T> Held for Symm<T>
where
    moe_ep::SymmBuffer<T>: Send + Sync,
{
    fn ready_on(&self, stream: &Arc<CudaStream>) -> moe_ep::Result<()> {
        self.0.ready_on(stream)
    }
}

/// Anything else that owns device memory (a handle, a batch).
pub(crate) struct Keep<T: Send + Sync>(pub(crate) T);
impl<T: Send + Sync> Held for Keep<T> {}

/// Device memory that the Rust API owns, as a DLPack producer:
/// `torch.from_dlpack(a)` (or cupy's) aliases it, zero copy, and keeps it
/// alive. Made by the ops; not constructible from Python.
#[pyclass(frozen, module = "moe_ep._moe_ep")]
pub struct DeviceArray {
    pub(crate) ptr: u64,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) ctx: Arc<CudaContext>,
    /// The stream the memory's last writer (the op) ran on; `0` legacy.
    pub(crate) stream: u64,
    pub(crate) owner: Arc<dyn Held>,
}

impl DeviceArray {
    pub(crate) fn new(
        ptr: u64,
        shape: Vec<usize>,
        dtype: DType,
        ctx: &Arc<CudaContext>,
        stream: u64,
        owner: Arc<dyn Held>,
    ) -> DeviceArray {
        DeviceArray {
            ptr,
            shape,
            dtype,
            ctx: ctx.clone(),
            stream,
            owner,
        }
    }
}

/// One exported tensor: the managed tensor first (its address is the
/// block's), then what its pointers point into and the owner.
#[repr(C)]
struct Export {
    managed: DLManagedTensor,
    shape: Vec<i64>,
    owner: Arc<dyn Held>,
}

#[repr(C)]
struct ExportVersioned {
    managed: DLManagedTensorVersioned,
    shape: Vec<i64>,
    owner: Arc<dyn Held>,
}

unsafe extern "C" fn delete_export(m: *mut DLManagedTensor) {
    // Called by the consumer (any thread, GIL or not) once: frees the block
    // and drops the owner's reference, never unwinding into C.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: made by Box::into_raw of an Export whose first field is `m`.
        drop(unsafe { Box::from_raw(m as *mut Export) })
    });
}

unsafe extern "C" fn delete_export_versioned(m: *mut DLManagedTensorVersioned) {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: as above, for ExportVersioned.
        drop(unsafe { Box::from_raw(m as *mut ExportVersioned) })
    });
}

/// The capsule's destructor: where no consumer took the tensor (its name
/// is unchanged), the tensor is deleted here.
unsafe extern "C" fn capsule_destructor(cap: *mut ffi::PyObject) {
    // SAFETY: a capsule of ours; the name tells whether it was consumed.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, NAME.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*m).deleter {
                d(m)
            }
        } else if ffi::PyCapsule_IsValid(cap, NAME_VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, NAME_VERSIONED.as_ptr())
                as *mut DLManagedTensorVersioned;
            if let Some(d) = (*m).deleter {
                d(m)
            }
        }
    }
}

fn dl_tensor(a: &DeviceArray, shape: &mut [i64]) -> DLTensor {
    DLTensor {
        data: a.ptr as *mut c_void,
        device: DLDevice {
            device_type: KDL_CUDA,
            device_id: a.ctx.ordinal() as i32,
        },
        ndim: shape.len() as i32,
        dtype: a.dtype.dl(),
        shape: shape.as_mut_ptr(),
        // NULL: compact row-major (DLPack >= 0.2); torch accepts it.
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

impl DeviceArray {
    /// A new DLPack capsule over this array (versioned where asked).
    pub(crate) fn capsule<'py>(
        &self,
        py: Python<'py>,
        versioned: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let shape: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        let (ptr, name) = if versioned {
            let mut b = Box::new(ExportVersioned {
                managed: DLManagedTensorVersioned {
                    version: DLPackVersion { major: 1, minor: 1 },
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_export_versioned),
                    flags: 0,
                    dl_tensor: dl_tensor(self, &mut []),
                },
                shape,
                owner: self.owner.clone(),
            });
            b.managed.dl_tensor = dl_tensor(self, &mut b.shape);
            let p = Box::into_raw(b);
            // SAFETY: just made; manager_ctx points at its own block.
            unsafe { (*p).managed.manager_ctx = p as *mut c_void };
            (p as *mut c_void, NAME_VERSIONED)
        } else {
            let mut b = Box::new(Export {
                managed: DLManagedTensor {
                    dl_tensor: dl_tensor(self, &mut []),
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_export),
                },
                shape,
                owner: self.owner.clone(),
            });
            b.managed.dl_tensor = dl_tensor(self, &mut b.shape);
            let p = Box::into_raw(b);
            // SAFETY: as above.
            unsafe { (*p).managed.manager_ctx = p as *mut c_void };
            (p as *mut c_void, NAME)
        };
        // SAFETY: a valid pointer and a static name; on failure the block
        // is freed here (no capsule owns it).
        unsafe {
            let cap = ffi::PyCapsule_New(ptr, name.as_ptr(), Some(capsule_destructor));
            if cap.is_null() {
                if versioned {
                    delete_export_versioned(ptr as *mut DLManagedTensorVersioned);
                } else {
                    delete_export(ptr as *mut DLManagedTensor);
                }
                return Err(PyErr::fetch(py));
            }
            Ok(Bound::from_owned_ptr(py, cap))
        }
    }

    /// Orders `consumer` (a raw stream; `None`/-1: not at all) after the
    /// op that wrote the array, and pool buffers' reuse after the consumer.
    pub(crate) fn order_for(&self, consumer: Option<i64>) -> moe_ep::Result<()> {
        let Some(c) = consumer.filter(|&c| c != -1) else {
            return Ok(());
        };
        let c = match c {
            1 => 0,
            c if c < 0 => return Err(Error::arg("stream", "a CUDA stream handle", c)),
            c => c as u64,
        };
        if c != self.stream {
            stream::wait_for(&self.ctx, c, self.stream)?;
        }
        // SAFETY: the consumer's stream, which it keeps alive while it uses
        // the array (DLPack's contract); wrapped without taking it over.
        let s = unsafe { self.ctx.wrap_borrowed_stream(c as sys::CUstream) };
        self.owner.ready_on(&s)
    }
}

#[pymethods]
impl DeviceArray {
    /// DLPack: a capsule of this array for a consumer that will use it on
    /// `stream` (ordered after the op that wrote it). Versioned (DLPack 1.1)
    /// when `max_version` is at least (1, 0).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guarded(py, || {
            if let Some((kind, id)) = dl_device {
                if (kind, id) != (KDL_CUDA, self.ctx.ordinal() as i32) {
                    return Err(Fail::Py(pyo3::exceptions::PyBufferError::new_err(
                        "moe_ep arrays are exported only on their own GPU (no copy)",
                    )));
                }
            }
            if copy == Some(true) {
                return Err(Fail::Py(pyo3::exceptions::PyBufferError::new_err(
                    "moe_ep arrays are exported without a copy (copy=True refused)",
                )));
            }
            self.order_for(stream).map_err(Fail::Ep)?;
            Ok(self.capsule(py, max_version.is_some_and(|v| v.0 >= 1))?)
        })
    }

    /// DLPack: `(kDLCUDA, ordinal)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDL_CUDA, self.ctx.ordinal() as i32)
    }

    /// The shape, as a tuple.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The dtype's name (torch's: `bfloat16`, `float32`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The device address of the first element.
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.ptr
    }

    /// The GPU's ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceArray(shape={}, dtype={}, device=cuda:{}, data_ptr={:#x})",
            shape_text(&self.shape),
            self.dtype.name(),
            self.ctx.ordinal(),
            self.ptr
        )
    }
}

/// For the CPU tests: `obj` read as an argument of an op on GPU `device`
/// and raw stream `stream` (no GPU needed: without a context no driver call
/// is made), returning `(data_ptr, shape, dtype)`.
#[pyfunction]
#[pyo3(signature = (obj, arg="x", dtypes=vec!["bfloat16".to_string()], device=0, shape=None, stream=0))]
pub(crate) fn _check_array(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    arg: &str,
    dtypes: Vec<String>,
    device: usize,
    shape: Option<Vec<Option<usize>>>,
    stream: u64,
) -> PyResult<(u64, Vec<usize>, &'static str)> {
    guarded(py, || {
        let arg: &'static str = Box::leak(arg.to_string().into_boxed_str());
        let want: Vec<DType> = dtypes
            .iter()
            .map(|d| DType::from_name("dtypes", d))
            .collect::<Res<_>>()?;
        let a = import(obj, arg, &want, device, None, stream)?;
        if let Some(shape) = shape {
            a.expect_shape(&shape, "an array of the shape given")?;
        }
        Ok((a.ptr, a.shape.clone(), a.dtype.name()))
    })
}
