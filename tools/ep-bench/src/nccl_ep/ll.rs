//! NCCL EP's low-latency (LL) mode beside `--mode ll`.
//!
//! | ours | NCCL EP |
//! | --- | --- |
//! | `--mode ll --layout expert` | LL, expert-major: `[local experts, ranks * M, H]` |
//! | `--mode ll --layout rank` | LL, rank-major: `[ranks, M, H]` with `[ranks, M, K]` local expert ids and weights |
//!
//! Its rows: `nccl-ep-ll-dispatch` (bf16 rows), `nccl-ep-ll-dispatch-fp8`
//! (its `NCCL_EP_DISP_QUANT_DS_FP8E3M4` recipe: bf16 in, e4m3 codes and one
//! f32 scale per 128 values out, cast in its kernel; it needs hidden a
//! multiple of 512), `nccl-ep-ll-combine` (bf16 rows home, expert-major
//! weighted on the home rank with our weights) and `nccl-ep-ll-pair` (the
//! fp8 dispatch and the combine, timed together).
//!
//! Configuration ([`Runner::new`]): `ncclEpCreateGroup` with
//! `NCCL_EP_ALGO_LOW_LATENCY`, `max_dispatch_tokens_per_rank` = our tokens
//! (M), `max_token_bytes` = a bf16 row, `max_num_sms` = our SM count, its
//! buffers sized by itself (`NCCL_EP_AUTO`); one handle
//! (`ncclEpInitHandle` with the layout and top-k) given our routing once
//! (`ncclEpUpdateHandle`, as the routing does not change between runs);
//! every tensor plain device memory (no NCCL windows). Dispatch and combine
//! are one call each (`send_only` = 0; `ncclEpComplete` is not used).
//!
//! Cross-check ([`compare_dispatch`]): its counters (per local expert, or
//! per source rank) equal the reference's, and its rows are the reference's
//! rows matched by their bits inside each expert's (source rank's) block,
//! in any order (it places rows in arrival order); rank-major rows also
//! carry the same local expert ids and, where the expert is here, the same
//! weights. Its combine of its own rows (identity experts) is compared as
//! in the high-throughput mode ([`super::compare_combine`]).

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_ulong};
use std::sync::Arc;

use moe_ep::cuda::{CudaSlice, CudaStream};
use moe_ep::ops::{DeviceRegion, LlLayout};
use moe_ep::reference::{LlDispatchOutput, LlTokens};
use moe_ep::{bf16, Communicator};

use super::{ffi, measured, row_hash, same_bits, Desc, Inputs, Lib, MAX_HIDDEN, TIMEOUT_NS};
use crate::cli::{ll_layout, Case};
use crate::memory::NcclEpMemory;

/// `NCCL_EP_LAYOUT_RANK_MAJOR` (LL only).
const LAYOUT_RANK_MAJOR: c_int = 2;
/// `NCCL_EP_DISP_QUANT_DS_FP8E3M4`: e4m3 codes and f32 per-128 scales, cast in its kernel.
const QUANT_DS_FP8: c_int = 2;
/// `ncclFloat8e4m3`.
const NCCL_FLOAT8E4M3: c_int = 10;
/// Its LL kernels' row vector: hidden a multiple of this.
const HIDDEN_MULTIPLE: usize = 256;
/// Its fp8 cast's hidden multiple (the quantized row 16-byte aligned).
const FP8_HIDDEN_MULTIPLE: usize = 512;
/// Why its fp8 rows are left out.
pub const FP8_HIDDEN_WHY: &str =
    "its in-kernel fp8 cast (DS_FP8E3M4) needs hidden a multiple of 512";
/// Values per fp8 scale.
const FP8_BLOCK: usize = 128;

/// What of NCCL EP's LL mode stands beside a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pairing {
    /// Its layout: ours.
    pub layout: LlLayout,
    /// Whether its in-kernel fp8 cast takes this hidden size.
    pub fp8: bool,
}

/// What NCCL EP's LL mode runs beside `case` of `--mode ll`, or why nothing does.
pub fn pairing(case: &Case, world: usize) -> Result<Pairing, String> {
    if case.tokens == 0 {
        return Err("it needs at least one token per rank".into());
    }
    if !case.hidden.is_multiple_of(HIDDEN_MULTIPLE) {
        return Err(format!(
            "its LL kernels need hidden a multiple of {HIDDEN_MULTIPLE}, not {}",
            case.hidden
        ));
    }
    if case.hidden > MAX_HIDDEN {
        return Err(format!("its largest hidden size is {MAX_HIDDEN}"));
    }
    // Its dispatch's control warp asserts (a device trap) more than one SM.
    if case.num_sms < 2 {
        return Err("its LL kernels need at least 2 SMs".into());
    }
    if world > 32 {
        return Err("its LL kernels take at most 32 ranks".into());
    }
    Ok(Pairing {
        layout: ll_layout(case.layout),
        fp8: case.hidden.is_multiple_of(FP8_HIDDEN_MULTIPLE),
    })
}

/// The sizes of one case.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Tokens per rank (>= 1): also its `max_dispatch_tokens_per_rank`.
    pub tokens: usize,
    /// Hidden size (bf16 elements).
    pub hidden: usize,
    /// Top-k.
    pub topk: usize,
    /// Experts (all ranks).
    pub experts: usize,
    /// Ranks.
    pub world: usize,
    /// SMs (`max_num_sms`).
    pub num_sms: usize,
    /// What runs.
    pub pairing: Pairing,
}

impl Spec {
    /// Rows of its dispatch output: expert-major `E_local * R * M`, rank-major `R * M`.
    fn rows(&self) -> usize {
        let rm = self.world * self.tokens;
        match self.pairing.layout {
            LlLayout::ExpertMajor => self.experts / self.world * rm,
            LlLayout::RankMajor => rm,
        }
    }

    /// The leading two extents of its 3-D outputs.
    fn lead(&self) -> [usize; 2] {
        let (r, m) = (self.world, self.tokens);
        match self.pairing.layout {
            LlLayout::ExpertMajor => [self.experts / r, r * m],
            LlLayout::RankMajor => [r, m],
        }
    }
}

/// What its last bf16 dispatch received on this rank, on the host.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Received {
    /// Expert-major: `[E_local]` per-expert counts; rank-major `[R]` per source rank.
    pub counts: Vec<i32>,
    /// `[rows * H]` (only the received rows are defined).
    pub rows: Vec<bf16>,
    /// Rank-major `[rows * K]` local expert ids (-1: not here, or no row).
    pub idx: Option<Vec<i32>>,
    /// Rank-major `[rows * K]` weights.
    pub weights: Option<Vec<f32>>,
}

type R<T> = Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// A group and a handle of NCCL EP's LL mode for one case, with its buffers.
pub struct Runner {
    lib: &'static Lib,
    comm: ffi::ncclComm_t,
    group: ffi::ncclEpGroup_t,
    handle: ffi::ncclEpHandle_t,
    spec: Spec,
    stream: Arc<CudaStream>,
    /// What its group and handle took ([`crate::memory`]).
    memory: NcclEpMemory,
    // Descriptors: ours (idx, x, w), then its buffers'.
    idx: Box<Desc>,
    x: Box<Desc>,
    w: Box<Desc>,
    recv_x: Box<Desc>,
    recv_q: Option<Box<Desc>>,
    recv_s: Option<Box<Desc>>,
    recv_w: Option<Box<Desc>>,
    recv_idx: Option<Box<Desc>>,
    counts: Box<Desc>,
    out: Box<Desc>,
    // Its buffers (freed after the handle and group: Drop runs first).
    recv_x_buf: CudaSlice<bf16>,
    _recv_q_buf: Option<CudaSlice<u8>>,
    _recv_s_buf: Option<CudaSlice<f32>>,
    recv_w_buf: Option<CudaSlice<f32>>,
    recv_idx_buf: Option<CudaSlice<i32>>,
    counts_buf: CudaSlice<i32>,
    out_buf: CudaSlice<bf16>,
}

impl Runner {
    /// Creates the group and the handle (collective: every rank, in the
    /// same order), gives it the routing, and allocates the buffers.
    ///
    /// # Safety
    /// `inputs` must stay valid device memory of `stream`'s GPU, of the
    /// sizes `spec` gives, for the life of the runner.
    pub unsafe fn new(
        lib: &'static Lib,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        spec: Spec,
        inputs: Inputs,
    ) -> R<Runner> {
        let raw = comm.raw().ok_or("no NCCL communicator (virtual ranks)")? as ffi::ncclComm_t;
        let (t, h, k) = (spec.tokens, spec.hidden, spec.topk);
        let (rows, [a, b]) = (spec.rows(), spec.lead());
        let rm = spec.pairing.layout == LlLayout::RankMajor;
        let fp8 = spec.pairing.fp8;
        let alloc = |what: &'static str| move |e| format!("NCCL EP LL {what} ({rows} rows): {e}");
        let recv_x_buf = stream
            .alloc_zeros::<bf16>(rows * h)
            .map_err(alloc("receive buffer"))?;
        let recv_q_buf = match fp8 {
            true => Some(
                stream
                    .alloc_zeros::<u8>(rows * h)
                    .map_err(alloc("fp8 receive buffer"))?,
            ),
            false => None,
        };
        let recv_s_buf = match fp8 {
            true => Some(
                stream
                    .alloc_zeros::<f32>(rows * (h / FP8_BLOCK))
                    .map_err(s)?,
            ),
            false => None,
        };
        let recv_w_buf = match rm {
            true => Some(stream.alloc_zeros::<f32>(rows * k).map_err(s)?),
            false => None,
        };
        let recv_idx_buf = match rm {
            true => Some(stream.alloc_zeros::<i32>(rows * k).map_err(s)?),
            false => None,
        };
        let counters = if rm { a } else { spec.experts / spec.world };
        let counts_buf = stream.alloc_zeros::<i32>(counters).map_err(s)?;
        let out_buf = stream.alloc_zeros::<bf16>(t * h).map_err(s)?;
        let at = |p: u64, dt: c_int, dims: &[usize]| Desc::new(dt, p, dims);
        let mut r = Runner {
            lib,
            comm: raw,
            group: std::ptr::null_mut(),
            handle: std::ptr::null_mut(),
            spec,
            stream: stream.clone(),
            memory: NcclEpMemory::default(),
            idx: at(inputs.topk_idx, ffi::NCCL_INT64, &[t, k]),
            x: at(inputs.x, ffi::NCCL_BFLOAT16, &[t, h]),
            w: at(inputs.w, ffi::NCCL_FLOAT32, &[t, k]),
            recv_x: at(recv_x_buf.device_ptr(), ffi::NCCL_BFLOAT16, &[a, b, h]),
            recv_q: recv_q_buf
                .as_ref()
                .map(|q| at(q.device_ptr(), NCCL_FLOAT8E4M3, &[a, b, h])),
            recv_s: recv_s_buf
                .as_ref()
                .map(|q| at(q.device_ptr(), ffi::NCCL_FLOAT32, &[a, b, h / FP8_BLOCK])),
            recv_w: recv_w_buf
                .as_ref()
                .map(|q| at(q.device_ptr(), ffi::NCCL_FLOAT32, &[a, b, k])),
            recv_idx: recv_idx_buf
                .as_ref()
                .map(|q| at(q.device_ptr(), ffi::NCCL_INT32, &[a, b, k])),
            counts: at(counts_buf.device_ptr(), ffi::NCCL_INT32, &[counters]),
            out: at(out_buf.device_ptr(), ffi::NCCL_BFLOAT16, &[t, h]),
            recv_x_buf,
            _recv_q_buf: recv_q_buf,
            _recv_s_buf: recv_s_buf,
            recv_w_buf,
            recv_idx_buf,
            counts_buf,
            out_buf,
        };
        // The buffers are zeroed on the stream: done before its streams use them.
        stream.synchronize().map_err(s)?;
        let cfg = ffi::GroupConfig {
            size: std::mem::size_of::<ffi::GroupConfig>() as c_uint,
            magic: ffi::MAGIC,
            version: ffi::API_VERSION,
            algorithm: ffi::ALGO_LOW_LATENCY,
            num_experts: spec.experts as c_uint,
            max_dispatch_tokens_per_rank: t as c_uint,
            // LL: unused, sized by itself.
            max_recv_tokens_per_rank: 0,
            max_token_bytes: (h * 2) as c_uint,
            rdma_buffer_size: 0 as c_ulong,
            num_qp_per_rank: 0,
            num_channels: 0,
            max_num_sms: spec.num_sms as c_uint,
            alloc: ffi::AllocConfig {
                alloc_fn: std::ptr::null_mut(),
                free_fn: std::ptr::null_mut(),
                context: std::ptr::null_mut(),
            },
            enable_mask: 0,
            timeout_ns: TIMEOUT_NS,
            zero_copy: 0,
            overflow_policy: 0,
            num_topk: k as c_uint,
            padding_v2: [0; 4],
        };
        let ((), taken) = measured(stream, || {
            // SAFETY: a valid config and out-pointer; raw is moe-ep's live communicator.
            let rc = unsafe { (lib.create_group)(&mut r.group, raw, &cfg) };
            lib.check("ncclEpCreateGroup (LL)", rc, raw)
        })?;
        r.memory.group_measured = taken;
        let hcfg = ffi::HandleConfig {
            size: std::mem::size_of::<ffi::HandleConfig>() as c_uint,
            magic: ffi::MAGIC,
            dispatch_output_per_expert_alignment: 0,
        };
        let layout = if rm {
            LAYOUT_RANK_MAJOR
        } else {
            ffi::LAYOUT_EXPERT_MAJOR
        };
        r.memory.handle_queried = lib.handle_mem_size(r.group, layout, &hcfg, k);
        let ((), taken) = measured(stream, || {
            // SAFETY: a live group, a valid config; collective (its buffers
            // may be sized here).
            let rc = unsafe {
                (lib.init_handle)(
                    &mut r.handle,
                    r.group,
                    layout,
                    &hcfg,
                    k as c_int,
                    std::ptr::null(),
                )
            };
            lib.check("ncclEpInitHandle (LL)", rc, raw)
        })?;
        r.memory.init_handle_measured = taken;
        let st = r.stream.cu_stream() as ffi::cudaStream_t;
        // SAFETY: live handle, a descriptor of our routing; LL takes no layout info.
        let rc = unsafe { (lib.update_handle)(r.handle, r.idx.ptr(), std::ptr::null(), st) };
        lib.check("ncclEpUpdateHandle (LL)", rc, raw)?;
        Ok(r)
    }

    fn stream_ptr(&self) -> ffi::cudaStream_t {
        self.stream.cu_stream() as ffi::cudaStream_t
    }

    /// What its group and handle took on this rank ([`crate::memory`]).
    pub fn memory(&self) -> NcclEpMemory {
        self.memory
    }

    fn rank_major(&self) -> bool {
        self.spec.pairing.layout == LlLayout::RankMajor
    }

    /// Its LL dispatch of our `x` (and, rank-major, our weights), bf16 rows
    /// or (`fp8`) cast to e4m3 in its kernel.
    pub fn dispatch(&mut self, fp8: bool) -> R<()> {
        if fp8 && self.recv_q.is_none() {
            return Err(FP8_HIDDEN_WHY.into());
        }
        let rm = self.rank_major();
        let null = std::ptr::null_mut;
        let inputs = ffi::Inputs {
            size: std::mem::size_of::<ffi::Inputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.x.ptr(),
            topk_weights: if rm { self.w.ptr() } else { null() },
            scales: null(),
        };
        let (tokens, scales) = match (fp8, &mut self.recv_q, &mut self.recv_s) {
            (true, Some(q), Some(sc)) => (q.ptr(), sc.ptr()),
            _ => (self.recv_x.ptr(), null()),
        };
        let outputs = ffi::DispatchOutputs {
            size: std::mem::size_of::<ffi::DispatchOutputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens,
            topk_weights: self.recv_w.as_mut().map_or(null(), |d| d.ptr()),
            scales,
            topk_idx: self.recv_idx.as_mut().map_or(null(), |d| d.ptr()),
        };
        let info = ffi::LayoutInfo {
            size: std::mem::size_of::<ffi::LayoutInfo>() as c_uint,
            magic: ffi::MAGIC,
            expert_counters: if rm { null() } else { self.counts.ptr() },
            src_rank_counters: if rm { self.counts.ptr() } else { null() },
            expert_offsets: null(),
            recv_total_counter: null(),
            recv_topk_idx_kind: ffi::EXPERT_ID_LOCAL,
            padding_v2: [0; 4],
        };
        let cfg = ffi::DispatchConfig {
            size: std::mem::size_of::<ffi::DispatchConfig>() as c_uint,
            magic: ffi::MAGIC,
            send_only: 0,
            round_scales: 0,
            pass_direction: ffi::FWD_PASS,
            quant_recipe: if fp8 { QUANT_DS_FP8 } else { 0 },
        };
        // SAFETY: live handle; the descriptors name live buffers of their sizes.
        let rc = unsafe {
            (self.lib.dispatch)(
                self.handle,
                &inputs,
                &outputs,
                &info,
                &cfg,
                self.stream_ptr(),
            )
        };
        let what = if fp8 {
            "ncclEpDispatch (LL, fp8)"
        } else {
            "ncclEpDispatch (LL)"
        };
        self.lib.check(what, rc, self.comm)
    }

    /// Its LL combine of its bf16 receive buffer (identity experts after a
    /// bf16 dispatch) into `out`; expert-major weighted with our weights.
    pub fn combine(&mut self) -> R<()> {
        let null = std::ptr::null_mut;
        let rm = self.rank_major();
        let inputs = ffi::Inputs {
            size: std::mem::size_of::<ffi::Inputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.recv_x.ptr(),
            topk_weights: null(),
            scales: null(),
        };
        let outputs = ffi::CombineOutputs {
            size: std::mem::size_of::<ffi::CombineOutputs>() as c_uint,
            magic: ffi::MAGIC,
            tokens: self.out.ptr(),
            topk_weights: if rm { null() } else { self.w.ptr() },
        };
        let cfg = ffi::CombineConfig {
            size: std::mem::size_of::<ffi::CombineConfig>() as c_uint,
            magic: ffi::MAGIC,
            send_only: 0,
            pass_direction: ffi::FWD_PASS,
            quant_recipe: 0,
        };
        // SAFETY: as dispatch.
        let rc =
            unsafe { (self.lib.combine)(self.handle, &inputs, &outputs, &cfg, self.stream_ptr()) };
        self.lib.check("ncclEpCombine (LL)", rc, self.comm)
    }

    /// What the last (bf16) dispatch received, on the host. Synchronises the stream.
    pub fn received(&self) -> R<Received> {
        let st = &self.stream;
        let rows = st.clone_dtoh(&self.recv_x_buf).map_err(s)?;
        let counts = st.clone_dtoh(&self.counts_buf).map_err(s)?;
        let idx = match &self.recv_idx_buf {
            Some(b) => Some(st.clone_dtoh(b).map_err(s)?),
            None => None,
        };
        let weights = match &self.recv_w_buf {
            Some(b) => Some(st.clone_dtoh(b).map_err(s)?),
            None => None,
        };
        st.synchronize().map_err(s)?;
        Ok(Received {
            counts,
            rows,
            idx,
            weights,
        })
    }

    /// The last combine's output `[T * H]`, on the host. Synchronises the stream.
    pub fn combined(&self) -> R<Vec<bf16>> {
        let v = self.stream.clone_dtoh(&self.out_buf).map_err(s)?;
        self.stream.synchronize().map_err(s)?;
        Ok(v)
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // SAFETY: its handle and group, created by this runner, go once.
        unsafe {
            super::destroy(
                self.lib,
                self.comm,
                &self.stream,
                self.handle,
                self.group,
                " (LL)",
            )
        };
    }
}

// ---------------------------------------------------------------------------
// The cross-check: pure host code.
// ---------------------------------------------------------------------------

/// NCCL EP's bf16 LL dispatch output against the reference's (see the
/// module docs): the rows it received, or the first difference.
pub fn compare_dispatch(
    want: &LlDispatchOutput,
    got: &Received,
    hidden: usize,
    topk: usize,
) -> Result<usize, String> {
    let (h, k, m) = (hidden, topk, want.max_tokens_per_rank);
    let r = want.tokens_from_rank.len();
    let LlTokens::Bf16(want_rows) = &want.tokens else {
        return Err("the reference's rows are not bf16".into());
    };
    let row = |v: &'_ [bf16], i: usize| -> Vec<u16> {
        v.get(i * h..(i + 1) * h)
            .map_or(Vec::new(), |x| x.iter().map(|b| b.to_bits()).collect())
    };
    // (block name, reference rows, NCCL EP rows) of each block.
    let mut blocks: Vec<(String, Vec<usize>, Vec<usize>)> = Vec::new();
    match want.layout {
        LlLayout::ExpertMajor => {
            for (j, &n) in want.tokens_per_local_expert.iter().enumerate() {
                let got_n = got.counts.get(j).copied().unwrap_or(-1);
                if got_n != n as i32 {
                    return Err(format!(
                        "local expert {j}: NCCL EP counts {got_n} rows, the reference {n}"
                    ));
                }
                let start = j * r * m;
                let rows: Vec<usize> = (start..start + n as usize).collect();
                blocks.push((format!("local expert {j}"), rows.clone(), rows));
            }
        }
        LlLayout::RankMajor => {
            let idx = got.idx.as_deref().unwrap_or(&[]);
            for src in 0..r {
                let region = src * m..(src + 1) * m;
                let mine: Vec<usize> = region.clone().filter(|&i| want.src[i].0 >= 0).collect();
                // Its rows: those with a local expert (it sets every slot
                // of a row it did not write to -1).
                let theirs: Vec<usize> = region
                    .filter(|&i| {
                        idx.get(i * k..(i + 1) * k)
                            .is_some_and(|s| s.iter().any(|&e| e >= 0))
                    })
                    .collect();
                let got_n = got.counts.get(src).copied().unwrap_or(-1);
                if got_n != mine.len() as i32 || theirs.len() != mine.len() {
                    return Err(format!(
                        "source rank {src}: NCCL EP counts {got_n} tokens ({} rows with an \
                         expert here), the reference {}",
                        theirs.len(),
                        mine.len()
                    ));
                }
                blocks.push((format!("source rank {src}"), mine, theirs));
            }
        }
    }
    // Rank-major slots of NCCL EP row `i` against reference row `j`.
    let slots_fit = |j: usize, i: usize| -> bool {
        let (Some(gi), Some(gw)) = (got.idx.as_deref(), got.weights.as_deref()) else {
            return true;
        };
        (0..k).all(|q| {
            let (e, we) = (want.topk_local_idx[j * k + q], want.topk_weights[j * k + q]);
            gi.get(i * k + q) == Some(&e)
                && (e < 0 || gw.get(i * k + q).map(|w| w.to_bits()) == Some(we.to_bits()))
        })
    };
    let mut total = 0;
    for (name, mine, theirs) in blocks {
        let mut by_hash: HashMap<u64, Vec<usize>> = HashMap::new();
        for &j in &mine {
            let x = &want_rows[j * h..(j + 1) * h];
            by_hash.entry(row_hash(x)).or_default().push(j);
        }
        let mut taken = vec![false; want.num_rows];
        for i in theirs {
            let g = got.rows.get(i * h..(i + 1) * h).unwrap_or(&[]);
            let cands: Vec<usize> = by_hash
                .get(&row_hash(g))
                .map(|v| {
                    (v.iter().copied())
                        .filter(|&j| !taken[j] && same_bits(g, &want_rows[j * h..(j + 1) * h]))
                        .collect()
                })
                .unwrap_or_default();
            if cands.is_empty() {
                let head: Vec<u16> = row(&got.rows, i).into_iter().take(4).collect();
                return Err(format!(
                    "{name}: NCCL EP's row {i} (bits {head:04x?} ...) is none of the rows the \
                     reference sends there"
                ));
            }
            let Some(j) = cands.iter().copied().find(|&j| slots_fit(j, i)) else {
                let (s, t) = want.src[cands[0]];
                return Err(format!(
                    "{name}: NCCL EP's row {i} (source rank {s}, token {t}): local expert ids or \
                     weights differ from the reference's"
                ));
            };
            taken[j] = true;
            total += 1;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Dtype, Routing};
    use moe_ep::reference::{self as refr, LlPayload, Shape};
    use moe_ep::testkit::workload;
    use moe_ep::{Mode, RecvLayout};

    fn case(layout: RecvLayout, tokens: usize, hidden: usize, sms: usize) -> Case {
        Case {
            tokens,
            hidden,
            topk: 4,
            experts: 16,
            layout,
            num_sms: sms,
            mode: Mode::LowLatency,
            dtype: Dtype::Bf16,
            fp8_scales: crate::cli::ScaleKind::F32,
            routing: Routing::Generated(workload::Routing::Uniform),
        }
    }

    #[test]
    fn pairings() {
        let em = RecvLayout::ExpertMajor { alignment: 1 };
        let p = pairing(&case(em, 64, 1024, 24), 2).unwrap();
        assert_eq!((p.layout, p.fp8), (LlLayout::ExpertMajor, true));
        let p = pairing(&case(RecvLayout::RankMajor, 64, 7168, 24), 1).unwrap();
        assert_eq!((p.layout, p.fp8), (LlLayout::RankMajor, true));
        // 1280 = 5 x 256: bf16 only.
        assert!(!pairing(&case(em, 64, 1280, 24), 2).unwrap().fp8);
        for (c, why) in [
            (case(em, 0, 1024, 24), "at least one token"),
            (case(em, 8, 1032, 24), "multiple of 256"),
            (case(em, 8, 1024, 1), "2 SMs"),
        ] {
            assert!(pairing(&c, 2).unwrap_err().contains(why), "{why}");
        }
    }

    /// Two ranks' inputs and rank 1's reference output.
    fn reference(layout: LlLayout) -> LlDispatchOutput {
        let shape = Shape {
            num_ranks: 2,
            num_experts: 8,
            hidden: 32,
            topk: 3,
        };
        let inputs = workload::rank_inputs(5, &shape, &[12, 10], workload::Routing::Uniform);
        refr::ll_dispatch(&shape, &inputs, 12, 1, layout, LlPayload::Bf16).unwrap()
    }

    /// What NCCL EP would report if it wrote the reference's rows, each
    /// block's rows packed in reverse order (rank-major: from the block's start).
    fn as_received(want: &LlDispatchOutput, k: usize) -> Received {
        let (h, m) = (32, want.max_tokens_per_rank);
        let r = want.tokens_from_rank.len();
        let LlTokens::Bf16(rows) = &want.tokens else {
            unreachable!()
        };
        let mut got = Received {
            rows: vec![bf16::from_f32(7.0); rows.len()],
            ..Default::default()
        };
        let put = |to: usize, from: usize, got: &mut Received| {
            got.rows[to * h..(to + 1) * h].copy_from_slice(&rows[from * h..(from + 1) * h]);
        };
        match want.layout {
            LlLayout::ExpertMajor => {
                for (j, &n) in want.tokens_per_local_expert.iter().enumerate() {
                    let start = j * r * m;
                    for q in 0..n as usize {
                        put(start + q, start + n as usize - 1 - q, &mut got);
                    }
                    got.counts.push(n as i32);
                }
            }
            LlLayout::RankMajor => {
                let mut idx = vec![-1i32; want.num_rows * k];
                let mut w = vec![0.5f32; want.num_rows * k];
                for src in 0..r {
                    let mine: Vec<usize> = (src * m..(src + 1) * m)
                        .filter(|&i| want.src[i].0 >= 0)
                        .collect();
                    for (q, &j) in mine.iter().rev().enumerate() {
                        let to = src * m + q;
                        put(to, j, &mut got);
                        idx[to * k..(to + 1) * k]
                            .copy_from_slice(&want.topk_local_idx[j * k..(j + 1) * k]);
                        for s in 0..k {
                            if want.topk_local_idx[j * k + s] >= 0 {
                                w[to * k + s] = want.topk_weights[j * k + s];
                            }
                        }
                    }
                    got.counts.push(mine.len() as i32);
                }
                got.idx = Some(idx);
                got.weights = Some(w);
            }
        }
        got
    }

    #[test]
    fn rows_in_any_order_inside_their_block() {
        let k = 3;
        for layout in [LlLayout::ExpertMajor, LlLayout::RankMajor] {
            let want = reference(layout);
            let got = as_received(&want, k);
            let n = compare_dispatch(&want, &got, 32, k).unwrap();
            let expect = match layout {
                LlLayout::ExpertMajor => want.tokens_per_local_expert.iter().sum::<u32>() as usize,
                LlLayout::RankMajor => want.src.iter().filter(|s| s.0 >= 0).count(),
            };
            assert_eq!(n, expect, "{layout:?}");
            // A value off: no reference row has it.
            let mut bad = got.clone();
            bad.rows[0] = bf16::from_f32(1234.0);
            let e = compare_dispatch(&want, &bad, 32, k).unwrap_err();
            assert!(e.contains("none of the rows"), "{layout:?}: {e}");
            // A count off.
            let mut bad = got.clone();
            bad.counts[0] += 1;
            assert!(compare_dispatch(&want, &bad, 32, k).is_err(), "{layout:?}");
        }
        // Rank-major: a weight of a local slot off by one bit.
        let want = reference(LlLayout::RankMajor);
        let mut got = as_received(&want, k);
        let i = (0..want.num_rows * k)
            .find(|&i| got.idx.as_ref().unwrap()[i] >= 0)
            .unwrap();
        let w = got.weights.as_mut().unwrap();
        w[i] = f32::from_bits(w[i].to_bits() ^ 1);
        let e = compare_dispatch(&want, &got, 32, k).unwrap_err();
        assert!(e.contains("weights differ"), "{e}");
    }
}
