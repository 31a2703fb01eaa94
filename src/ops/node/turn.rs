//! An op's turn on the one-node group: [`OpTurn`] (held while the op
//! checks its arguments and enqueues its kernels), the entry every op
//! starts with ([`NodeGroup::op`]: the group's turn and call number, the
//! error an earlier call left, the stream's context, the handle), the
//! refusal that tells the peers when an op fails before it launched
//! ([`Refuse`]), the ordering of the op with its buffers' streams, the
//! checks of the buffers themselves (length, alignment, device memory of
//! the group's GPU: [`NodeGroup::check_region`]; symmetric and located:
//! [`NodeGroup::located`]) and what every kernel's parameters start with
//! ([`NodeGroup::op_common`]).
//!
//! Kernels: `moe_ep_publish_refusal` (`kernels-cuda/layout.cu`). Tests:
//! `tests/gpu_intranode.rs` (refused calls on one rank; zero copy into
//! caller buffers; a plain buffer refused with `Error::NotSymmetric`; a
//! handle of another group refused).

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use cudarc::driver::CudaStream;

use super::group::{NodeGroup, OpStreams, Turns};
use super::handle::NodeHandle;
use crate::error::{Error, Result};
use crate::ops::abi::{self, desc, OpCommon, RefusalParams, DESC_WORDS, MAX_RANKS, SCAN_THREADS};
use crate::ops::buffers::{check_len, DeviceRegion, DeviceRegionMut, Peers, RecvBuf};
use crate::runtime::nvtx::{self, Range};

/// An op's turn on its group, held while the op checks its arguments and
/// enqueues its kernels: ops of one group never interleave (two threads on
/// one group are serialised), an op on another stream than the group's
/// previous one is ordered after everything enqueued there so far, and the
/// op is one call of the group (every op counts, on every rank: the call's
/// number is what its kernels' descriptors and flags carry).
pub(crate) struct OpTurn<'a> {
    group: &'a NodeGroup,
    _range: Range,
    pub(crate) turns: MutexGuard<'a, Turns>,
    /// The call's number on the group, as the host counts them (a
    /// layout's is its handle's id; the kernels count the calls
    /// themselves, `next_call` in intranode.cuh).
    pub(crate) call: u64,
    /// The op's descriptor code (`desc::OP_*`), for a refusal.
    op: u64,
    /// The op's stream, once bound (`None`: another context's stream).
    stream: Option<Arc<CudaStream>>,
    /// Set by the first launch: a refusal after it publishes nothing.
    pub(crate) launched: std::cell::Cell<bool>,
}

/// Where an op runs once it has its turn: the turn, the op's stream and
/// its handle (what every launcher of the one-node ops takes first).
#[derive(Clone, Copy)]
pub(crate) struct OnTurn<'a, 't> {
    pub(crate) turn: &'a OpTurn<'t>,
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) handle: &'a NodeHandle,
}

impl Drop for OpTurn<'_> {
    /// After the op's launches: every buffer's own stream waits for them.
    fn drop(&mut self) {
        self.group
            .op_streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .finish();
    }
}

impl OpTurn<'_> {
    /// The op's stream, once bound (`None`: the entry refused it).
    pub(crate) fn stream(&self) -> Option<&Arc<CudaStream>> {
        self.stream.as_ref()
    }
}

impl NodeGroup {
    /// Runs one op: its NVTX range `name`, the group's turn and the call's
    /// number, the error an earlier call left (refused at once), the
    /// stream's context, `handle` (this group's and made since the last
    /// cleared error), then `body`. When `body` (or the entry) refuses
    /// before anything was launched, every peer is told through the call's
    /// descriptor (`desc::OP_REFUSED`, naming the argument), so their
    /// kernels stop at once; later ops of this rank refuse until `check`.
    /// On a virtual world every op ends in a host barrier of the ranks
    /// (see [`Communicator::virtual_world`](crate::Communicator::virtual_world)).
    pub(crate) fn op<T>(
        &self,
        name: &'static str,
        op: u64,
        stream: &Arc<CudaStream>,
        handle: Option<&NodeHandle>,
        body: impl FnOnce(&OpTurn<'_>) -> Result<T>,
    ) -> Result<T> {
        self.op_with(name, op, stream, handle, Refuse::Descriptor, body)
    }

    /// [`NodeGroup::op`] whose refusal tells the peers as `refuse` says.
    pub(crate) fn op_with<T>(
        &self,
        name: &'static str,
        op: u64,
        stream: &Arc<CudaStream>,
        handle: Option<&NodeHandle>,
        refuse: Refuse<'_>,
        body: impl FnOnce(&OpTurn<'_>) -> Result<T>,
    ) -> Result<T> {
        let (out, refused) = {
            let mut turn = self.turn(name, op);
            let res = self
                .enter(&mut turn, stream, handle)
                .and_then(|()| body(&turn));
            match res {
                Ok(v) => (Ok(v), false),
                Err(e) => {
                    let (e, refused) = self.refused(turn, e, refuse);
                    (Err(e), refused)
                }
            }
        };
        match (out, self.virtual_barrier(refused)) {
            (Ok(v), Ok(())) => Ok(v),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    }

    /// The group's turn, the op's NVTX range and its call number.
    fn turn(&self, name: &'static str, op: u64) -> OpTurn<'_> {
        let range = nvtx::range(name);
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        turns.calls += 1;
        turns.unchecked = true;
        let call = turns.calls;
        OpTurn {
            group: self,
            _range: range,
            turns,
            call,
            op,
            stream: None,
            launched: std::cell::Cell::new(false),
        }
    }

    /// The checks every op starts with; orders `stream` after the group's
    /// previous op.
    fn enter(
        &self,
        turn: &mut OpTurn<'_>,
        stream: &Arc<CudaStream>,
        handle: Option<&NodeHandle>,
    ) -> Result<()> {
        if self.comm.is_aborted() {
            return Err(Error::InvalidState(format!(
                "rank {}: the communicator was aborted: every op of its groups is refused; make a new communicator and group",
                self.comm.rank()
            )));
        }
        self.pending_error()?;
        self.bind(stream)?;
        if !self.capture_allowed.load(Ordering::Relaxed) && crate::symm::capturing(stream) {
            return Err(Error::arg(
                "stream",
                "a stream that does not capture a CUDA graph (capture is allowed once the caller takes on its contract: unsafe NodeGroup::allow_graph_capture)",
                "a capturing stream",
            ));
        }
        turn.stream = Some(stream.clone());
        if let Some(prev) = turn
            .turns
            .last
            .as_ref()
            .filter(|p| p.cu_stream() != stream.cu_stream())
        {
            // The group's kernels share its workspace: this op waits for
            // what the previous stream has been given.
            stream
                .join(prev)
                .map_err(Error::cuda("cuStreamWaitEvent"))?;
        }
        turn.turns.last = Some(stream.clone());
        *self.op_streams.lock().unwrap_or_else(|p| p.into_inner()) = OpStreams::start(stream);
        if let Some(h) = handle {
            self.check_handle(h, turn.turns.epoch)?;
            self.mark_used(&h.meta)?;
        }
        Ok(())
    }

    /// An op that failed: unless the failure is one every rank already
    /// shares (an error the group holds, an aborted communicator) or the
    /// op launched its kernels, this rank's part of the call is published
    /// as refused, naming the argument of `e`, so that no peer waits for it;
    /// this rank's `check` then names the refusal (unless every rank refused
    /// the call: nothing is then out of step). Returns `e` and whether it
    /// was this rank's own refusal (not an error every rank shares).
    fn refused(&self, mut turn: OpTurn<'_>, e: Error, refuse: Refuse<'_>) -> (Error, bool) {
        let dead = self.poisoned.load(Ordering::Relaxed) || self.comm.is_aborted();
        // An error this rank's kernels already hold (its peers found it
        // too): the call is skipped, not refused.
        let shared = self.error.read().code != abi::code::OK;
        // Nothing is launched into a graph being captured (it would run at
        // every launch of the graph, not now).
        let capturing = turn
            .stream
            .as_ref()
            .is_some_and(|s| crate::symm::capturing(s));
        if !dead && !capturing && !turn.launched.get() {
            // Every call is one kernel on every rank, whatever happens to it
            // (the group's call counts stay in step).
            let told = match refuse {
                Refuse::Descriptor => {
                    let word = if shared {
                        desc::OP_STOPPED
                    } else {
                        desc::OP_REFUSED | (turn.op << 8) | (refused_arg(&e) << 16)
                    };
                    self.publish_refusal(&turn, word)
                }
                // A send that moves no rows: its peers' receives wait for
                // every sender.
                Refuse::With(f) => f(&turn, refused_arg(&e)),
                Refuse::Quiet => Ok(()),
            };
            if let Err(p) = told {
                tracing::warn!("telling the peers of a refused call failed: {p}");
            }
        }
        if !shared && !dead && turn.turns.refused.is_none() {
            turn.turns.refused = Some(format!(
                "this rank refused call {} ({}): {e}",
                turn.call,
                desc::op_name(turn.op)
            ));
        }
        (e, !shared && !dead)
    }

    /// Launches the refusal of `turn`'s call (moe_ep_publish_refusal, whose
    /// descriptor's word 0 is `word`) on its stream, or, where the op never
    /// got a stream of this context, on the group's own stream after the
    /// group's last op.
    fn publish_refusal(&self, turn: &OpTurn<'_>, word: u64) -> Result<()> {
        self.comm
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let stream = match &turn.stream {
            Some(s) => s.clone(),
            None => {
                if let Some(last) = &turn.turns.last {
                    self.own_stream
                        .join(last)
                        .map_err(Error::cuda("cuStreamWaitEvent"))?;
                }
                self.own_stream.clone()
            }
        };
        let mut d = [0u64; DESC_WORDS];
        d[0] = word;
        let p = RefusalParams {
            op: self.op_base(),
            desc: d,
            _pad: 0,
        };
        // SAFETY: p mirrors RefusalParams; the kernel writes only the peers'
        // descriptor slots of this call, inside their workspaces.
        unsafe {
            self.k
                .publish_refusal
                .launch(&stream, 1, SCAN_THREADS, 0, &p)
        }
    }

    /// On a virtual world, waits (bounded by the group's timeout) until
    /// every rank has enqueued the op: the ranks' streams share the GPU's
    /// hardware queues, where a rank's later work queued ahead of a
    /// sibling's earlier op would keep that op from starting while this
    /// rank's kernels wait for it.
    /// A rank that does not come within twice the group's timeout leaves
    /// the ops out of step: the group is then unusable on the ranks that
    /// came. Once this rank holds an error, or it and a peer parted on a
    /// refusal (one's host refused a call the other made: `refused` says
    /// this call was refused here), the wait ends at once until `check`
    /// (its kernels skip every call, or meet peers that stopped on the
    /// refusal; `check` counts every rank in step again): the ranks'
    /// programs may then make different calls (a rank retries the call its
    /// host refused). Ranks that all refused the same call stay in step and
    /// paced.
    fn virtual_barrier(&self, refused: bool) -> Result<()> {
        let Some(b) = &self.op_barrier else {
            return Ok(());
        };
        let holds_error =
            || self.poisoned.load(Ordering::Relaxed) || self.error.read().code != abi::code::OK;
        b.arrive(
            self.comm.rank(),
            "op (virtual ranks enqueue every op in step)",
            // Twice the kernels' bound: a rank that does not come is found
            // first by the kernels that wait for it (naming it), which ends
            // this wait (an error held).
            2 * self.cfg.timeout,
            refused,
            &holds_error,
        )
        .inspect_err(|_| self.poisoned.store(true, Ordering::Relaxed))
    }

    /// Orders the current op after the work enqueued so far on `home` (a
    /// buffer's own stream, when it is not the op's), once per op; the op's
    /// end orders `home` after it ([`OpTurn`]'s drop).
    pub(crate) fn order_with(&self, home: &Arc<CudaStream>) -> Result<()> {
        self.op_streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .order_with(home)
    }

    /// Tells `r` that the current op uses it on the op's stream (symmetric
    /// buffers order their release by it).
    pub(crate) fn mark_used<T>(&self, r: &dyn DeviceRegion<T>) -> Result<()> {
        let op = self
            .op_streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .op
            .clone();
        match op {
            Some(op) => r.used_on(&op),
            None => Ok(()),
        }
    }

    /// Refuses a handle that another group's layout made, or one made
    /// before the last error `check` cleared (its routing or its dispatch
    /// may have been skipped by that error).
    fn check_handle(&self, handle: &NodeHandle, epoch: u64) -> Result<()> {
        if handle.group != self.id {
            return Err(Error::arg(
                "handle",
                format!("a handle made by this group's layout (group {})", self.id),
                format!("a handle of group {}", handle.group),
            ));
        }
        if handle.epoch != epoch {
            return Err(Error::arg(
                "handle",
                "a handle made since the last error check() cleared (the error may have skipped its layout or dispatch on some rank): make a new one with layout",
                "a handle made before that error",
            ));
        }
        Ok(())
    }

    /// What every kernel of an op is told that is not a handle's: the
    /// group's workspace and error report, its sizes.
    pub(crate) fn op_base(&self) -> OpCommon {
        OpCommon {
            ws: self.ws_peers,
            w: self.w,
            error: self.error.device_ptr(),
            timeout_ns: self.timeout_ns(),
            rank: self.comm.rank() as i32,
            world: self.comm.world() as i32,
            hidden: self.cfg.hidden as i32,
            num_experts: self.cfg.num_experts as i32,
            alignment: 1,
            recv_capacity: self.recv_capacity as i32,
            num_blocks: self.cfg.num_sms as i32,
            ..Default::default()
        }
    }

    /// What every kernel of an op on `handle` is told: the group's
    /// workspace and error report, the handle's arrays and the call's shape.
    pub(crate) fn op_common(&self, handle: &NodeHandle) -> OpCommon {
        let (layout, alignment) = handle.layout.kind();
        OpCommon {
            bufs: handle.bufs(),
            // The rows this rank's buffers of the handle's ops hold (what
            // the kernels bound a peer's row indices by).
            recv_capacity: handle.rows_held(self.recv_capacity) as i32,
            num_tokens: handle.num_tokens as i32,
            topk: handle.topk as i32,
            layout,
            alignment,
            ..self.op_base()
        }
    }
}

/// The high-throughput ops, for a refusal their caller makes
/// ([`NodeGroup::refuse_op`]).
#[derive(Clone, Copy)]
pub(crate) enum Op {
    Layout,
    Dispatch,
    Combine,
    DispatchBackward,
    CombineBackward,
}

impl Op {
    /// The op's NVTX name and descriptor code, as the op itself has them.
    fn name_and_code(self) -> (&'static str, u64) {
        match self {
            Op::Layout => ("moe_ep::layout", desc::OP_LAYOUT),
            Op::Dispatch => ("moe_ep::dispatch", desc::OP_DISPATCH),
            Op::Combine => ("moe_ep::combine", desc::OP_COMBINE),
            Op::DispatchBackward => ("moe_ep::dispatch_backward", desc::OP_DISPATCH_BWD),
            Op::CombineBackward => ("moe_ep::combine_backward", desc::OP_COMBINE_BWD),
        }
    }
}

impl NodeGroup {
    /// `op`, refused on this rank with `e` before its own checks ran
    /// ([`EpGroup::refuse`](crate::EpGroup::refuse)): the entry's checks,
    /// then the refusal the op would publish for `e`. Returns the error.
    pub(crate) fn refuse_op(
        &self,
        stream: &Arc<CudaStream>,
        op: Op,
        handle: Option<&NodeHandle>,
        e: Error,
    ) -> Error {
        let (name, code) = op.name_and_code();
        refusal(self.op(name, code, stream, handle, |_| Err(e)))
    }
}

/// The error of an op whose body always fails.
pub(crate) fn refusal(r: Result<std::convert::Infallible>) -> Error {
    match r {
        Err(e) => e,
        Ok(never) => match never {},
    }
}

/// How a refused op tells its peers.
pub(crate) enum Refuse<'r> {
    /// The high-throughput ops: the call's descriptor says so
    /// (`moe_ep_publish_refusal`).
    Descriptor,
    /// Another way (the low-latency dispatch sends: a send that moves no
    /// rows), given the op's turn and the refused argument's id.
    With(&'r dyn Fn(&OpTurn<'_>, u64) -> Result<()>),
    /// Not at all (ops no peer waits for; the low-latency combines, see
    /// `ll_combine_send`).
    Quiet,
}

/// The argument a refused call names to its peers ([`abi::arg_id`]).
pub(crate) fn refused_arg(e: &Error) -> u64 {
    match e {
        Error::InvalidArgument { arg, .. } => abi::arg_id(arg),
        Error::NotSymmetric { what } => abi::arg_id(what),
        _ => 0,
    }
}

impl NodeGroup {
    /// Checks a buffer before it goes to a kernel: at least `want` elements
    /// (holding `what`), its address aligned to `align` bytes, and device
    /// memory of this group's GPU (not host memory, not another GPU's);
    /// each failure is an `InvalidArgument` naming `arg`. An empty region is
    /// never touched and passes.
    pub(crate) fn check_region<T>(
        &self,
        arg: &'static str,
        r: &dyn DeviceRegion<T>,
        want: usize,
        what: &str,
        align: usize,
    ) -> Result<()> {
        if let Some(home) = r.home_stream() {
            self.order_with(home)?;
        }
        self.mark_used(r)?;
        self.check_region_only(arg, r, want, what, align)
    }

    /// [`NodeGroup::check_region`] for an op that is not this group's own (the
    /// two-level path's, around its node group's ops): the region is
    /// ordered with the op through `order`, the op's own ordering.
    pub(crate) fn check_region_in<T>(
        &self,
        order: &mut OpStreams,
        arg: &'static str,
        r: &dyn DeviceRegion<T>,
        want: usize,
        what: &str,
        align: usize,
    ) -> Result<()> {
        order.use_region(r)?;
        self.check_region_only(arg, r, want, what, align)
    }

    /// The checks of [`NodeGroup::check_region`] without the ordering.
    fn check_region_only<T>(
        &self,
        arg: &'static str,
        r: &dyn DeviceRegion<T>,
        want: usize,
        what: &str,
        align: usize,
    ) -> Result<()> {
        check_len(arg, r.len(), want, what)?;
        r.num_bytes_checked(arg)?;
        if want == 0 {
            return Ok(());
        }
        let ptr = r.device_ptr();
        self.check_device_memory(arg, ptr, r.num_bytes_checked(arg)?)?;
        if !(ptr as usize).is_multiple_of(align) {
            return Err(Error::arg(
                arg,
                format!("a {align}-byte aligned device address ({what})"),
                format!("{ptr:#x}"),
            ));
        }
        Ok(())
    }

    /// `[ptr, ptr + bytes)` must be device memory of this group's GPU, in
    /// one allocation. A registered window of the group's communicator is
    /// known to be (the whole range inside it); anything else is asked of
    /// the driver (one `cuPointerGetAttributes` call: the memory type, the
    /// GPU and the allocation's range, so that a length longer than the
    /// allocation, which a C caller can give, is refused).
    fn check_device_memory(&self, arg: &'static str, ptr: u64, bytes: usize) -> Result<()> {
        use cudarc::driver::sys::{self, CUpointer_attribute};
        if crate::symm::segment_of(&self.comm, ptr, bytes.max(1)).is_some() {
            return Ok(());
        }
        if let Some(seg) = crate::symm::segment_of(&self.comm, ptr, 1) {
            return Err(Error::arg(
                arg,
                format!(
                    "{bytes} bytes inside the symmetric window they start in ({} bytes from its base {:#x})",
                    seg.size(),
                    seg.base()
                ),
                format!("{ptr:#x} + {bytes} bytes, past the window's end"),
            ));
        }
        let mut kind: u32 = 0;
        let mut ordinal: i32 = -1;
        let mut start: u64 = 0;
        let mut size: usize = 0;
        let mut attrs = [
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data = [
            &mut kind as *mut u32 as *mut std::ffi::c_void,
            &mut ordinal as *mut i32 as *mut std::ffi::c_void,
            &mut start as *mut u64 as *mut std::ffi::c_void,
            &mut size as *mut usize as *mut std::ffi::c_void,
        ];
        // SAFETY: four attributes, each with an out-parameter of its size
        // (an unsigned int, an int, a CUdeviceptr, a size_t); any `ptr` value
        // is accepted (memory CUDA does not know leaves the memory type 0).
        let rc =
            unsafe { sys::cuPointerGetAttributes(4, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
        if rc != sys::CUresult::CUDA_SUCCESS
            || kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
        {
            return Err(Error::arg(
                arg,
                "device memory of the group's GPU",
                format!(
                    "{ptr:#x}: not device memory (host memory, or no allocation known to CUDA)"
                ),
            ));
        }
        let mine = self.comm.context().ordinal() as i32;
        if ordinal != mine {
            return Err(Error::arg(
                arg,
                format!("device memory of the group's GPU {mine}"),
                format!("{ptr:#x}: memory of GPU {ordinal}"),
            ));
        }
        // A range the driver knows (start and size both set) must hold all
        // of the region's bytes.
        if start != 0 && size != 0 {
            let end = start.saturating_add(size as u64);
            if ptr.saturating_add(bytes as u64) > end {
                return Err(Error::arg(
                    arg,
                    format!(
                        "{bytes} bytes inside one allocation (the one at {ptr:#x} is [{start:#x}, {end:#x}), {size} bytes)"
                    ),
                    format!("{} bytes past its end", ptr + bytes as u64 - end),
                ));
            }
        }
        Ok(())
    }

    /// A receive buffer for `rows` rows of `per_row` elements: the caller's
    /// (checked to be long enough, as `arg` holding `what`) or a new one
    /// from the pool.
    pub(crate) fn recv_buf<'a, T: Copy>(
        &self,
        handle: &NodeHandle,
        callers: Option<&'a mut dyn DeviceRegionMut<T>>,
        arg: &'static str,
        per_row: usize,
        what: &str,
        align: usize,
    ) -> Result<RecvBuf<'a, T>> {
        match callers {
            Some(b) => {
                let want = handle.rows_held(self.recv_capacity) * per_row;
                self.check_region(arg, &*b, want, what, align)?;
                Ok(RecvBuf::Caller(b))
            }
            // Collective: the same size on every rank.
            None => Ok(RecvBuf::Pool(
                self.pool.alloc(self.recv_capacity * per_row)?,
            )),
        }
    }

    /// Every rank's address of `buf`, which must lie in a registered window
    /// of this communicator (same offset on every rank, by the collective
    /// allocation contract), and where it lies (the window's id and the
    /// offset in it: the descriptor word the kernels compare between ranks
    /// before they touch a peer's copy); `Error::NotSymmetric` naming `arg`
    /// otherwise.
    pub(crate) fn located<T>(
        &self,
        buf: &dyn DeviceRegion<T>,
        arg: &'static str,
    ) -> Result<(Peers, u64)> {
        self.mark_used(buf)?;
        let (ptr, bytes) = (buf.device_ptr(), buf.num_bytes_checked(arg)?);
        let seg = crate::symm::segment_of(&self.comm, ptr, bytes)
            .ok_or(Error::NotSymmetric { what: arg })?;
        let mut out = [0u64; MAX_RANKS];
        for (rank, p) in out.iter_mut().enumerate().take(self.comm.world()) {
            *p = seg
                .peer_base(rank)
                .ok_or(Error::NotSymmetric { what: arg })?
                + (ptr - seg.base());
        }
        Ok((out, seg.place_of(ptr)))
    }
}
