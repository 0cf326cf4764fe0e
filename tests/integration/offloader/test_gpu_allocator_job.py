"""The GPU allocator job's logic on a CPU rank (what the GPU variant runs on a GPU)."""

from __future__ import annotations

from tests.unit.offloader.test_gpu_allocator import (  # noqa: F401
    _allocator,
    _assert_pieces,
    _free_port,
    _run,
    _train,
    allocator_job,
)


def test_gpu_allocator_job_logic_runs_on_cpu():
    """The GPU job end to end on CPU ranks (small sizes, no allocator figures)."""
    out = _run(4 << 10, dry_run=True, hidden=64, layers=2)
    _assert_pieces(out, 4 << 10)
    assert out["returned"] is None and out["tracked"] > 0
