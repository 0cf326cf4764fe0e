"""Which methods of megatron-core's optimizers reach the offloaded tensors, and megatron-core's
load fixes.

The tables below are the contract between the state access (``state.py``) and megatron-core:
every public method of its optimizers that reads or writes the optimizer states or the master
weights is a state method (served by the state access), a safe method (with the reason), or a
routed one. ``tests/unit/access/test_state_contract.py`` finds, in the megatron-core it runs,
every public method that reaches the state mapping, the parameter groups or the master lists,
and fails on any method in none of them.

After a load, megatron-core (up to 0.19.2) gives every parameter of a ``torch.optim``
optimizer the same ``step`` tensor, which Adam then increments once per parameter per step,
and a DistributedOptimizer checkpoint load leaves that step at a stale value; each parameter
gets its own tensor with the saved step back (``restore_step_tensors``).
"""

from __future__ import annotations

import inspect

import torch

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
    "between steps that finds the states off the device brings them back first",
    "param_groups": "hands out the parameter groups without reading them; the masters found "
    "there between steps are a documented limit (docs/usage.md: read them inside host_view())",
    "load_state_dict_from_file": "(Megatron-LM dev: the layer-wise optimizer's torch-format "
    "load) torch.load, then self.load_state_dict: the instance's served method",
}
# megatron-core's RL moves, routed to the offloader instead (``offloader.py``).
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


def is_loading(method, args, kwargs) -> bool:
    """``sharded_state_dict``'s ``is_loading`` argument (positional or keyword)."""
    if "is_loading" in kwargs:
        return bool(kwargs["is_loading"])
    try:
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
