"""Host memory of the engine: one exactly-sized arena per engine, a budget shared by engines,
and the one allocator of every other host buffer (``HostBuffers``).

The arena is the only host memory an engine holds for its pieces (each piece has a slice of
it). It remembers the newest copy into or out of it on each side stream, so that it is
never given back (or replaced) while a copy still uses it (protocol rule 5). The budget
limits what several engines (one offloader's optimizers) hold together, checked before
anything is allocated, against the peak of a change: while a layout is rebuilt the old and
the new arena (or the bytes moved aside to rewrite one in place) are held together.

The arena may be allocated (and pinned, which is slow) ahead of the first offload
(``reserve``, from ``OffloadEngine.reserve_host``); a later layout reuses it when it fits
(``fits``) instead of allocating again.

Host memory beyond the arena (the chunked update's first-step staging and its undo journal,
the states a load put on the host) is carved from ``HostBuffers``: few buffers, each carved in
order, never one per tensor, since every host buffer is pinned on an accelerator and pinning
costs a system call and page-table work per buffer.
"""

from __future__ import annotations

import torch

from ..device import Device
from .labels import HOST_FREE_AFTER_COPIES

#: A layout reuses the arena if the arena is at most 1/REUSE_SLACK larger than it needs.
REUSE_SLACK = 8


from ..errors import HostMemoryBudgetError  # noqa: E402,F401 - raised here; every exception lives in errors.py


class HostBudget:
    """A limit on the host memory held by several engines (one offloader's optimizers)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._held: dict[int, int] = {}

    def _others(self, owner) -> int:
        return sum(n for key, n in self._held.items() if key != id(owner))

    def check(self, owner, nbytes: int, name: str, *, peak: int | None = None) -> None:
        """Refuse if ``owner`` cannot hold ``nbytes``, or ``peak`` bytes for a moment (a
        layout change holding old and new host copies together), besides the others."""
        if self.limit is None:
            return
        others = self._others(owner)
        if peak is not None and peak > nbytes and others + peak > self.limit:
            raise HostMemoryBudgetError(
                f"{name}: laying the states out again holds {peak:,} bytes of host memory at once "
                f"(the new layout needs {nbytes:,}; the rest are the previous host copies while "
                f"their bytes move), {others:,} already held by the other optimizers, over "
                f"host_memory_budget={self.limit:,}. Nothing was freed or allocated. Raise "
                "host_memory_budget, or offload less: offload_fraction, per_optimizer, or "
                "offload_master_weights=False."
            )
        if others + nbytes > self.limit:
            raise HostMemoryBudgetError(
                f"{name}: offloading needs {nbytes:,} bytes of host memory ({others:,} already "
                f"held by the other optimizers), over host_memory_budget={self.limit:,}. Nothing "
                "was allocated. Raise "
                "host_memory_budget, or offload less: offload_fraction, per_optimizer, or "
                "offload_master_weights=False."
            )

    def hold(self, owner, nbytes: int) -> None:
        self._held[id(owner)] = nbytes

    def release(self, owner) -> None:
        self._held.pop(id(owner), None)


class HostArena:
    """The engine's one host buffer, and the newest copy using it on each side stream."""

    def __init__(self, device: Device, budget: HostBudget | None = None) -> None:
        self.device = device
        self.budget = budget
        self.buffer: torch.Tensor | None = None
        self.retired: torch.Tensor | None = None  # the previous buffer, while its bytes move
        # Side streams run in order, so the newest event of each covers every earlier copy.
        self.last_d2h = None
        self.last_h2d = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def check(self, nbytes: int, name: str, *, peak: int | None = None) -> None:
        if self.budget is not None:
            self.budget.check(self, nbytes, name, peak=peak)

    def fits(self, nbytes: int) -> bool:
        """True if a layout of ``nbytes`` should reuse the current buffer: it is large
        enough, and not so much larger that keeping it would hold memory for nothing."""
        return self.buffer is not None and nbytes <= self.nbytes <= nbytes + nbytes // REUSE_SLACK

    def reserve(self, nbytes: int, name: str) -> bool:
        """Allocate a buffer of ``nbytes`` now, for a layout to come (only when the arena has
        none); True if one was allocated. A budget that cannot hold it is refused here,
        before anything is allocated (``HostMemoryBudgetError``), not at the first offload,
        which runs inside a training step."""
        if self.buffer is not None or nbytes <= 0:
            return False
        self.check(nbytes, name)
        self.replace(nbytes)
        return True

    def lay_out(self, pieces, carried, sources: dict, *, name: str, staged: int = 0) -> None:
        """Give every piece its range of the arena, in order; the pieces in ``carried`` keep
        their host bytes, found in ``sources`` (``{id(tensor): host tensor}``: the old arena
        or buffers handed over; their copies are complete).

        The arena is reused when the layout fits it (the carried bytes set aside first: their
        new places may overlap their old ones); otherwise a new one is allocated while the old
        one still holds the bytes to carry. Either way the peak (plus ``staged`` bytes held in
        other buffers) is checked against the budget before anything is freed or allocated.
        """
        need = sum(g.nbytes for g in pieces)
        reuse = self.fits(need)
        aside = sum(g.nbytes for g in carried) if reuse else need
        self.check(need, name, peak=self.nbytes + aside + staged)
        if reuse:
            # Rule 5: the host rewrites the arena below, while a copy of the old layout may
            # still read or write it.
            self._synchronize()
            arena = self.buffer
            base = arena.untyped_storage().data_ptr()
            for piece in carried:
                for tensor in piece.tensors:
                    host = sources[id(tensor)]
                    if host.untyped_storage().data_ptr() == base:
                        sources[id(tensor)] = host.clone()
        else:
            arena = self.replace(need)
        offset = 0
        for piece in pieces:
            piece.host = arena[offset : offset + piece.nbytes].view(piece.dtype)
            offset += piece.nbytes
        for piece in carried:
            for tensor, host in piece.host_slices():
                host.copy_(sources[id(tensor)])
        self.free_retired()

    def replace(self, nbytes: int) -> torch.Tensor:
        """A new buffer of ``nbytes``; the old one stays readable until ``free_retired``."""
        self.free_retired()
        self.retired, self.buffer = self.buffer, self.device.host_buffer(nbytes)
        if self.budget is not None:
            self.budget.hold(self, nbytes)
        return self.buffer

    def free_retired(self) -> None:
        """Give back the buffer ``replace`` retired."""
        if self.retired is None:
            return
        self._synchronize()
        self.device.free_host_buffer(self.retired)
        self.retired = None

    def _synchronize(self) -> None:
        # Rule 5: copies into or out of the arena may still be queued even when the device
        # streams are ordered; the host must see them finish before the memory goes.
        for event in (self.last_d2h, self.last_h2d):
            if event is not None:
                self.device.synchronize_event(event, label=HOST_FREE_AFTER_COPIES)
        self.last_d2h = self.last_h2d = None

    def free(self) -> None:
        self.free_retired()
        if self.buffer is None:
            return
        self._synchronize()
        self.device.free_host_buffer(self.buffer)
        self.buffer = None
        if self.budget is not None:
            self.budget.release(self)


class HostBuffers:
    """Host buffers of one device, carved in order: ``take`` hands out the next bytes of the
    current buffer, and allocates a new buffer only when they do not fit, at least as large
    as all before it together (or ``hint``), so the count grows with the logarithm of what a
    misestimate costs, not with the number of tensors.

    Args:
        device: whose ``host_buffer`` allocates (pinned on accelerators).
        budget: the ``HostBudget`` the buffers count against (checked before each allocation).
        name: used in a budget refusal.
    """

    def __init__(self, device: Device, *, budget: HostBudget | None = None, name: str = "") -> None:
        self.device = device
        self.budget = budget
        self.name = name
        self._buffers: list[torch.Tensor] = []
        self._index = 0  # the buffer being carved
        self._used = 0  # bytes used of it
        self._handed: set[int] = set()  # ids of buffers someone else gives back
        self._taken = 0  # bytes handed out since the last rewind

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held."""
        return sum(buffer.numel() for buffer in self._buffers)

    @property
    def count(self) -> int:
        """How many buffers are held."""
        return len(self._buffers)

    @property
    def carved(self) -> int:
        """Bytes handed out since the last ``rewind``."""
        return self._taken

    def reserve(self, nbytes: int) -> None:
        """Hold one buffer of ``nbytes`` now, if none is held."""
        if not self._buffers and nbytes > 0:
            self._allocate(nbytes)

    def take(self, nbytes: int, *, hint: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(view, buffer)``: ``nbytes`` of host memory (a multiple of 16 keeps the next one
        aligned for any dtype) and the buffer they are carved from."""
        while self._index < len(self._buffers):
            buffer = self._buffers[self._index]
            if self._used + nbytes <= buffer.numel():
                view = buffer[self._used : self._used + nbytes]
                self._used += nbytes
                self._taken += nbytes
                return view, buffer
            # The buffer left behind stays: what was carved from it is still in use.
            self._index += 1
            self._used = 0
        self._allocate(max(nbytes, hint, self.nbytes))
        return self.take(nbytes)

    def rewind(self, *, merge_to: int = 0) -> None:
        """Carve again from the first buffer (what was taken is no longer needed). With
        several buffers held and ``merge_to`` bytes asked, they become one of that size (the
        caller has waited for every copy into them)."""
        if len(self._buffers) > 1 and merge_to:
            self.free()
            self._allocate(merge_to)
        self._index = self._used = self._taken = 0

    def hand_over(self, buffers) -> None:
        """Someone else gives ``buffers`` back from now on (the engine adopted states in them);
        what is left of them is still carved."""
        self._handed.update(id(buffer) for buffer in buffers)

    def free(self) -> None:
        """Give back every buffer not handed over (the caller has waited for every copy into
        them)."""
        for buffer in self._buffers:
            if id(buffer) not in self._handed:
                self.device.free_host_buffer(buffer)
        self._buffers = []
        self._handed = set()
        self._index = self._used = self._taken = 0
        if self.budget is not None:
            self.budget.release(self)

    def _allocate(self, nbytes: int) -> None:
        if self.budget is not None:
            self.budget.check(self, self.nbytes + nbytes, self.name)
        self._buffers.append(self.device.host_buffer(nbytes))
        self._hold()

    def _hold(self) -> None:
        if self.budget is not None:
            self.budget.hold(self, self.nbytes)
