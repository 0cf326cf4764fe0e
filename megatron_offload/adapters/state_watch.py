"""``StateWatch``: when the tensors of a Megatron optimizer may have changed, in O(groups).

The engine walks ``collect`` (every state tensor, ~1.5 us each) only when a fingerprint
says the set may have changed; the fingerprint runs before every offload, so it must not
itself look at every parameter. What ``collect`` returns is a function of

* the inner optimizer, its ``state`` mapping and ``param_groups`` (each group and its
  ``params`` list), and the wrapper's lists of masters (``shard_fp32_from_float16_groups``
  or ``fp32_from_float16_groups``, see ``distributed_optimizer.master_groups``);
* the contents of each parameter's state dict.

The first are compared by identity and length at every call: O(groups). Of the second only
the dicts that may still grow are looked at: those that were empty (or missing), or held
fewer entries than the fullest one, at the last look. That is sound for megatron-core's
inner optimizers because each creates a parameter's states in ``step()`` only when its dict
is empty, all at once (torch's Adam/AdamW ``_init_group``, apex's and Transformer Engine's
FusedAdam: ``if len(state) == 0``; apex never does for a parameter without gradients, which
therefore stays watched). A dict that is already full changes otherwise only by a load
(torch's ``load_state_dict`` puts a new mapping in place, seen here; the guarded load methods
of megatron-core and TE invalidate the engine), by TE's ``initialize_state`` (guarded:
invalidates), or by hand, where ``mark_optimizer_states_initialized()`` says so (replacing
an existing tensor by hand never changed a count either).

Other inner optimizers may replace state tensors inside ``step()`` without changing any
count: SOAP (``emerging_optimizers``) puts new ``exp_avg``, ``exp_avg_sq``, ``Q_L`` and
``Q_R`` tensors into the state at every step. For every inner optimizer that is not one of
those Adams (``inner_optimizers.kind_of`` is ``OTHER``) the watch also compares the identity
of every state tensor with the last look: O(state tensors) per call, a few microseconds per
parameter, so a replaced tensor is offloaded like a new one and none stays on the device.
Better still, ``keep_replaced`` (called before every offload) copies a replacement that is
a fresh tensor like the one it replaced back into that one and puts it back: the layout (one
copy per piece and direction) survives SOAP's steps, for one device-to-device copy of each
replaced tensor, and the replacement's memory goes back to the allocator.

The value is a serial number advanced at every change seen (any caller may ask: a change
seen by one is a new value for all). The watch also keeps the list of masters for
``release_master_grads``, rebuilt with the rest. It holds the containers it compares (so
that a replaced one can never be mistaken for a new one at the same address); the engine
drops the watch when it is closed (detach), so nothing outlives the offloader's use.
"""

from __future__ import annotations

import collections
import itertools
import operator

import torch

from .distributed_optimizer import master_groups
from .inner_optimizers import OTHER, kind_of

_is = operator.is_


class StateWatch:
    """Fingerprint of ``collect(distrib_optimizer)`` and the masters whose gradients to release.

    ``distrib_optimizer`` needs ``.optimizer`` (with ``state`` and ``param_groups``) and may
    have masters (``distributed_optimizer.master_groups``). ``identities``: also compare the
    identity of every state tensor at every call (None: for inner optimizers other than
    megatron-core's Adams, which may replace their state tensors in ``step()``).
    """

    def __init__(self, distrib_optimizer, *, identities: bool | None = None) -> None:
        self._owner = distrib_optimizer
        if identities is None:
            identities = kind_of(distrib_optimizer.optimizer) == OTHER
        self.identities = identities
        self._params: list = []  # every parameter of the inner optimizer, at the last look
        self._tensor_ids: list[tuple[int, ...]] = []  # ids of each one's state tensors
        self._places: list[tuple[dict, object, torch.Tensor]] = []  # (entries, key, tensor) seen
        self.serial = 0  # advanced at every change seen
        self.looks = 0  # full looks (O(parameters)) so far
        self._objects: list = []  # containers compared by identity
        self._lengths: list[int] = []
        self._watched: list[tuple[object, int]] = []  # (param, entries at the last look)
        self._state = None
        self._masters: list[torch.Tensor] = []
        self._probes: list[torch.Tensor] = []  # first and last master of each group

    # ----------------------------------------------------------------- fingerprint
    def __call__(self) -> int:
        objects, lengths = self._containers()
        if (
            lengths != self._lengths
            or not all(map(_is, objects, self._objects))
            or self._grown()
            or (self.identities and self._tensor_identities() != self._tensor_ids)
        ):
            self._look(objects, lengths)
        return self.serial

    def _containers(self) -> tuple[list, list[int]]:
        owner = self._owner
        inner = owner.optimizer
        state = inner.state
        groups = inner.param_groups
        masters = master_groups(owner)
        objects = [inner, state, groups, masters]
        lengths = [len(state), len(groups), len(masters)]
        for group in groups:
            params = group["params"]
            objects += (group, params)
            lengths.append(len(params))
        for master_group in masters:
            objects.append(master_group)
            lengths.append(len(master_group))
        return objects, lengths

    def _grown(self) -> bool:
        """True if a watched parameter's state dict has other entries than at the last look."""
        if not self._watched:
            return False
        get = _getter(self._state)
        return any(len(get(param) or ()) != seen for param, seen in self._watched)

    def _tensor_identities(self) -> list[tuple[int, ...]]:
        """The ids of each parameter's state tensors (``identities`` mode), O(state tensors)."""
        get = _getter(self._state)
        return [
            tuple(id(value) for value in (get(param) or {}).values() if isinstance(value, torch.Tensor))
            for param in self._params
        ]

    def _look(self, objects: list, lengths: list[int]) -> None:
        """O(parameters): note every container and which state dicts may still grow."""
        self.serial += 1
        self.looks += 1
        self._objects, self._lengths = objects, lengths
        owner = self._owner
        state = owner.optimizer.state
        self._state = state
        get = _getter(state)
        params = [p for group in owner.optimizer.param_groups for p in group["params"]]
        counts = [len(get(p) or ()) for p in params]
        fullest = max(counts, default=0)
        self._watched = [(p, n) for p, n in zip(params, counts) if n == 0 or n < fullest]
        if self.identities:
            self._params = params
            self._tensor_ids = self._tensor_identities()
            self._places = [
                (entries, key, value)
                for entries in filter(None, map(get, params))
                for key, value in entries.items()
                if type(value) is torch.Tensor
            ]
        groups = [[m for m in g if m is not None] for g in master_groups(owner)]
        self._masters = [m for g in groups for m in g]
        self._probes = [m for g in groups if g for m in {id(g[0]): g[0], id(g[-1]): g[-1]}.values()]

    def keep_replaced(self) -> int:
        """Undo the optimizer's replacement of state tensors (``identities`` mode); returns
        how many tensors it changed.

        Where the optimizer put a new tensor in place of one seen at the last look, of the
        same shape, dtype and device (not another state tensor), while the old one is contiguous and
        still has its memory (resident): the new values are copied into the old tensor (on
        the current stream, after the step that made them) and the old tensor goes back into
        the state. A state tensor that is not contiguous (SOAP's eigenbases come from
        ``torch.linalg.eigh`` in column-major order) is replaced by a contiguous copy once:
        the engine moves contiguous tensors only. The optimizer holds no reference to its
        states between steps, so it cannot tell; the tracked tensors, and with them the
        engine's layout, stay the same from step to step.
        """
        if not self.identities:
            return 0
        if not self._places:
            self()  # a first look records the places (the states appear at the first step)
        changed = 0
        seen = {id(tensor) for _, _, tensor in self._places}
        for entries, key, old in self._places:
            new = entries.get(key)
            if type(new) is not torch.Tensor:
                continue
            if new is not old and _same_kind(new, old) and old.is_contiguous() and old.untyped_storage().nbytes() \
                    and new.untyped_storage().nbytes() and id(new) not in seen:
                with torch.no_grad():
                    old.copy_(new)
                entries[key] = old
                changed += 1
            elif not new.is_contiguous() and new.untyped_storage().nbytes():
                entries[key] = new.contiguous()
                changed += 1
        return changed

    # --------------------------------------------------------------- master grads
    def release_master_grads(self) -> bool:
        """Drop the ``.grad`` of every master if any may hold one; True if they were dropped.

        megatron-core gives the masters their fp32 gradients in one loop over each group
        (``_copy_model_grads_to_main_grads``, every master of the group) and drops them in one
        loop (``zero_grad``), so the first and last master of each group tell whether any
        holds one (an interrupted loop leaves a prefix). Only then is every master visited,
        in one C-level pass: each gradient is its own allocation, so freeing them costs a call
        per master, but a cycle without a step (nothing to free) costs O(groups).
        """
        self()
        if not any(m.grad is not None for m in self._probes):
            return False
        collections.deque(map(setattr, self._masters, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0)
        return True

    def forget(self) -> None:
        """Drop every reference to the optimizer's containers (the engine was closed)."""
        self._objects, self._lengths, self._watched = [], [], []
        self._params, self._tensor_ids, self._places = [], [], []
        self._state, self._masters, self._probes = None, [], []


def _same_kind(new, old: torch.Tensor) -> bool:
    """``new`` is a plain tensor that can take ``old``'s place (shape, dtype, device)."""
    return (
        type(new) is torch.Tensor
        and new.shape == old.shape
        and new.dtype == old.dtype
        and new.device == old.device
    )


def _getter(state):
    """``state.get`` by dict's own lookup (a guarded mapping's accessors reload; see
    ``distributed_optimizer._entries``)."""
    if isinstance(state, dict):
        return lambda param: dict.get(state, param)
    return state.get
