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
checked at each sleep, never assumed, and costs the steps nothing: each parameter shard is
compared bit for bit with its master cast, on the device while the masters have device memory,
else on the host against the masters' host copies (the shards copied out for it: a host
synchronization at the sleep, none on the step's path). Where the check fails on any rank of
the data-parallel group, every rank copies that optimizer's parameters instead, with a warning
saying why.

All or nothing: sleep allocates (the host copies of the parameters it cannot rebuild) before
it gives anything up; wake regrows everything before it copies, casts or gathers, gives back
what it regrew when any allocation fails, and agrees with the other ranks of each rebuilding
optimizer's data-parallel group before the all-gather, so that one rank's out-of-memory is
every rank's ``DeviceMemoryError`` and nobody waits in a collective. The same call works again
once the memory is free.

With a disk tier, ``sleep(to="disk")`` then lays the host copies of the states and masters
out again in the tier's file and gives the host arena and staging back, and puts the copies of
the parameters in files of the tier whatever the budget holds; wake lays the states and masters
out where the budget places them before anything else (every rank together, each move all or
nothing: docs/disk-tier.md).

Under Megatron-FSDP the parameters are its model weight buffers and the gradients its main
gradient buffers; the unsharded parameters it gathered after the step are given back through
its own all-gather pipeline and gathered again on wake (``model_buffers.release_gathered``).

Under CUDA graphs (the model's ``cuda_graph_impl`` or ``enable_cuda_graph``) the graphs replay
the addresses of the parameter and gradient buffers they captured: sleep keeps those buffers
where they are, with their bytes, and moves only the optimizer states and masters (a warning
says so once).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch

from .. import rules
from ..adapters import MASTER_WEIGHTS, OPTIMIZER_STATES
from ..adapters import model_buffers as buffers
from ..adapters.megatron_wrappers import device_of
from ..device import device_for
from ..engine.model_memory import ModelMemory
from ..errors import (
    DeviceMemoryError,
    HostMemoryError,
    NodeMemoryError,
    OffloadStateError,
    out_of_memory,
)
from ..phase import Phase
from . import node_memory
from .members import is_stub, megatron_optimizers

# Each DDP chunk a distributed optimizer was built for -> the offloader serving that optimizer
# (frameworks whose model moves are given the model only find it here).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Sleep:
    """The sleep and wake of one offloader's optimizer and model chunks."""

    def __init__(self, offloader) -> None:
        self._offloader = offloader
        self._chunks: list = []
        self._rebuilders: list = []
        self._taken: list[tuple[str, ...]] = []
        self._hooks: list = []
        self._graphs_said = False
        #: True while the parameters (and the states and masters) are asleep.
        self.asleep = False
        #: True while the gradient buffers are given up (with the parameters, or alone).
        self.gradients_dropped = False
        #: True after ``sleep(to="disk")`` until wake moved the host copies back.
        self.on_disk = False
        self.sleeps = 0
        self._params: ModelMemory | None = None
        self._grads: ModelMemory | None = None
        self._pools: ModelMemory | None = None  # Megatron-FSDP's double-buffer pools
        self._figures = dict.fromkeys(
            (
                "rebuilt_parameter_bytes",
                "copied_parameter_bytes",
                "dropped_gradient_bytes",
                "released_gathered_bytes",
            ),
            0,
        )

    @property
    def sleeping(self) -> bool:
        return self.asleep or self.gradients_dropped

    def register(self) -> None:
        """Make the offloader findable from its optimizer's model chunks (``owner_of``)."""
        chunks = [
            chunk
            for chunk in buffers.chunks_of(megatron_optimizers(self._offloader.optimizer))
            if hasattr(chunk, "buffers") or buffers.is_megatron_fsdp_chunk(chunk)
        ]
        # All or nothing; a weak reference: the model must not keep a dropped offloader alive
        # (its finalizers give its host memory back).
        _OWNERS.update(dict.fromkeys(chunks, weakref.ref(self._offloader)))

    # -------------------------------------------------------------------- the moves
    def sleep(
        self, model=None, *, parameters: bool = True, gradients: bool = True, to: str = "host"
    ) -> None:
        offloader = self._offloader
        if to not in ("host", "disk"):
            raise ValueError(f'sleep(to={to!r}): to is "host" or "disk".')
        if to == "disk":
            if not parameters:
                raise ValueError(
                    'sleep(to="disk") moves the optimizer states and master weights, which '
                    "leave with the parameters: call it with parameters=True."
                )
            if any(engine.budget.disk is None for engine in offloader.engines):
                raise OffloadStateError(
                    'sleep(to="disk") needs a disk tier: attach with offload_disk_dir '
                    "(--offload-disk-dir) and a host_memory_budget."
                )
        if to == "disk" and self.asleep:
            self._place_on_disk(True)  # asleep already: the host copies move on to disk
            return
        parameters = parameters and not self.asleep
        gradients = gradients and not self.gradients_dropped
        if not (parameters or gradients):
            return  # idempotent
        if offloader.phase.current is not Phase.IDLE:
            raise OffloadStateError(
                f"sleep() inside {offloader.phase.current.value}: call it between steps."
            )
        found = megatron_optimizers(offloader.optimizer)
        for wrapper in found:
            why = buffers.fsdp_sleep_refusal(wrapper)
            if why is not None:
                rules.refuse_under_megatron_fsdp(
                    "sleep() here",
                    f"{why}. Use offloaded() around the rollout to move the optimizer states "
                    "and master weights only.",
                )
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
        graphs = buffers.graph_capture(chunks)
        if graphs is not None and not self._graphs_said:
            warnings.warn(
                f"sleep(): the model's CUDA graphs ({graphs}) replay the addresses of the "
                "parameter and gradient buffers they captured, so those stay on the device "
                "with their bytes; only the optimizer states and master weights leave.",
                stacklevel=3,
            )
            self._graphs_said = True
        rebuilders = self._rebuilders_among(found) if parameters and graphs is None else []
        storages = buffers.storages(chunks, rebuilders) if graphs is None else []
        grads = [s for s in storages if s.kind == buffers.GRADIENTS] if gradients else []
        params = [s for s in storages if s.kind == buffers.PARAMETERS] if parameters else []
        device = offloader.engines[0].device if offloader.engines else None
        budget = offloader.engines[0].budget if offloader.engines else None
        entries = [(s.tensor, s.rebuilder is None, False) for s in params]
        if parameters:
            # Every rank of the node together (collective: every rank sleeps), before any
            # allocates: what the copies add to what the node already holds.
            held = self._params.host_bytes if self._params is not None else 0
            # to="disk": the copies are files of the disk tier, not host memory.
            need = 0 if to == "disk" else max(0, ModelMemory.host_need(entries) - held)
            try:
                node_memory.agree(need, pins=False, budget=None)
            except NodeMemoryError as error:
                raise NodeMemoryError(
                    f"sleep() copies the parameters it cannot rebuild to the host: {error}"
                ) from None
        failure = None
        if params:
            self._params = self._params or ModelMemory(
                device or device_for(params[0].tensor.device), budget=budget, name="wake()"
            )
            # All or nothing: the only allocation of a sleep comes before anything is given up.
            try:
                self._params.prepare(entries, to_disk=to == "disk")
            except BaseException as error:
                operation = "sleep() (host copies of the parameters it cannot rebuild)"
                failure = out_of_memory(error, self._params.device, operation, need)
        if parameters and not node_memory.every_rank(failure is None):
            # A rank that could not get its copies makes every rank give up nothing: sleep is
            # collective (the node check above), and a rank asleep alone would wait there at
            # the next one. The others keep what they prepared (counted) for the next sleep.
            failure = failure or HostMemoryError("sleep() on another rank", needed=0)
        if failure is not None:
            raise failure
        self._chunks = chunks
        if grads:
            self._grads = self._grads or ModelMemory(
                device or device_for(grads[0].tensor.device), name="wake()"
            )
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
            member.engine.copies.fingerprint.release_master_grads()
        copied = [s for s in params if s.rebuilder is None]
        self._figures["copied_parameter_bytes"] = _nbytes(copied)
        self._figures["rebuilt_parameter_bytes"] = _nbytes(params) - _nbytes(copied)
        # Megatron-FSDP's gathered parameters first: a gather in flight reads the buffers.
        # Under CUDA graphs they stay, with the buffers the graphs captured.
        gathered = buffers.release_gathered(chunks) if graphs is None else 0
        pools = buffers.fsdp_pools(chunks) if graphs is None else []
        if pools:
            # Idle now (every bucket released): given up without a copy, regrown on wake.
            self._pools = self._pools or ModelMemory(
                device or device_for(pools[0].device), name="wake()"
            )
            self._pools.release([(tensor, False, False) for tensor in pools])
            gathered += self._pools.dropped_bytes
        self._figures["released_gathered_bytes"] = gathered
        if params:
            self._params.release(entries)
        self._rebuilders = rebuilders
        self._watch_forward()
        self.asleep = True
        self.sleeps += 1
        if to == "disk":
            self._place_on_disk(True)

    def _place_on_disk(self, on_disk: bool) -> None:
        """Every engine's host copies into the disk tier's file (``on_disk``: the arenas given
        back) or back where the budget places them, on every rank together (collective, as
        sleep and wake are): a rank that cannot makes every rank raise, each engine left
        where it was or where it went (asleep either way: wake brings everything back)."""
        # Set on every rank before trying, cleared only once every rank moved back: wake
        # (again) moves back whatever went, on any rank.
        self.on_disk = self.on_disk or on_disk
        failure = None
        try:
            for engine in self._offloader.engines:
                engine.place_on_disk(on_disk)
        except BaseException as error:
            failure = error
        if not node_memory.every_rank(failure is None):
            where = "into the disk tier" if on_disk else "back into host memory"
            raise failure or OffloadStateError(
                f"moving the host copies of the optimizer states and master weights {where} "
                "failed on another rank; this rank's moved. Every rank is asleep: wake() (or "
                "the next forward) brings everything back."
            )
        self.on_disk = on_disk

    def wake(self, *, parameters: bool = True, gradients: bool = True) -> None:
        gradients = gradients and self.gradients_dropped
        parameters = parameters and self.asleep
        if not (parameters or gradients):
            return
        if parameters and self.on_disk:
            # The arenas again first, every rank together: refused, nothing else was touched.
            self._place_on_disk(False)
        # Every allocation first, all or nothing; then the copies, the cast, the all-gather.
        undo = []
        try:
            if gradients and self._grads is not None:
                self._grads.regrow()  # zeroed, as before a backward
                undo.append(self._grads.unregrow)
            if parameters:
                borrowed = self._regrow_parameters(undo)
            failure = None
        except BaseException as error:  # an out-of-memory above all; undone below either way
            failure = error
        if parameters and self._rebuilders:
            # The all-gather below is collective: a rank that could not get its memory must
            # not leave the others waiting in it.
            agreed = all(_agreed(failure is None, w) for w in self._rebuilders)
            if failure is None and not agreed:
                failure = DeviceMemoryError(
                    "wake() on another rank of the data-parallel group", needed=0, free=None
                )
        if failure is not None:
            for step in reversed(undo):
                step()
            raise failure
        if gradients:
            self.gradients_dropped = False
        if parameters:
            self._finish_parameters(borrowed)
        if not (self.asleep or self.gradients_dropped):
            for handle in self._hooks:
                handle.remove()
            self._hooks = []

    def _regrow_parameters(self, undo: list) -> list:
        """Regrow the parameters and reload what sleep took (and the masters a rebuild casts
        from), each step undone by ``undo`` if a later one fails; returns the engines whose
        masters were borrowed for the cast."""
        offloader = self._offloader
        for memory in (self._params, self._pools):
            if memory is not None:
                memory.regrow()  # the copied ones get their bytes back
                undo.append(memory.unregrow)
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
                    undo.append(functools.partial(_give_back, offloader, engine, kinds))
            for engine in borrowed:
                engine.reload((MASTER_WEIGHTS,))
                undo.append(functools.partial(_give_back, offloader, engine, (MASTER_WEIGHTS,)))
        return borrowed

    def _finish_parameters(self, borrowed: list) -> None:
        offloader = self._offloader
        with offloader.phase.within(Phase.MOVING):
            for engine in offloader.engines:
                engine.wait()  # ordered before the current stream, which casts and steps
            if self._rebuilders:
                buffers.rebuild(self._rebuilders, self._chunks)  # the chunks gather too
            else:
                buffers.gather_again(self._chunks)
            for engine in borrowed:
                # The cast only read them: released again without a copy (rule 6).
                engine.offload((MASTER_WEIGHTS,), skip_unchanged=True, release=True)
        self.asleep = False

    @contextlib.contextmanager
    def block(self, model=None, to: str = "host"):
        was = self.asleep, self.gradients_dropped
        self._offloader.sleep(model, to=to)
        try:
            yield self._offloader
        finally:
            self.wake(parameters=not was[0], gradients=not was[1])

    # ------------------------------------------------------------------ figures
    def figures(self) -> dict:
        """What the last sleep did with the model, for ``stats()``."""
        held = [m for m in (self._params, self._grads) if m is not None]
        return {
            "asleep": self.asleep,
            "sleeps": self.sleeps,
            **self._figures,
            "sleep_host_bytes": sum(m.host_bytes for m in held),
            "sleep_disk_bytes": sum(m.disk_bytes for m in held),
        }

    def close(self) -> None:
        self.wake()
        for chunk, owner in list(_OWNERS.items()):
            if owner() is self._offloader:
                del _OWNERS[chunk]
        for memory in (self._params, self._grads, self._pools):
            if memory is not None:
                memory.close()
        self._params = self._grads = self._pools = None

    # ------------------------------------------------------------------ internals
    def _watch_forward(self) -> None:
        """What touches the model wakes it first: a forward (the parameters, and the
        gradients unless none will be made: inference), ``zero_grad_buffer()``, which
        megatron-core's training step calls before the forward, and the optimizer's step
        (everything). Installed while asleep only: awake, they cost nothing."""
        if self._hooks:
            return
        installed = self._offloader.interceptions
        why = "the model is asleep: what touches it wakes it first"
        for chunk in self._chunks:
            self._hooks.append(
                installed.hook(
                    chunk.register_forward_pre_hook(self._wake_hook),
                    where=f"{type(chunk).__name__} (forward pre-hook)",
                    why=why,
                )
            )
            self._hooks.append(installed.wrap(chunk, "zero_grad_buffer", self._waking, why=why))
        self._hooks.append(installed.wrap(self._offloader.optimizer, "step", self._waking, why=why))

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
        rebuilders = []
        for wrapper in found:
            if is_stub(wrapper):
                continue
            why = buffers.rebuild_refusal(wrapper)
            if why is not None and not buffers.is_distributed(wrapper):
                continue  # nothing to agree on: its parameters are copied on every rank
            if why is None:
                why = self._inexact(wrapper)
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

    def _inexact(self, wrapper) -> str | None:
        """Why a rebuild of ``wrapper``'s parameters would not be exact, or None: each shard
        compared with its master cast, where the masters are (their host copies, inside a
        host view, where the step cycle released them)."""
        with self._offloader.access.host_view(writes=False):
            equal = buffers.matches_masters(wrapper)
        if equal:
            return None
        return (
            "its parameters changed since the last step (a weight load that did not go through "
            "the optimizer?); after such a load, optimizer.reload_model_params() makes them the "
            "masters again"
        )


def _give_back(offloader, engine, kinds) -> None:
    """Undo a wake's reload of ``kinds``: released again without a copy (rule 6)."""
    with offloader.phase.within(Phase.MOVING):
        engine.offload(kinds, skip_unchanged=True, release=True)


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
