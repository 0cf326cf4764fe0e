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
  per call, and the new states are copied to the host and freed right after, so even the
  first step never holds more than one parameter's states beyond the slots. They go into
  one host staging buffer for the whole step (``_Staging``; a few more only where the
  states' size is not known in advance), never a buffer per tensor: every host buffer is
  pinned, and pinning costs a system call and page-table work per buffer;
- everything else (states kept on the device): updated together in one call.

Budget: every parameter's states are sized at construction from the optimizer's own
configuration (``inner_optimizers.planned_state_bytes``: exact for torch's, apex's and TE's
Adam), and a budget one of them cannot fit in is refused there. The budget also holds the
fp32 temporaries TE's ``step`` makes per call for its FP8/fp16 (and, before TE 2.13, bf16)
states (``inner_optimizers.transient_bytes``): it is split into the slots and a reserve that
grows with them. At each step every parameter is checked before any is updated, so a refused
step changes nothing (no parameter, group step or state), and can be retried. A step that
fails part-way (an update call or a copy raises) is undone (``step_undo.StepUndo``): what each
call writes is copied to the host before it, and written back if the step fails, so it too
leaves parameters, group steps and states byte for byte as they were.

Master weights that megatron-core keeps outside the optimizer state (the fp32 copies of
bf16/fp16 parameters) are not streamed: megatron copies them into the model parameters
after the update, so they are reloaded whole as without the chunked update. Masters kept
inside the optimizer state (Transformer Engine's precision-aware path) are streamed.
"""

from __future__ import annotations

import functools

import torch

from ..adapters import OPTIMIZER_STATES, PRIMARY_WEIGHTS, inner_optimizers
from ..engine import OffloadEngine, OffloadStateError, SlotSizeError, SlotStream
from ..engine.engine import D2H_AFTER_WRITERS, D2H_RECORD_STREAM, HOST_FREE_AFTER_COPIES, _typed
from ..engine.groups import owns_storage
from ..engine.slots import aligned_bytes, budget_for
from ..engine.staging import _Staging
from ..engine.undo import StepUndo, written_tensors

_ABSENT = object()
#: Host bytes the undo reserves per parameter for the small tensors its state keeps on the
#: device (torch Adam's step count, Transformer Engine's FP8 scales: 16 bytes each, aligned).
_SMALL_STATE_ROOM = 128


def _planned(inner, param, kinds) -> tuple[int, bool]:
    """(slot bytes of ``param``'s states before they exist, exact?) for the offloaded kinds."""
    return inner_optimizers.planned_state_bytes(
        inner, param, moments=OPTIMIZER_STATES in kinds, masters=PRIMARY_WEIGHTS in kinds
    )


def _transient_ratio(inner, params, kinds) -> float:
    """Largest ratio of an update call's temporary bytes to the slot bytes of the states it
    updates (Transformer Engine's fp32 temporaries; 0 for other optimizers)."""
    ratio = 0.0
    for param in params:
        planned, _ = _planned(inner, param, kinds)
        extra = inner_optimizers.transient_bytes(inner, param)
        if planned and extra:
            ratio = max(ratio, extra / planned)
    return ratio


def _takes_place_of(new, view: torch.Tensor) -> bool:
    """``new`` can be copied into the slot ``view`` it replaced (same shape, dtype, device)."""
    return (
        isinstance(new, torch.Tensor)
        and type(new) in (torch.Tensor, torch.nn.Parameter)
        and new.shape == view.shape
        and new.dtype == view.dtype
        and new.device == view.device
    )


class ChunkedUpdate:
    """Runs one inner optimizer's step in chunks with its states streamed through slots.

    Args:
        engine: the engine offloading this optimizer's states (built with ``streamed``).
        distrib_optimizer: the DistributedOptimizer whose inner optimizer is wrapped.
        total_bytes: device bytes the slots may take, split over ``slots`` slots.
        slots: how many slots rotate (2 overlaps the copies with the update).
        kinds: the kinds offloaded for this optimizer (new states of other kinds stay).
        owner: the ``OptimizerStateOffloader``: its ``_streaming`` count is raised while the
            update runs, so its guard leaves the optimizer's own state calls alone.
        undo: keep what each update call writes, so a step that fails part-way is undone
            (``step_undo.py``; ``OffloadConfig.chunked_update_undo``).
    """

    def __init__(
        self,
        engine: OffloadEngine,
        distrib_optimizer,
        *,
        total_bytes: int,
        slots: int,
        kinds,
        owner=None,
        undo: bool = False,
    ) -> None:
        self.engine = engine
        self._owner = owner  # the offloader, told while a chunked update runs
        self.inner = distrib_optimizer.optimizer
        params = [p for group in self.inner.param_groups for p in group["params"]]
        # Budget split: ``slots`` slots of ``slot_bytes`` plus a reserve for the temporaries
        # the inner step makes per call (TE: fp32 copies of FP8/fp16 states, proportional to
        # the states updated). With ``ratio`` = the largest temporaries/state-bytes ratio, a
        # chunk that fits a slot makes at most ``ratio * slot_bytes`` of temporaries, so the
        # update never holds more than ``slots * slot_bytes + reserve <= total_bytes``.
        self.transient_ratio = _transient_ratio(self.inner, params, kinds)
        slot_bytes = int(total_bytes // (slots + self.transient_ratio))
        self.transient_reserve = total_bytes - slots * slot_bytes
        # Refuse now, before any memory is touched, a budget some parameter cannot fit in:
        # every parameter's states are sized from the optimizer's own configuration.
        planned = 0
        for param in params:
            need, exact = _planned(self.inner, param, kinds)
            planned += need
            if need > slot_bytes:
                raise ValueError(
                    f"chunked_update_bytes={total_bytes} gives {slots} slot(s) of {slot_bytes:,} bytes"
                    + (
                        f" (and {self.transient_reserve:,} bytes for the optimizer's temporary fp32 "
                        "copies during each update call)"
                        if self.transient_ratio
                        else ""
                    )
                    + f", but the states of the parameter shard {tuple(param.shape)} take "
                    f"{'' if exact else 'at least '}{need:,} bytes: give at least "
                    f"{budget_for(need, slots, self.transient_ratio):,} bytes, or leave "
                    "chunked_update_bytes unset."
                )
        self.stream = SlotStream(
            engine, slot_bytes=slot_bytes, slots=slots, transient_ratio=self.transient_ratio
        )
        self.kinds = tuple(kinds)
        self.undo = StepUndo(engine) if undo else None
        if self.undo is not None:
            # Pinned now, not on a step's path: what a step saves (the streamed states, the
            # parameters, and room for the step counts and scales a state keeps on the device).
            try:
                self.undo.reserve(
                    planned + sum(aligned_bytes(p) + _SMALL_STATE_ROOM for p in params)
                )
            except BaseException:
                self.undo.close()
                raise
        self.active = False  # True only inside the automatic cycle's optimizer.step()
        self._installed = False
        self._base_steps: dict[int, object] = {}
        self._final_steps: dict[int, object] = {}
        self._cached = None  # (key, layout) of _layout
        self._group_of: dict[int, int] = {}  # id(param) -> index of its param group

    def install(self) -> None:
        """Wrap the inner optimizer's ``step`` (``remove`` gives it back)."""
        self._had_instance_step = "step" in vars(self.inner)
        self._previous_step = self.inner.step

        def step(*args, **kwargs):
            return self._step(*args, **kwargs)

        self.inner.step = functools.update_wrapper(step, self._previous_step)
        self._installed = True

    def remove(self) -> None:
        if self.undo is not None:
            self.undo.close()
        if not self._installed:
            return
        self._installed = False
        if self._had_instance_step:
            self.inner.step = self._previous_step
        else:
            del self.inner.step

    # ------------------------------------------------------------------ step
    def _step(self, *args, **kwargs):
        # Outside the automatic cycle (megatron's dummy step before a checkpoint load, a
        # direct call) or with a closure, the states are reloaded whole as usual.
        if not self.active or args or kwargs:
            return self._previous_step(*args, **kwargs)
        inner = self.inner
        streamed, stateless, rest, chunks = self._layout()
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
        # from the tensors themselves by ``_layout`` above; new ones are sized from the
        # optimizer's configuration, exactly for torch's, apex's and TE's Adam.)
        for param in creating:
            self._check_transients(inner_optimizers.transient_bytes(inner, param), param.shape)
            need, exact = _planned(inner, param, self.kinds)
            if need > self.stream.slot_bytes:
                raise SlotSizeError(
                    f"{self.engine.name}: the states that parameter {tuple(param.shape)} creates at this "
                    f"step take {'' if exact else 'at least '}{need:,} bytes, more than one slot of "
                    f"the chunked update ({self.stream.slot_bytes:,} bytes); no parameter was "
                    f"updated. Give the chunked update at least "
                    f"{self.stream.budget_for(need):,} bytes "
                    "(chunked_update_bytes), or leave it unset."
                )
        self._base_steps = {id(g): g.get("step", _ABSENT) for g in inner.param_groups}
        self._final_steps = {}
        # Host memory for the states this step creates (none in a steady step).
        staging = (
            _Staging(
                self.engine.device, [_planned(inner, param, self.kinds)[0] for param in creating]
            )
            if creating
            else None
        )
        undo = self.undo
        if undo is not None:
            undo.begin()
            if not undo.nbytes:
                # Nothing reserved at attach (no parameters then): one buffer for what this
                # step and the next save, not one per tensor.
                undo.reserve(
                    sum(chunk.nbytes for chunk in chunks)
                    + (sum(staging.expected) if staging is not None else 0)
                    + sum(
                        aligned_bytes(p) + _SMALL_STATE_ROOM
                        for g in inner.param_groups
                        for p in g["params"]
                    )
                )
            # The saves read parameters and states before the first call, whose pre-hook
            # orders the copy-back of what is reloaded whole (rule 4): order it now.
            if self.engine.is_released(streamed=False):
                self.engine.reload(streamed=False)
            self.engine.wait()
        scales = getattr(inner, "_scales", None)
        scaled = {id(p) for p in stateless if isinstance(scales, dict) and p in scales}
        failed = True
        if self._owner is not None:
            self._owner._streaming += 1
        try:
            for index, param in enumerate(creating):
                self._call([param])
                self._to_host(param, staging, index)
            self.stream.run(
                chunks,
                functools.partial(self._update_chunk, streamed),
                save=None if undo is None else functools.partial(self._save_chunk, streamed),
            )
            self._call(rest, empty_groups=True)
            failed = False
        except BaseException as error:
            if undo is not None:
                self._undo(error, stateless, scaled, staging)
            raise
        finally:
            if self._owner is not None:
                self._owner._streaming -= 1
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

    def _undo(
        self, error: BaseException, stateless, scaled: set[int], staging: "_Staging | None"
    ) -> None:
        """Put back what the failed step changed: the saved bytes, and no state it created."""
        inner, engine = self.inner, self.engine
        try:
            self.undo.restore()
            if staging is not None:
                staging.free_unused()
            created = []
            for param in stateless:
                entries = inner.state.pop(param, None)
                if entries:
                    created.extend(t for _, t in inner_optimizers.state_tensors(param, entries))
                scales = getattr(inner, "_scales", None)
                if isinstance(scales, dict) and id(param) not in scaled:
                    scales.pop(param, None)
            engine.disown(created)
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

    def _layout(self):
        """(streamed (param, places) pairs, parameters without state, the other parameters,
        chunks), worked out again only when the states or the engine's groups changed."""
        inner, engine = self.inner, self.engine
        # The engine's state fingerprint (O(groups), see adapters/megatron_wrappers.py) says when
        # the states may have changed; without one, count every parameter's entries.
        watch = engine.fingerprint
        key = (
            engine.generation,
            watch()
            if watch is not None
            else (len(inner.state), sum(map(len, inner.state.values()))),
            tuple(group.place for group in engine.groups),
            tuple((id(group["params"]), len(group["params"])) for group in inner.param_groups),
        )
        if self._cached is not None and self._cached[0] == key:
            streamed, stateless, rest, chunks = self._cached[1]
            return streamed, stateless, list(rest), chunks
        # Which param group each parameter is in, for narrowing the groups per call.
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
                    (holder, name, tensor)
                    for _, holder, name, tensor in inner_optimizers.state_places(param, entries)
                    if self.stream.streamable(tensor)
                ]
                (streamed.append((param, unit)) if unit else rest.append(param))
        chunks = self.stream.plan(
            [[tensor for _, _, tensor in unit] for _, unit in streamed],
            [f"parameter {tuple(param.shape)}" for param, _ in streamed],
        )
        if (
            self.transient_ratio
            or inner_optimizers.kind_of(inner) == inner_optimizers.TE_FUSED_ADAM
        ):
            # The reserve for TE's temporaries was split off the budget from the parameters
            # known at attach: a param group added since may need more per chunk.
            for chunk in chunks:
                params = [streamed[index][0] for index in chunk.units]
                extra = sum(inner_optimizers.transient_bytes(inner, param) for param in params)
                self._check_transients(extra, params[0].shape, len(params))
        self._cached = (key, (streamed, stateless, rest, chunks))
        return streamed, stateless, list(rest), chunks

    def _check_transients(self, nbytes: int, shape, count: int = 1) -> None:
        """Refuse, before any update, a call whose temporaries exceed the budget's reserve."""
        if nbytes <= self.transient_reserve:
            return
        params = [p for group in self.inner.param_groups for p in group["params"]]
        ratio = _transient_ratio(self.inner, params, self.kinds)
        raise SlotSizeError(
            f"{self.engine.name}: the optimizer's temporary fp32 copies for "
            f"{'parameter' if count == 1 else f'{count} parameters from'} {tuple(shape)} take "
            f"{nbytes:,} bytes during one update call, more than the {self.transient_reserve:,} "
            "bytes chunked_update_bytes keeps for them (split when attaching, from the parameters "
            "then; a param group added since needs more); no parameter was updated. Attach again, "
            f"with at least {budget_for(self.stream.slot_bytes, self.stream.slots, ratio):,} bytes "
            "(chunked_update_bytes), or leave it unset."
        )

    def _update_chunk(self, streamed, chunk, views) -> None:
        """Point the chunk's states at their slot places, update, point them back."""
        swapped = []
        failed = True
        try:
            for index in chunk.units:
                for holder, name, tensor in streamed[index][1]:
                    view = views[id(tensor)]
                    # A place is a key of the parameter's state dict, or an attribute of a
                    # quantized state (``inner_optimizers.state_places``).
                    if isinstance(holder, dict):
                        holder[name] = view
                    else:
                        setattr(holder, name, view)
                    swapped.append((holder, name, tensor, view))
            # What the call writes was saved with the chunk's prefetch (``_save_chunk``).
            self._call([streamed[index][0] for index in chunk.units], saved=True)
            failed = False
        finally:
            replaced = []
            for holder, name, _, view in swapped:
                current = holder[name] if isinstance(holder, dict) else getattr(holder, name)
                if current is view:
                    continue
                if not failed and _takes_place_of(current, view):
                    # The optimizer put a new tensor in place of the state (SOAP does, for
                    # its moments and eigenbases): its values go into the slot, which is
                    # copied back to the host as usual.
                    with torch.no_grad():
                        view.copy_(current)
                else:
                    replaced.append(name)
            for holder, name, tensor, _ in swapped:
                if isinstance(holder, dict):
                    holder[name] = tensor
                else:
                    setattr(holder, name, tensor)
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
            for tensor in written_tensors(self.inner, param, self.inner.state.get(param)):
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
        saved = [(group, group["params"]) for group, _ in chosen]
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
            for group, params_of_group in saved:
                group["params"] = params_of_group
        for group, _ in chosen:
            self._final_steps[id(group)] = group.get("step", _ABSENT)

    def _to_host(self, param: torch.Tensor, staging: "_Staging", index: int) -> None:
        """Copy the states just created for ``param`` (the ``index``-th parameter creating
        states in this step) into ``staging`` on the host and free their device memory."""
        engine, device = self.engine, self.engine.device
        entries = self.inner.state.get(param) or {}
        moving = []
        for key, _, _, tensor in inner_optimizers.state_places(param, entries):
            kind = PRIMARY_WEIGHTS if inner_optimizers.is_master_key(key) else OPTIMIZER_STATES
            if (
                kind in self.kinds
                and engine.movable(tensor)
                and tensor.numel()
                and owns_storage(tensor)
            ):
                moving.append(tensor)
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
                    if self.undo is not None
                    else "; parameters updated earlier in this step keep "
                    "their update, so do not retry this step"
                )
                + f". Give the chunked update at least {self.stream.budget_for(size):,} bytes "
                "(chunked_update_bytes), or leave it unset."
            )
        if not moving:
            return
        current = device.current_stream()
        side = engine.side_stream("d2h")
        # Rule 1: the D2H copies what the step just wrote.
        device.wait_stream(side, current, label=D2H_AFTER_WRITERS)
        places = []
        event = None
        try:
            with device.use_stream(side):
                try:
                    for tensor in moving:
                        places.append(staging.take(aligned_bytes(tensor), index))
                        device.copy(_typed(places[-1][0], tensor), tensor)
                finally:
                    # Even when a copy raised: the copies queued before it still run.
                    event = device.record_event(side)
        except BaseException:
            # The states stay on the device, in the optimizer. Staging memory goes back only
            # once the copies into it ran (rule 5), which also orders those reads of the
            # states before whatever writes them next; memory that earlier parameters' states
            # use stays, the engine gives it back with them.
            if event is not None:
                device.synchronize_event(event, label=HOST_FREE_AFTER_COPIES)
            staging.free_unused()
            raise
        for tensor in moving:
            # Rule 2: the D2H still reads this memory; the allocator must know before it goes.
            device.record_stream(tensor, side, label=D2H_RECORD_STREAM)
            device.release(tensor)
        staging.handed_over(buffer for _, buffer in places)
        engine.adopt(
            (tensor, view, event, buffer) for tensor, (view, buffer) in zip(moving, places)
        )
