//! Communicators and groups: the handles `moe_ep_comm_t` ([`CComm`]) and
//! `moe_ep_group_t` ([`CGroup`], of one node or of several), the caller's
//! stream checked against the communicator's context, and the calls on
//! devices, communicators (`moe_ep_device_count`, `moe_ep_unique_id_create`,
//! `moe_ep_comm_*`) and groups (`moe_ep_group_config_validate`,
//! `moe_ep_group_create` and the other `moe_ep_group_*`, the memory
//! footprint `moe_ep_group_memory_footprint` among them).

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use moe_ep::cuda::{CudaContext, CudaStream};
use moe_ep::error::{Error, Result};
use moe_ep::ops::{EpGroup, GroupConfig, Mode, Overflow, RefusedCall};
use moe_ep::runtime::{Communicator, UniqueId};
use moe_ep::symm::SymmPool;

use crate::status::{
    boxed, device_of, ffi, obj, out_ptr, to_usize, unboxed, Status, MOE_EP_MODE_HIGH_THROUGHPUT,
    MOE_EP_MODE_LOW_LATENCY, MOE_EP_OVERFLOW_DROP, MOE_EP_OVERFLOW_ERROR, MOE_EP_PADDING_UNTOUCHED,
    MOE_EP_PADDING_ZERO,
};
use crate::structs::{
    head, read_in, write_out, CGroupConfig, CMemoryFootprint, CUniqueId, Versioned,
};

/// `moe_ep_comm_t`.
pub struct CComm(Arc<Communicator>);
/// `moe_ep_group_t`: a group of one node (the NVLink path) or of several
/// (`ranks_per_node` below the world: the two-level path), as
/// `EpGroup::new` picks; shared with the low-latency handles made by it.
pub struct CGroup(pub(crate) Arc<EpGroup>);
impl CGroup {
    pub(crate) fn comm(&self) -> &Arc<Communicator> {
        self.0.comm()
    }
    /// The group, which the low-latency mode needs of one node; a group of
    /// several nodes is refused naming `group`.
    pub(crate) fn node(&self) -> Result<&Arc<EpGroup>> {
        if self.0.is_two_level() {
            return Err(Error::arg(
                "group",
                "a low-latency group (MOE_EP_MODE_LOW_LATENCY, one node)",
                format!(
                    "a high-throughput group of {} nodes",
                    self.0.topology().nodes()
                ),
            ));
        }
        Ok(&self.0)
    }
    pub(crate) fn pool(&self) -> &SymmPool {
        self.0.pool()
    }
}

/// The caller's stream, wrapped without taking it over: it must belong to
/// the communicator's context (checked with `cuStreamGetCtx`).
pub(crate) unsafe fn stream_of(ctx: &Arc<CudaContext>, s: *mut c_void) -> Result<Arc<CudaStream>> {
    // SAFETY: the header makes the caller keep the stream alive while the
    // group and what it made with it live.
    unsafe { moe_ep::runtime::borrow_stream(ctx, s as u64) }
}

/// The group and the caller's stream of an op that takes no handle.
pub(crate) unsafe fn group_stream<'a>(
    group: *const CGroup,
    stream: *mut c_void,
) -> Result<(&'a CGroup, Arc<CudaStream>)> {
    // SAFETY: the header's contract for handles and streams.
    unsafe {
        let g = obj(group, "group")?;
        let s = stream_of(g.comm().context(), stream)?;
        Ok((g, s))
    }
}

/// Runs the C ABI's own checks of an op's call (`checks`: NULL pointers
/// with a length, dtype and enum codes, overlapping buffers, ...) and, where
/// they refuse it, publishes the refusal as `call` on `on`'s group and
/// stream ([`EpGroup::refuse`]), as the op's own refusals are published: no
/// peer waits for this rank, their `moe_ep_group_check` names this rank and
/// the argument. Returns the error to report: the checks', or one the op
/// would have returned first (the group holds an error, the communicator was
/// aborted, the handle is another group's or stale).
///
/// `on` is `None` where the group, the stream or the handle did not resolve
/// (NULL, a stream of another context; for a low-latency combine, a handle
/// of another group or of a batch not received yet): nothing can be
/// published, and the checks' error is returned as it is (the peers wait
/// until their timeout, which names this rank). An error of the op itself
/// is published by the op: only its caller's checks go through here.
pub(crate) fn checked<T>(
    on: Option<(&CGroup, &Arc<CudaStream>, RefusedCall<'_>)>,
    checks: impl FnOnce() -> Result<T>,
) -> Result<T> {
    checks().map_err(|e| match on {
        Some((g, s, call)) => g.0.refuse(s, call, e),
        None => e,
    })
}

// ---- devices and communicators -----------------------------------------

#[no_mangle]
pub unsafe extern "C" fn moe_ep_device_count(out: *mut c_int) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        let n = moe_ep::device_count()?;
        // SAFETY: checked non-null; the caller's int.
        unsafe { *out = n.min(c_int::MAX as usize) as c_int };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_unique_id_create(out: *mut CUniqueId) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        let bytes = UniqueId::generate()?.to_bytes();
        // SAFETY: checked non-null; 128 bytes.
        unsafe { (*out).internal = bytes.map(|b| b as c_char) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_init(
    device: c_int,
    id: *const CUniqueId,
    rank: c_int,
    world: c_int,
    out: *mut *mut CComm,
) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        let id = unsafe { obj(id, "id") }?;
        let world = usize::try_from(world).map_err(|_| Error::arg("world", ">= 1", world))?;
        let rank = usize::try_from(rank)
            .map_err(|_| Error::arg("rank", format!("a rank in 0..{world}"), rank))?;
        let device = device_of("device", device)?;
        let ctx = moe_ep::context(device)?;
        let id = UniqueId::from_bytes(id.internal.map(|b| b as u8));
        let comm = Communicator::init(&ctx, &id, rank, world)?;
        // SAFETY: checked non-null.
        unsafe { *out = boxed(CComm(comm)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_borrow_nccl(
    device: c_int,
    nccl: *mut c_void,
    out: *mut *mut CComm,
) -> Status {
    ffi(|| {
        let out = out_ptr(out, "out")?;
        if nccl.is_null() {
            return Err(Error::arg("nccl", "a live ncclComm_t", "NULL"));
        }
        let device = device_of("device", device)?;
        let ctx = moe_ep::context(device)?;
        let raw = nccl as moe_ep::sys::nccl::ncclComm_t;
        // SAFETY: the caller's live communicator (the header's contract).
        let on = unsafe { moe_ep::runtime::nccl_call::comm_cu_device(raw)? };
        if on != device {
            return Err(Error::arg(
                "nccl",
                format!("a communicator of GPU {device} (the `device` argument)"),
                format!("a communicator of GPU {on}"),
            ));
        }
        // SAFETY: live, of this device, outliving the handle (the contract).
        let comm = unsafe { Communicator::borrow_raw(&ctx, raw)? };
        // SAFETY: checked non-null.
        unsafe { *out = boxed(CComm(comm)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_create_virtual(
    device: c_int,
    world: c_int,
    comms: *mut *mut CComm,
) -> Status {
    ffi(|| {
        let comms = out_ptr(comms, "comms")?;
        let world = usize::try_from(world)
            .ok()
            .filter(|&w| w >= 1)
            .ok_or_else(|| Error::arg("world", "at least 1 virtual rank", world))?;
        let device = device_of("device", device)?;
        let ctx = moe_ep::context(device)?;
        let all = Communicator::virtual_world(&ctx, world)?;
        for (r, c) in all.into_iter().enumerate() {
            // SAFETY: the caller's array of `world` pointers.
            unsafe { *comms.add(r) = boxed(CComm(c)) };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_destroy(comm: *mut CComm) -> Status {
    ffi(|| {
        // SAFETY: a handle of ours, destroyed once (the contract).
        unsafe { unboxed(comm) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_rank(comm: *const CComm, out: *mut c_int) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        unsafe { *out = c.0.rank() as c_int };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_world(comm: *const CComm, out: *mut c_int) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        unsafe { *out = c.0.world() as c_int };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_max_sms(
    comm: *const CComm,
    num_experts: u64,
    out: *mut u32,
) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        let e = to_usize("num_experts", num_experts)?;
        let n = moe_ep::ops::residency(&c.0, e)?.max_blocks_per_rank();
        unsafe { *out = n.min(u32::MAX as usize) as u32 };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_abort(comm: *mut CComm) -> Status {
    ffi(|| unsafe { obj(comm, "comm") }?.0.abort())
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_host_timeout(comm: *const CComm, out_ms: *mut u64) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out_ms, "out_ms")?;
        let ms = c.0.host_timeout().as_millis().min(u64::MAX as u128) as u64;
        unsafe { *out = ms };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_comm_set_host_timeout(
    comm: *const CComm,
    timeout_ms: u64,
) -> Status {
    ffi(|| {
        let c = unsafe { obj(comm, "comm") }?;
        c.0.set_host_timeout(std::time::Duration::from_millis(timeout_ms))
    })
}

// ---- groups -------------------------------------------------------------

pub(crate) fn group_config(c: &CGroupConfig) -> Result<GroupConfig> {
    let mut g = GroupConfig::new(
        to_usize("num_experts", c.num_experts)?,
        to_usize("hidden", c.hidden)?,
        to_usize("max_tokens_per_rank", c.max_tokens_per_rank)?,
    );
    g.recv_capacity = to_usize("recv_capacity", c.recv_capacity)?;
    if c.num_sms != 0 {
        g.num_sms = c.num_sms as usize;
    }
    if c.combine_chunks != 0 {
        g.combine_chunks = c.combine_chunks as usize;
    }
    g.mode = match c.mode {
        MOE_EP_MODE_HIGH_THROUGHPUT => Mode::HighThroughput,
        MOE_EP_MODE_LOW_LATENCY => Mode::LowLatency,
        m => {
            return Err(Error::arg(
                "mode",
                "MOE_EP_MODE_HIGH_THROUGHPUT (0) or MOE_EP_MODE_LOW_LATENCY (1)",
                m,
            ))
        }
    };
    if c.timeout_ms != 0 {
        g.timeout = Duration::from_millis(c.timeout_ms as u64);
    }
    // 0 (and a struct of ABI 1 or 2, which lacks the field) is one node.
    g.ranks_per_node = to_usize("ranks_per_node", c.ranks_per_node)?;
    // 0 (and a struct of ABI 4 or older) keeps the defaults: zeroed padding
    // rows, rows over the capacity an error.
    g.zero_padding = match c.padding {
        MOE_EP_PADDING_ZERO => true,
        MOE_EP_PADDING_UNTOUCHED => false,
        p => {
            return Err(Error::arg(
                "padding",
                "MOE_EP_PADDING_ZERO (0) or MOE_EP_PADDING_UNTOUCHED (1)",
                p,
            ))
        }
    };
    g.overflow = match c.overflow {
        MOE_EP_OVERFLOW_ERROR => Overflow::Error,
        MOE_EP_OVERFLOW_DROP => Overflow::Drop,
        o => {
            return Err(Error::arg(
                "overflow",
                "MOE_EP_OVERFLOW_ERROR (0) or MOE_EP_OVERFLOW_DROP (1)",
                o,
            ))
        }
    };
    Ok(g)
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_config_validate(
    cfg: *const CGroupConfig,
    world: c_int,
) -> Status {
    ffi(|| {
        let cfg = group_config(&unsafe { read_in(cfg, "cfg") }?)?;
        let world = usize::try_from(world).map_err(|_| Error::arg("world", ">= 1", world))?;
        cfg.validate(world)
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_create(
    comm: *const CComm,
    cfg: *const CGroupConfig,
    out: *mut *mut CGroup,
) -> Status {
    ffi(|| {
        let cfg = group_config(&unsafe { read_in(cfg, "cfg") }?)?;
        let c = unsafe { obj(comm, "comm") }?;
        let out = out_ptr(out, "out")?;
        // One node: the NVLink path; several: the two-level path.
        let g = Arc::new(EpGroup::new(&c.0, cfg)?);
        unsafe { *out = boxed(CGroup(g)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_destroy(group: *mut CGroup) -> Status {
    ffi(|| {
        // SAFETY: a handle of ours, destroyed once; dropping the last
        // reference (this or a low-latency handle's) waits for its work.
        unsafe { unboxed(group) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_check(group: *const CGroup) -> Status {
    ffi(|| unsafe { obj(group, "group") }?.0.check())
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_allow_graph_capture(group: *const CGroup) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        // SAFETY: the C caller takes on the contract the header states
        // (that of EpGroup::allow_graph_capture).
        unsafe { g.0.allow_graph_capture() };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_memory_footprint(
    group: *const CGroup,
    out: *mut CMemoryFootprint,
) -> Status {
    ffi(|| {
        unsafe { head(out, "out") }?;
        let g = unsafe { obj(group, "group") }?;
        let f = g.0.memory_footprint();
        let v = CMemoryFootprint {
            workspace: f.workspace,
            low_latency: f.low_latency,
            pool_other: f.pool_other,
            pool_free: f.pool_free,
            two_level: f.two_level,
            pinned_host: f.pinned_host,
            device_total: f.device_total(),
            ..CMemoryFootprint::init()
        };
        unsafe { write_out(out, "out", &v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn moe_ep_group_recv_capacity(group: *const CGroup, out: *mut u64) -> Status {
    ffi(|| {
        let g = unsafe { obj(group, "group") }?;
        let out = out_ptr(out, "out")?;
        let cap = g.0.recv_capacity();
        unsafe { *out = cap as u64 };
        Ok(())
    })
}
