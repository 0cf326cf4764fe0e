"""Laying the tracked tensors out: which tensors move, in which pieces, and again when they change.

The half of ``OffloadEngine`` that decides what the groups (pieces) are: ``_rescan`` asks
``collect`` for the tensors (cheaply, when a fingerprint says nothing changed), keeps
unmovable ones resident and, with a fraction, picks the largest; ``_rebuild`` splits them by
kind, dtype and streaming into pieces of at most ``max_piece_bytes`` and gives each a range
of the host arena, carrying over the host copies of groups that stay released and of
tensors the caller handed over with ``adopt``. ``OffloadEngine`` (``engine.py``) moves the
pieces; this mixin only lays them out.

The arena is reused when the new layout fits it (``HostArena.fits``): the host copies that
move are set aside first, so no new (pinned) arena is allocated. Otherwise a new arena is
allocated while the old one still holds the copies to carry over. Either way the peak of
host memory during the change is checked against the budget before anything is freed or
allocated. ``reserve_host`` allocates the arena for the first layout ahead of time (at
attach), from the tensors the caller expects, laid out exactly as ``_rebuild`` will.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch

from ..device import Device
from .groups import FlatGroup, Place, itemsize_of, split_pieces
from .labels import HOST_FREE_AFTER_COPIES, HOST_READ_AFTER_D2H

#: More copies than this per cycle and direction get a warning (launch overhead adds up).
MANY_COPIES = 10_000

_NEVER = object()


class LayoutMixin:
    """Tracking and layout of ``OffloadEngine`` (which provides the attributes used here)."""

    def invalidate(self) -> None:
        """The tracked tensors may have been replaced: look at them again at the next offload."""
        self._last_fingerprint = _NEVER

    def rescan(self) -> None:
        """Look at the tensors ``collect`` returns now (after ``invalidate`` or ``adopt``) and
        lay the groups out anew if they changed, instead of at the next offload: adopted
        tensors then belong to released groups, which the next reload brings back."""
        if self._closed:
            raise self._closed_error()
        fingerprint = self.fingerprint() if self.fingerprint is not None else _NEVER
        if fingerprint is _NEVER or fingerprint != self._last_fingerprint:
            self._rescan(fingerprint)

    def _rescan(self, fingerprint: object) -> None:
        """Pick up tensors created or replaced since the last look (``fingerprint``: the
        fingerprint's value now, ``_NEVER`` without one)."""
        self._last_fingerprint = fingerprint
        current: list[tuple[str, torch.Tensor]] = []
        kept: list[tuple[str, torch.Tensor, str]] = []
        for kind, tensor in self._collect():
            reason = _unmovable_reason(tensor, self.device)
            if reason:
                kept.append((kind, tensor, reason))
            elif tensor.numel():
                current.append((kind, tensor))
        current, partial = self._chosen(current)
        kept += [(kind, tensor, "partial offload") for kind, tensor in partial]
        self._kept_resident = kept
        if len(current) == len(self._tracked) and all(
            a is b and k == j for (k, a), (j, b) in zip(current, self._tracked)
        ):
            return
        self._rebuild(current)

    def _chosen(self, pairs):
        """``(offloaded, kept for partial offload)``: with a fraction, the largest tensors."""
        if self._fraction < 1.0:
            return _largest_first(pairs, self._fraction)
        return pairs, []

    def reserve_host(
        self, expected: Iterable[tuple[str, torch.Tensor, bool, torch.device]] | None
    ) -> int:
        """Allocate (and pin) the host arena now for the layout the first offload will make.

        ``expected``: ``(kind, tensor, in_state, device)`` for every tensor ``collect`` will
        return then, in its order; a tensor that does not exist yet (Adam's moments appear
        at the first step) is a meta tensor of its shape and dtype, ``device`` where it will
        live. ``in_state``: streamed by a chunked update (see ``streamed``). The arena is
        sized exactly as ``_rebuild`` lays those tensors out (movability, fraction, pieces,
        alignment); the first layout reuses it when it fits. None or an arena already there:
        nothing is reserved (the first offload allocates, and checks the budget then). A
        budget too small for it raises ``HostMemoryBudgetError`` before anything is
        allocated. Returns the bytes reserved.
        """
        if expected is None or self._closed or self._host.buffer is not None:
            return 0
        need = self.host_need(expected)
        return need if self._host.reserve(need, self.name) else 0

    def host_need(
        self, expected: Iterable[tuple[str, torch.Tensor, bool, torch.device]] | None
    ) -> int:
        """The bytes of the host arena ``reserve_host(expected)`` would allocate (0 for None),
        allocating nothing: what a node-wide check adds up before any rank allocates."""
        if expected is None:
            return 0
        pairs, flags = [], {}
        for kind, tensor, in_state, where in expected:
            if tensor.device.type == "meta":
                movable = where == self.device.torch_device  # new tensors are plain and contiguous
            else:
                movable = not _unmovable_reason(tensor, self.device)
            if movable and tensor.numel():
                pairs.append((kind, tensor))
                flags[id(tensor)] = bool(in_state) and self._streamed is not None
        chosen, _ = self._chosen(pairs)
        pieces = self._pieces(chosen, {key for key, flag in flags.items() if flag})
        return sum(FlatGroup(kind, dtype, tensors).nbytes for kind, dtype, _, _, tensors in pieces)

    def adopt(self, items: Iterable[tuple]) -> None:
        """Take over tensors whose only copy the caller put on the host.

        Each item is ``(tensor, host, event)`` or ``(tensor, host, event, buffer)``:
        ``host`` holds the tensor's bytes once ``event`` (the D2H that filled it, or None)
        completed, and the caller has released the tensor's device memory. ``buffer`` is
        the buffer from this engine's device (``host_buffer``) that ``host`` is a view of,
        and may be shared by several items (one staging buffer); without it ``host`` is
        that buffer. At the next rescan the tensors are tracked as released and their bytes
        move into the host arena; the engine gives each buffer back once, when no adopted
        tensor needs it any more.
        """
        for item in items:
            tensor, host, event = item[:3]
            buffer = item[3] if len(item) > 3 else host
            self._adopted[id(tensor)] = (tensor, host, event, buffer)
        self.invalidate()

    def disown(self, tensors: Iterable[torch.Tensor]) -> None:
        """Forget adopted tensors the caller dropped (the states a failed step had created):
        their host copies are not kept, and a buffer no other adopted tensor uses goes back."""
        ids = {id(tensor) for tensor in tensors}
        dropped = [self._adopted.pop(key) for key in [k for k in self._adopted if k in ids]]
        if not dropped:
            return
        for _, _, event, _ in dropped:
            if event is not None:
                # Rule 5: the copy filling the buffer is done before the buffer goes back.
                self.device.synchronize_event(event, label=HOST_FREE_AFTER_COPIES)
        for buffer in {id(item[3]): item[3] for item in dropped}.values():
            if not any(other is buffer for *_, other in self._adopted.values()):
                self.device.free_host_buffer(buffer)
        self.invalidate()

    def _pieces(self, current, streamed: set[int]):
        """``(kind, dtype, streamed, index, tensors)`` of every piece of ``current``."""
        by_key: dict[tuple[str, torch.dtype, bool], list[torch.Tensor]] = {}
        for kind, tensor in current:
            by_key.setdefault((kind, tensor.dtype, id(tensor) in streamed), []).append(tensor)
        return [
            (kind, dtype, is_streamed, index, piece)
            for (kind, dtype, is_streamed), tensors in by_key.items()
            for index, piece in enumerate(
                split_pieces(tensors, itemsize_of(dtype), self._max_piece_bytes)
            )
        ]

    def _rebuild(self, current: list[tuple[str, torch.Tensor]]) -> None:
        streamed = {id(t) for t in self._streamed()} if self._streamed is not None else set()
        by_key: dict[tuple[str, torch.dtype, bool], list[torch.Tensor]] = {}
        for kind, tensor in current:
            by_key.setdefault((kind, tensor.dtype, id(tensor) in streamed), []).append(tensor)
        # A group is described by one place, so it cannot mix tensors whose only copy is on
        # the host with tensors on the device (a new state beside released ones): the former
        # come back to the device first. Groups made only of host copies stay released, and
        # their bytes move from the old arena (or an adopted buffer) into the new one.
        on_host = self._host_copies()
        mixed = {
            id(t)
            for tensors in by_key.values()
            if any(id(t) in on_host for t in tensors) and not all(id(t) in on_host for t in tensors)
            for t in tensors
        }
        if mixed:
            self.reload(
                groups=[
                    g
                    for g in self.groups
                    if g.place is Place.RELEASED and any(id(t) in mixed for t in g.tensors)
                ]
            )
            self._restore_adopted(mixed)
            on_host = self._host_copies()
        self.wait()
        _check_no_aliasing(current, self.name)
        old_flat = {id(t): g for g in self.groups if g.flat is not None for t in g.tensors}
        groups = []
        pieces = self._pieces(current, streamed)
        if len(pieces) > MANY_COPIES:
            warnings.warn(
                f"{self.name}: max_piece_bytes={self._max_piece_bytes:,} splits the states into "
                f"{len(pieces):,} pieces, so every offload and reload issues that many copies "
                "(each costs a launch, a few microseconds on a GPU, and an event). Raise "
                "max_piece_bytes (the default is 256 MiB).",
                stacklevel=3,
            )
        for kind, dtype, is_streamed, index, tensors in pieces:
            group = FlatGroup(kind, dtype, tensors, streamed=is_streamed, piece=index)
            previous = {id(old_flat.get(id(t))) for t in tensors}
            old = old_flat.get(id(tensors[0]))
            if (
                old is not None
                and len(previous) == 1
                and len(old.tensors) == len(tensors)
                and all(a is b for a, b in zip(old.tensors, tensors))
            ):
                group.flat = old.flat  # unchanged piece: keep its consolidated storage
            if all(id(t) in on_host for t in tensors):
                group.place = Place.RELEASED
                group.host_valid = True
            groups.append(group)
        # Largest element size first: every group's host slice is then aligned for its dtype
        # without padding, and host bytes equal tracked bytes exactly.
        groups.sort(key=lambda g: -g.itemsize)
        need = sum(g.nbytes for g in groups)
        carried = [g for g in groups if g.place is Place.RELEASED]
        reuse = self._host.fits(need)
        staged = {id(b): b.numel() for *_, b in self._adopted.values()}
        # The peak of host memory while the layout changes: the arena kept and the carried
        # bytes set aside from it, or the old and the new arena; plus the adopted buffers.
        # Checked against the budget before anything is freed or allocated.
        aside = sum(g.nbytes for g in carried) if reuse else need
        self._host.check(need, self.name, peak=self._host.nbytes + aside + sum(staged.values()))
        # Rule 5: the host reads the old copies below, so the copies into them must be done.
        for _, event in on_host.values():
            if event is not None:
                self.device.synchronize_event(event, label=HOST_READ_AFTER_D2H)
        for group in self.groups:
            group.d2h_event = None
        sources = {key: host for key, (host, _) in on_host.items()}
        if reuse:
            # Rule 5: the host rewrites the arena below, while an H2D of the old layout may
            # still read it (the waits above only order it before the current stream).
            self._host.synchronize()
            arena = self._host.buffer
            # Carried copies in the arena are set aside first: their new places may overlap
            # their old ones (or another's).
            base = arena.untyped_storage().data_ptr()
            for group in carried:
                for tensor in group.tensors:
                    host = sources[id(tensor)]
                    if host.untyped_storage().data_ptr() == base:
                        sources[id(tensor)] = host.clone()
        else:
            arena = self._host.replace(need)
        offset = 0
        for group in groups:
            group.host = arena[offset : offset + group.nbytes].view(group.dtype)
            offset += group.nbytes
        for group in carried:
            for tensor, host in group.host_slices():
                host.copy_(sources[id(tensor)])
        del sources
        self._host.free_retired()
        # Every copy into an adopted buffer was waited for above (rule 5); each goes back once.
        for buffer in {id(b): b for *_, b in self._adopted.values()}.values():
            self.device.free_host_buffer(buffer)
        self._adopted = {}
        # Memory of the old layout announced to the D2H stream lives on with the tensors.
        self._announced_elsewhere = self._announced_elsewhere or any(
            g.announced for g in self.groups
        )
        self.groups = tuple(groups)
        self._tracked = current
        self._where = {id(t): (g, i) for g in groups for i, t in enumerate(g.tensors)}
        self.generation += 1

    def _host_copies(self) -> dict[int, tuple[torch.Tensor, object]]:
        """Where the bytes of every tensor that has no device memory are: id -> (host, event)."""
        copies = {}
        for group in self.groups:
            if group.place is Place.RELEASED:
                for tensor, host in group.host_slices():
                    copies[id(tensor)] = (host, group.d2h_event)
        for key, (tensor, host, event, _) in self._adopted.items():
            copies[key] = (_typed(host, tensor), event)
        return copies

    def _restore_adopted(self, ids: set[int]) -> None:
        """Copy adopted tensors among ``ids`` back into device memory of their own."""
        for key in [k for k in self._adopted if k in ids]:
            tensor, host, event, buffer = self._adopted.pop(key)
            if event is not None:
                self.device.synchronize_event(event, label=HOST_READ_AFTER_D2H)
            self.device.regrow(tensor, tensor.numel() * tensor.element_size())
            current = self.device.current_stream()
            # On the current stream, the one that regrew the memory and will use it (rule 7).
            with self.device.use_stream(current):
                self.device.copy(tensor, _typed(host, tensor))
            # Rule 5: the buffer is given back only once the copy reading it is done (and
            # only once no other adopted tensor still has its bytes in it).
            self.device.synchronize_event(
                self.device.record_event(current), label=HOST_FREE_AFTER_COPIES
            )
            if not any(other is buffer for *_, other in self._adopted.values()):
                self.device.free_host_buffer(buffer)


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


def _typed(buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The first bytes of the uint8 ``buffer`` seen as a tensor like ``tensor``."""
    nbytes = tensor.numel() * tensor.element_size()
    return buffer[:nbytes].view(tensor.dtype).view(tensor.shape)


def _unmovable_reason(tensor: torch.Tensor, device: Device) -> str:
    """Why ``tensor`` cannot be moved by the engine ('' if it can)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(tensor).__name__}"
    if tensor.device != device.torch_device:
        return f"on {tensor.device}, not on {device.torch_device}"
    if not tensor.is_contiguous():
        return "not contiguous"
    return ""


def _check_no_aliasing(pairs: list[tuple[str, torch.Tensor]], name: str) -> None:
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
