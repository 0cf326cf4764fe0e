"""Optimizer-state and master-weight offloading for megatron-core's DistributedOptimizer.

    import megatron_offload
    optimizer = get_megatron_optimizer(config, model)
    offloader = megatron_offload.attach(optimizer)   # states live on the host between steps

The package is layered: ``device`` (the only code that knows accelerators), ``engine``
(moves a set of tensors), ``adapters`` (finds the tensors of each optimizer kind) and
``integration`` (attach, the per-step cycle, Megatron-facing API).
"""

from .config import OffloadConfig
from .engine import HostMemoryBudgetError, OffloadStateError
from .integration import OptimizerStateOffloader, attach

__version__ = "0.1.0"

__all__ = [
    "HostMemoryBudgetError",
    "OffloadConfig",
    "OffloadStateError",
    "OptimizerStateOffloader",
    "attach",
    "__version__",
]
