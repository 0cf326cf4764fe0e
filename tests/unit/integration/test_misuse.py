"""Misuse gets a clear Python error (never a crash), and nothing is touched before it."""

import pytest
import torch

import megatron_offload
from megatron_offload import OffloadConfig, OffloadStateError


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc)
    return None


def misuse_job():
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    found = {}
    found["not_distributed"] = _error(lambda: megatron_offload.attach(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])))
    found["unknown_option"] = _error(lambda: megatron_offload.attach(optimizer, offload_moments=True))
    found["bad_option_type"] = _error(lambda: megatron_offload.attach(optimizer, offload_primary_weights="yes"))
    distrib = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    distrib.config.optimizer_cpu_offload = True
    found["cpu_offload"] = _error(lambda: megatron_offload.attach(optimizer))
    found["untouched_after_refusal"] = getattr(distrib, "_state_offloader", None) is None
    distrib.config.optimizer_cpu_offload = False

    offloader = megatron_offload.attach(optimizer)
    found["reachable_as_state_offloader"] = distrib._state_offloader is offloader
    found["second_attach"] = _error(lambda: megatron_offload.attach(optimizer))
    found["second_attach_inner"] = _error(lambda: megatron_offload.OptimizerStateOffloader(distrib))
    found["reload_before_offload"] = _error(offloader.reload)
    models.train_step(chunks, optimizer, config, 0)  # the step offloads
    found["offloaded_after_step"] = offloader.is_offloaded
    found["detach_while_offloaded"] = _error(offloader.detach)
    offloader.reload()
    offloader.wait()
    offloader.detach()
    found["detached"] = distrib._state_offloader is None and "step" not in vars(optimizer)
    found["use_after_detach"] = _error(offloader.offload)
    # After detach the optimizer is a plain optimizer again: a step leaves states resident.
    models.train_step(chunks, optimizer, config, 1)
    found["resident_after_detached_step"] = all(
        t.untyped_storage().nbytes() > 0 for s in distrib.optimizer.state.values() for t in s.values()
    )
    # And a new offloader can be attached.
    again = megatron_offload.attach(optimizer)
    models.train_step(chunks, optimizer, config, 2)
    found["reattached_offloads"] = again.is_offloaded
    return found


def test_misuse_is_refused_with_clear_messages(rank_pool):
    found = rank_pool.run(misuse_job)[0]
    kind, message = found["not_distributed"]
    assert kind == "TypeError" and "DistributedOptimizer" in message and "use_distributed_optimizer" in message
    kind, message = found["unknown_option"]
    assert kind == "TypeError" and "offload_moments" in message and "offload_optimizer_states" in message
    kind, message = found["bad_option_type"]
    assert kind == "TypeError" and "offload_primary_weights" in message
    kind, message = found["cpu_offload"]
    assert kind == "ValueError" and "--optimizer-cpu-offload" in message
    assert found["untouched_after_refusal"]
    assert found["reachable_as_state_offloader"]
    for case in ("second_attach", "second_attach_inner"):
        kind, message = found[case]
        assert kind == "RuntimeError" and "already has a state offloader" in message and "detach()" in message
    kind, message = found["reload_before_offload"]
    assert kind == "OffloadStateError" and "reload() before offload()" in message
    assert found["offloaded_after_step"]
    kind, message = found["detach_while_offloaded"]
    assert kind == "OffloadStateError" and "reload()" in message
    assert found["detached"]
    kind, message = found["use_after_detach"]
    assert kind == "OffloadStateError" and "detached" in message
    assert found["resident_after_detached_step"]
    assert found["reattached_offloads"]


def test_config_refuses_non_boolean_selection():
    with pytest.raises(TypeError, match="offload_optimizer_states must be True or False"):
        OffloadConfig(offload_optimizer_states=1)
    with pytest.raises(TypeError, match="callable"):
        OffloadConfig(device_factory="cuda")


def test_offload_state_error_is_a_runtime_error():
    assert issubclass(OffloadStateError, RuntimeError)
