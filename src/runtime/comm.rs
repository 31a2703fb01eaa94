//! `Communicator`: an NCCL communicator bound to one GPU, owned (created from
//! a unique id) or borrowed (a caller's existing `ncclComm_t`).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{CudaContext, CudaStream};

use crate::error::{Error, Result};
use crate::runtime::nccl_call::{self as nc, UniqueId};
use crate::symm::Segment;
use crate::sys::nccl::{ncclComm_t, ncclDataType_t, ncclUint8};

/// An NCCL communicator of `world` ranks, this process being `rank`, on the
/// GPU of `ctx`. Windows and pool segments keep it alive (`Arc`).
pub struct Communicator {
    raw: ncclComm_t,
    owned: bool,
    rank: usize,
    world: usize,
    ctx: Arc<CudaContext>,
    /// `node_of[r]`: index of rank r's host, in order of first appearance.
    node_of: Vec<usize>,
    /// Every registered window of this communicator (pool segments and
    /// wrapped caller windows), for `is_symm_backed`.
    segments: Mutex<Vec<Weak<Segment>>>,
}

// SAFETY: NCCL communicators may be used from any thread, one call at a time;
// every call here goes through &self on the owning rank's thread in practice.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

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
            raw,
            owned,
            rank,
            world,
            ctx: ctx.clone(),
            node_of: vec![0; world],
            segments: Mutex::new(vec![]),
        };
        let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        let keys = c.all_gather_host(&stream, &[host_key()])?;
        let mut seen: Vec<u64> = Vec::new();
        for (r, k) in keys.iter().enumerate() {
            c.node_of[r] = seen.iter().position(|s| s == k).unwrap_or_else(|| {
                seen.push(*k);
                seen.len() - 1
            });
        }
        Ok(Arc::new(c))
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
    /// The raw handle, for NCCL calls of the caller's own.
    pub fn raw(&self) -> ncclComm_t {
        self.raw
    }
    /// Ranks on this rank's host, in rank order (NVLink reachable candidates).
    pub fn node_ranks(&self) -> Vec<usize> {
        (0..self.world)
            .filter(|&r| self.node_of[r] == self.node_of[self.rank])
            .collect()
    }

    /// Records a registered window (called by `Segment`).
    pub(crate) fn register_segment(&self, seg: &Arc<Segment>) {
        let mut v = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(seg));
    }

    /// The live registered window of this communicator that holds
    /// `[ptr, ptr + len)`, if any.
    pub fn segment_of(&self, ptr: u64, len: usize) -> Option<Arc<Segment>> {
        let v = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        v.iter()
            .filter_map(|w| w.upgrade())
            .find(|s| s.contains(ptr, len))
    }

    /// True if `[ptr, ptr + len)` lies inside a registered window of this
    /// communicator (a pool buffer or a wrapped caller window).
    pub fn is_symm_backed(&self, ptr: u64, len: usize) -> bool {
        self.segment_of(ptr, len).is_some()
    }

    /// Reports an asynchronous NCCL error, if any.
    pub fn check_async(&self) -> Result<()> {
        // SAFETY: raw is live for self's lifetime.
        let code = unsafe { nc::comm_get_async_error(self.raw)? };
        nc::check("ncclCommGetAsyncError(async)", code, Some(self.raw))
    }

    /// Gathers `value` (same length on every rank) from every rank, in rank
    /// order. Collective and synchronous: set-up paths only.
    pub fn all_gather_host<T: bytemuck::Pod>(
        &self,
        stream: &Arc<CudaStream>,
        value: &[T],
    ) -> Result<Vec<T>> {
        let bytes: &[u8] = bytemuck::cast_slice(value);
        let n = bytes.len().max(1);
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
            // SAFETY: both buffers live until the stream sync below.
            unsafe {
                nc::all_gather(
                    s as *const c_void,
                    r as *mut c_void,
                    n,
                    ncclUint8 as ncclDataType_t,
                    self.raw,
                    stream.cu_stream() as *mut c_void,
                )?;
            }
            drop((_g1, _g2));
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

    /// A barrier over the communicator on `stream` (an all-reduce of one byte),
    /// waited for on the host.
    pub fn barrier(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.all_gather_host(stream, &[0u8]).map(|_| ())
    }

    /// Aborts the communicator (unblocks peers' pending NCCL calls).
    pub fn abort(self: Arc<Self>) -> Result<()> {
        match Arc::try_unwrap(self) {
            Ok(mut c) => {
                let owned = std::mem::replace(&mut c.owned, false);
                if owned {
                    // SAFETY: we own raw and nothing else references it.
                    unsafe { nc::comm_abort(c.raw) }
                } else {
                    Ok(())
                }
            }
            Err(_) => Err(Error::InvalidState(
                "abort: the communicator is still used by windows or groups".into(),
            )),
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: we own raw; every window/segment holding an Arc is gone.
        unsafe {
            if let Err(e) = nc::comm_finalize(self.raw) {
                eprintln!("moe-ep: ncclCommFinalize failed in drop: {e}");
            }
            if let Err(e) = nc::comm_destroy(self.raw) {
                eprintln!("moe-ep: ncclCommDestroy failed in drop: {e}");
            }
        }
    }
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
