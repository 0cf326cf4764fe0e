"""The heap under the CPU harness: the guard pages the functional tests put under the
offloaded Megatron-FSDP recipe (``test_deepseek_recipe.py``) catch a late write into a released
storage, and gloo's coalesced all-gathers no longer corrupt the heap (below).

``megatron_offload_testing/guard_pages`` makes a freed tensor storage inaccessible and never
reused, so a reader or writer that comes late (a storage released or regrown in place while a
view, an overlapped collective or a checkpoint writer still uses it) faults at once, with its
stack, instead of corrupting memory that was handed out again (which glibc reports, if at all,
rarely and later). The guard covers tensor storages only, not glibc's small blocks, where the
gloo corruption below lands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_offload_testing import guard_pages
from tests.harness.rank_pool import store_port

REPO_ROOT = str(Path(__file__).resolve().parents[2])


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


# Gloo's coalesced all-gather and the heap. torch 2.13 gives each gloo group two worker threads,
# and two coalesced all-gathers of one group in flight at once corrupt the heap, with no
# megatron-core and no offloading involved: three bucket groups of five bf16 shards gathered
# asynchronously, 30,000 times, aborted 3 runs in 5 (``malloc_consolidate(): unaligned fastbin
# chunk detected`` or a segmentation fault in a gloo worker); one at a time (3 runs) and
# uncoalesced (3 runs) never did. Megatron-FSDP's overlapped parameter gather issues exactly
# that, one coalesced all-gather per bucket group. ``cpu_megatron.install()`` therefore gives
# every gloo group one worker thread, which runs a group's collectives in the order they were
# issued, as NCCL runs them on a GPU's stream: 5 runs of the same 30,000 iterations, no abort.
GATHERS = """
import os, sys, datetime
import torch, torch.distributed as dist
from megatron_offload_testing import cpu_megatron

rank, port, iterations = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
cpu_megatron.install()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
group = dist.new_group([0, 1])
threads = [pg._get_backend(torch.device("cpu")).options._threads for pg in (dist.group.WORLD, group)]
print("worker threads per group", threads, flush=True)
torch.manual_seed(rank)
shards = [torch.randn(n, dtype=torch.bfloat16) for n in (40, 96, 8, 300, 24)]
for _ in range(iterations):
    buckets, works = [], []
    for _bucket_group in range(3):  # issued back to back, waited for later
        bucket = [torch.empty(2 * s.numel(), dtype=s.dtype) for s in shards]
        with dist._coalescing_manager(group, async_ops=True) as work:
            for out, shard in zip(bucket, shards):
                dist.all_gather_into_tensor(out, shard, group=group)
        buckets.append(bucket)
        works.append(work)
    for work in works:
        work.wait()
    for bucket in buckets:
        for out, shard in zip(bucket, shards):
            assert torch.equal(out.chunk(2)[rank], shard)
dist.destroy_process_group()
print("gathered", iterations, flush=True)
"""


def _gather_on_two_ranks(tmp_path, iterations: int) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "gathers.py"
    script.write_text(GATHERS)
    port = str(store_port())
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", str(script), str(rank), port, str(iterations)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


ITERATIONS = 3000


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> list[subprocess.CompletedProcess]:
    """The two ranks of the gathers below, run once for the tests of this module."""
    return _gather_on_two_ranks(tmp_path_factory.mktemp("gathers"), ITERATIONS)


def test_every_gloo_group_runs_its_collectives_in_order_on_one_worker_thread(gathered):
    """Deterministic: gloo's default is two worker threads per group (the heap corruption above
    needs two); under ``cpu_megatron.install()`` every group, the world's included, has one."""
    for run in gathered:
        assert "worker threads per group [1, 1]" in run.stdout, (run.stdout, run.stderr[-3000:])


def test_coalesced_all_gathers_in_flight_together_leave_the_heap_sound(gathered):
    """Megatron-FSDP's overlapped parameter gather on gloo, reduced to torch: three coalesced
    all-gathers of one group in flight at once, many times, with every value checked. (Without
    the one worker thread this aborted in 3 of 5 runs of 30,000 iterations: a race, so it is
    the test above that fails every time without it.)"""
    for run in gathered:
        assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-3000:])
        assert f"gathered {ITERATIONS}" in run.stdout, run.stdout
