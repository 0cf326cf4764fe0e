"""The chunked update's first step stages the new states in one host buffer, not one per tensor.

Every host buffer is pinned on an accelerator (a system call and page-table work each), so
the first step, where Adam creates the states of every parameter, must not ask the device
for a buffer per state tensor. Driven as in ``test_chunked_errors.py``, on the checked
device in the isolated process; results are compared bitwise with plain AdamW steps.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_offload.adapters import megatron_wrappers as adapter
from megatron_offload.chunked.update import ChunkedUpdate
from megatron_offload.engine import HostBuffers, OffloadEngine
from megatron_offload.phase import Phase
from megatron_offload_testing import CheckedDevice
from tests.harness.adamw_model import seeded_grads, two_group_adamw

STATES = "optimizer_states"
SIZES = (40, 7, 33, 16, 5, 24)


class CountingDevice(CheckedDevice):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.buffers: list[int] = []
        self.freed = 0

    def host_buffer(self, nbytes):
        self.buffers.append(nbytes)
        return super().host_buffer(nbytes)

    def free_host_buffer(self, buffer):
        self.freed += 1
        super().free_host_buffer(buffer)


def run_first_steps(steps=3, undo=False) -> dict:
    params, opt = two_group_adamw(SIZES)
    ref_params, ref_opt = two_group_adamw(SIZES)
    distrib = types.SimpleNamespace(optimizer=opt)
    device = CountingDevice()
    engine = OffloadEngine(
        device, lambda: adapter.collect(distrib), streamed=lambda: adapter.in_state(distrib)
    )
    chunked = ChunkedUpdate(
        engine, distrib, total_bytes=2 * 512, slots=2, kinds=(STATES,), undo=undo
    )
    chunked.install()
    at_attach = list(device.buffers)
    per_step = []
    for step in range(steps):
        seeded_grads(params, step)
        seeded_grads(ref_params, step)
        before = len(device.buffers)
        token = chunked.phase.enter(Phase.STEPPING)
        try:
            opt.step()
        finally:
            chunked.phase.leave(token)
        per_step.append(device.buffers[before:])
        ref_opt.step()
        engine.offload(skip_unchanged=True)
        engine.release()
    engine.reload()
    engine.wait()
    equal = all(torch.equal(a.detach(), b.detach()) for a, b in zip(params, ref_params))
    for p, r in zip(params, ref_params):
        for key in ("exp_avg", "exp_avg_sq"):
            equal = equal and torch.equal(opt.state[p][key], ref_opt.state[r][key])
    tensors = sum(len([k for k in opt.state[p] if k != "step"]) for p in params)
    engine.close()
    chunked.remove()
    device.check()
    return {
        "per_step": per_step,
        "equal": equal,
        "tensors": tensors,
        "freed": device.freed,
        "allocated": len(device.buffers),
        "undo_peak": chunked.undo.peak_bytes if undo else 0,
        "at_attach": at_attach,
    }


@pytest.mark.parametrize("undo", [False, True])
def test_the_first_step_stages_every_new_state_in_one_host_buffer(isolated, undo):
    out = isolated.run(run_first_steps, undo=undo)
    assert out["tensors"] == 2 * len(SIZES)
    # One staging buffer of exactly the new states (16-byte aligned each), not 12 buffers.
    itemsizes = [4 if i % 2 == 0 else 8 for i in range(len(SIZES))]
    staged = sum(2 * (-(-n * s // 16) * 16) for n, s in zip(SIZES, itemsizes))
    params = sum(-(-n * s // 16) * 16 for n, s in zip(SIZES, itemsizes))
    if undo:
        # The undo's copies: one buffer, pinned at attach (the states planned, the parameters,
        # room for each parameter's step count), none during the steps.
        assert out["at_attach"] == [staged + params + 128 * len(SIZES)]
        # Each later step saves the streamed states, the parameters and the step counts.
        assert out["undo_peak"] == staged + params + 16 * len(SIZES)
    else:
        assert out["at_attach"] == []
    assert out["per_step"][0] == [staged]
    assert out["per_step"][1:] == [[]] * (len(out["per_step"]) - 1)
    assert out["equal"]
    assert out["freed"] == out["allocated"]  # staging, undo and arena given back, each once


def test_staging_with_underestimated_sizes_needs_few_buffers():
    class Recorder:
        def __init__(self):
            self.sizes, self.freed = [], []

        def host_buffer(self, nbytes):
            self.sizes.append(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8)

        def free_host_buffer(self, buffer):
            self.freed.append(buffer.numel())

    device = Recorder()
    staging = HostBuffers(device)
    estimates = [16] * 64  # a lower bound: the states are 4x larger
    views = []
    for index in range(64):
        view, buffer = staging.take(64, hint=sum(estimates[index:]))
        views.append(view)
        staging.hand_over([buffer])
    assert len(device.sizes) <= 4 and sum(device.sizes) < 3 * 64 * 64
    assert all(v.numel() == 64 for v in views)
    starts = sorted(v.data_ptr() for v in views)
    assert all(b - a >= 64 for a, b in zip(starts, starts[1:]))  # no two views overlap
    # A failure before hand-over gives back only the buffer no adopted state lives in.
    staging.take(10_000, hint=16)
    staging.free()
    assert device.freed == [10_000]
