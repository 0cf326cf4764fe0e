"""The Megatron-Bridge callback's refusals, without Bridge: what the user gets wrong is said
before anything is touched (``test_bridge.py`` trains through Bridge itself)."""

from __future__ import annotations

import pytest

from megatron_offload.frameworks.bridge import OptimizerStateOffloadCallback


def test_options_are_checked_when_the_callback_is_made():
    with pytest.raises(TypeError, match="offload_moments"):
        OptimizerStateOffloadCallback(offload_moments=True)
    with pytest.raises((TypeError, ValueError), match="offload_master_weights"):
        OptimizerStateOffloadCallback(offload_master_weights="yes")
