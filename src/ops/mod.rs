//! Layout, dispatch, combine and their backward passes on the NVLink path.
//!
//! One file per op, each naming its kernel file and its tests:
//! [`layout`](EpGroup::layout) in `layout.rs` (`kernels-cuda/layout.cu`),
//! [`dispatch`](EpGroup::dispatch) and the combine backward in
//! `dispatch.rs` (`dispatch.cu`), [`combine`](EpGroup::combine) and the
//! dispatch backward in `combine.rs` (`combine_pull.cu`, `combine_push.cu`);
//! the group and its kernels in `group.rs`, [`Handle`] in `handle.rs`, the
//! buffer types in `buffers.rs`, the parameter structs the kernels see in
//! [`abi`] (mirrors of `kernels-cuda/abi.cuh`), the residency check in
//! `residency.rs`, the nodes of a world and their rail peers ([`Topology`])
//! in `topology.rs`, the network hop between rail peers (`RailHop`, public
//! with the feature `raw`) in `rail_hop.rs`, its chunk rounds for one
//! dispatch (`hop_rounds`) in `hop_plan.rs`, and the two-level path over
//! several nodes ([`TwoLevelGroup`], `kernels-cuda/two_level.cu`) in
//! `two_level.rs`; [`ExpertParallel`], the ops both groups have, in
//! `expert_parallel.rs`.
//!
//! ```ignore
//! let group = EpGroup::new(&comm, GroupConfig::new(256, 7168, 4096))?;     // collective
//! let handle = group.layout(&stream, TopkIdx::I64(&topk_idx), 8, RecvLayout::RankMajor)?;
//! let recv = group.dispatch(&stream, &handle, &x, &topk_weights, DispatchOut::default())?;
//! // ... experts run on recv.tokens() ...
//! group.combine(&stream, &handle, &expert_out, None, &mut out)?;
//! ```
//!
//! Every op is enqueued on the caller's stream and never synchronises the
//! host, except [`Handle::host_counts`]. Problems only the device can see
//! (receive capacity exceeded, an expert id out of range, a peer that never
//! answers) are recorded in host-mapped memory by the kernels and reported as
//! an [`Error`](crate::Error) by the next call on the group (or by [`EpGroup::check`]).

pub mod abi;
mod buffers;
mod combine;
mod dispatch;
mod expert_parallel;
mod group;
mod handle;
#[cfg(feature = "raw")]
pub mod hop_plan;
#[cfg(not(feature = "raw"))]
#[cfg_attr(not(feature = "raw"), allow(dead_code))]
// the inter-node path's plans (the chunk rounds are not used by the ops yet)
pub(crate) mod hop_plan;
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
pub use buffers::{DeviceRegion, DeviceRegionMut, DispatchOut, Dispatched, RecvBuf, TopkIdx};
pub use expert_parallel::ExpertParallel;
pub use group::{EpGroup, GroupConfig, Mode};
pub use handle::{Handle, HostCounts};
pub use low_latency::{
    ll_buffer_bytes, LlBufferBytes, LlCombineSent, LlDispatchSent, LlHandle, LlInput, LlView,
};
#[cfg(feature = "raw")]
pub use rail_hop::{HopRecv, HopSend, RailHop};
pub use residency::{residency, Residency};
pub use two_level::{TwoLevelGroup, TwoLevelHandle, DEFAULT_HOP_CHUNK_ROWS};
