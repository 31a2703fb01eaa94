"""The exceptions of moe_ep: one class per kind of ``moe_ep::Error``.

Every error of the Rust API arrives as an instance of the class of its kind,
with the Rust error's message. Arguments refused by the Python binding itself
(host memory, another GPU, strides, a shape) are ``InvalidArgument`` (also a
``ValueError``); a wrong type or dtype is ``InvalidArgumentType`` (also a
``TypeError``). Attributes where the kind has them: ``arg`` (the argument
named), ``rank``, ``peer``. A panic inside the library never crosses into
Python: it is an ``InternalError``.
"""


class MoeEpError(Exception):
    """Base of every moe_ep error."""

    arg = None
    rank = None
    peer = None


class InvalidArgument(MoeEpError, ValueError):
    """An argument has the wrong shape, device, alignment or value; ``arg``
    names it."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument is not an array, or has the wrong dtype; ``arg`` names
    it."""


class NotSymmetric(InvalidArgument):
    """A buffer that zero copy needs in symmetric memory is not (allocate it
    with ``Group.symm_empty``)."""


class CapacityExceeded(MoeEpError):
    """A receive count found on the device exceeds the buffer sized for it."""


class PeerTimeout(MoeEpError, TimeoutError):
    """A bounded wait on another GPU ran out of time (``peer`` names it)."""


class PeerFailed(MoeEpError):
    """Another rank failed its part of the same op (``peer``, ``arg``)."""


class CollectiveFailed(MoeEpError):
    """A host collective of a virtual world did not complete."""


class InvalidDeviceData(MoeEpError, ValueError):
    """A value checked on the device was out of range (``arg`` names it)."""


class NoDriver(MoeEpError):
    """No usable CUDA driver."""


class NotEnoughGpus(MoeEpError):
    """Fewer GPUs than needed."""


class CudaError(MoeEpError):
    """A CUDA driver call failed."""


class NcclLibraryError(MoeEpError):
    """libnccl.so.2 could not be loaded or lacks a symbol."""


class NcclVersionError(MoeEpError):
    """libnccl.so.2 is older than the headers moe-ep was built with."""


class NcclError(MoeEpError):
    """An NCCL call failed."""


class ModuleError(MoeEpError):
    """A kernel image is missing for this GPU."""


class InvalidState(MoeEpError):
    """The call is not allowed in the object's state."""


class IoError(MoeEpError, OSError):
    """Host-side I/O."""


class InternalError(MoeEpError, RuntimeError):
    """A bug in moe-ep (a panic, caught at the binding)."""


__all__ = [
    "MoeEpError",
    "InvalidArgument",
    "InvalidArgumentType",
    "NotSymmetric",
    "CapacityExceeded",
    "PeerTimeout",
    "PeerFailed",
    "CollectiveFailed",
    "InvalidDeviceData",
    "NoDriver",
    "NotEnoughGpus",
    "CudaError",
    "NcclLibraryError",
    "NcclVersionError",
    "NcclError",
    "ModuleError",
    "InvalidState",
    "IoError",
    "InternalError",
]
