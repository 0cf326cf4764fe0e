"""What the disk tier's tests look at from outside the package: a directory on a disk for it,
the page cache of a file's mapping (``mincore``), and what a process holds open or mapped
under a directory (``/proc``)."""

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
