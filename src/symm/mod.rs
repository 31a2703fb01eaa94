//! Symmetric memory: segments registered as NCCL windows on every rank, and a
//! pool that sub-allocates from them at the same offset everywhere.
//!
//! A **segment** is `ncclMemAlloc` + `ncclCommWindowRegister(..,
//! NCCL_WIN_COLL_SYMMETRIC)`, collective over the communicator. Its peers'
//! addresses (load/store mappings of the other ranks' copies) come from
//! `ncclGetPeerDevicePointer` on NCCL >= 2.29.2, else from a one-thread kernel
//! calling the device API's `ncclGetPeerPointer` (kernels-cuda/symm.cu).
//!
//! On a virtual rank (`Communicator::virtual_world`) a segment is a plain
//! device allocation per rank, allocated collectively in-process, and its
//! peers are the sibling ranks' allocations on the same GPU.
//!
//! The **pool** grows by whole segments. Allocation is collective by contract:
//! every rank makes the same `alloc`/drop calls in the same order, so the
//! first-fit allocator returns the same (segment, offset) on every rank; debug
//! builds verify it with an all-gather.
//!
//! Release is **stream-ordered**: a buffer records the streams it was used
//! on ([`SymmBuffer::ready_on`], and every op of the crate that takes it);
//! dropping it records an event on each, and the range's next buffer makes
//! each stream it is used on wait for those events first. Which range an
//! `alloc` returns never depends on the GPU's progress (the offsets stay
//! equal on every rank).
//!
//! ```no_run
//! # use moe_ep::{Communicator, SymmBuffer, SymmPool};
//! # fn f(comm: &std::sync::Arc<Communicator>) -> moe_ep::Result<()> {
//! let pool = SymmPool::new(comm, 256 << 20);
//! let buf: SymmBuffer<u32> = pool.alloc(1 << 20)?;      // same offset on every rank
//! let _peer = buf.peer_ptr(1);                           // rank 1's copy, mapped here
//! assert!(pool.is_symm_backed(buf.device_ptr(), buf.num_bytes()));
//! # Ok(()) }
//! ```
//!
//! Files: segments (allocation, registration, peers, the registry of live
//! windows) in `segment.rs`; the pool's free ranges and what they wait for
//! in `ranges.rs`; the pool in `pool.rs`; buffers and their views in
//! `buffer.rs`.
//!
//! Kernels: `kernels-cuda/symm.cu` (peer pointers on older NCCL). Tests:
//! `tests/gpu_symm.rs`.

mod buffer;
mod pool;
mod ranges;
mod segment;

pub use buffer::{SymmBuffer, SymmView, SymmViewMut};
pub use pool::SymmPool;
pub(crate) use ranges::capturing;
pub use segment::{is_symm_backed, segment_of, Segment, ALLOC_ALIGN, SEGMENT_GRANULE};
