"""``OptimizerStateOffloader``: offloading for megatron-core's optimizers.

One offloader serves everything ``get_megatron_optimizer`` returns: a DistributedOptimizer,
Float16OptimizerWithFloat16Params or FP32Optimizer, or a ChainedOptimizer of any mix of them
(dense and expert optimizers in MoE models; Muon, SOAP or Lion beside AdamW;
``LayerWiseDistributedOptimizer``, nested chains). It keeps one ``OffloadEngine`` per
Megatron optimizer that has a torch optimizer on this rank and is reachable from each of
them as ``_state_offloader``, the attribute name used by Megatron-LM's own (unreleased)
offloader. The loop points:

====================================  ================================================
``offload(offload_optimizer_states,   copy the selected states to the host and free
offload_primary_weights)``            their device memory (asynchronous on accelerators)
``reload()``                          regrow and copy back (asynchronous)
``prefetch()``                        ``reload()`` of what the step needs whole
``wait()``                            order the copy-back before the current stream
``mark_optimizer_states_initialized``  look for replaced state tensors at the next offload
====================================  ================================================

The unreleased offloader's ``release_gpu_memory()`` and ``sync_before_step()`` are not
offered: ``offload()`` frees the memory itself, and ``wait()`` is the other's name here;
calling them says so (``__getattr__``).

Methods of the optimizers that touch the states (state dicts, checkpointing, megatron's
own ``offload_to_cpu``) and the inner optimizers' ``state`` mappings are made safe while
offloaded by ``guard.py``; ``attach`` (see ``attach.py``) adds the automatic per-step cycle
on top.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Callable, Iterable, Iterator, Sequence

from torch.utils.hooks import RemovableHandle

from .. import report as stats_log
from ..access.guard import StateAccessGuard
from ..access.host_view import HostView
from ..adapters import KINDS, OPTIMIZER_STATES, PRIMARY_WEIGHTS
from ..adapters import megatron_wrappers as wrappers
from ..adapters.megatron_wrappers import StateWatch
from ..config import OffloadConfig
from ..device import device_for, numa
from ..engine import HostBudget, OffloadEngine, OffloadStateError, Place
from ..engine.figures import gbps
from . import node_memory
from .acceptance import distributed_optimizers, is_stub, megatron_optimizers, refuse_unsupported  # noqa: F401 - re-exported


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
        found = megatron_optimizers(optimizer)
        for wrapper in found:
            refuse_unsupported(wrapper)
        served = [(index, wrapper) for index, wrapper in enumerate(found) if not is_stub(wrapper)]
        self.optimizer = optimizer
        # The Megatron optimizers served (one engine each), and each one's index among all of
        # them (for ``per_optimizer``).
        self._distributed = [wrapper for _, wrapper in served]
        self._indices = [index for index, _ in served]
        # What each served optimizer offloads as configured (``per_optimizer`` applied).
        self._configured_kinds = [self.config.kinds(index) for index in self._indices]
        #: True once ``detach()`` ran: the optimizer is a plain optimizer again.
        self.detached = False
        self._cycles = 0
        self._automatic = None  # set by attach()
        self._streaming = 0  # > 0 while a chunked update runs (integration/chunked.py)
        # The HostView open on this offloader (checkpoint code served from the host copy,
        # integration/host_view.py), and whether anything in it may write the states.
        self._host_view = None
        self._host_view_writes = False
        # The HostView a read of the state mapping between steps opened (guard.py): open
        # until the next call that moves states (``end_reads``; host_view.serve_reads).
        self._reads = None
        # What the host views served (host_view.py), for stats().
        self._host_view_figures = {
            "host_view_calls": 0,
            "host_view_save_bytes": 0,
            "host_view_load_bytes": 0,
            "host_view_wait_ms": 0.0,
            "host_view_device_bytes": 0,
        }
        self._offload_pre_hooks: dict[int, Callable] = collections.OrderedDict()
        self._offload_post_hooks: dict[int, Callable] = collections.OrderedDict()
        self._engines: list[OffloadEngine] = []
        self._marked: list[tuple[object, bool, object]] = []  # (optimizer, had one, previous)
        # All or nothing: a step that fails (a budget the arena does not fit, pinning, a wrap)
        # undoes the steps before it, and the optimizer is left exactly as it was.
        with contextlib.ExitStack() as undo:
            self._make_engines(undo)
            undo.callback(self._unmark)
            for distrib_optimizer in self._distributed:
                self._mark(distrib_optimizer)
            self._guard = StateAccessGuard(self)
            undo.pop_all()

    def _make_engines(self, undo: contextlib.ExitStack) -> None:
        """One engine per served optimizer, each with its host arena allocated (and pinned)
        now, not inside the first offload (the step's path), within the budget."""
        budget = HostBudget(None)  # its limit is set once the node agreed, below
        factory = self.config.device_factory or functools.partial(
            device_for, stream_priority=self.config.stream_priority
        )
        for index, distrib_optimizer in zip(self._indices, self._distributed):
            engine = OffloadEngine(
                factory(wrappers.device_of(distrib_optimizer)),
                _collector(distrib_optimizer),
                name=f"optimizer {index} ({type(distrib_optimizer).__name__} of "
                f"{type(distrib_optimizer.optimizer).__name__})",
                fingerprint=_fingerprinter(distrib_optimizer),
                budget=budget,
                fraction=float(self.config.offload_fraction),
                streamed=_in_state(distrib_optimizer) if self.config.chunked_update_bytes else None,
                max_piece_bytes=self.config.max_piece_bytes,
            )
            undo.callback(engine.close)
            self._engines.append(engine)
        expected = [wrappers.expected(distrib_optimizer) for distrib_optimizer in self._distributed]
        # Every rank of the node together, before any rank allocates (node_memory.py).
        budget.limit = node_memory.agree(
            sum(engine.host_need(wanted) for engine, wanted in zip(self._engines, expected)),
            pins=any(_pins(engine.device) for engine in self._engines),
            budget=self.config.host_memory_budget,
        )
        for engine, wanted in zip(self._engines, expected):
            engine.reserve_host(wanted)

    def _mark(self, distrib_optimizer) -> None:
        """Make this offloader reachable as ``_state_offloader`` (the name of Megatron-LM's
        own unreleased offloader); ``_unmark`` puts back what was there."""
        had = "_state_offloader" in vars(distrib_optimizer)
        self._marked.append(
            (distrib_optimizer, had, vars(distrib_optimizer).get("_state_offloader"))
        )
        distrib_optimizer._state_offloader = self

    def _unmark(self) -> None:
        for distrib_optimizer, had, previous in reversed(self._marked):
            if getattr(distrib_optimizer, "_state_offloader", None) is not self:
                continue
            if had:
                distrib_optimizer._state_offloader = previous
            else:
                del distrib_optimizer._state_offloader
        self._marked = []

    # --------------------------------------------------------------- hooks
    def register_offload_pre_hook(
        self, hook: Callable[["OptimizerStateOffloader"], None]
    ) -> RemovableHandle:
        """Call ``hook(offloader)`` just before the states are copied out and their device
        memory released: at every ``offload()`` and after every step of an attached
        optimizer. Returns a handle whose ``remove()`` unregisters it (as torch's hooks).
        (Measurement tools read the device's memory here, e.g. ``benchmarks/gpu_report``.)"""
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
    def engines(self) -> tuple[OffloadEngine, ...]:
        return tuple(self._engines)

    @property
    def configured_kinds(self) -> tuple[tuple[str, ...], ...]:
        """What each served optimizer offloads as configured (``per_optimizer`` applied),
        in the order of ``engines``."""
        return tuple(self._configured_kinds)

    @property
    def automatic(self) -> bool:
        """True when ``attach`` runs the per-step cycle: each step reloads what it needs by
        itself (a framework's "to the device" phase has nothing to do)."""
        return self._automatic is not None and not self.detached

    @property
    def is_offloaded(self) -> bool:
        """True while some selected state has no device memory."""
        return any(engine.is_released() for engine in self._engines)

    def stats(self) -> dict:
        """Byte counts and the copy figures of the last cycle, summed over optimizers.

        ``offloaded_bytes``: device bytes currently released (each tensor padded to 16 bytes,
        as it is laid out); ``offloaded_payload_bytes``: the same without that padding;
        ``resident_bytes``: bytes of tracked (or unmovable) state on the device;
        ``host_bytes``: every host buffer held: the arena, buffers handed to it that it has not
        taken yet, and the chunked update's undo buffer (``chunked_update_undo``); ``d2h_copies``/``h2d_copies`` and ``*_bytes``: copy
        operations of the last offload and reload; ``offload_seconds``/``reload_seconds``: host
        time spent issuing them (the copies themselves on a CPU); ``update_chunks``,
        ``update_copies``, ``update_bytes``: chunks and copies of the last chunked update;
        ``pieces``: device storages (pieces) per kind, ``largest_piece_bytes`` the largest.

        Measured on the device (timing events, read now without waiting: the newest
        measurement whose copies have completed): ``d2h_ms``/``h2d_ms``, the transfer time
        of the last offload's and reload's copies, with ``d2h_timed_bytes``/``h2d_timed_bytes``
        and ``d2h_gbps``/``h2d_gbps`` (10^9 bytes per second); ``exposed_ms``, the time the
        compute stream waited for a copy-back at the last ``wait`` that had one pending. On a
        CPU they are the measured copy times, all of them exposed. The chunked update's slot
        copies are in the ``update_*`` figures only.
        ``per_optimizer`` has the same per optimizer. ``numa_node``, ``numa_bound`` and
        ``numa_note``: the NUMA node host buffers were bound to (-1: none), and why not.

        Checkpoints and reads served from the host copy (``host_view``; since attach):
        ``host_view_calls``; ``host_view_save_bytes``, the host-copy bytes handed to code that
        only reads them (a save) in place of released tensors; ``host_view_load_bytes``, those
        handed to code that may write them (a load, a read between steps), plus the bytes of
        new state a load put on the host; ``host_view_wait_ms``, host time spent waiting for
        copies out to complete before serving them; ``host_view_device_bytes``, the most state
        found on the device when one opened (0 in whole mode).
        """
        per = [engine.stats() for engine in self._engines]
        chunked = getattr(self._automatic, "chunked", ()) or ()
        for figures, update in zip(per, chunked):
            if update.undo is not None:  # the chunked update's undo buffer (opt-in)
                figures["host_bytes"] += update.undo.nbytes
        total = {}
        for key in per[0] if per else {}:
            if isinstance(per[0][key], dict):  # counts per kind (``pieces``)
                merged: dict = {}
                for figures in per:
                    for kind, count in figures[key].items():
                        merged[kind] = merged.get(kind, 0) + count
                total[key] = merged
            elif key == "largest_piece_bytes":
                total[key] = max(s[key] for s in per)
            else:
                total[key] = sum(s[key] for s in per)
        for direction in ("d2h", "h2d"):  # of the summed bytes and times, not a sum of rates
            total[f"{direction}_gbps"] = gbps(
                total.get(f"{direction}_timed_bytes", 0), total.get(f"{direction}_ms", 0.0)
            )
        total["cycles"] = self._cycles
        total.update(numa.figures([engine.device for engine in self._engines]))
        total.update(self._host_view_figures)
        total["per_optimizer"] = per
        return total

    # ------------------------------------------------- the upstream-compatible API
    def offload(
        self,
        offload_optimizer_states: bool | None = None,
        offload_primary_weights: bool | None = None,
    ) -> None:
        """Copy the selected states to the host and free their device memory.

        ``None`` for either selection means "as configured". On accelerators the copy is
        asynchronous: the memory goes back to the allocator at once but is reused only once
        the copy has read it.
        """
        self._check_attached()
        self.end_reads()
        self._offload(self._selection(offload_optimizer_states, offload_primary_weights))
        self._sync_state_guard()

    def reload(self) -> None:
        """Regrow the offloaded states and start copying them back.

        Call ``wait()`` before reading them outside a step; a
        step of an attached optimizer waits by itself. Idempotent, and safe in any order: with
        nothing offloaded (before the first offload, or twice in a row) it does nothing, so RL
        frameworks may call their "to the device" phase unconditionally.
        """
        self._check_attached()
        self.end_reads()
        for engine in self._engines:
            engine.reload()
        self._sync_state_guard()

    def prefetch(self) -> None:
        """Start reloading what the step needs whole (asynchronous): everything, except
        the states a chunked update (``chunked_update_bytes``) streams through its slots
        during the step. What ``attach``'s cycle and the training hooks call."""
        if self._reads is not None:
            self.end_reads()
        for engine in self._engines:
            engine.reload(streamed=False)
        self._sync_state_guard()

    def wait(self) -> None:
        """Order every pending copy-back before the current stream (no host block)."""
        if self._reads is not None:
            self.end_reads()
        for engine in self._engines:
            engine.wait()
        self._sync_state_guard()

    def mark_optimizer_states_initialized(self) -> None:
        """Look for new or replaced state tensors at the next offload.

        New states (Adam's moments after the first step, created all at once per parameter)
        are noticed without this, and so are loads through the optimizer and replaced state
        mappings, parameter groups or masters. Call it after changing a parameter's state by
        hand: replacing one of its tensors, or adding a key to a state dict that already
        has states (the per-cycle check does not walk full state dicts).
        """
        for engine in self._engines:
            engine.invalidate()

    # ------------------------------------------------------------- conveniences
    @contextlib.contextmanager
    def offloaded(
        self,
        offload_optimizer_states: bool | None = None,
        offload_primary_weights: bool | None = None,
    ) -> Iterator["OptimizerStateOffloader"]:
        """The selected states offloaded for the duration of the block (an RL rollout).

        The selection is that of ``offload()`` (``None``: as configured), so a run whose
        step cycle keeps the master weights on the device can free them for a rollout with
        ``offloaded(offload_primary_weights=True)``. Nests, and composes with the per-step
        cycle: what is already offloaded on entry is left offloaded on exit; what the block
        offloads is reloaded, and ready for the current stream, on exit.
        """
        self._check_attached()
        self.end_reads()
        selection = self._selection(offload_optimizer_states, offload_primary_weights)
        taken = [
            tuple(kind for kind in kinds if not _all_released(engine, kind))
            for engine, kinds in zip(self._engines, selection)
        ]
        if any(taken):
            self._offload(taken)
            self._sync_state_guard()
        try:
            yield self
        finally:
            if any(taken) and not self.detached:
                for engine, kinds in zip(self._engines, taken):
                    if kinds:
                        engine.reload(kinds)
                for engine, kinds in zip(self._engines, taken):
                    if kinds:
                        # Ordered before the current stream: the caller may step at once.
                        engine.wait(kinds)
                self._sync_state_guard()

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

        ``kinds`` selects what comes back, in the terms of ``offload()``'s selection:
        ``"optimizer_states"`` (the moments) and ``"primary_weights"`` (the master weights),
        either for every optimizer or as one selection per optimizer of a ChainedOptimizer
        (a list as long as ``engines``). None: every kind. What is not selected stays on the
        host (reading it still brings it back, through the state-access guard).
        """
        self._check_attached()
        self.end_reads()
        selection = self._resident_selection(kinds)
        taken = [
            tuple(kind for kind in chosen if engine.is_released((kind,)))
            for engine, chosen in zip(self._engines, selection)
        ]
        for engine, kinds_taken in zip(self._engines, taken):
            if kinds is None and any(taken):
                engine.reload()  # as before: everything, in every engine
            elif kinds_taken:  # an engine with nothing to bring back keeps its copy figures
                engine.reload(kinds_taken)
        for engine, chosen in zip(self._engines, selection):
            engine.wait(chosen)  # also a copy-back started before (a prefetch)
            if any(taken) and not read_only:
                for group in engine.groups:  # engine.mark_dirty(), for the chosen kinds
                    if group.kind in chosen:
                        group.host_valid = False
        self._sync_state_guard()
        try:
            yield self
        finally:
            if any(taken) and not self.detached:
                again = taken
                if kinds is None:  # as before: the configured selection, and what came back
                    again = [
                        tuple(dict.fromkeys(configured + kinds_taken))
                        for configured, kinds_taken in zip(self._selection(None, None), taken)
                    ]
                self._offload(again, skip_unchanged=True)
                self._sync_state_guard()

    def host_view(self, *, writes: bool = False) -> "HostView":
        """Offloaded state seen as its host copy for the duration of the block.

        Inside ``with offloader.host_view():`` every released state tensor and master weight
        is, where the optimizer keeps it (``optimizer.optimizer.state[p][...]``, the
        ``param_groups``, the wrapper's master lists), a CPU tensor viewing its host copy:
        reading it copies nothing to the device. What the block writes into them reaches the
        next step (the prefetch copies the host copy in). Resident states are seen where they
        are; ``writes=True`` says the block may write those too (their host copies become
        stale). On exit the optimizer's own tensor objects are back in place; do not keep the
        host views past the block (the next offload overwrites the host copy). The
        optimizer's checkpoint methods run inside one by themselves.
        """
        self._check_attached()
        return HostView(self, writes=writes)

    def detach(self) -> None:
        """Stop offloading: bring back whatever is offloaded, give back the host memory,
        and leave a plain optimizer (its step, methods and state mapping as before attach).

        Callable in any state, typically after a training loop, when the step cycle has
        offloaded the states; training after it is bitwise that of a run never offloaded.
        """
        if self.detached:
            return
        self.end_reads()
        # The host copies may be the only copies: every engine regrows and copies back
        # what it released (and waits for any copy-out still reading device memory) before
        # its host arena is given back; the waits order the copies before the current
        # stream, which uses the states next.
        for engine in self._engines:
            engine.reload()
        for engine in self._engines:
            engine.wait()
        if self._automatic is not None:
            self._automatic.remove()
            self._automatic = None
        self._guard.remove()
        for engine in self._engines:
            engine.close()
        self._unmark()
        self.detached = True

    # ----------------------------------------------------------------- internals
    def _selection(self, states: bool | None, primaries: bool | None) -> list[tuple[str, ...]]:
        """The kinds to offload, per optimizer: an explicit argument applies to every
        optimizer, None means as configured (``per_optimizer`` included)."""
        selection = []
        for configured in self._configured_kinds:
            wanted = (
                (OPTIMIZER_STATES, OPTIMIZER_STATES in configured if states is None else states),
                (
                    PRIMARY_WEIGHTS,
                    PRIMARY_WEIGHTS in configured if primaries is None else primaries,
                ),
            )
            selection.append(tuple(kind for kind, on in wanted if on))
        return selection

    def _resident_selection(self, kinds) -> list[tuple[str, ...]]:
        """``resident()``'s ``kinds`` as one tuple of kinds per optimizer (None: all)."""
        count = len(self._engines)
        if kinds is None:
            return [KINDS] * count
        if isinstance(kinds, str):
            kinds = (kinds,)
        kinds = list(kinds)
        per_optimizer = kinds if not all(isinstance(k, str) for k in kinds) else [kinds] * count
        if len(per_optimizer) != count:
            raise ValueError(
                f"resident(kinds=...) has {len(per_optimizer)} selections for {count} optimizers; "
                "pass one selection for all, or one per optimizer of the ChainedOptimizer."
            )
        selection = []
        for chosen in per_optimizer:
            chosen = (chosen,) if isinstance(chosen, str) else tuple(chosen)
            unknown = [k for k in chosen if k not in KINDS]
            if unknown:
                raise ValueError(
                    f"resident(kinds=...) got unknown kind(s) {unknown}; the kinds are {list(KINDS)}."
                )
            selection.append(chosen)
        return selection

    def _offload(self, selection: list[tuple[str, ...]], *, skip_unchanged: bool = False) -> None:
        """Copy out (unless ``skip_unchanged`` and still valid) and release, per optimizer."""
        if self._reads is not None:
            self.end_reads()
        for hook in tuple(self._offload_pre_hooks.values()):
            hook(self)
        for engine, kinds in zip(self._engines, selection):
            watch = engine.fingerprint
            if kinds and isinstance(watch, StateWatch) and watch.identities:
                # Tensors the step replaced (SOAP) go back where the layout has them.
                watch.keep_replaced()
            # Released piece by piece as the copies are queued (progressive reuse).
            engine.offload(kinds, skip_unchanged=skip_unchanged, release=True)
        if self.config.release_master_grads:
            # The fp32 gradients megatron-core gave the masters for the step (as large as the
            # masters) are not needed until the next step makes new ones.
            for engine, kinds in zip(self._engines, selection):
                if PRIMARY_WEIGHTS in kinds:
                    engine.fingerprint.release_master_grads()  # O(groups) unless a master holds one
        for hook in tuple(self._offload_post_hooks.values()):
            hook(self)

    def _make_resident(self, *, changes: bool, replaced: bool = False) -> None:
        """Bring every offloaded state back and order it before the current stream.

        The states then stay on the device until the next offload. ``changes``: the caller
        may write them, so the next offload must copy them out again. ``replaced``: the
        caller may put new tensor objects into the state (a load).
        """
        self.end_reads()
        for engine in self._engines:
            if engine.is_released():
                engine.reload()
            engine.wait()
            if changes:
                engine.mark_dirty()
            if replaced:
                engine.invalidate()
        self._sync_state_guard()

    def end_reads(self) -> None:
        """Close the view that served reads between steps (``host_view.serve_reads``): what
        the reader wrote is in the host copy. Every operation of the offloader does this first."""
        view, self._reads = self._reads, None
        if view is not None:
            view.__exit__(None, None, None)

    def _sync_state_guard(self) -> None:
        """Guard the inner optimizers' state mappings while some state is not on the device
        (released, or still being copied), and not otherwise (see ``guard.GuardedState``)."""
        if not self.detached and self._host_view is None:
            self._guard.arm(
                any(
                    group.place is not Place.RESIDENT
                    for engine in self._engines
                    for group in engine.groups
                )
            )

    def _check_attached(self) -> None:
        if self.detached:
            raise OffloadStateError("this offloader was detached; attach a new one to offload.")

    def __getattr__(self, name: str):
        # Only reached for names the class does not have.
        if name in _NOT_OFFERED:
            raise AttributeError(f"OptimizerStateOffloader has no {name}(): {_NOT_OFFERED[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def summary(self) -> str:
        """``stats()`` in one line for people, sizes in KiB/MiB/GiB as they come: offloaded,
        host, the last D2H and H2D with GB/s (once measured), the exposed wait, the cycles."""
        return stats_log.summary(self.stats())

    def __str__(self) -> str:
        state = "detached" if self.detached else f"{len(self._engines)} optimizer(s)"
        return f"OptimizerStateOffloader ({state}): {self.summary()}"

    def __repr__(self) -> str:
        return f"OptimizerStateOffloader({', '.join(map(repr, self._engines))})"


# Methods of Megatron-LM's unreleased offloader that this one does not offer, and why.
_NOT_OFFERED = {
    "release_gpu_memory": "offload() frees the device memory itself (once the copy has read it); drop the call.",
    "sync_before_step": "call wait() (the same: the copy-back is ordered before the current stream).",
}


def _fingerprinter(distrib_optimizer) -> StateWatch:
    """Changes when states are created (lazily, per parameter), a container (the state
    mapping, param groups, masters) is replaced or resized: in O(groups), not O(parameters)
    (see ``adapters/megatron_wrappers.py``). Loads and replacements the guard sees invalidate the
    engine besides."""
    return StateWatch(distrib_optimizer)


# The adapter's walks read the state mapping with dict's own lookup (no reload for looking).
def _in_state(distrib_optimizer):
    def streamed():
        return wrappers.in_state(distrib_optimizer)

    return streamed


def _collector(distrib_optimizer):
    def collect():
        return wrappers.collect(distrib_optimizer)

    return collect


def _pins(device) -> bool:
    """True where host buffers are pinned (counted against ``ulimit -l``)."""
    return bool(device.is_accelerator) and not getattr(device, "pageable_fallback", False)


def _all_released(engine: OffloadEngine, kind: str) -> bool:
    """True if ``engine`` tracks tensors of ``kind`` and all of them are on the host only.

    A kind it does not track yet (nothing offloaded so far) counts as on the device."""
    groups = [group for group in engine.groups if group.kind == kind]
    return bool(groups) and all(group.place is Place.RELEASED for group in groups)
