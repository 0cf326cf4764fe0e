"""Adapters: where each optimizer kind keeps the tensors worth offloading."""

from .distributed_optimizer import KINDS, OPTIMIZER_STATES, PRIMARY_WEIGHTS, collect

__all__ = ["KINDS", "OPTIMIZER_STATES", "PRIMARY_WEIGHTS", "collect"]
