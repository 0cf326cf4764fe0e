"""host_memory_budget's values, and the node-wide check's arithmetic in one process."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("budget", ["auto", None, 1 << 20])
def test_the_budget_option_takes_auto(budget):
    from megatron_offload import OffloadConfig

    assert OffloadConfig(host_memory_budget=budget).host_memory_budget == budget
    with pytest.raises(ValueError, match='"auto" or None'):
        OffloadConfig(host_memory_budget="half")
