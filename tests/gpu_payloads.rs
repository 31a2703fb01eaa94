//! GPU tests of what a TransformerEngine-style runtime asks of the
//! high-throughput ops (`multi-gpu`; virtual ranks on GPU 0 at world 2, 4
//! and 8, or real GPUs, and world 1):
//!
//! - `fp8_*`: fp8 rows with both scale kinds (MXFP8's e8m0 per 32 values,
//!   f32 per 128) in both layouts, bit for bit against the CPU reference
//!   (`reference::dispatch_rows`), into pool buffers and zero copy into the
//!   caller's; ranks that send different payloads are refused naming `op`;
//!   a bad argument on one rank only (short codes or scales, scales of the
//!   other kind, a receive buffer a row short of the exact size) is refused
//!   there and named by every other rank's `check()` within 2 s, and the
//!   group works after (`fp8_and_exact_size_refusals_on_one_rank_*`).
//! - `padding_fill_off_*`: expert-major padding rows left as they were,
//!   their weights, ids and sources still marked.
//! - `overflow_*`: a capacity below the need: `Overflow::Drop` drops what
//!   `reference::drop_over_capacity` drops (counts, masks, the kept
//!   routing), dispatch and combine equal the reference of the kept routing
//!   bit for bit; `Overflow::Error` stops every rank naming the capacity.
//! - `eager_*`: the host counts after layout (one sync) size the receive
//!   buffers exactly; dispatch and combine through them are bit-exact, one
//!   row less is refused naming the buffer.
#![cfg(feature = "multi-gpu")]

use std::sync::Arc;
use std::time::Duration;

use moe_ep::cuda::CudaStream;
use moe_ep::ops::{DeviceRegion, TopkIdx};
use moe_ep::reference::{self as refr, RankInput, Shape};
use moe_ep::testkit::ranks::{ensure, run_worlds, Rank};
use moe_ep::testkit::workload::{self, Rng, Routing};
use moe_ep::{
    bf16, DispatchOut, DispatchOutFp8, DispatchedFp8, EpGroup, Error, Fp8Rows, Fp8Scales,
    GroupConfig, Handle, Overflow, RecvLayout, RecvScales, RecvScalesOut, Result, SymmBuffer,
};

#[path = "common/device.rs"]
mod device;
use device::{bits, down, f32_bits, first_diff, up, weights_per_row};

const EXPERTS: usize = 64;
const HIDDEN: usize = 1024;
const TOPK: usize = 4;
const TOKENS: usize = 96;
const SEED: u64 = 0xF8;
/// The groups' bound on waits: far above any wait here, also under
/// compute-sanitizer (which slows the kernels many times over).
const TIMEOUT: Duration = Duration::from_secs(30);

/// The routing and weights of every rank (the same on every rank: each
/// computes the reference for all).
fn shape(world: usize) -> Shape {
    Shape {
        num_ranks: world,
        num_experts: EXPERTS,
        hidden: HIDDEN,
        topk: TOPK,
    }
}

fn all_inputs(world: usize, seed: u64) -> Vec<RankInput> {
    let tpr: Vec<usize> = (0..world).map(|r| TOKENS - 7 * (r % 3)).collect();
    workload::rank_inputs(seed, &shape(world), &tpr, Routing::Uniform)
}

/// Rank `r`'s fp8 codes (any bytes: dispatch moves them as they are) and
/// scales: e8m0 bytes `[T, H / 32]`, or f32 `[T, H / 128]` given as their
/// bytes.
fn codes_of(r: usize, t: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (r as u64 * 0x9E37));
    (0..t * HIDDEN).map(|_| rng.next_u64() as u8).collect()
}
fn e8m0_of(r: usize, t: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (r as u64 * 0x51) ^ 0xE8);
    (0..t * HIDDEN / 32).map(|_| rng.next_u64() as u8).collect()
}
fn f32_of(r: usize, t: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed ^ (r as u64 * 0x77) ^ 0xF3);
    (0..t * HIDDEN / 128)
        .map(|_| rng.f32_unit() * 8.0)
        .collect()
}

fn group(r: &Rank, zero_padding: bool) -> Result<EpGroup> {
    let mut cfg: GroupConfig = r.config(EXPERTS, HIDDEN, TOKENS)?;
    // Enough for expert-major alignment 16 of any routing here.
    cfg.recv_capacity = r.world * TOKENS * TOPK.min(EXPERTS / r.world) + EXPERTS * 16;
    cfg.timeout = TIMEOUT;
    cfg.zero_padding = zero_padding;
    EpGroup::new(&r.comm, cfg)
}

/// The scale kinds and layouts every fp8 test runs.
const KINDS: [bool; 2] = [true, false]; // e8m0 per 32, f32 per 128
fn layouts() -> [RecvLayout; 2] {
    [
        RecvLayout::RankMajor,
        RecvLayout::ExpertMajor { alignment: 16 },
    ]
}

/// Compares one fp8 dispatch's outputs with the reference, rows `[0, rows)`.
fn check_fp8(
    r: &Rank,
    got: &DispatchedFp8<'_>,
    handle: &Handle,
    inputs: &[RankInput],
    e8m0: bool,
    seed: u64,
) -> Result<()> {
    let (s, me, w) = (&r.stream, r.rank, r.world);
    let sh = shape(w);
    let layout = handle.layout();
    let rows = handle.host_counts(s)?.recv_rows;
    let want = refr::dispatch(&sh, inputs, me, layout)?;
    ensure(rows == want.num_rows, || {
        format!("{rows} rows, the reference {}", want.num_rows)
    })?;
    let t_of = |q: usize| inputs[q].num_tokens(&sh);
    let codes: Vec<Vec<u8>> = (0..w).map(|q| codes_of(q, t_of(q), seed)).collect();
    let want_codes = refr::dispatch_rows(&sh, inputs, &codes, HIDDEN, me, layout)?;
    first_diff("codes", &down(s, &got.codes, rows * HIDDEN)?, &want_codes)?;
    match (&got.scales, e8m0) {
        (RecvScales::E8m0Per32(b), true) => {
            let sc: Vec<Vec<u8>> = (0..w).map(|q| e8m0_of(q, t_of(q), seed)).collect();
            let want_sc = refr::dispatch_rows(&sh, inputs, &sc, HIDDEN / 32, me, layout)?;
            first_diff("e8m0 scales", &down(s, b, rows * HIDDEN / 32)?, &want_sc)?;
        }
        (RecvScales::F32Per128(b), false) => {
            let sc: Vec<Vec<f32>> = (0..w).map(|q| f32_of(q, t_of(q), seed)).collect();
            let want_sc = refr::dispatch_rows(&sh, inputs, &sc, HIDDEN / 128, me, layout)?;
            first_diff(
                "f32 scales",
                &f32_bits(&down(s, b, rows * HIDDEN / 128)?),
                &f32_bits(&want_sc),
            )?;
        }
        _ => return Err(Error::InvalidState("scales of the other kind".into())),
    }
    check_meta(
        s,
        (&got.topk_weights, &got.topk_idx, &got.src),
        weights_per_row(layout, TOPK),
        &want,
    )
}

/// A dispatch's received weights, local expert ids and sources (rows of
/// the reference's `want`) against the reference, bit for bit.
fn check_meta(
    s: &Arc<CudaStream>,
    (w, idx, src): (
        &dyn DeviceRegion<f32>,
        &dyn DeviceRegion<i32>,
        &dyn DeviceRegion<i32>,
    ),
    wpr: usize,
    want: &refr::DispatchOutput,
) -> Result<()> {
    let rows = want.num_rows;
    first_diff(
        "weights",
        &f32_bits(&down(s, w, rows * wpr)?),
        &f32_bits(&want.topk_weights),
    )?;
    first_diff(
        "local ids",
        &down(s, idx, rows * wpr)?,
        &want.topk_local_idx,
    )?;
    let src: Vec<(i32, i32)> = down(s, src, rows * 2)?
        .chunks(2)
        .map(|p| (p[0], p[1]))
        .collect();
    first_diff("sources", &src, &want.src)
}

/// This rank's device inputs of an fp8 dispatch.
struct Fp8In {
    idx: moe_ep::cuda::CudaSlice<i64>,
    w: moe_ep::cuda::CudaSlice<f32>,
    codes: moe_ep::cuda::CudaSlice<u8>,
    e8m0: moe_ep::cuda::CudaSlice<u8>,
    f32s: moe_ep::cuda::CudaSlice<f32>,
}

fn fp8_in(s: &Arc<CudaStream>, me: &RankInput, rank: usize, seed: u64) -> Result<Fp8In> {
    let t = me.topk_idx.len() / TOPK;
    Ok(Fp8In {
        idx: up(s, &me.topk_idx)?,
        w: up(s, &me.topk_weights)?,
        codes: up(s, &codes_of(rank, t, seed))?,
        e8m0: up(s, &e8m0_of(rank, t, seed))?,
        f32s: up(s, &f32_of(rank, t, seed))?,
    })
}

impl Fp8In {
    fn rows(&self, e8m0: bool) -> Fp8Rows<'_> {
        Fp8Rows {
            codes: &self.codes,
            scales: if e8m0 {
                Fp8Scales::E8m0Per32(&self.e8m0)
            } else {
                Fp8Scales::F32Per128(&self.f32s)
            },
        }
    }
}

#[test]
fn fp8_dispatch_both_scale_kinds_both_layouts() {
    run_worlds("fp8_dispatch_both_scale_kinds_both_layouts", 1, |r| {
        let s = &r.stream;
        let g = group(r, true)?;
        let cap = g.recv_capacity();
        for (round, layout) in layouts().into_iter().enumerate() {
            for e8m0 in KINDS {
                let seed = SEED + round as u64 * 2 + e8m0 as u64;
                let inputs = all_inputs(r.world, seed);
                let inp = fp8_in(s, &inputs[r.rank], r.rank, seed)?;
                let h = g.layout(s, TopkIdx::I64(&inp.idx), TOPK, layout)?;
                // Pool outputs.
                let got =
                    g.dispatch_fp8(s, &h, inp.rows(e8m0), &inp.w, DispatchOutFp8::default())?;
                check_fp8(r, &got, &h, &inputs, e8m0, seed)?;
                drop(got);
                // Zero copy into the caller's symmetric buffers (collective).
                let mut codes = g.pool().alloc::<u8>(cap * HIDDEN)?;
                let mut e8 = g.pool().alloc::<u8>(cap * HIDDEN / 32)?;
                let mut f4 = g.pool().alloc::<f32>(cap * HIDDEN / 128)?;
                let (codes_at, scales_at) = (
                    codes.device_ptr(),
                    if e8m0 {
                        e8.device_ptr()
                    } else {
                        f4.device_ptr()
                    },
                );
                let out = DispatchOutFp8 {
                    recv_codes: Some(&mut codes),
                    recv_scales: Some(if e8m0 {
                        RecvScalesOut::E8m0Per32(&mut e8)
                    } else {
                        RecvScalesOut::F32Per128(&mut f4)
                    }),
                    recv_topk_weights: None,
                };
                let got = g.dispatch_fp8(s, &h, inp.rows(e8m0), &inp.w, out)?;
                ensure(
                    got.codes.is_callers()
                        && got.codes.device_ptr() == codes_at
                        && got.scales.device_ptr() == scales_at,
                    || "the caller's buffers were not written in place".into(),
                )?;
                check_fp8(r, &got, &h, &inputs, e8m0, seed)?;
                drop(got);
                g.check()?;
            }
        }
        Ok(())
    });
}

#[test]
fn fp8_payloads_that_differ_between_ranks_are_refused_naming_op() {
    run_worlds(
        "fp8_payloads_that_differ_between_ranks_are_refused_naming_op",
        2,
        |r| {
            let s = &r.stream;
            let g = group(r, true)?;
            let inputs = all_inputs(r.world, SEED);
            let inp = fp8_in(s, &inputs[r.rank], r.rank, SEED)?;
            let h = g.layout(s, TopkIdx::I64(&inp.idx), TOPK, RecvLayout::RankMajor)?;
            // The last rank sends f32 scales, the others e8m0.
            let e8m0 = r.rank + 1 != r.world;
            let res = g
                .dispatch_fp8(s, &h, inp.rows(e8m0), &inp.w, DispatchOutFp8::default())
                .map(drop);
            let chk = g.check();
            let named = |e: &Error| match e {
                Error::InvalidArgument { arg, .. } => *arg == "op",
                Error::PeerFailed { arg, .. } => *arg == Some("op"),
                _ => false,
            };
            match (&res, &chk) {
                (Ok(()), Err(e)) if named(e) => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "rank {}: want a refusal naming op, got {other:?}",
                        r.rank
                    )))
                }
            }
            // The group takes the next (agreed) call.
            let h = g.layout(s, TopkIdx::I64(&inp.idx), TOPK, RecvLayout::RankMajor)?;
            let got = g.dispatch_fp8(s, &h, inp.rows(true), &inp.w, DispatchOutFp8::default())?;
            check_fp8(r, &got, &h, &inputs, true, SEED)?;
            drop(got);
            g.check()
        },
    );
}

#[test]
fn fp8_bad_arguments_are_refused_by_name() {
    run_worlds("fp8_bad_arguments_are_refused_by_name", 1, |r| {
        let s = &r.stream;
        let g = group(r, true)?;
        let inputs = all_inputs(r.world, SEED);
        let inp = fp8_in(s, &inputs[r.rank], r.rank, SEED)?;
        let h = g.layout(s, TopkIdx::I64(&inp.idx), TOPK, RecvLayout::RankMajor)?;
        let t = inputs[r.rank].topk_idx.len() / TOPK;
        let short_codes = up(s, &vec![0u8; t * HIDDEN - 16])?;
        let short_scales = up(s, &vec![0u8; t * HIDDEN / 32 - 4])?;
        let mut wrong_kind = g.pool().alloc::<f32>(g.recv_capacity() * HIDDEN / 128)?;
        // Every rank makes the same mistakes: each call is refused on every
        // rank's host, nothing is out of step.
        let cases: Vec<(&str, Result<()>)> = vec![
            (
                "x.codes",
                g.dispatch_fp8(
                    s,
                    &h,
                    Fp8Rows {
                        codes: &short_codes,
                        scales: Fp8Scales::E8m0Per32(&inp.e8m0),
                    },
                    &inp.w,
                    DispatchOutFp8::default(),
                )
                .map(drop),
            ),
            (
                "x.scales",
                g.dispatch_fp8(
                    s,
                    &h,
                    Fp8Rows {
                        codes: &inp.codes,
                        scales: Fp8Scales::E8m0Per32(&short_scales),
                    },
                    &inp.w,
                    DispatchOutFp8::default(),
                )
                .map(drop),
            ),
            (
                "recv_scales",
                g.dispatch_fp8(
                    s,
                    &h,
                    inp.rows(true),
                    &inp.w,
                    DispatchOutFp8 {
                        recv_scales: Some(RecvScalesOut::F32Per128(&mut wrong_kind)),
                        ..Default::default()
                    },
                )
                .map(drop),
            ),
        ];
        for (arg, res) in cases {
            match res {
                Err(Error::InvalidArgument { arg: a, .. }) if a == arg => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "want a refusal naming {arg}, got {other:?}"
                    )))
                }
            }
        }
        g.check()
    });
}

#[test]
fn padding_fill_off_leaves_padding_rows_and_marks_them() {
    run_worlds(
        "padding_fill_off_leaves_padding_rows_and_marks_them",
        1,
        |r| {
            let s = &r.stream;
            let g = group(r, false)?;
            let cap = g.recv_capacity();
            let layout = RecvLayout::ExpertMajor { alignment: 16 };
            let inputs = all_inputs(r.world, SEED + 9);
            let inp = fp8_in(s, &inputs[r.rank], r.rank, SEED + 9)?;
            let h = g.layout(s, TopkIdx::I64(&inp.idx), TOPK, layout)?;
            // Caller buffers poisoned with 0xAB: padding rows must keep it.
            let mut codes = g.pool().alloc::<u8>(cap * HIDDEN)?;
            let mut e8 = g.pool().alloc::<u8>(cap * HIDDEN / 32)?;
            codes.copy_from_host(s, &vec![0xABu8; cap * HIDDEN])?;
            e8.copy_from_host(s, &vec![0xABu8; cap * HIDDEN / 32])?;
            let out = DispatchOutFp8 {
                recv_codes: Some(&mut codes),
                recv_scales: Some(RecvScalesOut::E8m0Per32(&mut e8)),
                recv_topk_weights: None,
            };
            let got = g.dispatch_fp8(s, &h, inp.rows(true), &inp.w, out)?;
            let sh = shape(r.world);
            let want = refr::dispatch(&sh, &inputs, r.rank, layout)?;
            let rows = want.num_rows;
            let t_of = |q: usize| inputs[q].num_tokens(&sh);
            let all_codes: Vec<Vec<u8>> = (0..r.world)
                .map(|q| codes_of(q, t_of(q), SEED + 9))
                .collect();
            let mut want_codes =
                refr::dispatch_rows(&sh, &inputs, &all_codes, HIDDEN, r.rank, layout)?;
            let sc: Vec<Vec<u8>> = (0..r.world)
                .map(|q| e8m0_of(q, t_of(q), SEED + 9))
                .collect();
            let mut want_sc = refr::dispatch_rows(&sh, &inputs, &sc, HIDDEN / 32, r.rank, layout)?;
            let mut padding = 0;
            for (row, src) in want.src.iter().enumerate() {
                if src.0 < 0 {
                    padding += 1;
                    want_codes[row * HIDDEN..(row + 1) * HIDDEN].fill(0xAB);
                    want_sc[row * HIDDEN / 32..(row + 1) * HIDDEN / 32].fill(0xAB);
                }
            }
            ensure(padding > 0 || rows == 0, || {
                "the case has no padding rows".into()
            })?;
            first_diff("codes", &down(s, &got.codes, rows * HIDDEN)?, &want_codes)?;
            let RecvScales::E8m0Per32(b) = &got.scales else {
                return Err(Error::InvalidState("f32 scales".into()));
            };
            first_diff("scales", &down(s, b, rows * HIDDEN / 32)?, &want_sc)?;
            // Weights, ids and sources of the padding rows are still marked.
            first_diff(
                "local ids",
                &down(s, &got.topk_idx, rows)?,
                &want.topk_local_idx,
            )?;
            let src: Vec<(i32, i32)> = down(s, &got.src, rows * 2)?
                .chunks(2)
                .map(|p| (p[0], p[1]))
                .collect();
            first_diff("sources", &src, &want.src)?;
            drop(got);
            g.check()
        },
    );
}

/// The rows each rank receives of `inputs` in `layout`.
fn rows_of(inputs: &[RankInput], world: usize, layout: RecvLayout) -> Result<Vec<usize>> {
    (0..world)
        .map(|d| Ok(refr::dispatch(&shape(world), inputs, d, layout)?.num_rows))
        .collect()
}

/// One bf16 round trip of `handle` on `g` (identity experts: combine reads
/// the received rows, unweighted), checked bit for bit against the
/// reference of `kept` (the routing after any drop): dispatch's rows,
/// weights, ids and sources, and combine's output. `out`: caller receive
/// buffers of `rows` rows (eager sizing), or the pool's.
fn round_trip_against(
    r: &Rank,
    g: &EpGroup,
    handle: &Handle,
    me: &RankInput,
    kept: &[RankInput],
    caller_rows: Option<usize>,
) -> Result<()> {
    let (s, w) = (&r.stream, r.world);
    let sh = shape(w);
    let layout = handle.layout();
    let want = refr::dispatch(&sh, kept, r.rank, layout)?;
    let x = up(s, &me.tokens)?;
    let tw = up(s, &me.topk_weights)?;
    let wpr = weights_per_row(layout, TOPK);
    let mut tokens_buf;
    let mut weights_buf;
    let out = match caller_rows {
        Some(rows) => {
            tokens_buf = g.pool().alloc::<bf16>(rows * HIDDEN)?;
            weights_buf = g.pool().alloc::<f32>(rows * wpr)?;
            DispatchOut {
                recv_tokens: Some(&mut tokens_buf),
                recv_topk_weights: Some(&mut weights_buf),
            }
        }
        None => DispatchOut::default(),
    };
    let got = g.dispatch(s, handle, &x, &tw, out)?;
    // What the kernels found first (a timeout, a refusal), before the data.
    g.check()?;
    let rows = want.num_rows;
    first_diff(
        "tokens",
        &bits(&down(s, &got.tokens, rows * HIDDEN)?),
        &bits(&want.tokens),
    )?;
    check_meta(s, (&got.topk_weights, &got.topk_idx, &got.src), wpr, &want)?;
    // Identity experts: combine reads the received rows in place.
    let expert_out: Vec<Vec<bf16>> = (0..w)
        .map(|d| Ok(refr::dispatch(&sh, kept, d, layout)?.tokens))
        .collect::<Result<_>>()?;
    let want_out = refr::combine_emulated(&sh, kept, &expert_out, r.rank, layout, false)?;
    let mut out = s
        .alloc_zeros::<bf16>(me.tokens.len().max(1))
        .map_err(Error::cuda("alloc"))?;
    g.combine(s, handle, &got.tokens, None, &mut out)?;
    g.check()?;
    first_diff(
        "combine",
        &bits(&down(s, &out, me.tokens.len())?),
        &bits(&want_out),
    )?;
    drop(got);
    Ok(())
}

#[test]
fn overflow_drop_and_error_below_capacity() {
    run_worlds("overflow_drop_and_error_below_capacity", 1, |r| {
        let (s, w) = (&r.stream, r.world);
        let sh = shape(w);
        for (round, layout) in layouts().into_iter().enumerate() {
            let inputs = all_inputs(w, SEED + 20 + round as u64);
            let need = rows_of(&inputs, w, layout)?;
            let most = need.iter().copied().max().unwrap_or(0);
            let cap = most * 2 / 3;
            let refd = refr::drop_over_capacity(&sh, &inputs, layout, cap)?;
            ensure(refd.dropped_rows.iter().any(|&n| n > 0), || {
                "the case drops nothing".into()
            })?;
            let me = &inputs[r.rank];
            let idx = up(s, &me.topk_idx)?;
            for policy in [Overflow::Drop, Overflow::Error] {
                let mut cfg = r.config(EXPERTS, HIDDEN, TOKENS)?;
                cfg.recv_capacity = cap;
                cfg.timeout = TIMEOUT;
                cfg.overflow = policy;
                let g = EpGroup::new(&r.comm, cfg)?;
                let t0 = std::time::Instant::now();
                let h = g.layout(s, TopkIdx::I64(&idx), TOPK, layout)?;
                if policy == Overflow::Error {
                    match g.check() {
                        Err(Error::CapacityExceeded { .. }) | Err(Error::PeerFailed { .. }) => {}
                        other => {
                            return Err(Error::InvalidState(format!(
                                "{layout:?} Error policy: want CapacityExceeded, got {other:?}"
                            )))
                        }
                    }
                    ensure(t0.elapsed() < Duration::from_secs(2), || {
                        format!("the capacity error took {:?}", t0.elapsed())
                    })?;
                    continue;
                }
                let hc = h.host_counts(s)?;
                first_diff("dropped rows", &hc.dropped_rows, &refd.dropped_rows)?;
                let kept_rows = rows_of(&refd.kept, w, layout)?;
                ensure(
                    hc.recv_rows == kept_rows[r.rank]
                        && hc.max_recv_rows == kept_rows.iter().copied().max().unwrap_or(0),
                    || {
                        format!(
                            "rows {} / {}, want {kept_rows:?}",
                            hc.recv_rows, hc.max_recv_rows
                        )
                    },
                )?;
                first_diff(
                    "dropped slots",
                    &h.dropped_slots(s)?,
                    &refd.dropped_slots[r.rank],
                )?;
                let kept_idx: Vec<i32> = refd.kept[r.rank]
                    .topk_idx
                    .iter()
                    .map(|&e| e as i32)
                    .collect();
                let view = h.kept_topk_idx().expect("one node");
                first_diff("kept routing", &down(s, &view, kept_idx.len())?, &kept_idx)?;
                round_trip_against(r, &g, &h, me, &refd.kept, None)?;
                g.check()?;
            }
        }
        Ok(())
    });
}

#[test]
fn eager_sizes_equal_what_dispatch_writes() {
    run_worlds("eager_sizes_equal_what_dispatch_writes", 1, |r| {
        let (s, w) = (&r.stream, r.world);
        let sh = shape(w);
        let g = group(r, true)?;
        for (round, layout) in layouts().into_iter().enumerate() {
            let inputs = all_inputs(w, SEED + 40 + round as u64);
            let me = &inputs[r.rank];
            let idx = up(s, &me.topk_idx)?;
            let h = g.layout(s, TopkIdx::I64(&idx), TOPK, layout)?;
            let hc = h.host_counts(s)?;
            let want = refr::dispatch(&sh, &inputs, r.rank, layout)?;
            let rows = rows_of(&inputs, w, layout)?;
            let most = rows.iter().copied().max().unwrap_or(0);
            ensure(
                hc.recv_rows == want.num_rows && hc.max_recv_rows == most,
                || {
                    format!(
                        "rows {} / {}, want {} / {most}",
                        hc.recv_rows, hc.max_recv_rows, want.num_rows
                    )
                },
            )?;
            let per: Vec<usize> = want
                .tokens_per_local_expert
                .iter()
                .map(|&n| n as usize)
                .collect();
            first_diff("per local expert", &hc.tokens_per_local_expert, &per)?;
            ensure(most < g.recv_capacity(), || {
                "no smaller than the capacity".into()
            })?;
            // One row short: refused on every rank (all make the mistake).
            let mut short = g.pool().alloc::<bf16>((most.max(1) - 1) * HIDDEN)?;
            let x = up(s, &me.tokens)?;
            let tw = up(s, &me.topk_weights)?;
            match g.dispatch(
                s,
                &h,
                &x,
                &tw,
                DispatchOut {
                    recv_tokens: Some(&mut short),
                    recv_topk_weights: None,
                },
            ) {
                Err(Error::InvalidArgument {
                    arg: "recv_tokens", ..
                }) => {}
                Err(e) => return Err(Error::InvalidState(format!("short buffer: {e}"))),
                Ok(_) if most == 0 => {}
                Ok(_) => return Err(Error::InvalidState("a short buffer was taken".into())),
            }
            drop(short);
            // Exactly that many rows: the round trip through them.
            round_trip_against(r, &g, &h, me, &inputs, Some(most))?;
            g.check()?;
        }
        Ok(())
    });
}

/// A bad fp8 or exact-size argument on the last rank only: that rank's host
/// refuses it naming the argument (its `check()` says it refused), every
/// other rank's dispatch is accepted and its `check()` names the last rank
/// and the argument, all within 2 s (the groups wait up to 30 s); then a
/// correct fp8 round trip on the same group.
#[test]
fn fp8_and_exact_size_refusals_on_one_rank_reach_every_rank() {
    /// The bad rank's call: the group, stream, handle, inputs, the rows the
    /// counts said, and two buffers every rank allocated (collectively).
    type Bad = fn(
        &EpGroup,
        &Arc<CudaStream>,
        &Handle,
        &Fp8In,
        usize,
        &mut SymmBuffer<f32>,
        &mut SymmBuffer<u8>,
    ) -> Result<()>;
    let rows: [(&str, Bad); 4] = [
        ("x.codes", |g, s, h, inp, _, _, _| {
            let codes = inp.codes.slice(0..inp.codes.len() - 16);
            let x = Fp8Rows {
                codes: &codes,
                scales: Fp8Scales::E8m0Per32(&inp.e8m0),
            };
            g.dispatch_fp8(s, h, x, &inp.w, DispatchOutFp8::default())
                .map(drop)
        }),
        ("x.scales", |g, s, h, inp, _, _, _| {
            let sc = inp.e8m0.slice(0..inp.e8m0.len() - 4);
            let x = Fp8Rows {
                codes: &inp.codes,
                scales: Fp8Scales::E8m0Per32(&sc),
            };
            g.dispatch_fp8(s, h, x, &inp.w, DispatchOutFp8::default())
                .map(drop)
        }),
        ("recv_scales", |g, s, h, inp, _, f4, _| {
            let out = DispatchOutFp8 {
                recv_scales: Some(RecvScalesOut::F32Per128(f4)),
                ..Default::default()
            };
            g.dispatch_fp8(s, h, inp.rows(true), &inp.w, out).map(drop)
        }),
        ("recv_codes", |g, s, h, inp, rows, _, codes| {
            // Exact sizes: one row short of what the counts said.
            let mut short = codes.view_mut(0..(rows.max(1) - 1) * HIDDEN)?;
            let out = DispatchOutFp8 {
                recv_codes: Some(&mut short),
                ..Default::default()
            };
            g.dispatch_fp8(s, h, inp.rows(true), &inp.w, out).map(drop)
        }),
    ];
    run_worlds(
        "fp8_and_exact_size_refusals_on_one_rank_reach_every_rank",
        2,
        |r| {
            let s = &r.stream;
            let bad = r.world - 1;
            let g = group(r, true)?;
            let inputs = all_inputs(r.world, SEED + 60);
            let inp = fp8_in(s, &inputs[r.rank], r.rank, SEED + 60)?;
            for (arg, call) in rows {
                let h = g.layout(s, TopkIdx::I64(&inp.idx), TOPK, RecvLayout::RankMajor)?;
                let most = h.host_counts(s)?.max_recv_rows;
                // Every rank makes the same pool allocations (collective):
                // the bad row's buffers, which the good ranks leave unused.
                let mut f4 = g.pool().alloc::<f32>(g.recv_capacity() * HIDDEN / 128)?;
                let mut codes = g.pool().alloc::<u8>(most.max(1) * HIDDEN)?;
                r.comm.barrier(s)?;
                let t0 = std::time::Instant::now();
                let op = if r.rank == bad {
                    call(&g, s, &h, &inp, most, &mut f4, &mut codes)
                } else {
                    g.dispatch_fp8(s, &h, inp.rows(true), &inp.w, DispatchOutFp8::default())
                        .map(drop)
                };
                let chk = g.check();
                let took = t0.elapsed();
                let ok = if r.rank == bad {
                    matches!(&op, Err(Error::InvalidArgument { arg: a, .. }) if *a == arg)
                        && matches!(&chk, Err(Error::InvalidState(m)) if m.contains("refused"))
                } else {
                    op.is_ok()
                        && matches!(&chk, Err(Error::PeerFailed { peer, arg: a, .. })
                            if *peer == bad && *a == Some(arg))
                };
                ensure(ok && took < Duration::from_secs(2), || {
                    format!(
                        "{arg}, rank {}: the op gave {op:?}, check {chk:?}, in {took:?}",
                        r.rank
                    )
                })?;
            }
            // The group works after every row.
            let h = g.layout(s, TopkIdx::I64(&inp.idx), TOPK, RecvLayout::RankMajor)?;
            let got = g.dispatch_fp8(s, &h, inp.rows(true), &inp.w, DispatchOutFp8::default())?;
            check_fp8(r, &got, &h, &inputs, true, SEED + 60)?;
            drop(got);
            g.check()
        },
    );
}
