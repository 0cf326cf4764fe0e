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
    if uses_nccl_pool(wrapper):
        return []
    return _viewed_master_buffers(wrapper)


def pooled_master_bytes(wrapper) -> int:
    """Device bytes of the master buffers that stay on the device because they come from
    NCCL's registered pool (0 without ``--use-nccl-ub``)."""
    if not uses_nccl_pool(wrapper):
        return 0
    return sum(b.numel() * b.element_size() for b in _viewed_master_buffers(wrapper))


def _viewed_master_buffers(wrapper) -> list[torch.Tensor]:
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
                buffers.append(buffer)
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
