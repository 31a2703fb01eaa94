//! Buffers: [`CRegion`], a caller's `(device pointer, element count)` as
//! the Rust API's [`DeviceRegion`] / [`DeviceRegionMut`]; `topk_idx` of
//! either index type; the check that no output of a call overlaps another
//! of its buffers; the pool buffers (`moe_ep_buffer_t`) and a dispatch's
//! receive buffers (`moe_ep_dispatched_t`); and the symmetric-memory calls
//! (`moe_ep_pool_alloc`, `moe_ep_buffer_free`, `moe_ep_buffer_get`,
//! `moe_ep_is_symm_backed`), with the caller's own windows (ABI 4:
//! `moe_ep_pool_wrap_window`, on virtual ranks `moe_ep_pool_wrap_device`)
//! and ranges of a buffer as any op's argument (`moe_ep_buffer_range`).
//!
//! A range of a wrapped window is accepted by every op as any buffer is: the
//! ops take `(pointer, length)`, and one that lies inside a registered
//! window of the group's communicator (`is_symm_backed`) is symmetric
//! memory, located by its window and offset, which the kernels compare
//! between ranks before they touch a peer's copy.

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;

use moe_ep::bf16;
use moe_ep::error::{Error, Result};
use moe_ep::ops::{DeviceRegion, DeviceRegionMut, RecvBuf, TopkIdx};
use moe_ep::symm::SymmBuffer;

use crate::group::CGroup;
use crate::status::{
    boxed, ffi, obj, out_ptr, unboxed, Status, MOE_EP_DTYPE_BF16, MOE_EP_DTYPE_F32,
    MOE_EP_DTYPE_I32, MOE_EP_DTYPE_I64, MOE_EP_DTYPE_U8,
};
use crate::structs::{CBuf, CBufMut};

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
    pub(crate) fn new(arg: &'static str, ptr: *const c_void, len: usize) -> Result<CRegion<T>> {
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
    pub(crate) fn opt(
        arg: &'static str,
        ptr: *const c_void,
        len: usize,
    ) -> Result<Option<CRegion<T>>> {
        if ptr.is_null() && len == 0 {
            return Ok(None);
        }
        Self::new(arg, ptr, len).map(Some)
    }
    pub(crate) fn span(&self, arg: &'static str) -> Span {
        (arg, self.ptr, (self.len * std::mem::size_of::<T>()) as u64)
    }
}

/// `topk_idx` of a `topk_idx_dtype`.
pub(crate) enum CTopkIdx {
    I32(CRegion<i32>),
    I64(CRegion<i64>),
}

impl CTopkIdx {
    pub(crate) fn new(b: CBuf, dtype: u32) -> Result<CTopkIdx> {
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
    pub(crate) fn get(&self) -> TopkIdx<'_> {
        match self {
            CTopkIdx::I32(r) => TopkIdx::I32(r),
            CTopkIdx::I64(r) => TopkIdx::I64(r),
        }
    }
}

/// A buffer's name, address and size in bytes.
pub(crate) type Span = (&'static str, u64, u64);

pub(crate) fn span_of<T>(arg: &'static str, r: &Option<CRegion<T>>) -> Option<Span> {
    r.as_ref().map(|r| r.span(arg))
}

/// Refuses an output that overlaps an input or another output, naming it.
pub(crate) fn disjoint(outs: &[Option<Span>], ins: &[Option<Span>]) -> Result<()> {
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

/// `moe_ep_buffer_t`: a pool buffer of one element type.
pub enum CBuffer {
    Bf16(SymmBuffer<bf16>),
    F32(SymmBuffer<f32>),
    I32(SymmBuffer<i32>),
    I64(SymmBuffer<i64>),
    U8(SymmBuffer<u8>),
}
/// `moe_ep_dispatched_t`: the receive buffers of a dispatch (bf16 rows, or
/// fp8 codes and their scales); the pool's are owned here, the caller's
/// only named.
pub struct CDispatched {
    /// bf16 rows, or an fp8 dispatch's codes.
    pub(crate) tokens: Kept,
    /// An fp8 dispatch's scales and their `moe_ep_fp8_scales_t`.
    pub(crate) scales: Option<(Kept, u32)>,
    pub(crate) topk_weights: Kept,
    pub(crate) topk_idx: SymmBuffer<i32>,
    pub(crate) src: SymmBuffer<i32>,
}

/// A receive buffer's address and length, and the pool buffer if it is one
/// (of any element type: kept only to be dropped with the result).
pub(crate) struct Kept {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    _pool: Option<Box<dyn std::any::Any>>,
}

impl Kept {
    pub(crate) fn of<T: 'static>(b: RecvBuf<'_, T>) -> Kept {
        let (ptr, len) = (b.device_ptr(), b.len());
        let pool = match b {
            RecvBuf::Pool(s) => Some(Box::new(s) as Box<dyn std::any::Any>),
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
    /// The buffer's size in bytes.
    fn bytes(&self) -> usize {
        match self {
            CBuffer::Bf16(b) => b.num_bytes(),
            CBuffer::F32(b) => b.num_bytes(),
            CBuffer::I32(b) => b.num_bytes(),
            CBuffer::I64(b) => b.num_bytes(),
            CBuffer::U8(b) => b.num_bytes(),
        }
    }
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

/// Bytes of one element of `dtype`, or an error naming `arg`.
pub(crate) fn dtype_bytes(arg: &'static str, dtype: c_int) -> Result<usize> {
    Ok(match dtype {
        MOE_EP_DTYPE_BF16 => 2,
        MOE_EP_DTYPE_F32 | MOE_EP_DTYPE_I32 => 4,
        MOE_EP_DTYPE_I64 => 8,
        MOE_EP_DTYPE_U8 => 1,
        d => return Err(Error::arg(arg, "a moe_ep_dtype_t (1..=5)", d)),
    })
}

/// `len` elements of `elem` bytes starting `offset` bytes into a buffer of
/// `bytes` bytes at `ptr`: the range's address, or why not (naming
/// `byte_offset` or `len`).
pub(crate) fn range_in(
    (ptr, bytes): (u64, usize),
    offset: u64,
    elem: usize,
    len: usize,
) -> Result<u64> {
    if !offset.is_multiple_of(elem as u64) {
        return Err(Error::arg(
            "byte_offset",
            format!("a multiple of the element's {elem} bytes"),
            offset,
        ));
    }
    let end = len
        .checked_mul(elem)
        .and_then(|n| offset.checked_add(n as u64));
    match end {
        Some(end) if end <= bytes as u64 => Ok(ptr + offset),
        _ => Err(Error::arg(
            "len",
            format!("a range inside the buffer's {bytes} bytes"),
            format!("{len} elements of {elem} bytes from byte {offset}"),
        )),
    }
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_pool_wrap_window(
    group: *const CGroup,
    window: *mut c_void,
    base: *mut c_void,
    bytes: usize,
    out: *mut *mut CBuffer,
) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        if g.comm().is_virtual() {
            // Every rank of a virtual world is: refused alike, before the
            // collective.
            return Err(Error::arg(
                "window",
                "an NCCL window of a group of NCCL ranks (virtual ranks have none: wrap a \
                 device buffer with moe_ep_pool_wrap_device)",
                "a window given to a group of virtual ranks",
            ));
        }
        // SAFETY: the header's contract: `window` is a live symmetric window
        // (Segment::wrap checks that it is one of the group's communicator
        // and that its copy here is the memory at `base`) of `bytes` bytes
        // here, registered until the group is destroyed.
        let b = unsafe { g.pool().wrap_window::<u8>(window, base as u64, bytes) }?;
        unsafe { *out = boxed(CBuffer::U8(b)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_pool_wrap_device(
    group: *const CGroup,
    base: *mut c_void,
    bytes: usize,
    out: *mut *mut CBuffer,
) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        if !g.comm().is_virtual() {
            return Err(Error::arg(
                "group",
                "a group of virtual ranks (on NCCL ranks, register an NCCL window and wrap it \
                 with moe_ep_pool_wrap_window)",
                "a group of NCCL ranks",
            ));
        }
        // SAFETY: the header's contract: `bytes` of device memory of the
        // group's GPU at `base`, allocated until the group is destroyed.
        let b = unsafe { g.pool().wrap_device::<u8>(base as u64, bytes) }?;
        unsafe { *out = boxed(CBuffer::U8(b)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_buffer_range(
    buffer: *const CBuffer,
    byte_offset: u64,
    dtype: c_int,
    len: usize,
    out: *mut CBufMut,
) -> Status {
    ffi(|| {
        let b = unsafe { obj(buffer, "buffer") }?;
        let out = out_ptr(out, "out")?;
        let elem = dtype_bytes("dtype", dtype)?;
        let at = range_in((b.ptr_len().0, b.bytes()), byte_offset, elem, len)?;
        unsafe { *out = CBufMut::of(at, len) };
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A range of a buffer: inside it, its offset a multiple of the element.
    #[test]
    fn ranges_of_a_buffer() {
        let buf = (0x10000u64, 4096usize);
        assert_eq!(range_in(buf, 0, 2, 2048).unwrap(), 0x10000);
        assert_eq!(range_in(buf, 128, 2, 1984).unwrap(), 0x10080);
        assert_eq!(range_in(buf, 4096, 4, 0).unwrap(), 0x11000);
        let arg = |r: Result<u64>| match r {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("{other:?}"),
        };
        assert_eq!(arg(range_in(buf, 130, 4, 1)), "byte_offset");
        assert_eq!(arg(range_in(buf, 128, 2, 1985)), "len");
        assert_eq!(arg(range_in(buf, 0, 8, usize::MAX)), "len");
        assert_eq!(arg(range_in(buf, u64::MAX - 7, 8, 2)), "len");
        assert_eq!(dtype_bytes("dtype", MOE_EP_DTYPE_BF16).unwrap(), 2);
        assert_eq!(dtype_bytes("dtype", MOE_EP_DTYPE_I64).unwrap(), 8);
        assert!(dtype_bytes("dtype", 0).is_err());
    }
}
