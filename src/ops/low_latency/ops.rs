//! The low-latency ops on a one-node group of
//! [`Mode::LowLatency`](crate::Mode::LowLatency): the dispatch's send and
//! wait ([`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch) and its
//! two-phase form), the combine's ([`EpGroup::ll_combine`](crate::EpGroup::ll_combine)),
//! their checks and launches, and the phases of the group's buffer sets.
//!
//! Kernels: `kernels-cuda/low_latency.cu`. Tests: `tests/gpu_low_latency.rs`
//! (GPU); the unit test below (the kernel's fp8 constants are the
//! reference's).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use super::buffers::{LlBuffers, Phase};
use super::handle::{LlBatch, LlCombineSent, LlDispatchArgs, LlDispatchSent, LlHandle, LlInput};
use super::kernels::{li, LlKernels};
use crate::error::{Error, Result};
use crate::ops::abi::{
    ll_cast, ll_payload, LayoutKind, LlParams, OpCommon, FP8_BLOCK, LL_SETS, THREADS,
};
use crate::ops::buffers::{DeviceRegion, DeviceRegionMut, TopkIdx, ROW_ALIGN};
use crate::ops::node::group::NodeGroup;
use crate::ops::node::layout_op::tokens_of_routing;
use crate::ops::node::turn::{refusal, OpTurn, Refuse};
use crate::runtime::Function;
use crate::types::{Fp8Scaling, LlLayout};

/// What a dispatch send launches with, checked.
struct SendCall {
    x: u64,
    x_scales: u64,
    topk_idx: u64,
    idx_i64: bool,
    topk_w: u64,
    fp8: bool,
    cast: i32,
}

impl NodeGroup {
    fn ll_buffers(&self) -> Result<&LlBuffers> {
        self.ll.as_ref().ok_or_else(|| {
            Error::arg(
                "mode",
                "a group made with Mode::LowLatency (its buffers are fixed at creation)",
                "HighThroughput",
            )
        })
    }

    /// The parameters every low-latency kernel of batch `b` starts from.
    fn ll_params(&self, ll: &LlBuffers, b: &LlBatch) -> LlParams {
        let layout = match b.layout {
            LlLayout::RankMajor => LayoutKind::RankMajor,
            LlLayout::ExpertMajor => LayoutKind::ExpertMajor,
        };
        LlParams {
            op: OpCommon {
                ws: self.ws_peers,
                w: self.w,
                error: self.error.device_ptr(),
                timeout_ns: self.timeout_ns(),
                rank: self.comm.rank() as i32,
                world: self.comm.world() as i32,
                num_tokens: b.num_tokens as i32,
                hidden: self.cfg.hidden as i32,
                topk: b.topk as i32,
                num_experts: self.cfg.num_experts as i32,
                layout,
                alignment: 1,
                recv_capacity: 0,
                num_blocks: self.cfg.num_sms as i32,
                ..Default::default()
            },
            b: ll.bufs,
            set: b.set as i32,
            max_tokens: self.cfg.max_tokens_per_rank as i32,
            payload: if b.fp8 {
                ll_payload::FP8
            } else {
                ll_payload::BF16
            },
            ..Default::default()
        }
    }

    fn ll_launch(&self, stream: &Arc<CudaStream>, f: &Function, p: &LlParams) -> Result<()> {
        // SAFETY: p mirrors LlParams; every buffer was checked by the
        // caller or lies in the group's low-latency buffers, which outlive
        // the enqueued work (dropping the group waits for it).
        unsafe { f.launch(stream, self.cfg.num_sms as u32, THREADS, 0, p) }
    }

    fn ll_kernels(&self) -> &LlKernels {
        self.k
            .ll
            .as_ref()
            .expect("a low-latency group loads its kernels")
    }

    /// Checks that batch `b` is this group's and its set's latest, in
    /// phase `from`, for `op`.
    fn ll_expect(&self, ll: &LlBuffers, b: &LlBatch, from: Phase, op: &str) -> Result<()> {
        self.ll_own(b)?;
        let (generation, phase) = ll.state().sets[b.set];
        if generation != b.generation {
            return Err(Error::arg(
                "handle",
                format!(
                    "the latest batch of buffer set {} (a later dispatch reused the set)",
                    b.set
                ),
                "a handle of an earlier batch",
            ));
        }
        if phase != from {
            return Err(Error::InvalidState(format!(
                "{op}: the batch in buffer set {} is {phase:?}, not {from:?} (each batch is sent, waited for, combine-sent and combine-waited once, in that order)",
                b.set
            )));
        }
        Ok(())
    }

    /// Refuses a batch of another group (naming `handle`).
    fn ll_own(&self, b: &LlBatch) -> Result<()> {
        if b.group != self.id {
            return Err(Error::arg(
                "handle",
                format!("a low-latency batch of this group (group {})", self.id),
                format!("one of group {}", b.group),
            ));
        }
        Ok(())
    }

    fn ll_set_phase(&self, ll: &LlBuffers, b: &LlBatch, to: Phase) {
        ll.state().sets[b.set].1 = to;
    }

    /// The checks of a dispatch send (on the op's turn).
    fn ll_check_send(&self, a: &LlDispatchArgs<'_>) -> Result<(usize, SendCall)> {
        let (x, topk_idx, topk, topk_weights, cast_fp8) =
            (&a.x, &a.topk_idx, a.topk, a.topk_weights, a.cast_fp8);
        let h = self.cfg.hidden;
        // topk, then topk_idx's shape and tokens: the layout's checks.
        let (idx_ptr, idx_len) = topk_idx.ptr_len();
        let t = tokens_of_routing(topk, idx_len, &self.cfg)?;
        let idx_i64 = match topk_idx {
            TopkIdx::I32(b) => {
                self.check_region("topk_idx", *b, t * topk, "[T, K] i32", 4)?;
                false
            }
            TopkIdx::I64(b) => {
                self.check_region("topk_idx", *b, t * topk, "[T, K] i64", 8)?;
                true
            }
        };
        self.check_region("topk_weights", topk_weights, t * topk, "[T, K] f32", 4)?;
        let fp8_hidden = || {
            if h.is_multiple_of(FP8_BLOCK) {
                Ok(())
            } else {
                Err(Error::arg(
                    "hidden",
                    "a multiple of 128 for fp8 rows (one scale per 128 values)",
                    h,
                ))
            }
        };
        let call = match (x, cast_fp8) {
            (LlInput::Bf16(x), cast) => {
                if cast.is_some() {
                    fp8_hidden()?;
                }
                self.check_region("x", *x, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
                SendCall {
                    x: x.device_ptr(),
                    x_scales: 0,
                    topk_idx: idx_ptr,
                    idx_i64,
                    topk_w: topk_weights.device_ptr(),
                    fp8: cast.is_some(),
                    cast: match cast {
                        None => ll_cast::NONE,
                        Some(Fp8Scaling::Exact) => ll_cast::EXACT,
                        Some(Fp8Scaling::PowerOfTwo) => ll_cast::POW2,
                    },
                }
            }
            (LlInput::Fp8 { .. }, Some(_)) => {
                return Err(Error::arg(
                    "cast_fp8",
                    "None for fp8 input (the caller's rows are sent as they are)",
                    "Some",
                ))
            }
            (LlInput::Fp8 { codes, scales }, None) => {
                fp8_hidden()?;
                self.check_region("x", *codes, t * h, "[T, hidden] e4m3 codes", ROW_ALIGN)?;
                self.check_region(
                    "x_scales",
                    *scales,
                    t * (h / FP8_BLOCK),
                    "[T, hidden / 128] f32",
                    4,
                )?;
                SendCall {
                    x: codes.device_ptr(),
                    x_scales: scales.device_ptr(),
                    topk_idx: idx_ptr,
                    idx_i64,
                    topk_w: topk_weights.device_ptr(),
                    fp8: true,
                    cast: ll_cast::NONE,
                }
            }
        };
        Ok((t, call))
    }

    /// Dispatch send, on the op's turn.
    fn ll_send(&self, stream: &Arc<CudaStream>, a: LlDispatchArgs<'_>) -> Result<LlDispatchSent> {
        let ll = self.ll_buffers()?;
        let (t, call) = self.ll_check_send(&a)?;
        let (layout, topk) = (a.layout, a.topk);
        let (set, generation) = {
            let st = ll.state();
            let set = st.next_set;
            let (_, phase) = st.sets[set];
            if !matches!(phase, Phase::Free | Phase::Combined | Phase::Refused) {
                return Err(Error::InvalidState(format!(
                    "ll_dispatch: buffer set {set} still holds a batch that is {phase:?}: combine it (ll_combine, or ll_combine_send + ll_combine_wait) before dispatching a third batch"
                )));
            }
            (set, st.generation + 1)
        };
        let b = LlBatch {
            group: self.id,
            set,
            generation,
            layout,
            fp8: call.fp8,
            num_tokens: t,
            topk,
        };
        let mut p = self.ll_params(ll, &b);
        p.x = call.x;
        p.x_scales = call.x_scales;
        p.topk_idx = call.topk_idx;
        p.topk_w = call.topk_w;
        p.cast = call.cast;
        p.tokens_fault = self
            .faults
            .ll_tokens
            .swap(0, std::sync::atomic::Ordering::Relaxed);
        self.ll_launch(stream, &self.ll_kernels().send[call.idx_i64 as usize], &p)?;
        let mut st = ll.state();
        st.generation = generation;
        st.sets[set] = (generation, Phase::Sent);
        st.next_set = (set + 1) % LL_SETS;
        Ok(LlDispatchSent { b })
    }

    /// Dispatch wait, on the op's turn.
    fn ll_recv(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        sent: &LlDispatchSent,
    ) -> Result<LlHandle> {
        let ll = self.ll_buffers()?;
        let b = sent.b;
        self.ll_expect(ll, &b, Phase::Sent, "ll_dispatch_wait")?;
        let p = self.ll_params(ll, &b);
        self.ll_launch(stream, &self.ll_kernels().recv[li(b.layout)], &p)?;
        if b.layout == LlLayout::ExpertMajor {
            self.ll_launch(stream, &self.ll_kernels().copy, &p)?;
        }
        self.ll_set_phase(ll, &b, Phase::Received);
        Ok(LlHandle {
            group: Arc::clone(self),
            b,
        })
    }

    /// The one-node path of [`EpGroup::ll_dispatch_send`](crate::EpGroup::ll_dispatch_send).
    pub fn ll_dispatch_send(
        &self,
        stream: &Arc<CudaStream>,
        args: LlDispatchArgs<'_>,
    ) -> Result<LlDispatchSent> {
        let layout = args.layout;
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_send(turn, layout, arg);
        self.op_with(
            "moe_ep::ll_dispatch_send",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            |_| self.ll_send(stream, args),
        )
    }

    /// A dispatch send this rank's host refused (argument `arg`), or made
    /// after an error of its own: the send kernel moves no rows and tells
    /// every receiver why (LlSignal), so that none waits for this rank, and
    /// the batch counts on every rank. Nothing when the set the batch would
    /// take still holds one (its receivers are not waiting for this batch).
    fn ll_refuse_send(&self, turn: &OpTurn<'_>, layout: LlLayout, arg: u64) -> Result<()> {
        let (Some(ll), Some(stream)) = (self.ll.as_ref(), turn.stream()) else {
            return Ok(());
        };
        let mut st = ll.state();
        let set = st.next_set;
        if !matches!(
            st.sets[set].1,
            Phase::Free | Phase::Combined | Phase::Refused
        ) {
            return Ok(());
        }
        let generation = st.generation + 1;
        let b = LlBatch {
            group: self.id,
            set,
            generation,
            layout,
            fp8: false,
            num_tokens: 0,
            topk: 1,
        };
        let mut p = self.ll_params(ll, &b);
        p.refuse = arg as i32 + 1;
        self.ll_launch(stream, &self.ll_kernels().send[0], &p)?;
        st.generation = generation;
        st.sets[set] = (generation, Phase::Free);
        st.next_set = (set + 1) % LL_SETS;
        Ok(())
    }

    /// Waits (on the stream, bounded by the group's timeout) for every
    /// rank's rows of a sent dispatch and lays them out: the second half of
    /// [`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch).
    pub fn ll_dispatch_wait(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        sent: &LlDispatchSent,
    ) -> Result<LlHandle> {
        self.op_with(
            "moe_ep::ll_dispatch_wait",
            0,
            stream,
            None,
            Refuse::Quiet,
            |_| self.ll_recv(stream, sent),
        )
    }

    /// The one-node path of [`EpGroup::ll_dispatch`](crate::EpGroup::ll_dispatch).
    pub fn ll_dispatch(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        args: LlDispatchArgs<'_>,
    ) -> Result<LlHandle> {
        let layout = args.layout;
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_send(turn, layout, arg);
        self.op_with(
            "moe_ep::ll_dispatch",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            |turn| {
                let sent = self.ll_send(stream, args)?;
                turn.launched.set(true);
                self.ll_recv(stream, &sent)
            },
        )
    }

    /// [`EpGroup::refuse`](crate::EpGroup::refuse) of a low-latency
    /// dispatch (one call or send) in `layout`: the entry's checks, then
    /// the send that tells every receiver (as the op's own refusal).
    pub(crate) fn ll_refuse_dispatch(
        &self,
        stream: &Arc<CudaStream>,
        layout: LlLayout,
        e: Error,
    ) -> Error {
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_send(turn, layout, arg);
        refusal(self.op_with(
            "moe_ep::ll_dispatch",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            |_| Err(e),
        ))
    }

    /// [`EpGroup::refuse`](crate::EpGroup::refuse) of a low-latency combine
    /// (one call or send) of `handle`'s batch: the entry's checks, then the
    /// send that tells every home (as the op's own refusal).
    pub(crate) fn ll_refuse_combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        e: Error,
    ) -> Error {
        let b = handle.b;
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_combine_send(turn, &b, arg);
        refusal(self.op_with(
            "moe_ep::ll_combine",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            |_| Err(e),
        ))
    }

    /// [`EpGroup::refuse`](crate::EpGroup::refuse) of a wait (`name`): no
    /// peer waits for it; this rank's `check` names the refusal, as after
    /// the wait's own refusal.
    pub(crate) fn ll_refuse_quietly(
        &self,
        stream: &Arc<CudaStream>,
        name: &'static str,
        e: Error,
    ) -> Error {
        refusal(self.op_with(name, 0, stream, None, Refuse::Quiet, |_| Err(e)))
    }

    /// The checks of `expert_out`.
    fn ll_check_expert_out(
        &self,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
    ) -> Result<()> {
        let h = self.cfg.hidden;
        self.check_region(
            "expert_out",
            expert_out,
            handle.num_rows() * h,
            "[rows, hidden] bf16 in the dispatch's layout",
            ROW_ALIGN,
        )
    }

    /// The checks of a combine wait's `weights` and `out`: the weights'
    /// address, or 0 for the dispatch's.
    fn ll_check_wait(
        &self,
        b: &LlBatch,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &dyn DeviceRegionMut<bf16>,
    ) -> Result<u64> {
        let (t, k, h) = (b.num_tokens, b.topk, self.cfg.hidden);
        let w = match (weights, b.layout) {
            (None, _) => 0,
            (Some(_), LlLayout::RankMajor) => {
                return Err(Error::arg(
                    "weights",
                    "None for rank-major (each rank weights and sums its experts' outputs into the row before combine)",
                    "Some",
                ))
            }
            (Some(w), LlLayout::ExpertMajor) => {
                self.check_region("weights", w, t * k, "[T, K] f32", 4)?;
                w.device_ptr()
            }
        };
        self.check_region("out", out, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
        Ok(w)
    }

    fn ll_combine_send_on_turn(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        in_place: bool,
        op: &str,
    ) -> Result<LlCombineSent> {
        let ll = self.ll_buffers()?;
        let b = handle.b;
        // The handle's group, the arguments, then the batch's state (a
        // spent batch's retry names a bad argument too).
        self.ll_own(&b)?;
        self.ll_check_expert_out(handle, expert_out)?;
        self.ll_expect(ll, &b, Phase::Received, op)?;
        let mut p = self.ll_params(ll, &b);
        p.y = expert_out.device_ptr();
        p.in_place = in_place as i32;
        self.ll_launch(stream, &self.ll_kernels().combine_send[li(b.layout)], &p)?;
        self.ll_set_phase(ll, &b, Phase::CombineSent);
        Ok(LlCombineSent { b })
    }

    fn ll_combine_wait_on_turn(
        &self,
        stream: &Arc<CudaStream>,
        b: LlBatch,
        w: u64,
        out: u64,
        in_place_y: Option<u64>,
    ) -> Result<()> {
        let ll = self.ll_buffers()?;
        self.ll_expect(ll, &b, Phase::CombineSent, "ll_combine_wait")?;
        let mut p = self.ll_params(ll, &b);
        p.comb_w = w;
        p.out = out;
        if let Some(y) = in_place_y {
            p.y = y;
            p.in_place = 1;
        }
        self.ll_launch(stream, &self.ll_kernels().combine_recv[li(b.layout)], &p)?;
        self.ll_set_phase(ll, &b, Phase::Combined);
        Ok(())
    }

    /// A combine send of `b`'s batch this rank's host refused (argument
    /// `arg`): the send kernel moves no rows and tells every home why (its
    /// signal), so that none waits for this rank; the homes stop on it. The
    /// batch is spent here (Phase::Refused: a corrected retry is refused,
    /// since no second signal of the batch's number may follow the
    /// refusal's) and its set takes the next batch. Nothing when `b` is not
    /// this group's latest batch of its set, ready to combine (no home
    /// waits for this rank's rows of it).
    fn ll_refuse_combine_send(&self, turn: &OpTurn<'_>, b: &LlBatch, arg: u64) -> Result<()> {
        let (Some(ll), Some(stream)) = (self.ll.as_ref(), turn.stream()) else {
            return Ok(());
        };
        if b.group != self.id || ll.state().sets[b.set] != (b.generation, Phase::Received) {
            return Ok(());
        }
        let mut p = self.ll_params(ll, b);
        p.refuse = arg as i32 + 1;
        self.ll_launch(stream, &self.ll_kernels().combine_send[li(b.layout)], &p)?;
        self.ll_set_phase(ll, b, Phase::Refused);
        Ok(())
    }

    /// Sends this rank's expert outputs home (the first half of
    /// [`EpGroup::ll_combine`](crate::EpGroup::ll_combine), whose docs say what `expert_out` holds);
    /// returns at once. Then [`EpGroup::ll_combine_wait`](crate::EpGroup::ll_combine_wait).
    pub fn ll_combine_send(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
    ) -> Result<LlCombineSent> {
        let b = handle.b;
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_combine_send(turn, &b, arg);
        self.op_with(
            "moe_ep::ll_combine_send",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            // Not in place: the caller may reuse expert_out before the wait.
            |_| self.ll_combine_send_on_turn(stream, handle, expert_out, false, "ll_combine_send"),
        )
    }

    /// Waits (bounded) for every rank's rows of a sent combine and sums them
    /// into `out` (the second half of [`EpGroup::ll_combine`](crate::EpGroup::ll_combine)).
    pub fn ll_combine_wait(
        &self,
        stream: &Arc<CudaStream>,
        sent: &LlCombineSent,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        self.op_with(
            "moe_ep::ll_combine_wait",
            0,
            stream,
            None,
            Refuse::Quiet,
            |_| {
                let b = sent.b;
                let w = self.ll_check_wait(&b, weights, &*out)?;
                self.ll_combine_wait_on_turn(stream, b, w, out.device_ptr(), None)
            },
        )
    }

    /// The one-node path of [`EpGroup::ll_combine`](crate::EpGroup::ll_combine).
    pub fn ll_combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &LlHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        let b = handle.b;
        let refuse = |turn: &OpTurn<'_>, arg: u64| self.ll_refuse_combine_send(turn, &b, arg);
        self.op_with(
            "moe_ep::ll_combine",
            0,
            stream,
            None,
            Refuse::With(&refuse),
            |turn| {
                self.ll_own(&handle.b)?;
                let w = self.ll_check_wait(&handle.b, weights, &*out)?;
                // Both halves on one stream within this call: the rows homed
                // here stay in expert_out, read there by the sum (no copy).
                let sent =
                    self.ll_combine_send_on_turn(stream, handle, expert_out, true, "ll_combine")?;
                turn.launched.set(true);
                let y = expert_out.device_ptr();
                self.ll_combine_wait_on_turn(stream, sent.b, w, out.device_ptr(), Some(y))
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's e4m3 constant is the reference's `1.0f / 448.0f`.
    #[test]
    fn kernel_constants_match_the_reference() {
        let inv = crate::reference::E4M3_MAX_INV.to_bits();
        assert_eq!(inv, 0x3B12_4925);
        let cu = include_str!("../../../kernels-cuda/low_latency.cu");
        assert!(cu.contains("kE4m3MaxInvBits = 0x3B124925u"));
        assert!(cu.contains("kAmaxFloor = 1e-4f"));
        assert_eq!(crate::reference::FP8_AMAX_FLOOR, 1e-4f32);
        assert_eq!(crate::reference::FP8_BLOCK, FP8_BLOCK);
    }
}
