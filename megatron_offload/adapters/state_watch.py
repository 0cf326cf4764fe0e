"""``StateWatch``: when the tensors of a DistributedOptimizer may have changed, in O(groups).

The engine walks ``collect`` (every state tensor, ~1.5 us each) only when a fingerprint
says the set may have changed; the fingerprint runs before every offload, so it must not
itself look at every parameter. What ``collect`` returns is a function of

* the inner optimizer, its ``state`` mapping and ``param_groups`` (each group and its
  ``params`` list), and megatron-core's ``shard_fp32_from_float16_groups`` (the masters);
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

_is = operator.is_


class StateWatch:
    """Fingerprint of ``collect(distrib_optimizer)`` and the masters whose gradients to release.

    ``distrib_optimizer`` needs ``.optimizer`` (with ``state`` and ``param_groups``) and may
    have ``shard_fp32_from_float16_groups``.
    """

    def __init__(self, distrib_optimizer) -> None:
        self._owner = distrib_optimizer
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
        if lengths != self._lengths or not all(map(_is, objects, self._objects)) or self._grown():
            self._look(objects, lengths)
        return self.serial

    def _containers(self) -> tuple[list, list[int]]:
        owner = self._owner
        inner = owner.optimizer
        state = inner.state
        groups = inner.param_groups
        masters = getattr(owner, "shard_fp32_from_float16_groups", None) or ()
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
        groups = [[m for m in g if m is not None] for g in getattr(owner, "shard_fp32_from_float16_groups", None) or ()]
        self._masters = [m for g in groups for m in g]
        self._probes = [m for g in groups if g for m in {id(g[0]): g[0], id(g[-1]): g[-1]}.values()]

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
        self._state, self._masters, self._probes = None, [], []


def _getter(state):
    """``state.get`` by dict's own lookup (a guarded mapping's accessors reload; see
    ``distributed_optimizer._entries``)."""
    if isinstance(state, dict):
        return lambda param: dict.get(state, param)
    return state.get
