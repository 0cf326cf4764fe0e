"""An offload that meets an out-of-memory while it lays the states out again, or while it
releases tensors that share storages, injected at the boundary with torch and the OS
(``tests/harness/faults.py``: ``torch.empty`` and a storage's ``resize_`` on the device side,
the anonymous mappings the host buffers live in on the host side).

For every allocation the offload makes: it raises a ``DeviceMemoryError`` or a
``HostMemoryError`` that says to call it again; every host mapping made or given back is
counted so by ``stats()["host_bytes"]`` (a layout finished before the fault keeps its arena); no
piece is half released (each tensor has all its bytes or none); ``stats()`` counts as
resident exactly the bytes the raw storages hold; and the same offload made again lays out,
releases and brings back every value intact. Runs on the real CPU device (its host buffers are
those mappings) in the isolated process.
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_offload.engine import OffloadEngine

STATES = "optimizer_states"


def _values(seed, *sizes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def _resident_bytes(tensors) -> int:
    """What the raw storages hold (a storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _same_sign(a: int, b: int) -> bool:
    return (a > 0) == (b > 0) and (a < 0) == (b < 0)


def _whole_or_released(tensor) -> bool:
    """The tensor has all its bytes, or none: never a storage too short for it."""
    nbytes = tensor.untyped_storage().nbytes()
    return (
        nbytes == 0 or nbytes >= (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    )


def _new_layout(engine, device, tracked) -> list[torch.Tensor]:
    """Offloaded states, then new ones adopted from the host (the chunked update's first
    step) and a new resident one beside them: the next offload brings the host ones back,
    copies the adopted ones back, and lays everything out in a larger arena."""
    from tests.unit.engine.test_layout_changes import _adopted

    new, resident = _values(2, 5, 12), _values(3, 4)
    expected = [t.clone() for t in tracked + new + resident]
    engine.offload()
    engine.release()
    engine.adopted.add([_adopted(device, t) for t in new])
    tracked += new + resident
    return expected


def _shared(engine, device, tracked) -> list[torch.Tensor]:
    """The first offload of states that are views of one storage the optimizer keeps."""
    engine.base = torch.randn(40)  # the other owner of the storage
    tracked += [engine.base[:8], engine.base[8:20], engine.base[20:]]
    return [t.clone() for t in tracked]


SCENARIOS = {"new layout": _new_layout, "shared storages": _shared}


def run_offload_fault(scenario: str, fail_at: int | None) -> dict:
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.errors import DeviceMemoryError, HostMemoryError
    from tests.harness.faults import AllocationFaults, shared_mapping_bytes

    device = CPUDevice()
    tracked = _values(1, 8)
    engine = OffloadEngine(device, lambda: [(STATES, t) for t in tracked])
    expected = SCENARIOS[scenario](engine, device, tracked)
    # Mappings of earlier runs in this process that are garbage now must not be given back
    # inside the measured call.
    gc.collect()
    host_before, mapped_before = engine.stats()["host_bytes"], shared_mapping_bytes()
    out = {"raised": None}
    with AllocationFaults(fail_at, host=True) as faults:
        try:
            engine.offload(release=True)
        except (DeviceMemoryError, HostMemoryError) as error:
            out["raised"] = str(error)
    out["count"] = faults.count
    if out["raised"] is not None:
        stats = engine.stats()
        out["after"] = {
            # Host memory held or given back is counted so: an arena laid out before the
            # fault holds the copies made, and an adopted state copied back before it gave
            # its buffer back.
            "counted": _same_sign(
                shared_mapping_bytes() - mapped_before, stats["host_bytes"] - host_before
            ),
            "whole_or_released": all(_whole_or_released(t) for t in tracked),
            "resident_counted": stats["resident_bytes"] == _resident_bytes(tracked),
        }
        engine.offload(release=True)  # the same call, with the memory there
    out["released"] = all(t.untyped_storage().nbytes() == 0 for t in tracked)
    engine.reload()
    engine.wait()
    out["intact"] = all(torch.equal(t, e) for t, e in zip(tracked, expected, strict=True))
    engine.close()
    return out


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_an_offload_meeting_an_out_of_memory_holds_nothing_and_works_again(isolated, scenario):
    clean = isolated.run(run_offload_fault, scenario, None)
    assert clean["raised"] is None and clean["released"] and clean["intact"], clean
    assert clean["count"] >= 1, clean  # the offload allocates: there is something to fail
    for k in range(1, clean["count"] + 1):
        out = isolated.run(run_offload_fault, scenario, k)
        assert out["raised"] is not None, (k, out)
        assert "call it again" in out["raised"], out["raised"]
        assert all(out["after"].values()), (k, out)
        assert out["released"] and out["intact"], (k, out)
