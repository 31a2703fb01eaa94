//! GPU tests of the low-latency mode (`multi-gpu`; any world size >= 1).
//!
//! Every test runs on all real GPUs when there are enough, and on virtual
//! ranks on GPU 0 at world 2, 4 and 8 when there are fewer than two
//! (`moe_ep::testkit::ranks`). The table, the identity experts, the two
//! batches in flight, the two-phase form and the CUDA graphs run at world 1
//! too: on one real GPU (or `MOE_EP_TEST_GPUS=1`), and as a virtual world
//! with `MOE_EP_TEST_VIRTUAL_WORLDS=1,2,4,8`; the tests of peers that
//! disagree or stall need two ranks.
//! Each case of the table is two tests, `<case>::rank_major` and
//! `<case>::expert_major`, that dispatch (bf16, fp8 cast on the sender with
//! exact or power-of-two scales, or the caller's fp8 rows) and combine twice
//! (once per buffer set), or ten times in the cases marked so, on every
//! rank, checked against the CPU reference (`moe_ep::reference::ll_dispatch`,
//! `ll_combine_emulated`, `ll_combine_f64`): dispatch bit for bit on the
//! counted rows in every round, combine bit for bit against the f32
//! emulation and within bf16 rounding of the f64 sum, and the same bits in
//! every round. The cases span T = 0, 1, 77 and max_tokens_per_rank (up to
//! 256 rows of hidden 7168), uniform, skewed, one-hot and masked routing.
//! The other tests: identity experts, two batches in flight, the two-phase
//! form, CUDA graphs captured once and replayed five times with new routing
//! and tokens, bad inputs refused by name, bad routing and mismatched ranks
//! reported on every rank, and bounded timeouts.
#![cfg(feature = "multi-gpu")]

use std::sync::Arc;
use std::time::Duration;

use moe_ep::cuda::{CudaSlice, CudaStream};
use moe_ep::ops::{DeviceRegion, Fp8Scaling, LlHandle, LlInput, LlLayout, TopkIdx};
use moe_ep::reference::{self as refr, Fp8Tokens, LlDispatchOutput, LlPayload, LlTokens};
use moe_ep::reference::{RankInput, Shape};
use moe_ep::testkit::ranks::{ensure, run_ranks, worlds, Rank};
use moe_ep::testkit::workload::{self, Rng, Routing};
use moe_ep::{bf16, EpGroup, Error, GroupConfig, Mode, Result};

#[path = "common/device.rs"]
mod device;
use device::{bits, down, drain, f32_bits, first_diff, up};

// ---- helpers (uploads, downloads, bits: tests/common/device.rs) ----

/// Compares the counted rows (`per_row` values each) of `got` with `want`.
fn diff_rows<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
    per_row: usize,
    rows: &[usize],
) -> Result<()> {
    ensure(got.len() >= want.len(), || {
        format!("{what}: {} values, want {}", got.len(), want.len())
    })?;
    for &row in rows {
        let r = row * per_row..(row + 1) * per_row;
        if let Some(i) = got[r.clone()]
            .iter()
            .zip(&want[r.clone()])
            .position(|(a, b)| a != b)
        {
            return Err(Error::InvalidState(format!(
                "{what}: row {row}, value {i}: got {:?}, want {:?}",
                got[r.start + i],
                want[r.start + i]
            )));
        }
    }
    Ok(())
}

fn arg_of(res: Result<impl Sized>) -> String {
    match res {
        Err(Error::InvalidArgument { arg, .. }) => arg.to_string(),
        Err(e) => format!("not InvalidArgument: {e}"),
        Ok(_) => "accepted".to_string(),
    }
}

fn expect_arg(what: &str, res: Result<impl Sized>, want: &str) -> Result<()> {
    let got = arg_of(res);
    ensure(got == want, || {
        format!("{what}: expected InvalidArgument naming `{want}`, got {got}")
    })
}

// ---- cases ----

#[derive(Clone, Copy, Debug)]
enum Payload {
    Bf16,
    /// Cast to fp8 by the sender.
    Cast(Fp8Scaling),
    /// The caller's fp8 rows (random codes and scales, forwarded).
    Caller,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    tokens: usize,
    /// `max_tokens_per_rank` (>= tokens).
    max_tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    routing: Routing,
    payload: Payload,
    /// This rank sends nothing (0 tokens).
    silent_rank: Option<usize>,
    idx_i32: bool,
    sms: usize,
    /// Dispatch and combine rounds on one group with the same inputs
    /// (alternating buffer sets); every round's combine has the same bits.
    rounds: usize,
}

const fn case(tokens: usize, hidden: usize, topk: usize, experts: usize) -> Case {
    Case {
        tokens,
        max_tokens: if tokens == 0 { 1 } else { tokens },
        hidden,
        topk,
        experts,
        routing: Routing::Uniform,
        payload: Payload::Bf16,
        silent_rank: None,
        idx_i32: false,
        sms: 24,
        rounds: 2,
    }
}

const EXACT: Payload = Payload::Cast(Fp8Scaling::Exact);
const POW2: Payload = Payload::Cast(Fp8Scaling::PowerOfTwo);

/// One module per case with a test per layout.
macro_rules! case_table {
    ($($id:ident = $case:expr;)+) => {
        $(
            mod $id {
                use super::*;
                #[test]
                fn rank_major() {
                    table_case(stringify!($id), $case, LlLayout::RankMajor);
                }
                #[test]
                fn expert_major() {
                    table_case(stringify!($id), $case, LlLayout::ExpertMajor);
                }
            }
        )+
    };
}

case_table! {
    // Ten rounds: the same combine bits every time (every payload).
    bf16_t128_h2048_k8_e64_10rounds = Case { rounds: 10, ..case(128, 2048, 8, 64) };
    // Fewer tokens than the buffers hold; the largest decode rows.
    bf16_t100_m256_h7168_k8_e64 = Case { max_tokens: 256, ..case(100, 7168, 8, 64) };
    // As many tokens as the buffers hold, of the largest decode rows.
    bf16_t256_m256_h7168_k8_e64 = case(256, 7168, 8, 64);
    fp8_exact_t128_h2048_k8_e64_10rounds = Case {
        payload: EXACT,
        rounds: 10,
        ..case(128, 2048, 8, 64)
    };
    fp8_pow2_t64_h1024_k4_e32_10rounds = Case {
        payload: POW2,
        rounds: 10,
        ..case(64, 1024, 4, 32)
    };
    fp8_caller_t96_h512_k2_e16_10rounds = Case {
        payload: Payload::Caller,
        rounds: 10,
        ..case(96, 512, 2, 16)
    };
    // One token per rank: with buffers for one, and for 128.
    bf16_t1_h2048_k8_e64 = case(1, 2048, 8, 64);
    fp8_exact_t1_m128_h7168_k8_e64 = Case {
        payload: EXACT,
        max_tokens: 128,
        ..case(1, 7168, 8, 64)
    };
    fp8_pow2_t1_h1024_k4_e16 = Case { payload: POW2, ..case(1, 1024, 4, 16) };
    // 77 tokens (no power of two, not a multiple of a warp).
    bf16_t77_m128_h4096_k8_e64 = Case { max_tokens: 128, ..case(77, 4096, 8, 64) };
    fp8_exact_t77_h2048_k6_e64 = Case { payload: EXACT, ..case(77, 2048, 6, 64) };
    // Every token routes to expert 0 (rank 0's first local expert): top-1
    // leaves every other expert empty; top-8 adds 7 uniform picks.
    bf16_onehot_t64_h2048_k1_e16 = Case {
        routing: Routing::Skewed { hot_share: 1.0 },
        ..case(64, 2048, 1, 16)
    };
    fp8_exact_onehot_t128_h2048_k8_e64 = Case {
        routing: Routing::Skewed { hot_share: 1.0 },
        payload: EXACT,
        ..case(128, 2048, 8, 64)
    };
    // No tokens anywhere.
    bf16_t0_h1024_k4_e16 = case(0, 1024, 4, 16);
    fp8_exact_t0_h1024_k4_e16 = Case { payload: EXACT, ..case(0, 1024, 4, 16) };
    // One rank sends nothing; the others send to it.
    bf16_t64_h1024_k2_e16_silent1 = Case { silent_rank: Some(1), ..case(64, 1024, 2, 16) };
    fp8_caller_t64_h1024_k2_e16_silent0 = Case {
        silent_rank: Some(0),
        payload: Payload::Caller,
        ..case(64, 1024, 2, 16)
    };
    // Half the slots masked: some ranks get nothing from some senders.
    fp8_exact_masked50_t80_h1024_k8_e64 = Case {
        routing: Routing::Masked { masked_share: 0.5 },
        payload: EXACT,
        ..case(80, 1024, 8, 64)
    };
    bf16_masked90_t16_h512_k2_e16_sm1 = Case {
        routing: Routing::Masked { masked_share: 0.9 },
        sms: 1,
        ..case(16, 512, 2, 16)
    };
    bf16_t256_h2048_k16_e64_i32 = Case { idx_i32: true, ..case(256, 2048, 16, 64) };
    // A hidden size that only bf16 takes; top-1; one hot expert.
    bf16_skewed_t32_h1032_k1_e8_sm3 = Case {
        routing: Routing::Skewed { hot_share: 0.8 },
        sms: 3,
        ..case(32, 1032, 1, 8)
    };
    fp8_pow2_t128_h2048_k8_e256 = Case { payload: POW2, ..case(128, 2048, 8, 256) };
}

fn shape_of(c: &Case, world: usize) -> Shape {
    Shape {
        num_ranks: world,
        num_experts: c.experts,
        hidden: c.hidden,
        topk: c.topk,
    }
}

fn tokens_per_rank(c: &Case, world: usize) -> Vec<usize> {
    (0..world)
        .map(|r| {
            if Some(r) == c.silent_rank {
                0
            } else {
                c.tokens
            }
        })
        .collect()
}

/// Random fp8 rows of the caller: any codes (NaN codes too: they are only
/// moved), positive scales.
fn caller_fp8(seed: u64, rows: usize, hidden: usize) -> Fp8Tokens {
    let mut rng = Rng::new(seed);
    Fp8Tokens {
        codes: (0..rows * hidden).map(|_| rng.next_u64() as u8).collect(),
        scales: (0..rows * hidden / 128)
            .map(|_| 1e-3 + rng.f32_unit())
            .collect(),
    }
}

/// Random expert outputs on the counted rows of `o` (zeros elsewhere: never read).
fn expert_out(seed: u64, o: &LlDispatchOutput, hidden: usize) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; o.num_rows * hidden];
    let mut rng = Rng::new(seed);
    for row in o.counted_rows() {
        let v = workload::tokens(&mut rng, 1, hidden);
        out[row * hidden..(row + 1) * hidden].copy_from_slice(&v);
    }
    out
}

/// What every rank of a run needs of the reference, computed once per world.
struct Fixture {
    shape: Shape,
    m: usize,
    inputs: Vec<RankInput>,
    /// The caller's fp8 rows per rank (Payload::Caller).
    fp8: Option<Vec<Fp8Tokens>>,
    /// What each rank receives.
    refs: Vec<LlDispatchOutput>,
    /// Each rank's expert outputs in the layout.
    outs: Vec<Vec<bf16>>,
}

fn ref_payload<'a>(p: Payload, fp8: &'a Option<Vec<Fp8Tokens>>) -> LlPayload<'a> {
    match p {
        Payload::Bf16 => LlPayload::Bf16,
        Payload::Cast(s) => LlPayload::Fp8Cast(s),
        Payload::Caller => LlPayload::Fp8(fp8.as_deref().expect("caller rows")),
    }
}

/// The reference's dispatch to every rank, one thread per destination.
fn dispatch_all(
    shape: &Shape,
    inputs: &[RankInput],
    m: usize,
    layout: LlLayout,
    payload: LlPayload,
) -> Result<Vec<LlDispatchOutput>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..shape.num_ranks)
            .map(|d| s.spawn(move || refr::ll_dispatch(shape, inputs, m, d, layout, payload)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("reference thread"))
            .collect()
    })
}

fn build_fixture(c: &Case, world: usize, layout: LlLayout, seed: u64) -> Result<Fixture> {
    let shape = shape_of(c, world);
    let tpr = tokens_per_rank(c, world);
    let inputs = workload::rank_inputs(seed, &shape, &tpr, c.routing);
    let fp8 = match c.payload {
        Payload::Caller => Some(
            tpr.iter()
                .enumerate()
                .map(|(r, &t)| caller_fp8(seed ^ (0xF8 + r as u64), t, c.hidden))
                .collect(),
        ),
        _ => None,
    };
    let refs = dispatch_all(
        &shape,
        &inputs,
        c.max_tokens,
        layout,
        ref_payload(c.payload, &fp8),
    )?;
    let outs = refs
        .iter()
        .enumerate()
        .map(|(d, o)| expert_out(seed ^ (0xE0 + d as u64), o, c.hidden))
        .collect();
    Ok(Fixture {
        shape,
        m: c.max_tokens,
        inputs,
        fp8,
        refs,
        outs,
    })
}

/// A low-latency group config (its SMs capped to what fits).
fn ll_config(r: &Rank, experts: usize, hidden: usize, m: usize, sms: usize) -> Result<GroupConfig> {
    let mut cfg = GroupConfig::new(experts, hidden, m);
    cfg.mode = Mode::LowLatency;
    cfg.timeout = Duration::from_secs(10);
    cfg.num_sms = r.sms(sms, experts)?;
    Ok(cfg)
}

/// One rank's inputs on the device.
struct Dev {
    t: usize,
    k: usize,
    x: CudaSlice<bf16>,
    idx64: CudaSlice<i64>,
    idx32: CudaSlice<i32>,
    w: CudaSlice<f32>,
    codes: CudaSlice<u8>,
    scales: CudaSlice<f32>,
}

impl Dev {
    fn new(s: &Arc<CudaStream>, me: &RankInput, k: usize, fp8: Option<&Fp8Tokens>) -> Result<Dev> {
        let idx32: Vec<i32> = me.topk_idx.iter().map(|&v| v as i32).collect();
        let (codes, scales) = match fp8 {
            Some(q) => (up(s, &q.codes)?, up(s, &q.scales)?),
            None => (up::<u8>(s, &[])?, up::<f32>(s, &[])?),
        };
        Ok(Dev {
            t: me.topk_idx.len() / k,
            k,
            x: up(s, &me.tokens)?,
            idx64: up(s, &me.topk_idx)?,
            idx32: up(s, &idx32)?,
            w: up(s, &me.topk_weights)?,
            codes,
            scales,
        })
    }

    /// Overwrites the inputs in place (same T), for graph replays.
    fn refill(&mut self, s: &Arc<CudaStream>, me: &RankInput) -> Result<()> {
        drain(s)?;
        let idx32: Vec<i32> = me.topk_idx.iter().map(|&v| v as i32).collect();
        s.memcpy_htod(&me.tokens, &mut self.x)
            .and_then(|()| s.memcpy_htod(&me.topk_idx, &mut self.idx64))
            .and_then(|()| s.memcpy_htod(&idx32, &mut self.idx32))
            .and_then(|()| s.memcpy_htod(&me.topk_weights, &mut self.w))
            .map_err(Error::cuda("htod"))?;
        drain(s)
    }
}

/// Dispatches `dev` in `layout` with `payload` (exact-length views: T may be 0).
fn dispatch(
    group: &EpGroup,
    s: &Arc<CudaStream>,
    dev: &Dev,
    c_hidden: usize,
    idx_i32: bool,
    layout: LlLayout,
    payload: Payload,
) -> Result<LlHandle> {
    let (t, k, h) = (dev.t, dev.k, c_hidden);
    let (x, w) = (dev.x.slice(0..t * h), dev.w.slice(0..t * k));
    let (i64v, i32v) = (dev.idx64.slice(0..t * k), dev.idx32.slice(0..t * k));
    let idx = if idx_i32 {
        TopkIdx::I32(&i32v)
    } else {
        TopkIdx::I64(&i64v)
    };
    let caller = matches!(payload, Payload::Caller);
    let n = if caller { t * h } else { 0 };
    let (codes, scales) = (dev.codes.slice(0..n), dev.scales.slice(0..n / 128));
    let (input, cast) = match payload {
        Payload::Bf16 => (LlInput::Bf16(&x), None),
        Payload::Cast(sc) => (LlInput::Bf16(&x), Some(sc)),
        Payload::Caller => (
            LlInput::Fp8 {
                codes: &codes,
                scales: &scales,
            },
            None,
        ),
    };
    group.ll_dispatch(
        s,
        moe_ep::LlDispatchArgs {
            x: input,
            topk_idx: idx,
            topk: k,
            topk_weights: &w,
            layout,
            cast_fp8: cast,
        },
    )
}

/// Checks every output of a dispatch against what the reference says this
/// rank receives (the counted rows only).
fn check_dispatch(
    s: &Arc<CudaStream>,
    h: &LlHandle,
    want: &LlDispatchOutput,
    hidden: usize,
    k: usize,
) -> Result<()> {
    let rows = want.num_rows;
    ensure(h.num_rows() == rows, || {
        format!("num_rows {} want {rows}", h.num_rows())
    })?;
    let (el, r) = (
        want.tokens_per_local_expert.len(),
        want.tokens_from_rank.len(),
    );
    let as_i32 = |v: &[u32]| v.iter().map(|&x| x as i32).collect::<Vec<_>>();
    first_diff(
        "tokens per local expert",
        &down(s, &h.tokens_per_local_expert(), el)?,
        &as_i32(&want.tokens_per_local_expert),
    )?;
    first_diff(
        "tokens per (expert, source)",
        &down(s, &h.tokens_per_expert_source(), el * r)?,
        &as_i32(&want.tokens_per_expert_source),
    )?;
    first_diff(
        "tokens from rank",
        &down(s, &h.tokens_from_rank(), r)?,
        &as_i32(&want.tokens_from_rank),
    )?;
    let counted = want.counted_rows();
    let want_src: Vec<i32> = want.src.iter().flat_map(|&(a, b)| [a, b]).collect();
    diff_rows("src", &down(s, &h.src(), rows * 2)?, &want_src, 2, &counted)?;
    match &want.tokens {
        LlTokens::Bf16(v) => {
            ensure(!h.is_fp8(), || "fp8 rows, want bf16".into())?;
            let got = down(s, &h.tokens().expect("bf16 rows"), rows * hidden)?;
            diff_rows("rows (bf16)", &bits(&got), &bits(v), hidden, &counted)?;
        }
        LlTokens::Fp8(q) => {
            ensure(h.is_fp8(), || "bf16 rows, want fp8".into())?;
            let codes = down(s, &h.fp8_codes().expect("fp8 rows"), rows * hidden)?;
            diff_rows("rows (fp8 codes)", &codes, &q.codes, hidden, &counted)?;
            let nb = hidden / 128;
            let sc = down(s, &h.fp8_scales().expect("fp8 scales"), rows * nb)?;
            diff_rows(
                "fp8 scales",
                &f32_bits(&sc),
                &f32_bits(&q.scales),
                nb,
                &counted,
            )?;
        }
    }
    if want.layout == LlLayout::RankMajor {
        let idx = down(s, &h.topk_local_idx().expect("rank-major"), rows * k)?;
        diff_rows("local expert ids", &idx, &want.topk_local_idx, k, &counted)?;
        let w = down(s, &h.topk_weights().expect("rank-major"), rows * k)?;
        diff_rows(
            "weights",
            &f32_bits(&w),
            &f32_bits(&want.topk_weights),
            k,
            &counted,
        )?;
    } else {
        ensure(
            h.topk_local_idx().is_none() && h.topk_weights().is_none(),
            || "expert-major handle with rank-major slots".into(),
        )?;
    }
    Ok(())
}

/// Checks a combine output against the reference's f32 emulation (bits) and
/// its exact sum (bf16 rounding).
fn check_combine(
    got: &[bf16],
    shape: &Shape,
    inputs: &[RankInput],
    m: usize,
    outs: &[Vec<bf16>],
    home: usize,
    layout: LlLayout,
) -> Result<()> {
    let emu = refr::ll_combine_emulated(shape, inputs, m, outs, home, layout)?;
    first_diff("combine vs emulated f32", &bits(got), &bits(&emu))?;
    let exact = refr::ll_combine_f64(shape, inputs, m, outs, home, layout)?;
    refr::check_close_bf16(got, &exact, 1)
        .map_err(|e| Error::InvalidState(format!("combine vs f64: {e}")))
}

fn seed_of(id: &str) -> u64 {
    1000 + id
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64))
        % 1000
}

fn table_case(id: &str, c: Case, layout: LlLayout) {
    let seed = seed_of(id);
    let test = format!("{id}::{layout:?}");
    for world in worlds(&test, 1) {
        if !c.experts.is_multiple_of(world.size) {
            eprintln!("  SKIP {test} at {world}: {} experts", c.experts);
            continue;
        }
        let f = build_fixture(&c, world.size, layout, seed).expect("the reference");
        run_ranks(world, |r| {
            run_case(r, &c, &f, layout).map_err(|e| Error::InvalidState(format!("{test}: {e}")))
        });
    }
}

/// Dispatch and combine of one case, `c.rounds` times (alternating buffer
/// sets), on one rank: every round's dispatch against the reference, the
/// first round's combine against the reference, and every later round's
/// combine bit for bit against the first's.
fn run_case(r: &Rank, c: &Case, f: &Fixture, layout: LlLayout) -> Result<()> {
    let me = &f.inputs[r.rank];
    let (h, k) = (c.hidden, c.topk);
    let group = EpGroup::new(&r.comm, ll_config(r, c.experts, h, f.m, c.sms)?)?;
    let s = &r.stream;
    let fp8 = f.fp8.as_ref().map(|q| &q[r.rank]);
    let dev = Dev::new(s, me, k, fp8)?;
    let t = dev.t;
    let y = up(s, &f.outs[r.rank])?;
    let mut out = up(s, &vec![bf16::from_bits(0x7fc1); (t * h).max(1)])?;
    let mut first: Option<Vec<u16>> = None;
    for round in 0..c.rounds {
        let hd = dispatch(&group, s, &dev, h, c.idx_i32, layout, c.payload)?;
        ensure(hd.buffer_set() == round % 2, || {
            format!("round {round} used buffer set {}", hd.buffer_set())
        })?;
        check_dispatch(s, &hd, &f.refs[r.rank], h, k)
            .map_err(|e| Error::InvalidState(format!("dispatch round {round}: {e}")))?;
        // Poisoned between rounds: a round that writes nothing is caught.
        if round > 0 && t > 0 {
            s.memcpy_htod(&vec![bf16::from_bits(0x7fc1); t * h], &mut out)
                .map_err(Error::cuda("htod"))?;
        }
        group.ll_combine(s, &hd, &y, None, &mut out)?;
        let got: Vec<bf16> = down(s, &out, t * h)?;
        match &first {
            None => {
                check_combine(&got, &f.shape, &f.inputs, f.m, &f.outs, r.rank, layout)
                    .map_err(|e| Error::InvalidState(format!("combine round {round}: {e}")))?;
                first = Some(bits(&got));
            }
            Some(b) => first_diff(&format!("combine round {round} vs round 0"), &bits(&got), b)?,
        }
    }
    group.check()?;
    r.comm.barrier(s)?;
    Ok(())
}

// ---- the other tests ----

/// A small case for the tests below.
const SMALL: Case = case(48, 1024, 4, 16);

fn small_fixture(world: usize, layout: LlLayout, payload: Payload, seed: u64) -> Fixture {
    let c = Case { payload, ..SMALL };
    build_fixture(&c, world, layout, seed).expect("the reference")
}

/// The reference's received bf16 rows of every rank: the identity experts'
/// outputs.
fn identity_outs(refs: &[LlDispatchOutput]) -> Vec<Vec<bf16>> {
    refs.iter()
        .map(|o| match &o.tokens {
            LlTokens::Bf16(v) => v.clone(),
            LlTokens::Fp8(_) => panic!("identity experts need bf16 rows"),
        })
        .collect()
}

/// Identity experts: combine reads the dispatch's own rows (the handle's
/// view), in both layouts; the result is the reference's combine of the
/// received rows (expert-major: the token's weights summed times the token;
/// rank-major: the token times the ranks it reached).
#[test]
fn identity_experts_round_trip() {
    for layout in [LlLayout::ExpertMajor, LlLayout::RankMajor] {
        let test = format!("identity_experts_round_trip::{layout:?}");
        for world in worlds(&test, 1) {
            let f = small_fixture(world.size, layout, Payload::Bf16, 21);
            let outs = identity_outs(&f.refs);
            run_ranks(world, |r| {
                let c = SMALL;
                let group = EpGroup::new(&r.comm, ll_config(r, c.experts, c.hidden, f.m, c.sms)?)?;
                let s = &r.stream;
                let dev = Dev::new(s, &f.inputs[r.rank], c.topk, None)?;
                let mut out = up(s, &vec![bf16::ZERO; (dev.t * c.hidden).max(1)])?;
                for _ in 0..3 {
                    let hd = dispatch(&group, s, &dev, c.hidden, false, layout, Payload::Bf16)?;
                    let rows = hd.tokens().expect("bf16 rows");
                    group.ll_combine(s, &hd, &rows, None, &mut out)?;
                    let got = down(s, &out, dev.t * c.hidden)?;
                    check_combine(&got, &f.shape, &f.inputs, f.m, &outs, r.rank, layout)?;
                }
                group.check()?;
                r.comm.barrier(s)
            });
        }
    }
}

/// Two batches in flight: both dispatches sent before either is waited for,
/// in different layouts and payloads, in alternating buffer sets; their
/// combines sent before either is waited for, waited in the other order.
/// A set holding a batch not yet combined refuses a third dispatch (on every
/// rank alike); after the combine it takes it.
#[test]
fn two_batches_in_flight_alternate_buffer_sets() {
    let test = "two_batches_in_flight_alternate_buffer_sets";
    for world in worlds(test, 1) {
        let fa = small_fixture(world.size, LlLayout::ExpertMajor, Payload::Bf16, 31);
        let fb = small_fixture(world.size, LlLayout::RankMajor, EXACT, 32);
        run_ranks(world, |r| {
            let c = SMALL;
            let (h, k) = (c.hidden, c.topk);
            let group = EpGroup::new(&r.comm, ll_config(r, c.experts, h, c.max_tokens, c.sms)?)?;
            let s = &r.stream;
            let da = Dev::new(s, &fa.inputs[r.rank], k, None)?;
            let db = Dev::new(s, &fb.inputs[r.rank], k, None)?;
            let (ya, yb) = (up(s, &fa.outs[r.rank])?, up(s, &fb.outs[r.rank])?);
            let mut oa = up(s, &vec![bf16::ZERO; (da.t * h).max(1)])?;
            let mut ob = up(s, &vec![bf16::ZERO; (db.t * h).max(1)])?;
            let send = |d: &Dev, layout: LlLayout, cast: Option<Fp8Scaling>| {
                let (x, w, idx) = (
                    d.x.slice(0..d.t * h),
                    d.w.slice(0..d.t * k),
                    d.idx64.slice(0..d.t * k),
                );
                group.ll_dispatch_send(
                    s,
                    moe_ep::LlDispatchArgs {
                        x: LlInput::Bf16(&x),
                        topk_idx: TopkIdx::I64(&idx),
                        topk: k,
                        topk_weights: &w,
                        layout,
                        cast_fp8: cast,
                    },
                )
            };
            for pair in 0..2 {
                let sa = send(&da, LlLayout::ExpertMajor, None)?;
                let sb = send(&db, LlLayout::RankMajor, Some(Fp8Scaling::Exact))?;
                let ha = group.ll_dispatch_wait(s, &sa)?;
                let hb = group.ll_dispatch_wait(s, &sb)?;
                ensure(ha.buffer_set() == 0 && hb.buffer_set() == 1, || {
                    format!(
                        "pair {pair}: sets {} and {}",
                        ha.buffer_set(),
                        hb.buffer_set()
                    )
                })?;
                check_dispatch(s, &ha, &fa.refs[r.rank], h, k)
                    .map_err(|e| Error::InvalidState(format!("pair {pair}, batch a: {e}")))?;
                check_dispatch(s, &hb, &fb.refs[r.rank], h, k)
                    .map_err(|e| Error::InvalidState(format!("pair {pair}, batch b: {e}")))?;
                let ca = group.ll_combine_send(s, &ha, &ya)?;
                let cb = group.ll_combine_send(s, &hb, &yb)?;
                group.ll_combine_wait(s, &cb, None, &mut ob)?;
                group.ll_combine_wait(s, &ca, None, &mut oa)?;
                let got_a = down(s, &oa, da.t * h)?;
                check_combine(
                    &got_a,
                    &fa.shape,
                    &fa.inputs,
                    fa.m,
                    &fa.outs,
                    r.rank,
                    LlLayout::ExpertMajor,
                )
                .map_err(|e| Error::InvalidState(format!("pair {pair}, batch a: {e}")))?;
                let got_b = down(s, &ob, db.t * h)?;
                check_combine(
                    &got_b,
                    &fb.shape,
                    &fb.inputs,
                    fb.m,
                    &fb.outs,
                    r.rank,
                    LlLayout::RankMajor,
                )
                .map_err(|e| Error::InvalidState(format!("pair {pair}, batch b: {e}")))?;
            }
            // Set 0 holds a batch that is not combined: a third one is refused.
            let ha = group.ll_dispatch_wait(s, &send(&da, LlLayout::ExpertMajor, None)?)?;
            let hb = group
                .ll_dispatch_wait(s, &send(&db, LlLayout::RankMajor, Some(Fp8Scaling::Exact))?)?;
            match send(&da, LlLayout::ExpertMajor, None) {
                Err(Error::InvalidState(msg)) if msg.contains("buffer set 0") => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "a third batch into an uncombined set: expected InvalidState, got {:?}",
                        other.map(|_| ())
                    )))
                }
            }
            group.ll_combine(s, &ha, &ya, None, &mut oa)?;
            group.ll_combine(s, &hb, &yb, None, &mut ob)?;
            let hc = group.ll_dispatch_wait(s, &send(&da, LlLayout::ExpertMajor, None)?)?;
            ensure(hc.buffer_set() == 0, || "the third batch's set".into())?;
            check_dispatch(s, &hc, &fa.refs[r.rank], h, k)?;
            group.ll_combine(s, &hc, &ya, None, &mut oa)?;
            let got_a = down(s, &oa, da.t * h)?;
            check_combine(
                &got_a,
                &fa.shape,
                &fa.inputs,
                fa.m,
                &fa.outs,
                r.rank,
                LlLayout::ExpertMajor,
            )?;
            group.check()?;
            r.comm.barrier(s)
        });
    }
}

/// The two-phase form (send, other work on the stream, wait) gives the
/// one-call form's bits; expert-major combine with weights of the caller's
/// (other than the dispatch's) matches the reference with those weights.
#[test]
fn two_phase_form_matches_one_call() {
    for layout in [LlLayout::ExpertMajor, LlLayout::RankMajor] {
        let test = format!("two_phase_form_matches_one_call::{layout:?}");
        for world in worlds(&test, 1) {
            let f = small_fixture(world.size, layout, POW2, 41);
            // The same routing with other weights (expert-major combine).
            let mut rng = Rng::new(42);
            let inputs_w: Vec<RankInput> = f
                .inputs
                .iter()
                .map(|i| RankInput {
                    topk_weights: i
                        .topk_weights
                        .iter()
                        .map(|_| rng.f32_unit() - 0.3)
                        .collect(),
                    ..i.clone()
                })
                .collect();
            run_ranks(world, |r| {
                let c = SMALL;
                let (h, k) = (c.hidden, c.topk);
                let group = EpGroup::new(&r.comm, ll_config(r, c.experts, h, f.m, c.sms)?)?;
                let s = &r.stream;
                let dev = Dev::new(s, &f.inputs[r.rank], k, None)?;
                let y = up(s, &f.outs[r.rank])?;
                let w2 = up(s, &inputs_w[r.rank].topk_weights)?;
                let mut scratch = s.alloc_zeros::<u8>(1 << 20).map_err(Error::cuda("alloc"))?;
                let mut out1 = up(s, &vec![bf16::ZERO; (dev.t * h).max(1)])?;
                let mut out2 = up(s, &vec![bf16::ZERO; (dev.t * h).max(1)])?;

                let hd = dispatch(&group, s, &dev, h, false, layout, POW2)?;
                check_dispatch(s, &hd, &f.refs[r.rank], h, k)?;
                group.ll_combine(s, &hd, &y, None, &mut out1)?;
                let one = down(s, &out1, dev.t * h)?;
                check_combine(&one, &f.shape, &f.inputs, f.m, &f.outs, r.rank, layout)?;

                let (x, w, idx) = (
                    dev.x.slice(0..dev.t * h),
                    dev.w.slice(0..dev.t * k),
                    dev.idx64.slice(0..dev.t * k),
                );
                let sent = group.ll_dispatch_send(
                    s,
                    moe_ep::LlDispatchArgs {
                        x: LlInput::Bf16(&x),
                        topk_idx: TopkIdx::I64(&idx),
                        topk: k,
                        topk_weights: &w,
                        layout,
                        cast_fp8: Some(Fp8Scaling::PowerOfTwo),
                    },
                )?;
                s.memset_zeros(&mut scratch)
                    .map_err(Error::cuda("memset"))?;
                let hd = group.ll_dispatch_wait(s, &sent)?;
                check_dispatch(s, &hd, &f.refs[r.rank], h, k)?;
                let cs = group.ll_combine_send(s, &hd, &y)?;
                s.memset_zeros(&mut scratch)
                    .map_err(Error::cuda("memset"))?;
                group.ll_combine_wait(s, &cs, None, &mut out2)?;
                first_diff(
                    "two-phase vs one call",
                    &bits(&down(s, &out2, dev.t * h)?),
                    &bits(&one),
                )?;

                if layout == LlLayout::ExpertMajor {
                    let hd = dispatch(&group, s, &dev, h, false, layout, POW2)?;
                    group.ll_combine(s, &hd, &y, Some(&w2), &mut out2)?;
                    let got = down(s, &out2, dev.t * h)?;
                    check_combine(&got, &f.shape, &inputs_w, f.m, &f.outs, r.rank, layout)
                        .map_err(|e| Error::InvalidState(format!("caller's weights: {e}")))?;
                }
                group.check()?;
                r.comm.barrier(s)
            });
        }
    }
}

/// Dispatch and combine captured once in a CUDA graph (identity experts,
/// both layouts), then replayed five times, each replay with new routing,
/// weights and tokens written into the same input buffers and the output
/// poisoned first: every replay matches the reference of its inputs.
#[test]
fn cuda_graph_captured_once_replayed_five_times_with_new_inputs() {
    use moe_ep::cuda::sys::CUstreamCaptureMode;
    const REPLAYS: u64 = 5;
    let c = SMALL;
    for layout in [LlLayout::ExpertMajor, LlLayout::RankMajor] {
        let test =
            format!("cuda_graph_captured_once_replayed_five_times_with_new_inputs::{layout:?}");
        for world in worlds(&test, 1) {
            let shape = shape_of(&c, world.size);
            let tpr = vec![c.tokens; world.size];
            // Input sets 0 (eager and captured), 1..=REPLAYS (replays).
            let sets: Vec<(Vec<RankInput>, Vec<Vec<bf16>>)> = (0..=REPLAYS)
                .map(|i| {
                    let inputs = workload::rank_inputs(50 + i, &shape, &tpr, c.routing);
                    let refs = dispatch_all(&shape, &inputs, c.max_tokens, layout, LlPayload::Bf16)
                        .expect("reference");
                    let outs = identity_outs(&refs);
                    (inputs, outs)
                })
                .collect();
            // Every replay's routing differs from the one before it.
            for (i, pair) in sets.windows(2).enumerate() {
                assert!(
                    (0..world.size).any(|r| pair[0].0[r].topk_idx != pair[1].0[r].topk_idx),
                    "input sets {i} and {} route alike",
                    i + 1
                );
            }
            run_ranks(world, |r| {
                let (h, k) = (c.hidden, c.topk);
                let group =
                    EpGroup::new(&r.comm, ll_config(r, c.experts, h, c.max_tokens, c.sms)?)?;
                let s = &r.stream;
                let mut dev = Dev::new(s, &sets[0].0[r.rank], k, None)?;
                let mut out = up(s, &vec![bf16::ZERO; c.tokens * h])?;
                let poison = vec![bf16::from_bits(0x7fc1); c.tokens * h];
                {
                    let hd = dispatch(&group, s, &dev, h, false, layout, Payload::Bf16)?;
                    group.ll_combine(s, &hd, &hd.tokens().expect("bf16"), None, &mut out)?;
                    let got = down(s, &out, c.tokens * h)?;
                    check_combine(
                        &got,
                        &shape,
                        &sets[0].0,
                        c.max_tokens,
                        &sets[0].1,
                        r.rank,
                        layout,
                    )
                    .map_err(|e| Error::InvalidState(format!("eager: {e}")))?;
                }
                r.comm.barrier(s)?;
                // SAFETY: the graph is launched only below, while every
                // buffer it captured and the group live; every rank launches
                // it the same number of times.
                unsafe { group.allow_graph_capture() };
                s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(Error::cuda("begin_capture"))?;
                let captured = (|| {
                    let hd = dispatch(&group, s, &dev, h, false, layout, Payload::Bf16)?;
                    group.ll_combine(s, &hd, &hd.tokens().expect("bf16"), None, &mut out)
                })();
                let graph = s
                    .end_capture(moe_ep::cuda::sys::CUgraphInstantiate_flags(0))
                    .map_err(Error::cuda("end_capture"))?;
                captured?;
                let graph = graph.ok_or_else(|| Error::InvalidState("empty graph".into()))?;
                // Instantiation may wait for the whole GPU: every rank
                // instantiates before any rank's replay waits for the others.
                r.comm.barrier(s)?;
                for (i, (inputs, outs)) in sets.iter().enumerate().skip(1) {
                    dev.refill(s, &inputs[r.rank])?;
                    s.memcpy_htod(&poison, &mut out)
                        .map_err(Error::cuda("htod"))?;
                    graph.launch().map_err(Error::cuda("graph launch"))?;
                    let got = down(s, &out, c.tokens * h)?;
                    check_combine(&got, &shape, inputs, c.max_tokens, outs, r.rank, layout)
                        .map_err(|e| Error::InvalidState(format!("replay {i}: {e}")))?;
                }
                group.check()?;
                r.comm.barrier(s)?;
                drop(graph);
                Ok(())
            });
        }
    }
}

/// Every bad argument is refused before anything is enqueued, naming it;
/// the group then works.
#[test]
fn bad_inputs_are_refused_by_name() {
    let test = "bad_inputs_are_refused_by_name";
    for world in worlds(test, 2) {
        let f = small_fixture(world.size, LlLayout::ExpertMajor, Payload::Bf16, 61);
        let fr = small_fixture(world.size, LlLayout::RankMajor, Payload::Bf16, 61);
        run_ranks(world, |r| {
            let c = SMALL;
            let (h, k, m) = (c.hidden, c.topk, c.max_tokens);
            let group = EpGroup::new(&r.comm, ll_config(r, c.experts, h, m, c.sms)?)?;
            // A hidden size fp8 does not take, and a high-throughput group.
            let odd = EpGroup::new(&r.comm, ll_config(r, c.experts, 1032, m, c.sms)?)?;
            let ht = EpGroup::new(&r.comm, r.config(c.experts, h, m)?)?;
            let s = &r.stream;
            let me = &f.inputs[r.rank];
            let dev = Dev::new(s, me, k, None)?;
            let t = dev.t;
            let x = dev.x.slice(0..t * h);
            let w = dev.w.slice(0..t * k);
            let idx = dev.idx64.slice(0..t * k);
            let big_idx = up(s, &vec![0i64; (m + 1) * k])?;
            let codes = up(s, &vec![0u8; t * h])?;
            let scales = up(s, &vec![1f32; t * h / 128])?;
            let x_odd = up(s, &vec![bf16::ZERO; t * 1032])?;
            let em = LlLayout::ExpertMajor;
            let go = |g, x, i, kk, w: &dyn DeviceRegion<f32>, cast| {
                try_dispatch(g, s, x, i, kk, w, cast)
            };
            expect_arg(
                "topk 0",
                go(&group, LlInput::Bf16(&x), TopkIdx::I64(&idx), 0, &w, None),
                "topk",
            )?;
            expect_arg(
                "topk 17",
                go(&group, LlInput::Bf16(&x), TopkIdx::I64(&idx), 17, &w, None),
                "topk",
            )?;
            let ragged = dev.idx64.slice(0..t * k - 1);
            expect_arg(
                "ragged topk_idx",
                go(
                    &group,
                    LlInput::Bf16(&x),
                    TopkIdx::I64(&ragged),
                    k,
                    &w,
                    None,
                ),
                "topk_idx",
            )?;
            let big_w = up(s, &vec![0f32; (m + 1) * k])?;
            let big_x = up(s, &vec![bf16::ZERO; (m + 1) * h])?;
            expect_arg(
                "T > max_tokens_per_rank",
                go(
                    &group,
                    LlInput::Bf16(&big_x),
                    TopkIdx::I64(&big_idx),
                    k,
                    &big_w,
                    None,
                ),
                "topk_idx",
            )?;
            let short_w = dev.w.slice(0..t * k - 1);
            expect_arg(
                "short topk_weights",
                go(
                    &group,
                    LlInput::Bf16(&x),
                    TopkIdx::I64(&idx),
                    k,
                    &short_w,
                    None,
                ),
                "topk_weights",
            )?;
            let short_x = dev.x.slice(0..t * h - 8);
            expect_arg(
                "short x",
                go(
                    &group,
                    LlInput::Bf16(&short_x),
                    TopkIdx::I64(&idx),
                    k,
                    &w,
                    None,
                ),
                "x",
            )?;
            let short_codes = codes.slice(0..t * h - 16);
            expect_arg(
                "short fp8 codes",
                go(
                    &group,
                    LlInput::Fp8 {
                        codes: &short_codes,
                        scales: &scales,
                    },
                    TopkIdx::I64(&idx),
                    k,
                    &w,
                    None,
                ),
                "x",
            )?;
            let short_scales = scales.slice(0..t * h / 128 - 1);
            expect_arg(
                "short fp8 scales",
                go(
                    &group,
                    LlInput::Fp8 {
                        codes: &codes,
                        scales: &short_scales,
                    },
                    TopkIdx::I64(&idx),
                    k,
                    &w,
                    None,
                ),
                "x_scales",
            )?;
            expect_arg(
                "fp8 input cast again",
                go(
                    &group,
                    LlInput::Fp8 {
                        codes: &codes,
                        scales: &scales,
                    },
                    TopkIdx::I64(&idx),
                    k,
                    &w,
                    Some(Fp8Scaling::Exact),
                ),
                "cast_fp8",
            )?;
            expect_arg(
                "fp8 cast of hidden 1032",
                go(
                    &odd,
                    LlInput::Bf16(&x_odd),
                    TopkIdx::I64(&idx),
                    k,
                    &w,
                    Some(Fp8Scaling::Exact),
                ),
                "hidden",
            )?;
            let odd_codes = up(s, &vec![0u8; t * 1032])?;
            expect_arg(
                "fp8 rows of hidden 1032",
                go(
                    &odd,
                    LlInput::Fp8 {
                        codes: &odd_codes,
                        scales: &scales,
                    },
                    TopkIdx::I64(&idx),
                    k,
                    &w,
                    None,
                ),
                "hidden",
            )?;
            expect_arg(
                "a high-throughput group",
                go(&ht, LlInput::Bf16(&x), TopkIdx::I64(&idx), k, &w, None),
                "mode",
            )?;

            // Combine.
            let batch = |layout| {
                group.ll_dispatch(
                    s,
                    moe_ep::LlDispatchArgs {
                        x: LlInput::Bf16(&x),
                        topk_idx: TopkIdx::I64(&idx),
                        topk: k,
                        topk_weights: &w,
                        layout,
                        cast_fp8: None,
                    },
                )
            };
            let hd = batch(em)?;
            check_dispatch(s, &hd, &f.refs[r.rank], h, k)?;
            let y = up(s, &f.outs[r.rank])?;
            let short_y = y.slice(0..hd.num_rows() * h - 8);
            let mut out = up(s, &vec![bf16::ZERO; t * h])?;
            let mut short_out = up(s, &vec![bf16::ZERO; t * h - 8])?;
            let short_cw = dev.w.slice(0..t * k - 1);
            expect_arg(
                "short expert_out",
                group.ll_combine(s, &hd, &short_y, None, &mut out),
                "expert_out",
            )?;
            expect_arg(
                "short out",
                group.ll_combine(s, &hd, &y, None, &mut short_out),
                "out",
            )?;
            expect_arg(
                "short weights",
                group.ll_combine(s, &hd, &y, Some(&short_cw), &mut out),
                "weights",
            )?;
            expect_arg(
                "another group's handle",
                odd.ll_combine(s, &hd, &y, None, &mut out),
                "handle",
            )?;
            // The first refusal told every home and spent the batch (no
            // second signal of its number may follow): the corrected retry
            // is refused by state, and the group runs the next batch.
            match group.ll_combine(s, &hd, &y, None, &mut out) {
                Err(Error::InvalidState(m)) if m.contains("Refused") => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "the retry of a refused combine: {:?}",
                        other.err()
                    )))
                }
            }
            // Every rank refused the same call: nothing is out of step.
            group.check()?;
            let hd = batch(em)?;
            check_dispatch(s, &hd, &f.refs[r.rank], h, k)?;
            group.ll_combine(s, &hd, &y, None, &mut out)?;
            check_combine(
                &down(s, &out, t * h)?,
                &f.shape,
                &f.inputs,
                m,
                &f.outs,
                r.rank,
                em,
            )?;
            match group.ll_combine(s, &hd, &y, None, &mut out) {
                Err(Error::InvalidState(_)) => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "a second combine of one batch: {:?}",
                        other.err()
                    )))
                }
            }
            // Rank-major combine takes no weights (refused: the batch is
            // spent, the next one takes the corrected call).
            let spent = batch(LlLayout::RankMajor)?;
            let yr = up(s, &fr.outs[r.rank])?;
            expect_arg(
                "rank-major weights",
                group.ll_combine(s, &spent, &yr, Some(&w), &mut out),
                "weights",
            )?;
            group.check()?;
            let hr = batch(LlLayout::RankMajor)?;
            group.ll_combine(s, &hr, &yr, None, &mut out)?;
            check_combine(
                &down(s, &out, t * h)?,
                &fr.shape,
                &fr.inputs,
                m,
                &fr.outs,
                r.rank,
                LlLayout::RankMajor,
            )?;
            // The spent batch's set takes the next batch: its handle is stale.
            let h3 = batch(em)?;
            ensure(h3.buffer_set() == spent.buffer_set(), || "set reuse".into())?;
            expect_arg(
                "a stale handle",
                group.ll_combine(s, &spent, &y, None, &mut out),
                "handle",
            )?;
            group.ll_combine(s, &h3, &y, None, &mut out)?;
            check_combine(
                &down(s, &out, t * h)?,
                &f.shape,
                &f.inputs,
                m,
                &f.outs,
                r.rank,
                em,
            )?;
            group.check()?;
            r.comm.barrier(s)
        });
    }
}

/// An expert-major dispatch whose handle is dropped (the refusals above).
fn try_dispatch(
    g: &EpGroup,
    s: &Arc<CudaStream>,
    x: LlInput<'_>,
    idx: TopkIdx<'_>,
    k: usize,
    w: &dyn DeviceRegion<f32>,
    cast: Option<Fp8Scaling>,
) -> Result<()> {
    g.ll_dispatch(
        s,
        moe_ep::LlDispatchArgs {
            x,
            topk_idx: idx,
            topk: k,
            topk_weights: w,
            layout: LlLayout::ExpertMajor,
            cast_fp8: cast,
        },
    )
    .map(|_| ())
}

/// Runs one bf16 expert-major round trip on `group` against `f` (after an
/// error was reported and cleared).
fn round_trip(r: &Rank, group: &EpGroup, f: &Fixture) -> Result<()> {
    let c = SMALL;
    let s = &r.stream;
    let dev = Dev::new(s, &f.inputs[r.rank], c.topk, None)?;
    let hd = dispatch(
        group,
        s,
        &dev,
        c.hidden,
        false,
        LlLayout::ExpertMajor,
        Payload::Bf16,
    )?;
    let y = up(s, &f.outs[r.rank])?;
    let mut out = up(s, &vec![bf16::ZERO; (dev.t * c.hidden).max(1)])?;
    group.ll_combine(s, &hd, &y, None, &mut out)?;
    let got = down(s, &out, dev.t * c.hidden)?;
    group.check()?;
    check_combine(
        &got,
        &f.shape,
        &f.inputs,
        f.m,
        &f.outs,
        r.rank,
        LlLayout::ExpertMajor,
    )
}

/// An expert id out of range on rank 0, then one repeated in a token: every
/// rank reports it at `check` (naming rank 0, the token and the slot) with
/// no rank waiting for the timeout, and the group works after it.
#[test]
fn bad_expert_id_is_reported_on_every_rank() {
    let test = "bad_expert_id_is_reported_on_every_rank";
    for world in worlds(test, 2) {
        let f = small_fixture(world.size, LlLayout::ExpertMajor, Payload::Bf16, 71);
        run_ranks(world, |r| {
            let c = SMALL;
            let (h, k, e) = (c.hidden, c.topk, c.experts);
            let mut cfg = ll_config(r, e, h, c.max_tokens, c.sms)?;
            cfg.timeout = Duration::from_secs(20);
            let group = EpGroup::new(&r.comm, cfg)?;
            let s = &r.stream;
            let me = &f.inputs[r.rank];
            for (bad, want) in [
                ((e + 3) as i64, "token 2 slot 1: expert id"),
                (-2, "token 2 slot 1: expert id -2"),
                (-7, "appears twice"),
            ] {
                let mut idx = me.topk_idx.clone();
                if r.rank == 0 {
                    // Slot 1 of token 2; -7 stands for "slot 0's expert again"
                    // (uniform routing: slot 0 is an expert).
                    idx[2 * k + 1] = if bad == -7 { idx[2 * k] } else { bad };
                }
                let d_idx = up(s, &idx)?;
                let dev = Dev::new(s, me, k, None)?;
                let (x, w) = (dev.x.slice(0..dev.t * h), dev.w.slice(0..dev.t * k));
                let y = up(s, &f.outs[r.rank])?;
                let mut out = up(s, &vec![bf16::ZERO; dev.t * h])?;
                r.comm.barrier(s)?;
                let since = std::time::Instant::now();
                let res = (|| {
                    let hd = group.ll_dispatch(
                        s,
                        moe_ep::LlDispatchArgs {
                            x: LlInput::Bf16(&x),
                            topk_idx: TopkIdx::I64(&d_idx),
                            topk: k,
                            topk_weights: &w,
                            layout: LlLayout::ExpertMajor,
                            cast_fp8: None,
                        },
                    )?;
                    group.ll_combine(s, &hd, &y, None, &mut out)?;
                    group.check()
                })();
                // The op after the dispatch may refuse with the error, or
                // check reports it: either way, then check clears it.
                let res = match res {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let _ = group.check();
                        Err(e)
                    }
                };
                match &res {
                    Err(Error::InvalidDeviceData { arg: "topk_idx", detail })
                        if detail.contains("rank 0") && detail.contains(want) => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "bad id {bad}: expected InvalidDeviceData for topk_idx ({want}), got {other:?}"
                        )))
                    }
                }
                ensure(since.elapsed() < Duration::from_secs(5), || {
                    format!(
                        "the error took {:?}: a rank waited for a timeout",
                        since.elapsed()
                    )
                })?;
                group.check()?;
                r.comm.barrier(s)?;
            }
            round_trip(r, &group, &f)?;
            r.comm.barrier(s)
        });
    }
}

/// Ranks that disagree on the layout, the payload or topk: every rank
/// refuses, naming the field, without waiting for the timeout; the group
/// works after `check`.
#[test]
fn batch_that_differs_between_ranks_is_refused_everywhere() {
    let test = "batch_that_differs_between_ranks_is_refused_everywhere";
    for world in worlds(test, 2) {
        let f = small_fixture(world.size, LlLayout::ExpertMajor, Payload::Bf16, 81);
        run_ranks(world, |r| {
            let c = SMALL;
            let (h, e) = (c.hidden, c.experts);
            let mut cfg = ll_config(r, e, h, c.max_tokens, c.sms)?;
            cfg.timeout = Duration::from_secs(20);
            let group = EpGroup::new(&r.comm, cfg)?;
            let s = &r.stream;
            let odd = r.rank == r.world - 1;
            let (em, rm) = (LlLayout::ExpertMajor, LlLayout::RankMajor);
            for (field, k, layout, cast) in [
                ("layout", 4, if odd { rm } else { em }, None),
                (
                    "payload (bf16 or fp8 rows)",
                    4,
                    em,
                    if odd { Some(Fp8Scaling::Exact) } else { None },
                ),
                ("topk", if odd { 2 } else { 4 }, em, None),
            ] {
                let t = c.tokens;
                // Token t's experts t, t + 3, t + 6, ... (mod e): all distinct.
                let idx: Vec<i64> = (0..t * k)
                    .map(|i| ((i / k + (i % k) * 3) % e) as i64)
                    .collect();
                let d_idx = up(s, &idx)?;
                let x = up(s, &vec![bf16::ONE; t * h])?;
                let w = up(s, &vec![0.5f32; t * k])?;
                r.comm.barrier(s)?;
                let since = std::time::Instant::now();
                let res = (|| {
                    let _hd = group.ll_dispatch(
                        s,
                        moe_ep::LlDispatchArgs {
                            x: LlInput::Bf16(&x),
                            topk_idx: TopkIdx::I64(&d_idx),
                            topk: k,
                            topk_weights: &w,
                            layout,
                            cast_fp8: cast,
                        },
                    )?;
                    group.check()
                })();
                match &res {
                    Err(Error::InvalidArgument { arg, expected, .. })
                        if *arg == field && expected.contains("the same value on every rank") => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "{field} differing on rank {}: expected InvalidArgument naming `{field}`, got {other:?}",
                            r.world - 1
                        )))
                    }
                }
                ensure(since.elapsed() < Duration::from_secs(5), || {
                    format!("{field}: the error took {:?}", since.elapsed())
                })?;
                group.check()?;
                r.comm.barrier(s)?;
            }
            round_trip(r, &group, &f)?;
            r.comm.barrier(s)
        });
    }
}

/// A peer that never dispatches, then (a new group) one that never
/// combines: each wait is bounded and the error names the rank, the peer
/// and the counter; the group refuses further work.
#[test]
fn stalled_peer_times_out_with_rank_and_counter() {
    let test = "stalled_peer_times_out_with_rank_and_counter";
    for world in worlds(test, 2) {
        let f = small_fixture(world.size, LlLayout::ExpertMajor, Payload::Bf16, 91);
        run_ranks(world, |r| {
            let c = SMALL;
            let (h, k) = (c.hidden, c.topk);
            let mut cfg = ll_config(r, c.experts, h, c.max_tokens, c.sms)?;
            cfg.timeout = Duration::from_millis(300);
            let s = &r.stream;
            let dev = Dev::new(s, &f.inputs[r.rank], k, None)?;
            let y = up(s, &f.outs[r.rank])?;
            let mut out = up(s, &vec![bf16::ZERO; dev.t * h])?;
            let expect_timeout = |res: Result<()>, counter: &str| match res {
                Err(Error::PeerTimeout {
                    rank: 0,
                    peer,
                    counter: c,
                    ..
                }) if peer != 0 && c == counter => Ok(()),
                other => Err(Error::InvalidState(format!(
                    "expected PeerTimeout on {counter}, got {other:?}"
                ))),
            };
            // 1. Only rank 0 dispatches.
            {
                let group = EpGroup::new(&r.comm, cfg.clone())?;
                drain(s)?;
                r.comm.barrier(s)?;
                if r.rank == 0 {
                    let _hd = dispatch(
                        &group,
                        s,
                        &dev,
                        h,
                        false,
                        LlLayout::ExpertMajor,
                        Payload::Bf16,
                    )?;
                    expect_timeout(group.check(), "low-latency dispatch")?;
                    match dispatch(
                        &group,
                        s,
                        &dev,
                        h,
                        false,
                        LlLayout::ExpertMajor,
                        Payload::Bf16,
                    ) {
                        Err(Error::InvalidState(_)) => {}
                        other => {
                            return Err(Error::InvalidState(format!(
                                "a poisoned group accepted work: {:?}",
                                other.err()
                            )))
                        }
                    }
                }
                // The peers keep their groups (rank 0 wrote into them) until here.
                r.comm.barrier(s)?;
            }
            // 2. Everyone dispatches; only rank 0 combines.
            {
                let group = EpGroup::new(&r.comm, cfg)?;
                let hd = dispatch(
                    &group,
                    s,
                    &dev,
                    h,
                    false,
                    LlLayout::ExpertMajor,
                    Payload::Bf16,
                )?;
                drain(s)?;
                r.comm.barrier(s)?;
                if r.rank == 0 {
                    group.ll_combine(s, &hd, &y, None, &mut out)?;
                    expect_timeout(group.check(), "low-latency combine")?;
                }
                r.comm.barrier(s)?;
            }
            Ok(())
        });
    }
}
