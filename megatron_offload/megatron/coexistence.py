"""Coexistence with a Megatron that has an optimizer-state offloader (and flags) of its own.

Megatron-LM's ``dev`` branch defines ``--offload-optimizer-states`` itself (dest
``offload_optimizer_states``, the same as this project's): a deprecated alias of its own chunked
offloader, ``--chunked-optimizer-state-offload``. Megatron's ``validate_args`` applies the
chunked offloader's checks when the alias is set, and ``get_megatron_optimizer_config`` copies
it into ``OptimizerConfig.offload_optimizer_states``, whose ``__post_init__`` warns
(FutureWarning), sets ``chunked_optimizer_state_offload`` and clears the alias; the distributed
optimizer then builds Megatron's offloader.

Run through megatron-offload (the launcher, ``patch_megatron()`` or the source patches), the
flag selects megatron-offload's offloader, and exactly one offloader runs:

* ``add_arguments`` takes over a ``--offload-optimizer-states`` Megatron already defines with
  the same dest and action (its help then describes this project's meaning), and still adds
  every tuning flag; any other flag or dest of this project that Megatron already defines is
  refused with a clear error instead of argparse's conflict or a silently shared value.
* ``validate_args`` refuses ``--chunked-optimizer-state-offload`` (and Megatron's tuning flags
  of it) together with ``--offload-optimizer-states``, before anything is built.
* ``patch_megatron()`` hides the alias (``args.offload_optimizer_states`` reads False for the
  call) from Megatron's ``validate_args`` and ``get_megatron_optimizer_config``, so Megatron
  neither applies its offloader's checks nor turns it on.
* ``attach_for_training`` refuses an optimizer on which Megatron's offloader is enabled anyway,
  and its one log line says which offloader is active and why.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from .. import rules
from ..errors import OffloadArgumentError
from ..offloader.members import chain_walk
from ..rules import MEGATRON_OFFLOADER_FIELD as MEGATRON_DEST
from ..rules import MEGATRON_OFFLOADER_FLAG as MEGATRON_FLAG
from ..rules import SWITCH as OFFLOAD_FLAG
from ..rules import offload_enabled

CHUNKED_FLAG = "--offload-chunked-update-bytes"

# Megatron's tuning flags of its own offloader: (option, dest, Megatron's default, what to use
# with megatron-offload instead).
MEGATRON_TUNING_FLAGS = (
    (
        "--optimizer-state-offload-chunk-size-mb",
        "optimizer_state_offload_chunk_size_mb",
        0,
        f"{CHUNKED_FLAG} bounds the device memory of megatron-offload's update",
    ),
    (
        "--optimizer-state-offload-fraction",
        "optimizer_state_offload_fraction",
        1.0,
        "megatron-offload offloads every state; --offload-fraction offloads the largest "
        "ones only, --no-offload-master-weights keeps the master weights",
    ),
)
# The only flag of this project that a Megatron may define too (as the alias above): taken
# over when it stores the same value in the same dest.
ADOPTABLE_FLAGS = (OFFLOAD_FLAG,)

KEPT_OFF_NOTE = (
    "megatron-offload's offloader is active and Megatron's own chunked optimizer-state "
    f"offloader ({MEGATRON_FLAG}) is off: run through megatron-offload, {OFFLOAD_FLAG} selects "
    "megatron-offload's offloader (this Megatron also reads it as a deprecated alias of its "
    "own), and only one offloader may manage the optimizer states"
)
MEGATRON_ACTIVE_LINE = (
    "> optimizer-state offloading: Megatron's own chunked optimizer-state offloader is active "
    f"({MEGATRON_FLAG}); megatron-offload's is off (no {OFFLOAD_FLAG})"
)

_MARK = "_megatron_offload_flag"  # set on the argparse actions this project added or took over


# ------------------------------------------------------------------------------ the parser
def add_flags(parser: argparse.ArgumentParser, flags, title: str) -> argparse.ArgumentParser:
    """Add ``flags`` (``(option, add_argument kwargs)`` pairs) to ``parser``, once.

    Flags this project already added are skipped (idempotent); ``--offload-optimizer-states``
    defined by Megatron is taken over; any other clash is an ``OffloadArgumentError``.
    """
    group = None
    for option, kwargs in flags:
        existing = parser._option_string_actions.get(option)
        if existing is not None:
            if not getattr(existing, _MARK, None):
                _adopt(existing, option, kwargs)
            continue
        probe = _probe(option, kwargs)
        for action in parser._actions:
            if action.dest == probe.dest and not getattr(action, _MARK, None):
                _refuse_clash(
                    option,
                    f"{'/'.join(action.option_strings) or action.dest} "
                    f"already stores into args.{probe.dest}, which {option} sets",
                )
        if group is None:
            group = parser.add_argument_group(title=title)
        setattr(group.add_argument(option, **kwargs), _MARK, "added")
    return parser


def _probe(option: str, kwargs: dict) -> argparse.Action:
    """The action ``add_argument(option, **kwargs)`` makes, on a scratch parser."""
    return argparse.ArgumentParser(add_help=False).add_argument(option, **kwargs)


def _shape(action: argparse.Action) -> tuple:
    return (
        type(action),
        action.dest,
        action.nargs,
        action.const,
        action.default,
        action.type,
        action.choices,
    )


def _adopt(existing: argparse.Action, option: str, kwargs: dict) -> None:
    probe = _probe(option, kwargs)
    if option not in ADOPTABLE_FLAGS:
        _refuse_clash(option, f"it defines {option} itself")
    if _shape(existing) != _shape(probe):
        _refuse_clash(
            option,
            f"it defines {option} differently (dest {existing.dest!r}, "
            f"default {existing.default!r}, {type(existing).__name__})",
        )
    existing.help = (
        f"{probe.help} [megatron-offload: this Megatron also defines {option}, as its own "
        f"offloader's deprecated alias; here it selects megatron-offload's offloader, and "
        f"Megatron's stays off.]"
    )
    setattr(existing, _MARK, "adopted")


def _refuse_clash(option: str, what: str) -> None:
    raise OffloadArgumentError(
        f"megatron-offload cannot add {option} to this Megatron's argument parser: {what}, "
        f"so the two would share one value. Use a megatron-offload release made for this "
        f"Megatron version, or a Megatron version that does not define it."
    )


# ------------------------------------------------------------------------------ validation
def refuse_conflicts(args) -> None:
    """With offloading on: refuse Megatron's own offloader (``rules.refuse``) and its tuning
    flags (read from ``args`` only, so before anything is built)."""
    if not offload_enabled(args):
        return
    rules.refuse(args)
    for option, dest, default, instead in MEGATRON_TUNING_FLAGS:
        value = getattr(args, dest, default)
        if value != default:
            raise OffloadArgumentError(
                f"{option} {value} tunes Megatron's own chunked offloader ({MEGATRON_FLAG}), "
                f"which stays off with {OFFLOAD_FLAG} (megatron-offload's offloader), so it "
                f"would have no effect. Drop {option} ({instead}), or use {MEGATRON_FLAG} "
                f"without {OFFLOAD_FLAG}."
            )


# ------------------------------------------------------------------- Megatron's offloader
def megatron_has_own_offloader(args=None, config_cls=None, optimizer=None) -> bool:
    """Whether this Megatron has its own optimizer-state offloader: its flag's dest in ``args``,
    its field in ``config_cls`` (``OptimizerConfig``) or in ``optimizer``'s configs."""
    if args is not None and hasattr(args, MEGATRON_DEST):
        return True
    if config_cls is not None and dataclasses.is_dataclass(config_cls):
        if any(field.name == MEGATRON_DEST for field in dataclasses.fields(config_cls)):
            return True
    return any(hasattr(getattr(o, "config", None), MEGATRON_DEST) for o in _optimizers(optimizer))


def megatron_offloader_enabled(optimizer) -> bool:
    """Whether Megatron's own offloader is on for ``optimizer`` (or a chained optimizer)."""
    return any(
        rules.megatron_offloader_on(candidate)
        or rules.megatron_offloader_on(getattr(candidate, "config", None))
        for candidate in _optimizers(optimizer)
    )


def _optimizers(optimizer) -> list:
    return list(chain_walk(optimizer))


@contextlib.contextmanager
def alias_hidden(args, config_cls=None):
    """``args.offload_optimizer_states`` reads False inside the block when it selects
    megatron-offload's offloader and this Megatron would read it as its own offloader's alias;
    restored after it (megatron-offload keeps reading it)."""
    if not (offload_enabled(args) and megatron_has_own_offloader(args, config_cls)):
        yield
        return
    args.offload_optimizer_states = False
    try:
        yield
    finally:
        args.offload_optimizer_states = True


def refuse_enabled_optimizer(optimizer) -> None:
    """Before megatron-offload attaches: refuse an optimizer (or a member of a chain) that
    Megatron's offloader manages, or that ``rules.refuse`` refuses otherwise."""
    for candidate in _optimizers(optimizer):
        rules.refuse(candidate, getattr(candidate, "config", None))


def refuse_enabled_config(args, config) -> None:
    """After Megatron built its ``OptimizerConfig`` from ``args``: refuse one that enables
    Megatron's offloader (or anything else ``rules.refuse`` refuses) when ``args`` selects
    megatron-offload's."""
    if offload_enabled(args):
        rules.refuse(config)
