"""Undoing a chunked step that failed part-way.

The chunked update (``chunked.py``) runs the inner optimizer's step as several calls, each
over a subset of the parameters. A call, or a copy between two calls, may raise after other
calls already updated their parameters: an allocation for the optimizer's temporaries runs
out of memory, a copy fails, the optimizer replaces a state it must not. Without more, the
step would be half done: some parameters, their states and their scales updated, the others
not, and a retry would update the first ones twice.

``StepUndo`` keeps what is needed to put everything back. Before each call it copies to the
host every tensor the call may write (``save``): the parameters, the slot holding their
streamed states, and the tensors of their state that stay on the device (scalar steps,
scales, the internals of a quantized state). If the step fails, ``restore`` writes those
bytes back, newest first, into the parameters and device tensors and into the host copies
of the streamed states (which the slots' copy-back had already overwritten). Together with
the group steps (set back by the chunked update) and the states the step had created
(dropped by it), the optimizer is then byte for byte as before the step, and the step can
be retried.

Cost: one more device-to-host copy, per step, of the bytes the calls write (the streamed
states once more, and the parameters), and one pinned host buffer as large, pinned when the
chunked update is attached (``reserve``), kept from step to step and counted in
``host_memory_budget`` and ``stats()["host_bytes"]``. Opt-in, for that cost
(``OffloadConfig.chunked_update_undo=True``); without it a failed step keeps the update of the
calls that ran.

Ordering (rule numbers as in ``engine/engine.py``):

- the copy to the host waits for the current stream, where earlier calls wrote (rule 1:
  ``D2H_AFTER_WRITERS``), and a slot's copy for the H2D that filled it (``USE_AFTER_H2D``);
  a chunk's copies are issued with its prefetch, so they overlap the update of the chunk
  before it;
- the call writes those tensors only after that copy read them (``WRITE_AFTER_D2H``);
- the journal is rewritten by the next step's copies on the same side stream, so in stream
  order after this step's; the host reads it (``restore``) and frees it only after every
  copy into it completed (rule 5).
"""

from __future__ import annotations

import torch

from .host import HostBuffers
from .labels import (
    D2H_AFTER_WRITERS,
    HOST_FREE_AFTER_COPIES,
    HOST_READ_AFTER_D2H,
    USE_AFTER_H2D,
    WRITE_AFTER_D2H,
)
from .pieces import aligned_size, typed_view


class StepUndo:
    """Host copies of what each call of a chunked step writes, to undo the step if it fails.

    Args:
        engine: the engine of the chunked update (its device, D2H side stream and host
            memory budget are used).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.device = engine.device
        # The journal: pinned host buffers, carved in order, reused from step to step.
        self._journal = HostBuffers(
            engine.device,
            budget=engine.budget,
            name=f"{engine.name} (chunked update's undo copies)",
        )
        self._entries: list[tuple] = []  # (target, saved copy, target is host memory)
        self._last_event = None  # the newest copy into the journal
        self.peak_bytes = 0  # most bytes one step saved

    @property
    def nbytes(self) -> int:
        """Host bytes the journal holds."""
        return self._journal.nbytes

    # ------------------------------------------------------------------ step
    def begin(self) -> None:
        """Start a step: nothing saved yet. Buffers of earlier steps are reused; several are
        merged into one as large as the largest step needed, once their copies are done."""
        self._entries = []
        if self._journal.count > 1:
            # Several buffers (the first steps outgrew the reservation) become one as large
            # as the largest step, once the copies into them are done (rule 5). Otherwise the
            # next step's copies rewrite the journal in stream order after this step's.
            self._wait_for_copies()
            self._journal.rewind(merge_to=self.peak_bytes)
        else:
            self._journal.rewind()

    def reserve(self, nbytes: int) -> None:
        """Hold at least ``nbytes`` in one buffer before the first step saves anything (an
        estimate; a step that needs more allocates more)."""
        self._journal.reserve(nbytes)

    def save(self, pairs, *, after=None, order_current: bool = True):
        """Copy each ``(source, target)`` to the host before it is written: ``source`` is read
        on the device, ``restore`` writes its bytes into ``target`` (``source`` itself, or the
        host copy of a streamed state held in a slot).

        ``after``: an event the copies also wait for (the H2D filling a slot).
        ``order_current``: the current stream waits for the copies at once; otherwise the
        caller orders the writer after the returned event (None if nothing was queued).
        """
        device = self.device
        pairs = _coalesced(pairs, device.torch_device)
        current = device.current_stream()
        side = self.engine.side_stream("d2h")
        queued = False
        event = None
        # Rule 1: the copy reads what the current stream wrote (earlier calls, the reload).
        device.wait_stream(side, current, label=D2H_AFTER_WRITERS)
        if after is not None:
            # Rules 3 and 4: ... and what the H2D wrote into the slot.
            device.wait_event(side, after, label=USE_AFTER_H2D)
        try:
            with device.use_stream(side), torch.no_grad():
                for source, target in pairs:
                    if source.device != device.torch_device:
                        # Kept beside the device (torch Adam's step counts live on the CPU).
                        self._entries.append((target, source.detach().clone(), True))
                        continue
                    nbytes = aligned_size(source.numel() * source.element_size())
                    # A step larger than the buffers so far (the first steps): one more,
                    # at least as large as all before it, or what the largest step needed.
                    view, _ = self._journal.take(nbytes, hint=self.peak_bytes - self.nbytes)
                    saved = typed_view(view, source)
                    device.copy(saved, source)
                    queued = True
                    on_host = (
                        isinstance(target, torch.Tensor)
                        and target.device.type == "cpu"
                        and target is not source
                    )
                    self._entries.append((target, saved, on_host))
        finally:
            if queued:
                # Even when a copy raised: the copies queued before it still run.
                event = self._last_event = device.record_event(side)
                if order_current:
                    # The call rewrites these tensors: only after the copies read them.
                    device.wait_event(current, event, label=WRITE_AFTER_D2H)
        self.peak_bytes = max(self.peak_bytes, self._journal.carved)
        return event

    def restore(self) -> None:
        """Write every saved copy back, newest first: the step's writes are undone.

        Called after the step failed and the chunked update's copies were ordered (the slot
        stream's ``run`` returned or raised): every copy queued so far is waited for, since
        the host copies of streamed states are rewritten by the host here.
        """
        device = self.device
        entries, self._entries = self._entries, []
        if not entries:
            return
        # Rule 5: the host reads the journal and rewrites host copies that the slots' copies
        # wrote or read: every queued copy must be done.
        device.synchronize()
        if self._last_event is not None:
            device.synchronize_event(self._last_event, label=HOST_READ_AFTER_D2H)
        current = device.current_stream()
        with torch.no_grad():
            for target, saved, on_host in reversed(entries):
                if on_host:
                    target.copy_(saved)
                else:
                    if isinstance(target, _Bytes):
                        target = target.view()
                    with device.use_stream(current):
                        device.copy(target, saved)
        # The journal is rewritten (next step) or freed only once the copies reading it ran.
        device.synchronize_event(device.record_event(current), label=HOST_FREE_AFTER_COPIES)

    def close(self) -> None:
        """Give back the host memory (every copy into it is waited for first)."""
        self._entries = []
        self._wait_for_copies()
        self._journal.free()

    def _wait_for_copies(self) -> None:
        if self._last_event is not None:
            # Rule 5: no copy may still write a buffer given back or rewritten by the host.
            self.device.synchronize_event(self._last_event, label=HOST_FREE_AFTER_COPIES)
            self._last_event = None


#: Neighbouring tensors of one storage are saved with one copy when at most this many bytes
#: lie between them (the 16-byte alignment padding of the engine's pieces, in which the
#: master weights it offloads live): one copy per buffer, not per parameter.
MERGE_GAP_BYTES = 64


def _coalesced(pairs, torch_device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pairs`` with the device tensors saved in place (``target is source``, contiguous)
    merged into one byte range per run of neighbours in a storage.

    Bytes between two merged tensors are saved and written back too. That is safe: a failed
    step writes back everything it saved, newest first, so those bytes end as they were
    before the step, whoever they belong to.
    """
    out, runs = [], {}
    for source, target in pairs:
        if target is source and source.device == torch_device and source.is_contiguous():
            start = source.storage_offset() * source.element_size()
            runs.setdefault(source.untyped_storage().data_ptr(), (source, []))[1].append(
                (start, start + source.numel() * source.element_size())
            )
        else:
            out.append((source, target))
    for anchor, ranges in runs.values():
        ranges.sort()
        merged = [list(ranges[0])]
        for start, end in ranges[1:]:
            if start - merged[-1][1] <= MERGE_GAP_BYTES:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            where = _Bytes(anchor, start, end)
            out.append((where.view(), where))
    return out


class _Bytes:
    """Bytes ``start:end`` of the storage of ``anchor``, a tensor the optimizer holds anyway.

    Only a view made when the bytes are read or written: a view kept alive would count as one
    more user of the storage, and the engine reads that count to decide how it frees it.
    """

    __slots__ = ("anchor", "start", "end")

    def __init__(self, anchor: torch.Tensor, start: int, end: int) -> None:
        self.anchor, self.start, self.end = anchor, start, end

    def view(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=self.anchor.device).set_(
            self.anchor.untyped_storage(), self.start, (self.end - self.start,), (1,)
        )
