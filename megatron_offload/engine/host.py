"""Host memory: the one allocator every host buffer comes from (``HostBudget``, with the
limit shared by one offloader's engines), each engine's exactly-sized arena (``HostArena``),
and the buffers carved for everything else (``HostBuffers``).

The arena is the only host memory an engine holds for its pieces (each piece has a slice of
it). It remembers the newest copy into or out of it on each side stream, so that it is
never given back (or replaced) while a copy still uses it (protocol rule 5). The budget
counts every buffer once, whoever holds it, and checks before anything is allocated,
against the peak of a change: while a layout is rebuilt the old and the new arena (or the
bytes moved aside to rewrite one in place) are held together.

The arena may be allocated (and pinned, which is slow) ahead of the first offload
(``reserve``, from ``OffloadEngine.reserve_host``); a later layout reuses it when it fits
(``fits``) instead of allocating again.

Host memory beyond the arena (the chunked update's first-step staging and its undo journal,
sleep's copies of the parameters, the states a load put on the host) is carved from
``HostBuffers``: few buffers, each carved in order, never one per tensor, since every host
buffer is pinned on an accelerator and pinning costs a system call and page-table work per
buffer.
"""

from __future__ import annotations

import torch

from ..device import Device
from .disk import DiskFile, DiskTier, fault_in, page_size, staging_bytes
from .labels import HOST_FREE_AFTER_COPIES

#: A layout reuses the arena if the arena is at most 1/REUSE_SLACK larger than it needs.
REUSE_SLACK = 8


from ..errors import HostMemoryBudgetError  # noqa: E402,F401 - raised here; every exception lives in errors.py


class HostBudget:
    """The one allocator of host memory, and its limit.

    Every host buffer the package holds (the engines' arenas, the chunked update's staging
    and undo journal, sleep's copies of the parameters, states adopted from a load) is
    allocated by ``allocate`` and given back by ``free``: counted once per buffer, whoever
    holds it at the moment (a staging buffer handed to the engine stays the same buffer),
    and bounded by ``limit`` (``host_memory_budget``; None: no limit). One budget is shared
    by one offloader's engines.
    """

    def __init__(self, limit: int | None, disk: DiskTier | None = None) -> None:
        self.limit = limit
        #: Where the host copies ``limit`` cannot hold go (``offload_disk_dir``; None: they
        #: are refused): the arenas' pieces (``HostArena.spill``) and the buffers allocated
        #: with ``spill`` (``HostBuffers``: staging, sleep's copies).
        self.disk = disk
        self._buffers: dict[int, torch.Tensor] = {}  # id -> the buffer, until given back
        self._files: dict[int, DiskFile] = {}  # id of a buffer -> its file, when spilled

    def files(self) -> list[DiskFile]:
        """The disk tier's files of the buffers ``allocate`` spilled."""
        return list(self._files.values())

    def room(self) -> int | None:
        """Bytes still free under ``limit`` (None: no limit)."""
        return None if self.limit is None else max(self.limit - self.held, 0)

    @property
    def held(self) -> int:
        """Bytes of the buffers allocated and not given back."""
        return sum(buffer.numel() for buffer in self._buffers.values())

    def check(self, nbytes: int, name: str, *, moving: int = 0, relayout: bool = False) -> None:
        """Refuse (``HostMemoryBudgetError``) if ``nbytes`` more would not fit beside what is
        held, plus ``moving`` bytes held for a moment. ``relayout``: a layout change, which
        holds the previous host copies (in what is held, or set aside: ``moving``) while their
        bytes move."""
        if self.limit is None:
            return
        held = self.held
        if (moving or relayout) and held + nbytes + moving > self.limit:
            raise HostMemoryBudgetError(
                f"{name}: laying the states out again needs {nbytes + moving:,} more bytes of "
                f"host memory at once (the new layout {nbytes:,}, the previous host copies set "
                f"aside {moving:,}) while the {held:,} already held (the previous arena among "
                f"them) are held too, over host_memory_budget={self.limit:,}. Nothing was freed "
                "or allocated. Raise host_memory_budget, or offload less: offload_fraction, "
                "per_optimizer, or offload_master_weights=False."
            )
        if held + nbytes > self.limit:
            raise HostMemoryBudgetError(
                f"{name}: offloading needs {nbytes:,} bytes of host memory ({held:,} already "
                f"held by the other optimizers and buffers), over host_memory_budget="
                f"{self.limit:,}. Nothing was allocated. Raise host_memory_budget, or offload "
                "less: offload_fraction, per_optimizer, or offload_master_weights=False."
            )

    def allocate(
        self,
        device: Device,
        nbytes: int,
        name: str,
        *,
        relayout: bool = False,
        spill=False,
        to_disk=False,
        io=False,
    ):
        """A host buffer of ``nbytes`` from ``device`` (pinned on accelerators), checked
        first (``check``) and counted until ``free``. ``spill``: where the limit cannot hold
        it and there is a disk tier, a file of the disk tier instead (not counted in
        ``held``; ``files`` lists them); ``to_disk``: such a file whatever the limit.
        ``io``: a buffer that direct I/O moves through (``Device.io_buffer``)."""
        over = spill and self.room() is not None and nbytes > self.room()
        if self.disk is not None and (to_disk or over):
            file = self.disk.file(nbytes)
            self._files[id(file.buffer)] = file
            return file.buffer
        self.check(nbytes, name, relayout=relayout)
        buffer = device.io_buffer(nbytes) if io else device.host_buffer(nbytes)
        self._buffers[id(buffer)] = buffer
        return buffer

    def free(self, device: Device, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back (the caller has waited for every copy into or out of it)."""
        file = self._files.pop(id(buffer), None)
        if file is not None:
            file.close()
            return
        device.free_host_buffer(buffer)
        self._buffers.pop(id(buffer), None)


def disk_span(piece) -> int:
    """Bytes of ``piece``'s range in a disk tier file: whole pages, so that every piece starts
    on a page boundary, as direct I/O wants (``DiskFile.write``)."""
    page = page_size()
    return -(-piece.host_nbytes // page) * page


def disk_file_of(tensor: torch.Tensor, files) -> DiskFile | None:
    """The one of ``files`` (``DiskFile`` or None each) whose mapping ``tensor`` is in."""
    for file in files:
        if file is not None and file.owns(tensor):
            return file
    return None


class HostArena:
    """The engine's one host buffer, and the newest copy using it on each side stream; with a
    disk tier (``budget.disk``), also the file holding the pieces the budget cannot."""

    def __init__(self, device: Device, budget: HostBudget | None = None) -> None:
        self.device = device
        self.budget = budget if budget is not None else HostBudget(None)
        self.buffer: torch.Tensor | None = None
        self.retired: torch.Tensor | None = None  # the previous buffer, while its bytes move
        #: The disk tier's file for the pieces host memory cannot hold (None: none spilled).
        self.disk: DiskFile | None = None
        self.retired_disk: DiskFile | None = None  # the previous file, while its bytes move
        #: The host buffer the copies to and from ``disk`` go through (``DiskFile.write``),
        #: counted against the budget; None while nothing is spilled.
        self.staging: torch.Tensor | None = None
        # Bytes ``reserve`` allocated for a layout still to come, until a layout that large is
        # laid out: the smaller layouts before it (the masters alone, offloaded at attach
        # before the first step makes the states) reuse the buffer instead of replacing it.
        self.reserved_for = 0
        #: Every piece's host copy goes to the disk tier at the next layout, whatever the
        #: budget holds (``sleep(to="disk")``: ``OffloadEngine.place_on_disk``).
        self.everything_on_disk = False
        # Side streams run in order, so the newest event of each covers every earlier copy.
        self.last_d2h = None
        self.last_h2d = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    @property
    def disk_nbytes(self) -> int:
        """Bytes of the disk tier's file (0: none)."""
        return 0 if self.disk is None else self.disk.nbytes

    def fits(self, nbytes: int) -> bool:
        """True if a layout of ``nbytes`` should reuse the current buffer: it is large
        enough, and not so much larger that keeping it would hold memory for nothing."""
        if self.buffer is None or nbytes > self.nbytes:
            return False
        return nbytes <= self.reserved_for or self.nbytes <= nbytes + nbytes // REUSE_SLACK

    def reserve(self, nbytes: int, name: str) -> bool:
        """Allocate a buffer of ``nbytes`` now, for a layout to come (only when the arena has
        none); True if one was allocated. A budget that cannot hold it is refused here,
        before anything is allocated (``HostMemoryBudgetError``), not at the first offload,
        which runs inside a training step. With a disk tier, what the budget cannot hold is
        a file allocated now instead (a full disk raises ``DiskTierError`` here)."""
        if self.buffer is not None or nbytes <= 0:
            return False
        room = self.budget.room() if self.budget.disk is not None else None
        on_host = nbytes if room is None else min(nbytes, room)
        if on_host < nbytes:  # the staging for the copies to disk comes out of the budget too
            on_host = max(0, min(nbytes, room - staging_bytes(nbytes, self.budget.limit)))
            self.disk = self.budget.disk.file(nbytes - on_host)
        try:
            if self.disk is not None:
                self._stage(staging_bytes(nbytes, self.budget.limit), name)
            if on_host:
                self.replace(on_host, name)
        except BaseException:
            self._unstage()
            if self.disk is not None:
                self.disk.close()
                self.disk = None
            raise
        self.reserved_for = on_host
        return True

    def spill(self, pieces) -> list:
        """The pieces whose host copies go to the disk tier: none without one or while the
        budget holds them all; otherwise the largest first, until the rest and the staging
        the copies to disk go through fit the budget (the largest, since a file is read and
        written fastest in long runs). The arena's own bytes count as room when the arena
        can be reused for the rest, and so does a staging buffer held (kept or replaced)."""
        if self.budget.disk is None or not pieces:
            return []
        if self.everything_on_disk:
            return list(pieces)
        if self.budget.limit is None:
            return []
        need = sum(g.host_nbytes for g in pieces)
        largest = sorted(pieces, key=lambda g: g.host_nbytes, reverse=True)
        staging = max(staging_bytes(largest[0].host_nbytes, self.budget.limit), self.staging_nbytes)

        def choose(room: int) -> tuple[list, int]:
            spilled, left = [], need
            for piece in largest:
                if left <= room:
                    break
                spilled.append(piece)
                left -= piece.host_nbytes
            return spilled, left

        free = self.budget.room() + self.staging_nbytes
        for room in (free + self.nbytes, free):  # the arena reused, or a new one beside it
            spilled, left = choose(room)
            if spilled:
                spilled, left = choose(max(room - staging, 0))
            if room == free or self.fits(left):
                return spilled
        return spilled  # pragma: no cover - the loop returns

    @property
    def staging_nbytes(self) -> int:
        return 0 if self.staging is None else self.staging.numel()

    def _stage(self, nbytes: int, name: str) -> None:
        """Hold a staging buffer of at least ``nbytes`` (counted against the budget)."""
        if self.staging_nbytes >= nbytes:
            return
        self._unstage()
        self.staging = self.budget.allocate(
            self.device, nbytes, f"{name}: disk tier staging", io=True
        )
        fault_in(self.staging)  # its pages in long physical runs, for the direct writes

    def _unstage(self) -> None:
        if self.staging is not None:
            self._synchronize()  # no copy uses it any more
            self.budget.free(self.device, self.staging)
            self.staging = None

    def lay_out(self, pieces, carried, sources: dict, *, name: str) -> None:
        """Give every piece its range of the arena (or, spilled, of the disk tier's file), in
        order; the pieces in ``carried`` keep their host bytes, found in ``sources``
        (``{id(tensor): host tensor}``: the old arena or file, or buffers handed over; their
        copies are complete).

        The arena is reused when the layout fits it (the carried bytes set aside first: their
        new places may overlap their old ones); otherwise a new one is allocated while the old
        one still holds the bytes to carry. Either way the peak is checked against the budget
        before anything is freed or allocated. A file is reused when the spilled pieces fit
        it and nothing carried is read from it; otherwise a new one is allocated first.
        """
        spilled = {id(g) for g in self.spill(pieces)}
        need = sum(g.host_nbytes for g in pieces if id(g) not in spilled)
        disk_need = sum(disk_span(g) for g in pieces if id(g) in spilled)
        disk = self._file_for(disk_need, carried, sources)
        try:
            if disk is not None and not self.everything_on_disk:
                self._stage(
                    staging_bytes(max(g.host_nbytes for g in pieces), self.budget.limit), name
                )
            elif disk is None:
                self._unstage()  # nothing spilled: its room may be the arena's now
            # Everything on disk: nothing left for the arena, which goes (not reused).
            reuse = self.fits(need) and not self.everything_on_disk
            if need >= self.reserved_for or self.everything_on_disk:
                self.reserved_for = 0  # the layout the reservation was for has come
            if reuse:
                arena = self.buffer
                self._place(pieces, spilled, arena, disk)
                base = arena.untyped_storage().data_ptr()
                # Carried bytes whose new place is not their old one are set aside (copies)
                # for a moment, since the places may overlap: checked before any.
                aside = [
                    tensor
                    for piece in carried
                    for tensor, host in piece.host_slices()
                    if sources[id(tensor)].untyped_storage().data_ptr() == base
                    and sources[id(tensor)].data_ptr() != host.data_ptr()
                ]
                moving = sum(t.numel() * t.element_size() for t in aside)
                self.budget.check(0, name, moving=moving)
                # Rule 5: the host rewrites the arena below, while a copy of the old layout
                # may still read or write it.
                self._synchronize()
                for tensor in aside:
                    sources[id(tensor)] = sources[id(tensor)].clone()
            else:
                # Allocated while the old arena still holds the bytes to carry: both counted.
                arena = self.replace(need, name, relayout=self.buffer is not None) if need else None
                if arena is None:  # every piece spilled: the arena goes once carried from
                    self.free_retired()
                    self.retired, self.buffer = self.buffer, None
                self._place(pieces, spilled, arena, disk)
        except BaseException:
            if disk is not None and disk is not self.disk:
                disk.close()
            raise
        if disk is not self.disk:
            self.retired_disk, self.disk = self.disk, disk
        for piece in carried:
            for tensor, host in piece.host_slices():
                source = sources[id(tensor)]
                files = (self.retired_disk, self.disk, *self.budget.files())
                read_from = disk_file_of(source, files)
                if read_from is not None:
                    read_from.check_readable(source)  # an I/O error raises, not a SIGBUS
                if source.data_ptr() != host.data_ptr():  # else already in place
                    host.copy_(source)
                if read_from is not None:
                    read_from.drop(source)  # read: out of host memory (dirty pages stay)
            if piece.disk is not None:
                # The file holds the only copy from now on.
                piece.disk.write_back(
                    piece.host,
                    then="The host copies laid out anew may be lost: load the last checkpoint.",
                )
        self.free_retired()
        if self.everything_on_disk:
            # No cycle runs while everything is on disk (asleep): the staging goes too, and
            # what reads or writes the file meanwhile goes through its mapping (disk.py).
            self._unstage()

    @staticmethod
    def _place(pieces, spilled: set, arena, disk) -> None:
        """Give each piece its range: of ``disk`` (a ``DiskFile``) for the ids in ``spilled``,
        of ``arena`` for the others, each in layout order."""
        offset = disk_offset = 0
        for piece in pieces:
            if id(piece) in spilled:
                piece.host = disk.buffer[disk_offset : disk_offset + piece.nbytes].view(piece.dtype)
                piece.disk = disk
                disk_offset += disk_span(piece)
            else:
                piece.host = arena[offset : offset + piece.nbytes].view(piece.dtype)
                piece.disk = None
                offset += piece.host_nbytes

    def _file_for(self, nbytes: int, carried, sources: dict) -> DiskFile | None:
        """The disk tier's file for ``nbytes`` of spilled pieces: the current one when they
        fit it and no carried bytes are read from it, else a new one (None for 0 bytes)."""
        if not nbytes:
            return None
        if self.disk is not None and nbytes <= self.disk.nbytes:
            if not any(self.disk.owns(sources[id(t)]) for piece in carried for t in piece.tensors):
                return self.disk
        return self.budget.disk.file(nbytes)

    def replace(self, nbytes: int, name: str, *, relayout: bool = False) -> torch.Tensor:
        """A new buffer of ``nbytes``; the old one stays readable until ``free_retired``."""
        self.free_retired()
        buffer = self.budget.allocate(self.device, nbytes, name, relayout=relayout)
        self.retired, self.buffer = self.buffer, buffer
        return self.buffer

    def free_retired(self) -> None:
        """Give back the buffer ``replace`` retired, and the file a layout replaced."""
        if self.retired is None and self.retired_disk is None:
            return
        self._synchronize()
        if self.retired is not None:
            self.budget.free(self.device, self.retired)
            self.retired = None
        if self.retired_disk is not None:
            self.retired_disk.close()
            self.retired_disk = None

    def _synchronize(self) -> None:
        # Rule 5: copies into or out of the arena may still be queued even when the device
        # streams are ordered; the host must see them finish before the memory goes.
        for event in (self.last_d2h, self.last_h2d):
            if event is not None:
                self.device.synchronize_event(event, label=HOST_FREE_AFTER_COPIES)
        self.last_d2h = self.last_h2d = None

    def free(self) -> None:
        self.free_retired()
        self.reserved_for = 0
        self._unstage()
        if self.buffer is None and self.disk is None:
            return
        self._synchronize()
        if self.buffer is not None:
            self.budget.free(self.device, self.buffer)
            self.buffer = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None


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
        self.budget = budget if budget is not None else HostBudget(None)
        self.name = name
        #: New buffers are files of the budget's disk tier whatever its limit
        #: (``sleep(to="disk")``'s copies of parameters).
        self.to_disk = False
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

    def files(self) -> list[DiskFile]:
        """The disk tier's files of the buffers held that the budget spilled there."""
        return [f for f in self.budget.files() if any(f.buffer is b for b in self._buffers)]

    def hand_over(self, buffers) -> None:
        """Someone else gives ``buffers`` back from now on (the engine adopted states in them;
        the budget counts them until then, once); what is left of them is still carved."""
        self._handed.update(id(buffer) for buffer in buffers)

    def free(self) -> None:
        """Give back every buffer not handed over (the caller has waited for every copy into
        them)."""
        for buffer in self._buffers:
            if id(buffer) not in self._handed:
                self.budget.free(self.device, buffer)
        self._buffers = []
        self._handed = set()
        self._index = self._used = self._taken = 0

    def _allocate(self, nbytes: int) -> None:
        self._buffers.append(
            self.budget.allocate(self.device, nbytes, self.name, spill=True, to_disk=self.to_disk)
        )
