"""The access rules of the checked device: whether one access of an issued copy is ordered
after everything that could conflict with it (rules 1, 3, 4, 5 and 7 of the copy-ordering
rules), which violation it is when not, and the access history each memory keeps.

A mixin of ``CheckedDevice`` (``checked_device.py``), which holds the streams, their vector
clocks and the memory records these methods read.
"""

from __future__ import annotations

from .checked_records import (
    DEVICE_RACE,
    HOST_FREED_IN_USE,
    HOST_OVERWRITE,
    OVERWRITE_WHILE_READ,
    RELEASED_ACCESS,
    UNORDERED_DEVICE_ACCESS,
    UNORDERED_HOST_READ,
    USE_BEFORE_COPY,
    WRITE_BEFORE_ALLOCATION,
    _Access,
    _Memory,
    _Ref,
    _Stream,
)


class AccessRules:
    """Checks and records the accesses of copies (see the module docstring)."""

    def _check_access(self, stream: _Stream, seq: int, ref: _Ref, *, write: bool) -> bool:
        """Check one access of an issued copy; False if the copy must not be issued."""
        mem = ref.mem
        verb = "writes" if write else "reads"
        what = mem.describe()
        if ref.end > ref.start and ref.resolve() is None:
            self._violation(3, RELEASED_ACCESS, f"a copy on {stream.name} {verb} released {what}")
            return False
        if mem.host and mem.freed:
            self._violation(
                5,
                HOST_FREED_IN_USE,
                f"a copy on {stream.name} {verb} a host buffer already given back",
            )
        if not mem.host and not stream.compute:
            for compute in self._computes:
                if compute is (mem.allocated_on or self._compute):
                    needed = compute.pos  # its kernels are invisible: anything so far
                else:  # another compute stream: its uses the test marked (``note_compute``)
                    needed = mem.compute_uses.get(compute, -1)
                seen = stream.after.get(compute, -1)
                if seen >= needed:
                    continue
                if write and compute is mem.allocated_on and mem.allocated_at > seen:
                    self._violation(
                        7,
                        WRITE_BEFORE_ALLOCATION,
                        f"a copy on {stream.name} writes device memory allocated on {compute.name} "
                        f"after {stream.name} last waited for {compute.name}: the block's earlier "
                        "users may still run",
                    )
                else:
                    self._violation(
                        1,
                        UNORDERED_DEVICE_ACCESS,
                        f"a copy on {stream.name} {verb} device memory without waiting for "
                        f"{compute.name}'s latest work, which may still be writing it",
                    )
                return True
        for acc in mem.accesses:
            if acc.stream is stream or not (write or acc.write):
                continue
            if acc.end <= ref.start or ref.end <= acc.start:
                continue
            if self._ordered(stream, acc.stream, acc.seq):
                continue
            rule, kind = self._classify(mem, stream, write, acc.write)
            self._violation(
                rule,
                kind,
                f"a copy on {stream.name} {verb} {what} that a copy on {acc.stream.name} "
                f"{'writes' if acc.write else 'reads'}, and the two are not ordered",
            )
            break
        return True

    def _classify(self, mem: _Memory, stream: _Stream, write: bool, other_writes: bool):
        if mem.host:
            return (5, HOST_OVERWRITE) if write else (5, UNORDERED_HOST_READ)
        if stream.compute and not write:
            return 4, USE_BEFORE_COPY
        if stream.compute and not other_writes:
            return 2, OVERWRITE_WHILE_READ
        return 3, DEVICE_RACE

    def _note_access(self, stream: _Stream, seq: int, ref: _Ref, *, write: bool) -> None:
        mem = ref.mem
        if ref.end <= ref.start:
            return
        kept = []
        for acc in mem.accesses:
            if self._host.get(acc.stream, 0) >= acc.seq:
                continue  # complete as far as the host knows: nothing issued later can race it
            covered = ref.start <= acc.start and acc.end <= ref.end
            if acc.stream is stream and covered and (write or not acc.write):
                continue  # anything ordered after the new access is ordered after this one
            kept.append(acc)
        kept.append(_Access(stream, seq, ref.start, ref.end, write))
        mem.accesses = kept
