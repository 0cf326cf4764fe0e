"""The engine's figures: what the last offload and reload copied, and how long the copies
took on the device.

Host time spent *issuing* copies (``offload_seconds``, ``reload_seconds``) says nothing about
the transfers on an accelerator: a non-blocking copy returns at once. The transfer times are
measured on the device instead, with timing events on the side streams around each
direction's copies, and the time the compute stream stalled for a copy-back ("exposed")
with timing events on that stream around ``wait``. Those events complete long after the
calls that recorded them, so they are read lazily: ``CopyTimes.read`` (at ``stats()``, i.e.
at log time) takes the newest measurement whose end event has completed and never waits
for one that has not; the step never pays for a measurement.

On a device whose copies are synchronous (the CPU) the timing events are host timestamps,
so the same fields hold the measured copy times, and since those copies run in the
caller's thread, all of that time is exposed.
"""

from __future__ import annotations

import collections
from typing import Sequence

#: Measurements kept per quantity while their events are pending (the newest win).
PENDING_PER_QUANTITY = 4


class CycleStats:
    """Figures of the last offload and reload, and of the last chunked update (``slots.py``)."""

    __slots__ = (
        "d2h_copies",
        "h2d_copies",
        "d2h_bytes",
        "h2d_bytes",
        "offload_seconds",
        "reload_seconds",
        "update_chunks",
        "update_copies",
        "update_bytes",
    )

    def __init__(self) -> None:
        self.d2h_copies = self.h2d_copies = self.d2h_bytes = self.h2d_bytes = 0
        self.update_chunks = self.update_copies = self.update_bytes = 0
        self.offload_seconds = self.reload_seconds = 0.0

    def figures(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class CopyTimes:
    """Device-timed D2H and H2D transfers and exposed waits, read lazily (see module doc)."""

    QUANTITIES = ("d2h", "h2d", "exposed")

    def __init__(self, device) -> None:
        self.device = device
        #: quantity -> ``(start, end, bytes)`` measurements between two timing events, the
        #: newest last, that ``read`` has not taken yet. The engine appends to them as it
        #: queues copies (events are None where the device has no timing: never taken).
        self.pending = {q: collections.deque(maxlen=PENDING_PER_QUANTITY) for q in self.QUANTITIES}
        # quantity -> (milliseconds, bytes) of the newest completed measurement
        self._latest = {q: (0.0, 0) for q in self.QUANTITIES}

    def read(self) -> dict:
        """The newest completed figures: ``d2h_ms``, ``h2d_ms``, ``exposed_ms``, the bytes the
        transfers moved (``d2h_timed_bytes``, ``h2d_timed_bytes``) and their GB/s (10^9 bytes
        per second; 0 before the first completed measurement). Never blocks."""
        for quantity, pending in self.pending.items():
            for index in range(len(pending) - 1, -1, -1):
                start, end, nbytes = pending[index]
                if start is None or end is None:  # a device without timing: nothing measured
                    del pending[index]
                    continue
                elapsed = self.device.elapsed_ms(start, end)
                if elapsed is not None:
                    self._latest[quantity] = (elapsed, nbytes)
                    for _ in range(index + 1):  # it and everything older are done with
                        pending.popleft()
                    break
        (d2h_ms, d2h_bytes), (h2d_ms, h2d_bytes) = self._latest["d2h"], self._latest["h2d"]
        exposed_ms = self._latest["exposed"][0]
        if not self.device.is_accelerator:  # synchronous copies, in the caller's thread
            exposed_ms = d2h_ms + h2d_ms
        return {
            "d2h_ms": d2h_ms,
            "h2d_ms": h2d_ms,
            "d2h_timed_bytes": d2h_bytes,
            "h2d_timed_bytes": h2d_bytes,
            "d2h_gbps": gbps(d2h_bytes, d2h_ms),
            "h2d_gbps": gbps(h2d_bytes, h2d_ms),
            "exposed_ms": exposed_ms,
        }


def gbps(nbytes: int, ms: float) -> float:
    """10^9 bytes per second for ``nbytes`` in ``ms`` milliseconds (0 when nothing was timed)."""
    return nbytes / (ms * 1e6) if ms > 0 else 0.0


def piece_figures(pieces: Sequence, released) -> dict:
    """Bytes, pieces and tensors of an engine's ``pieces`` (``released``: the place of a
    piece whose only copy is on the host)."""
    on_host = [g for g in pieces if g.place is released]
    return {
        "tracked_bytes": sum(g.nbytes for g in pieces),
        "offloaded_bytes": sum(g.nbytes for g in on_host),
        "offloaded_payload_bytes": sum(g.payload_bytes for g in on_host),
        "pieces": count_by_kind(pieces),
        "largest_piece_bytes": max((g.nbytes for g in pieces), default=0),
        "tensors": sum(len(g.tensors) for g in pieces),
    }


def count_by_kind(pieces: Sequence) -> dict[str, int]:
    counts: dict[str, int] = {}
    for piece in pieces:
        counts[piece.kind] = counts.get(piece.kind, 0) + 1
    return counts
