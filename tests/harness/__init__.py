"""Test harness: real megatron-core on CPU ranks (see rank_pool, models, and
megatron_offload_testing.cpu_megatron for the CPU redirects).

Importing this package must not import torch: rank processes set their thread environment first.
"""
