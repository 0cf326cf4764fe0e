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
        if not hasattr(chunk, "buffers") or not hasattr(chunk, "expert_parallel_buffers"):
            raise TypeError(
                f"{type(chunk).__name__} is not a megatron-core DistributedDataParallel chunk; "
                "sleep() needs the DDP-wrapped model chunks (as get_model returns them)."
            )
    return unique


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
    """(this rank's shard of a 16-bit parameter, its fp32 master), for every one."""
    models = getattr(wrapper, "shard_float16_groups", None) or ()
    masters = getattr(wrapper, "shard_fp32_from_float16_groups", None) or ()
    return [
        (model, master)
        for model_group, master_group in zip(models, masters)
        for model, master in zip(model_group, master_group)
    ]


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


def rebuild(rebuilders, chunks) -> None:
    """Make the 16-bit parameters again from the (resident) masters, as megatron-core does
    after a step: each rank casts its shards, then the chunks all-gather every buffer."""
    for wrapper in rebuilders:
        wrapper._copy_main_params_to_model_params()
    for chunk in chunks:
        # Synchronous, whatever overlap_param_gather says: the parameters are used next.
        chunk.start_param_sync(force_sync=True)
