"""The copy protocol: moving an engine's pieces between device and host, in order.

``CopyProtocol`` issues every copy, event, stream wait and release of the engine's pieces
(``Piece``); ``OffloadEngine`` (``engine.py``) decides what the pieces are, hands them over
(``take_pieces``) and holds one ``CopyProtocol``, which makes every move. The rules (why
each exists: docs/design.md; each device call below is labelled with the rule it keeps,
``labels.py``):

1. A D2H starts after the work that last wrote the tensors (every stream that used them).
2. Device memory is released only once the allocator knows the D2H stream reads it
   (``record_stream``), piece by piece, so each piece is reusable once its own copy is done.
3. A released tensor is not touched until regrown and its H2D is ordered before the reader.
4. The update (any caller of ``wait``) waits for the H2D of everything it reads.
5. A new D2H never overwrites a host copy a pending H2D still reads; the host reads a host
   copy only after its D2H completed.
6. A piece whose host copy is still valid is released without copying again.
7. Regrowth happens on the states' home stream (where the update runs), whichever stream
   asked for the reload.

Any stream: every stream ``wait`` ran on is a *user*: the D2H waits for each, memory regrown on
one stream is announced for the others (``record_stream``), and each waits for a D2H still
reading memory kept in place.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from ..device import Device
from ..errors import OffloadStateError, out_of_memory
from .disk import KEPT
from .figures import CopyTimes, CycleStats
from .host import HostArena
from .labels import (
    D2H_AFTER_USERS,
    D2H_AFTER_WRITERS,
    D2H_RECORD_STREAM,
    H2D_AFTER_ALLOCATION,
    H2D_AFTER_D2H,
    HOST_READ_AFTER_D2H,
    USE_AFTER_H2D,
    USE_RECORD_STREAM,
    USER_AFTER_D2H,
    WRITE_AFTER_D2H,
)
from .pieces import Piece, Place, release_separate_storages

_NEVER = object()


class CopyProtocol:
    """The copies of one engine's pieces, into and out of the engine's host arena (``host``:
    each piece's host slice is in it, and the newest copy of each direction is recorded
    there, for whoever frees it). ``offload`` asks ``fingerprint`` first and calls
    ``relayout`` (the engine's: it hands the new pieces over with ``take_pieces``) when its
    value changed."""

    def __init__(
        self,
        device: Device,
        *,
        name: str,
        host: HostArena,
        fingerprint: Callable[[], object] | None,
        relayout: Callable[[], None],
    ) -> None:
        self.device = device
        self.name = name
        #: The pieces, in layout order (a tuple, replaced whenever the layout changes).
        self.pieces: tuple[Piece, ...] = ()
        #: The host arena the pieces' host copies are in.
        self.host = host
        # Walking every optimizer state at every offload costs milliseconds for thousands of
        # parameters; a cheap fingerprint (None: always walk) says when it may have changed,
        # and invalidate() covers changes it cannot see (tensors replaced by a load).
        self.fingerprint = fingerprint  # None once closed
        self._last_fingerprint: object = _NEVER
        self._relayout = relayout
        self._d2h_stream = None
        self._h2d_stream = None
        # Streams ``wait`` made the states usable on since the last full offload: any of
        # them may have written the states (the step), so the D2H waits for each.
        self._users: list = []
        # Rule 7: the stream the states are allocated on (the first user, else the stream
        # current at the first offload); every regrowth happens on it.
        self._home_stream = None
        # Memory the engine no longer tracks that still names the D2H stream in its
        # record_stream set (storages other owners keep): the stream must outlive us.
        self._announced_elsewhere = False
        self._closed = False
        self.unreleasable_bytes = 0  # memory other references kept alive at consolidation
        self.last = CycleStats()
        self.times = CopyTimes(device)  # device-timed copies, read lazily by stats()

    # ----------------------------------------------------------------- queries
    @property
    def closed(self) -> bool:
        """True once ``close`` ran (detach): nothing more can be offloaded."""
        return self._closed

    def is_released(self, kinds: Iterable[str] | None = None, *, streamed: bool = True) -> bool:
        """True if any selected piece has no device memory (reload needed before use).

        ``streamed=False`` leaves out the pieces of streamed tensors (see ``streamed``).
        """
        pieces = self.pieces if kinds is None and streamed else self._select(kinds, streamed)
        return any(g.place is Place.RELEASED for g in pieces)

    def fully_released(self, kind: str) -> bool:
        """True if the engine tracks tensors of ``kind`` and all of them are on the host only
        (a kind it does not track yet counts as on the device)."""
        pieces = self._select((kind,))
        return bool(pieces) and all(g.place is Place.RELEASED for g in pieces)

    # --------------------------------------------------------------- the cycle
    def offload(
        self,
        kinds: Iterable[str] | None = None,
        *,
        skip_unchanged: bool = False,
        release: bool = False,
    ) -> None:
        """Start copying the selected pieces to the host (asynchronous on accelerators);
        pieces already offloading or released are not copied again. ``skip_unchanged``: a
        piece whose host copy is still valid is not copied again (rule 6). ``release``: each
        piece's device memory is released right after its own copy is queued (progressive
        reuse), and so is that of pieces already offloading."""
        if self._closed:
            raise self._closed_error()
        start = time.perf_counter()
        # The tensors may have changed (states made by the first step, replaced by a load):
        # the fingerprint says so cheaply, and the pieces are then laid out again (``rescan``,
        # written out here: this runs at every step).
        fingerprint = self.fingerprint() if self.fingerprint is not None else _NEVER
        if fingerprint is _NEVER or fingerprint != self._last_fingerprint:
            self._relayout()
            self._last_fingerprint = fingerprint  # only once laid out (see ``rescan``)
        pieces = self.pieces if kinds is None else self._select(kinds)
        for piece in self.pieces:
            if piece.disk is not None and piece.place is Place.RELEASED:
                # Read through the mapping since (a checkpoint served from the host copy):
                # out of host memory, once per step (dropping never loses data, disk.py).
                piece.disk.drop(piece.host)
        if release:
            # Copied out before and not released (an offload without ``release``, or one an
            # out-of-memory stopped): only the release is left.
            for piece in pieces:
                if piece.place is Place.OFFLOADING:
                    self._release_group(piece)
        selected = [g for g in pieces if g.place in (Place.RESIDENT, Place.RELOADING)]
        if not selected:
            return
        # Rule 5: a pending H2D reads the host copy we are about to overwrite; order it
        # before the current stream, which the D2H stream waits for below.
        self._wait_groups(selected)
        to_copy = [g for g in selected if not (skip_unchanged and g.host_valid)]
        self.last.d2h_copies = self.last.d2h_bytes = 0
        if to_copy:
            current = self.device.current_stream()
            if self._home_stream is None:
                self._home_stream = current
            side = self._d2h_stream if self._d2h_stream is not None else self.side_stream("d2h")
            users = [stream for stream in self._users if stream != current]
            timed = None
            for piece in to_copy:
                # Rule 1: the D2H sees everything the current stream wrote (the step); once per
                # piece, since the host calls between two pieces queue device work too.
                self.device.wait_stream(side, current, label=D2H_AFTER_WRITERS)
                for user in users:
                    # ... and everything the streams the step may have run on wrote.
                    self.device.wait_stream(side, user, label=D2H_AFTER_USERS)
                with self.device.use_stream(side):
                    if timed is None:  # after the waits: the transfers alone are timed
                        timed = self.device.record_event(side, timing=True)
                    if piece.flat is not None and piece.disk is not None:
                        # Into the disk tier's file through the arena's staging, on the disk
                        # when this returns: a write error raises here, the device copy whole
                        # and the piece still resident (disk.py).
                        piece.host_valid = False
                        piece.disk.write(piece.host, piece.flat, self.host.staging, self.device)
                        self.last.d2h_copies += 1
                        self.last.d2h_bytes += piece.nbytes
                    elif piece.flat is not None:
                        self.device.copy(piece.host, piece.flat)
                        self.last.d2h_copies += 1
                        self.last.d2h_bytes += piece.nbytes
                    else:  # first cycle: the tensors still have their own storages
                        for tensor, host in piece.host_slices():
                            self.device.copy(host, tensor)
                            self.last.d2h_copies += 1
                            self.last.d2h_bytes += tensor.numel() * tensor.element_size()
                    event = self.device.record_event(side, timing=piece is to_copy[-1])
                # Rule 5: the arena is not given back before this copy is done, even if a
                # later piece's release raises before the loop ends.
                self.host.last_d2h = event
                if piece.disk is not None and piece.flat is None:
                    # The first cycle's copies went through the file's mapping, which will hold
                    # the only copy: the host waits for them, then the pages go to the disk (an
                    # I/O error raises here, the device copies whole) and out of host memory.
                    piece.host_valid = False
                    self.device.synchronize_event(event, label=HOST_READ_AFTER_D2H)
                    piece.disk.write_back(piece.host, then=KEPT)
                piece.d2h_event = event
                piece.host_valid = True
                piece.place = Place.OFFLOADING
                piece.d2h_waiters = []  # a user must wait for this D2H before writing again
                # Rule 2: the side stream reads this memory; tell the allocator before any
                # release so it is not handed out again until the copy is done.
                for tensor in (piece.flat,) if piece.flat is not None else piece.tensors:
                    self.device.record_stream(tensor, side, label=D2H_RECORD_STREAM)
                piece.announced = True  # until its memory is freed (see ``close``)
                if release:
                    # Freed before the next piece's copy is queued: the allocator reuses a
                    # block freed under record_stream once the work queued on that stream AT
                    # THE FREE has run, i.e. this piece's own copy, not the ones after it.
                    self._release_group(piece)
            self.times.pending["d2h"].append((timed, event, self.last.d2h_bytes))
        for piece in selected:
            if piece.place is not Place.RELEASED:
                piece.place = Place.OFFLOADING
                if release:
                    self._release_group(piece)
        if all(g.place is Place.RELEASED for g in self.pieces):
            self._users = []  # nothing left on the device for them to have written
        self.last.offload_seconds = time.perf_counter() - start

    def release(self, kinds: Iterable[str] | None = None) -> None:
        """Return the device memory of the selected pieces that were offloaded."""
        if self._closed:
            raise self._closed_error()
        start = time.perf_counter()
        selected = list(self._select(kinds))
        if selected and not any(g.place in (Place.OFFLOADING, Place.RELEASED) for g in selected):
            raise OffloadStateError(
                f"{self.name}: release() before offload(): the states have no host copy yet. "
                "Call offload() first."
            )
        for piece in selected:
            if piece.place is Place.OFFLOADING:
                self._release_group(piece)
        self.last.offload_seconds += time.perf_counter() - start

    def _release_group(self, piece: Piece) -> None:
        if piece.flat is not None:
            if not piece.flat.untyped_storage().resizable():
                raise OffloadStateError(
                    f"{self.name}: the memory of the {piece.kind} ({piece.dtype}) cannot be "
                    "released because something made it non-resizable (on CPU, "
                    "Tensor.numpy() of a state tensor does). Keep copies instead "
                    "(tensor.clone().numpy()), or leave these states on the device."
                )
            self.device.release(piece.flat)
        else:
            try:  # its one allocation comes first: a failure leaves the piece whole
                kept = release_separate_storages(self.device, piece.tensors)
            except BaseException as error:
                operation = f"{self.name}: offload (releasing tensors that share storages)"
                raise out_of_memory(error, self.device, operation, piece.nbytes)
            self.unreleasable_bytes += kept
            # Other owners keep storages the D2H stream was announced to (see ``close``).
            self._announced_elsewhere = self._announced_elsewhere or (kept > 0 and piece.announced)
        piece.announced = False
        piece.place = Place.RELEASED
        piece.used_on = []

    def reload(
        self,
        kinds: Iterable[str] | None = None,
        *,
        streamed: bool = True,
        pieces: Sequence[Piece] | None = None,
    ) -> None:
        """Regrow the released pieces and start copying them back (asynchronous on accelerators).

        The data may be used only after ``wait`` (which the caller of the step does).
        ``streamed=False`` leaves the pieces of streamed tensors on the host. ``pieces``:
        these pieces instead of the ones ``kinds`` and ``streamed`` select.
        """
        if self._closed:
            raise self._closed_error()
        start = time.perf_counter()
        if pieces is not None:
            selected = pieces
        else:
            selected = self.pieces if kinds is None and streamed else self._select(kinds, streamed)
        # An offloading piece still has its device memory: it only has to become resident.
        # Its D2H may still be reading that memory, and the next writer (the step) runs on
        # the current stream, so the current stream waits for the D2H first.
        current = self.device.current_stream()
        for piece in selected:
            if piece.place is Place.OFFLOADING:
                if piece.d2h_event is not None:
                    self.device.wait_event(current, piece.d2h_event, label=WRITE_AFTER_D2H)
                    piece.d2h_waiters.append(current)
                piece.place = Place.RESIDENT
        released = [g for g in selected if g.place is Place.RELEASED]
        if not released:
            return  # nothing to copy: the figures stay those of the last reload that copied
        self.last.h2d_copies = self.last.h2d_bytes = 0
        # Rule 7: regrown on the home stream (whose pool the memory goes back to when it is
        # released again); ``wait`` announces any other stream that uses it.
        home = self._home_stream if self._home_stream is not None else current
        grown, issued = [], []
        side = self._h2d_stream if self._h2d_stream is not None else self.side_stream("h2d")
        try:  # all or nothing: a failure (out of memory, an interrupt) gives back what it made
            with self.device.use_stream(home):
                for piece in released:
                    if piece.flat is not None:
                        self.device.regrow(piece.flat, piece.nbytes)
                    else:
                        piece.consolidate(self.device.empty(piece.numel, piece.dtype))
                    grown.append(piece)
            # The regrown blocks may have been used by work still queued on the home stream
            # (the allocator reuses memory in stream order), and the host copy must be complete.
            self.device.wait_stream(side, home, label=H2D_AFTER_ALLOCATION)
            for piece in released:
                if piece.d2h_event is not None:
                    self.device.wait_event(side, piece.d2h_event, label=H2D_AFTER_D2H)
            with self.device.use_stream(side):
                timed = self.device.record_event(side, timing=True)  # after the waits
                for piece in released:
                    if piece.disk is not None:
                        # From the disk tier's file, read through the arena's staging (a read
                        # error raises here, and what was regrown is given back below).
                        issued.append(piece)
                        piece.disk.read(piece.flat, piece.host, self.host.staging, self.device)
                    else:
                        self.device.copy(piece.flat, piece.host)
                        issued.append(piece)
                    self.last.h2d_copies += 1
                    self.last.h2d_bytes += piece.nbytes
                    # One event per piece: a reader waits for the pieces it uses.
                    piece.h2d_event = self.device.record_event(side, timing=piece is released[-1])
        except BaseException as error:
            for piece in issued:  # Rule 2: the H2D queued on the side stream still writes it
                self.device.record_stream(piece.flat, side, label=USE_RECORD_STREAM)
                piece.h2d_event = None
            for piece in grown:  # still RELEASED: the host copy is the only one
                self.device.release(piece.flat)
            needed = sum(g.nbytes for g in released)
            raise out_of_memory(error, self.device, f"{self.name}: reload", needed)
        for piece in released:
            piece.alloc_stream = home
            piece.used_on = []
        self.host.last_h2d = released[-1].h2d_event
        self.times.pending["h2d"].append((timed, released[-1].h2d_event, self.last.h2d_bytes))
        for piece in released:
            # No record_stream for the H2D's writes: nothing frees this memory before the H2D
            # is ordered before the current stream or the host waited for it (finalizer).
            piece.d2h_event = None  # the H2D waited for it, so the host copy is complete
            piece.place = Place.RELOADING
        self.last.reload_seconds = time.perf_counter() - start

    def wait(self, kinds: Iterable[str] | None = None) -> None:
        """Order every pending H2D before the current stream (rule 4), whichever it is."""
        pieces = self.pieces if kinds is None else self._select(kinds)
        current = self.device.current_stream()
        if current not in self._users:
            self._users.append(current)
        if self._home_stream is None:
            self._home_stream = current  # the update runs here: it allocates its states here
        for piece in pieces:
            if piece.place is Place.RELEASED:
                continue
            if current not in piece.used_on:
                piece.used_on.append(current)
                if piece.alloc_stream is not None and piece.alloc_stream != current:
                    # Rule 2: the allocator knows only the stream it was regrown on.
                    for tensor in (piece.flat,) if piece.flat is not None else piece.tensors:
                        self.device.record_stream(tensor, current, label=USE_RECORD_STREAM)
            if (
                piece.place is Place.RESIDENT
                and piece.d2h_event is not None
                and current not in piece.d2h_waiters
            ):
                # Kept in place by a reload on another stream, which waited for this D2H:
                # this stream writes the memory next, so it waits too.
                self.device.wait_event(current, piece.d2h_event, label=USER_AFTER_D2H)
                piece.d2h_waiters.append(current)
        self._wait_groups(pieces, current)

    def synchronize_host(self, kinds: Iterable[str] | None = None) -> None:
        """Block until every pending D2H completed, so the host copies may be read (rule 5)."""
        for piece in self._select(kinds):
            if piece.d2h_event is not None:
                self.device.synchronize_event(piece.d2h_event, label=HOST_READ_AFTER_D2H)
                piece.d2h_event = None

    def mark_dirty(self, kinds: Iterable[str] | None = None, *, on_device: bool = False) -> None:
        """The selected pieces' device copies are about to change (a step, tensors handed out):
        their host copies become stale. ``on_device``: only pieces with device memory."""
        for piece in self._select(kinds):
            if not (on_device and piece.place is Place.RELEASED):
                piece.host_valid = False

    def retire(self) -> None:
        """The end of ``close``: the pieces forgotten, the side streams retired, nothing more
        offloaded. Memory announced to the D2H stream outlives the engine where a piece was
        offloaded and never released (its storage stays with the optimizer) or where other
        owners kept a storage: the allocator records an event on the stream when that memory
        is freed, so that stream lives on."""
        announced = self._announced_elsewhere or any(g.announced for g in self.pieces)
        for stream, named in ((self._d2h_stream, announced), (self._h2d_stream, False)):
            if stream is not None:
                self.device.retire_stream(stream, announced=named)
        self.pieces = ()
        self._closed = True

    # ------------------------------------------------------------------ layouts
    def invalidate(self) -> None:
        """The tracked tensors may have been replaced: look at them again at the next offload."""
        self._last_fingerprint = _NEVER

    def rescan(self) -> None:
        """Lay the pieces out anew if the fingerprint says they may have changed (always
        without one). Called by ``offload``; after an adoption, it lays the adopted tensors
        out at once (released pieces, which the next reload brings back)."""
        if self._closed:
            raise self._closed_error()
        fingerprint = self.fingerprint() if self.fingerprint is not None else _NEVER
        if fingerprint is not _NEVER and fingerprint == self._last_fingerprint:
            return
        self._relayout()
        # Only once laid out: a layout that failed is made again by the next offload.
        self._last_fingerprint = fingerprint

    def take_pieces(self, pieces: Sequence[Piece]) -> None:
        """``pieces`` replace the current ones (a new layout); memory of the old layout
        announced to the D2H stream lives on with the tensors."""
        self._announced_elsewhere |= any(g.announced for g in self.pieces)
        self.pieces = tuple(pieces)

    # ----------------------------------------------------------------- helpers
    def _select(self, kinds: Iterable[str] | None, streamed: bool = True):
        pieces = self.pieces if streamed else [g for g in self.pieces if not g.streamed]
        if kinds is None:
            return pieces
        wanted = set(kinds)
        return [g for g in pieces if g.kind in wanted]

    def _closed_error(self) -> OffloadStateError:
        return OffloadStateError(f"{self.name} is closed (detached); attach again to offload.")

    def side_stream(self, which: str):
        """The engine's own side stream for copies ``which`` way ("d2h" or "h2d"), made at
        its first use; every copy of the engine, its slots' included, is issued on these."""
        if which == "d2h":
            if self._d2h_stream is None:
                self._d2h_stream = self.device.new_stream()
            return self._d2h_stream
        if self._h2d_stream is None:
            self._h2d_stream = self.device.new_stream()
        return self._h2d_stream

    def _wait_groups(self, pieces: list[Piece], current=None) -> None:
        waited = set()
        before = None
        for piece in pieces:
            if piece.place is not Place.RELOADING:
                continue
            if id(piece.h2d_event) not in waited:
                if before is None:
                    current = current or self.device.current_stream()
                    # Exposed time: from where the current stream reaches the waits to
                    # where it may go on (timing events on the current stream).
                    before = self.device.record_event(current, timing=True)
                self.device.wait_event(current, piece.h2d_event, label=USE_AFTER_H2D)
                waited.add(id(piece.h2d_event))
            piece.h2d_event = None
            piece.place = Place.RESIDENT
        if before is not None:
            self.times.pending["exposed"].append(
                (before, self.device.record_event(current, timing=True), 0)
            )
