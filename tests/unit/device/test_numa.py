"""NUMA placement of host buffers (``device/numa.py``).

The accelerator's node is read from a fake sysfs tree (this machine has one node); binding is
real: a fresh shared buffer is bound to node 0 (present wherever the kernel has NUMA) and
``/proc/self/numa_maps`` must say so. The accelerator device binds its host buffers before
they are touched and runs the faulting threads on the node's CPUs (fake CUDA module).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from megatron_offload.device import numa, pinned

BUS_ID = "0000:3B:00.0"


def _tree(tmp_path, *, online, node, cpulist="8-11,20"):
    root = tmp_path / "sys"
    (root / "devices/system/node").mkdir(parents=True)
    (root / "devices/system/node/online").write_text(online + "\n")
    for n in numa.parse_list(online):
        (root / f"devices/system/node/node{n}").mkdir()
        (root / f"devices/system/node/node{n}/cpulist").write_text(
            cpulist if n == node else "0-1" + "\n"
        )
    device = root / "bus/pci/devices" / BUS_ID.lower()
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{node}\n")
    return str(root)


def test_the_accelerators_node_and_its_cpus_come_from_sysfs(tmp_path):
    place = numa.placement(BUS_ID, sysfs=_tree(tmp_path, online="0-1", node=1))
    assert place == numa.Placement(1, 2, (8, 9, 10, 11, 20)) and place.binds


@pytest.mark.parametrize(
    "online,node,note",
    [
        ("0", 0, "single NUMA node"),
        ("0-1", -1, "does not say which node"),
        ("0-1", 3, "does not say which node"),
    ],
)
def test_nothing_is_bound_without_a_choice_and_the_note_says_why(tmp_path, online, node, note):
    place = numa.placement(BUS_ID, sysfs=_tree(tmp_path, online=online, node=node))
    assert place.node is None and not place.binds and note in place.note
    assert (
        "PCI bus id is unknown"
        in numa.placement(None, sysfs=_tree(tmp_path / "x", online="0-1", node=0)).note
    )


def test_lists_parse_as_sysfs_writes_them():
    assert numa.parse_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_list("") == []


def _numa_maps_line(address):
    with open("/proc/self/numa_maps") as f:
        return next((line for line in f if int(line.split()[0], 16) == address), None)


def test_binding_puts_a_fresh_buffers_pages_on_the_node():
    if not os.path.exists("/proc/self/numa_maps"):
        pytest.skip(
            "this kernel has no NUMA support (/proc/self/numa_maps is missing): nothing to bind"
        )
    buffer = pinned.shared_host_buffer(1 << 20)
    assert numa.bind(buffer.data_ptr(), buffer.numel(), 0) == ""
    buffer[::4096].fill_(1)  # touched after the binding, as the device does
    line = _numa_maps_line(buffer.data_ptr())
    assert line is not None and "bind:0" in line and "N0=" in line, line
    control = pinned.shared_host_buffer(1 << 20)
    control.fill_(1)
    assert "bind:" not in _numa_maps_line(control.data_ptr())


def test_the_accelerator_binds_its_host_buffers_and_faults_them_in_on_the_node(
    tmp_path, monkeypatch
):
    from megatron_offload.device import accelerator
    from tests.unit.device.test_pinned import FakeModule, FakeRegistry

    module = FakeModule()
    module.get_device_properties = lambda device: type(
        "P", (), {"pci_domain_id": 0, "pci_bus_id": 0x3B, "pci_device_id": 0}
    )()
    real = torch.get_device_module
    monkeypatch.setattr(
        torch, "get_device_module", lambda t: module if str(t) == "cuda" else real(t)
    )
    registry = FakeRegistry(current=lambda: module.current)
    monkeypatch.setattr(
        accelerator, "_host_register_calls", lambda: (registry.register, registry.unregister)
    )
    sysfs = _tree(
        tmp_path, online="0-1", node=1, cpulist=",".join(map(str, sorted(os.sched_getaffinity(0))))
    )
    monkeypatch.setattr(
        numa, "placement", lambda bus_id, _real=numa.placement: _real(bus_id, sysfs=sysfs)
    )
    bound, affinities = [], []
    monkeypatch.setattr(
        numa, "bind", lambda address, nbytes, node: bound.append((address, nbytes, node)) or ""
    )
    real_affinity = os.sched_setaffinity
    monkeypatch.setattr(
        os,
        "sched_setaffinity",
        lambda pid, cpus: (
            affinities.append((threading.current_thread().name, tuple(sorted(cpus))))
            or real_affinity(pid, cpus)
        ),
    )

    device = accelerator.AcceleratorDevice(torch.device("cuda", 0))
    device.pin_threads = 2
    size = 2 * pinned.MIN_RANGE_BYTES  # two ranges: two pool threads
    buffer = device.host_buffer(size)
    assert bound == [(buffer.data_ptr(), size, 1)]  # bound before the pages were touched
    assert device.numa_bound and device.numa_note == "" and device.placement.node == 1
    assert len(affinities) == 2 and all(name.startswith("pin-host") for name, _ in affinities)
    assert os.sched_getaffinity(0) == set(affinities[0][1])  # the caller's own is unchanged
    device.free_host_buffer(buffer)
