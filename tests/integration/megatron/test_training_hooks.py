"""The megatron.training hooks driving a real DistributedOptimizer on the gloo ranks: bitwise equal training, the reload inside the gradient finalization, residency around a checkpoint."""

from __future__ import annotations

from megatron_offload.megatron import training as hooks
from tests.harness.training_args import offload_args


# ---------------------------------------------------------------- a real optimizer (rank pool)
def hooks_job(offload: bool, steps: int = 3):
    """Train the harness GPT (bf16) with the training-loop helpers, as pretrain() would."""
    from megatron.core.distributed import finalize_model_grads

    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    args = offload_args(offload_optimizer_states=offload)
    offloader = hooks.attach_for_training(optimizer, args)
    trace = []
    if offloader is not None:
        config.finalize_model_grads_func = finalize_model_grads
        assert hooks.install_prefetch(config, optimizer, args)
        prefetching = config.finalize_model_grads_func
        inside = []

        def finalize(*a, **k):  # what the schedule calls: marks the gradient finalization
            inside.append(True)
            try:
                return prefetching(*a, **k)
            finally:
                inside.pop()

        config.finalize_model_grads_func = finalize
        prefetch = offloader.prefetch

        def traced_prefetch():  # the prefetches that have something to reload
            if offloader.is_offloaded:
                trace.append("in finalize" if inside else "elsewhere")
            return prefetch()

        offloader.prefetch = traced_prefetch
    results = [models.train_step(chunks, optimizer, config, step) for step in range(steps)]
    report = {"results": results, "trace": list(trace)}
    if offloader is not None:
        copies = []
        for engine in offloader.engines:  # every copy the offloader makes goes through its device
            engine.device.copy = lambda dst, src, _copy=engine.device.copy: (
                copies.append(1),
                _copy(dst, src),
            )
        with hooks.checkpoint_residency(optimizer, read_only=True):
            report["served_inside"] = offloader.is_offloaded  # served from the host copy
            optimizer.sharded_state_dict(
                chunks[0].sharded_state_dict(),
                metadata={"distrib_optim_sharding_type": "dp_reshardable"},
            )
        for engine in offloader.engines:
            del engine.device.copy
        report["copies_for_save"] = len(copies)
        report["offloaded_after"] = offloader.is_offloaded
        with hooks.master_weights_residency():
            # The params norm reads the fp32 masters only: they are back, the moments are not.
            dopts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
            masters = [
                m
                for d in dopts
                for g in d.shard_fp32_from_float16_groups
                for m in g
                if m is not None
            ]
            moments = [
                v
                for d in dopts
                for state in dict.values(d.optimizer.state)
                for k, v in state.items()
                if k in ("exp_avg", "exp_avg_sq")
            ]
            report["masters_inside"] = bool(masters) and all(
                m.untyped_storage().size() > 0 for m in masters
            )
            report["moments_released_inside"] = bool(moments) and all(
                v.untyped_storage().size() == 0 for v in moments
            )
        printed = []
        report["figures"] = hooks.log_offload_stats(steps, offloader, printer=printed.append)
        report["printed"] = printed
        report["own_offloaded_bytes"] = offloader.stats()["offloaded_bytes"]
        offloader.reload()
        offloader.wait()
        offloader.detach()
    return report


def test_hooks_on_a_real_distributed_optimizer(rank_pool):
    reference = rank_pool.run(hooks_job, False)
    offloaded = rank_pool.run(hooks_job, True)
    for ref, off in zip(reference, offloaded):
        assert ref["results"] == off["results"]  # bitwise: loss and grad norm per step
        # Every step reloads inside finalize, the first included (the masters attach sent out).
        assert off["trace"] == ["in finalize", "in finalize", "in finalize"]
        assert off["served_inside"] and off["offloaded_after"] and off["masters_inside"]
        assert off["moments_released_inside"]
        assert off["copies_for_save"] == 0  # read from the host copy: nothing copied either way
        assert len(off["printed"]) == 1 and "(max over 2 ranks; GB/s: min)" in off["printed"][0]
    most = max(rank["own_offloaded_bytes"] for rank in offloaded)
    assert all(rank["figures"]["offloaded_gib"] == most / (1 << 30) for rank in offloaded)
    assert offloaded[0]["printed"] == offloaded[1]["printed"]
