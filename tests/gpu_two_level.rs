//! GPU tests of the two-level path over several nodes (`TwoLevelGroup`;
//! `multi-gpu`): on virtual nodes of virtual ranks on GPU 0 (2 x 1 at world
//! 2, 2 x 2 at world 4, 4 x 2 and 2 x 4 at world 8), and on real GPUs as
//! nodes of one GPU when there are at least two (the hop then runs over
//! NCCL).
//!
//! Each case runs layout, dispatch, combine and both backward passes in
//! both receive layouts on every rank and checks them against the CPU
//! reference of the two-level path (`moe_ep::reference::two_level`):
//! dispatch bit for bit (`two_level_dispatch`: the flat rows, grouped by
//! forwarding rank, then home node, then token), combine bit for bit
//! against `combine_two_level_emulated` and within bf16 rounding of the
//! exact f64 sum, the same bits over repeated runs; the backward passes
//! against the flat references with the rows in the two-level order.
#![cfg(feature = "multi-gpu")]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use moe_ep::cuda::{CudaSlice, CudaStream};
use moe_ep::ops::{DeviceRegion, DispatchOut, TopkIdx, TwoLevelGroup};
use moe_ep::reference::{self as refr, RankInput, Shape};
use moe_ep::testkit::ranks::{ensure, run_ranks, worlds, Rank};
use moe_ep::testkit::workload::{self, Rng, Routing};
use moe_ep::{bf16, Error, GroupConfig, RecvLayout, Result, Topology};

/// Where the tokens' experts lie.
#[derive(Clone, Copy, Debug)]
enum Route {
    /// The workload generator's routing over all experts.
    Random(Routing),
    /// Every expert of every token on another node than the token's.
    AllRemote,
    /// Every expert of every token on the token's own node.
    AllLocal,
    /// Random, and every rank of node 0 has no tokens.
    SilentNode,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    route: Route,
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

/// Every rank's inputs of a case (the same on every rank).
fn inputs_of(c: &Case, topo: &Topology, seed: u64) -> Vec<RankInput> {
    let world = topo.world();
    let shape = shape_of(c, world);
    let tokens: Vec<usize> = (0..world)
        .map(|r| match c.route {
            Route::SilentNode if topo.node_of(r) == 0 => 0,
            _ => c.tokens,
        })
        .collect();
    let routing = match c.route {
        Route::Random(r) => r,
        _ => Routing::Uniform,
    };
    let mut inputs = workload::rank_inputs(seed, &shape, &tokens, routing);
    let en = c.experts / topo.nodes();
    for (r, inp) in inputs.iter_mut().enumerate() {
        let n = topo.node_of(r);
        let pool: Vec<i64> = match c.route {
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

fn up<T: moe_ep::cuda::DeviceRepr + moe_ep::cuda::ValidAsZeroBits>(
    s: &Arc<CudaStream>,
    v: &[T],
) -> Result<CudaSlice<T>> {
    if v.is_empty() {
        return s.alloc_zeros::<T>(1).map_err(Error::cuda("alloc"));
    }
    s.synchronize().map_err(Error::cuda("sync"))?;
    s.clone_htod(v).map_err(Error::cuda("htod"))
}

fn down<T: moe_ep::cuda::DeviceRepr + Default + Clone>(
    s: &Arc<CudaStream>,
    r: &dyn DeviceRegion<T>,
    n: usize,
) -> Result<Vec<T>> {
    let mut host = vec![T::default(); n];
    if n == 0 {
        return Ok(host);
    }
    s.synchronize().map_err(Error::cuda("sync"))?;
    // SAFETY: r holds at least n elements (sized by the callers).
    unsafe {
        moe_ep::cuda::result::memcpy_dtoh_async(&mut host, r.device_ptr(), s.cu_stream())
            .map_err(Error::cuda("dtoh"))?;
    }
    s.synchronize().map_err(Error::cuda("sync"))?;
    Ok(host)
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn fbits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn first_diff<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) -> Result<()> {
    ensure(got.len() == want.len(), || {
        format!("{what}: {} values, want {}", got.len(), want.len())
    })?;
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        return Err(Error::InvalidState(format!(
            "{what}: first difference at {i}: got {:?}, want {:?}",
            got[i], want[i]
        )));
    }
    Ok(())
}

fn weights_per_row(layout: RecvLayout, k: usize) -> usize {
    match layout {
        RecvLayout::RankMajor => k,
        RecvLayout::ExpertMajor { .. } => 1,
    }
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

/// The whole forward and backward of one case, one layout, on one rank of
/// a world of nodes of `g` ranks.
fn run_case(r: &Rank, g: usize, c: &Case, layout: RecvLayout, seed: u64) -> Result<()> {
    let topo = Topology::new(r.world, g)?;
    let shape = shape_of(c, r.world);
    let inputs = inputs_of(c, &topo, seed);
    let me = &inputs[r.rank];
    let (h, k) = (c.hidden, c.topk);
    let t = me.topk_idx.len() / k;
    let wpr = weights_per_row(layout, k);
    let flats: Vec<refr::DispatchOutput> = (0..r.world)
        .map(|d| refr::dispatch(&shape, &inputs, d, layout))
        .collect::<Result<_>>()?;
    let want = refr::two_level_dispatch(&shape, &topo, &inputs, r.rank, layout)?;
    let flat = &flats[r.rank];
    let perm = flat_row_of(&want, flat, wpr);
    let cap = flats.iter().map(|o| o.num_rows).max().unwrap_or(0).max(1);

    let mut cfg = GroupConfig::new(c.experts, h, c.tokens.max(1));
    cfg.ranks_per_node = g;
    cfg.recv_capacity = cap;
    cfg.timeout = Duration::from_secs(10);
    cfg.num_sms = r.sms(8, c.experts / topo.nodes())?;
    let group = TwoLevelGroup::new(&r.comm, cfg)?;
    let s = &r.stream;
    let (x_buf, w_buf, idx_buf) = (
        up(s, &me.tokens)?,
        up(s, &me.topk_weights)?,
        up(s, &me.topk_idx)?,
    );
    let (x, w, idx) = (
        x_buf.slice(0..t * h),
        w_buf.slice(0..t * k),
        idx_buf.slice(0..t * k),
    );

    // Layout: the receive counts are the flat path's.
    let handle = group.layout(s, TopkIdx::I64(&idx), k, layout)?;
    let rows = want.num_rows;
    ensure(handle.recv_rows() == rows && flat.num_rows == rows, || {
        format!(
            "recv rows {} want {rows} (flat {})",
            handle.recv_rows(),
            flat.num_rows
        )
    })?;
    let hc = handle.node_handle().host_counts(s)?;
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
    let traffic = refr::two_level_traffic(&shape, &topo, &inputs)?;
    let mine = &traffic[r.rank];
    let me_node = topo.node_of(r.rank);
    let net = |v: &[usize]| -> Vec<usize> {
        v.iter()
            .enumerate()
            .map(|(m, &n)| if m == me_node { 0 } else { n })
            .collect()
    };
    first_diff(
        "network rows sent",
        handle.network_rows_sent(),
        &net(&mine.net_sent),
    )?;
    first_diff(
        "network rows received",
        handle.network_rows_received(),
        &net(&mine.net_recv),
    )?;

    // Dispatch, pool buffers: bit for bit.
    let got = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
    first_diff(
        "dispatch tokens",
        &bits(&down(s, &got.tokens, rows * h)?),
        &bits(&want.tokens),
    )?;
    first_diff(
        "dispatch weights",
        &fbits(&down(s, &got.topk_weights, rows * wpr)?),
        &fbits(&want.topk_weights),
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
        let pool = group.node_group().pool();
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
            &fbits(&down(s, &rw, rows * wpr)?),
            &fbits(&want.topk_weights),
        )?;
    }

    // Combine: every rank's expert outputs in the flat order (the
    // reference's), each rank's given to the kernels in its two-level order.
    let outs: Vec<Vec<bf16>> = flats
        .iter()
        .enumerate()
        .map(|(d, o)| workload::tokens(&mut Rng::new(seed ^ (0xE0 + d as u64)), o.num_rows, h))
        .collect();
    let mut y_rows = permuted(&outs[r.rank], &perm, h);
    y_rows.resize(cap * h, bf16::ZERO);
    let y = up(s, &y_rows)?;
    let mut out = s
        .alloc_zeros::<bf16>((t * h).max(1))
        .map_err(Error::cuda("alloc"))?;
    let weightings: &[bool] = match layout {
        RecvLayout::RankMajor => &[false],
        RecvLayout::ExpertMajor { .. } => &[false, true],
    };
    for &weighted in weightings {
        let wts: Option<&dyn DeviceRegion<f32>> = weighted.then_some(&got.topk_weights as _);
        group.combine(s, &handle, &y, wts, &mut out)?;
        let first = bits(&down(s, &out, t * h)?);
        let emu = refr::combine_two_level_emulated(
            &shape, &topo, &inputs, &outs, r.rank, layout, weighted,
        )?;
        first_diff(
            &format!("combine (weighted={weighted}) vs emulated f32"),
            &first,
            &bits(&emu),
        )?;
        let exact = refr::combine_f64(&shape, &inputs, &outs, r.rank, layout, weighted)?;
        let got_bf: Vec<bf16> = first.iter().map(|&b| bf16::from_bits(b)).collect();
        refr::check_close_bf16(&got_bf, &exact, r.world + topo.nodes())
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
        let mut ys = group.node_group().pool().alloc::<bf16>(cap * h)?;
        ys.copy_from_device(s, &y)?;
        group.combine(s, &handle, &ys, None, &mut out)?;
        let emu =
            refr::combine_two_level_emulated(&shape, &topo, &inputs, &outs, r.rank, layout, false)?;
        first_diff(
            "combine from symmetric memory",
            &bits(&down(s, &out, t * h)?),
            &bits(&emu),
        )?;
    }

    // Dispatch backward: the gradient rows summed home as combine sums
    // (unweighted), the weight gradients routed back to their slots.
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
    let mut gw_rows = permuted(&gws[r.rank], &perm, wpr);
    gw_rows.resize(cap * wpr, 0.0);
    let gw_in = up(s, &gw_rows)?;
    let mut grad_x = s
        .alloc_zeros::<bf16>((t * h).max(1))
        .map_err(Error::cuda("alloc"))?;
    let mut grad_w = up(s, &vec![f32::from_bits(u32::MAX); (t * k).max(1)])?;
    group.dispatch_backward(s, &handle, &y, Some(&gw_in), &mut grad_x, Some(&mut grad_w))?;
    let want_gx =
        refr::combine_two_level_emulated(&shape, &topo, &inputs, &outs, r.rank, layout, false)?;
    let (_, want_gw) = refr::dispatch_backward(&shape, &inputs, &outs, &gws, r.rank, layout)?;
    first_diff(
        "dispatch_backward grad tokens",
        &bits(&down(s, &grad_x, t * h)?),
        &bits(&want_gx),
    )?;
    first_diff(
        "dispatch_backward grad weights",
        &fbits(&down(s, &grad_w, t * k)?),
        &fbits(&want_gw),
    )?;

    // Combine backward: the output gradient sent to every row of its token
    // (scaled by the row's weight when weighted).
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
    let g_buf = up(s, &grads[r.rank])?;
    let g = g_buf.slice(0..t * h);
    for &weighted in weightings {
        let wts: Option<&dyn DeviceRegion<f32>> = weighted.then_some(&got.topk_weights as _);
        let gx = group.combine_backward(s, &handle, &g, wts, None)?;
        let want_g = refr::combine_backward(&shape, &inputs, &grads, r.rank, layout, weighted)?;
        first_diff(
            &format!("combine_backward (weighted={weighted})"),
            &bits(&down(s, &gx, rows * h)?),
            &bits(&permuted(&want_g, &perm, h)),
        )?;
    }
    r.comm.barrier(s)?;
    Ok(())
}

/// Runs `c` in both layouts at every world's node shapes.
fn run_table_case(test: &str, c: Case, seed: u64) {
    for world in worlds(test, 2) {
        for g in per_node(world.size) {
            for layout in LAYOUTS {
                run_ranks(world, |r| {
                    run_case(r, g, &c, layout, seed).map_err(|e| {
                        Error::InvalidState(format!(
                            "{test}: {} nodes x {g}, {layout:?}: {e}",
                            world.size / g
                        ))
                    })
                });
                eprintln!("    {} nodes x {g} ranks, {layout:?}: ok", world.size / g);
            }
        }
    }
}

#[test]
fn uniform_t127_h2048_k8_e64() {
    let c = Case {
        tokens: 127,
        hidden: 2048,
        topk: 8,
        experts: 64,
        route: Route::Random(Routing::Uniform),
    };
    run_table_case("uniform_t127_h2048_k8_e64", c, 11);
}

#[test]
fn masked30_t300_h4096_k4_e32() {
    let c = Case {
        tokens: 300,
        hidden: 4096,
        topk: 4,
        experts: 32,
        route: Route::Random(Routing::Masked { masked_share: 0.3 }),
    };
    run_table_case("masked30_t300_h4096_k4_e32", c, 12);
}

/// Every token's experts on other nodes: everything crosses the network,
/// nothing stays home.
#[test]
fn all_experts_on_other_nodes() {
    let c = Case {
        tokens: 64,
        hidden: 1024,
        topk: 2,
        experts: 16,
        route: Route::AllRemote,
    };
    run_table_case("all_experts_on_other_nodes", c, 13);
}

/// Every token's experts on its own node: nothing crosses the network.
#[test]
fn all_experts_on_the_own_node() {
    let c = Case {
        tokens: 64,
        hidden: 1024,
        topk: 2,
        experts: 16,
        route: Route::AllLocal,
    };
    run_table_case("all_experts_on_the_own_node", c, 14);
}

/// Node 0's ranks have no tokens: they send nothing and still receive.
#[test]
fn a_node_that_sends_nothing() {
    let c = Case {
        tokens: 50,
        hidden: 2048,
        topk: 4,
        experts: 32,
        route: Route::SilentNode,
    };
    run_table_case("a_node_that_sends_nothing", c, 15);
}

/// A bad expert id on rank 0 (out of range, then the same expert twice in
/// a token): every rank's layout refuses it, naming rank 0, the token and
/// the slot; then the group runs a good batch.
#[test]
fn bad_expert_id_is_refused_on_every_rank() {
    let test = "bad_expert_id_is_refused_on_every_rank";
    let c = Case {
        tokens: 20,
        hidden: 512,
        topk: 4,
        experts: 32,
        route: Route::Random(Routing::Uniform),
    };
    for world in worlds(test, 2) {
        let g = per_node(world.size)[0];
        run_ranks(world, |r| {
            let topo = Topology::new(r.world, g)?;
            let inputs = inputs_of(&c, &topo, 16);
            let mut cfg = GroupConfig::new(c.experts, c.hidden, c.tokens);
            cfg.ranks_per_node = g;
            cfg.num_sms = r.sms(4, c.experts / topo.nodes())?;
            let group = TwoLevelGroup::new(&r.comm, cfg)?;
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
            // The group still works.
            let me = &inputs[r.rank];
            let (x, w, idx) = (
                up(s, &me.tokens)?,
                up(s, &me.topk_weights)?,
                up(s, &me.topk_idx)?,
            );
            let handle = group.layout(s, TopkIdx::I64(&idx), c.topk, RecvLayout::RankMajor)?;
            let got = group.dispatch(s, &handle, &x, &w, DispatchOut::default())?;
            let shape = shape_of(&c, r.world);
            let want =
                refr::two_level_dispatch(&shape, &topo, &inputs, r.rank, RecvLayout::RankMajor)?;
            first_diff(
                "dispatch after the refusals",
                &bits(&down(s, &got.tokens, want.num_rows * c.hidden)?),
                &bits(&want.tokens),
            )?;
            r.comm.barrier(s)
        });
    }
}

/// Bad configurations are refused by name before any collective step: one
/// node (EpGroup's), a world that is not a multiple of `ranks_per_node`,
/// low-latency mode. (More than 8 ranks per node needs a world of 16; the
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
                match TwoLevelGroup::new(&r.comm, cfg) {
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
            refused(0, false, "ranks_per_node", "one node runs on EpGroup")?;
            refused(r.world, false, "ranks_per_node", "one node runs on EpGroup")?;
            refused(r.world + 1, false, "ranks_per_node", "divisor")?;
            refused(1, true, "mode", "HighThroughput")?;
            Ok(())
        });
    }
}
