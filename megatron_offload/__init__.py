"""Optimizer-state and master-weight offloading for megatron-core's DistributedOptimizer.

    import megatron_offload
    optimizer = get_megatron_optimizer(config, model)
    offloader = megatron_offload.attach(optimizer)   # states live on the host between steps

The package is layered: ``device`` (the only code that knows accelerators), ``engine``
(moves a set of tensors), ``adapters`` (finds the tensors of each optimizer kind) and
``integration`` (attach, the per-step cycle, Megatron-facing API) and ``frameworks`` (the
adapters that make NeMo-RL's and verl's own optimizer moves delegate to the offloader).
"""

from .config import OffloadConfig
from .errors import (
    HostMemoryBudgetError,
    NodeMemoryError,
    OffloadArgumentError,
    OffloadError,
    OffloadStateError,
    PinError,
    SlotSizeError,
)
from .megatron.arguments import add_arguments, validate_args
from .megatron.training import find_offloader, patch_megatron, unpatch_megatron
from .offloader import OptimizerStateOffloader, attach

__version__ = "0.1.0"

__all__ = [
    "HostMemoryBudgetError",
    "NodeMemoryError",
    "OffloadArgumentError",
    "OffloadConfig",
    "OffloadError",
    "OffloadStateError",
    "OptimizerStateOffloader",
    "PinError",
    "SlotSizeError",
    "add_arguments",
    "attach",
    "find_offloader",
    "patch_megatron",
    "unpatch_megatron",
    "validate_args",
    "__version__",
]
