"""verl: offload the actor's optimizer states between steps (a worker-side module).

Import this module in verl's worker processes, before the actor's engine is built (for
example from the module that defines your reward or your custom worker): it registers an
engine that attaches the offloader right after verl builds the Megatron optimizer, and makes
verl's own optimizer moves delegate to it.

    actor_rollout_ref.actor.strategy=megatron
    actor_rollout_ref.actor.megatron.use_distributed_optimizer=True
    actor_rollout_ref.actor.megatron.optimizer_offload=True   # or False: the same result
    (no optim.override_optimizer_config.optimizer_cpu_offload: a different feature, refused)

With ``optimizer_offload=True`` verl calls ``offload_megatron_optimizer`` after init and when
leaving train mode, and ``load_megatron_optimizer`` when entering it; with ``install()`` the
first is ``offloader.offload()`` and the second does nothing: the states come back only inside
each ``optimizer.step()`` (during the gradient reduction), so they are off the device through
rollouts, log-prob computation, the forward and backward passes. Masters, moments, momentum
buffers and the masters' gradients all leave, in a few large asynchronous copies.
"""

from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

import megatron_offload
from megatron_offload.frameworks import verl as verl_offload

verl_offload.install()  # verl's offload_megatron_optimizer / load_megatron_optimizer delegate


@EngineRegistry.register(model_type="language_model", backend="megatron")
class OffloadingMegatronEngine(MegatronEngineWithLMHead):
    def _build_optimizer(self):
        optimizer = super()._build_optimizer()
        # Here, not after initialize(): initialize() moves the optimizer to the host at its
        # end, which must already be the offloader's move.
        self.offloader = megatron_offload.attach(optimizer)
        return optimizer
