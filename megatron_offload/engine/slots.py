"""Streaming released tensors through a few device slots while the caller updates them.

The chunked update keeps the optimizer states on the host even during the step. The
caller splits its tensors into units (the states of one parameter: a unit is updated by
one call) and ``SlotStream.plan`` packs consecutive units into chunks of at most
``slot_bytes``. ``SlotStream.run`` then, for chunk after chunk, copies the chunk's bytes
from the host arena into a device slot (H2D), lets the caller update them there, and
copies them back (D2H), with ``slots`` slots in rotation so that the copies of one chunk
overlap the update of another. The device memory this takes is the slots, allocated for
the run and given back at its end: at most ``slots * slot_bytes``.

Inside a chunk, the tensors of one engine piece that are neighbours in the host arena
(consecutive parameters' states) move with one copy, so a chunk costs one copy per piece
and direction, whatever the number of parameters in it.

The ordering (labels as in ``engine.py``; a chunk ``i`` uses slot ``i % slots``):

- the H2D stream waits for the current stream before each prefetch: the slots were
  allocated on it and the update that last used the slot ran on it (rule 7);
- the first H2D waits for the D2H that filled the host copies (rule 5);
- the H2D into a slot waits for the D2H that read the slot's previous chunk
  (``SLOT_REUSE_AFTER_D2H``);
- the update waits for its chunk's H2D (rules 3 and 4);
- the D2H waits for the update (rule 1);
- the slots are freed once the allocator knows the D2H stream reads them (rule 2), and
  the host copies carry the last D2H's event, so the next reader of the arena waits for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..errors import OffloadStateError, SlotSizeError, out_of_memory
from .engine import OffloadEngine
from .labels import (
    D2H_AFTER_WRITERS,
    D2H_RECORD_STREAM,
    H2D_AFTER_ALLOCATION,
    H2D_AFTER_D2H,
    HOST_READ_AFTER_D2H,
    SLOT_REUSE_AFTER_D2H,
    USE_AFTER_H2D,
    WRITE_AFTER_D2H,
)
from .pieces import Piece, Place, aligned_size


@dataclass
class _Segment:
    """Neighbouring tensors of one piece: elements ``start:end`` of the piece, at ``slot_offset``."""

    piece: Piece
    start: int
    end: int
    slot_offset: int  # bytes
    nbytes: int = field(init=False)  # bytes in the slot, from ``slot_offset``

    def __post_init__(self) -> None:
        self.nbytes = (self.end - self.start) * self.piece.itemsize


@dataclass
class Chunk:
    """Units updated together, and where their tensors sit in a slot."""

    units: list[int]
    segments: list[_Segment] = field(default_factory=list)
    # id(tensor) -> (index of its segment, element offset in the segment's typed slot view,
    # shape, stride): enough to make its slot view with one as_strided call.
    places: dict[int, tuple[int, int, tuple, tuple]] = field(default_factory=dict)
    nbytes: int = 0


class SlotStream:
    """Runs an update over chunks of an engine's released tensors, in device slots.

    Args:
        engine: the ``OffloadEngine`` tracking the tensors (in released pieces).
        slot_bytes: the size of one slot; a unit larger than this cannot be streamed.
        slots: how many slots rotate (2: the copies of one chunk overlap the update of the
            next; 1: no overlap, half the memory).
    """

    def __init__(
        self,
        engine: OffloadEngine,
        *,
        slot_bytes: int,
        slots: int = 2,
        transient_ratio: float = 0.0,
    ) -> None:
        if slot_bytes <= 0 or slots < 1:
            raise ValueError(
                f"slot_bytes must be > 0 and slots >= 1, got {slot_bytes} and {slots}."
            )
        self.engine = engine
        self.slot_bytes = slot_bytes
        self.slots = slots
        # Temporary bytes the caller's update makes per byte of the chunk it updates (kept
        # beside the slots by whoever sized them): only used to say what budget a unit needs.
        self.transient_ratio = transient_ratio
        self.peak_slot_bytes = 0  # device bytes of the slots of the largest run so far

    def budget_for(self, nbytes: int) -> int:
        """The total budget (slots and temporaries) in which a unit of ``nbytes`` fits a slot."""
        return budget_for(nbytes, self.slots, self.transient_ratio)

    def clear_figures(self) -> None:
        """Zero the engine's chunked-update figures (a step that streams nothing reports 0)."""
        last = self.engine.copies.last
        last.update_chunks = last.update_copies = last.update_bytes = 0

    # ------------------------------------------------------------------ plan
    def streamable(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` is tracked in a released streamed piece (its bytes are on the host)."""
        where = self.engine.locate(tensor)
        return where is not None and where[0].streamed and where[0].place is Place.RELEASED

    def plan(
        self, units: Sequence[Sequence[torch.Tensor]], names: Sequence[str] = ()
    ) -> list[Chunk]:
        """Pack consecutive ``units`` (each a list of streamable tensors) into chunks.

        ``names`` (one per unit) are used in the error raised when a unit is larger than
        a slot, before any memory is touched.
        """
        chunks: list[Chunk] = []
        current: list[int] = []
        used = 0
        for index, unit in enumerate(units):
            size = sum(aligned_bytes(t) for t in unit)
            if size > self.slot_bytes:
                name = names[index] if index < len(names) else f"unit {index}"
                raise SlotSizeError(
                    f"{self.engine.name}: the states of {name} take {size:,} bytes, more than one "
                    f"slot of the chunked update ({self.slot_bytes:,} bytes). Give the chunked "
                    f"update at least {self.budget_for(size):,} bytes (chunked_update_bytes), or leave "
                    "it unset to reload the states whole for the step."
                )
            if current and used + size > self.slot_bytes:
                chunks.append(self._layout(current, units))
                current, used = [], 0
            current.append(index)
            used += size
        if current:
            chunks.append(self._layout(current, units))
        return chunks

    def _layout(self, indices: list[int], units) -> Chunk:
        located = []
        for index in indices:
            for tensor in units[index]:
                where = self.engine.locate(tensor)
                if where is None:
                    raise OffloadStateError(
                        f"{self.engine.name}: a streamed tensor is not tracked."
                    )
                piece, position = where
                located.append((id(piece), piece.offsets[position], piece, tensor))
        located.sort(key=lambda item: (item[0], item[1]))
        chunk = Chunk(list(indices))
        slot_offset = 0
        segment = None
        for _, offset, piece, tensor in located:
            end = offset + aligned_bytes(tensor) // piece.itemsize
            if segment is None or segment.piece is not piece or segment.end != offset:
                if segment is not None:
                    slot_offset += segment.nbytes
                segment = _Segment(piece, offset, end, slot_offset)
                chunk.segments.append(segment)
            else:
                segment.end = end
                segment.nbytes = (end - segment.start) * piece.itemsize
            chunk.places[id(tensor)] = (
                len(chunk.segments) - 1,
                offset - segment.start,
                tuple(tensor.shape),
                tuple(tensor.stride()),
            )
        chunk.nbytes = sum(s.nbytes for s in chunk.segments)
        return chunk

    # ------------------------------------------------------------------- run
    def run(
        self,
        chunks: Sequence[Chunk],
        update: Callable[[Chunk, dict[int, torch.Tensor]], None],
        *,
        save: Callable[[Chunk, list[tuple[torch.Tensor, torch.Tensor]], object], object]
        | None = None,
    ) -> None:
        """For every chunk: bring its bytes into a slot, ``update(chunk, views)``, copy them back.

        ``views`` maps ``id(tensor)`` to the tensor's place in the slot (same dtype and shape):
        the caller makes the update use those instead of the (released) tensors.

        ``save`` (the chunked update's undo), if given, is called as soon as a chunk's H2D is
        queued, as ``save(chunk, pairs, h2d_event)``: ``pairs`` are ``(slot bytes, their host
        copy)``, one per segment, which hold the bytes from before the update once
        ``h2d_event`` completed. It returns the event of the copies it queued (or None); the
        chunk's update waits for it, so they read the slot before the update writes it. Being
        issued with the prefetch, those copies overlap the update of the chunk before.
        """
        if not chunks:
            return
        engine, device = self.engine, self.engine.device
        for chunk in chunks:
            for segment in chunk.segments:
                if segment.piece.place is not Place.RELEASED:
                    raise OffloadStateError(
                        f"{engine.name}: the chunked update streams released states only; "
                        f"the {segment.piece.kind} are {segment.piece.place.value}."
                    )
        count = min(self.slots, len(chunks))
        size = max(chunk.nbytes for chunk in chunks)  # <= slot_bytes (plan)
        slots = []
        try:  # all or nothing, before any state moves
            for _ in range(count):
                slots.append(device.empty(size, torch.uint8))
        except BaseException as error:
            slots.clear()
            raise out_of_memory(
                error, device, f"{engine.name}: the chunked update's slots", count * size
            )
        self.peak_slot_bytes = max(self.peak_slot_bytes, count * size)
        current = device.current_stream()
        h2d = engine.side_stream("h2d")
        d2h = engine.side_stream("d2h")
        pieces = {id(s.piece): s.piece for c in chunks for s in c.segments}.values()
        stats = engine.copies.last
        stats.update_chunks = len(chunks)
        stats.update_copies = stats.update_bytes = 0
        h2d_events: dict[int, object] = {}
        typed_views: dict[int, list[torch.Tensor]] = {}  # each segment's place in its slot, typed
        saved_events: dict[int, object] = {}  # the ``save`` copies of prefetched chunks
        d2h_events: list[object] = [None] * count
        fetched = 0
        h2d_issued = False  # some H2D was queued (the host arena must not go before it ran)

        def fetch(index: int) -> None:
            nonlocal h2d_issued
            slot = slots[index % count]
            # Rule 7: the slot was allocated on the current stream, and the update of the
            # chunk that used it before ran there: the H2D comes after both.
            device.wait_stream(h2d, current, label=H2D_AFTER_ALLOCATION)
            if index == 0:
                # Rule 5: the host copies are complete before they are read.
                for piece in pieces:
                    if piece.d2h_event is not None:
                        device.wait_event(h2d, piece.d2h_event, label=H2D_AFTER_D2H)
            previous = d2h_events[index % count]
            if previous is not None:
                # The D2H of the slot's previous chunk still reads it: refill after it.
                device.wait_event(h2d, previous, label=SLOT_REUSE_AFTER_D2H)
            typed = typed_views[index] = [
                slot[s.slot_offset : s.slot_offset + s.nbytes].view(s.piece.dtype)
                for s in chunks[index].segments
            ]
            for segment in chunks[index].segments:
                if segment.piece.disk is not None:
                    # Read with pread first: an I/O error raises, where through the mapping
                    # it would be a SIGBUS (disk.py).
                    segment.piece.disk.check_readable(
                        segment.piece.host[segment.start : segment.end]
                    )
            with device.use_stream(h2d):
                h2d_issued = True
                try:
                    for segment, view in zip(chunks[index].segments, typed):
                        device.copy(view, segment.piece.host[segment.start : segment.end])
                        stats.update_copies += 1
                        stats.update_bytes += segment.nbytes
                finally:
                    # Even when a copy raised: those queued before it still write the slot,
                    # and the slot is freed (run's finally) only once this event is ordered
                    # before the current stream.
                    h2d_events[index] = device.record_event(h2d)
            if save is not None:
                # The slot's bytes from before the update, saved while the chunk before is
                # updated (the D2H stream reads the slot after its H2D, and the slots are
                # freed only once the D2H stream is done with them, rule 2 below).
                pairs = [
                    (view, s.piece.host[s.start : s.end])
                    for s, view in zip(chunks[index].segments, typed)
                ]
                saved_events[index] = save(chunks[index], pairs, h2d_events[index])

        last_d2h = None
        try:
            for index, chunk in enumerate(chunks):
                # Prefetch as far ahead as free slots allow: a slot is free once the D2H of
                # its previous chunk was issued (chunks before ``index``).
                while fetched < len(chunks) and fetched < index + count:
                    fetch(fetched)
                    fetched += 1
                # Rules 3 and 4: the update reads what the H2D wrote.
                device.wait_event(current, h2d_events.pop(index), label=USE_AFTER_H2D)
                typed = typed_views.pop(index)
                views = {
                    key: typed[segment].as_strided(
                        shape, stride, typed[segment].storage_offset() + offset
                    )
                    for key, (segment, offset, shape, stride) in chunk.places.items()
                }
                saved = saved_events.pop(index, None)
                if saved is not None:
                    # The update overwrites the slot (and what else ``save`` read) only after
                    # the copies saving it read it.
                    device.wait_event(current, saved, label=WRITE_AFTER_D2H)
                failure = None
                try:
                    update(chunk, views)
                except BaseException as error:
                    if save is not None:
                        raise  # the undo puts back the bytes from before the step
                    # What the update wrote before it failed is copied back, as a finished
                    # chunk's: the states are then those of the same update failing whole.
                    failure = error
                del views
                # Rule 1: the D2H copies what the update wrote.
                device.wait_stream(d2h, current, label=D2H_AFTER_WRITERS)
                with device.use_stream(d2h):
                    try:
                        for segment, view in zip(chunk.segments, typed):
                            device.copy(segment.piece.host[segment.start : segment.end], view)
                            stats.update_copies += 1
                            stats.update_bytes += segment.nbytes
                    finally:
                        # Even when a copy raised: the next reader of the host copies (and
                        # of the slot) must wait for the copies queued before it.
                        last_d2h = d2h_events[index % count] = device.record_event(d2h)
                on_disk = [s for s in chunk.segments if s.piece.disk is not None]
                if on_disk:
                    # The disk tier's file holds the only copy: the host waits for this
                    # chunk's copy, then its pages go to the disk and out of host memory, so
                    # the page cache holds at most a chunk (an I/O error raises here).
                    device.synchronize_event(last_d2h, label=HOST_READ_AFTER_D2H)
                    for segment in on_disk:
                        segment.piece.disk.write_back(
                            segment.piece.host[segment.start : segment.end],
                            then="The updated states of this chunk may be in host memory "
                            "only: save a checkpoint now, or load the last one.",
                        )
                if failure is not None:
                    try:
                        raise failure
                    finally:
                        failure = None  # no cycle through this frame: the slots go now
        finally:
            # Prefetched chunks that were never updated (the update raised): order their
            # H2D before the current stream, which frees the slots.
            for event in h2d_events.values():
                device.wait_event(current, event, label=USE_AFTER_H2D)
            for slot in slots:
                # Rule 2: the D2H stream still reads the slots; the allocator must know.
                device.record_stream(slot, d2h, label=D2H_RECORD_STREAM)
            if last_d2h is not None:
                engine.host.last_d2h = last_d2h
                for piece in pieces:
                    # The next reader of these host copies (an H2D, the host) waits for it.
                    piece.d2h_event = last_d2h
                    piece.host_valid = True
            if h2d_issued:
                engine.host.last_h2d = device.record_event(h2d)
            # The slots, and every view of them, go back to the allocator (under the
            # record_stream above) now, not when this frame ends.
            slots.clear()
            typed_views.clear()


def aligned_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` takes in a slot (and in a piece): its size rounded up to 16."""
    return aligned_size(tensor.numel() * tensor.element_size())


def budget_for(nbytes: int, slots: int, transient_ratio: float = 0.0) -> int:
    """The smallest budget whose split (``slots`` slots and a reserve of ``transient_ratio``
    slots for the update's temporaries) gives slots of at least ``nbytes``."""
    return aligned_size(math.ceil(nbytes * (slots + transient_ratio)))
