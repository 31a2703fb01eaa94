"""Autograd for moe_ep's ops: ``dispatch`` and ``combine`` as
``torch.autograd.Function``s whose backward passes call moe-ep's backward
ops, so that a MoE layer trains with ``loss.backward()``.

    recv_x, recv_w, _, _ = moe_ep.torch.dispatch(group, handle, x, topk_weights)
    y = experts(recv_x, recv_w)                 # [recv_capacity, H] bfloat16
    out = moe_ep.torch.combine(group, handle, y)

- ``dispatch``: the gradient of the received tokens is combined home
  (``dispatch_backward``), that of the received weights routed back to
  ``[T, K]``.
- ``combine``: the gradient of the output is dispatched back
  (``combine_backward``); with ``weights`` (expert-major), each row's
  gradient is scaled by its weight, and the weights' gradient is the dot
  product of each row with its gradient (computed here in f32, from the
  unweighted backward).

Every rank must run the same forward and backward ops in the same order (the
ops are collective); ``loss.backward()`` on every rank does.
"""

import torch as _torch

from . import _api


class _Dispatch(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, group, handle, stream):
        d = group.dispatch(handle, x.detach(), topk_weights.detach(), stream=stream)
        ctx.group, ctx.handle, ctx.stream = group, handle, stream
        ctx.shapes = (tuple(d.tokens.shape), tuple(d.topk_weights.shape))
        ctx.mark_non_differentiable(d.topk_idx, d.src)
        return d.tokens, d.topk_weights, d.topk_idx, d.src

    @staticmethod
    def backward(ctx, g_tokens, g_weights, _g_idx, _g_src):
        group, handle = ctx.group, ctx.handle
        dev = _torch.device("cuda", group.device)
        if g_tokens is None:
            g_tokens = _torch.zeros(ctx.shapes[0], dtype=_torch.bfloat16, device=dev)
        gw = None
        if ctx.needs_input_grad[1]:
            gw = g_weights
            if gw is None:
                gw = _torch.zeros(ctx.shapes[1], dtype=_torch.float32, device=dev)
            gw = gw.contiguous()
        gx, gtw = group.dispatch_backward(handle, g_tokens.contiguous(), gw, stream=ctx.stream)
        return (gx if ctx.needs_input_grad[0] else None), gtw, None, None, None


class _Combine(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, group, handle, stream):
        w = None if weights is None else weights.detach()
        out = group.combine(handle, expert_out.detach(), weights=w, stream=stream)
        ctx.group, ctx.handle, ctx.stream = group, handle, stream
        ctx.weighted = weights is not None
        if weights is not None:
            ctx.save_for_backward(expert_out, weights)
        return out

    @staticmethod
    def backward(ctx, g_out):
        group, handle = ctx.group, ctx.handle
        g_out = g_out.contiguous()
        if not ctx.weighted:
            g = group.combine_backward(handle, g_out, stream=ctx.stream)
            return g, None, None, None, None
        y, w = ctx.saved_tensors
        # The unweighted backward gives each row its token's gradient; the
        # row's own weight scales it, and the weight's gradient is their dot
        # product.
        g = group.combine_backward(handle, g_out, stream=ctx.stream)
        gf = g.float()
        gy = (gf * w.detach().unsqueeze(1)).to(_torch.bfloat16) if ctx.needs_input_grad[0] else None
        gw = (gf * y.detach().float()).sum(1) if ctx.needs_input_grad[1] else None
        return gy, gw, None, None, None


def dispatch(group, handle, x, topk_weights, *, stream=None):
    """``Group.dispatch`` with autograd: returns ``(tokens, topk_weights,
    topk_idx, src)`` (``[recv_capacity, ...]``, aliasing the group's pool);
    gradients flow to ``x`` and ``topk_weights``."""
    return _Dispatch.apply(x, topk_weights, group, handle, stream)


def combine(group, handle, expert_out, weights=None, *, stream=None):
    """``Group.combine`` with autograd: ``expert_out`` ``[recv_capacity, H]``
    bfloat16 (expert-major rows scaled by ``weights`` ``[recv_capacity]``
    float32 where given) summed home into a new ``[T, H]`` tensor; gradients
    flow to ``expert_out`` and ``weights``."""
    return _Combine.apply(expert_out, weights, group, handle, stream)


__all__ = ["dispatch", "combine"]
