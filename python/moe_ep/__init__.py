"""moe_ep: expert-parallel dispatch and combine for Mixture-of-Experts models,
from PyTorch.

    import moe_ep
    group = moe_ep.from_process_group(num_experts=64, hidden=4096,
                                      max_tokens_per_rank=4096)
    handle = group.layout(topk_idx)                        # [T, K] int64
    recv = group.dispatch(handle, x, topk_weights)         # zero copy
    ...  # experts on recv.tokens, writing their outputs y [recv_capacity, H]
    out = group.combine(handle, y)                         # [T, H] bfloat16

Torch tensors go in and come out without a copy (DLPack); every op runs on
torch's current stream (or ``stream=``); ``moe_ep.torch`` has the autograd
functions. torch is not needed to import the package. See docs/python.md.
"""

from . import errors
from ._api import (
    Communicator,
    DeviceArray,
    Dispatched,
    DispatchedFp8,
    Group,
    Handle,
    LlBatch,
    device_count,
    from_process_group,
    run_virtual,
    unique_id,
    virtual_world,
)
from ._moe_ep import NCCL_HEADERS_VERSION, __version__
from .errors import *  # noqa: F401,F403 - the exception classes


def symm_empty(shape, dtype, *, group, stream=None):
    """An uninitialised tensor in ``group``'s symmetric pool (collective:
    every rank allocates the same sizes in the same order); see
    ``Group.symm_empty``."""
    return group.symm_empty(shape, dtype, stream=stream)


__all__ = [
    "Communicator",
    "DeviceArray",
    "Dispatched",
    "DispatchedFp8",
    "Group",
    "Handle",
    "LlBatch",
    "NCCL_HEADERS_VERSION",
    "__version__",
    "device_count",
    "errors",
    "from_process_group",
    "run_virtual",
    "symm_empty",
    "unique_id",
    "virtual_world",
] + errors.__all__
