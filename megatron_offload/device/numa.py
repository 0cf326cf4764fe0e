"""NUMA placement of host buffers: the node an accelerator hangs off, and binding pages to it.

On a host with several NUMA nodes, a copy between an accelerator and host memory on another
node crosses the inter-socket link, which costs a large share of the host-link bandwidth.
The pages of a host buffer land on the node of the CPU that first touches them unless a
memory policy says otherwise, and the threads that fault the arena in are not bound. So
before a new host buffer is touched, its pages are bound to the accelerator's node
(``mbind(MPOL_BIND)``: whichever CPU faults them in, they are allocated there), and the
threads that fault it in run on that node's CPUs.

Where the node comes from: ``/sys/bus/pci/devices/<pci bus id>/numa_node`` (-1 when the
platform does not say), the nodes online in ``/sys/devices/system/node/online``, a node's
CPUs in ``/sys/devices/system/node/node<N>/cpulist``. A single-node host binds nothing and
says so (``Placement.note``). Nothing here knows CUDA: the caller passes the PCI bus id, and
the sysfs root can be a fake tree (tests).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform

SYSFS = "/sys"
#: ``mbind`` system call numbers (the generic table's on aarch64).
_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_BIND = 2


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where host buffers for one accelerator go."""

    node: int | None  # the accelerator's node; None: unknown, or nothing to choose
    nodes: int  # NUMA nodes online
    cpus: tuple[int, ...] = ()  # the node's CPUs (for the threads that fault pages in)
    note: str = ""  # why nothing is bound, when nothing is

    @property
    def binds(self) -> bool:
        return self.node is not None


def parse_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (sysfs cpu and node lists)."""
    items: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        items.extend(range(int(first), int(last or first) + 1))
    return items


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def placement(pci_bus_id: str | None, *, sysfs: str = SYSFS) -> Placement:
    """The ``Placement`` for the accelerator at ``pci_bus_id`` (``"0000:3b:00.0"``)."""
    online = _read(os.path.join(sysfs, "devices/system/node/online"))
    nodes = parse_list(online) if online else []
    if len(nodes) <= 1:
        return Placement(None, len(nodes), note="a single NUMA node: nothing to bind")
    if not pci_bus_id:
        return Placement(None, len(nodes), note="the accelerator's PCI bus id is unknown")
    text = _read(os.path.join(sysfs, "bus/pci/devices", pci_bus_id.lower(), "numa_node"))
    node = int(text) if text and text.strip().lstrip("-").isdigit() else -1
    if node < 0 or node not in nodes:
        return Placement(
            None, len(nodes), note=f"the platform does not say which node {pci_bus_id} is on"
        )
    cpus = _read(os.path.join(sysfs, f"devices/system/node/node{node}/cpulist"))
    return Placement(node, len(nodes), tuple(parse_list(cpus or "")))


def figures(devices) -> dict:
    """``numa_node`` (-1: unknown, or nothing chosen), ``numa_bound`` and ``numa_note`` (why
    nothing is bound) of the devices' host buffers, for ``stats()``."""
    placement = next((d.placement for d in devices if getattr(d, "placement", None)), None)
    note = next((d.numa_note for d in devices if getattr(d, "numa_note", "")), "")
    return {
        "numa_node": -1 if placement is None or placement.node is None else placement.node,
        "numa_bound": any(getattr(d, "numa_bound", False) for d in devices),
        "numa_note": note
        if placement is not None
        else "host memory is not placed (no accelerator)",
    }


def bind(address: int, nbytes: int, node: int) -> str:
    """Bind the pages of ``[address, address + nbytes)`` (page-aligned, not yet touched) to
    ``node``; returns '' on success, else why not (the pages then go where they are touched)."""
    number = _MBIND.get(platform.machine())
    if number is None:
        return f"mbind is not known on {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    result = libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(_MPOL_BIND),
        mask,
        ctypes.c_ulong(64 * words),
        ctypes.c_uint(0),
    )
    if result != 0:
        return f"mbind failed: {os.strerror(ctypes.get_errno())}"
    return ""
