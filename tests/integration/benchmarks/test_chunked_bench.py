"""The chunked-update part of ``python -m benchmarks.offload_cycle``, on a small model.

Runs the benchmark's own job in the session's rank pool (both modes) and checks what the
benchmark reports: the footprint within the budget, below the whole state, and the two
runs bitwise equal; and that the target row judges it.
"""

from __future__ import annotations


def test_chunked_benchmark_figures(rank_pool):
    from benchmarks import chunked_bench, offload_cycle

    cfg = chunked_bench.job_config(layers=3, hidden=128, steps=4, fraction=0.25)
    whole = rank_pool.run(chunked_bench.chunked_job, {**cfg, "mode": "whole"})
    chunked = rank_pool.run(chunked_bench.chunked_job, {**cfg, "mode": "chunked"})
    result = chunked_bench.strip(
        {"whole": whole, "chunked": chunked, "bitwise": chunked_bench.bitwise(whole, chunked)}
    )
    assert result["bitwise"]
    for w, c in zip(result["whole"], result["chunked"]):
        assert w["budget"] is None and 0 < c["budget"] < c["state_bytes"]
        assert max(s["footprint"] for s in w["steps"]) >= w["state_bytes"]
        assert all(s["footprint"] <= c["budget"] for s in c["steps"])
        assert all(s["chunks"] >= 2 for s in c["steps"][1:])
    args = offload_cycle.parse_args(["--chunked-steps", "4"])
    rows = offload_cycle.targets({"chunked": result}, args)
    assert rows[-1][0].startswith("chunked update") and rows[-1][2] is True
