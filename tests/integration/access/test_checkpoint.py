"""Checkpoints taken while the states are offloaded, and resuming from them.

megatron-core ``dist_checkpointing`` (torch_dist format, DP-reshardable optimizer state),
synchronous and asynchronous saves, on the real DistributedOptimizer. The uninterrupted
run, the run resumed from a checkpoint saved while offloaded, and a run that loads the
checkpoint into an already running, offloaded optimizer must all continue bitwise alike,
and all alike with and without offloading.
"""

import pytest
import torch

from tests.harness.checkpoints import (
    DeviceWatch,
    all_released,
    assert_phases_equal,
    chunked_options,
    load,
    offloaded_snapshot,
    save,
    shared_directory,
    tensors_equal,
    writing,
)

STEPS, SAVE_AFTER = 6, 3


def _attach(optimizer, options, disk):
    """``attach`` with ``options``; with ``disk`` (a directory), a host budget of 40% of the
    host copies and the rest in the disk tier there."""
    import megatron_offload

    if disk is None:
        return megatron_offload.attach(optimizer, **options)
    probe = megatron_offload.attach(optimizer, **options)
    budget = int(probe.stats()["host_bytes"] * 0.4)
    probe.detach()
    return megatron_offload.attach(
        optimizer, **options, host_memory_budget=budget, offload_disk_dir=disk
    )


def _disk_figures(offloader) -> dict:
    """What is in the disk tier, and how much of it is in host memory (mincore, apart from
    ``stats()``)."""
    from tests.harness.disk import page_cache_bytes

    files = [e.host.disk.buffer for e in offloader.engines if e.host.disk is not None]
    return {
        "disk_bytes": offloader.stats()["disk_bytes"],
        "page_cache": sum(page_cache_bytes(buffer) for buffer in files),
    }


def checkpoint_job(offload, dtype, async_save, directory, checked=False, chunked=False, disk=None):
    """Phase 1: train STEPS steps, saving after SAVE_AFTER (states offloaded at that point).
    Phase 2: a fresh model+optimizer loads the checkpoint and trains the remaining steps.
    Phase 3: a third one trains 2 steps of its own (offloaded), then loads the checkpoint
    into the running optimizer and trains the remaining steps.
    chunked: with the chunked update (states on the host during the steps too). disk: a
    directory for the disk tier, which then holds 60% of the host copies."""
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    directory = shared_directory(directory)
    out = {}
    options, devices = checked_device_options() if checked else ({}, [])

    chunks, optimizer, config = models.build("mlp", dtype)
    if chunked:
        options = chunked_options(optimizer, options)
    offloader = _attach(optimizer, options, disk) if offload else None
    results, pending = [], None
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if step == SAVE_AFTER - 1:
            if offloader:
                out["offloaded_at_save"] = offloader.is_offloaded
            with DeviceWatch(offloader) as watch:
                pending = save(chunks, optimizer, directory, async_save)
            if offloader:  # served from the host copy: nothing came back, nothing is stale
                out["save"] = watch.figures()
                out["offloaded_after_save"] = all_released(offloader)
        if step == SAVE_AFTER and offloader:  # the step after the save offloaded again
            out["disk_after_save"] = _disk_figures(offloader)
    if pending is not None:
        out["written_while_training"] = writing(pending)  # the steps after the save ran meanwhile
        pending.maybe_finalize_async_calls(blocking=True)
    out["uninterrupted"] = results
    out["uninterrupted_snapshot"] = offloaded_snapshot(chunks, optimizer, offloader)

    # Phase 2: resume in a fresh optimizer (offloaded before anything, like a restarted job).
    torch.manual_seed(99)  # different init: everything must come from the checkpoint
    chunks, optimizer, config = models.build("mlp", dtype)
    if chunked:
        options = chunked_options(optimizer, options)
    offloader = _attach(optimizer, options, disk) if offload else None
    load(chunks, optimizer, directory, offload)
    out["resumed"] = [
        models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER, STEPS)
    ]
    out["resumed_snapshot"] = offloaded_snapshot(chunks, optimizer, offloader)

    # Phase 3: load into a running optimizer whose states are offloaded.
    torch.manual_seed(7)
    chunks, optimizer, config = models.build("mlp", dtype)
    if chunked:
        options = chunked_options(optimizer, options)
    offloader = _attach(optimizer, options, disk) if offload else None
    for step in range(2):
        models.train_step(chunks, optimizer, config, 100 + step)
    if offloader:
        out["offloaded_before_load"] = offloader.is_offloaded
    with DeviceWatch(offloader) as watch:
        load(chunks, optimizer, directory, offload)
    if offloader:
        out["load"] = watch.figures()
        out["offloaded_after_load"] = all_released(offloader)
        out["disk_after_load"] = _disk_figures(offloader)
    out["loaded_running"] = [
        models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER, STEPS)
    ]
    out["loaded_running_snapshot"] = offloaded_snapshot(chunks, optimizer, offloader)
    if offloader:
        stats = offloader.stats()
        out["sizes"] = (stats["host_bytes"], stats["disk_bytes"], stats["tracked_bytes"])
        out["host_equals_tracked"] = stats["host_bytes"] == stats["tracked_bytes"]
        out["update_chunks"] = stats["update_chunks"]
        for engine in offloader.engines:  # the last offload's D2H has nothing after it to order it
            engine.synchronize_host()
    check_devices(devices)
    out["checked"] = len(devices)
    torch.distributed.barrier()
    return out


# On every megatron-core line (0.16 to 0.19, mark ``floor``): a synchronous fp32 save, and the
# asynchronous bf16 saves in whole and chunked mode on the checked device (the plain-device
# variants of the same saves run on the main line only).
_EVERY_LINE = pytest.mark.floor


@pytest.mark.parametrize(
    "dtype,async_save,checked,chunked",
    [
        pytest.param("fp32", False, False, False, id="fp32-sync", marks=_EVERY_LINE),
        pytest.param("bf16", False, False, False, id="bf16-sync"),
        pytest.param("bf16", True, False, False, id="bf16-async"),
        pytest.param("bf16", True, True, False, id="bf16-async-checked-device", marks=_EVERY_LINE),
        pytest.param("bf16", True, True, True, id="bf16-async-checked-chunked", marks=_EVERY_LINE),
    ],
)
def test_save_while_offloaded_then_resume_is_bitwise(
    rank_pool, tmp_path, dtype, async_save, checked, chunked
):
    reference = rank_pool.run(checkpoint_job, False, dtype, async_save, str(tmp_path / "ref"))
    offloaded = rank_pool.run(
        checkpoint_job, True, dtype, async_save, str(tmp_path / "off"), checked, chunked
    )
    assert all(rank["checked"] == (3 if checked else 0) for rank in offloaded)
    assert all((rank["update_chunks"] >= 2) == chunked for rank in offloaded)
    for ref, off in zip(reference, offloaded):
        if async_save:  # the writer was still writing when the run had stepped past the save
            assert ref["written_while_training"] and off["written_while_training"]
        # Saved and loaded from the host copy: no state storage regrown, no allocation, and
        # offloaded right after (measured inside megatron-core's per-parameter accesses).
        assert off["offloaded_at_save"] and off["offloaded_after_save"]
        assert (
            off["offloaded_before_load"]
            and off["offloaded_after_load"]
            and off["host_equals_tracked"]
        )
        for call in ("save", "load"):
            assert off[call]["probes"] > 2 and off[call]["peak_state_bytes"] == 0, (call, off[call])
            assert off[call]["allocations"] == off[call]["copies"] == 0, (call, off[call])
        # Offloading changes nothing, in any phase.
        assert_phases_equal(ref, off, ("uninterrupted", "resumed", "loaded_running"))
        # Resuming continues exactly as the run that never stopped.
        assert off["resumed"] == off["uninterrupted"][SAVE_AFTER:]
        assert off["loaded_running"] == off["uninterrupted"][SAVE_AFTER:]
        for phase in ("resumed", "loaded_running"):
            for section in ("params", "optimizer"):
                assert tensors_equal(
                    off["uninterrupted_snapshot"][section], off[phase + "_snapshot"][section]
                ), phase


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_and_load_with_states_in_the_disk_tier_resume_bitwise(
    rank_pool, tmp_path, tmp_path_factory, async_save
):
    """60% of the host copies in the disk tier: saved from its file and loaded into it with no
    device bytes, its pages out of host memory after each, and the same resumes."""
    from tests.harness.disk import disk_directory

    disk = disk_directory(tmp_path_factory)
    reference = rank_pool.run(checkpoint_job, False, "bf16", async_save, str(tmp_path / "ref"))
    tiered = rank_pool.run(
        checkpoint_job, True, "bf16", async_save, str(tmp_path / "off"), disk=disk
    )
    for ref, off in zip(reference, tiered):
        assert off["offloaded_at_save"] and off["offloaded_after_save"]
        assert off["offloaded_before_load"] and off["offloaded_after_load"]
        host, disk_bytes, tracked = off["sizes"]
        # The arena reserved at attach (up to the budget, 40%) holds the pieces that fit it.
        assert host <= 0.4 * tracked and host + disk_bytes >= tracked, off["sizes"]
        for call in ("save", "load"):
            assert off[call]["probes"] > 2 and off[call]["peak_state_bytes"] == 0, (call, off[call])
            assert off[call]["allocations"] == off[call]["copies"] == 0, (call, off[call])
            figures = off[f"disk_after_{call}"]
            assert figures["disk_bytes"] > 0 and figures["page_cache"] == 0, (call, figures)
        assert_phases_equal(ref, off, ("uninterrupted", "resumed", "loaded_running"))
        assert off["resumed"] == off["uninterrupted"][SAVE_AFTER:]
        assert off["loaded_running"] == off["uninterrupted"][SAVE_AFTER:]
