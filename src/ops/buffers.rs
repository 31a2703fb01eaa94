//! The device buffers the ops take and return: [`DeviceRegion`] (inputs: any
//! cudarc slice or view, a [`SymmBuffer`] or its views) and
//! [`DeviceRegionMut`] (outputs, taken as `&mut`), the routing ([`TopkIdx`]), the
//! receive buffers of a dispatch ([`DispatchOut`], [`Dispatched`],
//! [`RecvBuf`]), and the host-side checks of their lengths and of their
//! peers' mappings.
//!
//! Tests: `tests/gpu_intranode.rs` (zero copy into caller buffers, a plain
//! buffer refused with `Error::NotSymmetric`); `tests/gpu_symm.rs` (pool
//! buffers as regions).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceSlice};
use half::bf16;

use super::abi::MAX_RANKS;
use crate::error::{Error, Result};
use crate::symm::{SymmBuffer, SymmView, SymmViewMut};

/// A region of device memory holding `len()` elements of `T` that the ops
/// may read: a cudarc slice or view, a [`SymmBuffer`] or one of its views.
/// Ops take their inputs through it.
///
/// # Safety
/// `device_ptr()` must be the address of `len()` elements of `T` of device
/// memory (of the context the region was made in) that stay allocated, and
/// are not written by anyone else outside stream order, as long as the
/// region is borrowed. The kernels read exactly that: safe code cannot aim
/// them elsewhere, because only this crate implements the trait for
/// regions it can vouch for (cudarc's slices and views, symmetric buffers).
pub unsafe trait DeviceRegion<T> {
    /// Device address of the first element.
    fn device_ptr(&self) -> u64;
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The stream the region's memory is ordered on, if it has one
    /// (cudarc's slices and views): an op on another stream waits for the
    /// work enqueued there first, and that stream waits for the op's.
    fn home_stream(&self) -> Option<&Arc<CudaStream>> {
        None
    }
    /// Called by every op that takes the region, with the op's stream,
    /// before its launch: symmetric buffers order their reuse by it
    /// ([`SymmBuffer::ready_on`](crate::symm::SymmBuffer::ready_on)).
    #[doc(hidden)]
    fn used_on(&self, _stream: &Arc<CudaStream>) -> Result<()> {
        Ok(())
    }
    /// Size in bytes, or an error naming `arg` when it does not fit a `usize`.
    fn num_bytes_checked(&self, arg: &'static str) -> Result<usize> {
        self.len()
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::arg(arg, "a size in bytes that fits usize", self.len()))
    }
}

/// A [`DeviceRegion`] the ops may also write: outputs are taken as
/// `&mut dyn DeviceRegionMut`, so an output cannot alias an input or be
/// shared with other code while the op is enqueued.
///
/// # Safety
/// As [`DeviceRegion`], and the memory must be writable through the region
/// while it is borrowed mutably.
pub unsafe trait DeviceRegionMut<T>: DeviceRegion<T> {}

// SAFETY: a live pool or window allocation of `len` elements.
unsafe impl<T> DeviceRegion<T> for SymmBuffer<T> {
    fn device_ptr(&self) -> u64 {
        SymmBuffer::device_ptr(self)
    }
    fn used_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.ready_on(stream)
    }
    fn len(&self) -> usize {
        SymmBuffer::len(self)
    }
}
// SAFETY: as above; `&mut SymmBuffer` is exclusive.
unsafe impl<T> DeviceRegionMut<T> for SymmBuffer<T> {}

// SAFETY: the view lies inside its buffer (checked when it was made).
unsafe impl<T> DeviceRegion<T> for SymmView<'_, T> {
    fn device_ptr(&self) -> u64 {
        SymmView::device_ptr(self)
    }
    fn used_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.ready_on(stream)
    }
    fn len(&self) -> usize {
        SymmView::len(self)
    }
}
// SAFETY: as above.
unsafe impl<T> DeviceRegion<T> for SymmViewMut<'_, T> {
    fn device_ptr(&self) -> u64 {
        SymmViewMut::device_ptr(self)
    }
    fn used_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.ready_on(stream)
    }
    fn len(&self) -> usize {
        SymmViewMut::len(self)
    }
}
// SAFETY: the view borrows its buffer mutably.
unsafe impl<T> DeviceRegionMut<T> for SymmViewMut<'_, T> {}

// SAFETY: cudarc's allocation of `len` elements, alive while borrowed.
unsafe impl<T> DeviceRegion<T> for CudaSlice<T> {
    fn device_ptr(&self) -> u64 {
        let (p, _sync) = DevicePtr::device_ptr(self, self.stream());
        p
    }
    fn home_stream(&self) -> Option<&Arc<CudaStream>> {
        Some(self.stream())
    }
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
}
// SAFETY: `&mut CudaSlice` is exclusive.
unsafe impl<T> DeviceRegionMut<T> for CudaSlice<T> {}

// SAFETY: a view into a live cudarc allocation.
unsafe impl<T> DeviceRegion<T> for CudaView<'_, T> {
    fn device_ptr(&self) -> u64 {
        let (p, _sync) = DevicePtr::device_ptr(self, self.stream());
        p
    }
    fn home_stream(&self) -> Option<&Arc<CudaStream>> {
        Some(self.stream())
    }
    fn len(&self) -> usize {
        CudaView::len(self)
    }
}

// SAFETY: a mutable view into a live cudarc allocation.
unsafe impl<T> DeviceRegion<T> for CudaViewMut<'_, T> {
    fn device_ptr(&self) -> u64 {
        let (p, _sync) = DevicePtr::device_ptr(self, self.stream());
        p
    }
    fn home_stream(&self) -> Option<&Arc<CudaStream>> {
        Some(self.stream())
    }
    fn len(&self) -> usize {
        CudaViewMut::len(self)
    }
}
// SAFETY: the view borrows its allocation mutably.
unsafe impl<T> DeviceRegionMut<T> for CudaViewMut<'_, T> {}

/// `topk_idx [T, K]` on the device, i32 or i64; -1 = not routed.
pub enum TopkIdx<'a> {
    I32(&'a dyn DeviceRegion<i32>),
    I64(&'a dyn DeviceRegion<i64>),
}

impl TopkIdx<'_> {
    /// Device address and length in elements.
    pub(crate) fn ptr_len(&self) -> (u64, usize) {
        match self {
            TopkIdx::I32(r) => (r.device_ptr(), r.len()),
            TopkIdx::I64(r) => (r.device_ptr(), r.len()),
        }
    }
}

/// A receive buffer: the caller's (borrowed mutably; symmetric memory of the
/// group's communicator) or one the pool gave this call.
pub enum RecvBuf<'a, T> {
    Caller(&'a mut dyn DeviceRegionMut<T>),
    Pool(SymmBuffer<T>),
}

// SAFETY: either a caller's region (its own guarantee) or a pool buffer.
unsafe impl<T> DeviceRegion<T> for RecvBuf<'_, T> {
    fn device_ptr(&self) -> u64 {
        match self {
            RecvBuf::Caller(b) => b.device_ptr(),
            RecvBuf::Pool(b) => b.device_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            RecvBuf::Caller(b) => b.len(),
            RecvBuf::Pool(b) => b.len(),
        }
    }
    fn home_stream(&self) -> Option<&Arc<CudaStream>> {
        match self {
            RecvBuf::Caller(b) => b.home_stream(),
            RecvBuf::Pool(_) => None,
        }
    }
    fn used_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        match self {
            RecvBuf::Caller(b) => b.used_on(stream),
            RecvBuf::Pool(b) => b.ready_on(stream),
        }
    }
}

// SAFETY: as above; both are held exclusively.
unsafe impl<T> DeviceRegionMut<T> for RecvBuf<'_, T> {}

impl<T> RecvBuf<'_, T> {
    /// True when this is the caller's buffer (zero copy into it).
    pub fn is_callers(&self) -> bool {
        matches!(self, RecvBuf::Caller(_))
    }
}

/// Optional caller-supplied receive buffers (symmetric: from the group's pool
/// or a wrapped window, allocated collectively). `None` takes them from the pool.
#[derive(Default)]
pub struct DispatchOut<'a> {
    /// `[recv_capacity, H]` bf16.
    pub recv_tokens: Option<&'a mut dyn DeviceRegionMut<bf16>>,
    /// Rank-major `[recv_capacity, K]`, expert-major `[recv_capacity]` f32.
    pub recv_topk_weights: Option<&'a mut dyn DeviceRegionMut<f32>>,
}

/// What dispatch returns. Rows past the handle's `recv_rows` are untouched.
pub struct Dispatched<'a> {
    /// `[rows, H]` received tokens in the handle's layout.
    pub tokens: RecvBuf<'a, bf16>,
    /// Rank-major `[rows, K]` (0 for experts not on this rank), expert-major `[rows]`.
    pub topk_weights: RecvBuf<'a, f32>,
    /// Local expert ids, same shape as the weights; -1 = not here / padding.
    pub topk_idx: SymmBuffer<i32>,
    /// `[rows, 2]` (source rank, source token); (-1, -1) on padding.
    pub src: SymmBuffer<i32>,
}

/// The block scales of fp8 rows, row-major, one row of scales per token row
/// (`H / 32` bytes a row either way); forwarded as given.
pub enum Fp8Scales<'a> {
    /// MXFP8 (TransformerEngine): one e8m0 exponent byte per 32 values,
    /// `[T, H / 32]` u8.
    E8m0Per32(&'a dyn DeviceRegion<u8>),
    /// One f32 per 128 values (DeepEP's recipe), `[T, H / 128]` f32.
    F32Per128(&'a dyn DeviceRegion<f32>),
}

/// The fp8 rows of [`EpGroup::dispatch_fp8`](crate::EpGroup::dispatch_fp8):
/// e4m3 codes and their block scales (`x ≈ e4m3(code) * scale` of its block).
pub struct Fp8Rows<'a> {
    /// `[T, H]` e4m3 codes, 16-byte aligned.
    pub codes: &'a dyn DeviceRegion<u8>,
    /// The codes' block scales.
    pub scales: Fp8Scales<'a>,
}

/// A caller's receive buffer for fp8 scales (symmetric, as every receive
/// buffer), of the kind the dispatch sends.
pub enum RecvScalesOut<'a> {
    /// `[recv_capacity, H / 32]` u8.
    E8m0Per32(&'a mut dyn DeviceRegionMut<u8>),
    /// `[recv_capacity, H / 128]` f32.
    F32Per128(&'a mut dyn DeviceRegionMut<f32>),
}

/// Received fp8 scales, row `i` beside received row `i`.
pub enum RecvScales<'a> {
    /// `[rows, H / 32]` e8m0 bytes.
    E8m0Per32(RecvBuf<'a, u8>),
    /// `[rows, H / 128]` f32.
    F32Per128(RecvBuf<'a, f32>),
}

impl RecvScales<'_> {
    /// Device address of the first scale.
    pub fn device_ptr(&self) -> u64 {
        match self {
            RecvScales::E8m0Per32(b) => b.device_ptr(),
            RecvScales::F32Per128(b) => b.device_ptr(),
        }
    }
}

/// Optional caller-supplied receive buffers of an fp8 dispatch (symmetric).
/// `None` takes them from the pool.
#[derive(Default)]
pub struct DispatchOutFp8<'a> {
    /// `[recv_capacity, H]` u8 e4m3 codes.
    pub recv_codes: Option<&'a mut dyn DeviceRegionMut<u8>>,
    /// The scales, of the kind sent.
    pub recv_scales: Option<RecvScalesOut<'a>>,
    /// Rank-major `[recv_capacity, K]`, expert-major `[recv_capacity]` f32.
    pub recv_topk_weights: Option<&'a mut dyn DeviceRegionMut<f32>>,
}

/// What [`EpGroup::dispatch_fp8`](crate::EpGroup::dispatch_fp8) returns;
/// as [`Dispatched`], with the rows as fp8 codes and their scales.
pub struct DispatchedFp8<'a> {
    /// `[rows, H]` e4m3 codes in the handle's layout.
    pub codes: RecvBuf<'a, u8>,
    /// The rows' scales, beside them (same row index).
    pub scales: RecvScales<'a>,
    /// Rank-major `[rows, K]` (0 for experts not on this rank), expert-major `[rows]`.
    pub topk_weights: RecvBuf<'a, f32>,
    /// Local expert ids, same shape as the weights; -1 = not here / padding.
    pub topk_idx: SymmBuffer<i32>,
    /// `[rows, 2]` (source rank, source token); (-1, -1) on padding.
    pub src: SymmBuffer<i32>,
}

/// The gradients of a dispatch backward
/// ([`EpGroup::dispatch_backward`](crate::EpGroup::dispatch_backward)): the
/// received rows' gradients in, the tokens' gradients out.
pub struct DispatchBackwardArgs<'a> {
    /// `[recv_capacity, H]` bf16: the gradient of the received tokens, in
    /// the handle's layout.
    pub grad_recv_tokens: &'a dyn DeviceRegion<bf16>,
    /// The gradient of the received weights (as the dispatch wrote them), or
    /// `None`; given together with `grad_topk_weights`.
    pub grad_recv_topk_weights: Option<&'a dyn DeviceRegion<f32>>,
    /// `[T, H]` bf16 out: each token's gradient, summed over its copies.
    pub grad_tokens: &'a mut dyn DeviceRegionMut<bf16>,
    /// `[T, K]` f32 out: the gradient of each token's top-k weights, or `None`.
    pub grad_topk_weights: Option<&'a mut dyn DeviceRegionMut<f32>>,
}

/// One device address per rank (the same buffer as mapped here).
pub(crate) type Peers = [u64; MAX_RANKS];

/// Refuses a buffer shorter than `want` elements, naming `arg` and `what`
/// it should hold.
pub(crate) fn check_len(arg: &'static str, got: usize, want: usize, what: &str) -> Result<()> {
    if got < want {
        return Err(Error::arg(
            arg,
            format!("at least {want} elements ({what})"),
            format!("{got} elements"),
        ));
    }
    Ok(())
}

/// Byte alignment the kernels need of a buffer of token rows (16-byte
/// vectors and bulk copies).
pub(crate) const ROW_ALIGN: usize = 16;
