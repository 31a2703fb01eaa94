//! Shared harness of the GPU tests: a guard that skips (visibly) when GPUs
//! are missing, and a runner that starts one thread per GPU with its own
//! context and NCCL communicator.
#![allow(dead_code)]

use std::io::Write;
use std::sync::Arc;

use moe_ep::cuda::{CudaContext, CudaStream};
use moe_ep::{Communicator, Result, UniqueId};

/// Number of GPUs to use (all visible, or `MOE_EP_TEST_GPUS`), or None after
/// printing why the test is skipped.
pub fn gpus_or_skip(test: &str, needed: usize) -> Option<usize> {
    let found = match moe_ep::device_count() {
        Ok(n) => n,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIP: {test}: {e}");
            return None;
        }
    };
    let want = std::env::var("MOE_EP_TEST_GPUS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(found);
    if want.min(found) < needed {
        let _ = writeln!(
            std::io::stderr(),
            "SKIP: {test}: needs {needed} GPUs, found {found}"
        );
        return None;
    }
    Some(want.min(found))
}

/// What each rank's closure gets.
pub struct Rank {
    pub rank: usize,
    pub world: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub comm: Arc<Communicator>,
}

/// Runs `f` on `world` threads, one per GPU, each with its communicator.
/// Panics with every rank's error if any rank fails.
pub fn run_ranks<F>(world: usize, f: F)
where
    F: Fn(&Rank) -> Result<()> + Send + Sync,
{
    let id = UniqueId::generate().expect("ncclGetUniqueId");
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, id) = (&f, &id);
                s.spawn(move || -> std::result::Result<(), String> {
                    let ctx = moe_ep::context(rank).map_err(|e| e.to_string())?;
                    let comm = Communicator::init(&ctx, id, rank, world)
                        .map_err(|e| format!("init: {e}"))?;
                    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
                    let r = Rank {
                        rank,
                        world,
                        ctx,
                        stream,
                        comm,
                    };
                    f(&r).map_err(|e| format!("{e}"))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .filter_map(|(rank, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("rank {rank}: {e}")),
                Err(p) => Some(format!(
                    "rank {rank} panicked: {}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                )),
            })
            .collect()
    });
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Fails the rank with a message (for use inside `run_ranks` closures).
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(moe_ep::Error::InvalidState(msg()))
    }
}
