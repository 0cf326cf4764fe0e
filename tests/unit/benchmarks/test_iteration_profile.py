"""The iteration profile's counting (``benchmarks.iteration_profile``): what it counts as ours."""

from benchmarks import iteration_profile
from megatron_offload.device import allocator
from megatron_offload_testing import allocator_model


def test_counts_named_functions_of_the_package_alone():
    def work():
        allocator.piece_bound(
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
        )  # settings, backend, ...
        allocator_model.round_size(1000)  # test machinery: not counted
        sorted([3, 1], key=lambda x: x)  # a lambda: not counted

    out = iteration_profile.count(iteration_profile.starts(work))
    names = {name for _, _, name, _ in out["table"]}
    assert names == {
        "piece_bound",
        "backend",
        "settings",
        "max_split_size",
        "splittable_piece_bytes",
    }
    assert out["files"] == 1 and out["functions"] == 5
    assert out["calls"] == sum(calls for *_, calls in out["table"]) == 6  # settings() twice
