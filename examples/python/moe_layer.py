"""A small MoE layer over moe_ep, trained one step with ``loss.backward()``,
checked against a dense computation of the same layer on one GPU.

The layer: a router (``x @ Wr``, softmax, top-k, weights renormalised), the
layout, ``moe_ep.torch.dispatch``, per local expert a two-matmul MLP
(``silu(x @ W1) @ W2``, bfloat16), ``moe_ep.torch.combine``. Expert-major
receives one row per (token, expert) in per-expert blocks and combine weights
them; rank-major receives one row per token and this rank weights and sums
its experts' outputs before combine.

    python3 examples/python/moe_layer.py                 # virtual world 4 on GPU 0
    python3 examples/python/moe_layer.py --world 1       # NCCL world 1
    python3 examples/python/moe_layer.py --world 8 --layout rank_major

Each rank holds its own tokens and a copy of the router, and the experts
``[rank * El, (rank + 1) * El)``. The dense reference runs every rank's
tokens through all experts on one GPU with the same parameters; outputs and
gradients (of x, of the router, of every expert's weights) must agree within
bfloat16's rounding (the check prints the worst relative error of each).
"""

import argparse
import os
import sys

# Virtual ranks need every kernel loaded when CUDA starts (moe_ep.run_virtual
# says why): before the first CUDA call, unless the caller chose.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402
import torch.nn.functional as F

import moe_ep  # noqa: E402
import moe_ep.torch as ep_torch  # noqa: E402

H, FF, K, EL, T = 256, 512, 4, 4, 96  # hidden, expert width, top-k, experts per rank, tokens
ALIGN = 8  # expert-major: each expert's block of rows padded to a multiple of this


def params(world, seed=0):
    """The layer's parameters (on the GPU, f32 router, bf16 experts)."""
    g = torch.Generator().manual_seed(seed)
    e = EL * world
    wr = torch.randn(H, e, generator=g) / H**0.5
    w1 = (torch.randn(e, H, FF, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, FF, H, generator=g) / FF**0.5).to(torch.bfloat16)
    return wr.cuda(), w1.cuda(), w2.cuda()


def tokens(rank, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T - 7 * rank % T, H, generator=g).to(torch.bfloat16)
    dy = torch.randn(x.shape[0], H, generator=g)
    return x.cuda(), dy.cuda()


def route(x, wr):
    """Top-k experts and their renormalised weights (f32)."""
    probs = torch.softmax(x.float() @ wr, dim=-1)
    w, idx = torch.topk(probs, K, dim=-1)
    return idx, w / w.sum(-1, keepdim=True)


def expert(x, w1, w2):
    return F.silu(x @ w1) @ w2


def moe_forward(group, x, wr, w1, w2, layout):
    """The expert-parallel layer on this rank: `w1`, `w2` are this rank's
    experts ``[EL, ...]``. Returns ``[T, H]`` bfloat16."""
    idx, w = route(x, wr)
    align = ALIGN if layout == "expert_major" else 1
    h = group.layout(idx, layout=layout, alignment=align)
    recv_x, recv_w, recv_idx, _ = ep_torch.dispatch(group, h, x, w)
    counts = h.host_counts()  # one host synchronisation per layout
    rows, cap = counts["recv_rows"], group.recv_capacity
    if layout == "expert_major":
        pieces, start = [], 0
        for j, n in enumerate(counts["tokens_per_local_expert"]):
            padded = -(-n // align) * align
            pieces.append(expert(recv_x[start : start + n], w1[j], w2[j]))
            if padded > n:
                pieces.append(recv_x.new_zeros(padded - n, H))
            start += padded
        pieces.append(recv_x.new_zeros(cap - rows, H))
        y = torch.cat(pieces)
        # Combine weights each row by its received top-k weight.
        return ep_torch.combine(group, h, y, recv_w)
    # Rank-major: a row per token; weight and sum this rank's experts here.
    xr, idx_r, w_r = recv_x[:rows], recv_idx[:rows], recv_w[:rows]
    acc = torch.zeros(rows, H, device=x.device, dtype=torch.float32)
    for j in range(EL):
        wj = (w_r * (idx_r == j)).sum(-1)
        sel = (idx_r == j).any(-1).nonzero().flatten()
        if sel.numel():
            acc = acc.index_add(0, sel, expert(xr[sel], w1[j], w2[j]).float() * wj[sel].unsqueeze(1))
    y = torch.cat([acc.to(torch.bfloat16), recv_x.new_zeros(cap - rows, H)])
    return ep_torch.combine(group, h, y)


def dense_forward(x, wr, w1, w2):
    """The same layer on one GPU, every expert local."""
    idx, w = route(x, wr)
    out = torch.zeros(x.shape[0], H, device=x.device, dtype=torch.float32)
    for e in range(w1.shape[0]):
        t, k = (idx == e).nonzero(as_tuple=True)
        if t.numel():
            out = out.index_add(0, t, expert(x[t], w1[e], w2[e]).float() * w[t, k].unsqueeze(1))
    return out.to(torch.bfloat16)


def rank_step(comm, world, layout):
    """One forward and backward of the layer on this rank; returns what the
    check compares."""
    r = comm.rank
    # Receive rows: the default (every token of every rank) is rank-major's
    # worst case; expert-major receives a row per (token, local expert),
    # each expert's block padded to the alignment.
    if layout == "expert_major":
        cap = world * T * min(K, EL) + EL * (ALIGN - 1)
    else:
        cap = world * T
    group = moe_ep.Group(comm, num_experts=EL * world, hidden=H, max_tokens_per_rank=T, recv_capacity=cap)
    wr, w1, w2 = params(world)
    wr = wr.clone().requires_grad_()
    w1 = w1[r * EL : (r + 1) * EL].clone().requires_grad_()
    w2 = w2[r * EL : (r + 1) * EL].clone().requires_grad_()
    x, dy = tokens(r)
    x = x.clone().requires_grad_()
    out = moe_forward(group, x, wr, w1, w2, layout)
    (out.float() * dy).sum().backward()
    group.check()
    torch.cuda.current_stream().synchronize()
    return [t.detach().cpu() for t in (out, x.grad, wr.grad, w1.grad, w2.grad)]


def run(world, layout):
    if world == 1:
        comm = moe_ep.Communicator.init(torch.cuda.current_device(), moe_ep.unique_id(), 0, 1)
        with torch.cuda.stream(torch.cuda.Stream()):
            return [rank_step(comm, 1, layout)]
    return moe_ep.run_virtual(world, lambda comm: rank_step(comm, world, layout))


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def check(world, layout="expert_major"):
    """Runs the layer at `world` and the dense reference; returns
    ``{name: (worst relative error, tolerance)}``."""
    ranks = run(world, layout)
    wr, w1, w2 = params(world)
    wr, w1, w2 = (t.clone().requires_grad_() for t in (wr, w1, w2))
    report = {"out": 0.0, "grad x": 0.0, "grad router": 0.0}
    for r in range(world):
        x, dy = tokens(r)
        x = x.clone().requires_grad_()
        wr_r = wr.detach().clone().requires_grad_()  # each rank's router copy
        out = dense_forward(x, wr_r, w1, w2)
        (out.float() * dy).sum().backward()
        got = ranks[r]
        report["out"] = max(report["out"], rel(got[0], out.detach().cpu()))
        report["grad x"] = max(report["grad x"], rel(got[1], x.grad.cpu()))
        report["grad router"] = max(report["grad router"], rel(got[2], wr_r.grad.cpu()))
    g1 = torch.cat([ranks[r][3] for r in range(world)])
    g2 = torch.cat([ranks[r][4] for r in range(world)])
    report["grad W1"] = rel(g1, w1.grad.cpu())
    report["grad W2"] = rel(g2, w2.grad.cpu())
    # bfloat16 keeps 8 bits: a few roundings of difference in sums over
    # experts and ranks (the router's gradient passes through the softmax
    # and the renormalisation: looser).
    tol = {"out": 0.03, "grad x": 0.05, "grad router": 0.08, "grad W1": 0.05, "grad W2": 0.05}
    return {k: (v, tol[k]) for k, v in report.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4, help="1: NCCL; more: virtual ranks on one GPU")
    ap.add_argument("--layout", choices=["expert_major", "rank_major", "both"], default="both")
    a = ap.parse_args()
    layouts = ["expert_major", "rank_major"] if a.layout == "both" else [a.layout]
    ok = True
    for layout in layouts:
        report = check(a.world, layout)
        kind = "NCCL" if a.world == 1 else "virtual"
        line = ", ".join(f"{k} {v:.4f} (<= {t})" for k, (v, t) in report.items())
        good = all(v <= t for v, t in report.values())
        ok &= good
        print(f"world {a.world} ({kind}), {layout}: {'OK' if good else 'MISMATCH'}: {line}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
