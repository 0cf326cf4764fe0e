"""Integration with megatron-core and megatron.training: the offloader, ``attach`` and its
training hooks, command-line arguments and the pretrain-script patches."""

from .arguments import OffloadArgumentError, add_arguments, validate_args
from .attach import attach
from .offloader import OptimizerStateOffloader, distributed_optimizers
from .training import patch_megatron, unpatch_megatron

__all__ = [
    "OffloadArgumentError",
    "OptimizerStateOffloader",
    "add_arguments",
    "attach",
    "distributed_optimizers",
    "patch_megatron",
    "unpatch_megatron",
    "validate_args",
]
