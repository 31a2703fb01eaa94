//! Command-line options of `ep-bench`: parsing, sweep expansion and validation.
//!
//! Every check that can be made without a GPU happens here, before any GPU
//! work, and fails with a single line that names the offending option
//! (`main` prefixes it with `ep-bench: error: `). The checks that need the
//! world size (known only once the launcher or the device count decided it)
//! are in [`validate_for_world`], which the rank code calls.
//!
//! Options marked LIST take a comma-separated list; the cartesian product of
//! all lists is the case list (see [`Opts::cases`] for the order).

use std::fmt;
use std::path::{Path, PathBuf};

/// Largest accepted `--tokens` value (tokens per rank).
pub const MAX_TOKENS: usize = 65536;
/// Largest accepted `--topk` value (experts per token).
pub const MAX_TOPK: usize = 16;
/// Largest accepted `--num-sms` value (streaming multiprocessors per kernel).
pub const MAX_NUM_SMS: usize = 132;
/// Row alignment (tokens) used by `--layout expert` without an explicit `:ALIGN`.
pub const DEFAULT_EXPERT_ALIGNMENT: usize = 128;
/// Timed iterations per op under `--profile` when `--iters` is not given.
pub const PROFILE_DEFAULT_ITERS: usize = 3;

/// Usage text printed by `--help`.
pub const USAGE: &str = "\
ep-bench: time the moe-ep expert-parallel dispatch/combine kernels against
NCCL all-to-all and hardware ceilings.

USAGE:
    ep-bench [OPTIONS]                      spawn one rank per visible GPU
    torchrun --no-python --nproc-per-node 8 ep-bench [OPTIONS]
    mpirun -np 8 ep-bench [OPTIONS]         (or srun; see launchers below)

Options marked LIST take a comma list (e.g. --tokens 512,1024,4096); the
cartesian product of all lists is benchmarked, tokens varying fastest.

    --gpus N               spawn N local ranks (default: all visible GPUs)
    --tokens LIST          tokens per rank, 0..=65536 (default 4096)
    --hidden LIST          hidden size, a positive multiple of 8 (default 7168)
    --topk LIST            experts per token, 1..=16 and <= experts (default 8)
    --experts LIST         total experts, divisible by the world size (default 256)
    --mode ht|ll           high-throughput or low-latency kernels (default ht)
    --layout LIST          rank | expert | expert:ALIGN  receive-buffer layout
                           (default rank; expert = expert:128)
    --dtype bf16           payload type (only bf16 for now)
    --routing R            uniform | skewed:SHARE | masked:SHARE | file:PATH,
                           SHARE in [0, 1] (default uniform)
    --num-sms LIST         SMs given to our kernels, 1..=132 (default 24)
    --warmup N             untimed iterations per op (default 5)
    --iters N              timed iterations per op, >= 1 (default 20)
    --ops LIST             layout,dispatch,combine,dispatch-bwd,combine-bwd,
                           combine-push
                           (default layout,dispatch,combine)
    --check                compare with the CPU reference once before timing
    --no-baselines         skip NCCL all-to-all and the hardware ceilings
    --profile              Nsight mode: no warm-up, each op runs exactly --iters
                           times (default 3), no L2 flush
    --start gpu|host       how the ranks start each timed run (default gpu;
                           host under --profile): gpu = every rank's work is
                           enqueued behind a gate, then the GPUs leave a
                           one-word NCCL all-reduce together and the timer
                           starts; host = the timer starts after a host
                           barrier (host skew and enqueue time fall inside)
    --seed N               routing seed (default 0)
    --json FILE            write all results (per-rank stats included) as JSON
    --csv FILE             write one line per (case, op) as CSV
    --plot FILE.svg        NVLink GB/s against tokens (needs >= 2 --tokens)
    --ranks-per-node N     ranks per (virtual) node (default: the world size)
    --quiet                no progress line
    -h, --help             print this help

Launchers: without one, ep-bench re-executes itself once per GPU. Under
torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT), Open MPI
(OMPI_COMM_WORLD_*) or Slurm (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, with
MASTER_ADDR/MASTER_PORT exported) each process is one rank and the NCCL id is
shared over TCP; MOE_EP_BENCH_RDZV_ADDR/MOE_EP_BENCH_RDZV_PORT override the
address and port of that rendezvous.

Exit status: 0 ok, 1 runtime failure (or a failed --check), 2 usage error.
";

/// Which kernel family is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// High-throughput kernels (`ht`): large batches, SM-budgeted (`--num-sms`).
    HighThroughput,
    /// Low-latency kernels (`ll`): small decode batches.
    LowLatency,
}

impl Mode {
    /// The command-line spelling: `ht` or `ll`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::HighThroughput => "ht",
            Mode::LowLatency => "ll",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Layout of the received tokens on the destination rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Rows grouped by source rank (`rank`).
    RankMajor,
    /// Rows grouped by local expert, each expert's segment padded to a
    /// multiple of `alignment` rows (tokens) (`expert` / `expert:ALIGN`).
    ExpertMajor {
        /// Segment alignment in rows (tokens), >= 1.
        alignment: usize,
    },
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::RankMajor => f.write_str("rank"),
            Layout::ExpertMajor { alignment } => write!(f, "expert:{alignment}"),
        }
    }
}

/// Payload element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How tokens pick their experts. The generator itself lives with the GPU
/// code; the shares are validated to lie in `[0, 1]`.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// Every token picks `topk` distinct experts uniformly at random.
    Uniform,
    /// `skewed:SHARE`: a fraction SHARE (0..=1) of the picks go to a hot
    /// subset of experts, the rest uniformly.
    Skewed(f64),
    /// `masked:SHARE`: a fraction SHARE (0..=1) of the (token, slot) picks
    /// are masked out (expert id -1), as in dropped/padded tokens.
    Masked(f64),
    /// `file:PATH`: routing read from a file (checked to exist at parse time).
    File(PathBuf),
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Routing::Uniform => f.write_str("uniform"),
            Routing::Skewed(s) => write!(f, "skewed:{s}"),
            Routing::Masked(s) => write!(f, "masked:{s}"),
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
}

impl Op {
    /// All ops, in their canonical order.
    pub const ALL: [Op; 6] = [
        Op::Layout,
        Op::Dispatch,
        Op::Combine,
        Op::DispatchBwd,
        Op::CombineBwd,
        Op::CombinePush,
    ];

    /// The command-line and report name (`dispatch-bwd`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Op::Layout => "layout",
            Op::Dispatch => "dispatch",
            Op::Combine => "combine",
            Op::DispatchBwd => "dispatch-bwd",
            Op::CombineBwd => "combine-bwd",
            Op::CombinePush => "combine-push",
        }
    }

    /// Inverse of [`Op::name`]; `None` for baselines and unknown names.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
    pub layout: Layout,
    /// SMs given to our kernels (1..=132).
    pub num_sms: usize,
    /// Kernel family (not swept).
    pub mode: Mode,
    /// Payload type (not swept).
    pub dtype: Dtype,
    /// Routing distribution (not swept).
    pub routing: Routing,
}

impl Case {
    /// `tokens=4096 hidden=7168 topk=8 experts=256 layout=rank sms=24`.
    pub fn label(&self) -> String {
        format!(
            "tokens={} hidden={} topk={} experts={} layout={} sms={}",
            self.tokens, self.hidden, self.topk, self.experts, self.layout, self.num_sms
        )
    }

    /// Bytes per payload element (2 for bf16).
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn elem_bytes(&self) -> usize {
        self.dtype.elem_bytes()
    }

    /// Bytes of one token row (`hidden * elem_bytes`).
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn row_bytes(&self) -> u64 {
        (self.hidden as u64).saturating_mul(self.elem_bytes() as u64)
    }

    /// Experts owned by each rank, or `None` if `experts` is not divisible
    /// by `world` (or `world` is 0).
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn experts_per_rank(&self, world: usize) -> Option<usize> {
        if world == 0 || !self.experts.is_multiple_of(world) {
            None
        } else {
            Some(self.experts / world)
        }
    }
}

/// All parsed and validated options.
#[derive(Clone, Debug, PartialEq)]
pub struct Opts {
    /// `--gpus`: ranks to spawn; `None` = all visible GPUs (decided by the GPU code).
    pub gpus: Option<usize>,
    /// `--tokens`: tokens per rank, one entry per sweep value.
    pub tokens: Vec<usize>,
    /// `--hidden`: hidden sizes (elements).
    pub hidden: Vec<usize>,
    /// `--topk`: experts per token.
    pub topk: Vec<usize>,
    /// `--experts`: total experts.
    pub experts: Vec<usize>,
    /// `--mode`.
    pub mode: Mode,
    /// `--layout`: receive layouts.
    pub layouts: Vec<Layout>,
    /// `--dtype`.
    pub dtype: Dtype,
    /// `--routing`.
    pub routing: Routing,
    /// `--num-sms`: SM budgets.
    pub num_sms: Vec<usize>,
    /// `--warmup`: untimed iterations per op (0 under `--profile`).
    pub warmup: usize,
    /// `--iters`: timed iterations per op (>= 1; default 3 under `--profile`).
    pub iters: usize,
    /// `--ops`: our ops to time, in the given order, without duplicates.
    pub ops: Vec<Op>,
    /// `--check`: compare with the CPU reference once before timing.
    pub check: bool,
    /// `false` with `--no-baselines`: skip NCCL all-to-all and the ceilings.
    pub baselines: bool,
    /// `--profile`: Nsight mode (no warm-up sweep, exactly `iters` runs per op).
    pub profile: bool,
    /// Flush L2 between timed iterations (`false` under `--profile`).
    pub flush_l2: bool,
    /// `--start`: `true` (gpu, the default) lines the ranks up on the GPUs
    /// before each timed run; `false` (host) after a host barrier only.
    pub gpu_start: bool,
    /// `--seed`: routing seed.
    pub seed: u64,
    /// `--json`: output file.
    pub json: Option<PathBuf>,
    /// `--csv`: output file.
    pub csv: Option<PathBuf>,
    /// `--plot`: SVG output file.
    pub plot: Option<PathBuf>,
    /// `--ranks-per-node`: `None` = the whole world is one node.
    pub ranks_per_node: Option<usize>,
    /// `--quiet`: no progress line.
    pub quiet: bool,
}

impl Default for Opts {
    /// The documented defaults (what an empty command line gives).
    fn default() -> Self {
        Opts {
            gpus: None,
            tokens: vec![4096],
            hidden: vec![7168],
            topk: vec![8],
            experts: vec![256],
            mode: Mode::HighThroughput,
            layouts: vec![Layout::RankMajor],
            dtype: Dtype::Bf16,
            routing: Routing::Uniform,
            num_sms: vec![24],
            warmup: 5,
            iters: 20,
            ops: vec![Op::Layout, Op::Dispatch, Op::Combine],
            check: false,
            baselines: true,
            profile: false,
            flush_l2: true,
            gpu_start: true,
            seed: 0,
            json: None,
            csv: None,
            plot: None,
            ranks_per_node: None,
            quiet: false,
        }
    }
}

impl Opts {
    /// The case list: the cartesian product of all LIST options. Order is
    /// stable: hidden (slowest), topk, experts, layout, num-sms, tokens
    /// (fastest), each in the order given on the command line.
    pub fn cases(&self) -> Vec<Case> {
        let mut out = Vec::new();
        for &hidden in &self.hidden {
            for &topk in &self.topk {
                for &experts in &self.experts {
                    for &layout in &self.layouts {
                        for &num_sms in &self.num_sms {
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

    /// Ranks per node for a world of `world` ranks (`--ranks-per-node`, or
    /// the whole world).
    #[allow(dead_code)] // offered to gpu.rs, which may not use it
    pub fn ranks_per_node_for(&self, world: usize) -> usize {
        self.ranks_per_node.unwrap_or(world)
    }
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Run the benchmark with these options.
    Run(Box<Opts>),
    /// `--help` / `-h`: print [`USAGE`] and exit 0.
    Help,
}

/// Parses the arguments (without the program name) and validates
/// everything that does not need the world size. `--gpus` given: also checks
/// [`validate_for_world`] with that size.
///
/// Errors are one line naming the option, e.g.
/// `--tokens: 'abc' is not a whole number`.
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Command, String> {
    let mut opts = Opts::default();
    let mut iters_given = false;
    let mut warmup_given = false;
    let mut start_given = false;
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_ref();
        i += 1;
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        if !arg.starts_with("--") || arg == "--" {
            if arg.starts_with('-') {
                return Err(format!("unknown option '{arg}' (see --help)"));
            }
            return Err(format!(
                "unexpected argument '{arg}' (options start with --; see --help)"
            ));
        }
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (arg, None),
        };
        // Flags: no value.
        let flag = match name {
            "--check" | "--no-baselines" | "--profile" | "--quiet" => true,
            "--gpus" | "--tokens" | "--hidden" | "--topk" | "--experts" | "--mode" | "--layout"
            | "--dtype" | "--routing" | "--num-sms" | "--warmup" | "--iters" | "--ops"
            | "--seed" | "--json" | "--csv" | "--plot" | "--ranks-per-node" | "--start" => false,
            _ => return Err(format!("unknown option '{name}' (see --help)")),
        };
        if flag {
            if inline.is_some() {
                return Err(format!("{name}: takes no value"));
            }
            match name {
                "--check" => opts.check = true,
                "--no-baselines" => opts.baselines = false,
                "--profile" => opts.profile = true,
                _ => opts.quiet = true,
            }
            continue;
        }
        let value: &str = match inline {
            Some(v) => v,
            None => match args.get(i).map(|s| s.as_ref()) {
                Some(v) if !v.starts_with("--") => {
                    i += 1;
                    v
                }
                _ => return Err(format!("{name}: missing value")),
            },
        };
        match name {
            "--gpus" => opts.gpus = Some(parse_uint(name, value)?),
            "--tokens" => opts.tokens = parse_uint_list(name, value)?,
            "--hidden" => opts.hidden = parse_uint_list(name, value)?,
            "--topk" => opts.topk = parse_uint_list(name, value)?,
            "--experts" => opts.experts = parse_uint_list(name, value)?,
            "--num-sms" => opts.num_sms = parse_uint_list(name, value)?,
            "--mode" => opts.mode = parse_mode(value)?,
            "--layout" => opts.layouts = parse_list(name, value, parse_layout)?,
            "--dtype" => opts.dtype = parse_dtype(value)?,
            "--routing" => opts.routing = parse_routing(value)?,
            "--warmup" => {
                opts.warmup = parse_uint(name, value)?;
                warmup_given = true;
            }
            "--iters" => {
                opts.iters = parse_uint(name, value)?;
                iters_given = true;
            }
            "--ops" => opts.ops = parse_list(name, value, parse_op)?,
            "--seed" => opts.seed = parse_u64(name, value)?,
            "--json" => opts.json = Some(parse_out_path(name, value)?),
            "--csv" => opts.csv = Some(parse_out_path(name, value)?),
            "--plot" => opts.plot = Some(parse_out_path(name, value)?),
            "--start" => {
                opts.gpu_start = match value {
                    "gpu" => true,
                    "host" => false,
                    _ => return Err(format!("--start: '{value}' is not gpu or host")),
                };
                start_given = true;
            }
            // Only "--ranks-per-node" is left (the list above is exhaustive).
            _ => opts.ranks_per_node = Some(parse_uint(name, value)?),
        }
    }

    if opts.profile {
        if warmup_given && opts.warmup > 0 {
            return Err(
                "--warmup: --profile runs no warm-up; drop --warmup or set it to 0".to_string(),
            );
        }
        if start_given && opts.gpu_start {
            return Err(
                "--start gpu: not with --profile (Nsight Compute runs each profiled \
                        kernel inside its launch call, before the gate could open); \
                        --profile times from a host barrier"
                    .to_string(),
            );
        }
        opts.gpu_start = false;
        opts.warmup = 0;
        opts.flush_l2 = false;
        if !iters_given {
            opts.iters = PROFILE_DEFAULT_ITERS;
        }
    }
    validate(&opts)?;
    Ok(Command::Run(Box::new(opts)))
}

/// Range and consistency checks that need no world size.
fn validate(o: &Opts) -> Result<(), String> {
    if o.gpus == Some(0) {
        return Err("--gpus: 0 must be at least 1".to_string());
    }
    for &t in &o.tokens {
        if t > MAX_TOKENS {
            return Err(format!(
                "--tokens: {t} is out of range (0..={MAX_TOKENS} tokens per rank)"
            ));
        }
    }
    for &h in &o.hidden {
        if h == 0 || h % 8 != 0 {
            return Err(format!("--hidden: {h} is not a positive multiple of 8"));
        }
    }
    for &e in &o.experts {
        if e == 0 {
            return Err("--experts: 0 must be at least 1".to_string());
        }
    }
    for &k in &o.topk {
        if !(1..=MAX_TOPK).contains(&k) {
            return Err(format!("--topk: {k} is out of range (1..={MAX_TOPK})"));
        }
    }
    let max_topk = o.topk.iter().copied().max().unwrap_or(0);
    let min_experts = o.experts.iter().copied().min().unwrap_or(0);
    if max_topk > min_experts {
        return Err(format!(
            "--topk: {max_topk} is larger than --experts {min_experts}"
        ));
    }
    for &s in &o.num_sms {
        if !(1..=MAX_NUM_SMS).contains(&s) {
            return Err(format!(
                "--num-sms: {s} is out of range (1..={MAX_NUM_SMS})"
            ));
        }
    }
    if o.iters == 0 {
        return Err("--iters: 0 must be at least 1".to_string());
    }
    if o.ranks_per_node == Some(0) {
        return Err("--ranks-per-node: 0 must be at least 1".to_string());
    }
    if let Some(plot) = &o.plot {
        if o.tokens.len() < 2 {
            return Err(format!(
                "--plot: '{}' needs at least 2 --tokens values (e.g. --tokens 1024,2048,4096), got {}",
                plot.display(),
                o.tokens.len()
            ));
        }
    }
    if let Some(n) = o.gpus {
        validate_for_world(o, n)?;
    }
    Ok(())
}

/// Checks that need the world size (number of ranks), e.g. once a launcher
/// or the device count decided it: every `--experts` value divisible by
/// `world`, `--ranks-per-node` dividing `world`, and `--gpus` (if given)
/// equal to `world`. Returns one line naming the option.
pub fn validate_for_world(opts: &Opts, world: usize) -> Result<(), String> {
    if world == 0 {
        return Err("--gpus: the world size is 0 (no GPU visible?)".to_string());
    }
    if let Some(n) = opts.gpus {
        if n != world {
            return Err(format!(
                "--gpus: {n} does not match the world size {world} set by the launcher"
            ));
        }
    }
    for &e in &opts.experts {
        if e % world != 0 {
            return Err(format!(
                "--experts: {e} is not divisible by the world size {world}"
            ));
        }
    }
    if let Some(rpn) = opts.ranks_per_node {
        if rpn == 0 || !world.is_multiple_of(rpn) {
            return Err(format!(
                "--ranks-per-node: {rpn} does not divide the world size {world}"
            ));
        }
    }
    Ok(())
}

/// A whole number (digits only, `usize`).
fn parse_uint(name: &str, s: &str) -> Result<usize, String> {
    let v = parse_u64(name, s)?;
    usize::try_from(v).map_err(|_| format!("{name}: '{s}' is too large"))
}

/// A whole number (digits only, `u64`).
fn parse_u64(name: &str, s: &str) -> Result<u64, String> {
    if let Some(rest) = s.strip_prefix('-') {
        if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("{name}: '{s}' is negative"));
        }
    }
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{name}: '{s}' is not a whole number"));
    }
    s.parse::<u64>()
        .map_err(|_| format!("{name}: '{s}' is too large"))
}

fn parse_uint_list(name: &str, s: &str) -> Result<Vec<usize>, String> {
    parse_list(name, s, |v| parse_uint(name, v))
}

/// Splits a comma list, parses each item, drops repeated values (first
/// occurrence wins, order kept).
fn parse_list<T: PartialEq>(
    name: &str,
    s: &str,
    item: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let mut out: Vec<T> = Vec::new();
    for part in s.split(',') {
        let v = item(part)?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    if out.is_empty() {
        return Err(format!("{name}: empty list"));
    }
    Ok(out)
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    match s {
        "ht" => Ok(Mode::HighThroughput),
        "ll" => Ok(Mode::LowLatency),
        _ => Err(format!("--mode: '{s}' is not one of ht, ll")),
    }
}

fn parse_layout(s: &str) -> Result<Layout, String> {
    if s == "rank" {
        return Ok(Layout::RankMajor);
    }
    if s == "expert" {
        return Ok(Layout::ExpertMajor {
            alignment: DEFAULT_EXPERT_ALIGNMENT,
        });
    }
    if let Some(a) = s.strip_prefix("expert:") {
        if a.is_empty() || !a.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "--layout: alignment '{a}' in '{s}' is not a whole number"
            ));
        }
        let alignment: usize = a
            .parse()
            .map_err(|_| format!("--layout: alignment '{a}' in '{s}' is too large"))?;
        if alignment == 0 {
            return Err(format!("--layout: alignment in '{s}' must be at least 1"));
        }
        return Ok(Layout::ExpertMajor { alignment });
    }
    Err(format!(
        "--layout: '{s}' is not one of rank, expert, expert:ALIGN"
    ))
}

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    let lower = s.to_ascii_lowercase();
    match lower.as_str() {
        "bf16" | "bfloat16" => Ok(Dtype::Bf16),
        _ if lower.starts_with("fp8") || lower.starts_with("e4m3") || lower.starts_with("e5m2") => {
            Err(format!(
                "--dtype: {s} is not yet supported (only bf16 for now)"
            ))
        }
        _ => Err(format!("--dtype: '{s}' is not one of bf16")),
    }
}

fn parse_share(kind: &str, s: &str, full: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| {
        format!("--routing: share '{s}' in '{full}' is not a number (expected {kind}:SHARE with SHARE in [0, 1])")
    })?;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!(
            "--routing: share {s} in '{full}' is outside [0, 1]"
        ));
    }
    Ok(v)
}

fn parse_routing(s: &str) -> Result<Routing, String> {
    if s == "uniform" {
        return Ok(Routing::Uniform);
    }
    if s == "skewed" || s == "masked" {
        return Err(format!("--routing: '{s}' needs a share, e.g. {s}:0.5"));
    }
    if let Some(v) = s.strip_prefix("skewed:") {
        return Ok(Routing::Skewed(parse_share("skewed", v, s)?));
    }
    if let Some(v) = s.strip_prefix("masked:") {
        return Ok(Routing::Masked(parse_share("masked", v, s)?));
    }
    if let Some(p) = s.strip_prefix("file:") {
        if p.is_empty() {
            return Err("--routing: 'file:' needs a path, e.g. file:routing.txt".to_string());
        }
        let path = PathBuf::from(p);
        if !path.is_file() {
            return Err(format!("--routing: file '{p}' does not exist"));
        }
        return Ok(Routing::File(path));
    }
    Err(format!(
        "--routing: '{s}' is not one of uniform, skewed:SHARE, masked:SHARE, file:PATH"
    ))
}

fn parse_op(s: &str) -> Result<Op, String> {
    Op::from_name(s).ok_or_else(|| {
        format!("--ops: '{s}' is not one of layout, dispatch, combine, dispatch-bwd, combine-bwd, combine-push")
    })
}

/// An output file whose directory exists (checked now, not after the run).
fn parse_out_path(name: &str, s: &str) -> Result<PathBuf, String> {
    if s.is_empty() {
        return Err(format!("{name}: missing value"));
    }
    let path = PathBuf::from(s);
    if path.is_dir() {
        return Err(format!("{name}: '{s}' is a directory, expected a file"));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!(
            "{name}: directory '{}' of '{s}' does not exist",
            dir.display()
        ));
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

    fn err(args: &[&str]) -> String {
        match parse(args) {
            Err(e) => e,
            other => panic!("expected an error for {args:?}, got {other:?}"),
        }
    }

    /// The error names `option` and is a single line.
    fn assert_err_names(args: &[&str], option: &str) -> String {
        let e = err(args);
        assert!(e.contains(option), "error {e:?} does not name {option}");
        assert!(!e.contains('\n'), "error {e:?} is not one line");
        e
    }

    #[test]
    fn defaults() {
        let o = run(&[]);
        assert_eq!(o, Opts::default());
        assert_eq!(o.gpus, None);
        assert_eq!(o.tokens, vec![4096]);
        assert_eq!(o.hidden, vec![7168]);
        assert_eq!(o.topk, vec![8]);
        assert_eq!(o.experts, vec![256]);
        assert_eq!(o.mode, Mode::HighThroughput);
        assert_eq!(o.layouts, vec![Layout::RankMajor]);
        assert_eq!(o.num_sms, vec![24]);
        assert_eq!((o.warmup, o.iters), (5, 20));
        assert_eq!(o.ops, vec![Op::Layout, Op::Dispatch, Op::Combine]);
        assert!(o.baselines && o.flush_l2 && o.gpu_start && !o.check && !o.profile && !o.quiet);
        let cases = o.cases();
        assert_eq!(cases.len(), 1);
        assert_eq!(
            cases[0].label(),
            "tokens=4096 hidden=7168 topk=8 experts=256 layout=rank sms=24"
        );
    }

    #[test]
    fn help() {
        assert_eq!(parse(&["--help"]), Ok(Command::Help));
        assert_eq!(parse(&["--tokens", "1", "-h"]), Ok(Command::Help));
        assert!(USAGE.contains("--ranks-per-node"));
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
            "ll",
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
            "--seed",
            "42",
            "--ranks-per-node",
            "2",
            "--start",
            "host",
            "--quiet",
        ]);
        assert_eq!(o.gpus, Some(4));
        assert!(!o.gpu_start);
        assert_eq!(o.tokens, vec![128, 256]);
        assert_eq!(o.mode, Mode::LowLatency);
        assert_eq!(
            o.layouts,
            vec![
                Layout::RankMajor,
                Layout::ExpertMajor { alignment: 128 },
                Layout::ExpertMajor { alignment: 64 }
            ]
        );
        assert_eq!(o.routing, Routing::Skewed(0.25));
        assert_eq!(o.num_sms, vec![20, 24]);
        assert_eq!((o.warmup, o.iters, o.seed), (2, 7, 42));
        assert_eq!(o.ops, vec![Op::Dispatch, Op::CombineBwd]);
        assert!(o.check && !o.baselines && o.quiet);
        assert_eq!(o.ranks_per_node, Some(2));
        assert_eq!(o.ranks_per_node_for(4), 2);
        assert_eq!(o.cases().len(), 2 * 3 * 2);
        let o = run(&["--routing", "masked:0"]);
        assert_eq!(o.routing, Routing::Masked(0.0));
        assert_eq!(o.routing.to_string(), "masked:0");
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
        let cases = o.cases();
        assert_eq!(cases.len(), 12);
        let key: Vec<(usize, usize, usize)> = cases
            .iter()
            .map(|c| (c.hidden, c.num_sms, c.tokens))
            .collect();
        assert_eq!(
            key,
            vec![
                (8, 4, 1),
                (8, 4, 2),
                (8, 4, 3),
                (8, 5, 1),
                (8, 5, 2),
                (8, 5, 3),
                (16, 4, 1),
                (16, 4, 2),
                (16, 4, 3),
                (16, 5, 1),
                (16, 5, 2),
                (16, 5, 3),
            ]
        );
        // Given order is kept, repeats dropped.
        let o = run(&["--tokens", "512,64,512,0"]);
        assert_eq!(o.tokens, vec![512, 64, 0]);
        assert!(cases.iter().all(|c| c.routing == Routing::Uniform));
    }

    #[test]
    fn profile_mode() {
        let o = run(&["--profile"]);
        assert!(o.profile && !o.flush_l2 && !o.gpu_start);
        assert_err_names(&["--profile", "--start", "gpu"], "--start");
        assert!(!run(&["--profile", "--start", "host"]).gpu_start);
        assert_eq!((o.warmup, o.iters), (0, PROFILE_DEFAULT_ITERS));
        let o = run(&["--profile", "--iters", "1", "--warmup", "0"]);
        assert_eq!((o.warmup, o.iters), (0, 1));
        assert_err_names(&["--profile", "--warmup", "3"], "--warmup");
    }

    #[test]
    fn bad_numbers_and_values() {
        assert_eq!(
            err(&["--tokens", "abc"]),
            "--tokens: 'abc' is not a whole number"
        );
        assert_err_names(&["--tokens", "1,,2"], "--tokens");
        assert_err_names(&["--tokens", "-5"], "--tokens");
        assert_err_names(&["--hidden", "1.5"], "--hidden");
        assert_err_names(&["--seed", "99999999999999999999999"], "--seed");
        assert_err_names(&["--gpus", "x"], "--gpus");
        assert_err_names(&["--warmup", ""], "--warmup");
        assert_err_names(&["--mode", "fast"], "--mode");
        assert_err_names(&["--layout", "token"], "--layout");
        assert_err_names(&["--layout", "expert:0"], "--layout");
        assert_err_names(&["--layout", "expert:x"], "--layout");
        assert_err_names(&["--ops", "dispatch,foo"], "--ops");
        assert_err_names(&["--dtype", "fp16"], "--dtype");
        assert_err_names(&["--start", "now"], "--start");
        let e = assert_err_names(&["--dtype", "fp8"], "--dtype");
        assert!(e.contains("not yet supported"), "{e}");
    }

    #[test]
    fn routing_values() {
        assert_err_names(&["--routing", "skewed:1.5"], "--routing");
        assert_err_names(&["--routing", "masked:-0.1"], "--routing");
        assert_err_names(&["--routing", "masked:nan"], "--routing");
        assert_err_names(&["--routing", "skewed"], "--routing");
        assert_err_names(&["--routing", "zipf"], "--routing");
        assert_err_names(&["--routing", "file:/nonexistent/routing.txt"], "--routing");
        let tmp = std::env::temp_dir().join(format!("ep-bench-routing-{}.txt", std::process::id()));
        std::fs::write(&tmp, "0 1\n").unwrap();
        let arg = format!("file:{}", tmp.display());
        let o = run(&["--routing", &arg]);
        assert_eq!(o.routing, Routing::File(tmp.clone()));
        let _ = std::fs::remove_file(&tmp);
    }

    #[test]
    fn unknown_missing_and_positional() {
        assert_err_names(&["--bogus"], "--bogus");
        assert_err_names(&["--bogus=3"], "--bogus");
        assert_err_names(&["-x"], "-x");
        assert_err_names(&["stray"], "stray");
        assert_eq!(err(&["--tokens"]), "--tokens: missing value");
        assert_eq!(err(&["--tokens", "--check"]), "--tokens: missing value");
        assert_err_names(&["--check=yes"], "--check");
        assert_err_names(&["--json", ""], "--json");
    }

    #[test]
    fn range_validation() {
        assert_err_names(&["--hidden", "7001"], "--hidden");
        assert_err_names(&["--hidden", "0"], "--hidden");
        assert_err_names(&["--hidden", "4096,7004"], "--hidden");
        assert_err_names(&["--topk", "0"], "--topk");
        assert_err_names(&["--topk", "17"], "--topk");
        let e = assert_err_names(&["--topk", "8", "--experts", "4"], "--topk");
        assert!(e.contains("--experts"), "{e}");
        assert_err_names(&["--topk", "2,8", "--experts", "4,64"], "--topk");
        assert_err_names(&["--experts", "0"], "--experts");
        assert_err_names(&["--tokens", "65537"], "--tokens");
        run(&["--tokens", "0,65536"]);
        assert_err_names(&["--num-sms", "0"], "--num-sms");
        assert_err_names(&["--num-sms", "133"], "--num-sms");
        run(&["--num-sms", "1,132"]);
        assert_err_names(&["--iters", "0"], "--iters");
        assert_err_names(&["--gpus", "0"], "--gpus");
        assert_err_names(&["--ranks-per-node", "0"], "--ranks-per-node");
        assert_err_names(&["--plot", "out.svg"], "--plot");
        run(&["--plot", "out.svg", "--tokens", "1,2"]);
        assert_err_names(&["--csv", "/nonexistent-dir/x.csv"], "--csv");
        assert_err_names(&["--json", "/"], "--json");
    }

    #[test]
    fn world_validation() {
        let e = assert_err_names(&["--gpus", "3", "--experts", "256"], "--experts");
        assert!(e.contains('3'), "{e}");
        run(&["--gpus", "4", "--experts", "256"]);
        assert_err_names(
            &["--gpus", "4", "--ranks-per-node", "3"],
            "--ranks-per-node",
        );
        let o = run(&["--experts", "48,96"]);
        assert!(validate_for_world(&o, 8).is_ok());
        assert!(validate_for_world(&o, 32)
            .unwrap_err()
            .contains("--experts"));
        assert!(validate_for_world(&o, 0).is_err());
        let o = run(&["--gpus", "4"]);
        assert!(validate_for_world(&o, 8).unwrap_err().contains("--gpus"));
        let o = run(&["--ranks-per-node", "4"]);
        assert!(validate_for_world(&o, 8).is_ok());
        assert!(validate_for_world(&o, 2)
            .unwrap_err()
            .contains("--ranks-per-node"));
    }

    #[test]
    fn case_helpers() {
        let c = &run(&["--hidden", "16", "--experts", "64"]).cases()[0];
        assert_eq!(c.elem_bytes(), 2);
        assert_eq!(c.row_bytes(), 32);
        assert_eq!(c.experts_per_rank(8), Some(8));
        assert_eq!(c.experts_per_rank(3), None);
        assert_eq!(c.experts_per_rank(0), None);
        for op in Op::ALL {
            assert_eq!(Op::from_name(op.name()), Some(op));
        }
        assert_eq!(Op::from_name("nccl-alltoall"), None);
    }
}
