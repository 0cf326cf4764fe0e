"""The device memory an optimizer's states take at a given moment, from tracked allocations.

Counted once per storage: every storage behind a per-element tensor of the inner optimizer's
state as it is at that moment (a chunked update has pointed the chunk's states at its slot),
and every live device storage a checked device allocated, regrew or copied (the slots, the
consolidated groups). The master weights megatron-core keeps beside the optimizer (under
Megatron-FSDP, the buffers its DTensor parameters view) are left out: they are not optimizer
state (a chunked update reloads them whole).
"""


def state_storages(distrib_optimizer):
    from megatron_offload.adapters import inner_optimizers

    inner = distrib_optimizer.optimizer
    for group in inner.param_groups:
        for param in group["params"]:
            for _, tensor in inner_optimizers.state_tensors(param, inner.state.get(param) or {}):
                yield tensor.untyped_storage()


def optimizer_footprint(distrib_optimizer, devices=(), more_masters=()) -> int:
    """Bytes of device memory held for ``distrib_optimizer``'s states right now
    (``more_masters``: more master storages to leave out, by ``_cdata``)."""
    from megatron_offload.adapters import megatron_wrappers as adapter

    masters = {m.untyped_storage()._cdata for m in adapter.master_weights(distrib_optimizer)}
    masters.update(more_masters)
    held = {}
    for storage in state_storages(distrib_optimizer):
        held[storage._cdata] = storage.nbytes()
    for device in devices:
        for mem in device._memories.values():
            storage = mem.storage()
            if not mem.host and storage is not None:
                held[storage._cdata] = storage.nbytes()
    return sum(n for key, n in held.items() if key not in masters)


def record_peaks(optimizer, devices=()):
    """Register step post-hooks on every inner optimizer of ``optimizer``; returns a list
    that gets, per call of ``new_step()``, the largest footprint any inner step call saw."""
    from megatron_offload.adapters import megatron_fsdp
    from tests.harness import models

    peaks = []
    for index, distrib in enumerate(models.distributed_optimizers(optimizer)):
        own = [devices[index]] if devices else []  # the engines' devices, in optimizer order
        # Megatron-FSDP's masters, found now: a chunked update narrows the param groups that
        # lead to them during its calls.
        buffers = {b.untyped_storage()._cdata for b in megatron_fsdp.master_buffers(distrib)}

        def hook(inner, args, kwargs, distrib=distrib, own=own, buffers=buffers):
            if peaks:
                peaks[-1] = max(peaks[-1], optimizer_footprint(distrib, own, buffers))

        distrib.optimizer.register_step_post_hook(hook)
    return peaks


def whole_state_bytes(optimizer) -> int:
    """Bytes of per-element state of the largest inner optimizer: what its whole update holds
    on the device (the inner optimizers of a ChainedOptimizer update one after the other)."""
    from megatron_offload.adapters import inner_optimizers
    from tests.harness import models

    totals = [0]
    for distrib in models.distributed_optimizers(optimizer):
        inner = distrib.optimizer
        totals.append(0)
        for group in inner.param_groups:
            for param in group["params"]:
                for _, t in inner_optimizers.state_tensors(param, inner.state.get(param) or {}):
                    totals[-1] += t.numel() * t.element_size()
    return max(totals)
