"""Runs compared bitwise: each rank's step results, parameters and optimizer state.

A run is what a job returns on each rank: ``results`` (one dict per step) and a ``snapshot``
(``models.snapshot``: ``params`` and ``optimizer``, each ``{name: tensor}``)."""

from __future__ import annotations

import torch


def bytes_equal(a, b) -> bool:
    """Tensors with the same dtype, shape and bytes (this tells -0.0 from 0.0 and compares NaN
    payloads); anything else by ``==``."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return a == b


def differences(reference: dict, run: dict, *, ignore=lambda key: False) -> list[str]:
    """What differs between one rank's two runs: the results, or the names of the tensors
    (keys ``ignore`` accepts left out)."""
    found = [] if reference["results"] == run["results"] else ["results"]
    for section in ("params", "optimizer"):
        a, b = reference["snapshot"][section], run["snapshot"][section]
        if a.keys() != b.keys():
            found.append(f"{section} names")
            continue
        found += [f"{section} {k}" for k in a if not ignore(k) and not bytes_equal(a[k], b[k])]
    return found


def assert_bitwise_equal(reference, runs, *, ignore=lambda key: False) -> None:
    """Every rank's run is bitwise the reference's (keys ``ignore`` accepts left out)."""
    for ref, run in zip(reference, runs, strict=True):
        different = differences(ref, run, ignore=ignore)
        assert not different, f"differ: {different[:5]}"


def same_run(reference: dict, run: dict) -> bool:
    """Whether one rank's run is bitwise the reference's."""
    return not differences(reference, run)
