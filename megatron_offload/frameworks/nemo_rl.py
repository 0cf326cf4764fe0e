"""NeMo-RL: its Megatron policy worker's optimizer moves delegate to the attached offloader.

NeMo-RL's ``MegatronPolicyWorker`` (``nemo_rl/models/policy/workers/megatron_policy_worker.py``)
moves every tensor of ``optimizer.state`` with ``move_optimizer("cpu")`` before log-prob
inference and around weight refit, and with ``move_optimizer("cuda")`` before training (always,
also before anything was moved out) and before a checkpoint save; one tensor at a time,
pageable, synchronous, leaving the fp32 master weights on the device. With an offloader
attached to ``worker.optimizer``, ``install()`` turns those calls into ``phases.to_host`` and
``phases.to_device``: the states travel once, asynchronously, masters included, and a
checkpoint save is served from the host copy. Its model moves
(``move_model(model, device, move_params, move_grads)``: megatron-core's buffer moves, the
parameters copied out and back, the gradients freed) become ``sleep()`` / ``wake()`` of the
parts moved, for the model the attached optimizer was built for (a reference model keeps
NeMo-RL's own move).

    from megatron_offload.frameworks import nemo_rl
    nemo_rl.install()   # once per worker process, before the worker's first phase

NeMo-RL skips its moves when ``optimizer_cpu_offload`` is set; megatron-offload refuses that
setting (a different, CPU-compute feature) at attach.
"""

from __future__ import annotations

import functools
import importlib

from ..interceptions import PROCESS
from ..megatron.training import find_offloader
from ..offloader.sleep import owner_of
from .phases import model_to_device, model_to_host, to_device, to_host

MODULE = "nemo_rl.models.policy.workers.megatron_policy_worker"
CLASS = "MegatronPolicyWorker"
_installed: dict = {}  # worker class -> what install() replaced in it (removable handles)
_WHY = "NeMo-RL's optimizer and model moves delegate to the attached offloader"


def install(worker_class=None) -> None:
    """Make ``worker_class.move_optimizer`` and ``move_model`` (NeMo-RL's
    ``MegatronPolicyWorker`` by default) delegate to the offloader attached to
    ``self.optimizer``; idempotent."""
    cls = worker_class if worker_class is not None else _worker_class()
    if cls in _installed:
        return
    own = cls.__dict__.get("move_optimizer")
    if own is None:
        raise TypeError(
            f"{cls.__qualname__} has no move_optimizer of its own: not NeMo-RL's Megatron policy worker."
        )
    own_model = cls.__dict__.get("move_model")

    @functools.wraps(own)
    def move_optimizer(self, device: str):
        offloader = find_offloader(getattr(self, "optimizer", None))
        if offloader is None:
            return own(self, device)
        _check(device)
        (to_host if device == "cpu" else to_device)(offloader)

    handles = [PROCESS.replace(cls, "move_optimizer", move_optimizer, why=_WHY)]
    if own_model is not None:

        @functools.wraps(own_model)
        def move_model(self, model, device: str, move_params=True, move_grads=True):
            offloader = find_offloader(getattr(self, "optimizer", None))
            if offloader is None or owner_of(model) is not offloader:  # a reference model
                return own_model(self, model, device, move_params, move_grads)
            _check(device)
            parts = {"parameters": move_params, "gradients": move_grads}
            if device == "cpu":
                model_to_host(offloader, model, **parts)
            else:
                model_to_device(offloader, **parts)
            return model

        handles.append(PROCESS.replace(cls, "move_model", move_model, why=_WHY))
    _installed[cls] = handles


def _check(device: str) -> None:
    if device not in ("cpu", "cuda"):  # as NeMo-RL's own
        raise ValueError(f"Invalid device: {device}. Only strings 'cpu' and 'cuda' are supported.")


def uninstall(worker_class=None) -> None:
    """Give ``worker_class`` its own ``move_optimizer`` and ``move_model`` back."""
    cls = worker_class if worker_class is not None else _worker_class()
    for handle in reversed(_installed.pop(cls, [])):
        handle.remove()


def _worker_class():
    try:
        return getattr(importlib.import_module(MODULE), CLASS)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"megatron_offload.frameworks.nemo_rl.install() needs NeMo-RL's {MODULE}.{CLASS} ({error}); "
            "pass the worker class as install(worker_class) if it lives elsewhere."
        ) from error
