"""The offload engine: moves one set of tensors between device and host memory.

The engine knows nothing about optimizers. ``collect`` returns ``(kind, tensor)`` pairs
(``kind`` names what the tensor is, e.g. ``"optimizer_states"``); the ``Layout`` pieces
them by kind and dtype into pieces of at most ``max_piece_bytes`` (``Piece``), one
exactly-sized host arena holds them all (``HostArena``), and each piece moves with one copy
per direction once consolidated (``pieces.py``; the copies: ``protocol.py``). Copies per
cycle are therefore bounded by bytes / piece size plus the number of pieces, whatever the
number of tensors. When the tensors change (new states appear) the pieces are laid out
again; pieces whose only copy is on the host stay released and their bytes move into the
new layout. Tensors a caller put on the host itself join through ``adopted``.

The engine is made of parts it owns: the ``Layout`` (which tensors, in which pieces), the
``HostArena`` (their host bytes), the ``CopyProtocol`` (every move of the pieces, in order;
``copies``) and ``Adopted``. Its moves (``offload``, ``release``, ``reload``, ``wait``...) are
the protocol's, with the layout looked at again first where the tensors may have changed.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch

from ..device import Device
from ..errors import OffloadStateError, out_of_memory
from .adopted import Adopted
from .figures import piece_figures
from .host import HostArena, HostBudget
from .labels import HOST_READ_AFTER_D2H
from .layout import DEFAULT_MAX_PIECE_BYTES, Collect, Layout, check_no_aliasing, unmovable_reason
from .pieces import Piece, Place, owns_storage
from .protocol import CopyProtocol


class OffloadEngine:
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
            as that piece's copy is done, not when the whole piece's is. None: one storage
            per kind and dtype. Lowered to the device's ``piece_bound()`` (the allocator's
            ``max_split_size_mb``) where that is smaller.
        in_place: returns the tensors whose own storage is released and regrown, never
            re-pointed, because other tensors view it (an in-place piece each, see
            ``pieces.py``): each must be contiguous and cover its whole storage.
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
        in_place: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        self.device = device
        self.name = name
        #: The host arena, and the newest copy into or out of it on each side stream.
        self.host = HostArena(device, budget)
        #: Every copy, event, stream wait and release of the pieces, and when to lay them
        #: out again (its ``fingerprint``).
        self.copies = CopyProtocol(
            device, name=name, host=self.host, fingerprint=fingerprint, relayout=self._relayout
        )
        # The moves are the protocol's own methods: nothing in between on the step's path.
        copies = self.copies
        self.offload, self.release, self.reload, self.wait = (
            copies.offload,
            copies.release,
            copies.reload,
            copies.wait,
        )
        self.synchronize_host, self.mark_dirty, self.side_stream = (
            copies.synchronize_host,
            copies.mark_dirty,
            copies.side_stream,
        )
        self.is_released, self.fully_released = copies.is_released, copies.fully_released
        self.invalidate, self.rescan = copies.invalidate, copies.rescan
        self._layout = Layout(
            device,
            collect,
            name=name,
            fraction=fraction,
            streamed=streamed,
            max_piece_bytes=max_piece_bytes,
            in_place=in_place,
        )
        #: Advances whenever the pieces are laid out again.
        self.generation = 0
        #: Bytes of tensors ``collect`` returned that a failed layout left untracked.
        self.unlaid_bytes = 0
        #: Tensors whose only copy someone else put on the host, until the next layout.
        self.adopted = Adopted(
            device, self.host.budget, changed=copies.invalidate, side=copies.side_stream
        )
        # An engine dropped with copies in flight still waits for them before its arena is
        # freed: the arena is an object of its own, and this finalizer holds only it.
        weakref.finalize(self, self.host.free)

    # ----------------------------------------------------------------- queries
    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The pieces, in layout order (the protocol's; replaced whenever the layout changes)."""
        return self.copies.pieces

    @property
    def host_arena(self) -> torch.Tensor | None:
        """The host arena (a 1-D uint8 tensor; None before the first layout or reservation),
        for inspection: its pages, its mapping. The engine owns what is in it."""
        return self.host.buffer

    @property
    def budget(self) -> HostBudget:
        """The ``HostBudget`` the engine's host memory comes from and counts against (its
        ``limit`` None: no limit)."""
        return self.host.budget

    @property
    def kept_resident(self) -> list[tuple[str, torch.Tensor, str]]:
        """``(kind, tensor, why)`` of the tensors ``collect`` returned that stay on the device."""
        return list(self._layout.kept_resident)

    def movable(self, tensor: torch.Tensor) -> bool:
        """True if the engine would move ``tensor`` (a plain, contiguous tensor of its device)."""
        return not unmovable_reason(tensor, self.device)

    def stageable(self, tensor: torch.Tensor) -> bool:
        """True if ``stage_out`` can take ``tensor``: movable, not empty, the only user of
        its storage (a view of other memory cannot be released alone)."""
        return self.movable(tensor) and tensor.numel() > 0 and owns_storage(tensor)

    def locate(self, tensor: torch.Tensor) -> tuple[Piece, int] | None:
        """The piece tracking ``tensor`` and its index in that piece, or None."""
        return self._layout.locate(tensor)

    def stats(self) -> dict:
        kept = sum(t.numel() * t.element_size() for _, t, _ in self._layout.kept_resident)
        figures = piece_figures(self.pieces, Place.RELEASED)
        return {
            **figures,
            "resident_bytes": figures["tracked_bytes"]
            - figures["offloaded_bytes"]
            + kept
            + self.unlaid_bytes,
            # The arena, and host buffers handed over with ``adopt`` until the arena takes them.
            "host_bytes": self.host.nbytes + self.host.staging_nbytes + self.adopted.nbytes,
            # The disk tier's file (``offload_disk_dir``), and how much of it is in the page
            # cache now (host memory too, bounded by one piece between copies).
            "disk_bytes": self.host.disk_nbytes + self.adopted.disk_nbytes,
            "disk_resident_bytes": 0 if self.host.disk is None else self.host.disk.resident_bytes(),
            "kept_resident_bytes": kept,
            # Tensors a layout that failed (out of memory) left on the device, untracked.
            "unlaid_bytes": self.unlaid_bytes,
            "unreleasable_bytes": self.copies.unreleasable_bytes,
            "max_piece_bytes": self._layout.max_piece_bytes,
            **self.copies.last.figures(),
            **self.copies.times.read(),
        }

    # ------------------------------------------------------------------ the layout
    def _relayout(self) -> None:
        current = self._layout.look()
        if current is None:
            return
        try:
            self._lay_out(current)
        except BaseException as error:
            # All or nothing: the allocations come before anything changes (a mixed piece
            # brought back is consistent on its own), so the old pieces, their places and the
            # arena are as they were. The tensors the new layout would have added stay on the
            # device, counted as resident, and the next offload lays them out again.
            tracked = {id(t) for g in self.pieces for t in g.tensors} | set(self.adopted.copies())
            self.unlaid_bytes = sum(
                t.numel() * t.element_size() for _, t in current if id(t) not in tracked
            )
            needed = sum(t.numel() * t.element_size() for _, t in current)
            raise out_of_memory(error, self.device, f"{self.name}: offload (a new layout)", needed)
        self.unlaid_bytes = 0

    def _lay_out(self, current) -> None:
        plan = self._layout.plan(current)
        # A piece is described by one place, so it cannot mix tensors whose only copy is on
        # the host with tensors on the device (a new state beside released ones): the former
        # come back to the device first.
        on_host = self._host_copies()
        mixed = {
            id(t)
            for *_, tensors in plan
            if any(id(t) in on_host for t in tensors) and not all(id(t) in on_host for t in tensors)
            for t in tensors
        }
        if mixed:
            self.reload(
                pieces=[
                    g
                    for g in self.pieces
                    if g.place is Place.RELEASED and any(id(t) in mixed for t in g.tensors)
                ]
            )
            self.adopted.restore(mixed)
            on_host = self._host_copies()
        self.wait()
        check_no_aliasing(current, self.name)
        pieces = self._layout.arrange(plan, self.pieces, on_host)
        # Rule 5: the host reads the old copies, so the copies into them must be done.
        for _, event in on_host.values():
            if event is not None:
                self.device.synchronize_event(event, label=HOST_READ_AFTER_D2H)
        for piece in self.pieces:
            piece.d2h_event = None
        # Groups made only of host copies stay released; their bytes move into the arena.
        carried = [g for g in pieces if g.place is Place.RELEASED]
        sources = {key: host for key, (host, _) in on_host.items()}
        self.host.lay_out(pieces, carried, sources, name=self.name)
        self.adopted.laid_out()
        self.copies.take_pieces(pieces)
        self._layout.laid_out(current, pieces)
        self.generation += 1

    def _host_copies(self) -> dict[int, tuple[torch.Tensor, object]]:
        """Where the bytes of every tensor that has no device memory are: id -> (host, event)."""
        copies = {}
        for piece in self.pieces:
            if piece.place is Place.RELEASED:
                for tensor, host in piece.host_slices():
                    copies[id(tensor)] = (host, piece.d2h_event)
        copies.update(self.adopted.copies())
        return copies

    def place_on_disk(self, on_disk: bool) -> None:
        """Lay the pieces out again with every host copy in the disk tier's file
        (``on_disk``; the arena given back) or where the budget places them (the arena
        allocated again), carrying the released pieces' bytes: ``sleep(to="disk")`` and its
        wake. All or nothing: a refused file or arena leaves the layout as it was, and the
        same call works again."""
        if self.budget.disk is None:
            raise OffloadStateError(
                f"{self.name}: there is no disk tier to place the host copies in: pass "
                "offload_disk_dir (--offload-disk-dir) to attach."
            )
        if self.host.everything_on_disk == on_disk:
            return
        current = self._layout.look() or self._layout.tracked
        self.host.everything_on_disk = on_disk
        try:
            if current:
                self._lay_out(current)
        except BaseException as error:
            self.host.everything_on_disk = not on_disk
            needed = sum(t.numel() * t.element_size() for _, t in current)
            where = "the disk tier" if on_disk else "host memory"
            raise out_of_memory(error, self.device, f"{self.name}: moving to {where}", needed)

    def check_disk(self) -> None:
        """Read the released pieces in the disk tier's file with ``pread`` before something
        reads them through the mapping (a checkpoint served from the host copy): an I/O
        error raises ``DiskTierError`` here, where through the mapping it is a SIGBUS."""
        for piece in self.pieces:
            if piece.disk is not None and piece.place is Place.RELEASED:
                piece.disk.check_readable(piece.host)

    def settle_disk(self) -> None:
        """After the host copies were written through the mapping (a load served into them):
        the disk tier's file written back and its pages dropped from host memory. (Pages only
        read stay cached until the next offload drops them: a state dict served from the host
        copy is read by its writer after the view closed.)"""
        if self.host.disk is not None:
            self.host.disk.write_back(
                then="What was written into the host copies may not be on the disk: make "
                "the same call again (a load: load the checkpoint again)."
            )

    def host_need(self, expected) -> int:
        """The host bytes ``reserve_host(expected)`` would allocate (``Layout.host_need``),
        allocating nothing: what a node-wide check adds up before any rank allocates."""
        return self._layout.host_need(expected)

    def reserve_host(self, expected) -> int:
        """Allocate (and pin) the host arena now for the layout the first offload will make
        (``expected`` as for ``host_need``; the first layout reuses it when it fits). None or
        an arena already there: nothing is reserved. A budget too small for it raises
        ``HostMemoryBudgetError`` before anything is allocated. Returns the bytes reserved."""
        if expected is None or self.copies.closed or self.host.buffer is not None:
            return 0
        need = self.host_need(expected)
        return need if self.host.reserve(need, self.name) else 0

    def close(self) -> None:
        """Bring everything back to the device, free the host arena, forget the tensors."""
        if self.copies.closed:
            return
        if any(g.place is Place.RELEASED for g in self.pieces):
            raise OffloadStateError(
                f"{self.name}: cannot close while states are released; reload() first."
            )
        self.wait()
        for piece in self.pieces:
            piece.d2h_event = None
            piece.host = None
        self.host.free()
        self.copies.retire()
        forget = getattr(self.copies.fingerprint, "forget", None)
        if forget is not None:
            forget()  # it may hold the caller's containers
        self.copies.fingerprint = None
        self._layout.forget()

    def __repr__(self) -> str:
        places = ", ".join(f"{g.kind}/{g.dtype}:{g.place.value}" for g in self.pieces)
        return f"{type(self).__name__}({self.name}: {places or 'empty'})"
