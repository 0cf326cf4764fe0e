"""Offloading under Megatron-FSDP (``use_megatron_fsdp``, ``optim_grads_params``) on gloo ranks.

megatron-core's ``FullyShardedDataParallel`` builds and trains a bf16 GPT on the CPU harness
(the harness gives it the CPU as its device; ``torch.cuda.current_device()`` answers 0 there,
as on a GPU). Attached, the offloader moves the states (the DTensors' local shards) and the
fp32 master buffers (``main_weight_buffer.data`` of every parameter group, released and
regrown in place) after every step and back before the next: the run is bitwise the run
without offloading, and between steps those storages hold no bytes at all.

What is compared: the step results (loss, grad norm), every rank's fp32 master shards (the
inner optimizer's parameters), its states, and its shard of each bf16 model weight (in
``model_weight_buffer``, where Megatron-FSDP keeps them between steps).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.compare import assert_bitwise_equal
from tests.harness.megatron_fsdp import FSDP, held_bytes, inner, local, snapshot

STEPS = 4


class PlantedFailure(RuntimeError):
    pass


def fsdp_job(
    offload: bool,
    *,
    steps=STEPS,
    options=None,
    moe=False,
    checked=False,
    te=None,
    strategy=None,
    ddp=None,
    fail=None,
):
    """``te``: None (torch's AdamW), or Transformer Engine's FusedAdam (its CPU double):
    "te" keeping no masters (Megatron-FSDP's buffers hold them), or "te-precision-aware"
    (``--use-precision-aware-optimizer`` with bf16 moments). ``ddp``: more fields of the
    ``DistributedDataParallelConfig``. ``fail``: (step, call): that call of the inner
    optimizer's ``step`` in that step raises after its update, and the loop runs the same
    iteration again."""
    import contextlib

    from tests.harness import optimizer_jobs

    with optimizer_jobs.injected("te") if te else contextlib.nullcontext():
        return _fsdp_run(offload, steps, options, moe, checked, te, strategy, ddp, fail)


def _fsdp_run(offload, steps, options, moe, checked, te, strategy, ddp, fail):
    import torch
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    import megatron_offload
    from tests.harness import models, optimizer_jobs
    from tests.harness.checked import check_devices, checked_device_options
    from tests.harness.footprint import record_peaks, whole_state_bytes

    overrides = dict(models.MOE) if moe else None
    precision_aware = te == "te-precision-aware"
    chunks, optimizer, config = models.build(
        "gpt",
        "bf16",
        # megatron.training sets megatron_fsdp_use_decoupled_grad from the precision-aware flag.
        ddp_overrides={
            **FSDP,
            "megatron_fsdp_use_decoupled_grad": precision_aware,
            **({"data_parallel_sharding_strategy": strategy} if strategy else {}),
            **(ddp or {}),
        },
        transformer_overrides=overrides,
        optimizer_overrides=optimizer_jobs.precision_aware(exp_avg="bf16")
        if precision_aware
        else None,
    )
    devices = []
    if checked:
        options, devices = checked_device_options(options)
    current = {"step": 0, "calls": 0}
    if fail is not None:
        real = inner(optimizer).step

        def failing(*args, **kwargs):  # set before attach: the chunked update calls this one
            out = real(*args, **kwargs)
            if current["step"] == fail[0]:
                current["calls"] += 1
                if current["calls"] == fail[1]:
                    raise PlantedFailure("planted failure after an update call")
            return out

        inner(optimizer).step = failing
    offloader = megatron_offload.attach(optimizer, **(options or {})) if offload else None
    # The states' device footprint during each step (the masters left out): what a chunked
    # update bounds by its slots.
    peaks = record_peaks(optimizer, devices)
    results, held, figures, failures = [], [], [], []
    for step in range(steps):
        current["step"] = step
        peaks.append(0)
        # The iteration run again draws the same dropout masks as the failed one did.
        generators = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
        try:
            results.append(models.train_step(chunks, optimizer, config, step))
        except PlantedFailure as error:
            failures.append({"step": step, "notes": list(getattr(error, "__notes__", []))})
            torch.set_rng_state(generators[0])
            get_cuda_rng_tracker().set_states(generators[1])
            results.append(models.train_step(chunks, optimizer, config, step))  # again
        held.append(held_bytes(chunks, optimizer))
        if offloader is not None:
            stats = offloader.stats()
            figures.append(
                {k: stats[k] for k in ("tracked_bytes", "offloaded_bytes", "update_chunks")}
            )
    if offloader is not None:
        offloader.reload()
        offloader.wait()
    opt = inner(optimizer)
    shards = [tuple(local(p).shape) for group in opt.param_groups for p in group["params"]]
    out = {
        "results": results,
        "held": held,
        "figures": figures,
        "shards": shards,
        "snapshot": snapshot(chunks, optimizer),
        "checked_calls": [dict(d.calls) for d in devices],
        "peaks": peaks,
        "whole": whole_state_bytes(optimizer),
        "failures": failures,
        "optimizer": type(opt).__module__ + "." + type(opt).__name__,
        "state_dtypes": sorted(
            {
                (k, str(local(v).dtype))
                for entries in dict.values(opt.state)
                for k, v in entries.items()
            }
        ),
    }
    check_devices(devices)
    return out


def _assert_offloaded_between_steps(reference, offloaded):
    for ref, off in zip(reference, offloaded):
        assert all(nbytes > 0 for nbytes in ref["held"]), ref["held"]  # the measure sees them
        assert off["held"] == [0] * len(off["held"]), off["held"]
        assert all(f["offloaded_bytes"] == f["tracked_bytes"] > 0 for f in off["figures"])


@pytest.mark.parametrize("prefetch", [None, "step"], ids=["prefetch-gradients", "prefetch-step"])
def test_offloaded_under_megatron_fsdp_trains_bitwise_with_nothing_held(
    rank_pool, prefetch, reference_run
):
    options = {"prefetch": prefetch} if prefetch else None
    reference = reference_run(fsdp_job, False)
    offloaded = rank_pool.run(fsdp_job, True, options=options)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)
    # Uneven shards, and a rank holding an empty shard of some parameter: both served.
    shards = [rank["shards"] for rank in reference]
    assert shards[0] != shards[1]
    assert any(0 in shape for rank in shards for shape in rank), shards


@pytest.mark.parametrize("strategy", ["optim_grads", "optim", "no_shard"])
def test_the_other_sharding_strategies_bitwise_with_nothing_held(
    rank_pool, strategy, reference_run
):
    """optim_grads (parameters whole), optim (parameters and gradients whole), no_shard
    (nothing sharded: every rank holds whole masters and states): the masters are one buffer
    per parameter group all the same, released and regrown in place."""
    reference = reference_run(fsdp_job, False, steps=3, strategy=strategy)
    offloaded = rank_pool.run(fsdp_job, True, steps=3, strategy=strategy)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)


def test_one_rank_bitwise_with_nothing_held():
    """Data parallel 1: every shard is the whole parameter."""
    from tests.harness.rank_pool import RankPool

    with RankPool(1) as pool:
        reference = pool.run(fsdp_job, False, steps=3)
        offloaded = pool.run(fsdp_job, True, steps=3)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)


def test_four_ranks_bitwise_with_nothing_held(rank_pool4):
    reference = rank_pool4.run(fsdp_job, False, steps=3)
    offloaded = rank_pool4.run(fsdp_job, True, steps=3)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)


@pytest.mark.parametrize("outer", ["no_shard", "optim"], ids=["hsdp", "hfsdp"])
def test_hybrid_sharding_bitwise_with_nothing_held(rank_pool4, outer):
    """Hybrid sharding on 4 ranks: two distributed optimizer instances of 2 ranks each
    (``--num-distributed-optimizer-instances 2``), the outer group replicated (HSDP) or
    sharded too (``--outer-dp-sharding-strategy optim``). Each rank's masters are still one
    main weight buffer per parameter group, released and regrown in place."""
    instances = {"num_distributed_optimizer_instances": 2}
    ddp = {**instances, "outer_dp_sharding_strategy": outer}
    reference = rank_pool4.run(fsdp_job, False, steps=3, ddp=ddp, mp_kwargs=instances)
    offloaded = rank_pool4.run(fsdp_job, True, steps=3, ddp=ddp, mp_kwargs=instances)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)


@pytest.mark.parametrize("te", ["te", "te-precision-aware"])
def test_transformer_engines_fused_adam_bitwise_with_nothing_held(rank_pool, te, reference_run):
    """TE's FusedAdam (its CPU double) under Megatron-FSDP, plain and precision-aware (bf16
    moments, gradients in ``decoupled_grad``; megatron-core turns FusedAdam's own masters off
    under Megatron-FSDP: its buffers hold them): every state shard and master buffer
    offloaded, bitwise the run without."""
    reference = reference_run(fsdp_job, False, steps=3, te=te)
    offloaded = rank_pool.run(fsdp_job, True, steps=3, te=te)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)
    for rank in reference:
        assert rank["optimizer"].endswith("te_fused_adam.FusedAdam"), rank["optimizer"]
        moments = "torch.bfloat16" if te == "te-precision-aware" else "torch.float32"
        assert rank["state_dtypes"] == [("exp_avg", moments), ("exp_avg_sq", moments)], rank
        assert all(r["grad_norm"] > 0 for r in rank["results"]), rank["results"]


def test_every_copy_ordered_under_the_checked_stream_model(rank_pool, reference_run):
    """Side streams deferred, memory poisoned until its copy ran: a missing wait raises or
    changes the comparison."""
    reference = reference_run(fsdp_job, False, steps=3)
    offloaded = rank_pool.run(fsdp_job, True, steps=3, checked=True)
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        (calls,) = rank["checked_calls"]
        assert calls["use-after-h2d"] > 0 and calls["d2h-after-writers"] > 0, calls


def test_mixture_of_experts_with_expert_parallelism_bitwise(rank_pool, reference_run):
    """One optimizer holds the dense and the expert parameters (their own parameter groups
    and master buffers, sharded over the expert data-parallel group)."""
    reference = reference_run(fsdp_job, False, steps=3, moe=True, ep=2)
    offloaded = rank_pool.run(fsdp_job, True, steps=3, moe=True, ep=2)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)


def _tensors(state_dict) -> dict:
    """Copies of the local shards of a module state dict's tensors (extra states left out)."""
    return {
        k: local(v).detach().clone() for k, v in state_dict.items() if isinstance(v, torch.Tensor)
    }


def model_state_job(offload: bool):
    """Between steps, the FSDP module's state dict (which holds the fp32 master weights) is
    read and a state dict saved earlier is loaded into it; training goes on after each."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    offloader = megatron_offload.attach(optimizer) if offload else None
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    saved = _tensors(chunks[0].state_dict())
    results.append(models.train_step(chunks, optimizer, config, 2))
    read = _tensors(chunks[0].state_dict())
    offloaded_after_read = offloader.is_offloaded if offloader else None
    # Back to the weights after step 2: written into the masters (and the model weights).
    current = chunks[0].state_dict()
    with torch.no_grad():
        for key, value in saved.items():
            local(current[key]).copy_(value)
    chunks[0].load_state_dict(current)
    results.append(models.train_step(chunks, optimizer, config, 3))
    out = {"results": results, "read": read, "offloaded_after_read": offloaded_after_read}
    if offloader is not None:
        out["offloaded_at_end"] = offloader.is_offloaded
        offloader.reload()
        offloader.wait()
    out["snapshot"] = snapshot(chunks, optimizer)
    return out


def test_the_modules_state_dict_reads_and_loads_the_masters_while_offloaded(
    rank_pool, reference_run
):
    reference = reference_run(model_state_job, False)
    offloaded = rank_pool.run(model_state_job, True)
    assert_bitwise_equal(reference, offloaded)
    for ref, off in zip(reference, offloaded):
        assert ref["read"].keys() == off["read"].keys() and ref["read"]
        assert all(torch.equal(ref["read"][k], off["read"][k]) for k in ref["read"])
        # The read brought them back; the step after it offloaded them again.
        assert off["offloaded_after_read"] is False and off["offloaded_at_end"] is True


def host_view_job(offload: bool):
    """Between steps, a host view (what megatron.training's synchronous save runs in): the
    module's and the optimizer's DTensors are read from the host copy; a view whose opening
    fails part-way (torch's ``as_strided`` raising) leaves every DTensor as it was, and the
    same view opened again serves the same bytes; training goes on bitwise."""
    import contextlib

    import megatron_offload
    from tests.harness import models
    from tests.harness.megatron_fsdp import HostRecordingDevice

    host = HostRecordingDevice()
    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    offloader = megatron_offload.attach(optimizer, device_factory=host) if offload else None
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    opt = inner(optimizer)

    def read():
        dtensors = [p for group in opt.param_groups for p in group["params"]]
        dtensors += [v for e in dict.values(opt.state) for v in e.values() if v.dim() > 0]
        module = [v for v in chunks[0].state_dict().values() if isinstance(v, torch.Tensor)]
        return {
            "values": [local(d).detach().clone() for d in dtensors + module],
            "on_host": sum(host.holds(local(d)) for d in dtensors + module),
            "held": held_bytes(chunks, optimizer, besides=host.holds),
        }

    out = {}
    if offload:
        real = torch.Tensor.as_strided
        calls = {"n": 0}

        def failing(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("planted: as_strided failed")
            return real(self, *args, **kwargs)

        torch.Tensor.as_strided = failing
        try:
            with offloader.host_view():
                pass
        except RuntimeError as error:
            out["failed"] = str(error)
        finally:
            torch.Tensor.as_strided = real
        out["after_failure"] = {
            "held": held_bytes(chunks, optimizer),
            "on_host": sum(host.holds(local(p)) for g in opt.param_groups for p in g["params"]),
            "phase": offloader.phase.current.value,
        }
    with offloader.host_view() if offload else contextlib.nullcontext():
        out["read"] = read()
    out["offloaded_after_view"] = offloader.is_offloaded if offload else None
    results.append(models.train_step(chunks, optimizer, config, 2))
    out["results"] = results
    if offloader is not None:
        offloader.reload()
        offloader.wait()
    out["snapshot"] = snapshot(chunks, optimizer)
    return out


def test_a_host_view_serves_the_dtensors_from_the_host_copy_all_or_nothing(
    rank_pool, reference_run
):
    reference = reference_run(host_view_job, False)
    offloaded = rank_pool.run(host_view_job, True)
    assert_bitwise_equal(
        [{k: r[k] for k in ("results", "snapshot")} for r in reference],
        [{k: r[k] for k in ("results", "snapshot")} for r in offloaded],
    )
    for ref, off in zip(reference, offloaded):
        assert off["failed"] == "planted: as_strided failed"
        assert off["after_failure"] == {"held": 0, "on_host": 0, "phase": "idle"}
        values = ref["read"]["values"], off["read"]["values"]
        assert len(values[0]) == len(values[1]) > 0
        assert all(torch.equal(a, b) for a, b in zip(*values))
        assert ref["read"]["held"] > 0 and off["read"]["held"] == 0
        assert ref["read"]["on_host"] == 0 and off["read"]["on_host"] > 0
        assert off["offloaded_after_view"] is True


def node_check_job():
    """The node-wide host-memory check at attach under Megatron-FSDP: each rank's need is
    its own shards' (uneven), an over-commit is refused before anything moves, and
    ``stats()`` tracks exactly the bytes the master buffers and state shards hold."""
    import megatron_offload
    from tests.harness import models
    from tests.harness.faults import fake_host_limits

    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    models.train_step(chunks, optimizer, config, 0)  # the states exist: the need is theirs too
    held = held_bytes(chunks, optimizer)
    offloader = megatron_offload.attach(optimizer)
    stats = offloader.stats()
    out = {"held": held, "tracked": stats["tracked_bytes"], "need": stats["host_bytes"]}
    offloader.detach()
    needs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(needs, out["need"])
    out["needs"] = needs
    restore = fake_host_limits(sum(needs) - 1)  # one byte short for the node
    try:
        megatron_offload.attach(optimizer)
    except megatron_offload.HostMemoryBudgetError as error:
        out["refused"] = type(error).__name__
    finally:
        restore()
    out["untouched"] = held_bytes(chunks, optimizer) == held
    out["attached"] = megatron_offload.find_offloader(optimizer) is not None
    restore = fake_host_limits(sum(needs))
    try:
        offloader = megatron_offload.attach(optimizer)
        models.train_step(chunks, optimizer, config, 1)
        out["held_after"] = held_bytes(chunks, optimizer)
        out["offloaded"] = offloader.stats()["offloaded_bytes"]
        offloader.detach()
    finally:
        restore()
    return out


def test_the_node_check_and_stats_count_the_shards(rank_pool):
    ranks = rank_pool.run(node_check_job)
    assert ranks[0]["need"] != ranks[1]["need"]  # uneven shards: uneven needs
    for rank in ranks:
        assert rank["tracked"] == rank["held"] > 0 and rank["need"] >= rank["tracked"], rank
        assert rank["refused"] == "NodeMemoryError", rank
        assert rank["untouched"] and not rank["attached"], rank
        assert rank["held_after"] == 0 and rank["offloaded"] == rank["tracked"], rank


def nccl_pool_job(offload: bool):
    """Megatron-FSDP with NCCL user buffers (``--use-nccl-ub``): its buffers, the masters
    included, come from a pool registered with NCCL, which a CPU cannot make; the flag is set
    on the model's DDP config as megatron.training sets it (what ``attach`` reads). The states
    move; the masters stay, said once with their bytes."""
    import warnings

    import megatron_offload
    from tests.harness import models
    from tests.harness.megatron_fsdp import groups

    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    for wrapper in models.megatron_optimizers(optimizer):
        wrapper.ddp_config.nccl_ub = True
    buffers = [g.main_weight_buffer.data for g in groups(chunks) if g.main_weight_buffer]
    offloader = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if offload:
            offloader = megatron_offload.attach(optimizer)
    said = [str(w.message) for w in caught if "--use-nccl-ub" in str(w.message)]
    results, masters, states = [], [], []
    for step in range(3):
        results.append(models.train_step(chunks, optimizer, config, step))
        masters.append(sum(b.untyped_storage().nbytes() for b in buffers))
        states.append(held_bytes(chunks, optimizer) - masters[-1])
    if offloader is not None:
        offloader.reload()
        offloader.wait()
    return {
        "results": results,
        "said": said,
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "masters": masters,
        "states": states,
        "snapshot": snapshot(chunks, optimizer),
    }


def test_with_nccl_user_buffers_the_states_move_and_the_pooled_masters_stay(
    rank_pool, reference_run
):
    reference = reference_run(nccl_pool_job, False)
    offloaded = rank_pool.run(nccl_pool_job, True)
    assert_bitwise_equal(reference, offloaded)
    for ref, off in zip(reference, offloaded):
        assert all(nbytes > 0 for nbytes in ref["states"]), ref["states"]  # the measure sees them
        assert off["states"] == [0, 0, 0], off["states"]
        assert off["masters"] == [off["buffer_bytes"]] * 3 and off["buffer_bytes"] > 0
        (said,) = off["said"]
        assert f"({off['buffer_bytes']:,} bytes on this rank)" in said and "NCCL" in said


def _model_bytes(chunks, optimizer) -> dict:
    """Device bytes of the model's buffers (each storage once): the model weights, the main
    gradients, the unsharded parameters Megatron-FSDP gathered, and the states and masters."""
    from tests.harness.megatron_fsdp import groups

    def nbytes(tensors):
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    from megatron_offload.adapters.model_buffers import fsdp_pools

    found = groups(chunks)
    weights = [g.model_weight_buffer.data for g in found]
    pools = fsdp_pools(chunks)
    # The module's parameters outside the weight buffers (unsharded: they view them) and the
    # pools: what Megatron-FSDP gathered into buckets of their own.
    known = {t.untyped_storage()._cdata for t in weights + pools}
    params = chunks[0].module.raw_param.values()
    return {
        "weights": nbytes(weights),
        "gradients": nbytes([g.main_grad_buffer.data for g in found]),
        "gathered": nbytes([p for p in params if p.untyped_storage()._cdata not in known]),
        "pools": nbytes(pools),
        "optimizer": held_bytes(chunks, optimizer),
    }


def sleep_job(sleeps: bool, strategy="optim_grads_params", woken_by="wake"):
    """Attached; after two steps the model sleeps (or not) and wakes (``woken_by``: "wake",
    or "forward": the next step's forward wakes it), then trains two more steps.
    ``strategy`` "double-buffer": optim_grads_params with ``--fsdp-double-buffer``."""
    import megatron_offload
    from tests.harness import models

    overrides = {**FSDP, "data_parallel_sharding_strategy": strategy}
    if strategy == "double-buffer":
        overrides.update(data_parallel_sharding_strategy="optim_grads_params")
        overrides.update(fsdp_double_buffer=True)
    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=overrides)
    offloader = megatron_offload.attach(optimizer)
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    out = {"awake": _model_bytes(chunks, optimizer)}
    if sleeps:
        offloader.sleep()
        out["asleep"] = _model_bytes(chunks, optimizer)
        out["figures"] = {
            k: offloader.stats()[k]
            for k in (
                "rebuilt_parameter_bytes",
                "copied_parameter_bytes",
                "released_gathered_bytes",
            )
        }
        if woken_by == "wake":
            offloader.wake()
    results += [models.train_step(chunks, optimizer, config, step) for step in (2, 3)]
    offloader.reload()
    offloader.wait()
    out["results"], out["snapshot"] = results, snapshot(chunks, optimizer)
    return out


@pytest.mark.parametrize(
    "strategy, woken_by",
    [
        ("optim_grads_params", "wake"),
        ("optim_grads_params", "forward"),
        ("optim", "wake"),
        ("double-buffer", "forward"),
    ],
)
def test_sleep_gives_up_every_buffer_and_wakes_bitwise(
    rank_pool, strategy, woken_by, reference_run
):
    reference = reference_run(sleep_job, False, strategy)
    slept = rank_pool.run(sleep_job, True, strategy, woken_by)
    assert_bitwise_equal(
        [{k: r[k] for k in ("results", "snapshot")} for r in reference],
        [{k: r[k] for k in ("results", "snapshot")} for r in slept],
    )
    for ref, run in zip(reference, slept):
        awake = ref["awake"]
        assert awake["weights"] > 0 and awake["gradients"] > 0, awake
        assert (awake["gathered"] > 0) == (strategy != "optim"), awake
        assert (awake["pools"] > 0) == (strategy == "double-buffer"), awake
        assert run["asleep"] == dict.fromkeys(awake, 0), run["asleep"]
        figures = run["figures"]
        assert figures["rebuilt_parameter_bytes"] == awake["weights"], figures
        assert figures["copied_parameter_bytes"] == 0, figures
        # What it gathered, and the double buffer's pools (its gradient buckets' too).
        assert figures["released_gathered_bytes"] == awake["gathered"] + awake["pools"], figures


def refusal_job(what: str):
    """Under Megatron-FSDP, what stays refused is refused before anything is touched: the
    run goes on bitwise as one that never tried."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    results = [models.train_step(chunks, optimizer, config, 0)]
    refused = None
    flag = {"sleep-nccl-ub": "nccl_ub"}[what]
    for wrapper in models.megatron_optimizers(optimizer):
        setattr(wrapper.ddp_config, flag, True)  # as megatron.training sets it on the config
    if what.startswith("sleep"):
        offloader = megatron_offload.attach(optimizer)
        results.append(models.train_step(chunks, optimizer, config, 1))
        before = held_bytes(chunks, optimizer)
        try:
            offloader.sleep()
        except megatron_offload.OffloadArgumentError as error:
            refused = str(error)
        attached = before == held_bytes(chunks, optimizer)  # nothing moved
    for wrapper in models.megatron_optimizers(optimizer):
        setattr(wrapper.ddp_config, flag, False)
    results.append(models.train_step(chunks, optimizer, config, len(results)))
    if what.startswith("sleep"):
        offloader.reload()
        offloader.wait()
    return {
        "results": results,
        "refused": refused,
        "attached": attached,
        "snapshot": snapshot(chunks, optimizer),
    }


@pytest.mark.parametrize("what", ["sleep-nccl-ub"])
def test_what_stays_refused_under_megatron_fsdp_touches_nothing(rank_pool, what, reference_run):
    reference = reference_run(fsdp_job, False, steps=3)
    tried = rank_pool.run(refusal_job, what)
    for ref, run in zip(reference, tried):
        assert "Megatron-FSDP" in run["refused"] and "yet" in run["refused"], run["refused"]
        assert "NCCL" in run["refused"]
        assert run["attached"]  # the offloaded states did not move
    assert_bitwise_equal(reference, tried)


# A budget under one whole update's states (about 440 KB of fp32 moments per rank here), above
# what the largest parameter shard needs in two slots.
CHUNKED_BUDGET = 256 * 1024


@pytest.mark.parametrize("layout", ["dense", "moe-ep2"])
def test_the_chunked_update_streams_the_state_shards_bitwise_with_nothing_held(
    rank_pool, layout, reference_run
):
    """Under Megatron-FSDP the chunked update streams each rank's state shards (the locals of
    the optimizer's DTensors) through its slots, several update calls per step, the first
    step's new states included; the masters (``main_weight_buffer``) come back whole for the
    step, as megatron-core copies them into the parameters after the update. Bitwise with the
    plain run, the states' footprint within the budget during every step, 0 bytes between.
    With MoE on 2 expert-parallel ranks one optimizer streams the dense and expert shards."""
    model = dict(moe=True, ep=2) if layout == "moe-ep2" else {}
    reference = reference_run(fsdp_job, False, steps=3, **model)
    chunked = rank_pool.run(
        fsdp_job,
        True,
        steps=3,
        checked=True,
        options={"chunked_update_bytes": CHUNKED_BUDGET},
        **model,
    )
    _assert_offloaded_between_steps(reference, chunked)
    for ref, off in zip(reference, chunked):
        assert max(ref["peaks"]) == ref["whole"] > CHUNKED_BUDGET, (ref["peaks"], ref["whole"])
        assert all(0 < peak <= CHUNKED_BUDGET for peak in off["peaks"]), off["peaks"]
        # The states streamed in several chunks once they exist (the first step makes them,
        # one parameter per call, straight to the host).
        chunks = [f["update_chunks"] for f in off["figures"]]
        assert chunks[0] == 0 and all(n >= 2 for n in chunks[1:]), chunks
    assert_bitwise_equal(reference, chunked)


def test_a_chunked_step_failing_part_way_is_undone_and_run_again_bitwise(rank_pool, reference_run):
    """With ``chunked_update_undo``, the update calls of a step write the DTensor parameters'
    and states' local shards: the second call of step 2 fails after its update, the step is
    undone (the first call's shards written back too), and the iteration run again equals the
    run that never failed. Without the undo the first call's update would be applied twice."""
    reference = reference_run(fsdp_job, False, steps=3)
    failed = rank_pool.run(
        fsdp_job,
        True,
        steps=3,
        fail=(2, 2),
        options={"chunked_update_bytes": CHUNKED_BUDGET, "chunked_update_undo": True},
    )
    for rank in failed:
        assert [f["step"] for f in rank["failures"]] == [2], rank["failures"]
        assert any("undone" in note for note in rank["failures"][0]["notes"])
        assert rank["figures"][2]["update_chunks"] >= 2
    assert_bitwise_equal(reference, failed)


def detach_job():
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    module = chunks[0].module
    hooks = (len(module._state_dict_pre_hooks), len(module._load_state_dict_pre_hooks))
    offloader = megatron_offload.attach(optimizer)
    models.train_step(chunks, optimizer, config, 0)
    listed = [where for _, where, _ in offloader.interceptions.listing()]
    offloader.detach()
    return {
        "listed": [w for w in listed if w.startswith("MegatronFSDP.")],
        "after_detach": offloader.interceptions.listing(),
        "hooks_back": hooks
        == (len(module._state_dict_pre_hooks), len(module._load_state_dict_pre_hooks)),
        "held": held_bytes(chunks, optimizer),
    }


def test_detach_takes_the_module_hooks_away(rank_pool):
    for rank in rank_pool.run(detach_job):
        assert rank["listed"] == [
            "MegatronFSDP.state_dict (pre-hook)",
            "MegatronFSDP.load_state_dict (pre-hook)",
        ], rank
        assert rank["after_detach"] == [] and rank["hooks_back"], rank
        assert rank["held"] > 0  # detach brought the states and masters back
