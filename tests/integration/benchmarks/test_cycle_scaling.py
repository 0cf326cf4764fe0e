"""What one offload cycle of the real offloader touches, on megatron-core's optimizers on the gloo ranks: the same for ten times the parameters, and a real step's master gradients released."""

from __future__ import annotations

import pytest


# ---------------------------------------------------------------- the real optimizer
def per_cycle_job(cfg: dict) -> list[dict]:
    """Attach to tiny MLPs of each size in ``cfg["layers"]``; count what a cycle touches."""
    import torch

    import megatron_offload
    from megatron_offload.offloader.members import megatron_optimizers as distributed_optimizers
    from tests.harness import models

    class Counting(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    class CountingDict(dict):
        touches = 0

        def _touch(self):
            CountingDict.touches += 1

        def __len__(self):
            self._touch()
            return super().__len__()

        def __iter__(self):
            self._touch()
            return super().__iter__()

        def keys(self):
            self._touch()
            return super().keys()

        def values(self):
            self._touch()
            return super().values()

        def items(self):
            self._touch()
            return super().items()

    out = []
    for layers in cfg["layers"]:
        chunks, optimizer, _config = models.build(
            model="mlp", dtype="bf16", num_layers=layers, hidden=8
        )
        distributed = distributed_optimizers(optimizer)
        masters = [
            m
            for d in distributed
            for g in d.shard_fp32_from_float16_groups
            for m in g
            if m is not None
        ]
        offloader = megatron_offload.attach(optimizer)
        in_step = []
        handles = [
            d.optimizer.register_step_post_hook(
                lambda *_: in_step.append(sum(m.grad is not None for m in masters))
            )
            for d in distributed
        ]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.step()  # Adam's states appear; the automatic offload follows
        grads_after_step = sum(m.grad is not None for m in masters)
        for handle in handles:
            handle.remove()

        def cycle():
            offloader.reload()
            offloader.wait()
            offloader.offload()

        cycle()  # consolidates
        offloader.reload()
        offloader.wait()
        for d in distributed:  # the same entries, in dicts that count how often they are read
            state = d.optimizer.state
            for param in list(dict.keys(state)):
                dict.__setitem__(state, param, CountingDict(dict.__getitem__(state, param)))
        cycle()
        calls, touches = [], []
        for _ in range(3):
            CountingDict.touches = 0
            with Counting() as mode:
                cycle()
            calls.append(mode.calls)
            touches.append(CountingDict.touches)
        stats = offloader.stats()
        out.append(
            {
                "layers": layers,
                "masters": len(masters),
                "grads_in_step": in_step,
                "grads_after_step": grads_after_step,
                "torch_calls": calls,
                "dict_touches": touches,
                "tensors": stats["tensors"],
                "copies": (stats["d2h_copies"], stats["h2d_copies"]),
                "offloaded": offloader.is_offloaded,
            }
        )
        offloader.detach()
    # Negative control: without the release, the step's gradients stay (as large as the masters).
    chunks, optimizer, _config = models.build(
        model="mlp", dtype="bf16", num_layers=cfg["layers"][0], hidden=8
    )
    masters = [
        m
        for d in distributed_optimizers(optimizer)
        for g in d.shard_fp32_from_float16_groups
        for m in g
    ]
    offloader = megatron_offload.attach(optimizer, release_master_grads=False)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()
    out[0]["grads_after_step_without_release"] = sum(m.grad is not None for m in masters)
    offloader.detach()
    return out


@pytest.fixture(scope="module")
def per_cycle(rank_pool):
    """100 and 1,000 parameter tensors, every rank holding a shard of each (tp = world)."""
    return rank_pool.run(per_cycle_job, {"layers": [25, 250]}, tp=rank_pool.world_size)


def test_offloader_cycle_touches_the_same_for_ten_times_the_parameters(per_cycle):
    for rank, (small, large) in enumerate(per_cycle):
        assert large["tensors"] == 10 * small["tensors"] > 0, (rank, small, large)
        assert small["offloaded"] and large["offloaded"]
        assert small["copies"] == large["copies"]
        assert small["torch_calls"] == large["torch_calls"], (rank, small, large)
        assert small["dict_touches"] == large["dict_touches"] == [0, 0, 0], (rank, small, large)


def test_a_real_steps_master_grads_are_released_by_the_offload(per_cycle):
    for rank, runs in enumerate(per_cycle):
        for run in runs:
            # megatron-core gave every master an fp32 gradient for the step ...
            assert run["grads_in_step"] and all(
                n == run["masters"] > 0 for n in run["grads_in_step"]
            ), (rank, run)
            # ... and the automatic offload after it freed them all.
            assert run["grads_after_step"] == 0, (rank, run)
        assert (
            runs[0]["grads_after_step_without_release"] == runs[0]["masters"]
        )  # (they do not go by themselves)
