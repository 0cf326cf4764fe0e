"""The Megatron-Bridge example's training function, run in the rank pool of the Bridge
environment (the example itself is torchrun)."""

import pytest

from tests.harness.examples import train_plain_and_offloaded

pytestmark = pytest.mark.bridge  # skipped, with the reason, where Bridge is absent (conftest)


def example_job(steps):
    plain, offloaded, stats = train_plain_and_offloaded(
        "bridge_train_offload.py", bf16=True, steps=steps
    )
    return plain, offloaded, stats["host_bytes"], stats["offloaded_bytes"]


def test_bridge_example_trains_identically_with_the_callback(rank_pool):
    for plain, offloaded, host_bytes, offloaded_bytes in rank_pool.run(example_job, 3):
        assert [loss for loss, _ in plain] == [loss for loss, _ in offloaded]
        assert all(nbytes == offloaded_bytes == host_bytes > 0 for _, nbytes in offloaded)
        assert all(nbytes == 0 for _, nbytes in plain)
