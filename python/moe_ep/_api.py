"""The Python API over the extension module: groups, handles and ops on torch
tensors (or any DLPack / ``__cuda_array_interface__`` array), torch's current
stream, outputs allocated by torch, results as tensors that alias moe-ep's
buffers.

torch is optional: without it every op needs ``stream=`` (an int handle or an
object with ``.cuda_stream``), outputs must be given (``out=``), and results
are ``DeviceArray`` objects (DLPack producers: ``cupy.from_dlpack(a)``).
"""

import contextlib
import os
import threading
import warnings
from typing import NamedTuple, Optional

from . import _moe_ep as _core
from .errors import InvalidArgumentType, MoeEpError

try:  # torch is optional
    import torch as _torch
except ImportError:  # pragma: no cover - exercised by the CPU tests' machine
    _torch = None

Communicator = _core.Communicator
DeviceArray = _core.DeviceArray

if _torch is not None:
    _raw_stream = getattr(_torch._C, "_cuda_getCurrentRawStream", None)
    if _raw_stream is None:  # pragma: no cover - older torch

        def _raw_stream(device):
            return _torch.cuda.current_stream(device).cuda_stream

    _from_capsule = getattr(_torch._C, "_from_dlpack", None) or _torch.utils.dlpack.from_dlpack
    _DTYPES = {
        "bfloat16": _torch.bfloat16,
        "float32": _torch.float32,
        "int32": _torch.int32,
        "int64": _torch.int64,
        "uint8": _torch.uint8,
        "float8_e4m3fn": getattr(_torch, "float8_e4m3fn", None),
    }


def _no_torch(arg, what):
    return InvalidArgumentType(
        f"invalid argument `{arg}`: expected {what} (torch is not importable), got None"
    )


def _stream(stream, device):
    """The raw handle of the op's stream: torch's current stream of `device`
    unless `stream` names one."""
    if stream is None:
        if _torch is None:
            raise _no_torch("stream", "a CUDA stream (an int handle or an object with .cuda_stream)")
        return _raw_stream(device)
    if isinstance(stream, int):
        return stream
    s = getattr(stream, "cuda_stream", None)
    if isinstance(s, int):
        return s
    raise InvalidArgumentType(
        "invalid argument `stream`: expected a CUDA stream (an int handle or an object "
        f"with .cuda_stream), got {type(stream).__name__}"
    )


def _consumer(stream, s, device):
    """The stream that will use the results: the op's own where it ran on
    torch's current stream, else torch's current stream (ordered after the
    op by the export)."""
    if stream is None or _torch is None:
        return s
    return _raw_stream(device)


def _tensor(arr, consumer):
    """A DeviceArray as a torch tensor aliasing it (zero copy), ordered for
    `consumer`; the DeviceArray itself without torch."""
    if arr is None or _torch is None:
        return arr
    t = _from_capsule(arr.__dlpack__(stream=consumer))
    return t


def _u8(t):
    """A torch float8_e4m3fn tensor as its uint8 codes (the same memory), for
    exporters that cannot name fp8 in DLPack; anything else as it is."""
    if t is not None and _torch is not None and isinstance(t, _torch.Tensor):
        f8 = _DTYPES.get("float8_e4m3fn")
        if f8 is not None and t.dtype == f8:
            return t.view(_torch.uint8)
    return t


def _dtype_name(dtype):
    if isinstance(dtype, str):
        return dtype
    return str(dtype).rsplit(".", 1)[-1]


class Dispatched(NamedTuple):
    """What ``Group.dispatch`` returns: the received rows (``[rows, H]``
    bfloat16 in the handle's layout), their top-k weights (rank-major
    ``[rows, K]``, expert-major ``[rows]`` float32), local expert ids (same
    shape, int32, -1 = not here or padding), sources (``[rows, 2]`` int32:
    source rank, source token) and, expert-major, the unpadded rows per local
    expert (``[experts_per_rank]`` int32, on the device). ``rows`` is the
    group's ``recv_capacity``; rows past the handle's ``recv_rows()`` are not
    written."""

    tokens: object
    topk_weights: object
    topk_idx: object
    src: object
    tokens_per_expert: object


class DispatchedFp8(NamedTuple):
    """What ``Group.dispatch_fp8`` returns: the received e4m3 codes
    (``[rows, H]`` uint8 in the handle's layout; ``.view(torch.float8_e4m3fn)``
    for torch's fp8 type), their scales beside them (row ``i``'s scales in
    row ``i``: ``[rows, H / 32]`` uint8 e8m0, or ``[rows, H / 128]`` float32,
    the kind sent), then as ``Dispatched``: top-k weights, local expert ids,
    sources and, expert-major, the unpadded rows per local expert."""

    codes: object
    scales: object
    topk_weights: object
    topk_idx: object
    src: object
    tokens_per_expert: object


class Handle:
    """The routing of one batch (``Group.layout``): the dispatch, the combine
    and both backward passes of the same group take it."""

    __slots__ = ("_h", "group")

    def __init__(self, group, h):
        self._h = h
        self.group = group

    num_tokens = property(lambda self: self._h.num_tokens, doc="This rank's tokens T.")
    topk = property(lambda self: self._h.topk, doc="Experts per token K.")
    layout = property(lambda self: self._h.layout, doc='"rank_major" or "expert_major".')
    alignment = property(lambda self: self._h.alignment, doc="Expert-major block alignment.")

    @property
    def tokens_per_expert(self):
        """Unpadded rows per local expert, ``[experts_per_rank]`` int32 on the
        device (no host synchronisation)."""
        return _tensor(self._h.tokens_per_local_expert(), None)

    def host_counts(self, stream=None):
        """The counts on the host (synchronises the stream), a dict:
        ``recv_rows`` (here), ``max_recv_rows`` (the most any rank receives:
        after this call, on one node, the ``out=`` buffers of the handle's
        ops need hold only that many rows, not ``recv_capacity``: eager
        sizing), ``dropped_rows`` (per receiving rank; the drop policy's,
        else zeros), ``recv_tokens``, ``tokens_per_local_expert``,
        ``rank_counts``, ``expert_counts``."""
        return self._h.host_counts(_stream(stream, self.group.device))

    def dropped_slots(self, stream=None):
        """This rank's dropped slots (synchronises the stream): ``[T, K]``
        bool on the CPU (a torch tensor; nested lists without torch), true
        where the slot was routed and its row dropped at the receiver
        (``overflow="drop"``)."""
        flat = self._h.dropped_slots(_stream(stream, self.group.device))
        t, k = self.num_tokens, self.topk
        if _torch is not None:
            return _torch.tensor(flat, dtype=_torch.bool).reshape(t, k)
        return [flat[i * k : (i + 1) * k] for i in range(t)]

    def kept_topk_idx(self):
        """The routing the layout kept: ``[T, K]`` int32 on the device, the
        given ``topk_idx`` with -1 for unrouted, bad and dropped slots (no
        host synchronisation; aliases the handle's memory). ``None`` on
        several nodes."""
        arr = self._h.kept_topk_idx()
        return None if arr is None else _tensor(arr, None)

    @property
    def device_bytes(self):
        """Device bytes the handle holds, on top of the group's
        ``memory_footprint()``."""
        return self._h.device_bytes

    def recv_rows(self, stream=None):
        """Rows dispatch delivers here (expert-major: padded); synchronises
        the stream."""
        return self._h.recv_rows(_stream(stream, self.group.device))

    def __repr__(self):
        return repr(self._h)


class LlBatch:
    """One low-latency batch: ``Group.ll_dispatch`` (or ``ll_dispatch_send``
    and ``ll_dispatch_wait``), then ``ll_combine`` (or ``ll_combine_send``
    and ``ll_combine_wait``), each once, in that order. After the dispatch
    its arrays are attributes (tensors aliasing the group's buffer set, valid
    until the set takes its next batch, two batches later): ``tokens``
    (bfloat16 rows) or ``fp8_codes`` (float8_e4m3fn) and ``fp8_scales``
    (float32 per 128 values), ``src``, rank-major ``topk_local_idx`` and
    ``topk_weights``, and the counts ``tokens_per_expert``,
    ``tokens_per_expert_source``, ``tokens_from_rank``. Rows are
    expert-major ``[El, R * M, ...]``, rank-major ``[R, M, ...]``."""

    def __init__(self, group, b, consumer):
        self._b = b
        self.group = group
        self._consumer = consumer
        self._arrays = None

    num_tokens = property(lambda self: self._b.num_tokens)
    topk = property(lambda self: self._b.topk)
    layout = property(lambda self: self._b.layout)
    fp8 = property(lambda self: self._b.fp8)
    buffer_set = property(lambda self: self._b.buffer_set)
    state = property(lambda self: self._b.state)

    def arrays(self):
        """The batch's arrays, by name (see the class)."""
        if self._arrays is None:
            raw = self._b.buffers()
            out = {}
            for name, arr in raw.items():
                t = _tensor(arr, self._consumer)
                if name == "fp8_codes" and _torch is not None and _DTYPES["float8_e4m3fn"]:
                    t = t.view(_DTYPES["float8_e4m3fn"])
                if name == "tokens_per_local_expert":
                    name = "tokens_per_expert"
                out[name] = t
            self._arrays = out
        return self._arrays

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        arrays = self.arrays()
        if name in arrays:
            return arrays[name]
        if name in ("tokens", "fp8_codes", "fp8_scales", "topk_local_idx", "topk_weights"):
            return None
        raise AttributeError(name)

    def __repr__(self):
        return repr(self._b)


class Group:
    """An expert-parallel group over a communicator (``moe_ep::EpGroup``).

    Creating it is collective, and so is every op: every rank calls the same
    ops in the same order. The fields are those of the Rust ``GroupConfig``:
    ``num_experts``, ``hidden``, ``max_tokens_per_rank``, ``mode``
    (``"high_throughput"`` or ``"low_latency"``), ``recv_capacity`` (0: world
    * max tokens, rank-major's worst case; expert-major receives a row per
    token and local expert, each expert's block padded to the alignment:
    give it room for that), ``num_sms`` (``None``: the Rust default, or as
    many as fit where virtual ranks share the GPU), ``combine_chunks``,
    ``timeout`` (seconds),
    ``ranks_per_node`` (0: one node), ``hop_chunk_rows``, ``overflow``
    (``"error"`` or ``"drop"``: rows beyond the receive capacity),
    ``zero_padding`` (``True``: expert-major padding rows are zeroed;
    ``False`` leaves them, for a grouped GEMM that reads per-expert counts).

    Every op runs on torch's current stream of the group's GPU, or on
    ``stream=``; its arrays must be C-contiguous CUDA memory of that GPU, of
    the dtype the op expects, and stay alive (and unwritten by others) until
    the op's work on the stream is done, as torch's own kernels require.
    """

    def __init__(self, comm, *, num_experts, hidden, max_tokens_per_rank, **config):
        self._g = _core.Group(
            comm,
            num_experts=num_experts,
            hidden=hidden,
            max_tokens_per_rank=max_tokens_per_rank,
            **config,
        )
        self.comm = comm
        self.device = self._g.device
        self.hidden = hidden
        self._tdev = _torch.device("cuda", self.device) if _torch is not None else None
        self._pool = None  # mem_pool(), made at its first call

    rank = property(lambda self: self._g.rank)
    world = property(lambda self: self._g.world)
    recv_capacity = property(lambda self: self._g.recv_capacity)
    experts_per_rank = property(lambda self: self._g.experts_per_rank)
    is_two_level = property(lambda self: self._g.is_two_level)
    config = property(lambda self: self._g.config)

    def __repr__(self):
        return repr(self._g)

    # ---- outputs ---------------------------------------------------------

    def _empty(self, arg, shape, dtype):
        if _torch is None:
            raise _no_torch(arg, f"an output array of shape {list(shape)} {dtype}")
        return _torch.empty(shape, dtype=_DTYPES[dtype], device=self._tdev)

    # ---- group -----------------------------------------------------------

    def check(self):
        """Waits for the group's work, then learns what every rank found since
        the last check (collective: call it on every rank at the same point,
        e.g. once per step)."""
        self._g.check()

    def abort(self):
        """Stops every running kernel of the communicator's groups; later ops
        are refused. Any thread, any time."""
        self._g.abort()

    def allow_graph_capture(self):
        """Lets the group's ops run while a stream captures a CUDA graph
        (``torch.cuda.graph``). The caller takes on the contract of
        ``EpGroup::allow_graph_capture``: every tensor and handle a captured
        op was given (the results it returned included), and the group, stay
        alive while the graph may be replayed; every rank replays its graph
        the same number of times, in the same order relative to the group's
        other ops."""
        self._g._allow_graph_capture()

    def symm_empty(self, shape, dtype, *, stream=None):
        """An uninitialised tensor in the group's symmetric pool (collective:
        every rank allocates the same sizes in the same order), for zero-copy
        dispatch (``out=``) and combine inputs that peers read in place. It
        keeps its pool buffer alive."""
        if isinstance(shape, int):
            shape = (shape,)
        s = _stream(stream, self.device)
        arr = self._g.symm_empty(s, list(shape), _dtype_name(dtype))
        t = _tensor(arr, _consumer(stream, s, self.device))
        if _torch is not None and _dtype_name(dtype) == "float8_e4m3fn":
            t = t.view(_DTYPES["float8_e4m3fn"])
        return t

    def memory_footprint(self):
        """The memory this rank of the group holds now, by category, in
        bytes (a dict: ``workspace``, ``low_latency``, ``pool_other``,
        ``pool_free``, ``two_level``, ``pinned_host``, ``device_total``).
        Handles come on top (``Handle.device_bytes``)."""
        return self._g.memory_footprint()

    def is_symm_backed(self, t):
        """True where the tensor's memory lies in symmetric memory of the
        group's communicator."""
        if hasattr(t, "data_ptr") and callable(t.data_ptr):
            return self._g.is_symm_backed(t.data_ptr(), t.numel() * t.element_size())
        return self._g.is_symm_backed(t.data_ptr, t.nbytes)

    def mem_pool(self):
        """A ``torch.cuda.MemPool`` whose allocations come from this group's
        symmetric pool while ``symmetric_allocations`` is active on the
        allocating thread (as TransformerEngine places its buffers in NCCL
        windows). Allocations are collective by contract: every rank must
        make the same ones in the same order. One pool a group, made at the
        first call and kept with the group: torch aborts the process when a
        ``MemPool`` is destroyed while any thread allocates into a pool
        (``use_mem_pool``), so on virtual ranks, where the ranks are threads,
        a pool made and dropped per block would end one rank's block under
        another's. Drop the groups of a virtual world only once every rank
        has left ``symmetric_allocations``."""
        if self._pool is None:
            self._pool = _torch.cuda.MemPool(_pluggable().allocator())
        return self._pool

    @contextlib.contextmanager
    def symmetric_allocations(self, pool=None):
        """Within the block, torch allocations of this thread on the group's
        GPU come from the group's symmetric pool (through ``pool``, the
        group's ``mem_pool()`` when not given). Yields the pool."""
        pool = pool if pool is not None else self.mem_pool()
        # The group's pool takes its first segment in a collective
        # allocation: made here, outside torch's allocator, whose device lock
        # one virtual rank's thread would hold while waiting in it for its
        # siblings, which wait for that lock. Later torch allocations that
        # fit the segment's free bytes (256 MiB less what is taken) are local; on
        # virtual ranks a larger one would need the collective under that
        # lock: keep them within it.
        self.symm_empty((1,), _torch.uint8)
        _core._set_allocation_group(self._g)
        try:
            with _torch.cuda.use_mem_pool(pool, device=self._tdev):
                yield pool
        finally:
            _core._set_allocation_group(None)

    # ---- high-throughput ops ----------------------------------------------

    def layout(self, topk_idx, *, layout="rank_major", alignment=1, stream=None):
        """The routing layout of ``topk_idx`` ``[T, K]`` (int64 or int32, -1 =
        not routed): ``layout`` is ``"rank_major"`` or ``"expert_major"``
        (blocks padded to ``alignment`` rows). Returns a ``Handle``."""
        s = _stream(stream, self.device)
        return Handle(self, self._g.layout(s, topk_idx, layout, alignment))

    def dispatch(self, handle, x, topk_weights, *, out=None, stream=None):
        """Sends every token of ``x`` ``[T, H]`` bfloat16, with its
        ``topk_weights`` ``[T, K]`` float32, to the ranks of its experts,
        writing straight into each receiver's buffers. ``out=(tokens,
        weights)`` (either may be None) receives into the caller's symmetric
        tensors (``symm_empty``); otherwise the group's pool gives them.
        Returns ``Dispatched``, tensors aliasing those buffers (zero copy)."""
        s = _stream(stream, self.device)
        ot, ow = out if out is not None else (None, None)
        tok, w, idx, src = self._g.dispatch(s, handle._h, x, topk_weights, ot, ow)
        c = _consumer(stream, s, self.device)
        counts = None
        if handle.layout == "expert_major":
            counts = _tensor(handle._h.tokens_per_local_expert(), c)
        return Dispatched(
            ot if tok is None else _tensor(tok, c),
            ow if w is None else _tensor(w, c),
            _tensor(idx, c),
            _tensor(src, c),
            counts,
        )

    def dispatch_fp8(self, handle, codes, scales, topk_weights, *, out=None, stream=None):
        """``dispatch`` of fp8 rows: ``codes`` ``[T, H]`` e4m3 (uint8 or
        float8_e4m3fn) and their block ``scales``, ``[T, H / 32]`` uint8
        (MXFP8's e8m0 per 32 values) or ``[T, H / 128]`` float32 (one per 128
        values), forwarded as given, with ``topk_weights`` ``[T, K]`` float32.
        ``H`` must be a multiple of 128; one node only. ``out=(codes, scales,
        weights)`` (any may be None) receives into the caller's symmetric
        tensors; otherwise the group's pool gives them. Returns
        ``DispatchedFp8``, tensors aliasing those buffers (codes uint8)."""
        s = _stream(stream, self.device)
        oc, os_, ow = out if out is not None else (None, None, None)
        rc, rs, w, idx, src = self._g.dispatch_fp8(
            s, handle._h, _u8(codes), scales, topk_weights, _u8(oc), os_, ow
        )
        c = _consumer(stream, s, self.device)
        counts = None
        if handle.layout == "expert_major":
            counts = _tensor(handle._h.tokens_per_local_expert(), c)
        return DispatchedFp8(
            oc if rc is None else _tensor(rc, c),
            os_ if rs is None else _tensor(rs, c),
            ow if w is None else _tensor(w, c),
            _tensor(idx, c),
            _tensor(src, c),
            counts,
        )

    def combine(self, handle, expert_out, *, weights=None, out=None, stream=None):
        """Brings ``expert_out`` ``[recv_capacity, H]`` bfloat16 (in the
        handle's layout; expert-major rows scaled by ``weights``
        ``[recv_capacity]`` float32 where given) home and sums each token's
        rows in f32 in a fixed order, into ``out`` ``[T, H]`` bfloat16
        (allocated where not given). Returns ``out``."""
        s = _stream(stream, self.device)
        if out is None:
            out = self._empty("out", (handle.num_tokens, self.hidden), "bfloat16")
        self._g.combine(s, handle._h, expert_out, out, weights)
        return out

    def combine_backward(self, handle, grad_out, *, weights=None, out=None, stream=None):
        """Backward of combine: ``grad_out`` ``[T, H]`` dispatched into
        ``[recv_capacity, H]`` rows of the handle's layout (padding rows zero;
        scaled by ``weights`` where given). Returns them (``out`` where
        given)."""
        s = _stream(stream, self.device)
        r = self._g.combine_backward(s, handle._h, grad_out, weights, out)
        return out if r is None else _tensor(r, _consumer(stream, s, self.device))

    def dispatch_backward(
        self,
        handle,
        grad_recv_tokens,
        grad_recv_topk_weights=None,
        *,
        grad_x=None,
        grad_topk_weights=None,
        stream=None,
    ):
        """Backward of dispatch: ``grad_recv_tokens`` ``[recv_capacity, H]``
        combined home (unweighted) into ``grad_x`` ``[T, H]``; with
        ``grad_recv_topk_weights`` (as dispatch returned the weights), the
        weights' gradient ``[T, K]`` too. Returns ``(grad_x,
        grad_topk_weights or None)``."""
        s = _stream(stream, self.device)
        t, k = handle.num_tokens, handle.topk
        if grad_x is None:
            grad_x = self._empty("grad_x", (t, self.hidden), "bfloat16")
        if grad_recv_topk_weights is not None and grad_topk_weights is None:
            grad_topk_weights = self._empty("grad_topk_weights", (t, k), "float32")
        self._g.dispatch_backward(
            s,
            handle._h,
            grad_recv_tokens,
            grad_x,
            grad_recv_topk_weights,
            grad_topk_weights if grad_recv_topk_weights is not None else None,
        )
        return grad_x, (grad_topk_weights if grad_recv_topk_weights is not None else None)

    # ---- low-latency ops -----------------------------------------------------

    def _ll_dispatch(self, x, topk_idx, topk_weights, layout, cast_fp8, x_scales, stream, send):
        s = _stream(stream, self.device)
        b = _core.ll_dispatch(
            self._g, s, x, topk_idx, topk_weights, layout, cast_fp8, x_scales, send
        )
        return LlBatch(self, b, _consumer(stream, s, self.device))

    def ll_dispatch(
        self,
        x,
        topk_idx,
        topk_weights,
        *,
        layout="expert_major",
        cast_fp8=None,
        x_scales=None,
        stream=None,
    ):
        """Low-latency dispatch (a group of ``mode="low_latency"``): ``x``
        ``[T, H]`` bfloat16 (``cast_fp8="exact"`` or ``"power_of_two"`` casts
        it to fp8 e4m3 on the sender, one scale per 128 values), or the
        caller's fp8 rows (``x`` float8_e4m3fn ``[T, H]`` with ``x_scales``
        ``[T, H / 128]`` float32); ``topk_idx`` ``[T, K]``, ``topk_weights``
        ``[T, K]`` float32. No layout pass, no host synchronisation, capturable
        in a CUDA graph. Returns an ``LlBatch`` with its arrays."""
        return self._ll_dispatch(x, topk_idx, topk_weights, layout, cast_fp8, x_scales, stream, False)

    def ll_dispatch_send(
        self,
        x,
        topk_idx,
        topk_weights,
        *,
        layout="expert_major",
        cast_fp8=None,
        x_scales=None,
        stream=None,
    ):
        """The first half of ``ll_dispatch`` (returns at once; then
        ``ll_dispatch_wait``)."""
        return self._ll_dispatch(x, topk_idx, topk_weights, layout, cast_fp8, x_scales, stream, True)

    def ll_dispatch_wait(self, batch, *, stream=None):
        """The second half of a sent low-latency dispatch. Returns the batch."""
        s = _stream(stream, self.device)
        _core.ll_dispatch_wait(self._g, s, batch._b)
        batch._consumer = _consumer(stream, s, self.device)
        return batch

    def ll_combine(self, batch, expert_out, *, weights=None, out=None, stream=None):
        """Low-latency combine: the batch's expert outputs (bfloat16 rows in
        the dispatch's layout: expert-major one per (token, expert),
        unweighted; rank-major per token the weighted sum of this rank's
        experts) summed home into ``out`` ``[T, H]`` bfloat16 (expert-major
        weighted by ``weights`` ``[T, K]``, default the dispatch's). Returns
        ``out``."""
        s = _stream(stream, self.device)
        if out is None:
            out = self._empty("out", (batch.num_tokens, self.hidden), "bfloat16")
        _core.ll_combine(self._g, s, batch._b, expert_out, out, weights)
        return out

    def ll_combine_send(self, batch, expert_out, *, stream=None):
        """The first half of ``ll_combine``: the expert outputs sent home
        (``expert_out`` may be reused at once)."""
        s = _stream(stream, self.device)
        _core.ll_combine_send(self._g, s, batch._b, expert_out)

    def ll_combine_wait(self, batch, *, weights=None, out=None, stream=None):
        """The second half of ``ll_combine``. Returns ``out``."""
        s = _stream(stream, self.device)
        if out is None:
            out = self._empty("out", (batch.num_tokens, self.hidden), "bfloat16")
        _core.ll_combine_wait(self._g, s, batch._b, out, weights)
        return out


_PLUGGABLE = None
_PLUGGABLE_LOCK = threading.Lock()


def _pluggable():
    """torch's pluggable allocator over this library's two C functions (one
    per process: torch loads the library once)."""
    global _PLUGGABLE
    with _PLUGGABLE_LOCK:
        if _PLUGGABLE is None:
            if _torch is None:
                raise _no_torch("allocator", "torch for a MemPool")
            _PLUGGABLE = _torch.cuda.memory.CUDAPluggableAllocator(
                _core.__file__, "moe_ep_torch_alloc", "moe_ep_torch_free"
            )
        return _PLUGGABLE


# ---- communicators ---------------------------------------------------------


def unique_id():
    """128 bytes naming a new NCCL world (make it on one rank, give it to
    every rank's ``Communicator.init``)."""
    return bytes(_core.unique_id())


def device_count():
    """CUDA devices visible to this process (``NoDriver`` without a driver)."""
    return _core.device_count()


def virtual_world(world, *, device=0, timeout=None):
    """``world`` virtual ranks on GPU ``device``, one ``Communicator`` each, in
    rank order: run each on its own thread, with its own stream
    (``run_virtual`` does)."""
    return _core.Communicator.virtual_world(world, device, timeout)


def run_virtual(world, fn, *, device=0, timeout=None):
    """Runs ``fn(comm)`` for each of ``world`` virtual ranks on GPU ``device``,
    each on its own thread and its own torch stream (made one after another,
    in rank order), and returns their results in rank order. Each thread runs
    its autograd backward passes itself
    (``torch.autograd.set_multithreading_enabled(False)``): by default torch
    runs every backward of a GPU on one engine thread, where the ranks'
    collective backward ops would wait for each other forever. Where ranks
    raise, the first rank's exception is raised (the others are attached as
    ``exc.rank_errors``).

    Set ``CUDA_MODULE_LOADING=EAGER`` before CUDA starts in the process (warned
    here otherwise): with CUDA's default lazy loading, the first launch of a
    kernel (torch's, in a backward pass say) loads its module, which waits
    for the whole GPU, where the sibling ranks' kernels wait for this rank's
    next op: every rank then waits until the group's timeout. For the same
    reason each rank's thread first runs a small matmul forward and backward
    (torch's per-thread cuBLAS set-up), and the ranks start ``fn`` together
    once every thread has."""
    if world > 1 and os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
        warnings.warn(
            "moe_ep.run_virtual: CUDA_MODULE_LOADING is not EAGER: a kernel loaded lazily at its "
            "first launch waits for the whole GPU while sibling ranks' kernels wait for this rank "
            "(a hang until the group's timeout); set CUDA_MODULE_LOADING=EAGER before CUDA starts",
            RuntimeWarning,
            stacklevel=2,
        )
    comms = virtual_world(world, device=device, timeout=timeout)
    streams = [None] * world
    if _torch is not None:
        with _torch.cuda.device(device):
            streams = [_torch.cuda.Stream(device=device) for _ in range(world)]
    results = [None] * world
    errors = [None] * world
    # Every rank's thread sets up its own torch state first (below), and the
    # ranks start fn together once all have.
    start = threading.Barrier(world)

    def body(r):
        try:
            if _torch is not None:
                _torch.cuda.set_device(device)
                # Backward passes on this thread, not the engine's one thread
                # per GPU: the ranks' collective backward ops must run at once.
                with _torch.cuda.stream(streams[r]), _torch.autograd.set_multithreading_enabled(False):
                    try:
                        _warm_up_thread(device)
                        streams[r].synchronize()
                    except BaseException:
                        start.abort()
                        raise
                    start.wait()
                    results[r] = fn(comms[r])
                    streams[r].synchronize()
            else:
                results[r] = fn(comms[r])
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"moe-ep-rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        # The root cause first: a rank's own error before the PeerFailed /
        # timeouts it caused on the others.
        from .errors import PeerFailed, PeerTimeout, CollectiveFailed

        secondary = (PeerFailed, PeerTimeout, CollectiveFailed)
        failed.sort(key=lambda re: (isinstance(re[1], secondary), re[0]))
        r, e = failed[0]
        e.rank_errors = dict(failed)
        raise e
    return results


def _warm_up_thread(device):
    """What torch sets up per thread at its first matmul, forward and
    backward, in bfloat16 and float32 (cuBLAS handles and workspaces, which
    may wait for the whole GPU), done on a virtual rank's thread before any
    rank runs a collective op: made later, between two ops, it would wait
    for sibling ranks' kernels that wait for this rank."""
    for dtype in (_torch.bfloat16, _torch.float32):
        a = _torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
        b = _torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
        (a @ b).float().sum().backward()


def from_process_group(group=None, *, device=None, **config):
    """A ``Group`` over the ranks of a ``torch.distributed`` process group
    (collective over it): rank 0 makes the NCCL unique id, which travels
    through the process group (``broadcast_object_list``); rank and world are
    the process group's; ``device`` defaults to torch's current device. The
    remaining arguments are ``Group``'s."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if device is None:
        device = _torch.cuda.current_device()
    obj = [unique_id() if rank == 0 else None]
    bdev = None
    if dist.get_backend(pg) == "nccl":
        bdev = _torch.device("cuda", device)
    try:
        dist.broadcast_object_list(obj, group=pg, group_src=0, device=bdev)
    except TypeError:  # pragma: no cover - torch without group_src
        dist.broadcast_object_list(obj, src=dist.get_global_rank(pg, 0), group=pg, device=bdev)
    comm = _core.Communicator.init(device, obj[0], rank, world)
    return Group(comm, **config)


__all__ = [
    "Communicator",
    "DeviceArray",
    "Dispatched",
    "DispatchedFp8",
    "Group",
    "Handle",
    "LlBatch",
    "MoeEpError",
    "device_count",
    "from_process_group",
    "run_virtual",
    "unique_id",
    "virtual_world",
]
