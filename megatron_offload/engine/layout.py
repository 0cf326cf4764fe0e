"""Which tracked tensors move, in which pieces, and when to look at them again.

``Layout`` is the engine's plan, with no device work of its own: it asks ``collect`` for the
tensors (only when a cheap fingerprint says they may have changed), keeps unmovable ones
resident and, with a fraction, picks the largest, and splits the rest by kind, dtype and
streaming into pieces of at most ``max_piece_bytes`` (``pieces.split_pieces``). The engine
(``engine.py``) turns a plan into pieces and moves them; ``HostArena.lay_out`` gives each a
range of host memory. ``host_need`` sizes that memory before any tensor exists (attach).
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch

from ..device import Device
from .pieces import Piece, Place, is_plain, itemsize_of, split_pieces

#: More copies than this per cycle and direction get a warning (launch overhead adds up).
MANY_COPIES = 10_000

#: Default bound of one device storage (piece); see ``OffloadConfig.max_piece_bytes``.
DEFAULT_MAX_PIECE_BYTES = 256 << 20

Collect = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class Layout:
    """The tracked tensors of one engine and how they are grouped (see the engine's args)."""

    def __init__(
        self,
        device: Device,
        collect: Collect,
        *,
        name: str,
        fraction: float,
        streamed: Callable[[], Iterable[torch.Tensor]] | None,
        max_piece_bytes: int | None,
        in_place: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"offload fraction must be between 0 and 1, got {fraction!r}.")
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
        self.device = device
        self.name = name
        self.max_piece_bytes = max_piece_bytes
        self._collect: Collect = collect
        self._fraction = fraction
        #: The state tensors the chunked update streams through its slots (None without one).
        self._streamed: Callable[[], Iterable[torch.Tensor]] | None = streamed
        #: The tensors released and regrown in their own storage (in-place pieces).
        self._in_place: Callable[[], Iterable[torch.Tensor]] | None = in_place
        #: ``(kind, tensor)`` as laid out now, in layout order.
        self.tracked: list[tuple[str, torch.Tensor]] = []
        #: ``(kind, tensor, why)`` of tensors ``collect`` returned that stay on the device.
        self.kept_resident: list[tuple[str, torch.Tensor, str]] = []
        self._where: dict[int, tuple[Piece, int]] = {}

    # ------------------------------------------------------------------ looking
    def look(self) -> list[tuple[str, torch.Tensor]] | None:
        """The ``(kind, tensor)`` pairs to lay out if they differ from those laid out, else
        None; unmovable tensors (and, with a fraction, the smaller ones) are kept resident."""
        current: list[tuple[str, torch.Tensor]] = []
        kept: list[tuple[str, torch.Tensor, str]] = []
        for kind, tensor in self._collect():
            reason = unmovable_reason(tensor, self.device)
            if reason:
                kept.append((kind, tensor, reason))
            elif tensor.numel():
                current.append((kind, tensor))
        current, partial = self._chosen(current)
        kept += [(kind, tensor, "partial offload") for kind, tensor in partial]
        self.kept_resident = kept
        if len(current) == len(self.tracked) and all(
            a is b and k == j for (k, a), (j, b) in zip(current, self.tracked)
        ):
            return None
        return current

    def _chosen(self, pairs):
        """``(offloaded, kept for partial offload)``: with a fraction, the largest tensors."""
        if self._fraction < 1.0:
            return _largest_first(pairs, self._fraction)
        return pairs, []

    # ----------------------------------------------------------------- planning
    def plan(self, current) -> list[tuple[str, torch.dtype, bool, bool, int, list[torch.Tensor]]]:
        """``(kind, dtype, streamed, in_place, index, tensors)`` of every piece of ``current``."""
        streamed = {id(t) for t in self._streamed()} if self._streamed is not None else set()
        return self._plan(current, streamed, self._in_place_ids())

    def _in_place_ids(self) -> set[int]:
        return {id(t) for t in self._in_place()} if self._in_place is not None else set()

    def _plan(self, current, streamed: set[int], in_place: set[int]):
        by_key: dict[tuple[str, torch.dtype, bool], list[torch.Tensor]] = {}
        alone = []  # in-place tensors: a piece each
        for kind, tensor in current:
            if id(tensor) in in_place:
                _check_whole_storage(tensor, self.name)
                alone.append((kind, tensor.dtype, id(tensor) in streamed, True, 0, [tensor]))
            else:
                by_key.setdefault((kind, tensor.dtype, id(tensor) in streamed), []).append(tensor)
        plan = alone + [
            (kind, dtype, is_streamed, False, index, tensors_of_piece)
            for (kind, dtype, is_streamed), tensors in by_key.items()
            for index, tensors_of_piece in enumerate(
                split_pieces(tensors, itemsize_of(dtype), self.max_piece_bytes)
            )
        ]
        if len(plan) > MANY_COPIES:
            warnings.warn(
                f"{self.name}: max_piece_bytes={self.max_piece_bytes:,} splits the states into "
                f"{len(plan):,} pieces, so every offload and reload issues that many copies "
                "(each costs a launch, a few microseconds on a GPU, and an event). Raise "
                "max_piece_bytes (the default is 256 MiB).",
                stacklevel=4,
            )
        return plan

    def host_need(
        self, expected: Iterable[tuple[str, torch.Tensor, bool, torch.device]] | None
    ) -> int:
        """The host bytes the first layout of ``expected`` takes (0 for None), allocating
        nothing: ``(kind, tensor, in_state, device)`` for every tensor ``collect`` will
        return, in its order; a tensor that does not exist yet (Adam's moments appear at the
        first step) is a meta tensor of its shape and dtype, ``device`` where it will live.
        ``in_state``: streamed by a chunked update. Sized exactly as a layout of them would
        be (movability, fraction, pieces, alignment)."""
        if expected is None:
            return 0
        pairs, streamed = [], set()
        for kind, tensor, in_state, where in expected:
            if tensor.device.type == "meta":
                movable = where == self.device.torch_device  # new tensors are plain, contiguous
            else:
                movable = not unmovable_reason(tensor, self.device)
            if movable and tensor.numel():
                pairs.append((kind, tensor))
                if in_state and self._streamed is not None:
                    streamed.add(id(tensor))
        chosen, _ = self._chosen(pairs)
        return sum(
            Piece(kind, dtype, tensors, in_place=in_place).host_nbytes
            for kind, dtype, _, in_place, _, tensors in self._plan(
                chosen, streamed, self._in_place_ids()
            )
        )

    def arrange(self, plan, old_pieces, on_host: dict) -> list[Piece]:
        """The pieces of ``pieces``, largest element size first (so every piece's host slice
        is aligned for its dtype without padding, and host bytes equal tracked bytes): a
        piece made of the same tensors as an old consolidated one keeps its storage; one
        whose tensors all have their only copy on the host (``on_host``) is released."""
        old_flat = {id(t): p for p in old_pieces if p.flat is not None for t in p.tensors}
        pieces = []
        for kind, dtype, is_streamed, in_place, index, tensors in plan:
            piece = Piece(
                kind, dtype, tensors, streamed=is_streamed, in_place=in_place, piece=index
            )
            old = old_flat.get(id(tensors[0]))
            if (
                old is not None
                and len(old.tensors) == len(tensors)
                and all(a is b for a, b in zip(old.tensors, tensors))
            ):
                piece.flat = old.flat
            if all(id(t) in on_host for t in tensors):
                piece.place = Place.RELEASED
                piece.host_valid = True
            pieces.append(piece)
        pieces.sort(key=lambda g: -g.itemsize)
        return pieces

    def laid_out(self, current, pieces) -> None:
        """``current`` is tracked now, in ``pieces``."""
        self.tracked = current
        self._where = {id(t): (g, i) for g in pieces for i, t in enumerate(g.tensors)}

    def locate(self, tensor: torch.Tensor) -> tuple[Piece, int] | None:
        """The piece tracking ``tensor`` and its index in that piece, or None."""
        return self._where.get(id(tensor))

    def forget(self) -> None:
        """Drop every reference to the tracked tensors."""
        self.tracked, self.kept_resident, self._where = [], [], {}


def _largest_first(pairs, fraction):
    """Split ``pairs`` into the largest tensors making up ``fraction`` of the bytes, and the rest.

    Whole tensors only; ties keep their order, so the choice is the same on every rank
    and from run to run.
    """
    total = sum(t.numel() * t.element_size() for _, t in pairs)
    budget = fraction * total
    order = sorted(
        range(len(pairs)), key=lambda i: -pairs[i][1].numel() * pairs[i][1].element_size()
    )
    chosen, used = set(), 0
    for i in order:
        nbytes = pairs[i][1].numel() * pairs[i][1].element_size()
        if used + nbytes <= budget:
            chosen.add(i)
            used += nbytes
    return (
        [p for i, p in enumerate(pairs) if i in chosen],
        [p for i, p in enumerate(pairs) if i not in chosen],
    )


def unmovable_reason(tensor: torch.Tensor, device: Device) -> str:
    """Why ``tensor`` cannot be moved by the engine ('' if it can)."""
    if not is_plain(tensor):
        return f"tensor subclass {type(tensor).__name__}"
    if tensor.device != device.torch_device:
        return f"on {tensor.device}, not on {device.torch_device}"
    if not tensor.is_contiguous():
        return "not contiguous"
    return ""


def _check_whole_storage(tensor: torch.Tensor, name: str) -> None:
    """An in-place tensor is released and regrown by its storage: it must be all of it."""
    nbytes = tensor.untyped_storage().nbytes()
    if tensor.storage_offset() or nbytes not in (0, tensor.numel() * tensor.element_size()):
        raise ValueError(
            f"{name}: a tensor to release in place must cover its whole storage (offset 0, "
            f"{tensor.numel() * tensor.element_size()} bytes), not a part of {nbytes} bytes."
        )


def check_no_aliasing(pairs: list[tuple[str, torch.Tensor]], name: str) -> None:
    """Two tracked tensors sharing memory would be separated by consolidation: refuse."""
    # Tensors without memory (released and replaced) cannot alias anything live.
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, (_, t) in enumerate(pairs)
        if t.untyped_storage().nbytes()
    )
    for (start_a, end_a, i), (start_b, _, j) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ValueError(
                f"{name}: tensors {pairs[i][0]}#{i} and {pairs[j][0]}#{j} share memory, so they "
                "cannot be moved independently. Offloading supports optimizers whose state "
                "tensors do not alias each other."
            )
