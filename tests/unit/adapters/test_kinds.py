"""Small adapter facts that need no megatron-core objects."""

import types

import torch

from megatron_offload.adapters import kind_of
from megatron_offload.adapters import megatron_wrappers as adapter
from megatron_offload.adapters.inner_optimizers import OTHER, TORCH_ADAM


def test_an_optimizer_without_parameters_lives_on_the_cpu():
    empty = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[{"params": []}]))
    assert adapter.device_of(empty) == torch.device("cpu")


def test_kind_of_names_optimizers_it_does_not_know_as_other():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert kind_of(torch.optim.AdamW(params)) == TORCH_ADAM
    assert kind_of(torch.optim.SGD(params, lr=0.1)) == OTHER
