//! The low-latency kernels ([`LlKernels`]): the entry points of
//! `kernels-cuda/low_latency.cu`, loaded for a group of
//! [`Mode::LowLatency`](crate::Mode::LowLatency).
//!
//! Tests: `node/kernels.rs` (every entry point is in the module's PTX).

use crate::error::Result;
use crate::runtime::{Communicator, Function, Module};
use crate::types::LlLayout;

/// The entry points of `kernels-cuda/low_latency.cu`.
pub(crate) const LL_SEND: [&str; 2] =
    ["moe_ep_ll_dispatch_send_i32", "moe_ep_ll_dispatch_send_i64"];
/// `[rank-major, expert-major]`.
pub(crate) const LL_RECV: [&str; 2] = [
    "moe_ep_ll_dispatch_recv_rank_major",
    "moe_ep_ll_dispatch_recv_expert_major",
];
/// Expert-major only: the counted rows into their experts' blocks.
pub(crate) const LL_COPY: &str = "moe_ep_ll_dispatch_copy_expert_major";
pub(crate) const LL_COMBINE_SEND: [&str; 2] = [
    "moe_ep_ll_combine_send_rank_major",
    "moe_ep_ll_combine_send_expert_major",
];
pub(crate) const LL_COMBINE_RECV: [&str; 2] = [
    "moe_ep_ll_combine_recv_rank_major",
    "moe_ep_ll_combine_recv_expert_major",
];

/// The low-latency kernels, loaded for a group of that mode.
pub(crate) struct LlKernels {
    pub(crate) send: [Function; 2],
    pub(crate) recv: [Function; 2],
    pub(crate) copy: Function,
    pub(crate) combine_send: [Function; 2],
    pub(crate) combine_recv: [Function; 2],
}

impl LlKernels {
    pub(crate) fn load(comm: &Communicator) -> Result<LlKernels> {
        let m = Module::get(comm.context(), "low_latency")?;
        let two = |n: [&'static str; 2]| -> Result<[Function; 2]> {
            Ok([m.function(n[0])?, m.function(n[1])?])
        };
        Ok(LlKernels {
            send: two(LL_SEND)?,
            recv: two(LL_RECV)?,
            copy: m.function(LL_COPY)?,
            combine_send: two(LL_COMBINE_SEND)?,
            combine_recv: two(LL_COMBINE_RECV)?,
        })
    }
    /// Every kernel (none takes dynamic shared memory).
    pub(crate) fn all(&self) -> impl Iterator<Item = &Function> {
        self.send
            .iter()
            .chain(&self.recv)
            .chain(std::iter::once(&self.copy))
            .chain(&self.combine_send)
            .chain(&self.combine_recv)
    }
}

/// `[rank-major, expert-major]` index of a layout.
pub(crate) fn li(layout: LlLayout) -> usize {
    match layout {
        LlLayout::RankMajor => 0,
        LlLayout::ExpertMajor => 1,
    }
}
