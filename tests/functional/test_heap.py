"""The guard pages the functional tests put under the offloaded Megatron-FSDP recipe
(``test_deepseek_recipe.py``) catch a late write into a released storage.

``megatron_offload_testing/guard_pages`` makes a freed tensor storage inaccessible and never
reused, so a reader or writer that comes late (a storage released or regrown in place while a
view, an overlapped collective or a checkpoint writer still uses it) faults at once, with its
stack, instead of corrupting memory that was handed out again (what ``malloc(): unaligned
tcache chunk detected`` reports, rarely and later).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from megatron_offload_testing import guard_pages


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    return guard_pages.build(tmp_path_factory.mktemp("guard"))


LATE_WRITE = """
import ctypes, torch
states = torch.ones(1000)
address = states.data_ptr()
states.untyped_storage().resize_(0)  # released, as the offloader releases a piece
print("released", flush=True)
ctypes.c_float.from_address(address).value = 3.0  # a writer that still had the address
print("not caught", flush=True)
"""


def test_the_guard_catches_a_write_into_a_released_storage(guard):
    run = subprocess.run(
        [sys.executable, "-c", LATE_WRITE],
        env=guard_pages.environment(guard),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == -signal.SIGSEGV, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "released" in run.stdout and "not caught" not in run.stdout
    assert "Fatal Python error: Segmentation fault" in run.stderr  # the writer's stack follows
    # Without the guard the same write lands in freed memory: the writer goes on, and what
    # notices (if anything does) is glibc, later, in whatever allocates or frees next.
    plain = subprocess.run(
        [sys.executable, "-c", LATE_WRITE], capture_output=True, text=True, timeout=120
    )
    assert "not caught" in plain.stdout, (plain.returncode, plain.stderr[-2000:])
