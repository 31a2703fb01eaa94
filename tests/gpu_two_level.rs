//! GPU tests of the two-level path over several nodes (an `EpGroup` whose
//! `ranks_per_node` makes several nodes; `multi-gpu`): on virtual nodes of virtual ranks on GPU 0 (2 x 1 at world
//! 2, 2 x 2 at world 4, 4 x 2 and 2 x 4 at world 8), and on real GPUs as
//! nodes of one GPU when there are at least two (the hop then runs over
//! NCCL).
//!
//! The case table is the NVLink path's (`tests/common/cases.rs`: one module
//! per case, a test per receive layout), plus routings of their own: every
//! expert on another node, every expert on the own node, a node with no
//! tokens. Each case runs layout, dispatch, combine and both backward passes
//! on every rank and checks them against the CPU
//! reference of the two-level path (`moe_ep::reference::two_level`):
//! dispatch bit for bit (`two_level_dispatch`: the flat rows, grouped by
//! forwarding rank, then home node, then token), combine bit for bit
//! against `combine_two_level_emulated` and within bf16 rounding of the
//! exact f64 sum, the same bits over repeated runs; the backward passes
//! against the flat references with the rows in the two-level order.
#![cfg(feature = "multi-gpu")]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use moe_ep::ops::{DeviceRegion, DispatchOut, TopkIdx};
use moe_ep::reference::{self as refr, RankInput, Shape};
use moe_ep::testkit::ranks::{ensure, run_ranks, worlds, Rank};
use moe_ep::testkit::workload::{self, Rng, Routing};
use moe_ep::{bf16, EpGroup, Error, GroupConfig, RecvLayout, Result, Topology};

#[macro_use]
#[path = "common/cases.rs"]
mod cases;
#[path = "common/device.rs"]
mod device;
use cases::{case, Case};
use device::{bits, down, f32_bits, first_diff, up, weights_per_row};

/// The case table at virtual nodes: one module per case, a test per layout.
macro_rules! two_level_table {
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

with_case_table!(two_level_table);

/// Where the tokens' experts lie.
#[derive(Clone, Copy, Debug)]
enum Route {
    /// The case's routing over all experts.
    Table,
    /// Every expert of every token on another node than the token's.
    AllRemote,
    /// Every expert of every token on the token's own node.
    AllLocal,
    /// The case's routing, and every rank of node 0 has no tokens.
    SilentNode,
}

/// A case of the table and where its experts lie.
#[derive(Clone, Copy, Debug)]
struct Run {
    case: Case,
    route: Route,
    /// Rows per chunk of the hop (`GroupConfig::hop_chunk_rows`).
    chunk_rows: usize,
}

const LAYOUTS: [RecvLayout; 2] = [
    RecvLayout::RankMajor,
    RecvLayout::ExpertMajor { alignment: 16 },
];

/// The ranks per node that make at least two nodes of a world.
fn per_node(world: usize) -> Vec<usize> {
    let mut g: Vec<usize> = match world {
        2 => vec![1],
        _ => vec![2, world / 2],
    };
    g.dedup();
    g.retain(|&g| g < world && world.is_multiple_of(g));
    g
}

fn shape_of(c: &Case, world: usize) -> Shape {
    Shape {
        num_ranks: world,
        num_experts: c.experts,
        hidden: c.hidden,
        topk: c.topk,
    }
}

/// Every rank's inputs of a run (the same on every rank).
fn inputs_of(run: &Run, topo: &Topology, seed: u64) -> Vec<RankInput> {
    let (c, world) = (&run.case, topo.world());
    let shape = shape_of(c, world);
    let tokens: Vec<usize> = (0..world)
        .map(|r| match run.route {
            Route::SilentNode if topo.node_of(r) == 0 => 0,
            _ if c.silent_rank == Some(r) => 0,
            _ => c.tokens,
        })
        .collect();
    let mut inputs = workload::rank_inputs(seed, &shape, &tokens, c.routing);
    let en = c.experts / topo.nodes();
    for (r, inp) in inputs.iter_mut().enumerate() {
        let n = topo.node_of(r);
        let pool: Vec<i64> = match run.route {
            Route::AllRemote => (0..c.experts)
                .filter(|e| e / en != n)
                .map(|e| e as i64)
                .collect(),
            Route::AllLocal => (n * en..(n + 1) * en).map(|e| e as i64).collect(),
            _ => continue,
        };
        let mut rng = Rng::new(seed ^ (0x7A0 + r as u64));
        for row in inp.topk_idx.chunks_mut(c.topk) {
            let mut p = pool.clone();
            rng.shuffle(&mut p);
            row.copy_from_slice(&p[..c.topk]);
        }
    }
    inputs
}

/// For each row of the two-level receive buffer, the flat buffer's row of
/// the same (home rank, token[, local expert]); a padding row maps to
/// itself (the blocks have the same starts in both).
fn flat_row_of(two: &refr::DispatchOutput, flat: &refr::DispatchOutput, per: usize) -> Vec<usize> {
    let key = |o: &refr::DispatchOutput, i: usize| {
        let (r, t) = o.src[i];
        let e = if per == 1 { o.topk_local_idx[i] } else { -1 };
        (r, t, e)
    };
    let at: HashMap<(i32, i32, i32), usize> =
        (0..flat.num_rows).map(|j| (key(flat, j), j)).collect();
    (0..two.num_rows)
        .map(|i| match two.src[i].0 < 0 {
            true => i,
            false => at[&key(two, i)],
        })
        .collect()
}

/// `rows` of `per` values in the two-level order, from the flat order.
fn permuted<T: Copy>(flat: &[T], perm: &[usize], per: usize) -> Vec<T> {
    perm.iter()
        .flat_map(|&j| flat[j * per..(j + 1) * per].iter().copied())
        .collect()
}

/// What one rank of a run needs of the reference.
struct PerRank {
    /// What it receives (the two-level order).
    want: refr::DispatchOutput,
    /// Its expert outputs and weight gradients in the two-level order.
    y: Vec<bf16>,
    gw: Vec<f32>,
    /// Per weighting (unweighted, then weighted for expert-major): its
    /// combine bit for bit, and exactly.
    emu: Vec<Vec<bf16>>,
    exact: Vec<Vec<f64>>,
    /// Its dispatch backward's weight gradients.
    want_gw: Vec<f32>,
    /// Its combine backward per weighting, in the two-level order.
    want_cb: Vec<Vec<bf16>>,
    /// Network rows per node, sent and received (0 at its own node).
    net_sent: Vec<usize>,
    net_recv: Vec<usize>,
}

/// What every rank of a run needs: computed once per world and node shape
/// (one thread per rank), shared by all ranks.
struct Fixture {
    topo: Topology,
    inputs: Vec<RankInput>,
    /// Every rank's output gradient (combine backward's input).
    grads: Vec<Vec<bf16>>,
    per: Vec<PerRank>,
    cap: usize,
}

fn build_fixture(
    run: &Run,
    world: usize,
    g: usize,
    layout: RecvLayout,
    seed: u64,
) -> Result<Fixture> {
    let c = &run.case;
    let topo = Topology::new(world, g)?;
    let shape = shape_of(c, world);
    let inputs = inputs_of(run, &topo, seed);
    let (h, k) = (c.hidden, c.topk);
    let wpr = weights_per_row(layout, k);
    let flats: Vec<refr::DispatchOutput> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|d| {
                let (shape, inputs) = (&shape, &inputs);
                sc.spawn(move || refr::dispatch(shape, inputs, d, layout))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("reference thread"))
            .collect::<Result<_>>()
    })?;
    let outs: Vec<Vec<bf16>> = flats
        .iter()
        .enumerate()
        .map(|(d, o)| workload::tokens(&mut Rng::new(seed ^ (0xE0 + d as u64)), o.num_rows, h))
        .collect();
    let gws: Vec<Vec<f32>> = flats
        .iter()
        .enumerate()
        .map(|(d, o)| {
            let mut rng = Rng::new(seed ^ (0x6A0 + d as u64));
            (0..o.num_rows * wpr)
                .map(|_| rng.f32_unit() - 0.5)
                .collect()
        })
        .collect();
    let grads: Vec<Vec<bf16>> = inputs
        .iter()
        .enumerate()
        .map(|(d, i)| {
            workload::tokens(
                &mut Rng::new(seed ^ (0x9B0 + d as u64)),
                i.topk_idx.len() / k,
                h,
            )
        })
        .collect();
    let traffic = refr::two_level_traffic(&shape, &topo, &inputs)?;
    let weightings: &[bool] = match layout {
        RecvLayout::RankMajor => &[false],
        RecvLayout::ExpertMajor { .. } => &[false, true],
    };
    let per: Vec<PerRank> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|d| {
                let (shape, topo, inputs, flats, outs, gws, grads, traffic) = (
                    &shape, &topo, &inputs, &flats, &outs, &gws, &grads, &traffic,
                );
                sc.spawn(move || -> Result<PerRank> {
                    let want = refr::two_level_dispatch(shape, topo, inputs, d, layout)?;
                    let perm = flat_row_of(&want, &flats[d], wpr);
                    let (mut emu, mut exact, mut want_cb) = (vec![], vec![], vec![]);
                    for &w in weightings {
                        emu.push(refr::combine_two_level_emulated(
                            shape, topo, inputs, outs, d, layout, w,
                        )?);
                        exact.push(refr::combine_f64(shape, inputs, outs, d, layout, w)?);
                        let cb = refr::combine_backward(shape, inputs, grads, d, layout, w)?;
                        want_cb.push(permuted(&cb, &perm, h));
                    }
                    let (_, want_gw) =
                        refr::dispatch_backward(shape, inputs, outs, gws, d, layout)?;
                    let node = topo.node_of(d);
                    let net = |v: &[usize]| -> Vec<usize> {
                        v.iter()
                            .enumerate()
                            .map(|(m, &n)| if m == node { 0 } else { n })
                            .collect()
                    };
                    Ok(PerRank {
                        y: permuted(&outs[d], &perm, h),
                        gw: permuted(&gws[d], &perm, wpr),
                        want,
                        emu,
                        exact,
                        want_gw,
                        want_cb,
                        net_sent: net(&traffic[d].net_sent),
                        net_recv: net(&traffic[d].net_recv),
                    })
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("reference thread"))
            .collect::<Result<_>>()
    })?;
    let cap = flats.iter().map(|o| o.num_rows).max().unwrap_or(0).max(1);
    Ok(Fixture {
        topo,
        inputs,
        grads,
        per,
        cap,
    })
}

/// The whole forward and backward of one run, one layout, on one rank.
fn run_case(r: &Rank, run: &Run, f: &Fixture, layout: RecvLayout) -> Result<()> {
    let c = &run.case;
    let (topo, mine) = (&f.topo, &f.per[r.rank]);
    let me = &f.inputs[r.rank];
    let (h, k) = (c.hidden, c.topk);
    let t = me.topk_idx.len() / k;
    let wpr = weights_per_row(layout, k);
    let want = &mine.want;
    let cap = f.cap;

    let mut cfg = GroupConfig::new(c.experts, h, c.tokens.max(1));
    cfg.ranks_per_node = topo.ranks_per_node();
    cfg.recv_capacity = cap;
    cfg.timeout = Duration::from_secs(10);
    cfg.combine_chunks = c.chunks;
    cfg.num_sms = r.sms(c.sms.min(8), c.experts / topo.nodes())?;
    cfg.hop_chunk_rows = run.chunk_rows;
    let group = EpGroup::new(&r.comm, cfg)?;
    ensure(group.is_two_level(), || {
        format!(
            "ranks_per_node {}: not the two-level path",
            topo.ranks_per_node()
        )
    })?;
    ensure(group.topology() == *topo, || {
        format!("topology {:?}, asked {topo:?}", group.topology())
    })?;
    let s = &r.stream;
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

    // Layout: the receive counts are the flat path's; the network rows the
    // reference's traffic.
    let handle = group.layout(s, idx, k, layout)?;
    let rows = want.num_rows;
    let got_rows = handle.recv_rows(s)?;
    ensure(got_rows == rows, || {
        format!("recv rows {got_rows} want {rows}")
    })?;
    let hc = handle.host_counts(s)?;
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
    first_diff(
        "network rows sent",
        handle.network_rows_sent().unwrap_or_default(),
        &mine.net_sent,
    )?;
    first_diff(
        "network rows received",
        handle.network_rows_received().unwrap_or_default(),
        &mine.net_recv,
    )?;

    // Dispatch, pool buffers: bit for bit.
    let got = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
    // A wait that timed out (a node peer, a chunk of the hop) by its name,
    // before the rows it left unwritten.
    s.synchronize()
        .map_err(|e| Error::InvalidState(format!("dispatch: {e}")))?;
    group.check()?;
    first_diff(
        "dispatch tokens",
        &bits(&down(s, &got.tokens, rows * h)?),
        &bits(&want.tokens),
    )?;
    first_diff(
        "dispatch weights",
        &f32_bits(&down(s, &got.topk_weights, rows * wpr)?),
        &f32_bits(&want.topk_weights),
    )?;
    first_diff(
        "dispatch expert ids",
        &down(s, &got.topk_idx, rows * wpr)?,
        &want.topk_local_idx,
    )?;
    let want_src: Vec<i32> = want.src.iter().flat_map(|&(a, b)| [a, b]).collect();
    first_diff("dispatch source", &down(s, &got.src, rows * 2)?, &want_src)?;

    // Zero copy: the caller's buffers of the node group's pool, written in
    // place with the same rows.
    {
        let pool = group.pool();
        let mut rt = pool.alloc::<bf16>(group.recv_capacity() * h)?;
        let mut rw = pool.alloc::<f32>(group.recv_capacity() * wpr)?;
        let ptr = rt.device_ptr();
        let zc = group.dispatch(
            s,
            &handle,
            &x,
            &w,
            DispatchOut {
                recv_tokens: Some(&mut rt),
                recv_topk_weights: Some(&mut rw),
            },
        )?;
        ensure(
            zc.tokens.is_callers() && zc.tokens.device_ptr() == ptr,
            || "zero copy: the tokens did not land in the caller's buffer".into(),
        )?;
        drop(zc);
        first_diff(
            "zero-copy dispatch tokens",
            &bits(&down(s, &rt, rows * h)?),
            &bits(&want.tokens),
        )?;
        first_diff(
            "zero-copy dispatch weights",
            &f32_bits(&down(s, &rw, rows * wpr)?),
            &f32_bits(&want.topk_weights),
        )?;
    }

    // Combine, the expert outputs in the two-level order: bit for bit the
    // reference's emulation, within bf16 rounding of exact, the same bits
    // on every run.
    let mut y_rows = mine.y.clone();
    y_rows.resize(cap * h, bf16::ZERO);
    let y = up(s, &y_rows)?;
    let mut out = s
        .alloc_zeros::<bf16>((t * h).max(1))
        .map_err(Error::cuda("alloc"))?;
    for (i, weighted) in [false, true].into_iter().take(mine.emu.len()).enumerate() {
        let wts: Option<&dyn DeviceRegion<f32>> = weighted.then_some(&got.topk_weights as _);
        group.combine(s, &handle, &y, wts, &mut out)?;
        let first = bits(&down(s, &out, t * h)?);
        first_diff(
            &format!("combine (weighted={weighted}) vs emulated f32"),
            &first,
            &bits(&mine.emu[i]),
        )?;
        let got_bf: Vec<bf16> = first.iter().map(|&b| bf16::from_bits(b)).collect();
        refr::check_close_bf16(&got_bf, &mine.exact[i], r.world + topo.nodes())
            .map_err(|e| Error::InvalidState(format!("combine vs f64: {e}")))?;
        for run in 1..4 {
            group.combine(s, &handle, &y, wts, &mut out)?;
            ensure(bits(&down(s, &out, t * h)?) == first, || {
                format!("combine run {run} differs from run 0")
            })?;
        }
    }
    if matches!(layout, RecvLayout::RankMajor) {
        // The expert outputs in symmetric memory of the node: read in place
        // by the forwarding ranks, the same bits.
        let mut ys = group.pool().alloc::<bf16>(cap * h)?;
        ys.copy_from_device(s, &y)?;
        group.combine(s, &handle, &ys, None, &mut out)?;
        first_diff(
            "combine from symmetric memory",
            &bits(&down(s, &out, t * h)?),
            &bits(&mine.emu[0]),
        )?;
    }

    // Dispatch backward: the gradient rows summed home as combine sums
    // (unweighted), the weight gradients routed back to their slots.
    let mut gw_rows = mine.gw.clone();
    gw_rows.resize(cap * wpr, 0.0);
    let gw_in = up(s, &gw_rows)?;
    let mut grad_x = s
        .alloc_zeros::<bf16>((t * h).max(1))
        .map_err(Error::cuda("alloc"))?;
    let mut grad_w = up(s, &vec![f32::from_bits(u32::MAX); (t * k).max(1)])?;
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
    first_diff(
        "dispatch_backward grad tokens",
        &bits(&down(s, &grad_x, t * h)?),
        &bits(&mine.emu[0]),
    )?;
    first_diff(
        "dispatch_backward grad weights",
        &f32_bits(&down(s, &grad_w, t * k)?),
        &f32_bits(&mine.want_gw),
    )?;

    // Combine backward: the output gradient sent to every row of its token
    // (scaled by the row's weight when weighted).
    let g_buf = up(s, &f.grads[r.rank])?;
    let g = g_buf.slice(0..t * h);
    for (i, weighted) in [false, true]
        .into_iter()
        .take(mine.want_cb.len())
        .enumerate()
    {
        let wts: Option<&dyn DeviceRegion<f32>> = weighted.then_some(&got.topk_weights as _);
        let gx = group.combine_backward(s, &handle, &g, wts, None)?;
        first_diff(
            &format!("combine_backward (weighted={weighted})"),
            &bits(&down(s, &gx, rows * h)?),
            &bits(&mine.want_cb[i]),
        )?;
    }
    r.comm.barrier(s)?;
    Ok(())
}

/// Runs `run` in `layout` at every world's node shapes (`test` names it).
fn run_at_nodes(test: &str, run: Run, layout: RecvLayout, seed: u64) {
    for world in worlds(test, 2) {
        if !run.case.experts.is_multiple_of(world.size) {
            eprintln!("  SKIP {test} at {world}: {} experts", run.case.experts);
            continue;
        }
        for g in per_node(world.size) {
            let f = build_fixture(&run, world.size, g, layout, seed).expect("the reference");
            run_ranks(world, |r| {
                run_case(r, &run, &f, layout).map_err(|e| {
                    Error::InvalidState(format!(
                        "{test}: {} nodes x {g}, {layout:?}: {e}",
                        world.size / g
                    ))
                })
            });
            eprintln!("    {} nodes x {g} ranks: ok", world.size / g);
        }
    }
}

/// One case of the table in one layout.
fn table_case(id: &str, c: Case, layout: RecvLayout) {
    assert_eq!(
        id,
        c.id(),
        "the test's name must be the id of its case's fields"
    );
    let seed = 2000
        + id.bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64))
            % 1000;
    let run = Run {
        case: c,
        route: Route::Table,
        chunk_rows: moe_ep::ops::DEFAULT_HOP_CHUNK_ROWS,
    };
    run_at_nodes(&format!("{id}::{layout:?}"), run, layout, seed);
}

/// A routing of this file's own in both layouts.
fn routed_case(test: &str, c: Case, route: Route, seed: u64) {
    for layout in LAYOUTS {
        run_at_nodes(
            &format!("{test}::{layout:?}"),
            Run {
                case: c,
                route,
                chunk_rows: moe_ep::ops::DEFAULT_HOP_CHUNK_ROWS,
            },
            layout,
            seed,
        );
    }
}

/// Every token's experts on other nodes: everything crosses the network,
/// nothing stays home.
#[test]
fn all_experts_on_other_nodes() {
    let c = case(64, 1024, 2, 16, Routing::Uniform);
    routed_case("all_experts_on_other_nodes", c, Route::AllRemote, 13);
}

/// Every token's experts on its own node: nothing crosses the network.
#[test]
fn all_experts_on_the_own_node() {
    let c = case(64, 1024, 2, 16, Routing::Uniform);
    routed_case("all_experts_on_the_own_node", c, Route::AllLocal, 14);
}

/// Node 0's ranks have no tokens: they send nothing and still receive.
#[test]
fn a_node_that_sends_nothing() {
    let c = case(50, 2048, 4, 32, Routing::Masked { masked_share: 0.2 });
    routed_case("a_node_that_sends_nothing", c, Route::SilentNode, 15);
}

/// The refusal tests' case: 20 tokens a rank, hidden 512, top-4 of 32.
fn refusal_case() -> (Case, Run) {
    let c = case(20, 512, 4, 32, Routing::Uniform);
    let run = Run {
        case: c,
        route: Route::Table,
        chunk_rows: moe_ep::ops::DEFAULT_HOP_CHUNK_ROWS,
    };
    (c, run)
}

/// A refusal test's topology of `g` ranks a node, every rank's inputs and
/// the group.
fn refusal_group(
    r: &Rank,
    c: &Case,
    run: &Run,
    g: usize,
    seed: u64,
) -> Result<(Topology, Vec<RankInput>, EpGroup)> {
    let topo = Topology::new(r.world, g)?;
    let inputs = inputs_of(run, &topo, seed);
    let mut cfg = GroupConfig::new(c.experts, c.hidden, c.tokens);
    cfg.ranks_per_node = g;
    cfg.num_sms = r.sms(4, c.experts / topo.nodes())?;
    let group = EpGroup::new(&r.comm, cfg)?;
    Ok((topo, inputs, group))
}

/// After a refusal: the group dispatches a good batch, bit for bit.
fn still_works(
    r: &Rank,
    group: &EpGroup,
    c: &Case,
    topo: &Topology,
    inputs: &[RankInput],
    what: &str,
) -> Result<()> {
    let s = &r.stream;
    let me = &inputs[r.rank];
    let (x, w, idx) = (
        up(s, &me.tokens)?,
        up(s, &me.topk_weights)?,
        up(s, &me.topk_idx)?,
    );
    let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
    let got = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
    let shape = shape_of(c, r.world);
    let want = refr::two_level_dispatch(&shape, topo, inputs, r.rank, RecvLayout::RankMajor)?;
    first_diff(
        what,
        &bits(&down(s, &got.tokens, want.num_rows * c.hidden)?),
        &bits(&want.tokens),
    )?;
    r.comm.barrier(s)
}

/// A bad expert id on rank 0 (out of range, then the same expert twice in
/// a token): every rank's layout refuses it, naming rank 0, the token and
/// the slot; then the group runs a good batch.
#[test]
fn bad_expert_id_is_refused_on_every_rank() {
    let test = "bad_expert_id_is_refused_on_every_rank";
    let (c, run) = refusal_case();
    for world in worlds(test, 2) {
        let g = per_node(world.size)[0];
        run_ranks(world, |r| {
            let (topo, inputs, group) = refusal_group(r, &c, &run, g, 16)?;
            let s = &r.stream;
            for (value, want) in [
                (c.experts as i64, "not in [-1, 32)"),
                (-7, "not in [-1, 32)"),
            ] {
                let mut idx = inputs[r.rank].topk_idx.clone();
                if r.rank == 0 {
                    idx[3 * c.topk + 1] = value;
                }
                let d = up(s, &idx)?;
                match group.layout(s, TopkIdx::I64(&d), c.topk, RecvLayout::RankMajor) {
                    Err(Error::InvalidDeviceData {
                        arg: "topk_idx",
                        detail,
                    }) if detail.contains("rank 0")
                        && detail.contains("token 3 slot 1")
                        && (r.rank != 0 || detail.contains(want)) => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "expert id {value}: expected InvalidDeviceData naming rank 0, \
                             token 3 slot 1, got {:?}",
                            other.err()
                        )))
                    }
                }
            }
            let mut idx = inputs[r.rank].topk_idx.clone();
            if r.rank == 0 {
                idx[3 * c.topk + 2] = idx[3 * c.topk];
            }
            let d = up(s, &idx)?;
            match group.layout(s, TopkIdx::I64(&d), c.topk, RecvLayout::RankMajor) {
                Err(Error::InvalidDeviceData { detail, .. })
                    if detail.contains("rank 0")
                        && detail.contains("token 3 slot 2")
                        && detail.contains("twice") => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "a repeated expert: expected InvalidDeviceData naming rank 0, token 3 \
                         slot 2, got {:?}",
                        other.err()
                    )))
                }
            }
            still_works(r, &group, &c, &topo, &inputs, "dispatch after the refusals")
        });
    }
}

/// A layout this rank's host refuses (its topk_idx one element short of
/// [T, K], on the last rank only): that rank gets InvalidArgument naming
/// topk_idx, every other rank PeerFailed naming it and topk_idx, all at
/// once (within 2 s; the host collectives would wait 60 s); then the group
/// runs a good batch.
#[test]
fn a_refused_layout_on_one_rank_fails_every_rank_at_once() {
    let test = "a_refused_layout_on_one_rank_fails_every_rank_at_once";
    let (c, run) = refusal_case();
    for world in worlds(test, 2) {
        let g = per_node(world.size)[0];
        run_ranks(world, |r| {
            let (topo, inputs, group) = refusal_group(r, &c, &run, g, 17)?;
            let s = &r.stream;
            let me = &inputs[r.rank];
            let idx = up(s, &me.topk_idx)?;
            let bad = r.world - 1;
            let n = if r.rank == bad {
                me.topk_idx.len() - 1
            } else {
                me.topk_idx.len()
            };
            r.comm.barrier(s)?;
            let t0 = Instant::now();
            let got = group.layout(
                s,
                TopkIdx::I64(&idx.slice(0..n)),
                c.topk,
                RecvLayout::RankMajor,
            );
            let took = t0.elapsed();
            match got {
                Err(Error::InvalidArgument {
                    arg: "topk_idx", ..
                }) if r.rank == bad => {}
                Err(Error::PeerFailed {
                    peer,
                    arg: Some("topk_idx"),
                    ..
                }) if r.rank != bad && peer == bad => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "rank {}: expected {} (rank {bad} refused its topk_idx), got {:?}",
                        r.rank,
                        if r.rank == bad {
                            "InvalidArgument naming topk_idx"
                        } else {
                            "PeerFailed naming it and topk_idx"
                        },
                        other.err()
                    )))
                }
            }
            if took > Duration::from_secs(2) {
                return Err(Error::InvalidState(format!(
                    "rank {}: the refused layout took {took:?} (want under 2 s)",
                    r.rank
                )));
            }
            group.check()?;
            still_works(
                r,
                &group,
                &c,
                &topo,
                &inputs,
                "dispatch after the refused layout",
            )
        });
    }
}

/// Every op's hop one row per chunk (every row its own arrival flag and
/// progress counter, the most rounds), in chunks of 16 rows, and in one
/// chunk per stream (one flag and counter per rail peer), in both layouts:
/// the same results as the table's default chunks.
#[test]
fn hop_in_single_rows_and_in_one_chunk() {
    let c = case(127, 2048, 8, 64, Routing::Uniform);
    for chunk_rows in [1, 16, 4096] {
        for layout in LAYOUTS {
            run_at_nodes(
                &format!("hop_in_single_rows_and_in_one_chunk::{chunk_rows}::{layout:?}"),
                Run {
                    case: c,
                    route: Route::Table,
                    chunk_rows,
                },
                layout,
                17,
            );
        }
    }
}

/// A hop chunk of 0 rows, one past the progress counters' 2^30 vectors,
/// and chunk rows that differ between ranks, are refused by name on every
/// rank.
#[test]
fn bad_hop_chunk_rows_are_refused_by_name() {
    let test = "bad_hop_chunk_rows_are_refused_by_name";
    for world in worlds(test, 2) {
        run_ranks(world, |r| {
            let mut cfg = GroupConfig::new(64, 512, 16);
            cfg.ranks_per_node = per_node(r.world)[0];
            cfg.num_sms = r.sms(4, 64 / (r.world / cfg.ranks_per_node))?;
            match EpGroup::new(
                &r.comm,
                GroupConfig {
                    hop_chunk_rows: 0,
                    ..cfg.clone()
                },
            ) {
                Err(Error::InvalidArgument {
                    arg: "hop_chunk_rows",
                    ..
                }) => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "hop_chunk_rows 0: expected an error naming hop_chunk_rows, got {:?}",
                        other.err()
                    )))
                }
            }
            // Hidden 512: 64 vectors a row, so 2^24 rows fill 2^30.
            match EpGroup::new(
                &r.comm,
                GroupConfig {
                    hop_chunk_rows: (1 << 24) + 1,
                    ..cfg.clone()
                },
            ) {
                Err(Error::InvalidArgument {
                    arg: "hop_chunk_rows",
                    ..
                }) => {}
                other => {
                    return Err(Error::InvalidState(format!(
                        "hop_chunk_rows 2^24 + 1 at hidden 512: expected an error naming \
                         hop_chunk_rows, got {:?}",
                        other.err()
                    )))
                }
            }
            let rows = if r.rank == 0 { 32 } else { 64 };
            match EpGroup::new(
                &r.comm,
                GroupConfig {
                    hop_chunk_rows: rows,
                    ..cfg
                },
            ) {
                Err(Error::InvalidArgument {
                    arg: "hop_chunk_rows",
                    ..
                }) => Ok(()),
                other => Err(Error::InvalidState(format!(
                    "hop_chunk_rows {rows} on rank {}: expected an error naming \
                     hop_chunk_rows on every rank, got {:?}",
                    r.rank,
                    other.err()
                ))),
            }
        });
    }
}

/// Bad configurations are refused by name on every rank:
/// a world that is not a multiple of `ranks_per_node`,
/// low-latency mode (these before any collective step), and (ranks sharing
/// a GPU) a `num_sms` that leaves no block for combine's hop. (More than 8 ranks per node needs a world of 16; the
/// check is `GroupConfig`'s, tested on the CPU in `tests/cpu_api.rs`.)
#[test]
fn bad_configurations_are_refused_by_name() {
    let test = "bad_configurations_are_refused_by_name";
    for world in worlds(test, 2) {
        run_ranks(world, |r| {
            let base = GroupConfig::new(64, 512, 16);
            let refused = |g: usize, ll: bool, arg: &str, text: &str| -> Result<()> {
                let mut cfg = base.clone();
                cfg.ranks_per_node = g;
                if ll {
                    cfg.mode = moe_ep::Mode::LowLatency;
                }
                match EpGroup::new(&r.comm, cfg) {
                    Err(e) if e.to_string().contains(text) && format!("{e:?}").contains(arg) => {
                        Ok(())
                    }
                    Err(e) => Err(Error::InvalidState(format!(
                        "ranks_per_node {g}: expected an error naming {arg} ({text}), got {e}"
                    ))),
                    Ok(_) => Err(Error::InvalidState(format!(
                        "ranks_per_node {g}: expected an error naming {arg}, got a group"
                    ))),
                }
            };
            refused(r.world + 1, false, "ranks_per_node", "divisor")?;
            refused(1, true, "mode", "HighThroughput")?;
            // Ranks on one GPU: combine's hop needs one block per rank
            // beside the node combine's, so the most that fit is refused.
            if r.comm.ranks_per_gpu() > 1 {
                let mut cfg = base.clone();
                cfg.ranks_per_node = 1;
                cfg.num_sms = moe_ep::ops::residency(&r.comm, 64 / r.world)?.max_blocks_per_rank();
                match EpGroup::new(&r.comm, cfg) {
                    Err(Error::InvalidArgument { arg: "num_sms", .. }) => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "num_sms at the residency limit: expected an error naming num_sms, got {:?}",
                            other.err()
                        )))
                    }
                }
            }
            Ok(())
        });
    }
}
