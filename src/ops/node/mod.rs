//! The one-node (NVLink) path: a group whose ranks share a node, and its
//! high-throughput ops.
//!
//! - the group ([`NodeGroup`](group::NodeGroup): creation, workspace,
//!   what it holds) in `group.rs`, its kernels in `kernels.rs`, whether
//!   every rank's blocks fit the GPU at once in `residency.rs`;
//! - an op's turn on the group (entry, refusal, stream ordering, buffer
//!   checks, the kernels' common parameters) in `turn.rs`; what the device
//!   found, as an error (`check`, the status words decoded) in
//!   `device_error.rs`;
//! - the routing of a batch ([`NodeHandle`](handle::NodeHandle),
//!   [`HostCounts`]) in `handle.rs`;
//! - the ops: layout in `layout_op.rs` (`kernels-cuda/layout.cu`),
//!   dispatch and the combine backward in `dispatch_op.rs` (`dispatch.cu`),
//!   combine and the dispatch backward in `combine_op.rs`
//!   (`combine_pull.cu`, `combine_push.cu`).
//!
//! The low-latency ops of a group of that mode are in `ops/low_latency/`.
//!
//! Tests: `tests/gpu_intranode.rs` (every op), `tests/cpu_api.rs`.

pub(crate) mod combine_op;
mod device_error;
pub(crate) mod dispatch_op;
pub(crate) mod group;
pub(crate) mod handle;
pub(crate) mod kernels;
pub(crate) mod layout_op;
pub(crate) mod residency;
pub(crate) mod turn;

pub use handle::HostCounts;
