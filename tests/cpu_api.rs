//! CPU tests of the public API's host-side checks: no GPU, driver or NCCL
//! needed.

use std::time::Duration;

use moe_ep::{Error, GroupConfig, Mode, NcclVersion};

fn arg_of(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected InvalidArgument, got {other}"),
    }
}

#[test]
fn group_config_rejects_each_bad_field_by_name() {
    let ok = GroupConfig::new(256, 7168, 4096);
    ok.validate(2).expect("defaults are valid for 2 ranks");
    let bad = |f: &dyn Fn(&mut GroupConfig), world: usize| {
        let mut c = ok.clone();
        f(&mut c);
        arg_of(c.validate(world).unwrap_err())
    };
    assert_eq!(bad(&|_| {}, 0), "world");
    assert_eq!(bad(&|_| {}, 9), "world");
    assert_eq!(bad(&|c| c.num_experts = 255, 2), "num_experts");
    assert_eq!(bad(&|c| c.num_experts = 0, 2), "num_experts");
    assert_eq!(bad(&|c| c.num_experts = 16386, 2), "num_experts");
    assert_eq!(bad(&|c| c.num_experts = usize::MAX - 1, 2), "num_experts");
    assert_eq!(bad(&|c| c.hidden = 7170, 2), "hidden");
    assert_eq!(bad(&|c| c.hidden = 0, 2), "hidden");
    assert_eq!(
        bad(&|c| c.max_tokens_per_rank = 0, 2),
        "max_tokens_per_rank"
    );
    assert_eq!(bad(&|c| c.num_sms = 0, 2), "num_sms");
    assert_eq!(bad(&|c| c.num_sms = 133, 2), "num_sms");
    assert_eq!(bad(&|c| c.combine_chunks = 0, 2), "combine_chunks");
    assert_eq!(bad(&|c| c.combine_chunks = 3, 2), "combine_chunks");
    assert_eq!(bad(&|c| c.combine_chunks = 32, 2), "combine_chunks");
    for n in [1, 2, 4, 8, 16] {
        let mut c = ok.clone();
        c.combine_chunks = n;
        c.validate(2).unwrap();
    }
    assert_eq!(bad(&|c| c.timeout = Duration::ZERO, 2), "timeout");
    let msg = {
        let mut c = ok.clone();
        c.hidden = 7170;
        c.validate(2).unwrap_err().to_string()
    };
    assert!(
        msg.contains("multiple of 8") && msg.contains("7170"),
        "{msg}"
    );
}

/// `ranks_per_node`: the default (0) and the world size are one node and
/// accepted; a divisor of the world makes that many nodes, accepted too
/// (the two-level path); a value that does not divide the world and more
/// than 8 ranks per node are refused by name, each with its own message. A
/// single node of more than 8 ranks stays a `world` error.
#[test]
fn ranks_per_node_is_checked_by_name() {
    let ok = GroupConfig::new(256, 7168, 4096);
    assert_eq!(ok.ranks_per_node, 0, "the default is one node");
    for world in [1, 2, 4, 8] {
        ok.validate(world)
            .expect("the default at any world of one node");
        let mut c = ok.clone();
        c.ranks_per_node = world;
        c.validate(world).expect("ranks_per_node = world");
        let t = c.topology(world).unwrap();
        assert_eq!((t.nodes(), t.ranks_per_node()), (1, world));
        assert_eq!(ok.topology(world).unwrap(), t);
    }
    let refused = |g: usize, world: usize| {
        let mut c = ok.clone();
        c.ranks_per_node = g;
        let e = c.validate(world).unwrap_err();
        let msg = e.to_string();
        (arg_of(e), msg)
    };
    let (arg, not_divisor) = refused(3, 8);
    assert_eq!(arg, "ranks_per_node");
    assert!(
        not_divisor.contains("divisor of the world size 8"),
        "{not_divisor}"
    );
    let (arg, too_many) = refused(16, 32);
    assert_eq!(arg, "ranks_per_node");
    assert!(
        too_many.contains("at most 8") && too_many.contains("16"),
        "{too_many}"
    );
    for (g, world, nodes) in [(4, 8, 2), (1, 2, 2), (2, 8, 4), (8, 16, 2), (8, 64, 8)] {
        let mut c = ok.clone();
        c.ranks_per_node = g;
        c.validate(world).expect("a world of several nodes");
        let t = c.topology(world).unwrap();
        assert_eq!((t.nodes(), t.ranks_per_node()), (nodes, g), "{g} x {nodes}");
    }
    assert_ne!(not_divisor, too_many);
    // More than 8 ranks on one node: the world check of a single node.
    assert_eq!(refused(0, 16).0, "world");
    assert_eq!(refused(16, 16).0, "world");
    assert_eq!(refused(0, 0).0, "world");
    // A multi-node world takes the one-node field checks too.
    let mut c = ok.clone();
    c.ranks_per_node = 4;
    c.hidden = 7170;
    assert_eq!(arg_of(c.validate(8).unwrap_err()), "hidden");
    c.hidden = 7168;
    c.num_experts = 12;
    assert_eq!(arg_of(c.validate(8).unwrap_err()), "num_experts");
}

/// `GroupConfig::validate` of a world of several nodes (the checks of the
/// two-level path that need no peer, what the C ABI's config check uses
/// too): good worlds pass; more than 64 nodes, the low-latency mode, a
/// forward batch past 2^20 tokens and bad hop chunks refused by name, each
/// with its own message, and every one-node field check still made.
#[test]
fn two_level_config_is_checked_by_name() {
    let ok = GroupConfig::new(1024, 7168, 4096);
    let with = |g: usize, f: &dyn Fn(&mut GroupConfig)| {
        let mut c = ok.clone();
        c.ranks_per_node = g;
        f(&mut c);
        c
    };
    for (g, world, nodes) in [
        (1, 2, 2),
        (2, 4, 2),
        (4, 8, 2),
        (2, 8, 4),
        (8, 64, 8),
        (8, 512, 64),
    ] {
        let c = with(g, &|_| {});
        c.validate(world).expect("a good world of nodes");
        let t = c.topology(world).unwrap();
        assert_eq!((t.nodes(), t.ranks_per_node()), (nodes, g), "{g} x {nodes}");
    }
    let refused = |c: GroupConfig, world: usize| {
        let e = c.validate(world).unwrap_err();
        let msg = e.to_string();
        (arg_of(e), msg)
    };
    let (arg, zero) = refused(with(4, &|c| c.hop_chunk_rows = 0), 8);
    assert_eq!(arg, "hop_chunk_rows");
    assert!(zero.contains("at least 1 row"), "{zero}");
    // Hidden 512: 64 vectors a row, so 2^24 rows fill the 2^30 of a chunk.
    let (arg, long) = refused(
        with(4, &|c| {
            c.hidden = 512;
            c.hop_chunk_rows = (1 << 24) + 1
        }),
        8,
    );
    assert_eq!(arg, "hop_chunk_rows");
    assert!(long.contains("2^30"), "{long}");
    let (arg, many) = refused(with(1, &|_| {}), 128);
    assert_eq!(arg, "ranks_per_node");
    assert!(
        many.contains("at most 64 nodes") && many.contains("128 nodes"),
        "{many}"
    );
    let low_latency = |c: &mut GroupConfig| {
        c.mode = Mode::LowLatency;
        c.max_tokens_per_rank = 128; // within the mode's own bound
    };
    let (arg, ll) = refused(with(4, &low_latency), 8);
    assert_eq!(arg, "mode");
    assert!(ll.contains("no low-latency kernels"), "{ll}");
    let (arg, big) = refused(with(4, &|c| c.max_tokens_per_rank = 1 << 19), 16);
    assert_eq!(arg, "max_tokens_per_rank");
    assert!(big.contains("2^20 / 4 nodes"), "{big}");
    // 2^18 tokens over 4 nodes is exactly 2^20: accepted.
    with(4, &|c| c.max_tokens_per_rank = 1 << 18)
        .validate(16)
        .expect("a forward batch of 2^20 tokens");
    // The one-node checks come first.
    assert_eq!(refused(with(3, &|_| {}), 8).0, "ranks_per_node");
    assert_eq!(refused(with(4, &|c| c.hidden = 7170), 8).0, "hidden");
    assert_eq!(
        refused(with(4, &|c| c.num_experts = 12), 8).0,
        "num_experts"
    );
    assert_eq!(refused(with(16, &|_| {}), 32).0, "ranks_per_node");
}

/// The low-latency mode is accepted with up to 1024 tokens per rank (any
/// hidden a multiple of 8: fp8 needs a multiple of 128 only per call), and
/// refuses the same bad fields as the high-throughput one; its buffers
/// follow the documented formula.
#[test]
fn low_latency_config_is_accepted_and_checked() {
    let mut ok = GroupConfig::new(256, 7168, 256);
    ok.mode = Mode::LowLatency;
    for world in [1, 2, 4, 8] {
        ok.validate(world).expect("a low-latency config");
    }
    for (m, h) in [(1, 8), (128, 2056), (1024, 4096), (256, 7168)] {
        let mut c = ok.clone();
        c.max_tokens_per_rank = m;
        c.hidden = h;
        c.validate(8).unwrap();
    }
    let bad = |f: &dyn Fn(&mut GroupConfig), world: usize| {
        let mut c = ok.clone();
        f(&mut c);
        arg_of(c.validate(world).unwrap_err())
    };
    assert_eq!(
        bad(&|c| c.max_tokens_per_rank = 1025, 2),
        "max_tokens_per_rank"
    );
    assert_eq!(
        bad(&|c| c.max_tokens_per_rank = 0, 2),
        "max_tokens_per_rank"
    );
    assert_eq!(bad(&|c| c.hidden = 7170, 2), "hidden");
    assert_eq!(bad(&|c| c.num_experts = 255, 2), "num_experts");
    assert_eq!(bad(&|c| c.num_sms = 0, 2), "num_sms");
    assert_eq!(bad(&|c| c.timeout = Duration::ZERO, 2), "timeout");
    assert_eq!(bad(&|_| {}, 9), "world");
    let msg = {
        let mut c = ok.clone();
        c.max_tokens_per_rank = 4096;
        c.validate(2).unwrap_err().to_string()
    };
    assert!(msg.contains("LowLatency") && msg.contains("1024"), "{msg}");
    // High-throughput groups keep their larger bound.
    let mut ht = ok.clone();
    ht.mode = Mode::HighThroughput;
    ht.max_tokens_per_rank = 4096;
    ht.validate(2).unwrap();

    // Buffer sizes: about 4 H M (E + R + 16) bytes, growing with each factor.
    let b = moe_ep::ops::ll_buffer_bytes(&ok, 8);
    let approx = 4 * 7168 * 256 * (256 + 8 + 16) as u64;
    assert!(
        b.total() >= approx && b.total() < approx + approx / 20,
        "{b:?}"
    );
    assert!(b.symmetric < b.local);
    let mut more = ok.clone();
    more.max_tokens_per_rank = 512;
    assert!(moe_ep::ops::ll_buffer_bytes(&more, 8).total() > b.total());
}

/// Without a driver the crate answers with an error, never a panic; with one
/// (a GPU machine) it counts the devices.
#[test]
fn missing_driver_is_an_error_not_a_panic() {
    match moe_ep::device_count() {
        Ok(n) => eprintln!("driver present: {n} device(s)"),
        Err(Error::NoDriver(msg)) => {
            assert!(msg.contains("libcuda") || msg.contains("cuInit"), "{msg}")
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
    match moe_ep::context(0) {
        Ok(_) => {}
        Err(Error::NoDriver(_)) | Err(Error::NotEnoughGpus { .. }) => {}
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn nccl_versions_decode_and_order() {
    let v = NcclVersion::from_code(22809);
    assert_eq!((v.major, v.minor, v.patch), (2, 28, 9));
    assert_eq!(v.to_string(), "2.28.9");
    assert_eq!(v.code(), 22809);
    assert!(NcclVersion::from_code(22803) < v);
    assert!(NcclVersion::from_code(22902) > v);
    assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
}

/// The workspace formula of `moe_ep::ops::workspace_bytes`, by hand: each
/// region rounded up to 256 bytes, the stage `2 * R * M * H` bf16 rows the
/// bulk of it.
#[test]
fn workspace_bytes_follow_the_formula() {
    let up = |x: u64| x.div_ceil(256) * 256;
    for (r, e, m, h) in [
        (8u64, 256u64, 4096u64, 7168u64),
        (2, 64, 128, 1024),
        (1, 8, 1, 8),
    ] {
        let cfg = GroupConfig::new(e as usize, h as usize, m as usize);
        let (s, b, k) = (16u64, 132u64, 16u64);
        let want = up(4 * 2 * r * (e + r * s + 8))
            + up(8 * r)
            + 3 * up(8 * r * b)
            + up(8 * 2 * 8 * 8)
            + up(8 * 5 * b)
            + up(4 * 2 * r * m * k)
            + up(2 * 2 * r * m * h);
        assert_eq!(
            moe_ep::ops::workspace_bytes(&cfg, r as usize),
            want,
            "R={r} E={e} M={m} H={h}"
        );
    }
    // The headline figure of the docs: 944 MB at R = 8, M = 4096, H = 7168.
    let big = moe_ep::ops::workspace_bytes(&GroupConfig::new(256, 7168, 4096), 8);
    assert_eq!(big.div_ceil(1_000_000), 944, "{big}");
}
