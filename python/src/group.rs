//! Communicators, groups and the high-throughput ops: `Communicator` (NCCL
//! from a unique id, or the ranks of a virtual world), `Group` (an
//! [`EpGroup`]) with `layout`, `dispatch`, `dispatch_fp8`, `combine`, both
//! backward passes and its memory footprint on the caller's arrays, and
//! `Handle` (counts, the drop policy's dropped slots and kept routing). Every call that reaches an
//! op runs with the GIL released ([`detached`]): on a virtual world an op
//! ends when every rank has enqueued it, and the ranks are Python threads.
//!
//! The Python layer (`moe_ep/_api.py`) resolves streams (torch's current
//! stream), allocates outputs with torch and turns the [`DeviceArray`]s
//! returned here into tensors.

use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use moe_ep::cuda::CudaContext;
use moe_ep::error::Error;
use moe_ep::ops::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, DispatchOutFp8, EpGroup,
    Fp8Rows, Fp8Scales, GroupConfig, Handle as EpHandle, Mode, Overflow, RecvBuf, RecvLayout,
    RecvScales, RecvScalesOut, RefusedCall, TopkIdx,
};
use moe_ep::runtime::{Communicator, UniqueId};
use moe_ep::{bf16, SymmBuffer};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack::{import, Array, DType, DeviceArray, Keep, Symm};
use crate::errors::{detached, guarded, value_err, Fail, Res};
use crate::stream;

// ---- raw regions ------------------------------------------------------------

/// A checked array's `(device address, element count)` as the Rust API's
/// [`DeviceRegion`] / [`DeviceRegionMut`]: the C ABI's `CRegion`, for
/// Python.
///
/// What the binding cannot check, the caller promises (docs/python.md,
/// "Buffers"): the array stays allocated, and is written by no one else
/// outside stream order, until the work enqueued with it has finished;
/// torch's caching allocator keeps that promise on the op's stream. The ops
/// check lengths, alignment and that the memory is device memory of the
/// group's GPU; [`disjoint`] that no output overlaps another buffer of the
/// call.
pub(crate) struct Raw<T> {
    ptr: u64,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Raw<T> {
    pub(crate) fn of(a: &Array) -> Raw<T> {
        debug_assert_eq!(a.dtype.size(), std::mem::size_of::<T>());
        Raw {
            ptr: a.ptr,
            len: a.numel(),
            _t: PhantomData,
        }
    }
}

// SAFETY: the caller's promise above stands in for ownership, which Python
// cannot show; everything checkable is checked by the ops.
unsafe impl<T> DeviceRegion<T> for Raw<T> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}
// SAFETY: as above; outputs are checked disjoint from the call's other buffers.
unsafe impl<T> DeviceRegionMut<T> for Raw<T> {}

/// Refuses an output that overlaps an input or another output, naming it.
pub(crate) fn disjoint(outs: &[Option<&Array>], ins: &[Option<&Array>]) -> Res<()> {
    let live = |a: &&Option<&Array>| a.is_some_and(|a| a.bytes() > 0);
    let outs: Vec<&Array> = outs.iter().filter(live).map(|a| a.unwrap()).collect();
    let ins: Vec<&Array> = ins.iter().filter(live).map(|a| a.unwrap()).collect();
    for (i, o) in outs.iter().enumerate() {
        let (a, n) = (o.ptr, o.bytes() as u64);
        for other in ins.iter().chain(outs[i + 1..].iter()) {
            let (b, m) = (other.ptr, other.bytes() as u64);
            if a < b + m && b < a + n {
                return Err(value_err(
                    o.arg,
                    format!(
                        "an output that overlaps no other array of the call (it overlaps `{}`)",
                        other.arg
                    ),
                    format!("[{a:#x}, {:#x}) and [{b:#x}, {:#x})", a + n, b + m),
                ));
            }
        }
    }
    Ok(())
}

/// The pool's buffer of an fp8 dispatch's scales, of either kind.
enum PoolScales {
    E8m0(SymmBuffer<u8>),
    F32(SymmBuffer<f32>),
}

/// The pool's buffer of a result, `None` where the caller gave its own.
fn pooled<T>(b: RecvBuf<'_, T>) -> Option<SymmBuffer<T>> {
    match b {
        RecvBuf::Pool(b) => Some(b),
        RecvBuf::Caller(_) => None,
    }
}

// ---- communicators ------------------------------------------------------------

/// One rank of an expert-parallel world: an NCCL communicator
/// (`Communicator.init`, one process or thread per GPU) or a rank of a
/// virtual world (`Communicator.virtual_world`: W ranks on one GPU, one
/// Python thread each, for tests).
#[pyclass(frozen, module = "moe_ep._moe_ep", name = "Communicator")]
pub struct Comm {
    pub(crate) comm: Arc<Communicator>,
}

#[pymethods]
impl Comm {
    /// This rank's NCCL communicator on GPU `device` (collective: every
    /// rank calls it with the same `unique_id`, 128 bytes from
    /// `moe_ep.unique_id()` on one rank).
    #[staticmethod]
    fn init(
        py: Python<'_>,
        device: usize,
        unique_id: &[u8],
        rank: usize,
        world: usize,
    ) -> PyResult<Comm> {
        guarded(py, || {
            let bytes = unique_id.try_into().map_err(|_| {
                value_err(
                    "unique_id",
                    "the 128 bytes of moe_ep.unique_id()",
                    format!("{} bytes", unique_id.len()),
                )
            })?;
            let id = UniqueId::from_bytes(bytes);
            let comm = detached(py, || {
                let ctx = moe_ep::context(device)?;
                Communicator::init(&ctx, &id, rank, world)
            })?;
            Ok(Comm { comm })
        })
    }

    /// `world` virtual ranks on GPU `device`, in rank order: give each to
    /// its own thread, with its own stream. Host collectives wait at most
    /// `timeout` seconds for the slowest rank (default 60).
    #[staticmethod]
    #[pyo3(signature = (world, device=0, timeout=None))]
    fn virtual_world(
        py: Python<'_>,
        world: usize,
        device: usize,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Comm>> {
        guarded(py, || {
            let timeout = duration("timeout", timeout)?;
            let all = detached(py, || {
                let ctx = moe_ep::context(device)?;
                match timeout {
                    Some(t) => Communicator::virtual_world_with_timeout(&ctx, world, t),
                    None => Communicator::virtual_world(&ctx, world),
                }
            })?;
            Ok(all.into_iter().map(|comm| Comm { comm }).collect())
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    #[getter]
    fn world(&self) -> usize {
        self.comm.world()
    }
    /// The GPU's ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.comm.context().ordinal()
    }
    #[getter]
    fn is_virtual(&self) -> bool {
        self.comm.is_virtual()
    }
    /// Stops every running kernel of the communicator's groups and refuses
    /// their later ops; may be called from any thread at any time.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || detached(py, || self.comm.abort()))
    }
    /// Seconds the host collectives (the all-gathers of group creation,
    /// `check` and the two-level layout) wait for the slowest rank.
    #[getter]
    fn host_timeout(&self) -> f64 {
        self.comm.host_timeout().as_secs_f64()
    }
    /// Bounds those waits on an NCCL communicator (set it alike on every
    /// rank); past it they raise `CollectiveFailed` and the communicator is
    /// aborted. A virtual world's bound is set at its creation.
    fn set_host_timeout(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        guarded(py, || {
            let d = duration("seconds", Some(seconds))?.expect("given");
            Ok(self.comm.set_host_timeout(d)?)
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "Communicator(rank={}, world={}, device={}, virtual={})",
            self.comm.rank(),
            self.comm.world(),
            self.comm.context().ordinal(),
            self.comm.is_virtual()
        )
    }
}

fn duration(arg: &'static str, secs: Option<f64>) -> Res<Option<Duration>> {
    secs.map(|s| {
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| value_err(arg, "a positive number of seconds", s))
    })
    .transpose()
}

/// 128 bytes naming a new NCCL world: made on one rank, given to every
/// rank's `Communicator.init`.
#[pyfunction]
pub(crate) fn unique_id(py: Python<'_>) -> PyResult<Vec<u8>> {
    guarded(py, || Ok(UniqueId::generate()?.to_bytes().to_vec()))
}

/// CUDA devices visible to this process (`NoDriver` without a driver).
#[pyfunction]
pub(crate) fn device_count(py: Python<'_>) -> PyResult<usize> {
    guarded(py, || Ok(moe_ep::device_count()?))
}

/// The checked arrays of an fp8 dispatch (`Group.dispatch_fp8`).
struct Fp8Args {
    ca: Array,
    sa: Array,
    wa: Array,
    oc: Option<Array>,
    os: Option<Array>,
    ow: Option<Array>,
    /// e8m0 scales per 32 values (uint8), else f32 per 128.
    e8m0: bool,
    /// Scales per row.
    sw: usize,
}

/// How an op imports one array (`Group::import` on the op's stream).
type Importer<'a> = &'a dyn Fn(&Bound<'_, PyAny>, &'static str, &[DType]) -> Res<Array>;

/// Imports and checks an fp8 dispatch's arrays, naming the bad one:
/// `codes` `[T, H]` uint8 or float8_e4m3fn, `scales` `[T, H / 32]` uint8
/// or `[T, H / 128]` float32 (the dtype is the kind), `topk_weights`
/// `[T, K]` float32, and the optional receive arrays of the same kinds
/// (`out_weights` rank-major `[rows, K]`, expert-major `[rows]`), no output
/// overlapping another array. `H` must be a multiple of 128.
fn fp8_args(
    imp: Importer<'_>,
    [codes, scales, topk_weights]: [&Bound<'_, PyAny>; 3],
    [out_codes, out_scales, out_weights]: [Option<&Bound<'_, PyAny>>; 3],
    (t, k, hd, em): (usize, usize, usize, bool),
) -> Res<Fp8Args> {
    if !hd.is_multiple_of(128) {
        return Err(value_err("hidden", "a multiple of 128 for fp8 rows", hd));
    }
    let opt = |o: Option<&Bound<'_, PyAny>>, arg: &'static str, want: &[DType]| {
        o.filter(|o| !o.is_none())
            .map(|o| imp(o, arg, want))
            .transpose()
    };
    let fp8 = [DType::U8, DType::F8E4M3];
    let ca = imp(codes, "codes", &fp8)?;
    ca.expect_shape(&[Some(t), Some(hd)], &format!("[T={t}, H={hd}]"))?;
    let sa = imp(scales, "scales", &[DType::U8, DType::F32])?;
    // The kind of the scales is their dtype: e8m0 bytes per 32 values, or
    // f32 per 128.
    let e8m0 = sa.dtype == DType::U8;
    let per = if e8m0 { 32 } else { 128 };
    let sw = hd / per;
    sa.expect_shape(
        &[Some(t), Some(sw)],
        &format!("[T={t}, H/{per}={sw}] ({})", sa.dtype.name()),
    )?;
    let wa = imp(topk_weights, "topk_weights", &[DType::F32])?;
    wa.expect_shape(&[Some(t), Some(k)], &format!("[T={t}, K={k}]"))?;
    let oc = opt(out_codes, "out_codes", &fp8)?;
    if let Some(o) = &oc {
        o.expect_shape(&[None, Some(hd)], &format!("[rows, H={hd}]"))?;
    }
    let os = opt(out_scales, "out_scales", &[sa.dtype])?;
    if let Some(o) = &os {
        o.expect_shape(&[None, Some(sw)], &format!("[rows, H/{per}={sw}]"))?;
    }
    let ow = opt(out_weights, "out_weights", &[DType::F32])?;
    if let Some(o) = &ow {
        if em {
            o.expect_shape(&[None], "[rows] (expert-major)")?;
        } else {
            o.expect_shape(&[None, Some(k)], &format!("[rows, K={k}] (rank-major)"))?;
        }
    }
    disjoint(
        &[oc.as_ref(), os.as_ref(), ow.as_ref()],
        &[Some(&ca), Some(&sa), Some(&wa)],
    )?;
    Ok(Fp8Args {
        ca,
        sa,
        wa,
        oc,
        os,
        ow,
        e8m0,
        sw,
    })
}

/// Tests only: `Group.dispatch_fp8`'s argument checks without a group (no
/// GPU needed), for a handle of `tokens` x `topk` in `layout` and a group
/// of `hidden`. Returns the scales' kind, `"e8m0"` or `"f32"`.
#[pyfunction]
#[pyo3(signature = (codes, scales, topk_weights, *, tokens, topk, hidden, layout="rank_major",
    out_codes=None, out_scales=None, out_weights=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _check_fp8_args(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    topk_weights: &Bound<'_, PyAny>,
    tokens: usize,
    topk: usize,
    hidden: usize,
    layout: &str,
    out_codes: Option<&Bound<'_, PyAny>>,
    out_scales: Option<&Bound<'_, PyAny>>,
    out_weights: Option<&Bound<'_, PyAny>>,
) -> PyResult<&'static str> {
    guarded(py, || {
        let em = parse_layout(layout, 1)? != RecvLayout::RankMajor;
        let imp = |o: &Bound<'_, PyAny>, arg: &'static str, want: &[DType]| {
            import(o, arg, want, 0, None, 0)
        };
        let a = fp8_args(
            &imp,
            [codes, scales, topk_weights],
            [out_codes, out_scales, out_weights],
            (tokens, topk, hidden, em),
        )?;
        Ok(if a.e8m0 { "e8m0" } else { "f32" })
    })
}

// ---- groups -------------------------------------------------------------------

/// An expert-parallel group (`EpGroup`): creating it is collective, and so
/// is every op (every rank calls the same ops in the same order).
#[pyclass(frozen, module = "moe_ep._moe_ep", name = "Group")]
pub struct Group {
    pub(crate) g: Arc<EpGroup>,
    pub(crate) ctx: Arc<CudaContext>,
}

pub(crate) fn parse_mode(s: &str) -> Res<Mode> {
    match s {
        "high_throughput" | "ht" => Ok(Mode::HighThroughput),
        "low_latency" | "ll" => Ok(Mode::LowLatency),
        other => Err(value_err(
            "mode",
            "\"high_throughput\" or \"low_latency\"",
            other,
        )),
    }
}

fn parse_layout(s: &str, alignment: usize) -> Res<RecvLayout> {
    match s {
        "rank_major" if alignment <= 1 => Ok(RecvLayout::RankMajor),
        "rank_major" => Err(value_err(
            "alignment",
            "1 (or none) for a rank-major layout",
            alignment,
        )),
        "expert_major" => {
            let l = RecvLayout::ExpertMajor {
                alignment: alignment.max(1),
            };
            l.validate()?;
            Ok(l)
        }
        other => Err(value_err(
            "layout",
            "\"rank_major\" or \"expert_major\"",
            other,
        )),
    }
}

fn layout_name(l: RecvLayout) -> (&'static str, usize) {
    match l {
        RecvLayout::RankMajor => ("rank_major", 1),
        RecvLayout::ExpertMajor { alignment } => ("expert_major", alignment),
    }
}

impl Group {
    pub(crate) fn import(
        &self,
        obj: &Bound<'_, PyAny>,
        arg: &'static str,
        want: &[DType],
        stream: u64,
    ) -> Res<Array> {
        import(obj, arg, want, self.ctx.ordinal(), Some(&self.ctx), stream)
    }
    pub(crate) fn import_opt(
        &self,
        obj: Option<&Bound<'_, PyAny>>,
        arg: &'static str,
        want: &[DType],
        stream: u64,
    ) -> Res<Option<Array>> {
        obj.filter(|o| !o.is_none())
            .map(|o| self.import(o, arg, want, stream))
            .transpose()
    }
    pub(crate) fn hidden(&self) -> usize {
        self.g.config().hidden
    }
    /// Runs one op's binding (`f`: this binding's checks of the arguments,
    /// then the op, inside [`detached`]) as [`guarded`] does; where the
    /// binding's own checks refuse the call, the refusal is published to
    /// the peers first ([`Group::publish_refusal`]).
    pub(crate) fn guarded_op<T>(
        &self,
        py: Python<'_>,
        stream: u64,
        call: RefusedCall<'_>,
        f: impl FnOnce() -> Res<T>,
    ) -> PyResult<T> {
        guarded(py, || {
            let r = f();
            if let Err(e) = &r {
                self.publish_refusal(py, stream, call, e);
            }
            r
        })
    }
    /// Tells the peers that this rank refused `call` (`EpGroup::refuse`),
    /// so that their op stops at once naming this rank and the argument,
    /// as for the Rust API's own refusals. Nothing for an error of the op
    /// itself (it told them) or on a stream this binding cannot wrap.
    pub(crate) fn publish_refusal(
        &self,
        py: Python<'_>,
        stream: u64,
        call: RefusedCall<'_>,
        e: &Fail,
    ) {
        if matches!(e, Fail::Ran(_) | Fail::Panic(_)) {
            return;
        }
        let told = e.told();
        let _ = py.detach(|| {
            catch_unwind(AssertUnwindSafe(|| {
                if let Ok(s) = stream::wrap(&self.ctx, stream) {
                    drop(self.g.refuse(&s, call, told));
                }
            }))
        });
    }
    fn check_handle(&self, h: &Handle) -> Res<()> {
        if Arc::ptr_eq(&h.group, &self.g) {
            return Ok(());
        }
        Err(Fail::Ep(Error::arg(
            "handle",
            "a handle made by this group's layout",
            "a handle of another group",
        )))
    }
    pub(crate) fn array<T>(
        &self,
        b: SymmBuffer<T>,
        shape: Vec<usize>,
        dt: DType,
        s: u64,
    ) -> DeviceArray
    where
        Symm<T>: crate::dlpack::Held + 'static,
    {
        let ptr = b.device_ptr();
        DeviceArray::new(ptr, shape, dt, &self.ctx, s, Arc::new(Symm(b)))
    }
}

#[pymethods]
impl Group {
    /// Creates the group (collective). The fields are `GroupConfig`'s;
    /// `None` keeps the Rust default.
    #[new]
    #[pyo3(signature = (comm, *, num_experts, hidden, max_tokens_per_rank, mode="high_throughput",
        recv_capacity=0, num_sms=None, combine_chunks=None, timeout=None, ranks_per_node=0,
        hop_chunk_rows=None, overflow="error", zero_padding=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        comm: &Comm,
        num_experts: usize,
        hidden: usize,
        max_tokens_per_rank: usize,
        mode: &str,
        recv_capacity: usize,
        num_sms: Option<usize>,
        combine_chunks: Option<usize>,
        timeout: Option<f64>,
        ranks_per_node: usize,
        hop_chunk_rows: Option<usize>,
        overflow: &str,
        zero_padding: bool,
    ) -> PyResult<Group> {
        guarded(py, || {
            let mut cfg = GroupConfig::new(num_experts, hidden, max_tokens_per_rank);
            cfg.mode = parse_mode(mode)?;
            cfg.recv_capacity = recv_capacity;
            let fit_sms = num_sms.is_none();
            if let Some(n) = num_sms {
                cfg.num_sms = n;
            }
            if let Some(c) = combine_chunks {
                cfg.combine_chunks = c;
            }
            if let Some(t) = duration("timeout", timeout)? {
                cfg.timeout = t;
            }
            cfg.ranks_per_node = ranks_per_node;
            if let Some(r) = hop_chunk_rows {
                cfg.hop_chunk_rows = r;
            }
            cfg.overflow = match overflow {
                "error" => Overflow::Error,
                "drop" => Overflow::Drop,
                other => return Err(value_err("overflow", "\"error\" or \"drop\"", other)),
            };
            cfg.zero_padding = zero_padding;
            let c = comm.comm.clone();
            let g = detached(py, || {
                if fit_sms {
                    // Not given: the default, or as many blocks as fit
                    // where ranks share a GPU (virtual ranks: at world 8 an
                    // H100 holds 16 a rank, not the default 24).
                    let fit = moe_ep::ops::residency(&c, cfg.num_experts)?.max_blocks_per_rank();
                    cfg.num_sms = cfg.num_sms.min(fit);
                }
                EpGroup::new(&c, cfg)
            })?;
            Ok(Group {
                g: Arc::new(g),
                ctx: comm.comm.context().clone(),
            })
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.g.comm().rank()
    }
    #[getter]
    fn world(&self) -> usize {
        self.g.comm().world()
    }
    #[getter]
    fn device(&self) -> usize {
        self.ctx.ordinal()
    }
    #[getter]
    fn recv_capacity(&self) -> usize {
        self.g.recv_capacity()
    }
    #[getter]
    fn experts_per_rank(&self) -> usize {
        self.g.experts_per_rank()
    }
    #[getter]
    fn is_two_level(&self) -> bool {
        self.g.is_two_level()
    }
    /// The configuration, as a dict of `GroupConfig`'s fields.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.g.config();
        let d = PyDict::new(py);
        d.set_item("num_experts", c.num_experts)?;
        d.set_item("hidden", c.hidden)?;
        d.set_item("max_tokens_per_rank", c.max_tokens_per_rank)?;
        d.set_item("recv_capacity", c.recv_capacity)?;
        d.set_item("num_sms", c.num_sms)?;
        d.set_item("combine_chunks", c.combine_chunks)?;
        d.set_item(
            "mode",
            match c.mode {
                Mode::HighThroughput => "high_throughput",
                Mode::LowLatency => "low_latency",
            },
        )?;
        d.set_item("timeout", c.timeout.as_secs_f64())?;
        d.set_item("ranks_per_node", c.ranks_per_node)?;
        d.set_item("hop_chunk_rows", c.hop_chunk_rows)?;
        d.set_item(
            "overflow",
            match c.overflow {
                Overflow::Error => "error",
                Overflow::Drop => "drop",
            },
        )?;
        d.set_item("zero_padding", c.zero_padding)?;
        Ok(d)
    }

    /// Waits for the group's work, then learns what every rank found since
    /// the last check (collective).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || detached(py, || self.g.check()))
    }

    /// Aborts the group's communicator (see `Communicator.abort`).
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || detached(py, || self.g.comm().abort()))
    }

    /// Lets the group's ops run on a stream that captures a CUDA graph. The
    /// caller takes on `EpGroup::allow_graph_capture`'s contract: every
    /// array and handle a captured op was given, and the group, stay alive
    /// while the graph may be launched, and every rank launches its graph
    /// the same number of times in the same order.
    fn _allow_graph_capture(&self) {
        // SAFETY: the Python caller's contract, stated above and in
        // docs/python.md.
        unsafe { self.g.allow_graph_capture() }
    }

    /// `nbytes` of the group's symmetric pool (collective: every rank
    /// allocates the same sizes in the same order), as a `DeviceArray` of
    /// `shape` and `dtype`, ordered on `stream` for its first use.
    fn symm_empty(
        &self,
        py: Python<'_>,
        stream: u64,
        shape: Vec<usize>,
        dtype: &str,
    ) -> PyResult<DeviceArray> {
        guarded(py, || {
            let dt = DType::from_name("dtype", dtype)?;
            let n = shape
                .iter()
                .try_fold(dt.size(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| {
                    value_err("shape", "a size that fits in memory", format!("{shape:?}"))
                })?;
            let buf = detached(py, || {
                let b = self.g.pool().alloc::<u8>(n)?;
                let s = stream::wrap(&self.ctx, stream)?;
                b.ready_on(&s)?;
                Ok(b)
            })?;
            Ok(self.array(buf, shape, dt, stream))
        })
    }

    /// True where `[ptr, ptr + nbytes)` lies in symmetric memory of the
    /// group's communicator.
    fn is_symm_backed(&self, ptr: u64, nbytes: usize) -> bool {
        self.g.pool().is_symm_backed(ptr, nbytes)
    }

    /// The memory this rank of the group holds now, by category, in bytes
    /// (`EpGroup::memory_footprint`): `workspace`, `low_latency`,
    /// `pool_other`, `pool_free`, `two_level`, `pinned_host` and
    /// `device_total`. Handles come on top (`Handle.device_bytes`).
    fn memory_footprint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let f = self.g.memory_footprint();
        let d = PyDict::new(py);
        d.set_item("workspace", f.workspace)?;
        d.set_item("low_latency", f.low_latency)?;
        d.set_item("pool_other", f.pool_other)?;
        d.set_item("pool_free", f.pool_free)?;
        d.set_item("two_level", f.two_level)?;
        d.set_item("pinned_host", f.pinned_host)?;
        d.set_item("device_total", f.device_total())?;
        Ok(d)
    }

    /// The routing layout of `topk_idx` `[T, K]` (int64 or int32).
    #[pyo3(signature = (stream, topk_idx, layout="rank_major", alignment=1))]
    fn layout(
        &self,
        py: Python<'_>,
        stream: u64,
        topk_idx: &Bound<'_, PyAny>,
        layout: &str,
        alignment: usize,
    ) -> PyResult<Handle> {
        self.guarded_op(py, stream, RefusedCall::Layout, || {
            let lay = parse_layout(layout, alignment)?;
            let idx = self.import(topk_idx, "topk_idx", &[DType::I64, DType::I32], stream)?;
            idx.expect_shape(&[None, None], "[T, topk]")?;
            let k = idx.shape[1];
            let (r64, r32) = (Raw::<i64>::of(&idx), Raw::<i32>::of(&idx));
            let dt = idx.dtype;
            let h = detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                let ti = match dt {
                    DType::I64 => TopkIdx::I64(&r64),
                    _ => TopkIdx::I32(&r32),
                };
                self.g.layout(&s, ti, k, lay)
            })?;
            Ok(Handle {
                h: Arc::new(h),
                group: self.g.clone(),
                ctx: self.ctx.clone(),
                stream,
            })
        })
    }

    /// Dispatch: `x` `[T, H]` bfloat16 and `topk_weights` `[T, K]` float32
    /// to the ranks of their experts. Returns `(tokens, topk_weights,
    /// topk_idx, src)`: the receive buffers from the pool (`None` for one
    /// the caller gave as `out_tokens` / `out_weights`, symmetric memory of
    /// the group), the local expert ids and the sources.
    #[pyo3(signature = (stream, handle, x, topk_weights, out_tokens=None, out_weights=None))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn dispatch(
        &self,
        py: Python<'_>,
        stream: u64,
        handle: &Handle,
        x: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        out_tokens: Option<&Bound<'_, PyAny>>,
        out_weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(
        Option<DeviceArray>,
        Option<DeviceArray>,
        DeviceArray,
        DeviceArray,
    )> {
        self.guarded_op(py, stream, RefusedCall::Dispatch(&handle.h), || {
            self.check_handle(handle)?;
            let (t, k, hd) = (handle.h.num_tokens(), handle.h.topk(), self.hidden());
            let em = handle.h.layout() != RecvLayout::RankMajor;
            let xa = self.import(x, "x", &[DType::Bf16], stream)?;
            xa.expect_shape(&[Some(t), Some(hd)], &format!("[T={t}, H={hd}]"))?;
            let wa = self.import(topk_weights, "topk_weights", &[DType::F32], stream)?;
            wa.expect_shape(&[Some(t), Some(k)], &format!("[T={t}, K={k}]"))?;
            let ot = self.import_opt(out_tokens, "out_tokens", &[DType::Bf16], stream)?;
            if let Some(o) = &ot {
                o.expect_shape(&[None, Some(hd)], &format!("[rows, H={hd}]"))?;
            }
            let ow = self.import_opt(out_weights, "out_weights", &[DType::F32], stream)?;
            if let Some(o) = &ow {
                if em {
                    o.expect_shape(&[None], "[rows] (expert-major)")?;
                } else {
                    o.expect_shape(&[None, Some(k)], &format!("[rows, K={k}] (rank-major)"))?;
                }
            }
            disjoint(&[ot.as_ref(), ow.as_ref()], &[Some(&xa), Some(&wa)])?;
            let (xr, wr) = (Raw::<bf16>::of(&xa), Raw::<f32>::of(&wa));
            let mut otr = ot.as_ref().map(Raw::<bf16>::of);
            let mut owr = ow.as_ref().map(Raw::<f32>::of);
            let (tok, w, idx, src) = detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                let d = self.g.dispatch(
                    &s,
                    &handle.h,
                    &xr,
                    &wr,
                    DispatchOut {
                        recv_tokens: otr.as_mut().map(|r| r as &mut dyn DeviceRegionMut<bf16>),
                        recv_topk_weights: owr.as_mut().map(|r| r as &mut dyn DeviceRegionMut<f32>),
                    },
                )?;
                Ok((pooled(d.tokens), pooled(d.topk_weights), d.topk_idx, d.src))
            })?;
            let per = if em { 1 } else { k };
            let wshape = |n: usize| if em { vec![n] } else { vec![n / per, per] };
            let tok = tok.map(|b| {
                let n = b.len() / hd;
                self.array(b, vec![n, hd], DType::Bf16, stream)
            });
            let w = w.map(|b| {
                let n = b.len();
                self.array(b, wshape(n), DType::F32, stream)
            });
            let n = idx.len();
            let idx = self.array(idx, wshape(n), DType::I32, stream);
            let n = src.len();
            let src = self.array(src, vec![n / 2, 2], DType::I32, stream);
            Ok((tok, w, idx, src))
        })
    }

    /// Dispatch of fp8 rows: `codes` `[T, H]` uint8 (or float8_e4m3fn) e4m3
    /// codes and their block `scales`, `[T, H / 32]` uint8 (MXFP8's e8m0
    /// per 32 values) or `[T, H / 128]` float32 (one per 128 values), with
    /// `topk_weights` `[T, K]` float32. Returns `(codes, scales,
    /// topk_weights, topk_idx, src)`: pool buffers (`None` for one the
    /// caller gave as `out_codes` / `out_scales` / `out_weights`, symmetric
    /// memory of the group, the scales of the kind sent), the local expert
    /// ids and the sources. One node only.
    #[pyo3(signature = (stream, handle, codes, scales, topk_weights, out_codes=None,
        out_scales=None, out_weights=None))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn dispatch_fp8(
        &self,
        py: Python<'_>,
        stream: u64,
        handle: &Handle,
        codes: &Bound<'_, PyAny>,
        scales: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        out_codes: Option<&Bound<'_, PyAny>>,
        out_scales: Option<&Bound<'_, PyAny>>,
        out_weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(
        Option<DeviceArray>,
        Option<DeviceArray>,
        Option<DeviceArray>,
        DeviceArray,
        DeviceArray,
    )> {
        self.guarded_op(py, stream, RefusedCall::Dispatch(&handle.h), || {
            self.check_handle(handle)?;
            let (t, k, hd) = (handle.h.num_tokens(), handle.h.topk(), self.hidden());
            let em = handle.h.layout() != RecvLayout::RankMajor;
            let imp = |o: &Bound<'_, PyAny>, arg: &'static str, want: &[DType]| {
                self.import(o, arg, want, stream)
            };
            let Fp8Args {
                ca,
                sa,
                wa,
                oc,
                os,
                ow,
                e8m0,
                sw,
            } = fp8_args(
                &imp,
                [codes, scales, topk_weights],
                [out_codes, out_scales, out_weights],
                (t, k, hd, em),
            )?;
            let (cr, wr) = (Raw::<u8>::of(&ca), Raw::<f32>::of(&wa));
            let (s8, s32) = (Raw::<u8>::of(&sa), Raw::<f32>::of(&sa));
            let mut ocr = oc.as_ref().map(Raw::<u8>::of);
            let mut os8 = os.as_ref().filter(|_| e8m0).map(Raw::<u8>::of);
            let mut os32 = os.as_ref().filter(|_| !e8m0).map(Raw::<f32>::of);
            let mut owr = ow.as_ref().map(Raw::<f32>::of);
            let (rc, rs, w, idx, src) = detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                let (scales, recv_scales) = if e8m0 {
                    (
                        Fp8Scales::E8m0Per32(&s8 as &dyn DeviceRegion<u8>),
                        os8.as_mut().map(|r| RecvScalesOut::E8m0Per32(r)),
                    )
                } else {
                    (
                        Fp8Scales::F32Per128(&s32 as &dyn DeviceRegion<f32>),
                        os32.as_mut().map(|r| RecvScalesOut::F32Per128(r)),
                    )
                };
                let d = self.g.dispatch_fp8(
                    &s,
                    &handle.h,
                    Fp8Rows { codes: &cr, scales },
                    &wr,
                    DispatchOutFp8 {
                        recv_codes: ocr.as_mut().map(|r| r as &mut dyn DeviceRegionMut<u8>),
                        recv_scales,
                        recv_topk_weights: owr.as_mut().map(|r| r as &mut dyn DeviceRegionMut<f32>),
                    },
                )?;
                let rs = match d.scales {
                    RecvScales::E8m0Per32(b) => pooled(b).map(PoolScales::E8m0),
                    RecvScales::F32Per128(b) => pooled(b).map(PoolScales::F32),
                };
                Ok((
                    pooled(d.codes),
                    rs,
                    pooled(d.topk_weights),
                    d.topk_idx,
                    d.src,
                ))
            })?;
            let wpr = if em { 1 } else { k };
            let wshape = |n: usize| if em { vec![n] } else { vec![n / wpr, wpr] };
            let rc = rc.map(|b| {
                let n = b.len() / hd;
                self.array(b, vec![n, hd], DType::U8, stream)
            });
            let rs = rs.map(|b| match b {
                PoolScales::E8m0(b) => {
                    let n = b.len() / sw;
                    self.array(b, vec![n, sw], DType::U8, stream)
                }
                PoolScales::F32(b) => {
                    let n = b.len() / sw;
                    self.array(b, vec![n, sw], DType::F32, stream)
                }
            });
            let w = w.map(|b| {
                let n = b.len();
                self.array(b, wshape(n), DType::F32, stream)
            });
            let n = idx.len();
            let idx = self.array(idx, wshape(n), DType::I32, stream);
            let n = src.len();
            let src = self.array(src, vec![n / 2, 2], DType::I32, stream);
            Ok((rc, rs, w, idx, src))
        })
    }

    /// Combine: `expert_out` `[rows, H]` bfloat16 in the handle's layout
    /// (expert-major with `weights` `[rows]` float32 scaling each row) into
    /// `out` `[T, H]` bfloat16, summed in f32 in a fixed order.
    #[pyo3(signature = (stream, handle, expert_out, out, weights=None))]
    fn combine(
        &self,
        py: Python<'_>,
        stream: u64,
        handle: &Handle,
        expert_out: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.guarded_op(py, stream, RefusedCall::Combine(&handle.h), || {
            self.check_handle(handle)?;
            let (t, hd) = (handle.h.num_tokens(), self.hidden());
            let y = self.import(expert_out, "expert_out", &[DType::Bf16], stream)?;
            y.expect_shape(&[None, Some(hd)], &format!("[rows, H={hd}]"))?;
            let w = self.import_opt(weights, "weights", &[DType::F32], stream)?;
            if let Some(w) = &w {
                w.expect_shape(&[None], "[rows] (expert-major)")?;
            }
            let o = self.import(out, "out", &[DType::Bf16], stream)?;
            o.expect_shape(&[Some(t), Some(hd)], &format!("[T={t}, H={hd}]"))?;
            disjoint(&[Some(&o)], &[Some(&y), w.as_ref()])?;
            let (yr, wr) = (Raw::<bf16>::of(&y), w.as_ref().map(Raw::<f32>::of));
            let mut or = Raw::<bf16>::of(&o);
            detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                self.g.combine(
                    &s,
                    &handle.h,
                    &yr,
                    wr.as_ref().map(|w| w as &dyn DeviceRegion<f32>),
                    &mut or,
                )
            })?;
            Ok(())
        })
    }

    /// Backward of combine: `grad_out` `[T, H]` dispatched into `[rows, H]`
    /// rows of the handle's layout (scaled by `weights` where given). Into
    /// `out` when given (returns `None`), else a pool buffer.
    #[pyo3(signature = (stream, handle, grad_out, weights=None, out=None))]
    fn combine_backward(
        &self,
        py: Python<'_>,
        stream: u64,
        handle: &Handle,
        grad_out: &Bound<'_, PyAny>,
        weights: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<DeviceArray>> {
        self.guarded_op(py, stream, RefusedCall::CombineBackward(&handle.h), || {
            self.check_handle(handle)?;
            let (t, hd) = (handle.h.num_tokens(), self.hidden());
            let g = self.import(grad_out, "grad_out", &[DType::Bf16], stream)?;
            g.expect_shape(&[Some(t), Some(hd)], &format!("[T={t}, H={hd}]"))?;
            let w = self.import_opt(weights, "weights", &[DType::F32], stream)?;
            if let Some(w) = &w {
                w.expect_shape(&[None], "[rows] (expert-major)")?;
            }
            let o = self.import_opt(out, "out", &[DType::Bf16], stream)?;
            if let Some(o) = &o {
                o.expect_shape(&[None, Some(hd)], &format!("[rows, H={hd}]"))?;
            }
            disjoint(&[o.as_ref()], &[Some(&g), w.as_ref()])?;
            let (gr, wr) = (Raw::<bf16>::of(&g), w.as_ref().map(Raw::<f32>::of));
            let mut orr = o.as_ref().map(Raw::<bf16>::of);
            let r = detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                let r = self.g.combine_backward(
                    &s,
                    &handle.h,
                    &gr,
                    wr.as_ref().map(|w| w as &dyn DeviceRegion<f32>),
                    orr.as_mut().map(|r| r as &mut dyn DeviceRegionMut<bf16>),
                )?;
                Ok(pooled(r))
            })?;
            Ok(r.map(|b| {
                let n = b.len() / hd;
                self.array(b, vec![n, hd], DType::Bf16, stream)
            }))
        })
    }

    /// Backward of dispatch: `grad_recv_tokens` `[rows, H]` combined home
    /// into `grad_x` `[T, H]`; with `grad_recv_topk_weights` (rank-major
    /// `[rows, K]`, expert-major `[rows]`), the weights' gradient into
    /// `grad_topk_weights` `[T, K]` too.
    #[pyo3(signature = (stream, handle, grad_recv_tokens, grad_x, grad_recv_topk_weights=None,
        grad_topk_weights=None))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch_backward(
        &self,
        py: Python<'_>,
        stream: u64,
        handle: &Handle,
        grad_recv_tokens: &Bound<'_, PyAny>,
        grad_x: &Bound<'_, PyAny>,
        grad_recv_topk_weights: Option<&Bound<'_, PyAny>>,
        grad_topk_weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.guarded_op(py, stream, RefusedCall::DispatchBackward(&handle.h), || {
            self.check_handle(handle)?;
            let (t, k, hd) = (handle.h.num_tokens(), handle.h.topk(), self.hidden());
            let em = handle.h.layout() != RecvLayout::RankMajor;
            let gr = self.import(grad_recv_tokens, "grad_recv_tokens", &[DType::Bf16], stream)?;
            gr.expect_shape(&[None, Some(hd)], &format!("[rows, H={hd}]"))?;
            let grw = self.import_opt(
                grad_recv_topk_weights,
                "grad_recv_topk_weights",
                &[DType::F32],
                stream,
            )?;
            if let Some(a) = &grw {
                if em {
                    a.expect_shape(&[None], "[rows] (expert-major)")?;
                } else {
                    a.expect_shape(&[None, Some(k)], &format!("[rows, K={k}] (rank-major)"))?;
                }
            }
            let gx = self.import(grad_x, "grad_x", &[DType::Bf16], stream)?;
            gx.expect_shape(&[Some(t), Some(hd)], &format!("[T={t}, H={hd}]"))?;
            let gw = self.import_opt(
                grad_topk_weights,
                "grad_topk_weights",
                &[DType::F32],
                stream,
            )?;
            if let Some(a) = &gw {
                a.expect_shape(&[Some(t), Some(k)], &format!("[T={t}, K={k}]"))?;
            }
            disjoint(&[Some(&gx), gw.as_ref()], &[Some(&gr), grw.as_ref()])?;
            let grr = Raw::<bf16>::of(&gr);
            let grwr = grw.as_ref().map(Raw::<f32>::of);
            let mut gxr = Raw::<bf16>::of(&gx);
            let mut gwr = gw.as_ref().map(Raw::<f32>::of);
            detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                self.g.dispatch_backward(
                    &s,
                    &handle.h,
                    DispatchBackwardArgs {
                        grad_recv_tokens: &grr,
                        grad_recv_topk_weights: grwr.as_ref().map(|w| w as &dyn DeviceRegion<f32>),
                        grad_tokens: &mut gxr,
                        grad_topk_weights: gwr.as_mut().map(|w| w as &mut dyn DeviceRegionMut<f32>),
                    },
                )
            })?;
            Ok(())
        })
    }

    fn __repr__(&self) -> String {
        let c = self.g.config();
        format!(
            "Group(rank={}, world={}, device={}, num_experts={}, hidden={}, max_tokens_per_rank={}, mode={:?})",
            self.g.comm().rank(),
            self.g.comm().world(),
            self.ctx.ordinal(),
            c.num_experts,
            c.hidden,
            c.max_tokens_per_rank,
            c.mode
        )
    }
}

// ---- handles ------------------------------------------------------------------

/// The routing of one batch (`Group.layout`), for the dispatch, combine and
/// backward passes of the group that made it.
#[pyclass(frozen, module = "moe_ep._moe_ep", name = "Handle")]
pub struct Handle {
    pub(crate) h: Arc<EpHandle>,
    pub(crate) group: Arc<EpGroup>,
    ctx: Arc<CudaContext>,
    /// The stream the layout ran on (its arrays are written there).
    stream: u64,
}

#[pymethods]
impl Handle {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.h.num_tokens()
    }
    #[getter]
    fn topk(&self) -> usize {
        self.h.topk()
    }
    /// `"rank_major"` or `"expert_major"`.
    #[getter]
    fn layout(&self) -> &'static str {
        layout_name(self.h.layout()).0
    }
    /// The expert-major block alignment (1 for rank-major).
    #[getter]
    fn alignment(&self) -> usize {
        layout_name(self.h.layout()).1
    }
    /// Unpadded (token, expert) rows per local expert, on the device:
    /// `[experts_per_rank]` int32 (written by the layout, on its stream).
    fn tokens_per_local_expert(&self) -> DeviceArray {
        let v = self.h.tokens_per_local_expert();
        let (p, n) = (DeviceRegion::device_ptr(&v), DeviceRegion::len(&v));
        DeviceArray::new(
            p,
            vec![n],
            DType::I32,
            &self.ctx,
            self.stream,
            Arc::new(Keep(self.h.clone())),
        )
    }
    /// The counts on the host (synchronises `stream`): a dict of
    /// `recv_rows`, `max_recv_rows` (the most any rank receives: after this
    /// call the caller's buffers of the handle's ops need hold only that
    /// many rows, on one node), `dropped_rows` (per receiving rank, the drop
    /// policy's), `recv_tokens`, `tokens_per_local_expert`, `rank_counts`
    /// (`[s * R + d]`) and `expert_counts` (`[s * E + e]`).
    fn host_counts<'py>(&self, py: Python<'py>, stream: u64) -> PyResult<Bound<'py, PyDict>> {
        let c = guarded(py, || {
            detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                self.h.host_counts(&s)
            })
        })?;
        let d = PyDict::new(py);
        d.set_item("recv_rows", c.recv_rows)?;
        d.set_item("max_recv_rows", c.max_recv_rows)?;
        d.set_item("dropped_rows", c.dropped_rows)?;
        d.set_item("recv_tokens", c.recv_tokens)?;
        d.set_item("tokens_per_local_expert", c.tokens_per_local_expert)?;
        d.set_item("rank_counts", c.rank_counts)?;
        d.set_item("expert_counts", c.expert_counts)?;
        Ok(d)
    }
    /// This rank's dropped slots, `[T * K]` on the host in row-major
    /// order: true where the slot was routed and its row dropped at the
    /// receiver (synchronises `stream`).
    fn dropped_slots(&self, py: Python<'_>, stream: u64) -> PyResult<Vec<bool>> {
        guarded(py, || {
            detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                self.h.dropped_slots(&s)
            })
        })
    }
    /// The routing the layout kept, `[T, K]` int32 on the device (the
    /// caller's with -1 for unrouted, bad and dropped slots; written by the
    /// layout on its stream); `None` on several nodes.
    fn kept_topk_idx(&self) -> Option<DeviceArray> {
        let v = self.h.kept_topk_idx()?;
        let (p, n) = (DeviceRegion::device_ptr(&v), DeviceRegion::len(&v));
        let k = self.h.topk().max(1);
        Some(DeviceArray::new(
            p,
            vec![n / k, k],
            DType::I32,
            &self.ctx,
            self.stream,
            Arc::new(Keep(self.h.clone())),
        ))
    }
    /// Device bytes the handle holds (on top of the group's footprint).
    #[getter]
    fn device_bytes(&self) -> u64 {
        self.h.device_bytes()
    }
    /// Rows dispatch delivers here (expert-major: padded); synchronises
    /// `stream` on one node.
    fn recv_rows(&self, py: Python<'_>, stream: u64) -> PyResult<usize> {
        guarded(py, || {
            detached(py, || {
                let s = stream::wrap(&self.ctx, stream)?;
                self.h.recv_rows(&s)
            })
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "Handle(num_tokens={}, topk={}, layout={}, alignment={})",
            self.h.num_tokens(),
            self.h.topk(),
            layout_name(self.h.layout()).0,
            layout_name(self.h.layout()).1
        )
    }
}
