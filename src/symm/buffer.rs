//! A buffer of the pool ([`SymmBuffer`]) and its views ([`SymmView`],
//! [`SymmViewMut`]): the same offset of the same segment on every rank,
//! the peers' copies, and the stream order of its use and release.
//!
//! Tests: `tests/gpu_symm.rs`.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

use super::ranges::{capturing, Pending, PoolInner};
use super::segment::Segment;
use crate::error::{Error, Result};

/// `len` elements of `T` in symmetric memory: the same offset of the same
/// segment on every rank. Returned to its pool on drop.
pub struct SymmBuffer<T> {
    pub(crate) seg: Arc<Segment>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) bytes: usize,
    pub(crate) pool: Option<Arc<PoolInner>>,
    /// Stream order of the range (see the module's doc).
    pub(crate) order: Mutex<Order>,
    pub(crate) _t: PhantomData<T>,
}

/// What a buffer's uses wait for and who used it.
#[derive(Default)]
pub(crate) struct Order {
    /// Work of the range's earlier buffers: every stream waits for it
    /// before its first use of this one.
    pub(crate) after: Pending,
    /// The streams it was used on (each waited for `after`).
    pub(crate) used_on: Vec<Arc<CudaStream>>,
}

impl<T> SymmBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Size in bytes of the elements.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
    /// Byte offset inside the segment (equal on every rank).
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// This rank's device address.
    pub fn device_ptr(&self) -> u64 {
        self.seg.base + self.offset as u64
    }
    /// Rank `r`'s copy, mapped here; `None` when not load/store reachable.
    pub fn peer_ptr(&self, r: usize) -> Option<u64> {
        self.seg.peer_base(r).map(|b| b + self.offset as u64)
    }
    /// The segment it lives in.
    pub fn segment(&self) -> &Arc<Segment> {
        &self.seg
    }

    /// Orders `stream` for a use of this buffer: its first use waits for
    /// the work that used the range before (when the pool handed out a
    /// range an earlier buffer had), and dropping the buffer orders the
    /// range's next user after what `stream` has enqueued by then. Call it
    /// before using the buffer in your own kernels on `stream`; the crate's
    /// ops and copies call it themselves. (Not while `stream` captures a
    /// graph: keep buffers a graph uses alive while it may run.)
    pub fn ready_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if capturing(stream) {
            return Ok(());
        }
        let mut o = self.order.lock().unwrap_or_else(|p| p.into_inner());
        if o.used_on
            .iter()
            .any(|s| s.cu_stream() == stream.cu_stream())
        {
            return Ok(());
        }
        for e in &o.after.0 {
            stream.wait(e).map_err(Error::cuda("cuStreamWaitEvent"))?;
        }
        o.used_on.push(stream.clone());
        Ok(())
    }
}

impl<T: cudarc::driver::DeviceRepr> SymmBuffer<T> {
    /// Copies `src` into this rank's copy from element 0, on `stream`, and
    /// waits for it (the stream is drained first: see
    /// `Communicator::virtual_world` on copies from pageable memory).
    pub fn copy_from_host(&mut self, stream: &Arc<CudaStream>, src: &[T]) -> Result<()> {
        self.check_fits("src", src.len())?;
        self.ready_on(stream)?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        // SAFETY: src.len() elements fit this buffer (checked above).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.device_ptr(), src, stream.cu_stream())
        }
        .map_err(Error::cuda("cuMemcpyHtoDAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))
    }

    /// Copies this rank's first `dst.len()` elements to `dst` (drains
    /// `stream` first, then waits for the copy).
    pub fn copy_to_host(&self, stream: &Arc<CudaStream>, dst: &mut [T]) -> Result<()> {
        self.check_fits("dst", dst.len())?;
        self.ready_on(stream)?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        // SAFETY: dst.len() elements fit this buffer (checked above).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(dst, self.device_ptr(), stream.cu_stream())
        }
        .map_err(Error::cuda("cuMemcpyDtoHAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))
    }

    /// Copies all of `src` (a cudarc slice or view) into this rank's copy
    /// from element 0, enqueued on `stream`.
    pub fn copy_from_device<Src: cudarc::driver::DevicePtr<T>>(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &Src,
    ) -> Result<()> {
        let n = src.len();
        self.check_fits("src", n)?;
        self.ready_on(stream)?;
        let (ptr, _guard) = src.device_ptr(stream);
        // SAFETY: n elements fit this buffer (checked above); `src` is
        // ordered on `stream` by its guard until the copy is enqueued.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                self.device_ptr(),
                ptr,
                n * std::mem::size_of::<T>(),
                stream.cu_stream(),
            )
        }
        .map_err(Error::cuda("cuMemcpyDtoDAsync"))
    }
}

impl<T: cudarc::driver::DeviceRepr> SymmBuffer<T> {
    /// Copies this rank's first `dst.len()` elements into `dst` (a cudarc
    /// slice or mutable view), enqueued on `stream`.
    pub fn copy_to_device<Dst: cudarc::driver::DevicePtrMut<T>>(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut Dst,
    ) -> Result<()> {
        let n = dst.len();
        self.check_fits("dst", n)?;
        self.ready_on(stream)?;
        let (ptr, _guard) = dst.device_ptr_mut(stream);
        // SAFETY: n elements of this buffer exist (checked above); `dst` is
        // ordered on `stream` by its guard until the copy is enqueued.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                ptr,
                self.device_ptr(),
                n * std::mem::size_of::<T>(),
                stream.cu_stream(),
            )
        }
        .map_err(Error::cuda("cuMemcpyDtoDAsync"))
    }
}

impl<T> SymmBuffer<T> {
    fn check_fits(&self, arg: &'static str, n: usize) -> Result<()> {
        if n > self.len {
            return Err(Error::arg(
                arg,
                format!("at most {} elements (the buffer's length)", self.len),
                format!("{n} elements"),
            ));
        }
        Ok(())
    }

    fn check_range(&self, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::arg(
                "range",
                format!("a range inside 0..{}", self.len),
                format!("{}..{}", range.start, range.end),
            ));
        }
        Ok(())
    }

    /// Elements `range` of this buffer, as a region the ops can read. The
    /// same range of every rank's copy: symmetric too (zero copy works on
    /// views).
    pub fn view(&self, range: Range<usize>) -> Result<SymmView<'_, T>> {
        self.check_range(&range)?;
        Ok(SymmView { buf: self, range })
    }

    /// Elements `range` of this buffer, as a region the ops can write.
    pub fn view_mut(&mut self, range: Range<usize>) -> Result<SymmViewMut<'_, T>> {
        self.check_range(&range)?;
        Ok(SymmViewMut { buf: self, range })
    }
}

/// Elements of a [`SymmBuffer`] ([`SymmBuffer::view`]).
pub struct SymmView<'a, T> {
    pub(crate) buf: &'a SymmBuffer<T>,
    pub(crate) range: Range<usize>,
}

/// Elements of a [`SymmBuffer`] borrowed mutably ([`SymmBuffer::view_mut`]).
pub struct SymmViewMut<'a, T> {
    pub(crate) buf: &'a mut SymmBuffer<T>,
    pub(crate) range: Range<usize>,
}

macro_rules! view_methods {
    ($ty:ident) => {
        impl<T> $ty<'_, T> {
            /// Device address of the first element (this rank's copy).
            pub fn device_ptr(&self) -> u64 {
                self.buf.device_ptr() + (self.range.start * std::mem::size_of::<T>()) as u64
            }
            /// Number of elements.
            pub fn len(&self) -> usize {
                self.range.len()
            }
            /// True when empty.
            pub fn is_empty(&self) -> bool {
                self.range.is_empty()
            }
            /// [`SymmBuffer::ready_on`] of the viewed buffer.
            pub fn ready_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
                self.buf.ready_on(stream)
            }
        }
    };
}
view_methods!(SymmView);
view_methods!(SymmViewMut);

impl<T> Drop for SymmBuffer<T> {
    /// Returns the range to the pool, ordered after the work enqueued so
    /// far on every stream it was used on.
    fn drop(&mut self) {
        let Some(pool) = &self.pool else { return };
        let o = std::mem::take(self.order.get_mut().unwrap_or_else(|p| p.into_inner()));
        let mut after = o.after;
        for s in o.used_on.iter().filter(|s| !capturing(s)) {
            match s.record_event(None) {
                Ok(e) => after.0.push(Arc::new(e)),
                // Without the event the range would be reused unordered:
                // wait for the stream instead.
                Err(_) => {
                    if let Err(e) = s.synchronize() {
                        tracing::warn!("releasing a pool buffer: {e}");
                    }
                }
            }
        }
        after.0.retain(|e| !e.is_complete());
        pool.release(&self.seg, self.offset, self.bytes, after);
    }
}
