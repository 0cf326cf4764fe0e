"""Test doubles of optimizers that cannot be installed on a CPU-only machine.

* ``te_fused_adam``: Transformer Engine's ``FusedAdam`` and the ``Float8Tensor`` it keeps FP8
  moments in (TE 2.17, the release megatron-core 0.19 pins).
* ``apex_fused_adam``: apex's ``FusedAdam`` (only what shapes its state).
* ``megatron_injection``: makes megatron-core pick one of them, the way it would pick the real
  package if it were installed, for the duration of a ``with`` block.

Nothing in ``megatron_offload`` imports this package: the offloader must work on the real
optimizers, and these doubles exist only so that its Transformer Engine and apex paths run in CI.
"""
