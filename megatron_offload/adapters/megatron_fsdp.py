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
"""

from __future__ import annotations

import torch


def is_megatron_fsdp(wrapper) -> bool:
    """Whether ``wrapper`` (a Megatron optimizer) was built for Megatron-FSDP."""
    return bool(getattr(getattr(wrapper, "ddp_config", None), "use_megatron_fsdp", False))


def master_buffers(wrapper) -> list[torch.Tensor]:
    """The ``main_weight_buffer.data`` of every parameter group whose masters ``wrapper``'s
    inner optimizer updates (its parameters' local tensors view that storage), in model
    chunk and group order; empty where ``wrapper`` is not a Megatron-FSDP optimizer."""
    if not is_megatron_fsdp(wrapper) or getattr(wrapper, "optimizer", None) is None:
        return []
    # Storages by their StorageImpl (stable while a storage is released and regrown).
    viewed = {
        _local(param).untyped_storage()._cdata
        for group in wrapper.optimizer.param_groups
        for param in group["params"]
    }
    buffers = []
    for chunk in getattr(wrapper, "model_chunks", None) or ():
        module = getattr(chunk, "module", chunk)
        groups = getattr(getattr(module, "param_and_grad_buffer", None), "parameter_groups", ())
        for group in groups:
            buffer = getattr(group.main_weight_buffer, "data", None)
            if buffer is not None and buffer.untyped_storage()._cdata in viewed:
                buffers.append(buffer)
    return buffers


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor
