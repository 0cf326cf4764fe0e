"""``sleep()`` under CUDA graphs (on CPU ranks, through the model's config): every graph
setting of megatron-core keeps the parameter and gradient buffers at their addresses with their
bytes (graphs replay the addresses they captured), moves the optimizer states and masters,
warns once, and trains on bitwise; ``prefetch="gradients"`` under full-iteration graphs starts
the reload at the step (warned), and a backward-pass prefetch is refused under each setting."""

from __future__ import annotations

import warnings

import pytest

from tests.harness.compare import same_run
from tests.integration.offloader.test_sleep import _device_bytes

SETTINGS = (
    ("cuda_graph_impl", "local"),
    ("cuda_graph_impl", "transformer_engine"),
    ("cuda_graph_impl", "full_iteration"),
    ("enable_cuda_graph", True),
    ("external_cuda_graph", True),
)


def _buffers(chunks) -> list:
    return [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.clone())
        for chunk in chunks
        for buffer in chunk.buffers
        for t in (buffer.param_data, buffer.grad_data)
    ]


def graphs_job(mode: str):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    offloader = megatron_offload.attach(optimizer) if mode == "sleep" else None
    model_config = chunks[0].config
    results, cycles = [], []
    for step, (name, value) in enumerate(SETTINGS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if offloader is None:
            continue
        before = _buffers(chunks)
        saved = getattr(model_config, name)
        setattr(model_config, name, value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            offloader.sleep()
            asleep = _device_bytes(chunks, optimizer)
            during = _buffers(chunks)
            offloader.sleep()  # again: nothing more, no second warning
            offloader.wake()
        setattr(model_config, name, saved)
        kept = all(
            a[0] == b[0] and a[1] == b[1] and bool((a[2] == b[2]).all())
            for a, b in zip(before, during)
        )
        cycles.append(
            {"kept": kept, "asleep": asleep, "warnings": [str(w.message) for w in caught]}
        )
        offloader._sleep._graphs_said = False  # each setting's own warning
    results.append(models.train_step(chunks, optimizer, config, len(SETTINGS)))
    if offloader is not None:
        offloader.detach()
    return {"results": results, "cycles": cycles, "snapshot": models.snapshot(chunks, optimizer)}


def test_sleep_under_every_graph_setting_keeps_the_captured_buffers(rank_pool):
    references = rank_pool.run(graphs_job, "reference")
    runs = rank_pool.run(graphs_job, "sleep")
    for reference, run in zip(references, runs):
        assert same_run(reference, run)
        for (name, value), cycle in zip(SETTINGS, run["cycles"]):
            assert cycle["kept"], (name, value)
            assert cycle["asleep"]["states"] == cycle["asleep"]["masters"] == 0
            assert cycle["asleep"]["parameters"] and cycle["asleep"]["gradients"]
            (warning,) = [w for w in cycle["warnings"] if "CUDA graphs" in w]
            assert str(value) in warning and "stay on the device" in warning


def prefetch_job(name, value):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    setattr(chunks[0].config, name, value)
    found = {}
    try:
        megatron_offload.attach(optimizer, prefetch=0.5)
    except megatron_offload.OffloadArgumentError as error:
        found["fraction"] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloader = megatron_offload.attach(optimizer)
    found["warnings"] = [str(w.message) for w in caught]
    found["finalize_wrapped"] = hasattr(
        chunks[0].config.finalize_model_grads_func, "__wrapped_finalize__"
    )
    offloader.detach()
    return found


@pytest.mark.parametrize("name,value", SETTINGS)
def test_prefetch_points_under_each_graph_setting(rank_pool, name, value):
    for found in rank_pool.run(prefetch_job, name, value):
        assert "replay without calling" in found["fraction"], found
        full = value == "full_iteration"
        assert found["finalize_wrapped"] is not full
        assert any("inside the captured graph" in w for w in found["warnings"]) is full
