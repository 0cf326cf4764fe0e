"""Test machinery, apart from the package (``pip install .`` does not install it; the tests,
benchmarks and the CPU runs of the examples import it from the repository root): a device that
models accelerator streams on the CPU and checks ordering, a model of the CUDA caching
allocator that says when freed device memory is reusable, and the CPU stand-ins that let
megatron-core and megatron.training run on gloo ranks (``cpu_megatron``, ``cpu_training``), and
Megatron-Bridge's training modules import on a CPU (``bridge_imports``)."""

from .allocator_model import AllocatorModel, ModelledOutOfMemory
from .checked_device import CheckedDevice
from .checked_records import (
    DEVICE_RACE,
    FREED_IN_USE,
    HOST_FREED_IN_USE,
    HOST_OVERWRITE,
    NEVER_ORDERED,
    OVERWRITE_WHILE_READ,
    RECORDED_ON_RETIRED_STREAM,
    RELEASE_IN_USE,
    RELEASED_ACCESS,
    UNORDERED_DEVICE_ACCESS,
    UNORDERED_HOST_READ,
    USE_BEFORE_COPY,
    WRITE_BEFORE_ALLOCATION,
    ProtocolViolation,
    Violation,
    fill_poison,
)
from .modelled_device import REUSE_BEFORE_COPY, ModelledDevice

__all__ = [
    "AllocatorModel",
    "ModelledDevice",
    "ModelledOutOfMemory",
    "REUSE_BEFORE_COPY",
    "CheckedDevice",
    "ProtocolViolation",
    "Violation",
    "fill_poison",
    "DEVICE_RACE",
    "FREED_IN_USE",
    "HOST_FREED_IN_USE",
    "HOST_OVERWRITE",
    "NEVER_ORDERED",
    "RECORDED_ON_RETIRED_STREAM",
    "OVERWRITE_WHILE_READ",
    "RELEASE_IN_USE",
    "RELEASED_ACCESS",
    "UNORDERED_DEVICE_ACCESS",
    "UNORDERED_HOST_READ",
    "USE_BEFORE_COPY",
    "WRITE_BEFORE_ALLOCATION",
]
