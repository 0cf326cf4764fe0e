"""Checkpoints taken while the states are offloaded, and resuming from them.

megatron-core ``dist_checkpointing`` (torch_dist format, DP-reshardable optimizer state),
synchronous and asynchronous saves, on the real DistributedOptimizer. The uninterrupted
run, the run resumed from a checkpoint saved while offloaded, and a run that loads the
checkpoint into an already running, offloaded optimizer must all continue bitwise alike,
and all alike with and without offloading.
"""

import pytest
import torch

from tests.harness.checkpoints import apply_loaded

STEPS, SAVE_AFTER = 6, 3
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state_dict(chunks, optimizer, is_loading=False):
    model = chunks[0].sharded_state_dict()
    return {
        "model": model,
        "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=SHARDING),
    }


WRITER_DELAY_S = 1.5


def _save(chunks, optimizer, directory, async_save):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    state = _sharded_state_dict(chunks, optimizer)
    if not async_save:
        dist_checkpointing.save(state, directory)
        return None
    queue = AsyncCallsQueue()
    # A throttled writer: the forked writer process sleeps before it writes a byte, so the
    # next steps (and their offloads, which overwrite the host copy the save was served
    # from) run while the checkpoint is being written.
    # The writer's entry point: write_preloaded_data_multithread from 0.17, _multiproc in 0.16.
    name = next(
        n
        for n in ("write_preloaded_data_multithread", "write_preloaded_data_multiproc")
        if hasattr(FileSystemWriterAsync, n)
    )
    write = getattr(FileSystemWriterAsync, name)

    def slow_write(*args, **kwargs):
        import time

        time.sleep(WRITER_DELAY_S)
        return write(*args, **kwargs)

    setattr(FileSystemWriterAsync, name, staticmethod(slow_write))
    try:
        import inspect

        # megatron-core 0.16 has one asynchronous strategy (megatron-core's own) and no argument.
        strategy = (
            {"async_strategy": "mcore"}
            if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
            else {}
        )
        request = dist_checkpointing.save(state, directory, async_sharded_save=True, **strategy)
        queue.schedule_async_request(request)
    finally:
        setattr(FileSystemWriterAsync, name, staticmethod(write))
    return queue


def _writing(queue):
    """Whether the forked writer of ``queue`` is still running."""
    return any(
        call.async_caller.process is not None and call.async_caller.process.is_alive()
        for call in queue.async_calls
    )


@torch.no_grad()
def _load(chunks, optimizer, directory, offload):
    from megatron.core import dist_checkpointing

    from tests.harness import models

    for distrib in models.distributed_optimizers(optimizer):
        if not distrib.optimizer.state:
            # megatron-core (0.16-0.19) cannot build a load dict for a torch-AdamW optimizer
            # that has no state yet (`assert len(steps) == 1`), offloading or not: create it
            # first, as its own loading code expects of TE/apex optimizers.
            distrib._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(
        _sharded_state_dict(chunks, optimizer, is_loading=True), directory
    )
    apply_loaded(chunks, optimizer, state)
    if not offload:
        # The offloader repairs the per-parameter `step` tensors megatron-core's load leaves
        # shared and stale with torch AdamW; the reference (no offloader) gets the same fix.
        from megatron_offload.access.guard import restore_step_tensors

        for distrib in models.distributed_optimizers(optimizer):
            restore_step_tensors(
                distrib.optimizer, {"optimizer": {"param_groups": distrib.optimizer.param_groups}}
            )


def _shared_directory(path):
    import os

    shared = [path]
    torch.distributed.broadcast_object_list(shared, src=0)
    if torch.distributed.get_rank() == 0:
        os.makedirs(shared[0], exist_ok=True)
    torch.distributed.barrier()
    return shared[0]


def _chunked_options(optimizer, options):
    """The chunked update with two slots of the largest parameter shard's two fp32 moments."""
    from tests.harness import models

    largest = max(
        p.numel()
        for d in models.distributed_optimizers(optimizer)
        for g in d.optimizer.param_groups
        for p in g["params"]
    )
    return {**options, "chunked_update_bytes": 2 * (8 * largest + 32)}


def checkpoint_job(offload, dtype, async_save, directory, checked=False, chunked=False):
    """Phase 1: train STEPS steps, saving after SAVE_AFTER (states offloaded at that point).
    Phase 2: a fresh model+optimizer loads the checkpoint and trains the remaining steps.
    Phase 3: a third one trains 2 steps of its own (offloaded), then loads the checkpoint
    into the running optimizer and trains the remaining steps.
    chunked: with the chunked update (states on the host during the steps too)."""
    import megatron_offload
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    directory = _shared_directory(directory)
    out = {}
    options, devices = checked_device_options() if checked else ({}, [])

    chunks, optimizer, config = models.build("mlp", dtype)
    if chunked:
        options = _chunked_options(optimizer, options)
    offloader = megatron_offload.attach(optimizer, **options) if offload else None
    results, pending = [], None
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if step == SAVE_AFTER - 1:
            if offloader:
                out["offloaded_at_save"] = offloader.is_offloaded
            with DeviceWatch(offloader) as watch:
                pending = _save(chunks, optimizer, directory, async_save)
            if offloader:  # served from the host copy: nothing came back, nothing is stale
                out["save"] = watch.figures()
                out["offloaded_after_save"] = _all_released(offloader)
    if pending is not None:
        out["written_while_training"] = _writing(pending)  # the steps after the save ran meanwhile
        pending.maybe_finalize_async_calls(blocking=True)
    out["uninterrupted"] = results
    out["uninterrupted_snapshot"] = _final_snapshot(chunks, optimizer, offloader)

    # Phase 2: resume in a fresh optimizer (offloaded before anything, like a restarted job).
    torch.manual_seed(99)  # different init: everything must come from the checkpoint
    chunks, optimizer, config = models.build("mlp", dtype)
    if chunked:
        options = _chunked_options(optimizer, options)
    offloader = megatron_offload.attach(optimizer, **options) if offload else None
    _load(chunks, optimizer, directory, offload)
    out["resumed"] = [
        models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER, STEPS)
    ]
    out["resumed_snapshot"] = _final_snapshot(chunks, optimizer, offloader)

    # Phase 3: load into a running optimizer whose states are offloaded.
    torch.manual_seed(7)
    chunks, optimizer, config = models.build("mlp", dtype)
    if chunked:
        options = _chunked_options(optimizer, options)
    offloader = megatron_offload.attach(optimizer, **options) if offload else None
    for step in range(2):
        models.train_step(chunks, optimizer, config, 100 + step)
    if offloader:
        out["offloaded_before_load"] = offloader.is_offloaded
    with DeviceWatch(offloader) as watch:
        _load(chunks, optimizer, directory, offload)
    if offloader:
        out["load"] = watch.figures()
        out["offloaded_after_load"] = _all_released(offloader)
    out["loaded_running"] = [
        models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER, STEPS)
    ]
    out["loaded_running_snapshot"] = _final_snapshot(chunks, optimizer, offloader)
    if offloader:
        stats = offloader.stats()
        out["host_equals_tracked"] = stats["host_bytes"] == stats["tracked_bytes"]
        out["update_chunks"] = stats["update_chunks"]
        for engine in offloader.engines:  # the last offload's D2H has nothing after it to order it
            engine.synchronize_host()
    check_devices(devices)
    out["checked"] = len(devices)
    torch.distributed.barrier()
    return out


def _all_released(offloader):
    return all(g.place.value == "released" for e in offloader.engines for g in e.pieces)


class DeviceWatch:
    """What a checkpoint call does to the device, measured apart from ``stats()``: the bytes
    of the offloaded tensors' own storages, probed inside megatron-core's per-parameter
    state access (every save and load of the DistributedOptimizer goes through it) and
    after the call, and every regrow, allocation and copy the offloader's devices make."""

    def __init__(self, offloader):
        self.offloader = offloader
        self.peak = 0
        self.allocations = 0
        self.copies = 0
        self.probes = 0

    def probe(self):
        self.probes += 1
        # Each storage once (a consolidated group's tensors share one).
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors
        }
        self.peak = max(self.peak, sum(storages.values()))

    def __enter__(self):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.patches = []
        if self.offloader is None:
            return self
        for engine in self.offloader.engines:
            engine.synchronize_host()
        self.tensors = [t for e in self.offloader.engines for g in e.pieces for t in g.tensors]
        for name in (
            "_get_main_param_and_optimizer_states",
            "_set_main_param_and_optimizer_states",
        ):
            original = getattr(DistributedOptimizer, name)

            def probed(*args, _original=original, **kwargs):
                self.probe()
                result = _original(*args, **kwargs)
                self.probe()
                return result

            setattr(DistributedOptimizer, name, probed)
            self.patches.append((DistributedOptimizer, name, original))
        for engine in self.offloader.engines:
            for name in ("regrow", "empty", "copy"):
                original = getattr(engine.device, name)

                def counted(*args, _original=original, _name=name, **kwargs):
                    if _name == "copy":
                        self.copies += 1
                    else:
                        self.allocations += 1
                    return _original(*args, **kwargs)

                setattr(engine.device, name, counted)
                self.patches.append((engine.device, name, None))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.patches):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        if self.offloader is not None:
            self.probe()

    def figures(self):
        return {
            "peak_state_bytes": self.peak,
            "allocations": self.allocations,
            "copies": self.copies,
            "probes": self.probes,
        }


def _final_snapshot(chunks, optimizer, offloader):
    from tests.harness import models

    if offloader and offloader.is_offloaded:
        offloader.reload()
        offloader.wait()
    snap = models.snapshot(chunks, optimizer)
    if offloader:
        offloader.offload()
    return snap


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
        for phase in ("uninterrupted", "resumed", "loaded_running"):
            assert off[phase] == ref[phase], phase
            for section in ("params", "optimizer"):
                assert _equal(
                    ref[phase + "_snapshot"][section], off[phase + "_snapshot"][section]
                ), phase
        # Resuming continues exactly as the run that never stopped.
        assert off["resumed"] == off["uninterrupted"][SAVE_AFTER:]
        assert off["loaded_running"] == off["uninterrupted"][SAVE_AFTER:]
        for phase in ("resumed", "loaded_running"):
            for section in ("params", "optimizer"):
                assert _equal(
                    off["uninterrupted_snapshot"][section], off[phase + "_snapshot"][section]
                ), phase
