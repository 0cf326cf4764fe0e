"""The tests' one home for helpers: real megatron-core on CPU ranks (``rank_pool``, ``models``,
``gloo``, ``inspection``; ``megatron_offload_testing.cpu_megatron`` holds the CPU redirects),
jobs shared by several test modules (``optimizer_jobs``), an isolated process for bodies that
may touch released memory (``isolated``), faults injected at the boundary with torch and the
OS (``faults``), checkpoints, footprints and state contracts, and test doubles of optimizers
that cannot be installed here (``doubles``). What the examples and benchmarks use as well
(the checked and modelled devices, the CPU stand-ins for CUDA) lives beside the package in
``megatron_offload_testing``, not here.

Importing this package must not import torch: rank processes set their thread environment first.
"""
