"""Makes megatron-core's state-touching optimizer methods safe while states are offloaded.

Every public method of megatron-core's optimizers that reads or writes the optimizer states or the
master weights (state dicts, checkpoint save and load, parameter-state exchange, reloading
master weights from the model) runs inside a ``HostView`` (``host_view.py``): the released
tensors are seen as their host copies for the call, so a save reads the host copy and a load
writes it, and nothing comes back to the device. Where the states cannot be read on the host
(``host_view.servable``: Transformer Engine's fp16 and FP8 moments) the method first brings
them back to the device instead; they then stay resident until the next automatic offload
(after the next step) or an explicit ``offload()``, and are marked changed.

megatron-core's own RL helpers ``offload_to_cpu()`` / ``restore_from_cpu()`` are routed
to the offloader (asynchronous, coalesced, and consistent with it) instead of moving the
tensors themselves behind its back.

The inner torch optimizer is covered with its own ``state_dict`` / ``load_state_dict``
pre-hooks. After a load, megatron-core (up to 0.19.2) gives every parameter of a
``torch.optim`` optimizer the same ``step`` tensor, which Adam then increments once per
parameter per step, and a DistributedOptimizer checkpoint load leaves that step at a stale
value; each parameter gets its own tensor with the saved step back here.

The inner optimizer's ``state`` mapping itself is guarded too, for code that reads the
states the way research code does (``optimizer.optimizer.state[p]["exp_avg"].sum()``
between steps): the guard puts a ``GuardedState`` (``phase.py``) in its place, armed
by the offloader's phase. Such a read is served from the host copy until the next transition
(``host_view.serve_reads``).
"""

from __future__ import annotations

import collections
import functools

import torch

from ..adapters import state_access
from ..phase import ACCESSORS, GuardedState, Phase
from . import megatron_fsdp_models
from .host_view import HostView, servable, serve_reads

# Public methods (on DistributedOptimizer, ChainedOptimizer and their bases, megatron-core
# 0.16-0.19) that read or write the offloaded tensors. Names absent on a version are skipped.
STATE_METHODS = (
    "state_dict",
    "load_state_dict",
    "sharded_state_dict",
    "save_parameter_state",
    "load_parameter_state",
    "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable",
    "get_parameter_state_fs_bucket_space",
    "load_parameter_state_from_dp_zero",
    "load_parameter_state_from_dp_zero_legacy",
    "load_parameter_state_from_dp_reshardable",
    "load_parameter_state_from_fs_bucket_space",
    "load_parameter_state_from_fs_model_space",
    "load_parameter_state_from_fully_reshardable",
    "sharded_param_state_dp_zero",
    "sharded_param_state_dp_reshardable",
    "sharded_param_state_fully_reshardable",
    "sharded_param_state_fs_bucket_space",
    "sharded_param_state_fs_model_space",
    "sharded_param_state_fsdp_dtensor",
    "reload_model_params",
    # MXFP8 parameter all-gather (reuse_grad_buf_for_mxfp8_param_ag with overlapped param
    # gather): copies the fp32 masters into the parameter buffer outside the step.
    "prepare_model_params_for_param_sync",
)
# Public methods of megatron-core's optimizers (0.16-0.19, Megatron-LM main and dev) that touch
# the optimizer states or the master weights but are not served by a host view, and why that
# is safe. With STATE_METHODS and the RL helpers they are the whole contract: the suite finds,
# in the megatron-core it runs (each line, the patched trees, a Megatron-LM checkout), every
# public method that reaches the state mapping, the parameter groups or the master lists, and
# fails on any method in none of them (tests/unit/access/test_state_contract.py).
SAFE_METHODS = {
    "__init__": "builds the optimizer: before any offloader exists",
    "step": "the step: the inner optimizer's step pre-hook brings every state back (and orders "
    "the copy) before the update reads any, and the masters stay until the offload after it",
    "step_with_ready_grads": "the update and the copy of the masters into the model: as step",
    "prepare_grads": "the step's gradient preparation: reads and writes the masters' .grad "
    "(never their data) before the update",
    "get_grad_norm": "reads the masters' .grad, never their data",
    "clip_grad_norm": "scales the masters' .grad, never their data",
    "count_zeros": "reads the masters' .grad, never their data",
    "get_grads_for_grad_norm": "returns the masters' .grad, never their data",
    "get_main_grads_for_grad_norm": "(up to 0.18) returns the masters' .grad, never their data",
    "has_grad_norm_group": "looks up parameter attributes, no tensor data",
    "get_parameters": "returns the parameter objects (megatron-core reads their .grad)",
    "zero_grad": "sets the masters' .grad to None",
    "state": "the inner optimizer's state mapping, guarded itself (GuardedState): a read "
    "between steps is served from the host copy",
    "param_groups": "hands out the parameter groups without reading them; the masters found "
    "there between steps are a documented limit (docs/usage.md: read them inside host_view())",
    "load_state_dict_from_file": "(Megatron-LM dev: the layer-wise optimizer's torch-format "
    "load) torch.load, then self.load_state_dict: the instance's served method",
}
# Methods routed to the offloader instead (StateAccessGuard wraps them).
ROUTED_METHODS = ("offload_to_cpu", "restore_from_cpu")
# Loads after which megatron-core may have shared one ``step`` tensor between parameters.
LOAD_METHODS = frozenset(name for name in STATE_METHODS if name.startswith("load"))
# Methods that only read the states and return copies (no references the caller could
# write through): the host copy stays valid, so the next offload need not copy again.
READ_ONLY_METHODS = frozenset(
    {
        "state_dict",
        "save_parameter_state",
        "get_parameter_state_dp_zero",
        "get_parameter_state_dp_reshardable",
        "get_parameter_state_fs_bucket_space",
    }
)


class StateAccessGuard:
    """Wraps the state-touching methods of the offloader's optimizers and guards their state
    mappings; ``remove`` undoes it."""

    def __init__(self, offloader) -> None:
        self._offloader = offloader
        self._installed = offloader.interceptions
        self._handles = []  # what this guard installed (``Interception``s)
        # The state mappings of the inner optimizers (see GuardedState): the objects they
        # replaced, given back refilled by remove(); one interception per inner says so.
        self._inners = [member.optimizer.optimizer for member in offloader.members]
        self._originals: dict[int, object] = {}
        self._mappings: dict[int, object] = {}  # id(inner) -> its mapping's interception
        try:
            self._install_all()
        except BaseException:
            self.remove()  # all or nothing: what was wrapped so far is given back
            raise

    def _install_all(self) -> None:
        offloader = self._offloader
        wrappers = [member.optimizer for member in offloader.members]
        targets = [offloader.optimizer] + [o for o in wrappers if o is not offloader.optimizer]
        served = "a checkpoint method: served from the host copy (or the states come back)"
        for target in targets:
            for name in STATE_METHODS:
                if callable(getattr(type(target), name, None)):
                    self._wrap(target, name, self._resident_call(target, name), served)
            if all(callable(getattr(type(target), n, None)) for n in ROUTED_METHODS):
                routed = "megatron-core's RL move, routed to the offloader"
                self._wrap(target, "offload_to_cpu", _rl_offload(offloader), routed)
                self._wrap(target, "restore_from_cpu", _rl_restore(offloader), routed)
        self.reinstall()
        self._handles += megatron_fsdp_models.install(offloader, wrappers, self._installed)
        for inner in self._inners:
            if isinstance(inner, torch.optim.Optimizer):
                where = type(inner).__name__
                self._hook(
                    inner.register_state_dict_pre_hook(
                        functools.partial(_inner_pre_hook, offloader)
                    ),
                    f"{where}.state_dict (pre-hook)",
                    "the states come back: torch's state_dict() hands out the live tensors",
                )
                self._hook(
                    inner.register_load_state_dict_pre_hook(
                        functools.partial(_inner_load_pre_hook, offloader)
                    ),
                    f"{where}.load_state_dict (pre-hook)",
                    "a load writes the host copy inside a host view, else the states come back",
                )
                # torch's load_state_dict() puts a new defaultdict in place of the state.
                self._hook(
                    inner.register_load_state_dict_post_hook(self._after_inner_load),
                    f"{where}.load_state_dict (post-hook)",
                    "the new state mapping a load put in is guarded again",
                )
            # Methods of the inner optimizer itself that touch state outside step() (TE's
            # get_unscaled_state / set_scaled_state / initialize_state): the torch hooks
            # above cover only state_dict and load_state_dict.
            access = state_access(inner)
            for name in access.reads + access.writes + access.replaces:
                if name in ("state_dict", "load_state_dict") or not callable(
                    getattr(inner, name, None)
                ):
                    continue
                self._wrap(
                    inner,
                    name,
                    self._inner_state_call(name in access.replaces),
                    "touches the states outside step(): they come back first",
                )

    def _inner_state_call(self, replaces: bool):
        offloader = self._offloader

        def make(previous):
            def call(*args, **kwargs):
                # TE's own step() calls these while everything is resident: nothing to do
                # then beyond noting that the states change. Otherwise bring them back;
                # they hand out (or write) the live tensors, so the host copy goes stale.
                # Inside a chunked update, step() calls them for the parameters of the
                # current chunk, whose states are in a slot: nothing must move then.
                # Inside a HostView (a checkpoint served from the host) they read and write
                # the host copies in its place.
                phase = offloader.phase.current
                if phase is not Phase.STREAMING and phase is not Phase.SERVING:
                    offloader.make_resident(changes=True, replaced=replaces)
                return previous(*args, **kwargs)

            return call

        return make

    def _wrap(self, target, name: str, make, why: str) -> None:
        self._handles.append(self._installed.wrap(target, name, make, why=why))

    def _hook(self, handle, where: str, why: str) -> None:
        self._handles.append(self._installed.hook(handle, where=where, why=why))

    def _resident_call(self, target, name: str):
        offloader = self._offloader

        def make(previous):
            def call(*args, **kwargs):
                loads = name in LOAD_METHODS
                if name.startswith("sharded_"):  # sharded_state_dict, sharded_param_state_*
                    writes = _is_loading(previous, args, kwargs)
                else:  # loads and reload_model_params write; state dicts and getters read
                    writes = loads or name == "reload_model_params"
                if offloader.phase.serving or servable(offloader):
                    # Served from the host copy: nothing comes back to the device.
                    with HostView(offloader, writes=writes) as view:
                        result = previous(*args, **kwargs)
                        if loads:
                            self._after_load(target, name, args)
                        elif view.outer and name != "sharded_state_dict":
                            # What the caller keeps references no host view (see detached).
                            # A sharded state dict keeps them: dist_checkpointing copies every
                            # view while it plans the write, inside the save call.
                            result = view.detached(result)
                    return result
                # Loads may put new tensor objects into the state.
                changes = name not in READ_ONLY_METHODS
                offloader.make_resident(changes=changes, replaced=changes)
                result = previous(*args, **kwargs)
                if loads:
                    self._after_load(target, name, args)
                return result

            return call

        return make

    def _after_load(self, target, name: str, args) -> None:
        self.reinstall()  # a load may have put a new state mapping in
        for member in self._offloader.members:
            wrapper = member.optimizer
            if wrapper is target and name == "load_state_dict" and args:
                restore_step_tensors(wrapper.optimizer, args[0])
            else:
                unshare_step_tensors(wrapper.optimizer)

    # ------------------------------------------------------- the state mapping
    def reinstall(self) -> None:
        """A ``GuardedState`` in place of every inner optimizer's plain ``state`` mapping
        (at attach, and after a load that put a new one in), handed to the phase tracker,
        which arms them."""
        for inner in self._inners:
            self._install(inner)
        guarded = [
            inner
            for inner in self._inners
            if isinstance(getattr(inner, "state", None), GuardedState) and inner.state.owner is self
        ]
        self._offloader.phase.guard(guarded, [inner.state for inner in guarded])

    def _after_inner_load(self, inner) -> None:
        self.reinstall()
        view = self._offloader.phase.view
        if view is not None and self._offloader.phase.serving:
            view.after_load(inner)

    def _install(self, inner) -> None:
        """Put a ``GuardedState`` with the same entries in place of ``inner.state``.

        Only torch's own ``defaultdict`` is replaced (what every torch optimizer, and so
        TE's and apex's FusedAdam, keeps); any other mapping is left as it is, unguarded.
        """
        state = getattr(inner, "state", None)
        if isinstance(state, GuardedState):
            state.owner = self
            return
        if type(state) is not collections.defaultdict:
            return
        mapping = GuardedState(state.default_factory)
        dict.update(mapping, state)
        mapping.owner = self
        inner.state = mapping
        self._originals[id(inner)] = state
        if id(inner) not in self._mappings:
            self._mappings[id(inner)] = self._installed.record(
                "attribute",
                f"{type(inner).__name__}.state",
                "the state mapping, guarded: a read between steps is served from the host copy",
                functools.partial(self._restore_state, inner),
            )

    def accessed(self, state: GuardedState, writes: bool, name: str = "") -> None:
        """An access to an armed mapping (accessor ``name``): serve it from the host copy,
        or bring every state back, before it proceeds."""
        offloader = self._offloader
        accessor = ACCESSORS.get(name)
        if accessor is not None and accessor.served and servable(offloader):
            # Values served from the host copy (host_view.py) until the next transition; an
            # accessor that hands out keys (the masters of a bf16/fp16 model) brings those
            # back.
            serve_reads(offloader, masters=accessor.keys)
            return
        # The mapping hands out the live tensors (the caller may write through them), so the
        # host copy is stale from now on; a write may put new tensors in.
        offloader.make_resident(changes=True, replaced=writes)

    def _restore_state(self, inner) -> None:
        """Give ``inner`` a plain ``defaultdict`` again (the one replaced at attach or after a
        load, refilled with the current entries)."""
        self._mappings.pop(id(inner), None)
        state = getattr(inner, "state", None)
        if not (isinstance(state, GuardedState) and state.owner is self):
            return
        original = self._originals.pop(id(inner), None)
        if original is None:
            original = collections.defaultdict(state.default_factory)
        original.clear()
        original.update(dict.items(state))
        state.owner = None  # a reference kept elsewhere is an unguarded mapping now
        inner.state = original

    def remove(self) -> None:
        self._offloader.phase.guard([], [])
        for handle in reversed(self._handles):
            handle.remove()
        for handle in list(self._mappings.values()):
            handle.remove()
        self._handles = []


def _rl_offload(offloader):
    def make(previous):
        def offload_to_cpu(*args, **kwargs):
            offloader.offload()

        return offload_to_cpu

    return make


def _rl_restore(offloader):
    def make(previous):
        def restore_from_cpu(*args, **kwargs):
            if offloader.is_offloaded:
                offloader.reload()
            offloader.wait()

        return restore_from_cpu

    return make


def _inner_pre_hook(offloader, optimizer, *args) -> None:
    # torch's state_dict() returns references to the live tensors, which the caller may
    # write through: the host copy is stale. Inside a HostView they are the host copies.
    if not offloader.phase.serving:
        offloader.make_resident(changes=True, replaced=True)


def _inner_load_pre_hook(offloader, optimizer, state_dict):
    # load_state_dict() writes; inside a HostView it writes the host copies.
    if offloader.phase.serving:
        return offloader.phase.view.before_load(optimizer, state_dict)
    offloader.make_resident(changes=True, replaced=True)
    return None


def _is_loading(method, args, kwargs) -> bool:
    """``sharded_state_dict``'s ``is_loading`` argument (positional or keyword)."""
    if "is_loading" in kwargs:
        return bool(kwargs["is_loading"])
    try:
        import inspect

        bound = inspect.signature(method).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return True  # unknown: treat as a write, which is always safe
    return bool(bound.get("is_loading", False))


def restore_step_tensors(optimizer, state_dict) -> None:
    """Per-parameter ``step`` tensors after a DistributedOptimizer load (torch optimizers).

    megatron-core (0.16-0.19) keeps the step of a torch optimizer only in the saved
    ``param_groups``; on load it puts one shared tensor with that value into every
    parameter's state, and then the DP-reshardable parameter-state load copies in whatever
    ``step`` the optimizer had before the load (for example 1 after the dummy step that
    initializes states for loading). Each parameter gets its own tensor with the saved value.
    """
    groups = (
        state_dict.get("optimizer", {}).get("param_groups", [])
        if isinstance(state_dict, dict)
        else []
    )
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        unshare_step_tensors(optimizer)
        return
    (value,) = steps
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            state["step"] = torch.full_like(step, value)


def unshare_step_tensors(optimizer) -> None:
    """Give each parameter its own ``step`` tensor where several share one object."""
    seen: set[int] = set()
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, torch.Tensor):
            continue
        if id(step) in seen:
            state["step"] = step.clone()
        else:
            seen.add(id(step))
