"""Megatron-FSDP's settings as ``rules.refuse`` judges them, on a DDP config's field names
(what ``attach`` reads from the optimizer's ``ddp_config``; the command line's are the same)."""

from __future__ import annotations

import types

import pytest

from megatron_offload import OffloadArgumentError, rules


def _ddp_config(**fields):
    base = dict(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        num_distributed_optimizer_instances=1,
        megatron_fsdp_cuda_graph_mode=False,
    )
    return types.SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_every_sharding_strategy_is_served(strategy):
    rules.refuse(_ddp_config(data_parallel_sharding_strategy=strategy))


def test_nccl_user_buffers_are_served():
    # The states move, the masters in NCCL's pool stay (adapters/megatron_fsdp.py).
    rules.refuse(_ddp_config(nccl_ub=True))


def test_without_megatron_fsdp_its_fields_are_not_judged():
    rules.refuse(_ddp_config(use_megatron_fsdp=False, data_parallel_sharding_strategy="no_shard"))


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"data_parallel_sharding_strategy": "a_later_one"}, "not 'a_later_one' (not shown"),
        ({"megatron_fsdp_cuda_graph_mode": True}, "CUDA-graph mode of"),
        (
            {
                "use_megatron_fsdp": False,
                "use_custom_fsdp": True,
                "megatron_fsdp_cuda_graph_mode": True,
            },
            "CUDA-graph mode of",
        ),
    ],
)
def test_what_megatron_fsdp_offloading_does_not_serve_is_refused(fields, words):
    with pytest.raises(OffloadArgumentError, match=r"--offload-optimizer-states") as error:
        rules.refuse(_ddp_config(**fields))
    assert words in str(error.value)
