"""Optimizer-state and master-weight offloading for megatron-core's DistributedOptimizer.

    import megatron_offload
    optimizer = get_megatron_optimizer(config, model)
    offloader = megatron_offload.attach(optimizer)   # states live on the host between steps

The package is layered: ``device`` (the only code that knows accelerators), ``engine``
(moves a set of tensors), ``adapters`` (finds the tensors of each optimizer kind) and
``offloader`` (attach, the per-step cycle, sleep and wake), ``access`` and ``chunked``,
``megatron`` (flags, megatron.training's hooks) and ``frameworks`` (Megatron-Bridge's
callback; NeMo-RL's and verl's own moves delegated to the offloader).
"""

from .config import OffloadConfig
from .errors import (
    DeviceMemoryError,
    HostMemoryBudgetError,
    HostMemoryError,
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
    "DeviceMemoryError",
    "HostMemoryBudgetError",
    "HostMemoryError",
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
