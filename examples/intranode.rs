//! The README's API example, runnable: layout, dispatch, identity experts and
//! combine on every rank, checked on the host.
//!
//! ```sh
//! cargo run --release --example intranode
//! ```
//!
//! With N >= 2 GPUs: one thread per GPU, each with an NCCL communicator (needs
//! `libnccl.so.2` >= 2.28 on the library path or `MOE_EP_NCCL_LIBRARY`). With
//! one GPU: a virtual world of 2 ranks on GPU 0, one thread per rank. Without
//! a GPU or driver it says so and exits with status 0.

use std::sync::Arc;

use moe_ep::cuda::{CudaSlice, CudaStream, DeviceRepr};
use moe_ep::ops::{DispatchOut, TopkIdx};
use moe_ep::{bf16, Communicator, EpGroup, Error, GroupConfig, RecvLayout, Result, UniqueId};

const EXPERTS: usize = 64;
const HIDDEN: usize = 2048;
const TOKENS: usize = 256;
const TOPK: usize = 8;

/// One rank's seeded routing: `topk_idx [T, K]` (a random start and odd
/// stride modulo 64 give K distinct experts; every 4th token leaves its last
/// slot unrouted, -1), `topk_weights [T, K]` and the tokens `x [T, H]`.
fn routing(rank: usize) -> (Vec<i64>, Vec<f32>, Vec<bf16>) {
    let mut state = 0x5EED ^ rank as u64;
    let mut below = |n: usize| {
        // splitmix64: a tiny generator, so that the example needs no test support
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (state ^ (state >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % n as u64) as usize
    };
    let mut idx = Vec::with_capacity(TOKENS * TOPK);
    for t in 0..TOKENS {
        let (start, stride) = (below(EXPERTS), 2 * below(EXPERTS / 2) + 1);
        idx.extend((0..TOPK).map(|j| ((start + j * stride) % EXPERTS) as i64));
        if t % 4 == 3 {
            idx[(t + 1) * TOPK - 1] = -1;
        }
    }
    let w = (0..TOKENS * TOPK).map(|i| (i % 5) as f32 / 4.0).collect();
    let x = (0..TOKENS * HIDDEN).map(|_| bf16::from_f32((below(4096) as f32 - 2048.0) / 512.0));
    (idx, w, x.collect())
}

/// Waits for the stream; done before every host copy, as virtual ranks
/// share the driver's staging buffers (`Communicator::virtual_world`).
fn drain(s: &Arc<CudaStream>) -> Result<()> {
    s.synchronize().map_err(Error::cuda("cuStreamSynchronize"))
}

fn up<T: DeviceRepr>(s: &Arc<CudaStream>, host: &[T]) -> Result<CudaSlice<T>> {
    drain(s)?;
    s.clone_htod(host).map_err(Error::cuda("cuMemcpyHtoD"))
}

/// One rank's work, collective with its peers; returns the line to print.
fn run_rank(comm: &Arc<Communicator>, s: &Arc<CudaStream>, ranks: &str) -> Result<String> {
    let (rank, world) = (comm.rank(), comm.world());
    let mut cfg = GroupConfig::new(EXPERTS, HIDDEN, TOKENS);
    // Ranks that share a GPU must all fit on it at once.
    let fit = moe_ep::ops::residency(comm, EXPERTS)?.max_blocks_per_rank();
    cfg.num_sms = cfg.num_sms.min(fit);
    let group = EpGroup::new(comm, cfg)?;
    let (idx, w, x) = routing(rank);
    let (d_idx, d_w, d_x) = (up(s, &idx)?, up(s, &w)?, up(s, &x)?);
    let mut out = up(s, &vec![bf16::ZERO; TOKENS * HIDDEN])?;

    let handle = group.layout(s, TopkIdx::I64(&d_idx), TOPK, RecvLayout::RankMajor)?;
    let recv = group.dispatch(s, &handle, &d_x, &d_w, DispatchOut::default())?;
    // Identity experts: the received rows (grouped by source rank) are their
    // own outputs, and combine reads them in place from symmetric memory.
    group.combine(s, &handle, &recv.tokens, None, &mut out)?;
    let received = handle.host_counts(s)?.recv_tokens;
    drain(s)?;
    let got = s.clone_dtoh(&out).map_err(Error::cuda("cuMemcpyDtoH"))?;
    group.check()?; // errors only the GPU saw (capacity, bad ids, timeouts)
    comm.barrier(s)?; // every rank done with the GPU before any frees its buffers

    // Each output row is its input row times the number of ranks it reached.
    for t in 0..TOKENS {
        let ranks_hit = idx[t * TOPK..(t + 1) * TOPK]
            .iter()
            .filter(|&&e| e >= 0)
            .fold(0u32, |m, &e| m | 1 << (e as usize / (EXPERTS / world)));
        let n = ranks_hit.count_ones() as f64;
        for i in t * HIDDEN..(t + 1) * HIDDEN {
            let want = bf16::from_f64(x[i].to_f64() * n);
            if got[i].to_bits() != want.to_bits() {
                let (c, g) = (i - t * HIDDEN, got[i]);
                let why = format!("token {t}, column {c}: got {g}, want {want} ({n} ranks)");
                return Err(Error::InvalidState(why));
            }
        }
    }
    Ok(format!(
        "{ranks}: {received} tokens received; out = x * ranks reached, bit for bit"
    ))
}

/// Runs `f(rank)` for every rank, each on its own thread; their results in rank order.
fn on_threads(world: usize, f: impl Fn(usize) -> Result<String> + Sync) -> Vec<Result<String>> {
    let f = &f;
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world).map(|r| s.spawn(move || f(r))).collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// World `world`, one GPU and one NCCL communicator per rank.
fn nccl_ranks(world: usize) -> Result<Vec<Result<String>>> {
    let id = UniqueId::generate()?; // made once, shared by every rank
    Ok(on_threads(world, |rank| {
        let ctx = moe_ep::context(rank)?;
        let comm = Communicator::init(&ctx, &id, rank, world)?;
        let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
        run_rank(&comm, &stream, &format!("GPU {rank} of {world}, NCCL"))
    }))
}

/// A virtual world of `world` ranks on GPU 0, one thread per rank.
fn virtual_ranks(world: usize) -> Result<Vec<Result<String>>> {
    let ctx = moe_ep::context(0)?;
    let comms = Communicator::virtual_world(&ctx, world)?;
    // Streams made one after another: the driver spreads them over its queues.
    let streams = (0..world)
        .map(|_| ctx.new_stream().map_err(Error::cuda("cuStreamCreate")))
        .collect::<Result<Vec<_>>>()?;
    let run = |r: usize| run_rank(&comms[r], &streams[r], "GPU 0, virtual");
    Ok(on_threads(world, run))
}

fn main() -> Result<()> {
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // More hardware queues for virtual ranks, before the first CUDA call.
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    let gpus = match moe_ep::device_count() {
        Err(e @ Error::NoDriver(_)) => {
            println!("{e}");
            0
        }
        n => n?,
    };
    if gpus == 0 {
        println!("intranode needs a Hopper GPU with a CUDA 13 driver (2 ranks share it), or");
        println!("2 or more GPUs over NVLink (one rank each) and NCCL >= 2.28");
        return Ok(());
    }
    // A power of two (at most 8) of the GPUs, so that the 64 experts split evenly.
    let results = match gpus.min(8) {
        1 => virtual_ranks(2)?,
        n => nccl_ranks(1 << n.ilog2())?,
    };
    for (rank, r) in results.iter().enumerate() {
        match r {
            Ok(line) => println!("rank {rank}: {line}"),
            Err(e) => println!("rank {rank}: FAILED: {e}"),
        }
    }
    if results.iter().any(Result::is_err) {
        std::process::exit(1);
    }
    Ok(())
}
