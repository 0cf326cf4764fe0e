"""Which Megatron optimizers an offloader serves, and one engine for each.

``megatron_optimizers`` finds them in what ``get_megatron_optimizer`` returned: every Megatron
optimizer that wraps a torch optimizer (``DistributedOptimizer``,
``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``), alone or inside a
``ChainedOptimizer`` (``LayerWiseDistributedOptimizer`` is one), nested chains included.
``members`` refuses what cannot be served (``rules.refuse``) and builds a ``Member`` for each
served optimizer: its engine, its host arena allocated (and pinned) now, within the budget
the ranks of the node agreed on (``node_memory``), not inside the first offload.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from .. import rules
from ..adapters import KINDS, MASTER_WEIGHTS, OPTIMIZER_STATES, megatron_fsdp
from ..adapters import megatron_wrappers as wrappers
from ..config import OffloadConfig
from ..device import device_for
from ..engine import HostBudget, OffloadEngine
from ..engine.disk import DiskTier
from ..errors import OffloadStateError
from . import node_memory


@dataclass(frozen=True)
class Member:
    """One served Megatron optimizer: its index among all of the chain's (for
    ``per_optimizer``), the optimizer, its engine and what it offloads as configured."""

    index: int
    optimizer: object
    engine: OffloadEngine
    kinds: tuple[str, ...]


def _wrapper_classes() -> tuple[type, ...]:
    """The Megatron optimizer classes that wrap one torch optimizer (and keep the masters)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    return (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer)


def chain_walk(optimizer):
    """``optimizer`` and, inside every ChainedOptimizer (anything with
    ``chained_optimizers``), its members, depth first in chain order: the one walk of an
    optimizer chain (None: nothing)."""
    if optimizer is None:
        return
    yield optimizer
    for member in getattr(optimizer, "chained_optimizers", None) or ():
        yield from chain_walk(member)


def find_offloader(optimizer):
    """The offloader attached to ``optimizer`` (or to one of its chained optimizers), or None."""
    for candidate in chain_walk(optimizer):
        offloader = getattr(candidate, "_state_offloader", None)
        if offloader is not None:
            return offloader
    return None


def megatron_optimizers(optimizer) -> list:
    """The Megatron optimizers inside ``optimizer`` that hold a torch optimizer, in chain
    order (nested ChainedOptimizers flattened), or a TypeError saying what to do.

    Stub optimizers (a rank without parameters for them: ``optimizer.optimizer is None``)
    are included; the offloader has nothing to move for them (``is_stub``).
    """
    from megatron.core.optimizer import ChainedOptimizer

    classes = _wrapper_classes()
    names = ", ".join(cls.__name__ for cls in classes)
    if isinstance(optimizer, classes):
        return [optimizer]
    if isinstance(optimizer, ChainedOptimizer):
        walked = list(chain_walk(optimizer))
        found = [o for o in walked if isinstance(o, classes)]
        bad = [type(o).__name__ for o in walked if not isinstance(o, (*classes, ChainedOptimizer))]
        if bad or not found:
            raise TypeError(
                "optimizer-state offloading serves the optimizers of a ChainedOptimizer that wrap "
                f"a torch optimizer ({names}, or ChainedOptimizers of them), but found "
                f"{', '.join(bad) or 'no optimizer at all'}. Pass what get_megatron_optimizer "
                "returned, unchanged."
            )
        return found
    raise TypeError(
        "optimizer-state offloading works on what megatron-core's get_megatron_optimizer "
        f"returns ({names}, or a ChainedOptimizer of them), not on {type(optimizer).__name__}. "
        "Build the optimizer with get_megatron_optimizer(OptimizerConfig(...), model_chunks) "
        "and attach to its result."
    )


def is_stub(wrapper) -> bool:
    """True for a Megatron optimizer without a torch optimizer on this rank (nothing to move)."""
    return getattr(wrapper, "optimizer", None) is None or bool(
        getattr(wrapper, "is_stub_optimizer", False)
    )


def refuse_unsupported(wrapper) -> None:
    """Raise before anything is touched if offloading cannot serve ``wrapper``."""
    if getattr(wrapper, "_state_offloader", None) is not None:
        raise OffloadStateError(
            "this optimizer already has a state offloader attached; use that one "
            "(megatron_offload.find_offloader(optimizer)), or call its detach() before "
            "attaching again."
        )
    rules.refuse(wrapper, getattr(wrapper, "config", None), getattr(wrapper, "ddp_config", None))


def members(optimizer, config: OffloadConfig, undo: contextlib.ExitStack) -> list[Member]:
    """A ``Member`` for every served optimizer of ``optimizer``, each engine's host arena
    reserved; every engine made is closed by ``undo`` if a later step fails."""
    found = megatron_optimizers(optimizer)
    for wrapper in found:
        refuse_unsupported(wrapper)
    served = [(index, wrapper) for index, wrapper in enumerate(found) if not is_stub(wrapper)]
    # Its limit is set once the node agreed, below; the disk tier's directory is checked now.
    budget = HostBudget(
        None, disk=DiskTier(config.offload_disk_dir) if config.offload_disk_dir else None
    )
    factory = config.device_factory or functools.partial(
        device_for, stream_priority=config.stream_priority
    )
    made = []
    for index, wrapper in served:
        device = factory(wrappers.device_of(wrapper))
        if device.is_accelerator:
            # A pin that fails falls back to pageable memory with a warning, unless refused.
            device.pageable_fallback = not config.require_pinned_memory
        engine = OffloadEngine(
            device,
            functools.partial(wrappers.collect, wrapper),
            name=f"optimizer {index} ({type(wrapper).__name__} of "
            f"{type(wrapper.optimizer).__name__})",
            # Changes when states are created (lazily, per parameter) or a container (the
            # state mapping, param groups, masters) is replaced or resized: in O(groups).
            fingerprint=wrappers.StateWatch(wrapper),
            budget=budget,
            fraction=float(config.offload_fraction),
            streamed=(
                functools.partial(wrappers.in_state, wrapper)
                if config.chunked_update_bytes
                else None
            ),
            max_piece_bytes=config.max_piece_bytes,
            # Megatron-FSDP's master buffers: viewed by its optimizer's parameters, so they are
            # released and regrown in place (an empty list elsewhere).
            in_place=functools.partial(megatron_fsdp.master_buffers, wrapper),
        )
        undo.callback(engine.close)
        made.append(Member(index, wrapper, engine, config.kinds(index)))
    expected = [wrappers.expected(member.optimizer) for member in made]
    # Every rank of the node together, before any rank allocates (node_memory.py).
    need = sum(m.engine.host_need(wanted) for m, wanted in zip(made, expected))
    auto = config.host_memory_budget == "auto"
    if budget.disk is not None and not auto:
        need = min(need, config.host_memory_budget)  # the disk tier holds the rest
    budget.limit, pin = node_memory.agree(
        need,
        # "auto" with a disk tier: this rank's part of what the node can give, the rest on disk.
        spill=budget.disk is not None and auto,
        pins=any(m.engine.device.is_accelerator for m in made),
        budget=config.host_memory_budget,
        fallback=not config.require_pinned_memory,
    )
    if not pin:
        for member in made:
            member.engine.device.pinning = False  # over ulimit -l: pageable (warned)
    failure = None
    try:
        for member, wanted in zip(made, expected):
            member.engine.reserve_host(wanted)
    except Exception as error:  # a budget, the system, a full disk: this rank's own
        failure = error
    # The ranks go on, or raise, together: a rank that attached would otherwise wait in its
    # first collective for one that did not (``undo`` gives back what this rank reserved).
    if not node_memory.every_rank(failure is None):
        if failure is not None:
            raise failure
        raise OffloadStateError(
            "attach: another rank could not reserve its host memory or its disk tier file, so "
            "this rank gave back what it reserved (that rank's error says why). Nothing was "
            "offloaded; attach again once that is fixed."
        )
    return made


def master_weights_option(value: bool | None, primary: bool | None) -> bool | None:
    """``offload_master_weights``, or PR #2811's ``offload_primary_weights`` (not both)."""
    if primary is not None and value is not None and primary != value:
        raise TypeError(
            "offload_primary_weights is another name of offload_master_weights; pass one of them."
        )
    return value if value is not None else primary


def selection(configured, states: bool | None, masters: bool | None) -> list[tuple[str, ...]]:
    """The kinds ``offload()`` moves, per optimizer (``configured``: each one's kinds): an
    explicit argument applies to every optimizer, None means as configured."""
    chosen = []
    for kinds in configured:
        wanted = (
            (OPTIMIZER_STATES, OPTIMIZER_STATES in kinds if states is None else states),
            (MASTER_WEIGHTS, MASTER_WEIGHTS in kinds if masters is None else masters),
        )
        chosen.append(tuple(kind for kind, on in wanted if on))
    return chosen


def resident_selection(kinds, count: int) -> list[tuple[str, ...]]:
    """``resident()``'s ``kinds`` as one tuple of kinds per optimizer (None: all)."""
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
