"""Sleep and wake: the whole training state off the device between uses (an RL rollout).

``sleep()`` takes, in this order: the optimizer states and master weights (offloaded as
``offload()`` does, asynchronously); the masters' fp32 gradients (dropped); the gradient
buffers (dropped: they are zeroed before the next backward anyway); the parameter buffers,
dropped where they can be made again from the masters and copied to the host where they
cannot (``adapters/model_buffers.py`` says which). ``wake()`` gives everything back in the
opposite order on the caller's stream: storages regrown (gradients zeroed, copied parameters
copied back), the states and masters sleep took reloaded, and the dropped parameters made
again as megatron-core makes them after a step (each rank casts its master shards, the model
chunks all-gather the buffers). Masters the step cycle keeps on the host come back for the
cast only and are released again without a copy.

A rebuild is exact only while the parameters still equal their masters cast. That is
checked, never assumed: directly while the masters have device memory, else against a
fingerprint (two 31-bit modular checksums of the rank's parameter shards, and whether they
equalled the masters, taken at the last offload that found the masters on the device: device
work only, read on the host at the next sleep) that nothing may have written since (a
checkpoint load, a read or write served from the host copy, ``resident()``). Where the check
fails on any rank of the data-parallel group, every rank copies that optimizer's parameters
instead, with a warning saying why.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch

from ..adapters import MASTER_WEIGHTS, OPTIMIZER_STATES
from ..adapters import model_buffers as buffers
from ..adapters.megatron_wrappers import device_of
from ..device import device_for
from ..engine.model_memory import ModelMemory
from ..errors import OffloadStateError
from ..phase import Phase
from .members import is_stub, megatron_optimizers

# Each DDP chunk a distributed optimizer was built for -> the offloader serving that optimizer
# (frameworks whose model moves are given the model only find it here).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_P = 2**31 - 1  # a prime: the checksums are sums modulo it
_MULTIPLIERS = (1_000_003, 998_244_353)
_CHUNK = 1 << 20


def fingerprint(tensors) -> tuple[int, int]:
    """Two checksums of the bits of 16-bit ``tensors``, in order (each element weighted by
    its position, so moved or swapped values count): integer arithmetic, the same on any
    device, in chunks of a million elements."""
    return tuple(int(value) for value in checksums(tensors).tolist())


def checksums(tensors) -> torch.Tensor:
    """``fingerprint`` as an int64 tensor of two on the tensors' device, not waited for."""
    sums = None
    offset = 0
    for tensor in tensors:
        flat = tensor.reshape(-1).view(torch.int16)
        for start in range(0, flat.numel(), _CHUNK):
            bits = flat[start : start + _CHUNK].to(torch.int64) + 32769  # 1 .. 65536
            index = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64)
            index = (index + offset + start) % _P + 1
            parts = torch.stack([((index * k) % _P * bits % _P).sum() % _P for k in _MULTIPLIERS])
            sums = parts if sums is None else (sums + parts) % _P
        offset += flat.numel()
    return torch.zeros(2, dtype=torch.int64) if sums is None else sums


class Sleep:
    """The sleep and wake of one offloader's optimizer and model chunks."""

    def __init__(self, offloader) -> None:
        self._offloader = offloader
        self._chunks: list = []
        self._rebuilders: list = []
        self._taken: list[tuple[str, ...]] = []
        self._hooks: list = []
        self._recording = None  # the offload pre-hook taking fingerprints, once slept
        # id(wrapper) -> (changes, equal to the masters, checksums): device tensors
        self._fingerprints: dict[int, tuple] = {}
        #: True while the parameters (and the states and masters) are asleep.
        self.asleep = False
        #: True while the gradient buffers are given up (with the parameters, or alone).
        self.gradients_dropped = False
        self.sleeps = 0
        self._params: ModelMemory | None = None
        self._grads: ModelMemory | None = None
        self._figures = dict.fromkeys(
            ("rebuilt_parameter_bytes", "copied_parameter_bytes", "dropped_gradient_bytes"), 0
        )

    @property
    def sleeping(self) -> bool:
        return self.asleep or self.gradients_dropped

    def register(self) -> None:
        """Make the offloader findable from its optimizer's model chunks (``owner_of``)."""
        chunks = [
            chunk
            for wrapper in megatron_optimizers(self._offloader.optimizer)
            for chunk in getattr(wrapper, "model_chunks", None) or ()
            if hasattr(chunk, "buffers")  # a DDP chunk
        ]
        # All or nothing; a weak reference: the model must not keep a dropped offloader alive
        # (its finalizers give its host memory back).
        _OWNERS.update(dict.fromkeys(chunks, weakref.ref(self._offloader)))

    # -------------------------------------------------------------------- the moves
    def sleep(self, model=None, *, parameters: bool = True, gradients: bool = True) -> None:
        offloader = self._offloader
        parameters = parameters and not self.asleep
        gradients = gradients and not self.gradients_dropped
        if not (parameters or gradients):
            return  # idempotent
        if offloader.phase.current is not Phase.IDLE:
            raise OffloadStateError(
                f"sleep() inside {offloader.phase.current.value}: call it between steps."
            )
        found = megatron_optimizers(offloader.optimizer)
        chunks = (
            buffers.model_chunks(found, model)
            if model is not None or not self._chunks
            else self._chunks
        )
        if not chunks:
            raise OffloadStateError(
                "sleep() found no model chunks: the optimizer is not a DistributedOptimizer "
                "built for them. Pass them: sleep(model=model_chunks)."
            )
        self._chunks = chunks
        if parameters and self._recording is None:
            self._recording = offloader.register_offload_pre_hook(self._record)
        rebuilders = self._rebuilders_among(found) if parameters else []
        storages = buffers.storages(chunks, rebuilders)
        grads = [s for s in storages if s.kind == buffers.GRADIENTS]
        params = [s for s in storages if s.kind == buffers.PARAMETERS]
        device = offloader.engines[0].device if offloader.engines else None
        if gradients and grads:
            self._grads = self._grads or ModelMemory(device or device_for(grads[0].tensor.device))
            self._figures["dropped_gradient_bytes"] = _nbytes(grads)
            self._grads.release([(s.tensor, False, True) for s in grads])  # zeroed on waking
            self.gradients_dropped = True
            self._watch_forward()
        if not parameters:
            return
        self._taken = [
            tuple(k for k in (OPTIMIZER_STATES, MASTER_WEIGHTS) if not engine.fully_released(k))
            for engine in offloader.engines
        ]
        offloader.offload(True, True)  # asynchronous; its copies overlap what follows
        for member in offloader.members:
            member.engine.fingerprint.release_master_grads()
        copied = [s for s in params if s.rebuilder is None]
        self._figures["copied_parameter_bytes"] = _nbytes(copied)
        self._figures["rebuilt_parameter_bytes"] = _nbytes(params) - _nbytes(copied)
        if params:
            self._params = self._params or ModelMemory(
                device or device_for(params[0].tensor.device)
            )
            self._params.release([(s.tensor, s.rebuilder is None, False) for s in params])
        self._rebuilders = rebuilders
        self._watch_forward()
        self.asleep = True
        self.sleeps += 1

    def wake(self, *, parameters: bool = True, gradients: bool = True) -> None:
        if gradients and self.gradients_dropped:
            if self._grads is not None:
                self._grads.regrow()  # zeroed, as before a backward
            self.gradients_dropped = False
        if parameters and self.asleep:
            self._wake_parameters()
        if not (self.asleep or self.gradients_dropped):
            for handle in self._hooks:
                handle.remove()
            self._hooks = []

    def _wake_parameters(self) -> None:
        offloader = self._offloader
        if self._params is not None:
            self._params.regrow()  # the copied ones get their bytes back
        # What the step cycle keeps on the host between steps stays there (the next step
        # brings it back); masters among it come back for the cast only.
        configured = offloader.configured_kinds if offloader.automatic else None
        back = [
            tuple(k for k in kinds if configured is None or k not in configured[index])
            for index, kinds in enumerate(self._taken)
        ]
        taken = {id(engine): kinds for engine, kinds in zip(offloader.engines, back)}
        borrowed = [
            member.engine
            for member in offloader.members
            if any(member.optimizer is wrapper for wrapper in self._rebuilders)
            and member.engine.is_released((MASTER_WEIGHTS,))
            and MASTER_WEIGHTS not in taken.get(id(member.engine), ())
        ]
        with offloader.phase.within(Phase.MOVING):
            for engine, kinds in zip(offloader.engines, back):
                if kinds:
                    engine.reload(kinds)
            for engine in borrowed:
                engine.reload((MASTER_WEIGHTS,))
            for engine in offloader.engines:
                engine.wait()  # ordered before the current stream, which casts and steps
            if self._rebuilders:
                buffers.rebuild(self._rebuilders, self._chunks)
            for engine in borrowed:
                # The cast only read them: released again without a copy (rule 6).
                engine.offload((MASTER_WEIGHTS,), skip_unchanged=True, release=True)
        self.asleep = False

    @contextlib.contextmanager
    def block(self, model=None):
        was = self.asleep, self.gradients_dropped
        self._offloader.sleep(model)
        try:
            yield self._offloader
        finally:
            self.wake(parameters=not was[0], gradients=not was[1])

    # ------------------------------------------------------------------ figures
    def figures(self) -> dict:
        """What the last sleep did with the model, for ``stats()``."""
        held = [m.host_bytes for m in (self._params, self._grads) if m is not None]
        return {
            "asleep": self.asleep,
            "sleeps": self.sleeps,
            **self._figures,
            "sleep_host_bytes": sum(held),
        }

    def close(self) -> None:
        self.wake()
        for chunk, owner in list(_OWNERS.items()):
            if owner() is self._offloader:
                del _OWNERS[chunk]
        if self._recording is not None:
            self._recording.remove()
            self._recording = None
        for memory in (self._params, self._grads):
            if memory is not None:
                memory.close()
        self._params = self._grads = None

    # ------------------------------------------------------------------ internals
    def _watch_forward(self) -> None:
        """What touches the model wakes it first: a forward (the parameters, and the
        gradients unless none will be made: inference), ``zero_grad_buffer()``, which
        megatron-core's training step calls before the forward, and the optimizer's step
        (everything). Installed while asleep only: awake, they cost nothing."""
        if self._hooks:
            return
        for chunk in self._chunks:
            self._hooks.append(chunk.register_forward_pre_hook(self._wake_hook))
            self._hooks.append(_InstanceWrap(chunk, "zero_grad_buffer", self._waking))
        self._hooks.append(_InstanceWrap(self._offloader.optimizer, "step", self._waking))

    def _wake_hook(self, module, args) -> None:
        self.wake(gradients=torch.is_grad_enabled())

    def _waking(self, method):
        @functools.wraps(method)
        def woken(*args, **kwargs):
            self.wake()
            return method(*args, **kwargs)

        return woken

    def _rebuilders_among(self, found) -> list:
        """The distributed optimizers whose parameters every rank of their data-parallel
        group can make again from the masters (a collective per optimizer)."""
        served = {id(member.optimizer): member.engine for member in self._offloader.members}
        rebuilders = []
        for wrapper in found:
            if is_stub(wrapper):
                continue
            why = buffers.rebuild_refusal(wrapper)
            if why is not None and not buffers.is_distributed(wrapper):
                continue  # nothing to agree on: its parameters are copied on every rank
            if why is None:
                why = self._inexact(wrapper, served.get(id(wrapper)))
            if not _agreed(why is None, wrapper) and why is None:
                why = "another rank of its data-parallel group cannot rebuild"
            if why is None:
                rebuilders.append(wrapper)
            else:
                warnings.warn(
                    f"sleep(): the parameters of {type(wrapper).__name__} are copied to the host, "
                    f"not rebuilt from the masters: {why}.",
                    stacklevel=4,
                )
        return rebuilders

    def _inexact(self, wrapper, engine) -> str | None:
        """Why a rebuild of ``wrapper``'s parameters would not be exact, or None."""
        changed = (
            "its parameters changed since the last step (a weight load that did not go through "
            "the optimizer?); after such a load, optimizer.reload_model_params() makes them the "
            "masters again"
        )
        if engine is None or not engine.is_released((MASTER_WEIGHTS,)):
            return None if buffers.matches_masters(wrapper) else changed  # masters on device
        recorded = self._fingerprints.get(id(wrapper))
        if recorded is None:
            return (
                "the masters were on the host before the first sleep, so nothing showed that "
                "the parameters equal them (checked after every step from now on)"
            )
        changes, equal, sums = recorded
        if changes != self._offloader.phase.changes:
            return "the states or masters were served for writing since the last step"
        models = (model for model, _ in buffers.shard_pairs(wrapper))
        now = checksums(models).to(sums.device)
        return None if (equal is None or bool(equal)) and torch.equal(sums, now) else changed

    def _record(self, offloader) -> None:
        """Offload pre-hook: while the masters still have device memory, note whether the
        parameters equal them cast, and a fingerprint of the parameters. Queued on the
        current stream before the offload that follows (so before the masters' memory is
        given back) and never waited for here: this runs after every step, and a host
        synchronization would stall the next iteration's launches; a sleep reads it."""
        for member in offloader.members:
            wrapper = member.optimizer
            if member.engine.is_released((MASTER_WEIGHTS,)):
                continue  # an earlier record stands, or none
            if buffers.rebuild_refusal(wrapper) is None:
                models = (model for model, _ in buffers.shard_pairs(wrapper))
                self._fingerprints[id(wrapper)] = (
                    offloader.phase.changes,
                    buffers.masters_match(wrapper),
                    checksums(models),
                )
            else:
                self._fingerprints.pop(id(wrapper), None)


def _agreed(able: bool, wrapper) -> bool:
    """True if every rank of ``wrapper``'s data-parallel group is ``able``."""
    group = getattr(wrapper, "data_parallel_group", None)
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return able
    pairs = buffers.shard_pairs(wrapper)
    device = pairs[0][0].device if pairs else device_of(wrapper)
    flag = torch.tensor([1 if able else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _nbytes(storages) -> int:
    return sum(s.tensor.untyped_storage().nbytes() for s in storages)


def _owner(chunk):
    try:
        owner = _OWNERS.get(chunk)
    except TypeError:  # not weakly referable: not a chunk of ours
        return None
    return owner() if owner is not None else None


def owner_of(model):
    """The offloader whose optimizer was built for ``model`` (a DDP chunk or a list of them),
    or None."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    owners = {id(o): o for o in map(_owner, chunks)}
    return next(iter(owners.values())) if len(owners) == 1 and chunks else None


class _InstanceWrap:
    """``obj.name`` replaced by ``wrap(obj.name)`` on the instance until ``remove()``."""

    def __init__(self, obj, name: str, wrap) -> None:
        self._obj, self._name = obj, name
        self._had = name in vars(obj)
        self._previous = vars(obj).get(name)
        setattr(obj, name, wrap(getattr(obj, name)))

    def remove(self) -> None:
        if self._had:
            setattr(self._obj, self._name, self._previous)
        else:
            vars(self._obj).pop(self._name, None)
