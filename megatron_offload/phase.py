"""The phase the optimizer is in, held in one place, and the state mapping it guards.

An attached optimizer is always in exactly one phase (the top of a stack: phases nest, a
chunked update streams inside a step):

============  ==========================================================================
``IDLE``      between steps: a read of the inner optimizer's ``state`` mapping is guarded
              (served from the host copy, or the states come back) while some state is not
              on the device
``MOVING``    the offloader moves states (offload, reload, wait, ``resident``, detach)
``STEPPING``  inside ``optimizer.step()`` of the automatic cycle: the step reads the
              mapping itself, unguarded, at full speed
``STREAMING`` inside a chunked update's calls: the states are in device slots; nothing may
              move them
``SERVING``   a ``HostView`` is open for a checkpoint method or a ``host_view()`` block: the
              released tensors are their host copies where the optimizer keeps them
``READING``   reads of the mapping between steps are served from a ``HostView``, until the
              next transition (whatever it is) closes it
``DETACHED``  the offloader was detached: a plain optimizer again
============  ==========================================================================

``PhaseTracker.enter(phase)`` / ``leave(token)`` (or ``within(phase)`` around a block) is the
one transition: it closes a ``READING`` view first, and on entry and exit arms or disarms
every guarded mapping, which is guarded exactly in ``IDLE`` while some state of the served
engines is not on the device with no copy pending. Nothing else arms the guard or ends the
reads.

``GuardedState`` is the inner optimizer's ``state`` while an offloader is attached: a
``defaultdict`` whose accessors check one attribute (``armed``: the tracker while guarded,
None otherwise). The check costs the step one Python call per state lookup (about 0.6 us;
measured against a plain ``defaultdict`` in ``tests/integration/access/test_state_mapping.py``);
the class of the mapping never changes. Not guarded, because they touch no tensor:
``len(state)`` and ``p in state`` (tensors hash by identity, and a dict compares keys by
identity before equality, so a lookup reads no tensor data).

``UpdateGate`` is what every update of a served optimizer passes first, whichever entry point
steps it: megatron-core steps through the wrapper's ``step()``, its ``step_with_ready_grads()``
or the inner optimizer's own ``step()`` (megatron-core's own Lion test does; so may a
framework), and each runs the inner optimizer's step, so one step pre-hook there
(``torch.optim``'s ``register_step_pre_hook``) sees every update, with attach's cycle or
without it. Inside a host view the update is refused before anything is written (the states
are their host copies there); a sleeping model wakes (the step writes the parameters); reads
served between steps end (a transition: what they wrote is in the host copy), everything comes
back but what a chunked update streams, the copy-back is ordered before the update (rule 4 of
the copy protocol), and the host copies go stale.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
from typing import Callable, Iterator, NamedTuple, Sequence

from .engine.pieces import Place
from .errors import OffloadStateError


class Phase(enum.Enum):
    IDLE = "idle"
    MOVING = "moving"
    STEPPING = "stepping"
    STREAMING = "streaming"
    SERVING = "serving"
    READING = "reading"
    DETACHED = "detached"


class PhaseTracker:
    """Which phase the optimizer is in, and the consequences of a change: the guard's arming
    and the end of reads between steps.

    Args:
        on_access: ``on_access(mapping, writes, accessor)`` for an access to an armed
            mapping (the guard serves it from the host copy or brings the states back).
        before_arming: called before the mappings are armed (the guard puts a guarded
            mapping back in place of one a load replaced behind its back).
    """

    def __init__(
        self,
        *,
        on_access: Callable[["GuardedState", bool, str], None],
        before_arming: Callable[[], None] = lambda: None,
    ) -> None:
        self._stack = [Phase.IDLE]
        #: The phase now (the top of the stack).
        self.current = Phase.IDLE
        self._views: list = []  # the HostView of each SERVING or READING entry, in order
        self._mappings: list[GuardedState] = []
        self._holders: list = []  # the optimizers whose ``state`` the mappings are
        self._engines: Sequence = ()  # whose states the guard protects
        self._on_access = on_access
        self._before_arming = before_arming
        #: True while the mappings are armed: ``IDLE`` with some state off the device.
        self.guarded = False

    @property
    def view(self):
        """The innermost open ``HostView`` (a ``SERVING`` block's, or the current
        ``READING``'s: any transition closes that), or None."""
        return self._views[-1] if self._views else None

    @property
    def serving(self) -> bool:
        """True while a ``HostView`` is open for a checkpoint method or a ``host_view()``
        block (reads between steps are not: any transition closes them)."""
        return Phase.SERVING in self._stack

    # --------------------------------------------------------------- transitions
    @contextlib.contextmanager
    def within(self, phase: Phase, view=None) -> Iterator[None]:
        """The block runs in ``phase`` (``view``: the HostView of a ``SERVING`` block); the
        phase before it is back after it, whatever happened."""
        token = self.enter(phase, view)
        try:
            yield
        finally:
            self.leave(token)

    def enter(self, phase: Phase, view=None) -> int:
        """Enter ``phase`` (``view``: the HostView of a ``SERVING`` block); returns the token
        ``leave`` takes."""
        stack = self._stack
        if stack[-1] is Phase.DETACHED:
            return len(stack)
        if stack[-1] is Phase.READING:
            self._close_reading()
        stack.append(phase)
        if phase in (Phase.SERVING, Phase.READING):
            self._views.append(view)
        self._settle()
        return len(self._stack) - 1

    def leave(self, token: int) -> None:
        """Back to the phase before ``enter`` returned ``token`` (closing reads opened since)."""
        while len(self._stack) > token and len(self._stack) > 1:
            phase = self._stack[-1]
            if phase is Phase.DETACHED:
                return
            if phase is Phase.READING:
                self._close_reading()
                continue
            self._stack.pop()
            if phase is Phase.SERVING:
                self._views.pop()
        self._settle()

    def read(self, view) -> None:
        """Reads between steps are served by ``view`` (entered already) until the next
        transition, which closes it (``view.close()``)."""
        self._stack.append(Phase.READING)
        self._views.append(view)
        self._settle()

    def detached(self) -> None:
        """The end: reads closed, nothing guarded any more."""
        self._close_reading()
        self._stack = [Phase.DETACHED]
        self.settle()

    def settle(self) -> None:
        """Arm or disarm the mappings for the current phase after the places changed
        without a transition (a layout the engine rebuilt by itself)."""
        self._settle()

    def _close_reading(self) -> None:
        while self._stack[-1] is Phase.READING:
            self._stack.pop()
            view = self._views.pop()
            view.close()  # what the reader wrote is in the host copy

    def _settle(self) -> None:
        guarded = self._stack[-1] is Phase.IDLE and any(
            piece.place is not Place.RESIDENT
            for engine in self._engines
            for piece in engine.copies.pieces
        )
        self.current = self._stack[-1]
        if (
            guarded
            and not self.guarded
            and any(
                getattr(holder, "state", None) is not mapping
                for holder, mapping in zip(self._holders, self._mappings)
            )
        ):
            self._before_arming()  # a load replaced a mapping behind the guard's back
        self.guarded = guarded
        armed = self if guarded else None
        for mapping in self._mappings:
            mapping.armed = armed

    # ------------------------------------------------------------------ the mappings
    def serve(self, engines: Sequence) -> None:
        """The engines whose states the guard protects."""
        self._engines = tuple(engines)

    def guard(self, holders: list, mappings: list["GuardedState"]) -> None:
        """``mappings`` (the ``state`` of each of ``holders``, the inner optimizers) are armed
        while guarded, replacing the ones before; when one is no longer its holder's state,
        ``before_arming`` is called before arming."""
        for mapping in self._mappings:
            if all(mapping is not m for m in mappings):
                mapping.armed = None
        self._holders, self._mappings = list(holders), list(mappings)
        for mapping in self._mappings:
            mapping.armed = self if self.guarded else None

    def accessed(self, mapping: "GuardedState", writes: bool, name: str) -> None:
        """An armed mapping was accessed (accessor ``name``): disarmed first, so that
        nothing the handler does comes back here, then handled, then settled again."""
        mapping.armed = None
        if self._stack[-1] is Phase.DETACHED:
            return
        try:
            self._on_access(mapping, writes, name)
        finally:
            self._settle()


class UpdateGate:
    """The step pre-hook of every served inner optimizer; ``remove`` takes them away.

    Args:
        phase: the offloader's phase.
        members: the served optimizers (``Member``: optimizer, engine).
        sleep: the offloader's ``Sleep`` (woken before an update).
        interceptions: the offloader's ``Interceptions``, which installs the hooks.
    """

    def __init__(self, phase: "PhaseTracker", members: Sequence, sleep, interceptions) -> None:
        self._phase, self._members, self._sleep = phase, members, sleep
        #: The chunked update of each member, in order (attach's cycle sets them), or none.
        self.chunked: list = []
        self._handles = []
        try:
            for index, member in enumerate(members):
                inner = member.optimizer.optimizer
                hook = functools.partial(self.before_update, index)
                self._handles.append(
                    interceptions.hook(
                        inner.register_step_pre_hook(hook),
                        where=f"{type(inner).__name__}.step (step pre-hook)",
                        why="every update, whichever entry steps it: reads served between steps "
                        "end, the states come back and are waited for, a host view refuses",
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


class _PlainState(collections.defaultdict):
    """What a ``GuardedState`` is to its readers: a ``defaultdict`` that copies, pickles and
    prints as one (the accessors below wrap these)."""

    def __reduce__(self):
        return (
            collections.defaultdict,
            (self.default_factory,),
            None,
            None,
            iter(dict.items(self)),
        )

    def copy(self):
        return collections.defaultdict(self.default_factory, dict.items(self))

    __copy__ = copy

    def __or__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        merged = collections.defaultdict(self.default_factory, other)
        merged.update(dict.items(self))
        return merged

    def __repr__(self) -> str:
        return repr(self.copy())  # printed as the defaultdict it stands for


class GuardedState(_PlainState):
    """An inner optimizer's ``state`` while an offloader is attached (see the module's
    docstring). ``owner``: the guard that installed it (None once given back)."""

    armed = None  # the PhaseTracker while armed (set on the instance by the tracker)
    owner = None


class Accessor(NamedTuple):
    """What one accessor of an armed mapping does, for the guard (``access/guard.py``)."""

    writes: bool  # it may put new tensors into the state
    served: bool  # a read or write the host copy can serve (else every state comes back)
    keys: bool  # it hands out the mapping's keys: the masters of a bf16/fp16 model


# Every accessor of an armed mapping: everything that hands out entries, keys (the parameter
# shards: the offloaded master weights of a bf16/fp16 model) or values, or compares, prints,
# copies or pickles them. Those that print, copy or pickle the whole mapping with its keys
# are not served: every state comes back for them.
ACCESSORS = {
    "__getitem__": Accessor(writes=False, served=True, keys=False),
    "get": Accessor(writes=False, served=True, keys=False),
    "keys": Accessor(writes=False, served=True, keys=True),
    "values": Accessor(writes=False, served=True, keys=False),
    "items": Accessor(writes=False, served=True, keys=True),
    "__iter__": Accessor(writes=False, served=True, keys=True),
    "__reversed__": Accessor(writes=False, served=True, keys=True),
    "__eq__": Accessor(writes=False, served=True, keys=False),
    "__ne__": Accessor(writes=False, served=True, keys=False),
    "__or__": Accessor(writes=False, served=False, keys=False),
    "__ror__": Accessor(writes=False, served=False, keys=False),
    "__repr__": Accessor(writes=False, served=False, keys=False),
    "copy": Accessor(writes=False, served=False, keys=False),
    "__copy__": Accessor(writes=False, served=False, keys=False),
    "__reduce__": Accessor(writes=False, served=False, keys=False),
    "__setitem__": Accessor(writes=True, served=True, keys=False),
    "__delitem__": Accessor(writes=True, served=True, keys=False),
    "setdefault": Accessor(writes=True, served=True, keys=False),
    "pop": Accessor(writes=True, served=True, keys=False),
    "popitem": Accessor(writes=True, served=True, keys=True),
    "clear": Accessor(writes=True, served=True, keys=False),
    "update": Accessor(writes=True, served=True, keys=False),
    "__ior__": Accessor(writes=True, served=True, keys=False),
}


def _guarded_accessor(name: str, writes: bool):
    plain = getattr(_PlainState, name)

    def accessor(self, *args, **kwargs):
        tracker = self.armed
        if tracker is not None:
            tracker.accessed(self, writes, name)
        return plain(self, *args, **kwargs)

    accessor.__name__ = name
    accessor.__qualname__ = f"GuardedState.{name}"
    return accessor


for _name, _accessor in ACCESSORS.items():
    setattr(GuardedState, _name, _guarded_accessor(_name, _accessor.writes))
del _name, _accessor
