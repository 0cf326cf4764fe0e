"""The engine: moves a set of tensors between device and host (knows nothing of optimizers)."""

from .engine import HostBudget, HostMemoryBudgetError, OffloadEngine, OffloadStateError
from .groups import FlatGroup, Place
from .slots import SlotSizeError, SlotStream

__all__ = [
    "HostBudget",
    "HostMemoryBudgetError",
    "OffloadEngine",
    "OffloadStateError",
    "FlatGroup",
    "Place",
    "SlotSizeError",
    "SlotStream",
]
