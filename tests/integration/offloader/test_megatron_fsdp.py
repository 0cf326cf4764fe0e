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

FSDP = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"}
STEPS = 4


def _groups(chunks):
    """Megatron-FSDP's parameter groups, over every model chunk."""
    return [g for chunk in chunks for g in chunk.module.param_and_grad_buffer.parameter_groups]


def _local(tensor):
    return getattr(tensor, "_local_tensor", tensor)


def _inner(optimizer):
    from tests.harness import models

    (wrapper,) = models.megatron_optimizers(optimizer)
    return wrapper.optimizer


def _held_bytes(chunks, optimizer) -> int:
    """Bytes the raw storages of the master buffers and of the states' local tensors hold,
    each storage once (read without the state mapping's accessors)."""
    inner = _inner(optimizer)
    tensors = [g.main_weight_buffer.data for g in _groups(chunks) if g.main_weight_buffer]
    tensors += [
        _local(value)
        for entries in dict.values(inner.state)
        for value in dict.values(entries)
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _snapshot(chunks, optimizer) -> dict:
    inner = _inner(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    optimizer_side = {f"master {i}": _local(p).detach().clone() for i, p in enumerate(params)}
    for i, param in enumerate(params):
        for key, value in sorted(dict.get(inner.state, param, {}).items()):
            if isinstance(value, torch.Tensor):
                optimizer_side[f"state {i} {key}"] = _local(value).detach().clone()
    # Each parameter's shard of the bf16 weights (the buffers' padding is never written).
    model_side = {
        f"model weights {g} {i}": group.model_weight_buffer.get_item(i, only_shard=True).clone()
        for g, group in enumerate(_groups(chunks))
        if group.model_weight_buffer is not None
        for i in range(len(group.params))
    }
    return {"params": model_side, "optimizer": optimizer_side}


def fsdp_job(offload: bool, *, steps=STEPS, options=None, moe=False, checked=False):
    import megatron_offload
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    overrides = dict(models.MOE) if moe else None
    chunks, optimizer, config = models.build(
        "gpt", "bf16", ddp_overrides=FSDP, transformer_overrides=overrides
    )
    devices = []
    if checked:
        options, devices = checked_device_options(options)
    offloader = megatron_offload.attach(optimizer, **(options or {})) if offload else None
    results, held, figures = [], [], []
    for step in range(steps):
        results.append(models.train_step(chunks, optimizer, config, step))
        held.append(_held_bytes(chunks, optimizer))
        if offloader is not None:
            stats = offloader.stats()
            figures.append({k: stats[k] for k in ("tracked_bytes", "offloaded_bytes")})
    if offloader is not None:
        offloader.reload()
        offloader.wait()
    shards = [
        tuple(_local(p).shape) for group in _inner(optimizer).param_groups for p in group["params"]
    ]
    out = {
        "results": results,
        "held": held,
        "figures": figures,
        "shards": shards,
        "snapshot": _snapshot(chunks, optimizer),
        "checked_calls": [dict(d.calls) for d in devices],
    }
    check_devices(devices)
    return out


def _assert_offloaded_between_steps(reference, offloaded):
    for ref, off in zip(reference, offloaded):
        assert all(nbytes > 0 for nbytes in ref["held"]), ref["held"]  # the measure sees them
        assert off["held"] == [0] * len(off["held"]), off["held"]
        assert all(f["offloaded_bytes"] == f["tracked_bytes"] > 0 for f in off["figures"])


@pytest.mark.parametrize("prefetch", [None, "step"], ids=["prefetch-gradients", "prefetch-step"])
def test_offloaded_under_megatron_fsdp_trains_bitwise_with_nothing_held(rank_pool, prefetch):
    options = {"prefetch": prefetch} if prefetch else None
    reference = rank_pool.run(fsdp_job, False)
    offloaded = rank_pool.run(fsdp_job, True, options=options)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)
    # Uneven shards, and a rank holding an empty shard of some parameter: both served.
    shards = [rank["shards"] for rank in reference]
    assert shards[0] != shards[1]
    assert any(0 in shape for rank in shards for shape in rank), shards


def test_four_ranks_bitwise_with_nothing_held(rank_pool4):
    reference = rank_pool4.run(fsdp_job, False, steps=3)
    offloaded = rank_pool4.run(fsdp_job, True, steps=3)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)


def test_every_copy_ordered_under_the_checked_stream_model(rank_pool):
    """Side streams deferred, memory poisoned until its copy ran: a missing wait raises or
    changes the comparison."""
    reference = rank_pool.run(fsdp_job, False, steps=3)
    offloaded = rank_pool.run(fsdp_job, True, steps=3, checked=True)
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        (calls,) = rank["checked_calls"]
        assert calls["use-after-h2d"] > 0 and calls["d2h-after-writers"] > 0, calls


def test_mixture_of_experts_with_expert_parallelism_bitwise(rank_pool):
    """One optimizer holds the dense and the expert parameters (their own parameter groups
    and master buffers, sharded over the expert data-parallel group)."""
    reference = rank_pool.run(fsdp_job, False, steps=3, moe=True, ep=2)
    offloaded = rank_pool.run(fsdp_job, True, steps=3, moe=True, ep=2)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(reference, offloaded)


def _tensors(state_dict) -> dict:
    """Copies of the local shards of a module state dict's tensors (extra states left out)."""
    return {
        k: _local(v).detach().clone() for k, v in state_dict.items() if isinstance(v, torch.Tensor)
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
            _local(current[key]).copy_(value)
    chunks[0].load_state_dict(current)
    results.append(models.train_step(chunks, optimizer, config, 3))
    out = {"results": results, "read": read, "offloaded_after_read": offloaded_after_read}
    if offloader is not None:
        out["offloaded_at_end"] = offloader.is_offloaded
        offloader.reload()
        offloader.wait()
    out["snapshot"] = _snapshot(chunks, optimizer)
    return out


def test_the_modules_state_dict_reads_and_loads_the_masters_while_offloaded(rank_pool):
    reference = rank_pool.run(model_state_job, False)
    offloaded = rank_pool.run(model_state_job, True)
    assert_bitwise_equal(reference, offloaded)
    for ref, off in zip(reference, offloaded):
        assert ref["read"].keys() == off["read"].keys() and ref["read"]
        assert all(torch.equal(ref["read"][k], off["read"][k]) for k in ref["read"])
        # The read brought them back; the step after it offloaded them again.
        assert off["offloaded_after_read"] is False and off["offloaded_at_end"] is True


def refusal_job(what: str):
    """Under Megatron-FSDP, what stays refused is refused before anything is touched: the
    run goes on bitwise as one that never tried."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    results = [models.train_step(chunks, optimizer, config, 0)]
    refused = None
    if what == "chunked":
        try:
            megatron_offload.attach(optimizer, chunked_update_bytes=1 << 20)
        except megatron_offload.OffloadArgumentError as error:
            refused = str(error)
        attached = megatron_offload.find_offloader(optimizer) is not None
    elif what == "sleep":
        offloader = megatron_offload.attach(optimizer)
        results.append(models.train_step(chunks, optimizer, config, 1))
        before = _held_bytes(chunks, optimizer)
        try:
            offloader.sleep()
        except megatron_offload.OffloadArgumentError as error:
            refused = str(error)
        attached = before == _held_bytes(chunks, optimizer) == 0  # nothing moved
    results.append(models.train_step(chunks, optimizer, config, len(results)))
    if what == "sleep":
        offloader.reload()
        offloader.wait()
    return {
        "results": results,
        "refused": refused,
        "attached": attached,
        "snapshot": _snapshot(chunks, optimizer),
    }


@pytest.mark.parametrize("what", ["chunked", "sleep"])
def test_what_stays_refused_under_megatron_fsdp_touches_nothing(rank_pool, what):
    reference = rank_pool.run(fsdp_job, False, steps=3 if what == "sleep" else 2)
    tried = rank_pool.run(refusal_job, what)
    for ref, run in zip(reference, tried):
        assert "Megatron-FSDP" in run["refused"] and "yet" in run["refused"], run["refused"]
        # chunked: no offloader was left attached; sleep: the offloaded states did not move.
        assert run["attached"] is (what == "sleep")
    assert_bitwise_equal(reference, tried)


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
        "held": _held_bytes(chunks, optimizer),
    }


def test_detach_takes_the_module_hooks_away(rank_pool):
    for rank in rank_pool.run(detach_job):
        assert rank["listed"] == [
            "MegatronFSDP.state_dict (pre-hook)",
            "MegatronFSDP.load_state_dict (pre-hook)",
        ], rank
        assert rank["after_detach"] == [] and rank["hooks_back"], rank
        assert rank["held"] > 0  # detach brought the states and masters back


# ------------------------------------------------------------------ fsdp_dtensor checkpoints
SAVE_AFTER, CHECKPOINT_STEPS = 2, 4
SWIGLU = {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu}


def _adam_states_for_every_parameter(optimizer) -> None:
    """torch's Adam gives no state to a parameter whose shard on this rank is empty (it never
    gets a gradient), so ranks would hold different state keys and the fsdp_dtensor save's
    metadata gather would wait forever; Transformer Engine's FusedAdam makes every state at its
    first step. The fresh state Adam would make, before the first step: training is unchanged."""
    inner = _inner(optimizer)
    for group in inner.param_groups:
        for param in group["params"]:
            inner.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }


def _fsdp_dtensor_state(chunks, optimizer, glu: bool, is_loading: bool = False):
    """The state dict megatron.training saves in the fsdp_dtensor format, as it builds it."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict

    raw = {"model": chunks[0].state_dict()}
    raw["optimizer"] = optimizer.sharded_state_dict(
        raw, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"}
    )
    state = dict(raw)
    if glu:
        state["model"], state["optimizer"] = handle_swiglu_in_state_dict(
            chunks[0], state["model"], state["optimizer"]
        )
    preprocess_state_dict_for_uneven_dtensor(state)
    return raw, state


def _build(offload: bool, glu: bool):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build(
        "gpt", "bf16", ddp_overrides=FSDP, transformer_overrides=SWIGLU if glu else None
    )
    _adam_states_for_every_parameter(optimizer)
    offloader = megatron_offload.attach(optimizer) if offload else None
    return chunks, optimizer, config, offloader


def _final(chunks, optimizer, offloader) -> dict:
    offloaded = offloader.is_offloaded if offloader is not None else None
    if offloader is not None:
        offloader.reload()
        offloader.wait()
    return {"snapshot": _snapshot(chunks, optimizer), "offloaded": offloaded}


def fsdp_checkpoint_job(offload: bool, directory: str, glu: bool):
    """Save (fsdp_dtensor, torch DCP) after SAVE_AFTER steps, while offloaded, and train on;
    then a fresh model and optimizer (offloaded before the load, as a restarted job) load it
    and train the rest. Each phase is compared with the same phase without offloading."""
    from torch.distributed import checkpoint as dcp

    from tests.harness import models
    from tests.harness.checkpoints import shared_directory

    where = shared_directory(directory)
    chunks, optimizer, config, offloader = _build(offload, glu)
    first = [models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER)]
    held_at_save = _held_bytes(chunks, optimizer)
    _, state = _fsdp_dtensor_state(chunks, optimizer, glu)
    dcp.save(state, checkpoint_id=where)
    del state
    rest = [
        models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER, CHECKPOINT_STEPS)
    ]
    uninterrupted = {"results": first + rest, **_final(chunks, optimizer, offloader)}

    chunks, optimizer, config, offloader = _build(offload, glu)
    if offloader is not None:
        offloader.offload()
    raw, state = _fsdp_dtensor_state(chunks, optimizer, glu, is_loading=True)
    dcp.load(state, checkpoint_id=where)
    chunks[0].load_state_dict(raw["model"], strict=False)
    optimizer.load_state_dict(raw["optimizer"])
    del raw, state
    resumed = [
        models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER, CHECKPOINT_STEPS)
    ]
    return {
        "uninterrupted": uninterrupted,
        "resumed": {"results": first + resumed, **_final(chunks, optimizer, offloader)},
        "held_at_save": held_at_save,
    }


# Gated linear units (SwiGLU) are not run here: megatron-core's handle_swiglu_in_state_dict
# looks the parameters up under the model nesting megatron.training builds, and the harness
# model has a Float16Module between (AttributeError: Float16Module has no attribute `decoder`).
def test_fsdp_dtensor_save_and_load_while_offloaded_are_bitwise_those_without(tmp_path):
    glu = False
    from tests.harness.rank_pool import RankPool

    runs = []
    for offload in (False, True):
        # A pool of its own per run: the save's mesh lookups fail on a rank process where an
        # earlier job's process groups were destroyed ("Could not resolve the process group").
        with RankPool(2) as pool:
            runs.append(pool.run(fsdp_checkpoint_job, offload, str(tmp_path / str(offload)), glu))
    reference, offloaded = runs
    for phase in ("uninterrupted", "resumed"):
        assert_bitwise_equal([r[phase] for r in reference], [r[phase] for r in offloaded])
    # Not asserted: that the resumed run continues as the uninterrupted one. With this load
    # sequence it does not, offloading or not (the losses after the load differ in the third
    # digit); megatron.training's load_checkpoint is what a resume test must follow.
    for ref, off in zip(reference, offloaded):
        assert off["held_at_save"] == 0 and ref["held_at_save"] > 0
        assert off["uninterrupted"]["offloaded"] and off["resumed"]["offloaded"]
