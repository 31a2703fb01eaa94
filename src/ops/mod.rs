//! The group and its ops: layout, dispatch, combine, their backward
//! passes, and the low-latency mode.
//!
//! [`EpGroup`] and [`Handle`] (`ep_group.rs`) pick the path of a world:
//! - one node, NVLink: the group, its kernels and its per-op entry in
//!   `group.rs` and `handle.rs`; [`layout`](EpGroup::layout) in `layout.rs`
//!   (`kernels-cuda/layout.cu`), [`dispatch`](EpGroup::dispatch) and the
//!   combine backward in `dispatch.rs` (`dispatch.cu`),
//!   [`combine`](EpGroup::combine) and the dispatch backward in
//!   `combine.rs` (`combine_pull.cu`, `combine_push.cu`); the low-latency
//!   ops in `low_latency.rs` (`low_latency.cu`);
//! - several nodes: the two-level path in `two_level.rs`
//!   (`kernels-cuda/two_level.cu`), the network hop between rail peers
//!   (`RailHop`, public with the feature `raw`) in `rail_hop.rs`, its chunk
//!   plans in `hop_plan.rs`.
//!
//! Beside them: the buffer types in `buffers.rs`, the parameter structs the
//! kernels see in `abi.rs` (mirrors of `kernels-cuda/abi.cuh`), the
//! residency check in `residency.rs`; the layouts and [`Topology`] live in
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
mod combine;
mod dispatch;
mod ep_group;
mod group;
mod handle;
// the inter-node hop's rows per rail peer (public for the reference tests)
#[cfg(feature = "raw")]
pub mod hop_plan;
#[cfg(not(feature = "raw"))]
mod hop_plan;
mod layout;
mod low_latency;
#[cfg(feature = "raw")]
pub mod rail_hop;
#[cfg(not(feature = "raw"))]
#[cfg_attr(not(feature = "raw"), allow(dead_code))]
// the inter-node path's hop (some of its accessors serve the raw API only)
pub(crate) mod rail_hop;
mod residency;
mod two_level;

pub use crate::types::{Fp8Scaling, LlLayout, RecvLayout, Topology};
/// Most tokens per rank of the low-latency mode.
pub const LL_MAX_TOKENS: usize = abi::LL_MAX_TOKENS;
/// Most ranks on one NVLink node.
pub const MAX_NODE_RANKS: usize = abi::MAX_RANKS;
pub use buffers::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, Dispatched, RecvBuf, TopkIdx,
};
pub use ep_group::{EpGroup, Handle};
pub use group::{GroupConfig, Mode};
pub use handle::HostCounts;
pub use low_latency::{
    ll_buffer_bytes, LlBufferBytes, LlCombineSent, LlDispatchArgs, LlDispatchSent, LlHandle,
    LlInput, LlView,
};
#[cfg(feature = "raw")]
pub use rail_hop::{HopRecv, HopSend, RailHop};
pub use residency::{residency, Residency};
pub use two_level::DEFAULT_HOP_CHUNK_ROWS;
