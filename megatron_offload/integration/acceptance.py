"""Which megatron-core optimizers an offloader accepts, refused before anything is touched.

``distributed_optimizers`` finds the DistributedOptimizers of what ``get_megatron_optimizer``
returned; ``refuse_unsupported`` refuses the configurations offloading cannot serve, each
with the flag to change.
"""

from __future__ import annotations


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside ``optimizer``, or a TypeError saying what to do."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        return [optimizer]
    if isinstance(optimizer, ChainedOptimizer):
        inner = list(optimizer.chained_optimizers)
        bad = [type(o).__name__ for o in inner if not isinstance(o, DistributedOptimizer)]
        if bad or not inner:
            raise TypeError(
                "optimizer-state offloading needs every optimizer of the ChainedOptimizer to be "
                f"a DistributedOptimizer, but found {', '.join(bad) or 'none'}. Build the "
                "optimizer with OptimizerConfig(use_distributed_optimizer=True) "
                "(--use-distributed-optimizer)."
            )
        return inner
    raise TypeError(
        "optimizer-state offloading works on megatron-core's DistributedOptimizer (or a "
        f"ChainedOptimizer of them), not on {type(optimizer).__name__}. Build the optimizer "
        "with get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True, ...)) "
        "(--use-distributed-optimizer)."
    )


def refuse_unsupported(distrib_optimizer) -> None:
    """Raise before anything is touched if offloading cannot work with this optimizer."""
    existing = getattr(distrib_optimizer, "_state_offloader", None)
    if existing is not None:
        raise RuntimeError(
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
        raise ValueError(
            "Megatron's own chunked optimizer-state offloader manages this optimizer "
            "(OptimizerConfig.chunked_optimizer_state_offload, --chunked-optimizer-state-offload, "
            "or the deprecated OptimizerConfig.offload_optimizer_states); only one offloader may "
            "manage the optimizer states. Build the optimizer without it to use this one."
        )
    if getattr(config, "optimizer_cpu_offload", False):
        raise ValueError(
            "optimizer-state offloading cannot be combined with optimizer_cpu_offload "
            "(--optimizer-cpu-offload), which already keeps states on the host and runs Adam "
            "on the CPU. Use one of them: drop --optimizer-cpu-offload to keep the update on "
            "the accelerator and offload states between steps."
        )
    if getattr(config, "optimizer_cuda_graph", False):
        raise ValueError(
            "optimizer-state offloading cannot be combined with optimizer_cuda_graph "
            "(--optimizer-cuda-graph): a captured step replays fixed device addresses, while "
            "offloading frees and reallocates the state memory. Disable one of them."
        )
    ddp_config = getattr(distrib_optimizer, "ddp_config", None)
    if getattr(ddp_config, "use_megatron_fsdp", False):
        raise ValueError(
            "optimizer-state offloading does not support Megatron-FSDP (--use-megatron-fsdp); "
            "use the DistributedOptimizer with --use-distributed-optimizer instead."
        )
