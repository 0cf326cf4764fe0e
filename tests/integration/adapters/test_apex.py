"""apex FusedAdam (megatron-core's second choice) under ``attach``, with the apex double.

apex creates ``exp_avg``/``exp_avg_sq`` only for parameters that have a gradient at a step, so
states can appear in the middle of a run; a parameter that never had a gradient has none. The
offloader must pick new states up at the next offload and train bitwise like the run without it.
"""

import pytest

from tests.harness import optimizer_jobs

DROP = {0: 3, 2: 1}  # inner params 0 and 2 get no gradient in the first 3 / 1 steps


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_apex_training_is_bitwise_identical_with_offloading(rank_pool, dtype):
    kw = dict(drop_grads=DROP)
    reference = rank_pool.run(optimizer_jobs.train_job, "apex", "mlp", dtype, 6, False, **kw)
    offloaded = rank_pool.run(optimizer_jobs.train_job, "apex", "mlp", dtype, 6, True, **kw)
    for rank in reference:
        assert rank["classes"][-1] == "FusedAdam"
        assert rank["layout"]["param_dtype"] == "torch.float32"  # apex steps fp32 shards
        # State appears with the first gradient.
        states = rank["state_params"]
        assert 0 not in states[0] and 2 not in states[0] and 1 in states[0]
        assert 2 in states[1] and 0 not in states[2] and 0 in states[3]
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        figures = rank["figures"]
        # What was offloaded grew as states appeared, and all of it was always offloaded.
        assert figures[0]["tracked_bytes"] < figures[-1]["tracked_bytes"]
        for fig in figures:
            assert fig["offloaded_bytes"] == fig["tracked_bytes"]
            assert fig["kept_resident_bytes"] == 0 and fig["max_storage"] == 0
            assert fig["census_max_storage"] == 0
        groups = 2 if dtype == "bf16" else 1  # fp32 masters exist only for bf16 models
        assert figures[-1]["d2h_copies"] == groups
