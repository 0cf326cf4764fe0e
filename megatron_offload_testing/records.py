"""What the recorders around ``examples/pretrain_gpt.py`` (the functional tests' and the GPU
report's) share: values written exactly, and the optimizers of a chain."""

from __future__ import annotations


def exact(value) -> str | None:
    """A float (or a one-element tensor) as its exact hexadecimal text; None stays None."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return float(value).hex()


def chain_members(optimizer) -> list:
    """The optimizers of a ChainedOptimizer, or the optimizer itself."""
    inner = getattr(optimizer, "chained_optimizers", None)
    return list(inner) if inner is not None else [optimizer]
