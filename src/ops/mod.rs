//! The group and its ops: layout, dispatch, combine, their backward
//! passes, and the low-latency mode.
//!
//! [`EpGroup`] and [`Handle`] (`ep_group.rs`) pick the path of a world,
//! one folder each:
//! - `node/`: one node, NVLink: the group, its kernels and their residency
//!   check ([`residency`]), an op's turn and the device's errors; [`layout`](EpGroup::layout) in `layout_op.rs`
//!   (`kernels-cuda/layout.cu`), [`dispatch`](EpGroup::dispatch) and the
//!   combine backward in `dispatch_op.rs` (`dispatch.cu`),
//!   [`combine`](EpGroup::combine) and the dispatch backward in
//!   `combine_op.rs` (`combine_pull.cu`, `combine_push.cu`);
//! - `low_latency/`: the low-latency ops of a one-node group of
//!   [`Mode::LowLatency`] (`low_latency.cu`): its buffers, handle and ops;
//! - `two_level/`: several nodes (`kernels-cuda/two_level.cu`): the row
//!   plan, the path's group and ops, the network hop between rail peers
//!   (`RailHop`, public with the feature `raw`) in `rail_hop.rs`, its rows
//!   per rail peer in `hop_plan.rs`.
//!
//! Beside them, used by every path: [`GroupConfig`] and [`Mode`] in
//! `config.rs`, the buffer types in `buffers.rs`, the parameter structs the
//! kernels see in `abi.rs` (mirrors of `kernels-cuda/abi.cuh`); the layouts and [`Topology`] live in
//! [`crate::types`].
//!
//! ```no_run
//! # use moe_ep::{bf16, cuda::CudaSlice, Communicator, DispatchOut, EpGroup, GroupConfig, RecvLayout, TopkIdx};
//! # fn step(comm: &std::sync::Arc<Communicator>, topk_idx: &CudaSlice<i64>, x: &CudaSlice<bf16>,
//! #         topk_weights: &CudaSlice<f32>, out: &mut CudaSlice<bf16>) -> moe_ep::Result<()> {
//! let stream = comm.context().default_stream();
//! let group = EpGroup::new(comm, GroupConfig::new(256, 7168, 4096))?; // collective
//! let handle = group.layout(&stream, TopkIdx::I64(topk_idx), 8, RecvLayout::RankMajor)?;
//! let recv = group.dispatch(&stream, &handle, x, topk_weights, DispatchOut::default())?;
//! // ... the experts run on recv.tokens, writing their outputs in place ...
//! group.combine(&stream, &handle, &recv.tokens, None, out)?;
//! group.check()?; // once a step: what any rank's kernels found
//! # Ok(()) }
//! ```
//!
//! Every op is enqueued on the caller's stream and never synchronises the
//! host, except [`Handle::host_counts`]. Problems only the device can see
//! (receive capacity exceeded, an expert id out of range, a peer that never
//! answers) are recorded in host-mapped memory by the kernels and reported as
//! an [`Error`](crate::Error) by the next call on the group (or by [`EpGroup::check`]).

pub(crate) mod abi;
mod buffers;
mod config;
mod ep_group;
mod footprint;
mod low_latency;
mod node;
mod two_level;

pub use crate::types::{Fp8Scaling, LlLayout, RecvLayout, Topology};
/// Most tokens per rank of the low-latency mode.
pub const LL_MAX_TOKENS: usize = abi::LL_MAX_TOKENS;
/// Most ranks on one NVLink node.
pub const MAX_NODE_RANKS: usize = abi::MAX_RANKS;
pub use buffers::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, DispatchOutFp8, Dispatched,
    DispatchedFp8, Fp8Rows, Fp8Scales, RecvBuf, RecvScales, RecvScalesOut, TopkIdx,
};
pub use config::{GroupConfig, Mode, Overflow, DEFAULT_HOP_CHUNK_ROWS};
#[cfg(feature = "testkit")]
#[doc(hidden)]
pub use ep_group::CountWord;
pub use ep_group::{EpGroup, Handle, RefusedCall};
pub use footprint::{workspace_bytes, MemoryFootprint};
pub use low_latency::{
    ll_buffer_bytes, LlBufferBytes, LlCombineSent, LlDispatchArgs, LlDispatchSent, LlHandle,
    LlInput, LlView,
};
pub use node::residency::{residency, Residency};
pub use node::HostCounts;
#[cfg(feature = "raw")]
pub use two_level::hop_plan;
#[cfg(feature = "raw")]
pub use two_level::rail_hop;
#[cfg(feature = "raw")]
pub use two_level::rail_hop::{HopRecv, HopSend, RailHop};
