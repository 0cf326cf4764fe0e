"""Host memory of the engine: one exactly-sized arena per engine, and a budget shared by engines.

The arena is the only host memory an engine holds for its groups (each group has a slice of
it). It remembers the newest copy into or out of it on each side stream, so that it is
never given back (or replaced) while a copy still uses it (protocol rule 5). The budget
limits what several engines (one offloader's optimizers) hold together, checked before
anything is allocated, against the peak of a change: while a layout is rebuilt the old and
the new arena (or the bytes moved aside to rewrite one in place) are held together.

The arena may be allocated (and pinned, which is slow) ahead of the first offload
(``reserve``, from ``LayoutMixin.reserve_host``); a later layout reuses it when it fits
(``fits``) instead of allocating again.
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

    def fits(self, owner, nbytes: int) -> bool:
        """True if ``owner`` may hold ``nbytes`` (at once) besides what the others hold."""
        return self.limit is None or self._others(owner) + nbytes <= self.limit

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
                "offload_primary_weights=False."
            )
        if others + nbytes > self.limit:
            raise HostMemoryBudgetError(
                f"{name}: offloading needs {nbytes:,} bytes of host memory ({others:,} already "
                f"held by the other optimizers), over host_memory_budget={self.limit:,}. Nothing "
                "was allocated. Raise "
                "host_memory_budget, or offload less: offload_fraction, per_optimizer, or "
                "offload_primary_weights=False."
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

    def synchronize(self) -> None:
        """Block until no copy into or out of the buffer is pending (before host writes)."""
        self._synchronize()

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
