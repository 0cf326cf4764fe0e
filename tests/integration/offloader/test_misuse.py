"""Misuse gets a clear Python error (never a crash), and nothing is touched before it."""

import torch

import megatron_offload


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc)
    return None


def misuse_job():
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    found = {}
    found["not_distributed"] = _error(
        lambda: megatron_offload.attach(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
    )
    found["unknown_option"] = _error(
        lambda: megatron_offload.attach(optimizer, offload_moments=True)
    )
    found["bad_option_type"] = _error(
        lambda: megatron_offload.attach(optimizer, offload_master_weights="yes")
    )
    distrib = (
        optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    )
    distrib.config.optimizer_cpu_offload = True
    found["cpu_offload"] = _error(lambda: megatron_offload.attach(optimizer))
    found["untouched_after_refusal"] = getattr(distrib, "_state_offloader", None) is None
    distrib.config.optimizer_cpu_offload = False

    offloader = megatron_offload.attach(optimizer)
    found["reachable_as_state_offloader"] = distrib._state_offloader is offloader
    found["second_attach"] = _error(lambda: megatron_offload.attach(optimizer))
    found["second_attach_inner"] = _error(lambda: megatron_offload.OptimizerStateOffloader(distrib))
    # RL frameworks call their "to the device" phase unconditionally: once the masters attach
    # sent out are back, a reload with nothing offloaded does nothing.
    offloader.reload()
    offloader.wait()
    copies = offloader.stats()["h2d_copies"]
    found["reload_before_offload"] = (
        _error(offloader.reload),
        _error(offloader.wait),
        offloader.is_offloaded,
        offloader.stats()["h2d_copies"] - copies,
    )
    found["found_by_framework"] = megatron_offload.find_offloader(optimizer) is offloader
    models.train_step(chunks, optimizer, config, 0)  # the step offloads
    found["offloaded_after_step"] = offloader.is_offloaded
    offloader.detach()  # while offloaded: the states come back first
    found["detached"] = "_state_offloader" not in vars(distrib) and "step" not in vars(optimizer)
    found["use_after_detach"] = _error(offloader.offload)
    found["reload_after_detach"] = _error(offloader.reload)
    found["block_after_detach"] = _error(lambda: offloader.offloaded().__enter__())
    # After detach the optimizer is a plain optimizer again: a step leaves states resident.
    models.train_step(chunks, optimizer, config, 1)
    found["resident_after_detached_step"] = all(
        t.untyped_storage().nbytes() > 0
        for s in distrib.optimizer.state.values()
        for t in s.values()
    )
    # And a new offloader can be attached.
    again = megatron_offload.attach(optimizer)
    models.train_step(chunks, optimizer, config, 2)
    found["reattached_offloads"] = again.is_offloaded
    again.detach()
    # The attribute as Megatron-LM's own offloader leaves it (None) is put back as it was; one
    # that someone else set after attach is left to them.
    distrib._state_offloader = None
    megatron_offload.attach(optimizer).detach()
    found["none_put_back"] = (
        "_state_offloader" in vars(distrib) and distrib._state_offloader is None
    )
    third = megatron_offload.attach(optimizer)
    distrib._state_offloader = "theirs"
    third.detach()
    found["theirs_left"] = distrib._state_offloader == "theirs"
    del distrib._state_offloader
    return found


def more_misuse_job():
    import copy
    import functools

    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    distrib = optimizer.chained_optimizers[0]
    found = {}
    mixed = copy.copy(optimizer)
    mixed.chained_optimizers = [
        distrib,
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
    ]
    found["chained_with_other"] = _error(lambda: megatron_offload.attach(mixed))
    # Refused settings (Megatron-FSDP: its CUDA-graph mode), before anything is touched.
    for flag, obj, fields in (
        ("optimizer_cuda_graph", distrib.config, {"optimizer_cuda_graph": True}),
        (
            "use_megatron_fsdp",
            distrib.ddp_config,
            {"use_megatron_fsdp": True, "megatron_fsdp_cuda_graph_mode": True},
        ),
    ):
        saved = {name: getattr(obj, name) for name in fields}
        for name, value in fields.items():
            setattr(obj, name, value)
        found[flag] = _error(lambda: megatron_offload.attach(optimizer))
        for name, value in saved.items():
            setattr(obj, name, value)

    # Another wrapper already on step / state_dict: attach chains it, detach restores it.
    outer_step = functools.partial(type(optimizer).step, optimizer)
    optimizer.step = outer_step
    outer_state_dict = functools.partial(type(optimizer).state_dict, optimizer)
    optimizer.state_dict = outer_state_dict

    # The upstream call sequence, by hand.
    offloader = megatron_offload.OptimizerStateOffloader(optimizer)
    models.train_step(chunks, optimizer, config, 0)  # not attached: nothing automatic
    found["resident_without_attach"] = not offloader.is_offloaded
    offloader.offload(offload_optimizer_states=True, offload_master_weights=False)
    for name in ("release_gpu_memory", "sync_before_step"):  # the unreleased API's: not offered
        try:
            getattr(offloader, name)()
        except AttributeError as error:
            found[f"{name}_refused"] = str(error)
    found["moments_only"] = (
        offloader.stats()["offloaded_bytes"] * 3 == offloader.stats()["tracked_bytes"] * 2
    )
    offloader.offload()
    offloader.mark_optimizer_states_initialized()
    offloader.reload()
    offloader.wait()
    found["reloaded"] = not offloader.is_offloaded
    offloader.offload()
    offloader.detach()  # while offloaded: the states come back first
    found["detached_while_offloaded"] = offloader.detached and not offloader.is_offloaded
    offloader.detach()  # twice is harmless
    found["restored"] = (
        vars(optimizer).get("step") is outer_step
        and vars(optimizer).get("state_dict") is outer_state_dict
    )
    found["repr"] = repr(offloader)

    attached = megatron_offload.attach(optimizer)
    models.train_step(chunks, optimizer, config, 1)
    found["offloaded"] = attached.is_offloaded
    # A step of the inner optimizer called directly while offloaded reloads by itself.
    for group in distrib.optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p) if p.untyped_storage().nbytes() else None
    distrib.optimizer.step()  # the pre-hook brings the states back before the update
    found["inner_step_reloaded"] = not attached.is_offloaded
    attached.detach()
    found["restored_after_attach"] = vars(optimizer).get("step") is outer_step

    # A refused prefetch option leaves the optimizer untouched (no half-attached state).
    models_of = distrib.model_chunks
    distrib.model_chunks = []
    found["prefetch_without_model"] = _error(
        lambda: megatron_offload.attach(optimizer, prefetch=0.5)
    )
    distrib.model_chunks = models_of
    found["attach_after_refusal"] = _error(
        lambda: megatron_offload.attach(optimizer, prefetch=0.5).detach()
    )
    return found


def test_more_misuse_and_the_upstream_call_sequence(rank_pool):
    found = rank_pool.run(more_misuse_job)[0]
    kind, message = found["chained_with_other"]
    assert kind == "TypeError" and "SGD" in message
    kind, message = found["optimizer_cuda_graph"]
    assert kind == "OffloadArgumentError" and "--optimizer-cuda-graph" in message
    kind, message = found["use_megatron_fsdp"]
    assert kind == "OffloadArgumentError" and "--use-megatron-fsdp" in message
    assert found["resident_without_attach"] and found["moments_only"] and found["reloaded"]
    assert "offload() frees the device memory itself" in found["release_gpu_memory_refused"]
    assert "call wait()" in found["sync_before_step_refused"]
    assert found["detached_while_offloaded"]
    assert found["restored"] and found["repr"].startswith("OptimizerStateOffloader(OffloadEngine(")
    assert found["offloaded"] and found["inner_step_reloaded"] and found["restored_after_attach"]
    kind, message = found["prefetch_without_model"]
    assert kind == "OffloadArgumentError" and 'prefetch="step"' in message
    assert found["attach_after_refusal"] is None


def test_misuse_is_refused_with_clear_messages(rank_pool):
    found = rank_pool.run(misuse_job)[0]
    kind, message = found["not_distributed"]
    assert kind == "TypeError" and "AdamW" in message and "get_megatron_optimizer" in message
    assert all(
        name in message
        for name in ("DistributedOptimizer", "Float16OptimizerWithFloat16Params", "FP32Optimizer")
    )
    kind, message = found["unknown_option"]
    assert (
        kind == "TypeError"
        and "offload_moments" in message
        and "offload_optimizer_states" in message
    )
    kind, message = found["bad_option_type"]
    assert kind == "TypeError" and "offload_master_weights" in message
    kind, message = found["cpu_offload"]
    assert kind == "OffloadArgumentError" and "--optimizer-cpu-offload" in message
    assert found["untouched_after_refusal"]
    assert found["reachable_as_state_offloader"]
    for case in ("second_attach", "second_attach_inner"):
        kind, message = found[case]
        assert (
            kind == "OffloadStateError"
            and "already has a state offloader" in message
            and "detach()" in message
        )
    # reload() with nothing offloaded (again) does nothing: no error, nothing copied.
    assert found["reload_before_offload"] == (None, None, False, 0)
    assert found["found_by_framework"]
    assert found["offloaded_after_step"]
    assert found["detached"]
    for case in ("use_after_detach", "reload_after_detach", "block_after_detach"):
        kind, message = found[case]
        assert kind == "OffloadStateError" and "detached" in message, case
    assert found["resident_after_detached_step"]
    assert found["reattached_offloads"]
    assert found["none_put_back"] and found["theirs_left"]


def graphs_job():
    """prefetch as a fraction of the backward pass with CUDA-graphed layers: refused before
    anything is touched; the same model without graphs attaches."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    distrib = models.distributed_optimizers(optimizer)[0]
    chunks[0].config.cuda_graph_impl = "local"  # what --cuda-graph-impl local sets
    found = {
        "refused": _error(lambda: megatron_offload.attach(optimizer, prefetch=0.5)),
        "untouched": getattr(distrib, "_state_offloader", None) is None
        and "step" not in vars(optimizer),
    }
    offloader = megatron_offload.attach(optimizer)  # "gradients" (the default) works with graphs
    found["step_prefetch_attaches"] = offloader.config.prefetch == "gradients"
    offloader.detach()
    offloader = megatron_offload.attach(optimizer, prefetch="step")  # and "step"
    found["step_prefetch_attaches"] &= offloader.config.prefetch == "step"
    offloader.detach()
    chunks[0].config.cuda_graph_impl = "none"
    offloader = megatron_offload.attach(optimizer, prefetch=0.5)
    found["fraction_without_graphs"] = offloader.config.prefetch == 0.5
    offloader.detach()
    return found


def test_backward_prefetch_is_refused_with_cuda_graphed_layers(rank_pool):
    found = rank_pool.run(graphs_job)[0]
    kind, message = found["refused"]
    assert (
        kind == "OffloadArgumentError"
        and 'prefetch="gradients"' in message
        and "cuda_graph_impl='local'" in message
    )
    assert (
        found["untouched"] and found["step_prefetch_attaches"] and found["fraction_without_graphs"]
    )
