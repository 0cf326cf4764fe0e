"""Long runs of offload/reload cycles, and RL-style phases around the per-step cycle."""

import pytest
import torch

from tests.harness.optimizer_jobs import piece_places


def _resident_sizes(offloader, distributed):
    from megatron_offload.adapters import megatron_wrappers as adapter

    # Consolidated tensors share one storage per group: count each storage once.
    storages = {}
    for d in distributed:
        for _, t in adapter.collect(d):
            storage = t.untyped_storage()
            storages[
                (storage.data_ptr(), id(t)) if storage.nbytes() == 0 else storage.data_ptr()
            ] = storage.nbytes()
    return list(storages.values())


def thousand_cycles_job(cycles):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    offloader = megatron_offload.attach(optimizer)
    for step in range(2):
        models.train_step(chunks, optimizer, config, step)
    distributed = models.distributed_optimizers(optimizer)
    offloader.reload()
    offloader.wait()
    before = models.snapshot(chunks, optimizer)
    arena = offloader.engines[0].host_arena.data_ptr()
    figures = set()
    for _ in range(cycles):
        offloader.offload()
        released = sum(_resident_sizes(offloader, distributed))
        offloaded = offloader.stats()
        offloader.reload()
        offloader.wait()
        stats = offloader.stats()
        figures.add(
            (
                released,
                offloaded["offloaded_bytes"],
                stats["resident_bytes"],
                stats["host_bytes"],
                stats["d2h_copies"],
                stats["h2d_copies"],
                sum(_resident_sizes(offloader, distributed)),
                offloader.engines[0].host_arena.data_ptr() == arena,
            )
        )
    after = models.snapshot(chunks, optimizer)
    same = all(
        torch.equal(before[s][k], after[s][k]) for s in ("params", "optimizer") for k in before[s]
    )
    return {"same": same, "figures": sorted(figures)}


def test_thousand_cycles_leave_state_bitwise_unchanged_and_bytes_flat(rank_pool):
    for rank in rank_pool.run(thousand_cycles_job, 1000):
        assert rank["same"]
        # One set of figures for all 1000 cycles: nothing grows, nothing is reallocated.
        ((released, offloaded, resident, host, d2h, h2d, held, same_arena),) = rank["figures"]
        assert released == 0 and offloaded == resident == host == held > 0
        assert (d2h, h2d) == (2, 2) and same_arena


def rl_job(offload, checked=False):
    """Training steps with rollouts between them, in every combination a loop may use."""
    import megatron_offload
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    chunks, optimizer, config = models.build(
        "mlp", "bf16", overlap_grad_reduce=True, bucket_size=1000
    )
    options, devices = checked_device_options() if checked else ({}, [])
    offloader = megatron_offload.attach(optimizer, **options) if offload else None
    seen, results = {}, []

    def rollout():  # stands for inference: reads the model's current weights
        with torch.no_grad():
            return sum(float(p.float().sum()) for p in chunks[0].parameters())

    def phase(name, body):
        value = body()
        if offloader:
            seen[name] = offloader.is_offloaded
        return value

    def offloaded():
        return offloader.offloaded() if offloader else _Null()

    results.append(models.train_step(chunks, optimizer, config, 0))
    # A rollout while the per-step cycle already offloaded: entering and leaving changes nothing.
    with offloaded():
        results.append(phase("rollout-after-step", rollout))
    if offloader:
        seen["still-offloaded-after-block"] = offloader.is_offloaded
        offloader.reload()  # explicit reload, twice: idempotent
        offloader.reload()
        offloader.wait()
        seen["resident-after-reload"] = not offloader.is_offloaded
    # States resident on entry: offloaded inside, nested blocks, resident again after.
    with offloaded():
        results.append(phase("inside-outer", rollout))
        with offloaded():
            results.append(phase("inside-nested", rollout))
        results.append(phase("after-nested", rollout))
    if offloader:
        seen["resident-after-outer"] = not offloader.is_offloaded
        offloader.offload()  # explicit offload, twice: idempotent
        offloader.offload()
    results.append(models.train_step(chunks, optimizer, config, 1))  # the step reloads by itself
    with offloaded():
        results.append(models.train_step(chunks, optimizer, config, 2))  # a step inside a block
    results.append(models.train_step(chunks, optimizer, config, 3))
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    check_devices(devices)
    return {"results": results, "seen": seen, "snapshot": snapshot}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("checked", [False, True], ids=["cpu-device", "checked-device"])
def test_rl_phases_nest_and_compose_with_the_step_cycle(rank_pool, checked):
    reference = rank_pool.run(rl_job, False)
    offloaded = rank_pool.run(rl_job, True, checked)
    for ref, off in zip(reference, offloaded):
        assert off["results"] == ref["results"]
        for section in ("params", "optimizer"):
            for key, value in ref["snapshot"][section].items():
                assert torch.equal(value, off["snapshot"][section][key]), (section, key)
        seen = off["seen"]
        assert seen["rollout-after-step"] and seen["still-offloaded-after-block"]
        assert seen["resident-after-reload"]
        assert seen["inside-outer"] and seen["inside-nested"] and seen["after-nested"]
        assert seen["resident-after-outer"]


def rl_selection_job(offload, checked=False):
    """A step cycle that keeps the masters on the device, and rollouts that free them too."""
    import megatron_offload
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    chunks, optimizer, config = models.build(
        "mlp", "bf16", overlap_grad_reduce=True, bucket_size=1000
    )
    options, devices = checked_device_options() if checked else ({}, [])
    offloader = (
        megatron_offload.attach(optimizer, offload_master_weights=False, **options)
        if offload
        else None
    )
    seen, results = {}, []

    def rollout():
        with torch.no_grad():
            return sum(float(p.float().sum()) for p in chunks[0].parameters())

    def look(name):
        if offloader:
            seen[name] = (piece_places(offloader), offloader.stats()["offloaded_bytes"])

    def block(**selection):
        return offloader.offloaded(**selection) if offloader else _Null()

    results.append(models.train_step(chunks, optimizer, config, 0))
    look("after-step")  # the cycle offloaded the moments only
    with block(offload_master_weights=True):
        look("rollout")
        results.append(rollout())
        with block():  # nested, as configured: the moments are offloaded already
            look("nested-default")
        with block(offload_optimizer_states=False, offload_master_weights=True):  # nested, no-op
            look("nested-masters")
        look("after-nested")
    look("after-block")  # as before the block: masters resident, moments offloaded
    results.append(models.train_step(chunks, optimizer, config, 1))
    if offloader:
        offloader.reload()
        offloader.wait()
    look("all-resident")
    with block(offload_optimizer_states=False, offload_master_weights=True):  # the masters only
        look("masters-only")
        results.append(rollout())
    look("after-masters-only")
    results.append(models.train_step(chunks, optimizer, config, 2))
    with block(offload_master_weights=True):  # a step inside a block
        results.append(models.train_step(chunks, optimizer, config, 3))
        look("after-step-in-block")
    look("after-block-with-step")
    results.append(models.train_step(chunks, optimizer, config, 4))
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    check_devices(devices)
    return {"results": results, "seen": seen, "snapshot": snapshot, "checked": len(devices)}


@pytest.mark.parametrize("checked", [False, True], ids=["cpu-device", "checked-device"])
def test_rl_blocks_free_what_the_caller_names_and_restore_it(rank_pool, checked):
    reference = rank_pool.run(rl_selection_job, False)
    offloaded = rank_pool.run(rl_selection_job, True, checked)
    states, masters = "optimizer_states", "master_weights"
    released, resident = {"released"}, {"resident"}
    for ref, off in zip(reference, offloaded):
        assert off["results"] == ref["results"]
        for section in ("params", "optimizer"):
            for key, value in ref["snapshot"][section].items():
                assert torch.equal(value, off["snapshot"][section][key]), (section, key)
        assert off["checked"] == (1 if checked else 0)
        seen = off["seen"]
        step_places, step_bytes = seen["after-step"]
        assert step_places == {states: released, masters: resident}
        # The block frees the masters too, although the moments were offloaded already.
        rollout_places, rollout_bytes = seen["rollout"]
        assert (
            rollout_places == {states: released, masters: released} and rollout_bytes > step_bytes
        )
        for name in ("nested-default", "nested-masters", "after-nested"):
            assert seen[name] == seen["rollout"], name
        assert seen["after-block"] == seen["after-step"]  # everything back as it was
        assert seen["all-resident"][0] == {states: resident, masters: resident}
        masters_only, masters_bytes = seen["masters-only"]
        assert masters_only == {states: resident, masters: released}
        assert 0 < masters_bytes < rollout_bytes
        assert seen["after-masters-only"] == seen["all-resident"]
        # The step inside the block reloads everything and offloads what the cycle offloads;
        # the block's exit reloads only what it had taken (the masters).
        assert seen["after-step-in-block"][0] == {states: released, masters: resident}
        assert seen["after-block-with-step"][0] == {states: released, masters: resident}


def offload_hooks_job():
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    offloader = megatron_offload.attach(optimizer)
    calls = []

    def pre(o):
        calls.append(("pre", o is offloader, o.stats()["offloaded_payload_bytes"]))

    def post(o):
        calls.append(("post", o is offloader, o.stats()["offloaded_payload_bytes"]))

    handles = [offloader.register_offload_pre_hook(pre), offloader.register_offload_post_hook(post)]
    for step in range(2):
        models.train_step(chunks, optimizer, config, step)
    offloader.reload()
    offloader.wait()
    offloader.offload()
    watched = list(calls)
    for handle in handles:
        handle.remove()
    models.train_step(chunks, optimizer, config, 2)
    offloader.reload()
    offloader.wait()
    offloader.offload()
    return {"calls": watched, "after_remove": calls[len(watched) :]}


def test_offload_hooks_run_around_every_release_until_removed(rank_pool):
    """``register_offload_pre_hook``/``post_hook``: around the release after each step and
    around ``offload()``, seeing the states resident before and offloaded after."""
    for rank in rank_pool.run(offload_hooks_job):
        calls = rank["calls"]
        assert [c[0] for c in calls] == ["pre", "post"] * 3 and all(c[1] for c in calls)
        for pre, post in zip(calls[::2], calls[1::2]):
            assert pre[2] == 0 < post[2]
        assert rank["after_remove"] == []
