"""The arguments megatron.training hands the offloader's training hooks."""

from __future__ import annotations

import argparse


def offload_args(**overrides) -> argparse.Namespace:
    """The offloading flags as Megatron's parser leaves them with ``--offload-optimizer-states``
    alone (the rest at their defaults), ``--log-interval 2``, then ``overrides``."""
    values = dict(
        offload_optimizer_states=True,
        offload_master_weights=None,
        offload_release_master_grads=None,
        offload_prefetch=None,
        offload_log_stats=None,
        log_interval=2,
    )
    return argparse.Namespace(**{**values, **overrides})
