//! The two-level (inter-node) path: which rows cross the network and which
//! NVLink, and combine's fixed order (`docs/rdma-model.md`).
//!
//! The model of [`crate::reference`] plus a [`Topology`]: `N` nodes of `G`
//! ranks, rank `r` on node `r / G` with local index `r % G`, experts hosted
//! as before (rank `r` holds `[r * E_local, (r + 1) * E_local)`, so node `m`
//! holds `[m * G * E_local, (m + 1) * G * E_local)`).
//!
//! # Dispatch
//!
//! A token of home rank `h` (node `n`, local index `i`) *reaches* node `m`
//! when `m` hosts at least one of its non-masked experts. For each node `m
//! != n` it reaches, the token crosses the network once, from `h` to `h`'s
//! rail peer on `m`, `p = m * G + i`, with its top-k masked to the experts
//! of `m` (the others `-1` / `0.0`, the token's own slot order): a
//! [`RemoteHop`]. `p` forwards it over NVLink to every other rank of `m`
//! that hosts one of those experts; where `p` hosts one itself, the row
//! stays on `p`. On its own node the token goes over NVLink to every rank
//! other than `h` that hosts one of its experts, as on one node. Every rank
//! ends up with the tokens, and the rows, of the flat
//! [`dispatch`](super::dispatch): the two levels change the path and the
//! order of the rows, not the rows. [`forward_batches`] are what each rail
//! peer forwards (its node's rows of the tokens of its rail, nodes
//! ascending); [`two_level_dispatch`] is the receive buffer they make,
//! grouped by forwarding rank, then home node, then token.
//!
//! # Counts and bytes ([`two_level_traffic`])
//!
//! Per rank, the rows it sends to and receives from each rail peer (the
//! sizes the host-issued send / receive pairs need), the NVLink rows it
//! forwards as a rail peer and those of its own tokens inside its node,
//! and the rows that stay on it. In bytes, with `H` bf16 values and `K` slots
//! per token: a network row of dispatch is `2H + 8K` (the row, `K` i32
//! expert ids and `K` f32 weights), an NVLink row `2H`; combine moves the
//! same rows back, `2H` bytes each.
//!
//! # Combine ([`combine_two_level_emulated`])
//!
//! Partials are summed inside each remote node first, one bf16 row per
//! (token, remote node) crosses the network, and the home rank sums over
//! nodes in ascending order; the order is fixed, so the result has the same
//! bits on every run, and with one node they are exactly
//! [`combine_emulated`](super::combine_emulated)'s. The exact answer is
//! [`combine_f64`](super::combine_f64), whatever the path.
//!
//! Tests: `tests/reference_two_level.rs`.

use half::bf16;

use super::flat::{
    add_bf16, check_inputs, check_per_rank, check_rank, check_rank_inputs,
    check_rank_major_unweighted, combine_plan, dispatch, rank_partial, DispatchOutput,
};
use super::{RankInput, Shape};
use crate::error::{Error, Result};
use crate::types::{RecvLayout, Topology};

/// One token's crossing of the network to a remote node.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteHop {
    /// The remote node.
    pub node: usize,
    /// The home rank's rail peer on `node` (`node * G + home % G`), which
    /// receives the network row and forwards it.
    pub rail_peer: usize,
    /// `[K]` the token's expert ids hosted on `node`, in the token's slot
    /// order; `-1` in the other slots (masked, or hosted elsewhere).
    pub topk_idx: Vec<i64>,
    /// `[K]` the weights of those slots; `0.0` in the others.
    pub topk_weights: Vec<f32>,
    /// The ranks of `node` hosting at least one of them, ascending (the rail
    /// peer included where it hosts one): the forwarded row's destinations.
    pub ranks: Vec<usize>,
}

/// The two-level route of one token of a home rank.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenRoute {
    /// The nodes hosting at least one of the token's experts, ascending (its
    /// own node included where it hosts one). Empty for a fully masked token.
    pub nodes: Vec<usize>,
    /// The ranks of the home node hosting at least one of its experts,
    /// ascending (the home rank included where it hosts one).
    pub home_ranks: Vec<usize>,
    /// One hop per node of `nodes` other than the home node, ascending.
    pub remote: Vec<RemoteHop>,
}

/// Rows one rank moves in one dispatch on the two-level path (combine moves
/// the same rows the other way). Indexed by node: the peer on node `m` is
/// the rank's rail peer there ([`Topology::rail_peer`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankTraffic {
    /// `[N]` network rows this rank sends to its rail peer on node `m`: its
    /// tokens that reach `m`; `0` for its own node.
    pub net_sent: Vec<usize>,
    /// `[N]` network rows it receives from its rail peer on node `m`: that
    /// peer's tokens that reach this rank's node; `0` for its own node.
    pub net_recv: Vec<usize>,
    /// NVLink rows it forwards as a rail peer: for every network row it
    /// receives, the ranks of its node other than itself that host one of
    /// the row's experts.
    pub nvlink_forward: usize,
    /// NVLink rows of its own tokens: for each, the ranks of its node other
    /// than itself that host one of the token's experts.
    pub nvlink_home: usize,
    /// Rows that stay on this rank: its own tokens with an expert here, and
    /// received network rows with an expert here.
    pub local: usize,
}

/// Checks that `topo` is a topology of `shape`'s ranks.
fn check_topology(shape: &Shape, topo: &Topology) -> Result<()> {
    if topo.world() != shape.num_ranks {
        return Err(Error::arg(
            "topology",
            format!("a world of num_ranks = {} ranks", shape.num_ranks),
            format!("{} ranks", topo.world()),
        ));
    }
    Ok(())
}

/// The route of one token of `home` (`idx` and `w` its `[K]` slots).
fn route(shape: &Shape, topo: &Topology, home: usize, idx: &[i64], w: &[f32]) -> TokenRoute {
    let home_node = topo.node_of(home);
    let mut ranks: Vec<usize> = idx.iter().filter_map(|&e| shape.rank_of_entry(e)).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut nodes: Vec<usize> = ranks.iter().map(|&r| topo.node_of(r)).collect();
    nodes.dedup(); // ranks ascending: equal nodes are adjacent
    let on = |m: usize| -> Vec<usize> {
        ranks
            .iter()
            .copied()
            .filter(|&r| topo.node_of(r) == m)
            .collect()
    };
    let remote = nodes
        .iter()
        .filter(|&&m| m != home_node)
        .map(|&m| {
            let here = |e: i64| shape.rank_of_entry(e).map(|r| topo.node_of(r)) == Some(m);
            RemoteHop {
                node: m,
                rail_peer: topo.rail_peer(home, m),
                topk_idx: idx.iter().map(|&e| if here(e) { e } else { -1 }).collect(),
                topk_weights: idx
                    .iter()
                    .zip(w)
                    .map(|(&e, &w)| if here(e) { w } else { 0.0 })
                    .collect(),
                ranks: on(m),
            }
        })
        .collect();
    TokenRoute {
        home_ranks: on(home_node),
        nodes,
        remote,
    }
}

/// The two-level routes of rank `home`'s tokens, `[T_home]` in token order.
/// `inputs` holds one [`RankInput`] per rank (their `tokens` are not read).
///
/// Errors name `topology` (not a topology of `shape.num_ranks` ranks), the
/// shape's fields, `inputs`, `topk_idx`, `topk_weights` or `home`.
pub fn two_level_routes(
    shape: &Shape,
    topo: &Topology,
    inputs: &[RankInput],
    home: usize,
) -> Result<Vec<TokenRoute>> {
    check_routing(shape, topo, inputs)?;
    check_rank("home", home, shape)?;
    Ok(routes_of(shape, topo, inputs, home))
}

/// The checks of [`two_level_routes`] but `home`.
fn check_routing(shape: &Shape, topo: &Topology, inputs: &[RankInput]) -> Result<()> {
    shape.validate()?;
    check_topology(shape, topo)?;
    check_rank_inputs(shape, inputs, false)
}

/// [`two_level_routes`] of checked inputs.
fn routes_of(shape: &Shape, topo: &Topology, inputs: &[RankInput], home: usize) -> Vec<TokenRoute> {
    let k = shape.topk;
    let inp = &inputs[home];
    inp.topk_idx
        .chunks_exact(k)
        .zip(inp.topk_weights.chunks_exact(k))
        .map(|(idx, w)| route(shape, topo, home, idx, w))
        .collect()
}

/// One forwarding rank's batch: what rail peer `(m, i)` dispatches inside
/// node `m` over NVLink.
#[derive(Clone, Debug)]
pub struct ForwardBatch {
    /// The forwarding dispatch's input: the rows, each with its top-k masked
    /// to node `m`'s experts (global ids; `-1` elsewhere) and their weights
    /// (`0.0` elsewhere).
    pub input: RankInput,
    /// `[rows]` where each row came from: (home rank, home token).
    pub origin: Vec<(usize, usize)>,
}

/// The forward batches of node `node`, `[G]` by local index `i`: batch `i`
/// holds the tokens of the ranks `(n, i)` that reach `node`, nodes `n`
/// ascending (the node's own rank `(node, i)` at its place), each rank's in
/// token order. For `n != node` these are the rows that crossed the network
/// to `(node, i)` ([`RemoteHop`]); for `n == node`, its own tokens.
///
/// Errors name `topology`, the shape's fields, `inputs`, `topk_idx`,
/// `topk_weights`, `tokens` or `node`.
pub fn forward_batches(
    shape: &Shape,
    topo: &Topology,
    inputs: &[RankInput],
    node: usize,
) -> Result<Vec<ForwardBatch>> {
    check_inputs(shape, inputs, RecvLayout::RankMajor)?;
    check_topology(shape, topo)?;
    if node >= topo.nodes() {
        return Err(Error::arg(
            "node",
            format!("a node in 0..{}", topo.nodes()),
            node,
        ));
    }
    let (h, k, g) = (shape.hidden, shape.topk, topo.ranks_per_node());
    let on_node = |e: i64| shape.rank_of_entry(e).map(|r| topo.node_of(r)) == Some(node);
    Ok((0..g)
        .map(|i| {
            let mut b = ForwardBatch {
                input: RankInput {
                    tokens: Vec::new(),
                    topk_idx: Vec::new(),
                    topk_weights: Vec::new(),
                },
                origin: Vec::new(),
            };
            for n in 0..topo.nodes() {
                let home = n * g + i;
                let inp = &inputs[home];
                for t in 0..inp.num_tokens(shape) {
                    let idx = &inp.topk_idx[t * k..(t + 1) * k];
                    if !idx.iter().any(|&e| on_node(e)) {
                        continue;
                    }
                    let w = &inp.topk_weights[t * k..(t + 1) * k];
                    b.input
                        .tokens
                        .extend_from_slice(&inp.tokens[t * h..(t + 1) * h]);
                    for (&e, &w) in idx.iter().zip(w) {
                        let here = on_node(e);
                        b.input.topk_idx.push(if here { e } else { -1 });
                        b.input.topk_weights.push(if here { w } else { 0.0 });
                    }
                    b.origin.push((home, t));
                }
            }
            b
        })
        .collect())
}

/// The rows rank `dst` receives on the two-level path, in `layout`: the
/// [`dispatch`](super::dispatch) inside `dst`'s node of the node's
/// [`forward_batches`] (batch `i` the input of the node's rank with local
/// index `i`, nothing from other nodes), with `src` given as the rows'
/// (home rank, home token).
///
/// The rows, their weights, local expert ids, per-expert counts and (in
/// the expert-major layout) the padded blocks are the flat dispatch's; the
/// order of the rows is not. Rows are grouped by forwarding rank, then by
/// home node, then by token, where the flat layout groups them by home
/// rank, then by token. Rank-major `offsets` (`[R + 1]`) are therefore the
/// first row per forwarding rank (ranks of other nodes forward nothing
/// here). Expert-major blocks hold the same rows as the flat ones, in that
/// order. With one node every field is the flat dispatch's.
///
/// Errors: those of [`forward_batches`], `dst` and `alignment`.
pub fn two_level_dispatch(
    shape: &Shape,
    topo: &Topology,
    inputs: &[RankInput],
    dst: usize,
    layout: RecvLayout,
) -> Result<DispatchOutput> {
    check_inputs(shape, inputs, layout)?;
    check_topology(shape, topo)?;
    check_rank("dst", dst, shape)?;
    let node = topo.node_of(dst);
    let batches = forward_batches(shape, topo, inputs, node)?;
    let empty = RankInput {
        tokens: Vec::new(),
        topk_idx: Vec::new(),
        topk_weights: Vec::new(),
    };
    let forwarders: Vec<RankInput> = (0..shape.num_ranks)
        .map(|r| match topo.node_of(r) == node {
            true => batches[topo.local_index(r)].input.clone(),
            false => empty.clone(),
        })
        .collect();
    let mut out = dispatch(shape, &forwarders, dst, layout)?;
    for s in out.src.iter_mut() {
        if s.0 >= 0 {
            let i = topo.local_index(s.0 as usize);
            let (home, t) = batches[i].origin[s.1 as usize];
            *s = (home as i32, t as i32);
        }
    }
    Ok(out)
}

/// One home rank's streams on the two-level path: the place of each of its
/// tokens in its stream to each remote node's rail peer, and among its own
/// rows of its forward batch (what the layout's node bins are to compute on
/// the GPU, one bin per node).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStreams {
    /// `[T][N]`: token `t`'s row in the stream to node `m`, tokens in
    /// order; `-1` where the token does not reach `m`. For a remote node,
    /// the stream crosses the network to the home's rail peer there; for
    /// the home node, it is the home's own segment of its
    /// [`forward_batches`] batch (no network).
    pub pos: Vec<i32>,
    /// `[N]`: the rows of each stream (the home node's: its own segment).
    pub len: Vec<usize>,
}

/// The streams of rank `home` ([`NodeStreams`]). The stream to node `m`
/// holds, in token order, the home's tokens that reach `m`: the rows of
/// node `m`'s [`forward_batches`] that come from `home`, in their order.
/// The same errors as [`two_level_routes`].
pub fn node_streams(
    shape: &Shape,
    topo: &Topology,
    inputs: &[RankInput],
    home: usize,
) -> Result<NodeStreams> {
    check_routing(shape, topo, inputs)?;
    check_rank("home", home, shape)?;
    let n = topo.nodes();
    let routes = routes_of(shape, topo, inputs, home);
    let mut s = NodeStreams {
        pos: vec![-1; routes.len() * n],
        len: vec![0; n],
    };
    for (t, route) in routes.iter().enumerate() {
        for &m in &route.nodes {
            s.pos[t * n + m] = s.len[m] as i32;
            s.len[m] += 1;
        }
    }
    Ok(s)
}

/// Bytes of one network row of dispatch: the `H` bf16 values, then `K`
/// i32 expert ids, then `K` f32 weights.
pub fn network_row_bytes(hidden: usize, topk: usize) -> usize {
    2 * hidden + 8 * topk
}

/// Rank `home`'s send range of a two-level dispatch as one byte model: its
/// streams to the remote nodes, nodes ascending, each holding in token order
/// the tokens that reach that node (the rows of [`node_streams`]), one
/// [`network_row_bytes`] row each: the token's values (bf16,
/// little-endian), then its [`RemoteHop`] top-k (the expert ids hosted on
/// that node as i32, `-1` elsewhere; their weights as f32, `0.0`
/// elsewhere). A row carries no origin here: the rail peer returns its
/// partials in the same order.
///
/// `TwoLevelGroup` sends the same fields per row as separate arrays (the
/// ids node-local and in the layout, with each row's origin; the values
/// and weights in the dispatch: `docs/rdma-model.md`, "Building it").
///
/// Errors name `topology`, the shape's fields, `inputs`, `topk_idx`,
/// `topk_weights`, `tokens` or `home`.
pub fn pack_network_rows(
    shape: &Shape,
    topo: &Topology,
    inputs: &[RankInput],
    home: usize,
) -> Result<Vec<u8>> {
    check_inputs(shape, inputs, RecvLayout::RankMajor)?;
    check_topology(shape, topo)?;
    check_rank("home", home, shape)?;
    let h = shape.hidden;
    let routes = routes_of(shape, topo, inputs, home);
    let tokens = &inputs[home].tokens;
    let mut out = Vec::new();
    for m in 0..topo.nodes() {
        for (t, route) in routes.iter().enumerate() {
            let Some(hop) = route.remote.iter().find(|hop| hop.node == m) else {
                continue;
            };
            for v in &tokens[t * h..(t + 1) * h] {
                out.extend(v.to_bits().to_le_bytes());
            }
            for &e in &hop.topk_idx {
                out.extend((e as i32).to_le_bytes());
            }
            for &w in &hop.topk_weights {
                out.extend(w.to_bits().to_le_bytes());
            }
        }
    }
    Ok(out)
}

/// The home's sum over nodes, the last step of the two-level combine: for
/// each token of `home`, in f32 from 0, over the nodes it reaches in
/// ascending order, one bf16 row each (the node's partial), rounded once to
/// bf16; `[T_home][H]`, zero rows for tokens that reach no node.
///
/// Where each node's row lies:
/// - a remote node `m`: row `streams.pos[t][m]` of `landed[m]`, the
///   partials its rail peer sent back, in the order of the home's stream
///   to `m` (`[streams.len[m]][H]`; `landed[home node]` is not read);
/// - the home node: row `before + streams.pos[t][home node]` of `own`, the
///   home's node-group combine over its forward batch, where the home's own
///   rows start after `before`, the rows landed from the nodes below the
///   home's (`recv_rows[m]` summed over `m < home node`; `recv_rows` as
///   [`crate::Topology`]'s rail peers send them, one count per node).
///
/// With `own` and `landed` the node groups' combines (`combine_emulated` of
/// each node over its forward batches), this is
/// [`combine_two_level_emulated`] bit for bit
/// (`tests/reference_two_level.rs`).
///
/// Errors, each naming the argument: `streams` not of `T x N`, `recv_rows`
/// not one count per node, `own` or `landed` shorter than the rows read.
pub fn node_sum(
    shape: &Shape,
    topo: &Topology,
    home: usize,
    streams: &NodeStreams,
    recv_rows: &[usize],
    own: &[bf16],
    landed: &[Vec<bf16>],
) -> Result<Vec<bf16>> {
    shape.validate()?;
    check_topology(shape, topo)?;
    check_rank("home", home, shape)?;
    let (n, h) = (topo.nodes(), shape.hidden);
    if streams.len.len() != n || !streams.pos.len().is_multiple_of(n) {
        return Err(Error::arg(
            "streams",
            format!("[T][{n}] positions and {n} lengths"),
            format!(
                "{} positions, {} lengths",
                streams.pos.len(),
                streams.len.len()
            ),
        ));
    }
    if recv_rows.len() != n {
        return Err(Error::arg(
            "recv_rows",
            format!("{n} counts, one per node"),
            recv_rows.len(),
        ));
    }
    let me = topo.node_of(home);
    let before: usize = recv_rows[..me].iter().sum();
    if own.len() < (before + streams.len[me]) * h {
        return Err(Error::arg(
            "own",
            format!("at least {} rows of {h}", before + streams.len[me]),
            format!("{} values", own.len()),
        ));
    }
    if landed.len() != n {
        return Err(Error::arg(
            "landed",
            format!("{n} row sets, one per node"),
            landed.len(),
        ));
    }
    if let Some(m) = (0..n).find(|&m| m != me && landed[m].len() < streams.len[m] * h) {
        return Err(Error::arg(
            "landed",
            format!("at least {} rows of {h} from node {m}", streams.len[m]),
            format!("{} values", landed[m].len()),
        ));
    }
    let tokens = streams.pos.len() / n;
    let mut out = vec![bf16::ZERO; tokens * h];
    let mut acc = vec![0.0f32; h];
    for t in 0..tokens {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (m, from) in landed.iter().enumerate() {
            let p = streams.pos[t * n + m];
            if p < 0 {
                continue;
            }
            let (rows, row) = match m == me {
                true => (own, before + p as usize),
                false => (&from[..], p as usize),
            };
            for (a, v) in acc.iter_mut().zip(&rows[row * h..(row + 1) * h]) {
                *a += v.to_f32();
            }
        }
        for (o, &a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = bf16::from_f32(a);
        }
    }
    Ok(out)
}

/// The rows every rank moves in one dispatch, `[R]` in rank order
/// ([`RankTraffic`]); the same errors as [`two_level_routes`] (but `home`).
///
/// Over all ranks, rows sent equal rows received (rank `a` sends to `b`
/// what `b` receives from `a`), their total is the number of (token,
/// remote node) pairs, and `nvlink_forward + nvlink_home + local` summed is
/// the flat dispatch's total of rank-major rows.
pub fn two_level_traffic(
    shape: &Shape,
    topo: &Topology,
    inputs: &[RankInput],
) -> Result<Vec<RankTraffic>> {
    check_routing(shape, topo, inputs)?;
    let nodes = topo.nodes();
    let mut out = vec![
        RankTraffic {
            net_sent: vec![0; nodes],
            net_recv: vec![0; nodes],
            nvlink_forward: 0,
            nvlink_home: 0,
            local: 0,
        };
        shape.num_ranks
    ];
    for home in 0..shape.num_ranks {
        let home_node = topo.node_of(home);
        for r in routes_of(shape, topo, inputs, home) {
            for &d in &r.home_ranks {
                if d == home {
                    out[home].local += 1;
                } else {
                    out[home].nvlink_home += 1;
                }
            }
            for hop in &r.remote {
                let p = hop.rail_peer;
                out[home].net_sent[hop.node] += 1;
                out[p].net_recv[home_node] += 1;
                for &d in &hop.ranks {
                    if d == p {
                        out[p].local += 1;
                    } else {
                        out[p].nvlink_forward += 1;
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The two-level combine on home rank `home`, bit for bit: `[T_home * H]`
/// bf16. The arguments, layouts and per-rank partials are those of
/// [`combine_emulated`](super::combine_emulated), plus the topology; for
/// home token `t`, elementwise:
///
/// 1. On every rank `d` where `t` was sent, its partial `p_d` exactly as in
///    [`combine_emulated`](super::combine_emulated): f32 from `0.0` over
///    `t`'s rows on `d` in ascending row order (`RankMajor`: the one row;
///    `ExpertMajor`: `acc = w.mul_add(x, acc)` weighted, `acc = acc + x`
///    unweighted), then rounded to bf16 (round-to-nearest-even), the rail
///    peer's own partial included.
/// 2. On each node `m` that `t` reaches, the home rank's rail peer there
///    (on the home node: the home rank itself): f32 `q = 0.0`, for the
///    ranks `d` of `m` in ascending local index where `t` was sent,
///    `q += f32(p_d)`; rounded once to bf16: `P_m`, one bf16 row per
///    (token, node). This is the one-node combine of the node's own group
///    (the home sum of [`combine_emulated`](super::combine_emulated) over
///    the node's ranks), run on the [`forward_batches`].
/// 3. On the home rank: f32 `acc = 0.0`, for the nodes `m` ascending that
///    `t` reaches: `acc += f32(P_m)`. Result `bf16::from_f32(acc)`.
///
/// So the path needs the intra-node combine unchanged on every node, the
/// hop back, and one sum of bf16 rows per token in node order. With one
/// node this is [`combine_emulated`](super::combine_emulated) bit for bit
/// (the one `P_m` rounded again unchanged); with one rank per node too
/// (each `P_m` is one bf16 `p_d`). Against
/// [`combine_f64`](super::combine_f64), each node adds one bf16 rounding to
/// those of the partials.
///
/// Errors: those of [`combine_emulated`](super::combine_emulated), and
/// `topology` when `topo` is not a topology of `shape.num_ranks` ranks.
pub fn combine_two_level_emulated(
    shape: &Shape,
    topo: &Topology,
    inputs: &[RankInput],
    expert_out: &[Vec<bf16>],
    home: usize,
    layout: RecvLayout,
    weighted: bool,
) -> Result<Vec<bf16>> {
    check_rank_major_unweighted(layout, weighted)?;
    let cp = combine_plan(shape, inputs, home, layout)?;
    check_topology(shape, topo)?;
    check_per_rank("expert_out", expert_out, &cp.plans, shape.hidden, "hidden")?;
    let h = shape.hidden;
    let mut out = Vec::with_capacity(cp.home_tokens * h);
    let mut acc = vec![0.0f32; h];
    let mut node_acc = vec![0.0f32; h];
    let mut partial = vec![0.0f32; h];
    for t in 0..cp.home_tokens {
        acc.fill(0.0);
        for m in 0..topo.nodes() {
            // Every node's partial is summed on its rail peer (the home node's
            // on the home rank) and rounded once; the home sums them.
            node_acc.fill(0.0);
            let mut reached = false;
            for d in topo.node_ranks(m) {
                if rank_partial(
                    shape,
                    inputs,
                    &cp,
                    expert_out,
                    (d, t),
                    weighted,
                    &mut partial,
                ) {
                    add_bf16(&mut node_acc, &partial);
                    reached = true;
                }
            }
            if reached {
                add_bf16(&mut acc, &node_acc);
            }
        }
        out.extend(acc.iter().map(|&a| bf16::from_f32(a)));
    }
    Ok(out)
}
