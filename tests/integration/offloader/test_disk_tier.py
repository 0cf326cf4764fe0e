"""The disk tier (``offload_disk_dir``) on real megatron-core: a bf16 GPT on 2 gloo ranks with
a host budget of 40% of its states and masters trains bitwise as the same run without
offloading, whole and with the chunked update, while

* the rest lives in a file under the directory both ranks share (``disk_bytes``), with no
  name in it (unlinked from the start) and nothing open or mapped there after ``detach``;
* between steps, the optimizer states and masters hold 0 bytes of device memory, the arena
  holds at most the budget, and the page cache of the file (measured here with ``mincore``,
  apart from ``stats()``) is 0: host memory stays within the budget, not the file's size;
* in the first step, where the chunked update stages the states it makes (to disk, over the
  budget), each chunk's are written back and out of the page cache before the next chunk.

Jobs run in rank processes (a touched released tensor kills the rank and fails the test with
its exit code).
"""

from __future__ import annotations

import pytest

from tests.harness.compare import differences
from tests.harness.disk import disk_directory, held_in, page_cache_bytes

STEPS = 3
FRACTION = 0.4  # of the states and masters the host budget holds


def _device_bytes(optimizer) -> int:
    """Bytes of the raw storages of the optimizer states and fp32 masters, each once."""
    import torch

    from tests.harness import models

    seen, total = set(), 0
    for wrapper in models.megatron_optimizers(optimizer):
        tensors = [m for group in wrapper.shard_fp32_from_float16_groups for m in group]
        for state in dict.values(wrapper.optimizer.state):  # the raw mapping, not a guarded read
            tensors += [v for v in dict.values(state) if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.numel() > 1 and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def disk_job(directory: str | None, chunked: bool):
    import gc
    import os

    import megatron_offload
    from tests.harness import models
    from tests.harness.checkpoints import chunked_options

    chunks, optimizer, config = models.build("gpt", "bf16")
    options = chunked_options(optimizer, {}) if chunked else {}
    results, between, offloader = [], [], None
    if directory is not None:
        probe = megatron_offload.attach(optimizer, **options)
        need = probe.stats()["host_bytes"]  # the arena for every state and master
        probe.detach()
        budget = int(need * FRACTION)
        options.update(host_memory_budget=budget, offload_disk_dir=directory)
        offloader = megatron_offload.attach(optimizer, **options)
    inner = [d.optimizer for d in models.distributed_optimizers(optimizer)]
    in_step, hooks = [], []
    if offloader is not None:
        # Sampled at every update of the first step (one per chunk when chunked): the page
        # cache of every file of the disk tier, the staging of the new states included.
        def sample(*_):
            files = [e.host.disk.buffer for e in offloader.engines if e.host.disk is not None]
            files += [f.buffer for e in offloader.engines for f in e.budget.files()]
            in_step.append(sum(page_cache_bytes(b) for b in {id(b): b for b in files}.values()))

        hooks = [o.register_step_post_hook(sample) for o in inner]
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        for hook in hooks:
            hook.remove()
        hooks = []
        if offloader is not None:
            stats = offloader.stats()
            files = [e.host.disk.buffer for e in offloader.engines if e.host.disk is not None]
            between.append(
                {
                    "need": need,
                    "budget": budget,
                    "host_bytes": stats["host_bytes"],
                    "disk_bytes": stats["disk_bytes"],
                    "device_bytes": _device_bytes(optimizer),
                    "page_cache": sum(page_cache_bytes(b) for b in files),
                    "disk_resident_bytes": stats["disk_resident_bytes"],
                    "names": os.listdir(directory),
                    "offloaded_bytes": stats["offloaded_bytes"],
                }
            )
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    left = None
    if offloader is not None:
        offloader.detach()
        del files
        gc.collect()
        left = held_in(directory)
    return {
        "results": results,
        "snapshot": snapshot,
        "between": between,
        "left": left,
        "in_first_step": in_step,
    }


@pytest.fixture
def plain_run(reference_run):
    """The run without offloading (``sleep_job`` without a directory): every job here trains
    the same steps from the same seeds. ``plain_run(True)``: with ``sleep_job``'s weight
    loads (``refit``)."""
    return lambda refit=False: reference_run(sleep_job, None, refit)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_budget_under_half_trains_bitwise_with_the_rest_on_disk(
    rank_pool, tmp_path_factory, chunked, plain_run
):
    directory = disk_directory(tmp_path_factory)
    plain = plain_run()
    tiered = rank_pool.run(disk_job, directory, chunked)
    for reference, run in zip(plain, tiered, strict=True):
        assert not differences(reference, run)
        for figures in run["between"]:
            assert figures["device_bytes"] == 0, figures
            assert figures["host_bytes"] <= figures["budget"] < figures["need"] / 2, figures
            assert figures["host_bytes"] + figures["disk_bytes"] >= figures["need"], figures
            assert figures["disk_bytes"] > figures["need"] / 2, figures
            assert figures["page_cache"] == figures["disk_resident_bytes"] == 0, figures
            assert figures["names"] == [], figures  # unlinked: no name, even for a moment
        assert run["left"] == []  # nothing open or mapped there after detach
        # At each update of the first step (with the chunked update, one per chunk, after
        # the update and before its new states are staged), the new states staged so far
        # are on disk and out of the page cache (before they were kept there: 438 KB of the
        # 656 KB of states and masters by the last chunk, over the 262 KB chunk budget).
        assert run["in_first_step"] and max(run["in_first_step"]) == 0, run["in_first_step"]


# ----------------------------------------------------------------------------- faults
# Injected at the boundary with the OS (``os`` calls that fail, a file cut short with
# ``ftruncate``), on every rank unless named.


def _failing(name: str, code: int, *, times: int = 1, result=None):
    """Make ``os.<name>`` fail with ``code`` for its next ``times`` calls (``result``: return
    that instead of raising); returns the undo."""
    import itertools
    import os

    # The I/O threads call it at once: the calls are counted atomically.
    original, calls = getattr(os, name), itertools.count()

    def failing(*args, **kwargs):
        if next(calls) < times:
            if result is not None:
                return result
            raise OSError(code, os.strerror(code))
        return original(*args, **kwargs)

    setattr(os, name, failing)
    return lambda: setattr(os, name, original)


def fault_job(directory: str, fault: str, failing_rank: int | None = None):
    import errno
    import os
    import warnings

    import torch

    import megatron_offload
    from megatron_offload.errors import DiskTierError, OffloadError
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    probe = megatron_offload.attach(optimizer)
    budget = int(probe.stats()["host_bytes"] * FRACTION)
    probe.detach()
    options = dict(host_memory_budget=budget, offload_disk_dir=directory, prefetch="step")
    mine = failing_rank is None or torch.distributed.get_rank() == failing_rank
    found, results = {}, []
    if fault == "full disk":
        before = _device_bytes(optimizer)
        undo = _failing("posix_fallocate", errno.ENOSPC) if mine else (lambda: None)
        try:
            megatron_offload.attach(optimizer, **options)
            found["raised"] = None
        except OffloadError as error:
            found["raised"] = (type(error).__name__, getattr(error, "errno", None), str(error))
        finally:
            undo()
        found["kept"] = _device_bytes(optimizer) == before > 0
        found["left"] = held_in(directory)
        found["attached"] = megatron_offload.find_offloader(optimizer) is not None
    offloader = megatron_offload.attach(optimizer, **options)
    results.append(models.train_step(chunks, optimizer, config, 0))
    if fault == "write":
        undo = _failing("pwrite", errno.EIO)  # the copies out are written with pwrite
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(models.train_step(chunks, optimizer, config, 1))
        undo()
        found["warned"] = [str(w.message) for w in caught if "disk tier" in str(w.message)]
        found["resident"] = (offloader.stats()["resident_bytes"], _device_bytes(optimizer))
    if fault in ("read", "short read"):
        # The step's copy back meets the error: ``optimizer.step()`` raises, and is called
        # again (as a loop retrying it would; the forward and backward are not repeated).
        released = _device_bytes(optimizer)
        attached_step = optimizer.step

        def failing_once():
            undo = (
                _failing("preadv", errno.EIO, result=0 if fault == "short read" else None)
                if mine
                else (lambda: None)
            )
            try:
                attached_step()
                found["raised"] = None
            except OffloadError as error:  # the failing rank's DiskTierError, or "another rank"
                found["raised"] = (type(error).__name__, getattr(error, "errno", None), str(error))
            finally:
                undo()
            found["held"] = (_device_bytes(optimizer), released)
            return attached_step()

        optimizer.step = failing_once
        results.append(models.train_step(chunks, optimizer, config, 1))
        optimizer.step = attached_step
    if fault == "cut short":
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(directory):
                    os.ftruncate(int(fd), 4096)
            except OSError:
                continue
        try:
            models.train_step(chunks, optimizer, config, len(results))
            found["raised"] = None
        except DiskTierError as error:
            found["raised"] = (error.errno, str(error))
        return found  # the states are lost: nothing to compare
    while len(results) < STEPS:
        results.append(models.train_step(chunks, optimizer, config, len(results)))
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    offloader.detach()
    return {"results": results, "snapshot": snapshot, **found}


@pytest.mark.parametrize("failing", ["every rank", "rank 1"])
def test_a_full_disk_at_attach_refuses_on_every_rank_leaving_nothing(
    rank_pool, tmp_path_factory, failing, plain_run
):
    directory = disk_directory(tmp_path_factory)
    plain = plain_run()
    runs = rank_pool.run(fault_job, directory, "full disk", None if failing == "every rank" else 1)
    for rank, (reference, run) in enumerate(zip(plain, runs, strict=True)):
        kind, code, message = run["raised"]
        if failing == "every rank" or rank == 1:
            assert kind == "DiskTierError" and code == 28 and directory in message, run["raised"]
        else:
            assert kind == "OffloadStateError" and "another rank" in message, run["raised"]
        assert run["kept"] and run["left"] == [] and not run["attached"], run
        assert not differences(reference, run)  # attached again after it: bitwise


def test_a_write_error_after_the_step_keeps_the_device_copy_and_trains_on(
    rank_pool, tmp_path_factory, plain_run
):
    directory = disk_directory(tmp_path_factory)
    plain = plain_run()
    runs = rank_pool.run(fault_job, directory, "write")
    for reference, run in zip(plain, runs, strict=True):
        assert len(run["warned"]) == 1 and "do not repeat it" in run["warned"][0], run["warned"]
        counted, device = run["resident"]
        assert counted == device > 0, run["resident"]  # kept on the device, and counted
        assert not differences(reference, run)


@pytest.mark.parametrize(
    "fault,failing", [("read", None), ("short read", None), ("read", 1)], ids=str
)
def test_a_read_error_raises_before_anything_is_regrown_and_the_step_works_again(
    rank_pool, tmp_path_factory, fault, failing, plain_run
):
    """On every rank, or on rank 1 alone: then rank 0 raises too (no rank goes on into the
    gradient reduction to wait there), and gives back what it regrew."""
    directory = disk_directory(tmp_path_factory)
    plain = plain_run()
    runs = rank_pool.run(fault_job, directory, fault, failing)
    for rank, (reference, run) in enumerate(zip(plain, runs, strict=True)):
        kind, code, message = run["raised"]
        if failing is None or rank == failing:
            assert kind == "DiskTierError" and code == 5 and directory in message, message
            assert "Nothing was copied" in message, message
        else:
            assert kind == "OffloadStateError" and "another rank" in message, message
        held, released = run["held"]
        assert held == released == 0, run["held"]
        assert not differences(reference, run)  # the same step, made again


def test_a_file_cut_short_is_a_clear_error_not_a_sigbus(rank_pool, tmp_path_factory):
    directory = disk_directory(tmp_path_factory)
    for run in rank_pool.run(fault_job, directory, "cut short"):
        code, message = run["raised"]
        assert code == 5 and "cut short" in message and "last checkpoint" in message, message


# ----------------------------------------------------------------------------- sleep
def sleep_job(directory: str | None, refit: bool):
    """Steps with a sleep and a wake after each (``directory`` None: the plain run, no
    sleep). ``refit``: the parameters are changed after each step without the optimizer (a
    weight load), so sleep cannot rebuild them from the masters and copies them; those
    copies do not fit the budget either and go to the disk tier too."""
    import megatron_offload
    from tests.harness import models
    from tests.integration.offloader.test_sleep import _device_bytes as model_device_bytes
    from tests.integration.offloader.test_sleep import _load_weights, _rollout_block

    chunks, optimizer, config = models.build("gpt", "bf16")
    offloader = None
    if directory is not None:
        probe = megatron_offload.attach(optimizer)
        budget = int(probe.stats()["host_bytes"] * FRACTION)
        probe.detach()
        offloader = megatron_offload.attach(
            optimizer, host_memory_budget=budget, offload_disk_dir=directory
        )
    results, asleep = [], []
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if refit:
            _load_weights(chunks)
        if offloader is None:
            continue
        offloader.sleep()
        engines = [e.host.disk.buffer for e in offloader.engines if e.host.disk is not None]
        spilled = [f.buffer for f in offloader.engines[0].budget.files()]
        stats = offloader.stats()
        asleep.append(
            {
                "device": model_device_bytes(chunks, optimizer),
                "page_cache": sum(page_cache_bytes(b) for b in engines + spilled),
                "spilled": sum(b.numel() for b in spilled),
                "host_bytes": stats["host_bytes"],
                "disk_bytes": (stats["disk_bytes"], stats["sleep_disk_bytes"]),
                "budget": budget,
            }
        )
        _rollout_block()
        offloader.wake()
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    if offloader is not None:
        offloader.detach()
    return {"results": results, "snapshot": snapshot, "asleep": asleep}


@pytest.mark.parametrize("refit", [False, True], ids=["rebuilt", "copied parameters"])
def test_sleep_and_wake_with_the_rest_on_disk_train_bitwise(
    rank_pool, tmp_path_factory, refit, plain_run
):
    directory = disk_directory(tmp_path_factory)
    plain = plain_run(refit)
    runs = rank_pool.run(sleep_job, directory, refit)
    for reference, run in zip(plain, runs, strict=True):
        assert not differences(reference, run)
        for figures in run["asleep"]:
            device = figures["device"]
            assert device["states"] == device["masters"] == device["parameters"] == 0, figures
            assert figures["page_cache"] == 0, figures
            assert (figures["spilled"] > 0) == refit, figures  # the copies, in the disk tier
            assert figures["disk_bytes"][1] == figures["spilled"], figures  # and counted there
            assert figures["host_bytes"] <= figures["budget"], figures


# ------------------------------------------------------------- "auto" and the node check
def auto_job(directory: str | None):
    """``host_memory_budget="auto"`` on a node (fake limits, 2 ranks) that can give half of
    what its ranks need: without a disk tier attach refuses on every rank; with one each rank
    takes its part of the node and the disk tier the rest."""
    import torch

    import megatron_offload
    from tests.harness import models
    from tests.harness.faults import fake_host_limits

    chunks, optimizer, config = models.build("gpt", "bf16")
    if directory is None:
        results = [models.train_step(chunks, optimizer, config, s) for s in range(STEPS)]
        return {"results": results, "snapshot": models.final_snapshot(chunks, optimizer)}
    probe = megatron_offload.attach(optimizer)
    need = probe.stats()["host_bytes"]
    probe.detach()
    needs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(needs, need)
    available = sum(needs) // 2
    found = {"share": available * need // sum(needs)}
    restore = fake_host_limits(available)
    try:
        try:
            megatron_offload.attach(optimizer, host_memory_budget="auto")
            found["refused"] = None
        except megatron_offload.HostMemoryBudgetError as error:
            found["refused"] = type(error).__name__
        offloader = megatron_offload.attach(
            optimizer, host_memory_budget="auto", offload_disk_dir=directory
        )
    finally:
        restore()
    found["limit"] = offloader.engines[0].budget.limit
    results = [models.train_step(chunks, optimizer, config, s) for s in range(STEPS)]
    stats = offloader.stats()
    found["held"] = (stats["host_bytes"], stats["disk_bytes"], stats["disk_resident_bytes"])
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    offloader.detach()
    return {"results": results, "snapshot": snapshot, **found}


def test_auto_with_a_disk_tier_takes_each_ranks_part_of_the_node_and_spills_the_rest(
    rank_pool, tmp_path_factory
):
    directory = disk_directory(tmp_path_factory)
    plain = rank_pool.run(auto_job, None)
    runs = rank_pool.run(auto_job, directory)
    for reference, run in zip(plain, runs, strict=True):
        assert run["refused"] == "NodeMemoryError"  # the same node without a disk tier
        assert run["limit"] == run["share"] > 0, run
        host, disk, cached = run["held"]
        assert host <= run["limit"] and disk > 0 and cached == 0, run["held"]
        assert not differences(reference, run)


def first_chunked_step_fault_job(directory: str):
    """The chunked update's first step with its new states staged to disk: the first write
    back of that staging fails (``fdatasync``: EIO). The update undoes the failed step
    (``chunked_update_undo``); training then goes on."""
    import errno

    import torch

    import megatron_offload
    from megatron_offload.errors import OffloadError
    from tests.harness import models
    from tests.harness.checkpoints import chunked_options

    chunks, optimizer, config = models.build("gpt", "bf16")
    options = chunked_options(optimizer, {"chunked_update_undo": True})
    probe = megatron_offload.attach(optimizer, **options)
    budget = int(probe.stats()["host_bytes"] * FRACTION)
    probe.detach()
    offloader = megatron_offload.attach(
        optimizer, **options, host_memory_budget=budget, offload_disk_dir=directory
    )
    attached_step, found = optimizer.step, {}

    def held():
        stats = offloader.stats()
        return (stats["host_bytes"], stats["disk_bytes"], _device_bytes(optimizer))

    def failing_once():
        before = [p.detach().clone() for c in chunks for p in c.parameters()]
        found["held_before"] = held()
        undo = _failing("fdatasync", errno.EIO)
        try:
            attached_step()
            found["raised"] = None
        except OffloadError as error:
            found["raised"] = (type(error).__name__, getattr(error, "errno", None), str(error))
        finally:
            undo()
        found["held_after"] = held()
        after = [p.detach() for c in chunks for p in c.parameters()]
        found["undone"] = all(torch.equal(a, b) for a, b in zip(before, after))
        # Called again as a loop would (megatron-core's step clips the gradients in place
        # first, so this is not the update a step without the fault makes).
        return attached_step()

    optimizer.step = failing_once
    results = [models.train_step(chunks, optimizer, config, 0)]
    optimizer.step = attached_step
    while len(results) < STEPS:
        results.append(models.train_step(chunks, optimizer, config, len(results)))
    found["between"] = held()
    found["losses"] = [r["loss"] for r in results]
    offloader.detach()
    found["left"] = held_in(directory)
    return found


def test_a_write_error_staging_the_first_chunked_steps_states_is_undone_and_clear(
    rank_pool, tmp_path_factory
):
    directory = disk_directory(tmp_path_factory)
    for run in rank_pool.run(first_chunked_step_fault_job, directory):
        kind, code, message = run["raised"]
        assert kind == "DiskTierError" and code == 5, run["raised"]
        assert directory in message and "stay on the device" in message, message
        # Undone: the parameters as before the step, and nothing it made held on the host or
        # on disk (the masters the update streamed are off the device, as after any step).
        assert run["undone"] and run["held_after"][:2] == run["held_before"][:2], run
        assert run["held_after"][2] <= run["held_before"][2], run
        host, disk, device = run["between"]  # trained on: the rest on disk between steps
        assert disk > 0 and device == 0, run["between"]
        assert all(loss == loss for loss in run["losses"]) and run["left"] == [], run


# ------------------------------------------------------------------ sleep(to="disk")
def sleep_to_disk_job(directory: str, fault: str | None = None):
    """Steps with ``sleep(to="disk")`` and a wake after each. ``fault`` (at the second sleep,
    on rank 1 only): ``"full disk"`` (the file for the move, ``posix_fallocate``: ENOSPC) or
    ``"no host memory"`` (the arena wake allocates again: ``mmap`` ENOMEM); ``"chunked"``:
    none, with the chunked update; ``"copied parameters"``: none, the parameters changed
    after each step without the optimizer (a weight load), so sleep copies them, and a
    budget that holds everything: the first sleep is a plain ``sleep()``, for contrast."""
    import errno
    import gc

    import torch

    import megatron_offload
    from megatron_offload.errors import OffloadError
    from tests.harness import models
    from tests.harness.checkpoints import chunked_options
    from tests.harness.faults import AllocationFaults
    from tests.integration.offloader.test_sleep import _device_bytes as model_device_bytes
    from tests.integration.offloader.test_sleep import _load_weights, _rollout_block

    chunks, optimizer, config = models.build("gpt", "bf16")
    options = chunked_options(optimizer, {}) if fault == "chunked" else {}
    probe = megatron_offload.attach(optimizer)
    need = probe.stats()["host_bytes"]
    probe.detach()
    budget = int(need * (1.5 if fault == "copied parameters" else FRACTION))
    offloader = megatron_offload.attach(
        optimizer, **options, host_memory_budget=budget, offload_disk_dir=directory
    )
    failing = fault in ("full disk", "no host memory") and torch.distributed.get_rank() == 1
    results, asleep, awake, raised = [], [], [], []

    def attempt(call, step):
        try:
            call()
        except OffloadError as error:
            raised.append((step, type(error).__name__, str(error)))

    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if fault == "copied parameters":
            _load_weights(chunks)
        undo = lambda: None  # noqa: E731
        if step == 1 and failing and fault == "full disk":
            undo = _failing("posix_fallocate", errno.ENOSPC)
        to = "host" if fault == "copied parameters" and step == 0 else "disk"
        attempt(lambda: offloader.sleep(to=to), step)
        undo()
        stats = offloader.stats()
        asleep.append(
            {
                "to": to,
                "device": model_device_bytes(chunks, optimizer),
                "host_bytes": stats["host_bytes"],
                "staging": sum(e.host.staging_nbytes for e in offloader.engines),
                "disk_bytes": stats["disk_bytes"],
                "copied": (stats["copied_parameter_bytes"], stats["sleep_disk_bytes"]),
                "page_cache": sum(
                    page_cache_bytes(e.host.disk.buffer)
                    for e in offloader.engines
                    if e.host.disk is not None
                )
                + sum(page_cache_bytes(f.buffer) for f in offloader.engines[0].budget.files()),
            }
        )
        if fault is None:
            # Something reads the states while everything is on disk (it brings them back to
            # the device), and offload() takes them out again: both through the file's
            # mapping, no staging being held.
            inner = [d.optimizer for d in models.distributed_optimizers(optimizer)]
            read = [dict(entry) for o in inner for entry in o.state.values()]
            asleep[-1]["brought_back"] = model_device_bytes(chunks, optimizer)["states"]
            offloader.offload()
            asleep[-1]["offloaded"] = (
                model_device_bytes(chunks, optimizer)["states"],
                offloader.stats()["host_bytes"],
                sum(page_cache_bytes(e.host.disk.buffer) for e in offloader.engines),
            )
            del read
        _rollout_block()
        if step == 1 and failing and fault == "no host memory":
            with AllocationFaults(1, host=True, device=False):
                attempt(offloader.wake, step)
        elif step == 1 and fault == "no host memory":
            attempt(offloader.wake, step)
        offloader.wake()
        awake.append((offloader.stats()["host_bytes"], offloader.sleeping))
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    offloader.detach()
    gc.collect()
    return {
        "results": results,
        "snapshot": snapshot,
        "asleep": asleep,
        "awake": awake,
        "raised": raised,
        "need": need,
        "budget": budget,
        "left": held_in(directory),
    }


@pytest.mark.parametrize(
    "fault", [None, "chunked", "copied parameters", "full disk", "no host memory"]
)
def test_sleep_to_disk_gives_the_host_arena_back_and_wakes_bitwise(
    rank_pool, tmp_path_factory, fault, plain_run
):
    directory = disk_directory(tmp_path_factory)
    if fault == "copied parameters":  # the same weight loads, never asleep
        plain = plain_run(True)
    else:
        plain = plain_run()
    runs = rank_pool.run(sleep_to_disk_job, directory, fault)
    for rank, (reference, run) in enumerate(zip(plain, runs, strict=True)):
        assert not differences(reference, run)  # bitwise with the run that never slept
        for step, figures in enumerate(run["asleep"]):
            device = figures["device"]
            assert device["states"] == device["masters"] == device["parameters"] == 0, figures
            assert figures["page_cache"] == 0, figures
            copied, on_disk = figures["copied"]
            assert (copied > 0) == (fault == "copied parameters"), figures
            if figures["to"] == "host":  # the budget holds everything: nothing on disk
                assert figures["host_bytes"] >= run["need"] + copied and on_disk == 0, figures
                continue
            if fault == "full disk" and step == 1:
                continue  # below: where each rank's host copies are after the refusal
            # Asleep: no arena and no staging, every state and master in the file, and the
            # copies of the parameters (if any) in files of the tier too.
            assert figures["host_bytes"] == figures["staging"] == 0, figures
            assert figures["disk_bytes"] >= run["need"] and on_disk == copied, figures
            if fault is None:
                assert figures["brought_back"] > 0, figures
                assert figures["offloaded"] == (0, 0, 0), figures
        for host_bytes, sleeping in run["awake"]:
            assert 0 < host_bytes <= run["budget"] and not sleeping, run["awake"]
        assert run["left"] == []
        if fault in (None, "chunked", "copied parameters"):
            assert run["raised"] == []
            continue
        # Every rank raised at the second sleep or wake, rank 1 for itself, rank 0 for it.
        [(step, kind, message)] = run["raised"]
        assert step == 1, run["raised"]
        if rank == 1:
            expected = "DiskTierError" if fault == "full disk" else "HostMemoryError"
            assert kind == expected, run["raised"]
        else:
            assert kind == "OffloadStateError" and "another rank" in message, run["raised"]


def refused_sleep_job():
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    offloader = megatron_offload.attach(optimizer)
    models.train_step(chunks, optimizer, config, 0)
    before, refused = offloader.stats(), []
    for kwargs in ({"to": "disk"}, {"to": "tape"}, {"to": "disk", "parameters": False}):
        try:
            offloader.sleep(**kwargs)
            refused.append(None)
        except (megatron_offload.OffloadError, ValueError) as error:
            refused.append((type(error).__name__, str(error)))
    after = offloader.stats()
    asleep = offloader.sleeping
    offloader.detach()
    return {"refused": refused, "same": before == after, "asleep": asleep}


def test_sleep_to_disk_without_a_disk_tier_is_refused_before_anything_moves(rank_pool):
    for run in rank_pool.run(refused_sleep_job):
        (no_tier, message), (bad, _), (without_parameters, _) = run["refused"]
        assert no_tier == "OffloadStateError" and "offload_disk_dir" in message, run
        assert bad == without_parameters == "ValueError", run
        assert run["same"] and not run["asleep"], run
