"""Functional tests: examples/pretrain_gpt.py launched as torchrun launches it, offloading on and off.

Tests marked ``gpu`` run the same cases with NCCL on GPUs. Where no GPU exists they are
skipped with that reason (visible in the summary); where GPUs exist they run, and fail (never
skip) when something they need is missing: too few GPUs, or no golden file for the case.
"""

from __future__ import annotations

import pytest


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or _gpu_count() > 0:
        return
    skip = pytest.mark.skip(
        reason="no GPU on this machine: the NCCL variants of the functional tests run (and "
        "must pass) where GPUs exist"
    )
    for item in gpu_items:
        item.add_marker(skip)
