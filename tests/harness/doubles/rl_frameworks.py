"""Stand-ins for the optimizer moves of NeMo-RL's Megatron policy worker and of verl.

Neither framework imports on a machine like ours: ``import verl`` needs ray (and tensordict,
pandas, pyarrow, ...), NeMo-RL's worker module ray, vLLM and Megatron-Bridge. What the
adapters replace is reproduced here from reading their sources (NeMo-RL main,
``nemo_rl/models/policy/workers/megatron_policy_worker.py``; verl main,
``verl/utils/megatron_utils.py``), with the same names and call shapes, and nothing else:

* ``MegatronPolicyWorker.move_optimizer(device)`` (NeMo-RL main at 7ea279a, 2026-08-22):
  every tensor value of each parameter's entry in ``optimizer.state`` (a ChainedOptimizer's
  proxy mapping, else ``_get_state()``) is replaced by ``.to(device)`` where it is not there
  yet; "cpu" or "cuda", anything else a ``ValueError``. Its phases call it as NeMo-RL does:
  "cpu" before log-prob inference (unless ``keep_train_buffers``, and only with
  ``offload_optimizer_for_logprob``) and before refit (with ``offload_optimizer_for_refit``,
  NeMo-RL's default), "cuda" before training (always) and before a checkpoint save. None of
  them when ``optimizer_cpu_offload`` is set.
* ``offload_megatron_optimizer(optimizers)`` / ``load_megatron_optimizer(optimizers)``: per
  optimizer of a chain, the fp32 masters (``shard_fp32_from_float16_groups``) moved with
  ``p.data = p.data.to(...)``, then ``exp_avg`` and ``exp_avg_sq`` of each state entry with
  ``.to(...)``. A second module imports them by name, as verl's engine does.

On CPU ranks "cuda" is the CPU (the harness redirects it), so a move copies nothing: what the
tests see is what reading and rewriting the states does to an attached offloader.
"""

from __future__ import annotations

import sys
import types

import torch


class MegatronPolicyWorker:
    """The optimizer side of NeMo-RL's worker: its moves and the phases that call them."""

    def __init__(self, model_chunks, optimizer, config, train_step) -> None:
        self.model, self.optimizer, self.config = model_chunks, optimizer, config
        self.optimizer_cpu_offload = False
        self.offload_optimizer_for_logprob = True  # policy.offload_optimizer_for_logprob
        self.offload_optimizer_for_refit = True  # policy.offload_optimizer_for_refit (default)
        self._train_step = train_step
        self._steps = 0

    def move_optimizer(self, device: str):
        from megatron.core.optimizer import ChainedOptimizer

        state = (
            self.optimizer.state
            if isinstance(self.optimizer, ChainedOptimizer)
            else self.optimizer._get_state()
        )
        for _, entry in state.items():
            for key, value in entry.items():
                if not torch.is_tensor(value):
                    continue
                if device == "cpu":
                    if value.is_cuda:
                        entry[key] = value.to("cpu")
                elif device == "cuda":
                    if not value.is_cuda:
                        entry[key] = value.to("cuda")
                else:
                    raise ValueError(
                        f"Invalid device: {device}. Only strings 'cpu' and 'cuda' are supported."
                    )

    def move_model(self, model, device: str, move_params: bool = True, move_grads: bool = True):
        """NeMo-RL's: megatron-core's own buffer moves (parameters copied to a pinned host
        copy and back, gradients freed and zeroed), per buffer of a DDP chunk. (Pinning is a
        plain copy on CPU ranks.)"""
        from megatron_offload_testing.cpu_megatron import plain_pinning

        with plain_pinning():
            self._move_buffers(model, device, move_params, move_grads)
        return model

    def _move_buffers(self, model, device, move_params, move_grads) -> None:
        for buffers in (model.buffers, model.expert_parallel_buffers):
            for buffer in buffers:
                if device == "cpu":
                    buffer.offload_to_cpu(move_params=move_params, move_grads=move_grads)
                elif device == "cuda":
                    buffer.reload_from_cpu(move_params=move_params, move_grads=move_grads)
                else:
                    raise ValueError(
                        f"Invalid device: {device}. Only strings 'cpu' and 'cuda' are supported."
                    )

    def _move_chunks(self, device, **moves) -> None:
        self.model = [self.move_model(chunk, device, **moves) for chunk in self.model]

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        self._move_chunks("cuda", move_grads=False)
        if not keep_train_buffers:
            self._move_chunks("cpu", move_params=False, move_grads=True)
        if (
            not keep_train_buffers
            and not self.optimizer_cpu_offload
            and self.offload_optimizer_for_logprob
        ):
            self.move_optimizer("cpu")

    def prepare_for_training(self) -> None:
        self._move_chunks("cuda", move_grads=True, move_params=True)
        if not self.optimizer_cpu_offload:
            self.move_optimizer("cuda")

    def train(self, steps: int) -> list:
        results = []
        for _ in range(steps):
            results.append(self._train_step(self.model, self.optimizer, self.config, self._steps))
            self._steps += 1
        return results

    def offload_before_refit(self) -> None:
        self._move_chunks("cpu", move_params=False, move_grads=True)
        if not self.optimizer_cpu_offload and self.offload_optimizer_for_refit:
            self.move_optimizer("cpu")

    def offload_after_refit(self) -> None:
        self._move_chunks("cpu")
        self.offload_before_refit()

    def save_checkpoint(self, save) -> None:
        if not self.optimizer_cpu_offload:
            self.move_optimizer("cuda")
        save(self.model, self.optimizer)


def _chain(optimizers):
    return getattr(optimizers, "chained_optimizers", None) or [optimizers]


def _move_masters(optimizer, device) -> None:
    for group in getattr(optimizer, "shard_fp32_from_float16_groups", None) or []:
        for param in group:
            param.data = param.data.to(device, non_blocking=True)


def _move_moments(optimizer, device) -> None:
    for entry in optimizer.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry:
                entry[key] = entry[key].to(device, non_blocking=True)


def offload_megatron_optimizer(optimizers):
    for optimizer in _chain(optimizers):
        _move_masters(optimizer, "cpu")
        if optimizer.optimizer is not None:
            _move_moments(optimizer, "cpu")


def load_megatron_optimizer(optimizers):
    for optimizer in _chain(optimizers):
        _move_masters(optimizer, "cuda")
        if optimizer.optimizer is not None:
            _move_moments(optimizer, "cuda")


def offload_megatron_model_to_cpu(models):
    for chunk in models:
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            if buffer.param_data.untyped_storage().nbytes() > 0:
                if getattr(buffer.param_data, "cpu_data", None) is None:
                    buffer.param_data.cpu_data = torch.empty_like(buffer.param_data, device="cpu")
                    buffer.param_data_size = buffer.param_data.untyped_storage().size()
                buffer.param_data.cpu_data.copy_(buffer.param_data)
                buffer.param_data.untyped_storage().resize_(0)
            if buffer.grad_data.untyped_storage().nbytes() > 0:
                buffer.grad_data_size = buffer.grad_data.untyped_storage().size()
                buffer.grad_data.untyped_storage().resize_(0)
        for param in chunk.module.parameters():
            if not param.requires_grad:
                param.data = param.data.to("cpu", non_blocking=True)


def load_megatron_model_to_gpu(models, load_grad=True, load_frozen_params=True):
    for chunk in models:
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            if load_grad and hasattr(buffer, "grad_data_size"):
                if buffer.grad_data.untyped_storage().size() == 0:
                    buffer.grad_data.untyped_storage().resize_(buffer.grad_data_size)
                buffer.grad_data.zero_()
            if buffer.param_data.untyped_storage().size() == 0:
                buffer.param_data.untyped_storage().resize_(buffer.param_data_size)
                buffer.param_data.copy_(buffer.param_data.cpu_data, non_blocking=True)
        if load_frozen_params:
            for param in chunk.module.parameters():
                if not param.requires_grad:
                    param.data = param.data.to("cuda", non_blocking=True)


def verl_modules(root: str = "verl_double"):
    """``(megatron_utils, engine)``: the stand-in module and one that imported its moves by
    name, registered in ``sys.modules`` under ``root`` (as verl's are under ``verl``)."""
    utils = types.ModuleType(f"{root}.utils.megatron_utils")
    engine = types.ModuleType(f"{root}.workers.engine")
    for module in (utils, engine):
        module.offload_megatron_optimizer = offload_megatron_optimizer
        module.load_megatron_optimizer = load_megatron_optimizer
        module.offload_megatron_model_to_cpu = offload_megatron_model_to_cpu
        module.load_megatron_model_to_gpu = load_megatron_model_to_gpu
    for name in (root, f"{root}.utils", f"{root}.workers"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[utils.__name__] = utils
    sys.modules[engine.__name__] = engine
    return utils, engine


# ------------------------------------------------------------- verl's engine and its registry
class EngineRegistry:
    """verl's ``verl/workers/engine/base.py`` registry: ``register`` maps (model type,
    backend) to an engine class, the last registration winning; ``new`` builds one."""

    _engines: dict = {}

    @classmethod
    def register(cls, model_type: str, backend: str, device: str = "cuda"):
        def decorator(engine_class):
            cls._engines[(model_type, backend)] = engine_class
            return engine_class

        return decorator

    @classmethod
    def new(cls, model_type: str, backend: str, *args, **kwargs):
        return cls._engines[(model_type, backend)](*args, **kwargs)


class MegatronEngine:
    """The optimizer side of verl's ``MegatronEngine`` (``transformer_impl.py``):
    ``initialize()`` builds the model, then the optimizer (``_build_optimizer``), then moves
    the optimizer to the host when ``optimizer_offload`` is set; ``train_mode()`` brings it
    back on entry and moves it out again on exit (``to``), through the module-level names
    ``load_megatron_optimizer`` / ``offload_megatron_optimizer`` of the engine's module."""

    def __init__(self, build, optimizer_offload: bool = True) -> None:
        self._build = build  # () -> (model_chunks, optimizer, config): the harness's build
        self._is_offload_optimizer = optimizer_offload
        self.module = self.optimizer = self.config = None

    def _build_optimizer(self):
        return self._optimizer_built

    def initialize(self) -> None:
        self.module, self._optimizer_built, self.config = self._build()
        self.optimizer = self._build_optimizer()
        self.to("cpu", optimizer=self._is_offload_optimizer)

    def to(self, device: str, optimizer: bool = True) -> None:
        # verl's engine module imported the moves by name: looked up there at call time.
        module = sys.modules.get(_ENGINE_MODULE) or sys.modules[__name__]
        if optimizer and self.optimizer is not None:
            (
                module.offload_megatron_optimizer
                if device == "cpu"
                else module.load_megatron_optimizer
            )(self.optimizer)

    def train_mode(self):
        engine = self

        class _TrainMode:
            def __enter__(self):
                engine.to("cuda", optimizer=engine._is_offload_optimizer)
                return engine

            def __exit__(self, *exc):
                engine.to("cpu", optimizer=engine._is_offload_optimizer)

        return _TrainMode()


class MegatronEngineWithLMHead(MegatronEngine):
    """The class verl registers for ("language_model", "megatron")."""


_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"


def install_real_names():
    """Register the stand-ins under the module names the frameworks use (``verl.*``,
    ``nemo_rl.*``), as they would be in a worker process of either framework, so that code
    written against them (``examples/rl/``) imports them; ``remove_real_names`` undoes it."""
    EngineRegistry._engines = {}
    EngineRegistry.register("language_model", "megatron")(MegatronEngineWithLMHead)
    utils = types.ModuleType("verl.utils.megatron_utils")
    utils.offload_megatron_optimizer = offload_megatron_optimizer
    utils.load_megatron_optimizer = load_megatron_optimizer
    utils.offload_megatron_model_to_cpu = offload_megatron_model_to_cpu
    utils.load_megatron_model_to_gpu = load_megatron_model_to_gpu
    base = types.ModuleType("verl.workers.engine.base")
    base.EngineRegistry = EngineRegistry
    impl = types.ModuleType(_ENGINE_MODULE)
    impl.MegatronEngine, impl.MegatronEngineWithLMHead = MegatronEngine, MegatronEngineWithLMHead
    impl.offload_megatron_optimizer = offload_megatron_optimizer  # imported by name, as verl's
    impl.load_megatron_optimizer = load_megatron_optimizer
    worker = types.ModuleType("nemo_rl.models.policy.workers.megatron_policy_worker")
    worker.MegatronPolicyWorker = type(
        "MegatronPolicyWorker",
        (MegatronPolicyWorker,),
        {"move_optimizer": MegatronPolicyWorker.move_optimizer},
    )
    modules = {m.__name__: m for m in (utils, base, impl, worker)}
    for name in list(modules):
        parts = name.split(".")
        for end in range(1, len(parts)):
            modules.setdefault(".".join(parts[:end]), types.ModuleType(".".join(parts[:end])))
    for name, module in modules.items():
        assert name not in sys.modules, f"{name} is imported already: not a stand-in's place"
        sys.modules[name] = module
    return list(modules)


def remove_real_names(names) -> None:
    for name in names:
        sys.modules.pop(name, None)
