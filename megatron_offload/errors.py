"""Every exception of the package, under one base class, and how a refusal reaches a person.

``OffloadError`` is the base: ``except megatron_offload.OffloadError`` catches anything the
package raises on purpose. Each subclass also derives from the built-in exception a caller
would expect (a refusal is a ``ValueError``, a budget a ``MemoryError``), so existing handlers
keep working.

A refusal is the same on every rank (it follows from the command line or the optimizer's
configuration, which every rank shares), so a job of hundreds of ranks would print hundreds
of identical tracebacks. ``print_refusals_once()`` (installed by ``patch_megatron``) prints a
refusal once, from rank 0, as its message alone; the exception still ends every rank's
process with status 1.
"""

from __future__ import annotations

import errno
import os
import sys

import torch

from .interceptions import PROCESS

#: ``print_refusals_once``'s change of ``sys.excepthook`` while installed.
_EXCEPTHOOK = None


class OffloadError(Exception):
    """Base class of the exceptions megatron-offload raises."""

    #: True where every rank raises the same error (printed once, by rank 0).
    same_on_every_rank = False


class OffloadArgumentError(OffloadError, ValueError):
    """A command line, or an optimizer configuration, that offloading cannot run with; raised
    before anything is touched."""

    same_on_every_rank = True


class HostMemoryBudgetError(OffloadError, MemoryError):
    """Offloading would hold more host memory than the configured budget; raised before
    anything is allocated."""


class NodeMemoryError(HostMemoryBudgetError):
    """The ranks of a node need more host memory together than the node (or its container,
    or ``ulimit -l`` for pinned memory) can give; every rank raises it, before anything is
    allocated (``offloader/node_memory.py``)."""

    same_on_every_rank = True


class OffloadStateError(OffloadError, RuntimeError):
    """An offload operation was called in a state where it cannot be honoured (for example
    after ``detach()``)."""


class DeviceMemoryError(OffloadError, torch.OutOfMemoryError):
    """An operation could not get the device memory it needed (another process, an inference
    engine, still holds it). What the operation had allocated was given back: the optimizer
    and the model are as before the call, and the same call works once memory is free. A
    ``torch.OutOfMemoryError``, so handlers written for torch's own keep working."""

    def __init__(
        self, operation: str, *, needed: int, free: int | None, advice: str | None = None
    ) -> None:
        self.operation, self.needed, self.free = operation, needed, free
        where = "" if free is None else f"; the device has {_gib(free)} free"
        super().__init__(
            f"{operation} needed {_gib(needed)} of device memory and could not get it{where}. "
            + (
                advice
                or "Nothing it allocated is kept and nothing was lost: call it again once that "
                "memory is free (an inference engine still releasing it, a cache to empty)."
            )
        )


class HostMemoryError(OffloadError, MemoryError):
    """An operation could not get the host memory it needed (the kernel refused a mapping).
    As for ``DeviceMemoryError``, what it had allocated was given back and the same call
    works once memory is free."""

    def __init__(self, operation: str, *, needed: int, advice: str | None = None) -> None:
        self.operation, self.needed = operation, needed
        super().__init__(
            f"{operation} needed {_gib(needed)} of host memory and the system refused it. "
            + (
                advice
                or "Nothing it allocated is kept and nothing was lost: call it again once that "
                "memory is free, or lower what the ranks of this node hold (host_memory_budget)."
            )
        )


def out_of_memory(
    error: BaseException, device, operation: str, needed: int, advice: str | None = None
) -> BaseException:
    """What to raise for ``error``, met by ``operation`` while allocating ``needed`` bytes,
    after undoing what it allocated: a ``DeviceMemoryError`` (chained to the allocator's own)
    for a device out of memory, a ``HostMemoryError`` for a host allocation the system
    refused, ``error`` itself for anything else (the package's own errors included).
    ``advice`` replaces "call it again" where the operation cannot simply be made again."""
    if isinstance(error, OffloadError):
        return error
    if isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "alloc" in str(error).lower()
    ):
        raised = DeviceMemoryError(
            operation, needed=needed, free=device.memory_free(), advice=advice
        )
    elif isinstance(error, MemoryError) or (
        isinstance(error, OSError) and error.errno == errno.ENOMEM
    ):
        raised = HostMemoryError(operation, needed=needed, advice=advice)
    else:
        return error
    raised.__cause__ = error
    return raised


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB ({nbytes} bytes)"


class DiskTierError(OffloadError, OSError):
    """A file of the disk tier could not be made, written or read (a full disk, an I/O error,
    a file cut short), or its directory is not a disk (``engine/disk.py``). The message names
    the operation and the directory; ``errno`` is the system's. Raised before the copy that
    needed the file lost anything: the device copy (after a failed write) or the file (after
    a failed read) is still the whole copy, and the same call can be made again."""

    same_on_every_rank = False

    def __init__(self, message: str, *, errno_: int | None = None, path: str = "") -> None:
        super().__init__(errno_, message)
        self.path = path

    def __str__(self) -> str:
        return self.strerror or ""


class SlotSizeError(OffloadError, ValueError):
    """One parameter's states do not fit in a slot of the chunked update."""


class PinError(OffloadError, RuntimeError):
    """Registering (part of) a host buffer failed; nothing of it is registered any more."""

    def __init__(self, message: str, *, code: int, address: int, nbytes: int) -> None:
        super().__init__(message)
        self.code, self.address, self.nbytes = code, address, nbytes


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a broken process group must not hide the refusal
        pass
    return int(os.environ.get("RANK", "0") or 0)


def _excepthook(kind, error, traceback, *, previous=None) -> None:
    if not isinstance(error, OffloadError):
        (previous or sys.__excepthook__)(kind, error, traceback)
        return
    rank = _rank()
    if error.same_on_every_rank and rank != 0:
        return  # rank 0 says it for everyone
    where = "" if error.same_on_every_rank else f" (rank {rank})"
    print(f"megatron-offload{where}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


def print_refusals_once() -> None:
    """Print an uncaught ``OffloadError`` as one message instead of a traceback per rank:
    a refusal every rank raises by rank 0 only, any other with its rank. Idempotent;
    ``restore_excepthook`` undoes it. A process-wide change: listed in ``PROCESS``."""
    global _EXCEPTHOOK
    if _EXCEPTHOOK is not None:
        return
    previous = sys.excepthook

    def excepthook(kind, error, traceback):
        _excepthook(kind, error, traceback, previous=previous)

    _EXCEPTHOOK = PROCESS.replace(
        sys,
        "excepthook",
        excepthook,
        why="an uncaught refusal is printed once, by rank 0, as its message",
        only_if_ours=True,
    )


def restore_excepthook() -> None:
    """Undo ``print_refusals_once`` (a hook installed since over ours stays)."""
    global _EXCEPTHOOK
    if _EXCEPTHOOK is not None:
        _EXCEPTHOOK.remove()
        _EXCEPTHOOK = None


# Methods of Megatron-LM's unreleased offloader that the offloader does not offer, and why.
_NOT_OFFERED = {
    "release_gpu_memory": "offload() frees the device memory itself (once the copy has read it); drop the call.",
    "sync_before_step": "call wait() (the same: the copy-back is ordered before the current stream).",
}


def no_attribute(obj, name: str) -> AttributeError:
    """The AttributeError for ``obj.name``, saying what to do for a name upstream had."""
    if name in _NOT_OFFERED:
        return AttributeError(f"{type(obj).__name__} has no {name}(): {_NOT_OFFERED[name]}")
    return AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
