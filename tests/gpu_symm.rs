//! GPU tests of the symmetric-memory pool and the communicator (`multi-gpu`;
//! any world size >= 2: real GPUs, or virtual ranks on GPU 0 at world 2, 4
//! and 8 when there are fewer; `moe_ep::testkit::ranks`).
#![cfg(feature = "multi-gpu")]

use std::time::{Duration, Instant};

use moe_ep::cuda::result::mem_get_info;
use moe_ep::ops::{DeviceRegion, DispatchOut, TopkIdx};
use moe_ep::reference::{self as refr, Shape};
use moe_ep::symm::{SymmBuffer, SymmPool, SEGMENT_GRANULE};
use moe_ep::testkit::copy::{fill_pattern, pattern_mismatches};
use moe_ep::testkit::ranks::{ensure, gpus_or_skip, run_ranks, run_worlds, Ranks, World};
use moe_ep::testkit::workload::{self, Routing};
use moe_ep::{bf16, Communicator, EpGroup, Error, RecvLayout, UniqueId};

#[path = "common/device.rs"]
mod device;
use device::{bits, down, first_diff, up};

const SEG: usize = 64 << 20;

/// Collective allocations land at equal offsets; each rank writes a pattern
/// into its right neighbour's copy through the peer pointer and every rank
/// checks what it received; pool buffers are symmetric, plain ones are not.
#[test]
fn pool_offsets_peer_writes_and_is_symm_backed() {
    run_worlds("pool_offsets_peer_writes_and_is_symm_backed", 2, |r| {
        let pool = SymmPool::new(&r.comm, SEG);
        let a: SymmBuffer<u32> = pool.alloc(1000)?;
        let b: SymmBuffer<u32> = pool.alloc(1 << 20)?;
        let offsets = r
            .comm
            .all_gather_host(&r.stream, &[a.offset() as u64, b.offset() as u64])?;
        for s in 0..r.world {
            ensure(
                offsets[2 * s] == a.offset() as u64 && offsets[2 * s + 1] == b.offset() as u64,
                || {
                    format!(
                        "offsets differ: rank {s} has {:?}, rank {} has ({}, {})",
                        &offsets[2 * s..2 * s + 2],
                        r.rank,
                        a.offset(),
                        b.offset()
                    )
                },
            )?;
        }
        let right = (r.rank + 1) % r.world;
        let left = (r.rank + r.world - 1) % r.world;
        let peer = b
            .peer_ptr(right)
            .ok_or_else(|| Error::InvalidState(format!("no peer pointer to rank {right}")))?;
        // SAFETY: peer is rank `right`'s copy of b, b.len() u32.
        unsafe { fill_pattern(&r.stream, peer, b.len() as u64, 1000 + r.rank as u32)? };
        r.stream.synchronize().map_err(Error::cuda("sync"))?;
        r.comm.barrier(&r.stream)?;
        let bad = pattern_mismatches(&r.stream, &b, 1000 + left as u32)?;
        ensure(bad == 0, || {
            format!(
                "rank {}: {bad} of {} words from rank {left} wrong",
                r.rank,
                b.len()
            )
        })?;
        // A different seed must not match: the check can fail.
        let wrong = pattern_mismatches(&r.stream, &b, 7)?;
        ensure(wrong > 0, || {
            "pattern checker accepted the wrong seed".into()
        })?;

        ensure(pool.is_symm_backed(b.device_ptr(), b.num_bytes()), || {
            "pool buffer not symm-backed".into()
        })?;
        ensure(!pool.is_symm_backed(b.device_ptr(), SEG * 4), || {
            "range past the segment reported symmetric".into()
        })?;
        let plain = r
            .stream
            .alloc_zeros::<u32>(1024)
            .map_err(Error::cuda("alloc"))?;
        let plain_ptr = DeviceRegion::device_ptr(&plain);
        ensure(!pool.is_symm_backed(plain_ptr, 4096), || {
            "cudaMalloc buffer reported symmetric".into()
        })?;
        Ok(())
    });
}

/// An allocation larger than what is left grows the pool by a segment, and
/// freed space is reused at the same offset.
#[test]
fn pool_grows_past_one_segment_and_reuses() {
    run_worlds("pool_grows_past_one_segment_and_reuses", 2, |r| {
        let pool = SymmPool::new(&r.comm, SEGMENT_GRANULE * 4);
        let a: SymmBuffer<u8> = pool.alloc(SEGMENT_GRANULE * 3)?;
        ensure(pool.num_segments() == 1, || {
            format!("{} segments after the first alloc", pool.num_segments())
        })?;
        let b: SymmBuffer<u8> = pool.alloc(SEGMENT_GRANULE * 2)?; // does not fit the rest of segment 0
        ensure(pool.num_segments() == 2, || {
            format!("{} segments after growth", pool.num_segments())
        })?;
        ensure(!std::sync::Arc::ptr_eq(a.segment(), b.segment()), || {
            "growth reused the full segment".into()
        })?;
        let big: SymmBuffer<u8> = pool.alloc(SEGMENT_GRANULE * 9)?; // larger than a default segment
        ensure(big.segment().size() >= SEGMENT_GRANULE * 9, || {
            "oversized request got a small segment".into()
        })?;
        // The peer copy of a buffer in the second segment works too.
        let peer = b
            .peer_ptr((r.rank + 1) % r.world)
            .ok_or_else(|| Error::InvalidState("no peer".into()))?;
        ensure(peer != 0, || "null peer".into())?;
        let off = a.offset();
        drop(a);
        let c: SymmBuffer<u8> = pool.alloc(SEGMENT_GRANULE)?;
        ensure(
            c.offset() == off && !std::sync::Arc::ptr_eq(c.segment(), b.segment()),
            || "freed range not reused first-fit".into(),
        )?;
        // A length whose bytes overflow is refused by name, on every rank,
        // and the pool is unchanged.
        let before = pool.num_segments();
        match pool.alloc::<u64>(usize::MAX / 4) {
            Err(Error::InvalidArgument { arg: "len", .. }) => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "overflowing length: expected InvalidArgument for len, got {:?}",
                    other.err()
                )))
            }
        }
        ensure(pool.num_segments() == before, || {
            "the refused alloc grew the pool".into()
        })?;
        Ok(())
    });
}

/// 1000 allocate/free cycles leave device memory where it started.
#[test]
fn thousand_alloc_free_cycles_leak_nothing() {
    run_worlds("thousand_alloc_free_cycles_leak_nothing", 2, |r| {
        let pool = SymmPool::new(&r.comm, SEG);
        let warm: SymmBuffer<u8> = pool.alloc(1 << 20)?;
        drop(warm);
        // Every rank synchronised before any rank reads the free memory (on
        // virtual ranks the GPU, and so its free memory, is shared).
        r.ctx.synchronize().map_err(Error::cuda("sync"))?;
        r.comm.barrier(&r.stream)?;
        let (free_before, _) = mem_get_info().map_err(Error::cuda("cuMemGetInfo"))?;
        r.comm.barrier(&r.stream)?;
        for i in 0..1000usize {
            let x: SymmBuffer<u32> = pool.alloc(1 + (i * 7919) % (1 << 20))?;
            let y: SymmBuffer<u8> = pool.alloc(4096 + i)?;
            drop(x);
            drop(y);
        }
        r.ctx.synchronize().map_err(Error::cuda("sync"))?;
        r.comm.barrier(&r.stream)?;
        let (free_after, _) = mem_get_info().map_err(Error::cuda("cuMemGetInfo"))?;
        ensure(pool.num_segments() == 1, || {
            format!("{} segments after the cycles", pool.num_segments())
        })?;
        ensure(free_after == free_before, || {
            format!("free device memory moved: {free_before} -> {free_after} bytes")
        })?;
        Ok(())
    });
}

/// A buffer the caller allocated and registered itself is symmetric like a
/// pool buffer: an NCCL window it registered (one GPU per rank), or, on
/// virtual ranks, its own device allocation registered collectively.
#[test]
fn wrapped_caller_buffer_is_symmetric() {
    run_worlds("wrapped_caller_buffer_is_symmetric", 2, |r| {
        let pool = SymmPool::new(&r.comm, SEG);
        let n = 1usize << 16;
        let bytes = n * 4;
        // The caller's memory: an NCCL window, or a plain allocation.
        let plain = r
            .stream
            .alloc_zeros::<u32>(n)
            .map_err(Error::cuda("alloc"))?;
        let plain_ptr = DeviceRegion::device_ptr(&plain);
        // (window, allocation) to deregister and free at the end (GPUs).
        let mut registered = None;
        let wrapped: SymmBuffer<u32> = match r.ranks {
            Ranks::Virtual => {
                // A window is refused on a virtual rank, naming the argument.
                // SAFETY: refused before anything is dereferenced.
                match unsafe { pool.wrap_window::<u32>(std::ptr::null_mut(), plain_ptr, bytes) } {
                    Err(Error::InvalidArgument { arg: "window", .. }) => {}
                    other => {
                        return Err(Error::InvalidState(format!(
                            "wrap_window on a virtual rank: {:?}",
                            other.err()
                        )))
                    }
                }
                // SAFETY: `plain` outlives the pool and `wrapped` on every rank
                // (both dropped below, before it).
                unsafe { pool.wrap_device(plain_ptr, bytes)? }
            }
            Ranks::Gpus => {
                use moe_ep::runtime::nccl_call as nc;
                let ptr = nc::mem_alloc(bytes)?;
                let raw = r.comm.raw().expect("an NCCL communicator");
                // SAFETY: a fresh ncclMemAlloc of `bytes`, registered
                // collectively; deregistered and freed below, after the pool
                // and `wrapped` are gone.
                let win = unsafe {
                    nc::window_register(
                        raw,
                        ptr,
                        bytes,
                        moe_ep::sys::nccl::NCCL_WIN_COLL_SYMMETRIC,
                    )?
                };
                registered = Some((raw, win, ptr));
                // SAFETY: as above.
                unsafe { pool.wrap_window(win, ptr as u64, bytes)? }
            }
        };
        ensure(pool.is_symm_backed(wrapped.device_ptr(), bytes), || {
            "wrapped buffer not symm-backed".into()
        })?;
        ensure(
            !pool.is_symm_backed(wrapped.device_ptr(), bytes + 4),
            || "range past the wrapped buffer reported symmetric".into(),
        )?;
        let right = (r.rank + 1) % r.world;
        let left = (r.rank + r.world - 1) % r.world;
        let peer = wrapped
            .peer_ptr(right)
            .ok_or_else(|| Error::InvalidState(format!("no peer pointer to rank {right}")))?;
        // SAFETY: rank `right`'s copy of the wrapped buffer, n u32.
        unsafe { fill_pattern(&r.stream, peer, n as u64, 300 + r.rank as u32)? };
        r.comm.barrier(&r.stream)?;
        let bad = pattern_mismatches(&r.stream, &wrapped, 300 + left as u32)?;
        ensure(bad == 0, || {
            format!("rank {}: {bad} of {n} words from rank {left} wrong", r.rank)
        })?;
        r.comm.barrier(&r.stream)?;
        drop(wrapped);
        drop(pool);
        if let Some((raw, win, ptr)) = registered {
            use moe_ep::runtime::nccl_call as nc;
            // SAFETY: registered above; nothing maps it any more.
            unsafe {
                nc::window_deregister(raw, win)?;
                nc::mem_free(ptr)?;
            }
        }
        drop(plain);
        Ok(())
    });
}

/// `bytes` of `ncclMemAlloc` memory registered as a symmetric window of
/// `comm` (collective): (window, address). Undo with [`unregister`].
fn register(
    comm: &Communicator,
    bytes: usize,
) -> moe_ep::Result<(moe_ep::sys::nccl::ncclWindow_t, u64)> {
    use moe_ep::runtime::nccl_call as nc;
    let raw = comm.raw().expect("an NCCL communicator");
    let ptr = nc::mem_alloc(bytes)?;
    // SAFETY: a fresh ncclMemAlloc of `bytes`, registered collectively;
    // deregistered and freed by `unregister`.
    let win = unsafe {
        nc::window_register(raw, ptr, bytes, moe_ep::sys::nccl::NCCL_WIN_COLL_SYMMETRIC)?
    };
    Ok((win, ptr as u64))
}

/// Deregisters (collective) and frees what [`register`] made.
fn unregister(
    comm: &Communicator,
    (win, ptr): (moe_ep::sys::nccl::ncclWindow_t, u64),
) -> moe_ep::Result<()> {
    use moe_ep::runtime::nccl_call as nc;
    let raw = comm.raw().expect("an NCCL communicator");
    // SAFETY: registered by `register`; nothing maps it any more.
    unsafe {
        nc::window_deregister(raw, win)?;
        nc::mem_free(ptr as *mut std::ffi::c_void)?;
    }
    Ok(())
}

/// The zero copy of a runtime that owns its payload memory: a window the
/// caller registered itself (one GPU per rank, world 1 included; on virtual
/// ranks its own device allocation, wrapped with `wrap_device`), wrapped in the group's
/// pool, and a range of it at a byte offset used as dispatch's
/// `recv_tokens` (written in place: the reference's rows there, the bytes
/// before it untouched) and then, as the identity experts' outputs, as
/// combine's `expert_out` (read in place over NVLink: the reference's
/// emulation bit for bit).
#[test]
fn caller_window_at_an_offset_as_recv_tokens_and_expert_out() {
    let (tokens, hidden, topk, experts) = (128usize, 1024usize, 4usize, 32usize);
    // Needs 1 rank: on one GPU also a real world of one rank, whose window
    // is an NCCL one (the virtual worlds wrap device buffers).
    run_worlds(
        "caller_window_at_an_offset_as_recv_tokens_and_expert_out",
        1,
        |r| {
            let shape = Shape {
                num_ranks: r.world,
                num_experts: experts,
                hidden,
                topk,
            };
            let inputs =
                workload::rank_inputs(29, &shape, &vec![tokens; r.world], Routing::Uniform);
            let layout = RecvLayout::RankMajor;
            let want = refr::dispatch(&shape, &inputs, r.rank, layout)?;
            let group = EpGroup::new(&r.comm, r.config(experts, hidden, tokens)?)?;
            let cap = group.recv_capacity();
            let s = &r.stream;
            // The payload starts 3 rows and 64 elements (128 bytes) into
            // the window, which ends one row after it (4 KiB multiple).
            let off = 3 * hidden + 64;
            let elems = (off + cap * hidden + hidden).next_multiple_of(2048);
            let bytes = elems * 2;
            let mut plain = None;
            let mut registered = None;
            let mut window: SymmBuffer<bf16> = match r.ranks {
                Ranks::Gpus => {
                    let (win, ptr) = register(&r.comm, bytes)?;
                    registered = Some((win, ptr));
                    // SAFETY: registered above over `bytes` at `ptr`;
                    // deregistered at the end, after the group is gone.
                    unsafe { group.pool().wrap_window(win, ptr, bytes)? }
                }
                Ranks::Virtual => {
                    let b = s.alloc_zeros::<bf16>(elems).map_err(Error::cuda("alloc"))?;
                    let ptr = DeviceRegion::device_ptr(&b);
                    plain = Some(b);
                    // SAFETY: `plain` outlives the group (dropped after it).
                    unsafe { group.pool().wrap_device(ptr, bytes)? }
                }
            };
            let filler = bf16::from_bits(0x7f7f);
            window.copy_from_host(s, &vec![filler; elems])?;
            r.comm.barrier(s)?;
            let me = &inputs[r.rank];
            let (x, w, idx) = (
                up(s, &me.tokens)?,
                up(s, &me.topk_weights)?,
                up(s, &me.topk_idx)?,
            );
            let handle = group.layout(s, TopkIdx::I64(&idx), topk, layout)?;
            let range = off..off + cap * hidden;
            {
                let mut recv = window.view_mut(range.clone())?;
                let at = DeviceRegion::device_ptr(&recv);
                let got = group.dispatch(
                    s,
                    &handle,
                    &x,
                    &w,
                    DispatchOut {
                        recv_tokens: Some(&mut recv),
                        recv_topk_weights: None,
                    },
                )?;
                ensure(
                    got.tokens.is_callers() && got.tokens.device_ptr() == at,
                    || "recv_tokens at the window's offset not used in place".into(),
                )?;
            }
            let all = down(s, &window, elems)?;
            first_diff(
                "rows at the window's offset",
                &bits(&all[off..off + want.num_rows * hidden]),
                &bits(&want.tokens),
            )?;
            ensure(
                all[..off].iter().all(|v| v.to_bits() == filler.to_bits()),
                || "bytes before the offset written".into(),
            )?;
            // Identity experts: the received rows, in place, are the expert
            // outputs; combine pulls them from every rank's window.
            let mut out = s
                .alloc_zeros::<bf16>(tokens * hidden)
                .map_err(Error::cuda("alloc"))?;
            {
                let y = window.view(range)?;
                group.combine(s, &handle, &y, None, &mut out)?;
            }
            let outs: Vec<Vec<bf16>> = (0..r.world)
                .map(|d| refr::dispatch(&shape, &inputs, d, layout).map(|o| o.tokens))
                .collect::<moe_ep::Result<_>>()?;
            let emu = refr::combine_emulated(&shape, &inputs, &outs, r.rank, layout, false)?;
            first_diff(
                "combine of the window's rows",
                &bits(&down(s, &out, tokens * hidden)?),
                &bits(&emu),
            )?;
            group.check()?;
            r.comm.barrier(s)?;
            drop(handle);
            drop(window);
            drop(group);
            if let Some(reg) = registered {
                unregister(&r.comm, reg)?;
            }
            drop(plain);
            Ok(())
        },
    );
}

/// A window registered on another communicator (the same GPUs, the ranks
/// in reverse order) is refused on every rank naming `window`; the same
/// window wrapped by a pool of its own communicator is accepted, and so is
/// a window of this communicator after the refusal.
/// Needs 2 GPUs (a virtual rank has no window: refused by name, tested in
/// `wrapped_caller_buffer_is_symmetric`).
#[test]
fn window_of_another_communicator_is_refused() {
    let test = "window_of_another_communicator_is_refused";
    let Some(gpus) = gpus_or_skip(test, 2) else {
        return;
    };
    eprintln!("{test}:");
    let world = World {
        size: gpus,
        ranks: Ranks::Gpus,
    };
    run_ranks(world, |r| {
        let s = &r.stream;
        // Rank 0's id for the second communicator, through the first.
        let mine = match r.rank {
            0 => UniqueId::generate()?.to_bytes(),
            _ => [0u8; 128],
        };
        let all = r.comm.all_gather_host(s, &mine)?;
        let mut id = [0u8; 128];
        id.copy_from_slice(&all[..128]);
        let other = Communicator::init(
            &r.ctx,
            &UniqueId::from_bytes(id),
            r.world - 1 - r.rank,
            r.world,
        )?;
        let bytes = 4 << 20;
        let theirs = register(&other, bytes)?;
        let pool = SymmPool::new(&r.comm, SEG);
        // SAFETY: a live window; refused before anything keeps it.
        match unsafe { pool.wrap_window::<u8>(theirs.0, theirs.1, bytes) } {
            Err(Error::InvalidArgument {
                arg: "window", got, ..
            }) if got.contains("another communicator") => {}
            other => {
                return Err(Error::InvalidState(format!(
                    "rank {}: a window of another communicator: {:?}",
                    r.rank,
                    other.map(|b| b.len())
                )))
            }
        }
        // Its own communicator's pool takes it.
        let own_pool = SymmPool::new(&other, SEG);
        // SAFETY: a live window of `other` at its own base; the pool goes
        // before the window is deregistered.
        let ok = unsafe { own_pool.wrap_window::<u8>(theirs.0, theirs.1, bytes)? };
        ensure(own_pool.is_symm_backed(ok.device_ptr(), bytes), || {
            "the window not symmetric in its own communicator's pool".into()
        })?;
        drop(ok);
        drop(own_pool);
        // A window of this communicator.
        let ours = register(&r.comm, bytes)?;
        // Nothing was registered by the refusal: a good window after it
        // is symmetric (the collective contract held).
        // SAFETY: a live window of this communicator at its base; the pool
        // goes before the window is deregistered.
        let good = unsafe { pool.wrap_window::<u8>(ours.0, ours.1, bytes)? };
        ensure(pool.is_symm_backed(good.device_ptr(), bytes), || {
            "a window of this communicator not symmetric after the refusals".into()
        })?;
        r.comm.barrier(s)?;
        drop(good);
        drop(pool);
        unregister(&r.comm, ours)?;
        unregister(&other, theirs)?;
        drop(other);
        Ok(())
    });
}

/// Virtual ranks: a rank whose thread panics leaves the world, and every
/// other rank's next host collective fails at once naming it (no hang, no
/// timeout to sit out); a rank that never arrives is named after the timeout.
#[test]
fn virtual_rank_that_panics_or_stays_away_is_named() {
    let Some(_) = gpus_or_skip("virtual_rank_that_panics_or_stays_away_is_named", 1) else {
        return;
    };
    let ctx = moe_ep::context(0).expect("GPU 0");
    for world in [2usize, 4, 8] {
        eprintln!("  world {world}, virtual ranks on GPU 0");
        let comms = Communicator::virtual_world_with_timeout(&ctx, world, Duration::from_secs(20))
            .expect("virtual world");
        let t0 = Instant::now();
        let results: Vec<Result<(), String>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let ctx = ctx.clone();
                    s.spawn(move || {
                        let stream = ctx.new_stream().expect("stream");
                        comm.barrier(&stream).map_err(|e| e.to_string())?;
                        if comm.rank() == world - 1 {
                            panic!("rank {} fails on purpose", comm.rank());
                        }
                        comm.barrier(&stream).map_err(|e| e.to_string())
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
                .collect()
        });
        let took = t0.elapsed();
        assert!(
            took < Duration::from_secs(10),
            "world {world}: took {took:?}"
        );
        for (rank, res) in results.iter().enumerate() {
            let want = if rank == world - 1 {
                "panicked".to_string()
            } else {
                format!("rank {} panicked", world - 1)
            };
            match res {
                Err(e) if e.contains(&want) => {}
                other => panic!("world {world} rank {rank}: expected an error naming the panicked rank, got {other:?}"),
            }
        }
    }
    // A rank that never arrives: named by every other rank after the timeout.
    let comms = Communicator::virtual_world_with_timeout(&ctx, 4, Duration::from_millis(500))
        .expect("virtual world");
    let t0 = Instant::now();
    let errs: Vec<Error> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .filter(|c| c.rank() != 2)
            .map(|comm| {
                let ctx = ctx.clone();
                s.spawn(move || {
                    let stream = ctx.new_stream().expect("stream");
                    comm.barrier(&stream).expect_err("rank 2 never arrives")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for e in errs {
        match e {
            Error::CollectiveFailed { missing, .. } if missing == vec![2] => {}
            other => panic!("expected CollectiveFailed naming rank 2, got {other}"),
        }
    }
}

/// One process per GPU: this test re-runs its own binary once per rank (the
/// child part below), sharing the NCCL unique id through the environment.
#[test]
fn one_process_per_gpu() {
    let Some(world) = gpus_or_skip("one_process_per_gpu", 2) else {
        return;
    };
    let id = moe_ep::UniqueId::generate().expect("unique id");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args([
                    "--exact",
                    "process_rank_child",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("MOE_EP_CHILD_RANK", rank.to_string())
                .env("MOE_EP_CHILD_WORLD", world.to_string())
                .env("MOE_EP_CHILD_ID", id.to_hex())
                .spawn()
                .expect("spawn child")
        })
        .collect();
    for (rank, mut c) in children.into_iter().enumerate() {
        let st = c.wait().expect("wait");
        assert!(st.success(), "rank {rank} process failed: {st}");
    }
}

/// The per-process rank of `one_process_per_gpu` (ignored unless started by it).
#[test]
#[ignore = "started by one_process_per_gpu with MOE_EP_CHILD_* set"]
fn process_rank_child() {
    let get = |k: &str| {
        std::env::var(k).unwrap_or_else(|_| panic!("{k} unset: run one_process_per_gpu instead"))
    };
    let (rank, world): (usize, usize) = (
        get("MOE_EP_CHILD_RANK").parse().unwrap(),
        get("MOE_EP_CHILD_WORLD").parse().unwrap(),
    );
    let id = moe_ep::UniqueId::from_hex(&get("MOE_EP_CHILD_ID")).unwrap();
    let ctx = moe_ep::context(rank).unwrap();
    let comm = moe_ep::Communicator::init(&ctx, &id, rank, world).unwrap();
    let stream = ctx.new_stream().unwrap();
    let pool = SymmPool::new(&comm, SEG);
    let b: SymmBuffer<u32> = pool.alloc(1 << 16).unwrap();
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    // SAFETY: right's copy of b.
    unsafe {
        fill_pattern(
            &stream,
            b.peer_ptr(right).unwrap(),
            b.len() as u64,
            50 + rank as u32,
        )
        .unwrap()
    };
    stream.synchronize().unwrap();
    comm.barrier(&stream).unwrap();
    assert_eq!(
        pattern_mismatches(&stream, &b, 50 + left as u32).unwrap(),
        0,
        "rank {rank}: data from rank {left} wrong"
    );
    comm.barrier(&stream).unwrap();
    println!("process rank {rank}/{world}: received rank {left}'s pattern intact");
}

/// Virtual ranks: `abort` on one rank while a group and a pool buffer still
/// hold its communicator fails every rank's next host collective at once
/// (naming the rank that aborted); a new world and a new group then work.
#[test]
fn abort_while_a_group_holds_the_communicator() {
    let Some(_) = gpus_or_skip("abort_while_a_group_holds_the_communicator", 1) else {
        return;
    };
    let ctx = moe_ep::context(0).expect("GPU 0");
    let world = 4;
    let build = |round: usize| -> Vec<Result<(), String>> {
        let comms = Communicator::virtual_world_with_timeout(&ctx, world, Duration::from_secs(20))
            .expect("virtual world");
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let ctx = ctx.clone();
                    s.spawn(move || -> Result<(), String> {
                        let e = |e: Error| e.to_string();
                        let stream = ctx.new_stream().map_err(|x| x.to_string())?;
                        let mut cfg = moe_ep::GroupConfig::new(8 * world, 1024, 16);
                        cfg.num_sms = 2;
                        let group = moe_ep::EpGroup::new(&comm, cfg).map_err(e)?;
                        let buf: SymmBuffer<u32> = group.pool().alloc(1024).map_err(e)?;
                        comm.barrier(&stream).map_err(e)?;
                        if round == 0 && comm.rank() == 1 {
                            comm.abort().map_err(e)?;
                        }
                        let res = comm.barrier(&stream).map_err(e);
                        drop((buf, group));
                        res
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
                .collect()
        })
    };
    let t0 = Instant::now();
    let aborted = build(0);
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    for (rank, res) in aborted.iter().enumerate() {
        match res {
            Err(e) if e.contains("rank 1 aborted") => {}
            other => panic!("rank {rank}: expected the abort of rank 1 named, got {other:?}"),
        }
    }
    for (rank, res) in build(1).iter().enumerate() {
        assert!(res.is_ok(), "new world, rank {rank}: {res:?}");
    }
}
