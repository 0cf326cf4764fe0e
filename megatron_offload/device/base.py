"""The device interface: every stream, event, copy and memory call the offloader makes.

The engine never calls ``torch.cuda`` (or any accelerator module) itself. It asks a
``Device`` for host buffers, streams, events and copies, and for the two storage
operations that really return and regain device memory (``release`` / ``regrow``).
Three implementations exist:

* ``AcceleratorDevice`` (``accelerator.py``): CUDA-like devices through the torch device
  module: side streams, events, non-blocking copies, pinned host memory, record_stream.
* ``CPUDevice`` (``cpu.py``): plain synchronous copies; streams and events are inert.
* a checked device for tests (``megatron_offload_testing``) that models streams on the CPU
  and reports every ordering mistake.

Streams and events are opaque handles: only the device that made them interprets them.
The ordering calls take a ``label`` naming the protocol step they implement; real devices
ignore it, the checked device uses it in its reports (and to leave one out in negative
controls).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any

import torch

Stream = Any
Event = Any


class Device(abc.ABC):
    """Streams, events, copies and storage memory for one device."""

    #: True when copies are asynchronous and host memory should be pinned.
    is_accelerator: bool = False
    #: The torch device whose tensors are offloaded.
    torch_device: torch.device

    #: True when freeing device memory a side stream was announced on (``record_stream``)
    #: makes the memory's allocation stream wait for that stream (``cudaMallocAsync``): the
    #: compute stream then waits for the copy out of every released piece.
    frees_wait_for_copies: bool = False

    # ----------------------------------------------------------------- memory
    def piece_bound(self) -> int | None:
        """The largest storage the device's allocator can split again for smaller requests
        once it is freed, or None when any size can (see ``allocator.py``)."""
        return None

    @abc.abstractmethod
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor of exactly ``nbytes`` (pinned on accelerators)."""

    def io_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` that direct reads and writes of a file move through
        (the disk tier's staging; pinned on accelerators), given back by
        ``free_host_buffer``. Default: ``host_buffer``'s."""
        return self.host_buffer(nbytes)

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        """Give back a buffer made by ``host_buffer`` or ``io_buffer`` (unpin it). Default:
        nothing to do."""

    def release(self, tensor: torch.Tensor) -> None:
        """Free the device memory of ``tensor``'s whole storage, keeping the storage object.

        Every tensor viewing that storage stays a valid Python object with its shape, but
        has no memory until ``regrow``. The caller guarantees that every stream still using
        the memory was announced with ``record_stream`` (protocol rule 2).
        """
        tensor.untyped_storage().resize_(0)

    def regrow(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Give ``tensor``'s storage ``nbytes`` of fresh memory on the current stream."""
        tensor.untyped_storage().resize_(nbytes)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh 1-D device tensor, allocated on the current stream."""
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    # ---------------------------------------------------------------- streams
    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream the caller's (and the optimizer's) work is issued on."""

    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A new side stream for copies, used by nothing but the caller (each call makes
        another): a collective must never queue behind an offload copy on a shared stream."""

    def retire_stream(self, stream: Stream, *, announced: bool) -> None:
        """The engine is done with its side stream ``stream`` (it was closed).

        ``announced``: device memory that outlives the engine still carries a
        ``record_stream`` naming ``stream`` (a storage another owner shares, or states
        offloaded but never released). The allocator records an event on that stream when
        the memory is freed, however much later, so the stream must live on. Default:
        nothing to do."""

    @abc.abstractmethod
    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        """Context manager making ``stream`` current."""

    @abc.abstractmethod
    def wait_stream(self, waiter: Stream, waitee: Stream, *, label: str = "") -> None:
        """Work queued on ``waiter`` from now on starts after all work queued on ``waitee``."""

    @abc.abstractmethod
    def record_event(self, stream: Stream, *, timing: bool = False) -> Event:
        """An event completing when the work queued on ``stream`` so far is done.

        ``timing``: the event also records when that happened, for ``elapsed_ms``.
        """

    def elapsed_ms(self, start: Event, end: Event) -> float | None:
        """Milliseconds between two timing events, or None while ``end`` has not completed
        (or where the device measures no time). Never blocks."""
        return None

    @abc.abstractmethod
    def wait_event(self, stream: Stream, event: Event, *, label: str = "") -> None:
        """Work queued on ``stream`` from now on starts after ``event``."""

    @abc.abstractmethod
    def synchronize_event(self, event: Event, *, label: str = "") -> None:
        """Block the host until ``event`` completed."""

    @abc.abstractmethod
    def record_stream(self, tensor: torch.Tensor, stream: Stream, *, label: str = "") -> None:
        """Tell the allocator that ``tensor``'s memory is used by ``stream``."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` queued on the current stream (non-blocking on accelerators)."""

    def synchronize(self) -> None:
        """Block the host until all work on the device completed."""

    # -------------------------------------------------------------- accounting
    def memory_allocated(self) -> int | None:
        """Bytes the device allocator holds for tensors, or None where unknown."""
        return None

    def pinned_bytes(self) -> int:
        """Bytes of the host buffers made by ``host_buffer`` that are pinned now (the rest of
        what the engines hold is pageable)."""
        return 0

    def memory_free(self) -> int | None:
        """Bytes the device could still give (its driver's figure), or None where unknown:
        what an out-of-memory error reports."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device})"
