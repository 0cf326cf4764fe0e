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
