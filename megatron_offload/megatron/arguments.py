"""Command-line flags for Megatron's argument parser, and their validation.

``add_arguments(parser)`` has the signature of Megatron's ``extra_args_provider`` (it returns
the parser), so a script can pass it to ``parse_and_validate_args`` directly;
``patch_megatron()`` adds the same flags to every Megatron parser. ``validate_args(args)``
raises ``OffloadArgumentError`` (a ``ValueError``) for every combination that cannot work,
naming both flags and what to do instead. It reads only ``args``, so it runs (and fails)
before any process group, model or optimizer exists, and it accepts the namespace both before
and after Megatron's own ``validate_args`` (which derives some flags from others).

A Megatron that defines ``--offload-optimizer-states`` itself (Megatron-LM ``dev``: an alias of
its own chunked offloader) is handled in ``coexistence``: the flag selects megatron-offload's
offloader and Megatron's stays off.
"""

from __future__ import annotations

import argparse
import functools

from ..config import OffloadConfig
from .coexistence import add_flags, refuse_conflicts
from .flags import CHUNKED_FLAG, OFFLOAD_FLAG, OffloadArgumentError, offload_enabled

PIECE_FLAG = "--offload-max-piece-mb"

# Tuning flags: (option, dest). All are "--no-..." switches whose default is True, so a False
# value means the user passed the flag.
TUNING_FLAGS = (
    ("--no-offload-moments", "offload_moments"),
    ("--no-offload-master-weights", "offload_master_weights"),
    ("--no-offload-release-master-grads", "offload_release_master_grads"),
    ("--no-offload-prefetch", "offload_prefetch"),
    ("--no-log-offload-stats", "log_offload_stats"),
)
UNDO_FLAG = "--offload-chunked-update-undo"

__all__ = [
    "OFFLOAD_FLAG",
    "OffloadArgumentError",
    "add_arguments",
    "config_from_args",
    "offload_enabled",
    "validate_args",
]


def _flags() -> list:
    """``(option, add_argument kwargs)`` of every flag this project adds."""
    return [
        (
            OFFLOAD_FLAG,
            dict(
                action="store_true",
                help="Keep the distributed optimizer's states (Adam's exp_avg and exp_avg_sq) and "
                "fp32 master weights in host memory between optimizer steps: they are copied to the "
                "host after each step, their device memory is freed, and they are copied back while "
                "the gradients are reduced. The update itself still runs on the accelerator and "
                "gives bitwise the same results. Works with every --optimizer megatron-core builds "
                "(adam, sgd, lion, muon, soap), with or without --use-distributed-optimizer; not "
                "with --optimizer-cpu-offload, which runs Adam on the CPU.",
            ),
        ),
        (
            "--no-offload-moments",
            dict(
                action="store_false",
                dest="offload_moments",
                help="With --offload-optimizer-states: keep Adam's moments (exp_avg, exp_avg_sq) "
                "on the accelerator and offload only the fp32 master weights (needs --bf16 or "
                "--fp16, without which there are no separate master weights).",
            ),
        ),
        (
            "--no-offload-master-weights",
            dict(
                action="store_false",
                dest="offload_master_weights",
                help="With --offload-optimizer-states: keep the fp32 master weights on the "
                "accelerator and offload only the optimizer states.",
            ),
        ),
        (
            "--no-offload-release-master-grads",
            dict(
                action="store_false",
                dest="offload_release_master_grads",
                help="With --offload-optimizer-states: keep the .grad of the fp32 master-weight "
                "shards between steps instead of dropping it after the step (zero_grad drops it "
                "before the next backward anyway).",
            ),
        ),
        (
            "--no-offload-prefetch",
            dict(
                action="store_false",
                dest="offload_prefetch",
                help="With --offload-optimizer-states: do not start copying the states back in "
                "finalize_model_grads (overlapping the gradient reduction); copy them back when "
                "the optimizer step starts instead.",
            ),
        ),
        (
            CHUNKED_FLAG,
            dict(
                type=int,
                default=None,
                dest="offload_chunked_update_bytes",
                metavar="BYTES",
                help="With --offload-optimizer-states: keep Adam's moments in host memory during the "
                "optimizer step too, and stream them through device slots taking at most BYTES in all "
                "(for example 1073741824 for 1 GiB), a few parameters at a time, so that the update "
                "needs BYTES of device memory for them instead of their whole size. Bitwise the same "
                "results. Each parameter shard's moments must fit in half of BYTES.",
            ),
        ),
        (
            UNDO_FLAG,
            dict(
                action="store_true",
                dest="offload_chunked_update_undo",
                help=f"With {CHUNKED_FLAG}: keep host copies of what each update call writes, so that "
                "a chunked step that fails part-way (out of memory for the optimizer's temporaries, a "
                "failed copy) is undone, leaving parameters and optimizer states as before it, at the "
                "cost of one more device-to-host copy of them per step and as much pinned host memory. "
                "Without it (the default) such a failure leaves the step half done; a step that does "
                "not fit its budget is refused before anything is touched either way.",
            ),
        ),
        (
            PIECE_FLAG,
            dict(
                type=int,
                default=None,
                dest="offload_max_piece_mb",
                metavar="MIB",
                help="With --offload-optimizer-states: the largest device storage the offloader frees "
                "and regrows as one, in MiB (default 256). Each piece's memory becomes reusable by "
                "the caching allocator as soon as its own copy to the host is done; smaller pieces "
                "free memory sooner and fragment less, at a few microseconds of copy launch each.",
            ),
        ),
        (
            "--no-log-offload-stats",
            dict(
                action="store_false",
                dest="log_offload_stats",
                help="With --offload-optimizer-states: do not print the offloaded/host GiB and "
                "copy milliseconds at each --log-interval (nor write them to TensorBoard/W&B).",
            ),
        ),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--offload-optimizer-states`` and its tuning flags to ``parser``; returns it.

    Usable as Megatron's ``extra_args_provider``. Adding them twice to the same parser is a
    no-op (so a script's own provider and ``patch_megatron()`` do not collide). A Megatron that
    defines ``--offload-optimizer-states`` itself (an alias of its own offloader) keeps its
    action, which megatron-offload takes over; the tuning flags are added all the same. Any
    other flag or dest Megatron already defines is an ``OffloadArgumentError`` (see
    ``coexistence``), never argparse's conflict.
    """
    return add_flags(parser, _flags(), "optimizer state offloading (megatron-offload)")


def _refuse(message: str) -> None:
    raise OffloadArgumentError(message)


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

    A no-op without ``--offload-optimizer-states``, except that the tuning flags are refused
    without it. Reads attributes with defaults, so namespaces from other parsers work too.
    With it, Megatron's own offloader (``--chunked-optimizer-state-offload``) and its tuning
    flags are refused first.
    """
    enabled = offload_enabled(args)
    if not enabled:
        used = [flag for flag, dest in TUNING_FLAGS if getattr(args, dest, True) is False]
        if getattr(args, "offload_chunked_update_undo", False) is True:
            used.append(UNDO_FLAG)
        if getattr(args, "offload_chunked_update_bytes", None) is not None:
            used.append(CHUNKED_FLAG)
        if getattr(args, "offload_max_piece_mb", None) is not None:
            used.append(PIECE_FLAG)
        if used:
            _refuse(
                f"{used[0]} has no effect without {OFFLOAD_FLAG}: add {OFFLOAD_FLAG} to "
                f"offload optimizer states, or drop {' and '.join(used)}."
            )
        return

    # A Megatron with an offloader of its own: never both (before anything else is judged).
    refuse_conflicts(args)
    if getattr(args, "optimizer_cpu_offload", False):
        _refuse(
            f"{OFFLOAD_FLAG} and --optimizer-cpu-offload are mutually exclusive: "
            "--optimizer-cpu-offload runs Adam on the CPU (HybridDeviceOptimizer), while "
            f"{OFFLOAD_FLAG} keeps the update on the accelerator and parks the states in host "
            "memory only between steps. Use one of them: drop --optimizer-cpu-offload to keep "
            f"the update on the accelerator, or drop {OFFLOAD_FLAG}."
        )
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_custom_fsdp", False):
        _refuse(
            f"{OFFLOAD_FLAG} does not support Megatron-FSDP (--use-megatron-fsdp), whose "
            "optimizer states live in its own sharded buffers. Drop --use-megatron-fsdp and "
            "train with --use-distributed-optimizer, or drop "
            f"{OFFLOAD_FLAG}."
        )
    if getattr(args, "use_torch_fsdp2", False):
        _refuse(
            f"{OFFLOAD_FLAG} does not support torch FSDP2 (--use-torch-fsdp2), which does not "
            "use megatron-core's DistributedOptimizer. Drop --use-torch-fsdp2 and train with "
            f"--use-distributed-optimizer, or drop {OFFLOAD_FLAG}."
        )
    optimizer = getattr(args, "optimizer", "adam")
    supported = supported_optimizers()
    if supported is not None and optimizer not in supported:
        _refuse(
            f"{OFFLOAD_FLAG} cannot run with --optimizer {optimizer}: {_why_not(optimizer)} "
            f"The optimizers the installed megatron-core builds are: {', '.join(supported)}. "
            f"Use one of them, or drop {OFFLOAD_FLAG}."
        )
    if getattr(args, "freeze_all_layers", False):
        _refuse(
            f"{OFFLOAD_FLAG} cannot be combined with --freeze-all-layers, which turns the "
            "distributed optimizer off (and leaves no optimizer state to offload). Drop one "
            "of them."
        )
    if getattr(args, "optimizer_cuda_graph", False):
        _refuse(
            f"{OFFLOAD_FLAG} cannot be combined with --optimizer-cuda-graph: a captured "
            "optimizer step replays fixed device addresses, while offloading frees the state "
            "memory after every step and allocates it again before the next. Drop "
            f"--optimizer-cuda-graph, or drop {OFFLOAD_FLAG}."
        )
    if _cuda_graph_impl(args) == "full_iteration" and getattr(args, "offload_prefetch", True):
        _refuse(
            f"{OFFLOAD_FLAG} prefetches the states inside finalize_model_grads, which "
            "--cuda-graph-impl full_iteration captures into its graph (the copies would be "
            "replayed into stale memory). Add --no-offload-prefetch to copy them back at the "
            "optimizer step, outside the graph, or use another --cuda-graph-impl."
        )
    offload_masters = getattr(args, "offload_master_weights", True)
    if offload_masters and _mixed_precision(args):
        if getattr(args, "qk_clip", False):
            _refuse(
                f"{OFFLOAD_FLAG} cannot be combined with --qk-clip while master weights are "
                "offloaded: QK-clip rewrites the fp32 master weights after the optimizer step, "
                "when they are already in host memory. Add --no-offload-master-weights, or drop "
                "--qk-clip."
            )
        if getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False) and getattr(
            args, "overlap_param_gather", False
        ):
            _refuse(
                f"{OFFLOAD_FLAG} cannot be combined with --reuse-grad-buf-for-mxfp8-param-ag "
                "and --overlap-param-gather while master weights are offloaded: the training "
                "step copies the fp32 master weights into the parameter buffer before the "
                "forward pass, when they are in host memory. Add --no-offload-master-weights, "
                "or drop --reuse-grad-buf-for-mxfp8-param-ag."
            )
    offload_moments = getattr(args, "offload_moments", True)
    if not offload_moments and not offload_masters:
        _refuse(
            f"{OFFLOAD_FLAG} with both --no-offload-moments and --no-offload-master-weights "
            "has nothing to offload. Drop one of them (or drop "
            f"{OFFLOAD_FLAG})."
        )
    piece = getattr(args, "offload_max_piece_mb", None)
    if piece is not None and (isinstance(piece, bool) or not isinstance(piece, int) or piece <= 0):
        _refuse(f"{PIECE_FLAG} must be a whole number of MiB > 0 (default 256), got {piece!r}.")
    chunked = getattr(args, "offload_chunked_update_bytes", None)
    if chunked is None and getattr(args, "offload_chunked_update_undo", False) is True:
        _refuse(
            f"{UNDO_FLAG} has no effect without {CHUNKED_FLAG}: add "
            f"{CHUNKED_FLAG} BYTES, or drop it."
        )
    if chunked is not None and chunked <= 0:
        _refuse(f"{CHUNKED_FLAG} must be a number of bytes > 0, got {chunked}.")
    if chunked is not None and not offload_moments:
        _refuse(
            f"{CHUNKED_FLAG} streams Adam's moments through the device during the step, but "
            "--no-offload-moments keeps them on the device. Drop one of them."
        )
    if not offload_moments and not _mixed_precision(args):
        _refuse(
            f"{OFFLOAD_FLAG} with --no-offload-moments offloads only the fp32 master weights, "
            "which exist only with --bf16 or --fp16 (an fp32 model updates its parameters "
            "directly). Add --bf16 or --fp16, or drop --no-offload-moments."
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
    """The ``OffloadConfig`` the flags in ``args`` select."""
    return OffloadConfig(
        offload_optimizer_states=bool(getattr(args, "offload_moments", True)),
        offload_primary_weights=bool(getattr(args, "offload_master_weights", True)),
        release_master_grads=bool(getattr(args, "offload_release_master_grads", True)),
        chunked_update_bytes=getattr(args, "offload_chunked_update_bytes", None),
        chunked_update_undo=bool(getattr(args, "offload_chunked_update_undo", False)),
        **_piece_option(args),
    )


def _piece_option(args) -> dict:
    piece = getattr(args, "offload_max_piece_mb", None)
    return {} if piece is None else {"max_piece_bytes": piece << 20}
