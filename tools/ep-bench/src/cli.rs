//! Command-line options of `ep-bench` (clap derive), the checks that need no
//! GPU, and the case list.
//!
//! Every check that can be made before any GPU work happens here and fails
//! with one line naming the option (`main` prints it as
//! `ep-bench: error: ...` and exits 2). The checks that need the world size
//! (known once the launcher, the device count or `--virtual-ranks` decided
//! it) are in [`Opts::validate_for_world`].
//!
//! Options marked LIST take a comma-separated list (repeats dropped, order
//! kept); the cartesian product of all lists is the case list
//! ([`Opts::cases`]). An option given twice keeps its last value.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use clap::error::ErrorKind;
use clap::{ArgAction, Parser, ValueEnum};
use moe_ep::ops::LlLayout;
use moe_ep::testkit::workload;
use moe_ep::{Mode, RecvLayout};

/// Largest accepted `--tokens` value (tokens per rank).
pub const MAX_TOKENS: usize = 65536;
/// Largest `--tokens` value of `--mode ll` (a low-latency group's most tokens per rank).
pub const LL_MAX_TOKENS: usize = moe_ep::ops::LL_MAX_TOKENS;
/// Tokens per rank when `--tokens` is not given (`--mode ht`).
pub const DEFAULT_TOKENS: usize = 4096;
/// Tokens per rank when `--tokens` is not given with `--mode ll` (decode).
pub const LL_DEFAULT_TOKENS: usize = 128;
/// Values per f32 fp8 scale: the hidden size of `dispatch-fp8`,
/// `ll-dispatch-fp8` and `ll-pair` is a multiple of it.
pub const FP8_BLOCK: usize = 128;
/// Largest accepted `--topk` value (experts per token).
pub const MAX_TOPK: usize = 16;
/// Largest accepted `--num-sms` value (streaming multiprocessors per kernel).
pub const MAX_NUM_SMS: usize = 132;
/// SMs per kernel when `--num-sms` is not given (`GroupConfig`'s default).
pub const DEFAULT_NUM_SMS: usize = 24;
/// Most `--virtual-ranks` (the library's largest world).
pub const MAX_VIRTUAL_RANKS: usize = 8;
/// Row alignment (tokens) of `--layout expert` without an explicit `:ALIGN`.
pub const DEFAULT_EXPERT_ALIGNMENT: usize = 128;
/// Untimed iterations per op when `--warmup` is not given.
pub const DEFAULT_WARMUP: usize = 5;
/// Timed iterations per op when `--iters` is not given.
pub const DEFAULT_ITERS: usize = 20;
/// Timed iterations per op under `--profile` when `--iters` is not given.
pub const PROFILE_DEFAULT_ITERS: usize = 3;

/// The `--help` text above the options.
const ABOUT: &str = "Time the moe-ep expert-parallel dispatch/combine kernels against \
NCCL all-to-all, NCCL EP, the NVLink ceilings and the local-copy ceilings.\n\nOptions marked LIST take a comma list \
(e.g. --tokens 512,1024,4096); the cartesian product of all lists is benchmarked, \
tokens varying fastest.";

/// The `--help` text below the options: launchers and exit status.
const AFTER_HELP: &str = "\
Launchers: without one, ep-bench re-executes itself once per GPU (rank r on
device r). Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT),
Open MPI (OMPI_COMM_WORLD_*) or Slurm (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID,
with MASTER_ADDR/MASTER_PORT exported) each process is one rank and the NCCL id
is shared over TCP; MOE_EP_BENCH_RDZV_ADDR/MOE_EP_BENCH_RDZV_PORT override the
address and port of that rendezvous. --virtual-ranks runs every rank in this
process on GPU 0 instead (no launcher, no --gpus).

NCCL EP: when libnccl_ep.so.0 loads (library path, or MOE_EP_NCCL_EP_LIBRARY),
its HT flat / expert-major ops (--mode ll: its LL ops) run beside ours on the
same routing and SMs (rows nccl-ep-*, column vs NCCL-EP; --check cross-checks its outputs). It
needs NCCL >= 2.30.4 as moe-ep's own NCCL (MOE_EP_NCCL_LIBRARY), and
NCCL_EP_HOME / NCCL_HOME for its kernel compiler; absent, one line says so.

Low-latency mode (--mode ll, decode): a group of Mode::LowLatency with the
case's tokens as its max tokens per rank (at most 1024; default 128); ops
ll-dispatch (bf16 rows), ll-dispatch-fp8 (cast to e4m3 in the kernel, exact
per-128 scales), ll-combine (bf16 expert outputs home) and ll-pair (the fp8
dispatch and its combine timed together); --layout rank = rank-major,
expert[:A] = expert-major. NCCL EP's LL mode runs beside them (rows
nccl-ep-ll-*); --check compares with the CPU reference bit for bit.

fp8 dispatch (--ops dispatch-fp8, --mode ht, one node): EpGroup::dispatch_fp8
moving e4m3 codes [T, H] and their scales as given, --fp8-scales f32 (one f32
per 128 values, [T, H/128], the default: DeepEP's recipe, and what NCCL EP
generates in its own fp8 cast) or e8m0 (MXFP8, one byte per 32 values,
[T, H/32]); hidden a multiple of 128. Logical and NVLink GB/s count codes,
scales and the top-k f32 weights of every row. Beside it nccl-ep-dispatch-fp8:
NCCL EP's HT dispatch with its QUANT_FWD recipe forwarding the same codes and
scales (its rows 16-byte aligned: hidden a multiple of 512).

Local-copy ceilings (every layout, world 1 and virtual ranks included, same
SMs): local-copy-dispatch reads each of this rank's token rows once and
writes them into as many rows as the rank receives (expert-major: padding
rows included); local-copy-combine reads those rows and writes each token row
once (16-byte xor of its share of them). Column vs local: the ceiling's median
time over the op's (dispatch, combine-bwd: the first; combine, combine-push,
dispatch-bwd: the second); above 1.00x the op beats the copy.

Exit status: 0 ok, 1 runtime failure (or a failed --check), 2 usage error.";

/// Payload element type (`--dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16, 2 bytes per element.
    Bf16,
}

impl Dtype {
    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
        }
    }

    /// Size of one element in bytes.
    pub fn elem_bytes(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
        }
    }
}

/// How tokens pick their experts (`--routing`).
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// One of the testkit's seeded generators.
    Generated(workload::Routing),
    /// `file:PATH`: the routing read from a file (checked to exist at parse time).
    File(PathBuf),
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Routing::Generated(workload::Routing::Uniform) => f.write_str("uniform"),
            Routing::Generated(workload::Routing::Skewed { hot_share }) => {
                write!(f, "skewed:{hot_share}")
            }
            Routing::Generated(workload::Routing::Masked { masked_share }) => {
                write!(f, "masked:{masked_share}")
            }
            Routing::File(p) => write!(f, "file:{}", p.display()),
        }
    }
}

/// One of our timed operations (`--ops`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Computing the dispatch layout (per-rank / per-expert counts).
    Layout,
    /// Sending token rows to the ranks that own their experts.
    Dispatch,
    /// Dispatch of fp8 rows: e4m3 codes and their block scales, forwarded
    /// as given (`--fp8-scales`).
    DispatchFp8,
    /// Sending (weighted) expert outputs back and reducing them per token
    /// (expert outputs in symmetric memory: rank-major homes read them in
    /// place).
    Combine,
    /// Combine with expert outputs in plain device memory: pushed to their
    /// homes through the group's stage.
    CombinePush,
    /// Backward of dispatch (moves data like combine).
    DispatchBwd,
    /// Backward of combine (moves data like dispatch).
    CombineBwd,
    /// Low-latency dispatch of bf16 rows (`--mode ll`).
    LlDispatch,
    /// Low-latency dispatch, rows cast to fp8 e4m3 by the sender's kernel
    /// (exact per-128 scales).
    LlDispatchFp8,
    /// Low-latency combine (bf16 expert outputs home, summed per token).
    LlCombine,
    /// A decode step's communication: fp8 dispatch then combine, timed together.
    LlPair,
}

impl Op {
    /// The low-latency ops (`--mode ll`), in their canonical order.
    pub const LL: [Op; 4] = [Op::LlDispatch, Op::LlDispatchFp8, Op::LlCombine, Op::LlPair];

    /// All ops, in their canonical order.
    pub const ALL: [Op; 11] = [
        Op::Layout,
        Op::Dispatch,
        Op::DispatchFp8,
        Op::Combine,
        Op::DispatchBwd,
        Op::CombineBwd,
        Op::CombinePush,
        Op::LlDispatch,
        Op::LlDispatchFp8,
        Op::LlCombine,
        Op::LlPair,
    ];

    /// The command-line and report name (`dispatch-bwd`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Op::Layout => "layout",
            Op::Dispatch => "dispatch",
            Op::DispatchFp8 => "dispatch-fp8",
            Op::Combine => "combine",
            Op::DispatchBwd => "dispatch-bwd",
            Op::CombineBwd => "combine-bwd",
            Op::CombinePush => "combine-push",
            Op::LlDispatch => "ll-dispatch",
            Op::LlDispatchFp8 => "ll-dispatch-fp8",
            Op::LlCombine => "ll-combine",
            Op::LlPair => "ll-pair",
        }
    }

    /// Whether the op belongs to `--mode ll`.
    pub fn is_ll(self) -> bool {
        Op::LL.contains(&self)
    }

    /// Whether the op sends fp8 rows (its hidden size a multiple of [`FP8_BLOCK`]).
    pub fn is_fp8(self) -> bool {
        matches!(self, Op::DispatchFp8 | Op::LlDispatchFp8 | Op::LlPair)
    }

    /// Inverse of [`Op::name`]; `None` for baselines and unknown names.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// `--start`: how the ranks start each timed run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Start {
    /// Every rank's run is enqueued behind a gate; the GPUs then leave a
    /// one-word NCCL all-reduce together (virtual ranks: the host barrier
    /// lines them up, then each opens its own gate).
    Gpu,
    /// The timer starts after a host barrier.
    Host,
}

/// `--fp8-scales`: the block scales that `dispatch-fp8` forwards beside
/// its e4m3 codes (`moe_ep::Fp8Scales`). Either kind is `H / 32` bytes a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScaleKind {
    /// One f32 per 128 values, `[T, H / 128]` (DeepEP's recipe).
    F32,
    /// MXFP8: one e8m0 exponent byte per 32 values, `[T, H / 32]`.
    E8m0,
}

impl ScaleKind {
    /// The command-line spelling (`f32`, `e8m0`).
    pub fn name(self) -> &'static str {
        match self {
            ScaleKind::F32 => "f32",
            ScaleKind::E8m0 => "e8m0",
        }
    }

    /// In words: `f32 per 128 values`, `e8m0 per 32 values`.
    pub fn describe(self) -> &'static str {
        match self {
            ScaleKind::F32 => "f32 per 128 values",
            ScaleKind::E8m0 => "e8m0 per 32 values",
        }
    }

    /// Values that share one scale.
    pub fn block(self) -> usize {
        match self {
            ScaleKind::F32 => FP8_BLOCK,
            ScaleKind::E8m0 => 32,
        }
    }

    /// Bytes of one scale.
    pub fn scale_bytes(self) -> usize {
        match self {
            ScaleKind::F32 => 4,
            ScaleKind::E8m0 => 1,
        }
    }

    /// Scales of one row of `hidden` values.
    pub fn per_row(self, hidden: usize) -> usize {
        hidden / self.block()
    }

    /// Bytes of one row's scales (`hidden / 32` for either kind).
    pub fn row_bytes(self, hidden: usize) -> usize {
        self.per_row(hidden) * self.scale_bytes()
    }
}

/// `rank` or `expert:ALIGN`, the `--layout` spelling of a receive layout.
pub fn layout_name(l: RecvLayout) -> String {
    match l {
        RecvLayout::RankMajor => "rank".to_string(),
        RecvLayout::ExpertMajor { alignment } => format!("expert:{alignment}"),
    }
}

/// The low-latency layout that `--layout` names under `--mode ll`: `rank`
/// is [`LlLayout::RankMajor`], `expert` and `expert:ALIGN` are
/// [`LlLayout::ExpertMajor`] (it has no alignment: every expert's block
/// holds `world * tokens` rows).
pub fn ll_layout(l: RecvLayout) -> LlLayout {
    match l {
        RecvLayout::RankMajor => LlLayout::RankMajor,
        RecvLayout::ExpertMajor { .. } => LlLayout::ExpertMajor,
    }
}

/// `rank` or `expert`, the `--layout` spelling of a low-latency layout.
pub fn ll_layout_name(l: LlLayout) -> &'static str {
    match l {
        LlLayout::RankMajor => "rank",
        LlLayout::ExpertMajor => "expert",
    }
}

/// `ht` or `ll`, the `--mode` spelling of a kernel family.
pub fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::HighThroughput => "ht",
        Mode::LowLatency => "ll",
    }
}

/// One benchmark configuration: a point of the sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// Tokens per rank (0..=65536).
    pub tokens: usize,
    /// Hidden size in elements (multiple of 8).
    pub hidden: usize,
    /// Experts per token (1..=16).
    pub topk: usize,
    /// Total experts over all ranks.
    pub experts: usize,
    /// Receive-buffer layout.
    pub layout: RecvLayout,
    /// SMs given to our kernels (1..=132).
    pub num_sms: usize,
    /// Kernel family (not swept).
    pub mode: Mode,
    /// Payload type (not swept).
    pub dtype: Dtype,
    /// The scales `dispatch-fp8` forwards (not swept).
    pub fp8_scales: ScaleKind,
    /// Routing distribution (not swept).
    pub routing: Routing,
}

impl Case {
    /// `tokens=4096 hidden=7168 topk=8 experts=256 layout=rank sms=24`.
    pub fn label(&self) -> String {
        format!(
            "tokens={} hidden={} topk={} experts={} layout={} sms={}",
            self.tokens,
            self.hidden,
            self.topk,
            self.experts,
            self.layout_label(),
            self.num_sms
        )
    }

    /// The layout as `--layout` spells it: `rank`, `expert:128`; under
    /// `--mode ll` `rank` or `expert` ([`ll_layout_name`]).
    pub fn layout_label(&self) -> String {
        match self.mode {
            Mode::HighThroughput => layout_name(self.layout),
            Mode::LowLatency => ll_layout_name(ll_layout(self.layout)).to_string(),
        }
    }
}

/// All options. Parse with [`parse`], which also runs [`Opts::validate`].
#[derive(Parser, Clone, Debug)]
#[command(
    name = "ep-bench",
    version,
    about = ABOUT,
    after_help = AFTER_HELP,
    args_override_self = true,
    allow_negative_numbers = true
)]
pub struct Opts {
    /// Spawn N local ranks, one process per GPU [default: all visible GPUs]
    #[arg(long, value_name = "N", value_parser = in_range(1, usize::MAX))]
    pub gpus: Option<usize>,
    /// Run N ranks (1..=8) as N threads of this process, all on GPU 0: for
    /// --check and for timing the protocol without NVLink. No NVLink is
    /// crossed and the NVLink baselines are left out (the local-copy ceilings
    /// are kept); --num-sms defaults to
    /// min(24, what fits N ranks on one GPU)
    #[arg(long, value_name = "N", value_parser = in_range(1, MAX_VIRTUAL_RANKS), conflicts_with = "gpus")]
    pub virtual_ranks: Option<usize>,
    /// Tokens per rank, 0..=65536 (--mode ll: 0..=1024) [default: 4096; --mode ll: 128]
    #[arg(long, value_name = "LIST", value_delimiter = ',', action = ArgAction::Set, value_parser = in_range(0, MAX_TOKENS))]
    pub tokens: Vec<usize>,
    /// Hidden size, a positive multiple of 8
    #[arg(long, value_name = "LIST", value_delimiter = ',', action = ArgAction::Set, default_value = "7168", value_parser = parse_hidden)]
    pub hidden: Vec<usize>,
    /// Experts per token, 1..=16 and <= experts
    #[arg(long, value_name = "LIST", value_delimiter = ',', action = ArgAction::Set, default_value = "8", value_parser = in_range(1, MAX_TOPK))]
    pub topk: Vec<usize>,
    /// Total experts, divisible by the world size
    #[arg(long, value_name = "LIST", value_delimiter = ',', action = ArgAction::Set, default_value = "256", value_parser = in_range(1, usize::MAX))]
    pub experts: Vec<usize>,
    /// High-throughput kernels (ht: training, prefill) or the low-latency ones
    /// (ll: decode; ops ll-dispatch, ll-dispatch-fp8, ll-combine, ll-pair)
    #[arg(long, value_name = "ht|ll", default_value = "ht", value_parser = parse_mode)]
    pub mode: Mode,
    /// Receive-buffer layout: rank | expert | expert:ALIGN (expert = expert:128;
    /// --mode ll: rank = rank-major, expert and expert:ALIGN = expert-major)
    #[arg(long = "layout", value_name = "LIST", value_delimiter = ',', action = ArgAction::Set, default_value = "rank", value_parser = parse_layout)]
    pub layouts: Vec<RecvLayout>,
    /// Payload type (only bf16 for now)
    #[arg(long, value_name = "bf16", default_value = "bf16", value_parser = parse_dtype)]
    pub dtype: Dtype,
    /// uniform | skewed:SHARE | masked:SHARE | file:PATH, SHARE in [0, 1]
    #[arg(long, value_name = "R", default_value = "uniform", value_parser = parse_routing)]
    pub routing: Routing,
    /// SMs given to our kernels, 1..=132 [default: 24]
    #[arg(long, value_name = "LIST", value_delimiter = ',', action = ArgAction::Set, value_parser = in_range(1, MAX_NUM_SMS))]
    pub num_sms: Vec<usize>,
    /// Untimed iterations per op [default: 5; 0 under --profile]
    #[arg(long, value_name = "N", value_parser = in_range(0, usize::MAX))]
    pub warmup: Option<usize>,
    /// Timed iterations per op, >= 1 [default: 20; 3 under --profile]
    #[arg(long, value_name = "N", value_parser = in_range(1, usize::MAX))]
    pub iters: Option<usize>,
    /// layout,dispatch,dispatch-fp8,combine,dispatch-bwd,combine-bwd,combine-push [default:
    /// layout,dispatch,combine]; --mode ll: ll-dispatch,ll-dispatch-fp8,ll-combine,ll-pair
    /// [default: all four]
    #[arg(long, value_name = "LIST", value_delimiter = ',', action = ArgAction::Set, value_parser = parse_op)]
    pub ops: Vec<Op>,
    /// The scales dispatch-fp8 forwards beside its e4m3 codes: f32 (one per
    /// 128 values, [T, H/128]) or e8m0 (MXFP8, one byte per 32 values,
    /// [T, H/32]) [default: f32]
    #[arg(long, value_name = "f32|e8m0")]
    pub fp8_scales: Option<ScaleKind>,
    /// Compare with the CPU reference once before timing
    #[arg(long)]
    pub check: bool,
    /// Skip the baselines: NCCL all-to-all, NCCL EP, the NVLink and the
    /// local-copy ceilings
    #[arg(long)]
    pub no_baselines: bool,
    /// Skip NCCL EP only (libnccl_ep.so.0, measured beside ours when it loads)
    #[arg(long)]
    pub no_nccl_ep: bool,
    /// Nsight mode: no warm-up, each op runs exactly --iters times, no L2 flush,
    /// timed from a host barrier
    #[arg(long)]
    pub profile: bool,
    /// How the ranks start each timed run [default: gpu; host under --profile]:
    /// gpu = every rank's work is enqueued behind a gate, then the GPUs leave a
    /// one-word NCCL all-reduce together and the timer starts (virtual ranks:
    /// the host barrier lines the ranks up, then each opens its own gate);
    /// host = the timer starts after a host barrier (host skew and enqueue
    /// time fall inside)
    #[arg(long, value_name = "gpu|host")]
    pub start: Option<Start>,
    /// Routing seed
    #[arg(long, value_name = "N", default_value = "0", value_parser = parse_u64)]
    pub seed: u64,
    /// Write all results (per-rank stats included) as JSON
    #[arg(long, value_name = "FILE", value_parser = parse_out_path)]
    pub json: Option<PathBuf>,
    /// Write one line per (case, op) as CSV
    #[arg(long, value_name = "FILE", value_parser = parse_out_path)]
    pub csv: Option<PathBuf>,
    /// NVLink GB/s against tokens as SVG (needs >= 2 --tokens)
    #[arg(long, value_name = "FILE.svg", value_parser = parse_out_path)]
    pub plot: Option<PathBuf>,
    /// Ranks per node, 1..=8: the two-level path (an EpGroup of several nodes), the world
    /// as world / N nodes of N ranks, tokens for another node crossing the
    /// network to the rail peer there (--mode ht; ops layout, dispatch,
    /// combine, dispatch-bwd, combine-bwd). Adds "net GB/s" (network bytes
    /// each rank sends) and the rail-hop baseline: the dispatch's network
    /// bytes moved by the hop alone (NCCL send / receive; device copies on
    /// virtual ranks), "vs hop"
    #[arg(long, value_name = "N", value_parser = in_range(1, 8))]
    pub ranks_per_node: Option<usize>,
    /// With --ranks-per-node: rows per chunk of dispatch's network hop
    /// (the node's forwarding starts on the first chunk while the next ones
    /// are on the wire; default moe_ep::ops::DEFAULT_HOP_CHUNK_ROWS)
    #[arg(long, value_name = "ROWS", value_parser = in_range(1, 1 << 20))]
    pub hop_chunk_rows: Option<usize>,
    /// No progress bar
    #[arg(long)]
    pub quiet: bool,
}

/// What the command line asks for.
#[derive(Clone, Debug)]
pub enum Command {
    /// Run the benchmark with these options.
    Run(Box<Opts>),
    /// `--help` / `-h` or `--version` / `-V`: print this text and exit 0.
    Help(String),
}

/// Parses the arguments (without the program name) and runs
/// [`Opts::validate`]. Errors are one line naming the option.
pub fn parse<I, T>(args: I) -> Result<Command, String>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let argv = std::iter::once(OsString::from("ep-bench")).chain(args.into_iter().map(Into::into));
    match Opts::try_parse_from(argv) {
        Ok(mut opts) => {
            opts.validate()?;
            Ok(Command::Run(Box::new(opts)))
        }
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            Ok(Command::Help(e.to_string()))
        }
        Err(e) => {
            // clap's first paragraph (the error and its context lines) on one line.
            let text = e.to_string();
            let mut lines: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.is_empty())
                .collect();
            // clap's suggestion of a similar flag, when it has one.
            lines.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| l.starts_with("tip:")),
            );
            let line = lines.join(" ");
            Err(line.strip_prefix("error: ").unwrap_or(&line).to_string())
        }
    }
}

impl Opts {
    /// Cross-option checks, the refusals of what does not exist yet, and
    /// the dropping of repeated list values. `--gpus` or `--virtual-ranks`
    /// given: also [`Opts::validate_for_world`] with that size.
    pub fn validate(&mut self) -> Result<(), String> {
        let ll = self.mode == Mode::LowLatency;
        if self.hop_chunk_rows.is_some() && self.ranks_per_node.is_none() {
            return Err("--hop-chunk-rows: only with --ranks-per-node (the two-level path)".into());
        }
        if self.ranks_per_node.is_some() && ll {
            return Err(
                "--ranks-per-node: the two-level path has no low-latency kernels (--mode ht only)"
                    .into(),
            );
        }
        if self.tokens.is_empty() {
            self.tokens = vec![if ll {
                LL_DEFAULT_TOKENS
            } else {
                DEFAULT_TOKENS
            }];
        }
        if self.ops.is_empty() {
            self.ops = if ll {
                Op::LL.to_vec()
            } else {
                vec![Op::Layout, Op::Dispatch, Op::Combine]
            };
        }
        if let Some(op) = self.ops.iter().find(|op| op.is_ll() != ll) {
            let (mode, these) = if ll {
                ("ll", "ll-dispatch, ll-dispatch-fp8, ll-combine, ll-pair")
            } else {
                (
                    "ht",
                    "layout, dispatch, dispatch-fp8, combine, dispatch-bwd, combine-bwd, \
                     combine-push",
                )
            };
            return Err(format!(
                "--ops: {} is not an op of --mode {mode} (its ops: {these})",
                op.name()
            ));
        }
        if self.ranks_per_node.is_some() && self.ops.contains(&Op::CombinePush) {
            return Err(
                "--ops: combine-push is not an op of --ranks-per-node (the two-level combine \
                 always pushes)"
                    .into(),
            );
        }
        if self.ranks_per_node.is_some() && self.ops.contains(&Op::DispatchFp8) {
            return Err(
                "--ops: dispatch-fp8 is not an op of --ranks-per-node (the two-level path has \
                 no fp8 dispatch: one node only)"
                    .into(),
            );
        }
        if self.fp8_scales.is_some() && !self.ops.contains(&Op::DispatchFp8) {
            return Err(
                "--fp8-scales: only with --ops dispatch-fp8 (the scales it forwards; the \
                 low-latency fp8 ops make their own f32 per 128 values)"
                    .into(),
            );
        }
        if ll {
            if let Some(t) = self.tokens.iter().find(|&&t| t > LL_MAX_TOKENS) {
                return Err(format!(
                    "--tokens: {t} is more than --mode ll takes ({LL_MAX_TOKENS} tokens per rank)"
                ));
            }
            // One expert-major layout: the alignment means nothing here.
            for l in &mut self.layouts {
                if let RecvLayout::ExpertMajor { alignment } = l {
                    *alignment = 1;
                }
            }
        }
        let fp8: Vec<&str> = (self.ops.iter().filter(|op| op.is_fp8()))
            .map(|op| op.name())
            .collect();
        if let Some(h) = self.hidden.iter().find(|&&h| !h.is_multiple_of(FP8_BLOCK)) {
            if !fp8.is_empty() {
                return Err(format!(
                    "--hidden: {h} is not a multiple of {FP8_BLOCK}, which {} need{} (one f32 \
                     scale per {FP8_BLOCK} values, or 16-byte rows of codes and 4-byte rows of \
                     e8m0 scales); leave {} out of --ops",
                    fp8.join(" and "),
                    if fp8.len() == 1 { "s" } else { "" },
                    if fp8.len() == 1 { "it" } else { "them" }
                ));
            }
        }
        dedup(&mut self.tokens);
        dedup(&mut self.hidden);
        dedup(&mut self.topk);
        dedup(&mut self.experts);
        dedup(&mut self.layouts);
        dedup(&mut self.num_sms);
        dedup(&mut self.ops);
        let max_topk = self.topk.iter().copied().max().unwrap_or(0);
        let min_experts = self.experts.iter().copied().min().unwrap_or(0);
        if max_topk > min_experts {
            return Err(format!(
                "--topk: {max_topk} is larger than --experts {min_experts}"
            ));
        }
        if self.profile {
            if self.warmup.is_some_and(|w| w > 0) {
                return Err(
                    "--warmup: --profile runs no warm-up; drop --warmup or set it to 0".into(),
                );
            }
            if self.start == Some(Start::Gpu) {
                return Err(
                    "--start gpu: not with --profile (Nsight Compute runs each profiled \
                            kernel inside its launch call, before the gate could open); \
                            --profile times from a host barrier"
                        .into(),
                );
            }
        }
        if let Some(plot) = &self.plot {
            if self.tokens.len() < 2 {
                return Err(format!(
                    "--plot: '{}' needs at least 2 --tokens values (e.g. --tokens 1024,2048,4096), got {}",
                    plot.display(),
                    self.tokens.len()
                ));
            }
        }
        if let Some(n) = self.gpus.or(self.virtual_ranks) {
            self.validate_for_world(n)?;
        }
        Ok(())
    }

    /// Checks that need the world size: every `--experts` value divisible
    /// by `world`, and `--gpus` (if given) equal to it. One line naming the
    /// option.
    pub fn validate_for_world(&self, world: usize) -> Result<(), String> {
        if world == 0 {
            return Err("--gpus: the world size is 0 (no GPU visible?)".to_string());
        }
        if let Some(n) = self.gpus.filter(|&n| n != world) {
            return Err(format!(
                "--gpus: {n} does not match the world size {world} set by the launcher"
            ));
        }
        if let Some(e) = self.experts.iter().find(|&&e| e % world != 0) {
            return Err(format!(
                "--experts: {e} is not divisible by the world size {world}"
            ));
        }
        if let Some(g) = self.ranks_per_node {
            if !world.is_multiple_of(g) || world / g < 2 {
                return Err(format!(
                    "--ranks-per-node: {g} must divide the world size {world} into at least \
                     2 nodes"
                ));
            }
        }
        Ok(())
    }

    /// Untimed iterations per op (0 under `--profile`).
    pub fn warmup(&self) -> usize {
        if self.profile {
            0
        } else {
            self.warmup.unwrap_or(DEFAULT_WARMUP)
        }
    }

    /// Timed iterations per op.
    pub fn iters(&self) -> usize {
        let default = if self.profile {
            PROFILE_DEFAULT_ITERS
        } else {
            DEFAULT_ITERS
        };
        self.iters.unwrap_or(default)
    }

    /// `--start gpu` in effect (the default, not under `--profile`).
    pub fn gpu_start(&self) -> bool {
        !self.profile && self.start != Some(Start::Host)
    }

    /// Flush L2 between timed iterations (not under `--profile`).
    pub fn flush_l2(&self) -> bool {
        !self.profile
    }

    /// `--fp8-scales`, or its default (f32 per 128 values).
    pub fn fp8_scales(&self) -> ScaleKind {
        self.fp8_scales.unwrap_or(ScaleKind::F32)
    }

    /// `--virtual-ranks` without `--num-sms`: each case takes
    /// min(24, what fits the ranks on one GPU).
    pub fn auto_num_sms(&self) -> bool {
        self.virtual_ranks.is_some() && self.num_sms.is_empty()
    }

    /// The case list: the cartesian product of all LIST options. Order is
    /// stable: hidden (slowest), topk, experts, layout, num-sms, tokens
    /// (fastest), each in the order given on the command line.
    pub fn cases(&self) -> Vec<Case> {
        let sms = if self.num_sms.is_empty() {
            vec![DEFAULT_NUM_SMS]
        } else {
            self.num_sms.clone()
        };
        let mut out = Vec::new();
        for &hidden in &self.hidden {
            for &topk in &self.topk {
                for &experts in &self.experts {
                    for &layout in &self.layouts {
                        for &num_sms in &sms {
                            for &tokens in &self.tokens {
                                out.push(Case {
                                    tokens,
                                    hidden,
                                    topk,
                                    experts,
                                    layout,
                                    num_sms,
                                    mode: self.mode,
                                    dtype: self.dtype,
                                    fp8_scales: self.fp8_scales(),
                                    routing: self.routing.clone(),
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// Drops repeated values, keeping the first occurrence and the order.
fn dedup<T: PartialEq>(v: &mut Vec<T>) {
    let mut seen: Vec<T> = Vec::with_capacity(v.len());
    for x in v.drain(..) {
        if !seen.contains(&x) {
            seen.push(x);
        }
    }
    *v = seen;
}

/// A whole number (digits only).
fn parse_u64(s: &str) -> Result<u64, String> {
    let digits = s.strip_prefix('-').unwrap_or(s);
    if s.is_empty() || digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("'{s}' is not a whole number"));
    }
    if digits.len() != s.len() {
        return Err(format!("'{s}' is negative"));
    }
    s.parse().map_err(|_| format!("'{s}' is too large"))
}

/// A whole number in `lo..=hi` (`hi = usize::MAX`: no upper bound).
fn in_range(
    lo: usize,
    hi: usize,
) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |s| {
        let v = usize::try_from(parse_u64(s)?).map_err(|_| format!("'{s}' is too large"))?;
        match (v < lo, v > hi) {
            (false, false) => Ok(v),
            _ if hi == usize::MAX => Err(format!("{v} must be at least {lo}")),
            _ => Err(format!("{v} is out of range ({lo}..={hi})")),
        }
    }
}

/// `--hidden`: a positive multiple of 8.
fn parse_hidden(s: &str) -> Result<usize, String> {
    let h = in_range(0, usize::MAX)(s)?;
    if h == 0 || h % 8 != 0 {
        return Err(format!("{h} is not a positive multiple of 8"));
    }
    Ok(h)
}

/// `--mode`: `ht` or `ll`.
fn parse_mode(s: &str) -> Result<Mode, String> {
    match s {
        "ht" => Ok(Mode::HighThroughput),
        "ll" => Ok(Mode::LowLatency),
        _ => Err("not one of ht, ll".into()),
    }
}

/// `--layout`: `rank`, `expert` or `expert:ALIGN` (ALIGN >= 1).
fn parse_layout(s: &str) -> Result<RecvLayout, String> {
    let alignment = match s {
        "rank" => return Ok(RecvLayout::RankMajor),
        "expert" => DEFAULT_EXPERT_ALIGNMENT,
        _ => match s.strip_prefix("expert:") {
            Some(a) => in_range(1, usize::MAX)(a).map_err(|e| format!("alignment {e}"))?,
            None => return Err("not one of rank, expert, expert:ALIGN".into()),
        },
    };
    Ok(RecvLayout::ExpertMajor { alignment })
}

/// `--dtype`: `bf16` (or `bfloat16`); fp8 types are not supported yet.
fn parse_dtype(s: &str) -> Result<Dtype, String> {
    let lower = s.to_ascii_lowercase();
    match lower.as_str() {
        "bf16" | "bfloat16" => Ok(Dtype::Bf16),
        _ if ["fp8", "e4m3", "e5m2"].iter().any(|p| lower.starts_with(p)) => {
            Err(format!("{s} is not yet supported (only bf16 for now)"))
        }
        _ => Err("not one of bf16".into()),
    }
}

/// The SHARE of `skewed:SHARE` / `masked:SHARE`, in [0, 1].
fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(_) => Err(format!("share {s} is outside [0, 1]")),
        Err(_) => Err(format!("share '{s}' is not a number in [0, 1]")),
    }
}

/// `--routing`: `uniform`, `skewed:SHARE`, `masked:SHARE` or `file:PATH` (an existing file).
fn parse_routing(s: &str) -> Result<Routing, String> {
    use workload::Routing as W;
    let (kind, value) = s.split_once(':').unwrap_or((s, ""));
    match (kind, value) {
        ("uniform", "") => Ok(Routing::Generated(W::Uniform)),
        ("skewed" | "masked", "") => Err(format!("'{kind}' needs a share, e.g. {kind}:0.5")),
        ("skewed", v) => Ok(Routing::Generated(W::Skewed {
            hot_share: parse_share(v)?,
        })),
        ("masked", v) => Ok(Routing::Generated(W::Masked {
            masked_share: parse_share(v)?,
        })),
        ("file", "") => Err("'file:' needs a path, e.g. file:routing.txt".into()),
        ("file", p) if Path::new(p).is_file() => Ok(Routing::File(p.into())),
        ("file", p) => Err(format!("file '{p}' does not exist")),
        _ => Err("not one of uniform, skewed:SHARE, masked:SHARE, file:PATH".into()),
    }
}

/// One `--ops` name.
fn parse_op(s: &str) -> Result<Op, String> {
    Op::from_name(s).ok_or_else(|| {
        "not one of layout, dispatch, dispatch-fp8, combine, dispatch-bwd, combine-bwd, \
         combine-push (--mode ht), ll-dispatch, ll-dispatch-fp8, ll-combine, ll-pair (--mode ll)"
            .into()
    })
}

/// An output file whose directory exists (checked now, not after the run).
fn parse_out_path(s: &str) -> Result<PathBuf, String> {
    if s.is_empty() {
        return Err("empty file name".into());
    }
    let path = PathBuf::from(s);
    if path.is_dir() {
        return Err(format!("'{s}' is a directory, expected a file"));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!("directory '{}' does not exist", dir.display()));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Opts {
        match parse(args) {
            Ok(Command::Run(o)) => *o,
            other => panic!("expected Run for {args:?}, got {other:?}"),
        }
    }

    /// The error of `args`: one line that names `option`.
    fn err_names(args: &[&str], option: &str) -> String {
        let e = match parse(args) {
            Err(e) => e,
            other => panic!("expected an error for {args:?}, got {other:?}"),
        };
        assert!(e.contains(option), "error {e:?} does not name {option}");
        assert!(!e.contains('\n'), "error {e:?} is not one line");
        e
    }

    #[test]
    fn defaults() {
        let o = run(&[]);
        assert_eq!((o.gpus, o.virtual_ranks), (None, None));
        assert_eq!(o.tokens, vec![4096]);
        assert_eq!(o.hidden, vec![7168]);
        assert_eq!(o.topk, vec![8]);
        assert_eq!(o.experts, vec![256]);
        assert_eq!(o.mode, Mode::HighThroughput);
        assert_eq!(o.layouts, vec![RecvLayout::RankMajor]);
        assert!(o.num_sms.is_empty() && !o.auto_num_sms());
        assert_eq!((o.warmup(), o.iters()), (5, 20));
        assert_eq!(o.ops, vec![Op::Layout, Op::Dispatch, Op::Combine]);
        assert!(o.flush_l2() && o.gpu_start() && !o.no_baselines && !o.no_nccl_ep);
        assert!(!o.check && !o.profile && !o.quiet);
        let cases = o.cases();
        assert_eq!(cases.len(), 1);
        assert_eq!(
            cases[0].label(),
            "tokens=4096 hidden=7168 topk=8 experts=256 layout=rank sms=24"
        );
        assert_eq!(cases[0].routing.to_string(), "uniform");
    }

    #[test]
    fn version_and_suggestions() {
        match parse(["--version"]) {
            Ok(Command::Help(text)) => assert_eq!(
                text.trim(),
                format!("ep-bench {}", env!("CARGO_PKG_VERSION"))
            ),
            _ => panic!("--version: expected the version text"),
        }
        let Err(e) = parse(["--tokns", "128"]) else {
            panic!("a mistyped flag is refused");
        };
        assert!(e.contains("--tokens"), "no suggestion: {e}");
    }

    #[test]
    fn help() {
        for args in [&["--help"][..], &["--tokens", "1", "-h"]] {
            match parse(args) {
                Ok(Command::Help(text)) => {
                    for opt in [
                        "--virtual-ranks",
                        "--ranks-per-node",
                        "--num-sms",
                        "local-copy-dispatch",
                        "vs local",
                        "--mode ll",
                        "ll-pair",
                        "dispatch-fp8",
                        "--fp8-scales",
                        "QUANT_FWD",
                        "Exit status",
                    ] {
                        assert!(text.contains(opt), "help lacks {opt}:\n{text}");
                    }
                }
                other => panic!("expected help, got {other:?}"),
            }
        }
    }

    #[test]
    fn all_options() {
        let o = run(&[
            "--gpus",
            "4",
            "--tokens=128,256",
            "--hidden",
            "4096",
            "--topk",
            "4",
            "--experts",
            "64",
            "--mode",
            "ht",
            "--layout",
            "rank,expert,expert:64",
            "--dtype",
            "bf16",
            "--routing",
            "skewed:0.25",
            "--num-sms",
            "20,24",
            "--warmup",
            "2",
            "--iters",
            "7",
            "--ops",
            "dispatch,combine-bwd",
            "--check",
            "--no-baselines",
            "--no-nccl-ep",
            "--seed",
            "42",
            "--start",
            "host",
            "--quiet",
        ]);
        assert_eq!(o.gpus, Some(4));
        assert!(!o.gpu_start());
        assert_eq!(o.tokens, vec![128, 256]);
        assert_eq!(
            o.layouts,
            vec![
                RecvLayout::RankMajor,
                RecvLayout::ExpertMajor { alignment: 128 },
                RecvLayout::ExpertMajor { alignment: 64 }
            ]
        );
        assert_eq!(o.routing.to_string(), "skewed:0.25");
        assert_eq!(o.num_sms, vec![20, 24]);
        assert_eq!((o.warmup(), o.iters(), o.seed), (2, 7, 42));
        assert_eq!(o.ops, vec![Op::Dispatch, Op::CombineBwd]);
        assert!(o.check && o.no_baselines && o.no_nccl_ep && o.quiet);
        assert_eq!(o.cases().len(), 2 * 3 * 2);
        assert_eq!(
            run(&["--routing", "masked:0"]).routing.to_string(),
            "masked:0"
        );
        // The last of a repeated option wins.
        assert_eq!(
            run(&["--tokens", "1", "--tokens", "2,3"]).tokens,
            vec![2, 3]
        );
        assert_eq!(run(&["--seed", "1", "--seed", "2"]).seed, 2);
    }

    #[test]
    fn sweep_order_is_stable_tokens_fastest() {
        let o = run(&[
            "--tokens",
            "1,2,3",
            "--hidden",
            "8,16",
            "--num-sms",
            "4,5",
            "--experts",
            "16",
        ]);
        let key: Vec<(usize, usize, usize)> = o
            .cases()
            .iter()
            .map(|c| (c.hidden, c.num_sms, c.tokens))
            .collect();
        let mut want = Vec::new();
        for h in [8, 16] {
            for s in [4, 5] {
                for t in [1, 2, 3] {
                    want.push((h, s, t));
                }
            }
        }
        assert_eq!(key, want);
        // Given order is kept, repeats dropped.
        assert_eq!(run(&["--tokens", "512,64,512,0"]).tokens, vec![512, 64, 0]);
    }

    #[test]
    fn profile_mode() {
        let o = run(&["--profile"]);
        assert!(!o.flush_l2() && !o.gpu_start());
        assert_eq!((o.warmup(), o.iters()), (0, PROFILE_DEFAULT_ITERS));
        err_names(&["--profile", "--start", "gpu"], "--start");
        assert!(!run(&["--profile", "--start", "host"]).gpu_start());
        let o = run(&["--profile", "--iters", "1", "--warmup", "0"]);
        assert_eq!((o.warmup(), o.iters()), (0, 1));
        err_names(&["--profile", "--warmup", "3"], "--warmup");
    }

    /// Bad command lines (split at spaces), the option each error names,
    /// and a part of the message.
    const BAD: &[(&str, &str, &str)] = &[
        ("--mode ll --tokens 1025", "--tokens", "1024"),
        ("--mode ll --tokens 64,2048", "--tokens", "2048"),
        (
            "--mode ll --ops dispatch",
            "--ops",
            "not an op of --mode ll",
        ),
        ("--ops ll-dispatch", "--ops", "not an op of --mode ht"),
        ("--ops layout,ll-pair", "--ops", "ll-pair"),
        (
            "--mode ll --hidden 1032",
            "--hidden",
            "ll-dispatch-fp8 and ll-pair",
        ),
        (
            "--mode ll --hidden 1024,1032 --ops ll-dispatch,ll-pair",
            "--hidden",
            "1032",
        ),
        ("--mode ll --ops ll-foo", "--ops", "ll-dispatch"),
        (
            "--ops dispatch-fp8 --hidden 7232",
            "--hidden",
            "which dispatch-fp8 needs",
        ),
        (
            "--mode ll --ops dispatch-fp8",
            "--ops",
            "not an op of --mode ll",
        ),
        (
            "--ranks-per-node 1 --ops dispatch-fp8",
            "--ops",
            "not an op of --ranks-per-node",
        ),
        (
            "--fp8-scales e8m0",
            "--fp8-scales",
            "only with --ops dispatch-fp8",
        ),
        (
            "--ops dispatch-fp8 --fp8-scales e4m3",
            "--fp8-scales",
            "f32, e8m0",
        ),
        (
            "--ops dispatch-fp8 --fp8-scales",
            "--fp8-scales",
            "value is required",
        ),
        ("--ranks-per-node 0", "--ranks-per-node", "out of range"),
        ("--ranks-per-node 9", "--ranks-per-node", "out of range"),
        (
            "--hop-chunk-rows 64",
            "--hop-chunk-rows",
            "only with --ranks-per-node",
        ),
        (
            "--ranks-per-node 1 --hop-chunk-rows 0",
            "--hop-chunk-rows",
            "out of range",
        ),
        (
            "--virtual-ranks 4 --ranks-per-node 3",
            "--ranks-per-node",
            "at least 2 nodes",
        ),
        (
            "--virtual-ranks 4 --ranks-per-node 4",
            "--ranks-per-node",
            "at least 2 nodes",
        ),
        (
            "--mode ll --ranks-per-node 1",
            "--ranks-per-node",
            "--mode ht only",
        ),
        (
            "--ranks-per-node 1 --ops combine-push",
            "--ops",
            "not an op of --ranks-per-node",
        ),
        ("--tokens abc", "--tokens", "'abc' is not a whole number"),
        ("--tokens 1,,2", "--tokens", "not a whole number"),
        ("--tokens -5", "--tokens", "negative"),
        ("--tokens 65537", "--tokens", "out of range"),
        ("--tokens", "--tokens", "value is required"),
        ("--tokens --check", "--tokens", "value is required"),
        ("--hidden 1.5", "--hidden", ""),
        ("--hidden 7001", "--hidden", "multiple of 8"),
        ("--hidden 0", "--hidden", "multiple of 8"),
        ("--hidden 4096,7004", "--hidden", "7004"),
        ("--topk 0", "--topk", ""),
        ("--topk 17", "--topk", ""),
        ("--topk 8 --experts 4", "--topk", "--experts"),
        ("--topk 2,8 --experts 4,64", "--topk", "--experts 4"),
        ("--experts 0", "--experts", "at least 1"),
        ("--num-sms 0", "--num-sms", ""),
        ("--num-sms 133", "--num-sms", "1..=132"),
        ("--iters 0", "--iters", ""),
        ("--gpus 0", "--gpus", ""),
        ("--gpus x", "--gpus", ""),
        ("--seed 99999999999999999999999", "--seed", "too large"),
        ("--warmup=", "--warmup", ""),
        ("--mode fast", "--mode", ""),
        ("--layout token", "--layout", ""),
        ("--layout expert:0", "--layout", ""),
        ("--layout expert:x", "--layout", ""),
        ("--ops dispatch,foo", "--ops", "foo"),
        ("--dtype fp16", "--dtype", ""),
        ("--dtype fp8", "--dtype", "not yet supported"),
        ("--start now", "--start", "gpu, host"),
        ("--routing skewed:1.5", "--routing", "outside [0, 1]"),
        ("--routing masked:-0.1", "--routing", ""),
        ("--routing masked:nan", "--routing", ""),
        ("--routing skewed", "--routing", "needs a share"),
        ("--routing zipf", "--routing", ""),
        (
            "--routing file:/nonexistent/routing.txt",
            "--routing",
            "does not exist",
        ),
        ("--bogus", "--bogus", ""),
        ("--bogus=3", "--bogus", ""),
        ("-x", "-x", ""),
        ("stray", "stray", ""),
        ("--check=yes", "--check", ""),
        ("--json=", "--json", ""),
        ("--json /", "--json", "directory"),
        ("--csv /nonexistent-dir/x.csv", "--csv", "does not exist"),
        ("--plot out.svg", "--plot", "at least 2 --tokens"),
    ];

    #[test]
    fn bad_command_lines() {
        for (args, option, text) in BAD {
            let args: Vec<&str> = args.split(' ').collect();
            let e = err_names(&args, option);
            assert!(e.contains(text), "{args:?}: {e}");
        }
    }

    #[test]
    fn edge_values() {
        run(&["--tokens", "0,65536"]);
        run(&["--num-sms", "1,132"]);
        run(&["--plot", "out.svg", "--tokens", "1,2"]);
        let tmp = std::env::temp_dir().join(format!("ep-bench-routing-{}.txt", std::process::id()));
        std::fs::write(&tmp, "0 1\n").unwrap();
        let arg = format!("file:{}", tmp.display());
        assert_eq!(
            run(&["--routing", &arg]).routing,
            Routing::File(tmp.clone())
        );
        let _ = std::fs::remove_file(&tmp);
    }

    #[test]
    fn world_validation() {
        let e = err_names(&["--gpus", "3", "--experts", "256"], "--experts");
        assert!(e.contains('3'), "{e}");
        run(&["--gpus", "4", "--experts", "256"]);
        let o = run(&["--experts", "48,96"]);
        assert!(o.validate_for_world(8).is_ok());
        assert!(o.validate_for_world(32).unwrap_err().contains("--experts"));
        assert!(o.validate_for_world(0).is_err());
        let o = run(&["--gpus", "4"]);
        assert!(o.validate_for_world(8).unwrap_err().contains("--gpus"));
    }

    #[test]
    fn virtual_ranks() {
        let o = run(&["--virtual-ranks", "8"]);
        assert_eq!(o.virtual_ranks, Some(8));
        assert!(o.auto_num_sms() && o.gpu_start());
        assert_eq!(o.cases()[0].num_sms, DEFAULT_NUM_SMS);
        assert!(!run(&["--virtual-ranks", "2", "--num-sms", "32"]).auto_num_sms());
        err_names(&["--virtual-ranks", "0"], "--virtual-ranks");
        err_names(&["--virtual-ranks", "9"], "--virtual-ranks");
        let e = err_names(&["--virtual-ranks", "2", "--gpus", "2"], "--virtual-ranks");
        assert!(e.contains("--gpus"), "{e}");
        let e = err_names(&["--virtual-ranks", "3"], "--experts");
        assert!(e.contains("world size 3"), "{e}");
        run(&["--virtual-ranks", "3", "--experts", "48"]);
    }

    #[test]
    fn low_latency_mode() {
        let o = run(&["--mode", "ll"]);
        assert_eq!(o.mode, Mode::LowLatency);
        assert_eq!(o.tokens, vec![LL_DEFAULT_TOKENS]);
        assert_eq!(
            o.ops,
            [Op::LlDispatch, Op::LlDispatchFp8, Op::LlCombine, Op::LlPair]
        );
        assert_eq!(
            o.cases()[0].label(),
            "tokens=128 hidden=7168 topk=8 experts=256 layout=rank sms=24"
        );
        // expert, expert:A: one expert-major layout; rank: rank-major.
        let o = run(&[
            "--mode",
            "ll",
            "--layout",
            "expert,rank,expert:64",
            "--tokens",
            "1,1024",
            "--ops",
            "ll-combine,ll-pair",
        ]);
        assert_eq!(
            o.layouts,
            [
                RecvLayout::ExpertMajor { alignment: 1 },
                RecvLayout::RankMajor
            ]
        );
        assert_eq!(
            o.layouts.iter().map(|&l| ll_layout(l)).collect::<Vec<_>>(),
            [LlLayout::ExpertMajor, LlLayout::RankMajor]
        );
        assert_eq!(o.ops, [Op::LlCombine, Op::LlPair]);
        let labels: Vec<String> = o.cases().iter().map(Case::layout_label).collect();
        assert_eq!(labels, ["expert", "expert", "rank", "rank"]);
        assert!(o.cases()[0].label().contains("layout=expert sms"));
        // Hidden sizes that are no multiple of 128 take the bf16 ops only.
        let o = run(&[
            "--mode",
            "ll",
            "--hidden",
            "1032",
            "--ops",
            "ll-dispatch,ll-combine",
        ]);
        assert_eq!(o.hidden, vec![1032]);
        // The world checks of --mode ht hold too.
        run(&[
            "--mode",
            "ll",
            "--virtual-ranks",
            "2",
            "--experts",
            "16",
            "--topk",
            "4",
        ]);
        err_names(&["--mode", "ll", "--gpus", "3"], "--experts");
        // --mode ht keeps its defaults.
        let o = run(&["--mode", "ht"]);
        assert_eq!((o.tokens[0], o.ops.len()), (DEFAULT_TOKENS, 3));
        for op in Op::LL {
            assert!(op.is_ll() && Op::from_name(op.name()) == Some(op));
        }
        assert!(Op::LlPair.is_fp8() && !Op::LlCombine.is_fp8() && !Op::Dispatch.is_ll());
        assert_eq!(ll_layout_name(LlLayout::ExpertMajor), "expert");
        assert_eq!(mode_name(Mode::LowLatency), "ll");
    }

    /// `dispatch-fp8`: an op of `--mode ht` on one node; `--fp8-scales`
    /// picks the scales (f32 per 128 values unless given).
    #[test]
    fn fp8_dispatch_op() {
        let o = run(&["--ops", "dispatch,dispatch-fp8", "--layout", "rank,expert"]);
        assert_eq!(o.ops, [Op::Dispatch, Op::DispatchFp8]);
        assert_eq!(o.fp8_scales(), ScaleKind::F32);
        assert!(o.cases().iter().all(|c| c.fp8_scales == ScaleKind::F32));
        let o = run(&["--ops", "dispatch-fp8", "--fp8-scales", "e8m0"]);
        assert_eq!(o.fp8_scales, Some(ScaleKind::E8m0));
        assert_eq!(o.cases()[0].fp8_scales, ScaleKind::E8m0);
        assert_eq!(
            run(&["--ops", "dispatch-fp8", "--fp8-scales", "f32"]).fp8_scales(),
            ScaleKind::F32
        );
        assert!(Op::DispatchFp8.is_fp8() && !Op::DispatchFp8.is_ll());
        assert_eq!(Op::from_name("dispatch-fp8"), Some(Op::DispatchFp8));
        // Hidden a multiple of 128 (the library's rule); the bf16 ops take any.
        run(&["--ops", "dispatch-fp8", "--hidden", "128,7168"]);
        run(&["--ops", "dispatch", "--hidden", "7232"]);
        // Virtual ranks run it too.
        run(&["--virtual-ranks", "8", "--ops", "dispatch-fp8", "--check"]);
        // Either kind is H / 32 bytes a row.
        for k in [ScaleKind::F32, ScaleKind::E8m0] {
            assert_eq!(k.row_bytes(7168), 224);
        }
        assert_eq!(
            (ScaleKind::F32.per_row(7168), ScaleKind::E8m0.per_row(7168)),
            (56, 224)
        );
        assert_eq!(ScaleKind::E8m0.describe(), "e8m0 per 32 values");
    }

    #[test]
    fn case_names() {
        assert_eq!(Dtype::Bf16.elem_bytes(), 2);
        assert_eq!(
            layout_name(RecvLayout::ExpertMajor { alignment: 64 }),
            "expert:64"
        );
        assert_eq!(mode_name(Mode::HighThroughput), "ht");
        for op in Op::ALL {
            assert_eq!(Op::from_name(op.name()), Some(op));
        }
        assert_eq!(Op::from_name("nccl-alltoall"), None);
    }
}
