"""Finds the tensors to offload in a megatron-core optimizer that wraps a torch optimizer.

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
* ``primary_weights``: the fp32 master weights, wherever the wrapper keeps them:
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
described and handled in ``inner_optimizers.py`` and ``state_watch.py``.
"""

from __future__ import annotations

from typing import Iterator

import torch

from . import inner_optimizers

OPTIMIZER_STATES = "optimizer_states"
PRIMARY_WEIGHTS = "primary_weights"
KINDS = (OPTIMIZER_STATES, PRIMARY_WEIGHTS)


def inner_params(distrib_optimizer) -> Iterator[torch.Tensor]:
    """The parameters the inner optimizer updates, in its param-group order."""
    for group in distrib_optimizer.optimizer.param_groups:
        yield from group["params"]


def collect(distrib_optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """``(kind, tensor)`` for every tensor of ``distrib_optimizer`` that can be offloaded.

    The order is stable from call to call (param groups, then parameters, then state keys
    sorted), so the engine sees an unchanged set as unchanged.
    """
    for master in master_weights(distrib_optimizer):
        yield PRIMARY_WEIGHTS, master
    state = distrib_optimizer.optimizer.state
    for param in inner_params(distrib_optimizer):
        entries = _entries(state, param)
        if not entries:
            continue  # apex FusedAdam: no state until the parameter had a gradient
        for key, tensor in inner_optimizers.state_tensors(param, entries):
            yield (PRIMARY_WEIGHTS if inner_optimizers.is_master_key(key) else OPTIMIZER_STATES), tensor


def in_state(distrib_optimizer) -> Iterator[torch.Tensor]:
    """Every tensor ``collect`` finds inside the inner optimizer's state (not the masters
    megatron-core keeps beside it): what the chunked update can stream."""
    state = distrib_optimizer.optimizer.state
    for param in inner_params(distrib_optimizer):
        entries = _entries(state, param)
        if entries:
            for _, tensor in inner_optimizers.state_tensors(param, entries):
                yield tensor


def _entries(state, param):
    """``state.get(param)`` by dict's own lookup: while states are offloaded the mapping is
    the offloader's guarded one (``integration/guard.py``), whose accessors bring them back,
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


def master_weights(distrib_optimizer) -> Iterator[torch.Tensor]:
    """The master weights (or master shards) held outside the optimizer state (may be empty)."""
    for groups in master_groups(distrib_optimizer):
        for master in groups:
            if master is not None:
                yield master


def device_of(distrib_optimizer) -> torch.device:
    """The device the optimizer's parameters live on (CPU if it has none)."""
    for param in inner_params(distrib_optimizer):
        return param.device
    return torch.device("cpu")


def expected(distrib_optimizer) -> list[tuple[str, torch.Tensor, bool, torch.device]] | None:
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
    inner = distrib_optimizer.optimizer
    found = [(PRIMARY_WEIGHTS, master, False, master.device) for master in master_weights(distrib_optimizer)]
    state = inner.state
    for group in inner.param_groups:
        for param in group["params"]:
            entries = _entries(state, param)
            if entries:
                for key, tensor in inner_optimizers.state_tensors(param, entries):
                    kind = PRIMARY_WEIGHTS if inner_optimizers.is_master_key(key) else OPTIMIZER_STATES
                    found.append((kind, tensor, True, tensor.device))
                continue
            future = _future_states(inner, group, param)
            if future is None:
                return None
            for key, dtype in future:  # sorted by key, as state_tensors visits them
                kind = PRIMARY_WEIGHTS if inner_optimizers.is_master_key(key) else OPTIMIZER_STATES
                found.append((kind, torch.empty(param.shape, dtype=dtype, device="meta"), True, param.device))
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
            remainders = getattr(inner, "store_param_remainders", False) and param.dtype == torch.bfloat16
            states.append(("master_param", torch.int16 if remainders else dtypes.get("master_param")))
        if any(dtype not in plain + (torch.int16,) for _, dtype in states):
            return None
        return sorted(states)
    return None
