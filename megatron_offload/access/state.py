"""``StateAccess``: every way the optimizer's states are reached between steps, in one object.

While states are offloaded, their device tensors have no memory; code outside the step that
reaches them must find them somewhere. What reaches them, and what it finds:

* **megatron-core's state methods** (state dicts, checkpoint save and load, parameter-state
  exchange, reloading the masters from the model: ``methods.STATE_METHODS``), wrapped on each
  served optimizer, and the inner torch optimizer's own ``state_dict`` / ``load_state_dict``
  (torch hooks): served from the host copy where the optimizer's policy says so, else the
  states come back first;
* **the inner optimizer's methods that touch state outside the step** (Transformer Engine's
  ``get_unscaled_state`` / ``set_scaled_state`` / ``initialize_state``) and **Megatron-FSDP's
  module state dict** (its parameters are views into the master buffers): the states come
  back first;
* **the inner optimizer's ``state`` mapping** (research code reading
  ``optimizer.optimizer.state[p]["exp_avg"]`` between steps): a ``GuardedState`` in its place,
  whose accessors bring that optimizer's states back when they find them off the device
  between steps (docs/design.md says why reads are not served from the host copy);
* **``host_view()``**: a block in which the released tensors are their host copies.

The policy of each served optimizer (``policies``) is decided once, here, at attach: its
checkpoints are served from the host copy (``Policy.HOST_COPY``: 0 device bytes at a save),
served so inside a host view only (``Policy.HOST_VIEW``: Megatron-FSDP, whose DTensors the
checkpoint is built from after the method returned), or its states come back to the device
until the next offload (``Policy.DEVICE``: Transformer Engine's fp16 and FP8 moments, which
need the device to be read). The listing of interceptions names it.

Brought back (``bring_back``) means: regrown and copied back, ordered before the current
stream, and kept on the device until the next offload (the next step's, under ``attach``);
the host copy is marked stale when the caller may write.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import inspect
from typing import Iterator, Sequence

import torch

from ..adapters import (
    MASTER_WEIGHTS,
    OPTIMIZER_STATES,
    inner_optimizers,
    megatron_fsdp,
    state_access,
)
from ..adapters.megatron_wrappers import state_kinds
from ..adapters.model_buffers import chunks_of
from ..engine import HostBuffers
from ..engine.pieces import aligned_size
from ..interceptions import Interceptions
from ..phase import Phase, PhaseTracker
from .host_view import HostView, HostViewFigures
from .methods import (
    LOAD_METHODS,
    READ_ONLY_METHODS,
    STATE_METHODS,
    is_loading,
    restore_step_tensors,
    unshare_step_tensors,
)

# TE FusedAdam state dtypes whose values need the device to be read (scales on the device,
# FP8 dequantization kernels).
_DEVICE_ONLY_DTYPES = (torch.float16, torch.uint8)


class Policy(enum.Enum):
    """How a served optimizer's checkpoints reach its offloaded states."""

    HOST_COPY = "served from the host copy"
    HOST_VIEW = (
        "served from the host copy inside a host view (megatron.training's synchronous save "
        "opens one), else the states come back to the device until the next offload"
    )
    DEVICE = "the states come back to the device until the next offload"


def policy_of(wrapper) -> Policy:
    """``HOST_VIEW`` for Megatron-FSDP: its module hands the optimizer's own DTensors out in
    the model's state dict and megatron-core builds the checkpoint from them after the
    optimizer's method returned, so they are served for as long as a host view is open
    (``dtensor_view.py``) and come back for a call outside one. ``DEVICE`` for Transformer
    Engine's fp16 and FP8 moments, which need the device to be read; ``HOST_COPY`` otherwise."""
    if megatron_fsdp.is_megatron_fsdp(wrapper):
        return Policy.HOST_VIEW
    inner = wrapper.optimizer
    if inner_optimizers.kind_of(inner) == inner_optimizers.TE_FUSED_ADAM:
        dtypes = getattr(inner, "name_to_dtype_map", {}) or {}
        if any(
            dtypes.get(k) in _DEVICE_ONLY_DTYPES for k in ("exp_avg", "exp_avg_sq", "master_param")
        ):
            return Policy.DEVICE
    return Policy.HOST_COPY


class StateAccess:
    """Installs every way in to the served optimizers' states (``remove`` takes them away) and
    serves each one.

    Args:
        optimizer: what the offloader was made for (a ChainedOptimizer or one wrapper).
        members: the served optimizers, each with its engine.
        phase: the offloader's phase (read, and entered while states move or are served).
        interceptions: the offloader's interceptions, which install every wrap and hook.
    """

    def __init__(
        self, optimizer, members: Sequence, phase: PhaseTracker, interceptions: Interceptions
    ) -> None:
        self._members = tuple(members)
        self._phase = phase
        self._installed = interceptions
        #: Each served optimizer's policy, in the order of ``members`` (decided here, once).
        self.policies = tuple(policy_of(member.optimizer) for member in self._members)
        #: What host views served since attach (``stats()``).
        self.figures = HostViewFigures()
        self._view: HostView | None = None  # the open host view (the outermost), if any
        self._handles = []
        self._mappings: dict[int, tuple] = {}  # id(inner) -> (replaced mapping, interception)
        try:
            self._install(optimizer)
        except BaseException:
            self.remove()  # all or nothing: what was installed so far is given back
            raise

    # ------------------------------------------------------------------- serving
    def bring_back(
        self, members: Sequence | None = None, *, changes: bool, replaced: bool = False
    ) -> None:
        """Every offloaded state of ``members`` (all by default) back on the device, ordered
        before the current stream; it stays there until the next offload. ``changes``: the
        caller may write them (the next offload copies them out again). ``replaced``: the
        caller may put new tensor objects into the state (a load)."""
        with self._phase.within(Phase.MOVING):
            for member in self._members if members is None else members:
                engine = member.engine
                if engine.is_released():
                    engine.reload()
                engine.wait()
                if changes:
                    engine.mark_dirty()
                if replaced:
                    engine.invalidate()

    @contextlib.contextmanager
    def host_view(self, members: Sequence | None = None, *, writes: bool) -> Iterator[HostView]:
        """The block sees the released tensors of ``members`` (all by default) as their host
        copies, in the ``SERVING`` phase (see ``host_view.py``). Re-entrant: a block nested in
        an open view is served by it (a save calls ``state_dict`` inside
        ``sharded_state_dict``)."""
        view = self._view
        if view is not None:
            if writes:
                view.note_writes()
            yield view
            return
        view = HostView(self._members if members is None else members, writes, self.figures)
        # Served, not guarded, in the block.
        token = self._phase.enter(Phase.SERVING)
        try:
            view.open()  # all or nothing
            self._view = view
            try:
                yield view
            finally:
                self._view = None
                view.close()
        finally:
            self._phase.leave(token)

    def loads_in_view(self) -> bool:
        """True if a checkpoint load can write the host copy inside a host view: every
        Megatron-FSDP optimizer can have the states the load writes into made without an
        update (``_load_without_update``)."""
        return all(
            megatron_fsdp.can_make_load_states(member.optimizer)
            for member, policy in zip(self._members, self.policies)
            if policy is Policy.HOST_VIEW
        )

    def accessed(self, mapping: "GuardedState", writes: bool) -> None:
        """A ``GuardedState`` was accessed between steps: if its optimizer's states are off the
        device they come back first (the mapping hands out the live tensors, which the caller
        may write through; a write may put new tensors in)."""
        member = self._members[mapping.member]
        if member.engine.is_released():
            self.bring_back((member,), changes=True, replaced=writes)

    def guard_replaced(self) -> None:
        """Guard again a state mapping that was replaced since it was guarded (megatron-core's
        ``optimizer.state = ...`` setter): what each offload calls, as the states leave."""
        for member in self._members:
            inner = member.optimizer.optimizer
            if type(getattr(inner, "state", None)) is collections.defaultdict:
                self._guard(member)

    # --------------------------------------------------------------- installing
    def _install(self, optimizer) -> None:
        wrappers = [member.optimizer for member in self._members]
        targets = [optimizer] + [w for w in wrappers if w is not optimizer]
        for target in targets:
            policy = " / ".join(
                dict.fromkeys(
                    p.value
                    for m, p in zip(self._members, self.policies)
                    if target is optimizer or m.optimizer is target
                )
            )
            for name in STATE_METHODS:
                if callable(getattr(type(target), name, None)):
                    self._handles.append(
                        self._installed.wrap(
                            target,
                            name,
                            functools.partial(self._state_method, target, name),
                            why=f"a checkpoint method: {policy or Policy.HOST_COPY.value}",
                        )
                    )
        for member in self._members:
            self._guard(member)
            self._install_inner(member)
            if megatron_fsdp.is_megatron_fsdp(member.optimizer):
                self._install_megatron_fsdp_model(member)

    def _install_inner(self, member) -> None:
        inner = member.optimizer.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            where = type(inner).__name__
            self._handles += [
                self._installed.hook(
                    inner.register_state_dict_pre_hook(
                        functools.partial(self._inner_state_dict, member)
                    ),
                    where=f"{where}.state_dict (pre-hook)",
                    why="torch's state_dict() hands out the live tensors: they are the host "
                    "copies inside a host view, else the states come back",
                ),
                self._installed.hook(
                    inner.register_load_state_dict_pre_hook(
                        functools.partial(self._inner_load, member)
                    ),
                    where=f"{where}.load_state_dict (pre-hook)",
                    why="a load writes the host copy inside a host view, else the states come back",
                ),
                # torch's load_state_dict() puts a new defaultdict in place of the state.
                self._installed.hook(
                    inner.register_load_state_dict_post_hook(
                        functools.partial(self._inner_loaded, member)
                    ),
                    where=f"{where}.load_state_dict (post-hook)",
                    why="the new state mapping a load put in is guarded again",
                ),
            ]
        # Methods of the inner optimizer itself that touch state outside step() (TE's
        # get_unscaled_state / set_scaled_state / initialize_state): the torch hooks above
        # cover only state_dict and load_state_dict.
        access = state_access(inner)
        for name in access.reads + access.writes + access.replaces:
            if name in ("state_dict", "load_state_dict") or not callable(
                getattr(inner, name, None)
            ):
                continue
            self._handles.append(
                self._installed.wrap(
                    inner,
                    name,
                    functools.partial(self._inner_method, member, name in access.replaces),
                    why="touches the states outside step(): they come back first",
                )
            )

    def _install_megatron_fsdp_model(self, member) -> None:
        """Megatron-FSDP's module swaps its parameters for the optimizer's DTensors (views into
        the master buffers) before a state dict is read or loaded, so a save reads the masters
        and a load writes them: they come back first (a load's values are copied out at the
        next offload)."""
        for chunk in chunks_of([member.optimizer]):
            module = getattr(chunk, "module", chunk)
            for method, register, writes in (
                ("state_dict", module.register_state_dict_pre_hook, False),
                ("load_state_dict", module.register_load_state_dict_pre_hook, True),
            ):
                self._handles.append(
                    self._installed.hook(
                        register(functools.partial(self._model_state_dict, member, writes)),
                        where=f"{type(module).__name__}.{method} (pre-hook)",
                        why="its state dict holds the master weights: they come back",
                    )
                )

    # ------------------------------------------------------------ what each runs
    def _state_method(self, target, name: str, previous):
        """``target.name`` (``previous``) served: the members of ``target`` whose policy is
        ``HOST_COPY`` see their host copies, the others' states come back first."""

        def call(*args, **kwargs):
            loads = name in LOAD_METHODS
            if name.startswith("sharded_"):  # sharded_state_dict, sharded_param_state_*
                writes = is_loading(previous, args, kwargs)
            else:  # loads and reload_model_params write; state dicts and getters read
                writes = loads or name == "reload_model_params"
            if self._view is not None:
                served, brought = self._members, ()  # inside a view: served by it
            else:
                served = [m for m, p in zip(self._members, self.policies) if p is Policy.HOST_COPY]
                brought = [m for m in self._members if all(m is not s for s in served)]
            if brought:
                # Loads may put new tensor objects into the state.
                changes = name not in READ_ONLY_METHODS
                self.bring_back(brought, changes=changes, replaced=changes)
            outer = self._view is None
            with (
                self.host_view(served, writes=writes)
                if served
                else contextlib.nullcontext() as view
            ):
                if name == "sharded_param_state_fsdp_dtensor" and writes and view is not None:
                    args, kwargs = self._load_without_update(target, previous, args, kwargs)
                result = previous(*args, **kwargs)
                if loads:
                    self._after_load(target, name, args)
                elif view is not None and outer and name != "sharded_state_dict":
                    # What the caller keeps references no host view (see HostView.detached). A
                    # sharded state dict keeps them: dist_checkpointing copies every view
                    # while it plans the write, inside the save call.
                    result = view.detached(result)
            return result

        return call

    def _load_without_update(self, target, previous, args, kwargs):
        """``sharded_param_state_fsdp_dtensor(is_loading=True)`` of Megatron-FSDP's
        ``target`` in a host view: megatron-core would first step the inner optimizer on zero
        gradients to make the states the load writes into, an update on the device that reads
        and writes every state and master (the view refuses it). Here the parameters without
        states get them from megatron-core's own initializer, one parameter at a time, each
        copied to the host at once (``_make_load_states``), and the method then runs as for a
        save: it hands out the DTensors the load writes, which the view points at the host
        copy. Returns the arguments to call it with. An optimizer megatron-core built without
        an initializer keeps its dummy step (refused in the view: its loads run resident)."""
        members = [m for m in self._members if m.optimizer is target]
        if (
            not members
            or not all(self._view.serves(m) for m in members)  # its states came back instead
            or not megatron_fsdp.can_make_load_states(target)
        ):
            return args, kwargs
        for member in members:
            if megatron_fsdp.params_without_states(member.optimizer):
                with self._view.unserved(member):
                    self._make_load_states(member)
        bound = inspect.signature(previous).bind(*args, **kwargs)
        bound.arguments["is_loading"] = False
        return bound.args, bound.kwargs

    def _make_load_states(self, member) -> None:
        """States for every parameter of ``member`` that has none (``make_load_states``), made
        on the device one parameter at a time and staged to the host right after (one host
        buffer for all), then laid out as released pieces: the device never holds more than
        one parameter's states. All or nothing: a failure leaves no state made and no host
        memory held."""
        wrapper, engine, kinds = member.optimizer, member.engine, member.kinds
        inner = wrapper.optimizer
        params = megatron_fsdp.params_without_states(wrapper)
        remaining = sum(
            inner_optimizers.planned_state_bytes(
                inner, p, moments=OPTIMIZER_STATES in kinds, masters=MASTER_WEIGHTS in kinds
            )[0]
            for p in params
        )
        staging = HostBuffers(
            engine.device, budget=engine.budget, name=f"{engine.name}: states for a load"
        )
        made = []
        try:
            for param in params:
                made.append(param)
                megatron_fsdp.make_load_states(wrapper, param)
                moving = [
                    tensor
                    for kind, tensor in state_kinds(param, dict.get(inner.state, param) or {})
                    if kind in kinds and engine.stageable(tensor)
                ]
                if moving:
                    engine.adopted.stage_out(moving, staging, hint=remaining)
                    remaining -= sum(aligned_size(t.numel() * t.element_size()) for t in moving)
            engine.invalidate()
            engine.rescan()  # released pieces now: the view serves them, the next step loads them
        except BaseException:
            created = []
            for param in made:
                entries = dict.pop(inner.state, param, None) or {}
                created += [tensor for _, tensor in inner_optimizers.state_tensors(param, entries)]
            engine.adopted.disown(created)
            staging.free()
            engine.invalidate()
            raise

    def _after_load(self, target, name: str, args) -> None:
        for member in self._members:
            self._guard(member)  # a load may have put a new state mapping in
            wrapper = member.optimizer
            if wrapper is target and name == "load_state_dict" and args:
                restore_step_tensors(wrapper.optimizer, args[0])
            else:
                unshare_step_tensors(wrapper.optimizer)

    def _inner_method(self, member, replaces: bool, previous):
        def call(*args, **kwargs):
            # TE's own step() calls these while everything is resident: nothing to do then
            # beyond noting that the states change. Inside a chunked update, step() calls them
            # for the parameters of the current chunk, whose states are in a slot: nothing
            # must move then. Inside a host view they read and write the host copies.
            if self._phase.current not in (Phase.STREAMING, Phase.SERVING):
                self.bring_back((member,), changes=True, replaced=replaces)
            return previous(*args, **kwargs)

        return call

    def _inner_state_dict(self, member, optimizer) -> None:
        if self._view is None:  # inside a host view the tensors it hands out are host copies
            self.bring_back((member,), changes=True, replaced=True)

    def _inner_load(self, member, optimizer, state_dict):
        if self._view is not None:  # the load writes the host copies
            return self._view.before_load(optimizer, state_dict)
        self.bring_back((member,), changes=True, replaced=True)
        return None

    def _inner_loaded(self, member, optimizer) -> None:
        self._guard(member)
        if self._view is not None:
            self._view.after_load(optimizer)

    def _model_state_dict(self, member, writes: bool, *args, **kwargs) -> None:
        # A load writes the masters wherever they are: the host copy is stale either way.
        if self._phase.current is Phase.IDLE and (writes or member.engine.is_released()):
            self.bring_back((member,), changes=writes)

    # -------------------------------------------------------- the state mapping
    def _guard(self, member) -> None:
        """A ``GuardedState`` with the same entries in place of the member's inner ``state``.
        Only torch's own ``defaultdict`` is replaced (what every torch optimizer, and so TE's
        and apex's FusedAdam, keeps); any other mapping is left as it is, unguarded."""
        inner = member.optimizer.optimizer
        state = getattr(inner, "state", None)
        if isinstance(state, GuardedState) and state.access is self:
            return
        if type(state) is not collections.defaultdict:
            return
        mapping = GuardedState(state.default_factory)
        dict.update(mapping, state)
        mapping.member = next(i for i, m in enumerate(self._members) if m is member)
        mapping.access, mapping.phase = self, self._phase
        inner.state = mapping
        if id(inner) in self._mappings:
            replaced, handle = self._mappings[id(inner)]
            self._mappings[id(inner)] = (state, handle)
            return
        handle = self._installed.record(
            "attribute",
            f"{type(inner).__name__}.state",
            "the state mapping, guarded: a read between steps brings the states back first",
            functools.partial(self._unguard, inner),
        )
        self._mappings[id(inner)] = (state, handle)

    def _unguard(self, inner) -> None:
        """Give ``inner`` a plain ``defaultdict`` again (the one replaced, refilled with the
        current entries)."""
        original, _ = self._mappings.pop(id(inner), (None, None))
        state = getattr(inner, "state", None)
        if not (isinstance(state, GuardedState) and state.access is self):
            return
        if original is None:
            original = collections.defaultdict(state.default_factory)
        original.clear()
        original.update(dict.items(state))
        state.access = state.phase = None  # a reference kept elsewhere is unguarded now
        inner.state = original

    def remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        for _, handle in list(self._mappings.values()):
            handle.remove()
        self._handles = []


class _PlainState(collections.defaultdict):
    """What a ``GuardedState`` is to its readers: a ``defaultdict`` that copies, pickles and
    prints as one (the accessors below wrap these)."""

    def __reduce__(self):
        return (
            collections.defaultdict,
            (self.default_factory,),
            None,
            None,
            iter(dict.items(self)),
        )

    def copy(self):
        return collections.defaultdict(self.default_factory, dict.items(self))

    __copy__ = copy

    def __or__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        merged = collections.defaultdict(self.default_factory, other)
        merged.update(dict.items(self))
        return merged

    def __repr__(self) -> str:
        return repr(self.copy())  # printed as the defaultdict it stands for


class GuardedState(_PlainState):
    """An inner optimizer's ``state`` while an offloader is attached: each accessor that hands
    out entries, keys or values (or compares, prints, copies or pickles them) first asks the
    ``StateAccess`` between steps (``IDLE``); in every other phase (the step above all) it
    checks one attribute chain and runs the plain method. Not guarded, because they touch no
    tensor: ``len(state)`` and ``p in state`` (a lookup compares keys by identity first).

    ``access``: the ``StateAccess`` that installed it and ``phase`` its phase (None once given
    back); ``member``: the index of its optimizer there."""

    access = None
    phase = None
    member = 0


# Every accessor of a guarded mapping, and whether it may put new tensors into the state.
ACCESSORS = {
    **dict.fromkeys(
        (
            "__getitem__", "get", "keys", "values", "items", "__iter__", "__reversed__",
            "__eq__", "__ne__", "__or__", "__ror__", "__repr__", "copy", "__copy__",
            "__reduce__",
        ),
        False,
    ),
    **dict.fromkeys(
        ("__setitem__", "__delitem__", "setdefault", "pop", "popitem", "clear", "update", "__ior__"),
        True,
    ),
}  # fmt: skip


def _guarded_accessor(name: str, writes: bool):
    plain = getattr(_PlainState, name)

    def accessor(self, *args, **kwargs):
        phase = self.phase
        if phase is not None and phase.current is Phase.IDLE:
            self.access.accessed(self, writes)
        return plain(self, *args, **kwargs)

    accessor.__name__ = name
    accessor.__qualname__ = f"GuardedState.{name}"
    return accessor


for _name, _writes in ACCESSORS.items():
    setattr(GuardedState, _name, _guarded_accessor(_name, _writes))
del _name, _writes
