"""``OptimizerStateOffloader``: offloading for megatron-core's optimizers.

One offloader serves everything ``get_megatron_optimizer`` returns: a DistributedOptimizer,
Float16OptimizerWithFloat16Params or FP32Optimizer, or a ChainedOptimizer of any mix of them
(dense and expert optimizers in MoE models; Muon, SOAP or Lion beside AdamW;
``LayerWiseDistributedOptimizer``, nested chains). It keeps one ``OffloadEngine`` per served
optimizer (``members.py``) and is reachable from each of them as ``_state_offloader``, the
attribute name of Megatron-LM's own (unreleased) offloader. The loop points are
``offload()`` (copy the selected states out, free their device memory), ``reload()`` (regrow,
copy back), ``prefetch()`` (what the step needs whole), ``wait()`` (order the copy-back
before the current stream) and, for RL, ``sleep()`` / ``wake()`` (the model too).

Every call that moves states runs in the ``MOVING`` phase (``phase.py``). Everything else that
reaches the states between steps (state dicts, checkpointing, reads of the state mapping,
``host_view()``) is the state access's (``access/state.py``); every update passes the update
gate first (``gate.py``); megatron-core's own ``offload_to_cpu`` / ``restore_from_cpu`` are
routed here. ``attach`` (``cycle.py``) adds the automatic per-step cycle on top.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Iterable, Iterator, Sequence

from torch.utils.hooks import RemovableHandle

from .. import report
from ..access.host_view import HostView
from ..access.methods import ROUTED_METHODS
from ..access.state import StateAccess
from ..adapters import MASTER_WEIGHTS
from ..config import OffloadConfig
from ..engine import OffloadEngine, OffloadStateError
from ..errors import no_attribute
from ..interceptions import Interceptions
from ..phase import Phase, PhaseTracker
from . import node_memory
from .gate import UpdateGate
from .members import Member, master_weights_option, members, resident_selection, selection
from .sleep import Sleep


class OptimizerStateOffloader:
    """Offloads optimizer states and master weights of megatron-core optimizers.

    Args:
        optimizer: what ``get_megatron_optimizer`` returned (a DistributedOptimizer,
            Float16OptimizerWithFloat16Params, FP32Optimizer, or a ChainedOptimizer of any
            of them).
        config: an ``OffloadConfig``; keyword ``options`` override its fields. The indices
            of ``per_optimizer`` count the optimizers of the ChainedOptimizer in order
            (nested chains flattened, optimizers without parameters on this rank included).
    """

    def __init__(self, optimizer, config: OffloadConfig | None = None, **options) -> None:
        self.config = OffloadConfig.from_options(config, **options)
        self.optimizer = optimizer
        #: True once ``detach()`` ran: the optimizer is a plain optimizer again.
        self.detached = False
        #: The phase the optimizer is in (``phase.py``).
        self.phase = PhaseTracker()
        self._members: list[Member] = []
        self._cycle = None  # the automatic cycle, once attach() installs one
        self._offload_pre_hooks: dict[int, Callable] = collections.OrderedDict()
        self._offload_post_hooks: dict[int, Callable] = collections.OrderedDict()
        #: Every change made to the served objects (``interceptions.listing()``: what, where,
        #: why); ``detach`` removes them all.
        self.interceptions = Interceptions()
        #: Every way in to the states between steps, and each optimizer's policy
        #: (``access/state.py``).
        self.access = None
        self._gate = None  # every update's pre-hook (gate.py)
        self._sleep = Sleep(self)
        # All or nothing: a step that fails (a budget the arena does not fit, pinning, a wrap)
        # undoes the steps before it, and the optimizer is left exactly as it was.
        with contextlib.ExitStack() as undo:
            self._members = members(optimizer, self.config, undo)
            undo.callback(self.interceptions.remove_all)
            for member in self._members:
                self.interceptions.replace(
                    member.optimizer,
                    "_state_offloader",
                    self,
                    why="the offloader serving it, under the name Megatron-LM's own uses",
                    only_if_ours=True,
                )
            self.access = StateAccess(optimizer, self._members, self.phase, self.interceptions)
            self._route_megatron_moves()
            self._gate = UpdateGate(self.phase, self._members, self._sleep, self.interceptions)
            self._sleep.register()
            undo.pop_all()

    # --------------------------------------------------------------- hooks
    def register_offload_pre_hook(
        self, hook: Callable[["OptimizerStateOffloader"], None]
    ) -> RemovableHandle:
        """Call ``hook(offloader)`` just before states are copied out and released (every
        ``offload()``, every step of an attached optimizer); ``remove()`` on the handle
        unregisters it, as torch's hooks."""
        handle = RemovableHandle(self._offload_pre_hooks)
        self._offload_pre_hooks[handle.id] = hook
        return handle

    def register_offload_post_hook(
        self, hook: Callable[["OptimizerStateOffloader"], None]
    ) -> RemovableHandle:
        """Call ``hook(offloader)`` just after the copies out were queued and the device
        memory released (the copies may still run); see ``register_offload_pre_hook``."""
        handle = RemovableHandle(self._offload_post_hooks)
        self._offload_post_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------- queries
    @property
    def members(self) -> tuple[Member, ...]:
        """The served optimizers, each with its engine and configured kinds."""
        return tuple(self._members)

    @property
    def engines(self) -> tuple[OffloadEngine, ...]:
        return tuple(member.engine for member in self._members)

    @property
    def configured_kinds(self) -> tuple[tuple[str, ...], ...]:
        """What each served optimizer offloads as configured (``per_optimizer`` applied),
        in the order of ``engines``."""
        return tuple(member.kinds for member in self._members)

    @property
    def automatic(self) -> bool:
        """True when ``attach`` runs the per-step cycle: each step reloads what it needs by
        itself (a framework's "to the device" phase has nothing to do)."""
        return self._cycle is not None and not self.detached

    @property
    def is_offloaded(self) -> bool:
        """True while some selected state has no device memory."""
        return any(engine.is_released() for engine in self.engines)

    def stats(self) -> dict:
        """Every figure, summed over the served optimizers (``per_optimizer``: each one's);
        the keys are described in docs/usage.md. ``host_bytes`` counts every host buffer
        held: the arenas, buffers handed to them not taken yet, and the chunked update's
        undo journal."""
        per = [member.engine.stats() for member in self._members]
        extra = self._cycle.extra_host_bytes() if self._cycle is not None else [0] * len(per)
        for figures, nbytes in zip(per, extra):
            figures["host_bytes"] += nbytes
        return report.combine(
            per,
            cycles=self._cycle.cycles if self._cycle is not None else 0,
            devices=[member.engine.device for member in self._members],
            host_views=self.access.figures.figures(),
            sleep=self._sleep.figures(),
        )

    def summary(self) -> str:
        """``stats()`` in one line for people, sizes in KiB/MiB/GiB as they come: offloaded,
        host, the last D2H and H2D with GB/s (once measured), the exposed wait, the cycles."""
        return report.summary(self.stats())

    # ------------------------------------------------- the upstream-compatible API
    def offload(
        self,
        offload_optimizer_states: bool | None = None,
        offload_master_weights: bool | None = None,
        *,
        offload_primary_weights: bool | None = None,
    ) -> None:
        """Copy the selected states to the host and free their device memory.

        ``None`` for either selection means "as configured" (``offload_primary_weights``:
        Megatron-LM PR #2811's name of ``offload_master_weights``). On accelerators the copy
        is asynchronous: the memory goes back to the allocator at once but is reused only once
        the copy has read it.
        """
        self._check_attached()
        masters = master_weights_option(offload_master_weights, offload_primary_weights)
        with self.phase.within(Phase.MOVING):
            self._offload(selection(self.configured_kinds, offload_optimizer_states, masters))

    def reload(self) -> None:
        """Regrow the offloaded states and start copying them back.

        Call ``wait()`` before reading them outside a step; a step of an attached optimizer
        waits by itself. Idempotent, and safe in any order: with nothing offloaded (before the
        first offload, or twice in a row) it does nothing, so RL frameworks may call their
        "to the device" phase unconditionally.
        """
        self._check_attached()
        with self.phase.within(Phase.MOVING):
            try:
                for engine in self.engines:
                    engine.reload()
            except Exception as error:
                if self.config.offload_disk_dir is None:
                    raise
                self._reloaded_together(error)
            else:
                if self.config.offload_disk_dir is not None:
                    self._reloaded_together(None)

    def prefetch(self) -> None:
        """Start reloading what the step needs whole (asynchronous): everything, except
        the states a chunked update (``chunked_update_bytes``) streams through its slots
        during the step. What ``attach``'s cycle and the training hooks call."""
        token = self.phase.enter(Phase.MOVING)
        try:
            for member in self._members:
                member.engine.reload(streamed=False)
        except Exception as error:
            if self.config.offload_disk_dir is None:
                raise
            self._reloaded_together(error)
        else:
            if self.config.offload_disk_dir is not None:
                self._reloaded_together(None)
        finally:
            self.phase.leave(token)

    def _reloaded_together(self, failure: Exception | None) -> None:
        """With a disk tier, after a reload: a read from a disk can fail on one rank alone,
        whose step then raises while the others would go on into the gradient reduction and
        wait there for it. So the ranks raise together (one gather per reload): this rank's
        ``failure``, or, where another rank failed, an ``OffloadStateError`` once what this
        rank regrew went back (its host copies are still valid)."""
        if not node_memory.every_rank(failure is None) and failure is None:
            for member in self._members:
                member.engine.offload(skip_unchanged=True, release=True)
            failure = OffloadStateError(
                "reloading the optimizer states: another rank could not read its states back "
                "(its error says why). Nothing was copied back here either; make the same call "
                "again."
            )
        if failure is not None:
            raise failure

    def wait(self) -> None:
        """Order every pending copy-back before the current stream (no host block)."""
        with self.phase.within(Phase.MOVING):
            for engine in self.engines:
                engine.wait()

    def mark_optimizer_states_initialized(self) -> None:
        """Look for new or replaced state tensors at the next offload.

        New states (Adam's moments after the first step, created all at once per parameter)
        are noticed without this, and so are loads through the optimizer and replaced state
        mappings, parameter groups or masters. Call it after changing a parameter's state by
        hand: replacing one of its tensors, or adding a key to a state dict that already
        has states (the per-cycle check does not walk full state dicts).
        """
        for engine in self.engines:
            engine.invalidate()

    # ------------------------------------------------------------- conveniences
    @contextlib.contextmanager
    def offloaded(
        self,
        offload_optimizer_states: bool | None = None,
        offload_master_weights: bool | None = None,
        *,
        offload_primary_weights: bool | None = None,
    ) -> Iterator["OptimizerStateOffloader"]:
        """The selected states offloaded for the duration of the block (an RL rollout).

        The selection is that of ``offload()`` (``None``: as configured), so a run whose
        step cycle keeps the master weights on the device can free them for a rollout with
        ``offloaded(offload_master_weights=True)``. Nests, and composes with the per-step
        cycle: what is already offloaded on entry is left offloaded on exit; what the block
        offloads is reloaded, and ready for the current stream, on exit.
        """
        self._check_attached()
        masters = master_weights_option(offload_master_weights, offload_primary_weights)
        chosen = selection(self.configured_kinds, offload_optimizer_states, masters)
        taken = [
            tuple(kind for kind in kinds if not engine.fully_released(kind))
            for engine, kinds in zip(self.engines, chosen)
        ]
        if any(taken):
            with self.phase.within(Phase.MOVING):
                self._offload(taken)
        try:
            yield self
        finally:
            if any(taken) and not self.detached:
                with self.phase.within(Phase.MOVING):
                    for engine, kinds in zip(self.engines, taken):
                        if kinds:
                            engine.reload(kinds)
                    for engine, kinds in zip(self.engines, taken):
                        if kinds:
                            # Ordered before the current stream: the caller may step at once.
                            engine.wait(kinds)

    @contextlib.contextmanager
    def resident(
        self,
        *,
        read_only: bool = False,
        kinds: Iterable[str] | Sequence[Iterable[str]] | None = None,
    ) -> Iterator["OptimizerStateOffloader"]:
        """States on the device for the duration of the block (checkpointing, inspection).

        If they were offloaded on entry they are offloaded again on exit. With
        ``read_only=True`` the block promises not to change them, so the still-valid host
        copy is kept and nothing is copied back out (a checkpoint save); otherwise the
        states are copied out again (a checkpoint load, or any in-place change).

        ``kinds``: ``"optimizer_states"`` and/or ``"master_weights"``, for every optimizer or
        one selection per optimizer of a ChainedOptimizer (None: all). What is not selected
        stays on the host (reading it still brings it back, through the guard).
        """
        self._check_attached()
        chosen_kinds = resident_selection(kinds, len(self._members))
        engines = self.engines
        taken = [
            tuple(kind for kind in chosen if engine.is_released((kind,)))
            for engine, chosen in zip(engines, chosen_kinds)
        ]
        with self.phase.within(Phase.MOVING):
            for engine, kinds_taken in zip(engines, taken):
                if kinds is None and any(taken):
                    engine.reload()  # everything, in every engine
                elif kinds_taken:  # an engine with nothing to bring back keeps its figures
                    engine.reload(kinds_taken)
            for engine, chosen in zip(engines, chosen_kinds):
                engine.wait(chosen)  # also a copy-back started before (a prefetch)
                if any(taken) and not read_only:
                    engine.mark_dirty(chosen)
        try:
            yield self
        finally:
            if any(taken) and not self.detached:
                again = taken
                if kinds is None:  # the configured selection, and what came back
                    again = [
                        tuple(dict.fromkeys(configured + kinds_taken))
                        for configured, kinds_taken in zip(self.configured_kinds, taken)
                    ]
                with self.phase.within(Phase.MOVING):
                    self._offload(again, skip_unchanged=True)

    def host_view(self, *, writes: bool = False) -> contextlib.AbstractContextManager[HostView]:
        """Offloaded state seen as its host copy for the duration of the block.

        Inside ``with offloader.host_view():`` every released state tensor and master weight
        is, where the optimizer keeps it (``optimizer.optimizer.state[p][...]``, the
        ``param_groups``, the wrapper's master lists), a CPU tensor viewing its host copy:
        reading it copies nothing to the device. Under Megatron-FSDP the DTensors stay in
        place and their local tensors are the host copies (a save built and written inside
        the block reads only host memory). What the block writes into them reaches the
        next step (the prefetch copies the host copy in). Resident states are seen where they
        are; ``writes=True`` says the block may write those too (their host copies become
        stale). On exit the optimizer's own tensor objects are back in place; do not keep the
        host views past the block (the next offload overwrites the host copy). The
        optimizer's checkpoint methods run inside one by themselves.
        """
        self._check_attached()
        return self.access.host_view(writes=writes)

    # ------------------------------------------------------------- sleep and wake
    def sleep(
        self, model=None, *, parameters: bool = True, gradients: bool = True, to: str = "host"
    ) -> None:
        """The training state off the device (RL rollouts; ``offloader/sleep.py``): states,
        masters and ``parameters``, the ``gradients``. ``model``: the DDP chunks (default:
        the optimizer's). ``to="disk"``: the host copies of the states and masters go on to
        the disk tier (and the parameter copies there too), the host arena given back
        until wake. Every rank, between
        steps; idempotent; a forward wakes it."""
        self._check_attached()
        self._sleep.sleep(model, parameters=parameters, gradients=gradients, to=to)

    def wake(self, *, parameters: bool = True, gradients: bool = True) -> None:
        """Undo ``sleep()`` (the parts selected) on the current stream; every rank."""
        self._sleep.wake(parameters=parameters, gradients=gradients)

    def asleep(self, model=None, *, to: str = "host") -> contextlib.AbstractContextManager:
        """Asleep for the block (``with offloader.asleep(): rollout()``); nests. ``to``: as
        for ``sleep``."""
        return self._sleep.block(model, to)

    sleeping = property(lambda self: self._sleep.sleeping, doc="Some part is asleep.")

    def detach(self) -> None:
        """Stop offloading: bring back whatever is offloaded (awake), give back the host
        memory, and leave a plain optimizer (its step, methods and state mapping as before
        attach). Callable in any state; training after it is bitwise that of a run never
        offloaded."""
        if self.detached:
            return
        self._sleep.close()  # awake first: the parameters and gradients come back
        with self.phase.within(Phase.MOVING):
            # The host copies may be the only copies: every engine regrows and copies back
            # what it released (and waits for any copy-out still reading device memory)
            # before its host arena is given back; the waits order the copies before the
            # current stream, which uses the states next.
            for engine in self.engines:
                engine.reload()
            for engine in self.engines:
                engine.wait()
        if self._cycle is not None:
            self._cycle.remove()
            self._cycle = None
        self._gate.remove()
        self.access.remove()
        for engine in self.engines:
            engine.close()
        self.interceptions.remove_all()
        self.detached = True
        self.phase.detached()

    # --------------------------------------------------- for the cycle and the guard
    def run_by(self, cycle) -> None:
        """``attach``'s cycle drives this offloader from now on (``detach`` removes it)."""
        self._cycle = cycle
        self._gate.chunked = list(cycle.chunked_updates)  # streamed by them during a step

    def offload_after_step(self) -> None:
        """What the automatic cycle does after each step: the configured selection copied out
        and released (a skipped step left the host copies valid: nothing copied, rule 6)."""
        token = self.phase.enter(Phase.MOVING)
        try:
            self._offload([member.kinds for member in self._members], skip_unchanged=True)
        finally:
            self.phase.leave(token)

    # ----------------------------------------------------------------- internals
    def _offload(self, selection: list[tuple[str, ...]], *, skip_unchanged: bool = False) -> None:
        """Copy out (unless ``skip_unchanged`` and still valid) and release, per optimizer."""
        for hook in tuple(self._offload_pre_hooks.values()):
            hook(self)
        for member, kinds in zip(self._members, selection):
            watch = member.engine.copies.fingerprint
            if kinds and watch.identities:
                # Tensors the step replaced (SOAP) go back where the layout has them.
                watch.keep_replaced()
            # Released piece by piece as the copies are queued (progressive reuse).
            member.engine.offload(kinds, skip_unchanged=skip_unchanged, release=True)
        if self.config.release_master_grads:
            # The fp32 gradients megatron-core gave the masters for the step (as large as the
            # masters) are not needed until the next step makes new ones.
            for member, kinds in zip(self._members, selection):
                if MASTER_WEIGHTS in kinds:
                    member.engine.copies.fingerprint.release_master_grads()  # O(groups) mostly
        # A state mapping replaced since it was guarded (the wrapper's ``state`` setter) is
        # guarded again as the states leave.
        self.access.guard_replaced()
        for hook in tuple(self._offload_post_hooks.values()):
            hook(self)

    def _route_megatron_moves(self) -> None:
        """megatron-core's own RL moves (``offload_to_cpu`` / ``restore_from_cpu``) on each
        served optimizer that has both, routed here: asynchronous, coalesced, and consistent
        with what this offloader holds, instead of moving the tensors behind its back."""

        def offload_to_cpu(previous):
            return lambda *args, **kwargs: self.offload()

        def restore_from_cpu(previous):
            def restore(*args, **kwargs):
                if self.is_offloaded:
                    self.reload()
                self.wait()

            return restore

        wrappers = [member.optimizer for member in self._members]
        targets = [self.optimizer] + [w for w in wrappers if w is not self.optimizer]
        for target in targets:
            if all(callable(getattr(type(target), name, None)) for name in ROUTED_METHODS):
                for name, make in zip(ROUTED_METHODS, (offload_to_cpu, restore_from_cpu)):
                    self.interceptions.wrap(
                        target, name, make, why="megatron-core's RL move, routed to the offloader"
                    )

    def _check_attached(self) -> None:
        if self.detached:
            raise OffloadStateError("this offloader was detached; attach a new one to offload.")

    def __getattr__(self, name: str):
        raise no_attribute(self, name)  # only reached for names the class does not have

    def __str__(self) -> str:
        state = "detached" if self.detached else f"{len(self._members)} optimizer(s)"
        return f"OptimizerStateOffloader ({state}): {self.summary()}"

    def __repr__(self) -> str:
        return f"OptimizerStateOffloader({', '.join(map(repr, self.engines))})"
