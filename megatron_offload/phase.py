"""The phase an attached optimizer is in, held in one place.

An attached optimizer is always in exactly one phase (the top of a stack: phases nest, a
chunked update streams inside a step):

============  ==========================================================================
``IDLE``      between steps: a read of the optimizer's states that finds them off the
              device brings them back first (``access/state.py``)
``MOVING``    the offloader moves states (offload, reload, wait, bringing them back, detach)
``STEPPING``  inside ``optimizer.step()`` of the automatic cycle: the step reads the state
              mapping itself, at full speed
``STREAMING`` inside a chunked update's calls: the states are in device slots; nothing may
              move them
``SERVING``   a ``HostView`` is open for a checkpoint method or a ``host_view()`` block: the
              released tensors are their host copies where the optimizer keeps them
``DETACHED``  the offloader was detached: a plain optimizer again
============  ==========================================================================

``PhaseTracker.enter(phase)`` / ``leave(token)`` (or ``within(phase)`` around a block) is the
one transition, and it has no consequence of its own: whoever needs to know the phase asks
``current`` (the state access, the update gate, the chunked update, sleep).
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator


class Phase(enum.Enum):
    IDLE = "idle"
    MOVING = "moving"
    STEPPING = "stepping"
    STREAMING = "streaming"
    SERVING = "serving"
    DETACHED = "detached"


class PhaseTracker:
    """Which phase the optimizer is in (the top of a stack of nested phases)."""

    def __init__(self) -> None:
        self._stack = [Phase.IDLE]
        #: The phase now (the top of the stack).
        self.current = Phase.IDLE

    @property
    def serving(self) -> bool:
        """True while a ``HostView`` is open (for a checkpoint method or ``host_view()``),
        whatever is nested in it."""
        return Phase.SERVING in self._stack

    @contextlib.contextmanager
    def within(self, phase: Phase) -> Iterator[None]:
        """The block runs in ``phase``; the phase before it is back after it, whatever
        happened."""
        token = self.enter(phase)
        try:
            yield
        finally:
            self.leave(token)

    def enter(self, phase: Phase) -> int:
        """Enter ``phase``; returns the token ``leave`` takes. Nothing is entered once
        detached."""
        stack = self._stack
        if stack[-1] is not Phase.DETACHED:
            stack.append(phase)
            self.current = phase
        return len(stack) - 1

    def leave(self, token: int) -> None:
        """Back to the phase before ``enter`` returned ``token`` (and everything entered
        since); once detached, the optimizer stays detached."""
        stack = self._stack
        if stack[-1] is not Phase.DETACHED:
            del stack[max(token, 1) :]
            self.current = stack[-1]

    def detached(self) -> None:
        """The end: a plain optimizer from now on."""
        self._stack = [Phase.DETACHED]
        self.current = Phase.DETACHED
