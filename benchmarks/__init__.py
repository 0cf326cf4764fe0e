"""Benchmarks of the offload cycle: bytes, copies, cycle time against the physical floor
and Python bookkeeping. Run ``python -m benchmarks.offload_cycle --help`` (see README.md).

Importing this package must stay cheap and must not import megatron-core: rank processes
and test files import pieces of it.
"""
