"""``ModelMemory`` (the model's storages given up while asleep), on the CPU device: what
comes back, what is held on the host, and all or nothing when an allocation fails. Storages
are released, so the bodies run in the isolated process."""

from __future__ import annotations

import pytest
import torch


def release_and_regrow() -> dict:
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.model_memory import ModelMemory

    device = CPUDevice()
    copied = [0]
    copy = device.copy

    def counting(dst, src):
        copied[0] += dst.numel() * dst.element_size()
        copy(dst, src)

    device.copy = counting
    params = torch.arange(12, dtype=torch.bfloat16)
    view = params[4:8].view(2, 2)  # a parameter viewing the buffer
    grads = torch.full((6,), 3.0)
    rebuilt = torch.ones(5, dtype=torch.bfloat16)
    memory = ModelMemory(device, name="wake()")
    facts = {}
    for cycle in range(2):
        memory.release([(params, True, False), (grads, False, True), (rebuilt, False, False)])
        facts[f"released {cycle}"] = [
            t.untyped_storage().nbytes() for t in (params, view, grads, rebuilt)
        ]
        facts[f"copied {cycle}"] = copied[0]
        memory.regrow()
        facts[f"regrown {cycle}"] = [t.untyped_storage().nbytes() for t in (params, grads)]
        facts[f"params {cycle}"] = torch.equal(params, torch.arange(12, dtype=torch.bfloat16))
        facts[f"view {cycle}"] = torch.equal(view.reshape(-1), params[4:8])
        facts[f"grads {cycle}"] = torch.equal(grads, torch.zeros(6))
        facts[f"figures {cycle}"] = (memory.copied_bytes, memory.dropped_bytes, memory.host_bytes)
        grads.fill_(3.0)
        params.add_(0)  # unchanged values, used
    memory.close()
    return facts


def test_copied_storages_come_back_dropped_ones_zeroed_where_asked(isolated):
    facts = isolated.run(release_and_regrow)
    for cycle in range(2):
        assert facts[f"released {cycle}"] == [0, 0, 0, 0]
        assert facts[f"regrown {cycle}"] == [24, 24]
        assert facts[f"params {cycle}"] and facts[f"view {cycle}"] and facts[f"grads {cycle}"]
        # Only the copied storage crosses, out and back; its host buffer (aligned) is kept.
        assert facts[f"figures {cycle}"] == (24, 24 + 10, 32)
    assert facts["copied 0"] == 24 and facts["copied 1"] == 24 * 3


def regrow_failing_at(k: int) -> dict:
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.model_memory import ModelMemory
    from megatron_offload.errors import DeviceMemoryError
    from tests.harness.faults import AllocationFaults

    params = torch.arange(12, dtype=torch.bfloat16)
    grads = torch.full((6,), 3.0)
    rebuilt = torch.ones(5, dtype=torch.bfloat16)
    memory = ModelMemory(CPUDevice(), name="wake()")
    memory.release([(params, True, False), (grads, False, True), (rebuilt, False, False)])
    facts = {}
    with AllocationFaults(fail_at=k):
        try:
            memory.regrow()
            facts["raised"] = None
        except DeviceMemoryError as error:
            facts["raised"] = str(error)
    sizes = [t.untyped_storage().nbytes() for t in (params, grads, rebuilt)]
    facts["after fault"] = sizes
    facts["released"] = memory.released
    memory.regrow()  # again, memory free
    facts["again"] = [t.untyped_storage().nbytes() for t in (params, grads, rebuilt)]
    facts["params"] = torch.equal(params, torch.arange(12, dtype=torch.bfloat16))
    facts["grads"] = torch.equal(grads, torch.zeros(6))
    memory.unregrow()  # undone: given up again, the host copy kept
    facts["unregrown"] = [t.untyped_storage().nbytes() for t in (params, grads, rebuilt)]
    memory.regrow()
    facts["params again"] = torch.equal(params, torch.arange(12, dtype=torch.bfloat16))
    memory.close()
    return facts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_regrow_that_fails_gives_back_what_it_regrew_and_works_again(isolated, k):
    facts = isolated.run(regrow_failing_at, k)
    assert "needed" in facts["raised"] and "call it again" in facts["raised"], facts["raised"]
    assert facts["after fault"] == [0, 0, 0] and facts["released"]
    assert facts["again"] == [24, 24, 10] and facts["params"] and facts["grads"]
    assert facts["unregrown"] == [0, 0, 0] and facts["params again"]


def reuse_across_sleeps() -> dict:
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.model_memory import ModelMemory

    device = CPUDevice()
    made = []
    host_buffer = device.host_buffer
    device.host_buffer = lambda n: made.append(n) or host_buffer(n)
    params = torch.arange(12, dtype=torch.bfloat16)
    memory = ModelMemory(device, name="wake()")
    for _ in range(3):
        memory.release([(params, True, False)])
        memory.regrow()
    other = torch.ones(4)
    memory.release([(params, True, False), (other, True, False)])  # another set: anew
    memory.regrow()
    memory.close()
    return {"made": made}


def test_the_host_buffer_is_kept_while_the_same_storages_are_copied(isolated):
    # One allocation (pinning, on a GPU) for three sleeps of the same storages, one more when
    # the set changes.
    assert isolated.run(reuse_across_sleeps)["made"] == [32, 48]
