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

import torch

from ..errors import DiskTierError

#: Filesystems whose files live in host memory: not a disk tier.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})
#: Filesystems reached over a network: allowed, with a warning.
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "9p", "lustre"})
#: ``check_readable`` reads this many bytes per ``pread`` (a scratch buffer of this size).
READ_CHUNK = 8 << 20


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

    def check_readable(self, tensor: torch.Tensor) -> None:
        """Read ``tensor``'s range of the file with ``pread`` before it is copied from the
        mapping, so that an I/O error or a file cut short raises ``DiskTierError`` here (through
        the mapping it would be a SIGBUS). The pages read stay cached for the copy."""
        offset, nbytes = self._range(tensor)
        size = os.fstat(self._fd).st_size
        if size < offset + nbytes:
            raise DiskTierError(
                f"reading {self.where}: the file was cut short to {size:,} bytes (bytes "
                f"{offset:,} to {offset + nbytes:,} are needed). The host copy there is lost; "
                "load the last checkpoint.",
                errno_=errno.EIO,
                path=self.tier.directory,
            )
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
        os.close(self._fd)

    def __repr__(self) -> str:
        return f"DiskFile({self.where})"


# mincore(2) from the C library: int mincore(void *addr, size_t length, unsigned char *vec).
_MINCORE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte), use_errno=True
)(("mincore", ctypes.CDLL(None, use_errno=True)))


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
