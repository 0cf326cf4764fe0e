"""The demo example's training function, run in the rank pool (the demo itself is torchrun)."""

import argparse
import importlib.util
import os

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "train_gpt_offload.py")


def example_job(bf16, steps):
    spec = importlib.util.spec_from_file_location("train_gpt_offload", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(bf16=bf16, steps=steps)
    plain, _ = example.train(args, offload=False)
    offloaded, stats = example.train(args, offload=True)
    return plain, offloaded, stats["host_bytes"], stats["d2h_copies"]


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_example_trains_identically_with_offloading(rank_pool, bf16):
    for plain, offloaded, host_bytes, copies in rank_pool.run(example_job, bf16, 3):
        assert [loss for loss, _ in plain] == [loss for loss, _ in offloaded]
        assert all(nbytes == host_bytes > 0 for _, nbytes in offloaded)
        assert copies == (2 if bf16 else 1)  # moments (+ masters with bf16): one copy each
