"""The demo example's training function, run in the rank pool (the demo itself is torchrun)."""

import pytest

from tests.harness.examples import load_example, train_plain_and_offloaded


def example_job(bf16, steps):
    plain, offloaded, stats = train_plain_and_offloaded(
        "train_gpt_offload.py", bf16=bf16, steps=steps
    )
    return plain, offloaded, stats["host_bytes"], stats["d2h_copies"]


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_example_trains_identically_with_offloading(rank_pool, bf16):
    for plain, offloaded, host_bytes, copies in rank_pool.run(example_job, bf16, 3):
        assert [loss for loss, _ in plain] == [loss for loss, _ in offloaded]
        assert all(nbytes == host_bytes > 0 for _, nbytes in offloaded)
        assert copies == (2 if bf16 else 1)  # moments (+ masters with bf16): one copy each


def test_demo_prints_one_table_with_every_rank_folded_in(rank_pool):
    """The demo's table: one header, one row per step, each rank's offloaded and host MiB,
    and 'NO' as soon as one rank's losses differ (the negative control)."""
    example = load_example("train_gpt_offload.py", "train_gpt_offload_table")
    ranks = [
        (plain, offloaded, {"host_bytes": host, "d2h_copies": copies, "h2d_copies": copies})
        for plain, offloaded, host, copies in rank_pool.run(example_job, True, 2)
    ]
    text = example.table(ranks)
    lines = text.splitlines()
    assert len(lines) == 1 + 2 + 1 and lines[0].count("step") == 1
    assert "r0/r1" in lines[0] and all(" yes " in line for line in lines[1:3])
    assert lines[-1].startswith("host MiB per rank") and lines[-1].endswith("yes")
    plain, offloaded, stats = ranks[1]
    ranks[1] = (plain, [(loss + 1.0, nbytes) for loss, nbytes in offloaded], stats)
    broken = example.table(ranks).splitlines()
    assert " NO " in broken[1] and broken[-1].endswith("NO")
