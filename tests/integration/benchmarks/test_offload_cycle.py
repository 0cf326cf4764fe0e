"""The offload cycle's targets with the real offloader on megatron-core's optimizers (gloo ranks): copies and host bytes independent of the parameter count, bookkeeping under 1 ms."""

from __future__ import annotations

import pytest

from tests.unit.benchmarks.test_offload_cycle import BOOKKEEPING_S, HOST_RATIO, _load  # noqa: F401


# ----------------------------------------------------------- the real DistributedOptimizer
@pytest.fixture(scope="module")
def offloader_scaling(rank_pool):
    """200 and 2,000 parameter tensors (tiny MLPs), every rank holding a shard of each."""
    from benchmarks.megatron_bench import scaling_config, scaling_job

    cfg = scaling_config(layers=[50, 500], cycles=20)
    return rank_pool.run(scaling_job, cfg, tp=rank_pool.world_size)


def test_offloader_copies_do_not_grow_with_ten_times_the_parameters(offloader_scaling):
    for rank, (small, large) in enumerate(offloader_scaling):
        assert (small["model_param_tensors"], large["model_param_tensors"]) == (200, 2000)
        assert large["layout"]["tensors"] == 10 * small["layout"]["tensors"]
        assert (small["d2h_copies"], small["h2d_copies"]) == (
            large["d2h_copies"],
            large["h2d_copies"],
        ), rank
        assert small["d2h_copies"] > 0


def test_offloader_host_bytes_match_the_offloaded_bytes(offloader_scaling):
    for runs in offloader_scaling:
        for run in runs:
            assert run["layout"]["device_bytes_held"] == 0
            assert run["layout"]["host_ratio"] <= HOST_RATIO, run["layout"]


@pytest.mark.perf
def test_offloader_bookkeeping_is_under_1ms_for_2000_parameter_tensors(offloader_scaling):
    # Timed with torch function modes off: the harness's CUDA-on-CPU mode intercepts every
    # torch call on CPU ranks, which no real training process has (scaling_job keeps the
    # as-run figure for comparison).
    for rank, (_small, large) in enumerate(offloader_scaling):
        median = large["bookkeeping"]["no_function_mode"]["median"]
        assert median < BOOKKEEPING_S, (
            f"rank {rank}: {median * 1e3:.3f} ms per cycle for {large['optimizer_shards']} shards "
            f"({large['layout']['tensors']} tensors); {_load()}"
        )
