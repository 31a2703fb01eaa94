//! GPU tests of what holds when a run is long or one rank is wrong
//! (`multi-gpu`; virtual ranks on GPU 0 at world 2, 4 and 8, or real GPUs).
//!
//! - `plain_loop_*`: the loop a runtime runs, {layout, dispatch into pool
//!   buffers, combine into one caller output}, the receive layouts
//!   alternating (or one of them), handles and outputs dropped every cycle
//!   and no host sync in the loop; the last cycle's output checked bit for
//!   bit. `MOE_EP_SOAK_CYCLES` sets the cycles (default 300; the ignored
//!   `plain_loop_soak` runs 10,000).
#![cfg(feature = "multi-gpu")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use moe_ep::cuda::CudaStream;
use moe_ep::ops::{DispatchOut, TopkIdx};
use moe_ep::testkit::ranks::{ensure, run_worlds, Rank};
use moe_ep::testkit::workload::{self, Rng};
use moe_ep::{bf16, EpGroup, Error, GroupConfig, RecvLayout, Result};

#[path = "common/device.rs"]
mod device;
use device::{bits, down, first_diff, up};

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
    (0..TOKENS * HIDDEN)
        .map(|i| {
            let t = i / HIDDEN;
            let n = match layout {
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
            };
            bf16::from_f64(x[i].to_f64() * n).to_bits()
        })
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
            Layouts::Alternating if cycle % 2 == 0 => RecvLayout::RankMajor,
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
    ensure(true, String::new)?;
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
#[ignore = "10,000 cycles per world: run with --ignored"]
fn plain_loop_soak() {
    run_worlds("plain_loop_soak", 2, |r| {
        plain_loop(r, Layouts::Alternating, cycles(10_000))
    });
}
