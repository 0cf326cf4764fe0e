"""Adapters: where each optimizer kind keeps the tensors worth offloading."""

from .inner_optimizers import StateAccess, kind_of, state_access
from .megatron_wrappers import KINDS, MASTER_WEIGHTS, OPTIMIZER_STATES, collect

__all__ = [
    "KINDS",
    "OPTIMIZER_STATES",
    "MASTER_WEIGHTS",
    "StateAccess",
    "collect",
    "kind_of",
    "state_access",
]
