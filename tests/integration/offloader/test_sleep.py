"""``sleep()`` / ``wake()`` on real megatron-core (gloo ranks): rollout-like phases (step,
sleep, a block that allocates where the state was, wake, step) train bitwise as the same run
without sleeping; while asleep the raw storages of parameters, gradients, states and masters
hold 0 bytes; the bytes over the device interface per cycle are the optimizer states and
masters plus the parameters that could not be rebuilt. Negative controls: a wake that skips
the all-gather, or the cast, is caught by the bitwise comparison.

Jobs run in rank processes (a touched released tensor kills the rank and fails the test
with its exit code).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.harness.compare import same_run

STEPS = 3


def _device_bytes(chunks, optimizer) -> dict:
    """Bytes of the raw storages of parameters, gradients, optimizer states and masters (and
    their .grad), each storage once."""
    from tests.harness import models

    seen, sizes = set(), {"parameters": 0, "gradients": 0, "states": 0, "masters": 0}

    def add(kind, tensor):
        if isinstance(tensor, torch.Tensor) and tensor.numel() > 1:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen or not storage.nbytes():
                seen.add(storage.data_ptr())
                sizes[kind] += storage.nbytes()

    for chunk in chunks:
        for param in chunk.parameters():
            add("parameters", param)
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            add("gradients", buffer.grad_data)
    for wrapper in models.megatron_optimizers(optimizer):
        for group in getattr(wrapper, "shard_fp32_from_float16_groups", ()):
            for master in group:
                add("masters", master)
                add("gradients", master.grad)
        # dict.values: the raw mapping, not a read the state-access guard would serve
        for state in dict.values(wrapper.optimizer.state) if wrapper.optimizer else ():
            for value in dict.values(state):
                add("states", value)
    return sizes


def _counting(offloader) -> list:
    """Count the bytes of every copy through the offloader's devices (the link, on a GPU);
    regrown memory holds garbage (``poison_regrowth``)."""
    from tests.harness.fresh_memory import poison_regrowth

    poison_regrowth(offloader)
    counted = [0]
    for device in {id(e.device): e.device for e in offloader.engines}.values():
        copy = device.copy

        def counting(dst, src, copy=copy):
            counted[0] += dst.numel() * dst.element_size()
            copy(dst, src)

        device.copy = counting
    return counted


def _rollout_block():
    """What an inference engine does with the freed memory: allocates and writes it."""
    block = torch.full((1 << 20,), float("nan"))
    block.add_(1)
    del block


def _load_weights(chunks):
    """A weight load that does not go through the optimizer (refit from another copy)."""
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                if param.requires_grad:
                    param.mul_(0.5)


def sleep_job(mode: str, automatic=False, **kwargs):
    return sleep_run(mode, automatic=automatic, **kwargs)


def sleep_run(
    mode: str, moe: bool = False, freeze: str | None = None, automatic=False, load_at=None
):
    """``mode``: "reference" (no offloader), "sleep", or a planted bug: "no-gather",
    "no-cast" (wake skips megatron-core's all-gather or the cast of the masters).
    ``load_at``: after that step, the weights are changed outside the optimizer."""
    import megatron_offload
    from tests.harness import models

    options = {"transformer_overrides": dict(models.MOE)} if moe else {}
    chunks, optimizer, config = models.build("gpt", "bf16", freeze=freeze, **options)
    offloader = None
    if mode != "reference":
        offloader = (
            megatron_offload.attach(optimizer)
            if automatic
            else megatron_offload.OptimizerStateOffloader(optimizer)
        )
        counted = _counting(offloader)
    results, cycles = [], []
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if step == load_at:
            _load_weights(chunks)
        if offloader is None:
            _rollout_block()
            continue
        before = counted[0]
        awake = _device_bytes(chunks, optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            offloader.sleep()
        slept = counted[0] - before
        asleep = _device_bytes(chunks, optimizer)
        stats = offloader.stats()
        _rollout_block()
        if mode == "no-gather":
            for chunk in chunks:
                chunk.start_param_sync = lambda *a, **k: None
        if mode == "no-cast":
            for wrapper in models.megatron_optimizers(optimizer):
                wrapper._copy_main_params_to_model_params = lambda: None
        before = counted[0]
        offloader.wake()
        for chunk in chunks:
            vars(chunk).pop("start_param_sync", None)
        for wrapper in models.megatron_optimizers(optimizer):
            vars(wrapper).pop("_copy_main_params_to_model_params", None)
        cycles.append(
            {
                "awake": awake,
                "asleep": asleep,
                "warnings": [str(w.message) for w in caught],
                "sleep_bytes": slept,
                "wake_bytes": counted[0] - before,
                "stats": {k: v for k, v in stats.items() if k != "per_optimizer"},
                "awake_after": _device_bytes(chunks, optimizer),
                "master_bytes": sum(
                    master.numel() * master.element_size()
                    for wrapper in models.megatron_optimizers(optimizer)
                    for group in getattr(wrapper, "shard_fp32_from_float16_groups", ())
                    for master in group
                ),
            }
        )
    results.append(models.train_step(chunks, optimizer, config, STEPS))
    if offloader is not None:
        offloader.detach()
    return {"results": results, "cycles": cycles, "snapshot": models.snapshot(chunks, optimizer)}


_REFERENCES: dict = {}


def _references(pool, **build) -> list:
    """The run without sleeping, once per pool and build (several tests compare with it)."""
    key = (pool.world_size, tuple(sorted(build.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = pool.run(sleep_job, "reference", **build)
    return _REFERENCES[key]


@pytest.mark.parametrize("case", ["dense", "frozen", "moe", "automatic"])
def test_sleep_trains_bitwise_with_nothing_on_the_device(rank_pool, case):
    build = {"frozen": {"freeze": "position_embeddings"}, "moe": {"moe": True}}.get(case, {})
    ep = {"ep": 2} if case == "moe" else {}
    references = _references(rank_pool, **build, **ep)
    runs = rank_pool.run(sleep_job, "sleep", automatic=case == "automatic", **build, **ep)
    for reference, run in zip(references, runs):
        assert same_run(reference, run)
        for index, cycle in enumerate(run["cycles"]):
            resident = ("parameters", "gradients") if case == "automatic" else cycle["awake"]
            assert all(cycle["awake"][kind] for kind in resident), cycle["awake"]
            assert cycle["asleep"] == dict.fromkeys(cycle["asleep"], 0), cycle["asleep"]
            assert cycle["awake_after"] == cycle["awake"]
            stats = cycle["stats"]
            copied = stats["copied_parameter_bytes"]
            # Under attach's cycle too: the sleep compares the parameters with the masters'
            # host copies, so even the first sleep rebuilds.
            assert (copied > 0) == (case == "frozen")
            assert stats["rebuilt_parameter_bytes"] > 0
            assert stats["dropped_gradient_bytes"] == cycle["awake"]["gradients"]
            # One host buffer per copied storage, kept while it is copied, none else.
            assert stats["sleep_host_bytes"] == copied
            if case == "automatic":
                # The states and masters left after the step; the masters come back for the
                # cast and are released again without a copy.
                assert cycle["sleep_bytes"] == copied
                borrowed = cycle["master_bytes"] if stats["rebuilt_parameter_bytes"] else 0
                assert cycle["wake_bytes"] == borrowed + copied
            else:
                link = stats["tracked_bytes"] + copied
                assert cycle["sleep_bytes"] == link
                assert cycle["wake_bytes"] == link


@pytest.mark.parametrize("plant", ["no-gather", "no-cast"])
def test_a_wake_without_the_all_gather_or_the_cast_is_caught(rank_pool, plant):
    references = _references(rank_pool)
    runs = rank_pool.run(sleep_job, plant)
    assert not any(same_run(reference, run) for reference, run in zip(references, runs))


def test_weights_changed_outside_the_optimizer_are_copied_not_rebuilt(rank_pool):
    references = _references(rank_pool, load_at=1)
    runs = rank_pool.run(sleep_job, "sleep", load_at=1)
    for reference, run in zip(references, runs):
        assert same_run(reference, run)
        copied = [cycle["stats"]["copied_parameter_bytes"] for cycle in run["cycles"]]
        rebuilt = [cycle["stats"]["rebuilt_parameter_bytes"] for cycle in run["cycles"]]
        assert copied[0] == 0 and copied[1] == rebuilt[0] and copied[2] == 0, copied
        assert rebuilt[1] == 0 and rebuilt[2] == rebuilt[0], rebuilt
        (warning,) = run["cycles"][1]["warnings"]
        assert "changed since the last step" in warning and "reload_model_params" in warning


def test_under_the_cycle_a_weight_change_is_seen_at_the_sleep(rank_pool):
    """attach's cycle: the masters are on the host at each sleep, where the parameters are
    compared with their host copies. Weights changed after step 1: the second sleep copies
    (warning), the first and third rebuild."""
    references = _references(rank_pool, load_at=1)
    runs = rank_pool.run(sleep_job, "sleep", automatic=True, load_at=1)
    for reference, run in zip(references, runs):
        assert same_run(reference, run)
        copied = [cycle["stats"]["copied_parameter_bytes"] for cycle in run["cycles"]]
        rebuilt = [cycle["stats"]["rebuilt_parameter_bytes"] for cycle in run["cycles"]]
        assert copied[0] == 0 and copied[1] == rebuilt[0] > 0 and copied[2] == 0, copied
        assert rebuilt[1] == 0 and rebuilt[2] == rebuilt[0], rebuilt
        (warning,) = run["cycles"][1]["warnings"]
        assert "changed since the last step" in warning, warning


def test_four_ranks_with_expert_buffers_and_a_frozen_parameter(rank_pool4):
    build = {"moe": True, "freeze": "position_embeddings", "ep": 2}  # expert data-parallel 2
    references = _references(rank_pool4, **build)
    runs = rank_pool4.run(sleep_job, "sleep", **build)
    for reference, run in zip(references, runs):
        assert same_run(reference, run)
        for cycle in run["cycles"]:
            assert cycle["asleep"] == dict.fromkeys(cycle["asleep"], 0), cycle["asleep"]
            stats = cycle["stats"]
            copied = stats["copied_parameter_bytes"]
            assert copied > 0 and stats["rebuilt_parameter_bytes"] > 0  # frozen, and the rest
            link = stats["tracked_bytes"] + copied
            assert cycle["sleep_bytes"] == cycle["wake_bytes"] == link


def budget_job():
    """A budget that holds the arena but not sleep's copies of the frozen parameter, and then
    a node that cannot give them: the sleep is refused before anything is given up; with room
    it sleeps, and the copies count."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", freeze="position_embeddings")
    models.train_step(chunks, optimizer, config, 0)
    probe = megatron_offload.attach(optimizer)
    arena = probe.stats()["host_bytes"]
    probe.detach()
    found = {}
    offloader = megatron_offload.attach(optimizer, host_memory_budget=arena)
    models.train_step(chunks, optimizer, config, 1)
    before = _device_bytes(chunks, optimizer)
    try:
        offloader.sleep()
    except megatron_offload.HostMemoryBudgetError as error:
        found["refused"] = str(error)
    found["untouched"] = _device_bytes(chunks, optimizer) == before
    found["sleeping"] = offloader.sleeping
    found["host_bytes"] = offloader.stats()["host_bytes"]
    offloader.detach()
    offloader = megatron_offload.attach(optimizer, host_memory_budget=2 * arena + (1 << 20))
    # The node cannot give the copies (fake limits: nothing available): every rank refuses.
    from tests.integration.offloader.test_node_memory import _with_limits

    before = _device_bytes(chunks, optimizer)
    restore = _with_limits(1)
    try:
        offloader.sleep()
    except megatron_offload.NodeMemoryError as error:
        found["node_refused"] = str(error)
    finally:
        restore()
    found["node_untouched"] = _device_bytes(chunks, optimizer) == before and not offloader.sleeping
    offloader.sleep()
    stats = offloader.stats()
    found["slept"] = (stats["sleep_host_bytes"], stats["host_bytes"], arena)
    offloader.wake()
    offloader.detach()
    return found


def test_a_budget_or_a_node_too_small_for_sleep_is_refused_before_anything_is_given_up(
    rank_pool,
):
    for found in rank_pool.run(budget_job):
        assert "host_memory_budget" in found["refused"], found
        assert found["untouched"] and not found["sleeping"]
        sleep_bytes, host_bytes, arena = found["slept"]
        assert found["host_bytes"] == arena  # the refused sleep holds nothing more
        assert sleep_bytes > 0 and host_bytes == arena + sleep_bytes
        assert "sleep() copies the parameters" in found["node_refused"], found
        assert "can give 1" in found["node_refused"] and found["node_untouched"]


def asleep_job():
    """The RL loop's one line: ``with offloader.asleep(): rollout()`` after every step,
    nested once (a framework's own sleep inside the user's)."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    offloader = megatron_offload.attach(optimizer)
    results, inside = [], []
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        with offloader.asleep():
            with offloader.asleep():
                inside.append(offloader.sleeping and _device_bytes(chunks, optimizer))
            still = offloader.sleeping  # the inner block leaves the outer one's sleep
            _rollout_block()
        inside[-1] = (inside[-1], still, offloader.sleeping)
    results.append(models.train_step(chunks, optimizer, config, STEPS))
    offloader.detach()
    return {"results": results, "inside": inside, "snapshot": models.snapshot(chunks, optimizer)}


def test_the_asleep_block_sleeps_and_wakes_around_a_rollout_and_nests(rank_pool):
    references = _references(rank_pool)
    for reference, run in zip(references, rank_pool.run(asleep_job)):
        assert same_run(reference, run)
        for asleep, still, after in run["inside"]:
            assert asleep["states"] == asleep["masters"] == asleep["parameters"] == 0, asleep
            assert still and not after
