//! [`ExpertParallel`]: the ops every expert-parallel group has, whether its
//! ranks share one node ([`EpGroup`], the NVLink path) or span several
//! ([`TwoLevelGroup`], the network hop between rail peers, then NVLink).
//! A runtime written against it runs on either; each method is the
//! group's own (same arguments, same errors, same results), so the docs of
//! [`EpGroup`]'s methods hold, with the differences that
//! [`TwoLevelGroup`] documents (its layout waits on the host).
//!
//! ```no_run
//! use std::sync::Arc;
//! use moe_ep::cuda::{CudaSlice, CudaStream};
//! use moe_ep::ops::{DispatchOut, TopkIdx};
//! use moe_ep::{bf16, ExpertParallel, RecvLayout, Result};
//!
//! /// One MoE step on one node or several: route, send, (experts), bring home.
//! fn moe_step<G: ExpertParallel>(
//!     g: &G,
//!     s: &Arc<CudaStream>,
//!     idx: &CudaSlice<i64>,
//!     x: &CudaSlice<bf16>,
//!     w: &CudaSlice<f32>,
//!     out: &mut CudaSlice<bf16>,
//!     k: usize,
//! ) -> Result<usize> {
//!     let h = g.layout(s, TopkIdx::I64(idx), k, RecvLayout::ExpertMajor { alignment: 128 })?;
//!     let got = g.dispatch(s, &h, x, w, DispatchOut::default())?;
//!     let rows = g.recv_rows(s, &h)?; // the experts' rows in got.tokens
//!     g.combine(s, &h, &got.tokens, Some(&got.topk_weights), out)?;
//!     Ok(rows)
//! }
//! ```
//!
//! Tests: the groups' own (tests/gpu_intranode.rs, tests/gpu_two_level.rs).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use super::buffers::{DeviceRegion, DeviceRegionMut, DispatchOut, Dispatched, RecvBuf, TopkIdx};
use super::group::{EpGroup, GroupConfig};
use super::handle::Handle;
use super::two_level::{TwoLevelGroup, TwoLevelHandle};
use crate::error::Result;
use crate::runtime::Communicator;
use crate::symm::SymmPool;
use crate::types::RecvLayout;

/// The ops of an expert-parallel group, on one node or several.
pub trait ExpertParallel {
    /// The routing of one batch, made by [`ExpertParallel::layout`].
    type Handle;

    /// The configuration the group was made with.
    fn config(&self) -> &GroupConfig;
    /// The world communicator.
    fn comm(&self) -> &Arc<Communicator>;
    /// The pool that caller-supplied receive buffers (zero copy) and
    /// symmetric expert outputs come from: on several nodes, the node's.
    fn pool(&self) -> &SymmPool;
    /// Rows every rank's receive buffers hold.
    fn recv_capacity(&self) -> usize;
    /// The error the group's kernels recorded, if any, clearing it
    /// ([`EpGroup::check`]; on several nodes, the node group's).
    fn check(&self) -> Result<()>;

    /// Computes the routing of a batch ([`EpGroup::layout`],
    /// [`TwoLevelGroup::layout`]).
    fn layout(
        &self,
        stream: &Arc<CudaStream>,
        topk_idx: TopkIdx<'_>,
        topk: usize,
        layout: RecvLayout,
    ) -> Result<Self::Handle>;
    /// Rows dispatch delivers to this rank for `handle` (expert-major:
    /// padded). On one node this reads the counts to the host (a wait on
    /// `stream`, as [`Handle::host_counts`]); on several, the layout
    /// already has them.
    fn recv_rows(&self, stream: &Arc<CudaStream>, handle: &Self::Handle) -> Result<usize>;
    /// Sends every token to the ranks of its experts ([`EpGroup::dispatch`]).
    fn dispatch<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Self::Handle,
        x: &dyn DeviceRegion<bf16>,
        topk_weights: &dyn DeviceRegion<f32>,
        out: DispatchOut<'a>,
    ) -> Result<Dispatched<'a>>;
    /// Brings expert outputs home and sums them per token
    /// ([`EpGroup::combine`]).
    fn combine(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Self::Handle,
        expert_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        out: &mut dyn DeviceRegionMut<bf16>,
    ) -> Result<()>;
    /// Backward of dispatch ([`EpGroup::dispatch_backward`]).
    fn dispatch_backward(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Self::Handle,
        grad_recv_tokens: &dyn DeviceRegion<bf16>,
        grad_recv_topk_weights: Option<&dyn DeviceRegion<f32>>,
        grad_tokens: &mut dyn DeviceRegionMut<bf16>,
        grad_topk_weights: Option<&mut dyn DeviceRegionMut<f32>>,
    ) -> Result<()>;
    /// Backward of combine ([`EpGroup::combine_backward`]).
    fn combine_backward<'a>(
        &self,
        stream: &Arc<CudaStream>,
        handle: &Self::Handle,
        grad_out: &dyn DeviceRegion<bf16>,
        weights: Option<&dyn DeviceRegion<f32>>,
        grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
    ) -> Result<RecvBuf<'a, bf16>>;
}

/// Each method is the group's inherent one of the same name.
macro_rules! delegate_ops {
    ($group:ty, $handle:ty) => {
        fn layout(
            &self,
            stream: &Arc<CudaStream>,
            topk_idx: TopkIdx<'_>,
            topk: usize,
            layout: RecvLayout,
        ) -> Result<$handle> {
            <$group>::layout(self, stream, topk_idx, topk, layout)
        }
        fn dispatch<'a>(
            &self,
            stream: &Arc<CudaStream>,
            handle: &$handle,
            x: &dyn DeviceRegion<bf16>,
            topk_weights: &dyn DeviceRegion<f32>,
            out: DispatchOut<'a>,
        ) -> Result<Dispatched<'a>> {
            <$group>::dispatch(self, stream, handle, x, topk_weights, out)
        }
        fn combine(
            &self,
            stream: &Arc<CudaStream>,
            handle: &$handle,
            expert_out: &dyn DeviceRegion<bf16>,
            weights: Option<&dyn DeviceRegion<f32>>,
            out: &mut dyn DeviceRegionMut<bf16>,
        ) -> Result<()> {
            <$group>::combine(self, stream, handle, expert_out, weights, out)
        }
        fn dispatch_backward(
            &self,
            stream: &Arc<CudaStream>,
            handle: &$handle,
            grad_recv_tokens: &dyn DeviceRegion<bf16>,
            grad_recv_topk_weights: Option<&dyn DeviceRegion<f32>>,
            grad_tokens: &mut dyn DeviceRegionMut<bf16>,
            grad_topk_weights: Option<&mut dyn DeviceRegionMut<f32>>,
        ) -> Result<()> {
            <$group>::dispatch_backward(
                self,
                stream,
                handle,
                grad_recv_tokens,
                grad_recv_topk_weights,
                grad_tokens,
                grad_topk_weights,
            )
        }
        fn combine_backward<'a>(
            &self,
            stream: &Arc<CudaStream>,
            handle: &$handle,
            grad_out: &dyn DeviceRegion<bf16>,
            weights: Option<&dyn DeviceRegion<f32>>,
            grad_expert_out: Option<&'a mut dyn DeviceRegionMut<bf16>>,
        ) -> Result<RecvBuf<'a, bf16>> {
            <$group>::combine_backward(self, stream, handle, grad_out, weights, grad_expert_out)
        }
    };
}

impl ExpertParallel for EpGroup {
    type Handle = Handle;
    fn config(&self) -> &GroupConfig {
        EpGroup::config(self)
    }
    fn comm(&self) -> &Arc<Communicator> {
        EpGroup::comm(self)
    }
    fn pool(&self) -> &SymmPool {
        EpGroup::pool(self)
    }
    fn recv_capacity(&self) -> usize {
        EpGroup::recv_capacity(self)
    }
    fn check(&self) -> Result<()> {
        EpGroup::check(self)
    }
    fn recv_rows(&self, stream: &Arc<CudaStream>, handle: &Handle) -> Result<usize> {
        Ok(handle.host_counts(stream)?.recv_rows)
    }
    delegate_ops!(EpGroup, Handle);
}

impl ExpertParallel for TwoLevelGroup {
    type Handle = TwoLevelHandle;
    fn config(&self) -> &GroupConfig {
        TwoLevelGroup::config(self)
    }
    fn comm(&self) -> &Arc<Communicator> {
        TwoLevelGroup::comm(self)
    }
    fn pool(&self) -> &SymmPool {
        self.node_group().pool()
    }
    fn recv_capacity(&self) -> usize {
        TwoLevelGroup::recv_capacity(self)
    }
    fn check(&self) -> Result<()> {
        self.node_group().check()
    }
    fn recv_rows(&self, _stream: &Arc<CudaStream>, handle: &TwoLevelHandle) -> Result<usize> {
        Ok(handle.recv_rows())
    }
    delegate_ops!(TwoLevelGroup, TwoLevelHandle);
}
