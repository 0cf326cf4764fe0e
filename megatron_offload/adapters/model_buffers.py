"""Where megatron-core keeps a model's parameters and gradients, and how its distributed
optimizer makes the parameters again from the master weights.

``DistributedDataParallel`` (each model chunk) keeps every trainable parameter in the
``param_data`` of one of its buffers (``buffers`` for dense parameters,
``expert_parallel_buffers`` for experts; only with the distributed optimizer, otherwise each
parameter keeps its own storage) and every gradient in the buffers' ``grad_data``
(``param.main_grad`` views it). Frozen parameters are in no buffer. Every tensor that views
a buffer (parameters, ``main_grad``, the buckets' views, the optimizer's shard views) views
its storage, so giving the storage's memory back and regrowing it later serves all of them.

Rebuilding: after every step the DistributedOptimizer copies each fp32 master shard into the
rank's shard of the 16-bit parameter buffer (``_copy_main_params_to_model_params``, a cast)
and the DDP chunks all-gather the buffer (``start_param_sync``). So while the parameters
still equal their masters cast (``matches_masters``), a 16-bit buffer can be given up without
a copy and made again from the masters. Not rebuildable, copied instead: fp32 parameters
(their own masters), frozen parameters, buffers of optimizers that keep masters elsewhere
(the precision-aware optimizer, FP8 parameters, the layer-wise optimizer, Float16Optimizer).

Megatron-FSDP (``FullyShardedDataParallel`` chunks) keeps, per parameter group, the 16-bit
weights in a model weight buffer (sharded under ``optim_grads_params``) and the gradients in a
main gradient buffer; the unsharded parameters a forward uses are gathered from the weights
into buckets of its own (with ``--fsdp-double-buffer``, slices of pools it keeps). After a step
it casts the fp32 master shards into the weight buffers (``copy_main_weights_to_model_weights``)
and gathers (``start_param_sync``): the same rebuild.
"""

from __future__ import annotations

import dataclasses

import torch

PARAMETERS = "parameters"
GRADIENTS = "gradients"
_HALF = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class ModelStorage:
    """One storage of the model: a buffer's ``param_data`` or ``grad_data``, or a parameter
    kept outside the buffers."""

    #: A tensor viewing the whole storage.
    tensor: torch.Tensor
    #: ``PARAMETERS`` or ``GRADIENTS``.
    kind: str
    #: The DistributedOptimizer that can make it again from its masters (None: copied).
    rebuilder: object | None = None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, the object itself (``to_local()`` hands out a view while
    gradients are enabled); any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def storage_key(tensor: torch.Tensor) -> int:
    """``tensor``'s storage, by its StorageImpl (stable while the storage is released and
    regrown in place, when its data pointer is null)."""
    return tensor.untyped_storage()._cdata


def chunks_of(wrappers) -> list:
    """The model chunks the Megatron optimizers ``wrappers`` were built for (their
    ``model_chunks``; none for an optimizer without them), each once, in order: the one walk
    of them."""
    chunks = [c for w in wrappers for c in (getattr(w, "model_chunks", None) or ())]
    return list({id(chunk): chunk for chunk in chunks}.values())


def model_chunks(optimizers, model=None) -> list:
    """The DDP model chunks: ``model`` (a chunk or a list of them) when given, else those the
    distributed optimizers among ``optimizers`` were built for."""
    if model is not None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        unique = list({id(chunk): chunk for chunk in chunks}.values())
    else:
        unique = chunks_of(optimizers)
    for chunk in unique:
        if is_megatron_fsdp_chunk(chunk):
            continue
        if not hasattr(chunk, "buffers") or not hasattr(chunk, "expert_parallel_buffers"):
            raise TypeError(
                f"{type(chunk).__name__} is not a megatron-core DistributedDataParallel chunk; "
                "sleep() needs the DDP-wrapped model chunks (as get_model returns them)."
            )
    return unique


def is_megatron_fsdp_chunk(chunk) -> bool:
    """Whether ``chunk`` is megatron-core's ``FullyShardedDataParallel`` (Megatron-FSDP)."""
    return hasattr(chunk, "param_and_grad_buffer") and hasattr(
        getattr(chunk, "module", None), "all_gather_pipeline"
    )


def fsdp_groups(chunk) -> list:
    """Megatron-FSDP's parameter groups of ``chunk`` (its buffers, one of each kind per
    group)."""
    return list(chunk.param_and_grad_buffer.parameter_groups)


def is_distributed(wrapper) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(wrapper, DistributedOptimizer)


def rebuild_refusal(wrapper) -> str | None:
    """Why ``wrapper``'s 16-bit parameters cannot be made from its masters, or None."""
    if not is_distributed(wrapper):
        return f"{type(wrapper).__name__} keeps no shards of a parameter buffer"
    config = getattr(wrapper, "config", None)
    if getattr(config, "use_precision_aware_optimizer", False):
        return "the precision-aware optimizer keeps its masters in the inner optimizer"
    pairs = shard_pairs(wrapper)
    if any(type(model) is not torch.Tensor or model.dtype not in _HALF for model, _ in pairs):
        return "some parameters are not plain 16-bit tensors (FP8)"
    return None


def shard_pairs(wrapper) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(this rank's shard of a 16-bit parameter, its fp32 master), for every one. Under
    Megatron-FSDP the master is the optimizer's DTensor's local tensor (inside a host view:
    its host copy) and the shard is the model weight buffer's."""
    if getattr(getattr(wrapper, "ddp_config", None), "use_megatron_fsdp", False):
        return _fsdp_shard_pairs(wrapper)
    models = getattr(wrapper, "shard_float16_groups", None) or ()
    masters = getattr(wrapper, "shard_fp32_from_float16_groups", None) or ()
    return [
        (model, master)
        for model_group, master_group in zip(models, masters)
        for model, master in zip(model_group, master_group)
    ]


def _fsdp_shard_pairs(wrapper) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Each of the inner optimizer's parameters (a DTensor over its master shard) names the
    # model parameter it stands for (``orig_param``), whose item in the group's buffers is its
    # index there.
    items = {
        id(param): (group, item_id)
        for chunk in chunks_of([wrapper])
        for group in fsdp_groups(chunk)
        for item_id, param in enumerate(group.params)
    }
    pairs = []
    for group in wrapper.optimizer.param_groups:
        for master in group["params"]:
            found = items.get(id(getattr(master, "orig_param", None)))
            if found is None or found[0].model_weight_buffer is None:
                continue
            owner, item_id = found
            model, main = owner.model_weight_buffer, owner.main_weight_buffer
            shard = model.is_data_distributed or (main is not None and main.is_data_distributed)
            # The buffer's item is flat, the DTensor's local tensor shaped: compared flat.
            pairs.append(
                (model.get_item(item_id, only_shard=shard), local_tensor(master).reshape(-1))
            )
    return pairs


def matches_masters(wrapper) -> bool:
    """Whether every 16-bit parameter shard of this rank is bit for bit its master cast: the
    bits, not the values (-0.0 and NaN payloads must come back as they were). Where a master
    is on the host (its host copy, served by a host view) the shard is copied there to be
    compared: at a sleep, never on the step's path."""
    for model, master in shard_pairs(wrapper):
        cast = master.to(model.dtype)
        if not torch.equal(model.to(cast.device).view(torch.int16), cast.view(torch.int16)):
            return False
    return True


#: TransformerConfig settings under which CUDA graphs replay the model's buffers' addresses.
GRAPH_SETTINGS = ("cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph")


def graph_capture(chunks) -> str | None:
    """The CUDA-graph setting of the chunks' model config that captures the addresses of the
    parameter and gradient buffers (``cuda_graph_impl`` "local", "transformer_engine",
    "full_iteration", or the older ``enable_cuda_graph`` / ``external_cuda_graph``), or None."""
    for chunk in chunks:
        module = chunk
        while module is not None:
            config = getattr(module, "config", None)
            if config is not None:
                impl = getattr(config, "cuda_graph_impl", "none") or "none"
                if impl != "none":
                    return f"cuda_graph_impl={impl!r}"
                for flag in GRAPH_SETTINGS[1:]:
                    if getattr(config, flag, False):
                        return f"{flag}=True"
                break
            module = getattr(module, "module", None)
    return None


def storages(chunks, rebuilders) -> list[ModelStorage]:
    """Every storage of the chunks' parameters and gradients, once each; 16-bit parameter
    buffers owned by one of ``rebuilders`` carry it."""
    owner = {}
    for wrapper in rebuilders:
        for buffer in getattr(wrapper, "buffers", ()):
            owner[id(buffer)] = wrapper
    found: dict[int, ModelStorage] = {}

    def add(tensor, kind, rebuilder=None):
        if tensor is not None and tensor.untyped_storage().nbytes():
            key = tensor.untyped_storage().data_ptr()
            found.setdefault(key, ModelStorage(tensor, kind, rebuilder))

    for chunk in chunks:
        if is_megatron_fsdp_chunk(chunk):
            # Its model weight and main gradient buffers (the masters are the engine's); the
            # unsharded parameters gathered from them are Megatron-FSDP's own buckets
            # (``release_gathered``).
            rebuilder = next((w for w in rebuilders if chunk in chunks_of([w])), None)
            for group in fsdp_groups(chunk):
                if group.main_grad_buffer is not None:
                    add(group.main_grad_buffer.data, GRADIENTS)
                if group.model_weight_buffer is not None:
                    data = group.model_weight_buffer.data
                    add(data, PARAMETERS, rebuilder if data.dtype in _HALF else None)
            continue
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            add(buffer.grad_data, GRADIENTS)
            if buffer.param_data is not None:
                half = buffer.param_data.dtype in _HALF
                add(buffer.param_data, PARAMETERS, owner.get(id(buffer)) if half else None)
            else:  # without the distributed optimizer each parameter has its own storage
                for param in buffer.params:
                    add(param, PARAMETERS)  # the parameter itself: the same object every time
        for param in chunk.parameters():
            if not param.requires_grad:
                add(param, PARAMETERS)
    return list(found.values())


def release_gathered(chunks) -> int:
    """Give back the unsharded parameters Megatron-FSDP gathered into its all-gather buckets
    (after a step they wait for the next forward), through its own pipeline, which knows them
    gathered no more: the next forward (or ``start_param_sync``) gathers them again. Returns
    the bytes given back."""
    freed = 0
    for chunk in chunks:
        if not is_megatron_fsdp_chunk(chunk):
            continue
        # The module's own parameters, which view the gathered buckets.
        storages = {storage_key(p): p for p in chunk.module.raw_param.values()}
        before = sum(p.untyped_storage().nbytes() for p in storages.values())
        # No gather in flight into what is given back (it gives the FSDP units' buckets back
        # itself); the module holds the optimizer's DTensors after it, as after a step with
        # overlapped gathers.
        chunk.synchronize_param_gather()
        pipeline = chunk.module.all_gather_pipeline
        for bucket_id in range(pipeline.num_buckets):
            pipeline.release_bucket(bucket_id, False)
        freed += before - sum(p.untyped_storage().nbytes() for p in storages.values())
    return freed


def fsdp_sleep_refusal(wrapper) -> str | None:
    """Why ``sleep()`` cannot give up the buffers of ``wrapper``'s Megatron-FSDP model, or
    None (not a Megatron-FSDP optimizer, or one it serves)."""
    config = getattr(wrapper, "ddp_config", None)
    if not getattr(config, "use_megatron_fsdp", False):
        return None
    if getattr(config, "nccl_ub", False):
        return (
            "with NCCL user buffers (--use-nccl-ub) its buffers are in NCCL's registered pool, "
            "where a released block frees nothing the rollout can use"
        )
    if getattr(config, "data_parallel_sharding_strategy", "no_shard") == "no_shard":
        return "under no_shard its parameters are the module's own, outside its buffers"
    if getattr(config, "outer_dp_sharding_strategy", "no_shard") != "no_shard":
        return "hybrid sharding's outer buffers are not shown yet"
    for chunk in chunks_of([wrapper]):
        if any(g.transpose_weight_buffer is not None for g in fsdp_groups(chunk)):
            return "FP8 parameters keep transposed copies in buffers of their own"
    return None


def fsdp_pools(chunks) -> list[torch.Tensor]:
    """The pools of Megatron-FSDP's double buffer (``--fsdp-double-buffer``): the tensors of its
    global memory buffer that its fixed-pool allocators (gathered parameters, gradient buckets)
    hand out slices of, kept for the whole run. Idle between steps once every bucket is
    released (``release_gathered``); empty without the double buffer."""
    import importlib

    names, pool = set(), None
    for chunk in chunks:
        if not is_megatron_fsdp_chunk(chunk):
            continue
        buffer = chunk.param_and_grad_buffer
        for allocator in vars(buffer).values():
            # A fixed-pool allocator (FixedPoolAllocator, MaxPoolAllocator) names its pools.
            if hasattr(allocator, "fsdp_double_buffer_units") and isinstance(
                getattr(allocator, "name", None), str
            ):
                names.add(allocator.name + "_")
                pool = importlib.import_module(type(buffer).__module__).get_global_memory_buffer()
    if pool is None:
        return []
    return [
        tensor
        for (name, _), tensor in pool.buffer.items()
        if isinstance(name, str) and name.startswith(tuple(names)) and tensor.numel()
    ]


def gather_again(chunks) -> None:
    """Megatron-FSDP's chunks gather their parameters again (``release_gathered`` gave them
    back), as after a step; other chunks are left as they are."""
    for chunk in chunks:
        if is_megatron_fsdp_chunk(chunk):
            chunk.start_param_sync(force_sync=True)


def rebuild(rebuilders, chunks) -> None:
    """Make the 16-bit parameters again from the (resident) masters, as megatron-core does
    after a step: each rank casts its shards, then the chunks all-gather every buffer."""
    for wrapper in rebuilders:
        wrapper._copy_main_params_to_model_params()
    for chunk in chunks:
        # Synchronous, whatever overlap_param_gather says: the parameters are used next.
        chunk.start_param_sync(force_sync=True)
