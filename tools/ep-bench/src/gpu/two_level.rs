//! `--ranks-per-node N`: one case on the two-level path (an `EpGroup` of several nodes),
//! the world as nodes of N ranks.
//!
//! Per op it reports, beside the time, the NVLink bytes of the forwarding
//! inside the nodes and the network bytes this rank sends to its rail
//! peers (`net GB/s`):
//!
//! | op | network bytes sent by a rank |
//! |---|---|
//! | layout | its network rows x (4K ids + 8 origin) |
//! | dispatch | its network rows x (2H row + 4K weights) |
//! | combine | the rows it forwarded x 2H (the partials go back) |
//! | dispatch-bwd | the rows it forwarded x (2H + 4K) |
//! | combine-bwd | its network rows x 2H |
//!
//! The layout waits on the host, so it is timed from the host barrier
//! (host skew and enqueue time fall inside); the other ops as on one node.
//! The `rail-hop` baseline moves the dispatch's network bytes with the
//! hop alone (`RailHop::exchange`: NCCL send / receive between rail peers;
//! device copies on virtual ranks), in the same run. `--check` compares
//! dispatch bit for bit with `reference::two_level_dispatch` and combine
//! (the received rows as the expert outputs) with
//! `reference::combine_two_level_emulated`.

use moe_ep::ops::{DeviceRegion, DispatchOut, HopRecv, HopSend, RailHop, TopkIdx};
use moe_ep::reference::{self as refr, RankInput, Shape};
use moe_ep::{bf16, GroupConfig, RecvLayout, Topology};
use moe_ep::{EpGroup, Handle};

use super::{
    all_ranks_ok, counts_and_capacity, gather, gather_memory, moe_ep_memory, rank_input, routings,
    s, time_ht_op, upload, Ctx, HtBufs, Measured, Outcome, R,
};
use crate::cli::{Case, Op};
use crate::memory::Memory;
use crate::report::RAIL_HOP;

/// One case at `g` ranks per node: our ops (and `--check`), then the
/// rail-hop baseline unless `--no-baselines`.
pub(super) fn run_case(c: &Ctx<'_>, case: &Case, world: usize, g: usize) -> R<Outcome> {
    let opts = c.opts;
    let (rank, s_) = (c.comm.rank(), &c.stream);
    let shape = Shape {
        num_ranks: world,
        num_experts: case.experts,
        hidden: case.hidden,
        topk: case.topk,
    };
    shape.validate().map_err(s)?;
    let topo = Topology::new(world, g).map_err(s)?;
    let layout = case.layout;
    let routing = routings(case, &shape, opts.seed, world)?;
    // Every rank's routing (no tokens): the receive counts and the traffic.
    let routed: Vec<RankInput> = routing
        .iter()
        .map(|idx| RankInput {
            tokens: Vec::new(),
            topk_weights: vec![0.0; idx.len()],
            topk_idx: idx.clone(),
        })
        .collect();
    let (counts, cap) = counts_and_capacity(&shape, &routing, layout)?;
    let traffic = refr::two_level_traffic(&shape, &topo, &routed).map_err(s)?;
    let mut cfg = GroupConfig::new(case.experts, case.hidden, case.tokens.max(1));
    cfg.ranks_per_node = g;
    cfg.recv_capacity = cap;
    cfg.num_sms = case.num_sms;
    cfg.hop_chunk_rows = opts
        .hop_chunk_rows
        .unwrap_or(moe_ep::ops::DEFAULT_HOP_CHUNK_ROWS);
    let group = EpGroup::new(&c.comm, cfg).map_err(s)?;
    // The group's own, before the pool gives out buffers.
    let footprint = group.memory_footprint();
    let me = rank_input(case, opts.seed, rank, routing[rank].clone());
    let (t, h, k) = (case.tokens, case.hidden, case.topk);
    let (x, w, idx) = upload(s_, &me)?;
    let (xv, wv, idxv) = (x.slice(0..t * h), w.slice(0..t * k), idx.slice(0..t * k));
    let wpr = if matches!(layout, RecvLayout::RankMajor) {
        k
    } else {
        1
    };
    let pool = group.pool();
    let mut recv = pool.alloc::<bf16>(cap * h).map_err(s)?;
    let mut recv_w = pool.alloc::<f32>(cap * wpr).map_err(s)?;
    let mut out = s_.alloc_zeros::<bf16>((t * h).max(1)).map_err(s)?;
    let mut grad_w = s_.alloc_zeros::<f32>((t * k).max(1)).map_err(s)?;
    let handle = group
        .layout(s_, TopkIdx::I64(&idxv), k, layout)
        .map_err(s)?;

    // The bytes of each op on this rank.
    let eb = case.dtype.elem_bytes();
    let sent: usize = handle.network_rows_sent().unwrap_or_default().iter().sum();
    let forwarded: usize = handle
        .network_rows_received()
        .unwrap_or_default()
        .iter()
        .sum();
    let nvlink_rows = (traffic[rank].nvlink_forward + traffic[rank].nvlink_home) as u64;
    let flat = crate::accounting::Traffic::new(&counts.rank, world, h, eb);
    let row = (h * eb) as u64;
    let bytes = |op: Op| -> (u64, u64, u64) {
        let (net_rows, per_row) = match op {
            Op::Layout => (sent, 4 * k + 8),
            Op::Dispatch => (sent, h * eb + 4 * k),
            Op::Combine => (forwarded, h * eb),
            Op::DispatchBwd => (forwarded, h * eb + 4 * k),
            _ => (sent, h * eb),
        };
        let nvlink = match op {
            Op::Layout => 0,
            _ => nvlink_rows * row,
        };
        (
            nvlink,
            flat.op(op, rank).logical,
            (net_rows * per_row) as u64,
        )
    };

    let check = if opts.check {
        Some(check(
            c,
            &group,
            &handle,
            &shape,
            &topo,
            case,
            routing.clone(),
            (&xv, &wv),
            (&mut recv, &mut recv_w),
            &mut out,
        )?)
    } else {
        None
    };
    let check = all_ranks_ok(c, check)?;

    let mut mine: Vec<Measured> = Vec::new();
    let mut net: Vec<u64> = Vec::new();
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
            Op::Layout | Op::Dispatch | Op::Combine | Op::DispatchBwd | Op::CombineBwd => {
                // The layout waits on the host (its stream lengths): timed
                // from the host barrier.
                time_ht_op(c, &group, &handle, op, k, layout, &mut bufs, true)?
            }
            // Refused by the command line.
            _ => return Err(format!("{} is not an op of --ranks-per-node", op.name())),
        };
        let (nv, lg, nb) = bytes(op);
        mine.push((op.name().to_string(), samples, nv, lg));
        net.push(nb);
    }
    group.check().map_err(s)?;

    // The same network bytes as the dispatch, by the hop alone.
    if !opts.no_baselines {
        let (samples, nb) = rail_hop(c, &topo, &handle, h * eb + 4 * k)?;
        mine.push((RAIL_HOP.to_string(), samples, 0, 0));
        net.push(nb);
    }
    let mut ops = gather(c, mine)?;
    let all = c.comm.all_gather_host(s_, &net).map_err(s)?;
    for (i, op) in ops.iter_mut().enumerate() {
        op.network_bytes = (0..world).map(|r| all[r * net.len() + i]).collect();
    }
    let memory = Memory {
        moe_ep: moe_ep_memory(footprint, Some(handle.device_bytes()), None),
        nccl_ep: None,
    };
    Ok(Outcome {
        ops,
        check,
        nccl_ep_check: None,
        memory: gather_memory(c, memory)?,
    })
}

/// Times [`RailHop::exchange`] of `row` bytes per network row, the
/// dispatch's pairs (this rank's streams out, its rail peers' in); returns
/// the samples and the bytes this rank sends.
fn rail_hop(c: &Ctx<'_>, topo: &Topology, handle: &Handle, row: usize) -> R<(Vec<f64>, u64)> {
    let (rank, me) = (c.comm.rank(), topo.node_of(c.comm.rank()));
    let hop = RailHop::new(&c.comm, *topo).map_err(s)?;
    let (sent, recvd) = (
        handle.network_rows_sent().unwrap_or_default(),
        handle.network_rows_received().unwrap_or_default(),
    );
    let total = |v: &[usize]| v.iter().sum::<usize>() * row;
    let src = c.stream.alloc_zeros::<u8>(total(sent).max(1)).map_err(s)?;
    let dst = c.stream.alloc_zeros::<u8>(total(recvd).max(1)).map_err(s)?;
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let (mut at_s, mut at_r) = (0, 0);
    for m in (0..topo.nodes()).filter(|&m| m != me) {
        let peer = topo.rail_peer(rank, m);
        sends.push(HopSend {
            peer,
            src: DeviceRegion::device_ptr(&src) + at_s as u64,
            bytes: sent[m] * row,
        });
        recvs.push(HopRecv {
            peer,
            dst: DeviceRegion::device_ptr(&dst) + at_r as u64,
            bytes: recvd[m] * row,
        });
        at_s += sent[m] * row;
        at_r += recvd[m] * row;
    }
    // SAFETY: the ranges lie in `src` and `dst`, which outlive the timed
    // runs (each is waited for); they do not overlap.
    let samples = c.time(RAIL_HOP, || unsafe {
        hop.exchange(&c.stream, &sends, &recvs).map_err(s)
    })?;
    c.stream.synchronize().map_err(s)?;
    Ok((samples, total(sent) as u64))
}

/// `--check`: dispatch bit for bit against `two_level_dispatch`, combine of
/// the received rows against `combine_two_level_emulated` (every rank's
/// reference rows as its expert outputs). This rank's verdict.
#[allow(clippy::too_many_arguments)]
fn check(
    c: &Ctx<'_>,
    group: &EpGroup,
    handle: &Handle,
    shape: &Shape,
    topo: &Topology,
    case: &Case,
    routing: Vec<Vec<i64>>,
    (x, w): (&dyn DeviceRegion<bf16>, &dyn DeviceRegion<f32>),
    (recv, recv_w): (&mut moe_ep::SymmBuffer<bf16>, &mut moe_ep::SymmBuffer<f32>),
    out: &mut moe_ep::cuda::CudaSlice<bf16>,
) -> R<bool> {
    let (rank, s_) = (c.comm.rank(), &c.stream);
    let inputs: Vec<RankInput> = routing
        .into_iter()
        .enumerate()
        .map(|(r, idx)| rank_input(case, c.opts.seed, r, idx))
        .collect();
    let layout = case.layout;
    let want = refr::two_level_dispatch(shape, topo, &inputs, rank, layout).map_err(s)?;
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
    recv.copy_to_host(s_, &mut got).map_err(s)?;
    if !comb.is_empty() {
        s_.memcpy_dtoh(&out.slice(0..t * h), &mut comb).map_err(s)?;
    }
    s_.synchronize().map_err(s)?;
    // The expert outputs are the received rows: in the reference's (flat)
    // order, every rank's flat dispatch.
    let outs: Vec<Vec<bf16>> = (0..shape.num_ranks)
        .map(|d| refr::dispatch(shape, &inputs, d, layout).map(|o| o.tokens))
        .collect::<Result<_, _>>()
        .map_err(s)?;
    let emu = refr::combine_two_level_emulated(shape, topo, &inputs, &outs, rank, layout, false)
        .map_err(s)?;
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
    Ok(ok)
}
