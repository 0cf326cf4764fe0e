"""Which public methods of megatron-core's optimizers touch the optimizer states or the master
weights, found in the installed megatron-core's own source.

A method touches them when its body names one of ``CONTAINERS`` (the state mapping, the
parameter groups, the master lists), or calls, through ``self``, a method of the class that
does (to a fixed point). Methods of megatron-core's classes only (torch's own are covered by
the guard's hooks on the inner optimizer).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

CONTAINERS = frozenset(
    {
        "state",
        "param_groups",
        "shard_fp32_from_float16_groups",
        "fp32_from_float16_groups",
        "shard_fp32_groups",
    }
)


def optimizer_classes() -> list[type]:
    """The optimizer classes of the installed megatron-core that an offloader serves."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )

    return [
        DistributedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
        ChainedOptimizer,
    ]


def _functions(cls) -> dict:
    """name -> function of every method (and property getter) ``cls`` has from a class of
    megatron-core or of the caller's own (the most derived one wins)."""
    found = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith(("torch", "builtins", "abc")):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, property):
                value = value.fget
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value):
                found[name] = value
    return found


def _facts(function) -> tuple[set, set]:
    """(containers named, methods called through self) in ``function``'s body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return set(), set()
    named, called = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in CONTAINERS:
                named.add(node.attr)
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                called.add(node.attr)
    return named, called


def touching_methods(cls) -> dict[str, str]:
    """Public methods of ``cls`` that touch states or masters -> how (a container it names,
    or the method through which it reaches one)."""
    facts = {name: _facts(function) for name, function in _functions(cls).items()}
    how = {name: f"names {sorted(named)[0]}" for name, (named, _) in facts.items() if named}
    changed = True
    while changed:
        changed = False
        for name, (_, called) in facts.items():
            if name not in how:
                through = sorted(called & how.keys())
                if through:
                    how[name] = f"calls {through[0]}"
                    changed = True
    return {
        name: why for name, why in how.items() if not name.startswith("_") or name == "__init__"
    }


def unclassified() -> dict[str, str]:
    """``Class.method -> how`` for every method of the importable megatron-core's optimizers
    that touches states or masters and is neither served from the host copy, routed to the
    offloader, nor shown safe by ``megatron_offload.access.methods`` (empty when the contract
    holds)."""
    from megatron_offload.access import methods

    classified = (
        set(methods.STATE_METHODS) | set(methods.ROUTED_METHODS) | set(methods.SAFE_METHODS)
    )
    return {
        f"{cls.__name__}.{name}": how
        for cls in optimizer_classes()
        for name, how in touching_methods(cls).items()
        if name not in classified
    }
