"""Pieces: how the tracked tensors are laid out on device and host.

The tensors of one kind and dtype (a *group*) are split into *pieces* of at most
``max_piece_bytes`` (``split_pieces``), so that no device storage the engine frees is larger
than that. Each ``Piece`` has its own storage, host range, copies and events.

A piece starts as the tensors the optimizer made (each with its own storage). The first
time it is reloaded it is *consolidated*: one flat device tensor is allocated and every
tracked tensor is re-pointed (``Tensor.set_``) at its slice of it. From then on the whole
piece is released and regrown as one storage and copied with one operation per direction,
while the tensor objects, their shapes and every view taken of them stay the same Python
objects, so the optimizer (and its state-dict keys) never notice.

An *in-place* piece is one tensor that owns a whole storage other tensors view (Megatron-FSDP
keeps each parameter group's fp32 master weights in one buffer, and its optimizer's
parameters are views into it, taken once): re-pointing the tensor would leave the views on
the old memory, so the storage itself is released and regrown (``resize_``) and every view
follows. It is never consolidated nor split: its flat tensor is the tensor itself, and its
bytes are the storage's, unpadded (its range of the host arena is padded, see ``host_nbytes``).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

# Where a piece's bytes are. Transitions (see engine.py):
#   RESIDENT --offload--> OFFLOADING --release--> RELEASED --reload--> RELOADING --wait--> RESIDENT


ALIGN_BYTES = 16


class Place(enum.Enum):
    RESIDENT = "resident"  # device memory valid, no copy pending
    OFFLOADING = "offloading"  # device memory valid, D2H into the host copy issued (or not needed)
    RELEASED = "released"  # device memory returned; the host copy is the only copy
    RELOADING = "reloading"  # device memory regrown, H2D issued, not yet ordered before the caller


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many tensors (and storage objects) share ``tensor``'s storage, or None if unknown."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # pragma: no cover - every supported torch has it
        return None
    storage = tensor.untyped_storage()
    # Minus one for the temporary ``storage`` object itself.
    return use_count(storage._cdata) - 1


def owns_storage(tensor: torch.Tensor) -> bool:
    """True if releasing ``tensor``'s storage frees exactly ``tensor`` and nothing else."""
    storage = tensor.untyped_storage()
    if tensor.storage_offset() != 0 or storage.nbytes() != tensor.numel() * tensor.element_size():
        return False
    count = storage_use_count(tensor)
    return count is None or count <= 1


@functools.lru_cache(maxsize=None)
def itemsize_of(dtype: torch.dtype) -> int:
    # Asked per tensor when chunks are laid out: computed once per dtype.
    return torch.empty((), dtype=dtype, device="meta").element_size()


def is_plain(tensor) -> bool:
    """A ``torch.Tensor`` (or ``Parameter``) that is not a subclass: its memory is its storage."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def typed_view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of the uint8 ``buffer`` as a contiguous tensor shaped like ``like``."""
    nbytes = like.numel() * like.element_size()
    return buffer[:nbytes].view(like.dtype).view(like.shape)


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of ``ALIGN_BYTES``: what a tensor takes in a
    piece, a slot or a staging buffer, so that the next one starts aligned."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def aligned_numel(numel: int, itemsize: int) -> int:
    """``numel`` rounded up so that the next tensor starts on an ``ALIGN_BYTES`` boundary."""
    align = max(1, ALIGN_BYTES // itemsize)
    return -(-numel // align) * align


def split_pieces(
    tensors: list[torch.Tensor], itemsize: int, max_bytes: int | None
) -> list[list[torch.Tensor]]:
    """Split ``tensors`` (in order) into pieces of at most ``max_bytes`` each, laid out aligned.

    Consecutive tensors share a piece while it stays within the bound; a tensor larger than
    the bound gets a piece of its own; no tensor straddles two pieces. ``None``: one piece.
    The same tensors give the same pieces on every rank and in every run.
    """
    if max_bytes is None:
        return [tensors] if tensors else []
    pieces: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    used = 0
    for tensor in tensors:
        nbytes = aligned_numel(tensor.numel(), itemsize) * itemsize
        if current and used + nbytes > max_bytes:
            pieces.append(current)
            current, used = [], 0
        current.append(tensor)
        used += nbytes
    if current:
        pieces.append(current)
    return pieces


@dataclass(eq=False)
class Piece:
    """Tensors of one kind and dtype that move together."""

    kind: str
    dtype: torch.dtype
    tensors: list[torch.Tensor]
    streamed: bool = (
        False  # streamed through device slots by the caller's update, not reloaded whole
    )
    in_place: bool = False  # one tensor whose own storage is released and regrown (above)
    piece: int = 0  # index among the pieces of its (kind, dtype) (see ``split_pieces``)
    offsets: list[int] = field(default_factory=list)  # element offset of each tensor
    numel: int = 0
    itemsize: int = 0  # bytes per element of ``dtype`` (set from it)
    nbytes: int = 0  # bytes of the piece's storage, alignment padding included (set)
    host: torch.Tensor | None = None  # this piece's slice of the host arena, as ``dtype``
    disk: Any = None  # the disk tier's ``DiskFile`` ``host`` is in (None: host memory)
    flat: torch.Tensor | None = None  # the consolidated device tensor (after the first reload)
    place: Place = Place.RESIDENT
    host_valid: bool = False  # host copy equals the device contents (as of the last copy)
    d2h_event: Any = None  # pending D2H (host copy not yet readable by the host)
    h2d_event: Any = None  # pending H2D (device copy not yet ordered before the caller)
    alloc_stream: Any = None  # stream the device memory was regrown on (None: the optimizer's own)
    used_on: list = field(default_factory=list)  # streams ``wait`` made it usable on since then
    d2h_waiters: list = field(default_factory=list)  # streams ordered after ``d2h_event``
    announced: bool = False  # its device memory names the D2H stream (record_stream) until freed

    def __post_init__(self) -> None:
        # Every tensor starts on a 16-byte boundary of the flat storage, as a tensor of its
        # own would (allocators align far more): vectorized optimizer and cast kernels
        # (TE's, apex's multi-tensor apply) rely on it or fall back to slow paths. The piece
        # is padded to a multiple of 16 bytes too, so pieces stay aligned in the host arena.
        itemsize = self.itemsize = itemsize_of(self.dtype)
        if self.in_place:
            (tensor,) = self.tensors
            self.offsets, self.numel, self.flat = [0], tensor.numel(), tensor
            self.nbytes = tensor.numel() * itemsize
            return
        offset = 0
        self.offsets = []
        for tensor in self.tensors:
            self.offsets.append(offset)
            offset += aligned_numel(tensor.numel(), itemsize)
        self.numel = offset
        self.nbytes = offset * itemsize  # the piece's storage, alignment padding included

    @property
    def host_nbytes(self) -> int:
        """Bytes of its range of the host arena: ``nbytes``, padded so the next starts aligned."""
        return aligned_size(self.nbytes)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the tensors themselves (``nbytes`` without the alignment padding)."""
        return sum(t.numel() for t in self.tensors) * self.itemsize

    def host_slices(self):
        """(tensor, its slice of the host copy) pairs, for per-tensor copies."""
        assert self.host is not None
        for tensor, offset in zip(self.tensors, self.offsets):
            yield tensor, self.host[offset : offset + tensor.numel()].view(tensor.shape)

    def consolidate(self, flat: torch.Tensor) -> None:
        """Re-point every tracked tensor at its slice of ``flat`` (which must be allocated)."""
        storage = flat.untyped_storage()
        with torch.no_grad():
            for tensor, offset in zip(self.tensors, self.offsets):
                tensor.set_(storage, flat.storage_offset() + offset, tensor.shape, tensor.stride())
        self.flat = flat


def release_separate_storages(device, tensors: list[torch.Tensor]) -> int:
    """First release of tensors that still have the storages the optimizer made (their
    contents are on the host already); returns the bytes other owners keep alive."""
    shared = {}
    own = [t for t in tensors if owns_storage(t) and t.untyped_storage().resizable()]
    owned = {id(t) for t in own}
    others = [t for t in tensors if id(t) not in owned]
    # Something else shares the storages of ``others`` (views taken before we attached, or a
    # piece that was re-laid out). Freeing them would leave the other tensors dangling, so
    # ours are pointed at one scratch storage, which is then released: one allocation, as
    # large as the largest of them (``set_`` needs the memory to exist), not one per tensor,
    # made before anything is released (if it fails, the piece is still whole). The old
    # storages live on with their other owners; the next reload re-points every tensor at
    # its slice of the piece's own storage (``consolidate``).
    scratch = None
    if others:
        scratch = device.empty(max(t.numel() * t.element_size() for t in others), torch.uint8)
    for tensor in own:
        device.release(tensor)
    if others:
        storage = scratch.untyped_storage()
        with torch.no_grad():
            for tensor in others:
                old = tensor.untyped_storage()
                shared.setdefault(old.data_ptr(), old)
                tensor.set_(storage, 0, tensor.shape, tensor.stride())
        del scratch, storage
        device.release(others[0])  # the scratch, for all of them
    unreleasable = 0
    for old in shared.values():
        # Still referenced by something other than the ``old`` object held here: that memory
        # is not ours to free, and it is reported rather than silently lost.
        if torch._C._storage_Use_Count(old._cdata) > 1:
            unreleasable += old.nbytes()
    return unreleasable
