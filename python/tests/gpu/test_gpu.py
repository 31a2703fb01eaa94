"""GPU tests of the Python package, through torch tensors (skipped without
torch or a GPU).

Worlds: ``MOE_EP_PY_WORLDS`` (default ``1,2,4,8``): 1 is a real NCCL
communicator of one rank, the others virtual ranks on GPU 0, one Python
thread and one torch stream each.

- Round trips, bit for bit against a CPU reference written here from the
  rules of ``moe_ep::reference`` (row order, padding, combine's f32 order;
  weights are powers of two, so each weighted term is exact): dispatch,
  combine, both backward passes, rank-major and expert-major; the
  low-latency mode in both layouts, two-phase, and its fp8 cast (within the
  cast's rounding).
- Zero copy: results alias the symmetric pool (``data_ptr()`` is the pool
  buffer's; ``out=`` tensors from ``symm_empty`` and from a ``MemPool`` over
  the pool are written in place).
- CUDA graphs: a high-throughput step (dispatch and combine) and a
  low-latency step captured once (``CUDAGraph.capture_begin`` in thread-local
  mode, every rank idle first) and replayed with new inputs.
- Autograd: the example's MoE layer, forward and backward, against torch's
  own computation of the same dense layer.
- fp8 dispatch (e8m0 per 32 and f32 per 128 scales, both layouts, pool
  and caller receive buffers) bit for bit against the CPU reference; the
  drop policy (``overflow="drop"`` below the need: dropped rows, slots and
  the kept routing against ``moe_ep::reference::drop_over_capacity``'s rules
  written here, then dispatch into eagerly sized buffers of
  ``max_recv_rows`` rows and combine bit for bit against the reference of
  the kept routing); the memory footprint.
- Streams: an op given ``stream=`` waits for its inputs written on
  torch's current stream.
- A group from a ``torch.distributed`` process group (gloo, world 1) and
  the refusals, in the run whose worlds include 1.

Run: ``python3 -m unittest discover -s python/tests/gpu -v`` with the wheel
installed (``scripts/gpu-python.sh`` does).
"""

import os
import sys
import tempfile
import threading
import time
import unittest

# Virtual ranks: every kernel loaded when CUDA starts (moe_ep.run_virtual
# says why); before the first CUDA call.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

import moe_ep

HAVE_GPU = torch is not None and torch.cuda.is_available()
WORLDS = [int(w) for w in os.environ.get("MOE_EP_PY_WORLDS", "1,2,4,8").split(",") if w]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

H, K, M = 256, 4, 64  # hidden, top-k, max tokens per rank


def capacity(world, el, layout, alignment=1):
    """Receive rows enough for any routing here: rank-major every token of
    every rank (the group's default); expert-major min(K, el) rows of each
    token plus every local expert's padding to `alignment`."""
    if layout == "rank_major":
        return world * M
    return world * M * min(K, el) + el * (alignment - 1)


def ht_group(comm, world, el, layout, alignment=1):
    """A high-throughput group of `el` experts a rank with room for `layout`."""
    return moe_ep.Group(
        comm,
        num_experts=el * world,
        hidden=H,
        max_tokens_per_rank=M,
        recv_capacity=capacity(world, el, layout, alignment),
    )


def run_world(world, fn):
    """fn(comm) on every rank of a world: NCCL at 1, virtual above."""
    if world == 1:
        comm = moe_ep.Communicator.init(0, moe_ep.unique_id(), 0, 1)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            r = fn(comm)
            s.synchronize()
        return [r]
    return moe_ep.run_virtual(world, fn)


def inputs(rank, world, seed=0, experts_per_rank=4, t_max=48):
    """Rank `rank`'s tokens (CPU): x [T, H] bf16, topk_idx [T, K] int64
    (distinct experts, ~15% -1), weights [T, K] powers of two."""
    e = experts_per_rank * world
    t = max(1, t_max - 5 * rank)
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    k = min(K, e)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int64)
    idx[torch.rand(t, k, generator=g) < 0.15] = -1
    w = torch.pow(2.0, -torch.randint(0, 4, (t, k), generator=g).float())
    return x, idx, w


def cpu(t):
    torch.cuda.current_stream().synchronize()
    return t.cpu()


# ---- the CPU reference ------------------------------------------------------


def ref_dispatch(all_inputs, dst, el, layout, alignment=1):
    """The rows rank `dst` receives: (tokens [rows, H], weights, local idx,
    src [rows, 2], per-expert counts), moe_ep::reference's order."""
    rows = []  # (x, w, idx, (s, t))
    counts = [0] * el
    first = dst * el
    if layout == "rank_major":
        for s, (x, idx, w) in enumerate(all_inputs):
            for t in range(x.shape[0]):
                here = [(int(e) - first) if 0 <= int(e) - first < el else -1 for e in idx[t]]
                if any(h >= 0 for h in here):
                    ws = [float(w[t, k]) if here[k] >= 0 else 0.0 for k in range(len(here))]
                    rows.append((x[t], ws, here, (s, t)))
    else:
        for j in range(el):
            start = len(rows)
            for s, (x, idx, w) in enumerate(all_inputs):
                for t in range(x.shape[0]):
                    for k in range(idx.shape[1]):
                        if int(idx[t, k]) == first + j:
                            rows.append((x[t], float(w[t, k]), j, (s, t)))
            counts[j] = len(rows) - start
            while (len(rows) - start) % alignment:
                rows.append((torch.zeros(H, dtype=torch.bfloat16), 0.0, -1, (-1, -1)))
    if not rows:
        return None, None, None, None, counts
    tokens = torch.stack([r[0] for r in rows])
    weights = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    lidx = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    src = torch.tensor([r[3] for r in rows], dtype=torch.int32)
    return tokens, weights, lidx, src, counts


def ref_combine(all_inputs, home, el, layout, expert_out_of, weighted, alignment=1):
    """combine_emulated: per destination d ascending where the token went,
    the partial (rank-major: the row; expert-major: f32 sum of its rows in
    row order, weighted or not, rounded to bf16), summed in f32 at home."""
    world = len(all_inputs)
    x_home = all_inputs[home][0]
    acc = torch.zeros(x_home.shape[0], H, dtype=torch.float32)
    for d in range(world):
        _, wts, _, src, _ = ref_dispatch(all_inputs, d, el, layout, alignment)
        if src is None:
            continue
        y = expert_out_of(d)
        rows_of = {}
        for row, (s, t) in enumerate(src.tolist()):
            if s == home:
                rows_of.setdefault(t, []).append(row)
        for t, sel in rows_of.items():
            if layout == "rank_major":
                part = y[sel[0]].float()
            else:
                p = torch.zeros(H, dtype=torch.float32)
                for r in sel:
                    p = p + (float(wts[r]) * y[r].float() if weighted else y[r].float())
                part = p.to(torch.bfloat16).float()
            acc[t] = acc[t] + part
    return acc.to(torch.bfloat16)


def ref_rows(all_inputs, payloads, dst, el, layout, alignment=1):
    """Any per-token payload (``payloads[s]`` ``[T_s, W]``) in the rows rank
    `dst` receives: the row of (source rank, token), zeros on padding."""
    src = ref_dispatch(all_inputs, dst, el, layout, alignment)[3]
    if src is None:
        return None
    zero = torch.zeros_like(payloads[0][0])
    return torch.stack([payloads[s][t] if s >= 0 else zero for s, t in src.tolist()])


def ref_drop(all_inputs, el, layout, alignment, cap):
    """moe_ep::reference::drop_over_capacity: (every rank's inputs with its
    dropped slots set to -1, rows each receiver dropped, per rank [T, K]
    dropped slots). Per receiver over `cap`, the sources (rank-major, in
    tokens) or local experts (expert-major, in blocks of `alignment` rows)
    share it by water-filling, the extra units to the lowest first; each
    keeps its first rows in (source rank, token) order."""
    world = len(all_inputs)
    kept = [(x, idx.clone(), w) for x, idx, w in all_inputs]
    slots = [torch.zeros(idx.shape, dtype=torch.bool) for _, idx, _ in all_inputs]
    dropped = [0] * world

    def share(need, unit):
        blocks = [-(-n // unit) for n in need]
        if sum(blocks) * unit <= cap:
            return list(need)

        def kb(m):
            return sum(min(b, m) for b in blocks) * unit

        q = max(m for m in range(max(blocks) + 1) if kb(m) <= cap)
        left = (cap - kb(q)) // unit
        out = []
        for n, b in zip(need, blocks):
            keep = min(b, q)
            if b > q and left > 0:
                keep, left = keep + 1, left - 1
            out.append(min(n, keep * unit))
        return out

    for d in range(world):
        lo = d * el
        if layout == "rank_major":
            on_d = [
                [t for t in range(idx.shape[0]) if any(lo <= int(e) < lo + el for e in idx[t])]
                for _, idx, _ in all_inputs
            ]
            keep = share([len(v) for v in on_d], 1)
            dropped[d] = sum(len(v) for v in on_d) - sum(keep)
            for s, toks in enumerate(on_d):
                idx = all_inputs[s][1]
                for t in toks[keep[s] :]:
                    for k in range(idx.shape[1]):
                        if lo <= int(idx[t, k]) < lo + el:
                            kept[s][1][t, k] = -1
                            slots[s][t, k] = True
        else:
            per = [[int((idx == lo + j).sum()) for _, idx, _ in all_inputs] for j in range(el)]
            need = [sum(p) for p in per]
            keep = share(need, alignment)
            dropped[d] = sum(need) - sum(keep)
            for j in range(el):
                before = 0
                for s, (_, idx, _) in enumerate(all_inputs):
                    keep_s = min(max(keep[j] - before, 0), per[j][s])
                    before += per[j][s]
                    seen = 0
                    for i, e in enumerate(idx.flatten().tolist()):
                        if e == lo + j:
                            seen += 1
                            if seen > keep_s:
                                t, k = divmod(i, idx.shape[1])
                                kept[s][1][t, k] = -1
                                slots[s][t, k] = True
    return kept, dropped, slots


def fp8_inputs(rank, t, kind, seed=0):
    """Rank `rank`'s fp8 rows (CPU): any code bytes [t, H] uint8, and scales
    [t, H / 32] uint8 (e8m0) or [t, H / 128] float32."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    codes = torch.randint(0, 256, (t, H), generator=g, dtype=torch.uint8)
    if kind == "e8m0":
        scales = torch.randint(0, 256, (t, H // 32), generator=g, dtype=torch.uint8)
    else:
        scales = torch.rand(t, H // 128, generator=g) * 8
    return codes, scales


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
class HighThroughput(unittest.TestCase):
    def round_trip(self, world, layout, alignment):
        el = 4

        def rank(comm):
            r = comm.rank
            group = ht_group(comm, world, el, layout, alignment)
            all_in = [inputs(s, world) for s in range(world)]
            x, idx, w = (t.cuda() for t in all_in[r])
            h = group.layout(idx, layout=layout, alignment=alignment)
            d = group.dispatch(h, x, w)
            counts = h.host_counts()
            rows = counts["recv_rows"]
            rt, rw, ri, rs, rc = ref_dispatch(all_in, r, el, layout, alignment)
            # Zero copy: every result aliases the group's symmetric pool.
            for tns in (d.tokens, d.topk_weights, d.topk_idx, d.src):
                self.assertTrue(group.is_symm_backed(tns))
            self.assertEqual(d.tokens.shape, (group.recv_capacity, H))
            if rt is None:
                self.assertEqual(rows, 0)
            else:
                self.assertEqual(rows, rt.shape[0])
                self.assertTrue(torch.equal(cpu(d.tokens[:rows]), rt))
                self.assertTrue(torch.equal(cpu(d.topk_weights[:rows]), rw))
                self.assertTrue(torch.equal(cpu(d.topk_idx[:rows]), ri))
                self.assertTrue(torch.equal(cpu(d.src[:rows]), rs))
            if layout == "expert_major":
                self.assertEqual(cpu(d.tokens_per_expert).tolist(), rc)
                self.assertEqual(counts["tokens_per_local_expert"], rc)
            # Combine with identity experts (expert-major weighted by the
            # received weights) and its reference.
            weighted = layout == "expert_major"
            out = group.combine(h, d.tokens, weights=d.topk_weights if weighted else None)

            def y_of(dst):
                return ref_dispatch(all_in, dst, el, layout, alignment)[0]

            ref = ref_combine(all_in, r, el, layout, y_of, weighted, alignment)
            self.assertTrue(torch.equal(cpu(out), ref), f"combine on rank {r}")
            # Backward of dispatch: the received rows' gradient (here the
            # rows themselves) combined unweighted; the weights' gradient
            # routed back (here the weights, so: w where routed, else 0).
            gx, gw = group.dispatch_backward(h, d.tokens, d.topk_weights)
            ref_gx = ref_combine(all_in, r, el, layout, y_of, False, alignment)
            self.assertTrue(torch.equal(cpu(gx), ref_gx), f"dispatch_backward on rank {r}")
            w_cpu, idx_cpu = all_in[r][2], all_in[r][1]
            self.assertTrue(torch.equal(cpu(gw), torch.where(idx_cpu >= 0, w_cpu, torch.zeros_like(w_cpu))))
            # Backward of combine: the output's gradient (here x) dispatched
            # back into the layout: the same rows as dispatch's tokens.
            gy = group.combine_backward(h, x)
            if rt is not None:
                self.assertTrue(torch.equal(cpu(gy[:rows]), rt))
            group.check()
            return rows

        run_world(world, rank)

    def test_round_trips_bit_exact(self):
        for world in WORLDS:
            for layout, alignment in (("rank_major", 1), ("expert_major", 1), ("expert_major", 8)):
                with self.subTest(world=world, layout=layout, alignment=alignment):
                    self.round_trip(world, layout, alignment)

    def test_zero_copy_into_symmetric_outputs(self):
        for world in WORLDS:
            with self.subTest(world=world):

                def rank(comm):
                    group = moe_ep.Group(comm, num_experts=4 * world, hidden=H, max_tokens_per_rank=M)
                    cap = group.recv_capacity
                    recv = group.symm_empty((cap, H), torch.bfloat16)
                    recv_w = group.symm_empty((cap, K), torch.float32)
                    x, idx, w = (t.cuda() for t in inputs(comm.rank, world, seed=3))
                    h = group.layout(idx)
                    d = group.dispatch(h, x, w, out=(recv, recv_w))
                    self.assertEqual(d.tokens.data_ptr(), recv.data_ptr())
                    self.assertEqual(d.topk_weights.data_ptr(), recv_w.data_ptr())
                    # A pool result's tensor is the DeviceArray's memory.
                    tok, _, _, _ = group._g.dispatch(torch.cuda.current_stream().cuda_stream, h._h, x, w)
                    self.assertEqual(torch.from_dlpack(tok).data_ptr(), tok.data_ptr)
                    # Expert outputs in place in the receive buffer, read by
                    # their home ranks over the peer mappings.
                    out = group.combine(h, recv)
                    group.check()
                    return cpu(out)

                run_world(world, rank)

    def test_mem_pool_allocations_are_symmetric(self):
        for world in [w for w in WORLDS if w <= 2]:
            with self.subTest(world=world):
                # No rank drops its group (and with it its MemPool) while
                # another is still inside symmetric_allocations (torch
                # aborts then): every rank meets here first.
                barrier = threading.Barrier(world)

                def rank(comm):
                    group = moe_ep.Group(comm, num_experts=4 * world, hidden=H, max_tokens_per_rank=M)
                    cap = group.recv_capacity
                    with group.symmetric_allocations():
                        recv = torch.empty((cap, H), dtype=torch.bfloat16, device="cuda")
                    self.assertTrue(group.is_symm_backed(recv))
                    x, idx, w = (t.cuda() for t in inputs(comm.rank, world, seed=5))
                    h = group.layout(idx)
                    d = group.dispatch(h, x, w, out=(recv, None))
                    self.assertEqual(d.tokens.data_ptr(), recv.data_ptr())
                    group.check()
                    barrier.wait()
                    return True

                run_world(world, rank)

    def test_cuda_graph_capture_and_replay(self):
        for world in [w for w in WORLDS if w <= 2]:
            with self.subTest(world=world):
                barrier = threading.Barrier(world)

                def rank(comm):
                    r = comm.rank
                    el = 4
                    group = moe_ep.Group(comm, num_experts=el * world, hidden=H, max_tokens_per_rank=M)
                    cap = group.recv_capacity
                    all_in = [inputs(s, world, seed=10) for s in range(world)]
                    x, idx, w = (t.cuda() for t in all_in[r])
                    # The layout and the receive buffers outside the graph
                    # (as in the Rust test); an eager step first.
                    h = group.layout(idx)
                    recv = group.symm_empty((cap, H), torch.bfloat16)
                    recv_w = group.symm_empty((cap, K), torch.float32)
                    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16, device="cuda")
                    d = group.dispatch(h, x, w, out=(recv, recv_w))
                    group.combine(h, d.tokens, out=out)
                    group.check()
                    group.allow_graph_capture()
                    g = torch.cuda.CUDAGraph()
                    # Every rank idle before any rank captures (a device-wide
                    # synchronisation must not meet a sibling's capture).
                    torch.cuda.synchronize()
                    barrier.wait()
                    g.capture_begin(capture_error_mode="thread_local")
                    d = group.dispatch(h, x, w, out=(recv, recv_w))
                    group.combine(h, d.tokens, out=out)
                    g.capture_end()
                    # Instantiation may wait for the whole GPU: every rank
                    # instantiates before any rank's replay waits for the others.
                    barrier.wait()
                    for replay in range(2):
                        new = [inputs(q, world, seed=10) for q in range(world)]
                        for q in range(world):
                            new[q] = (new[q][0] * (replay + 2), new[q][1], new[q][2])
                        x.copy_(new[r][0])
                        out.zero_()
                        g.replay()
                        ref = ref_combine(
                            new, r, el, "rank_major", lambda dd: ref_dispatch(new, dd, el, "rank_major")[0], False
                        )
                        self.assertTrue(torch.equal(cpu(out), ref), f"replay {replay} rank {r}")
                    group.check()
                    barrier.wait()
                    del g
                    return True

                run_world(world, rank)


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
class TransformerEngineFeatures(unittest.TestCase):
    """fp8 dispatch, the drop policy, eager sizing and the footprint."""

    def fp8_round_trip(self, world, layout, alignment, kind, caller_out):
        el = 4

        def rank(comm):
            r = comm.rank
            group = ht_group(comm, world, el, layout, alignment)
            self.assertIs(group.config["zero_padding"], True)
            all_in = [inputs(s, world, seed=30) for s in range(world)]
            fp8 = [fp8_inputs(s, all_in[s][0].shape[0], kind, seed=30) for s in range(world)]
            _, idx, w = (t.cuda() for t in all_in[r])
            codes, scales = (t.cuda() for t in fp8[r])
            h = group.layout(idx, layout=layout, alignment=alignment)
            out = None
            if caller_out:
                cap = group.recv_capacity
                sdt = torch.uint8 if kind == "e8m0" else torch.float32
                sw = H // 32 if kind == "e8m0" else H // 128
                wshape = (cap,) if layout == "expert_major" else (cap, K)
                out = (
                    group.symm_empty((cap, H), torch.uint8),
                    group.symm_empty((cap, sw), sdt),
                    group.symm_empty(wshape, torch.float32),
                )
            d = group.dispatch_fp8(h, codes, scales, w, out=out)
            if out is not None:
                for got, given in zip(d[:3], out):
                    self.assertEqual(got.data_ptr(), given.data_ptr())
            for tns in (d.codes, d.scales, d.topk_weights, d.topk_idx, d.src):
                self.assertTrue(group.is_symm_backed(tns))
            self.assertEqual(d.codes.dtype, torch.uint8)
            self.assertEqual(d.scales.dtype, torch.uint8 if kind == "e8m0" else torch.float32)
            rows = h.host_counts()["recv_rows"]
            _, rw, ri, rs, _ = ref_dispatch(all_in, r, el, layout, alignment)
            if rs is None:
                self.assertEqual(rows, 0)
            else:
                self.assertEqual(rows, rs.shape[0])
                want_c = ref_rows(all_in, [f[0] for f in fp8], r, el, layout, alignment)
                want_s = ref_rows(all_in, [f[1] for f in fp8], r, el, layout, alignment)
                self.assertTrue(torch.equal(cpu(d.codes[:rows]), want_c), f"codes on rank {r}")
                got_s = cpu(d.scales[:rows])
                if kind == "f32":  # bit for bit
                    got_s, want_s = got_s.view(torch.int32), want_s.view(torch.int32)
                self.assertTrue(torch.equal(got_s, want_s), f"scales on rank {r}")
                self.assertTrue(torch.equal(cpu(d.topk_weights[:rows]), rw))
                self.assertTrue(torch.equal(cpu(d.topk_idx[:rows]), ri))
                self.assertTrue(torch.equal(cpu(d.src[:rows]), rs))
            fp = group.memory_footprint()
            self.assertGreater(fp["workspace"], 0)
            self.assertEqual(
                fp["device_total"],
                fp["workspace"] + fp["low_latency"] + fp["pool_other"] + fp["two_level"],
            )
            self.assertGreater(h.device_bytes, 0)
            group.check()
            return rows

        run_world(world, rank)

    def test_fp8_round_trips_bit_exact(self):
        cases = (
            ("rank_major", 1, "e8m0", False),
            ("expert_major", 8, "e8m0", False),
            ("rank_major", 1, "f32", True),
            ("expert_major", 8, "f32", True),
        )
        for world in WORLDS:
            for layout, alignment, kind, caller_out in cases:
                with self.subTest(world=world, layout=layout, kind=kind, out=caller_out):
                    self.fp8_round_trip(world, layout, alignment, kind, caller_out)

    def drop_round_trip(self, world, layout, alignment):
        el = 4
        all_in = [inputs(s, world, seed=40) for s in range(world)]
        need = [ref_dispatch(all_in, d, el, layout, alignment)[3] for d in range(world)]
        most = max(0 if n is None else n.shape[0] for n in need)
        cap = most * 2 // 3
        kept_in, dropped, slots = ref_drop(all_in, el, layout, alignment, cap)
        self.assertGreater(sum(dropped), 0, "the case drops nothing")
        kept_rows = [
            0 if (v := ref_dispatch(kept_in, d, el, layout, alignment)[3]) is None else v.shape[0]
            for d in range(world)
        ]

        def rank(comm):
            r = comm.rank
            group = moe_ep.Group(
                comm,
                num_experts=el * world,
                hidden=H,
                max_tokens_per_rank=M,
                recv_capacity=cap,
                overflow="drop",
            )
            x, idx, w = (t.cuda() for t in all_in[r])
            h = group.layout(idx, layout=layout, alignment=alignment)
            counts = h.host_counts()
            self.assertEqual(counts["dropped_rows"], dropped)
            self.assertEqual((counts["recv_rows"], counts["max_recv_rows"]), (kept_rows[r], max(kept_rows)))
            self.assertTrue(torch.equal(h.dropped_slots(), slots[r]), f"dropped slots on rank {r}")
            self.assertTrue(torch.equal(cpu(h.kept_topk_idx()), kept_in[r][1].to(torch.int32)))
            # Eager sizing: receive tokens of max_recv_rows rows (collective:
            # the same on every rank) instead of recv_capacity.
            tok = group.symm_empty((counts["max_recv_rows"], H), torch.bfloat16)
            d = group.dispatch(h, x, w, out=(tok, None))
            rows = kept_rows[r]
            rt, rw, ri, rs, _ = ref_dispatch(kept_in, r, el, layout, alignment)
            if rows:
                self.assertTrue(torch.equal(cpu(d.tokens[:rows]), rt), f"kept rows on rank {r}")
                self.assertTrue(torch.equal(cpu(d.topk_idx[:rows]), ri))
                self.assertTrue(torch.equal(cpu(d.src[:rows]), rs))
            weighted = layout == "expert_major"
            out = group.combine(h, d.tokens, weights=d.topk_weights[: tok.shape[0]] if weighted else None)

            def y_of(dst):
                return ref_dispatch(kept_in, dst, el, layout, alignment)[0]

            ref = ref_combine(kept_in, r, el, layout, y_of, weighted, alignment)
            self.assertTrue(torch.equal(cpu(out), ref), f"combine on rank {r}")
            group.check()

        run_world(world, rank)

    def test_overflow_drop(self):
        for world in WORLDS:
            for layout, alignment in (("rank_major", 1), ("expert_major", 4)):
                with self.subTest(world=world, layout=layout):
                    self.drop_round_trip(world, layout, alignment)


def ll_ref_tokens(all_in, dst, el, layout):
    """Low-latency expert-major rows on `dst`: per local expert, (s, t) in
    order; rank-major rows: row s * M + t for every token of s."""
    return ref_dispatch(all_in, dst, el, "expert_major" if layout == "expert_major" else "rank_major")


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
class LowLatency(unittest.TestCase):
    def ll_round_trip(self, world, layout, two_phase, cast):
        el = 2

        def rank(comm):
            r = comm.rank
            group = moe_ep.Group(
                comm, num_experts=el * world, hidden=H, max_tokens_per_rank=M, mode="low_latency"
            )
            all_in = [inputs(s, world, seed=20, experts_per_rank=el) for s in range(world)]
            x, idx, w = (t.cuda() for t in all_in[r])
            if two_phase:
                b = group.ll_dispatch_send(x, idx, w, layout=layout, cast_fp8=cast)
                group.ll_dispatch_wait(b)
            else:
                b = group.ll_dispatch(x, idx, w, layout=layout, cast_fp8=cast)
            self.assertEqual(b.state, "received")
            if layout == "expert_major":
                rt, _, _, rs, rc = ref_dispatch(all_in, r, el, "expert_major")
                self.assertEqual(cpu(b.tokens_per_expert).tolist(), rc)
                if cast is None:
                    for j in range(el):
                        got = cpu(b.tokens[j, : rc[j]])
                        start = sum(rc[:j])
                        self.assertTrue(torch.equal(got, rt[start : start + rc[j]]))
                        self.assertTrue(torch.equal(cpu(b.src[j, : rc[j]]), rs[start : start + rc[j]]))
                    y = b.tokens
                else:
                    codes, scales = b.fp8_codes, b.fp8_scales
                    deq = codes.float() * scales.repeat_interleave(128, dim=-1)
                    for j in range(el):
                        start = sum(rc[:j])
                        got = cpu(deq[j, : rc[j]])
                        want = rt[start : start + rc[j]].float()
                        err = (got - want).abs().max().item() if rc[j] else 0.0
                        self.assertLessEqual(err, want.abs().max().item() / 8 + 1e-6)
                    y = deq.to(torch.bfloat16)
                # Identity experts: out[t] = sum over k of w[t, k] * row.
                if two_phase:
                    group.ll_combine_send(b, y)
                    out = group.ll_combine_wait(b)
                else:
                    out = group.ll_combine(b, y)
                if cast is None:
                    x_c, idx_c, w_c = all_in[r]
                    acc = torch.zeros(x_c.shape[0], H)
                    for k in range(idx_c.shape[1]):
                        m = (idx_c[:, k] >= 0).float().unsqueeze(1)
                        acc = acc + m * w_c[:, k : k + 1] * x_c.float()
                    self.assertTrue(torch.equal(cpu(out), acc.to(torch.bfloat16)))
            else:
                # Rank-major: row s * M + t is token t of rank s.
                toks = cpu(b.tokens)
                for s in range(world):
                    xs, idx_s, _ = all_in[s]
                    sent = (((idx_s >= el * r) & (idx_s < el * (r + 1))).any(1)).nonzero().flatten()
                    for t in sent.tolist():
                        self.assertTrue(torch.equal(toks[s, t], xs[t]))
                # Experts: each row times the sum of its local weights
                # (rounded to bf16 here, as an expert would write it).
                wsum = b.topk_weights.sum(-1, keepdim=True)
                y = (b.tokens.float() * wsum).to(torch.bfloat16)
                y_cpu = cpu(y)
                out = group.ll_combine(b, y)
                acc = torch.zeros(all_in[r][0].shape[0], H)
                for d in range(world):
                    # Rank d's row for token t of this rank.
                    idx_r = all_in[r][1]
                    for t in range(idx_r.shape[0]):
                        if ((idx_r[t] >= el * d) & (idx_r[t] < el * (d + 1))).any():
                            wsum_d = sum(
                                float(all_in[r][2][t, k])
                                for k in range(idx_r.shape[1])
                                if el * d <= int(idx_r[t, k]) < el * (d + 1)
                            )
                            acc[t] += (all_in[r][0][t].float() * wsum_d).to(torch.bfloat16).float()
                self.assertTrue(torch.equal(cpu(out), acc.to(torch.bfloat16)))
                del y_cpu
            self.assertEqual(b.state, "combined")
            group.check()
            return True

        run_world(world, rank)

    def test_low_latency_round_trips(self):
        for world in WORLDS:
            for layout, two_phase, cast in (
                ("expert_major", False, None),
                ("expert_major", True, None),
                ("expert_major", False, "exact"),
                ("rank_major", False, None),
            ):
                with self.subTest(world=world, layout=layout, two_phase=two_phase, cast=cast):
                    self.ll_round_trip(world, layout, two_phase, cast)

    def test_low_latency_graph_capture_and_replay(self):
        for world in [w for w in WORLDS if w <= 2]:
            with self.subTest(world=world):
                barrier = threading.Barrier(world)

                def rank(comm):
                    r = comm.rank
                    el = 2
                    group = moe_ep.Group(
                        comm, num_experts=el * world, hidden=H, max_tokens_per_rank=M, mode="low_latency"
                    )
                    x, idx, w = (t.cuda() for t in inputs(r, world, seed=30, experts_per_rank=el))
                    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16, device="cuda")
                    b = group.ll_dispatch(x, idx, w)
                    group.ll_combine(b, b.tokens, out=out)
                    group.check()
                    group.allow_graph_capture()
                    g = torch.cuda.CUDAGraph()
                    torch.cuda.synchronize()
                    barrier.wait()
                    g.capture_begin(capture_error_mode="thread_local")
                    b = group.ll_dispatch(x, idx, w)
                    group.ll_combine(b, b.tokens, out=out)
                    g.capture_end()
                    barrier.wait()
                    for replay in range(2):
                        nx, nidx, nw = inputs(r, world, seed=31 + replay, experts_per_rank=el)
                        x.copy_(nx)
                        idx.copy_(nidx)
                        w.copy_(nw)
                        g.replay()
                        acc = torch.zeros(nx.shape[0], H)
                        for k in range(nidx.shape[1]):
                            m = (nidx[:, k] >= 0).float().unsqueeze(1)
                            acc = acc + m * nw[:, k : k + 1] * nx.float()
                        self.assertTrue(torch.equal(cpu(out), acc.to(torch.bfloat16)), f"replay {replay}")
                    group.check()
                    barrier.wait()
                    del g
                    return True

                run_world(world, rank)


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
class Streams(unittest.TestCase):
    def test_an_op_on_another_stream_waits_for_its_inputs(self):
        """x is written on torch's current stream behind a long kernel; the
        layout and dispatch run on another stream (``stream=``), so the
        export must order that stream after the current one (an op on the
        current stream itself needs nothing: its tensors are exported
        without a stream). The rows received are x's, not the zeros x
        held before."""
        for world in WORLDS:
            with self.subTest(world=world):

                def rank(comm):
                    r = comm.rank
                    group = ht_group(comm, world, 4, "rank_major")
                    all_in = [inputs(s, world, seed=5) for s in range(world)]
                    x_dev, idx, w = (t.cuda() for t in all_in[r])
                    x = torch.zeros_like(x_dev)
                    side = torch.cuda.Stream()
                    torch.cuda.current_stream().synchronize()
                    torch.cuda._sleep(20_000_000)  # ~10 ms of this stream
                    x.copy_(x_dev)
                    h = group.layout(idx, stream=side)
                    d = group.dispatch(h, x, w, stream=side)
                    rows = h.host_counts(stream=side)["recv_rows"]
                    rt = ref_dispatch(all_in, r, 4, "rank_major")[0]
                    if rt is not None:
                        self.assertTrue(torch.equal(cpu(d.tokens[:rows]), rt), f"rank {r}")
                    group.check()
                    return rows

                run_world(world, rank)


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
class HostTimeout(unittest.TestCase):
    def test_the_host_collectives_bound(self):
        """NCCL ranks: 600 s by default, settable (then a group is made, its
        all-gather waited for under the bound); virtual ranks: the world's
        own, refused naming `timeout`; zero refused everywhere."""
        for world in WORLDS:
            with self.subTest(world=world):

                def rank(comm):
                    with self.assertRaises(moe_ep.InvalidArgument):
                        comm.set_host_timeout(0.0)
                    if comm.is_virtual:
                        with self.assertRaises(moe_ep.InvalidArgument) as cm:
                            comm.set_host_timeout(5.0)
                        self.assertEqual(cm.exception.arg, "timeout")
                        return comm.host_timeout
                    self.assertEqual(comm.host_timeout, 600.0)
                    comm.set_host_timeout(30.0)
                    self.assertEqual(comm.host_timeout, 30.0)
                    ht_group(comm, world, 4, "rank_major").check()
                    return comm.host_timeout

                run_world(world, rank)


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
class Autograd(unittest.TestCase):
    def test_moe_layer_gradients_match_the_dense_layer(self):
        sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
        import moe_layer

        for world in WORLDS:
            for layout in ("expert_major", "rank_major"):
                with self.subTest(world=world, layout=layout):
                    report = moe_layer.check(world, layout=layout)
                    for name, (err, tol) in report.items():
                        self.assertLessEqual(err, tol, f"{name} at world {world}")


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
@unittest.skipUnless(1 in WORLDS, "world 1 only (MOE_EP_PY_WORLDS lacks 1)")
class ProcessGroup(unittest.TestCase):
    def test_group_from_a_torch_process_group(self):
        import torch.distributed as dist

        with tempfile.NamedTemporaryFile() as f:
            dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
            try:
                group = moe_ep.from_process_group(num_experts=8, hidden=H, max_tokens_per_rank=M)
                self.assertEqual((group.rank, group.world), (0, 1))
                x, idx, w = (t.cuda() for t in inputs(0, 1, experts_per_rank=8))
                h = group.layout(idx)
                d = group.dispatch(h, x, w)
                out = group.combine(h, d.tokens)
                all_in = [inputs(0, 1, experts_per_rank=8)]
                ref = ref_combine(all_in, 0, 8, "rank_major", lambda dd: ref_dispatch(all_in, dd, 8, "rank_major")[0], False)
                self.assertTrue(torch.equal(cpu(out), ref))
                group.check()
            finally:
                dist.destroy_process_group()


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
@unittest.skipUnless(1 in WORLDS, "world 1 only (MOE_EP_PY_WORLDS lacks 1)")
class Refusals(unittest.TestCase):
    def test_bad_arguments_name_the_argument(self):
        comm = moe_ep.Communicator.init(0, moe_ep.unique_id(), 0, 1)
        group = moe_ep.Group(comm, num_experts=8, hidden=H, max_tokens_per_rank=M)
        x, idx, w = (t.cuda() for t in inputs(0, 1, experts_per_rank=8))
        h = group.layout(idx)
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            group.dispatch(h, x.cpu(), w)
        self.assertEqual(cm.exception.arg, "x")
        with self.assertRaises(TypeError):
            group.dispatch(h, x.float(), w)
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            group.dispatch(h, x[:, :128], w)
        self.assertIn("C-contiguous", str(cm.exception))
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            group.dispatch(h, x[:-1], w)
        self.assertEqual(cm.exception.arg, "x")
        with self.assertRaises(moe_ep.NotSymmetric):
            plain = torch.empty((group.recv_capacity, H), dtype=torch.bfloat16, device="cuda")
            group.dispatch(h, x, w, out=(plain, None))
        # Each refusal above counts as the call it refused, published to
        # the peers (here none): every rank refused the same calls, so
        # nothing is out of step and check returns normally (a rank whose
        # peers did not refuse gets InvalidState there: OneRankRefusal).
        group.check()
        # A tensor that requires grad is read, not differentiated.
        h = group.layout(idx)
        d = group.dispatch(h, x.clone().requires_grad_(), w)
        group.combine(h, d.tokens)
        group.check()


@unittest.skipUnless(HAVE_GPU, "needs torch with CUDA and a GPU")
class OneRankRefusal(unittest.TestCase):
    def test_a_refusal_on_one_rank_reaches_every_rank_at_once(self):
        """The binding's own dtype check refuses ``x`` (float32) on the last
        rank only, in dispatch and then in the low-latency dispatch: every
        other rank's op stops at once, and ``check`` names that rank and
        ``x`` there (``PeerFailed``) in well under the group's 10 s timeout;
        then a round trip on the same group matches the CPU reference."""
        el = 4
        worlds = [w for w in WORLDS if w > 1]
        if not worlds:
            self.skipTest("needs a world of two ranks or more (MOE_EP_PY_WORLDS)")
        for world in worlds:
            with self.subTest(world=world):

                def rank(comm):
                    r, bad = comm.rank, comm.rank == world - 1
                    all_in = [inputs(s, world, seed=30, experts_per_rank=el) for s in range(world)]
                    x, idx, w = (t.cuda() for t in all_in[r])
                    took = []
                    for mode in ("high_throughput", "low_latency"):
                        group = moe_ep.Group(
                            comm,
                            num_experts=el * world,
                            hidden=H,
                            max_tokens_per_rank=M,
                            mode=mode,
                            timeout=10.0,
                        )
                        ll = mode == "low_latency"
                        h = None if ll else group.layout(idx)
                        torch.cuda.current_stream().synchronize()
                        t0 = time.monotonic()
                        op = group.ll_dispatch if ll else (lambda a, b, c: group.dispatch(h, a, c))
                        if bad:
                            with self.assertRaises(moe_ep.InvalidArgumentType) as cm:
                                op(x.float(), idx, w)
                            self.assertEqual(cm.exception.arg, "x")
                            with self.assertRaises(moe_ep.InvalidState) as cm:
                                group.check()
                            self.assertIn("refused", str(cm.exception))
                        else:
                            op(x, idx, w)
                            with self.assertRaises(moe_ep.PeerFailed) as cm:
                                group.check()
                            self.assertEqual(cm.exception.peer, world - 1, str(cm.exception))
                            self.assertEqual(cm.exception.arg, "x", str(cm.exception))
                        took.append(time.monotonic() - t0)
                        self.assertLess(took[-1], 2.0, f"{mode} on rank {r}")
                        # The same group works: a round trip, checked.
                        if ll:
                            b = group.ll_dispatch(x, idx, w, layout="rank_major")
                            wsum = b.topk_weights.sum(-1, keepdim=True)
                            out = group.ll_combine(b, (b.tokens.float() * wsum).to(torch.bfloat16))
                            group.check()
                            self.assertEqual(tuple(out.shape), tuple(x.shape))
                        else:
                            h = group.layout(idx)
                            d = group.dispatch(h, x, w)
                            out = group.combine(h, d.tokens)

                            def y_of(dst):
                                return ref_dispatch(all_in, dst, el, "rank_major")[0]

                            ref = ref_combine(all_in, r, el, "rank_major", y_of, False)
                            group.check()
                            self.assertTrue(torch.equal(cpu(out), ref), f"round trip on rank {r}")
                    return took

                run_world(world, rank)


if __name__ == "__main__":
    unittest.main()
