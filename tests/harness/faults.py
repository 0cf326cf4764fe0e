"""Faults injected at the boundary with torch: a device allocation that fails, an update that
raises part-way. Nothing of the package is patched: these replace torch's own entry points for
the duration of a block, as a device out of memory or a failing kernel would answer."""

from __future__ import annotations

import errno
import mmap

import torch

_OOM = "CUDA out of memory. Tried to allocate {} bytes (injected)"


class AllocationFaults:
    """Inside the block, storage allocations are counted (a storage regrown with ``resize_``,
    a fresh ``torch.empty``), and the ``fail_at``-th (from 1; None: none) raises
    ``torch.OutOfMemoryError`` instead of allocating, as a full device does. ``host``: the
    host mappings the package's buffers live in (``mmap.mmap``) are counted too, and the
    failing one raises ``OSError(ENOMEM)``, as the kernel answers. ``device=False``: only
    those."""

    def __init__(self, fail_at: int | None = None, *, host: bool = False, device=True) -> None:
        self.fail_at = fail_at
        self.host = host
        self.device = device
        self.count = 0
        self._saved = None

    def _allocation(self, nbytes: int, error=torch.OutOfMemoryError) -> None:
        self.count += 1
        if self.count == self.fail_at:
            if error is OSError:
                raise OSError(errno.ENOMEM, f"Cannot allocate memory ({nbytes} bytes, injected)")
            raise error(_OOM.format(nbytes))

    def __enter__(self) -> "AllocationFaults":
        resize, empty, mapping = torch.UntypedStorage.resize_, torch.empty, mmap.mmap
        self._saved = resize, empty, mapping
        faults = self

        def resize_(storage, nbytes):
            if nbytes > storage.nbytes():
                faults._allocation(nbytes)
            return resize(storage, nbytes)

        def empty_(*args, **kwargs):
            faults._allocation(-1)
            return empty(*args, **kwargs)

        def mmap_(fileno, length, *args, **kwargs):
            faults._allocation(length, OSError)
            return mapping(fileno, length, *args, **kwargs)

        if self.device:
            torch.UntypedStorage.resize_ = resize_
            torch.empty = empty_
        if self.host:
            mmap.mmap = mmap_
        return self

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_, torch.empty, mmap.mmap = self._saved


class Failing:
    """Inside the block, the ``fail_at``-th call (from 1) of ``owner.name`` raises ``error``
    instead of running: an update that stops part-way (``torch.Tensor.addcdiv_``, the last
    operation of Adam's update of one parameter in torch's single-tensor AdamW), an interrupt
    inside a copy (``torch.Tensor.copy_``)."""

    def __init__(self, owner, name: str, fail_at: int, error: BaseException) -> None:
        self.owner, self.name, self.fail_at, self.error = owner, name, fail_at, error
        self.count = 0

    def __enter__(self) -> "Failing":
        self._saved = getattr(self.owner, self.name)
        saved, faults = self._saved, self

        def failing(*args, **kwargs):
            faults.count += 1
            if faults.count == faults.fail_at:
                raise faults.error
            return saved(*args, **kwargs)

        setattr(self.owner, self.name, failing)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self._saved)


def failing_update(fail_at: int) -> Failing:
    """The ``fail_at``-th parameter's Adam update raises (torch's single-tensor AdamW)."""
    return Failing(torch.Tensor, "addcdiv_", fail_at, RuntimeError("the update failed (injected)"))


def interrupted_copy(fail_at: int) -> Failing:
    """The ``fail_at``-th ``copy_`` is interrupted (Ctrl-C, a signal turned into an error)."""
    return Failing(torch.Tensor, "copy_", fail_at, KeyboardInterrupt("injected"))


class FullDisk:
    """Inside the block, every file opened for writing under ``directory`` is a real file whose
    writes fail with ``OSError(ENOSPC)``, as on a full disk."""

    def __init__(self, directory: str) -> None:
        self.directory = str(directory)
        self.failed = 0

    def __enter__(self) -> "FullDisk":
        import builtins
        import errno
        import io
        import os

        self._saved = builtins.open
        saved, faults = self._saved, self

        class _Full(io.FileIO):
            def write(self, data):
                faults.failed += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def open_(file, mode="r", *args, **kwargs):
            path = os.fspath(file) if isinstance(file, (str, os.PathLike)) else ""
            if path.startswith(faults.directory) and "b" in mode and "w" in mode:
                return io.BufferedWriter(_Full(path, "w"))
            return saved(file, mode, *args, **kwargs)

        builtins.open = open_
        return self

    def __exit__(self, *exc) -> None:
        import builtins

        builtins.open = self._saved


def shared_mapping_bytes() -> int:
    """Bytes of this process's shared anonymous mappings (where the package's host buffers
    live on this device), as the kernel lists them: what is held, counted or not."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == "/dev/zero" and "s" in fields[1]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                total += end - start
    return total


def fake_host_limits(available, memlock=None):
    """The host's limits as ``available`` bytes of memory (and ``ulimit -l`` ``memlock``) for
    what the package reads of the OS (``host_limits.read``); returns the function that puts
    the real reader back."""
    from megatron_offload.engine import host_limits

    fake = host_limits.HostLimits(available, None, None, memlock)
    original = host_limits.read
    host_limits.read = lambda root="/": fake
    return lambda: setattr(host_limits, "read", original)
