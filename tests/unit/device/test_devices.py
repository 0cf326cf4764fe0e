"""The synchronous CPU device (the accelerator one needs an accelerator: see the README)."""

import torch

from megatron_offload.device import CPUDevice, device_for


def test_cpu_device_copies_synchronously_and_releases_storage():
    device = device_for(torch.device("cpu"))
    assert isinstance(device, CPUDevice) and not device.is_accelerator
    assert repr(device) == "CPUDevice(cpu)" and device.memory_allocated() is None
    host = device.host_buffer(16)
    assert host.dtype == torch.uint8 and host.numel() == 16
    side = device.new_stream()
    src = torch.arange(4, dtype=torch.float32)
    dst = host.view(torch.float32)
    with device.use_stream(side):
        device.copy(dst, src)
        event = device.record_event(side)
    device.wait_stream(device.current_stream(), side)
    device.wait_event(device.current_stream(), event)
    device.synchronize_event(event)
    device.record_stream(src, side)
    device.synchronize()
    assert torch.equal(dst, src)  # complete as soon as copy() returned
    device.release(src)
    assert src.untyped_storage().nbytes() == 0 and src.shape == (4,)
    device.regrow(src, 16)
    assert src.untyped_storage().nbytes() == 16
    device.free_host_buffer(host)


def cycle_under_another_default_device():
    """Offload and reload with torch's default device set elsewhere (as ``set_default_device
    ("cuda")`` in a user's script): every host-side allocation names its device."""
    torch.set_default_device("meta")
    try:
        from megatron_offload.engine import OffloadEngine

        tensors = [
            torch.randn(1000, device="cpu"),
            torch.randn(10, dtype=torch.float64, device="cpu"),
        ]
        expected = [t.clone() for t in tensors]
        engine = OffloadEngine(CPUDevice(), lambda: [("optimizer_states", t) for t in tensors])
        engine.offload(release=True)
        released = [t.untyped_storage().nbytes() for t in tensors]
        host = CPUDevice().host_buffer(64)
        engine.reload()
        engine.wait()
        return released, host.device.type, all(torch.equal(a, b) for a, b in zip(tensors, expected))
    finally:
        torch.set_default_device(None)


def test_host_allocations_name_their_device(isolated):
    released, host_device, equal = isolated.run(cycle_under_another_default_device)
    assert released == [0, 0] and host_device == "cpu" and equal
