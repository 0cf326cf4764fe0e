"""megatron-core's precision-aware optimizer path, offloaded, with the TE FusedAdam double.

``--use-precision-aware-optimizer`` with Transformer Engine's FusedAdam: bf16 parameters, the
fp32 master weights inside the optimizer state (``master_param``, or int16 remainders with
``store_param_remainders``), moments in fp32, bf16, fp16 or FP8 (``Float8Tensor``). megatron-core
0.19.2 takes this path for real here (the double is injected where megatron-core would have
imported TE; see ``tests/harness/doubles/megatron_injection.py``); ``attach`` offloads its states.

Every case trains the same run with and without offloading and compares losses, grad norms,
model parameters and every byte of optimizer state (FP8 data, transposes, scales, TE's
``_scales``, group steps). Between steps every per-element state buffer, found both through the
adapter and by walking the state independently, must hold no device memory.
"""

import pytest

from tests.harness import optimizer_jobs

# (remainders, exp_avg, exp_avg_sq, master, expected (kind, dtype) groups)
MATRIX = [
    pytest.param(remainders, moments, moments, "fp32", 2, id=f"remainders-{remainders}-{moments}")
    for remainders in (True, False)
    for moments in ("fp32", "bf16", "fp16", "fp8")
]
EXTRA = [
    # Moments of different dtypes: three groups (two for the moments, one for the masters).
    pytest.param(True, "bf16", "fp8", "fp32", 3, id="remainders-mixed-bf16-fp8"),
    # fp16 master weights (main_params_dtype=fp16): TE ignores store_param_remainders.
    pytest.param(True, "bf16", "bf16", "fp16", 2, id="fp16-master"),
]


def _pair(pool, model, dtype, steps, overrides, **kw):
    reference = pool.run(
        optimizer_jobs.train_job, "te", model, dtype, steps, False, overrides=overrides, **kw
    )
    offloaded = pool.run(
        optimizer_jobs.train_job, "te", model, dtype, steps, True, overrides=overrides, **kw
    )
    return reference, offloaded


def _check_layout(rank, remainders, exp_avg, exp_avg_sq, master):
    layout = rank["layout"]
    assert rank["classes"][-1] == "FusedAdam"  # the double, not torch's AdamW fallback
    assert layout["param_dtype"] == "torch.bfloat16"  # TE steps the bf16 shards themselves
    expected_master = (
        "torch.int16" if remainders and master == "fp32" else str(optimizer_jobs.DTYPES[master])
    )
    assert layout["master_param"][1] == expected_master
    for key, name in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if name == "fp8":
            assert layout[key][0] == "Float8Tensor" and layout[key][1] == "torch.float32"
            assert layout[key][3] == "torch.uint8"
        else:
            assert layout[key] == (
                "Tensor",
                str(optimizer_jobs.DTYPES[name]),
                optimizer_jobs.DTYPES[name].itemsize,
            )
    assert "step" not in layout  # TE keeps the step per group


@pytest.mark.parametrize("remainders,exp_avg,exp_avg_sq,master,groups", MATRIX + EXTRA)
def test_precision_aware_training_is_bitwise_identical_with_offloading(
    rank_pool, remainders, exp_avg, exp_avg_sq, master, groups
):
    overrides = optimizer_jobs.precision_aware(remainders, exp_avg, exp_avg_sq, master)
    reference, offloaded = _pair(rank_pool, "mlp", "bf16", 8, overrides)
    for rank in reference:
        _check_layout(rank, remainders, exp_avg, exp_avg_sq, master)
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    optimizer_jobs.assert_offloaded_between_steps(offloaded, groups=groups)


@pytest.mark.parametrize("line", ["2.12", "2.19"])
@pytest.mark.parametrize("moments", ["bf16", "fp8"])
def test_precision_aware_offloading_is_bitwise_in_the_other_te_lines(rank_pool, line, moments):
    """The matrix above runs the double's default line (2.13-2.18); here the others: 2.8-2.12
    (bf16 moments unscaled into fp32 temporaries) and 2.19+ (empty groups count steps)."""
    overrides = optimizer_jobs.precision_aware(True, moments)
    reference, offloaded = (
        rank_pool.run(
            optimizer_jobs.train_job, f"te@{line}", "mlp", "bf16", 6, offload, overrides=overrides
        )
        for offload in (False, True)
    )
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    optimizer_jobs.assert_offloaded_between_steps(offloaded, groups=2)


def test_gpt_with_overlapped_gather_fp8_moments_and_remainders(rank_pool):
    overrides = optimizer_jobs.precision_aware(True, "fp8")
    build = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000)
    reference, offloaded = _pair(rank_pool, "gpt", "bf16", 6, overrides, **build)
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    optimizer_jobs.assert_offloaded_between_steps(offloaded, groups=2)


def test_fp32_model_keeps_an_unused_master_copy_and_offloads_it(rank_pool):
    """fp32 params on the precision-aware path: TE still creates ``master_param`` (never
    updated; the kernel steps the fp32 param itself). It is dead weight on the device, so it
    is offloaded with the moments."""
    overrides = optimizer_jobs.precision_aware(True, "bf16")
    reference, offloaded = _pair(rank_pool, "mlp", "fp32", 5, overrides)
    layout = reference[0]["layout"]
    assert layout["param_dtype"] == "torch.float32"
    assert layout["master_param"][1] == "torch.float32"
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    optimizer_jobs.assert_offloaded_between_steps(offloaded, groups=2)


def test_moments_only_leave_the_masters_resident(rank_pool):
    overrides = optimizer_jobs.precision_aware(True, "fp8")
    reference = rank_pool.run(
        optimizer_jobs.train_job, "te", "mlp", "bf16", 5, False, overrides=overrides
    )
    offloaded = rank_pool.run(
        optimizer_jobs.train_job,
        "te",
        "mlp",
        "bf16",
        5,
        True,
        overrides=overrides,
        options={"offload_master_weights": False},
    )
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        last = rank["figures"][-1]
        census = rank["resident_census"]
        # Moments: 4 one-byte buffers per element (FP8 data and transpose, two moments);
        # masters: int16 remainders, 2 bytes per element, left on the device.
        assert last["resident_bytes"] == census["tensor_bytes"] // 3
        assert last["offloaded_bytes"] == 2 * last["resident_bytes"]


@pytest.mark.parametrize("moments", ["bf16", "fp8"])
def test_precision_aware_under_the_checked_stream_model(rank_pool, moments):
    """Side-stream copies deferred and fresh memory poisoned until its copy ran."""
    overrides = optimizer_jobs.precision_aware(True, moments)
    build = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=1000)
    reference, offloaded = _pair(rank_pool, "mlp", "bf16", 6, overrides, checked=True, **build)
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    optimizer_jobs.assert_offloaded_between_steps(offloaded, groups=2)
    for rank in offloaded:
        (calls,) = rank["checked_calls"]
        assert calls["use-after-h2d"] > 0 and calls["d2h-after-writers"] > 0


@pytest.mark.floor
def test_floor_smoke_precision_aware_fp8_remainders(rank_pool):
    """The same injection and path on the compatibility floor (megatron-core 0.16.1)."""
    overrides = optimizer_jobs.precision_aware(True, "fp8")
    reference, offloaded = _pair(rank_pool, "mlp", "bf16", 4, overrides)
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    optimizer_jobs.assert_offloaded_between_steps(offloaded, groups=2)


def test_fp16_model_with_skipped_steps(rank_pool):
    """fp16 params (TE ignores remainders for them: fp32 ``master_param``) with dynamic loss
    scaling tuned to overflow every other step: a skipped step copies nothing and leaves the
    states offloaded with their still-valid host copy."""
    overrides = dict(
        optimizer_jobs.precision_aware(True, "bf16"),
        initial_loss_scale=2.0**22,
        hysteresis=1,
        loss_scale_window=1,
    )
    # fp16 grads are refused as decoupled grads by megatron-core's clipping: reduce in fp32.
    reference, offloaded = _pair(rank_pool, "mlp", "fp16", 10, overrides, grad_reduce_in_fp32=True)
    layout = reference[0]["layout"]
    assert layout["param_dtype"] == "torch.float16"
    assert layout["master_param"][1] == "torch.float32"
    optimizer_jobs.assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        successes = [r["update_successful"] for r in rank["results"]]
        assert True in successes and False in successes[successes.index(True) :]
        seen_state = False
        for ok, fig in zip(successes, rank["figures"]):
            seen_state = seen_state or ok
            if not seen_state:
                assert fig["tracked_bytes"] == 0  # TE creates state in its first real step
                continue
            assert fig["offloaded_bytes"] == fig["tracked_bytes"] > 0
            assert fig["max_storage"] == 0 and fig["census_max_storage"] == 0
            if not ok:
                assert fig["d2h_copies"] == 0  # rule 6: nothing changed, nothing copied


def injection_job():
    import sys

    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.distrib_optimizer as mcore_distrib
    import megatron.core.optimizer.optimizer_config as mcore_config
    import torch

    from tests.harness.doubles import megatron_injection, te_fused_adam

    def globals_now():
        return (
            mcore_optimizer.Adam,
            mcore_optimizer.USING_PYTORCH_OPTIMIZER,
            mcore_optimizer.is_te_min_version,
            mcore_distrib.Adam,
            mcore_distrib.USING_TE_OPTIMIZER,
            mcore_distrib.HAVE_APEX_OR_TE,
            mcore_config.is_te_min_version,
            mcore_config.OptimizerConfig.__post_init__,
        )

    before = globals_now()
    inside = {}
    try:
        with megatron_injection.te_fused_adam_injected():
            inside["adam"] = mcore_optimizer.Adam is te_fused_adam.FusedAdam
            inside["te_imported"] = "transformer_engine" in sys.modules
            config = mcore_optimizer.OptimizerConfig(
                bf16=True,
                use_distributed_optimizer=True,
                use_precision_aware_optimizer=True,
                exp_avg_dtype=torch.uint8,
            )
            inside["remainders_kept"] = config.store_param_remainders  # TE >= 2.1 seen
            raise KeyError("leave the block by an exception")
    except KeyError:
        pass
    return {
        "restored": globals_now() == before,
        "inside": inside,
        "te_left_behind": any(name.startswith("transformer_engine") for name in sys.modules),
        "torch_adam": before[0].__module__.startswith("torch.optim"),
    }


def test_injection_is_undone_even_on_errors(rank_pool):
    for rank in rank_pool.run(injection_job):
        assert rank["inside"] == {"adam": True, "te_imported": False, "remainders_kept": True}
        assert rank["restored"] and not rank["te_left_behind"] and rank["torch_adam"]
