"""The disk tier: host copies kept in files on a local disk, for what host memory cannot hold.

A ``DiskTier`` is one directory (``OffloadConfig.offload_disk_dir``), checked once: it must
be a directory on a disk. tmpfs and ramfs are refused (their files ARE host memory), a
network filesystem is warned about (every copy then crosses the network).

A ``DiskFile`` is one file in it, holding the host copies of the pieces that do not fit in
host memory (``host.py`` decides which). It is

* **unlinked from the start**: opened with ``O_TMPFILE`` (no name ever appears in the
  directory), or, where the filesystem lacks it, created and removed at once. Nothing is
  left behind after ``close``, a crash or a kill, and ranks sharing the directory never
  meet each other's files.
* **allocated in full before anything is written** (``posix_fallocate``): a full disk is a
  ``DiskTierError`` then, when nothing has moved, never a SIGBUS at a later write through
  the mapping.
* **mapped shared**: its bytes are a 1-D uint8 tensor like any host buffer, so the engine's
  copies go into and out of it unchanged (``device.copy``).

Page cache is host memory (a container's limit counts it), so the tier keeps it bounded:
after a piece is copied out, ``write_back`` writes the file's dirty pages (``fdatasync``) and
drops the piece's pages (``drop``: ``madvise(MADV_DONTNEED)`` unmaps them from this process,
``posix_fadvise(POSIX_FADV_DONTNEED)`` then drops the clean pages from the page cache); after a
piece is copied in, its pages are dropped again. Dropping never loses data (a dirty page stays
in the page cache until written), so it is safe whatever a copy still does. Between two
copies the tier holds the page cache of at most the piece being copied
(``resident_bytes`` measures it with ``mincore``).

I/O errors through a mapping arrive as SIGBUS, not as exceptions. So a write error is met by
``fdatasync`` (before the device copy is released), and before a piece is copied in,
``check_readable`` reads its range with ``pread`` (an I/O error or a file cut short raises
there, naming the directory, and the read pages are then cached for the copy).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import DiskTierError
from .labels import HOST_READ_AFTER_D2H

#: Filesystems whose files live in host memory: not a disk tier.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})
#: Filesystems reached over a network: allowed, with a warning.
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "9p", "lustre"})
#: ``check_readable`` reads this many bytes per ``pread`` (a scratch buffer of this size).
READ_CHUNK = 8 << 20
#: A staging buffer is this many parts, each of (at most) ``STAGING_PART`` bytes: the I/O
#: threads read or write the others while one part is copied (``staging_bytes``).
PARTS = 4
STAGING_PART = 16 << 20
#: The threads that write the parts: up to this many writes at once while the thread that
#: copies fills another part. A direct write queues only the requests of its own chunk, and a
#: disk reaches its rate with several queued (docs/disk-tier.md measures one and three). Reads
#: stay on one thread: they go through the page cache, whose readahead keeps the disk's queue
#: full, and parallel reads measured slower.
WRITE_THREADS = PARTS - 1


def page_size() -> int:
    return mmap.PAGESIZE


def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``), or "" if unknown."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if "-" not in fields:
                    continue
                point = fields[4].encode().decode("unicode_escape")  # \040 for a space
                fstype = fields[fields.index("-") + 1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fstype
    except OSError:  # pragma: no cover - no /proc: nothing to check against
        return ""
    return kind


class DiskTier:
    """The directory the disk tier's files are made in, checked once here.

    Raises ``DiskTierError`` if ``directory`` is not a writable directory, or is on a
    filesystem held in memory (tmpfs, ramfs); warns for a network filesystem."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise DiskTierError(
                f"offload_disk_dir={self.directory!r} is not a directory. Create it on a local "
                "disk (NVMe), or leave offload_disk_dir unset.",
                errno_=errno.ENOTDIR,
                path=self.directory,
            )
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise DiskTierError(
                f"offload_disk_dir={self.directory!r} is not writable by this process.",
                errno_=errno.EACCES,
                path=self.directory,
            )
        self.filesystem = filesystem_type(self.directory)
        if self.filesystem in MEMORY_FILESYSTEMS:
            raise DiskTierError(
                f"offload_disk_dir={self.directory!r} is on {self.filesystem}, whose files are "
                "host memory: it is not a disk tier. Give a directory on a local disk (NVMe), "
                "or raise host_memory_budget instead.",
                errno_=errno.EINVAL,
                path=self.directory,
            )
        if self.filesystem in NETWORK_FILESYSTEMS:
            warnings.warn(
                f"megatron-offload: offload_disk_dir={self.directory!r} is on {self.filesystem}, "
                "a network filesystem: every copy to and from the disk tier crosses the network. "
                "A local disk (NVMe) is what the disk tier is for.",
                RuntimeWarning,
                stacklevel=3,
            )

    def file(self, nbytes: int) -> "DiskFile":
        """A new ``DiskFile`` of ``nbytes``, allocated in full (``DiskTierError`` if it cannot
        be, with nothing left behind)."""
        return DiskFile(self, nbytes)

    def __repr__(self) -> str:
        return f"DiskTier({self.directory!r}, {self.filesystem or 'unknown filesystem'})"


class DiskFile:
    """One unlinked, fully allocated file of the disk tier, mapped shared as ``buffer``."""

    def __init__(self, tier: DiskTier, nbytes: int) -> None:
        self.tier = tier
        self.nbytes = int(nbytes)
        self.where = f"a file of {self.nbytes:,} bytes in {tier.directory}"
        self._fd = _open_unlinked(tier.directory)
        try:
            try:
                os.posix_fallocate(self._fd, 0, self.nbytes)
            except OSError as error:
                free = _free_bytes(tier.directory)
                raise DiskTierError(
                    f"allocating {self.where} failed: {error.strerror}"
                    + ("" if free is None else f" ({free:,} bytes free there)")
                    + ". Nothing was moved. Free space there, point offload_disk_dir at a larger "
                    "disk, or raise host_memory_budget so less goes to disk.",
                    errno_=error.errno,
                    path=tier.directory,
                ) from error
            self._mapping = mmap.mmap(
                self._fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            # No readahead, on reads nor on faults: pages read ahead complete asynchronously,
            # into the page cache after a ``drop`` (the tier would then hold more than one
            # piece); every read here is of a known range already.
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._mapping.madvise(mmap.MADV_RANDOM)
        except BaseException:
            os.close(self._fd)  # the file is unlinked: closing it gives its blocks back
            raise
        #: The file's bytes: a 1-D uint8 tensor over the shared mapping.
        self.buffer: torch.Tensor | None = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._address = self.buffer.data_ptr()
        #: The same file opened for direct I/O (``O_DIRECT``: no page cache at all), which
        #: ``write`` uses; None where the filesystem has none.
        self.direct = _open_again(self._fd, os.O_DIRECT)
        #: The same file opened again, with the kernel's readahead (off on the mapping's
        #: descriptor), which ``read`` uses: each chunk read is dropped once copied.
        self._stream = _open_again(self._fd, 0)
        if self._stream is not None:
            os.posix_fadvise(self._stream, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    # ------------------------------------------------------------------ I/O
    def owns(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor``'s bytes are in this file's mapping."""
        start = tensor.untyped_storage().data_ptr()
        return self._address <= start < self._address + self.nbytes

    def write_back(self, tensor: torch.Tensor | None = None, *, then: str = "") -> None:
        """Write the file's dirty pages to the disk, then drop ``tensor``'s (a range of
        ``buffer``; None: the whole file) from host memory. Raises ``DiskTierError`` if the
        disk refuses them, with ``then`` (what the caller's user is left with) in the
        message; the pages are kept (they may be the only copy)."""
        try:
            os.fdatasync(self._fd)
        except OSError as error:
            raise DiskTierError(
                f"writing to {self.where} failed: {error.strerror}. {then}".strip(),
                errno_=error.errno,
                path=self.tier.directory,
            ) from error
        self.drop(tensor)

    def write(self, host: torch.Tensor, source: torch.Tensor, staging: torch.Tensor, device):
        """``source`` (a contiguous device tensor) into ``host`` (its range of ``buffer``, as
        long), through ``staging`` (a host buffer of ``staging_bytes``, in ``PARTS`` parts):
        each chunk is copied out on the current stream into a part, the host waits for that
        copy, and an I/O thread writes the part while the next chunks are copied out. Then
        the file is written back and the range dropped where the writes went through the page
        cache (without direct I/O). Faster than copying through the mapping, whose page
        faults read every page before it is overwritten. Raises ``DiskTierError`` on a write
        error, ``source`` untouched."""
        offset, nbytes = self._range(host)
        source = source.reshape(-1).view(torch.uint8)
        if staging is None:  # none held (everything on disk, asleep): through the mapping
            device.copy(host.reshape(-1).view(torch.uint8), source)
            # The host writes the pages back: the copy into them must be complete.
            device.synchronize_event(
                device.record_event(device.current_stream()), label=HOST_READ_AFTER_D2H
            )
            self.write_back(host, then=KEPT)
            return
        parts = _parts(staging)
        step = len(parts[0])
        pending: list = [None] * len(parts)
        try:
            for index, start in enumerate(range(0, nbytes, step)):
                slot = index % len(parts)
                size = min(step, nbytes - start)
                if pending[slot] is not None:  # the part's last write must be done: refill it
                    error = pending[slot].exception()
                    if error is not None:
                        raise self._failed("writing", error, KEPT) from error
                device.copy(parts[slot][:size], source[start : start + size])
                # An I/O thread reads the part: the copy into it must be complete.
                device.synchronize_event(
                    device.record_event(device.current_stream()), label=HOST_READ_AFTER_D2H
                )
                pending[slot] = _io("write").submit(self._pwrite, parts[slot], size, offset + start)
        finally:
            # Every write is waited for, even after an error: none may read the staging later.
            errors = [f.exception() for f in pending if f is not None]
        for error in errors:
            if error is not None:
                raise self._failed("writing", error, KEPT) from error
        if self.direct is None or not self._aligned(offset, staging):
            self.write_back(host, then=KEPT)  # through the page cache: out of it again

    def read(self, destination: torch.Tensor, host: torch.Tensor, staging: torch.Tensor, device):
        """``host`` (a range of ``buffer``) into ``destination`` (a contiguous device tensor
        as long), through ``staging``: an I/O thread reads the chunks with ``pread`` into the
        parts, up to ``PARTS`` ahead, while the chunks read are copied in on the current
        stream; a part is refilled once the host saw its copy in complete. Raises
        ``DiskTierError`` on a read error or a short read (``destination`` then holds part of
        the bytes)."""
        offset, nbytes = self._range(host)
        destination = destination.reshape(-1).view(torch.uint8)
        if staging is None:  # none held (everything on disk, asleep): through the mapping
            self.check_readable(host)  # an I/O error raises here, not a SIGBUS in the copy
            device.copy(destination, host.reshape(-1).view(torch.uint8))
            # The pages are dropped once the copy read them.
            device.synchronize_event(
                device.record_event(device.current_stream()), label=HOST_READ_AFTER_D2H
            )
            self.drop(host)
            return
        parts = _parts(staging)
        step = len(parts[0])
        starts = list(range(0, nbytes, step))
        reads: dict = {}

        def submit(index: int) -> None:
            size = min(step, nbytes - starts[index])
            part = parts[index % len(parts)]
            reads[index] = _io("read").submit(self._pread, part, size, offset + starts[index])

        try:
            for index in range(min(len(parts), len(starts))):
                submit(index)
            for index, start in enumerate(starts):
                try:
                    reads.pop(index).result()
                except OSError as error:
                    self._check_length(offset, nbytes)  # a file cut short: say so
                    raise self._failed("reading", error, NOT_COPIED) from error
                size = min(step, nbytes - start)
                device.copy(destination[start : start + size], parts[index % len(parts)][:size])
                following = index + len(parts)
                if following < len(starts) or index == len(starts) - 1:
                    # The part is refilled next (or, after the last chunk, the staging is free
                    # for the next piece): the copies in must have read it. On a stream, in
                    # order, so the last one covers those before it.
                    device.synchronize_event(
                        device.record_event(device.current_stream()), label=HOST_READ_AFTER_D2H
                    )
                if following < len(starts):
                    submit(following)
        finally:
            for future in reads.values():
                future.exception()  # none may write the staging later
            # Pages read ahead past the range, out of host memory too (dropping never loses
            # data).
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _aligned(self, offset: int, part: torch.Tensor) -> bool:
        """True if direct I/O can move a chunk at ``offset`` through ``part``: both on a page
        boundary (chunks are whole pages long, the file's pieces page-aligned, ``host.py``)."""
        page = page_size()
        return offset % page == 0 and part.data_ptr() % page == 0

    def _pwrite(self, part: torch.Tensor, size: int, offset: int) -> None:
        if self.direct is not None and self._aligned(offset, part):
            # Whole pages: the piece's range in the file is padded to them.
            view = _bytes_of(part)[: -(-size // page_size()) * page_size()]
            _all(os.pwrite, self.direct, view, offset)
            return
        _all(os.pwrite, self._fd, _bytes_of(part)[:size], offset)
        # Starts writing the pages back now, and drops those already clean.
        os.posix_fadvise(self._fd, offset, size, os.POSIX_FADV_DONTNEED)

    def _pread(self, part: torch.Tensor, size: int, offset: int) -> None:
        # Buffered, with readahead: faster here than direct reads of a chunk at a time (the
        # kernel reads ahead while the chunk is copied); the chunk's pages are dropped once
        # read, and those read ahead when their chunk is (``read`` drops the rest).
        fd = self._stream if self._stream is not None else self._fd
        _all(_preadv, fd, _bytes_of(part)[:size], offset)
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)

    def _check_length(self, offset: int, nbytes: int) -> None:
        """Raise ``DiskTierError`` if the file no longer holds bytes ``offset`` to
        ``offset + nbytes`` (something cut it short)."""
        size = os.fstat(self._fd).st_size
        if size < offset + nbytes:
            raise DiskTierError(
                f"reading {self.where}: the file was cut short to {size:,} bytes (bytes "
                f"{offset:,} to {offset + nbytes:,} are needed). The host copy there is lost; "
                "load the last checkpoint.",
                errno_=errno.EIO,
                path=self.tier.directory,
            )

    def _failed(self, operation: str, error: BaseException, then: str) -> DiskTierError:
        reason = getattr(error, "strerror", None) or str(error)
        return DiskTierError(
            f"{operation} {self.where} failed: {reason}. {then}",
            errno_=getattr(error, "errno", None) or errno.EIO,
            path=self.tier.directory,
        )

    def check_readable(self, tensor: torch.Tensor) -> None:
        """Read ``tensor``'s range of the file with ``pread`` before it is copied from the
        mapping, so that an I/O error or a file cut short raises ``DiskTierError`` here (through
        the mapping it would be a SIGBUS). The pages read stay cached for the copy."""
        offset, nbytes = self._range(tensor)
        self._check_length(offset, nbytes)
        scratch = memoryview(bytearray(min(READ_CHUNK, max(nbytes, 1))))
        done = 0
        while done < nbytes:
            want = min(len(scratch), nbytes - done)
            try:
                got = os.preadv(self._fd, [scratch[:want]], offset + done)
            except OSError as error:
                raise DiskTierError(
                    f"reading {self.where} failed at byte {offset + done:,}: {error.strerror}. "
                    "Nothing was copied to the device; the same call can be made again.",
                    errno_=error.errno,
                    path=self.tier.directory,
                ) from error
            if got <= 0:
                raise DiskTierError(
                    f"reading {self.where}: the read returned short at byte {offset + done:,} "
                    f"of {offset + nbytes:,}. Nothing was copied to the device.",
                    errno_=errno.EIO,
                    path=self.tier.directory,
                )
            done += got

    def drop(self, tensor: torch.Tensor | None = None) -> None:
        """Take ``tensor``'s pages (a range of ``buffer``; None: the whole file) out of host
        memory: unmapped from this process, then dropped from the page cache once clean.
        Never loses data: a page still dirty stays cached until written."""
        if self.buffer is None:
            return
        offset, nbytes = (0, self.nbytes) if tensor is None else self._range(tensor)
        page = page_size()
        start = offset // page * page
        end = min(-(-(offset + nbytes) // page) * page, self.nbytes)
        if end <= start:
            return
        self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
        os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Bytes of the file in the page cache now (``mincore`` over the mapping)."""
        if self.buffer is None or not self.nbytes:
            return 0
        page = page_size()
        pages = -(-self.nbytes // page)
        vector = (ctypes.c_ubyte * pages)()
        if _MINCORE(self._address, self.nbytes, vector):
            return 0  # pragma: no cover - the mapping is ours and page-aligned
        return (pages - bytes(vector).count(0)) * page  # Linux writes 1 (resident) or 0

    def _range(self, tensor: torch.Tensor) -> tuple[int, int]:
        start = tensor.data_ptr() - self._address
        return start, tensor.numel() * tensor.element_size()

    def close(self) -> None:
        """Close the file: its blocks go back to the filesystem once no tensor views
        ``buffer`` (the caller has waited for every copy into or out of it)."""
        if self.buffer is None:
            return
        self.buffer = self._mapping = None
        for fd in (self.direct, self._stream):
            if fd is not None:
                os.close(fd)
        os.close(self._fd)

    def __repr__(self) -> str:
        return f"DiskFile({self.where})"


#: What a failed write leaves: the device copy (the caller releases it only after).
KEPT = (
    "The device copy is kept (nothing was released): the next offload tries again once the "
    "disk is sound."
)
#: What a failed read leaves.
NOT_COPIED = (
    "Nothing was copied to the device for good (what was regrown is given back); the same "
    "call can be made again."
)


def staging_bytes(largest: int, limit: int | None = None) -> int:
    """Bytes of the staging buffer for pieces of at most ``largest`` bytes under a host
    budget of ``limit``: ``PARTS`` parts of ``STAGING_PART``, or less where the largest piece
    (rounded up to a page) or an eighth of the budget is smaller; at least a page each."""
    page = page_size()
    part = min(STAGING_PART, -(-max(largest, 1) // page) * page)
    if limit is not None:
        part = min(part, limit // 8 // page * page)
    return PARTS * max(part, page)


def fault_in(staging: torch.Tensor) -> None:
    """Give every page of a new staging buffer its memory now, in one pass from one thread.

    The direct writes read their chunks from the staging's pages, and the disk moves each
    physically contiguous run of pages as one segment. The staging is advised into huge
    pages (``Device.io_buffer``), each one run of 2 MiB, given now rather than at the first
    copies. Where it has small pages, those faulted in one pass lie in longer runs: left to
    the first copies, which fault them in a part at a time among the step's other
    allocations, they lay one page per run (seen here with ``/proc/self/pagemap``), and the
    writes from them ran at about half a plain write's rate (docs/disk-tier.md). An
    accelerator's pinned staging was faulted in by pinning already: this only writes it."""
    if staging.numel():
        ctypes.memset(staging.data_ptr(), 0, staging.numel())


def _parts(staging: torch.Tensor) -> list[torch.Tensor]:
    part = staging.numel() // PARTS
    return [staging[i * part : (i + 1) * part] for i in range(PARTS)]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 host tensor's bytes (no copy)."""
    return memoryview((ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


# "write" or "read" -> (the process it was made in, its pool).
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def _io(kind: str) -> ThreadPoolExecutor:
    """The disk tier's I/O threads for ``kind``, "write" (``WRITE_THREADS`` of them) or "read"
    (one), made at their first use: the writes and reads run there, off the thread that
    issues the copies. A forked child (a DataLoader worker, a checkpoint writer) has no thread
    behind its parent's pools: it makes its own."""
    made = _POOLS.get(kind)
    if made is None or made[0] != os.getpid():
        threads = WRITE_THREADS if kind == "write" else 1
        made = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix=f"offload-{kind}"))
        _POOLS[kind] = made
    return made[1]


# mincore(2) from the C library: int mincore(void *addr, size_t length, unsigned char *vec).
_MINCORE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte), use_errno=True
)(("mincore", ctypes.CDLL(None, use_errno=True)))


def _all(call, fd: int, view: memoryview, offset: int) -> None:
    """``call`` (``os.pwrite`` or ``_preadv``) until all of ``view`` moved; a call that moves
    nothing is a short read (EIO)."""
    done = 0
    while done < len(view):
        moved = call(fd, view[done:], offset + done)
        if moved <= 0:
            raise OSError(errno.EIO, f"the transfer returned short at byte {offset + done:,}")
        done += moved


def _preadv(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def _open_again(fd: int, flags: int) -> int | None:
    """``fd``'s file opened again, with ``flags`` (through /proc: the file has no name), or
    None where that is refused (``O_DIRECT`` on a filesystem without direct I/O)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC | flags)
    except (OSError, AttributeError):
        return None


def _open_unlinked(directory: str) -> int:
    """A new file in ``directory`` that has no name: ``O_TMPFILE``, or a named file removed
    at once where the filesystem cannot make one without a name."""
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise DiskTierError(
                    f"opening a file in {directory} failed: {error.strerror}.",
                    errno_=error.errno,
                    path=directory,
                ) from error
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".megatron-offload-")
    except OSError as error:
        raise DiskTierError(
            f"opening a file in {directory} failed: {error.strerror}.",
            errno_=error.errno,
            path=directory,
        ) from error
    os.unlink(name)
    return fd


def _free_bytes(directory: str) -> int | None:
    try:
        figures = os.statvfs(directory)
    except OSError:  # pragma: no cover
        return None
    return figures.f_bavail * figures.f_frsize
