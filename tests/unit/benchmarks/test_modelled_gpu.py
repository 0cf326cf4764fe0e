"""The modelled-GPU section of the benchmark: memory reusable after the step, per layout.

A small run of the same code (an 8 GB state of 60 tensors, modelled; one link): the targets
the benchmark reports for 20 GB must hold here too, and the peer layouts must show why they
are the peers (everything reusable only at the end; a stall of the next forward pass).
"""

import pytest

from benchmarks import modelled_gpu

GB = modelled_gpu.GB


@pytest.fixture(scope="module")
def rows():
    return {
        r["layout"]: r for r in modelled_gpu.run(links=(25 * GB,), state_bytes=8 * GB, tensors=60)
    }


def test_pieces_free_memory_progressively_at_link_speed(rows):
    pieces = rows["pieces"]
    assert pieces["bytes"] == pytest.approx(8 * GB, rel=0.01)
    assert pieces["full_ratio"] <= 1.05 and pieces["half_ratio"] <= 0.55
    assert pieces["full_ratio"] >= 1.0 - 1e-9  # nothing beats the link
    assert pieces["stalls"] == 0 and not pieces["oom"]
    # Copies are bounded by the bytes, not by the tensor count: two neighbouring pieces hold
    # more than one piece's bound together, so there are at most 2 x bytes / bound + 1.
    assert 1 < pieces["copies"] <= 2 * pieces["bytes"] // modelled_gpu.PIECE + 1


def test_peer_layouts_free_everything_only_at_the_end_and_stall(rows):
    for layout in ("one block", "per tensor"):
        row = rows[layout]
        assert row["half_ratio"] == pytest.approx(1.0, abs=0.01), layout  # nothing before the end
        assert row["stalls"] >= 1 or row["oom"], layout
    assert rows["one block"]["copies"] == 1
    assert rows["per tensor"]["copies"] == 60


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        modelled_gpu.measure("scattered", 25 * GB)
