//! The routing of one batch on the two-level path ([`TwoLevelHandle`]):
//! the node group's handle of the forward batch, the node streams and the
//! plan of the hop.
//!
//! Tests: `tests/gpu_two_level.rs` (virtual nodes).

use cudarc::driver::CudaSlice;

use super::plan::{Chunks, Plan};
use crate::ops::node::handle::NodeHandle;
use crate::symm::SymmBuffer;

/// The routing of one batch on the two-level path ([`TwoLevelPath::layout`]).
pub(crate) struct TwoLevelHandle {
    pub(crate) node: NodeHandle,
    pub(crate) num_tokens: usize,
    pub(crate) topk: usize,
    /// `[T][N]` each token's row in its stream to each node, -1 if not reached.
    pub(crate) pos: CudaSlice<i32>,
    pub(crate) plan: Plan,
    /// `[fwd_rows][K]` and `[sent_rows][K]` node-local ids.
    pub(crate) own_ids: CudaSlice<i32>,
    pub(crate) net_ids: CudaSlice<i32>,
    /// `[N * max_tokens][2]` (home rank, token) of every forward-batch row,
    /// in the node group's pool (read by the node's receivers).
    pub(crate) origin: SymmBuffer<i32>,
    /// Rows the node group's dispatch delivers here.
    pub(crate) received: usize,
    /// The hop in chunks (every op).
    pub(crate) chunks: Chunks,
    pub(crate) group: u64,
}

impl TwoLevelHandle {
    /// The node group's handle of the forward batch: its counts are this
    /// rank's receive counts (`host_counts().recv_rows`,
    /// `tokens_per_local_expert`); its rank and expert counts are the node's.
    pub fn node_handle(&self) -> &NodeHandle {
        &self.node
    }
    /// This rank's tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// The top-k of the routing the layout was given.
    pub fn topk(&self) -> usize {
        self.topk
    }
    /// Rows dispatch delivers here (expert-major: padded).
    pub fn recv_rows(&self) -> usize {
        self.received
    }
    /// Network rows this rank sends per remote node in dispatch (and
    /// receives back in combine), by node; 0 at its own node.
    pub fn network_rows_sent(&self) -> &[usize] {
        &self.plan.send_rows
    }
    /// Network rows this rank receives per remote node in dispatch.
    pub fn network_rows_received(&self) -> &[usize] {
        &self.plan.recv_rows
    }
}
