"""``ModelMemory``: the device memory of a model's parameters and gradients, given up while
the offloader sleeps and regained when it wakes.

Each storage is either dropped (its bytes are not needed: gradients, which are zeroed before
the next backward, and parameters made again from the masters) or copied to the host first.
The host bytes of the copied storages are carved, in order, from ``HostBuffers`` (the one
host allocator: counted against ``host_memory_budget`` and in ``host_bytes``), allocated by
``prepare`` before anything on the device changes and kept from one sleep to the next while
the same storages are copied. All copies run on the caller's stream, which is the stream
that uses the parameters, so nothing else needs ordering: the D2H runs after the work that
last wrote the storage, the memory is given back behind it on the same stream, and a wake's
H2D is queued behind the regrowth.

All or nothing: ``prepare`` allocates one host buffer or nothing; ``regrow`` gives back what
it regrew when a later storage cannot be regrown, and ``unregrow`` undoes a whole regrow
when something after it fails (the host copies are still there).
"""

from __future__ import annotations

import dataclasses

import torch

from ..device import Device
from ..errors import out_of_memory
from .host import HostBudget, HostBuffers
from .labels import HOST_READ_AFTER_D2H
from .pieces import aligned_size


@dataclasses.dataclass
class _Held:
    tensor: torch.Tensor  # views the whole storage
    nbytes: int
    copied: bool
    zeroed: bool
    host: torch.Tensor | None = None  # the host copy, for a copied storage


class ModelMemory:
    """Storages given up together (``release``) and regained together (``regrow``)."""

    def __init__(self, device: Device, *, budget: HostBudget | None = None, name: str) -> None:
        self.device = device
        self.name = name
        self._held: list[_Held] = []
        self._regrown: list[_Held] = []  # the last regrow, until something else changes
        self._host = HostBuffers(device, budget=budget, name=name)
        self._carved: tuple = ()  # (tensor, bytes) the host buffer is carved for
        self._hosts: list[torch.Tensor] = []
        #: Bytes of the last release: copied to the host, and dropped without a copy.
        self.copied_bytes = 0
        self.dropped_bytes = 0

    @property
    def released(self) -> bool:
        return bool(self._held)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers held for copied storages (in host memory)."""
        return self._host.nbytes - self.disk_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of those buffers the budget put in the disk tier instead."""
        return sum(file.nbytes for file in self._host.files())

    @staticmethod
    def host_need(entries) -> int:
        """Host bytes ``prepare(entries)`` holds: the copied storages, each aligned."""
        return sum(aligned_size(t.untyped_storage().nbytes()) for t, copy, _ in entries if copy)

    def prepare(self, entries, *, to_disk: bool | None = None) -> None:
        """Hold host memory for every copied storage of ``entries`` (``(tensor, copy, zero)``),
        reusing the buffer when the same storages are copied again. ``to_disk``: in the disk
        tier whatever the budget holds (None: as the last call asked). Changes nothing on the
        device; refused (``HostMemoryBudgetError``) or failing, it holds nothing new."""
        moved = to_disk is not None and to_disk != self._host.to_disk
        if moved and self._host.count:
            self.device.synchronize()  # the last wake's copies from it are done
            self._host.free()
            self._carved, self._hosts = (), []
        if to_disk is not None:
            self._host.to_disk = to_disk
        # The same tensor objects (a buffer's ``param_data``, a frozen parameter) come back at
        # every sleep; a storage object is made anew at every ``untyped_storage()`` call.
        carved = tuple(
            (tensor, tensor.untyped_storage().nbytes()) for tensor, copy, _ in entries if copy
        )
        same = len(carved) == len(self._carved) and all(
            a[0] is b[0] and a[1] == b[1] for a, b in zip(carved, self._carved)
        )
        if same:
            return
        if self._host.count:
            self.device.synchronize()  # the last wake's copies from it are done
            self._host.free()
        self._carved, self._hosts = (), []
        self._host.reserve(self.host_need(entries))
        self._hosts = [self._host.take(aligned_size(n))[0][:n] for _, n in carved]
        self._carved = carved

    def release(self, entries) -> None:
        """Give up the memory of every ``(tensor, copy, zero)`` (``prepare`` ran for them):
        ``copy`` copies the storage to the host first; ``zero`` zeroes it when regrown."""
        self.prepare(entries)
        current = self.device.current_stream()
        held = []
        hosts = iter(self._hosts)
        for tensor, copy, zero in entries:
            storage = tensor.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            entry = _Held(whole, storage.nbytes(), copy, zero)
            if copy:
                entry.host = next(hosts)
                self.device.copy(entry.host, whole)
            held.append(entry)
        if any(entry.copied for entry in held):
            # The host copies are the only ones once the memory is given back; a sleeping
            # process hands its memory to others (an inference engine), so the copies are
            # finished before this returns rather than left to the allocator's stream order.
            self.device.synchronize_event(
                self.device.record_event(current), label=HOST_READ_AFTER_D2H
            )
        for file in self._host.files():
            # Copies the budget could not hold are in the disk tier: on the disk (a write
            # error raises here, nothing given up yet) and out of host memory.
            file.write_back(
                then="The storages were not given up; the same call works once the disk can "
                "write (sleep() again)."
            )
        for entry in held:
            self.device.release(entry.tensor)
        self._held, self._regrown = held, []
        self.copied_bytes = sum(entry.nbytes for entry in held if entry.copied)
        self.dropped_bytes = sum(entry.nbytes for entry in held if not entry.copied)

    def regrow(self) -> None:
        """Regrow every storage on the current stream, all or nothing (a ``DeviceMemoryError``
        with nothing regrown when one cannot be); then copied ones get their bytes back and
        dropped ones are zeroed where asked (else left for their owner to write)."""
        held = self._held
        files = self._host.files()
        for entry in held:
            for file in files:
                if entry.copied and file.owns(entry.host):
                    file.check_readable(entry.host)  # an I/O error raises here, not a SIGBUS
        grown = []
        try:
            for entry in held:
                self.device.regrow(entry.tensor, entry.nbytes)
                grown.append(entry)
        except BaseException as error:
            for entry in grown:
                self.device.release(entry.tensor)
            raise out_of_memory(error, self.device, self.name, sum(e.nbytes for e in held))
        for entry in held:
            if entry.copied:
                self.device.copy(entry.tensor, entry.host)
            elif entry.zeroed:
                entry.tensor.zero_()
        for file in files:
            file.drop()  # copied from (pageable: read when the copy call returns)
        self._held, self._regrown = [], held

    def unregrow(self) -> None:
        """Undo the last ``regrow`` (something after it failed): the storages are given up
        again, without a copy (the host copies are still there)."""
        if self._regrown and not self._held:
            for entry in self._regrown:
                self.device.release(entry.tensor)
            self._held, self._regrown = self._regrown, []

    def close(self) -> None:
        """Give back the host buffer (after every copy that used it finished)."""
        if self._held:
            self.regrow()
        if self._host.count:
            self.device.synchronize()
        self._host.free()
        self._carved, self._hosts, self._regrown = (), [], []
