"""Command-line flags for Megatron's argument parser, and their validation.

Every field of ``OffloadConfig`` is a flag, named as the field with ``--offload-`` in front
(``config.flag``), in the field's unit; ``config_from_args`` maps every one of them.
``--offload-optimizer-states`` turns offloading on (the optimizer states and, unless
``--no-offload-master-weights``, the master weights); ``--offload-master-weights`` alone
offloads only the master weights. Pretrain-only: ``--no-offload-log-stats``.

``add_arguments(parser)`` has the signature of Megatron's ``extra_args_provider`` (it returns
the parser), so a script can pass it to ``parse_and_validate_args`` directly;
``patch_megatron()`` adds the same flags to every Megatron parser. ``validate_args(args)``
raises ``OffloadArgumentError`` (a ``ValueError``) for every combination that cannot work,
naming the flags and what to do instead. It reads only ``args``, so it runs (and fails)
before any process group, model or optimizer exists, and it accepts the namespace both before
and after Megatron's own ``validate_args`` (which derives some flags from others).

A Megatron that defines ``--offload-optimizer-states`` itself (Megatron-LM ``dev``: an alias of
its own chunked offloader) is handled in ``coexistence``: the flag selects megatron-offload's
offloader and Megatron's stays off.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import fields

from ..config import NOT_FLAGS, PREFETCH_POINTS, OffloadConfig, flag
from ..errors import OffloadArgumentError
from ..rules import SWITCH, offload_enabled
from .coexistence import add_flags, refuse_conflicts

MASTERS_FLAG = flag("offload_master_weights")
CHUNKED_FLAG = flag("chunked_update_bytes")
LOG_FLAG = "--offload-log-stats"

__all__ = [
    "SWITCH",
    "OffloadArgumentError",
    "add_arguments",
    "config_from_args",
    "dest",
    "offload_enabled",
    "validate_args",
]


def dest(name: str) -> str:
    """The ``args`` attribute of field ``name``'s flag."""
    return flag(name)[2:].replace("-", "_")


def _budget(text: str):
    return "auto" if text == "auto" else int(text)


def _prefetch(text: str):
    return text if text in PREFETCH_POINTS else float(text)


def _per_optimizer(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object of optimizer index -> options")
    try:
        return {int(index): options for index, options in value.items()}
    except ValueError:
        raise argparse.ArgumentTypeError("the keys are optimizer indices (0, 1, ...)") from None


# Per field: (argparse keyword arguments, help). Defaults are None ("as the field's default")
# so that a flag given without offloading on can be told from one not given.
_FIELD_FLAGS = {
    "offload_optimizer_states": (
        dict(action="store_true"),
        "Keep the optimizer's states (Adam's exp_avg and exp_avg_sq, momentum buffers, ...) and "
        "the fp32 master weights in host memory between optimizer steps: they are copied to the "
        "host after each step, their device memory is freed, and they are copied back while the "
        "gradients are reduced. The update itself still runs on the accelerator and gives "
        "bitwise the same results. Works with every --optimizer megatron-core builds, with or "
        "without --use-distributed-optimizer; not with --optimizer-cpu-offload, which runs Adam "
        "on the CPU.",
    ),
    "offload_master_weights": (
        dict(action=argparse.BooleanOptionalAction, default=None),
        "Offload the fp32 master weights (default: with --offload-optimizer-states). "
        "--no-offload-master-weights keeps them on the accelerator; --offload-master-weights "
        "without --offload-optimizer-states offloads only them (needs --bf16 or --fp16).",
    ),
    "release_master_grads": (
        dict(action=argparse.BooleanOptionalAction, default=None),
        "Drop the .grad of the fp32 master weights after the step (default), as zero_grad would "
        "before the next backward; --no-offload-release-master-grads keeps it.",
    ),
    "offload_fraction": (
        dict(type=float, default=None, metavar="F"),
        "Offload only the largest tensors making up this fraction of the bytes (default 1).",
    ),
    "host_memory_budget": (
        dict(type=_budget, default=None, metavar="BYTES|auto"),
        "Most host bytes the offloader may hold, or 'auto': this rank's part of what its node "
        "and container can give. Refused at start-up if too small.",
    ),
    "offload_disk_dir": (
        dict(type=str, default=None, metavar="PATH"),
        "A directory on a local disk (NVMe) for the optimizer states and master weights that "
        "--offload-host-memory-budget (bytes or auto, required) cannot hold; not tmpfs.",
    ),
    "prefetch": (
        dict(type=_prefetch, default=None, metavar="gradients|step|F"),
        "When the copy back starts: 'gradients' (default; during the gradient reduction), "
        "'step' (at the optimizer step), or a fraction F of the backward pass.",
    ),
    "chunked_update_bytes": (
        dict(type=int, default=None, metavar="BYTES"),
        "Keep the optimizer states in host memory during the step too, streamed through device "
        "slots taking at most BYTES in all (for example 1073741824 for 1 GiB). Bitwise the same "
        "results; each parameter shard's states must fit in one slot.",
    ),
    "chunked_update_slots": (
        dict(type=int, default=None, metavar="N"),
        "Slots the chunked update rotates through (default 2: the copies overlap the update).",
    ),
    "chunked_update_undo": (
        dict(action="store_true"),
        "Keep host copies of what each chunked update call writes, so that a chunked step that "
        "fails part-way is undone, at the cost of one more copy of them to the host per step "
        "and as much pinned host memory.",
    ),
    "max_piece_bytes": (
        dict(type=int, default=None, metavar="BYTES"),
        "Largest device storage the offloader frees and regrows as one (default 268435456, 256 "
        "MiB). Smaller pieces free memory sooner and fragment less, at a few microseconds of "
        "copy launch each.",
    ),
    "stream_priority": (
        dict(type=int, default=None, metavar="N"),
        "CUDA priority of the offloader's copy streams (default 0, the lowest; negative: higher).",
    ),
    "require_pinned_memory": (
        dict(action="store_true"),
        "Refuse to start where host memory cannot be pinned (ulimit -l, the container's memlock "
        "limit) instead of falling back to pageable memory, whose copies are synchronous.",
    ),
    "per_optimizer": (
        dict(type=_per_optimizer, default=None, metavar="JSON"),
        'Selections per optimizer of the chain, e.g. \'{"1": {"offload_master_weights": false}}\'.',
    ),
}
assert set(_FIELD_FLAGS) == {f.name for f in fields(OffloadConfig)} - set(NOT_FLAGS)
_STORE_TRUE = {
    name for name, (kwargs, _) in _FIELD_FLAGS.items() if kwargs.get("action") == "store_true"
}


def _flags() -> list:
    """``(option, add_argument kwargs)`` of every flag this project adds."""
    found = []
    for name, (kwargs, help_text) in _FIELD_FLAGS.items():
        found.append((flag(name), dict(kwargs, dest=dest(name), help=help_text)))
    found.append(
        (
            LOG_FLAG,
            dict(
                action=argparse.BooleanOptionalAction,
                default=None,
                dest="offload_log_stats",
                help="Print the offloaded and host bytes and the copy times at each "
                "--log-interval, and write them to TensorBoard/W&B (default);"
                " --no-offload-log-stats does not.",
            ),
        )
    )
    return found


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--offload-optimizer-states`` and the other flags to ``parser``; returns it.

    Usable as Megatron's ``extra_args_provider``. Adding them twice to the same parser is a
    no-op (so a script's own provider and ``patch_megatron()`` do not collide). A Megatron that
    defines ``--offload-optimizer-states`` itself (an alias of its own offloader) keeps its
    action, which megatron-offload takes over; the other flags are added all the same. Any
    other flag or dest Megatron already defines is an ``OffloadArgumentError`` (see
    ``coexistence``), never argparse's conflict.
    """
    return add_flags(parser, _flags(), "optimizer state offloading (megatron-offload)")


def _refuse(message: str) -> None:
    raise OffloadArgumentError(message)


def _given(args) -> list[str]:
    """The flags of this project given in ``args``, other than the switch."""
    given = []
    for name in _FIELD_FLAGS:
        value = getattr(args, dest(name), None)
        if name == "offload_optimizer_states" or value is None:
            continue
        if value is False:
            if name not in _STORE_TRUE:  # a store_true left off
                given.append(f"--no-{flag(name)[2:]}")
        else:
            given.append(flag(name))
    if getattr(args, "offload_log_stats", None) is False:
        given.append("--no-offload-log-stats")
    return given


def _mixed_precision(args) -> bool:
    return bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))


def _cuda_graph_impl(args) -> str:
    impl = getattr(args, "cuda_graph_impl", "none") or "none"
    # Before Megatron's validate_args: --enable-cuda-graph with the deprecated scope
    # 'full_iteration' is migrated to --cuda-graph-impl full_iteration.
    scopes = getattr(args, "cuda_graph_scope_deprecated", None) or []
    if getattr(args, "enable_cuda_graph", False) and any(
        str(scope) == "full_iteration" for scope in scopes
    ):
        return "full_iteration"
    return str(impl)


def validate_args(args) -> None:
    """Refuse (``OffloadArgumentError``) every combination offloading cannot work with.

    Without offloading on, its other flags are refused (they would do nothing). Reads
    attributes with defaults, so namespaces from other parsers work too. With it, Megatron's
    own offloader and its tuning flags are refused first.
    """
    if not offload_enabled(args):
        used = _given(args)
        if used:
            _refuse(
                f"{used[0]} has no effect without {SWITCH}: add {SWITCH} to offload the "
                f"optimizer states (or {MASTERS_FLAG} to offload the master weights only), or "
                f"drop {' and '.join(used)}."
            )
        return
    # A Megatron with an offloader of its own, and the settings refused for any optimizer
    # (``rules.refuse``, which refuse_conflicts runs).
    refuse_conflicts(args)
    if getattr(args, "use_torch_fsdp2", False):
        _refuse(
            f"{SWITCH} does not support torch FSDP2 (--use-torch-fsdp2), which does not "
            "use megatron-core's DistributedOptimizer. Drop --use-torch-fsdp2 and train with "
            f"--use-distributed-optimizer, or drop {SWITCH}."
        )
    optimizer = getattr(args, "optimizer", "adam")
    supported = supported_optimizers()
    if supported is not None and optimizer not in supported:
        _refuse(
            f"{SWITCH} cannot run with --optimizer {optimizer}: {_why_not(optimizer)} "
            f"The optimizers the installed megatron-core builds are: {', '.join(supported)}. "
            f"Use one of them, or drop {SWITCH}."
        )
    if getattr(args, "freeze_all_layers", False):
        _refuse(
            f"{SWITCH} cannot be combined with --freeze-all-layers, which turns the "
            "distributed optimizer off (and leaves no optimizer state to offload). Drop one "
            "of them."
        )
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as error:
        raise OffloadArgumentError(str(error)) from None
    if _cuda_graph_impl(args) == "full_iteration" and config.prefetch == "gradients":
        _refuse(
            f"{SWITCH} prefetches the states inside finalize_model_grads, which "
            "--cuda-graph-impl full_iteration captures into its graph (the copies would be "
            "replayed into stale memory). Add --offload-prefetch step to copy them back at the "
            "optimizer step, outside the graph, or use another --cuda-graph-impl."
        )
    if config.offload_master_weights and _mixed_precision(args):
        if getattr(args, "qk_clip", False):
            _refuse(
                f"{SWITCH} cannot be combined with --qk-clip while master weights are "
                "offloaded: QK-clip rewrites the fp32 master weights after the optimizer step, "
                "when they are already in host memory. Add --no-offload-master-weights, or drop "
                "--qk-clip."
            )
        if getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False) and getattr(
            args, "overlap_param_gather", False
        ):
            _refuse(
                f"{SWITCH} cannot be combined with --reuse-grad-buf-for-mxfp8-param-ag "
                "and --overlap-param-gather while master weights are offloaded: the training "
                "step copies the fp32 master weights into the parameter buffer before the "
                "forward pass, when they are in host memory. Add --no-offload-master-weights, "
                "or drop --reuse-grad-buf-for-mxfp8-param-ag."
            )
    if config.chunked_update_bytes is not None and not config.offload_optimizer_states:
        _refuse(
            f"{CHUNKED_FLAG} streams the optimizer states through the device during the step, "
            f"but without {SWITCH} they stay on the device. Add {SWITCH}, or drop {CHUNKED_FLAG}."
        )
    if not config.offload_optimizer_states and not _mixed_precision(args):
        _refuse(
            f"{MASTERS_FLAG} without {SWITCH} offloads only the fp32 master weights, "
            "which exist only with --bf16 or --fp16 (an fp32 model updates its parameters "
            f"directly). Add --bf16 or --fp16, or add {SWITCH}."
        )


def supported_optimizers() -> tuple[str, ...] | None:
    """The ``--optimizer`` values the installed megatron-core builds and trains with: those of
    megatron.training's ``--optimizer`` choices that megatron-core can build, in their order
    (None without megatron-core: nothing is judged).

    'adam' and 'sgd' always ('sgd' with --use-distributed-optimizer is refused by
    megatron-core itself); the emerging optimizers ('muon', its deprecated alias 'dist_muon',
    'lion', 'soap', 'adaptive_muon') where megatron-core registers them, which needs the
    emerging-optimizers package, and only if they can step: megatron-core 0.19.2's
    TensorParallelAdaptiveMuon never sets the ``scale_mode`` its first step reads.
    """
    try:
        from megatron.core.optimizer import emerging_optimizers
    except ImportError:
        return None
    registered = set(getattr(emerging_optimizers, "_EMERGING_OPTIMIZERS", {}) or {})
    if not getattr(emerging_optimizers, "HAVE_EMERGING_OPTIMIZERS", False):
        registered = set()
    if "muon" in registered:
        registered.add("dist_muon")
    if "adaptive_muon" in registered and not _adaptive_muon_steps(emerging_optimizers):
        registered.discard("adaptive_muon")
    choices = _megatron_optimizer_choices()
    return tuple(name for name in choices if name in ("adam", "sgd") or name in registered)


@functools.lru_cache(maxsize=None)
def _megatron_optimizer_choices() -> tuple[str, ...]:
    """``--optimizer``'s choices in megatron.training's parser (0.19.2's without it)."""
    try:
        from megatron.training.arguments import add_megatron_arguments

        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        choices = parser._option_string_actions["--optimizer"].choices
        if choices:
            return tuple(choices)
    except Exception:  # noqa: BLE001 - megatron-core without megatron.training, or another parser
        pass
    return ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")


def _adaptive_muon_steps(emerging_optimizers) -> bool:
    """False when megatron-core's TensorParallelAdaptiveMuon lacks what its step reads."""
    import torch

    cls = getattr(emerging_optimizers, "TensorParallelAdaptiveMuon", None)
    if cls is None:
        return False
    try:
        probe = cls([torch.nn.Parameter(torch.zeros(2, 2))])
    except Exception:  # noqa: BLE001 - any failure to build means it cannot train
        return False
    return hasattr(probe, "scale_mode")


def _why_not(optimizer: str) -> str:
    if optimizer == "adaptive_muon":
        return (
            "megatron-core builds it, but its first step fails (TensorParallelAdaptiveMuon "
            "has no attribute 'scale_mode', megatron-core 0.19.2)."
        )
    if optimizer in ("muon", "dist_muon", "lion", "soap"):
        return (
            "megatron-core builds it from the emerging-optimizers package, which is not "
            "installed (pip install emerging-optimizers)."
        )
    return "the installed megatron-core does not build it."


def config_from_args(args) -> OffloadConfig:
    """The ``OffloadConfig`` the flags in ``args`` select: every field whose flag was given,
    the field's default otherwise (the master weights follow the switch)."""
    values = {}
    for name in _FIELD_FLAGS:
        value = getattr(args, dest(name), None)
        if value is not None:
            values[name] = value
    values["offload_optimizer_states"] = bool(getattr(args, "offload_optimizer_states", False))
    if values.get("offload_master_weights") is None:
        values["offload_master_weights"] = values["offload_optimizer_states"]
    return OffloadConfig(**values)
