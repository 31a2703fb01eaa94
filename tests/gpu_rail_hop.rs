//! GPU tests of the inter-node path's network hop (`moe_ep::ops::rail_hop`;
//! `multi-gpu`).
//!
//! The shapes: every split of each world the harness picks
//! (`moe_ep::testkit::ranks::worlds`) into two or more nodes. On one GPU
//! that is virtual worlds 2, 4 and 8: 2 x 1, 4 x 1, 2 x 2, 8 x 1, 4 x 2 and
//! 2 x 4 (nodes x ranks per node), the hop a device copy; with two or more
//! GPUs, 2 x 1 on GPUs 0 and 1 and the splits of all of them, the hop one
//! NCCL group of send/recv (virtual worlds too when
//! `MOE_EP_TEST_VIRTUAL_WORLDS` asks for them). A case that cannot run
//! says SKIP and why.
#![cfg(feature = "multi-gpu")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use moe_ep::cuda::{result as cu, CudaSlice, CudaStream};
use moe_ep::ops::rail_hop::{HopRecv, HopSend, RailHop};
use moe_ep::ops::DeviceRegion;
use moe_ep::testkit::copy::fill_pattern;
use moe_ep::testkit::ranks::{ensure, gpus_or_skip, run_ranks, worlds, Rank, Ranks, World};
use moe_ep::{Communicator, Error, Result, Topology};

/// Calls made in a row on one hop, with the same buffers.
const CALLS: usize = 4;
/// What a receive buffer holds before each call: the bytes past what lands
/// must still hold it after.
const SENTINEL: u8 = 0xa5;

/// Bytes rank `a` sends rank `b` at call `call`: 0, a megabyte and a few
/// bytes, or up to 9000 bytes, rarely a multiple of 16, different for each
/// peer of a sender. Rank 0 sends nothing at call 1, and the last call
/// moves nothing at all.
fn len(call: usize, a: usize, b: usize) -> usize {
    if (call == 1 && a == 0) || call == CALLS - 1 {
        return 0;
    }
    match (a + b + call) % 4 {
        0 => 0,
        1 => (1 << 20) + 3 + b,
        _ => 1 + (b * 4099 + a * 97 + call * 13) % 9000,
    }
}

/// Byte `i` of what rank `a` sends rank `b` at call `call`.
fn byte(call: usize, a: usize, b: usize, i: usize) -> u8 {
    let x = (i as u64).wrapping_mul(0x9e37_79b1)
        ^ ((call * 4096 + a * 64 + b) as u64).wrapping_mul(0x85eb_ca77);
    ((x >> 13) ^ x) as u8
}

fn pattern(call: usize, a: usize, b: usize) -> Vec<u8> {
    (0..len(call, a, b)).map(|i| byte(call, a, b, i)).collect()
}

/// The (world, ranks per node) shapes of a test, from the harness's worlds.
fn shapes(test: &str) -> Vec<(World, usize)> {
    let gpus = moe_ep::device_count().unwrap_or(0);
    if gpus == 1 {
        eprintln!(
            "SKIP: {test} at 2 x 1 on two GPUs (NCCL send/recv): found 1 GPU; virtual ranks only"
        );
    }
    let mut out = Vec::new();
    for w in worlds(test, 2) {
        let sizes = match w.ranks {
            Ranks::Virtual => vec![w.size],
            Ranks::Gpus if w.size > 2 => vec![2, w.size],
            Ranks::Gpus => vec![w.size],
        };
        for size in sizes {
            for g in (1..size).filter(|g| size.is_multiple_of(*g) && *g <= 8) {
                out.push((
                    World {
                        size,
                        ranks: w.ranks,
                    },
                    g,
                ));
            }
        }
    }
    out
}

fn kind(w: World) -> &'static str {
    match w.ranks {
        Ranks::Gpus => "one GPU per rank, NCCL",
        Ranks::Virtual => "virtual ranks on GPU 0, device copies",
    }
}

fn alloc(s: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>> {
    s.alloc_zeros::<u8>(bytes.max(1))
        .map_err(Error::cuda("cuMemAllocAsync"))
}

fn ptr(b: &CudaSlice<u8>) -> u64 {
    DeviceRegion::device_ptr(b)
}

/// `bytes` from `src` to `dst` on `s` (nothing for 0).
///
/// # Safety
/// Both ranges device memory of `s`'s GPU for `bytes`, live until `s` ran it.
unsafe fn copy(s: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    cu::memcpy_dtod_async(dst, src, bytes, s.cu_stream()).map_err(Error::cuda("cuMemcpyDtoDAsync"))
}

fn fill_sentinel(s: &CudaStream, b: &CudaSlice<u8>) -> Result<()> {
    // SAFETY: the whole of `b`, on its stream.
    unsafe { cu::memset_d8_async(ptr(b), SENTINEL, b.len(), s.cu_stream()) }
        .map_err(Error::cuda("cuMemsetD8Async"))
}

/// The bytes of `b`, after everything enqueued on `s` (drained before and
/// after the pageable copy).
fn download(s: &Arc<CudaStream>, b: &CudaSlice<u8>) -> Result<Vec<u8>> {
    s.synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;
    let v = s.clone_dtoh(b).map_err(Error::cuda("cuMemcpyDtoH"))?;
    s.synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;
    Ok(v)
}

/// `got` is `want` followed by the sentinel, or the first difference.
fn check_landed(got: &[u8], want: &[u8], what: &str) -> Result<()> {
    let bad = got
        .iter()
        .enumerate()
        .find(|&(i, &g)| g != if i < want.len() { want[i] } else { SENTINEL });
    let Some((i, &g)) = bad else { return Ok(()) };
    let wrong = (0..got.len())
        .filter(|&j| got[j] != if j < want.len() { want[j] } else { SENTINEL })
        .count();
    Err(Error::InvalidState(format!(
        "{what}: {wrong} of {} bytes wrong, the first at byte {i}: {g:#04x}, expected {:#04x} ({} bytes sent, the rest {SENTINEL:#04x})",
        got.len(),
        if i < want.len() { want[i] } else { SENTINEL },
        want.len()
    )))
}

/// Keeps `s`'s GPU busy for a while (a few tens of MB written), so that
/// the host runs ahead of the GPU and a missing wait would show.
fn delay(s: &Arc<CudaStream>, scratch: &CudaSlice<u32>, seed: u32) -> Result<()> {
    // SAFETY: the whole of `scratch`, on its stream.
    unsafe {
        fill_pattern(
            s,
            DeviceRegion::device_ptr(scratch),
            scratch.len() as u64,
            seed,
        )
    }
}

/// Every rank sends every rail peer its own pattern and length, CALLS
/// times in a row on one hop with the same buffers and no host wait in
/// between: before each call the stream writes the call's pattern into the
/// send buffers and the sentinel into the receive buffers, after it copies
/// each receive buffer whole into a buffer of its own (after a delay, so a
/// later call that wrote too early would show); every byte is checked on
/// the host at the end.
fn every_byte_reaches_its_rail_peer(r: &Rank, g: usize) -> Result<()> {
    let topo = Topology::new(r.world, g)?;
    let hop = RailHop::new(&r.comm, topo)?;
    let (me, s) = (r.rank, &r.stream);
    let want_peers: Vec<usize> = (0..topo.nodes())
        .filter(|&m| m != topo.node_of(me))
        .map(|m| topo.rail_peer(me, m))
        .collect();
    let peers = hop.rail_peers().to_vec();
    ensure(peers == want_peers, || {
        format!("rank {me}: rail peers {peers:?}, expected {want_peers:?}")
    })?;
    let most = |f: &dyn Fn(usize) -> usize| (0..CALLS).map(f).max().unwrap_or(0).max(1);
    let send_cap: Vec<usize> = peers.iter().map(|&p| most(&|c| len(c, me, p))).collect();
    let recv_cap: Vec<usize> = peers.iter().map(|&p| most(&|c| len(c, p, me))).collect();
    let send_buf: Vec<_> = send_cap
        .iter()
        .map(|&n| alloc(s, n))
        .collect::<Result<_>>()?;
    let recv_buf: Vec<_> = recv_cap
        .iter()
        .map(|&n| alloc(s, n))
        .collect::<Result<_>>()?;
    // Every call's patterns, uploaded before the first call.
    s.synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;
    let mut pats: Vec<Vec<CudaSlice<u8>>> = Vec::new();
    for c in 0..CALLS {
        let mut row = Vec::new();
        for &p in &peers {
            let host = pattern(c, me, p);
            let mut d = alloc(s, host.len())?;
            if !host.is_empty() {
                s.memcpy_htod(&host, &mut d)
                    .map_err(Error::cuda("cuMemcpyHtoD"))?;
            }
            row.push(d);
        }
        pats.push(row);
    }
    let staged: Vec<Vec<CudaSlice<u8>>> = (0..CALLS)
        .map(|_| recv_cap.iter().map(|&n| alloc(s, n)).collect())
        .collect::<Result<_>>()?;
    let scratch = s
        .alloc_zeros::<u32>((1 << 22) * (1 + me % 3))
        .map_err(Error::cuda("cuMemAllocAsync"))?;
    s.synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;

    for c in 0..CALLS {
        delay(s, &scratch, c as u32)?;
        for (i, &p) in peers.iter().enumerate() {
            // SAFETY: both buffers hold len(c, me, p) bytes, on this stream.
            unsafe { copy(s, ptr(&send_buf[i]), ptr(&pats[c][i]), len(c, me, p))? };
            fill_sentinel(s, &recv_buf[i])?;
        }
        let (sends, recvs): (Vec<HopSend>, Vec<HopRecv>) = if c == CALLS - 1 {
            (vec![], vec![]) // nothing to move at all
        } else {
            let sends = if c == 1 && me == 0 {
                vec![] // nothing to send; the peers list 0 bytes from it
            } else {
                peers
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| HopSend {
                        peer: p,
                        src: ptr(&send_buf[i]),
                        bytes: len(c, me, p),
                    })
                    .collect()
            };
            let recvs = peers
                .iter()
                .enumerate()
                .map(|(i, &p)| HopRecv {
                    peer: p,
                    dst: ptr(&recv_buf[i]),
                    bytes: len(c, p, me),
                })
                .collect();
            (sends, recvs)
        };
        // SAFETY: every buffer lives to the end of the function and is
        // touched only by work enqueued on `s` (ordered by the call).
        unsafe { hop.exchange(s, &sends, &recvs)? };
        delay(s, &scratch, 100 + c as u32)?;
        for (i, b) in recv_buf.iter().enumerate() {
            // SAFETY: both hold recv_cap[i] bytes, on this stream.
            unsafe { copy(s, ptr(&staged[c][i]), ptr(b), recv_cap[i])? };
        }
    }
    for (c, row) in staged.iter().enumerate() {
        for (i, &p) in peers.iter().enumerate() {
            let got = download(s, &row[i])?;
            check_landed(
                &got,
                &pattern(c, p, me),
                &format!("rank {me}, call {c}, from rank {p}"),
            )?;
        }
    }
    r.comm.barrier(s)
}

/// What a shape moves over all calls: (transfers, of them of 0 bytes,
/// bytes, the longest).
fn traffic(world: usize, g: usize) -> (usize, usize, usize, usize) {
    let topo = Topology::new(world, g).expect("a valid shape");
    let (mut n, mut zero, mut bytes, mut longest) = (0, 0, 0, 0);
    for c in 0..CALLS - 1 {
        for a in 0..world {
            for m in (0..topo.nodes()).filter(|&m| m != topo.node_of(a)) {
                let l = len(c, a, topo.rail_peer(a, m));
                n += 1;
                zero += (l == 0) as usize;
                bytes += l;
                longest = longest.max(l);
            }
        }
    }
    (n, zero, bytes, longest)
}

#[test]
fn every_byte_reaches_its_rail_peer_call_after_call() {
    let test = "every_byte_reaches_its_rail_peer_call_after_call";
    for (world, g) in shapes(test) {
        let nodes = world.size / g;
        eprintln!("  {nodes} x {g} ({})", kind(world));
        run_ranks(world, |r| {
            every_byte_reaches_its_rail_peer(r, g)
                .map_err(|e| Error::InvalidState(format!("{test} at {nodes} x {g}: {e}")))
        });
        let (n, zero, bytes, longest) = traffic(world.size, g);
        eprintln!(
            "  {nodes} x {g} ({}): ok: {CALLS} calls on one hop ({} with transfers), {n} transfers ({zero} of 0 bytes, the longest {longest}), {bytes} bytes, every byte checked on the host",
            kind(world),
            CALLS - 1
        );
    }
}

/// Rank 0 sends 64 bytes to its rail peer g, which expects 100: both fail
/// naming the pair and both sizes, every other rank names the pair, and
/// nothing lands anywhere; then a call that agrees moves its bytes (the
/// ranks stayed in step). Virtual worlds only: on NCCL the peer's sizes
/// are not on this host.
fn sizes_that_disagree(r: &Rank, g: usize) -> Result<()> {
    let topo = Topology::new(r.world, g)?;
    let hop = RailHop::new(&r.comm, topo)?;
    let (me, s) = (r.rank, &r.stream);
    let peer = hop.rail_peers()[0]; // two nodes: the one rail peer
    let (src, dst) = (alloc(s, 128)?, alloc(s, 128)?);
    s.synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;
    let host: Vec<u8> = (0..128).map(|i| byte(7, me, peer, i)).collect();
    let mut src = src;
    s.memcpy_htod(&host, &mut src)
        .map_err(Error::cuda("cuMemcpyHtoD"))?;
    fill_sentinel(s, &dst)?;
    let sent = if me == 0 { 64 } else { 5 };
    let expected = if me == g { 100 } else { 5 };
    let call = |sent: usize, expected: usize| {
        let sends = [HopSend {
            peer,
            src: ptr(&src),
            bytes: sent,
        }];
        let recvs = [HopRecv {
            peer,
            dst: ptr(&dst),
            bytes: expected,
        }];
        // SAFETY: both buffers live until the stream is drained below.
        unsafe { hop.exchange(s, &sends, &recvs) }
    };
    let res = call(sent, expected);
    let fail = |what: String| Error::InvalidState(format!("rank {me}: {what}, got {res:?}"));
    match (&res, me) {
        (Err(Error::InvalidArgument { arg: "sends", .. }), 0) => {
            let m = res.as_ref().unwrap_err().to_string();
            ensure(
                m.contains(&format!("64 bytes from rank 0 to rank {g}"))
                    && m.contains(&format!("100 bytes that rank {g} expects from rank 0")),
                || format!("rank 0: the error must name the pair and both sizes: {m}"),
            )?;
        }
        (Err(Error::InvalidArgument { arg: "recvs", .. }), m) if m == g => {
            let m = res.as_ref().unwrap_err().to_string();
            ensure(
                m.contains(&format!("64 bytes that rank 0 sends to rank {g}"))
                    && m.contains(&format!("100 bytes expected by rank {g} from rank 0")),
                || format!("rank {g}: the error must name the pair and both sizes: {m}"),
            )?;
        }
        (
            Err(Error::CollectiveFailed {
                missing, reason, ..
            }),
            m,
        ) if m != 0 && m != g => {
            ensure(
                *missing == vec![0, g]
                    && reason.contains(&format!("rank 0 sends 64 bytes to rank {g}")),
                || format!("rank {me}: expected the pair 0 -> {g} named: {missing:?} {reason}"),
            )?;
        }
        _ => {
            return Err(fail(format!(
                "expected the size mismatch 0 -> {g} (64 sent, 100 expected) refused"
            )))
        }
    }
    check_landed(
        &download(s, &dst)?,
        &[],
        &format!("rank {me}, refused call"),
    )?;
    // The same pair agreeing: the bytes land.
    call(5, 5)?;
    let want: Vec<u8> = (0..5).map(|i| byte(7, peer, me, i)).collect();
    check_landed(
        &download(s, &dst)?,
        &want,
        &format!("rank {me}, from rank {peer}"),
    )?;
    r.comm.barrier(s)
}

#[test]
fn sizes_that_disagree_fail_both_ranks_of_the_pair() {
    let test = "sizes_that_disagree_fail_both_ranks_of_the_pair";
    let all = worlds(test, 2);
    if all.iter().any(|w| w.ranks == Ranks::Gpus) {
        eprintln!("  SKIP {test} on real GPUs: NCCL's peers' sizes are not on this host (virtual worlds only)");
    }
    for world in all.into_iter().filter(|w| w.ranks == Ranks::Virtual) {
        let g = world.size / 2;
        run_ranks(world, |r| {
            sizes_that_disagree(r, g)
                .map_err(|e| Error::InvalidState(format!("{test} at 2 x {g}: {e}")))
        });
        eprintln!(
            "  2 x {g} (virtual): ok: 64 bytes sent against 100 expected, refused on ranks 0 and {g} by name, on the others naming the pair; nothing landed; 5 bytes each way after"
        );
    }
}

/// A plan one rank gets wrong (on a virtual world; on NCCL every rank, as
/// nothing is seen across ranks there): refused before anything is
/// enqueued, by name, on every rank; then a good call moves its bytes.
fn bad_plans(r: &Rank, g: usize) -> Result<()> {
    let topo = Topology::new(r.world, g)?;
    let hop = RailHop::new(&r.comm, topo)?;
    let (me, s) = (r.rank, &r.stream);
    let peer = hop.rail_peers()[0];
    let (src, dst) = (alloc(s, 4096)?, alloc(s, 4096)?);
    fill_sentinel(s, &dst)?;
    let at = (ptr(&src), ptr(&dst));
    let send = |peer, src, bytes| HopSend { peer, src, bytes };
    let recv = |peer, dst, bytes| HopRecv { peer, dst, bytes };
    // (sends, recvs, the argument refused, what its error says)
    let same_node = if g >= 2 { me ^ 1 } else { me };
    let mut cases: Vec<(Vec<HopSend>, Vec<HopRecv>, &str, String)> = vec![
        (
            vec![send(same_node, at.0, 16)],
            vec![],
            "sends",
            format!("sends[0].peer = {same_node} ("),
        ),
        (
            vec![],
            vec![recv(r.world, at.1, 16)],
            "recvs",
            format!("recvs[0].peer = {} (outside the world", r.world),
        ),
        (
            vec![send(peer, at.0, 8), send(peer, at.0, 8)],
            vec![],
            "sends",
            format!("sends[0].peer and sends[1].peer both rank {peer}"),
        ),
        (
            vec![],
            vec![recv(peer, 0, 8)],
            "recvs",
            "recvs[0].dst = 0 (null)".to_string(),
        ),
    ];
    if g >= 2 {
        let other_rail = topo.node_ranks(topo.node_of(peer)).start + (topo.local_index(me) + 1) % g;
        cases.push((
            vec![send(other_rail, at.0, 8)],
            vec![],
            "sends",
            format!(
                "sends[0].peer = {other_rail} (node {}, local index",
                topo.node_of(peer)
            ),
        ));
    }
    for (k, (sends, recvs, arg, text)) in cases.iter().enumerate() {
        let bad = match r.ranks {
            Ranks::Virtual => k % r.world,
            Ranks::Gpus => me,
        };
        let res = if me == bad {
            // SAFETY: refused before anything is enqueued.
            unsafe { hop.exchange(s, sends, recvs) }
        } else {
            // SAFETY: nothing to move.
            unsafe { hop.exchange(s, &[], &[]) }
        };
        match &res {
            Err(e @ Error::InvalidArgument { arg: a, .. }) if me == bad && a == arg => {
                let m = e.to_string();
                ensure(m.contains(text.as_str()), || {
                    format!("rank {me}, case {k}: expected {text:?} in: {m}")
                })?;
            }
            Err(Error::CollectiveFailed {
                missing, reason, ..
            }) if me != bad => {
                ensure(
                    *missing == vec![bad] && reason.contains(&format!("rank {bad} refused its part")),
                    || format!("rank {me}, case {k}: expected rank {bad} named: {missing:?} {reason}"),
                )?;
            }
            other => {
                return Err(Error::InvalidState(format!(
                    "rank {me}, case {k} (rank {bad} passes {sends:?} / {recvs:?}): expected `{arg}` refused, got {other:?}"
                )))
            }
        }
    }
    check_landed(
        &download(s, &dst)?,
        &[],
        &format!("rank {me}, refused calls"),
    )?;
    // Still in step: a good call moves its bytes.
    let host: Vec<u8> = (0..1000).map(|i| byte(9, me, peer, i)).collect();
    let mut src = src;
    s.memcpy_htod(&host, &mut src)
        .map_err(Error::cuda("cuMemcpyHtoD"))?;
    // SAFETY: both buffers live until the stream is drained below.
    unsafe { hop.exchange(s, &[send(peer, ptr(&src), 1000)], &[recv(peer, at.1, 1000)])? };
    let want: Vec<u8> = (0..1000).map(|i| byte(9, peer, me, i)).collect();
    check_landed(
        &download(s, &dst)?,
        &want,
        &format!("rank {me}, from rank {peer}"),
    )?;
    r.comm.barrier(s)
}

#[test]
fn bad_plans_are_refused_by_name_and_the_ranks_stay_in_step() {
    let test = "bad_plans_are_refused_by_name_and_the_ranks_stay_in_step";
    for world in worlds(test, 2) {
        // Two nodes: on real GPUs 2 x 1 on GPUs 0 and 1, virtual 2 x (W/2).
        let world = match world.ranks {
            Ranks::Gpus => World { size: 2, ..world },
            Ranks::Virtual => world,
        };
        let g = world.size / 2;
        run_ranks(world, |r| {
            bad_plans(r, g).map_err(|e| Error::InvalidState(format!("{test} at 2 x {g}: {e}")))
        });
        eprintln!(
            "  2 x {g} ({}): ok: a peer off the rail or node, outside the world, twice, a null address refused by name; 1000 bytes each way after",
            kind(world)
        );
    }
}

/// Rank 2 of a virtual 2 x 2 world makes its hop and never calls
/// `exchange`: the others fail within the host group's timeout (2 s here),
/// naming rank 2, and rank 2's late call fails at once.
#[test]
fn a_rank_that_never_calls_is_named_within_the_timeout() {
    let test = "a_rank_that_never_calls_is_named_within_the_timeout";
    if gpus_or_skip(test, 1).is_none() {
        return;
    }
    let timeout = Duration::from_secs(2);
    let ctx = moe_ep::context(0).expect("context of GPU 0");
    let comms = Communicator::virtual_world_with_timeout(&ctx, 4, timeout).expect("virtual world");
    let streams: Vec<_> = (0..4).map(|_| ctx.new_stream().expect("stream")).collect();
    let topo = Topology::new(4, 2).unwrap();
    let t0 = Instant::now();
    let results: Vec<(Result<()>, Duration)> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&streams)
            .map(|(comm, s)| {
                sc.spawn(move || -> (Result<()>, Duration) {
                    let hop = match RailHop::new(comm, topo) {
                        Ok(h) => h,
                        Err(e) => return (Err(e), t0.elapsed()),
                    };
                    let (src, dst) = (alloc(s, 64).expect("alloc"), alloc(s, 64).expect("alloc"));
                    let peer = hop.rail_peers()[0];
                    if comm.rank() == 2 {
                        std::thread::sleep(timeout + Duration::from_secs(1));
                    }
                    let t = Instant::now();
                    // SAFETY: both buffers live until the stream is drained below.
                    let res = unsafe {
                        hop.exchange(
                            s,
                            &[HopSend {
                                peer,
                                src: ptr(&src),
                                bytes: 64,
                            }],
                            &[HopRecv {
                                peer,
                                dst: ptr(&dst),
                                bytes: 64,
                            }],
                        )
                    };
                    let took = t.elapsed();
                    let _ = s.synchronize();
                    (res, took)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    for (rank, (res, took)) in results.iter().enumerate() {
        match res {
            Err(Error::CollectiveFailed {
                missing, reason, ..
            }) => {
                assert_eq!(missing, &vec![2], "rank {rank}: {reason}");
                if rank == 2 {
                    assert!(
                        *took < Duration::from_millis(500),
                        "rank 2's late call took {took:?}"
                    );
                } else {
                    assert!(
                        reason.contains("rank 2 did not arrive within"),
                        "rank {rank}: {reason}"
                    );
                    assert!(
                        // The group breaks at the first waiting rank's deadline.
                        *took + Duration::from_millis(500) >= timeout
                            && *took < timeout + Duration::from_secs(3),
                        "rank {rank} failed after {took:?}, the timeout is {timeout:?}"
                    );
                }
            }
            other => panic!("rank {rank}: expected CollectiveFailed naming rank 2, got {other:?}"),
        }
    }
    ctx.synchronize().expect("GPU 0 after the world");
    eprintln!(
        "{test}: ok: 2 x 2 (virtual), ranks 0, 1, 3 failed after the {timeout:?} timeout naming rank 2; rank 2's late call failed at once"
    );
}
