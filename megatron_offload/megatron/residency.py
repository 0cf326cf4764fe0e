"""Where the optimizer states are while megatron.training saves or loads a checkpoint.

``checkpoint_residency`` is what the patched ``save_checkpoint`` / ``load_checkpoint`` (and the
source patches in ``patches/``) run the call in.
"""

from __future__ import annotations

import contextlib

from ..access.state import Policy
from ..offloader.members import find_offloader


def save_is_staged_on_return(args) -> bool:
    """Whether ``save_checkpoint`` has copied out every tensor it writes when it returns.

    True for synchronous saves and for megatron-core's own asynchronous saves (``mcore``
    strategy: the D2H staging finishes inside ``save_checkpoint``, before the background
    write). Other asynchronous writers may still hold references to the device tensors.
    """
    if not getattr(args, "async_save", False):
        return True
    return getattr(args, "async_strategy", "mcore") == "mcore"


@contextlib.contextmanager
def checkpoint_residency(optimizer, *, read_only: bool, args=None):
    """A checkpoint save (``read_only=True``) or load of ``optimizer``'s states.

    Where the offloader serves checkpoints from the host copy (``servable``: every optimizer
    but Transformer Engine's with fp16 or FP8 moments, and none under Megatron-FSDP), nothing
    is done here: the optimizer's checkpoint methods read and write the host copy, and
    nothing comes back to the device. Under Megatron-FSDP a synchronous save and a load run in
    a host view (``servable_in_view``): the save reads the host copy, the load writes it (the
    states it writes into are made on the host, ``StateAccess.loads_in_view``). Otherwise (an
    optimizer megatron-core built without a state initializer) the states are on the device
    for the block and offloaded again right after it (so the next iteration's forward and
    backward do not run with them).

    For a save the host copy stays valid. A save whose writer may keep references after it
    returns (an asynchronous save other than megatron-core's own) is left to the offloader's
    state access, which brings the states back when the save reads them and keeps
    them on the device until the next step's offload.

    After a load everything is offloaded, also what was never offloaded before: a resumed
    run loads before its first step, and the states the load made would otherwise stay on
    the device through the first iteration's forward and backward (the peak of a run
    without offloading). The first step brings them back.
    """
    offloader = find_offloader(optimizer)
    if args is None:
        args = _megatron_args_or_none()
    if offloader is None:
        yield offloader
        return
    if servable(offloader):
        # The optimizer's checkpoint methods read and write the host copy themselves
        # (access/state.py): nothing comes back to the device.
        yield offloader
    elif servable_in_view(offloader) and (
        not getattr(args, "async_save", False) if read_only else offloader.access.loads_in_view()
    ):
        # Megatron-FSDP: the whole save reads the host copy and the whole load writes it (the
        # state dict holds the optimizer's own DTensors until torch DCP is done with them).
        # An asynchronous writer could read them after the view closed: its saves take the
        # way below.
        with offloader.host_view(writes=not read_only):
            yield offloader
    elif read_only and args is not None and not save_is_staged_on_return(args):
        yield offloader
    else:
        with offloader.resident(read_only=read_only):
            yield offloader
    if not read_only and not offloader.detached and not offloader.is_offloaded:
        offloader.offload()


def servable_in_view(offloader) -> bool:
    """True if every optimizer of ``offloader`` has its checkpoints served from the host copy
    at least inside a host view (Megatron-FSDP's), and one only there."""
    policies = offloader.access.policies
    return Policy.HOST_VIEW in policies and all(
        policy in (Policy.HOST_COPY, Policy.HOST_VIEW) for policy in policies
    )


def servable(offloader) -> bool:
    """True if every optimizer of ``offloader`` has its checkpoints served from the host copy
    (its policy, decided at attach)."""
    return all(policy is Policy.HOST_COPY for policy in offloader.access.policies)


def _megatron_args_or_none():
    try:
        from megatron.training.global_vars import _GLOBAL_ARGS
    except ImportError:
        return None
    return _GLOBAL_ARGS
