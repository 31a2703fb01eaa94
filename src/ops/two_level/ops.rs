//! The two-level path's ops: layout, dispatch, combine and both backward
//! passes ([`TwoLevelPath::layout`] and the rest), each the node group's op
//! around the network hop (the module docs of `two_level/` say what each
//! op runs).
//!
//! Kernels: `kernels-cuda/two_level.cu`. Tests: `tests/gpu_two_level.rs`
//! (virtual nodes).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use half::bf16;

use super::handle::TwoLevelHandle;
use super::path::{alloc, dptr, grid, TwoLevelPath, STREAM_THREADS, THREADS};
use super::plan::{Chunks, Plan};
use crate::error::{Error, Result};
use crate::ops::abi::{self, TwoLevelParams};
use crate::ops::buffers::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, Dispatched, RecvBuf, TopkIdx,
    ROW_ALIGN,
};
use crate::ops::node::group::OpStreams;
use crate::ops::node::layout_op::tokens_of_routing;
use crate::ops::node::turn::refused_arg;
use crate::runtime::nvtx;
use crate::symm::SymmBuffer;
use crate::types::RecvLayout;

impl TwoLevelPath {
    /// Computes the two-level routing (collective over the world, and waits
    /// on the host): the node streams, their lengths on every rank, the
    /// forward batch's ids and origins at the rail peers, and the node
    /// group's layout of it. `topk_idx` is `[T, topk]`, `T <=
    /// max_tokens_per_rank`; a bad expert id (outside `-1..E`, or twice in
    /// a token) on any rank fails every rank here with
    /// [`Error::InvalidDeviceData`] naming `topk_idx`, the rank, the token
    /// and the slot.
    pub fn layout(
        &self,
        stream: &Arc<CudaStream>,
        topk_idx: TopkIdx<'_>,
        topk: usize,
        layout: RecvLayout,
    ) -> Result<TwoLevelHandle> {
        let _range = nvtx::range("moe_ep::two_level::layout");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        // The caller's buffers ordered with this op's stream (their own
        // streams wait for it when it ends).
        let mut order = OpStreams::start(stream);
        let (idx_ptr, idx_len) = topk_idx.ptr_len();
        // This rank's own checks, before any collective step; a refusal is
        // still this rank's part of the world's all-gather below, so that
        // every rank's layout fails at once naming it.
        let checked = (|| {
            let t = tokens_of_routing(topk, idx_len, &self.cfg)?;
            let elem = match topk_idx {
                TopkIdx::I32(b) => {
                    self.node.check_region_in(
                        &mut order,
                        "topk_idx",
                        b,
                        t * topk,
                        "[T, K] i32",
                        4,
                    )?;
                    4
                }
                TopkIdx::I64(b) => {
                    self.node.check_region_in(
                        &mut order,
                        "topk_idx",
                        b,
                        t * topk,
                        "[T, K] i64",
                        8,
                    )?;
                    8
                }
            };
            // The node group's layout refuses what its kernels cannot
            // take: here, before any collective step.
            layout.check_for_kernels()?;
            Ok((t, elem))
        })();
        let (t, elem) = match checked {
            Ok(v) => v,
            Err(e) => return Err(self.refuse_layout(stream, e)),
        };
        let (rank, n) = (self.comm.rank(), self.topology.nodes());
        let me = self.topology.node_of(rank);
        self.comm
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let pos = alloc::<i32>(stream, t * n)?;
        let lens = alloc::<i32>(stream, n + 1)?;
        let mut p = TwoLevelParams {
            topk_idx: idx_ptr,
            pos: dptr(&pos),
            lens: dptr(&lens),
            num_tokens: t as i32,
            topk: topk as i32,
            num_experts: self.cfg.num_experts as i32,
            nodes: n as i32,
            node: me as i32,
            home_rank: rank as i32,
            ..Default::default()
        };
        let (streams, pack_ids) = match topk_idx {
            TopkIdx::I32(_) => (&self.k.streams_i32, &self.k.pack_ids_i32),
            TopkIdx::I64(_) => (&self.k.streams_i64, &self.k.pack_ids_i64),
        };
        // SAFETY: p mirrors TwoLevelParams; topk_idx holds [T, K] (checked),
        // pos [T, N] and lens [N + 1] were allocated above.
        unsafe { streams.launch(stream, n as u32, STREAM_THREADS, 0, &p)? };
        // Drained before the pageable copy (see `NodeHandle::host_counts`).
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let host_lens = stream
            .clone_dtoh(&lens)
            .map_err(Error::cuda("cuMemcpyDtoH"))?;
        // Every rank's lengths and verdict (the all-gather waits for the
        // kernel on every rank).
        let all = self.comm.all_gather_host(stream, &host_lens)?;
        if let Some(e) = refusal_in(&all, n) {
            return Err(e);
        }
        for (r, theirs) in all.chunks(n + 1).enumerate() {
            if theirs[n] != 0 {
                return Err(self.bad_entry(stream, r, theirs[n] - 1, topk, idx_ptr, elem));
            }
        }
        let lens_all: Vec<usize> = all
            .chunks(n + 1)
            .flat_map(|c| c[..n].iter().map(|&v| v as usize))
            .collect();
        let plan = Plan::new(&self.topology, rank, &lens_all)?;
        let (fwd_rows, sent_rows, row_off) = (plan.fwd_rows, plan.sent_rows, plan.row_off);
        let own_ids = alloc::<i32>(stream, fwd_rows * topk)?;
        let net_ids = alloc::<i32>(stream, sent_rows * topk)?;
        let net_origin = alloc::<i32>(stream, sent_rows * 2)?;
        // Collective: the same size on every rank of the node.
        let origin: SymmBuffer<i32> = self
            .node
            .pool()
            .alloc(n * self.cfg.max_tokens_per_rank * 2)?;
        origin.used_on(stream)?;
        p.row_off = row_off;
        p.own_ids = dptr(&own_ids);
        p.net_ids = dptr(&net_ids);
        p.own_origin = origin.device_ptr();
        p.net_origin = dptr(&net_origin);
        // SAFETY: as above; the rows written are those of the streams, inside
        // the forward batch (fwd_rows) and the send range (sent_rows).
        unsafe { pack_ids.launch(stream, grid(t, THREADS as usize), THREADS, 0, &p)? };
        self.hop(
            stream,
            &plan,
            (dptr(&own_ids), dptr(&net_ids), 4 * topk),
            true,
            None,
        )?;
        self.hop(
            stream,
            &plan,
            (origin.device_ptr(), dptr(&net_origin), 8),
            true,
            None,
        )?;
        let ids = own_ids.slice(0..fwd_rows * topk);
        let node = self.node.layout(stream, TopkIdx::I32(&ids), topk, layout)?;
        let received = node.host_counts(stream)?.recv_rows;
        let (rounds, first, table) =
            Chunks::plan(&self.topology, rank, &lens_all, &plan, self.chunk_rows);
        let flags = table.len() - plan.fwd_rows;
        if flags > self.arrive.len() {
            return Err(Error::InvalidState(format!(
                "rank {rank}: {flags} chunks of the hop, more than the {} arrival flags",
                self.arrive.len()
            )));
        }
        let mut table = table;
        table.push(-1); // never empty
        let table = stream
            .clone_htod(&table)
            .map_err(Error::cuda("cuMemcpyHtoD"))?;
        let chunks = Chunks {
            rounds,
            first,
            table,
        };
        Ok(TwoLevelHandle {
            node,
            num_tokens: t,
            topk,
            pos,
            plan,
            own_ids,
            net_ids,
            origin,
            received,
            chunks,
            group: self.id,
        })
    }

    /// A layout this rank's host refused (`e`): its part of the world's
    /// all-gather of the layout still comes, its verdict word naming the
    /// argument, so that every other rank's layout fails at once with
    /// [`Error::PeerFailed`] naming this rank (nothing of the layout is
    /// enqueued on any rank: the group stays in step). Returns `e`.
    pub(crate) fn refuse_layout(&self, stream: &Arc<CudaStream>, e: Error) -> Error {
        let n = self.topology.nodes();
        let mut words = vec![0i32; n + 1];
        words[n] = -1 - refused_arg(&e) as i32;
        let told = self
            .comm
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))
            .and_then(|()| self.comm.all_gather_host(stream, &words));
        if let Err(p) = told {
            tracing::warn!("telling the peers of a refused layout failed: {p}");
        }
        e
    }

    /// Sends every token to the ranks of its experts: over the network to
    /// its rail peers, then inside each node (the node group's dispatch).
    /// `x` is `[T, H]` bf16, `topk_weights` `[T, K]` f32; `out` as for
    /// [`EpGroup::dispatch`](crate::EpGroup::dispatch) (buffers of the node group's pool). The rows
    /// are the flat dispatch's, grouped by forwarding rank, then home node,
    /// then token; `src` gives each row's (home rank, home token).
    pub fn dispatch<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
    ) -> Result<Dispatched<'a>> {
        let _range = nvtx::range("moe_ep::two_level::dispatch");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, k, h) = (handle.num_tokens, handle.topk, self.cfg.hidden);
        self.node
            .check_region_in(&mut order, "x", x, t * h, "[T, hidden] bf16", ROW_ALIGN)?;
        self.node.check_region_in(
            &mut order,
            "topk_weights",
            topk_weights,
            t * k,
            "[T, K] f32",
            4,
        )?;
        let plan = &handle.plan;
        let fwd_x = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        let fwd_w = alloc::<f32>(stream, plan.fwd_rows * k)?;
        let net_x = alloc::<bf16>(stream, plan.sent_rows * h)?;
        let net_w = alloc::<f32>(stream, plan.sent_rows * k)?;
        self.pack_rows(
            stream,
            handle,
            (x.device_ptr(), topk_weights.device_ptr()),
            &fwd_x,
            &net_x,
            Some((&fwd_w, &net_w)),
        )?;
        // The hop in rounds on the hop stream; the node dispatch, enqueued
        // after them on `stream`, waits for each row's chunk.
        let arrival = self.hop_forward_in_chunks(
            stream,
            handle,
            &[
                (dptr(&fwd_x), dptr(&net_x), 2 * h),
                (dptr(&fwd_w), dptr(&net_w), 4 * k),
            ],
        )?;
        let (xs, ws) = (
            fwd_x.slice(0..plan.fwd_rows * h),
            fwd_w.slice(0..plan.fwd_rows * k),
        );
        let got = self
            .node
            .dispatch_arriving(stream, &handle.node, &xs, &ws, out, Some(&arrival));
        self.rejoin(stream)?;
        let mut got = got?;
        got.src = self.remap_src(stream, handle, got.src)?;
        Ok(got)
    }

    /// Brings expert outputs home and sums them per token in a fixed order:
    /// inside each node as the node group's combine (ascending rank), then,
    /// at home, over the nodes ascending (f32 from 0, one bf16 term per
    /// node, one rounding); the same bits on every run. Arguments as for
    /// [`EpGroup::combine`](crate::EpGroup::combine), in this handle's receive layout.
    pub fn combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()> {
        let _range = nvtx::range("moe_ep::two_level::combine");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, h) = (handle.num_tokens, self.cfg.hidden);
        self.node.check_region_in(
            &mut order,
            "out",
            &*out,
            t * h,
            "[T, hidden] bf16",
            ROW_ALIGN,
        )?;
        let plan = &handle.plan;
        let mut fwd = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        let net = alloc::<bf16>(stream, plan.sent_rows * h)?;
        let (own, home) = (dptr(&fwd), dptr(&net));
        self.hop_home_in_chunks(stream, handle, own, home, |progress| {
            let mut view = fwd.slice_mut(0..plan.fwd_rows * h);
            self.node.combine_counting(
                stream,
                &handle.node,
                expert_out,
                weights,
                &mut view,
                Some(progress),
            )
        })?;
        let summed = self.node_sum(stream, handle, &fwd, &net, out.device_ptr());
        self.rejoin(stream)?;
        summed
    }

    /// Backward of dispatch: the gradient of the received tokens combined
    /// home (unweighted, in combine's order), and the gradient of the
    /// received weights routed back to `[T, K]` (`grad_topk_weights`, when
    /// given). Arguments as for [`EpGroup::dispatch_backward`](crate::EpGroup::dispatch_backward).
    pub fn dispatch_backward(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        args: DispatchBackwardArgs<'_>,
    ) -> Result<()> {
        let DispatchBackwardArgs {
            grad_recv_tokens,
            grad_recv_topk_weights,
            grad_tokens,
            grad_topk_weights,
        } = args;
        let _range = nvtx::range("moe_ep::two_level::dispatch_backward");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, k, h) = (handle.num_tokens, handle.topk, self.cfg.hidden);
        self.node.check_region_in(
            &mut order,
            "grad_tokens",
            &*grad_tokens,
            t * h,
            "[T, hidden] bf16",
            ROW_ALIGN,
        )?;
        if let Some(g) = grad_topk_weights.as_deref() {
            self.node.check_region_in(
                &mut order,
                "grad_topk_weights",
                g,
                t * k,
                "[T, K] f32",
                4,
            )?;
        }
        let plan = &handle.plan;
        let mut fwd = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        // The weight gradients' rows only when they are asked for.
        let mut fwd_w = match grad_topk_weights {
            Some(_) => Some(alloc::<f32>(stream, plan.fwd_rows * k)?),
            None => None,
        };
        let net = alloc::<bf16>(stream, plan.sent_rows * h)?;
        let (own, home) = (dptr(&fwd), dptr(&net));
        self.hop_home_in_chunks(stream, handle, own, home, |progress| {
            let mut view = fwd.slice_mut(0..plan.fwd_rows * h);
            let mut view_w = fwd_w.as_mut().map(|w| w.slice_mut(0..plan.fwd_rows * k));
            let gw = view_w.as_mut().map(|v| v as &mut dyn DeviceRegionMut<f32>);
            let args = DispatchBackwardArgs {
                grad_recv_tokens,
                grad_recv_topk_weights,
                grad_tokens: &mut view,
                grad_topk_weights: gw,
            };
            self.node
                .dispatch_backward_counting(stream, &handle.node, args, Some(progress))
        })?;
        let summed = self.node_sum(stream, handle, &fwd, &net, grad_tokens.device_ptr());
        self.rejoin(stream)?;
        summed?;
        if let (Some(g), Some(fwd_w)) = (grad_topk_weights, fwd_w) {
            let net_w = alloc::<f32>(stream, plan.sent_rows * k)?;
            self.hop(
                stream,
                plan,
                (dptr(&fwd_w), dptr(&net_w), 4 * k),
                false,
                None,
            )?;
            let mut p = self.params(handle);
            p.own_w = dptr(&fwd_w);
            p.net_w = dptr(&net_w);
            p.out_w = g.device_ptr();
            // SAFETY: p mirrors TwoLevelParams; out_w holds [T, K] (checked),
            // the weight rows every row the handle's streams name.
            unsafe {
                self.k
                    .gather_w
                    .launch(stream, grid(t * k, THREADS as usize), THREADS, 0, &p)?
            };
        }
        Ok(())
    }

    /// Backward of combine: the gradient of the output `[T, H]` sent to
    /// every row of the token (over the network to the rail peers, then the
    /// node group's combine backward); with `weights` (expert-major, as
    /// given to combine) each row is scaled by its weight. Arguments as for
    /// [`EpGroup::combine_backward`](crate::EpGroup::combine_backward).
    pub fn combine_backward<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &TwoLevelHandle,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
    ) -> Result<RecvBuf<'a, bf16>> {
        let _range = nvtx::range("moe_ep::two_level::combine_backward");
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.check_handle(handle)?;
        let mut order = OpStreams::start(stream);
        let (t, h) = (handle.num_tokens, self.cfg.hidden);
        self.node.check_region_in(
            &mut order,
            "grad_out",
            grad_out,
            t * h,
            "[T, hidden] bf16",
            ROW_ALIGN,
        )?;
        let plan = &handle.plan;
        let fwd = alloc::<bf16>(stream, plan.fwd_rows * h)?;
        let net = alloc::<bf16>(stream, plan.sent_rows * h)?;
        self.pack_rows(stream, handle, (grad_out.device_ptr(), 0), &fwd, &net, None)?;
        let arrival =
            self.hop_forward_in_chunks(stream, handle, &[(dptr(&fwd), dptr(&net), 2 * h)])?;
        let view = fwd.slice(0..plan.fwd_rows * h);
        let got = self.node.combine_backward_arriving(
            stream,
            &handle.node,
            &view,
            weights,
            grad_expert_out,
            Some(&arrival),
        );
        self.rejoin(stream)?;
        got
    }
}

/// The first rank whose part of a layout's all-gather (`all`: every rank's
/// `n + 1` words, the last its verdict) says its host refused the layout
/// (a negative verdict: `-1 - argument id`), as every rank's error.
fn refusal_in(all: &[i32], n: usize) -> Option<Error> {
    all.chunks(n + 1).enumerate().find_map(|(r, w)| {
        (w[n] < 0).then(|| {
            let arg = Some(abi::arg_name((-1 - i64::from(w[n])) as u64))
                .filter(|&a| a != abi::ARG_NAMES[0]);
            Error::PeerFailed {
                peer: r,
                arg,
                reason: format!(
                    "its host refused its part of the layout{} (its own error says why)",
                    arg.map_or(String::new(), |a| format!(": argument `{a}`"))
                ),
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_layout_in_the_all_gather_names_the_rank_and_argument() {
        // Three ranks of two nodes: lengths, then the verdict.
        let topk_idx = abi::arg_id("topk_idx") as i32;
        let all = [3, 4, 0, 0, 0, -1 - topk_idx, 5, 6, 2];
        match refusal_in(&all, 2) {
            Some(Error::PeerFailed {
                peer: 1,
                arg: Some("topk_idx"),
                reason,
            }) => assert!(reason.contains("`topk_idx`"), "{reason}"),
            other => panic!("{other:?}"),
        }
        // A bad entry (a positive verdict) and no verdict are no refusal.
        assert!(refusal_in(&[3, 4, 0, 1, 2, 7], 2).is_none());
        // An error naming no known argument.
        match refusal_in(&[0, 0, -1], 2) {
            Some(Error::PeerFailed {
                peer: 0, arg: None, ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
