"""A model of PyTorch's CUDA caching allocator, with streams on a modelled clock.

Pure Python, no tensors: it answers "when is freed device memory reusable, and does
anything stall" for a sequence of allocations, frees, copies and waits. Times are seconds
of modelled time; sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KiB, MiB = 1024, 1024 * 1024
MIN_BLOCK = 512  # every request is rounded up to a multiple of this
SMALL_REQUEST = 1 * MiB  # requests up to this size come from the small pool
SMALL_SEGMENT = 2 * MiB  # segment size of the small pool
MID_SEGMENT = 20 * MiB  # segment for large requests below LARGE_REQUEST
LARGE_REQUEST = 10 * MiB  # from here on a segment is the request rounded up to SEGMENT_ROUND
SEGMENT_ROUND = 2 * MiB
LARGE_BUFFER = 20 * MiB  # an oversize request takes a cached block at most this much larger

DIRECTIONS = ("d2h", "h2d")


class ModelledOutOfMemory(MemoryError):
    """A modelled allocation that fits nowhere even after a stall released the cache."""


@dataclass(eq=False)
class ModelStream:
    """A stream of the model. ``tail``: when the work queued on it so far ends (side streams)."""

    name: str
    direction: str | None = None  # default direction of its copies ('d2h' or 'h2d')
    tail: float = 0.0

    def __repr__(self) -> str:
        return f"<modelled stream {self.name}>"


@dataclass(frozen=True, eq=False)
class ModelEvent:
    """An event: completes at ``time``, the end of the work queued before it."""

    stream: ModelStream
    time: float


@dataclass(eq=False)
class Segment:
    """One ``cudaMalloc``: blocks are carved out of it, addresses ``address..address+size``."""

    address: int
    size: int
    stream: ModelStream
    small: bool
    pool: str | None = None  # a torch.cuda.MemPool's name; None: the default pool


@dataclass(eq=False)
class Block:
    """A piece of a segment: allocated, deferred (freed, waiting for events) or free (cached)."""

    address: int
    size: int
    segment: Segment | None
    stream: ModelStream | None  # allocation stream
    state: str = "allocated"  # 'allocated' | 'deferred' | 'free' | 'released'
    requested: int = 0
    recorded: set = field(default_factory=set)  # streams named by record_stream
    uses: dict = field(default_factory=dict)  # stream -> end time of its last copy using the block
    ready: float = 0.0  # when a deferred/free block became (becomes) reusable
    prev: "Block | None" = None
    next: "Block | None" = None

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass(frozen=True)
class Stall:
    """An allocation that found no cached block and no capacity (a ``num_alloc_retries``)."""

    time: float  # when the allocation was made
    requested: int  # bytes requested
    waited: float  # modelled seconds the stall held the host and compute stream
    waited_for: tuple  # what it waited for, in words
    released: int  # bytes of cached segments given back to the device


@dataclass(frozen=True)
class ReuseHazard:
    """Memory handed out while a copy that used it (unannounced by record_stream) still runs."""

    time: float  # the allocation handing the memory out
    address: int
    nbytes: int  # bytes of the new block overlapping the copy's memory
    stream: str  # the copy's stream
    copy_end: float  # when that copy finishes


def round_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` gets: a multiple of 512 bytes (at least 512)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """Size of the segment ``cudaMalloc``-ed for a (rounded) request no cached block fits."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < LARGE_REQUEST:
        return MID_SEGMENT
    return -(-size // SEGMENT_ROUND) * SEGMENT_ROUND


class AllocatorModel:
    """PyTorch's CUDA caching allocator (no expandable segments) and stream timing, modelled.

    One rule a line (PyTorch's behaviour, except those marked "model"):

    - Pools: a cached block serves only its allocation stream, and the small (<= 1 MiB) or large pool.
    - MemPools (``pool=``, ``torch.cuda.MemPool``, e.g. Megatron-FSDP's NCCL-registered one): a
      block freed in one serves only allocations in the same pool, and its segments are never
      given back by a stall or ``empty_cache`` (model: the pool lives as long as the run).
    - Stream-ordered reuse: freed without ``record_stream``, a block is reusable at once by its stream.
    - Other streams: never get a cached block; only a stall or ``empty_cache`` returns its segment.
    - ``record_stream``: the free records an event on each recorded stream; reusable when all completed.
    - Events are recorded AT FREE TIME: work queued on a recorded stream after the free does not delay.
    - Lazy: deferred frees become reusable at the next ``malloc`` after their events (``process_events``).
    - Rounding: requests round up to a multiple of 512 bytes.
    - Segments: 2 MiB for requests <= 1 MiB, 20 MiB below 10 MiB, else the request rounded up to 2 MiB.
    - Best fit: the smallest cached free block that fits, then the lowest address.
    - Splitting: large-pool remainders > 1 MiB and small-pool ones >= 512 bytes are split off.
    - ``backend="cudaMallocAsync"``: a free with recorded streams makes the allocation stream wait
      for them (the compute stream: ``now`` moves), then the block is reusable at once.
    - ``max_split_size`` (when set): a large block of that size or more is never split; a request
      below it never takes such a block, one at or above it only a block < its size + 20 MiB.
    - Merging: adjacent blocks of a segment merge once both are free (reusable).
    - Capacity: a segment is ``cudaMalloc``-ed only if reserved + its size <= ``capacity``.
    - Stall: no block, no capacity -> wait for all deferred frees, ``cudaFree`` free segments, retry.
    - ``cudaFree`` synchronizes the device: a stall that frees a segment waits for all queued work.
    - The retry is a ``cudaMalloc`` only: blocks the stall's wait freed are found by the next malloc.
    - Each stall is recorded in ``stalls`` (``num_alloc_retries``); a failed retry raises OOM.
    - Clock (model): ``now`` is the compute stream's time; ``compute(s)`` advances it.
    - No host run-ahead (model): the host is where the compute stream is; allocations see ``now``.
    - Compute waits (model): ``wait_event``/``wait_stream`` on the compute stream move ``now``.
    - Side copies (model): start after their stream's work and waits, not before ``now``; nbytes / bw.
    - Compute copies (model): advance ``now`` by nbytes / compute_copy_bandwidth (or the direction's).
    - Events complete at the end of the work queued before them (model: end times fixed at issue).
    - Hazards (model): bytes handed out while an unrecorded copy using them runs go to ``hazards``.

    Without host run-ahead the model is optimistic where a real host would allocate before the
    compute stream reached the allocation: it sees deferred frees complete that a real
    ``process_events`` (at the earlier host time) would not yet see.
    """

    def __init__(
        self,
        *,
        capacity: int,
        d2h_bandwidth: float,
        h2d_bandwidth: float,
        compute_copy_bandwidth: float | None = None,
        max_split_size: int | None = None,
        backend: str = "native",
    ) -> None:
        for name, value in (("d2h_bandwidth", d2h_bandwidth), ("h2d_bandwidth", h2d_bandwidth)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if compute_copy_bandwidth is not None and not compute_copy_bandwidth > 0:
            raise ValueError(
                f"compute_copy_bandwidth must be positive, got {compute_copy_bandwidth!r}"
            )
        self.capacity = capacity
        self.max_split_size = max_split_size  # PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb, in bytes
        if backend not in ("native", "cudaMallocAsync"):
            raise ValueError(f"backend must be 'native' or 'cudaMallocAsync', got {backend!r}")
        self.backend = backend
        self.bandwidth = {"d2h": float(d2h_bandwidth), "h2d": float(h2d_bandwidth)}
        self.compute_copy_bandwidth = compute_copy_bandwidth
        self.now = 0.0
        self.compute_stream = ModelStream("compute")
        self._sides: list[ModelStream] = []
        self._segments: list[Segment] = []
        self._next_address = 1 << 20  # modelled addresses; never reused
        self._free: list[Block] = []  # cached, reusable blocks
        self._deferred: list[Block] = []  # freed, waiting for record_stream events
        self._reuse_log: list[tuple[float, int]] = []
        self._unprotected: list[tuple[int, int, float, str]] = []  # start, end, copy end, stream
        self.stalls: list[Stall] = []
        self.hazards: list[ReuseHazard] = []
        self.oom_count = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated = 0
        self.peak_reserved = 0

    # ------------------------------------------------------------------ clock
    def compute(self, seconds: float) -> float:
        """Run ``seconds`` of kernels on the compute stream; returns the new ``now``."""
        if seconds < 0:
            raise ValueError(f"compute time must not be negative, got {seconds!r}")
        self.now += seconds
        return self.now

    def new_stream(self, direction: str | None = None, *, name: str | None = None) -> ModelStream:
        """A side stream; ``direction`` ('d2h'/'h2d') is the default for its copies."""
        if direction is not None and direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        stream = ModelStream(name or f"side-{len(self._sides) + 1}", direction, self.now)
        self._sides.append(stream)
        return stream

    def copy(
        self, stream: ModelStream, nbytes: int, direction: str | None = None, *, uses=()
    ) -> float:
        """Queue a copy of ``nbytes`` on ``stream``; returns when it ends.

        ``uses``: blocks of device memory the copy reads or writes (for ``hazards``).
        """
        direction = direction or stream.direction
        if direction is not None and direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if stream is self.compute_stream:
            bandwidth = self.compute_copy_bandwidth or (direction and self.bandwidth[direction])
            if not bandwidth:
                raise ValueError(
                    "a copy on the compute stream needs a direction or compute_copy_bandwidth"
                )
            end = self.compute(nbytes / bandwidth)
        else:
            if direction is None:
                raise ValueError(f"{stream.name} has no direction: pass direction='d2h' or 'h2d'")
            # A copy starts after its stream's earlier work and waits, and not before it is issued.
            end = max(stream.tail, self.now) + nbytes / self.bandwidth[direction]
            stream.tail = end
        for block in uses:
            if block.stream is not stream:
                block.uses[stream] = max(block.uses.get(stream, 0.0), end)
        return end

    def record_event(self, stream: ModelStream) -> ModelEvent:
        """An event completing when the work queued on ``stream`` so far has executed."""
        return ModelEvent(stream, self._tail(stream))

    def wait_event(self, stream: ModelStream, event: ModelEvent) -> None:
        """Work queued on ``stream`` from now on starts no earlier than ``event``."""
        if stream is self.compute_stream:
            # No host run-ahead: the host reaches the compute stream's next work when it starts.
            self.now = max(self.now, event.time)
        else:
            stream.tail = max(stream.tail, event.time)

    def wait_stream(self, waiter: ModelStream, waitee: ModelStream) -> None:
        """Work queued on ``waiter`` from now on starts after all work queued on ``waitee``."""
        self.wait_event(waiter, self.record_event(waitee))

    def synchronize_event(self, event: ModelEvent) -> None:
        """The host blocks until ``event`` completed: ``now`` moves to its time."""
        self.now = max(self.now, event.time)

    def synchronize(self) -> None:
        """The host blocks until every stream's queued work executed."""
        self.now = max([self.now] + [s.tail for s in self._sides])

    def _tail(self, stream: ModelStream) -> float:
        return self.now if stream is self.compute_stream else max(stream.tail, self.now)

    # ----------------------------------------------------------------- memory
    def malloc(
        self, nbytes: int, stream: ModelStream | None = None, *, pool: str | None = None
    ) -> Block:
        """Allocate ``nbytes`` for ``stream`` (None: the compute stream), inside the MemPool
        ``pool`` (None: the default pool)."""
        stream = stream or self.compute_stream
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes == 0:  # like cudaMalloc of 0 bytes: a null block, no memory
            return Block(0, 0, None, stream, requested=0)
        # process_events: deferred frees whose events completed by now become reusable.
        self._process_events(self.now)
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        block = self._best_fit(stream, small, size, pool) or self._new_segment(
            stream, small, size, pool
        )
        if block is None:
            self._stall(nbytes)
            block = self._new_segment(stream, small, size, pool)
            if block is None:
                self.oom_count += 1
                raise ModelledOutOfMemory(
                    f"modelled device out of memory: tried to allocate {nbytes} bytes "
                    f"({size} rounded, a {segment_size(size)}-byte segment); capacity "
                    f"{self.capacity}, reserved {self.reserved_bytes}, allocated {self.allocated_bytes}"
                )
        return self._hand_out(block, size, nbytes)

    def free(self, block: Block) -> None:
        """Free ``block``: reusable at once by its stream, or once its recorded streams pass."""
        if block.size == 0:
            return
        if block.state != "allocated":
            raise ValueError(f"block at {block.address:#x} is not allocated ({block.state})")
        size = block.size
        self.allocated_bytes -= size
        for stream, end in block.uses.items():
            if stream not in block.recorded and end > self.now:
                # Nobody told the allocator this stream still uses the memory.
                self._unprotected.append((block.address, block.end, end, stream.name))
        recorded, block.recorded, block.uses = block.recorded, set(), {}
        if recorded and self.backend == "cudaMallocAsync":
            # cudaFreeAsync on the allocation stream after it waited for every recorded one.
            end = max(self._tail(s) for s in recorded)
            if block.stream is self.compute_stream:
                self.now = max(self.now, end)
            else:
                block.stream.tail = max(block.stream.tail, end)
            recorded = set()
        if recorded:
            # insert_events: one event per recorded stream, recorded now (at free time).
            block.state = "deferred"
            block.ready = max(self._tail(s) for s in recorded)
            self._deferred.append(block)
        else:
            block.ready = self.now
            self._make_free(block)
        self._reuse_log.append((block.ready, size))

    def record_stream(self, block: Block, stream: ModelStream) -> None:
        """``tensor.record_stream(stream)``: the block is used by ``stream`` too."""
        if block.size == 0:
            return
        if block.state != "allocated":
            raise ValueError(f"record_stream on a block that is not allocated ({block.state})")
        if stream is not block.stream:  # the allocation stream is ordered already
            block.recorded.add(stream)

    def empty_cache(self) -> int:
        """``torch.cuda.empty_cache()``: wait for deferred frees, give free segments back."""
        return self._release_cached()[2]

    # ---------------------------------------------------------------- queries
    @property
    def num_alloc_retries(self) -> int:
        """Like ``torch.cuda.memory_stats()['num_alloc_retries']``."""
        return len(self.stalls)

    def reusable_bytes(
        self, stream: ModelStream | None = None, at: float | None = None, *, pool: str | None = None
    ) -> int:
        """Bytes of the cached blocks of ``stream`` (None: compute) reusable at time ``at`` by
        an allocation in ``pool`` (None: the default pool, where the forward pass allocates).

        ``at`` defaults to ``now`` and may not be earlier: a later time answers what an
        allocation then would find if nothing else happened before.
        """
        stream = stream or self.compute_stream
        at = self.now if at is None else at
        if at < self.now:
            raise ValueError(f"at={at!r} is before now={self.now!r}")
        cached = self._free + [b for b in self._deferred if b.ready <= at]
        return sum(b.size for b in cached if b.stream is stream and b.segment.pool == pool)

    def reuse_timeline(self) -> list[tuple[float, int]]:
        """``(time, nbytes)`` for every freed block, when it became reusable (up to ``now``)."""
        return sorted(entry for entry in self._reuse_log if entry[0] <= self.now)

    def segments(self) -> list[tuple[int, int, str]]:
        """``(address, size, stream name)`` of every reserved segment."""
        return [(s.address, s.size, s.stream.name) for s in self._segments]

    # ---------------------------------------------------------------- helpers
    def _process_events(self, at: float) -> None:
        for block in sorted((b for b in self._deferred if b.ready <= at), key=lambda b: b.ready):
            self._deferred.remove(block)
            self._make_free(block)

    def _best_fit(self, stream: ModelStream, small: bool, size: int, pool=None) -> Block | None:
        fits = [
            b
            for b in self._free
            if b.stream is stream
            and b.segment.pool == pool
            and b.segment.small == small
            and b.size >= size
            and self._may_take(b, size)
        ]
        return min(fits, key=lambda b: (b.size, b.address), default=None)

    def _may_take(self, block: Block, size: int) -> bool:
        """``max_split_size``: oversize blocks serve only requests of about their own size."""
        bound = self.max_split_size
        if bound is None or block.segment.small:
            return True
        if size < bound:
            return block.size < bound
        return block.size < size + LARGE_BUFFER

    def _new_segment(self, stream: ModelStream, small: bool, size: int, pool=None) -> Block | None:
        """``cudaMalloc`` a segment for ``size``; None if it does not fit the capacity."""
        nbytes = segment_size(size)
        if self.reserved_bytes + nbytes > self.capacity:
            return None
        segment = Segment(self._next_address, nbytes, stream, small, pool)
        self._next_address += nbytes
        self._segments.append(segment)
        self.reserved_bytes += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved_bytes)
        block = Block(segment.address, nbytes, segment, stream, state="free", ready=self.now)
        self._free.append(block)
        return block

    def _hand_out(self, block: Block, size: int, requested: int) -> Block:
        self._free.remove(block)
        remainder = block.size - size
        oversize = (
            self.max_split_size is not None
            and not block.segment.small
            and size >= self.max_split_size
        )
        if not oversize and (
            remainder > SMALL_REQUEST or (block.segment.small and remainder >= MIN_BLOCK)
        ):
            rest = Block(block.address + size, remainder, block.segment, block.stream, state="free")
            rest.ready, rest.prev, rest.next = block.ready, block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._free.append(rest)
        block.state, block.requested = "allocated", requested
        self.allocated_bytes += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated_bytes)
        self._note_hazards(block)
        return block

    def _make_free(self, block: Block) -> None:
        """The block becomes reusable: merge it with free neighbours of its segment."""
        block.state = "free"
        prev, nxt = block.prev, block.next
        if nxt is not None and nxt.state == "free":
            self._free.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
            block.ready = max(block.ready, nxt.ready)
        if prev is not None and prev.state == "free":
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            prev.ready = max(prev.ready, block.ready)
            return  # prev is cached already
        self._free.append(block)

    def _release_cached(self) -> tuple[float, list[str], int]:
        """synchronize_and_free_events + cudaFree of every wholly free segment.

        Returns (seconds waited, what was waited for, bytes released).
        """
        start, reasons = self.now, []
        if self._deferred:
            # Every outstanding event is synchronized, not only those of this request's stream.
            until = max(b.ready for b in self._deferred)
            reasons.append(
                f"{len(self._deferred)} deferred frees (record_stream events) until t={until:.6g}s"
            )
            self.now = max(self.now, until)
            self._process_events(self.now)
        whole = [
            b for b in self._free if b.prev is None and b.next is None and b.segment.pool is None
        ]
        for block in whole:
            self._free.remove(block)
            self._segments.remove(block.segment)
            block.state = "released"
            self.reserved_bytes -= block.size
        released = sum(b.size for b in whole)
        if whole:
            # cudaFree synchronizes the device: the host waits for all queued work.
            until = max([self.now] + [s.tail for s in self._sides])
            if until > self.now:
                reasons.append(f"cudaFree device synchronization until t={until:.6g}s")
            self.now = until
        return self.now - start, reasons, released

    def _stall(self, requested: int) -> None:
        start = self.now
        waited, reasons, released = self._release_cached()
        self.stalls.append(Stall(start, requested, waited, tuple(reasons), released))

    def _note_hazards(self, block: Block) -> None:
        self._unprotected = [u for u in self._unprotected if u[2] > self.now]
        for start, end, copy_end, stream in self._unprotected:
            overlap = min(end, block.end) - max(start, block.address)
            if overlap > 0:
                address = max(start, block.address)
                self.hazards.append(ReuseHazard(self.now, address, overlap, stream, copy_end))

    def __repr__(self) -> str:
        return (
            f"AllocatorModel(now={self.now:.6g}s, allocated={self.allocated_bytes}, "
            f"reserved={self.reserved_bytes}/{self.capacity}, stalls={len(self.stalls)})"
        )
