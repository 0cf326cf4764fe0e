"""The rank pool and the CPU megatron-core harness behave as the other tests rely on."""

from __future__ import annotations

import os

import pytest

from tests.harness.rank_pool import RankJobError, RankPoolBroken

# What the other lines' tests rely on runs on every line (``floor``); the pool's own
# robustness (dead ranks, timeouts, orphans, four ranks) does not depend on megatron-core
# and runs in the main suite only, on pools of its own whose ranks import torch alone: they are
# broken on purpose and restarted, which costs a shared pool megatron-core's imports each time.


@pytest.fixture
def light_pool():
    from tests.harness.rank_pool import RankPool

    pool = RankPool(world_size=2, megatron=False)
    try:
        yield pool
    finally:
        pool.close()


# ------------------------------------------------------------------- rank-side jobs
def describe_rank(scale):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.harness.rank_pool import current_job

    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    bf16 = (torch.arange(6, dtype=torch.float32) * scale + rank).to(torch.bfloat16)
    return {
        "rank": rank,
        "pid": os.getpid(),
        "sum": total.item(),
        "bf16_view": bf16.view(2, 3)[:, 1],  # a view: must arrive as its own compact tensor
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "job": current_job(),
        "cuda_available": torch.cuda.is_available(),
        "accelerator_available": torch.accelerator.is_available(),
        "threads": torch.get_num_threads(),
        "draw": torch.rand(3),
    }


def raise_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return "fine"


def exit_on_rank(bad_rank, code):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(code)
    dist.barrier()  # the survivor waits for a peer that will never come
    return "unreachable"


def sleep_forever():
    import time

    time.sleep(3600)


def start_child_job():
    """Start a process that would run for minutes (as a checkpoint writer or a Manager may)."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


def pid_job():
    return os.getpid()


def megatron_imported():
    import sys

    return "megatron.core" in sys.modules


def train_job(model, dtype, steps, micro_batches=1, **build_kw):
    """`steps` real Megatron training steps; results and a snapshot after the first and last."""
    from tests.harness import models

    chunks, optimizer, config = models.build(model, dtype, **build_kw)
    empty_before_first_step = all(
        not opt.optimizer.state for opt in models.distributed_optimizers(optimizer)
    )
    results, first = [], None
    for step in range(steps):
        results.append(models.train_step(chunks, optimizer, config, step, micro_batches))
        if step == 0:
            first = models.snapshot(chunks, optimizer)["optimizer"]
    models.flush_param_gather(chunks)
    return {
        "results": results,
        "classes": models.optimizer_classes(optimizer),
        "empty_before_first_step": empty_before_first_step,
        "after_first_step": first,
        "snapshot": models.snapshot(chunks, optimizer),
    }


# ------------------------------------------------------------------- helpers
def assert_bitwise_equal(a, b, where=""):
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"tensors differ at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ------------------------------------------------------------------- tests
@pytest.mark.floor
def test_results_round_trip_per_rank(rank_pool):
    import torch

    results = rank_pool.run(describe_rank, 2.0, tp=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["sum"] for r in results} == {3.0}
    for rank, r in enumerate(results):
        expected = (torch.arange(6, dtype=torch.float32) * 2.0 + rank).to(torch.bfloat16)
        assert torch.equal(r["bf16_view"], expected.view(2, 3)[:, 1])
        assert r["bf16_view"].untyped_storage().nbytes() == 2 * 2  # compact, not the base
        assert (r["tp"], r["dp"]) == (2, 1)
        assert r["job"]["rank"] == rank and r["job"]["tp"] == 2
        # The harness must not make the CPU look like an accelerator to the code under test.
        assert not r["cuda_available"] and not r["accelerator_available"]
        assert r["threads"] == 1
    # Reseeded per job: the same draws whatever ran before, and equal across DP ranks.
    again = rank_pool.run(describe_rank, 1.0)
    assert (again[0]["tp"], again[0]["dp"]) == (1, 2)
    assert torch.equal(again[0]["draw"], results[0]["draw"])
    assert torch.equal(again[0]["draw"], again[1]["draw"])
    assert rank_pool.run(megatron_imported) == [True, True]  # what a light pool leaves out


@pytest.mark.floor
def test_exception_on_one_rank_carries_its_traceback(rank_pool):
    pids = rank_pool.run(pid_job)
    with pytest.raises(RankJobError) as info:
        rank_pool.run(raise_on_rank, 1)
    assert set(info.value.tracebacks) == {1}
    text = str(info.value)
    assert "rank(s) [1]" in text
    assert "ValueError: deliberate failure on rank 1" in text
    assert "raise_on_rank" in text  # the rank's own traceback, not the parent's
    # A job error leaves the pool usable, with the same processes.
    assert rank_pool.run(pid_job) == pids


def test_dead_rank_breaks_the_pool_and_the_next_run_starts_fresh(light_pool):
    assert light_pool.run(megatron_imported) == [False, False]
    pids = light_pool.run(pid_job)
    with pytest.raises(RankPoolBroken) as info:
        light_pool.run(exit_on_rank, 1, 139, timeout=60)
    text = str(info.value)
    assert "rank 1" in text and "exit code 139" in text
    assert "fresh pool" in text
    assert light_pool.broken
    new_pids = light_pool.run(pid_job)
    assert not light_pool.broken
    assert not set(new_pids) & set(pids)
    assert light_pool.run(raise_on_rank, -1) == ["fine", "fine"]
    assert light_pool.starts == 2


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["close", "dead-rank"])
def test_nothing_a_job_started_outlives_the_pool(how):
    """A process a job started (and left running) is ended with the pool: when the pool is
    closed (the ranks exit normally first), and when a rank died and the pool was killed."""
    import time

    from tests.harness.rank_pool import RankPool

    pool = RankPool(world_size=2, megatron=False)
    try:
        children = pool.run(start_child_job)
        assert all(_alive(pid) for pid in children)
        if how == "close":
            pool.close()
        else:
            with pytest.raises(RankPoolBroken):
                pool.run(exit_on_rank, 1, 139, timeout=60)
    finally:
        pool.close()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children), children


def test_job_timeout_breaks_the_pool(light_pool):
    with pytest.raises(RankPoolBroken, match=r"timed out after 2 s"):
        light_pool.run(sleep_forever, timeout=2)
    assert light_pool.run(raise_on_rank, -1) == ["fine", "fine"]
    assert light_pool.starts == 2


@pytest.mark.floor
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_is_reproducible_and_optimizer_state_is_as_expected(rank_pool, dtype):
    import torch

    kw = dict(overlap_grad_reduce=True, bucket_size=1000)
    first = rank_pool.run(train_job, "mlp", dtype, 3, **kw)
    # Something different in between must not leak into the next job.
    rank_pool.run(train_job, "mlp", "bf16" if dtype == "fp32" else "fp32", 2, seed=7)
    second = rank_pool.run(train_job, "mlp", dtype, 3, **kw)
    assert_bitwise_equal(first, second)

    for rank_result in first:
        assert rank_result["classes"][-2:] == ["DistributedOptimizer", "AdamW"]
        assert rank_result["empty_before_first_step"]
        assert all(r["update_successful"] for r in rank_result["results"])
        losses = [r["loss"] for r in rank_result["results"]]
        assert all(isinstance(x, float) and x == x for x in losses)
        after_first = rank_result["after_first_step"]
        final = rank_result["snapshot"]["optimizer"]
        shards = {key[:3] for key in final}
        assert shards, "the DistributedOptimizer holds no shards"
        for shard in shards:
            assert shard + ("exp_avg",) in after_first
            assert shard + ("exp_avg_sq",) in after_first
            assert after_first[shard + ("step",)].item() == 1
            assert final[shard + ("step",)].item() == 3
            assert final[shard + ("main_param",)].dtype == torch.float32
    # Data-parallel ranks see different data but end with identical replicas.
    assert first[0]["results"][0]["loss"] == first[1]["results"][0]["loss"]  # DP-averaged
    assert_bitwise_equal(first[0]["snapshot"]["params"], first[1]["snapshot"]["params"])


@pytest.mark.floor
def test_gpt_training_is_reproducible(rank_pool):
    kw = dict(
        micro_batches=2, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000
    )
    first = rank_pool.run(train_job, "gpt", "bf16", 3, **kw)
    second = rank_pool.run(train_job, "gpt", "bf16", 3, **kw)
    assert_bitwise_equal(first, second)
    assert all(r["update_successful"] for rank in first for r in rank["results"])


def test_four_ranks_with_tensor_parallelism(rank_pool4):
    results = rank_pool4.run(describe_rank, 1.0, tp=2)
    assert [(r["rank"], r["tp"], r["dp"], r["sum"]) for r in results] == [
        (rank, 2, 2, 10.0) for rank in range(4)
    ]
    trained = rank_pool4.run(train_job, "mlp", "bf16", 2, tp=2, micro_batches=2)
    assert all(r["update_successful"] for rank in trained for r in rank["results"])


def threads_job():
    """(process groups, gloo transport threads, all threads) of this rank, each the fewest
    seen over a second: the transport threads of a group destroyed at the last teardown may
    end a moment after it returned (one suite run counted 2 and 3 more gloo threads after
    three jobs, with the same total), while what a job strands stays."""
    import os
    import time

    import torch.distributed as dist

    def names():
        found = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as comm:
                    found.append(comm.read().strip())
            except OSError:
                pass  # the thread ended after the listing (what this waits for)
        return found

    fewest = None
    deadline = time.monotonic() + 1.0
    while True:
        threads = names()
        now = (
            len(dist.distributed_c10d._world.pg_map),
            threads.count("gloo_tcp_loop"),
            len(threads),
        )
        fewest = now if fewest is None else tuple(map(min, fewest, now))
        if time.monotonic() >= deadline:
            return fewest
        time.sleep(0.02)


def fp32_training_job():
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "fp32")
    for step in range(2):
        models.train_step(chunks, optimizer, config, step)


def megatron_fsdp_moe_job():
    from tests.integration.offloader.test_megatron_fsdp import fsdp_job

    fsdp_job(True, steps=1, moe=True)


@pytest.mark.parametrize(
    "job", [fp32_training_job, megatron_fsdp_moe_job], ids=["fp32-ddp", "megatron-fsdp-moe"]
)
def test_jobs_leave_no_process_groups_or_threads_behind(rank_pool, job):
    """An fp32 model with the distributed optimizer outlives its job (autograd's nodes keep
    its hooks, and so the DDP wrapper, alive) and held its process groups, three gloo threads
    each: a few hundred jobs left each rank with a thousand threads. A Megatron-FSDP job with
    MoE left its module, its distributed index and its whole model (some 60 threads per rank
    and job). The pool empties such leftovers at every teardown; the groups and threads stay
    what one job needs. (No more after three jobs than before them: the shared ranks may still
    hold, before, what an earlier test's job left, which a teardown then frees.)"""
    rank_pool.run(job)
    before = rank_pool.run(threads_job)
    for _ in range(3):
        rank_pool.run(job)
    after = rank_pool.run(threads_job)
    for rank_before, rank_after in zip(before, after):
        assert all(a <= b for a, b in zip(rank_after, rank_before)), (before, after)
    assert all(groups == after[0][0] for groups, _, _ in after), after
