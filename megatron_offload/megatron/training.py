"""``--offload-optimizer-states`` for megatron.training's own training loop.

``patch_megatron()`` turns any script built on ``megatron.training`` (``pretrain`` and
``parse_and_validate_args``) into an offloading one when it is run with
``--offload-optimizer-states``, without editing Megatron's sources::

    import megatron_offload
    megatron_offload.patch_megatron()      # at the top of a pretrain script
    # or: python -m megatron_offload.launch pretrain_gpt.py <flags> --offload-optimizer-states

It replaces a few module globals that megatron.training looks up at call time:

==================================================  =======================================
``arguments.add_megatron_arguments``                 also adds this project's flags
``arguments.validate_args``                          refuses impossible combinations, before
                                                     and after Megatron's own checks
``training.get_megatron_optimizer_config``           never enables Megatron's own offloader
                                                     (``coexistence``: only one offloader runs)
``training.get_megatron_optimizer``                  ``attach`` to the optimizer it builds,
                                                     before ``setup_model_and_optimizer``
                                                     loads a checkpoint into it
``training.setup_model_and_optimizer``               ``attach`` to the optimizer it returns
                                                     (where none was attached yet)
``training.train``                                   wraps ``config.finalize_model_grads_func``
                                                     (keeping one a builder set) so the reload
                                                     starts while the gradients are reduced
``training.save_checkpoint`` / ``load_checkpoint``   run with the states resident, and
                                                     offloaded again right after
``training.calc_params_l2_norm``                     runs with the master weights resident
``training.training_log``                            one line of offload figures per log
                                                     interval, and TensorBoard/W&B scalars
==================================================  =======================================

The per-step cycle itself is ``attach``'s: reload at ``optimizer.step()`` if nothing
prefetched, the update waits for the copy, offload after the step. Every wrapper is a
pass-through unless the run has ``--offload-optimizer-states`` and an attached offloader, so
patching is harmless for runs without the flag. ``patch_megatron()`` is idempotent;
``unpatch_megatron()`` restores the originals.

The helpers below (``attach_for_training``, ``install_prefetch``, ``checkpoint_residency``
(from ``residency.py``), ``log_for_megatron``, ...) are also what the source patches in
``patches/`` call, so both routes share one implementation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

from ..adapters.megatron_wrappers import MASTER_WEIGHTS, master_weights
from ..errors import print_refusals_once, restore_excepthook
from ..interceptions import PROCESS
from ..offloader import allocator_warnings
from ..offloader.cycle import WRAPPER_MARK as _MARK
from ..offloader.cycle import attach, prefetch_at_gradient_reduction, prefetching_finalize
from ..offloader.members import find_offloader
from ..report import (  # noqa: F401  (re-exported: the patches and users call them here)
    format_offload_stats,
    log_offload_stats,
    offload_figures,
)
from . import coexistence
from .arguments import add_arguments, config_from_args, offload_enabled, validate_args
from .residency import checkpoint_residency, save_is_staged_on_return

__all__ = [
    "attach_for_training",
    "attach_from_optimizer_config",
    "checkpoint_residency",
    "find_offloader",
    "format_offload_stats",
    "install_prefetch",
    "is_patched",
    "log_for_megatron",
    "log_offload_stats",
    "master_weights_residency",
    "offload_figures",
    "patch_megatron",
    "prefetching_finalize",
    "save_is_staged_on_return",
    "unpatch_megatron",
]

# What patch_megatron() installed (in interceptions.PROCESS), for unpatch_megatron().
_PATCHES: list = []
# Offloaders attached by this module (for hooks that do not receive the optimizer).
_ATTACHED: list = []


# ---------------------------------------------------------------------------------- helpers
def _active_offloaders() -> list:
    alive = []
    for ref in list(_ATTACHED):
        offloader = ref()
        if offloader is None or offloader.detached:
            _ATTACHED.remove(ref)
        else:
            alive.append(offloader)
    return alive


def attach_for_training(optimizer, args):
    """Attach an offloader configured by ``args`` to ``optimizer`` (once); returns it.

    Returns None without ``--offload-optimizer-states`` or without an optimizer
    (``--skip-train``). An offloader already attached (for example by a patched
    ``get_megatron_optimizer``) is reused. Refuses (``OffloadArgumentError``) an optimizer that
    Megatron's own offloader manages: never two offloaders.
    """
    if optimizer is None or not offload_enabled(args):
        return None
    coexistence.refuse_enabled_optimizer(optimizer)
    offloader = find_offloader(optimizer)
    if offloader is None:
        offloader = attach(optimizer, config_from_args(args))
        line = (
            "> optimizer-state offloading: "
            f"{len(offloader.engines)} distributed optimizer(s); states are kept in host "
            "memory between optimizer steps"
            + (
                ""
                if offloader.config.prefetch == "gradients"
                else f" (copied back at: {offloader.config.prefetch})"
            )
        )
        if coexistence.megatron_has_own_offloader(args, optimizer=optimizer):
            line += ". " + coexistence.KEPT_OFF_NOTE
        _print_rank_0(line)
        allocator_warnings.warn_where_empty_cache_follows_the_step(
            offloader, int(getattr(args, "empty_unused_memory_level", 0) or 0)
        )
    if not any(o is offloader for o in _active_offloaders()):
        _ATTACHED.append(weakref.ref(offloader))
    return offloader


def attach_from_optimizer_config(optimizer, config):
    """For a patched ``get_megatron_optimizer``: attach when ``config.offload_optimizer_states``.

    ``OptimizerConfig`` fields of a patched megatron-core carry the flags' names
    (``offload_optimizer_states``, ``offload_master_weights``,
    ``offload_release_master_grads``), so the config stands in for the arguments.
    """
    return attach_for_training(optimizer, config)


def install_prefetch(config, optimizer, args=None) -> bool:
    """Wrap ``config.finalize_model_grads_func`` (after ``train()`` set its default) so the
    reload of ``optimizer``'s states starts while the gradients are reduced.

    Returns whether it wrapped: only with an attached offloader whose ``prefetch`` is
    ``"gradients"`` (the default), and not under full-iteration CUDA graphs. Idempotent. (``args``: unused, the offloader's config
    says; kept for the source patches' call.)
    """
    offloader = find_offloader(optimizer)
    if offloader is None or offloader.config.prefetch != "gradients":
        return False
    from megatron.core.distributed import finalize_model_grads

    return (
        prefetch_at_gradient_reduction(config, offloader, default=finalize_model_grads) is not None
    )


def log_for_megatron(iteration: int) -> None:
    """One offload line (and TensorBoard/W&B scalars) for ``iteration``, if the run offloads
    and logs offload stats. Call it on every rank at the same iterations (it is collective)."""
    from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer

    args = get_args()
    if not offload_enabled(args) or getattr(args, "offload_log_stats", None) is False:
        return
    offloaders = _active_offloaders()
    if not offloaders:
        return
    log_offload_stats(
        iteration, offloaders[-1], writer=get_tensorboard_writer(), wandb_writer=get_wandb_writer()
    )


@contextlib.contextmanager
def master_weights_residency():
    """Only what ``calc_params_l2_norm`` reads (``main_param``: the fp32 masters kept beside the
    optimizer), never the optimizer states, on the device for the block; offloaded after it,
    no copy."""
    with contextlib.ExitStack() as stack:
        for offloader in _active_offloaders():  # no masters beside a precision-aware optimizer
            kinds = [
                (MASTER_WEIGHTS,) if any(True for _ in master_weights(m.optimizer)) else ()
                for m in offloader.members
            ]
            stack.enter_context(offloader.resident(read_only=True, kinds=kinds))
        yield


def _print_rank_0(message: str) -> None:
    try:
        from megatron.training.utils import print_rank_0
    except ImportError:  # megatron-core without megatron.training
        print(message, flush=True)
        return
    print_rank_0(message)


def _get_args():
    from megatron.training.global_vars import get_args

    return get_args()


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def _bound(function, args, kwargs) -> dict:
    """The arguments of a call of ``function`` by parameter name."""
    return _signature(function).bind_partial(*args, **kwargs).arguments


# --------------------------------------------------------------------------------- wrappers
def _wrap_add_megatron_arguments(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        return add_arguments(parser)

    return add_megatron_arguments


def _wrap_validate_args(original):
    @functools.wraps(original)
    def megatron_validate_args(args, *rest, **kwargs):
        validate_args(args)  # clear messages before Megatron's own assertions
        # A Megatron that reads the flag as its own offloader's alias does not see it.
        with coexistence.alias_hidden(args):
            result = original(args, *rest, **kwargs)
        validate_args(args)  # and for what Megatron derived (FSDP, --freeze-all-layers, ...)
        return result

    return megatron_validate_args


def _wrap_optimizer_config(original, module):
    @functools.wraps(original)
    def get_megatron_optimizer_config(args, *rest, **kwargs):
        # OptimizerConfig(offload_optimizer_states=True) would turn Megatron's offloader on.
        with coexistence.alias_hidden(args, getattr(module, "OptimizerConfig", None)):
            result = original(args, *rest, **kwargs)
        config = result[0] if isinstance(result, tuple) else result
        coexistence.refuse_enabled_config(args, config)
        return result

    return get_megatron_optimizer_config


def _wrap_get_megatron_optimizer(original):
    """Attach as soon as megatron.training has built the optimizer, as the source patch's
    ``get_megatron_optimizer`` does: ``setup_model_and_optimizer`` then loads a resumed run's
    checkpoint into an attached offloader, so the load writes the host copy (the masters are
    offloaded at attach, the states it makes are made on the host) instead of holding the
    optimizer memory of a run without offloading."""

    @functools.wraps(original)
    def get_megatron_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        megatron_args = _get_args()
        if offload_enabled(megatron_args):
            attach_for_training(optimizer, megatron_args)
        return optimizer

    return get_megatron_optimizer


def _wrap_setup_model_and_optimizer(original):
    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        result = original(*args, **kwargs)
        megatron_args = _get_args()
        if offload_enabled(megatron_args):
            attach_for_training(result[1], megatron_args)
        elif coexistence.megatron_offloader_enabled(result[1]):
            _print_rank_0(coexistence.MEGATRON_ACTIVE_LINE)
        return result

    return setup_model_and_optimizer


def _wrap_train(original, module):
    @functools.wraps(original)
    def train(*args, **kwargs):
        named = _bound(original, args, kwargs)
        optimizer, config = named.get("optimizer"), named.get("config")
        offloader = find_offloader(optimizer)
        if config is None or offloader is None or offloader.config.prefetch != "gradients":
            return original(*args, **kwargs)
        # Where the config has none, what train() would install; a hook a model builder set is
        # kept (and wrapped). Given back after the call.
        default = getattr(module, "finalize_model_grads", None)
        handle = prefetch_at_gradient_reduction(
            config, offloader, default=default, only_if_ours=False
        )
        if handle is None:  # full-iteration graphs: the step starts the reload
            return original(*args, **kwargs)
        # megatron.training 0.17 and 0.18 assign the module's finalize_model_grads to the config
        # in train() unconditionally (the only use of that name): wrap the name for the call.
        named = None
        if default is not None:
            named = PROCESS.replace(
                module,
                "finalize_model_grads",
                prefetching_finalize(default, offloader),
                why="train() of megatron.training 0.17/0.18 hands this name to the model config: "
                "the reload starts when the loop reduces the gradients",
            )
        try:
            return original(*args, **kwargs)
        finally:
            handle.remove()
            if named is not None:
                named.remove()

    return train


def _wrap_checkpoint(original, *, read_only: bool):
    @functools.wraps(original)
    def checkpoint(*args, **kwargs):
        optimizer = _bound(original, args, kwargs).get("optimizer")
        with checkpoint_residency(optimizer, read_only=read_only, args=_get_args()):
            return original(*args, **kwargs)

    return checkpoint


def _wrap_params_norm(original):
    @functools.wraps(original)
    def calc_params_l2_norm(*args, **kwargs):
        with master_weights_residency():
            return original(*args, **kwargs)

    return calc_params_l2_norm


def _wrap_training_log(original):
    @functools.wraps(original)
    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        named = _bound(original, args, kwargs)
        iteration = named.get("iteration")
        if iteration is not None and (
            iteration % _get_args().log_interval == 0 or named.get("is_first_iteration")
        ):
            log_for_megatron(iteration)
        return result

    return training_log


# --------------------------------------------------------------------------------- patching
def _replace(module, name: str, make_wrapper) -> None:
    current = getattr(module, name)
    if getattr(current, _MARK, False):
        return
    wrapper = make_wrapper(current)
    setattr(wrapper, _MARK, True)
    why = "--offload-optimizer-states: megatron.training's own function, wrapped"
    _PATCHES.append(PROCESS.replace(module, name, wrapper, why=why))


def patch_megatron() -> None:
    """Hook megatron.training so that ``--offload-optimizer-states`` works (idempotent).

    Call it before the script parses its arguments (``parse_and_validate_args``). Runs
    without the flag are unaffected. A refusal (a command line or optimizer offloading
    cannot run with) is printed once, by rank 0, as its message (``errors.print_refusals_once``).
    """
    import megatron.training.arguments as arguments_module
    import megatron.training.training as training_module

    print_refusals_once()
    if getattr(arguments_module, "_OPTIMIZER_STATE_OFFLOAD_PATCH", None):
        return  # a source tree with patches/ applied already has every hook
    _replace(arguments_module, "add_megatron_arguments", _wrap_add_megatron_arguments)
    _replace(arguments_module, "validate_args", _wrap_validate_args)
    import megatron.training.initialize as initialize_module

    if hasattr(initialize_module, "validate_args"):  # 0.17 validates in initialize_megatron
        _replace(initialize_module, "validate_args", _wrap_validate_args)
    if hasattr(training_module, "get_megatron_optimizer_config"):
        _replace(
            training_module,
            "get_megatron_optimizer_config",
            lambda f: _wrap_optimizer_config(f, training_module),
        )
    if hasattr(training_module, "get_megatron_optimizer"):
        _replace(training_module, "get_megatron_optimizer", _wrap_get_megatron_optimizer)
    _replace(training_module, "setup_model_and_optimizer", _wrap_setup_model_and_optimizer)
    _replace(training_module, "train", lambda f: _wrap_train(f, training_module))
    _replace(training_module, "save_checkpoint", lambda f: _wrap_checkpoint(f, read_only=True))
    _replace(training_module, "load_checkpoint", lambda f: _wrap_checkpoint(f, read_only=False))
    _replace(training_module, "calc_params_l2_norm", _wrap_params_norm)
    _replace(training_module, "training_log", _wrap_training_log)


def unpatch_megatron() -> None:
    """Restore everything ``patch_megatron()`` replaced."""
    restore_excepthook()
    while _PATCHES:
        _PATCHES.pop().remove()


def is_patched() -> bool:
    return bool(_PATCHES)
