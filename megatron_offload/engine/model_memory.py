"""``ModelMemory``: the device memory of a model's parameters and gradients, given up while
the offloader sleeps and regained when it wakes.

Each storage is either dropped (its bytes are not needed: gradients, which are zeroed before
the next backward, and parameters made again from the masters) or copied to a host buffer of
its own first (kept from one sleep to the next while the storage is copied, counted in
``host_bytes``). All copies run on
the caller's stream, which is the stream that uses the parameters, so nothing else needs
ordering: the D2H runs after the work that last wrote the storage, the memory is given back
behind it on the same stream, and a wake's H2D is queued behind the regrowth.
"""

from __future__ import annotations

import dataclasses

import torch

from ..device import Device
from .labels import HOST_READ_AFTER_D2H


@dataclasses.dataclass
class _Held:
    tensor: torch.Tensor  # views the whole storage
    nbytes: int
    copied: bool
    zeroed: bool
    host: torch.Tensor | None = None  # the host buffer, for a copied storage


class ModelMemory:
    """Storages given up together (``release``) and regained together (``regrow``)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._held: list[_Held] = []
        # id(tensor) -> (tensor, its host buffer), kept from one release to the next
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: Bytes of the last release: copied to the host, and dropped without a copy.
        self.copied_bytes = 0
        self.dropped_bytes = 0

    @property
    def released(self) -> bool:
        return bool(self._held)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers held for copied storages."""
        return sum(buffer.numel() for _, buffer in self._buffers.values())

    def release(self, entries) -> None:
        """Give up the memory of every ``(tensor, copy, zero)``: ``copy`` copies the storage
        to the host first; ``zero`` zeroes it when it is regrown."""
        current = self.device.current_stream()
        held = []
        for tensor, copy, zero in entries:
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            entry = _Held(whole, nbytes, copy, zero)
            if copy:
                kept = self._buffers.get(id(tensor))
                if kept is None or kept[0] is not tensor or kept[1].numel() != nbytes:
                    if kept is not None and kept[0] is tensor:
                        self.device.free_host_buffer(kept[1])  # resized: one buffer each
                    kept = self._buffers[id(tensor)] = (tensor, self.device.host_buffer(nbytes))
                entry.host = kept[1]
                self.device.copy(entry.host, whole)
            held.append(entry)
        if any(entry.copied for entry in held):
            # The host copies are the only ones once the memory is given back; a sleeping
            # process hands its memory to others (an inference engine), so the copies are
            # finished before this returns rather than left to the allocator's stream order.
            self.device.synchronize_event(
                self.device.record_event(current), label=HOST_READ_AFTER_D2H
            )
        for entry in held:
            self.device.release(entry.tensor)
        self._held = held
        copied = {id(tensor) for tensor, copy, _ in entries if copy}
        unused = [key for key in self._buffers if key not in copied]
        if unused:  # storages rebuilt this time: their host buffers are not held on
            self.device.synchronize()  # the last wake's copies from them are done
            for key in unused:
                self.device.free_host_buffer(self._buffers.pop(key)[1])
        self.copied_bytes = sum(entry.nbytes for entry in held if entry.copied)
        self.dropped_bytes = sum(entry.nbytes for entry in held if not entry.copied)

    def regrow(self) -> None:
        """Regrow every storage on the current stream: copied ones get their bytes back,
        dropped ones are zeroed where asked (else left for their owner to write)."""
        held, self._held = self._held, []
        for entry in held:
            self.device.regrow(entry.tensor, entry.nbytes)
            if entry.copied:
                self.device.copy(entry.tensor, entry.host)
            elif entry.zeroed:
                entry.tensor.zero_()

    def close(self) -> None:
        """Give back the host buffers (after every copy that used them finished)."""
        if self._held:
            self.regrow()
        if self._buffers:
            self.device.synchronize()
        for _, buffer in self._buffers.values():
            self.device.free_host_buffer(buffer)
        self._buffers = {}
