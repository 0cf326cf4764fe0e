"""``attach``: the automatic per-step offload cycle for a plain training loop.

After ``attach(optimizer)`` the loop needs no further call:

* ``optimizer.step()`` starts the reload of the offloaded states (asynchronous, so the
  copy overlaps the gradient preparation, norm and clipping that come first);
* the inner optimizer's step pre-hook orders that reload before the update (and reloads
  synchronously if nothing did), and marks the host copies stale;
* after ``optimizer.step()`` returns (so the master weights have been copied into the
  model parameters) the states are copied out and their device memory freed. If the step
  was skipped (inf/nan, grad-norm threshold) the host copies are still valid and nothing
  is copied.

Megatron optimizers have no step hooks of their own, so ``step`` is wrapped on the
instance (``detach`` restores it); the inner torch optimizer gets ordinary
``register_step_pre_hook`` hooks.

The reload may start earlier than the step, so that it overlaps more: from the gradient
reduction (``prefetch="gradients"``, the default: the model config's
``finalize_model_grads_func`` is wrapped, ``prefetching_finalize``) or from a point of the
backward pass (``prefetch=<fraction>``).
"""

from __future__ import annotations

import functools
import gc
import warnings

import torch

from ..adapters import MASTER_WEIGHTS, megatron_fsdp
from ..adapters import megatron_wrappers as wrappers
from ..adapters.model_buffers import chunks_of, graph_capture
from ..chunked.update import ChunkedUpdate
from ..config import OffloadConfig
from ..errors import DiskTierError, OffloadArgumentError
from ..phase import Phase
from . import allocator_warnings
from .members import is_stub, megatron_optimizers
from .offloader import OptimizerStateOffloader

#: Set on the functions of Megatron's that this package wrapped (the value says which wrapper).
WRAPPER_MARK = "__megatron_offload_wrapper__"


def attach(optimizer, config: OffloadConfig | None = None, **options) -> OptimizerStateOffloader:
    """Offload ``optimizer``'s states between steps; returns the offloader (the handle).

    ``optimizer`` is what ``get_megatron_optimizer`` returned (a ChainedOptimizer or a
    DistributedOptimizer): the object whose ``step()`` the training loop calls. Options are
    the fields of ``OffloadConfig``. Call it between steps: states that exist already (a
    checkpoint loaded before attaching) go to the host at once.

    All or nothing: every refusal comes before anything is touched, and if any later step
    fails (host memory, pinning, a chunked plan) the optimizer is left exactly as it was,
    so that an ``attach`` with corrected options works.
    """
    config = OffloadConfig.from_options(config, **options)
    _refuse_chain_member(optimizer)
    _refuse_backward_prefetch_under_cuda_graphs(optimizer, config)
    trigger = None
    if config.prefetch not in ("step", "gradients"):
        served = [wrapper for wrapper in megatron_optimizers(optimizer) if not is_stub(wrapper)]
        trigger = _prefetch_trigger(served, float(config.prefetch))
    offloader = OptimizerStateOffloader(optimizer, config)
    try:
        offloader.run_by(AutomaticCycle(offloader, trigger))
        allocator_warnings.warn_where_frees_wait(offloader)
    except BaseException:
        offloader.detach()  # leave the optimizer as it was: a later attach must work
        raise
    _warn_if_nothing_selected(offloader)
    _say_pooled_masters_stay(offloader)
    return offloader


def _say_pooled_masters_stay(offloader: OptimizerStateOffloader) -> None:
    """Under ``--use-nccl-ub`` the masters stay on the device: said once, with the bytes."""
    kept = sum(
        megatron_fsdp.pooled_master_bytes(m.optimizer)
        for m in offloader.members
        if MASTER_WEIGHTS in m.kinds
    )
    if kept:
        warnings.warn(
            f"megatron_offload.attach: the master weights ({kept:,} bytes on this rank) stay on "
            "the device under --use-nccl-ub: Megatron-FSDP's main weight buffers come from the "
            "memory pool registered with NCCL, to which freeing them would return the memory "
            "(not to the forward pass), and a regrown buffer would leave NCCL's registration. "
            "The optimizer states are offloaded.",
            UserWarning,
            stacklevel=3,
        )


def _refuse_chain_member(optimizer) -> None:
    """Attaching to one optimizer of a ChainedOptimizer while the loop steps the chain would
    offload nothing: the chain's step calls its members' ``step_with_ready_grads``, never
    their ``step``. Refused, naming the object to attach to."""
    from megatron.core.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return  # what get_megatron_optimizer returns (0.17+): no scan needed
    chain = _chain_holding(optimizer)
    if chain is None:
        return
    index = next(i for i, member in enumerate(chain.chained_optimizers) if member is optimizer)
    raise OffloadArgumentError(
        f"attach() got chained_optimizers[{index}] ({type(optimizer).__name__}) of a "
        f"{type(chain).__name__}. The training loop steps the ChainedOptimizer, whose step() "
        "does not call its members' step(), so nothing would be offloaded. Attach to the "
        "ChainedOptimizer (what get_megatron_optimizer returned): "
        "megatron_offload.attach(optimizer); per_optimizer selects what each member offloads, "
        f"by index ({index} for this one)."
    )


def _chain_holding(optimizer):
    """The ChainedOptimizer whose ``chained_optimizers`` holds ``optimizer``, or None.

    megatron-core's members keep no reference to their chain, so the chain is found among
    the referrers of the lists holding the optimizer (two scans of the garbage collector's
    objects, once per attach)."""
    from megatron.core.optimizer import ChainedOptimizer

    lists = [r for r in gc.get_referrers(optimizer) if type(r) is list]
    if not lists:
        return None
    for owner in gc.get_referrers(*lists):
        if isinstance(owner, ChainedOptimizer) and any(
            owner.chained_optimizers is r for r in lists
        ):
            return owner
        if type(owner) is dict and any(owner.get("chained_optimizers") is r for r in lists):
            for chain in gc.get_referrers(owner):  # an instance dict outside its object
                if isinstance(chain, ChainedOptimizer) and vars(chain) is owner:
                    return chain
    return None


def _warn_if_nothing_selected(offloader: OptimizerStateOffloader) -> None:
    """An attach that will move nothing says so once (it costs a wrapper per step)."""
    kinds = [kind for engine_kinds in offloader.configured_kinds for kind in engine_kinds]
    if not offloader.engines:
        why = "no optimizer of it has parameters on this rank"
    elif not kinds:
        why = "offload_optimizer_states and offload_master_weights are off for every optimizer"
    elif offloader.config.offload_fraction == 0:
        why = "offload_fraction=0 keeps every tensor on the device"
    else:
        return
    warnings.warn(
        f"megatron_offload.attach: nothing will be offloaded ({why}). Turn a selection on, or "
        "do not attach.",
        UserWarning,
        stacklevel=3,
    )


def prefetching_finalize(finalize_model_grads_func, offloader):
    """``finalize_model_grads_func`` that first starts reloading the offloaded states.

    The reload is asynchronous on accelerators, so the copy overlaps the gradient reduction
    ``finalize_model_grads`` waits for; the optimizer step orders itself after it.
    """
    if getattr(finalize_model_grads_func, WRAPPER_MARK, None) == "prefetch":
        return finalize_model_grads_func

    @functools.wraps(finalize_model_grads_func)
    def finalize_model_grads(*args, **kwargs):
        if not offloader.detached:
            offloader.prefetch()  # nothing to do when nothing is offloaded
        return finalize_model_grads_func(*args, **kwargs)

    setattr(finalize_model_grads, WRAPPER_MARK, "prefetch")
    finalize_model_grads.__wrapped_finalize__ = finalize_model_grads_func
    return finalize_model_grads


class AutomaticCycle:
    """The hooks of one attached offloader; ``remove`` undoes all of them."""

    def __init__(self, offloader: OptimizerStateOffloader, prefetch_trigger=None) -> None:
        self._offloader = offloader
        self._handles = []
        self._chunked = []
        #: Steps run through the cycle (skipped ones included).
        self.cycles = 0
        try:
            self._install(prefetch_trigger)
        except BaseException:
            self.remove()  # all or nothing: what was installed so far is undone
            raise

    def _install(self, prefetch_trigger) -> None:
        offloader = self._offloader
        config = offloader.config
        members = offloader.members
        if config.chunked_update_bytes is not None:
            for member in members:
                chunked = ChunkedUpdate(
                    member.engine,
                    member.optimizer,
                    total_bytes=config.chunked_update_bytes,
                    slots=config.chunked_update_slots,
                    kinds=member.kinds,
                    phase=offloader.phase,
                    undo=config.chunked_update_undo,
                )
                self._chunked.append(chunked)
                self._handles.append(chunked)
                chunked.install(offloader.interceptions)
        if any(_holds_something(m) for m in members):
            # What exists at attach goes to the host now: attach is between steps. The masters
            # exist from the optimizer's construction (the DistributedOptimizer's fp32 shards,
            # Megatron-FSDP's main weight buffers), so without this a fresh run's first forward
            # and backward would hold them on the device, the only iteration that does. A
            # resumed run loads its checkpoint before attaching (megatron.training's setup
            # does), and its first iteration would otherwise hold every state too, the peak of
            # a run without offloading; Transformer Engine's precision-aware path creates the
            # states with the optimizer. The first update brings them back (the chunked one
            # streams the states).
            offloader.offload()
        installed = offloader.interceptions
        if prefetch_trigger is not None:
            self._handles.append(_backward_prefetch_hook(offloader, prefetch_trigger))
        if config.prefetch == "gradients":
            for model_config in model_configs(members):
                if getattr(model_config, "finalize_model_grads_func", None) is None:
                    continue
                handle = prefetch_at_gradient_reduction(model_config, offloader)
                if handle is not None:
                    self._handles.append(handle)

        def make(previous):
            self._previous_step = previous

            def step(*args, **kwargs):
                return self._step(*args, **kwargs)

            return step

        self._handles.append(
            installed.wrap(
                offloader.optimizer,
                "step",
                make,
                why="the step cycle: reload before the update, offload after it",
            )
        )

    def _step(self, *args, **kwargs):
        """One iteration's optimizer step: reload, update, offload."""
        offloader = self._offloader
        # The step reads the optimizer's state mapping itself, at full speed, and a chunked
        # update reads it while its states are still on the host: STEPPING is not guarded.
        # Entering it ends reads served since the last step (their writes are in the host
        # copy). The update orders itself after the copy-back (pre-hook).
        token = offloader.phase.enter(Phase.STEPPING)
        finished = False
        try:
            # Start the copy-back now (nothing to do if a hook already did): it overlaps the
            # gradient copy, unscale, norm and clipping the step does before the update,
            # which waits for it (pre-hook). States a chunked update streams stay on the host.
            offloader.prefetch()
            for chunked in self._chunked:
                chunked.stream.clear_figures()
            result = self._previous_step(*args, **kwargs)
            finished = True
        finally:
            # A step that raised (an out-of-memory in the update, an interrupt) leaves the
            # states where a finished step does: off the device, what it wrote copied out.
            # Rule 6: a skipped step left the states as they were copied last time.
            offloader.phase.leave(token)
            try:
                offloader.offload_after_step()
            except (torch.OutOfMemoryError, MemoryError, DiskTierError) as error:
                # A new layout's host arena or scratch could not be had, or the disk tier
                # refused a write. A finished update happened: raising would invite the caller
                # to apply it twice (a failed one raises its own error below). What could not
                # be offloaded stays on the device, counted; the next offload tries again.
                step = "finished: do not repeat it" if finished else "raised (its error follows)"
                warnings.warn(
                    "the offload after the step could not get the memory it needed or write "
                    f"to the disk tier ({getattr(error, 'operation', error)}). The step itself {step}. What "
                    "could not be offloaded stays on the device (stats()['resident_bytes']) "
                    "until the next offload, which tries again.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self.cycles += 1
        return result

    @property
    def chunked_updates(self) -> list:
        """The chunked update of each served optimizer, in order (empty without one)."""
        return list(self._chunked)

    def extra_host_bytes(self) -> list[int]:
        """Host bytes each engine's chunked update holds beyond the engine (its undo journal)."""
        if not self._chunked:
            return [0] * len(self._offloader.members)
        return [chunked.extra_host_bytes for chunked in self._chunked]

    def remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []


def _holds_something(member) -> bool:
    """Whether ``member``'s optimizer holds, now, tensors its offloader moves: states, or the
    master weights where they are selected."""
    optimizer = member.optimizer
    if any(True for _ in wrappers.in_state(optimizer)):
        return True
    return MASTER_WEIGHTS in member.kinds and any(True for _ in wrappers.master_weights(optimizer))


def _refuse_backward_prefetch_under_cuda_graphs(optimizer, config: OffloadConfig) -> None:
    """``prefetch`` as a fraction of the backward pass hooks a parameter's gradient
    accumulator, which a replayed CUDA graph of the layers never calls: the reload would
    silently move to the step. Refused before anything is touched."""
    if config.prefetch in ("step", "gradients"):
        return
    graphs = graph_capture(chunks_of(megatron_optimizers(optimizer)))
    if graphs is not None:
        raise OffloadArgumentError(
            f"prefetch={config.prefetch!r} starts the reload from a hook on the backward pass, "
            f"which the model's CUDA graphs ({graphs}) replay without calling: use "
            'prefetch="gradients" (the default) or "step" with CUDA-graphed layers.'
        )


def _prefetch_trigger(served, fraction: float):
    """The parameter whose gradient starts the reload once the backward pass has produced
    ``fraction`` of the gradients (a ValueError, before anything is touched, without one).

    Autograd computes gradients roughly in the reverse of the order parameters were
    registered (the last layer first), so the trigger is the parameter at which the bytes
    counted from the end reach ``fraction``.
    """
    params = [p for chunk in chunks_of(served) for p in chunk.parameters() if p.requires_grad]
    if not params:
        raise OffloadArgumentError(
            "prefetch as a fraction of the backward pass needs the model: this optimizer has no "
            'model_chunks with trainable parameters. Use prefetch="step".'
        )
    total = sum(p.numel() for p in params)
    seen = 0
    for trigger in reversed(params):
        seen += trigger.numel()
        if seen >= fraction * total:
            break
    return trigger


def _backward_prefetch_hook(offloader, trigger):
    """Start the reload when ``trigger``'s gradient is computed: the hook sits on its
    gradient accumulator, as megatron-core's DDP hooks do; it fires at every backward
    (every micro-batch), and the reload does nothing when the states are already back."""

    def start_reload(*_):
        if not offloader.detached:
            offloader.prefetch()  # nothing to do when the states are back

    # The accumulator node is reached through a view of the parameter; keep it alive (it is
    # the node autograd uses for this parameter for the life of the model).
    accumulator = trigger.expand_as(trigger).grad_fn.next_functions[0][0]
    return offloader.interceptions.hook(
        accumulator.register_hook(start_reload),
        where="a parameter's gradient accumulator (autograd hook)",
        why="the reload starts once this much of the backward pass is done (prefetch=F)",
        keep=accumulator,
    )


def model_configs(members) -> list:
    """The model configs (``TransformerConfig``) of the served optimizers' model chunks, each
    once: what the training loop's schedule reads ``finalize_model_grads_func`` from."""
    found = []
    for chunk in chunks_of(member.optimizer for member in members):
        module = chunk
        while module is not None:  # DDP and other wrappers keep the model as .module
            config = getattr(module, "config", None)
            if config is not None:
                if all(config is not c for c in found):
                    found.append(config)
                break
            module = getattr(module, "module", None)
    return found


def prefetch_at_gradient_reduction(model_config, offloader, default=None, *, only_if_ours=True):
    """Start the reload when the loop reduces the gradients (``prefetch="gradients"``): the
    model config's ``finalize_model_grads_func`` (``default`` where it has none: the one
    megatron.training's ``train()`` installs) becomes ``prefetching_finalize`` of it, through
    the offloader's interceptions; removing the handle puts back what the config had (if
    nobody replaced it since, unless ``only_if_ours`` is False: megatron.training's ``train()``
    assigns its own). The one place the finalize function is wrapped."""
    if getattr(model_config, "cuda_graph_impl", "none") == "full_iteration":
        # The whole forward and backward, the gradient finalize included, is one captured
        # graph: a reload started there would be recorded into it (and its memory taken from
        # the graph's pool). The step starts it instead; nothing is installed (None).
        warnings.warn(
            'prefetch="gradients": under cuda_graph_impl="full_iteration" the gradient '
            "finalize runs inside the captured graph, so the reload starts at step() instead.",
            stacklevel=3,
        )
        return None
    own = model_config.finalize_model_grads_func
    return offloader.interceptions.replace(
        model_config,
        "finalize_model_grads_func",
        prefetching_finalize(own if own is not None else default, offloader),
        why="the reload starts when the loop reduces the gradients (prefetch='gradients')",
        only_if_ours=only_if_ours,
    )
