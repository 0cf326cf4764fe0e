"""What the disk tier's tests look at from outside the package: a directory on a disk for it,
the page cache of a file's mapping (``mincore``), the kernel's view of a mapping's areas
(``/proc/self/smaps``), and what a process holds open or mapped under a directory
(``/proc``)."""

from __future__ import annotations

import ctypes
import mmap
import os


def disk_directory(tmp_path_factory) -> str:
    """A directory on a disk for the tier (pytest's temporary directory, unless that is
    tmpfs, which the tier refuses: then one in the checkout)."""
    from megatron_offload.engine.disk import MEMORY_FILESYSTEMS, filesystem_type

    directory = str(tmp_path_factory.mktemp("disk-tier"))
    if filesystem_type(directory) in MEMORY_FILESYSTEMS:
        directory = os.path.abspath(os.path.join(".disk-tier-tests", os.path.basename(directory)))
        os.makedirs(directory, exist_ok=True)
    return directory


def page_cache_bytes(buffer) -> int:
    """Bytes of ``buffer``'s pages (a tensor over a mapping) that have memory: for a file's
    mapping, its pages in the page cache."""
    page = mmap.PAGESIZE
    pages = -(-buffer.numel() // page)
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None).mincore
    assert mincore(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel()), vector) == 0
    return sum(1 for byte in bytes(vector) if byte & 1) * page


def areas(start: int, end: int) -> list[dict]:
    """The areas of this process's memory map that overlap ``[start, end)``, from
    ``/proc/self/smaps``: each ``{"start", "end", "flags"}`` (the set of its ``VmFlags``:
    "sh" shared, "dc" not copied into a fork, "hg" advised into huge pages...) and its
    ``Rss`` and ``AnonHugePages`` in bytes."""
    found, area = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a new area: "start-end perms ..."
                low, high = (int(x, 16) for x in head.split("-"))
                area = (
                    {"start": low, "end": high, "flags": set()}
                    if low < end and start < high
                    else None
                )
                if area is not None:
                    found.append(area)
            elif area is not None and head == "VmFlags:":
                area["flags"] = set(line.split()[1:])
            elif area is not None and head in ("Rss:", "AnonHugePages:"):
                area[head[:-1]] = int(line.split()[1]) * 1024
    return found


def held_in(directory: str) -> list[str]:
    """This process's open files and mappings under ``directory``."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target.startswith(directory):
            held.append(target)
    with open("/proc/self/maps") as maps:
        held += [line.split(None, 5)[-1].strip() for line in maps if directory in line]
    return held
