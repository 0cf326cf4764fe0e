"""The calls tests make on the checked device: ``note_compute`` (the caller's kernels),
``check_readable``, ``check`` (the final report) and the queries ``device_bytes``,
``pending`` and ``held_bytes``.

A mixin of ``CheckedDevice`` (``checked_device.py``), which holds the streams, their vector
clocks and the memory records these methods read.
"""

from __future__ import annotations

import torch

from .checked_records import (
    NEVER_ORDERED,
    OVERWRITE_WHILE_READ,
    RELEASED_ACCESS,
    UNORDERED_HOST_READ,
    USE_BEFORE_COPY,
    ProtocolViolation,
    Violation,
    _Ref,
)


class DeviceChecks:
    """Checks and queries for tests (see the module docstring)."""

    def note_compute(self, *, reads: bool = True, writes: bool = True) -> None:
        """The caller's kernels (an optimizer step) now read and/or write device memory."""
        self._tick()
        current = self._current_compute()
        for mem in list(self._memories.values()):
            if mem.host or not mem.alive():
                continue
            mem.compute_uses[current] = current.pos
            for acc in mem.accesses:
                if acc.stream is current or self._ordered(current, acc.stream, acc.seq):
                    continue
                if acc.write and (reads or writes):
                    self._violation(
                        4,
                        USE_BEFORE_COPY,
                        f"the compute stream uses device memory that a copy on {acc.stream.name} "
                        "writes, without waiting for that copy",
                    )
                    break
                if not acc.write and writes:
                    self._violation(
                        2,
                        OVERWRITE_WHILE_READ,
                        f"the compute stream overwrites device memory that a copy on "
                        f"{acc.stream.name} still reads, without waiting for that copy",
                    )
                    break

    def check_readable(self, tensor: torch.Tensor, *, label: str = "") -> None:
        """Report if ``tensor`` may not be read now: by the host for a host buffer (rule 5),
        by the compute stream for device memory (rules 3 and 4)."""
        mem = self._memory(tensor)
        ref = _Ref(mem, tensor)
        if ref.end > ref.start and ref.resolve() is None:
            self._violation(3, RELEASED_ACCESS, "reading memory that has been released", label)
            return
        reader = None if mem.host else self._current_compute()
        for acc in mem.accesses:
            if not acc.write or acc.end <= ref.start or ref.end <= acc.start:
                continue
            if acc.stream is reader or self._ordered(reader, acc.stream, acc.seq):
                continue
            if mem.host:
                self._violation(
                    5,
                    UNORDERED_HOST_READ,
                    f"the host reads a host buffer written by a copy on {acc.stream.name} "
                    "that it has not synchronized with",
                    label,
                )
            else:
                self._violation(
                    4,
                    USE_BEFORE_COPY,
                    f"the compute stream reads device memory written by a copy on "
                    f"{acc.stream.name} that it has not waited for",
                    label,
                )
            return

    def check(self, *, raise_on_violation: bool = True) -> list[Violation]:
        """Report queued work nothing ever ordered, run all remaining work, and raise
        ``ProtocolViolation`` if any violation was recorded (or return them)."""
        for op in list(self._pending()):
            if any(s.after.get(op.stream, 0) >= op.seq for s in self._streams()) or self._ordered(
                None, op.stream, op.seq
            ):
                continue
            host = op.dst.mem.host
            self._violation(
                5 if host else 4,
                NEVER_ORDERED,
                f"a copy on {op.stream.name} into {op.dst.mem.describe()} was never waited for "
                "by any stream or the host",
                record_only=True,
            )
        for stream in self._sides:
            self._run_to(stream, stream.pos)
        if raise_on_violation and self.violations:
            raise ProtocolViolation(self.violations[0], more=len(self.violations) - 1)
        return list(self.violations)

    def device_bytes(self) -> int:
        """Bytes of live device memory this device has seen (allocated, regrown or copied)."""
        seen = {}
        for mem in self._memories.values():
            storage = mem.storage()
            if not mem.host and storage is not None:
                seen[storage._cdata] = storage.nbytes()
        return sum(seen.values())

    def pending(self) -> int:
        """Number of queued copies that have not run yet."""
        return sum(len(s.queue) for s in self._sides)

    @property
    def held_bytes(self) -> int:
        """Bytes of released memory kept for queued copies (the allocator's deferred frees)."""
        return sum(
            ref.ghost.numel() * ref.ghost.element_size()
            for op in self._pending()
            for ref in (op.dst, op.src)
            if ref.ghost is not None
        )
