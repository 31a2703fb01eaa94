//! The layout op ([`EpGroup::layout`](crate::EpGroup::layout)): from a batch's routing, every
//! token's row on every receiver and the count matrix of all ranks, kept in
//! a [`Handle`](crate::Handle), and the routing checks every path's layout
//! makes (`tokens_of_routing`). The kernels' view of a [`RecvLayout`] and
//! the exchange's shared memory are in `kernels.rs`.
//!
//! Kernels: `kernels-cuda/layout.cu` (`moe_ep_layout_scan_i32` / `_i64`: the
//! scan, then the exchange in the scan's last block). Tests:
//! `tests/gpu_intranode.rs` (every case runs the layout and checks
//! `NodeHandle::host_counts` against the reference; bad and duplicate expert
//! ids; capacity exceeded; 1024 experts).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::group::NodeGroup;
use super::handle::{ArenaOffsets, NodeHandle};
use super::kernels::exchange_smem;
use super::turn::OpTurn;
use crate::error::{Error, Result};
use crate::ops::abi::{
    desc, layout_check_blocks, layout_info_len, LayoutParams, MAX_TOPK, SCAN_EXPERTS, SCAN_THREADS,
};
use crate::ops::buffers::TopkIdx;
use crate::ops::config::{GroupConfig, Overflow};
use crate::types::RecvLayout;

/// The tokens of a `[T, topk]` routing of `idx_len` entries, after the
/// checks every layout makes: `topk` in `1..=MAX_TOPK` and at most the
/// experts, `idx_len` a multiple of it, `T` at most `max_tokens_per_rank`
/// (each error names `topk` or `topk_idx`).
pub(crate) fn tokens_of_routing(topk: usize, idx_len: usize, cfg: &GroupConfig) -> Result<usize> {
    if topk == 0 || topk > MAX_TOPK || topk > cfg.num_experts {
        return Err(Error::arg(
            "topk",
            format!("1..={} (and at most num_experts)", MAX_TOPK),
            topk,
        ));
    }
    if !idx_len.is_multiple_of(topk) {
        return Err(Error::arg(
            "topk_idx",
            format!("[T, {topk}] (a multiple of {topk} elements)"),
            format!("{idx_len} elements"),
        ));
    }
    let t = idx_len / topk;
    if t > cfg.max_tokens_per_rank {
        return Err(Error::arg(
            "topk_idx",
            format!(
                "at most max_tokens_per_rank = {} tokens",
                cfg.max_tokens_per_rank
            ),
            format!("{t} tokens"),
        ));
    }
    Ok(t)
}

impl NodeGroup {
    /// Computes the routing layout (collective): tokens per rank and expert,
    /// every token's row on every receiver, and the count matrix of all
    /// ranks. `topk_idx` is `[T, topk]` with `T <= max_tokens_per_rank`.
    pub fn layout(
        &self,
        stream: &Arc<CudaStream>,
        topk_idx: TopkIdx<'_>,
        topk: usize,
        layout: RecvLayout,
    ) -> Result<NodeHandle> {
        self.op("moe_ep::layout", desc::OP_LAYOUT, stream, None, |turn| {
            self.layout_on_turn(turn, stream, topk_idx, topk, layout)
        })
    }

    fn layout_on_turn(
        &self,
        turn: &OpTurn<'_>,
        stream: &Arc<CudaStream>,
        topk_idx: TopkIdx<'_>,
        topk: usize,
        layout: RecvLayout,
    ) -> Result<NodeHandle> {
        let (idx_ptr, idx_len) = topk_idx.ptr_len();
        let t = tokens_of_routing(topk, idx_len, &self.cfg)?;
        match topk_idx {
            TopkIdx::I32(b) => self.check_region("topk_idx", b, t * topk, "[T, K] i32", 4)?,
            TopkIdx::I64(b) => self.check_region("topk_idx", b, t * topk, "[T, K] i64", 8)?,
        }
        layout.check_for_kernels()?;
        let (r, e) = (self.comm.world(), self.cfg.num_experts);
        let el = e / r;
        let arena_at = ArenaOffsets::new(t, topk, r, layout_info_len(r, e, el, t));
        // SAFETY: not zeroed (a memset node would cost more than the scan of
        // a small batch): the scan writes every word the kernels or
        // `NodeHandle::host_counts` read before any reads it (every token's
        // normalised ids and positions, this rank's count row, zeros in the
        // other info words, each check block's bad-entry word); only the
        // padding between the arrays stays unwritten, and nothing reads it.
        let arena =
            unsafe { stream.alloc::<i32>(arena_at.total) }.map_err(Error::cuda("cuMemAlloc"))?;
        // Expert-major receivers need, per received token, its rows here:
        // written by the senders, so symmetric. Collective allocation, made
        // for every layout and sized for the largest topk: a rank whose
        // layout or topk differs (refused on the device, in the exchange)
        // still makes the same pool allocations as its peers, so the pool's
        // offsets stay equal on every rank.
        // (Kept by every handle: dropping it early on a rank-major one would
        // let the next allocation differ from an expert-major peer's.)
        let meta = self
            .pool
            .alloc::<i32>(r * self.cfg.max_tokens_per_rank * MAX_TOPK)?;
        self.mark_used(&meta)?;
        let handle = NodeHandle {
            layout,
            num_tokens: t,
            topk,
            arena,
            arena_at,
            meta,
            meta_written: std::sync::atomic::AtomicBool::new(false),
            group: self.id,
            id: turn.call,
            epoch: turn.turns.epoch,
            world: r,
            experts: e,
            rows_bound: std::sync::atomic::AtomicUsize::new(usize::MAX),
        };
        let p = LayoutParams {
            op: self.op_common(&handle),
            topk_idx: idx_ptr,
            drop: (self.cfg.overflow == Overflow::Drop) as i32,
            count_fault: self
                .faults
                .count_row
                .swap(0, std::sync::atomic::Ordering::Relaxed),
        };
        let scan = match topk_idx {
            TopkIdx::I32(_) => &self.k.layout_scan_i32,
            TopkIdx::I64(_) => &self.k.layout_scan_i64,
        };
        // SAFETY: p mirrors LayoutParams; every buffer lives in `handle` or
        // the group, both outliving the enqueued work (the handle's arrays are
        // stream-ordered allocations freed in stream order).
        unsafe {
            // Expert-group blocks, R rank blocks, then one token per thread
            // of the check blocks.
            let check_blocks = layout_check_blocks(t);
            let groups = e.div_ceil(SCAN_EXPERTS);
            scan.launch(
                stream,
                (groups + r + check_blocks) as u32,
                SCAN_THREADS,
                exchange_smem(e),
                &p,
            )?;
        }
        turn.launched.set(true);
        Ok(handle)
    }
}
