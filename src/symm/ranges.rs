//! What a pool holds ([`PoolInner`]): its segments' free ranges, each with
//! the work its next user waits for ([`Pending`]), their release and
//! coalescing; and whether a stream captures a CUDA graph ([`capturing`]).
//!
//! Tests: `tests/gpu_symm.rs` (stream-ordered reuse).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaStream};

use super::segment::Segment;
use crate::runtime::Communicator;

/// Work a range waits for before its next use: the events its last
/// buffers recorded when they were dropped (completed ones pruned).
#[derive(Clone, Default)]
pub(crate) struct Pending(pub(crate) Vec<Arc<CudaEvent>>);

impl Pending {
    pub(crate) fn merge(&mut self, other: Pending) {
        self.0.extend(other.0);
        self.0.retain(|e| !e.is_complete());
    }
}

/// A free range of a segment: offset, length, and what its next user waits for.
pub(crate) type FreeRange = (usize, usize, Pending);

pub(crate) struct Slot {
    pub(crate) seg: Arc<Segment>,
    /// Free ranges, sorted by offset, coalesced. Empty for wrapped caller
    /// windows (not allocated from).
    pub(crate) free: Vec<FreeRange>,
    pub(crate) pooled: bool,
}

/// True while `stream` records a CUDA graph: nothing runs then, so there is
/// nothing to order (and events of uncaptured work cannot be waited for).
pub(crate) fn capturing(stream: &CudaStream) -> bool {
    !matches!(
        stream.capture_status(),
        Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    )
}

pub(crate) struct PoolInner {
    pub(crate) comm: Arc<Communicator>,
    pub(crate) segment_bytes: usize,
    pub(crate) slots: Mutex<Vec<Slot>>,
}

impl Drop for PoolInner {
    /// The pool's segments are freed once its last buffer is gone: first
    /// every stream-ordered use of a released range must have finished
    /// (a copy of a buffer still pending on another stream, say), else the
    /// memory would be freed under it.
    fn drop(&mut self) {
        let slots = self.slots.get_mut().unwrap_or_else(|p| p.into_inner());
        for slot in slots.iter() {
            for (_, _, pending) in &slot.free {
                for e in &pending.0 {
                    if let Err(err) = e.synchronize() {
                        tracing::warn!("waiting for a pool range's last use before its segment is freed: {err}");
                    }
                }
            }
        }
    }
}

impl PoolInner {
    pub(crate) fn release(&self, seg: &Arc<Segment>, offset: usize, bytes: usize, after: Pending) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let Some(slot) = slots.iter_mut().find(|s| Arc::ptr_eq(&s.seg, seg)) else {
            return;
        };
        let i = slot.free.partition_point(|&(o, _, _)| o < offset);
        slot.free.insert(i, (offset, bytes, after));
        // Coalesce with the next and the previous range (a merged range
        // waits for what either waited for).
        if i + 1 < slot.free.len() && slot.free[i].0 + slot.free[i].1 == slot.free[i + 1].0 {
            let (_, l, p) = slot.free.remove(i + 1);
            slot.free[i].1 += l;
            slot.free[i].2.merge(p);
        }
        if i > 0 && slot.free[i - 1].0 + slot.free[i - 1].1 == slot.free[i].0 {
            let (_, l, p) = slot.free.remove(i);
            slot.free[i - 1].1 += l;
            slot.free[i - 1].2.merge(p);
        }
    }
}
