"""Reading a torch_dist checkpoint back in the test process, and writing a loaded one into a
harness model and its optimizer."""

from __future__ import annotations

import os
import tempfile

import torch


def torch_dist_tensors(checkpoint: str, scratch: str | None = None) -> dict:
    """Every tensor of a torch_dist checkpoint directory, keyed by its path in the saved
    state (``/optimizer/state/0/exp_avg``, ...); ``scratch`` is where the converted file
    goes (a temporary file, removed after, when None)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if scratch is None:
        handle, path = tempfile.mkstemp(suffix=".pt")
        os.close(handle)
        try:
            return torch_dist_tensors(checkpoint, path)
        finally:
            os.remove(path)
    dcp_to_torch_save(checkpoint, scratch)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)

    walk("", torch.load(scratch, weights_only=False))
    return flat


def apply_loaded(chunks, optimizer, state: dict) -> None:
    """Write a loaded distributed checkpoint into the model and the optimizer: parameters by
    name without the DDP wrapper's ``module.`` prefixes (the harness models' sharded keys carry
    them), every parameter found, Transformer Engine's extra state left out."""
    loaded = {
        k.replace("module.", ""): v
        for k, v in state["model"].items()
        if not k.endswith("_extra_state")
    }
    params = dict(chunks[0].named_parameters())
    assert len(params) == len(loaded)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(loaded[name.replace("module.", "")])
    optimizer.load_state_dict(state["optimizer"])


# ------------------------------------------------- torch_dist saves and loads of the harness
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def sharded_state_dict(chunks, optimizer, is_loading=False):
    """The model's and the DistributedOptimizer's sharded state (DP-reshardable)."""
    model = chunks[0].sharded_state_dict()
    return {
        "model": model,
        "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=SHARDING),
    }


WRITER_DELAY_S = 1.5


def save(chunks, optimizer, directory, async_save):
    """A torch_dist save; asynchronous: through a writer that waits ``WRITER_DELAY_S``
    before it writes, returning the queue to finalize."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    state = sharded_state_dict(chunks, optimizer)
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


def writing(queue):
    """Whether the forked writer of ``queue`` is still running."""
    return any(
        call.async_caller.process is not None and call.async_caller.process.is_alive()
        for call in queue.async_calls
    )


@torch.no_grad()
def load(chunks, optimizer, directory, offload):
    """Load the checkpoint in ``directory`` into a harness model and its optimizer."""
    from megatron.core import dist_checkpointing

    from tests.harness import models

    for distrib in models.distributed_optimizers(optimizer):
        if not distrib.optimizer.state:
            # megatron-core (0.16-0.19) cannot build a load dict for a torch-AdamW optimizer
            # that has no state yet (`assert len(steps) == 1`), offloading or not: create it
            # first, as its own loading code expects of TE/apex optimizers.
            distrib._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(
        sharded_state_dict(chunks, optimizer, is_loading=True), directory
    )
    apply_loaded(chunks, optimizer, state)
    if not offload:
        # The offloader repairs the per-parameter `step` tensors megatron-core's load leaves
        # shared and stale with torch AdamW; the reference (no offloader) gets the same fix.
        from megatron_offload.access.methods import restore_step_tensors

        for distrib in models.distributed_optimizers(optimizer):
            restore_step_tensors(
                distrib.optimizer, {"optimizer": {"param_groups": distrib.optimizer.param_groups}}
            )


def shared_directory(path):
    """Rank 0's ``path``, created, on every rank."""
    shared = [path]
    torch.distributed.broadcast_object_list(shared, src=0)
    if torch.distributed.get_rank() == 0:
        os.makedirs(shared[0], exist_ok=True)
    torch.distributed.barrier()
    return shared[0]


def chunked_options(optimizer, options):
    """The chunked update with two slots of the largest parameter shard's two fp32 moments."""
    from tests.harness import models

    largest = max(
        p.numel()
        for d in models.distributed_optimizers(optimizer)
        for g in d.optimizer.param_groups
        for p in g["params"]
    )
    return {**options, "chunked_update_bytes": 2 * (8 * largest + 32)}


def all_released(offloader):
    """Whether every piece of every engine is released."""
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


def offloaded_snapshot(chunks, optimizer, offloader):
    """``snapshot`` with the states brought back for it and offloaded again after."""
    from tests.harness import models

    if offloader and offloader.is_offloaded:
        offloader.reload()
        offloader.wait()
    snap = models.snapshot(chunks, optimizer)
    if offloader:
        offloader.offload()
    return snap


def tensors_equal(a, b):
    """Two ``{name: tensor}`` mappings with the same names and bitwise the same tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_phases_equal(ref: dict, off: dict, phases) -> None:
    """Each phase's results and snapshots are bitwise the reference run's."""
    for phase in phases:
        assert off[phase] == ref[phase], phase
        for section in ("params", "optimizer"):
            assert tensors_equal(
                ref[phase + "_snapshot"][section], off[phase + "_snapshot"][section]
            ), phase
