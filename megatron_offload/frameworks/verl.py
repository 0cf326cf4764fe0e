"""verl: its Megatron optimizer moves delegate to the attached offloader.

verl's ``verl/utils/megatron_utils.py`` moves the optimizer with
``offload_megatron_optimizer(optimizer)`` when its Megatron engine leaves train mode (and after
it is built) and ``load_megatron_optimizer(optimizer)`` when it enters train mode: the fp32
masters (``p.data = p.data.to(...)``) and ``exp_avg`` / ``exp_avg_sq`` one ``.to()`` each, then
``empty_cache()``. The states are on the device for the whole train phase, and momentum
buffers, other optimizers' states and the masters' gradients are not moved. With an
offloader attached, ``install()`` makes both delegate (``phases.to_host`` /
``phases.to_device``): everything the offloader tracks leaves the device, and in train mode
the states come back only around each step. The model moves
``offload_megatron_model_to_cpu(models)`` / ``load_megatron_model_to_gpu(models, load_grad)``
(verl copies the parameter buffers out and back and drops the gradient buffers) become
``sleep()`` / ``wake()`` for the model the attached optimizer was built for: the parameters
are made again from the masters instead of copied.

    from megatron_offload.frameworks import verl
    verl.install()   # once per worker process, after importing verl

Modules of verl that imported the functions by name get the delegating ones too.
"""

from __future__ import annotations

import functools
import importlib
import sys

from ..interceptions import PROCESS
from ..megatron.training import find_offloader
from ..offloader.sleep import owner_of
from .phases import model_to_device, model_to_host, to_device, to_host

MODULE = "verl.utils.megatron_utils"


def _model_to_host(offloader, models, *args, **kwargs) -> None:
    model_to_host(offloader, models)


def _model_to_device(offloader, models, load_grad=True, load_frozen_params=True) -> None:
    # Frozen parameters come back with the others (load_frozen_params=False is verl's
    # adapter-only refit, which reads only the trainable ones: they are back too).
    model_to_device(offloader, gradients=load_grad)


# verl's function -> (how the offloader is found from its first argument, what it becomes)
NAMES = {
    "offload_megatron_optimizer": (find_offloader, to_host),
    "load_megatron_optimizer": (find_offloader, to_device),
    "offload_megatron_model_to_cpu": (owner_of, _model_to_host),
    "load_megatron_model_to_gpu": (owner_of, _model_to_device),
}
# The model moves are delegated where the module has them.
OPTIONAL = ("offload_megatron_model_to_cpu", "load_megatron_model_to_gpu")
# id(delegating function) -> (delegating function, its replacements, the module installed)
_installed: dict = {}


def install(module=None) -> None:
    """Make ``module``'s (``verl.utils.megatron_utils`` by default) optimizer moves delegate
    to the offloader attached to the optimizer they are given, in that module and in every
    loaded ``verl`` module that imported them; idempotent."""
    module = module if module is not None else _module()
    replaced = {}  # id(verl's own) -> delegating function
    for name, (finder, phase) in NAMES.items():
        own = getattr(module, name, None)
        if own is None and name in OPTIONAL:
            continue
        if own is None:
            raise TypeError(f"{module.__name__} has no {name}: not verl's megatron_utils.")
        if id(own) not in _installed:  # not installed already
            replaced[id(own)] = _delegating(own, finder, phase)
    handles = {id(delegating): [] for delegating in replaced.values()}
    for target in _modules(module):
        for attribute, value in list(vars(target).items()):
            if id(value) in replaced and replaced[id(value)].__wrapped__ is value:
                delegating = replaced[id(value)]
                why = "verl's optimizer and model moves delegate to the attached offloader"
                handles[id(delegating)].append(
                    PROCESS.replace(target, attribute, delegating, why=why, only_if_ours=True)
                )
    for delegating in replaced.values():
        _installed[id(delegating)] = (delegating, handles[id(delegating)], module.__name__)


def uninstall(module=None) -> None:
    """Give verl its own functions back, wherever ``install`` replaced them."""
    module = module if module is not None else _module()
    for key, (_, handles, name) in list(_installed.items()):
        if name == module.__name__:
            for handle in handles:
                handle.remove()
            del _installed[key]


def _delegating(own, finder, phase):
    @functools.wraps(own)
    def move(target, *args, **kwargs):
        offloader = finder(target)  # the optimizer's, or the model's (a reference model: none)
        if offloader is None:
            return own(target, *args, **kwargs)
        return phase(offloader, target, *args, **kwargs)

    return move


def _modules(module):
    """``module`` and every loaded module of its top-level package."""
    root = module.__name__.split(".")[0]
    found = [module]
    for name, loaded in list(sys.modules.items()):
        if (
            loaded is not None
            and loaded is not module
            and (name == root or name.startswith(root + "."))
        ):
            found.append(loaded)
    return found


def _module():
    try:
        return importlib.import_module(MODULE)
    except ImportError as error:
        raise ImportError(
            f"megatron_offload.frameworks.verl.install() needs verl's {MODULE} ({error}); "
            "pass the module as install(module) if it lives elsewhere."
        ) from error
