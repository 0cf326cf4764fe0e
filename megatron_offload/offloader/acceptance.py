"""Which megatron-core optimizers an offloader accepts, refused before anything is touched.

``megatron_optimizers`` finds the optimizers to serve in what ``get_megatron_optimizer``
returned: every Megatron optimizer that wraps a torch optimizer (``DistributedOptimizer``,
``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``), alone or inside a
``ChainedOptimizer`` (``LayerWiseDistributedOptimizer`` is one), nested chains included.
``refuse_unsupported`` refuses the configurations offloading cannot serve, each with the flag
to change.
"""

from __future__ import annotations

from ..errors import OffloadArgumentError, OffloadStateError


def _wrapper_classes() -> tuple[type, ...]:
    """The Megatron optimizer classes that wrap one torch optimizer (and keep the masters)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    return (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer)


def megatron_optimizers(optimizer) -> list:
    """The Megatron optimizers inside ``optimizer`` that hold a torch optimizer, in chain
    order (nested ChainedOptimizers flattened), or a TypeError saying what to do.

    Stub optimizers (a rank without parameters for them: ``optimizer.optimizer is None``)
    are included; the offloader has nothing to move for them (``is_stub``).
    """
    from megatron.core.optimizer import ChainedOptimizer

    wrappers = _wrapper_classes()
    names = ", ".join(cls.__name__ for cls in wrappers)
    if isinstance(optimizer, wrappers):
        return [optimizer]
    if isinstance(optimizer, ChainedOptimizer):
        found, bad = [], []
        _flatten(optimizer, ChainedOptimizer, wrappers, found, bad)
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


def _flatten(chain, chained_class, wrappers, found: list, bad: list) -> None:
    for inner in chain.chained_optimizers:
        if isinstance(inner, wrappers):
            found.append(inner)
        elif isinstance(inner, chained_class):
            _flatten(inner, chained_class, wrappers, found, bad)
        else:
            bad.append(type(inner).__name__)


def distributed_optimizers(optimizer) -> list:
    """Kept for compatibility: ``megatron_optimizers``."""
    return megatron_optimizers(optimizer)


def is_stub(wrapper) -> bool:
    """True for a Megatron optimizer without a torch optimizer on this rank (nothing to move)."""
    return getattr(wrapper, "optimizer", None) is None or bool(
        getattr(wrapper, "is_stub_optimizer", False)
    )


def refuse_unsupported(distrib_optimizer) -> None:
    """Raise before anything is touched if offloading cannot work with this optimizer."""
    existing = getattr(distrib_optimizer, "_state_offloader", None)
    if existing is not None:
        raise OffloadStateError(
            "this optimizer already has a state offloader attached; use that one "
            "(optimizer._state_offloader), or call its detach() before attaching again."
        )
    config = getattr(distrib_optimizer, "config", None)
    if getattr(distrib_optimizer, "_optimizer_state_offloader", None) is not None or (
        getattr(config, "chunked_optimizer_state_offload", False)
        and getattr(config, "optimizer_state_offload_fraction", 1.0) > 0.0
    ):
        # Megatron-LM's development line has an offloader of its own; two would each move and
        # free the same states.
        raise OffloadArgumentError(
            "Megatron's own chunked optimizer-state offloader manages this optimizer "
            "(OptimizerConfig.chunked_optimizer_state_offload, --chunked-optimizer-state-offload, "
            "or the deprecated OptimizerConfig.offload_optimizer_states); only one offloader may "
            "manage the optimizer states. Build the optimizer without it to use this one."
        )
    if getattr(config, "optimizer_cpu_offload", False):
        raise OffloadArgumentError(
            "optimizer-state offloading cannot be combined with optimizer_cpu_offload "
            "(--optimizer-cpu-offload), which already keeps states on the host and runs Adam "
            "on the CPU. Use one of them: drop --optimizer-cpu-offload to keep the update on "
            "the accelerator and offload states between steps."
        )
    if getattr(config, "optimizer_cuda_graph", False):
        raise OffloadArgumentError(
            "optimizer-state offloading cannot be combined with optimizer_cuda_graph "
            "(--optimizer-cuda-graph): a captured step replays fixed device addresses, while "
            "offloading frees and reallocates the state memory. Disable one of them."
        )
    ddp_config = getattr(distrib_optimizer, "ddp_config", None)
    if getattr(ddp_config, "use_megatron_fsdp", False):
        raise OffloadArgumentError(
            "optimizer-state offloading does not support Megatron-FSDP (--use-megatron-fsdp); "
            "use the DistributedOptimizer with --use-distributed-optimizer instead."
        )
