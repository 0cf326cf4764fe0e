"""Collectives megatron-core issues that NCCL allows and gloo does not, made to work on the
CPU ranks of the tests (never used by the product)."""

from __future__ import annotations

import torch


def allow_uneven_all_gather() -> None:
    """LayerWiseDistributedOptimizer gathers each rank's whole parameters with one
    ``all_gather`` of per-rank sizes that differ, which NCCL allows and gloo refuses ("invalid
    tensor size"). On the CPU ranks such a gather is padded to the largest size and cut back:
    the same result, for the harness only (process-wide, idempotent; even gathers unchanged)."""
    import torch.distributed as dist

    if getattr(dist.all_gather, "harness_uneven", False):
        return
    original = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = {t.numel() for t in tensor_list} | {tensor.numel()}
        if len(sizes) == 1 or async_op:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        padded = [
            torch.empty(longest, dtype=tensor.dtype, device=tensor.device) for _ in tensor_list
        ]
        mine = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
        mine[: tensor.numel()] = tensor.reshape(-1)
        original(padded, mine, group=group)
        for out, full in zip(tensor_list, padded):
            out.copy_(full[: out.numel()].view_as(out))
        return None

    all_gather.harness_uneven = True
    dist.all_gather = all_gather
