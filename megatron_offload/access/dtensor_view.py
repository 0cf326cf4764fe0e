"""Megatron-FSDP's DTensors seen over their host copy, inside a host view.

Megatron-FSDP keeps the masters and the states as DTensors (``adapters/megatron_fsdp.py``),
and its module hands the optimizer's own DTensor objects out in the model's state dict: a
host view cannot put other objects in their place. Instead each DTensor whose local tensor is
released keeps its identity, and its local tensor's ``data`` is pointed at the same bytes of
the host copy for the block (torch's ``Tensor.data`` setter, which crosses devices as
``Module.to`` does), then back at its released device storage on exit. A save built from
them (torch DCP writes the local tensors) reads the host copy and copies nothing to the
device; a load writes it. The released master buffers themselves (``main_weight_buffer.data``,
which megatron-core slices to copy the masters into the model weights after a load) are the
host copy too for the block.

megatron-core re-wraps slices of them for ``fsdp_dtensor`` checkpoints of gated linear units
(SwiGLU) and Gated DeltaNet: ``fsdp_dtensor_checkpoint.make_fsdp_dtensor``, which calls
``DTensor.from_local``, which copies a host tensor to the mesh's device (a GPU). While a view
is open that function is wrapped: a slice of the host copy is handed to it as a one-element
device stand-in expanded to the slice's shape (4 bytes, never a copy of the slice), and the
DTensor it returns gets the host slice as its local tensor's data. Only its shape, dtype and
placement metadata reach megatron-core's collectives there (``all_gather_object``); a
replicated tensor-parallel placement would make the stand-in contiguous, but the re-wrapped
tensors are column-parallel (``linear_fc1``, ``in_proj``), sharded.
"""

from __future__ import annotations

import torch

from ..adapters import megatron_fsdp
from ..interceptions import PROCESS

# Where megatron-core re-wraps state slices for fsdp_dtensor checkpoints.
_REWRAP_MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"


class DTensorView:
    """The released local tensors of ``wrapper``'s DTensors pointed at ``slices`` (the
    engine's (device tensor, host slice) pairs of its released pieces) until ``close()``."""

    def __init__(self, wrapper, slices) -> None:
        # Storage (by its StorageImpl, stable while released) -> where its bytes are on the host.
        self._hosts: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        self._host_storages: set[int] = set()  # data_ptr of each host storage served
        self.device = None
        for tensor, host in slices:
            flat = host.reshape(-1)
            self._hosts.setdefault(megatron_fsdp.storage_key(tensor), []).append(
                (tensor.storage_offset(), tensor.numel(), flat)
            )
            self._host_storages.add(host.untyped_storage().data_ptr())
            self.device = tensor.device
        self._pointed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local, its own data)
        self._buffers: list[tuple[object, torch.Tensor]] = []  # (buffer owner, its own data)
        self._rewrap = None
        try:
            # Found before any local tensor is pointed: they are found through them.
            owners = megatron_fsdp.master_buffer_owners(wrapper)
            for dtensor in megatron_fsdp.dtensors(wrapper):
                local = megatron_fsdp.local_tensor(dtensor)
                host = self._host_of(local)
                if host is not None:
                    own = local.data  # an alias of its device storage, for close()
                    local.data = host
                    self._pointed.append((local, own))
            # megatron-core also slices the master buffers themselves (a load's
            # ``copy_main_weights_to_model_weights``): they are the host copy too.
            for owner in owners:
                host = self._host_of(owner.data)
                if host is not None:
                    self._buffers.append((owner, owner.data))
                    owner.data = host
            if self._pointed:
                self._install_rewrap()
        except BaseException:
            self.close()  # all or nothing
            raise

    def _host_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The host copy of released ``tensor``, shaped like it (None: not served here)."""
        if tensor.numel() == 0:
            return None
        offset = tensor.storage_offset()
        for start, numel, flat in self._hosts.get(megatron_fsdp.storage_key(tensor), ()):
            if start <= offset and offset + tensor.numel() <= start + numel:
                return flat.as_strided(
                    tensor.shape, tensor.stride(), flat.storage_offset() + offset - start
                )
        return None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views the host copy this view serves."""
        return tensor.device.type == "cpu" and (
            tensor.untyped_storage().data_ptr() in self._host_storages
        )

    def _install_rewrap(self) -> None:
        try:
            module = __import__(_REWRAP_MODULE, fromlist=["make_fsdp_dtensor"])
        except ImportError:
            return
        original = getattr(module, "make_fsdp_dtensor", None)
        if original is None:
            return
        device = self.device

        def make_fsdp_dtensor(local_tensor, *args, **kwargs):
            if not self.holds(local_tensor):
                return original(local_tensor, *args, **kwargs)
            # No copy of the host slice: metadata alone reaches from_local.
            stand_in = torch.empty(1, dtype=local_tensor.dtype, device=device).expand(
                local_tensor.shape
            )
            dtensor = original(stand_in, *args, **kwargs)
            local = megatron_fsdp.local_tensor(dtensor)
            local.data = local_tensor.reshape(local.shape)
            return dtensor

        self._rewrap = PROCESS.replace(
            module,
            "make_fsdp_dtensor",
            make_fsdp_dtensor,
            why="a host view is open: slices of the host copy are re-wrapped without a copy "
            "to the device",
        )

    def close(self) -> None:
        """The local tensors back on their own (released) device storages."""
        if self._rewrap is not None:
            self._rewrap.remove()
            self._rewrap = None
        buffers, self._buffers = self._buffers, []
        for owner, own in reversed(buffers):
            owner.data = own
        pointed, self._pointed = self._pointed, []
        for local, own in reversed(pointed):
            local.data = own
