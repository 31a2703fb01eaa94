//! The two-level (inter-node) path: [`TwoLevelPath`], a world of several
//! nodes (`GroupConfig::ranks_per_node`), and its [`TwoLevelHandle`].
//!
//! A token crosses the network once per remote node it reaches, to the rank
//! of that node with its own local index (its rail peer), which forwards it
//! over NVLink inside its node; combine runs the other way, each node's
//! partial summed inside the node before it crosses the network, and the
//! home sums the nodes in ascending order (`docs/rdma-model.md`,
//! [`crate::reference::two_level`]). Per op:
//!
//! - layout: the node streams (`moe_ep_two_level_streams_*`: each token's
//!   row in its stream to each node), their lengths to the host and to every
//!   rank (one all-gather: the host waits here), each stream's node-local
//!   expert ids and origins packed (`pack_ids`) and sent to the rail peers
//!   ([`RailHop`]), then the node group's layout of the forward batch (the
//!   rows landed from the nodes below, this rank's own rows, the rows landed
//!   from the nodes above);
//! - dispatch: the rows and weights packed (`pack_rows`), sent, and
//!   dispatched inside the node; the received rows' sources mapped back to
//!   (home rank, home token) (`remap_src`);
//! - combine: the node group's combine of the forward batch, the partials
//!   sent back, the home's sum over nodes (`node_sum`);
//! - dispatch backward: as combine, plus the weight gradients (`gather_w`);
//! - combine backward: as dispatch, without weights.
//!
//! The received rows are the flat dispatch's rows in another order: grouped
//! by forwarding rank, then home node, then token
//! ([`two_level_dispatch`](crate::reference::two_level_dispatch)).
//!
//! Kernels: `kernels-cuda/two_level.cu`; the forwarding is the NVLink path
//! (the node's [`EpGroup`](crate::EpGroup)). Tests: `tests/gpu_two_level.rs` (virtual nodes),
//! and the unit tests below (each rank's rows against the reference's
//! forward batches and traffic, on the CPU).
//!
//! Every op's hop runs in chunks of [`TwoLevelPath::hop_chunk_rows`] rows
//! on a stream of its own, overlapped with the node's NVLink work:
//! - dispatch and combine backward (towards the experts): the node group's
//!   op starts at once and each of its warps waits (bounded) for the chunk
//!   of the row it takes, which the hop stream flags once the chunk has
//!   landed (a stream-ordered memset, after the chunk's receive);
//! - combine and dispatch backward (home): the node group's combine counts
//!   the vectors it has written of each chunk of its rows, and each round
//!   of the hop waits on the hop stream (`moe_ep_two_level_wait_chunks`,
//!   one block, bounded) until its chunks are complete, then sends them.
//!   So that every rank's blocks stay resident together where ranks share
//!   a GPU, `num_sms` leaves room for that one block per rank.
//!
//! A world of several nodes runs on this path; [`EpGroup`](crate::EpGroup)
//! picks it from the config.
//!
//! Files: the per-rank row plan and the hop's chunks in `plan.rs`, the
//! handle in `handle.rs`, the path's group (creation, the hop in chunks,
//! the helper kernels' launches) in `path.rs`, its ops in `ops.rs`; the
//! network hop between rail peers ([`RailHop`], public with the feature
//! `raw`) in `rail_hop.rs`, its rows per rail peer in `hop_plan.rs`.

mod handle;
// the inter-node hop's rows per rail peer (public for the reference tests)
#[cfg(feature = "raw")]
pub mod hop_plan;
#[cfg(not(feature = "raw"))]
mod hop_plan;
mod ops;
mod path;
mod plan;
#[cfg(feature = "raw")]
pub mod rail_hop;
#[cfg(not(feature = "raw"))]
#[cfg_attr(not(feature = "raw"), allow(dead_code))]
// the inter-node path's hop (some of its accessors serve the raw API only)
pub(crate) mod rail_hop;

pub(crate) use handle::TwoLevelHandle;
pub(crate) use path::TwoLevelPath;
#[allow(unused_imports)]
use rail_hop::RailHop;
