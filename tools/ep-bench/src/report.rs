//! Results and their renderings: the aligned table (stdout), JSON and CSV
//! files (serde), and the progress bar over cases (indicatif).
//!
//! Across ranks, a row reports the **slowest rank** (largest median): its
//! median / min / max in µs and its bytes; GB/s = that rank's bytes / its
//! median (see [`crate::accounting::gbps`], 1 GB = 1e9 B). Ratios compare our
//! ops with the baselines measured in the same [`CaseResult`]:
//! `vs NCCL` = our NVLink GB/s / `nccl-alltoall` NVLink GB/s, `vs peers` =
//! the same over `nccl-peers` (NCCL moving only the NVLink bytes, not the
//! rows that stay on the GPU), `vs ceiling` = our NVLink GB/s /
//! `peer-store-ceiling` NVLink GB/s. `vs NCCL-EP` = the median time of
//! NCCL EP's row for the same op ([`nccl_ep_row`]) over ours:
//! a time ratio, since both move the same rows (at world 1 none crosses
//! NVLink), above 1.00x faster. `vs local` = the median time of the
//! local-copy ceiling that bounds the op ([`local_copy_row`]: the same rows
//! read and written on one GPU with the same SM count) over ours, also a
//! time ratio (above 1.00x: faster than that copy). Virtual ranks have no
//! NVLink baselines, so of the ratios only `vs local`; every record of
//! theirs says `ranks: virtual`.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::accounting::gbps;
use crate::cli::{mode_name, Case, Op};
use crate::memory::{mib, Memory, MoeEpMemory, NcclEpMemory};

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
/// Op name of the local-copy ceiling of dispatch (and combine-bwd): this
/// rank's token rows fanned out on its own GPU into as many rows as it
/// receives (expert-major: padding rows included), same SM count.
pub const LOCAL_COPY_DISPATCH: &str = "local-copy-dispatch";
/// Op name of the local-copy ceiling of combine (combine-push,
/// dispatch-bwd): the received rows (padding included) folded on this GPU
/// into its token rows, same SM count.
pub const LOCAL_COPY_COMBINE: &str = "local-copy-combine";
/// Prefix of NCCL EP's rows.
pub const NCCL_EP_PREFIX: &str = "nccl-ep-";
/// The two-level path's network baseline: the dispatch's network bytes
/// moved by the rail hop alone (NCCL send / receive between rail peers;
/// device copies on virtual ranks).
pub const RAIL_HOP: &str = "rail-hop";
/// NCCL EP's `ncclEpUpdateHandle` (its layout).
pub const NCCL_EP_LAYOUT: &str = "nccl-ep-layout";
/// NCCL EP's forward dispatch.
pub const NCCL_EP_DISPATCH: &str = "nccl-ep-dispatch";
/// NCCL EP's forward dispatch of fp8 rows: its HT dispatch with the
/// `QUANT_FWD` recipe, forwarding the codes and scales of `dispatch-fp8`.
pub const NCCL_EP_DISPATCH_FP8: &str = "nccl-ep-dispatch-fp8";
/// NCCL EP's forward combine.
pub const NCCL_EP_COMBINE: &str = "nccl-ep-combine";
/// NCCL EP's backward combine (the data movement of our dispatch-bwd).
pub const NCCL_EP_DISPATCH_BWD: &str = "nccl-ep-dispatch-bwd";
/// NCCL EP's backward dispatch (the data movement of our combine-bwd).
pub const NCCL_EP_COMBINE_BWD: &str = "nccl-ep-combine-bwd";
/// NCCL EP's low-latency dispatch of bf16 rows.
pub const NCCL_EP_LL_DISPATCH: &str = "nccl-ep-ll-dispatch";
/// NCCL EP's low-latency dispatch casting the rows to fp8 in its kernel.
pub const NCCL_EP_LL_DISPATCH_FP8: &str = "nccl-ep-ll-dispatch-fp8";
/// NCCL EP's low-latency combine.
pub const NCCL_EP_LL_COMBINE: &str = "nccl-ep-ll-combine";
/// NCCL EP's low-latency fp8 dispatch then combine, timed together.
pub const NCCL_EP_LL_PAIR: &str = "nccl-ep-ll-pair";

/// The NCCL EP row that one of our ops is compared with (`vs NCCL-EP`).
pub fn nccl_ep_row(op: Op) -> &'static str {
    match op {
        Op::Layout => NCCL_EP_LAYOUT,
        Op::Dispatch => NCCL_EP_DISPATCH,
        Op::DispatchFp8 => NCCL_EP_DISPATCH_FP8,
        Op::Combine | Op::CombinePush => NCCL_EP_COMBINE,
        Op::DispatchBwd => NCCL_EP_DISPATCH_BWD,
        Op::CombineBwd => NCCL_EP_COMBINE_BWD,
        Op::LlDispatch => NCCL_EP_LL_DISPATCH,
        Op::LlDispatchFp8 => NCCL_EP_LL_DISPATCH_FP8,
        Op::LlCombine => NCCL_EP_LL_COMBINE,
        Op::LlPair => NCCL_EP_LL_PAIR,
    }
}

/// The local-copy ceiling that one of our ops is compared with (`vs
/// local`): ops that fan rows out like dispatch, or in like combine; none
/// for the layout (it moves no rows), nor for the ops that move fp8 rows
/// (the copies move bf16 rows).
pub fn local_copy_row(op: Op) -> Option<&'static str> {
    match op {
        Op::Layout | Op::DispatchFp8 | Op::LlDispatchFp8 | Op::LlPair => None,
        Op::Dispatch | Op::CombineBwd | Op::LlDispatch => Some(LOCAL_COPY_DISPATCH),
        Op::Combine | Op::CombinePush | Op::DispatchBwd | Op::LlCombine => Some(LOCAL_COPY_COMBINE),
    }
}

/// Summary of one rank's timing samples, in microseconds (µs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Stat {
    /// Median (µs); the mean of the middle two for an even count.
    pub median_us: f64,
    /// Fastest sample (µs).
    pub min_us: f64,
    /// Slowest sample (µs).
    pub max_us: f64,
}

impl Stat {
    /// No valid sample: every field NaN (written as `-` / `null` / empty).
    pub const NONE: Stat = Stat {
        median_us: f64::NAN,
        min_us: f64::NAN,
        max_us: f64::NAN,
    };

    /// Summarizes `samples` (µs), ignoring non-finite ones; sorts the slice
    /// in place.
    pub fn from_samples(samples: &mut [f64]) -> Stat {
        samples.sort_by(f64::total_cmp);
        let finite: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
        let n = finite.len();
        if n == 0 {
            return Stat::NONE;
        }
        Stat {
            median_us: (finite[(n - 1) / 2] + finite[n / 2]) / 2.0,
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
    /// Bytes (B) each rank sent over the network (between nodes) in the
    /// op, indexed by rank; empty on one node (`--ranks-per-node`).
    pub network_bytes: Vec<u64>,
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

    /// The slowest rank's stats ([`Stat::NONE`] if no rank has a valid one).
    pub fn stat(&self) -> Stat {
        self.slowest_rank()
            .and_then(|r| self.per_rank.get(r).copied())
            .unwrap_or(Stat::NONE)
    }

    /// The slowest rank's entry of `bytes` (0 if unknown).
    fn slowest_of(&self, bytes: &[u64]) -> u64 {
        self.slowest_rank()
            .and_then(|r| bytes.get(r).copied())
            .unwrap_or(0)
    }

    /// NVLink bytes (B) of the slowest rank (0 if unknown).
    pub fn row_network_bytes(&self) -> u64 {
        self.slowest_of(&self.network_bytes)
    }

    /// The slowest rank's network GB/s (0 without network bytes).
    pub fn network_gbps(&self) -> f64 {
        gbps(self.row_network_bytes(), self.stat().median_us)
    }

    /// The slowest rank's NVLink bytes.
    pub fn row_nvlink_bytes(&self) -> u64 {
        self.slowest_of(&self.nvlink_bytes)
    }

    /// Logical bytes (B) of the slowest rank (0 if unknown).
    pub fn row_logical_bytes(&self) -> u64 {
        self.slowest_of(&self.logical_bytes)
    }

    /// NVLink GB/s of the slowest rank (0.0 if unknown).
    pub fn nvlink_gbps(&self) -> f64 {
        gbps(self.row_nvlink_bytes(), self.stat().median_us)
    }

    /// Logical (DeepEP "NVL") GB/s of the slowest rank (0.0 if unknown).
    pub fn logical_gbps(&self) -> f64 {
        gbps(self.row_logical_bytes(), self.stat().median_us)
    }
}

/// What the ranks of a run were (the `ranks` field of every record).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Ranks {
    /// One GPU per rank, an NCCL communicator, NVLink between the GPUs.
    Nccl,
    /// `--virtual-ranks`: every rank a thread of one process on one GPU.
    Virtual,
}

/// Everything measured for one case.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseResult {
    /// The configuration (with the SM count it ran with).
    pub case: Case,
    /// Our ops, then the baselines, in measurement order.
    pub ops: Vec<OpResult>,
    /// Number of ranks.
    pub world: usize,
    /// NCCL ranks on their own GPUs, or virtual ranks on one.
    pub ranks: Ranks,
    /// Device name (e.g. `NVIDIA H200`).
    pub gpu_name: String,
    /// `--check` outcome: `Some(true)` passed, `Some(false)` failed, `None` not run.
    pub check: Option<bool>,
    /// `--check`'s cross-check of NCCL EP's outputs (same words; `None`
    /// also when NCCL EP did not run).
    pub nccl_ep_check: Option<bool>,
    /// Ranks per node of the two-level path (`--ranks-per-node`); 0: one
    /// node.
    pub ranks_per_node: usize,
    /// Rows per chunk of the two-level dispatch's network hop
    /// (`--hop-chunk-rows`); 0: one node.
    pub hop_chunk_rows: usize,
    /// Device memory of a rank, moe-ep's and NCCL EP's (each field the
    /// largest over the ranks); `None` where not measured.
    pub memory: Option<Memory>,
}

impl CaseResult {
    /// The op or baseline called `name`.
    pub fn op(&self, name: &str) -> Option<&OpResult> {
        self.ops.iter().find(|o| o.op == name)
    }

    /// Our NVLink GB/s over `baseline`'s, when both are known and `op` is ours.
    pub fn ratio(&self, op: &OpResult, baseline: &str) -> Option<f64> {
        let ours = op.nvlink_gbps();
        let base = self.op(baseline)?.nvlink_gbps();
        (op.is_ours() && ours > 0.0 && base > 0.0).then(|| ours / base)
    }

    /// `baseline`'s median time over `op`'s, when both are known.
    fn time_ratio(&self, op: &OpResult, baseline: &str) -> Option<f64> {
        let base = self.op(baseline)?.stat().median_us;
        let mine = op.stat().median_us;
        (base.is_finite() && mine.is_finite() && base > 0.0 && mine > 0.0).then(|| base / mine)
    }

    /// Our network GB/s over the [`RAIL_HOP`] baseline's (`vs hop`: the
    /// same network bytes moved by the hop alone), when both moved some.
    pub fn vs_hop(&self, op: &OpResult) -> Option<f64> {
        let ours = op.network_gbps();
        let base = self.op(RAIL_HOP)?.network_gbps();
        (op.is_ours() && ours > 0.0 && base > 0.0).then(|| ours / base)
    }

    /// NCCL EP's median time for the op over ours (`vs NCCL-EP`), when
    /// both ran and `op` is ours.
    pub fn vs_nccl_ep(&self, op: &OpResult) -> Option<f64> {
        self.time_ratio(op, nccl_ep_row(Op::from_name(&op.op)?))
    }

    /// The median time of the op's local-copy ceiling over ours (`vs
    /// local`), when both ran and `op` is one of ours that moves rows.
    pub fn vs_local(&self, op: &OpResult) -> Option<f64> {
        self.time_ratio(op, local_copy_row(Op::from_name(&op.op)?)?)
    }

    /// Whether a local-copy ceiling row is in this result.
    pub fn has_local_copy(&self) -> bool {
        self.ops
            .iter()
            .any(|o| o.op == LOCAL_COPY_DISPATCH || o.op == LOCAL_COPY_COMBINE)
    }

    /// Whether an fp8 dispatch row (ours or NCCL EP's) is in this result.
    pub fn has_fp8_dispatch(&self) -> bool {
        self.ops
            .iter()
            .any(|o| o.op == Op::DispatchFp8.name() || o.op == NCCL_EP_DISPATCH_FP8)
    }

    /// Whether NCCL EP's rows are in this result.
    pub fn has_nccl_ep(&self) -> bool {
        self.ops.iter().any(|o| o.op.starts_with(NCCL_EP_PREFIX))
    }

    /// The `--check` outcome that row `op` shows: NCCL EP's rows show the
    /// cross-check, every other row the case's check.
    pub fn check_of(&self, op: &OpResult) -> Option<bool> {
        if op.op.starts_with(NCCL_EP_PREFIX) {
            self.nccl_ep_check
        } else {
            self.check
        }
    }

    /// `8 virtual ranks on one NVIDIA H200` or `2 x NVIDIA H200`.
    pub fn who(&self) -> String {
        let gpu = if self.gpu_name.is_empty() {
            "unknown GPU"
        } else {
            &self.gpu_name
        };
        let ranks = match self.ranks {
            Ranks::Virtual => format!("{} virtual ranks on one {gpu}", self.world),
            Ranks::Nccl => format!("{} x {gpu}", self.world),
        };
        match self.ranks_per_node {
            0 => ranks,
            g => format!(
                "{ranks} as {} nodes x {g} (two-level path, hop chunks of {} rows)",
                self.world / g,
                self.hop_chunk_rows
            ),
        }
    }
}

/// The case fields of the table columns, the title and the plot legend, in order.
const CASE_FIELDS: [&str; 6] = ["tokens", "hidden", "topk", "experts", "layout", "sms"];

/// The value of case column `i` of [`CASE_FIELDS`].
fn case_field(c: &Case, i: usize) -> String {
    match i {
        0 => c.tokens.to_string(),
        1 => c.hidden.to_string(),
        2 => c.topk.to_string(),
        3 => c.experts.to_string(),
        4 => c.layout_label(),
        _ => c.num_sms.to_string(),
    }
}

/// Indices of the case fields whose value differs between results.
pub fn varying_fields(results: &[CaseResult]) -> Vec<usize> {
    (0..CASE_FIELDS.len())
        .filter(|&i| {
            results.first().is_some_and(|first| {
                let v = case_field(&first.case, i);
                results.iter().any(|r| case_field(&r.case, i) != v)
            })
        })
        .collect()
}

/// `name=value` of field `i` of `c` (`hidden=7168`).
pub fn field_label(c: &Case, i: usize) -> String {
    format!("{}={}", CASE_FIELDS[i], case_field(c, i))
}

/// A table number with `decimals` decimals, `-` when not finite.
fn fmt_num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "-".to_string()
    }
}

/// Pads cells into aligned columns (two spaces apart): text left-aligned,
/// numbers right-aligned; a dashed rule under the header. Widths count
/// characters, so `µs` lines up.
fn render_columns(header: &[String], right: &[bool], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let mut s = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = " ".repeat(widths[i].saturating_sub(cell.chars().count()));
            if i > 0 {
                s.push_str("  ");
            }
            if right[i] {
                s.push_str(&pad);
                s.push_str(cell);
            } else {
                s.push_str(cell);
                s.push_str(&pad);
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    let mut out = line(header) + &line(&rule);
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

/// Human-readable table: for virtual ranks a line saying so, a title line
/// (ranks, GPU name, fixed settings), then one row per (case, op) with the
/// case columns that vary in the sweep, op, median/min/max µs (slowest
/// rank), NVLink GB/s, logical GB/s, vs NCCL, vs peers, vs ceiling (not for
/// virtual ranks, which have no NVLink baselines), vs NCCL-EP (when NCCL EP
/// ran), vs local (when a local-copy ceiling ran) and `check` when
/// `--check` ran (NCCL EP's rows: its cross-check).
pub fn table(results: &[CaseResult]) -> String {
    let Some(first) = results.first() else {
        return "ep-bench: no results\n".to_string();
    };
    let varying = varying_fields(results);
    let c = &first.case;
    let fixed: Vec<String> = (0..CASE_FIELDS.len())
        .filter(|i| !varying.contains(i))
        .map(|i| field_label(c, i))
        .collect();
    let mut out = String::new();
    if first.ranks == Ranks::Virtual {
        out += &format!(
            "{} virtual ranks on one GPU: no NVLink crossed; NVLink baselines left out\n",
            first.world
        );
    }
    out += &format!(
        "ep-bench: {} | mode {} | {} | routing {}",
        first.who(),
        mode_name(c.mode),
        c.dtype.name(),
        c.routing
    );
    if !fixed.is_empty() {
        out += &format!(" | {}", fixed.join(" "));
    }
    if results.iter().any(CaseResult::has_fp8_dispatch) {
        out += &format!(
            " | dispatch-fp8: e4m3 codes + {} scales",
            c.fp8_scales.describe()
        );
    }
    out.push('\n');

    let with_check = results
        .iter()
        .any(|r| r.check.is_some() || r.nccl_ep_check.is_some());
    let with_ep = results.iter().any(CaseResult::has_nccl_ep);
    let with_local = results.iter().any(CaseResult::has_local_copy);
    let with_net = results
        .iter()
        .any(|r| r.ops.iter().any(|o| o.row_network_bytes() > 0));
    let with_hop = results.iter().any(|r| r.op(RAIL_HOP).is_some());
    let mut header: Vec<String> = varying.iter().map(|&i| CASE_FIELDS[i].into()).collect();
    // Every case column is a number but the layout.
    let mut right: Vec<bool> = varying.iter().map(|&i| i != 4).collect();
    // Virtual ranks have no NVLink baselines: none of their ratio columns.
    let ratios: &[&str] = match first.ranks {
        Ranks::Nccl => &[NCCL_ALLTOALL, NCCL_PEERS, PEER_STORE_CEILING],
        Ranks::Virtual => &[],
    };
    // Virtual ranks cross no NVLink: no NVLink GB/s either.
    let nvlink = first.ranks == Ranks::Nccl;
    let columns = [
        "op",
        "median µs",
        "min µs",
        "max µs",
        "NVLink GB/s",
        "logical GB/s",
        "vs NCCL",
        "vs peers",
        "vs ceiling",
    ];
    let columns = columns[..6 + ratios.len()]
        .iter()
        .filter(|h| nvlink || **h != "NVLink GB/s")
        .chain(with_net.then_some(&"net GB/s"))
        .chain(with_hop.then_some(&"vs hop"))
        .chain(with_ep.then_some(&"vs NCCL-EP"))
        .chain(with_local.then_some(&"vs local"))
        .chain(with_check.then_some(&"check"));
    for h in columns {
        header.push(h.to_string());
        right.push(!matches!(*h, "op" | "check"));
    }
    let mut rows = Vec::new();
    for res in results {
        for op in &res.ops {
            let st = op.stat();
            let known = op.slowest_rank().is_some();
            // No rank or no bytes (layout): no bandwidth.
            let bw = |bytes: u64, v: f64| {
                if known && bytes > 0 {
                    fmt_num(v, 1)
                } else {
                    "-".into()
                }
            };
            let ratio = |b: &str| {
                res.ratio(op, b)
                    .filter(|r| r.is_finite())
                    .map_or("-".into(), |r| format!("{r:.2}x"))
            };
            let mut row: Vec<String> = varying.iter().map(|&i| case_field(&res.case, i)).collect();
            row.extend([
                op.op.clone(),
                fmt_num(st.median_us, 2),
                fmt_num(st.min_us, 2),
                fmt_num(st.max_us, 2),
            ]);
            if nvlink {
                row.push(bw(op.row_nvlink_bytes(), op.nvlink_gbps()));
            }
            row.push(bw(op.row_logical_bytes(), op.logical_gbps()));
            row.extend(ratios.iter().map(|b| ratio(b)));
            let times = |r: Option<f64>| {
                r.filter(|r| r.is_finite())
                    .map_or("-".into(), |r| format!("{r:.2}x"))
            };
            if with_net {
                row.push(bw(op.row_network_bytes(), op.network_gbps()));
            }
            if with_hop {
                row.push(times(res.vs_hop(op)));
            }
            if with_ep {
                row.push(times(res.vs_nccl_ep(op)));
            }
            if with_local {
                row.push(times(res.vs_local(op)));
            }
            if with_check {
                row.push(check_word(res.check_of(op), "ok", "FAILED", "-").into());
            }
            rows.push(row);
        }
    }
    out + &render_columns(&header, &right, &rows) + &memory_table(results, &varying)
}

/// The memory block under the op table, when some case has its memory
/// ([`crate::memory`]): a line on what is counted, then per case one row
/// for moe-ep and, where it ran, one for NCCL EP (library `NCCL-EP`):
/// group, handle and device MiB, and how each figure came about.
fn memory_table(results: &[CaseResult], varying: &[usize]) -> String {
    if results.iter().all(|r| r.memory.is_none()) {
        return String::new();
    }
    let mut header: Vec<String> = varying.iter().map(|&i| CASE_FIELDS[i].into()).collect();
    let mut right: Vec<bool> = varying.iter().map(|&i| i != 4).collect();
    for h in [
        "library",
        "group MiB",
        "handle MiB",
        "device MiB",
        "of which",
    ] {
        header.push(h.into());
        right.push(!matches!(h, "library" | "of which"));
    }
    let mut rows = Vec::new();
    for res in results {
        let Some(m) = &res.memory else { continue };
        let case: Vec<String> = varying.iter().map(|&i| case_field(&res.case, i)).collect();
        let ours = &m.moe_ep;
        let mut row = case.clone();
        row.extend([
            "moe-ep".to_string(),
            mib(ours.group()),
            ours.handle.map_or("-".into(), mib),
            mib(ours.device()),
            format!(
                "workspace {}, low-latency {}, pool {} (free {}), two-level {}; pinned host {} B{}",
                mib(ours.workspace),
                mib(ours.low_latency),
                mib(ours.pool_other),
                mib(ours.pool_free),
                mib(ours.two_level),
                ours.pinned_host,
                if ours.handle.is_none() {
                    "; no handle"
                } else {
                    ""
                }
            ),
        ]);
        rows.push(row);
        if let (Some(sized), Some(used)) = (ours.sized_to_case(), ours.pool_in_use) {
            let mut row = case.clone();
            row.extend([
                "moe-ep sized".to_string(),
                mib(sized - ours.handle.unwrap_or(0)),
                ours.handle.map_or("-".into(), mib),
                mib(sized),
                format!(
                    "the pool sized to the case: workspace {}, pool in use {} (receive \
                     buffers, a dispatch's ids and sources, the handle's rows)",
                    mib(ours.workspace),
                    mib(used)
                ),
            ]);
            rows.push(row);
        }
        if let Some(ep) = &m.nccl_ep {
            let mut row = case;
            row.extend([
                "NCCL-EP".to_string(),
                mib(ep.group_measured),
                ep.handle_queried.map_or("-".into(), mib),
                mib(ep.device()),
                format!(
                    "group: cuMemGetInfo around ncclEpCreateGroup; handle: {}; \
                     device: group + ncclEpInitHandle's {} by cuMemGetInfo",
                    if ep.handle_queried.is_some() {
                        "ncclEpHandleMemSize"
                    } else {
                        "not queried (no ncclEpHandleMemSize)"
                    },
                    mib(ep.init_handle_measured)
                ),
            ]);
            rows.push(row);
        }
    }
    "\nmemory per rank (largest rank), MiB = 2^20 B: moe-ep's group at creation \
     (EpGroup::memory_footprint) and handle (Handle::device_bytes), and sized to the case \
     (its pool as much as a dispatch's outputs and the receive buffers use); tokens and \
     outputs in neither\n"
        .to_string()
        + &render_columns(&header, &right, &rows)
}

/// The word of a `--check` outcome: passed, failed, not run.
fn check_word(
    c: Option<bool>,
    ok: &'static str,
    failed: &'static str,
    none: &'static str,
) -> &'static str {
    match c {
        Some(true) => ok,
        Some(false) => failed,
        None => none,
    }
}

/// A finite value, else `None` (`null` in JSON, empty in CSV).
fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

/// The case fields of a JSON record and the first CSV columns.
#[derive(Serialize)]
struct CaseRecord {
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    layout: String,
    num_sms: usize,
    mode: &'static str,
    dtype: &'static str,
    routing: String,
    /// The scales of the fp8 dispatch rows (`f32`, `e8m0`); `None` (null,
    /// empty) in a case without them.
    fp8_scales: Option<&'static str>,
}

impl CaseRecord {
    /// The record of `res`'s case.
    fn new(res: &CaseResult) -> Self {
        let c = &res.case;
        CaseRecord {
            tokens: c.tokens,
            hidden: c.hidden,
            topk: c.topk,
            experts: c.experts,
            layout: c.layout_label(),
            num_sms: c.num_sms,
            mode: mode_name(c.mode),
            dtype: c.dtype.name(),
            routing: c.routing.to_string(),
            fp8_scales: res.has_fp8_dispatch().then(|| c.fp8_scales.name()),
        }
    }
}

/// One op's summary over the ranks: a JSON op record without `per_rank`,
/// and the middle CSV columns.
#[derive(Serialize)]
struct OpRecord<'a> {
    op: &'a str,
    baseline: bool,
    median_us: Option<f64>,
    min_us: Option<f64>,
    max_us: Option<f64>,
    slowest_rank: Option<usize>,
    /// `None` on virtual ranks (no NVLink crossed): left out.
    #[serde(skip_serializing_if = "Option::is_none")]
    nvlink_bytes: Option<u64>,
    network_bytes: u64,
    logical_bytes: u64,
    /// `None` on virtual ranks: left out.
    #[serde(skip_serializing_if = "Option::is_none")]
    nvlink_gbps: Option<f64>,
    logical_gbps: f64,
    vs_nccl: Option<f64>,
    vs_nccl_peers: Option<f64>,
    vs_ceiling: Option<f64>,
    vs_nccl_ep: Option<f64>,
    vs_local: Option<f64>,
}

impl<'a> OpRecord<'a> {
    /// The summary of `op`, measured in `res`.
    fn new(res: &CaseResult, op: &'a OpResult) -> Self {
        let st = op.stat();
        let nvlink = res.ranks == Ranks::Nccl;
        OpRecord {
            op: &op.op,
            baseline: !op.is_ours(),
            median_us: finite(st.median_us),
            min_us: finite(st.min_us),
            max_us: finite(st.max_us),
            slowest_rank: op.slowest_rank(),
            nvlink_bytes: nvlink.then(|| op.row_nvlink_bytes()),
            network_bytes: op.row_network_bytes(),
            logical_bytes: op.row_logical_bytes(),
            nvlink_gbps: nvlink.then(|| op.nvlink_gbps()),
            logical_gbps: op.logical_gbps(),
            vs_nccl: res.ratio(op, NCCL_ALLTOALL),
            vs_nccl_peers: res.ratio(op, NCCL_PEERS),
            vs_ceiling: res.ratio(op, PEER_STORE_CEILING),
            vs_nccl_ep: res.vs_nccl_ep(op),
            vs_local: res.vs_local(op),
        }
    }
}

/// A case's memory in JSON ([`crate::memory`]): every figure in bytes, the
/// largest over the ranks, with the totals and how NCCL EP's were found.
#[derive(Serialize)]
struct MemoryRecord {
    moe_ep: MoeEpRecord,
    nccl_ep: Option<NcclEpRecord>,
}

#[derive(Serialize)]
struct MoeEpRecord {
    #[serde(flatten)]
    parts: MoeEpMemory,
    group: u64,
    device: u64,
    sized_to_case: Option<u64>,
}

#[derive(Serialize)]
struct NcclEpRecord {
    #[serde(flatten)]
    parts: NcclEpMemory,
    device: u64,
    group_how: &'static str,
    handle_how: &'static str,
}

impl MemoryRecord {
    fn new(m: &Memory) -> Self {
        MemoryRecord {
            moe_ep: MoeEpRecord {
                parts: m.moe_ep,
                group: m.moe_ep.group(),
                device: m.moe_ep.device(),
                sized_to_case: m.moe_ep.sized_to_case(),
            },
            nccl_ep: m.nccl_ep.map(|n| NcclEpRecord {
                parts: n,
                device: n.device(),
                group_how: "measured: cuMemGetInfo around ncclEpCreateGroup",
                handle_how: match n.handle_queried {
                    Some(_) => "queried: ncclEpHandleMemSize",
                    None => "not queried: no ncclEpHandleMemSize",
                },
            }),
        }
    }
}

/// All results as one JSON document:
/// `{"tool", "version", "results": [{"case": {"tokens", "hidden", "topk",
/// "experts", "layout", "num_sms", "mode", "dtype", "routing", "fp8_scales"}, "world",
/// "ranks_per_node", "hop_chunk_rows", "ranks", "gpu_name", "check", "ops": [{"op", "baseline", "median_us",
/// "min_us", "max_us", "slowest_rank", "nvlink_bytes", "network_bytes", "logical_bytes",
/// "nvlink_gbps", "logical_gbps", "vs_nccl", "vs_nccl_peers", "vs_ceiling",
/// "vs_nccl_ep", "vs_local", "per_rank": [{"rank", "median_us", "min_us", "max_us",
/// "nvlink_bytes", "network_bytes", "logical_bytes"}]}], "nccl_ep_check",
/// "memory": {"moe_ep": {"workspace", "low_latency", "pool_other",
/// "pool_free", "two_level", "pinned_host", "handle", "pool_in_use", "group", "device",
/// "sized_to_case"},
/// "nccl_ep": {"group_measured", "handle_queried", "init_handle_measured",
/// "device", "group_how", "handle_how"}}}]}`. Times in µs, bytes in B,
/// bandwidths in GB/s; unknown values are `null`; `ranks` is `"nccl"` or
/// `"virtual"`. Virtual ranks' records have no `nvlink_bytes` and
/// `nvlink_gbps` (they cross no NVLink), nor have their CSV rows. The
/// memory is a rank's (each figure the largest over the ranks;
/// [`crate::memory`]); `nccl_ep` is `null` where NCCL EP did not run.
pub fn json(results: &[CaseResult]) -> String {
    #[derive(Serialize)]
    struct RankRecord {
        rank: usize,
        #[serde(flatten)]
        stat: Stat,
        #[serde(skip_serializing_if = "Option::is_none")]
        nvlink_bytes: Option<u64>,
        network_bytes: Option<u64>,
        logical_bytes: Option<u64>,
    }
    #[derive(Serialize)]
    struct OpWithRanks<'a> {
        #[serde(flatten)]
        summary: OpRecord<'a>,
        per_rank: Vec<RankRecord>,
    }
    #[derive(Serialize)]
    struct CaseOut<'a> {
        case: CaseRecord,
        world: usize,
        ranks_per_node: usize,
        hop_chunk_rows: usize,
        ranks: Ranks,
        gpu_name: &'a str,
        check: Option<bool>,
        ops: Vec<OpWithRanks<'a>>,
        nccl_ep_check: Option<bool>,
        memory: Option<MemoryRecord>,
    }
    #[derive(Serialize)]
    struct Doc<'a> {
        tool: &'static str,
        version: &'static str,
        results: Vec<CaseOut<'a>>,
    }
    let doc = Doc {
        tool: "ep-bench",
        version: env!("CARGO_PKG_VERSION"),
        results: results
            .iter()
            .map(|res| CaseOut {
                case: CaseRecord::new(res),
                world: res.world,
                ranks_per_node: res.ranks_per_node,
                hop_chunk_rows: res.hop_chunk_rows,
                ranks: res.ranks,
                gpu_name: &res.gpu_name,
                check: res.check,
                ops: res
                    .ops
                    .iter()
                    .map(|op| OpWithRanks {
                        summary: OpRecord::new(res, op),
                        per_rank: (op.per_rank.iter().enumerate())
                            .map(|(rank, &stat)| RankRecord {
                                rank,
                                stat,
                                nvlink_bytes: (res.ranks == Ranks::Nccl)
                                    .then(|| op.nvlink_bytes.get(rank).copied())
                                    .flatten(),
                                network_bytes: op.network_bytes.get(rank).copied(),
                                logical_bytes: op.logical_bytes.get(rank).copied(),
                            })
                            .collect(),
                    })
                    .collect(),
                nccl_ep_check: res.nccl_ep_check,
                memory: res.memory.as_ref().map(MemoryRecord::new),
            })
            .collect(),
    };
    serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n"
}

/// Header plus one line per (case, op): `tokens, hidden, topk, experts,
/// layout, num_sms, mode, dtype, routing, fp8_scales, world, gpu_name, op, baseline,
/// median_us, min_us, max_us, slowest_rank, nvlink_bytes, network_bytes,
/// logical_bytes, nvlink_gbps, logical_gbps, vs_nccl, vs_nccl_peers, vs_ceiling,
/// vs_nccl_ep, vs_local, check, per_rank_median_us, ranks`. Times in µs, bytes in B,
/// GB/s; unknown values are empty; `check` is `ok` / `failed` / empty (the
/// row's: NCCL EP's rows give the cross-check); `per_rank_median_us` is
/// `rank0;rank1;...`; `ranks` is `nccl` or `virtual`. Virtual ranks' rows
/// have no `nvlink_bytes` and `nvlink_gbps` columns (no NVLink crossed), as
/// their table and JSON.
pub fn csv(results: &[CaseResult]) -> String {
    #[derive(Serialize)]
    struct Run<'a> {
        world: usize,
        gpu_name: &'a str,
    }
    #[derive(Serialize)]
    struct Tail {
        check: &'static str,
        per_rank_median_us: String,
        ranks: Ranks,
    }
    let mut w = csv::Writer::from_writer(Vec::new());
    for res in results {
        for op in &res.ops {
            let per_rank: Vec<String> = (op.per_rank.iter())
                .map(|s| finite(s.median_us).map_or(String::new(), |v| v.to_string()))
                .collect();
            let row = (
                CaseRecord::new(res),
                Run {
                    world: res.world,
                    gpu_name: &res.gpu_name,
                },
                OpRecord::new(res, op),
                Tail {
                    check: check_word(res.check_of(op), "ok", "failed", ""),
                    per_rank_median_us: per_rank.join(";"),
                    ranks: res.ranks,
                },
            );
            w.serialize(row).expect("plain data serializes");
        }
    }
    String::from_utf8(w.into_inner().expect("writes to memory")).expect("UTF-8 fields")
}

/// The progress bar over `total` cases on stderr, or a hidden one when not
/// `enabled` (`--quiet`, ranks other than 0) or stderr is not a terminal.
pub fn progress(total: usize, enabled: bool) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{bar:30} [{pos}/{len}] {elapsed} {wide_msg}")
        .expect("a valid template");
    ProgressBar::new(total as u64).with_style(style)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cli::{Dtype, Routing, ScaleKind};
    use moe_ep::testkit::workload;
    use moe_ep::{Mode, RecvLayout};

    pub(crate) fn case(tokens: usize, hidden: usize) -> Case {
        Case {
            tokens,
            hidden,
            topk: 8,
            experts: 256,
            layout: RecvLayout::RankMajor,
            num_sms: 24,
            mode: Mode::HighThroughput,
            dtype: Dtype::Bf16,
            fp8_scales: ScaleKind::F32,
            routing: Routing::Generated(workload::Routing::Uniform),
        }
    }

    pub(crate) fn op(name: &str, medians: &[f64], nvlink: &[u64]) -> OpResult {
        OpResult {
            op: name.to_string(),
            per_rank: (medians.iter())
                .map(|&m| Stat {
                    median_us: m,
                    min_us: m * 0.9,
                    max_us: m * 1.2,
                })
                .collect(),
            nvlink_bytes: nvlink.to_vec(),
            logical_bytes: nvlink.iter().map(|b| b + b / 2).collect(),
            network_bytes: Vec::new(),
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
            ranks: Ranks::Nccl,
            gpu_name: "NVIDIA H200".to_string(),
            check,
            nccl_ep_check: None,
            ranks_per_node: 0,
            hop_chunk_rows: 0,
            memory: None,
        }
    }

    /// `sample` as 8 virtual ranks would report it: our ops only.
    fn virtual_sample(tokens: usize) -> CaseResult {
        let mut r = sample(tokens, 7168, Some(true));
        r.ops.truncate(3);
        (r.world, r.ranks) = (8, Ranks::Virtual);
        r
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
        assert!(!Stat::from_samples(&mut []).is_valid());
        let mut v = [3.0, 1.0, 2.0];
        Stat::from_samples(&mut v);
        assert_eq!(v, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn slowest_rank_and_ratios() {
        let r = sample(1024, 7168, None);
        let d = r.op("dispatch").unwrap();
        assert_eq!(d.slowest_rank(), Some(1));
        assert_eq!(d.stat().median_us, 100.0);
        assert_eq!(d.row_nvlink_bytes(), 2_000_000);
        assert!((d.nvlink_gbps() - 20.0).abs() < 1e-9);
        assert!((d.logical_gbps() - 30.0).abs() < 1e-9);
        // NCCL slowest = rank 0 (200 µs, 2e6 B) -> 10 GB/s; ceiling 40 GB/s.
        assert!((r.ratio(d, NCCL_ALLTOALL).unwrap() - 2.0).abs() < 1e-9);
        assert!((r.ratio(d, PEER_STORE_CEILING).unwrap() - 0.5).abs() < 1e-9);
        let nccl = r.op(NCCL_ALLTOALL).unwrap();
        assert!(!nccl.is_ours() && d.is_ours());
        assert_eq!(r.ratio(nccl, NCCL_ALLTOALL), None);
        // No nccl-peers row: no ratio; with one (100 µs, 2e6 B -> 20 GB/s): 1.0.
        assert_eq!(r.ratio(d, NCCL_PEERS), None);
        let mut wp = r.clone();
        wp.ops
            .push(op(NCCL_PEERS, &[100.0, 80.0], &[2_000_000, 2_000_000]));
        assert!((wp.ratio(wp.op("dispatch").unwrap(), NCCL_PEERS).unwrap() - 1.0).abs() < 1e-9);
        // Layout moves no bytes: no ratio.
        assert_eq!(r.ratio(r.op("layout").unwrap(), NCCL_ALLTOALL), None);
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
            assert!(l.chars().nth(col).unwrap().is_ascii_alphabetic(), "{l}");
        }
        // The last column is right-aligned: every line has the same width.
        let w = lines[1].chars().count();
        for l in &lines[1..] {
            assert_eq!(l.chars().count(), w, "{l}");
        }
        // Layout moves no bytes: no bandwidth, no ratios.
        let layout = lines[3..].iter().find(|l| l.contains(" layout ")).unwrap();
        assert!(
            !layout.contains("0.0 ") && layout.ends_with('-'),
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
    fn virtual_ranks_say_so() {
        let t = table(&[virtual_sample(1024), virtual_sample(2048)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "8 virtual ranks on one GPU: no NVLink crossed; NVLink baselines left out"
        );
        assert!(
            lines[1].contains("8 virtual ranks on one NVIDIA H200"),
            "{}",
            lines[1]
        );
        assert!(!lines[1].contains(" x "), "{}", lines[1]);
        assert!(lines[2].ends_with("logical GB/s  check"), "{}", lines[2]);
        // No NVLink crossed: no NVLink GB/s column, in the table, JSON or CSV.
        assert!(!t.contains("NVLink GB/s"), "{t}");
        assert!(lines[2].contains("max µs  logical GB/s"), "{}", lines[2]);
        // dispatch: 100 µs, 3e6 logical B -> 30.0 GB/s right after max µs.
        let d: Vec<&str> = lines[5].split_whitespace().collect();
        assert_eq!(
            d,
            ["1024", "dispatch", "100.00", "90.00", "120.00", "30.0", "ok"],
            "{t}"
        );
        let doc: serde_json::Value = serde_json::from_str(&json(&[virtual_sample(1024)])).unwrap();
        assert_eq!(doc["results"][0]["ranks"], "virtual");
        for o in doc["results"][0]["ops"].as_array().unwrap() {
            assert!(
                o.get("nvlink_bytes").is_none() && o.get("nvlink_gbps").is_none(),
                "{o}"
            );
            assert!(o.get("logical_gbps").is_some(), "{o}");
            for r in o["per_rank"].as_array().unwrap() {
                assert!(r.get("nvlink_bytes").is_none(), "{r}");
                assert!(r.get("logical_bytes").is_some(), "{r}");
            }
        }
        // Real ranks keep them.
        let real: serde_json::Value =
            serde_json::from_str(&json(&[sample(1024, 7168, None)])).unwrap();
        assert_eq!(real["results"][0]["ops"][1]["nvlink_bytes"], 2_000_000);
        assert_eq!(
            real["results"][0]["ops"][1]["per_rank"][0]["nvlink_bytes"],
            3_000_000
        );
        let text = csv(&[virtual_sample(1024)]);
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        assert!(
            !header.iter().any(|h| h.starts_with("nvlink_")),
            "{header:?}"
        );
        let ranks = header.iter().position(|h| h == "ranks").unwrap();
        for rec in rd.records() {
            assert_eq!(&rec.unwrap()[ranks], "virtual");
        }
    }

    /// `dispatch-fp8` beside NCCL EP's fp8 dispatch: its `vs NCCL-EP`
    /// against that row (not the bf16 one), no `vs local`; the title, JSON
    /// and CSV name the scales; a case without it has none.
    #[test]
    fn fp8_dispatch_rows() {
        assert_eq!(nccl_ep_row(Op::DispatchFp8), NCCL_EP_DISPATCH_FP8);
        assert_eq!(local_copy_row(Op::DispatchFp8), None);
        let mut r = sample(4096, 7168, Some(true));
        r.case.fp8_scales = ScaleKind::E8m0;
        r.ops.insert(2, op("dispatch-fp8", &[40.0, 50.0], &[0, 0]));
        r.ops.push(op(NCCL_EP_DISPATCH, &[300.0, 300.0], &[0, 0]));
        r.ops
            .push(op(NCCL_EP_DISPATCH_FP8, &[150.0, 150.0], &[0, 0]));
        r.nccl_ep_check = Some(true);
        let fp8 = r.op("dispatch-fp8").unwrap();
        assert_eq!(r.vs_nccl_ep(fp8), Some(3.0));
        assert_eq!(r.vs_local(fp8), None);
        assert!(r.has_fp8_dispatch() && !sample(1024, 7168, None).has_fp8_dispatch());
        let t = table(std::slice::from_ref(&r));
        let title = t.lines().next().unwrap();
        assert!(
            title.ends_with("| dispatch-fp8: e4m3 codes + e8m0 per 32 values scales"),
            "{title}"
        );
        let row = t.lines().find(|l| l.starts_with("dispatch-fp8 ")).unwrap();
        assert!(row.contains("3.00x"), "{row}");
        let doc: serde_json::Value = serde_json::from_str(&json(&[r.clone()])).unwrap();
        assert_eq!(doc["results"][0]["case"]["fp8_scales"], "e8m0");
        assert_eq!(doc["results"][0]["ops"][2]["op"], "dispatch-fp8");
        assert_eq!(doc["results"][0]["ops"][2]["vs_nccl_ep"], 3.0);
        let plain: serde_json::Value =
            serde_json::from_str(&json(&[sample(1024, 7168, None)])).unwrap();
        assert!(plain["results"][0]["case"]["fp8_scales"].is_null());
        let text = csv(&[r]);
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        let at = header.iter().position(|h| h == "fp8_scales").unwrap();
        let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert!(rows.iter().all(|row| &row[at] == "e8m0"));
        let ep = header.iter().position(|h| h == "op").unwrap();
        assert!(rows.iter().any(|row| &row[ep] == NCCL_EP_DISPATCH_FP8));
    }

    /// The two-level path's title and JSON say its nodes and hop chunks.
    #[test]
    fn two_level_says_its_nodes_and_chunks() {
        let mut r = virtual_sample(1024);
        (r.ranks_per_node, r.hop_chunk_rows) = (2, 128);
        let t = table(std::slice::from_ref(&r));
        assert!(
            t.contains("as 4 nodes x 2 (two-level path, hop chunks of 128 rows)"),
            "{t}"
        );
        let doc: serde_json::Value = serde_json::from_str(&json(&[r])).unwrap();
        assert_eq!(doc["results"][0]["ranks_per_node"], 2);
        assert_eq!(doc["results"][0]["hop_chunk_rows"], 128);
        let flat: serde_json::Value = serde_json::from_str(&json(&[virtual_sample(1024)])).unwrap();
        assert_eq!(flat["results"][0]["hop_chunk_rows"], 0);
    }

    #[test]
    fn csv_shape() {
        let mut r = vec![sample(1024, 7168, Some(true)), sample(2048, 4096, None)];
        r[0].gpu_name = "GPU, \"quoted\"".to_string();
        let text = csv(&r);
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        assert_eq!(
            header.join(","),
            "tokens,hidden,topk,experts,layout,num_sms,mode,dtype,routing,fp8_scales,world,gpu_name,op,\
             baseline,median_us,min_us,max_us,slowest_rank,nvlink_bytes,network_bytes,logical_bytes,\
             nvlink_gbps,logical_gbps,vs_nccl,vs_nccl_peers,vs_ceiling,vs_nccl_ep,vs_local,check,\
             per_rank_median_us,ranks"
        );
        let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert_eq!(rows.len(), 10);
        let col = |row: &csv::StringRecord, name: &str| {
            row[header.iter().position(|h| h == name).unwrap()].to_string()
        };
        assert_eq!(col(&rows[0], "gpu_name"), "GPU, \"quoted\"");
        let d = &rows[1];
        assert_eq!(col(d, "op"), "dispatch");
        assert_eq!(col(d, "baseline"), "false");
        let num = |name: &str| col(d, name).parse::<f64>().unwrap();
        assert_eq!(
            (num("median_us"), num("min_us"), num("max_us")),
            (100.0, 90.0, 120.0)
        );
        assert_eq!((num("slowest_rank"), num("nvlink_bytes")), (1.0, 2e6));
        assert_eq!(
            (num("nvlink_gbps"), num("vs_nccl"), num("vs_ceiling")),
            (20.0, 2.0, 0.5)
        );
        assert_eq!(col(d, "vs_nccl_peers"), "");
        assert_eq!(col(d, "check"), "ok");
        assert_eq!(col(d, "per_rank_median_us"), "80;100");
        assert_eq!(col(d, "ranks"), "nccl");
        assert_eq!(col(&rows[6], "check"), "");
    }

    #[test]
    fn json_shape() {
        let mut results = vec![sample(1024, 7168, Some(true)), sample(2048, 7168, None)];
        results[0].gpu_name = "H200 \"SXM\"\\\n\t\u{1}".to_string();
        results[1].ops[0].per_rank[0].median_us = f64::NAN;
        let text = json(&results);
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["tool"], "ep-bench");
        let res = doc["results"].as_array().unwrap();
        assert_eq!(res.len(), 2);
        assert_eq!(res[0]["gpu_name"], "H200 \"SXM\"\\\n\t\u{1}");
        assert_eq!(res[0]["check"], true);
        assert!(res[1]["check"].is_null());
        assert_eq!(
            (res[0]["world"].as_u64(), res[0]["ranks"].as_str()),
            (Some(2), Some("nccl"))
        );
        let case = &res[0]["case"];
        for k in [
            "tokens", "hidden", "topk", "experts", "layout", "num_sms", "mode", "dtype", "routing",
        ] {
            assert!(!case[k].is_null(), "case.{k}");
        }
        assert_eq!(case["layout"], "rank");
        let ops = res[0]["ops"].as_array().unwrap();
        assert_eq!(ops.len(), 5);
        let d = &ops[1];
        assert_eq!(d["op"], "dispatch");
        assert_eq!(d["baseline"], false);
        assert_eq!(d["median_us"], 100.0);
        assert_eq!(d["slowest_rank"], 1);
        assert_eq!(d["nvlink_gbps"], 20.0);
        assert_eq!(d["vs_nccl"], 2.0);
        assert_eq!(d["vs_ceiling"], 0.5);
        assert!(d["vs_nccl_peers"].is_null());
        let per_rank = d["per_rank"].as_array().unwrap();
        assert_eq!(per_rank.len(), 2);
        assert_eq!(per_rank[0]["median_us"], 80.0);
        assert_eq!(per_rank[1]["nvlink_bytes"], 2_000_000);
        assert_eq!(ops[3]["baseline"], true);
        assert!(ops[3]["vs_nccl"].is_null());
        // NaN became null.
        assert!(res[1]["ops"][0]["per_rank"][0]["median_us"].is_null());
        // Empty inputs are valid too.
        assert!(serde_json::from_str::<serde_json::Value>(&json(&[])).is_ok());
    }

    #[test]
    fn nccl_ep_rows_and_ratios() {
        let mut r = sample(1024, 7168, Some(true));
        // NCCL EP: dispatch 150 µs (ours 100: 1.50x), layout 3 µs (ours 6: 0.50x).
        r.ops.push(op(
            NCCL_EP_DISPATCH,
            &[150.0, 140.0],
            &[3_000_000, 2_000_000],
        ));
        r.ops.push(op(NCCL_EP_LAYOUT, &[3.0, 2.0], &[0, 0]));
        r.nccl_ep_check = Some(false);
        let d = r.op("dispatch").unwrap();
        assert!((r.vs_nccl_ep(d).unwrap() - 1.5).abs() < 1e-9);
        assert!((r.vs_nccl_ep(r.op("layout").unwrap()).unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(r.vs_nccl_ep(r.op("combine").unwrap()), None);
        assert_eq!(r.vs_nccl_ep(r.op(NCCL_EP_DISPATCH).unwrap()), None);
        let t = table(std::slice::from_ref(&r));
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[1].ends_with("vs NCCL-EP  check"), "{}", lines[1]);
        let row = |name: &str| {
            *lines
                .iter()
                .find(|l| l.split_whitespace().next() == Some(name))
                .unwrap()
        };
        assert!(row("dispatch").ends_with("1.50x  ok"), "{t}");
        assert!(row(NCCL_EP_DISPATCH).ends_with("FAILED"), "{t}");
        let doc: serde_json::Value = serde_json::from_str(&json(&[r.clone()])).unwrap();
        assert_eq!(doc["results"][0]["nccl_ep_check"], false);
        assert_eq!(doc["results"][0]["ops"][1]["vs_nccl_ep"], 1.5);
        let text = csv(&[r]);
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let h: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        let at = |n: &str| h.iter().position(|x| x == n).unwrap();
        let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert_eq!(&rows[1][at("vs_nccl_ep")], "1.5");
        assert_eq!(&rows[5][at("check")], "failed");
        // Without NCCL EP rows the table has no such column.
        assert!(!table(&[sample(1024, 7168, None)]).contains("NCCL-EP"));
    }

    #[test]
    fn local_copy_rows_and_ratios() {
        assert_eq!(local_copy_row(Op::Layout), None);
        for (op, row) in [
            (Op::Dispatch, LOCAL_COPY_DISPATCH),
            (Op::CombineBwd, LOCAL_COPY_DISPATCH),
            (Op::Combine, LOCAL_COPY_COMBINE),
            (Op::CombinePush, LOCAL_COPY_COMBINE),
            (Op::DispatchBwd, LOCAL_COPY_COMBINE),
        ] {
            assert_eq!(local_copy_row(op), Some(row), "{op:?}");
        }
        // Expert-major on virtual ranks: dispatch 100 µs (slowest rank) against
        // a 40 µs copy (0.40x), combine 95 against 190 (2.00x); the ceilings
        // cross no NVLink (0 B) but carry the op's logical bytes.
        let mut r = virtual_sample(1024);
        r.case.layout = RecvLayout::ExpertMajor { alignment: 128 };
        let mut local = |name: &str, medians: &[f64]| {
            let mut o = op(name, medians, &[0, 0]);
            o.logical_bytes = vec![3_000_000, 3_000_000];
            r.ops.push(o);
        };
        local(LOCAL_COPY_DISPATCH, &[30.0, 40.0]);
        local(LOCAL_COPY_COMBINE, &[190.0, 180.0]);
        let d = r.op("dispatch").unwrap();
        assert!((r.vs_local(d).unwrap() - 0.4).abs() < 1e-9);
        assert!((r.vs_local(r.op("combine").unwrap()).unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(r.vs_local(r.op("layout").unwrap()), None);
        assert_eq!(r.vs_local(r.op(LOCAL_COPY_DISPATCH).unwrap()), None);
        // No NVLink ratio of a ceiling that crosses no NVLink, nor against it.
        assert_eq!(r.ratio(d, LOCAL_COPY_DISPATCH), None);
        assert!(r.has_local_copy() && !sample(1024, 7168, None).has_local_copy());
        let t = table(std::slice::from_ref(&r));
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[2].ends_with("logical GB/s  vs local  check"),
            "{}",
            lines[2]
        );
        let row = |name: &str| {
            *lines
                .iter()
                .find(|l| l.split_whitespace().next() == Some(name))
                .unwrap()
        };
        assert!(row("dispatch").ends_with("0.40x  ok"), "{t}");
        assert!(row("combine").ends_with("2.00x  ok"), "{t}");
        assert!(row("layout").ends_with("-  ok"), "{t}");
        // The ceiling's own row: no NVLink GB/s, logical 3e6 B / 40 µs = 75 GB/s.
        let ld: Vec<&str> = row(LOCAL_COPY_DISPATCH).split_whitespace().collect();
        assert_eq!(ld[1..], ["40.00", "36.00", "48.00", "75.0", "-", "ok"]);
        let doc: serde_json::Value = serde_json::from_str(&json(&[r.clone()])).unwrap();
        let ops = doc["results"][0]["ops"].as_array().unwrap();
        assert_eq!(ops[1]["vs_local"], 0.4);
        assert_eq!(ops[2]["vs_local"], 2.0);
        assert!(ops[0]["vs_local"].is_null() && ops[3]["vs_local"].is_null());
        assert_eq!(ops[3]["op"], LOCAL_COPY_DISPATCH);
        assert_eq!(ops[3]["baseline"], true);
        let text = csv(&[r]);
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let h: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        let at = |n: &str| h.iter().position(|x| x == n).unwrap();
        let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert_eq!(rows.len(), 5);
        assert_eq!(&rows[1][at("vs_local")], "0.4");
        assert_eq!(rows[2][at("vs_local")].parse::<f64>().unwrap(), 2.0);
        assert_eq!(&rows[4][at("vs_local")], "");
        assert_eq!(&rows[4][at("op")], LOCAL_COPY_COMBINE);
        // Beside the NVLink ratios of real ranks: the column after vs ceiling.
        let mut n = sample(1024, 7168, None);
        n.ops.push(op(LOCAL_COPY_DISPATCH, &[50.0, 50.0], &[0, 0]));
        let t = table(&[n]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[1].ends_with("vs ceiling  vs local"), "{}", lines[1]);
        let cells: Vec<&str> = row_of(&lines, "dispatch").split_whitespace().collect();
        assert_eq!(cells[cells.len() - 2..], ["0.50x", "0.50x"], "{t}");
        // Without local-copy rows the table has no such column.
        assert!(!table(&[sample(1024, 7168, None)]).contains("vs local"));
    }

    /// `--mode ll` at world 1, both layouts: our four ops beside NCCL EP's
    /// four rows; the layouts named `expert` / `rank`; every op of ours gets
    /// its `vs NCCL-EP` (ll-pair against NCCL EP's pair), the fp8 ops no
    /// `vs local`.
    #[test]
    fn low_latency_rows() {
        for (op, ep, local) in [
            (
                Op::LlDispatch,
                NCCL_EP_LL_DISPATCH,
                Some(LOCAL_COPY_DISPATCH),
            ),
            (Op::LlDispatchFp8, NCCL_EP_LL_DISPATCH_FP8, None),
            (Op::LlCombine, NCCL_EP_LL_COMBINE, Some(LOCAL_COPY_COMBINE)),
            (Op::LlPair, NCCL_EP_LL_PAIR, None),
        ] {
            assert_eq!((nccl_ep_row(op), local_copy_row(op)), (ep, local), "{op:?}");
        }
        let ll = |layout: RecvLayout| {
            let mut c = case(128, 7168);
            (c.mode, c.layout) = (Mode::LowLatency, layout);
            // World 1: nothing crosses; the logical bytes give the GB/s.
            let one = |name: &str, us: f64| {
                let mut o = op(name, &[us], &[0]);
                o.logical_bytes = vec![14_680_064];
                o
            };
            CaseResult {
                case: c,
                ops: vec![
                    one("ll-dispatch", 20.0),
                    one("ll-dispatch-fp8", 25.0),
                    one("ll-combine", 30.0),
                    one("ll-pair", 50.0),
                    one(LOCAL_COPY_DISPATCH, 10.0),
                    one(LOCAL_COPY_COMBINE, 15.0),
                    one(NCCL_EP_LL_DISPATCH, 40.0),
                    one(NCCL_EP_LL_DISPATCH_FP8, 50.0),
                    one(NCCL_EP_LL_COMBINE, 15.0),
                    one(NCCL_EP_LL_PAIR, 100.0),
                ],
                world: 1,
                ranks: Ranks::Nccl,
                gpu_name: "NVIDIA H200".to_string(),
                check: Some(true),
                nccl_ep_check: Some(true),
                ranks_per_node: 0,
                hop_chunk_rows: 0,
                memory: None,
            }
        };
        let results = [
            ll(RecvLayout::ExpertMajor { alignment: 1 }),
            ll(RecvLayout::RankMajor),
        ];
        for r in &results {
            for name in ["ll-dispatch", "ll-dispatch-fp8", "ll-combine", "ll-pair"] {
                assert!(r.op(name).unwrap().is_ours(), "{name}");
            }
            assert!(!r.op(NCCL_EP_LL_PAIR).unwrap().is_ours());
            let vs = |name: &str| r.vs_nccl_ep(r.op(name).unwrap()).unwrap();
            assert_eq!(
                ["ll-dispatch", "ll-dispatch-fp8", "ll-combine", "ll-pair"].map(vs),
                [2.0, 2.0, 0.5, 2.0]
            );
            assert_eq!(r.vs_local(r.op("ll-dispatch-fp8").unwrap()), None);
        }
        let t = table(&results);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("mode ll"), "{t}");
        assert!(
            lines[1].starts_with("layout  op") && lines[1].ends_with("vs NCCL-EP  vs local  check"),
            "{t}"
        );
        let rows: Vec<Vec<&str>> = lines[3..]
            .iter()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows.len(), 20, "{t}");
        assert_eq!(rows[0][..2], ["expert", "ll-dispatch"], "{t}");
        assert_eq!(rows[10][..2], ["rank", "ll-dispatch"], "{t}");
        // ll-dispatch: 14.68e6 B / 20 µs = 734.0 logical GB/s, no NVLink GB/s,
        // 40 / 20 = 2.00x NCCL EP, 10 / 20 = 0.50x the local copy.
        assert_eq!(
            rows[0][2..],
            ["20.00", "18.00", "24.00", "-", "734.0", "-", "-", "-", "2.00x", "0.50x", "ok"],
            "{t}"
        );
        assert_eq!(rows[3][1], "ll-pair");
        assert_eq!(rows[3][rows[3].len() - 3..], ["2.00x", "-", "ok"], "{t}");
        let doc: serde_json::Value = serde_json::from_str(&json(&results)).unwrap();
        let r0 = &doc["results"][0];
        assert_eq!(
            (r0["case"]["mode"].as_str(), r0["case"]["layout"].as_str()),
            (Some("ll"), Some("expert"))
        );
        assert_eq!(doc["results"][1]["case"]["layout"], "rank");
        assert_eq!(r0["ops"][2]["vs_nccl_ep"], 0.5);
        assert_eq!(r0["ops"][9]["op"], NCCL_EP_LL_PAIR);
        let text = csv(&results);
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let h: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        let at = |n: &str| h.iter().position(|x| x == n).unwrap();
        let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert_eq!(rows.len(), 20);
        assert_eq!(
            (&rows[13][at("op")], &rows[13][at("layout")]),
            ("ll-pair", "rank")
        );
        assert_eq!(rows[13][at("vs_nccl_ep")].parse::<f64>().unwrap(), 2.0);
    }

    /// A case's memory: moe-ep's row and NCCL EP's under the op table (the
    /// varying case columns first), and the same figures in JSON.
    #[test]
    fn memory_beside_nccl_ep() {
        use crate::memory::{MoeEpMemory, NcclEpMemory};
        const MIB: u64 = 1 << 20;
        let mut a = sample(1024, 7168, Some(true));
        let ours = MoeEpMemory {
            workspace: 100 * MIB,
            low_latency: 0,
            pool_other: 2 * MIB,
            pool_free: MIB,
            two_level: 0,
            pinned_host: 96,
            handle: Some(MIB / 2),
            pool_in_use: Some(3 * MIB),
        };
        let theirs = NcclEpMemory {
            group_measured: 300 * MIB,
            handle_queried: Some(MIB / 4),
            init_handle_measured: 2 * MIB,
        };
        a.memory = Some(Memory {
            moe_ep: ours,
            nccl_ep: Some(theirs),
        });
        // Another token count: no NCCL EP, no handle query, no handle.
        let mut b = sample(2048, 7168, Some(true));
        b.memory = Some(Memory {
            moe_ep: MoeEpMemory {
                handle: None,
                pool_in_use: None,
                ..ours
            },
            nccl_ep: None,
        });
        let t = table(&[a.clone(), b]);
        let lines: Vec<&str> = t.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.starts_with("memory per rank"))
            .unwrap_or_else(|| panic!("{t}"));
        assert!(
            lines[at + 1]
                .split_whitespace()
                .take(4)
                .eq(["tokens", "library", "group", "MiB"]),
            "{t}"
        );
        let cells = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
        let r0 = cells(lines[at + 3]);
        assert_eq!(
            r0[..5],
            ["1024", "moe-ep", "102.00", "0.50", "102.50"],
            "{t}"
        );
        assert!(lines[at + 3].contains("workspace 100.00, low-latency 0.00, pool 2.00 (free 1.00)"));
        assert!(lines[at + 3].contains("pinned host 96 B"), "{t}");
        // Sized to the case: workspace 100 + pool in use 3 (+ handle 0.5).
        let sized = cells(lines[at + 4]);
        assert_eq!(
            sized[..6],
            ["1024", "moe-ep", "sized", "103.00", "0.50", "103.50"],
            "{t}"
        );
        assert!(lines[at + 4].contains("pool in use 3.00"), "{t}");
        let r1 = cells(lines[at + 5]);
        assert_eq!(
            r1[..5],
            ["1024", "NCCL-EP", "300.00", "0.25", "302.00"],
            "{t}"
        );
        assert!(lines[at + 5].contains("cuMemGetInfo around ncclEpCreateGroup"));
        assert!(lines[at + 5].contains("ncclEpHandleMemSize"));
        let r2 = cells(lines[at + 6]);
        assert_eq!(r2[..5], ["2048", "moe-ep", "102.00", "-", "102.00"], "{t}");
        assert!(lines[at + 6].ends_with("no handle"), "{t}");
        assert_eq!(lines.len(), at + 7, "{t}");
        // Without memory, no block.
        assert!(!table(&[sample(1024, 7168, None)]).contains("memory per rank"));

        let doc: serde_json::Value = serde_json::from_str(&json(&[a])).unwrap();
        let m = &doc["results"][0]["memory"];
        assert_eq!(m["moe_ep"]["workspace"], 100 * MIB);
        assert_eq!(m["moe_ep"]["handle"], MIB / 2);
        assert_eq!(m["moe_ep"]["group"], 102 * MIB);
        assert_eq!(m["moe_ep"]["device"], 102 * MIB + MIB / 2);
        assert_eq!(m["moe_ep"]["pinned_host"], 96);
        assert_eq!(m["moe_ep"]["pool_in_use"], 3 * MIB);
        assert_eq!(m["moe_ep"]["sized_to_case"], 103 * MIB + MIB / 2);
        assert_eq!(m["nccl_ep"]["group_measured"], 300 * MIB);
        assert_eq!(m["nccl_ep"]["handle_queried"], MIB / 4);
        assert_eq!(m["nccl_ep"]["device"], 302 * MIB);
        assert!(m["nccl_ep"]["group_how"]
            .as_str()
            .unwrap()
            .contains("cuMemGetInfo"));
        let none: serde_json::Value =
            serde_json::from_str(&json(&[sample(1024, 7168, None)])).unwrap();
        assert!(none["results"][0]["memory"].is_null());
    }

    /// The table line of op `name`.
    fn row_of<'a>(lines: &[&'a str], name: &str) -> &'a str {
        lines
            .iter()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap()
    }
}
