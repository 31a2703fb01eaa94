//! Dispatch ([`EpGroup::dispatch`](crate::EpGroup::dispatch)) and the combine backward
//! ([`EpGroup::combine_backward`](crate::EpGroup::combine_backward), a dispatch of the output gradient):
//! argument checks, receive buffers, and the launch of one kernel per
//! receive layout.
//!
//! Kernels: `kernels-cuda/dispatch.cu` (`moe_ep_dispatch_rank_major` /
//! `_expert_major`, `moe_ep_combine_bwd_rank_major` / `_expert_major`).
//! Tests: `tests/gpu_intranode.rs` (every routing case bit for bit against
//! the CPU reference, zero copy, capacity, CUDA graphs; the combine
//! backward weighted and not).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use super::group::NodeGroup;
use super::handle::NodeHandle;
use super::turn::OnTurn;
use crate::error::{Error, Result};
use crate::ops::abi::{desc, DispatchParams, DESC_WORDS, MAX_RANKS, THREADS};
use crate::ops::buffers::{
    DeviceRegion, DeviceRegionMut, DispatchOut, DispatchOutFp8, Dispatched, DispatchedFp8, Fp8Rows,
    Fp8Scales, Peers, RecvBuf, RecvScales, RecvScalesOut, ROW_ALIGN,
};
use crate::symm::SymmBuffer;
use crate::types::RecvLayout;

/// Every rank's address of a symmetric buffer, and where it lies (the
/// descriptor word, [`NodeGroup::located`]).
type Located = (Peers, u64);

/// Where a dispatch's input rows arrive while it runs (device addresses):
/// `flags[c]` reaches `epoch` once chunk `c` has landed, `row_chunk[t]` is
/// row `t`'s chunk (-1: already there), `chunk_peer[c]` the rank sending
/// chunk `c`. The flags are written in stream order on another stream; the
/// kernel waits for each row's chunk (bounded: a chunk that never lands is
/// a timeout naming its sender and "network hop arrival").
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arrival {
    pub flags: u64,
    pub row_chunk: u64,
    pub chunk_peer: u64,
    pub epoch: u64,
}

/// fp8 rows: where their scales are (`[T, H / 128]` 4-byte words) and
/// land, and the payload code of the descriptor (`desc::PAYLOAD_*`).
#[derive(Clone, Copy)]
struct Fp8Send {
    xs: u64,
    recv_xs: Located,
    payload: u64,
}

/// What one dispatch-kernel launch moves, besides the rows. (Built and
/// consumed within one call: its size does not matter.)
#[allow(clippy::large_enum_variant)]
enum Rows {
    /// Dispatch: the top-k weights `[T, K]` travel with the rows, and every
    /// receiver gets its rows' weights, local expert ids and sources.
    Tokens {
        topk_w: u64,
        recv_w: Located,
        recv_idx: Located,
        recv_src: Located,
        fp8: Option<Fp8Send>,
    },
    /// Combine backward: the output gradient alone, expert-major rows scaled
    /// by their combine weights when given (`[recv_capacity]` f32, local).
    Gradient { scale_w: Option<u64> },
}

impl NodeGroup {
    /// Launches the dispatch kernel of `handle`'s layout that `rows` asks
    /// for: `x` (`[T, H]` bf16, local) into `recv_x` on every rank.
    fn launch_dispatch(
        &self,
        at: OnTurn<'_, '_>,
        x: u64,
        recv_x: Located,
        rows: Rows,
        arrival: Option<&Arrival>,
    ) -> Result<()> {
        let OnTurn {
            turn,
            stream,
            handle,
        } = at;
        let none = ([0u64; MAX_RANKS], 0);
        let (f, op, topk_w, scale_w, recv_w, recv_idx, recv_src, fp8) = match rows {
            Rows::Tokens {
                topk_w,
                recv_w,
                recv_idx,
                recv_src,
                fp8,
            } => (
                &self.k.dispatch,
                desc::OP_DISPATCH,
                topk_w,
                0,
                recv_w,
                recv_idx,
                recv_src,
                fp8,
            ),
            Rows::Gradient { scale_w } => (
                &self.k.combine_bwd,
                desc::OP_COMBINE_BWD,
                0,
                scale_w.unwrap_or(0),
                none,
                none,
                none,
                None,
            ),
        };
        let h = self.cfg.hidden;
        let (payload, xs, recv_xs, row16, scale_words) = match fp8 {
            Some(f) => (f.payload, f.xs, f.recv_xs, h / 16, h / 128),
            None => (desc::PAYLOAD_BF16, 0, none, 0, 0),
        };
        // What every peer compares before it writes here (abi.cuh,
        // MOE_EP_FIELD_OP): the op (and its rows' payload) and where each
        // buffer lies.
        let mut d = [0u64; DESC_WORDS];
        d[..6].copy_from_slice(&[
            op | payload << 8,
            recv_x.1,
            recv_w.1,
            recv_idx.1,
            recv_src.1,
            recv_xs.1,
        ]);
        d[desc::HANDLE_WORD] = handle.id;
        let p = DispatchParams {
            op: self.op_common(handle),
            x,
            topk_w,
            scale_w,
            recv_x: recv_x.0,
            recv_w: recv_w.0,
            recv_idx: recv_idx.0,
            recv_src: recv_src.0,
            desc: d,
            meta: handle.meta_peers()?,
            arrive: arrival.map_or(0, |a| a.flags),
            arrive_of: arrival.map_or(0, |a| a.row_chunk),
            arrive_peer: arrival.map_or(0, |a| a.chunk_peer),
            arrive_epoch: arrival.map_or(0, |a| a.epoch),
            xs,
            recv_xs: recv_xs.0,
            row16: row16 as i32,
            scale_words: scale_words as i32,
            zero_pad: self.cfg.zero_padding as i32,
            _pad: 0,
        };
        // SAFETY: p mirrors DispatchParams; sizes were validated by callers.
        unsafe {
            f.of(handle.layout)
                .launch(stream, self.cfg.num_sms as u32, THREADS, 0, &p)?;
        }
        turn.launched.set(true);
        handle
            .meta_written
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Sends every token to the ranks of its experts, writing straight into
    /// each receiver's buffers (zero copy). `x` is `[T, H]` bf16,
    /// `topk_weights` `[T, K]` f32, matching the handle's routing.
    pub fn dispatch<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
    ) -> Result<Dispatched<'a>> {
        self.dispatch_arriving(stream, handle, x, topk_weights, out, None)
    }

    /// [`EpGroup::dispatch`](crate::EpGroup::dispatch) of rows that land in `x` and `topk_weights`
    /// while the kernel runs (`arrival`: the two-level path's forward batch,
    /// chunk by chunk); `None` is a plain dispatch.
    pub(crate) fn dispatch_arriving<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
        arrival: Option<&Arrival>,
    ) -> Result<Dispatched<'a>> {
        self.op(
            "moe_ep::dispatch",
            desc::OP_DISPATCH,
            stream,
            Some(handle),
            |turn| {
                self.dispatch_on_turn(
                    OnTurn {
                        turn,
                        stream,
                        handle,
                    },
                    x,
                    topk_weights,
                    out,
                    arrival,
                )
            },
        )
    }

    fn dispatch_on_turn<'a>(
        &self,
        at: OnTurn<'_, '_>,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
        arrival: Option<&Arrival>,
    ) -> Result<Dispatched<'a>> {
        let (t, h) = (at.handle.num_tokens, self.cfg.hidden);
        self.check_region("x", x, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
        let tokens = self.recv_buf(
            at.handle,
            out.recv_tokens,
            "recv_tokens",
            h,
            "[recv_capacity, hidden] bf16",
            ROW_ALIGN,
        )?;
        let recv_x = self.located(&tokens, "recv_tokens")?;
        let (topk_weights, topk_idx, src) = self.send_rows(
            at,
            (x.device_ptr(), recv_x),
            None,
            topk_weights,
            out.recv_topk_weights,
            arrival,
        )?;
        Ok(Dispatched {
            tokens,
            topk_weights,
            topk_idx,
            src,
        })
    }

    /// fp8 rows: [`EpGroup::dispatch_fp8`](crate::EpGroup::dispatch_fp8) on one node.
    pub fn dispatch_fp8<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        x: Fp8Rows<'_>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOutFp8<'a>,
    ) -> Result<DispatchedFp8<'a>> {
        self.op(
            "moe_ep::dispatch_fp8",
            desc::OP_DISPATCH,
            stream,
            Some(handle),
            |turn| {
                self.dispatch_fp8_on_turn(
                    OnTurn {
                        turn,
                        stream,
                        handle,
                    },
                    x,
                    topk_weights,
                    out,
                )
            },
        )
    }

    fn dispatch_fp8_on_turn<'a>(
        &self,
        at: OnTurn<'_, '_>,
        x: Fp8Rows<'_>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOutFp8<'a>,
    ) -> Result<DispatchedFp8<'a>> {
        let (t, h) = (at.handle.num_tokens, self.cfg.hidden);
        if !h.is_multiple_of(128) {
            return Err(Error::arg(
                "hidden",
                "a multiple of 128 for fp8 rows (16-byte rows of codes, 4-byte rows of scales)",
                h,
            ));
        }
        self.check_region("x.codes", x.codes, t * h, "[T, hidden] e4m3", ROW_ALIGN)?;
        let (xs, payload) = match x.scales {
            Fp8Scales::E8m0Per32(s) => {
                self.check_region("x.scales", s, t * h / 32, "[T, hidden / 32] e8m0", 4)?;
                (s.device_ptr(), desc::PAYLOAD_FP8_E8M0_32)
            }
            Fp8Scales::F32Per128(s) => {
                self.check_region("x.scales", s, t * h / 128, "[T, hidden / 128] f32", 4)?;
                (s.device_ptr(), desc::PAYLOAD_FP8_F32_128)
            }
        };
        let e8m0 = payload == desc::PAYLOAD_FP8_E8M0_32;
        let e8 = |c: Option<&'a mut dyn DeviceRegionMut<u8>>| {
            self.recv_buf(
                at.handle,
                c,
                "recv_scales",
                h / 32,
                "[recv_capacity, hidden / 32] e8m0",
                4,
            )
        };
        let f32s = |c: Option<&'a mut dyn DeviceRegionMut<f32>>| {
            self.recv_buf(
                at.handle,
                c,
                "recv_scales",
                h / 128,
                "[recv_capacity, hidden / 128] f32",
                4,
            )
        };
        let scales = match (out.recv_scales, e8m0) {
            (None, true) => RecvScales::E8m0Per32(e8(None)?),
            (Some(RecvScalesOut::E8m0Per32(b)), true) => RecvScales::E8m0Per32(e8(Some(b))?),
            (None, false) => RecvScales::F32Per128(f32s(None)?),
            (Some(RecvScalesOut::F32Per128(b)), false) => RecvScales::F32Per128(f32s(Some(b))?),
            (Some(_), _) => {
                return Err(Error::arg(
                    "recv_scales",
                    "scales of the kind x.scales holds",
                    "the other kind",
                ))
            }
        };
        let codes = self.recv_buf(
            at.handle,
            out.recv_codes,
            "recv_codes",
            h,
            "[recv_capacity, hidden] e4m3",
            ROW_ALIGN,
        )?;
        let recv_x = self.located(&codes, "recv_codes")?;
        let recv_xs = match &scales {
            RecvScales::E8m0Per32(b) => self.located(b, "recv_scales")?,
            RecvScales::F32Per128(b) => self.located(b, "recv_scales")?,
        };
        let fp8 = Fp8Send {
            xs,
            recv_xs,
            payload,
        };
        let (topk_weights, topk_idx, src) = self.send_rows(
            at,
            (x.codes.device_ptr(), recv_x),
            Some(fp8),
            topk_weights,
            out.recv_topk_weights,
            None,
        )?;
        Ok(DispatchedFp8 {
            codes,
            scales,
            topk_weights,
            topk_idx,
            src,
        })
    }

    /// The part of a dispatch that both payloads share: the top-k weights
    /// checked, the receive metadata made, the kernel launched with the
    /// rows `x` (local address, and where they land).
    fn send_rows<'a>(
        &self,
        at: OnTurn<'_, '_>,
        x: (u64, Located),
        fp8: Option<Fp8Send>,
        topk_weights: &dyn DeviceRegion<f32>,
        recv_topk_weights: Option<&'a mut dyn DeviceRegionMut<f32>>,
        arrival: Option<&Arrival>,
    ) -> Result<(RecvBuf<'a, f32>, SymmBuffer<i32>, SymmBuffer<i32>)> {
        let OnTurn {
            turn,
            stream,
            handle,
        } = at;
        let (t, k, cap) = (handle.num_tokens, handle.topk, self.recv_capacity);
        self.check_region("topk_weights", topk_weights, t * k, "[T, K] f32", 4)?;
        let wpr = handle.layout.weights_per_row(k);
        let weights = self.recv_buf(
            handle,
            recv_topk_weights,
            "recv_topk_weights",
            wpr,
            "recv_capacity rows of weights",
            4,
        )?;
        let idx: SymmBuffer<i32> = self.pool.alloc(cap * wpr)?;
        let src: SymmBuffer<i32> = self.pool.alloc(cap * 2)?;
        let rows = Rows::Tokens {
            topk_w: topk_weights.device_ptr(),
            recv_w: self.located(&weights, "recv_topk_weights")?,
            recv_idx: self.located(&idx, "recv_topk_idx")?,
            recv_src: self.located(&src, "recv_src")?,
            fp8,
        };
        self.launch_dispatch(
            OnTurn {
                turn,
                stream,
                handle,
            },
            x.0,
            x.1,
            rows,
            arrival,
        )?;
        Ok((weights, idx, src))
    }

    /// The one-node path of [`EpGroup::combine_backward`](crate::EpGroup::combine_backward).
    pub fn combine_backward<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
    ) -> Result<RecvBuf<'a, bf16>> {
        self.combine_backward_arriving(stream, handle, grad_out, weights, grad_expert_out, None)
    }

    /// [`EpGroup::combine_backward`](crate::EpGroup::combine_backward) of a gradient whose rows land in
    /// `grad_out` while the kernel runs (`arrival`, as for
    /// [`NodeGroup::dispatch_arriving`]); `None` is a plain combine backward.
    pub(crate) fn combine_backward_arriving<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &NodeHandle,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
        arrival: Option<&Arrival>,
    ) -> Result<RecvBuf<'a, bf16>> {
        self.op(
            "moe_ep::combine_backward",
            desc::OP_COMBINE_BWD,
            stream,
            Some(handle),
            |turn| {
                self.combine_backward_on_turn(
                    OnTurn {
                        turn,
                        stream,
                        handle,
                    },
                    grad_out,
                    weights,
                    grad_expert_out,
                    arrival,
                )
            },
        )
    }

    fn combine_backward_on_turn<'a>(
        &self,
        at: OnTurn<'_, '_>,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
        arrival: Option<&Arrival>,
    ) -> Result<RecvBuf<'a, bf16>> {
        let OnTurn {
            turn,
            stream,
            handle,
        } = at;
        let (t, h) = (handle.num_tokens, self.cfg.hidden);
        let cap = handle.rows_held(self.recv_capacity);
        self.check_region("grad_out", grad_out, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
        let scale_w = match (weights, handle.layout) {
            (None, _) => None,
            (Some(_), RecvLayout::RankMajor) => {
                return Err(Error::arg(
                    "weights",
                    "None for a rank-major handle",
                    "Some",
                ))
            }
            (Some(w), _) => {
                self.check_region("weights", w, cap, "[recv_capacity] f32", 4)?;
                Some(w.device_ptr())
            }
        };
        let out = self.recv_buf(
            handle,
            grad_expert_out,
            "grad_expert_out",
            h,
            "[recv_capacity, hidden] bf16",
            ROW_ALIGN,
        )?;
        let recv_x = self.located(&out, "grad_expert_out")?;
        self.launch_dispatch(
            OnTurn {
                turn,
                stream,
                handle,
            },
            grad_out.device_ptr(),
            recv_x,
            Rows::Gradient { scale_w },
            arrival,
        )?;
        Ok(out)
    }
}
