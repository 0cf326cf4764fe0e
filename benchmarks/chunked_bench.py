"""The chunked update on the real megatron-core DistributedOptimizer.

``chunked_job`` runs on every rank of the test harness's CPU rank pool (or of ``torchrun``
on GPUs) in one of two modes, with the same model and data:

* ``"whole"``: offloading as by default: the states come back whole for the step;
* ``"chunked"``: ``chunked_update_bytes`` set to a fraction of the optimizer's state, so the
  states stay on the host during the step and stream through the slots.

Per rank it reports the state bytes, the configured budget, the chunks and copies of each
step, the step time, and the optimizer's device footprint during the update: after every
call of the inner optimizer's step, the bytes of every storage behind its state tensors
plus every live allocation the offloader made (slots included; the master weights megatron
keeps beside the optimizer are left out). On GPUs the allocator's peak is reported too.
The parent compares the two modes' final parameters and states bitwise.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

from .timing import device_sync, perf_counter, summary, undisturbed


def _tracking_factory(allocations: list):
    """A device factory whose devices keep a weak reference to every ``empty`` allocation."""
    from megatron_offload.device import device_for

    def factory(torch_device):
        device = device_for(torch_device)
        plain_empty = device.empty

        def empty(numel, dtype):
            tensor = plain_empty(numel, dtype)
            allocations.append(weakref.ref(tensor))
            return tensor

        device.empty = empty
        return device

    return factory


def _live(allocations: list) -> dict:
    """{storage address: bytes} of the allocations still alive and holding memory."""
    held = {}
    for ref in list(allocations):
        tensor = ref()
        if tensor is None:
            allocations.remove(ref)
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            held[storage.data_ptr()] = storage.nbytes()
    return held


def chunked_job(cfg: dict) -> dict:
    import megatron_offload
    from megatron_offload.adapters import inner_optimizers
    from megatron_offload.adapters import megatron_wrappers as adapter
    from tests.harness import models

    from .megatron_bench import _Memory, _train_step

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if cfg["device"] == "cuda"
        else torch.device("cpu")
    )
    sync = device_sync(device)
    memory = _Memory(device)
    chunks, optimizer, config = models.build(
        model=cfg["model"],
        dtype=cfg["dtype"],
        num_layers=cfg["layers"],
        hidden=cfg["hidden"],
        heads=cfg["heads"],
    )
    distributed = models.distributed_optimizers(optimizer)
    params = [p for d in distributed for g in d.optimizer.param_groups for p in g["params"]]
    state_bytes = 8 * sum(p.numel() for p in params)  # Adam's two fp32 moments (torch AdamW)
    budget = None
    allocations: list = []
    options = {"device_factory": _tracking_factory(allocations)}
    if cfg["mode"] == "chunked":
        largest = 8 * max(p.numel() for p in params)
        budget = max(int(cfg["fraction"] * state_bytes), 2 * largest)
        options["chunked_update_bytes"] = budget
    offloader = megatron_offload.attach(optimizer, **options)
    peak = {"bytes": 0}

    def footprint(inner, args, kwargs):
        held = _live(allocations)
        for distrib in distributed:
            masters = {m.untyped_storage().data_ptr() for m in adapter.master_weights(distrib)}
            for key in masters:
                held.pop(key, None)
            for group in distrib.optimizer.param_groups:
                for param in group["params"]:
                    for _, tensor in inner_optimizers.state_tensors(
                        param, distrib.optimizer.state.get(param) or {}
                    ):
                        storage = tensor.untyped_storage()
                        if storage.data_ptr() not in masters:
                            held[storage.data_ptr()] = storage.nbytes()
        peak["bytes"] = max(peak["bytes"], sum(held.values()))

    for distrib in distributed:
        distrib.optimizer.register_step_post_hook(footprint)
    step = partial(_train_step, chunks, optimizer, config, device=device)
    per_step, times = [], []
    memory.reset_peak()
    with undisturbed():
        for index in range(cfg["steps"]):
            peak["bytes"] = 0
            sync()
            start = perf_counter()
            step(index)
            sync()
            times.append(perf_counter() - start)
            stats = offloader.stats()
            per_step.append(
                {
                    "footprint": peak["bytes"],
                    "chunks": stats["update_chunks"],
                    "copies": stats["update_copies"],
                    "offloaded": stats["offloaded_bytes"],
                }
            )
    offloader.reload()
    offloader.wait()
    models.flush_param_gather(chunks)
    return {
        "rank": torch.distributed.get_rank(),
        "state_bytes": state_bytes,
        "budget": budget,
        "steps": per_step,
        "step_time": summary(times[2:] or times),
        "device_peak": memory.peak(),
        "snapshot": models.snapshot(chunks, optimizer),
    }


def job_config(
    *,
    model="mlp",
    dtype="bf16",
    layers=11,
    hidden=1024,
    heads=4,
    steps=6,
    fraction=0.25,
    device="cpu",
) -> dict:
    """``chunked_job``'s settings (``mode`` is set per run)."""
    return dict(locals())


def run_in_rank_pool(
    cfg: dict, *, world_size: int, tp: int = 1, pp: int = 1, timeout: float = 900.0
) -> dict:
    """Both modes on CPU gloo ranks; returns their results and whether they agree bitwise."""
    from tests.harness.rank_pool import RankPool

    with RankPool(world_size=world_size, timeout=timeout) as pool:
        whole = pool.run(chunked_job, {**cfg, "mode": "whole"}, tp=tp, pp=pp)
        chunked = pool.run(chunked_job, {**cfg, "mode": "chunked"}, tp=tp, pp=pp)
    return {"whole": whole, "chunked": chunked, "bitwise": bitwise(whole, chunked)}


def bitwise(whole: list[dict], chunked: list[dict]) -> bool:
    for a, b in zip(whole, chunked):
        for section in ("params", "optimizer"):
            x, y = a["snapshot"][section], b["snapshot"][section]
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
    return True


def strip(result: dict) -> dict:
    """The figures without the snapshots (for printing and JSON)."""
    return {
        mode: [{k: v for k, v in rank.items() if k != "snapshot"} for rank in result[mode]]
        for mode in ("whole", "chunked")
    } | {"bitwise": result["bitwise"]}
