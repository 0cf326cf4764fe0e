"""What the checked device records: violations, streams, events, and the memory queued copies use.

The checked device (``checked_device.py``) decides; these are the records it keeps: the kinds
of protocol violation, a stream's queue and vector clock, events, what is known about each
storage (its accesses, recorded streams, allocation time), the memory a queued copy will
touch (captured when the copy is issued), and the poison fresh memory holds.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# Kinds of violation (``Violation.kind``), with the protocol rule each belongs to.
UNORDERED_DEVICE_ACCESS = "unordered-device-access"  # rule 1
RELEASE_IN_USE = "release-in-use"  # rule 2
FREED_IN_USE = "freed-in-use"  # rule 2
OVERWRITE_WHILE_READ = "overwrite-while-read"  # rule 2
RELEASED_ACCESS = "released-access"  # rule 3
DEVICE_RACE = "device-race"  # rule 3
USE_BEFORE_COPY = "use-before-copy"  # rule 4
UNORDERED_HOST_READ = "unordered-host-read"  # rule 5
HOST_OVERWRITE = "host-overwrite-while-read"  # rule 5
HOST_FREED_IN_USE = "host-buffer-freed-in-use"  # rule 5
WRITE_BEFORE_ALLOCATION = "write-before-allocation"  # rule 7
RECORDED_ON_RETIRED_STREAM = (
    "recorded-on-retired-stream"  # rule 2 (a stream destroyed under a record)
)
NEVER_ORDERED = "never-ordered"  # rule 4 (device writes) or 5 (host writes)


@dataclass(frozen=True)
class Violation:
    """One ordering mistake: the protocol rule it breaks and where it was seen."""

    rule: int
    kind: str
    message: str
    label: str = ""  # label of the call that detected it ('' for unlabelled calls)

    def __str__(self) -> str:
        where = f" at '{self.label}'" if self.label else ""
        return f"rule {self.rule} ({self.kind}){where}: {self.message}"


class ProtocolViolation(AssertionError):
    """Raised for a ``Violation`` (at the call that detects it, or by ``check``)."""

    def __init__(self, violation: Violation, more: int = 0) -> None:
        self.violation = violation
        self.rule = violation.rule
        self.kind = violation.kind
        self.label = violation.label
        suffix = f" (and {more} more)" if more else ""
        super().__init__(f"{violation}{suffix}")


class _Stream:
    """A stream: a queue of copies plus what it is ordered after."""

    def __init__(self, name: str, *, compute: bool = False) -> None:
        self.name = name
        #: A compute stream is eager: the caller's ops and copies issued on it run at once.
        self.compute = compute
        self.pos = 0  # sequence number of the last operation issued (ticks for the compute stream)
        # stream -> the last of its sequence numbers ordered before this stream's next work
        self.after: dict[_Stream, int] = {}
        self.queue: collections.deque[_Op] = collections.deque()

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


@dataclass(frozen=True, eq=False)
class _Event:
    stream: _Stream
    vector: dict  # stream -> sequence number completed when the event completes


class _Memory:
    """What the model knows about one storage (identified by its storage object)."""

    def __init__(self, storage: torch.UntypedStorage, host: bool) -> None:
        # Only a weak reference: a strong one would change the storage use counts the
        # engine reads to decide whether a tensor owns its storage.
        self._weak = StorageWeakRef(storage)
        self.host = host
        self.accesses: list[_Access] = []
        self.recorded: set[_Stream] = set()  # streams announced with record_stream
        self.allocated_at: int | None = None  # tick of the last regrow/empty on its stream
        self.allocated_on: _Stream | None = None  # the compute stream that allocated it
        # compute stream -> its tick at the last ``note_compute`` since the allocation
        self.compute_uses: dict[_Stream, int] = {}
        self.freed = False  # host buffer given back with free_host_buffer
        self.from_empty = False  # allocated by ``empty`` (no tensor of the caller shares it)

    def storage(self) -> torch.UntypedStorage | None:
        return torch.UntypedStorage._new_with_weak_ptr(self._weak.cdata)

    def alive(self) -> bool:
        return not self._weak.expired()

    def describe(self) -> str:
        return "host buffer" if self.host else "device memory"


@dataclass(eq=False)
class _Access:
    stream: _Stream
    seq: int
    start: int  # byte range in the storage
    end: int
    write: bool


class _Ref:
    """The memory a queued copy will touch, fixed when the copy is issued.

    A queued accelerator copy works on addresses, not on tensor objects: re-pointing the
    tensor later (``set_``) must not redirect the copy. So the storage, offset, shape and
    stride are captured, without keeping the storage alive.
    """

    __slots__ = (
        "mem",
        "offset",
        "shape",
        "stride",
        "dtype",
        "start",
        "end",
        "ghost",
        "keep",
        "reported",
    )

    def __init__(self, mem: _Memory, tensor: torch.Tensor) -> None:
        self.mem = mem
        self.offset = tensor.storage_offset()
        self.shape = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.dtype = tensor.dtype
        self.start, self.end = _byte_span(tensor)
        self.ghost: torch.Tensor | None = None  # private bytes kept for a legal release
        self.keep: torch.Tensor | None = None  # the memory, kept alive for a recorded stream
        self.reported = False  # a violation already covers this memory going away

    def resolve(self) -> torch.Tensor | None:
        """A tensor over the captured memory, or None if that memory is gone."""
        if self.ghost is not None:
            return self.ghost
        if self.keep is not None and self.keep.untyped_storage().nbytes() >= self.end:
            return self.keep
        storage = self.mem.storage()
        if storage is None or storage.nbytes() < self.end:
            return None
        view = torch.empty(0, dtype=self.dtype, device=storage.device)
        return view.set_(storage, self.offset, self.shape, self.stride)


@dataclass(eq=False)
class _Op:
    stream: _Stream
    seq: int
    dst: _Ref
    src: _Ref
    deps: dict  # stream -> sequence number this copy must run after


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.storage_offset() * tensor.element_size()
    if tensor.numel() == 0:
        return start, start
    extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return start, start + extent * tensor.element_size()


def fill_poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with the model's garbage: NaN, the integer maximum, or 0xFF bytes."""
    dtype = tensor.dtype
    with torch.no_grad():
        if dtype.is_floating_point or dtype.is_complex:
            tensor.fill_(math.nan)
        elif dtype == torch.bool:
            tensor.view(torch.uint8).fill_(0xFF)
        else:
            try:
                tensor.fill_(torch.iinfo(dtype).max)
            except TypeError:  # a dtype without integer limits: raw all-ones bytes
                tensor.view(torch.uint8).fill_(0xFF)


def _poison_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    whole = raw.numel() // itemsize * itemsize
    if whole:
        fill_poison(raw[:whole].view(dtype))
    raw[whole:].fill_(0xFF)
