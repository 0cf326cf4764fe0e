"""``ModelMemory`` (the model's storages given up while asleep) and the parameter
fingerprint a sleep compares, on the CPU device. Storages are released, so the bodies run in
the isolated process."""

from __future__ import annotations

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
    memory = ModelMemory(device)
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
        # Only the copied storage crosses, out and back; its host buffer is kept.
        assert facts[f"figures {cycle}"] == (24, 24 + 10, 24)
    assert facts["copied 0"] == 24 and facts["copied 1"] == 24 * 3


def test_the_fingerprint_sees_any_change_of_bits_or_places():
    from megatron_offload.offloader.sleep import fingerprint

    torch.manual_seed(0)
    shards = [torch.randn(3000, dtype=torch.bfloat16), torch.randn(17, dtype=torch.bfloat16)]
    base = fingerprint(shards)
    assert base == fingerprint([s.clone() for s in shards])
    assert base != fingerprint(list(reversed(shards)))
    flipped = shards[0].clone()
    flipped.view(torch.int16)[1234] ^= 1  # the lowest bit of one element
    assert base != fingerprint([flipped, shards[1]])
    swapped = shards[0].clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert shards[0][10] != shards[0][11] and base != fingerprint([swapped, shards[1]])
    big = torch.randn((1 << 20) + 5, dtype=torch.bfloat16)  # over one chunk
    assert fingerprint([big]) != fingerprint([big[:-1]])
    assert fingerprint([]) == (0, 0)
