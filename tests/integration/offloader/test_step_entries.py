"""No entry point steps on stale bytes: whichever method steps the optimizer (the wrapper's
``step()``, ``step_with_ready_grads()``, the inner optimizer's own ``step()``), after any of
``offload()``, ``reload()``, reads and writes served from the host copy, ``resident()`` and a
checkpoint, the update is bitwise that of the plain run doing the same (a twin), with
attach's cycle (each prefetch point) and with a manual offloader. A step inside a host view is
refused before anything is written. Real megatron-core on gloo ranks (a touched released
tensor kills the rank: the test fails with its exit code)."""

from __future__ import annotations

import pytest
import torch

from tests.harness.compare import same_run

# What happens between two steps, one per iteration, in this order.
SEQUENCES = ("read", "write", "reload", "resident", "checkpoint", "offload twice")


class _Entry:
    """The training loop's view of the optimizer: ``step()`` goes through ``entry``."""

    def __init__(self, optimizer, entry: str) -> None:
        self._optimizer, self._entry = optimizer, entry

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def step(self):
        optimizer = self._optimizer
        if self._entry == "step":
            return optimizer.step()
        members = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        for member in members:
            member.prepare_grads()
        for member in members:
            if self._entry == "step_with_ready_grads":
                member.step_with_ready_grads()
            else:  # the inner optimizer's own step, as megatron-core's Lion test does
                member.optimizer.step()
                member._copy_main_params_to_model_params()
        return True, None, None


def _between_steps(sequence, optimizer, offloader):
    """``sequence`` on the optimizer; the plain run (``offloader`` None) does the same reads and
    writes on its device tensors."""
    from tests.harness import models

    inner = models.megatron_optimizers(optimizer)[0].optimizer
    param = inner.param_groups[0]["params"][0]
    if sequence == "read":
        return float(inner.state[param]["exp_avg"].sum())
    if sequence == "write":
        inner.state[param]["exp_avg"].add_(1e-3)  # served: written into the host copy
        return None
    if sequence == "checkpoint":
        return sorted(optimizer.state_dict())
    if sequence == "resident":
        if offloader is None:
            return float(inner.state[param]["exp_avg_sq"].sum())
        with offloader.resident(read_only=True):
            return float(inner.state[param]["exp_avg_sq"].sum())
    if offloader is None:
        return None
    if sequence == "reload":
        offloader.reload()  # no wait(): the step orders it
    elif sequence == "offload twice":
        offloader.offload()
        offloader.offload()
    return None


def entry_job(mode: str, entry: str):
    """``mode``: "reference" (no offloader), "manual" (an offloader without attach's cycle),
    or attach's cycle with ``prefetch`` "step" or "gradients"."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    results = [models.train_step(chunks, optimizer, config, 0)]
    offloader = None
    if mode == "manual":
        offloader = megatron_offload.OptimizerStateOffloader(optimizer)
    elif mode != "reference":
        offloader = megatron_offload.attach(optimizer, prefetch=mode)
    seen = []
    for step, sequence in enumerate(SEQUENCES, start=1):
        if offloader is not None:
            offloader.offload()
        seen.append(_between_steps(sequence, optimizer, offloader))
        results.append(models.train_step(chunks, _Entry(optimizer, entry), config, step))
    if offloader is not None:
        offloader.detach()
    return {"results": results, "seen": seen, "snapshot": models.snapshot(chunks, optimizer)}


ENTRIES = ("step", "step_with_ready_grads", "inner step")


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_point_after_every_sequence_is_bitwise_the_plain_run(rank_pool, entry):
    references = rank_pool.run(entry_job, "reference", entry)
    for mode in ("step", "gradients", "manual"):
        runs = rank_pool.run(entry_job, mode, entry)
        for reference, run in zip(references, runs):
            assert run["seen"] == reference["seen"], (mode, run["seen"], reference["seen"])
            assert same_run(reference, run), mode


def _state_bytes(wrapper) -> list[bytes]:
    return [
        bytes(value.view(torch.uint8).clone().numpy())
        for state in dict.values(wrapper.optimizer.state)
        for value in dict.values(state)
        if isinstance(value, torch.Tensor) and value.numel() > 1
    ]


def host_view_step_job():
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    models.train_step(chunks, optimizer, config, 0)
    before = {
        key: value.clone() for key, value in models.snapshot(chunks, optimizer)["params"].items()
    }
    offloader = megatron_offload.attach(optimizer)  # the states exist: offloaded at once
    wrapper = models.megatron_optimizers(optimizer)[0]
    with offloader.host_view():
        try:
            wrapper.optimizer.step()
            raised = None
        except megatron_offload.OffloadStateError as error:
            raised = str(error)
        states = _state_bytes(wrapper)
    offloader.reload()
    offloader.wait()
    with offloader.host_view():
        after = _state_bytes(wrapper)
    offloader.detach()
    params = models.snapshot(chunks, optimizer)["params"]
    unchanged = all(torch.equal(before[key], value) for key, value in params.items())
    return {"raised": raised, "states_unchanged": states == after, "params_unchanged": unchanged}


def test_a_step_inside_a_host_view_is_refused_before_anything_is_written(rank_pool):
    for found in rank_pool.run(host_view_step_job):
        assert found["raised"] and "inside host_view()" in found["raised"], found
        assert found["states_unchanged"] and found["params_unchanged"]
