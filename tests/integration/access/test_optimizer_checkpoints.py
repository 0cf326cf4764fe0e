"""Checkpoints of the non-distributed, layer-wise and emerging optimizers taken while offloaded.

Saved (megatron-core ``dist_checkpointing``, torch_dist format; or ``state_dict()`` through
``torch.save``) while the states are on the host, then loaded into a fresh model and
optimizer that is offloaded before the load (a restarted job): the resumed run continues
bitwise as the run that never stopped, and both runs are bitwise those without offloading.
"""

import importlib.util
import io

import pytest
import torch

from tests.harness.checkpoints import (
    DeviceWatch,
    all_released,
    apply_loaded,
    assert_phases_equal,
    offloaded_snapshot,
    shared_directory,
    tensors_equal,
)

STEPS, SAVE_AFTER = 5, 3
HAVE_EMERGING = importlib.util.find_spec("emerging_optimizers") is not None
NEEDS_EMERGING = pytest.mark.skipif(
    not HAVE_EMERGING,
    reason="needs the emerging-optimizers package (requirements/py312.txt: emerging-optimizers==0.3.0)",
)


def _sharded(chunks, optimizer, is_loading=False):
    model = chunks[0].sharded_state_dict()
    return {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading)}


def _save(chunks, optimizer, directory, fmt):
    if fmt == "dist":
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(_sharded(chunks, optimizer), directory)
        return None
    buffer = io.BytesIO()
    if hasattr(optimizer, "save_state_dict_to_file"):
        # LayerWiseDistributedOptimizer's torch format (megatron.training's checkpointing):
        # its own load_state_dict does not take what ChainedOptimizer.state_dict() returns.
        path = f"{directory}/layer_wise_{torch.distributed.get_rank()}.pt"
        optimizer.save_state_dict_to_file(path)
        torch.save({"model": chunks[0].state_dict(), "optimizer_file": path}, buffer)
        return buffer.getvalue()
    torch.save({"model": chunks[0].state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


@torch.no_grad()
def _load(chunks, optimizer, directory, fmt, saved):
    if fmt == "dist":
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(_sharded(chunks, optimizer, is_loading=True), directory)
        apply_loaded(chunks, optimizer, state)
        return
    state = torch.load(io.BytesIO(saved), weights_only=False)
    chunks[0].load_state_dict(state["model"])
    if "optimizer_file" in state:
        optimizer.load_state_dict_from_file(state["optimizer_file"])
    else:
        optimizer.load_state_dict(state["optimizer"])


def checkpoint_job(offload, fmt, directory, build_kw):
    import megatron_offload
    from tests.harness import models

    # No dropout: its random state is not part of these checkpoints, and a resumed run
    # must be the uninterrupted one bit for bit.
    build_kw = {
        **build_kw,
        "transformer_overrides": {"hidden_dropout": 0.0, "attention_dropout": 0.0},
    }
    directory = shared_directory(directory)
    out = {}
    chunks, optimizer, config = models.build("gpt", "bf16", **build_kw)
    offloader = megatron_offload.attach(optimizer) if offload else None
    results, saved = [], None
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if step == SAVE_AFTER - 1:
            out["offloaded_at_save"] = bool(offloader and offloader.is_offloaded)
            with DeviceWatch(offloader) as watch:
                saved = _save(chunks, optimizer, directory, fmt)
            if offloader:  # served from the host copy: nothing came back
                out["save"] = {**watch.figures(), "released_after": all_released(offloader)}
    out["uninterrupted"] = results
    out["uninterrupted_snapshot"] = offloaded_snapshot(chunks, optimizer, offloader)

    torch.manual_seed(99)  # a different init: everything must come from the checkpoint
    chunks, optimizer, config = models.build("gpt", "bf16", **build_kw)
    offloader = megatron_offload.attach(optimizer) if offload else None
    if offloader:
        offloader.offload()  # a restarted job: the masters are on the host before the load
        out["offloaded_before_load"] = offloader.is_offloaded
    with DeviceWatch(offloader) as watch:
        _load(chunks, optimizer, directory, fmt, saved)
    if offloader:
        # The states the load creates (this optimizer had none) are put on the host at once.
        out["load"] = {**watch.figures(), "released_after": all_released(offloader)}
    out["resumed"] = [
        models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER, STEPS)
    ]
    out["resumed_snapshot"] = offloaded_snapshot(chunks, optimizer, offloader)
    if offloader:
        stats = offloader.stats()
        out["all_offloaded"] = stats["offloaded_bytes"] == stats["tracked_bytes"] > 0
    torch.distributed.barrier()
    return out


CASES = [
    # id, build options, needs emerging-optimizers
    ("adam-float16", {"use_distributed_optimizer": False}, False),
    ("lion", {"optimizer": "lion", "use_distributed_optimizer": False}, True),
    ("muon", {"optimizer": "muon", "use_distributed_optimizer": False}, True),
    ("soap", {"optimizer": "soap", "use_distributed_optimizer": False}, True),
    ("muon-layer-wise", {"optimizer": "muon", "layer_wise": True}, True),
]


def _params():
    # megatron-core 0.19.2 cannot dist-checkpoint SOAP at all (test below).
    return [
        pytest.param(fmt, build_kw, id=f"{name}-{fmt}", marks=[NEEDS_EMERGING] if emerging else [])
        for fmt in ("dist", "torch")
        for name, build_kw, emerging in CASES
        if not (fmt == "dist" and name == "soap")
    ]


@pytest.mark.parametrize("fmt,build_kw", _params())
def test_checkpoint_while_offloaded_then_resume_is_bitwise(rank_pool, tmp_path, build_kw, fmt):
    reference = rank_pool.run(checkpoint_job, False, fmt, str(tmp_path / "ref"), build_kw)
    offloaded = rank_pool.run(checkpoint_job, True, fmt, str(tmp_path / "off"), build_kw)
    for ref, off in zip(reference, offloaded):
        assert off["offloaded_at_save"] and off["offloaded_before_load"] and off["all_offloaded"]
        assert off["save"]["peak_state_bytes"] == 0 and off["save"]["allocations"] == 0, off["save"]
        assert off["save"]["released_after"] and off["load"]["released_after"], (
            off["save"],
            off["load"],
        )
        assert off["load"]["peak_state_bytes"] == 0, off["load"]
        assert_phases_equal(ref, off, ("uninterrupted", "resumed"))
        assert off["resumed"] == off["uninterrupted"][SAVE_AFTER:]
        for section in ("params", "optimizer"):
            assert tensors_equal(
                off["uninterrupted_snapshot"][section], off["resumed_snapshot"][section]
            ), section


@NEEDS_EMERGING
def test_soap_dist_checkpoint_is_megatron_cores_own_refusal(rank_pool, tmp_path):
    """megatron-core 0.19.2's Float16OptimizerWithFloat16Params.sharded_state_dict asserts that
    every state tensor has its parameter's shape, which SOAP's preconditioners (L: [m, m],
    R: [n, n]) do not: the torch_dist save fails with and without offloading alike (the
    torch format above works)."""
    import tests.harness.rank_pool as pool_module

    build_kw = {"optimizer": "soap", "use_distributed_optimizer": False}
    messages = []
    for offload, name in ((False, "ref"), (True, "off")):
        with pytest.raises(pool_module.RankJobError) as raised:
            rank_pool.run(checkpoint_job, offload, "dist", str(tmp_path / name), build_kw)
        messages.append(raised.value.tracebacks[0].strip().splitlines()[-1])
    assert messages[0] == messages[1] and "does not match model shape" in messages[0]
