"""The engine: moves a set of tensors between device and host (knows nothing of optimizers)."""

from .engine import OffloadEngine, OffloadStateError
from .groups import FlatGroup, Place

__all__ = ["OffloadEngine", "OffloadStateError", "FlatGroup", "Place"]
