"""The checked device's stream model, rule by rule, on the raw Device API.

Bodies that release memory run in the isolated process: if the model ever let torch touch
released memory, the CPU process would die rather than fail.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from megatron_offload_testing import CheckedDevice, ProtocolViolation
from megatron_offload_testing import checked_records as records


def values(n=4, dtype=torch.float32):
    return torch.arange(1, n + 1, dtype=dtype)


def host_like(device, tensor):
    """A host buffer viewed with ``tensor``'s dtype and shape."""
    nbytes = tensor.numel() * tensor.element_size()
    return device.host_buffer(nbytes).view(tensor.dtype).view(tensor.shape)


def setup(**options):
    """A checked device (``options``), a side stream, a device tensor and a host buffer like it."""
    device = CheckedDevice(**options)
    src = values()
    return device, device.new_stream(), src, host_like(device, src)


def d2h(device, side, host, tensor):
    """Issue a D2H the way the protocol wants it: after the compute stream's work."""
    device.wait_stream(side, device.current_stream(), label="test-d2h")
    with device.use_stream(side):
        device.copy(host, tensor)
        return device.record_event(side)


def copied_out(device):
    """A device tensor and its host copy, the copy finished (eager: filled at once)."""
    tensor = values()
    host = host_like(device, tensor)
    device.copy(host, tensor)
    device.synchronize()
    return tensor, host


def queued_h2d(**options):
    """A device tensor with its host copy taken, and a copy back into it queued on a side
    stream that waited for the compute stream: (device, side stream, tensor, host copy)."""
    device = CheckedDevice(**options)
    side = device.new_stream()
    tensor, host = copied_out(device)
    device.wait_stream(side, device.current_stream())
    with device.use_stream(side):
        device.copy(tensor, host)
    return device, side, tensor, host


def is_poison(tensor):
    return bool(torch.isnan(tensor).all())


def raises(kind, rule):
    """pytest.raises for a ProtocolViolation of ``kind``; checks its rule afterwards."""

    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(ProtocolViolation)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            assert (self.info.value.kind, self.info.value.rule) == (kind, rule), self.info.value
            return handled

    return _Check()


# ------------------------------------------------------------------- basics
def test_device_surface():
    device = CheckedDevice()
    assert device.is_accelerator and device.torch_device == torch.device("cpu")
    buffer = device.host_buffer(10)
    assert buffer.dtype == torch.uint8 and buffer.shape == (10,) and not buffer.is_pinned()
    assert device.current_stream() is not device.new_stream()


def test_compute_stream_copies_run_at_once():
    device = CheckedDevice()
    dst = torch.zeros(4)
    device.copy(dst, values())
    assert torch.equal(dst, values()) and device.pending() == 0


def test_side_stream_copy_is_deferred_until_the_compute_stream_waits():
    device, side, src, host = setup()
    event = d2h(device, side, host, src)
    assert device.pending() == 1 and is_poison(host)  # queued, not run
    device.wait_event(device.current_stream(), event, label="use")
    assert device.pending() == 0 and torch.equal(host, src)


@pytest.mark.parametrize("how", ["wait_stream", "synchronize_event", "synchronize"])
def test_other_ways_of_ordering_run_the_queue(how):
    device, side, src, host = setup()
    event = d2h(device, side, host, src)
    if how == "wait_stream":
        device.wait_stream(device.current_stream(), side, label="x")
    elif how == "synchronize_event":
        device.synchronize_event(event, label="x")
    else:
        device.synchronize()
    assert torch.equal(host, src)


def test_queue_runs_in_fifo_order_and_only_up_to_the_event():
    device = CheckedDevice()
    side = device.new_stream()
    first, second = values(), values() * 10
    host = host_like(device, first)
    device.wait_stream(side, device.current_stream())
    with device.use_stream(side):
        device.copy(host, first)
        early = device.record_event(side)
        device.copy(host, second)
    device.synchronize_event(early)
    assert torch.equal(host, first) and device.pending() == 1
    device.synchronize()
    assert torch.equal(host, second)


def test_side_stream_wait_orders_but_does_not_run():
    device = CheckedDevice()
    down, up = device.new_stream(), device.new_stream()
    src, back = values(), torch.zeros(4)
    host = host_like(device, src)
    event = d2h(device, down, host, src)
    device.wait_stream(up, device.current_stream())
    device.wait_event(up, event, label="h2d-after-d2h")
    assert device.pending() == 1  # a side stream waiting runs nothing
    with device.use_stream(up):
        device.copy(back, host)
        done = device.record_event(up)
    device.wait_event(device.current_stream(), done)
    assert torch.equal(back, src)  # the D2H ran first: it is a dependency of the H2D


def test_ordering_is_transitive_through_the_compute_stream():
    device = CheckedDevice()
    down, up = device.new_stream(), device.new_stream()
    src, back = values(), torch.zeros(4)
    host = host_like(device, src)
    event = d2h(device, down, host, src)
    device.wait_event(device.current_stream(), event)  # compute after the D2H ...
    device.wait_stream(up, device.current_stream())  # ... and the H2D after compute
    with device.use_stream(up):
        device.copy(back, host)
    device.synchronize()
    assert torch.equal(back, src) and device.violations == []


def test_a_queued_copy_keeps_the_memory_it_was_issued_with():
    device, side, src, host = setup()
    d2h(device, side, host, src)
    old = src[:]  # keeps the old memory alive: only the tensor object is re-pointed
    with torch.no_grad():
        src.set_(torch.full((4,), 7.0).untyped_storage(), 0, (4,), (1,))
    device.synchronize()
    assert torch.equal(host, old)  # the copy reads addresses, not the tensor object


# ------------------------------------------------------------------- poison
@pytest.mark.parametrize(
    "dtype, check",
    [
        (torch.float32, lambda t: torch.isnan(t).all()),
        (torch.bfloat16, lambda t: torch.isnan(t).all()),
        (torch.int64, lambda t: (t == torch.iinfo(torch.int64).max).all()),
        (torch.int32, lambda t: (t == torch.iinfo(torch.int32).max).all()),
        (torch.bool, lambda t: (t.view(torch.uint8) == 0xFF).all()),
    ],
)
def test_fresh_device_memory_is_poisoned(dtype, check):
    device = CheckedDevice()
    assert check(device.empty(5, dtype))


def test_host_buffers_are_poisoned_until_written():
    device = CheckedDevice()
    buffer = device.host_buffer(16)
    assert (buffer == 0xFF).all()
    assert torch.isnan(buffer.view(torch.float32)).all()  # all-ones bytes are NaN as floats


def _regrow_poisons():
    device = CheckedDevice()
    tensor = values(6)
    device.release(tensor)
    device.regrow(tensor, 6 * 4)
    return [math.isnan(x) for x in tensor.tolist()]


def test_regrown_memory_is_poisoned(isolated):
    assert all(isolated.run(_regrow_poisons))


# --------------------------------------------------------------- violations
def test_d2h_without_waiting_for_the_compute_stream():
    device, side, src, host = setup()
    with raises(records.UNORDERED_DEVICE_ACCESS, 1):
        with device.use_stream(side):
            device.copy(host, src)


def test_any_compute_stream_call_after_the_wait_counts_as_new_work():
    device, side, src, host = setup()
    device.wait_stream(side, device.current_stream())
    device.record_stream(src, side)  # the caller may have run kernels before this call
    with raises(records.UNORDERED_DEVICE_ACCESS, 1):
        with device.use_stream(side):
            device.copy(host, src)


def _release_under_queued_read():
    device, side, src, host = setup()
    d2h(device, side, host, src)
    try:
        device.release(src)
    except ProtocolViolation as exc:
        return exc.kind, exc.rule, src.untyped_storage().nbytes()
    return None


def test_release_while_a_queued_copy_reads_without_record_stream(isolated):
    # Raised before anything is freed.
    assert isolated.run(_release_under_queued_read) == (records.RELEASE_IN_USE, 2, 16)


def _release_without_record_lets_garbage_through():
    device, side, src, host = setup(raise_violations=False)
    d2h(device, side, host, src)
    device.release(src)
    device.synchronize()
    return [v.kind for v in device.violations], torch.isnan(host).all().item()


def test_release_without_record_stream_frees_at_once(isolated):
    kinds, garbage = isolated.run(_release_without_record_lets_garbage_through)
    assert kinds == [records.RELEASE_IN_USE] and garbage


def _release_with_record_stream_defers_the_free():
    device, side, src, host = setup()
    d2h(device, side, host, src)
    device.record_stream(src, side, label="rec")
    device.release(src)
    freed_now = src.untyped_storage().nbytes() == 0
    held = device.held_bytes
    # Regrow the same storage before the copy ran: the copy still reads the old bytes and
    # leaves the new memory alone.
    device.regrow(src, 16)
    device.synchronize()
    return freed_now, held, host.tolist(), is_poison(src), device.held_bytes, device.violations


def test_release_with_record_stream_keeps_the_bytes_for_the_copy(isolated):
    freed_now, held, host, regrown_poisoned, held_after, violations = isolated.run(
        _release_with_record_stream_defers_the_free
    )
    assert freed_now and held == 16 and held_after == 0
    assert host == values().tolist() and regrown_poisoned and violations == []


def _h2d_into_regrown_memory(wait_first):
    device = CheckedDevice()
    side = device.new_stream()
    tensor, host = copied_out(device)  # eager: the host copy is filled at once
    device.wait_stream(side, device.current_stream())
    device.release(tensor)
    device.regrow(tensor, 16)
    if wait_first:
        device.wait_stream(side, device.current_stream())
    try:
        with device.use_stream(side):
            device.copy(tensor, host)
            event = device.record_event(side)
        device.wait_event(device.current_stream(), event)
    except ProtocolViolation as exc:
        return exc.kind, exc.rule
    return tensor.tolist()


def test_h2d_into_regrown_memory_must_wait_for_the_allocation(isolated):
    assert isolated.run(_h2d_into_regrown_memory, False) == (records.WRITE_BEFORE_ALLOCATION, 7)
    assert isolated.run(_h2d_into_regrown_memory, True) == values().tolist()


def test_h2d_reading_a_host_buffer_before_its_d2h_is_ordered():
    device = CheckedDevice()
    down, up = device.new_stream(), device.new_stream()
    src, back = values(), torch.zeros(4)
    host = host_like(device, src)
    d2h(device, down, host, src)
    device.wait_stream(up, device.current_stream())
    with raises(records.UNORDERED_HOST_READ, 5):
        with device.use_stream(up):
            device.copy(back, host)


def test_d2h_overwriting_a_host_buffer_a_queued_h2d_reads():
    device = CheckedDevice()
    down, up = device.new_stream(), device.new_stream()
    src, back = values(), torch.zeros(4)
    host = host_like(device, src)
    device.copy(host, src)
    device.synchronize()
    device.wait_stream(up, device.current_stream())
    with device.use_stream(up):
        device.copy(back, host)  # queued: still reads the host copy
    with raises(records.HOST_OVERWRITE, 5):
        d2h(device, down, host, src)


def test_host_reads_need_a_host_synchronization():
    device, side, src, host = setup()
    event = d2h(device, side, host, src)
    device.wait_event(device.current_stream(), event)  # ordered on the device only
    with raises(records.UNORDERED_HOST_READ, 5):
        device.check_readable(host)
    device.synchronize_event(event, label="host-read")
    device.check_readable(host)
    assert torch.equal(host, src)


def test_freeing_a_host_buffer_under_a_copy():
    device, side, src, host = setup()
    d2h(device, side, host, src)
    with raises(records.HOST_FREED_IN_USE, 5):
        device.free_host_buffer(host)
    device.synchronize()
    device.free_host_buffer(host)


def test_side_streams_racing_on_device_memory():
    device = CheckedDevice()
    one, two = device.new_stream(), device.new_stream()
    tensor, host = copied_out(device)
    for stream in (one, two):
        device.wait_stream(stream, device.current_stream())
    with device.use_stream(one):
        device.copy(tensor, host)
    with raises(records.DEVICE_RACE, 3):
        with device.use_stream(two):
            device.copy(host, tensor)


def test_the_compute_stream_using_memory_a_queued_copy_writes():
    device, side, tensor, host = queued_h2d()
    with raises(records.USE_BEFORE_COPY, 4):
        device.check_readable(tensor)
    with raises(records.USE_BEFORE_COPY, 4):
        device.note_compute()


def test_the_compute_stream_overwriting_memory_a_queued_copy_reads():
    device, side, src, host = setup()
    d2h(device, side, host, src)
    device.note_compute(writes=False)  # reading alongside a reader is fine
    with raises(records.OVERWRITE_WHILE_READ, 2):
        device.note_compute()


def _copy_from_released_memory():
    device = CheckedDevice()
    tensor = values()
    device.release(tensor)
    try:
        device.copy(torch.zeros(4), tensor)
    except ProtocolViolation as exc:
        return exc.kind, exc.rule
    return None


def test_copies_of_released_memory_are_refused(isolated):
    assert isolated.run(_copy_from_released_memory) == (records.RELEASED_ACCESS, 3)


def _memory_dies_under_a_queued_write(record):
    device, side, tensor, host = queued_h2d(raise_violations=False)
    if record:
        device.record_stream(tensor, side, label="rec")
    del tensor
    gc.collect()
    device.synchronize()
    return [(v.kind, v.rule) for v in device.violations]


def test_memory_dropped_under_a_queued_copy(isolated):
    assert isolated.run(_memory_dies_under_a_queued_write, False) == [(records.FREED_IN_USE, 2)]
    assert isolated.run(_memory_dies_under_a_queued_write, True) == []


def test_check_reports_work_nothing_ordered_and_drains():
    device, side, src, host = setup()
    d2h(device, side, host, src)
    with raises(records.NEVER_ORDERED, 5):
        device.check()
    assert device.pending() == 0 and torch.equal(host, src)


def test_check_passes_when_everything_was_ordered():
    device, side, src, host = setup()
    event = d2h(device, side, host, src)
    device.synchronize_event(event)
    assert device.check() == []


def test_violations_can_be_collected_instead_of_raised():
    device, side, src, host = setup(raise_violations=False)
    with device.use_stream(side):
        device.copy(host, src)
    assert [(v.rule, v.kind) for v in device.violations] == [(1, records.UNORDERED_DEVICE_ACCESS)]
    with pytest.raises(ProtocolViolation):
        device.check()
    assert len(device.check(raise_on_violation=False)) == 2  # plus the never-ordered copy


# ------------------------------------------------------------ fault injection
def test_skip_labels_drop_exactly_the_labelled_calls():
    device, side, src, host = setup(skip_labels={"test-d2h"})
    with raises(records.UNORDERED_DEVICE_ACCESS, 1) as info:
        d2h(device, side, host, src)
    assert "test-d2h" in str(info.value)  # the report names what was dropped
    device.wait_stream(side, device.current_stream(), label="other")  # not dropped
    with device.use_stream(side):
        device.copy(host, src)
    assert device.calls == {"test-d2h": 1, "other": 1}
    assert device.skipped == {"test-d2h": 1}


def test_skipping_a_record_stream_or_a_host_synchronization():
    device, side, src, host = setup(skip_labels={"rec", "sync"}, raise_violations=False)
    event = d2h(device, side, host, src)
    device.synchronize_event(event, label="sync")
    assert device.pending() == 1  # dropped: nothing ran
    device.check_readable(host)
    assert [v.kind for v in device.violations] == [records.UNORDERED_HOST_READ]
    device.record_stream(src, side, label="rec")
    assert device.calls["rec"] == device.skipped["rec"] == 1


def test_reprs_and_poison_for_dtypes_without_integer_limits():
    device = CheckedDevice(skip_labels={"x"})
    assert repr(device) == "CheckedDevice(cpu, skip_labels=['x'])"
    assert repr(CheckedDevice()) == "CheckedDevice(cpu)"
    assert repr(device.new_stream()).startswith("<stream ")
    from megatron_offload_testing import fill_poison

    quantized = torch.zeros(4, dtype=torch.uint16)  # torch.iinfo has no limits for it
    fill_poison(quantized)
    assert (quantized.view(torch.uint8) == 0xFF).all()


def test_reading_released_memory_is_reported():
    device = CheckedDevice(raise_violations=False)
    tensor = device.empty(8, torch.float32)
    device.release(tensor)
    device.check_readable(tensor, label="checkpoint")
    assert [(v.rule, v.kind) for v in device.violations] == [(3, "released-access")]


def test_cpu_training_redirects_report_whether_they_are_installed():
    from megatron_offload_testing import cpu_training

    assert cpu_training.is_installed() in (True, False)


def test_copies_touching_released_memory_are_refused_and_reported():
    device = CheckedDevice(raise_violations=False)
    released = device.empty(8, torch.float32)
    device.release(released)
    live = device.empty(8, torch.float32)
    device.copy(live, released)  # reads released memory
    device.copy(released, live)  # writes released memory
    assert [(v.rule, v.kind) for v in device.violations] == [(3, "released-access")] * 2
    device.check_readable(device.empty(0, torch.float32))  # nothing to read: always fine
    assert len(device.violations) == 2


def test_compute_stream_copies_racing_queued_side_copies_are_classified():
    device = CheckedDevice(raise_violations=False)
    compute, side = device.current_stream(), device.new_stream()
    dev, other = device.empty(8, torch.float32), device.empty(8, torch.float32)
    device.copy(dev, torch.zeros(8))
    host = device.host_buffer(32).view(torch.float32)
    device.wait_stream(side, compute)
    with device.use_stream(side):
        device.copy(host, dev)  # a queued D2H reads dev
    device.copy(dev, other)  # the compute stream overwrites it without waiting
    device.wait_stream(side, compute)
    with device.use_stream(side):
        device.copy(other, host)  # a queued H2D writes other
    device.copy(dev, other)  # the compute stream reads it without waiting
    device.copy(
        device.empty(0, torch.float32), device.empty(0, torch.float32)
    )  # no bytes: no access
    kinds = [(v.rule, v.kind) for v in device.violations]
    assert (2, "overwrite-while-read") in kinds and (4, "use-before-copy") in kinds


# ------------------------------------------------------- several compute streams
def test_a_second_compute_stream_is_eager_and_current_inside_use_stream():
    device = CheckedDevice()
    default, other = device.current_stream(), device.compute_stream()
    assert other is not default and other.compute and other.name == "compute-2"
    src, dst = values(), torch.zeros(4)
    with device.use_stream(other):
        assert device.current_stream() is other
        device.copy(dst, src)  # runs at once, like the default compute stream
    assert device.current_stream() is default and torch.equal(dst, src)


def _d2h_after_work_on_another_compute_stream(wait_for_other):
    device = CheckedDevice()
    other, side = device.compute_stream(), device.new_stream()
    src = device.empty(4, torch.float32)  # allocated on the default stream
    src.copy_(values())
    with device.use_stream(other):
        device.note_compute()  # a step on `other` writes it
    host = host_like(device, src)
    device.wait_stream(side, device.current_stream())
    if wait_for_other:
        device.wait_stream(side, other)
    try:
        with device.use_stream(side):
            device.copy(host, src)
    except ProtocolViolation as exc:
        return exc.kind, exc.rule
    return None


def test_a_d2h_must_wait_for_the_other_compute_stream_that_wrote_the_memory():
    assert _d2h_after_work_on_another_compute_stream(False) == (records.UNORDERED_DEVICE_ACCESS, 1)
    assert _d2h_after_work_on_another_compute_stream(True) is None


def test_work_on_another_stream_that_never_used_the_memory_does_not_order_a_d2h():
    device = CheckedDevice()
    other, side = device.compute_stream(), device.new_stream()
    src = values()
    host = host_like(device, src)
    with device.use_stream(other):
        device.copy(torch.zeros(2), torch.ones(2))  # unrelated work on `other`
    d2h(device, side, host, src)  # waits for the default stream only: enough
    device.synchronize()
    device.check()
    assert torch.equal(host, src)


def _release_used_on_another_stream(record, order):
    """Memory regrown on the default stream is read by kernels on `other`, then released."""
    device = CheckedDevice()
    other = device.compute_stream()
    tensor = values()
    device.release(tensor)
    device.regrow(tensor, 16)
    with device.use_stream(other):
        device.note_compute(writes=False)
    if record:
        device.record_stream(tensor, other, label="use")
    if order:
        device.wait_stream(device.current_stream(), other)
    try:
        device.release(tensor)
    except ProtocolViolation as exc:
        return exc.kind, exc.rule
    return None


def test_release_of_memory_used_on_another_stream_needs_record_stream_or_an_order(isolated):
    assert isolated.run(_release_used_on_another_stream, False, False) == (
        records.RELEASE_IN_USE,
        2,
    )
    assert isolated.run(_release_used_on_another_stream, True, False) is None
    assert isolated.run(_release_used_on_another_stream, False, True) is None


def _h2d_on_another_stream_after_work_before_the_allocation():
    device = CheckedDevice()
    other, side = device.compute_stream(), device.new_stream()
    tensor, host = copied_out(device)
    with device.use_stream(other):
        device.note_compute()  # before the allocation below: cannot touch the new block
    device.release(tensor)
    device.regrow(tensor, 16)
    device.wait_stream(side, device.current_stream())
    with device.use_stream(side):
        device.copy(tensor, host)
        event = device.record_event(side)
    with device.use_stream(other):
        device.wait_event(other, event)
        device.check_readable(tensor)
        return tensor.tolist(), device.violations


def test_an_h2d_orders_after_the_allocating_stream_only(isolated):
    data, violations = isolated.run(_h2d_on_another_stream_after_work_before_the_allocation)
    assert data == values().tolist() and violations == []
