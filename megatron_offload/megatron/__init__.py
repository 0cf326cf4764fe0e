"""Megatron's command line and training loop: the flags, their validation, coexistence with a
Megatron that has an offloader of its own, and the hooks of ``megatron.training``."""
