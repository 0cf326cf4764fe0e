"""Pinning a host buffer with several threads, for any register/unregister pair of calls.

Pinning a large buffer (``cudaHostRegister``) costs most of its time faulting in and
zeroing every page of it, on the one calling thread (about a few GB/s). ``pin`` splits the
buffer into page-aligned ranges and, on a small thread pool, first touches every page of
each range (one write per page, which makes the kernel back it), so that the pages are
faulted in by several cores at once. Then it registers the buffer: by default with ONE call
for the whole buffer (what torch's own ``pinned_num_register_threads`` does), or, with
``per_range=True``, one call per range from the pool threads.

Why one registration by default: a copy whose host slice crosses the border between two
separate registrations is not documented to be treated as a copy from pinned memory, and
the engine's copies fall anywhere in the arena. Per-range registration is there for callers
whose copies never cross the borders; a failure half-way then unregisters what succeeded.

Nothing here knows about CUDA: the caller passes ``register(address, nbytes) -> error code``
(0 for success) and ``unregister(address) -> error code`` (see ``accelerator.py``), so the
logic runs on the CPU with fakes.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

Register = Callable[[int, int], int]
Unregister = Callable[[int], int]

#: Threads that fault pages in (torch's ``pinned_num_register_threads`` defaults to 1, and
#: is commonly raised to 8 for large buffers).
DEFAULT_THREADS = min(8, os.cpu_count() or 1)
#: A range smaller than this is not worth a thread of its own.
MIN_RANGE_BYTES = 64 << 20


def shared_host_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 host tensor of ``nbytes`` in its own anonymous mapping, mapped shared.

    Why shared: the driver pins registered memory (``pin_user_pages``), and since Linux 5.9
    ``fork()`` copies pinned pages of a PRIVATE mapping into the child at once instead of
    sharing them copy-on-write: every DataLoader worker or checkpoint process Megatron forks
    after attach would get a copy of the whole arena (and the fork would take as long as the
    copy). Pages of a shared mapping are shared by the child, pinned or not, so a fork copies
    none of them. The mapping starts on a page boundary, so no page of it is shared with
    another allocation (or another registration). The tensor keeps the mapping alive.
    """
    if nbytes <= 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # pragma: no cover - non-POSIX hosts
        return torch.empty(max(nbytes, 0), dtype=torch.uint8, device="cpu")
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX hosts
        return 4096


from ..errors import PinError  # noqa: E402,F401 - raised here; every exception lives in errors.py


def split_ranges(
    address: int,
    nbytes: int,
    parts: int,
    *,
    page: int | None = None,
    min_bytes: int = MIN_RANGE_BYTES,
) -> list[tuple[int, int]]:
    """``[(address, nbytes), ...]`` covering ``[address, address + nbytes)`` in at most
    ``parts`` ranges of at least ``min_bytes`` (except when the whole is smaller).

    Every border between two ranges is a multiple of ``page`` as an absolute address, so no
    page belongs to two ranges (two registrations of one page would fail, and two threads
    touching one page would fault it twice).
    """
    if nbytes <= 0:
        return []
    page = page or page_size()
    end = address + nbytes
    parts = max(1, min(parts, nbytes // max(min_bytes, page) or 1))
    step = -(-nbytes // parts)
    borders = sorted({((address + i * step) // page) * page for i in range(1, parts)} | {end})
    ranges = []
    start = address
    for border in borders:
        if start < border <= end:
            ranges.append((start, border - start))
            start = border
    return ranges


def touch(buffer: torch.Tensor, base: int, start: int, nbytes: int, page: int) -> None:
    """Write one byte in every page of ``[start, start + nbytes)`` of the uint8 ``buffer``
    (whose first byte is at ``base``), so that the pages are faulted in now."""
    offset = start - base
    if nbytes > 0:
        buffer[offset : offset + nbytes : page].fill_(0)


def pin(
    buffer: torch.Tensor,
    *,
    register: Register,
    unregister: Unregister,
    threads: int = DEFAULT_THREADS,
    per_range: bool = False,
    min_range_bytes: int = MIN_RANGE_BYTES,
    page: int | None = None,
    cpus: tuple[int, ...] = (),
) -> tuple[tuple[int, int], ...]:
    """Fault in and register the 1-D uint8 ``buffer``; returns the registered ranges
    ``((address, nbytes), ...)`` to give to ``unpin``. Raises ``PinError`` (with nothing
    left registered) if a registration fails. ``cpus``: the pool threads run on these CPUs
    (the accelerator's NUMA node, ``numa.py``); the calling thread is left as it is."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("pin() takes a contiguous 1-D uint8 buffer.")
    nbytes = buffer.numel()
    if not nbytes:
        return ()
    page = page or page_size()
    base = buffer.data_ptr()
    ranges = split_ranges(base, nbytes, max(1, threads), page=page, min_bytes=min_range_bytes)

    def work(item: tuple[int, int]) -> int:
        start, size = item
        touch(buffer, base, start, size, page)
        return register(start, size) if per_range else 0

    def work_on_node(item: tuple[int, int]) -> int:
        if cpus and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, cpus)  # this pool thread only (0: the calling thread)
            except OSError:  # CPUs outside this process's cgroup: run where allowed
                pass
        return work(item)

    if len(ranges) == 1:
        codes = [work(ranges[0])]
    else:
        # The pool is joined (the with block) before anything is registered or returned:
        # every page is faulted in, and every per-range registration has finished, before
        # the buffer is handed to anyone who may queue a copy into it.
        with ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix="pin-host") as pool:
            futures = [pool.submit(work_on_node, item) for item in ranges]
            codes, raised = [], None
            for future in futures:
                try:
                    codes.append(int(future.result()))
                except BaseException as error:  # a range whose touch or register raised
                    codes.append(-1)
                    raised = raised or error
        if raised is not None:
            unpin([r for r, code in zip(ranges, codes) if per_range and code == 0], unregister)
            raise raised
    if not per_range:
        code = int(register(base, nbytes))
        if code != 0:
            raise PinError(
                f"registering {nbytes:,} bytes of host memory failed with error {code}",
                code=code,
                address=base,
                nbytes=nbytes,
            )
        return ((base, nbytes),)
    failed = [(r, code) for r, code in zip(ranges, codes) if code != 0]
    if failed:
        unpin([r for r, code in zip(ranges, codes) if code == 0], unregister)
        (start, size), code = failed[0]
        raise PinError(
            f"registering {size:,} of {nbytes:,} bytes of host memory (at offset {start - base:,}) "
            f"failed with error {code}; the {len(ranges) - len(failed)} range(s) registered were unregistered",
            code=code,
            address=start,
            nbytes=size,
        )
    return tuple(ranges)


def unpin(ranges: Sequence[tuple[int, int]], unregister: Unregister) -> list[int]:
    """Unregister every range (all of them, even after a failure); the error codes."""
    return [int(unregister(start)) for start, _ in ranges]
