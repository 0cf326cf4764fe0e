"""Pinning host buffers: the thread-pool logic (``device/pinned.py``) and the accelerator's use of it.

There is no GPU here. ``pinned.pin`` takes its register/unregister calls as arguments, so
fakes stand for cudaHostRegister/cudaHostUnregister; the accelerator device's CUDA calls
(``_host_register_calls``, cuda-python's runtime, the torch device module) are replaced by
fakes that record the device current at each call. Nothing here says anything about a GPU.
"""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
import torch

from megatron_offload.device import accelerator, pinned
from megatron_offload.device.accelerator import AcceleratorDevice

PAGE = 4096


class FakeRegistry:
    """Registrations by address, as the CUDA runtime keeps them; fails where told to."""

    def __init__(self, fail_at=(), raise_at=(), current=lambda: None):
        self.fail_at, self.raise_at, self.current = set(fail_at), set(raise_at), current
        self.live: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()
        self._count = 0

    def register(self, address, nbytes):
        with self._lock:
            index = self._count
            self._count += 1
            self.calls.append(("register", address, nbytes, self.current()))
            self.threads.add(threading.current_thread().name)
            if index in self.raise_at:
                raise OSError("planted")
            if index in self.fail_at:
                return 2  # cudaErrorMemoryAllocation
            assert all(address + nbytes <= a or a + n <= address for a, n in self.live.items())
            self.live[address] = nbytes
            return 0

    def unregister(self, address):
        with self._lock:
            self.calls.append(("unregister", address, self.current()))
            return 0 if self.live.pop(address, None) is not None else 4


def test_ranges_cover_the_buffer_with_page_aligned_borders():
    base = 10 * PAGE + 123  # an unaligned start, as malloc gives
    nbytes = 37 * PAGE + 5
    ranges = pinned.split_ranges(base, nbytes, 4, page=PAGE, min_bytes=PAGE)
    assert 1 < len(ranges) <= 4
    assert ranges[0][0] == base and sum(n for _, n in ranges) == nbytes
    for (a, n), (b, _) in zip(ranges, ranges[1:]):
        assert a + n == b and b % PAGE == 0  # no page in two ranges
    # Small buffers are not split below min_bytes; empty ones give nothing.
    assert pinned.split_ranges(base, 3 * PAGE, 8, page=PAGE, min_bytes=2 * PAGE) == [
        (base, 3 * PAGE)
    ]
    assert pinned.split_ranges(base, 0, 4, page=PAGE) == []


def _pin(buffer, registry, **options):
    """``pinned.pin`` with ``registry``'s calls, four threads and ranges of at least a page."""
    return pinned.pin(
        buffer,
        register=registry.register,
        unregister=registry.unregister,
        threads=4,
        min_range_bytes=PAGE,
        page=PAGE,
        **options,
    )


def test_pages_are_faulted_in_by_several_threads_and_registered_once():
    buffer = torch.full((64 * PAGE,), 0xAB, dtype=torch.uint8)
    fake = FakeRegistry()
    ranges = _pin(buffer, fake)
    base = buffer.data_ptr()
    assert ranges == ((base, buffer.numel()),)
    assert fake.calls == [("register", base, buffer.numel(), None)]
    # One byte in every page was written (first touch), nothing else.
    offsets = sorted(
        {
            (a - base) + k
            for a, n in pinned.split_ranges(base, buffer.numel(), 4, page=PAGE, min_bytes=PAGE)
            for k in range(0, n, PAGE)
        }
    )
    assert len(offsets) >= 64
    assert bool((buffer[offsets] == 0).all())
    assert int((buffer == 0).sum()) == len(offsets)
    assert pinned.unpin(ranges, fake.unregister) == [0] and not fake.live


def test_per_range_registration_runs_on_the_pool_and_unregisters_what_succeeded_on_failure():
    buffer = torch.zeros(32 * PAGE, dtype=torch.uint8)
    fake = FakeRegistry()
    ranges = _pin(buffer, fake, per_range=True)
    assert len(ranges) == 4 and len(fake.live) == 4
    assert all(name.startswith("pin-host") for name in fake.threads)
    pinned.unpin(ranges, fake.unregister)
    assert not fake.live

    failing = FakeRegistry(fail_at={2})
    with pytest.raises(pinned.PinError, match="failed with error 2") as info:
        _pin(buffer, failing, per_range=True)
    assert info.value.code == 2
    assert not failing.live  # the three ranges that were registered are unregistered again
    assert sum(1 for c in failing.calls if c[0] == "unregister") == 3

    raising = FakeRegistry(raise_at={1})
    with pytest.raises(OSError, match="planted"):
        _pin(buffer, raising, per_range=True)
    assert not raising.live


def test_a_failed_whole_registration_raises_with_the_code():
    fake = FakeRegistry(fail_at={0})
    with pytest.raises(pinned.PinError) as info:
        pinned.pin(
            torch.zeros(3 * PAGE, dtype=torch.uint8),
            register=fake.register,
            unregister=fake.unregister,
            page=PAGE,
        )
    assert info.value.code == 2 and not fake.live


# ----------------------------------------------------------------- the accelerator device
class FakeModule:
    """The torch device module, as far as host pinning uses it: a per-thread current device."""

    def __init__(self):
        self._local = threading.local()

    @property
    def current(self):
        return getattr(self._local, "device", None)

    def device(self, torch_device):
        module = self

        class _Context:
            def __enter__(self):
                self.previous = module.current
                module._local.device = torch_device

            def __exit__(self, *exc):
                module._local.device = self.previous

        return _Context()


class FakeRuntime:
    def __init__(self):
        self.last_error_calls = 0

    def cudaGetLastError(self):
        self.last_error_calls += 1
        return (0,)


@pytest.fixture
def fake_cuda(monkeypatch):
    module = FakeModule()
    real = torch.get_device_module
    monkeypatch.setattr(
        torch, "get_device_module", lambda t: module if str(t) == "cuda" else real(t)
    )
    runtime = FakeRuntime()
    monkeypatch.setattr(accelerator, "_cuda_runtime", lambda: runtime)
    state = {"registry": FakeRegistry(current=lambda: module.current)}
    monkeypatch.setattr(
        accelerator,
        "_host_register_calls",
        lambda: (state["registry"].register, state["registry"].unregister),
    )
    return module, runtime, state


def test_host_buffers_are_pinned_on_their_device_and_unpinned_explicitly(fake_cuda):
    module, _, state = fake_cuda
    registry = state["registry"]
    device = AcceleratorDevice(torch.device("cuda", 1))
    buffer = device.host_buffer(10_000)
    assert buffer.numel() == 10_000 and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % pinned.page_size() == 0  # a page of its own
    [(kind, address, nbytes, current)] = registry.calls
    assert (kind, address, current) == ("register", buffer.data_ptr(), torch.device("cuda", 1))
    assert nbytes % pinned.page_size() == 0 and nbytes >= 10_000
    # Never left to the garbage collector: dropping the caller's reference unpins nothing.
    view = buffer[:16]
    del buffer
    gc.collect()
    assert len(registry.calls) == 1 and registry.live
    assert module.current is None
    device.free_host_buffer(view.as_strided((10_000,), (1,)))
    assert registry.calls[-1] == ("unregister", address, torch.device("cuda", 1))
    assert not registry.live
    device.free_host_buffer(view.as_strided((10_000,), (1,)))  # again: nothing to do
    assert len(registry.calls) == 2
    assert device.host_buffer(0).numel() == 0 and len(registry.calls) == 2


def test_a_failed_pin_raises_a_clear_error_and_clears_cudas_error(fake_cuda):
    _, runtime, state = fake_cuda
    state["registry"] = FakeRegistry(fail_at={0})
    device = AcceleratorDevice(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"ulimit -l.*pageable_fallback"):
        device.host_buffer(1 << 20)
    assert runtime.last_error_calls == 1
    assert not state["registry"].live


def test_a_failed_pin_can_fall_back_to_pageable_memory_with_a_warning(fake_cuda):
    _, runtime, state = fake_cuda
    state["registry"] = FakeRegistry(fail_at={0})
    device = AcceleratorDevice(torch.device("cuda", 0))
    device.pageable_fallback = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffer = device.host_buffer(5000)
    assert buffer.numel() == 5000
    assert runtime.last_error_calls == 1
    assert any("synchronous" in str(w.message) for w in caught)
    calls = len(state["registry"].calls)
    device.free_host_buffer(buffer)  # pageable: nothing to unregister
    assert len(state["registry"].calls) == calls
    assert device.pinned_bytes() == 0
    state["registry"].fail_at = set(range(100))  # every later pin fails: no second warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device.host_buffer(5000)
    assert not caught


def test_an_io_buffer_is_wiped_in_forks_and_in_huge_pages_up_to_its_end_only():
    """The disk tier's staging (``io_host_buffer``): a private mapping whose pages a fork
    does not copy ("wf": wiped on fork; not "sh"), on a huge page boundary, advised into huge
    pages ("hg") over its whole huge pages and not over its tail, so that faulting it in gives
    it exactly ``nbytes`` of memory (a huge page over the tail would hold up to 2 MiB the
    budget does not count), and none to the room the alignment skips."""
    from megatron_offload.engine.disk import fault_in
    from tests.harness.disk import areas

    huge = pinned.HUGE_PAGE
    nbytes = 2 * huge + 3 * PAGE + huge // 2
    buffer = pinned.io_host_buffer(nbytes)
    assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % huge == 0
    storage = buffer.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    mapped = areas(start, end)
    assert mapped and all("wf" in a["flags"] and "sh" not in a["flags"] for a in mapped)
    head, tail = buffer.data_ptr(), buffer.data_ptr() + 2 * huge
    for area in mapped:
        advised = area["start"] < tail and head < area["end"]  # overlaps the whole huge pages
        assert ("hg" in area["flags"]) == advised, (area, head, tail)
        assert ("nh" in area["flags"]) == (area["start"] >= tail), (area, tail)  # the rest
        if advised:
            assert head <= area["start"] and area["end"] <= tail
    fault_in(buffer)
    mapped = areas(start, end)
    assert sum(a["Rss"] for a in mapped) == nbytes
    assert not buffer.any()  # fresh memory: zeros
    print(f"\nhuge pages: {sum(a['AnonHugePages'] for a in mapped) // huge} of 2 advised")
    assert pinned.io_host_buffer(0).numel() == 0


def test_the_huge_page_advice_fits_the_mapping_wherever_the_kernel_put_it():
    """Wherever the mapping starts (every page offset from a huge page boundary, which sets
    ``skip``), and whatever the buffer's size: each range is non-empty and inside the
    mapping (``madvise`` refuses one at its end: a buffer of whole huge pages at the largest
    skip leaves no rest), the huge pages exactly the buffer's whole ones, and the rest
    everything after them."""
    huge = pinned.HUGE_PAGE
    for nbytes in (PAGE, huge - PAGE, huge, 2 * huge + 3 * PAGE, 4 * huge):
        length = nbytes + huge - PAGE
        for skip in range(0, huge, PAGE):
            advice = pinned.huge_page_advice(skip, nbytes, length)
            assert all(n > 0 and 0 <= start and start + n <= length for _, start, n in advice)
            ranges = dict((name, (start, n)) for name, start, n in advice)
            whole = nbytes // huge * huge
            assert ranges.get("MADV_HUGEPAGE") == ((skip, whole) if whole else None)
            rest = length - skip - whole
            assert ranges.get("MADV_NOHUGEPAGE") == ((skip + whole, rest) if rest else None)


def test_an_io_buffer_where_the_kernel_refuses_the_advice(monkeypatch):
    """A kernel before 4.14 refuses MADV_WIPEONFORK (EINVAL): the buffer is a shared one, as
    the arena's, and the private mapping made first is closed. A kernel without THP refuses
    MADV_HUGEPAGE: the buffer keeps small pages, wiped in a fork all the same."""
    import errno
    import mmap

    from tests.harness.disk import areas

    made = []

    class Refusing(mmap.mmap):
        def __init__(self, *args, **kwargs):
            made.append(self)

        def madvise(self, option, *args):
            if option in refused:
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().madvise(option, *args)

    monkeypatch.setattr(pinned.mmap, "mmap", Refusing)
    refused = {pinned.MADV_WIPEONFORK}
    buffer = pinned.io_host_buffer(4 << 20)
    assert buffer.numel() == 4 << 20 and made[0].closed
    [area] = areas(buffer.data_ptr(), buffer.data_ptr() + buffer.numel())
    assert "sh" in area["flags"] and "wf" not in area["flags"]
    refused = {mmap.MADV_HUGEPAGE, mmap.MADV_NOHUGEPAGE}
    buffer = pinned.io_host_buffer(4 << 20)
    mapped = areas(buffer.data_ptr(), buffer.data_ptr() + buffer.numel())
    assert all("wf" in a["flags"] and "hg" not in a["flags"] for a in mapped), mapped


def test_io_buffers_are_pinned_over_their_own_mapping_and_unpinned_explicitly(fake_cuda):
    _, _, state = fake_cuda
    registry = state["registry"]
    device = AcceleratorDevice(torch.device("cuda", 0))
    buffer = device.io_buffer(3 << 20)
    assert buffer.numel() == 3 << 20 and buffer.data_ptr() % pinned.HUGE_PAGE == 0
    [(kind, address, nbytes, _)] = registry.calls
    assert (kind, address, nbytes) == ("register", buffer.data_ptr(), 3 << 20)
    assert device.pinned_bytes() == 3 << 20
    device.free_host_buffer(buffer)
    assert registry.calls[-1][:2] == ("unregister", address) and not registry.live


def test_a_device_told_not_to_pin_makes_pageable_buffers_and_counts_what_it_pinned(fake_cuda):
    _, _, state = fake_cuda
    device = AcceleratorDevice(torch.device("cuda", 0))
    pinned_buffer = device.host_buffer(10_000)
    assert device.pinned_bytes() >= 10_000 and len(state["registry"].calls) == 1
    device.pinning = False  # the node check found ulimit -l too low (and warned)
    pageable = device.host_buffer(20_000)
    assert pageable.numel() == 20_000 and len(state["registry"].calls) == 1
    assert device.pinned_bytes() < 20_000
    device.free_host_buffer(pinned_buffer)
    assert device.pinned_bytes() == 0
