"""Accelerator device (CUDA and other torch accelerators with streams and events).

This is the only module that issues asynchronous work. It is written against the
generic torch device module (``torch.get_device_module``), so the same code serves
CUDA and other stream-based accelerators; the single CUDA-specific call is the exact-size
pinning of host buffers (see ``host_buffer``).

Nothing here runs in CI (there is no accelerator there): keep it small and obvious.
"""

from __future__ import annotations

import weakref

import torch

from .base import Device


class AcceleratorDevice(Device):
    """Streams, events and non-blocking copies on one accelerator."""

    is_accelerator = True

    def __init__(self, torch_device: torch.device) -> None:
        if torch_device.index is None:
            module = torch.get_device_module(torch_device.type)
            torch_device = torch.device(torch_device.type, module.current_device())
        self.torch_device = torch_device
        self._module = torch.get_device_module(torch_device.type)

    # ----------------------------------------------------------------- memory
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.torch_device.type == "cuda":
            # torch's pinned-memory allocator rounds every request up to a power of two
            # (up to 2x the host RAM for one large arena). Registering an exactly sized
            # pageable buffer pins exactly what is asked for.
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                cudart = torch.cuda.cudart()
                err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
                if int(err) != 0:
                    raise RuntimeError(
                        f"cudaHostRegister of {nbytes} bytes failed with error {int(err)}: "
                        "the host may be out of lockable memory (check `ulimit -l`), or lower "
                        "the host-memory need by offloading fewer states."
                    )
                weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
            return buffer
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    # ---------------------------------------------------------------- streams
    def current_stream(self):
        return self._module.current_stream(self.torch_device)

    def new_stream(self):
        return self._module.Stream(device=self.torch_device)

    def use_stream(self, stream):
        return self._module.stream(stream)

    def wait_stream(self, waiter, waitee, *, label="") -> None:
        waiter.wait_stream(waitee)

    def record_event(self, stream):
        event = self._module.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event, *, label="") -> None:
        stream.wait_event(event)

    def synchronize_event(self, event, *, label="") -> None:
        event.synchronize()

    def record_stream(self, tensor, stream, *, label="") -> None:
        tensor.record_stream(stream)

    def copy(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        self._module.synchronize(self.torch_device)

    def memory_allocated(self):
        return self._module.memory_allocated(self.torch_device)
