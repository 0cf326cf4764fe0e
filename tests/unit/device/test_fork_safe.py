"""A fork after attach copies none of the host arena, nor the disk tier's staging, pinned as
the driver pins them.

``cudaHostRegister`` pins pages with ``pin_user_pages``; since Linux 5.9 ``fork()`` copies
the pinned pages of a PRIVATE mapping into the child at once (the child holds a copy, and the
fork takes as long as copying it). io_uring's fixed-buffer registration pins pages the same
way and needs no GPU, so it stands in for the driver here. The arena the devices hand out
(``host_buffer``, mapped shared) is registered, the process forks, and the child reports its
private memory: it stays flat as the arena grows. So it does for the staging (``io_buffer``:
a private mapping in huge pages, whose pages a fork wipes). The negative control, the same
buffer in a private mapping, shows the copy. Runs in the isolated process (forking pytest itself is not
wanted); skipped, naming the reason, where the kernel refuses io_uring.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

MIB = 1 << 20
SIZES = (32 * MIB, 128 * MIB)
_IO_URING_SETUP, _IO_URING_REGISTER, _REGISTER_BUFFERS = 425, 427, 0


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _private_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return 1024 * sum(
            int(line.split()[1])
            for line in f
            if line.startswith(("Private_Dirty", "Private_Clean"))
        )


def fork_with_pinned(nbytes: int, kind: str):
    """(fork milliseconds, the child's private bytes) with ``nbytes`` pinned; ``kind``:
    "arena" (the device's host buffer), "staging" (its I/O buffer) or "private" (a private
    mapping, the control). A string: why it could not."""
    import torch

    from megatron_offload.device.cpu import CPUDevice

    if kind == "arena":
        buffer = CPUDevice().host_buffer(nbytes)
    elif kind == "staging":
        buffer = CPUDevice().io_buffer(nbytes)
    else:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    buffer[::4096].fill_(1)  # fault every page in, as pinning does
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    ring = libc.syscall(_IO_URING_SETUP, ctypes.c_uint(4), params)
    if ring < 0:
        return f"io_uring_setup failed: {os.strerror(ctypes.get_errno())}"
    try:
        iov = _IoVec(buffer.data_ptr(), nbytes)
        if libc.syscall(_IO_URING_REGISTER, ring, _REGISTER_BUFFERS, ctypes.byref(iov), 1) < 0:
            return f"io_uring buffer registration failed: {os.strerror(ctypes.get_errno())}"
        from benchmarks.gpu_kit import timed_fork

        return timed_fork(_private_bytes)
    finally:
        os.close(ring)  # unregisters the buffer


def test_a_fork_copies_none_of_the_pinned_arena(isolated):
    kinds = ("arena", "staging", "private")
    results = {
        (kind, size): isolated.run(fork_with_pinned, size, kind) for kind in kinds for size in SIZES
    }
    refused = [r for r in results.values() if isinstance(r, str)]
    if refused:
        pytest.skip(
            f"this kernel does not pin memory through io_uring ({refused[0]}): nothing to measure"
        )
    for (kind, size), (forked_ms, child) in results.items():
        print(
            f"\n{kind} {size // MIB} MiB pinned: fork {forked_ms:.1f} ms, "
            f"child private {child / MIB:.1f} MiB"
        )
    for size in SIZES:
        for kind in ("arena", "staging"):
            # The child holds none of it, whatever its size.
            assert results[(kind, size)][1] < 16 * MIB, (kind, results[(kind, size)])
        # The control: the child holds a copy of every pinned page.
        assert results[("private", size)][1] >= size, results[("private", size)]
    # Flat as the buffers grow: 4x the pinned bytes, not 4x the child's memory.
    for kind in ("arena", "staging"):
        assert results[(kind, SIZES[1])][1] < results[(kind, SIZES[0])][1] + 8 * MIB
