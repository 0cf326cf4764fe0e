"""Megatron-FSDP's model side: its module's state dict holds the fp32 master weights.

The module swaps its parameters for the optimizer's DTensors (views into the master buffers)
before a state dict is read or loaded (``_replace_param_with_distributed_if_needed``), so a
save reads the masters and a load writes them, between steps, while they are offloaded. The
hooks here bring the states and masters back first; a load's values are copied out at the next
offload. They are the state-access guard's (``guard.py``), installed and removed with it.
"""

from __future__ import annotations

import functools

from ..adapters import megatron_fsdp
from ..adapters.model_buffers import chunks_of
from ..phase import Phase


def install(offloader, wrappers, installed) -> list:
    """Hook the Megatron-FSDP modules of ``wrappers`` (none for other optimizers) through
    ``installed`` (the offloader's ``Interceptions``); returns the interceptions made."""
    made = []
    for wrapper in wrappers:
        if not megatron_fsdp.is_megatron_fsdp(wrapper):
            continue
        for chunk in chunks_of([wrapper]):
            module = getattr(chunk, "module", chunk)
            hooks = (
                ("state_dict", module.register_state_dict_pre_hook, False, "they come back"),
                (
                    "load_state_dict",
                    module.register_load_state_dict_pre_hook,
                    True,
                    "they come back, and what the load writes is copied out at the next offload",
                ),
            )
            for method, register, writes, why in hooks:
                made.append(
                    installed.hook(
                        register(functools.partial(_access, offloader, writes)),
                        where=f"{type(module).__name__}.{method} (pre-hook)",
                        why=f"its state dict holds the master weights: {why}",
                    )
                )
    return made


def _access(offloader, writes: bool, *args, **kwargs) -> None:
    """The module's state dict is read (or loaded, ``writes``) between steps."""
    if offloader.phase.current is Phase.IDLE and offloader.is_offloaded:
        offloader.make_resident(changes=writes)
