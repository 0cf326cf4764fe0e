"""The modelled device: real tensors on the checked device, memory and time in the allocator model.

Bodies that drive the engine run in the isolated process (a bug could leave torch touching
released memory, which kills a CPU process); they return plain figures asserted here.
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_offload.engine import OffloadEngine
from megatron_offload_testing.allocator_model import AllocatorModel, MiB
from megatron_offload_testing.modelled_device import REUSE_BEFORE_COPY, ModelledDevice
from tests.harness.adamw_model import AdamWModel

D2H, H2D = 1e9, 2e9  # bytes per second
STEP = 0.01  # modelled seconds of one optimizer step
NUMEL = 3 * MiB // 4  # float32 elements: 3 MiB per tensor (large pool, split 20 MiB segments)
RECORD_STREAM = "d2h-record-stream"  # the engine's label for its record_stream calls


def new_net() -> AdamWModel:
    """Two parameters and their AdamW states, all 3 MiB, in the shape the adapters produce."""
    return AdamWModel([((NUMEL,), torch.float32)] * 2, grad_seed=100)


def new_device(**kwargs) -> ModelledDevice:
    return ModelledDevice(capacity=1 << 30, d2h_bandwidth=D2H, h2d_bandwidth=H2D, **kwargs)


# ------------------------------------------------------------ the engine's cycle
def _offload_cycles(steps: int):
    device = new_device()
    model = device.model
    net = new_net()
    engine = OffloadEngine(device, net.collect)
    cycles = []
    for index in range(steps):
        cycle = {}
        if engine.is_released():
            cycle["reload_start"], cycle["reserved_before"] = model.now, model.reserved_bytes
            engine.reload()
            engine.wait()  # the compute stream waits for the H2D: the clock moves to its end
            cycle.update(
                reload_end=model.now,
                h2d_bytes=engine.stats()["h2d_bytes"],
                reserved_after=model.reserved_bytes,
                allocated_after=model.allocated_bytes,
            )
        engine.mark_dirty()
        net.step(index)
        model.compute(STEP)
        expected = net.snapshot()
        t0 = model.now
        engine.offload()
        allocated, cached = model.allocated_bytes, model.reusable_bytes()
        engine.release()
        end = t0 + engine.stats()["d2h_bytes"] / D2H
        cycle.update(
            t0=t0,
            end=end,
            offloaded=engine.stats()["offloaded_bytes"],
            released=allocated - model.allocated_bytes,
            at_release=model.reusable_bytes() - cached,
            just_before=model.reusable_bytes(at=end * (1 - 1e-9)) - cached,
            at_end=model.reusable_bytes(at=end * (1 + 1e-9)) - cached,  # end, up to rounding
        )
        model.compute(end - model.now + STEP)  # the next forward and backward
        freed = [(t, n) for t, n in model.reuse_timeline() if t >= t0]
        cycle["freed_last"], cycle["freed_bytes"] = (
            max(t for t, _ in freed),
            sum(n for _, n in freed),
        )
        cycles.append(cycle)
    reserved, start = model.reserved_bytes, model.now
    engine.reload()
    engine.wait()
    same = all(torch.equal(a, b) for a, b in zip(expected, net.snapshot()))
    final = {
        "same": same,
        "reload_seconds": model.now - start,
        "h2d_bytes": engine.stats()["h2d_bytes"],
        "new_segments": model.reserved_bytes - reserved,
        "stalls": len(model.stalls),
        "hazards": len(model.hazards),
        "violations": [v.kind for v in device.check(raise_on_violation=False)],
    }
    return cycles, final


def test_released_memory_becomes_reusable_when_the_d2h_ends_and_reload_reuses_it(isolated):
    cycles, final = isolated.run(_offload_cycles, 3)
    for cycle in cycles:
        assert cycle["released"] >= cycle["offloaded"] > 0
        assert cycle["at_release"] == 0  # the D2H still reads every released byte
        assert cycle["just_before"] < cycle["released"]
        assert cycle["at_end"] == cycle["released"]  # all of it once the copy ended
        assert cycle["freed_last"] == pytest.approx(cycle["end"])
        assert cycle["freed_bytes"] == cycle["released"]
    for cycle in cycles[1:]:
        # reload() allocates again, and the H2D takes its bytes over the H2D bandwidth.
        assert cycle["allocated_after"] >= cycle["offloaded"]
        assert cycle["reload_end"] - cycle["reload_start"] == pytest.approx(
            cycle["h2d_bytes"] / H2D
        )
    # Steady state: the regrown memory is the released memory, no new segment.
    assert cycles[-1]["reserved_after"] == cycles[-1]["reserved_before"]
    assert final["new_segments"] == 0
    assert final["reload_seconds"] == pytest.approx(final["h2d_bytes"] / H2D)
    assert final["same"]  # bitwise round trip
    assert (final["stalls"], final["hazards"], final["violations"]) == (0, 0, [])


def _allocate_during_the_d2h(skip: tuple[str, ...]):
    device = new_device(skip_labels=skip, raise_violations=False)
    model = device.model
    net = new_net()
    engine = OffloadEngine(device, net.collect)
    net.step(0)
    model.compute(STEP)
    engine.offload()
    allocated, cached, reserved = (
        model.allocated_bytes,
        model.reusable_bytes(),
        model.reserved_bytes,
    )
    engine.release()
    released, at_release = allocated - model.allocated_bytes, model.reusable_bytes() - cached
    probe = device.empty(NUMEL, torch.float32)  # something allocates before the D2H ended
    result = {
        "released": released,
        "at_release": at_release,
        "new_segments": model.reserved_bytes - reserved,
        "kinds": [v.kind for v in device.violations],
        "dropped": device.skipped[RECORD_STREAM],
    }
    del probe
    return result


def test_reuse_before_the_copy_is_reported_when_record_stream_is_missing(isolated):
    control = isolated.run(_allocate_during_the_d2h, ())
    assert control["released"] > 0 and control["at_release"] == 0
    assert control["new_segments"] > 0  # the probe got fresh memory
    assert control["kinds"] == [] and control["dropped"] == 0

    broken = isolated.run(_allocate_during_the_d2h, (RECORD_STREAM,))
    assert broken["dropped"] > 0
    assert broken["at_release"] == broken["released"] > 0  # reusable at once
    assert broken["new_segments"] == 0  # the probe got memory the D2H still reads
    assert REUSE_BEFORE_COPY in broken["kinds"]


def _reload_from_another_stream():
    """Steps on the compute stream; every reload is issued from a second stream (an RL
    framework's ``torch.cuda.stream`` block, a backward hook on autograd's stream)."""
    device = new_device()
    model = device.model
    other = device.compute_stream()
    net = new_net()
    engine = OffloadEngine(device, net.collect)
    for index in range(3):
        if engine.is_released():
            with device.use_stream(other):
                engine.reload()
        engine.wait()  # the step's pre-hook, on the compute stream
        engine.mark_dirty()
        net.step(index)
        model.compute(STEP)
        engine.offload(release=True)
        model.compute(1.0)  # long after the copy out
    return {
        "offloaded": engine.stats()["offloaded_bytes"],
        "compute": model.reusable_bytes(),
        "other": model.reusable_bytes(device._streams_of[other]),
    }


def test_a_reload_from_another_stream_regrows_on_the_states_home_stream(isolated):
    """The caching allocator keeps one pool per stream: memory regrown under another
    stream goes back to that stream's pool when released, where the compute stream's
    activations cannot use it. Regrown on the home stream, it goes back to the compute
    stream's pool (rule 7)."""
    out = isolated.run(_reload_from_another_stream)
    assert out["offloaded"] > 0
    assert out["compute"] >= out["offloaded"], out
    assert out["other"] == 0, out


# ------------------------------------------------------------ the device API
def test_copies_are_timed_by_direction_and_ordered_by_waits():
    device = new_device(compute_copy_bandwidth=4e9)
    model = device.model
    nbytes = NUMEL * 4
    x, y = device.empty(NUMEL, torch.float32), device.empty(NUMEL, torch.float32)
    host = device.host_buffer(nbytes).view(torch.float32)
    d2h, h2d = device.new_stream(), device.new_stream()
    model.compute(1.0)
    device.wait_stream(d2h, device.current_stream(), label="t-d2h")
    with device.use_stream(d2h):
        device.copy(host, x)
        copied = device.record_event(d2h)
    assert copied.modelled.time == pytest.approx(1.0 + nbytes / D2H)
    device.wait_stream(h2d, device.current_stream(), label="t-h2d")
    device.wait_event(h2d, copied, label="t-h2d-after-d2h")
    with device.use_stream(h2d):
        device.copy(y, host)
        back = device.record_event(h2d)
    assert back.modelled.time == pytest.approx(copied.modelled.time + nbytes / H2D)
    assert model.now == 1.0  # side streams leave the compute clock alone
    device.synchronize_event(back, label="t-host")
    assert model.now == pytest.approx(back.modelled.time)
    start = model.now
    device.copy(x, y)  # on the compute stream: compute-copy bandwidth
    assert model.now == pytest.approx(start + nbytes / 4e9)
    assert device.violations == []


@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_a_free_under_record_stream_waits_on_the_compute_stream_only_with_cuda_malloc_async(
    backend,
):
    model = AllocatorModel(capacity=1 << 30, d2h_bandwidth=D2H, h2d_bandwidth=H2D, backend=backend)
    side = model.new_stream("d2h")
    block = model.malloc(8 * MiB)
    rest = model.reusable_bytes()  # the remainder of its segment
    model.compute(1.0)
    end = model.copy(side, 8 * MiB, uses=(block,))
    model.record_stream(block, side)
    model.free(block)
    if backend == "native":
        assert model.now == 1.0  # the block waits for the copy, the compute stream does not
        assert model.reusable_bytes() == rest and model.reusable_bytes(at=end) == rest + 8 * MiB
    else:
        assert model.now == pytest.approx(end)  # cudaFreeAsync after the compute stream waited
        assert model.reusable_bytes() == rest + 8 * MiB


def _h2d_after_d2h(skip, how):
    """A D2H, then an H2D of the same host memory ordered after it by ``how``: its end."""
    device = new_device(skip_labels=skip, raise_violations=False)
    nbytes = NUMEL * 4
    x, y = device.empty(NUMEL, torch.float32), device.empty(NUMEL, torch.float32)
    host = device.host_buffer(nbytes).view(torch.float32)
    d2h, h2d = device.new_stream(), device.new_stream()
    device.wait_stream(d2h, device.current_stream(), label="t-d2h")
    with device.use_stream(d2h):
        device.copy(host, x)
        copied = device.record_event(d2h)
    device.wait_stream(h2d, device.current_stream(), label="t-h2d")
    if how == "event":
        device.wait_event(h2d, copied, label="t-h2d-after-d2h")
    else:
        device.wait_stream(h2d, d2h, label="t-h2d-after-d2h")
    with device.use_stream(h2d):
        device.copy(y, host)
        back = device.record_event(h2d)
    return copied.modelled.time, back.modelled.time, device.skipped["t-h2d-after-d2h"]


@pytest.mark.parametrize("how", ["event", "stream"])
def test_a_dropped_wait_orders_nothing_in_the_model_either(how):
    nbytes = NUMEL * 4
    copied, back, dropped = _h2d_after_d2h((), how)
    assert back == pytest.approx(copied + nbytes / H2D) and dropped == 0
    copied, back, dropped = _h2d_after_d2h(("t-h2d-after-d2h",), how)
    assert back == pytest.approx(nbytes / H2D)  # did not wait for the D2H
    assert back < copied
    assert dropped == 1


def test_storages_from_empty_that_die_are_freed_in_the_model():
    device = new_device()
    model = device.model
    kept, dropped = device.empty(NUMEL, torch.float32), device.empty(NUMEL, torch.float32)
    assert model.allocated_bytes == device.memory_allocated() == 2 * NUMEL * 4
    address = device._owned[dropped.untyped_storage()._cdata].block.address
    del dropped
    gc.collect()
    again = device.empty(NUMEL, torch.float32)  # the next device call notices the death
    assert model.allocated_bytes == 2 * NUMEL * 4  # kept + again: the dead one was freed
    assert device._owned[again.untyped_storage()._cdata].block.address == address  # and reused
    assert kept.numel() == NUMEL  # control: the live storage stays allocated
    assert model.reserved_bytes == 20 * MiB


def test_memory_kept_only_for_a_recorded_copy_is_freed_when_its_owner_drops_it():
    """A slot dropped while its D2H is queued: the checked device keeps the bytes for the
    copy, the allocator frees the block at once, deferred until the copy has run."""
    device = new_device()
    model = device.model
    slot, other = device.empty(NUMEL, torch.float32), device.empty(NUMEL, torch.float32)
    host = device.host_buffer(NUMEL * 4)
    side = device.new_stream()
    device.wait_stream(side, device.current_stream())
    with device.use_stream(side):
        device.copy(host.view(torch.float32), slot)
    copy_end = device.model.record_event(device._streams_of[side]).time
    device.record_stream(slot, side)
    del slot
    gc.collect()
    device.settle()
    assert model.allocated_bytes == NUMEL * 4  # only ``other``: the slot's block is freed...
    assert model.reusable_bytes() < model.reusable_bytes(at=copy_end)  # ...deferred to the copy
    assert other.numel() == NUMEL  # control: a live storage stays allocated
    device.synchronize()


def test_a_model_and_its_arguments_are_not_both_accepted():
    with pytest.raises(TypeError):
        ModelledDevice(AllocatorModel(capacity=1, d2h_bandwidth=1, h2d_bandwidth=1), capacity=2)
    assert isinstance(new_device().model, AllocatorModel)


def test_scale_multiplies_every_byte_count_the_model_sees():
    from megatron_offload_testing.modelled_device import ModelledDevice

    device = ModelledDevice(capacity=1 << 40, d2h_bandwidth=1e9, h2d_bandwidth=1e9, scale=1024)
    tensor = device.empty(256, torch.float32)  # 1 KiB real
    assert device.model.allocated_bytes == 1024 * 1024  # 1 MiB modelled
    host = device.host_buffer(1024)
    side = device.new_stream()
    device.wait_stream(side, device.current_stream())
    with device.use_stream(side):
        device.copy(host, tensor.view(torch.uint8))
        end = device.model.record_event(device._streams_of[side]).time
    assert end == pytest.approx(1024 * 1024 / 1e9)  # the copy takes the modelled bytes' time
    device.synchronize()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="scale must be an int >= 1"):
            ModelledDevice(capacity=1, d2h_bandwidth=1.0, h2d_bandwidth=1.0, scale=bad)
