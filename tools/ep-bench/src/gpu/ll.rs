//! `--mode ll`: one case of the low-latency ops on one rank.
//!
//! A group of [`Mode::LowLatency`] with `max_tokens_per_rank` = the case's
//! tokens, and four timed ops: `ll-dispatch` (bf16 rows), `ll-dispatch-fp8`
//! (rows cast to fp8 e4m3 by the sending kernel, exact per-128 scales),
//! `ll-combine` (bf16 expert outputs home) and `ll-pair` (the fp8 dispatch
//! and the combine of its batch, timed together: a decode step's
//! communication). A batch's buffer set takes the next batch only after
//! its combine, so a timed dispatch's batch is combined before the next
//! run, and a timed combine combines the batch an untimed dispatch sent
//! before it, both outside the timed span ([`Ctx::time_prepared`]). The
//! expert outputs combine sends are a plain device buffer holding the bf16
//! dispatch's received rows (identity experts).
//!
//! `--check` compares once, before timing, with the CPU reference: the bf16
//! and the fp8 dispatch bit for bit on the counted rows (rows, scales,
//! sources, counts; rank-major also the slots' local experts and weights),
//! and combine bit for bit with `reference::ll_combine_emulated` of those
//! identity experts. NCCL EP's low-latency mode runs beside ours on the same
//! communicator, inputs and SM cap ([`crate::nccl_ep::ll`]).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use moe_ep::cuda::{result as cu, CudaSlice, CudaStream, DeviceRepr};
use moe_ep::ops::{DeviceRegion, Fp8Scaling, LlHandle, LlInput, LlLayout, TopkIdx};
use moe_ep::reference::{self as refr, LlDispatchOutput, LlPayload, LlTokens, RankInput, Shape};
use moe_ep::{bf16, EpGroup, GroupConfig, Mode};

use super::{
    baselines, gather, gather_memory, keep_nccl_ep_rows, local_copies, moe_ep_memory,
    nccl_ep_begin, rank_input, routings, s, Ctx, Measured, NcclEpRun, Outcome, R,
};
use crate::accounting::{pair_counts, LlTraffic};
use crate::cli::{ll_layout, ll_layout_name, Case, Op};
use crate::memory::Memory;
use crate::nccl_ep::{self, ll as ep_ll};

/// The fp8 scaling of the fp8 ops (DeepEP's: amax / 448 per 128 values).
const SCALING: Fp8Scaling = Fp8Scaling::Exact;

/// What the reference says of one case, for every rank: computed once per
/// process and case (virtual ranks share it: expert-major rows are
/// `E * M * H` values per rank).
struct Reference {
    /// Which case, world and seed.
    key: String,
    shape: Shape,
    /// Every rank's inputs.
    inputs: Vec<RankInput>,
    /// Every rank's bf16 dispatch output: also the identity experts' outputs.
    bf16: Vec<LlDispatchOutput>,
    /// Every rank's combine of those outputs: our f32 arithmetic, emulated.
    emu: Vec<Vec<bf16>>,
    /// The same in f64 (for NCCL EP's cross-check).
    exact: Vec<Vec<f64>>,
}

/// The reference of `case` ([`Reference`]), from the process-wide cache.
fn reference(
    case: &Case,
    seed: u64,
    world: usize,
    shape: Shape,
    routing: &[Vec<i64>],
) -> R<Arc<Reference>> {
    static LAST: Mutex<Option<Arc<Reference>>> = Mutex::new(None);
    let key = format!(
        "{} routing={} seed={seed} world={world}",
        case.label(),
        case.routing
    );
    // Held while computing: the other virtual ranks wait for the same result.
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(r) = last.as_ref().filter(|r| r.key == key) {
        return Ok(r.clone());
    }
    *last = None;
    let inputs: Vec<RankInput> = (0..world)
        .map(|r| rank_input(case, seed, r, routing[r].clone()))
        .collect();
    let (m, layout) = (case.tokens.max(1), ll_layout(case.layout));
    let mut dispatched = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|d| {
                let (shape, inputs) = (&shape, &inputs);
                sc.spawn(move || refr::ll_dispatch(shape, inputs, m, d, layout, LlPayload::Bf16))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| "reference thread panicked".to_string())
            })
            .map(|r| r.and_then(|o| o.map_err(s)))
            .collect::<R<Vec<_>>>()
    })?;
    // The identity experts' outputs, lent out of the dispatch outputs.
    let outs: Vec<Vec<bf16>> = (dispatched.iter_mut())
        .map(|o| match &mut o.tokens {
            LlTokens::Bf16(v) => std::mem::take(v),
            LlTokens::Fp8(_) => Vec::new(),
        })
        .collect();
    let combined = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|home| {
                let (shape, inputs, outs) = (&shape, &inputs, &outs);
                sc.spawn(move || {
                    let emu = refr::ll_combine_emulated(shape, inputs, m, outs, home, layout);
                    let exact = refr::ll_combine_f64(shape, inputs, m, outs, home, layout);
                    emu.and_then(|e| exact.map(|x| (e, x))).map_err(s)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| "reference thread panicked".to_string())
            })
            .map(|r| r.and_then(|o| o))
            .collect::<R<Vec<_>>>()
    })?;
    for (o, v) in dispatched.iter_mut().zip(outs) {
        o.tokens = LlTokens::Bf16(v);
    }
    let (emu, exact) = combined.into_iter().unzip();
    let r = Arc::new(Reference {
        key,
        shape,
        inputs,
        bf16: dispatched,
        emu,
        exact,
    });
    *last = Some(r.clone());
    Ok(r)
}

/// `n` elements of `v` on the host (the stream drained first: pageable
/// copies of all threads share the driver's staging buffers, so a copy
/// queued behind kernels that wait for other virtual ranks would hold
/// theirs up).
fn down<T: DeviceRepr + Default + Clone>(
    st: &Arc<CudaStream>,
    v: &dyn DeviceRegion<T>,
    n: usize,
) -> R<Vec<T>> {
    let mut host = vec![T::default(); n];
    if n == 0 {
        return Ok(host);
    }
    if v.len() < n {
        return Err(format!("download of {n} values from {}", v.len()));
    }
    st.synchronize().map_err(s)?;
    // SAFETY: v holds at least n elements of T (checked above).
    unsafe { cu::memcpy_dtoh_async(&mut host, v.device_ptr(), st.cu_stream()) }.map_err(s)?;
    st.synchronize().map_err(s)?;
    Ok(host)
}

/// The first counted row (of `per_row` values) where `got` and `want`
/// differ, as a message.
fn diff_rows<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
    per_row: usize,
    rows: &[usize],
) -> Result<(), String> {
    for &row in rows {
        let r = row * per_row..(row + 1) * per_row;
        let (Some(g), Some(w)) = (got.get(r.clone()), want.get(r.clone())) else {
            return Err(format!("{what}: row {row} is missing"));
        };
        if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
            return Err(format!(
                "{what}: row {row}, value {i}: got {:?}, want {:?}",
                g[i], w[i]
            ));
        }
    }
    Ok(())
}

fn u16s(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn u32s(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A handle's outputs against the reference's (counted rows only).
fn compare_handle(
    st: &Arc<CudaStream>,
    hd: &LlHandle,
    want: &LlDispatchOutput,
    hidden: usize,
    topk: usize,
) -> Result<(), String> {
    let rows = want.num_rows;
    if hd.num_rows() != rows {
        return Err(format!("{} rows, the reference {rows}", hd.num_rows()));
    }
    let (el, r) = (
        want.tokens_per_local_expert.len(),
        want.tokens_from_rank.len(),
    );
    let i32s = |v: &[u32]| v.iter().map(|&x| x as i32).collect::<Vec<_>>();
    let counts = [
        (
            "tokens per local expert",
            down(st, &hd.tokens_per_local_expert(), el)?,
            i32s(&want.tokens_per_local_expert),
        ),
        (
            "tokens per (expert, source)",
            down(st, &hd.tokens_per_expert_source(), el * r)?,
            i32s(&want.tokens_per_expert_source),
        ),
        (
            "tokens from rank",
            down(st, &hd.tokens_from_rank(), r)?,
            i32s(&want.tokens_from_rank),
        ),
    ];
    for (what, got, want) in counts {
        if got != want {
            return Err(format!("{what}: got {got:?}, want {want:?}"));
        }
    }
    let counted = want.counted_rows();
    let src: Vec<i32> = want.src.iter().flat_map(|&(a, b)| [a, b]).collect();
    diff_rows("src", &down(st, &hd.src(), rows * 2)?, &src, 2, &counted)?;
    match (&want.tokens, hd.tokens(), hd.fp8_codes(), hd.fp8_scales()) {
        (LlTokens::Bf16(v), Some(x), _, _) => {
            let got = down(st, &x, rows * hidden)?;
            diff_rows("rows", &u16s(&got), &u16s(v), hidden, &counted)?;
        }
        (LlTokens::Fp8(q), None, Some(codes), Some(scales)) => {
            let got = down(st, &codes, rows * hidden)?;
            diff_rows("fp8 codes", &got, &q.codes, hidden, &counted)?;
            let nb = hidden / refr::FP8_BLOCK;
            let got = down(st, &scales, rows * nb)?;
            diff_rows("fp8 scales", &u32s(&got), &u32s(&q.scales), nb, &counted)?;
        }
        _ => return Err("rows of the wrong kind (bf16 / fp8)".into()),
    }
    if want.layout == LlLayout::RankMajor {
        let (Some(idx), Some(w)) = (hd.topk_local_idx(), hd.topk_weights()) else {
            return Err("a rank-major handle without slots".into());
        };
        let idx = down(st, &idx, rows * topk)?;
        diff_rows("local experts", &idx, &want.topk_local_idx, topk, &counted)?;
        let w = down(st, &w, rows * topk)?;
        let ww = u32s(&want.topk_weights);
        diff_rows("weights", &u32s(&w), &ww, topk, &counted)?;
    }
    Ok(())
}

/// What `--check` compared on this rank, kept for NCCL EP's cross-check.
pub(super) struct Checked {
    /// Ours passed.
    ok: bool,
    reference: Arc<Reference>,
    /// The reference's emulation of our combine on this rank.
    emu: Vec<bf16>,
    /// Our combine output on this rank.
    comb: Vec<bf16>,
}

/// The device buffers of one rank's case.
struct Bufs {
    x: CudaSlice<bf16>,
    w: CudaSlice<f32>,
    idx: CudaSlice<i64>,
    /// Expert outputs `[rows, H]` (the identity experts': the bf16 rows).
    y: CudaSlice<bf16>,
    /// Combine's output `[T, H]` (at least one element).
    out: RefCell<CudaSlice<bf16>>,
}

/// One case of `--mode ll` on one rank (see the module docs): our ops, the
/// local-copy ceilings and (NCCL ranks, world > 1) the NVLink baselines,
/// NCCL EP's low-latency ops; all ranks' statistics gathered, the `--check`
/// outcome and NCCL EP's cross-check.
pub(super) fn run_case(c: &Ctx<'_>, case: &Case, world: usize) -> R<Outcome> {
    let opts = c.opts;
    let (rank, s_) = (c.comm.rank(), &c.stream);
    let shape = Shape {
        num_ranks: world,
        num_experts: case.experts,
        hidden: case.hidden,
        topk: case.topk,
    };
    shape.validate().map_err(s)?;
    let layout = ll_layout(case.layout);
    let routing = routings(case, &shape, opts.seed, world)?;
    let layouts: Vec<refr::Layout> = routing
        .iter()
        .map(|t| refr::layout(&shape, t))
        .collect::<Result<_, _>>()
        .map_err(s)?;
    let counts = refr::gather_counts(&shape, &layouts);
    let (t, h, k) = (case.tokens, case.hidden, case.topk);
    let m = t.max(1);
    let mut cfg = GroupConfig::new(case.experts, h, m);
    cfg.mode = Mode::LowLatency;
    cfg.num_sms = case.num_sms;
    let group = EpGroup::new(&c.comm, cfg).map_err(s)?;
    // The low-latency mode makes no handle: its buffers are the group's.
    let mut memory = Memory {
        moe_ep: moe_ep_memory(group.memory_footprint(), None, None),
        nccl_ep: None,
    };
    let el = case.experts / world;
    let rows = match layout {
        LlLayout::ExpertMajor => el * world * m,
        LlLayout::RankMajor => world * m,
    };

    let me = rank_input(case, opts.seed, rank, routing[rank].clone());
    let nonempty = |v: &[bf16]| {
        if v.is_empty() {
            vec![bf16::ZERO]
        } else {
            v.to_vec()
        }
    };
    let b = Bufs {
        x: s_.clone_htod(&nonempty(&me.tokens)).map_err(s)?,
        w: s_
            .clone_htod(if me.topk_weights.is_empty() {
                &[0f32][..]
            } else {
                &me.topk_weights
            })
            .map_err(s)?,
        idx: s_
            .clone_htod(if me.topk_idx.is_empty() {
                &[-1i64][..]
            } else {
                &me.topk_idx
            })
            .map_err(s)?,
        y: s_.alloc_zeros::<bf16>(rows * h).map_err(s)?,
        out: RefCell::new(s_.alloc_zeros::<bf16>((t * h).max(1)).map_err(s)?),
    };
    let (xv, wv, idxv) = (
        b.x.slice(0..t * h),
        b.w.slice(0..t * k),
        b.idx.slice(0..t * k),
    );
    let dispatch = |cast: Option<Fp8Scaling>| {
        group
            .ll_dispatch(
                s_,
                moe_ep::LlDispatchArgs {
                    x: LlInput::Bf16(&xv),
                    topk_idx: TopkIdx::I64(&idxv),
                    topk: k,
                    topk_weights: &wv,
                    layout,
                    cast_fp8: cast,
                },
            )
            .map_err(s)
    };
    let combine = |hd: &LlHandle| {
        group
            .ll_combine(s_, hd, &b.y, None, &mut *b.out.borrow_mut())
            .map_err(s)
    };
    let fp8 = h.is_multiple_of(refr::FP8_BLOCK);

    // Once untimed (and checked under --check): the bf16 dispatch, its rows
    // copied into the expert outputs, the combine; then the fp8 dispatch and
    // its combine.
    let reference = if opts.check {
        Some(reference(case, opts.seed, world, shape, &routing)?)
    } else {
        None
    };
    let mut verdict: Result<(), String> = Ok(());
    let mut check = |what: &str, r: Result<(), String>| {
        if let (Ok(()), Err(e)) = (&verdict, r) {
            verdict = Err(format!("{what}: {e}"));
        }
    };
    let hd = dispatch(None)?;
    if let Some(rf) = &reference {
        check(
            "bf16 dispatch",
            compare_handle(s_, &hd, &rf.bf16[rank], h, k),
        );
    }
    let rows_view = hd.tokens().ok_or("bf16 dispatch without bf16 rows")?;
    // SAFETY: both hold rows * h bf16 values; the copy is ordered on s_.
    unsafe {
        cu::memcpy_dtod_async(
            DeviceRegion::device_ptr(&b.y),
            rows_view.device_ptr(),
            rows * h * 2,
            s_.cu_stream(),
        )
    }
    .map_err(s)?;
    combine(&hd)?;
    let emu = match &reference {
        Some(rf) => rf.emu[rank].clone(),
        None => Vec::new(),
    };
    let mut comb = Vec::new();
    if reference.is_some() {
        comb = down(s_, &*b.out.borrow(), t * h)?;
        let same = u16s(&comb) == u16s(&emu);
        check(
            "combine",
            same.then_some(())
                .ok_or_else(|| first_diff_words(&comb, &emu)),
        );
    }
    if fp8 {
        let hd = dispatch(Some(SCALING))?;
        if let Some(rf) = &reference {
            let want = refr::ll_dispatch(
                &rf.shape,
                &rf.inputs,
                m,
                rank,
                layout,
                LlPayload::Fp8Cast(SCALING),
            )
            .map_err(s)?;
            check("fp8 dispatch", compare_handle(s_, &hd, &want, h, k));
        }
        combine(&hd)?;
        if reference.is_some() {
            let again = down(s_, &*b.out.borrow(), t * h)?;
            let same = u16s(&again) == u16s(&emu);
            check(
                "combine after the fp8 dispatch",
                same.then_some(())
                    .ok_or_else(|| first_diff_words(&again, &emu)),
            );
        }
    }
    s_.synchronize().map_err(s)?;
    group.check().map_err(s)?;
    let checked = reference.map(|rf| {
        if let Err(e) = &verdict {
            eprintln!("ep-bench: rank {rank}: --check failed: {e}");
        }
        Checked {
            ok: verdict.is_ok(),
            reference: rf,
            emu,
            comb,
        }
    });
    let check = match &checked {
        Some(ch) => {
            let all = c.comm.all_gather_host(s_, &[ch.ok as u8]).map_err(s)?;
            Some(all.iter().all(|&v| v == 1))
        }
        None => None,
    };

    // Bytes: combine sends one row per (token, rank) in rank-major, one per
    // (token, expert) in expert-major.
    let back = match layout {
        LlLayout::RankMajor => counts.rank.clone(),
        LlLayout::ExpertMajor => pair_counts(&counts.expert, world, case.experts),
    };
    let traffic = LlTraffic::new(&counts.rank, &back, world, h);
    let bytes = |op: Op| traffic.op(op, rank);

    // The timed ops. `pending`: a dispatched batch not yet combined.
    let pending: RefCell<Option<LlHandle>> = RefCell::new(None);
    let settle = || match pending.borrow_mut().take() {
        Some(hd) => combine(&hd),
        None => Ok(()),
    };
    let send = |cast| -> R<()> {
        let hd = dispatch(cast)?;
        *pending.borrow_mut() = Some(hd);
        Ok(())
    };
    let mut mine: Vec<Measured> = Vec::new();
    for &op in &opts.ops {
        let name = op.name();
        let samples = match op {
            Op::LlDispatch => c.time_prepared(name, opts.gpu_start(), settle, || send(None))?,
            Op::LlDispatchFp8 => {
                c.time_prepared(name, opts.gpu_start(), settle, || send(Some(SCALING)))?
            }
            Op::LlCombine => c.time_prepared(
                name,
                opts.gpu_start(),
                || settle().and_then(|()| send(None)),
                settle,
            )?,
            Op::LlPair => c.time(name, || {
                let hd = dispatch(Some(SCALING))?;
                combine(&hd)
            })?,
            other => return Err(format!("{} is not an op of --mode ll", other.name())),
        };
        settle()?;
        let by = bytes(op);
        mine.push((name.to_string(), samples, by.nvlink, by.logical));
    }
    s_.synchronize().map_err(s)?;
    group.check().map_err(s)?;

    // The local-copy ceilings: the rows the rank receives (expert-major: one
    // per (token, expert); rank-major: one per token), bf16.
    if !opts.no_baselines {
        let recv_rows: usize = (0..world)
            .map(|src| back[src * world + rank] as usize)
            .sum();
        mine.extend(local_copies(
            c,
            (
                DeviceRegion::device_ptr(&b.x),
                DeviceRegion::device_ptr(&*b.out.borrow()),
            ),
            (t, recv_rows),
            h * 2,
            (recv_rows * h * 2) as u64,
            case.num_sms,
        )?);
    }
    // Virtual ranks share one GPU: no NVLink to measure.
    if !opts.no_baselines && world > 1 && !c.comm.is_virtual() {
        let nv = bytes(Op::LlDispatch).nvlink;
        mine.extend(baselines(
            c,
            &group,
            &counts.rank,
            world,
            h * 2,
            nv,
            case.num_sms,
        )?);
    }

    // NCCL EP on the same communicator, inputs and SM cap.
    let mut nccl_ep_check = None;
    if let Some(lib) = c.nccl_ep {
        match ep_ll::pairing(case, world) {
            Err(why) => c.note(&format!(
                "ep-bench: NCCL EP: {}: not applicable: {why}",
                case.label()
            )),
            Ok(pairing) => {
                let spec = ep_ll::Spec {
                    tokens: t,
                    hidden: h,
                    topk: k,
                    experts: case.experts,
                    world,
                    num_sms: case.num_sms,
                    pairing,
                };
                let inputs = nccl_ep::Inputs {
                    topk_idx: DeviceRegion::device_ptr(&b.idx),
                    x: DeviceRegion::device_ptr(&b.x),
                    w: DeviceRegion::device_ptr(&b.w),
                    fp8: None,
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

/// The first element where two combine outputs differ, as a message.
fn first_diff_words(got: &[bf16], want: &[bf16]) -> String {
    if got.len() != want.len() {
        return format!("{} values, the reference {}", got.len(), want.len());
    }
    match got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        Some(i) => format!(
            "value {i}: got {} ({:#06x}), the reference's emulation {} ({:#06x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        ),
        None => "equal".into(),
    }
}

/// NCCL EP's low-latency ops beside one case: its group and handle, a bf16
/// dispatch and combine once (cross-checked under `--check`), then its rows
/// of the ops in `--ops`, timed as ours are (a dispatch's batch combined
/// before the next run, a combine's batch dispatched before it, outside
/// the timed span), with CUDA events on the stream around the call; a call
/// that waits for the GPU inside behind a hold instead of the start gate
/// ([`nccl_ep_begin`]), said once per run.
fn run_nccl_ep(
    c: &Ctx<'_>,
    lib: &'static nccl_ep::Lib,
    case: &Case,
    spec: ep_ll::Spec,
    inputs: nccl_ep::Inputs,
    checked: Option<&Checked>,
    bytes: &dyn Fn(Op) -> crate::accounting::OpBytes,
) -> R<NcclEpRun> {
    // SAFETY: inputs are run_case's buffers of these sizes, alive until
    // after `ep` drops at the end of this function.
    let ep = unsafe { ep_ll::Runner::new(lib, &c.comm, &c.stream, spec, inputs)? };
    let ep = RefCell::new(ep);
    ep.borrow_mut().dispatch(false)?;
    let verdict = match checked {
        Some(ch) => {
            let got = ep.borrow().received()?;
            ep.borrow_mut().combine()?;
            let comb = ep.borrow().combined()?;
            Some(cross_check(c, case, &spec, ch, &got, &comb))
        }
        None => {
            ep.borrow_mut().combine()?;
            None
        }
    };
    let mut ops: Vec<Op> = Vec::new();
    for &op in &c.opts.ops {
        if op.is_fp8() && !spec.pairing.fp8 {
            c.note_once(format!(
                "ep-bench: NCCL EP's {} left out: {}",
                crate::report::nccl_ep_row(op),
                ep_ll::FP8_HIDDEN_WHY
            ));
            continue;
        }
        ops.push(op);
    }
    // `pending`: its dispatched batch not yet combined.
    let pending = RefCell::new(false);
    let settle = || -> R<()> {
        if pending.replace(false) {
            ep.borrow_mut().combine()?;
        }
        Ok(())
    };
    let send = |fp8: bool| -> R<()> {
        ep.borrow_mut().dispatch(fp8)?;
        pending.replace(true);
        Ok(())
    };
    let mut out = Vec::new();
    for op in ops {
        let name = crate::report::nccl_ep_row(op);
        // (before, timed) of each op.
        let before = |op: Op| -> R<()> {
            settle()?;
            if op == Op::LlCombine {
                send(false)?;
            }
            Ok(())
        };
        let timed = |op: Op| -> R<()> {
            match op {
                Op::LlDispatch => send(false),
                Op::LlDispatchFp8 => send(true),
                Op::LlCombine => settle(),
                _ => {
                    send(true)?;
                    settle()
                }
            }
        };
        // Once untimed first (its kernels are compiled at first use).
        before(op)?;
        timed(op)?;
        before(op)?;
        let begin = nccl_ep_begin(c, || timed(op))?;
        let samples = c.time_begin(name, begin, || before(op), || timed(op))?;
        settle()?;
        let b = bytes(op);
        out.push((name.to_string(), samples, b.nvlink, b.logical));
    }
    c.stream.synchronize().map_err(s)?;
    let memory = ep.borrow().memory();
    drop(ep);
    Ok((out, verdict, memory))
}

/// NCCL EP's bf16 dispatch and its combine (identity experts) against the
/// reference and ours ([`ep_ll::compare_dispatch`],
/// [`nccl_ep::compare_combine`]); says how it went (rank 0 when it passed,
/// every failing rank when not).
fn cross_check(
    c: &Ctx<'_>,
    case: &Case,
    spec: &ep_ll::Spec,
    ch: &Checked,
    got: &ep_ll::Received,
    comb: &[bf16],
) -> bool {
    let rank = c.comm.rank();
    let rf = &ch.reference;
    let layout = ll_layout(case.layout);
    let d = ep_ll::compare_dispatch(&rf.bf16[rank], got, spec.hidden, spec.topk);
    let exact = || Ok(rf.exact[rank].clone());
    let k = nccl_ep::compare_combine(comb, &ch.comb, &ch.emu, &exact, spec.hidden);
    let what = format!(
        "NCCL EP (LL {}) cross-check, {}",
        ll_layout_name(layout),
        case.label()
    );
    match (&d, &k) {
        (Ok(n), Ok(same_bits)) => {
            if !c.opts.quiet {
                let comb = if *same_bits {
                    "combine output equals moe-ep's bit for bit"
                } else {
                    "combine output equals, element by element, moe-ep's, the reference's emulation or the rounded exact sum"
                };
                c.note(&format!(
                    "ep-bench: {what}: ok: {n} rows and their counts equal the CPU reference's \
                     (matched by their bits within each {}); {comb}",
                    match layout {
                        LlLayout::ExpertMajor => "expert's block",
                        LlLayout::RankMajor => "source rank's block",
                    }
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
