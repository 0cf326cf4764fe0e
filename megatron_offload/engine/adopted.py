"""Tensors that reach the host before the engine tracks them: states made by a chunked step
(copied out at once) and states a checkpoint load made on the host.

The engine adopts them as already offloaded: their device memory is released, their bytes
wait in a host buffer until the next layout moves them into the arena (``HostArena.lay_out``),
and the buffer then goes back, once. ``Adopted`` holds them meanwhile and does the copies
that bring a tensor to the host (``stage_out``, ``from_host``) or back (``restore``).
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..device import Device
from ..errors import out_of_memory
from .host import HostBudget, HostBuffers
from .labels import (
    D2H_AFTER_WRITERS,
    D2H_RECORD_STREAM,
    HOST_FREE_AFTER_COPIES,
    HOST_READ_AFTER_D2H,
)
from .pieces import aligned_size, typed_view

#: A staging that fails comes after the update of the states it stages (a chunk of a step).
_PART_WAY = (
    "The states it made are whole (attach's cycle offloads them as after any step); the "
    "update that made them was applied, as when an update raises part-way: whether to step "
    "again is the loop's decision."
)


class Adopted:
    """The engine's adopted tensors: ``id(tensor) -> (tensor, host, event, buffer)``.

    Args:
        device: the engine's device.
        budget: the allocator the host buffers come from and go back to (``HostBudget``).
        changed: told whenever the adopted tensors change (the engine looks again).
        side: ``side("d2h")`` is the engine's D2H stream.
    """

    def __init__(self, device: Device, budget: HostBudget, *, changed=lambda: None, side=None):
        self.device = device
        self.budget = budget
        self._changed = changed
        self._side = side
        self._items: dict[int, tuple[torch.Tensor, torch.Tensor, object, torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes of the host buffers the adopted tensors live in (in host memory)."""
        return sum(self._buffers_by_id().values()) - self.disk_nbytes

    @property
    def disk_nbytes(self) -> int:
        """Bytes of those buffers the budget put in the disk tier instead."""
        spilled = {id(file.buffer) for file in self.budget.files()}
        return sum(n for key, n in self._buffers_by_id().items() if key in spilled)

    def _buffers_by_id(self) -> dict[int, int]:
        return {id(b): b.numel() for *_, b in self._items.values()}

    def add(self, items: Iterable[tuple]) -> None:
        """``(tensor, host, event)`` or ``(tensor, host, event, buffer)``: ``host`` holds the
        tensor's bytes once ``event`` (the copy that filled it, or None) completed, and the
        tensor's device memory is released. ``buffer`` is the host buffer of this device that
        ``host`` views (shared by several items: one staging buffer); without it ``host`` is
        that buffer."""
        for item in items:
            tensor, host, event = item[:3]
            buffer = item[3] if len(item) > 3 else host
            self._items[id(tensor)] = (tensor, host, event, buffer)
        self._changed()

    def copies(self) -> dict[int, tuple[torch.Tensor, object]]:
        """``{id(tensor): (its bytes on the host, typed like it; the copy's event)}``."""
        return {
            key: (typed_view(host, tensor), event)
            for key, (tensor, host, event, _) in self._items.items()
        }

    def disown(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Forget adopted tensors the caller dropped (the states a failed step had created):
        their host copies are not kept, and a buffer no other one uses goes back. True if
        any was adopted."""
        ids = {id(tensor) for tensor in tensors}
        dropped = [self._items.pop(key) for key in [k for k in self._items if k in ids]]
        for _, _, event, _ in dropped:
            if event is not None:
                # Rule 5: the copy filling the buffer is done before the buffer goes back.
                self.device.synchronize_event(event, label=HOST_FREE_AFTER_COPIES)
        for buffer in {id(item[3]): item[3] for item in dropped}.values():
            self._free_if_unused(buffer)
        if dropped:
            self._changed()
        return bool(dropped)

    def restore(self, ids: set[int]) -> None:
        """Copy the adopted tensors among ``ids`` back into device memory of their own (on
        the current stream, which regrows and then uses them: rule 7)."""
        device = self.device
        for key in [k for k in self._items if k in ids]:
            tensor, host, event, buffer = self._items[key]
            if event is not None:
                device.synchronize_event(event, label=HOST_READ_AFTER_D2H)
            # Adopted until its bytes are back: a regrowth that fails leaves it as it was.
            device.regrow(tensor, tensor.numel() * tensor.element_size())
            current = device.current_stream()
            with device.use_stream(current):
                device.copy(tensor, typed_view(host, tensor))
            del self._items[key]
            # Rule 5: the buffer goes back only once the copy reading it is done.
            device.synchronize_event(device.record_event(current), label=HOST_FREE_AFTER_COPIES)
            self._free_if_unused(buffer)

    def laid_out(self) -> None:
        """The arena holds their bytes now (every copy into the buffers was waited for, rule
        5): each buffer goes back once."""
        for buffer in {id(b): b for *_, b in self._items.values()}.values():
            self.budget.free(self.device, buffer)
        self._items = {}

    def _free_if_unused(self, buffer: torch.Tensor) -> None:
        if not any(other is buffer for *_, other in self._items.values()):
            self.budget.free(self.device, buffer)

    # ---------------------------------------------------------------- copies in
    def stage_out(
        self, tensors: list[torch.Tensor], staging: HostBuffers, *, hint: int = 0
    ) -> None:
        """Copy ``tensors`` (new states just written on the current stream; ``stageable`` by
        the engine) into ``staging`` on the engine's D2H stream, release their device memory
        and adopt them. If a copy raises, the tensors stay on the device (the caller's) and
        nothing is adopted. ``hint``: bytes a new staging buffer should hold at least."""
        device = self.device
        side = self._side("d2h")
        current = device.current_stream()
        # Rule 1: the D2H copies what the current stream just wrote.
        device.wait_stream(side, current, label=D2H_AFTER_WRITERS)
        places, event = [], None
        try:
            with device.use_stream(side):
                try:
                    for tensor in tensors:
                        nbytes = aligned_size(tensor.numel() * tensor.element_size())
                        places.append(staging.take(nbytes, hint=hint))
                        device.copy(typed_view(places[-1][0], tensor), tensor)
                finally:
                    # Even when a copy raised: the copies queued before it still run.
                    event = device.record_event(side)
            self._write_back_spilled(places, event)
        except BaseException as error:
            # Staging memory goes back only once the copies into it ran (rule 5), which also
            # orders those reads of the states before whatever writes them next.
            if event is not None:
                device.synchronize_event(event, label=HOST_FREE_AFTER_COPIES)
            needed = sum(aligned_size(t.numel() * t.element_size()) for t in tensors)
            raise out_of_memory(error, device, "staging new states to the host", needed, _PART_WAY)
        for tensor in tensors:
            # Rule 2: the D2H still reads this memory; the allocator must know before it goes.
            device.record_stream(tensor, side, label=D2H_RECORD_STREAM)
            device.release(tensor)
        staging.hand_over(buffer for _, buffer in places)
        self.add((tensor, view, event, buffer) for tensor, (view, buffer) in zip(tensors, places))

    def _write_back_spilled(self, places, event) -> None:
        """Staging the budget put in the disk tier (a first chunked step's, over the host
        budget): the bytes just copied into it are written back and dropped now, chunk by
        chunk, so that the step holds about one chunk of its new states in the page cache
        (host memory), not all of them. Raises ``DiskTierError`` before anything is released
        or adopted."""
        files = {id(file.buffer): file for file in self.budget.files()}
        spilled = {id(buffer): files[id(buffer)] for _, buffer in places if id(buffer) in files}
        if not spilled:
            return
        # The host writes the pages back: the copies into them must be complete.
        self.device.synchronize_event(event, label=HOST_READ_AFTER_D2H)
        for file in spilled.values():
            file.write_back(then="The new states stay on the device; nothing was staged.")

    def from_host(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Adopt the bytes of the CPU tensors ``values`` (states a load made on the host):
        one host buffer for all of them; returns, for each, the released device tensor the
        optimizer will use (allocated and released one at a time: never more than the
        largest of them on the device)."""
        device = self.device
        sizes = [value.numel() * value.element_size() for value in values]
        total = sum(aligned_size(n) for n in sizes)
        tensors, items, offset, buffer = [], [], 0, None
        try:  # all or nothing: nothing is adopted until every tensor is made
            buffer = self.budget.allocate(device, total, "adopting the states a load made")
            for value, nbytes in zip(values, sizes):
                host = buffer[offset : offset + nbytes]
                host.copy_(value.contiguous().view(-1).view(torch.uint8))
                offset += aligned_size(nbytes)  # each one aligned for its dtype
                tensor = device.empty(value.numel(), value.dtype).view(value.shape)
                device.release(tensor)
                items.append((tensor, host, None, buffer))
                tensors.append(tensor)
        except BaseException as error:
            if buffer is not None:
                self.budget.free(device, buffer)
            # The traceback keeps this frame: nothing in it may keep the buffer mapped.
            buffer = host = None
            items.clear()
            tensors.clear()
            raise out_of_memory(error, device, "adopting the states a load made", total)
        self.add(items)
        return tensors
