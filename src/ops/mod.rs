//! Layout, dispatch, combine and their backward passes on the NVLink path.
//!
//! ```ignore
//! let group = EpGroup::new(&comm, GroupConfig::new(256, 7168, 4096))?;     // collective
//! let handle = group.layout(&stream, TopkIdx::I64(&topk_idx), 8, RecvLayout::RankMajor)?;
//! let recv = group.dispatch(&stream, &handle, &x, &topk_weights, DispatchOut::default())?;
//! // ... experts run on recv.tokens() ...
//! group.combine(&stream, &handle, &expert_out, None, &mut out)?;
//! ```
//!
//! Every op is enqueued on the caller's stream and never synchronises the
//! host, except [`Handle::host_counts`]. Problems only the device can see
//! (receive capacity exceeded, an expert id out of range, a peer that never
//! answers) are recorded in host-mapped memory by the kernels and reported as
//! an [`Error`] by the next call on the group (or by [`EpGroup::check`]).

pub mod abi;
mod group;
mod launch;
mod residency;

pub use group::{EpGroup, GroupConfig, Mode};
pub use launch::{DispatchOut, Dispatched, Handle, HostCounts, RecvBuf, TopkIdx};
pub use residency::{residency, Residency};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DeviceSlice};

use crate::symm::SymmBuffer;

/// A region of device memory holding `len()` elements of `T`: a cudarc slice
/// or view, or a [`SymmBuffer`]. Ops take their device arguments through it.
pub trait DeviceRegion<T> {
    /// Device address of the first element.
    fn device_ptr(&self) -> u64;
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> DeviceRegion<T> for SymmBuffer<T> {
    fn device_ptr(&self) -> u64 {
        SymmBuffer::device_ptr(self)
    }
    fn len(&self) -> usize {
        SymmBuffer::len(self)
    }
}

impl<T> DeviceRegion<T> for CudaSlice<T> {
    fn device_ptr(&self) -> u64 {
        let (p, _sync) = DevicePtr::device_ptr(self, self.stream());
        p
    }
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
}

impl<T> DeviceRegion<T> for CudaView<'_, T> {
    fn device_ptr(&self) -> u64 {
        let (p, _sync) = DevicePtr::device_ptr(self, self.stream());
        p
    }
    fn len(&self) -> usize {
        CudaView::len(self)
    }
}

impl<T> DeviceRegion<T> for CudaViewMut<'_, T> {
    fn device_ptr(&self) -> u64 {
        let (p, _sync) = DevicePtr::device_ptr(self, self.stream());
        p
    }
    fn len(&self) -> usize {
        CudaViewMut::len(self)
    }
}
