"""The RL worker sketches (examples/rl/) where they run: on the frameworks' stand-ins
(tests/harness/doubles/rl_frameworks.py, registered under verl's and NeMo-RL's module names), on real
megatron-core (2 gloo ranks). Every tracked byte is on the host at every phase outside a
step, and training is bitwise that of the same worker without the sketch."""

import importlib.util

import pytest
import torch

from tests.harness.examples import load_example

BUILD = dict(overlap_grad_reduce=True, bucket_size=3000)


def _load(name):
    return load_example(f"rl/{name}.py")


def _offloaded(optimizer):
    import megatron_offload

    offloader = megatron_offload.find_offloader(optimizer)
    if offloader is None:
        return None
    stats = offloader.stats()
    return stats["tracked_bytes"] > 0 and stats["offloaded_bytes"] == stats["tracked_bytes"]


def verl_job(sketch: bool):
    """verl's engine: built through its registry, initialized (optimizer moved out), then
    rounds of generation and train mode (load in, steps, offload out)."""
    from megatron_offload.frameworks import verl as adapter
    from tests.harness import models
    from tests.harness.doubles import rl_frameworks

    names = rl_frameworks.install_real_names()
    try:
        if sketch:
            _load("verl_offload_engine")
        from verl.workers.engine.base import EngineRegistry

        engine = EngineRegistry.new(
            "language_model", "megatron", lambda: models.build("gpt", "bf16", **BUILD)
        )
        engine.initialize()
        phases, losses, step = [("init", _offloaded(engine.optimizer))], [], 0
        for _ in range(2):
            phases.append(("generation", _offloaded(engine.optimizer)))
            with engine.train_mode():
                phases.append(("train mode in", _offloaded(engine.optimizer)))
                for _ in range(2):
                    losses.append(
                        models.train_step(engine.module, engine.optimizer, engine.config, step)[
                            "loss"
                        ]
                    )
                    step += 1
            phases.append(("train mode out", _offloaded(engine.optimizer)))
        summary = engine.offloader.summary() if sketch else None
        if sketch:
            engine.offloader.detach()
        return {
            "phases": phases,
            "losses": losses,
            "summary": summary,
            "snapshot": models.snapshot(engine.module, engine.optimizer),
        }
    finally:
        adapter.uninstall(importlib.import_module("verl.utils.megatron_utils"))
        rl_frameworks.remove_real_names(names)


def nemo_rl_job(sketch: bool):
    """NeMo-RL's worker, built as its worker extension, through its phases."""
    from megatron_offload.frameworks import nemo_rl as adapter
    from tests.harness import models
    from tests.harness.doubles import rl_frameworks

    names = rl_frameworks.install_real_names()
    try:
        if sketch:
            worker_class = _load("nemo_rl_offload_worker").OffloadingMegatronPolicyWorker
        else:
            from nemo_rl.models.policy.workers.megatron_policy_worker import (
                MegatronPolicyWorker as worker_class,
            )
        chunks, optimizer, config = models.build("gpt", "bf16", **BUILD)
        worker = worker_class(chunks, optimizer, config, models.train_step)
        phases, results = [], []
        for _ in range(2):
            for name in ("prepare_for_lp_inference", "prepare_for_training"):
                getattr(worker, name)()
                phases.append((name, _offloaded(optimizer)))
            results += worker.train(2)
            phases.append(("train", _offloaded(optimizer)))
            worker.offload_before_refit()
            phases.append(("offload_before_refit", _offloaded(optimizer)))
        summary = worker.offloader.summary() if sketch else None
        if sketch:
            worker.offloader.detach()
        return {
            "phases": phases,
            "losses": [r["loss"] for r in results],
            "summary": summary,
            "snapshot": models.snapshot(chunks, optimizer),
        }
    finally:
        worker_module = importlib.import_module(
            "nemo_rl.models.policy.workers.megatron_policy_worker"
        )
        adapter.uninstall(worker_module.MegatronPolicyWorker)
        rl_frameworks.remove_real_names(names)


import importlib  # noqa: E402  (used inside the jobs' finally blocks)


@pytest.mark.parametrize("framework", ["verl", "nemo_rl"])
def test_the_worker_sketch_offloads_at_every_phase_and_trains_bitwise(rank_pool, framework):
    job = verl_job if framework == "verl" else nemo_rl_job
    plain = rank_pool.run(job, False)
    sketched = rank_pool.run(job, True)
    for reference, run in zip(plain, sketched):
        assert all(state is None for _, state in reference["phases"])  # nothing attached there
        first = 1 if framework == "nemo_rl" else 0  # NeMo-RL's first phase precedes any step
        assert [name for name, state in run["phases"][first:] if state is not True] == [], run[
            "phases"
        ]
        assert run["losses"] == reference["losses"]
        for section in ("params", "optimizer"):
            a, b = reference["snapshot"][section], run["snapshot"][section]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), section
        assert run["summary"].startswith("offloaded ") and "| 4 cycles" in run["summary"]
