"""The accelerator device's side streams are its own, never torch's shared pool streams.

There is no GPU here: the torch device module (``torch.get_device_module('cuda')``) and
cuda-python's runtime are replaced by fakes that record what the device asks of them. What is
tested is the logic: a private non-blocking stream per ``new_stream()`` call, made with the
optimizer's device current and the configured priority, wrapped in ``ExternalStream``; the
fallback to a pooled stream with one warning per process, never an error; the stream
destroyed only after the last reference to it is gone, and only after a synchronize.
Nothing here says anything about a real GPU.
"""

from __future__ import annotations

import contextlib
import gc
import types
import warnings

import pytest
import torch

from megatron_offload.config import OffloadConfig
from megatron_offload.device import accelerator, device_for
from megatron_offload.device.accelerator import AcceleratorDevice

NON_BLOCKING = 1


class FakeRuntime:
    """cuda-python's ``cuda.bindings.runtime``, as far as the device uses it."""

    cudaStreamNonBlocking = NON_BLOCKING

    def __init__(self, module, error=0, raises=None):
        self.module, self.error, self.raises = module, error, raises
        self.calls = []
        self._next = 0x7000

    def cudaStreamCreateWithPriority(self, flags, priority):
        if self.raises is not None:
            raise self.raises
        self.calls.append(("create", flags, priority, self.module.current))
        if self.error:
            return self.error, None
        self._next += 0x100
        return 0, self._next

    def cudaStreamSynchronize(self, handle):
        self.calls.append(("synchronize", handle))
        return 0

    def cudaStreamDestroy(self, handle):
        self.calls.append(("destroy", handle))
        return 0


class FakeExternalStream:
    def __init__(self, stream_ptr, device=None):
        self.cuda_stream, self.device = stream_ptr, device


class FakePoolStream:
    def __init__(self, device=None, priority=0):
        self.device, self.priority = device, priority


def fake_cuda_module():
    module = types.SimpleNamespace(current=None, pool=[])

    @contextlib.contextmanager
    def device(torch_device):
        previous, module.current = module.current, torch_device
        try:
            yield
        finally:
            module.current = previous

    def pool_stream(device=None, priority=0):
        module.pool.append(FakePoolStream(device, priority))
        return module.pool[-1]

    module.device = device
    module.Stream = pool_stream
    module.ExternalStream = FakeExternalStream
    module.current_device = lambda: 0
    return module


@pytest.fixture
def fake_cuda(monkeypatch):
    module = fake_cuda_module()
    runtime = FakeRuntime(module)
    real = torch.get_device_module
    monkeypatch.setattr(
        torch, "get_device_module", lambda t: module if str(t) == "cuda" else real(t)
    )
    monkeypatch.setattr(accelerator, "_cuda_runtime", lambda: runtime)
    monkeypatch.setattr(accelerator, "_shared_pool_warned", False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    return module, runtime


def test_each_offloader_gets_private_streams_on_its_device(fake_cuda):
    module, runtime = fake_cuda
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the private path warns about nothing
        first = AcceleratorDevice(torch.device("cuda", 1), stream_priority=-2)
        second = AcceleratorDevice(torch.device("cuda", 1), stream_priority=-2)
        streams = [first.new_stream(), first.new_stream(), second.new_stream(), second.new_stream()]
    assert not module.pool  # nothing taken from torch's shared pool
    assert all(isinstance(s, FakeExternalStream) for s in streams)
    assert len({s.cuda_stream for s in streams}) == 4  # D2H and H2D of two offloaders: distinct
    assert all(s.device == torch.device("cuda", 1) for s in streams)
    # Non-blocking (no implicit sync with the legacy default stream), the configured priority,
    # created while the optimizer's device was current.
    assert runtime.calls == [("create", NON_BLOCKING, -2, torch.device("cuda", 1))] * 4


def test_priority_reaches_the_device_from_the_config(fake_cuda):
    _, runtime = fake_cuda
    config = OffloadConfig(stream_priority=-3)
    device = device_for(torch.device("cuda", 0), stream_priority=config.stream_priority)
    kept = [device.new_stream()]
    assert runtime.calls == [("create", NON_BLOCKING, -3, torch.device("cuda", 0))]
    kept.append(device_for(torch.device("cuda", 0)).new_stream())
    assert runtime.calls[-1] == ("create", NON_BLOCKING, 0, torch.device("cuda", 0))
    cpu = device_for(torch.device("cpu"), stream_priority=-3)
    assert cpu.new_stream() is not cpu.new_stream()  # inert tokens: no priority to pass


def _fallback_streams(module, count=3):
    module.pool.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        devices = [AcceleratorDevice(torch.device("cuda", 0), stream_priority=-1) for _ in range(2)]
        streams = [devices[i % 2].new_stream() for i in range(count)]
    assert streams == module.pool and len({id(s) for s in streams}) == count
    assert all(s.device == torch.device("cuda", 0) and s.priority == -1 for s in streams)
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_without_cuda_python_falls_back_to_the_pool_and_warns_once(fake_cuda, monkeypatch):
    module, _ = fake_cuda
    monkeypatch.setattr(accelerator, "_cuda_runtime", lambda: None)
    (warning,) = _fallback_streams(module)
    assert "cuda-python is not installed" in str(warning.message)
    assert "shared stream pool" in str(warning.message)
    assert not _fallback_streams(module)  # once per process


def test_a_failing_create_falls_back_and_warns_once(fake_cuda, monkeypatch):
    module, _ = fake_cuda
    runtime = FakeRuntime(module, error=35)  # cudaErrorInsufficientDriver
    monkeypatch.setattr(accelerator, "_cuda_runtime", lambda: runtime)
    (warning,) = _fallback_streams(module)
    assert "cudaStreamCreateWithPriority failed" in str(warning.message)
    assert [c[0] for c in runtime.calls] == ["create"] * 3


def test_a_raising_runtime_falls_back(fake_cuda, monkeypatch):
    module, _ = fake_cuda
    runtime = FakeRuntime(module, raises=RuntimeError("cudaStreamCreateWithPriority not found"))
    monkeypatch.setattr(accelerator, "_cuda_runtime", lambda: runtime)
    (warning,) = _fallback_streams(module)
    assert "not found" in str(warning.message)


def test_rocm_falls_back_without_calling_cuda_python(fake_cuda, monkeypatch):
    module, runtime = fake_cuda
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    (warning,) = _fallback_streams(module)
    assert "HIP" in str(warning.message)
    assert runtime.calls == []


def test_the_stream_is_destroyed_after_its_last_user_and_a_synchronize(fake_cuda):
    _, runtime = fake_cuda
    device = AcceleratorDevice(torch.device("cuda", 0))
    holder = {"d2h": device.new_stream()}  # as the engine holds its side streams
    handle = holder["d2h"].cuda_stream
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["create"]  # alive while referenced
    del device
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["create"]  # the device going is not enough
    holder.clear()
    gc.collect()
    assert runtime.calls[1:] == [("synchronize", handle), ("destroy", handle)]


@pytest.mark.parametrize("bad", [1, True, -1.0, "0", None])
def test_stream_priority_is_validated(bad):
    with pytest.raises(
        ValueError, match=r"stream_priority \(--offload-stream-priority\) must be an int <= 0"
    ):
        OffloadConfig(stream_priority=bad)
    assert OffloadConfig.from_options(stream_priority=-5).stream_priority == -5
