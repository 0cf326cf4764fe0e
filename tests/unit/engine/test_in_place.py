"""In-place pieces: a tensor whose storage other tensors view (Megatron-FSDP's master buffer,
viewed by its optimizer's parameters) is released and regrown in that storage, never
re-pointed, so every view follows it through every cycle.

Runs on the checked stream-model device in the isolated process: a copy out of order raises.
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload.device.cpu import CPUDevice
from megatron_offload.engine import OffloadEngine
from megatron_offload.engine.pieces import ALIGN_BYTES

STATES, MASTERS = "optimizer_states", "master_weights"


def run_views_follow(in_place: bool, cycles: int = 3) -> dict:
    from megatron_offload_testing import CheckedDevice

    gen = torch.Generator().manual_seed(0)
    # 13 and 8 fp32 elements: one buffer of unaligned size (52 bytes), one aligned (32).
    buffers = [torch.randn(13, generator=gen), torch.randn(8, generator=gen)]
    views = [buffers[0][:5], buffers[0][5:], buffers[1][2:6]]  # taken once, as FSDP does
    moment = torch.randn(7, generator=gen)
    expected = [v.clone() for v in views] + [moment.clone()]
    device = CheckedDevice()
    engine = OffloadEngine(
        device,
        lambda: [(MASTERS, b) for b in buffers] + [(STATES, moment)],
        in_place=(lambda: buffers) if in_place else None,
    )
    released, followed = [], []
    for step in range(cycles):
        engine.offload()
        engine.release()
        released.append([b.untyped_storage().nbytes() for b in buffers + [moment]])
        engine.reload()
        engine.wait()
        device.note_compute()
        for tensor, value in zip(views + [moment], expected):
            tensor.add_(step + 1)  # the update, through the views
            value.add_(step + 1)
        followed.append(
            all(
                v.untyped_storage()._cdata == b.untyped_storage()._cdata
                for v, b in zip(views, (buffers[0], buffers[0], buffers[1]))
            )
        )
    engine.offload()
    engine.release()
    engine.reload()
    engine.wait()
    stats = engine.stats()
    out = {
        "released": released,
        "followed": followed,
        "intact": all(torch.equal(t, e) for t, e in zip(views + [moment], expected)),
        "pieces": [(p.kind, p.in_place, p.nbytes) for p in engine.pieces],
        "host_offsets_aligned": all(
            (p.host.data_ptr() - engine.pieces[0].host.data_ptr()) % ALIGN_BYTES == 0
            for p in engine.pieces
        ),
        "tracked_bytes": stats["tracked_bytes"],
        "host_bytes": stats["host_bytes"],
    }
    engine.close()
    device.check()
    return out


def test_a_viewed_buffer_is_released_and_regrown_in_its_own_storage(isolated):
    out = isolated.run(run_views_follow, True)
    # Between steps the buffers and the moment hold no memory; the views follow every cycle.
    assert out["released"] == [[0, 0, 0]] * 3, out
    assert all(out["followed"]) and out["intact"], out
    # One piece each, unpadded: 52 and 32 bytes; the moment's piece is padded as always.
    assert sorted(out["pieces"]) == [
        (MASTERS, True, 32),
        (MASTERS, True, 52),
        (STATES, False, 32),
    ], out
    # The host ranges stay aligned after the 52-byte piece (each range is padded).
    assert out["host_offsets_aligned"] and out["host_bytes"] == 32 + 64 + 32, out


def test_without_in_place_the_views_are_left_behind(isolated):
    """The control: consolidation re-points the buffers, and the views stay on the old
    memory, which the release cannot free and the update no longer reaches."""
    out = isolated.run(run_views_follow, False)
    assert not any(out["followed"]), out


def test_a_part_of_a_storage_is_refused_in_place():
    whole = torch.zeros(10)
    part = whole[2:]
    engine = OffloadEngine(
        CPUDevice(),
        lambda: [(MASTERS, part)],
        in_place=lambda: [part],
    )
    with pytest.raises(ValueError, match="cover its whole storage"):
        engine.offload()
    engine.close()
