"""Test helpers: a device that models accelerator streams on the CPU and checks ordering."""

from .checked_device import (
    DEVICE_RACE,
    FREED_IN_USE,
    HOST_FREED_IN_USE,
    HOST_OVERWRITE,
    NEVER_ORDERED,
    OVERWRITE_WHILE_READ,
    RELEASE_IN_USE,
    RELEASED_ACCESS,
    UNORDERED_DEVICE_ACCESS,
    UNORDERED_HOST_READ,
    USE_BEFORE_COPY,
    WRITE_BEFORE_ALLOCATION,
    CheckedDevice,
    ProtocolViolation,
    Violation,
    fill_poison,
)

__all__ = [
    "CheckedDevice",
    "ProtocolViolation",
    "Violation",
    "fill_poison",
    "DEVICE_RACE",
    "FREED_IN_USE",
    "HOST_FREED_IN_USE",
    "HOST_OVERWRITE",
    "NEVER_ORDERED",
    "OVERWRITE_WHILE_READ",
    "RELEASE_IN_USE",
    "RELEASED_ACCESS",
    "UNORDERED_DEVICE_ACCESS",
    "UNORDERED_HOST_READ",
    "USE_BEFORE_COPY",
    "WRITE_BEFORE_ALLOCATION",
]
