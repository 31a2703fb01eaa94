//! Rust mirrors of `kernels-cuda/abi.cuh`, field for field. The sizes are
//! asserted on both sides (static_assert there, const assert here), so a
//! drift fails the build.

/// Largest world of the NVLink path (`MOE_EP_MAX_RANKS`).
pub const MAX_RANKS: usize = 8;
const _: () = assert!(MAX_RANKS == crate::types::NODE_MAX_RANKS);
/// Largest grid (`MOE_EP_MAX_BLOCKS`).
pub const MAX_BLOCKS: usize = 132;
/// Largest top-k (`MOE_EP_MAX_TOPK`).
pub const MAX_TOPK: usize = 16;
/// Threads per block of the data kernels (`MOE_EP_THREADS`).
pub const THREADS: u32 = 512;
/// Dynamic shared memory of the combine kernels (`MOE_EP_COMBINE_SMEM`): the
/// rank-major pushed combine's bulk-copy ring.
pub const COMBINE_SMEM: u32 = 128 * 1024;
/// Dynamic shared memory of the expert-major pushed combine kernels
/// (`MOE_EP_EM_COMBINE_SMEM`): their ring of row slots.
pub const EM_COMBINE_SMEM: u32 = 200 * 1024;
/// Sub-chunks of each rank's tokens that combine pipelines over
/// (`MOE_EP_SUBCHUNKS`).
pub const SUBCHUNKS: usize = 16;
/// Experts per block of the layout scan (`MOE_EP_SCAN_EXPERTS`).
pub const SCAN_EXPERTS: usize = 4;
/// Threads per block of the layout scan (`MOE_EP_SCAN_THREADS`).
pub const SCAN_THREADS: u32 = 512;

/// Words of a count row's tail (`MOE_EP_ROW_TAIL`): the sender's first bad
/// routing entry, topk, layout kind and alignment, checked by every receiver.
pub const ROW_TAIL: usize = 8;

/// Words in one rank's row of the count matrix (`count_row` in abi.cuh):
/// `[E]` per expert, `[R]` per destination, `[R][SUBCHUNKS - 1]` sub-chunk
/// starts per destination, then the [`ROW_TAIL`] words.
pub fn count_row(r: usize, e: usize) -> usize {
    e + r * SUBCHUNKS + ROW_TAIL
}

/// Error codes of [`ErrorInfo::code`].
pub mod code {
    pub const OK: i32 = 0;
    pub const TIMEOUT: i32 = 1;
    pub const CAPACITY: i32 = 2;
    pub const BAD_EXPERT: i32 = 3;
    pub const DUP_EXPERT: i32 = 4;
    pub const MISMATCH: i32 = 5;
    pub const REFUSED: i32 = 6;
    pub const PEER_STOPPED: i32 = 7;
    pub const BAD_PEER_DATA: i32 = 8;
    pub const ABORTED: i32 = 9;
}
/// A short name of error code `c` ([`code`]).
pub fn code_name(c: i32) -> &'static str {
    match c {
        code::OK => "none",
        code::TIMEOUT => "a peer timeout",
        code::CAPACITY => "capacity exceeded",
        code::BAD_EXPERT => "an expert id out of range",
        code::DUP_EXPERT => "a repeated expert id",
        code::MISMATCH => "ranks that disagree",
        code::REFUSED => "a peer's refusal",
        code::PEER_STOPPED => "a peer that stopped",
        code::BAD_PEER_DATA => "a peer's value out of range",
        code::ABORTED => "an aborted communicator",
        _ => "unknown",
    }
}

/// What [`code::MISMATCH`] found different (`MOE_EP_FIELD_*`).
pub fn field_name(f: i32) -> &'static str {
    match f {
        1 => "topk",
        2 => "layout",
        3 => "alignment",
        desc::FIELD_OP => "op",
        5 => "recv_tokens",
        6 => "recv_topk_weights",
        7 => "recv_topk_idx",
        8 => "recv_src",
        9 => "expert_out",
        10 => "grad_recv_topk_weights",
        FIELD_PAYLOAD => "payload (bf16 or fp8 rows)",
        desc::FIELD_HANDLE => "handle",
        FIELD_COUNTS => "count row",
        FIELD_META => "expert-major row index (meta)",
        FIELD_NUM_TOKENS => "num_tokens",
        FIELD_RECV_SCALES => "recv_scales",
        FIELD_META_REPEATED => "expert-major row index (meta) repeated in a token",
        FIELD_BAD_ENTRY => "first bad topk_idx entry (a peer's report)",
        FIELD_SUBCHUNK_STARTS => "count row (its sub-chunk starts)",
        _ => "unknown field",
    }
}

/// `MOE_EP_FIELD_PAYLOAD`: the low-latency rows' payload (bf16 or fp8).
pub const FIELD_PAYLOAD: i32 = 11;
/// `MOE_EP_FIELD_COUNTS`: a peer's count row, out of range.
pub const FIELD_COUNTS: i32 = 13;
/// `MOE_EP_FIELD_META`: an expert-major row index a sender wrote.
pub const FIELD_META: i32 = 14;
/// `MOE_EP_FIELD_NUM_TOKENS`: a low-latency sender's token count.
pub const FIELD_NUM_TOKENS: i32 = 15;
/// `MOE_EP_FIELD_RECV_SCALES`: dispatch's descriptor word 5, where the fp8
/// scales land.
pub const FIELD_RECV_SCALES: i32 = 16;
/// `MOE_EP_FIELD_META_REPEATED`: an expert-major row index a sender wrote
/// twice for one token.
pub const FIELD_META_REPEATED: i32 = 17;
/// `MOE_EP_FIELD_BAD_ENTRY`: a peer's first-bad-entry word (a count row's
/// tail, a low-latency signal) that names no error.
pub const FIELD_BAD_ENTRY: i32 = 18;
/// `MOE_EP_FIELD_SUBCHUNK_STARTS`: a count row's sub-chunk starts that
/// fall, or pass the rows they split.
pub const FIELD_SUBCHUNK_STARTS: i32 = 19;

/// The arguments a refusal names (the id a refused call's descriptor
/// carries, `MOE_EP_OP_REFUSED`): index 0 is "an argument" (one not in
/// the table).
pub const ARG_NAMES: [&str; 41] = [
    "an argument",
    "x",
    "topk_weights",
    "topk_idx",
    "topk",
    "layout",
    "recv_tokens",
    "recv_topk_weights",
    "expert_out",
    "weights",
    "out",
    "grad_out",
    "grad_expert_out",
    "grad_recv_tokens",
    "grad_recv_topk_weights",
    "grad_tokens",
    "grad_topk_weights",
    "handle",
    "stream",
    "x_scales",
    "cast_fp8",
    "hidden",
    "mode",
    "op",
    "recv_topk_idx",
    "recv_src",
    "len",
    "group",
    "alignment",
    "capacity",
    "num_tokens",
    "payload",
    "x.codes",
    "x.scales",
    "recv_codes",
    "recv_scales",
    // The C ABI's own names (its fp8 arrays, codes and the args struct).
    "codes",
    "scales",
    "scale_kind",
    "topk_idx_dtype",
    "args",
];

/// The id of argument `name` in [`ARG_NAMES`] (0 for one not there).
pub fn arg_id(name: &str) -> u64 {
    ARG_NAMES.iter().position(|&n| n == name).unwrap_or(0) as u64
}

/// The name of argument id `id` ([`ARG_NAMES`]).
///
/// Every argument an op's host checks can refuse is in the table (the unit
/// test `every_refusable_argument_has_an_id` reads the sources for them).
pub fn arg_name(id: u64) -> &'static str {
    ARG_NAMES.get(id as usize).copied().unwrap_or(ARG_NAMES[0])
}

/// Words of an op call's descriptor (`MOE_EP_DESC_WORDS`).
pub const DESC_WORDS: usize = 7;

/// An op call's descriptor (`MOE_EP_FIELD_OP` in abi.cuh): what every rank
/// publishes to the others at the call's start, and the kernels compare
/// before they write to or read from a peer's buffers.
pub mod desc {
    /// `MOE_EP_FIELD_OP`: descriptor word 0; fields of the other words follow.
    pub const FIELD_OP: i32 = 4;
    pub const OP_DISPATCH: u64 = 1;
    pub const OP_COMBINE_BWD: u64 = 2;
    pub const OP_COMBINE: u64 = 3;
    pub const OP_DISPATCH_BWD: u64 = 4;
    pub const OP_LAYOUT: u64 = 5;
    /// Word 0 of a refused call: `OP_REFUSED | op << 8 | argument << 16`.
    pub const OP_REFUSED: u64 = 6;
    /// Word 0 of a call skipped after an error: `OP_STOPPED | code << 8`.
    pub const OP_STOPPED: u64 = 7;
    /// `MOE_EP_FIELD_HANDLE`: descriptor word 6, the handle's id.
    pub const FIELD_HANDLE: i32 = 12;
    /// The descriptor word of the handle's id (`MOE_EP_DESC_HANDLE`).
    pub const HANDLE_WORD: usize = 6;
    /// A buffer that travels through the stage (not read in place).
    pub const PUSHED: u64 = 1 << 63;
    /// Bits of the byte offset in a place word (the window id above them).
    pub const OFFSET_BITS: u32 = 40;

    /// Dispatch: word 0's second byte, the rows' payload
    /// (`MOE_EP_DESC_PAYLOAD_*`).
    pub const PAYLOAD_BF16: u64 = 0;
    pub const PAYLOAD_FP8_E8M0_32: u64 = 1;
    pub const PAYLOAD_FP8_F32_128: u64 = 2;

    /// The op a descriptor's word 0 names.
    pub fn op_name(v: u64) -> &'static str {
        match v {
            OP_DISPATCH => "dispatch",
            v if v == OP_DISPATCH | PAYLOAD_FP8_E8M0_32 << 8 => "dispatch (fp8, e8m0 per 32)",
            v if v == OP_DISPATCH | PAYLOAD_FP8_F32_128 << 8 => "dispatch (fp8, f32 per 128)",
            OP_COMBINE_BWD => "combine_backward",
            OP_COMBINE => "combine",
            OP_DISPATCH_BWD => "dispatch_backward",
            OP_LAYOUT => "layout",
            _ => "unknown op",
        }
    }

    /// A place word, for an error message.
    pub fn place(v: u64) -> String {
        match v {
            0 => "none (or read on its own rank and pushed)".to_string(),
            PUSHED => "pushed through the stage".to_string(),
            v => format!(
                "symmetric window #{} at byte {}",
                v >> OFFSET_BITS,
                v & ((1u64 << OFFSET_BITS) - 1)
            ),
        }
    }
}
/// Counters a wait can stall on (`MOE_EP_CTR_*`).
pub fn counter_name(c: i32) -> &'static str {
    match c {
        1 => "layout counts",
        2 => "dispatch done",
        3 => "combine done",
        4 => "bulk copy",
        5 => "combine pull handshake",
        6 => "op call descriptor",
        7 => "low-latency dispatch",
        8 => "low-latency combine",
        9 => "network hop arrival",
        10 => "network hop departure (the node combine's chunk)",
        _ => "unknown",
    }
}

/// First device-side error, written by kernels into host-mapped memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorInfo {
    pub code: i32,
    pub rank: i32,
    pub peer: i32,
    pub counter: i32,
    pub expected: u64,
    pub seen: u64,
    pub needed: u64,
    pub capacity: u64,
    pub _pad: [u64; 2],
}

/// Per-handle layout arrays (device addresses, local).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LayoutBufs {
    pub topk: u64,
    pub rank_pos: u64,
    pub expert_pos: u64,
    pub info: u64,
    pub meta: u64,
}

/// Byte offsets of the group's symmetric workspace regions.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Workspace {
    pub counts_off: u64,
    pub count_flag_off: u64,
    pub dispatch_done_off: u64,
    pub combine_done_off: u64,
    pub stage_off: u64,
    pub stage_w_off: u64,
    pub seq_off: u64,
    pub stage_rows: u64,
    pub pull_flag_off: u64,
    /// `[2 parity][MAX_RANKS][8]` u64: op call descriptors.
    pub desc_off: u64,
}

/// How received rows are laid out (`LayoutKind` in abi.cuh); the kernels'
/// view of [`RecvLayout`](crate::RecvLayout).
#[repr(i32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LayoutKind {
    /// One row per (token, destination rank).
    #[default]
    RankMajor = 0,
    /// One row per (token, local expert), in padded per-expert blocks.
    ExpertMajor = 1,
}

/// What every op's parameters share (`OpCommon` in abi.cuh): the group's
/// resources, the handle's layout arrays and the call's shape.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct OpCommon {
    /// The handle's arrays (local).
    pub bufs: LayoutBufs,
    /// Workspace base as mapped here, per rank.
    pub ws: [u64; MAX_RANKS],
    pub w: Workspace,
    /// Host-mapped [`ErrorInfo`].
    pub error: u64,
    /// Bound on every wait for another GPU.
    pub timeout_ns: u64,
    pub rank: i32,
    pub world: i32,
    pub num_tokens: i32,
    pub hidden: i32,
    pub topk: i32,
    pub num_experts: i32,
    pub layout: LayoutKind,
    /// Expert-major padding (1 for rank-major).
    pub alignment: i32,
    /// Rows on every rank.
    pub recv_capacity: i32,
    /// Grid of the data kernels, the same on every rank.
    pub num_blocks: i32,
}

/// `moe_ep_layout_scan_{i32,i64}`, `_exchange`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LayoutParams {
    pub op: OpCommon,
    pub topk_idx: u64,
    /// The overflow policy: 0 error, 1 drop rows beyond the capacity.
    pub drop: i32,
    /// Fault tests only (0 otherwise): this rank's count row goes out with
    /// word `(count_fault >> 16) - 1` replaced by the low 16 bits, signed.
    pub count_fault: i32,
}

/// `moe_ep_publish_refusal` (`layout.cu`): the descriptor of a call this
/// rank's host refused (or skipped after an error), published to every
/// peer once the kernel has counted the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RefusalParams {
    pub op: OpCommon,
    pub desc: [u64; DESC_WORDS],
    pub _pad: u64,
}

/// Dispatch and combine backward (`dispatch.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DispatchParams {
    pub op: OpCommon,
    pub x: u64,
    pub topk_w: u64,
    pub scale_w: u64,
    pub recv_x: [u64; MAX_RANKS],
    pub recv_w: [u64; MAX_RANKS],
    pub recv_idx: [u64; MAX_RANKS],
    pub recv_src: [u64; MAX_RANKS],
    /// This call's descriptor: op, then where `recv_x`, `recv_w`,
    /// `recv_idx`, `recv_src` lie here ([`desc`]).
    pub desc: [u64; DESC_WORDS],
    /// Expert-major: every rank's `LayoutBufs::meta` as mapped here (the
    /// senders write it); zeros for rank-major.
    pub meta: [u64; MAX_RANKS],
    /// Rows that arrive while the kernel runs (the two-level forward batch,
    /// chunk by chunk), or 0: row `t` is read once
    /// `arrive[arrive_of[t]] >= arrive_epoch` (`arrive_of[t] < 0`: already
    /// here); `arrive_peer[c]` sends chunk `c`.
    pub arrive: u64,
    pub arrive_of: u64,
    pub arrive_peer: u64,
    pub arrive_epoch: u64,
    /// fp8 rows: `[T, scale_words]` u32 scales beside the rows, or 0.
    pub xs: u64,
    /// Every rank's receive scales `[rows, scale_words]` as mapped here.
    pub recv_xs: [u64; MAX_RANKS],
    /// 16-byte vectors per row (fp8: `H / 16`); 0 = bf16 rows (`H / 8`).
    pub row16: i32,
    /// 4-byte scale words per row (fp8: `H / 128`); 0 = none.
    pub scale_words: i32,
    /// Expert-major: 1 = padding rows' vectors and scales zeroed.
    pub zero_pad: i32,
    pub _pad: i32,
}

/// Combine and dispatch backward (`combine_pull.cu`, `combine_push.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CombineParams {
    pub op: OpCommon,
    pub y: u64,
    pub w_rows: u64,
    pub grad_w_in: u64,
    pub out: u64,
    pub grad_w_out: u64,
    /// `y` as mapped here, per rank, for the pulled kernels; all zero for
    /// the pushed ones.
    pub y_peers: [u64; MAX_RANKS],
    /// `grad_w_in` as mapped here, per rank, for the pulled dispatch backward.
    pub gw_peers: [u64; MAX_RANKS],
    /// Pushed kernels: 1, 2, 4, 8 or 16 chunks combine pipelines its push and
    /// reduction over.
    pub num_chunks: i32,
    pub _pad: i32,
    /// This call's descriptor: op, where `y` lies when read in place (0:
    /// pushed), where `grad_w_in` lies when read in place
    /// ([`desc::PUSHED`]: pushed, 0: none).
    pub desc: [u64; DESC_WORDS],
    /// The two-level combine's progress counters (0: not counted): a warp
    /// that stored vectors of home row `t` adds how many to
    /// `done[done_of[t]]` (`done_of[t] < 0`: not counted).
    pub done: u64,
    pub done_of: u64,
}

/// Buffer sets of a low-latency group (`MOE_EP_LL_SETS`).
pub const LL_SETS: usize = 2;
/// Largest `max_tokens_per_rank` of a low-latency group (`MOE_EP_LL_MAX_TOKENS`).
pub const LL_MAX_TOKENS: usize = 1024;
/// Values per fp8 scale (`MOE_EP_FP8_BLOCK`).
pub const FP8_BLOCK: usize = 128;
/// `LlParams::payload` (`MOE_EP_LL_BF16`, `MOE_EP_LL_FP8`).
pub mod ll_payload {
    pub const BF16: i32 = 0;
    pub const FP8: i32 = 1;
}
/// `LlParams::cast` (`MOE_EP_LL_CAST_*`).
pub mod ll_cast {
    pub const NONE: i32 = 0;
    pub const EXACT: i32 = 1;
    pub const POW2: i32 = 2;
}

/// One low-latency sender block's signal to one receiver (`LlSignal`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LlSignal {
    pub seq: u64,
    pub bad: u64,
    pub num_tokens: i32,
    pub topk: i32,
    pub payload: i32,
    pub layout: i32,
}

/// The low-latency buffers as the kernels see them (`LlBufs` in abi.cuh):
/// base addresses, the bytes of one set, and each region's byte offset
/// inside a set (see `src/ops/low_latency/` for the sizes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LlBufs {
    /// The symmetric buffer as mapped here, per rank.
    pub sym: [u64; MAX_RANKS],
    /// This rank's local buffer.
    pub local: u64,
    pub sym_set_bytes: u64,
    pub local_set_bytes: u64,
    pub sig_dispatch: u64,
    pub sig_combine: u64,
    pub recv_x: u64,
    pub recv_scales: u64,
    pub recv_src: u64,
    pub recv_idx: u64,
    pub recv_w: u64,
    pub comb: u64,
    pub em_x: u64,
    pub em_scales: u64,
    pub em_src: u64,
    pub counts: u64,
    pub home_topk: u64,
    pub home_w: u64,
    pub set_seq: u64,
    /// From the local base, after both sets.
    pub counters: u64,
    /// Local set again: staged expert-major rows, their offsets, the
    /// receive's last-block ticket.
    pub em_stage: u64,
    pub em_off: u64,
    pub ticket: u64,
    /// Expert-major: this rank's token slot -> its row here (local experts).
    pub home_row: u64,
}

/// Every low-latency kernel's parameters (`LlParams`, `low_latency.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LlParams {
    pub op: OpCommon,
    pub b: LlBufs,
    pub x: u64,
    pub x_scales: u64,
    pub topk_idx: u64,
    pub topk_w: u64,
    pub y: u64,
    pub comb_w: u64,
    pub out: u64,
    pub set: i32,
    pub max_tokens: i32,
    pub payload: i32,
    pub cast: i32,
    /// Combine: rows homed on this rank are read in `y` by the sum (the
    /// one-call combine only).
    pub in_place: i32,
    /// Sends (dispatch and combine): 0, or 1 + the id of the argument this
    /// rank's host refused ([`ARG_NAMES`]): the send moves no rows and tells
    /// every peer.
    pub refuse: i32,
    /// Fault tests only (0 otherwise): the dispatch send's token count as
    /// every receiver's signal says it, instead of `T`.
    pub tokens_fault: i32,
    pub _pad: i32,
}

/// Word offsets inside `LayoutBufs::info` (`info_offsets` in abi.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InfoOffsets {
    pub counts: usize,
    pub dst_u_off: usize,
    pub erow_base: usize,
    pub src_u_off: usize,
    pub my_slot_on: usize,
    pub home_slot: usize,
    pub expert_start: usize,
    pub expert_count: usize,
    pub rows_needed: usize,
    pub dropped: usize,
    pub bad: usize,
    pub total: usize,
}

/// Same arithmetic as `info_offsets` in abi.cuh.
pub fn info_offsets(r: usize, e: usize, el: usize) -> InfoOffsets {
    let counts = 0;
    let dst_u_off = counts + r * count_row(r, e);
    let erow_base = dst_u_off + r;
    let src_u_off = erow_base + e;
    let my_slot_on = src_u_off + r + 1;
    let home_slot = my_slot_on + r;
    let expert_start = home_slot + r + 1;
    let expert_count = expert_start + el + 1;
    let rows_needed = expert_count + el;
    let dropped = rows_needed + r;
    let bad = (dropped + r).div_ceil(2) * 2;
    let total = bad + 2;
    InfoOffsets {
        counts,
        dst_u_off,
        erow_base,
        src_u_off,
        my_slot_on,
        home_slot,
        expert_start,
        expert_count,
        rows_needed,
        dropped,
        bad,
        total,
    }
}

/// Check blocks of the layout scan, one token per thread, 1 when `t = 0`
/// (`layout_check_blocks` in abi.cuh). Each writes its own bad-entry word
/// at `InfoOffsets::bad`.
pub fn layout_check_blocks(t: usize) -> usize {
    t.div_ceil(SCAN_THREADS as usize).max(1)
}

/// Words of a handle's info array at `t` tokens: the fixed words, then one
/// more bad-entry word (two i32) per check block after the first.
pub fn layout_info_len(r: usize, e: usize, el: usize, t: usize) -> usize {
    info_offsets(r, e, el).total + 2 * (layout_check_blocks(t) - 1)
}

/// Most nodes of a two-level world (`MOE_EP_MAX_NODES`).
pub const MAX_NODES: usize = 64;

/// Every two-level kernel (`two_level.cu`): node `m`'s row of home token `t`
/// is row `row_off[m] + pos[t][m]` of the `own_*` arrays (`m` this rank's
/// node) or the `net_*` arrays (a remote node).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TwoLevelParams {
    pub topk_idx: u64,
    pub x: u64,
    pub topk_w: u64,
    pub pos: u64,
    pub lens: u64,
    pub own_ids: u64,
    pub net_ids: u64,
    pub own_origin: u64,
    pub net_origin: u64,
    pub own_x: u64,
    pub net_x: u64,
    pub own_w: u64,
    pub net_w: u64,
    pub out: u64,
    pub out_w: u64,
    pub recv_src: u64,
    pub src_in: u64,
    pub origin_peers: [u64; MAX_RANKS],
    pub row_off: [i32; MAX_NODES],
    pub num_tokens: i32,
    pub topk: i32,
    pub hidden: i32,
    pub num_experts: i32,
    pub nodes: i32,
    pub node: i32,
    pub home_rank: i32,
    pub recv_rows: i32,
    pub node_world: i32,
    pub origin_rows: i32,
}

impl Default for TwoLevelParams {
    fn default() -> Self {
        TwoLevelParams {
            topk_idx: 0,
            x: 0,
            topk_w: 0,
            pos: 0,
            lens: 0,
            own_ids: 0,
            net_ids: 0,
            own_origin: 0,
            net_origin: 0,
            own_x: 0,
            net_x: 0,
            own_w: 0,
            net_w: 0,
            out: 0,
            out_w: 0,
            recv_src: 0,
            src_in: 0,
            origin_peers: [0; MAX_RANKS],
            row_off: [0; MAX_NODES],
            num_tokens: 0,
            topk: 0,
            hidden: 0,
            num_experts: 0,
            nodes: 0,
            node: 0,
            home_rank: 0,
            recv_rows: 0,
            node_world: 0,
            origin_rows: 0,
        }
    }
}

/// `moe_ep_two_level_wait_chunks`: one round of the two-level combine's
/// hop waits until `done[chunk[i]] >= need[i]` for `i < count` (the node
/// combine's [`CombineParams::done`]); `op` is the node group's (error
/// sink, timeout, rank), `peer[i]` the rail peer chunk `i` goes to.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ChunkWaitParams {
    pub op: OpCommon,
    pub done: u64,
    pub count: i32,
    pub _pad: i32,
    pub chunk: [i32; MAX_NODES],
    pub peer: [i32; MAX_NODES],
    pub need: [u64; MAX_NODES],
}

// The same numbers abi.cuh static_asserts.
const _: () = assert!(std::mem::size_of::<ErrorInfo>() == 64);
const _: () = assert!(std::mem::size_of::<LayoutBufs>() == 40);
const _: () = assert!(std::mem::size_of::<Workspace>() == 80);
const _: () = assert!(std::mem::size_of::<LayoutKind>() == 4);
const _: () = assert!(std::mem::size_of::<OpCommon>() == 240);
const _: () = assert!(std::mem::size_of::<LayoutParams>() == 256);
const _: () = assert!(std::mem::size_of::<RefusalParams>() == 304);
const _: () = assert!(std::mem::size_of::<DispatchParams>() == 760);
const _: () = assert!(std::mem::size_of::<CombineParams>() == 488);
const _: () = assert!(std::mem::size_of::<LlSignal>() == 32);
const _: () = assert!(std::mem::size_of::<LlBufs>() == 248);
const _: () = assert!(std::mem::size_of::<LlParams>() == 576);
const _: () = assert!(std::mem::size_of::<TwoLevelParams>() == 496);
const _: () = assert!(std::mem::size_of::<ChunkWaitParams>() == 1280);

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// The buffers the ops' hosts check (`check_region("name", ...)`) are
    /// named to the peers of a refused call: each has an id.
    #[test]
    fn every_refusable_argument_has_an_id() {
        let sources = [
            include_str!("node/turn.rs"),
            include_str!("node/dispatch_op.rs"),
            include_str!("node/combine_op.rs"),
            include_str!("node/layout_op.rs"),
            include_str!("low_latency/ops.rs"),
        ];
        let mut seen = 0;
        for src in sources {
            for call in src.split("check_region(").skip(1) {
                let Some(name) = call.trim_start().strip_prefix('"') else {
                    continue; // the definition, or a name held in a variable
                };
                let name = &name[..name.find('"').unwrap()];
                assert_ne!(arg_id(name), 0, "`{name}` has no id in ARG_NAMES");
                seen += 1;
            }
        }
        assert!(
            seen > 20,
            "only {seen} checks found: has check_region moved?"
        );
        assert!(
            ARG_NAMES
                .iter()
                .enumerate()
                .all(|(i, n)| arg_id(n) == i as u64),
            "a name twice in ARG_NAMES"
        );
    }

    /// Offsets worked out by hand from the C layout rules (8-byte pointers).
    #[test]
    fn param_offsets_match_the_c_layout() {
        assert_eq!(offset_of!(OpCommon, ws), 40);
        assert_eq!(offset_of!(OpCommon, w), 104);
        assert_eq!(offset_of!(OpCommon, error), 184);
        assert_eq!(offset_of!(OpCommon, timeout_ns), 192);
        assert_eq!(offset_of!(OpCommon, rank), 200);
        assert_eq!(offset_of!(OpCommon, layout), 224);
        assert_eq!(offset_of!(OpCommon, num_blocks), 236);
        assert_eq!(offset_of!(RefusalParams, desc), 240);
        assert_eq!(offset_of!(LayoutParams, topk_idx), 240);
        assert_eq!(offset_of!(DispatchParams, x), 240);
        assert_eq!(offset_of!(DispatchParams, scale_w), 256);
        assert_eq!(offset_of!(DispatchParams, recv_x), 264);
        assert_eq!(offset_of!(DispatchParams, recv_src), 456);
        assert_eq!(offset_of!(DispatchParams, desc), 520);
        assert_eq!(offset_of!(DispatchParams, meta), 576);
        assert_eq!(offset_of!(DispatchParams, arrive), 640);
        assert_eq!(offset_of!(DispatchParams, arrive_epoch), 664);
        assert_eq!(offset_of!(DispatchParams, xs), 672);
        assert_eq!(offset_of!(DispatchParams, recv_xs), 680);
        assert_eq!(offset_of!(DispatchParams, row16), 744);
        assert_eq!(offset_of!(DispatchParams, zero_pad), 752);
        assert_eq!(offset_of!(CombineParams, y), 240);
        assert_eq!(offset_of!(CombineParams, out), 264);
        assert_eq!(offset_of!(CombineParams, y_peers), 280);
        assert_eq!(offset_of!(CombineParams, gw_peers), 344);
        assert_eq!(offset_of!(CombineParams, num_chunks), 408);
        assert_eq!(offset_of!(CombineParams, desc), 416);
        assert_eq!(offset_of!(CombineParams, done), 472);
        assert_eq!(offset_of!(ChunkWaitParams, done), 240);
        assert_eq!(offset_of!(ChunkWaitParams, chunk), 256);
        assert_eq!(offset_of!(ChunkWaitParams, need), 768);
        assert_eq!(offset_of!(LlBufs, local), 64);
        assert_eq!(offset_of!(LlBufs, sig_dispatch), 88);
        assert_eq!(offset_of!(LlBufs, em_x), 152);
        assert_eq!(offset_of!(LlBufs, counters), 208);
        assert_eq!(offset_of!(LlBufs, ticket), 232);
        assert_eq!(offset_of!(LlParams, b), 240);
        assert_eq!(offset_of!(LlParams, x), 488);
        assert_eq!(offset_of!(LlParams, out), 536);
        assert_eq!(offset_of!(LlParams, set), 544);
        assert_eq!(offset_of!(LlParams, in_place), 560);
        assert_eq!(offset_of!(TwoLevelParams, src_in), 128);
        assert_eq!(offset_of!(TwoLevelParams, origin_peers), 136);
        assert_eq!(offset_of!(TwoLevelParams, row_off), 200);
        assert_eq!(offset_of!(TwoLevelParams, num_tokens), 456);
        assert_eq!(offset_of!(TwoLevelParams, recv_rows), 484);
        assert_eq!(offset_of!(TwoLevelParams, origin_rows), 492);
    }

    /// The constants mirrored from abi.cuh's `#define`s have the same values.
    #[test]
    fn constants_match_abi_cuh() {
        let text = include_str!("../../kernels-cuda/abi.cuh");
        let define = |name: &str| -> String {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("abi.cuh has no #define {name}"));
            line[format!("#define {name} ").len()..]
                .split("//")
                .next()
                .unwrap()
                .trim()
                .to_string()
        };
        assert_eq!(define("MOE_EP_MAX_RANKS"), MAX_RANKS.to_string());
        assert_eq!(define("MOE_EP_MAX_NODES"), MAX_NODES.to_string());
        assert_eq!(define("MOE_EP_MAX_BLOCKS"), MAX_BLOCKS.to_string());
        assert_eq!(define("MOE_EP_MAX_TOPK"), MAX_TOPK.to_string());
        assert_eq!(define("MOE_EP_THREADS"), THREADS.to_string());
        assert_eq!(define("MOE_EP_SUBCHUNKS"), SUBCHUNKS.to_string());
        assert_eq!(define("MOE_EP_SCAN_EXPERTS"), SCAN_EXPERTS.to_string());
        assert_eq!(define("MOE_EP_SCAN_THREADS"), SCAN_THREADS.to_string());
        assert_eq!(define("MOE_EP_LL_SETS"), LL_SETS.to_string());
        assert_eq!(define("MOE_EP_LL_MAX_TOKENS"), LL_MAX_TOKENS.to_string());
        assert_eq!(define("MOE_EP_FP8_BLOCK"), FP8_BLOCK.to_string());
        assert_eq!(define("MOE_EP_LL_BF16"), ll_payload::BF16.to_string());
        assert_eq!(define("MOE_EP_LL_FP8"), ll_payload::FP8.to_string());
        assert_eq!(define("MOE_EP_LL_CAST_NONE"), ll_cast::NONE.to_string());
        assert_eq!(define("MOE_EP_LL_CAST_EXACT"), ll_cast::EXACT.to_string());
        assert_eq!(define("MOE_EP_LL_CAST_POW2"), ll_cast::POW2.to_string());
        assert_eq!(define("MOE_EP_CTR_DESCRIPTOR"), "6");
        assert_eq!(counter_name(6), "op call descriptor");
        assert_eq!(define("MOE_EP_CTR_LL_DISPATCH"), "7");
        assert_eq!(counter_name(7), "low-latency dispatch");
        assert_eq!(define("MOE_EP_CTR_LL_COMBINE"), "8");
        assert_eq!(counter_name(8), "low-latency combine");
        assert_eq!(define("MOE_EP_CTR_HOP_ARRIVAL"), "9");
        assert_eq!(counter_name(9), "network hop arrival");
        assert_eq!(define("MOE_EP_CTR_HOP_DEPARTURE"), "10");
        assert_eq!(
            counter_name(10),
            "network hop departure (the node combine's chunk)"
        );
        assert_eq!(define("MOE_EP_FIELD_PAYLOAD"), FIELD_PAYLOAD.to_string());
        assert_eq!(define("MOE_EP_FIELD_OP"), desc::FIELD_OP.to_string());
        assert_eq!(
            define("MOE_EP_FIELD_HANDLE"),
            desc::FIELD_HANDLE.to_string()
        );
        assert_eq!(define("MOE_EP_FIELD_COUNTS"), FIELD_COUNTS.to_string());
        assert_eq!(define("MOE_EP_FIELD_META"), FIELD_META.to_string());
        assert_eq!(
            define("MOE_EP_FIELD_META_REPEATED"),
            FIELD_META_REPEATED.to_string()
        );
        assert_eq!(
            define("MOE_EP_FIELD_BAD_ENTRY"),
            FIELD_BAD_ENTRY.to_string()
        );
        assert_eq!(
            define("MOE_EP_FIELD_SUBCHUNK_STARTS"),
            FIELD_SUBCHUNK_STARTS.to_string()
        );
        assert_eq!(
            define("MOE_EP_FIELD_NUM_TOKENS"),
            FIELD_NUM_TOKENS.to_string()
        );
        assert_eq!(define("MOE_EP_DESC_HANDLE"), desc::HANDLE_WORD.to_string());
        assert_eq!(define("MOE_EP_OP_LAYOUT"), desc::OP_LAYOUT.to_string());
        assert_eq!(define("MOE_EP_OP_REFUSED"), desc::OP_REFUSED.to_string());
        assert_eq!(define("MOE_EP_OP_STOPPED"), desc::OP_STOPPED.to_string());
        assert_eq!(define("MOE_EP_ERR_REFUSED"), code::REFUSED.to_string());
        assert_eq!(
            define("MOE_EP_ERR_PEER_STOPPED"),
            code::PEER_STOPPED.to_string()
        );
        assert_eq!(
            define("MOE_EP_ERR_BAD_PEER_DATA"),
            code::BAD_PEER_DATA.to_string()
        );
        assert_eq!(define("MOE_EP_ERR_ABORTED"), code::ABORTED.to_string());
        assert_eq!(define("MOE_EP_DESC_WORDS"), DESC_WORDS.to_string());
        assert_eq!(define("MOE_EP_DESC_PUSHED"), "(1ull << 63)");
        assert_eq!(desc::PUSHED, 1u64 << 63);
        assert_eq!(define("MOE_EP_COMBINE_SMEM"), "(128 * 1024)");
        assert_eq!(COMBINE_SMEM, 128 * 1024);
        assert_eq!(define("MOE_EP_EM_COMBINE_SMEM"), "(200 * 1024)");
        assert_eq!(EM_COMBINE_SMEM, 200 * 1024);
        let kinds = "enum class LayoutKind : int32_t { RankMajor = 0, ExpertMajor = 1 };";
        assert!(text.contains(kinds), "abi.cuh: {kinds}");
        assert_eq!(LayoutKind::RankMajor as i32, 0);
        assert_eq!(LayoutKind::ExpertMajor as i32, 1);
    }

    #[test]
    fn layout_check_blocks_take_one_token_per_thread() {
        let n = SCAN_THREADS as usize;
        assert_eq!(layout_check_blocks(0), 1);
        assert_eq!(layout_check_blocks(1), 1);
        assert_eq!(layout_check_blocks(n), 1);
        assert_eq!(layout_check_blocks(n + 1), 2);
        let fixed = info_offsets(2, 256, 128).total;
        assert_eq!(layout_info_len(2, 256, 128, n), fixed);
        assert_eq!(layout_info_len(2, 256, 128, 4 * n), fixed + 6);
    }

    #[test]
    fn info_offsets_are_contiguous() {
        let o = info_offsets(2, 256, 128);
        assert_eq!(o.dst_u_off, 2 * (256 + 2 * 16 + ROW_TAIL));
        // `bad` (a u64 the scan's atomics use) on an even word, last.
        assert_eq!(o.bad % 2, 0);
        assert_eq!(o.dropped, o.rows_needed + 2);
        assert!(o.bad >= o.dropped + 2 && o.bad <= o.dropped + 3);
        assert_eq!(o.total, o.bad + 2);
        assert_eq!(o.expert_count - o.expert_start, 129);
    }
}
