//! GPU test of the profiler (`multi-gpu`): a short sweep with `--check` on 2
//! GPUs, ranks started by the tool itself; it must exit 0 and print a table
//! with the baselines.
#![cfg(feature = "multi-gpu")]

use moe_ep::testkit::ranks as common;

use std::path::PathBuf;
use std::process::Command;

/// The ep-bench binary: `MOE_EP_BENCH_BIN`, else cargo's build of it, else
/// `../bin/ep-bench` beside a staged test binary (.gpu/tests -> .gpu/bin).
fn bench_bin() -> PathBuf {
    if let Ok(p) = std::env::var("MOE_EP_BENCH_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ep-bench"));
    if built.is_file() {
        return built;
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("bin/ep-bench"))
        .unwrap_or(built)
}

#[test]
fn short_sweep_with_check_on_two_gpus() {
    if common::gpus_or_skip("short_sweep_with_check_on_two_gpus", 2).is_none() {
        return;
    }
    let out = Command::new(bench_bin())
        .args([
            "--gpus",
            "2",
            "--tokens",
            "128,512",
            "--hidden",
            "2048",
            "--experts",
            "64",
        ])
        .args(["--iters", "3", "--warmup", "1", "--check", "--quiet"])
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ep-bench failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for needle in [
        "dispatch",
        "combine",
        "nccl-alltoall",
        "nccl-peers",
        "peer-store-ceiling",
        "copy-engine",
        "vs NCCL",
    ] {
        assert!(stdout.contains(needle), "table lacks `{needle}`:\n{stdout}");
    }
    let checks = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with("128") || l.trim_start().starts_with("512"));
    assert!(
        checks.clone().count() >= 10,
        "expected rows for both token counts:\n{stdout}"
    );
    assert!(
        checks
            .filter(|l| l.contains("dispatch"))
            .all(|l| l.trim_end().ends_with("ok")),
        "--check did not pass:\n{stdout}"
    );
}
