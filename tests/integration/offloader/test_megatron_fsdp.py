"""Megatron-FSDP (``use_megatron_fsdp``, ``optim_grads_params``) on the CPU harness: the
ground for offloading under it (not offloaded yet).

megatron-core's ``FullyShardedDataParallel`` builds and trains a bf16 GPT on two gloo ranks
(the harness gives it the CPU as its device; ``torch.cuda.current_device()`` answers 0 there,
as on a GPU), reproducibly; ``attach`` refuses it before anything is touched, and the run goes
on exactly as one that never tried.
"""

from __future__ import annotations

import torch

FSDP = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"}
STEPS = 3


def fsdp_job(try_attach: bool):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", ddp_overrides=FSDP)
    found = {}
    if try_attach:
        try:
            megatron_offload.attach(optimizer)
        except megatron_offload.OffloadArgumentError as error:
            found["refused"] = str(error)
        found["changed"] = [
            name
            for wrapper in models.megatron_optimizers(optimizer)
            for name in ("step", "state_dict", "_state_offloader")
            if name in vars(wrapper)
        ]
    results = [models.train_step(chunks, optimizer, config, step) for step in range(STEPS)]
    inner = models.megatron_optimizers(optimizer)[0].optimizer
    states = [
        value
        for entries in dict.values(inner.state)
        for value in dict.values(entries)
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    found["states_are_dtensors"] = bool(states) and all(
        type(value).__name__ == "DTensor" for value in states
    )
    snapshot = {
        section: {key: _local(value) for key, value in values.items()}
        for section, values in models.snapshot(chunks, optimizer).items()
    }
    return {**found, "results": results, "snapshot": snapshot}


def _local(value):
    """This rank's shard of a DTensor (parameters and states are), a tensor as it is."""
    to_local = getattr(value, "to_local", None)
    return (to_local() if to_local is not None else value).detach().clone()


def test_megatron_fsdp_trains_on_the_cpu_harness_and_attach_refuses_it_untouched(rank_pool):
    plain = rank_pool.run(fsdp_job, False)
    again = rank_pool.run(fsdp_job, False)
    tried = rank_pool.run(fsdp_job, True)
    for first, second, refused in zip(plain, again, tried):
        assert first["states_are_dtensors"] and all(first["snapshot"].values()), first
        assert all(r["update_successful"] for r in first["results"])
        assert "--use-megatron-fsdp" in refused["refused"] and refused["changed"] == []
        for run in (second, refused):
            assert run["results"] == first["results"]
            # What the optimizer holds. The model's bf16 parameters (views into Megatron-FSDP's
            # buffers), read after the last step, were seen to differ between identical runs
            # in one pytest session (not yet explained; the losses are equal): they are left out
            # here until the offloading work reads them the way Megatron-FSDP means them read.
            for key, value in first["snapshot"]["optimizer"].items():
                assert torch.equal(value, run["snapshot"]["optimizer"][key]), key
