"""Copy times measured on the device: transfer milliseconds and GB/s per direction, and the
time the compute stream waited for a copy-back (exposed), read lazily by ``stats()``.

On the modelled device the timing events carry the modelled clock, so every figure has an
exact expected value (bytes over the modelled bandwidth); on the CPU they are host
timestamps around the synchronous copies. Engines run in the isolated process.
"""

from __future__ import annotations

import pytest

from megatron_offload.device import CPUDevice
from megatron_offload.engine import OffloadEngine
from megatron_offload.engine.figures import PENDING_PER_QUANTITY, CopyTimes, gbps

from ..testing.test_modelled_device import D2H, H2D, STEP, new_device, new_net


def _modelled_cycle():
    device = new_device()
    model = device.model
    net = new_net()
    engine = OffloadEngine(device, net.collect)
    net.step(0)
    model.compute(STEP)
    out = {"before": engine.stats()}

    engine.offload(release=True)
    issued = model.now
    out["d2h_bytes"] = engine.stats()["d2h_bytes"]
    out["while_copying"] = engine.stats()  # the D2H is still running in modelled time
    out["clock_unmoved"] = model.now == issued  # reading the figures never waits
    model.compute(2 * out["d2h_bytes"] / D2H)  # the next forward and backward
    out["after_copy"] = engine.stats()

    # A copy-back waited for at once: the compute stream stalls for all of it.
    engine.reload()
    out["h2d_bytes"] = engine.stats()["h2d_bytes"]
    engine.wait()
    out["waited_at_once"] = engine.stats()

    # A copy-back that had time to finish: nothing is exposed.
    engine.mark_dirty()
    engine.offload(release=True)
    model.compute(2 * out["d2h_bytes"] / D2H)
    engine.reload()
    model.compute(2 * out["h2d_bytes"] / H2D)
    engine.wait()
    out["overlapped"] = engine.stats()
    device.check()
    return out


def test_modelled_transfer_times_and_exposed_time(isolated):
    out = isolated.run(_modelled_cycle)
    d2h_s, h2d_s = out["d2h_bytes"] / D2H, out["h2d_bytes"] / H2D
    for key in ("d2h_ms", "h2d_ms", "exposed_ms", "d2h_gbps", "h2d_gbps"):
        assert out["before"][key] == 0
    # Lazily: nothing is known while the copy runs, and asking did not wait for it.
    assert out["while_copying"]["d2h_ms"] == 0 and out["clock_unmoved"]
    after = out["after_copy"]
    assert after["d2h_ms"] == pytest.approx(d2h_s * 1e3)
    assert after["d2h_timed_bytes"] == out["d2h_bytes"] > 0
    assert after["d2h_gbps"] == pytest.approx(D2H / 1e9)
    waited = out["waited_at_once"]
    assert waited["h2d_ms"] == pytest.approx(h2d_s * 1e3)
    assert waited["h2d_gbps"] == pytest.approx(H2D / 1e9)
    assert waited["exposed_ms"] == pytest.approx(h2d_s * 1e3)  # the whole copy-back
    assert out["overlapped"]["exposed_ms"] == 0  # hidden behind the modelled compute


def _cpu_cycle():
    net = new_net()
    engine = OffloadEngine(CPUDevice(), net.collect)
    net.step(0)
    engine.offload(release=True)
    engine.reload()
    engine.wait()
    return engine.stats()


def test_cpu_figures_are_the_measured_copies_all_exposed(isolated):
    stats = isolated.run(_cpu_cycle)
    assert stats["d2h_ms"] > 0 and stats["h2d_ms"] > 0
    assert stats["d2h_timed_bytes"] == stats["d2h_bytes"] > 0
    assert stats["h2d_timed_bytes"] == stats["h2d_bytes"] > 0
    assert stats["d2h_gbps"] == pytest.approx(gbps(stats["d2h_bytes"], stats["d2h_ms"]))
    assert stats["exposed_ms"] == pytest.approx(stats["d2h_ms"] + stats["h2d_ms"])


class _Clock:
    """A device whose timing events complete when the test says so."""

    is_accelerator = True

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.asked = 0

    def elapsed_ms(self, start, end):
        self.asked += 1
        return float(end - start) if end in self.done else None


def test_the_newest_completed_measurement_wins_and_pending_ones_are_bounded():
    clock = _Clock()
    times = CopyTimes(clock)
    for index in range(10):
        times.pending["d2h"].append((100 * index, 100 * index + index + 1, 1000 * (index + 1)))
    assert len(times.pending["d2h"]) == PENDING_PER_QUANTITY  # the oldest were dropped
    assert times.read()["d2h_ms"] == 0  # none completed yet: nothing measured
    clock.done = {100 * i + i + 1 for i in (6, 7)}  # 8 and 9 still running
    figures = times.read()
    assert (figures["d2h_ms"], figures["d2h_timed_bytes"]) == (8.0, 8000)  # the newest done: 7
    assert len(times.pending["d2h"]) == 2  # 8 and 9 are kept for a later read
    clock.done.add(100 * 9 + 10)
    assert times.read()["d2h_ms"] == 10.0 and not times.pending["d2h"]


def test_devices_without_timing_events_report_nothing():
    times = CopyTimes(_Clock())
    times.pending["h2d"].append((None, None, 10))  # what record_event gives on such a device
    assert times.read()["h2d_ms"] == 0 and not times.pending["h2d"]


def test_the_offloader_rate_comes_from_summed_bytes_and_times():
    # Two optimizers: 1 GB in 10 ms and 3 GB in 10 ms give 200 GB/s, not 100 + 300.
    assert gbps(4 * 10**9, 20.0) == pytest.approx(200.0)
    assert gbps(0, 0.0) == 0.0
