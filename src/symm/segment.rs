//! Symmetric segments ([`Segment`]): `ncclMemAlloc` + a collective window
//! registration (or, on a virtual rank, a plain allocation per rank), the
//! peers' addresses of each, and the registry of the live windows by
//! communicator ([`segment_of`], [`is_symm_backed`]).
//!
//! Kernels: `kernels-cuda/symm.cu` (`ncclGetPeerPointer` where NCCL has no
//! host call). Tests: `tests/gpu_symm.rs`.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, Weak};

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
    pub(crate) base: u64,
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
            tracing::warn!("cuMemFree of a virtual segment failed in drop: {e}");
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
        // Our own mapping is the allocation itself.
        seg.peers[comm.rank()] = seg.base;
        let seg = Arc::new(seg);
        register(&seg);
        Ok(seg)
    }

    /// Wraps a window the caller registered (with `NCCL_WIN_COLL_SYMMETRIC`)
    /// over `size` bytes at `base`. The caller keeps ownership. Collective:
    /// every rank wraps its own copy of the same window, in the same order
    /// (one host all-gather of the communicator).
    ///
    /// Checked, on every rank, and refused on every rank naming `window`
    /// and the ranks that failed: a window, base and size given (not null
    /// or empty), the same size on every rank, and a window of `comm`:
    /// its copy of this rank (as the window maps it for this rank's number
    /// in `comm`) is the physical memory at `base` (the same cuMem
    /// allocation), which a window of another communicator, where this
    /// process has another rank or none, or a window over other memory
    /// than `base`, is not. Not told apart: a window of another
    /// communicator over the same processes with the same rank numbers
    /// (it maps the same memory for every rank, and works), and a `base`
    /// elsewhere in the window's own allocation.
    ///
    /// # Safety
    /// `win` must be a live symmetric window (of any communicator: the
    /// check above only reads it) whose copy here starts at `base` and
    /// holds `size` bytes, alive as long as the returned segment.
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
        let mut seg = Segment {
            comm: comm.clone(),
            id: 0,
            base,
            size,
            backing: Backing::Window { win, owned: false },
            peers: vec![],
        };
        // This rank's verdict (an empty string: fine), then every rank's.
        let mine: std::result::Result<Vec<u64>, String> = if win.is_null() || base == 0 || size == 0
        {
            Err("a null or empty window (window, base or size)".into())
        } else {
            // SAFETY: a live window (the caller's contract).
            match seg.resolve_peers(win) {
                Err(e) => Err(format!("its peers could not be resolved ({e})")),
                Ok(peers) => match same_memory(peers[comm.rank()], base) {
                    Ok(()) => Ok(peers),
                    Err(why) => Err(why),
                },
            }
        };
        let code = match &mine {
            Ok(_) => 0u64,
            Err(_) => 1,
        };
        let stream = comm
            .context()
            .new_stream()
            .map_err(Error::cuda("cuStreamCreate"))?;
        let all = comm.all_gather_host(&stream, &[code, size as u64])?;
        let bad: Vec<usize> = (0..comm.world()).filter(|&r| all[2 * r] != 0).collect();
        if !bad.is_empty() {
            let ranks: Vec<String> = bad.iter().map(|r| r.to_string()).collect();
            let here = match &mine {
                Err(why) => format!("; here (rank {}): {why}", comm.rank()),
                Ok(_) => String::new(),
            };
            return Err(Error::arg(
                "window",
                "on every rank, a live symmetric window of this communicator whose copy here starts at `base`",
                format!(
                    "not on rank(s) {}{here} (a window registered on another communicator, or over other memory than `base`)",
                    ranks.join(", ")
                ),
            ));
        }
        if let Some(r) = (0..comm.world()).find(|&r| all[2 * r + 1] != size as u64) {
            return Err(Error::arg(
                "window",
                format!(
                    "{size} bytes on every rank (the size rank {} gave)",
                    comm.rank()
                ),
                format!("{} bytes on rank {r}", all[2 * r + 1]),
            ));
        }
        let mut peers = mine.expect("checked on every rank");
        // Our own mapping is the allocation itself.
        peers[comm.rank()] = base;
        seg.peers = peers;
        seg.id = comm.next_window_id();
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

    /// Every rank's copy of `win` as mapped here, this rank's included (the
    /// window's own mapping of it, which need not be the caller's address);
    /// 0 where not load/store reachable.
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

/// `Ok` when device addresses `mapped` and `base` are the same address or
/// lie in the same physical memory: the same cuMem allocation (the handle
/// `cuMemRetainAllocationHandle` gives for an address is the one its
/// memory was mapped with, and NCCL maps a rank's own copy of a window
/// with the handle of the caller's allocation); else why not. A symmetric
/// window's memory is cuMem memory (`ncclMemAlloc` or the cuMem calls).
/// Where in the allocation is not compared (the ranges the driver reports
/// for NCCL's mappings are not documented).
fn same_memory(mapped: u64, base: u64) -> std::result::Result<(), String> {
    use cudarc::driver::sys::{self, CUresult};
    if mapped == base {
        return Ok(());
    }
    if mapped == 0 {
        return Err("the window has no copy for this rank's number".into());
    }
    let handle = |p: u64| -> std::result::Result<u64, CUresult> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: any address is accepted; one not mapped by cuMem is an error code.
        let rc = unsafe { sys::cuMemRetainAllocationHandle(&mut h, p as *mut c_void) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(rc);
        }
        // SAFETY: retained above; released once (the mapping keeps the allocation).
        unsafe { sys::cuMemRelease(h) };
        Ok(h)
    };
    let mine = handle(base).map_err(|rc| {
        format!("{base:#x} is not cuMem memory ({rc:?}), which a symmetric window needs")
    })?;
    match handle(mapped) {
        Ok(h) if h == mine => Ok(()),
        Ok(_) => Err(format!(
            "the window's copy of this rank's number is other memory than {base:#x}"
        )),
        Err(rc) => Err(format!(
            "the window's copy of this rank's number is not mapped here ({rc:?})"
        )),
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
                        tracing::warn!("ncclCommWindowDeregister failed in drop: {e}");
                    }
                }
                None => tracing::info!(
                    "a symmetric window of an aborted communicator: its memory is freed, its registration went with the abort"
                ),
            }
            if let Err(e) = nc::mem_free(self.base as *mut c_void) {
                tracing::warn!("ncclMemFree failed in drop: {e}");
            }
        }
    }
}
