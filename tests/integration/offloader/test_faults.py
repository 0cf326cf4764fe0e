"""Faults off the happy path, injected at the boundary with torch (``tests/harness/faults.py``:
a device allocation that fails, an update that raises part-way), on real megatron-core (gloo
ranks; a touched released tensor kills the rank and fails the test with its exit code).

For every allocation of a reload, of a step's prefetch and of a wake: the operation raises a
``DeviceMemoryError`` that says what it needed and to call again, nothing it allocated stays
held (the raw storages of states, masters, parameters and gradients are what they were before
the call), ``stats()`` says so, the same call made again works, and training after it is
bitwise that of a run that never failed. An update that raises part-way leaves the states off
the device, what it wrote copied out, and training goes on bitwise as the plain run that
failed the same way. On two ranks, a wake that fails on one rank fails on both, with no hang.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.compare import same_run
from tests.integration.offloader.test_sleep import _device_bytes

STEPS = 3
PIECES = {"max_piece_bytes": 1 << 17}  # several pieces per kind: faults between them


def _points(count: int) -> list[int]:
    """Which allocations fail: every one (the first, the second, one in the middle and the
    last where there are more than 12)."""
    if count <= 12:
        return list(range(1, count + 1))
    return sorted({1, 2, count // 2, count})


def _build(freeze=None):
    from tests.harness import models

    return models.build("gpt", "bf16", freeze=freeze)


def _finish(chunks, optimizer, config, offloader, results, steps=STEPS):
    from tests.harness import models

    for step in range(len(results), steps):
        results.append(models.train_step(chunks, optimizer, config, step))
    if offloader is not None:
        offloader.detach()
    return {"results": results, "snapshot": models.snapshot(chunks, optimizer)}


def reference_job(fail_update_at=None, steps=STEPS):
    """The plain run (optionally with its step-1 update failing at the same place)."""
    from tests.harness import models
    from tests.harness.faults import failing_update

    chunks, optimizer, config = _build()
    results = [models.train_step(chunks, optimizer, config, 0)]
    if fail_update_at is not None:
        with failing_update(fail_update_at), pytest.raises(RuntimeError, match="injected"):
            models.train_step(chunks, optimizer, config, 1)
        results.append(None)  # the failed iteration
    return _finish(chunks, optimizer, config, None, results, steps)


def _count(call) -> int:
    from tests.harness.faults import AllocationFaults

    with AllocationFaults() as faults:
        call()
    return faults.count


def reload_fault_job(where: str):
    """``where``: "reload" (``offloader.reload()``, retried once it failed) or "step" (the
    step's own prefetch: each iteration's ``optimizer.step()`` fails once, at another
    allocation, and is called again). Failing allocations: ``_points``."""
    import megatron_offload
    from megatron_offload.errors import DeviceMemoryError
    from tests.harness import models
    from tests.harness.faults import AllocationFaults
    from tests.harness.fresh_memory import poison_regrowth

    chunks, optimizer, config = _build()
    offloader = megatron_offload.attach(optimizer, prefetch="step", **PIECES)
    poison_regrowth(offloader)
    results = [models.train_step(chunks, optimizer, config, 0)]
    released = _device_bytes(chunks, optimizer)
    count = _count(offloader.reload)
    offloader.offload()
    faults = []

    def failing_once(call, k):
        with AllocationFaults(fail_at=k):
            try:
                call()
                raise AssertionError(f"allocation {k} of {count} was not the offloader's")
            except DeviceMemoryError as error:
                faults.append(
                    {
                        "raised": str(error),
                        "device": _device_bytes(chunks, optimizer),
                        "resident": offloader.stats()["resident_bytes"],
                        "offloaded": offloader.is_offloaded,
                    }
                )
        return call()  # the same call, with the memory free

    points = _points(count)
    if where == "reload":
        for k in points:
            failing_once(offloader.reload, k)
            offloader.offload()
    else:
        attached_step = optimizer.step
        for k in points:
            optimizer.step = lambda k=k: failing_once(attached_step, k)
            results.append(models.train_step(chunks, optimizer, config, len(results)))
        optimizer.step = attached_step
    steps = len(results) + 2
    return {
        "count": count,
        "faults": faults,
        "released": released,
        "steps": steps,
        **_finish(chunks, optimizer, config, offloader, results, steps),
    }


@pytest.mark.parametrize("where", ["reload", "step"])
def test_an_out_of_memory_at_any_allocation_of_a_reload_holds_nothing(
    rank_pool, where, reference_run
):
    runs = rank_pool.run(reload_fault_job, where)
    references = reference_run(reference_job, steps=runs[0]["steps"])
    for reference, run in zip(references, runs):
        assert run["count"] >= 3, run["count"]  # several pieces: faults between them
        assert len(run["faults"]) == len(_points(run["count"]))
        for fault in run["faults"]:
            assert "needed" in fault["raised"] and "call it again" in fault["raised"], fault
            # Nothing the failed reload regrew is held: states and masters are as released.
            assert fault["device"] == run["released"], (fault["device"], run["released"])
            assert fault["resident"] == 0 and fault["offloaded"]
        assert same_run(reference, run)


CHUNKED = {"chunked_update_bytes": 1 << 18}


def update_fault_job(fail_at: int, options: dict):
    """The step-1 update raises part-way under attach's cycle; the loop goes on."""
    import megatron_offload
    from tests.harness import models
    from tests.harness.faults import failing_update

    chunks, optimizer, config = _build()
    offloader = megatron_offload.attach(optimizer, **options)
    results = [models.train_step(chunks, optimizer, config, 0)]
    with failing_update(fail_at), pytest.raises(RuntimeError, match="injected"):
        models.train_step(chunks, optimizer, config, 1)
    after = {
        "device": _device_bytes(chunks, optimizer),
        "resident": offloader.stats()["resident_bytes"],
    }
    results.append(None)  # the failed iteration
    return {"after": after, **_finish(chunks, optimizer, config, offloader, results)}


@pytest.mark.parametrize("mode", ["whole", "chunked"])
def test_an_update_that_raises_part_way_leaves_the_states_off_the_device(
    rank_pool, mode, reference_run
):
    """The chunked update streams the states chunk by chunk; failing in a later chunk, what the
    earlier ones wrote went back to the host, as the plain run keeps its partial update."""
    fail_at = 3 if mode == "whole" else 20  # some parameters updated, the rest not
    references = reference_run(reference_job, fail_update_at=fail_at)
    runs = rank_pool.run(update_fault_job, fail_at, PIECES if mode == "whole" else CHUNKED)
    for reference, run in zip(references, runs):
        after = run["after"]
        assert after["resident"] == 0
        assert after["device"]["states"] == after["device"]["masters"] == 0, after
        assert same_run(reference, run)  # what it wrote was copied out, not lost


def wake_fault_job(failing_rank: int | None = None):
    """Sleep after step 0, then a wake failing at each of its allocations in turn (on
    ``failing_rank`` only, or on every rank), then a wake that works and the next steps."""
    import megatron_offload
    from megatron_offload.errors import DeviceMemoryError
    from tests.harness import models
    from tests.harness.faults import AllocationFaults
    from tests.harness.fresh_memory import poison_regrowth

    rank = torch.distributed.get_rank()
    chunks, optimizer, config = _build(freeze="position_embeddings")
    offloader = megatron_offload.attach(optimizer, **PIECES)
    poison_regrowth(offloader)
    results = [models.train_step(chunks, optimizer, config, 0)]
    offloader.sleep()
    asleep = _device_bytes(chunks, optimizer)
    count = _count(offloader.wake)
    offloader.sleep()
    faults = []
    for k in _points(count):
        mine = failing_rank is None or failing_rank == rank
        with AllocationFaults(fail_at=k if mine else None):
            try:
                offloader.wake()
                raised = None
            except DeviceMemoryError as error:
                raised = str(error)
        faults.append(
            {
                "raised": raised,
                "device": _device_bytes(chunks, optimizer),
                "sleeping": offloader.sleeping,
                "stats_asleep": offloader.stats()["asleep"],
            }
        )
        if raised is None:
            offloader.sleep()  # the wake went through (an allocation not its own): again
    offloader.wake()
    return {
        "count": count,
        "faults": faults,
        "asleep": asleep,
        **_finish(chunks, optimizer, config, offloader, results),
    }


def frozen_reference_job():
    from tests.harness import models

    chunks, optimizer, config = _build(freeze="position_embeddings")
    results = [models.train_step(chunks, optimizer, config, 0)]
    return _finish(chunks, optimizer, config, None, results)


@pytest.mark.parametrize("failing", ["every rank", "rank 1"])
def test_a_wake_that_meets_an_out_of_memory_keeps_everything_and_works_again(
    rank_pool, failing, reference_run
):
    references = reference_run(frozen_reference_job)
    runs = rank_pool.run(wake_fault_job, None if failing == "every rank" else 1)
    for rank, (reference, run) in enumerate(zip(references, runs)):
        assert run["count"] >= 4, run["count"]  # gradients, parameters, masters' pieces
        failed = [fault for fault in run["faults"] if fault["raised"] is not None]
        assert len(failed) == len(_points(run["count"])), run["faults"]
        for fault in failed:
            # Every rank raises (the all-gather is never entered by one rank alone); the
            # other rank's message says where the memory was missing.
            if failing == "rank 1" and rank == 0:
                assert "another rank" in fault["raised"], fault["raised"]
            else:
                assert "needed" in fault["raised"] and "call it again" in fault["raised"]
            assert fault["device"] == run["asleep"], (fault["device"], run["asleep"])
            assert fault["sleeping"] and fault["stats_asleep"]
        assert same_run(reference, run)


def full_disk_job(offload: bool, directory: str):
    """A synchronous save while offloaded meets a full disk: it raises on every rank, the
    states stay offloaded with their host copy intact, training goes on, and a save made again
    resumes bitwise."""
    import megatron_offload
    from tests.harness import checkpoints, models
    from tests.harness.faults import FullDisk

    failed = checkpoints.shared_directory(directory + "/failed")
    saved = checkpoints.shared_directory(directory + "/saved")
    chunks, optimizer, config = models.build("mlp", "bf16")
    offloader = megatron_offload.attach(optimizer) if offload else None
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    found = {}
    if offload:
        before = _device_bytes_mlp(optimizer)
        with FullDisk(failed) as disk:
            try:
                checkpoints.save(chunks, optimizer, failed, async_save=False)
                found["raised"] = None
            except BaseException as error:  # torch.distributed.checkpoint raises a BaseException
                found["raised"] = f"{type(error).__name__}: {error}"
        found["writes_failed"] = disk.failed
        found["still_offloaded"] = offloader.is_offloaded and _device_bytes_mlp(optimizer) == before
    checkpoints.save(chunks, optimizer, saved, async_save=False)
    results += [models.train_step(chunks, optimizer, config, step) for step in range(2, 4)]
    if offloader is not None:
        offloader.detach()
    found["snapshot"] = models.snapshot(chunks, optimizer)
    torch.manual_seed(99)
    chunks, optimizer, config = models.build("mlp", "bf16")
    offloader = megatron_offload.attach(optimizer) if offload else None
    checkpoints.load(chunks, optimizer, saved, offload)
    resumed = [models.train_step(chunks, optimizer, config, step) for step in range(2, 4)]
    if offloader is not None:
        offloader.detach()
    found.update(
        results=results, resumed=resumed, resumed_snapshot=models.snapshot(chunks, optimizer)
    )
    torch.distributed.barrier()
    return found


def _device_bytes_mlp(optimizer) -> int:
    from tests.harness import models

    total = 0
    for wrapper in models.megatron_optimizers(optimizer):
        for state in dict.values(wrapper.optimizer.state):
            for value in dict.values(state):
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    total += value.untyped_storage().nbytes()
    return total


def test_a_full_disk_during_a_save_while_offloaded_loses_nothing(
    rank_pool, tmp_path, reference_run
):
    references = reference_run(full_disk_job, False, str(tmp_path / "plain"))
    runs = rank_pool.run(full_disk_job, True, str(tmp_path / "offload"))
    for reference, run in zip(references, runs):
        assert run["raised"] is not None and run["writes_failed"] > 0, run["raised"]
        assert run["still_offloaded"]
        assert run["results"] == reference["results"]
        assert run["resumed"] == reference["resumed"] == reference["results"][2:]
        for snapshot in ("snapshot", "resumed_snapshot"):
            for section in ("params", "optimizer"):
                for key, value in reference[snapshot][section].items():
                    assert torch.equal(value, run[snapshot][section][key]), (snapshot, key)


def interrupt_job():
    """``offload()`` and ``reload()`` interrupted at each of their copies in turn: nothing is
    left regrown or half-moved, the same call works again, training goes on bitwise."""
    import megatron_offload
    from tests.harness import models
    from tests.harness.faults import interrupted_copy
    from tests.harness.fresh_memory import poison_regrowth

    chunks, optimizer, config = _build()
    offloader = megatron_offload.OptimizerStateOffloader(optimizer, **PIECES)
    poison_regrowth(offloader)
    results = [models.train_step(chunks, optimizer, config, 0)]
    offloader.offload()
    offloader.reload()
    offloader.wait()  # consolidated: one copy per piece from now on
    resident = _device_bytes(chunks, optimizer)
    offloader.offload()
    released = _device_bytes(chunks, optimizer)
    pieces = sum(offloader.stats()["pieces"].values())
    found = {"pieces": pieces, "reload": [], "offload": []}
    for k in _points(pieces):
        with interrupted_copy(k):
            try:
                offloader.reload()
            except KeyboardInterrupt:
                found["reload"].append(_device_bytes(chunks, optimizer) == released)
        offloader.reload()
        offloader.wait()
        with interrupted_copy(k):
            try:
                offloader.offload()
            except KeyboardInterrupt:
                found["offload"].append(offloader.stats()["resident_bytes"] > 0)
        offloader.offload()
        found.setdefault("offloaded", []).append(_device_bytes(chunks, optimizer) == released)
    found["resident"] = resident != released
    return {**found, **_finish(chunks, optimizer, config, offloader, results)}


def test_an_interrupt_inside_a_copy_leaves_a_state_the_same_call_completes(
    rank_pool, reference_run
):
    references = reference_run(reference_job)
    runs = rank_pool.run(interrupt_job)
    for reference, run in zip(references, runs):
        points = len(_points(run["pieces"]))
        assert run["pieces"] >= 3 and run["resident"]
        assert run["reload"] == [True] * points  # nothing regrown is held
        assert run["offload"] == [True] * points  # what was not copied stayed on the device
        assert run["offloaded"] == [True] * points  # and the same call moved it
        assert same_run(reference, run)


def chunked_fault_job():
    """The chunked update's own allocations (its slots) failing, one per iteration: the step
    raises a DeviceMemoryError before any state moved, nothing stays held, and the same
    ``optimizer.step()`` made again works."""
    import megatron_offload
    from megatron_offload.errors import DeviceMemoryError
    from tests.harness import models
    from tests.harness.faults import AllocationFaults

    chunks, optimizer, config = _build()
    offloader = megatron_offload.attach(optimizer, **CHUNKED)
    results = [models.train_step(chunks, optimizer, config, 0)]
    attached_step = optimizer.step
    counted = []

    def counting():
        with AllocationFaults() as faults:
            result = attached_step()
        counted.append(faults.count)
        return result

    optimizer.step = counting
    results.append(models.train_step(chunks, optimizer, config, 1))
    count = counted[0]
    faults = []

    def failing_once(k):
        with AllocationFaults(fail_at=k):
            try:
                attached_step()
                faults.append(None)
            except DeviceMemoryError as error:
                faults.append(
                    {
                        "raised": str(error),
                        "device": _device_bytes(chunks, optimizer),
                        "resident": offloader.stats()["resident_bytes"],
                    }
                )
                return attached_step()  # the same call, with the memory free
        return None

    for k in range(1, count + 1):
        optimizer.step = lambda k=k: failing_once(k)
        results.append(models.train_step(chunks, optimizer, config, len(results)))
    optimizer.step = attached_step
    steps = len(results) + 1
    return {
        "count": count,
        "faults": faults,
        "steps": steps,
        **_finish(chunks, optimizer, config, offloader, results, steps),
    }


def retried_reference_job(retried: int, steps: int):
    """The plain run whose inner update fails once (out of memory) in each of the
    ``retried`` iterations after the first two, and whose loop calls ``optimizer.step()``
    again: megatron-core prepares and clips the gradients a second time, as it does for the
    chunked run retrying its step."""
    from tests.harness import models
    from tests.harness.faults import Failing

    chunks, optimizer, config = _build()
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    plain_step, inner = optimizer.step, models.megatron_optimizers(optimizer)[0].optimizer

    def failing_once():
        with Failing(type(inner), "step", 1, torch.OutOfMemoryError("injected")):
            try:
                plain_step()
            except torch.OutOfMemoryError:
                pass
        return plain_step()

    optimizer.step = failing_once
    for _ in range(retried):
        results.append(models.train_step(chunks, optimizer, config, len(results)))
    optimizer.step = plain_step
    return _finish(chunks, optimizer, config, None, results, steps)


def test_the_chunked_update_meeting_an_out_of_memory_holds_nothing(rank_pool, reference_run):
    runs = rank_pool.run(chunked_fault_job)
    retried = len(runs[0]["faults"])
    references = reference_run(retried_reference_job, retried, runs[0]["steps"])
    for reference, run in zip(references, runs):
        assert run["count"] >= 2 and None not in run["faults"], run["faults"]  # every slot
        for fault in run["faults"]:
            assert "chunked update's slots" in fault["raised"], fault["raised"]
            assert "call it again" in fault["raised"]
            assert fault["device"]["states"] == 0 and fault["resident"] == 0, fault
        assert same_run(reference, run)


def corrupt_checkpoint_job(offload: bool, directory: str):
    """A checkpoint whose files are cut short, loaded into a running optimizer: the load
    raises on every rank, nothing it allocated stays held, and loading the good checkpoint
    again trains on bitwise."""
    import glob
    import os

    import megatron_offload
    from tests.harness import checkpoints, models

    good = checkpoints.shared_directory(directory + "/good")
    cut = checkpoints.shared_directory(directory + "/cut")
    chunks, optimizer, config = models.build("mlp", "bf16")
    offloader = megatron_offload.attach(optimizer) if offload else None
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    checkpoints.save(chunks, optimizer, good, async_save=False)
    checkpoints.save(chunks, optimizer, cut, async_save=False)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        for path in glob.glob(os.path.join(cut, "*.distcp")):
            with open(path, "r+b") as handle:
                handle.truncate(os.path.getsize(path) // 2)
    torch.distributed.barrier()
    results += [models.train_step(chunks, optimizer, config, step) for step in range(2, 3)]
    found = {}
    host = offloader.stats()["host_bytes"] if offload else None
    try:
        checkpoints.load(chunks, optimizer, cut, offload)
        found["raised"] = None
    except BaseException as error:  # torch.distributed.checkpoint raises a BaseException
        found["raised"] = type(error).__name__
    if offload:
        stats = offloader.stats()
        found["held"] = (stats["host_bytes"] == host, stats["resident_bytes"])
    torch.distributed.barrier()
    checkpoints.load(chunks, optimizer, good, offload)
    results += [models.train_step(chunks, optimizer, config, step) for step in range(2, 4)]
    if offloader is not None:
        offloader.detach()
    found.update(results=results, snapshot=models.snapshot(chunks, optimizer))
    return found


def test_a_checkpoint_cut_short_fails_its_load_and_the_good_one_resumes(
    rank_pool, tmp_path, reference_run
):
    references = reference_run(corrupt_checkpoint_job, False, str(tmp_path / "plain"))
    runs = rank_pool.run(corrupt_checkpoint_job, True, str(tmp_path / "offload"))
    for reference, run in zip(references, runs):
        assert run["raised"] is not None and run["raised"] == reference["raised"], run["raised"]
        assert run["held"][0], run["held"]  # no host memory left behind by the failed load
        assert run["results"] == reference["results"]
        for section in ("params", "optimizer"):
            for key, value in reference["snapshot"][section].items():
                assert torch.equal(value, run["snapshot"][section][key]), key


def _build_float16():
    """Megatron's non-distributed mixed-precision optimizer: its ``state_dict()`` holds every
    state (the distributed one saves them apart, through its sharded state dict)."""
    from tests.harness import models

    # No dropout: its random state is not part of what is saved, and the run that loads
    # must be the plain one bit for bit.
    return models.build(
        "gpt",
        "bf16",
        use_distributed_optimizer=False,
        transformer_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0},
    )


def load_fault_job(offload: bool):
    """A restarted job: a fresh model and optimizer (offloaded before the load when
    ``offload``) load what a trained one saved (``state_dict``; the states the load makes are
    adopted on the host). With ``offload``, the load fails at each of its allocations in turn
    (device and host, torch's own included; counted in a clean load first) and is made
    again, from where the failed one left the optimizer (as a loop that catches it would)."""
    import megatron_offload
    from megatron_offload.errors import DeviceMemoryError, HostMemoryError
    from tests.harness import models
    from tests.harness.faults import AllocationFaults, shared_mapping_bytes

    chunks, optimizer, config = _build_float16()
    results = [models.train_step(chunks, optimizer, config, 0)]
    saved = {"model": chunks[0].state_dict(), "optimizer": optimizer.state_dict()}
    torch.manual_seed(99)  # a different init: everything comes from what was saved
    chunks, optimizer, config = _build_float16()
    offloader = megatron_offload.attach(optimizer, **PIECES) if offload else None

    def load():
        chunks[0].load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    found = {"faults": []}
    if offload:
        offloader.offload()  # the masters on the host before the load
        with AllocationFaults(host=True) as counted:
            load()
        found["count"] = counted.count
        offloader.detach()  # and again, fresh, for each failing allocation
        torch.manual_seed(99)
        chunks, optimizer, config = _build_float16()
        offloader = megatron_offload.attach(optimizer, **PIECES)
        offloader.offload()
        for k in range(1, counted.count + 1):
            stats, mapped = offloader.stats(), shared_mapping_bytes()
            with AllocationFaults(fail_at=k, host=True) as faults:
                try:
                    load()
                    raised = None
                except (torch.OutOfMemoryError, MemoryError, OSError) as error:
                    raised = error
            after = offloader.stats()
            found["faults"].append(
                {
                    "ours": isinstance(raised, (DeviceMemoryError, HostMemoryError)),
                    # A load made again after a partial one may allocate less.
                    "raised": raised is not None or faults.count < k,
                    "reached": faults.count >= k,
                    # Host memory held or given back is counted so.
                    "host": (shared_mapping_bytes() > mapped)
                    == (after["host_bytes"] > stats["host_bytes"]),
                }
            )
    load()
    results += [models.train_step(chunks, optimizer, config, step) for step in range(1, 3)]
    if offloader is not None:
        found["offloaded"] = (
            offloader.stats()["offloaded_bytes"] == offloader.stats()["tracked_bytes"]
        )
        offloader.detach()
    return {**found, "results": results, "snapshot": models.snapshot(chunks, optimizer)}


def test_a_load_while_offloaded_meeting_an_out_of_memory_holds_nothing(rank_pool, reference_run):
    references = reference_run(load_fault_job, False)
    runs = rank_pool.run(load_fault_job, True)
    for reference, run in zip(references, runs):
        assert run["count"] >= 3, run["count"]
        assert len(run["faults"]) == run["count"]
        assert all(f["raised"] and f["host"] for f in run["faults"]), run["faults"]
        assert any(f["ours"] for f in run["faults"]), run["faults"]
        assert sum(f["reached"] for f in run["faults"]) >= 3, run["faults"]
        assert run["offloaded"]
        assert same_run(reference, run)


def after_step_fault_job(fail: bool):
    """SGD with momentum (states the offloader cannot foresee: no arena reserved at attach):
    the offload that ends the first step lays out a host arena, and with ``fail`` the system
    refuses it. The step finished, so it returns, with a warning; the momentum stays on the
    device, counted; the next step's offload lays it out."""
    import warnings

    import megatron_offload
    from tests.harness import models
    from tests.harness.faults import AllocationFaults

    chunks, optimizer, config = models.build(
        "gpt", "bf16", optimizer="sgd", use_distributed_optimizer=False
    )
    offloader = megatron_offload.attach(optimizer, prefetch="step", **PIECES)
    found = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AllocationFaults(fail_at=1 if fail else None, host=True, device=False) as faults:
            results = [models.train_step(chunks, optimizer, config, 0)]
    stats = offloader.stats()
    found["count"] = faults.count
    found["warned"] = [str(w.message) for w in caught if "after the step" in str(w.message)]
    found["counted"] = (stats["resident_bytes"], _float16_state_bytes(optimizer))
    found["unlaid"] = stats["unlaid_bytes"]
    results += [models.train_step(chunks, optimizer, config, step) for step in (1, 2)]
    stats = offloader.stats()
    found["offloaded_later"] = stats["offloaded_bytes"] == stats["tracked_bytes"] > 0
    return {**found, **_finish(chunks, optimizer, config, offloader, results)}


def test_an_offload_after_the_step_meeting_an_out_of_memory_warns_and_goes_on(
    rank_pool, reference_run
):
    references = reference_run(reference_sgd_job)
    clean = rank_pool.run(after_step_fault_job, False)
    runs = rank_pool.run(after_step_fault_job, True)
    for reference, ok, run in zip(references, clean, runs):
        assert ok["count"] >= 1 and not ok["warned"] and ok["unlaid"] == 0, ok
        assert len(run["warned"]) == 1 and "do not repeat it" in run["warned"][0], run["warned"]
        assert run["unlaid"] > 0 and run["counted"][0] == run["counted"][1], run
        assert run["offloaded_later"] and ok["offloaded_later"]
        assert same_run(reference, run) and same_run(reference, ok)


def _float16_state_bytes(optimizer) -> int:
    """Device bytes of the masters and states of Megatron's non-distributed optimizer (the
    raw storages, each once: tensors the offloader consolidated share one)."""
    from tests.harness import models

    storages = {}
    for wrapper in models.megatron_optimizers(optimizer):
        tensors = [master for group in wrapper.fp32_from_float16_groups for master in group]
        for state in dict.values(wrapper.optimizer.state):
            tensors += [
                value
                for value in dict.values(state)
                if isinstance(value, torch.Tensor) and value.numel() > 1
            ]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def reference_sgd_job():
    from tests.harness import models

    chunks, optimizer, config = models.build(
        "gpt", "bf16", optimizer="sgd", use_distributed_optimizer=False
    )
    results = [models.train_step(chunks, optimizer, config, step) for step in range(3)]
    return _finish(chunks, optimizer, config, None, results)


def sleep_fault_job(failing_rank: int | None = None):
    """After step 0, a sleep whose host copies of the parameters it cannot rebuild (a frozen
    one) the system refuses (on ``failing_rank`` only, or on every rank): it raises on every
    rank before anything is given up, still awake, nothing more mapped than counted; the same
    sleep made again works (no rank waits alone in its node check), and training after the
    wake is bitwise."""
    import megatron_offload
    from megatron_offload.errors import HostMemoryError
    from tests.harness import models
    from tests.harness.faults import AllocationFaults, shared_mapping_bytes

    chunks, optimizer, config = _build(freeze="position_embeddings")
    offloader = megatron_offload.attach(optimizer, **PIECES)
    results = [models.train_step(chunks, optimizer, config, 0)]
    awake, mapped, host = (
        _device_bytes(chunks, optimizer),
        shared_mapping_bytes(),
        offloader.stats()["host_bytes"],
    )
    found = {"raised": None}
    mine = failing_rank is None or failing_rank == torch.distributed.get_rank()
    with AllocationFaults(fail_at=1 if mine else None, host=True, device=False) as faults:
        try:
            offloader.sleep()
        except HostMemoryError as error:
            found["raised"] = str(error)
    found.update(
        count=faults.count,
        awake=not offloader.sleeping and _device_bytes(chunks, optimizer) == awake,
        # A rank that got its copies keeps them (counted) for the next sleep.
        held=_same_sign(shared_mapping_bytes() - mapped, offloader.stats()["host_bytes"] - host),
    )
    offloader.sleep()
    found["asleep"] = offloader.sleeping
    offloader.wake()
    return {**found, **_finish(chunks, optimizer, config, offloader, results)}


@pytest.mark.parametrize("failing", ["every rank", "rank 1"])
def test_a_sleep_the_system_refuses_host_memory_gives_up_nothing(rank_pool, failing, reference_run):
    references = reference_run(frozen_reference_job)
    runs = rank_pool.run(sleep_fault_job, None if failing == "every rank" else 1)
    for rank, (reference, run) in enumerate(zip(references, runs)):
        assert run["count"] >= 1 and run["raised"] is not None, run
        assert "host memory" in run["raised"] and "call it again" in run["raised"], run["raised"]
        if failing == "rank 1" and rank == 0:
            assert "another rank" in run["raised"], run["raised"]
        assert run["awake"] and run["held"] and run["asleep"], run
        assert same_run(reference, run)


def _same_sign(a: int, b: int) -> bool:
    return (a > 0) == (b > 0) and (a < 0) == (b < 0)


def staging_fault_job():
    """The chunked update's first step copies the states it makes to the host as it goes;
    the system refuses that staging memory: the step raises a HostMemoryError, the states
    it made leave the device with the cycle's offload (counted: nothing resident, nothing
    mapped that stats() does not count), and the next steps train on."""
    import megatron_offload
    from megatron_offload.errors import HostMemoryError
    from tests.harness import models
    from tests.harness.faults import AllocationFaults, shared_mapping_bytes

    chunks, optimizer, config = _build()
    offloader = megatron_offload.attach(optimizer, **CHUNKED)
    mapped, host = shared_mapping_bytes(), offloader.stats()["host_bytes"]
    found = {"raised": None}
    with AllocationFaults(fail_at=1, host=True, device=False) as faults:
        try:
            models.train_step(chunks, optimizer, config, 0)
        except HostMemoryError as error:
            found["raised"] = str(error)
    stats = offloader.stats()
    found.update(
        count=faults.count,
        resident=(stats["resident_bytes"], _device_bytes(chunks, optimizer)["states"]),
        held=_same_sign(shared_mapping_bytes() - mapped, stats["host_bytes"] - host),
    )
    results = [models.train_step(chunks, optimizer, config, step) for step in (1, 2)]
    stats = offloader.stats()
    found["offloaded"] = stats["offloaded_bytes"] == stats["tracked_bytes"] > 0
    found["finite"] = all(torch.isfinite(torch.tensor(r["loss"])) for r in results)
    offloader.detach()
    return found


def test_the_chunked_update_refused_its_staging_memory_raises_and_trains_on(rank_pool):
    for run in rank_pool.run(staging_fault_job):
        assert run["raised"] is not None and "staging" in run["raised"], run
        assert "loop's decision" in run["raised"] and run["count"] >= 1, run
        assert run["resident"] == (0, 0) and run["held"], run
        assert run["offloaded"] and run["finite"], run
