"""NeMo-RL: offload the policy's optimizer states between steps (a worker extension).

Name the class as the policy's worker extension, so that NeMo-RL's Ray workers build it:

    # this file copied into your project as my_project/nemo_rl_offload_worker.py:
    Policy(..., worker_extension_cls_fqn="my_project.nemo_rl_offload_worker.OffloadingMegatronPolicyWorker")
    policy.megatron_cfg.enabled=true
    policy.megatron_cfg.optimizer.use_distributed_optimizer=true
    policy.megatron_cfg.optimizer.optimizer_cpu_offload=false   # a different feature, refused
    policy.offload_optimizer_for_logprob: as you like (with the offloader it costs nothing)

NeMo-RL's worker moves every ``optimizer.state`` tensor with ``move_optimizer("cpu")`` before
log-prob inference and weight refit, and with ``move_optimizer("cuda")`` before training and
before a checkpoint save, one pageable tensor at a time, leaving the fp32 masters on the
device. With ``install()`` the first is ``offloader.offload()`` (masters included) and the
second does nothing: the states come back only inside each ``optimizer.step()``, and a save
is served from the host copy.
"""

from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

import megatron_offload
from megatron_offload.frameworks import nemo_rl as nemo_rl_offload

nemo_rl_offload.install()  # MegatronPolicyWorker.move_optimizer delegates


class OffloadingMegatronPolicyWorker(MegatronPolicyWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # builds the model and the optimizer
        self.offloader = (
            megatron_offload.attach(self.optimizer) if self.optimizer is not None else None
        )
