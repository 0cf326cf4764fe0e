"""Offloaded state seen as its host copy: ``HostView`` (checkpoints, ``host_view()``).

While the states are offloaded their only valid copy is in the host arena; a checkpoint save
reads them, a load writes them, and neither needs them on the device. For the duration of a
call, each released tensor is replaced where the optimizer keeps it (``adapters.holders``:
the masters in ``param_groups``, the wrapper's master lists and as keys of the state; every
state tensor in the per-parameter state dicts) by a CPU tensor viewing its slice of the host
arena, and the optimizer's own tensor objects go back in place afterwards. A save reads the
host copy and leaves it valid; a load writes it. Loads that put new tensors in place of the
served ones (torch's ``Optimizer.load_state_dict`` casts each value to its parameter's
device) are folded back into the host copy (``before_load`` / ``after_load`` and the end of
the view); states a load made on the host for a served parameter are adopted by the engine
as offloaded. Resident tensors are read where they are. Which optimizers are served this way
is their policy (``state.py``). Why each of these, and the formats it serves:
docs/checkpointing.md.

Rule 5 of the copy protocol: opening waits for every pending copy out before the host reads
the arena (a host block, at a checkpoint only).
"""

from __future__ import annotations

import collections
import contextlib
import time

import torch

from ..adapters import inner_optimizers, megatron_fsdp
from ..adapters import megatron_wrappers as wrappers
from ..adapters.holders import Holder, Repointing, items_of
from ..engine import Place
from ..engine.pieces import is_plain
from .dtensor_view import DTensorView


class HostViewFigures:
    """What the host views of one offloader served, since attach (``stats()``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.save_bytes = 0  # host-copy bytes handed to code that only reads them (a save)
        self.load_bytes = 0  # ... to code that may write them, and new state a load made
        self.wait_ms = 0.0  # host time spent waiting for copies out before serving
        self.device_bytes = 0  # the most state found on the device when one opened

    def figures(self) -> dict:
        return {
            "host_view_calls": self.calls,
            "host_view_save_bytes": self.save_bytes,
            "host_view_load_bytes": self.load_bytes,
            "host_view_wait_ms": self.wait_ms,
            "host_view_device_bytes": self.device_bytes,
        }


class HostView:
    """The released tensors of ``members`` seen as their host copies, from ``open()`` to
    ``close()`` (``StateAccess.host_view`` opens one around a block, in the ``SERVING`` phase).

    ``writes``: the block may write the states (a load): resident tensors' host copies become
    stale, and values the block put in place of served tensors are folded back. ``figures``:
    where what it served is counted.
    """

    def __init__(self, members, writes: bool, figures: HostViewFigures) -> None:
        self._members = tuple(members)
        self._writes = writes
        self._figures = figures
        self._served: list[_Served] = []

    def note_writes(self) -> None:
        """A block nested in this one may write the states."""
        self._writes = True

    def open(self) -> None:
        """Swap the host views in (all or nothing)."""
        figures = self._figures
        figures.calls += 1
        # State the block finds on the device (partial offload, a prefetch): read there.
        figures.device_bytes = max(
            figures.device_bytes,
            sum(m.engine.stats()["resident_bytes"] for m in self._members),
        )
        start = time.perf_counter()
        try:
            for member in self._members:
                member.engine.check_disk()  # read before the block reads the file's mapping
                self._served.append(_Served(member.engine, member.optimizer))
        except BaseException:
            self.close()
            raise
        figures.wait_ms += (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        """Put the optimizer's own tensors back (what the block wrote is in the host copy)."""
        self._restore(self._writes)

    def serves(self, member) -> bool:
        """Whether this view serves ``member`` (an optimizer of the offloader)."""
        return any(served.engine is member.engine for served in self._served)

    @contextlib.contextmanager
    def unserved(self, member):
        """The block runs with ``member``'s own tensors in place (what was written through the
        view so far is in the host copy), and the view serves ``member`` again after it, as its
        pieces are then: a block may lay them out anew (the states a load makes). ``member``
        must be served (``serves``)."""
        index = next(i for i, served in enumerate(self._served) if served.engine is member.engine)
        self._served.pop(index).restore(self._writes)
        try:
            yield
        finally:
            self._served.insert(index, _Served(member.engine, member.optimizer))

    # ------------------------------------------------------- torch's load hooks
    def before_load(self, inner, state_dict: dict) -> dict:
        """``inner.load_state_dict`` pre-hook inside the block: every value for a served
        place is written into its host copy and replaced by a zero-element placeholder, so
        torch's cast to the parameter's device copies nothing to the device."""
        served = self._for(inner)
        if served is None or not served.views:
            return state_dict
        saved = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
        current = [p for group in inner.param_groups for p in group["params"]]
        incoming = state_dict.get("state", {})
        replaced = {}
        for saved_id, param in zip(saved, current):
            entries = incoming.get(saved_id)
            if not isinstance(entries, dict):
                continue
            key = served.pointed.original(param)
            new_entries = None
            for name, value in entries.items():
                original = served.places.get((id(key), name))
                if (
                    original is None
                    or not isinstance(value, torch.Tensor)
                    or not _fits(value, original)
                ):
                    continue
                if value.numel():
                    served.write(original, value)
                if new_entries is None:
                    new_entries = dict(entries)
                new_entries[name] = value.new_empty(0)
            if new_entries is not None:
                replaced[saved_id] = new_entries
        if not replaced:
            return state_dict
        return {**state_dict, "state": {**incoming, **replaced}}

    def after_load(self, inner) -> None:
        """``inner.load_state_dict`` post-hook inside the block: the placeholders become the
        host views again, for the rest of the block (a load copies into them next)."""
        served = self._for(inner)
        if served is None or not served.views:
            return
        for key, entries in dict.items(inner.state):
            if not isinstance(entries, dict):
                continue
            original_key = served.pointed.original(key)
            for name, value in list(entries.items()):
                original = served.places.get((id(original_key), name))
                if original is not None and isinstance(value, torch.Tensor) and value.numel() == 0:
                    entries[name] = served.views[id(original)]

    def detached(self, result):
        """``result`` with every served host view in it (in dicts, lists and tuples) replaced
        by a copy of its own: what a caller keeps (``state_dict()`` pickled by ``torch.save``)
        never references the host arena, which the next offload overwrites and which torch's
        serialization would otherwise save whole under one storage of mixed dtypes."""
        views = {key for served in self._served for key in served.pointed.stand_in_ids()}
        if not views:
            return result
        return _replace_views(result, views)

    def _for(self, inner):
        for served in self._served:
            if served.owner.optimizer is inner:
                return served
        return None

    def _restore(self, writes: bool) -> None:
        figures = self._figures
        for served in self._served:
            if writes:
                figures.load_bytes += served.served_bytes
            else:
                figures.save_bytes += served.served_bytes
        errors = []
        for served in reversed(self._served):
            try:
                served.restore(writes)
                if writes:
                    served.engine.settle_disk()  # on the disk, and out of host memory
            except BaseException as error:  # restore the others before raising
                errors.append(error)
            figures.load_bytes += served.written_bytes
        self._served = []
        if errors:
            raise errors[0]


class _Served:
    """The swap for one Megatron optimizer (one engine)."""

    def __init__(self, engine, wrapper) -> None:
        self.engine = engine
        self.owner = wrapper
        # Rules 3 and 4: what is on the device (a prefetch may have started its copy back) is
        # read and written in place by the block, after that copy (no host block).
        engine.wait()
        # Rule 5: the host copies are read (and written) by the host in the block.
        engine.synchronize_host()
        self.views: dict[int, torch.Tensor] = {}  # id(original) -> its host view
        # Views that are copies, with the host copy they are written back to (see below).
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.served_bytes = 0  # host-copy bytes in place of released tensors
        self.written_bytes = 0  # bytes folded into the host copy beyond them (new tensors)
        self.dtensors: DTensorView | None = None  # Megatron-FSDP's, pointed at the host
        slices = []
        for piece in engine.pieces:
            if piece.place is Place.RELEASED:
                for tensor, host in piece.host_slices():
                    if host.numel() * host.element_size() == host.untyped_storage().nbytes():
                        # A view of the whole arena (an engine with one tensor): savers copy
                        # only views of a larger storage, and a persistent writer would move a
                        # whole storage it is sent into shared memory, the arena with it. It
                        # gets a copy, written back on exit if the block may write.
                        served = _like(tensor, host.clone())
                        self.copies.append((served, host))
                    else:
                        served = _like(tensor, host)
                    self.views[id(tensor)] = served
                    slices.append((tensor, served))
                    self.served_bytes += host.numel() * host.element_size()
        # The views pointed at where the optimizer holds the released tensors.
        self.pointed = Repointing()
        # Where each served tensor sat in the state: (original key, state key) -> original.
        self.places: dict[tuple[int, object], torch.Tensor] = {}
        self.existing: dict[int, torch.Tensor] = {}
        if not self.views:
            return
        inner = wrapper.optimizer
        lists = [group["params"] for group in inner.param_groups]
        lists += list(wrappers.master_groups(wrapper))
        self.pointed.point_items(items_of(lists), self.views)
        state = inner.state
        # Every tensor the state holds now (held, so that no id is reused in the block): on
        # exit, a tensor found in the state that is none of these was made in the block.
        self.existing = {
            id(v): v
            for e in dict.values(state)
            if isinstance(e, dict)
            for v in e.values()
            if isinstance(v, torch.Tensor)
        }
        for key, entries in list(dict.items(state)):
            if isinstance(entries, dict):
                for name, value in list(entries.items()):
                    view = self.views.get(id(value)) if isinstance(value, torch.Tensor) else None
                    if view is not None:
                        self.places[(id(key), name)] = value
                        self.pointed.point(Holder(entries, name), view)
        self.pointed.rekey(state, self.views)
        if megatron_fsdp.is_megatron_fsdp(wrapper):
            # Its DTensors are handed out as themselves: their local tensors are pointed at
            # the host copy (dtensor_view.py).
            try:
                self.dtensors = DTensorView(wrapper, slices)
            except BaseException:
                self.restore(writes=False)  # all or nothing
                raise

    def restore(self, writes: bool) -> None:
        engine = self.engine
        if writes:
            # Resident tensors may have been written in place: their host copies are stale.
            engine.mark_dirty(on_device=True)
        if not self.views:
            return
        if self.dtensors is not None:
            self.dtensors.close()
        if writes:
            for served, host in self.copies:
                host.copy_(served)
        inner = self.owner.optimizer
        pointed = self.pointed
        # Back in the lists the block sees now (a load may have rebuilt param_groups around
        # them), in the entries it found, and as the keys of the mapping it sees now.
        pointed.restore(
            lists=[group["params"] for group in inner.param_groups]
            + list(wrappers.master_groups(self.owner)),
            mapping=inner.state,
        )
        changed = False
        adopt = []
        for key, entries in list(dict.items(inner.state)):
            if not isinstance(entries, dict):
                continue
            for name, value in list(entries.items()):
                if not isinstance(value, torch.Tensor):
                    continue
                if pointed.stands_in(value):  # a view in an entry dict a load made
                    entries[name] = pointed.original(value)
                    continue
                original = self.places.get((id(key), name))
                if not writes or value is original or id(value) in self.existing:
                    continue  # put back above, or the optimizer's own (resident)
                if original is not None and _fits(value, original):
                    if value.numel():
                        # A new value for a served place: into the host copy, the tensor stays.
                        self.write(original, value)
                    entries[name] = original
                elif original is not None or _has_state_place(key, name, value):
                    changed = True
                    if (
                        id(key) in self.views
                        and value.device.type == "cpu"
                        and is_plain(value)
                        and value.numel()
                    ):
                        # Made in the block for a served parameter (torch's load casts to the
                        # parameter's device): already on the host.
                        adopt.append((entries, name, value))
        pointed.forget()
        if adopt:
            try:
                tensors = engine.adopted.from_host([value for _, _, value in adopt])
            except BaseException:
                # Not kept on the host outside the engine either: the optimizer goes on as
                # if the load had not made these states (a load made again makes them anew).
                for entries, name, _ in adopt:
                    del entries[name]
                raise
            for (entries, name, value), tensor in zip(adopt, tensors):
                entries[name] = tensor
                self.written_bytes += value.numel() * value.element_size()
        if changed or adopt:
            engine.invalidate()
        if adopt:
            # Laid out now: the next prefetch must bring the adopted states in with the rest.
            engine.rescan()

    def write(self, original: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` into the host copy of the served ``original``. A value that is itself a
        served tensor (a state dict taken earlier holds the optimizer's own tensors) is read
        from its host copy: its device memory is released."""
        target = self.views[id(original)]
        source = self.views.get(id(value), value)
        if source is target:
            return
        with torch.no_grad():
            target.copy_(source)
        self.written_bytes += value.numel() * value.element_size()


def _replace_views(value, views: set[int]):
    """``value`` with the tensors whose id is in ``views`` cloned; a container is rebuilt only
    if something in it changed (shared objects stay shared, as a pickle sees them)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if id(value) in views else value
    if isinstance(value, dict) and _plain_dict(value):
        items = [(k, _replace_views(v, views)) for k, v in value.items()]
        if all(new is old for (_, new), old in zip(items, value.values())):
            return value
        return type(value)(items)
    if isinstance(value, list) or (isinstance(value, tuple) and type(value) is tuple):
        items = [_replace_views(v, views) for v in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return type(value)(items)
    return value


def _plain_dict(value) -> bool:
    return type(value) in (dict, collections.OrderedDict)


def _like(tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """The host view standing in for ``tensor``: its class and Python attributes (Megatron's
    tensor-parallel attributes on masters), over the host copy."""
    if isinstance(tensor, torch.nn.Parameter):
        view = torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
    else:
        view = host.view(host.shape)
    view.__dict__.update(tensor.__dict__)
    return view


def _fits(value: torch.Tensor, original: torch.Tensor) -> bool:
    """``value`` can be written into ``original``'s host copy (a load's value for it)."""
    return (
        is_plain(value)
        and value.dtype == original.dtype
        and (value.numel() == 0 or value.shape == original.shape)
    )


def _has_state_place(key, name, value) -> bool:
    """A per-element state tensor the engine would track (not ``step``, not a scalar)."""
    return (
        isinstance(key, torch.Tensor)
        and name not in inner_optimizers.NEVER_MOVED
        and (value.numel() == key.numel() or value.numel() > 1)
    )
