"""The offload engine: moves one set of tensors between device and host memory.

The engine knows nothing about optimizers. It is given a ``collect`` callable returning
``(kind, tensor)`` pairs (``kind`` names what the tensor is, e.g. ``"optimizer_states"``)
and a ``Device``; it groups the tensors by kind and dtype, splits each group into pieces
of at most ``max_piece_bytes`` (``FlatGroup`` objects), keeps one exactly-sized host arena
for all of them, and moves each piece with one copy per direction once consolidated (see
``groups.py``). Copies per cycle are therefore bounded by bytes / piece size plus the
number of groups, whatever the number of tensors.

When the set of tensors changes (new states appear), the groups are laid out again in a new
arena; groups whose only copy is on the host stay released and their bytes move from the old
arena to the new one. Tensors named by ``streamed`` are grouped apart, so that a caller can
leave them on the host during its update and stream them through device slots instead
(``slots.py``); tensors it copied to the host itself join through ``adopt``.

The copy protocol (numbers refer to the rules in the project's design notes):

1. A D2H starts only after the work that last wrote the tensors: the D2H stream waits for
   the current stream before copying.
2. Device memory is released only once the allocator knows the D2H stream reads it
   (``record_stream``), so the memory is not reused before that copy is done. Each piece
   is released right after its own copy is queued (``offload(release=True)``), so it
   becomes reusable when that copy is done, piece by piece.
3. A released tensor is not touched until regrown and its H2D is ordered before the
   reader (``wait``).
4. The update (any caller of ``wait``) waits for the H2D of everything it reads.
5. A new D2H never overwrites a host copy that a pending H2D still reads (``offload``
   first orders pending H2Ds before the current stream, which the D2H stream then waits
   for); the host copy is read by the host only after its D2H completed
   (``synchronize_host``).
6. A group whose host copy is still valid (nothing wrote the device copy since it was last
   copied) is released without copying again when ``skip_unchanged`` is set.
7. Regrowth happens on the states' home stream: the one the update first ran on (where an
   optimizer allocates its states), else the one current at the first offload. A reload
   issued from another stream (a backward hook, a ``torch.cuda.stream`` block in an RL
   loop) still regrows there, so that a released piece goes back to the pool the
   activations allocate from; the caching allocator keeps one pool per stream.

Any stream (the rules above, when the caller's current stream changes between calls): the
stream current at ``wait`` is the one the update runs on (a step pre-hook), which need not
be the one current at ``reload`` (a prefetch from a backward hook runs on autograd's stream)
or at ``offload`` (a user's ``torch.cuda.stream`` block around the step, an RL loop). So
every stream ``wait`` ran on is a *user*: the D2H waits for every user as well as for the
current stream (rule 1); memory regrown on one stream and made usable on another is
announced to the allocator for that other stream with ``record_stream`` (rule 2), so that a
release from any stream never hands it out under the user's work; and a user other than
the reloading stream waits for a D2H still reading memory kept in place (rule 2).
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Iterable, Sequence

import torch

from ..device import Device
from .figures import CopyTimes, CycleStats, count_by_kind
from .groups import FlatGroup, Place, release_separate_storages
from .host import HostArena, HostBudget, HostMemoryBudgetError  # noqa: F401 - HostMemoryBudgetError re-exported
from .labels import (  # noqa: F401 - re-exported: the labels are named from here
    D2H_AFTER_USERS,
    D2H_AFTER_WRITERS,
    D2H_RECORD_STREAM,
    H2D_AFTER_ALLOCATION,
    H2D_AFTER_D2H,
    HOST_FREE_AFTER_COPIES,
    HOST_READ_AFTER_D2H,
    USE_AFTER_H2D,
    USE_RECORD_STREAM,
    USER_AFTER_D2H,
    WRITE_AFTER_D2H,
)
from .layout import _NEVER, MANY_COPIES, LayoutMixin, _typed, _unmovable_reason  # noqa: F401 - re-exported

Collect = Callable[[], Iterable[tuple[str, torch.Tensor]]]

#: Default bound of one device storage (piece); see ``OffloadConfig.max_piece_bytes``.
DEFAULT_MAX_PIECE_BYTES = 256 << 20


from ..errors import OffloadStateError  # noqa: E402,F401 - raised here; every exception lives in errors.py


class OffloadEngine(LayoutMixin):
    """Offloads the tensors returned by ``collect`` to one host arena and back.

    Args:
        device: the ``Device`` whose streams and memory are used.
        collect: returns the ``(kind, tensor)`` pairs to manage; called again at every
            ``offload`` so that tensors created later (Adam's moments appear at the first
            step) or replaced (``load_state_dict``) are picked up.
        name: used in error messages.
        fingerprint: a cheap callable whose value changes when ``collect`` may return other
            tensors (None: walk ``collect`` at every offload). Dropped at ``close``, after
            calling its ``forget()`` if it has one (it may hold the caller's containers).
        budget: the ``HostBudget`` this engine's host arena counts against.
        fraction: offload only the largest tensors making up this fraction of the bytes.
        streamed: returns the tensors the caller streams through device slots during its
            update (``engine.slots.SlotStream``) rather than reloading them whole. They are
            grouped apart from the others, so ``reload(streamed=False)`` can leave them on
            the host.
        max_piece_bytes: no consolidated device storage holds more than this many bytes
            (a larger tensor gets a storage of its own). Each piece is copied, released and
            regrown on its own, so the allocator can hand a piece's memory out again as soon
            as that piece's copy is done, not when the whole group's is. None: one storage
            per kind and dtype. Lowered to the device's ``piece_bound()`` (the allocator's
            ``max_split_size_mb``) where that is smaller.
    """

    def __init__(
        self,
        device: Device,
        collect: Collect,
        *,
        name: str = "offload engine",
        fingerprint: Callable[[], object] | None = None,
        budget: HostBudget | None = None,
        fraction: float = 1.0,
        streamed: Callable[[], Iterable[torch.Tensor]] | None = None,
        max_piece_bytes: int | None = DEFAULT_MAX_PIECE_BYTES,
    ) -> None:
        self.device = device
        self.name = name
        self._collect = collect
        # Walking every optimizer state at every offload costs milliseconds for thousands of
        # parameters; a cheap fingerprint (None: always walk) says when it may have changed,
        # and invalidate() covers changes it cannot see (tensors replaced by a load).
        self.fingerprint = fingerprint  # None once closed
        self._last_fingerprint: object = _NEVER
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"offload fraction must be between 0 and 1, got {fraction!r}.")
        self._fraction = fraction
        if max_piece_bytes is not None and (
            isinstance(max_piece_bytes, bool)
            or not isinstance(max_piece_bytes, int)
            or max_piece_bytes <= 0
        ):
            raise ValueError(
                f"max_piece_bytes must be a positive number of bytes or None, got {max_piece_bytes!r}."
            )
        # The allocator cannot split a freed block above its bound (``max_split_size_mb``):
        # such a piece would serve nothing else once released, so pieces stay under it.
        bound = device.piece_bound()
        if bound is not None and (max_piece_bytes is None or max_piece_bytes > bound):
            max_piece_bytes = bound
        self._max_piece_bytes = max_piece_bytes
        self._streamed = streamed
        self._adopted: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}
        self._where: dict[int, tuple[FlatGroup, int]] = {}
        self.generation = 0  # advances whenever the groups are laid out again
        #: The pieces, in layout order (a tuple, replaced whenever the layout changes).
        self.groups: tuple[FlatGroup, ...] = ()
        self._tracked: list[tuple[str, torch.Tensor]] = []
        self._kept_resident: list[tuple[str, torch.Tensor, str]] = []
        # The host arena and the newest copy into or out of it on each side stream. Kept
        # apart from the engine so that an engine dropped with copies in flight still waits
        # for them before its arena is freed (the finalizer below).
        self._host = HostArena(device, budget)
        weakref.finalize(self, self._host.free)
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
    def host_arena(self) -> torch.Tensor | None:
        """The host arena (a 1-D uint8 tensor; None before the first layout or reservation),
        for inspection: its pages, its mapping. The engine owns what is in it."""
        return self._host.buffer

    def is_released(self, kinds: Iterable[str] | None = None, *, streamed: bool = True) -> bool:
        """True if any selected group has no device memory (reload needed before use).

        ``streamed=False`` leaves out the groups of streamed tensors (see ``streamed``).
        """
        groups = self.groups if kinds is None and streamed else self._select(kinds, streamed)
        return any(g.place is Place.RELEASED for g in groups)

    def movable(self, tensor: torch.Tensor) -> bool:
        """True if the engine would move ``tensor`` (a plain, contiguous tensor of its device)."""
        return not _unmovable_reason(tensor, self.device)

    def locate(self, tensor: torch.Tensor) -> tuple[FlatGroup, int] | None:
        """The group tracking ``tensor`` and its index in that group, or None."""
        return self._where.get(id(tensor))

    def stats(self) -> dict:
        on_host = sum(g.nbytes for g in self.groups if g.place is Place.RELEASED)
        tracked = sum(g.nbytes for g in self.groups)
        kept = sum(t.numel() * t.element_size() for _, t, _ in self._kept_resident)
        payload = sum(g.payload_bytes for g in self.groups if g.place is Place.RELEASED)
        return {
            "tracked_bytes": tracked,
            "offloaded_bytes": on_host,
            "offloaded_payload_bytes": payload,
            "resident_bytes": tracked - on_host + kept,
            # The arena, and host buffers handed over with ``adopt`` until the arena takes them.
            "host_bytes": self._host.nbytes
            + sum({id(b): b.numel() for *_, b in self._adopted.values()}.values()),
            "kept_resident_bytes": kept,
            "unreleasable_bytes": self.unreleasable_bytes,
            "groups": len(self.groups),
            "pieces": count_by_kind(self.groups),
            "largest_piece_bytes": max((g.nbytes for g in self.groups), default=0),
            "max_piece_bytes": self._max_piece_bytes,
            "tensors": sum(len(g.tensors) for g in self.groups),
            "d2h_copies": self.last.d2h_copies,
            "h2d_copies": self.last.h2d_copies,
            "d2h_bytes": self.last.d2h_bytes,
            "h2d_bytes": self.last.h2d_bytes,
            "offload_seconds": self.last.offload_seconds,
            "reload_seconds": self.last.reload_seconds,
            "update_chunks": self.last.update_chunks,
            "update_copies": self.last.update_copies,
            "update_bytes": self.last.update_bytes,
            **self.times.read(),
        }

    # --------------------------------------------------------------- the cycle
    def offload(
        self,
        kinds: Iterable[str] | None = None,
        *,
        skip_unchanged: bool = False,
        release: bool = False,
    ) -> None:
        """Start copying the selected groups to the host (asynchronous on accelerators).

        Groups already offloading or released are left alone. With ``skip_unchanged``, a
        group whose host copy is still valid is not copied again (rule 6). With ``release``,
        each piece's device memory is released right after its own copy is queued, so the
        allocator may hand it out again once that copy is done (progressive reuse); the
        same as ``release()`` afterwards, where every piece waits for the last copy.
        """
        if self._closed:
            raise self._closed_error()
        start = time.perf_counter()
        # The tensors may have changed (states made by the first step, replaced by a load):
        # the fingerprint says so cheaply, and the groups are then laid out again.
        fingerprint = self.fingerprint() if self.fingerprint is not None else _NEVER
        if fingerprint is _NEVER or fingerprint != self._last_fingerprint:
            self._rescan(fingerprint)
        groups = self.groups if kinds is None else self._select(kinds)
        selected = [g for g in groups if g.place in (Place.RESIDENT, Place.RELOADING)]
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
            for group in to_copy:
                # Rule 1: the D2H must see everything the current stream wrote (the step).
                # Once per piece: the host calls between two pieces (record_stream, the
                # release) are device calls too, and nothing may be assumed about what the
                # current stream queued around them. It costs one event wait per piece.
                self.device.wait_stream(side, current, label=D2H_AFTER_WRITERS)
                for user in users:
                    # ... and everything the streams the step may have run on wrote.
                    self.device.wait_stream(side, user, label=D2H_AFTER_USERS)
                with self.device.use_stream(side):
                    if timed is None:  # after the waits: the transfers alone are timed
                        timed = self.device.record_event(side, timing=True)
                    if group.flat is not None:
                        self.device.copy(group.host, group.flat)
                        self.last.d2h_copies += 1
                        self.last.d2h_bytes += group.nbytes
                    else:  # first cycle: the tensors still have their own storages
                        for tensor, host in group.host_slices():
                            self.device.copy(host, tensor)
                            self.last.d2h_copies += 1
                            self.last.d2h_bytes += tensor.numel() * tensor.element_size()
                    event = self.device.record_event(side, timing=group is to_copy[-1])
                # Rule 5: the arena is not given back before this copy is done, even if a
                # later piece's release raises before the loop ends.
                self._host.last_d2h = event
                group.d2h_event = event
                group.host_valid = True
                group.place = Place.OFFLOADING
                group.d2h_waiters = []  # a user must wait for this D2H before writing again
                # Rule 2: the side stream reads this memory; tell the allocator before any
                # release so it is not handed out again until the copy is done.
                for tensor in (group.flat,) if group.flat is not None else group.tensors:
                    self.device.record_stream(tensor, side, label=D2H_RECORD_STREAM)
                group.announced = True  # until its memory is freed (see ``close``)
                if release:
                    # Freed now, before the next piece's copy is queued: the caching
                    # allocator marks a block freed under record_stream reusable once the
                    # work queued on the recorded stream AT THE FREE has run, i.e. once this
                    # piece's own copy is done, not the copies queued after it.
                    self._release_group(group)
            self.times.pending["d2h"].append((timed, event, self.last.d2h_bytes))
        for group in selected:
            if group.place is not Place.RELEASED:
                group.place = Place.OFFLOADING
                if release:
                    self._release_group(group)
        if all(g.place is Place.RELEASED for g in self.groups):
            self._users = []  # nothing left on the device for them to have written
        self.last.offload_seconds = time.perf_counter() - start

    def release(self, kinds: Iterable[str] | None = None) -> None:
        """Return the device memory of the selected groups that were offloaded."""
        if self._closed:
            raise self._closed_error()
        start = time.perf_counter()
        selected = list(self._select(kinds))
        if selected and not any(g.place in (Place.OFFLOADING, Place.RELEASED) for g in selected):
            raise OffloadStateError(
                f"{self.name}: release() before offload(): the states have no host copy yet. "
                "Call offload() first."
            )
        for group in selected:
            if group.place is Place.OFFLOADING:
                self._release_group(group)
        self.last.offload_seconds += time.perf_counter() - start

    def _release_group(self, group: FlatGroup) -> None:
        if group.flat is not None:
            if not group.flat.untyped_storage().resizable():
                raise OffloadStateError(
                    f"{self.name}: the memory of the {group.kind} ({group.dtype}) cannot be "
                    "released because something made it non-resizable (on CPU, "
                    "Tensor.numpy() of a state tensor does). Keep copies instead "
                    "(tensor.clone().numpy()), or leave these states on the device."
                )
            self.device.release(group.flat)
        else:
            kept = release_separate_storages(self.device, group.tensors)
            self.unreleasable_bytes += kept
            # Other owners keep storages the D2H stream was announced to (see ``close``).
            self._announced_elsewhere = self._announced_elsewhere or (kept > 0 and group.announced)
        group.announced = False
        group.place = Place.RELEASED
        group.used_on = []

    def reload(
        self,
        kinds: Iterable[str] | None = None,
        *,
        streamed: bool = True,
        groups: Sequence[FlatGroup] | None = None,
    ) -> None:
        """Regrow the released groups and start copying them back (asynchronous on accelerators).

        The data may be used only after ``wait`` (which the caller of the step does).
        ``streamed=False`` leaves the groups of streamed tensors on the host. ``groups``:
        these pieces instead of the ones ``kinds`` and ``streamed`` select.
        """
        if self._closed:
            raise self._closed_error()
        start = time.perf_counter()
        if groups is not None:
            selected = groups
        else:
            selected = self.groups if kinds is None and streamed else self._select(kinds, streamed)
        # An offloading group still has its device memory: it only has to become resident.
        # Its D2H may still be reading that memory, and the next writer (the step) runs on
        # the current stream, so the current stream waits for the D2H first.
        current = self.device.current_stream()
        for group in selected:
            if group.place is Place.OFFLOADING:
                if group.d2h_event is not None:
                    self.device.wait_event(current, group.d2h_event, label=WRITE_AFTER_D2H)
                    group.d2h_waiters.append(current)
                group.place = Place.RESIDENT
        released = [g for g in selected if g.place is Place.RELEASED]
        if not released:
            return  # nothing to copy: the figures stay those of the last reload that copied
        self.last.h2d_copies = self.last.h2d_bytes = 0
        # Rule 7: memory is regrown on the home stream (the allocator's stream of the
        # block, whose pool the memory goes back to when it is released again); ``wait``
        # announces any other stream that uses it.
        home = self._home_stream if self._home_stream is not None else current
        with self.device.use_stream(home):
            for group in released:
                if group.flat is not None:
                    self.device.regrow(group.flat, group.nbytes)
                else:
                    group.consolidate(self.device.empty(group.numel, group.dtype))
                group.alloc_stream = home
                group.used_on = []
        side = self._h2d_stream if self._h2d_stream is not None else self.side_stream("h2d")
        # The regrown blocks may have been used by work still queued on the home stream
        # (the allocator reuses memory in stream order): the H2D must come after it. The
        # D2H that filled the host copy must also be complete before the H2D reads it.
        self.device.wait_stream(side, home, label=H2D_AFTER_ALLOCATION)
        for group in released:
            if group.d2h_event is not None:
                self.device.wait_event(side, group.d2h_event, label=H2D_AFTER_D2H)
        with self.device.use_stream(side):
            timed = self.device.record_event(side, timing=True)  # after the waits
            for group in released:
                self.device.copy(group.flat, group.host)
                self.last.h2d_copies += 1
                self.last.h2d_bytes += group.nbytes
                # One event per piece: a reader waits for the pieces it uses.
                group.h2d_event = self.device.record_event(side, timing=group is released[-1])
        self._host.last_h2d = released[-1].h2d_event
        self.times.pending["h2d"].append((timed, released[-1].h2d_event, self.last.h2d_bytes))
        for group in released:
            # No record_stream for the H2D's writes: nothing frees this memory before the
            # H2D is ordered before the current stream (offload, rebuild and close wait for
            # it first) or the host has waited for it (a dropped engine's finalizer).
            group.d2h_event = None  # the H2D waited for it, so the host copy is complete
            group.place = Place.RELOADING
        self.last.reload_seconds = time.perf_counter() - start

    def wait(self, kinds: Iterable[str] | None = None) -> None:
        """Order every pending H2D before the current stream (rule 4), which may then use
        the selected states (read and write them), whichever stream it is."""
        groups = self.groups if kinds is None else self._select(kinds)
        current = self.device.current_stream()
        if current not in self._users:
            self._users.append(current)
        if self._home_stream is None:
            self._home_stream = current  # the update runs here: it allocates its states here
        for group in groups:
            if group.place is Place.RELEASED:
                continue
            if current not in group.used_on:
                group.used_on.append(current)
                if group.alloc_stream is not None and group.alloc_stream != current:
                    # Rule 2: regrown on another stream, the allocator knows only that one; a
                    # release (from any stream) would hand the block out under this one's work.
                    for tensor in (group.flat,) if group.flat is not None else group.tensors:
                        self.device.record_stream(tensor, current, label=USE_RECORD_STREAM)
            if (
                group.place is Place.RESIDENT
                and group.d2h_event is not None
                and current not in group.d2h_waiters
            ):
                # Kept in place by a reload on another stream, which waited for this D2H:
                # this stream writes the memory next, so it waits too.
                self.device.wait_event(current, group.d2h_event, label=USER_AFTER_D2H)
                group.d2h_waiters.append(current)
        self._wait_groups(groups, current)

    def synchronize_host(self, kinds: Iterable[str] | None = None) -> None:
        """Block until every pending D2H completed, so the host copies may be read (rule 5)."""
        for group in self._select(kinds):
            if group.d2h_event is not None:
                self.device.synchronize_event(group.d2h_event, label=HOST_READ_AFTER_D2H)
                group.d2h_event = None

    def mark_dirty(self) -> None:
        """The device copies are about to change (a step): host copies become stale."""
        for group in self.groups:
            group.host_valid = False

    def close(self) -> None:
        """Bring everything back to the device and free the host arena."""
        if self._closed:
            return
        if any(g.place is Place.RELEASED for g in self.groups):
            raise OffloadStateError(
                f"{self.name}: cannot close while states are released; reload() first."
            )
        self.wait()
        self._free_arena()
        # Memory announced to the D2H stream outlives this engine where a group was offloaded
        # and never released (its storage stays with the optimizer) or where other owners kept
        # a storage: the allocator records an event on the stream when that memory is freed.
        announced = self._announced_elsewhere or any(g.announced for g in self.groups)
        for stream, named in ((self._d2h_stream, announced), (self._h2d_stream, False)):
            if stream is not None:
                self.device.retire_stream(stream, announced=named)
        self.groups = ()
        self._tracked = []
        self._where = {}
        forget = getattr(self.fingerprint, "forget", None)
        if forget is not None:
            forget()
        self.fingerprint = None
        self._closed = True

    # ----------------------------------------------------------------- helpers
    def _select(self, kinds: Iterable[str] | None, streamed: bool = True):
        groups = self.groups if streamed else [g for g in self.groups if not g.streamed]
        if kinds is None:
            return groups
        wanted = set(kinds)
        return [g for g in groups if g.kind in wanted]

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

    def _wait_groups(self, groups: list[FlatGroup], current=None) -> None:
        waited = set()
        before = None
        for group in groups:
            if group.place is not Place.RELOADING:
                continue
            if id(group.h2d_event) not in waited:
                if before is None:
                    current = current or self.device.current_stream()
                    # Exposed time: from where the current stream reaches the waits to
                    # where it may go on (timing events on the current stream).
                    before = self.device.record_event(current, timing=True)
                self.device.wait_event(current, group.h2d_event, label=USE_AFTER_H2D)
                waited.add(id(group.h2d_event))
            group.h2d_event = None
            group.place = Place.RESIDENT
        if before is not None:
            self.times.pending["exposed"].append(
                (before, self.device.record_event(current, timing=True), 0)
            )

    def _free_arena(self) -> None:
        for group in self.groups:
            group.d2h_event = None
            group.host = None
        self._host.free()

    def __repr__(self) -> str:
        places = ", ".join(f"{g.kind}/{g.dtype}:{g.place.value}" for g in self.groups)
        return f"OffloadEngine({self.name}: {places or 'empty'})"
