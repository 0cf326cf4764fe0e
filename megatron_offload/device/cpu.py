"""Synchronous CPU device: every copy is complete when ``copy`` returns.

On a CPU there is nothing to overlap, so streams and events are inert tokens and the
ordering calls are no-ops. Host buffers are ordinary memory (torch cannot pin memory
without an accelerator), mapped shared as the accelerator's are.
"""

from __future__ import annotations

import contextlib
import time

import torch

from . import pinned
from .base import Device

# One reusable do-nothing context for every ``use_stream``.
_NO_STREAM = contextlib.nullcontext()


class CPUDevice(Device):
    """Offloading between two places in host memory, synchronously."""

    is_accelerator = False

    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Mapped shared, as on an accelerator (see pinned.shared_host_buffer): a fork after
        # attach copies none of it, which the tests show on this device.
        return pinned.shared_host_buffer(nbytes)

    def io_buffer(self, nbytes: int) -> torch.Tensor:
        # In huge pages, wiped in a fork (see pinned.io_host_buffer).
        return pinned.io_host_buffer(nbytes)

    def current_stream(self):
        return None

    def new_stream(self):
        return object()  # a token: nothing runs on it

    def use_stream(self, stream):
        return _NO_STREAM

    def wait_stream(self, waiter, waitee, *, label="") -> None:
        pass

    def record_event(self, stream, *, timing=False):
        # Copies are complete when issued: a timing event is the host's clock now.
        return time.perf_counter() if timing else None

    def elapsed_ms(self, start, end):
        return None if start is None or end is None else (end - start) * 1e3

    def wait_event(self, stream, event, *, label="") -> None:
        pass

    def synchronize_event(self, event, *, label="") -> None:
        pass

    def record_stream(self, tensor, stream, *, label="") -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
