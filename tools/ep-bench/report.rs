//! Results and their renderings: aligned table, JSON, CSV; and the progress line.
//!
//! Across ranks, a row reports the **slowest rank** (largest median): its
//! median / min / max in µs and its bytes; GB/s = that rank's bytes / its
//! median (see [`crate::accounting::gbps`], 1 GB = 1e9 B). Ratios compare our
//! ops with the baselines measured in the same [`CaseResult`]:
//! `vs NCCL` = our NVLink GB/s / `nccl-alltoall` NVLink GB/s, `vs peers` =
//! the same over `nccl-peers` (NCCL moving only the NVLink bytes, not the
//! rows that stay on the GPU), `vs ceiling` = our NVLink GB/s /
//! `peer-store-ceiling` NVLink GB/s.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};

use crate::accounting::gbps;
use crate::cli::{Case, Op};

/// Op name of the NCCL all-to-all baseline: grouped send/recv with every
/// rank, this one included (PyTorch's `all_to_all_single`), moving the rows
/// our dispatch moves.
pub const NCCL_ALLTOALL: &str = "nccl-alltoall";
/// Op name of NCCL grouped send/recv with the peers only: the NVLink bytes,
/// without the rows that stay on this GPU.
pub const NCCL_PEERS: &str = "nccl-peers";
/// Op name of the peer-store (SM writes to peer memory) bandwidth ceiling.
pub const PEER_STORE_CEILING: &str = "peer-store-ceiling";
/// Op name of the peer-load (SM reads of peer memory) bandwidth ceiling.
pub const PEER_LOAD_CEILING: &str = "peer-load-ceiling";
/// Op name of the bulk-load ceiling: the bulk-copy kernel reading the peer's
/// buffer into local memory.
pub const BULK_LOAD_CEILING: &str = "bulk-load-ceiling";
/// Op name of the bulk-copy (TMA units of the SMs) bandwidth ceiling.
pub const BULK_COPY_CEILING: &str = "bulk-copy-ceiling";
/// Op name of the copy-engine (`cudaMemcpyPeerAsync`-style) baseline.
pub const COPY_ENGINE: &str = "copy-engine";

/// Summary of one rank's timing samples, in microseconds (µs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    /// Median (µs); the mean of the middle two for an even count.
    pub median_us: f64,
    /// Fastest sample (µs).
    pub min_us: f64,
    /// Slowest sample (µs).
    pub max_us: f64,
}

impl Stat {
    /// Summarizes `samples` (µs); sorts the slice in place. Non-finite
    /// samples are ignored; with no finite sample every field is NaN
    /// (rendered as `-` / `null`).
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn from_samples(samples: &mut [f64]) -> Stat {
        samples.sort_by(|a, b| a.total_cmp(b));
        let finite: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
        let n = finite.len();
        if n == 0 {
            return Stat {
                median_us: f64::NAN,
                min_us: f64::NAN,
                max_us: f64::NAN,
            };
        }
        let median_us = if n % 2 == 1 {
            finite[n / 2]
        } else {
            (finite[n / 2 - 1] + finite[n / 2]) / 2.0
        };
        Stat {
            median_us,
            min_us: finite[0],
            max_us: finite[n - 1],
        }
    }

    /// Whether the median is a finite number.
    pub fn is_valid(&self) -> bool {
        self.median_us.is_finite()
    }
}

/// One op (ours or a baseline) of one case, all ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct OpResult {
    /// `dispatch`, `combine`, ... (see [`Op::name`]) or a baseline:
    /// [`NCCL_ALLTOALL`], [`PEER_STORE_CEILING`], [`COPY_ENGINE`], ...
    pub op: String,
    /// Timing of each rank, indexed by rank.
    pub per_rank: Vec<Stat>,
    /// Bytes (B) each rank pushed across NVLink, indexed by rank.
    pub nvlink_bytes: Vec<u64>,
    /// DeepEP-convention bytes (B) of each rank, indexed by rank.
    pub logical_bytes: Vec<u64>,
}

impl OpResult {
    /// Whether this is one of our ops (as opposed to a baseline).
    pub fn is_ours(&self) -> bool {
        Op::from_name(&self.op).is_some()
    }

    /// The rank with the largest valid median (ties: the lowest rank).
    pub fn slowest_rank(&self) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (r, s) in self.per_rank.iter().enumerate() {
            if s.is_valid() && best.is_none_or(|(_, m)| s.median_us > m) {
                best = Some((r, s.median_us));
            }
        }
        best.map(|(r, _)| r)
    }

    /// The slowest rank's stats (all NaN if no rank has a valid one).
    pub fn stat(&self) -> Stat {
        self.slowest_rank()
            .and_then(|r| self.per_rank.get(r).copied())
            .unwrap_or(Stat {
                median_us: f64::NAN,
                min_us: f64::NAN,
                max_us: f64::NAN,
            })
    }

    /// The slowest rank's median (µs), NaN if none.
    pub fn median_us(&self) -> f64 {
        self.stat().median_us
    }

    /// NVLink bytes (B) of the slowest rank (0 if unknown).
    pub fn row_nvlink_bytes(&self) -> u64 {
        self.slowest_rank()
            .and_then(|r| self.nvlink_bytes.get(r).copied())
            .unwrap_or(0)
    }

    /// Logical bytes (B) of the slowest rank (0 if unknown).
    pub fn row_logical_bytes(&self) -> u64 {
        self.slowest_rank()
            .and_then(|r| self.logical_bytes.get(r).copied())
            .unwrap_or(0)
    }

    /// NVLink GB/s of the slowest rank (0.0 if unknown).
    pub fn nvlink_gbps(&self) -> f64 {
        gbps(self.row_nvlink_bytes(), self.median_us())
    }

    /// Logical (DeepEP "NVL") GB/s of the slowest rank (0.0 if unknown).
    pub fn logical_gbps(&self) -> f64 {
        gbps(self.row_logical_bytes(), self.median_us())
    }
}

/// Everything measured for one case.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseResult {
    /// The configuration.
    pub case: Case,
    /// Our ops, then the baselines, in measurement order.
    pub ops: Vec<OpResult>,
    /// Number of ranks.
    pub world: usize,
    /// Device name (e.g. `NVIDIA H200`).
    pub gpu_name: String,
    /// `--check` outcome: `Some(true)` passed, `Some(false)` failed, `None` not run.
    pub check: Option<bool>,
}

impl CaseResult {
    /// The op or baseline called `name`.
    pub fn op(&self, name: &str) -> Option<&OpResult> {
        self.ops.iter().find(|o| o.op == name)
    }

    fn ratio(&self, op: &OpResult, baseline: &str) -> Option<f64> {
        if !op.is_ours() {
            return None;
        }
        let ours = op.nvlink_gbps();
        let base = self.op(baseline)?.nvlink_gbps();
        if ours > 0.0 && base > 0.0 {
            Some(ours / base)
        } else {
            None
        }
    }

    /// Our NVLink GB/s over `nccl-alltoall`'s, when both are known and
    /// `op` is ours.
    pub fn vs_nccl(&self, op: &OpResult) -> Option<f64> {
        self.ratio(op, NCCL_ALLTOALL)
    }

    /// Our NVLink GB/s over `nccl-peers`', when both are known and `op` is
    /// ours.
    pub fn vs_nccl_peers(&self, op: &OpResult) -> Option<f64> {
        self.ratio(op, NCCL_PEERS)
    }

    /// Our NVLink GB/s over `peer-store-ceiling`'s, when both are known and
    /// `op` is ours.
    pub fn vs_ceiling(&self, op: &OpResult) -> Option<f64> {
        self.ratio(op, PEER_STORE_CEILING)
    }
}

/// Case columns that can vary in a sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CaseField {
    Tokens,
    Hidden,
    Topk,
    Experts,
    Layout,
    NumSms,
}

impl CaseField {
    pub(crate) const ALL: [CaseField; 6] = [
        CaseField::Tokens,
        CaseField::Hidden,
        CaseField::Topk,
        CaseField::Experts,
        CaseField::Layout,
        CaseField::NumSms,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            CaseField::Tokens => "tokens",
            CaseField::Hidden => "hidden",
            CaseField::Topk => "topk",
            CaseField::Experts => "experts",
            CaseField::Layout => "layout",
            CaseField::NumSms => "sms",
        }
    }

    pub(crate) fn value(self, c: &Case) -> String {
        match self {
            CaseField::Tokens => c.tokens.to_string(),
            CaseField::Hidden => c.hidden.to_string(),
            CaseField::Topk => c.topk.to_string(),
            CaseField::Experts => c.experts.to_string(),
            CaseField::Layout => c.layout.to_string(),
            CaseField::NumSms => c.num_sms.to_string(),
        }
    }

    fn numeric(self) -> bool {
        self != CaseField::Layout
    }
}

/// Fields whose value differs between results (in [`CaseField::ALL`] order).
pub(crate) fn varying_fields(results: &[CaseResult]) -> Vec<CaseField> {
    CaseField::ALL
        .into_iter()
        .filter(|f| {
            results
                .first()
                .map(|first| {
                    let v = f.value(&first.case);
                    results.iter().any(|r| f.value(&r.case) != v)
                })
                .unwrap_or(false)
        })
        .collect()
}

fn fmt_num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "-".to_string()
    }
}

fn fmt_ratio(v: Option<f64>) -> String {
    match v {
        Some(r) if r.is_finite() => format!("{r:.2}x"),
        _ => "-".to_string(),
    }
}

fn fmt_check(c: Option<bool>) -> &'static str {
    match c {
        Some(true) => "ok",
        Some(false) => "FAILED",
        None => "-",
    }
}

/// Title line: world size, GPU name and the fixed settings.
fn title(results: &[CaseResult]) -> String {
    let first = &results[0];
    let c = &first.case;
    let mut t = format!(
        "ep-bench: {} x {} | mode {} | {} | routing {}",
        first.world,
        if first.gpu_name.is_empty() {
            "unknown GPU"
        } else {
            &first.gpu_name
        },
        c.mode,
        c.dtype,
        c.routing
    );
    let varying = varying_fields(results);
    let fixed: Vec<String> = CaseField::ALL
        .into_iter()
        .filter(|f| !varying.contains(f))
        .map(|f| format!("{}={}", f.name(), f.value(c)))
        .collect();
    if !fixed.is_empty() {
        let _ = write!(t, " | {}", fixed.join(" "));
    }
    t
}

/// Pads cells into aligned columns (two spaces apart): text left-aligned,
/// numbers right-aligned; a dashed rule under the header. Widths count
/// characters, so `µs` lines up.
fn render_columns(header: &[String], right: &[bool], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: &[String]| -> String {
        let mut s = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            let pad = w.saturating_sub(cell.chars().count());
            if i > 0 {
                s.push_str("  ");
            }
            if right.get(i).copied().unwrap_or(false) {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                if i + 1 < cells.len() {
                    s.push_str(&" ".repeat(pad));
                }
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(header);
    out.push('\n');
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    out.push_str(&line(&rule));
    out.push('\n');
    for row in rows {
        out.push_str(&line(row));
        out.push('\n');
    }
    out
}

/// Human-readable table: a title line (world size, GPU name, fixed
/// settings), then one row per (case, op) with the case columns that vary in
/// the sweep, op, median/min/max µs (slowest rank), NVLink GB/s, logical
/// GB/s, vs NCCL, vs peers, vs ceiling (and `check` when `--check` ran).
pub fn table(results: &[CaseResult]) -> String {
    if results.is_empty() {
        return "ep-bench: no results\n".to_string();
    }
    let varying = varying_fields(results);
    let with_check = results.iter().any(|r| r.check.is_some());
    let mut header: Vec<String> = varying.iter().map(|f| f.name().to_string()).collect();
    let mut right: Vec<bool> = varying.iter().map(|f| f.numeric()).collect();
    for (h, r) in [
        ("op", false),
        ("median µs", true),
        ("min µs", true),
        ("max µs", true),
        ("NVLink GB/s", true),
        ("logical GB/s", true),
        ("vs NCCL", true),
        ("vs peers", true),
        ("vs ceiling", true),
    ] {
        header.push(h.to_string());
        right.push(r);
    }
    if with_check {
        header.push("check".to_string());
        right.push(false);
    }
    let mut rows = Vec::new();
    for res in results {
        for op in &res.ops {
            let st = op.stat();
            let mut row: Vec<String> = varying.iter().map(|f| f.value(&res.case)).collect();
            row.push(op.op.clone());
            row.push(fmt_num(st.median_us, 2));
            row.push(fmt_num(st.min_us, 2));
            row.push(fmt_num(st.max_us, 2));
            // No rank or no bytes (layout): no bandwidth.
            let known = op.slowest_rank().is_some();
            row.push(if known && op.row_nvlink_bytes() > 0 {
                fmt_num(op.nvlink_gbps(), 1)
            } else {
                "-".into()
            });
            row.push(if known && op.row_logical_bytes() > 0 {
                fmt_num(op.logical_gbps(), 1)
            } else {
                "-".into()
            });
            row.push(fmt_ratio(res.vs_nccl(op)));
            row.push(fmt_ratio(res.vs_nccl_peers(op)));
            row.push(fmt_ratio(res.vs_ceiling(op)));
            if with_check {
                row.push(fmt_check(res.check).to_string());
            }
            rows.push(row);
        }
    }
    let mut out = title(results);
    out.push('\n');
    out.push_str(&render_columns(&header, &right, &rows));
    out
}

/// A JSON string literal with `"`, `\` and control characters escaped.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{2028}' || c == '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number, or `null` when not finite.
fn json_f64(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".to_string()
    }
}

fn json_opt_f64(v: Option<f64>) -> String {
    v.map_or("null".to_string(), json_f64)
}

fn json_case(c: &Case) -> String {
    format!(
        "{{\"tokens\": {}, \"hidden\": {}, \"topk\": {}, \"experts\": {}, \"layout\": {}, \
         \"num_sms\": {}, \"mode\": {}, \"dtype\": {}, \"routing\": {}}}",
        c.tokens,
        c.hidden,
        c.topk,
        c.experts,
        json_string(&c.layout.to_string()),
        c.num_sms,
        json_string(c.mode.name()),
        json_string(c.dtype.name()),
        json_string(&c.routing.to_string())
    )
}

/// All results as one JSON document:
/// `{"tool", "version", "results": [{"case": {...}, "world", "gpu_name",
/// "check", "ops": [{"op", "baseline", "median_us", "min_us", "max_us",
/// "slowest_rank", "nvlink_bytes", "logical_bytes", "nvlink_gbps",
/// "logical_gbps", "vs_nccl", "vs_nccl_peers", "vs_ceiling", "per_rank": [{"rank",
/// "median_us", "min_us", "max_us", "nvlink_bytes", "logical_bytes"}]}]}]}`.
/// Times in µs, bytes in B, bandwidths in GB/s; unknown values are `null`.
pub fn json(results: &[CaseResult]) -> String {
    let mut o = String::new();
    o.push_str("{\n  \"tool\": \"ep-bench\",\n");
    let _ = writeln!(
        o,
        "  \"version\": {},",
        json_string(env!("CARGO_PKG_VERSION"))
    );
    o.push_str("  \"results\": [");
    for (ci, res) in results.iter().enumerate() {
        o.push_str(if ci == 0 { "\n" } else { ",\n" });
        o.push_str("    {\n");
        let _ = writeln!(o, "      \"case\": {},", json_case(&res.case));
        let _ = writeln!(o, "      \"world\": {},", res.world);
        let _ = writeln!(o, "      \"gpu_name\": {},", json_string(&res.gpu_name));
        let check = match res.check {
            Some(true) => "true",
            Some(false) => "false",
            None => "null",
        };
        let _ = writeln!(o, "      \"check\": {check},");
        o.push_str("      \"ops\": [");
        for (oi, op) in res.ops.iter().enumerate() {
            o.push_str(if oi == 0 { "\n" } else { ",\n" });
            let st = op.stat();
            let _ = write!(
                o,
                "        {{\"op\": {}, \"baseline\": {}, \"median_us\": {}, \"min_us\": {}, \
                 \"max_us\": {}, \"slowest_rank\": {}, \"nvlink_bytes\": {}, \
                 \"logical_bytes\": {}, \"nvlink_gbps\": {}, \"logical_gbps\": {}, \
                 \"vs_nccl\": {}, \"vs_nccl_peers\": {}, \"vs_ceiling\": {}, \
                 \"per_rank\": [",
                json_string(&op.op),
                !op.is_ours(),
                json_f64(st.median_us),
                json_f64(st.min_us),
                json_f64(st.max_us),
                op.slowest_rank()
                    .map_or("null".to_string(), |r| r.to_string()),
                op.row_nvlink_bytes(),
                op.row_logical_bytes(),
                json_f64(op.nvlink_gbps()),
                json_f64(op.logical_gbps()),
                json_opt_f64(res.vs_nccl(op)),
                json_opt_f64(res.vs_nccl_peers(op)),
                json_opt_f64(res.vs_ceiling(op)),
            );
            for (r, s) in op.per_rank.iter().enumerate() {
                if r > 0 {
                    o.push_str(", ");
                }
                let _ = write!(
                    o,
                    "{{\"rank\": {r}, \"median_us\": {}, \"min_us\": {}, \"max_us\": {}, \
                     \"nvlink_bytes\": {}, \"logical_bytes\": {}}}",
                    json_f64(s.median_us),
                    json_f64(s.min_us),
                    json_f64(s.max_us),
                    op.nvlink_bytes
                        .get(r)
                        .map_or("null".to_string(), |b| b.to_string()),
                    op.logical_bytes
                        .get(r)
                        .map_or("null".to_string(), |b| b.to_string()),
                );
            }
            o.push_str("]}");
        }
        o.push_str(if res.ops.is_empty() {
            "]\n"
        } else {
            "\n      ]\n"
        });
        o.push_str("    }");
    }
    o.push_str(if results.is_empty() {
        "]\n}\n"
    } else {
        "\n  ]\n}\n"
    });
    o
}

/// A CSV field, quoted when it holds a comma, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Column names of [`csv`].
pub const CSV_HEADER: &str = "tokens,hidden,topk,experts,layout,num_sms,mode,dtype,routing,world,\
gpu_name,op,baseline,median_us,min_us,max_us,slowest_rank,nvlink_bytes,logical_bytes,\
nvlink_gbps,logical_gbps,vs_nccl,vs_nccl_peers,vs_ceiling,check,per_rank_median_us";

/// Header plus one line per (case, op). Times in µs, bytes in B, GB/s;
/// unknown values are empty; `per_rank_median_us` is `rank0;rank1;...`.
pub fn csv(results: &[CaseResult]) -> String {
    let mut o = String::from(CSV_HEADER);
    o.push('\n');
    let num = |v: f64| {
        if v.is_finite() {
            format!("{v}")
        } else {
            String::new()
        }
    };
    let opt = |v: Option<f64>| v.map_or(String::new(), num);
    for res in results {
        let c = &res.case;
        for op in &res.ops {
            let st = op.stat();
            let per_rank: Vec<String> = op.per_rank.iter().map(|s| num(s.median_us)).collect();
            let check = match res.check {
                Some(true) => "ok",
                Some(false) => "failed",
                None => "",
            };
            let fields = [
                c.tokens.to_string(),
                c.hidden.to_string(),
                c.topk.to_string(),
                c.experts.to_string(),
                c.layout.to_string(),
                c.num_sms.to_string(),
                c.mode.name().to_string(),
                c.dtype.name().to_string(),
                c.routing.to_string(),
                res.world.to_string(),
                res.gpu_name.clone(),
                op.op.clone(),
                (!op.is_ours()).to_string(),
                num(st.median_us),
                num(st.min_us),
                num(st.max_us),
                op.slowest_rank().map_or(String::new(), |r| r.to_string()),
                op.row_nvlink_bytes().to_string(),
                op.row_logical_bytes().to_string(),
                num(op.nvlink_gbps()),
                num(op.logical_gbps()),
                opt(res.vs_nccl(op)),
                opt(res.vs_nccl_peers(op)),
                opt(res.vs_ceiling(op)),
                check.to_string(),
                per_rank.join(";"),
            ];
            let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
            o.push_str(&line.join(","));
            o.push('\n');
        }
    }
    o
}

/// `[3/12] tokens=4096 hidden=7168 ...` for case `index` (1-based) of `total`.
#[allow(dead_code)] // offered to gpu.rs, which may not use it
pub fn progress_line(index: usize, total: usize, case: &Case) -> String {
    format!("[{index}/{total}] {}", case.label())
}

/// Progress on stderr: one `[i/n] case` line per case, rewritten in place
/// with `\r` when stderr is a terminal, plain lines otherwise. Disabled
/// (prints nothing) when constructed with `enabled = false` (`--quiet`, or
/// ranks other than 0).
#[allow(dead_code)] // offered to gpu.rs, which may not use it
pub struct Progress {
    total: usize,
    done: usize,
    enabled: bool,
    tty: bool,
    last_len: usize,
}

impl Progress {
    /// A progress display for `total` cases; `enabled = false` makes every
    /// call a no-op. Typical: `Progress::new(cases.len(), rank == 0 && !opts.quiet)`.
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn new(total: usize, enabled: bool) -> Progress {
        Progress {
            total,
            done: 0,
            enabled,
            tty: std::io::stderr().is_terminal(),
            last_len: 0,
        }
    }

    /// Announces the next case (counts up from 1).
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn start_case(&mut self, case: &Case) {
        self.done += 1;
        if !self.enabled {
            return;
        }
        let line = progress_line(self.done, self.total, case);
        let mut err = std::io::stderr().lock();
        if self.tty {
            let len = line.chars().count();
            let pad = self.last_len.saturating_sub(len);
            let _ = write!(err, "\r{line}{}", " ".repeat(pad));
            self.last_len = len;
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    /// Ends the in-place line (terminal only). Called on drop as well.
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn finish(&mut self) {
        if self.enabled && self.tty && self.last_len > 0 {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err);
            let _ = err.flush();
        }
        self.last_len = 0;
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cli::{Dtype, Layout, Mode, Routing};

    pub(crate) fn case(tokens: usize, hidden: usize) -> Case {
        Case {
            tokens,
            hidden,
            topk: 8,
            experts: 256,
            layout: Layout::RankMajor,
            num_sms: 24,
            mode: Mode::HighThroughput,
            dtype: Dtype::Bf16,
            routing: Routing::Uniform,
        }
    }

    fn stat(m: f64) -> Stat {
        Stat {
            median_us: m,
            min_us: m * 0.9,
            max_us: m * 1.2,
        }
    }

    pub(crate) fn op(name: &str, medians: &[f64], nvlink: &[u64]) -> OpResult {
        OpResult {
            op: name.to_string(),
            per_rank: medians.iter().map(|&m| stat(m)).collect(),
            nvlink_bytes: nvlink.to_vec(),
            logical_bytes: nvlink.iter().map(|b| b + b / 2).collect(),
        }
    }

    /// Two ranks; dispatch: rank 1 is slowest (100 µs, 2e6 B -> 20 GB/s);
    /// NCCL: 200 µs with 2e6 B -> 10 GB/s; ceiling: 50 µs, 2e6 B -> 40 GB/s.
    pub(crate) fn sample(tokens: usize, hidden: usize, check: Option<bool>) -> CaseResult {
        let k = tokens as f64 / 1024.0;
        CaseResult {
            case: case(tokens, hidden),
            ops: vec![
                op("layout", &[5.0, 6.0], &[0, 0]),
                op("dispatch", &[80.0 * k, 100.0 * k], &[3_000_000, 2_000_000]),
                op("combine", &[90.0 * k, 95.0 * k], &[2_000_000, 3_000_000]),
                op(
                    NCCL_ALLTOALL,
                    &[200.0 * k, 150.0 * k],
                    &[2_000_000, 3_000_000],
                ),
                op(
                    PEER_STORE_CEILING,
                    &[50.0 * k, 50.0 * k],
                    &[2_000_000, 2_000_000],
                ),
            ],
            world: 2,
            gpu_name: "NVIDIA H200".to_string(),
            check,
        }
    }

    #[test]
    fn stat_median_min_max() {
        let s = Stat::from_samples(&mut [5.0, 1.0, 3.0]);
        assert_eq!((s.median_us, s.min_us, s.max_us), (3.0, 1.0, 5.0));
        let s = Stat::from_samples(&mut [4.0, 1.0, 3.0, 10.0]);
        assert_eq!((s.median_us, s.min_us, s.max_us), (3.5, 1.0, 10.0));
        let s = Stat::from_samples(&mut [7.5]);
        assert_eq!((s.median_us, s.min_us, s.max_us), (7.5, 7.5, 7.5));
        let s = Stat::from_samples(&mut [f64::NAN, 2.0, f64::INFINITY, 4.0]);
        assert_eq!((s.median_us, s.min_us, s.max_us), (3.0, 2.0, 4.0));
        let s = Stat::from_samples(&mut []);
        assert!(s.median_us.is_nan() && !s.is_valid());
        let mut v = [3.0, 1.0, 2.0];
        Stat::from_samples(&mut v);
        assert_eq!(v, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn slowest_rank_and_ratios() {
        let r = sample(1024, 7168, None);
        let d = r.op("dispatch").unwrap();
        assert_eq!(d.slowest_rank(), Some(1));
        assert_eq!(d.median_us(), 100.0);
        assert_eq!(d.row_nvlink_bytes(), 2_000_000);
        assert!((d.nvlink_gbps() - 20.0).abs() < 1e-9);
        assert!((d.logical_gbps() - 30.0).abs() < 1e-9);
        // NCCL slowest = rank 0 (200 µs, 2e6 B) -> 10 GB/s; ceiling 40 GB/s.
        assert!((r.vs_nccl(d).unwrap() - 2.0).abs() < 1e-9);
        assert!((r.vs_ceiling(d).unwrap() - 0.5).abs() < 1e-9);
        let nccl = r.op(NCCL_ALLTOALL).unwrap();
        assert!(!nccl.is_ours() && d.is_ours());
        assert_eq!(r.vs_nccl(nccl), None);
        // No nccl-peers row: no ratio; with one (100 µs, 2e6 B -> 20 GB/s): 1.0.
        assert_eq!(r.vs_nccl_peers(d), None);
        let mut wp = r.clone();
        wp.ops
            .push(op(NCCL_PEERS, &[100.0, 80.0], &[2_000_000, 2_000_000]));
        assert!((wp.vs_nccl_peers(wp.op("dispatch").unwrap()).unwrap() - 1.0).abs() < 1e-9);
        assert!((wp.vs_nccl(wp.op("dispatch").unwrap()).unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(wp.vs_nccl_peers(wp.op(NCCL_PEERS).unwrap()), None);
        // Layout moves no bytes: no ratio.
        assert_eq!(r.vs_nccl(r.op("layout").unwrap()), None);
        // No baselines: no ratios.
        let mut nb = r.clone();
        nb.ops.truncate(3);
        assert_eq!(nb.vs_nccl(nb.op("dispatch").unwrap()), None);
        assert_eq!(nb.vs_ceiling(nb.op("dispatch").unwrap()), None);
        // Empty / invalid ranks do not panic.
        let empty = op("dispatch", &[], &[]);
        assert_eq!(empty.slowest_rank(), None);
        assert_eq!(empty.nvlink_gbps(), 0.0);
        let mut short = op("dispatch", &[1.0, 2.0], &[10]);
        assert_eq!(short.row_nvlink_bytes(), 0);
        short.per_rank[1].median_us = f64::NAN;
        assert_eq!(short.slowest_rank(), Some(0));
    }

    #[test]
    fn table_shape() {
        let results = vec![sample(1024, 7168, None), sample(2048, 7168, None)];
        let t = table(&results);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("2 x NVIDIA H200"), "{}", lines[0]);
        assert!(lines[0].contains("hidden=7168"), "{}", lines[0]);
        assert!(lines[1].starts_with("tokens"), "{}", lines[1]);
        assert!(!lines[1].contains("hidden"));
        for h in [
            "op",
            "median µs",
            "NVLink GB/s",
            "logical GB/s",
            "vs NCCL",
            "vs peers",
            "vs ceiling",
        ] {
            assert!(lines[1].contains(h), "missing {h}");
        }
        assert!(lines[2].starts_with("------"));
        assert_eq!(lines.len(), 3 + 2 * 5);
        let dispatch = lines.iter().find(|l| l.contains("dispatch")).unwrap();
        assert!(
            dispatch.contains("100.00") && dispatch.contains("20.0"),
            "{dispatch}"
        );
        assert!(
            dispatch.contains("2.00x") && dispatch.contains("0.50x"),
            "{dispatch}"
        );
        // Columns line up: every row's "op" cell starts at the same column.
        let col = lines[1].find("op").unwrap();
        for l in &lines[3..] {
            let first_op_char = l.chars().nth(col).unwrap();
            assert!(first_op_char.is_ascii_alphabetic(), "{l}");
        }
        // The last column is right-aligned: every line has the same width.
        let w = lines[1].chars().count();
        for l in &lines[1..] {
            assert_eq!(l.chars().count(), w, "{l}");
        }
        // Layout moves no bytes: no bandwidth, no ratios.
        let layout = lines[3..].iter().find(|l| l.contains(" layout ")).unwrap();
        assert!(
            !layout.contains("0.0 ") && layout.trim_end().ends_with('-'),
            "{layout}"
        );
        // Check column appears when --check ran.
        let t = table(&[sample(1024, 7168, Some(false))]);
        assert!(t.contains("check") && t.contains("FAILED"));
        // Nothing varies: no case columns, all in the title.
        let one = table(&[sample(1024, 4096, None)]);
        assert!(one.lines().nth(1).unwrap().starts_with("op"));
        assert!(one.lines().next().unwrap().contains("tokens=1024"));
        assert_eq!(table(&[]), "ep-bench: no results\n");
    }

    #[test]
    fn csv_shape() {
        let results = vec![sample(1024, 7168, Some(true)), sample(2048, 4096, None)];
        let mut r = results.clone();
        r[0].gpu_name = "GPU, \"quoted\"".to_string();
        let text = csv(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 10);
        assert_eq!(lines[0], CSV_HEADER);
        let ncol = CSV_HEADER.split(',').count();
        // Line 2+ (unquoted gpu name) has exactly the header's column count.
        for l in &lines[6..] {
            assert_eq!(l.split(',').count(), ncol, "{l}");
        }
        assert!(lines[1].contains("\"GPU, \"\"quoted\"\"\""), "{}", lines[1]);
        let dispatch = lines.iter().find(|l| l.contains(",dispatch,")).unwrap();
        assert!(dispatch.ends_with(",ok,80;100"), "{dispatch}");
        assert!(
            dispatch.contains(",false,100,90,120,1,2000000,3000000,20,30,2,,0.5,"),
            "{dispatch}"
        );
    }

    // ---- a tiny JSON parser, enough to validate our output ----

    #[derive(Debug, PartialEq)]
    pub(crate) enum J {
        Null,
        Bool(bool),
        Num(f64),
        Str(String),
        Arr(Vec<J>),
        Obj(Vec<(String, J)>),
    }

    impl J {
        pub(crate) fn get(&self, key: &str) -> Option<&J> {
            match self {
                J::Obj(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
                _ => None,
            }
        }
        pub(crate) fn arr(&self) -> &[J] {
            match self {
                J::Arr(a) => a,
                _ => panic!("not an array: {self:?}"),
            }
        }
    }

    pub(crate) fn parse_json(s: &str) -> Result<J, String> {
        let b = s.as_bytes();
        let mut i = 0;
        let v = value(b, &mut i)?;
        ws(b, &mut i);
        if i != b.len() {
            return Err(format!("trailing data at {i}"));
        }
        Ok(v)
    }

    fn ws(b: &[u8], i: &mut usize) {
        while *i < b.len() && b" \t\n\r".contains(&b[*i]) {
            *i += 1;
        }
    }

    fn value(b: &[u8], i: &mut usize) -> Result<J, String> {
        ws(b, i);
        match b.get(*i) {
            Some(b'{') => {
                *i += 1;
                let mut kv = Vec::new();
                ws(b, i);
                if b.get(*i) == Some(&b'}') {
                    *i += 1;
                    return Ok(J::Obj(kv));
                }
                loop {
                    ws(b, i);
                    let k = match value(b, i)? {
                        J::Str(s) => s,
                        other => return Err(format!("key {other:?} at {i}")),
                    };
                    ws(b, i);
                    if b.get(*i) != Some(&b':') {
                        return Err(format!("expected : at {i}"));
                    }
                    *i += 1;
                    if kv.iter().any(|(kk, _): &(String, J)| *kk == k) {
                        return Err(format!("duplicate key {k}"));
                    }
                    kv.push((k, value(b, i)?));
                    ws(b, i);
                    match b.get(*i) {
                        Some(b',') => *i += 1,
                        Some(b'}') => {
                            *i += 1;
                            return Ok(J::Obj(kv));
                        }
                        _ => return Err(format!("expected , or }} at {i}")),
                    }
                }
            }
            Some(b'[') => {
                *i += 1;
                let mut a = Vec::new();
                ws(b, i);
                if b.get(*i) == Some(&b']') {
                    *i += 1;
                    return Ok(J::Arr(a));
                }
                loop {
                    a.push(value(b, i)?);
                    ws(b, i);
                    match b.get(*i) {
                        Some(b',') => *i += 1,
                        Some(b']') => {
                            *i += 1;
                            return Ok(J::Arr(a));
                        }
                        _ => return Err(format!("expected , or ] at {i}")),
                    }
                }
            }
            Some(b'"') => {
                *i += 1;
                let mut s = String::new();
                loop {
                    match b.get(*i) {
                        None => return Err("unterminated string".into()),
                        Some(b'"') => {
                            *i += 1;
                            return Ok(J::Str(s));
                        }
                        Some(b'\\') => {
                            let e = b.get(*i + 1).ok_or("bad escape")?;
                            *i += 2;
                            match e {
                                b'"' => s.push('"'),
                                b'\\' => s.push('\\'),
                                b'/' => s.push('/'),
                                b'n' => s.push('\n'),
                                b'r' => s.push('\r'),
                                b't' => s.push('\t'),
                                b'b' => s.push('\u{8}'),
                                b'f' => s.push('\u{c}'),
                                b'u' => {
                                    let h =
                                        std::str::from_utf8(b.get(*i..*i + 4).ok_or("short \\u")?)
                                            .map_err(|e| e.to_string())?;
                                    let c =
                                        u32::from_str_radix(h, 16).map_err(|e| e.to_string())?;
                                    s.push(char::from_u32(c).ok_or("bad \\u")?);
                                    *i += 4;
                                }
                                _ => return Err(format!("bad escape at {i}")),
                            }
                        }
                        Some(&c) if c < 0x20 => return Err(format!("raw control char at {i}")),
                        Some(_) => {
                            // Copy one UTF-8 character.
                            let rest = std::str::from_utf8(&b[*i..]).map_err(|e| e.to_string())?;
                            let ch = rest.chars().next().ok_or("eof")?;
                            s.push(ch);
                            *i += ch.len_utf8();
                        }
                    }
                }
            }
            Some(b't') if b[*i..].starts_with(b"true") => {
                *i += 4;
                Ok(J::Bool(true))
            }
            Some(b'f') if b[*i..].starts_with(b"false") => {
                *i += 5;
                Ok(J::Bool(false))
            }
            Some(b'n') if b[*i..].starts_with(b"null") => {
                *i += 4;
                Ok(J::Null)
            }
            Some(c) if *c == b'-' || c.is_ascii_digit() => {
                let start = *i;
                *i += 1;
                while *i < b.len() && (b[*i].is_ascii_digit() || b"+-.eE".contains(&b[*i])) {
                    *i += 1;
                }
                let t = std::str::from_utf8(&b[start..*i]).map_err(|e| e.to_string())?;
                // JSON forbids leading zeros and a bare '.'.
                let digits = t.trim_start_matches('-');
                if digits.starts_with('.')
                    || (digits.len() > 1
                        && digits.starts_with('0')
                        && !digits[1..].starts_with(['.', 'e', 'E']))
                {
                    return Err(format!("bad number {t}"));
                }
                t.parse::<f64>()
                    .map(J::Num)
                    .map_err(|_| format!("bad number {t}"))
            }
            other => Err(format!("unexpected {other:?} at {i}")),
        }
    }

    #[test]
    fn json_checker_rejects_garbage() {
        assert!(parse_json("{\"a\": [1, 2.5, -3e2, true, null, \"x\\n\"]}").is_ok());
        for bad in [
            "{",
            "{\"a\" 1}",
            "[1,]",
            "{\"a\":NaN}",
            "\"\u{1}\"",
            "[01]",
            "{} {}",
        ] {
            assert!(parse_json(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn json_shape() {
        let mut results = vec![sample(1024, 7168, Some(true)), sample(2048, 7168, None)];
        results[0].gpu_name = "H200 \"SXM\"\\\n\t\u{1}".to_string();
        results[1].ops[0].per_rank[0].median_us = f64::NAN;
        let text = json(&results);
        let doc = parse_json(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(doc.get("tool"), Some(&J::Str("ep-bench".into())));
        let res = doc.get("results").unwrap().arr();
        assert_eq!(res.len(), 2);
        assert_eq!(
            res[0].get("gpu_name"),
            Some(&J::Str("H200 \"SXM\"\\\n\t\u{1}".into()))
        );
        assert_eq!(res[0].get("check"), Some(&J::Bool(true)));
        assert_eq!(res[1].get("check"), Some(&J::Null));
        assert_eq!(res[0].get("world"), Some(&J::Num(2.0)));
        let case = res[0].get("case").unwrap();
        for k in [
            "tokens", "hidden", "topk", "experts", "layout", "num_sms", "mode", "dtype", "routing",
        ] {
            assert!(case.get(k).is_some(), "case.{k}");
        }
        assert_eq!(case.get("layout"), Some(&J::Str("rank".into())));
        let ops = res[0].get("ops").unwrap().arr();
        assert_eq!(ops.len(), 5);
        let d = &ops[1];
        assert_eq!(d.get("op"), Some(&J::Str("dispatch".into())));
        assert_eq!(d.get("baseline"), Some(&J::Bool(false)));
        assert_eq!(d.get("median_us"), Some(&J::Num(100.0)));
        assert_eq!(d.get("slowest_rank"), Some(&J::Num(1.0)));
        assert_eq!(d.get("nvlink_gbps"), Some(&J::Num(20.0)));
        assert_eq!(d.get("vs_nccl"), Some(&J::Num(2.0)));
        assert_eq!(d.get("vs_ceiling"), Some(&J::Num(0.5)));
        assert_eq!(d.get("vs_nccl_peers"), Some(&J::Null));
        let per_rank = d.get("per_rank").unwrap().arr();
        assert_eq!(per_rank.len(), 2);
        assert_eq!(per_rank[0].get("median_us"), Some(&J::Num(80.0)));
        assert_eq!(per_rank[1].get("nvlink_bytes"), Some(&J::Num(2e6)));
        assert_eq!(ops[3].get("baseline"), Some(&J::Bool(true)));
        assert_eq!(ops[3].get("vs_nccl"), Some(&J::Null));
        // NaN became null.
        let l = &res[1].get("ops").unwrap().arr()[0];
        assert_eq!(
            l.get("per_rank").unwrap().arr()[0].get("median_us"),
            Some(&J::Null)
        );
        // Empty inputs are valid too.
        assert!(parse_json(&json(&[])).is_ok());
        let mut no_ops = sample(1, 8, None);
        no_ops.ops.clear();
        assert!(parse_json(&json(&[no_ops])).is_ok());
    }

    #[test]
    fn progress_lines() {
        let c = case(4096, 7168);
        assert_eq!(
            progress_line(3, 12, &c),
            "[3/12] tokens=4096 hidden=7168 topk=8 experts=256 layout=rank sms=24"
        );
        let mut p = Progress::new(2, false);
        p.start_case(&c);
        p.start_case(&c);
        p.finish();
        assert_eq!(p.done, 2);
    }
}
