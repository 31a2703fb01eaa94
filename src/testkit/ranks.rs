//! The harness of the multi-rank GPU tests: which worlds a test runs at
//! (real GPUs, or virtual ranks on GPU 0 when there are too few), a runner
//! that starts one thread per rank with its context, stream and
//! communicator, and a guard that skips (visibly) when there is no GPU.
//!
//! ```no_run
//! use moe_ep::testkit::ranks::run_worlds;
//! // world 2 on 2 GPUs, or virtual worlds 2, 4 and 8 on GPU 0:
//! run_worlds("barrier", 2, |r| r.comm.barrier(&r.stream));
//! ```
//!
//! - `MOE_EP_TEST_GPUS=N`: use at most N real GPUs.
//! - `MOE_EP_TEST_VIRTUAL_WORLDS=2,4,8`: the virtual worlds to run (the
//!   default when fewer real GPUs than a test needs, or fewer than two, are
//!   found; with enough real GPUs none unless this is set; `none` turns them
//!   off). `1,2,4,8` adds a virtual world of one rank to the tests that
//!   need only one.

use std::fmt;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};

use crate::{Communicator, GroupConfig, Result, UniqueId};

/// How a world's ranks are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranks {
    /// One GPU per rank, one NCCL communicator each (NVLink crossed).
    Gpus,
    /// All ranks on GPU 0, one thread each (`Communicator::virtual_world`).
    Virtual,
}

/// One world a test runs at.
#[derive(Clone, Copy, Debug)]
pub struct World {
    pub size: usize,
    pub ranks: Ranks,
}

impl fmt::Display for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ranks {
            Ranks::Gpus => write!(f, "world {}, one GPU per rank (NCCL)", self.size),
            Ranks::Virtual => write!(f, "world {}, virtual ranks on GPU 0", self.size),
        }
    }
}

fn say(line: String) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The real GPUs to use (all visible, at most `MOE_EP_TEST_GPUS`), or None
/// after printing why `test` is skipped (no driver).
fn usable_gpus(test: &str) -> Option<usize> {
    more_hardware_queues();
    let found = match crate::device_count() {
        Ok(n) => n,
        Err(e) => {
            say(format!("SKIP: {test}: {e}"));
            return None;
        }
    };
    let cap = std::env::var("MOE_EP_TEST_GPUS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(found);
    Some(found.min(cap))
}

/// GPUs to use (all visible, or `MOE_EP_TEST_GPUS`), or None after printing
/// why the test is skipped (no driver, or fewer than `needed`).
pub fn gpus_or_skip(test: &str, needed: usize) -> Option<usize> {
    let gpus = usable_gpus(test)?;
    if gpus < needed {
        say(format!("SKIP: {test}: needs {needed} GPUs, found {gpus}"));
        return None;
    }
    Some(gpus)
}

/// The virtual worlds asked for by `MOE_EP_TEST_VIRTUAL_WORLDS` (`None`:
/// the variable is unset).
fn virtual_worlds_from_env() -> Option<Vec<usize>> {
    let v = std::env::var("MOE_EP_TEST_VIRTUAL_WORLDS").ok()?;
    if v.trim() == "none" || v.trim().is_empty() {
        return Some(vec![]);
    }
    Some(
        v.split(',')
            .map(|w| {
                w.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("MOE_EP_TEST_VIRTUAL_WORLDS: {w:?} is not a number"))
            })
            .collect(),
    )
}

/// The worlds a multi-rank test that needs `needed` ranks runs at: every
/// real GPU when there are at least `needed`, plus the virtual worlds asked
/// for; with fewer than `needed` real GPUs, or fewer than two, also the
/// virtual worlds (2, 4 and 8 unless asked otherwise) on GPU 0. A test that
/// also runs at world 1 (`needed` = 1) thus runs on one GPU as a real world
/// of one rank plus the virtual worlds; a virtual world 1 only when asked
/// for. Empty (after printing SKIP) without a GPU.
pub fn worlds(test: &str, needed: usize) -> Vec<World> {
    let Some(gpus) = usable_gpus(test) else {
        return vec![];
    };
    if gpus == 0 {
        say(format!("SKIP: {test}: no GPU found"));
        return vec![];
    }
    let asked = virtual_worlds_from_env();
    let mut out = Vec::new();
    if gpus >= needed {
        out.push(World {
            size: gpus,
            ranks: Ranks::Gpus,
        });
    }
    let virtual_sizes = match asked {
        Some(v) => v,
        None if gpus < needed.max(2) => vec![2, 4, 8],
        None => vec![],
    };
    out.extend(
        virtual_sizes
            .into_iter()
            .filter(|&w| w >= needed)
            .map(|size| World {
                size,
                ranks: Ranks::Virtual,
            }),
    );
    if out.is_empty() {
        say(format!(
            "SKIP: {test}: needs {needed} ranks; {gpus} GPUs and no virtual world asked for"
        ));
    } else {
        say(format!("{test}:"));
    }
    out
}

/// Asks the driver for 32 hardware work queues (`CUDA_DEVICE_MAX_CONNECTIONS`,
/// 8 by default) unless the environment says otherwise, before the first
/// CUDA call: streams that share a queue can wait behind each other, and the
/// ranks of a virtual world wait for each other's kernels.
fn more_hardware_queues() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
        }
    });
}

/// What each rank's closure gets.
pub struct Rank {
    pub rank: usize,
    pub world: usize,
    pub ranks: Ranks,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// A second stream of this rank (tests of one group driven from two
    /// streams), made with the first: for virtual ranks, all ranks' streams
    /// are made one after another.
    pub stream2: Arc<CudaStream>,
    pub comm: Arc<Communicator>,
}

impl Rank {
    /// The SMs a group of this world may use: `want`, or fewer when the
    /// ranks share one GPU and `want` blocks each would not all fit
    /// ([`crate::ops::residency`]).
    pub fn sms(&self, want: usize, num_experts: usize) -> Result<usize> {
        let fit = crate::ops::residency(&self.comm, num_experts)?.max_blocks_per_rank();
        Ok(want.min(fit))
    }

    /// `GroupConfig::new` with the default SMs, or as many as fit.
    pub fn config(&self, experts: usize, hidden: usize, tokens: usize) -> Result<GroupConfig> {
        let mut cfg = GroupConfig::new(experts, hidden, tokens);
        cfg.num_sms = self.sms(cfg.num_sms, experts)?;
        Ok(cfg)
    }
}

type Outcome = Option<std::result::Result<(), String>>;
/// A virtual rank made on the main thread: its context, communicator, streams.
type Made = (Arc<CudaContext>, Arc<Communicator>, [Arc<CudaStream>; 2]);

/// Runs `f` once per rank of `world`, each rank on its own thread with its
/// own stream and communicator (NCCL on GPU r, or one virtual world on GPU
/// 0). Panics with every rank's error if any rank fails. When one rank fails
/// and others are still blocked 30 s later, the process exits with the
/// errors rather than hanging.
pub fn run_ranks<F>(world: World, f: F)
where
    F: Fn(&Rank) -> Result<()> + Send + Sync,
{
    // One world at a time per process: the ranks of a virtual world need
    // the whole GPU's SMs, and NCCL ranks their GPUs.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    say(format!("  {world}"));
    let n = world.size;
    // Virtual ranks: one context, the streams made one after another here
    // (the driver spreads consecutive streams over its hardware queues, so
    // no rank's kernels queue behind another's).
    let virtual_ranks = match world.ranks {
        Ranks::Gpus => None,
        Ranks::Virtual => {
            let ctx = crate::context(0).expect("context of GPU 0");
            let comms = Communicator::virtual_world(&ctx, n).expect("virtual world");
            let streams: Vec<[Arc<CudaStream>; 2]> = (0..n)
                .map(|_| [(); 2].map(|_| ctx.new_stream().expect("stream")))
                .collect();
            Some((ctx, comms, streams))
        }
    };
    let mut slots: Vec<Option<Made>> = match virtual_ranks {
        None => (0..n).map(|_| None).collect(),
        Some((ctx, comms, streams)) => comms
            .into_iter()
            .zip(streams)
            .map(|(c, s)| Some((ctx.clone(), c, s)))
            .collect(),
    };
    let id = match world.ranks {
        Ranks::Gpus => Some(UniqueId::generate().expect("ncclGetUniqueId")),
        Ranks::Virtual => None,
    };
    let state: (std::sync::Mutex<Vec<Outcome>>, std::sync::Condvar) = (
        std::sync::Mutex::new(vec![None; n]),
        std::sync::Condvar::new(),
    );
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (rank, slot) in slots.iter_mut().enumerate() {
            let (f, id, state) = (&f, &id, &state);
            let made = slot.take();
            s.spawn(move || {
                let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                    || -> std::result::Result<(), String> {
                        let (ctx, comm, [stream, stream2]) = match made {
                            Some(m) => m,
                            None => {
                                let ctx = crate::context(rank).map_err(|e| e.to_string())?;
                                let id = id.as_ref().expect("an NCCL id for GPU ranks");
                                let comm = Communicator::init(&ctx, id, rank, n)
                                    .map_err(|e| format!("init: {e}"))?;
                                let stream = ctx.new_stream().map_err(|e| e.to_string())?;
                                let stream2 = ctx.new_stream().map_err(|e| e.to_string())?;
                                (ctx, comm, [stream, stream2])
                            }
                        };
                        let r = Rank {
                            rank,
                            world: n,
                            ranks: world.ranks,
                            ctx,
                            stream,
                            stream2,
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
                say(format!("FAILED (watchdog, {world}):\n{}", msgs.join("\n")));
                std::process::exit(101);
            }
            done = state
                .1
                .wait_timeout(done, Duration::from_millis(200))
                .unwrap()
                .0;
        }
    });
    if let Ranks::Virtual = world.ranks {
        // Kernels that a failed rank left waiting run until their timeout:
        // the next world needs the whole GPU.
        let ctx = crate::context(0).expect("context of GPU 0");
        if let Err(e) = ctx.synchronize() {
            say(format!("  {world}: GPU 0 after the world: {e}"));
        }
    }
    let results = state.0.into_inner().unwrap();
    let errors: Vec<String> = results
        .into_iter()
        .enumerate()
        .filter_map(|(r, x)| x.and_then(|x| x.err()).map(|e| format!("rank {r}: {e}")))
        .collect();
    if !errors.is_empty() {
        // Printed now too: a later test's watchdog may end the process
        // before the harness prints the failures.
        say(format!(
            "  {world}: FAILED after {:.1} s\n    {}",
            t0.elapsed().as_secs_f64(),
            errors.join("\n    ")
        ));
    }
    assert!(errors.is_empty(), "{world}:\n{}", errors.join("\n"));
    say(format!(
        "  {world}: ok in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
}

/// Runs `f` at every world of [`worlds`] (nothing, after SKIP, without a GPU).
pub fn run_worlds<F>(test: &str, needed: usize, f: F)
where
    F: Fn(&Rank) -> Result<()> + Send + Sync,
{
    for w in worlds(test, needed) {
        run_ranks(w, &f);
    }
}

/// Fails the rank with a message (for use inside `run_ranks` closures).
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(crate::Error::InvalidState(msg()))
    }
}
