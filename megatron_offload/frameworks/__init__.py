"""Frameworks that train with megatron-core through loops of their own.

Megatron-Bridge calls callbacks at fixed points of its loop: ``bridge.OptimizerStateOffloadCallback``
is the one to add (``pretrain(cfg, forward_step, callbacks=[OptimizerStateOffloadCallback()])``).

RL frameworks move the optimizer's states themselves around their phases (generation,
log-prob inference, weight refit, training, checkpoints). With an offloader attached those
moves would undo ours (reading the states brings them back) and, on a GPU, swap our tracked
tensors behind our back. Each adapter here makes the framework's own move delegate to the
attached offloader, and leaves it as it was for optimizers without one:

* ``nemo_rl.install()``: NeMo-RL's ``MegatronPolicyWorker.move_optimizer``;
* ``verl.install()``: verl's ``offload_megatron_optimizer`` / ``load_megatron_optimizer``.

One call installs an adapter (nothing to change in the framework's code); ``uninstall()``
restores the framework's own functions.
"""

from . import nemo_rl, verl
from .phases import to_device, to_host

__all__ = ["nemo_rl", "to_device", "to_host", "verl"]
