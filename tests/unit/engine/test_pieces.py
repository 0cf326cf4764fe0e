"""Bounded pieces: no device storage larger than ``max_piece_bytes``, each moved on its own.

Bodies that read state after a reload run in the isolated process (a bug there would touch
released memory, which crashes torch on CPU).
"""

import warnings

import pytest
import torch

from megatron_offload.device import CPUDevice
from megatron_offload.engine import OffloadEngine
from megatron_offload.engine.pieces import split_pieces
from tests.unit.engine.test_engine import MASTERS, STATES, Model, aligned

KIB = 1 << 10


# ------------------------------------------------------------------ the split itself
def test_split_pieces_bounds_each_piece_and_keeps_order():
    tensors = [torch.empty(n) for n in (100, 300, 50, 2000, 10, 10, 700)]  # fp32
    pieces = split_pieces(tensors, 4, 2 * KIB)
    assert [t for piece in pieces for t in piece] == tensors  # order kept, nothing lost
    for piece in pieces:
        # Within the bound, or a single tensor larger than it.
        assert sum(aligned(t) for t in piece) <= 2 * KIB or len(piece) == 1
    # 400+1200+208 bytes | 8000 (alone: larger than the bound) | 48+48 | 2800 (alone)
    assert [[t.numel() for t in piece] for piece in pieces] == [
        [100, 300, 50],
        [2000],
        [10, 10],
        [700],
    ]


def test_split_pieces_examples():
    def sizes(numels, bound):
        return [
            [t.numel() for t in piece]
            for piece in split_pieces([torch.empty(n) for n in numels], 4, bound)
        ]

    assert sizes([4, 4, 4], None) == [[4, 4, 4]]  # unbounded: one piece
    assert sizes([4, 4, 4], 32) == [[4, 4], [4]]  # 16 + 16 bytes fill a piece
    assert sizes([4, 100, 4], 32) == [[4], [100], [4]]  # the large one alone, never straddling
    assert sizes([5, 3], 32) == [[5], [3]]  # 5 fp32 take 32 bytes once aligned
    assert sizes([], 32) == []


# ------------------------------------------------------------- the engine with pieces
SIZES = (300, 40, 1000, 5, 260, 7, 600)  # fp32 elements: 1.2 KiB ... 4 KiB per tensor


def _pieces_job(max_piece_bytes, steps=5):
    """Offload on (in pieces) vs off, bitwise, with the figures of every cycle."""
    ref, off = Model(SIZES), Model(SIZES)
    engine = OffloadEngine(CPUDevice(), off.collect, max_piece_bytes=max_piece_bytes)
    figures = []
    for _ in range(steps):
        if engine.is_released():
            engine.reload()
            engine.wait()
        ref.step()
        engine.mark_dirty()
        off.step()
        engine.offload(release=True)
        stats = engine.stats()
        storages = {g.flat.untyped_storage()._cdata for g in engine.pieces if g.flat is not None}
        figures.append(
            {
                "pieces": stats["pieces"],
                "groups": sum(stats["pieces"].values()),
                "d2h": stats["d2h_copies"],
                "h2d": stats["h2d_copies"],
                "largest": stats["largest_piece_bytes"],
                "piece_bytes": [g.nbytes for g in engine.pieces],
                "flats": len(storages),
                "held": sum(t.untyped_storage().nbytes() for _, t in off.collect()),
                "offloaded": stats["offloaded_bytes"],
                "tracked": stats["tracked_bytes"],
            }
        )
    engine.reload()
    engine.wait()
    same = all(torch.equal(a, b) for a, b in zip(ref.snapshot(), off.snapshot()))
    return {"same": same, "figures": figures}


def test_pieces_are_bounded_bitwise_and_one_copy_each(isolated):
    out = isolated.run(_pieces_job, 2 * KIB)
    assert out["same"]
    for cycle, fig in enumerate(out["figures"]):
        assert fig["held"] == 0 and fig["offloaded"] == fig["tracked"]
        # Params (one fp32 group) and moments (one fp32 group) are both split.
        assert fig["pieces"][MASTERS] > 1 and fig["pieces"][STATES] > 1
        assert fig["groups"] == sum(fig["pieces"].values())
        for nbytes in fig["piece_bytes"]:  # within the bound, or one tensor larger than it
            assert nbytes <= 2 * KIB or nbytes in {aligned(n) for n in SIZES}
        if cycle >= 2:  # consolidated: one copy per piece and direction
            assert fig["d2h"] == fig["h2d"] == fig["groups"]
            assert fig["flats"] == fig["groups"]  # one device storage per piece
    # The unbounded layout: one storage per (kind, dtype), so 2 copies per direction.
    whole = isolated.run(_pieces_job, None)
    assert whole["same"]
    assert whole["figures"][-1]["d2h"] == whole["figures"][-1]["groups"] == 2
    # A whole group: the moments group holds exp_avg and exp_avg_sq of every parameter.
    assert whole["figures"][-1]["largest"] == 2 * sum(aligned(n) for n in SIZES)
    assert out["figures"][-1]["largest"] == aligned(max(SIZES))  # the largest single tensor


class _CallLog(CPUDevice):
    """A CPU device that logs the copies, records and releases the engine issues."""

    def __init__(self):
        super().__init__()
        self.log = []

    def copy(self, dst, src):
        self.log.append(("copy", None))
        super().copy(dst, src)

    def record_stream(self, tensor, stream, *, label=""):
        self.log.append(("record", None))

    def release(self, tensor):
        self.log.append(("release", None))
        super().release(tensor)


def _order_job(release_in_offload):
    model = Model(SIZES)
    device = _CallLog()
    engine = OffloadEngine(device, model.collect, max_piece_bytes=2 * KIB)
    for _ in range(3):  # consolidated from the second reload on
        if engine.is_released():
            engine.reload()
            engine.wait()
        model.step()
        engine.mark_dirty()
        device.log.clear()
        if release_in_offload:
            engine.offload(release=True)
        else:
            engine.offload()
            engine.release()
    return [kind for kind, _ in device.log], len(engine.pieces)


def test_each_piece_is_released_right_after_its_own_copy(isolated):
    """Progressive reuse: piece i is freed before piece i+1's copy is queued, so the
    allocator's record_stream event for it covers only its own copy."""
    order, pieces = isolated.run(_order_job, True)
    assert pieces > 2
    assert order == ["copy", "record", "release"] * pieces
    # Negative control: offload() then release() frees every piece after the last copy.
    order, pieces = isolated.run(_order_job, False)
    assert order == ["copy", "record"] * pieces + ["release"] * pieces


def _many_pieces_job():
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(10_001)]
    engine = OffloadEngine(CPUDevice(), lambda: ((MASTERS, p) for p in params), max_piece_bytes=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.offload(release=True)
    engine.reload()
    engine.wait()
    return [str(w.message) for w in caught], len(engine.pieces)


def test_a_bound_that_makes_too_many_copies_warns(isolated):
    messages, pieces = isolated.run(_many_pieces_job)
    assert pieces == 10_001
    assert any("10,001 pieces" in m and "max_piece_bytes" in m for m in messages), messages


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "256"])
def test_bad_max_piece_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="max_piece_bytes"):
        OffloadEngine(CPUDevice(), lambda: [], max_piece_bytes=bad)


def _release_refused_mid_offload_job():
    """A piece whose memory cannot be released (numpy() pinned it) stops offload(release=True)
    after earlier pieces were copied and released: nothing is lost, and the arena is not
    given back under a copy that is still queued."""
    from megatron_offload.engine import OffloadStateError
    from megatron_offload_testing import CheckedDevice

    ref, off = Model(SIZES), Model(SIZES)
    device = CheckedDevice()
    extra = []  # a tensor joining later makes the next offload lay the pieces out again
    engine = OffloadEngine(device, lambda: [*off.collect(), *extra], max_piece_bytes=2 * KIB)
    for _ in range(2):  # consolidated from the second reload on
        ref.step()
        engine.mark_dirty()
        device.note_compute()
        off.step()
        engine.offload(release=True)
        engine.reload()
        engine.wait()
    moments = [g for g in engine.pieces if g.kind == STATES]
    moments[-1].tensors[0].numpy()  # makes the last piece's storage non-resizable
    ref.step()
    engine.mark_dirty()
    device.note_compute()
    off.step()
    try:
        engine.offload(release=True)
        refused = None
    except OffloadStateError as exc:
        refused = str(exc)
    released = sum(g.place.value == "released" for g in engine.pieces)
    # A new layout replaces the host arena while the refused piece's copy may still be
    # queued: the old arena is given back only after that copy (rule 5).
    extra.append((MASTERS, torch.ones(5)))
    try:
        engine.offload(release=True)
    except OffloadStateError:
        pass  # the same piece is refused again, after the new layout was made
    engine.reload()
    engine.wait()
    same = all(torch.equal(a, b) for a, b in zip(ref.snapshot(), off.snapshot()))
    engine.close()  # gives the arena back: must wait for every copy still using it
    device.check()
    return refused, released, same


def test_a_release_refused_mid_offload_loses_nothing(isolated):
    refused, released, same = isolated.run(_release_refused_mid_offload_job)
    assert refused is not None and "non-resizable" in refused
    assert released > 0  # earlier pieces were already released when it stopped
    assert same
