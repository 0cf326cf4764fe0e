"""A fork after attach (DataLoader workers, checkpoint processes) copies none of the offloader's pinned host arena: on the real optimizer, gloo ranks."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from benchmarks.gpu_kit import (
    mapping_private_bytes,
)  # the GPU kit reads the child's smaps the same way
from tests.unit.device.test_fork_safe import (
    _IO_URING_REGISTER,
    _IO_URING_SETUP,
    _REGISTER_BUFFERS,
    _IoVec,
)


def _pinned_fork(buffer) -> tuple | str:
    """Register ``buffer`` with io_uring, fork, and return the child's private bytes of the
    buffer's mapping (a string: why it could not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    ring = libc.syscall(_IO_URING_SETUP, ctypes.c_uint(4), params)
    if ring < 0:
        return f"io_uring_setup failed: {os.strerror(ctypes.get_errno())}"
    try:
        iov = _IoVec(buffer.data_ptr(), buffer.numel())
        if libc.syscall(_IO_URING_REGISTER, ring, _REGISTER_BUFFERS, ctypes.byref(iov), 1) < 0:
            return f"io_uring buffer registration failed: {os.strerror(ctypes.get_errno())}"
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, str(mapping_private_bytes(buffer.data_ptr())).encode())
            os._exit(0)
        child = int(os.read(read, 64))
        os.waitpid(pid, 0)
        os.close(read)
        os.close(write)
        return (child,)
    finally:
        os.close(ring)


def attached_fork_job():
    """On real megatron-core: attach, train (the states on the host), pin the arena as the
    driver would, fork; and the same bytes in a private mapping (the control)."""
    import torch

    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    offloader = megatron_offload.attach(optimizer)
    for step in range(2):
        models.train_step(chunks, optimizer, config, step)
    arena = offloader.engines[0].host_arena
    nbytes = arena.numel()
    control = torch.frombuffer(
        mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8
    )
    control.copy_(arena)
    result = {
        "arena_bytes": nbytes,
        "arena": _pinned_fork(arena),
        "control": _pinned_fork(control),
        "offloaded": offloader.stats()["offloaded_bytes"],
    }
    offloader.detach()
    return result


def test_a_fork_after_attach_copies_none_of_the_arena(rank_pool):
    for rank in rank_pool.run(attached_fork_job):
        if isinstance(rank["arena"], str):
            pytest.skip(
                f"this kernel does not pin memory through io_uring ({rank['arena']}): nothing to measure"
            )
        assert rank["arena_bytes"] == rank["offloaded"] > 0
        (arena_child,), (control_child,) = rank["arena"], rank["control"]
        assert arena_child == 0, rank  # the child shares every page of the arena
        assert control_child >= rank["arena_bytes"] - 4096, rank  # the control: copied at fork
