"""The offload cycle on the real megatron-core DistributedOptimizer.

``offload_job`` runs on every rank, either in the test harness's CPU rank pool (gloo ranks
with megatron-core's CUDA assumptions redirected to the CPU) or, on GPU machines, in each
process of ``torchrun`` (see ``gpu.py``). Per rank it:

1. builds a model with ``tests.harness.models.build`` (Float16Module + DDP +
   DistributedOptimizer from ``get_megatron_optimizer``) and runs one warm-up step;
2. times training steps WITHOUT offloading (phase A);
3. ``megatron_offload.attach``es the offloader (with a ``TimingDevice``), runs two steps (the
   first offload copies tensor by tensor, the next reload consolidates), then times steps
   WITH offloading and reads ``stats()`` after each: bytes and copies of the automatic cycle;
4. times explicit cycles through the offloader's API (reload, wait, offload, release),
   interleaved with the physical floor of the same bytes, and the bookkeeping per cycle;
5. brings the states back, detaches and times steps without offloading again (phase A'),
   so that A / with / A' bracket any drift of the machine.

Peak and between-step device memory are read where the device has an allocator that reports
them (CUDA); on CPU ranks they are None.
"""

from __future__ import annotations

import contextlib
import statistics
from functools import partial

import torch

from .timing import (
    FloorCopy,
    TimingDevice,
    device_sync,
    interleaved,
    perf_counter,
    profile_table,
    ratio_figures,
    summary,
    undisturbed,
)


def _train_step(model_chunks, optimizer, config, step_index: int, device: torch.device) -> bool:
    """One iteration as megatron.training.training.train_step runs it, data on ``device``.

    ``tests.harness.models.step_on`` with the batch moved to ``device``, so the same code
    serves CPU ranks and GPUs.
    """
    from tests.harness import models

    spec = config.harness_spec
    batch = {k: v.to(device) for k, v in models._micro_batch(spec, step_index, 0).items()}
    _losses, update_successful, _grad_norm = models.step_on(
        model_chunks, optimizer, config, [batch]
    )
    return bool(update_successful)


class _Memory:
    """Device memory figures where the device reports them (None on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.module = torch.get_device_module(device.type) if device.type != "cpu" else None
        self.device = device

    def reset_peak(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats(self.device)

    def allocated(self):
        return None if self.module is None else self.module.memory_allocated(self.device)

    def peak(self):
        return None if self.module is None else self.module.max_memory_allocated(self.device)

    def retries(self):
        """The caching allocator's retries so far (synchronize + free the cache + retry)."""
        if self.module is None or not hasattr(self.module, "memory_stats"):
            return None
        return self.module.memory_stats(self.device).get("num_alloc_retries", 0)

    def reserved(self):
        return None if self.module is None else self.module.memory_reserved(self.device)


def _timed_steps(step, first_index: int, count: int, sync, memory: _Memory) -> dict:
    memory.reset_peak()
    retries_before = memory.retries()
    times = []
    with undisturbed():
        for i in range(count):
            sync()
            start = perf_counter()
            step(first_index + i)
            sync()
            times.append(perf_counter() - start)
    return {
        "step": summary(times),
        "peak_device_bytes": memory.peak(),
        "between_steps_device_bytes": memory.allocated(),
        "between_steps_reserved_bytes": memory.reserved(),
        # Allocator retries during these (steady-state) steps: must be 0 on a GPU.
        "alloc_retries": None if retries_before is None else memory.retries() - retries_before,
    }


def offload_job(cfg: dict) -> dict:
    """Everything measured on one rank (see the module docstring); ``cfg`` from ``job_config``."""
    from megatron.core import parallel_state

    import megatron_offload
    from megatron_offload.adapters import collect as adapter_collect
    from megatron_offload.device import device_for
    from megatron_offload.offloader.members import megatron_optimizers as distributed_optimizers
    from tests.harness import models

    if cfg["device"] == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(cfg["device"])
    sync = device_sync(device)
    memory = _Memory(device)

    model_chunks, optimizer, config = models.build(
        model=cfg["model"],
        dtype=cfg["dtype"],
        num_layers=cfg["layers"],
        hidden=cfg["hidden"],
        heads=cfg["heads"],
        vocab_size=cfg["vocab_size"],
        seq_length=cfg["seq_length"],
        micro_batch_size=cfg["micro_batch_size"],
    )
    step = partial(_train_step, model_chunks, optimizer, config, device=device)
    result = {
        "rank": torch.distributed.get_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "model_param_tensors": sum(1 for c in model_chunks for _ in c.parameters()),
        "model_params": sum(p.numel() for c in model_chunks for p in c.parameters()),
        "optimizer_classes": models.optimizer_classes(optimizer),
    }
    distributed = distributed_optimizers(optimizer)
    result["optimizer_shards"] = sum(
        len(g["params"]) for d in distributed for g in d.optimizer.param_groups
    )
    index = 0
    step(index)  # warm-up: Adam creates its moments here
    index += 1
    steps = cfg["step_repeats"]
    if steps:
        result["steps_without"] = _timed_steps(step, index, steps, sync, memory)
        index += steps

    timing_devices: list[TimingDevice] = []

    def factory(torch_device):
        timing = TimingDevice(device_for(torch_device))
        timing_devices.append(timing)
        return timing

    offloader = megatron_offload.attach(optimizer, device_factory=factory)

    def take_physical() -> tuple[float, int]:
        seconds = copies = 0
        for timing in timing_devices:
            physical, calls, _copied = timing.take()
            seconds += physical
            copies += calls["copy"]
        return seconds, copies

    step(index)  # first automatic offload: tensor by tensor
    index += 1
    first = offloader.stats()
    step(index)  # reload consolidates every group; the offload after it is one copy per group
    index += 1
    result["first_cycle"] = {
        "d2h_copies": first["d2h_copies"],
        "tensors": sum(s["tensors"] for s in first["per_optimizer"]),
    }
    if steps:
        result["steps_with"] = _timed_steps(step, index, steps, sync, memory)
        index += steps
    stats = offloader.stats()
    result["layout"] = _layout(offloader, stats)
    result["automatic_cycle"] = {
        "d2h_copies": stats["d2h_copies"],
        "h2d_copies": stats["h2d_copies"],
        "d2h_bytes": stats["d2h_bytes"],
        "h2d_bytes": stats["h2d_bytes"],
    }

    # Explicit cycles through the offloader's API, interleaved with the floor.
    def cycle(records: list) -> float:
        take_physical()
        start = perf_counter()
        offloader.reload()
        offloader.wait()
        offloader.offload()
        end = perf_counter()
        sync()
        total = perf_counter() - start
        physical, copies = take_physical()
        # Bookkeeping: host time inside the offloader's calls minus the physical work in
        # them (the final device sync is not an offloader call).
        records.append((total, (end - start) - physical, copies))
        return total

    tracked = stats["tracked_bytes"]
    if cfg["repeats"] and tracked:
        floor = FloorCopy(tracked, device)
        records: list = []
        samples = interleaved({"cycle": partial(cycle, records), "floor": floor}, cfg["repeats"])
        del floor
        result["cycle_vs_floor"] = {
            "bytes": tracked,
            "repeats": cfg["repeats"],
            "cycle": summary(samples["cycle"]),
            "floor": summary(samples["floor"]),
            **ratio_figures(samples["cycle"], samples["floor"]),
            "copies_per_cycle": statistics.median(r[2] for r in records),
        }
    if cfg["bookkeeping_repeats"]:
        result["bookkeeping"] = {}
        # As run here (with the harness's CUDA-on-CPU function mode intercepting every torch
        # call on CPU ranks) and with function modes disabled, which is what a process
        # without that harness sees.
        for label, context in (
            ("as_run", contextlib.nullcontext),
            ("no_function_mode", torch._C.DisableTorchFunction),
        ):
            records = []
            with context(), undisturbed():
                for _ in range(cfg["bookkeeping_repeats"]):
                    cycle(records)
            result["bookkeeping"][label] = summary([r[1] for r in records])
        # The adapter's share: walking the optimizer to list its tensors, once per offload.
        drains = []
        with torch._C.DisableTorchFunction(), undisturbed():
            for _ in range(cfg["bookkeeping_repeats"]):
                start = perf_counter()
                for d in distributed:
                    for _pair in adapter_collect(d):
                        pass
                drains.append(perf_counter() - start)
        result["bookkeeping"]["adapter_collect"] = summary(drains)

    offloader.reload()
    offloader.wait()
    offloader.detach()
    if steps:
        result["steps_without_after"] = _timed_steps(step, index, steps, sync, memory)
    sync()
    return result


def _layout(offloader, stats: dict) -> dict:
    """Bytes while released, from ``stats()`` and measured from the tensors themselves."""
    from .engine_bench import byte_figures, unique_storage_bytes

    per = [byte_figures(engine, s) for engine, s in zip(offloader.engines, stats["per_optimizer"])]
    summed = {key: sum(p[key] for p in per) for key in per[0] if not key.startswith("host_ratio")}
    payload = summed["payload_bytes"]
    host = max(summed["host_bytes"], summed["host_storage_bytes"])
    return {
        **summed,
        "host_ratio": host / payload if payload else float("nan"),
        "host_ratio_stats": stats["host_bytes"] / stats["offloaded_bytes"]
        if stats["offloaded_bytes"]
        else float("nan"),
        "device_bytes_held": unique_storage_bytes(
            t for engine in offloader.engines for g in engine.pieces for t in g.tensors
        ),
        "resident_bytes": stats["resident_bytes"],
        "unreleasable_bytes": stats["unreleasable_bytes"],
        "pieces": sum(sum(s["pieces"].values()) for s in stats["per_optimizer"]),
        "tensors": sum(s["tensors"] for s in stats["per_optimizer"]),
    }


def job_config(
    *,
    model: str = "mlp",
    dtype: str = "bf16",
    layers: int = 11,
    hidden: int = 1024,
    heads: int = 4,
    vocab_size: int = 128,
    seq_length: int = 16,
    micro_batch_size: int = 2,
    repeats: int = 9,
    step_repeats: int = 3,
    bookkeeping_repeats: int = 20,
    device: str = "cpu",
) -> dict:
    """The job's settings as a plain (picklable) dict."""
    return dict(locals())


def scaling_config(
    *,
    layers: list[int],
    dtype: str = "bf16",
    cycles: int = 40,
    device: str = "cpu",
    profile: bool = False,
) -> dict:
    """``scaling_job``'s settings as a plain (picklable) dict."""
    return {
        "layers": list(layers),
        "dtype": dtype,
        "cycles": cycles,
        "device": device,
        "profile": profile,
    }


def run_in_rank_pool(
    main: dict | None,
    scaling: dict | None,
    *,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    timeout: float = 900.0,
) -> tuple[list | None, list | None]:
    """``offload_job`` in the chosen layout and ``scaling_job`` on CPU gloo ranks of the test
    harness's rank pool (started once for both).

    The scaling job runs with every rank in one tensor-parallel group (data-parallel size 1),
    so that each rank's DistributedOptimizer holds a shard of every parameter tensor: a
    model of 2,000 parameter tensors gives 2,000 shards per rank, not 2,000 / dp.
    """
    from tests.harness.rank_pool import RankPool

    with RankPool(world_size=world_size, timeout=timeout) as pool:
        main_result = pool.run(offload_job, main, tp=tp, pp=pp) if main else None
        scaling_result = pool.run(scaling_job, scaling, tp=world_size, pp=1) if scaling else None
    return main_result, scaling_result


def scaling_job(cfg: dict) -> list[dict]:
    """Copies and bookkeeping of the attached offloader on tiny MLPs of several sizes.

    For each layer count in ``cfg["layers"]`` (4 parameter tensors per layer, hidden 8, so
    copy time is negligible): build, attach, run one optimizer step (it creates the moments,
    and the automatic offload after it copies them out tensor by tensor), run one explicit
    cycle (its reload consolidates every group), then time ``cfg["cycles"]`` explicit cycles
    (reload, wait, offload, release), whose copies are one per group and direction. The
    step is ``optimizer.step()`` on zeroed gradients, without forward and backward: the
    offloader's work does not depend on the gradient values, and on CPU ranks a forward
    through hundreds of layers (and each further step, ~1 s at 2,000 parameters) would
    dominate the run time.

    Bookkeeping is timed with torch function modes disabled: on CPU ranks the harness's
    CUDA-on-CPU mode intercepts every torch call (``master.grad = None`` included), which a
    real training process does not have. ``as_run`` keeps it for comparison.
    """
    import megatron_offload
    from megatron_offload.device import device_for
    from megatron_offload.offloader.members import megatron_optimizers as distributed_optimizers
    from tests.harness import models

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if cfg["device"] == "cuda"
        else torch.device("cpu")
    )
    sync = device_sync(device)
    out = []
    for layers in cfg["layers"]:
        chunks, optimizer, _config = models.build(
            model="mlp", dtype=cfg["dtype"], num_layers=layers, hidden=8
        )
        devices: list[TimingDevice] = []

        def factory(torch_device, devices=devices):
            devices.append(TimingDevice(device_for(torch_device)))
            return devices[-1]

        offloader = megatron_offload.attach(optimizer, device_factory=factory)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.step()
        first_copies = offloader.stats()["d2h_copies"]

        def cycle(offloader=offloader):
            for timing in devices:
                timing.take()
            start = perf_counter()
            offloader.reload()
            offloader.wait()
            offloader.offload()
            wall = perf_counter() - start
            sync()
            return wall - sum(timing.take()[0] for timing in devices)

        cycle()  # consolidates
        cycle()
        stats = offloader.stats()  # copies of the last (steady) offload and reload
        layout = _layout(offloader, stats)
        bookkeeping = {}
        for label, context in (
            ("no_function_mode", torch._C.DisableTorchFunction),
            ("as_run", contextlib.nullcontext),
        ):
            with context(), undisturbed():
                bookkeeping[label] = summary([cycle() for _ in range(cfg["cycles"])])
        profile = None
        if cfg.get("profile") and layers == max(cfg["layers"]):
            with torch._C.DisableTorchFunction():
                profile = profile_table(cycle, cfg["cycles"])
        out.append(
            {
                "profile": profile,
                "layers": layers,
                "model_param_tensors": sum(1 for c in chunks for _ in c.parameters()),
                "optimizer_shards": sum(
                    len(g["params"])
                    for d in distributed_optimizers(optimizer)
                    for g in d.optimizer.param_groups
                ),
                "first_offload_d2h_copies": first_copies,
                "d2h_copies": stats["d2h_copies"],
                "h2d_copies": stats["h2d_copies"],
                "layout": layout,
                "bookkeeping": bookkeeping,
            }
        )
        offloader.reload()
        offloader.wait()
        offloader.detach()
        del chunks, optimizer, offloader
    return out
