"""The node-wide host-memory check at attach, with fake limits on 2 ranks of one node: an
over-commit is refused on every rank with the figures before anything is allocated, a node
that has room attaches, ``host_memory_budget="auto"`` takes each rank's part, and a rank that
would pin more than its ``ulimit -l`` falls back to pageable memory with one warning (refused
with ``require_pinned_memory``)."""

from tests.harness.faults import fake_host_limits as _with_limits


def node_job():
    import torch

    import megatron_offload
    from megatron_offload.offloader import node_memory
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    models.train_step(chunks, optimizer, config, 0)
    offloader = megatron_offload.attach(optimizer)
    need = offloader.stats()["host_bytes"]  # this rank's arena, reserved at attach
    offloader.detach()
    needs = [None, None]
    torch.distributed.all_gather_object(needs, need)
    total = sum(needs)
    found = {"need": need, "total": total}

    restore = _with_limits(total - 1)  # one byte short for the node, enough for either rank
    try:
        megatron_offload.attach(optimizer)
    except megatron_offload.HostMemoryBudgetError as error:
        found["refused"] = (type(error).__name__, str(error))
    finally:
        restore()
    distrib = models.distributed_optimizers(optimizer)[0]
    found["untouched"] = "_state_offloader" not in vars(distrib) and "step" not in vars(optimizer)

    restore = _with_limits(total)
    try:
        attached = megatron_offload.attach(optimizer)
        found["fits"] = attached.stats()["host_bytes"] == need
        attached.detach()
        attached = megatron_offload.attach(optimizer, host_memory_budget="auto")
        found["auto_budget"] = attached.engines[0].budget.limit
        models.train_step(chunks, optimizer, config, 1)
        found["auto_trains"] = attached.is_offloaded
        attached.detach()
    finally:
        restore()

    import warnings

    restore = _with_limits(None, memlock=need - 1)
    try:
        node_memory.agree(need, pins=True, budget=None)
    except megatron_offload.HostMemoryBudgetError as error:
        found["memlock"] = str(error)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found["fallback"] = node_memory.agree(need, pins=True, budget=None, fallback=True)
        found["fallback_warnings"] = [str(w.message) for w in caught]
        found["pinned_within"] = node_memory.agree(need - 1, pins=True, budget=7, fallback=True)
    finally:
        restore()
    restore = _with_limits(None)
    try:
        found["auto_unlimited"] = node_memory.agree(need, pins=True, budget="auto")
    finally:
        restore()
    return found


def test_the_ranks_of_a_node_agree_on_their_host_memory_before_allocating(rank_pool):
    results = rank_pool.run(node_job)
    messages = {found["refused"][1] for found in results}
    assert len(messages) == 1  # every rank refuses, with the same figures
    (message,) = messages
    for found in results:
        kind, text = found["refused"]
        assert kind == "NodeMemoryError" and found["untouched"]
        assert f"need {found['total']:,} bytes of host memory together" in text
        assert f"can give {found['total'] - 1:,}" in text and "Nothing was allocated" in text
        assert "fewer ranks per node" in text and "offload_fraction" in text
        assert found["fits"] and found["auto_trains"]
        assert (
            found["auto_budget"]
            == found["total"] * found["need"] // found["total"]
            == found["need"]
        )
        assert "would pin" in found["memlock"] and "ulimit -l" in found["memlock"]
        # The default falls back to pageable memory, with one warning saying what it costs.
        assert found["fallback"] == (None, False)
        (warning,) = found["fallback_warnings"]
        assert "pageable" in warning and "synchronous" in warning and "ulimit -l" in warning
        assert found["pinned_within"] == (7, True)
        assert found["auto_unlimited"] == (None, True)
