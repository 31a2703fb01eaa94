//! Combine ([`EpGroup::combine`](crate::EpGroup::combine)) and the dispatch backward
//! ([`EpGroup::dispatch_backward`](crate::EpGroup::dispatch_backward), a combine of the received tokens'
//! gradient): argument checks, the choice between reading the partials in
//! place (pulled) and pushing them through the group's stage, and the
//! launch of the kernel of that path.
//!
//! Kernels: `kernels-cuda/combine_pull.cu` (`moe_ep_combine_pull_r*`,
//! `moe_ep_dispatch_bwd_pull_r*`) and `kernels-cuda/combine_push.cu`
//! (`moe_ep_combine_push_rank_major_r*` / `_expert_major_r*`,
//! `moe_ep_dispatch_bwd_push_rank_major_r*` / `_expert_major_r*`). Tests:
//! `tests/gpu_intranode.rs` (both paths of every case against the CPU
//! reference and bit-identical across runs, every chunk count, weighted
//! expert-major, weight gradients, buffers that differ between ranks).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use super::group::NodeGroup;
use super::handle::NodeHandle;
use super::turn::{OnTurn, OpTurn};
use crate::error::{Error, Result};
use crate::ops::abi::{desc, CombineParams, COMBINE_SMEM, DESC_WORDS, EM_COMBINE_SMEM, THREADS};
use crate::ops::buffers::{DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, Peers, ROW_ALIGN};
use crate::types::RecvLayout;

/// Every rank's expert outputs (and weight gradients, when they travel) as
/// mapped here: the home reads them in place (the pulled kernels).
struct PullPeers {
    y: (Peers, u64),
    grad_w: Option<(Peers, u64)>,
}

/// Where a combine counts its finished home rows (device addresses; the
/// two-level path's node combine, whose network hop sends each chunk of
/// them as soon as it is complete): a warp that stored `n` vectors of home
/// row `t` adds `n` to the `u64` at `done + 8 * done_of[t]` (`done_of`:
/// `[T]` i32, -1 for rows not counted). A chunk of `r` rows is complete at
/// `r * hidden / 8`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Progress {
    pub done: u64,
    pub done_of: u64,
}

/// One combine-kernel launch: device addresses, local.
struct CombineCall {
    /// `[recv_capacity, H]` bf16 partial rows in the handle's layout.
    y: u64,
    /// `[T, H]` bf16.
    out: u64,
    /// Expert-major weighted combine: `[recv_capacity]` f32 per row.
    w_rows: Option<u64>,
    /// Dispatch backward with weight gradients: the received rows'
    /// (`grad_w_in`, rank-major `[rows, K]` / expert-major `[rows]`) and the
    /// tokens' (`grad_w_out`, `[T, K]`).
    grad_w: Option<(u64, u64)>,
    /// `Some` when the partials are read in place.
    pull: Option<PullPeers>,
    /// The dispatch backward (a combine of the gradient).
    dispatch_bwd: bool,
    /// Counting of the finished home rows, when asked for.
    progress: Option<Progress>,
}

impl NodeGroup {
    /// Refuses an expert-major combine (or dispatch backward) of a handle
    /// that no dispatch or combine backward ran on yet: those write, on
    /// every rank, the rows of each received token's experts it reads.
    fn check_meta(handle: &NodeHandle) -> Result<()> {
        if matches!(handle.layout, RecvLayout::ExpertMajor { .. })
            && !handle
                .meta_written
                .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(Error::InvalidState(
                "an expert-major combine or dispatch backward needs a dispatch (or combine_backward) of the handle first: it tells each rank where its tokens' rows are".into(),
            ));
        }
        Ok(())
    }

    /// Peer mappings for the pulled path: rank-major, `y` (and `grad_w`,
    /// when given) symmetric. Otherwise `None`: the partials are pushed.
    fn pull_peers(
        &self,
        handle: &NodeHandle,
        y: &dyn DeviceRegion<bf16>,
        grad_w: Option<&dyn DeviceRegion<f32>>,
    ) -> Option<PullPeers> {
        if !matches!(handle.layout, RecvLayout::RankMajor) {
            return None;
        }
        let y = self.located(y, "expert_out").ok()?;
        let grad_w = match grad_w {
            None => None,
            Some(g) => Some(self.located(g, "grad_recv_topk_weights").ok()?),
        };
        Some(PullPeers { y, grad_w })
    }

    /// Launches the combine kernel of the call's path: pulled or pushed,
    /// with or without weight gradients, in the handle's layout.
    fn launch_combine(
        &self,
        turn: &OpTurn<'_>,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        call: CombineCall,
    ) -> Result<()> {
        let k = &self.k;
        let f = match (&call.pull, call.grad_w.is_some()) {
            (Some(_), false) => &k.combine_pull,
            (Some(_), true) => &k.dispatch_bwd_pull,
            (None, false) => k.combine_push.of(handle.layout),
            (None, true) => k.dispatch_bwd_push.of(handle.layout),
        };
        let (grad_w_in, grad_w_out) = call.grad_w.unwrap_or((0, 0));
        // What every peer compares before it reads here or waits for this
        // rank (abi.cuh, MOE_EP_FIELD_OP): the op, and where the partials
        // (and weight gradients) lie when they are read in place.
        let mut d = [0u64; DESC_WORDS];
        d[0] = if call.dispatch_bwd {
            desc::OP_DISPATCH_BWD
        } else {
            desc::OP_COMBINE
        };
        match &call.pull {
            Some(q) => {
                d[1] = q.y.1;
                d[2] = q.grad_w.map_or(0, |g| g.1);
            }
            None => {
                d[2] = if call.grad_w.is_some() {
                    desc::PUSHED
                } else {
                    0
                }
            }
        }
        d[desc::HANDLE_WORD] = handle.id;
        let p = CombineParams {
            op: self.op_common(handle),
            y: call.y,
            w_rows: call.w_rows.unwrap_or(0),
            grad_w_in,
            out: call.out,
            grad_w_out,
            y_peers: call.pull.as_ref().map(|q| q.y.0).unwrap_or_default(),
            gw_peers: call
                .pull
                .as_ref()
                .and_then(|q| q.grad_w.map(|g| g.0))
                .unwrap_or_default(),
            num_chunks: self.cfg.combine_chunks as i32,
            _pad: 0,
            desc: d,
            done: call.progress.map_or(0, |q| q.done),
            done_of: call.progress.map_or(0, |q| q.done_of),
        };
        // NOTE: every combine kernel launches with the pushed rank-major
        // ring's shared memory, as the one combine kernel did before the
        // paths had entry points of their own: the L1 / shared split, and so
        // the measured times, stay as they were (BENCHMARKS.md).
        // SAFETY: p mirrors CombineParams; sizes were validated by callers.
        let smem = match (&call.pull, handle.layout) {
            (None, RecvLayout::ExpertMajor { .. }) => EM_COMBINE_SMEM,
            _ => COMBINE_SMEM,
        };
        unsafe { f.launch(stream, self.cfg.num_sms as u32, THREADS, smem, &p)? };
        turn.launched.set(true);
        Ok(())
    }

    /// The one-node path of [`EpGroup::combine`](crate::EpGroup::combine).
    pub fn combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        self.combine_counting(stream, handle, expert_out, weights, out, None)
    }

    /// [`EpGroup::combine`](crate::EpGroup::combine) that counts its finished home rows into
    /// `progress` (the two-level path's node combine); `None` is a plain
    /// combine.
    pub(crate) fn combine_counting(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
        progress: Option<Progress>,
    ) -> Result<()> {
        self.op(
            "moe_ep::combine",
            desc::OP_COMBINE,
            stream,
            Some(handle),
            |turn| {
                self.combine_on_turn(
                    OnTurn {
                        turn,
                        stream,
                        handle,
                    },
                    expert_out,
                    weights,
                    out,
                    progress,
                )
            },
        )
    }

    fn combine_on_turn(
        &self,
        at: OnTurn<'_, '_>,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
        progress: Option<Progress>,
    ) -> Result<()> {
        let OnTurn {
            turn,
            stream,
            handle,
        } = at;
        Self::check_meta(handle)?;
        let (t, h) = (handle.num_tokens, self.cfg.hidden);
        let cap = handle.rows_held(self.recv_capacity);
        self.check_region(
            "expert_out",
            expert_out,
            cap * h,
            "[recv_capacity, hidden] bf16",
            ROW_ALIGN,
        )?;
        self.check_region("out", &*out, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
        let w_rows = match (weights, handle.layout) {
            (None, _) => None,
            (Some(_), RecvLayout::RankMajor) => {
                return Err(Error::arg("weights", "None for a rank-major handle (a rank-major row already stands for all of the token's experts on that rank: weight them before combine)", "Some"))
            }
            (Some(w), RecvLayout::ExpertMajor { .. }) => {
                self.check_region("weights", w, cap, "[recv_capacity] f32", 4)?;
                Some(w.device_ptr())
            }
        };
        let pull = self.pull_peers(handle, expert_out, None);
        self.launch_combine(
            turn,
            stream,
            handle,
            CombineCall {
                y: expert_out.device_ptr(),
                out: out.device_ptr(),
                w_rows,
                grad_w: None,
                pull,
                dispatch_bwd: false,
                progress,
            },
        )
    }

    /// The one-node path of [`EpGroup::dispatch_backward`](crate::EpGroup::dispatch_backward).
    pub fn dispatch_backward(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        args: DispatchBackwardArgs<'_>,
    ) -> Result<()> {
        self.dispatch_backward_counting(stream, handle, args, None)
    }

    /// [`EpGroup::dispatch_backward`](crate::EpGroup::dispatch_backward) that counts its finished home rows
    /// (of `grad_tokens`) into `progress`, as [`NodeGroup::combine_counting`].
    pub(crate) fn dispatch_backward_counting(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        args: DispatchBackwardArgs<'_>,
        progress: Option<Progress>,
    ) -> Result<()> {
        self.op(
            "moe_ep::dispatch_backward",
            desc::OP_DISPATCH_BWD,
            stream,
            Some(handle),
            |turn| self.dispatch_backward_on_turn(turn, stream, handle, args, progress),
        )
    }

    fn dispatch_backward_on_turn(
        &self,
        turn: &OpTurn<'_>,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        args: DispatchBackwardArgs<'_>,
        progress: Option<Progress>,
    ) -> Result<()> {
        let DispatchBackwardArgs {
            grad_recv_tokens,
            grad_recv_topk_weights,
            grad_tokens,
            grad_topk_weights,
        } = args;
        Self::check_meta(handle)?;
        let (t, k, h) = (handle.num_tokens, handle.topk, self.cfg.hidden);
        let cap = handle.rows_held(self.recv_capacity);
        let wpr = handle.layout.weights_per_row(k);
        self.check_region(
            "grad_recv_tokens",
            grad_recv_tokens,
            cap * h,
            "[recv_capacity, hidden] bf16",
            ROW_ALIGN,
        )?;
        self.check_region(
            "grad_tokens",
            &*grad_tokens,
            t * h,
            "[T, hidden] bf16",
            ROW_ALIGN,
        )?;
        let grad_w = match (grad_recv_topk_weights, grad_topk_weights) {
            (Some(a), Some(b)) => {
                self.check_region(
                    "grad_recv_topk_weights",
                    a,
                    cap * wpr,
                    "recv_capacity rows of weights",
                    4,
                )?;
                self.check_region("grad_topk_weights", &*b, t * k, "[T, K] f32", 4)?;
                Some((a.device_ptr(), b.device_ptr()))
            }
            (None, None) => None,
            _ => {
                return Err(Error::arg(
                    "grad_topk_weights",
                    "given together with grad_recv_topk_weights",
                    "only one of the two",
                ))
            }
        };
        let pull = self.pull_peers(handle, grad_recv_tokens, grad_recv_topk_weights);
        self.launch_combine(
            turn,
            stream,
            handle,
            CombineCall {
                y: grad_recv_tokens.device_ptr(),
                out: grad_tokens.device_ptr(),
                w_rows: None,
                grad_w,
                pull,
                dispatch_bwd: true,
                progress,
            },
        )
    }
}
