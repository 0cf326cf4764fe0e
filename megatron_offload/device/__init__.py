"""Device layer: the only code that knows about accelerators (see ``base.Device``)."""

from __future__ import annotations

import torch

from .base import Device
from .cpu import CPUDevice


def device_for(tensor_device: torch.device, *, stream_priority: int = 0) -> Device:
    """The ``Device`` that offloads tensors living on ``tensor_device``; ``stream_priority``
    is that of its side streams (``OffloadConfig.stream_priority``; a CPU has none)."""
    if tensor_device.type == "cpu":
        return CPUDevice()
    from .accelerator import AcceleratorDevice

    return AcceleratorDevice(tensor_device, stream_priority=stream_priority)


def collective_device(backend: str) -> torch.device:
    """Where a tensor reduced by a ``backend`` process group lives: NCCL (and other
    accelerator backends) reduce device tensors of the current device, gloo host tensors."""
    if backend == "gloo":
        return torch.device("cpu")
    from .accelerator import current_device

    return current_device()


__all__ = ["Device", "CPUDevice", "collective_device", "device_for"]
