"""Megatron settings offloading cannot run with: each rule written once.

The same rule is met in two places: on the command line (``megatron.arguments.validate_args``,
before anything is built) and on the optimizer itself (``attach``, for loops that build their
optimizer from an ``OptimizerConfig``). Both read Megatron's own names, which the command
line's ``args`` and megatron-core's configs share (``optimizer_cpu_offload``,
``optimizer_cuda_graph``, ``use_megatron_fsdp``, ``chunked_optimizer_state_offload``), so one
function serves both and says the same thing: the flag and the field. Megatron-FSDP is
served in the configurations ``refuse_megatron_fsdp`` lets through.
"""

from __future__ import annotations

from .errors import OffloadArgumentError

SWITCH = "--offload-optimizer-states"
#: Megatron-LM ``dev``'s own offloader: its flag and the field it sets.
MEGATRON_OFFLOADER_FLAG = "--chunked-optimizer-state-offload"
MEGATRON_OFFLOADER_FIELD = "chunked_optimizer_state_offload"


def offload_enabled(args) -> bool:
    """True when ``args`` (the command line, or a patched ``OptimizerConfig``) asks for
    offloading: the switch, or the master weights alone (``--offload-master-weights``)."""
    return bool(getattr(args, "offload_optimizer_states", False)) or (
        getattr(args, "offload_master_weights", None) is True
    )


def megatron_offloader_on(settings) -> bool:
    """Whether Megatron's own (development-line) offloader is on in ``settings`` (the command
    line, an ``OptimizerConfig``, or a Megatron optimizer that built one)."""
    if getattr(settings, "_optimizer_state_offloader", None) is not None:
        return True
    return bool(getattr(settings, MEGATRON_OFFLOADER_FIELD, False)) and (
        getattr(settings, "optimizer_state_offload_fraction", 1.0) > 0.0
    )


def refuse(*settings) -> None:
    """Raise ``OffloadArgumentError`` if any of ``settings`` (objects with Megatron's attribute
    names: ``args``, an ``OptimizerConfig``, a DDP config, a Megatron optimizer) asks for
    something offloading cannot run with."""
    for source in settings:
        if source is None:
            continue
        if megatron_offloader_on(source):
            raise OffloadArgumentError(
                f"Megatron's own chunked optimizer-state offloader ({MEGATRON_OFFLOADER_FLAG}, "
                f"OptimizerConfig.{MEGATRON_OFFLOADER_FIELD}, or the deprecated "
                "OptimizerConfig.offload_optimizer_states of Megatron-LM's development line) is on "
                "for this optimizer, and only one may manage the optimizer states. Drop "
                f"{MEGATRON_OFFLOADER_FLAG} to use megatron-offload's, or do not attach "
                f"megatron-offload (drop {SWITCH}) to use Megatron's."
            )
        if getattr(source, "optimizer_cpu_offload", False):
            raise OffloadArgumentError(
                f"optimizer-state offloading ({SWITCH}) and optimizer_cpu_offload "
                "(--optimizer-cpu-offload) are mutually exclusive: --optimizer-cpu-offload runs "
                "Adam on the CPU (HybridDeviceOptimizer), while offloading keeps the update on "
                "the accelerator and parks the states in host memory only between steps. Drop "
                f"--optimizer-cpu-offload to keep the update on the accelerator, or drop {SWITCH}."
            )
        if getattr(source, "optimizer_cuda_graph", False):
            raise OffloadArgumentError(
                f"optimizer-state offloading ({SWITCH}) cannot be combined with "
                "optimizer_cuda_graph (--optimizer-cuda-graph): a captured optimizer step replays "
                "fixed device addresses, while offloading frees the state memory after every step "
                f"and allocates it again before the next. Drop --optimizer-cuda-graph, or drop {SWITCH}."
            )
        if getattr(source, "use_megatron_fsdp", False) or getattr(source, "use_custom_fsdp", False):
            refuse_megatron_fsdp(source)


#: The Megatron-FSDP sharding strategies offloading serves, every one megatron-core 0.19 has
#: (each shown bitwise on CPU ranks, training and fsdp_dtensor resume); a later one is refused
#: until shown.
FSDP_STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")


def refuse_megatron_fsdp(source) -> None:
    """Raise ``OffloadArgumentError`` for the Megatron-FSDP settings offloading does not serve
    (yet): sharding strategies it does not know, and its CUDA-graph mode. Hybrid sharding
    (``--num-distributed-optimizer-instances`` above 1, either outer strategy) and NCCL user
    buffers are served: each rank's masters are still one main weight buffer per parameter
    group (``adapters/megatron_fsdp.py``)."""
    strategy = getattr(source, "data_parallel_sharding_strategy", None)
    if strategy is not None and strategy not in FSDP_STRATEGIES:
        raise OffloadArgumentError(
            f"optimizer-state offloading ({SWITCH}) under Megatron-FSDP (--use-megatron-fsdp) "
            f"serves --data-parallel-sharding-strategy {', '.join(FSDP_STRATEGIES)}, not "
            f"{strategy!r} (not shown yet). Use one of those, or drop {SWITCH}."
        )
    if getattr(source, "megatron_fsdp_cuda_graph_mode", False):
        raise OffloadArgumentError(
            f"optimizer-state offloading ({SWITCH}) cannot run with the CUDA-graph mode of "
            "Megatron-FSDP (--use-megatron-fsdp, megatron_fsdp_cuda_graph_mode): a captured step "
            "replays fixed device addresses, while offloading frees the state memory after every "
            f"step. Turn it off, or drop {SWITCH}."
        )


def refuse_under_megatron_fsdp(feature: str, advice: str) -> None:
    """Raise ``OffloadArgumentError``: ``feature`` of offloading does not serve Megatron-FSDP
    yet (``advice``: what to do instead)."""
    raise OffloadArgumentError(
        f"{feature} does not serve Megatron-FSDP (--use-megatron-fsdp) yet: {advice}"
    )
