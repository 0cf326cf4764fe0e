"""The chunked update on real megatron-core: states on the host during the step too.

Each case trains the same run twice in the rank pool: without offloading (the reference)
and attached with ``chunked_update_bytes``, on the checked stream-model device (side streams
deferred, fresh memory poisoned, every ordering checked). It compares losses, grad norms,
parameters and optimizer states bitwise, and it measures, after every inner step call (each
chunk, each first-step creation, the rest), the device memory the optimizer's states hold:
the storages behind every state tensor at that moment plus every live allocation the device
made (slots included). That footprint must stay at or under ``chunked_update_bytes`` at every
step, while the reference's whole update held more (so the bound is not met by accident).
Steps skipped by the loss scaler or the grad-norm threshold run no update at all.
"""

import contextlib

import pytest

from tests.harness import optimizer_jobs
from tests.harness.compare import assert_bitwise_equal

STEPS, SKIP_AT = 5, 3


def chunked_job(
    model,
    dtype,
    *,
    chunk_fraction=None,
    slots=2,
    offload=True,
    micro=1,
    kind=None,
    overrides=None,
    build=None,
    options=None,
    attach_at=0,
    drop_grads=None,
    fail=None,
):
    """Train STEPS steps (one skipped by the grad-norm threshold) and measure the footprint.

    chunk_fraction: chunked_update_bytes as a fraction of the whole state's bytes (raised to
        what the largest parameter needs); None: offloading without the chunked update.
    kind: None for megatron-core's torch AdamW, or "te"/"apex" for a FusedAdam double.
    attach_at: the step before which the offloader is attached (earlier steps run without).
    drop_grads: {index of an inner optimizer parameter: steps before which it has no
        gradient} (apex FusedAdam then creates its state later, beside streamed ones).
    fail: (step, call, "before"/"after"): that inner step call of that step raises, before or
        after its update; the training loop then runs the same iteration again.
    """
    import megatron_offload
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options
    from tests.harness.footprint import record_peaks, whole_state_bytes

    context = optimizer_jobs.injected(kind) if kind else contextlib.nullcontext()
    with context:
        chunks, optimizer, config = models.build(
            model, dtype, optimizer_overrides=dict(overrides or {}), **(build or {})
        )
        distributed = models.distributed_optimizers(optimizer)
        options = dict(options or {})
        devices = []
        budget = None
        if offload:
            options, devices = checked_device_options(options)
            if chunk_fraction is not None:
                # What one parameter's states need (slots and the optimizer's temporaries),
                # sized as the chunked update sizes them, and the whole state's bytes.
                from megatron_offload.adapters import inner_optimizers

                largest, whole = 0, 0
                for d in distributed:
                    inner = d.optimizer
                    params = [p for g in inner.param_groups for p in g["params"]]
                    planned = [
                        inner_optimizers.planned_state_bytes(inner, p, moments=True, masters=True)[
                            0
                        ]
                        for p in params
                    ]
                    ratio = max(
                        (
                            inner_optimizers.transient_bytes(inner, p) / n
                            for p, n in zip(params, planned)
                            if n
                        ),
                        default=0.0,
                    )
                    largest = max(largest, -(-int(max(planned) * (slots + ratio) + 1) // 16) * 16)
                    whole = max(whole, sum(planned))
                budget = max(int(chunk_fraction * whole), largest)
                options.update(chunked_update_bytes=budget, chunked_update_slots=slots)
        current = {"step": 0}
        if drop_grads:
            # The full list, taken now: a chunked update narrows the param groups per call.
            flat = [p for g in distributed[0].optimizer.param_groups for p in g["params"]]

            def drop(inner, args, kwargs):
                for index, until in drop_grads.items():
                    if current["step"] < until:
                        flat[index].grad = None

            distributed[0].optimizer.register_step_pre_hook(drop)
        failures = []
        if fail is not None:

            class PlantedFailure(RuntimeError):
                pass

            calls = {"n": 0}
            for d in distributed:
                real = d.optimizer.step

                def failing(*args, real=real, **kwargs):
                    if current["step"] != fail[0]:
                        return real(*args, **kwargs)
                    calls["n"] += 1
                    if calls["n"] == fail[1]:
                        if fail[2] == "after":
                            real(*args, **kwargs)
                        raise PlantedFailure("planted failure of an update call")
                    return real(*args, **kwargs)

                d.optimizer.step = failing  # the chunked update calls this one
        offloader = None
        peaks = record_peaks(optimizer, devices)
        results, figures = [], []
        # megatron-core < 0.17 has no grad-norm skip threshold: no step is skipped there.
        skip_supported = hasattr(distributed[0].config, "grad_norm_skip_threshold")
        for step in range(STEPS):
            current["step"] = step
            if offload and step == attach_at:
                offloader = megatron_offload.attach(optimizer, **options)
            peaks.append(0)
            if step == SKIP_AT:
                for distrib in distributed:
                    distrib.config.grad_norm_skip_threshold = 0.0
            try:
                results.append(models.train_step(chunks, optimizer, config, step, micro))
            except RuntimeError as error:
                if fail is None or type(error).__name__ != "PlantedFailure":
                    raise
                failures.append({"step": step, "notes": list(getattr(error, "__notes__", []))})
                results.append(models.train_step(chunks, optimizer, config, step, micro))  # again
            if step == SKIP_AT:
                for distrib in distributed:
                    distrib.config.grad_norm_skip_threshold = float("inf")
            if offloader:
                stats = offloader.stats()
                figures.append(
                    {
                        key: stats[key]
                        for key in (
                            "update_chunks",
                            "update_copies",
                            "offloaded_bytes",
                            "tracked_bytes",
                            "host_bytes",
                            "h2d_bytes",
                        )
                    }
                )
                # What is reloaded whole: the masters megatron keeps beside the optimizer.
                figures[-1]["whole_bytes"] = sum(
                    g.nbytes for e in offloader.engines for g in e.pieces if not g.streamed
                )
        whole = whole_state_bytes(optimizer)
        if offloader:
            offloader.reload()
            offloader.wait()
        models.flush_param_gather(chunks)
        snapshot = (
            optimizer_jobs.snapshot(chunks, optimizer)
            if kind
            else models.snapshot(chunks, optimizer)
        )
        check_devices(devices)
        return {
            "results": results,
            "figures": figures,
            "snapshot": snapshot,
            "peaks": peaks,
            "budget": budget,
            "whole": whole,
            "checked": len(devices),
            "skip_supported": skip_supported,
            "optimizers": len(distributed),
            "failures": failures,
        }


def _assert_bounded(reference, chunked, dtype, *, min_chunks=2):
    for ref, off in zip(reference, chunked):
        budget = off["budget"]
        updated = [r["update_successful"] for r in off["results"]]
        assert not updated[SKIP_AT] or not off["skip_supported"]
        assert off["checked"] == off["optimizers"]
        attached_peaks = off["peaks"][len(off["peaks"]) - len(off["figures"]) :]
        for step, (peak, figures) in enumerate(zip(attached_peaks, off["figures"])):
            assert peak <= budget, (step, peak, budget)
            assert (
                figures["h2d_bytes"] <= figures["whole_bytes"]
            )  # no optimizer state reloaded whole
            if dtype == "fp32":
                assert figures["whole_bytes"] == 0  # fp32 models have no separate masters
            assert figures["offloaded_bytes"] == figures["tracked_bytes"] > 0
            # The host holds what is offloaded; until every state exists (an fp16 overflow
            # skips the first step, apex makes a state at its first gradient), the arena
            # reserved for all of them at attach.
            assert figures["host_bytes"] >= figures["offloaded_bytes"], (step, figures)
            if not updated[step]:
                assert figures["update_chunks"] == figures["update_copies"] == 0  # nothing streamed
            if updated[step] and step > 0 and updated[step - 1]:
                # States existed and were streamed: several chunks, one copy per group and
                # direction each (a copy count that does not grow with the parameters).
                assert figures["update_chunks"] >= min_chunks, (step, figures)
                assert figures["update_copies"] <= 2 * figures["update_chunks"] * 4, figures
        last = off["figures"][-1]
        assert last["host_bytes"] == last["offloaded_bytes"], last
        # Without the chunked update, the whole state sat on the device during the step.
        assert max(ref["peaks"]) >= ref["whole"] > budget, (ref["whole"], budget)


CASES = {
    # name: (model, dtype, job options, rank-pool options)
    "fp32-gpt-overlap-dp2": (
        "gpt",
        "fp32",
        dict(
            chunk_fraction=0.25,
            micro=2,
            build=dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000),
        ),
        {},
    ),
    "bf16-mlp-one-slot-dp2": (
        "mlp",
        "bf16",
        dict(chunk_fraction=0.3, slots=1, build=dict(overlap_grad_reduce=True, bucket_size=1000)),
        {},
    ),
    "fp16-mlp-loss-scaler-dp2": (
        "mlp",
        "fp16",
        dict(
            chunk_fraction=0.2,
            overrides={"initial_loss_scale": 2.0**24, "hysteresis": 1},
            build=dict(num_layers=4),
        ),
        {},
    ),
    "bf16-gpt-backward-prefetch-dp2": (
        "gpt",
        "bf16",
        dict(chunk_fraction=0.3, micro=2, options={"prefetch": 0.5}),
        {},
    ),
    "bf16-moe-ep2": (
        "gpt",
        "bf16",
        dict(
            chunk_fraction=0.3,
            build=dict(
                transformer_overrides=dict(
                    num_moe_experts=4,
                    moe_router_topk=2,
                    moe_token_dispatcher_type="allgather",
                    expert_model_parallel_size=2,
                )
            ),
        ),
        {"ep": 2},
    ),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.floor] if name == "bf16-mlp-one-slot-dp2" else [])
        for name in CASES
    ],
)
def test_chunked_update_is_bitwise_and_bounded(rank_pool, name, reference_run):
    model, dtype, job, pool = CASES[name]
    reference = reference_run(chunked_job, model, dtype, offload=False, **job, **pool)
    chunked = rank_pool.run(chunked_job, model, dtype, **job, **pool)
    assert_bitwise_equal(reference, chunked)
    _assert_bounded(reference, chunked, dtype)


def test_chunked_update_with_a_virtual_pipeline(rank_pool4):
    """PP 2 with two virtual stages per rank (one optimizer over two model chunks), with the
    prefetch at half the backward pass (its trigger parameter is found across the chunks)."""
    job = dict(chunk_fraction=0.3, micro=4, build=dict(num_layers=4), options={"prefetch": 0.5})
    layout = dict(pp=2, mp_kwargs={"virtual_pipeline_model_parallel_size": 2})
    reference = rank_pool4.run(chunked_job, "mlp", "bf16", offload=False, **job, **layout)
    chunked = rank_pool4.run(chunked_job, "mlp", "bf16", **job, **layout)
    assert_bitwise_equal(reference, chunked)
    _assert_bounded(reference, chunked, "bf16")


PRECISION_AWARE_FP8 = optimizer_jobs.precision_aware(True, "fp8", "fp8", "fp32")
PRECISION_AWARE_BF16 = optimizer_jobs.precision_aware(False, "bf16", "bf16", "fp32")


@pytest.mark.parametrize(
    "kind,overrides",
    [
        pytest.param("te", PRECISION_AWARE_FP8, id="te-precision-aware-fp8"),
        # The double's TE lines ("te@LINE", see tests/harness/doubles/te_fused_adam.py): 2.8-2.12 unscale
        # bf16 moments into fp32 temporaries, 2.13+ update them in place, 2.19+ count empty groups.
        pytest.param("te@2.12", PRECISION_AWARE_FP8, id="te-2.12-precision-aware-fp8"),
        pytest.param("te@2.12", PRECISION_AWARE_BF16, id="te-2.12-precision-aware-bf16"),
        pytest.param("te", PRECISION_AWARE_BF16, id="te-2.17-precision-aware-bf16"),
        pytest.param("te@2.19", PRECISION_AWARE_FP8, id="te-2.19-precision-aware-fp8"),
        pytest.param("te", {}, id="te-plain"),
        pytest.param("apex", {}, id="apex"),
    ],
)
def test_chunked_update_with_fused_adam(rank_pool, kind, overrides, reference_run):
    """Per-group step counters (advanced once per step(), however many calls), FP8 moments
    streamed through their buffers, masters inside the state (precision-aware) streamed."""
    job = dict(chunk_fraction=0.25, kind=kind, overrides=overrides, build=dict(num_layers=4))
    reference = reference_run(chunked_job, "mlp", "bf16", offload=False, **job)
    chunked = rank_pool.run(chunked_job, "mlp", "bf16", **job)
    assert_bitwise_equal(reference, chunked)
    _assert_bounded(reference, chunked, "bf16")


def test_attached_mid_run_the_existing_states_are_streamed_from_the_next_step(
    rank_pool, reference_run
):
    """Attach after two steps without offloading: the states already exist, so attach moves
    them to the host at once and the first offloaded step streams them."""
    job = dict(chunk_fraction=0.25, build=dict(num_layers=4))
    reference = reference_run(chunked_job, "mlp", "fp32", offload=False, **job)
    chunked = rank_pool.run(chunked_job, "mlp", "fp32", attach_at=2, **job)
    assert_bitwise_equal(reference, chunked)
    for rank in chunked:
        assert len(rank["figures"]) == STEPS - 2
        assert rank["figures"][0]["update_chunks"] >= 2  # streamed from the first step
        assert max(rank["peaks"][2:]) <= rank["budget"] < max(rank["peaks"][:2])


def test_a_state_created_late_joins_the_streamed_ones(rank_pool, reference_run):
    """apex FusedAdam creates a parameter's state at its first gradient: here two steps after
    the others'. The new state is created alone, copied to the host, and from then on
    streamed with the rest, bitwise."""
    job = dict(chunk_fraction=0.25, kind="apex", build=dict(num_layers=4), drop_grads={0: 2, 5: 2})
    reference = reference_run(chunked_job, "mlp", "bf16", offload=False, **job)
    chunked = rank_pool.run(chunked_job, "mlp", "bf16", **job)
    assert_bitwise_equal(reference, chunked)
    _assert_bounded(reference, chunked, "bf16")
    for rank in chunked:
        tracked = [f["tracked_bytes"] for f in rank["figures"]]
        assert tracked[1] < tracked[2] == tracked[-1]  # the late states joined at step 2


def planted_group_step_job(*args, **kwargs):
    """``chunked_job`` with a bug planted for the job's length: every update call starts from
    the step count the previous call left (the ranks are shared: the plant must not outlive
    the job)."""
    from unittest import mock

    from megatron_offload.chunked import update as chunked_module

    original = chunked_module.ChunkedUpdate._call

    def call(self, params, **kw):
        self._base_steps = {
            id(g): g.get("step", chunked_module._ABSENT) for g in self.inner.param_groups
        }
        return original(self, params, **kw)

    with mock.patch.object(chunked_module.ChunkedUpdate, "_call", call):
        return chunked_job(*args, **kwargs)


def test_planted_group_step_bug_is_caught(rank_pool, reference_run):
    """Negative control: letting the group step advance per call changes TE's bias correction."""
    job = dict(chunk_fraction=0.25, kind="te", build=dict(num_layers=4))
    reference = reference_run(chunked_job, "mlp", "bf16", offload=False, **job)
    planted = rank_pool.run(planted_group_step_job, "mlp", "bf16", **job)
    again = rank_pool.run(chunked_job, "mlp", "bf16", **job)  # the plant is gone with its job
    with pytest.raises(AssertionError):
        assert_bitwise_equal(reference, planted)
    assert all(max(f["update_chunks"] for f in rank["figures"]) >= 2 for rank in planted)
    assert_bitwise_equal(reference, again)


@pytest.mark.parametrize(
    "kind,overrides,when",
    [
        pytest.param(None, {}, "after", id="torch-adamw"),
        pytest.param("te", PRECISION_AWARE_FP8, "before", id="te-precision-aware-fp8"),
    ],
)
def test_a_step_failing_part_way_is_undone_and_can_be_run_again(
    rank_pool, kind, overrides, when, reference_run
):
    """An inner step call fails at step 2 after earlier calls updated their parameters (the
    third call; the first two streamed chunks were copied back): megatron's step raises, the
    chunked update undoes what the step changed, and the loop runs the iteration again. The
    run then equals one that never failed, bitwise (a half-undone step would update some
    parameters twice)."""
    job = dict(chunk_fraction=0.25, kind=kind, overrides=overrides, build=dict(num_layers=4))
    reference = reference_run(chunked_job, "mlp", "bf16", offload=False, **job)
    failed = rank_pool.run(
        chunked_job, "mlp", "bf16", fail=(2, 3, when), options={"chunked_update_undo": True}, **job
    )
    assert_bitwise_equal(reference, failed)
    for rank in failed:
        assert [f["step"] for f in rank["failures"]] == [2]
        assert any("undone" in note for note in rank["failures"][0]["notes"])
        assert rank["figures"][1]["update_chunks"] >= 3  # the failing call came after two chunks


def test_without_the_chunked_update_the_states_are_reloaded_whole(rank_pool):
    """Control for the footprint measure: the same offloaded run without chunks holds the
    whole state during the step."""
    offloaded = rank_pool.run(chunked_job, "mlp", "bf16")
    for rank in offloaded:
        assert max(rank["peaks"]) >= rank["whole"] > 0
        assert all(f["update_chunks"] == 0 for f in rank["figures"])


def slot_size_job(kind, budget_per_element, steps):
    import megatron_offload
    from megatron_offload.engine.slots import SlotSizeError
    from tests.harness import models

    context = optimizer_jobs.injected(kind) if kind else contextlib.nullcontext()
    with context:
        chunks, optimizer, config = models.build("mlp", "bf16" if kind else "fp32")
        inner = models.distributed_optimizers(optimizer)[0].optimizer
        largest = max(p.numel() for g in inner.param_groups for p in g["params"])
        try:
            megatron_offload.attach(
                optimizer, chunked_update_bytes=2 * budget_per_element * largest
            )
        except ValueError as error:
            return "attach", str(error), len(inner.state)
        try:
            for step in range(steps):
                models.train_step(chunks, optimizer, config, step)
        except SlotSizeError as error:
            return "step", str(error), len(inner.state)
    return None


def test_a_budget_too_small_for_torch_adam_is_refused_at_attach(rank_pool):
    """torch AdamW's moments are known before they exist (two fp32 tensors shaped like the
    parameter): a budget that cannot hold them is refused before anything is touched."""
    for when, message, states in rank_pool.run(slot_size_job, None, 4, 2):
        assert when == "attach" and states == 0
        assert "chunked_update_bytes=" in message and "give at least" in message


def test_a_budget_too_small_for_te_adam_is_refused_at_attach(rank_pool):
    """Transformer Engine's states are sized from its configuration before they exist (here
    two fp32 moments: 8 bytes per element, where 2 used to be assumed): a budget of 4 bytes
    per element is refused before anything is touched, with the size it needs."""
    for when, message, states in rank_pool.run(slot_size_job, "te", 4, 2):
        assert when == "attach" and states == 0
        assert "give at least" in message and "chunked_update_bytes" in message


def test_a_budget_no_parameter_can_fit_is_refused_at_attach(rank_pool):
    for when, message, _ in rank_pool.run(slot_size_job, "te", 1, 1):
        assert when == "attach" and "give at least" in message and "at least " in message
