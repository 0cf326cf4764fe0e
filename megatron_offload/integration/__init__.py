"""Integration with megatron-core: the offloader, ``attach`` and its training hooks."""

from .attach import attach
from .offloader import OptimizerStateOffloader, distributed_optimizers

__all__ = ["attach", "OptimizerStateOffloader", "distributed_optimizers"]
