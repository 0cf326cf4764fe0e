"""Options of the offloader: one dataclass, validated in one place.

Every field is also a flag of Megatron's command line (``megatron/arguments.py``): the field's
name with ``--offload-`` in front (not twice), in the same unit; ``flag(name)`` gives it. A
refusal names both, so it reads the same from ``attach`` and from the command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable

#: Fields that are not flags: ``device_factory`` is a callable (testing and other devices).
NOT_FLAGS = ("device_factory",)
#: Megatron-LM PR #2811's name of ``offload_master_weights``, accepted by ``attach`` too.
ALIASES = {"offload_primary_weights": "offload_master_weights"}
PREFETCH_POINTS = ("step", "gradients")


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``--offload-`` and its name in dashes."""
    dashed = name.replace("_", "-")
    return f"--{dashed}" if name.startswith("offload_") else f"--offload-{dashed}"


def _named(name: str) -> str:
    return f"{name} ({flag(name)})" if name not in NOT_FLAGS else name


@dataclass
class OffloadConfig:
    """What to offload and how. Every field is keyword-only when passed to ``attach``."""

    offload_optimizer_states: bool = True
    """Offload the inner optimizer's per-parameter tensors (Adam's ``exp_avg``/``exp_avg_sq``)."""

    offload_master_weights: bool = True
    """Offload the fp32 master weights (only exist for bf16/fp16 models: fp32 models have
    their master weights in the model parameters, which the forward pass needs). Megatron-LM
    PR #2811 called them primary weights: ``offload_primary_weights`` is accepted for it."""

    release_master_grads: bool = True
    """After the step, drop the ``.grad`` of master-weight shards, as ``zero_grad`` would
    before the next iteration; with bf16 gradients it is an fp32 copy worth 4 bytes per
    parameter that otherwise stays on the device between iterations."""

    offload_fraction: float = 1.0
    """Partial offload: offload only this fraction of each optimizer's selected bytes,
    whole tensors, largest first (0 keeps everything on the device, 1 offloads all). For
    users with some device memory to spare who want less traffic."""

    host_memory_budget: int | str | None = None
    """Most host bytes the offloader may hold (None: no limit; ``"auto"``: this rank's part of
    what its node and container can give, in proportion to its need). Checked at attach,
    before any host memory is allocated; exceeding it raises ``HostMemoryBudgetError`` naming
    the need. Whatever the budget, attach also refuses a node whose ranks need more host
    memory together than it can give (``offloader/node_memory.py``), except with
    ``offload_disk_dir`` and ``"auto"``: the rest then goes to the disk tier."""

    offload_disk_dir: str | None = None
    """A directory on a local disk (NVMe) for what ``host_memory_budget`` cannot hold: the
    pieces that do not fit the budget keep their host copies in a file there instead (the
    largest first), allocated in full at attach and unlinked from the start, so nothing is
    left behind. The cycle is unchanged: the states and masters still leave the device after
    the step and come back before the next, bitwise. The copies of the pieces on disk go
    through a staging buffer counted in the budget (written with direct I/O where the
    filesystem has it, read with the page cache dropped as they go: no page of the file is
    in host memory after an offload), and the host waits for the disk: 2 x bytes on disk /
    disk rate per step. Needs a ``host_memory_budget``: bytes, or ``"auto"``
    (this rank's part of what its node and container can give; the node check then spills
    instead of refusing). tmpfs is refused (its files are host memory). See
    docs/disk-tier.md."""

    prefetch: str | float = "gradients"
    """When the copy back of the states starts. ``"gradients"`` (the default): when the
    gradients are reduced, from the model config's ``finalize_model_grads_func`` (what
    megatron.training, Megatron-Bridge and megatron-core's schedules call once the backward
    pass is done), so the copy overlaps the reduction; where the loop has none when
    ``attach`` runs, at ``optimizer.step()``. ``"step"``: when ``optimizer.step()`` begins, so
    the copy overlaps the gradient copy, unscale, norm and clipping. A number f in (0, 1):
    once the backward pass has produced the gradients of a fraction f of the parameters (by
    bytes, in backward order), so the copy also overlaps the rest of the backward pass, at
    the price of holding the states during it. The states occupy no device memory before
    that point."""

    chunked_update_bytes: int | None = None
    """Chunked update (``attach`` only): keep the offloaded states on the host during the
    step too, and stream them through device slots taking at most this many bytes in all,
    chunk by chunk of parameters, so that the update needs this much device memory for
    them instead of their whole size. Bitwise identical to the whole update; costs one
    copy per chunk and direction and a little overlap. None: the states are reloaded whole
    for the step. The master weights megatron-core keeps beside the optimizer (fp32 copies
    of bf16/fp16 parameters) are still reloaded whole, since megatron copies them into the
    model after the update. Each parameter's states must fit in one slot
    (``chunked_update_bytes / chunked_update_slots``)."""

    chunked_update_slots: int = 2
    """Slots the chunked update rotates through (splitting ``chunked_update_bytes``): with
    2, the copies of one chunk overlap the update of the next; 1 uses the whole budget for
    one slot, without overlap."""

    chunked_update_undo: bool = False
    """Opt in to making a chunked step that fails part-way (an update call or a copy raises,
    for example out of memory for the optimizer's temporaries) change nothing: before each
    update call, what it may write (its parameters, the slot with their states, the scales
    and step counts kept on the device) is copied to the host, and written back if the step
    fails. Parameters, group steps and states are then byte for byte as before the step,
    which can be retried. Costs one more device-to-host copy of those bytes per step (1.5x
    the bytes over the link of the default) and a pinned host buffer as large as everything
    the update writes (about 2x the host memory of the default; pinned at attach, counted in
    ``host_memory_budget`` and in ``stats()["host_bytes"]``). Off (the default): a step that
    does not fit its budget is still refused before anything is touched; a failure the plan
    cannot foresee leaves the update of the calls that ran, and the step is not retried
    safely (load the last checkpoint)."""

    max_piece_bytes: int = 256 << 20
    """Largest device storage the offloader frees and regrows as one (default 256 MiB). The
    states of one kind and dtype are laid out in pieces of at most this size (a larger
    tensor gets a piece of its own), each with its own copy and events, and each piece's
    memory is released as soon as its own copy to the host is queued. On a GPU the caching
    allocator can then hand the first pieces to the next forward pass while the later ones
    are still being copied, and a regrowth never needs one huge contiguous block. Smaller
    pieces mean finer reuse but more copies per cycle (bytes / piece + groups per direction,
    a few microseconds of launch each); see docs/memory-on-gpu.md."""

    stream_priority: int = 0
    """Priority of the offloader's side streams (the D2H and H2D copies), in CUDA's
    convention: 0, the default, is the lowest priority and that of torch's compute stream
    and NCCL's collectives (unless NCCL is asked for high-priority streams); negative numbers
    are higher, and the device clamps them to its range (``torch.cuda.Stream.priority_range()``).
    A scheduling hint: the device prefers pending work of higher-priority streams, it never
    preempts running work. The streams are the offloader's own whatever the priority (created
    with cuda-python, never taken from torch's stream pool that ProcessGroupNCCL shares; see
    ``megatron_offload/device/accelerator.py``)."""

    require_pinned_memory: bool = False
    """Refuse to offload into pageable host memory. By default, where host memory cannot be
    pinned (a rank would pin more than its ``ulimit -l`` or its container's memlock limit, or
    pinning fails), the host buffers fall back to pageable memory with one warning: every
    copy to or from them is then synchronous with the host, so offloading no longer overlaps
    computation (``stats()["pinned_host_bytes"]`` says what is pinned). True refuses instead,
    before anything is allocated, as a run that must overlap its copies wants."""

    per_optimizer: dict[int, dict[str, bool]] | None = None
    """Overrides of ``offload_optimizer_states`` / ``offload_master_weights`` for single
    optimizers of a ChainedOptimizer, by index in ``chained_optimizers`` (nested chains such
    as ``LayerWiseDistributedOptimizer`` flattened, in order; for example
    ``{1: {"offload_master_weights": False}}`` to keep the expert optimizer's masters on
    the device in a MoE model). Optimizers not named use the fields above."""

    device_factory: Callable[[Any], Any] | None = None
    """Advanced/testing: ``device_factory(torch_device) -> megatron_offload.device.Device``
    replaces the device layer picked from the parameters' device."""

    def __post_init__(self) -> None:
        if isinstance(self.per_optimizer, dict):
            self.per_optimizer = {
                index: {ALIASES.get(name, name): value for name, value in override.items()}
                if isinstance(override, dict)
                else override
                for index, override in self.per_optimizer.items()
            }
        self.validate()

    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the bad option (and its flag) and what to
        pass instead."""
        for name in (
            "offload_optimizer_states",
            "offload_master_weights",
            "release_master_grads",
            "chunked_update_undo",
            "require_pinned_memory",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"OffloadConfig.{_named(name)} must be True or False, got {value!r}."
                )
        fraction = self.offload_fraction
        if _not_number(fraction) or not 0 <= fraction <= 1:
            raise ValueError(
                f"OffloadConfig.{_named('offload_fraction')} must be a number from 0 to 1, got "
                f"{fraction!r}."
            )
        budget = self.host_memory_budget
        if budget is not None and budget != "auto" and (_not_int(budget) or budget < 0):
            raise ValueError(
                f"OffloadConfig.{_named('host_memory_budget')} must be a number of bytes "
                f'(int >= 0), "auto" or None, got {budget!r}.'
            )
        disk_dir = self.offload_disk_dir
        if disk_dir is not None:
            if not isinstance(disk_dir, (str, os.PathLike)) or not os.fspath(disk_dir):
                raise TypeError(
                    f"OffloadConfig.{_named('offload_disk_dir')} must be a directory path or "
                    f"None, got {disk_dir!r}."
                )
            if budget is None:
                raise ValueError(
                    f"OffloadConfig.{_named('offload_disk_dir')} needs "
                    f'{_named("host_memory_budget")}: bytes, or "auto" (this rank\'s part of '
                    "what its node can give); the disk tier holds what that budget cannot."
                )
        prefetch = self.prefetch
        if prefetch not in PREFETCH_POINTS and (_not_number(prefetch) or not 0 < prefetch < 1):
            raise ValueError(
                f'OffloadConfig.{_named("prefetch")} must be "gradients", "step" or a fraction '
                f"of the backward pass strictly between 0 and 1, got {prefetch!r}."
            )
        chunk = self.chunked_update_bytes
        if chunk is not None and (_not_int(chunk) or chunk <= 0):
            raise ValueError(
                f"OffloadConfig.{_named('chunked_update_bytes')} must be a number of bytes "
                f"(int > 0) or None, got {chunk!r}."
            )
        slots = self.chunked_update_slots
        if _not_int(slots) or slots < 1:
            raise ValueError(
                f"OffloadConfig.{_named('chunked_update_slots')} must be an int >= 1, got {slots!r}."
            )
        piece = self.max_piece_bytes
        if _not_int(piece) or piece <= 0:
            raise ValueError(
                f"OffloadConfig.{_named('max_piece_bytes')} must be a positive number of bytes "
                f"(int > 0), got {piece!r}; the default is {256 << 20} (256 MiB)."
            )
        priority = self.stream_priority
        if _not_int(priority) or priority > 0:
            raise ValueError(
                f"OffloadConfig.{_named('stream_priority')} must be an int <= 0, got "
                f"{priority!r}: 0 (the default) is the lowest CUDA stream priority, negative "
                "numbers are higher."
            )
        if chunk is not None and fraction < 1:
            raise ValueError(
                f"OffloadConfig.{_named('chunked_update_bytes')} cannot be combined with "
                f"{_named('offload_fraction')} < 1: partial offload picks tensors by size across "
                "all parameters, the chunked update streams every offloaded state per parameter. "
                "Use one of them."
            )
        if self.chunked_update_undo and chunk is None:
            raise ValueError(
                f"OffloadConfig.{_named('chunked_update_undo')} has no effect without "
                f"{_named('chunked_update_bytes')}: set both, or drop it."
            )
        if chunk is not None and chunk < slots * 16:
            raise ValueError(
                f"OffloadConfig.{_named('chunked_update_bytes')}={chunk} is too small for "
                f"{slots} slot(s); give each slot at least one parameter's states."
            )
        selectable = ("offload_optimizer_states", "offload_master_weights")
        for index, override in (self.per_optimizer or {}).items():
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                raise TypeError(
                    f"OffloadConfig.{_named('per_optimizer')} keys are optimizer indices "
                    f"(0, 1, ...), got {index!r}."
                )
            if not isinstance(override, dict):
                raise TypeError(f"OffloadConfig.per_optimizer[{index}] must be a dict of options.")
            for name, value in override.items():
                if name not in selectable:
                    raise TypeError(
                        f"OffloadConfig.per_optimizer[{index}] has unknown option {name!r}; "
                        f"per-optimizer options are {', '.join(selectable)}."
                    )
                if not isinstance(value, bool):
                    raise TypeError(
                        f"OffloadConfig.per_optimizer[{index}][{name!r}] must be True or False, "
                        f"got {value!r}."
                    )
        if self.device_factory is not None and not callable(self.device_factory):
            raise TypeError(
                "OffloadConfig.device_factory must be callable(torch_device) -> Device."
            )

    @classmethod
    def from_options(cls, config: "OffloadConfig | None" = None, **options) -> "OffloadConfig":
        """A config from an optional base config and keyword overrides, refusing unknown names
        (``offload_primary_weights`` is ``offload_master_weights``); ``config`` itself when
        nothing overrides it (``attach`` builds the config once and hands it on)."""
        if config is not None and not options:
            return config
        for alias, name in ALIASES.items():
            if alias in options:
                if name in options and options[name] != options[alias]:
                    raise TypeError(f"{alias} is another name of {name}; pass one of them.")
                options[name] = options.pop(alias)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown offload option(s) {', '.join(unknown)}; valid options are "
                f"{', '.join(sorted(known))}."
            )
        base = {f.name: getattr(config, f.name) for f in fields(cls)} if config else {}
        base.update(options)
        return cls(**base)

    def kinds(self, index: int | None = None) -> tuple[str, ...]:
        """The kinds offloaded for optimizer ``index`` (the defaults when None)."""
        from .adapters import MASTER_WEIGHTS, OPTIMIZER_STATES

        override = (self.per_optimizer or {}).get(index, {}) if index is not None else {}
        selected = []
        if override.get("offload_optimizer_states", self.offload_optimizer_states):
            selected.append(OPTIMIZER_STATES)
        if override.get("offload_master_weights", self.offload_master_weights):
            selected.append(MASTER_WEIGHTS)
        return tuple(selected)


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _not_number(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float))
