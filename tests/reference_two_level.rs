//! The two-level (inter-node) parts of the CPU reference
//! (`moe_ep::reference`): routes, traffic counts and the two-level combine.
//!
//! * Routes and counts on a hand-made 2 x 2 routing: a token whose experts
//!   all lie on another node, one with none there, a fully masked one, one
//!   forwarded to a rank other than the rail peer, and a node that sends
//!   nothing.
//! * Properties over seeded random routings at 1 x 2 .. 1 x 8, 2 x 2, 2 x 4,
//!   4 x 2 and 8 x 1 (nodes x ranks per node): every (token, remote node)
//!   is one network row, rank `a` sends to its rail peer what the peer
//!   receives from `a`, the hops' experts and ranks are the token's on that
//!   node, and the rows landing on each rank are the flat dispatch's.
//! * The forwarding stage: each rail peer's batch is its node's rows of the
//!   tokens of its rail, nodes ascending, top-k masked to the node as the
//!   network hops carry it; the receive buffer made from the batches holds
//!   the flat dispatch's rows (bits, weights, local ids, counts, padded
//!   blocks), grouped by forwarding rank, home node and token, and with one
//!   node is the flat buffer. Each rank's send streams (`node_streams`):
//!   their lengths are the traffic's network rows, paired between rail
//!   peers by `ops::hop_plan::hop_rows`, and a token's place in a stream is
//!   its row in the forward batch. The hop on the host: rows packed per
//!   node (`pack_network_rows`), each stream moved whole into its rail
//!   peer's landing range, give each rail peer exactly its forward batch.
//! * The combine is each node's intra-node combine over its forward batches,
//!   then one f32 sum of the nodes' bf16 partials per token, nodes
//!   ascending (bit for bit): the rail peers' partials moved home on the
//!   host (each home's segment, from where it lies in the peer's output),
//!   then `node_sum`, reading each node's partial where the streams put it
//!   (a hand case for its order and its own row).
//! * The combine: with one node (and with one rank per node) bit for bit
//!   [`combine_emulated`]; on several nodes within bf16 rounding of
//!   [`combine_f64`] with one more rounding per node; hand cases for the
//!   rounding of each node's partial (the home node's too) and the
//!   ascending node order.
//! * `docs/rdma-model.md`: its formulas give its tables' numbers, and the
//!   rows of a sampled uniform routing at EP16 / 32 / 64 match the formulas.

use moe_ep::reference::*;
use moe_ep::testkit::workload::{self, Rng, Routing};
use moe_ep::{bf16, RecvLayout, Topology};
use std::collections::BTreeMap;

/// A random case on `topo`: K in {1, 2, 8}, E >= K, T in {0, 1, 0..40}
/// per rank, uniform, skewed or masked routing.
fn gen_case(seed: u64, topo: &Topology) -> (Shape, Vec<RankInput>) {
    let mut rng = Rng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x2_1E7E1);
    let r = topo.world();
    let k: usize = [1, 2, 8][rng.below(3)];
    let el = k.div_ceil(r) + rng.below(3);
    let shape = Shape {
        num_ranks: r,
        num_experts: r * el,
        hidden: 8 * (1 + rng.below(3)),
        topk: k,
    };
    shape.validate().unwrap();
    let routing = Routing::for_case(seed, &mut rng);
    let tpr = workload::case_tokens_per_rank(&mut rng, r);
    let inputs = workload::rank_inputs(seed, &shape, &tpr, routing);
    (shape, inputs)
}

fn layouts(shape: &Shape) -> [RecvLayout; 2] {
    [
        RecvLayout::RankMajor,
        RecvLayout::ExpertMajor {
            alignment: 1 + (shape.hidden / 8) % 3 * 3,
        },
    ]
}

/// Random expert outputs in `l` on every rank.
fn expert_out(shape: &Shape, inputs: &[RankInput], l: RecvLayout, rng: &mut Rng) -> Vec<Vec<bf16>> {
    (0..shape.num_ranks)
        .map(|d| {
            let rows = dispatch(shape, inputs, d, l).unwrap().num_rows;
            workload::tokens(rng, rows, shape.hidden)
        })
        .collect()
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn topo(world: usize, ranks_per_node: usize) -> Topology {
    Topology::new(world, ranks_per_node).unwrap()
}

// ------------------------------------------------------------ hand cases

/// 2 nodes x 2 ranks, E = 8 (rank r hosts experts 2r, 2r + 1; node 0 holds
/// experts 0..4, node 1 experts 4..8), K = 2.
fn hand_case() -> (Shape, Topology, Vec<RankInput>) {
    let shape = Shape {
        num_ranks: 4,
        num_experts: 8,
        hidden: 8,
        topk: 2,
    };
    let mk = |idx: Vec<i64>| {
        let t = idx.len() / 2;
        RankInput {
            tokens: vec![bf16::ONE; t * 8],
            topk_weights: (0..t * 2).map(|i| 0.125 * (i as f32 + 1.0)).collect(),
            topk_idx: idx,
        }
    };
    let inputs = vec![
        // t0: all on node 1; t1: all on node 0; t2: masked; t3: both nodes.
        mk(vec![5, 6, 0, 3, -1, -1, 1, 7]),
        // t0: rank 2 (forwarded by rail peer 3) and rank 1 itself.
        mk(vec![4, 2]),
        // Node 1's tokens stay on node 1: it sends nothing.
        mk(vec![4, 7]),
        mk(vec![6, -1, 5, 4]),
    ];
    (shape, topo(4, 2), inputs)
}

#[test]
fn routes_of_a_hand_made_routing() {
    let (shape, t, inputs) = hand_case();
    let r0 = two_level_routes(&shape, &t, &inputs, 0).unwrap();
    assert_eq!(r0.len(), 4);
    // Every expert on another node: one hop, nothing at home.
    assert_eq!(r0[0].nodes, vec![1]);
    assert!(r0[0].home_ranks.is_empty());
    assert_eq!(
        r0[0].remote,
        vec![RemoteHop {
            node: 1,
            rail_peer: 2,
            topk_idx: vec![5, 6],
            topk_weights: vec![0.125, 0.25],
            ranks: vec![2, 3],
        }]
    );
    // None on another node: no hop.
    assert_eq!(
        (&r0[1].nodes, &r0[1].home_ranks, r0[1].remote.len()),
        (&vec![0], &vec![0, 1], 0)
    );
    // Masked: nowhere.
    assert!(r0[2].nodes.is_empty() && r0[2].home_ranks.is_empty() && r0[2].remote.is_empty());
    // Both nodes: the hop carries only node 1's slot.
    assert_eq!(r0[3].nodes, vec![0, 1]);
    assert_eq!(r0[3].home_ranks, vec![0]);
    assert_eq!(
        r0[3].remote,
        vec![RemoteHop {
            node: 1,
            rail_peer: 2,
            topk_idx: vec![-1, 7],
            topk_weights: vec![0.0, 1.0],
            ranks: vec![3],
        }]
    );
    // Rank 1's rail peer on node 1 is rank 3, which forwards to rank 2.
    let r1 = two_level_routes(&shape, &t, &inputs, 1).unwrap();
    assert_eq!(r1[0].home_ranks, vec![1]);
    assert_eq!(
        (r1[0].remote[0].rail_peer, &r1[0].remote[0].ranks),
        (3, &vec![2])
    );
    assert_eq!(r1[0].remote[0].topk_idx, vec![4, -1]);
}

#[test]
fn traffic_of_a_hand_made_routing() {
    let (shape, t, inputs) = hand_case();
    let tr = two_level_traffic(&shape, &t, &inputs).unwrap();
    let want = |sent: [usize; 2], recv: [usize; 2], fwd, home, local| RankTraffic {
        net_sent: sent.to_vec(),
        net_recv: recv.to_vec(),
        nvlink_forward: fwd,
        nvlink_home: home,
        local,
    };
    assert_eq!(tr[0], want([0, 2], [0, 0], 0, 1, 2));
    assert_eq!(tr[1], want([0, 1], [0, 0], 0, 0, 1));
    // Rank 2 receives rank 0's t0 (keeps one row, forwards one to rank 3)
    // and t3 (forwards it to rank 3); its own t0 goes to itself and rank 3.
    assert_eq!(tr[2], want([0, 0], [2, 0], 2, 1, 2));
    assert_eq!(tr[3], want([0, 0], [1, 0], 1, 1, 1));
    // Node 1 sends nothing over the network; node 0 receives nothing.
    assert!(tr[2..].iter().all(|r| r.net_sent.iter().all(|&n| n == 0)));
    assert!(tr[..2].iter().all(|r| r.net_recv.iter().all(|&n| n == 0)));
}

/// 2 x 2 ranks, E = 8: one token of `home` with experts `idx`, whose
/// rank-major rows are `rows` ((rank, value) of every element). Returns the
/// flat combine, the two-level one and the exact one.
fn three_row_case(
    home: usize,
    idx: [i64; 3],
    rows: [(usize, f32); 3],
) -> (Vec<bf16>, Vec<bf16>, Vec<f64>) {
    three_row_case_on(&topo(4, 2), home, idx, rows)
}

/// [`three_row_case`] on any topology of 4 ranks.
fn three_row_case_on(
    t: &Topology,
    home: usize,
    idx: [i64; 3],
    rows: [(usize, f32); 3],
) -> (Vec<bf16>, Vec<bf16>, Vec<f64>) {
    let shape = Shape {
        num_ranks: 4,
        num_experts: 8,
        hidden: 8,
        topk: 3,
    };
    let mut inputs = vec![
        RankInput {
            tokens: vec![],
            topk_idx: vec![],
            topk_weights: vec![],
        };
        4
    ];
    inputs[home] = RankInput {
        tokens: vec![bf16::ONE; 8],
        topk_idx: idx.to_vec(),
        topk_weights: vec![1.0; 3],
    };
    let mut out = vec![vec![]; 4];
    for (d, v) in rows {
        out[d] = vec![bf16::from_f32(v); 8];
    }
    let l = RecvLayout::RankMajor;
    let flat = combine_emulated(&shape, &inputs, &out, home, l, false).unwrap();
    let two = combine_two_level_emulated(&shape, t, &inputs, &out, home, l, false);
    let exact = combine_f64(&shape, &inputs, &out, home, l, false).unwrap();
    (flat, two.unwrap(), exact)
}

/// A token whose rows are 1.0 and 2^-8 twice (`idx`, `rows` as in
/// [`three_row_case`], home rank 0): the flat combine keeps the exact
/// 1 + 2^-7, the two-level one gives 1.0 (a node's partial 1 + 2^-8 rounds,
/// ties to even, to 1.0, and so does 1.0 + 2^-8 at home), within the bound
/// of 4 partials and 2 nodes.
fn rounds_to_one(idx: [i64; 3], rows: [(usize, f32); 3]) {
    let tiny = 1.0 / 256.0;
    let (flat, two, exact) = three_row_case(0, idx, rows);
    assert!(exact.iter().all(|&x| x == 1.0 + 2.0 * tiny as f64));
    assert!(
        flat.iter().all(|&x| x.to_f32() == 1.0 + 2.0 * tiny),
        "{flat:?}"
    );
    assert!(two.iter().all(|&x| x == bf16::ONE), "{two:?}");
    check_close_bf16(&two, &exact, 4 + 2).unwrap();
}

#[test]
fn each_remote_node_partial_is_rounded_once() {
    // Home rank 0 (node 0): 2^-8 at home, 1.0 and 2^-8 on node 1.
    rounds_to_one([0, 4, 6], [(0, 1.0 / 256.0), (2, 1.0), (3, 1.0 / 256.0)]);
}

#[test]
fn the_home_node_partial_is_rounded_once_too() {
    // Home rank 0 (node 0): 1.0 on itself and 2^-8 on rank 1 (its node),
    // 2^-8 on rank 2 (node 1).
    rounds_to_one([0, 2, 4], [(0, 1.0), (1, 1.0 / 256.0), (2, 1.0 / 256.0)]);
}

#[test]
fn nodes_are_summed_in_ascending_order() {
    // (2^24 + 1) rounds to 2^24 in f32, (1 - 2^24) is exact: the order of
    // the terms decides between 0 and 1. Two terms commute, so 4 nodes of
    // one rank: home rank 0, the rows on nodes 1, 2, 3.
    let big = 16_777_216.0f32;
    assert_eq!(((big + 1.0) - big, (1.0 - big) + big), (0.0, 1.0));
    let t = topo(4, 1);
    // Ascending: 2^24, then 1, then -2^24: 0 (descending: 1).
    let (flat, two, exact) = three_row_case_on(&t, 0, [2, 4, 6], [(1, big), (2, 1.0), (3, -big)]);
    assert!(exact.iter().all(|&x| x == 1.0));
    assert_eq!(bits(&two), bits(&flat));
    assert!(two.iter().all(|&x| x.to_f32() == 0.0), "{two:?}");
    // The same rows the other way round: -2^24, 1, 2^24 gives 1.
    let (_, two, _) = three_row_case_on(&t, 0, [2, 4, 6], [(1, -big), (2, 1.0), (3, big)]);
    assert!(two.iter().all(|&x| x.to_f32() == 1.0), "{two:?}");
}

/// `node_sum` adds the nodes in ascending order (the values of
/// [`nodes_are_summed_in_ascending_order`]), reads the home's own row past
/// the rows landed from lower nodes, and leaves a token that reaches no
/// node zero.
#[test]
fn node_sum_adds_the_nodes_ascending_and_finds_the_own_row() {
    let big = 16_777_216.0f32;
    let shape = Shape {
        num_ranks: 4,
        num_experts: 8,
        hidden: 8,
        topk: 3,
    };
    let t = topo(4, 1);
    let row = |v: f32| vec![bf16::from_f32(v); 8];
    // Home rank 2 (node 2): token 0 reaches nodes 0, 1, 2 and 3, token 1 none.
    let streams = NodeStreams {
        pos: vec![0, 0, 0, 0, -1, -1, -1, -1],
        len: vec![1, 1, 1, 1],
    };
    // Its own row lies after 2 rows landed at node 2 from nodes 0 and 1.
    let own: Vec<bf16> = [row(7.0), row(7.0), row(1.0)].concat();
    let sum = |landed: &[Vec<bf16>]| {
        node_sum(&shape, &t, 2, &streams, &[1, 1, 0, 1], &own, landed).unwrap()
    };
    // Ascending: 2^24 (node 0), +0 (node 1), +1 (own), -2^24 (node 3): 0.
    let got = sum(&[row(big), row(0.0), vec![], row(-big)]);
    assert!(got[..8].iter().all(|&x| x.to_f32() == 0.0), "{got:?}");
    assert!(got[8..].iter().all(|&x| x == bf16::ZERO), "{got:?}");
    // The other way round: -2^24, 0, 1, 2^24: 1.
    let got = sum(&[row(-big), row(0.0), vec![], row(big)]);
    assert!(got[..8].iter().all(|&x| x.to_f32() == 1.0), "{got:?}");
    // Too few rows are refused by name.
    let e = node_sum(
        &shape,
        &t,
        2,
        &streams,
        &[1, 1, 0, 1],
        &own[..16],
        &[row(1.0), row(1.0), vec![], row(1.0)],
    );
    assert!(e.unwrap_err().to_string().contains("own"));
    let e = node_sum(
        &shape,
        &t,
        2,
        &streams,
        &[1, 1, 0, 1],
        &own,
        &[row(1.0), vec![], vec![], row(1.0)],
    );
    assert!(e.unwrap_err().to_string().contains("landed"));
}

// ------------------------------------------------------------ properties

const SEEDS: u64 = 40;

/// Nodes x ranks per node of the property tests.
const TOPOLOGIES: [(usize, usize); 7] = [(2, 2), (4, 4), (8, 8), (4, 2), (8, 4), (8, 2), (8, 1)];

#[test]
fn prop_routes_and_counts_agree_with_the_flat_layout() {
    for (world, g) in TOPOLOGIES {
        let t = topo(world, g);
        for seed in 0..SEEDS {
            let (shape, inputs) = gen_case(seed, &t);
            let ctx = format!("{} x {g} seed {seed}", t.nodes());
            let tr = two_level_traffic(&shape, &t, &inputs).unwrap();
            let mut pairs = 0; // (token, remote node)
            for home in 0..world {
                let n = t.node_of(home);
                let fl = layout(&shape, &inputs[home].topk_idx).unwrap();
                let k = shape.topk;
                for (tok, r) in two_level_routes(&shape, &t, &inputs, home)
                    .unwrap()
                    .iter()
                    .enumerate()
                {
                    let flat_ranks: Vec<usize> = (0..world)
                        .filter(|&d| fl.is_token_in_rank[tok * world + d])
                        .collect();
                    let mut flat_nodes: Vec<usize> =
                        flat_ranks.iter().map(|&d| t.node_of(d)).collect();
                    flat_nodes.dedup();
                    assert_eq!(r.nodes, flat_nodes, "{ctx}");
                    let mut all = r.home_ranks.clone();
                    assert!(all.iter().all(|&d| t.node_of(d) == n), "{ctx}");
                    let idx = &inputs[home].topk_idx[tok * k..(tok + 1) * k];
                    let w = &inputs[home].topk_weights[tok * k..(tok + 1) * k];
                    let remote: Vec<usize> = r.remote.iter().map(|h| h.node).collect();
                    let want: Vec<usize> = flat_nodes.iter().copied().filter(|&m| m != n).collect();
                    assert_eq!(remote, want, "{ctx}");
                    for hop in &r.remote {
                        assert_eq!(hop.rail_peer, t.rail_peer(home, hop.node), "{ctx}");
                        for s in 0..k {
                            let here = idx[s] >= 0
                                && t.node_of(shape.rank_of_expert(idx[s] as usize)) == hop.node;
                            let (e, wt) = if here { (idx[s], w[s]) } else { (-1, 0.0) };
                            assert_eq!((hop.topk_idx[s], hop.topk_weights[s]), (e, wt), "{ctx}");
                        }
                        assert!(hop.ranks.iter().all(|&d| t.node_of(d) == hop.node));
                        all.extend(&hop.ranks);
                    }
                    all.sort_unstable();
                    assert_eq!(all, flat_ranks, "{ctx}: the flat dispatch's ranks");
                    pairs += r.remote.len();
                }
            }
            // Every (token, remote node) is one row sent and one received.
            let sent: usize = tr.iter().flat_map(|r| &r.net_sent).sum();
            let recv: usize = tr.iter().flat_map(|r| &r.net_recv).sum();
            assert_eq!((sent, recv), (pairs, pairs), "{ctx}");
            for a in 0..world {
                let n = t.node_of(a);
                assert_eq!((tr[a].net_sent[n], tr[a].net_recv[n]), (0, 0), "{ctx}");
                for m in 0..t.nodes() {
                    let b = t.rail_peer(a, m);
                    assert_eq!(tr[a].net_sent[m], tr[b].net_recv[n], "{ctx}: {a} -> {b}");
                }
            }
            // The rows landing on the ranks are the flat dispatch's.
            let fls: Vec<Layout> = inputs
                .iter()
                .map(|i| layout(&shape, &i.topk_idx).unwrap())
                .collect();
            let counts = gather_counts(&shape, &fls);
            let flat_rows: usize = (0..world).map(|d| counts.rank_major_rows(d)).sum();
            let landed: usize = tr
                .iter()
                .map(|r| r.local + r.nvlink_home + r.nvlink_forward)
                .sum();
            assert_eq!(landed, flat_rows, "{ctx}");
            if t.nodes() == 1 {
                assert!(tr
                    .iter()
                    .all(|r| r.nvlink_forward == 0 && r.net_sent == [0]));
            }
        }
    }
}

/// One combine case of the property tests below.
struct CombineCase<'a> {
    t: &'a Topology,
    shape: &'a Shape,
    inputs: &'a [RankInput],
    out: &'a [Vec<bf16>],
    seed: u64,
    home: usize,
    layout: RecvLayout,
    weighted: bool,
}

/// Calls `f` for every seed, layout, home rank and weighting (weighted only
/// expert-major) of random cases at each `(world, ranks per node)`; `salt`
/// seeds the expert outputs.
fn for_each_combine(topologies: &[(usize, usize)], salt: u64, mut f: impl FnMut(&CombineCase)) {
    for &(world, g) in topologies {
        let t = topo(world, g);
        for seed in 0..SEEDS {
            let (shape, inputs) = gen_case(seed, &t);
            let mut rng = Rng::new(seed ^ salt);
            for layout in layouts(&shape) {
                let out = expert_out(&shape, &inputs, layout, &mut rng);
                for home in 0..world {
                    for weighted in [false, true] {
                        if weighted && layout == RecvLayout::RankMajor {
                            continue;
                        }
                        let (t, shape, inputs, out) = (&t, &shape, &inputs[..], &out[..]);
                        f(&CombineCase {
                            t,
                            shape,
                            inputs,
                            out,
                            seed,
                            home,
                            layout,
                            weighted,
                        });
                    }
                }
            }
        }
    }
}

#[test]
fn prop_one_node_or_one_rank_per_node_is_the_flat_combine_bit_for_bit() {
    let mut compared = 0;
    let cases = [(2, 2), (2, 1), (4, 4), (4, 1), (8, 8), (8, 1)];
    for_each_combine(&cases, 0x2_1E7E1, |c| {
        let (shape, inputs, out) = (c.shape, c.inputs, c.out);
        let flat = combine_emulated(shape, inputs, out, c.home, c.layout, c.weighted).unwrap();
        let two = combine_two_level_emulated(shape, c.t, inputs, out, c.home, c.layout, c.weighted)
            .unwrap();
        assert_eq!(
            bits(&two),
            bits(&flat),
            "{} ranks, {} per node, seed {} {:?} home {}",
            c.t.world(),
            c.t.ranks_per_node(),
            c.seed,
            c.layout,
            c.home
        );
        compared += flat.len();
    });
    assert!(compared > 100_000, "{compared} values compared");
}

#[test]
fn prop_several_nodes_within_bf16_rounding_of_exact() {
    let (mut differ, mut total) = (0usize, 0usize);
    for_each_combine(&[(4, 2), (8, 4), (8, 2)], 0xC0B1, |c| {
        let (shape, inputs, out) = (c.shape, c.inputs, c.out);
        let exact = combine_f64(shape, inputs, out, c.home, c.layout, c.weighted).unwrap();
        let two = combine_two_level_emulated(shape, c.t, inputs, out, c.home, c.layout, c.weighted)
            .unwrap();
        // One rounding per rank's partial and one per node's partial
        // (check_close_bf16's terms).
        check_close_bf16(&two, &exact, c.t.world() + c.t.nodes()).unwrap_or_else(|e| {
            panic!(
                "{} x {} seed {} {:?} home {}: {e}",
                c.t.nodes(),
                c.t.ranks_per_node(),
                c.seed,
                c.layout,
                c.home
            )
        });
        let flat = combine_emulated(shape, inputs, out, c.home, c.layout, c.weighted).unwrap();
        differ += two.iter().zip(&flat).filter(|(a, b)| a != b).count();
        total += two.len();
    });
    // The node partials' rounding is real: some values differ from the flat
    // combine's, most do not.
    assert!(
        differ > 0 && differ < total / 4,
        "{differ} of {total} differ"
    );
}

/// Every row of a dispatch output keyed by where it came from (home rank,
/// token, and the local expert for an expert-major row): its bits, weights
/// and local ids. Padding rows are counted apart.
#[allow(clippy::type_complexity)]
fn rows_by_origin(
    o: &DispatchOutput,
    shape: &Shape,
    layout: RecvLayout,
) -> (
    BTreeMap<(i32, i32, i32), (Vec<u16>, Vec<u32>, Vec<i32>)>,
    usize,
) {
    let (h, k) = (shape.hidden, shape.topk);
    let per = match layout {
        RecvLayout::RankMajor => k,
        RecvLayout::ExpertMajor { .. } => 1,
    };
    let (mut rows, mut padding) = (BTreeMap::new(), 0);
    for (row, &(rank, token)) in o.src.iter().enumerate() {
        if rank < 0 {
            padding += 1;
            continue;
        }
        let ids = o.topk_local_idx[row * per..(row + 1) * per].to_vec();
        let key = (rank, token, if per == 1 { ids[0] } else { -1 });
        let w = o.topk_weights[row * per..(row + 1) * per]
            .iter()
            .map(|w| w.to_bits())
            .collect();
        let old = rows.insert(key, (bits(&o.tokens[row * h..(row + 1) * h]), w, ids));
        assert!(old.is_none(), "row {row}: origin {key:?} twice");
    }
    (rows, padding)
}

#[test]
fn prop_two_level_dispatch_holds_the_flat_rows() {
    let mut compared = 0;
    for (world, g) in TOPOLOGIES {
        let t = topo(world, g);
        for seed in 0..SEEDS {
            let (shape, inputs) = gen_case(seed, &t);
            for l in layouts(&shape) {
                for dst in 0..world {
                    let ctx = format!("{} x {g} seed {seed} {l:?} dst {dst}", t.nodes());
                    let flat = dispatch(&shape, &inputs, dst, l).unwrap();
                    let two = two_level_dispatch(&shape, &t, &inputs, dst, l).unwrap();
                    if g == world || (g == 1 && l != RecvLayout::RankMajor) {
                        // One node, or one rank per node in expert-major:
                        // the same buffer.
                        assert_eq!(two, flat, "{ctx}");
                    }
                    assert_eq!(two.num_rows, flat.num_rows, "{ctx}");
                    assert_eq!(
                        two.tokens_per_local_expert, flat.tokens_per_local_expert,
                        "{ctx}"
                    );
                    if l == RecvLayout::RankMajor {
                        // First row per forwarding rank: only dst's node's.
                        let (node, o) = (t.node_of(dst), &two.offsets);
                        assert_eq!(o.len(), world + 1, "{ctx}");
                        let quiet = |r: usize| t.node_of(r) == node || o[r] == o[r + 1];
                        assert!((0..world).all(quiet), "{ctx}: offsets {o:?}");
                    } else {
                        assert_eq!(two.offsets, flat.offsets, "{ctx}");
                    }
                    let (a, pa) = rows_by_origin(&two, &shape, l);
                    let (b, pb) = rows_by_origin(&flat, &shape, l);
                    assert_eq!(pa, pb, "{ctx}: padding rows");
                    assert!(a == b, "{ctx}: the rows differ from the flat dispatch's");
                    // Forwarded rows are grouped by forwarding local index,
                    // then home node, then token.
                    if l == RecvLayout::RankMajor {
                        let order: Vec<(usize, usize, i32)> = two
                            .src
                            .iter()
                            .map(|&(r, tok)| (r as usize % g, r as usize / g, tok))
                            .collect();
                        assert!(order.windows(2).all(|w| w[0] < w[1]), "{ctx}: row order");
                    }
                    compared += a.len();
                }
            }
        }
    }
    assert!(compared > 10_000, "{compared} rows compared");
}

#[test]
fn prop_forward_batches_are_the_rows_that_reach_each_node() {
    for (world, g) in TOPOLOGIES {
        let t = topo(world, g);
        for seed in 0..SEEDS {
            let (shape, inputs) = gen_case(seed, &t);
            let el = shape.experts_per_rank();
            let mut seen = 0;
            for m in 0..t.nodes() {
                let batches = forward_batches(&shape, &t, &inputs, m).unwrap();
                assert_eq!(batches.len(), g);
                for (i, b) in batches.iter().enumerate() {
                    let ctx = format!("{} x {g} seed {seed} node {m} forwarder {i}", t.nodes());
                    // Home nodes ascending, tokens ascending, local index i.
                    let keys: Vec<(usize, usize)> =
                        b.origin.iter().map(|&(r, tok)| (r / g, tok)).collect();
                    assert!(keys.windows(2).all(|w| w[0] < w[1]), "{ctx}: order");
                    assert!(b.origin.iter().all(|&(r, _)| r % g == i), "{ctx}: rail");
                    for (row, &(home, tok)) in b.origin.iter().enumerate() {
                        let k = shape.topk;
                        let masked = &b.input.topk_idx[row * k..(row + 1) * k];
                        let want: Vec<i64> = if t.node_of(home) == m {
                            inputs[home].topk_idx[tok * k..(tok + 1) * k]
                                .iter()
                                .map(|&e| {
                                    if e >= 0 && e as usize / (g * el) == m {
                                        e
                                    } else {
                                        -1
                                    }
                                })
                                .collect()
                        } else {
                            let routes = two_level_routes(&shape, &t, &inputs, home).unwrap();
                            let hop = routes[tok].remote.iter().find(|h| h.node == m);
                            hop.expect("a remote row has its hop").topk_idx.clone()
                        };
                        assert_eq!(masked, &want[..], "{ctx} row {row}");
                        assert!(
                            masked.iter().any(|&e| e >= 0),
                            "{ctx} row {row}: no expert here"
                        );
                        assert_eq!(
                            bits(&b.input.tokens[row * shape.hidden..(row + 1) * shape.hidden]),
                            bits(
                                &inputs[home].tokens[tok * shape.hidden..(tok + 1) * shape.hidden]
                            ),
                            "{ctx} row {row}"
                        );
                    }
                    seen += b.origin.len();
                }
            }
            // Every (token, node it reaches) is one batch row.
            let reached: usize = (0..world)
                .map(|home| {
                    two_level_routes(&shape, &t, &inputs, home)
                        .unwrap()
                        .iter()
                        .map(|r| r.nodes.len())
                        .sum::<usize>()
                })
                .sum();
            assert_eq!(seen, reached, "{} x {g} seed {seed}", t.nodes());
        }
    }
}

/// Each rank's streams: their lengths to the other nodes are the traffic's
/// network rows (sent, and through `hop_rows` received), and a token's
/// place in the stream to node `m` (its own node too) is its row among the
/// home's rows in node `m`'s forward batch of its rail.
#[test]
#[allow(clippy::needless_range_loop)] // nodes index the batches and the positions
fn prop_node_streams_are_the_traffic_in_the_forward_batches_order() {
    use moe_ep::ops::hop_plan::hop_rows;
    let mut placed = 0;
    for (world, g) in TOPOLOGIES {
        let t = topo(world, g);
        let n = t.nodes();
        for seed in 0..SEEDS {
            let (shape, inputs) = gen_case(seed, &t);
            let traffic = two_level_traffic(&shape, &t, &inputs).unwrap();
            let streams: Vec<NodeStreams> = (0..world)
                .map(|a| node_streams(&shape, &t, &inputs, a).unwrap())
                .collect();
            let lens: Vec<usize> = streams.iter().flat_map(|s| s.len.clone()).collect();
            let batches: Vec<Vec<ForwardBatch>> = (0..n)
                .map(|m| forward_batches(&shape, &t, &inputs, m).unwrap())
                .collect();
            for (a, st) in streams.iter().enumerate() {
                let what = format!("{n} x {g} seed {seed} rank {a}");
                let own = t.node_of(a);
                let net: Vec<usize> = (0..n)
                    .map(|m| if m == own { 0 } else { st.len[m] })
                    .collect();
                assert_eq!(net, traffic[a].net_sent, "{what}: lengths");
                let (send, recv) = hop_rows(&t, a, &lens).unwrap();
                assert_eq!(
                    (send, recv),
                    (traffic[a].net_sent.clone(), traffic[a].net_recv.clone()),
                    "{what}: hop rows"
                );
                let tokens = inputs[a].num_tokens(&shape);
                assert_eq!(st.pos.len(), tokens * n, "{what}");
                for m in 0..n {
                    // The tokens of a in node m's batch of a's rail, in batch order.
                    let b = &batches[m][t.local_index(a)];
                    let mine: Vec<usize> =
                        b.origin.iter().filter(|o| o.0 == a).map(|o| o.1).collect();
                    // (At its own node: its own segment of its own batch.)
                    let want: Vec<i32> = (0..tokens)
                        .map(|tok| mine.iter().position(|&x| x == tok).map_or(-1, |p| p as i32))
                        .collect();
                    assert_eq!(st.len[m], mine.len(), "{what}: length to node {m}");
                    let got: Vec<i32> = (0..tokens).map(|tok| st.pos[tok * n + m]).collect();
                    assert_eq!(got, want, "{what}: positions to node {m}");
                    placed += got.iter().filter(|&&p| p >= 0).count();
                }
            }
        }
    }
    assert!(placed > 0, "no token crossed the network");
}

/// The whole dispatch hop on the host: each rank packs its rows for every
/// other node (node order, token order), each stream moves whole into its
/// rail peer's landing range (streams back to back, nodes ascending, their
/// lengths paired by `hop_rows`), and each rail peer's forward input
/// (landed rows of the nodes before its own, its own tokens, the landed
/// rows after) is the reference's forward batch, row for row and slot for
/// slot.
#[test]
#[allow(clippy::needless_range_loop)] // ranks and nodes index several tables each
fn prop_pack_hop_and_land_make_the_forward_batches() {
    use moe_ep::ops::hop_plan::hop_rows;
    for (world, g) in TOPOLOGIES.into_iter().filter(|&(w, g)| w != g) {
        let t = topo(world, g);
        for seed in 0..SEEDS / 4 {
            let (shape, inputs) = gen_case(seed, &t);
            let (h, k) = (shape.hidden, shape.topk);
            let n = t.nodes();
            // A network row: the bf16 row's bits, then the K ids and K weights.
            let row_bytes = network_row_bytes(h, k);
            let batches: Vec<Vec<ForwardBatch>> = (0..n)
                .map(|m| forward_batches(&shape, &t, &inputs, m).unwrap())
                .collect();
            let encode = |b: &ForwardBatch, row: usize| -> Vec<u8> {
                let mut v: Vec<u8> = bits(&b.input.tokens[row * h..(row + 1) * h])
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                for &e in &b.input.topk_idx[row * k..(row + 1) * k] {
                    v.extend((e as i32).to_le_bytes());
                }
                for &w in &b.input.topk_weights[row * k..(row + 1) * k] {
                    v.extend(w.to_bits().to_le_bytes());
                }
                v
            };
            // Rank a's rows for node m: its rows in node m's batch of its rail.
            let rows_for = |a: usize, m: usize| -> Vec<usize> {
                let b = &batches[m][t.local_index(a)];
                (0..b.origin.len())
                    .filter(|&r| b.origin[r].0 == a)
                    .collect()
            };
            // Each rank's send range, as the pack kernel is to write it:
            // its rows of the forward batches of its rail, nodes ascending.
            let mut send = Vec::new();
            for a in 0..world {
                let mut buf = Vec::new();
                for m in (0..n).filter(|&m| m != t.node_of(a)) {
                    for r in rows_for(a, m) {
                        buf.extend(encode(&batches[m][t.local_index(a)], r));
                    }
                }
                let packed = pack_network_rows(&shape, &t, &inputs, a).unwrap();
                assert!(
                    packed == buf,
                    "{n} x {g} seed {seed}: rank {a}'s packed rows"
                );
                assert_eq!(buf.len() % network_row_bytes(h, k), 0);
                send.push(buf);
            }
            // The streams' lengths as the layouts give them, paired by hop_rows.
            let lens: Vec<usize> = (0..world)
                .flat_map(|a| node_streams(&shape, &t, &inputs, a).unwrap().len)
                .collect();
            let rows_of = |a: usize| hop_rows(&t, a, &lens).unwrap();
            let recv_counts = |a: usize| rows_of(a).1;
            let mut land: Vec<Vec<u8>> = (0..world)
                .map(|a| vec![0u8; recv_counts(a).iter().sum::<usize>() * row_bytes])
                .collect();
            // Rows before each node's stream (0 rows at the own node).
            let starts = |rows: &[usize]| -> Vec<usize> {
                rows.iter()
                    .scan(0, |at, &r| {
                        *at += r;
                        Some(*at - r)
                    })
                    .collect()
            };
            for a in 0..world {
                let (sends, me) = (rows_of(a).0, t.node_of(a));
                let send_at = starts(&sends);
                for m in (0..n).filter(|&m| m != me) {
                    let peer = t.rail_peer(a, m);
                    let recvs = recv_counts(peer);
                    assert_eq!(recvs[me], sends[m], "{n} x {g} seed {seed}: {a} to {peer}");
                    let (src, dst) = (send_at[m] * row_bytes, starts(&recvs)[me] * row_bytes);
                    let bytes = sends[m] * row_bytes;
                    land[peer][dst..dst + bytes].copy_from_slice(&send[a][src..src + bytes]);
                }
            }
            for m in 0..n {
                for i in 0..g {
                    let a = m * g + i;
                    let b = &batches[m][i];
                    // The forward input, node by node.
                    let mut rebuilt: Vec<u8> = Vec::new();
                    let mut landed_at = 0;
                    for node in 0..n {
                        if node == m {
                            for r in rows_for(a, m) {
                                rebuilt.extend(encode(b, r));
                            }
                        } else {
                            let bytes = recv_counts(a)[node] * row_bytes;
                            rebuilt.extend(&land[a][landed_at..landed_at + bytes]);
                            landed_at += bytes;
                        }
                    }
                    let want: Vec<u8> = (0..b.origin.len()).flat_map(|r| encode(b, r)).collect();
                    assert!(
                        rebuilt == want,
                        "{n} x {g} seed {seed}: rank {a}'s forward input"
                    );
                }
            }
        }
    }
}

/// The two-level combine is the intra-node combine of each node's group
/// over its forward batches (expert outputs in the two-level receive
/// layout), then one f32 sum per home token of the nodes' bf16 partials,
/// nodes ascending: bit for bit `combine_two_level_emulated`.
#[test]
fn prop_node_combines_then_the_node_sum_are_the_two_level_combine() {
    use moe_ep::ops::hop_plan::hop_rows;
    let mut compared = 0;
    for_each_combine(&[(4, 2), (8, 4), (8, 2), (8, 1)], 0x5EA1, |c| {
        let (shape, t, h) = (c.shape, c.t, c.shape.hidden);
        let g = t.ranks_per_node();
        let empty = RankInput {
            tokens: vec![],
            topk_idx: vec![],
            topk_weights: vec![],
        };
        // Per node: the forwarders' inputs, and each rank's expert outputs
        // moved from the flat layout's rows to the two-level layout's.
        let mut node_sums: Vec<Vec<bf16>> = Vec::new(); // [node]: the home's rail peer's P rows
        let mut batches_of = Vec::new();
        for m in 0..t.nodes() {
            let batches = forward_batches(shape, t, c.inputs, m).unwrap();
            let fwd: Vec<RankInput> = (0..t.world())
                .map(|r| match t.node_of(r) == m {
                    true => batches[t.local_index(r)].input.clone(),
                    false => empty.clone(),
                })
                .collect();
            let out2: Vec<Vec<bf16>> = (0..t.world())
                .map(|d| {
                    if t.node_of(d) != m {
                        return vec![];
                    }
                    let two = two_level_dispatch(shape, t, c.inputs, d, c.layout).unwrap();
                    let flat = dispatch(shape, c.inputs, d, c.layout).unwrap();
                    let per = two.topk_local_idx.len() / two.num_rows.max(1);
                    let key = |o: &DispatchOutput, r: usize| {
                        let e = if per == 1 { o.topk_local_idx[r] } else { -1 };
                        (o.src[r], e)
                    };
                    let at: BTreeMap<_, usize> =
                        (0..flat.num_rows).map(|r| (key(&flat, r), r)).collect();
                    (0..two.num_rows)
                        .flat_map(|r| match two.src[r].0 >= 0 {
                            true => {
                                let f = at[&key(&two, r)];
                                c.out[d][f * h..(f + 1) * h].to_vec()
                            }
                            false => vec![bf16::ZERO; h],
                        })
                        .collect()
                })
                .collect();
            let peer = t.rail_peer(c.home, m);
            node_sums
                .push(combine_emulated(shape, &fwd, &out2, peer, c.layout, c.weighted).unwrap());
            batches_of.push(batches);
        }
        let want =
            combine_two_level_emulated(shape, t, c.inputs, c.out, c.home, c.layout, c.weighted)
                .unwrap();
        // The return hop on the host: every rank of the home's rail on
        // another node sends the home its segment of its partials (the
        // segments lie in node order, its own among them), whole, into the
        // home's landing range (streams back to back, nodes ascending), 2H
        // bytes a row.
        let (n, i, me) = (t.nodes(), t.local_index(c.home), t.node_of(c.home));
        let streams: Vec<NodeStreams> = (0..t.world())
            .map(|a| node_streams(shape, t, c.inputs, a).unwrap())
            .collect();
        let mine = &streams[c.home];
        let lens: Vec<usize> = streams.iter().flat_map(|s| s.len.clone()).collect();
        let rail = |m: usize| m * g + i;
        let starts = |rows: &[usize]| -> Vec<usize> {
            rows.iter()
                .scan(0, |a, &r| {
                    *a += r;
                    Some(*a - r)
                })
                .collect()
        };
        let row = 2 * h;
        let partial_bytes: Vec<Vec<u8>> = node_sums
            .iter()
            .map(|p| p.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect())
            .collect();
        let (own_streams, recv_rows) = hop_rows(t, c.home, &lens).unwrap();
        let land_at = starts(&own_streams);
        let mut land = vec![0u8; own_streams.iter().sum::<usize>() * row];
        for m in (0..n).filter(|&m| m != me) {
            // Rail peer rail(m)'s rows from each node, its home segment among them.
            let (_, from_homes) = hop_rows(t, rail(m), &lens).unwrap();
            let segments: Vec<usize> = (0..n).map(|nd| streams[rail(nd)].len[m]).collect();
            assert_eq!(from_homes[me], own_streams[m], "the home gets what it sent");
            let (src, dst) = (starts(&segments)[me] * row, land_at[m] * row);
            let bytes = own_streams[m] * row;
            land[dst..dst + bytes].copy_from_slice(&partial_bytes[m][src..src + bytes]);
        }
        let landed: Vec<Vec<bf16>> = (0..n)
            .map(|m| {
                let bytes = &land[land_at[m] * row..(land_at[m] + own_streams[m]) * row];
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect()
            })
            .collect();
        let got = node_sum(shape, t, c.home, mine, &recv_rows, &node_sums[me], &landed).unwrap();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{} x {g} seed {} {:?} home {}",
            t.nodes(),
            c.seed,
            c.layout,
            c.home
        );
        // The batches' origins are where node_streams says the rows lie.
        for (m, batches) in batches_of.iter().enumerate() {
            let origin = &batches[i].origin;
            let seg: usize = (0..me).map(|nd| streams[nd * g + i].len[m]).sum();
            for tok in 0..c.inputs[c.home].num_tokens(shape) {
                let p = mine.pos[tok * n + m];
                let row = origin.iter().position(|&o| o == (c.home, tok));
                assert_eq!(
                    row,
                    (p >= 0).then(|| seg + p as usize),
                    "node {m} token {tok}"
                );
            }
        }
        compared += got.len();
    });
    assert!(compared > 10_000, "{compared} values compared");
}

#[test]
fn bad_topology_is_refused_by_name() {
    let (shape, _, inputs) = hand_case();
    let wrong = topo(8, 4);
    let err = |r: moe_ep::Result<()>| r.unwrap_err().to_string();
    let e = err(two_level_routes(&shape, &wrong, &inputs, 0).map(|_| ()));
    assert!(e.contains("`topology`") && e.contains("4 ranks"), "{e}");
    assert!(err(two_level_traffic(&shape, &wrong, &inputs).map(|_| ())).contains("`topology`"));
    let out = vec![vec![bf16::ONE; 8]; 4];
    let l = RecvLayout::ExpertMajor { alignment: 1 };
    let e = err(combine_two_level_emulated(&shape, &wrong, &inputs, &out, 0, l, false).map(|_| ()));
    assert!(e.contains("`topology`"), "{e}");
    let e = err(two_level_routes(&shape, &topo(4, 2), &inputs, 4).map(|_| ()));
    assert!(e.contains("`home`"), "{e}");
}

// ------------------------------------------------------------ the model

/// P(none of K distinct experts of E lies in a given set of `a`).
fn none_in(e: usize, a: usize, k: usize) -> f64 {
    (0..k)
        .map(|j| (e - a - j) as f64 / (e - j) as f64)
        .product()
}

/// `docs/rdma-model.md`: T = 4096, H = 7168, K = 8 of E = 256, G = 8. The
/// formulas give the tables' numbers, and a sampled uniform routing (1024
/// tokens per rank) the formulas' rows per token within 2 %.
#[test]
fn the_model_formulas_give_the_doc_tables_and_the_sampled_rows() {
    let (tokens, hidden, k, e, g) = (4096.0, 7168usize, 8usize, 256usize, 8usize);
    let row = 2.0 * hidden as f64;
    let net_row = row + 8.0 * k as f64; // the 8 ids (i32) and 8 weights (f32)
                                        // N, p0, q0, r, network rows, network MB dispatch / combine, NVLink MB
                                        // forwarding / home: the doc's rounded values.
    let doc = [
        (
            2, 0.00349, 0.59230, 0.9965, 4082.0, 58.78, 58.52, 167.58, 167.58,
        ),
        (
            4, 0.09645, 0.77291, 2.7107, 11103.0, 159.88, 159.17, 280.03, 93.34,
        ),
        (
            8, 0.33817, 0.88007, 4.6328, 18976.0, 273.25, 272.04, 345.08, 49.30,
        ),
    ];
    let close = |got: f64, want: f64, decimals: i32| {
        (got - want).abs() <= 0.5 * 10f64.powi(-decimals) * (1.0 + 1e-9)
    };
    for (n, p0_doc, q0_doc, r_doc, rows_doc, mb_d, mb_c, fwd_doc, home_doc) in doc {
        let p0 = none_in(e, e / n, k);
        let q0 = none_in(e, e / (n * g), k);
        let r = (n - 1) as f64 * (1.0 - p0);
        let net = tokens * r;
        let fwd = tokens * ((n - 1) * (g - 1)) as f64 * (1.0 - q0);
        let home = tokens * (g - 1) as f64 * (1.0 - q0);
        let ctx = format!("N = {n}");
        assert!(
            close(p0, p0_doc, 5) && close(q0, q0_doc, 5),
            "{ctx}: {p0} {q0}"
        );
        assert!(
            close(r, r_doc, 4) && close(net, rows_doc, 0),
            "{ctx}: {r} {net}"
        );
        assert!(close(net * net_row / 1e6, mb_d, 2), "{ctx}");
        assert!(close(net * row / 1e6, mb_c, 2), "{ctx}");
        assert!(close(fwd * row / 1e6, fwd_doc, 2), "{ctx}");
        assert!(close(home * row / 1e6, home_doc, 2), "{ctx}");

        // A sampled uniform routing of 1024 tokens per rank.
        let per_rank = 1024;
        let world = n * g;
        let shape = Shape {
            num_ranks: world,
            num_experts: e,
            hidden: 8,
            topk: k,
        };
        let inputs: Vec<RankInput> = (0..world)
            .map(|rank| {
                let mut rng = Rng::new(workload::rank_seed(n as u64, rank));
                RankInput {
                    tokens: vec![],
                    topk_idx: workload::topk_idx(&mut rng, per_rank, &shape, Routing::Uniform),
                    topk_weights: vec![0.0; per_rank * k],
                }
            })
            .collect();
        let tr = two_level_traffic(&shape, &topo(world, g), &inputs).unwrap();
        let per_token = |f: &dyn Fn(&RankTraffic) -> usize| {
            tr.iter().map(f).sum::<usize>() as f64 / (world * per_rank) as f64
        };
        let sent = per_token(&|r| r.net_sent.iter().sum());
        let recv = per_token(&|r| r.net_recv.iter().sum());
        let fwd_s = per_token(&|r| r.nvlink_forward);
        let home_s = per_token(&|r| r.nvlink_home);
        for (what, got, want) in [
            ("network rows sent", sent, net / tokens),
            ("network rows received", recv, net / tokens),
            ("NVLink rows forwarded", fwd_s, fwd / tokens),
            ("NVLink rows of the home node", home_s, home / tokens),
        ] {
            assert!(
                (got - want).abs() <= 0.02 * want,
                "{ctx}: {what} per token {got}, the model {want}"
            );
        }
    }
}
