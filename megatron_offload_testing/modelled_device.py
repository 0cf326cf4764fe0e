"""A checked device whose memory and stream calls are mirrored into an allocator model.

``CheckedDevice`` answers "is every copy ordered"; the ``AllocatorModel`` it drives here
answers "when is freed device memory reusable, and does anything stall" for the same run,
with real (CPU) tensors. Mirroring, call by call:

- ``empty`` / ``regrow`` -> ``model.malloc`` on the current stream; the storage is mapped to
  its block (by storage ``_cdata``, held weakly). ``release`` -> ``model.free``.
- Device memory the model has not seen (tensors the optimizer made itself) is adopted at
  first sight (a copy, ``record_stream`` or ``release``): allocated on the compute stream
  then, as if it had been allocated there before.
- A storage that dies (garbage collected) is freed in the model at the next device call (or
  ``settle``), and so is one that only the checked device still keeps for queued copies
  announced with ``record_stream``.
- ``record_stream`` -> ``model.record_stream``, unless ``skip_labels`` drops it.
- ``copy`` -> ``model.copy``: d2h when the destination is a host buffer, h2d otherwise; on
  the compute stream it advances the clock by the compute-copy time.
- ``new_stream``, ``record_event``, ``wait_event``, ``wait_stream``, ``synchronize_event`` and
  ``synchronize`` are mirrored (a wait dropped by ``skip_labels`` orders nothing in the
  model either). Kernels are modelled by ``device.model.compute(seconds)``.
- Reuse before the copy (rule 2): when the model hands out memory of a block that was freed
  while a copy on a stream not announced by ``record_stream`` still used it, and that copy
  has not ended in modelled time, a violation of kind ``reuse-before-copy`` is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_offload.device.allocator import splittable_piece_bytes

from .allocator_model import AllocatorModel, Block, ModelEvent, ModelStream
from .checked_device import CheckedDevice, _Event, _Stream

REUSE_BEFORE_COPY = "reuse-before-copy"  # rule 2


@dataclass(frozen=True, eq=False)
class _ModelledEvent(_Event):
    """A checked-device event that also carries the model's event."""

    modelled: ModelEvent | None = None


class _Owned:
    """The model block behind one storage; the storage is held weakly."""

    __slots__ = ("weak", "block")

    def __init__(self, storage: torch.UntypedStorage, block: Block | None) -> None:
        self.weak = StorageWeakRef(storage)
        self.block = block


class ModelledDevice(CheckedDevice):
    """A ``CheckedDevice`` mirrored into an ``AllocatorModel`` (see the module doc).

    Args:
        model: the allocator model to drive; None builds one from ``model_args``
            (``capacity``, ``d2h_bandwidth``, ``h2d_bandwidth``, ``compute_copy_bandwidth``).
        skip_labels, raise_violations: as for ``CheckedDevice``.
        scale: every byte count the model sees is ``scale`` times the real tensors' (an
            allocation, a copy): a run on small CPU tensors stands for the same run on
            ``scale`` times larger ones, whose allocator behaviour and copy times the model
            then gives. 1: the real sizes.
    """

    def __init__(
        self,
        model: AllocatorModel | None = None,
        *,
        skip_labels: Iterable[str] = (),
        raise_violations: bool = True,
        scale: int = 1,
        **model_args,
    ) -> None:
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
            raise ValueError(f"scale must be an int >= 1, got {scale!r}")
        self.scale = scale
        super().__init__(skip_labels=skip_labels, raise_violations=raise_violations)
        if model is None:
            model = AllocatorModel(**model_args)
        elif model_args:
            raise TypeError(f"pass either a model or its arguments, not both: {sorted(model_args)}")
        self.model = model
        self._streams_of: dict[_Stream, ModelStream] = {
            super().current_stream(): model.compute_stream
        }
        self._owned: dict[int, _Owned] = {}
        self._hazards_seen = 0

    # ------------------------------------------------------------------ memory
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._reap()
        tensor = super().empty(numel, dtype)
        self._allocate(tensor.untyped_storage(), numel * tensor.element_size() * self.scale)
        return tensor

    def regrow(self, tensor: torch.Tensor, nbytes: int) -> None:
        self._reap()
        owned = self._owned.get(tensor.untyped_storage()._cdata)
        old = owned.block if owned is not None else None
        super().regrow(tensor, nbytes)
        # Growing a live storage allocates the new memory before the old one is freed.
        self._allocate(tensor.untyped_storage(), nbytes * self.scale)
        if old is not None and old.state == "allocated":
            self.model.free(old)

    def release(self, tensor: torch.Tensor) -> None:
        self._reap()
        block = self._block(tensor)
        super().release(tensor)
        if block is not None:
            self.model.free(block)
            self._owned[tensor.untyped_storage()._cdata].block = None

    @property
    def frees_wait_for_copies(self) -> bool:
        return self.model.backend == "cudaMallocAsync"

    def piece_bound(self) -> int | None:
        # The model's max_split_size, as the accelerator reads it from PYTORCH_CUDA_ALLOC_CONF
        # (in real bytes: the model sees ``scale`` times each).
        if self.model.max_split_size is None or self.model.backend != "native":
            return None
        return splittable_piece_bytes(self.model.max_split_size) // self.scale

    def memory_allocated(self) -> int:
        return self.model.allocated_bytes

    def settle(self) -> None:
        """Free in the model what died since the last device call (a real allocator frees a
        block when its last tensor goes): call it before allocating on the model directly."""
        self._reap()

    def adopt(self, *tensors: torch.Tensor) -> None:
        """Tell the model about device memory allocated outside this device (now, on the
        compute stream), e.g. optimizer states, before anything else touches it."""
        self._reap()
        for tensor in tensors:
            self._block(tensor)

    # ----------------------------------------------------------------- streams
    def compute_stream(self) -> _Stream:
        stream = super().compute_stream()
        self._streams_of[stream] = self.model.new_stream(name=stream.name)
        return stream

    def new_stream(self) -> _Stream:
        stream = super().new_stream()
        self._streams_of[stream] = self.model.new_stream(name=stream.name)
        return stream

    def record_event(self, stream: _Stream, *, timing: bool = False) -> _ModelledEvent:
        event = super().record_event(stream)
        return _ModelledEvent(
            event.stream, event.vector, self.model.record_event(self._streams_of[stream])
        )

    def elapsed_ms(self, start: _ModelledEvent, end: _ModelledEvent) -> float | None:
        """Modelled milliseconds, once the modelled clock has reached ``end``."""
        if end.modelled is None or start.modelled is None or end.modelled.time > self.model.now:
            return None
        return (end.modelled.time - start.modelled.time) * 1e3

    def wait_stream(self, waiter: _Stream, waitee: _Stream, *, label: str = "") -> None:
        self._reap()
        super().wait_stream(waiter, waitee, label=label)
        if label not in self.skip_labels:  # a dropped wait orders nothing in the model either
            self.model.wait_stream(self._streams_of[waiter], self._streams_of[waitee])

    def wait_event(self, stream: _Stream, event: _Event, *, label: str = "") -> None:
        self._reap()
        super().wait_event(stream, event, label=label)
        modelled = getattr(event, "modelled", None)
        if label not in self.skip_labels and modelled is not None:
            self.model.wait_event(self._streams_of[stream], modelled)

    def synchronize_event(self, event: _Event, *, label: str = "") -> None:
        self._reap()
        super().synchronize_event(event, label=label)
        modelled = getattr(event, "modelled", None)
        if label not in self.skip_labels and modelled is not None:
            self.model.synchronize_event(modelled)

    def synchronize(self) -> None:
        self._reap()
        super().synchronize()
        self.model.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: _Stream, *, label: str = "") -> None:
        self._reap()
        super().record_stream(tensor, stream, label=label)
        if label in self.skip_labels:
            return  # dropped: the allocator never hears of this stream (a negative control)
        block = self._block(tensor)
        if block is not None:
            self.model.record_stream(block, self._streams_of[stream])

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._reap()
        to_host = self._is_host(dst)
        blocks = [b for b in (self._block(t) for t in (dst, src)) if b is not None]
        super().copy(dst, src)
        stream = self._streams_of[self.current_stream()]
        nbytes = src.numel() * src.element_size() * self.scale
        self.model.copy(stream, nbytes, "d2h" if to_host else "h2d", uses=blocks)

    # ----------------------------------------------------------------- helpers
    def _is_host(self, tensor: torch.Tensor) -> bool:
        mem = self._memories.get(tensor.untyped_storage()._cdata)
        return mem is not None and mem.host and mem.alive()

    def _block(self, tensor: torch.Tensor) -> Block | None:
        """The model block of ``tensor``'s device memory, adopting memory not seen before."""
        if self._is_host(tensor):
            return None
        storage = tensor.untyped_storage()
        owned = self._owned.get(storage._cdata)
        if owned is not None and owned.block is not None:
            return owned.block
        if storage.nbytes() == 0:
            return None
        # Memory the optimizer made itself: it lives on the compute stream (adopted now).
        block = self.model.malloc(storage.nbytes() * self.scale, self.model.compute_stream)
        self._own(storage, block)
        return block

    def _allocate(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``model.malloc`` on the current stream for ``storage``, reporting early reuse."""
        block = self.model.malloc(nbytes, self._streams_of[self.current_stream()])
        self._own(storage, block)
        self._report_hazards()

    def _held_for_copies(self) -> dict[int, int]:
        """Storage key -> references the checked device keeps for queued recorded copies."""
        held: dict[int, int] = {}
        for op in self._pending():
            for ref in (op.dst, op.src):
                if ref.keep is not None:
                    key = ref.keep.untyped_storage()._cdata
                    held[key] = held.get(key, 0) + 1
        return held

    def _report_hazards(self) -> None:
        """Report the model's reuse hazards not reported yet: those of this device's own
        allocations, and those of allocations made on the model directly (a modelled
        workload such as a forward pass's activations), at the next device call."""
        new, self._hazards_seen = self.model.hazards[self._hazards_seen :], len(self.model.hazards)
        for hazard in new:
            self._violation(
                2,
                REUSE_BEFORE_COPY,
                f"{hazard.nbytes} bytes of device memory are handed out again at "
                f"t={hazard.time:.6g}s while a copy on {hazard.stream} that used them runs "
                f"until t={hazard.copy_end:.6g}s: record_stream did not announce that stream, "
                "so the allocator reused the block at once",
            )

    def _own(self, storage: torch.UntypedStorage, block: Block) -> None:
        key = storage._cdata
        owned = self._owned.get(key)
        if owned is None or owned.weak.expired():
            self._owned[key] = _Owned(storage, block)
        else:
            owned.block = block

    def _reap(self) -> None:
        """Free in the model the memory of storages that died since the last device call,
        and report reuse hazards the model noted since then."""
        self._report_hazards()
        # Memory kept alive only for queued copies announced with record_stream (the checked
        # device holds it until the copy runs) is freed by its owner already: a real
        # allocator frees the block when the last tensor goes, deferred for those streams.
        held = self._held_for_copies()
        for key, owned in self._owned.items():
            if held.get(key) and owned.block is not None and owned.block.state == "allocated":
                # One use beyond the tensors: the storage's own Python object (as in
                # ``engine.pieces.storage_use_count``).
                if not owned.weak.expired() and torch._C._storage_Use_Count(key) <= held[key] + 1:
                    self.model.free(owned.block)
                    owned.block = None
        dead = [key for key, owned in self._owned.items() if owned.weak.expired()]
        for key in dead:
            owned = self._owned.pop(key)
            if owned.block is not None and owned.block.state == "allocated":
                # The storage's last reference went: the caching allocator frees the block
                # now, deferred for the streams record_stream announced.
                self.model.free(owned.block)

    def __repr__(self) -> str:
        skip = f", skip_labels={sorted(self.skip_labels)}" if self.skip_labels else ""
        return f"ModelledDevice(cpu, {self.model!r}{skip})"
