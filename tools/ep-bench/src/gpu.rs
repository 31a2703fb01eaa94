//! The GPU half of ep-bench: one rank's measurements, on its own GPU (an
//! NCCL communicator; [`run_rank`]) or as one of the threads of
//! `--virtual-ranks` on GPU 0 ([`run_virtual`]).
//!
//! For each case every rank builds its routing (the same generators as the
//! tests, seeded per rank, so every rank can rebuild every other rank's
//! routing for `--check` and for sizing), creates an `EpGroup`, and times each
//! op with CUDA events around it: warm-up runs first, then `--iters` timed
//! runs, each after an L2 flush and a host barrier, then (`--start gpu`, the
//! default) a gate that the stream waits on while the host enqueues the run:
//! NCCL ranks leave a one-word NCCL all-reduce together behind it; virtual
//! ranks, which have no NCCL, meet at the host barrier once every rank has
//! enqueued, then each opens its own gate.
//! The baselines move the same bytes in the same run: NCCL grouped
//! send/recv (with every rank, this one included: the all-to-all; and with
//! the peers only), an SM copy loop storing into the peer's symmetric buffer (the
//! peer-store ceiling), the same with the SMs' bulk-copy units (the
//! bulk-copy ceiling) and the copy engine's peer copy. Virtual ranks cross
//! no NVLink, so they measure none of them. The local-copy ceilings
//! ([`local_copies`]) are measured on every rank, virtual ones and world 1
//! included: the rows an op reads and writes, moved on the rank's own GPU
//! with the op's SM count. NCCL EP, when its library
//! loads, runs the same case beside ours on the same communicator, inputs
//! and SM count ([`run_nccl_ep`], [`crate::nccl_ep`]), timed by the same
//! events; a call of its that waits for the GPU inside starts behind a
//! hold instead of the gate ([`Begin::Held`]). Each case also reports a
//! rank's memory, moe-ep's beside NCCL EP's ([`crate::memory`]).
//! `--mode ll` cases run the low-latency ops instead ([`ll`]),
//! `--ranks-per-node` the two-level path ([`two_level`]). Rank 0 gathers
//! every rank's statistics and returns them.

use std::cell::RefCell;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use indicatif::ProgressBar;

use moe_ep::cuda::{result as cu, sys, CudaContext, CudaEvent, CudaSlice, CudaStream};
use moe_ep::ops::{DeviceRegion, DispatchOut, TopkIdx};
use moe_ep::reference::{self as refr, RankInput, Shape};
use moe_ep::testkit::nccl::{exchange_rows, StartGate};
use moe_ep::testkit::workload::{self, Rng};
use moe_ep::{
    bf16, Communicator, DispatchOutFp8, DispatchedFp8, EpGroup, Error, Fp8Rows, Fp8Scales,
    GroupConfig, Handle, RecvLayout, RecvScalesOut, SymmBuffer, UniqueId,
};

use crate::accounting::OpBytes;
use crate::cli::{Case, Op, Opts, Routing, ScaleKind, DEFAULT_NUM_SMS};
use crate::fp8;
use crate::launch::RankEnv;
use crate::memory::{Memory, MoeEpMemory, NcclEpMemory};
use crate::nccl_ep;
use crate::report::{self, CaseResult, OpResult, Ranks, Stat};

mod ll;
mod two_level;

/// Errors travel as one line of text up to `main`.
type R<T> = Result<T, String>;
/// One op's samples on this rank: (name, per-iteration µs, NVLink bytes, logical bytes).
type Measured = (String, Vec<f64>, u64, u64);
/// NCCL EP beside a case on this rank: its rows, its cross-check's
/// verdict (`None`: not checked), what its group and handle took.
type NcclEpRun = (Vec<Measured>, Option<bool>, NcclEpMemory);

/// One case's outcome, gathered over the ranks (rank 0 keeps it).
struct Outcome {
    /// Every op's statistics, ours then the baselines.
    ops: Vec<OpResult>,
    /// `--check`'s verdict over all ranks (`None`: not run).
    check: Option<bool>,
    /// NCCL EP's cross-check over all ranks (`None`: not run).
    nccl_ep_check: Option<bool>,
    /// The memory of a rank ([`gather_memory`]).
    memory: Option<Memory>,
}

/// An error as its message (for `map_err`).
fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Visible GPUs (parent process, when `--gpus` is not given).
pub fn device_count() -> R<usize> {
    moe_ep::device_count().map_err(s)
}

/// A fresh NCCL unique id (parent process, or rank 0 of a launcher job).
pub fn nccl_unique_id() -> R<[u8; 128]> {
    Ok(UniqueId::generate().map_err(s)?.to_bytes())
}

/// The CUDA events around one timed run.
struct Timer {
    /// Recorded before the run.
    start: CudaEvent,
    /// Recorded after it.
    end: CudaEvent,
}

impl Timer {
    /// Two timing events of `ctx`.
    fn new(ctx: &Arc<CudaContext>) -> R<Timer> {
        let timing = Some(moe_ep::cuda::sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Timer {
            start: ctx.new_event(timing).map_err(s)?,
            end: ctx.new_event(timing).map_err(s)?,
        })
    }
}

/// One rank's GPU handles.
struct Rank {
    /// The context of the rank's GPU.
    ctx: Arc<CudaContext>,
    /// Its communicator (NCCL or virtual).
    comm: Arc<Communicator>,
    /// The stream every op and baseline runs on.
    stream: Arc<CudaStream>,
    /// Virtual ranks under `--start gpu`: an idle stream for the host
    /// barrier that lines the ranks up while `stream` waits at its gate
    /// (the barrier first synchronises the stream it is given).
    idle: Option<Arc<CudaStream>>,
}

/// What one rank measures with, for all its cases.
struct Ctx<'a> {
    /// The options.
    opts: &'a Opts,
    /// The rank's stream ([`Rank::stream`]).
    stream: Arc<CudaStream>,
    /// [`Rank::idle`].
    idle: Option<Arc<CudaStream>>,
    /// The rank's communicator.
    comm: Arc<Communicator>,
    /// 256 MiB written before each timed run, to flush L2.
    flush: CudaSlice<u8>,
    /// The events around each timed run.
    timer: Timer,
    /// `--start gpu`'s gate (virtual ranks have no NCCL all-reduce behind it:
    /// they meet at the host barrier once all have enqueued, then each opens
    /// its own gate).
    start: StartGate,
    /// NCCL EP, when it runs beside ours.
    nccl_ep: Option<&'static nccl_ep::Lib>,
    /// Rank 0's progress bar (lines are printed around it).
    bar: ProgressBar,
    /// The notes already printed (each once per run).
    said: RefCell<Vec<String>>,
}

impl Ctx<'_> {
    /// Rank 0 prints `line` on stderr.
    fn note(&self, line: &str) {
        if self.comm.rank() == 0 {
            self.bar.suspend(|| eprintln!("{line}"));
        }
    }

    /// [`Ctx::note`], once per run.
    fn note_once(&self, line: String) {
        if self.comm.rank() == 0 && !self.said.borrow().contains(&line) {
            self.note(&line);
            self.said.borrow_mut().push(line);
        }
    }

    /// [`Ctx::time_with`] under `--start` as given.
    fn time(&self, what: &str, f: impl FnMut() -> R<()>) -> R<Vec<f64>> {
        self.time_with(what, self.opts.gpu_start(), f)
    }

    /// Runs `f` warm-up + iters times; returns the per-iteration times (us);
    /// `gpu_start`: behind the start gate (else from the host barrier).
    /// With `MOE_EP_BENCH_ENQUEUE=1` each rank also prints the median host
    /// time `f` took to enqueue its work (inside the timed span: the stream
    /// is empty when the start event is recorded).
    fn time_with(&self, what: &str, gpu_start: bool, f: impl FnMut() -> R<()>) -> R<Vec<f64>> {
        self.time_prepared(what, gpu_start, || Ok(()), f)
    }

    /// [`Ctx::time_with`], with `before` enqueued ahead of every run of `f`
    /// (warm-up ones included), outside the timed span: ahead of the L2
    /// flush and the barrier. The low-latency ops need it: a combine times
    /// the batch an untimed dispatch sent, and a dispatch's buffer set takes
    /// a new batch only after the previous one's combine.
    fn time_prepared(
        &self,
        what: &str,
        gpu_start: bool,
        before: impl FnMut() -> R<()>,
        f: impl FnMut() -> R<()>,
    ) -> R<Vec<f64>> {
        let begin = if gpu_start { Begin::Gate } else { Begin::Host };
        self.time_begin(what, begin, before, f)
    }

    /// [`Ctx::time_prepared`] with the start of each timed run chosen by
    /// `begin` ([`Begin`]). Every run is timed by the CUDA events recorded
    /// on the stream before and after `f`, whatever `begin` is.
    fn time_begin(
        &self,
        what: &str,
        begin: Begin,
        mut before: impl FnMut() -> R<()>,
        mut f: impl FnMut() -> R<()>,
    ) -> R<Vec<f64>> {
        let iters = self.opts.iters();
        // Held runs: the warm-ups' host times bound the hold's window.
        let mut slowest = Duration::ZERO;
        for _ in 0..self.opts.warmup() {
            before()?;
            let t0 = std::time::Instant::now();
            f()?;
            slowest = slowest.max(t0.elapsed());
        }
        self.stream.synchronize().map_err(s)?;
        let hold = match begin {
            Begin::Held => {
                let window = hold_window(slowest);
                self.note_once(format!(
                    "ep-bench: {what} waits for the GPU inside its call: each timed run's stream \
                     is held until the call returns or {:.1} ms after it began (4 x its slowest \
                     warm-up call, within [{:.0}, {:.0}] ms), so its host work up to that wait \
                     stays out of the span between the events, as for every other op",
                    window.as_secs_f64() * 1e3,
                    HOLD_MIN.as_secs_f64() * 1e3,
                    HOLD_MAX.as_secs_f64() * 1e3
                ));
                Some((Hold::new()?, window))
            }
            _ => None,
        };
        let mut out = Vec::with_capacity(iters);
        let mut enqueue = Vec::with_capacity(iters);
        for _ in 0..iters {
            before()?;
            if self.opts.flush_l2() {
                // SAFETY: flush is a live allocation of its length.
                unsafe {
                    cu::memset_d8_async(
                        DeviceRegion::device_ptr(&self.flush),
                        0x5a,
                        self.flush.len(),
                        self.stream.cu_stream(),
                    )
                }
                .map_err(s)?;
            }
            self.comm.barrier(&self.stream).map_err(s)?;
            let t0 = std::time::Instant::now();
            let (ran, lined_up) = match (&hold, begin) {
                (Some((hold, window)), _) => (self.held_run(hold, *window, &mut f), Ok(())),
                (None, Begin::Gate) => {
                    if let Err(e) = self.start.enqueue(&self.comm, &self.stream).map_err(s) {
                        self.start.open();
                        return Err(e);
                    }
                    // The gate opens whatever happens: a closed gate would block the stream.
                    let ran = self.recorded(&mut f);
                    let mut lined_up = Ok(());
                    if let Some(idle) = &self.idle {
                        lined_up = self.comm.barrier(idle).map_err(s);
                    }
                    self.start.open();
                    (ran, lined_up)
                }
                (None, _) => (self.recorded(&mut f), Ok(())),
            };
            enqueue.push(t0.elapsed().as_secs_f64() * 1e6);
            if ran.is_err() || lined_up.is_err() {
                // Drained before the hold's word can go.
                let _ = self.stream.synchronize();
            }
            ran?;
            lined_up?;
            self.timer.end.synchronize().map_err(s)?;
            out.push(self.timer.start.elapsed_ms(&self.timer.end).map_err(s)? as f64 * 1e3);
        }
        if std::env::var_os("MOE_EP_BENCH_ENQUEUE").is_some_and(|v| v == "1") && !enqueue.is_empty()
        {
            enqueue.sort_by(f64::total_cmp);
            eprintln!(
                "rank {}: {what}: host enqueue median {:.1} µs",
                self.comm.rank(),
                enqueue[enqueue.len() / 2]
            );
        }
        Ok(out)
    }

    /// The start event, `f`, the end event, on the stream.
    fn recorded(&self, f: &mut impl FnMut() -> R<()>) -> R<()> {
        self.timer
            .start
            .record(&self.stream)
            .map_err(s)
            .and_then(|_| f())
            .and_then(|_| self.timer.end.record(&self.stream).map_err(s))
    }

    /// One [`Begin::Held`] run: the stream waits at `hold`, then (NCCL
    /// ranks) passes the start gate's one-word all-reduce, whose gate is
    /// opened at once, so the GPUs leave the hold's end together; then the
    /// events around `f`. A watchdog opens the hold when `f` returns or
    /// `window` after it began, whichever comes first: a call that waits
    /// for the GPU inside has by then enqueued what it can before its wait,
    /// and that host time is not timed.
    fn held_run(&self, hold: &Hold, window: Duration, f: &mut impl FnMut() -> R<()>) -> R<()> {
        let open = hold.enqueue(&self.stream)?;
        if !self.comm.is_virtual() {
            let gated = self.start.enqueue(&self.comm, &self.stream).map_err(s);
            self.start.open();
            if let Err(e) = gated {
                open();
                return Err(e);
            }
        }
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let _ = rx.recv_timeout(window);
                open();
            });
            let ran = self.recorded(f);
            let _ = tx.send(());
            ran
        })
    }
}

/// Where the timed span of a run starts: the start event is recorded on
/// the stream before the call and the end event after it in every case,
/// so every row is stream time; what differs is what the stream does
/// while the host enqueues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Begin {
    /// `--start host`: the stream runs as the host enqueues, after the host
    /// barrier (host enqueue time and skew inside the span).
    Host,
    /// `--start gpu`: the stream waits at the start gate until the whole
    /// run is enqueued, then the GPUs leave the gate's all-reduce together.
    Gate,
    /// For a call that waits for the GPU inside (NCCL EP's dispatch): the
    /// stream waits at a hold until the call returns or a window after it
    /// began ([`Ctx::held_run`]); the host time of the call before its
    /// wait stays out of the span, its waits and what follows them are in.
    Held,
}

/// Shortest hold window of a [`Begin::Held`] run.
const HOLD_MIN: Duration = Duration::from_millis(2);
/// Longest hold window.
const HOLD_MAX: Duration = Duration::from_millis(200);

/// The hold window of a call whose slowest warm-up run took `slowest` on
/// the host (its whole run, waits included, bounds its host work before
/// its first wait): four times that, within [`HOLD_MIN`, `HOLD_MAX`].
fn hold_window(slowest: Duration) -> Duration {
    (slowest * 4).clamp(HOLD_MIN, HOLD_MAX)
}

/// The hold of [`Begin::Held`] runs: a host-mapped word the stream waits
/// on (each run waits for the next value), opened from another thread.
struct Hold {
    word: HostWord,
    /// The value the last enqueued wait waits for.
    next: std::cell::Cell<u32>,
}

impl Hold {
    fn new() -> R<Hold> {
        Ok(Hold {
            word: HostWord::new()?,
            next: std::cell::Cell::new(0),
        })
    }

    /// Enqueues the stream's wait for the next value; returns what opens
    /// it (callable from any thread while the hold lives; call it once
    /// whatever happens: a closed hold blocks the stream).
    fn enqueue(&self, stream: &Arc<CudaStream>) -> R<impl FnOnce() + Send + 'static> {
        let v = self.next.get().wrapping_add(1);
        // SAFETY: a live mapped word; flags 0 = wait until it is >= v.
        let rc = unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), self.word.device, v, 0) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuStreamWaitValue32: {rc:?}"));
        }
        self.next.set(v);
        let addr = self.word.host as usize;
        // SAFETY: the word outlives every run (the hold is dropped after
        // the last run's end event was waited for).
        Ok(move || unsafe { (addr as *mut u32).write_volatile(v) })
    }
}

/// The buffers the timed high-throughput ops read and write, on one node
/// or several: the routing, tokens and weights, the zero-copy receive
/// buffers (the group's pool), the combine output and the weight gradients.
struct HtBufs<'b> {
    idx: &'b dyn DeviceRegion<i64>,
    x: &'b dyn DeviceRegion<bf16>,
    w: &'b dyn DeviceRegion<f32>,
    recv: &'b mut SymmBuffer<bf16>,
    recv_w: &'b mut SymmBuffer<f32>,
    out: &'b mut CudaSlice<bf16>,
    grad_w: &'b mut CudaSlice<f32>,
}

/// This rank's fp8 rows on the device (`dispatch-fp8`), the symmetric
/// receive buffers its dispatch writes in place (zero copy, as `dispatch`
/// into `recv`), and the host copy of every rank's rows under `--check`.
struct Fp8Dev {
    /// `[T, H]` e4m3 codes (one byte for an empty rank).
    codes: CudaSlice<u8>,
    /// The scales and their receive buffer, of the case's kind.
    scales: Fp8Side,
    /// `[cap, H]` received codes.
    recv_codes: SymmBuffer<u8>,
    /// Rank-major `[cap, K]`, expert-major `[cap]` received weights.
    recv_w: SymmBuffer<f32>,
    /// Tokens of this rank.
    tokens: usize,
    /// Hidden size.
    hidden: usize,
}

/// Scales of one kind: this rank's `[T, H / 128]` f32 or `[T, H / 32]`
/// e8m0, and the `[cap, ...]` receive buffer beside them.
enum Fp8Side {
    F32 {
        x: CudaSlice<f32>,
        recv: SymmBuffer<f32>,
    },
    E8m0 {
        x: CudaSlice<u8>,
        recv: SymmBuffer<u8>,
    },
}

impl Fp8Dev {
    /// `me` on the device, and receive buffers of `cap` rows from `group`'s
    /// pool (collective: every rank allocates the same, in the same order),
    /// `wpr` weights a row.
    fn new(
        s_: &Arc<CudaStream>,
        group: &EpGroup,
        me: fp8::Payload,
        (tokens, hidden): (usize, usize),
        (cap, wpr): (usize, usize),
    ) -> R<Fp8Dev> {
        fn up<T: moe_ep::cuda::DeviceRepr + Default + Copy>(
            s_: &Arc<CudaStream>,
            v: &[T],
        ) -> R<CudaSlice<T>> {
            match v.is_empty() {
                true => s_.clone_htod(&[T::default()][..]).map_err(s),
                false => s_.clone_htod(v).map_err(s),
            }
        }
        let pool = group.pool();
        let scales = match me.scales {
            fp8::Scales::F32(v) => Fp8Side::F32 {
                x: up(s_, &v)?,
                recv: (pool.alloc::<f32>(cap * ScaleKind::F32.per_row(hidden))).map_err(s)?,
            },
            fp8::Scales::E8m0(v) => Fp8Side::E8m0 {
                x: up(s_, &v)?,
                recv: (pool.alloc::<u8>(cap * ScaleKind::E8m0.per_row(hidden))).map_err(s)?,
            },
        };
        Ok(Fp8Dev {
            codes: up(s_, &me.codes)?,
            scales,
            recv_codes: pool.alloc::<u8>(cap * hidden).map_err(s)?,
            recv_w: pool.alloc::<f32>(cap * wpr).map_err(s)?,
            tokens,
            hidden,
        })
    }

    /// Device addresses for NCCL EP (the same codes and scales).
    fn inputs(&self) -> nccl_ep::Fp8Inputs {
        let (scales, kind) = match &self.scales {
            Fp8Side::F32 { x, .. } => (DeviceRegion::device_ptr(x), ScaleKind::F32),
            Fp8Side::E8m0 { x, .. } => (DeviceRegion::device_ptr(x), ScaleKind::E8m0),
        };
        nccl_ep::Fp8Inputs {
            codes: DeviceRegion::device_ptr(&self.codes),
            scales,
            kind,
        }
    }

    /// One `dispatch_fp8` of the rows with weights `w` into the receive
    /// buffers; `then` sees its outputs (timed runs drop them at once).
    fn dispatch<T>(
        &mut self,
        group: &EpGroup,
        s_: &Arc<CudaStream>,
        handle: &Handle,
        w: &dyn DeviceRegion<f32>,
        then: impl FnOnce(DispatchedFp8<'_>) -> R<T>,
    ) -> R<T> {
        let (t, h) = (self.tokens, self.hidden);
        let codes = self.codes.slice(0..t * h);
        let (recv_codes, recv_w) = (&mut self.recv_codes, &mut self.recv_w);
        let got = match &mut self.scales {
            Fp8Side::F32 { x, recv } => {
                let xs = x.slice(0..t * ScaleKind::F32.per_row(h));
                let rows = Fp8Rows {
                    codes: &codes,
                    scales: Fp8Scales::F32Per128(&xs),
                };
                let out = DispatchOutFp8 {
                    recv_codes: Some(recv_codes),
                    recv_scales: Some(RecvScalesOut::F32Per128(recv)),
                    recv_topk_weights: Some(recv_w),
                };
                group.dispatch_fp8(s_, handle, rows, w, out)
            }
            Fp8Side::E8m0 { x, recv } => {
                let xs = x.slice(0..t * ScaleKind::E8m0.per_row(h));
                let rows = Fp8Rows {
                    codes: &codes,
                    scales: Fp8Scales::E8m0Per32(&xs),
                };
                let out = DispatchOutFp8 {
                    recv_codes: Some(recv_codes),
                    recv_scales: Some(RecvScalesOut::E8m0Per32(recv)),
                    recv_topk_weights: Some(recv_w),
                };
                group.dispatch_fp8(s_, handle, rows, w, out)
            }
        };
        then(got.map_err(s)?)
    }
}

/// The samples of one op of both paths (layout, dispatch into the receive
/// buffers, combine of them, both backward passes) on `group`.
/// `layout_at_host`: the layout is timed from the host barrier (the
/// two-level layout waits on the host, and behind the start gate its stream
/// would never drain). Another op is an error.
#[allow(clippy::too_many_arguments)]
fn time_ht_op(
    c: &Ctx<'_>,
    group: &EpGroup,
    handle: &Handle,
    op: Op,
    k: usize,
    layout: RecvLayout,
    b: &mut HtBufs<'_>,
    layout_at_host: bool,
) -> R<Vec<f64>> {
    let s_ = &c.stream;
    match op {
        Op::Layout => {
            let f = || {
                group
                    .layout(s_, TopkIdx::I64(b.idx), k, layout)
                    .map(drop)
                    .map_err(s)
            };
            match layout_at_host {
                true => c.time_with(op.name(), false, f),
                false => c.time(op.name(), f),
            }
        }
        Op::Dispatch => c.time(op.name(), || {
            group
                .dispatch(
                    s_,
                    handle,
                    b.x,
                    b.w,
                    DispatchOut {
                        recv_tokens: Some(&mut *b.recv),
                        recv_topk_weights: Some(&mut *b.recv_w),
                    },
                )
                .map(drop)
                .map_err(s)
        }),
        Op::Combine => c.time(op.name(), || {
            group
                .combine(s_, handle, &*b.recv, None, &mut *b.out)
                .map_err(s)
        }),
        Op::DispatchBwd => c.time(op.name(), || {
            group
                .dispatch_backward(
                    s_,
                    handle,
                    moe_ep::DispatchBackwardArgs {
                        grad_recv_tokens: &*b.recv,
                        grad_recv_topk_weights: Some(&*b.recv_w),
                        grad_tokens: &mut *b.out,
                        grad_topk_weights: Some(&mut *b.grad_w),
                    },
                )
                .map_err(s)
        }),
        Op::CombineBwd => c.time(op.name(), || {
            group
                .combine_backward(s_, handle, &*b.out, None, Some(&mut *b.recv))
                .map(drop)
                .map_err(s)
        }),
        _ => Err(format!("{} is not timed by time_ht_op", op.name())),
    }
}

/// Every rank's top-k routing of a case (cheap: no token data).
/// `--check`'s verdict of every rank (`None`: not checked): ok only if
/// this rank's `ok` and every other rank's are (collective).
fn all_ranks_ok(c: &Ctx<'_>, ok: Option<bool>) -> R<Option<bool>> {
    let Some(ok) = ok else { return Ok(None) };
    let all = c.comm.all_gather_host(&c.stream, &[ok as u8]).map_err(s)?;
    Ok(Some(all.iter().all(|&v| v == 1)))
}

fn routings(case: &Case, shape: &Shape, seed: u64, world: usize) -> R<Vec<Vec<i64>>> {
    (0..world)
        .map(|r| match &case.routing {
            Routing::File(path) => workload::read_topk_file(path, case.topk)
                .map_err(s)
                .and_then(|v| {
                    let need = case.tokens * case.topk;
                    if v.len() < need {
                        return Err(format!(
                            "--routing file: {} has {} tokens, the case needs {}",
                            path.display(),
                            v.len() / case.topk,
                            case.tokens
                        ));
                    }
                    Ok(v[..need].to_vec())
                }),
            Routing::Generated(routing) => Ok(workload::topk_idx(
                &mut Rng::new(workload::rank_seed(seed, r)),
                case.tokens,
                shape,
                *routing,
            )),
        })
        .collect()
}

/// One rank's inputs: the same generator as `workload::rank_inputs`, but with
/// this case's routing (which may come from a file).
fn rank_input(case: &Case, seed: u64, rank: usize, topk_idx: Vec<i64>) -> RankInput {
    let mut rng = Rng::new(workload::rank_seed(seed, rank) ^ 0x70CE);
    RankInput {
        tokens: workload::tokens(&mut rng, case.tokens, case.hidden),
        topk_weights: workload::topk_weights(&mut rng, case.tokens, case.topk),
        topk_idx,
    }
}

/// Rows rank `d` receives in `layout` (expert-major: padding rows
/// included), as the handle's `host_counts().recv_rows` says on rank d.
fn recv_rows(counts: &refr::Counts, layout: RecvLayout, d: usize) -> usize {
    match layout {
        RecvLayout::RankMajor => counts.rank_major_rows(d),
        RecvLayout::ExpertMajor { alignment } => counts.expert_major_rows(d, alignment),
    }
}

/// Every rank's counts of a case's routing, and the receive capacity that
/// holds the most rows any rank receives (at least 1).
fn counts_and_capacity(
    shape: &Shape,
    routing: &[Vec<i64>],
    layout: RecvLayout,
) -> R<(refr::Counts, usize)> {
    let layouts: Vec<refr::Layout> = routing
        .iter()
        .map(|t| refr::layout(shape, t))
        .collect::<Result<_, _>>()
        .map_err(s)?;
    let counts = refr::gather_counts(shape, &layouts);
    let cap = (0..shape.num_ranks)
        .map(|d| recv_rows(&counts, layout, d))
        .max()
        .unwrap_or(1)
        .max(1);
    Ok((counts, cap))
}

/// One rank's tokens, weights and routing on the device (one element for
/// an empty rank, so that every buffer exists).
fn upload(
    s_: &Arc<CudaStream>,
    me: &RankInput,
) -> R<(CudaSlice<bf16>, CudaSlice<f32>, CudaSlice<i64>)> {
    fn up<T: moe_ep::cuda::DeviceRepr>(s_: &Arc<CudaStream>, v: &[T], empty: T) -> R<CudaSlice<T>> {
        match v.is_empty() {
            true => s_.clone_htod(&[empty][..]).map_err(s),
            false => s_.clone_htod(v).map_err(s),
        }
    }
    Ok((
        up(s_, &me.tokens, bf16::ZERO)?,
        up(s_, &me.topk_weights, 0f32)?,
        up(s_, &me.topk_idx, -1i64)?,
    ))
}

/// One NCCL rank of a launcher's (or our own spawned) world: measures every
/// case; rank 0 returns the gathered results, the others an empty `Vec`.
pub fn run_rank(opts: &Opts, cases: &[Case], env: &RankEnv) -> R<Vec<CaseResult>> {
    let id = env.unique_id(nccl_unique_id)?;
    let uid = UniqueId::from_bytes(id);
    let ctx = moe_ep::context(env.device()).map_err(s)?;
    let comm = Communicator::init(&ctx, &uid, env.rank, env.world)
        .map_err(|e| format!("NCCL init: {e}"))?;
    let stream = ctx.new_stream().map_err(s)?;
    let rank = Rank {
        ctx,
        comm,
        stream,
        idle: None,
    };
    measure(opts, cases, rank)
}

/// `--virtual-ranks`: `world` ranks as threads of this process on GPU 0
/// (`Communicator::virtual_world`); returns rank 0's gathered results. The
/// ranks' streams are created one after another here, before the threads
/// start (the driver spreads consecutive streams over its hardware queues).
/// Errors name the failing ranks, ranks that failed alike together.
pub fn run_virtual(opts: &Opts, cases: &[Case], world: usize) -> R<Vec<CaseResult>> {
    let ctx = moe_ep::context(0).map_err(s)?;
    let comms = Communicator::virtual_world(&ctx, world).map_err(s)?;
    let new_streams = || {
        (0..world)
            .map(|_| ctx.new_stream().map_err(s))
            .collect::<R<Vec<_>>>()
    };
    let streams = new_streams()?;
    let idle = if opts.gpu_start() {
        new_streams()?.into_iter().map(Some).collect()
    } else {
        vec![None; world]
    };
    let ranks = comms.into_iter().zip(streams).zip(idle);
    let outcomes: Vec<R<Vec<CaseResult>>> = std::thread::scope(|scope| {
        let threads: Vec<_> = ranks
            .map(|((comm, stream), idle)| {
                let ctx = ctx.clone();
                scope.spawn(move || {
                    ctx.bind_to_thread().map_err(s)?;
                    measure(
                        opts,
                        cases,
                        Rank {
                            ctx,
                            comm,
                            stream,
                            idle,
                        },
                    )
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join().unwrap_or_else(|p| {
                    let msg = p.downcast_ref::<String>().cloned();
                    let msg = msg.or_else(|| p.downcast_ref::<&str>().map(|m| m.to_string()));
                    Err(format!("panicked: {}", msg.unwrap_or_default()))
                })
            })
            .collect()
    });
    let mut failed: Vec<(Vec<usize>, String)> = Vec::new();
    let mut root = Vec::new();
    for (r, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(results) if r == 0 => root = results,
            Ok(_) => {}
            Err(e) => match failed.iter_mut().find(|(_, m)| *m == e) {
                Some((who, _)) => who.push(r),
                None => failed.push((vec![r], e)),
            },
        }
    }
    if failed.is_empty() {
        return Ok(root);
    }
    let lines: Vec<String> = failed
        .iter()
        .map(|(who, e)| {
            let who: Vec<String> = who.iter().map(|r| r.to_string()).collect();
            let noun = if who.len() == 1 { "rank" } else { "ranks" };
            format!("virtual {noun} {} of {world}: {e}", who.join(", "))
        })
        .collect();
    Err(lines.join("\n"))
}

/// Measures every case on one rank; rank 0 returns the gathered results.
/// Without `--num-sms`, virtual ranks run each case with min(24, what fits
/// all ranks on the GPU) SMs, and rank 0 says so (once per value).
fn measure(opts: &Opts, cases: &[Case], rank: Rank) -> R<Vec<CaseResult>> {
    let Rank {
        ctx,
        comm,
        stream,
        idle,
    } = rank;
    let root = comm.rank() == 0;
    let flush = stream.alloc_zeros::<u8>(256 << 20).map_err(s)?;
    let start = StartGate::new(&stream).map_err(s)?;
    let bar = report::progress(cases.len(), root && !opts.quiet);
    let mut c = Ctx {
        opts,
        timer: Timer::new(&ctx)?,
        stream,
        idle,
        comm,
        flush,
        start,
        nccl_ep: None,
        bar: bar.clone(),
        said: RefCell::new(Vec::new()),
    };
    c.nccl_ep = nccl_ep_baseline(&c)?;
    let world = c.comm.world();
    let ranks = if c.comm.is_virtual() {
        Ranks::Virtual
    } else {
        Ranks::Nccl
    };
    let gpu_name = ctx.name().unwrap_or_else(|_| "GPU".into());
    let mut said = None;
    let mut results = Vec::new();
    for case in cases {
        let mut case = case.clone();
        if opts.auto_num_sms() {
            let fit = moe_ep::ops::residency(&c.comm, case.experts)
                .map_err(s)?
                .max_blocks_per_rank();
            // The two-level combine's hop waits with one more block per
            // rank (GroupConfig::hop_chunk_rows).
            let fit = match opts.ranks_per_node {
                Some(_) => fit.saturating_sub(1).max(1),
                None => fit,
            };
            case.num_sms = DEFAULT_NUM_SMS.min(fit);
            if root && said != Some(case.num_sms) {
                said = Some(case.num_sms);
                bar.suspend(|| {
                    eprintln!(
                        "ep-bench: --num-sms not given: {} SMs per rank = min({DEFAULT_NUM_SMS}, {fit}), \
                         {fit} being the most whose blocks fit when {world} virtual ranks share one GPU",
                        case.num_sms
                    )
                });
            }
        }
        bar.set_message(case.label());
        let r = run_case(&c, &case, world).map_err(|e| format!("{}: {e}", case.label()))?;
        bar.inc(1);
        results.push(CaseResult {
            case,
            ops: r.ops,
            world,
            ranks,
            gpu_name: gpu_name.clone(),
            check: r.check,
            nccl_ep_check: r.nccl_ep_check,
            memory: r.memory,
            ranks_per_node: opts.ranks_per_node.unwrap_or(0),
            hop_chunk_rows: match opts.ranks_per_node {
                Some(_) => opts
                    .hop_chunk_rows
                    .unwrap_or(moe_ep::ops::DEFAULT_HOP_CHUNK_ROWS),
                None => 0,
            },
        });
    }
    bar.finish_and_clear();
    Ok(if root { results } else { Vec::new() })
}

/// Whether NCCL EP runs beside ours on this rank's communicator: `None`
/// with one line from rank 0 when it cannot (not on every rank, virtual
/// ranks, the library absent or unfit), silently with `--no-baselines` or
/// `--no-nccl-ep`. Collective on NCCL ranks (they agree).
fn nccl_ep_baseline(c: &Ctx<'_>) -> R<Option<&'static nccl_ep::Lib>> {
    if c.opts.no_baselines || c.opts.no_nccl_ep {
        return Ok(None);
    }
    if c.comm.is_virtual() || c.comm.raw().is_none() {
        c.note("ep-bench: NCCL EP baseline left out: not applicable to virtual ranks (it needs an NCCL communicator)");
        return Ok(None);
    }
    let mine = nccl_ep::load();
    let all = c
        .comm
        .all_gather_host(&c.stream, &[mine.is_ok() as u8])
        .map_err(s)?;
    let missing: Vec<String> = (all.iter().enumerate())
        .filter(|(_, &v)| v != 1)
        .map(|(r, _)| r.to_string())
        .collect();
    match mine {
        Err(why) => {
            c.note(&format!("ep-bench: NCCL EP baseline left out: {why}"));
            Ok(None)
        }
        Ok(_) if !missing.is_empty() => {
            c.note(&format!(
                "ep-bench: NCCL EP baseline left out: it did not load on rank(s) {}",
                missing.join(", ")
            ));
            Ok(None)
        }
        Ok(lib) => {
            c.note(&format!("ep-bench: NCCL EP baseline: {}", lib.describe()));
            Ok(Some(lib))
        }
    }
}

/// One case on one rank: our ops, their local-copy ceilings (and, on NCCL
/// ranks, the NVLink baselines), all ranks' statistics gathered, the
/// `--check` outcome when asked for, and that of NCCL EP's cross-check.
fn run_case(c: &Ctx<'_>, case: &Case, world: usize) -> R<Outcome> {
    if case.mode == moe_ep::Mode::LowLatency {
        return ll::run_case(c, case, world);
    }
    if let Some(g) = c.opts.ranks_per_node {
        return two_level::run_case(c, case, world, g);
    }
    let opts = c.opts;
    let (rank, s_) = (c.comm.rank(), &c.stream);
    let shape = Shape {
        num_ranks: world,
        num_experts: case.experts,
        hidden: case.hidden,
        topk: case.topk,
    };
    shape.validate().map_err(s)?;
    let layout = case.layout;
    let routing = routings(case, &shape, opts.seed, world)?;
    let (counts, cap) = counts_and_capacity(&shape, &routing, layout)?;
    let rows_on = |d: usize| recv_rows(&counts, layout, d);
    let mut cfg = GroupConfig::new(case.experts, case.hidden, case.tokens.max(1));
    cfg.recv_capacity = cap;
    cfg.num_sms = case.num_sms;
    // Tuning knob, not a CLI option: combine's pipeline depth.
    if let Ok(v) = std::env::var("MOE_EP_COMBINE_CHUNKS") {
        cfg.combine_chunks = v
            .parse()
            .map_err(|_| format!("MOE_EP_COMBINE_CHUNKS: {v:?} is not a number"))?;
    }
    // Tuning knob: expert-major padding rows left unwritten
    // (GroupConfig::zero_padding = false), for timing both settings.
    if std::env::var("MOE_EP_ZERO_PADDING").as_deref() == Ok("0") {
        if opts.check {
            return Err(
                "MOE_EP_ZERO_PADDING=0 leaves padding rows unwritten, which --check \
                        compares with zeros: run it without --check"
                    .into(),
            );
        }
        cfg.zero_padding = false;
    }
    let group = EpGroup::new(&c.comm, cfg).map_err(s)?;
    // The group's own, before the pool gives out buffers.
    let footprint = group.memory_footprint();
    let me = rank_input(case, opts.seed, rank, routing[rank].clone());
    let (t, h, k) = (case.tokens, case.hidden, case.topk);
    let (x, w, idx) = upload(s_, &me)?;
    let (xv, wv, idxv) = (x.slice(0..t * h), w.slice(0..t * k), idx.slice(0..t * k));
    let mut recv = group.pool().alloc::<bf16>(cap * h).map_err(s)?;
    let wpr = if matches!(layout, RecvLayout::RankMajor) {
        k
    } else {
        1
    };
    let mut recv_w = group.pool().alloc::<f32>(cap * wpr).map_err(s)?;
    // dispatch-fp8: this rank's random codes and scales, and their receive buffers.
    let mut fp8_dev = match opts.ops.contains(&Op::DispatchFp8) {
        true => {
            let me = fp8::payload(opts.seed, rank, t, h, case.fp8_scales);
            Some(Fp8Dev::new(s_, &group, me, (t, h), (cap, wpr))?)
        }
        false => None,
    };
    let mut out = s_.alloc_zeros::<bf16>((t * h).max(1)).map_err(s)?;
    let mut grad_w = s_.alloc_zeros::<f32>((t * k).max(1)).map_err(s)?;
    // combine-push: the same expert outputs in plain (non-symmetric) memory.
    let plain = if opts.ops.contains(&Op::CombinePush) {
        let mut v = s_.alloc_zeros::<bf16>(cap * h).map_err(s)?;
        recv.copy_to_device(s_, &mut v).map_err(s)?;
        Some(v)
    } else {
        None
    };

    let handle = group
        .layout(s_, TopkIdx::I64(&idxv), k, layout)
        .map_err(s)?;
    // The pool in use while a dispatch holds its outputs (collective: every
    // rank dispatches here, untimed).
    let pool_in_use = {
        let d = group
            .dispatch(
                s_,
                &handle,
                &xv,
                &wv,
                DispatchOut {
                    recv_tokens: Some(&mut recv),
                    recv_topk_weights: Some(&mut recv_w),
                },
            )
            .map_err(s)?;
        let f = group.memory_footprint();
        drop(d);
        f.pool_other - f.pool_free
    };
    let mut memory = Memory {
        moe_ep: moe_ep_memory(footprint, Some(handle.device_bytes()), Some(pool_in_use)),
        nccl_ep: None,
    };
    let eb = case.dtype.elem_bytes();
    let traffic = crate::accounting::Traffic::new(&counts.rank, world, h, eb).with_topk(h, k);
    let bytes = |op: Op| traffic.op(op, rank);
    let mut mine: Vec<Measured> = Vec::new();

    // --check: dispatch and combine against the CPU reference, once.
    let mut checked = if opts.check {
        let inputs: Vec<RankInput> = (0..world)
            .map(|r| rank_input(case, opts.seed, r, routing[r].clone()))
            .collect();
        Some(check_case(
            c,
            &group,
            &handle,
            shape,
            inputs,
            layout,
            (&xv, &wv),
            (&mut recv, &mut recv_w),
            &mut out,
        )?)
    } else {
        None
    };
    // --check: the fp8 dispatch too, bit for bit.
    if let (Some(ch), Some(f)) = (checked.as_mut(), fp8_dev.as_mut()) {
        let (ok, packed) = check_fp8(c, &group, &handle, ch, case, f, &wv)?;
        ch.ok &= ok;
        ch.fp8 = Some(packed);
    }
    let check = all_ranks_ok(c, checked.as_ref().map(|ch| ch.ok))?;

    let mut bufs = HtBufs {
        idx: &idxv,
        x: &xv,
        w: &wv,
        recv: &mut recv,
        recv_w: &mut recv_w,
        out: &mut out,
        grad_w: &mut grad_w,
    };
    for &op in &opts.ops {
        let samples = match op {
            Op::CombinePush => {
                let y = plain.as_ref().expect("allocated when asked for");
                let out = &mut *bufs.out;
                c.time(op.name(), || {
                    group.combine(s_, &handle, y, None, out).map_err(s)
                })?
            }
            Op::DispatchFp8 => {
                let f = fp8_dev.as_mut().expect("allocated when asked for");
                c.time(op.name(), || {
                    f.dispatch(&group, s_, &handle, &wv, |_| Ok(()))
                })?
            }
            // Refused by the command line (`--mode ll` runs them: [`ll`]).
            Op::LlDispatch | Op::LlDispatchFp8 | Op::LlCombine | Op::LlPair => {
                return Err(format!("{} is an op of --mode ll", op.name()))
            }
            _ => time_ht_op(c, &group, &handle, op, k, layout, &mut bufs, false)?,
        };
        let b = bytes(op);
        mine.push((op.name().to_string(), samples, b.nvlink, b.logical));
    }
    group.check().map_err(s)?;

    // The local-copy ceilings, on virtual ranks too: nothing crosses NVLink.
    if !opts.no_baselines {
        mine.extend(local_copies(
            c,
            (DeviceRegion::device_ptr(&x), DeviceRegion::device_ptr(&out)),
            (t, rows_on(rank)),
            h * eb,
            traffic.logical(rank),
            case.num_sms,
        )?);
    }

    // Virtual ranks share one GPU: no NVLink to measure.
    if !opts.no_baselines && world > 1 && !c.comm.is_virtual() {
        let nv = bytes(Op::Dispatch).nvlink;
        mine.extend(baselines(
            c,
            &group,
            &counts.rank,
            world,
            h * eb,
            nv,
            case.num_sms,
        )?);
    }

    // NCCL EP on the same communicator, inputs and SM count.
    let mut nccl_ep_check = None;
    if let Some(lib) = c.nccl_ep {
        match nccl_ep::pairing(case, world) {
            Err(why) => c.note(&format!(
                "ep-bench: NCCL EP: {}: not applicable: {why}",
                case.label()
            )),
            Ok(pairing) => {
                let spec = nccl_ep::Spec {
                    tokens: t,
                    hidden: h,
                    topk: k,
                    experts: case.experts,
                    world,
                    num_sms: case.num_sms,
                    recv_rows: cap,
                    pairing,
                };
                let inputs = nccl_ep::Inputs {
                    topk_idx: DeviceRegion::device_ptr(&idx),
                    x: DeviceRegion::device_ptr(&x),
                    w: DeviceRegion::device_ptr(&w),
                    fp8: fp8_dev.as_ref().map(Fp8Dev::inputs),
                };
                let ran = run_nccl_ep(c, lib, case, spec, inputs, checked.as_ref(), &bytes);
                if let Some((v, m)) = keep_nccl_ep_rows(c, s_, case, ran, &mut mine)? {
                    (nccl_ep_check, memory.nccl_ep) = (v, Some(m));
                }
            }
        }
    }
    Ok(Outcome {
        ops: gather(c, mine)?,
        check,
        nccl_ep_check,
        memory: gather_memory(c, memory)?,
    })
}

/// moe-ep's memory of a case on this rank: the group's `footprint` (read
/// right after it was made), its handle's bytes and the pool's bytes in use
/// while a dispatch holds its outputs.
fn moe_ep_memory(
    footprint: moe_ep::MemoryFootprint,
    handle: Option<u64>,
    pool_in_use: Option<u64>,
) -> MoeEpMemory {
    MoeEpMemory {
        workspace: footprint.workspace,
        low_latency: footprint.low_latency,
        pool_other: footprint.pool_other,
        pool_free: footprint.pool_free,
        two_level: footprint.two_level,
        pinned_host: footprint.pinned_host,
        handle,
        pool_in_use,
    }
}

/// Every rank's `mine`, the largest of each field ([`Memory::largest`]);
/// collective.
fn gather_memory(c: &Ctx<'_>, mine: Memory) -> R<Option<Memory>> {
    let words = mine.words();
    let all = c.comm.all_gather_host(&c.stream, &words).map_err(s)?;
    let ranks: Vec<Memory> = all
        .chunks_exact(words.len())
        .map(|w| {
            let mut a = [0u64; 12];
            a.copy_from_slice(w);
            Memory::from_words(&a)
        })
        .collect();
    Ok(Memory::largest(&ranks))
}

/// How long a probed call may take while its stream is held before it is
/// deemed to wait for the GPU.
const PROBE_WAIT: Duration = Duration::from_secs(3);

/// A host-pinned word mapped for the GPU: the probe's gate.
struct HostWord {
    host: *mut u32,
    device: u64,
}

impl HostWord {
    /// A zero word (the context bound to this thread).
    fn new() -> R<HostWord> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: four bytes; the result is checked.
        let host = unsafe { cu::malloc_host(4, flags) }.map_err(s)? as *mut u32;
        // SAFETY: valid for one u32.
        unsafe { host.write_volatile(0) };
        let mut device = 0u64;
        // SAFETY: host is a live mapped allocation.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: allocated above, freed once.
            let _ = unsafe { cu::free_host(host.cast()) };
            return Err(format!("cuMemHostGetDevicePointer: {rc:?}"));
        }
        Ok(HostWord { host, device })
    }
}

impl Drop for HostWord {
    fn drop(&mut self) {
        // SAFETY: allocated in new; the stream that waited on it has drained.
        if let Err(e) = unsafe { cu::free_host(self.host.cast()) } {
            eprintln!("ep-bench: cuMemFreeHost failed: {e}");
        }
    }
}

/// Whether `f` returns while `stream` is held, as behind `--start gpu`'s
/// gate: `f`'s work is enqueued behind a host-mapped word that a watchdog
/// sets after [`PROBE_WAIT`] should `f` not have returned by then. A call
/// that waits for the GPU inside (a stream synchronisation, a blocking
/// copy) would never return behind the gate, which opens only after it.
fn returns_while_held(stream: &Arc<CudaStream>, f: impl FnOnce() -> R<()>) -> R<bool> {
    let word = HostWord::new()?;
    // SAFETY: a live mapped word; flags 0 = wait until it is >= 1.
    let rc = unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), word.device, 1, 0) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuStreamWaitValue32: {rc:?}"));
    }
    let addr = word.host as usize;
    // SAFETY: the word lives until the stream has drained, below.
    let open = move || unsafe { (addr as *mut u32).write_volatile(1) };
    let (tx, rx) = mpsc::channel::<()>();
    let (ran, fired) = std::thread::scope(|scope| {
        let dog = scope.spawn(move || {
            let late = rx.recv_timeout(PROBE_WAIT).is_err();
            if late {
                open();
            }
            late
        });
        let ran = f();
        let _ = tx.send(());
        open();
        (ran, dog.join().unwrap_or(true))
    });
    stream.synchronize().map_err(s)?;
    drop(word);
    ran?;
    Ok(!fired)
}

/// NCCL EP's rows of a case (`ran`: its measurements, cross-check
/// verdict and memory) go into `mine` only when every rank ran it; returns
/// the check verdict over all ranks then (`Some(None)`: not checked) and
/// this rank's memory of it, `None` when its rows were left out (said once).
fn keep_nccl_ep_rows(
    c: &Ctx<'_>,
    stream: &Arc<CudaStream>,
    case: &Case,
    ran: R<NcclEpRun>,
    mine: &mut Vec<Measured>,
) -> R<Option<(Option<bool>, NcclEpMemory)>> {
    let code = match &ran {
        Ok((_, Some(true), _)) => 1u8,
        Ok((_, Some(false), _)) => 2,
        Ok((_, None, _)) => 3,
        Err(_) => 0,
    };
    let all = c.comm.all_gather_host(stream, &[code]).map_err(s)?;
    match ran {
        Ok((rows, v, memory)) if all.iter().all(|&a| a != 0) => {
            mine.extend(rows);
            Ok(Some((v.map(|_| all.iter().all(|&a| a == 1)), memory)))
        }
        Ok(_) => {
            c.note(&format!(
                "ep-bench: NCCL EP: {}: failed on another rank; its rows left out",
                case.label()
            ));
            Ok(None)
        }
        Err(e) => {
            eprintln!(
                "ep-bench: rank {}: NCCL EP: {}: {e}; its rows left out",
                c.comm.rank(),
                case.label()
            );
            Ok(None)
        }
    }
}

/// NCCL EP beside one case: its group and handle, its layout (handle
/// update), dispatch and combine once (the cross-check under `--check`),
/// then the rows of the NCCL EP ops matching `--ops`, timed as ours are:
/// CUDA events on the stream around the call; a call that waits for the
/// GPU inside (probed first) behind a hold instead of the start gate
/// ([`nccl_ep_begin`], [`Begin::Held`]), said once per run.
fn run_nccl_ep(
    c: &Ctx<'_>,
    lib: &'static nccl_ep::Lib,
    case: &Case,
    spec: nccl_ep::Spec,
    inputs: nccl_ep::Inputs,
    checked: Option<&Checked>,
    bytes: &dyn Fn(Op) -> OpBytes,
) -> R<NcclEpRun> {
    // SAFETY: inputs are run_case's buffers of these sizes, alive until
    // after `ep` drops at the end of this function.
    let mut ep = unsafe { nccl_ep::Runner::new(lib, &c.comm, &c.stream, spec, inputs)? };
    ep.layout()?;
    ep.recv_total()?;
    ep.dispatch()?;
    let verdict = match checked {
        Some(ch) => {
            let got = ep.received()?;
            ep.combine()?;
            let comb = ep.combined()?;
            Some(cross_check(c, case, spec.pairing, ch, &got, &comb))
        }
        None => {
            ep.combine()?;
            None
        }
    };
    // Its rows, one per NCCL EP op that some op of ours asks for.
    let mut ops: Vec<(Op, &'static str)> = Vec::new();
    for &op in &c.opts.ops {
        let name = crate::report::nccl_ep_row(op);
        if !ops.iter().any(|&(_, n)| n == name) {
            ops.push((op, name));
        }
    }
    let run = |ep: &mut nccl_ep::Runner, op: Op| match op {
        Op::Layout => ep.layout(),
        Op::Dispatch => ep.dispatch(),
        Op::DispatchFp8 => ep.dispatch_fp8(),
        Op::Combine | Op::CombinePush => ep.combine(),
        Op::DispatchBwd => ep.dispatch_bwd(),
        Op::CombineBwd => ep.combine_bwd(),
        Op::LlDispatch | Op::LlDispatchFp8 | Op::LlCombine | Op::LlPair => {
            Err(format!("{} is an op of --mode ll", op.name()))
        }
    };
    // Every call once untimed before it is probed (its kernels are
    // compiled at first use). A backward pass or an fp8 dispatch it
    // refuses is left out alone.
    let mut primed = Vec::new();
    for (op, name) in ops {
        match run(&mut ep, op) {
            Ok(()) => primed.push((op, name)),
            Err(e) if matches!(op, Op::DispatchBwd | Op::CombineBwd | Op::DispatchFp8) => {
                c.note_once(format!("ep-bench: NCCL EP's {name} left out: {e}"))
            }
            Err(e) => return Err(e),
        }
    }
    let ops = primed;
    // --check: its fp8 rows (codes with their scales) against the reference's.
    let verdict = match (verdict, checked.and_then(|ch| ch.fp8.as_ref())) {
        (Some(v), Some(want)) if ops.iter().any(|&(op, _)| op == Op::DispatchFp8) => {
            ep.dispatch_fp8()?;
            let got = ep.received_fp8()?;
            Some(cross_check_fp8(c, case, spec.pairing, want, &got) && v)
        }
        (v, _) => v,
    };
    c.stream.synchronize().map_err(s)?;
    let mut out = Vec::new();
    for (op, name) in ops {
        let begin = nccl_ep_begin(c, || run(&mut ep, op))?;
        let samples = c.time_begin(name, begin, || Ok(()), || run(&mut ep, op))?;
        let b = bytes(op);
        out.push((name.to_string(), samples, b.nvlink, b.logical));
    }
    let memory = ep.memory();
    drop(ep);
    Ok((out, verdict, memory))
}

/// How NCCL EP's call `probe` (one run of an op, its inputs ready) is
/// timed: from the host barrier under `--start host`; behind the start gate
/// when the call returns while its stream is held ([`returns_while_held`],
/// on every rank); else (the call waits for the GPU inside) behind a hold
/// that opens a window after the call began ([`Begin::Held`]).
fn nccl_ep_begin(c: &Ctx<'_>, probe: impl FnOnce() -> R<()>) -> R<Begin> {
    if !c.opts.gpu_start() {
        return Ok(Begin::Host);
    }
    let held = returns_while_held(&c.stream, probe)?;
    let all = c
        .comm
        .all_gather_host(&c.stream, &[held as u8])
        .map_err(s)?;
    Ok(match all.iter().all(|&v| v == 1) {
        true => Begin::Gate,
        false => Begin::Held,
    })
}

/// NCCL EP's dispatch output and combine against the reference and ours
/// ([`nccl_ep::compare_dispatch`], [`nccl_ep::compare_combine`]); says how
/// it went (rank 0 when it passed, every failing rank when not).
fn cross_check(
    c: &Ctx<'_>,
    case: &Case,
    pairing: nccl_ep::Pairing,
    ch: &Checked,
    got: &nccl_ep::Received,
    comb: &[bf16],
) -> bool {
    let rank = c.comm.rank();
    let d = nccl_ep::compare_dispatch(&ch.want, got, case.layout, case.hidden, case.topk);
    let exact =
        || refr::combine_f64(&ch.shape, &ch.inputs, &ch.outs, rank, case.layout, false).map_err(s);
    let k = nccl_ep::compare_combine(comb, &ch.comb, &ch.emu, &exact, case.hidden);
    let what = format!("NCCL EP ({}) cross-check, {}", pairing.name(), case.label());
    match (&d, &k) {
        (Ok(order), Ok(same_bits)) => {
            if !c.opts.quiet {
                let rows = if ch.ok {
                    "rows and weights equal the CPU reference's (so moe-ep's)"
                } else {
                    "rows and weights equal the CPU reference's"
                };
                let comb = if *same_bits {
                    "combine output equals moe-ep's bit for bit"
                } else {
                    "combine output equals, element by element, moe-ep's, the reference's emulation or the rounded exact sum"
                };
                c.note(&format!(
                    "ep-bench: {what}: ok: {} rows {}; {rows}; {comb}",
                    got.total,
                    order.words()
                ));
            }
            true
        }
        _ => {
            if let Err(e) = &d {
                eprintln!("ep-bench: rank {rank}: {what}: FAILED: dispatch: {e}");
            }
            if let Err(e) = &k {
                eprintln!("ep-bench: rank {rank}: {what}: FAILED: {e}");
            }
            false
        }
    }
}

/// NCCL EP's fp8 dispatch output (`got`: its codes and scales packed,
/// [`nccl_ep::Runner::received_fp8`]) against the reference's `want`
/// ([`fp8::packed_output`]) with the bf16 rows' comparison
/// ([`nccl_ep::compare_dispatch`]: counts, rows in any order, weights and
/// ids); says how it went (rank 0 when it passed, every failing rank when
/// not).
fn cross_check_fp8(
    c: &Ctx<'_>,
    case: &Case,
    pairing: nccl_ep::Pairing,
    want: &refr::DispatchOutput,
    got: &nccl_ep::Received,
) -> bool {
    let width = fp8::packed_width(case.hidden);
    let what = format!(
        "NCCL EP ({}) fp8 (QUANT_FWD, {} scales) cross-check, {}",
        pairing.name(),
        case.fp8_scales.describe(),
        case.label()
    );
    match nccl_ep::compare_dispatch(want, got, case.layout, width, case.topk) {
        Ok(order) => {
            if !c.opts.quiet {
                c.note(&format!(
                    "ep-bench: {what}: ok: {} rows {}; codes, scales, weights and ids equal \
                     the CPU reference's",
                    got.total,
                    order.words()
                ));
            }
            true
        }
        Err(e) => {
            eprintln!(
                "ep-bench: rank {}: {what}: FAILED: dispatch (a row is its codes then its \
                 scale bytes, shown as bf16 words): {e}",
                c.comm.rank()
            );
            false
        }
    }
}

/// NCCL grouped send/recv of this rank's dispatch rows to every rank (the
/// all-to-all) and to the peers only; SM stores and bulk (TMA) copies into
/// the next rank's symmetric buffer; SM loads and bulk copies from it;
/// copy-engine peer copy.
fn baselines(
    c: &Ctx<'_>,
    group: &EpGroup,
    counts: &[u32],
    world: usize,
    row: usize,
    nv: u64,
    sms: usize,
) -> R<Vec<Measured>> {
    let rank = c.comm.rank();
    let total_rows: usize = (0..world)
        .map(|d| counts[rank * world + d].max(counts[d * world + rank]) as usize)
        .sum::<usize>()
        .max(1);
    let send = group.pool().alloc::<u8>(total_rows * row).map_err(s)?;
    let recv = group.pool().alloc::<u8>(total_rows * row).map_err(s)?;
    // Real bytes, not the allocation's zeros: the baselines move data as
    // varied as the tokens (all-zero lines could be cheaper to move).
    // SAFETY: send holds total_rows * row bytes, a multiple of 4.
    unsafe {
        moe_ep::testkit::copy::fill_pattern(
            &c.stream,
            send.device_ptr(),
            (total_rows * row / 4) as u64,
            7,
        )
        .map_err(s)?;
    }
    // NCCL's all-to-all as PyTorch's `all_to_all_single` issues it for
    // uneven splits: grouped send/recv with every rank, this one included
    // (NCCL copies the rows that stay here itself), the rows our dispatch
    // moves. Then the same without the self pair: the NVLink bytes alone.
    let nccl = |with_self| {
        exchange_rows(&c.comm, &c.stream, &send, &recv, counts, row, with_self).map_err(s)
    };
    let a2a = c.time("nccl", || nccl(true))?;
    let peers = c.time("nccl-peers", || nccl(false))?;
    let own = counts[rank * world + rank] as u64 * row as u64;
    let peer = (rank + 1) % world;
    let dst = recv.peer_ptr(peer).ok_or("peer not reachable")?;
    let len = (nv / 16 * 16).min(recv.len() as u64);
    // SAFETY: len bytes fit both buffers.
    let store = c.time("peer-store", || unsafe {
        moe_ep::testkit::copy::sm_copy(&c.stream, send.device_ptr(), dst, len, sms as u32)
            .map_err(s)
    })?;
    // The same copy the other way: SM loads of the peer's buffer (what a
    // combine that reads its partials in place does), local stores.
    let src = send.peer_ptr(peer).ok_or("peer not reachable")?;
    // SAFETY: as above.
    let load = c.time("peer-load", || unsafe {
        moe_ep::testkit::copy::sm_copy(&c.stream, src, recv.device_ptr(), len, sms as u32)
            .map_err(s)
    })?;
    // SAFETY: as above.
    let bulk = c.time("bulk-copy", || unsafe {
        moe_ep::testkit::copy::bulk_copy(&c.stream, send.device_ptr(), dst, len, sms as u32)
            .map_err(s)
    })?;
    // SAFETY: as above.
    let bulk_load = c.time("bulk-load", || unsafe {
        moe_ep::testkit::copy::bulk_copy(&c.stream, src, recv.device_ptr(), len, sms as u32)
            .map_err(s)
    })?;
    let ce = c.time("copy-engine", || unsafe {
        cu::memcpy_dtod_async(dst, send.device_ptr(), len as usize, c.stream.cu_stream()).map_err(s)
    })?;
    Ok(vec![
        (report::NCCL_ALLTOALL.to_string(), a2a, nv, nv + own),
        (report::NCCL_PEERS.to_string(), peers, nv, nv),
        (report::PEER_STORE_CEILING.to_string(), store, len, len),
        (report::PEER_LOAD_CEILING.to_string(), load, len, len),
        (report::BULK_COPY_CEILING.to_string(), bulk, len, len),
        (report::BULK_LOAD_CEILING.to_string(), bulk_load, len, len),
        (report::COPY_ENGINE.to_string(), ce, len, len),
    ])
}

/// The local-copy ceilings of the ops in `--ops` ([`report::local_copy_row`]),
/// each once, with `sms` blocks: `local-copy-dispatch` fans this rank's
/// `tokens` rows (`x`) out into its `recv_rows` received rows (expert-major:
/// padding included), `local-copy-combine` folds those rows into `tokens`
/// rows (`out`); rows of `row` bytes ([`moe_ep::testkit::copy::fan_copy`]:
/// every source row read once, every destination row written once). The
/// received rows live in a buffer of this rank's own, filled with a pattern:
/// the op's receive buffer is the peers' to read while they finish their
/// last runs. The rows carry no NVLink bytes (none cross) and the op's
/// `logical` bytes, so their logical GB/s is the op's at the ceiling's time.
fn local_copies(
    c: &Ctx<'_>,
    (x, out): (u64, u64),
    (tokens, recv_rows): (usize, usize),
    row: usize,
    logical: u64,
    sms: usize,
) -> R<Vec<Measured>> {
    let mut names: Vec<&'static str> = Vec::new();
    for &op in &c.opts.ops {
        if let Some(name) = report::local_copy_row(op) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let received = c
        .stream
        .alloc_zeros::<u8>((recv_rows * row).max(16))
        .map_err(s)?;
    let at = DeviceRegion::device_ptr(&received);
    // Real bytes, as the NVLink baselines move (all-zero lines could be
    // cheaper to move).
    // SAFETY: received holds at least recv_rows * row bytes, a multiple of 4.
    unsafe {
        moe_ep::testkit::copy::fill_pattern(&c.stream, at, (recv_rows * row / 4) as u64, 11)
            .map_err(s)?;
    }
    let (t, d) = (tokens as u64, recv_rows as u64);
    let mut rows = Vec::new();
    for name in names {
        let (src, dst) = if name == report::LOCAL_COPY_DISPATCH {
            ((x, t), (at, d))
        } else {
            ((at, d), (out, t))
        };
        // SAFETY: x and out hold `tokens` rows, received `recv_rows`; the
        // three do not overlap.
        let samples = c.time(name, || unsafe {
            moe_ep::testkit::copy::fan_copy(&c.stream, src, dst, row as u64, sms as u32).map_err(s)
        })?;
        rows.push((name.to_string(), samples, 0, logical));
    }
    Ok(rows)
}

/// All ranks' statistics of every op, gathered in rank order.
fn gather(c: &Ctx<'_>, mine: Vec<Measured>) -> R<Vec<OpResult>> {
    let mut flat: Vec<f64> = Vec::new();
    for (_, samples, nv, lg) in &mine {
        let mut v = samples.clone();
        let st = Stat::from_samples(&mut v);
        flat.extend([st.median_us, st.min_us, st.max_us, *nv as f64, *lg as f64]);
    }
    let all = c.comm.all_gather_host(&c.stream, &flat).map_err(s)?;
    let world = c.comm.world();
    let per = flat.len();
    Ok(mine
        .iter()
        .enumerate()
        .map(|(i, (name, ..))| {
            let at = |r: usize, j: usize| all[r * per + i * 5 + j];
            OpResult {
                op: name.clone(),
                per_rank: (0..world)
                    .map(|r| Stat {
                        median_us: at(r, 0),
                        min_us: at(r, 1),
                        max_us: at(r, 2),
                    })
                    .collect(),
                nvlink_bytes: (0..world).map(|r| at(r, 3) as u64).collect(),
                logical_bytes: (0..world).map(|r| at(r, 4) as u64).collect(),
                network_bytes: Vec::new(),
            }
        })
        .collect())
}

/// What `--check` compared, kept for NCCL EP's cross-check.
struct Checked {
    /// Ours passed (this rank).
    ok: bool,
    /// The case's shape.
    shape: Shape,
    /// Every rank's inputs.
    inputs: Vec<RankInput>,
    /// The reference's dispatch output of this rank.
    want: refr::DispatchOutput,
    /// Every rank's reference dispatch rows (identity expert outputs).
    outs: Vec<Vec<bf16>>,
    /// The reference's emulation of our combine on this rank.
    emu: Vec<bf16>,
    /// Our combine output on this rank.
    comb: Vec<bf16>,
    /// `dispatch-fp8`: the reference's output with its rows replaced by the
    /// fp8 rows, codes and scales packed ([`fp8::packed_output`]), for
    /// NCCL EP's fp8 cross-check.
    fp8: Option<refr::DispatchOutput>,
}

/// Dispatch bit for bit and combine (identity experts) bit for bit against
/// the reference's emulation of the kernel arithmetic.
#[allow(clippy::too_many_arguments)]
fn check_case(
    c: &Ctx<'_>,
    group: &EpGroup,
    handle: &moe_ep::Handle,
    shape: Shape,
    inputs: Vec<RankInput>,
    layout: RecvLayout,
    (x, w): (&dyn DeviceRegion<bf16>, &dyn DeviceRegion<f32>),
    (recv, recv_w): (&mut moe_ep::SymmBuffer<bf16>, &mut moe_ep::SymmBuffer<f32>),
    out: &mut CudaSlice<bf16>,
) -> R<Checked> {
    let (rank, s_) = (c.comm.rank(), &c.stream);
    let want = refr::dispatch(&shape, &inputs, rank, layout).map_err(s)?;
    let d = group
        .dispatch(
            s_,
            handle,
            x,
            w,
            DispatchOut {
                recv_tokens: Some(recv),
                recv_topk_weights: Some(recv_w),
            },
        )
        .map_err(s)?;
    drop(d);
    group.combine(s_, handle, &*recv, None, out).map_err(s)?;
    let h = shape.hidden;
    let mut got = vec![bf16::ZERO; want.num_rows * h];
    let t = inputs[rank].topk_idx.len() / shape.topk;
    let mut comb = vec![bf16::ZERO; t * h];
    // Drained first (as `copy_to_host` does): pageable copies of all
    // threads share the driver's staging buffers, so a copy waiting behind
    // this rank's kernels would hold up a virtual sibling's copies and launches.
    recv.copy_to_host(s_, &mut got).map_err(s)?;
    if !comb.is_empty() {
        s_.memcpy_dtoh(&out.slice(0..t * h), &mut comb).map_err(s)?;
    }
    s_.synchronize().map_err(s)?;
    group.check().map_err(s)?;
    let outs: Vec<Vec<bf16>> = (0..shape.num_ranks)
        .map(|d| refr::dispatch(&shape, &inputs, d, layout).map(|o| o.tokens))
        .collect::<Result<_, Error>>()
        .map_err(s)?;
    let emu = refr::combine_emulated(&shape, &inputs, &outs, rank, layout, false).map_err(s)?;
    let same = |a: &[bf16], b: &[bf16]| {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    };
    let ok = same(&got, &want.tokens) && same(&comb, &emu);
    if !ok {
        eprintln!(
            "ep-bench: rank {rank}: --check failed (dispatch {}, combine {})",
            same(&got, &want.tokens),
            same(&comb, &emu)
        );
    }
    Ok(Checked {
        ok,
        shape,
        inputs,
        want,
        outs,
        emu,
        comb,
        fp8: None,
    })
}

/// `--check` of `dispatch-fp8`: one fp8 dispatch of every rank's random
/// codes and scales ([`fp8::payload`]) with the case's weights, its codes,
/// scales, weights, local expert ids and sources compared bit for bit with
/// the reference's ([`fp8::expected`], `reference::dispatch_rows`). Returns
/// whether they matched on this rank (a difference is named on stderr),
/// and the reference's output of packed fp8 rows for NCCL EP's cross-check.
fn check_fp8(
    c: &Ctx<'_>,
    group: &EpGroup,
    handle: &Handle,
    ch: &Checked,
    case: &Case,
    f: &mut Fp8Dev,
    w: &dyn DeviceRegion<f32>,
) -> R<(bool, refr::DispatchOutput)> {
    let (rank, s_) = (c.comm.rank(), &c.stream);
    let (h, k) = (case.hidden, case.topk);
    let payloads: Vec<fp8::Payload> = (ch.inputs.iter().enumerate())
        .map(|(r, inp)| fp8::payload(c.opts.seed, r, inp.topk_idx.len() / k, h, case.fp8_scales))
        .collect();
    let (want, bf) = fp8::expected(&ch.shape, &ch.inputs, &payloads, rank, case.layout)?;
    drop(payloads);
    let wpr = match case.layout {
        RecvLayout::RankMajor => k,
        RecvLayout::ExpertMajor { .. } => 1,
    };
    let (rows, idx, src) = f.dispatch(group, s_, handle, w, |d| {
        let rows = handle.host_counts(s_).map_err(s)?.recv_rows;
        let n = rows.min(d.topk_idx.len() / wpr).min(d.src.len() / 2);
        let mut idx = vec![0i32; n * wpr];
        let mut src = vec![0i32; n * 2];
        d.topk_idx.copy_to_host(s_, &mut idx).map_err(s)?;
        d.src.copy_to_host(s_, &mut src).map_err(s)?;
        Ok((rows, idx, src))
    })?;
    // Rows past the buffers (an overflow) fail the row count.
    let n = rows.min(f.recv_codes.len() / h.max(1));
    let mut codes = vec![0u8; n * h];
    f.recv_codes.copy_to_host(s_, &mut codes).map_err(s)?;
    let scales = match &f.scales {
        Fp8Side::F32 { recv, .. } => {
            let mut v = vec![0f32; n * ScaleKind::F32.per_row(h)];
            recv.copy_to_host(s_, &mut v).map_err(s)?;
            fp8::Scales::F32(v)
        }
        Fp8Side::E8m0 { recv, .. } => {
            let mut v = vec![0u8; n * ScaleKind::E8m0.per_row(h)];
            recv.copy_to_host(s_, &mut v).map_err(s)?;
            fp8::Scales::E8m0(v)
        }
    };
    let mut weights = vec![0f32; n * wpr];
    f.recv_w.copy_to_host(s_, &mut weights).map_err(s)?;
    group.check().map_err(s)?;
    let got = fp8::Rows {
        rows,
        codes,
        scales,
        weights,
        idx,
        src: src.chunks_exact(2).map(|p| (p[0], p[1])).collect(),
    };
    let ok = match fp8::compare(&want, &got, h) {
        Ok(()) => true,
        Err(e) => {
            eprintln!(
                "ep-bench: rank {rank}: --check failed: dispatch-fp8 ({} scales): {e}",
                case.fp8_scales.describe()
            );
            false
        }
    };
    Ok((ok, fp8::packed_output(&bf, &want, h)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held run's window: four times the slowest warm-up call, within
    /// [2, 200] ms.
    #[test]
    fn hold_window_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(hold_window(Duration::ZERO), HOLD_MIN);
        assert_eq!(hold_window(Duration::from_micros(300)), ms(2));
        assert_eq!(hold_window(ms(3)), ms(12));
        assert_eq!(hold_window(ms(80)), HOLD_MAX);
        assert!(HOLD_MIN < HOLD_MAX);
    }
}
