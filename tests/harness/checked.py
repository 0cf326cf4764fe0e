"""Attach options that put the offloader on the checked stream-model device."""


def checked_device_options(options=None):
    """(options with a ``device_factory`` making CheckedDevices, the list they land in).

    Call ``check()`` on every device at the end of the job: it raises on any protocol
    violation and on copies nothing ever ordered.
    """
    from megatron_offload_testing import CheckedDevice

    devices = []

    def factory(torch_device):
        devices.append(CheckedDevice())
        return devices[-1]

    return {**(options or {}), "device_factory": factory}, devices


def check_devices(devices):
    """Collect garbage (dropped offloaders settle their copies in finalizers), then check."""
    import gc

    gc.collect()
    for device in devices:
        device.check()


def assert_dropped_call_caught(isolated, scenario, label, caught, **kwargs):
    """Run ``scenario`` in the isolated process with the ordering calls labelled ``label``
    dropped: at least one was dropped, and the checked device raised ``caught`` (rule, kind)."""
    out = isolated.run(scenario, skip_labels=(label,), **kwargs)
    assert out["skipped"].get(label, 0) > 0
    assert out["raised"] == caught, out
