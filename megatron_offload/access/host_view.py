"""Checkpoints served from the host copy: ``HostView``.

While the states are offloaded, their only valid copy is in the host arena. A checkpoint save
reads them and a load writes them; neither needs them on the device. ``HostView`` is the one
mechanism by which megatron-core's checkpoint code reaches offloaded state: for the duration
of a call (``sharded_state_dict``, ``state_dict``, ``save_parameter_state``, every load) each
released tensor is replaced, where the optimizer keeps it, by a CPU tensor that views its
slice of the host arena:

* the fp32 masters in the inner optimizer's ``param_groups`` and in the wrapper's master
  lists (``shard_fp32_from_float16_groups`` / ``fp32_from_float16_groups``), and as keys of
  the inner optimizer's ``state`` (re-keyed in place, in the same order);
* every state tensor (``exp_avg``, ``momentum_buffer``, ...) in the per-parameter state dicts.

A read is then a read of the host copy (no device byte, no copy in); a write (a load copying
into the states in place, ``reload_model_params`` copying into the masters) writes the host
copy, which the next prefetch brings to the device as usual. On exit every original tensor
object goes back in its place, so the engine's layout, the optimizer's identities and any
reference a user kept are unchanged. Nothing is marked stale: a save leaves the host copy
valid, and the next offload copies only what the next step wrote.

Loads that put new tensors in place of the served ones (torch's ``Optimizer.load_state_dict``
rebuilds every state dict and casts each value to its parameter's device) are folded back:
a value for a served place is first written into the host copy and stands in the load as a
zero-element placeholder (so the cast to a device parameter's device copies nothing), and the
original tensor goes back on exit. A new value of another shape or dtype, or for a place that
had no tensor (the first load into an optimizer without state), stays as the load made it and
the engine looks again at the next offload; one that landed on the host because its parameter
was served is handed to the engine as already offloaded (``adopt``).

Resident tensors (partial offload, a prefetched state) are read where they are; a load
that writes them marks their host copy stale. Configurations whose states cannot be read on
the host without the device (Transformer Engine's fp16 moments, whose scales live on the
device, and FP8 moments, dequantized by a device kernel) are not served: there the guard
brings the states back as before (``servable``).

Rule 5 of the copy protocol: the host copy is read only after its D2H completed, so entering
waits for every pending copy out (a host block, at a checkpoint only). The arena is written
next by the offload after the next step; megatron-core's savers copy what they write before
the save call returns (``dist_checkpointing`` clones every CPU tensor that views a larger
storage while planning the write; the torch format pickles synchronously).
"""

from __future__ import annotations

import collections
import time

import torch

from ..adapters import PRIMARY_WEIGHTS, inner_optimizers
from ..adapters import megatron_wrappers as wrappers
from ..engine import Place
from ..engine.groups import aligned_size

# TE FusedAdam state dtypes whose values need the device to be read (scales on the device,
# FP8 dequantization kernels).
_DEVICE_ONLY_DTYPES = (torch.float16, torch.uint8)


def servable(offloader) -> bool:
    """True if every optimizer of ``offloader`` can have its checkpoints served from the host."""
    for distrib_optimizer in offloader._distributed:
        inner = distrib_optimizer.optimizer
        if inner_optimizers.kind_of(inner) == inner_optimizers.TE_FUSED_ADAM:
            dtypes = getattr(inner, "name_to_dtype_map", {}) or {}
            if any(
                dtypes.get(k) in _DEVICE_ONLY_DTYPES
                for k in ("exp_avg", "exp_avg_sq", "master_param")
            ):
                return False
    return True


def serve_reads(offloader, *, masters: bool) -> None:
    """A read of a guarded state mapping between steps (guard.py): its values are served from
    the host copy until the next call that moves states (``offloader.end_reads``), with no
    copy to the device. ``masters``: the access hands out the mapping's keys, which are the
    master weights of a bf16/fp16 model; those come back to the device (the moments stay)."""
    if masters:
        for engine in offloader._engines:
            kinds = (PRIMARY_WEIGHTS,)
            if engine.is_released(kinds):
                engine.reload(kinds)
            engine.wait(kinds)
            for group in engine.groups:  # handed out: the caller may write them
                if group.kind == PRIMARY_WEIGHTS:
                    group.host_valid = False
    if offloader._reads is None and offloader._host_view is None:
        view = HostView(offloader, writes=True, keys=False)
        view.__enter__()
        offloader._reads = view


def checkpoint_view(offloader):
    """The HostView a checkpoint method opened (its calls into the inner optimizer read and
    write the host copies), or None. A read's view (``serve_reads``) is not one: it is closed
    first, and calls made under it (a user's own ``inner.state_dict()``) take the old path."""
    if offloader._host_view is not None and offloader._host_view is offloader._reads:
        offloader.end_reads()
    return offloader._host_view


class HostView:
    """Context manager: the offloader's released tensors seen as their host copies.

    Re-entrant (a save calls ``state_dict`` inside ``sharded_state_dict``): only the outermost
    one swaps. ``writes``: the block may write the states (a load): resident tensors' host
    copies become stale, and values the block put in place of served tensors are folded back.
    ``keys=False``: only the state values are served; parameters (and so the state's keys)
    stay the optimizer's own objects, so ``state[p]`` with a parameter taken from
    ``param_groups`` before the block still finds its entry (reads between steps).
    """

    def __init__(self, offloader, *, writes: bool, keys: bool = True) -> None:
        self._offloader = offloader
        self._writes = writes
        self._keys = keys
        self.outer = False
        self._served: list[_Served] = []

    def __enter__(self) -> "HostView":
        offloader = self._offloader
        self.outer = offloader._host_view is None
        if self._writes:
            offloader._host_view_writes = True
        if not self.outer:
            return self
        offloader._host_view = self
        offloader._guard.arm(False)  # the mapping is served, not guarded, in the block
        figures = offloader._host_view_figures
        figures["host_view_calls"] += 1
        # State the block finds on the device (partial offload, a prefetch): read there.
        figures["host_view_device_bytes"] = max(
            figures["host_view_device_bytes"],
            sum(e.stats()["resident_bytes"] for e in offloader._engines),
        )
        start = time.perf_counter()
        try:
            for engine, distrib_optimizer in zip(offloader._engines, offloader._distributed):
                self._served.append(_Served(engine, distrib_optimizer, self._keys))
            figures["host_view_wait_ms"] += (time.perf_counter() - start) * 1e3
        except BaseException:
            self._close(False)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.outer:
            self._close(self._offloader._host_view_writes)

    def _close(self, writes: bool) -> None:
        offloader = self._offloader
        try:
            self._restore(writes)
        finally:
            offloader._host_view = None
            offloader._host_view_writes = False
            offloader._sync_state_guard()

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
            key = served.originals.get(id(param), param)
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
            original_key = served.originals.get(id(key), key)
            for name, value in list(entries.items()):
                original = served.places.get((id(original_key), name))
                if original is not None and isinstance(value, torch.Tensor) and value.numel() == 0:
                    entries[name] = served.views[id(original)]

    def detached(self, result):
        """``result`` with every served host view in it (in dicts, lists and tuples) replaced
        by a copy of its own: what a caller keeps (``state_dict()`` pickled by ``torch.save``)
        never references the host arena, which the next offload overwrites and which torch's
        serialization would otherwise save whole under one storage of mixed dtypes."""
        views = {key for served in self._served for key in served.originals}
        if not views:
            return result
        return _replace_views(result, views)

    def _for(self, inner):
        for served in self._served:
            if served.owner.optimizer is inner:
                return served
        return None

    def _restore(self, writes: bool) -> None:
        figures = self._offloader._host_view_figures
        key = "host_view_load_bytes" if writes else "host_view_save_bytes"
        for served in self._served:
            figures[key] += served.served_bytes
        errors = []
        for served in reversed(self._served):
            try:
                served.restore(writes)
            except BaseException as error:  # restore the others before raising
                errors.append(error)
            figures["host_view_load_bytes"] += served.written_bytes
        self._served = []
        if errors:
            raise errors[0]


class _Served:
    """The swap for one Megatron optimizer (one engine)."""

    def __init__(self, engine, distrib_optimizer, keys: bool = True) -> None:
        self.engine = engine
        self.owner = distrib_optimizer
        # Rules 3 and 4: what is on the device (a prefetch may have started its copy back) is
        # read and written in place by the block, after that copy (no host block).
        engine.wait()
        # Rule 5: the host copies are read (and written) by the host in the block.
        engine.synchronize_host()
        self.views: dict[int, torch.Tensor] = {}  # id(original) -> its host view
        self.originals: dict[int, torch.Tensor] = {}  # id(view) -> original
        # Views that are copies, with the host copy they are written back to (see below).
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.served_bytes = 0  # host-copy bytes in place of released tensors
        self.written_bytes = 0  # bytes folded into the host copy beyond them (new tensors)
        for group in engine.groups:
            if group.place is Place.RELEASED:
                for tensor, host in group.host_slices():
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
                    self.originals[id(served)] = tensor
                    self.served_bytes += host.numel() * host.element_size()
        # Where each served tensor sat in the state: (original key, state key) -> original.
        self.places: dict[tuple[int, object], torch.Tensor] = {}
        self.existing: dict[int, torch.Tensor] = {}
        # The entry dicts changed here: restored even if a load put other dicts in the state
        # (someone may still hold these: the optimizer's state watch does).
        self.swapped: list[tuple[dict, object, torch.Tensor, torch.Tensor]] = []
        if not self.views:
            return
        inner = distrib_optimizer.optimizer
        if keys:
            for group in inner.param_groups:
                self._swap_list(group["params"])
            for masters in wrappers.master_groups(distrib_optimizer):
                self._swap_list(masters)
        state = inner.state
        items = list(dict.items(state))
        # Every tensor the state holds now (held, so that no id is reused in the block): on
        # exit, a tensor found in the state that is none of these was made in the block.
        self.existing = {
            id(v): v
            for _, e in items
            if isinstance(e, dict)
            for v in e.values()
            if isinstance(v, torch.Tensor)
        }
        dict.clear(state)
        for key, entries in items:
            if isinstance(entries, dict):
                for name, value in list(entries.items()):
                    view = self.views.get(id(value)) if isinstance(value, torch.Tensor) else None
                    if view is not None:
                        self.places[(id(key), name)] = value
                        self.swapped.append((entries, name, value, view))
                        entries[name] = view
            dict.__setitem__(state, self.views.get(id(key), key) if keys else key, entries)

    def _swap_list(self, tensors: list) -> None:
        for index, tensor in enumerate(tensors):
            view = self.views.get(id(tensor)) if tensor is not None else None
            if view is not None:
                tensors[index] = view

    def restore(self, writes: bool) -> None:
        engine = self.engine
        if writes:
            # Resident tensors may have been written in place: their host copies are stale.
            for group in engine.groups:
                if group.place is not Place.RELEASED:
                    group.host_valid = False
        if not self.views:
            return
        if writes:
            for served, host in self.copies:
                host.copy_(served)
        inner = self.owner.optimizer
        originals = self.originals
        # The lists the block sees now (a load may have rebuilt param_groups around them).
        lists = [group["params"] for group in inner.param_groups] + list(
            wrappers.master_groups(self.owner)
        )
        for tensors in lists:
            for index, tensor in enumerate(tensors):
                original = originals.get(id(tensor)) if tensor is not None else None
                if original is not None:
                    tensors[index] = original
        for entries, name, original, view in self.swapped:
            if entries.get(name) is view:
                entries[name] = original
        state = inner.state
        items = list(dict.items(state))
        dict.clear(state)
        changed = False
        adopt = []
        for key, entries in items:
            served_key = id(key) in originals
            key = originals.get(id(key), key)
            if isinstance(entries, dict):
                for name, value in list(entries.items()):
                    if not isinstance(value, torch.Tensor):
                        continue
                    original = originals.get(id(value))
                    if original is not None:
                        entries[name] = original
                        continue
                    original = self.places.get((id(key), name))
                    if not writes or value is original or id(value) in self.existing:
                        continue  # put back above with its dict, or the optimizer's own (resident)
                    if original is not None and _fits(value, original):
                        if value.numel():
                            # A new value for a served place: into the host copy, the tensor stays.
                            self.write(original, value)
                        entries[name] = original
                    elif original is not None or _has_state_place(key, name, value):
                        changed = True
                        if (
                            served_key
                            and value.device.type == "cpu"
                            and _plain(value)
                            and value.numel()
                        ):
                            # Made in the block for a served parameter (torch's load casts to
                            # the parameter's device): already on the host.
                            adopt.append((entries, name, value))
            dict.__setitem__(state, key, entries)
        if adopt:
            self._adopt(adopt)
        if changed or adopt:
            engine.invalidate()
        if adopt:
            # Laid out now: the next prefetch must bring the adopted states in with the rest.
            engine.rescan()

    def _adopt(self, places) -> None:
        """States the block created on the host (their parameter was served): the engine
        takes them as offloaded, their bytes in a host buffer of its device."""
        device = self.engine.device
        sizes = [value.numel() * value.element_size() for _, _, value in places]
        # One staging buffer for all of them (one pinned allocation, not one per tensor); the
        # engine moves them into its arena at the next offload and gives it back then.
        buffer = device.host_buffer(sum(aligned_size(n) for n in sizes))
        items, offset = [], 0
        for (entries, name, value), nbytes in zip(places, sizes):
            host = buffer[offset : offset + nbytes]
            host.copy_(value.contiguous().view(-1).view(torch.uint8))
            offset += aligned_size(nbytes)  # each one aligned for its dtype
            # The device tensor the optimizer will use: allocated and released at once, one at
            # a time (never more than the largest of them on the device).
            tensor = device.empty(value.numel(), value.dtype).view(value.shape)
            device.release(tensor)
            entries[name] = tensor
            items.append((tensor, host, None, buffer))
            self.written_bytes += nbytes
        self.engine.adopt(items)

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


def _plain(value) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter)


def _fits(value: torch.Tensor, original: torch.Tensor) -> bool:
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
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
