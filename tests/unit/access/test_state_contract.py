"""The state-access contract, checked against the installed megatron-core's own code: every
public method of the optimizers an offloader serves that touches the optimizer states or the
master weights is served from the host copy (``methods.STATE_METHODS``), routed to the
offloader (``methods.ROUTED_METHODS``), or shown safe (``methods.SAFE_METHODS``, with the reason).
A method a later megatron-core adds fails here, naming it, until it is classified.

Runs on every megatron-core line of the suite (``floor``: 0.16.1; ``line``: 0.17.1, 0.18.2;
the main suite: 0.19.2), and on the Megatron trees the suite runs: the installed line patched
with ``patches/`` (``tests/integration/patches/test_patched_tree_imports.py``) and a Megatron-LM
checkout (``tests/functional/test_stock_script.py``).
"""

import pytest

from megatron_offload.access import methods
from tests.harness.state_contract import optimizer_classes, touching_methods, unclassified

CLASSIFIED = set(methods.STATE_METHODS) | set(methods.ROUTED_METHODS) | set(methods.SAFE_METHODS)


@pytest.mark.floor
@pytest.mark.line
def test_every_method_that_touches_states_or_masters_is_served_routed_or_safe():
    import megatron.core

    found = unclassified()
    assert found == {}, f"megatron-core {megatron.core.__version__}: {found}"
    # The scan sees what it must: served, routed and safe methods of each kind.
    found = touching_methods(optimizer_classes()[0])
    assert {"state_dict", "load_state_dict", "sharded_state_dict", "offload_to_cpu", "step"} <= set(
        found
    )


@pytest.mark.floor
@pytest.mark.line
def test_a_planted_method_that_reads_the_masters_is_caught():
    """Negative control: a subclass with one more public method that reads the masters
    directly, and one that reaches them through a private helper."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class Later(DistributedOptimizer):
        def peek_masters(self):
            return [p.sum() for group in self.shard_fp32_from_float16_groups for p in group]

        def _helper(self):
            return self.param_groups

        def summarize(self):
            return self._helper()

    found = touching_methods(Later)
    assert found["peek_masters"] == "names shard_fp32_from_float16_groups"
    assert found["summarize"] == "calls _helper"
    assert {"peek_masters", "summarize"} - CLASSIFIED == {"peek_masters", "summarize"}
