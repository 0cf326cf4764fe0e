"""The allocator model's MemPool rule against the real CUDA caching allocator.

Why the masters stay on the device under ``--use-nccl-ub`` (``adapters/megatron_fsdp.py``):
Megatron-FSDP allocates them inside a ``torch.cuda.MemPool`` registered with NCCL, and a block
freed inside a MemPool serves that pool only. Shown here with a plain MemPool (no NCCL needed):
memory freed in the pool is not what the next default-pool allocation of the same size gets,
while memory freed in the default pool is. Marked ``gpu``: runs (and must pass) where
``torch.cuda.is_available()``, in the GPU kit; skipped elsewhere with the reason. The CPU twin
is ``tests/unit/testing/test_allocator_model.py``'s MemPool tests.
"""

from __future__ import annotations

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
NBYTES = 64 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU; none is present")
def test_memory_freed_in_a_mempool_does_not_serve_the_default_pool():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Control: freed in the default pool, the same allocation takes the same block back.
    block = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    address = block.data_ptr()
    del block
    again = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    assert again.data_ptr() == address
    del again
    torch.cuda.empty_cache()

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        masters = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    address = masters.data_ptr()
    del masters  # "released": back to the pool's cache
    reserved = torch.cuda.memory_reserved()
    forward = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")  # the default pool
    assert forward.data_ptr() != address
    assert torch.cuda.memory_reserved() >= reserved + NBYTES  # a segment of its own
    # The pool's block serves the pool again.
    with torch.cuda.use_mem_pool(pool):
        regrown = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    assert regrown.data_ptr() == address
    del forward, regrown
    torch.cuda.synchronize()
