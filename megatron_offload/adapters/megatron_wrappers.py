"""The tensors of megatron-core's optimizer wrappers: which to offload, and when they change.

The wrappers (what ``get_megatron_optimizer`` builds, alone or chained) are
``DistributedOptimizer`` (``--use-distributed-optimizer``: each data-parallel rank holds a
shard of every parameter's state), ``Float16OptimizerWithFloat16Params`` (bf16/fp16 models
without it, and every emerging optimizer: Lion, Muon, SOAP, also inside
``LayerWiseDistributedOptimizer``) and ``FP32Optimizer`` (fp32 models without it). Each
keeps its torch optimizer as ``.optimizer``.

Two kinds of tensors are offloaded (the names match the upstream ``offload`` arguments):

* ``optimizer_states``: every full-size tensor the inner optimizer keeps per parameter,
  found in its state itself, whatever the optimizer calls it (Adam's ``exp_avg`` and
  ``exp_avg_sq``, Lion's ``exp_avg``, Muon's and SGD's ``momentum_buffer``, SOAP's moments
  and its preconditioners ``L``, ``R``, ``Q_L``, ``Q_R``). Scalars (``step``, ``[1]`` scales)
  never move: they are tiny, and they are read on the host.
* ``master_weights``: the fp32 master weights, wherever the wrapper keeps them:
  ``shard_fp32_from_float16_groups`` (DistributedOptimizer: fp32 clones of the bf16/fp16
  parameter shards), ``fp32_from_float16_groups`` (Float16OptimizerWithFloat16Params: fp32
  clones of the whole bf16/fp16 parameters), or, on the precision-aware path (Transformer
  Engine FusedAdam with master weights), inside the optimizer state as ``master_param``
  (fp32, fp16, or the int16 low bits of an fp32 master whose high bits are the bf16
  parameter, with ``store_param_remainders``). FP32Optimizer has none.

fp32 *parameters* the inner optimizer updates directly (``shard_fp32_groups``, views into the
model's fp32 parameters; ``fp32_from_fp32_groups``; every parameter under FP32Optimizer) are the
model's own weights: the forward pass needs them, so they are never offloaded.

The inner optimizer may be Transformer Engine's FusedAdam, apex's FusedAdam, the
``torch.optim.AdamW`` fallback, torch's SGD, or an ``emerging_optimizers`` optimizer: all keep
``state[param][name]`` tensors. What differs (low-precision and FP8 moments, int16 master
remainders, state only for parameters with gradients, states replaced at every step) is
described and handled in ``inner_optimizers.py`` and by ``StateWatch`` below.

``StateWatch``: when the tensors of a wrapper may have changed, in O(groups).

The engine walks ``collect`` (every state tensor, ~1.5 us each) only when a fingerprint
says the set may have changed; the fingerprint runs before every offload, so it must not
itself look at every parameter. What ``collect`` returns is a function of

* the inner optimizer, its ``state`` mapping and ``param_groups`` (each group and its
  ``params`` list), and the wrapper's lists of masters (``shard_fp32_from_float16_groups``
  or ``fp32_from_float16_groups``, see ``master_groups``);
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
from typing import Iterator

import torch

from . import inner_optimizers, megatron_fsdp
from .holders import Holder, Repointing, same_kind
from .inner_optimizers import OTHER, kind_of

OPTIMIZER_STATES = "optimizer_states"
MASTER_WEIGHTS = "master_weights"
KINDS = (OPTIMIZER_STATES, MASTER_WEIGHTS)


def inner_params(wrapper) -> Iterator[torch.Tensor]:
    """The parameters the inner optimizer updates, in its param-group order."""
    for group in wrapper.optimizer.param_groups:
        yield from group["params"]


def collect(wrapper) -> Iterator[tuple[str, torch.Tensor]]:
    """``(kind, tensor)`` for every tensor of ``wrapper`` that can be offloaded.

    The order is stable from call to call (param groups, then parameters, then state keys
    sorted), so the engine sees an unchanged set as unchanged.
    """
    for master in master_weights(wrapper):
        yield MASTER_WEIGHTS, master
    state = wrapper.optimizer.state
    for param in inner_params(wrapper):
        entries = _entries(state, param)
        if not entries:
            continue  # apex FusedAdam: no state until the parameter had a gradient
        yield from state_kinds(param, entries)


def state_kinds(param, entries) -> Iterator[tuple[str, torch.Tensor]]:
    """``(kind, tensor)`` for every per-parameter tensor of one parameter's state
    (``entries``), in ``state_tensors``' order: ``MASTER_WEIGHTS`` for a master kept in the
    state (Transformer Engine's ``master_param``), ``OPTIMIZER_STATES`` for the rest."""
    for key, tensor in inner_optimizers.state_tensors(param, entries):
        yield (MASTER_WEIGHTS if inner_optimizers.is_master_key(key) else OPTIMIZER_STATES), tensor


def in_state(wrapper) -> Iterator[torch.Tensor]:
    """Every tensor ``collect`` finds inside the inner optimizer's state (not the masters
    megatron-core keeps beside it): what the chunked update can stream."""
    state = wrapper.optimizer.state
    for param in inner_params(wrapper):
        entries = _entries(state, param)
        if entries:
            for _, tensor in inner_optimizers.state_tensors(param, entries):
                yield tensor


def _entries(state, param):
    """``state.get(param)`` by dict's own lookup: while states are offloaded the mapping is
    the offloader's guarded one (``access/state.py``), whose accessors bring them back,
    and finding the tensors touches none of them."""
    return dict.get(state, param) if isinstance(state, dict) else state.get(param)


# Where each wrapper keeps the fp32 masters of its bf16/fp16 parameters (lists of lists, one
# list per param group): DistributedOptimizer, then Float16OptimizerWithFloat16Params.
MASTER_GROUP_ATTRIBUTES = ("shard_fp32_from_float16_groups", "fp32_from_float16_groups")


def master_groups(wrapper) -> list:
    """The wrapper's lists of master weights held outside the optimizer state, one list per
    param group (entries may be None on the precision-aware path); empty if it has none."""
    for name in MASTER_GROUP_ATTRIBUTES:
        groups = getattr(wrapper, name, None)
        if groups is not None:
            return groups
    return []


def master_weights(wrapper) -> Iterator[torch.Tensor]:
    """The master weights (or master shards) held outside the optimizer state (may be empty):
    under Megatron-FSDP, its per-group buffers of them (``megatron_fsdp.py``)."""
    yield from megatron_fsdp.master_buffers(wrapper)
    for groups in master_groups(wrapper):
        for master in groups:
            if master is not None:
                yield master


def device_of(wrapper) -> torch.device:
    """The device the optimizer's parameters live on (CPU if it has none)."""
    for param in inner_params(wrapper):
        return param.device
    return torch.device("cpu")


def expected(wrapper) -> list[tuple[str, torch.Tensor, bool, torch.device]] | None:
    """What ``collect`` will return once every parameter has its state, for reserving the
    host arena ahead of the first offload (``OffloadEngine.reserve_host``).

    ``(kind, tensor, in_state, device)`` in ``collect``'s order: the masters and existing
    states as they are; the states Adam makes at its first step as meta tensors of their
    shape and dtype, ``device`` the parameter's. Exact for torch's Adam/AdamW and apex's
    FusedAdam, which give every parameter with a gradient moments like the parameter (an
    upper bound when some parameter never gets a gradient), and for Transformer Engine's
    FusedAdam with plain (fp32, bf16, fp16) moments; None where the states cannot be
    foreseen (FP8 moments, other optimizers): nothing is reserved then.
    """
    inner = wrapper.optimizer
    found = [(MASTER_WEIGHTS, master, False, master.device) for master in master_weights(wrapper)]
    state = inner.state
    for group in inner.param_groups:
        for param in group["params"]:
            entries = _entries(state, param)
            if entries:
                for key, tensor in inner_optimizers.state_tensors(param, entries):
                    kind = (
                        MASTER_WEIGHTS if inner_optimizers.is_master_key(key) else OPTIMIZER_STATES
                    )
                    found.append((kind, tensor, True, tensor.device))
                continue
            future = _future_states(inner, group, param)
            if future is None:
                return None
            # This rank's shard of a DTensor parameter (Megatron-FSDP): its states are as large.
            local = inner_optimizers.dtensor_local(param)
            shape = (param if local is None else local).shape
            for key, dtype in future:  # sorted by key, as state_tensors visits them
                kind = MASTER_WEIGHTS if inner_optimizers.is_master_key(key) else OPTIMIZER_STATES
                found.append(
                    (kind, torch.empty(shape, dtype=dtype, device="meta"), True, param.device)
                )
    return found


def _future_states(inner, group, param) -> list[tuple[str, torch.dtype]] | None:
    """``[(key, dtype), ...]`` of the per-element states ``inner`` will make for ``param``."""
    kind = inner_optimizers.kind_of(inner)
    if kind in (inner_optimizers.TORCH_ADAM, inner_optimizers.APEX_FUSED_ADAM):
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        return [(key, param.dtype) for key in keys]
    if kind == inner_optimizers.TE_FUSED_ADAM:
        dtypes = getattr(inner, "name_to_dtype_map", {})
        plain = (torch.float32, torch.bfloat16, torch.float16)
        states = [(key, dtypes.get(key)) for key in ("exp_avg", "exp_avg_sq")]
        if getattr(inner, "master_weights", False):
            remainders = (
                getattr(inner, "store_param_remainders", False) and param.dtype == torch.bfloat16
            )
            states.append(
                ("master_param", torch.int16 if remainders else dtypes.get("master_param"))
            )
        if any(dtype not in plain + (torch.int16,) for _, dtype in states):
            return None
        return sorted(states)
    return None


# ---------------------------------------------------------------------- the watch
_is = operator.is_


class StateWatch:
    """Fingerprint of ``collect(wrapper)`` and the masters whose gradients to release.

    ``wrapper`` needs ``.optimizer`` (with ``state`` and ``param_groups``) and may
    have masters (``master_groups``). ``identities``: also compare the
    identity of every state tensor at every call (None: for inner optimizers other than
    megatron-core's Adams, which may replace their state tensors in ``step()``).
    """

    def __init__(self, wrapper, *, identities: bool | None = None) -> None:
        self._owner = wrapper
        if identities is None:
            identities = kind_of(wrapper.optimizer) == OTHER
        self.identities = identities
        self._params: list = []  # every parameter of the inner optimizer, at the last look
        self._tensor_ids: list[tuple[int, ...]] = []  # ids of each one's state tensors
        self._kept = Repointing()  # every plain state tensor seen, where it was (identities)
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
        owner = self._owner
        inner = owner.optimizer
        state = inner.state
        groups = inner.param_groups
        masters = master_groups(owner)
        # The containers, compared by identity, and their lengths: O(groups).
        objects = [inner, state, groups, masters]
        lengths = [len(state), len(groups), len(masters)]
        for group in groups:
            params = group["params"]
            objects += (group, params)
            lengths.append(len(params))
        for master_group in masters:
            objects.append(master_group)
            lengths.append(len(master_group))
        changed = lengths != self._lengths or not all(map(_is, objects, self._objects))
        if not changed and self._watched:
            # A watched parameter's state dict has other entries than at the last look.
            entries = self._state
            get = (
                (lambda param: dict.get(entries, param))
                if isinstance(entries, dict)
                else entries.get
            )
            changed = any(len(get(param) or ()) != seen for param, seen in self._watched)
        if not changed and self.identities:
            changed = self._tensor_identities() != self._tensor_ids
        if changed:
            self._look(objects, lengths)
        return self.serial

    def _tensor_identities(self) -> list[tuple[int, ...]]:
        """The ids of each parameter's state tensors (``identities`` mode), O(state tensors)."""
        get = _getter(self._state)
        return [
            tuple(
                id(value)
                for value in (get(param) or {}).values()
                if isinstance(value, torch.Tensor)
            )
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
            self._kept = Repointing()
            for entries in filter(None, map(get, params)):
                for key, value in entries.items():
                    if type(value) is torch.Tensor:
                        self._kept.record(Holder(entries, key))
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
        if not len(self._kept):
            self()  # a first look records the places (the states appear at the first step)
        changed = 0
        items = list(self._kept.items())
        seen = {id(old) for _, old, _, _ in items}
        for holder, old, _, new in items:
            if type(new) is not torch.Tensor:
                continue
            if (
                new is not old
                and same_kind(new, old)
                and old.is_contiguous()
                and old.untyped_storage().nbytes()
                and new.untyped_storage().nbytes()
                and id(new) not in seen
            ):
                with torch.no_grad():
                    old.copy_(new)
                holder.set(old)
                changed += 1
            elif not new.is_contiguous() and new.untyped_storage().nbytes():
                holder.set(new.contiguous())
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
        collections.deque(
            map(setattr, self._masters, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0
        )
        return True

    def forget(self) -> None:
        """Drop every reference to the optimizer's containers (the engine was closed)."""
        self._objects, self._lengths, self._watched = [], [], []
        self._params, self._tensor_ids = [], []
        self._kept.forget()
        self._state, self._masters, self._probes = None, [], []


def _getter(state):
    """``state.get`` by dict's own lookup (a guarded mapping's accessors reload; see
    ``_entries``)."""
    if isinstance(state, dict):
        return lambda param: dict.get(state, param)
    return state.get
