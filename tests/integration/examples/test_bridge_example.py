"""The Megatron-Bridge example's training function, run in the rank pool of the Bridge
environment (the example itself is torchrun)."""

import argparse
import importlib.util
import os

import pytest

pytestmark = pytest.mark.bridge  # skipped, with the reason, where Bridge is absent (conftest)

EXAMPLE = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "examples", "bridge_train_offload.py"
)


def example_job(steps):
    spec = importlib.util.spec_from_file_location("bridge_train_offload", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(bf16=True, steps=steps)
    plain, _ = example.train(args, offload=False)
    offloaded, stats = example.train(args, offload=True)
    return plain, offloaded, stats["host_bytes"], stats["offloaded_bytes"]


def test_bridge_example_trains_identically_with_the_callback(rank_pool):
    for plain, offloaded, host_bytes, offloaded_bytes in rank_pool.run(example_job, 3):
        assert [loss for loss, _ in plain] == [loss for loss, _ in offloaded]
        assert all(nbytes == offloaded_bytes == host_bytes > 0 for _, nbytes in offloaded)
        assert all(nbytes == 0 for _, nbytes in plain)
