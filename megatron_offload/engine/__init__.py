"""The engine: moves a set of tensors between device and host (knows nothing of optimizers)."""

from ..errors import HostMemoryBudgetError, OffloadStateError, SlotSizeError
from .engine import OffloadEngine
from .host import HostBudget, HostBuffers
from .pieces import Piece, Place
from .slots import SlotStream

__all__ = [
    "Piece",
    "HostBudget",
    "HostBuffers",
    "HostMemoryBudgetError",
    "OffloadEngine",
    "OffloadStateError",
    "Place",
    "SlotSizeError",
    "SlotStream",
]
