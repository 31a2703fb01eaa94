//! GPU tests of the NVLink path (`multi-gpu`; written for any world size >= 2).
//!
//! Every test runs on real GPUs when there are at least two, and on virtual
//! ranks on GPU 0 at world 2, 4 and 8 otherwise (`moe_ep::testkit::ranks`
//! says how to choose). Each case of the table is two tests,
//! `<case id>::rank_major` and `<case id>::expert_major`, that run layout,
//! dispatch, combine and both backward passes on every rank and check them
//! against the CPU reference: dispatch bit for bit, combine bit for bit
//! against the reference's emulation of the kernel's f32 arithmetic *and*
//! within bf16 rounding of the exact f64 sum, and the same bits over 10 runs.
//! `cargo test --features multi-gpu uniform_t4096` runs one case.
#![cfg(feature = "multi-gpu")]

use std::sync::Arc;
use std::time::Duration;

use moe_ep::cuda::{CudaSlice, CudaStream};
use moe_ep::ops::{DeviceRegion, DispatchOut, TopkIdx};
use moe_ep::reference::{self as refr, RankInput, Shape};
use moe_ep::testkit::ranks::{ensure, run_ranks, run_worlds, worlds, Rank};
use moe_ep::testkit::workload::{self, Rng, Routing};
use moe_ep::{bf16, EpGroup, Error, GroupConfig, RecvLayout, Result};

#[macro_use]
#[path = "common/cases.rs"]
mod cases;
#[path = "common/device.rs"]
mod device;
use cases::{case, Case};
use device::{bits, down, drain, first_diff, hold, up, up_len, weights_per_row};

/// The case table: one module per case, named by the case's id, with a test
/// per receive layout. Each test first checks that its name is the id its
/// fields give.
macro_rules! case_table {
    ($($id:ident = $case:expr;)+) => {
        $(
            mod $id {
                use super::*;
                #[test]
                fn rank_major() {
                    table_case(stringify!($id), $case, RecvLayout::RankMajor);
                }
                #[test]
                fn expert_major() {
                    table_case(stringify!($id), $case, RecvLayout::ExpertMajor { alignment: 16 });
                }
            }
        )+
    };
}

with_case_table!(case_table);

fn table_case(id: &str, c: Case, layout: RecvLayout) {
    assert_eq!(
        id,
        c.id(),
        "the test's name must be the id of its case's fields"
    );
    // A seed per case, the same for both layouts.
    let seed = 1000
        + id.bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64))
            % 1000;
    let test = format!("{id}::{layout:?}");
    for world in worlds(&test, 2) {
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

/// What every rank of a case needs of the reference: computed once per
/// world (one thread per destination rank), shared by all ranks.
struct Fixture {
    shape: Shape,
    inputs: Vec<RankInput>,
    /// What each rank receives.
    refs: Vec<refr::DispatchOutput>,
    counts: refr::Counts,
    /// Expert outputs, weight gradients (`[rows * wpr]`) and output
    /// gradients of every rank.
    outs: Vec<Vec<bf16>>,
    gw_rows: Vec<Vec<f32>>,
    grads: Vec<Vec<bf16>>,
    /// The largest receive count of any rank (the group's capacity).
    cap: usize,
}

fn build_fixture(c: &Case, world: usize, layout: RecvLayout, seed: u64) -> Result<Fixture> {
    let shape = shape_of(c, world);
    let tpr = tokens_per_rank(c, world);
    let inputs = workload::rank_inputs(seed, &shape, &tpr, c.routing);
    let wpr = weights_per_row(layout, c.topk);
    // Per destination: what it receives, its expert outputs, weight and output gradients.
    type PerRank = (refr::DispatchOutput, Vec<bf16>, Vec<f32>, Vec<bf16>);
    let per_rank: Vec<Result<PerRank>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|d| {
                let (shape, inputs, tpr) = (&shape, &inputs, &tpr);
                s.spawn(move || {
                    let o = refr::dispatch(shape, inputs, d, layout)?;
                    let out = expert_out(seed, d, o.num_rows, c.hidden);
                    let mut rng = Rng::new(seed ^ (0x6A0 + d as u64));
                    let gw = (0..o.num_rows * wpr)
                        .map(|_| rng.f32_unit() - 0.5)
                        .collect();
                    let g = workload::tokens(
                        &mut Rng::new(seed ^ (0x9B0 + d as u64)),
                        tpr[d],
                        c.hidden,
                    );
                    Ok((o, out, gw, g))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("reference thread"))
            .collect()
    });
    let (mut refs, mut outs, mut gw_rows, mut grads) = (vec![], vec![], vec![], vec![]);
    for p in per_rank {
        let (o, out, gw, g) = p?;
        refs.push(o);
        outs.push(out);
        gw_rows.push(gw);
        grads.push(g);
    }
    let layouts: Vec<refr::Layout> = inputs
        .iter()
        .map(|i| refr::layout(&shape, &i.topk_idx))
        .collect::<Result<_>>()?;
    let counts = refr::gather_counts(&shape, &layouts);
    let cap = refs.iter().map(|o| o.num_rows).max().unwrap_or(0).max(1);
    Ok(Fixture {
        shape,
        inputs,
        refs,
        counts,
        outs,
        gw_rows,
        grads,
        cap,
    })
}

/// Random expert outputs of rank `d` (`rows` x hidden), the same on every rank.
fn expert_out(seed: u64, d: usize, rows: usize, hidden: usize) -> Vec<bf16> {
    workload::tokens(&mut Rng::new(seed ^ (0xE0 + d as u64)), rows, hidden)
}

/// One rank's tokens, top-k weights and top-k ids on the device.
fn upload(
    s: &Arc<CudaStream>,
    me: &RankInput,
) -> Result<(CudaSlice<bf16>, CudaSlice<f32>, CudaSlice<i64>)> {
    Ok((
        up(s, &me.tokens)?,
        up(s, &me.topk_weights)?,
        up(s, &me.topk_idx)?,
    ))
}

/// Combine's bits when every expert is the identity and combine reads the
/// received rows themselves (rank-major): each token times the number of
/// ranks it reached.
fn identity_combine(shape: &Shape, me: &RankInput) -> Result<Vec<u16>> {
    let (world, h) = (shape.num_ranks, shape.hidden);
    let l = refr::layout(shape, &me.topk_idx)?;
    Ok((0..me.tokens.len())
        .map(|i| {
            let t = i / h;
            let n = (0..world)
                .filter(|&d| l.is_token_in_rank[t * world + d])
                .count();
            bf16::from_f64(me.tokens[i].to_f64() * n as f64).to_bits()
        })
        .collect())
}

/// A group config of the case on this world (its SMs capped to what fits).
fn case_config(r: &Rank, c: &Case, cap: usize) -> Result<GroupConfig> {
    let mut cfg = GroupConfig::new(c.experts, c.hidden, c.tokens.max(1));
    cfg.recv_capacity = cap;
    cfg.timeout = Duration::from_secs(10);
    cfg.combine_chunks = c.chunks;
    cfg.num_sms = r.sms(c.sms, c.experts)?;
    if r.rank == 0 && cfg.num_sms != c.sms {
        eprintln!(
            "  num_sms {} -> {} ({} ranks share one GPU)",
            c.sms, cfg.num_sms, r.world
        );
    }
    Ok(cfg)
}

/// The whole forward and backward of one case and one layout on one rank.
fn run_case(r: &Rank, c: &Case, f: &Fixture, layout: RecvLayout) -> Result<()> {
    run_case_then(r, c, f, layout, || Ok(()))
}

/// [`run_case`], with `before_drop` run after the last check, while the
/// case's group and buffers are still alive.
fn run_case_then(
    r: &Rank,
    c: &Case,
    f: &Fixture,
    layout: RecvLayout,
    before_drop: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let (shape, inputs) = (&f.shape, &f.inputs);
    let me = &inputs[r.rank];
    let (h, k) = (c.hidden, c.topk);
    let t = me.topk_idx.len() / k;
    let cap = f.cap;
    let group = EpGroup::new(&r.comm, case_config(r, c, cap)?)?;
    let s = &r.stream;

    // Exact-length views: T may be 0 (`up` keeps one element for empty input).
    let (x_buf, w_buf) = (up(s, &me.tokens)?, up(s, &me.topk_weights)?);
    let (x, w) = (x_buf.slice(0..t * h), w_buf.slice(0..t * k));
    let idx64_buf = up(s, &me.topk_idx)?;
    let idx32_buf = up(
        s,
        &me.topk_idx.iter().map(|&v| v as i32).collect::<Vec<_>>(),
    )?;
    let (idx64, idx32) = (idx64_buf.slice(0..t * k), idx32_buf.slice(0..t * k));
    let idx = if c.idx_i32 {
        TopkIdx::I32(&idx32)
    } else {
        TopkIdx::I64(&idx64)
    };
    let handle = group.layout(s, idx, k, layout)?;
    if matches!(layout, RecvLayout::ExpertMajor { .. }) {
        // Before its dispatch an expert-major handle has no rows to combine.
        let (y0, mut out0) = (up_len::<bf16>(s, &[], 1)?, up_len::<bf16>(s, &[], 1)?);
        match group.combine(s, &handle, &y0, None, &mut out0) {
            Err(Error::InvalidState(m)) if m.contains("needs a dispatch") => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "expert-major combine before any dispatch: expected InvalidState, got {other:?}"
                )))
            }
        }
    }

    // Counts, on the host on request.
    let hc = handle.host_counts(s)?;
    let want = &f.refs[r.rank];
    first_diff("rank counts", &hc.rank_counts, &f.counts.rank)?;
    first_diff("expert counts", &hc.expert_counts, &f.counts.expert)?;
    ensure(hc.recv_rows == want.num_rows, || {
        format!("recv rows {} want {}", hc.recv_rows, want.num_rows)
    })?;
    let tple: Vec<usize> = want
        .tokens_per_local_expert
        .iter()
        .map(|&v| v as usize)
        .collect();
    first_diff(
        "tokens per local expert",
        &hc.tokens_per_local_expert,
        &tple,
    )?;

    // Dispatch, pool buffers: bit for bit.
    let got = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
    let rows = want.num_rows;
    let wpr = weights_per_row(layout, k);
    first_diff(
        "dispatch tokens",
        &bits(&down(s, &got.tokens, rows * h)?),
        &bits(&want.tokens),
    )?;
    first_diff(
        "dispatch weights",
        &down(s, &got.topk_weights, rows * wpr)?
            .iter()
            .map(|f| f.to_bits())
            .collect::<Vec<_>>(),
        &want
            .topk_weights
            .iter()
            .map(|f| f.to_bits())
            .collect::<Vec<_>>(),
    )?;
    first_diff(
        "dispatch expert ids",
        &down(s, &got.topk_idx, rows * wpr)?,
        &want.topk_local_idx,
    )?;
    let src = down(s, &got.src, rows * 2)?;
    let want_src: Vec<i32> = want.src.iter().flat_map(|&(a, b)| [a, b]).collect();
    first_diff("dispatch source", &src, &want_src)?;
    group.check()?;

    // Combine: unweighted, and weighted by the received weights (expert-major).
    let outs = &f.outs;
    let y = up_len(s, &outs[r.rank], cap * h)?;
    let mut out = s
        .alloc_zeros::<bf16>((t * h).max(1))
        .map_err(Error::cuda("alloc"))?;
    let weightings: &[bool] = if matches!(layout, RecvLayout::RankMajor) {
        &[false]
    } else {
        &[false, true]
    };
    for &weighted in weightings {
        let wts: Option<&dyn DeviceRegion<f32>> = if weighted {
            Some(&got.topk_weights)
        } else {
            None
        };
        group.combine(s, &handle, &y, wts, &mut out)?;
        let first = bits(&down(s, &out, t * h)?);
        let emu = refr::combine_emulated(shape, inputs, outs, r.rank, layout, weighted)?;
        first_diff(
            &format!("combine (weighted={weighted}) vs emulated f32"),
            &first,
            &bits(&emu),
        )?;
        let exact = refr::combine_f64(shape, inputs, outs, r.rank, layout, weighted)?;
        let got_bf: Vec<bf16> = first.iter().map(|&b| bf16::from_bits(b)).collect();
        refr::check_close_bf16(&got_bf, &exact, r.world)
            .map_err(|e| Error::InvalidState(format!("combine vs f64: {e}")))?;
        for run in 1..10 {
            group.combine(s, &handle, &y, wts, &mut out)?;
            ensure(bits(&down(s, &out, t * h)?) == first, || {
                format!("combine run {run} differs from run 0")
            })?;
        }
        if matches!(layout, RecvLayout::RankMajor) {
            // The same expert outputs in symmetric memory: each home reads
            // them in place (pull path), with the push path's bits.
            let mut ys = group.pool().alloc::<bf16>(cap * h)?;
            let mut out2 = up(s, &vec![bf16::from_bits(0x7fc1); (t * h).max(1)])?;
            ys.copy_from_device(s, &y)?;
            for run in 0..3 {
                group.combine(s, &handle, &ys, None, &mut out2)?;
                first_diff(
                    &format!("combine from symmetric memory (pull), run {run}, vs plain (push)"),
                    &bits(&down(s, &out2, t * h)?),
                    &first,
                )?;
            }
        }
    }
    group.check()?;

    // Dispatch backward: gradient rows combined home, weight gradients routed back.
    let gw_rows = &f.gw_rows;
    let gw_in = up_len(s, &gw_rows[r.rank], cap * wpr)?;
    let mut grad_x = s
        .alloc_zeros::<bf16>((t * h).max(1))
        .map_err(Error::cuda("alloc"))?;
    let mut grad_w = s
        .alloc_zeros::<f32>((t * k).max(1))
        .map_err(Error::cuda("alloc"))?;
    let (want_gx, want_gw) = refr::dispatch_backward(shape, inputs, outs, gw_rows, r.rank, layout)?;
    let want_gw_bits: Vec<u32> = want_gw.iter().map(|f| f.to_bits()).collect();
    group.dispatch_backward(
        s,
        &handle,
        moe_ep::DispatchBackwardArgs {
            grad_recv_tokens: &y,
            grad_recv_topk_weights: Some(&gw_in),
            grad_tokens: &mut grad_x,
            grad_topk_weights: Some(&mut grad_w),
        },
    )?;
    let check_backward =
        |how: &str, grad_x: &CudaSlice<bf16>, grad_w: &CudaSlice<f32>| -> Result<()> {
            first_diff(
                &format!("dispatch_backward grad tokens ({how})"),
                &bits(&down(s, grad_x, t * h)?),
                &bits(&want_gx),
            )?;
            first_diff(
                &format!("dispatch_backward grad weights ({how})"),
                &down(s, grad_w, t * k)?
                    .iter()
                    .map(|f| f.to_bits())
                    .collect::<Vec<_>>(),
                &want_gw_bits,
            )
        };
    check_backward("plain memory: pushed", &grad_x, &grad_w)?;
    if matches!(layout, RecvLayout::RankMajor) {
        // Both gradients in symmetric memory: read in place (pull).
        let mut ys = group.pool().alloc::<bf16>(cap * h)?;
        let mut gws = group.pool().alloc::<f32>(cap * wpr)?;
        ys.copy_from_device(s, &y)?;
        gws.copy_from_device(s, &gw_in)?;
        // Poison the outputs (all bits set) so that unwritten elements fail.
        drain(s)?;
        s.memcpy_htod(&vec![bf16::from_bits(0xffff); grad_x.len()], &mut grad_x)
            .map_err(Error::cuda("htod"))?;
        s.memcpy_htod(&vec![f32::from_bits(u32::MAX); grad_w.len()], &mut grad_w)
            .map_err(Error::cuda("htod"))?;
        group.dispatch_backward(
            s,
            &handle,
            moe_ep::DispatchBackwardArgs {
                grad_recv_tokens: &ys,
                grad_recv_topk_weights: Some(&gws),
                grad_tokens: &mut grad_x,
                grad_topk_weights: Some(&mut grad_w),
            },
        )?;
        check_backward("symmetric memory: pulled", &grad_x, &grad_w)?;
    }

    // Combine backward: the output gradient dispatched (scaled when weighted).
    let grads = &f.grads;
    let g_buf = up(s, &grads[r.rank])?;
    let g = g_buf.slice(0..t * h);
    for &weighted in weightings {
        let wts: Option<&dyn DeviceRegion<f32>> = if weighted {
            Some(&got.topk_weights)
        } else {
            None
        };
        let gx = group.combine_backward(s, &handle, &g, wts, None)?;
        let want_g = refr::combine_backward(shape, inputs, grads, r.rank, layout, weighted)?;
        first_diff(
            &format!("combine_backward (weighted={weighted})"),
            &bits(&down(s, &gx, rows * h)?),
            &bits(&want_g),
        )?;
    }
    group.check()?;
    r.comm.barrier(s)?;
    before_drop()
}

/// A small case for the single-purpose tests below (name, tokens, hidden,
/// top-k, experts, routing).
const fn small(
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    routing: Routing,
) -> Case {
    case(tokens, hidden, topk, experts, routing)
}

/// Caller-supplied receive buffers are written in place (zero copy); the
/// pool supplies them when none are given; a plain allocation is refused
/// with NotSymmetric; over-capacity is reported and writes nothing.
/// A world split into nodes (`Communicator::split`, color rank / G): every
/// node runs its own group of G ranks, side by side with the other nodes'
/// on the same GPU(s), and each gets, bit for bit, what a world of G ranks
/// gets (the table case's every check). The inter-node path forwards inside
/// a node over such a group.
#[test]
fn split_world_runs_one_group_per_node() {
    let test = "split_world_runs_one_group_per_node";
    let c = case(127, 2048, 8, 64, Routing::Uniform);
    for world in worlds(test, 4) {
        let mut per_node: Vec<usize> = vec![2, world.size / 2];
        per_node.dedup();
        for g in per_node {
            if g < 2 || !world.size.is_multiple_of(g) || g == world.size {
                continue;
            }
            for layout in [
                RecvLayout::RankMajor,
                RecvLayout::ExpertMajor { alignment: 16 },
            ] {
                let f = build_fixture(&c, g, layout, 77).expect("the reference");
                run_ranks(world, |r| {
                    let node = r.comm.split(&r.stream, r.rank / g)?;
                    ensure(node.world() == g && node.rank() == r.rank % g, || {
                        format!(
                            "rank {} of {}: node communicator {} of {}, want {} of {g}",
                            r.rank,
                            r.world,
                            node.rank(),
                            node.world(),
                            r.rank % g
                        )
                    })?;
                    let sub = Rank {
                        rank: node.rank(),
                        world: g,
                        ranks: r.ranks,
                        ctx: r.ctx.clone(),
                        stream: r.stream.clone(),
                        stream2: r.stream2.clone(),
                        comm: node,
                    };
                    // Every node's group is dropped only when all nodes are
                    // done: the last drop of a virtual segment frees it with
                    // cuMemFree, which waits for the whole GPU. Without the
                    // barrier, a node still at work timed out waiting for a
                    // peer's next launch in 6 of 10 runs (2 x 2, 4 x 2,
                    // 2 x 4; one H200, 2026-12-01); with it, 3 of 3 passed.
                    let parent = r.comm.clone();
                    let all_done = || parent.barrier(&r.stream);
                    run_case_then(&sub, &c, &f, layout, all_done).map_err(|e| {
                        Error::InvalidState(format!(
                            "{test}: {} nodes x {g}, node {}, {layout:?}: {e}",
                            world.size / g,
                            r.rank / g
                        ))
                    })
                });
                eprintln!("    {} nodes x {g} ranks, {layout:?}: ok", world.size / g);
            }
        }
    }
}

#[test]
fn caller_buffers_zero_copy_and_rejections() {
    let c = small(256, 2048, 8, 64, Routing::Uniform);
    run_worlds("caller_buffers_zero_copy_and_rejections", 2, |r| {
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(7, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let want = refr::dispatch(&shape, &inputs, r.rank, RecvLayout::RankMajor)?;
        let cap = r.world * c.tokens;
        let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
        let s = &r.stream;
        let (x, w, idx) = upload(s, me)?;
        let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;

        let mut recv_tokens = group.pool().alloc::<bf16>(cap * c.hidden)?;
        let mut recv_w = group.pool().alloc::<f32>(cap * c.topk)?;
        let (tokens_ptr, w_ptr) = (recv_tokens.device_ptr(), recv_w.device_ptr());
        let got = group.dispatch(
            s,
            &handle,
            &x,
            &w,
            DispatchOut {
                recv_tokens: Some(&mut recv_tokens),
                recv_topk_weights: Some(&mut recv_w),
            },
        )?;
        ensure(
            got.tokens.is_callers() && got.tokens.device_ptr() == tokens_ptr,
            || "recv_tokens not used in place".into(),
        )?;
        ensure(got.topk_weights.device_ptr() == w_ptr, || {
            "recv_topk_weights not used in place".into()
        })?;
        drop(got);
        ensure(
            group
                .pool()
                .is_symm_backed(recv_tokens.device_ptr(), recv_tokens.num_bytes()),
            || "caller buffer not symm-backed".into(),
        )?;
        first_diff(
            "zero-copy tokens",
            &bits(&down(s, &recv_tokens, want.num_rows * c.hidden)?),
            &bits(&want.tokens),
        )?;

        let pooled = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
        ensure(
            !pooled.tokens.is_callers()
                && group
                    .pool()
                    .is_symm_backed(pooled.tokens.device_ptr(), cap * c.hidden * 2),
            || "pool buffer not symmetric".into(),
        )?;
        drop(pooled);

        let mut plain = s
            .alloc_zeros::<bf16>(cap * c.hidden)
            .map_err(Error::cuda("alloc"))?;
        match group.dispatch(
            s,
            &handle,
            &x,
            &w,
            DispatchOut {
                recv_tokens: Some(&mut plain),
                recv_topk_weights: None,
            },
        ) {
            Err(Error::NotSymmetric {
                what: "recv_tokens",
            }) => {}
            Err(e) => {
                return Err(Error::InvalidState(format!(
                    "plain buffer: wrong error {e}"
                )))
            }
            Ok(_) => {
                return Err(Error::InvalidState(
                    "plain buffer accepted as a receive buffer".into(),
                ))
            }
        }
        let mut short = group.pool().alloc::<bf16>(cap * c.hidden - 8)?;
        match group.dispatch(
            s,
            &handle,
            &x,
            &w,
            DispatchOut {
                recv_tokens: Some(&mut short),
                recv_topk_weights: None,
            },
        ) {
            Err(Error::InvalidArgument {
                arg: "recv_tokens", ..
            }) => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "short buffer: {:?}",
                    other.err()
                )))
            }
        }
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// A receive count over capacity is found on the device: every rank skips the
/// data movement, the next call reports CapacityExceeded, and the bytes
/// around (and inside) the caller's buffer are unchanged.
#[test]
fn over_capacity_is_reported_and_writes_nothing() {
    let c = small(512, 2048, 8, 64, Routing::Skewed { hot_share: 0.9 });
    run_worlds("over_capacity_is_reported_and_writes_nothing", 2, |r| {
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(11, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let mut cfg = r.config(c.experts, c.hidden, c.tokens)?;
        cfg.recv_capacity = 100; // far below what this routing needs
        let group = EpGroup::new(&r.comm, cfg)?;
        let s = &r.stream;
        let (x, w, idx) = upload(s, me)?;
        let guard = 64 * c.hidden;
        let total = guard + 100 * c.hidden + guard;
        let mut buf = group.pool().alloc::<bf16>(total)?;
        let pattern: Vec<bf16> = (0..total)
            .map(|i| bf16::from_bits(0x3C00 ^ (i as u16 & 0x0FFF)))
            .collect();
        buf.copy_from_host(s, &pattern)?;
        r.comm.barrier(s)?;
        // The receive region inside the guards: a view of the pool buffer.
        let mut inner = buf.view_mut(guard..guard + 100 * c.hidden)?;
        let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
        let res = group.dispatch(
            s,
            &handle,
            &x,
            &w,
            DispatchOut {
                recv_tokens: Some(&mut inner),
                recv_topk_weights: None,
            },
        );
        // One check on every rank, whichever op reported the error.
        let first_err = match res {
            Ok(d) => {
                drop(d);
                s.synchronize().map_err(Error::cuda("sync"))?;
                group.check().err()
            }
            Err(e) => {
                let _ = group.check();
                Some(e)
            }
        };
        match first_err {
            Some(Error::CapacityExceeded {
                needed,
                capacity: 100,
                ..
            }) if needed > 100 => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "expected CapacityExceeded, got {other:?}"
                )))
            }
        }
        let after = down(s, &buf, total)?;
        first_diff(
            "buffer and guards after over-capacity dispatch",
            &bits(&after),
            &bits(&pattern),
        )?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// Pipeline-parallel order: forward 0, forward 1, backward 0, forward 2,
/// backward 1, backward 2, with three handles in flight; every result right.
#[test]
fn several_handles_in_flight() {
    let c = small(300, 2048, 8, 64, Routing::Uniform);
    let layout = RecvLayout::ExpertMajor { alignment: 8 };
    run_worlds("several_handles_in_flight", 2, |r| {
        let shape = shape_of(&c, r.world);
        let tpr = vec![c.tokens; r.world];
        let batches: Vec<Vec<RankInput>> = (0..3)
            .map(|b| workload::rank_inputs(100 + b, &shape, &tpr, c.routing))
            .collect();
        let refs: Vec<Vec<refr::DispatchOutput>> = batches
            .iter()
            .map(|inp| {
                (0..r.world)
                    .map(|d| refr::dispatch(&shape, inp, d, layout))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let cap = refs.iter().flatten().map(|o| o.num_rows).max().unwrap_or(1);
        let mut cfg = r.config(c.experts, c.hidden, c.tokens)?;
        cfg.recv_capacity = cap;
        let group = EpGroup::new(&r.comm, cfg)?;
        let s = &r.stream;
        struct Batch {
            x: CudaSlice<bf16>,
            w: CudaSlice<f32>,
            idx: CudaSlice<i64>,
            y: CudaSlice<bf16>,
            g: CudaSlice<bf16>,
            outs: Vec<Vec<bf16>>,
            grads: Vec<Vec<bf16>>,
        }
        let mut bs = Vec::new();
        for (b, inp) in batches.iter().enumerate() {
            let outs: Vec<Vec<bf16>> = (0..r.world)
                .map(|d| expert_out(500 + b as u64, d, refs[b][d].num_rows, c.hidden))
                .collect();
            let grads: Vec<Vec<bf16>> = (0..r.world)
                .map(|d| {
                    workload::tokens(
                        &mut Rng::new(900 + b as u64 + d as u64 * 7),
                        c.tokens,
                        c.hidden,
                    )
                })
                .collect();
            bs.push(Batch {
                x: up(s, &inp[r.rank].tokens)?,
                w: up(s, &inp[r.rank].topk_weights)?,
                idx: up(s, &inp[r.rank].topk_idx)?,
                y: up_len(s, &outs[r.rank], cap * c.hidden)?,
                g: up(s, &grads[r.rank])?,
                outs,
                grads,
            });
        }
        let th = c.tokens * c.hidden;
        let handles: Vec<_> = bs
            .iter()
            .map(|b| group.layout(s, TopkIdx::I64(&b.idx), c.topk, layout))
            .collect::<Result<_>>()?;
        let mut outs: Vec<CudaSlice<bf16>> = (0..3)
            .map(|_| s.alloc_zeros::<bf16>(th).map_err(Error::cuda("alloc")))
            .collect::<Result<_>>()?;
        let mut recvs = Vec::new();
        let mut grads_in = Vec::new();
        let forward = |b: usize, recvs: &mut Vec<_>, out: &mut CudaSlice<bf16>| -> Result<()> {
            let d = group.dispatch(s, &handles[b], &bs[b].x, &bs[b].w, DispatchOut::default())?;
            group.combine(s, &handles[b], &bs[b].y, None, out)?;
            recvs.push(d);
            Ok(())
        };
        let backward = |b: usize, grads_in: &mut Vec<_>, out: &mut CudaSlice<bf16>| -> Result<()> {
            let gx = group.combine_backward(s, &handles[b], &bs[b].g, None, None)?;
            group.dispatch_backward(
                s,
                &handles[b],
                moe_ep::DispatchBackwardArgs {
                    grad_recv_tokens: &gx,
                    grad_recv_topk_weights: None,
                    grad_tokens: out,
                    grad_topk_weights: None,
                },
            )?;
            grads_in.push(gx);
            Ok(())
        };
        forward(0, &mut recvs, &mut outs[0])?;
        forward(1, &mut recvs, &mut outs[1])?;
        let combined0 = bits(&down(s, &outs[0], th)?);
        backward(0, &mut grads_in, &mut outs[0])?;
        forward(2, &mut recvs, &mut outs[2])?;
        let combined1 = bits(&down(s, &outs[1], th)?);
        backward(1, &mut grads_in, &mut outs[1])?;
        let combined2 = bits(&down(s, &outs[2], th)?);
        backward(2, &mut grads_in, &mut outs[2])?;
        for (b, combined) in [combined0, combined1, combined2].iter().enumerate() {
            let emu =
                refr::combine_emulated(&shape, &batches[b], &bs[b].outs, r.rank, layout, false)?;
            first_diff(&format!("forward {b} combine"), combined, &bits(&emu))?;
            let rows = refs[b][r.rank].num_rows;
            first_diff(
                &format!("forward {b} dispatch"),
                &bits(&down(s, &recvs[b].tokens, rows * c.hidden)?),
                &bits(&refs[b][r.rank].tokens),
            )?;
            let want_g =
                refr::combine_backward(&shape, &batches[b], &bs[b].grads, r.rank, layout, false)?;
            first_diff(
                &format!("backward {b} combine_backward"),
                &bits(&down(s, &grads_in[b], rows * c.hidden)?),
                &bits(&want_g),
            )?;
            // dispatch_backward(combine_backward(g)) = g summed over each token's rows.
            let per_rank: Vec<Vec<bf16>> = (0..r.world)
                .map(|d| {
                    refr::combine_backward(&shape, &batches[b], &bs[b].grads, d, layout, false)
                })
                .collect::<Result<_>>()?;
            let want_back =
                refr::combine_emulated(&shape, &batches[b], &per_rank, r.rank, layout, false)?;
            first_diff(
                &format!("backward {b} dispatch_backward"),
                &bits(&down(s, &outs[b], th)?),
                &bits(&want_back),
            )?;
        }
        group.check()?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// Dispatch + combine captured once in a CUDA graph and replayed 5 times:
/// the same bits every time, equal to the eager result.
#[test]
fn cuda_graph_capture_and_replay() {
    let c = small(256, 4096, 8, 64, Routing::Uniform);
    run_worlds("cuda_graph_capture_and_replay", 2, |r| {
        use moe_ep::cuda::sys::CUstreamCaptureMode;
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(3, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
        let s = &r.stream;
        let cap = group.recv_capacity();
        let (x, w, idx) = upload(s, me)?;
        let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
        let mut recv = group.pool().alloc::<bf16>(cap * c.hidden)?;
        let mut recv_w = group.pool().alloc::<f32>(cap * c.topk)?;
        let mut out = s
            .alloc_zeros::<bf16>(c.tokens * c.hidden)
            .map_err(Error::cuda("alloc"))?;
        // Expert = identity on the received rows: combine reads recv itself.
        let eager = {
            let d = group.dispatch(
                s,
                &handle,
                &x,
                &w,
                DispatchOut {
                    recv_tokens: Some(&mut recv),
                    recv_topk_weights: Some(&mut recv_w),
                },
            )?;
            group.combine(s, &handle, &d.tokens, None, &mut out)?;
            drop(d);
            bits(&down(s, &out, c.tokens * c.hidden)?)
        };
        let want = identity_combine(&shape, me)?;
        first_diff("eager identity combine", &eager, &want)?;
        r.comm.barrier(s)?;
        let zero = vec![bf16::ZERO; c.tokens * c.hidden];
        // Not allowed yet: the op refuses a capturing stream by name.
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(Error::cuda("begin_capture"))?;
        let refused = group.combine(s, &handle, &recv, None, &mut out);
        let _ = s.end_capture(moe_ep::cuda::sys::CUgraphInstantiate_flags(0));
        match refused {
            Err(Error::InvalidArgument { arg: "stream", .. }) => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "an op on a capturing stream before allow_graph_capture: {other:?}"
                )))
            }
        }
        // Every rank refused the same call: nothing out of step.
        group.check()?;
        r.comm.barrier(s)?;
        // SAFETY: the graph is launched only below, while recv, recv_w, x,
        // w, out, handle and the group live; every rank launches it 5 times.
        unsafe { group.allow_graph_capture() };
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(Error::cuda("begin_capture"))?;
        let d = group.dispatch(
            s,
            &handle,
            &x,
            &w,
            DispatchOut {
                recv_tokens: Some(&mut recv),
                recv_topk_weights: Some(&mut recv_w),
            },
        )?;
        group.combine(s, &handle, &d.tokens, None, &mut out)?;
        let graph = s
            .end_capture(moe_ep::cuda::sys::CUgraphInstantiate_flags(0))
            .map_err(Error::cuda("end_capture"))?
            .ok_or_else(|| Error::InvalidState("empty graph".into()))?;
        // Instantiation may wait for the whole GPU: every rank instantiates
        // before any rank's replay waits for the others (virtual ranks).
        r.comm.barrier(s)?;
        for replay in 0..5 {
            drain(s)?;
            s.memcpy_htod(&zero, &mut out)
                .map_err(Error::cuda("htod"))?;
            graph.launch().map_err(Error::cuda("graph launch"))?;
            first_diff(
                &format!("graph replay {replay}"),
                &bits(&down(s, &out, c.tokens * c.hidden)?),
                &eager,
            )?;
        }
        drop(d);
        group.check()?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// Identity round trip (rank-major layout, dispatch, combine of the received
/// rows) of the small uniform case: bit for bit what the reference gives.
/// The group still works after an error was reported and cleared.
fn identity_round_trip(r: &Rank, group: &EpGroup, c: &Case, seed: u64) -> Result<()> {
    let shape = shape_of(c, r.world);
    let inputs = workload::rank_inputs(seed, &shape, &vec![c.tokens; r.world], c.routing);
    let me = &inputs[r.rank];
    let s = &r.stream;
    let (x, w, idx) = upload(s, me)?;
    let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
    let mut out = s
        .alloc_zeros::<bf16>(c.tokens * c.hidden)
        .map_err(Error::cuda("alloc"))?;
    let d = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
    group.combine(s, &handle, &d.tokens, None, &mut out)?;
    drop(d);
    let got = bits(&down(s, &out, c.tokens * c.hidden)?);
    group.check()?;
    first_diff(
        "identity combine after the error",
        &got,
        &identity_combine(&shape, me)?,
    )
}

/// Asserts that `res` is the bad-routing error of rank 0 that `want`
/// describes, on every rank, and that it came well before the timeout.
fn expect_routing_error(res: Result<()>, want: &str, since: std::time::Instant) -> Result<()> {
    match res {
        Err(Error::InvalidDeviceData {
            arg: "topk_idx",
            detail,
        }) if detail.contains(want) => {}
        other => {
            return Err(Error::InvalidState(format!(
                "expected InvalidDeviceData for topk_idx ({want}), got {other:?}"
            )))
        }
    }
    let took = since.elapsed();
    ensure(took < Duration::from_secs(5), || {
        format!("the error took {took:?}: a rank waited for a timeout")
    })
}

/// An expert id out of range on rank 0, then (next step) an expert twice in
/// one of rank 0's tokens: every rank refuses the dispatch or reports it at
/// `check`, naming rank 0, the token and the slot, with no rank waiting for
/// the timeout; after `check` every rank runs a correct round trip.
#[test]
fn bad_expert_id_is_reported_on_every_rank() {
    let c = small(16, 1024, 2, 16, Routing::Uniform);
    run_worlds("bad_expert_id_is_reported_on_every_rank", 2, |r| {
        let (t, k, e) = (c.tokens, c.topk, c.experts * r.world / 2);
        let c = Case { experts: e, ..c };
        let mut cfg = r.config(e, c.hidden, t)?;
        cfg.timeout = Duration::from_secs(20);
        let group = EpGroup::new(&r.comm, cfg)?;
        let s = &r.stream;
        let mut idx: Vec<i64> = (0..t * k).map(|i| (i % e) as i64).collect();
        if r.rank == 0 {
            idx[5] = e as i64 + 3;
        }
        let x = up(s, &vec![bf16::ONE; t * c.hidden])?;
        let w = up(s, &vec![1f32; t * k])?;
        let this = if r.rank == 0 { " (this rank)" } else { "" };
        for step in 0..2 {
            let want = if step == 0 {
                format!(
                    "rank 0{this}: token 2 slot 1: expert id {} not in [-1, {e})",
                    e + 3
                )
            } else {
                // Rank 0's token 3 names its slot-0 expert again in slot 1.
                idx[5] = 5;
                if r.rank == 0 {
                    idx[7] = idx[6];
                }
                format!(
                    "rank 0{this}: token 3 slot 1: expert {} appears twice",
                    idx[6]
                )
            };
            let d_idx = up(s, &idx)?;
            r.comm.barrier(s)?;
            let since = std::time::Instant::now();
            // The error comes from an op that refuses (once the host has
            // seen it; it stays pending) or from check (which clears it).
            let mut from_check = false;
            let mut res = (|| {
                let handle = group.layout(s, TopkIdx::I64(&d_idx), k, RecvLayout::RankMajor)?;
                let d = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
                drop(d);
                from_check = true;
                group.check()
            })();
            if let (Err(e), false) = (&res, from_check) {
                let again = group.check();
                ensure(
                    format!("{again:?}") == format!("{:?}", Err::<(), _>(e)),
                    || format!("check after the refusal gave {again:?}, the op {e:?}"),
                )?;
                res = again;
            }
            expect_routing_error(res, &want, since)?;
            group.check()?;
            r.comm.barrier(s)?;
        }
        identity_round_trip(r, &group, &c, 5)?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// One rank's layout differs from the others' in topk, in the layout kind,
/// or in the expert-major alignment: every rank's check names the field and
/// both values, nothing waits for the timeout, and after check the group
/// runs a correct round trip.
#[test]
fn layout_that_differs_between_ranks_is_refused_everywhere() {
    let c = small(64, 1024, 4, 16, Routing::Uniform);
    run_worlds(
        "layout_that_differs_between_ranks_is_refused_everywhere",
        2,
        |r| {
            let e = c.experts * r.world / 2;
            let c = Case { experts: e, ..c };
            let mut cfg = r.config(e, c.hidden, c.tokens)?;
            cfg.timeout = Duration::from_secs(20);
            let group = EpGroup::new(&r.comm, cfg)?;
            let s = &r.stream;
            let odd = r.rank == r.world - 1;
            let em = |a| RecvLayout::ExpertMajor { alignment: a };
            for (field, k, layout) in [
                ("topk", if odd { 2 } else { 4 }, em(4)),
                ("layout", 4, if odd { RecvLayout::RankMajor } else { em(1) }),
                ("alignment", 4, em(if odd { 8 } else { 4 })),
            ] {
                // Token t's experts t, t + 3, t + 6, ... (mod e): all distinct.
                let idx: Vec<i64> = (0..c.tokens * k)
                    .map(|i| ((i / k + (i % k) * 3) % e) as i64)
                    .collect();
                let d_idx = up(s, &idx)?;
                r.comm.barrier(s)?;
                let since = std::time::Instant::now();
                let res = (|| {
                    let handle = group.layout(s, TopkIdx::I64(&d_idx), k, layout)?;
                    drop(handle);
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
            identity_round_trip(r, &group, &c, 9)?;
            r.comm.barrier(s)?;
            Ok(())
        },
    );
}

/// After a peer timeout the group refuses work; dropping it and making a new
/// group on the same communicator gives correct results again.
#[test]
fn new_group_after_a_timeout_works() {
    let c = small(64, 1024, 2, 16, Routing::Uniform);
    run_worlds("new_group_after_a_timeout_works", 2, |r| {
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(5, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let mut cfg = r.config(c.experts, c.hidden, c.tokens)?;
        cfg.timeout = Duration::from_millis(300);
        let s = &r.stream;
        {
            let group = EpGroup::new(&r.comm, cfg.clone())?;
            let (x, w, idx) = upload(s, me)?;
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            s.synchronize().map_err(Error::cuda("sync"))?;
            r.comm.barrier(s)?;
            if r.rank == 0 {
                let d = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
                drop(d);
                match group.check() {
                    Err(Error::PeerTimeout { .. }) => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "expected PeerTimeout, got {other:?}"
                        )))
                    }
                }
            }
            r.comm.barrier(s)?;
        }
        let group = EpGroup::new(&r.comm, cfg)?;
        identity_round_trip(r, &group, &c, 6)?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// A peer that never dispatches: the wait is bounded and the error names the
/// rank and counter that stalled (its descriptor of the call, the first
/// thing a sender waits for, or, for a block with nothing to send, its
/// flags); the group refuses further work.
#[test]
fn stalled_peer_times_out_with_rank_and_counter() {
    let c = small(64, 1024, 2, 16, Routing::Uniform);
    run_worlds("stalled_peer_times_out_with_rank_and_counter", 2, |r| {
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(5, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let mut cfg = r.config(c.experts, c.hidden, c.tokens)?;
        cfg.timeout = Duration::from_millis(300);
        let group = EpGroup::new(&r.comm, cfg)?;
        let s = &r.stream;
        let (x, w, idx) = upload(s, me)?;
        let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        r.comm.barrier(s)?;
        if r.rank != 0 {
            return Ok(()); // the stalled peers never dispatch
        }
        let d = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        drop(d);
        match group.check() {
            Err(Error::PeerTimeout {
                rank: 0,
                peer,
                counter: "op call descriptor" | "dispatch done",
                ..
            }) if peer != 0 => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "expected PeerTimeout on op call descriptor or dispatch done, got {other:?}"
                )))
            }
        }
        match group.dispatch(s, &handle, &x, &w, DispatchOut::default()) {
            Err(Error::InvalidState(_)) => Ok(()),
            other => Err(Error::InvalidState(format!(
                "poisoned group accepted work: {:?}",
                other.err()
            ))),
        }
    });
}

/// Asserts that `res` refuses `arg` (a buffer or the op that differs between
/// ranks) on this rank, well before the timeout.
fn expect_mismatch(r: &Rank, res: Result<()>, arg: &str, since: std::time::Instant) -> Result<()> {
    match res {
        Err(Error::InvalidArgument {
            arg: a,
            ref expected,
            ..
        }) if a == arg => ensure(expected.contains("rank "), || {
            format!("rank {}: the error names no peer: {expected}", r.rank)
        })?,
        // This rank's kernels saw a peer stop first: that peer found the
        // mismatch, and its argument comes along.
        Err(Error::PeerFailed {
            peer, arg: Some(a), ..
        }) if a == arg && peer < r.world => {}
        other => {
            return Err(Error::InvalidState(format!(
                "rank {}: expected InvalidArgument for `{arg}`, got {other:?}",
                r.rank
            )))
        }
    }
    let took = since.elapsed();
    ensure(took < Duration::from_secs(5), || {
        format!("the error took {took:?}: a rank waited for a timeout")
    })
}

/// Ranks that pass buffers of another kind or in another place, or run
/// another op: rank 0's expert outputs symmetric (read in place) where the
/// others' are plain (pushed); rank 0's in another pool buffer; rank 0's
/// dispatch into a caller's buffer where the others' go into the group's
/// pool; rank 0 dispatching while the others run the combine backward.
/// Each time every rank stops at once with an error naming the argument
/// (no rank waits for the timeout, none writes to or reads from the wrong
/// place), and after `check` the same group runs a correct round trip.
#[test]
fn buffers_that_differ_between_ranks_are_refused_everywhere() {
    let c = small(64, 1024, 2, 16, Routing::Uniform);
    run_worlds(
        "buffers_that_differ_between_ranks_are_refused_everywhere",
        2,
        |r| {
            let shape = shape_of(&c, r.world);
            let inputs = workload::rank_inputs(6, &shape, &vec![c.tokens; r.world], c.routing);
            let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
            let s = &r.stream;
            let (x, w, idx) = upload(s, &inputs[r.rank])?;
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            let n = group.recv_capacity() * c.hidden;
            let symm_a = group.pool().alloc::<bf16>(n)?;
            let mut symm_b = group.pool().alloc::<bf16>(n)?;
            let plain = s.alloc_zeros::<bf16>(n).map_err(Error::cuda("alloc"))?;
            let mut out = s
                .alloc_zeros::<bf16>(c.tokens * c.hidden)
                .map_err(Error::cuda("alloc"))?;
            let zero = r.rank == 0;
            let mut seed = 60;
            let mut after = |what: &str| -> Result<()> {
                s.synchronize().map_err(Error::cuda("sync"))?;
                seed += 1;
                identity_round_trip(r, &group, &c, seed)
                    .map_err(|e| Error::InvalidState(format!("after {what}: {e}")))
            };

            // Combine: pulled on rank 0, pushed elsewhere.
            s.synchronize().map_err(Error::cuda("sync"))?;
            r.comm.barrier(s)?;
            let t0 = std::time::Instant::now();
            let y: &dyn DeviceRegion<bf16> = if zero { &symm_a } else { &plain };
            group.combine(s, &handle, y, None, &mut out)?;
            s.synchronize().map_err(Error::cuda("sync"))?;
            expect_mismatch(r, group.check(), "expert_out", t0)?;
            after("a combine pulled on rank 0 only")?;

            // Combine: pulled everywhere, rank 0's outputs in another buffer.
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            s.synchronize().map_err(Error::cuda("sync"))?;
            r.comm.barrier(s)?;
            let t0 = std::time::Instant::now();
            let y: &dyn DeviceRegion<bf16> = if zero { &symm_b } else { &symm_a };
            group.combine(s, &handle, y, None, &mut out)?;
            s.synchronize().map_err(Error::cuda("sync"))?;
            expect_mismatch(r, group.check(), "expert_out", t0)?;
            after("a combine of outputs in another place on rank 0")?;

            // Dispatch: rank 0 into a caller's buffer, the others into the pool.
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            s.synchronize().map_err(Error::cuda("sync"))?;
            r.comm.barrier(s)?;
            let t0 = std::time::Instant::now();
            let out_b = DispatchOut {
                recv_tokens: if zero { Some(&mut symm_b) } else { None },
                recv_topk_weights: None,
            };
            drop(group.dispatch(s, &handle, &x, &w, out_b)?);
            s.synchronize().map_err(Error::cuda("sync"))?;
            expect_mismatch(r, group.check(), "recv_tokens", t0)?;
            after("a dispatch into a caller's buffer on rank 0 only")?;

            // Another op: rank 0 dispatches, the others run the combine backward.
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            let grad = up_len::<bf16>(s, &[], c.tokens * c.hidden)?;
            s.synchronize().map_err(Error::cuda("sync"))?;
            r.comm.barrier(s)?;
            let t0 = std::time::Instant::now();
            if zero {
                drop(group.dispatch(s, &handle, &x, &w, DispatchOut::default())?);
            } else {
                drop(group.combine_backward(s, &handle, &grad, None, None)?);
            }
            s.synchronize().map_err(Error::cuda("sync"))?;
            expect_mismatch(r, group.check(), "op", t0)?;
            after("a dispatch on rank 0 beside a combine backward")
        },
    );
}

/// A pool buffer dropped while the combine that reads it in place is still
/// queued (its stream held behind a host function): the pool hands the
/// same range out again at once, and a write of zeros into it on another
/// stream waits for that combine, whose result is still right (without
/// the ordering the zeros land first and the combine sums them).
#[test]
fn a_dropped_pool_buffer_is_reused_only_after_its_work() {
    let c = small(64, 1024, 2, 16, Routing::Uniform);
    run_worlds(
        "a_dropped_pool_buffer_is_reused_only_after_its_work",
        2,
        |r| {
            let shape = shape_of(&c, r.world);
            let inputs = workload::rank_inputs(8, &shape, &vec![c.tokens; r.world], c.routing);
            let me = &inputs[r.rank];
            let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
            let s = &r.stream;
            let (x, w, idx) = upload(s, me)?;
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            let mut out = s
                .alloc_zeros::<bf16>(c.tokens * c.hidden)
                .map_err(Error::cuda("alloc"))?;
            let d = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
            drain(s)?;
            r.comm.barrier(s)?;
            hold(s, 100)?;
            group.combine(s, &handle, &d.tokens, None, &mut out)?;
            let (ptr, n) = (d.tokens.device_ptr(), d.tokens.len());
            drop(d);
            let mut again = group.pool().alloc::<bf16>(n)?;
            ensure(again.device_ptr() == ptr, || {
                format!(
                "rank {}: the pool did not hand out the dropped range again ({:#x}, not {ptr:#x}): the test proves nothing",
                r.rank,
                again.device_ptr()
            )
            })?;
            let zeros = r
                .stream2
                .alloc_zeros::<bf16>(n)
                .map_err(Error::cuda("alloc"))?;
            again.copy_from_device(&r.stream2, &zeros)?;
            drain(&r.stream2)?;
            let got = bits(&down(s, &out, c.tokens * c.hidden)?);
            group.check()?;
            first_diff(
                "combine of a buffer dropped while queued",
                &got,
                &identity_combine(&shape, me)?,
            )
        },
    );
}

/// Every rank's blocks must be resident at once (they wait for each other):
/// one block more per rank than fits is refused on every rank before any
/// collective allocation, naming `num_sms` and what fits; exactly what fits
/// runs layout, dispatch and combine to the end (no rank's blocks wait for
/// blocks that cannot start).
#[test]
fn residency_is_checked_and_what_fits_runs() {
    let c = small(256, 2048, 8, 64, Routing::Uniform);
    run_worlds("residency_is_checked_and_what_fits_runs", 2, |r| {
        let res = moe_ep::ops::residency(&r.comm, c.experts)?;
        let fit = res.max_blocks_per_rank();
        if r.rank == 0 {
            eprintln!("  {res:?}: at most {fit} blocks per rank");
        }
        let mut cfg = GroupConfig::new(c.experts, c.hidden, c.tokens);
        if fit < 132 {
            cfg.num_sms = fit + 1;
            match EpGroup::new(&r.comm, cfg.clone()) {
                Err(Error::InvalidArgument {
                    arg: "num_sms",
                    expected,
                    ..
                }) if expected.contains(&format!("at most {fit} blocks per rank")) => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "num_sms {} (one more than fits): expected a refusal, got {:?}",
                        fit + 1,
                        other.err()
                    )))
                }
            }
        }
        cfg.num_sms = fit.min(132);
        let group = EpGroup::new(&r.comm, cfg)?;
        let s = &r.stream;
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(21, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let (x, w, idx) = upload(s, me)?;
        let want = refr::dispatch(&shape, &inputs, r.rank, RecvLayout::RankMajor)?;
        let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
        let got = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
        first_diff(
            "dispatch at the residency limit",
            &bits(&down(s, &got.tokens, want.num_rows * c.hidden)?),
            &bits(&want.tokens),
        )?;
        let mut out = s
            .alloc_zeros::<bf16>(c.tokens * c.hidden)
            .map_err(Error::cuda("alloc"))?;
        group.combine(s, &handle, &got.tokens, None, &mut out)?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        group.check()?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// A shared field of the config different on one rank (or a config one rank
/// refuses) stops every rank in `EpGroup::new`, before anything is
/// allocated collectively, naming the field and both values; the ranks can
/// then make a group that agrees.
#[test]
fn config_that_differs_between_ranks_is_refused_everywhere() {
    type Tweak = fn(&mut GroupConfig);
    let tweaks: [(&str, Tweak); 6] = [
        ("num_experts", |c| c.num_experts *= 2),
        ("hidden", |c| c.hidden += 8),
        ("max_tokens_per_rank", |c| c.max_tokens_per_rank += 1),
        ("recv_capacity", |c| c.recv_capacity += 1),
        ("num_sms", |c| c.num_sms -= 1),
        ("combine_chunks", |c| c.combine_chunks = 2),
    ];
    run_worlds(
        "config_that_differs_between_ranks_is_refused_everywhere",
        2,
        |r| {
            let base = {
                let mut c = r.config(8 * r.world, 1024, 64)?;
                c.recv_capacity = r.world * 64;
                c
            };
            for (field, tweak) in tweaks {
                let mut cfg = base.clone();
                if r.rank == r.world - 1 {
                    tweak(&mut cfg);
                }
                match EpGroup::new(&r.comm, cfg) {
                    Err(Error::InvalidArgument { arg, expected, .. })
                        if arg == field && expected.contains("the same value on every rank") => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "{field} different on rank {}: expected a refusal naming it, got {:?}",
                            r.world - 1,
                            other.err()
                        )))
                    }
                }
            }
            // One rank's config invalid (hidden not a multiple of 8): that rank
            // names the field, every other rank names the rank.
            let mut cfg = base.clone();
            if r.rank == 0 {
                cfg.hidden = 1001;
            }
            match (r.rank, EpGroup::new(&r.comm, cfg)) {
                (0, Err(Error::InvalidArgument { arg: "hidden", .. })) => {}
                (
                    _,
                    Err(Error::InvalidArgument {
                        arg: "cfg", got, ..
                    }),
                ) if r.rank != 0 && got.contains("rank 0") => {}
                (_, other) => {
                    return Err(Error::InvalidState(format!(
                        "an invalid config on rank 0: got {:?}",
                        other.err()
                    )))
                }
            }
            // Agreeing configs still work afterwards.
            let group = EpGroup::new(&r.comm, base)?;
            group.check()?;
            r.comm.barrier(&r.stream)?;
            Ok(())
        },
    );
}

/// A handle from another group (same world, experts and sizes) is refused,
/// naming `handle`; the group stays usable.
#[test]
fn handle_of_another_group_is_refused() {
    let c = small(64, 1024, 2, 16, Routing::Uniform);
    run_worlds("handle_of_another_group_is_refused", 2, |r| {
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(31, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let a = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
        let b = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
        let s = &r.stream;
        let (x, w, idx) = upload(s, me)?;
        let from_a = a.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
        match b.dispatch(s, &from_a, &x, &w, DispatchOut::default()) {
            Err(Error::InvalidArgument { arg: "handle", .. }) => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "a handle of group A on group B: {:?}",
                    other.err().map(|e| e.to_string())
                )))
            }
        }
        // Both groups still work with their own handles.
        let want = refr::dispatch(&shape, &inputs, r.rank, RecvLayout::RankMajor)?;
        for g in [&a, &b] {
            let h = g.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            let got = g.dispatch(s, &h, &x, &w, DispatchOut::default())?;
            first_diff(
                "dispatch after a refused handle",
                &bits(&down(s, &got.tokens, want.num_rows * c.hidden)?),
                &bits(&want.tokens),
            )?;
            g.check()?;
        }
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// Ops of one group on two streams, with no synchronisation by the caller:
/// the group orders the second stream's op after the first stream's, so
/// combine on stream 2 sees what dispatch on stream 1 received, and two
/// threads of one rank that take turns on the group do the same.
#[test]
fn two_streams_and_two_threads_on_one_group_are_ordered() {
    let c = small(256, 4096, 8, 64, Routing::Uniform);
    run_worlds(
        "two_streams_and_two_threads_on_one_group_are_ordered",
        2,
        |r| {
            let shape = shape_of(&c, r.world);
            let inputs = workload::rank_inputs(41, &shape, &vec![c.tokens; r.world], c.routing);
            let me = &inputs[r.rank];
            let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
            let (s1, s2) = (&r.stream, &r.stream2);
            let (x, w, idx) = upload(s1, me)?;
            let want = identity_combine(&shape, me)?;
            let mut out = s2
                .alloc_zeros::<bf16>(c.tokens * c.hidden)
                .map_err(Error::cuda("alloc"))?;
            s2.synchronize().map_err(Error::cuda("sync"))?;
            let handle = group.layout(s1, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            // Two threads of this rank take turns (the first has enqueued its
            // dispatch on stream 1 when the second enqueues its combine on
            // stream 2); neither synchronises a stream.
            let cap = group.recv_capacity();
            let mut recv = group.pool().alloc::<bf16>(cap * c.hidden)?;
            let mut recv_w = group.pool().alloc::<f32>(cap * c.topk)?;
            std::thread::scope(|sc| {
                sc.spawn(|| -> Result<()> {
                    let d = group.dispatch(
                        s1,
                        &handle,
                        &x,
                        &w,
                        DispatchOut {
                            recv_tokens: Some(&mut recv),
                            recv_topk_weights: Some(&mut recv_w),
                        },
                    )?;
                    drop(d);
                    Ok(())
                })
                .join()
                .expect("dispatch thread")
            })?;
            // Identity experts, on the other stream, enqueued right away.
            group.combine(s2, &handle, &recv, None, &mut out)?;
            first_diff(
                "combine on stream 2 after dispatch on stream 1",
                &bits(&down(s2, &out, c.tokens * c.hidden)?),
                &want,
            )?;
            group.check()?;
            r.comm.barrier(s1)?;
            Ok(())
        },
    );
}

/// An input written on another stream (a cudarc slice whose own stream is
/// held at a closed gate, then copies the tokens in): dispatch on the op's
/// stream waits for that stream first, so combine's output is right.
#[test]
fn inputs_written_on_another_stream_are_waited_for() {
    let c = small(256, 4096, 8, 64, Routing::Uniform);
    run_worlds("inputs_written_on_another_stream_are_waited_for", 2, |r| {
        use moe_ep::testkit::nccl::StartGate;
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(43, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
        let s = &r.stream;
        let n = c.tokens * c.hidden;
        let (good, w, idx) = upload(s, me)?;
        let mut out = s.alloc_zeros::<bf16>(n).map_err(Error::cuda("alloc"))?;
        s.synchronize().map_err(Error::cuda("sync"))?;
        let other = r.ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        let mut x = other.alloc_zeros::<bf16>(n).map_err(Error::cuda("alloc"))?;
        other.synchronize().map_err(Error::cuda("sync"))?;
        let gate = StartGate::new(&other)?;
        let run = (|| {
            gate.enqueue(&r.comm, &other)?;
            other
                .memcpy_dtod(&good, &mut x)
                .map_err(Error::cuda("cuMemcpyDtoD"))?;
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            let d = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
            group.combine(s, &handle, &d.tokens, None, &mut out)?;
            Ok::<_, Error>((handle, d))
        })();
        // The other stream (and with it the ops) waits until here.
        gate.open();
        let kept = run?;
        let got = bits(&down(s, &out, n)?);
        drop(kept);
        group.check()?;
        first_diff(
            "combine of tokens copied in on another stream",
            &got,
            &identity_combine(&shape, me)?,
        )?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// Host memory pretending to be a device region: only an `unsafe impl` can
/// make one, and the group's checks still catch it.
struct HostRegion(Vec<bf16>);
// SAFETY: deliberately wrong (host memory): the group must refuse it before
// any kernel sees the address.
unsafe impl DeviceRegion<bf16> for HostRegion {
    fn device_ptr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Every buffer is checked before launch: a view whose rows are not 16-byte
/// aligned (input and output), host memory, a buffer one element short;
/// each is refused naming the argument, and the group works afterwards.
#[test]
fn bad_buffers_are_refused_naming_the_argument() {
    let c = small(64, 1024, 2, 16, Routing::Uniform);
    run_worlds("bad_buffers_are_refused_naming_the_argument", 2, |r| {
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(51, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
        let s = &r.stream;
        let th = c.tokens * c.hidden;
        let (w, idx) = (up(s, &me.topk_weights)?, up(s, &me.topk_idx)?);
        let x_room = up_len(s, &me.tokens, th + 8)?;
        let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
        let expect = |what: &str, arg: &str, needle: &str, res: Result<()>| -> Result<()> {
            match res {
                Err(Error::InvalidArgument {
                    arg: a,
                    expected,
                    got,
                }) if a == arg && (expected.contains(needle) || got.contains(needle)) => Ok(()),
                other => Err(Error::InvalidState(format!(
                    "{what}: expected InvalidArgument naming {arg} ({needle}), got {:?}",
                    other.err().map(|e| e.to_string())
                ))),
            }
        };
        // x one bf16 into its allocation: 2-byte aligned rows.
        let x_odd = x_room.slice(1..1 + th);
        expect(
            "misaligned x",
            "x",
            "16-byte aligned",
            group
                .dispatch(s, &handle, &x_odd, &w, DispatchOut::default())
                .map(drop),
        )?;
        let host = HostRegion(me.tokens.clone());
        expect(
            "host memory as x",
            "x",
            "not device memory",
            group
                .dispatch(s, &handle, &host, &w, DispatchOut::default())
                .map(drop),
        )?;
        let x = x_room.slice(0..th);
        expect(
            "x one element short",
            "x",
            "elements",
            group
                .dispatch(
                    s,
                    &handle,
                    &x_room.slice(0..th - 1),
                    &w,
                    DispatchOut::default(),
                )
                .map(drop),
        )?;
        // A receive buffer viewed one element in: misaligned, refused.
        let cap = group.recv_capacity();
        let mut recv = group.pool().alloc::<bf16>(cap * c.hidden + 8)?;
        {
            let mut odd = recv.view_mut(1..1 + cap * c.hidden)?;
            expect(
                "misaligned recv_tokens",
                "recv_tokens",
                "16-byte aligned",
                group
                    .dispatch(
                        s,
                        &handle,
                        &x,
                        &w,
                        DispatchOut {
                            recv_tokens: Some(&mut odd),
                            recv_topk_weights: None,
                        },
                    )
                    .map(drop),
            )?;
        }
        // The group is usable: an aligned view of the same buffer works.
        let want = refr::dispatch(&shape, &inputs, r.rank, RecvLayout::RankMajor)?;
        {
            let mut view = recv.view_mut(0..cap * c.hidden)?;
            let d = group.dispatch(
                s,
                &handle,
                &x,
                &w,
                DispatchOut {
                    recv_tokens: Some(&mut view),
                    recv_topk_weights: None,
                },
            )?;
            drop(d);
        }
        first_diff(
            "dispatch into a view after the refusals",
            &bits(&down(s, &recv, want.num_rows * c.hidden)?),
            &bits(&want.tokens),
        )?;
        group.check()?;
        r.comm.barrier(s)?;
        Ok(())
    });
}

/// Memory of another GPU as an input: refused by name, naming both GPUs
/// (needs two real GPUs: a one-rank virtual world on GPU 0 and a buffer of
/// GPU 1; SKIP otherwise).
#[test]
fn memory_of_another_gpu_is_refused() {
    if moe_ep::testkit::ranks::gpus_or_skip("memory_of_another_gpu_is_refused", 2).is_none() {
        return;
    }
    let run = || -> Result<()> {
        let c = small(64, 1024, 2, 16, Routing::Uniform);
        let ctx0 = moe_ep::cuda::CudaContext::new(0).map_err(Error::cuda("cuCtxCreate"))?;
        let ctx1 = moe_ep::cuda::CudaContext::new(1).map_err(Error::cuda("cuCtxCreate"))?;
        let comm = moe_ep::Communicator::virtual_world(&ctx0, 1)?.remove(0);
        let group = EpGroup::new(&comm, GroupConfig::new(c.experts, c.hidden, c.tokens))?;
        let shape = shape_of(&c, 1);
        let inputs = workload::rank_inputs(52, &shape, &[c.tokens], c.routing);
        let (s0, s1) = (ctx0.default_stream(), ctx1.default_stream());
        let (w, idx) = (
            up(&s0, &inputs[0].topk_weights)?,
            up(&s0, &inputs[0].topk_idx)?,
        );
        let x_other = up(&s1, &inputs[0].tokens)?;
        ctx0.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let handle = group.layout(&s0, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
        match group.dispatch(&s0, &handle, &x_other, &w, DispatchOut::default()) {
            Err(Error::InvalidArgument { arg: "x", got, .. })
                if got.contains("memory of GPU 1") => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "x on GPU 1 for a group on GPU 0: expected InvalidArgument for `x`, got {:?}",
                    other.map(drop)
                )))
            }
        }
        group.check()
    };
    if let Err(e) = run() {
        panic!("{e}");
    }
}

/// Free device memory with the default stream-ordered pool trimmed (what the
/// handles' arrays were freed into is given back first).
fn trimmed_free_memory(r: &Rank) -> Result<usize> {
    use moe_ep::cuda::sys;
    r.ctx.synchronize().map_err(Error::cuda("sync"))?;
    r.comm.barrier(&r.stream)?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: plain driver queries on this rank's (current) context.
    unsafe {
        let dev = r.ctx.cu_device();
        sys::cuDeviceGetDefaultMemPool(&mut pool, dev)
            .result()
            .map_err(Error::cuda("cuDeviceGetDefaultMemPool"))?;
        sys::cuMemPoolTrimTo(pool, 0)
            .result()
            .map_err(Error::cuda("cuMemPoolTrimTo"))?;
    }
    // Every rank trimmed before any reads (virtual ranks share the GPU).
    r.comm.barrier(&r.stream)?;
    let (free, _) = moe_ep::cuda::result::mem_get_info().map_err(Error::cuda("cuMemGetInfo"))?;
    r.comm.barrier(&r.stream)?;
    Ok(free)
}

/// 1000 cycles of a group made, a handle computed, both dropped: free device
/// memory is back where it started.
#[test]
fn thousand_group_and_handle_cycles_leak_nothing() {
    run_worlds("thousand_group_and_handle_cycles_leak_nothing", 2, |r| {
        let (t, k, e, h) = (32, 2, 8 * r.world, 1024);
        let s = &r.stream;
        let idx: Vec<i64> = (0..t * k)
            .map(|i| ((i / k + (i % k) * 3) % e) as i64)
            .collect();
        let d_idx = up(s, &idx)?;
        let cycle = || -> Result<()> {
            let group = EpGroup::new(&r.comm, r.config(e, h, t)?)?;
            let handle = group.layout(s, TopkIdx::I64(&d_idx), k, RecvLayout::RankMajor)?;
            drop(handle);
            drop(group);
            Ok(())
        };
        cycle()?;
        let before = trimmed_free_memory(r)?;
        for _ in 0..1000 {
            cycle()?;
        }
        let after = trimmed_free_memory(r)?;
        ensure(after == before, || {
            format!("free device memory moved: {before} -> {after} bytes after 1000 cycles")
        })
    });
}

/// A group dropped with its layout, dispatch and combine still enqueued:
/// the drop waits for them (no fault, nothing freed under a kernel), and a
/// new group on the same communicator gives correct results.
#[test]
fn dropping_a_group_with_work_in_flight_is_safe() {
    let c = small(512, 4096, 8, 64, Routing::Uniform);
    run_worlds("dropping_a_group_with_work_in_flight_is_safe", 2, |r| {
        let shape = shape_of(&c, r.world);
        let inputs = workload::rank_inputs(8, &shape, &vec![c.tokens; r.world], c.routing);
        let me = &inputs[r.rank];
        let s = &r.stream;
        let (x, w, idx) = upload(s, me)?;
        {
            let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
            let mut out = s
                .alloc_zeros::<bf16>(c.tokens * c.hidden)
                .map_err(Error::cuda("alloc"))?;
            for _ in 0..3 {
                let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
                let d = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
                group.combine(s, &handle, &d.tokens, None, &mut out)?;
            }
            // Handles, receive buffers and the group go here, work enqueued.
        }
        s.synchronize()
            .map_err(Error::cuda("sync after the drop"))?;
        r.comm.barrier(s)?;
        let group = EpGroup::new(&r.comm, r.config(c.experts, c.hidden, c.tokens)?)?;
        identity_round_trip(r, &group, &c, 8)?;
        r.comm.barrier(s)?;
        Ok(())
    });
}
