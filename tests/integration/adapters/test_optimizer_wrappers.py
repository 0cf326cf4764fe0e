"""Adam without the distributed optimizer: Float16OptimizerWithFloat16Params and FP32Optimizer.

What megatron-core builds without ``--use-distributed-optimizer``: a ChainedOptimizer of
``Float16OptimizerWithFloat16Params`` (bf16/fp16 models; fp32 masters of the whole bf16
parameters in ``fp32_from_float16_groups``) or of ``FP32Optimizer`` (fp32 models: no masters,
the optimizer updates the model's parameters). Every rank holds the whole state. Training
with offloading must be bitwise that of training without it, with no state byte on the device
between steps; on the real megatron-core, on gloo CPU ranks (the shared rank pool).
"""

import pytest

from tests.harness.compare import assert_bitwise_equal
from tests.integration.offloader.test_attach_megatron import (
    assert_offloaded_between_steps,
    train_job,
)


def classes_job(model, dtype, **build_kw):
    from tests.harness import models

    _, optimizer, _ = models.build(model, dtype, **build_kw)
    return models.optimizer_classes(optimizer)


CASES = [
    # model, dtype, wrapper megatron-core builds, masters offloaded
    ("mlp", "bf16", "Float16OptimizerWithFloat16Params", True),
    ("mlp", "fp32", "FP32Optimizer", False),
    ("gpt", "bf16", "Float16OptimizerWithFloat16Params", True),
    ("gpt", "fp32", "FP32Optimizer", False),
]


@pytest.mark.parametrize("model,dtype,wrapper,masters", CASES)
def test_adam_without_distributed_optimizer_is_bitwise_identical(
    rank_pool, model, dtype, wrapper, masters, reference_run
):
    build = dict(use_distributed_optimizer=False)
    assert rank_pool.run(classes_job, model, dtype, **build)[0] == [
        "ChainedOptimizer",
        wrapper,
        "AdamW",
    ]
    reference = reference_run(train_job, model, dtype, 5, False, **build)
    offloaded = rank_pool.run(train_job, model, dtype, 5, True, **build)
    assert_bitwise_equal(reference, offloaded)
    assert_offloaded_between_steps(offloaded, expect_masters=masters)
    for rank in offloaded:
        # Each rank holds the whole model's states (no sharding): 2 moments (+ master) of
        # 4 bytes per parameter, nothing else.
        assert rank["figures"][-1]["tracked_bytes"] >= (12 if masters else 8) * rank["numel"]


def test_fp16_skipped_steps_without_distributed_optimizer(rank_pool, reference_run):
    """fp16 with the dynamic loss scaler: the first steps overflow and are skipped, before
    and after the states exist; the host copies stay valid and nothing is copied then."""
    build = dict(
        use_distributed_optimizer=False,
        optimizer_overrides={"initial_loss_scale": 2.0**24, "hysteresis": 1},
    )
    reference = reference_run(train_job, "mlp", "fp16", 6, False, **build)
    offloaded = rank_pool.run(train_job, "mlp", "fp16", 6, True, **build)
    assert_bitwise_equal(reference, offloaded)
    skipped = [not r["update_successful"] for r in reference[0]["results"]]
    assert skipped[0] and not all(skipped)  # a real mix of skipped and taken steps
    for rank in offloaded:
        for step, figures in enumerate(rank["figures"]):
            if skipped[step] and step > 0 and skipped[step - 1]:
                assert figures["d2h_copies"] == 0  # nothing changed, nothing copied


def test_moe_chain_of_float16_optimizers(rank_pool, reference_run):
    """Expert parallelism without the distributed optimizer: a ChainedOptimizer of two
    Float16OptimizerWithFloat16Params (dense and expert parameters), one engine each."""
    build = dict(
        use_distributed_optimizer=False,
        transformer_overrides=dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="allgather",
            expert_model_parallel_size=2,
        ),
    )
    classes = rank_pool.run(classes_job, "gpt", "bf16", ep=2, **build)[0]
    assert classes == ["ChainedOptimizer"] + ["Float16OptimizerWithFloat16Params", "AdamW"] * 2
    reference = reference_run(train_job, "gpt", "bf16", 4, False, ep=2, **build)
    offloaded = rank_pool.run(train_job, "gpt", "bf16", 4, True, ep=2, **build)
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        last = rank["figures"][-1]
        assert last["offloaded_bytes"] == last["tracked_bytes"] > 0 and last["max_storage"] == 0
        assert last["d2h_copies"] == 4  # (moments, masters) x 2 optimizers, one piece each


def sgd_with_distributed_optimizer_job():
    from tests.harness import models

    try:
        models.build("mlp", "bf16", optimizer="sgd")
    except AssertionError as error:
        return str(error)
    return None


def test_sgd_momentum_buffer_without_distributed_optimizer(rank_pool, reference_run):
    """torch SGD's momentum_buffer is found in the state like any moment; with the
    distributed optimizer megatron-core refuses SGD itself (--offload-optimizer-states lets
    that refusal stand)."""
    build = dict(use_distributed_optimizer=False, optimizer="sgd")
    assert rank_pool.run(classes_job, "mlp", "bf16", **build)[0] == [
        "ChainedOptimizer",
        "Float16OptimizerWithFloat16Params",
        "SGD",
    ]
    reference = reference_run(train_job, "mlp", "bf16", 4, False, **build)
    offloaded = rank_pool.run(train_job, "mlp", "bf16", 4, True, **build)
    assert_bitwise_equal(reference, offloaded)
    assert_offloaded_between_steps(offloaded, expect_masters=True)
    assert any(key[-1] == "momentum_buffer" for key in offloaded[0]["snapshot"]["optimizer"])
    refusal = rank_pool.run(sgd_with_distributed_optimizer_job)[0]
    assert refusal is not None and "init_state_fn" in refusal


# The same phases as Lion, Muon and SOAP get (test_emerging_optimizers.py), for Adam without
# the distributed optimizer on the bf16 GPT: its job builds optimizer="adam" without the
# distributed optimizer and needs no emerging-optimizers package.
ADAM_CHUNK_BYTES = 2 * 140_000  # two slots of the largest matrix's moments ([256, 64]: 128 KiB)


def test_adam_without_distributed_optimizer_skipped_step_rl_phase_checked_device(
    rank_pool, reference_run
):
    from tests.integration.adapters.test_emerging_optimizers import (
        _assert_offloaded_between_steps,
        emerging_job,
    )

    reference = reference_run(emerging_job, "adam", 5, False, skip_at=3, rl_at=1)
    offloaded = rank_pool.run(emerging_job, "adam", 5, True, skip_at=3, rl_at=1, checked=True)
    assert_bitwise_equal(reference, offloaded)
    updated = [r["update_successful"] for r in reference[0]["results"]]
    assert updated == [step != 3 for step in range(5)]  # all but the skipped step
    _assert_offloaded_between_steps(offloaded)
    for rank in offloaded:
        assert rank["classes"] == ["Float16OptimizerWithFloat16Params/AdamW"]
        assert rank["checked"] == 1  # one checked device, for its one engine
        assert rank["figures"][3]["d2h_copies"] == 0  # the skipped step copied nothing
        assert rank["rl"] == {
            "block_offloaded": True,
            "back_after_block": True,
            "offload_to_cpu_routed": True,
            "restored": True,
        }


def test_adam_without_distributed_optimizer_chunked_update(rank_pool, reference_run):
    from tests.integration.adapters.test_emerging_optimizers import (
        _assert_offloaded_between_steps,
        emerging_job,
    )

    reference = reference_run(emerging_job, "adam", 4, False)
    offloaded = rank_pool.run(
        emerging_job,
        "adam",
        4,
        True,
        options={"chunked_update_bytes": ADAM_CHUNK_BYTES},
        checked=True,
    )
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(offloaded, chunked=True)
    for rank in offloaded:
        assert rank["checked"] == 1 and rank["update_chunks"] >= 3
