"""Test harness: real megatron-core on CPU ranks (see cpu_megatron, rank_pool, models).

Importing this package must not import torch: rank processes set their thread environment first.
"""
