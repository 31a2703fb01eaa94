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
/// Panics with every rank's error if any rank fails. When one rank fails and
/// the others are still blocked (in an NCCL collective, say) 30 s later, the
/// process exits with the errors rather than hanging.
pub fn run_ranks<F>(world: usize, f: F)
where
    F: Fn(&Rank) -> Result<()> + Send + Sync,
{
    use std::sync::{Condvar, Mutex};
    use std::time::{Duration, Instant};
    let id = UniqueId::generate().expect("ncclGetUniqueId");
    type Outcome = Option<std::result::Result<(), String>>;
    let state: (Mutex<Vec<Outcome>>, Condvar) = (Mutex::new(vec![None; world]), Condvar::new());
    std::thread::scope(|s| {
        for rank in 0..world {
            let (f, id, state) = (&f, &id, &state);
            s.spawn(move || {
                let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                    || -> std::result::Result<(), String> {
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
                    },
                ))
                .unwrap_or_else(|p| {
                    Err(format!(
                        "panicked: {}",
                        p.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default()
                    ))
                });
                state.0.lock().unwrap()[rank] = Some(res);
                state.1.notify_all();
            });
        }
        let mut first_error: Option<Instant> = None;
        let mut done = state.0.lock().unwrap();
        loop {
            if done.iter().all(|r| r.is_some()) {
                break;
            }
            if first_error.is_none() && done.iter().any(|r| matches!(r, Some(Err(_)))) {
                first_error = Some(Instant::now());
            }
            if first_error.is_some_and(|t| t.elapsed() > Duration::from_secs(30)) {
                let msgs: Vec<String> = done
                    .iter()
                    .enumerate()
                    .map(|(r, x)| match x {
                        Some(Err(e)) => format!("rank {r}: {e}"),
                        Some(Ok(())) => format!("rank {r}: ok"),
                        None => format!("rank {r}: still blocked 30 s after a peer failed"),
                    })
                    .collect();
                let _ = writeln!(std::io::stderr(), "FAILED (watchdog):\n{}", msgs.join("\n"));
                std::process::exit(101);
            }
            done = state
                .1
                .wait_timeout(done, Duration::from_millis(200))
                .unwrap()
                .0;
        }
    });
    let results = state.0.into_inner().unwrap();
    let errors: Vec<String> = results
        .into_iter()
        .enumerate()
        .filter_map(|(r, x)| x.and_then(|x| x.err()).map(|e| format!("rank {r}: {e}")))
        .collect();
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
