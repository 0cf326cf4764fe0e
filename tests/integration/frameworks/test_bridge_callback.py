"""The Bridge callback's refusals and events on the real optimizer (gloo ranks), without Megatron-Bridge installed."""

from __future__ import annotations

import types

from megatron_offload.frameworks.bridge import OptimizerStateOffloadCallback


class _Recorder:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, step))


def refusal_job():
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", overlap_grad_reduce=True)
    finalize = config.finalize_model_grads_func
    context = types.SimpleNamespace(model=chunks, optimizer=optimizer)
    found = {}
    for flag in ("optimizer_cpu_offload", "optimizer_cuda_graph"):
        for distrib in models.distributed_optimizers(optimizer):
            setattr(distrib.config, flag, True)
        callback = OptimizerStateOffloadCallback()
        try:
            callback.on_train_start(context)
        except ValueError as error:
            found[flag] = str(error)
        # Nothing touched: no offloader, Bridge's hook as it was, and the end event harmless.
        found[f"{flag}_untouched"] = (
            callback.offloader is None
            and config.finalize_model_grads_func is finalize
            and all(
                getattr(d, "_state_offloader", None) is None
                for d in models.distributed_optimizers(optimizer)
            )
        )
        callback.on_train_end(context)
        for distrib in models.distributed_optimizers(optimizer):
            setattr(distrib.config, flag, False)
    # Accepted: attached, the gradient-reduction hook prefetches; a second start is refused;
    # the end gives the hook back and detaches.
    callback = OptimizerStateOffloadCallback()
    callback.on_train_start(context)
    found["wrapped"] = config.finalize_model_grads_func is not finalize
    try:
        callback.on_train_start(context)
    except RuntimeError as error:
        found["twice"] = str(error)
    models.train_step(chunks, optimizer, config, 0)
    offloader = callback.offloader
    stats = offloader.stats()
    found["offloaded_after_step"] = stats["offloaded_bytes"] == stats["tracked_bytes"] > 0
    # A save that had to bring the states back (TE's FP8 moments): offloaded again at once,
    # unless an asynchronous writer that is not megatron-core's own may still read them.
    offloader.reload()
    offloader.wait()
    for strategy in ("nvrx", "mcore"):
        checkpoint = types.SimpleNamespace(async_save=True, async_strategy=strategy)
        save_context = types.SimpleNamespace(
            model=chunks,
            optimizer=optimizer,
            state=types.SimpleNamespace(cfg=types.SimpleNamespace(checkpoint=checkpoint)),
        )
        callback.on_checkpoint_save(save_context)
        stats = offloader.stats()
        found[f"offloaded_after_{strategy}_save"] = (
            stats["offloaded_bytes"] == stats["tracked_bytes"]
        )
    # Events whose context carries no optimizer and no state (a Bridge change moves the
    # checkpoint events there): the state kept from train start decides.
    kept = OptimizerStateOffloadCallback()
    callback.on_train_end(context)
    checkpoint = types.SimpleNamespace(async_save=True, async_strategy="nvrx")
    start = types.SimpleNamespace(
        model=chunks,
        optimizer=optimizer,
        state=types.SimpleNamespace(cfg=types.SimpleNamespace(checkpoint=checkpoint)),
    )
    kept.on_train_start(start)
    models.train_step(chunks, optimizer, config, 1)
    kept.offloader.reload()
    kept.offloader.wait()
    kept.on_checkpoint_save(types.SimpleNamespace())
    found["bare_context_nvrx_kept"] = kept.offloader.stats()["offloaded_bytes"] == 0
    checkpoint.async_strategy = "mcore"
    kept.on_checkpoint_save(types.SimpleNamespace())
    stats = kept.offloader.stats()
    found["bare_context_mcore_offloaded"] = stats["offloaded_bytes"] == stats["tracked_bytes"] > 0
    kept.on_train_end(types.SimpleNamespace())
    callback = OptimizerStateOffloadCallback()
    callback.on_train_start(context)
    # Bridge's writers get the figures at its log interval only.
    recorder = _Recorder()
    state = types.SimpleNamespace(
        cfg=types.SimpleNamespace(logger=types.SimpleNamespace(log_interval=2)),
        train_state=types.SimpleNamespace(step=1),
        tensorboard_logger=recorder,
        wandb_logger=None,
    )
    bridge_context = types.SimpleNamespace(model=chunks, optimizer=optimizer, state=state)
    callback.on_train_step_end(bridge_context)
    state.train_state.step = 2
    callback.on_train_step_end(bridge_context)
    found["logged"] = sorted({step for _, step in recorder.scalars})
    callback.on_train_end(context)
    found["restored"] = config.finalize_model_grads_func is finalize and callback.offloader.detached
    return found


def test_refusals_then_the_events_of_an_accepted_run(rank_pool):
    for found in rank_pool.run(refusal_job):
        assert "optimizer_cpu_offload" in found["optimizer_cpu_offload"]
        assert "optimizer_cuda_graph" in found["optimizer_cuda_graph"]
        assert found["optimizer_cpu_offload_untouched"] and found["optimizer_cuda_graph_untouched"]
        assert found["wrapped"] and "train started twice" in found["twice"] and found["restored"]
        assert found["offloaded_after_step"] and found["offloaded_after_mcore_save"]
        assert not found["offloaded_after_nvrx_save"]
        assert found["logged"] == [2]
        assert found["bare_context_nvrx_kept"] and found["bare_context_mcore_offloaded"]
