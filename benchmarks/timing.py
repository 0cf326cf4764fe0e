"""Measurement tools shared by every benchmark mode.

* ``TimingDevice`` wraps the offloader's ``Device`` and accumulates the host time spent
  inside the calls that do physical work (allocation, release, copies, host waits), so that
  "bookkeeping" = wall time of the offloader's calls minus that physical time can be
  measured at any size, not only for tiny tensors.
* ``interleaved`` alternates the measured variants (ABBA order) so that a burst of load on a
  shared 2-core machine hits both sides alike; results are reported as medians.
* ``FloorCopy`` is the physical floor of one cycle: allocate one fresh flat buffer of the
  offloaded bytes, copy the host copy into it, copy it back out, free it.
"""

from __future__ import annotations

import cProfile
import gc
import os
import platform
import pstats
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable

import torch

from megatron_offload.device.base import Device

perf_counter = time.perf_counter


class TimingDevice(Device):
    """A ``Device`` that forwards every call to ``inner`` and times the physical ones.

    Physical = memory (host buffers, release, regrow, empty), copies and host waits for
    the device. The ordering calls (streams, events) are bookkeeping and are only counted.
    The timer costs two ``perf_counter`` calls per physical call: with consolidated groups
    that is a handful per cycle (well under a microsecond in total).
    """

    def __init__(self, inner: Device) -> None:
        self.inner = inner
        self.is_accelerator = inner.is_accelerator
        self.torch_device = inner.torch_device
        self.physical_seconds = 0.0
        self.calls: Counter = Counter()
        self.copied_bytes = 0

    def take(self) -> tuple[float, Counter, int]:
        """(physical seconds, call counts, copied bytes) since the last ``take``; resets them."""
        taken = (self.physical_seconds, self.calls, self.copied_bytes)
        self.physical_seconds, self.calls, self.copied_bytes = 0.0, Counter(), 0
        return taken

    def _timed(self, name, fn, *args, **kwargs):
        start = perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.physical_seconds += perf_counter() - start
            self.calls[name] += 1

    # physical work
    def host_buffer(self, nbytes):
        return self._timed("host_buffer", self.inner.host_buffer, nbytes)

    def free_host_buffer(self, buffer):
        return self._timed("free_host_buffer", self.inner.free_host_buffer, buffer)

    def release(self, tensor):
        return self._timed("release", self.inner.release, tensor)

    def regrow(self, tensor, nbytes):
        return self._timed("regrow", self.inner.regrow, tensor, nbytes)

    def empty(self, numel, dtype):
        return self._timed("empty", self.inner.empty, numel, dtype)

    def copy(self, dst, src):
        self.copied_bytes += src.numel() * src.element_size()
        return self._timed("copy", self.inner.copy, dst, src)

    def synchronize_event(self, event, *, label=""):
        return self._timed("synchronize_event", self.inner.synchronize_event, event, label=label)

    def synchronize(self):
        return self._timed("synchronize", self.inner.synchronize)

    # ordering (bookkeeping): counted, not timed
    def current_stream(self):
        self.calls["current_stream"] += 1
        return self.inner.current_stream()

    def new_stream(self):
        self.calls["new_stream"] += 1
        return self.inner.new_stream()

    def use_stream(self, stream):
        self.calls["use_stream"] += 1
        return self.inner.use_stream(stream)

    def wait_stream(self, waiter, waitee, *, label=""):
        self.calls["wait_stream"] += 1
        return self.inner.wait_stream(waiter, waitee, label=label)

    def record_event(self, stream, *, timing=False):
        self.calls["record_event"] += 1
        return self.inner.record_event(stream, timing=timing)

    def elapsed_ms(self, start, end):
        return self.inner.elapsed_ms(start, end)

    def wait_event(self, stream, event, *, label=""):
        self.calls["wait_event"] += 1
        return self.inner.wait_event(stream, event, label=label)

    def record_stream(self, tensor, stream, *, label=""):
        self.calls["record_stream"] += 1
        return self.inner.record_stream(tensor, stream, label=label)

    def memory_allocated(self):
        return self.inner.memory_allocated()


def device_sync(torch_device: torch.device) -> Callable[[], None]:
    """A function that blocks until all queued work of ``torch_device`` is done."""
    if torch_device.type == "cpu":
        return lambda: None
    module = torch.get_device_module(torch_device.type)
    return lambda: module.synchronize(torch_device)


class FloorCopy:
    """The physical floor of one offload cycle of ``nbytes``.

    The host copy is allocated (pinned on accelerators) and touched once, as the offloader's
    arena is; each measurement then allocates a fresh device buffer, copies host -> device,
    device -> host, and frees the buffer, waiting for the device at the end. The copies use
    ``dtype`` elements, as the offloader's groups do (fp32 unless the bytes do not divide).
    """

    def __init__(self, nbytes: int, torch_device: torch.device, dtype: torch.dtype = torch.float32):
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes % itemsize:
            dtype, itemsize = torch.uint8, 1
        self.numel = nbytes // itemsize
        self.dtype = dtype
        self.device = torch_device
        self.accelerator = torch_device.type != "cpu"
        self.host = torch.empty(self.numel, dtype=dtype, pin_memory=self.accelerator)
        self.host.fill_(1)  # fault the pages in now, as the offloader's arena has been
        self._sync = device_sync(torch_device)

    def __call__(self) -> float:
        start = perf_counter()
        buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        buffer.copy_(self.host, non_blocking=self.accelerator)
        self.host.copy_(buffer, non_blocking=self.accelerator)
        del buffer  # stream-ordered free on accelerators: safe before the copy completes
        self._sync()
        return perf_counter() - start


@contextmanager
def undisturbed():
    """Time code as it runs in training: no garbage collection, no coverage tracer.

    A collection in one sample is pure noise. The test suite runs under coverage, whose
    tracer multiplies the cost of every Python line, which is exactly what bookkeeping
    measures (the offloader at 2,000 parameter tensors: 0.3 ms without it, 2.5 ms with
    it); it is paused for the measurement and resumed after (the lines run meanwhile are
    covered by other tests).
    """
    global _undisturbed_depth
    if _undisturbed_depth:  # nested: the outermost block pauses and resumes
        yield
        return
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    collector = _active_coverage_collector()
    if collector is not None:
        collector.pause()
    _undisturbed_depth += 1
    try:
        yield
    finally:
        _undisturbed_depth -= 1
        if collector is not None:
            collector.resume()
        if was_enabled:
            gc.enable()


_undisturbed_depth = 0


def _active_coverage_collector():
    """The coverage collector tracing this process, if any (None when coverage is absent).

    Processes started under coverage can hold several nested measurements (the startup
    hook's and multiprocessing's); only the innermost one traces, the others are paused
    by coverage itself, so pausing that one stops all tracing. This is the pause/resume
    coverage uses for nested measurements; if a coverage version lacks it, nothing is
    paused (and a timing test run under that coverage may then fail on the tracer's cost).
    """
    module = sys.modules.get("coverage.collector")  # never import coverage just to find out
    stack = getattr(getattr(module, "Collector", None), "_collectors", None)
    if not stack:
        return None
    collector = stack[-1]
    if not (hasattr(collector, "pause") and hasattr(collector, "resume")):
        return None
    return collector


def interleaved(variants: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run each variant ``repeats`` times in ABBA order; each call returns its own seconds."""
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with undisturbed():
        for repeat in range(repeats):
            for name in names if repeat % 2 == 0 else reversed(names):
                samples[name].append(variants[name]())
    return samples


def summary(samples: list[float]) -> dict:
    """Median, min and quartiles of a list of seconds."""
    ordered = sorted(samples)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4)
    else:
        q1, q3 = ordered[0], ordered[-1]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "q1": q1,
        "q3": q3,
        "n": len(ordered),
    }


def ratio_figures(cycle: list[float], floor: list[float]) -> dict:
    """Cycle / floor: the ratio of medians (the headline) and the median of paired ratios.

    Pairs are the two samples of one ABBA repetition, taken within a fraction of a second of
    each other, so their ratio is less sensitive to slow drifts in machine load.
    """
    return {
        "ratio_of_medians": statistics.median(cycle) / statistics.median(floor),
        "median_paired_ratio": statistics.median(c / f for c, f in zip(cycle, floor)),
        "ratio_of_minima": min(cycle) / min(floor),
    }


def machine() -> dict:
    """What the figures were measured on (the load average says how noisy it was)."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "load_average": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def profile_table(fn: Callable[[], object], calls: int, top: int = 12) -> dict:
    """cProfile ``calls`` calls of ``fn``: the functions with the most own time, per call.

    The profiler adds overhead to every Python call, so absolute figures are inflated
    (``profiled_call`` against an unprofiled timing says by how much); the shares show
    where the time goes.
    """
    profiler = cProfile.Profile()
    with undisturbed():
        start = perf_counter()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        profiled = (perf_counter() - start) / calls
    rows = []
    for (filename, line, name), (_cc, ncalls, tottime, cumtime, _callers) in pstats.Stats(
        profiler
    ).stats.items():
        rows.append(
            {
                "function": f"{_short(filename)}:{line}({name})",
                "calls_per_cycle": ncalls / calls,
                "tottime_per_cycle": tottime / calls,
                "cumtime_per_cycle": cumtime / calls,
            }
        )
    rows.sort(key=lambda r: -r["tottime_per_cycle"])
    return {"cycles": calls, "profiled_cycle": profiled, "top_tottime": rows[:top]}


def _short(filename: str) -> str:
    marker = "megatron_offload/"
    if marker in filename:
        return marker + filename.split(marker, 1)[1]
    if filename.startswith(("~", "<")):
        return filename
    return filename.rsplit("/", 1)[-1]
