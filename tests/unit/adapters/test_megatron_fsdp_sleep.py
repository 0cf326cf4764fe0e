"""Which Megatron-FSDP settings ``sleep()`` refuses, and why (``model_buffers.fsdp_sleep_refusal``).

The served ones (``optim_grads_params``, ``optim``, with and without ``--fsdp-double-buffer``)
and ``--use-nccl-ub`` are run on gloo ranks in
``tests/integration/offloader/test_megatron_fsdp.py``; here every setting is read from a
DDP config as megatron.training sets it, without building a model.
"""

from __future__ import annotations

import types

import pytest

from megatron_offload.adapters.model_buffers import fsdp_sleep_refusal


def _wrapper(transposed: bool = False, **config):
    """A Megatron optimizer built for one Megatron-FSDP chunk with one parameter group."""
    ddp_config = types.SimpleNamespace(
        use_megatron_fsdp=True,
        nccl_ub=False,
        fsdp_double_buffer=False,
        data_parallel_sharding_strategy="optim_grads_params",
        outer_dp_sharding_strategy="no_shard",
    )
    vars(ddp_config).update(config)
    group = types.SimpleNamespace(transpose_weight_buffer=object() if transposed else None)
    buffer = types.SimpleNamespace(parameter_groups=[group])
    chunk = types.SimpleNamespace(param_and_grad_buffer=buffer)
    return types.SimpleNamespace(ddp_config=ddp_config, model_chunks=[chunk])


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"data_parallel_sharding_strategy": "optim"},
        {"data_parallel_sharding_strategy": "optim_grads"},
        {"fsdp_double_buffer": True},
    ],
)
def test_what_sleep_serves(config):
    assert fsdp_sleep_refusal(_wrapper(**config)) is None


@pytest.mark.parametrize(
    "config, says",
    [
        ({"nccl_ub": True, "fsdp_double_buffer": True}, "NCCL's registered pool"),
        ({"data_parallel_sharding_strategy": "no_shard"}, "module's own"),
        ({"outer_dp_sharding_strategy": "optim"}, "hybrid sharding"),
        ({"transposed": True}, "FP8 parameters"),
    ],
)
def test_what_sleep_refuses_says_why(config, says):
    assert says in fsdp_sleep_refusal(_wrapper(**config))


def test_an_optimizer_without_megatron_fsdp_is_not_its_business():
    wrapper = types.SimpleNamespace(ddp_config=types.SimpleNamespace(use_megatron_fsdp=False))
    assert fsdp_sleep_refusal(wrapper) is None
    assert fsdp_sleep_refusal(types.SimpleNamespace()) is None
