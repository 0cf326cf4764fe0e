"""attach() on the real megatron-core DDP + DistributedOptimizer, on gloo CPU ranks.

Every comparison is bitwise: the same training run with and without offloading must give
identical losses, grad norms, parameters and optimizer state. Jobs run in the shared rank
pool (separate processes), so a bug touching released memory fails the test instead of
crashing pytest.
"""

import pytest
import torch

from tests.harness.compare import assert_bitwise_equal
from tests.harness.optimizer_jobs import STATS_KEYS


# ------------------------------------------------------------------- rank-side jobs
def _tracked_storage_bytes(offloader):
    from megatron_offload.adapters import megatron_wrappers as adapter

    kinds = set(offloader.config.kinds())
    sizes = []
    for distrib_optimizer in (member.optimizer for member in offloader.members):
        for kind, tensor in adapter.collect(distrib_optimizer):
            if kind in kinds:
                sizes.append(tensor.untyped_storage().nbytes())
    return sizes


def train_job(
    model,
    dtype,
    steps,
    offload,
    micro_batches=1,
    offload_before_first_step=False,
    options=None,
    checked=False,
    attach_at=0,
    **build_kw,
):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build(model, dtype, **build_kw)
    from tests.harness.checked import check_devices, checked_device_options

    devices = []
    if checked:  # the stream-model device: every ordering mistake raises
        options, devices = checked_device_options(options)
    results = [models.train_step(chunks, optimizer, config, s) for s in range(attach_at)]
    offloader = megatron_offload.attach(optimizer, **(options or {})) if offload else None
    figures = []
    if offloader and attach_at:
        figures.append(
            {"at_attach": True, **_figures(offloader, _tracked_storage_bytes(offloader))}
        )
    if offloader and offload_before_first_step:
        offloader.offload()
        sizes = _tracked_storage_bytes(offloader)
        figures.append({"before_first_step": True, **_figures(offloader, sizes)})
    for step in range(attach_at, steps):
        results.append(models.train_step(chunks, optimizer, config, step, micro_batches))
        if offloader:
            figures.append(_figures(offloader, _tracked_storage_bytes(offloader)))
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    check_devices(devices)
    numel = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return {
        "results": results,
        "figures": figures,
        "snapshot": snapshot,
        "checked_calls": [dict(d.calls) for d in devices],
        "numel": numel,
    }


def _figures(offloader, sizes):
    stats = offloader.stats()
    return {
        **{k: stats[k] for k in STATS_KEYS},
        "tensors": len(sizes),
        "max_storage": max(sizes, default=0),
    }


# ------------------------------------------------------------------- comparisons


def assert_offloaded_between_steps(offloaded, expect_masters):
    for rank in offloaded:
        for figures in rank["figures"]:
            assert figures["tracked_bytes"] > 0
            assert figures["offloaded_bytes"] == figures["tracked_bytes"]
            assert figures["resident_bytes"] == 0 and figures["kept_resident_bytes"] == 0
            assert figures["max_storage"] == 0  # every moment and master holds no memory
            assert figures["host_bytes"] == figures["tracked_bytes"]  # no rounding waste
        last = rank["figures"][-1]
        # Steady state: one copy per (kind, dtype) group and direction, whatever the size.
        groups = 2 if expect_masters else 1
        assert last["d2h_copies"] == groups and last["h2d_copies"] == groups


CASES = [
    # model, dtype, overlap_grad_reduce, overlap_param_gather, bucket_size
    ("mlp", "fp32", False, False, None),
    ("mlp", "bf16", False, False, None),
    ("mlp", "fp32", True, False, 1000),
    ("mlp", "bf16", True, False, 1000),
    ("mlp", "fp32", True, True, 1000),
    ("mlp", "bf16", True, True, 1000),
    ("gpt", "fp32", True, True, 3000),
    ("gpt", "bf16", False, False, None),
    ("gpt", "bf16", True, True, 3000),
]


def _run_pair(pool, model, dtype, ogr, opg, bucket, steps=10, **kw):
    build = dict(overlap_grad_reduce=ogr, overlap_param_gather=opg, bucket_size=bucket)
    reference = pool.run(train_job, model, dtype, steps, False, **build, **kw)
    offloaded = pool.run(train_job, model, dtype, steps, True, **build, **kw)
    return reference, offloaded


@pytest.mark.parametrize("model,dtype,ogr,opg,bucket", CASES)
def test_dp2_training_is_bitwise_identical_with_offloading(
    rank_pool, model, dtype, ogr, opg, bucket
):
    reference, offloaded = _run_pair(rank_pool, model, dtype, ogr, opg, bucket)
    assert_bitwise_equal(reference, offloaded)
    assert_offloaded_between_steps(offloaded, expect_masters=dtype == "bf16")


@pytest.mark.parametrize(
    "model,dtype,ogr,opg,bucket",
    [
        ("mlp", "bf16", True, True, 1000),
        ("gpt", "bf16", True, False, 3000),
        ("gpt", "fp32", False, False, None),
    ],
)
def test_dp4_training_is_bitwise_identical_with_offloading(
    rank_pool4, model, dtype, ogr, opg, bucket
):
    reference, offloaded = _run_pair(rank_pool4, model, dtype, ogr, opg, bucket)
    assert_bitwise_equal(reference, offloaded)
    assert_offloaded_between_steps(offloaded, expect_masters=dtype == "bf16")


@pytest.mark.floor
def test_floor_smoke_mlp_bf16(rank_pool):
    reference, offloaded = _run_pair(rank_pool, "mlp", "bf16", True, False, 1000, steps=4)
    assert_bitwise_equal(reference, offloaded)
    assert_offloaded_between_steps(offloaded, expect_masters=True)


def test_masters_offloaded_before_the_first_step(rank_pool, reference_run):
    kw = dict(overlap_grad_reduce=False, overlap_param_gather=False, bucket_size=None)
    reference = reference_run(train_job, "mlp", "bf16", 3, False, **kw)
    offloaded = rank_pool.run(
        train_job, "mlp", "bf16", 3, True, offload_before_first_step=True, **kw
    )
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        first = rank["figures"][0]
        assert first["before_first_step"]
        # Only the masters exist before the first step, and they all went.
        assert first["offloaded_bytes"] == first["tracked_bytes"] > 0 and first["max_storage"] == 0
        assert rank["figures"][1]["tracked_bytes"] == 3 * first["tracked_bytes"]  # + 2 moments


def test_attached_mid_run_the_existing_states_go_to_the_host_at_once(rank_pool, reference_run):
    """Attach after two steps (a run that loaded a checkpoint before attaching is the same):
    the states and masters that exist go to the host at attach, not at the next step's end,
    so the next forward and backward run without them."""
    kw = dict(overlap_grad_reduce=False, overlap_param_gather=False, bucket_size=None)
    reference = reference_run(train_job, "mlp", "bf16", 4, False, **kw)
    offloaded = rank_pool.run(train_job, "mlp", "bf16", 4, True, attach_at=2, **kw)
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        first = rank["figures"][0]
        assert first["at_attach"] and first["max_storage"] == 0
        assert (
            first["offloaded_bytes"]
            == first["tracked_bytes"]
            == rank["figures"][1]["tracked_bytes"]
            > 0
        )


def _bitwise_last_figures(rank_pool, options, **build) -> list:
    """Four steps of the bf16 MLP without and with offloading (``options``), bitwise alike;
    each rank's figures after the last step."""
    reference = rank_pool.run(train_job, "mlp", "bf16", 4, False, **build)
    offloaded = rank_pool.run(train_job, "mlp", "bf16", 4, True, options=options, **build)
    assert_bitwise_equal(reference, offloaded)
    return [rank["figures"][-1] for rank in offloaded]


def test_selective_offload_leaves_the_other_kind_resident(rank_pool):
    kw = dict(overlap_grad_reduce=False, overlap_param_gather=False, bucket_size=None)
    for last in _bitwise_last_figures(rank_pool, {"offload_master_weights": False}, **kw):
        assert last["offloaded_bytes"] == last["tracked_bytes"] - last["resident_bytes"]
        assert last["resident_bytes"] == last["offloaded_bytes"] // 2  # masters: half of moments


@pytest.mark.parametrize("model,dtype", [("mlp", "bf16"), ("gpt", "bf16")])
def test_training_under_the_checked_stream_model(rank_pool, model, dtype):
    """The automatic cycle on real megatron-core with side streams deferred and memory
    poisoned until its copy ran: any missing wait raises or corrupts the comparison."""
    reference, offloaded = _run_pair(
        rank_pool, model, dtype, True, True, 1000, steps=6, checked=True
    )
    assert_bitwise_equal(reference, offloaded)
    assert_offloaded_between_steps(offloaded, expect_masters=True)
    for rank in offloaded:
        (calls,) = rank["checked_calls"]
        assert calls["use-after-h2d"] > 0 and calls["d2h-after-writers"] > 0


def resident_job(offload):
    """Between steps: a read-only look at the states, then an in-place change to them."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    offloader = megatron_offload.attach(optimizer) if offload else None
    inner = models.distributed_optimizers(optimizer)[0].optimizer
    seen = {}
    for step in range(4):
        models.train_step(chunks, optimizer, config, step)
        if step == 1:
            ctx = offloader.resident(read_only=True) if offloader else _nothing()
            with ctx:
                seen["read_only_sum"] = sum(float(s["exp_avg"].sum()) for s in inner.state.values())
            if offloader:
                seen["read_only_copies"] = offloader.stats()["d2h_copies"]
                seen["offloaded_after_read_only"] = offloader.is_offloaded
        if step == 2:  # e.g. a user rescaling the moments (a checkpoint load writes likewise)
            ctx = offloader.resident() if offloader else _nothing()
            with ctx:
                for s in inner.state.values():
                    s["exp_avg"].mul_(0.5)
            if offloader:
                seen["write_copies"] = offloader.stats()["d2h_copies"]
    if offloader:
        offloader.reload()
        offloader.wait()
    return {"seen": seen, "snapshot": models.snapshot(chunks, optimizer)}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_resident_block_for_reads_and_in_place_changes(rank_pool, reference_run):
    reference = reference_run(resident_job, False)
    offloaded = rank_pool.run(resident_job, True)
    for ref, off in zip(reference, offloaded):
        assert ref["seen"]["read_only_sum"] == off["seen"]["read_only_sum"]
        assert off["seen"]["read_only_copies"] == 0  # the host copy was still valid
        assert off["seen"]["offloaded_after_read_only"]
        assert off["seen"]["write_copies"] == 2  # the change was copied out: nothing lost
        for key, value in ref["snapshot"]["optimizer"].items():
            assert torch.equal(value, off["snapshot"]["optimizer"][key]), key


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_partial_offload_is_bitwise_and_moves_the_expected_bytes(rank_pool, fraction):
    kw = dict(overlap_grad_reduce=True, overlap_param_gather=False, bucket_size=1000)
    for last in _bitwise_last_figures(rank_pool, {"offload_fraction": fraction}, **kw):
        tracked_plus_kept = last["tracked_bytes"] + last["kept_resident_bytes"]
        assert last["offloaded_bytes"] <= fraction * tracked_plus_kept
        if fraction == 0.0:
            assert last["offloaded_bytes"] == 0 and last["host_bytes"] == 0
        elif fraction == 1.0:
            assert last["offloaded_bytes"] == tracked_plus_kept
        else:  # whole tensors, largest first: close to half, never over
            assert 0.4 * tracked_plus_kept < last["offloaded_bytes"] <= 0.5 * tracked_plus_kept
        assert last["host_bytes"] == last["offloaded_bytes"]


def budget_job(budget):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    try:
        offloader = megatron_offload.attach(optimizer, host_memory_budget=budget)
    except megatron_offload.HostMemoryBudgetError as exc:
        distrib = models.distributed_optimizers(optimizer)[0]
        return str(exc), ("_state_offloader" in vars(distrib) or "step" in vars(optimizer))
    models.train_step(chunks, optimizer, config, 0)
    return None, offloader.stats()["host_bytes"]


def test_host_memory_budget_refuses_at_attach_before_allocating(rank_pool):
    (message, touched), _ = rank_pool.run(budget_job, 1000)
    assert "host_memory_budget=1,000" in message and "offload_fraction" in message
    assert touched is False
    (message, held), _ = rank_pool.run(budget_job, 10**9)
    assert message is None and held > 0


def prefetch_job(prefetch, offload=True):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build(
        "gpt", "bf16", overlap_grad_reduce=True, bucket_size=3000
    )
    offloader = megatron_offload.attach(optimizer, prefetch=prefetch) if offload else None
    at_step = []
    if offloader:
        step = optimizer.step

        def recording_step(*args, **kwargs):  # what the states look like when step() begins
            at_step.append(offloader.is_offloaded)
            return step(*args, **kwargs)

        optimizer.step = recording_step
    results = [models.train_step(chunks, optimizer, config, s, micro_batches=2) for s in range(4)]
    if offloader:
        offloader.reload()
        offloader.wait()
    return {
        "results": results,
        "offloaded_at_step": at_step,
        "snapshot": models.snapshot(chunks, optimizer),
    }


@pytest.mark.parametrize("prefetch", ["step", 0.5])
def test_prefetch_point(rank_pool, prefetch, reference_run):
    reference = reference_run(prefetch_job, "step", offload=False)
    offloaded = rank_pool.run(prefetch_job, prefetch)
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        # The states (and, at step 0, the masters attach sent out) are still on the host when
        # step() begins with "step", and already coming back with a backward fraction.
        assert rank["offloaded_at_step"] == [prefetch == "step"] * 4
