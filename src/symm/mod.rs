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
//! ```ignore
//! let pool = SymmPool::new(&comm, 256 << 20)?;
//! let buf: SymmBuffer<u32> = pool.alloc(1 << 20)?;      // same offset on every rank
//! let peer = buf.peer_ptr(1);                            // rank 1's copy, mapped here
//! assert!(pool.is_symm_backed(buf.device_ptr(), buf.num_bytes()));
//! ```

use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::{Error, Result};
use crate::runtime::nccl_call as nc;
use crate::runtime::{Communicator, Module};
use crate::sys::nccl::{ncclWindow_t, NCCL_WIN_COLL_SYMMETRIC};

/// Offsets inside segments are multiples of this (bytes): 16-byte vectors
/// and TMA bulk copies need at least 16; 256 keeps rows cache-line aligned.
pub const ALLOC_ALIGN: usize = 256;
/// Segment sizes are multiples of this (bytes), a safe multiple of the
/// allocation granularity of ncclMemAlloc (cuMem) on Hopper.
pub const SEGMENT_GRANULE: usize = 2 << 20;

/// Every live registered window (pool segments, wrapped caller windows),
/// by the address of the communicator it belongs to (a segment keeps its
/// communicator alive, so a live entry's address is its communicator's).
static REGISTRY: Mutex<Vec<(usize, Weak<Segment>)>> = Mutex::new(Vec::new());

fn comm_key(comm: &Communicator) -> usize {
    comm as *const Communicator as usize
}

fn register(seg: &Arc<Segment>) {
    let mut v = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    v.retain(|(_, w)| w.strong_count() > 0);
    v.push((comm_key(&seg.comm), Arc::downgrade(seg)));
}

/// The live registered window of `comm` that holds `[ptr, ptr + len)`, if any.
pub fn segment_of(comm: &Communicator, ptr: u64, len: usize) -> Option<Arc<Segment>> {
    let key = comm_key(comm);
    let v = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    v.iter()
        .filter(|(k, _)| *k == key)
        .filter_map(|(_, w)| w.upgrade())
        .find(|s| s.contains(ptr, len))
}

/// True if `[ptr, ptr + len)` lies inside a registered window of `comm` (a
/// pool buffer of any pool of it, or a wrapped caller window).
pub fn is_symm_backed(comm: &Communicator, ptr: u64, len: usize) -> bool {
    segment_of(comm, ptr, len).is_some()
}

/// One registered window: same size on every rank.
pub struct Segment {
    comm: Arc<Communicator>,
    /// Registration order on the communicator (1, 2, ...): the same window
    /// has the same id on every rank.
    id: u64,
    base: u64,
    size: usize,
    backing: Backing,
    /// `peers[r]`: rank r's copy as mapped here; 0 when not load/store reachable.
    peers: Vec<u64>,
}

enum Backing {
    /// An NCCL window; `owned` when this crate allocated and registered it.
    Window { win: ncclWindow_t, owned: bool },
    /// A virtual rank's segment: held, never read, are every rank's
    /// allocations of this collective call, so that each rank's memory
    /// lives until the last rank that maps it has dropped its segment.
    Virtual { _ranks: Vec<Arc<DeviceAlloc>> },
    /// A caller's buffer registered collectively by a virtual rank (the
    /// caller keeps ownership).
    VirtualWrapped,
}

/// A plain device allocation (a virtual rank's segment), freed on drop.
struct DeviceAlloc {
    ptr: u64,
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_async in Segment::new (and waited for);
        // no rank maps it any more (every Segment holding this Arc is gone).
        // cuMemFree waits for the work still using it.
        if let Err(e) = unsafe { cudarc::driver::result::free_sync(self.ptr) } {
            eprintln!("moe-ep: cuMemFree of a virtual segment failed in drop: {e}");
        }
    }
}

// SAFETY: the raw handles are only used through &self with NCCL/driver calls
// that are thread-safe for distinct objects.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}
unsafe impl Send for DeviceAlloc {}
unsafe impl Sync for DeviceAlloc {}

impl Segment {
    /// Allocates and registers `size` bytes (rounded up to SEGMENT_GRANULE).
    /// Collective.
    pub fn new(comm: &Arc<Communicator>, size: usize) -> Result<Arc<Segment>> {
        let size = size.max(1).div_ceil(SEGMENT_GRANULE) * SEGMENT_GRANULE;
        comm.context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        if let Some(group) = comm.host_group() {
            // Stream-ordered on a stream of its own, then waited for: a plain
            // cuMemAlloc may wait for the whole GPU, where the sibling ranks'
            // kernels can be waiting for this rank's next launch.
            let stream = comm
                .context()
                .new_stream()
                .map_err(Error::cuda("cuStreamCreate"))?;
            // SAFETY: `size` bytes on `stream`, owned by `mine` below once
            // the stream has finished the allocation.
            let ptr = unsafe { cudarc::driver::result::malloc_async(stream.cu_stream(), size) }
                .map_err(Error::cuda("cuMemAllocAsync (virtual segment)"))?;
            stream
                .synchronize()
                .map_err(Error::cuda("cuStreamSynchronize"))?;
            let mine = Arc::new(DeviceAlloc {
                ptr,
                ctx: comm.context().clone(),
            });
            let ranks = group.exchange("segment allocation", (mine, size))?;
            if let Some((r, (_, sz))) = ranks.iter().enumerate().find(|(_, (_, sz))| *sz != size) {
                return Err(Error::InvalidState(format!(
                    "symmetric allocation diverged: rank {r} allocated a segment of {sz} bytes, rank {} one of {size} (every rank must make the same allocations in the same order)",
                    comm.rank()
                )));
            }
            let ranks: Vec<Arc<DeviceAlloc>> = ranks.into_iter().map(|(a, _)| a).collect();
            let seg = Arc::new(Segment {
                comm: comm.clone(),
                id: comm.next_window_id(),
                base: ptr,
                size,
                peers: ranks.iter().map(|a| a.ptr).collect(),
                backing: Backing::Virtual { _ranks: ranks },
            });
            register(&seg);
            return Ok(seg);
        }
        let _one_call = comm.nccl_calls();
        let raw = comm.raw().ok_or_else(|| {
            Error::InvalidState(format!(
                "rank {}: the communicator was aborted; make a new one",
                comm.rank()
            ))
        })?;
        let ptr = nc::mem_alloc(size)?;
        // SAFETY: ptr is a fresh ncclMemAlloc of `size` bytes; comm is live.
        let win = match unsafe { nc::window_register(raw, ptr, size, NCCL_WIN_COLL_SYMMETRIC) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: allocated above, not registered.
                let _ = unsafe { nc::mem_free(ptr) };
                return Err(e);
            }
        };
        let mut seg = Segment {
            comm: comm.clone(),
            id: comm.next_window_id(),
            base: ptr as u64,
            size,
            backing: Backing::Window { win, owned: true },
            peers: vec![],
        };
        seg.peers = seg.resolve_peers(win)?;
        let seg = Arc::new(seg);
        register(&seg);
        Ok(seg)
    }

    /// Wraps a window the caller registered (with `NCCL_WIN_COLL_SYMMETRIC`)
    /// over `size` bytes at `base`. The caller keeps ownership.
    ///
    /// # Safety
    /// `win` must be a live symmetric window of `comm` covering exactly
    /// `[base, base + size)`, alive as long as the returned segment.
    pub unsafe fn wrap(
        comm: &Arc<Communicator>,
        win: ncclWindow_t,
        base: u64,
        size: usize,
    ) -> Result<Arc<Segment>> {
        if comm.is_virtual() {
            return Err(Error::arg(
                "window",
                "an NCCL window of an NCCL communicator (a virtual rank has none: wrap a device buffer with Segment::wrap_device)",
                "a window given to a virtual rank",
            ));
        }
        if win.is_null() || base == 0 || size == 0 {
            return Err(Error::arg(
                "window",
                "a live window with a non-null base and a size > 0",
                "null or empty",
            ));
        }
        let mut seg = Segment {
            comm: comm.clone(),
            id: comm.next_window_id(),
            base,
            size,
            backing: Backing::Window { win, owned: false },
            peers: vec![],
        };
        seg.peers = seg.resolve_peers(win)?;
        let seg = Arc::new(seg);
        register(&seg);
        Ok(seg)
    }

    /// A virtual rank's counterpart of [`Segment::wrap`]: registers the
    /// caller's device buffer `[base, base + size)` collectively (every rank
    /// of the virtual world calls it with its own buffer of the same size),
    /// so that its siblings map it. The caller keeps ownership.
    ///
    /// # Safety
    /// `[base, base + size)` must be device memory of `comm`'s context that
    /// stays allocated as long as any rank's returned segment lives.
    pub unsafe fn wrap_device(
        comm: &Arc<Communicator>,
        base: u64,
        size: usize,
    ) -> Result<Arc<Segment>> {
        let Some(group) = comm.host_group() else {
            return Err(Error::arg(
                "comm",
                "a virtual rank (on an NCCL communicator, register the buffer as an NCCL window and use Segment::wrap)",
                "an NCCL communicator",
            ));
        };
        if base == 0 || size == 0 {
            return Err(Error::arg(
                "buffer",
                "a non-null device buffer of size > 0",
                "null or empty",
            ));
        }
        let all = group.all_gather("wrap_device", &[base, size as u64])?;
        if let Some(r) = (0..comm.world()).find(|&r| all[2 * r + 1] != size as u64) {
            return Err(Error::arg(
                "buffer",
                format!(
                    "{size} bytes on every rank (the size rank {} gave)",
                    comm.rank()
                ),
                format!("{} bytes on rank {r}", all[2 * r + 1]),
            ));
        }
        let seg = Arc::new(Segment {
            comm: comm.clone(),
            id: comm.next_window_id(),
            base,
            size,
            backing: Backing::VirtualWrapped,
            peers: (0..comm.world()).map(|r| all[2 * r]).collect(),
        });
        register(&seg);
        Ok(seg)
    }

    fn resolve_peers(&self, win: ncclWindow_t) -> Result<Vec<u64>> {
        let world = self.comm.world();
        let mut peers = vec![0u64; world];
        let node = self.comm.node_ranks();
        // SAFETY: win is live.
        if unsafe { nc::peer_device_pointer(win, 0, self.comm.rank())? }.is_some() {
            for &r in &node {
                // SAFETY: as above.
                peers[r] = unsafe { nc::peer_device_pointer(win, 0, r)? }
                    .unwrap_or(std::ptr::null_mut()) as u64;
            }
        } else {
            // NCCL 2.28: ask the device API from a one-thread kernel. The LSA
            // team is this host's ranks, which NCCL numbers contiguously.
            let first = node[0];
            if node.iter().enumerate().any(|(i, &r)| r != first + i) {
                return Err(Error::InvalidState(
                    "ranks of one host are not contiguous; NVLink peers unresolved".into(),
                ));
            }
            let ctx = self.comm.context();
            let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
            let mut out = stream
                .alloc_zeros::<u64>(world)
                .map_err(Error::cuda("cuMemAlloc"))?;
            let f = Module::get(ctx, "symm")?.function("moe_ep_peer_pointers")?;
            #[repr(C)]
            #[derive(Clone, Copy)]
            struct Args {
                win: ncclWindow_t,
                first: i32,
                count: i32,
                out: u64,
            }
            // The kernel takes 4 separate parameters; pass them as such.
            let (out_ptr, _g) = {
                use cudarc::driver::DevicePtrMut;
                out.device_ptr_mut(&stream)
            };
            let mut a = Args {
                win,
                first: first as i32,
                count: node.len() as i32,
                out: out_ptr,
            };
            let mut args: [*mut c_void; 4] = [
                &mut a.win as *mut _ as *mut c_void,
                &mut a.first as *mut _ as *mut c_void,
                &mut a.count as *mut _ as *mut c_void,
                &mut a.out as *mut _ as *mut c_void,
            ];
            // SAFETY: matches moe_ep_peer_pointers(ncclWindow_t, int, int, u64*).
            unsafe { f.launch_raw(&stream, 1, 32, 0, &mut args)? };
            drop(_g);
            let host = stream
                .clone_dtoh(&out)
                .map_err(Error::cuda("cuMemcpyDtoH"))?;
            stream
                .synchronize()
                .map_err(Error::cuda("moe_ep_peer_pointers"))?;
            for &r in &node {
                peers[r] = host[r];
            }
        }
        // Our own mapping is the allocation itself.
        peers[self.comm.rank()] = self.base;
        Ok(peers)
    }

    /// Device address of this rank's copy.
    pub fn base(&self) -> u64 {
        self.base
    }
    /// Where `[ptr, ..)` of this window lies, the same word on every rank
    /// for the same collective buffer: `id << 40 | byte offset`.
    pub(crate) fn place_of(&self, ptr: u64) -> u64 {
        (self.id << 40) | ((ptr - self.base) & ((1u64 << 40) - 1))
    }
    /// Size in bytes (same on every rank).
    pub fn size(&self) -> usize {
        self.size
    }
    /// Rank `r`'s copy as mapped here; `None` when not load/store reachable.
    pub fn peer_base(&self, r: usize) -> Option<u64> {
        self.peers.get(r).copied().filter(|&p| p != 0)
    }
    /// The raw NCCL window; `None` on a virtual rank.
    pub fn window(&self) -> Option<ncclWindow_t> {
        match self.backing {
            Backing::Window { win, .. } => Some(win),
            Backing::Virtual { .. } | Backing::VirtualWrapped => None,
        }
    }
    /// The communicator it belongs to.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }
    pub(crate) fn contains(&self, ptr: u64, len: usize) -> bool {
        ptr >= self.base
            && ptr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.base + self.size as u64)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // Virtual segments free their memory when the last DeviceAlloc goes.
        let Backing::Window { win, owned: true } = self.backing else {
            return;
        };
        // The lock first, then the communicator's state: an abort between
        // the two would otherwise leave a window deregistered on a dead
        // communicator.
        let _one_call = self.comm.nccl_calls();
        let _ = self.comm.context().bind_to_thread();
        // SAFETY: registered and allocated in new; deregistered before
        // freeing. After an abort the window went with the communicator;
        // the memory itself (ncclMemAlloc, not the communicator's) is freed.
        unsafe {
            match self.comm.raw() {
                Some(raw) => {
                    if let Err(e) = nc::window_deregister(raw, win) {
                        eprintln!("moe-ep: ncclCommWindowDeregister failed in drop: {e}");
                    }
                }
                None => eprintln!(
                    "moe-ep: a symmetric window of an aborted communicator: its memory is freed, its registration went with the abort"
                ),
            }
            if let Err(e) = nc::mem_free(self.base as *mut c_void) {
                eprintln!("moe-ep: ncclMemFree failed in drop: {e}");
            }
        }
    }
}

/// Work a range waits for before its next use: the events its last
/// buffers recorded when they were dropped (completed ones pruned).
#[derive(Clone, Default)]
struct Pending(Vec<Arc<CudaEvent>>);

impl Pending {
    fn merge(&mut self, other: Pending) {
        self.0.extend(other.0);
        self.0.retain(|e| !e.is_complete());
    }
}

/// A free range of a segment: offset, length, and what its next user waits for.
type FreeRange = (usize, usize, Pending);

struct Slot {
    seg: Arc<Segment>,
    /// Free ranges, sorted by offset, coalesced. Empty for wrapped caller
    /// windows (not allocated from).
    free: Vec<FreeRange>,
    pooled: bool,
}

/// True while `stream` records a CUDA graph: nothing runs then, so there is
/// nothing to order (and events of uncaptured work cannot be waited for).
pub(crate) fn capturing(stream: &CudaStream) -> bool {
    !matches!(
        stream.capture_status(),
        Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    )
}

struct PoolInner {
    comm: Arc<Communicator>,
    segment_bytes: usize,
    slots: Mutex<Vec<Slot>>,
}

/// A pool of symmetric memory over one communicator. Cloning shares the pool.
#[derive(Clone)]
pub struct SymmPool {
    inner: Arc<PoolInner>,
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
    /// `is_symm_backed`) and returns a buffer over all of it.
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

    /// Number of segments this pool allocated (wrapped windows not counted).
    pub fn num_segments(&self) -> usize {
        let slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.iter().filter(|s| s.pooled).count()
    }
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
                        eprintln!("moe-ep: waiting for a pool range's last use before its segment is freed: {err}");
                    }
                }
            }
        }
    }
}

impl PoolInner {
    fn release(&self, seg: &Arc<Segment>, offset: usize, bytes: usize, after: Pending) {
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

/// `len` elements of `T` in symmetric memory: the same offset of the same
/// segment on every rank. Returned to its pool on drop.
pub struct SymmBuffer<T> {
    seg: Arc<Segment>,
    offset: usize,
    len: usize,
    bytes: usize,
    pool: Option<Arc<PoolInner>>,
    /// Stream order of the range (see the module's doc).
    order: Mutex<Order>,
    _t: PhantomData<T>,
}

/// What a buffer's uses wait for and who used it.
#[derive(Default)]
struct Order {
    /// Work of the range's earlier buffers: every stream waits for it
    /// before its first use of this one.
    after: Pending,
    /// The streams it was used on (each waited for `after`).
    used_on: Vec<Arc<CudaStream>>,
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
    buf: &'a SymmBuffer<T>,
    range: Range<usize>,
}

/// Elements of a [`SymmBuffer`] borrowed mutably ([`SymmBuffer::view_mut`]).
pub struct SymmViewMut<'a, T> {
    buf: &'a mut SymmBuffer<T>,
    range: Range<usize>,
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
                        eprintln!("moe-ep: releasing a pool buffer: {e}");
                    }
                }
            }
        }
        after.0.retain(|e| !e.is_complete());
        pool.release(&self.seg, self.offset, self.bytes, after);
    }
}
