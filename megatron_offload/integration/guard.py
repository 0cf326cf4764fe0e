"""Makes megatron-core's state-touching optimizer methods safe while states are offloaded.

Every public method of megatron-core's optimizers that reads or writes the moments or the
master weights (state dicts, checkpoint save and load, parameter-state exchange, reloading
master weights from the model) first brings the states back to the device. They then stay
resident until the next automatic offload (after the next step) or an explicit
``offload()``: checkpoint code keeps references to the tensors (sharded state dicts,
asynchronous saves), so they must not be released again behind its back. The states are
marked changed, so the next offload copies them out again and the host copy can never be
stale after a load.

megatron-core's own RL helpers ``offload_to_cpu()`` / ``restore_from_cpu()`` are routed
to the offloader (asynchronous, coalesced, and consistent with it) instead of moving the
tensors themselves behind its back.

The inner torch optimizer is covered with its own ``state_dict`` / ``load_state_dict``
pre-hooks. After a load, megatron-core (up to 0.19.2) gives every parameter of a
``torch.optim`` optimizer the same ``step`` tensor, which Adam then increments once per
parameter per step, and a DistributedOptimizer checkpoint load leaves that step at a stale
value; each parameter gets its own tensor with the saved step back here.
"""

from __future__ import annotations

import functools

import torch

from ..adapters import state_access

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
)
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
    """Wraps the state-touching methods of the offloader's optimizers; ``remove`` undoes it."""

    def __init__(self, offloader) -> None:
        self._offloader = offloader
        self._wrapped: list[tuple[object, str, bool, object]] = []
        self._hooks = []
        targets = [offloader.optimizer] + [
            o for o in offloader._distributed if o is not offloader.optimizer
        ]
        for target in targets:
            for name in STATE_METHODS:
                if callable(getattr(type(target), name, None)):
                    self._wrap(target, name, self._resident_call(target, name))
            if all(callable(getattr(type(target), n, None)) for n in ("offload_to_cpu", "restore_from_cpu")):
                self._wrap(target, "offload_to_cpu", _rl_offload(offloader))
                self._wrap(target, "restore_from_cpu", _rl_restore(offloader))
        for distrib_optimizer in offloader._distributed:
            inner = distrib_optimizer.optimizer
            if isinstance(inner, torch.optim.Optimizer):
                bring_back = functools.partial(_inner_pre_hook, offloader)
                self._hooks.append(inner.register_state_dict_pre_hook(bring_back))
                self._hooks.append(inner.register_load_state_dict_pre_hook(bring_back))
            # Methods of the inner optimizer itself that touch state outside step() (TE's
            # get_unscaled_state / set_scaled_state / initialize_state): the torch hooks
            # above cover only state_dict and load_state_dict.
            access = state_access(inner)
            for name in access.reads + access.writes + access.replaces:
                if name in ("state_dict", "load_state_dict") or not callable(getattr(inner, name, None)):
                    continue
                self._wrap(inner, name, self._inner_state_call(name in access.replaces))

    def _inner_state_call(self, replaces: bool):
        offloader = self._offloader

        def make(previous):
            def call(*args, **kwargs):
                # TE's own step() calls these while everything is resident: nothing to do
                # then beyond noting that the states change. Otherwise bring them back;
                # they hand out (or write) the live tensors, so the host copy goes stale.
                # Inside a chunked update, step() calls them for the parameters of the
                # current chunk, whose states are in a slot: nothing must move then.
                if not offloader._streaming:
                    offloader._make_resident(changes=True, replaced=replaces)
                return previous(*args, **kwargs)

            return call

        return make

    def _wrap(self, target, name: str, make) -> None:
        had_instance_attr = name in vars(target)
        previous = getattr(target, name)
        target.__dict__[name] = functools.update_wrapper(make(previous), previous)
        self._wrapped.append((target, name, had_instance_attr, previous))

    def _resident_call(self, target, name: str):
        offloader = self._offloader

        def make(previous):
            def call(*args, **kwargs):
                changes = name not in READ_ONLY_METHODS
                # Loads may put new tensor objects into the state.
                offloader._make_resident(changes=changes, replaced=changes)
                result = previous(*args, **kwargs)
                if name in LOAD_METHODS:
                    for distrib_optimizer in offloader._distributed:
                        if distrib_optimizer is target and name == "load_state_dict" and args:
                            restore_step_tensors(distrib_optimizer.optimizer, args[0])
                        else:
                            unshare_step_tensors(distrib_optimizer.optimizer)
                return result

            return call

        return make

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for target, name, had_instance_attr, previous in reversed(self._wrapped):
            if had_instance_attr:
                target.__dict__[name] = previous
            else:
                target.__dict__.pop(name, None)
        self._hooks = []
        self._wrapped = []


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
    # write through, and load_state_dict() writes: either way the host copy is stale.
    offloader._make_resident(changes=True, replaced=True)


def restore_step_tensors(optimizer, state_dict) -> None:
    """Per-parameter ``step`` tensors after a DistributedOptimizer load (torch optimizers).

    megatron-core (0.16-0.19) keeps the step of a torch optimizer only in the saved
    ``param_groups``; on load it puts one shared tensor with that value into every
    parameter's state, and then the DP-reshardable parameter-state load copies in whatever
    ``step`` the optimizer had before the load (for example 1 after the dummy step that
    initializes states for loading). Each parameter gets its own tensor with the saved value.
    """
    groups = state_dict.get("optimizer", {}).get("param_groups", []) if isinstance(state_dict, dict) else []
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
