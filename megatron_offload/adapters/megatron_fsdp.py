"""Megatron-FSDP (``use_megatron_fsdp``): where its optimizer keeps the fp32 master weights.

``get_megatron_optimizer`` builds the usual ``DistributedOptimizer``, whose ``__init__``
returns early under ``use_megatron_fsdp``: no ``shard_fp32_from_float16_groups``, no buffers
of its own (megatron-core 0.16-0.19, ``optimizer/distrib_optimizer.py``). Megatron-FSDP keeps
the fp32 master weights of each parameter group in one allocation, the group's
``main_weight_buffer.data`` (``param_and_grad_buffer.parameter_groups``, of the
``MegatronFSDP`` module each model chunk wraps); the inner optimizer's parameters are
``nn.Parameter(DTensor)`` whose local tensors are views into it, taken once
(``_init_distributed_params``), and ``copy_main_weights_to_model_weights`` slices the buffer
again at every call. So the masters are the buffers themselves, released and regrown in their
own storage (the engine's in-place pieces), never re-pointed: every view follows.

The states are DTensors too (torch's Adam makes them like the parameter); their local tensors
are plain and owned (``inner_optimizers.state_places``). A rank's shard of a parameter may be
empty: an empty local tensor holds nothing and is skipped.

With NCCL user buffers (``--use-nccl-ub``, ``ddp_config.nccl_ub``) Megatron-FSDP allocates its
buffers, the main weight buffers included, inside a ``torch.cuda.MemPool`` registered with NCCL
(``param_and_grad_buffer.py``, ``mem_alloc_context``); the optimizer allocates its states
outside any pool. A block freed in a pool goes back to that pool's cache, not to the memory the
forward pass allocates from, and a storage regrown outside the pool is not registered: releasing
the masters would free nothing the forward pass can use and would take them out of NCCL's
registration. So under it the masters stay on the device (``pooled_master_bytes`` says how
many bytes) and the states alone move, which frees their memory for the forward pass.
"""

from __future__ import annotations

import torch

from .model_buffers import chunks_of, local_tensor, storage_key


def is_megatron_fsdp(wrapper) -> bool:
    """Whether ``wrapper`` (a Megatron optimizer) was built for Megatron-FSDP."""
    return bool(getattr(getattr(wrapper, "ddp_config", None), "use_megatron_fsdp", False))


def uses_nccl_pool(wrapper) -> bool:
    """Whether ``wrapper``'s Megatron-FSDP buffers come from NCCL's registered pool
    (``--use-nccl-ub``): its masters then stay on the device (above)."""
    return is_megatron_fsdp(wrapper) and bool(getattr(wrapper.ddp_config, "nccl_ub", False))


def master_buffers(wrapper) -> list[torch.Tensor]:
    """The ``main_weight_buffer.data`` the offloader moves: of every parameter group whose
    masters ``wrapper``'s inner optimizer updates (its parameters' local tensors view that
    storage), in model chunk and group order; empty where ``wrapper`` is not a Megatron-FSDP
    optimizer, and under NCCL user buffers (they stay on the device: ``pooled_master_bytes``)."""
    return [owner.data for owner in master_buffer_owners(wrapper)]


def master_buffer_owners(wrapper) -> list:
    """The ``main_weight_buffer`` objects whose ``data`` is ``master_buffers``: megatron-core
    reads the masters there too (``copy_main_weights_to_model_weights`` slices ``data``)."""
    if uses_nccl_pool(wrapper):
        return []
    return _viewed_master_buffers(wrapper)


def pooled_master_bytes(wrapper) -> int:
    """Device bytes of the master buffers that stay on the device because they come from
    NCCL's registered pool (0 without ``--use-nccl-ub``)."""
    if not uses_nccl_pool(wrapper):
        return 0
    return sum(
        owner.data.numel() * owner.data.element_size() for owner in _viewed_master_buffers(wrapper)
    )


def _viewed_master_buffers(wrapper) -> list:
    """The ``main_weight_buffer`` of every parameter group whose storage the optimizer's
    parameters view."""
    if not is_megatron_fsdp(wrapper) or getattr(wrapper, "optimizer", None) is None:
        return []
    viewed = {
        storage_key(local_tensor(param))
        for group in wrapper.optimizer.param_groups
        for param in group["params"]
    }
    buffers = []
    for chunk in chunks_of([wrapper]):
        module = getattr(chunk, "module", chunk)
        groups = getattr(getattr(module, "param_and_grad_buffer", None), "parameter_groups", ())
        for group in groups:
            buffer = getattr(group.main_weight_buffer, "data", None)
            if buffer is not None and storage_key(buffer) in viewed:
                buffers.append(group.main_weight_buffer)
    return buffers


def dtensors(wrapper):
    """The DTensors of ``wrapper``'s inner optimizer whose local tensors the offloader may
    release: its parameters (views into the master buffers) and their states."""
    inner = wrapper.optimizer
    for group in inner.param_groups:
        for param in group["params"]:
            if local_tensor(param) is not param:
                yield param
    for entries in dict.values(inner.state):
        if isinstance(entries, dict):
            for value in entries.values():
                if isinstance(value, torch.Tensor) and local_tensor(value) is not value:
                    yield value


# ------------------------------------------------------------------ states for a load
def params_without_states(wrapper) -> list:
    """The parameters of ``wrapper``'s inner optimizer that have no state yet. megatron-core's
    ``fsdp_dtensor`` load makes states for every parameter (Transformer Engine's FusedAdam
    makes them for every parameter, also one whose shard on this rank is empty), and every
    rank must hold the same state keys: its metadata gather runs once per key."""
    inner = wrapper.optimizer
    return [
        param
        for group in inner.param_groups
        for param in group["params"]
        if not dict.get(inner.state, param)
    ]


def can_make_load_states(wrapper) -> bool:
    """Whether ``make_load_states`` can give ``wrapper``'s parameters the states a load writes
    into: megatron-core built it with a state initializer (``init_state_fn``: Adam, Lion), or
    every parameter has its states already."""
    return getattr(wrapper, "init_state_fn", None) is not None or not params_without_states(wrapper)


def make_load_states(wrapper, param) -> None:
    """Give ``param`` the states an ``fsdp_dtensor`` load writes into, without an update.

    megatron-core makes them by stepping the inner optimizer on zero gradients, which reads and
    writes the masters and every state on the device. This makes the same entries with its own
    initializer instead (``wrapper.init_state_fn``, what its DistributedOptimizer loads use:
    moments of zeros like the parameter, or TE's ``initialize_state`` with the precision-aware
    optimizer), run for this parameter alone, on the parameter's device; torch's Adam keeps a
    ``step`` in each parameter's state, which the initializer does not make, so it is added as
    torch makes it (0: the load writes the saved count). The load overwrites every value.
    """
    inner = wrapper.optimizer
    group = next(g for g in inner.param_groups if any(p is param for p in g["params"]))
    groups, params = inner.param_groups, group["params"]
    try:
        group["params"] = [param]
        inner.param_groups = [group]
        wrapper.init_state_fn(inner, wrapper.config)
    finally:
        inner.param_groups = groups
        group["params"] = params
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        entries = inner.state[param]
        if "step" not in entries:
            on_device = group.get("capturable") or group.get("fused")
            wide = torch.get_default_dtype() == torch.float64 and not group.get("fused")
            entries["step"] = torch.zeros(
                (),
                dtype=torch.float64 if wide else torch.float32,
                device=param.device if on_device else "cpu",
            )
