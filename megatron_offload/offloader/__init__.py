"""The offloader: its public API (``OptimizerStateOffloader``), ``attach`` and the per-step
cycle, the phase the optimizer is in, and which optimizers it serves."""

from .cycle import attach
from .offloader import OptimizerStateOffloader

__all__ = ["OptimizerStateOffloader", "attach"]
