//! `ep-bench`: launcher and profiler for the `moe-ep` expert-parallel
//! dispatch/combine kernels, compared against NCCL all-to-all and hardware
//! ceilings (peer stores, copy engines).
//!
//! Without a launcher, `ep-bench` re-executes itself once per GPU (rank `r`
//! uses device `r`); under torchrun, Open MPI or Slurm every process is one
//! rank. Rank 0 prints a table (slowest rank per row) and writes the
//! requested JSON / CSV / SVG files. Run `ep-bench --help` for all options.
//!
//! # Examples
//!
//! ```text
//! # All visible GPUs, defaults (4096 tokens/rank, hidden 7168, top-8 of 256 experts)
//! ep-bench
//!
//! # Token sweep on 8 GPUs with a bandwidth plot and machine-readable output
//! ep-bench --gpus 8 --tokens 256,512,1024,2048,4096,8192 --plot bw.svg --json bw.json
//!
//! # Low-latency kernels, correctness check against the CPU reference first
//! ep-bench --gpus 8 --mode ll --tokens 128 --check
//!
//! # SM budget and layout sweep, skewed routing, CSV for a spreadsheet
//! ep-bench --gpus 4 --num-sms 16,24,32 --layout rank,expert:64 --routing skewed:0.5 --csv sms.csv
//!
//! # Nsight Compute: few launches, no L2 flush, no warm-up
//! ncu --target-processes all --kernel-name regex:dispatch \
//!     ep-bench --gpus 2 --profile --ops dispatch --no-baselines
//!
//! # External launchers (two virtual nodes of 4 ranks each)
//! torchrun --no-python --nproc-per-node 8 ep-bench --ranks-per-node 4
//! mpirun -np 8 ep-bench --tokens 4096
//! MASTER_ADDR=node0 MASTER_PORT=29500 srun -N 2 --ntasks-per-node 8 ep-bench
//! ```
//!
//! Exit status: 0 success, 1 runtime failure (including a failed `--check`),
//! 2 usage error (reported before any GPU work as `ep-bench: error: ...`).
//!
//! # Contract with `gpu.rs`
//!
//! Everything here is host-side; `gpu.rs` provides:
//! * `gpu::device_count() -> Result<usize, String>`: visible GPUs; called in
//!   the parent only when `--gpus` is not given;
//! * `gpu::nccl_unique_id() -> Result<[u8; 128], String>`: a fresh
//!   `ncclUniqueId`, made in the parent, which stays alive (waiting in
//!   [`launch::spawn_ranks`]) for the whole run; also handy as the `make_id`
//!   of [`launch::RankEnv::unique_id`] under external launchers;
//! * `gpu::run_rank(&Opts, &[Case], &RankEnv) -> Result<Vec<CaseResult>, String>`:
//!   the whole measurement on one rank; rank 0's aggregated results on rank 0,
//!   an empty `Vec` elsewhere.

// Byte accounting is a toolkit for gpu.rs, which picks what it needs.
#[allow(dead_code)]
mod accounting;
mod cli;
mod gpu;
mod launch;
mod plot;
mod report;

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use cli::{Case, Command, Opts};
use launch::{RankEnv, Role};
use report::CaseResult;

/// Exit status: success.
const EXIT_OK: i32 = 0;
/// Exit status: runtime failure.
const EXIT_FAILURE: i32 = 1;
/// Exit status: bad command line or launcher environment.
const EXIT_USAGE: i32 = 2;

fn main() -> ExitCode {
    let code = run();
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Prints `ep-bench: error: {msg}` on stderr and returns `code`.
fn fail(code: i32, msg: &str) -> i32 {
    eprintln!("ep-bench: error: {msg}");
    code
}

fn run() -> i32 {
    let mut args = Vec::new();
    for a in std::env::args_os().skip(1) {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(bad) => {
                return fail(
                    EXIT_USAGE,
                    &format!("argument '{}' is not valid UTF-8", bad.to_string_lossy()),
                )
            }
        }
    }
    let opts = match cli::parse(&args) {
        Ok(Command::Help) => {
            let _ = std::io::stdout().lock().write_all(cli::USAGE.as_bytes());
            return EXIT_OK;
        }
        Ok(Command::Run(opts)) => *opts,
        Err(e) => return fail(EXIT_USAGE, &e),
    };
    let role = match Role::detect() {
        Ok(role) => role,
        Err(e) => return fail(EXIT_USAGE, &e),
    };
    match role {
        Role::Parent => run_parent(&opts, &args),
        Role::Rank(env) => run_as_rank(&opts, &opts.cases(), &env),
    }
}

/// No launcher: decide the world size, make the NCCL id, spawn the ranks
/// and wait for them (their output passes through).
fn run_parent(opts: &Opts, args: &[String]) -> i32 {
    let world = match opts.gpus {
        Some(n) => n,
        None => match gpu::device_count() {
            Ok(0) => return fail(EXIT_FAILURE, "no GPU visible (check CUDA_VISIBLE_DEVICES)"),
            Ok(n) => n,
            Err(e) => return fail(EXIT_FAILURE, &format!("cannot count GPUs: {e}")),
        },
    };
    if let Err(e) = cli::validate_for_world(opts, world) {
        return match opts.gpus {
            Some(_) => fail(EXIT_USAGE, &e),
            None => fail(
                EXIT_USAGE,
                &format!("{e} ({world} GPUs visible; choose the rank count with --gpus)"),
            ),
        };
    }
    let id = match gpu::nccl_unique_id() {
        Ok(id) => id,
        Err(e) => {
            return fail(
                EXIT_FAILURE,
                &format!("cannot create the NCCL unique id: {e}"),
            )
        }
    };
    match launch::spawn_ranks(world, id, args) {
        Ok(code) => code,
        Err(e) => fail(EXIT_FAILURE, &e),
    }
}

/// One rank: run the GPU work; rank 0 reports.
fn run_as_rank(opts: &Opts, cases: &[Case], env: &RankEnv) -> i32 {
    if let Err(e) = cli::validate_for_world(opts, env.world) {
        // Every rank sees the same problem: let rank 0 say it once.
        return if env.is_root() {
            fail(EXIT_USAGE, &e)
        } else {
            EXIT_USAGE
        };
    }
    let results = match gpu::run_rank(opts, cases, env) {
        Ok(r) => r,
        Err(e) => {
            let who = format!(
                "rank {} of {} ({})",
                env.rank,
                env.world,
                env.launcher.name()
            );
            return fail(EXIT_FAILURE, &format!("{who}: {e}"));
        }
    };
    if env.is_root() {
        emit(opts, &results)
    } else {
        EXIT_OK
    }
}

/// Rank 0: table on stdout, then the requested files. A failed `--check`
/// turns the exit status into 1 after everything is written.
fn emit(opts: &Opts, results: &[CaseResult]) -> i32 {
    {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(report::table(results).as_bytes());
        let _ = out.flush();
    }
    let mut code = EXIT_OK;
    if let Some(path) = &opts.json {
        code = code.max(write_output(opts, "--json", path, &report::json(results)));
    }
    if let Some(path) = &opts.csv {
        code = code.max(write_output(opts, "--csv", path, &report::csv(results)));
    }
    if let Some(path) = &opts.plot {
        let title = match results.first() {
            Some(r) => format!(
                "moe-ep {} NVLink bandwidth: {} x {}",
                r.case.mode, r.world, r.gpu_name
            ),
            None => "moe-ep NVLink bandwidth".to_string(),
        };
        code = code.max(match plot::svg(results, &title) {
            Ok(svg) => write_output(opts, "--plot", path, &svg),
            Err(e) => fail(EXIT_FAILURE, &format!("--plot: {e}")),
        });
    }
    let failed: Vec<String> = results
        .iter()
        .filter(|r| r.check == Some(false))
        .map(|r| r.case.label())
        .collect();
    if !failed.is_empty() {
        code = fail(
            EXIT_FAILURE,
            &format!(
                "--check: {} case(s) differ from the CPU reference: {}",
                failed.len(),
                failed.join("; ")
            ),
        );
    }
    code
}

fn write_output(opts: &Opts, option: &str, path: &Path, text: &str) -> i32 {
    match std::fs::write(path, text) {
        Ok(()) => {
            if !opts.quiet {
                eprintln!("ep-bench: wrote {}", path.display());
            }
            EXIT_OK
        }
        Err(e) => fail(
            EXIT_FAILURE,
            &format!("{option}: cannot write '{}': {e}", path.display()),
        ),
    }
}
