"""CPU tests of the Python package: no GPU, no driver, no torch needed.

Arrays come from a tiny DLPack producer written with ctypes (and a
``__cuda_array_interface__`` dict), so that every refusal of the binding's
argument checks is exercised without device memory: host memory, another GPU,
the wrong dtype, strides, the wrong shape, not an array at all. The error
mapping is checked kind by kind, a panic included; without a driver the ops
raise ``NoDriver``.

Run: ``python3 -m unittest discover -s python/tests -p 'test_cpu.py'`` (or
pytest) with the package importable (the built wheel installed, or on
PYTHONPATH).
"""

import ctypes
import importlib.util
import os
import unittest
import warnings

import moe_ep
from moe_ep import _moe_ep as core

# ---- a tiny DLPack producer -------------------------------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

DTYPES = {
    "bfloat16": (4, 16),
    "float32": (2, 32),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
    "float16": (2, 16),
}

# A device address that is never dereferenced: the checks come first.
FAKE_PTR = 0x7F00_0000_0000


class FakeArray:
    """A DLPack producer of a made-up array: nothing is ever read from it."""

    def __init__(self, shape, dtype="bfloat16", device=(2, 0), strides=None, ptr=FAKE_PTR, offset=0):
        self.device = device
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        code, bits = DTYPES[dtype]
        self._m = DLManagedTensor()
        t = self._m.dl_tensor
        t.data = ptr
        t.device = DLDevice(*device)
        t.ndim = len(shape)
        t.dtype = DLDataType(code, bits, 1)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self._strides is not None:
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = offset
        self.streams = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        # No deleter: the consumer must not consume (it does not).
        return _capsule_new(ctypes.addressof(self._m), b"dltensor", None)


class FakeCai:
    """A made-up ``__cuda_array_interface__`` producer."""

    def __init__(self, shape, typestr="<f4", strides=None, ptr=FAKE_PTR):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


def check(obj, arg="x", dtypes=("bfloat16",), shape=None, device=0, stream=0):
    return core._check_array(obj, arg, list(dtypes), device, shape, stream)


class ArgumentChecks(unittest.TestCase):
    def test_a_contiguous_cuda_array_is_read_as_it_is(self):
        a = FakeArray((4, 16))
        ptr, shape, dtype = check(a, shape=[4, 16])
        self.assertEqual((ptr, shape, dtype), (FAKE_PTR, [4, 16], "bfloat16"))
        # The consumer names its stream (1: the legacy default stream).
        self.assertEqual(a.streams, [1])

    def test_byte_offset_is_added(self):
        ptr, _, _ = check(FakeArray((2, 8), offset=64))
        self.assertEqual(ptr, FAKE_PTR + 64)

    def test_host_memory_is_refused_naming_the_argument(self):
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            check(FakeArray((4, 16), device=(1, 0)), arg="topk_weights", dtypes=("float32",))
        e = cm.exception
        self.assertIsInstance(e, ValueError)
        self.assertEqual(e.arg, "topk_weights")
        self.assertIn("`topk_weights`", str(e))
        self.assertIn("host memory", str(e))

    def test_pinned_and_managed_memory_are_refused(self):
        for dev, what in [((3, 0), "pinned host memory"), ((13, 0), "managed memory")]:
            with self.assertRaises(moe_ep.InvalidArgument) as cm:
                check(FakeArray((4, 16), device=dev))
            self.assertIn(what, str(cm.exception))

    def test_another_gpu_is_refused(self):
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            check(FakeArray((4, 16), device=(2, 1)), device=0)
        self.assertIn("GPU 1", str(cm.exception))
        self.assertIn("GPU 0", str(cm.exception))

    def test_wrong_dtype_is_a_type_error_naming_the_argument(self):
        with self.assertRaises(TypeError) as cm:
            check(FakeArray((4, 16), dtype="float32"), arg="x")
        e = cm.exception
        self.assertIsInstance(e, moe_ep.InvalidArgumentType)
        self.assertIsInstance(e, moe_ep.InvalidArgument)
        self.assertEqual(e.arg, "x")
        self.assertIn("bfloat16", str(e))
        self.assertIn("float32", str(e))
        with self.assertRaises(TypeError) as cm:
            check(FakeArray((4, 2), dtype="float16"), arg="topk_idx", dtypes=("int64", "int32"))
        self.assertIn("int64 or int32", str(cm.exception))

    def test_non_contiguous_is_refused(self):
        # A transposed [16, 4] view: strides (1, 16).
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            check(FakeArray((16, 4), strides=(1, 16)))
        self.assertIn("C-contiguous", str(cm.exception))
        # Every other row.
        with self.assertRaises(moe_ep.InvalidArgument):
            check(FakeArray((4, 16), strides=(32, 1)))

    def test_strides_of_extent_one_and_explicit_compact_strides_are_fine(self):
        check(FakeArray((1, 16), strides=(999, 1)))
        check(FakeArray((4, 16), strides=(16, 1)))
        check(FakeArray((0, 16), strides=(5, 7)))

    def test_wrong_shape_is_refused(self):
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            check(FakeArray((4, 16)), shape=[4, 32])
        self.assertIn("[4, 16]", str(cm.exception))
        with self.assertRaises(moe_ep.InvalidArgument):
            check(FakeArray((64,)), shape=[4, 16])
        check(FakeArray((4, 16)), shape=[None, 16])

    def test_not_an_array_is_a_type_error(self):
        for obj in ([1, 2, 3], None, "x", 3.0):
            with self.assertRaises(TypeError) as cm:
                check(obj, arg="expert_out")
            self.assertIn("`expert_out`", str(cm.exception))
            self.assertIn("__dlpack__", str(cm.exception))

    def test_cuda_array_interface(self):
        ptr, shape, dtype = check(FakeCai((4, 8), "<i8"), dtypes=("int64", "int32"))
        self.assertEqual((ptr, shape, dtype), (FAKE_PTR, [4, 8], "int64"))
        with self.assertRaises(moe_ep.InvalidArgument):
            check(FakeCai((4, 8), "<f4", strides=(4, 32)), dtypes=("float32",))
        with self.assertRaises(TypeError) as cm:
            check(FakeCai((4, 8), "<f2"))
        self.assertIn("DLPack", str(cm.exception))

    @unittest.skipUnless(importlib.util.find_spec("numpy"), "numpy not installed")
    def test_numpy_host_arrays_are_refused(self):
        import numpy as np

        for a in (np.zeros((4, 16), np.float32), np.zeros((4, 2), np.int64)):
            with self.assertRaises(moe_ep.InvalidArgument) as cm:
                check(a, arg="topk_weights", dtypes=("float32", "int64"))
            self.assertIn("host memory", str(cm.exception))


KINDS = {
    "InvalidArgument": (moe_ep.InvalidArgument, ValueError, "invalid argument `x`"),
    "NotSymmetric": (moe_ep.NotSymmetric, ValueError, "`recv_tokens` is not symmetric memory"),
    "CapacityExceeded": (moe_ep.CapacityExceeded, moe_ep.MoeEpError, "capacity exceeded"),
    "PeerTimeout": (moe_ep.PeerTimeout, TimeoutError, "rank 1 never arrived"),
    "PeerFailed": (moe_ep.PeerFailed, moe_ep.MoeEpError, "rank 2 failed its part"),
    "CollectiveFailed": (moe_ep.CollectiveFailed, moe_ep.MoeEpError, "host collective `barrier`"),
    "InvalidDeviceData": (moe_ep.InvalidDeviceData, ValueError, "invalid device data in `topk_idx`"),
    "NoDriver": (moe_ep.NoDriver, moe_ep.MoeEpError, "no CUDA driver"),
    "NotEnoughGpus": (moe_ep.NotEnoughGpus, moe_ep.MoeEpError, "need 2, found 1"),
    "Cuda": (moe_ep.CudaError, moe_ep.MoeEpError, "CUDA error in cuMemAlloc"),
    "NcclLibrary": (moe_ep.NcclLibraryError, moe_ep.MoeEpError, "NCCL library"),
    "NcclVersion": (moe_ep.NcclVersionError, moe_ep.MoeEpError, "older than the headers"),
    "Nccl": (moe_ep.NcclError, moe_ep.MoeEpError, "NCCL error in ncclCommInitRank"),
    "Module": (moe_ep.ModuleError, moe_ep.MoeEpError, "kernel module `dispatch`"),
    "InvalidState": (moe_ep.InvalidState, moe_ep.MoeEpError, "invalid state"),
    "Io": (moe_ep.IoError, OSError, "I/O error"),
}



class TorchTensorExport(unittest.TestCase):
    """A torch tensor (here a stand-in: a module named ``torch`` whose
    ``Tensor`` the binding recognises, as it looks torch up in
    ``sys.modules`` and never imports it) is exported without a stream where
    the op runs on torch's current stream of the group's GPU, with the op's
    stream where it does not, and detached where it requires grad."""

    def setUp(self):
        import sys
        import types

        self._saved = sys.modules.get("torch")
        fake = types.ModuleType("torch")
        self.current = {0: 0}
        self.asked = []
        self.dlpack_device_calls = 0
        outer = self

        def current_raw(device):
            self.asked.append(device)
            return self.current[device]

        class Tensor(FakeArray):
            def __init__(self, *a, requires_grad=False, **k):
                super().__init__(*a, **k)
                self.requires_grad = requires_grad
                self.detached = None

            @property
            def is_cuda(self):
                return self.device[0] == 2

            def get_device(self):
                return self.device[1] if self.is_cuda else -1

            def __dlpack_device__(self):
                outer.dlpack_device_calls += 1
                return super().__dlpack_device__()

            def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
                if self.requires_grad:
                    raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")
                return super().__dlpack__(stream, max_version, dl_device, copy)

            def detach(self):
                d = Tensor(tuple(self._shape))
                self.detached = d
                return d

        fake.Tensor = Tensor
        fake._C = types.SimpleNamespace(_cuda_getCurrentRawStream=current_raw)
        sys.modules["torch"] = fake
        self.Tensor = Tensor

    def tearDown(self):
        import sys

        if self._saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self._saved

    def test_on_the_current_stream_no_stream_is_passed(self):
        self.current[0] = 0x5000
        t = self.Tensor((4, 16))
        check(t, shape=[4, 16], stream=0x5000)
        self.assertEqual(t.streams, [-1])
        self.assertEqual(self.asked, [0])
        # The legacy default stream as torch's current one too.
        self.current[0] = 0
        t = self.Tensor((4, 16))
        check(t, stream=0)
        self.assertEqual(t.streams, [-1])

    def test_on_another_stream_the_op_stream_is_passed(self):
        self.current[0] = 0x5000
        t = self.Tensor((4, 16))
        check(t, stream=0x6000)
        self.assertEqual(t.streams, [0x6000])
        t = self.Tensor((4, 16))
        check(t, stream=0)
        self.assertEqual(t.streams, [1])

    def test_the_current_stream_of_the_groups_gpu_is_asked(self):
        self.current = {0: 7, 3: 0x5000}
        t = self.Tensor((4, 16), device=(2, 3))
        check(t, device=3, stream=0x5000)
        self.assertEqual(self.asked, [3])
        self.assertEqual(t.streams, [-1])

    def test_a_tensor_that_requires_grad_is_exported_detached(self):
        self.current[0] = 0x5000
        t = self.Tensor((4, 16), requires_grad=True)
        ptr, shape, _ = check(t, shape=[4, 16], stream=0x5000)
        self.assertEqual((ptr, shape), (FAKE_PTR, [4, 16]))
        self.assertEqual(t.streams, [])
        self.assertIsNotNone(t.detached)
        self.assertEqual(t.detached.streams, [-1])

    def test_without_the_raw_lookup_the_op_stream_is_passed(self):
        import sys

        sys.modules["torch"]._C = object()
        t = self.Tensor((4, 16))
        check(t, stream=0x5000)
        self.assertEqual(t.streams, [0x5000])

    def test_the_device_is_read_from_the_tensor(self):
        # is_cuda and get_device(), not torch's Python __dlpack_device__.
        self.current[0] = 0x5000
        check(self.Tensor((4, 16)), stream=0x5000)
        self.assertEqual(self.dlpack_device_calls, 0)

    def test_a_tensor_elsewhere_is_refused_as_any_array(self):
        for dev, what in [((1, 0), "host memory"), ((2, 1), "memory of GPU 1")]:
            t = self.Tensor((4, 16), device=dev)
            with self.assertRaises(moe_ep.InvalidArgument) as cm:
                check(t, arg="x")
            self.assertIn(what, str(cm.exception))
            self.assertEqual(cm.exception.arg, "x")
            self.assertEqual(t.streams, [])

    def test_other_arrays_are_unchanged(self):
        self.current[0] = 0x5000
        a = FakeArray((4, 16))
        check(a, stream=0x5000)
        self.assertEqual(a.streams, [0x5000])

class Fp8Arguments(unittest.TestCase):
    """``Group.dispatch_fp8``'s argument checks (``core._check_fp8_args``, the
    same code without a group): every array named, the scales' kind from
    their dtype."""

    T, K, H = 4, 2, 256

    def check(self, codes=None, scales=None, w=None, layout="rank_major", hidden=None, **out):
        T, K, H = self.T, self.K, self.H
        codes = codes if codes is not None else FakeArray((T, H), "uint8")
        scales = scales if scales is not None else FakeArray((T, H // 32), "uint8", ptr=FAKE_PTR + 4096)
        w = w if w is not None else FakeArray((T, K), "float32", ptr=FAKE_PTR + 8192)
        return core._check_fp8_args(
            codes, scales, w, tokens=T, topk=K, hidden=hidden or H, layout=layout, **out
        )

    def refused(self, arg, kind=moe_ep.InvalidArgument, **kw):
        with self.assertRaises(kind) as cm:
            self.check(**kw)
        self.assertEqual(cm.exception.arg, arg, str(cm.exception))
        return str(cm.exception)

    def test_both_scale_kinds_are_taken_by_dtype(self):
        self.assertEqual(self.check(), "e8m0")
        f32 = FakeArray((self.T, self.H // 128), "float32", ptr=FAKE_PTR + 4096)
        self.assertEqual(self.check(scales=f32), "f32")
        out = dict(
            out_codes=FakeArray((12, self.H), "uint8", ptr=FAKE_PTR + 16384),
            out_scales=FakeArray((12, self.H // 32), "uint8", ptr=FAKE_PTR + 65536),
            out_weights=FakeArray((12,), "float32", ptr=FAKE_PTR + 81920),
        )
        self.assertEqual(self.check(layout="expert_major", **out), "e8m0")

    def test_bad_arrays_are_refused_by_name(self):
        T, K, H = self.T, self.K, self.H
        self.refused("codes", TypeError, codes=FakeArray((T, H), "bfloat16"))
        self.refused("codes", codes=FakeArray((T, H - 8), "uint8"))
        self.refused("codes", codes=FakeArray((T, H), "uint8", device=(1, 0)))
        self.refused("scales", TypeError, scales=FakeArray((T, H // 32), "float16"))
        # e8m0 bytes per 32 values, f32 per 128: the other width is refused.
        msg = self.refused("scales", scales=FakeArray((T, H // 128), "uint8"))
        self.assertIn("H/32", msg)
        msg = self.refused("scales", scales=FakeArray((T, H // 32), "float32"))
        self.assertIn("H/128", msg)
        self.refused("topk_weights", w=FakeArray((T, K + 1), "float32"))
        self.refused("hidden", hidden=192)
        # Receive arrays: of the kind sent, the layout's weights shape.
        self.refused(
            "out_scales", TypeError, out_scales=FakeArray((12, H // 128), "float32", ptr=FAKE_PTR + 65536)
        )
        self.refused("out_codes", out_codes=FakeArray((12, H // 2), "uint8", ptr=FAKE_PTR + 16384))
        self.refused("out_weights", out_weights=FakeArray((12,), "float32", ptr=FAKE_PTR + 81920))
        self.refused(
            "out_weights",
            layout="expert_major",
            out_weights=FakeArray((12, K), "float32", ptr=FAKE_PTR + 81920),
        )
        # An output overlapping an input.
        msg = self.refused("out_codes", out_codes=FakeArray((12, H), "uint8", ptr=FAKE_PTR + 4096))
        self.assertIn("`scales`", msg)

    def test_python_layer(self):
        from moe_ep import _api

        self.assertEqual(
            moe_ep.DispatchedFp8._fields,
            ("codes", "scales", "topk_weights", "topk_idx", "src", "tokens_per_expert"),
        )
        self.assertIsNone(_api._u8(None))
        a = FakeArray((2, 128), "uint8")
        self.assertIs(_api._u8(a), a)

        class FakeCore:  # a Handle's extension object, as the layout made it
            num_tokens, topk, device_bytes = 3, 2, 4096

            def dropped_slots(self, stream):
                return [False, True, False, False, True, True]

            def kept_topk_idx(self):
                return None

        class FakeGroup:
            device = 0

        h = _api.Handle(FakeGroup(), FakeCore())
        slots = h.dropped_slots(stream=7)
        rows = slots.tolist() if hasattr(slots, "tolist") else slots
        self.assertEqual(rows, [[False, True], [False, False], [True, True]])
        self.assertIsNone(h.kept_topk_idx())
        self.assertEqual(h.device_bytes, 4096)


class ErrorsMapped(unittest.TestCase):
    def test_every_kind_has_its_class_and_the_rust_message(self):
        for kind, (cls, base, text) in KINDS.items():
            with self.subTest(kind=kind):
                with self.assertRaises(cls) as cm:
                    core._raise_for_tests(kind)
                e = cm.exception
                self.assertIsInstance(e, base)
                self.assertIsInstance(e, moe_ep.MoeEpError)
                self.assertIn(text, str(e))

    def test_fields_are_attributes(self):
        with self.assertRaises(moe_ep.PeerFailed) as cm:
            core._raise_for_tests("PeerFailed")
        self.assertEqual((cm.exception.peer, cm.exception.arg), (2, "x"))
        with self.assertRaises(moe_ep.PeerTimeout) as cm:
            core._raise_for_tests("PeerTimeout")
        self.assertEqual((cm.exception.rank, cm.exception.peer), (0, 1))

    def test_a_panic_never_crosses_into_python(self):
        with self.assertRaises(moe_ep.InternalError) as cm:
            core._raise_for_tests("Panic")
        self.assertIsInstance(cm.exception, RuntimeError)
        self.assertIn("a test panic", str(cm.exception))

    def test_every_class_is_exported(self):
        for name in moe_ep.errors.__all__:
            self.assertTrue(issubclass(getattr(moe_ep, name), moe_ep.MoeEpError), name)


def _driver_present():
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


class WithoutDriver(unittest.TestCase):
    @unittest.skipIf(_driver_present(), "a CUDA driver is installed")
    def test_ops_raise_no_driver(self):
        with self.assertRaises(moe_ep.NoDriver) as cm:
            moe_ep.device_count()
        self.assertIn("no CUDA driver", str(cm.exception))
        with self.assertRaises(moe_ep.NoDriver):
            moe_ep.virtual_world(2)
        with self.assertRaises(moe_ep.NoDriver):
            moe_ep.Communicator.init(0, bytes(128), 0, 1)

    def test_arguments_are_checked_before_the_driver(self):
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            moe_ep.Communicator.init(0, b"short", 0, 1)
        self.assertEqual(cm.exception.arg, "unique_id")
        with self.assertRaises(moe_ep.InvalidArgument) as cm:
            moe_ep.virtual_world(2, timeout=-1.0)
        self.assertEqual(cm.exception.arg, "timeout")

    def test_run_virtual_warns_without_eager_module_loading(self):
        old = os.environ.pop("CUDA_MODULE_LOADING", None)
        try:
            # The warning comes before anything else (here a bad timeout).
            with self.assertWarns(RuntimeWarning) as w, self.assertRaises(moe_ep.InvalidArgument):
                moe_ep.run_virtual(2, lambda comm: None, timeout=-1.0)
            self.assertIn("CUDA_MODULE_LOADING", str(w.warning))
            os.environ["CUDA_MODULE_LOADING"] = "EAGER"
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with self.assertRaises(moe_ep.InvalidArgument):
                    moe_ep.run_virtual(2, lambda comm: None, timeout=-1.0)
        finally:
            os.environ.pop("CUDA_MODULE_LOADING", None)
            if old is not None:
                os.environ["CUDA_MODULE_LOADING"] = old

    @unittest.skipIf(importlib.util.find_spec("torch"), "torch is installed")
    def test_without_torch_a_stream_must_be_named(self):
        from moe_ep import _api

        with self.assertRaises(TypeError) as cm:
            _api._stream(None, 0)
        self.assertIn("`stream`", str(cm.exception))
        self.assertEqual(_api._stream(7, 0), 7)

        class S:
            cuda_stream = 9

        self.assertEqual(_api._stream(S(), 0), 9)
        with self.assertRaises(TypeError):
            _api._stream("a stream", 0)


class Package(unittest.TestCase):
    def test_the_extension_is_the_abi3_module_of_the_package(self):
        self.assertEqual(core.__name__, "moe_ep._moe_ep")
        self.assertTrue(core.__file__.endswith(".abi3.so"), core.__file__)
        self.assertEqual(os.path.dirname(core.__file__), os.path.dirname(moe_ep.__file__))
        self.assertRegex(moe_ep.__version__, r"^\d+\.\d+\.\d+")
        self.assertRegex(moe_ep.NCCL_HEADERS_VERSION, r"^2\.\d+\.\d+$")

    def test_the_torch_allocator_symbols_are_exported(self):
        lib = ctypes.CDLL(core.__file__)
        for name in ("moe_ep_torch_alloc", "moe_ep_torch_free"):
            self.assertTrue(hasattr(lib, name), name)
        # Without a group set on this thread an allocation is refused (NULL).
        alloc = lib.moe_ep_torch_alloc
        alloc.restype = ctypes.c_void_p
        alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.assertIsNone(alloc(1024, 0, None))
        self.assertEqual(core._torch_allocations(), 0)

    def test_device_arrays_cannot_be_made_from_python(self):
        with self.assertRaises(TypeError):
            moe_ep.DeviceArray()


if __name__ == "__main__":
    unittest.main()
