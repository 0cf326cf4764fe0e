"""The host arena off the critical path: reserved at attach, reused by layout rebuilds, and the
transient peak of a rebuild counted against the host-memory budget.

A torch AdamW over fp32 masters (the inner optimizer megatron-core builds for a bf16 model:
its params are the master shards, held in ``shard_fp32_from_float16_groups``) creates its
moments at the first step. ``reserve_host`` sizes the arena from what the adapter expects;
the first offload must then lay out into it without another ``host_buffer`` call, exactly as
without the reservation. Scenarios that read state after a reload run in the isolated process
on the checked device.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_offload.adapters import megatron_wrappers as adapter
from megatron_offload.engine import HostBudget, HostMemoryBudgetError, OffloadEngine
from megatron_offload_testing import CheckedDevice

STATES, MASTERS = "optimizer_states", "master_weights"


class CountingDevice(CheckedDevice):
    """A checked device that records every host_buffer call and where it happened."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.buffers: list[tuple[str, int]] = []
        self.freed = 0
        self.phase = "setup"

    def host_buffer(self, nbytes):
        self.buffers.append((self.phase, nbytes))
        return super().host_buffer(nbytes)

    def free_host_buffer(self, buffer):
        self.freed += 1
        super().free_host_buffer(buffer)


def _model(sizes=(40, 7, 33, 16, 5, 24), seed=0, amsgrad=False):
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    opt = torch.optim.AdamW(masters, lr=0.01, amsgrad=amsgrad)
    return masters, types.SimpleNamespace(optimizer=opt, shard_fp32_from_float16_groups=[masters])


def _grads(masters, step):
    for j, p in enumerate(masters):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + j))


def _host_bytes(engine):
    return engine.host.nbytes


def _tracked_bytes(engine):
    return sum(g.nbytes for g in engine.pieces)


def _layout(engine):
    return [(g.kind, g.dtype, g.streamed, g.piece, g.offsets, g.nbytes) for g in engine.pieces]


def run_cycles(
    reserve: bool,
    fraction=1.0,
    max_piece_bytes=None,
    streamed=False,
    amsgrad=False,
    masters_first=False,
) -> dict:
    masters, distrib = _model(amsgrad=amsgrad)
    device = CountingDevice()
    engine = OffloadEngine(
        device,
        lambda: adapter.collect(distrib),
        fraction=fraction,
        max_piece_bytes=max_piece_bytes,
        streamed=(lambda: adapter.in_state(distrib)) if streamed else None,
    )
    reserved = engine.reserve_host(adapter.expected(distrib)) if reserve else 0
    first_layout = None
    host_bytes = []
    if masters_first:  # attach sends out the masters that exist before the first step
        device.phase = "attach"
        engine.offload(release=True)
        host_bytes.append((_host_bytes(engine), _tracked_bytes(engine)))
    for step in range(3):
        if engine.is_released():
            engine.reload()
            engine.wait()
        _grads(masters, step)
        device.note_compute()
        distrib.optimizer.step()
        device.phase = f"offload {step}"
        engine.offload(release=True)
        device.phase = "between"
        first_layout = first_layout or _layout(engine)
        host_bytes.append((_host_bytes(engine), _tracked_bytes(engine)))
    engine.reload()
    engine.wait()
    values = [m.detach().clone() for m in masters]
    values += [t.clone() for p in masters for t in distrib.optimizer.state[p].values()]
    engine.close()
    device.check()
    return {
        "reserved": reserved,
        "buffers": device.buffers,
        "layout": first_layout,
        "host_bytes": host_bytes,
        "values": values,
    }


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"fraction": 0.5},
        {"max_piece_bytes": 128},
        {"streamed": True, "max_piece_bytes": 200},
        {"amsgrad": True},
    ],
    ids=["whole", "fraction", "pieces", "streamed", "amsgrad"],
)
def test_the_first_offload_uses_the_arena_reserved_at_attach(isolated, options):
    with_reserve = isolated.run(run_cycles, True, **options)
    without = isolated.run(run_cycles, False, **options)
    # The reservation is the first layout's exact size, made before any step ...
    assert with_reserve["reserved"] > 0
    assert with_reserve["buffers"] == [("setup", with_reserve["reserved"])]
    # ... so no offload allocates (or pins) host memory; without it the first offload does.
    assert [phase for phase, _ in without["buffers"]] == ["offload 0"]
    assert without["buffers"][0][1] == with_reserve["reserved"]
    # The same layout, the same host bytes, bitwise the same results.
    assert with_reserve["layout"] == without["layout"]
    assert with_reserve["host_bytes"] == without["host_bytes"]
    assert all(torch.equal(a, b) for a, b in zip(with_reserve["values"], without["values"]))
    assert len(with_reserve["values"]) == len(without["values"])


def test_masters_offloaded_before_the_first_step_lay_out_into_the_reservation(isolated):
    """attach sends the masters out before the first step makes the states: that smaller
    layout reuses the arena reserved for the whole one, and so does the whole one after the
    step: one host allocation (one pinning) in all, as when the first offload follows a step."""
    run = isolated.run(run_cycles, True, masters_first=True)
    plain = isolated.run(run_cycles, True)
    assert run["buffers"] == [("setup", run["reserved"])] == plain["buffers"]
    at_attach, after_step = run["host_bytes"][0], run["host_bytes"][1]
    assert at_attach[1] < after_step[1] == at_attach[0] == run["reserved"]  # masters alone
    assert all(torch.equal(a, b) for a, b in zip(run["values"], plain["values"]))
    assert len(run["values"]) == len(plain["values"])


def test_a_reservation_the_budget_cannot_hold_is_refused_before_anything_is_allocated():
    masters, distrib = _model()
    expected = adapter.expected(distrib)
    need = OffloadEngine(CountingDevice(), lambda: adapter.collect(distrib)).reserve_host(expected)
    device = CountingDevice()
    engine = OffloadEngine(device, lambda: adapter.collect(distrib), budget=HostBudget(need - 1))
    with pytest.raises(HostMemoryBudgetError, match=f"needs {need:,} bytes.*Nothing was allocated"):
        engine.reserve_host(expected)
    assert device.buffers == [] and _host_bytes(engine) == 0
    # The budget that holds it reserves exactly the need.
    engine = OffloadEngine(device, lambda: adapter.collect(distrib), budget=HostBudget(need))
    assert engine.reserve_host(expected) == need


def test_unforeseeable_states_reserve_nothing():
    masters, distrib = _model()
    distrib.optimizer = torch.optim.SGD(masters, lr=0.1, momentum=0.9)  # not an Adam
    assert adapter.expected(distrib) is None
    assert OffloadEngine(CountingDevice(), lambda: adapter.collect(distrib)).reserve_host(None) == 0


def run_rebuild(limit_factor=None) -> dict:
    """Masters released; the moments are replaced by new tensors of the same sizes (a load):
    the layout is rebuilt with the masters carried from the arena into the same arena."""
    masters, distrib = _model(sizes=(40, 7, 33))
    device = CountingDevice()
    budget = HostBudget(None)
    engine = OffloadEngine(device, lambda: adapter.collect(distrib), budget=budget)
    _grads(masters, 0)
    distrib.optimizer.step()
    expected = [m.detach().clone() for m in masters]
    engine.offload([MASTERS], release=True)
    arena = engine.host_arena
    need = _host_bytes(engine)
    state = distrib.optimizer.state
    for p in masters:  # new tensors, as a load puts them in
        state[p] = {k: v.clone() for k, v in state[p].items()}
    engine.invalidate()
    if limit_factor is not None:
        budget.limit = int(need * limit_factor)
    error = None
    device.phase = "rebuild"
    try:
        engine.offload([STATES], release=True)
    except HostMemoryBudgetError as exc:
        error = str(exc)
    reused = engine.host_arena is arena
    released = engine.is_released([MASTERS])
    engine.reload()
    engine.wait()
    intact = all(torch.equal(m.detach(), e) for m, e in zip(masters, expected))
    host_equals_tracked = _host_bytes(engine) == _tracked_bytes(engine)
    engine.close()
    device.check()
    return {
        "error": error,
        "reused": reused,
        "released": released,
        "intact": intact,
        "buffers": device.buffers,
        "host_equals_tracked": host_equals_tracked,
    }


def test_a_rebuild_that_fits_reuses_the_arena_and_carries_released_copies(isolated):
    out = isolated.run(run_rebuild)
    assert out["error"] is None and out["reused"] and out["released"]
    assert [phase for phase, _ in out["buffers"]] == ["setup"]  # the rebuild allocated nothing
    assert out["intact"] and out["host_equals_tracked"]


def run_growth(halves: int) -> dict:
    """States appear while the masters are released: a larger arena is needed while the old
    one still holds the masters' only copy (old + new at once)."""
    masters, distrib = _model(sizes=(40, 7, 33))
    device = CountingDevice()
    budget = HostBudget(None)
    engine = OffloadEngine(device, lambda: adapter.collect(distrib), budget=budget)
    expected = [m.detach().clone() for m in masters]
    engine.offload([MASTERS], release=True)  # no states yet: the arena holds the masters only
    old = engine.host_arena
    old_bytes = _host_bytes(engine)
    for p in masters:  # the states Adam makes (by hand: the masters are on the host)
        distrib.optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.full(p.shape, 2.0),
            "exp_avg_sq": torch.full(p.shape, 3.0),
        }
    budget.limit = halves * old_bytes // 2
    buffers_before, freed_before = len(device.buffers), device.freed
    error = None
    try:
        engine.offload([STATES], release=True)
    except HostMemoryBudgetError as exc:
        error = str(exc)
    untouched = (
        engine.host_arena is old
        and len(device.buffers) == buffers_before
        and device.freed == freed_before
        and engine.is_released([MASTERS])
    )
    if error is not None:
        budget.limit = None
        engine.offload([STATES], release=True)
    new_bytes = _host_bytes(engine)
    engine.reload()
    engine.wait()
    intact = all(torch.equal(m.detach(), e) for m, e in zip(masters, expected))
    intact = intact and all(
        torch.equal(distrib.optimizer.state[p]["exp_avg_sq"], torch.full(p.shape, 3.0))
        for p in masters
    )
    engine.close()
    device.check()
    return {
        "error": error,
        "untouched": untouched,
        "intact": intact,
        "old": old_bytes,
        "new": new_bytes,
    }


def test_a_budget_below_the_transient_peak_of_a_rebuild_is_refused_before_anything_moves(isolated):
    # Room for the new layout alone (and more than the old one), not for both at once.
    out = isolated.run(run_growth, 7)
    assert out["new"] > out["old"] and out["new"] <= 7 * out["old"] // 2 < out["new"] + out["old"]
    assert (
        out["error"] is not None
        and "at once" in out["error"]
        and "Nothing was freed" in out["error"]
    )
    assert out["untouched"] and out["intact"]


def test_a_budget_holding_the_transient_peak_lets_the_rebuild_through(isolated):
    out = isolated.run(run_growth, 8)
    assert out["error"] is None and out["untouched"] is False and out["intact"]
    assert out["new"] + out["old"] <= 4 * out["old"]
