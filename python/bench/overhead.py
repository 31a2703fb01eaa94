"""What a call through Python costs over the same Rust op, in one run.

At NCCL world 1 on GPU 0, each op is called `--iters` times in a loop from
Python (``moe_ep.Group``, torch tensors in and out) and from Rust
(``moe_ep._moe_ep._rust_loop``: the same op on the same arrays and stream,
no Python in the loop). Reported per call: host time (the loop's wall time
over the calls, enqueue only) and time until the stream drained; the
overhead is Python's host time less Rust's.

    python3 python/bench/overhead.py [--iters 200] [--json out.json] [--profile 15]

With ``--profile N`` each Python loop is run once more under cProfile after
its measurement, and the N functions with the most own time are printed
(where the Python side spends its overhead).
"""

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import moe_ep
from moe_ep import _moe_ep as core


def py_loop(fn, iters):
    s = torch.cuda.current_stream()
    s.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t0
    s.synchronize()
    total = time.perf_counter() - t0
    return host / iters, total / iters


PROFILE_TOP = 0


def profile(name, fn, iters):
    """`fn` called `iters` times under cProfile; prints the PROFILE_TOP
    functions with the most own time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.current_stream().synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(PROFILE_TOP)
    print(f"---- profile of {name}, {iters} calls ----")
    print(buf.getvalue().strip())


def measure(name, py_fn, rust_fn, iters, warmup=10):
    py_loop(py_fn, warmup)
    rust_fn(warmup)
    rows = []
    for _ in range(3):  # interleaved, best of three each
        rows.append((py_loop(py_fn, iters), rust_fn(iters)))
    (ph, pt), (rh, rt) = min(r[0] for r in rows), min(r[1] for r in rows)
    if PROFILE_TOP:
        profile(name, py_fn, iters)
    return {
        "op": name,
        "python_host_us": ph * 1e6,
        "rust_host_us": rh * 1e6,
        "overhead_host_us": (ph - rh) * 1e6,
        "python_total_us": pt * 1e6,
        "rust_total_us": rt * 1e6,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ll-tokens", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    a = ap.parse_args()
    global PROFILE_TOP
    PROFILE_TOP = a.profile
    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    s = stream.cuda_stream
    results = []
    g = torch.Generator(device="cuda").manual_seed(0)

    def routing(t):
        scores = torch.rand(t, a.experts, device="cuda", generator=g)
        idx = scores.topk(a.topk, dim=-1).indices.to(torch.int64).contiguous()
        w = torch.rand(t, a.topk, device="cuda", generator=g)
        x = torch.randn(t, a.hidden, device="cuda", generator=g).to(torch.bfloat16)
        return x, idx, w

    comm = moe_ep.Communicator.init(0, moe_ep.unique_id(), 0, 1)
    group = moe_ep.Group(comm, num_experts=a.experts, hidden=a.hidden, max_tokens_per_rank=a.tokens)
    x, idx, w = routing(a.tokens)
    h = group.layout(idx)
    d = group.dispatch(h, x, w)
    out = torch.empty_like(x)
    y = d.tokens
    results.append(
        measure(
            "layout",
            lambda: group.layout(idx),
            lambda n: core._rust_loop(group._g, s, "layout", n, [idx], layout="rank_major"),
            a.iters,
        )
    )
    results.append(
        measure(
            "dispatch",
            lambda: group.dispatch(h, x, w),
            lambda n: core._rust_loop(group._g, s, "dispatch", n, [x, w], handle=h._h),
            a.iters,
        )
    )
    results.append(
        measure(
            "combine",
            lambda: group.combine(h, y, out=out),
            lambda n: core._rust_loop(group._g, s, "combine", n, [y, out], handle=h._h),
            a.iters,
        )
    )
    # Where the Rust host time goes: a layout whose handles are all kept
    # until the time is taken (against the loop that drops each), and the
    # pool allocations of a dispatch without its kernel.
    probes = []
    for name, op, arrays in [
        ("layout, handles dropped", "layout", [idx]),
        ("layout, handles kept", "layout_keep", [idx]),
        ("dispatch's 4 pool allocations", "pool", [x, w]),
    ]:
        fn = lambda n, op=op, arrays=arrays: core._rust_loop(
            group._g, s, op, n, arrays, handle=h._h, layout="rank_major"
        )
        fn(10)
        best = min(fn(a.iters) for _ in range(3))
        probes.append({"probe": name, "rust_host_us": best[0] * 1e6, "rust_total_us": best[1] * 1e6})
    group.check()
    del d, y, h, group

    ll = moe_ep.Group(
        comm, num_experts=a.experts, hidden=a.hidden, max_tokens_per_rank=a.ll_tokens, mode="low_latency"
    )
    lx, lidx, lw = routing(a.ll_tokens)
    lout = torch.empty_like(lx)
    rows = a.experts * a.ll_tokens  # expert-major [El, R * M] rows at world 1
    ly = torch.zeros(rows, a.hidden, dtype=torch.bfloat16, device="cuda")

    def ll_py():
        b = ll.ll_dispatch(lx, lidx, lw)
        ll.ll_combine(b, ly, out=lout)

    results.append(
        measure(
            "ll_dispatch+ll_combine",
            ll_py,
            lambda n: core._rust_loop(ll._g, s, "ll", n, [lx, lidx, lw, ly, lout]),
            a.iters,
        )
    )
    ll.check()
    print(f"{torch.cuda.get_device_name(0)}, NCCL world 1, {a.tokens} tokens (low-latency {a.ll_tokens}), "
          f"hidden {a.hidden}, top-{a.topk} of {a.experts}, {a.iters} calls, best of 3")
    print(f"{'op':<24}{'python host':>13}{'rust host':>11}{'overhead':>10}{'python total':>14}{'rust total':>12}  (us per call)")
    for r in results:
        print(f"{r['op']:<24}{r['python_host_us']:>13.1f}{r['rust_host_us']:>11.1f}"
              f"{r['overhead_host_us']:>10.1f}{r['python_total_us']:>14.1f}{r['rust_total_us']:>12.1f}")
    print(f"{'rust probe':<34}{'host':>8}{'total':>8}  (us per call)")
    for p in probes:
        print(f"{p['probe']:<34}{p['rust_host_us']:>8.1f}{p['rust_total_us']:>8.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(0), "args": vars(a), "results": results, "probes": probes},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
