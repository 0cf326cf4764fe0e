"""NeMo-RL's and verl's phase orders replayed on real megatron-core (2 gloo ranks), through
the adapters (``megatron_offload.frameworks``), against the same phases without offloading.

The frameworks' own optimizer moves are stand-ins (``tests/harness/doubles/rl_frameworks.py`` says
why and what they reproduce). Asserted at every phase: the bytes offloaded (every tracked
state byte, from the first offload on: the states come back only inside each step); and at
the end, training bitwise equal to the run without offloading. Negative control: without
the adapters, the frameworks' moves read and rewrite the states of an attached offloader.
"""

from __future__ import annotations

import pytest

from tests.harness.compare import assert_bitwise_equal

BUILD = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000)


def _figures(offloader, chunks=()):
    model = {"parameters": 0, "gradients": 0}
    for chunk in chunks:
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            model["parameters"] += buffer.param_data.untyped_storage().nbytes()
            model["gradients"] += buffer.grad_data.untyped_storage().nbytes()
    if offloader is None:
        return model
    stats = offloader.stats()
    return {
        "offloaded": stats["offloaded_bytes"],
        "tracked": stats["tracked_bytes"],
        "sleeps": stats["sleeps"],
        "rebuilt": stats["rebuilt_parameter_bytes"],
        **model,
    }


def _save(directory):
    def save(model_chunks, optimizer):
        import os

        from megatron.core import dist_checkpointing

        os.makedirs(directory, exist_ok=True)

        model = model_chunks[0].sharded_state_dict()
        sharded = optimizer.sharded_state_dict(
            model, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
        dist_checkpointing.save({"model": model, "optimizer": sharded}, directory)

    return save


def nemo_rl_job(mode: str, directory: str):
    """NeMo-RL's order: prepare_for_training before anything was offloaded, then per rollout
    log-prob preparation, prepare_for_training, train, offload_before_refit,
    offload_after_refit; a checkpoint save at the end."""
    import megatron_offload
    from megatron_offload.frameworks import nemo_rl
    from tests.harness import models
    from tests.harness.doubles.rl_frameworks import MegatronPolicyWorker
    from tests.harness.fresh_memory import poison_regrowth

    chunks, optimizer, config = models.build("gpt", "bf16", **BUILD)
    offloader = megatron_offload.attach(optimizer) if mode != "reference" else None
    if offloader is not None:
        poison_regrowth(offloader)
    worker = MegatronPolicyWorker(chunks, optimizer, config, models.train_step)
    if mode == "adapted":
        nemo_rl.install(MegatronPolicyWorker)
    phases, results = [], []
    try:
        worker.prepare_for_training()
        phases.append(("prepare_for_training (before the first step)", _figures(offloader)))
        for _ in range(2):
            for name in ("prepare_for_lp_inference", "prepare_for_training"):
                getattr(worker, name)()
                phases.append((name, _figures(offloader, chunks)))
            results += worker.train(2)
            phases.append(("train", _figures(offloader, chunks)))
            for name in ("offload_before_refit", "offload_after_refit"):
                getattr(worker, name)()
                phases.append((name, _figures(offloader, chunks)))
        worker.prepare_for_training()
        worker.save_checkpoint(_save(directory))
        phases.append(("save_checkpoint", _figures(offloader, chunks)))
        results += worker.train(1)
        snapshot = models.final_snapshot(chunks, optimizer, offloader)
        return {"phases": phases, "results": results, "snapshot": snapshot}
    finally:
        nemo_rl.uninstall(MegatronPolicyWorker)


def verl_job(mode: str, directory: str, real: bool = False):
    """verl's order: the engine is built and its optimizer offloaded; per round, generation,
    train mode in (load), training, train mode out (offload); a checkpoint saved while
    offloaded and loaded back (load_checkpoint), then more training. ``real``: verl's own
    ``verl.utils.megatron_utils`` (the ``verl`` environment), else the stand-in."""
    import megatron_offload
    from megatron_offload.frameworks import verl
    from megatron_offload_testing.cpu_megatron import plain_pinning
    from tests.harness import models
    from tests.harness.doubles.rl_frameworks import verl_modules
    from tests.harness.fresh_memory import poison_regrowth
    from tests.integration.access.test_checkpoint_formats import _load

    if real:
        import importlib

        utils = engine = importlib.import_module("verl.utils.megatron_utils")
    else:
        utils, engine = verl_modules()
    chunks, optimizer, config = models.build("gpt", "bf16", **BUILD)
    offloader = megatron_offload.attach(optimizer) if mode != "reference" else None
    if offloader is not None:
        poison_regrowth(offloader)
    if mode == "adapted":
        verl.install(utils)
    phases, results, step = [], [], 0
    try:
        with plain_pinning():  # verl's own moves pin their host copies (not on CPU ranks)
            engine.offload_megatron_model_to_cpu(chunks)  # engine init
        engine.offload_megatron_optimizer(optimizer)
        phases.append(("engine init (offload)", _figures(offloader, chunks)))
        for _ in range(2):
            phases.append(("generation", _figures(offloader, chunks)))
            with plain_pinning():
                engine.load_megatron_model_to_gpu(chunks, load_grad=True)
            engine.load_megatron_optimizer(optimizer)
            phases.append(("train mode in (load)", _figures(offloader, chunks)))
            for _ in range(2):
                results.append(models.train_step(chunks, optimizer, config, step))
                step += 1
            phases.append(("train", _figures(offloader, chunks)))
            with plain_pinning():
                utils.offload_megatron_model_to_cpu(chunks)
            utils.offload_megatron_optimizer(optimizer)
            phases.append(("train mode out (offload)", _figures(offloader, chunks)))
        with plain_pinning():
            utils.load_megatron_model_to_gpu(chunks)
        models.flush_param_gather(chunks)
        _save(directory)(chunks, optimizer)
        results.append(
            models.train_step(chunks, optimizer, config, step)
        )  # moves past the checkpoint
        step += 1
        engine.offload_megatron_optimizer(optimizer)
        _load(chunks, optimizer, directory, "dp_reshardable")  # as the checkpoint tests load
        phases.append(("load_checkpoint", _figures(offloader)))
        engine.load_megatron_optimizer(optimizer)
        for _ in range(2):
            results.append(models.train_step(chunks, optimizer, config, step))
            step += 1
        snapshot = models.final_snapshot(chunks, optimizer, offloader)
        return {"phases": phases, "results": results, "snapshot": snapshot}
    finally:
        verl.uninstall(utils)


_MODEL_OUT = ("offload_after_refit", "engine init (offload)", "train mode out (offload)")


def _all_offloaded(rank):
    return [
        (name, f)
        for name, f in rank["phases"]
        if not (f["tracked"] > 0 and f["offloaded"] == f["tracked"])
    ]


@pytest.fixture(scope="module")
def shared_dir(rank_pool, tmp_path_factory):
    return str(tmp_path_factory.mktemp("rl-phases"))


@pytest.mark.parametrize("framework", ["nemo_rl", "verl"])
def test_phases_through_the_adapter_keep_the_states_offloaded_and_train_bitwise(
    rank_pool, shared_dir, framework
):
    job = nemo_rl_job if framework == "nemo_rl" else verl_job
    reference = rank_pool.run(job, "reference", f"{shared_dir}/{framework}-reference")
    adapted = rank_pool.run(job, "adapted", f"{shared_dir}/{framework}-adapted")
    assert_bitwise_equal(reference, adapted)
    for rank in adapted:
        # Every phase, the first included (the masters attach sent out stay out through
        # NeMo-RL's prepare_for_training before the first step).
        assert _all_offloaded(rank) == [], rank["phases"]
        # The model moves slept and woke: nothing of the model on the device after them, and
        # the parameters made again from the masters rather than copied.
        asleep = [f for name, f in rank["phases"] if name in _MODEL_OUT]
        assert asleep and all(f["parameters"] == f["gradients"] == 0 for f in asleep)
        assert rank["phases"][-1][1]["sleeps"] >= 2
        assert any(f.get("rebuilt") for _, f in rank["phases"]), rank["phases"]


def test_without_the_adapter_their_moves_undo_ours(rank_pool, shared_dir):
    """Negative control. NeMo-RL: its "cpu" move walks the state mapping and rewrites every
    entry, which brings the states and fp32 masters back to the device (every tracked byte)
    until the next step. verl: its offload at engine init walks the state mapping too, which
    brings back the masters attach sent out (before the first step, the only tensors). What
    each costs: docs/design.md, reads between steps."""
    nemo = rank_pool.run(nemo_rl_job, "unadapted", f"{shared_dir}/nemo_rl-unadapted")
    for rank in nemo:
        # Its own model moves: megatron-core's buffer copies, no sleep.
        assert all(f["sleeps"] == 0 for name, f in rank["phases"]), rank["phases"]
        refit = [f for name, f in rank["phases"] if name == "offload_before_refit"]
        assert refit and all(0 == f["offloaded"] < f["tracked"] for f in refit), rank["phases"]
    verl_run = rank_pool.run(verl_job, "unadapted", f"{shared_dir}/verl-unadapted")
    for rank in verl_run:
        assert all(f["sleeps"] == 0 for name, f in rank["phases"]), rank["phases"]
        name, init = rank["phases"][0]
        assert name == "engine init (offload)" and init["offloaded"] == 0 < init["tracked"]
