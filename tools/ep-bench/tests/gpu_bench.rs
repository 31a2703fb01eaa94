//! GPU test of the profiler (feature `multi-gpu`): a short sweep with
//! `--check` that must exit 0. On >= 2 GPUs the tool starts its own ranks
//! (`--gpus 2`) and the table has the baselines; on one GPU it runs 2, 4 and
//! 8 virtual ranks, whose table, JSON and CSV must say so.
#![cfg(feature = "multi-gpu")]

use std::path::PathBuf;
use std::process::Command;

/// The sweep both tests run (64 experts split over 2, 4 and 8 ranks).
const SWEEP: [&str; 12] = [
    "--tokens",
    "128,512",
    "--hidden",
    "2048",
    "--experts",
    "64",
    "--iters",
    "3",
    "--warmup",
    "1",
    "--check",
    "--quiet",
];

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

/// GPUs to use: all visible, at most `MOE_EP_TEST_GPUS`; 0 (after saying
/// why) without a driver.
fn gpus(test: &str) -> usize {
    match moe_ep::device_count() {
        Ok(n) => std::env::var("MOE_EP_TEST_GPUS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(n, |cap: usize| cap.min(n)),
        Err(e) => {
            eprintln!("SKIP: {test}: {e}");
            0
        }
    }
}

/// Runs ep-bench with `args`; asserts it exits 0; returns stdout and stderr.
fn run(args: &[&str]) -> (String, String) {
    let out = Command::new(bench_bin())
        .args(args)
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "ep-bench {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// The table rows of the sweep's two token counts: at least `ops` each, and
/// every dispatch row's check passed.
fn assert_checked_rows(stdout: &str, ops: usize) {
    let rows: Vec<&str> = stdout
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with("128 ") || l.starts_with("512 "))
        .collect();
    assert!(
        rows.len() >= 2 * ops,
        "expected rows for both token counts:\n{stdout}"
    );
    assert!(
        rows.iter()
            .filter(|l| l.contains("dispatch"))
            .all(|l| l.trim_end().ends_with("ok")),
        "--check did not pass:\n{stdout}"
    );
}

#[test]
fn short_sweep_with_check_on_two_gpus() {
    let found = gpus("short_sweep_with_check_on_two_gpus");
    if found < 2 {
        eprintln!("SKIP: short_sweep_with_check_on_two_gpus: needs 2 GPUs, found {found}");
        return;
    }
    let (stdout, _) = run(&[&["--gpus", "2"][..], &SWEEP].concat());
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
    assert_checked_rows(&stdout, 10);
}

#[test]
fn virtual_ranks_with_check_on_one_gpu() {
    let found = gpus("virtual_ranks_with_check_on_one_gpu");
    if found != 1 {
        eprintln!(
            "SKIP: virtual_ranks_with_check_on_one_gpu: runs where exactly 1 GPU is used, found {found}"
        );
        return;
    }
    for n in ["2", "4", "8"] {
        let tmp = std::env::temp_dir().join(format!("ep-bench-virtual-{n}-{}", std::process::id()));
        let (json, csv) = (tmp.with_extension("json"), tmp.with_extension("csv"));
        let (json_s, csv_s) = (json.to_str().unwrap(), csv.to_str().unwrap());
        let args = [
            &["--virtual-ranks", n][..],
            &SWEEP,
            &["--json", json_s, "--csv", csv_s],
        ];
        let (stdout, stderr) = run(&args.concat());
        let note =
            format!("{n} virtual ranks on one GPU: no NVLink crossed; NVLink baselines left out");
        assert!(stdout.starts_with(&note), "no `{note}`:\n{stdout}");
        for baseline in ["nccl-", "peer-", "bulk-", "copy-engine"] {
            assert!(!stdout.contains(baseline), "a baseline ran:\n{stdout}");
        }
        assert_checked_rows(&stdout, 3);

        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap())
            .expect("--json writes JSON");
        let results = doc["results"].as_array().unwrap();
        assert_eq!(results.len(), 2, "{doc}");
        let mut reduced_sms = false;
        for r in results {
            assert_eq!(r["ranks"], "virtual", "{r}");
            assert_eq!(r["world"].as_u64(), n.parse().ok(), "{r}");
            assert_eq!(r["check"], true, "{r}");
            let ops: Vec<&str> = r["ops"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o["op"].as_str().unwrap())
                .collect();
            assert_eq!(ops, ["layout", "dispatch", "combine"], "{r}");
            reduced_sms |= r["case"]["num_sms"].as_u64().unwrap() < 24;
        }
        if reduced_sms {
            assert!(stderr.contains("--num-sms not given"), "{stderr}");
        }

        let mut rd = csv::Reader::from_path(&csv).expect("--csv writes CSV");
        let header = rd.headers().unwrap().clone();
        let col = |name: &str| header.iter().position(|h| h == name).unwrap();
        let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert_eq!(rows.len(), 2 * 3);
        for row in &rows {
            assert_eq!(
                (&row[col("ranks")], &row[col("check")]),
                ("virtual", "ok"),
                "{row:?}"
            );
        }
        let _ = (std::fs::remove_file(&json), std::fs::remove_file(&csv));
    }
}
