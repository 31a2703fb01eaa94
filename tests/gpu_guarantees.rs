//! GPU tests of what holds when a run is long or one rank is wrong
//! (`multi-gpu`; virtual ranks on GPU 0 at world 2, 4 and 8, or real GPUs).
//!
//! - `plain_loop_*`: the loop a runtime runs, {layout, dispatch into pool
//!   buffers, combine into one caller output}, the receive layouts
//!   alternating (or one of them), handles and outputs dropped every cycle
//!   and no host sync in the loop; the last cycle's output checked bit for
//!   bit. `MOE_EP_SOAK_CYCLES` sets the cycles (default 300; the ignored
//!   `plain_loop_soak` runs 10,000). `plain_loop_after_a_refusal_on_every_rank`
//!   starts with a dispatch every rank refuses alike, not checked.
//! - `fault_*`: the fault-injection table. Each row gives a bad input to
//!   one rank only (the last), asserts what every rank sees (the error's
//!   kind, the argument or rank it names) and how fast (far below the
//!   group's timeout, but for the rank that never comes, which is named
//!   within it), then runs a correct round trip on the same group (or on
//!   a new one where the README says to rebuild).
//! - `bad_layout_check_round_trip_*`: {bad routing on one rank, check on
//!   every rank, correct round trip}, 200 rounds (the ignored `_soak`:
//!   10,000).
#![cfg(feature = "multi-gpu")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use moe_ep::cuda::{CudaSlice, CudaStream};
use moe_ep::ops::{CountWord, DeviceRegion, DispatchOut, LlInput, LlLayout, Mode, TopkIdx};
use moe_ep::testkit::ranks::{ensure, run_worlds, Rank};
use moe_ep::testkit::workload::{self, Rng};
use moe_ep::{bf16, Communicator, EpGroup, Error, GroupConfig, RecvLayout, RefusedCall, Result};

#[path = "common/device.rs"]
mod device;
use device::{bits, down, first_diff, hold, up};

const EXPERTS: usize = 256;
const HIDDEN: usize = 7168;
const TOPK: usize = 8;
const TOKENS: usize = 128;
const ALIGN: usize = 128;

/// TransformerEngine's identity routing: `topk_idx[t, k] = ((rank * T + t) * K + k) % E`.
fn identity_routing(rank: usize, t: usize) -> Vec<i32> {
    (0..t * TOPK)
        .map(|i| ((rank * t * TOPK + i) % EXPERTS) as i32)
        .collect()
}

/// The loop's group: rank-major and expert-major (alignment 128) both fit.
fn loop_config(r: &Rank) -> Result<GroupConfig> {
    let mut cfg = r.config(EXPERTS, HIDDEN, TOKENS)?;
    let el = EXPERTS / r.world;
    cfg.recv_capacity = (r.world * TOKENS).max(el * ALIGN);
    cfg.timeout = Duration::from_secs(10);
    Ok(cfg)
}

/// The output of one cycle: rank-major unweighted, each token times the
/// ranks it reached; expert-major weighted by 1/K, the token itself.
fn loop_want(rank: usize, world: usize, x: &[bf16], layout: RecvLayout) -> Vec<u16> {
    let idx = identity_routing(rank, TOKENS);
    let el = EXPERTS / world;
    // A token's factor: the ranks it reached (rank-major sums one copy a
    // rank), or 1 (expert-major weights 1/K over K rows).
    let factor: Vec<f64> = (0..TOKENS)
        .map(|t| match layout {
            RecvLayout::RankMajor => {
                let mut ranks: Vec<usize> = idx[t * TOPK..(t + 1) * TOPK]
                    .iter()
                    .map(|&e| e as usize / el)
                    .collect();
                ranks.sort_unstable();
                ranks.dedup();
                ranks.len() as f64
            }
            RecvLayout::ExpertMajor { .. } => 1.0,
        })
        .collect();
    (0..TOKENS * HIDDEN)
        .map(|i| bf16::from_f64(x[i].to_f64() * factor[i / HIDDEN]).to_bits())
        .collect()
}

/// Which layouts the loop runs.
#[derive(Clone, Copy, Debug)]
enum Layouts {
    Alternating,
    RankOnly,
    ExpertOnly,
}

impl Layouts {
    fn of(self, cycle: usize) -> RecvLayout {
        let expert = RecvLayout::ExpertMajor { alignment: ALIGN };
        match self {
            Layouts::RankOnly => RecvLayout::RankMajor,
            Layouts::ExpertOnly => expert,
            Layouts::Alternating if cycle.is_multiple_of(2) => RecvLayout::RankMajor,
            Layouts::Alternating => expert,
        }
    }
}

fn cycles(default: usize) -> usize {
    std::env::var("MOE_EP_SOAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One rank's plain loop of `n` cycles.
fn plain_loop(r: &Rank, layouts: Layouts, n: usize) -> Result<()> {
    plain_loop_after(r, layouts, n, false)
}

/// [`plain_loop`], after a dispatch with a short `x` on every rank
/// (`refused_first`), refused everywhere alike: no check between, so the
/// loop runs with every rank's refusal still on record (virtual ranks stay
/// paced: the ranks are in step), and the check after it is Ok.
fn plain_loop_after(r: &Rank, layouts: Layouts, n: usize, refused_first: bool) -> Result<()> {
    let s: &Arc<CudaStream> = &r.stream;
    let group = EpGroup::new(&r.comm, loop_config(r)?)?;
    let x_host = workload::tokens(&mut Rng::new(77 + r.rank as u64), TOKENS, HIDDEN);
    let x = up(s, &x_host)?;
    let w = up(s, &vec![1.0f32 / TOPK as f32; TOKENS * TOPK])?;
    let idx = up(s, &identity_routing(r.rank, TOKENS))?;
    let mut out = s
        .alloc_zeros::<bf16>(TOKENS * HIDDEN)
        .map_err(Error::cuda("alloc"))?;
    let sync_each = std::env::var_os("MOE_EP_SOAK_SYNC").is_some_and(|v| v == "1");
    if refused_first {
        let handle = group.layout(s, TopkIdx::I32(&idx), TOPK, layouts.of(0))?;
        let short = x.slice(0..TOKENS * HIDDEN - 8);
        match group.dispatch(s, &handle, &short, &w, DispatchOut::default()) {
            Err(Error::InvalidArgument { arg: "x", .. }) => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "a short x on every rank: expected InvalidArgument naming x, got {:?}",
                    other.map(|_| ())
                )))
            }
        }
    }
    let t0 = Instant::now();
    for cycle in 0..n {
        let layout = layouts.of(cycle);
        let handle = group.layout(s, TopkIdx::I32(&idx), TOPK, layout)?;
        let got = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
        let weights = match layout {
            RecvLayout::RankMajor => None,
            RecvLayout::ExpertMajor { .. } => Some(&got.topk_weights as _),
        };
        group
            .combine(s, &handle, &got.tokens, weights, &mut out)
            .map_err(|e| Error::InvalidState(format!("cycle {cycle}: {e}")))?;
        drop(got);
        drop(handle);
        if sync_each {
            s.synchronize().map_err(Error::cuda("sync"))?;
        }
        if r.rank == 0 && (cycle + 1) % 1000 == 0 {
            eprintln!(
                "    {} cycles in {:.1} s",
                cycle + 1,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    group
        .check()
        .map_err(|e| Error::InvalidState(format!("after {n} cycles: {e}")))?;
    let last = layouts.of(n - 1);
    first_diff(
        "the last cycle's combine",
        &bits(&down(s, &out, TOKENS * HIDDEN)?),
        &loop_want(r.rank, r.world, &x_host, last),
    )?;
    if r.rank == 0 {
        eprintln!(
            "    {n} cycles ({layouts:?}) in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

#[test]
fn plain_loop_alternating() {
    run_worlds("plain_loop_alternating", 2, |r| {
        plain_loop(r, Layouts::Alternating, cycles(300))
    });
}

#[test]
fn plain_loop_rank_major() {
    run_worlds("plain_loop_rank_major", 2, |r| {
        plain_loop(r, Layouts::RankOnly, cycles(300))
    });
}

#[test]
fn plain_loop_expert_major() {
    run_worlds("plain_loop_expert_major", 2, |r| {
        plain_loop(r, Layouts::ExpertOnly, cycles(300))
    });
}

#[test]
fn plain_loop_after_a_refusal_on_every_rank() {
    run_worlds("plain_loop_after_a_refusal_on_every_rank", 2, |r| {
        plain_loop_after(r, Layouts::Alternating, cycles(300), true)
    });
}

#[test]
#[ignore = "10,000 cycles per world: run with --ignored"]
fn plain_loop_soak() {
    run_worlds("plain_loop_soak", 2, |r| {
        plain_loop(r, Layouts::Alternating, cycles(10_000))
    });
}

// ---------------------------------------------------------------------------
// The fault-injection table.
// ---------------------------------------------------------------------------

/// The rank that gets the bad input.
fn bad_rank(r: &Rank) -> usize {
    r.world - 1
}

/// Far below the group's timeout (10 s): what "at once" means here (virtual
/// ranks share one GPU and its host threads).
const FAST: Duration = Duration::from_secs(2);

/// The expert-major alignment of the fault rows (small receive buffers: no
/// pool growth inside an op, which is collective).
const FAULT_ALIGN: usize = 8;
const FAULT_EM: RecvLayout = RecvLayout::ExpertMajor {
    alignment: FAULT_ALIGN,
};

/// A group of the fault rows: both layouts of the identity routing fit
/// (each expert gets 4 x world rows, padded to FAULT_ALIGN).
fn fault_group(r: &Rank) -> Result<EpGroup> {
    let mut cfg = r.config(EXPERTS, HIDDEN, TOKENS)?;
    let el = EXPERTS / r.world;
    let per_expert = (TOKENS * TOPK * r.world / EXPERTS).div_ceil(FAULT_ALIGN) * FAULT_ALIGN;
    cfg.recv_capacity = (r.world * TOKENS).max(el * per_expert);
    cfg.timeout = Duration::from_secs(10);
    EpGroup::new(&r.comm, cfg)
}

/// One rank's device inputs of the fault rows.
struct Inputs {
    x_host: Vec<bf16>,
    x: CudaSlice<bf16>,
    w: CudaSlice<f32>,
    idx: CudaSlice<i32>,
}

fn inputs(r: &Rank, seed: u64) -> Result<Inputs> {
    let s = &r.stream;
    let x_host = workload::tokens(&mut Rng::new(seed + r.rank as u64), TOKENS, HIDDEN);
    Ok(Inputs {
        x: up(s, &x_host)?,
        x_host,
        w: up(s, &vec![1.0f32 / TOPK as f32; TOKENS * TOPK])?,
        idx: up(s, &identity_routing(r.rank, TOKENS))?,
    })
}

/// A correct round trip in `layout` on `group`, checked bit for bit, then a
/// clean check: what every row ends with.
fn round_trip(r: &Rank, group: &EpGroup, layout: RecvLayout, seed: u64) -> Result<()> {
    let inp = inputs(r, seed)?;
    let want = loop_want(r.rank, r.world, &inp.x_host, layout);
    round_trip_of(r, group, layout, &inp, &want)
}

/// [`round_trip`] of given inputs and their expected combine.
fn round_trip_of(
    r: &Rank,
    group: &EpGroup,
    layout: RecvLayout,
    inp: &Inputs,
    want: &[u16],
) -> Result<()> {
    let s = &r.stream;
    let mut out = s
        .alloc_zeros::<bf16>(TOKENS * HIDDEN)
        .map_err(Error::cuda("alloc"))?;
    let handle = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, layout)?;
    let got = group.dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())?;
    let weights = match layout {
        RecvLayout::RankMajor => None,
        RecvLayout::ExpertMajor { .. } => Some(&got.topk_weights as _),
    };
    group.combine(s, &handle, &got.tokens, weights, &mut out)?;
    drop(got);
    group
        .check()
        .map_err(|e| Error::InvalidState(format!("the round trip after the fault: {e}")))?;
    first_diff(
        "the round trip after the fault",
        &bits(&down(s, &out, TOKENS * HIDDEN)?),
        want,
    )
}

/// What a row expects of one rank.
enum Want<'a> {
    /// `InvalidArgument` (or `NotSymmetric`) naming this argument.
    Arg(&'a str),
    /// Ranks that disagree on this argument: `InvalidArgument` naming it
    /// where this rank's kernels compared first, or `PeerFailed` naming
    /// the peer that did and the argument, where this rank saw it stop.
    Mismatch(&'a str),
    /// `PeerFailed` naming the bad rank and (when given) the argument.
    /// `None` does not look at the argument.
    Peer(Option<&'a str>),
    /// `InvalidDeviceData` whose detail names this.
    Device(&'a str),
    /// A refusal of this rank's own host, as check reports it.
    OwnRefusal,
}

fn matches(e: &Error, want: &Want<'_>, bad: usize) -> bool {
    match (want, e) {
        (Want::Arg(a), Error::InvalidArgument { arg, .. }) => arg == a,
        (Want::Arg(a), Error::NotSymmetric { what }) => what == a,
        (Want::Mismatch(a), Error::InvalidArgument { arg, .. }) => arg == a,
        (Want::Mismatch(a), Error::PeerFailed { arg: Some(x), .. }) => x == a,
        (Want::Peer(a), Error::PeerFailed { peer, arg, .. }) => {
            *peer == bad && (a.is_none() || arg.as_deref() == *a)
        }
        (Want::Device(d), Error::InvalidDeviceData { detail, .. }) => detail.contains(d),
        (Want::OwnRefusal, Error::InvalidState(m)) => m.contains("refused"),
        _ => false,
    }
}

/// Asserts one rank's outcome of a row: the op's result `op`, then check's
/// `chk` (`None`: the op's error is the one to check, and check may say
/// it again), and the time the error took.
fn expect(
    r: &Rank,
    row: &str,
    op: Result<()>,
    chk: Result<()>,
    want_op: Option<Want<'_>>,
    want_check: Want<'_>,
    took: Duration,
) -> Result<()> {
    let bad = bad_rank(r);
    let fail = |what: String| Error::InvalidState(format!("{row}, rank {}: {what}", r.rank));
    match (&op, want_op) {
        (Ok(()), None) => {}
        (Err(e), Some(w)) if matches(e, &w, bad) => {}
        (got, _) => return Err(fail(format!("the op returned {got:?}"))),
    }
    match &chk {
        Err(e) if matches(e, &want_check, bad) => {}
        got => return Err(fail(format!("check returned {got:?}"))),
    }
    ensure(took < FAST, || {
        format!("{row}, rank {}: the error took {took:?}", r.rank)
    })
}

/// [`expect`] of a refusal: the bad rank's host refused `arg` (and its
/// check says so), every other rank's check names the bad rank and `arg`.
fn expect_refusal(
    r: &Rank,
    row: &str,
    op: Result<()>,
    chk: Result<()>,
    arg: &str,
    took: Duration,
) -> Result<()> {
    if r.rank == bad_rank(r) {
        expect(
            r,
            row,
            op,
            chk,
            Some(Want::Arg(arg)),
            Want::OwnRefusal,
            took,
        )
    } else {
        expect(r, row, op, chk, None, Want::Peer(Some(arg)), took)
    }
}

/// An op whose argument `arg` is bad on the bad rank only: that rank's
/// host refuses it (naming `arg`), every other rank's check names the bad
/// rank and `arg`, at once; then the group works. `good` is what the other
/// ranks run (dispatch or combine of a dispatched rank-major handle), `bad`
/// the bad rank's call.
fn refused_row(
    r: &Rank,
    row: &str,
    arg: &str,
    combine: bool,
    bad: impl Fn(&mut Ctx<'_>) -> Result<()>,
) -> Result<()> {
    let s = &r.stream;
    let group = fault_group(r)?;
    let inp = inputs(r, 11)?;
    let mut plain = s
        .alloc_zeros::<bf16>(group.recv_capacity() * HIDDEN)
        .map_err(Error::cuda("alloc"))?;
    let mut out = s
        .alloc_zeros::<bf16>(TOKENS * HIDDEN)
        .map_err(Error::cuda("alloc"))?;
    let handle = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)?;
    let got: Option<moe_ep::ops::Dispatched<'static>> = if combine {
        Some(group.dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())?)
    } else {
        None
    };
    s.synchronize().map_err(Error::cuda("sync"))?;
    r.comm.barrier(s)?;
    let t0 = Instant::now();
    let op = if r.rank == bad_rank(r) {
        bad(&mut Ctx {
            r,
            group: &group,
            handle: &handle,
            inp: &inp,
            plain: &mut plain,
            out: &mut out,
            got: got.as_ref(),
        })
    } else if let Some(got) = &got {
        group.combine(s, &handle, &got.tokens, None, &mut out)
    } else {
        group
            .dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())
            .map(drop)
    };
    let chk = group.check();
    expect_refusal(r, row, op, chk, arg, t0.elapsed())?;
    drop((got, handle));
    round_trip(r, &group, RecvLayout::RankMajor, 12)?;
    round_trip(r, &group, FAULT_EM, 13)
}

/// What the bad rank's call of a row gets.
struct Ctx<'a> {
    r: &'a Rank,
    group: &'a EpGroup,
    handle: &'a moe_ep::ops::Handle,
    inp: &'a Inputs,
    plain: &'a mut CudaSlice<bf16>,
    out: &'a mut CudaSlice<bf16>,
    got: Option<&'a moe_ep::ops::Dispatched<'static>>,
}

/// A region that claims more elements than its allocation holds (a C
/// caller's length, say): the ops must refuse it, not read past the end.
struct Lying<'a, T> {
    inner: &'a CudaSlice<T>,
    len: usize,
}
// SAFETY: a test of the ops' own check: the lie is the point, and the
// check refuses the region before any kernel could read it.
unsafe impl<T> DeviceRegion<T> for Lying<'_, T> {
    fn device_ptr(&self) -> u64 {
        DeviceRegion::device_ptr(self.inner)
    }
    fn len(&self) -> usize {
        self.len
    }
}

#[test]
fn fault_short_x_on_one_rank() {
    run_worlds("fault_short_x_on_one_rank", 2, |r| {
        refused_row(r, "short x", "x", false, |c| {
            let x = c.inp.x.slice(0..TOKENS * HIDDEN - 8);
            c.group
                .dispatch(&c.r.stream, c.handle, &x, &c.inp.w, DispatchOut::default())
                .map(drop)
        })
    });
}

#[test]
fn fault_short_topk_weights_on_one_rank() {
    run_worlds("fault_short_topk_weights_on_one_rank", 2, |r| {
        refused_row(r, "short topk_weights", "topk_weights", false, |c| {
            let w = c.inp.w.slice(0..TOKENS * TOPK - 1);
            c.group
                .dispatch(&c.r.stream, c.handle, &c.inp.x, &w, DispatchOut::default())
                .map(drop)
        })
    });
}

#[test]
fn fault_recv_tokens_not_symmetric_on_one_rank() {
    run_worlds("fault_recv_tokens_not_symmetric_on_one_rank", 2, |r| {
        refused_row(r, "plain recv_tokens", "recv_tokens", false, |c| {
            let out = DispatchOut {
                recv_tokens: Some(c.plain),
                recv_topk_weights: None,
            };
            c.group
                .dispatch(&c.r.stream, c.handle, &c.inp.x, &c.inp.w, out)
                .map(drop)
        })
    });
}

/// A length past the end of the allocation (what a C caller can give): the
/// driver's range of the pointer refuses it by name.
#[test]
fn fault_x_longer_than_its_allocation_on_one_rank() {
    run_worlds("fault_x_longer_than_its_allocation_on_one_rank", 2, |r| {
        refused_row(r, "x past its allocation", "x", false, |c| {
            let x = Lying {
                inner: &c.inp.x,
                len: 4 * TOKENS * HIDDEN,
            };
            c.group
                .dispatch(&c.r.stream, c.handle, &x, &c.inp.w, DispatchOut::default())
                .map(drop)
        })
    });
}

#[test]
fn fault_short_out_on_one_rank() {
    run_worlds("fault_short_out_on_one_rank", 2, |r| {
        refused_row(r, "short out", "out", true, |c| {
            let got = c.got.expect("dispatched");
            let mut out = c.out.slice_mut(0..HIDDEN);
            c.group
                .combine(&c.r.stream, c.handle, &got.tokens, None, &mut out)
        })
    });
}

/// T above max_tokens_per_rank on one rank (its layout refused: the
/// high-throughput combine's stage holds max_tokens_per_rank rows a rank).
#[test]
fn fault_tokens_over_the_maximum_on_one_rank() {
    run_worlds("fault_tokens_over_the_maximum_on_one_rank", 2, |r| {
        let s = &r.stream;
        let group = fault_group(r)?;
        let big = up(s, &identity_routing(r.rank, TOKENS + 1))?;
        let small = up(s, &identity_routing(r.rank, TOKENS))?;
        r.comm.barrier(s)?;
        let t0 = Instant::now();
        let idx = if r.rank == bad_rank(r) { &big } else { &small };
        let op = group
            .layout(s, TopkIdx::I32(idx), TOPK, RecvLayout::RankMajor)
            .map(drop);
        let chk = group.check();
        let took = t0.elapsed();
        expect_refusal(r, "T over the maximum", op, chk, "topk_idx", took)?;
        round_trip(r, &group, RecvLayout::RankMajor, 14)
    });
}

/// One rank runs combine where the others dispatch: every rank stops at
/// once naming `op` (the ops are of different families).
#[test]
fn fault_other_op_on_one_rank() {
    run_worlds("fault_other_op_on_one_rank", 2, |r| {
        let s = &r.stream;
        let group = fault_group(r)?;
        let inp = inputs(r, 21)?;
        // Plain memory (pushed): no pool allocation on the bad rank alone.
        let y = s
            .alloc_zeros::<bf16>(group.recv_capacity() * HIDDEN)
            .map_err(Error::cuda("alloc"))?;
        let mut out = s
            .alloc_zeros::<bf16>(TOKENS * HIDDEN)
            .map_err(Error::cuda("alloc"))?;
        let handle = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        r.comm.barrier(s)?;
        let t0 = Instant::now();
        let op = if r.rank == bad_rank(r) {
            group.combine(s, &handle, &y, None, &mut out)
        } else {
            group
                .dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())
                .map(drop)
        };
        let chk = group.check();
        expect(
            r,
            "combine beside dispatch",
            op,
            chk,
            None,
            Want::Mismatch("op"),
            t0.elapsed(),
        )?;
        drop((handle, y));
        round_trip(r, &group, RecvLayout::RankMajor, 22)
    });
}

/// Two expert-major handles; the bad rank dispatches the other one: every
/// rank stops at once naming `handle` (nothing is written with another
/// handle's rows).
#[test]
fn fault_other_handle_on_one_rank() {
    run_worlds("fault_other_handle_on_one_rank", 2, |r| {
        let s = &r.stream;
        let group = fault_group(r)?;
        let inp = inputs(r, 31)?;
        let layout = FAULT_EM;
        let h1 = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, layout)?;
        let h2 = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, layout)?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        r.comm.barrier(s)?;
        let t0 = Instant::now();
        let h = if r.rank == bad_rank(r) { &h1 } else { &h2 };
        let op = group
            .dispatch(s, h, &inp.x, &inp.w, DispatchOut::default())
            .map(drop);
        let chk = group.check();
        expect(
            r,
            "another handle",
            op,
            chk,
            None,
            Want::Mismatch("handle"),
            t0.elapsed(),
        )?;
        drop((h1, h2));
        round_trip(r, &group, layout, 32)
    });
}

/// A bad expert id on one rank: every rank's check names that rank, token
/// and slot at once; a combine of that handle after check is refused
/// naming `handle` (its dispatch was skipped by the error); then the group
/// works.
#[test]
fn fault_bad_routing_on_one_rank_and_its_handle_after_check() {
    run_worlds(
        "fault_bad_routing_on_one_rank_and_its_handle_after_check",
        2,
        |r| {
            let s = &r.stream;
            let group = fault_group(r)?;
            let inp = inputs(r, 41)?;
            let mut idx = identity_routing(r.rank, TOKENS);
            if r.rank == bad_rank(r) {
                idx[3 * TOPK + 2] = EXPERTS as i32 + 5;
            }
            let idx = up(s, &idx)?;
            let mut out = s
                .alloc_zeros::<bf16>(TOKENS * HIDDEN)
                .map_err(Error::cuda("alloc"))?;
            let layout = FAULT_EM;
            let y = group.pool().alloc::<bf16>(group.recv_capacity() * HIDDEN)?;
            let yw = group.pool().alloc::<f32>(group.recv_capacity())?;
            r.comm.barrier(s)?;
            let t0 = Instant::now();
            let handle = group.layout(s, TopkIdx::I32(&idx), TOPK, layout)?;
            // The dispatch is enqueued and skipped on the device, or, once
            // the host has seen the layout's error, refused with it.
            let op = group
                .dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())
                .map(drop);
            let chk = group.check();
            let took = t0.elapsed();
            let want = format!("rank {}", bad_rank(r));
            let routing = |e: &Error| {
                matches!(e, Error::InvalidDeviceData { arg: "topk_idx", detail }
                    if detail.contains(&want) && detail.contains("token 3 slot 2"))
            };
            let ok = match (&op, &chk) {
                (Ok(()), Err(e)) => routing(e),
                (Err(a), Err(b)) => routing(a) && routing(b),
                _ => false,
            };
            ensure(ok, || {
                format!(
                    "bad routing on rank {}: rank {} got {op:?} then {chk:?}",
                    bad_rank(r),
                    r.rank
                )
            })?;
            ensure(took < FAST, || {
                format!("bad routing: the error took {took:?}")
            })?;
            // The handle whose dispatch the error skipped: refused by name.
            let t1 = Instant::now();
            match group.combine(s, &handle, &y, Some(&yw), &mut out) {
                Err(Error::InvalidArgument { arg: "handle", .. }) => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "a combine of the handle the error skipped: {other:?}"
                    )))
                }
            }
            ensure(t1.elapsed() < FAST, || "the refusal was slow".into())?;
            // Refused on every rank's host: nothing out of step.
            group.check()?;
            drop((handle, y, yw));
            round_trip(r, &group, layout, 42)
        },
    );
}

/// A rank that never calls dispatch: every other rank's error names it
/// (the rank that did not arrive, not a peer that was waiting itself),
/// within the group's timeout; a new group on the same communicator works.
#[test]
fn fault_rank_that_never_dispatches_is_named() {
    run_worlds("fault_rank_that_never_dispatches_is_named", 2, |r| {
        let s = &r.stream;
        let bad = bad_rank(r);
        let mut cfg = loop_config(r)?;
        cfg.timeout = Duration::from_secs(1);
        {
            let group = EpGroup::new(&r.comm, cfg.clone())?;
            let inp = inputs(r, 51)?;
            let handle = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)?;
            s.synchronize().map_err(Error::cuda("sync"))?;
            r.comm.barrier(s)?;
            if r.rank != bad {
                let t0 = Instant::now();
                let op = group
                    .dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())
                    .map(drop);
                let chk = group.check();
                let took = t0.elapsed();
                let named = |e: &Error| match e {
                    // Its own wait for the rank, or a peer's (that one
                    // timed out first and stopped).
                    Error::PeerTimeout {
                        peer,
                        absent,
                        counter,
                        ..
                    } => *peer == bad && (*absent || counter.starts_with("another rank's wait")),
                    Error::CollectiveFailed { missing, .. } => missing == &vec![bad],
                    _ => false,
                };
                let ok = match (&op, &chk) {
                    (Ok(()), Err(e)) => named(e),
                    (Err(e), _) => named(e),
                    _ => false,
                };
                ensure(ok, || {
                    format!(
                        "rank {} never dispatched: rank {} got {op:?} then {chk:?}",
                        bad, r.rank
                    )
                })?;
                ensure(took < Duration::from_secs(5), || {
                    format!("the timeout took {took:?} (the group's is 1 s)")
                })?;
            }
            r.comm.barrier(s)?;
        }
        let group = EpGroup::new(&r.comm, cfg)?;
        round_trip(r, &group, RecvLayout::RankMajor, 52)
    });
}

/// Abort stops running work and refuses every later op: every rank but the
/// bad one dispatches (which waits for the bad rank), every rank aborts its
/// communicator 200 ms later (from another thread on the waiting ranks):
/// their streams drain at once, not at the timeout (10 s), and layout,
/// dispatch and combine are then refused naming the abort.
#[test]
fn fault_abort_stops_work_and_refuses_ops() {
    run_worlds("fault_abort_stops_work_and_refuses_ops", 2, |r| {
        let s = &r.stream;
        let group = fault_group(r)?;
        let inp = inputs(r, 61)?;
        let handle = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        r.comm.barrier(s)?;
        let t0 = Instant::now();
        std::thread::scope(|sc| -> Result<()> {
            let comm = r.comm.clone();
            let aborter = sc.spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                comm.abort()
            });
            if r.rank != bad_rank(r) {
                // Returns once the abort is seen (or with its error).
                let _ = group.dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default());
            }
            aborter.join().expect("aborter")?;
            s.synchronize().map_err(Error::cuda("sync"))
        })?;
        let took = t0.elapsed();
        ensure(took < Duration::from_secs(3), || {
            format!(
                "rank {}: the work ended {took:?} after the start (abort at 200 ms)",
                r.rank
            )
        })?;
        let refused = |what: &str, res: Result<()>| match res {
            Err(Error::InvalidState(m)) if m.contains("aborted") => Ok(()),
            other => Err(Error::InvalidState(format!(
                "{what} after abort on rank {}: {other:?}",
                r.rank
            ))),
        };
        let mut out = s
            .alloc_zeros::<bf16>(TOKENS * HIDDEN)
            .map_err(Error::cuda("alloc"))?;
        let y = s
            .alloc_zeros::<bf16>(group.recv_capacity() * HIDDEN)
            .map_err(Error::cuda("alloc"))?;
        refused(
            "layout",
            group
                .layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)
                .map(drop),
        )?;
        refused(
            "dispatch",
            group
                .dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())
                .map(drop),
        )?;
        refused("combine", group.combine(s, &handle, &y, None, &mut out))?;
        refused("check", group.check())
    });
}

/// A rank that never comes to `check`: on NCCL ranks (two GPUs or more)
/// every other rank's check fails once its host timeout (2 s here) has
/// passed, with `CollectiveFailed`, and its communicator is aborted (NCCL's
/// wait ends no other way); on virtual ranks the bound is the world's own,
/// and `set_host_timeout` is refused naming `timeout`.
#[test]
fn fault_rank_that_never_checks() {
    run_worlds("fault_rank_that_never_checks", 2, |r| {
        let s = &r.stream;
        let bound = Duration::from_secs(2);
        if r.comm.is_virtual() {
            return match r.comm.set_host_timeout(bound) {
                Err(Error::InvalidArgument { arg: "timeout", .. }) => Ok(()),
                other => Err(Error::InvalidState(format!(
                    "set_host_timeout on a virtual rank: {other:?}"
                ))),
            };
        }
        let group = fault_group(r)?;
        r.comm.set_host_timeout(bound)?;
        let inp = inputs(r, 99)?;
        // An op, so that check has something to meet over.
        let handle = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        if r.rank == bad_rank(r) {
            // Never checks: stays until the others have given up, then goes
            // as a rank that died would (its collective frees skipped).
            std::thread::sleep(2 * bound);
            r.comm.abort()?;
            drop(handle);
            return Ok(());
        }
        let t0 = Instant::now();
        let chk = group.check();
        let took = t0.elapsed();
        match chk {
            Err(Error::CollectiveFailed { .. }) => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "rank {}: check beside a rank that never checks: {other:?}",
                    r.rank
                )))
            }
        }
        ensure(
            took >= bound && took < bound + Duration::from_secs(1),
            || {
                format!(
                    "rank {}: check gave up after {took:?} (bound {bound:?})",
                    r.rank
                )
            },
        )?;
        ensure(r.comm.is_aborted(), || {
            format!("rank {}: the communicator was not aborted", r.rank)
        })
    });
}

/// Dropping a group while a copy of one of its pool buffers is pending on
/// another stream (held behind a host function): the pool's segment is
/// freed only after the copy, and the context stays usable.
#[test]
fn fault_group_dropped_with_a_pool_copy_pending() {
    run_worlds("fault_group_dropped_with_a_pool_copy_pending", 2, |r| {
        let (s, s2) = (&r.stream, &r.stream2);
        let n = 64 << 20;
        let mut dst = s2.alloc_zeros::<u8>(n).map_err(Error::cuda("alloc"))?;
        {
            let group = fault_group(r)?;
            let mut buf = group.pool().alloc::<u8>(n)?;
            buf.copy_from_host(s, &vec![7u8; n])?;
            r.comm.barrier(s)?;
            if r.rank == bad_rank(r) {
                hold(s2, 300)?;
                buf.copy_to_device(s2, &mut dst)?;
            }
            drop(buf);
            drop(group);
        }
        s2.synchronize()
            .map_err(Error::cuda("the copy after the drop"))?;
        if r.rank == bad_rank(r) {
            let host = down(s2, &dst, n)?;
            ensure(host.iter().all(|&b| b == 7), || {
                "the copy read freed memory".into()
            })?;
        }
        r.comm.barrier(s)?;
        let group = fault_group(r)?;
        round_trip(r, &group, RecvLayout::RankMajor, 71)
    });
}

/// What a peer wrote, out of range on one rank: the bad rank's expert-major
/// rows (meta, written by its senders) overwritten with a row past its
/// capacity before its combine: the combine reads nothing there and reports
/// it, and every rank's check fails (the bad rank's naming the field, the
/// others' naming the bad rank); then the group works.
#[test]
fn fault_peer_row_out_of_range_on_one_rank() {
    run_worlds("fault_peer_row_out_of_range_on_one_rank", 2, |r| {
        bad_meta_rows(r, 1, 81, "only values below", |rows, _| {
            rows.iter_mut().for_each(|v| *v = i32::MAX)
        })
    });
}

/// The same with the rows just past this rank's own rows (the padded
/// blocks of its experts) but inside a capacity twice what the routing
/// needs: a caller's buffers sized by the host counts hold no more, so
/// such a row is out of range too.
#[test]
fn fault_peer_row_past_this_ranks_rows_on_one_rank() {
    run_worlds("fault_peer_row_past_this_ranks_rows_on_one_rank", 2, |r| {
        bad_meta_rows(r, 2, 83, "only values below", |rows, here| {
            rows.iter_mut()
                .filter(|v| **v >= 0)
                .for_each(|v| *v = here as i32)
        })
    });
}

/// The same with a row written twice for one token (each token's second
/// row here made its first): reported, nothing read there.
#[test]
fn fault_peer_row_repeated_on_one_rank() {
    run_worlds("fault_peer_row_repeated_on_one_rank", 2, |r| {
        bad_meta_rows(r, 1, 85, "twice", |rows, _| {
            for tok in rows.chunks_mut(TOPK) {
                let here: Vec<usize> = (0..TOPK).filter(|&k| tok[k] >= 0).collect();
                if let [a, b, ..] = here[..] {
                    tok[b] = tok[a];
                }
            }
        })
    });
}

/// A peer's count row out of range, from one rank: the bad rank's layout
/// sends its count for expert 0 as -1. Every rank's layout finds it in
/// the row it received and stops (`InvalidDeviceData` naming the bad rank
/// on every rank's check, nothing derived from it); then the group works.
#[test]
fn fault_peer_count_out_of_range_on_one_rank() {
    run_worlds("fault_peer_count_out_of_range_on_one_rank", 2, |r| {
        bad_count_row(
            r,
            CountWord::Expert(0),
            -1,
            "wrote -1 where only values below",
            87,
        )
    });
}

/// The same with the row's last sub-chunk start toward rank 0 sent as 0,
/// below the starts before it (each in range): where combine's chunks of
/// its rows begin, out of order.
#[test]
fn fault_peer_sub_chunk_starts_falling_on_one_rank() {
    run_worlds("fault_peer_sub_chunk_starts_falling_on_one_rank", 2, |r| {
        let last = CountWord::SubChunkStart { to: 0, chunk: 15 };
        bad_count_row(r, last, 0, "sub-chunk start", 89)
    });
}

/// A fault row of a count row the bad rank sends with `word` as `value`:
/// every rank's layout stops, every rank's check is `InvalidDeviceData`
/// whose detail names the bad rank and `detail`, within the usual bound;
/// then a round trip in both layouts.
fn bad_count_row(r: &Rank, word: CountWord, value: i16, detail: &str, seed: u64) -> Result<()> {
    let s = &r.stream;
    let group = fault_group(r)?;
    let inp = inputs(r, seed)?;
    if r.rank == bad_rank(r) {
        group.corrupt_next_count_row_for_tests(word, value)?;
    }
    r.comm.barrier(s)?;
    let t0 = Instant::now();
    let op = group
        .layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)
        .map(drop);
    let chk = group.check();
    let took = t0.elapsed();
    // Every rank names the bad rank (the bad rank itself as "this rank").
    let bad = bad_rank(r);
    if let Err(Error::InvalidDeviceData { detail: d, .. }) = &chk {
        ensure(d.contains(&format!("rank {bad}")), || {
            format!("rank {}: the error names not rank {bad}: {d}", r.rank)
        })?;
    }
    expect(r, "count row", op, chk, None, Want::Device(detail), took)?;
    round_trip(r, &group, RecvLayout::RankMajor, seed + 1)?;
    round_trip(r, &group, FAULT_EM, seed + 2)
}

/// A fault row of expert-major rows a peer wrote: on a group of `factor`
/// times the fault rows' capacity, the bad rank's meta rows (as its senders
/// wrote them, and its own rows) changed by `junk` before its combine;
/// every rank's check fails (the bad rank's `InvalidDeviceData` naming
/// `detail`), then the group works.
fn bad_meta_rows(
    r: &Rank,
    factor: usize,
    seed: u64,
    detail: &str,
    junk: impl Fn(&mut [i32], usize),
) -> Result<()> {
    let s = &r.stream;
    let mut cfg = r.config(EXPERTS, HIDDEN, TOKENS)?;
    let el = EXPERTS / r.world;
    let per_expert = (TOKENS * TOPK * r.world / EXPERTS).div_ceil(FAULT_ALIGN) * FAULT_ALIGN;
    cfg.recv_capacity = factor * (r.world * TOKENS).max(el * per_expert);
    cfg.timeout = Duration::from_secs(10);
    let group = EpGroup::new(&r.comm, cfg)?;
    let inp = inputs(r, seed)?;
    let layout = FAULT_EM;
    let mut out = s
        .alloc_zeros::<bf16>(TOKENS * HIDDEN)
        .map_err(Error::cuda("alloc"))?;
    let handle = group.layout(s, TopkIdx::I32(&inp.idx), TOPK, layout)?;
    let got = group.dispatch(s, &handle, &inp.x, &inp.w, DispatchOut::default())?;
    let here = handle.host_counts(s)?.recv_rows;
    s.synchronize().map_err(Error::cuda("sync"))?;
    r.comm.barrier(s)?;
    if r.rank == bad_rank(r) {
        let meta = handle.meta_for_tests();
        let mut rows = vec![0i32; meta.len()];
        meta.copy_to_host(s, &mut rows)?;
        junk(&mut rows, here);
        // SAFETY: meta holds meta.len() i32; the stream is drained.
        unsafe { moe_ep::cuda::result::memcpy_htod_async(meta.device_ptr(), &rows, s.cu_stream()) }
            .map_err(Error::cuda("htod"))?;
        s.synchronize().map_err(Error::cuda("sync"))?;
    }
    let t0 = Instant::now();
    let op = group.combine(s, &handle, &got.tokens, Some(&got.topk_weights), &mut out);
    let chk = group.check();
    let took = t0.elapsed();
    let want = if r.rank == bad_rank(r) {
        Want::Device(detail)
    } else {
        Want::Peer(None)
    };
    expect(r, "meta out of range", op, chk, None, want, took)?;
    drop((got, handle));
    round_trip(r, &group, layout, seed + 1)
}

/// The virtual world's size is bounded (every rank is a thread on one GPU).
#[test]
fn huge_virtual_world_is_refused() {
    let Some(_) = moe_ep::testkit::ranks::gpus_or_skip("huge_virtual_world_is_refused", 1) else {
        return;
    };
    let ctx = moe_ep::context(0).expect("context");
    match Communicator::virtual_world(&ctx, 1 << 20) {
        Err(Error::InvalidArgument { arg: "world", .. }) => {}
        other => panic!("a virtual world of 2^20 ranks: {:?}", other.err()),
    }
}

// ---------------------------------------------------------------------------
// Low latency.
// ---------------------------------------------------------------------------

const LL_TOKENS: usize = 64;

fn ll_group(r: &Rank) -> Result<EpGroup> {
    let mut cfg = r.config(EXPERTS, HIDDEN, LL_TOKENS)?;
    cfg.mode = Mode::LowLatency;
    cfg.timeout = Duration::from_secs(10);
    EpGroup::new(&r.comm, cfg)
}

/// A rank-major bf16 low-latency dispatch of `x` routed by `idx`.
fn ll_dispatch_rank_major(
    s: &Arc<CudaStream>,
    group: &EpGroup,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<f32>,
    idx: &CudaSlice<i32>,
) -> Result<moe_ep::LlHandle> {
    group.ll_dispatch(
        s,
        moe_ep::LlDispatchArgs {
            x: LlInput::Bf16(x),
            topk_idx: TopkIdx::I32(idx),
            topk: TOPK,
            topk_weights: w,
            layout: LlLayout::RankMajor,
            cast_fp8: None,
        },
    )
}

/// A low-latency batch's inputs on this rank: `x` all ones, weights 1,
/// the identity routing (rank-major dispatch, `ll_dispatch_rank_major`).
fn ll_ones(r: &Rank) -> Result<(CudaSlice<bf16>, CudaSlice<f32>, CudaSlice<i32>)> {
    let s = &r.stream;
    Ok((
        up(s, &vec![bf16::ONE; LL_TOKENS * HIDDEN])?,
        up(s, &vec![1.0f32; LL_TOKENS * TOPK])?,
        up(s, &identity_routing(r.rank, LL_TOKENS))?,
    ))
}

/// A bf16 batch's received rows.
fn ll_rows(hd: &moe_ep::LlHandle) -> Result<moe_ep::ops::LlView<'_, bf16>> {
    hd.tokens()
        .ok_or_else(|| Error::InvalidState("bf16 rows".into()))
}

/// One correct low-latency batch (rank-major, bf16), its combine of the
/// received rows themselves checked bit for bit; then a clean check.
fn ll_round_trip(r: &Rank, group: &EpGroup, seed: u64) -> Result<()> {
    let s = &r.stream;
    let x_host = workload::tokens(&mut Rng::new(seed + r.rank as u64), LL_TOKENS, HIDDEN);
    let x = up(s, &x_host)?;
    let w = up(s, &vec![1.0f32; LL_TOKENS * TOPK])?;
    let idx = up(s, &identity_routing(r.rank, LL_TOKENS))?;
    let mut out = s
        .alloc_zeros::<bf16>(LL_TOKENS * HIDDEN)
        .map_err(Error::cuda("alloc"))?;
    let hd = ll_dispatch_rank_major(s, group, &x, &w, &idx)?;
    let rows = ll_rows(&hd)?;
    group.ll_combine(s, &hd, &rows, None, &mut out)?;
    group.check()?;
    // Each token back once per rank that hosts one of its experts.
    let want: Vec<u16> = {
        let el = EXPERTS / r.world;
        let idx = identity_routing(r.rank, LL_TOKENS);
        (0..LL_TOKENS * HIDDEN)
            .map(|i| {
                let t = i / HIDDEN;
                let mut d: Vec<usize> = idx[t * TOPK..(t + 1) * TOPK]
                    .iter()
                    .map(|&e| e as usize / el)
                    .collect();
                d.sort_unstable();
                d.dedup();
                bf16::from_f64(x_host[i].to_f64() * d.len() as f64).to_bits()
            })
            .collect()
    };
    first_diff(
        "low-latency round trip",
        &bits(&down(s, &out, LL_TOKENS * HIDDEN)?),
        &want,
    )
}

/// One bad low-latency batch (a bad expert id on one rank), check on every
/// rank, then correct batches: the buffer sets stay aligned (the group is
/// not dead), in one-call and two-phase form.
#[test]
fn fault_ll_bad_batch_then_good_batches() {
    run_worlds("fault_ll_bad_batch_then_good_batches", 2, |r| {
        ll_bad_batch(
            r,
            |_, idx| {
                idx[TOPK + 1] = -5;
                Ok(())
            },
            "topk_idx",
            "",
            90,
        )
    });
}

/// A peer's low-latency token count out of range, from one rank: its
/// dispatch sends its rows but signals max_tokens + 1 tokens. Every
/// receiver stops before reading a row of it (`InvalidDeviceData` naming
/// the bad rank and the count, on every rank's check); then batches work.
#[test]
fn fault_ll_peer_token_count_out_of_range_on_one_rank() {
    run_worlds(
        "fault_ll_peer_token_count_out_of_range_on_one_rank",
        2,
        |r| {
            let want = format!(
                "wrote {} where only values below {} fit",
                LL_TOKENS + 1,
                LL_TOKENS + 1
            );
            ll_bad_batch(
                r,
                |group, _| group.corrupt_next_ll_token_count_for_tests(LL_TOKENS as i32 + 1),
                "num_tokens",
                &want,
                94,
            )
        },
    );
}

/// A low-latency batch the bad rank spoils (`spoil` there: its routing, or
/// its group before the dispatch), then check on every rank: each gets
/// `InvalidDeviceData` naming `arg`, its detail naming the bad rank (as
/// "this rank" on the bad rank itself) and containing `detail`, fast; then
/// four good batches.
fn ll_bad_batch(
    r: &Rank,
    spoil: impl Fn(&EpGroup, &mut [i32]) -> Result<()>,
    arg: &str,
    detail: &str,
    seed: u64,
) -> Result<()> {
    let s = &r.stream;
    let group = ll_group(r)?;
    let x = up(s, &vec![bf16::ONE; LL_TOKENS * HIDDEN])?;
    let w = up(s, &vec![1.0f32; LL_TOKENS * TOPK])?;
    let mut idx = identity_routing(r.rank, LL_TOKENS);
    if r.rank == bad_rank(r) {
        spoil(&group, &mut idx)?;
    }
    let idx = up(s, &idx)?;
    r.comm.barrier(s)?;
    let t0 = Instant::now();
    let op = ll_dispatch_rank_major(s, &group, &x, &w, &idx).map(drop);
    let chk = group.check();
    let took = t0.elapsed();
    let who = format!("rank {}", bad_rank(r));
    match (&op, &chk) {
        (Ok(()), Err(Error::InvalidDeviceData { arg: a, detail: d }))
            if *a == arg && d.contains(&who) && d.contains(detail) => {}
        other => {
            return Err(Error::InvalidState(format!(
            "a bad low-latency batch on rank {}: rank {} got {other:?} (want {arg}, {detail:?})",
            bad_rank(r),
            r.rank
        )))
        }
    }
    ensure(took < FAST, || format!("the error took {took:?}"))?;
    for i in 0..4 {
        ll_round_trip(r, &group, seed + i)?;
    }
    Ok(())
}

/// A low-latency dispatch refused on one rank's host (x too short): every
/// other rank's check names it and `x` at once; then batches work.
#[test]
fn fault_ll_refused_send_on_one_rank() {
    run_worlds("fault_ll_refused_send_on_one_rank", 2, |r| {
        let s = &r.stream;
        let group = ll_group(r)?;
        let (x, w, idx) = ll_ones(r)?;
        r.comm.barrier(s)?;
        let t0 = Instant::now();
        let xs = x.slice(
            0..if r.rank == bad_rank(r) {
                HIDDEN
            } else {
                LL_TOKENS * HIDDEN
            },
        );
        let op = group
            .ll_dispatch(
                s,
                moe_ep::LlDispatchArgs {
                    x: LlInput::Bf16(&xs),
                    topk_idx: TopkIdx::I32(&idx),
                    topk: TOPK,
                    topk_weights: &w,
                    layout: LlLayout::RankMajor,
                    cast_fp8: None,
                },
            )
            .map(drop);
        let chk = group.check();
        let took = t0.elapsed();
        expect_refusal(r, "low-latency short x", op, chk, "x", took)?;
        for i in 0..3 {
            ll_round_trip(r, &group, 95 + i)?;
        }
        Ok(())
    });
}

/// A low-latency combine refused on one rank's host (`out` too short), in
/// its one-call and its two-phase form (`expert_out` too short for the
/// send): every other rank's check names that rank and the argument at
/// once (no combine wait runs to the timeout); the refused batch is spent
/// on the refusing rank (a retry is refused by state); then batches work.
#[test]
fn fault_ll_refused_combine_on_one_rank() {
    run_worlds("fault_ll_refused_combine_on_one_rank", 2, |r| {
        let s = &r.stream;
        let group = ll_group(r)?;
        let (x, w, idx) = ll_ones(r)?;
        let mut out = s
            .alloc_zeros::<bf16>(LL_TOKENS * HIDDEN)
            .map_err(Error::cuda("alloc"))?;
        let bad = r.rank == bad_rank(r);
        for two_phase in [false, true] {
            let hd = ll_dispatch_rank_major(s, &group, &x, &w, &idx)?;
            let rows = ll_rows(&hd)?;
            r.comm.barrier(s)?;
            let t0 = Instant::now();
            let (row, arg, op) = if two_phase {
                let ys = s
                    .alloc_zeros::<bf16>(hd.num_rows() * HIDDEN)
                    .map_err(Error::cuda("alloc"))?;
                let y = ys.slice(0..if bad { HIDDEN } else { hd.num_rows() * HIDDEN });
                let op = group
                    .ll_combine_send(s, &hd, &y)
                    .and_then(|sent| group.ll_combine_wait(s, &sent, None, &mut out));
                (
                    "low-latency combine send, short expert_out",
                    "expert_out",
                    op,
                )
            } else {
                let op = if bad {
                    let mut short = out.slice_mut(0..HIDDEN);
                    group.ll_combine(s, &hd, &rows, None, &mut short)
                } else {
                    group.ll_combine(s, &hd, &rows, None, &mut out)
                };
                ("low-latency combine, short out", "out", op)
            };
            if bad {
                // The batch is spent here: a corrected retry is refused.
                match group.ll_combine(s, &hd, &rows, None, &mut out) {
                    Err(Error::InvalidState(_)) => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "{row}: the retry on the refusing rank gave {:?}",
                            other.err()
                        )))
                    }
                }
            }
            let chk = group.check();
            let took = t0.elapsed();
            expect_refusal(r, row, op, chk, arg, took)?;
            for i in 0..2 {
                ll_round_trip(r, &group, 70 + i)?;
            }
        }
        Ok(())
    });
}

/// A refusal of the caller's own checks on one rank (a binding's dtype
/// check, say), made through `EpGroup::refuse` where the op would have
/// been called: every other rank's op stops at once, its check naming the
/// refusing rank and the argument, as for the ops' own refusals; then the
/// group works. Layout, dispatch and combine (high throughput), then the
/// low-latency dispatch and combine.
#[test]
fn fault_caller_refusal_on_one_rank() {
    run_worlds("fault_caller_refusal_on_one_rank", 2, |r| {
        let s = &r.stream;
        let f16 = |arg: &'static str| Error::arg(arg, "a bf16 array", "an f16 array");
        refused_row(r, "caller refusal of dispatch", "x", false, |c| {
            Err(c.group.refuse(s, RefusedCall::Dispatch(c.handle), f16("x")))
        })?;
        refused_row(r, "caller refusal of combine", "expert_out", true, |c| {
            Err(c
                .group
                .refuse(s, RefusedCall::Combine(c.handle), f16("expert_out")))
        })?;
        let bad = r.rank == bad_rank(r);
        {
            let group = fault_group(r)?;
            let inp = inputs(r, 31)?;
            r.comm.barrier(s)?;
            let t0 = Instant::now();
            let op = if bad {
                let e = Error::arg("topk_idx", "an int32 or int64 array", "a float array");
                Err(group.refuse(s, RefusedCall::Layout, e))
            } else {
                group
                    .layout(s, TopkIdx::I32(&inp.idx), TOPK, RecvLayout::RankMajor)
                    .map(drop)
            };
            let chk = group.check();
            let took = t0.elapsed();
            expect_refusal(r, "caller refusal of layout", op, chk, "topk_idx", took)?;
            round_trip(r, &group, RecvLayout::RankMajor, 32)?;
        }
        let group = ll_group(r)?;
        let (x, w, idx) = ll_ones(r)?;
        r.comm.barrier(s)?;
        let t0 = Instant::now();
        let op = if bad {
            Err(group.refuse(s, RefusedCall::LlDispatch(LlLayout::RankMajor), f16("x")))
        } else {
            ll_dispatch_rank_major(s, &group, &x, &w, &idx).map(drop)
        };
        let chk = group.check();
        let took = t0.elapsed();
        expect_refusal(r, "caller refusal of ll_dispatch", op, chk, "x", took)?;
        ll_round_trip(r, &group, 33)?;
        let mut out = s
            .alloc_zeros::<bf16>(LL_TOKENS * HIDDEN)
            .map_err(Error::cuda("alloc"))?;
        let hd = ll_dispatch_rank_major(s, &group, &x, &w, &idx)?;
        let rows = ll_rows(&hd)?;
        r.comm.barrier(s)?;
        let t0 = Instant::now();
        let op = if bad {
            Err(group.refuse(s, RefusedCall::LlCombine(&hd), f16("out")))
        } else {
            group.ll_combine(s, &hd, &rows, None, &mut out)
        };
        let chk = group.check();
        let took = t0.elapsed();
        expect_refusal(r, "caller refusal of ll_combine", op, chk, "out", took)?;
        ll_round_trip(r, &group, 34)
    });
}

// ---------------------------------------------------------------------------
// Recovery, looped.
// ---------------------------------------------------------------------------

/// Rounds of {a bad expert id on one rank, check on every rank, a correct
/// round trip}: the ranks never fall out of step.
fn bad_layout_rounds(r: &Rank, rounds: usize) -> Result<()> {
    let s = &r.stream;
    let group = fault_group(r)?;
    let mut idx = identity_routing(r.rank, TOKENS);
    if r.rank == bad_rank(r) {
        idx[7] = -9;
    }
    let bad_idx = up(s, &idx)?;
    // Seven inputs and their expected combines, made once.
    let mut cases = Vec::new();
    for seed in 100..107 {
        let inp = inputs(r, seed)?;
        let want = loop_want(r.rank, r.world, &inp.x_host, RecvLayout::RankMajor);
        cases.push((inp, want));
    }
    let t0 = Instant::now();
    for round in 0..rounds {
        let res = group
            .layout(s, TopkIdx::I32(&bad_idx), TOPK, RecvLayout::RankMajor)
            .map(drop);
        let chk = group.check();
        match (&res, &chk) {
            (Ok(()), Err(Error::InvalidDeviceData { .. })) => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "round {round}: the bad layout gave {other:?}"
                )))
            }
        }
        let (inp, want) = &cases[round % cases.len()];
        round_trip_of(r, &group, RecvLayout::RankMajor, inp, want)
            .map_err(|e| Error::InvalidState(format!("round {round}: {e}")))?;
    }
    if r.rank == 0 {
        eprintln!("    {rounds} rounds in {:.2} s", t0.elapsed().as_secs_f64());
    }
    Ok(())
}

#[test]
fn bad_layout_check_round_trip_rounds() {
    run_worlds("bad_layout_check_round_trip_rounds", 2, |r| {
        bad_layout_rounds(r, cycles(200))
    });
}

#[test]
#[ignore = "10,000 rounds per world: run with --ignored"]
fn bad_layout_check_round_trip_soak() {
    run_worlds("bad_layout_check_round_trip_soak", 2, |r| {
        bad_layout_rounds(r, cycles(10_000))
    });
}
