"""Run the real megatron-core (DDP, DistributedOptimizer, GPTModel) on CPU processes.

megatron-core assumes a CUDA device in a handful of places. `install()` redirects those to the
CPU, process-wide, and nothing else. Every redirect names the megatron-core call that needs it.
Those marked "needed" were found by leaving them out of a DDP + DistributedOptimizer + GPTModel
run on 0.16.1 and 0.19.2 (it raised, or silently drew different random numbers); the others
serve megatron-core paths the model builders do not reach (training initialization,
checkpointing, multi-instance DDP) and are plain no-ops.

What deliberately stays untouched: `torch.cuda.is_available()` and
`torch.accelerator.is_available()` keep returning False, so code with its own device layer
(the offloader under test) still sees a machine without an accelerator. `torch.cuda.device_count()`
reports one device because megatron-core only skips work when it is zero.

Caveats: the function mode below also rewrites `device='cuda'` arguments and makes
`Tensor.type()` report CUDA names for every caller in the process, not just megatron-core. Torch
function modes are thread-local: it is active on the thread that called install() (the rank's
main thread, where jobs run), not on threads megatron-core or a test may start.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_mode: TorchFunctionMode | None = None
# (owner, attribute) -> the value install() replaced; kept for diagnosis of what was patched.
ORIGINALS: dict = {}


def _patch(owner, name: str, value) -> None:
    ORIGINALS[(owner, name)] = getattr(owner, name)
    setattr(owner, name, value)


class _HostStream:
    """Stand-in for torch.cuda.Stream: on the CPU every op is complete when it returns."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _HostEvent:
    """Stand-in for torch.cuda.Event (completed as soon as it is recorded)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event):
        return 0.0


_HOST_STREAM = _HostStream()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer device index means a CUDA device to torch; none exists here.
    return isinstance(device, int) and not isinstance(device, bool)


def _cuda_type_name(cpu_name: str) -> str:
    # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor'
    prefix = "torch."
    if cpu_name.startswith(prefix) and not cpu_name.startswith("torch.cuda."):
        return "torch.cuda." + cpu_name[len(prefix) :]
    return cpu_name


def _cpu_type_name(name):
    if isinstance(name, str) and name.startswith("torch.cuda."):
        return "torch." + name[len("torch.cuda.") :]
    return name


class _CudaOnCpuMode(TorchFunctionMode):
    """Makes torch calls written for CUDA run on the CPU.

    - `device='cuda'` / `device=torch.device('cuda')` in factories (optimizer flags
      `torch.tensor([0.0], device='cuda')` in optimizer.py, grad_scaler.py, clip_grads.py, the
      token counter in pipeline_parallel/schedules.py, `torch.zeros([1], device="cuda")` in
      param_and_grad_buffer.py) are redirected to the CPU.
      Needed: without it DistributedOptimizer.__init__ fails creating its flags.
    - `Tensor.to('cuda')` / `Tensor.cuda()` return the CPU tensor (dist_checkpointing's
      exchange_utils, the DistributedOptimizer's checkpoint gather, GradScaler.load_state_dict).
    - `Tensor.type()` reports 'torch.cuda.FloatTensor' etc. Needed: DistributedOptimizer and
      MixedPrecisionOptimizer dispatch on `param.type()` against the CUDA names and raise
      TypeError for anything else; clip_grads asserts it for fp32 grads.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process passes here: the common case (no device, none of
        # the three methods) returns at once.
        if func is _TYPE or func is _CUDA or func is _TO:
            return self._redirect(func, args, dict(kwargs) if kwargs else {})
        if kwargs:
            if _is_cuda_device(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)
        return func(*args)

    @staticmethod
    def _redirect(func, args, kwargs):
        if func is _TYPE:
            if len(args) == 1 and not kwargs:
                return _cuda_type_name(func(*args))
            if len(args) > 1:
                args = (args[0], _cpu_type_name(args[1])) + tuple(args[2:])
            if "dtype" in kwargs:
                kwargs["dtype"] = _cpu_type_name(kwargs["dtype"])
            return func(*args, **kwargs)
        if func is _CUDA:
            # A real .cuda() returns the tensor itself when it already lives on the device.
            return args[0]
        if len(args) > 1 and _is_cuda_device(args[1]):  # Tensor.to
            args = (args[0], "cpu") + tuple(args[2:])
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


# The tensor methods the mode rewrites whatever their arguments.
_TYPE, _CUDA, _TO = torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.to


class _PlainPinning(TorchFunctionMode):
    """``Tensor.pin_memory()`` returns a plain host copy and ``pin_memory=True`` in factories
    is dropped: pinning needs a CUDA driver."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.pin_memory:
            return args[0].clone()
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def plain_pinning():
    """For the block, host copies that a GPU process would pin are plain ones (the RL
    frameworks' own model moves: megatron-core's ``offload_to_cpu``, verl's host buffers)."""
    return _PlainPinning()


def _cpu_get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_get_rng_state_megatron(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


#: The module of Megatron-FSDP (megatron-core's vendored copy, or the megatron-fsdp package)
#: that formats the current device into ``"cuda:{index}"``.
_FSDP_MODULE = "megatron_fsdp.megatron_fsdp"


def _current_device():
    """The CPU device; for Megatron-FSDP's module, the index 0, as on a GPU.

    Megatron-FSDP formats the answer into ``"cuda:{index}"`` while it builds and steps (the
    device it is given is the CPU). Every other caller gets the CPU device: the function mode
    sends a bare index to the CPU, but not inside the autograd engine, where a tensor-parallel
    gather (MoE's backward) allocates with it."""
    caller = sys._getframe(1).f_globals.get("__name__", "")
    return 0 if caller.endswith(_FSDP_MODULE) else torch.device("cpu")


def _eager_compile(model=None, **options):
    """``torch.compile`` on CPU ranks: ``model`` itself, run eagerly."""
    if model is None:  # @torch.compile(...) as a decorator factory
        return lambda model: model
    return model


def install() -> None:
    """Redirect megatron-core's CUDA assumptions to the CPU for this whole process (idempotent).

    Must be called in every process that runs megatron-core, before it builds models, so
    that tensor allocations, RNG trackers and the function mode are in place.
    """
    global _installed, _mode
    if _installed:
        return

    # megatron.core.jit wraps fused helpers (bias-gelu, bias-dropout-add) in torch.compile.
    # The model builders run either way, but megatron.training's JIT warm-up compiles them at
    # start-up and fails under the function mode below. The eager versions compute the same.
    # torch.compile hands back what it is given (what it returns under TORCHDYNAMO_DISABLE):
    # its wrapper, which would only run the function eagerly here, imports dynamo and inductor
    # to be built, some 2 s of a core in every process that imports megatron-core after this.
    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # dynamo, if imported later, reads it
    _patch(torch, "compile", _eager_compile)
    if "torch._dynamo" in sys.modules:  # compiled before this: run eagerly too
        import torch._dynamo.config as dynamo_config

        _patch(dynamo_config, "disable", True)

    cuda = torch.cuda
    # Needed: ParamAndGradBuffer, DistributedOptimizer, tensor_parallel layers and
    # rotary embeddings allocate with `device=torch.cuda.current_device()` (the CPU device:
    # inside the autograd engine, where the function mode is not active, an index would
    # reach CUDA; Megatron-FSDP's module gets one all the same: ``_current_device``).
    _patch(cuda, "current_device", _current_device)
    # Needed (0.19): _ParamAndGradBucketGroup.start_grad_sync/finish_grad_sync call
    # torch.cuda.current_stream() on every gradient reduction.
    _patch(cuda, "current_stream", lambda device=None: _HOST_STREAM)

    # Not reached by build()/train_step, kept for the megatron-core paths tests may add:
    # initialize_megatron skips model-parallel and RNG setup when device_count() == 0, and
    # pins each rank with set_device(rank % device_count()).
    _patch(cuda, "device_count", lambda: 1)
    _patch(cuda, "set_device", lambda device: None)
    # DDP with num_distributed_optimizer_instances > 1 creates a communication Stream and
    # enters torch.cuda.stream(); 0.16 also waits on default_stream() there.
    _patch(cuda, "Stream", _HostStream)
    _patch(cuda, "Event", _HostEvent)
    _patch(cuda, "default_stream", lambda device=None: _HOST_STREAM)
    _patch(cuda, "stream", lambda stream=None: contextlib.nullcontext(stream))
    # DDP.offload_grad_buffers/restore_grad_buffers, MegatronOptimizer.offload_to_cpu and the
    # dist_checkpointing save strategies synchronize / empty the cache.
    _patch(cuda, "synchronize", lambda device=None: None)
    _patch(cuda, "empty_cache", lambda: None)

    # The model-parallel RNG tracker (tensor_parallel/random.py) saves, seeds and restores the
    # CUDA generator around weight init and dropout; CPU kernels draw from the CPU default
    # generator, so the tracker must drive that one. Found by leaving each out:
    # - CudaRNGStatesTracker.add reads torch.cuda.get_rng_state(): raises without CUDA.
    _patch(cuda, "get_rng_state", _cpu_get_rng_state)
    # - model_parallel_cuda_manual_seed/add call torch.cuda.manual_seed(), which without CUDA
    #   is queued forever: every tracker state silently equals the current CPU state.
    _patch(cuda, "manual_seed", _cpu_manual_seed)
    from megatron.core.tensor_parallel import random as mcore_random

    # - fork() switches states with _set_cuda_rng_state, which defers through
    #   torch.cuda._lazy_call and so never runs: silently different dropout/init draws.
    _patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    # - fork() reads the current state through torch.cuda.random.get_rng_state().
    _patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state_megatron)
    # With one generator in both roles, fork() sees the "CPU" state change inside every forked
    # region (dropout) and logs a warning each time; that is expected here.
    logging.getLogger(mcore_random.__name__).setLevel(logging.ERROR)

    _run_each_gloo_group_in_order()
    _give_megatron_fsdp_the_cpu()
    _serve_the_deepseek_recipe()
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_step_every_megatron_fsdp_parameter)
    _mode = _CudaOnCpuMode()
    _mode.__enter__()
    _installed = True


def _run_each_gloo_group_in_order() -> None:
    """Every gloo process group created from now on runs its collectives on one worker thread,
    in the order they were issued, as a GPU's communication stream runs NCCL's.

    Needed: gloo gives each group two worker threads, so two asynchronous collectives of one
    group run at the same time, and torch 2.13's gloo coalesced all-gather
    (``allgather_into_tensor_coalesced``) is not safe that way: two of them in flight on one
    group corrupt the heap (``malloc(): unaligned tcache chunk detected``, ``malloc_consolidate():
    unaligned fastbin chunk detected`` or a segmentation fault in a gloo worker thread, one
    run in a few). Megatron-FSDP's overlapped parameter gather issues one such coalesced
    all-gather per bucket group, back to back, and waits for them later. NCCL on a GPU never
    takes this path: its collectives of one group run in order on the group's stream. (Must run
    before ``init_process_group``: a group keeps the worker threads it was created with.)"""
    from torch.distributed import distributed_c10d

    gloo = getattr(distributed_c10d, "ProcessGroupGloo", None)
    if gloo is None:  # a torch built without gloo: nothing runs on it
        return
    default_timeout = distributed_c10d.default_pg_timeout

    class InOrderGloo(gloo):
        """A ProcessGroupGloo with one worker thread; everything else as torch builds it."""

        def __init__(self, store, rank, size, timeout=default_timeout):
            options = gloo._Options()
            if timeout is not None:
                options._timeout = timeout
            options._threads = 1
            options._devices = [gloo.create_default_device()]
            super().__init__(store, rank, size, options)

    _patch(distributed_c10d, "ProcessGroupGloo", InOrderGloo)


def _give_megatron_fsdp_the_cpu() -> None:
    """Megatron-FSDP's model chunk without a ``device`` (megatron.training passes none) gets
    the CPU: it allocates its gradient buckets inside post-accumulate-grad hooks, where the
    device-rewriting mode is not active, on the device it was given."""
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    except ImportError:  # a megatron-core without it, or without its requirements (einops)
        return
    cls = mcore_fsdp_adapter.FullyShardedDataParallel
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, device=None, **kwargs):
        original(self, *args, device=device or torch.device("cpu"), **kwargs)

    _patch(cls, "__init__", __init__)


def _serve_the_deepseek_recipe() -> None:
    """What NVIDIA's DeepSeek-V3 recipe (multi-latent attention, MoE with the alltoall
    dispatcher, ``--recompute-modules layernorm``) needs of megatron-core 0.19 to run on a CPU
    with the local transformer implementation; each line names the error it fixes. None
    changes a value: the same model on a GPU computes the same thing."""
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import dot_product_attention

    # MLASelfAttention builds its core attention with ``k_channels`` and ``v_channels``, which
    # the local DotProductAttention does not take ("__init__() got an unexpected keyword
    # argument 'k_channels'"). It reads the head sizes from the tensors it is given, except
    # the output's, which is ``kv_channels``: exact when ``v_channels`` equals it (refused
    # otherwise).
    attention = dot_product_attention.DotProductAttention
    build_attention = attention.__init__

    @functools.wraps(build_attention)
    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(
                f"the local DotProductAttention computes multi-latent attention only with "
                f"--v-head-dim equal to --kv-channels (got {v_channels} and {config.kv_channels})"
            )
        build_attention(self, config, *args, **kwargs)

    _patch(attention, "__init__", __init__)

    # CheckpointWithoutOutput (``--recompute-modules layernorm``, ``mla_up_proj``, ``moe_act``)
    # sets ``self.fp8 = fp8 is not None``, true for its default ``fp8=False``, and then takes
    # the FP8 path of the recompute, which reaches CUDA ("Found no NVIDIA driver on your
    # system").
    checkpoint = mcore_random.CheckpointWithoutOutput
    build_checkpoint = checkpoint.__init__

    @functools.wraps(build_checkpoint)
    def checkpoint_init(self, fp8=False):
        build_checkpoint(self, fp8=None if fp8 is False else fp8)

    _patch(checkpoint, "__init__", checkpoint_init)

    # The alltoall dispatcher moves its split sizes to the host as numpy arrays with
    # ``maybe_move_tensor_to_cpu(as_numpy=True)``, which converts CUDA tensors only: on a CPU
    # they reach ``all_to_all_single`` as tensors ("all_to_all_single(): incompatible function
    # arguments"). As on a GPU, a copy on the host.
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(move)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().clone().numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _step_every_megatron_fsdp_parameter(optimizer, args, kwargs) -> None:
    """Before every torch optimizer step, a Megatron-FSDP parameter whose shard on this rank is
    empty gets an empty zero gradient, so torch's Adam makes and advances its state as on the
    ranks holding the parameter's shards.

    Without it, torch's Adam (megatron-core's fallback without Transformer Engine and apex, so
    the CPU's) skips such a parameter: ranks hold different state keys, and megatron-core's
    fsdp_dtensor save waits forever in its metadata gather
    (``preprocess_state_dict_for_uneven_dtensor``); and its ``step`` stays 0 while it advances
    on the other ranks, where the checkpoint keeps ONE ``step`` per parameter (a plain tensor,
    deduplicated over ranks), so a resume hands some rank another rank's count. Transformer
    Engine's FusedAdam, which GPU runs use, keeps one step per group and makes every state.
    Training is unchanged: the gradients are empty."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            shard = getattr(param, "_local_tensor", None)
            if shard is not None and shard.numel() == 0 and param.grad is None:
                param.grad = torch.zeros_like(param)


def is_installed() -> bool:
    return _installed
