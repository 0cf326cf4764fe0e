"""``UpdateGate``: what every update of a served optimizer passes first.

megatron-core steps an optimizer through the wrapper's ``step()``, its
``step_with_ready_grads()`` or the inner optimizer's own ``step()`` (megatron-core's own Lion
test does; so may a framework), and each runs the inner optimizer's step, so one step
pre-hook there (``torch.optim``'s ``register_step_pre_hook``) sees every update, with attach's
cycle or without it. Inside a host view the update is refused before anything is written (the
states are their host copies there); a sleeping model wakes (the step writes the parameters);
everything comes back but what a chunked update streams, the copy-back is ordered before the
update (rule 4 of the copy protocol), and the host copies go stale.
"""

from __future__ import annotations

import functools
from typing import Sequence

from ..errors import OffloadStateError
from ..interceptions import Interceptions
from ..phase import Phase, PhaseTracker
from .members import Member
from .sleep import Sleep


class UpdateGate:
    """The step pre-hook of every served inner optimizer; ``remove`` takes them away.

    Args:
        phase: the offloader's phase.
        members: the served optimizers (each with its engine).
        sleep: the offloader's sleep, woken before an update.
        interceptions: the offloader's interceptions, which install the hooks.
    """

    def __init__(
        self,
        phase: PhaseTracker,
        members: Sequence[Member],
        sleep: Sleep,
        interceptions: Interceptions,
    ) -> None:
        self._phase, self._members, self._sleep = phase, members, sleep
        #: The chunked update of each member, in order (attach's cycle sets them), or none.
        self.chunked: list = []
        self._handles = []
        try:
            for index, member in enumerate(members):
                inner = member.optimizer.optimizer
                self._handles.append(
                    interceptions.hook(
                        inner.register_step_pre_hook(functools.partial(self.before_update, index)),
                        where=f"{type(inner).__name__}.step (step pre-hook)",
                        why="every update, whichever entry steps it: the states come back and "
                        "are waited for, a sleeping model wakes, a host view refuses",
                    )
                )
        except BaseException:
            self.remove()  # all or nothing
            raise

    def before_update(self, index: int, optimizer, args, kwargs) -> None:
        """The ``index``-th member's inner optimizer is about to update."""
        phase = self._phase
        if phase.current is Phase.SERVING:
            raise OffloadStateError(
                "an optimizer step inside host_view() (or inside a checkpoint method): the "
                "states are their host copies there and the update would compute on them. "
                "Step after the block."
            )
        sleep = self._sleep
        if sleep.asleep or sleep.gradients_dropped:
            sleep.wake()  # the parameters and gradients the step writes come back
        streaming = bool(self.chunked) and phase.current in (Phase.STEPPING, Phase.STREAMING)
        engine = self._members[index].engine
        token = phase.enter(Phase.MOVING)
        try:
            # Nothing to copy if the step prefetched; else nobody did (a step called on the
            # inner optimizer directly, or without attach's cycle).
            engine.reload(streamed=not streaming)
            # Rule 4: the update must not start before the copy-back of what it reads.
            engine.wait()
            engine.mark_dirty()
        finally:
            phase.leave(token)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.chunked = []
