//! `ep-bench`: launcher and profiler for the `moe-ep` expert-parallel
//! dispatch/combine kernels, compared against NCCL all-to-all, NCCL EP
//! (NVIDIA's expert-parallel library, when `libnccl_ep.so.0` loads:
//! [`nccl_ep`]) and hardware ceilings (peer stores and loads, bulk copies,
//! the copy engine over NVLink; on the rank's own GPU, the local copies of
//! the rows each op reads and writes, column `vs local`).
//!
//! Without a launcher, `ep-bench` re-executes itself once per GPU (rank `r`
//! uses device `r`); under torchrun, Open MPI or Slurm every process is one
//! rank ([`launch`]). `--virtual-ranks N` runs N ranks as threads of this
//! process on GPU 0 instead: the same kernels and protocol, no NVLink
//! crossed, no NVLink baselines (the local-copy ceilings are kept). Rank 0
//! prints a table (slowest rank per row) and writes the requested JSON /
//! CSV / SVG files ([`report`], [`plot`]).
//! Run `ep-bench --help` for all options ([`cli`]).
//!
//! # Examples
//!
//! ```text
//! # All visible GPUs, defaults (4096 tokens/rank, hidden 7168, top-8 of 256 experts)
//! ep-bench --check
//!
//! # Token sweep on 8 GPUs with a bandwidth plot and machine-readable output
//! ep-bench --gpus 8 --tokens 256,512,1024,2048,4096,8192 --plot bw.svg --json bw.json
//!
//! # SM budget and layout sweep, skewed routing, CSV for a spreadsheet
//! ep-bench --gpus 4 --num-sms 16,24,32 --layout rank,expert:64 --routing skewed:0.5 --csv sms.csv
//!
//! # 8 ranks on one GPU: the protocol checked and timed without NVLink
//! ep-bench --virtual-ranks 8 --tokens 512,4096 --check
//!
//! # Nsight: exactly --iters runs per op, no L2 flush, no warm-up
//! ep-bench --gpus 2 --profile --ops dispatch --no-baselines
//!
//! # External launchers
//! torchrun --no-python --nproc-per-node 8 ep-bench
//! mpirun -np 8 ep-bench --tokens 4096
//! ```
//!
//! Exit status: 0 success, 1 runtime failure (including a failed `--check`),
//! 2 usage error (reported before any GPU work as one line
//! `ep-bench: error: ...`).

mod accounting;
mod cli;
mod fp8;
mod gpu;
mod launch;
mod memory;
mod nccl_ep;
mod plot;
mod report;

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use cli::{Command, Opts};
use launch::{RankEnv, Role};
use report::{CaseResult, Ranks};

/// Exit status: success.
const EXIT_OK: u8 = 0;
/// Exit status: runtime failure.
const EXIT_FAILURE: u8 = 1;
/// Exit status: bad command line or launcher environment.
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    init_logging();
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let opts = match cli::parse(args.iter().cloned()) {
        Ok(Command::Help(text)) => {
            let _ = std::io::stdout().lock().write_all(text.as_bytes());
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(opts)) => *opts,
        Err(e) => return fail(EXIT_USAGE, &e),
    };
    ExitCode::from(match (Role::detect(), opts.virtual_ranks) {
        (Err(e), _) => fail_code(EXIT_USAGE, &e),
        (Ok(Role::Parent), Some(n)) => run_virtual(&opts, n),
        (Ok(Role::Rank(env)), Some(_)) => fail_code(
            EXIT_USAGE,
            &format!(
                "--virtual-ranks: not under a launcher ({} started this process as rank {} of {}); \
                 run `ep-bench --virtual-ranks N` as one process",
                env.launcher.name(),
                env.rank,
                env.world
            ),
        ),
        (Ok(Role::Parent), None) => run_parent(&opts, &args),
        (Ok(Role::Rank(env)), None) => run_as_rank(&opts, &env),
    })
}

/// Writes the library's `tracing` log lines to stderr, filtered by
/// `RUST_LOG` (default `warn`: the failures the library reports without
/// returning them; `RUST_LOG=moe_ep=info` adds e.g. the line saying the NVTX
/// ranges are off).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .from_env_lossy();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Prints every line of `msg` as `ep-bench: error: {line}` on stderr and
/// returns `code`.
fn fail_code(code: u8, msg: &str) -> u8 {
    for line in msg.lines() {
        eprintln!("ep-bench: error: {line}");
    }
    code
}

/// [`fail_code`] as the process's exit status.
fn fail(code: u8, msg: &str) -> ExitCode {
    ExitCode::from(fail_code(code, msg))
}

/// No launcher: decide the world size, make the NCCL id, spawn the ranks
/// and wait for them (their output passes through).
fn run_parent(opts: &Opts, args: &[OsString]) -> u8 {
    let world = match opts.gpus {
        Some(n) => n,
        None => match gpu::device_count() {
            Ok(0) => return fail_code(EXIT_FAILURE, "no GPU visible (check CUDA_VISIBLE_DEVICES)"),
            Ok(n) => n,
            Err(e) => return fail_code(EXIT_FAILURE, &format!("cannot count GPUs: {e}")),
        },
    };
    if let Err(e) = opts.validate_for_world(world) {
        let hint = match opts.gpus {
            Some(_) => String::new(),
            None => format!(" ({world} GPUs visible; choose the rank count with --gpus)"),
        };
        return fail_code(EXIT_USAGE, &format!("{e}{hint}"));
    }
    let id = match gpu::nccl_unique_id() {
        Ok(id) => id,
        Err(e) => {
            return fail_code(
                EXIT_FAILURE,
                &format!("cannot create the NCCL unique id: {e}"),
            )
        }
    };
    match launch::spawn_ranks(world, id, args) {
        Ok(code) => u8::try_from(code).unwrap_or(EXIT_FAILURE),
        Err(e) => fail_code(EXIT_FAILURE, &e),
    }
}

/// One rank of a launcher's world: run the GPU work; rank 0 reports.
fn run_as_rank(opts: &Opts, env: &RankEnv) -> u8 {
    if let Err(e) = opts.validate_for_world(env.world) {
        // Every rank sees the same problem: let rank 0 say it once.
        return if env.is_root() {
            fail_code(EXIT_USAGE, &e)
        } else {
            EXIT_USAGE
        };
    }
    match gpu::run_rank(opts, &opts.cases(), env) {
        Ok(results) if env.is_root() => emit(opts, &results),
        Ok(_) => EXIT_OK,
        Err(e) => {
            let who = format!(
                "rank {} of {} ({})",
                env.rank,
                env.world,
                env.launcher.name()
            );
            fail_code(EXIT_FAILURE, &format!("{who}: {e}"))
        }
    }
}

/// `--virtual-ranks N`: every rank a thread of this process on GPU 0.
fn run_virtual(opts: &Opts, world: usize) -> u8 {
    match gpu::run_virtual(opts, &opts.cases(), world) {
        Ok(results) => emit(opts, &results),
        Err(e) => fail_code(EXIT_FAILURE, &e),
    }
}

/// Rank 0: table on stdout, then the requested files. A failed `--check`
/// turns the exit status into 1 after everything is written.
fn emit(opts: &Opts, results: &[CaseResult]) -> u8 {
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
            Some(r) if r.ranks == Ranks::Virtual => format!(
                "moe-ep {} bandwidth: {} (no NVLink crossed)",
                cli::mode_name(r.case.mode),
                r.who()
            ),
            Some(r) => format!(
                "moe-ep {} NVLink bandwidth: {}",
                cli::mode_name(r.case.mode),
                r.who()
            ),
            None => "moe-ep NVLink bandwidth".to_string(),
        };
        code = code.max(match plot::svg(results, &title) {
            Ok(svg) => write_output(opts, "--plot", path, &svg),
            Err(e) => fail_code(EXIT_FAILURE, &format!("--plot: {e}")),
        });
    }
    let failed: Vec<String> = results
        .iter()
        .filter(|r| r.check == Some(false))
        .map(|r| r.case.label())
        .collect();
    if !failed.is_empty() {
        code = fail_code(
            EXIT_FAILURE,
            &format!(
                "--check: {} case(s) differ from the CPU reference: {}",
                failed.len(),
                failed.join("; ")
            ),
        );
    }
    let ep_failed: Vec<String> = results
        .iter()
        .filter(|r| r.nccl_ep_check == Some(false))
        .map(|r| r.case.label())
        .collect();
    if !ep_failed.is_empty() {
        code = fail_code(
            EXIT_FAILURE,
            &format!(
                "--check: NCCL EP's outputs differ from moe-ep's and the CPU reference's in {} case(s): {}",
                ep_failed.len(),
                ep_failed.join("; ")
            ),
        );
    }
    code
}

/// Writes one output file (`option` names it in errors); says so unless `--quiet`.
fn write_output(opts: &Opts, option: &str, path: &Path, text: &str) -> u8 {
    match std::fs::write(path, text) {
        Ok(()) => {
            if !opts.quiet {
                eprintln!("ep-bench: wrote {}", path.display());
            }
            EXIT_OK
        }
        Err(e) => fail_code(
            EXIT_FAILURE,
            &format!("{option}: cannot write '{}': {e}", path.display()),
        ),
    }
}
