//! `Communicator`: the ranks of one expert-parallel world. Either an NCCL
//! communicator bound to one GPU, owned (created from a unique id) or
//! borrowed (a caller's existing `ncclComm_t`), or one rank of a **virtual
//! world**: W ranks in one process on one GPU, each driven from its own
//! thread, whose symmetric memory is plain device memory and whose host
//! collectives run in-process ([`Communicator::virtual_world`]).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};

use crate::error::{Error, Result};
use crate::runtime::host_group::HostGroup;
use crate::runtime::nccl_call::{self as nc, UniqueId};
use crate::sys::nccl::{ncclComm_t, ncclDataType_t, ncclUint8};

/// How long a virtual world's host collectives wait for the slowest rank
/// unless [`Communicator::virtual_world_with_timeout`] says otherwise.
pub const VIRTUAL_HOST_TIMEOUT: Duration = Duration::from_secs(60);

/// How long an NCCL communicator's host collectives (the all-gathers of
/// group creation, `EpGroup::check` and the two-level layout) wait for the
/// slowest rank unless [`Communicator::set_host_timeout`] says otherwise:
/// as long as PyTorch's default NCCL watchdog, so that a rank merely slow
/// to arrive (a long step, a stalled data loader) is waited for.
pub const NCCL_HOST_TIMEOUT: Duration = Duration::from_secs(600);

/// The largest virtual world (the two-level path's largest world: 64 nodes
/// of 8 ranks); every rank is a thread whose blocks share one GPU.
pub const MAX_VIRTUAL_WORLD: usize = 512;

enum Backend {
    Nccl { raw: ncclComm_t, owned: bool },
    Virtual(HostGroup),
}

/// One rank of a world of `world` ranks, on the GPU of its context. Windows
/// and pool segments keep it alive (`Arc`); `symm` keeps the registry of
/// its windows.
pub struct Communicator {
    backend: Backend,
    rank: usize,
    world: usize,
    ctx: Arc<CudaContext>,
    /// `node_of[r]`: index of rank r's host, in order of first appearance.
    node_of: Vec<usize>,
    /// Held across every NCCL call on `backend` (NCCL takes one call at a
    /// time per communicator): what makes `Sync` below sound.
    calls: std::sync::Mutex<()>,
    /// Set by `abort`: no NCCL call on `backend` after it.
    aborted: std::sync::atomic::AtomicBool,
    /// Symmetric windows registered on this communicator so far (the next
    /// one's id, less one): every rank registers them in the same order.
    windows: std::sync::atomic::AtomicU64,
    /// Ranks of this process whose kernels share this rank's GPU: the whole
    /// virtual world (also of a communicator split from it), else 1.
    gpu_ranks: usize,
    /// What `abort` tells the groups made on this communicator (each stops
    /// its running kernels); dead entries are skipped.
    abort_hooks: std::sync::Mutex<Vec<std::sync::Weak<dyn Fn() + Send + Sync>>>,
    /// The bound on an NCCL host collective's wait, in milliseconds
    /// ([`NCCL_HOST_TIMEOUT`], [`Communicator::set_host_timeout`]).
    host_timeout_ms: std::sync::atomic::AtomicU64,
}

// SAFETY: NCCL communicators may be used from any thread, one call at a time:
// every NCCL call on `raw` is made with `calls` held (all_gather_host,
// check_async, and the window calls of `symm` through `nccl_calls`). The
// virtual backend is Send + Sync by itself.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

/// For each key, the index of its first appearance among the distinct keys
/// in order: `[7, 3, 7, 5]` -> `[0, 1, 0, 2]` (ranks' host keys -> node
/// indices).
fn first_appearance<K: PartialEq + Copy>(keys: &[K]) -> Vec<usize> {
    let mut seen: Vec<K> = Vec::new();
    keys.iter()
        .map(|k| {
            seen.iter().position(|s| s == k).unwrap_or_else(|| {
                seen.push(*k);
                seen.len() - 1
            })
        })
        .collect()
}

impl Communicator {
    /// Creates this rank's communicator (collective: every rank calls it with
    /// the same `id` and `world`; one thread or one process per GPU).
    pub fn init(
        ctx: &Arc<CudaContext>,
        id: &UniqueId,
        rank: usize,
        world: usize,
    ) -> Result<Arc<Self>> {
        if world == 0 || rank >= world {
            return Err(Error::arg("rank", format!("a rank in 0..{world}"), rank));
        }
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: the context is current; NCCL writes the new handle.
        let raw = unsafe { nc::comm_init_rank(world, id.0, rank)? };
        Self::finish(ctx, raw, true)
    }

    /// Wraps a communicator the caller created and keeps ownership of.
    ///
    /// # Safety
    /// `raw` must be a live communicator on the device of `ctx` that outlives
    /// the returned value and everything created from it.
    pub unsafe fn borrow_raw(ctx: &Arc<CudaContext>, raw: ncclComm_t) -> Result<Arc<Self>> {
        if raw.is_null() {
            return Err(Error::arg("comm", "a live ncclComm_t", "null"));
        }
        Self::finish(ctx, raw, false)
    }

    fn finish(ctx: &Arc<CudaContext>, raw: ncclComm_t, owned: bool) -> Result<Arc<Self>> {
        // SAFETY: raw is live.
        let (rank, world) = unsafe { (nc::comm_user_rank(raw)?, nc::comm_count(raw)?) };
        let mut c = Communicator {
            backend: Backend::Nccl { raw, owned },
            rank,
            world,
            ctx: ctx.clone(),
            node_of: vec![0; world],
            calls: std::sync::Mutex::new(()),
            aborted: std::sync::atomic::AtomicBool::new(false),
            windows: std::sync::atomic::AtomicU64::new(0),
            gpu_ranks: 1,
            abort_hooks: Default::default(),
            host_timeout_ms: std::sync::atomic::AtomicU64::new(NCCL_HOST_TIMEOUT.as_millis() as u64),
        };
        let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        let keys = c.all_gather_host(&stream, &[host_key()])?;
        c.node_of = first_appearance(&keys);
        Ok(Arc::new(c))
    }

    /// `world` virtual ranks of one process on the GPU of `ctx`, in rank
    /// order: give each to its own thread, with its own stream. Their
    /// symmetric segments are plain device allocations (one per rank,
    /// allocated collectively), each rank's peer table points at its
    /// siblings' allocations, and the host collectives (barrier, all-gather)
    /// run in-process, waiting at most [`VIRTUAL_HOST_TIMEOUT`] for the
    /// slowest rank. The kernels are the same as on NCCL communicators: only
    /// NVLink is not crossed.
    ///
    /// All ranks' kernels run on one GPU at once and wait for each other, so
    /// `EpGroup::new` checks that every rank's blocks fit the GPU together,
    /// and nothing may make one rank's work wait for a sibling's:
    /// - the device's stream-ordered memory pool is told not to make one
    ///   stream wait for another to reuse memory (this applies to the whole
    ///   process's allocations on that GPU);
    /// - create the ranks' streams one after another (the driver spreads
    ///   consecutive streams over its hardware queues; more queues with
    ///   `CUDA_DEVICE_MAX_CONNECTIONS=32` before the first CUDA call);
    /// - a rank must not call what waits for the whole GPU (`cuCtxSynchronize`,
    ///   `cuMemFree`, pinned host allocation, graph instantiation) while its
    ///   siblings' kernels may wait for its next launch: do it before a
    ///   barrier; the crate loads every kernel when a group is created (not
    ///   lazily at its first launch, which can wait for the whole GPU);
    ///   other libraries' kernels load lazily by default (torch's backward
    ///   kernels, first launched between two ops): set
    ///   `CUDA_MODULE_LOADING=EAGER` before CUDA starts in the process;
    /// - synchronize a rank's stream before a copy from or to pageable host
    ///   memory: the driver moves pageable copies of all threads through
    ///   shared staging buffers, so a copy queued behind this rank's waiting
    ///   kernels holds up its siblings' copies, and with them their launches
    ///   (the crate's own host copies do so);
    /// - run one virtual world per GPU at a time.
    pub fn virtual_world(ctx: &Arc<CudaContext>, world: usize) -> Result<Vec<Arc<Self>>> {
        Self::virtual_world_with_timeout(ctx, world, VIRTUAL_HOST_TIMEOUT)
    }

    /// [`Communicator::virtual_world`] whose host collectives wait at most
    /// `timeout`: a rank that does not arrive in time (or whose communicator
    /// is dropped, also by a panicking thread) fails every other rank's
    /// collective with [`Error::CollectiveFailed`] naming it.
    pub fn virtual_world_with_timeout(
        ctx: &Arc<CudaContext>,
        world: usize,
        timeout: Duration,
    ) -> Result<Vec<Arc<Self>>> {
        if world == 0 || world > MAX_VIRTUAL_WORLD {
            return Err(Error::arg(
                "world",
                format!("1..={MAX_VIRTUAL_WORLD} virtual ranks (one thread each, on one GPU)"),
                world,
            ));
        }
        if timeout.is_zero() {
            return Err(Error::arg("timeout", "a positive duration", "0"));
        }
        no_cross_stream_reuse(ctx)?;
        Ok(HostGroup::new(world, timeout)
            .into_iter()
            .map(|g| {
                Arc::new(Communicator {
                    rank: g.rank(),
                    world,
                    backend: Backend::Virtual(g),
                    ctx: ctx.clone(),
                    node_of: vec![0; world],
                    calls: std::sync::Mutex::new(()),
                    aborted: std::sync::atomic::AtomicBool::new(false),
                    windows: std::sync::atomic::AtomicU64::new(0),
                    gpu_ranks: world,
                    abort_hooks: Default::default(),
                    host_timeout_ms: std::sync::atomic::AtomicU64::new(timeout.as_millis() as u64),
                })
            })
            .collect())
    }

    /// True for a rank of a virtual world (no NCCL communicator behind it).
    pub fn is_virtual(&self) -> bool {
        matches!(self.backend, Backend::Virtual(_))
    }

    /// Ranks that share this rank's GPU (and so its SMs): the world of a
    /// virtual world, else 1.
    pub fn ranks_per_gpu(&self) -> usize {
        self.gpu_ranks
    }

    /// The ranks that give the same `color` as a communicator of their own,
    /// in this one's rank order (collective: every rank calls it, after the
    /// work enqueued on `stream` so far). The inter-node path splits a world
    /// into its nodes and its rails. NCCL: `ncclCommSplit` (the parent's
    /// configuration inherited). Virtual: a new in-process group on the same
    /// GPU, with the parent's timeout; its ranks still share the GPU with
    /// the whole parent world ([`Communicator::ranks_per_gpu`]), so a group
    /// made on it fits its blocks beside every sibling's.
    pub fn split(&self, stream: &Arc<CudaStream>, color: usize) -> Result<Arc<Communicator>> {
        self.live()?;
        let colors = self.all_gather_host(stream, &[color as u64])?;
        let members: Vec<usize> = (0..self.world)
            .filter(|&r| colors[r] == color as u64)
            .collect();
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| {
                Error::InvalidState(format!("split: rank {} lost its color", self.rank))
            })?;
        let node_of =
            first_appearance(&members.iter().map(|&r| self.node_of[r]).collect::<Vec<_>>());
        let backend = match &self.backend {
            Backend::Virtual(g) => Backend::Virtual(g.split(color)?),
            Backend::Nccl { raw, .. } => {
                let _one_call = self.nccl_calls();
                self.live()?;
                self.ctx
                    .bind_to_thread()
                    .map_err(Error::cuda("cuCtxSetCurrent"))?;
                // SAFETY: raw is live (not aborted), its device's context is
                // current, and the lock keeps other calls on it out.
                let new = unsafe { nc::comm_split(*raw, color, self.rank)? };
                Backend::Nccl {
                    raw: new,
                    owned: true,
                }
            }
        };
        Ok(Arc::new(Communicator {
            backend,
            rank,
            world: members.len(),
            ctx: self.ctx.clone(),
            node_of,
            calls: std::sync::Mutex::new(()),
            aborted: std::sync::atomic::AtomicBool::new(false),
            windows: std::sync::atomic::AtomicU64::new(0),
            gpu_ranks: self.gpu_ranks,
            abort_hooks: Default::default(),
            host_timeout_ms: std::sync::atomic::AtomicU64::new(
                self.host_timeout_ms
                    .load(std::sync::atomic::Ordering::Relaxed),
            ),
        }))
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }
    /// The CUDA context of this rank's GPU.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The raw NCCL handle, for NCCL calls of the caller's own; `None` for a
    /// virtual rank and after [`Communicator::abort`].
    pub fn raw(&self) -> Option<ncclComm_t> {
        if self.is_aborted() {
            return None;
        }
        match self.backend {
            Backend::Nccl { raw, .. } => Some(raw),
            Backend::Virtual(_) => None,
        }
    }

    /// The in-process group of a virtual rank.
    pub(crate) fn host_group(&self) -> Option<&HostGroup> {
        match &self.backend {
            Backend::Virtual(g) => Some(g),
            Backend::Nccl { .. } => None,
        }
    }
    /// Ranks on this rank's host, in rank order (NVLink reachable candidates).
    pub fn node_ranks(&self) -> Vec<usize> {
        (0..self.world)
            .filter(|&r| self.node_of[r] == self.node_of[self.rank])
            .collect()
    }

    /// The id of the next symmetric window registered here: 1, 2, ... in
    /// registration order, so the same window has the same id on every
    /// rank (registrations are collective).
    pub(crate) fn next_window_id(&self) -> u64 {
        self.windows
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// The lock every NCCL call on this communicator holds (one call at a
    /// time, from whichever thread).
    pub(crate) fn nccl_calls(&self) -> std::sync::MutexGuard<'_, ()> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reports an asynchronous NCCL error, if any.
    pub fn check_async(&self) -> Result<()> {
        let Backend::Nccl { raw, .. } = self.backend else {
            return Ok(());
        };
        let _one_call = self.nccl_calls();
        self.live()?;
        // SAFETY: raw is live for self's lifetime (not aborted, checked above).
        let code = unsafe { nc::comm_get_async_error(raw)? };
        nc::check("ncclCommGetAsyncError(async)", code, Some(raw))
    }

    /// Gathers `value` (same length on every rank) from every rank, in rank
    /// order, after the work enqueued on `stream` so far has finished (on
    /// every rank). Collective and synchronous: set-up paths only.
    pub fn all_gather_host<T: bytemuck::Pod + Send + Sync>(
        &self,
        stream: &Arc<CudaStream>,
        value: &[T],
    ) -> Result<Vec<T>> {
        let raw = match &self.backend {
            Backend::Nccl { raw, .. } => *raw,
            Backend::Virtual(g) => {
                stream
                    .synchronize()
                    .map_err(Error::cuda("cuStreamSynchronize"))?;
                return g.all_gather("all_gather_host", value);
            }
        };
        let bytes: &[u8] = bytemuck::cast_slice(value);
        let n = bytes.len().max(1);
        // Drained before the pageable copies (see `Handle::host_counts`).
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let mut send = stream
            .alloc_zeros::<u8>(n)
            .map_err(Error::cuda("cuMemAlloc"))?;
        stream
            .memcpy_htod(bytes, &mut send)
            .map_err(Error::cuda("cuMemcpyHtoD"))?;
        let recv = stream
            .alloc_zeros::<u8>(n * self.world)
            .map_err(Error::cuda("cuMemAlloc"))?;
        {
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let (s, _g1) = send.device_ptr(stream);
            let mut recv = recv;
            let (r, _g2) = recv.device_ptr_mut(stream);
            {
                // The lock only while NCCL enqueues: the wait below is
                // outside it, so that `abort` can take it and end the wait.
                let _one_call = self.nccl_calls();
                self.live()?;
                // SAFETY: both buffers live until the stream sync below.
                unsafe {
                    nc::all_gather(
                        s as *const c_void,
                        r as *mut c_void,
                        n,
                        ncclUint8 as ncclDataType_t,
                        raw,
                        stream.cu_stream() as *mut c_void,
                    )?;
                }
            }
            drop((_g1, _g2));
            let done = stream
                .record_event(None)
                .map_err(Error::cuda("cuEventRecord"))?;
            if let Err(e) = self.wait_for_ranks(&done, "all_gather_host") {
                // The all-gather may still be pending: its buffers outlive it.
                std::mem::forget(send);
                std::mem::forget(recv);
                return Err(e);
            }
            // Aborted on another thread meanwhile: what arrived is not
            // every rank's.
            self.live()?;
            let out: Vec<u8> = stream
                .clone_dtoh(&recv)
                .map_err(Error::cuda("cuMemcpyDtoH"))?;
            stream
                .synchronize()
                .map_err(Error::cuda("cuStreamSynchronize"))?;
            let mut v = vec![T::zeroed(); value.len() * self.world];
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
            for r in 0..self.world {
                dst[r * bytes.len()..(r + 1) * bytes.len()]
                    .copy_from_slice(&out[r * n..r * n + bytes.len()]);
            }
            Ok(v)
        }
    }

    /// Waits on the host for `done` (the event after an NCCL host
    /// collective), at most the host timeout. Past it the collective is
    /// given up, on this rank: an owned communicator is aborted (NCCL's
    /// calls end no other way; its groups then refuse work), a lent one is
    /// left to its owner to abort. NCCL cannot say which rank did not come.
    fn wait_for_ranks(&self, done: &cudarc::driver::CudaEvent, what: &'static str) -> Result<()> {
        let timeout = self.host_timeout();
        let t0 = std::time::Instant::now();
        let mut polls = 0u32;
        while !done
            .try_is_complete()
            .map_err(Error::cuda("cuEventQuery"))?
        {
            if t0.elapsed() >= timeout {
                let owned = matches!(self.backend, Backend::Nccl { owned: true, .. });
                if owned {
                    let _ = self.abort();
                }
                return Err(Error::CollectiveFailed {
                    rank: self.rank,
                    collective: what,
                    missing: vec![],
                    reason: format!(
                        "not every rank came within {timeout:?} (NCCL does not say which); {}",
                        if owned {
                            "the communicator was aborted to end the wait: make a new one"
                        } else {
                            "the NCCL call is still pending on the lent communicator: abort it (ncclCommAbort)"
                        }
                    ),
                });
            }
            polls += 1;
            if polls < 2000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(())
    }

    /// How long an NCCL host collective waits for the slowest rank
    /// ([`NCCL_HOST_TIMEOUT`] unless set); a virtual world's host
    /// collectives wait as long as its creation said.
    pub fn host_timeout(&self) -> Duration {
        Duration::from_millis(
            self.host_timeout_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Bounds the wait of this rank's NCCL host collectives (the
    /// all-gathers of group creation, `EpGroup::check` and the two-level
    /// layout) for the slowest rank; past it the collective fails with
    /// [`Error::CollectiveFailed`] and an owned communicator is aborted.
    /// Set it alike on every rank. A virtual world's bound is set at its
    /// creation ([`Communicator::virtual_world_with_timeout`]): refused
    /// here, naming `timeout`. Zero is refused.
    pub fn set_host_timeout(&self, timeout: Duration) -> Result<()> {
        if self.is_virtual() {
            return Err(Error::arg(
                "timeout",
                "a bound set at the virtual world's creation (Communicator::virtual_world_with_timeout)",
                "set_host_timeout on a virtual rank",
            ));
        }
        if timeout.is_zero() {
            return Err(Error::arg("timeout", "a positive duration", "0"));
        }
        self.host_timeout_ms.store(
            timeout.as_millis().max(1) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(())
    }

    /// A barrier over the communicator after the work enqueued on `stream`
    /// (an all-gather of one byte), waited for on the host.
    pub fn barrier(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if let Backend::Virtual(g) = &self.backend {
            stream
                .synchronize()
                .map_err(Error::cuda("cuStreamSynchronize"))?;
            return g.barrier();
        }
        self.all_gather_host(stream, &[0u8]).map(|_| ())
    }

    /// Aborts the communicator: unblocks this rank's pending NCCL calls (on
    /// a virtual rank, fails every pending and later host collective of the
    /// world). Works while windows, pools and groups still hold it: from
    /// then on their host collectives fail with `Error::InvalidState`
    /// ("aborted"), and nothing more is freed through NCCL (its resources
    /// went with the abort). Make a new communicator and group to go on.
    ///
    /// From any thread, at any time: it does not wait for a call in
    /// progress on another thread (NCCL's abort ends such a call). Every
    /// group made on this communicator is told first: its running kernels
    /// stop at their next look at their error word (within microseconds
    /// where they wait), and every later op on it is refused naming the
    /// abort.
    pub fn abort(&self) -> Result<()> {
        let first = !self.aborted.swap(true, std::sync::atomic::Ordering::AcqRel);
        if first {
            let hooks =
                std::mem::take(&mut *self.abort_hooks.lock().unwrap_or_else(|p| p.into_inner()));
            for h in hooks.iter().filter_map(|w| w.upgrade()) {
                h();
            }
        }
        if let Backend::Virtual(g) = &self.backend {
            g.abort();
            return Ok(());
        }
        let Backend::Nccl { raw, owned } = self.backend else {
            return Ok(());
        };
        if !first || !owned {
            return Ok(());
        }
        // SAFETY: we own raw; every later NCCL call on it is refused
        // (`aborted`, checked with `calls` held) and drop skips its destroy.
        // NOTE: not under `calls`: a call blocked on another thread (a
        // window registration or an all-gather whose peer never comes)
        // may hold it, and this is what ends that call.
        unsafe { nc::comm_abort(raw) }
    }

    /// Registers what `abort` tells a group made on this communicator
    /// (held weakly: a dropped group is skipped).
    pub(crate) fn on_abort(&self, hook: std::sync::Weak<dyn Fn() + Send + Sync>) {
        let mut hooks = self.abort_hooks.lock().unwrap_or_else(|p| p.into_inner());
        hooks.retain(|w| w.strong_count() > 0);
        hooks.push(hook);
    }

    /// Refuses an NCCL call on an aborted communicator.
    fn live(&self) -> Result<()> {
        if self.aborted.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::InvalidState(format!(
                "rank {}: the communicator was aborted; make a new one",
                self.rank
            )));
        }
        Ok(())
    }

    /// Whether [`Communicator::abort`] was called on this rank.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // A virtual rank leaves its group when its HostGroup drops.
        let Backend::Nccl { raw, owned: true } = self.backend else {
            return;
        };
        if self.is_aborted() {
            return; // ncclCommAbort freed it
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: we own raw; every window/segment holding an Arc is gone.
        unsafe {
            if let Err(e) = nc::comm_finalize(raw) {
                tracing::warn!("ncclCommFinalize failed in drop: {e}");
            }
            if let Err(e) = nc::comm_destroy(raw) {
                tracing::warn!("ncclCommDestroy failed in drop: {e}");
            }
        }
    }
}

/// Stops the device's stream-ordered memory pool from making one stream wait
/// for another to reuse memory freed there
/// (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES` off): the ranks of a
/// virtual world allocate from one pool on their own streams, and such a
/// dependency would make a rank's next allocation wait behind a sibling's
/// kernel that is itself waiting for this rank. Reuse of memory whose free
/// has completed, and reuse along event dependencies, stay on.
fn no_cross_stream_reuse(ctx: &Arc<CudaContext>) -> Result<()> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()
        .map_err(Error::cuda("cuCtxSetCurrent"))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: out-parameter of the device's current pool.
    let rc = unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Cuda {
            context: "cuDeviceGetMemPool",
            source: cudarc::driver::DriverError(rc),
        });
    }
    let mut off: i32 = 0;
    // SAFETY: the attribute takes an int.
    let rc = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            &mut off as *mut i32 as *mut c_void,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Cuda {
            context: "cuMemPoolSetAttribute(REUSE_ALLOW_INTERNAL_DEPENDENCIES)",
            source: cudarc::driver::DriverError(rc),
        });
    }
    Ok(())
}

/// A key equal for processes on the same host: hash of the host name.
fn host_key() -> u64 {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mut h: u64 = 0xcbf29ce484222325;
    for b in name.trim().bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::first_appearance;

    #[test]
    fn first_appearance_numbers_keys_in_order() {
        assert_eq!(first_appearance(&[7u64, 3, 7, 5]), vec![0, 1, 0, 2]);
        assert_eq!(first_appearance(&[4usize, 4, 4]), vec![0, 0, 0]);
        assert_eq!(first_appearance::<u64>(&[]), Vec::<usize>::new());
        // A split's members keep their parent's nodes, renumbered from 0.
        let parent_nodes = [0usize, 0, 1, 1, 2, 2];
        let members = [2usize, 3, 4];
        let sub: Vec<usize> = members.iter().map(|&r| parent_nodes[r]).collect();
        assert_eq!(first_appearance(&sub), vec![0, 0, 1]);
    }
}
