//! The layout op ([`EpGroup::layout`](crate::EpGroup::layout)): from a batch's routing, every
//! token's row on every receiver and the count matrix of all ranks, kept in
//! a [`Handle`](crate::Handle); the kernels' view of a [`RecvLayout`] (defined in
//! `src/types/`, below both the ops and the CPU reference).
//!
//! Kernels: `kernels-cuda/layout.cu` (`moe_ep_layout_scan_i32` / `_i64`: the
//! scan, then the exchange in the scan's last block). Tests:
//! `tests/gpu_intranode.rs` (every case runs the layout and checks
//! `NodeHandle::host_counts` against the reference; bad and duplicate expert
//! ids; capacity exceeded; 1024 experts).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::abi::{
    desc, layout_check_blocks, layout_info_len, LayoutKind, LayoutParams, MAX_TOPK, SCAN_EXPERTS,
    SCAN_THREADS,
};
use super::buffers::TopkIdx;
use super::group::{GroupConfig, NodeGroup, MAX_EXPERTS};
use super::handle::{ArenaOffsets, NodeHandle, OpTurn};
use crate::error::{Error, Result};
use crate::types::RecvLayout;

/// Largest expert-major alignment the kernels take.
const MAX_ALIGNMENT: usize = 4096;

impl RecvLayout {
    /// The kernels' view: the layout kind and the alignment in rows (1 for
    /// rank-major). Handles are made by [`EpGroup::layout`](crate::EpGroup::layout), which checked
    /// the alignment ([`RecvLayout::check_for_kernels`]).
    pub(crate) fn kind(self) -> (LayoutKind, i32) {
        match self {
            RecvLayout::RankMajor => (LayoutKind::RankMajor, 1),
            RecvLayout::ExpertMajor { alignment } => (LayoutKind::ExpertMajor, alignment as i32),
        }
    }

    /// Refuses an alignment the kernels cannot take, naming `layout`.
    pub(crate) fn check_for_kernels(self) -> Result<()> {
        match self {
            RecvLayout::ExpertMajor { alignment }
                if alignment == 0 || alignment > MAX_ALIGNMENT =>
            {
                Err(Error::arg(
                    "layout",
                    format!("ExpertMajor alignment in 1..={MAX_ALIGNMENT}"),
                    alignment,
                ))
            }
            _ => Ok(()),
        }
    }
}

/// Dynamic shared memory of the layout exchange (every scan block asks for
/// it; the last one runs the exchange): two int32 per expert.
pub(crate) fn exchange_smem(num_experts: usize) -> u32 {
    (2 * num_experts * 4) as u32
}

/// The most [`exchange_smem`] asks for: 128 KiB at [`MAX_EXPERTS`], above
/// the 48 KiB a launch gets without raising the kernel's limit.
pub(crate) fn exchange_smem_limit() -> u32 {
    exchange_smem(MAX_EXPERTS)
}

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
        };
        let p = LayoutParams {
            op: self.op_common(&handle),
            topk_idx: idx_ptr,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_smem_is_two_words_per_expert_up_to_the_limit() {
        assert_eq!(exchange_smem(256), 2 * 256 * 4);
        // The most experts: 128 KiB, what the exchange's limit is raised to.
        assert_eq!(exchange_smem(MAX_EXPERTS), 128 * 1024);
        assert_eq!(exchange_smem_limit(), 128 * 1024);
    }
}
