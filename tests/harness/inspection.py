"""Inspection of built models and optimizers (see models.py): which Megatron optimizers a
build made, snapshots for the bitwise comparisons, and storage facts.

Run inside a rank job (see rank_pool).
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizer instances inside `optimizer` (a ChainedOptimizer or not)."""
    inner = getattr(optimizer, "chained_optimizers", None)
    optimizers = list(inner) if inner is not None else [optimizer]
    return [opt for opt in optimizers if isinstance(opt, DistributedOptimizer)]


def megatron_optimizers(optimizer) -> list:
    """Every Megatron optimizer inside `optimizer` that holds a torch optimizer on this rank
    (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer), in chain order,
    nested ChainedOptimizers (LayerWiseDistributedOptimizer) flattened."""
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is None:
        return [optimizer] if getattr(optimizer, "optimizer", None) is not None else []
    return [leaf for opt in inner for leaf in megatron_optimizers(opt)]


def _master_groups(opt) -> list:
    """The fp32 masters of bf16/fp16 params: the distributed optimizer's shards or the
    Float16 optimizer's whole-parameter copies (empty for FP32Optimizer)."""
    for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
        groups = getattr(opt, name, None)
        if groups is not None:
            return groups
    return []


def optimizer_classes(optimizer) -> list[str]:
    """Class names from the outside in, e.g. ['ChainedOptimizer', 'DistributedOptimizer', 'AdamW'].

    A ChainedOptimizer contributes its name, then each chained optimizer's name followed by
    the name of the torch optimizer it wraps.
    """
    inner = getattr(optimizer, "chained_optimizers", None)
    names = [type(optimizer).__name__] if inner is not None else []
    for opt in inner if inner is not None else [optimizer]:
        names += [type(opt).__name__, type(opt.optimizer).__name__]
    return names


def _iter_shards(optimizer):
    """Yield (opt_index, group_index, param_index, shard, master_kind) for every inner param.

    The inner optimizer's groups hold the fp32 shards: views into fp32 model params first,
    then the fp32 clones of bf16/fp16 shards (shard_fp32_from_float16_groups; for the
    non-distributed optimizers the whole parameters and fp32_from_float16_groups).
    """
    for opt_index, dist_opt in enumerate(megatron_optimizers(optimizer)):
        from_float16 = _master_groups(dist_opt)
        for group_index, group in enumerate(dist_opt.optimizer.param_groups):
            clones = {
                id(t)
                for t in (from_float16[group_index] if group_index < len(from_float16) else [])
                if t is not None
            }
            for param_index, shard in enumerate(group["params"]):
                kind = "fp32_from_float16" if id(shard) in clones else "fp32_view"
                yield opt_index, group_index, param_index, shard, kind


def snapshot(model_chunks, optimizer) -> dict:
    """CPU clones of everything the bitwise comparisons look at.

    {'params': {'<chunk>.<name>': tensor},
     'optimizer': {(opt_index, group_index, param_index, key): tensor}}
    where key is 'exp_avg', 'exp_avg_sq', 'step' (whatever the inner optimizer's state holds)
    or 'main_param' (the fp32 shard the optimizer updates: the master clone for bf16 params,
    a view of the model param for fp32 params). Indices follow the inner optimizer's
    param_groups, which are stable across runs built the same way. With overlap_param_gather,
    call flush_param_gather() first if the model params must be current.
    """
    params = {}
    for chunk_index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            params[f"{chunk_index}.{name}"] = param.detach().clone()
    state = {}
    dist_opts = megatron_optimizers(optimizer)
    for opt_index, group_index, param_index, shard, _kind in _iter_shards(optimizer):
        state[(opt_index, group_index, param_index, "main_param")] = shard.detach().clone()
        for key, value in dist_opts[opt_index].optimizer.state.get(shard, {}).items():
            if isinstance(value, torch.Tensor):
                state[(opt_index, group_index, param_index, key)] = value.detach().clone()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                # A Python step counter (SOAP's), compared like the tensors.
                state[(opt_index, group_index, param_index, key)] = torch.tensor(value)
    return {"params": params, "optimizer": state}


def _storage_fact(tensor) -> dict:
    storage_bytes = tensor.untyped_storage().nbytes()
    return {
        "owns_storage": storage_bytes == tensor.numel() * tensor.element_size()
        and tensor.storage_offset() == 0,
        "storage_bytes": storage_bytes,
        "tensor_bytes": tensor.numel() * tensor.element_size(),
        "storage_offset": tensor.storage_offset(),
        "dtype": str(tensor.dtype),
    }


def storage_facts(optimizer) -> dict:
    """Whether optimizer-held tensors own their storage (what an offloader may resize_(0)).

    {(opt_index, group_index, param_index, key): {'owns_storage', 'storage_bytes',
    'tensor_bytes', 'storage_offset', 'dtype', 'kind'?}} for exp_avg, exp_avg_sq, step and
    the main param (kind: 'fp32_from_float16' or 'fp32_view'; 'has_grad', and 'grad' with the
    same facts for its .grad).
    """
    facts = {}
    dist_opts = megatron_optimizers(optimizer)
    for opt_index, group_index, param_index, shard, kind in _iter_shards(optimizer):
        fact = _storage_fact(shard)
        fact["kind"] = kind
        fact["has_grad"] = shard.grad is not None
        if shard.grad is not None:
            fact["grad"] = _storage_fact(shard.grad)
        facts[(opt_index, group_index, param_index, "main_param")] = fact
        for key, value in dist_opts[opt_index].optimizer.state.get(shard, {}).items():
            if isinstance(value, torch.Tensor):
                facts[(opt_index, group_index, param_index, key)] = _storage_fact(value)
    return facts
