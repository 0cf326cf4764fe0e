"""Layout changes while states are on the host: carried host copies and adopted tensors.

When new tensors appear (Adam's states of a parameter that got its first gradient), the engine
lays its groups out again in a new host arena. Groups whose only copy is on the host stay
released and their bytes move from the old arena to the new one; tensors a caller copied to
the host itself (``adopt``: the chunked update's first step) join them the same way. A group
that would mix host-only tensors with device tensors brings the host-only ones back first.
Scenarios run on the checked device in the isolated process.
"""

from __future__ import annotations

import torch

from megatron_offload.engine import OffloadEngine, labels
from megatron_offload_testing import CheckedDevice, ProtocolViolation

STATES, MASTERS = "optimizer_states", "master_weights"


def _values(seed, *sizes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def run_carry(skip_labels=()) -> dict:
    """Masters released with their D2H still queued; a new state appears: the rebuild reads
    the old arena on the host, so it must wait for that D2H first."""
    masters = _values(0, 6, 10)
    expected = [m.clone() for m in masters]
    moments = []
    device = CheckedDevice(skip_labels=skip_labels, raise_violations=False)
    engine = OffloadEngine(
        device, lambda: [(MASTERS, m) for m in masters] + [(STATES, m) for m in moments]
    )
    engine.offload([MASTERS])
    engine.release([MASTERS])
    pending = device.pending()
    moments.append(torch.ones(6))
    engine.offload([STATES])
    carried = engine.is_released([MASTERS]) and all(
        m.untyped_storage().nbytes() == 0 for m in masters
    )
    engine.release([STATES])
    engine.reload()
    engine.wait()
    intact = all(torch.equal(a, b) for a, b in zip(masters, expected)) and torch.equal(
        moments[0], torch.ones(6)
    )
    stats = engine.stats()
    engine.close()
    device.check(raise_on_violation=False)
    return {
        "pending_before": pending,
        "carried": carried,
        "intact": intact,
        "host_equals_tracked": stats["host_bytes"] == stats["tracked_bytes"],
        "violations": [(v.rule, v.kind) for v in device.violations],
    }


def test_released_groups_are_carried_to_the_new_arena(isolated):
    out = isolated.run(run_carry)
    assert out["pending_before"] > 0  # the D2H was still queued when the layout changed
    assert out["carried"] and out["intact"] and out["host_equals_tracked"]
    assert out["violations"] == []


def test_carrying_without_waiting_for_the_d2h_reads_garbage(isolated):
    """Negative control: the host reads the old arena before the D2H filled it."""
    out = isolated.run(run_carry, skip_labels=(labels.HOST_READ_AFTER_D2H,))
    assert out["carried"] and not out["intact"]


def _adopted(device, tensor):
    """What the chunked update does with a new state: copy it to a host buffer on a side
    stream, tell the allocator, release its device memory."""
    side = device.new_stream()
    buffer = device.host_buffer(tensor.numel() * tensor.element_size())
    device.wait_stream(side, device.current_stream(), label=labels.D2H_AFTER_WRITERS)
    with device.use_stream(side):
        device.copy(buffer.view(tensor.dtype), tensor)
        event = device.record_event(side)
    device.record_stream(tensor, side, label=labels.D2H_RECORD_STREAM)
    device.release(tensor)
    return tensor, buffer, event


def run_adopt(mixed: bool) -> dict:
    """New states adopted from the host. ``mixed``: a resident state of the same kind and
    dtype appears with them, so their group cannot stay released: they come back first."""
    old = _values(1, 8)
    new = _values(2, 5, 12)
    resident = _values(3, 4) if mixed else []
    expected = [t.clone() for t in old + new + resident]
    tracked = list(old)
    device = CheckedDevice()
    raised = None
    try:
        engine = OffloadEngine(device, lambda: [(STATES, t) for t in tracked])
        engine.offload()
        engine.release()
        engine.adopted.add([_adopted(device, t) for t in new])
        tracked += new + resident
        engine.offload()  # the rescan builds the new layout
        released_after_rescan = engine.is_released()
        groups = len(engine.pieces)
        engine.release()
        engine.reload()
        engine.wait()
        intact = all(torch.equal(a, b) for a, b in zip(tracked, expected))
        engine.close()
        device.check()
    except ProtocolViolation as exc:
        raised = (exc.rule, exc.kind)
        intact = released_after_rescan = groups = None
    return {
        "raised": raised,
        "intact": intact,
        "released_after_rescan": released_after_rescan,
        "groups": groups,
    }


def test_adopted_tensors_join_released_groups(isolated):
    out = isolated.run(run_adopt, False)
    assert out == {"raised": None, "intact": True, "released_after_rescan": True, "groups": 1}


def test_adopted_tensors_beside_a_device_tensor_come_back_first(isolated):
    out = isolated.run(run_adopt, True)
    assert out["raised"] is None and out["intact"] and out["groups"] == 1
