"""The states a Megatron-FSDP load writes into, made without an update
(``adapters/megatron_fsdp.py``: ``params_without_states``, ``can_make_load_states``,
``make_load_states``).

Here with torch's AdamW over plain tensors and a stand-in for megatron-core's Adam
initializer, without building a model; on gloo ranks with DTensors and megatron-core's own
initializer, every strategy and the load that follows:
``tests/integration/offloader/test_megatron_fsdp_checkpoints.py``.
"""

from __future__ import annotations

import types

import torch

from megatron_offload.adapters import megatron_fsdp


def _init_moments(optimizer, config=None):
    """A stand-in for megatron-core's Adam ``init_state_fn`` (its contract: zero moments, like
    the parameter, for every parameter of ``optimizer``'s groups that has no state; the real
    one runs in the integration test)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param]["exp_avg"] = torch.zeros_like(param)
                optimizer.state[param]["exp_avg_sq"] = torch.zeros_like(param)


def _wrapper(init_state_fn, *, with_state: int = 0):
    """A Megatron optimizer over torch AdamW with three parameters in two groups, the first
    ``with_state`` of them stepped already."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 4, 5)]
    inner = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)
    for param in params[:with_state]:
        param.grad = torch.ones_like(param)
    if with_state:
        inner.step()
    config = types.SimpleNamespace(use_precision_aware_optimizer=False)
    return types.SimpleNamespace(optimizer=inner, init_state_fn=init_state_fn, config=config)


def test_the_parameters_without_states_and_whether_they_can_get_them():
    fresh, stepped = _wrapper(_init_moments), _wrapper(_init_moments, with_state=3)
    assert megatron_fsdp.params_without_states(fresh) == [
        p for g in fresh.optimizer.param_groups for p in g["params"]
    ]
    assert megatron_fsdp.params_without_states(stepped) == []
    assert megatron_fsdp.can_make_load_states(fresh) and megatron_fsdp.can_make_load_states(stepped)
    # megatron-core builds SGD without an initializer: its states come from its dummy step.
    assert not megatron_fsdp.can_make_load_states(_wrapper(None))
    assert megatron_fsdp.can_make_load_states(_wrapper(None, with_state=3))


def test_one_parameter_gets_the_states_a_step_would_make_and_nothing_else_changes():
    """The entries (names, shapes, dtypes, devices) are those torch's AdamW makes at its
    first step; only the chosen parameter gets them, its values are not updated, and the
    param groups are back as they were."""
    wrapper = _wrapper(_init_moments)
    inner = wrapper.optimizer
    groups = [list(g["params"]) for g in inner.param_groups]
    target = groups[1][0]
    before = target.detach().clone()
    megatron_fsdp.make_load_states(wrapper, target)

    assert [list(g["params"]) for g in inner.param_groups] == groups
    assert [p for p in inner.state if inner.state[p]] == [target]
    assert torch.equal(target.detach(), before)
    made = inner.state[target]

    reference = torch.optim.AdamW([torch.nn.Parameter(torch.randn(5))], lr=1e-3)
    (stepped,) = reference.param_groups[0]["params"]
    stepped.grad = torch.ones_like(stepped)
    reference.step()
    expected = reference.state[stepped]
    assert sorted(made) == sorted(expected)
    for key, value in expected.items():
        assert (made[key].shape, made[key].dtype, made[key].device) == (
            value.shape,
            value.dtype,
            value.device,
        ), key
        assert not made[key].any(), key  # zeros: the load writes every value
    # torch's AdamW steps from what the load wrote (here: the zeros) as from its own states.
    target.grad = torch.ones_like(target)
    inner.step()
    assert float(made["step"]) == 1.0
