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
import platform
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


#: The size of a transparent huge page on x86-64 (and arm64 with 4 KiB pages): an I/O
#: buffer's mapping is aligned to it (``io_host_buffer``).
HUGE_PAGE = 2 << 20
#: ``madvise``'s MADV_WIPEONFORK (Linux 4.14; Python's mmap module does not name it): a
#: fork gives the child the area empty, with none of its pages. Its number in the generic
#: table, which x86-64 and arm64 use; elsewhere the I/O buffers are mapped shared.
MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18)
_GENERIC_MADVISE = platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")


def io_host_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 host tensor of ``nbytes`` that direct reads and writes of a file move
    through (the disk tier's staging): its own private anonymous mapping, aligned to
    ``HUGE_PAGE``, advised into transparent huge pages (``MADV_HUGEPAGE``) and wiped in a
    fork (``MADV_WIPEONFORK``). Nothing is faulted in yet.

    Why huge pages: a direct write or read moves each physically contiguous run of the
    buffer's pages as one segment of a request, and a disk takes a bounded number of
    segments per request (254 on the virtio disk here). Small pages faulted in one pass lie
    in runs of a few pages; a huge page is one run of 2 MiB. The tier's direct writes ran at
    about 0.75 of a plain write from small pages and at about its rate from huge ones
    (docs/disk-tier.md).

    Why private, unlike ``shared_host_buffer``: shared anonymous memory gets huge pages only
    where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows it (``never`` by
    default on many distributions). What makes the other buffers shared, a fork copying the
    pinned pages of a private mapping at once, cannot happen to an area a fork wipes: the
    child gets the area with no pages (none copied, none shared), which it may still use as
    scratch memory of its own (a staging holds nothing between two copies).

    Only the whole huge pages inside the buffer are advised: the rest (under 2 MiB at its
    end) is advised against them and keeps small pages, so no page extends past ``nbytes``,
    which is what the budget counts. Where the kernel has no huge page to give (none free,
    or THP off), the pages are small: the same buffer, slower to write from. Where the fork
    advice is refused (a kernel before 4.14), the buffer is ``shared_host_buffer``'s.
    """
    page = page_size()
    if nbytes <= 0 or not _GENERIC_MADVISE:
        return shared_host_buffer(nbytes)
    # A huge page must lie on a 2 MiB boundary: the mapping is larger by what aligning the
    # buffer inside it may skip (never touched, so never given memory).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE - page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(MADV_WIPEONFORK)
    except OSError:
        mapping.close()
        return shared_host_buffer(nbytes)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    try:
        for advice, start, length in huge_page_advice(skip, nbytes, len(mapping)):
            mapping.madvise(getattr(mmap, advice), start, length)
    except (OSError, AttributeError):  # a kernel built without THP: small pages
        pass
    return whole[skip : skip + nbytes]


def huge_page_advice(skip: int, nbytes: int, length: int) -> list[tuple[str, int, int]]:
    """``(advice, start, length)`` for a buffer of ``nbytes`` at offset ``skip`` (on a huge
    page boundary) of a mapping of ``length`` bytes: its whole huge pages into huge pages,
    the rest of the mapping after them never (where THP is "always", a fault in the tail
    would otherwise get a huge page reaching into the room after the buffer). Only
    non-empty ranges: ``madvise`` refuses one that starts at the mapping's end."""
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    rest = length - skip - huge
    advice = [("MADV_HUGEPAGE", skip, huge)] if huge else []
    return advice + ([("MADV_NOHUGEPAGE", skip + huge, rest)] if rest > 0 else [])


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
