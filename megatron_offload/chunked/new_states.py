"""The states a chunked step creates (the first step, where Adam makes them): each parameter
is updated on its own, and its new states are copied to the host and freed right after, so
even the first step never holds more than one parameter's states beyond the slots.

They go into one host staging buffer for the whole step (``engine.HostBuffers``, counted
against ``host_memory_budget``; a few more only where the states' size is not known in
advance), never a buffer per tensor; the engine adopts them (``engine.adopted``) and the
next layout moves their bytes into its arena.
"""

from __future__ import annotations

from ..adapters.megatron_wrappers import state_kinds
from ..engine import HostBuffers, OffloadEngine, SlotSizeError, SlotStream
from ..engine.slots import aligned_bytes
from .plan import planned


class NewStates:
    """The staging of one chunked step's new states.

    Args:
        engine: the engine that adopts them.
        inner: the inner optimizer making them.
        kinds: which kinds are offloaded (``OPTIMIZER_STATES``, ``MASTER_WEIGHTS``).
        stream: the slots (a parameter's states must fit one).
        params: the parameters whose states this step creates, in update order.
        undone: a failed step is undone (``chunked_update_undo``), so a late refusal may say
            the step can be retried.
    """

    def __init__(
        self,
        engine: OffloadEngine,
        inner,
        kinds,
        stream: SlotStream,
        params: list,
        *,
        undone: bool,
    ) -> None:
        self.engine, self.inner, self.kinds, self.stream = engine, inner, kinds, stream
        self.undone = undone
        #: The bytes each parameter's states will take, where the optimizer tells in advance.
        self.expected = [planned(inner, param, kinds)[0] for param in params]
        self._remaining = [sum(self.expected[i:]) for i in range(len(self.expected))]
        name = f"{engine.name}: staging"
        #: The host memory they go to.
        self.staging = HostBuffers(engine.device, budget=engine.budget, name=name)

    def to_host(self, index: int, param) -> None:
        """Copy the states just created for ``param`` (the ``index``-th) to the staging
        buffer and free their device memory."""
        engine = self.engine
        entries = self.inner.state.get(param) or {}
        moving = [
            tensor
            for kind, tensor in state_kinds(param, entries)
            if kind in self.kinds and engine.stageable(tensor)
        ]
        size = sum(aligned_bytes(t) for t in moving)  # as the slots will hold them
        if size > self.stream.slot_bytes:
            # Reached only with an optimizer whose state sizes cannot be known before its first
            # step (not torch's, apex's or TE's Adam: those were checked before any update), so
            # the parameters updated earlier in this step keep their update: say so.
            raise SlotSizeError(
                f"{engine.name}: the states of parameter {tuple(param.shape)} take {size:,} bytes, "
                f"more than one slot of the chunked update ({self.stream.slot_bytes:,} bytes), which "
                f"this optimizer's configuration did not tell before its first step"
                + (
                    ""
                    if self.undone
                    else "; parameters updated earlier in this step keep "
                    "their update, so do not retry this step"
                )
                + f". Give the chunked update at least {self.stream.budget_for(size):,} bytes "
                "(chunked_update_bytes), or leave it unset."
            )
        if not moving:
            return
        try:
            # The bytes the states still to come will take: one buffer for them all.
            engine.adopted.stage_out(moving, self.staging, hint=self._remaining[index])
        except BaseException:
            # The states stay on the device, in the optimizer; staging memory no state lives
            # in goes back (stage_out waited for the copies into it). Memory that earlier
            # parameters' states use stays: the engine gives it back with them.
            self.staging.free()
            raise
