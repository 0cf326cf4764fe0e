"""Engine-level benchmark over synthetic Adam-like state (no megatron-core needed).

``SyntheticAdamState`` mimics what the DistributedOptimizer adapter hands the engine for a
model of ``n_params`` parameter shards: one fp32 master per parameter (``master_weights``)
and two moments (``optimizer_states``) kept in a torch-optimizer-like ``state`` dict, every
tensor with its own storage as the optimizer creates them, yielded in the adapter's order
(masters first, then the states parameter by parameter). Sizes vary from parameter to
parameter (a fixed-seed draw) so that nothing depends on uniform tensors.

The engine is given the state fingerprint the offloader gives it (``StateWatch``, which
looks at the containers and at the state dicts that may still grow, in O(groups)), when the
engine accepts one; ``fingerprint=False`` makes it walk every tensor at every offload, which
is what the first offload after a checkpoint load costs.

``EngineBench`` drives one ``OffloadEngine`` through the cycle the attached offloader runs
around each step, minus the update itself:

    reload -> wait -> mark_dirty (the step writes) -> offload -> release

and records wall time per phase, physical time (from ``TimingDevice``) and copies.
"""

from __future__ import annotations

import inspect
import statistics
import types
from dataclasses import dataclass, field

import torch

from megatron_offload.adapters import MASTER_WEIGHTS, OPTIMIZER_STATES
from megatron_offload.adapters.megatron_wrappers import StateWatch
from megatron_offload.device import device_for
from megatron_offload.engine import OffloadEngine

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

MiB = 1 << 20

PHASES = ("reload", "wait", "offload", "release")


class SyntheticAdamState:
    """Masters and Adam moments for ``n_params`` parameters, about ``total_bytes`` in all.

    ``total_bytes`` is split over the parameters (at least ``min_numel`` elements each); the
    exact figure is ``nbytes``. ``moment_dtype`` other than fp32 gives a second group dtype
    (and odd element counts), which is where a careless host layout would need padding.
    """

    def __init__(
        self,
        n_params: int,
        total_bytes: int,
        *,
        moment_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        min_numel: int = 1,
        seed: int = 0,
    ) -> None:
        if n_params < 1:
            raise ValueError("n_params must be >= 1")
        moment_size = torch.empty((), dtype=moment_dtype).element_size()
        per_element = 4 + 2 * moment_size  # master + exp_avg + exp_avg_sq
        total_numel = max(n_params * min_numel, total_bytes // per_element)
        gen = torch.Generator().manual_seed(seed)
        weights = (torch.rand(n_params, generator=gen, dtype=torch.float64) + 0.5).tolist()
        scale = (total_numel - n_params * min_numel) / sum(weights)
        numels = [min_numel + int(w * scale) for w in weights]
        numels[-1] += total_numel - sum(numels)  # exact total
        self.numels = numels
        self.masters = []
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        for i, numel in enumerate(numels):
            # Distinct values per tensor, written so every page is really allocated.
            self.masters.append(torch.empty(numel, dtype=torch.float32, device=device).fill_(i))
            self.state[i] = {
                "exp_avg": torch.empty(numel, dtype=moment_dtype, device=device).fill_(0.5),
                "exp_avg_sq": torch.empty(numel, dtype=moment_dtype, device=device).fill_(0.25),
                "step": torch.zeros(()),  # never moved, as in torch's Adam
            }
        self.nbytes = sum(numels) * per_element
        self.n_params = n_params
        # Shaped like a DistributedOptimizer for the offloader's fingerprint: an inner
        # optimizer with param groups and a state mapping, and the masters beside it.
        self.optimizer = types.SimpleNamespace(
            state=self.state, param_groups=[{"params": list(self.state)}]
        )
        self.shard_fp32_from_float16_groups = [self.masters]
        # The states are megatron-core's Adam's (torch AdamW's layout), updated in place: the
        # watch need not compare every state tensor's identity, as it does for an optimizer
        # it does not know (which may replace its states in step(), as SOAP does).
        self.fingerprint = StateWatch(self, identities=False)

    @property
    def n_tensors(self) -> int:
        return 3 * self.n_params

    def tensors(self):
        yield from self.masters
        for entries in self.state.values():
            yield entries["exp_avg"]
            yield entries["exp_avg_sq"]

    def collect(self):
        """The ``(kind, tensor)`` pairs, in the order the DistributedOptimizer adapter uses."""
        for master in self.masters:
            yield MASTER_WEIGHTS, master
        for entries in self.state.values():
            yield OPTIMIZER_STATES, entries["exp_avg"]
            yield OPTIMIZER_STATES, entries["exp_avg_sq"]


def engine_accepts_fingerprint() -> bool:
    """Whether this engine can be told when the tracked set may have changed."""
    return "fingerprint" in inspect.signature(OffloadEngine).parameters


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what memory they really hold).

    Reads only storage metadata, never data, so it is safe on released tensors.
    """
    seen = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def byte_figures(engine: OffloadEngine, stats: dict) -> dict:
    """Offloaded and host bytes of one engine, from ``stats()`` and measured independently.

    ``payload_bytes`` is the sum of the sizes of the tensors the engine moved (element count
    times element size), counted here from the tensors themselves; ``host_ratio`` is the
    host memory held per payload byte, so padding or rounding inside the engine shows up
    in it even when ``stats()`` counts the padding as offloaded.
    """
    released = [g for g in engine.pieces if g.place.value == "released"]
    payload = sum(t.numel() * t.element_size() for g in released for t in g.tensors)
    host_storage = unique_storage_bytes(g.host for g in engine.pieces)
    return {
        "payload_bytes": payload,
        "offloaded_bytes": stats["offloaded_bytes"],
        "tracked_bytes": stats["tracked_bytes"],
        "host_bytes": stats["host_bytes"],
        "host_storage_bytes": host_storage,  # the arena's storage itself, not a counter
        "host_ratio": max(stats["host_bytes"], host_storage) / payload if payload else float("nan"),
        "host_ratio_stats": stats["host_bytes"] / stats["offloaded_bytes"]
        if stats["offloaded_bytes"]
        else float("nan"),
    }


@dataclass
class CycleRecord:
    seconds: float
    phases: dict
    physical_seconds: float
    copies: int
    copied_bytes: int

    @property
    def bookkeeping_seconds(self) -> float:
        return self.seconds - self.physical_seconds


@dataclass
class EngineBench:
    """One engine over one synthetic state, warmed up to the steady (consolidated) cycle."""

    n_params: int
    total_bytes: int
    moment_dtype: torch.dtype = torch.float32
    torch_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    min_numel: int = 1
    warm_cycles: int = 2
    fingerprint: bool = True

    def __post_init__(self) -> None:
        self.state = SyntheticAdamState(
            self.n_params,
            self.total_bytes,
            moment_dtype=self.moment_dtype,
            device=self.torch_device,
            min_numel=self.min_numel,
        )
        self.device = TimingDevice(device_for(self.torch_device))
        options = {}
        self.fingerprinted = self.fingerprint and engine_accepts_fingerprint()
        if self.fingerprinted:
            options["fingerprint"] = self.state.fingerprint
        self.engine = OffloadEngine(
            self.device, self.state.collect, name="benchmark engine", **options
        )
        self._sync = device_sync(self.torch_device)
        self.records: list[CycleRecord] = []
        # The first offload copies tensor by tensor (nothing is consolidated yet); the first
        # reload consolidates each group. Record it, then run to the steady state.
        self.engine.offload()
        self.engine.release()
        self._sync()
        self.first_offload = dict(self.engine.stats())
        self.first_offload["device_copy_calls"] = self.device.take()[1]["copy"]
        for _ in range(self.warm_cycles):
            self.cycle()

    # ------------------------------------------------------------------ cycle
    def cycle(self) -> CycleRecord:
        """One steady cycle from the released state back to the released state."""
        engine = self.engine
        self.device.take()
        t0 = perf_counter()
        engine.reload()
        t1 = perf_counter()
        engine.wait()
        t2 = perf_counter()
        engine.mark_dirty()  # the step the cycle brackets writes every state
        engine.offload()
        t3 = perf_counter()
        engine.release()
        t4 = perf_counter()
        self._sync()  # accelerators: the copies are done only now (counted as physical)
        t5 = perf_counter()
        physical, calls, copied = self.device.take()
        return CycleRecord(
            seconds=t5 - t0,
            phases={"reload": t1 - t0, "wait": t2 - t1, "offload": t3 - t2, "release": t4 - t3},
            physical_seconds=physical + (t5 - t4),
            copies=calls["copy"],
            copied_bytes=copied,
        )

    def timed_cycle(self) -> float:
        record = self.cycle()
        self.records.append(record)
        return record.seconds

    # ---------------------------------------------------------------- figures
    def layout(self) -> dict:
        """Bytes and copies while released (the state between two steps)."""
        stats = self.engine.stats()
        return {
            "n_params": self.n_params,
            "n_tensors": self.state.n_tensors,
            **byte_figures(self.engine, stats),
            "state_bytes": self.state.nbytes,  # what the synthetic optimizer holds
            "device_bytes_held": unique_storage_bytes(self.state.tensors()),  # 0 when all freed
            "pieces": sum(stats["pieces"].values()),
            "d2h_copies": stats["d2h_copies"],
            "h2d_copies": stats["h2d_copies"],
            "first_offload_d2h_copies": self.first_offload["d2h_copies"],
        }

    def close(self) -> None:
        self.engine.reload()
        self.engine.wait()
        self._sync()
        self.engine.close()


# ---------------------------------------------------------------------- measurements
def cycle_vs_floor(bench: EngineBench, repeats: int) -> dict:
    """Steady cycles interleaved with the physical floor of the same bytes (medians)."""
    floor = FloorCopy(bench.engine.stats()["tracked_bytes"], bench.torch_device)
    bench.records = []
    samples = interleaved({"cycle": bench.timed_cycle, "floor": floor}, repeats)
    records = bench.records
    del floor
    return {
        "bytes": bench.engine.stats()["tracked_bytes"],
        "repeats": repeats,
        "cycle": summary(samples["cycle"]),
        "floor": summary(samples["floor"]),
        **ratio_figures(samples["cycle"], samples["floor"]),
        "phases": {p: statistics.median(r.phases[p] for r in records) for p in PHASES},
        "bookkeeping": summary([r.bookkeeping_seconds for r in records]),
        "copies_per_cycle": statistics.median(r.copies for r in records),
        "copied_bytes_per_cycle": statistics.median(r.copied_bytes for r in records),
    }


def bookkeeping(bench: EngineBench, repeats: int) -> dict:
    """Host time per cycle outside physical work (wall minus ``TimingDevice`` time)."""
    with undisturbed():
        records = [bench.cycle() for _ in range(repeats)]
    return {
        "n_params": bench.n_params,
        "n_tensors": bench.state.n_tensors,
        "bytes": bench.state.nbytes,
        "repeats": repeats,
        "bookkeeping": summary([r.bookkeeping_seconds for r in records]),
        "cycle": summary([r.seconds for r in records]),
        "phases": {p: statistics.median(r.phases[p] for r in records) for p in PHASES},
        "copies_per_cycle": statistics.median(r.copies for r in records),
    }


def profile_cycles(bench: EngineBench, cycles: int, top: int = 12) -> dict:
    """Where the host time of a steady cycle goes, function by function (cProfile)."""
    table = profile_table(bench.cycle, cycles, top)
    return {"n_params": bench.n_params, "n_tensors": bench.state.n_tensors, **table}


def copies_scaling(n_params: int, factor: int = 10, *, torch_device=None, cycles: int = 3) -> dict:
    """Copies per steady cycle for ``n_params`` and ``factor`` times more (tiny tensors)."""
    torch_device = torch_device or torch.device("cpu")
    out = {}
    for n in (n_params, n_params * factor):
        bench = EngineBench(n, 0, torch_device=torch_device)
        records = [bench.cycle() for _ in range(cycles)]
        stats = bench.engine.stats()
        out[n] = {
            "n_tensors": bench.state.n_tensors,
            "pieces": sum(stats["pieces"].values()),
            "d2h_copies": stats["d2h_copies"],
            "h2d_copies": stats["h2d_copies"],
            "device_copy_calls": max(r.copies for r in records),
            "first_offload_d2h_copies": bench.first_offload["d2h_copies"],
        }
        bench.close()
    return out


def rescan_anatomy(bench: EngineBench, repeats: int = 20) -> dict:
    """Without a profiler: what a walk over the optimizer's tensors costs, piece by piece.

    Times, on the unchanged steady state (medians, seconds per call), draining ``collect``
    alone; each per-tensor check the engine makes when it rescans (the tensor's type,
    device, contiguity and size); the state fingerprint that lets it skip the walk; the
    engine's rescan (an internal method: None if the engine no longer has one; it is the
    whole walk only on a bench made with ``fingerprint=False``) and a whole offload call.
    """
    tensors = [t for _, t in bench.state.collect()]
    torch_device = bench.device.torch_device
    movable_types = (torch.Tensor, torch.nn.Parameter)

    def timed(fn) -> float:
        samples = []
        for _ in range(repeats):
            start = perf_counter()
            fn()
            samples.append(perf_counter() - start)
        return statistics.median(samples)

    with undisturbed():
        figures = {
            "collect_drain": timed(lambda: [pair for pair in bench.state.collect()]),
            "loop_only": timed(lambda: [None for _t in tensors]),
            "type_check": timed(lambda: [type(t) in movable_types for t in tensors]),
            "tensor_device": timed(lambda: [t.device for t in tensors]),
            "device_compare": timed(lambda: [t.device != torch_device for t in tensors]),
            "is_contiguous": timed(lambda: [t.is_contiguous() for t in tensors]),
            "numel": timed(lambda: [t.numel() for t in tensors]),
            "identity_compare": timed(lambda: all(a is b for a, b in zip(tensors, tensors))),
            "state_fingerprint": timed(bench.state.fingerprint),
        }
        figures["engine_rescan"] = timed(bench.engine.rescan)
        bench.engine.reload()
        bench.engine.wait()
        figures["offload_call"] = timed(lambda: (bench.engine.mark_dirty(), bench.engine.offload()))
        bench.engine.release()
    return {"n_tensors": len(tensors), "repeats": repeats, "seconds": figures}
