"""A device that models accelerator streams on the CPU and reports every ordering mistake.

On the CPU every copy is synchronous, so a missing wait can never show in an ordinary test.
``CheckedDevice`` keeps the tensors on the CPU but gives side streams the freedom an
accelerator has: their copies are deferred until something orders them, fresh memory holds
garbage, and every access is checked against the waits that should protect it.

The model, one rule per item ("->" names the accelerator rule it stands for):

- The compute stream is eager: the caller's torch ops and copies issued on it run at once.
  -> Kernels on one stream run in issue order.
- A stream from ``new_stream`` is a FIFO queue: a copy issued under ``use_stream(side)`` is
  queued, not run. -> A non-blocking copy on a side stream runs later, in order.
- Queued work runs only when the compute stream (``wait_event``/``wait_stream``) or the host
  (``synchronize_event``/``synchronize``) waits for it. -> Work is known to be done only
  where something waits for it.
- A side stream waiting on another stream only gains a dependency; running its later work
  first runs what it waited for. -> Cross-stream waits order work, they do not run it.
- Ordering is transitive through events (a vector clock per stream and one for the host).
  -> B waits on the compute stream, which waited on A: B's later work comes after A's.
- Before every device call made from the compute stream (except handle and test queries
  and waits of a side stream) the caller may have run kernels: the compute stream is then
  assumed to have written all device memory. -> The optimizer's kernels are invisible to
  the offloader.
- A side-stream copy touching device memory must be ordered after the compute stream's
  latest such point. -> Rule 1: a D2H waits for the step that wrote its source.
- A side-stream write into memory regrown (or allocated) after that stream last waited on
  the compute stream breaks rule 7. -> Stream-ordered allocation: the new block's earlier
  users ran on the compute stream.
- Two accesses of overlapping memory from different streams, one a write, must be ordered
  by waits or host synchronization. -> A data race (rules 3, 4 and 5).
- ``release`` of memory an unordered side-stream copy used is legal only if
  ``record_stream`` named that stream; the storage is freed at once and the queued copy
  keeps a private copy of its bytes. -> The caching allocator does not reuse a block until
  the recorded streams pass the free (rule 2).
- Without ``record_stream`` the queued copy later finds the memory gone or regrown, and
  reads poison or writes into the new owner's memory. -> A freed block is reused at once.
- A queued copy whose memory died (its last reference dropped) before it ran breaks rule 2
  unless ``record_stream`` named its stream, which keeps the memory for that copy. -> The
  same, for memory freed by the garbage collector.
- ``regrow``/``empty`` memory holds poison (NaN for floating dtypes, the maximum for
  integers, 0xFF bytes for bool), host buffers hold 0xFF bytes, until a copy writes them.
  -> Fresh memory is garbage: state used before its H2D ran reads NaN (rules 3 and 4).
- The host may read a host buffer (``check_readable``) or give it back
  (``free_host_buffer``) only after a host synchronization covering every copy that used
  it. -> ``event.synchronize()`` before host reads and frees (rule 5).
- ``note_compute`` marks the caller's kernels (an optimizer step): side-stream writes of
  device memory must be ordered before it (rule 4), and reads too, since the step
  overwrites that memory. -> The rule 2 hazard without a release.
- ``compute_stream`` makes another eager stream (a user's ``torch.cuda.Stream``, autograd's
  stream for a backward hook). Memory is allocated on the compute stream current at
  ``regrow``/``empty``; the kernels of another compute stream are the ones ``note_compute``
  marks on it. A side-stream copy must be ordered after the allocating (or default)
  stream's latest point and after every other compute stream's marked kernels on that
  memory (rule 1); releasing memory another compute stream used needs ``record_stream``
  for it, or the allocating or a recorded stream ordered after its use. -> The caching
  allocator knows only a block's allocation stream and the streams recorded on it.
- ``check`` reports queued work nothing ever ordered, runs what is left, and raises if
  anything was violated. -> Work no stream or host waits for may never be seen complete.

Ordering calls carry a ``label`` naming the protocol step. ``skip_labels`` drops every call
with one of those labels (a negative control: exactly that wait or record is missing), and
``calls`` / ``skipped`` count the labelled calls issued and dropped.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterable

import torch

from megatron_offload.device.base import Device

from .checked_access import AccessRules
from .checked_checks import DeviceChecks
from .checked_records import (
    FREED_IN_USE,
    HOST_FREED_IN_USE,
    RECORDED_ON_RETIRED_STREAM,
    RELEASE_IN_USE,
    ProtocolViolation,
    Violation,
    _Event,
    _Memory,
    _Op,
    _poison_storage,
    _Ref,
    _Stream,
    fill_poison,
)


class CheckedDevice(DeviceChecks, AccessRules, Device):
    """A ``Device`` on the CPU whose side streams are deferred and checked (see module doc).

    Args:
        skip_labels: ordering calls with one of these labels are dropped (negative controls).
        raise_violations: raise ``ProtocolViolation`` where a violation is detected. When
            False, violations are only collected in ``violations``.
    """

    is_accelerator = True

    def __init__(self, *, skip_labels: Iterable[str] = (), raise_violations: bool = True) -> None:
        self.torch_device = torch.device("cpu")
        self.skip_labels = frozenset(skip_labels)
        self.raise_violations = raise_violations
        self.violations: list[Violation] = []
        self.calls: collections.Counter[str] = collections.Counter()  # labelled calls issued
        self.skipped: collections.Counter[str] = collections.Counter()  # ... and dropped
        self.retired: dict[_Stream, bool] = {}  # streams retire_stream was called for -> announced
        self._compute = _Stream("compute", compute=True)  # the default current stream
        self._computes: list[_Stream] = [self._compute]
        self._sides: list[_Stream] = []
        self._active = [self._compute]
        self._host: dict[_Stream, int] = {}  # what the host knows to be complete
        self._memories: dict[int, _Memory] = {}
        self._sweep_at = 64
        self._label = ""  # label of the wait whose work is running

    # ------------------------------------------------------------------ memory
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self._tick()
        buffer = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
        self._memory(buffer, host=True)
        return buffer

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        self._tick()
        mem = self._memory(buffer)
        for acc in mem.accesses:
            if not self._ordered(None, acc.stream, acc.seq):
                self._violation(
                    5,
                    HOST_FREED_IN_USE,
                    f"a host buffer is given back while a copy on {acc.stream.name} that "
                    f"{'writes' if acc.write else 'reads'} it is not known to be complete: the "
                    "host must synchronize with that copy first",
                )
                break
        mem.freed = True

    def release(self, tensor: torch.Tensor) -> None:
        self._tick()
        mem = self._memory(tensor)
        # The block goes back to the stream that allocated it (the current one, for memory
        # this device did not allocate); recorded streams hold it until their work at the
        # release ran. A copy ordered before any of them cannot see the block reused.
        protectors = (mem.allocated_on or self._current_compute(), *mem.recorded)
        self._check_other_users(mem)
        for acc in mem.accesses:
            if acc.stream in protectors or any(
                self._ordered(s, acc.stream, acc.seq) for s in protectors
            ):
                continue
            if acc.stream not in mem.recorded:
                self._violation(
                    2,
                    RELEASE_IN_USE,
                    f"device memory is released while a copy on {acc.stream.name} that "
                    f"{'writes' if acc.write else 'reads'} it is not ordered before the release, "
                    "and record_stream did not announce that stream to the allocator",
                )
                break
        for op in self._pending():
            for ref in (op.dst, op.src):
                if ref.mem is not mem or ref.ghost is not None:
                    continue
                if op.stream in mem.recorded:
                    # The allocator keeps the block for the recorded stream: keep its bytes.
                    alive = ref.resolve()
                    if alive is not None:
                        ref.ghost = alive.clone()
                    ref.keep = None
                else:
                    ref.reported = True
        tensor.untyped_storage().resize_(0)
        mem.accesses = []
        mem.recorded = set()
        mem.allocated_at = mem.allocated_on = None
        mem.compute_uses = {}

    def regrow(self, tensor: torch.Tensor, nbytes: int) -> None:
        self._tick()
        mem = self._memory(tensor)
        storage = tensor.untyped_storage()
        fresh = storage.nbytes() == 0
        storage.resize_(nbytes)
        if fresh:
            _poison_storage(storage, tensor.dtype)
        mem.accesses = []
        self._allocated(mem)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._tick()
        tensor = torch.empty(numel, dtype=dtype)
        fill_poison(tensor)
        mem = self._memory(tensor)
        self._allocated(mem)
        mem.from_empty = True
        return tensor

    # ----------------------------------------------------------------- streams
    def current_stream(self) -> _Stream:
        return self._active[-1]

    def new_stream(self) -> _Stream:
        stream = _Stream(f"side-{len(self._sides) + 1}")
        self._sides.append(stream)
        return stream

    def compute_stream(self) -> _Stream:
        """Another eager stream the caller may compute on (``use_stream`` makes it current),
        as a user's ``torch.cuda.Stream()`` or autograd's stream for a backward hook."""
        stream = _Stream(f"compute-{len(self._computes) + 1}", compute=True)
        self._computes.append(stream)
        return stream

    def retire_stream(self, stream: _Stream, *, announced: bool) -> None:
        # A destroyed stream (``announced=False``) must not be named by the record_stream set
        # of memory that is still alive: the allocator records an event on it at the free.
        self.retired[stream] = announced
        if announced:
            return
        for mem in list(self._memories.values()):
            storage = mem.storage() if mem.alive() and not mem.host else None
            if storage is not None and storage.nbytes() and stream in mem.recorded:
                self._violation(
                    2,
                    RECORDED_ON_RETIRED_STREAM,
                    f"{stream.name} is retired as destroyable while live device memory names it in "
                    "its record_stream set: the allocator records an event on the destroyed stream "
                    "when that memory is freed",
                )
                break

    @contextlib.contextmanager
    def use_stream(self, stream: _Stream):
        self._active.append(stream)
        try:
            yield stream
        finally:
            self._active.pop()

    def record_event(self, stream: _Stream, *, timing: bool = False) -> _Event:
        return _Event(stream, self._vector(stream))

    def wait_stream(self, waiter: _Stream, waitee: _Stream, *, label: str = "") -> None:
        if self._labelled(label, tick=waiter.compute):
            with self._detecting(label):
                self._wait(waiter, self._vector(waitee))

    def wait_event(self, stream: _Stream, event: _Event, *, label: str = "") -> None:
        if self._labelled(label, tick=stream.compute):
            with self._detecting(label):
                self._wait(stream, event.vector)

    def synchronize_event(self, event: _Event, *, label: str = "") -> None:
        if self._labelled(label, tick=True):
            with self._detecting(label):
                self._host_wait(event.vector)

    def synchronize(self) -> None:
        self._tick()
        self._host_wait(self._vector_all())

    def record_stream(self, tensor: torch.Tensor, stream: _Stream, *, label: str = "") -> None:
        if self._labelled(label, tick=True):
            mem = self._memory(tensor)
            mem.recorded.add(stream)
            # The allocator keeps a recorded block until the stream's queued work ran, even
            # if every tensor using it dies first: keep the memory for those copies. Only
            # for memory from ``empty``: a strong reference changes the storage use count,
            # which the engine reads for the optimizer's own tensors.
            if mem.from_empty:
                for op in stream.queue:
                    for ref in (op.dst, op.src):
                        if ref.mem is mem and ref.ghost is None and ref.keep is None:
                            ref.keep = ref.resolve()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self._active[-1]
        self._tick()
        src_ref = self._ref(src)
        dst_ref = self._ref(dst)
        seq = stream.pos if stream.compute else stream.pos + 1
        if not self._check_access(stream, seq, src_ref, write=False):
            return
        if not self._check_access(stream, seq, dst_ref, write=True):
            return
        self._note_access(stream, seq, src_ref, write=False)
        self._note_access(stream, seq, dst_ref, write=True)
        op = _Op(stream, seq, dst_ref, src_ref, dict(stream.after))
        if stream.compute:
            self._execute(op)
        else:
            stream.pos = seq
            stream.queue.append(op)

    # ----------------------------------------------------------------- helpers
    def _streams(self):
        return [*self._computes, *self._sides]

    def _pending(self):
        for stream in self._sides:
            yield from stream.queue

    def _tick(self) -> None:
        # The caller may have run kernels on the compute stream since its last device call.
        if self._active[-1].compute:
            self._active[-1].pos += 1

    def _current_compute(self) -> _Stream:
        """The compute stream the caller's work goes to (the innermost current one)."""
        for stream in reversed(self._active):
            if stream.compute:
                return stream
        return self._compute  # pragma: no cover - the default compute stream is always active

    def _allocated(self, mem) -> None:
        stream = self._current_compute()
        mem.allocated_on, mem.allocated_at = stream, stream.pos
        mem.compute_uses = {}

    def _check_other_users(self, mem) -> None:
        """Rule 2 across compute streams: memory allocated on one compute stream and used
        (after its allocation) by another may be freed only if ``record_stream`` announced
        that other stream, or the allocating stream or an announced one is ordered after its
        work: otherwise the allocator hands the block to the allocating stream's next
        allocation while the other stream may still use it."""
        if mem.host or mem.allocated_on is None:
            return  # memory this device did not allocate: its stream is not known
        for user, seq in mem.compute_uses.items():
            if user is mem.allocated_on or user in mem.recorded:
                continue
            if any(self._ordered(s, user, seq) for s in (mem.allocated_on, *mem.recorded)):
                continue
            self._violation(
                2,
                RELEASE_IN_USE,
                f"device memory allocated on {mem.allocated_on.name} is released while work on "
                f"{user.name}, which used it, is not ordered before the release, and "
                f"record_stream did not announce {user.name} to the allocator",
            )
            return

    def _labelled(self, label: str, *, tick: bool) -> bool:
        """Count an ordering call; False if ``skip_labels`` drops it."""
        if tick:
            self._tick()
        self.calls[label] += 1
        if label in self.skip_labels:
            self.skipped[label] += 1
            return False
        return True

    @contextlib.contextmanager
    def _detecting(self, label: str):
        # Work run by a labelled wait reports its violations under that label.
        outer, self._label = self._label, label
        try:
            yield
        finally:
            self._label = outer

    def _vector(self, stream: _Stream) -> dict:
        vector = dict(stream.after)
        vector[stream] = stream.pos
        return vector

    def _vector_all(self) -> dict:
        return {s: s.pos for s in self._streams()}

    def _ordered(self, waiter: _Stream | None, stream: _Stream, seq: int) -> bool:
        """Is operation ``seq`` of ``stream`` ordered before ``waiter``'s next work?

        ``waiter`` None stands for the host.
        """
        if waiter is stream or self._host.get(stream, 0) >= seq:
            return True
        return waiter is not None and waiter.after.get(stream, 0) >= seq

    def _wait(self, waiter: _Stream, vector: dict) -> None:
        for stream, seq in vector.items():
            if stream is not waiter and waiter.after.get(stream, -1) < seq:
                waiter.after[stream] = seq
        if waiter.compute:
            for stream, seq in vector.items():
                if not stream.compute:
                    self._run_to(stream, seq)

    def _host_wait(self, vector: dict) -> None:
        for compute in self._computes:  # whatever is issued next comes after what the host saw
            self._wait(compute, vector)
        for stream, seq in vector.items():
            if self._host.get(stream, -1) < seq:
                self._host[stream] = seq

    def _run_to(self, stream: _Stream, seq: int) -> None:
        while stream.queue and stream.queue[0].seq <= seq:
            op = stream.queue[0]
            for dep, dep_seq in op.deps.items():
                if not dep.compute:
                    self._run_to(dep, dep_seq)
            stream.queue.popleft()
            self._execute(op)

    def _execute(self, op: _Op) -> None:
        src = self._resolve_for(op, op.src)
        dst = self._resolve_for(op, op.dst)
        if dst is None:
            return  # the write lands in memory nobody owns any more
        with torch.no_grad():
            if src is None:
                fill_poison(dst)  # what reused memory would hold
            else:
                dst.copy_(src)

    def _resolve_for(self, op: _Op, ref: _Ref) -> torch.Tensor | None:
        tensor = ref.resolve()
        if tensor is None and not ref.reported and op.stream not in ref.mem.recorded:
            ref.reported = True
            host = ref.mem.host
            self._violation(
                5 if host else 2,
                HOST_FREED_IN_USE if host else FREED_IN_USE,
                f"a copy on {op.stream.name} runs after its {ref.mem.describe()} was freed, and "
                "record_stream did not announce that stream to the allocator",
            )
        return tensor

    def _memory(self, tensor: torch.Tensor, host: bool = False) -> _Memory:
        storage = tensor.untyped_storage()
        key = storage._cdata
        mem = self._memories.get(key)
        # A dead storage's address is not reused while our weak reference lives, but once
        # the record is dropped a new storage may take it: never trust a dead record.
        if mem is None or not mem.alive():
            mem = _Memory(storage, host)
            self._memories[key] = mem
            if len(self._memories) >= self._sweep_at:
                self._sweep()
        return mem

    def _sweep(self) -> None:
        self._memories = {k: m for k, m in self._memories.items() if m.alive()}
        self._sweep_at = max(64, 2 * len(self._memories))

    def _ref(self, tensor: torch.Tensor) -> _Ref:
        return _Ref(self._memory(tensor), tensor)

    def _violation(
        self, rule: int, kind: str, message: str, label: str = "", *, record_only: bool = False
    ) -> None:
        dropped = sorted(self.skipped)
        if dropped:
            message += f" [ordering calls dropped by skip_labels: {', '.join(dropped)}]"
        violation = Violation(rule, kind, message, label or self._label)
        self.violations.append(violation)
        if self.raise_violations and not record_only:
            raise ProtocolViolation(violation)

    def __repr__(self) -> str:
        skip = f", skip_labels={sorted(self.skip_labels)}" if self.skip_labels else ""
        return f"CheckedDevice(cpu{skip})"
