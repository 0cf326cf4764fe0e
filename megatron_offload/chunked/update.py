"""The chunked update: the inner optimizer's step with its states kept on the host.

With ``chunked_update_bytes`` set, ``attach`` does not reload the optimizer states for the
step. The inner optimizer's ``step`` is run several times instead, each time on a subset
of the parameters (its param groups narrowed to them), with those parameters' states
brought into a device slot just for that call (``engine.slots.SlotStream``) and copied
back after it. The device memory the states take during the update is the slots.

Why the result is bitwise identical to one whole step: Adam's update is elementwise and
per parameter, so updating the parameters in several calls computes the same values. So are
Lion's (elementwise), Muon's (each parameter's momentum orthogonalized on its own; with tensor
parallelism its collectives follow the parameters in the same order, chunked or not) and
SOAP's (each parameter's moments and preconditioners on their own); SOAP puts new tensors in
place of its states, whose values are copied into the slot after the call. The
only state shared across parameters is a per-group step counter (Transformer Engine's and
apex's FusedAdam keep ``group["step"]``, advanced once per ``step()``): it is set back to
its value before the step for every call, so each call sees the count the one step would.

What the step contains, per parameter:

- states on the host: streamed, packed into chunks of consecutive parameters;
- no state yet (the first step, where Adam creates its states): updated one parameter
  per call, the new states copied to the host and freed right after (``new_states.py``);
- everything else (states kept on the device): updated together in one call.

The budget and the plan are in ``plan.py``. At each step every parameter is checked before
any is updated, so a refused step changes nothing (no parameter, group step or state), and
can be retried. A step that fails part-way (an update call or a copy raises) is undone
(``engine.undo.StepUndo``, opt-in): what each call writes is copied to the host before it,
and written back if the step fails, so it too leaves parameters, group steps and states byte
for byte as they were.

Master weights that megatron-core keeps outside the optimizer state (the fp32 copies of
bf16/fp16 parameters) are not streamed: megatron copies them into the model parameters
after the update, so they are reloaded whole as without the chunked update. Masters kept
inside the optimizer state (Transformer Engine's precision-aware path) are streamed.
"""

from __future__ import annotations

import functools

import torch

from ..adapters import inner_optimizers
from ..adapters.holders import Repointing, same_kind
from ..engine import OffloadEngine, OffloadStateError, SlotStream
from ..engine.slots import aligned_bytes
from ..engine.undo import StepUndo
from ..interceptions import Interceptions
from ..phase import Phase, PhaseTracker
from .new_states import NewStates
from .plan import SMALL_STATE_ROOM, Budget

_ABSENT = object()


class ChunkedUpdate:
    """Runs one inner optimizer's step in chunks with its states streamed through slots.

    Args:
        engine: the engine offloading this optimizer's states (built with ``streamed``).
        wrapper: the Megatron optimizer whose inner optimizer is wrapped.
        total_bytes: device bytes the slots may take, split over ``slots`` slots.
        slots: how many slots rotate (2 overlaps the copies with the update).
        kinds: the kinds offloaded for this optimizer (new states of other kinds stay).
        phase: the offloader's ``PhaseTracker`` (None: one of its own): the update runs
            only inside the automatic cycle's step (``STEPPING``), and its calls run in
            ``STREAMING``, where nothing may move the states it holds in slots.
        undo: keep what each update call writes, so a step that fails part-way is undone
            (``engine.undo``; ``OffloadConfig.chunked_update_undo``).
    """

    def __init__(
        self,
        engine: OffloadEngine,
        wrapper,
        *,
        total_bytes: int,
        slots: int,
        kinds,
        phase: PhaseTracker | None = None,
        undo: bool = False,
    ) -> None:
        self.engine = engine
        # A chunked update of its own (no offloader): nothing else reacts to its phases.
        self.phase = phase if phase is not None else PhaseTracker()
        self.inner = wrapper.optimizer
        self.kinds = tuple(kinds)
        # Refused now, before any memory is touched, if some parameter cannot fit a slot.
        self.budget = Budget(self.inner, self.kinds, total_bytes=total_bytes, slots=slots)
        self.stream = SlotStream(
            engine,
            slot_bytes=self.budget.slot_bytes,
            slots=slots,
            transient_ratio=self.budget.ratio,
        )
        self._cached = None  # (key, plan) of ``_plan``
        self._group_of: dict[int, int] = {}  # id(param) -> index of its param group
        self.undo = StepUndo(engine) if undo else None
        if self.undo is not None:
            # Pinned now, not on a step's path: what a step saves (the streamed states, the
            # parameters, and room for the step counts and scales a state keeps on the device).
            params = [p for group in self.inner.param_groups for p in group["params"]]
            try:
                self.undo.reserve(
                    self.budget.planned + sum(aligned_bytes(p) + SMALL_STATE_ROOM for p in params)
                )
            except BaseException:
                self.undo.close()
                raise
        self._installed = None  # the step's wrap, once installed
        self._base_steps: dict[int, object] = {}
        self._final_steps: dict[int, object] = {}

    @property
    def transient_ratio(self) -> float:
        return self.budget.ratio

    @property
    def transient_reserve(self) -> int:
        return self.budget.reserve

    def install(self, interceptions: Interceptions | None = None) -> None:
        """Wrap the inner optimizer's ``step`` through ``interceptions`` (the offloader's; a
        chunked update of its own keeps its own); ``remove`` gives it back."""

        def make(previous):
            self._previous_step = previous

            def step(*args, **kwargs):
                return self._step(*args, **kwargs)

            return step

        self._installed = (interceptions or Interceptions()).wrap(
            self.inner, "step", make, why="the chunked update: the states streamed through slots"
        )

    def remove(self) -> None:
        if self.undo is not None:
            self.undo.close()
        installed, self._installed = self._installed, None
        if installed is not None:
            installed.remove()

    @property
    def extra_host_bytes(self) -> int:
        """Host bytes held beyond the engine's (the undo journal)."""
        return self.undo.nbytes if self.undo is not None else 0

    # ------------------------------------------------------------------ step
    def _step(self, *args, **kwargs):
        # Outside the automatic cycle's step (megatron's dummy step before a checkpoint
        # load, a direct call) or with a closure, the states are reloaded whole as usual.
        if self.phase.current is not Phase.STEPPING or args or kwargs:
            return self._previous_step(*args, **kwargs)
        inner, engine = self.inner, self.engine
        streamed, stateless, rest, chunks = self._plan()
        creating = []
        for param in stateless:
            # Adam creates states for parameters with a gradient (TE: for all; its
            # precision-aware path passes gradients as ``decoupled_grad``).
            has_grad = param.grad is not None or getattr(param, "decoupled_grad", None) is not None
            (creating if self.kinds and has_grad and param.numel() else rest).append(param)
        if not streamed and not creating:
            return self._previous_step()
        # Every parameter is checked before any is updated: a step refused here leaves the
        # parameters, the group steps and the states exactly as they were, so the caller may
        # attach again with a larger budget and retry the step. (Streamed states were sized
        # from the tensors themselves by the plan; new ones from the optimizer's configuration,
        # exactly for torch's, apex's and TE's Adam.)
        for param in creating:
            self.budget.check_new_states(param, engine.name)
        self._base_steps = {id(g): g.get("step", _ABSENT) for g in inner.param_groups}
        self._final_steps = {}
        # The states this step creates go to the host as they appear (none in a steady step).
        undo = self.undo
        new = (
            NewStates(engine, inner, self.kinds, self.stream, creating, undone=undo is not None)
            if creating
            else None
        )
        if undo is not None:
            undo.begin()
            if not undo.nbytes:
                # Nothing reserved at attach (no parameters then): one buffer for what this
                # step and the next save, not one per tensor.
                undo.reserve(
                    sum(chunk.nbytes for chunk in chunks)
                    + (sum(new.expected) if new is not None else 0)
                    + sum(
                        aligned_bytes(p) + SMALL_STATE_ROOM
                        for g in inner.param_groups
                        for p in g["params"]
                    )
                )
            # The saves read parameters and states before the first call, whose pre-hook
            # orders the copy-back of what is reloaded whole (rule 4): order it now.
            if engine.is_released(streamed=False):
                engine.reload(streamed=False)
            engine.wait()
        scales = getattr(inner, "_scales", None)
        scaled = {id(p) for p in stateless if isinstance(scales, dict) and p in scales}
        failed = True
        try:
            with self.phase.within(Phase.STREAMING):
                for index, param in enumerate(creating):
                    self._call([param])
                    new.to_host(index, param)
                self.stream.run(
                    chunks,
                    functools.partial(self._update_chunk, streamed),
                    save=None if undo is None else functools.partial(self._save_chunk, streamed),
                )
                self._call(rest, empty_groups=True)
            failed = False
        except BaseException as error:
            if undo is not None:
                self._undo(error, stateless, scaled, new)
            raise
        finally:
            for group in inner.param_groups:
                # A failed step that was undone counts as not having run.
                final = self._base_steps.get(id(group), _ABSENT)
                if not (failed and undo is not None):
                    final = self._final_steps.get(id(group), final)
                if final is _ABSENT:
                    group.pop("step", None)
                else:
                    group["step"] = final
        return None

    def _undo(self, error: BaseException, stateless, scaled: set[int], new) -> None:
        """Put back what the failed step changed: the saved bytes, and no state it created
        (``new``: their ``NewStates``, or None)."""
        inner, engine = self.inner, self.engine
        try:
            self.undo.restore()
            if new is not None:
                new.staging.free()
            created = []
            for param in stateless:
                entries = inner.state.pop(param, None)
                if entries:
                    created.extend(t for _, t in inner_optimizers.state_tensors(param, entries))
                scales = getattr(inner, "_scales", None)
                if isinstance(scales, dict) and id(param) not in scaled:
                    scales.pop(param, None)
            engine.adopted.disown(created)
        except BaseException as failure:
            raise OffloadStateError(
                f"{engine.name}: the chunked update failed part-way ({type(error).__name__}: {error}) "
                f"and could not be undone ({type(failure).__name__}: {failure}): parameters and "
                "optimizer states may be partly updated. Load the last checkpoint."
            ) from failure
        error.add_note(
            f"{engine.name}: the chunked update was undone: parameters, group steps and optimizer "
            "states are as they were before this step, which can be run again."
        )

    def _plan(self):
        """``(streamed (param, [(holder, tensor)]) pairs, parameters without state, the
        other parameters, chunks)``."""
        inner, engine = self.inner, self.engine
        # The engine's state fingerprint (O(groups), adapters/megatron_wrappers.py) says when
        # the states may have changed; without one, count every parameter's entries.
        watch = engine.copies.fingerprint
        key = (
            engine.generation,
            watch()
            if watch is not None
            else (len(inner.state), sum(map(len, inner.state.values()))),
            tuple(piece.place for piece in engine.copies.pieces),
            tuple((id(group["params"]), len(group["params"])) for group in inner.param_groups),
        )
        if self._cached is not None and self._cached[0] == key:
            streamed, stateless, rest, chunks = self._cached[1]
            return streamed, stateless, list(rest), chunks
        self._group_of = {
            id(p): i for i, group in enumerate(inner.param_groups) for p in group["params"]
        }
        streamed, stateless, rest = [], [], []
        for group in inner.param_groups:
            for param in group["params"]:
                entries = inner.state.get(param)
                if not entries:
                    stateless.append(param)
                    continue
                unit = [
                    (holder, tensor)
                    for _, holder, tensor in inner_optimizers.state_places(param, entries)
                    if self.stream.streamable(tensor)
                ]
                (streamed.append((param, unit)) if unit else rest.append(param))
        chunks = self.stream.plan(
            [[tensor for _, tensor in unit] for _, unit in streamed],
            [f"parameter {tuple(param.shape)}" for param, _ in streamed],
        )
        if self.budget.ratio or inner_optimizers.kind_of(inner) == inner_optimizers.TE_FUSED_ADAM:
            # The reserve for TE's temporaries was split off the budget from the parameters
            # known at attach: a param group added since may need more per chunk.
            for chunk in chunks:
                params = [streamed[index][0] for index in chunk.units]
                extra = sum(inner_optimizers.transient_bytes(inner, param) for param in params)
                self.budget.check_transients(
                    extra, params[0].shape, len(params), name=self.engine.name
                )
        self._cached = (key, (streamed, stateless, rest, chunks))
        return streamed, stateless, list(rest), chunks

    def _update_chunk(self, streamed, chunk, views) -> None:
        """Point the chunk's states at their slot places, update, point them back."""
        pointed = Repointing()
        failed = True
        try:
            pointed.point_many(
                (holder, views[id(tensor)])
                for index in chunk.units
                for holder, tensor in streamed[index][1]
            )
            # What the call writes was saved with the chunk's prefetch (``_save_chunk``).
            self._call([streamed[index][0] for index in chunk.units], saved=True)
            failed = False
        finally:
            replaced = []
            for holder, _, view, found in pointed.restore(always=True):
                if not failed and same_kind(found, view):
                    # The optimizer put a new tensor in place of the state (SOAP does, for
                    # its moments and eigenbases): its values go into the slot, which is
                    # copied back to the host as usual.
                    with torch.no_grad():
                        view.copy_(found)
                else:
                    replaced.append(str(holder.key))
        if replaced and not failed:
            raise OffloadStateError(
                f"{self.engine.name}: the optimizer replaced its state tensors ({', '.join(sorted(set(replaced)))}) "
                "during a chunked update, so the update's result would be lost. This optimizer "
                "does not support the chunked update: leave chunked_update_bytes unset."
            )

    def _written(self, params) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(tensor, tensor)`` for every tensor with device memory an update of ``params``
        may write (states released to the host have none: their slot is saved instead)."""
        seen, pairs = set(), []
        for param in params:
            entries = self.inner.state.get(param)
            for tensor in inner_optimizers.written_tensors(self.inner, param, entries):
                if (
                    id(tensor) in seen
                    or not tensor.numel()
                    or not tensor.untyped_storage().nbytes()
                ):
                    continue
                seen.add(id(tensor))
                pairs.append((tensor, tensor))
        return pairs

    def _save_chunk(self, streamed, chunk, slot_pairs, after):
        """``SlotStream.run``'s ``save``: a chunk's slot and what else its update writes."""
        params = [streamed[index][0] for index in chunk.units]
        return self.undo.save(
            list(slot_pairs) + self._written(params), after=after, order_current=False
        )

    def _call(self, params, *, empty_groups: bool = False, saved: bool = False) -> None:
        """One inner step over ``params`` only (and parameter-less groups if asked).

        With the undo on, everything the call may write is first saved to the host, unless
        it was (``saved``: a chunk, saved with its prefetch).
        """
        inner = self.inner
        if self.undo is not None and params and not saved:
            self.undo.save(self._written(params))
        groups = inner.param_groups
        subsets: dict[int, list] = {}
        for param in params:
            subsets.setdefault(self._group_of[id(param)], []).append(param)
        if empty_groups:
            for index, group in enumerate(groups):
                if not group["params"]:
                    subsets.setdefault(index, [])
        if not subsets:
            return
        chosen = [(groups[index], subsets[index]) for index in sorted(subsets)]
        kept = [(group, group["params"]) for group, _ in chosen]
        try:
            for group, subset in chosen:
                group["params"] = subset
                # A per-group step counter advances once per step(): every call starts from
                # the count before this step, as the single unchunked call would.
                base = self._base_steps.get(id(group), _ABSENT)
                if base is _ABSENT:
                    group.pop("step", None)
                else:
                    group["step"] = base
            inner.param_groups = [group for group, _ in chosen]
            self._previous_step()
        finally:
            inner.param_groups = groups
            for group, params_of_group in kept:
                group["params"] = params_of_group
        for group, _ in chosen:
            self._final_steps[id(group)] = group.get("step", _ABSENT)
