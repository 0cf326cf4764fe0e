"""Megatron-FSDP on the CPU harness: what its tests read, and what a GPU would do differently.

Read without the offloader's help (raw storages, the inner optimizer's own mapping):
``held_bytes`` (what the master buffers and the states' local shards hold) and ``snapshot``
(every rank's shards of the masters, states and bf16 model weights).

``host_copies_are_copied`` makes ``DTensor.from_local`` copy host tensors, as it does on a GPU.
(``cpu_megatron`` gives torch's Adam a state for every parameter under Megatron-FSDP, as
Transformer Engine's FusedAdam has.)
"""

from __future__ import annotations

import contextlib

import torch

#: The data-parallel options that turn Megatron-FSDP on, in the one strategy offloaded.
FSDP = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"}


def groups(chunks) -> list:
    """Megatron-FSDP's parameter groups, over every model chunk."""
    return [g for chunk in chunks for g in chunk.module.param_and_grad_buffer.parameter_groups]


def local(tensor):
    """A DTensor's local shard (any other tensor as it is)."""
    return getattr(tensor, "_local_tensor", tensor)


def inner(optimizer):
    """The torch optimizer under megatron-core's DistributedOptimizer."""
    from .inspection import megatron_optimizers

    (wrapper,) = megatron_optimizers(optimizer)
    return wrapper.optimizer


def held_bytes(chunks, optimizer, besides=lambda tensor: False) -> int:
    """Bytes the raw storages of the master buffers and of the local tensors of the
    optimizer's parameters and states hold, each storage once (read without the state
    mapping's accessors), but for tensors for which ``besides(tensor)`` (e.g.
    ``HostRecordingDevice.holds``: the offloader's host memory)."""
    opt = inner(optimizer)
    tensors = [g.main_weight_buffer.data for g in groups(chunks) if g.main_weight_buffer]
    tensors += [local(p) for group in opt.param_groups for p in group["params"]]
    tensors += [
        local(value)
        for entries in dict.values(opt.state)
        for value in dict.values(entries)
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if not besides(t)
    }
    return sum(storages.values())


def dtensors_in(state_dict) -> list:
    """Every DTensor in a (nested) state dict."""
    from torch.distributed.tensor import DTensor

    if isinstance(state_dict, DTensor):
        return [state_dict]
    if isinstance(state_dict, dict):
        return [d for value in state_dict.values() for d in dtensors_in(value)]
    if isinstance(state_dict, (list, tuple)):
        return [d for value in state_dict for d in dtensors_in(value)]
    return []


def snapshot(chunks, optimizer) -> dict:
    """Copies of every rank's master shards, states and shards of the bf16 model weights."""
    opt = inner(optimizer)
    params = [p for group in opt.param_groups for p in group["params"]]
    optimizer_side = {f"master {i}": local(p).detach().clone() for i, p in enumerate(params)}
    for i, param in enumerate(params):
        for key, value in sorted(dict.get(opt.state, param, {}).items()):
            if isinstance(value, torch.Tensor):
                optimizer_side[f"state {i} {key}"] = local(value).detach().clone()
    # Each parameter's shard of the bf16 weights (the buffers' padding is never written).
    model_side = {
        f"model weights {g} {i}": group.model_weight_buffer.get_item(i, only_shard=True).clone()
        for g, group in enumerate(groups(chunks))
        if group.model_weight_buffer is not None
        for i in range(len(group.params))
    }
    return {"params": model_side, "optimizer": optimizer_side}


class HostRecordingDevice:
    """A ``device_factory`` whose CPU devices record the host buffers they hand out, until
    they are given back: the address range of a buffer given back is unmapped, and the
    allocator may hand it to anything next (a later model's main weight buffer, which would
    then pass for host memory)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []  # the buffers held now
        self.made = 0  # buffers handed out in all

    def __call__(self, torch_device):
        from megatron_offload.device.cpu import CPUDevice

        recording = self

        class Recording(CPUDevice):
            def host_buffer(self, nbytes):
                buffer = super().host_buffer(nbytes)
                recording.ranges.append((buffer.data_ptr(), buffer.data_ptr() + nbytes))
                recording.made += 1
                return buffer

            def free_host_buffer(self, buffer):
                super().free_host_buffer(buffer)
                span = (buffer.data_ptr(), buffer.data_ptr() + buffer.numel())
                if span in recording.ranges:
                    recording.ranges.remove(span)

        return Recording()

    def holds(self, tensor: torch.Tensor) -> bool:
        start = tensor.untyped_storage().data_ptr()
        return any(low <= start < high for low, high in self.ranges)


@contextlib.contextmanager
def host_copies_are_copied(is_host):
    """``DTensor.from_local`` copies a local tensor for which ``is_host(tensor)`` (e.g.
    ``HostRecordingDevice.holds``: in the offloader's host memory) is true, as torch
    does on a GPU for a host tensor on a CUDA mesh (``local_tensor.to(device_type)``); on the
    CPU harness the mesh is the CPU's and nothing is ever copied. Megatron-core's SwiGLU
    handling re-wraps slices of the states and masters this way for fsdp_dtensor checkpoints:
    a load through such a copy would write the copy and leave the host copy stale.
    Yields the list of the tensors it copied."""
    from torch.distributed.tensor import DTensor

    original = DTensor.__dict__["from_local"]
    copied = []

    def from_local(local_tensor, *args, **kwargs):
        if is_host(local_tensor):
            copied.append(tuple(local_tensor.shape))
            local_tensor = local_tensor.clone()
        return original.__func__(local_tensor, *args, **kwargs)

    DTensor.from_local = staticmethod(from_local)
    try:
        yield copied
    finally:
        DTensor.from_local = original
