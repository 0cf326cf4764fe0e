"""``detach()`` in any state, and the README's own example, call for call.

A user detaches after the training loop, when the step cycle has just offloaded the states:
detach must bring them back first, and training after it must be bitwise that of a run
that never offloaded. Jobs run in rank processes (a touched released tensor kills the rank
and fails the test with its exit code).
"""

import pytest
import torch


def _assert_same(reference, offloaded, sections=("params", "optimizer")):
    for section in sections:
        assert reference["snapshot"][section].keys() == offloaded["snapshot"][section].keys()
        for key, value in reference["snapshot"][section].items():
            assert torch.equal(value, offloaded["snapshot"][section][key]), (section, key)


# ------------------------------------------------------------------ the README example
def _readme_world():
    """What the README's snippet takes as given: ``model_chunks`` (a bf16 Megatron model
    wrapped in DDP for the distributed optimizer), ``data``, ``forward_backward`` and
    ``generate``, built the way megatron.training builds them."""
    from functools import partial

    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from tests.harness import models

    spec = models.HarnessSpec(
        model="mlp",
        dtype="bf16",
        seq_length=16,
        micro_batch_size=2,
        hidden=64,
        vocab_size=128,
        data_seed=0,
    )
    config = models._transformer_config("mlp", "bf16", 2, 64, 4)
    module = Float16Module(config, models._build_module(spec, config))
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True
    )
    model_chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)]
    config.finalize_model_grads_func = finalize_model_grads  # as megatron.training sets it

    def data_for(steps):
        return [models._micro_batch(spec, step, 0) for step in steps]

    def forward_backward(batch):
        for chunk in model_chunks:
            chunk.zero_grad_buffer()  # Megatron's train_step does this beside zero_grad()
        return get_forward_backward_func()(
            forward_step_func=partial(models._forward_step, spec),
            data_iterator=iter([batch]),
            model=model_chunks,
            num_microbatches=1,
            seq_length=spec.seq_length,
            micro_batch_size=spec.micro_batch_size,
            forward_only=False,
        )

    def generate(chunks):  # stands for a rollout: inference with the current weights
        batch = models._micro_batch(spec, 1000, 0)
        with torch.no_grad():
            return chunks[0](batch["inputs"], batch["targets"]).float().sum().item()

    return model_chunks, data_for, forward_backward, generate


def readme_example_job(offload):
    import contextlib
    import io

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_offload
    from tests.harness import models

    model_chunks, data_for, forward_backward, generate = _readme_world()
    data = data_for(range(3))
    losses_seen = []

    # ---- README.md, "Quick start 1: your own training loop", call for call ----
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True, lr=1e-4),
        model_chunks,
    )
    if offload:
        offloader = megatron_offload.attach(optimizer)  # attach to what the loop steps

    printed = io.StringIO()
    for batch in data:
        optimizer.zero_grad()
        losses = forward_backward(batch)  # the states are not on the device here
        optimizer.step()  # reloads (asynchronously), updates, offloads again
        if offload:
            with contextlib.redirect_stdout(printed):
                print(offloader.summary())
        losses_seen.append([float(x["lm loss"][0]) for x in losses])

    if offload:
        with offloader.offloaded():  # free them outside the step cycle too (an RL rollout)
            rollouts = generate(model_chunks)
    else:
        rollouts = generate(model_chunks)

    if offload:
        offloaded_at_detach = offloader.is_offloaded
        offloader.detach()  # optional: a plain optimizer again
    # ---- end of the README's snippet ----

    distrib = models.distributed_optimizers(optimizer)[0]
    plain = {
        "state_type": type(distrib.optimizer.state).__name__,
        "step_restored": "step" not in vars(optimizer),
        "offloader_gone": getattr(distrib, "_state_offloader", None) is None,
        "all_resident": all(
            t.untyped_storage().nbytes() > 0
            for s in distrib.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ),
    }
    # Training goes on with the plain optimizer.
    for batch in data_for(range(3, 5)):
        optimizer.zero_grad()
        losses = forward_backward(batch)
        optimizer.step()
        losses_seen.append([float(x["lm loss"][0]) for x in losses])
    return {
        "losses": losses_seen,
        "rollouts": rollouts,
        "printed": printed.getvalue(),
        "plain": plain,
        "offloaded_at_detach": offloaded_at_detach if offload else None,
        "snapshot": models.snapshot(model_chunks, optimizer),
    }


@pytest.mark.floor
def test_the_readme_example_runs_as_written_and_detach_leaves_a_plain_optimizer(rank_pool):
    reference = rank_pool.run(readme_example_job, False)
    offloaded = rank_pool.run(readme_example_job, True)
    for ref, off in zip(reference, offloaded):
        assert off["losses"] == ref["losses"] and len(off["losses"]) == 5
        assert off["rollouts"] == ref["rollouts"]
        _assert_same(ref, off)
        # detach() ran right after the step cycle had offloaded the states.
        assert off["offloaded_at_detach"] is True
        printed = off["printed"].splitlines()
        assert len(printed) == 3 and all(line.startswith("offloaded ") for line in printed)
        assert printed[-1].endswith("| 3 cycles") and "last D2H" in printed[-1]
        assert (
            off["plain"]
            == ref["plain"]
            == {
                "state_type": "defaultdict",
                "step_restored": True,
                "offloader_gone": True,
                "all_resident": True,
            }
        )


# ------------------------------------------------------------------ detach while offloaded
def detach_job(offload, where="after-step", checked=False, options=None):
    """Train, detach in the state ``where`` names, train on with the plain optimizer."""
    import collections

    import megatron_offload
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    chunks, optimizer, config = models.build("mlp", "bf16")
    distrib = models.distributed_optimizers(optimizer)[0]
    options, devices = checked_device_options(options) if checked else (dict(options or {}), [])
    original_state = distrib.optimizer.state
    offloader = megatron_offload.attach(optimizer, **options) if offload else None
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    seen = {}
    if offloader:
        seen["offloaded_before"] = offloader.is_offloaded
        if where == "after-step":
            offloader.detach()
        elif where == "inside-block":  # the block's exit then leaves everything alone
            with offloader.offloaded(offload_master_weights=True):
                offloader.detach()
        elif where == "after-explicit-offload":
            offloader.reload()
            offloader.wait()
            offloader.offload(offload_optimizer_states=False, offload_master_weights=True)
            offloader.detach()
        elif where == "reloading":  # a copy-back started and not waited for
            offloader.reload()
            offloader.detach()
        seen["offloaded_after"] = offloader.is_offloaded
        seen["detached"] = offloader.detached
        seen["stats_after"] = {k: offloader.stats()[k] for k in ("host_bytes", "tracked_bytes")}
        seen["state_restored"] = (
            type(distrib.optimizer.state) is collections.defaultdict
            and distrib.optimizer.state is original_state
        )
        seen["all_resident"] = all(
            t.untyped_storage().nbytes() > 0
            for s in distrib.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        seen["masters_resident"] = all(
            m.untyped_storage().nbytes() > 0
            for g in distrib.shard_fp32_from_float16_groups
            for m in g
        )
    for step in range(2, 5):
        results.append(models.train_step(chunks, optimizer, config, step))
    if offloader:
        seen["stays_resident"] = not offloader.is_offloaded
    check_devices(devices)
    return {"results": results, "seen": seen, "snapshot": models.snapshot(chunks, optimizer)}


@pytest.mark.parametrize(
    "where,checked,options",
    [
        ("after-step", True, None),
        ("inside-block", False, None),
        ("after-explicit-offload", False, None),
        ("reloading", True, None),
        ("after-step", True, {"chunked_update_bytes": 1 << 17}),
    ],
    ids=[
        "after-step-checked",
        "inside-block",
        "after-explicit-offload",
        "reloading-checked",
        "chunked-update-checked",
    ],
)
def test_detach_while_offloaded_brings_states_back_and_training_goes_on_bitwise(
    rank_pool, where, checked, options
):
    reference = rank_pool.run(detach_job, False)
    detached = rank_pool.run(detach_job, True, where, checked, options)
    for ref, off in zip(reference, detached):
        assert off["results"] == ref["results"]
        _assert_same(ref, off)
        seen = off["seen"]
        assert seen["offloaded_before"]  # the step cycle offloaded after each step
        assert seen["detached"] and not seen["offloaded_after"]
        assert seen["stats_after"] == {
            "host_bytes": 0,
            "tracked_bytes": 0,
        }  # host memory given back
        assert seen["state_restored"] and seen["all_resident"] and seen["masters_resident"]
        assert seen["stays_resident"]  # the plain optimizer's steps offload nothing
