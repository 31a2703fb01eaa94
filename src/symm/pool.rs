//! The pool of symmetric memory over one communicator ([`SymmPool`]): a
//! first-fit allocator over whole segments, collective by contract (debug
//! builds compare every rank's offsets), and the wrapping of a caller's
//! window.
//!
//! Tests: `tests/gpu_symm.rs`.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use super::buffer::{Order, SymmBuffer};
use super::ranges::{Pending, PoolInner, Slot};
use super::segment::{is_symm_backed, Segment, ALLOC_ALIGN, SEGMENT_GRANULE};
use crate::error::{Error, Result};
use crate::runtime::Communicator;
use crate::sys::nccl::ncclWindow_t;

/// A pool of symmetric memory over one communicator. Cloning shares the pool.
#[derive(Clone)]
pub struct SymmPool {
    pub(crate) inner: Arc<PoolInner>,
}

impl SymmPool {
    /// A pool that grows by segments of at least `segment_bytes`. No memory
    /// is taken until the first allocation.
    pub fn new(comm: &Arc<Communicator>, segment_bytes: usize) -> Self {
        SymmPool {
            inner: Arc::new(PoolInner {
                comm: comm.clone(),
                segment_bytes: segment_bytes.max(SEGMENT_GRANULE),
                slots: Mutex::new(vec![]),
            }),
        }
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.inner.comm
    }

    /// Allocates `len` elements of `T`, at the same offset on every rank.
    /// Collective by contract (same calls, same order, on every rank).
    pub fn alloc<T: Copy>(&self, len: usize) -> Result<SymmBuffer<T>> {
        let bytes = len
            .max(1)
            .checked_mul(std::mem::size_of::<T>())
            .and_then(|b| b.checked_next_multiple_of(ALLOC_ALIGN))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::arg(
                    "len",
                    format!(
                        "at most {} elements",
                        isize::MAX as usize / std::mem::size_of::<T>().max(1)
                    ),
                    len,
                )
            })?;
        let mut slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        let found = slots.iter_mut().enumerate().find_map(|(i, s)| {
            let j = s.free.iter().position(|&(_, l, _)| l >= bytes)?;
            let (off, l) = (s.free[j].0, s.free[j].1);
            let after = s.free[j].2.clone();
            if l == bytes {
                s.free.remove(j);
            } else {
                s.free[j].0 = off + bytes;
                s.free[j].1 = l - bytes;
            }
            Some((i, off, after))
        });
        let (idx, offset, after) = match found {
            Some(x) => x,
            None => {
                let seg = Segment::new(&self.inner.comm, bytes.max(self.inner.segment_bytes))?;
                let size = seg.size();
                let free = if size > bytes {
                    vec![(bytes, size - bytes, Pending::default())]
                } else {
                    vec![]
                };
                slots.push(Slot {
                    seg,
                    free,
                    pooled: true,
                });
                (slots.len() - 1, 0, Pending::default())
            }
        };
        let seg = slots[idx].seg.clone();
        drop(slots);
        let buf = SymmBuffer {
            seg,
            offset,
            len,
            bytes,
            pool: Some(self.inner.clone()),
            order: Mutex::new(Order {
                after,
                used_on: vec![],
            }),
            _t: PhantomData,
        };
        if cfg!(debug_assertions) {
            self.verify_symmetric(idx, offset)?;
        }
        Ok(buf)
    }

    /// Debug check of the collective contract: every rank got (idx, offset).
    fn verify_symmetric(&self, idx: usize, offset: usize) -> Result<()> {
        let comm = &self.inner.comm;
        let stream = comm
            .context()
            .new_stream()
            .map_err(Error::cuda("cuStreamCreate"))?;
        let all = comm.all_gather_host(&stream, &[idx as u64, offset as u64])?;
        for r in 0..comm.world() {
            if all[2 * r] != idx as u64 || all[2 * r + 1] != offset as u64 {
                return Err(Error::InvalidState(format!(
                    "symmetric allocation diverged: rank {} got segment {idx} offset {offset}, rank {r} got segment {} offset {} (every rank must make the same allocations in the same order)",
                    comm.rank(),
                    all[2 * r],
                    all[2 * r + 1]
                )));
            }
        }
        Ok(())
    }

    /// Registers a window the caller created as part of this pool (for
    /// `is_symm_backed`) and returns a buffer over all of it. Collective
    /// ([`Segment::wrap`]: every rank, same order); a window that is not
    /// one of this pool's communicator is refused on every rank naming
    /// `window` (what is checked: [`Segment::wrap`]). The pool keeps the
    /// registration until it is dropped, so the window must stay
    /// registered as long as the pool lives.
    ///
    /// # Safety
    /// As [`Segment::wrap`]; `size` must be a multiple of `size_of::<T>()`.
    pub unsafe fn wrap_window<T: Copy>(
        &self,
        win: ncclWindow_t,
        base: u64,
        size: usize,
    ) -> Result<SymmBuffer<T>> {
        let seg = Segment::wrap(&self.inner.comm, win, base, size)?;
        Ok(self.adopt(seg, size))
    }

    /// On a virtual rank: registers the caller's device buffer collectively
    /// (every rank passes its own buffer of the same size), the counterpart
    /// of [`SymmPool::wrap_window`], and returns a buffer over all of it.
    ///
    /// # Safety
    /// As [`Segment::wrap_device`]; `size` must be a multiple of `size_of::<T>()`.
    pub unsafe fn wrap_device<T: Copy>(&self, base: u64, size: usize) -> Result<SymmBuffer<T>> {
        let seg = Segment::wrap_device(&self.inner.comm, base, size)?;
        Ok(self.adopt(seg, size))
    }

    fn adopt<T>(&self, seg: Arc<Segment>, size: usize) -> SymmBuffer<T> {
        let len = size / std::mem::size_of::<T>().max(1);
        self.inner
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Slot {
                seg: seg.clone(),
                free: vec![],
                pooled: false,
            });
        SymmBuffer {
            seg,
            offset: 0,
            len,
            bytes: size,
            pool: None,
            order: Mutex::default(),
            _t: PhantomData,
        }
    }

    /// True if `[ptr, ptr + len)` lies inside a registered window of this
    /// pool's communicator (any pool's buffer, or a wrapped caller window).
    pub fn is_symm_backed(&self, ptr: u64, len: usize) -> bool {
        is_symm_backed(&self.inner.comm, ptr, len)
    }

    /// Bytes of the segments this pool allocated (wrapped windows not
    /// counted): the device memory it holds.
    pub fn reserved_bytes(&self) -> u64 {
        let slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots
            .iter()
            .filter(|s| s.pooled)
            .map(|s| s.seg.size() as u64)
            .sum()
    }

    /// Of [`reserved_bytes`](Self::reserved_bytes), the bytes in free
    /// ranges now (released buffers' ranges count once their last use is
    /// ordered, as for reuse).
    pub fn free_bytes(&self) -> u64 {
        let slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots
            .iter()
            .filter(|s| s.pooled)
            .flat_map(|s| s.free.iter().map(|&(_, l, _)| l as u64))
            .sum()
    }

    /// Number of segments this pool allocated (wrapped windows not counted).
    pub fn num_segments(&self) -> usize {
        let slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.iter().filter(|s| s.pooled).count()
    }
}
