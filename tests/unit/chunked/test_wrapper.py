"""The chunked update's wrapper of an inner optimizer's ``step``, on a plain torch AdamW.

What the megatron-core cases do not reach: a step with a closure, a step with every state
on the device, an optimizer that replaces its state tensors during the update, a refusal
half-way through attaching, and an inner optimizer that already had its own ``step``.
Everything that could touch released memory runs in the isolated process.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_offload.adapters import megatron_wrappers as adapter
from megatron_offload.chunked.update import ChunkedUpdate
from megatron_offload.config import OffloadConfig
from megatron_offload.device.cpu import CPUDevice
from megatron_offload.engine import OffloadEngine, OffloadStateError
from megatron_offload.interceptions import Interceptions
from megatron_offload.offloader.cycle import AutomaticCycle
from megatron_offload.offloader.members import Member
from megatron_offload.phase import Phase
from tests.harness.adamw_model import seeded_grads


def _optimizer(cls=torch.optim.AdamW, sizes=(30, 20, 10), seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    return params, cls(params, lr=0.01)


def _attached(opt, budget=2 * 2 * 128):  # two slots of the largest parameter's moments
    distrib = types.SimpleNamespace(optimizer=opt)
    engine = OffloadEngine(
        CPUDevice(), lambda: adapter.collect(distrib), streamed=lambda: adapter.in_state(distrib)
    )
    chunked = ChunkedUpdate(
        engine, distrib, total_bytes=budget, slots=2, kinds=("optimizer_states",)
    )
    chunked.install()
    return engine, chunked


def run_paths():
    params, opt = _optimizer()
    ref_params, ref = _optimizer()
    engine, chunked = _attached(opt)
    out = {}
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    for step in range(3):
        seeded_grads(params, step)
        seeded_grads(ref_params, step)
        ref.step()
        calls.clear()
        token = chunked.phase.enter(Phase.STEPPING)
        if step == 1:
            # Every state back on the device (an RL phase, a user's reload): one whole step.
            engine.reload()
            engine.wait()
            opt.step()
            out["resident_calls"] = len(calls)
        elif step == 2:
            # A closure is the caller's business: the step runs whole, states reloaded.
            engine.reload()
            engine.wait()
            out["closure_result"] = opt.step(lambda: 7.0)
            out["closure_calls"] = len(calls)
        else:
            opt.step()
            out["creation_calls"] = len(calls)
        chunked.phase.leave(token)
        engine.offload()
        engine.release()
    engine.reload()
    engine.wait()
    out["bitwise"] = all(torch.equal(a, b) for a, b in zip(params, ref_params)) and all(
        torch.equal(opt.state[a][k], ref.state[b][k])
        for a, b in zip(params, ref_params)
        for k in ("exp_avg", "exp_avg_sq")
    )
    chunked.remove()
    out["step_restored"] = "step" not in vars(opt)
    return out


def test_closure_and_resident_steps_run_whole(isolated):
    out = isolated.run(run_paths)
    assert out["creation_calls"] == 3  # the first step: one call per parameter
    assert out["resident_calls"] == 1 and out["closure_calls"] == 1
    assert out["closure_result"] == 7.0
    assert out["bitwise"] and out["step_restored"]


class _Replacing(torch.optim.AdamW):
    """An optimizer that puts new tensor objects into its state during step() (as SOAP
    does); ``cast`` replaces them with another dtype, which cannot take the slot's place."""

    cast = None

    def step(self, closure=None):
        result = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                new = self.state[p]["exp_avg"].clone()
                late = float(self.state[p]["step"]) > 1  # after the states were created
                self.state[p]["exp_avg"] = (
                    new.to(self.cast) if self.cast is not None and late else new
                )
        return result


class _ReplacingWithAnotherDtype(_Replacing):
    cast = torch.float16


def run_replacing(cls, steps=3):
    params, opt = _optimizer(cls)
    engine, chunked = _attached(opt)
    for step in range(steps):
        seeded_grads(params, step)
        token = chunked.phase.enter(Phase.STEPPING)
        try:
            opt.step()
        except OffloadStateError as exc:
            return str(exc), all(
                opt.state[p]["exp_avg"].untyped_storage().nbytes() == 0 for p in params
            )
        finally:
            chunked.phase.leave(token)
        engine.offload()
        engine.release()
    engine.reload()
    engine.wait()
    return None, [p.detach().clone() for p in params]


def run_plain(steps=3):
    params, opt = _optimizer()
    for step in range(steps):
        seeded_grads(params, step)
        opt.step()
    return [p.detach().clone() for p in params]


def test_a_replacement_like_the_state_is_copied_into_the_slot(isolated):
    """SOAP's way: new tensors of the same shape and dtype each step; their values go into
    the slot, and the update is bitwise that of the plain optimizer."""
    message, params = isolated.run(run_replacing, _Replacing)
    assert message is None
    assert all(torch.equal(a, b) for a, b in zip(params, isolated.run(run_plain)))


def test_an_optimizer_replacing_its_states_is_refused(isolated):
    message, restored = isolated.run(run_replacing, _ReplacingWithAnotherDtype)
    assert "replaced its state tensors (exp_avg)" in message
    assert "leave chunked_update_bytes unset" in message
    assert restored  # the state entries point at the tracked (released) tensors again


def test_a_refusal_half_way_through_attaching_unwraps_every_optimizer():
    _, small = _optimizer(sizes=(10,))
    _, large = _optimizer(sizes=(10_000,))
    own_step = small.step
    small.step = own_step  # an instance attribute of its own, to be kept
    kinds = OffloadConfig().kinds()
    members = [
        Member(index, types.SimpleNamespace(optimizer=opt), OffloadEngine(CPUDevice(), list), kinds)
        for index, opt in enumerate((small, large))
    ]
    offloader = types.SimpleNamespace(
        members=members,
        engines=[member.engine for member in members],
        phase=None,
        config=OffloadConfig(chunked_update_bytes=4096),
        interceptions=Interceptions(),
    )
    with pytest.raises(ValueError, match="give at least 160,000 bytes"):
        AutomaticCycle(offloader)
    assert vars(small)["step"] is own_step  # the first wrapper was removed again
    assert "step" not in vars(large)
    assert offloader.interceptions.listing() == []


def run_cached_layout():
    params, opt = _optimizer()
    engine, chunked = _attached(opt)
    plans = []
    plan = chunked.stream.plan
    chunked.stream.plan = lambda *a, **k: plans.append(1) or plan(*a, **k)
    counts = []
    for step in range(5):
        seeded_grads(params, step)
        if step == 3:
            engine.reload()  # the user brings everything back: the layout key changes
            engine.wait()
        with chunked.phase.within(Phase.STEPPING):
            opt.step()
        engine.offload()
        engine.release()
        counts.append(len(plans))
    return counts


def test_the_chunk_layout_is_worked_out_only_when_something_changed(isolated):
    """Steady steps reuse the classification and the plan (Python work per step stays
    small); a first step, new states and a changed residency each work it out again."""
    counts = isolated.run(run_cached_layout)
    # step 0: no states (planned once, nothing streamed); step 1: states on the host now
    # (planned again); step 2: cached; step 3: resident (planned); step 4: released again.
    assert counts == [1, 2, 2, 3, 4]
