"""HostBuffers: every host buffer beyond the arena (staging, the undo journal), carved in
order from few allocations, counted against the budget, given back once."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.engine import HostBudget, HostBuffers, HostMemoryBudgetError


class _Device:
    def __init__(self):
        self.allocated, self.freed = [], []

    def host_buffer(self, nbytes):
        self.allocated.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def free_host_buffer(self, buffer):
        self.freed.append(buffer.numel())


def test_carves_in_order_and_grows_by_at_least_all_before():
    device = _Device()
    buffers = HostBuffers(device)
    buffers.reserve(64)
    views = [buffers.take(16)[0] for _ in range(4)]
    assert device.allocated == [64] and buffers.carved == 64
    view, buffer = buffers.take(16)  # the first is full: a second, as large as all before
    assert device.allocated == [64, 64] and buffer.numel() == 64 and buffers.count == 2
    starts = sorted(v.data_ptr() for v in views + [view])
    assert all(b - a >= 16 for a, b in zip(starts, starts[1:]))
    buffers.take(48)  # fills the second
    buffers.take(10, hint=200)  # a hint larger than the rest: one buffer for it all
    assert device.allocated[-1] == 200


def test_rewinding_reuses_and_merges_several_buffers_into_one():
    device = _Device()
    buffers = HostBuffers(device)
    buffers.take(64)
    buffers.take(64)
    assert buffers.count == 2
    buffers.rewind()  # carve the same buffers again
    assert buffers.carved == 0 and buffers.count == 2 and device.freed == []
    buffers.rewind(merge_to=128)
    assert device.freed == [64, 64] and device.allocated[-1] == 128 and buffers.count == 1


def test_a_handed_over_buffer_is_counted_once_until_its_new_holder_gives_it_back():
    device = _Device()
    budget = HostBudget(100)
    buffers = HostBuffers(device, budget=budget, name="journal")
    _, buffer = buffers.take(64)
    with pytest.raises(HostMemoryBudgetError, match="journal"):
        buffers.take(64)  # 64 more would make 128 > 100
    buffers.hand_over([buffer])  # the engine gives it back from now on
    buffers.free()
    assert device.freed == [] and buffers.nbytes == 0
    assert budget.held == 64  # still held: by the engine now, counted once
    with pytest.raises(HostMemoryBudgetError):
        HostBuffers(device, budget=budget).take(100)
    budget.free(device, buffer)  # its new holder gives it back
    assert device.freed == [64] and budget.held == 0
    HostBuffers(device, budget=budget).take(100)  # the budget is free again
