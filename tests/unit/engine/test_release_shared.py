"""The first release of tensors whose storages something else shares (``groups.release_separate_storages``).

Views of one buffer taken before offloading (or a storage another tensor still holds) cannot
be freed: the other owners would dangle. The engine points its tensors away from them, at
memory it then frees. That memory exists only because ``Tensor.set_`` needs it: one scratch
storage as large as the largest such tensor serves them all, not one block per tensor (on
an accelerator each is an allocation at the moment memory is meant to be given back).
Checked on the checked device (every ordering call verified), bitwise, in the isolated
process.
"""

from __future__ import annotations

import torch

from megatron_offload.engine import OffloadEngine
from megatron_offload_testing import CheckedDevice

STATES = "optimizer_states"


class CountingDevice(CheckedDevice):
    """Counts the device allocations ``empty`` makes, and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[int] = []

    def empty(self, numel, dtype):
        tensor = super().empty(numel, dtype)
        self.allocations.append(tensor.numel() * tensor.element_size())
        return tensor


def run_shared_release() -> dict:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(100, generator=gen)
    views = [base[0:30], base[30:45], base[45:100]]  # one storage, shared by three states
    held = torch.randn(20, generator=gen)
    keeper = held.view(4, 5)  # another tensor holds this state's storage
    own = torch.randn(7, generator=gen)  # owns its storage: released as it is
    tensors = views + [held, own]
    expected = [t.clone() for t in tensors]
    device = CountingDevice()
    engine = OffloadEngine(device, lambda: [(STATES, t) for t in tensors])
    engine.offload(release=True)
    allocations = list(device.allocations)
    released = [t.untyped_storage().nbytes() == 0 for t in tensors]
    others_alive = (
        base.untyped_storage().nbytes() == 400 and keeper.untyped_storage().nbytes() == 80
    )
    others_intact = torch.equal(base[0:30], expected[0]) and torch.equal(
        keeper.reshape(-1), expected[3]
    )
    unreleasable = engine.stats()["unreleasable_bytes"]
    engine.reload()
    engine.wait()
    intact = [torch.equal(t, e) for t, e in zip(tensors, expected)]
    engine.close()
    device.check()
    return {
        "allocations": allocations,
        "released": released,
        "others_alive": others_alive,
        "others_intact": others_intact,
        "unreleasable": unreleasable,
        "intact": intact,
    }


def test_shared_storages_are_left_through_one_scratch_allocation(isolated):
    out = isolated.run(run_shared_release)
    assert all(out["released"]), out  # every tracked tensor holds no memory
    assert out["others_alive"] and out["others_intact"]  # the other owners keep theirs, unchanged
    assert out["unreleasable"] == 400 + 80  # and that memory is reported, not lost silently
    assert all(out["intact"])  # the states come back bitwise
    # One allocation, as large as the largest of the four tensors pointed away (55 floats),
    # not one per tensor.
    assert out["allocations"] == [55 * 4], out["allocations"]


def run_retired_streams(scenario: str, honest: bool = True) -> dict:
    """Attach, cycle, close; then what the checked device saw when the engine retired its
    side streams. ``honest=False``: the engine's ``retire_stream`` calls all say
    ``announced=False`` (the gap this guards: streams destroyed under a live record)."""
    from megatron_offload_testing import RECORDED_ON_RETIRED_STREAM

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(100, generator=gen)
    views = [base[0:30], base[30:100]]  # another owner (``base``) keeps their storage
    own = [torch.randn(40, generator=gen), torch.randn(9, generator=gen)]
    tensors = views if scenario == "shared" else own
    device = CheckedDevice(raise_violations=False)
    if not honest:
        retire = device.retire_stream
        device.retire_stream = lambda stream, *, announced: retire(stream, announced=False)
    engine = OffloadEngine(device, lambda: [(STATES, t) for t in tensors])
    if scenario == "shared":  # the first release points the views away from ``base``
        engine.offload(release=True)
        engine.reload()
    elif scenario == "kept":  # offloaded, never released: the storages stay with the owner
        engine.offload()
        engine.reload()
    else:  # "released": every announced block was freed by the engine itself
        engine.offload(release=True)
        engine.reload()
        engine.wait()
        engine.offload(release=True)
        engine.reload()
    engine.wait()
    engine.close()
    device.check(raise_on_violation=False)
    return {
        "retired": sorted(device.retired.values()),
        "violations": [v.kind for v in device.violations],
        "kind": RECORDED_ON_RETIRED_STREAM,
        "base_alive": base.untyped_storage().nbytes() == 400,
    }


def test_a_side_stream_named_by_live_memory_is_kept_when_the_engine_closes(isolated):
    """After ``close`` (``detach``) a storage another owner keeps, or states offloaded and
    never released, still name the D2H stream in their ``record_stream`` set; the allocator
    records an event on it when they are freed. The engine retires that stream as announced
    (kept for the process's life); a stream no live memory names may be destroyed."""
    for scenario in ("shared", "kept"):
        out = isolated.run(run_retired_streams, scenario)
        assert out["violations"] == [], (scenario, out)
        assert out["retired"].count(True) == 1, (scenario, out)  # d2h kept (h2d, if any, not)
        control = isolated.run(run_retired_streams, scenario, honest=False)
        assert control["violations"] == [control["kind"]], (scenario, control)
    released = isolated.run(run_retired_streams, "released")
    assert released["violations"] == [] and released["retired"] == [False, False], released
