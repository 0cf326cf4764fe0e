"""Offloaded state seen by code outside the step: megatron-core's state-touching methods
(checkpoints, state dicts) and reads of the state mapping, served from the host copy."""
