//! The low-latency API's types: the dispatch's inputs ([`LlInput`],
//! [`LlDispatchArgs`]), the sent ops ([`LlDispatchSent`],
//! [`LlCombineSent`]), and the result of a dispatch ([`LlHandle`], with
//! [`LlView`]s into the group's buffer set).
//!
//! Tests: `tests/gpu_low_latency.rs` (GPU).

use std::marker::PhantomData;
use std::sync::Arc;

use half::bf16;

use super::buffers::LlBuffers;
use crate::ops::abi::FP8_BLOCK;
use crate::ops::buffers::{DeviceRegion, TopkIdx};
use crate::ops::node::group::NodeGroup;
use crate::types::{Fp8Scaling, LlLayout};

/// The token rows a low-latency dispatch sends.
pub enum LlInput<'a> {
    /// `[T, H]` bf16 (sent as bf16, or cast to fp8 with `cast_fp8`).
    Bf16(&'a dyn DeviceRegion<bf16>),
    /// The caller's fp8 rows, forwarded as they are: `codes` `[T, H]` e4m3,
    /// `scales` `[T, H / 128]` f32 (`x ≈ e4m3(code) * scale`).
    Fp8 {
        codes: &'a dyn DeviceRegion<u8>,
        scales: &'a dyn DeviceRegion<f32>,
    },
}

/// What a low-latency dispatch sends ([`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch),
/// [`EpGroup::ll_dispatch_send`](crate::EpGroup::ll_dispatch_send)).
pub struct LlDispatchArgs<'a> {
    /// This rank's token rows, `[T, H]`.
    pub x: LlInput<'a>,
    /// `[T, topk]` expert ids (-1: not routed).
    pub topk_idx: TopkIdx<'a>,
    /// Experts per token, 1..=8 (the kernels' `MAX_TOPK`).
    pub topk: usize,
    /// `[T, topk]` f32 weights.
    pub topk_weights: &'a dyn DeviceRegion<f32>,
    /// The receive layout.
    pub layout: LlLayout,
    /// `Some`: bf16 rows cast to fp8 on the sender, per 128 values, with
    /// this scaling ([`crate::reference::quantize_fp8`], bit for bit).
    pub cast_fp8: Option<Fp8Scaling>,
}

/// What a batch is, as the host knows it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LlBatch {
    pub(crate) group: u64,
    pub(crate) set: usize,
    pub(crate) generation: u64,
    pub(crate) layout: LlLayout,
    pub(crate) fp8: bool,
    pub(crate) num_tokens: usize,
    pub(crate) topk: usize,
}

/// A dispatch that was sent ([`EpGroup::ll_dispatch_send`](crate::EpGroup::ll_dispatch_send)); give it to
/// [`EpGroup::ll_dispatch_wait`](crate::EpGroup::ll_dispatch_wait) for the received rows.
#[must_use = "a sent dispatch must be waited for (ll_dispatch_wait) before its set is reused"]
#[derive(Debug)]
pub struct LlDispatchSent {
    pub(crate) b: LlBatch,
}

/// A combine that was sent ([`EpGroup::ll_combine_send`](crate::EpGroup::ll_combine_send)); give it to
/// [`EpGroup::ll_combine_wait`](crate::EpGroup::ll_combine_wait) for the output.
#[must_use = "a sent combine must be waited for (ll_combine_wait)"]
#[derive(Debug)]
pub struct LlCombineSent {
    pub(crate) b: LlBatch,
}

// A wait takes its sent op by reference: one that was refused (a short
// `out`, the wrong stream) can be waited for again once the call is fixed;
// a second wait of one that ran is refused by the group's phase check.
impl LlDispatchSent {
    /// The buffer set (0 or 1) the batch is in.
    pub fn buffer_set(&self) -> usize {
        self.b.set
    }
}

/// A read-only view of a low-latency output: `len()` elements of `T` at a
/// device address in the group's buffers. Valid (the batch's data) until
/// the next dispatch into the batch's set.
pub struct LlView<'a, T> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) _p: PhantomData<&'a T>,
}

impl<T> LlView<'_, T> {
    pub(crate) fn new(ptr: u64, len: usize) -> Self {
        LlView {
            ptr,
            len,
            _p: PhantomData,
        }
    }
}

// SAFETY: a range inside the group's low-latency buffers, which the view's
// lifetime (borrowing the handle, which borrows the group) keeps allocated.
unsafe impl<T> DeviceRegion<T> for LlView<'_, T> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// The result of a low-latency dispatch: where its rows and counts are on
/// this rank (views into the group's buffer set), for the experts and for
/// [`EpGroup::ll_combine`](crate::EpGroup::ll_combine). All arrays are on the device.
pub struct LlHandle {
    pub(crate) group: Arc<NodeGroup>,
    pub(crate) b: LlBatch,
}

impl LlHandle {
    /// The receive layout.
    pub fn layout(&self) -> LlLayout {
        self.b.layout
    }
    /// This rank's tokens `T` in the dispatch.
    pub fn num_tokens(&self) -> usize {
        self.b.num_tokens
    }
    /// Top-k.
    pub fn topk(&self) -> usize {
        self.b.topk
    }
    /// True when the rows are fp8 (cast by the senders, or the callers').
    pub fn is_fp8(&self) -> bool {
        self.b.fp8
    }
    /// The buffer set (0 or 1) holding the batch.
    pub fn buffer_set(&self) -> usize {
        self.b.set
    }
    /// Rows of the layout: expert-major `El * R * M`, rank-major `R * M`
    /// (only the counted ones are defined: expert-major the first
    /// `tokens_per_local_expert[j]` of each block `j`, rank-major rows
    /// `s * M + t` with `t < tokens_from_rank[s]`).
    pub fn num_rows(&self) -> usize {
        let (r, m) = (self.group.comm.world(), self.group.cfg.max_tokens_per_rank);
        match self.b.layout {
            LlLayout::ExpertMajor => self.group.experts_per_rank() * r * m,
            LlLayout::RankMajor => r * m,
        }
    }
    fn bufs(&self) -> &LlBuffers {
        self.group.ll.as_ref().expect("a low-latency group")
    }
    fn sym(&self, off: u64) -> u64 {
        self.bufs().sym_set(self.group.comm.rank(), self.b.set) + off
    }
    fn local(&self, off: u64) -> u64 {
        self.bufs().local_set(self.b.set) + off
    }
    /// Address of the rows and of their scales.
    fn rows_at(&self) -> (u64, u64) {
        let b = &self.bufs().bufs;
        match self.b.layout {
            LlLayout::ExpertMajor => (self.local(b.em_x), self.local(b.em_scales)),
            LlLayout::RankMajor => (self.sym(b.recv_x), self.sym(b.recv_scales)),
        }
    }
    /// `[rows, H]` bf16 rows; `None` for fp8 rows.
    pub fn tokens(&self) -> Option<LlView<'_, bf16>> {
        let h = self.group.cfg.hidden;
        (!self.b.fp8).then(|| LlView::new(self.rows_at().0, self.num_rows() * h))
    }
    /// `[rows, H]` e4m3 codes (rows `H` bytes apart); `None` for bf16 rows.
    pub fn fp8_codes(&self) -> Option<LlView<'_, u8>> {
        let h = self.group.cfg.hidden;
        self.b
            .fp8
            .then(|| LlView::new(self.rows_at().0, self.num_rows() * h))
    }
    /// `[rows, H / 128]` f32 scales of the fp8 rows; `None` for bf16 rows.
    pub fn fp8_scales(&self) -> Option<LlView<'_, f32>> {
        let nb = self.group.cfg.hidden / FP8_BLOCK;
        self.b
            .fp8
            .then(|| LlView::new(self.rows_at().1, self.num_rows() * nb))
    }
    /// `[rows, 2]` i32 (source rank, source token) per row; `(-1, -1)` for a
    /// counted rank-major row that carries no token.
    pub fn src(&self) -> LlView<'_, i32> {
        let b = &self.bufs().bufs;
        let at = match self.b.layout {
            LlLayout::ExpertMajor => self.local(b.em_src),
            LlLayout::RankMajor => self.sym(b.recv_src),
        };
        LlView::new(at, self.num_rows() * 2)
    }
    /// Rank-major `[R * M, K]` i32: the local expert of each of the row's
    /// token's slots, `-1` where that expert is not here. `None` for
    /// expert-major.
    pub fn topk_local_idx(&self) -> Option<LlView<'_, i32>> {
        let at = self.sym(self.bufs().bufs.recv_idx);
        (self.b.layout == LlLayout::RankMajor)
            .then(|| LlView::new(at, self.num_rows() * self.b.topk))
    }
    /// Rank-major `[R * M, K]` f32: the slots' weights, `0.0` where the
    /// expert is not here. `None` for expert-major.
    pub fn topk_weights(&self) -> Option<LlView<'_, f32>> {
        let at = self.sym(self.bufs().bufs.recv_w);
        (self.b.layout == LlLayout::RankMajor)
            .then(|| LlView::new(at, self.num_rows() * self.b.topk))
    }
    /// `[El]` i32: (token, expert) pairs received per local expert (the
    /// counted rows of each expert-major block).
    pub fn tokens_per_local_expert(&self) -> LlView<'_, i32> {
        let el = self.group.experts_per_rank();
        LlView::new(self.local(self.bufs().bufs.counts), el)
    }
    /// `[El * R]` i32: `[j * R + s]` = pairs of local expert `j` from rank `s`.
    pub fn tokens_per_expert_source(&self) -> LlView<'_, i32> {
        let (el, r) = (self.group.experts_per_rank(), self.group.comm.world());
        LlView::new(self.local(self.bufs().bufs.counts) + el as u64 * 4, el * r)
    }
    /// `[R]` i32: every rank's token count `T_s` (the counted rank-major rows).
    pub fn tokens_from_rank(&self) -> LlView<'_, i32> {
        let (el, r) = (self.group.experts_per_rank(), self.group.comm.world());
        let off = (el + el * r) as u64 * 4;
        LlView::new(self.local(self.bufs().bufs.counts) + off, r)
    }
}
